//! Warm-up: preload every chunk of the objects under some paths into a tier, in parallel, with
//! progress that the CLI polls.

use crate::cache::{Fetcher, GetOptions, TieredCache};
use crate::error::CacheError;
use crate::key::ChunkKey;
use crate::pattern::PathPattern;
use crate::source::{ObjectInfo, ObjectSource};
use crate::tier::TierKind;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

const MAX_ERRORS: usize = 20;

type WorkItem = (ChunkKey, Arc<dyn Fetcher + 'static>, u64);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    Listing,
    Running,
    Done,
    Failed,
}

/// Live progress of one warm-up job.
#[derive(Debug)]
pub struct Progress {
    started: Instant,
    state: AtomicU8,
    objects: AtomicU64,
    chunks_total: AtomicU64,
    chunks_done: AtomicU64,
    chunks_failed: AtomicU64,
    chunks_cached_before: AtomicU64,
    chunks_elsewhere: AtomicU64,
    bytes_total: AtomicU64,
    bytes_done: AtomicU64,
    errors: Mutex<Vec<String>>,
}

/// A snapshot of [`Progress`], as the admin API returns it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobStatus {
    pub id: u64,
    pub state: JobState,
    pub objects: u64,
    pub chunks_total: u64,
    pub chunks_done: u64,
    pub chunks_failed: u64,
    /// Chunks that were already in a local tier.
    pub chunks_cached_before: u64,
    /// Chunks cached, but in the other tier, because the asked-for tier had no room (it is full
    /// of pinned data, or its disk failed the write).
    pub chunks_elsewhere: u64,
    pub bytes_total: u64,
    pub bytes_done: u64,
    pub elapsed_ms: u64,
    pub errors: Vec<String>,
}

impl Default for Progress {
    fn default() -> Self {
        Progress {
            started: Instant::now(),
            state: AtomicU8::new(0),
            objects: AtomicU64::new(0),
            chunks_total: AtomicU64::new(0),
            chunks_done: AtomicU64::new(0),
            chunks_failed: AtomicU64::new(0),
            chunks_cached_before: AtomicU64::new(0),
            chunks_elsewhere: AtomicU64::new(0),
            bytes_total: AtomicU64::new(0),
            bytes_done: AtomicU64::new(0),
            errors: Mutex::new(Vec::new()),
        }
    }
}

impl Progress {
    fn set_state(&self, s: JobState) {
        self.state.store(s as u8, Ordering::Release);
    }

    fn error(&self, msg: String) {
        let mut e = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        if e.len() < MAX_ERRORS {
            e.push(msg);
        }
    }

    pub fn finished(&self) -> bool {
        self.state.load(Ordering::Acquire) >= JobState::Done as u8
    }

    pub fn snapshot(&self, id: u64) -> JobStatus {
        let state = match self.state.load(Ordering::Acquire) {
            0 => JobState::Listing,
            1 => JobState::Running,
            2 => JobState::Done,
            _ => JobState::Failed,
        };
        JobStatus {
            id,
            state,
            objects: self.objects.load(Ordering::Relaxed),
            chunks_total: self.chunks_total.load(Ordering::Relaxed),
            chunks_done: self.chunks_done.load(Ordering::Relaxed),
            chunks_failed: self.chunks_failed.load(Ordering::Relaxed),
            chunks_cached_before: self.chunks_cached_before.load(Ordering::Relaxed),
            chunks_elsewhere: self.chunks_elsewhere.load(Ordering::Relaxed),
            bytes_total: self.bytes_total.load(Ordering::Relaxed),
            bytes_done: self.bytes_done.load(Ordering::Relaxed),
            elapsed_ms: self.started.elapsed().as_millis() as u64,
            errors: self.errors.lock().unwrap_or_else(|p| p.into_inner()).clone(),
        }
    }
}

#[tracing::instrument(name = "warmup", skip_all, fields(tier = %tier, parallel = parallel))]
/// Lists the objects under the patterns, then fetches every chunk into `tier` with `parallel`
/// fetches in flight. A chunk that cannot be cached (tier full of pinned data, say) counts as
/// failed with the reason, so the summary never claims more than is there.
pub async fn run(
    cache: TieredCache,
    source: ObjectSource,
    patterns: Vec<PathPattern>,
    tier: TierKind,
    parallel: usize,
    progress: Arc<Progress>,
) {
    let mut objects: Vec<ObjectInfo> = Vec::new();
    for p in &patterns {
        match source.list(p.list_prefix()).await {
            Ok(list) => objects.extend(list.into_iter().filter(|o| p.matches(&o.path))),
            Err(e) => {
                progress.error(e.to_string());
                progress.set_state(JobState::Failed);
                return;
            }
        }
    }
    objects.sort_by(|a, b| a.path.cmp(&b.path));
    objects.dedup_by(|a, b| a.path == b.path);
    let chunk = source.chunk_size();
    let mut work: Vec<WorkItem> = Vec::new();
    for o in &objects {
        let fetcher = source.fetcher(o);
        for key in source.chunk_keys(o) {
            let crate::key::Identity::Object { index, .. } = key.identity else { continue };
            let len = chunk.min(o.size - index * chunk);
            work.push((key, fetcher.clone(), len));
        }
    }
    progress.objects.store(objects.len() as u64, Ordering::Relaxed);
    progress.chunks_total.store(work.len() as u64, Ordering::Relaxed);
    progress.bytes_total.store(work.iter().map(|w| w.2).sum(), Ordering::Relaxed);
    progress.set_state(JobState::Running);
    // Built eagerly: a lazy map over `work` trips a known higher-ranked lifetime limitation of
    // rustc once the future is spawned.
    let jobs: Vec<_> =
        work.into_iter().map(|(key, fetcher, len)| warm_one(cache.clone(), key, fetcher, len, tier)).collect();
    let mut done = futures::stream::iter(jobs).buffer_unordered(parallel.max(1));
    while let Some((key, len, before, r)) = done.next().await {
        match r {
            Ok(()) => {
                if !before && cache.location(&key).is_some_and(|t| t != tier) {
                    progress.chunks_elsewhere.fetch_add(1, Ordering::Relaxed);
                }
                progress.chunks_done.fetch_add(1, Ordering::Relaxed);
                progress.bytes_done.fetch_add(len, Ordering::Relaxed);
                if before {
                    progress.chunks_cached_before.fetch_add(1, Ordering::Relaxed);
                }
            }
            Err(e) => {
                progress.chunks_failed.fetch_add(1, Ordering::Relaxed);
                progress.error(format!("{key}: {e}"));
            }
        }
    }
    let failed = progress.chunks_failed.load(Ordering::Relaxed) > 0;
    progress.set_state(if failed { JobState::Failed } else { JobState::Done });
}

async fn warm_one(
    cache: TieredCache,
    key: ChunkKey,
    fetcher: Arc<dyn Fetcher>,
    len: u64,
    tier: TierKind,
) -> (ChunkKey, u64, bool, Result<(), CacheError>) {
    let before = cache.location(&key).is_some();
    let r = match cache.get(&key, fetcher, GetOptions { tier: Some(tier), wait_cached: true }).await {
        // The read worked but the chunk was not kept; storing it again reports why.
        Ok(data) if cache.location(&key).is_none() => cache.put(key.clone(), data, tier).await.map(|_| ()),
        Ok(_) => Ok(()),
        Err(e) => Err(e),
    };
    (key, len, before, r)
}
