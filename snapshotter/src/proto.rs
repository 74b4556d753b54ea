//! The Snapshots service as generated from `proto/snapshots.proto` by `build.rs`.

#![allow(missing_debug_implementations, clippy::all)]

tonic::include_proto!("containerd.services.snapshots.v1");
