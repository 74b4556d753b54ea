//! The CSI node plugin: kubelet asks it, over a unix socket, to publish a volume at a pod's
//! target path, and it mounts the volume's bucket prefix (or local directory) there as a
//! dataset mount on the node's one daemon cache. So two pods that read one dataset share one
//! copy of it, and a volume of the node's own store goes through the peer tier too.

pub mod proto {
    //! The CSI v1 Identity and Node services, generated from `proto/csi.proto`.
    #![allow(clippy::all, missing_debug_implementations)]
    tonic::include_proto!("csi.v1");
}

pub mod service;
pub mod socket;
pub mod table;
pub mod volume;

pub use service::{CsiNode, DRIVER_NAME};
pub use socket::{SocketError, bind, connect_identity, connect_node, serve};
/// The gRPC status types a client of the plugin sees.
pub use tonic::{Code, Status};
