//! Generates the Snapshots service (server, and a client for tests and tools) from the wire
//! contract in `proto/`. Needs `protoc` (Debian: protobuf-compiler).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/snapshots.proto");
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_protos(&["proto/snapshots.proto"], &["proto"])?;
    Ok(())
}
