//! Criterion benchmarks of the tiered cache, each side by side with its baseline in one run:
//!
//! - `hot_hit`: a 1 MiB chunk served from the hot tier (open, read, CRC32C check) against
//!   `std::fs::read` of the same bytes stored as a plain file in the same directory.
//! - `hot_hit_from_disk`: the same two reads after dropping the files' pages from the page cache
//!   (untimed, `dd iflag=nocache`), so the bytes come from the tier's disk, as they do for a hot
//!   tier far larger than RAM.
//! - `miss_rgw`: filling a 32 MiB object through the cache from Ceph RGW with 8 chunk fetches in
//!   flight, against 8 raw parallel `get_range` calls over the same ranges. Needs the RGW
//!   variables that `.ci/run` sets (`STRATA_TEST_S3_ENDPOINT`, ...); skipped with a notice
//!   otherwise.
//!
//! `docs/BENCHMARKS.md` has the figures and the commands.

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use futures::StreamExt;
use object_store::{ObjectStore, ObjectStoreExt};
use std::sync::Arc;
use std::time::{Duration, Instant};
use strata_tiering::source::{ColdConfig, ColdKind, ObjectSource};
use strata_tiering::units::{ByteSize, Dur};
use strata_tiering::{CacheConfig, ChunkKey, PathPattern, Policy, TierConfig, TieredCache};

const MIB: usize = 1 << 20;

fn payload(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

fn open_cache(dir: &std::path::Path) -> TieredCache {
    TieredCache::open(CacheConfig {
        hot: TierConfig::new(dir.join("hot"), 4 << 30),
        warm: Some(TierConfig::new(dir.join("warm"), 4 << 30)),
        state_dir: dir.join("state"),
        policy: Policy::default(),
    })
    .expect("cache opens")
}

fn hot_hit(c: &mut Criterion) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    // Under target/ rather than /tmp, so both sides sit on the same disk as a real tier would.
    let base = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench-hot");
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).unwrap();
    let cache = open_cache(&base);
    let plain = base.join("plain");
    std::fs::create_dir_all(&plain).unwrap();
    const N: usize = 32;
    let keys: Vec<ChunkKey> = (0..N).map(|i| ChunkKey::object(format!("bench/obj{i}"), "v1", 0, MIB as u64)).collect();
    for (i, k) in keys.iter().enumerate() {
        let data = Bytes::from(payload(i as u8, MIB));
        std::fs::write(plain.join(format!("obj{i}")), &data).unwrap();
        rt.block_on(cache.put(k.clone(), data, strata_tiering::TierKind::Hot)).unwrap();
    }
    let mut g = c.benchmark_group("hot_hit");
    g.throughput(Throughput::Bytes(MIB as u64));
    let mut i = 0;
    g.bench_function(BenchmarkId::new("std_fs_read", "1MiB"), |b| {
        b.iter(|| {
            i = (i + 1) % N;
            std::fs::read(plain.join(format!("obj{i}"))).unwrap()
        })
    });
    g.bench_function(BenchmarkId::new("strata_hot_hit", "1MiB"), |b| {
        b.iter(|| {
            i = (i + 1) % N;
            cache.get_local_blocking(&keys[i]).expect("chunk is hot")
        })
    });
    g.finish();

    // Only the data files leave the page cache: dropping every cache would also evict the
    // benchmark's own code pages, and the side that runs more code would pay for it.
    let chunk_files: Vec<std::path::PathBuf> = walk(&base.join("hot"));
    let plain_files: Vec<std::path::PathBuf> = (0..N).map(|i| plain.join(format!("obj{i}"))).collect();
    let uncache = |files: &[std::path::PathBuf]| {
        for f in files {
            let ok = std::process::Command::new("dd")
                .arg(format!("if={}", f.display()))
                .args(["iflag=nocache", "count=0", "status=none"])
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "dd could not drop {} from the page cache", f.display());
        }
    };
    let mut g = c.benchmark_group("hot_hit_from_disk");
    g.throughput(Throughput::Bytes((N * MIB) as u64));
    g.sample_size(20);
    g.measurement_time(Duration::from_secs(10));
    g.bench_function(BenchmarkId::new("std_fs_read", "32x1MiB"), |b| {
        b.iter_custom(|iters| {
            let mut t = Duration::ZERO;
            for _ in 0..iters {
                uncache(&plain_files);
                let start = Instant::now();
                for i in 0..N {
                    std::hint::black_box(std::fs::read(plain.join(format!("obj{i}"))).unwrap());
                }
                t += start.elapsed();
            }
            t
        })
    });
    g.bench_function(BenchmarkId::new("strata_hot_hit", "32x1MiB"), |b| {
        b.iter_custom(|iters| {
            let mut t = Duration::ZERO;
            for _ in 0..iters {
                uncache(&chunk_files);
                let start = Instant::now();
                for k in &keys {
                    std::hint::black_box(cache.get_local_blocking(k).expect("chunk is hot"));
                }
                t += start.elapsed();
            }
            t
        })
    });
    g.finish();
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

fn rgw_source() -> Option<ObjectSource> {
    let endpoint = std::env::var("STRATA_TEST_S3_ENDPOINT").ok()?;
    let bucket = std::env::var("STRATA_TEST_S3_BUCKET").ok()?;
    let cfg = ColdConfig {
        kind: ColdKind::S3,
        bucket: Some(bucket),
        endpoint: Some(endpoint),
        region: Some("us-east-1".into()),
        allow_http: true,
        timeout: Dur::secs(30),
        chunk_size: ByteSize::mib(1),
        ..ColdConfig::default()
    };
    Some(ObjectSource::new(&cfg, std::path::Path::new("/nonexistent")).expect("RGW source builds"))
}

fn miss_rgw(c: &mut Criterion) {
    let Some(source) = rgw_source() else {
        eprintln!(
            "miss_rgw: skipped, STRATA_TEST_S3_ENDPOINT/STRATA_TEST_S3_BUCKET not set (run it through benches/run.sh)"
        );
        return;
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    const SIZE: usize = 32 * MIB;
    const PARALLEL: usize = 8;
    let path = "bench/miss-32MiB.bin";
    rt.block_on(source.put(path, Bytes::from(payload(7, SIZE)))).unwrap();
    let info = rt.block_on(source.head(path)).unwrap();
    let base = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench-miss");
    let _ = std::fs::remove_dir_all(&base);
    let cache = open_cache(&base);
    let store: Arc<dyn ObjectStore> = source.store();
    let loc = object_store::path::Path::from(path);

    let mut g = c.benchmark_group("miss_rgw");
    g.throughput(Throughput::Bytes(SIZE as u64));
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(8));
    g.bench_function(BenchmarkId::new("raw_get_range_x8", "32MiB"), |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                for _ in 0..iters {
                    let n: usize = futures::stream::iter(0..SIZE / MIB)
                        .map(|i| {
                            let (store, loc) = (store.clone(), loc.clone());
                            async move {
                                store.get_range(&loc, (i * MIB) as u64..((i + 1) * MIB) as u64).await.unwrap().len()
                            }
                        })
                        .buffer_unordered(PARALLEL)
                        .fold(0, |a, n| async move { a + n })
                        .await;
                    assert_eq!(n, SIZE);
                }
                start.elapsed()
            })
        })
    });
    let fetcher = source.fetcher(&info);
    let keys = source.chunk_keys(&info);
    g.bench_function(BenchmarkId::new("strata_cache_fill_x8", "32MiB"), |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    cache.evict(PathPattern::prefix("bench/")).await.unwrap();
                    let start = Instant::now();
                    let n: usize = futures::stream::iter(keys.clone())
                        .map(|k| {
                            let (cache, f) = (cache.clone(), fetcher.clone());
                            async move { cache.get(&k, f, Default::default()).await.unwrap().len() }
                        })
                        .buffer_unordered(PARALLEL)
                        .fold(0, |a, n| async move { a + n })
                        .await;
                    total += start.elapsed();
                    assert_eq!(n, SIZE);
                }
                total
            })
        })
    });
    g.finish();
}

criterion_group!(benches, hot_hit, miss_rgw);
criterion_main!(benches);
