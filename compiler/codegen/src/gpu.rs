//! The fused kernels of a GPU partition as PTX, through LLVM's NVPTX back end.
//!
//! Each kernel's loop nest is emitted exactly as for a CPU (`kernel::emit`, with the GPU's
//! transcendentals), as an internal function over a range of rows of its outermost loop; the
//! entry, `.entry kN(i8** args, i64 rows)`, runs one row per thread and is inlined into at O3.
//! So an elementwise kernel whose dimensions merge into one loop runs one element per thread,
//! and a row op, or a reduction over inner axes, one output row per thread. A reduction over
//! the outermost loop (every row adds to one output) runs in one thread: right, not yet fast.

use crate::code::{GpuCode, GpuKernel};
use crate::kernel::{self, Flavor};
use crate::{sanitize, CodegenError};
use dfc_ir::{Module, NodeId};
use inkwell::attributes::{Attribute, AttributeLoc};
use inkwell::context::Context;
use inkwell::module::Linkage;
use inkwell::passes::PassBuilderOptions;
use inkwell::targets::{CodeModel, FileType, InitializationConfig, RelocMode, Target, TargetMachine, TargetTriple};
use inkwell::{IntPredicate, OptimizationLevel};

/// The architecture the PTX is generated for: Ampere (A100). LLVM 14 knows none newer than
/// sm_86; the driver compiles sm_80 PTX for Hopper and later.
pub const GPU_ARCH: &str = "sm_80";
const GPU_TRIPLE: &str = "nvptx64-nvidia-cuda";
/// PTX ISA 7.0, the first with sm_80.
const PTX_FEATURES: &str = "+ptx70";
/// LLVM's calling convention for a PTX kernel entry (`ptx_kernel`).
const PTX_KERNEL_CALLING_CONVENTION: u32 = 71;
/// Threads per block for kernels of many rows: a multiple of the warp, and enough blocks per
/// multiprocessor to hide memory latency.
const MAX_BLOCK: u64 = 256;

/// The fused kernels of `module` (a partition placed on a GPU) as PTX. Nodes in `keep` stay
/// kernel roots, so that their values can be fetched.
pub fn compile_gpu(module: &Module, keep: &[NodeId]) -> Result<GpuCode, CodegenError> {
    let fusion = dfc_passes::fuse(module, keep);
    let context = Context::create();
    let llvm = context.create_module("dfc_gpu");
    let machine = nvptx_machine()?;
    llvm.set_triple(&machine.get_triple());
    llvm.set_data_layout(&machine.get_target_data().get_data_layout());
    let i64t = context.i64_type();
    let i32t = context.i32_type();
    let mut kernels = Vec::with_capacity(fusion.kernels.len());
    for (i, kernel) in fusion.kernels.iter().enumerate() {
        let function = format!("k{i}_{}", sanitize(&module.graph.node(kernel.root).name));
        let rows_function = format!("{function}_rows");
        let shape = kernel::emit(&context, &llvm, module, kernel, &rows_function, Flavor::Nvptx);
        let body = llvm.get_function(&rows_function).expect("emitted");
        body.set_linkage(Linkage::Internal);
        body.add_attribute(
            AttributeLoc::Function,
            context.create_enum_attribute(Attribute::get_named_enum_kind_id("alwaysinline"), 0),
        );

        // The entry: row = blockIdx.x · blockDim.x + threadIdx.x. Split rows: each thread runs
        // its row, rows past the end do nothing. Otherwise (a reduction over the outermost
        // loop: every row adds to the one output) thread 0 runs them all, the others nothing.
        let args_type = body.get_type().get_param_types()[0];
        let entry = llvm.add_function(&function, context.void_type().fn_type(&[args_type, i64t.into()], false), None);
        entry.set_call_conventions(PTX_KERNEL_CALLING_CONVENTION);
        let builder = context.create_builder();
        let start = context.append_basic_block(entry, "entry");
        let run = context.append_basic_block(entry, "run");
        let done = context.append_basic_block(entry, "done");
        builder.position_at_end(start);
        let special = |name: &str| {
            let register =
                llvm.get_function(name).unwrap_or_else(|| llvm.add_function(name, i32t.fn_type(&[], false), None));
            builder.build_call(register, &[], "r").unwrap().try_as_basic_value().unwrap_basic().into_int_value()
        };
        let block = special("llvm.nvvm.read.ptx.sreg.ctaid.x");
        let threads = special("llvm.nvvm.read.ptx.sreg.ntid.x");
        let thread = special("llvm.nvvm.read.ptx.sreg.tid.x");
        let first = builder
            .build_int_mul(
                builder.build_int_z_extend(block, i64t, "b").unwrap(),
                builder.build_int_z_extend(threads, i64t, "n").unwrap(),
                "f",
            )
            .unwrap();
        let row = builder.build_int_add(first, builder.build_int_z_extend(thread, i64t, "t").unwrap(), "row").unwrap();
        let args = entry.get_nth_param(0).unwrap();
        let rows = entry.get_nth_param(1).unwrap().into_int_value();
        let (inside, begin, end) = if shape.split {
            let inside = builder.build_int_compare(IntPredicate::ULT, row, rows, "in").unwrap();
            (inside, row, builder.build_int_add(row, i64t.const_int(1, false), "next").unwrap())
        } else {
            let first = builder.build_int_compare(IntPredicate::EQ, row, i64t.const_zero(), "first").unwrap();
            (first, i64t.const_zero(), rows)
        };
        builder.build_conditional_branch(inside, run, done).unwrap();
        builder.position_at_end(run);
        builder.build_call(body, &[args.into(), begin.into(), end.into()], "").unwrap();
        builder.build_unconditional_branch(done).unwrap();
        builder.position_at_end(done);
        builder.build_return(None).unwrap();

        let (block, grid) = if shape.split { launch(shape.rows) } else { (1, 1) };
        kernels.push(GpuKernel {
            function,
            root: kernel.root,
            members: kernel.members.clone(),
            inputs: kernel.inputs.clone(),
            rows: shape.rows,
            split: shape.split,
            block,
            grid,
        });
    }
    llvm.verify().map_err(|e| CodegenError::Llvm(e.to_string()))?;
    llvm.run_passes("default<O3>", &machine, PassBuilderOptions::create())
        .map_err(|e| CodegenError::Llvm(e.to_string()))?;
    let ptx =
        machine.write_to_memory_buffer(&llvm, FileType::Assembly).map_err(|e| CodegenError::Llvm(e.to_string()))?;
    let ptx = String::from_utf8_lossy(ptx.as_slice()).trim_end_matches('\0').to_string();
    Ok(GpuCode { arch: GPU_ARCH.to_string(), ptx, kernels })
}

/// Threads per block and blocks for `rows` rows, one per thread: whole warps, at most
/// `MAX_BLOCK` threads, and as many blocks as it takes.
pub fn launch(rows: u64) -> (u32, u32) {
    let block = rows.div_ceil(32).clamp(1, MAX_BLOCK / 32) * 32;
    let grid = rows.div_ceil(block).max(1);
    (block as u32, u32::try_from(grid).unwrap_or(u32::MAX))
}

fn nvptx_machine() -> Result<TargetMachine, CodegenError> {
    let error = |message: String| CodegenError::Target { triple: GPU_TRIPLE.to_string(), message };
    Target::initialize_nvptx(&InitializationConfig::default());
    let triple = TargetTriple::create(GPU_TRIPLE);
    let target = Target::from_triple(&triple).map_err(|e| error(e.to_string()))?;
    target
        .create_target_machine(
            &triple,
            GPU_ARCH,
            PTX_FEATURES,
            OptimizationLevel::Aggressive,
            RelocMode::Default,
            CodeModel::Default,
        )
        .ok_or_else(|| error("LLVM made no NVPTX target machine".to_string()))
}

#[cfg(test)]
mod tests {
    use super::launch;

    #[test]
    fn launches_cover_every_row_in_whole_warps() {
        assert_eq!(launch(1), (32, 1));
        assert_eq!(launch(100), (128, 1));
        assert_eq!(launch(256), (256, 1));
        assert_eq!(launch(257), (256, 2));
        assert_eq!(launch(100_352), (256, 392));
    }
}
