//! The peer port: this node serves the chunks it owns to the other members, from its own
//! tiers, or from its origin once however many members ask at the same time: the cache's own
//! single flight does that, and each piece goes on as it arrives ([`crate::progress`]). Asked
//! in place of an owner the asker could not reach, it asks that owner once before its origin.
//! A hot chunk is sent to a bounded number of members at once, and the next askers are sent on
//! to them ([`super::hot`]). Every request must be signed with the cluster's secret.

use super::auth::{AUTH_HEADER, PeerSecret, now_secs};
use super::hot::{Admission, HotChunks, SendGuard};
use super::meta::{META_PATH, MetaCache, MetaRequest};
use super::wire::{Ask, CHUNK_PATH, CRC_TRAILER, ChunkRequest, ERROR_TRAILER, HOLDER_HEADER, STATUS_TRAILER};
use crate::chunkfile::{Crc32c, crc32c};
use crate::progress::Tail;
use crate::source::{ObjectInfo, ObjectSource};
use crate::{CacheError, ChunkKey, FetchError, Fetcher, Identity, PathPattern, Streamed, TieredCache};
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::StreamExt;
use futures::future::BoxFuture;
use http_body_util::StreamBody;
use hyper::body::Frame;
use prometheus_client::metrics::counter::Counter;
use std::sync::Arc;

/// Where this node fetches a chunk from when it serves a peer and does not hold it.
pub trait Origin: Send + Sync + 'static {
    /// The fetcher for chunk `req`, or why this node does not serve it.
    fn fetcher(&self, req: &ChunkRequest) -> Result<Arc<dyn Fetcher>, String>;
}

/// Dataset and checkpoint chunks: ranges of object versions in the node's cold store, which
/// every node of the cluster has the same of.
impl Origin for ObjectSource {
    fn fetcher(&self, req: &ChunkRequest) -> Result<Arc<dyn Fetcher>, String> {
        let Identity::Object { version, chunk_size, .. } = &req.key.identity else {
            return Err("only chunks of objects are served".into());
        };
        if *chunk_size != self.chunk_size() {
            return Err(format!("chunks of {chunk_size} bytes, where this node's store cuts {}", self.chunk_size()));
        }
        if req.expected_len().is_none() {
            return Err(format!("the chunk lies past the end of the {}-byte object", req.size));
        }
        let info = ObjectInfo {
            path: req.key.path.clone(),
            size: req.size,
            version: version.clone(),
            modified: std::time::UNIX_EPOCH,
        };
        Ok(self.origin_fetcher(&info))
    }
}

/// Origins by the paths of their chunks: a chunk whose path starts with one of the prefixes
/// is fetched from that origin, and any other from the default (the node's cold store).
pub struct Origins {
    pub by_prefix: Vec<(String, Arc<dyn Origin>)>,
    pub default: Arc<dyn Origin>,
}

impl std::fmt::Debug for Origins {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let prefixes: Vec<&str> = self.by_prefix.iter().map(|(p, _)| p.as_str()).collect();
        f.debug_struct("Origins").field("by_prefix", &prefixes).finish_non_exhaustive()
    }
}

impl Origin for Origins {
    fn fetcher(&self, req: &ChunkRequest) -> Result<Arc<dyn Fetcher>, String> {
        let found = self.by_prefix.iter().find(|(prefix, _)| req.key.path.starts_with(prefix.as_str()));
        found.map_or(&self.default, |(_, o)| o).fetcher(req)
    }
}

/// What the peer port serves from.
#[derive(Clone)]
pub struct ServeState {
    pub secret: PeerSecret,
    pub cache: TieredCache,
    pub origin: Arc<dyn Origin>,
    pub metrics: Arc<super::PeerMetrics>,
    pub hot: HotChunks,
    /// Paths whose chunks are never served to peers (`peers.not_shared`).
    pub not_shared: Arc<Vec<PathPattern>>,
    /// The store whose directories this node lists for members that ask it as their owner,
    /// and the listings it made as their owner.
    pub listings: Option<(ObjectSource, Arc<MetaCache>)>,
    /// This node's view of the peer tier, with which it stands in for an owner an asker could
    /// not reach ([`super::PeerTier::serving`]).
    pub tier: Option<Arc<super::PeerTier>>,
}

impl std::fmt::Debug for ServeState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServeState").finish_non_exhaustive()
    }
}

pub fn router(state: ServeState) -> axum::Router {
    axum::Router::new()
        .route(CHUNK_PATH, axum::routing::get(chunk))
        .route(META_PATH, axum::routing::get(meta))
        .with_state(state)
}

/// Serves the peer port on `listener` until `stop` completes.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: ServeState,
    stop: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(state)).with_graceful_shutdown(stop).await
}

/// The refusal to send, unless the request is signed with the cluster's secret.
fn unsigned(s: &ServeState, uri: &Uri, headers: &HeaderMap) -> Option<Response> {
    let pq = uri.path_and_query().map(|p| p.as_str()).unwrap_or(uri.path());
    let auth = headers.get(AUTH_HEADER).and_then(|v| v.to_str().ok());
    let e = s.secret.verify(auth, "GET", pq, now_secs()).err()?;
    s.metrics.refused.inc();
    tracing::warn!(error = %e, "peer request refused");
    Some((StatusCode::UNAUTHORIZED, e.to_string()).into_response())
}

/// A listing, stat or tree, for a member that asks this node as the path's owner. The answer
/// starts at once, as a chunk's does; what the store said, or why it failed, follows.
async fn meta(State(s): State<ServeState>, uri: Uri, headers: HeaderMap) -> Response {
    if let Some(refused) = unsigned(&s, &uri, &headers) {
        return refused;
    }
    let req = match MetaRequest::from_query(uri.query().unwrap_or_default()) {
        Ok(r) => r,
        Err(e) => return (StatusCode::BAD_REQUEST, e).into_response(),
    };
    if s.not_shared.iter().any(|p| p.matches(&req.shared_as())) {
        return (StatusCode::NOT_FOUND, "this path is not shared with peers").into_response();
    }
    let Some((source, meta)) = s.listings.clone() else {
        return (StatusCode::NOT_FOUND, "this node lists no store for peers").into_response();
    };
    let served = s.metrics.listings_served.clone();
    let listed = async move { meta.answer(&source, &req).await };
    let frames = futures::stream::once(listed).flat_map(move |got| match got {
        Ok(l) => {
            served.inc();
            let json = serde_json::to_vec(&l.answer()).expect("a listing serialises");
            futures::stream::iter([Ok(Frame::data(Bytes::from(json)))]).boxed()
        }
        Err(e) => failure(StatusCode::BAD_GATEWAY, &e.to_string()),
    });
    (StatusCode::OK, Body::new(StreamBody::new(frames))).into_response()
}

async fn chunk(State(s): State<ServeState>, uri: Uri, headers: HeaderMap) -> Response {
    if let Some(refused) = unsigned(&s, &uri, &headers) {
        return refused;
    }
    let req = match ChunkRequest::from_query(uri.query().unwrap_or_default()) {
        Ok(r) => r,
        Err(e) => return (StatusCode::BAD_REQUEST, e).into_response(),
    };
    if s.not_shared.iter().any(|p| p.matches(&req.key.path)) {
        return (StatusCode::NOT_FOUND, "this path is not shared with peers").into_response();
    }
    let (fetcher, mut guard): (Arc<dyn Fetcher>, Option<SendGuard>) = if req.ask == Ask::Holder {
        // Only what this node holds or is receiving now: a holder never fetches for another.
        if s.cache.location(&req.key).is_none() && !s.cache.fetching(&req.key) {
            return (StatusCode::NOT_FOUND, "this member does not hold the chunk").into_response();
        }
        (Arc::new(NotHeld), None)
    } else {
        let fetcher = match s.origin.fetcher(&req) {
            Ok(f) => f,
            Err(why) => return (StatusCode::NOT_FOUND, why).into_response(),
        };
        let fetcher = match &s.tier {
            Some(tier) => tier.serving(fetcher, &req),
            None => fetcher,
        };
        match s.hot.admit(req.key.id(), req.from.as_deref(), req.ask == Ask::Owner) {
            Admission::Send(guard) => (fetcher, Some(guard)),
            Admission::Redirect(to) => {
                s.metrics.redirects.inc();
                return (StatusCode::TEMPORARY_REDIRECT, [(HOLDER_HEADER, to)], "").into_response();
            }
        }
    };
    // The answer starts at once, before the chunk is fetched: that an owner is alive and
    // serving is told within the asker's short first-byte timeout, however slow the origin.
    // Then each piece goes as it arrives from the origin (or from the member this node is
    // receiving the chunk from), not once the chunk is whole: store and forward would cost a
    // chunk's transfer time at every hop.
    let sent = if guard.is_some() { s.metrics.served_bytes.clone() } else { s.metrics.holder_served_bytes.clone() };
    let start = req.start;
    let streamed = async move { s.cache.stream(&req.key, fetcher).await };
    let frames = futures::stream::once(streamed).flat_map(move |got| {
        let mut sending = Sending {
            tail: None,
            answer: None,
            whole: None,
            rest: Bytes::new(),
            start,
            seen: 0,
            crc: Crc32c::default(),
            unchecked: false,
            guard: guard.take(),
            sent: sent.clone(),
        };
        match got {
            Ok(Streamed::Whole(bytes)) => {
                sending.take(bytes.clone());
                sending.whole = Some(Ok(bytes));
            }
            Ok(Streamed::Arriving { tail, answer }) => {
                (sending.tail, sending.answer) = (Some(tail), Some(answer));
            }
            Err(e) => sending.whole = Some(Err(e)),
        }
        futures::stream::unfold(sending, |mut s| async move {
            s.next().await.map(|f| (Ok::<_, std::convert::Infallible>(f), s))
        })
        .boxed()
    });
    (StatusCode::OK, Body::new(StreamBody::new(frames))).into_response()
}

type Frames = futures::stream::BoxStream<'static, Result<Frame<Bytes>, std::convert::Infallible>>;

/// How much of a chunk goes in one piece of the body at most: the transfer counts against the
/// hot bound until its last piece is taken, and a requester sees progress piece by piece.
const PIECE: usize = 256 << 10;

/// One chunk's answer as it goes out: the pieces past the asker's `start` as they arrive, then
/// trailers with the whole chunk's CRC32C, or why there is no chunk. The CRC is of what this
/// node sent, and it is sent only if that is the chunk the fetch answered with.
struct Sending {
    tail: Option<Tail>,
    answer: Option<BoxFuture<'static, Result<Bytes, CacheError>>>,
    whole: Option<Result<Bytes, CacheError>>,
    /// What is yet to go of the last piece taken.
    rest: Bytes,
    start: u64,
    /// Bytes of the chunk taken so far, sent or skipped, and their CRC32C.
    seen: u64,
    crc: Crc32c,
    /// Whether any piece came before the fetch's answer, and so must be checked against it.
    unchecked: bool,
    /// Held until the last piece has been taken by the connection.
    guard: Option<SendGuard>,
    sent: Counter,
}

impl Sending {
    fn take(&mut self, piece: Bytes) {
        self.crc.update(&piece);
        let from = self.seen;
        self.seen += piece.len() as u64;
        if self.seen > self.start {
            self.rest = piece.slice(self.start.saturating_sub(from) as usize..);
        }
    }

    async fn next(&mut self) -> Option<Frame<Bytes>> {
        loop {
            if !self.rest.is_empty() {
                let piece = self.rest.split_to(self.rest.len().min(PIECE));
                self.sent.inc_by(piece.len() as u64);
                return Some(Frame::data(piece));
            }
            if let Some(tail) = self.tail.as_mut() {
                match tail.next().await {
                    Some(piece) => {
                        self.unchecked = true;
                        self.take(piece);
                    }
                    None => self.tail = None,
                }
                continue;
            }
            if let Some(answer) = self.answer.take() {
                let got = answer.await;
                if let Ok(bytes) = &got
                    && (self.seen as usize) < bytes.len()
                {
                    self.take(bytes.slice(self.seen as usize..));
                }
                self.whole = Some(got);
                continue;
            }
            let whole = self.whole.take()?;
            self.guard = None;
            return Some(Frame::trailers(self.verdict(whole)));
        }
    }

    fn verdict(&self, whole: Result<Bytes, CacheError>) -> HeaderMap {
        let bytes = match whole {
            Ok(b) => b,
            // The origin's own error, for the requester's log: it goes to the origin itself next.
            Err(e) => return failure_trailers(StatusCode::BAD_GATEWAY, &e.to_string()),
        };
        if self.start > bytes.len() as u64 {
            let why = format!("byte {} is past the {}-byte chunk", self.start, bytes.len());
            return failure_trailers(StatusCode::BAD_REQUEST, &why);
        }
        let crc = self.crc.finish();
        if self.seen != bytes.len() as u64 || (self.unchecked && crc != crc32c(&bytes)) {
            // The fetch began again after a bad answer, say: what went is not the chunk.
            let why = "the bytes sent as they arrived are not the chunk the fetch answered with";
            return failure_trailers(StatusCode::BAD_GATEWAY, why);
        }
        trailers(&[(CRC_TRAILER, format!("{crc:08x}"))])
    }
}

/// A failure found once the answer had started: no data, and the status and why in trailers.
fn failure(status: StatusCode, why: &str) -> Frames {
    let t = failure_trailers(status, why);
    futures::stream::once(async move { Ok(Frame::trailers(t)) }).boxed()
}

/// The trailers of a failure found once the answer had started: its status, and why.
fn failure_trailers(status: StatusCode, why: &str) -> HeaderMap {
    // A header value holds visible ASCII and spaces only, and a reason needs no more than a line.
    let why: String = why.chars().map(|c| if c == ' ' || c.is_ascii_graphic() { c } else { '?' }).take(300).collect();
    trailers(&[(STATUS_TRAILER, status.as_u16().to_string()), (ERROR_TRAILER, why)])
}

fn trailers(fields: &[(&'static str, String)]) -> HeaderMap {
    fields
        .iter()
        .filter_map(|(name, value)| Some((HeaderName::from_static(name), HeaderValue::from_str(value).ok()?)))
        .collect()
}

/// The fetcher of a holder: the chunk was in a tier or in flight a moment ago, and is not now.
struct NotHeld;

impl Fetcher for NotHeld {
    fn fetch(&self, key: &ChunkKey) -> BoxFuture<'static, Result<Bytes, FetchError>> {
        let e = std::io::Error::new(std::io::ErrorKind::NotFound, format!("{key} is no longer held here"));
        Box::pin(std::future::ready(Err(Arc::new(e) as FetchError)))
    }
}
