//! Elementwise ops: unary, binary and comparison (NumPy broadcasting), select and cast.

use crate::layout::broadcast;
use crate::scalar::{maximum, minimum, Fault, Float, Num, Scalar};
use crate::tensor::Data;
use dfc_ir::{broadcast_shapes, BinaryOp, CompareOp, DType, UnaryOp};

/// `neg`, `abs`, `relu` on any number (integers wrap: `neg(MIN) = MIN`, `abs(MIN) = MIN`).
pub(crate) fn unary_num<T: Num>(op: UnaryOp, x: &[T]) -> Vec<T> {
    match op {
        UnaryOp::Neg => x.iter().map(|&a| a.neg()).collect(),
        UnaryOp::Abs => x.iter().map(|&a| a.abs()).collect(),
        UnaryOp::Relu => x.iter().map(|&a| a.relu()).collect(),
        _ => unreachable!("`{}` takes floats only", op.name()),
    }
}

/// The unary ops defined on floats only. `rsqrt(x) = 1 / sqrt(x)`; `sigmoid` is computed
/// without overflow.
pub(crate) fn unary_float<T: Float>(op: UnaryOp, x: &[T]) -> Vec<T> {
    match op {
        UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Relu => unary_num(op, x),
        UnaryOp::Exp => x.iter().map(|&a| a.exp()).collect(),
        UnaryOp::Log => x.iter().map(|&a| a.ln()).collect(),
        UnaryOp::Sqrt => x.iter().map(|&a| a.sqrt()).collect(),
        UnaryOp::Rsqrt => x.iter().map(|&a| T::one().div(a.sqrt())).collect(),
        UnaryOp::Sigmoid => x.iter().map(|&a| a.sigmoid()).collect(),
        UnaryOp::Tanh => x.iter().map(|&a| a.tanh()).collect(),
    }
}

/// The broadcast shape of two operands (already checked by `infer`).
pub(crate) fn broadcast_dims(a: &[usize], b: &[usize]) -> Vec<usize> {
    broadcast_shapes(&a.to_vec().into(), &b.to_vec().into()).expect("`infer` checked that the shapes broadcast").0
}

/// `f(a, b)` elementwise over the broadcast shape `out`.
fn zip_broadcast<A: Copy, B: Copy, C>(
    a: &[A],
    a_dims: &[usize],
    b: &[B],
    b_dims: &[usize],
    out: &[usize],
    f: impl Fn(A, B) -> C,
) -> Vec<C> {
    let a = broadcast(a, a_dims, out);
    let b = broadcast(b, b_dims, out);
    a.iter().zip(b.iter()).map(|(&x, &y)| f(x, y)).collect()
}

/// A binary arithmetic op with broadcasting. Integer `div` by zero and integer `pow` with a
/// negative exponent are errors (checked over the divisors/exponents before computing).
pub(crate) fn binary<T: Num>(
    op: BinaryOp,
    a: &[T],
    a_dims: &[usize],
    b: &[T],
    b_dims: &[usize],
) -> Result<(Vec<usize>, Vec<T>), Fault> {
    let out = broadcast_dims(a_dims, b_dims);
    let has_elements = out.iter().product::<usize>() > 0;
    // A macro rather than a closure taking `fn` pointers, so that each op's loop is
    // compiled (and vectorised) on its own.
    macro_rules! z {
        ($f:expr) => {
            zip_broadcast(a, a_dims, b, b_dims, &out, $f)
        };
    }
    let values = match op {
        BinaryOp::Add => z!(T::add),
        BinaryOp::Sub => z!(T::sub),
        BinaryOp::Mul => z!(T::mul),
        BinaryOp::Div => {
            if has_elements {
                T::check_divisors(b)?;
            }
            z!(T::div)
        }
        BinaryOp::Pow => {
            if has_elements {
                T::check_exponents(b)?;
            }
            z!(T::pow)
        }
        BinaryOp::Maximum => z!(maximum),
        BinaryOp::Minimum => z!(minimum),
    };
    Ok((out, values))
}

/// A comparison with broadcasting, IEEE on floats (every comparison with NaN is false but
/// `not_equal`), `false < true` on bool.
pub(crate) fn compare<T: Scalar>(
    op: CompareOp,
    a: &[T],
    a_dims: &[usize],
    b: &[T],
    b_dims: &[usize],
) -> (Vec<usize>, Vec<bool>) {
    let out = broadcast_dims(a_dims, b_dims);
    macro_rules! z {
        ($f:expr) => {
            zip_broadcast(a, a_dims, b, b_dims, &out, $f)
        };
    }
    let values = match op {
        CompareOp::Equal => z!(|x, y| x == y),
        CompareOp::NotEqual => z!(|x, y| x != y),
        CompareOp::Less => z!(|x, y| x < y),
        CompareOp::LessEqual => z!(|x, y| x <= y),
        CompareOp::Greater => z!(|x, y| x > y),
        CompareOp::GreaterEqual => z!(|x, y| x >= y),
    };
    (out, values)
}

/// `cond ? a : b` elementwise over the broadcast shape of all three.
pub(crate) fn select<T: Scalar>(
    cond: &[bool],
    cond_dims: &[usize],
    a: &[T],
    a_dims: &[usize],
    b: &[T],
    b_dims: &[usize],
) -> (Vec<usize>, Vec<T>) {
    let out = broadcast_dims(&broadcast_dims(cond_dims, a_dims), b_dims);
    let cond = broadcast(cond, cond_dims, &out);
    let a = broadcast(a, a_dims, &out);
    let b = broadcast(b, b_dims, &out);
    let values = cond.iter().zip(a.iter().zip(b.iter())).map(|(&c, (&x, &y))| if c { x } else { y }).collect();
    (out, values)
}

/// Conversion to `to`, element by element, exactly as Rust's `as`: float to integer rounds
/// toward zero and saturates (NaN gives 0), integer to integer wraps, to bool is `!= 0`, bool
/// to a number is 0 or 1.
pub(crate) fn cast<T: Scalar>(x: &[T], to: DType) -> Data {
    match to {
        DType::F32 => Data::F32(x.iter().map(|&v| v.to_f32()).collect()),
        DType::F64 => Data::F64(x.iter().map(|&v| v.to_f64()).collect()),
        DType::I32 => Data::I32(x.iter().map(|&v| v.to_i32()).collect()),
        DType::I64 => Data::I64(x.iter().map(|&v| v.to_i64()).collect()),
        DType::U8 => Data::U8(x.iter().map(|&v| v.to_u8()).collect()),
        DType::Bool => Data::Bool(x.iter().map(|&v| v.to_bool()).collect()),
    }
}
