//! Filling a lazy layer: the prefetch region (everything before `.prefetch.landmark`) in one
//! ranged read, then the rest of the layer in the background, in blob order and in large
//! ranges, always yielding to reads a container is waiting on. Every chunk is checked against
//! its digest before it is cached, and chunks already cached are skipped.

use crate::estargz::{Chunk, Landmark};
use crate::fetch::{InFlight, StreamError, cache_stream, stream_and_cache};
use crate::layer::{Blob, LayerNamespace};
use crate::registry::RegistryError;
use crate::registry::range_stream::RangeStream;
use serde::{Deserialize, Serialize};
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
        tokio::time::timeout(limit, rx.wait_for(|s| !matches!(s, Stage::Waiting | Stage::Running))).await.is_ok()
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

/// The request for a layer's prefetch region, made before its TOC was parsed: bytes `0..end`.
/// Stopped when dropped unused.
#[derive(Debug)]
pub struct EarlyPrefetch {
    pub end: u64,
    pub request: tokio::task::JoinHandle<Result<RangeStream, RegistryError>>,
}

impl Drop for EarlyPrefetch {
    fn drop(&mut self) {
        self.request.abort();
    }
}

impl EarlyPrefetch {
    /// This request, if it is for the region the parsed TOC gives (bytes `0..end`).
    fn confirmed(self, end: u64, layer: &str) -> Option<EarlyPrefetch> {
        if self.end != end {
            tracing::debug!(layer, hint = self.end, landmark = end, "the early prefetch request was for another range");
            return None;
        }
        Some(self)
    }

    /// The answer, once it starts; `None` if the request failed.
    async fn answer(mut self, layer: &str) -> Option<RangeStream> {
        match (&mut self.request).await {
            Ok(Ok(stream)) => Some(stream),
            Ok(Err(e)) => {
                tracing::debug!(layer, error = %e, "the early prefetch request failed; asking again");
                None
            }
            Err(_) => None,
        }
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
    match prefetch_size(&ns) {
        Some(end) => {
            progress.prefetch.send_replace(Stage::Running);
            let region: Vec<&(String, Chunk)> = pieces.iter().filter(|(_, c)| c.compressed_end <= end).collect();
            let early = early.and_then(|e| e.confirmed(end, &blob.digest));
            match fetch_group(&blob, &cache, &region, &progress, true, early).await {
                Ok(()) => {
                    progress.prefetch.send_replace(Stage::Done);
                }
                Err(e) => {
                    tracing::warn!(layer = %blob.digest, error = %e, "prefetch failed; reads fetch on demand");
                    progress.fail(&progress.prefetch, e.to_string());
                }
            }
        }
        None => {
            progress.prefetch.send_replace(Stage::None);
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
        if let Err(e) = background_group(&blob, &cache, group, &progress).await {
            tracing::warn!(layer = %blob.digest, error = %e, "background fetch stopped; reads fetch on demand");
            progress.fail(&progress.background, e.to_string());
            return;
        }
    }
    progress.background.send_replace(Stage::Done);
}

/// A background range, fetched only when no container read is waiting on this layer.
async fn background_group(
    blob: &Arc<Blob>,
    cache: &TieredCache,
    group: &[&(String, Chunk)],
    progress: &Progress,
) -> Result<(), StreamError> {
    while blob.demand.load(Ordering::Relaxed) > 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    fetch_group(blob, cache, group, progress, false, None).await
}

/// Fetches the compressed range that covers `group` in one request, and caches each of its
/// chunks that is not cached yet as its bytes arrive. With `shared`, the range is in flight
/// meanwhile, so a container read of one of its chunks waits for it rather than fetching it
/// again: right for the prefetch region, which a starting container reads; a background range
/// is not shared, since a read of its last chunk would wait for all 8 MiB before it.
async fn fetch_group(
    blob: &Arc<Blob>,
    cache: &TieredCache,
    group: &[&(String, Chunk)],
    progress: &Progress,
    shared: bool,
    asked: Option<EarlyPrefetch>,
) -> Result<(), StreamError> {
    let key = |(path, c): &(String, Chunk)| ChunkKey::digest(path.clone(), c.digest.clone());
    let missing: Vec<(String, Chunk)> = group
        .iter()
        .copied()
        .filter(|p| {
            let cached = cache.location(&key(p)).is_some();
            if cached {
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
        let whole = 0..early.end;
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    /// Set when the request it is part of is dropped (stopped).
    struct Stopped(Arc<AtomicBool>);

    impl Drop for Stopped {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    async fn soon(flag: &AtomicBool) -> bool {
        for _ in 0..100 {
            if flag.load(Ordering::SeqCst) {
                return true;
            }
            tokio::task::yield_now().await;
        }
        false
    }

    fn pending_request(stopped: &Arc<AtomicBool>) -> EarlyPrefetch {
        let guard = Stopped(stopped.clone());
        let request = tokio::spawn(async move {
            let _guard = guard;
            std::future::pending::<Result<RangeStream, RegistryError>>().await
        });
        EarlyPrefetch { end: 4096, request }
    }

    #[tokio::test]
    async fn an_early_request_for_another_region_is_stopped_not_used() {
        let stopped = Arc::new(AtomicBool::new(false));
        let early = pending_request(&stopped);
        assert!(early.confirmed(8192, "layer").is_none(), "the parsed TOC's region ends elsewhere");
        assert!(soon(&stopped).await, "the request was stopped");
    }

    #[tokio::test]
    async fn an_early_request_that_failed_is_asked_again() {
        let request = tokio::spawn(async {
            Err(RegistryError::Blob { url: "http://registry/blob".into(), reason: "refused".into() })
        });
        let early = EarlyPrefetch { end: 4096, request }.confirmed(4096, "layer").expect("the region confirmed");
        assert!(early.answer("layer").await.is_none());
        let stopped = Arc::new(AtomicBool::new(false));
        drop(pending_request(&stopped));
        assert!(soon(&stopped).await, "an early request dropped unused is stopped");
    }
}
