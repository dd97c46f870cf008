//! Compiles proto/worker.proto with protox (a protobuf compiler in Rust: no system protoc).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/worker.proto");
    let descriptors = protox::compile(["worker.proto"], ["proto"])?;
    // Tensor bytes as `Bytes`: chunks of one buffer are views of it, not copies.
    tonic_prost_build::configure().bytes(".").compile_fds(descriptors)?;
    Ok(())
}
