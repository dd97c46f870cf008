//! GPU kernels of batch normalisation (f32, per channel: the last axis), written as the CPU's
//! (`dfc_kernels::norm`) computes: sums in f64, the moments in one pass.
//!
//! - `moments`: a thread per output value (`2 · channels`), each summing its channel's column;
//! - `batch_norm`: a thread per element;
//! - `batch_norm_grad`: a thread per channel, which sums its column's `g` and `g · x̂`, then
//!   writes its column's gradient.
//!
//! A column's threads read neighbouring addresses (the channels are contiguous), but the sums
//! run one thread per channel: a few hundred threads, far from filling a GPU. They are right
//! and deterministic; a grid of partial sums (as `GridReduction`) is what would make them fast.

use crate::code::{GpuKernel, THREAD_SUFFIX};
use crate::kernel::Flavor;
use crate::sanitize;
use crate::thread::Thread;
use dfc_ir::{DType, Module, Op};
use inkwell::context::Context;
use inkwell::intrinsics::Intrinsic;
use inkwell::module::Module as LlvmModule;
use inkwell::values::{FloatValue, IntValue, PointerValue};
use inkwell::FloatPredicate;

/// The normalisation kernels of `module`, in the graph's order (see `GpuCode::ops`).
pub(crate) fn emit_norms<'ctx>(
    context: &'ctx Context,
    llvm: &LlvmModule<'ctx>,
    module: &Module,
    flavor: Flavor<'_>,
) -> Vec<GpuKernel> {
    let graph = &module.graph;
    let mut kernels = Vec::new();
    for id in graph.node_ids() {
        let node = graph.node(id);
        if !matches!(node.op, Op::Moments | Op::BatchNorm { .. } | Op::BatchNormGrad { .. }) {
            continue;
        }
        let operands = graph.inputs(id);
        if operands.iter().any(|t| graph.ty(*t).dtype != DType::F32) {
            continue;
        }
        let x = graph.ty(operands[0]).shape.dims();
        let channels = x[x.len() - 1];
        let len = graph.ty(operands[0]).shape.n_elements();
        let shape = Columns { channels, rows: len / channels.max(1) };
        let function = format!("n{}_{}_{}", kernels.len(), sanitize(&node.name), node.op.name());
        let name = format!("{function}{THREAD_SUFFIX}");
        let t = Thread::begin(context, llvm, &name, flavor);
        let count = match node.op {
            Op::Moments => moments(&t, llvm, shape),
            Op::BatchNorm { epsilon } => batch_norm(&t, llvm, shape, epsilon),
            Op::BatchNormGrad { epsilon } => batch_norm_grad(&t, llvm, shape, epsilon),
            _ => unreachable!("matched above"),
        };
        crate::thread::inline_on_gpu(context, t.finish(), flavor);
        let out = &node.outputs[0];
        let bytes = operands.iter().map(|t| graph.ty(*t).size_in_bytes() as u64).chain([out.size_in_bytes() as u64]);
        kernels.push(GpuKernel::for_op(function, id, operands.clone(), bytes.collect(), count as u64, false));
    }
    kernels
}

/// `[rows, channels]`: the input seen as rows of its channels.
#[derive(Clone, Copy)]
struct Columns {
    channels: usize,
    rows: usize,
}

/// The arithmetic the kernels share, over a [`Thread`].
struct Arith<'a, 'ctx, 'f> {
    t: &'a Thread<'ctx, 'f>,
    llvm: &'a LlvmModule<'ctx>,
}

impl<'ctx> Arith<'_, 'ctx, '_> {
    fn f32(&self, v: f64) -> FloatValue<'ctx> {
        self.t.context.f32_type().const_float(v)
    }

    fn f64(&self, v: f64) -> FloatValue<'ctx> {
        self.t.context.f64_type().const_float(v)
    }

    fn wide(&self, v: FloatValue<'ctx>) -> FloatValue<'ctx> {
        self.t.b.build_float_ext(v, self.t.context.f64_type(), "wide").unwrap()
    }

    fn narrow(&self, v: FloatValue<'ctx>) -> FloatValue<'ctx> {
        self.t.b.build_float_trunc(v, self.t.context.f32_type(), "narrow").unwrap()
    }

    fn add(&self, a: FloatValue<'ctx>, b: FloatValue<'ctx>) -> FloatValue<'ctx> {
        self.t.b.build_float_add(a, b, "add").unwrap()
    }

    fn sub(&self, a: FloatValue<'ctx>, b: FloatValue<'ctx>) -> FloatValue<'ctx> {
        self.t.b.build_float_sub(a, b, "sub").unwrap()
    }

    fn mul(&self, a: FloatValue<'ctx>, b: FloatValue<'ctx>) -> FloatValue<'ctx> {
        self.t.b.build_float_mul(a, b, "mul").unwrap()
    }

    fn div(&self, a: FloatValue<'ctx>, b: FloatValue<'ctx>) -> FloatValue<'ctx> {
        self.t.b.build_float_div(a, b, "div").unwrap()
    }

    /// `1 / sqrt(variance + epsilon)` in f32, as the CPU and the interpreter compute it.
    fn reciprocal_deviation(&self, variance: FloatValue<'ctx>, epsilon: f64) -> FloatValue<'ctx> {
        let sqrt = Intrinsic::find("llvm.sqrt").expect("llvm.sqrt exists");
        let f32t = self.t.context.f32_type();
        let declaration = sqrt.get_declaration(self.llvm, &[f32t.into()]).expect("llvm.sqrt.f32");
        let shifted = self.add(variance, self.f32(epsilon as f32 as f64));
        let root = self.t.b.build_call(declaration, &[shifted.into()], "sqrt").unwrap();
        let root = root.try_as_basic_value().unwrap_basic().into_float_value();
        self.div(self.f32(1.0), root)
    }

    /// A register-promoted f64 sum starting at 0.
    fn sum(&self) -> PointerValue<'ctx> {
        self.t.variable(self.f64(0.0).into())
    }

    fn add_to(&self, sum: PointerValue<'ctx>, value: FloatValue<'ctx>) {
        let total = self.t.get(sum).into_float_value();
        self.t.set(sum, self.add(total, value));
    }

    fn get(&self, sum: PointerValue<'ctx>) -> FloatValue<'ctx> {
        self.t.get(sum).into_float_value()
    }

    /// # Safety
    /// (Of the generated code.) `index` is an element of the array at `array`.
    unsafe fn load(&self, array: PointerValue<'ctx>, index: IntValue<'ctx>) -> FloatValue<'ctx> {
        // SAFETY: the caller's.
        unsafe { self.t.load(array, index) }
    }
}

/// Thread `t < 2 · channels` writes `out[t]`: channel `t mod channels`'s mean (`t < channels`)
/// or biased variance, from the sums of `x` and `x²` in f64.
fn moments<'ctx>(t: &Thread<'ctx, '_>, llvm: &LlvmModule<'ctx>, s: Columns) -> usize {
    let a = Arith { t, llvm };
    let (x, out) = (t.argument(0), t.argument(1));
    let channel = t.rem(t.thread, s.channels);
    let (sum, squares) = (a.sum(), a.sum());
    t.for_each(s.rows, |row| {
        // SAFETY: (of the generated code) row < rows and channel < channels.
        let v = a.wide(unsafe { a.load(x, t.add(t.mul(row, s.channels), channel)) });
        a.add_to(sum, v);
        a.add_to(squares, a.mul(v, v));
    });
    let rows = a.f64(s.rows.max(1) as f64);
    let mean = a.div(a.get(sum), rows);
    let spread = a.sub(a.div(a.get(squares), rows), a.mul(mean, mean));
    let positive = t.b.build_float_compare(FloatPredicate::OGT, spread, a.f64(0.0), "positive").unwrap();
    let variance = t.b.build_select(positive, spread, a.f64(0.0), "variance").unwrap().into_float_value();
    let is_mean = t.below(t.thread, s.channels);
    let value = t.b.build_select(is_mean, mean, variance, "moment").unwrap().into_float_value();
    t.store_own(out, a.narrow(value));
    2 * s.channels
}

/// Thread `t` writes element `t`: `(x - mean) · rsqrt(variance + epsilon)` of its channel.
fn batch_norm<'ctx>(t: &Thread<'ctx, '_>, llvm: &LlvmModule<'ctx>, s: Columns, epsilon: f64) -> usize {
    let a = Arith { t, llvm };
    let (x, moments, out) = (t.argument(0), t.argument(1), t.argument(2));
    let channel = t.rem(t.thread, s.channels);
    // SAFETY: (of the generated code) thread < rows · channels, channel < channels, and the
    // moments hold 2 · channels values.
    let (v, mean, variance) =
        unsafe { (a.load(x, t.thread), a.load(moments, channel), a.load(moments, t.add(channel, t.int(s.channels)))) };
    let r = a.reciprocal_deviation(variance, epsilon);
    t.store_own(out, a.mul(a.sub(v, mean), r));
    s.rows * s.channels
}

/// Thread `t < channels` sums its channel's `g` and `g · x̂` (f64), then writes its column of
/// `r · (g - mean(g) - x̂ · mean(g · x̂))`.
fn batch_norm_grad<'ctx>(t: &Thread<'ctx, '_>, llvm: &LlvmModule<'ctx>, s: Columns, epsilon: f64) -> usize {
    let a = Arith { t, llvm };
    let (x, moments, g, out) = (t.argument(0), t.argument(1), t.argument(2), t.argument(3));
    let channel = t.thread;
    // SAFETY: (of the generated code) channel < channels; the moments hold 2 · channels.
    let (mean, variance) = unsafe { (a.load(moments, channel), a.load(moments, t.add(channel, t.int(s.channels)))) };
    let r = a.reciprocal_deviation(variance, epsilon);
    let at = |row: IntValue<'ctx>| t.add(t.mul(row, s.channels), channel);
    let element = |row| {
        let i = at(row);
        // SAFETY: (of the generated code) both loops call it with row < rows, and
        // channel < channels: i is an element of x and of g.
        let (v, gv) = unsafe { (a.load(x, i), a.load(g, i)) };
        (i, a.mul(a.sub(v, mean), r), gv)
    };
    let (g_sum, gx_sum) = (a.sum(), a.sum());
    t.for_each(s.rows, |row| {
        let (_, normalised, gv) = element(row);
        a.add_to(g_sum, a.wide(gv));
        a.add_to(gx_sum, a.wide(a.mul(gv, normalised)));
    });
    let rows = a.f64(s.rows.max(1) as f64);
    let g_mean = a.narrow(a.div(a.get(g_sum), rows));
    let gx_mean = a.narrow(a.div(a.get(gx_sum), rows));
    t.for_each(s.rows, |row| {
        let (i, normalised, gv) = element(row);
        let value = a.mul(r, a.sub(a.sub(gv, g_mean), a.mul(normalised, gx_mean)));
        // SAFETY: (of the generated code) i is this channel's element of a row < rows.
        unsafe { t.store_at(out, i, value) };
    });
    s.channels
}
