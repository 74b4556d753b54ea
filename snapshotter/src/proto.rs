//! The Snapshots service as generated from `proto/snapshots.proto` by `build.rs`, and (in
//! [`cri`]) the CRI image client from `proto/cri_images.proto`.

#![allow(missing_debug_implementations, clippy::all)]

tonic::include_proto!("containerd.services.snapshots.v1");

/// The CRI image service's PullImage, as kubelet calls it.
pub mod cri {
    #![allow(missing_debug_implementations, clippy::all)]
    tonic::include_proto!("runtime.v1");
}
