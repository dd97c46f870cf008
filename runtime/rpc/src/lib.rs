//! The distributed runtime: `dfc worker` (a gRPC server that runs some partitions of a plan),
//! the driver of remote workers (`RemoteSession`, a [`dfc_driver::Runner`]), the rendezvous
//! through which workers exchange tensors, and the ring all-reduce.
//!
//! - [`proto`]: the protocol (`proto/worker.proto`), compiled by protox at build time.
//! - [`auth`]: the shared token every call carries, checked in constant time.
//! - [`tensor`]: tensors to and from their wire form.
//! - [`tls`]: TLS with client certificates, required beyond loopback; [`certs`] (`dfc certs`)
//!   makes a CA and a certificate per host for it.
//! - [`limits`]: what a worker's ports hold for callers that have not proven the token.
//! - [`rendezvous`]: `NetRendezvous`, one per step on each worker: Send/Recv across workers
//!   (tensors pushed to the receiver's worker in chunks) and all-reduce (local replicas summed,
//!   then a ring of reduce-scatter and all-gather across the workers).
//! - [`data`]: the data plane, TCP (TLS beyond loopback) between workers for the ring's
//!   segments and tensors.
//! - [`shm`]: shared-memory queues that carry the data plane between workers on one machine.
//! - [`worker`]: the server.
//! - [`bench`]: `dfc bench-allreduce`, the ring's bandwidth next to loopback TCP's.
//! - [`driver`]: `RemoteSession`, `assign` (which worker runs which partition) and
//!   `LocalWorkers` (`dfc run --spawn N`).

pub mod auth;
pub mod bench;
pub mod certs;
pub mod data;
pub mod driver;
pub mod limits;
pub mod mpi;
pub mod rendezvous;
pub mod shm;
pub mod tensor;
pub mod tls;
pub mod worker;

pub mod proto {
    tonic::include_proto!("dfc.worker.v1");
}

pub use driver::{assign, Assignment, LocalWorkers, RemoteSession};
pub use tls::Tls;
pub use worker::{serve, DataPlane};

/// The largest message either side accepts (a plan, or a chunk). A worker
/// decodes a message only after its call has passed the token's check.
pub const MAX_MESSAGE_BYTES: usize = 1 << 30;
/// The calls a worker serves at once on one connection, and the HTTP/2 streams it lets a
/// connection open: well above what a driver and its peers use (a few per worker and
/// free-running replica), since a call over the limit waits, and a `Health` call that waits
/// behind them would read as a hung worker.
pub const MAX_CALLS_PER_CONNECTION: usize = 256;
/// The largest block of headers a worker takes with a call (the token is one of them).
pub const MAX_HEADER_BYTES: u32 = 16 << 10;
/// HTTP/2 keepalive: a worker pings a connection that has been quiet this long, and closes it
/// when the ping is not answered in time, so that the connections of peers that are gone are
/// not kept for ever.
pub const KEEPALIVE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(30);
pub const KEEPALIVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(20);
/// HTTP/2 flow-control windows: the protocol's default of 64 KiB per stream would stall a
/// large tensor every 64 KiB for a window update (a round trip).
pub const STREAM_WINDOW: u32 = 16 << 20;
pub const CONNECTION_WINDOW: u32 = 64 << 20;
/// The largest HTTP/2 frame a worker accepts: bulk tensors in 1 MiB frames rather than the
/// protocol's default 16 KiB.
pub const MAX_FRAME: u32 = 1 << 20;

/// Tensors travel in chunks of at most this many bytes.
pub const CHUNK_BYTES: usize = 1 << 20;

/// The SHA-256 of a plan file's bytes: what every call names the plan by.
pub fn plan_sha256(bytes: &[u8]) -> prost::bytes::Bytes {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).to_vec().into()
}

/// Keeps the memory of freed large buffers in this process for the next ones (glibc's malloc
/// otherwise maps every buffer over 32 MiB afresh and unmaps it when freed): a worker moves
/// tensors of hundreds of MiB every step, and faulting their pages in anew each time cost more
/// than sending them (on this project's VMs, two thirds of a 64 MiB all-reduce). For processes
/// that only serve as workers.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        extern "C" {
            fn mallopt(param: i32, value: i32) -> i32;
        }
        const M_TRIM_THRESHOLD: i32 = -1;
        const M_MMAP_MAX: i32 = -4;
        // SAFETY: mallopt only changes the allocator's tuning; called before the server starts.
        unsafe {
            mallopt(M_MMAP_MAX, 0);
            mallopt(M_TRIM_THRESHOLD, i32::MAX);
        }
    }
}
