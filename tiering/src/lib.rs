//! strata-tiering: the tiered chunk cache shared by image layers and datasets.
//!
//! Chunks are plain, verified bytes under a content identity ([`ChunkKey`]). A read tries the hot
//! tier, then the warm tier (promoting on a hit), then calls the caller's [`Fetcher`]. Misses on
//! one chunk share a single fetch. Every chunk file carries a CRC32C that is checked on every
//! read, so a damaged file is a miss, never a wrong byte. A [`Policy`] decides pinning, TTLs,
//! idle demotion and the eviction order; the daemon applies it in the background.

pub mod admin;
pub mod agent;
mod cache;
pub mod chunkfile;
pub mod config;
mod core;
mod error;
mod fetcher;
mod index;
pub mod key;
pub mod metrics;
mod partcopy;
pub mod pattern;
pub mod peer;
pub mod policy;
pub mod progress;
pub mod requests;
mod restore;
pub mod services;
pub mod source;
pub mod status;
pub mod tier;
pub mod units;
pub mod unix_socket;
pub mod upload;
pub mod warmup;
mod whole;

pub use cache::{CacheConfig, Fetcher, GetOptions, Moved, PolicyPass, Streamed, TieredCache};
pub use core::Pin;
pub use error::{CacheError, FetchError};
pub use key::{ChunkKey, Identity, KeyId};
pub use pattern::PathPattern;
pub use policy::{Eviction, Policy, PolicyError};
pub use tier::{TierConfig, TierKind};
