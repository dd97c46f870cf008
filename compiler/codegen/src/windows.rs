//! GPU kernels over the windows of NHWC images (f32): the convolutions' im2col and col2im,
//! and pooling with its gradients. Each is a per-thread function `(args, count, thread)`, as
//! the fused kernels' (`gpu.rs`), in which thread `t` writes element `t` of its output and
//! nothing else: gradients gather what the windows covering an element give it, in the CPU's
//! order (`dfc_kernels`), never scatter with atomics, so that results are deterministic.
//!
//! A window's taps are unrolled (a filter or pooling window has few), each behind its test;
//! ops whose unrolled taps would exceed `MAX_TAPS` get no kernel and run on the host.

use crate::code::{GpuKernel, THREAD_SUFFIX};
use crate::kernel::Flavor;
use crate::sanitize;
use crate::thread::Thread;
use dfc_ir::{DType, Module, Op};
use dfc_kernels::{Conv2dGeometry, PoolGeometry};
use inkwell::context::Context;
use inkwell::module::Module as LlvmModule;
use inkwell::values::{FloatValue, FunctionValue, IntValue, PointerValue};
use inkwell::{FloatPredicate, IntPredicate};

/// At most this many unrolled window taps per thread (a max-pool gradient's thread visits
/// every tap of every window that covers its element).
const MAX_TAPS: usize = 1024;

/// The window kernels of `module`, in the graph's order (see `GpuCode::ops`).
pub(crate) fn emit_windows<'ctx>(
    context: &'ctx Context,
    llvm: &LlvmModule<'ctx>,
    module: &Module,
    flavor: Flavor<'_>,
) -> Vec<GpuKernel> {
    let graph = &module.graph;
    let mut windows = Vec::new();
    for id in graph.node_ids() {
        let node = graph.node(id);
        let operands = graph.inputs(id);
        let floats = node.outputs.iter().chain(operands.iter().map(|t| graph.ty(*t))).all(|t| t.dtype == DType::F32);
        if !floats {
            continue;
        }
        let Some(window) = Window::of(module, id) else { continue };
        if window.taps() > MAX_TAPS {
            continue;
        }
        let function = format!("i{}_{}_{}", windows.len(), sanitize(&node.name), window.kind());
        let thread = window.emit(context, llvm, &format!("{function}{THREAD_SUFFIX}"), flavor);
        crate::thread::inline_on_gpu(context, thread, flavor);
        let (inputs, arg_bytes) = window.arguments(module, id);
        windows.push(GpuKernel::for_op(function, id, inputs, arg_bytes, window.threads(), false));
    }
    windows
}

/// What a window kernel computes.
enum Window {
    /// A convolution's or filter gradient's columns from its input.
    Im2col(Conv2dGeometry),
    /// An input gradient from the columns a GEMM made of the output's gradient.
    Col2im(Conv2dGeometry),
    MaxPool(PoolGeometry),
    MaxPoolGrad(PoolGeometry),
    AvgPool(PoolGeometry),
    AvgPoolGrad(PoolGeometry),
}

impl Window {
    fn of(module: &Module, id: dfc_ir::NodeId) -> Option<Window> {
        let graph = &module.graph;
        let node = graph.node(id);
        let operands = graph.inputs(id);
        let dims = |i: usize| graph.ty(operands[i]).shape.dims();
        let output = || node.outputs[0].shape.dims();
        let pool = |input: &[usize], window: [usize; 2], strides, padding| {
            PoolGeometry::from_dims(input, window, strides, padding)
        };
        Some(match &node.op {
            Op::Conv2d { strides, padding } => {
                Window::Im2col(Conv2dGeometry::from_dims(dims(0), dims(1), *strides, *padding))
            }
            Op::Conv2dBackpropFilter { strides, padding, .. } => {
                Window::Im2col(Conv2dGeometry::from_dims(dims(0), output(), *strides, *padding))
            }
            Op::Conv2dBackpropInput { strides, padding, .. } => {
                Window::Col2im(Conv2dGeometry::from_dims(output(), dims(0), *strides, *padding))
            }
            Op::MaxPool { window, strides, padding } => Window::MaxPool(pool(dims(0), *window, *strides, *padding)),
            Op::MaxPoolGrad { window, strides, padding } => {
                Window::MaxPoolGrad(pool(dims(0), *window, *strides, *padding))
            }
            Op::AvgPool { window, strides, padding } => Window::AvgPool(pool(dims(0), *window, *strides, *padding)),
            Op::AvgPoolGrad { window, strides, padding, input_shape } => {
                Window::AvgPoolGrad(pool(input_shape.dims(), *window, *strides, *padding))
            }
            _ => return None,
        })
    }

    fn kind(&self) -> &'static str {
        match self {
            Window::Im2col(_) => "im2col",
            Window::Col2im(_) => "col2im",
            Window::MaxPool(_) => "max_pool",
            Window::MaxPoolGrad(_) => "max_pool_grad",
            Window::AvgPool(_) => "avg_pool",
            Window::AvgPoolGrad(_) => "avg_pool_grad",
        }
    }

    /// Taps a thread visits, unrolled.
    fn taps(&self) -> usize {
        match self {
            Window::Im2col(_) => 1,
            Window::Col2im(g) => g.kh * g.kw,
            Window::MaxPool(g) | Window::AvgPool(g) | Window::AvgPoolGrad(g) => g.kh * g.kw,
            Window::MaxPoolGrad(g) => (g.kh * g.kw).saturating_mul(g.kh * g.kw),
        }
    }

    /// The launch's threads: one per element of what the kernel writes.
    fn threads(&self) -> u64 {
        (match self {
            Window::Im2col(g) => g.rows() * g.patch_len(),
            Window::Col2im(g) => g.input_len(),
            Window::MaxPool(g) | Window::AvgPool(g) => g.output_len(),
            Window::MaxPoolGrad(g) | Window::AvgPoolGrad(g) => g.input_len(),
        }) as u64
    }

    /// The graph's values the kernel reads (see `GpuCode::ops`), and each argument's bytes.
    fn arguments(&self, module: &Module, id: dfc_ir::NodeId) -> (Vec<dfc_ir::TensorRef>, Vec<u64>) {
        let graph = &module.graph;
        let operands = graph.inputs(id);
        let bytes = |t: &dfc_ir::TensorRef| graph.ty(*t).size_in_bytes() as u64;
        let output = graph.node(id).outputs[0].size_in_bytes() as u64;
        let columns = |g: &Conv2dGeometry| 4 * (g.rows() * g.patch_len()) as u64;
        match self {
            Window::Im2col(g) => (vec![operands[0]], vec![bytes(&operands[0]), columns(g)]),
            Window::Col2im(g) => (vec![operands[1]], vec![columns(g), output]),
            _ => (operands.clone(), operands.iter().map(bytes).chain([output]).collect()),
        }
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
            Window::Im2col(g) => im2col(&t, g),
            Window::Col2im(g) => col2im(&t, g),
            Window::MaxPool(g) => max_pool(&t, g),
            Window::MaxPoolGrad(g) => max_pool_grad(&t, g),
            Window::AvgPool(g) => avg_pool(&t, g),
            Window::AvgPoolGrad(g) => avg_pool_grad(&t, g),
        }
        t.finish()
    }
}

/// Thread `t` writes element `t` of the columns, row `(n, oy, ox)`, column `(ky, kx, c)`: the
/// input at `(n, oy·sh + ky − pad_top, ox·sw + kx − pad_left, c)`, or 0 in the padding.
fn im2col(t: &Thread<'_, '_>, g: &Conv2dGeometry) {
    let (x, columns) = (t.argument(0), t.argument(1));
    let patch = g.patch_len();
    let (row, column) = (t.div(t.thread, patch), t.rem(t.thread, patch));
    let c = t.rem(column, g.c);
    let kx = t.rem(t.div(column, g.c), g.kw);
    let ky = t.div(column, g.c * g.kw);
    let [n, oy, ox] = [t.div(row, g.out_w * g.out_h), t.rem(t.div(row, g.out_w), g.out_h), t.rem(row, g.out_w)];
    // The taps are not unrolled here: each thread has one, `(ky, kx)` from its column.
    let at = |o, k, stride: usize, pad: usize| {
        let shifted = t.add(t.mul(o, stride), k);
        t.b.build_int_sub(shifted, t.int(pad), "at").unwrap()
    };
    let (iy, ix) = (at(oy, ky, g.stride_h, g.pad_top), at(ox, kx, g.stride_w, g.pad_left));
    let value = t.variable(t.context.f32_type().const_zero().into());
    t.when(t.and(t.below(iy, g.h), t.below(ix, g.w)), || {
        // SAFETY: (of the generated code) n < N, iy < H and ix < W (checked), c < C.
        let v = unsafe { t.load(x, t.at_nhwc([n, iy, ix, c], [g.h, g.w, g.c])) };
        t.set(value, v);
    });
    t.store_own(columns, t.get(value).into_float_value());
}

/// Thread `t` sums into input element `t = (n, y, x, c)` the columns' elements `((n, oy, ox),
/// (ky, kx, c))` of the windows that cover it, in `(ky, kx)` order.
fn col2im(t: &Thread<'_, '_>, g: &Conv2dGeometry) {
    let (columns, image) = (t.argument(0), t.argument(1));
    let [n, y, x, c] = t.nhwc(t.thread, [g.h, g.w, g.c]);
    let sum = t.variable(t.context.f32_type().const_zero().into());
    let (y_padded, x_padded) = (t.pad(y, g.pad_top), t.pad(x, g.pad_left));
    for ky in 0..g.kh {
        let (oy, covers_y) = t.covering(y_padded, ky, g.stride_h, g.out_h);
        for kx in 0..g.kw {
            let (ox, covers_x) = t.covering(x_padded, kx, g.stride_w, g.out_w);
            t.when(t.and(covers_y, covers_x), || {
                let window = t.add(t.mul(t.add(t.mul(n, g.out_h), oy), g.out_w), ox);
                let index = t.add(t.add(t.mul(window, g.patch_len()), t.int((ky * g.kw + kx) * g.c)), c);
                // SAFETY: (of the generated code) the window `(n, oy, ox)` is a row of the
                // columns (oy < out_h and ox < out_w, checked), `(ky, kx, c)` a column.
                t.accumulate(sum, unsafe { t.load(columns, index) });
            });
        }
    }
    t.store_own(image, t.get(sum).into_float_value());
}

/// Whether `candidate` replaces `best` as a window's maximum, as on the CPU
/// (`dfc_kernels::pool`): larger, or NaN over a number, so that ties keep the earlier element
/// and the first NaN wins.
fn beats<'ctx>(t: &Thread<'ctx, '_>, candidate: FloatValue<'ctx>, best: FloatValue<'ctx>) -> IntValue<'ctx> {
    let b = &t.b;
    let larger = b.build_float_compare(FloatPredicate::OGT, candidate, best, "larger").unwrap();
    let nan = b.build_float_compare(FloatPredicate::UNO, candidate, candidate, "nan").unwrap();
    let number = b.build_float_compare(FloatPredicate::ORD, best, best, "number").unwrap();
    b.build_or(larger, t.and(nan, number), "beats").unwrap()
}

/// The maximum of the window at `(n, oy, ox)`, channel `c`, of image `x` (padding excluded),
/// and the pixel `iy·w + ix` holding it: the first in row-major window order on ties.
fn window_max<'ctx>(
    t: &Thread<'ctx, '_>,
    g: &PoolGeometry,
    x: PointerValue<'ctx>,
    [n, oy, ox, c]: [IntValue<'ctx>; 4],
) -> (FloatValue<'ctx>, IntValue<'ctx>) {
    let f32t = t.context.f32_type();
    let best = t.variable(f32t.const_zero().into());
    let arg = t.variable(t.int(0).into());
    let found = t.variable(t.context.bool_type().const_zero().into());
    for ky in 0..g.kh {
        let (iy, in_y) = t.tap(oy, ky, g.stride_h, g.pad_top, g.h);
        for kx in 0..g.kw {
            let (ix, in_x) = t.tap(ox, kx, g.stride_w, g.pad_left, g.w);
            t.when(t.and(in_y, in_x), || {
                // SAFETY: (of the generated code) iy < h and ix < w (checked), n < N, c < C.
                let v = unsafe { t.load(x, t.at_nhwc([n, iy, ix, c], [g.h, g.w, g.c])) };
                let first = t.b.build_not(t.get(found).into_int_value(), "first").unwrap();
                let take = t.b.build_or(first, beats(t, v, t.get(best).into_float_value()), "take").unwrap();
                t.when(take, || {
                    t.set(best, v);
                    t.set(arg, t.add(t.mul(iy, g.w), ix));
                });
                t.set(found, t.context.bool_type().const_all_ones());
            });
        }
    }
    (t.get(best).into_float_value(), t.get(arg).into_int_value())
}

/// Thread `t` writes output element `t`: its window's maximum.
fn max_pool(t: &Thread<'_, '_>, g: &PoolGeometry) {
    let (x, out) = (t.argument(0), t.argument(1));
    let position = t.nhwc(t.thread, [g.out_h, g.out_w, g.c]);
    t.store_own(out, window_max(t, g, x, position).0);
}

/// Thread `t` writes input element `t`'s gradient: the output's gradients of the windows whose
/// maximum it is, added in output order (as the CPU adds them).
fn max_pool_grad(t: &Thread<'_, '_>, g: &PoolGeometry) {
    let (x, grad_out, grad_in) = (t.argument(0), t.argument(1), t.argument(2));
    let [n, y, xx, c] = t.nhwc(t.thread, [g.h, g.w, g.c]);
    let pixel = t.add(t.mul(y, g.w), xx);
    let sum = t.variable(t.context.f32_type().const_zero().into());
    covering_windows(t, g, [y, xx], |oy, ox| {
        let (_, arg) = window_max(t, g, x, [n, oy, ox, c]);
        let hit = t.b.build_int_compare(IntPredicate::EQ, arg, pixel, "hit").unwrap();
        t.when(hit, || {
            // SAFETY: (of the generated code) oy < out_h and ox < out_w (`covering_windows`).
            t.accumulate(sum, unsafe { t.load(grad_out, t.at_nhwc([n, oy, ox, c], [g.out_h, g.out_w, g.c])) });
        });
    });
    t.store_own(grad_in, t.get(sum).into_float_value());
}

/// Calls `body(oy, ox)`, under the test that it exists, for each window covering input pixel
/// `(y, x)`, in output order: `oy` rising (the tap `ky` falling), then `ox`.
fn covering_windows<'ctx>(
    t: &Thread<'ctx, '_>,
    g: &PoolGeometry,
    [y, x]: [IntValue<'ctx>; 2],
    mut body: impl FnMut(IntValue<'ctx>, IntValue<'ctx>),
) {
    let (y_padded, x_padded) = (t.pad(y, g.pad_top), t.pad(x, g.pad_left));
    for ky in (0..g.kh).rev() {
        let (oy, covers_y) = t.covering(y_padded, ky, g.stride_h, g.out_h);
        for kx in (0..g.kw).rev() {
            let (ox, covers_x) = t.covering(x_padded, kx, g.stride_w, g.out_w);
            t.when(t.and(covers_y, covers_x), || body(oy, ox));
        }
    }
}

/// The taps of the window at `o` on an axis that are inside the input.
fn taps_inside<'ctx>(
    t: &Thread<'ctx, '_>,
    o: IntValue<'ctx>,
    k: usize,
    stride: usize,
    pad: usize,
    size: usize,
) -> IntValue<'ctx> {
    (0..k).fold(t.int(0), |count, tap| {
        let inside = t.tap(o, tap, stride, pad, size).1;
        t.add(count, t.b.build_int_z_extend(inside, t.context.i64_type(), "one").unwrap())
    })
}

/// The count of input elements in the window at `(oy, ox)`, as an `f32`.
fn window_count<'ctx>(
    t: &Thread<'ctx, '_>,
    g: &PoolGeometry,
    oy: IntValue<'ctx>,
    ox: IntValue<'ctx>,
) -> FloatValue<'ctx> {
    let rows = taps_inside(t, oy, g.kh, g.stride_h, g.pad_top, g.h);
    let columns = taps_inside(t, ox, g.kw, g.stride_w, g.pad_left, g.w);
    let count = t.b.build_int_mul(rows, columns, "count").unwrap();
    t.b.build_unsigned_int_to_float(count, t.context.f32_type(), "count").unwrap()
}

/// Thread `t` writes output element `t`: its window's sum in row-major order over its count
/// (padding excluded).
fn avg_pool(t: &Thread<'_, '_>, g: &PoolGeometry) {
    let (x, out) = (t.argument(0), t.argument(1));
    let [n, oy, ox, c] = t.nhwc(t.thread, [g.out_h, g.out_w, g.c]);
    let sum = t.variable(t.context.f32_type().const_zero().into());
    for ky in 0..g.kh {
        let (iy, in_y) = t.tap(oy, ky, g.stride_h, g.pad_top, g.h);
        for kx in 0..g.kw {
            let (ix, in_x) = t.tap(ox, kx, g.stride_w, g.pad_left, g.w);
            t.when(t.and(in_y, in_x), || {
                // SAFETY: (of the generated code) iy < h and ix < w (checked), n < N, c < C.
                t.accumulate(sum, unsafe { t.load(x, t.at_nhwc([n, iy, ix, c], [g.h, g.w, g.c])) });
            });
        }
    }
    let mean = t.b.build_float_div(t.get(sum).into_float_value(), window_count(t, g, oy, ox), "mean").unwrap();
    t.store_own(out, mean);
}

/// Thread `t` writes input element `t`'s gradient: each covering window's output gradient over
/// the window's count, added in output order.
fn avg_pool_grad(t: &Thread<'_, '_>, g: &PoolGeometry) {
    let (grad_out, grad_in) = (t.argument(0), t.argument(1));
    let [n, y, x, c] = t.nhwc(t.thread, [g.h, g.w, g.c]);
    let sum = t.variable(t.context.f32_type().const_zero().into());
    covering_windows(t, g, [y, x], |oy, ox| {
        // SAFETY: (of the generated code) oy < out_h and ox < out_w (`covering_windows`).
        let d = unsafe { t.load(grad_out, t.at_nhwc([n, oy, ox, c], [g.out_h, g.out_w, g.c])) };
        t.accumulate(sum, t.b.build_float_div(d, window_count(t, g, oy, ox), "share").unwrap());
    });
    t.store_own(grad_in, t.get(sum).into_float_value());
}
