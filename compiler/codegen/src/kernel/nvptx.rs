//! Transcendentals on a GPU, which has no C library: PTX's `ex2.approx` and `lg2.approx` (the
//! special function unit, f32 only; f64 goes through `float64`) and identities built on them.
//! Within a few units in the last place of the CPU's for moderate arguments; the tests compare
//! with tolerances, not bits.

use super::Gen;
use inkwell::intrinsics::Intrinsic;
use inkwell::values::FloatValue;
use inkwell::FloatPredicate;

impl<'ctx> Gen<'_, 'ctx> {
    /// A non-overloaded NVVM intrinsic of one float: `base` + `.f` (f32) or `.d` (f64).
    fn nvvm(&self, base: &str, x: FloatValue<'ctx>) -> FloatValue<'ctx> {
        let suffix = if x.get_type() == self.context.f32_type() { "f" } else { "d" };
        let name = format!("{base}.{suffix}");
        let decl = Intrinsic::find(&name)
            .unwrap_or_else(|| panic!("LLVM has no intrinsic {name}"))
            .get_declaration(self.llvm, &[])
            .expect("declaration");
        self.builder.build_call(decl, &[x.into()], "nv").unwrap().try_as_basic_value().unwrap_basic().into_float_value()
    }

    fn times(&self, x: FloatValue<'ctx>, k: f64) -> FloatValue<'ctx> {
        self.builder.build_float_mul(x, x.get_type().const_float(k), "k").unwrap()
    }

    fn is_f32(&self, x: FloatValue<'ctx>) -> bool {
        x.get_type() == self.context.f32_type()
    }

    /// e^x = 2^(x·log2 e) in f32; in f64, which `ex2.approx` does not take, `exp64`.
    pub(super) fn nvptx_exp(&self, x: FloatValue<'ctx>) -> FloatValue<'ctx> {
        if !self.is_f32(x) {
            return self.exp64(x);
        }
        self.nvvm("llvm.nvvm.ex2.approx", self.times(x, std::f64::consts::LOG2_E))
    }

    /// ln x = log2 x · ln 2 in f32; in f64, which `lg2.approx` does not take, `log64`.
    pub(super) fn nvptx_log(&self, x: FloatValue<'ctx>) -> FloatValue<'ctx> {
        if !self.is_f32(x) {
            return self.log64(x);
        }
        self.times(self.nvvm("llvm.nvvm.lg2.approx", x), std::f64::consts::LN_2)
    }

    /// The C library functions the CPU code calls (`libm`'s 64-bit names).
    pub(super) fn nvptx_libm(&self, name: &str, x: FloatValue<'ctx>) -> FloatValue<'ctx> {
        let b = &self.builder;
        let one = x.get_type().const_float(1.0);
        match name {
            // 1 − 2/(e^2x + 1): ±1 where e^2x overflows or vanishes, NaN for NaN.
            "tanh" => {
                let e = self.nvptx_exp(self.times(x, 2.0));
                let denominator = b.build_float_add(e, one, "d").unwrap();
                let quotient = b.build_float_div(x.get_type().const_float(2.0), denominator, "q").unwrap();
                b.build_float_sub(one, quotient, "tanh").unwrap()
            }
            "log1p" => self.nvptx_log(b.build_float_add(one, x, "1p").unwrap()),
            // cos.approx: within 2^-20.9 for arguments in [−π, π], which is where it is used.
            "cos" => self.nvvm("llvm.nvvm.cos.approx", x),
            other => unreachable!("no GPU version of the C library's {other}"),
        }
    }

    /// a^c as the C library defines it for the cases a model meets: 2^(c·log2|a|), negated for
    /// a negative base and an odd integer exponent, NaN for a negative base and a fractional
    /// one, and 1 for c = 0.
    pub(super) fn nvptx_pow(&self, a: FloatValue<'ctx>, c: FloatValue<'ctx>) -> FloatValue<'ctx> {
        let b = &self.builder;
        let ty = a.get_type();
        let zero = ty.const_float(0.0);
        let fabs = Intrinsic::find("llvm.fabs").unwrap().get_declaration(self.llvm, &[ty.into()]).unwrap();
        let floor = Intrinsic::find("llvm.floor").unwrap().get_declaration(self.llvm, &[ty.into()]).unwrap();
        let call = |f, x: FloatValue<'ctx>| -> FloatValue<'ctx> {
            b.build_call(f, &[x.into()], "f").unwrap().try_as_basic_value().unwrap_basic().into_float_value()
        };
        let magnitude = call(fabs, a);
        // |a|^c = e^(c·ln|a|): in f32 through the special function unit's base 2.
        let r = if self.is_f32(a) {
            let log = self.nvvm("llvm.nvvm.lg2.approx", magnitude);
            self.nvvm("llvm.nvvm.ex2.approx", b.build_float_mul(c, log, "cl").unwrap())
        } else {
            self.exp64(b.build_float_mul(c, self.log64(magnitude), "cl").unwrap())
        };
        let is_integer = b.build_float_compare(FloatPredicate::OEQ, call(floor, c), c, "int").unwrap();
        let half = call(floor, self.times(c, 0.5));
        let is_even = b.build_float_compare(FloatPredicate::OEQ, self.times(half, 2.0), c, "even").unwrap();
        let negated = b.build_float_neg(r, "neg").unwrap();
        let integer_power = b.build_select(is_even, r, negated, "ip").unwrap().into_float_value();
        let nan = ty.const_float(f64::NAN);
        let negative_base = b.build_select(is_integer, integer_power, nan, "nb").unwrap().into_float_value();
        let is_negative = b.build_float_compare(FloatPredicate::OLT, a, zero, "lt").unwrap();
        let power = b.build_select(is_negative, negative_base, r, "p").unwrap().into_float_value();
        let c_is_zero = b.build_float_compare(FloatPredicate::OEQ, c, zero, "c0").unwrap();
        b.build_select(c_is_zero, ty.const_float(1.0), power, "pow").unwrap().into_float_value()
    }
}
