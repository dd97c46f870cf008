//! The distributed runtime: `dfc worker` (a gRPC server that runs some partitions of a plan),
//! the driver of remote workers (`RemoteSession`, a [`dfc_driver::Runner`]), the rendezvous
//! through which workers exchange tensors, and the ring all-reduce.
//!
//! - [`proto`]: the protocol (`proto/worker.proto`), compiled by protox at build time.
//! - [`auth`]: the shared token every call carries, checked in constant time.
//! - [`tensor`]: tensors to and from their wire form.
//! - [`rendezvous`]: `NetRendezvous`, one per step on each worker: Send/Recv across workers
//!   (tensors pushed to the receiver's worker in chunks) and all-reduce (local replicas summed,
//!   then a ring of reduce-scatter and all-gather across the workers).
//! - [`worker`]: the server.
//! - [`bench`]: `dfc bench-allreduce`, the ring's bandwidth next to loopback TCP's.
//! - [`driver`]: `RemoteSession`, `assign` (which worker runs which partition) and
//!   `LocalWorkers` (`dfc run --spawn N`).

pub mod auth;
pub mod bench;
pub mod driver;
pub mod rendezvous;
pub mod tensor;
pub mod worker;

pub mod proto {
    tonic::include_proto!("dfc.worker.v1");
}

pub use driver::{assign, Assignment, LocalWorkers, RemoteSession};
pub use worker::serve;

/// The largest message either side accepts (a plan with its bitcode, or a chunk).
pub const MAX_MESSAGE_BYTES: usize = 1 << 30;
/// HTTP/2 flow-control windows: the protocol's default of 64 KiB per stream would stall a
/// large tensor every 64 KiB for a window update (a round trip).
pub const STREAM_WINDOW: u32 = 16 << 20;
pub const CONNECTION_WINDOW: u32 = 64 << 20;

/// Tensors travel in chunks of at most this many bytes.
pub const CHUNK_BYTES: usize = 1 << 20;

/// The SHA-256 of a plan file's bytes: what every call names the plan by.
pub fn plan_sha256(bytes: &[u8]) -> prost::bytes::Bytes {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).to_vec().into()
}
