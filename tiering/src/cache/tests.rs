//! Unit tests of the cache against real tier directories and an in-memory fetcher.

use super::*;
use crate::policy::Policy;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Serves deterministic bytes per key and counts fetches.
#[derive(Debug, Default)]
pub(crate) struct TestFetcher {
    pub calls: AtomicUsize,
    pub delay_ms: u64,
    pub len: usize,
}

pub(crate) fn bytes_for(key: &ChunkKey, len: usize) -> Bytes {
    let seed = key.id().0;
    Bytes::from((0..len).map(|i| seed[i % 32] ^ (i / 32) as u8).collect::<Vec<u8>>())
}

impl Fetcher for TestFetcher {
    fn fetch(&self, key: &ChunkKey) -> BoxFuture<'static, Result<Bytes, FetchError>> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let (key, delay, len) = (key.clone(), self.delay_ms, self.len);
        async move {
            if delay > 0 {
                tokio::time::sleep(Duration::from_millis(delay)).await;
            }
            Ok(bytes_for(&key, len))
        }
        .boxed()
    }
}

pub(crate) fn open(dir: &std::path::Path, hot: u64, warm: Option<u64>, policy: Policy) -> TieredCache {
    TieredCache::open(CacheConfig {
        hot: TierConfig::new(dir.join("hot"), hot),
        warm: warm.map(|w| TierConfig::new(dir.join("warm"), w)),
        state_dir: dir.join("state"),
        policy,
    })
    .unwrap()
}

fn fetcher(len: usize) -> Arc<TestFetcher> {
    Arc::new(TestFetcher { len, ..Default::default() })
}

fn key(path: &str, i: u64) -> ChunkKey {
    ChunkKey::object(path, "v1", i, 4096)
}

const CHUNK: usize = 4096;
/// Reads that return once the chunk is placed, so tests can look at where it went.
const W: GetOptions = GetOptions { tier: None, wait_cached: true };
/// What one 4 KiB test chunk occupies on disk.
fn disk(k: &ChunkKey) -> u64 {
    crate::chunkfile::encoded_len(k, CHUNK as u64)
}

#[tokio::test]
async fn miss_fetches_once_then_hits() {
    let dir = tempfile::tempdir().unwrap();
    let c = open(dir.path(), 1 << 20, Some(1 << 20), Policy::default());
    let f = fetcher(CHUNK);
    let k = key("a", 0);
    let first = c.get(&k, f.clone(), W).await.unwrap();
    let second = c.get(&k, f.clone(), W).await.unwrap();
    assert_eq!(first, bytes_for(&k, CHUNK));
    assert_eq!(second, first);
    assert_eq!(f.calls.load(Ordering::SeqCst), 1);
    assert_eq!(c.location(&k), Some(TierKind::Hot));
    let s = c.status();
    assert_eq!(s.tier(TierKind::Hot).unwrap().hits, 1);
    assert_eq!(s.tier(TierKind::Hot).unwrap().chunks, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_misses_share_one_fetch() {
    let dir = tempfile::tempdir().unwrap();
    let c = open(dir.path(), 1 << 20, None, Policy::default());
    let f = Arc::new(TestFetcher { len: CHUNK, delay_ms: 200, ..Default::default() });
    let k = key("a", 7);
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let (c, f, k) = (c.clone(), f.clone(), k.clone());
            tokio::spawn(async move { c.get(&k, f, W).await.unwrap() })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.unwrap(), bytes_for(&k, CHUNK));
    }
    assert_eq!(f.calls.load(Ordering::SeqCst), 1);
}

/// A chunk being fetched is `fetching` until its bytes are in a tier, not only until the
/// fetch returns: a layer's read ahead that looked in between took it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunk_is_fetching_until_it_is_in_a_tier() {
    let dir = tempfile::tempdir().unwrap();
    let c = open(dir.path(), 1 << 20, None, Policy::default());
    let f = Arc::new(TestFetcher { len: CHUNK, delay_ms: 200, ..Default::default() });
    let k = key("a", 3);
    assert!(!c.fetching(&k));
    let reading = tokio::spawn({
        let (c, f, k) = (c.clone(), f.clone(), k.clone());
        async move { c.get(&k, f, W).await.unwrap() }
    });
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    assert!(c.fetching(&k) && c.location(&k).is_none(), "under way, not cached yet");
    assert_eq!(reading.await.unwrap(), bytes_for(&k, CHUNK));
    c.settled(std::slice::from_ref(&k), std::time::Duration::from_secs(5)).await;
    assert!(!c.fetching(&k) && c.location(&k).is_some(), "cached, and no longer fetching");
}

#[tokio::test]
async fn flipped_byte_is_refetched_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let c = open(dir.path(), 1 << 20, None, Policy::default());
    let f = fetcher(CHUNK);
    let k = key("a", 0);
    c.get(&k, f.clone(), W).await.unwrap();
    let path = dir.path().join("hot/chunks").join(&k.id().to_hex()[..2]).join(k.id().to_hex());
    let mut raw = std::fs::read(&path).unwrap();
    let n = raw.len();
    raw[n - 100] ^= 0x40;
    std::fs::write(&path, raw).unwrap();
    let again = c.get(&k, f.clone(), W).await.unwrap();
    assert_eq!(again, bytes_for(&k, CHUNK));
    assert_eq!(f.calls.load(Ordering::SeqCst), 2);
    assert_eq!(c.status().checksum_failures, 1);
    // The refetched copy is good again.
    assert_eq!(c.get_local_blocking(&k).unwrap(), bytes_for(&k, CHUNK));
}

#[tokio::test]
async fn a_range_of_a_cached_chunk_is_read_from_its_pieces_and_a_flipped_one_is_refetched() {
    let dir = tempfile::tempdir().unwrap();
    let c = open(dir.path(), 4 << 20, None, Policy::default());
    let len = 600 << 10;
    let f = fetcher(len);
    let k = key("r", 0);
    let want = bytes_for(&k, len);
    // A miss fetches and caches the whole chunk, and gives the range of it.
    let got = c.get_range(&k, f.clone(), 1000..2000).await.unwrap();
    assert_eq!(got, want.slice(1000..2000));
    c.wait_background(Duration::from_secs(5)).await;
    c.get(&k, f.clone(), W).await.unwrap();
    // Cached: a range in the third piece is read from the file, not fetched.
    let third = (512 << 10) + 7..(512 << 10) + 9000;
    assert_eq!(
        c.get_range(&k, f.clone(), third.clone()).await.unwrap(),
        want.slice(third.start as usize..third.end as usize)
    );
    assert_eq!(f.calls.load(Ordering::SeqCst), 1);
    // A flipped byte in that piece: the range is never served from it; the chunk is fetched again.
    let path = dir.path().join("hot/chunks").join(&k.id().to_hex()[..2]).join(k.id().to_hex());
    let mut raw = std::fs::read(&path).unwrap();
    let n = raw.len();
    raw[n - 100] ^= 0x40;
    std::fs::write(&path, raw).unwrap();
    assert_eq!(
        c.get_range(&k, f.clone(), third.clone()).await.unwrap(),
        want.slice(third.start as usize..third.end as usize)
    );
    assert_eq!(f.calls.load(Ordering::SeqCst), 2);
    assert_eq!(c.status().checksum_failures, 1);
}

#[tokio::test]
async fn hot_overflow_demotes_to_warm_and_caps_hold() {
    let dir = tempfile::tempdir().unwrap();
    let k0 = key("d", 0);
    let hot_cap = 10 * disk(&k0);
    let warm_cap = 20 * disk(&k0);
    let c = open(dir.path(), hot_cap, Some(warm_cap), Policy::default());
    let f = fetcher(CHUNK);
    for i in 0..60 {
        let k = key("d", i);
        assert_eq!(c.get(&k, f.clone(), W).await.unwrap(), bytes_for(&k, CHUNK));
        let s = c.status();
        assert!(s.tier(TierKind::Hot).unwrap().used <= hot_cap);
        assert!(s.tier(TierKind::Warm).unwrap().used <= warm_cap);
    }
    let s = c.status();
    assert!(s.demotions > 0);
    assert!(s.evictions > 0);
    // The newest chunk is hot; the oldest ones fell out of both tiers.
    assert_eq!(c.location(&key("d", 59)), Some(TierKind::Hot));
    assert_eq!(c.location(&key("d", 0)), None);
    let on_disk: u64 = walk(&dir.path().join("hot")).iter().map(|p| std::fs::metadata(p).unwrap().len()).sum();
    assert!(on_disk <= hot_cap, "{on_disk} > {hot_cap}");
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() { out.extend(walk(&p)) } else { out.push(p) }
    }
    out
}

#[tokio::test]
async fn warm_hit_promotes_to_hot() {
    let dir = tempfile::tempdir().unwrap();
    let c = open(dir.path(), 1 << 20, Some(1 << 20), Policy::default());
    let f = fetcher(CHUNK);
    let k = key("p", 0);
    c.get(&k, f.clone(), GetOptions { tier: Some(TierKind::Warm), wait_cached: true }).await.unwrap();
    assert_eq!(c.location(&k), Some(TierKind::Warm));
    assert_eq!(c.get(&k, f.clone(), W).await.unwrap(), bytes_for(&k, CHUNK));
    for _ in 0..100 {
        if c.location(&k) == Some(TierKind::Hot) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(c.location(&k), Some(TierKind::Hot));
    assert_eq!(c.status().promotions, 1);
    assert_eq!(f.calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn pinned_chunks_stay_and_oversized_pins_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let k0 = key("keep/x", 0);
    let hot_cap = 10 * disk(&k0);
    let c = open(dir.path(), hot_cap, Some(100 * disk(&k0)), Policy::default());
    let f = fetcher(CHUNK);
    for i in 0..3 {
        c.get(&key("keep/x", i), f.clone(), W).await.unwrap();
    }
    c.pin(PathPattern::parse("keep/").unwrap(), TierKind::Hot).await.unwrap();
    for i in 0..40 {
        c.get(&key("churn", i), f.clone(), W).await.unwrap();
    }
    c.demote(Some(Duration::ZERO)).await.unwrap();
    c.evict(PathPattern::parse("keep/").unwrap()).await.unwrap();
    for i in 0..3 {
        assert_eq!(c.location(&key("keep/x", i)), Some(TierKind::Hot), "pinned chunk {i} moved");
    }
    // Nine more chunks would take the pinned set past the high watermark (90% of 10 chunks).
    for i in 0..9 {
        c.get(&key("big/y", i), f.clone(), GetOptions { tier: Some(TierKind::Warm), wait_cached: true }).await.unwrap();
    }
    let err = c.pin(PathPattern::parse("big/").unwrap(), TierKind::Hot).await.unwrap_err();
    assert!(matches!(err, CacheError::PinTooLarge { .. }), "{err}");
    assert!(err.to_string().contains("big/"), "{err}");
    assert_eq!(c.pins().len(), 1, "a refused pin changes nothing");
}

#[tokio::test]
async fn a_saved_pin_to_a_tier_the_config_no_longer_has_is_let_go() {
    let dir = tempfile::tempdir().unwrap();
    let f = fetcher(CHUNK);
    {
        let c = open(dir.path(), 1 << 20, Some(1 << 20), Policy::default());
        for i in 0..3 {
            c.get(&key("ckpt/a", i), f.clone(), W).await.unwrap();
        }
        c.pin(PathPattern::parse("ckpt/").unwrap(), TierKind::Warm).await.unwrap();
        c.flush().await.unwrap();
    }
    let c = open(dir.path(), 1 << 20, None, Policy::default());
    assert!(c.pins().is_empty(), "{:?}", c.pins());
    // Read again, the chunks come into the hot tier, the only one left.
    for i in 0..3 {
        c.get(&key("ckpt/a", i), f.clone(), W).await.unwrap();
    }
    assert_eq!(c.status().tier(TierKind::Hot).unwrap().pinned, 0, "no chunk may count as pinned");
    let dropped = c.evict(PathPattern::parse("ckpt/").unwrap()).await.unwrap();
    assert_eq!((dropped.chunks, dropped.skipped_pinned), (3, 0), "{dropped:?}");
}

#[tokio::test]
async fn a_chunk_pinned_after_the_policy_chose_it_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let c = open(dir.path(), 1 << 20, Some(1 << 20), Policy::default());
    let f = fetcher(CHUNK);
    let k = key("keep/x", 0);
    c.get(&k, f.clone(), W).await.unwrap();
    // A policy pass has chosen it (an expiry, an idle eviction, a capacity victim) ...
    let claimed = c.core.claim(|_, _| true);
    assert_eq!(claimed.len(), 1);
    // ... and a pin lands before the pass drops it.
    c.pin(PathPattern::parse("keep/").unwrap(), TierKind::Hot).await.unwrap();
    for reason in ["ttl", "idle", "capacity", "manual"] {
        assert!(c.core.evict_unpinned(&k.id(), reason).is_none(), "{reason}");
    }
    assert_eq!(c.location(&k), Some(TierKind::Hot));
    assert!(!c.core.lock().entries[&k.id()].moving, "the entry must be released for later moves");
    assert_eq!(c.get(&k, f.clone(), W).await.unwrap(), bytes_for(&k, CHUNK));
    assert_eq!(f.calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn restart_rebuilds_index_and_discards_damage() {
    let dir = tempfile::tempdir().unwrap();
    let f = fetcher(CHUNK);
    {
        let c = open(dir.path(), 1 << 20, Some(1 << 20), Policy::default());
        for i in 0..5 {
            c.get(&key("r", i), f.clone(), W).await.unwrap();
        }
        c.pin(PathPattern::parse("r").unwrap(), TierKind::Hot).await.unwrap();
        c.flush().await.unwrap();
    }
    let torn = key("r", 3);
    let p = dir.path().join("hot/chunks").join(&torn.id().to_hex()[..2]).join(torn.id().to_hex());
    let raw = std::fs::read(&p).unwrap();
    std::fs::write(&p, &raw[..raw.len() / 2]).unwrap();
    std::fs::write(p.with_extension("tmp.1.1"), b"half a chunk").unwrap();
    std::fs::write(dir.path().join("state/access.json"), b"{not json").unwrap();

    let c = open(dir.path(), 1 << 20, Some(1 << 20), Policy::default());
    let s = c.status();
    assert_eq!(s.tier(TierKind::Hot).unwrap().chunks, 4);
    assert_eq!(c.pins().len(), 1, "pins survive restarts");
    assert!(!p.with_extension("tmp.1.1").exists());
    for i in 0..5 {
        let k = key("r", i);
        assert_eq!(c.get(&k, f.clone(), W).await.unwrap(), bytes_for(&k, CHUNK));
    }
    assert_eq!(f.calls.load(Ordering::SeqCst), 6, "only the torn chunk was fetched again");
}

#[tokio::test]
async fn restart_with_smaller_capacity_enforces_it() {
    let dir = tempfile::tempdir().unwrap();
    let f = fetcher(CHUNK);
    {
        let c = open(dir.path(), 1 << 20, None, Policy::default());
        for i in 0..20 {
            c.get(&key("s", i), f.clone(), W).await.unwrap();
        }
    }
    let cap = 8 * disk(&key("s", 0));
    let c = open(dir.path(), cap, None, Policy::default());
    assert!(c.status().tier(TierKind::Hot).unwrap().used <= cap);
}

#[tokio::test]
async fn rules_apply_no_cache_and_ttl() {
    let dir = tempfile::tempdir().unwrap();
    let policy = Policy::from_toml(
        "[[rule]]\nprefix = \"scratch/\"\nno_cache = true\n[[rule]]\nprefix = \"short/\"\nttl = \"0s\"\n",
    )
    .unwrap();
    let c = open(dir.path(), 1 << 20, None, policy);
    let f = fetcher(CHUNK);
    c.get(&key("scratch/a", 0), f.clone(), W).await.unwrap();
    assert_eq!(c.location(&key("scratch/a", 0)), None);
    // Nor by a store of its own (a warm-up, a mount keeping what it wrote), nor as a copy.
    let stored = c.put(key("scratch/b", 0), bytes_for(&key("scratch/b", 0), CHUNK), TierKind::Hot).await;
    assert!(
        matches!(&stored, Err(CacheError::NoCache(p)) if p == "scratch/b"),
        "a no_cache path was stored: {stored:?}"
    );
    assert_eq!(c.location(&key("scratch/b", 0)), None);
    let whole = ChunkKey::whole("scratch/b", "v1", CHUNK as u64);
    assert!(!c.build_whole(whole.clone(), vec![key("scratch/b", 0)]).await.unwrap());
    assert!(c.open_whole(&whole).is_none());
    c.get(&key("short/a", 0), f.clone(), W).await.unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    c.apply_policy().await.unwrap();
    assert_eq!(c.location(&key("short/a", 0)), None);
    assert_eq!(f.calls.load(Ordering::SeqCst), 2);
}

/// A TTL counts from when a chunk was cached, across a demotion and a restart.
#[tokio::test]
async fn a_ttl_counts_from_the_caching_across_a_move_and_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let policy = || Policy::from_toml("[[rule]]\nprefix = \"ckpt/\"\nttl = \"1h\"\n").unwrap();
    let f = fetcher(CHUNK);
    let k = key("ckpt/a", 0);
    let path = |tier: &str| dir.path().join(tier).join("chunks").join(&k.id().to_hex()[..2]).join(k.id().to_hex());
    {
        let c = open(dir.path(), 1 << 20, Some(1 << 20), policy());
        c.get(&k, f.clone(), W).await.unwrap();
        c.flush().await.unwrap();
    }
    // Cached two hours ago, as far as the file says (the restart reads the time from it).
    let two_hours_ago = std::time::SystemTime::now() - Duration::from_secs(7200);
    std::fs::File::options().write(true).open(path("hot")).unwrap().set_modified(two_hours_ago).unwrap();
    {
        let c = open(dir.path(), 1 << 20, Some(1 << 20), Policy::default());
        c.demote(Some(Duration::ZERO)).await.unwrap();
        assert_eq!(c.location(&k), Some(TierKind::Warm));
        c.flush().await.unwrap();
    }
    let c = open(dir.path(), 1 << 20, Some(1 << 20), policy());
    assert!(path("warm").exists());
    let pass = c.apply_policy().await.unwrap();
    assert_eq!(pass.expired, 1, "{pass:?}");
    assert_eq!(c.location(&k), None, "a chunk cached two hours ago outlived its 1h TTL");
}

#[tokio::test]
async fn lfu_keeps_the_frequently_read() {
    let dir = tempfile::tempdir().unwrap();
    let k0 = key("l", 0);
    let cap = 5 * disk(&k0);
    let c = open(dir.path(), cap, None, Policy::from_toml("eviction = \"lfu\"").unwrap());
    let f = fetcher(CHUNK);
    c.get(&k0, f.clone(), W).await.unwrap();
    for _ in 0..5 {
        c.get(&k0, f.clone(), W).await.unwrap();
    }
    for i in 1..12 {
        c.get(&key("l", i), f.clone(), W).await.unwrap();
    }
    assert_eq!(c.location(&k0), Some(TierKind::Hot), "the most-read chunk survives under LFU");
}

#[tokio::test]
async fn unwritable_hot_tier_falls_back_to_warm() {
    let dir = tempfile::tempdir().unwrap();
    let c = open(dir.path(), 1 << 20, Some(1 << 20), Policy::default());
    // A file where the fan-out directory should be makes every hot write fail.
    let k = key("w", 0);
    let fan = dir.path().join("hot/chunks").join(&k.id().to_hex()[..2]);
    std::fs::write(&fan, b"in the way").unwrap();
    let f = fetcher(CHUNK);
    assert_eq!(c.get(&k, f.clone(), W).await.unwrap(), bytes_for(&k, CHUNK));
    assert_eq!(c.location(&k), Some(TierKind::Warm));
    assert_eq!(c.metrics().write_errors.get_or_create(&crate::metrics::tier(TierKind::Hot)).get(), 1);
}

#[tokio::test]
async fn fetch_errors_reach_every_waiter() {
    #[derive(Debug)]
    struct Failing;
    impl Fetcher for Failing {
        fn fetch(&self, _: &ChunkKey) -> BoxFuture<'static, Result<Bytes, FetchError>> {
            async { Err(Arc::new(std::io::Error::other("store at http://127.0.0.1:1 refused")) as FetchError) }.boxed()
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let c = open(dir.path(), 1 << 20, None, Policy::default());
    let err = c.get(&key("e", 0), Arc::new(Failing), W).await.unwrap_err();
    assert!(err.to_string().contains("127.0.0.1:1"), "{err}");
    assert_eq!(c.status().cold_fetch_errors, 1);
    assert_eq!(c.location(&key("e", 0)), None);
}

#[test]
fn open_file_survives_unlink() {
    // The reason readers open under the index lock: once open, eviction cannot take the bytes.
    let dir = tempfile::tempdir().unwrap();
    let k = key("u", 0);
    let p = dir.path().join("c");
    crate::chunkfile::write_tmp(&p, &k, &bytes_for(&k, CHUNK), false).unwrap();
    let f = std::fs::File::open(&p).unwrap();
    let len = f.metadata().unwrap().len();
    std::fs::remove_file(&p).unwrap();
    assert_eq!(crate::chunkfile::read_verified_file(f, k.id(), len).unwrap(), bytes_for(&k, CHUNK));
}

#[test]
fn a_second_cache_on_the_same_state_dir_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let first = open(dir.path(), 1 << 20, None, Policy::default());
    let err = TieredCache::open(CacheConfig {
        hot: TierConfig::new(dir.path().join("hot"), 1 << 20),
        warm: None,
        state_dir: dir.path().join("state"),
        policy: Policy::default(),
    })
    .unwrap_err();
    assert!(err.to_string().contains("another strata process"), "{err}");
    drop(first);
    open(dir.path(), 1 << 20, None, Policy::default());
}

#[tokio::test]
async fn whole_file_copies_are_built_from_hot_chunks_only_and_survive_a_restart_only_whole() {
    use std::io::Read;
    let dir = tempfile::tempdir().unwrap();
    let c = open(dir.path(), 1 << 20, Some(1 << 20), Policy::default());
    let f = fetcher(CHUNK);
    let chunks: Vec<ChunkKey> = (0..3).map(|i| key("w", i)).collect();
    let whole = ChunkKey::whole("w", "v1", 3 * CHUNK as u64);
    // Not every chunk is cached yet: no copy.
    c.get(&chunks[0], f.clone(), W).await.unwrap();
    assert!(!c.build_whole(whole.clone(), chunks.clone()).await.unwrap());
    assert!(c.open_whole(&whole).is_none());
    for k in &chunks {
        c.get(k, f.clone(), W).await.unwrap();
    }
    assert!(c.build_whole(whole.clone(), chunks.clone()).await.unwrap());
    let mut got = Vec::new();
    c.open_whole(&whole).unwrap().read_to_end(&mut got).unwrap();
    let want: Vec<u8> = chunks.iter().flat_map(|k| bytes_for(k, CHUNK).to_vec()).collect();
    assert_eq!(got, want, "the copy is the chunks' bytes, in order, with no header");
    let hot = c.status().tier(TierKind::Hot).unwrap().used;
    assert_eq!(hot, chunks.iter().map(disk).sum::<u64>() + 3 * CHUNK as u64, "the copy counts against the tier");

    // Demotion drops the copy instead of moving it, and warm never holds one.
    c.demote(Some(Duration::ZERO)).await.unwrap();
    assert!(c.open_whole(&whole).is_none());
    assert!(walk(&dir.path().join("warm")).iter().all(|p| p.extension().is_none_or(|e| e != "file")));

    // Back in hot, rebuilt, then a restart: the copy is kept, bytes and accounting.
    for k in &chunks {
        c.get(k, f.clone(), W).await.unwrap();
    }
    c.wait_background(Duration::from_secs(5)).await;
    assert!(c.build_whole(whole.clone(), chunks.clone()).await.unwrap());
    let used = c.status().tier(TierKind::Hot).unwrap().used;
    drop(c);
    let c = open(dir.path(), 1 << 20, Some(1 << 20), Policy::default());
    let mut again = Vec::new();
    c.open_whole(&whole).unwrap().read_to_end(&mut again).unwrap();
    assert_eq!(again, want);
    assert_eq!(c.status().tier(TierKind::Hot).unwrap().used, used);

    // A copy cut short (or without its key) is discarded at restart, never trusted.
    drop(c);
    let copy = walk(&dir.path().join("hot")).into_iter().find(|p| p.extension().is_some_and(|e| e == "file")).unwrap();
    let f2 = std::fs::OpenOptions::new().write(true).open(&copy).unwrap();
    f2.set_len(CHUNK as u64).unwrap();
    drop(f2);
    let c = open(dir.path(), 1 << 20, Some(1 << 20), Policy::default());
    assert!(c.open_whole(&whole).is_none());
    assert!(walk(&dir.path().join("hot")).iter().all(|p| p.extension().is_none_or(|e| e != "file" && e != "filekey")));
}

/// A copy whose file went from under the cache (removed by hand, say) is dropped from the index
/// at its next open, and the cache goes on: a later read, and the accounting, are right.
#[tokio::test]
async fn a_whole_file_copy_gone_from_disk_is_dropped_at_its_next_open() {
    let dir = tempfile::tempdir().unwrap();
    let c = open(dir.path(), 1 << 20, None, Policy::default());
    let f = fetcher(CHUNK);
    let chunks: Vec<ChunkKey> = (0..2).map(|i| key("gone", i)).collect();
    for k in &chunks {
        c.get(k, f.clone(), W).await.unwrap();
    }
    let whole = ChunkKey::whole("gone", "v1", 2 * CHUNK as u64);
    assert!(c.build_whole(whole.clone(), chunks.clone()).await.unwrap());
    let copy = walk(&dir.path().join("hot")).into_iter().find(|p| p.extension().is_some_and(|e| e == "file")).unwrap();
    std::fs::remove_file(&copy).unwrap();
    // On a thread of its own, so that a hang fails the test instead of stopping it.
    let (tx, rx) = std::sync::mpsc::channel();
    let (c2, w2) = (c.clone(), whole.clone());
    std::thread::spawn(move || tx.send(c2.open_whole(&w2).is_none()).unwrap());
    assert_eq!(rx.recv_timeout(Duration::from_secs(10)), Ok(true), "the open of a vanished copy hung or found it");
    assert_eq!(c.get(&chunks[1], f.clone(), W).await.unwrap(), bytes_for(&chunks[1], CHUNK));
    assert_eq!(c.status().tier(TierKind::Hot).unwrap().used, chunks.iter().map(disk).sum::<u64>());
}

#[tokio::test]
async fn a_damaged_chunk_stops_the_whole_file_copy() {
    let dir = tempfile::tempdir().unwrap();
    let c = open(dir.path(), 1 << 20, None, Policy::default());
    let f = fetcher(CHUNK);
    let chunks: Vec<ChunkKey> = (0..2).map(|i| key("d", i)).collect();
    for k in &chunks {
        c.get(k, f.clone(), W).await.unwrap();
    }
    let victim = walk(&dir.path().join("hot")).into_iter().find(|p| p.ends_with(chunks[1].id().to_hex())).unwrap();
    let mut bytes = std::fs::read(&victim).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&victim, bytes).unwrap();
    let whole = ChunkKey::whole("d", "v1", 2 * CHUNK as u64);
    assert!(!c.build_whole(whole.clone(), chunks).await.unwrap());
    assert!(c.open_whole(&whole).is_none());
    assert!(walk(&dir.path().join("hot")).iter().all(|p| !p.to_string_lossy().contains("whole")));
}

#[tokio::test]
async fn a_staged_file_is_adopted_as_the_whole_file_copy_by_a_move() {
    use std::io::Read;
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    let c = open(dir.path(), 1 << 20, None, Policy::default());
    let bytes: Vec<u8> = (0..3 * CHUNK).map(|i| (i % 253) as u8).collect();
    let staged = dir.path().join("staged.data");
    std::fs::write(&staged, &bytes).unwrap();
    let ino = std::fs::metadata(&staged).unwrap().ino();

    // A length other than the version's is refused, and the file left where it was.
    let wrong = ChunkKey::whole("s", "v1", bytes.len() as u64 + 1);
    assert!(!c.adopt_whole(wrong.clone(), staged.clone()).await.unwrap());
    assert!(staged.exists() && c.open_whole(&wrong).is_none());

    let whole = ChunkKey::whole("s", "v1", bytes.len() as u64);
    assert!(c.adopt_whole(whole.clone(), staged.clone()).await.unwrap());
    assert!(!staged.exists(), "the staged file was moved, not copied");
    let mut copy = c.open_whole(&whole).unwrap();
    assert_eq!(copy.metadata().unwrap().ino(), ino, "the copy is the staged file itself");
    let mut got = Vec::new();
    copy.read_to_end(&mut got).unwrap();
    assert_eq!(got, bytes);
    assert_eq!(c.status().tier(TierKind::Hot).unwrap().used, bytes.len() as u64, "the copy counts against the tier");

    // A second staged copy of a version already there is left for its owner to discard.
    let again = dir.path().join("again.data");
    std::fs::write(&again, &bytes).unwrap();
    assert!(c.adopt_whole(whole.clone(), again.clone()).await.unwrap());
    assert!(again.exists());

    // Kept across a restart, like an assembled copy.
    drop(c);
    let c = open(dir.path(), 1 << 20, None, Policy::default());
    let mut after = Vec::new();
    c.open_whole(&whole).unwrap().read_to_end(&mut after).unwrap();
    assert_eq!(after, bytes);
}

#[tokio::test]
async fn a_full_hot_tier_demotes_the_chunks_a_whole_file_copy_repeats_before_any_copy() {
    let dir = tempfile::tempdir().unwrap();
    let k0 = key("f0", 0);
    // Room for the chunks and copies of 5 of the 8 files read: under plain LRU, the copies of
    // the first files read were taken as often as their chunks.
    let hot_cap = 5 * (disk(&k0) + CHUNK as u64) + CHUNK as u64;
    let c = open(dir.path(), hot_cap, Some(1 << 20), Policy::default());
    let f = fetcher(CHUNK);
    let files: Vec<(ChunkKey, ChunkKey)> =
        (0..8).map(|i| (key(&format!("f{i}"), 0), ChunkKey::whole(format!("f{i}"), "v1", CHUNK as u64))).collect();
    for (chunk, whole) in &files {
        c.get(chunk, f.clone(), W).await.unwrap();
        c.wait_background(Duration::from_secs(5)).await;
        assert!(c.build_whole(whole.clone(), vec![chunk.clone()]).await.unwrap(), "{whole}");
        // Distinct access times, so that LRU's order is the reading order.
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
    c.wait_background(Duration::from_secs(5)).await;
    for (chunk, whole) in &files {
        assert!(c.open_whole(whole).is_some(), "{whole} was dropped while chunks it repeats stayed hot");
        assert!(c.location(chunk).is_some(), "{chunk} is kept, in one tier or the other");
    }
    // The room came from the oldest chunks, moved down rather than dropped.
    assert_eq!(c.location(&files[0].0), Some(TierKind::Warm));
    assert!(c.status().tier(TierKind::Hot).unwrap().used <= hot_cap);
}
