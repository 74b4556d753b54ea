//! Any TOC member (gzip or zstd) and any TOC JSON: a validated tree or an error, never a panic;
//! and for a tree, every chunk's range lies where the reader will fetch it, and decoding it
//! from the input either checks out or fails. The landmark scan, fed the input piece by piece
//! as a TOC member arrives from a registry, answers or gives up, never panics.
#![no_main]

use libfuzzer_sys::fuzz_target;
use strata_format::estargz::hint::{LandmarkScan, prefetch_landmark};
use strata_format::estargz::{Compression, decode_chunk, decode_toc, toc::parse_toc};

fuzz_target!(|data: &[u8]| {
    for c in [Compression::Gzip, Compression::Zstd] {
        let _ = decode_toc(data, c, data.len() as u64, "sha256:00", 1 << 20);
        // Pieces as long as the input's first byte says (at least one byte).
        let piece = usize::from(data.first().copied().unwrap_or(0)).max(1);
        let mut scan = LandmarkScan::new(c);
        for p in data.chunks(piece) {
            if scan.feed(p).is_some() {
                break;
            }
        }
    }
    let _ = prefetch_landmark(data);
    let end = data.len() as u64;
    if let Ok(toc) = parse_toc(data, end) {
        for e in &toc.entries {
            for c in &e.chunks {
                assert!(c.offset < c.compressed_end && c.compressed_end <= end, "{c:?}");
                let _ = decode_chunk(&e.path, c, &data[c.offset as usize..c.compressed_end as usize]);
            }
        }
    }
});
