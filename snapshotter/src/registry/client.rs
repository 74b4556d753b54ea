//! Talking to registries: manifests (resolving a multi-platform index to this platform), blob
//! sizes, and ranged blob reads. Each request goes to the host's endpoints in order (mirrors,
//! then the upstream), answering a 401 with the token or basic login the challenge asks for.

use super::RegistryError;
use super::auth::{Challenge, Credentials, Login, fetch_token, parse_challenge};
use super::hosts::{Endpoint, Hosts};
use super::keychain::Keychain;
use super::range_stream::{RangeStream, Resume, collect, collect_seen, ended_early};
use super::reference::ImageRef;
use bytes::Bytes;
use reqwest::header::{ACCEPT, AUTHORIZATION, CONTENT_LENGTH, CONTENT_RANGE, RANGE, WWW_AUTHENTICATE};
use reqwest::{Method, StatusCode};
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MANIFEST_TYPES: &str = "application/vnd.oci.image.index.v1+json, \
    application/vnd.oci.image.manifest.v1+json, \
    application/vnd.docker.distribution.manifest.list.v2+json, \
    application/vnd.docker.distribution.manifest.v2+json";

/// The most bytes of a manifest Strata reads: real ones are a few KiB.
const MANIFEST_LIMIT: usize = 4 << 20;
/// An image config is read whole into memory; real ones are a few KiB.
const CONFIG_LIMIT: u64 = 1 << 20;

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ManifestLayer {
    #[serde(default)]
    pub media_type: String,
    pub digest: String,
    pub size: u64,
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
}

/// An image manifest for one platform.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Manifest {
    pub digest: String,
    pub config_digest: String,
    pub config_size: u64,
    pub layers: Vec<ManifestLayer>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawManifest {
    #[serde(default)]
    media_type: String,
    config: Option<RawDescriptor>,
    #[serde(default)]
    layers: Vec<ManifestLayer>,
    #[serde(default)]
    manifests: Vec<RawPlatformManifest>,
}

#[derive(Deserialize)]
struct RawDescriptor {
    digest: String,
    #[serde(default)]
    size: u64,
}

#[derive(Deserialize)]
struct RawPlatformManifest {
    digest: String,
    platform: Option<RawPlatform>,
}

#[derive(Deserialize)]
struct RawPlatform {
    architecture: String,
    os: String,
}

type TlsKey = (bool, Vec<PathBuf>, Option<(PathBuf, Option<PathBuf>)>, Vec<Option<std::time::SystemTime>>);

/// What an endpoint must be able to do for a request: its `hosts.toml` capability.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    Pull,
    Resolve,
    Push,
}

/// A registry client for every host, with the node's `hosts.toml` and logins. Clones share
/// everything: connections, tokens, logins.
#[derive(Debug, Clone)]
pub struct Registry {
    pub(super) inner: Arc<Inner>,
}

#[derive(Debug)]
pub(super) struct Inner {
    pub(super) hosts: Hosts,
    /// Read again when its file changes, at the next challenge.
    credentials: Mutex<Credentials>,
    /// Logins kubelet passed with CRI pulls, which win over `credentials`, as in containerd.
    keychain: Arc<Keychain>,
    /// The answers of the credential helpers `credentials` names.
    helpers: super::helper::Helpers,
    /// One HTTP client per TLS setting in use (skip_verify, extra CAs, client certificate),
    /// each with its own pool.
    clients: Mutex<HashMap<TlsKey, reqwest::Client>>,
    /// Authorization headers that worked, by endpoint base and repository.
    auth: Mutex<HashMap<(String, String), String>>,
    /// Endpoints that failed for a passing reason, by base, and until when they are asked
    /// after the others.
    down: Mutex<HashMap<String, Instant>>,
    /// Origins (`scheme://host:port`) never asked: this node's own registry mirror, which a
    /// hosts.toml shared with containerd names, and which would otherwise ask itself.
    pub(super) skip: Mutex<Vec<String>>,
}

/// The logins to try for one host, each found only when the ones before it were refused: a
/// CRI pull's for the repository, then the credential helper's that config.json names for the
/// host, then config.json's own, then, with none of them, an anonymous token. A mirror has its
/// own, and is never sent the upstream registry's, as containerd picks them. The helper, a
/// program that may take seconds, is run only when no CRI login is left to try.
struct Tries<'a> {
    helpers: &'a super::helper::Helpers,
    host: &'a str,
    queue: std::collections::VecDeque<(Login, &'static str)>,
    /// The helper's name and config.json's login, until they are needed.
    later: Option<(Option<String>, Option<Login>)>,
    tried: Vec<Login>,
    anonymous: bool,
}

impl Tries<'_> {
    /// The next login (`Some(None)` is anonymous), or `None` when all were tried.
    async fn next(&mut self) -> Option<Option<(Login, &'static str)>> {
        loop {
            if let Some((login, from)) = self.queue.pop_front() {
                if !self.tried.contains(&login) {
                    self.tried.push(login.clone());
                    return Some(Some((login, from)));
                }
                continue;
            }
            if let Some((helper, file)) = self.later.take() {
                if let Some(name) = helper
                    && let Some(l) = self.helpers.login(&name, self.host).await
                {
                    self.queue.push_back((l, "docker config.json's credential helper"));
                }
                if let Some(l) = file {
                    self.queue.push_back((l, "docker config.json"));
                }
                continue;
            }
            if self.tried.is_empty() && !self.anonymous {
                self.anonymous = true;
                return Some(None);
            }
            return None;
        }
    }
}

/// The OCI architecture name of this machine.
fn this_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "powerpc64" => "ppc64le",
        other => other,
    }
}

impl Registry {
    pub fn new(hosts: Hosts, credentials: Credentials) -> Registry {
        // The client most endpoints use is made now: building one loads the system's trust
        // roots, which took 25 ms of a layer's first request when it was left to then. If it
        // fails, the first request that needs it reports why.
        let clients = build_client(false, Vec::new(), None)
            .map(|c| ((false, Vec::new(), None, Vec::new()), c))
            .into_iter()
            .collect();
        Registry {
            inner: Arc::new(Inner {
                hosts,
                credentials: Mutex::new(credentials),
                keychain: Arc::default(),
                helpers: Default::default(),
                clients: Mutex::new(clients),
                auth: Mutex::new(HashMap::new()),
                down: Mutex::new(HashMap::new()),
                skip: Mutex::default(),
            }),
        }
    }

    /// Never asks the endpoint at `origin` (`scheme://host:port`): this node's own mirror.
    pub fn skip_origin(&self, origin: impl Into<String>) {
        self.inner.skip.lock().unwrap_or_else(|p| p.into_inner()).push(origin.into());
    }

    pub(super) fn skips(&self, ep: &Endpoint) -> bool {
        let o = origin(&ep.base);
        self.inner.skip.lock().unwrap_or_else(|p| p.into_inner()).iter().any(|s| s == o)
    }

    /// Where the image service proxy keeps the logins of CRI pulls for this client.
    pub fn keychain(&self) -> Arc<Keychain> {
        self.inner.keychain.clone()
    }

    /// This registry, with its credential helpers' programs in `dir`, not on PATH.
    #[cfg(test)]
    fn with_helpers_in(mut self, dir: &std::path::Path) -> Registry {
        Arc::get_mut(&mut self.inner).expect("a registry not yet shared").helpers = super::helper::Helpers::in_dir(dir);
        self
    }

    /// The logins to send `host` for `image`, in the order to try them (see [`Tries`]).
    fn logins<'a>(&'a self, image: &ImageRef, host: &'a str) -> Tries<'a> {
        let mut queue = std::collections::VecDeque::new();
        if let Some(l) = self.inner.keychain.login(image, host) {
            queue.push_back((l, "the login kubelet passed with the image's CRI pull"));
        }
        let mut credentials = self.inner.credentials.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(fresh) = credentials.reloaded() {
            *credentials = fresh;
        }
        let later = (credentials.helper(host).map(str::to_owned), credentials.login(host).cloned());
        Tries { helpers: &self.inner.helpers, host, queue, later: Some(later), tried: Vec::new(), anonymous: false }
    }

    /// The client for `ep`'s TLS settings. Its CA files are read when first needed, so a bad
    /// one fails the reads of that host with the file's name, not the whole daemon.
    pub(super) fn client_for(&self, ep: &Endpoint) -> Result<reqwest::Client, RegistryError> {
        // The files' times are part of the key: a certificate renewed in place (cert-manager,
        // a CA rotated) is read again, as containerd reads them at each pull.
        let files = ep.ca.iter().chain(ep.client.iter().flat_map(|(c, k)| std::iter::once(c).chain(k)));
        let stamps = files.map(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok()).collect();
        let key = (ep.skip_verify, ep.ca.clone(), ep.client.clone(), stamps);
        let mut clients = self.inner.clients.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = clients.get(&key) {
            return Ok(c.clone());
        }
        let mut roots = Vec::new();
        for path in &ep.ca {
            let err = |reason: String| RegistryError::Config { path: path.display().to_string(), reason };
            let pem = std::fs::read(path).map_err(|e| err(format!("the CA file of {}: {e}", ep.base)))?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem)
                .map_err(|e| err(format!("the CA file of {} holds no usable PEM certificate: {e}", ep.base)))?;
            if certs.is_empty() {
                return Err(err(format!("the CA file of {} holds no PEM certificate", ep.base)));
            }
            roots.extend(certs);
        }
        let identity = match &ep.client {
            None => None,
            Some((cert, key)) => {
                let err =
                    |path: &PathBuf, reason: String| RegistryError::Config { path: path.display().to_string(), reason };
                let mut pem = std::fs::read(cert)
                    .map_err(|e| err(cert, format!("the client certificate of {}: {e}", ep.base)))?;
                if let Some(key) = key {
                    pem.push(b'\n');
                    pem.extend(
                        std::fs::read(key).map_err(|e| err(key, format!("the client key of {}: {e}", ep.base)))?,
                    );
                }
                Some(reqwest::Identity::from_pem(&pem).map_err(|e| {
                    err(cert, format!("the client certificate and key of {} are not a usable PEM pair: {e}", ep.base))
                })?)
            }
        };
        let client = build_client(ep.skip_verify, roots, identity).map_err(|e| RegistryError::Config {
            path: "hosts.toml".into(),
            reason: format!("an HTTP client for {}: {}", ep.base, super::with_causes(&e)),
        })?;
        clients.insert(key, client.clone());
        Ok(client)
    }

    /// The manifest of `image` for this platform: an index is resolved to the entry for
    /// linux and this architecture. Content fetched by digest is checked against it.
    pub async fn manifest(&self, image: &ImageRef) -> Result<Manifest, RegistryError> {
        self.manifest_at(image, image.object()).await
    }

    /// As [`Registry::manifest`], for `object` (a tag, or a digest that the content is checked
    /// against) of `image`'s repository.
    pub async fn manifest_at(&self, image: &ImageRef, object: &str) -> Result<Manifest, RegistryError> {
        let (body, digest) = self.manifest_bytes(image, object).await?;
        let chosen = match decode_manifest(image, &body, digest)? {
            Decoded::Image(m) => return Ok(m),
            Decoded::Index { chosen } => chosen,
        };
        let (body, digest) = self.manifest_bytes(image, &chosen).await?;
        match decode_manifest(image, &body, digest)? {
            Decoded::Image(m) => Ok(m),
            Decoded::Index { .. } => Err(RegistryError::Manifest {
                reference: image.to_string(),
                reason: format!("the index names {chosen} for linux/{}, which is an index too", this_arch()),
            }),
        }
    }

    /// The image's config (for this platform), checked against its digest: from `manifest` (a
    /// digest) if given, else from the manifest `image` names.
    pub async fn config(&self, image: &ImageRef, manifest: Option<&str>) -> Result<Bytes, RegistryError> {
        let m = self.manifest_at(image, manifest.unwrap_or(image.object())).await?;
        check_config_ref(image, &m)?;
        self.small_blob(image, &m.config_digest, m.config_size).await
    }

    /// Blob `digest` of `size` bytes (at most 1 MiB: a config), checked against its digest.
    pub async fn small_blob(&self, image: &ImageRef, digest: &str, size: u64) -> Result<Bytes, RegistryError> {
        if size > CONFIG_LIMIT {
            return Err(RegistryError::Manifest {
                reference: image.to_string(),
                reason: format!("blob {digest} of {size} bytes is over the 1 MiB a config may have"),
            });
        }
        let body = self.blob_range(image, digest, 0..size).await?;
        let actual = crate::estargz::sha256_digest(&body);
        if actual != digest {
            return Err(RegistryError::Manifest {
                reference: image.to_string(),
                reason: format!("blob {digest} hashes to {actual}"),
            });
        }
        Ok(body)
    }

    /// The manifest or index `object` (a tag or a digest) of `image`'s repository, as stored,
    /// with its digest; content asked for by digest is checked against it.
    pub async fn manifest_raw(&self, image: &ImageRef, object: &str) -> Result<(Bytes, String), RegistryError> {
        self.manifest_bytes(image, object).await
    }

    async fn manifest_bytes(&self, image: &ImageRef, object: &str) -> Result<(Bytes, String), RegistryError> {
        let by_digest = object.contains(':');
        let path = format!("/manifests/{object}");
        let resp = self
            .send(
                image,
                &path,
                Method::GET,
                |r| r.header(ACCEPT, MANIFEST_TYPES),
                if by_digest { Need::Pull } else { Need::Resolve },
            )
            .await?;
        let url = resp.url().to_string();
        let body = resp.bytes().await.map_err(|source| RegistryError::Http { url: url.clone(), source })?;
        if body.len() > MANIFEST_LIMIT {
            return Err(RegistryError::Manifest { reference: image.to_string(), reason: "larger than 4 MiB".into() });
        }
        let digest = crate::estargz::sha256_digest(&body);
        if by_digest && object != digest {
            return Err(RegistryError::Manifest {
                reference: image.to_string(),
                reason: format!("asked for {object}, got content hashing to {digest}"),
            });
        }
        Ok((body, digest))
    }

    /// Whether this node's logins may read manifest `digest` of `image`'s repository: a HEAD,
    /// before its bytes are taken from peers.
    pub async fn may_read_manifest(&self, image: &ImageRef, digest: &str) -> Result<(), RegistryError> {
        let accept = |r: reqwest::RequestBuilder| r.header(ACCEPT, MANIFEST_TYPES);
        self.send(image, &format!("/manifests/{digest}"), Method::HEAD, accept, Need::Pull).await.map(drop)
    }

    /// The digest tag `tag` of `image`'s repository names now: from a HEAD's
    /// `Docker-Content-Digest`, else from the manifest's bytes.
    pub async fn resolve_tag(&self, image: &ImageRef, tag: &str) -> Result<String, RegistryError> {
        let accept = |r: reqwest::RequestBuilder| r.header(ACCEPT, MANIFEST_TYPES);
        let resp = self.send(image, &format!("/manifests/{tag}"), Method::HEAD, accept, Need::Resolve).await?;
        let said = resp.headers().get("docker-content-digest").and_then(|v| v.to_str().ok());
        match said.filter(|d| crate::estargz::is_sha256_digest(d)) {
            Some(d) => Ok(d.to_owned()),
            None => Ok(self.manifest_bytes(image, tag).await?.1),
        }
    }

    /// The size of blob `digest` of `image`'s repository.
    pub async fn blob_size(&self, image: &ImageRef, digest: &str) -> Result<u64, RegistryError> {
        let resp = self.send(image, &format!("/blobs/{digest}"), Method::HEAD, |r| r, Need::Pull).await?;
        resp.headers().get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse().ok()).ok_or_else(|| {
            RegistryError::Status {
                url: resp.url().to_string(),
                status: resp.status().as_u16(),
                detail: " without a Content-Length".into(),
            }
        })
    }

    /// The last `len` bytes of blob `digest` (all of it, if it is shorter), and the blob's
    /// size, in one round trip: a suffix range, whose answer names the size. A server that
    /// will not answer a suffix range costs a HEAD and an ordinary range instead. `observe`
    /// sees the bytes as they arrive, in order.
    pub async fn blob_tail(
        &self,
        image: &ImageRef,
        digest: &str,
        len: u64,
        mut observe: impl FnMut(&[u8]) + Send,
    ) -> Result<(Bytes, u64), RegistryError> {
        let (resp, url, tail) =
            self.end_of_blob(image, digest, &format!("bytes=-{len}"), |start, size| size - start <= len).await?;
        // Else the whole blob, if it is shorter than what was asked for.
        let tail = tail.or_else(|| match resp.status() {
            StatusCode::OK => resp.content_length().filter(|n| *n <= len).map(|n| (0, n)),
            _ => None,
        });
        let Some((start, size)) = tail else {
            drop(resp);
            let size = self.blob_size(image, digest).await?;
            let start = size.saturating_sub(len);
            let tail = self.blob_range(image, digest, start..size).await?;
            observe(&tail);
            return Ok((tail, size));
        };
        collect_seen(RangeStream::new(resp, url, start..size), observe).await.map(|body| (body, size))
    }

    /// Blob `digest` from byte `start` to its end, and the blob's size, in one round trip (an
    /// open-ended range); an error if that is more than `limit` bytes or the server will not
    /// answer such a range.
    pub async fn blob_from(
        &self,
        image: &ImageRef,
        digest: &str,
        start: u64,
        limit: u64,
    ) -> Result<(Bytes, u64), RegistryError> {
        let (resp, url, got) = self
            .end_of_blob(image, digest, &format!("bytes={start}-"), |s, size| s == start && size - s <= limit)
            .await?;
        match got {
            Some((start, size)) => collect(RangeStream::new(resp, url, start..size)).await.map(|body| (body, size)),
            None => {
                Err(RegistryError::Blob { url, reason: format!("asked for bytes {start}- and got {}", resp.status()) })
            }
        }
    }

    /// Asks for a range of blob `digest` that ends the blob (`header`). For a 206, where the
    /// answer starts and the blob's size, which `fits` must accept; `None` for other statuses,
    /// left to the caller with the answer.
    async fn end_of_blob(
        &self,
        image: &ImageRef,
        digest: &str,
        header: &str,
        fits: impl Fn(u64, u64) -> bool,
    ) -> Result<(reqwest::Response, String, Option<(u64, u64)>), RegistryError> {
        let resp =
            self.send(image, &format!("/blobs/{digest}"), Method::GET, |r| r.header(RANGE, header), Need::Pull).await?;
        let url = resp.url().to_string();
        if resp.status() != StatusCode::PARTIAL_CONTENT {
            return Ok((resp, url, None));
        }
        let content_range = resp.headers().get(CONTENT_RANGE).and_then(|v| v.to_str().ok()).unwrap_or("");
        match parse_content_range(content_range) {
            Some((start, end, size)) if end + 1 == size && fits(start, size) => Ok((resp, url, Some((start, size)))),
            _ => Err(RegistryError::Blob {
                url,
                reason: format!("asked for {header} and got Content-Range {content_range:?}"),
            }),
        }
    }

    /// Bytes `range` of blob `digest`; exactly those bytes, or an error.
    pub async fn blob_range(&self, image: &ImageRef, digest: &str, range: Range<u64>) -> Result<Bytes, RegistryError> {
        if range.is_empty() {
            return Ok(Bytes::new());
        }
        collect(self.blob_range_stream(image, digest, range).await?).await
    }

    /// Bytes `range` of blob `digest` (not empty) as they arrive: exactly those bytes, or an
    /// error from [`RangeStream::next`]. A body that breaks off is asked for again from where
    /// it stopped, twice at most: a lazy read that fails is an I/O error in a running
    /// container.
    pub async fn blob_range_stream(
        &self,
        image: &ImageRef,
        digest: &str,
        range: Range<u64>,
    ) -> Result<RangeStream, RegistryError> {
        let stream = self.blob_range_once(image, digest, range).await?;
        let (registry, image, digest) = (self.clone(), image.clone(), digest.to_owned());
        Ok(stream.resuming(Resume::new(move |rest| {
            let (registry, image, digest) = (registry.clone(), image.clone(), digest.clone());
            Box::pin(async move { registry.blob_range_once(&image, &digest, rest).await })
        })))
    }

    async fn blob_range_once(
        &self,
        image: &ImageRef,
        digest: &str,
        range: Range<u64>,
    ) -> Result<RangeStream, RegistryError> {
        let header = format!("bytes={}-{}", range.start, range.end - 1);
        // A server that ignores Range would send the whole blob; lazy reads cannot work with
        // it, and reading the whole body would defeat the memory bound. A mirror that does so
        // (a pull-through cache fetching the blob for the first time) is passed over for the
        // next endpoint, as a failing one is.
        let whole = |resp: &reqwest::Response| {
            (resp.status() != StatusCode::PARTIAL_CONTENT).then(|| RegistryError::Range {
                url: resp.url().to_string(),
                start: range.start,
                end: range.end,
                got: format!("status {} instead of 206 Partial Content", resp.status()),
            })
        };
        let resp = self
            .send_accepting(
                image,
                &format!("/blobs/{digest}"),
                Method::GET,
                |r| r.header(RANGE, header.clone()),
                Need::Pull,
                whole,
            )
            .await?;
        let url = resp.url().to_string();
        let bad = |got: String| RegistryError::Range { url: url.clone(), start: range.start, end: range.end, got };
        let content_range = resp.headers().get(CONTENT_RANGE).and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
        let expected_prefix = format!("bytes {}-{}/", range.start, range.end - 1);
        if !content_range.starts_with(&expected_prefix) {
            return Err(bad(format!("Content-Range {content_range:?}")));
        }
        Ok(RangeStream::new(resp, url, range))
    }

    /// Streams blob `digest` into `out`, checking that its bytes hash to the digest; returns
    /// its size. On a mismatch `out` holds bytes that must not be used.
    pub async fn blob_to_file(
        &self,
        image: &ImageRef,
        digest: &str,
        out: &mut std::fs::File,
    ) -> Result<u64, RegistryError> {
        use sha2::{Digest as _, Sha256};
        use std::io::Write;
        let mut resp = self.send(image, &format!("/blobs/{digest}"), Method::GET, |r| r, Need::Pull).await?;
        let url = resp.url().to_string();
        let expected = resp.content_length();
        let mut hash = Sha256::new();
        let mut len = 0u64;
        while let Some(chunk) = resp.chunk().await.map_err(|e| ended_early(&url, len, expected, &e))? {
            hash.update(&chunk);
            len += chunk.len() as u64;
            out.write_all(&chunk)
                .map_err(|e| RegistryError::Blob { url: url.clone(), reason: format!("writing the blob: {e}") })?;
        }
        let actual = format!("sha256:{}", hex::encode(hash.finalize()));
        if actual != digest {
            return Err(RegistryError::Blob {
                url,
                reason: format!("the blob's bytes hash to {actual}, not {digest}"),
            });
        }
        Ok(len)
    }

    /// Opens a connection to `image`'s first pull endpoint before it is needed, with a `GET
    /// /v2/` whatever it answers, so that a request made while another is in flight does not
    /// wait for a handshake. The answer is read whole, which leaves the connection pooled.
    pub async fn preconnect(&self, image: &ImageRef) {
        let Some(ep) = self.inner.hosts.endpoints(&image.host).ok().and_then(|eps| eps.into_iter().find(|e| e.pull))
        else {
            return;
        };
        let Ok(client) = self.client_for(&ep) else { return };
        let url = format!("{}/v2/", origin(&ep.base));
        let answer = match client.get(&url).send().await {
            Ok(resp) => resp.bytes().await.map(|_| ()),
            Err(e) => Err(e),
        };
        if let Err(e) = answer {
            tracing::debug!(url, error = %super::with_causes(&e), "opening a connection ahead of need failed");
        }
    }

    /// Sends one request to the first endpoint that answers it with success, authenticating
    /// on a 401 as challenged. Only endpoints with the capability `need` are asked. `path` is
    /// under the repository (`/blobs/...`), or a URL the registry handed out (an upload's
    /// `Location`: absolute, or a path from the host's root).
    ///
    /// A read (GET or HEAD) that every endpoint failed for a reason that passes (a connection
    /// refused or reset, a timeout, 429 or a 5xx from an overloaded registry or a proxy in
    /// front of it) is sent again, twice, after a pause: a lazy read that fails is an I/O error
    /// in a running container, where a pull would merely have retried.
    pub(super) async fn send(
        &self,
        image: &ImageRef,
        path: &str,
        method: Method,
        build: impl Fn(reqwest::RequestBuilder) -> reqwest::RequestBuilder,
        need: Need,
    ) -> Result<reqwest::Response, RegistryError> {
        self.send_accepting(image, path, method, build, need, |_| None).await
    }

    /// As [`Registry::send`], where an endpoint's successful answer that `refuse` finds wrong
    /// (a mirror answering a ranged read with the whole blob) counts as that endpoint failing.
    async fn send_accepting(
        &self,
        image: &ImageRef,
        path: &str,
        method: Method,
        build: impl Fn(reqwest::RequestBuilder) -> reqwest::RequestBuilder,
        need: Need,
        refuse: impl Fn(&reqwest::Response) -> Option<RegistryError>,
    ) -> Result<reqwest::Response, RegistryError> {
        let reads = method == Method::GET || method == Method::HEAD;
        let mut pause = RETRY_PAUSE;
        for _ in 1..RETRIES {
            match self.send_once(image, path, method.clone(), &build, need, &refuse).await {
                Err(e) if reads && passes(&e) => {
                    tracing::debug!(image = %image, path, error = %e, ?pause, "the registry failed a read; asking again");
                    tokio::time::sleep(pause).await;
                    pause *= 4;
                }
                other => return other,
            }
        }
        self.send_once(image, path, method, &build, need, &refuse).await
    }

    async fn send_once(
        &self,
        image: &ImageRef,
        path: &str,
        method: Method,
        build: &impl Fn(reqwest::RequestBuilder) -> reqwest::RequestBuilder,
        need: Need,
        refuse: &impl Fn(&reqwest::Response) -> Option<RegistryError>,
    ) -> Result<reqwest::Response, RegistryError> {
        let endpoints: Vec<Endpoint> = self
            .inner
            .hosts
            .endpoints(&image.host)?
            .into_iter()
            .filter(|e| !self.skips(e))
            .filter(|e| match need {
                Need::Pull => e.pull,
                Need::Resolve => e.resolve,
                Need::Push => e.push,
            })
            .collect();
        let mut errors = Vec::new();
        for (at, ep) in self.up_first(&endpoints) {
            match self.send_to(ep, image, path, method.clone(), build).await {
                Ok(resp) => match refuse(&resp) {
                    None => {
                        self.inner.down.lock().unwrap_or_else(|p| p.into_inner()).remove(&ep.base);
                        return Ok(resp);
                    }
                    Some(e) => {
                        tracing::debug!(endpoint = %ep.base, error = %e, "registry endpoint answered wrongly; trying the next");
                        errors.push((at, e));
                    }
                },
                Err(e) => {
                    if endpoints.len() > 1 && unreachable(&e) {
                        self.mark_down(ep);
                    }
                    tracing::debug!(endpoint = %ep.base, error = %e, "registry endpoint failed; trying the next");
                    errors.push((at, e));
                }
            }
        }
        // What the read ends with (and whether it is asked again) is what the endpoint last in
        // hosts.toml's order said, the registry itself, however lately failing mirrors were
        // put after it.
        let last = errors.into_iter().max_by_key(|(at, _)| *at).map(|(_, e)| e);
        match last {
            Some(e) if endpoints.len() == 1 => Err(e),
            Some(e) => Err(RegistryError::AllHostsFailed { host: image.host.clone(), last: Box::new(e) }),
            None => Err(RegistryError::Config {
                path: "hosts.toml".into(),
                reason: format!("no endpoint of {} may {need:?}", image.host).to_lowercase(),
            }),
        }
    }

    /// `endpoints` in their order, those that failed lately last: a mirror that is down (a
    /// blackholed one costs the connect timeout, 10 s) is not waited on by every lazy read
    /// while the registry behind it answers. It is still asked when all else fails, and is
    /// asked first again once its pause is over.
    fn up_first<'e>(&self, endpoints: &'e [Endpoint]) -> Vec<(usize, &'e Endpoint)> {
        let now = Instant::now();
        let mut down = self.inner.down.lock().unwrap_or_else(|p| p.into_inner());
        down.retain(|_, until| *until > now);
        let (up, later): (Vec<_>, Vec<_>) =
            endpoints.iter().enumerate().partition(|(_, e)| !down.contains_key(&e.base));
        up.into_iter().chain(later).collect()
    }

    fn mark_down(&self, ep: &Endpoint) {
        let mut down = self.inner.down.lock().unwrap_or_else(|p| p.into_inner());
        if down.insert(ep.base.clone(), Instant::now() + DOWN_FOR).is_none() {
            // The error itself is left out: after a redirect it may hold a signed URL.
            tracing::warn!(endpoint = %ep.base, pause = ?DOWN_FOR, "registry endpoint cannot be reached; asking the others first for a while");
        }
    }

    async fn send_to(
        &self,
        ep: &Endpoint,
        image: &ImageRef,
        path: &str,
        method: Method,
        build: &impl Fn(reqwest::RequestBuilder) -> reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, RegistryError> {
        let client = &self.client_for(ep)?;
        let url = if path.starts_with("http://") || path.starts_with("https://") {
            path.to_owned()
        } else if path.starts_with("/v2/") {
            format!("{}{path}", origin(&ep.base))
        } else {
            format!("{}/{}{}", ep.base, image.repository, path)
        };
        let key = (ep.base.clone(), image.repository.clone());
        let cached = self.inner.auth.lock().unwrap_or_else(|p| p.into_inner()).get(&key).cloned();
        let attempt = |auth: Option<String>| {
            let mut req = build(client.request(method.clone(), &url));
            for (name, value) in &ep.headers {
                req = req.header(name, value);
            }
            if let Some(a) = auth {
                req = req.header(AUTHORIZATION, a);
            }
            req.send()
        };
        let http = |source| RegistryError::Http { url: url.clone(), source };
        let mut resp = attempt(cached.clone()).await.map_err(http)?;
        if resp.status() == StatusCode::UNAUTHORIZED {
            let challenge =
                resp.headers().get(WWW_AUTHENTICATE).and_then(|v| v.to_str().ok()).and_then(parse_challenge);
            // The logins of the host asked, as containerd picks them: a mirror has its own, and
            // is never sent the upstream registry's. A CRI pull's comes first; if the registry
            // refuses it (a token that expired since the pull), config.json's is tried.
            let asked = origin(&ep.base);
            let mut tries = self.logins(image, asked);
            let mut refused = None;
            let mut worked = None;
            while let Some(login) = tries.next().await {
                let login = login.as_ref();
                let header = match &challenge {
                    Some(Challenge::Basic) => match login {
                        // A refresh token is for a token service, never a password to send.
                        Some((l, from)) if l.is_identity_token() => {
                            refused = Some(RegistryError::Auth {
                                url: url.clone(),
                                reason: format!(
                                    "the login for {asked} ({from}) is an identity token, which cannot answer a Basic challenge"
                                ),
                            });
                            continue;
                        }
                        Some((l, _)) => l.basic_header(),
                        None => {
                            return Err(RegistryError::Auth {
                                url,
                                reason: "the registry wants a login, and neither a CRI pull nor config.json (its logins and credential helpers) gave one for this host".into(),
                            });
                        }
                    },
                    Some(Challenge::Bearer { realm, service, scope }) => {
                        let scope = scope.clone().unwrap_or_else(|| format!("repository:{}:pull", image.repository));
                        match fetch_token(client, realm, service.as_deref(), &scope, login.map(|(l, _)| l), &ep.headers)
                            .await
                        {
                            Ok(token) => format!("Bearer {token}"),
                            Err(e) => {
                                refused = Some(e);
                                continue;
                            }
                        }
                    }
                    None => {
                        return Err(RegistryError::Auth {
                            url,
                            reason: "401 without a challenge Strata understands".into(),
                        });
                    }
                };
                resp = attempt(Some(header.clone())).await.map_err(http)?;
                if resp.status() != StatusCode::UNAUTHORIZED {
                    worked = Some(header);
                    break;
                }
                let whose = match login {
                    Some((_, from)) => format!("the login for {asked} ({from})"),
                    None => "an anonymous token".to_owned(),
                };
                refused = Some(RegistryError::Auth {
                    url: url.clone(),
                    reason: format!("401 Unauthorized: {whose} was refused"),
                });
            }
            let Some(header) = worked else {
                return Err(refused.unwrap_or_else(|| RegistryError::Auth { url, reason: "no login to try".into() }));
            };
            self.inner.auth.lock().unwrap_or_else(|p| p.into_inner()).insert(key, header);
        }
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status().as_u16();
        let detail = match resp.text().await {
            Ok(t) if !t.trim().is_empty() => format!(": {}", t.trim().chars().take(200).collect::<String>()),
            _ => String::new(),
        };
        Err(RegistryError::Status { url, status, detail })
    }
}

/// How long an endpoint that failed for a passing reason is asked after the others.
const DOWN_FOR: Duration = Duration::from_secs(30);

/// Tries of a read whose failure passes, and the pause before the second (four times longer
/// before each later one).
const RETRIES: u32 = 3;
const RETRY_PAUSE: Duration = Duration::from_millis(250);

/// Whether an endpoint could not be reached at all (refused, or no answer in time), rather
/// than answering badly: a mirror's 429 or 502 is often about one request (an upstream rate
/// limit passed on), and skipping the mirror would send every read to that upstream.
fn unreachable(e: &RegistryError) -> bool {
    matches!(e, RegistryError::Http { source, .. } if source.is_connect() || source.is_timeout())
}

/// Whether a failed request may well work if sent again: the connection failed or timed out,
/// or the registry said it is overloaded or failing for now.
fn passes(e: &RegistryError) -> bool {
    match e {
        RegistryError::Http { source, .. } => source.is_connect() || source.is_timeout() || source.is_request(),
        RegistryError::Status { status, .. } => matches!(status, 408 | 429 | 500 | 502 | 503 | 504),
        RegistryError::AllHostsFailed { last, .. } => passes(last),
        _ => false,
    }
}

/// How long an answer may send nothing before it is given up as stalled.
const STALL_TIMEOUT: Duration = Duration::from_secs(10);

fn build_client(
    skip_verify: bool,
    roots: Vec<reqwest::Certificate>,
    identity: Option<reqwest::Identity>,
) -> Result<reqwest::Client, reqwest::Error> {
    let builder = match identity {
        Some(id) => reqwest::Client::builder().identity(id),
        None => reqwest::Client::builder(),
    };
    builder
        .connect_timeout(Duration::from_secs(10))
        // An answer that sends nothing for this long (a stalled connection) is cancelled, and
        // the read is sent again (see `send`), as the object store's `stall_timeout` does.
        .read_timeout(STALL_TIMEOUT)
        .danger_accept_invalid_certs(skip_verify)
        .tls_certs_merge(roots)
        .user_agent(concat!("strata/", env!("CARGO_PKG_VERSION")))
        .build()
}

/// `bytes START-END/SIZE`, as numbers.
fn parse_content_range(value: &str) -> Option<(u64, u64, u64)> {
    let (range, size) = value.strip_prefix("bytes ")?.split_once('/')?;
    let (start, end) = range.split_once('-')?;
    let (start, end, size) = (start.parse().ok()?, end.parse().ok()?, size.parse().ok()?);
    (start <= end && end < size).then_some((start, end, size))
}

/// Whether manifest `m`'s config is one [`Registry::small_blob`] reads: a sha256 digest, at
/// most 1 MiB.
pub fn check_config_ref(image: &ImageRef, m: &Manifest) -> Result<(), RegistryError> {
    if m.config_size > CONFIG_LIMIT || !crate::estargz::is_sha256_digest(&m.config_digest) {
        return Err(RegistryError::Manifest {
            reference: image.to_string(),
            reason: format!(
                "config {} of {} bytes: not a sha256 digest, or over 1 MiB",
                m.config_digest, m.config_size
            ),
        });
    }
    Ok(())
}

/// What a manifest's bytes say: an image manifest, or an index and the manifest in it for
/// this platform.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decoded {
    Image(Manifest),
    /// An index (or a docker manifest list): the digest of this platform's manifest.
    Index {
        chosen: String,
    },
}

/// Reads the manifest or index `body`, whose content digest is `digest`, as a registry served
/// it for `image`. Every digest it names is a well-formed `sha256:`, as the reads that follow
/// from it need: nothing a registry sends is used unchecked.
pub fn decode_manifest(image: &ImageRef, body: &[u8], digest: String) -> Result<Decoded, RegistryError> {
    let bad = |reason: String| RegistryError::Manifest { reference: image.to_string(), reason };
    let raw: RawManifest = serde_json::from_slice(body).map_err(|e| bad(format!("not a manifest: {e}")))?;
    let sha256 = |what: &str, d: &str| {
        if crate::estargz::is_sha256_digest(d) {
            Ok(())
        } else {
            Err(bad(format!("{what} digest {d:?} is not sha256")))
        }
    };
    if !raw.manifests.is_empty() {
        let chosen = raw
            .manifests
            .iter()
            .find(|m| m.platform.as_ref().is_some_and(|p| p.os == "linux" && p.architecture == this_arch()))
            .ok_or_else(|| bad(format!("the index has no manifest for linux/{}", this_arch())))?;
        sha256("the platform manifest's", &chosen.digest)?;
        return Ok(Decoded::Index { chosen: chosen.digest.clone() });
    }
    let config = raw.config.ok_or_else(|| bad(format!("no config (media type {:?})", raw.media_type)))?;
    sha256("config", &config.digest)?;
    for l in &raw.layers {
        sha256("layer", &l.digest)?;
    }
    Ok(Decoded::Image(Manifest { digest, config_digest: config.digest, config_size: config.size, layers: raw.layers }))
}

/// The scheme and authority of an endpoint's base URL (`https://host:port`), without its path.
pub(super) fn origin(base: &str) -> &str {
    let origin_end = base.find("://").map(|i| i + 3).unwrap_or(0);
    base[origin_end..].find('/').map_or(base, |i| &base[..origin_end + i])
}

#[cfg(test)]
mod tests {
    use super::parse_content_range;

    /// Every digest a manifest or an index hands on is checked before it is used in a URL or
    /// against content; an index chooses this platform's manifest.
    #[test]
    fn manifests_and_indexes_hand_on_only_sha256_digests() {
        use super::{Decoded, decode_manifest, this_arch};
        let image = super::ImageRef::parse("registry.test/app:1").unwrap();
        let d = |c: char| format!("sha256:{}", c.to_string().repeat(64));
        let decode = |json: serde_json::Value| decode_manifest(&image, json.to_string().as_bytes(), d('0'));
        let index = |digest: &str| {
            serde_json::json!({"manifests": [
                {"digest": d('a'), "platform": {"os": "linux", "architecture": "riscv-none"}},
                {"digest": digest, "platform": {"os": "linux", "architecture": this_arch()}},
            ]})
        };
        assert_eq!(decode(index(&d('b'))).unwrap(), Decoded::Index { chosen: d('b') });
        let e = decode(index("sha256:../../x")).unwrap_err().to_string();
        assert_eq!(e, "manifest registry.test/app:1: the platform manifest's digest \"sha256:../../x\" is not sha256");
        let image_of = |config: &str, layer: &str| serde_json::json!({"config": {"digest": config, "size": 7}, "layers": [{"digest": layer, "size": 9}]});
        let Decoded::Image(m) = decode(image_of(&d('c'), &d('e'))).unwrap() else { panic!("an image manifest") };
        assert_eq!((m.digest, m.config_digest, m.config_size, m.layers[0].size), (d('0'), d('c'), 7, 9));
        let e = decode(image_of("md5:x", &d('e'))).unwrap_err().to_string();
        assert!(e.ends_with("config digest \"md5:x\" is not sha256"), "{e}");
        let e = decode(image_of(&d('c'), "sha256:short")).unwrap_err().to_string();
        assert!(e.ends_with("layer digest \"sha256:short\" is not sha256"), "{e}");
    }

    /// A ranged read of bytes 0 to 3 answered.
    const ABCD: &str = "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-3/10\r\nContent-Length: 4\r\nConnection: close\r\n\r\nabcd";
    /// A login asked for, by HTTP basic auth.
    const BASIC_REFUSED: &str = "HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Basic realm=\"r\"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";

    /// A registry on loopback that answers each request in turn from `answers`, on a new
    /// connection each; returns its address and how many requests it took.
    fn serve(answers: Vec<&'static str>) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
        let mut answers = answers.into_iter();
        serve_by(answers.len(), move |_| answers.next().unwrap())
    }

    /// As [`serve`], for `n` requests, each answered by `answer` from its header lines.
    fn serve_by(
        n: usize,
        mut answer: impl FnMut(&str) -> &'static str + Send + 'static,
    ) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
        use std::io::{BufRead, BufReader, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let taken = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = taken.clone();
        std::thread::spawn(move || {
            for _ in 0..n {
                let (mut conn, _) = listener.accept().unwrap();
                let mut reader = BufReader::new(conn.try_clone().unwrap());
                let (mut head, mut line) = (String::new(), String::new());
                while reader.read_line(&mut line).is_ok_and(|n| n > 2) {
                    head.push_str(&line);
                    line.clear();
                }
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let _ = conn.write_all(answer(&head).as_bytes());
            }
        });
        (addr, taken)
    }

    /// An identity token goes to the realm as the challenge gave it, as an OAuth2 form; a
    /// service that does not know the form (400) is asked again by GET, with each scope on its
    /// own and the token as the password of a login without a user name.
    #[tokio::test]
    async fn an_identity_token_falls_back_to_a_get_where_the_form_is_unknown() {
        use super::*;
        use base64::Engine;
        let token = format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(":refresh-tok"));
        let (addr, taken) = serve_by(2, move |head| {
            let first = head.lines().next().unwrap_or("");
            let sent =
                head.lines().find_map(|l| l.strip_prefix("authorization: ").or(l.strip_prefix("Authorization: ")));
            if first.starts_with("POST /token?tenant=t1 ") {
                "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            } else if first.starts_with("GET /token?tenant=t1&scope=repository%3Aa%3Apull&scope=repository%3Ab%3Apull&")
                && sent == Some(token.as_str())
            {
                "HTTP/1.1 200 OK\r\nContent-Length: 14\r\nConnection: close\r\n\r\n{\"token\":\"T1\"}"
            } else {
                "HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            }
        });
        let client = reqwest::Client::new();
        let login = Login::identity_token("refresh-tok".into());
        let realm = format!("http://{addr}/token?tenant=t1");
        let scope = "repository:a:pull repository:b:pull";
        let got = fetch_token(&client, &realm, Some("reg"), scope, Some(&login), &[]).await.unwrap();
        assert_eq!((got.as_str(), taken.load(std::sync::atomic::Ordering::SeqCst)), ("T1", 2));
        // Any other refusal of the form ends it there: the token is not sent again.
        let (addr, taken) = serve(vec!["HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"]);
        let realm = format!("http://{addr}/token");
        let e = fetch_token(&client, &realm, None, "repository:a:pull", Some(&login), &[]).await.unwrap_err();
        assert!(e.to_string().contains("403") && e.to_string().contains("identity token"), "{e}");
        assert_eq!(taken.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert!(!format!("{e:?}").contains("refresh-tok"), "the token stays out of errors: {e:?}");
    }

    /// A login rotated in config.json while the daemon runs (a job renewing a registry token)
    /// is used at the next challenge, without a restart.
    #[tokio::test]
    async fn a_login_changed_in_config_json_is_used_without_a_restart() {
        use super::*;
        use base64::Engine;
        let right = format!("Basic {}", base64::engine::general_purpose::STANDARD.encode("strata:new-token"));
        let (ok, refused) = (ABCD, BASIC_REFUSED);
        let (addr, _) = serve_by(4, move |head| {
            let sent =
                head.lines().find_map(|l| l.strip_prefix("authorization: ").or(l.strip_prefix("Authorization: ")));
            if sent == Some(right.as_str()) { ok } else { refused }
        });
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("config.json");
        let write = |password: &str, at: std::time::SystemTime| {
            let auth = base64::engine::general_purpose::STANDARD.encode(format!("strata:{password}"));
            std::fs::write(&config, format!("{{\"auths\":{{\"{addr}\":{{\"auth\":\"{auth}\"}}}}}}")).unwrap();
            std::fs::File::options().write(true).open(&config).unwrap().set_modified(at).unwrap();
        };
        let start = std::time::SystemTime::now();
        write("old-token", start);
        let reg = Registry::new(Hosts::new(None), Credentials::load(&config).unwrap());
        let image = ImageRef::parse(&format!("{addr}/strata/x:1")).unwrap();
        let digest = format!("sha256:{}", "c".repeat(64));
        let e = reg.blob_range(&image, &digest, 0..4).await.unwrap_err().to_string();
        assert!(e.contains("was refused"), "{e}");
        write("new-token", start + Duration::from_secs(5));
        let got = reg.blob_range(&image, &digest, 0..4).await.unwrap();
        assert_eq!(&got[..], b"abcd");
    }

    /// The login kubelet passed with the image's CRI pull is sent for that repository, before
    /// config.json's for the host; another repository of the host still gets config.json's.
    #[tokio::test]
    async fn a_cri_pull_login_wins_for_its_repository() {
        use super::*;
        use base64::Engine;
        let header = |l: &str| format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(l));
        let (pod, node) = (header("pod:secret"), header("node:other"));
        let (ok, refused) = (ABCD, BASIC_REFUSED);
        // Each repository takes only its own login.
        let (addr, _) = serve_by(6, move |head| {
            let sent = head
                .lines()
                .find_map(|l| l.strip_prefix("authorization: ").or(l.strip_prefix("Authorization: ")))
                .unwrap_or("");
            let private = head.contains("/v2/team/private/");
            if (private && sent == pod) || (!private && sent == node) { ok } else { refused }
        });
        let credentials =
            Credentials::default().with_login(&addr, Login { username: "node".into(), password: "other".into() });
        let reg = Registry::new(Hosts::new(None), credentials);
        let private = ImageRef::parse(&format!("{addr}/team/private:1")).unwrap();
        let digest = format!("sha256:{}", "d".repeat(64));
        let e = reg.blob_range(&private, &digest, 0..4).await.unwrap_err().to_string();
        assert!(e.contains("(docker config.json) was refused"), "{e}");
        reg.keychain().remember(&private, Login { username: "pod".into(), password: "secret".into() }, "");
        assert_eq!(&reg.blob_range(&private, &digest, 0..4).await.unwrap()[..], b"abcd");
        let public = ImageRef::parse(&format!("{addr}/team/public:1")).unwrap();
        assert_eq!(&reg.blob_range(&public, &digest, 0..4).await.unwrap()[..], b"abcd");
    }

    /// A CRI pull's login that the registry refuses (expired since the pull) is followed by
    /// config.json's, rather than failing every read.
    #[tokio::test]
    async fn a_refused_cri_login_falls_back_to_config_json() {
        use super::*;
        use base64::Engine;
        let node = format!("Basic {}", base64::engine::general_purpose::STANDARD.encode("node:works"));
        let (ok, refused) = (ABCD, BASIC_REFUSED);
        let (addr, taken) = serve_by(3, move |head| if head.contains(&node) { ok } else { refused });
        let credentials =
            Credentials::default().with_login(&addr, Login { username: "node".into(), password: "works".into() });
        let reg = Registry::new(Hosts::new(None), credentials);
        let image = ImageRef::parse(&format!("{addr}/team/private:1")).unwrap();
        reg.keychain().remember(&image, Login { username: "pod".into(), password: "expired".into() }, "");
        let digest = format!("sha256:{}", "8".repeat(64));
        assert_eq!(&reg.blob_range(&image, &digest, 0..4).await.unwrap()[..], b"abcd");
        assert_eq!(taken.load(std::sync::atomic::Ordering::SeqCst), 3, "anonymous, the pod's login, then the node's");
    }

    /// The credential helper config.json names is run only once a CRI pull's login is refused,
    /// and then once for the reads that wait on it; its login is tried before config.json's own.
    #[tokio::test]
    async fn a_credential_helper_runs_only_when_the_cri_login_is_refused() {
        use super::*;
        use base64::Engine;
        let basic = |l: &str| format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(l));
        let (pod, helped) = (basic("pod:secret"), basic("robot:helped"));
        let (ok, refused) = (ABCD, BASIC_REFUSED);
        let dir = tempfile::tempdir().unwrap();
        let runs = dir.path().join("runs");
        let body =
            format!("echo \"$server\" >> {}\necho '{{\"Username\":\"robot\",\"Secret\":\"helped\"}}'", runs.display());
        super::super::helper::testing::ready_helper(dir.path(), "count", &body).await;
        let config = dir.path().join("config.json");
        let node = base64::engine::general_purpose::STANDARD.encode("node:other");
        let (addr, taken) =
            serve_by(5, move |head| if head.contains(&pod) || head.contains(&helped) { ok } else { refused });
        std::fs::write(&config, format!(r#"{{"credsStore": "count", "auths": {{"{addr}": {{"auth": "{node}"}}}}}}"#))
            .unwrap();
        let reg = Registry::new(Hosts::new(None), Credentials::load(&config).unwrap()).with_helpers_in(dir.path());
        let digest = format!("sha256:{}", "7".repeat(64));
        // The pod's login works: the helper is never run.
        let image = ImageRef::parse(&format!("{addr}/team/private:1")).unwrap();
        reg.keychain().remember(&image, Login { username: "pod".into(), password: "secret".into() }, "");
        assert_eq!(&reg.blob_range(&image, &digest, 0..4).await.unwrap()[..], b"abcd");
        assert!(!runs.exists(), "the helper ran beside a CRI login that worked");
        // Another repository, whose pod login has expired: the helper's login, before the node's.
        let other = ImageRef::parse(&format!("{addr}/team/other:1")).unwrap();
        reg.keychain().remember(&other, Login { username: "pod".into(), password: "expired".into() }, "");
        assert_eq!(&reg.blob_range(&other, &digest, 0..4).await.unwrap()[..], b"abcd");
        assert_eq!(std::fs::read_to_string(&runs).unwrap(), format!("{addr}\n"));
        let asked = taken.load(std::sync::atomic::Ordering::SeqCst);
        assert_eq!(asked, 5, "anonymous and the pod's; anonymous, the expired one and the helper's");
    }

    /// A pull-through mirror that answers a ranged read with the whole blob (200, as one
    /// fetching the blob upstream for the first time does) is passed over: the range is read
    /// from the next endpoint, the registry itself.
    #[tokio::test]
    async fn a_mirror_that_ignores_ranges_is_passed_over_for_the_next_host() {
        use super::*;
        let whole = "HTTP/1.1 200 OK\r\nContent-Length: 10\r\nConnection: close\r\n\r\nabcdefghij";
        let ok = "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-3/10\r\nContent-Length: 4\r\n\
                  Connection: close\r\n\r\nabcd";
        let (mirror, asked_mirror) = serve(vec![whole]);
        let (server, asked_server) = serve(vec![ok]);
        let hosts = tempfile::tempdir().unwrap();
        std::fs::create_dir(hosts.path().join("registry.test")).unwrap();
        std::fs::write(
            hosts.path().join("registry.test/hosts.toml"),
            format!("server = \"http://{server}\"\n[host.\"http://{mirror}\"]\n  capabilities = [\"pull\"]\n"),
        )
        .unwrap();
        let reg = Registry::new(Hosts::new(Some(hosts.path())), Credentials::default());
        let image = ImageRef::parse("registry.test/strata/x:1").unwrap();
        let digest = format!("sha256:{}", "b".repeat(64));
        let got = reg.blob_range(&image, &digest, 0..4).await.unwrap();
        assert_eq!(&got[..], b"abcd");
        let asked = |n: &std::sync::atomic::AtomicUsize| n.load(std::sync::atomic::Ordering::SeqCst);
        assert_eq!((asked(&asked_mirror), asked(&asked_server)), (1, 1));
    }

    /// A host's `header` table in hosts.toml goes with every request to that host, and only
    /// to it.
    #[tokio::test]
    async fn a_hosts_headers_go_with_its_requests() {
        use super::*;
        let ok = "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-3/10\r\nContent-Length: 4\r\n\
                  Connection: close\r\n\r\nabcd";
        let refused = "HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
        let (mirror, _) = serve_by(1, move |head| {
            let lower = head.to_ascii_lowercase();
            if lower.contains("x-api-key: k1\r\n")
                && lower.contains("x-multi: v1\r\n")
                && lower.contains("x-multi: v2\r\n")
            {
                ok
            } else {
                refused
            }
        });
        let (server, _) = serve_by(1, move |head| {
            // The server answers no blob read: the mirror's answer is the only way to the bytes.
            if head.to_ascii_lowercase().contains("x-api-key") || head.contains("/blobs/") { refused } else { ok }
        });
        let hosts = tempfile::tempdir().unwrap();
        std::fs::create_dir(hosts.path().join("registry.test")).unwrap();
        std::fs::write(
            hosts.path().join("registry.test/hosts.toml"),
            format!(
                "server = \"http://{server}\"\n[host.\"http://{mirror}\"]\n  capabilities = [\"pull\"]\n\
                 [host.\"http://{mirror}\".header]\n    x-api-key = \"k1\"\n    x-multi = [\"v1\", \"v2\"]\n"
            ),
        )
        .unwrap();
        let reg = Registry::new(Hosts::new(Some(hosts.path())), Credentials::default());
        let image = ImageRef::parse("registry.test/strata/x:1").unwrap();
        let digest = format!("sha256:{}", "7".repeat(64));
        assert_eq!(&reg.blob_range(&image, &digest, 0..4).await.unwrap()[..], b"abcd", "the mirror got its headers");
        // The server's own request (a manifest by tag resolves there only) carries none.
        let e = reg.manifest(&image).await.unwrap_err().to_string();
        assert!(!e.contains("403"), "{e}");
    }

    /// A body that breaks off mid-transfer is asked for again from where it stopped, and the
    /// bytes read are the blob's; a third break is the reader's error.
    #[tokio::test]
    async fn a_range_whose_body_breaks_off_goes_on_where_it_stopped() {
        use super::*;
        // Content-Length says 10 bytes, and the connection closes after 4.
        let cut = "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-9/10\r\nContent-Length: 10\r\n\
                   Connection: close\r\n\r\nabcd";
        let rest = "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 4-9/10\r\nContent-Length: 6\r\n\
                    Connection: close\r\n\r\nefghij";
        let wrong = "HTTP/1.1 416 Range Not Satisfiable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
        let (addr, taken) = serve_by(2, move |head| {
            let range = head.lines().find_map(|l| l.to_ascii_lowercase().strip_prefix("range: ").map(str::to_owned));
            match range.as_deref() {
                Some("bytes=0-9") => cut,
                Some("bytes=4-9") => rest,
                _ => wrong,
            }
        });
        let reg = Registry::new(Hosts::new(None), Credentials::default());
        let image = ImageRef::parse(&format!("{addr}/strata/x:1")).unwrap();
        let digest = format!("sha256:{}", "f".repeat(64));
        assert_eq!(&reg.blob_range(&image, &digest, 0..10).await.unwrap()[..], b"abcdefghij");
        assert_eq!(taken.load(std::sync::atomic::Ordering::SeqCst), 2);

        // Every answer, for whatever range, breaks off after 2 bytes.
        let (addr, taken) = serve_by(4, |head| {
            let range =
                head.lines().find_map(|l| l.to_ascii_lowercase().strip_prefix("range: bytes=").map(str::to_owned));
            let (start, end) = range.as_deref().and_then(|r| r.split_once('-')).unwrap();
            let (start, end): (usize, usize) = (start.parse().unwrap(), end.parse().unwrap());
            let body = &"abcdefghij"[start..start + 2];
            let answer = format!(
                "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {start}-{end}/10\r\nContent-Length: {}\r\n\
                 Connection: close\r\n\r\n{body}",
                end + 1 - start
            );
            Box::leak(answer.into_boxed_str())
        });
        let image = ImageRef::parse(&format!("{addr}/strata/x:1")).unwrap();
        let e = reg.blob_range(&image, &digest, 0..10).await.unwrap_err().to_string();
        assert!(e.contains("after 6 of 10 bytes"), "{e}");
        assert_eq!(taken.load(std::sync::atomic::Ordering::SeqCst), 3, "asked again twice, then the error");
    }

    /// A mirror that cannot be reached (nothing listens; a blackholed one costs the connect
    /// timeout) is asked after the registry for a while, not before every read. One that
    /// answers 503 is still asked first: that is often about one request, not the mirror.
    #[tokio::test]
    async fn a_mirror_that_cannot_be_reached_is_asked_last_for_a_while() {
        use super::*;
        let ok = "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-3/10\r\nContent-Length: 4\r\n\
                  Connection: close\r\n\r\nabcd";
        let unavailable = "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
        let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
        let (busy, asked_busy) = serve(vec![unavailable, unavailable, unavailable]);
        let (server, asked_server) = serve(vec![ok, ok, ok, ok, ok, ok]);
        let hosts = tempfile::tempdir().unwrap();
        for (name, mirror) in [("dead.test", &dead), ("busy.test", &busy)] {
            std::fs::create_dir(hosts.path().join(name)).unwrap();
            std::fs::write(
                hosts.path().join(name).join("hosts.toml"),
                format!("server = \"http://{server}\"\n[host.\"http://{mirror}\"]\n  capabilities = [\"pull\"]\n"),
            )
            .unwrap();
        }
        let reg = Registry::new(Hosts::new(Some(hosts.path())), Credentials::default());
        let digest = format!("sha256:{}", "e".repeat(64));
        for name in ["dead.test", "busy.test"] {
            let image = ImageRef::parse(&format!("{name}/strata/x:1")).unwrap();
            for _ in 0..3 {
                assert_eq!(&reg.blob_range(&image, &digest, 0..4).await.unwrap()[..], b"abcd");
            }
        }
        let down: Vec<String> = reg.inner.down.lock().unwrap().keys().cloned().collect();
        assert_eq!(down.len(), 1, "{down:?}");
        assert!(down[0].contains(&dead), "the mirror nothing listens on is set aside: {down:?}");
        let asked = |n: &std::sync::atomic::AtomicUsize| n.load(std::sync::atomic::Ordering::SeqCst);
        assert_eq!((asked(&asked_busy), asked(&asked_server)), (3, 6), "the busy mirror is still asked first");
    }

    /// However the endpoints were reordered, the read ends with what the registry itself said:
    /// its 404 is final, and the read is not sent again for a mirror's passing failure.
    #[tokio::test]
    async fn a_read_ends_with_the_registrys_own_answer() {
        use super::*;
        let missing = "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
        let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
        let (server, asked_server) = serve(vec![missing, missing, missing, missing]);
        let hosts = tempfile::tempdir().unwrap();
        std::fs::create_dir(hosts.path().join("reg.test")).unwrap();
        std::fs::write(
            hosts.path().join("reg.test/hosts.toml"),
            format!("server = \"http://{server}\"\n[host.\"http://{dead}\"]\n  capabilities = [\"pull\"]\n"),
        )
        .unwrap();
        let reg = Registry::new(Hosts::new(Some(hosts.path())), Credentials::default());
        let image = ImageRef::parse("reg.test/strata/x:1").unwrap();
        let digest = format!("sha256:{}", "9".repeat(64));
        for _ in 0..2 {
            let e = reg.blob_range(&image, &digest, 0..4).await.unwrap_err().to_string();
            assert!(e.contains("404"), "{e}");
        }
        assert_eq!(asked_server.load(std::sync::atomic::Ordering::SeqCst), 2, "each read asked the registry once");
    }

    /// A registry that is overloaded for a moment (503, then 502 from a proxy in front of it)
    /// is asked again, and the read gets its bytes; one that refuses a read for good (404) is
    /// not asked again.
    #[tokio::test]
    async fn a_read_the_registry_fails_for_a_moment_is_sent_again() {
        use super::*;
        let unavailable = "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
        let bad_gateway = "HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
        let ok = "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-3/10\r\nContent-Length: 4\r\n\
                  Connection: close\r\n\r\nabcd";
        let (addr, taken) = serve(vec![unavailable, bad_gateway, ok]);
        let reg = Registry::new(Hosts::new(None), Credentials::default());
        let image = ImageRef::parse(&format!("{addr}/strata/x:1")).unwrap();
        let digest = format!("sha256:{}", "a".repeat(64));
        let got = reg.blob_range(&image, &digest, 0..4).await.unwrap();
        assert_eq!(&got[..], b"abcd");
        assert_eq!(taken.load(std::sync::atomic::Ordering::SeqCst), 3);

        let missing = "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
        let (addr, taken) = serve(vec![missing, ok]);
        let image = ImageRef::parse(&format!("{addr}/strata/x:1")).unwrap();
        let e = reg.blob_range(&image, &digest, 0..4).await.unwrap_err().to_string();
        assert!(e.contains("404"), "{e}");
        assert_eq!(taken.load(std::sync::atomic::Ordering::SeqCst), 1, "a 404 is final");
    }

    #[test]
    fn content_ranges_are_read_whole_or_not_at_all() {
        assert_eq!(parse_content_range("bytes 100-199/200"), Some((100, 199, 200)));
        assert_eq!(parse_content_range("bytes 0-0/1"), Some((0, 0, 1)));
        // Past the end, backwards, unknown size, or not bytes: none of these names a tail.
        assert_eq!(parse_content_range("bytes 100-200/200"), None);
        assert_eq!(parse_content_range("bytes 10-5/200"), None);
        assert_eq!(parse_content_range("bytes 0-9/*"), None);
        assert_eq!(parse_content_range("items 0-9/10"), None);
        assert_eq!(parse_content_range("bytes */200"), None);
    }
}
