//! GPU kernels over the windows of NHWC images (f32): the convolutions' im2col and col2im,
//! and pooling with its gradients. Each is a per-thread function `(args, count, thread)`, as
//! the fused kernels' (`gpu.rs`), in which thread `t` writes element `t` of its output and
//! nothing else: gradients gather what the windows covering an element give it, in the CPU's
//! order (`dfc_kernels`), never scatter with atomics, so that results are deterministic.
//!
//! A window's taps are unrolled (a filter or pooling window has few), each behind its test;
//! ops whose unrolled taps would exceed `MAX_TAPS` get no kernel and run on the host.

use crate::code::{GpuKernel, THREAD_SUFFIX};
use crate::gpu::launch;
use crate::kernel::{self, Flavor, GLOBAL_ADDRESS_SPACE};
use crate::sanitize;
use dfc_ir::{DType, Module, Op};
use dfc_kernels::{Conv2dGeometry, PoolGeometry};
use inkwell::attributes::{Attribute, AttributeLoc};
use inkwell::builder::Builder;
use inkwell::context::Context;
use inkwell::module::{Linkage, Module as LlvmModule};
use inkwell::values::{FloatValue, FunctionValue, IntValue, PointerValue};
use inkwell::{AddressSpace, FloatPredicate, IntPredicate};

/// At most this many unrolled window taps per thread (a max-pool gradient's thread visits
/// every tap of every window that covers its element).
const MAX_TAPS: usize = 1024;

/// The window kernels of `module`, in the graph's order (see `GpuCode::windows`).
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
        if matches!(flavor, Flavor::Nvptx) {
            thread.set_linkage(Linkage::Internal);
            thread.add_attribute(
                AttributeLoc::Function,
                context.create_enum_attribute(Attribute::get_named_enum_kind_id("alwaysinline"), 0),
            );
        }
        let count = window.threads();
        let (block, grid) = launch(count);
        let (inputs, arg_bytes) = window.arguments(module, id);
        windows.push(GpuKernel {
            function,
            root: id,
            members: Vec::new(),
            inputs,
            arg_bytes,
            rows: count,
            block,
            grid,
            reduction: None,
        });
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

    /// The graph's values the kernel reads (see `GpuCode::windows`), and each argument's bytes.
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

/// A per-thread function being emitted: `void name(i8** args, i64 count, i64 thread)`, whose
/// body (between `begin` and `finish`) runs only where `thread < count`.
struct Thread<'ctx, 'f> {
    context: &'ctx Context,
    b: Builder<'ctx>,
    function: FunctionValue<'ctx>,
    args: PointerValue<'ctx>,
    thread: IntValue<'ctx>,
    done: inkwell::basic_block::BasicBlock<'ctx>,
    flavor: Flavor<'f>,
}

impl<'ctx, 'f> Thread<'ctx, 'f> {
    fn begin(context: &'ctx Context, llvm: &LlvmModule<'ctx>, name: &str, flavor: Flavor<'f>) -> Thread<'ctx, 'f> {
        let (function, b) = kernel::kernel_function(context, llvm, name, flavor);
        let args = function.get_nth_param(0).unwrap().into_pointer_value();
        let count = function.get_nth_param(1).unwrap().into_int_value();
        let thread = function.get_nth_param(2).unwrap().into_int_value();
        let work = context.append_basic_block(function, "work");
        let done = context.append_basic_block(function, "done");
        let inside = b.build_int_compare(IntPredicate::ULT, thread, count, "inside").unwrap();
        b.build_conditional_branch(inside, work, done).unwrap();
        b.position_at_end(work);
        Thread { context, b, function, args, thread, done, flavor }
    }

    fn finish(self) -> FunctionValue<'ctx> {
        self.b.build_unconditional_branch(self.done).unwrap();
        self.b.position_at_end(self.done);
        self.b.build_return(None).unwrap();
        self.function
    }

    fn int(&self, v: usize) -> IntValue<'ctx> {
        self.context.i64_type().const_int(v as u64, false)
    }

    fn add(&self, a: IntValue<'ctx>, b: IntValue<'ctx>) -> IntValue<'ctx> {
        self.b.build_int_add(a, b, "add").unwrap()
    }

    fn mul(&self, a: IntValue<'ctx>, b: usize) -> IntValue<'ctx> {
        self.b.build_int_mul(a, self.int(b), "mul").unwrap()
    }

    fn div(&self, a: IntValue<'ctx>, d: usize) -> IntValue<'ctx> {
        self.b.build_int_unsigned_div(a, self.int(d), "q").unwrap()
    }

    fn rem(&self, a: IntValue<'ctx>, d: usize) -> IntValue<'ctx> {
        self.b.build_int_unsigned_rem(a, self.int(d), "r").unwrap()
    }

    fn and(&self, a: IntValue<'ctx>, b: IntValue<'ctx>) -> IntValue<'ctx> {
        self.b.build_and(a, b, "and").unwrap()
    }

    fn below(&self, a: IntValue<'ctx>, limit: usize) -> IntValue<'ctx> {
        self.b.build_int_compare(IntPredicate::ULT, a, self.int(limit), "below").unwrap()
    }

    /// `(n, y, x, c)` of element `index` of an NHWC tensor of `[_, h, w, c]`.
    fn nhwc(&self, index: IntValue<'ctx>, [h, w, c]: [usize; 3]) -> [IntValue<'ctx>; 4] {
        [
            self.div(index, c * w * h),
            self.rem(self.div(index, c * w), h),
            self.rem(self.div(index, c), w),
            self.rem(index, c),
        ]
    }

    /// The index of `(n, y, x, c)` in an NHWC tensor of `[_, h, w, c]`.
    fn at_nhwc(&self, [n, y, x, ch]: [IntValue<'ctx>; 4], [h, w, c]: [usize; 3]) -> IntValue<'ctx> {
        let row = self.add(self.mul(n, h), y);
        let pixel = self.add(self.mul(row, w), x);
        self.add(self.mul(pixel, c), ch)
    }

    /// Argument `i`, an array of `f32`, in the global address space on a GPU.
    fn argument(&self, i: usize) -> PointerValue<'ctx> {
        let b = &self.b;
        let f32t = self.context.f32_type();
        // SAFETY: (of the generated code) `i` < the kernel's arity, the length of its
        // argument table (`Window::arguments`).
        let slot = unsafe { b.build_gep(self.args, &[self.int(i)], "arg").unwrap() };
        let raw = b.build_load(slot, "raw").unwrap().into_pointer_value();
        let typed = b.build_pointer_cast(raw, f32t.ptr_type(AddressSpace::default()), "p").unwrap();
        match self.flavor {
            // Device buffers: loads and stores through the global address space.
            Flavor::Nvptx => {
                b.build_address_space_cast(typed, f32t.ptr_type(AddressSpace::from(GLOBAL_ADDRESS_SPACE)), "g").unwrap()
            }
            Flavor::Cpu(_) => typed,
        }
    }

    /// # Safety
    /// (Of the generated code.) `index` is an element of the array at `array`.
    unsafe fn load(&self, array: PointerValue<'ctx>, index: IntValue<'ctx>) -> FloatValue<'ctx> {
        // SAFETY: the caller's.
        let element = unsafe { self.b.build_in_bounds_gep(array, &[index], "e").unwrap() };
        self.b.build_load(element, "v").unwrap().into_float_value()
    }

    /// Stores `value` as this thread's element of the array at `array`.
    fn store_own(&self, array: PointerValue<'ctx>, value: FloatValue<'ctx>) {
        // SAFETY: (of the generated code) `thread` < `count`, the elements of the array the
        // kernel writes (`Window::threads`).
        let target = unsafe { self.b.build_in_bounds_gep(array, &[self.thread], "own").unwrap() };
        self.b.build_store(target, value).unwrap();
    }

    /// Emits `body` to run only where `condition` holds.
    fn when(&self, condition: IntValue<'ctx>, body: impl FnOnce()) {
        let then = self.context.append_basic_block(self.function, "then");
        let next = self.context.append_basic_block(self.function, "next");
        self.b.build_conditional_branch(condition, then, next).unwrap();
        self.b.position_at_end(then);
        body();
        self.b.build_unconditional_branch(next).unwrap();
        self.b.position_at_end(next);
    }

    /// A stack slot holding `initial`, which LLVM promotes to a register. Allocated in the
    /// entry block, before its branch.
    fn variable(&self, initial: inkwell::values::BasicValueEnum<'ctx>) -> PointerValue<'ctx> {
        let entry = self.function.get_first_basic_block().expect("begun");
        let here = self.b.get_insert_block().expect("positioned");
        self.b.position_before(&entry.get_terminator().expect("begun"));
        let slot = self.b.build_alloca(initial.get_type(), "var").unwrap();
        self.b.build_store(slot, initial).unwrap();
        self.b.position_at_end(here);
        slot
    }

    fn get(&self, slot: PointerValue<'ctx>) -> inkwell::values::BasicValueEnum<'ctx> {
        self.b.build_load(slot, "get").unwrap()
    }

    fn set(&self, slot: PointerValue<'ctx>, value: impl inkwell::values::BasicValue<'ctx>) {
        self.b.build_store(slot, value).unwrap();
    }

    /// Adds `value` to the `f32` at `sum`.
    fn accumulate(&self, sum: PointerValue<'ctx>, value: FloatValue<'ctx>) {
        let total = self.get(sum).into_float_value();
        self.set(sum, self.b.build_float_add(total, value, "sum").unwrap());
    }

    /// Tap `k` of the window at output position `o` on an axis (`stride`, `pad`, input `size`):
    /// the input position `o·stride + k − pad`, and whether it is inside the input (below zero
    /// it wraps, so one unsigned compare says).
    fn tap(
        &self,
        o: IntValue<'ctx>,
        k: usize,
        stride: usize,
        pad: usize,
        size: usize,
    ) -> (IntValue<'ctx>, IntValue<'ctx>) {
        let at = self.b.build_int_sub(self.add(self.mul(o, stride), self.int(k)), self.int(pad), "at").unwrap();
        (at, self.below(at, size))
    }

    /// The window on an axis whose tap `k` is input position `i` (`padded` = `i + pad`): `o`
    /// with `o·stride + k − pad = i`, and whether there is one: `padded ≥ k`, `(padded − k)
    /// mod stride = 0` and `o < out`.
    fn covering(
        &self,
        padded: IntValue<'ctx>,
        k: usize,
        stride: usize,
        out: usize,
    ) -> (IntValue<'ctx>, IntValue<'ctx>) {
        let reaches = self.b.build_int_compare(IntPredicate::UGE, padded, self.int(k), "reaches").unwrap();
        let offset = self.b.build_int_sub(padded, self.int(k), "offset").unwrap();
        let whole = self.b.build_int_compare(IntPredicate::EQ, self.rem(offset, stride), self.int(0), "whole").unwrap();
        let o = self.div(offset, stride);
        (o, self.and(self.and(reaches, whole), self.below(o, out)))
    }

    /// `padded + pad`, an input position shifted into padded coordinates.
    fn pad(&self, i: IntValue<'ctx>, pad: usize) -> IntValue<'ctx> {
        self.add(i, self.int(pad))
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
