//! Counting every HTTP request sent to the object store, by method and by how it ended. An S3
//! store bills, and an RGW cluster is sized, by requests; a client's retries and each page of a
//! listing are requests too, so they are counted where they are sent, below `object_store`'s
//! retry loop, not per operation above it.

use async_trait::async_trait;
use object_store::ClientOptions;
use object_store::client::{
    HttpClient, HttpConnector, HttpError, HttpRequest, HttpResponse, HttpService, ReqwestConnector,
};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

/// One request to the object store and how it ended.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabel {
    /// `GET`, `HEAD`, `PUT`, `POST` or `DELETE`.
    pub method: String,
    /// `2xx`, `3xx`, `4xx`, `5xx`, or `error` when no answer came (refused, reset, timed out).
    pub status: &'static str,
}

/// Requests sent, shared by every client of one store.
pub type RequestCounts = Family<RequestLabel, Counter>;

/// Connects clients whose every request is counted in `counts`.
#[derive(Debug)]
pub(crate) struct CountingConnector {
    pub(crate) counts: RequestCounts,
}

impl HttpConnector for CountingConnector {
    fn connect(&self, options: &ClientOptions) -> object_store::Result<HttpClient> {
        let inner = ReqwestConnector::default().connect(options)?;
        Ok(HttpClient::new(Counting { inner, counts: self.counts.clone() }))
    }
}

#[derive(Debug)]
struct Counting {
    inner: HttpClient,
    counts: RequestCounts,
}

#[async_trait]
impl HttpService for Counting {
    async fn call(&self, req: HttpRequest) -> Result<HttpResponse, HttpError> {
        let method = req.method().as_str().to_string();
        let answer = self.inner.execute(req).await;
        let status = match &answer {
            Ok(r) => class(r.status().as_u16()),
            Err(_) => "error",
        };
        self.counts.get_or_create(&RequestLabel { method, status }).inc();
        answer
    }
}

fn class(code: u16) -> &'static str {
    match code {
        200..=299 => "2xx",
        300..=399 => "3xx",
        400..=499 => "4xx",
        _ => "5xx",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_are_counted_by_class() {
        assert_eq!([200, 206, 304, 404, 412, 503].map(class), ["2xx", "2xx", "3xx", "4xx", "4xx", "5xx"]);
    }
}
