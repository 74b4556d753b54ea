//! Status reports of the cache, as served by the admin API and printed by `strata tier status`.

use crate::tier::TierKind;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TierStatus {
    pub tier: TierKind,
    pub path: PathBuf,
    pub capacity: u64,
    pub high_watermark: f64,
    pub low_watermark: f64,
    /// Bytes on disk, chunk headers included.
    pub used: u64,
    pub chunks: u64,
    /// Bytes in this tier held by pins (to either tier); eviction never takes them.
    pub pinned: u64,
    pub hits: u64,
    pub misses: u64,
    pub hit_ratio: f64,
    /// Chunk bytes written into the tier (fills, promotions, demotions).
    pub bytes_in: u64,
    /// Chunk bytes served from the tier.
    pub bytes_out: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheStatus {
    pub tiers: Vec<TierStatus>,
    pub cold_fetches: u64,
    pub cold_fetch_errors: u64,
    pub cold_bytes: u64,
    pub checksum_failures: u64,
    pub promotions: u64,
    pub demotions: u64,
    pub evictions: u64,
}

impl CacheStatus {
    pub fn tier(&self, t: TierKind) -> Option<&TierStatus> {
        self.tiers.iter().find(|s| s.tier == t)
    }
}
