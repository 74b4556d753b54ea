//! Property test of the policy engine: random operation sequences against a small reference
//! model. Checked after every step: no tier ever holds more than its capacity, and after a
//! policy pass none sits above its high watermark unless pinned chunks that cannot move fill it;
//! pinned
//! chunks never leave the cache; a chunk the model says is present is served without a fetch;
//! and every read returns exactly the source bytes.

use bytes::Bytes;
use futures::FutureExt;
use futures::future::BoxFuture;
use proptest::prelude::*;
use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use strata_tiering::chunkfile::encoded_len;
use strata_tiering::*;

const CHUNK: usize = 2048;
const PATHS: [&str; 4] = ["a/", "b/", "c/", "d/"];

#[derive(Debug, Default)]
struct Source {
    calls: AtomicUsize,
}

fn expected(key: &ChunkKey) -> Bytes {
    let id = key.id().0;
    Bytes::from((0..CHUNK).map(|i| id[i % 32].wrapping_add(i as u8)).collect::<Vec<_>>())
}

impl Fetcher for Source {
    fn fetch(&self, key: &ChunkKey) -> BoxFuture<'static, Result<Bytes, FetchError>> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let key = key.clone();
        async move { Ok(expected(&key)) }.boxed()
    }
}

#[derive(Debug, Clone)]
enum Op {
    Read { path: usize, chunk: u64 },
    ReadIntoWarm { path: usize, chunk: u64 },
    Pin { path: usize, hot: bool },
    Unpin { path: usize },
    Evict { path: usize },
    Demote,
    Apply,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..PATHS.len(), 0..6u64).prop_map(|(path, chunk)| Op::Read { path, chunk }),
        2 => (0..PATHS.len(), 0..6u64).prop_map(|(path, chunk)| Op::ReadIntoWarm { path, chunk }),
        1 => (0..PATHS.len(), any::<bool>()).prop_map(|(path, hot)| Op::Pin { path, hot }),
        1 => (0..PATHS.len()).prop_map(|path| Op::Unpin { path }),
        1 => (0..PATHS.len()).prop_map(|path| Op::Evict { path }),
        1 => Just(Op::Demote),
        1 => Just(Op::Apply),
    ]
}

fn key(path: usize, chunk: u64) -> ChunkKey {
    ChunkKey::object(format!("{}f", PATHS[path]), "v1", chunk, CHUNK as u64)
}

/// The reference model: which paths are pinned, and which chunks must therefore be present.
#[derive(Default)]
struct Model {
    pinned: HashSet<usize>,
    must_have: BTreeSet<(usize, u64)>,
}

fn run(ops: Vec<Op>, eviction: &str) -> Result<(), TestCaseError> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let one = encoded_len(&key(0, 0), CHUNK as u64);
    let (hot_cap, warm_cap) = (8 * one, 12 * one);
    let cache = TieredCache::open(CacheConfig {
        hot: TierConfig::new(dir.path().join("hot"), hot_cap),
        warm: Some(TierConfig::new(dir.path().join("warm"), warm_cap)),
        state_dir: dir.path().join("state"),
        policy: Policy::from_toml(&format!("eviction = \"{eviction}\"")).unwrap(),
    })
    .unwrap();
    let src = Arc::new(Source::default());
    let mut model = Model::default();
    rt.block_on(async {
        for op in ops {
            match op {
                Op::Read { path, chunk } | Op::ReadIntoWarm { path, chunk } => {
                    let k = key(path, chunk);
                    let present = model.must_have.contains(&(path, chunk));
                    let before = src.calls.load(Ordering::SeqCst);
                    let tier = matches!(op, Op::ReadIntoWarm { .. }).then_some(TierKind::Warm);
                    let got = cache.get(&k, src.clone(), GetOptions { tier, wait_cached: true }).await.unwrap();
                    prop_assert_eq!(&got, &expected(&k));
                    if present {
                        prop_assert_eq!(src.calls.load(Ordering::SeqCst), before, "present chunk {} was fetched", k);
                    }
                    if model.pinned.contains(&path) && cache.location(&k).is_some() {
                        model.must_have.insert((path, chunk));
                    }
                }
                Op::Pin { path, hot } => {
                    let tier = if hot { TierKind::Hot } else { TierKind::Warm };
                    let pattern = PathPattern::parse(PATHS[path]).unwrap();
                    // A pin is refused when it does not fit, and then changes nothing.
                    if cache.pin(pattern, tier).await.is_ok() {
                        model.pinned.insert(path);
                        for chunk in 0..6 {
                            if cache.location(&key(path, chunk)).is_some() {
                                model.must_have.insert((path, chunk));
                            }
                        }
                    }
                }
                Op::Unpin { path } => {
                    cache.unpin(PathPattern::parse(PATHS[path]).unwrap()).await.unwrap();
                    model.pinned.remove(&path);
                    model.must_have.retain(|(p, _)| *p != path);
                }
                Op::Evict { path } => {
                    cache.evict(PathPattern::parse(PATHS[path]).unwrap()).await.unwrap();
                }
                Op::Demote => {
                    cache.demote(Some(Duration::ZERO)).await.unwrap();
                }
                Op::Apply => {
                    // Promotions triggered by earlier reads run in the background; the watermark
                    // promise is about where the cache settles, so let them finish first.
                    prop_assert!(cache.wait_background(Duration::from_secs(10)).await);
                    cache.apply_policy().await.unwrap();
                    let s = cache.status();
                    for t in &s.tiers {
                        let high = (t.capacity as f64 * t.high_watermark) as u64;
                        prop_assert!(
                            t.used <= high.max(t.pinned),
                            "{} above its high watermark after a pass: {:?}",
                            t.tier,
                            t
                        );
                    }
                }
            }
            let s = cache.status();
            prop_assert!(s.tier(TierKind::Hot).unwrap().used <= hot_cap);
            prop_assert!(s.tier(TierKind::Warm).unwrap().used <= warm_cap);
            for (p, c) in &model.must_have {
                prop_assert!(cache.location(&key(*p, *c)).is_some(), "pinned chunk {}#{} was evicted", PATHS[*p], c);
            }
        }
        Ok(())
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn lru_policy_holds_its_promises(ops in proptest::collection::vec(op(), 1..60)) {
        run(ops, "lru")?;
    }

    #[test]
    fn lrfu_policy_holds_its_promises(ops in proptest::collection::vec(op(), 1..60)) {
        run(ops, "lrfu")?;
    }
}
