//! Request and response bodies of the admin API, shared by the server and the CLI.

use crate::core::Pin;
use crate::status::CacheStatus;
use crate::tier::TierKind;
use crate::units::Dur;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

pub const STATUS: &str = "/v1/status";
pub const POLICY: &str = "/v1/policy";
pub const PIN: &str = "/v1/pin";
pub const UNPIN: &str = "/v1/unpin";
pub const WARMUP: &str = "/v1/warmup";
pub const JOBS: &str = "/v1/jobs";
pub const EVICT: &str = "/v1/evict";
pub const DEMOTE: &str = "/v1/demote";
pub const APPLY: &str = "/v1/apply";
/// `GET /v1/read/<path>`: the object's bytes, read through the cache.
pub const READ: &str = "/v1/read";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StatusReport {
    /// The cold store, e.g. `s3://bucket at http://127.0.0.1:7480`.
    pub cold: String,
    pub chunk_size: u64,
    #[serde(flatten)]
    pub cache: CacheStatus,
    /// The peer tier, when the node has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peers: Option<PeersStatus>,
}

/// The peer tier as `strata tier status` shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PeersStatus {
    pub members: Vec<PeerMember>,
    /// Chunk bytes this node's misses got from peers, and from the origin.
    pub received_bytes: u64,
    pub origin_bytes: u64,
    /// Chunk bytes this node served to peers as owner, and as a holder an owner named.
    pub served_bytes: u64,
    #[serde(default)]
    pub holder_served_bytes: u64,
    /// Askers of a hot chunk this node sent on to a holder, and redirects it followed.
    #[serde(default)]
    pub redirects: u64,
    #[serde(default)]
    pub redirected: u64,
    /// Stalled transfers resumed at their offset from another member.
    #[serde(default)]
    pub resumed: u64,
    /// Chunks asked of this node in place of their owner, which it got from that owner.
    #[serde(default)]
    pub stood_in: u64,
    /// Directory listings got from their owners, and served to members as their owner.
    #[serde(default)]
    pub listings_received: u64,
    #[serde(default)]
    pub listings_served: u64,
    pub errors: u64,
    pub timeouts: u64,
    pub corrupt: u64,
    /// Misses that went to the origin because no member could serve them.
    pub origin_fallbacks: u64,
    /// Requests refused for want of the cluster's secret.
    pub refused: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PeerMember {
    pub name: String,
    /// `self`, `ok`, or `suspect` (failed lately, skipped for now).
    pub state: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PolicyView {
    pub file: PathBuf,
    pub policy: String,
    pub pins: Vec<Pin>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PinRequest {
    pub paths: Vec<String>,
    pub tier: TierKind,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PathsRequest {
    pub paths: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WarmupRequest {
    pub paths: Vec<String>,
    pub tier: TierKind,
    pub parallel: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobCreated {
    pub id: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DemoteRequest {
    /// Idle time after which hot chunks go to warm; the policy's `hot_idle` when absent.
    pub idle: Option<Dur>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UnpinResult {
    pub removed: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ApiError {
    pub error: String,
}
