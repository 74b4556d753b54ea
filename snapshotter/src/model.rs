//! The snapshotter's own types, free of gRPC: what a snapshot is, and what it mounts as.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::SystemTime;

/// containerd's three kinds of snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// Read-only, not committable; used for `ctr snapshot view` and image checks.
    View,
    /// Writable; becomes committed on Commit.
    Active,
    /// Immutable; the only kind a snapshot can be built on.
    Committed,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::View => "view",
            Kind::Active => "active",
            Kind::Committed => "committed",
        }
    }
}

/// What containerd sees of a snapshot (its `snapshots.Info`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Info {
    pub name: String,
    pub parent: Option<String>,
    pub kind: Kind,
    pub labels: BTreeMap<String, String>,
    pub created: SystemTime,
    pub updated: SystemTime,
}

/// One mount the caller performs, in the shape of `containerd.types.Mount`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mount {
    pub kind: String,
    pub source: String,
    pub options: Vec<String>,
}

/// Disk space a snapshot's own layer takes, as containerd reports it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Bytes in allocated blocks, each hard-linked inode counted once.
    pub size: i64,
    pub inodes: i64,
}
