//! The native CPU backend: runs a partition with its fused kernels generated from its IR
//! (`dfc_codegen`, through the disk cache) and JIT-compiled, matrix products through `dfc_gemm`, convolution and
//! pooling through `dfc_kernels`, and the few remaining ops through the reference
//! interpreter's kernels.
//!
//! - [`jit::load_partition`] generates and JIT-compiles a partition's kernels, shared by the
//!   sessions that load the same partition and freed with the last of them.
//! - [`Schedule::new`] selects the steps some fetches and targets need (whole kernels:
//!   see `dfc_passes::fuse`), aliases what needs no copy (reads of variables, reshapes,
//!   assignments, which update the variable in place) and plans one arena for every other
//!   value by liveness, so that a run allocates nothing but its fetched results;
//!   [`NativeProgram::new`] gives it the JIT-compiled kernels (the grid emulator's GPU
//!   programs, in `dfc_cuda`, give it theirs).
//! - [`NativeProgram::run`] runs it on feeds and variables, with subnormal floats flushed to zero
//!   (`denormals`), as TensorFlow does.
//!
//! Unlike the interpreter's, a run is not atomic: assignments write the variables in place
//! as they run, so a run that fails part-way (an index out of range, a partition that
//! aborts) leaves the variables it already updated.

mod denormals;
pub mod jit;
mod kept;
mod memory;
pub mod overlap;
mod program;
pub mod schedule;

pub use jit::{link_code, live_count, load_partition, load_partitions, Jitted, KernelFn, PhaseFn};
pub use program::{read_tensor, run_host_step, Bindings, HostArena, NativeProgram};
pub use schedule::{ConvKind, KernelSite, Schedule, Slot, Step};

#[derive(Debug, thiserror::Error)]
pub enum CpuError {
    #[error("JIT: {0}")]
    Jit(String),
    /// A fetch of a value that a kernel computes inside itself; compile with it kept.
    #[error("`{0}` is computed inside a fused kernel; it is not stored")]
    NotStored(String),
    #[error(transparent)]
    Interp(#[from] dfc_interp::InterpError),
}
