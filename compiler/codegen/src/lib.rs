//! Lowers the fused kernels of a CPU partition (`dfc_passes::fuse`) to LLVM IR through
//! inkwell, optimises them at O3 (without LLVM's loop unroller) for a target CPU, one share of
//! the kernels per core, and returns them as object files in a [`NativeCode`] that `dfc_cpu`
//! links into the process (LLVM's ORC JIT). A GPU partition's kernels become PTX the same way
//! (`gpu.rs`). Code is generated where a plan runs, from its verified IR, never carried in
//! the plan; [`CodeCache`] keeps it on disk between runs (`cache.rs`).
//!
//! Every kernel becomes `void kN(i8** args, i64 begin, i64 end)`: `args` holds the kernel's
//! inputs in the order of `Kernel::inputs`, then its output; `begin..end` is a range of the
//! outermost loop, so that the runtime may split a large kernel across threads. The loop nest
//! runs over the root's iteration space (the output's shape, or for a reduction and a row op
//! the operand's), dimensions merged where every access allows it, innermost with unit or zero
//! strides so that LLVM's vectoriser takes it. Members are computed at the root's index,
//! each operand read through NumPy broadcasting (a size-1 or missing axis has stride 0).
//!
//! Results agree with the reference interpreter: sums run in the same row-major order (no
//! reassociation, so a reduction gives the interpreter's bits), casts are Rust's `as`
//! (saturating `fptosi.sat`), `maximum`/`minimum`/`relu` propagate NaN. Transcendentals call
//! the C library, so they may differ from Rust's in the last bit.

mod cache;
mod code;
mod distinct;
mod gpu;
mod kernel;
mod layout;
mod norms;
mod target;
mod thread;
mod windows;

pub use cache::{CacheKey, CodeCache, Origin, CACHE_DIR_VARIABLE, MAX_CACHE_BYTES};
pub use code::{
    GpuCode, GpuKernel, GpuLaunch, GridReduction, LaunchBuffer, NativeCode, NativeKernel, NativeTarget, PHASE_SUFFIX,
    STATUS_BYTES, THREAD_SUFFIX,
};
pub use gpu::{compile_gpu, compile_gpu_emulated, launch, FAN_IN, GPU_ARCH};

pub use target::{host_target, target_machine};

use dfc_ir::{Module, NodeId};
use dfc_passes::Kernel;
use inkwell::context::Context;
use inkwell::passes::PassBuilderOptions;
use std::collections::HashMap;

#[derive(Debug, thiserror::Error)]
pub enum CodegenError {
    #[error("LLVM: {0}")]
    Llvm(String),
    #[error("no LLVM target for `{triple}`: {message}")]
    Target { triple: String, message: String },
}

/// The fused kernels of `module` (a partition placed on a CPU) compiled for `target`. Nodes
/// in `keep` stay kernel roots, so that their values can be fetched.
pub fn compile(module: &Module, keep: &[NodeId], target: &NativeTarget) -> Result<NativeCode, CodegenError> {
    compile_group(&[(module, keep)], target)
}

/// The fused kernels of several CPU partitions (those one process runs) compiled together for
/// `target`: `NativeCode::partitions[i]` describes `parts[i]`'s kernels.
///
/// Kernels with the same canonical form, in one partition or across them, share one function
/// (`distinct.rs`): the layers of a model spread over many devices have a handful of distinct
/// kernels, each compiled once. The distinct kernels are shared out among the machine's
/// cores, each share one LLVM module optimised and compiled on its own thread (LLVM's contexts
/// are independent), so the code is ready in about the time of the largest share.
pub fn compile_group(parts: &[(&Module, &[NodeId])], target: &NativeTarget) -> Result<NativeCode, CodegenError> {
    let fused: Vec<Vec<Kernel>> = parts.iter().map(|(module, keep)| dfc_passes::fuse(module, keep).kernels).collect();
    let modules: Vec<&Module> = parts.iter().map(|(module, _)| *module).collect();
    let representative = distinct::representatives(&modules, &fused);
    let distinct: Vec<Site> = representative
        .iter()
        .enumerate()
        .flat_map(|(p, kernels)| kernels.iter().enumerate().map(move |(k, &r)| (r == (p, k)).then_some((p, k))))
        .flatten()
        .collect();
    let shares = shares(&modules, &fused, &distinct, target);
    let compiled = std::thread::scope(|scope| {
        let threads: Vec<_> =
            shares.iter().map(|share| scope.spawn(|| compile_share(&modules, &fused, share, target))).collect();
        threads
            .into_iter()
            .map(|thread| thread.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)))
            .collect::<Result<Vec<_>, _>>()
    })?;
    let mut functions: HashMap<Site, NativeKernel> = HashMap::new();
    let mut objects = Vec::with_capacity(compiled.len());
    for (share, (object, made)) in shares.iter().zip(compiled) {
        objects.push(object);
        functions.extend(share.iter().copied().zip(made));
    }
    let partitions = fused
        .iter()
        .zip(&representative)
        .map(|(kernels, representative)| {
            kernels
                .iter()
                .zip(representative)
                .map(|(kernel, r)| {
                    let function = &functions[r];
                    NativeKernel {
                        function: function.function.clone(),
                        root: kernel.root,
                        members: kernel.members.clone(),
                        inputs: kernel.inputs.clone(),
                        rows: function.rows,
                        parallel: function.parallel,
                    }
                })
                .collect()
        })
        .collect();
    Ok(NativeCode { target: target.clone(), objects, partitions })
}

/// A kernel of a group: (partition, kernel) indices.
type Site = (usize, usize);

/// Fewer kernels than this per share and a thread's set-up (a context, a target machine, a
/// pass pipeline) outweighs what it saves.
const KERNELS_PER_SHARE_MIN: usize = 4;

/// The kernels of `which`, in shares of about equal work (the largest kernel first to the
/// least loaded share), one share per available core.
fn shares(modules: &[&Module], kernels: &[Vec<Kernel>], which: &[Site], target: &NativeTarget) -> Vec<Vec<Site>> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let count = cores.min(which.len().div_ceil(KERNELS_PER_SHARE_MIN)).max(1);
    if count == 1 {
        return vec![which.to_vec()];
    }
    let mut order: Vec<(usize, Site)> =
        which.iter().map(|&(p, k)| (work(modules[p], &kernels[p][k], target), (p, k))).collect();
    order.sort_by_key(|&(work, _)| std::cmp::Reverse(work));
    let mut shares = vec![(0usize, Vec::new()); count];
    for (work, site) in order {
        let lightest = shares.iter_mut().min_by_key(|(load, _)| *load).expect("at least one share");
        lightest.0 += work;
        lightest.1.push(site);
    }
    shares
        .into_iter()
        .map(|(_, mut share)| {
            share.sort_unstable();
            share
        })
        .collect()
}

/// What optimising and compiling a kernel will cost, estimated by the instructions it has
/// before optimisation (a row op's unrolled folds outweigh an element-wise kernel's loop many
/// times over; member counts do not see that). Emitting is about 1% of compiling.
fn work(module: &Module, kernel: &Kernel, target: &NativeTarget) -> usize {
    let context = Context::create();
    let llvm = context.create_module("estimate");
    kernel::emit(&context, &llvm, module, kernel, "k", kernel::Flavor::Cpu(target));
    let function = llvm.get_function("k").expect("the kernel just emitted");
    function.get_basic_blocks().iter().map(|block| block.get_instructions().count()).sum()
}

/// One share of the kernels as one object file, with their descriptions in `share`'s order.
fn compile_share(
    modules: &[&Module],
    kernels: &[Vec<Kernel>],
    share: &[Site],
    target: &NativeTarget,
) -> Result<(Vec<u8>, Vec<NativeKernel>), CodegenError> {
    let context = Context::create();
    let llvm = context.create_module("dfc");
    let machine = target_machine(target)?;
    llvm.set_triple(&machine.get_triple());
    llvm.set_data_layout(&machine.get_target_data().get_data_layout());
    let mut made = Vec::with_capacity(share.len());
    for &(p, i) in share {
        let (module, kernel) = (modules[p], &kernels[p][i]);
        let function = format!("k{p}_{i}_{}", sanitize(&module.graph.node(kernel.root).name));
        let shape = kernel::emit(&context, &llvm, module, kernel, &function, kernel::Flavor::Cpu(target));
        made.push(NativeKernel {
            function,
            root: kernel.root,
            members: kernel.members.clone(),
            inputs: kernel.inputs.clone(),
            rows: shape.rows,
            parallel: shape.parallel,
        });
    }
    llvm.verify().map_err(|e| CodegenError::Llvm(e.to_string()))?;
    llvm.run_passes(llvm_pipeline(), &machine, optimisation()).map_err(|e| CodegenError::Llvm(e.to_string()))?;
    let object = machine
        .write_to_memory_buffer(&llvm, inkwell::targets::FileType::Object)
        .map_err(|e| CodegenError::Llvm(e.to_string()))?;
    Ok((object.as_slice().to_vec(), made))
}

/// Names another LLVM pass pipeline for the kernels, in `opt -passes=` syntax, for measuring
/// pipelines against each other (`benches/pipelines.sh`); it is part of the code cache's key.
pub const PIPELINE_VARIABLE: &str = "DFC_LLVM_PASSES";

/// The pipeline kernels are optimised with: `default<O3>`, or what `DFC_LLVM_PASSES` says.
/// `benches/pipelines.sh` (docs/benchmarks.md) found the examples' steps alike under O3, O2 and
/// a short hand-picked list, which loads 10–15% faster; O3 stays, as the pipeline that also
/// serves kernels the examples lack.
pub fn llvm_pipeline() -> &'static str {
    static PIPELINE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    PIPELINE.get_or_init(|| {
        std::env::var(PIPELINE_VARIABLE).ok().filter(|p| !p.trim().is_empty()).unwrap_or_else(|| "default<O3>".into())
    })
}

/// O3 without LLVM's loop unroller: its partial and runtime unrolling of the vectorised loops
/// (eight copies of a loop already interleaved four times) made the code ten times larger and
/// loading a plan four times slower (mlp: 540 against 120 ms, on one core) for no faster step;
/// the small loops whose full unrolling pays, codegen writes out itself
/// (`kernel::UNROLLED_MAX`).
fn optimisation() -> PassBuilderOptions {
    let options = PassBuilderOptions::create();
    options.set_loop_unrolling(false);
    options
}

/// A symbol-safe rendering of a node name.
fn sanitize(name: &str) -> String {
    name.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).take(48).collect()
}
