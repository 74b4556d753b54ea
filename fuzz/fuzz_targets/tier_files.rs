//! Any file where a tier keeps a chunk, as a restart scans it to rebuild the index, and any
//! bytes where the tier's key sidecars and its pins file are: a header, verified data, or an
//! error; never a panic. Data that verifies is exactly the header's length, and a ranged read
//! of it gives the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::path::PathBuf;
use std::sync::OnceLock;
use strata_tiering::chunkfile::{read_header, read_verified, read_verified_range};
use strata_tiering::{ChunkKey, Pin};

/// One file per fuzzing process, on tmpfs where there is one: the readers take paths.
fn scratch() -> &'static PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let dir =
            if std::path::Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
        dir.join(format!("strata-fuzz-chunk-{}", std::process::id()))
    })
}

fuzz_target!(|data: &[u8]| {
    let path = scratch();
    std::fs::write(path, data).expect("the scratch file is writable");
    if let Ok(h) = read_header(path) {
        let id = h.key.id();
        if let Ok(bytes) = read_verified(path, id) {
            assert_eq!(bytes.len() as u64, h.data_len);
            let f = std::fs::File::open(path).expect("just written");
            let ranged = read_verified_range(f, id, data.len() as u64, 0..h.data_len).expect("it verified whole");
            assert_eq!(ranged, bytes);
        }
    }
    if let Ok(key) = serde_json::from_slice::<ChunkKey>(data) {
        let _ = key.id();
    }
    if let Ok(pins) = serde_json::from_slice::<Vec<Pin>>(data) {
        for p in &pins {
            let _ = p.pattern.matches("datasets/imagenet/train/shard-0001.tar");
        }
    }
});
