//! Generates the CSI Identity and Node services (server, and a client for tests and tools that
//! act as kubelet does) from the wire contract in `proto/`. Needs `protoc` (Debian:
//! protobuf-compiler).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/csi.proto");
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_protos(&["proto/csi.proto"], &["proto"])?;
    Ok(())
}
