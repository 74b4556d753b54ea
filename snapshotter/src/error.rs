//! What can go wrong with a snapshot, named so that the gRPC boundary can pick the code
//! containerd expects (NotFound, AlreadyExists, FailedPrecondition, InvalidArgument).

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("snapshot {0:?} does not exist")]
    NotFound(String),
    #[error("parent snapshot {0:?} does not exist")]
    ParentNotFound(String),
    #[error("snapshot {0:?} already exists")]
    AlreadyExists(String),
    #[error("parent {0:?} is not a committed snapshot")]
    ParentNotCommitted(String),
    #[error("snapshot {key:?} is {kind}, not active")]
    NotActive { key: String, kind: &'static str },
    #[error("snapshot {0:?} is committed: only active snapshots and views have mounts")]
    NoMounts(String),
    #[error("cannot remove snapshot {0:?}: other snapshots are built on it")]
    HasChildren(String),
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("layer {name:?} is not available: {reason}")]
    LayerUnavailable { name: String, reason: String },
    #[error("snapshot metadata {path}: {source}")]
    Store {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("snapshot metadata {path} is damaged: {reason}")]
    StoreDamaged { path: PathBuf, reason: String },
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl SnapshotError {
    pub(crate) fn io(what: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> SnapshotError {
        let path = path.into();
        move |source| SnapshotError::Io { what, path, source }
    }
}
