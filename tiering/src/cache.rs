//! The public face of the tiered cache: async reads with coalesced misses, and the operator
//! actions (pin, evict, demote, apply policy) that the admin API exposes.

use crate::core::{Core, Pin};
use crate::error::{CacheError, FetchError};
pub use crate::fetcher::{Fetcher, Streamed};
use crate::index::now_ms;
use crate::key::{ChunkKey, KeyId};
use crate::metrics::{self, Metrics};
use crate::pattern::PathPattern;
use crate::policy::Policy;
use crate::progress::Progress;
use crate::restore;
use crate::status::{CacheStatus, TierStatus};
use crate::tier::{Tier, TierConfig, TierKind};
use bytes::Bytes;
use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing::{Instrument, info, warn};

/// What a read found: the bytes, or the fetch to join.
enum Joined {
    Hit(Bytes),
    Flight(InFlight),
}

/// How a read treats a miss.
#[derive(Debug, Clone, Copy, Default)]
pub struct GetOptions {
    /// Tier to store a fetched chunk in; default: the pinned tier, else hot.
    pub tier: Option<TierKind>,
    /// Return only once a fetched chunk is in a tier (or caching it failed), not as soon as its
    /// bytes arrive. For warm-up, and for callers that check placement right after.
    pub wait_cached: bool,
}

/// Settings the cache needs to open.
#[derive(Debug, Clone)]
pub struct CacheConfig {
    pub hot: TierConfig,
    pub warm: Option<TierConfig>,
    /// Where pins and the access history are kept.
    pub state_dir: PathBuf,
    pub policy: Policy,
}

/// A miss in progress: `data` resolves as soon as the fetcher answers, `cached` once the bytes
/// are in a tier (or caching them failed). The entry leaves the in-flight map only then, so a
/// reader arriving in between joins it instead of fetching again.
#[derive(Clone)]
struct InFlight {
    data: Shared<BoxFuture<'static, Result<Bytes, FetchError>>>,
    cached: Shared<BoxFuture<'static, ()>>,
    progress: Progress,
}

impl std::fmt::Debug for InFlight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("InFlight")
    }
}

/// The tiered chunk cache. Cheap to clone.
#[derive(Clone, Debug)]
pub struct TieredCache {
    core: Arc<Core>,
    inflight: Arc<Mutex<HashMap<KeyId, InFlight>>>,
    /// Background promotions still running.
    background: Arc<std::sync::atomic::AtomicUsize>,
}

/// What a maintenance action did.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Moved {
    pub chunks: u64,
    pub bytes: u64,
    /// Matching chunks left alone because they are pinned.
    pub skipped_pinned: u64,
}

impl TieredCache {
    /// Opens the tiers, rebuilds the index from the files they hold, and restores pins and
    /// access history from the state dir. Blocking: call before serving.
    pub fn open(config: CacheConfig) -> Result<TieredCache, CacheError> {
        let mut policy = config.policy;
        policy.validate().map_err(|e| CacheError::State { path: "policy".into(), message: e.to_string() })?;
        let open = |kind, c: TierConfig| {
            let path = c.path.clone();
            Tier::open(kind, c).map_err(|e| CacheError::io("opening tier directory", &path, e))
        };
        let hot = open(TierKind::Hot, config.hot)?;
        let warm = config.warm.map(|c| open(TierKind::Warm, c)).transpose()?;
        std::fs::create_dir_all(&config.state_dir)
            .map_err(|e| CacheError::io("creating state dir", &config.state_dir, e))?;
        let lock = restore::lock_state_dir(&config.state_dir)?;
        restore::remove_stale_temps(&config.state_dir);
        let mut pins = restore::load_pins(&config.state_dir);
        // A pin made by `strata tier pin --tier warm` outlives a config that drops the warm
        // tier. Held, it would count its chunks as pinned while nothing could keep them (a hot
        // chunk pinned elsewhere is a victim like any other), so it is let go, and said so.
        pins.retain(|p| {
            let kept = p.tier == TierKind::Hot || warm.is_some();
            if !kept {
                warn!(
                    pattern = %p.pattern,
                    tier = p.tier.as_str(),
                    "a saved pin names a tier the config no longer has; the pin is dropped and its chunks are cached as any others"
                );
            }
            kept
        });
        let metrics = Metrics::default();
        let core = Core {
            tiers: [Some(hot), warm],
            index: Default::default(),
            policy: std::sync::RwLock::new(policy),
            pins: std::sync::RwLock::new(pins),
            pin_refreshes: Default::default(),
            pins_saving: Default::default(),
            metrics,
            state_dir: config.state_dir,
            _lock: lock,
        };
        for t in core.tiers.iter().flatten() {
            core.metrics.capacity.get_or_create(&metrics::tier(t.kind)).set(t.capacity() as i64);
        }
        let report = restore::rebuild_index(&core);
        info!(
            chunks = report.chunks,
            bytes = report.bytes,
            discarded = report.discarded,
            "cache index rebuilt from tier directories"
        );
        let cache = TieredCache { core: Arc::new(core), inflight: Default::default(), background: Default::default() };
        // The configured capacity may have shrunk since the files were written.
        for t in TierKind::ALL {
            cache.core.enforce_watermark(t);
        }
        Ok(cache)
    }

    pub fn metrics(&self) -> &Metrics {
        &self.core.metrics
    }

    /// Reads a chunk: hot, then warm (promoting in the background), then the fetcher. Misses on
    /// one chunk share one fetch.
    pub async fn get(&self, key: &ChunkKey, fetcher: Arc<dyn Fetcher>, opts: GetOptions) -> Result<Bytes, CacheError> {
        match self.join(key, fetcher, opts).await? {
            Joined::Hit(bytes) => Ok(bytes),
            Joined::Flight(fut) => {
                let data = fut.data.await.map_err(|source| CacheError::Fetch { key: key.to_string(), source })?;
                if opts.wait_cached {
                    fut.cached.await;
                }
                Ok(data)
            }
        }
    }

    /// Reads a chunk as [`TieredCache::get`] does, but a miss gives the bytes as they arrive
    /// from the fetcher (see [`Fetcher::fetch_streaming`]): for a member passing the chunk on
    /// to another, who checks it whole.
    pub async fn stream(&self, key: &ChunkKey, fetcher: Arc<dyn Fetcher>) -> Result<Streamed, CacheError> {
        Ok(match self.join(key, fetcher, GetOptions::default()).await? {
            Joined::Hit(bytes) => Streamed::Whole(bytes),
            Joined::Flight(fut) => {
                let key = key.to_string();
                let answer = fut.data.map(|r| r.map_err(|source| CacheError::Fetch { key, source })).boxed();
                Streamed::Arriving { tail: fut.progress.tail(), answer }
            }
        })
    }

    /// A hit, or the fetch of the miss: joined if one is in flight, else started.
    async fn join(&self, key: &ChunkKey, fetcher: Arc<dyn Fetcher>, opts: GetOptions) -> Result<Joined, CacheError> {
        let resolved = self.core.resolve(&key.path);
        let id = key.id();
        for _ in 0..3 {
            if !resolved.no_cache {
                // A chunk the index does not hold is known a miss without the blocking pool's
                // round trip, which a cold read of many small files would pay once per file.
                let hit = if self.core.contains(&id) {
                    let core = self.core.clone();
                    let k = key.clone();
                    tokio::task::spawn_blocking(move || core.lookup(&k, &id))
                        .await
                        .map_err(|e| CacheError::Task(e.to_string()))?
                } else {
                    self.core.count_misses(&TierKind::ALL);
                    None
                };
                if let Some(hit) = hit {
                    if hit.promote && opts.tier != Some(TierKind::Warm) {
                        self.promote_in_background(id);
                    }
                    return Ok(Joined::Hit(hit.bytes));
                }
            }
            let fut = {
                let mut map = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(f) = map.get(&id) {
                    self.core.metrics.coalesced.inc();
                    f.clone()
                } else if !resolved.no_cache && self.core.contains(&id) {
                    // The fetch we would have joined finished between our lookup and now.
                    continue;
                } else {
                    let f = self.spawn_fetch(key.clone(), id, fetcher.clone(), opts, resolved.no_cache);
                    map.insert(id, f.clone());
                    f
                }
            };
            return Ok(Joined::Flight(fut));
        }
        Err(CacheError::Task(format!("chunk {key} kept vanishing from the cache while being read")))
    }

    /// The bytes `range` of a chunk, through the cache. A chunk in a local tier gives only the
    /// pieces the range touches, read and checked; any other read goes through
    /// [`TieredCache::get`], which fetches and caches the whole chunk.
    pub async fn get_range(
        &self,
        key: &ChunkKey,
        fetcher: Arc<dyn Fetcher>,
        range: std::ops::Range<u64>,
    ) -> Result<Bytes, CacheError> {
        let id = key.id();
        // A miss is left to `get`, which counts it once.
        if !self.core.resolve(&key.path).no_cache && self.core.contains(&id) {
            let (core, k, r) = (self.core.clone(), key.clone(), range.clone());
            let hit = tokio::task::spawn_blocking(move || core.lookup_range(&k, &id, r))
                .await
                .map_err(|e| CacheError::Task(e.to_string()))?;
            if let Some(hit) = hit {
                if hit.promote {
                    self.promote_in_background(id);
                }
                return Ok(hit.bytes);
            }
        }
        let whole = self.get(key, fetcher, GetOptions::default()).await?;
        let end = (range.end as usize).min(whole.len());
        Ok(whole.slice((range.start as usize).min(end)..end))
    }

    fn promote_in_background(&self, id: KeyId) {
        let core = self.core.clone();
        let background = self.background.clone();
        background.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        tokio::task::spawn_blocking(move || {
            core.promote(&id);
            background.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
        });
    }

    fn spawn_fetch(
        &self,
        key: ChunkKey,
        id: KeyId,
        fetcher: Arc<dyn Fetcher>,
        opts: GetOptions,
        no_cache: bool,
    ) -> InFlight {
        let core = self.core.clone();
        let inflight = self.inflight.clone();
        let (tx, rx) = tokio::sync::oneshot::channel::<Result<Bytes, FetchError>>();
        let progress = Progress::default();
        let told = progress.clone();
        let span = tracing::info_span!("cold_fetch", chunk = %key);
        // The fetch runs as its own task so a reader that gives up does not cancel it for the
        // others waiting on the same chunk. Readers get the bytes as soon as they arrive; writing
        // them into a tier happens after, off their critical path.
        let task = tokio::spawn(
            async move {
                let started = Instant::now();
                core.metrics.cold_fetches.inc();
                let finished = told.finish_on_drop();
                let result = fetcher.fetch_streaming(&key, told).await;
                drop(finished);
                core.metrics.cold_fetch_seconds.0.observe(started.elapsed().as_secs_f64());
                match &result {
                    Ok(data) => {
                        core.metrics.cold_fetch_bytes.inc_by(data.len() as u64);
                    }
                    Err(_) => {
                        core.metrics.cold_fetch_errors.inc();
                    }
                }
                let _ = tx.send(result.clone());
                if let Ok(data) = result
                    && !no_cache
                {
                    let prefer = opts.tier.or(core.resolve(&key.path).pin).unwrap_or(TierKind::Hot);
                    let (c, k) = (core.clone(), key.clone());
                    match tokio::task::spawn_blocking(move || c.store_anywhere(&k, &data, prefer)).await {
                        Ok(Ok(_)) => {}
                        Ok(Err(e)) => warn!(chunk = %key, error = %e, "serving chunk without caching it"),
                        Err(e) => warn!(chunk = %key, error = %e, "caching task failed"),
                    }
                }
                inflight.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
            }
            .instrument(span),
        );
        let data = async move {
            rx.await.unwrap_or_else(|_| {
                Err(Arc::new(std::io::Error::other("the fetch task ended without an answer")) as FetchError)
            })
        }
        .boxed()
        .shared();
        let cached = async move {
            let _ = task.await;
        }
        .boxed()
        .shared();
        InFlight { data, cached, progress }
    }

    /// Serves a chunk only if a local tier holds it; never fetches. For callers on their own
    /// threads (FUSE workers, benchmarks) that want no async hop on a hit.
    pub fn get_local_blocking(&self, key: &ChunkKey) -> Option<Bytes> {
        self.core.lookup(key, &key.id()).map(|h| h.bytes)
    }

    /// Stores a chunk from a blocking context (a decoding worker), as [`TieredCache::put`] does.
    pub fn put_blocking(&self, key: &ChunkKey, data: &[u8], tier: TierKind) -> Result<TierKind, CacheError> {
        self.core.store_anywhere(key, data, tier)
    }

    /// Which tier holds a chunk, if any.
    pub fn location(&self, key: &ChunkKey) -> Option<TierKind> {
        self.core.lock().entries.get(&key.id()).map(|e| e.tier)
    }

    /// Whether a fetch of `key` through [`TieredCache::get`] is under way, its bytes not yet
    /// written into a tier: a caller choosing what else to fetch leaves it to that fetch.
    pub fn fetching(&self, key: &ChunkKey) -> bool {
        self.inflight.lock().unwrap_or_else(|p| p.into_inner()).contains_key(&key.id())
    }

    /// How many accesses the index has counted to an entry since it was cached, if it is.
    pub fn hits(&self, key: &ChunkKey) -> Option<u64> {
        self.core.lock().entries.get(&key.id()).map(|e| e.hits)
    }

    /// The hot tier's whole-file copy named by `key` ([`ChunkKey::whole`]), opened for reading,
    /// if there is one. The open counts as an access.
    pub fn open_whole(&self, key: &ChunkKey) -> Option<std::fs::File> {
        self.core.open_whole(key)
    }

    /// Counts an access to each chunk present, without reading it.
    pub fn touch(&self, keys: &[ChunkKey]) {
        self.core.touch(keys)
    }

    /// Assembles the whole-file copy `key` from `chunks` when all of them are in the hot tier.
    /// Returns whether the copy exists afterwards.
    pub async fn build_whole(&self, key: ChunkKey, chunks: Vec<ChunkKey>) -> Result<bool, CacheError> {
        let core = self.core.clone();
        tokio::task::spawn_blocking(move || core.build_whole(&key, &chunks).map(|r| r.is_some()))
            .await
            .map_err(|e| CacheError::Task(e.to_string()))?
    }

    /// Moves the file at `from`, which holds exactly the object version `key` names, into the
    /// hot tier as its whole-file copy ([`Core::adopt_whole`]). `false`: not moved; assemble
    /// the copy from chunks instead.
    pub async fn adopt_whole(&self, key: ChunkKey, from: PathBuf) -> Result<bool, CacheError> {
        self.blocking(move |core| core.adopt_whole(&key, &from)).await?
    }

    /// Stores bytes the caller already has (e.g. a staged checkpoint) under `key`.
    pub async fn put(&self, key: ChunkKey, data: Bytes, tier: TierKind) -> Result<TierKind, CacheError> {
        let core = self.core.clone();
        tokio::task::spawn_blocking(move || core.store_anywhere(&key, &data, tier))
            .await
            .map_err(|e| CacheError::Task(e.to_string()))?
    }

    async fn blocking<T: Send + 'static>(&self, f: impl FnOnce(&Core) -> T + Send + 'static) -> Result<T, CacheError> {
        let core = self.core.clone();
        tokio::task::spawn_blocking(move || f(&core)).await.map_err(|e| CacheError::Task(e.to_string()))
    }

    /// Pins a path pattern to a tier. Fails, changing nothing, if the pinned data already cached
    /// would not fit under the tier's high watermark.
    pub async fn pin(&self, pattern: PathPattern, tier: TierKind) -> Result<Moved, CacheError> {
        self.pin_with(pattern, tier, None).await
    }

    /// Keeps `pattern` (the newest entry written into directory `dir`) in the hot tier, in
    /// place of the previous newest entry of `dir`, which goes back to the ordinary policy.
    pub async fn pin_newest(&self, dir: &str, pattern: PathPattern) -> Result<Moved, CacheError> {
        self.pin_with(pattern, TierKind::Hot, Some(dir.to_string())).await
    }

    /// Drops these chunks from every tier, pinned or not: for bytes that now live under other
    /// keys (a renamed file's). Returns how many were present.
    pub async fn discard(&self, keys: Vec<ChunkKey>) -> Result<usize, CacheError> {
        self.blocking(move |core| keys.iter().filter(|k| core.evict(&k.id(), "discarded").is_some()).count()).await
    }

    /// Removes the newest-entry pins whose directory `drop` accepts. Returns how many.
    pub async fn unpin_newest(&self, drop: impl Fn(&str) -> bool + Send + 'static) -> Result<usize, CacheError> {
        self.blocking(move |core| {
            let removed = core.change_pins(|pins| {
                let before = pins.len();
                pins.retain(|p| !p.newest_of.as_deref().is_some_and(&drop));
                before - pins.len()
            })?;
            if removed > 0 {
                core.refresh_pins();
            }
            Ok(removed)
        })
        .await?
    }

    async fn pin_with(
        &self,
        pattern: PathPattern,
        tier: TierKind,
        newest_of: Option<String>,
    ) -> Result<Moved, CacheError> {
        self.blocking(move |core| {
            let t = core.tier(tier)?;
            let mut moved = Moved::default();
            {
                let ix = core.lock();
                let mut needed = 0;
                for e in ix.entries.values() {
                    let now_pinned_here = if pattern.matches(&e.key.path) { Some(tier) } else { e.pin };
                    if pattern.matches(&e.key.path) {
                        moved.chunks += 1;
                        moved.bytes += e.data_len;
                    }
                    if now_pinned_here == Some(tier) {
                        needed += e.disk_len;
                    }
                }
                if needed > t.high_bytes() {
                    return Err(CacheError::PinTooLarge {
                        pattern: pattern.to_string(),
                        tier,
                        needed,
                        limit: t.high_bytes(),
                    });
                }
            }
            core.change_pins(|pins| {
                pins.retain(|p| p.pattern != pattern && (newest_of.is_none() || p.newest_of != newest_of));
                pins.push(Pin { pattern: pattern.clone(), tier, newest_of });
            })?;
            core.refresh_pins();
            // Bring the pinned chunks to their tier now rather than at the next policy pass.
            let from = match tier {
                TierKind::Hot => TierKind::Warm,
                TierKind::Warm => TierKind::Hot,
            };
            for (id, _, _) in core.claim(|e, _| e.tier == from && pattern.matches(&e.key.path)) {
                core.relocate(&id, from, tier);
            }
            Ok(moved)
        })
        .await?
    }

    /// Removes pins with exactly this pattern. Returns how many were removed.
    pub async fn unpin(&self, pattern: PathPattern) -> Result<usize, CacheError> {
        self.blocking(move |core| {
            let removed = core.change_pins(|pins| {
                let before = pins.len();
                pins.retain(|p| p.pattern != pattern);
                before - pins.len()
            })?;
            core.refresh_pins();
            Ok(removed)
        })
        .await?
    }

    pub fn pins(&self) -> Vec<Pin> {
        self.core.pins.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn policy(&self) -> Policy {
        self.core.policy().clone()
    }

    /// Replaces the policy. The caller validated it.
    pub fn set_policy(&self, policy: Policy) {
        *self.core.policy.write().unwrap_or_else(|p| p.into_inner()) = policy;
        self.core.refresh_pins();
    }

    /// Drops every unpinned chunk whose path matches.
    pub async fn evict(&self, pattern: PathPattern) -> Result<Moved, CacheError> {
        self.blocking(move |core| {
            let mut moved = Moved::default();
            let claimed = core.claim(|e, r| {
                if !pattern.matches(&e.key.path) {
                    return false;
                }
                r.pin.is_none()
            });
            for (id, _, _) in claimed {
                if let Some(e) = core.evict_unpinned(&id, "manual") {
                    moved.chunks += 1;
                    moved.bytes += e.data_len;
                }
            }
            moved.skipped_pinned =
                core.lock().entries.values().filter(|e| e.pin.is_some() && pattern.matches(&e.key.path)).count() as u64;
            moved
        })
        .await
    }

    /// Demotes hot chunks idle for at least `idle` (the policy's `hot_idle` when `None`) to warm.
    pub async fn demote(&self, idle: Option<Duration>) -> Result<Moved, CacheError> {
        // Asked for by name, a demotion with nowhere to go is an error, not "0 chunks".
        self.core.tier(TierKind::Warm)?;
        self.blocking(move |core| demote_idle(core, idle)).await
    }

    /// Whether the cache has `tier`.
    pub fn has_tier(&self, tier: TierKind) -> bool {
        self.core.has(tier)
    }

    /// One pass of the policy: TTL expiry, idle demotion and eviction, pinned chunks brought to
    /// their tier, then watermarks. The daemon runs this periodically.
    #[tracing::instrument(name = "policy_pass", skip_all)]
    pub async fn apply_policy(&self) -> Result<PolicyPass, CacheError> {
        self.blocking(|core| {
            let now = now_ms();
            let mut pass = PolicyPass::default();
            let expired = core.claim(|e, r| {
                e.pin.is_none() && r.ttl.is_some_and(|t| now.saturating_sub(e.inserted_ms) > t.as_millis() as u64)
            });
            for (id, _, _) in expired {
                pass.expired += u64::from(core.evict_unpinned(&id, "ttl").is_some());
            }
            pass.demoted = demote_idle(core, None).chunks;
            let stale = core.claim(|e, r| {
                e.tier == TierKind::Warm
                    && e.pin.is_none()
                    && r.warm_idle.is_some_and(|w| now.saturating_sub(e.last_ms) >= w.as_millis() as u64)
            });
            for (id, _, _) in stale {
                pass.evicted += u64::from(core.evict_unpinned(&id, "idle").is_some());
            }
            let misplaced = core.claim(|e, _| e.pin.is_some_and(|p| p != e.tier));
            for (id, tier, _) in misplaced {
                let to = match tier {
                    TierKind::Hot => TierKind::Warm,
                    TierKind::Warm => TierKind::Hot,
                };
                if core.relocate(&id, tier, to) {
                    pass.repinned += 1;
                }
            }
            for t in TierKind::ALL {
                pass.watermark_moves += core.enforce_watermark(t) as u64;
            }
            if let Err(e) = restore::save_access(core) {
                warn!(error = %e, "could not persist access history");
            }
            pass
        })
        .await
    }

    /// Waits, up to `limit`, until fetches of `keys` still in flight have been written into a
    /// tier (or failed to be).
    pub async fn settled(&self, keys: &[ChunkKey], limit: Duration) {
        let pending: Vec<_> = {
            let map = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
            keys.iter().filter_map(|k| map.get(&k.id()).map(|f| f.cached.clone())).collect()
        };
        let _ = tokio::time::timeout(limit, futures::future::join_all(pending)).await;
    }

    /// Waits, up to `limit`, until no background promotion is running. Returns whether it got
    /// there. Used before shutdown, and by tests that check what the policy settles to.
    pub async fn wait_background(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while self.background.load(std::sync::atomic::Ordering::Acquire) > 0 {
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        true
    }

    /// Persists access history; call on shutdown.
    pub async fn flush(&self) -> Result<(), CacheError> {
        self.blocking(restore::save_access).await?
    }

    pub fn status(&self) -> CacheStatus {
        let ix = self.core.lock();
        let m = &self.core.metrics;
        let tiers = self
            .core
            .tiers
            .iter()
            .flatten()
            .map(|t| {
                let l = metrics::tier(t.kind);
                let hits = m.hits.get_or_create(&l).get();
                let misses = m.misses.get_or_create(&l).get();
                TierStatus {
                    tier: t.kind,
                    path: t.config.path.clone(),
                    capacity: t.capacity(),
                    high_watermark: t.config.high_watermark,
                    low_watermark: t.config.low_watermark,
                    used: ix.used[t.kind.index()],
                    chunks: ix.chunks[t.kind.index()],
                    pinned: ix.pinned_bytes(t.kind),
                    hits,
                    misses,
                    hit_ratio: if hits + misses == 0 { 0.0 } else { hits as f64 / (hits + misses) as f64 },
                    bytes_in: m.bytes_written.get_or_create(&l).get(),
                    bytes_out: m.bytes_read.get_or_create(&l).get(),
                }
            })
            .collect();
        CacheStatus {
            tiers,
            cold_fetches: m.cold_fetches.get(),
            cold_fetch_errors: m.cold_fetch_errors.get(),
            cold_bytes: m.cold_fetch_bytes.get(),
            checksum_failures: TierKind::ALL
                .iter()
                .map(|t| m.checksum_failures.get_or_create(&metrics::tier(*t)).get())
                .sum(),
            promotions: m.promotions.get(),
            demotions: m.demotions.get(),
            evictions: m.evictions_total(),
        }
    }
}

fn demote_idle(core: &Core, idle: Option<Duration>) -> Moved {
    let mut moved = Moved::default();
    if core.tier(TierKind::Warm).is_err() {
        return moved;
    }
    let now = now_ms();
    let claimed = core.claim(|e, r| {
        let limit = idle.unwrap_or(r.hot_idle).as_millis() as u64;
        e.tier == TierKind::Hot && e.pin != Some(TierKind::Hot) && now.saturating_sub(e.last_ms) >= limit
    });
    moved.skipped_pinned =
        core.lock().entries.values().filter(|e| e.tier == TierKind::Hot && e.pin == Some(TierKind::Hot)).count() as u64;
    for (id, _, len) in claimed {
        if core.relocate(&id, TierKind::Hot, TierKind::Warm) {
            moved.chunks += 1;
            moved.bytes += len;
        }
    }
    moved
}

/// What one policy pass did.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PolicyPass {
    pub expired: u64,
    pub demoted: u64,
    pub evicted: u64,
    pub repinned: u64,
    pub watermark_moves: u64,
}

#[cfg(test)]
mod tests;
