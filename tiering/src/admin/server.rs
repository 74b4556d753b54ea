//! The admin API server. Every handler's error is logged here, once, and returned to the caller
//! as `{"error": "..."}` with a fitting status code.

use super::api::*;
use crate::cache::{Moved, TieredCache};
use crate::error::CacheError;
use crate::pattern::PathPattern;
use crate::policy::Policy;
use crate::source::ObjectSource;
use crate::warmup::{self, JobStatus, Progress};
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tracing::{info, instrument, warn};

/// What the handlers share.
#[derive(Debug, Clone)]
pub struct AdminState {
    pub cache: TieredCache,
    pub source: ObjectSource,
    pub policy_file: PathBuf,
    policy_lock: Arc<std::sync::Mutex<()>>,
    jobs: Arc<Mutex<HashMap<u64, Arc<Progress>>>>,
    next_job: Arc<AtomicU64>,
}

impl AdminState {
    pub fn new(cache: TieredCache, source: ObjectSource, policy_file: PathBuf) -> Self {
        AdminState {
            cache,
            source,
            policy_file,
            policy_lock: Default::default(),
            jobs: Default::default(),
            next_job: Arc::new(AtomicU64::new(1)),
        }
    }
}

const MAX_JOBS: usize = 256;

struct Failure(StatusCode, String);

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        warn!(status = %self.0, error = %self.1, "admin request failed");
        (self.0, Json(ApiError { error: self.1 })).into_response()
    }
}

fn bad(msg: impl Into<String>) -> Failure {
    Failure(StatusCode::BAD_REQUEST, msg.into())
}

impl From<CacheError> for Failure {
    fn from(e: CacheError) -> Self {
        let code = match e {
            CacheError::PinTooLarge { .. } | CacheError::NoSuchTier(_) | CacheError::NoCache(_) => StatusCode::CONFLICT,
            CacheError::TierFull { .. } => StatusCode::INSUFFICIENT_STORAGE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        Failure(code, e.to_string())
    }
}

type Reply<T> = Result<Json<T>, Failure>;

fn patterns(paths: &[String]) -> Result<Vec<PathPattern>, Failure> {
    if paths.is_empty() {
        return Err(bad("give at least one path"));
    }
    paths.iter().map(|p| PathPattern::parse(p).map_err(bad)).collect()
}

pub fn router(state: AdminState) -> Router {
    Router::new()
        .route(STATUS, get(status))
        .route(POLICY, get(policy_show).put(policy_set))
        .route(PIN, post(pin))
        .route(UNPIN, post(unpin))
        .route(WARMUP, post(warmup_start))
        .route(&format!("{JOBS}/{{id}}"), get(job))
        .route(EVICT, post(evict))
        .route(DEMOTE, post(demote))
        .route(APPLY, post(apply))
        .route(&format!("{READ}/{{*path}}"), get(read))
        .with_state(state)
}

#[instrument(name = "admin", skip_all, fields(op = "status"))]
async fn status(State(s): State<AdminState>) -> Json<StatusReport> {
    Json(StatusReport {
        cold: s.source.describe().to_string(),
        chunk_size: s.source.chunk_size(),
        cache: s.cache.status(),
        peers: s.source.peers().map(|t| peers_status(t)),
    })
}

fn peers_status(t: &crate::peer::PeerTier) -> crate::admin::api::PeersStatus {
    let m = t.metrics();
    let members = t
        .members()
        .into_iter()
        .map(|(name, suspect)| {
            let state = if t.is_self(&name) {
                "self"
            } else if suspect {
                "suspect"
            } else {
                "ok"
            };
            crate::admin::api::PeerMember { name, state: state.into() }
        })
        .collect();
    crate::admin::api::PeersStatus {
        members,
        received_bytes: m.peer_bytes.get(),
        origin_bytes: m.origin_bytes.get(),
        served_bytes: m.served_bytes.get(),
        holder_served_bytes: m.holder_served_bytes.get(),
        redirects: m.redirects.get(),
        redirected: m.redirected.get(),
        resumed: m.resumed.get(),
        stood_in: m.stood_in.get(),
        listings_received: m.listings_received.get(),
        listings_served: m.listings_served.get(),
        errors: m.peer_errors.get(),
        timeouts: m.peer_timeouts.get(),
        corrupt: m.peer_corrupt.get(),
        origin_fallbacks: m.origin_fallbacks.get(),
        refused: m.refused.get(),
    }
}

fn policy_view(s: &AdminState) -> PolicyView {
    PolicyView { file: s.policy_file.clone(), policy: s.cache.policy().to_toml(), pins: s.cache.pins() }
}

#[instrument(name = "admin", skip_all, fields(op = "policy_show"))]
async fn policy_show(State(s): State<AdminState>) -> Json<PolicyView> {
    Json(policy_view(&s))
}

#[instrument(name = "admin", skip_all, fields(op = "policy_set"))]
async fn policy_set(State(s): State<AdminState>, body: String) -> Reply<PolicyView> {
    let warm = s.cache.status().tier(crate::tier::TierKind::Warm).is_some();
    let policy = Policy::from_toml(&body)
        .and_then(|p| p.check_tiers(warm).map(|()| p))
        .map_err(|e| bad(format!("policy rejected, nothing changed: {e}")))?;
    // One set at a time, so the file on disk and the policy in force are the same one.
    let _one = s.policy_lock.lock().unwrap_or_else(|p| p.into_inner());
    // Persist first: a policy that cannot be saved would silently revert at the next restart.
    // Durably: an empty or torn file after a power cut would drop every rule, or stop the daemon.
    crate::restore::write_durably(&s.policy_file, body.as_bytes()).map_err(|e| {
        Failure(StatusCode::INTERNAL_SERVER_ERROR, format!("cannot write policy file {}: {e}", s.policy_file.display()))
    })?;
    s.cache.set_policy(policy);
    info!(file = %s.policy_file.display(), "policy replaced");
    Ok(Json(policy_view(&s)))
}

#[instrument(name = "admin", skip_all, fields(op = "pin"))]
async fn pin(State(s): State<AdminState>, Json(r): Json<PinRequest>) -> Reply<Moved> {
    let mut total = Moved::default();
    for p in patterns(&r.paths)? {
        let m = s.cache.pin(p, r.tier).await?;
        total.chunks += m.chunks;
        total.bytes += m.bytes;
    }
    Ok(Json(total))
}

#[instrument(name = "admin", skip_all, fields(op = "unpin"))]
async fn unpin(State(s): State<AdminState>, Json(r): Json<PathsRequest>) -> Reply<UnpinResult> {
    let mut removed = 0;
    for p in patterns(&r.paths)? {
        removed += s.cache.unpin(p).await?;
    }
    Ok(Json(UnpinResult { removed }))
}

#[instrument(name = "admin", skip_all, fields(op = "warmup_start"))]
async fn warmup_start(State(s): State<AdminState>, Json(r): Json<WarmupRequest>) -> Reply<JobCreated> {
    let pats = patterns(&r.paths)?;
    if r.parallel == 0 || r.parallel > 1024 {
        return Err(bad("parallel must be between 1 and 1024"));
    }
    if !s.cache.has_tier(r.tier) {
        return Err(CacheError::NoSuchTier(r.tier).into());
    }
    let id = s.next_job.fetch_add(1, Ordering::Relaxed);
    let progress = Arc::new(Progress::default());
    {
        let mut jobs = s.jobs.lock().unwrap_or_else(|p| p.into_inner());
        // Keep the newest jobs for `strata tier` to poll; forget finished ones beyond that.
        while jobs.len() >= MAX_JOBS {
            let oldest = jobs.iter().filter(|(_, p)| p.finished()).map(|(k, _)| *k).min();
            match oldest {
                Some(k) => jobs.remove(&k),
                None => break,
            };
        }
        jobs.insert(id, progress.clone());
    }
    tokio::spawn(warmup::run(s.cache.clone(), s.source.clone(), pats, r.tier, r.parallel, progress));
    Ok(Json(JobCreated { id }))
}

#[instrument(name = "admin", skip_all, fields(op = "job"))]
async fn job(State(s): State<AdminState>, Path(id): Path<u64>) -> Reply<JobStatus> {
    let jobs = s.jobs.lock().unwrap_or_else(|p| p.into_inner());
    let p = jobs.get(&id).ok_or_else(|| Failure(StatusCode::NOT_FOUND, format!("no warm-up job {id}")))?;
    Ok(Json(p.snapshot(id)))
}

#[instrument(name = "admin", skip_all, fields(op = "evict"))]
async fn evict(State(s): State<AdminState>, Json(r): Json<PathsRequest>) -> Reply<Moved> {
    let mut total = Moved::default();
    for p in patterns(&r.paths)? {
        let m = s.cache.evict(p).await?;
        total.chunks += m.chunks;
        total.bytes += m.bytes;
        total.skipped_pinned += m.skipped_pinned;
    }
    Ok(Json(total))
}

#[instrument(name = "admin", skip_all, fields(op = "demote"))]
async fn demote(State(s): State<AdminState>, Json(r): Json<DemoteRequest>) -> Reply<Moved> {
    Ok(Json(s.cache.demote(r.idle.map(|d| d.0)).await?))
}

#[instrument(name = "admin", skip_all, fields(op = "apply"))]
async fn apply(State(s): State<AdminState>) -> Reply<crate::cache::PolicyPass> {
    Ok(Json(s.cache.apply_policy().await?))
}

/// Chunks a read through the admin socket asks for ahead of the one it sends, as a mount's
/// sequential read-ahead does: a reader that waited for each chunk before asking the next would
/// pay a round trip through the owner (and its origin fetch) per chunk.
const READ_AHEAD: usize = 4;

/// Streams an object through the cache, chunk by chunk and in order, so operators and tests
/// can check that what the cache serves equals the source.
#[instrument(name = "admin", skip_all, fields(op = "read"))]
async fn read(State(s): State<AdminState>, Path(path): Path<String>) -> Result<Response, Failure> {
    let info = s.source.head(&path).await.map_err(|e| Failure(StatusCode::BAD_GATEWAY, e.to_string()))?;
    let fetcher = s.source.fetcher(&info);
    let keys = s.source.chunk_keys(&info);
    let cache = s.cache.clone();
    let len = info.size;
    let chunks = futures::stream::iter(keys)
        .map(move |key| {
            let (cache, fetcher) = (cache.clone(), fetcher.clone());
            async move {
                cache.get(&key, fetcher, Default::default()).await.map_err(|e| {
                    warn!(error = %e, "read through the cache failed mid-stream");
                    std::io::Error::other(e.to_string())
                })
            }
        })
        .buffered(READ_AHEAD);
    Ok(([("content-length", len.to_string())], axum::body::Body::from_stream(chunks)).into_response())
}
