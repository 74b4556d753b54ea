//! eStargz layers as stargz-snapshotter writes them, gzip or zstd:chunked: the footer that locates the TOC,
//! the TOC that describes every file and chunk, and the decoding of one chunk with its digest
//! checked. Nothing here does I/O: callers fetch byte ranges and hand them in.

pub mod chunk;
pub mod footer;
pub mod hint;
pub mod tail_scan;
#[cfg(test)]
mod testblob;
pub mod time;
pub mod toc;

pub use chunk::decode_chunk;
pub use footer::{Compression, Footer, MAX_FOOTER_SIZE, parse_footer};
pub use toc::{Chunk, Entry, EntryKind, Landmark, Toc, decode_toc, verified_toc_json};

/// What is wrong with a layer's bytes. Each names the part and, where there is one, the entry.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("a blob of {0} bytes is too short to be eStargz")]
    TooShort(u64),
    #[error("no eStargz footer at the end of the blob (neither the 51-byte form nor the legacy 47-byte one)")]
    NoFooter,
    #[error("the blob's footer says its TOC is outside this blob (external TOC), which is not supported")]
    ExternalToc,
    #[error("the footer puts the TOC at {offset}, outside the {size}-byte blob")]
    TocOffset { offset: u64, size: u64 },
    #[error("the TOC is over the limit of {limit} bytes (snapshotter.max_toc_size)")]
    TocTooLarge { limit: u64 },
    #[error("the TOC's digest is {actual}, but the layer's toc.digest annotation says {expected}")]
    TocDigest { expected: String, actual: String },
    #[error("the TOC member is damaged: {0}")]
    TocMember(String),
    #[error("the TOC is not valid JSON of an eStargz TOC: {0}")]
    TocJson(String),
    #[error("TOC entry {name:?}: {reason}")]
    Entry { name: String, reason: String },
    #[error("chunk at {file_offset} of {name:?}: {reason}")]
    Chunk { name: String, file_offset: u64, reason: String },
    #[error("chunk at {file_offset} of {name:?}: its bytes hash to {actual}, but the TOC says {expected}")]
    ChunkDigest { name: String, file_offset: u64, expected: String, actual: String },
}

/// `sha256:<hex>` of `bytes`.
pub fn sha256_digest(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

/// Whether `d` is a well-formed `sha256:` digest.
pub fn is_sha256_digest(d: &str) -> bool {
    d.strip_prefix("sha256:").is_some_and(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}
