//! GPU kernels that move data: transpose, concat, slice, pad and gather, each a thread per
//! output element that reads the one element it copies (or writes zero in a pad's border),
//! whatever the element type: elements move as integers of their width, as on the CPU
//! (`dfc_kernels::layout`, `dfc_kernels::gather`).
//!
//! A gather checks its indices: a thread that meets one out of range writes zero and reports
//! it in the kernel's status (`GpuKernel::checks`), which the executor reads at the end of the
//! run, so that a bad index is an error naming the node, never a read outside the table.

use crate::code::{GpuKernel, STATUS_BYTES, THREAD_SUFFIX};
use crate::kernel::Flavor;
use crate::sanitize;
use crate::thread::Thread;
use dfc_ir::{DType, Module, NodeId, Op};
use inkwell::context::Context;
use inkwell::module::Module as LlvmModule;
use inkwell::types::IntType;
use inkwell::values::{FunctionValue, IntValue};
use inkwell::{AtomicOrdering, AtomicRMWBinOp, IntPredicate};

/// The layout kernels of `module`, in the graph's order (see `GpuCode::ops`).
pub(crate) fn emit_layouts<'ctx>(
    context: &'ctx Context,
    llvm: &LlvmModule<'ctx>,
    module: &Module,
    flavor: Flavor<'_>,
) -> Vec<GpuKernel> {
    let graph = &module.graph;
    let mut kernels = Vec::new();
    for id in graph.node_ids() {
        let node = graph.node(id);
        let Some(layout) = Layout::of(module, id) else { continue };
        let operands = graph.inputs(id);
        let out = &node.outputs[0];
        let function = format!("l{}_{}_{}", kernels.len(), sanitize(&node.name), node.op.name());
        let thread = layout.emit(context, llvm, &format!("{function}{THREAD_SUFFIX}"), flavor);
        crate::thread::inline_on_gpu(context, thread, flavor);
        let count = out.shape.n_elements() as u64;
        let checks = matches!(layout, Layout::Gather { .. } | Layout::ScatterAdd { .. });
        let bytes = operands.iter().map(|t| graph.ty(*t).size_in_bytes() as u64).chain([out.size_in_bytes() as u64]);
        let arg_bytes = bytes.chain(checks.then_some(STATUS_BYTES)).collect();
        kernels.push(GpuKernel::for_op(function, id, operands.clone(), arg_bytes, count, checks));
    }
    kernels
}

/// What a layout kernel computes, with the dims it needs.
enum Layout {
    Transpose {
        dims: Vec<usize>,
        perm: Vec<usize>,
        out: Vec<usize>,
        bits: u32,
    },
    /// `parts`: each operand's dims.
    Concat {
        parts: Vec<Vec<usize>>,
        axis: usize,
        out: Vec<usize>,
        bits: u32,
    },
    Slice {
        dims: Vec<usize>,
        begin: Vec<usize>,
        out: Vec<usize>,
        bits: u32,
    },
    Pad {
        dims: Vec<usize>,
        before: Vec<usize>,
        out: Vec<usize>,
        bits: u32,
    },
    /// `rows` of `row_len` elements; indices of `index_bits`.
    Gather {
        rows: usize,
        row_len: usize,
        index_bits: u32,
        bits: u32,
    },
    /// `updates` (f32, `indices` rows of `row_len`) added into `rows` rows.
    ScatterAdd {
        rows: usize,
        row_len: usize,
        indices: usize,
        index_bits: u32,
    },
}

impl Layout {
    fn of(module: &Module, id: NodeId) -> Option<Layout> {
        let graph = &module.graph;
        let node = graph.node(id);
        let operands = graph.inputs(id);
        let dims = |i: usize| graph.ty(operands[i]).shape.dims().to_vec();
        let out = node.outputs.first()?;
        let bits = 8 * out.dtype.size_in_bytes() as u32;
        let out_dims = out.shape.dims().to_vec();
        Some(match &node.op {
            Op::Transpose { perm } => Layout::Transpose { dims: dims(0), perm: perm.clone(), out: out_dims, bits },
            Op::Concat { axis } => {
                Layout::Concat { parts: (0..operands.len()).map(dims).collect(), axis: *axis, out: out_dims, bits }
            }
            Op::Slice { begin, .. } => Layout::Slice { dims: dims(0), begin: begin.clone(), out: out_dims, bits },
            Op::Pad { before, .. } => Layout::Pad { dims: dims(0), before: before.clone(), out: out_dims, bits },
            Op::Gather => {
                let table = dims(0);
                let index_bits = match graph.ty(operands[1]).dtype {
                    DType::I32 => 32,
                    DType::I64 => 64,
                    _ => return None,
                };
                let row_len = table.iter().skip(1).product::<usize>();
                // Without elements to copy there are no threads to check the indices: the
                // host checks them.
                if table.is_empty() || row_len == 0 {
                    return None;
                }
                Layout::Gather { rows: table[0], row_len, index_bits, bits }
            }
            Op::ScatterAdd { rows } => {
                let (indices, updates) = (graph.ty(operands[0]), graph.ty(operands[1]));
                let index_bits = match indices.dtype {
                    DType::I32 => 32,
                    DType::I64 => 64,
                    _ => return None,
                };
                let count = indices.shape.n_elements();
                let row_len = updates.shape.n_elements().checked_div(count).unwrap_or(0);
                // A thread per output element loops over every index: with none, or no
                // elements to write, the host runs it (and checks the indices).
                if updates.dtype != DType::F32 || count == 0 || row_len == 0 || *rows == 0 {
                    return None;
                }
                Layout::ScatterAdd { rows: *rows, row_len, indices: count, index_bits }
            }
            _ => return None,
        })
    }

    fn emit<'ctx>(
        &self,
        context: &'ctx Context,
        llvm: &LlvmModule<'ctx>,
        name: &str,
        flavor: Flavor<'_>,
    ) -> FunctionValue<'ctx> {
        let t = Thread::begin(context, llvm, name, flavor);
        match self {
            Layout::Transpose { dims, perm, out, bits } => {
                let index = output_index(&t, out);
                let strides = row_major(dims);
                let from = sum(&t, index.iter().zip(perm).map(|(&i, &axis)| t.mul(i, strides[axis])));
                copy(&t, *bits, 0, from, 1);
            }
            Layout::Slice { dims, begin, out, bits } => {
                let index = output_index(&t, out);
                let strides = row_major(dims);
                let from =
                    sum(&t, index.iter().enumerate().map(|(a, &i)| t.mul(t.add(i, t.int(begin[a])), strides[a])));
                copy(&t, *bits, 0, from, 1);
            }
            Layout::Pad { dims, before, out, bits } => pad(&t, dims, before, out, *bits),
            Layout::Concat { parts, axis, out, bits } => concat(&t, parts, *axis, out, *bits),
            Layout::Gather { rows, row_len, index_bits, bits } => gather(&t, *rows, *row_len, *index_bits, *bits),
            Layout::ScatterAdd { rows, row_len, indices, index_bits } => {
                scatter_add(&t, *rows, *row_len, *indices, *index_bits)
            }
        }
        t.finish()
    }
}

fn row_major(dims: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; dims.len()];
    for a in (0..dims.len().saturating_sub(1)).rev() {
        strides[a] = strides[a + 1] * dims[a + 1];
    }
    strides
}

/// The thread's element of an output of `dims`, as one index per axis.
fn output_index<'ctx>(t: &Thread<'ctx, '_>, dims: &[usize]) -> Vec<IntValue<'ctx>> {
    let strides = row_major(dims);
    dims.iter().zip(&strides).map(|(&d, &s)| t.rem(t.div(t.thread, s), d.max(1))).collect()
}

fn sum<'ctx>(t: &Thread<'ctx, '_>, terms: impl Iterator<Item = IntValue<'ctx>>) -> IntValue<'ctx> {
    terms.fold(t.int(0), |total, term| t.add(total, term))
}

/// The integer type of `bits` (8, 32 or 64: an element's width).
fn element<'ctx>(t: &Thread<'ctx, '_>, bits: u32) -> IntType<'ctx> {
    match bits {
        8 => t.context.i8_type(),
        32 => t.context.i32_type(),
        _ => t.context.i64_type(),
    }
}

/// Copies element `from` of argument `source` to the thread's element of argument `target`.
fn copy(t: &Thread<'_, '_>, bits: u32, source: usize, from: IntValue<'_>, target: usize) {
    let ty = element(t, bits);
    let (input, output) = (t.argument_of(source, ty.into()), t.argument_of(target, ty.into()));
    // SAFETY: (of the generated code) `from` is an element of the input: every axis' index is
    // within its dims (the output's index within the output's, plus the op's offset, which
    // the IR's verifier bounds).
    let value = unsafe { t.load_value(input, from) };
    t.store_own(output, value);
}

/// An element of the input where the output's index, less `before`, is inside it; zero in
/// the border.
fn pad(t: &Thread<'_, '_>, dims: &[usize], before: &[usize], out: &[usize], bits: u32) {
    let ty = element(t, bits);
    let index = output_index(t, out);
    let strides = row_major(dims);
    let shifted: Vec<_> =
        index.iter().zip(before).map(|(&i, &b)| t.b.build_int_sub(i, t.int(b), "shifted").unwrap()).collect();
    // Below zero, `shifted` wraps: one unsigned compare per axis says whether it is inside.
    let inside = shifted
        .iter()
        .zip(dims)
        .fold(t.context.bool_type().const_all_ones(), |all, (&s, &d)| t.and(all, t.below(s, d)));
    let value = t.variable(ty.const_zero().into());
    let input = t.argument_of(0, ty.into());
    t.when(inside, || {
        let from = sum(t, shifted.iter().zip(&strides).map(|(&s, &stride)| t.mul(s, stride)));
        // SAFETY: (of the generated code) every axis' index is inside the input (checked).
        t.set(value, unsafe { t.load_value(input, from) });
    });
    t.store_own(t.argument_of(1, ty.into()), t.get(value));
}

/// The element of the part whose span of `axis` holds the output's index there.
fn concat(t: &Thread<'_, '_>, parts: &[Vec<usize>], axis: usize, out: &[usize], bits: u32) {
    let ty = element(t, bits);
    let index = output_index(t, out);
    let value = t.variable(ty.const_zero().into());
    let mut start = 0;
    for (p, dims) in parts.iter().enumerate() {
        let within = t.b.build_int_sub(index[axis], t.int(start), "within").unwrap();
        let strides = row_major(dims);
        let input = t.argument_of(p, ty.into());
        t.when(t.below(within, dims[axis]), || {
            let at = |a: usize| if a == axis { within } else { index[a] };
            let from = sum(t, (0..dims.len()).map(|a| t.mul(at(a), strides[a])));
            // SAFETY: (of the generated code) the index is inside the part: on `axis` by the
            // check, elsewhere the part's dims are the output's.
            t.set(value, unsafe { t.load_value(input, from) });
        });
        start += dims[axis];
    }
    t.store_own(t.argument_of(parts.len(), ty.into()), t.get(value));
}

/// Element `j` of row `indices[i]` of the table, for output element `i·row_len + j`; for an
/// index out of range, zero, and the status says so: word 0 set to 1, word 1 raised to the
/// index (as u64; atomics, as threads may meet bad indices together).
fn gather(t: &Thread<'_, '_>, rows: usize, row_len: usize, index_bits: u32, bits: u32) {
    let ty = element(t, bits);
    let i64t = t.context.i64_type();
    let (i, j) = (t.div(t.thread, row_len), t.rem(t.thread, row_len));
    let indices = t.argument_of(1, element(t, index_bits).into());
    // SAFETY: (of the generated code) `i` < the indices' count: the output holds `row_len`
    // elements per index, and `thread` < the output's elements.
    let raw = unsafe { t.load_value(indices, i) }.into_int_value();
    let k = t.b.build_int_s_extend_or_bit_cast(raw, i64t, "k").unwrap();
    let value = t.variable(ty.const_zero().into());
    let inside = t.below(k, rows);
    let table = t.argument_of(0, ty.into());
    t.when(inside, || {
        // SAFETY: (of the generated code) `k` < rows (checked), `j` < row_len.
        t.set(value, unsafe { t.load_value(table, t.add(t.mul(k, row_len), j)) });
    });
    t.when(t.b.build_not(inside, "outside").unwrap(), || report(t, 3, k));
    t.store_own(t.argument_of(2, ty.into()), t.get(value));
}

/// Records index `k`, out of range, in the status at argument `status`: word 0 set to 1, word 1
/// raised to `k` (as u64; atomics, as threads may meet bad indices together).
fn report<'ctx>(t: &Thread<'ctx, '_>, status: usize, k: IntValue<'ctx>) {
    let status = t.argument_of(status, t.context.i64_type().into());
    // SAFETY: (of the generated code) the status is two words (`STATUS_BYTES`).
    let index_word = unsafe { t.b.build_in_bounds_gep(status, &[t.int(1)], "index").unwrap() };
    let rmw = |op, at, v| t.b.build_atomicrmw(op, at, v, AtomicOrdering::Monotonic).unwrap();
    rmw(AtomicRMWBinOp::Max, status, t.int(1));
    rmw(AtomicRMWBinOp::UMax, index_word, k);
}

/// Output element `(r, j)` (of `rows` rows of `row_len`): the sum of element `j` of the
/// updates whose index is `r`, in the order of the indices, from zero, as on the CPU. Every
/// thread reads every index; thread 0 reports those out of range (the run then fails).
fn scatter_add(t: &Thread<'_, '_>, rows: usize, row_len: usize, count: usize, index_bits: u32) {
    let f32t = t.context.f32_type();
    let (row, j) = (t.div(t.thread, row_len), t.rem(t.thread, row_len));
    let indices = t.argument_of(0, element(t, index_bits).into());
    let updates = t.argument(1);
    let sum = t.variable(f32t.const_zero().into());
    let first = t.b.build_int_compare(IntPredicate::EQ, t.thread, t.int(0), "first").unwrap();
    t.for_each(count, |i| {
        // SAFETY: (of the generated code) `i` < the indices' count.
        let raw = unsafe { t.load_value(indices, i) }.into_int_value();
        let k = t.b.build_int_s_extend_or_bit_cast(raw, t.context.i64_type(), "k").unwrap();
        let hit = t.b.build_int_compare(IntPredicate::EQ, k, row, "hit").unwrap();
        t.when(hit, || {
            // SAFETY: (of the generated code) `i` < the indices' count and `j` < row_len: an
            // element of the updates.
            t.accumulate(sum, unsafe { t.load(updates, t.add(t.mul(i, row_len), j)) });
        });
        let bad = t.b.build_not(t.below(k, rows), "bad").unwrap();
        t.when(t.and(first, bad), || report(t, 3, k));
    });
    t.store_own(t.argument(2), t.get(sum).into_float_value());
}
