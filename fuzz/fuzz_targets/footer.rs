//! Any blob tail, for a blob of any size: a footer that points inside the blob, or an error.
#![no_main]

use libfuzzer_sys::fuzz_target;
use strata_format::estargz::parse_footer;

fuzz_target!(|data: &[u8]| {
    let (size_bytes, tail) = data.split_at(data.len().min(8));
    let mut size = [0u8; 8];
    size[..size_bytes.len()].copy_from_slice(size_bytes);
    for blob_size in [u64::from_le_bytes(size), tail.len() as u64] {
        if let Ok(f) = parse_footer(tail, blob_size) {
            // What a reader then fetches lies inside the blob, before the footer.
            assert!(f.toc_offset <= f.toc_end && f.toc_end <= blob_size - f.len, "{f:?} of {blob_size}");
            assert!(f.data_end <= f.toc_offset);
        }
    }
});
