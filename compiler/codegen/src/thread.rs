//! The per-thread functions of the GPU kernels written op by op (`windows.rs`, `layout.rs`,
//! `norms.rs`),
//! as a small builder: `void name(i8** args, i64 count, i64 thread)`, whose body runs only
//! where `thread < count`, with the index arithmetic, loads, stores and branches they share.

use crate::kernel::{self, Flavor, GLOBAL_ADDRESS_SPACE};
use inkwell::basic_block::BasicBlock;
use inkwell::builder::Builder;
use inkwell::context::Context;
use inkwell::module::Module as LlvmModule;
use inkwell::types::{BasicType, BasicTypeEnum};
use inkwell::values::{BasicValue, BasicValueEnum, FloatValue, FunctionValue, IntValue, PointerValue};
use inkwell::{AddressSpace, IntPredicate};

/// A per-thread function being emitted: `void name(i8** args, i64 count, i64 thread)`, whose
/// body (between `begin` and `finish`) runs only where `thread < count`.
pub(crate) struct Thread<'ctx, 'f> {
    pub(crate) context: &'ctx Context,
    pub(crate) b: Builder<'ctx>,
    pub(crate) function: FunctionValue<'ctx>,
    args: PointerValue<'ctx>,
    pub(crate) thread: IntValue<'ctx>,
    done: BasicBlock<'ctx>,
    flavor: Flavor<'f>,
}

impl<'ctx, 'f> Thread<'ctx, 'f> {
    pub(crate) fn begin(
        context: &'ctx Context,
        llvm: &LlvmModule<'ctx>,
        name: &str,
        flavor: Flavor<'f>,
    ) -> Thread<'ctx, 'f> {
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

    pub(crate) fn finish(self) -> FunctionValue<'ctx> {
        self.b.build_unconditional_branch(self.done).unwrap();
        self.b.position_at_end(self.done);
        self.b.build_return(None).unwrap();
        self.function
    }

    pub(crate) fn int(&self, v: usize) -> IntValue<'ctx> {
        self.context.i64_type().const_int(v as u64, false)
    }

    pub(crate) fn add(&self, a: IntValue<'ctx>, b: IntValue<'ctx>) -> IntValue<'ctx> {
        self.b.build_int_add(a, b, "add").unwrap()
    }

    pub(crate) fn mul(&self, a: IntValue<'ctx>, b: usize) -> IntValue<'ctx> {
        self.b.build_int_mul(a, self.int(b), "mul").unwrap()
    }

    pub(crate) fn div(&self, a: IntValue<'ctx>, d: usize) -> IntValue<'ctx> {
        self.b.build_int_unsigned_div(a, self.int(d), "q").unwrap()
    }

    pub(crate) fn rem(&self, a: IntValue<'ctx>, d: usize) -> IntValue<'ctx> {
        self.b.build_int_unsigned_rem(a, self.int(d), "r").unwrap()
    }

    pub(crate) fn and(&self, a: IntValue<'ctx>, b: IntValue<'ctx>) -> IntValue<'ctx> {
        self.b.build_and(a, b, "and").unwrap()
    }

    pub(crate) fn below(&self, a: IntValue<'ctx>, limit: usize) -> IntValue<'ctx> {
        self.b.build_int_compare(IntPredicate::ULT, a, self.int(limit), "below").unwrap()
    }

    /// `(n, y, x, c)` of element `index` of an NHWC tensor of `[_, h, w, c]`.
    pub(crate) fn nhwc(&self, index: IntValue<'ctx>, [h, w, c]: [usize; 3]) -> [IntValue<'ctx>; 4] {
        [
            self.div(index, c * w * h),
            self.rem(self.div(index, c * w), h),
            self.rem(self.div(index, c), w),
            self.rem(index, c),
        ]
    }

    /// The index of `(n, y, x, c)` in an NHWC tensor of `[_, h, w, c]`.
    pub(crate) fn at_nhwc(&self, [n, y, x, ch]: [IntValue<'ctx>; 4], [h, w, c]: [usize; 3]) -> IntValue<'ctx> {
        let row = self.add(self.mul(n, h), y);
        let pixel = self.add(self.mul(row, w), x);
        self.add(self.mul(pixel, c), ch)
    }

    /// Argument `i`, an array of `f32`, in the global address space on a GPU.
    pub(crate) fn argument(&self, i: usize) -> PointerValue<'ctx> {
        self.argument_of(i, self.context.f32_type().into())
    }

    /// Argument `i`, an array of `element`, in the global address space on a GPU.
    pub(crate) fn argument_of(&self, i: usize, element: BasicTypeEnum<'ctx>) -> PointerValue<'ctx> {
        let b = &self.b;
        // SAFETY: (of the generated code) `i` < the kernel's arity, the length of its
        // argument table (`GpuKernel::arg_bytes`).
        let slot = unsafe { b.build_gep(self.args, &[self.int(i)], "arg").unwrap() };
        let raw = b.build_load(slot, "raw").unwrap().into_pointer_value();
        let typed = b.build_pointer_cast(raw, element.ptr_type(AddressSpace::default()), "p").unwrap();
        match self.flavor {
            // Device buffers: loads and stores through the global address space.
            Flavor::Nvptx => b
                .build_address_space_cast(typed, element.ptr_type(AddressSpace::from(GLOBAL_ADDRESS_SPACE)), "g")
                .unwrap(),
            Flavor::Cpu(_) => typed,
        }
    }

    /// # Safety
    /// (Of the generated code.) `index` is an element of the array at `array`.
    pub(crate) unsafe fn load_value(&self, array: PointerValue<'ctx>, index: IntValue<'ctx>) -> BasicValueEnum<'ctx> {
        // SAFETY: the caller's.
        let element = unsafe { self.b.build_in_bounds_gep(array, &[index], "e").unwrap() };
        self.b.build_load(element, "v").unwrap()
    }

    /// # Safety
    /// (Of the generated code.) `index` is an element of the array at `array`.
    pub(crate) unsafe fn load(&self, array: PointerValue<'ctx>, index: IntValue<'ctx>) -> FloatValue<'ctx> {
        // SAFETY: the caller's.
        unsafe { self.load_value(array, index) }.into_float_value()
    }

    /// Stores `value` as this thread's element of the array at `array`.
    pub(crate) fn store_own(&self, array: PointerValue<'ctx>, value: impl BasicValue<'ctx>) {
        // SAFETY: (of the generated code) `thread` < `count`, the elements of the array the
        // kernel writes (its launch's count).
        let target = unsafe { self.b.build_in_bounds_gep(array, &[self.thread], "own").unwrap() };
        self.b.build_store(target, value).unwrap();
    }

    /// Stores `value` as element `index` of the array at `array`.
    ///
    /// # Safety
    /// (Of the generated code.) `index` is an element of the array, and no other thread of the
    /// launch writes it.
    pub(crate) unsafe fn store_at(
        &self,
        array: PointerValue<'ctx>,
        index: IntValue<'ctx>,
        value: impl BasicValue<'ctx>,
    ) {
        // SAFETY: the caller's.
        let target = unsafe { self.b.build_in_bounds_gep(array, &[index], "at").unwrap() };
        self.b.build_store(target, value).unwrap();
    }

    /// Emits `body` to run only where `condition` holds.
    pub(crate) fn when(&self, condition: IntValue<'ctx>, body: impl FnOnce()) {
        let then = self.context.append_basic_block(self.function, "then");
        let next = self.context.append_basic_block(self.function, "next");
        self.b.build_conditional_branch(condition, then, next).unwrap();
        self.b.position_at_end(then);
        body();
        self.b.build_unconditional_branch(next).unwrap();
        self.b.position_at_end(next);
    }

    /// Emits `body(i)` for `i` in `0..count`, a loop in the generated code.
    pub(crate) fn for_each(&self, count: usize, body: impl FnOnce(IntValue<'ctx>)) {
        if count == 0 {
            return;
        }
        let before = self.b.get_insert_block().expect("positioned");
        let head = self.context.append_basic_block(self.function, "loop");
        let exit = self.context.append_basic_block(self.function, "exit");
        self.b.build_unconditional_branch(head).unwrap();
        self.b.position_at_end(head);
        let i = self.b.build_phi(self.context.i64_type(), "i").unwrap();
        i.add_incoming(&[(&self.int(0), before)]);
        let index = i.as_basic_value().into_int_value();
        body(index);
        let next = self.add(index, self.int(1));
        let latch = self.b.get_insert_block().expect("positioned");
        i.add_incoming(&[(&next, latch)]);
        let more = self.below(next, count);
        self.b.build_conditional_branch(more, head, exit).unwrap();
        self.b.position_at_end(exit);
    }

    /// A stack slot holding `initial`, which LLVM promotes to a register. Allocated in the
    /// entry block, before its branch.
    pub(crate) fn variable(&self, initial: BasicValueEnum<'ctx>) -> PointerValue<'ctx> {
        let entry = self.function.get_first_basic_block().expect("begun");
        let here = self.b.get_insert_block().expect("positioned");
        self.b.position_before(&entry.get_terminator().expect("begun"));
        let slot = self.b.build_alloca(initial.get_type(), "var").unwrap();
        self.b.build_store(slot, initial).unwrap();
        self.b.position_at_end(here);
        slot
    }

    pub(crate) fn get(&self, slot: PointerValue<'ctx>) -> BasicValueEnum<'ctx> {
        self.b.build_load(slot, "get").unwrap()
    }

    pub(crate) fn set(&self, slot: PointerValue<'ctx>, value: impl BasicValue<'ctx>) {
        self.b.build_store(slot, value).unwrap();
    }

    /// Adds `value` to the `f32` at `sum`.
    pub(crate) fn accumulate(&self, sum: PointerValue<'ctx>, value: FloatValue<'ctx>) {
        let total = self.get(sum).into_float_value();
        self.set(sum, self.b.build_float_add(total, value, "sum").unwrap());
    }

    /// Tap `k` of the window at output position `o` on an axis (`stride`, `pad`, input `size`):
    /// the input position `o·stride + k − pad`, and whether it is inside the input (below zero
    /// it wraps, so one unsigned compare says).
    pub(crate) fn tap(
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
    pub(crate) fn covering(
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
    pub(crate) fn pad(&self, i: IntValue<'ctx>, pad: usize) -> IntValue<'ctx> {
        self.add(i, self.int(pad))
    }
}

/// On a GPU, a per-thread function is internal and always inlined into its entry (which is
/// all the PTX holds); on the host the emulator calls it, so it stays as it is.
pub(crate) fn inline_on_gpu<'ctx>(context: &'ctx Context, function: FunctionValue<'ctx>, flavor: Flavor<'_>) {
    if matches!(flavor, Flavor::Nvptx) {
        function.set_linkage(inkwell::module::Linkage::Internal);
        function.add_attribute(
            inkwell::attributes::AttributeLoc::Function,
            context.create_enum_attribute(inkwell::attributes::Attribute::get_named_enum_kind_id("alwaysinline"), 0),
        );
    }
}
