//! One fused kernel to one LLVM function: its iteration space, the strides of every access,
//! the loop nest, and the scalar code of each member.

use crate::code::NativeTarget;
use dfc_ir::{BinaryOp, CompareOp, ConstData, DType, Module, NodeId, Op, ReduceKind, TensorRef, UnaryOp};
use dfc_passes::Kernel;
use inkwell::attributes::AttributeLoc;
use inkwell::basic_block::BasicBlock;
use inkwell::builder::Builder;
use inkwell::context::Context;
use inkwell::intrinsics::Intrinsic;
use inkwell::module::Module as LlvmModule;
use inkwell::types::{BasicType, BasicTypeEnum};
use inkwell::values::{BasicValueEnum, FloatValue, FunctionValue, IntValue, PointerValue};
use inkwell::{AddressSpace, FloatPredicate, IntPredicate};
use std::collections::HashMap;

mod float64;
mod nvptx;

/// NVPTX's global address space.
pub(crate) const GLOBAL_ADDRESS_SPACE: u16 = 1;
/// NVPTX's shared address space: a block's own memory.
pub(crate) const SHARED_ADDRESS_SPACE: u16 = 3;

/// What the runtime needs to know of a kernel's loop nest.
pub struct KernelShape {
    /// Iterations of the outermost loop: `begin..end` ranges over these.
    pub rows: u64,
    /// Whether each row writes only its own part of the output, so that ranges of rows may
    /// run apart (not a reduction over the outermost loop, which every row adds to).
    pub split: bool,
    /// Whether the CPU should split the rows among threads: `split`, and large enough to pay.
    pub parallel: bool,
    /// Elements of the output: what a reduction keeps.
    pub out_len: u64,
    /// Elements of the iteration space.
    pub total: u64,
    /// The output's element type.
    pub out_dtype: DType,
}

/// Below this many elements a kernel runs on one thread: waking the pool costs more than it
/// saves (measured: the logreg step, whose largest kernel has 78,400 elements, went from 150 to
/// 64 µs when it stopped splitting them).
const PARALLEL_MIN_ELEMENTS: u64 = 1 << 18;

/// Folds over a row of at most this many elements, known when the kernel is generated (the ten
/// classes of a softmax), are written out in full, since the optimiser runs without LLVM's
/// unroller (`optimisation` in lib.rs): they are what its full unrolling gained (the logreg
/// step: 73 against 80 µs without). Other small loops gain nothing from it (measured).
pub(crate) const UNROLLED_MAX: u64 = 16;

#[derive(Clone, Copy, PartialEq)]
enum RowOp {
    Softmax,
    LogSoftmax,
    CrossEntropy,
    ArgMax,
    LayerNorm { epsilon: f64 },
    LayerNormGrad { epsilon: f64 },
}

impl RowOp {
    /// Whether the op writes a row for a row (not one value a row).
    fn maps_rows(self) -> bool {
        matches!(self, RowOp::Softmax | RowOp::LogSoftmax | RowOp::LayerNorm { .. } | RowOp::LayerNormGrad { .. })
    }
}

#[derive(Clone, PartialEq)]
enum Root {
    Loop,
    Assign(Op),
    Reduce { kind: ReduceKind, axes: Vec<usize> },
    Row(RowOp),
}

/// The loop nest of a kernel after merging dimensions, with every access's strides in it.
struct Nest {
    extents: Vec<u64>,
    /// Strides (elements) of each outside value, per loop dimension.
    leaves: HashMap<TensorRef, Vec<i64>>,
    out: Vec<i64>,
    /// For a reduction: which loop dimensions are summed over.
    reduced: Vec<bool>,
    /// The loop dimension each one-hot's class index runs along (`None`: always 0).
    one_hot_dim: HashMap<NodeId, Option<usize>>,
    /// Per random member, the strides of its own elements along each loop dimension: where
    /// an iteration is in its stream.
    positions: HashMap<TensorRef, Vec<i64>>,
}

/// What the code runs on, which decides the function's attributes and how transcendentals are
/// computed: the C library or polynomials on a CPU; on a GPU, which has none, the PTX
/// approximations (`ex2.approx`, `lg2.approx`, f32 only) and identities built on them, and
/// f64's `exp` and `ln` from multiplies and bits (`float64`, which the CPU runs too).
#[derive(Clone, Copy)]
pub enum Flavor<'t> {
    Cpu(&'t NativeTarget),
    Nvptx,
}

/// Emits `void name(i8** args, i64 begin, i64 end)`: the kernel over rows `begin..end`.
pub fn emit<'ctx>(
    context: &'ctx Context,
    llvm: &LlvmModule<'ctx>,
    module: &Module,
    kernel: &Kernel,
    name: &str,
    flavor: Flavor<'_>,
) -> KernelShape {
    emit_kernel(context, llvm, module, kernel, name, flavor, false)
}

/// [`emit`], for a GPU's grid: a reduction over the outermost loop, which runs in passes
/// (`GridReduction`), folds its rows into the output (a lane's partial) and leaves a mean
/// undivided: the last combining pass divides it ([`emit_tree_combine`]).
pub fn emit_lane<'ctx>(
    context: &'ctx Context,
    llvm: &LlvmModule<'ctx>,
    module: &Module,
    kernel: &Kernel,
    name: &str,
    flavor: Flavor<'_>,
) -> KernelShape {
    emit_kernel(context, llvm, module, kernel, name, flavor, true)
}

fn root_of(op: &Op) -> Root {
    match op {
        Op::Assign | Op::AssignAdd | Op::AssignSub => Root::Assign(op.clone()),
        Op::Reduce { kind, axes, .. } => Root::Reduce { kind: *kind, axes: axes.clone() },
        Op::Softmax { .. } => Root::Row(RowOp::Softmax),
        Op::LogSoftmax { .. } => Root::Row(RowOp::LogSoftmax),
        Op::SoftmaxCrossEntropy => Root::Row(RowOp::CrossEntropy),
        Op::ArgMax { .. } => Root::Row(RowOp::ArgMax),
        Op::LayerNorm { epsilon } => Root::Row(RowOp::LayerNorm { epsilon: *epsilon }),
        Op::LayerNormGrad { epsilon } => Root::Row(RowOp::LayerNormGrad { epsilon: *epsilon }),
        _ => Root::Loop,
    }
}

/// A function `void name(i8** args, i64, i64)` with the flavour's attributes, and a builder at
/// its entry.
pub(crate) fn kernel_function<'ctx>(
    context: &'ctx Context,
    llvm: &LlvmModule<'ctx>,
    name: &str,
    flavor: Flavor<'_>,
) -> (FunctionValue<'ctx>, Builder<'ctx>) {
    let i8_ptr = context.i8_type().ptr_type(AddressSpace::default());
    let i64t = context.i64_type();
    let params = [i8_ptr.ptr_type(AddressSpace::default()).into(), i64t.into(), i64t.into()];
    function_with(context, llvm, name, flavor, &params)
}

/// `void name(i8** args, i64 count, i64 thread, i8* shared, i32 phase)`: a phase of a thread
/// of a kernel with barriers (`emit_tree_combine`), with the flavour's attributes.
fn phase_function<'ctx>(
    context: &'ctx Context,
    llvm: &LlvmModule<'ctx>,
    name: &str,
    flavor: Flavor<'_>,
) -> (FunctionValue<'ctx>, Builder<'ctx>) {
    let i8_ptr = context.i8_type().ptr_type(AddressSpace::default());
    let i64t = context.i64_type();
    let params = [
        i8_ptr.ptr_type(AddressSpace::default()).into(),
        i64t.into(),
        i64t.into(),
        i8_ptr.into(),
        context.i32_type().into(),
    ];
    function_with(context, llvm, name, flavor, &params)
}

fn function_with<'ctx>(
    context: &'ctx Context,
    llvm: &LlvmModule<'ctx>,
    name: &str,
    flavor: Flavor<'_>,
    params: &[inkwell::types::BasicMetadataTypeEnum<'ctx>],
) -> (FunctionValue<'ctx>, Builder<'ctx>) {
    let fn_type = context.void_type().fn_type(params, false);
    let function = llvm.add_function(name, fn_type, None);
    if let Flavor::Cpu(target) = flavor {
        function.add_attribute(AttributeLoc::Function, context.create_string_attribute("target-cpu", &target.cpu));
        function.add_attribute(
            AttributeLoc::Function,
            context.create_string_attribute("target-features", &target.features),
        );
    }
    function.add_attribute(
        AttributeLoc::Function,
        context.create_enum_attribute(inkwell::attributes::Attribute::get_named_enum_kind_id("nounwind"), 0),
    );
    let builder = context.create_builder();
    let entry = context.append_basic_block(function, "entry");
    builder.position_at_end(entry);
    (function, builder)
}

/// Emits `void name(i8** args, i64 count, i64 thread, i8* shared, i32 phase)` (see
/// `phase_function`): phase `phase` of thread `thread` of a combining pass of a reduction over
/// the outermost loop run in passes (`GridReduction`), in blocks of `block` threads (a power
/// of two) with barriers between the phases. `args` = [partials, output]; `count` partials of
/// `out_len` elements each are left. Block `g·out_len + o` folds element `o` of partials
/// `g·block..` (at most `block` of them) into element `o` of partial `g` of the output, as a
/// tree in `shared` (`block` elements): in phase 0 each thread loads its partial's element
/// there; in phase `k` thread `t < block >> k` folds in the element `block >> k` above its
/// own; in the last, thread 0 writes the block's result, finishing a mean in the last pass
/// (one group: `count ≤ block`). The fold's order is fixed, and between phases every thread
/// of the block waits at a barrier, so no thread reads an element before it is written.
/// Returns the phases: `log2(block) + 1`.
pub fn emit_tree_combine<'ctx>(
    context: &'ctx Context,
    llvm: &LlvmModule<'ctx>,
    module: &Module,
    kernel: &Kernel,
    name: &str,
    flavor: Flavor<'_>,
    block: u64,
) -> u32 {
    assert!(block.is_power_of_two(), "a tree's block is a power of two");
    let root_node = module.graph.node(kernel.root);
    let root = root_of(&root_node.op);
    let Root::Reduce { kind, .. } = root else {
        panic!("a combining pass of a kernel that is no reduction");
    };
    let nest = plan_nest(module, kernel, &root);
    let function = phase_function(context, llvm, name, flavor);
    let gen = Gen::with_function(context, llvm, module, kernel, nest, function, flavor, false);
    gen.emit_tree_phase(kind, root_node.outputs[0].dtype, block);
    gen.builder.build_return(None).unwrap();
    block.trailing_zeros() + 1
}

/// Rows of a row op at least this long run one per block on a GPU ([`emit_block_row`]), their
/// elements spread over the block's threads; shorter ones one per thread.
pub const BLOCK_ROW_MIN: u64 = 128;

/// A row op run one row per block: `rows` blocks of `block` threads, through `phases` phases
/// over `shared_bytes` of shared memory.
pub struct BlockRow {
    pub rows: u64,
    pub block: u64,
    pub phases: u32,
    pub shared_bytes: u64,
}

/// For a row op (softmax, log-softmax, cross-entropy, argmax over the last axis) over rows of
/// at least `BLOCK_ROW_MIN` elements, emits `name` as a phase function (see `phase_function`)
/// that runs row `thread / block` in a block of `block` threads (a power of two, about eight
/// elements a thread): thread `t` folds elements `t, t + block, …` of the row, and trees in
/// shared memory (a phase per step, barriers between) combine the threads' maxima, sums of
/// exponentials and losses, as `emit_tree_combine`'s do. The elements are the fused kernel's
/// (`Gen::value`), computed where they are used. None for other kernels.
pub fn emit_block_row<'ctx>(
    context: &'ctx Context,
    llvm: &LlvmModule<'ctx>,
    module: &Module,
    kernel: &Kernel,
    name: &str,
    flavor: Flavor<'_>,
) -> Option<BlockRow> {
    let graph = &module.graph;
    let root_node = graph.node(kernel.root);
    let root = root_of(&root_node.op);
    let Root::Row(op) = root else { return None };
    let nest = plan_nest(module, kernel, &root);
    let classes = *nest.extents.last()?;
    if classes < BLOCK_ROW_MIN {
        return None;
    }
    let rows: u64 = nest.extents[..nest.extents.len() - 1].iter().product();
    let block = (classes / 8).next_power_of_two().clamp(32, 256);
    let x_bytes = graph.ty(graph.inputs(kernel.root)[0]).dtype.size_in_bytes() as u64;
    let out_dtype = root_node.outputs[0].dtype;
    let function = phase_function(context, llvm, name, flavor);
    let mut gen = Gen::with_function(context, llvm, module, kernel, nest, function, flavor, false);
    let args = gen.function.get_nth_param(0).unwrap().into_pointer_value();
    for (i, input) in kernel.inputs.iter().enumerate() {
        let pointer = gen.arg_pointer(args, i, graph.ty(*input).dtype);
        gen.pointers.insert(*input, pointer);
    }
    gen.out = Some(gen.arg_pointer(args, kernel.inputs.len(), out_dtype));
    let phases = gen.emit_row_phases(op, out_dtype, block);
    gen.builder.build_return(None).unwrap();
    Some(BlockRow { rows, block, phases, shared_bytes: block_row_shared_bytes(op, block, x_bytes) })
}

/// Two regions of the row's element type (maxima or means, sums or variances), one of 8 bytes a
/// thread (argmax's indices, cross-entropy's losses, the sums of gradients), and for a layer
/// norm's gradient a fourth (the sums of gradient × normalised value).
fn block_row_shared_bytes(op: RowOp, block: u64, x_bytes: u64) -> u64 {
    let fourth = if matches!(op, RowOp::LayerNormGrad { .. }) { x_bytes } else { 0 };
    block * (2 * x_bytes + 8 + fourth)
}

fn emit_kernel<'ctx>(
    context: &'ctx Context,
    llvm: &LlvmModule<'ctx>,
    module: &Module,
    kernel: &Kernel,
    name: &str,
    flavor: Flavor<'_>,
    partial: bool,
) -> KernelShape {
    let graph = &module.graph;
    let root_node = graph.node(kernel.root);
    let root = root_of(&root_node.op);
    let nest = plan_nest(module, kernel, &root);
    let total: u64 = nest.extents.iter().product();
    let rows = match &root {
        Root::Row(_) if nest.extents.len() < 2 => 1,
        _ => nest.extents[0],
    };
    // A row op's rows write their own outputs, also when there is one row (a vector's
    // softmax): not a reduction, which a GPU would run in passes.
    let split = match &root {
        Root::Reduce { .. } => !nest.reduced[0],
        _ => true,
    };
    let parallel = split && rows >= 2 && total >= PARALLEL_MIN_ELEMENTS;
    let out_len: u64 = match &root {
        Root::Reduce { .. } => nest.extents.iter().zip(&nest.reduced).filter(|(_, r)| !**r).map(|(e, _)| e).product(),
        _ => root_node.outputs[0].shape.n_elements() as u64,
    };
    let out_dtype = root_node.outputs[0].dtype;
    let mut gen = Gen::new(context, llvm, module, kernel, nest, name, flavor, partial && !split);
    let function = gen.function;
    let args = function.get_nth_param(0).unwrap().into_pointer_value();
    let begin = function.get_nth_param(1).unwrap().into_int_value();
    let end = function.get_nth_param(2).unwrap().into_int_value();
    for (i, input) in kernel.inputs.iter().enumerate() {
        let dtype = graph.ty(*input).dtype;
        let pointer = gen.arg_pointer(args, i, dtype);
        gen.pointers.insert(*input, pointer);
    }
    gen.out = Some(gen.arg_pointer(args, kernel.inputs.len(), out_dtype));

    match root.clone() {
        Root::Loop => gen.emit_loop(begin, end, out_dtype),
        Root::Assign(op) => gen.emit_assign(begin, end, &op, out_dtype),
        Root::Reduce { kind, .. } => gen.emit_reduce(begin, end, kind, out_dtype),
        Root::Row(op) => gen.emit_row(begin, end, op, out_dtype),
    }
    gen.builder.build_return(None).unwrap();
    KernelShape { rows, split, parallel, out_len, total, out_dtype }
}

/// The iteration space of the kernel and the strides of every access in it, merged.
fn plan_nest(module: &Module, kernel: &Kernel, root: &Root) -> Nest {
    let graph = &module.graph;
    let root_id = kernel.root;
    let operands = graph.inputs(root_id);
    let space: Vec<usize> = match root {
        Root::Loop | Root::Assign(_) => graph.node(root_id).outputs[0].shape.dims().to_vec(),
        Root::Reduce { .. } | Root::Row(_) => graph.ty(operands[0]).shape.dims().to_vec(),
    };
    let rank = space.len();
    // Each value's dimensions → loop dimensions (None: broadcast, index 0).
    let mut maps: HashMap<TensorRef, Vec<Option<usize>>> = HashMap::new();
    let identity: Vec<Option<usize>> = (0..rank).map(Some).collect();
    let broadcast_to = |shape: &[usize], target: &[usize], target_map: &[Option<usize>]| -> Vec<Option<usize>> {
        let offset = target.len() - shape.len();
        shape
            .iter()
            .enumerate()
            .map(|(j, &size)| if size == 1 && target[j + offset] != 1 { None } else { target_map[j + offset] })
            .collect()
    };
    match root {
        Root::Loop => {
            maps.insert(TensorRef::from(root_id), identity.clone());
        }
        Root::Assign(_) => {
            maps.insert(operands[0], identity.clone());
            let value_shape = graph.ty(operands[1]).shape.dims().to_vec();
            maps.insert(operands[1], broadcast_to(&value_shape, &space, &identity));
        }
        Root::Reduce { .. } | Root::Row(_) => {
            for operand in &operands {
                maps.insert(*operand, identity.clone());
            }
        }
    }
    let mut one_hot_dim: HashMap<NodeId, Option<usize>> = HashMap::new();
    for &member in kernel.members.iter().rev() {
        if member == root_id && !matches!(root, Root::Loop) {
            continue;
        }
        let node = graph.node(member);
        let map = maps.get(&TensorRef::from(member)).cloned().unwrap_or_else(|| identity.clone());
        let shape = node.outputs[0].shape.dims().to_vec();
        if let Op::OneHot { .. } = node.op {
            one_hot_dim.insert(member, *map.last().unwrap());
        }
        for operand in graph.inputs(member) {
            let operand_shape = graph.ty(operand).shape.dims().to_vec();
            let operand_map = match node.op {
                Op::OneHot { .. } => map[..operand_shape.len()].to_vec(),
                _ => broadcast_to(&operand_shape, &shape, &map),
            };
            maps.insert(operand, operand_map);
        }
    }
    let row_major = |shape: &[usize]| -> Vec<i64> {
        let mut strides = vec![0i64; shape.len()];
        let mut s = 1i64;
        for j in (0..shape.len()).rev() {
            strides[j] = s;
            s *= shape[j] as i64;
        }
        strides
    };
    let access = |shape: &[usize], map: &[Option<usize>]| -> Vec<i64> {
        let mut strides = vec![0i64; rank];
        for (j, s) in row_major(shape).into_iter().enumerate() {
            if let Some(l) = map[j] {
                strides[l] += s;
            }
        }
        strides
    };
    let mut leaves = HashMap::new();
    for input in &kernel.inputs {
        let shape = graph.ty(*input).shape.dims().to_vec();
        let map = maps.get(input).cloned().unwrap_or_else(|| vec![None; shape.len()]);
        leaves.insert(*input, access(&shape, &map));
    }
    let mut positions = HashMap::new();
    for &member in &kernel.members {
        if let Op::RandomUniform { shape, .. } | Op::RandomNormal { shape, .. } = &graph.node(member).op {
            let map = maps.get(&TensorRef::from(member)).cloned().unwrap_or_else(|| identity.clone());
            positions.insert(TensorRef::from(member), access(shape.dims(), &map));
        }
    }
    let mut reduced = vec![false; rank];
    let out: Vec<i64> = match root {
        Root::Loop | Root::Assign(_) => access(&space, &identity),
        Root::Reduce { axes, .. } => {
            for &a in axes {
                reduced[a] = true;
            }
            let kept: Vec<usize> = (0..rank).filter(|d| !reduced[*d]).collect();
            let kept_shape: Vec<usize> = kept.iter().map(|&d| space[d]).collect();
            let kept_map: Vec<Option<usize>> = kept.iter().map(|&d| Some(d)).collect();
            access(&kept_shape, &kept_map)
        }
        Root::Row(op) if op.maps_rows() => access(&space, &identity),
        Root::Row(_) => {
            let lead = &space[..rank - 1];
            access(lead, &identity[..rank - 1])
        }
    };
    let mut nest = Nest {
        extents: space.iter().map(|&e| e as u64).collect(),
        leaves,
        out,
        reduced,
        one_hot_dim: HashMap::new(),
        positions,
    };
    // Loop dimension of each one-hot, tracked through merges.
    let mut barrier: Vec<bool> = vec![false; rank];
    for dim in one_hot_dim.values().flatten() {
        barrier[*dim] = true;
    }
    let mut dim_of: Vec<usize> = (0..rank).collect();
    if !matches!(root, Root::Row(_)) {
        let mut l = 0;
        while l + 1 < nest.extents.len() {
            let inner = nest.extents[l + 1] as i64;
            let mergeable = !barrier[l]
                && !barrier[l + 1]
                && nest.reduced[l] == nest.reduced[l + 1]
                && std::iter::once(&nest.out)
                    .chain(nest.leaves.values())
                    .chain(nest.positions.values())
                    .all(|s| s[l] == s[l + 1] * inner || nest.extents[l] == 1 || inner == 1);
            if mergeable {
                // A size-1 inner dimension leaves the outer's stride; otherwise the inner's is the merged one.
                for s in
                    std::iter::once(&mut nest.out).chain(nest.leaves.values_mut()).chain(nest.positions.values_mut())
                {
                    let inner_stride = s.remove(l + 1);
                    if inner != 1 {
                        s[l] = inner_stride;
                    }
                }
                nest.extents[l] *= nest.extents[l + 1];
                nest.extents.remove(l + 1);
                nest.reduced.remove(l + 1);
                barrier.remove(l + 1);
                for d in dim_of.iter_mut() {
                    if *d > l {
                        *d -= 1;
                    }
                }
            } else {
                l += 1;
            }
        }
    }
    nest.one_hot_dim = one_hot_dim.into_iter().map(|(id, dim)| (id, dim.map(|d| dim_of[d]))).collect();
    if nest.extents.is_empty() {
        // A scalar: one iteration of one loop.
        nest.extents.push(1);
        nest.reduced.push(false);
        nest.out.push(0);
        for s in nest.leaves.values_mut().chain(nest.positions.values_mut()) {
            s.push(0);
        }
    }
    nest
}

struct Gen<'a, 'ctx> {
    context: &'ctx Context,
    llvm: &'a LlvmModule<'ctx>,
    builder: Builder<'ctx>,
    function: FunctionValue<'ctx>,
    module: &'a Module,
    kernel: &'a Kernel,
    nest: Nest,
    pointers: HashMap<TensorRef, PointerValue<'ctx>>,
    out: Option<PointerValue<'ctx>>,
    /// Code for a GPU: no C library (see `Flavor`).
    nvptx: bool,
    /// A lane of a reduction run in passes: a mean is not divided (see `emit_lane`).
    partial: bool,
}

/// Whether `q + (x − q·c)·r`, with `r` = 1/c and `q` = x·r in f32 and both steps by FMA (`Gen::divide_byte`), is the
/// bits of `x / c` for every byte's value x: checked here for all 256. It holds for the 255 that scales images (and for
/// every whole c up to 1,000, at least); refused where a value on the way overflows or is subnormal (which the native
/// runtime flushes to 0: `r` of a c above 2^126, say).
fn reciprocal_divides_bytes(c: f32) -> bool {
    let r = 1.0 / c;
    let tame = |v: f32| v == 0.0 || v.is_normal();
    c.is_normal()
        && r.is_normal()
        && (0..=255u8).map(f32::from).all(|x| {
            let q = x * r;
            let remainder = (-q).mul_add(c, x);
            let divided = remainder.mul_add(r, q);
            tame(q) && tame(remainder) && tame(divided) && divided.to_bits() == (x / c).to_bits()
        })
}

fn memory_type<'ctx>(context: &'ctx Context, dtype: DType) -> BasicTypeEnum<'ctx> {
    match dtype {
        DType::F32 => context.f32_type().into(),
        DType::F64 => context.f64_type().into(),
        DType::I32 => context.i32_type().into(),
        DType::I64 => context.i64_type().into(),
        DType::U8 | DType::Bool => context.i8_type().into(),
    }
}

/// Loop indices of the current point, one per loop dimension.
type Index<'ctx> = Vec<IntValue<'ctx>>;

impl<'a, 'ctx> Gen<'a, 'ctx> {
    /// A generator for the new function `name` (`void name(i8** args, i64, i64)`), at its entry.
    #[allow(clippy::too_many_arguments)]
    fn new(
        context: &'ctx Context,
        llvm: &'a LlvmModule<'ctx>,
        module: &'a Module,
        kernel: &'a Kernel,
        nest: Nest,
        name: &str,
        flavor: Flavor<'_>,
        partial: bool,
    ) -> Gen<'a, 'ctx> {
        let function = kernel_function(context, llvm, name, flavor);
        Gen::with_function(context, llvm, module, kernel, nest, function, flavor, partial)
    }

    #[allow(clippy::too_many_arguments)]
    fn with_function(
        context: &'ctx Context,
        llvm: &'a LlvmModule<'ctx>,
        module: &'a Module,
        kernel: &'a Kernel,
        nest: Nest,
        (function, builder): (FunctionValue<'ctx>, Builder<'ctx>),
        flavor: Flavor<'_>,
        partial: bool,
    ) -> Gen<'a, 'ctx> {
        let nvptx = matches!(flavor, Flavor::Nvptx);
        Gen {
            context,
            llvm,
            builder,
            function,
            module,
            kernel,
            nest,
            pointers: HashMap::new(),
            out: None,
            nvptx,
            partial,
        }
    }

    fn i64(&self, v: i64) -> IntValue<'ctx> {
        self.context.i64_type().const_int(v as u64, true)
    }

    fn arg_pointer(&self, args: PointerValue<'ctx>, i: usize, dtype: DType) -> PointerValue<'ctx> {
        // SAFETY: the generated code indexes the kernel's `i8** args` at `i`, one of the kernel's
        // own arguments (`i` < its arity, as the caller numbers them), so the address is in the array.
        let slot = unsafe { self.builder.build_gep(args, &[self.i64(i as i64)], "arg").unwrap() };
        let raw = self.builder.build_load(slot, "raw").unwrap().into_pointer_value();
        let ty = memory_type(self.context, dtype).ptr_type(AddressSpace::default());
        let pointer = self.builder.build_pointer_cast(raw, ty, "p").unwrap();
        if !self.nvptx {
            return pointer;
        }
        // A GPU kernel's buffers are all in global memory: loads and stores through the global
        // address space (`ld.global`), not generic addresses the hardware must resolve.
        let global = memory_type(self.context, dtype).ptr_type(AddressSpace::from(GLOBAL_ADDRESS_SPACE));
        self.builder.build_address_space_cast(pointer, global, "global").unwrap()
    }

    /// `for i in start..end { body(i) }`, leaving the builder after the loop.
    fn emit_for(&self, start: IntValue<'ctx>, end: IntValue<'ctx>, body: &mut dyn FnMut(IntValue<'ctx>)) {
        let pre = self.builder.get_insert_block().unwrap();
        let head = self.context.append_basic_block(self.function, "loop");
        let exit = self.context.append_basic_block(self.function, "exit");
        let enter = self.builder.build_int_compare(IntPredicate::SLT, start, end, "enter").unwrap();
        self.builder.build_conditional_branch(enter, head, exit).unwrap();
        self.builder.position_at_end(head);
        let phi = self.builder.build_phi(self.context.i64_type(), "i").unwrap();
        phi.add_incoming(&[(&start, pre)]);
        let i = phi.as_basic_value().into_int_value();
        body(i);
        let next = self.builder.build_int_add(i, self.i64(1), "next").unwrap();
        let latch: BasicBlock = self.builder.get_insert_block().unwrap();
        phi.add_incoming(&[(&next, latch)]);
        let more = self.builder.build_int_compare(IntPredicate::SLT, next, end, "more").unwrap();
        self.builder.build_conditional_branch(more, head, exit).unwrap();
        self.builder.position_at_end(exit);
    }

    /// Loops over dimensions `from..` of the nest (the first of them over `first`), calling
    /// `body` with the full index (`prefix` then these).
    fn emit_nest(
        &self,
        prefix: &mut Index<'ctx>,
        dims: std::ops::Range<usize>,
        first: Option<(IntValue<'ctx>, IntValue<'ctx>)>,
        body: &mut dyn FnMut(&Index<'ctx>),
    ) {
        if dims.is_empty() {
            body(prefix);
            return;
        }
        let d = dims.start;
        let (start, end) = first.unwrap_or((self.i64(0), self.i64(self.nest.extents[d] as i64)));
        self.emit_for(start, end, &mut |i| {
            prefix.push(i);
            self.emit_nest(prefix, d + 1..dims.end, None, body);
            prefix.pop();
        });
    }

    fn offset(&self, strides: &[i64], index: &Index<'ctx>) -> IntValue<'ctx> {
        let mut sum = self.i64(0);
        for (l, &i) in index.iter().enumerate() {
            match strides[l] {
                0 => {}
                1 => sum = self.builder.build_int_add(sum, i, "o").unwrap(),
                s => {
                    let term = self.builder.build_int_mul(i, self.i64(s), "t").unwrap();
                    sum = self.builder.build_int_add(sum, term, "o").unwrap();
                }
            }
        }
        sum
    }

    fn element(&self, base: PointerValue<'ctx>, offset: IntValue<'ctx>) -> PointerValue<'ctx> {
        // SAFETY: `offset` is an element's index computed from the loop indices and the access's
        // strides (`offset`), which stay within the buffer's elements for every point of the
        // iteration space, so the generated `inbounds` GEP holds.
        unsafe { self.builder.build_in_bounds_gep(base, &[offset], "e").unwrap() }
    }

    fn load(&self, pointer: PointerValue<'ctx>, dtype: DType) -> BasicValueEnum<'ctx> {
        let value = self.builder.build_load(pointer, "v").unwrap();
        if dtype == DType::Bool {
            let zero = self.context.i8_type().const_zero();
            return self.builder.build_int_compare(IntPredicate::NE, value.into_int_value(), zero, "b").unwrap().into();
        }
        value
    }

    fn store(&self, pointer: PointerValue<'ctx>, dtype: DType, value: BasicValueEnum<'ctx>) {
        let value = if dtype == DType::Bool {
            self.builder.build_int_z_extend(value.into_int_value(), self.context.i8_type(), "z").unwrap().into()
        } else {
            value
        };
        self.builder.build_store(pointer, value).unwrap();
    }

    fn constant(&self, dtype: DType, value: f64) -> BasicValueEnum<'ctx> {
        match dtype {
            DType::F32 => self.context.f32_type().const_float(value).into(),
            DType::F64 => self.context.f64_type().const_float(value).into(),
            DType::I32 => self.context.i32_type().const_int(value as i64 as u64, true).into(),
            DType::I64 => self.context.i64_type().const_int(value as i64 as u64, true).into(),
            DType::U8 => self.context.i8_type().const_int(value as u64, false).into(),
            DType::Bool => self.context.bool_type().const_int((value != 0.0) as u64, false).into(),
        }
    }

    /// A constant operand whose elements are all equal, as an immediate.
    fn splat(&self, tensor: TensorRef) -> Option<BasicValueEnum<'ctx>> {
        let Op::Const { value } = &self.module.graph.node(tensor.node).op else {
            return None;
        };
        fn uniform<T: PartialEq + Copy>(v: &[T]) -> Option<T> {
            let first = *v.first()?;
            v.iter().all(|x| *x == first).then_some(first)
        }
        Some(match &value.data {
            ConstData::F32(v) => self.context.f32_type().const_float(uniform(v)? as f64).into(),
            ConstData::F64(v) => self.context.f64_type().const_float(uniform(v)?).into(),
            ConstData::I32(v) => self.context.i32_type().const_int(uniform(v)? as i64 as u64, true).into(),
            ConstData::I64(v) => self.context.i64_type().const_int(uniform(v)? as u64, true).into(),
            ConstData::U8(v) => self.context.i8_type().const_int(uniform(v)? as u64, false).into(),
            ConstData::Bool(v) => self.context.bool_type().const_int(uniform(v)? as u64, false).into(),
        })
    }

    /// The value of `tensor` at `index`: a load of an outside value, or a member computed from
    /// its operands.
    fn value(
        &self,
        tensor: TensorRef,
        index: &Index<'ctx>,
        memo: &mut HashMap<TensorRef, BasicValueEnum<'ctx>>,
    ) -> BasicValueEnum<'ctx> {
        if let Some(v) = memo.get(&tensor) {
            return *v;
        }
        let graph = &self.module.graph;
        let dtype = graph.ty(tensor).dtype;
        let v = if let Some(strides) = self.nest.leaves.get(&tensor) {
            match self.splat(tensor) {
                Some(c) => c,
                None => {
                    let offset = self.offset(strides, index);
                    self.load(self.element(self.pointers[&tensor], offset), dtype)
                }
            }
        } else {
            let node = graph.node(tensor.node);
            let operands: Vec<TensorRef> = graph.inputs(tensor.node);
            let args: Vec<BasicValueEnum<'ctx>> = operands.iter().map(|t| self.value(*t, index, memo)).collect();
            let arg_types: Vec<DType> = operands.iter().map(|t| graph.ty(*t).dtype).collect();
            self.scalar_op(&node.op, tensor.node, &args, &arg_types, dtype, index)
        };
        memo.insert(tensor, v);
        v
    }

    fn float_intrinsic(&self, name: &str, x: FloatValue<'ctx>) -> FloatValue<'ctx> {
        match name {
            "llvm.exp" if self.nvptx => return self.nvptx_exp(x),
            "llvm.exp" if x.get_type() == self.context.f32_type() => return self.polynomial_exp(x),
            "llvm.exp" => return self.exp64(x),
            "llvm.log" if self.nvptx => return self.nvptx_log(x),
            "llvm.log" if x.get_type() == self.context.f64_type() => return self.log64(x),
            _ => {}
        }
        let intrinsic = Intrinsic::find(name).expect("LLVM intrinsic");
        let decl = intrinsic.get_declaration(self.llvm, &[x.get_type().into()]).unwrap();
        self.builder.build_call(decl, &[x.into()], "f").unwrap().try_as_basic_value().unwrap_basic().into_float_value()
    }

    /// A C library function of one float (`tanhf`, `log1p` …).
    fn libm(&self, name32: &str, name64: &str, x: FloatValue<'ctx>) -> FloatValue<'ctx> {
        if self.nvptx {
            return self.nvptx_libm(name64, x);
        }
        let ty = x.get_type();
        let name = if ty == self.context.f32_type() { name32 } else { name64 };
        let f = self
            .llvm
            .get_function(name)
            .unwrap_or_else(|| self.llvm.add_function(name, ty.fn_type(&[ty.into()], false), None));
        self.builder.build_call(f, &[x.into()], "m").unwrap().try_as_basic_value().unwrap_basic().into_float_value()
    }

    /// f32 `tanh(x)` as `x · P(x²) / Q(x²)` on x clamped to ±7.905 (beyond, tanh is ±1 in f32),
    /// and `x` itself where |x| < 0.0004: the rational approximation Eigen and XLA use, within
    /// 3e-7 of tanh. Multiplies and adds vectorise, where libm's `tanhf` is a call per element
    /// (a sixth of the transformer's step, in GELU, before). NaN stays NaN.
    fn rational_tanh(&self, x: FloatValue<'ctx>) -> FloatValue<'ctx> {
        const LIMIT: f64 = 7.905_311_107_635_498;
        const P: [f64; 7] = [
            4.893_524_558_917_86e-3,
            6.372_619_288_754_36e-4,
            1.485_722_357_179_79e-5,
            5.122_297_090_371_14e-8,
            -8.604_671_522_137_35e-11,
            2.000_187_904_824_77e-13,
            -2.760_768_477_423_55e-16,
        ];
        const Q: [f64; 4] =
            [4.893_525_185_543_85e-3, 2.268_434_632_439_00e-3, 1.185_347_056_866_54e-4, 1.198_258_394_667_02e-6];
        let b = &self.builder;
        let c = |v: f64| x.get_type().const_float(v);
        let above = b.build_float_compare(FloatPredicate::OGT, x, c(LIMIT), "above").unwrap();
        let x1 = b.build_select(above, c(LIMIT), x, "clamp").unwrap().into_float_value();
        let below = b.build_float_compare(FloatPredicate::OLT, x1, c(-LIMIT), "below").unwrap();
        let xc = b.build_select(below, c(-LIMIT), x1, "clamp").unwrap().into_float_value();
        let x2 = b.build_float_mul(xc, xc, "x2").unwrap();
        let horner = |coefficients: &[f64]| {
            let (last, rest) = coefficients.split_last().expect("coefficients");
            rest.iter().rev().fold(c(*last), |acc, &k| {
                let product = b.build_float_mul(acc, x2, "h").unwrap();
                b.build_float_add(product, c(k), "h").unwrap()
            })
        };
        let p = b.build_float_mul(horner(&P), xc, "p").unwrap();
        let ratio = b.build_float_div(p, horner(&Q), "tanh").unwrap();
        let abs = self.float_intrinsic("llvm.fabs", x);
        let tiny = b.build_float_compare(FloatPredicate::OLT, abs, c(0.0004), "tiny").unwrap();
        b.build_select(tiny, x, ratio, "tanh").unwrap().into_float_value()
    }

    /// f32 `exp(x)` as `2ⁿ · e^r`, n = ⌊x·log₂e + ½⌋ and r = x − n·ln 2 (ln 2 in two parts, so that r is
    /// exact), e^r by the degree-7 polynomial of Cephes' `expf`, and 2ⁿ as the product of two powers built from
    /// their exponent bits, neither of which overflows or is subnormal: within 1 ulp of exp for every f32 whose
    /// exp is a normal float (all were checked against f64's exp), and rounded once where it is subnormal. x is first clamped to [-104, 88.8], beyond which exp is 0 or +∞ in f32; NaN stays NaN. Multiplies,
    /// adds and bit operations vectorise, where `llvm.exp` is a call of `expf` per element on x86 (the softmax
    /// kernels' time, before).
    fn polynomial_exp(&self, x: FloatValue<'ctx>) -> FloatValue<'ctx> {
        const P: [f64; 6] = [
            1.987_569_150_0e-4,
            1.398_199_950_7e-3,
            8.333_451_907_3e-3,
            4.166_579_589_4e-2,
            1.666_666_545_9e-1,
            5.000_000_120_1e-1,
        ];
        let b = &self.builder;
        let (f32t, i32t) = (self.context.f32_type(), self.context.i32_type());
        let c = |v: f64| f32t.const_float(v);
        let call2 = |name: &str, a: FloatValue<'ctx>, v: f64| {
            let decl = Intrinsic::find(name).unwrap().get_declaration(self.llvm, &[f32t.into()]).unwrap();
            b.build_call(decl, &[a.into(), c(v).into()], "m")
                .unwrap()
                .try_as_basic_value()
                .unwrap_basic()
                .into_float_value()
        };
        // minnum/maxnum return the number where x is NaN: the clamped value is never NaN (no poison from the
        // conversion to an integer); NaN is put back at the end.
        let clamped = call2("llvm.minnum", call2("llvm.maxnum", x, -104.0), 88.8);
        let scaled = b.build_float_mul(clamped, c(std::f64::consts::LOG2_E), "s").unwrap();
        let half = b.build_float_add(scaled, c(0.5), "s").unwrap();
        let n = self.float_intrinsic("llvm.floor", half);
        let hi = b.build_float_mul(n, c(0.693_359_375), "h").unwrap();
        let lo = b.build_float_mul(n, c(-2.121_944_400_546_905_8e-4), "l").unwrap();
        let r = b.build_float_sub(b.build_float_sub(clamped, hi, "r").unwrap(), lo, "r").unwrap();
        let r2 = b.build_float_mul(r, r, "r2").unwrap();
        let (last, rest) = P.split_first().expect("coefficients");
        let poly = rest.iter().fold(c(*last), |acc, &k| {
            let product = b.build_float_mul(acc, r, "p").unwrap();
            b.build_float_add(product, c(k), "p").unwrap()
        });
        let poly = b.build_float_mul(poly, r2, "p").unwrap();
        let poly = b.build_float_add(b.build_float_add(poly, r, "p").unwrap(), c(1.0), "p").unwrap();
        // n in [-150, 128]: 2ⁿ = 2^⌊n/2⌋ · 2^(n − ⌊n/2⌋), each a normal float.
        let n = b.build_float_to_signed_int(n, i32t, "n").unwrap();
        let n1 = b.build_right_shift(n, i32t.const_int(1, false), true, "n1").unwrap();
        let n2 = b.build_int_sub(n, n1, "n2").unwrap();
        let power = |e: IntValue<'ctx>| {
            let biased = b.build_int_add(e, i32t.const_int(127, false), "e").unwrap();
            let bits = b.build_left_shift(biased, i32t.const_int(23, false), "e").unwrap();
            b.build_bit_cast(bits, f32t, "2^n").unwrap().into_float_value()
        };
        let e = b.build_float_mul(b.build_float_mul(poly, power(n1), "e").unwrap(), power(n2), "exp").unwrap();
        b.build_select(self.is_nan(x), x, e, "exp").unwrap().into_float_value()
    }

    fn is_nan(&self, x: FloatValue<'ctx>) -> IntValue<'ctx> {
        self.builder.build_float_compare(FloatPredicate::UNO, x, x, "nan").unwrap()
    }

    /// `candidate` replaces `best` as the largest (`larger`) or smallest: strictly beyond it,
    /// or NaN where `best` is not — the interpreter's `beats_max` / `beats_min`.
    fn beats(
        &self,
        candidate: BasicValueEnum<'ctx>,
        best: BasicValueEnum<'ctx>,
        dtype: DType,
        larger: bool,
    ) -> IntValue<'ctx> {
        let b = &self.builder;
        if dtype.is_float() {
            let (c, x) = (candidate.into_float_value(), best.into_float_value());
            let pred = if larger { FloatPredicate::OGT } else { FloatPredicate::OLT };
            let beyond = b.build_float_compare(pred, c, x, "gt").unwrap();
            let c_nan = self.is_nan(c);
            let x_nan = self.is_nan(x);
            let x_num = b.build_not(x_nan, "num").unwrap();
            let nan_wins = b.build_and(c_nan, x_num, "nw").unwrap();
            b.build_or(beyond, nan_wins, "beats").unwrap()
        } else {
            let signed = !matches!(dtype, DType::U8 | DType::Bool);
            let pred = match (larger, signed) {
                (true, true) => IntPredicate::SGT,
                (true, false) => IntPredicate::UGT,
                (false, true) => IntPredicate::SLT,
                (false, false) => IntPredicate::ULT,
            };
            b.build_int_compare(pred, candidate.into_int_value(), best.into_int_value(), "gt").unwrap()
        }
    }

    fn select(&self, cond: IntValue<'ctx>, a: BasicValueEnum<'ctx>, b: BasicValueEnum<'ctx>) -> BasicValueEnum<'ctx> {
        self.builder.build_select(cond, a, b, "sel").unwrap()
    }

    fn maximum(
        &self,
        a: BasicValueEnum<'ctx>,
        b: BasicValueEnum<'ctx>,
        dtype: DType,
        larger: bool,
    ) -> BasicValueEnum<'ctx> {
        let take_b = self.beats(b, a, dtype, larger);
        self.select(take_b, b, a)
    }

    /// The constant c of `cast<f32>(x) / c` with x bytes (images scaled to [0, 1]), where the reciprocal corrected by
    /// one FMA gives the division's bits for every byte (`reciprocal_divides_bytes`).
    fn byte_divisor(&self, id: NodeId) -> Option<f32> {
        let graph = &self.module.graph;
        let [x, c] = graph.inputs(id)[..] else { return None };
        let bytes = matches!(graph.node(x.node).op, Op::Cast { to: DType::F32 })
            && graph.inputs(x.node).first().is_some_and(|t| graph.ty(*t).dtype == DType::U8);
        let Op::Const { value } = &graph.node(c.node).op else { return None };
        let ConstData::F32(v) = &value.data else { return None };
        let c = *v.first()?;
        (bytes && v.iter().all(|e| e.to_bits() == c.to_bits()) && reciprocal_divides_bytes(c)).then_some(c)
    }

    /// `x / c` for x a byte's value, as `q + (x − q·c)·r` with `r` = 1/c and `q` = x·r, the remainder exact by an
    /// FMA: two FMAs and a product where a division takes a vector every 5 to 10 cycles (the logreg's 78,400 bytes
    /// took 13 µs to scale so on AVX2 and on AVX-512, `vdivps`). The caller checked the bits (`byte_divisor`).
    fn divide_byte(&self, x: FloatValue<'ctx>, c: f32) -> FloatValue<'ctx> {
        let b = &self.builder;
        let f32t = self.context.f32_type();
        let r = f32t.const_float(f64::from(1.0 / c));
        let q = b.build_float_mul(x, r, "q").unwrap();
        let minus_q = b.build_float_neg(q, "nq").unwrap();
        let remainder = self.fma(minus_q, f32t.const_float(f64::from(c)), x);
        self.fma(remainder, r, q)
    }

    /// `a·b + c`, rounded once (`llvm.fma`).
    fn fma(&self, a: FloatValue<'ctx>, b: FloatValue<'ctx>, c: FloatValue<'ctx>) -> FloatValue<'ctx> {
        let decl = Intrinsic::find("llvm.fma").unwrap().get_declaration(self.llvm, &[a.get_type().into()]).unwrap();
        self.builder
            .build_call(decl, &[a.into(), b.into(), c.into()], "fma")
            .unwrap()
            .try_as_basic_value()
            .unwrap_basic()
            .into_float_value()
    }

    fn float_binary(&self, op: BinaryOp, a: FloatValue<'ctx>, c: FloatValue<'ctx>) -> FloatValue<'ctx> {
        let b = &self.builder;
        match op {
            BinaryOp::Add => b.build_float_add(a, c, "add").unwrap(),
            BinaryOp::Sub => b.build_float_sub(a, c, "sub").unwrap(),
            BinaryOp::Mul => b.build_float_mul(a, c, "mul").unwrap(),
            BinaryOp::Div => b.build_float_div(a, c, "div").unwrap(),
            BinaryOp::Pow if self.nvptx => self.nvptx_pow(a, c),
            BinaryOp::Pow => {
                let decl =
                    Intrinsic::find("llvm.pow").unwrap().get_declaration(self.llvm, &[a.get_type().into()]).unwrap();
                b.build_call(decl, &[a.into(), c.into()], "pow")
                    .unwrap()
                    .try_as_basic_value()
                    .unwrap_basic()
                    .into_float_value()
            }
            BinaryOp::Maximum | BinaryOp::Minimum => unreachable!("handled by maximum"),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn scalar_op(
        &self,
        op: &Op,
        id: NodeId,
        args: &[BasicValueEnum<'ctx>],
        arg_types: &[DType],
        dtype: DType,
        index: &Index<'ctx>,
    ) -> BasicValueEnum<'ctx> {
        let b = &self.builder;
        match op {
            Op::Identity | Op::StopGradient | Op::BroadcastTo { .. } => args[0],
            Op::Unary(u) => self.unary(*u, args[0], dtype),
            Op::Binary(op @ (BinaryOp::Maximum | BinaryOp::Minimum)) => {
                self.maximum(args[0], args[1], dtype, *op == BinaryOp::Maximum)
            }
            Op::Binary(op) if dtype.is_float() => {
                let (x, y) = (args[0].into_float_value(), args[1].into_float_value());
                let divides = *op == BinaryOp::Div && dtype == DType::F32;
                match divides.then(|| self.byte_divisor(id)).flatten() {
                    Some(c) => self.divide_byte(x, c).into(),
                    None => self.float_binary(*op, x, y).into(),
                }
            }
            Op::Binary(op) => {
                let (x, y) = (args[0].into_int_value(), args[1].into_int_value());
                match op {
                    BinaryOp::Add => b.build_int_add(x, y, "add").unwrap().into(),
                    BinaryOp::Sub => b.build_int_sub(x, y, "sub").unwrap().into(),
                    BinaryOp::Mul => b.build_int_mul(x, y, "mul").unwrap().into(),
                    _ => unreachable!("fuse leaves integer div and pow to the library"),
                }
            }
            Op::Compare(c) => self.compare(*c, args[0], args[1], arg_types[0]).into(),
            Op::Select => self.select(args[0].into_int_value(), args[1], args[2]),
            Op::RandomUniform { salt, .. } => {
                let e = self.offset(&self.nest.positions[&TensorRef::from(id)], index);
                self.philox_uniform(args[0].into_int_value(), args[1].into_int_value(), *salt, e).into()
            }
            Op::RandomNormal { salt, .. } => {
                let e = self.offset(&self.nest.positions[&TensorRef::from(id)], index);
                self.philox_normal(args[0].into_int_value(), args[1].into_int_value(), *salt, e).into()
            }
            Op::Cast { to } => self.cast(args[0], arg_types[0], *to),
            Op::OneHot { dtype: to, .. } => {
                let class = match self.nest.one_hot_dim.get(&id).copied().flatten() {
                    Some(l) => index[l],
                    None => self.i64(0),
                };
                let idx = args[0].into_int_value();
                let wide = if arg_types[0] == DType::U8 {
                    b.build_int_z_extend(idx, self.context.i64_type(), "w").unwrap()
                } else {
                    b.build_int_s_extend_or_bit_cast(idx, self.context.i64_type(), "w").unwrap()
                };
                let hit = b.build_int_compare(IntPredicate::EQ, wide, class, "hit").unwrap();
                self.select(hit, self.constant(*to, 1.0), self.constant(*to, 0.0))
            }
            Op::SigmoidCrossEntropy => {
                // max(x, 0) - x * z + ln(1 + exp(-|x|))
                let (x, z) = (args[0].into_float_value(), args[1].into_float_value());
                let zero = self.constant(dtype, 0.0);
                let relu = self.maximum(x.into(), zero, dtype, true).into_float_value();
                let xz = b.build_float_mul(x, z, "xz").unwrap();
                let abs = self.float_intrinsic("llvm.fabs", x);
                let neg = b.build_float_neg(abs, "n").unwrap();
                let e = self.float_intrinsic("llvm.exp", neg);
                let l = self.libm("log1pf", "log1p", e);
                let d = b.build_float_sub(relu, xz, "d").unwrap();
                b.build_float_add(d, l, "sce").unwrap().into()
            }
            other => unreachable!("`{}` is not fused", other.name()),
        }
    }

    fn unary(&self, op: UnaryOp, x: BasicValueEnum<'ctx>, dtype: DType) -> BasicValueEnum<'ctx> {
        let b = &self.builder;
        if !dtype.is_float() {
            let v = x.into_int_value();
            let zero = v.get_type().const_zero();
            return match op {
                UnaryOp::Neg => b.build_int_sub(zero, v, "neg").unwrap().into(),
                UnaryOp::Abs if dtype == DType::U8 => v.into(),
                UnaryOp::Abs => {
                    let negative = b.build_int_compare(IntPredicate::SLT, v, zero, "lt").unwrap();
                    let neg = b.build_int_sub(zero, v, "neg").unwrap();
                    self.select(negative, neg.into(), v.into())
                }
                UnaryOp::Relu => self.maximum(x, zero.into(), dtype, true),
                _ => unreachable!("fuse keeps transcendentals to floats"),
            };
        }
        let v = x.into_float_value();
        let one = self.constant(dtype, 1.0).into_float_value();
        match op {
            UnaryOp::Neg => b.build_float_neg(v, "neg").unwrap().into(),
            UnaryOp::Abs => self.float_intrinsic("llvm.fabs", v).into(),
            UnaryOp::Exp => self.float_intrinsic("llvm.exp", v).into(),
            UnaryOp::Log => self.float_intrinsic("llvm.log", v).into(),
            UnaryOp::Sqrt => self.float_intrinsic("llvm.sqrt", v).into(),
            UnaryOp::Rsqrt => {
                let s = self.float_intrinsic("llvm.sqrt", v);
                b.build_float_div(one, s, "rsqrt").unwrap().into()
            }
            UnaryOp::Relu => self.maximum(x, self.constant(dtype, 0.0), dtype, true),
            UnaryOp::Tanh if dtype == DType::F32 && !self.nvptx => self.rational_tanh(v).into(),
            UnaryOp::Tanh => self.libm("tanhf", "tanh", v).into(),
            UnaryOp::Sigmoid => {
                // x >= 0: 1 / (1 + exp(-x)); else e / (1 + e) with e = exp(x), as the interpreter.
                let zero = self.constant(dtype, 0.0).into_float_value();
                let non_negative = b.build_float_compare(FloatPredicate::OGE, v, zero, "ge").unwrap();
                let neg = b.build_float_neg(v, "n").unwrap();
                let e_neg = self.float_intrinsic("llvm.exp", neg);
                let d1 = b.build_float_add(one, e_neg, "d").unwrap();
                let pos = b.build_float_div(one, d1, "p").unwrap();
                let e = self.float_intrinsic("llvm.exp", v);
                let d2 = b.build_float_add(one, e, "d").unwrap();
                let negv = b.build_float_div(e, d2, "q").unwrap();
                self.select(non_negative, pos.into(), negv.into())
            }
        }
    }

    fn compare(&self, op: CompareOp, x: BasicValueEnum<'ctx>, y: BasicValueEnum<'ctx>, dtype: DType) -> IntValue<'ctx> {
        let b = &self.builder;
        if dtype.is_float() {
            let pred = match op {
                CompareOp::Equal => FloatPredicate::OEQ,
                CompareOp::NotEqual => FloatPredicate::UNE,
                CompareOp::Less => FloatPredicate::OLT,
                CompareOp::LessEqual => FloatPredicate::OLE,
                CompareOp::Greater => FloatPredicate::OGT,
                CompareOp::GreaterEqual => FloatPredicate::OGE,
            };
            return b.build_float_compare(pred, x.into_float_value(), y.into_float_value(), "cmp").unwrap();
        }
        let signed = !matches!(dtype, DType::U8 | DType::Bool);
        let pred = match (op, signed) {
            (CompareOp::Equal, _) => IntPredicate::EQ,
            (CompareOp::NotEqual, _) => IntPredicate::NE,
            (CompareOp::Less, true) => IntPredicate::SLT,
            (CompareOp::Less, false) => IntPredicate::ULT,
            (CompareOp::LessEqual, true) => IntPredicate::SLE,
            (CompareOp::LessEqual, false) => IntPredicate::ULE,
            (CompareOp::Greater, true) => IntPredicate::SGT,
            (CompareOp::Greater, false) => IntPredicate::UGT,
            (CompareOp::GreaterEqual, true) => IntPredicate::SGE,
            (CompareOp::GreaterEqual, false) => IntPredicate::UGE,
        };
        b.build_int_compare(pred, x.into_int_value(), y.into_int_value(), "cmp").unwrap()
    }

    /// Rust's `as`: float → int saturates (NaN → 0); to bool is `!= 0`.
    fn cast(&self, x: BasicValueEnum<'ctx>, from: DType, to: DType) -> BasicValueEnum<'ctx> {
        let b = &self.builder;
        let target = memory_type(self.context, to);
        if from == to {
            return x;
        }
        if to == DType::Bool {
            let zero = self.constant(from, 0.0);
            return self.compare(CompareOp::NotEqual, x, zero, from).into();
        }
        let from_unsigned = matches!(from, DType::U8 | DType::Bool);
        match (from.is_float(), to.is_float()) {
            (true, true) => b.build_float_cast(x.into_float_value(), target.into_float_type(), "fc").unwrap().into(),
            (false, true) => {
                let v = x.into_int_value();
                if from_unsigned {
                    b.build_unsigned_int_to_float(v, target.into_float_type(), "uf").unwrap().into()
                } else {
                    b.build_signed_int_to_float(v, target.into_float_type(), "sf").unwrap().into()
                }
            }
            (true, false) => {
                let name = if to == DType::U8 { "llvm.fptoui.sat" } else { "llvm.fptosi.sat" };
                let decl = Intrinsic::find(name).unwrap().get_declaration(self.llvm, &[target, x.get_type()]).unwrap();
                b.build_call(decl, &[x.into()], "sat").unwrap().try_as_basic_value().unwrap_basic()
            }
            (false, false) => {
                let v = x.into_int_value();
                let t = target.into_int_type();
                let from_bits = v.get_type().get_bit_width();
                if from_bits > t.get_bit_width() {
                    b.build_int_truncate(v, t, "tr").unwrap().into()
                } else if from_unsigned {
                    b.build_int_z_extend(v, t, "zx").unwrap().into()
                } else {
                    b.build_int_s_extend(v, t, "sx").unwrap().into()
                }
            }
        }
    }

    fn emit_loop(&self, begin: IntValue<'ctx>, end: IntValue<'ctx>, dtype: DType) {
        let root = TensorRef::from(self.kernel.root);
        let n = self.nest.extents.len();
        self.emit_nest(&mut Vec::new(), 0..n, Some((begin, end)), &mut |index| {
            let mut memo = HashMap::new();
            let v = self.value(root, index, &mut memo);
            let offset = self.offset(&self.nest.out, index);
            self.store(self.element(self.out.unwrap(), offset), dtype, v);
        });
    }

    fn emit_assign(&self, begin: IntValue<'ctx>, end: IntValue<'ctx>, op: &Op, dtype: DType) {
        let graph = &self.module.graph;
        let operands = graph.inputs(self.kernel.root);
        let (variable, value) = (operands[0], operands[1]);
        let n = self.nest.extents.len();
        self.emit_nest(&mut Vec::new(), 0..n, Some((begin, end)), &mut |index| {
            let mut memo = HashMap::new();
            let v = self.value(value, index, &mut memo);
            let offset = self.offset(&self.nest.out, index);
            let target = self.element(self.out.unwrap(), offset);
            let new = match op {
                Op::Assign => v,
                Op::AssignAdd | Op::AssignSub => {
                    let current = self.value(variable, index, &mut memo);
                    let kind = if matches!(op, Op::AssignAdd) { BinaryOp::Add } else { BinaryOp::Sub };
                    self.scalar_op(&Op::Binary(kind), self.kernel.root, &[current, v], &[dtype, dtype], dtype, index)
                }
                _ => unreachable!(),
            };
            self.store(target, dtype, new);
        });
    }

    fn emit_reduce(&self, begin: IntValue<'ctx>, end: IntValue<'ctx>, kind: ReduceKind, dtype: DType) {
        let b = &self.builder;
        let graph = &self.module.graph;
        let operand = graph.inputs(self.kernel.root)[0];
        let out = self.out.unwrap();
        // The outputs this range writes: its rows if the first dimension is kept, else all.
        let out_len: u64 =
            self.nest.extents.iter().zip(&self.nest.reduced).filter(|(_, r)| !**r).map(|(e, _)| e).product();
        let (lo, hi) = if self.nest.reduced[0] {
            (self.i64(0), self.i64(out_len as i64))
        } else {
            // A row's outputs, whose count is the first dimension's stride; a scalar's one
            // output has stride 0 (with 0 here no output was initialised, and a scalar's sum
            // added to the last run's).
            let row = self.nest.out[0].max(1);
            (b.build_int_mul(begin, self.i64(row), "lo").unwrap(), b.build_int_mul(end, self.i64(row), "hi").unwrap())
        };
        let identity = match kind {
            ReduceKind::Sum | ReduceKind::Mean => self.constant(dtype, 0.0),
            ReduceKind::Max => self.extreme(dtype, false),
            ReduceKind::Min => self.extreme(dtype, true),
        };
        self.emit_for(lo, hi, &mut |i| self.store(self.element(out, i), dtype, identity));
        let combine = |acc, v| self.combine(kind, dtype, acc, v);
        let n = self.nest.extents.len();
        let inner_reduced = self.nest.reduced[n - 1] && n >= 1;
        if inner_reduced && n >= 2 {
            // Accumulate the innermost (reduced) run in a register.
            self.emit_nest(&mut Vec::new(), 0..n - 1, Some((begin, end)), &mut |prefix| {
                let mut index = prefix.clone();
                let out_at = self.element(out, self.offset(&self.nest.out[..n - 1], prefix));
                let start = self.load(out_at, dtype);
                let acc = self.fold(start, self.nest.extents[n - 1], &mut |j, acc| {
                    index.push(j);
                    let mut memo = HashMap::new();
                    let v = self.value(operand, &index, &mut memo);
                    index.pop();
                    combine(acc, v)
                });
                self.store(out_at, dtype, acc);
            });
        } else {
            self.emit_nest(&mut Vec::new(), 0..n, Some((begin, end)), &mut |index| {
                let mut memo = HashMap::new();
                let v = self.value(operand, index, &mut memo);
                let at = self.element(out, self.offset(&self.nest.out, index));
                let acc = self.load(at, dtype);
                self.store(at, dtype, combine(acc, v));
            });
        }
        if kind == ReduceKind::Mean && !self.partial {
            let count: u64 =
                self.nest.extents.iter().zip(&self.nest.reduced).filter(|(_, r)| **r).map(|(e, _)| e).product();
            let c = self.constant(dtype, count as f64).into_float_value();
            self.emit_for(lo, hi, &mut |i| {
                let at = self.element(out, i);
                let sum = self.load(at, dtype).into_float_value();
                let mean = self.builder.build_float_div(sum, c, "mean").unwrap();
                self.store(at, dtype, mean.into());
            });
        }
    }

    /// Philox-4x32-10 block `block` of the stream of (`seed` ^ `salt`, `step`), as the
    /// interpreter's `random::philox4x32_10` computes it: four 32-bit words.
    fn philox_block(
        &self,
        seed: IntValue<'ctx>,
        step: IntValue<'ctx>,
        salt: u64,
        block: IntValue<'ctx>,
    ) -> [IntValue<'ctx>; 4] {
        let b = &self.builder;
        let (i32t, i64t) = (self.context.i32_type(), self.context.i64_type());
        let low = |v: IntValue<'ctx>| b.build_int_truncate(v, i32t, "lo").unwrap();
        let high = |v: IntValue<'ctx>| low(b.build_right_shift(v, i64t.const_int(32, false), false, "hi").unwrap());
        let key = b.build_xor(seed, i64t.const_int(salt, false), "key").unwrap();
        let mut c = [low(block), high(block), low(step), high(step)];
        let mut k = [low(key), high(key)];
        let c32 = |v: u32| i32t.const_int(u64::from(v), false);
        let mulhilo = |m: u32, x: IntValue<'ctx>| {
            let wide = b.build_int_z_extend(x, i64t, "x").unwrap();
            let product = b.build_int_mul(wide, i64t.const_int(u64::from(m), false), "p").unwrap();
            (high(product), low(product))
        };
        for round in 0..10 {
            if round > 0 {
                k = [
                    b.build_int_add(k[0], c32(0x9E37_79B9), "k0").unwrap(),
                    b.build_int_add(k[1], c32(0xBB67_AE85), "k1").unwrap(),
                ];
            }
            let (hi0, lo0) = mulhilo(0xD251_1F53, c[0]);
            let (hi1, lo1) = mulhilo(0xCD9E_8D57, c[2]);
            let x0 = b.build_xor(b.build_xor(hi1, c[1], "x").unwrap(), k[0], "c0").unwrap();
            let x2 = b.build_xor(b.build_xor(hi0, c[3], "x").unwrap(), k[1], "c2").unwrap();
            c = [x0, lo1, x2, lo0];
        }
        c
    }

    /// The top 24 bits of a Philox word over 2^24: an f32 in [0, 1), exact.
    fn unit_float(&self, word: IntValue<'ctx>) -> FloatValue<'ctx> {
        let b = &self.builder;
        let top = b.build_right_shift(word, self.context.i32_type().const_int(8, false), false, "top").unwrap();
        let f32t = self.context.f32_type();
        let as_float = b.build_unsigned_int_to_float(top, f32t, "u").unwrap();
        b.build_float_mul(as_float, f32t.const_float(1.0 / (1u32 << 24) as f64), "unit").unwrap()
    }

    /// Element `e` of a `random_uniform`: word `e % 4` of block `e / 4`, as the interpreter's
    /// `random::uniform_at`.
    fn philox_uniform(
        &self,
        seed: IntValue<'ctx>,
        step: IntValue<'ctx>,
        salt: u64,
        e: IntValue<'ctx>,
    ) -> FloatValue<'ctx> {
        let b = &self.builder;
        let (i32t, i64t) = (self.context.i32_type(), self.context.i64_type());
        let block = b.build_right_shift(e, i64t.const_int(2, false), false, "block").unwrap();
        let c = self.philox_block(seed, step, salt, block);
        let c32 = |v: u32| i32t.const_int(u64::from(v), false);
        let lane = b.build_int_truncate(b.build_and(e, i64t.const_int(3, false), "lane").unwrap(), i32t, "l").unwrap();
        let pick = |i: u32| b.build_int_compare(IntPredicate::EQ, lane, c32(i), "w").unwrap();
        let upper = b.build_select(pick(2), c[2], c[3], "w23").unwrap().into_int_value();
        let lower = b.build_select(pick(0), c[0], c[1], "w01").unwrap().into_int_value();
        let below_two = b.build_int_compare(IntPredicate::ULT, lane, c32(2), "lt2").unwrap();
        let word = b.build_select(below_two, lower, upper, "word").unwrap().into_int_value();
        self.unit_float(word)
    }

    /// Element `e` of a `random_normal`: Box-Muller on words `2(e % 2)`, `2(e % 2) + 1` of block
    /// `e / 2`, `sqrt(-2 ln u1) · cos(2π u2 − π)`, as the interpreter's `random::normal_at`.
    fn philox_normal(
        &self,
        seed: IntValue<'ctx>,
        step: IntValue<'ctx>,
        salt: u64,
        e: IntValue<'ctx>,
    ) -> FloatValue<'ctx> {
        let b = &self.builder;
        let i64t = self.context.i64_type();
        let block = b.build_right_shift(e, i64t.const_int(1, false), false, "block").unwrap();
        let c = self.philox_block(seed, step, salt, block);
        let odd = b
            .build_int_compare(
                IntPredicate::NE,
                b.build_and(e, i64t.const_int(1, false), "odd").unwrap(),
                i64t.const_zero(),
                "o",
            )
            .unwrap();
        let first = b.build_select(odd, c[2], c[0], "w0").unwrap().into_int_value();
        let second = b.build_select(odd, c[3], c[1], "w1").unwrap().into_int_value();
        let f32t = self.context.f32_type();
        let u1 = b.build_float_sub(f32t.const_float(1.0), self.unit_float(first), "u1").unwrap();
        let u2 = self.unit_float(second);
        let log = self.float_intrinsic("llvm.log", u1);
        let radius = self.float_intrinsic("llvm.sqrt", b.build_float_mul(f32t.const_float(-2.0), log, "m2l").unwrap());
        let turn = b.build_float_mul(u2, f32t.const_float(std::f64::consts::TAU), "turn").unwrap();
        let angle = b.build_float_sub(turn, f32t.const_float(std::f64::consts::PI), "angle").unwrap();
        b.build_float_mul(radius, self.libm("cosf", "cos", angle), "normal").unwrap()
    }

    /// `combine(acc, v)` of a reduction of `kind` over `dtype`.
    fn combine(
        &self,
        kind: ReduceKind,
        dtype: DType,
        acc: BasicValueEnum<'ctx>,
        v: BasicValueEnum<'ctx>,
    ) -> BasicValueEnum<'ctx> {
        match kind {
            ReduceKind::Sum | ReduceKind::Mean => self.scalar_op(
                &Op::Binary(BinaryOp::Add),
                self.kernel.root,
                &[acc, v],
                &[dtype, dtype],
                dtype,
                &Vec::new(),
            ),
            ReduceKind::Max => self.maximum(acc, v, dtype, true),
            ReduceKind::Min => self.maximum(acc, v, dtype, false),
        }
    }

    /// The body of `emit_tree_combine`'s function: its parameters are (args, count, thread,
    /// shared, phase).
    fn emit_tree_phase(&self, kind: ReduceKind, dtype: DType, block: u64) {
        let b = &self.builder;
        let param = |i: u32| self.function.get_nth_param(i).unwrap();
        let args = param(0).into_pointer_value();
        let count = param(1).into_int_value();
        let thread = param(2).into_int_value();
        let phase = param(4).into_int_value();
        let out_len: u64 =
            self.nest.extents.iter().zip(&self.nest.reduced).filter(|(_, r)| !**r).map(|(e, _)| e).product();
        let reduced: u64 =
            self.nest.extents.iter().zip(&self.nest.reduced).filter(|(_, r)| **r).map(|(e, _)| e).product();
        let partials = self.arg_pointer(args, 0, dtype);
        let out = self.arg_pointer(args, 1, dtype);
        let element_type = memory_type(self.context, dtype);
        let shared = b
            .build_pointer_cast(param(3).into_pointer_value(), element_type.ptr_type(AddressSpace::default()), "s")
            .unwrap();
        // On a GPU the tree is in the block's shared memory: `ld.shared`/`st.shared`.
        let shared = if self.nvptx {
            b.build_address_space_cast(
                shared,
                element_type.ptr_type(AddressSpace::from(SHARED_ADDRESS_SPACE)),
                "shared",
            )
            .unwrap()
        } else {
            shared
        };
        let size = self.i64(block as i64);
        let width = self.i64(out_len as i64);
        let tid = b.build_int_unsigned_rem(thread, size, "tid").unwrap();
        let own_block = b.build_int_unsigned_div(thread, size, "block").unwrap();
        let group = b.build_int_unsigned_div(own_block, width, "g").unwrap();
        let element = b.build_int_unsigned_rem(own_block, width, "o").unwrap();
        let first = b.build_int_mul(group, size, "first").unwrap();
        let groups = b
            .build_int_unsigned_div(b.build_int_add(count, self.i64(block as i64 - 1), "c").unwrap(), size, "groups")
            .unwrap();
        let work = self.context.append_basic_block(self.function, "work");
        let done = self.context.append_basic_block(self.function, "done");
        let inside = b.build_int_compare(IntPredicate::ULT, group, groups, "inside").unwrap();
        b.build_conditional_branch(inside, work, done).unwrap();
        b.position_at_end(work);
        // The group's partials: `block`, or fewer in the last group.
        let left = b.build_int_sub(count, first, "left").unwrap();
        let fewer = b.build_int_compare(IntPredicate::ULT, left, size, "fewer").unwrap();
        let valid = b.build_select(fewer, left, size, "valid").unwrap().into_int_value();
        let last_phase = block.trailing_zeros();
        let phases: Vec<BasicBlock<'ctx>> =
            (0..=last_phase).map(|k| self.context.append_basic_block(self.function, &format!("phase{k}"))).collect();
        let i32t = self.context.i32_type();
        let cases: Vec<_> = phases.iter().enumerate().map(|(k, &at)| (i32t.const_int(k as u64, false), at)).collect();
        b.build_switch(phase, done, &cases).unwrap();
        // Runs `body` where `condition` holds, then goes on.
        let when = |condition: IntValue<'ctx>, body: &dyn Fn()| {
            let then = self.context.append_basic_block(self.function, "then");
            let next = self.context.append_basic_block(self.function, "next");
            self.builder.build_conditional_branch(condition, then, next).unwrap();
            self.builder.position_at_end(then);
            body();
            self.builder.build_unconditional_branch(next).unwrap();
            self.builder.position_at_end(next);
        };
        for (k, &at) in phases.iter().enumerate() {
            let b = &self.builder;
            b.position_at_end(at);
            if k == 0 {
                let own = b.build_int_compare(IntPredicate::ULT, tid, valid, "own").unwrap();
                when(own, &|| {
                    let b = &self.builder;
                    let partial = b.build_int_add(first, tid, "p").unwrap();
                    let index = b.build_int_add(b.build_int_mul(partial, width, "r").unwrap(), element, "i").unwrap();
                    let value = self.load(self.element(partials, index), dtype);
                    self.store(self.element(shared, tid), dtype, value);
                });
            } else {
                let stride = self.i64((block >> k) as i64);
                let lower = b.build_int_compare(IntPredicate::ULT, tid, stride, "lower").unwrap();
                let partner = b.build_int_add(tid, stride, "partner").unwrap();
                let present = b.build_int_compare(IntPredicate::ULT, partner, valid, "present").unwrap();
                when(b.build_and(lower, present, "fold").unwrap(), &|| {
                    let mine = self.load(self.element(shared, tid), dtype);
                    let theirs = self.load(self.element(shared, partner), dtype);
                    self.store(self.element(shared, tid), dtype, self.combine(kind, dtype, mine, theirs));
                });
            }
            if k as u32 == last_phase {
                let b = &self.builder;
                let writer = b.build_int_compare(IntPredicate::EQ, tid, self.i64(0), "writer").unwrap();
                when(writer, &|| {
                    let b = &self.builder;
                    let mut folded = self.load(self.element(shared, self.i64(0)), dtype);
                    if kind == ReduceKind::Mean {
                        // The last pass (one group left) finishes the mean.
                        let divided = b
                            .build_float_div(
                                folded.into_float_value(),
                                self.constant(dtype, reduced as f64).into_float_value(),
                                "mean",
                            )
                            .unwrap();
                        let last_pass = b.build_int_compare(IntPredicate::ULE, count, size, "final").unwrap();
                        folded = b.build_select(last_pass, BasicValueEnum::from(divided), folded, "v").unwrap();
                    }
                    let target = b.build_int_add(b.build_int_mul(group, width, "gw").unwrap(), element, "t").unwrap();
                    self.store(self.element(out, target), dtype, folded);
                });
            }
            self.builder.build_unconditional_branch(done).unwrap();
        }
        self.builder.position_at_end(done);
    }

    /// The largest (`highest`) or smallest value of `dtype`: -inf/+inf for floats.
    fn extreme(&self, dtype: DType, highest: bool) -> BasicValueEnum<'ctx> {
        match dtype {
            DType::F32 | DType::F64 => self.constant(dtype, if highest { f64::INFINITY } else { f64::NEG_INFINITY }),
            DType::I32 => self
                .context
                .i32_type()
                .const_int(if highest { i32::MAX as u64 } else { i32::MIN as i64 as u64 }, true)
                .into(),
            DType::I64 => {
                self.context.i64_type().const_int(if highest { i64::MAX as u64 } else { i64::MIN as u64 }, true).into()
            }
            DType::U8 => self.context.i8_type().const_int(if highest { 255 } else { 0 }, false).into(),
            DType::Bool => self.context.bool_type().const_int(highest as u64, false).into(),
        }
    }

    /// `acc = start; for j in 0..count { acc = step(j, acc) }`, in a register.
    fn fold(
        &self,
        start: BasicValueEnum<'ctx>,
        count: u64,
        step: &mut dyn FnMut(IntValue<'ctx>, BasicValueEnum<'ctx>) -> BasicValueEnum<'ctx>,
    ) -> BasicValueEnum<'ctx> {
        if count <= UNROLLED_MAX {
            return (0..count as i64).fold(start, |acc, j| step(self.i64(j), acc));
        }
        self.fold_between(start, self.i64(0), self.i64(count as i64), step)
    }

    /// `acc = start; for j in from..end { acc = step(j, acc) }`, in a register.
    fn fold_between(
        &self,
        start: BasicValueEnum<'ctx>,
        from: IntValue<'ctx>,
        end: IntValue<'ctx>,
        step: &mut dyn FnMut(IntValue<'ctx>, BasicValueEnum<'ctx>) -> BasicValueEnum<'ctx>,
    ) -> BasicValueEnum<'ctx> {
        self.fold_strided(start, from, end, 1, step)
    }

    /// The body of `emit_block_row`'s function: its parameters are (args, rows, thread,
    /// shared, phase). Returns the phases.
    fn emit_row_phases(&self, op: RowOp, dtype: DType, block: u64) -> u32 {
        let b = &self.builder;
        let param = |i: u32| self.function.get_nth_param(i).unwrap();
        let count = param(1).into_int_value();
        let thread = param(2).into_int_value();
        let phase = param(4).into_int_value();
        let graph = &self.module.graph;
        let operands = graph.inputs(self.kernel.root);
        let x_type = graph.ty(operands[0]).dtype;
        let n = self.nest.extents.len();
        let classes = self.nest.extents[n - 1];
        let lead = n - 1;
        let size = self.i64(block as i64);
        let tid = b.build_int_unsigned_rem(thread, size, "tid").unwrap();
        let row = b.build_int_unsigned_div(thread, size, "row").unwrap();
        // The shared regions: maxima, sums (the row's type), then 8 bytes a thread.
        let x_bytes = x_type.size_in_bytes() as u64;
        let region = |offset: u64, ty: BasicTypeEnum<'ctx>| {
            let raw = param(3).into_pointer_value();
            // SAFETY: (of the generated code) `offset` is within the block's shared memory
            // (`BlockRow::shared_bytes`: two regions of `block` elements, then `block` × 8).
            let at = unsafe { self.builder.build_gep(raw, &[self.i64(offset as i64)], "region").unwrap() };
            let typed = self.builder.build_pointer_cast(at, ty.ptr_type(AddressSpace::default()), "r").unwrap();
            if self.nvptx {
                let shared = ty.ptr_type(AddressSpace::from(SHARED_ADDRESS_SPACE));
                self.builder.build_address_space_cast(typed, shared, "shared").unwrap()
            } else {
                typed
            }
        };
        let x_memory = memory_type(self.context, x_type);
        let maxima = region(0, x_memory);
        let sums = region(block * x_bytes, x_memory);
        let extra_type = if op == RowOp::ArgMax { self.context.i64_type().into() } else { x_memory };
        let extra = region(2 * block * x_bytes, extra_type);
        // Only a layer norm's gradient has it (`block_row_shared_bytes`).
        let fourth = region(2 * block * x_bytes + 8 * block, x_memory);
        let work = self.context.append_basic_block(self.function, "work");
        let done = self.context.append_basic_block(self.function, "done");
        let inside = b.build_int_compare(IntPredicate::ULT, row, count, "inside").unwrap();
        b.build_conditional_branch(inside, work, done).unwrap();
        b.position_at_end(work);
        // The row's index over the leading dimensions.
        let mut prefix: Index<'ctx> = Vec::with_capacity(lead);
        let mut inner: u64 = self.nest.extents[..lead].iter().product();
        for d in 0..lead {
            inner /= self.nest.extents[d].max(1);
            let q = b.build_int_unsigned_div(row, self.i64(inner.max(1) as i64), "q").unwrap();
            prefix.push(b.build_int_unsigned_rem(q, self.i64(self.nest.extents[d] as i64), "d").unwrap());
        }
        let steps = block.trailing_zeros();
        let trees = match op {
            RowOp::ArgMax => 1,
            RowOp::Softmax | RowOp::LogSoftmax | RowOp::LayerNorm { .. } => 2,
            RowOp::CrossEntropy | RowOp::LayerNormGrad { .. } => 3,
        };
        let phases = trees * (steps + 1) + u32::from(op.maps_rows());
        let blocks: Vec<BasicBlock<'ctx>> =
            (0..phases).map(|k| self.context.append_basic_block(self.function, &format!("phase{k}"))).collect();
        let first_thread = b.build_int_compare(IntPredicate::EQ, tid, self.i64(0), "first").unwrap();
        let i32t = self.context.i32_type();
        let cases: Vec<_> = blocks.iter().enumerate().map(|(k, &at)| (i32t.const_int(k as u64, false), at)).collect();
        b.build_switch(phase, done, &cases).unwrap();
        let at = |j: IntValue<'ctx>, which: usize| {
            let mut index = prefix.clone();
            index.push(j);
            self.value(operands[which], &index, &mut HashMap::new())
        };
        let get = |region: PointerValue<'ctx>, i: IntValue<'ctx>, ty: DType| self.load(self.element(region, i), ty);
        let put =
            |region: PointerValue<'ctx>, i: IntValue<'ctx>, ty: DType, v| self.store(self.element(region, i), ty, v);
        // The thread's elements of the row: `tid, tid + block, …`, folded into `acc`.
        let slice =
            |start: BasicValueEnum<'ctx>,
             step: &mut dyn FnMut(IntValue<'ctx>, BasicValueEnum<'ctx>) -> BasicValueEnum<'ctx>| {
                self.fold_strided(start, tid, self.i64(classes as i64), block, step)
            };
        // Step `k` (1-based) of a tree over `region`: the lower `block >> k` threads fold in the
        // element `block >> k` above their own.
        let tree_step = |k: u32, fold: &dyn Fn(IntValue<'ctx>, IntValue<'ctx>)| {
            let stride = self.i64((block >> k) as i64);
            let lower = self.builder.build_int_compare(IntPredicate::ULT, tid, stride, "lower").unwrap();
            self.when(lower, &|| fold(tid, self.builder.build_int_add(tid, stride, "partner").unwrap()));
        };
        let zero = self.constant(x_type, 0.0);
        let row_out = |j: IntValue<'ctx>| {
            let mut full = prefix.clone();
            full.push(j);
            self.element(self.out.unwrap(), self.offset(&self.nest.out, &full))
        };
        let row_scalar = || self.element(self.out.unwrap(), self.offset(&self.nest.out[..lead], &prefix));
        let sum_tree = |region: PointerValue<'ctx>, k: u32| {
            tree_step(k, &|mine, theirs| {
                let total =
                    self.combine(ReduceKind::Sum, x_type, get(region, mine, x_type), get(region, theirs, x_type));
                put(region, mine, x_type, total);
            })
        };
        let mut phase_at = 0;
        let mut next_phase = |body: &mut dyn FnMut()| {
            self.builder.position_at_end(blocks[phase_at]);
            body();
            self.builder.build_unconditional_branch(done).unwrap();
            phase_at += 1;
        };
        if op == RowOp::ArgMax {
            // Pairs (value, index): the larger value, the smaller index on ties (the first
            // largest, the first NaN), whichever thread's slice holds it.
            next_phase(&mut || {
                let lowest = self.extreme(x_type, false);
                let (value, index) = self.fold_pair_strided(lowest, tid, classes, block, &mut |j| at(j, 0), x_type);
                put(maxima, tid, x_type, value);
                self.builder.build_store(self.element(extra, tid), index).unwrap();
            });
            for k in 1..=steps {
                next_phase(&mut || {
                    tree_step(k, &|mine, theirs| {
                        let b = &self.builder;
                        let (va, vb) = (get(maxima, mine, x_type), get(maxima, theirs, x_type));
                        let ia = b.build_load(self.element(extra, mine), "ia").unwrap().into_int_value();
                        let ib = b.build_load(self.element(extra, theirs), "ib").unwrap().into_int_value();
                        let beyond = self.beats(vb, va, x_type, true);
                        let behind = self.beats(va, vb, x_type, true);
                        let earlier = b.build_int_compare(IntPredicate::ULT, ib, ia, "earlier").unwrap();
                        let tie = b.build_and(b.build_not(behind, "nb").unwrap(), earlier, "tie").unwrap();
                        let wins = b.build_or(beyond, tie, "wins").unwrap();
                        put(maxima, mine, x_type, self.select(wins, vb, va));
                        let index = self.select(wins, ib.into(), ia.into());
                        b.build_store(self.element(extra, mine), index).unwrap();
                    });
                    if k == steps {
                        self.when(first_thread, &|| {
                            let b = &self.builder;
                            let index = b.build_load(self.element(extra, self.i64(0)), "i").unwrap().into_int_value();
                            let index = if dtype == DType::I32 {
                                b.build_int_truncate(index, self.context.i32_type(), "i").unwrap().into()
                            } else {
                                index.into()
                            };
                            self.store(row_scalar(), dtype, index);
                        });
                    }
                });
            }
            self.builder.position_at_end(done);
            return phases;
        }
        if let RowOp::LayerNorm { epsilon } | RowOp::LayerNormGrad { epsilon } = op {
            let n = self.constant(x_type, classes as f64).into_float_value();
            let add = |a: BasicValueEnum<'ctx>, v: FloatValue<'ctx>| -> BasicValueEnum<'ctx> {
                self.builder.build_float_add(a.into_float_value(), v, "s").unwrap().into()
            };
            // The row's mean: Σ x, then a tree; the mean is `means[0] / n`.
            let means = maxima;
            next_phase(&mut || {
                let sum = slice(zero, &mut |j, s| add(s, at(j, 0).into_float_value()));
                put(means, tid, x_type, sum);
            });
            for k in 1..=steps {
                next_phase(&mut || sum_tree(means, k));
            }
            let centred = |j: IntValue<'ctx>| {
                let mean = self.builder.build_float_div(get(means, self.i64(0), x_type).into_float_value(), n, "m");
                self.builder.build_float_sub(at(j, 0).into_float_value(), mean.unwrap(), "c").unwrap()
            };
            // Σ (x - mean)², then a tree.
            next_phase(&mut || {
                let squares = slice(zero, &mut |j, s| {
                    let c = centred(j);
                    add(s, self.builder.build_float_mul(c, c, "c2").unwrap())
                });
                put(sums, tid, x_type, squares);
            });
            for k in 1..=steps {
                next_phase(&mut || sum_tree(sums, k));
            }
            let normalised = |j: IntValue<'ctx>| {
                let squares = get(sums, self.i64(0), x_type).into_float_value();
                let r = self.reciprocal_deviation(squares, n, epsilon, x_type);
                self.builder.build_float_mul(centred(j), r, "xh").unwrap()
            };
            if matches!(op, RowOp::LayerNorm { .. }) {
                next_phase(&mut || {
                    slice(zero, &mut |j, s| {
                        self.store(row_out(j), dtype, normalised(j).into());
                        s
                    });
                });
            } else {
                // Σ g and Σ g·x̂ side by side, then the rows of r · (g - mean(g) - x̂ · mean(g·x̂)).
                next_phase(&mut || {
                    let g_sum = slice(zero, &mut |j, s| add(s, at(j, 1).into_float_value()));
                    put(extra, tid, x_type, g_sum);
                    let gx_sum = slice(zero, &mut |j, s| {
                        add(s, self.builder.build_float_mul(at(j, 1).into_float_value(), normalised(j), "gx").unwrap())
                    });
                    put(fourth, tid, x_type, gx_sum);
                });
                for k in 1..=steps {
                    next_phase(&mut || {
                        sum_tree(extra, k);
                        sum_tree(fourth, k);
                    });
                }
                next_phase(&mut || {
                    let squares = get(sums, self.i64(0), x_type).into_float_value();
                    let r = self.reciprocal_deviation(squares, n, epsilon, x_type);
                    let g_sum = get(extra, self.i64(0), x_type).into_float_value();
                    let gx_sum = get(fourth, self.i64(0), x_type).into_float_value();
                    slice(zero, &mut |j, s| {
                        let dx =
                            self.layer_norm_grad_at(at(j, 1).into_float_value(), normalised(j), g_sum, gx_sum, n, r);
                        self.store(row_out(j), dtype, dx.into());
                        s
                    });
                });
            }
            assert_eq!(phase_at as u32, phases, "every phase emitted");
            self.builder.position_at_end(done);
            return phases;
        }
        // The row's maximum.
        next_phase(&mut || {
            let lowest = self.extreme(x_type, false);
            let max = slice(lowest, &mut |j, m| self.maximum(m, at(j, 0), x_type, true));
            put(maxima, tid, x_type, max);
        });
        for k in 1..=steps {
            next_phase(&mut || {
                tree_step(k, &|mine, theirs| {
                    let larger = self.maximum(get(maxima, mine, x_type), get(maxima, theirs, x_type), x_type, true);
                    put(maxima, mine, x_type, larger);
                })
            });
        }
        let max = || get(maxima, self.i64(0), x_type).into_float_value();
        let shifted_exp = |j: IntValue<'ctx>| {
            let d = self.builder.build_float_sub(at(j, 0).into_float_value(), max(), "d").unwrap();
            self.float_intrinsic("llvm.exp", d)
        };
        // Σ exp(x − max).
        next_phase(&mut || {
            let sum = slice(zero, &mut |j, s| {
                self.builder.build_float_add(s.into_float_value(), shifted_exp(j), "s").unwrap().into()
            });
            put(sums, tid, x_type, sum);
        });
        for k in 1..=steps {
            next_phase(&mut || sum_tree(sums, k));
        }
        let sum = || get(sums, self.i64(0), x_type).into_float_value();
        let shifted = |j: IntValue<'ctx>| {
            let b = &self.builder;
            let log_sum = self.float_intrinsic("llvm.log", sum());
            let d = b.build_float_sub(at(j, 0).into_float_value(), max(), "d").unwrap();
            b.build_float_sub(d, log_sum, "ls").unwrap()
        };
        match op {
            RowOp::Softmax => next_phase(&mut || {
                slice(zero, &mut |j, s| {
                    let q = self.builder.build_float_div(shifted_exp(j), sum(), "q").unwrap();
                    self.store(row_out(j), dtype, q.into());
                    s
                });
            }),
            RowOp::LogSoftmax => next_phase(&mut || {
                slice(zero, &mut |j, s| {
                    self.store(row_out(j), dtype, shifted(j).into());
                    s
                });
            }),
            RowOp::CrossEntropy => {
                // −Σ z·(x − max − log Σ), the threads' parts, then a tree.
                next_phase(&mut || {
                    let loss = slice(zero, &mut |j, l| {
                        let z = at(j, 1).into_float_value();
                        let t = self.builder.build_float_mul(z, shifted(j), "zt").unwrap();
                        self.builder.build_float_sub(l.into_float_value(), t, "l").unwrap().into()
                    });
                    put(extra, tid, x_type, loss);
                });
                for k in 1..=steps {
                    next_phase(&mut || {
                        sum_tree(extra, k);
                        if k == steps {
                            self.when(first_thread, &|| {
                                self.store(row_scalar(), dtype, get(extra, self.i64(0), x_type))
                            });
                        }
                    });
                }
            }
            RowOp::ArgMax | RowOp::LayerNorm { .. } | RowOp::LayerNormGrad { .. } => unreachable!("returned above"),
        }
        assert_eq!(phase_at as u32, phases, "every phase emitted");
        self.builder.position_at_end(done);
        phases
    }

    /// `1 / sqrt(squares / n + epsilon)`: a row's reciprocal deviation from the sum of its
    /// squared deviations.
    fn reciprocal_deviation(
        &self,
        squares: FloatValue<'ctx>,
        n: FloatValue<'ctx>,
        epsilon: f64,
        dtype: DType,
    ) -> FloatValue<'ctx> {
        let b = &self.builder;
        let variance = b.build_float_div(squares, n, "var").unwrap();
        let shifted = b.build_float_add(variance, self.constant(dtype, epsilon).into_float_value(), "ve").unwrap();
        let deviation = self.float_intrinsic("llvm.sqrt", shifted);
        b.build_float_div(self.constant(dtype, 1.0).into_float_value(), deviation, "r").unwrap()
    }

    /// One element of a layer norm's gradient, `r · (g - Σg/n - x̂ · Σgx̂/n)`.
    fn layer_norm_grad_at(
        &self,
        g: FloatValue<'ctx>,
        normalised: FloatValue<'ctx>,
        g_sum: FloatValue<'ctx>,
        gx_sum: FloatValue<'ctx>,
        n: FloatValue<'ctx>,
        r: FloatValue<'ctx>,
    ) -> FloatValue<'ctx> {
        let b = &self.builder;
        let g_mean = b.build_float_div(g_sum, n, "gm").unwrap();
        let gx_mean = b.build_float_div(gx_sum, n, "gxm").unwrap();
        let along = b.build_float_mul(normalised, gx_mean, "xg").unwrap();
        let centred = b.build_float_sub(b.build_float_sub(g, g_mean, "gc").unwrap(), along, "d").unwrap();
        b.build_float_mul(r, centred, "dx").unwrap()
    }

    /// Emits `body` where `condition` holds, then goes on.
    fn when(&self, condition: IntValue<'ctx>, body: &dyn Fn()) {
        let then = self.context.append_basic_block(self.function, "then");
        let next = self.context.append_basic_block(self.function, "next");
        self.builder.build_conditional_branch(condition, then, next).unwrap();
        self.builder.position_at_end(then);
        body();
        self.builder.build_unconditional_branch(next).unwrap();
        self.builder.position_at_end(next);
    }

    /// `acc = start; for j in (from..end).step_by(stride) { acc = step(j, acc) }`, in a register.
    fn fold_strided(
        &self,
        start: BasicValueEnum<'ctx>,
        from: IntValue<'ctx>,
        end: IntValue<'ctx>,
        stride: u64,
        step: &mut dyn FnMut(IntValue<'ctx>, BasicValueEnum<'ctx>) -> BasicValueEnum<'ctx>,
    ) -> BasicValueEnum<'ctx> {
        let b = &self.builder;
        let pre = b.get_insert_block().unwrap();
        let head = self.context.append_basic_block(self.function, "fold");
        let exit = self.context.append_basic_block(self.function, "folded");
        let enter = b.build_int_compare(IntPredicate::SLT, from, end, "enter").unwrap();
        b.build_conditional_branch(enter, head, exit).unwrap();
        b.position_at_end(head);
        let j = b.build_phi(self.context.i64_type(), "j").unwrap();
        let acc = b.build_phi(start.get_type(), "acc").unwrap();
        j.add_incoming(&[(&from, pre)]);
        acc.add_incoming(&[(&start, pre)]);
        let jv = j.as_basic_value().into_int_value();
        let next_acc = step(jv, acc.as_basic_value());
        let next = b.build_int_add(jv, self.i64(stride as i64), "jn").unwrap();
        let latch = b.get_insert_block().unwrap();
        j.add_incoming(&[(&next, latch)]);
        acc.add_incoming(&[(&next_acc, latch)]);
        let more = b.build_int_compare(IntPredicate::SLT, next, end, "more").unwrap();
        b.build_conditional_branch(more, head, exit).unwrap();
        b.position_at_end(exit);
        let result = b.build_phi(start.get_type(), "r").unwrap();
        result.add_incoming(&[(&start, pre), (&next_acc, latch)]);
        result.as_basic_value()
    }

    /// The first largest element of `(from..classes).step_by(stride)` (`value(j)`), and its
    /// index (`u64::MAX` with `start`, the lowest value, where there is none): a register pair.
    fn fold_pair_strided(
        &self,
        start: BasicValueEnum<'ctx>,
        from: IntValue<'ctx>,
        classes: u64,
        stride: u64,
        value: &mut dyn FnMut(IntValue<'ctx>) -> BasicValueEnum<'ctx>,
        x_type: DType,
    ) -> (BasicValueEnum<'ctx>, IntValue<'ctx>) {
        let b = &self.builder;
        let i64t = self.context.i64_type();
        let none = i64t.const_all_ones();
        let end = self.i64(classes as i64);
        let pre = b.get_insert_block().unwrap();
        let head = self.context.append_basic_block(self.function, "arg");
        let exit = self.context.append_basic_block(self.function, "argd");
        let enter = b.build_int_compare(IntPredicate::SLT, from, end, "enter").unwrap();
        b.build_conditional_branch(enter, head, exit).unwrap();
        b.position_at_end(head);
        let j = b.build_phi(i64t, "j").unwrap();
        let best = b.build_phi(start.get_type(), "best").unwrap();
        let best_at = b.build_phi(i64t, "bi").unwrap();
        j.add_incoming(&[(&from, pre)]);
        best.add_incoming(&[(&start, pre)]);
        best_at.add_incoming(&[(&none, pre)]);
        let jv = j.as_basic_value().into_int_value();
        let v = value(jv);
        // The slice's first element always takes over (the lowest value may be an element's).
        let first =
            b.build_int_compare(IntPredicate::EQ, best_at.as_basic_value().into_int_value(), none, "first").unwrap();
        let wins = b.build_or(first, self.beats(v, best.as_basic_value(), x_type, true), "wins").unwrap();
        let next_best = self.select(wins, v, best.as_basic_value());
        let next_at = self.select(wins, jv.into(), best_at.as_basic_value());
        let next = b.build_int_add(jv, self.i64(stride as i64), "jn").unwrap();
        let latch = b.get_insert_block().unwrap();
        j.add_incoming(&[(&next, latch)]);
        best.add_incoming(&[(&next_best, latch)]);
        best_at.add_incoming(&[(&next_at, latch)]);
        let more = b.build_int_compare(IntPredicate::SLT, next, end, "more").unwrap();
        b.build_conditional_branch(more, head, exit).unwrap();
        b.position_at_end(exit);
        let value_out = b.build_phi(start.get_type(), "bv").unwrap();
        value_out.add_incoming(&[(&start, pre), (&next_best, latch)]);
        let index_out = b.build_phi(i64t, "bix").unwrap();
        index_out.add_incoming(&[(&none, pre), (&next_at, latch)]);
        (value_out.as_basic_value(), index_out.as_basic_value().into_int_value())
    }

    /// One row of a layer norm or its gradient, in passes: Σ x, Σ (x - mean)², for the
    /// gradient Σ g and Σ g·x̂, then the outputs (`at(j, 0)` is x, `at(j, 1)` g).
    fn emit_layer_norm_row(
        &self,
        op: RowOp,
        epsilon: f64,
        classes: u64,
        dtype: DType,
        at: &mut dyn FnMut(IntValue<'ctx>, usize) -> BasicValueEnum<'ctx>,
        row_out: &dyn Fn(IntValue<'ctx>) -> PointerValue<'ctx>,
    ) {
        let b = &self.builder;
        let zero = self.constant(dtype, 0.0);
        let n = self.constant(dtype, classes as f64).into_float_value();
        let add = |a: BasicValueEnum<'ctx>, v: FloatValue<'ctx>| -> BasicValueEnum<'ctx> {
            b.build_float_add(a.into_float_value(), v, "s").unwrap().into()
        };
        let sum = self.fold(zero, classes, &mut |j, s| add(s, at(j, 0).into_float_value()));
        let mean = b.build_float_div(sum.into_float_value(), n, "mean").unwrap();
        let squares = self.fold(zero, classes, &mut |j, s| {
            let c = b.build_float_sub(at(j, 0).into_float_value(), mean, "c").unwrap();
            add(s, b.build_float_mul(c, c, "c2").unwrap())
        });
        let r = self.reciprocal_deviation(squares.into_float_value(), n, epsilon, dtype);
        let normalised = |j: IntValue<'ctx>, at: &mut dyn FnMut(IntValue<'ctx>, usize) -> BasicValueEnum<'ctx>| {
            let c = b.build_float_sub(at(j, 0).into_float_value(), mean, "c").unwrap();
            b.build_float_mul(c, r, "xh").unwrap()
        };
        if matches!(op, RowOp::LayerNorm { .. }) {
            self.fold(zero, classes, &mut |j, s| {
                self.store(row_out(j), dtype, normalised(j, at).into());
                s
            });
            return;
        }
        let g_sum = self.fold(zero, classes, &mut |j, s| add(s, at(j, 1).into_float_value()));
        let gx_sum = self.fold(zero, classes, &mut |j, s| {
            let xh = normalised(j, at);
            add(s, b.build_float_mul(at(j, 1).into_float_value(), xh, "gx").unwrap())
        });
        self.fold(zero, classes, &mut |j, s| {
            let xh = normalised(j, at);
            let g = at(j, 1).into_float_value();
            let dx = self.layer_norm_grad_at(g, xh, g_sum.into_float_value(), gx_sum.into_float_value(), n, r);
            self.store(row_out(j), dtype, dx.into());
            s
        });
    }

    /// Row ops over the last axis: max, then Σ exp(x - max), then the outputs.
    fn emit_row(&self, begin: IntValue<'ctx>, end: IntValue<'ctx>, op: RowOp, dtype: DType) {
        let graph = &self.module.graph;
        let operands = graph.inputs(self.kernel.root);
        let x_type = graph.ty(operands[0]).dtype;
        let n = self.nest.extents.len();
        let classes = self.nest.extents[n - 1];
        let out = self.out.unwrap();
        let lead_dims = n - 1;
        let run = |prefix: &Index<'ctx>| {
            let mut index = prefix.clone();
            let mut at = |j: IntValue<'ctx>, which: usize| -> BasicValueEnum<'ctx> {
                index.push(j);
                let mut memo = HashMap::new();
                let v = self.value(operands[which], &index, &mut memo);
                index.pop();
                v
            };
            if op == RowOp::ArgMax {
                // The first largest: best starts at element 0.
                let first = at(self.i64(0), 0);
                let idx = if classes <= UNROLLED_MAX {
                    let mut best = (first, BasicValueEnum::from(self.i64(0)));
                    for j in 1..classes as i64 {
                        let v = at(self.i64(j), 0);
                        let wins = self.beats(v, best.0, x_type, true);
                        best = (self.select(wins, v, best.0), self.select(wins, self.i64(j).into(), best.1));
                    }
                    best.1.into_int_value()
                } else {
                    let lowest = self.extreme(x_type, false);
                    self.fold_pair_strided(lowest, self.i64(0), classes, 1, &mut |j| at(j, 0), x_type).1
                };
                let b = &self.builder;
                let idx = if dtype == DType::I32 {
                    b.build_int_truncate(idx, self.context.i32_type(), "i").unwrap().into()
                } else {
                    idx.into()
                };
                let o = self.offset(&self.nest.out[..lead_dims], prefix);
                self.store(self.element(out, o), dtype, idx);
                return;
            }
            if let RowOp::LayerNorm { epsilon } | RowOp::LayerNormGrad { epsilon } = op {
                self.emit_layer_norm_row(op, epsilon, classes, dtype, &mut at, &|j| {
                    let mut full = prefix.clone();
                    full.push(j);
                    self.element(out, self.offset(&self.nest.out, &full))
                });
                return;
            }
            let lowest = self.extreme(dtype, false);
            let max = self.fold(lowest, classes, &mut |j, m| {
                let v = at(j, 0);
                self.maximum(m, v, dtype, true)
            });
            let zero = self.constant(dtype, 0.0);
            let row_out = |j: IntValue<'ctx>, index: &Index<'ctx>| {
                let mut full = index.clone();
                full.push(j);
                self.element(out, self.offset(&self.nest.out, &full))
            };
            let b = &self.builder;
            match op {
                RowOp::Softmax => {
                    let sum = self.fold(zero, classes, &mut |j, s| {
                        let v = at(j, 0).into_float_value();
                        let d = b.build_float_sub(v, max.into_float_value(), "d").unwrap();
                        let e = self.float_intrinsic("llvm.exp", d);
                        self.store(row_out(j, prefix), dtype, e.into());
                        b.build_float_add(s.into_float_value(), e, "s").unwrap().into()
                    });
                    self.fold(zero, classes, &mut |j, s| {
                        let p = row_out(j, prefix);
                        let e = self.load(p, dtype).into_float_value();
                        let q = b.build_float_div(e, sum.into_float_value(), "q").unwrap();
                        self.store(p, dtype, q.into());
                        s
                    });
                }
                RowOp::LogSoftmax | RowOp::CrossEntropy => {
                    let sum = self.fold(zero, classes, &mut |j, s| {
                        let v = at(j, 0).into_float_value();
                        let d = b.build_float_sub(v, max.into_float_value(), "d").unwrap();
                        let e = self.float_intrinsic("llvm.exp", d);
                        b.build_float_add(s.into_float_value(), e, "s").unwrap().into()
                    });
                    let log_sum = self.float_intrinsic("llvm.log", sum.into_float_value());
                    let shifted = |v: FloatValue<'ctx>| {
                        let d = b.build_float_sub(v, max.into_float_value(), "d").unwrap();
                        b.build_float_sub(d, log_sum, "ls").unwrap()
                    };
                    if op == RowOp::LogSoftmax {
                        self.fold(zero, classes, &mut |j, s| {
                            let v = at(j, 0).into_float_value();
                            self.store(row_out(j, prefix), dtype, shifted(v).into());
                            s
                        });
                    } else {
                        let loss = self.fold(zero, classes, &mut |j, l| {
                            let v = at(j, 0).into_float_value();
                            let z = at(j, 1).into_float_value();
                            let t = b.build_float_mul(z, shifted(v), "zt").unwrap();
                            b.build_float_sub(l.into_float_value(), t, "l").unwrap().into()
                        });
                        let o = self.offset(&self.nest.out[..lead_dims], prefix);
                        self.store(self.element(out, o), dtype, loss);
                    }
                }
                RowOp::ArgMax | RowOp::LayerNorm { .. } | RowOp::LayerNormGrad { .. } => unreachable!(),
            }
        };
        if lead_dims == 0 {
            // One row: the range is always 0..1.
            run(&Vec::new());
        } else {
            self.emit_nest(&mut Vec::new(), 0..lead_dims, Some((begin, end)), &mut |prefix| run(prefix));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::reciprocal_divides_bytes;

    /// The images' scale takes the reciprocal, and so do the whole divisors up to 1,000; not 0, infinities or NaN, nor
    /// a divisor whose reciprocal or quotients overflow, nor one whose reciprocal is subnormal.
    #[test]
    fn bytes_are_divided_by_a_reciprocal_where_that_is_exact() {
        assert!(reciprocal_divides_bytes(255.0));
        assert!(reciprocal_divides_bytes(-255.0));
        assert!((1..=1000).all(|c| reciprocal_divides_bytes(c as f32)));
        for c in [0.0, -0.0, f32::INFINITY, f32::NAN, 1e-39, 2.0e-38, 3.0e38] {
            assert!(!reciprocal_divides_bytes(c), "{c}");
        }
    }
}
