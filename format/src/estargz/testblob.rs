//! Test-only: builds small eStargz blobs the way the format lays them out (a gzip member per
//! file payload, the TOC member, the footer), so the reader can be tested on exact bytes.

use super::footer::footer_bytes;
use super::sha256_digest;
use flate2::Compression;
use flate2::write::GzEncoder;
use std::io::Write;

pub struct Built {
    pub blob: Vec<u8>,
    pub toc_digest: String,
    pub toc_offset: u64,
}

fn gz(data: &[u8]) -> Vec<u8> {
    let mut e = GzEncoder::new(Vec::new(), Compression::default());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

/// Feeds `bytes` to a scan in pieces of `piece` bytes: the offset it found and the bytes fed by
/// then. A scan answers once: the same piece fed again after its answer gives nothing.
pub fn feed_in_pieces(bytes: &[u8], piece: usize, mut feed: impl FnMut(&[u8]) -> Option<u64>) -> Option<(u64, usize)> {
    let mut fed = 0;
    for p in bytes.chunks(piece) {
        fed += p.len();
        if let Some(at) = feed(p) {
            assert_eq!(feed(p), None, "one answer, then none");
            return Some((at, fed));
        }
    }
    None
}

/// A tar header block of a regular file, enough for the TOC member.
pub fn tar_header(name: &str, size: u64) -> Vec<u8> {
    let mut h = vec![0u8; 512];
    h[..name.len()].copy_from_slice(name.as_bytes());
    h[100..107].copy_from_slice(b"0000644");
    h[124..135].copy_from_slice(format!("{size:011o}").as_bytes());
    h[156] = b'0';
    h[257..262].copy_from_slice(b"ustar");
    h
}

/// Files given as (name, content, chunk size); other entries as raw TOC JSON objects. Each
/// chunk gets its own member. Returns the blob and its TOC.
pub fn build(files: &[(&str, &[u8], usize)], extra_entries: &[serde_json::Value]) -> Built {
    // The blob starts, as a writer's does, with a member of tar headers: no data is at byte 0.
    let mut blob = gz(&tar_header("./", 0));
    let mut entries: Vec<serde_json::Value> = extra_entries.to_vec();
    for (name, content, chunk) in files {
        for (n, piece) in content.chunks(*chunk).enumerate() {
            let offset = blob.len();
            blob.extend_from_slice(&gz(piece));
            let last = (n + 1) * chunk >= content.len();
            let mut e = serde_json::json!({
                "name": name,
                "type": if n == 0 { "reg" } else { "chunk" },
                "offset": offset,
                "chunkOffset": n * chunk,
                "chunkSize": if last { 0 } else { *chunk },
                "chunkDigest": sha256_digest(piece),
            });
            if n == 0 {
                e["size"] = content.len().into();
                e["digest"] = sha256_digest(content).into();
                e["mode"] = 0o644.into();
            }
            entries.push(e);
        }
    }
    let toc_json = serde_json::to_vec_pretty(&serde_json::json!({"version": 1, "entries": entries})).unwrap();
    let toc_offset = blob.len() as u64;
    let mut tar = tar_header("stargz.index.json", toc_json.len() as u64);
    tar.extend_from_slice(&toc_json);
    tar.resize(tar.len().div_ceil(512) * 512 + 1024, 0);
    blob.extend_from_slice(&gz(&tar));
    blob.extend_from_slice(&footer_bytes(toc_offset));
    Built { toc_digest: sha256_digest(&toc_json), blob, toc_offset }
}
