//! Element types as the kernels see them: `Scalar` (every type, bool included), `Num` (what
//! arithmetic accepts) and `Float` (f32 and f64). The arithmetic of every op on every element
//! type is defined here, in one place:
//!
//! - Integers wrap on overflow (as NumPy and TensorFlow do): `add`, `sub`, `mul`, `neg`, `abs`
//!   and `pow` are the `wrapping_*` operations. Division truncates toward zero; a zero divisor
//!   and a negative integer exponent are run-time errors, checked before the kernel runs.
//! - Floats follow IEEE 754. `maximum` and `minimum` propagate NaN (as NumPy's `maximum`).
//! - Bool is ordered `false < true`; its "sum" (used by `scatter_add` and the accumulation
//!   of `pad`-like ops) is logical or.

use crate::tensor::Element;
use std::fmt::Debug;

/// A run-time failure of a kernel, without the node it happened in (the caller adds that).
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Fault {
    IndexOutOfRange { index: i64, size: usize },
    DivisionByZero,
    Invalid(String),
}

pub(crate) trait Scalar: Element + Debug {
    /// 0, or `false`.
    fn zero() -> Self;
    /// 1, or `true`.
    fn one() -> Self;
    /// The identity of `maximum`: -inf, the type's minimum, or `false`.
    fn lowest() -> Self;
    /// The identity of `minimum`: +inf, the type's maximum, or `true`.
    fn highest() -> Self;
    fn is_nan(self) -> bool {
        false
    }
    /// `self + other` for accumulating gradients and scattered rows: wrapping for integers,
    /// logical or for bool.
    fn accumulate(self, other: Self) -> Self;

    // Conversions, exactly as Rust's `as` (float to int saturates, NaN gives 0); to bool is
    // `!= 0`, from bool is 0 or 1.
    fn to_f32(self) -> f32;
    fn to_f64(self) -> f64;
    fn to_i32(self) -> i32;
    fn to_i64(self) -> i64;
    fn to_u8(self) -> u8;
    fn to_bool(self) -> bool;
}

/// Whether `candidate` replaces `best` as the running maximum: it is larger, or it is the
/// first NaN. Scanning in order with this rule finds the *first* maximum (ties keep the
/// earlier element) and lets NaN win, as NumPy's `max` and `argmax` do.
pub(crate) fn beats_max<T: Scalar>(candidate: T, best: T) -> bool {
    candidate > best || (candidate.is_nan() && !best.is_nan())
}

/// The rule of `beats_max` for the minimum.
pub(crate) fn beats_min<T: Scalar>(candidate: T, best: T) -> bool {
    candidate < best || (candidate.is_nan() && !best.is_nan())
}

/// The larger of two values; NaN if either is NaN; `a` on ties.
pub(crate) fn maximum<T: Scalar>(a: T, b: T) -> T {
    if beats_max(b, a) {
        b
    } else {
        a
    }
}

/// The smaller of two values; NaN if either is NaN; `a` on ties.
pub(crate) fn minimum<T: Scalar>(a: T, b: T) -> T {
    if beats_min(b, a) {
        b
    } else {
        a
    }
}

pub(crate) trait Num: Scalar {
    fn add(self, other: Self) -> Self;
    fn sub(self, other: Self) -> Self;
    fn mul(self, other: Self) -> Self;
    /// Integer division truncates toward zero. Callers check divisors with `check_divisors`
    /// first; a zero divisor that slips through gives 0 rather than a panic.
    fn div(self, other: Self) -> Self;
    /// Callers check exponents with `check_exponents` first.
    fn pow(self, exponent: Self) -> Self;
    fn neg(self) -> Self;
    fn abs(self) -> Self;
    /// `max(x, 0)`, NaN staying NaN.
    fn relu(self) -> Self {
        maximum(self, Self::zero())
    }
    /// An error if integer division by any of `divisors` is undefined.
    fn check_divisors(_divisors: &[Self]) -> Result<(), Fault> {
        Ok(())
    }
    /// An error if any of `exponents` is a negative integer.
    fn check_exponents(_exponents: &[Self]) -> Result<(), Fault> {
        Ok(())
    }
    /// The mean of `values`. Floats: their sum in order, divided by the count (0/0 = NaN for
    /// none). Integers: the exact sum divided by the count, truncated toward zero (the mean of
    /// values of a type always fits the type); no values is an error.
    fn mean(values: &[Self]) -> Result<Self, Fault>;
}

pub(crate) trait Float: Num {
    fn from_f64(value: f64) -> Self;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn ln_1p(self) -> Self;
    fn sqrt(self) -> Self;
    fn tanh(self) -> Self;
    /// `1 / (1 + exp(-x))`, computed so that neither branch overflows.
    fn sigmoid(self) -> Self {
        if self >= Self::zero() {
            Self::one().div(Self::one().add(self.neg().exp()))
        } else {
            let e = self.exp();
            e.div(Self::one().add(e))
        }
    }
}

macro_rules! conversions {
    () => {
        fn to_f32(self) -> f32 {
            self as f32
        }
        fn to_f64(self) -> f64 {
            self as f64
        }
        fn to_i32(self) -> i32 {
            self as i32
        }
        fn to_i64(self) -> i64 {
            self as i64
        }
        fn to_u8(self) -> u8 {
            self as u8
        }
    };
}

macro_rules! float {
    ($t:ty) => {
        impl Scalar for $t {
            fn zero() -> Self {
                0.0
            }
            fn one() -> Self {
                1.0
            }
            fn lowest() -> Self {
                <$t>::NEG_INFINITY
            }
            fn highest() -> Self {
                <$t>::INFINITY
            }
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
            fn accumulate(self, other: Self) -> Self {
                self + other
            }
            fn to_bool(self) -> bool {
                self != 0.0
            }
            conversions!();
        }

        impl Num for $t {
            fn add(self, other: Self) -> Self {
                self + other
            }
            fn sub(self, other: Self) -> Self {
                self - other
            }
            fn mul(self, other: Self) -> Self {
                self * other
            }
            fn div(self, other: Self) -> Self {
                self / other
            }
            fn pow(self, exponent: Self) -> Self {
                self.powf(exponent)
            }
            fn neg(self) -> Self {
                -self
            }
            fn abs(self) -> Self {
                <$t>::abs(self)
            }
            fn mean(values: &[Self]) -> Result<Self, Fault> {
                let sum = values.iter().fold(0.0, |acc: $t, &x| acc + x);
                Ok(sum / values.len() as $t)
            }
        }

        impl Float for $t {
            fn from_f64(value: f64) -> Self {
                value as $t
            }
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            fn ln_1p(self) -> Self {
                <$t>::ln_1p(self)
            }
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            fn tanh(self) -> Self {
                <$t>::tanh(self)
            }
        }
    };
}

float!(f32);
float!(f64);

macro_rules! integer {
    ($t:ty) => {
        impl Scalar for $t {
            fn zero() -> Self {
                0
            }
            fn one() -> Self {
                1
            }
            fn lowest() -> Self {
                <$t>::MIN
            }
            fn highest() -> Self {
                <$t>::MAX
            }
            fn accumulate(self, other: Self) -> Self {
                self.wrapping_add(other)
            }
            fn to_bool(self) -> bool {
                self != 0
            }
            conversions!();
        }

        impl Num for $t {
            fn add(self, other: Self) -> Self {
                self.wrapping_add(other)
            }
            fn sub(self, other: Self) -> Self {
                self.wrapping_sub(other)
            }
            fn mul(self, other: Self) -> Self {
                self.wrapping_mul(other)
            }
            fn div(self, other: Self) -> Self {
                // `wrapping_div` truncates toward zero; MIN / -1 wraps to MIN.
                if other == 0 {
                    0
                } else {
                    self.wrapping_div(other)
                }
            }
            fn pow(self, exponent: Self) -> Self {
                // Square and multiply over the bits of the exponent, wrapping.
                let mut result: $t = 1;
                let mut base = self;
                let mut e = exponent.max(0) as u64;
                while e > 0 {
                    if e & 1 == 1 {
                        result = result.wrapping_mul(base);
                    }
                    base = base.wrapping_mul(base);
                    e >>= 1;
                }
                result
            }
            fn neg(self) -> Self {
                self.wrapping_neg()
            }
            fn abs(self) -> Self {
                if self < Self::zero() {
                    self.wrapping_neg()
                } else {
                    self
                }
            }
            fn check_divisors(divisors: &[Self]) -> Result<(), Fault> {
                if divisors.contains(&0) {
                    return Err(Fault::DivisionByZero);
                }
                Ok(())
            }
            fn check_exponents(exponents: &[Self]) -> Result<(), Fault> {
                if let Some(e) = exponents.iter().find(|&&e| e < Self::zero()) {
                    return Err(Fault::Invalid(format!(
                        "integers to negative integer powers are not allowed (exponent {e})"
                    )));
                }
                Ok(())
            }
            fn mean(values: &[Self]) -> Result<Self, Fault> {
                if values.is_empty() {
                    return Err(Fault::Invalid("the integer mean of no elements is undefined".into()));
                }
                let sum: i128 = values.iter().map(|&x| x as i128).sum();
                Ok((sum / values.len() as i128) as $t)
            }
        }
    };
}

integer!(i32);
integer!(i64);
integer!(u8);

impl Scalar for bool {
    fn zero() -> Self {
        false
    }
    fn one() -> Self {
        true
    }
    fn lowest() -> Self {
        false
    }
    fn highest() -> Self {
        true
    }
    fn accumulate(self, other: Self) -> Self {
        self || other
    }
    fn to_f32(self) -> f32 {
        f32::from(u8::from(self))
    }
    fn to_f64(self) -> f64 {
        f64::from(u8::from(self))
    }
    fn to_i32(self) -> i32 {
        i32::from(self)
    }
    fn to_i64(self) -> i64 {
        i64::from(self)
    }
    fn to_u8(self) -> u8 {
        u8::from(self)
    }
    fn to_bool(self) -> bool {
        self
    }
}
