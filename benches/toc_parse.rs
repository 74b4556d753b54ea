//! Criterion benchmark of reading an eStargz TOC, which a lazy pull does on its path for every
//! layer: `parse_toc` of a TOC of 8,000 files (about as many as a Debian base with python) and
//! 16,000 chunk entries, 4.4 MB of JSON, and the parse together with the layer's tree built from
//! it (all a layer's Prepare does with its TOC), against `serde_json::from_slice` of the same
//! bytes into a generic `Value`, the least any reader of that JSON does. `docs/BENCHMARKS.md`
//! has the figures and the command.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use std::sync::Arc;
use strata_snapshotter::estargz::toc::parse_toc;
use strata_snapshotter::layer::{Blob, LayerNamespace};
use strata_snapshotter::registry::{ImageRef, Registry, hosts::Hosts};

/// A TOC as ctr-remote writes them: a directory every 20 files, regular files of one to three
/// chunks, each with its digests, user and group names, and RFC 3339 times.
fn toc(files: usize) -> (Vec<u8>, u64) {
    let digest = |i: usize| format!("sha256:{:064x}", i * 7919);
    let mut entries = Vec::new();
    let mut offset = 0u64;
    for i in 0..files {
        if i % 20 == 0 {
            entries.push(serde_json::json!({"name": format!("usr/lib/d{}/", i / 20), "type": "dir",
                "modtime": "2024-05-01T10:00:00Z", "mode": 0o755, "uid": 0, "gid": 0,
                "userName": "root", "groupName": "root"}));
        }
        let chunks = 1 + i % 3;
        let size = chunks as u64 * 4096;
        for c in 0..chunks {
            let mut e = serde_json::json!({"name": format!("usr/lib/d{}/file-{i}.so", i / 20),
                "offset": offset, "chunkOffset": c * 4096, "chunkDigest": digest(i * 4 + c)});
            if c == 0 {
                e["type"] = "reg".into();
                e["size"] = size.into();
                e["modtime"] = "2024-05-01T10:00:00Z".into();
                e["mode"] = 0o644.into();
                e["userName"] = "root".into();
                e["groupName"] = "root".into();
                e["digest"] = digest(i).into();
            } else {
                e["type"] = "chunk".into();
            }
            if c + 1 < chunks {
                e["chunkSize"] = 4096.into();
            }
            entries.push(e);
            offset += 1500;
        }
    }
    (serde_json::to_vec(&serde_json::json!({"version": 1, "entries": entries})).unwrap(), offset)
}

fn bench(c: &mut Criterion) {
    let (json, toc_offset) = toc(8000);
    let mut g = c.benchmark_group("toc_parse");
    g.throughput(Throughput::Bytes(json.len() as u64));
    g.sample_size(30);
    g.bench_function("parse_toc", |b| b.iter(|| parse_toc(&json, toc_offset).unwrap()));
    let registry = Arc::new(Registry::new(Hosts::new(None), Default::default()));
    let image = ImageRef::parse("127.0.0.1:5000/strata/bench:1").unwrap();
    let blob = Arc::new(Blob::new(registry, image, format!("sha256:{}", "d".repeat(64)), toc_offset + (1 << 20)));
    g.bench_function("parse_toc_and_tree", |b| {
        b.iter(|| LayerNamespace::new(&parse_toc(&json, toc_offset).unwrap(), blob.clone()).unwrap())
    });
    g.bench_function("serde_json_value", |b| b.iter(|| serde_json::from_slice::<serde_json::Value>(&json).unwrap()));
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
