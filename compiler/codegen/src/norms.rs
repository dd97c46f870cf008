//! GPU kernels of batch normalisation (f32, per channel: the last axis), written as the CPU's
//! (`dfc_kernels::norm`) computes: sums in f64, the moments in one pass.
//!
//! The column sums run in passes over a grid (`OpPasses`): the rows split into about √rows
//! lanes, a thread per lane and channel sums its share of the column into scratch (adjacent
//! threads, adjacent channels: their loads are coalesced), then a thread per sum adds the
//! lanes' partials in lane order. So the work is spread over √rows · channels threads and the
//! result is the same bits on every run.
//!
//! - `moments`: the partial sums of `x` and `x²`, then a thread per mean or variance;
//! - `batch_norm`: a thread per element;
//! - `batch_norm_grad_means`: the partial sums of `g` and `g · x̂`, then their means a thread
//!   each;
//! - `batch_norm_grad`: a thread per element.

use crate::code::{GpuKernel, GpuLaunch, LaunchBuffer, OpPasses, THREAD_SUFFIX};
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
        let normalisation = matches!(
            node.op,
            Op::Moments | Op::BatchNorm { .. } | Op::BatchNormGradMeans { .. } | Op::BatchNormGrad { .. }
        );
        if !normalisation {
            continue;
        }
        let operands = graph.inputs(id);
        if operands.iter().any(|t| graph.ty(*t).dtype != DType::F32) {
            continue;
        }
        let x = graph.ty(operands[0]).shape.dims();
        let channels = x[x.len() - 1];
        if channels == 0 {
            // Nothing to compute, and no channel to index by: the host's kernels return at once.
            continue;
        }
        let len = graph.ty(operands[0]).shape.n_elements();
        let shape = Columns { channels, rows: len / channels.max(1) };
        let function = format!("n{}_{}_{}", kernels.len(), sanitize(&node.name), node.op.name());
        let out = &node.outputs[0];
        let bytes = operands.iter().map(|t| graph.ty(*t).size_in_bytes() as u64).chain([out.size_in_bytes() as u64]);
        let mut kernel = GpuKernel::for_op(function.clone(), id, operands.clone(), bytes.collect(), len as u64, false);
        let emit = |suffix: &str, body: &dyn Fn(&Thread<'ctx, '_>)| {
            let name = format!("{function}{suffix}");
            let t = Thread::begin(context, llvm, &format!("{name}{THREAD_SUFFIX}"), flavor);
            body(&t);
            crate::thread::inline_on_gpu(context, t.finish(), flavor);
            name
        };
        let (arg, scratch) = (LaunchBuffer::Arg, LaunchBuffer::Scratch);
        let partials = 2 * shape.lanes() * channels as u64 * 8;
        match node.op {
            Op::Moments => {
                let sums = emit("", &|t| partial_sums(t, llvm, shape, Sums::Moments));
                let finish = emit("_finish", &|t| moments(t, llvm, shape));
                kernel.passes = Some(OpPasses {
                    launches: vec![
                        pass(sums, vec![arg(0), scratch(0)], shape.lanes() * channels as u64),
                        pass(finish, vec![scratch(0), arg(1)], 2 * channels as u64),
                    ],
                    scratch: [partials, 0],
                });
            }
            Op::BatchNorm { epsilon, .. } => {
                emit("", &|t| batch_norm(t, llvm, shape, epsilon));
            }
            Op::BatchNormGradMeans { epsilon } => {
                let sums = emit("", &|t| partial_sums(t, llvm, shape, Sums::Gradient { epsilon }));
                let means = emit("_means", &|t| gradient_means(t, llvm, shape));
                kernel.passes = Some(OpPasses {
                    launches: vec![
                        pass(sums, vec![arg(0), arg(1), arg(2), scratch(0)], shape.lanes() * channels as u64),
                        pass(means, vec![scratch(0), arg(3)], 2 * channels as u64),
                    ],
                    scratch: [partials, 0],
                });
            }
            Op::BatchNormGrad { epsilon } => {
                emit("", &|t| batch_norm_grad(t, llvm, shape, epsilon));
            }
            _ => unreachable!("matched above"),
        }
        kernels.push(kernel);
    }
    kernels
}

/// A launch of a per-thread function over `count` threads.
fn pass(function: String, args: Vec<LaunchBuffer>, count: u64) -> GpuLaunch {
    let (block, grid) = crate::launch(count);
    GpuLaunch { function, args, count, block, grid, phases: 0, shared_bytes: 0 }
}

/// `[rows, channels]`: the input seen as rows of its channels.
#[derive(Clone, Copy)]
struct Columns {
    channels: usize,
    rows: usize,
}

impl Columns {
    /// Rows a lane sums: about √rows, so that the lanes and then each sum's pass over the
    /// lanes take about as long.
    fn lane_rows(self) -> usize {
        (self.rows as f64).sqrt().ceil().max(1.0) as usize
    }

    fn lanes(self) -> u64 {
        self.rows.div_ceil(self.lane_rows()).max(1) as u64
    }
}

/// What a lane sums over its rows, per channel: `x` and `x²`, or `g` and `g · x̂`.
#[derive(Clone, Copy)]
enum Sums {
    Moments,
    Gradient { epsilon: f64 },
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

    /// Channel `channel`'s mean and reciprocal deviation from `moments` (`[2, channels]`).
    fn channel_scales(
        &self,
        moments: PointerValue<'ctx>,
        channel: IntValue<'ctx>,
        channels: usize,
        epsilon: f64,
    ) -> (FloatValue<'ctx>, FloatValue<'ctx>) {
        let t = self.t;
        let at_variance = t.add(channel, t.int(channels));
        // SAFETY: (of the generated code) channel < channels; the moments hold 2 · channels.
        let (mean, variance) = unsafe { (self.load(moments, channel), self.load(moments, at_variance)) };
        (mean, self.reciprocal_deviation(variance, epsilon))
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

/// Thread `t < lanes · channels` sums its lane's rows of channel `t mod channels` (f64) into
/// partials `[lanes, 2, channels]`: of `x` and `x²` (arguments `x, partials`), or of `g` and
/// `g · x̂` (arguments `x, moments, g, partials`).
fn partial_sums<'ctx>(t: &Thread<'ctx, '_>, llvm: &LlvmModule<'ctx>, s: Columns, sums: Sums) {
    let a = Arith { t, llvm };
    let wide = t.context.f64_type().into();
    let channel = t.rem(t.thread, s.channels);
    let lane = t.div(t.thread, s.channels);
    let (first, second) = (a.sum(), a.sum());
    let lane_rows = s.lane_rows();
    let partials = match sums {
        Sums::Moments => {
            let x = t.argument(0);
            t.for_each(lane_rows, |i| {
                let row = t.add(t.mul(lane, lane_rows), i);
                t.when(t.below(row, s.rows), || {
                    // SAFETY: (of the generated code) row < rows and channel < channels.
                    let v = a.wide(unsafe { a.load(x, t.add(t.mul(row, s.channels), channel)) });
                    a.add_to(first, v);
                    a.add_to(second, a.mul(v, v));
                });
            });
            t.argument_of(1, wide)
        }
        Sums::Gradient { epsilon } => {
            let (x, moments, g) = (t.argument(0), t.argument(1), t.argument(2));
            let (mean, r) = a.channel_scales(moments, channel, s.channels, epsilon);
            t.for_each(lane_rows, |i| {
                let row = t.add(t.mul(lane, lane_rows), i);
                t.when(t.below(row, s.rows), || {
                    let at = t.add(t.mul(row, s.channels), channel);
                    // SAFETY: (of the generated code) row < rows and channel < channels.
                    let (v, gv) = unsafe { (a.load(x, at), a.load(g, at)) };
                    a.add_to(first, a.wide(gv));
                    a.add_to(second, a.wide(a.mul(gv, a.mul(a.sub(v, mean), r))));
                });
            });
            t.argument_of(3, wide)
        }
    };
    let own = t.add(t.mul(lane, 2 * s.channels), channel);
    // SAFETY: (of the generated code) lane < lanes and channel < channels: the two are this
    // thread's elements of the partials, `[lanes, 2, channels]`.
    unsafe {
        t.store_at(partials, own, a.get(first));
        t.store_at(partials, t.add(own, t.int(s.channels)), a.get(second));
    }
}

/// Sum `v < 2 · channels` of the lanes' partials, in lane order, in f64.
fn lane_total<'ctx>(a: &Arith<'_, 'ctx, '_>, partials: PointerValue<'ctx>, s: Columns) -> FloatValue<'ctx> {
    let t = a.t;
    let total = a.sum();
    t.for_each(s.lanes() as usize, |lane| {
        // SAFETY: (of the generated code) lane < lanes and thread < 2 · channels.
        a.add_to(total, unsafe { a.load(partials, t.add(t.mul(lane, 2 * s.channels), t.thread)) });
    });
    a.get(total)
}

/// Thread `t < 2 · channels` writes `out[t]`: channel `t mod channels`'s mean (`t < channels`)
/// or biased variance, from the lanes' sums of `x` and `x²` (arguments `partials, out`).
fn moments<'ctx>(t: &Thread<'ctx, '_>, llvm: &LlvmModule<'ctx>, s: Columns) {
    let a = Arith { t, llvm };
    let (partials, out) = (t.argument_of(0, t.context.f64_type().into()), t.argument(1));
    let is_mean = t.below(t.thread, s.channels);
    let channel = t.rem(t.thread, s.channels);
    let rows = a.f64(s.rows.max(1) as f64);
    let (sum, squares) = (a.sum(), a.sum());
    t.for_each(s.lanes() as usize, |lane| {
        let own = t.add(t.mul(lane, 2 * s.channels), channel);
        // SAFETY: (of the generated code) lane < lanes and channel < channels.
        let (v, q) = unsafe { (a.load(partials, own), a.load(partials, t.add(own, t.int(s.channels)))) };
        a.add_to(sum, v);
        a.add_to(squares, q);
    });
    let mean = a.div(a.get(sum), rows);
    let spread = a.sub(a.div(a.get(squares), rows), a.mul(mean, mean));
    let positive = t.b.build_float_compare(FloatPredicate::OGT, spread, a.f64(0.0), "positive").unwrap();
    let variance = t.b.build_select(positive, spread, a.f64(0.0), "variance").unwrap().into_float_value();
    let value = t.b.build_select(is_mean, mean, variance, "moment").unwrap().into_float_value();
    t.store_own(out, a.narrow(value));
}

/// Thread `t` writes element `t`: `(x - mean) · rsqrt(variance + epsilon)` of its channel.
fn batch_norm<'ctx>(t: &Thread<'ctx, '_>, llvm: &LlvmModule<'ctx>, s: Columns, epsilon: f64) {
    let a = Arith { t, llvm };
    let (x, moments, out) = (t.argument(0), t.argument(1), t.argument(2));
    let channel = t.rem(t.thread, s.channels);
    let (mean, r) = a.channel_scales(moments, channel, s.channels, epsilon);
    // SAFETY: (of the generated code) thread < rows · channels.
    let v = unsafe { a.load(x, t.thread) };
    t.store_own(out, a.mul(a.sub(v, mean), r));
}

/// Thread `t < 2 · channels` writes the mean over the rows of `g` (`t < channels`) or of
/// `g · x̂` of its channel, as f32, from the lanes' sums (arguments `partials, means`).
fn gradient_means<'ctx>(t: &Thread<'ctx, '_>, llvm: &LlvmModule<'ctx>, s: Columns) {
    let a = Arith { t, llvm };
    let (partials, means) = (t.argument_of(0, t.context.f64_type().into()), t.argument(1));
    let total = lane_total(&a, partials, s);
    t.store_own(means, a.narrow(a.div(total, a.f64(s.rows.max(1) as f64))));
}

/// Thread `t` writes element `t` of `r · (g - mean(g) - x̂ · mean(g · x̂))` (arguments `x,
/// moments, g, means, out`).
fn batch_norm_grad<'ctx>(t: &Thread<'ctx, '_>, llvm: &LlvmModule<'ctx>, s: Columns, epsilon: f64) {
    let a = Arith { t, llvm };
    let (x, moments, g, means, out) = (t.argument(0), t.argument(1), t.argument(2), t.argument(3), t.argument(4));
    let channel = t.rem(t.thread, s.channels);
    let (mean, r) = a.channel_scales(moments, channel, s.channels, epsilon);
    // SAFETY: (of the generated code) thread < rows · channels; the means hold 2 · channels.
    let (v, gv, g_mean, gx_mean) = unsafe {
        (
            a.load(x, t.thread),
            a.load(g, t.thread),
            a.load(means, channel),
            a.load(means, t.add(channel, t.int(s.channels))),
        )
    };
    let normalised = a.mul(a.sub(v, mean), r);
    t.store_own(out, a.mul(r, a.sub(a.sub(gv, g_mean), a.mul(normalised, gx_mean))));
}
