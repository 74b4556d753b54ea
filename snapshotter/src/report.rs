//! What `strata image layers` shows of each layer the snapshotter was asked to serve lazily:
//! whether it is lazy (and if not, why), how much of its blob has been fetched, and how far its
//! prefetch and background fill have got.

use crate::fill::Stage;
use serde::{Deserialize, Serialize};

/// The admin API path that serves the reports.
pub const LAYERS_PATH: &str = "/v1/images/layers";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerReport {
    /// The chain ID the layer is committed under.
    pub snapshot: String,
    pub image: String,
    pub layer: String,
    pub lazy: bool,
    /// `lazy`, `whole` (fetched whole and unpacked by Strata) or `containerd` (left to
    /// containerd to download).
    #[serde(default)]
    pub how: String,
    /// Why the layer is not lazy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub blob_size: u64,
    /// Compressed bytes fetched from the registry for chunks.
    pub fetched_bytes: u64,
    pub prefetch: Stage,
    /// Compressed bytes before `.prefetch.landmark`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefetch_bytes: Option<u64>,
    pub background: Stage,
    pub chunks_total: u64,
    pub chunks_cached: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}
