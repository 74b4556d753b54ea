//! Errors of the tiered cache.

use crate::tier::TierKind;
use std::sync::Arc;

/// Why a fetcher could not produce a chunk. Shared, because one fetch may answer many waiters.
pub type FetchError = Arc<dyn std::error::Error + Send + Sync>;

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("fetching {key} failed: {source}")]
    Fetch { key: String, source: FetchError },
    #[error("the {tier} tier is full: {used} of {capacity} bytes in use, {pinned} of them pinned")]
    TierFull { tier: TierKind, used: u64, capacity: u64, pinned: u64 },
    #[error(
        "pinning `{pattern}` to the {tier} tier would need {needed} bytes of pinned data, above the tier's high watermark of {limit} bytes; enlarge the tier or pin less"
    )]
    PinTooLarge { pattern: String, tier: TierKind, needed: u64, limit: u64 },
    #[error("the {0} tier is not configured")]
    NoSuchTier(TierKind),
    #[error("`{0}` is not cached: a policy rule says no_cache")]
    NoCache(String),
    #[error("{what} {path}: {source}")]
    Io { what: &'static str, path: std::path::PathBuf, source: std::io::Error },
    #[error("state file {path} is invalid: {message}")]
    State { path: std::path::PathBuf, message: String },
    #[error("internal task failed: {0}")]
    Task(String),
}

impl CacheError {
    pub(crate) fn io(what: &'static str, path: &std::path::Path, source: std::io::Error) -> Self {
        CacheError::Io { what, path: path.to_path_buf(), source }
    }
}
