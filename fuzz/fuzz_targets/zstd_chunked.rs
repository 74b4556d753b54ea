//! Any blob read as zstd:chunked: its footer, the manifest (TOC) it locates, checked against
//! the digest of the manifest's own JSON as a layer's annotation would give it, and each chunk
//! the manifest places. Every chunk's range lies in the blob's data, before the manifest, and
//! decoding it either checks out or fails; never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use strata_format::estargz::{Compression, MAX_FOOTER_SIZE, decode_chunk, decode_toc, parse_footer, sha256_digest};

/// The manifest limit the snapshotter is given in the tests: far above any seed's.
const LIMIT: u64 = 1 << 20;

fuzz_target!(|data: &[u8]| {
    let size = data.len() as u64;
    let tail = &data[data.len().saturating_sub(MAX_FOOTER_SIZE as usize)..];
    let Ok(footer) = parse_footer(tail, size) else { return };
    if footer.compression != Compression::Zstd {
        return;
    }
    assert!(footer.toc_offset <= footer.toc_end && footer.toc_end <= size - footer.len, "{footer:?}");
    let member = &data[footer.toc_offset as usize..footer.toc_end as usize];
    // The manifest's digest is over its raw JSON: decompressed here on its own, so that the
    // parse is reached for any manifest that decompresses, not only for the seeds'.
    let Ok(json) = zstd::bulk::decompress(member, LIMIT as usize) else { return };
    let Ok(toc) = decode_toc(member, Compression::Zstd, footer.data_end, &sha256_digest(&json), LIMIT) else {
        return;
    };
    for e in &toc.entries {
        for c in &e.chunks {
            assert!(c.offset < c.compressed_end && c.compressed_end <= footer.data_end, "{c:?} of {footer:?}");
            let _ = decode_chunk(&e.path, c, &data[c.offset as usize..c.compressed_end as usize]);
        }
    }
});
