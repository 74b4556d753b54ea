//! strata-format: the bytes of lazily pullable layers, with no I/O of its own.
//!
//! `estargz` reads eStargz and zstd:chunked blobs as stargz-snapshotter writes them: footers,
//! TOCs checked against their digest, and chunks checked against theirs. `write` turns a layer
//! tar into such a blob. Kept apart from the snapshotter so the fuzz targets build small.

pub mod estargz;
pub mod write;
