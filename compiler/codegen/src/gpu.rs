//! The fused kernels of a GPU partition as PTX, through LLVM's NVPTX back end, and the same
//! kernels compiled for the host for the grid emulator.
//!
//! Each kernel's loop nest is emitted exactly as for a CPU (`kernel::emit`, with the GPU's
//! transcendentals), as an internal function over a range of rows of its outermost loop. Over
//! it, a per-thread function `kN_thread(args, count, thread)` says what thread `thread` of the
//! launch does, and the entry, `.entry kN(i8** args, i64 count)`, calls it with
//! `blockIdx.x · blockDim.x + threadIdx.x`; at O3 both are inlined into the entry. An
//! elementwise kernel whose dimensions merge into one loop runs one element per thread, and a
//! row op, or a reduction over inner axes, one output row per thread. A reduction over the
//! outermost loop (every row adds to one output) runs in passes (`GridReduction`): lanes fold
//! chunks of rows into partials, and `kN_combine` folds the partials, `FAN_IN` at a time, as a
//! tree in a block's shared memory with barriers between its steps (its phase function,
//! `kN_combine.phase`, called once per phase by the entry).
//!
//! [`compile_gpu_emulated`] compiles the same per-thread functions for the host, with the CPU's
//! transcendentals, so that the grid emulator (`dfc_cuda::emulator`) runs what each GPU thread
//! runs.

use crate::code::{
    GpuCode, GpuKernel, GridReduction, NativeCode, NativeKernel, NativeTarget, PHASE_SUFFIX, THREAD_SUFFIX,
};
use crate::kernel::{self, Flavor, SHARED_ADDRESS_SPACE};
use crate::{sanitize, CodegenError};
use dfc_ir::{Module, NodeId};
use dfc_passes::Kernel;
use inkwell::attributes::{Attribute, AttributeLoc};
use inkwell::context::Context;
use inkwell::module::{Linkage, Module as LlvmModule};
use inkwell::passes::PassBuilderOptions;
use inkwell::targets::{CodeModel, FileType, InitializationConfig, RelocMode, Target, TargetMachine, TargetTriple};
use inkwell::values::FunctionValue;
use inkwell::{AddressSpace, IntPredicate, OptimizationLevel};

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
/// A reduction's lane folds at least this many elements: fewer, and its partial costs more
/// to write and combine than the work it takes over.
const LANE_ELEMENTS: u64 = 64;
/// At most this many lanes: enough threads to keep a GPU's memory busy (an H100 holds 270,000
/// resident threads, but a lane's loads of its own rows are many in flight).
const MAX_LANES: u64 = 1 << 16;
/// A reduction's partials take at most this many elements of scratch memory.
const SCRATCH_ELEMENTS: u64 = 1 << 24;
/// Partials folded by one block of a combining pass, as a tree in shared memory: 65,536 lanes
/// take two passes.
pub const FAN_IN: u64 = 256;

/// The fused kernels of `module` (a partition placed on a GPU) as PTX. Nodes in `keep` stay
/// kernel roots, so that their values can be fetched.
pub fn compile_gpu(module: &Module, keep: &[NodeId]) -> Result<GpuCode, CodegenError> {
    let fusion = dfc_passes::fuse(module, keep);
    let context = Context::create();
    let llvm = context.create_module("dfc_gpu");
    let machine = nvptx_machine()?;
    llvm.set_triple(&machine.get_triple());
    llvm.set_data_layout(&machine.get_target_data().get_data_layout());
    let kernels = emit_kernels(&context, &llvm, module, &fusion.kernels, Flavor::Nvptx);
    let ops = op_kernels(&context, &llvm, module, Flavor::Nvptx);
    for kernel in kernels.iter().chain(&ops) {
        if let Some(passes) = &kernel.passes {
            for launch in &passes.launches {
                add_entry(&context, &llvm, &launch.function);
            }
        } else if kernel.phases > 0 {
            add_phased_entry(&context, &llvm, &kernel.function, kernel.phases, kernel.shared_bytes);
        } else {
            add_entry(&context, &llvm, &kernel.function);
        }
        if let Some(reduction) = &kernel.reduction {
            let shared_bytes = reduction.fan_in * reduction.element_bytes;
            add_phased_entry(&context, &llvm, &reduction.combine, reduction.phases, shared_bytes);
        }
    }
    llvm.verify().map_err(|e| CodegenError::Llvm(e.to_string()))?;
    llvm.run_passes("default<O3>", &machine, PassBuilderOptions::create())
        .map_err(|e| CodegenError::Llvm(e.to_string()))?;
    let ptx =
        machine.write_to_memory_buffer(&llvm, FileType::Assembly).map_err(|e| CodegenError::Llvm(e.to_string()))?;
    let ptx = String::from_utf8_lossy(ptx.as_slice()).trim_end_matches('\0').to_string();
    Ok(GpuCode { arch: GPU_ARCH.to_string(), ptx, kernels, ops })
}

/// The kernels [`compile_gpu`] makes for `module`, described alike (a `GpuCode` without PTX),
/// with their per-thread functions (each launch's function followed by [`THREAD_SUFFIX`], of
/// the signature of `NativeKernel`'s functions: `(args, count, thread)`) compiled for
/// `target`, for the grid emulator. `NativeCode::partitions` has one partition, listing every
/// per-thread function.
pub fn compile_gpu_emulated(
    module: &Module,
    keep: &[NodeId],
    target: &NativeTarget,
) -> Result<(NativeCode, GpuCode), CodegenError> {
    let fusion = dfc_passes::fuse(module, keep);
    let context = Context::create();
    let llvm = context.create_module("dfc_gpu_emulated");
    let machine = crate::target_machine(target)?;
    llvm.set_triple(&machine.get_triple());
    llvm.set_data_layout(&machine.get_target_data().get_data_layout());
    let kernels = emit_kernels(&context, &llvm, module, &fusion.kernels, Flavor::Cpu(target));
    let ops = op_kernels(&context, &llvm, module, Flavor::Cpu(target));
    llvm.verify().map_err(|e| CodegenError::Llvm(e.to_string()))?;
    llvm.run_passes(crate::llvm_pipeline(), &machine, crate::optimisation())
        .map_err(|e| CodegenError::Llvm(e.to_string()))?;
    let object =
        machine.write_to_memory_buffer(&llvm, FileType::Object).map_err(|e| CodegenError::Llvm(e.to_string()))?;
    let threads = kernels
        .iter()
        .chain(&ops)
        .flat_map(|kernel| {
            let suffix = if kernel.phases > 0 { PHASE_SUFFIX } else { THREAD_SUFFIX };
            let thread = format!("{}{suffix}", kernel.function);
            let phased = kernel.reduction.as_ref().map(|r| format!("{}{PHASE_SUFFIX}", r.combine));
            let passes = kernel.passes.iter().flat_map(|p| &p.launches[1..]);
            let passes = passes.map(|launch| format!("{}{THREAD_SUFFIX}", launch.function));
            std::iter::once(thread).chain(phased).chain(passes).map(|function| NativeKernel {
                function,
                root: kernel.root,
                members: kernel.members.clone(),
                inputs: kernel.inputs.clone(),
                rows: kernel.rows,
                parallel: false,
            })
        })
        .collect();
    let code =
        NativeCode { target: target.clone(), objects: vec![object.as_slice().to_vec()], partitions: vec![threads] };
    Ok((code, GpuCode { arch: target.cpu.clone(), ptx: String::new(), kernels, ops }))
}

/// The kernels of single ops (`GpuCode::ops`): window kernels, layout kernels, then batch
/// normalisation's.
fn op_kernels<'ctx>(
    context: &'ctx Context,
    llvm: &LlvmModule<'ctx>,
    module: &Module,
    flavor: Flavor<'_>,
) -> Vec<GpuKernel> {
    let mut ops = crate::windows::emit_windows(context, llvm, module, flavor);
    ops.extend(crate::layout::emit_layouts(context, llvm, module, flavor));
    ops.extend(crate::norms::emit_norms(context, llvm, module, flavor));
    ops
}

/// Each kernel's loop nest and per-thread functions (internal on a GPU, where the entries call
/// them; external on the host, where the emulator does).
fn emit_kernels<'ctx>(
    context: &'ctx Context,
    llvm: &LlvmModule<'ctx>,
    module: &Module,
    fused: &[Kernel],
    flavor: Flavor<'_>,
) -> Vec<GpuKernel> {
    let inline = |function: FunctionValue<'ctx>| {
        function.set_linkage(Linkage::Internal);
        function.add_attribute(
            AttributeLoc::Function,
            context.create_enum_attribute(Attribute::get_named_enum_kind_id("alwaysinline"), 0),
        );
    };
    let on_gpu = matches!(flavor, Flavor::Nvptx);
    let mut kernels = Vec::with_capacity(fused.len());
    for (i, kernel) in fused.iter().enumerate() {
        let function = format!("k{i}_{}", sanitize(&module.graph.node(kernel.root).name));
        let rows_function = format!("{function}_rows");
        let shape = kernel::emit_lane(context, llvm, module, kernel, &rows_function, flavor);
        let reduction = (!shape.split).then(|| {
            let combine = format!("{function}_combine");
            let combine_phase = format!("{combine}{PHASE_SUFFIX}");
            let phases = kernel::emit_tree_combine(context, llvm, module, kernel, &combine_phase, flavor, FAN_IN);
            if on_gpu {
                inline(llvm.get_function(&combine_phase).expect("emitted"));
            }
            let (lanes, chunk) = lanes(shape.rows, shape.total, shape.out_len);
            let element_bytes = shape.out_dtype.size_in_bytes() as u64;
            GridReduction { lanes, chunk, out_len: shape.out_len, element_bytes, combine, fan_in: FAN_IN, phases }
        });
        let body = llvm.get_function(&rows_function).expect("emitted");
        inline(body);
        // Long rows of a row op run one per block; everything else a row (or lane) per thread.
        let phased = reduction
            .is_none()
            .then(|| {
                kernel::emit_block_row(context, llvm, module, kernel, &format!("{function}{PHASE_SUFFIX}"), flavor)
            })
            .flatten();
        // (rows: the launch's count, block, grid, phases, shared bytes)
        let (rows, block, grid, phases, shared_bytes) = match &phased {
            Some(row) => {
                if on_gpu {
                    inline(llvm.get_function(&format!("{function}{PHASE_SUFFIX}")).expect("emitted"));
                }
                let grid = u32::try_from(row.rows).unwrap_or(u32::MAX);
                (row.rows, row.block as u32, grid, row.phases, row.shared_bytes)
            }
            None => {
                let thread =
                    emit_thread(context, llvm, &format!("{function}{THREAD_SUFFIX}"), body, kernel, &reduction);
                if on_gpu {
                    inline(thread);
                }
                let threads = reduction.as_ref().map_or(shape.rows, |r| r.lanes);
                let (block, grid) = launch(threads);
                (shape.rows, block, grid, 0, 0)
            }
        };
        let graph = &module.graph;
        let output = &graph.node(kernel.root).outputs[0];
        let arg_bytes = kernel.inputs.iter().map(|t| graph.ty(*t)).chain([output]).map(|ty| ty.size_in_bytes() as u64);
        kernels.push(GpuKernel {
            function,
            root: kernel.root,
            members: kernel.members.clone(),
            inputs: kernel.inputs.clone(),
            arg_bytes: arg_bytes.collect(),
            rows,
            block,
            grid,
            reduction,
            checks: false,
            phases,
            shared_bytes,
            passes: None,
        });
    }
    kernels
}

/// Lanes and rows per lane for a reduction over `rows` rows (`total` elements) into `out_len`
/// elements: at least `LANE_ELEMENTS` elements a lane, at most `MAX_LANES` lanes and
/// `SCRATCH_ELEMENTS` elements of partials, and no lane without rows.
fn lanes(rows: u64, total: u64, out_len: u64) -> (u64, u64) {
    let row_elements = (total / rows.max(1)).max(1);
    let least_chunk = LANE_ELEMENTS.div_ceil(row_elements);
    let most = MAX_LANES.min((SCRATCH_ELEMENTS / out_len.max(1)).max(1));
    let lanes = rows.div_ceil(least_chunk).clamp(1, most);
    let chunk = rows.div_ceil(lanes).max(1);
    (rows.div_ceil(chunk).max(1), chunk)
}

/// `void name(i8** args, i64 rows, i64 thread)`: what thread `thread` of the kernel's first
/// launch does. Without a reduction, row `thread` if it is one (`body(args, thread,
/// thread + 1)`); for a reduction's lane `thread`, its chunk of rows into its partial: `body`
/// over the same arguments but the output, which is the lane's partial in the scratch memory
/// given in the output's place.
fn emit_thread<'ctx>(
    context: &'ctx Context,
    llvm: &LlvmModule<'ctx>,
    name: &str,
    body: FunctionValue<'ctx>,
    kernel: &Kernel,
    reduction: &Option<GridReduction>,
) -> FunctionValue<'ctx> {
    let i64t = context.i64_type();
    let function = llvm.add_function(name, body.get_type(), None);
    let builder = context.create_builder();
    let start = context.append_basic_block(function, "entry");
    let run = context.append_basic_block(function, "run");
    let done = context.append_basic_block(function, "done");
    builder.position_at_end(start);
    let args = function.get_nth_param(0).unwrap().into_pointer_value();
    let rows = function.get_nth_param(1).unwrap().into_int_value();
    let thread = function.get_nth_param(2).unwrap().into_int_value();
    let one = i64t.const_int(1, false);
    let Some(reduction) = reduction else {
        let inside = builder.build_int_compare(IntPredicate::ULT, thread, rows, "inside").unwrap();
        builder.build_conditional_branch(inside, run, done).unwrap();
        builder.position_at_end(run);
        let next = builder.build_int_add(thread, one, "next").unwrap();
        builder.build_call(body, &[args.into(), thread.into(), next.into()], "").unwrap();
        builder.build_unconditional_branch(done).unwrap();
        builder.position_at_end(done);
        builder.build_return(None).unwrap();
        return function;
    };
    let inside =
        builder.build_int_compare(IntPredicate::ULT, thread, i64t.const_int(reduction.lanes, false), "lane").unwrap();
    builder.build_conditional_branch(inside, run, done).unwrap();
    builder.position_at_end(run);
    // The lane's own argument array: the inputs, then its partial.
    let pointer = context.i8_type().ptr_type(AddressSpace::default());
    let arity = kernel.inputs.len() as u32 + 1;
    let own = builder.build_alloca(pointer.array_type(arity), "own").unwrap();
    let own = builder.build_pointer_cast(own, pointer.ptr_type(AddressSpace::default()), "own_args").unwrap();
    for i in 0..arity {
        let index = i64t.const_int(u64::from(i), false);
        // SAFETY: (of the generated code) `i` < the kernel's arity, the length of both `args`
        // (the launch's argument table) and `own` (allocated with that length just above).
        let from = unsafe { builder.build_gep(args, &[index], "from").unwrap() };
        // SAFETY: as above.
        let to = unsafe { builder.build_gep(own, &[index], "to").unwrap() };
        let mut value = builder.build_load(from, "arg").unwrap().into_pointer_value();
        if i + 1 == arity {
            let bytes = i64t.const_int(reduction.out_len * reduction.element_bytes, false);
            let offset = builder.build_int_mul(thread, bytes, "offset").unwrap();
            // SAFETY: lane `thread` < `lanes`, and the scratch buffer holds `lanes` partials of
            // `bytes` bytes (`GpuKernel::scratch_bytes`).
            value = unsafe { builder.build_gep(value, &[offset], "partial").unwrap() };
        }
        builder.build_store(to, value).unwrap();
    }
    let chunk = i64t.const_int(reduction.chunk, false);
    let begin = builder.build_int_mul(thread, chunk, "begin").unwrap();
    let past = builder.build_int_add(begin, chunk, "past").unwrap();
    let short = builder.build_int_compare(IntPredicate::ULT, past, rows, "short").unwrap();
    let end = builder.build_select(short, past, rows, "end").unwrap();
    builder.build_call(body, &[own.into(), begin.into(), end.into()], "").unwrap();
    builder.build_unconditional_branch(done).unwrap();
    builder.position_at_end(done);
    builder.build_return(None).unwrap();
    function
}

/// `.entry name(i8** args, i64 count)`, which calls `name_thread(args, count, thread)` with the
/// thread's index in the grid, `blockIdx.x · blockDim.x + threadIdx.x`.
fn add_entry<'ctx>(context: &'ctx Context, llvm: &LlvmModule<'ctx>, name: &str) {
    let i64t = context.i64_type();
    let thread_function = llvm.get_function(&format!("{name}{THREAD_SUFFIX}")).expect("emitted");
    let args_type = thread_function.get_type().get_param_types()[0];
    let entry = llvm.add_function(name, context.void_type().fn_type(&[args_type, i64t.into()], false), None);
    entry.set_call_conventions(PTX_KERNEL_CALLING_CONVENTION);
    let builder = context.create_builder();
    builder.position_at_end(context.append_basic_block(entry, "entry"));
    let index = grid_index(context, llvm, &builder);
    let args = entry.get_nth_param(0).unwrap();
    let count = entry.get_nth_param(1).unwrap();
    builder.build_call(thread_function, &[args.into(), count.into(), index.into()], "").unwrap();
    builder.build_return(None).unwrap();
}

/// `.entry name(i8** args, i64 count)` of a phased kernel: calls `name_phase(args, count,
/// thread, shared, p)` for each phase `p` in turn, with `thread` its index in the grid and
/// `shared` the block's shared memory (`shared_bytes`, a static array), and a barrier
/// (`bar.sync 0`) between phases, which every thread of the block reaches: the phase function
/// has no early exit.
fn add_phased_entry<'ctx>(context: &'ctx Context, llvm: &LlvmModule<'ctx>, name: &str, phases: u32, shared_bytes: u64) {
    let i64t = context.i64_type();
    let i32t = context.i32_type();
    let phase_function = llvm.get_function(&format!("{name}{PHASE_SUFFIX}")).expect("emitted");
    let args_type = phase_function.get_type().get_param_types()[0];
    let entry = llvm.add_function(name, context.void_type().fn_type(&[args_type, i64t.into()], false), None);
    entry.set_call_conventions(PTX_KERNEL_CALLING_CONVENTION);
    let shared_type = context.i8_type().array_type(shared_bytes.max(1) as u32);
    let shared =
        llvm.add_global(shared_type, Some(AddressSpace::from(SHARED_ADDRESS_SPACE)), &format!("{name}_shared"));
    shared.set_linkage(Linkage::Internal);
    shared.set_initializer(&shared_type.get_undef());
    shared.set_alignment(16);
    let builder = context.create_builder();
    builder.position_at_end(context.append_basic_block(entry, "entry"));
    let index = grid_index(context, llvm, &builder);
    let generic = builder
        .build_address_space_cast(shared.as_pointer_value(), shared_type.ptr_type(AddressSpace::default()), "generic")
        .unwrap();
    let generic =
        builder.build_pointer_cast(generic, context.i8_type().ptr_type(AddressSpace::default()), "bytes").unwrap();
    let barrier = llvm
        .get_function("llvm.nvvm.barrier0")
        .unwrap_or_else(|| llvm.add_function("llvm.nvvm.barrier0", context.void_type().fn_type(&[], false), None));
    let args = entry.get_nth_param(0).unwrap();
    let count = entry.get_nth_param(1).unwrap();
    for p in 0..phases {
        if p > 0 {
            builder.build_call(barrier, &[], "").unwrap();
        }
        let phase = i32t.const_int(u64::from(p), false);
        builder
            .build_call(phase_function, &[args.into(), count.into(), index.into(), generic.into(), phase.into()], "")
            .unwrap();
    }
    builder.build_return(None).unwrap();
}

/// The thread's index in the grid, `blockIdx.x · blockDim.x + threadIdx.x`, as an i64.
fn grid_index<'ctx>(
    context: &'ctx Context,
    llvm: &LlvmModule<'ctx>,
    builder: &inkwell::builder::Builder<'ctx>,
) -> inkwell::values::IntValue<'ctx> {
    let (i32t, i64t) = (context.i32_type(), context.i64_type());
    let special = |register: &str| {
        let read =
            llvm.get_function(register).unwrap_or_else(|| llvm.add_function(register, i32t.fn_type(&[], false), None));
        let value = builder.build_call(read, &[], "r").unwrap().try_as_basic_value().unwrap_basic().into_int_value();
        builder.build_int_z_extend(value, i64t, "wide").unwrap()
    };
    let block = special("llvm.nvvm.read.ptx.sreg.ctaid.x");
    let threads = special("llvm.nvvm.read.ptx.sreg.ntid.x");
    let thread = special("llvm.nvvm.read.ptx.sreg.tid.x");
    let first = builder.build_int_mul(block, threads, "first").unwrap();
    builder.build_int_add(first, thread, "index").unwrap()
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
