//! f64 `exp` and `ln` from multiplies, adds and bit operations. A GPU has no f64 special
//! function unit (PTX's `ex2.approx` and `lg2.approx` take f32 only, and `ptxas` refuses their
//! f64 forms), so its kernels need these; the CPU's kernels run the same code, where it
//! vectorises (`llvm.exp` and `llvm.log` are calls of libm's per element on x86) and where the
//! tests measure it (`tests/native_ops.rs`: within an ulp or two of Rust's `exp` and `ln`).

use super::Gen;
use inkwell::intrinsics::Intrinsic;
use inkwell::values::{FloatValue, IntValue};
use inkwell::FloatPredicate;

/// ln 2 in two parts: the high one has 21 trailing zero bits, so that n·LN2_HI is exact for
/// every |n| < 2²¹ (fdlibm's split).
const LN2_HI: f64 = 6.931_471_803_691_238_164_90e-1;
const LN2_LO: f64 = 1.908_214_929_270_587_700_02e-10;

/// 1/k! for k = 2 ..= 13: e^r = 1 + r + r²·(1/2! + r·(1/3! + …)) for |r| ≤ ln 2 / 2, where the
/// first term left out, r¹⁴/14!, is below 4e-18.
fn exp_terms() -> [f64; 12] {
    let mut factorial = 1.0;
    std::array::from_fn(|i| {
        factorial *= (i + 2) as f64;
        1.0 / factorial
    })
}

impl<'ctx> Gen<'_, 'ctx> {
    fn f64_call(&self, name: &str, args: &[FloatValue<'ctx>]) -> FloatValue<'ctx> {
        let f64t = self.context.f64_type();
        let decl = Intrinsic::find(name).expect("LLVM intrinsic").get_declaration(self.llvm, &[f64t.into()]).unwrap();
        let args: Vec<_> = args.iter().map(|&a| a.into()).collect();
        self.builder.build_call(decl, &args, "f").unwrap().try_as_basic_value().unwrap_basic().into_float_value()
    }

    /// 2ᵉ for an integer e in [-1022, 1023], from its exponent bits.
    fn f64_power_of_two(&self, e: IntValue<'ctx>) -> FloatValue<'ctx> {
        let (b, i64t) = (&self.builder, self.context.i64_type());
        let biased = b.build_int_add(e, i64t.const_int(1023, false), "e").unwrap();
        let bits = b.build_left_shift(biased, i64t.const_int(52, false), "e").unwrap();
        b.build_bit_cast(bits, self.context.f64_type(), "2^e").unwrap().into_float_value()
    }

    /// f64 `exp(x)` as `2ⁿ · e^r`: n = ⌊x·log₂e + ½⌋, r = x − n·ln 2 (ln 2 in two parts, so
    /// that |r| ≤ ln 2 / 2 carries no error of n·ln 2), e^r by its Taylor series to r¹³, and
    /// 2ⁿ as two powers built from exponent bits, neither of which overflows or is subnormal.
    /// x is first clamped to [-746, 710], beyond which exp is 0 or +∞; NaN stays NaN.
    pub(super) fn exp64(&self, x: FloatValue<'ctx>) -> FloatValue<'ctx> {
        let b = &self.builder;
        let (f64t, i64t) = (self.context.f64_type(), self.context.i64_type());
        let c = |v: f64| f64t.const_float(v);
        // minnum/maxnum return the number where x is NaN: the clamped value is never NaN (no
        // poison from the conversion to an integer); NaN is put back at the end.
        let clamped = self.f64_call("llvm.minnum", &[self.f64_call("llvm.maxnum", &[x, c(-746.0)]), c(710.0)]);
        let scaled = b.build_float_mul(clamped, c(std::f64::consts::LOG2_E), "s").unwrap();
        let n = self.f64_call("llvm.floor", &[b.build_float_add(scaled, c(0.5), "s").unwrap()]);
        let hi = b.build_float_sub(clamped, b.build_float_mul(n, c(LN2_HI), "h").unwrap(), "r").unwrap();
        let r = b.build_float_sub(hi, b.build_float_mul(n, c(LN2_LO), "l").unwrap(), "r").unwrap();
        let terms = exp_terms();
        let (last, rest) = terms.split_last().expect("terms");
        let series = rest
            .iter()
            .rev()
            .fold(c(*last), |acc, &k| b.build_float_add(b.build_float_mul(acc, r, "p").unwrap(), c(k), "p").unwrap());
        let r2 = b.build_float_mul(r, r, "r2").unwrap();
        let series = b.build_float_mul(series, r2, "p").unwrap();
        let e_r = b.build_float_add(c(1.0), b.build_float_add(r, series, "p").unwrap(), "p").unwrap();
        // n in [-1076, 1024]: 2ⁿ = 2^⌊n/2⌋ · 2^(n − ⌊n/2⌋), each within [-538, 512].
        let n = b.build_float_to_signed_int(n, i64t, "n").unwrap();
        let n1 = b.build_right_shift(n, i64t.const_int(1, false), true, "n1").unwrap();
        let n2 = b.build_int_sub(n, n1, "n2").unwrap();
        let scaled = b.build_float_mul(e_r, self.f64_power_of_two(n1), "e").unwrap();
        let e = b.build_float_mul(scaled, self.f64_power_of_two(n2), "exp").unwrap();
        let nan = b.build_float_compare(FloatPredicate::UNO, x, x, "nan").unwrap();
        b.build_select(nan, x, e, "exp").unwrap().into_float_value()
    }

    /// f64 `ln(x)`: x = m·2ᵉ with m in [√½, √2) (a subnormal x scaled by 2⁵⁴ first), and
    /// ln m = 2·atanh(s) = 2s + 2s³/3 + … to s²¹, s = (m − 1)/(m + 1) (|s| ≤ 0.172, so the
    /// first term left out is below 1e-18 of the sum); ln x = e·ln 2 + ln m, ln 2 in two parts.
    /// -∞ at ±0, NaN below 0 and for NaN, +∞ at +∞.
    pub(super) fn log64(&self, x: FloatValue<'ctx>) -> FloatValue<'ctx> {
        let b = &self.builder;
        let (f64t, i64t) = (self.context.f64_type(), self.context.i64_type());
        let c = |v: f64| f64t.const_float(v);
        let int = |v: u64| i64t.const_int(v, false);
        let subnormal = b.build_float_compare(FloatPredicate::OLT, x, c(f64::MIN_POSITIVE), "sub").unwrap();
        let normal = b.build_select(subnormal, b.build_float_mul(x, c(2f64.powi(54)), "x").unwrap(), x, "x").unwrap();
        let bits = b.build_bit_cast(normal, i64t, "bits").unwrap().into_int_value();
        let field = b.build_and(b.build_right_shift(bits, int(52), false, "e").unwrap(), int(0x7ff), "e").unwrap();
        let exponent = b
            .build_int_sub(
                field,
                b.build_select(subnormal, int(1023 + 54), int(1023), "bias").unwrap().into_int_value(),
                "e",
            )
            .unwrap();
        // The mantissa with exponent 0 (m in [1, 2)), halved where it is at least √2.
        let fraction = b.build_and(bits, int((1 << 52) - 1), "m").unwrap();
        let one = b
            .build_bit_cast(b.build_or(fraction, int(1023 << 52), "m").unwrap(), f64t, "m")
            .unwrap()
            .into_float_value();
        let large = b.build_float_compare(FloatPredicate::OGE, one, c(std::f64::consts::SQRT_2), "big").unwrap();
        let m =
            b.build_select(large, b.build_float_mul(one, c(0.5), "m").unwrap(), one, "m").unwrap().into_float_value();
        let exponent = b.build_int_add(exponent, b.build_int_z_extend(large, i64t, "big").unwrap(), "e").unwrap();
        let e = b.build_signed_int_to_float(exponent, f64t, "e").unwrap();
        let s = b
            .build_float_div(
                b.build_float_sub(m, c(1.0), "s").unwrap(),
                b.build_float_add(m, c(1.0), "s").unwrap(),
                "s",
            )
            .unwrap();
        let s2 = b.build_float_mul(s, s, "s2").unwrap();
        // 2/3 + s²·(2/5 + s²·(… 2/21)).
        let series = (1..10).rev().fold(c(2.0 / 21.0), |acc, k| {
            b.build_float_add(b.build_float_mul(acc, s2, "p").unwrap(), c(2.0 / (2 * k + 1) as f64), "p").unwrap()
        });
        let tail = b.build_float_mul(b.build_float_mul(series, s2, "p").unwrap(), s, "p").unwrap();
        let ln_m = b.build_float_add(b.build_float_add(s, s, "2s").unwrap(), tail, "lnm").unwrap();
        let low = b.build_float_add(b.build_float_mul(e, c(LN2_LO), "el").unwrap(), ln_m, "l").unwrap();
        let ln = b.build_float_add(b.build_float_mul(e, c(LN2_HI), "eh").unwrap(), low, "ln").unwrap();
        let special = |predicate, bound: f64, value: f64, ln: FloatValue<'ctx>| {
            let hit = b.build_float_compare(predicate, x, c(bound), "hit").unwrap();
            b.build_select(hit, c(value), ln, "ln").unwrap().into_float_value()
        };
        let ln = special(FloatPredicate::OEQ, f64::INFINITY, f64::INFINITY, ln);
        let ln = special(FloatPredicate::OEQ, 0.0, f64::NEG_INFINITY, ln);
        // ULT: below 0, or NaN.
        special(FloatPredicate::ULT, 0.0, f64::NAN, ln)
    }
}
