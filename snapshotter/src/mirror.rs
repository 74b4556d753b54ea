//! The registry mirror on every node: the read side of the distribution API, for blobs and
//! manifests by digest (`GET` and `HEAD` of `/v2/<name>/blobs/<digest>` and
//! `/v2/<name>/manifests/<digest>`, with ranges), which containerd asks as a `hosts.toml`
//! mirror. Plain overlayfs pulls and layers that cannot be lazy gain from the peer tier too: a
//! blob's bytes come through it in the segments lazy layers use, so a layer that any node holds
//! or is fetching now is not fetched from the registry again; a manifest comes through it as
//! one chunk named by its digest.
//!
//! A pull is served only to a client that the registry would serve. The mirror first asks the
//! registry (a HEAD, with the client's own `Authorization`, remembered for `access_ttl`), and
//! passes a refusal back as it came: a 401 with its challenge, so that containerd logs in to
//! the registry and asks again. The upstream is named by containerd's `ns` query parameter.

use crate::peer_blobs::{PeerBlobs, Whole};
use crate::registry::{ImageRef, Registry};
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::StreamExt;
use sha2::{Digest, Sha256};
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

/// What the mirror serves from.
#[derive(Clone)]
pub struct MirrorState {
    pub registry: Arc<Registry>,
    pub peers: Option<Arc<PeerBlobs>>,
    /// Access the registry granted, by client authorization and object.
    access: moka::sync::Cache<AccessKey, Granted>,
    /// How long access is remembered, and a tag's resolution trusted.
    access_ttl: Duration,
    pub metrics: strata_tiering::metrics::Metrics,
}

impl std::fmt::Debug for MirrorState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MirrorState").field("peers", &self.peers.is_some()).finish_non_exhaustive()
    }
}

/// One object, as one client may read it: the SHA-256 of its `Authorization` (never kept
/// itself), the registry, the repository and the object's path.
#[derive(Clone, PartialEq, Eq, Hash)]
struct AccessKey([u8; 32], String, String, String);

/// What the registry's HEAD said of an object it let the client read.
#[derive(Clone)]
struct Granted {
    size: u64,
    content_type: Option<HeaderValue>,
}

impl MirrorState {
    pub fn new(
        registry: Arc<Registry>,
        peers: Option<Arc<PeerBlobs>>,
        access_ttl: Duration,
        metrics: strata_tiering::metrics::Metrics,
    ) -> MirrorState {
        let access = moka::sync::Cache::builder().max_capacity(100_000).time_to_live(access_ttl).build();
        MirrorState { registry, peers, access, access_ttl, metrics }
    }
}

pub fn router(state: MirrorState) -> axum::Router {
    axum::Router::new()
        .route("/v2/", axum::routing::get(|| async { axum::Json(serde_json::json!({})) }))
        .route("/v2/{*object}", axum::routing::get(object).head(object))
        .with_state(state)
}

/// Serves the mirror on `listener` until `stop` completes.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: MirrorState,
    stop: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(state)).with_graceful_shutdown(stop).await
}

/// An object the mirror serves: `<name>/blobs/<digest>`, `<name>/manifests/<digest>` or
/// `<name>/manifests/<tag>` (`by_tag`, with the tag in `digest` until it is resolved).
#[derive(Debug, PartialEq, Eq)]
struct Object {
    repository: String,
    kind: Kind,
    digest: String,
    by_tag: bool,
}

#[derive(Debug, PartialEq, Eq, Clone, Copy)]
enum Kind {
    Blob,
    Manifest,
}

fn parse_object(path: &str) -> Result<Object, (StatusCode, String)> {
    let (repository, kind, reference) = if let Some((r, d)) = path.rsplit_once("/blobs/") {
        (r, Kind::Blob, d)
    } else if let Some((r, d)) = path.rsplit_once("/manifests/") {
        (r, Kind::Manifest, d)
    } else {
        return Err((StatusCode::NOT_FOUND, "the mirror serves blobs and manifests only".into()));
    };
    if repository.is_empty() || repository.split('/').any(|c| c.is_empty() || c == "." || c == "..") {
        return Err((StatusCode::BAD_REQUEST, format!("{repository:?} is not a repository name")));
    }
    let (repository, digest) = (repository.to_owned(), reference.to_owned());
    if kind == Kind::Manifest && crate::peer_blobs::is_tag(reference) {
        return Ok(Object { repository, kind, digest, by_tag: true });
    }
    let hex = reference.strip_prefix("sha256:").unwrap_or_default();
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        // A 404 sends the client to the next host.
        return Err((StatusCode::NOT_FOUND, format!("{reference:?} is neither a sha256 digest nor a manifest's tag")));
    }
    Ok(Object { repository, kind, digest, by_tag: false })
}

async fn object(State(s): State<MirrorState>, method: Method, uri: Uri, headers: HeaderMap) -> Response {
    let path = uri.path().strip_prefix("/v2/").unwrap_or_default();
    let mut o = match parse_object(path) {
        Ok(o) => o,
        Err((status, why)) => return (status, why).into_response(),
    };
    let ns = form_urlencoded::parse(uri.query().unwrap_or_default().as_bytes())
        .find(|(k, _)| k == "ns")
        .map(|(_, v)| v.into_owned());
    let Some(host) = ns.filter(|h| !h.is_empty() && !h.contains(['/', ' '])) else {
        return (
            StatusCode::BAD_REQUEST,
            "no ns= query parameter: name the mirror in a hosts.toml, and containerd adds it",
        )
            .into_response();
    };
    let image = ImageRef { host: host.clone(), repository: o.repository.clone(), tag: None, digest: None };
    let authorization = headers.get(header::AUTHORIZATION);
    if o.by_tag {
        // A tag is resolved by its owner once per access TTL for the cluster; the client's
        // access is then checked on the manifest it names, as for a pull by digest.
        let resolved = match s.peers.as_ref().filter(|p| p.shares(&image)) {
            Some(peers) => peers.resolve(&s.registry, &image, &o.digest, s.access_ttl).await,
            None => {
                return (StatusCode::NOT_FOUND, "this mirror resolves tags through the peer tier, which it has not")
                    .into_response();
            }
        };
        match resolved {
            Ok(digest) => o.digest = digest,
            Err(e) => {
                tracing::info!(image = %image, tag = %o.digest, error = %e, "the peer tier could not resolve a tag; passing it on to the registry");
                let (sub, range, accept) =
                    (format!("/manifests/{}", o.digest), headers.get(header::RANGE), headers.get(header::ACCEPT));
                return pass_on(&s, &image, &sub, method, authorization, range, accept).await;
            }
        }
    }
    let sub = match o.kind {
        Kind::Blob => format!("/blobs/{}", o.digest),
        Kind::Manifest => format!("/manifests/{}", o.digest),
    };
    let granted = match access(&s, &image, &sub, authorization, headers.get(header::ACCEPT)).await {
        Ok(g) => g,
        Err(refusal) => return refusal,
    };
    let mut answer = HeaderMap::new();
    answer.insert("docker-content-digest", HeaderValue::from_str(&o.digest).expect("a digest is a header value"));
    if let Some(t) = &granted.content_type {
        answer.insert(header::CONTENT_TYPE, t.clone());
    }
    if method == Method::HEAD {
        answer.insert(header::CONTENT_LENGTH, granted.size.into());
        return (StatusCode::OK, answer).into_response();
    }
    let range = match headers.get(header::RANGE).map(|r| parse_range(r, granted.size)) {
        None => None,
        Some(Ok(r)) => Some(r),
        Some(Err(())) => {
            let unsatisfied = format!("bytes */{}", granted.size);
            return (StatusCode::RANGE_NOT_SATISFIABLE, [(header::CONTENT_RANGE, unsatisfied)]).into_response();
        }
    };
    let shared = s.peers.as_ref().filter(|p| p.shares(&image) && granted.size > 0);
    if let Some(peers) = shared.filter(|_| o.kind == Kind::Manifest) {
        match peers.whole(&s.registry, &image, Whole::Manifest, &o.digest, 0).await {
            Ok(body) if body.len() as u64 == granted.size => {
                s.metrics.mirror_peer_bytes.inc_by(body.len() as u64);
                let part = match &range {
                    Some(r) => body.slice(r.start as usize..r.end as usize),
                    None => body,
                };
                return with_range(StatusCode::OK, answer, range, granted.size, Body::from(part));
            }
            Ok(body) => {
                tracing::warn!(image = %image, manifest = %o.digest, bytes = body.len(), head = granted.size, "a manifest's size is not what the registry's HEAD said; passing it on from the registry");
            }
            Err(e) => {
                tracing::info!(image = %image, manifest = %o.digest, error = %e, "the peer tier could not serve a manifest; passing it on from the registry");
            }
        }
    }
    if let Some(peers) = shared.filter(|_| o.kind == Kind::Blob) {
        let want = range.clone().unwrap_or(0..granted.size);
        let mut stream = peers.range_stream(&s.registry, &image, &o.digest, granted.size, want.clone());
        // The first piece decides: should the peer tier and this node's own logins fail (an
        // image only the client can pull), the registry is asked with the client's.
        match stream.next().await {
            Ok(first) => {
                let body = peer_body(s.clone(), image, o.digest.clone(), range.is_none(), first, stream);
                return with_range(StatusCode::OK, answer, range, granted.size, body);
            }
            Err(e) => {
                tracing::info!(image = %image, blob = %o.digest, error = %e, "the peer tier could not serve a blob; passing it on from the registry");
            }
        }
    }
    pass_on(&s, &image, &sub, method, authorization, headers.get(header::RANGE), headers.get(header::ACCEPT)).await
}

/// What the registry says of the client reading `sub` of `image`: what it granted, remembered
/// for the access TTL, or its refusal as the response to send.
async fn access(
    s: &MirrorState,
    image: &ImageRef,
    sub: &str,
    authorization: Option<&HeaderValue>,
    accept: Option<&HeaderValue>,
) -> Result<Granted, Response> {
    let who: [u8; 32] = Sha256::digest(authorization.map(|a| a.as_bytes()).unwrap_or_default()).into();
    let key = AccessKey(who, image.host.clone(), image.repository.clone(), sub.to_owned());
    if let Some(g) = s.access.get(&key) {
        return Ok(g);
    }
    // A manifest's HEAD is asked with the client's Accept, so the registry answers with the
    // media type the client will get.
    let head = s.registry.pass_on_with(image, sub, Method::HEAD, authorization, None, accept).await;
    let resp = match head {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(image = %image, object = sub, error = %e, "the registry could not be asked whether a client may pull");
            return Err((StatusCode::BAD_GATEWAY, e.to_string()).into_response());
        }
    };
    if !resp.status().is_success() {
        s.metrics.mirror_refused.inc();
        let mut refusal = HeaderMap::new();
        if let Some(c) = resp.headers().get(header::WWW_AUTHENTICATE) {
            refusal.insert(header::WWW_AUTHENTICATE, c.clone());
        }
        let status = StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
        return Err((status, refusal).into_response());
    }
    let size = resp.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse().ok());
    let Some(size) = size else {
        return Err((StatusCode::BAD_GATEWAY, "the registry's HEAD gave no Content-Length").into_response());
    };
    let granted = Granted { size, content_type: resp.headers().get(header::CONTENT_TYPE).cloned() };
    s.access.insert(key, granted.clone());
    Ok(granted)
}

/// The blob's bytes from the peer tier, `first` then the rest of `stream`. A whole blob is
/// checked against its digest on its way out: if it fails, the body breaks off before its end,
/// so the client never takes it, and this node's segments of it are dropped.
fn peer_body(
    s: MirrorState,
    image: ImageRef,
    digest: String,
    whole: bool,
    first: Option<Bytes>,
    stream: crate::registry::range_stream::RangeStream,
) -> Body {
    // When whole, the stream's range is the blob.
    let extent = stream.range();
    let state = (stream, first, whole.then(Sha256::new), s, image, digest);
    let pieces = futures::stream::unfold(Some(state), move |state| {
        let extent = extent.clone();
        async move {
            let (mut stream, first, mut hash, s, image, digest) = state?;
            let next = match first {
                Some(piece) => Ok(Some(piece)),
                None => stream.next().await,
            };
            match next {
                Ok(Some(piece)) => {
                    if let Some(h) = hash.as_mut() {
                        h.update(&piece);
                    }
                    s.metrics.mirror_peer_bytes.inc_by(piece.len() as u64);
                    Some((Ok(piece), Some((stream, None, hash, s, image, digest))))
                }
                Ok(None) => {
                    let actual = hash.map(|h| format!("sha256:{}", hex::encode(h.finalize())));
                    match actual {
                        Some(a) if a != digest => {
                            tracing::error!(image = %image, blob = %digest, actual = %a, "a blob from the peer tier failed its digest; its segments are dropped");
                            if let Some(peers) = &s.peers {
                                peers.forget(&image, &digest, extent).await;
                            }
                            Some((Err(std::io::Error::other("the blob failed its digest")), None))
                        }
                        _ => None,
                    }
                }
                Err(e) => Some((Err(std::io::Error::other(e.to_string())), None)),
            }
        }
    });
    Body::from_stream(pieces)
}

/// `body` as the answer to a request for `range` (all of the `size` bytes when none).
fn with_range(
    status: StatusCode,
    mut headers: HeaderMap,
    range: Option<Range<u64>>,
    size: u64,
    body: Body,
) -> Response {
    let (status, len) = match &range {
        Some(r) => {
            let content_range = format!("bytes {}-{}/{size}", r.start, r.end - 1);
            headers.insert(header::CONTENT_RANGE, HeaderValue::from_str(&content_range).expect("ASCII"));
            (StatusCode::PARTIAL_CONTENT, r.end - r.start)
        }
        None => (status, size),
    };
    headers.insert(header::CONTENT_LENGTH, len.into());
    headers.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    (status, headers, body).into_response()
}

/// The registry's answer to the client's request, passed on as it comes.
async fn pass_on(
    s: &MirrorState,
    image: &ImageRef,
    sub: &str,
    method: Method,
    authorization: Option<&HeaderValue>,
    range: Option<&HeaderValue>,
    accept: Option<&HeaderValue>,
) -> Response {
    // The client's Accept too: a manifest's bytes, and so its digest, depend on its media type.
    let resp = match s.registry.pass_on_with(image, sub, method, authorization, range, accept).await {
        Ok(r) => r,
        Err(e) => return (StatusCode::BAD_GATEWAY, e.to_string()).into_response(),
    };
    let status = StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let mut headers = HeaderMap::new();
    let names = [header::CONTENT_TYPE, header::CONTENT_LENGTH, header::CONTENT_RANGE, header::WWW_AUTHENTICATE];
    for name in names.into_iter().chain([header::HeaderName::from_static("docker-content-digest")]) {
        if let Some(v) = resp.headers().get(&name) {
            headers.insert(name, v.clone());
        }
    }
    let metrics = s.metrics.clone();
    let body = resp.bytes_stream().map(move |piece| {
        if let Ok(p) = &piece {
            metrics.mirror_upstream_bytes.inc_by(p.len() as u64);
        }
        piece.map_err(std::io::Error::other)
    });
    (status, headers, Body::from_stream(body)).into_response()
}

/// A `Range: bytes=a-b`, `bytes=a-` or `bytes=-n` header, one range, within `size` bytes.
fn parse_range(value: &HeaderValue, size: u64) -> Result<Range<u64>, ()> {
    let spec = value.to_str().map_err(|_| ())?.trim().strip_prefix("bytes=").ok_or(())?;
    let (a, b) = spec.split_once('-').ok_or(())?;
    let (start, end) = match (a.trim(), b.trim()) {
        ("", n) => {
            let n: u64 = n.parse().map_err(|_| ())?;
            (size.saturating_sub(n), size)
        }
        (a, "") => (a.parse().map_err(|_| ())?, size),
        (a, b) => (a.parse().map_err(|_| ())?, b.parse::<u64>().map_err(|_| ())?.saturating_add(1).min(size)),
    };
    if start >= end || start >= size {
        return Err(());
    }
    Ok(start..end)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_digests_of_sound_repositories_are_served() {
        let d = format!("sha256:{}", "0a".repeat(32));
        let o = parse_object(&format!("library/busybox/blobs/{d}")).unwrap();
        assert_eq!((o.repository.as_str(), o.kind, o.digest.as_str()), ("library/busybox", Kind::Blob, d.as_str()));
        assert!(!o.by_tag);
        assert_eq!(parse_object(&format!("a/manifests/{d}")).unwrap().kind, Kind::Manifest);
        assert!(parse_object("library/busybox/manifests/1.36").unwrap().by_tag, "a manifest by tag");
        for (path, status) in [
            ("library/busybox/blobs/latest", StatusCode::NOT_FOUND),
            ("library/busybox/manifests/-x", StatusCode::NOT_FOUND),
            ("library/busybox/blobs/sha256:ABC", StatusCode::NOT_FOUND),
            ("library/busybox/tags/list", StatusCode::NOT_FOUND),
        ] {
            assert_eq!(parse_object(path).unwrap_err().0, status, "{path}");
        }
        for bad in ["../etc/blobs/", "a//b/blobs/", "/blobs/"] {
            assert_eq!(parse_object(&format!("{bad}{d}")).unwrap_err().0, StatusCode::BAD_REQUEST, "{bad}");
        }
    }

    #[test]
    fn ranges_are_read_as_registries_read_them() {
        let r = |v: &str| parse_range(&HeaderValue::from_str(v).unwrap(), 100);
        assert_eq!(r("bytes=0-9"), Ok(0..10));
        assert_eq!(r("bytes=90-"), Ok(90..100));
        assert_eq!(r("bytes=-10"), Ok(90..100));
        assert_eq!(r("bytes=95-200"), Ok(95..100), "an end past the blob is cut to it");
        for bad in ["bytes=100-", "bytes=5-4", "items=0-1", "bytes=x-1", "0-1"] {
            assert_eq!(r(bad), Err(()), "{bad}");
        }
    }
}
