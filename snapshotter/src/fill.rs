//! Filling a lazy layer: the prefetch region (everything before `.prefetch.landmark`) in one
//! ranged read, with the files every container start reads beside it, then the rest of the
//! layer in the background, in blob order and in large ranges, always yielding to reads a
//! container is waiting on. Every chunk is checked against its digest before it is cached, and
//! chunks already cached are skipped.

use crate::early::EarlyPrefetch;
use crate::estargz::{Chunk, Landmark};
use crate::fetch::{InFlight, StreamError, cache_stream, stream_and_cache};
use crate::layer::{Blob, LayerNamespace};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use strata_tiering::{ChunkKey, TieredCache};
use tokio::sync::watch;

/// Compressed bytes one background request covers at most.
const GROUP_BYTES: u64 = 8 << 20;

/// Where a fill stage is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Stage {
    /// Nothing to do (no landmark; background fill turned off).
    None,
    Waiting,
    Running,
    Done,
    Failed,
}

impl Stage {
    /// Not over yet: still to start, or running.
    pub fn pending(&self) -> bool {
        matches!(self, Stage::Waiting | Stage::Running)
    }
}

/// Progress of one layer's fill, as `strata image layers` shows it.
#[derive(Debug)]
pub struct Progress {
    pub chunks_total: AtomicU64,
    pub chunks_cached: AtomicU64,
    prefetch: watch::Sender<Stage>,
    background: watch::Sender<Stage>,
    error: Mutex<Option<String>>,
}

impl Progress {
    pub fn new(chunks_total: u64) -> Progress {
        Progress {
            chunks_total: AtomicU64::new(chunks_total),
            chunks_cached: AtomicU64::new(0),
            prefetch: watch::Sender::new(Stage::Waiting),
            background: watch::Sender::new(Stage::Waiting),
            error: Mutex::new(None),
        }
    }

    pub fn prefetch(&self) -> Stage {
        *self.prefetch.borrow()
    }

    pub fn background(&self) -> Stage {
        *self.background.borrow()
    }

    pub fn error(&self) -> Option<String> {
        self.error.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Waits until the prefetch is over (done, failed or not needed), at most `limit`.
    /// Returns whether it is over.
    pub async fn prefetched(&self, limit: Duration) -> bool {
        let mut rx = self.prefetch.subscribe();
        tokio::time::timeout(limit, rx.wait_for(|s| !s.pending())).await.is_ok()
    }

    pub(crate) fn set_prefetch(&self, stage: Stage) {
        self.prefetch.send_replace(stage);
    }

    fn fail(&self, stage: &watch::Sender<Stage>, why: String) {
        *self.error.lock().unwrap_or_else(|p| p.into_inner()) = Some(why);
        stage.send_replace(Stage::Failed);
    }
}

/// The compressed bytes the landmark asks to have before a container starts, if any.
pub fn prefetch_size(ns: &LayerNamespace) -> Option<u64> {
    match ns.landmark() {
        Landmark::Prefetch { offset } => Some(offset),
        _ => None,
    }
}

/// Runs the prefetch, then (if `background` is given) the rest of the layer, once the node has
/// had no container reads for that long. The prefetch reads from `early` if it asked for the
/// region the TOC gives.
pub async fn fill(
    ns: LayerNamespace,
    cache: TieredCache,
    progress: Arc<Progress>,
    background: Option<Duration>,
    early: Option<EarlyPrefetch>,
) {
    let pieces = ns.pieces();
    let blob = ns.blob().clone();
    let region_end = prefetch_size(&ns);
    let runtime = runtime_pieces(&ns, region_end.unwrap_or(0));
    let runtime = fetch_runtime_files(&blob, &cache, &runtime, &progress);
    // The chunks counted in `progress` already, by offset: the background pass, which goes
    // over every chunk, counts each of the others once.
    let mut counted = HashSet::new();
    match region_end {
        Some(end) => {
            progress.set_prefetch(Stage::Running);
            let region: Vec<&(String, Chunk)> = pieces.iter().filter(|(_, c)| c.compressed_end <= end).collect();
            let early = early.and_then(|e| e.confirmed(end, &blob.digest));
            let none = HashSet::new();
            let (fetched, ran) =
                tokio::join!(fetch_group(&blob, &cache, &region, &progress, true, early, &none), runtime);
            counted.extend(ran);
            match fetched {
                Ok(()) => {
                    counted.extend(region.iter().map(|(_, c)| c.offset));
                    progress.set_prefetch(Stage::Done);
                }
                Err(e) => {
                    tracing::warn!(layer = %blob.digest, error = %e, "prefetch failed; reads fetch on demand");
                    progress.fail(&progress.prefetch, e.to_string());
                }
            }
        }
        None => {
            progress.set_prefetch(Stage::None);
            counted.extend(runtime.await);
        }
    }
    let Some(quiet) = background else {
        progress.background.send_replace(Stage::None);
        return;
    };
    // Containers starting now need the link more than this layer's remaining chunks do.
    blob.activity.quiet(quiet).await;
    progress.background.send_replace(Stage::Running);
    // Consecutive chunks, as many as fit in one request.
    let mut groups: Vec<Vec<&(String, Chunk)>> = Vec::new();
    for piece in pieces.iter() {
        let fits = groups
            .last()
            .and_then(|g| g.first())
            .is_some_and(|first| piece.1.compressed_end - first.1.offset <= GROUP_BYTES);
        match groups.last_mut() {
            Some(g) if fits => g.push(piece),
            _ => groups.push(vec![piece]),
        }
    }
    for group in &groups {
        if let Err(e) = background_group(&blob, &cache, group, &progress, &counted).await {
            tracing::warn!(layer = %blob.digest, error = %e, "background fetch stopped; reads fetch on demand");
            progress.fail(&progress.background, e.to_string());
            return;
        }
    }
    progress.background.send_replace(Stage::Done);
}

/// Files the runtime reads from every container's root file system as the container starts,
/// whatever the image recorded as its start-up files: runc resolves the container's user and
/// groups from them. Recordings made outside a real runc start (`ctr-remote image optimize`'s)
/// leave them out, and each then costs a round trip while the container starts.
const RUNTIME_FILES: [&str; 2] = ["etc/passwd", "etc/group"];

/// The chunks of [`RUNTIME_FILES`] that the layer holds past its prefetch region (which ends at
/// `region_end`).
fn runtime_pieces(ns: &LayerNamespace, region_end: u64) -> Vec<(String, Chunk)> {
    RUNTIME_FILES
        .iter()
        .filter_map(|path| Some((*path, ns.file_chunks(path)?)))
        .flat_map(|(path, chunks)| {
            chunks.iter().filter(|c| c.compressed_end > region_end).map(move |c| (path.to_owned(), c.clone()))
        })
        .collect()
}

/// Fetches `files` (from [`runtime_pieces`]) beside the prefetch region, a request each, all
/// at once: they are a few hundred bytes each, and apart. A container starting meanwhile waits
/// for them rather than asking again; one that failed is left to the container's own read.
/// Returns the offsets of those it counted as cached.
async fn fetch_runtime_files(
    blob: &Arc<Blob>,
    cache: &TieredCache,
    files: &[(String, Chunk)],
    progress: &Progress,
) -> Vec<u64> {
    let none = HashSet::new();
    let fetches =
        files.iter().map(|piece| async { fetch_group(blob, cache, &[piece], progress, true, None, &none).await });
    let mut counted = Vec::new();
    for (fetched, (path, c)) in futures::future::join_all(fetches).await.into_iter().zip(files) {
        match fetched {
            Ok(()) => counted.push(c.offset),
            Err(e) => {
                tracing::debug!(layer = %blob.digest, path, error = %e, "a file every container start reads was not fetched ahead")
            }
        }
    }
    counted
}

/// A background range, fetched only when no container read is waiting on this layer.
async fn background_group(
    blob: &Arc<Blob>,
    cache: &TieredCache,
    group: &[&(String, Chunk)],
    progress: &Progress,
    counted: &HashSet<u64>,
) -> Result<(), StreamError> {
    while blob.demand.load(Ordering::Relaxed) > 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    fetch_group(blob, cache, group, progress, false, None, counted).await
}

/// Fetches the compressed range that covers `group` in one request, and caches each of its
/// chunks that is not cached yet as its bytes arrive. With `shared`, the range is in flight
/// meanwhile, so a container read of one of its chunks waits for it rather than fetching it
/// again: right for the prefetch region, which a starting container reads; a background range
/// is not shared, since a read of its last chunk would wait for all 8 MiB before it. Chunks
/// found cached count in `progress` unless their offsets are in `counted`.
async fn fetch_group(
    blob: &Arc<Blob>,
    cache: &TieredCache,
    group: &[&(String, Chunk)],
    progress: &Progress,
    shared: bool,
    asked: Option<EarlyPrefetch>,
    counted: &HashSet<u64>,
) -> Result<(), StreamError> {
    let key = |(path, c): &(String, Chunk)| ChunkKey::digest(path.clone(), c.digest.clone());
    let missing: Vec<(String, Chunk)> = group
        .iter()
        .copied()
        .filter(|p| {
            let cached = cache.location(&key(p)).is_some();
            if cached && !counted.contains(&p.1.offset) {
                progress.chunks_cached.fetch_add(1, Ordering::Relaxed);
            }
            !cached
        })
        .cloned()
        .collect();
    let (Some(first), Some(end)) = (missing.first(), missing.iter().map(|(_, c)| c.compressed_end).max()) else {
        return Ok(());
    };
    let range = first.1.offset..end;
    let count = missing.len() as u64;
    if let Some(early) = asked {
        // The range is in flight from the moment it was asked for: a container that starts
        // before the answer does must wait for it, not fetch the bytes again.
        let whole = early.range.clone();
        let _in_flight = shared.then(|| InFlight::begin(blob, whole.clone(), false));
        if whole.end >= range.end
            && let Some(stream) = early.answer(&blob.digest).await
        {
            cache_stream(blob, cache, stream, 0, bytes::BytesMut::new(), missing, || {}).await?;
            progress.chunks_cached.fetch_add(count, Ordering::Relaxed);
            return Ok(());
        }
    }
    let _in_flight = shared.then(|| InFlight::begin(blob, range.clone(), false));
    stream_and_cache(blob, cache, range, missing, || {}).await?;
    progress.chunks_cached.fetch_add(count, Ordering::Relaxed);
    Ok(())
}
