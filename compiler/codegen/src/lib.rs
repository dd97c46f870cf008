//! Lowers the fused kernels of a CPU partition (`dfc_passes::fuse`) to LLVM IR through
//! inkwell, optimises them at O3 for a target CPU, and returns them as an object file in a
//! [`NativeCode`] that `dfc_cpu` links into the process (LLVM's ORC JIT). A GPU partition's kernels become PTX the same
//! way (`gpu.rs`). Code is generated where a plan runs, from its verified IR, never carried in
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
mod gpu;
mod kernel;
mod target;

pub use cache::{CacheKey, CodeCache, Origin, CACHE_DIR_VARIABLE, MAX_CACHE_BYTES};
pub use code::{GpuCode, GpuKernel, NativeCode, NativeKernel, NativeTarget};
pub use gpu::{compile_gpu, launch, GPU_ARCH};

pub use target::{host_target, target_machine};

use dfc_ir::{Module, NodeId};
use inkwell::context::Context;
use inkwell::passes::PassBuilderOptions;

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
    let fusion = dfc_passes::fuse(module, keep);
    let context = Context::create();
    let llvm = context.create_module("dfc");
    let machine = target_machine(target)?;
    llvm.set_triple(&machine.get_triple());
    llvm.set_data_layout(&machine.get_target_data().get_data_layout());
    let mut kernels = Vec::with_capacity(fusion.kernels.len());
    for (i, kernel) in fusion.kernels.iter().enumerate() {
        let function = format!("k{i}_{}", sanitize(&module.graph.node(kernel.root).name));
        let shape = kernel::emit(&context, &llvm, module, kernel, &function, kernel::Flavor::Cpu(target));
        kernels.push(NativeKernel {
            function,
            root: kernel.root,
            members: kernel.members.clone(),
            inputs: kernel.inputs.clone(),
            rows: shape.rows,
            parallel: shape.parallel,
        });
    }
    llvm.verify().map_err(|e| CodegenError::Llvm(e.to_string()))?;
    llvm.run_passes("default<O3>", &machine, PassBuilderOptions::create())
        .map_err(|e| CodegenError::Llvm(e.to_string()))?;
    let object = machine
        .write_to_memory_buffer(&llvm, inkwell::targets::FileType::Object)
        .map_err(|e| CodegenError::Llvm(e.to_string()))?;
    Ok(NativeCode { target: target.clone(), object: object.as_slice().to_vec(), kernels })
}

/// A symbol-safe rendering of a node name.
fn sanitize(name: &str) -> String {
    name.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).take(48).collect()
}
