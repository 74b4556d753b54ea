//! Any manifest or index body, as a registry or mirror answers a manifest request: an image
//! manifest or this platform's choice from an index, or an error; never a panic. Every digest
//! decoded is a well-formed sha256, since the reads that follow put it in a URL and check
//! content against it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use strata_format::estargz::is_sha256_digest;
use strata_snapshotter::registry::ImageRef;
use strata_snapshotter::registry::client::{Decoded, decode_manifest};

fuzz_target!(|data: &[u8]| {
    let image = ImageRef::parse("registry.test/team/app:1").expect("a valid reference");
    let digest = strata_format::estargz::sha256_digest(data);
    match decode_manifest(&image, data, digest.clone()) {
        Ok(Decoded::Image(m)) => {
            assert_eq!(m.digest, digest);
            assert!(is_sha256_digest(&m.config_digest), "{m:?}");
            assert!(m.layers.iter().all(|l| is_sha256_digest(&l.digest)), "{m:?}");
        }
        Ok(Decoded::Index { chosen }) => assert!(is_sha256_digest(&chosen), "{chosen:?}"),
        Err(e) => assert!(e.to_string().starts_with("manifest registry.test/team/app:1: "), "{e}"),
    }
});
