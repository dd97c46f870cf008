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
    /// Per op of the partition that has a kernel of its own rather than a fused one, that
    /// kernel; `root` is that op's node. Per convolution, convolution gradient and pooling op
    /// (f32), its window kernel (`windows.rs`); per transpose, concat, slice, pad and gather,
    /// its layout kernel (`layout.rs`: `inputs` the op's operands, then its output, then for a
    /// gather its status, `GpuKernel::checks`). An im2col kernel (a convolution's or
    /// a filter gradient's): `inputs` its input, and argument 1 the columns, `rows` of `(ky,
    /// kx, c)` patches, which one GEMM turns into the output (with the filter) or the filter's
    /// gradient (transposed, with the output's gradient). A col2im kernel (an input
    /// gradient's): argument 0 is the columns that one GEMM of `inputs` (the output's
    /// gradient) with the filter, transposed, makes, and argument 1 the input's gradient. A
    /// pooling kernel: `inputs` the op's operands, then its output.
    pub ops: Vec<GpuKernel>,
}

/// A fused kernel on a GPU: its launches ([`GpuKernel::launches`]) compute `root` (from
/// `members`, reading `inputs`) over the `rows` of its outermost loop. Without a `reduction`
/// each row writes its own part of the output, and the entry `function(args, rows)` runs one
/// row per thread, in `grid` blocks of `block` threads. A reduction over the outermost loop
/// (every row adds to the one output) runs as a [`GridReduction`]: `function` is its first
/// pass, of `grid` × `block` threads for its lanes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GpuKernel {
    pub function: String,
    pub root: NodeId,
    pub members: Vec<NodeId>,
    pub inputs: Vec<TensorRef>,
    /// Bytes of each argument: its inputs' values, then its output's.
    pub arg_bytes: Vec<u64>,
    pub rows: u64,
    pub block: u32,
    pub grid: u32,
    pub reduction: Option<GridReduction>,
    /// Whether the kernel checks values it reads (a gather's indices). Then it takes one more
    /// argument after its output, its status: [`STATUS_BYTES`], zero before the launch, where
    /// a thread that meets an index out of range sets word 0 to 1 and raises word 1 (an
    /// unsigned maximum) to that index.
    pub checks: bool,
    /// Phases of its first launch (0: a per-thread function; see [`GpuLaunch`]) and the shared
    /// memory they use: a row op whose rows run one per block (`kernel::emit_block_row`).
    pub phases: u32,
    pub shared_bytes: u64,
    /// An op kernel of several launches, in place of the one of `function`.
    pub passes: Option<OpPasses>,
}

/// The launches of an op kernel that computes in passes (batch norm's sums over a grid, then
/// what uses them), in order, each a per-thread function, and the bytes of the two scratch
/// buffers between them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OpPasses {
    pub launches: Vec<GpuLaunch>,
    pub scratch: [u64; 2],
}

/// Bytes of a checking kernel's status (`GpuKernel::checks`): two u64 words.
pub const STATUS_BYTES: u64 = 16;

/// A reduction over the outermost loop, run by a grid in passes. In the first (the kernel's
/// `function`), lane `t` of `lanes` folds rows `t·chunk..(t+1)·chunk` into its own partial
/// output of `out_len` elements in scratch memory. Each further pass, `combine(args, count)`
/// with `args` = [partials, output], folds each group of `fan_in` partials (of the `count`
/// left) into one, a block of `fan_in` threads per element of a group folding a tree in the
/// block's shared memory in `phases` phases with barriers between them
/// (`kernel::emit_tree_combine`), until one partial is left: the output, finished by the last
/// pass (a mean divided by its count). The fold's order is fixed, so the result does not
/// depend on which thread runs when.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GridReduction {
    pub lanes: u64,
    pub chunk: u64,
    pub out_len: u64,
    pub element_bytes: u64,
    pub combine: String,
    /// Partials a combining block folds: its threads, a power of two.
    pub fan_in: u64,
    pub phases: u32,
}

/// A buffer of a launch: argument `i` of the kernel (its inputs, then its output), or one of a
/// reduction's two scratch buffers ([`GpuKernel::scratch_bytes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LaunchBuffer {
    Arg(usize),
    Scratch(usize),
}

/// One launch of an entry: `function(args, count)` with the pointers of `args` in device
/// memory, in `grid` blocks of `block` threads. With `phases` (more than 0) the entry runs
/// its phase function ([`PHASE_SUFFIX`]) `phases` times with a barrier between, over
/// `shared_bytes` of the block's shared memory; without, its per-thread function
/// ([`THREAD_SUFFIX`]) once.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuLaunch {
    pub function: String,
    pub args: Vec<LaunchBuffer>,
    pub count: u64,
    pub block: u32,
    pub grid: u32,
    pub phases: u32,
    pub shared_bytes: u64,
}

impl GpuLaunch {
    /// The launch's arguments from the kernel's (`args`: its inputs, then its output) and the
    /// two scratch buffers, whatever stands for a buffer (an address, a pointer).
    pub fn buffers<T: Copy>(&self, args: &[T], scratch: [T; 2]) -> Vec<T> {
        self.args
            .iter()
            .map(|buffer| match *buffer {
                LaunchBuffer::Arg(i) => args[i],
                LaunchBuffer::Scratch(s) => scratch[s],
            })
            .collect()
    }
}

/// The suffix of a GPU entry's per-thread function, `fn(args, count, thread)` with the
/// thread's index in the grid: on a GPU the entry calls it with `blockIdx.x · blockDim.x +
/// threadIdx.x`; the grid emulator calls it for every thread of a launch
/// (`dfc_codegen::compile_gpu_emulated`).
pub const THREAD_SUFFIX: &str = "_thread";

/// The suffix of a phased entry's phase function, `fn(args, count, thread, shared, phase)`:
/// on a GPU the entry calls it for each phase in turn, with a barrier between, and `shared`
/// the block's shared memory; the grid emulator calls it for every thread of a block, phase
/// by phase, with a buffer per block. A `.` sets it apart: no other function's name has one
/// (node names are sanitised to letters, digits and `_`), so a name says its signature.
pub const PHASE_SUFFIX: &str = ".phase";

impl GpuKernel {
    /// The kernel of a single op (`GpuCode::ops`): `function` over `count` threads, one
    /// launch of whole warps, no reduction and no phases.
    pub fn for_op(
        function: String,
        root: NodeId,
        inputs: Vec<TensorRef>,
        arg_bytes: Vec<u64>,
        count: u64,
        checks: bool,
    ) -> GpuKernel {
        let (block, grid) = crate::launch(count);
        GpuKernel {
            function,
            root,
            members: Vec::new(),
            inputs,
            arg_bytes,
            rows: count,
            block,
            grid,
            reduction: None,
            checks,
            phases: 0,
            shared_bytes: 0,
            passes: None,
        }
    }

    /// The launches that compute the kernel, in order (each sees the previous ones' writes).
    pub fn launches(&self) -> Vec<GpuLaunch> {
        if let Some(passes) = &self.passes {
            return passes.launches.clone();
        }
        let output = LaunchBuffer::Arg(self.inputs.len());
        let mut args: Vec<LaunchBuffer> = (0..self.inputs.len()).map(LaunchBuffer::Arg).collect();
        let Some(reduction) = &self.reduction else {
            args.push(output);
            if self.checks {
                args.push(LaunchBuffer::Arg(self.inputs.len() + 1));
            }
            return vec![GpuLaunch {
                function: self.function.clone(),
                args,
                count: self.rows,
                block: self.block,
                grid: self.grid,
                phases: self.phases,
                shared_bytes: self.shared_bytes,
            }];
        };
        args.push(LaunchBuffer::Scratch(0));
        let mut launches = vec![GpuLaunch {
            function: self.function.clone(),
            args,
            count: self.rows,
            block: self.block,
            grid: self.grid,
            phases: 0,
            shared_bytes: 0,
        }];
        let (mut count, mut from) = (reduction.lanes, 0);
        loop {
            let groups = count.div_ceil(reduction.fan_in);
            let to = if groups == 1 { output } else { LaunchBuffer::Scratch(1 - from) };
            launches.push(GpuLaunch {
                function: reduction.combine.clone(),
                args: vec![LaunchBuffer::Scratch(from), to],
                count,
                block: reduction.fan_in as u32,
                grid: u32::try_from(groups * reduction.out_len).unwrap_or(u32::MAX),
                phases: reduction.phases,
                shared_bytes: reduction.fan_in * reduction.element_bytes,
            });
            if groups == 1 {
                return launches;
            }
            (count, from) = (groups, 1 - from);
        }
    }

    /// Bytes of the two scratch buffers its launches use: a reduction's partials, and the
    /// fewer of its second pass (none without a reduction).
    pub fn scratch_bytes(&self) -> [u64; 2] {
        if let Some(passes) = &self.passes {
            return passes.scratch;
        }
        match &self.reduction {
            None => [0, 0],
            Some(r) => {
                let partial = r.out_len * r.element_bytes;
                [r.lanes * partial, r.lanes.div_ceil(r.fan_in) * partial]
            }
        }
    }
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
