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
