//! What code generation produces for one partition: never part of a plan (plans are data),
//! made where the plan runs and kept in the code cache (`cache.rs`).

use dfc_ir::{NodeId, TensorRef};
use serde::{Deserialize, Serialize};

/// A GPU partition's fused kernels: one PTX module for `arch`, which the CUDA driver compiles
/// for the GPU it finds (PTX for an older architecture runs on newer ones).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GpuCode {
    /// `sm_80` …: the oldest architecture the PTX needs.
    pub arch: String,
    pub ptx: String,
    pub kernels: Vec<GpuKernel>,
}

/// A fused kernel on a GPU: the entry `function(args, rows)` computes `root` (from `members`,
/// reading `inputs`), in `grid` blocks of `block` threads: one row of its outermost loop per
/// thread where the rows are `split` (each writes its own part of the output), else every row
/// in one thread (a reduction over the outermost loop, which every row adds to).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GpuKernel {
    pub function: String,
    pub root: NodeId,
    pub members: Vec<NodeId>,
    pub inputs: Vec<TensorRef>,
    pub rows: u64,
    pub split: bool,
    pub block: u32,
    pub grid: u32,
}

/// The kernels of one or more CPU partitions (compiled together: `dfc_codegen::compile_group`)
/// as machine code for `target`: relocatable ELF objects (large code model, static
/// relocations) that a JIT linker places anywhere in memory, one per share of the kernels that
/// was compiled on its own thread.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NativeCode {
    pub target: NativeTarget,
    pub objects: Vec<Vec<u8>>,
    /// Per partition, one per kernel of `dfc_passes::fuse`: its function in one of the objects.
    pub partitions: Vec<Vec<NativeKernel>>,
}

/// The CPU code is generated for: LLVM's triple, CPU name and feature string (`+avx512f,...`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NativeTarget {
    pub triple: String,
    pub cpu: String,
    pub features: String,
}

/// A fused kernel: `function(args, begin, end)` computes `root` (from `members`, reading
/// `inputs`) over rows `begin..end` of its outermost loop, which has `rows` iterations.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NativeKernel {
    pub function: String,
    pub root: NodeId,
    pub members: Vec<NodeId>,
    pub inputs: Vec<TensorRef>,
    pub rows: u64,
    /// Whether ranges of rows may run on different threads.
    pub parallel: bool,
}
