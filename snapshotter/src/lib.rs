//! strata-snapshotter: the containerd snapshotter that Strata serves as a proxy plugin.
//!
//! It serves ordinary overlay snapshots, with containerd's overlayfs semantics and a persistent
//! metadata store, and remote layers: eStargz blobs mounted lazily through cachefs.

pub mod activity;
pub mod blob_reads;
pub mod command;
pub mod convert;
pub mod early;
pub mod elf;
pub mod error;
pub mod fetch;
pub mod fill;
pub mod filter;
pub mod gate;
pub mod image_proxy;
pub mod layer;
pub mod lazy;
pub mod loader;
pub mod mirror;
pub mod model;
pub mod overlay;
pub mod peek;
pub mod peer_blobs;
pub mod proto;
pub mod readaround;
pub mod record;
pub mod registry;
pub mod remote;
pub mod report;
pub mod server;
pub mod service;
pub mod startup;
pub mod store;
pub mod unpack;
mod usage;

pub use error::SnapshotError;
pub use model::{Info, Kind, Mount, Usage};
pub use overlay::Snapshotter;
/// The layer formats, from `strata-format`, under the path the snapshotter has always used.
pub use strata_format::estargz;
