//! strata-cachefs: a FUSE filesystem that serves a bucket prefix (or any [`Namespace`]) through
//! the tiered chunk cache.
//!
//! [`FsCore`] holds the filesystem logic and can be driven without the kernel; [`fuse`] is the
//! thin fuser adapter over it; [`mount`] sets up the session.

mod assemble;
pub mod core;
pub mod dataset;
pub mod fuse;
pub mod guard;
mod implicit;
mod keeper;
pub mod mount;
pub mod mountinfo;
pub mod namespace;
pub mod objects;
mod openers;
mod passthrough;
pub mod readahead;
pub mod resume;
pub mod snapshot;
pub mod staging;
mod streaming;
mod window;

pub use crate::core::{FsCore, FsError, FsOptions};
pub use crate::dataset::{DatasetMount, Mounted, mount_dataset, mount_namespace};
pub use crate::mount::{MountError, MountOptions, mount, unmount};
pub use crate::namespace::{Namespace, Node, NodeKind, NsError};
pub use crate::objects::ObjectNamespace;
