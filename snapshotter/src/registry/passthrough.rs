//! Requests passed on to a registry with the client's own authorization, as a mirror passes
//! them: none of this node's logins is added, and whatever the registry answers (a 401 and its
//! challenge, a 404) goes back as it is, so that the client pulls only what it could pull from
//! the registry itself.

use super::RegistryError;
use super::client::{Registry, origin};
use super::reference::ImageRef;
use reqwest::Method;
use reqwest::header::{ACCEPT, AUTHORIZATION, HeaderValue, RANGE};

impl Registry {
    /// `method` `/v2/<repository><path>` of `image`, at the first pull endpoint that answers
    /// (mirrors of this node's hosts.toml first, never this node's own), with `authorization`,
    /// `range` and `accept` as the client sent them.
    pub async fn pass_on_with(
        &self,
        image: &ImageRef,
        path: &str,
        method: Method,
        authorization: Option<&HeaderValue>,
        range: Option<&HeaderValue>,
        accept: Option<&HeaderValue>,
    ) -> Result<reqwest::Response, RegistryError> {
        let endpoints = self.inner.hosts.endpoints(&image.host)?;
        let mut last = None;
        for ep in endpoints.iter().filter(|e| e.pull && !self.skips(e)) {
            let client = self.client_for(ep)?;
            let url = format!("{}/{}{path}", ep.base, image.repository);
            let mut req = client.request(method.clone(), &url);
            for (name, value) in &ep.headers {
                req = req.header(name, value);
            }
            if let Some(a) = authorization {
                req = req.header(AUTHORIZATION, a);
            }
            if let Some(r) = range {
                req = req.header(RANGE, r);
            }
            if let Some(a) = accept {
                req = req.header(ACCEPT, a);
            }
            match req.send().await {
                // A mirror's failure is its own: the next endpoint (the registry) is asked.
                Ok(resp) if resp.status().is_server_error() && ep.base != endpoints[endpoints.len() - 1].base => {
                    tracing::debug!(endpoint = %origin(&ep.base), status = %resp.status(), "a mirror failed a passed-on request; asking the next");
                }
                Ok(resp) => return Ok(resp),
                Err(source) => last = Some(RegistryError::Http { url, source }),
            }
        }
        Err(last.unwrap_or_else(|| RegistryError::Config {
            path: "hosts.toml".into(),
            reason: format!("no endpoint of {} may pull", image.host),
        }))
    }
}
