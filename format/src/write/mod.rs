//! Layer tars rewritten as eStargz or zstd:chunked: `tar_index` finds the entries, `plan`
//! orders them for prefetch, `estargz_out` writes the members, TOC and footer.

pub mod estargz_out;
mod members;
pub use members::Hashed;
pub mod plan;
pub mod tar_index;
mod toc_out;
