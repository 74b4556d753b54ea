//! Generates the Snapshots service (server, and a client for tests and tools), and a client of
//! the CRI image service, from the wire contracts in `proto/`. Needs `protoc` (Debian:
//! protobuf-compiler).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/snapshots.proto");
    println!("cargo:rerun-if-changed=proto/cri_images.proto");
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_protos(&["proto/snapshots.proto"], &["proto"])?;
    // Only a client: kubelet's image pulls, for tests and tools that act as kubelet does.
    tonic_prost_build::configure()
        .build_server(false)
        .build_client(true)
        .compile_protos(&["proto/cri_images.proto"], &["proto"])?;
    Ok(())
}
