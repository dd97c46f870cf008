//! Helpers shared by the interpreter's tests.
#![allow(dead_code)]

use dfc_interp::{eval, Element, InterpError, Tensor};
use dfc_ir::{Op, Padding};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A tensor of `dims` holding `values`.
pub fn t<T: Element>(dims: &[usize], values: Vec<T>) -> Tensor {
    Tensor::from_vec(dims.to_vec(), values)
}

/// `op` on `operands`, which must succeed.
pub fn ev(op: Op, operands: &[&Tensor]) -> Tensor {
    match eval(&op, operands) {
        Ok(t) => t,
        Err(e) => panic!("`{}` failed: {e}", op.name()),
    }
}

/// `op` on `operands`, which must fail.
pub fn ev_err(op: Op, operands: &[&Tensor]) -> InterpError {
    match eval(&op, operands) {
        Ok(t) => panic!("`{}` succeeded with {t:?}", op.name()),
        Err(e) => e,
    }
}

pub fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// Uniform values in [-1, 1).
pub fn random_f64(rng: &mut ChaCha8Rng, dims: &[usize]) -> Tensor {
    let n = dims.iter().product();
    t(dims, (0..n).map(|_| rng.random::<f64>() * 2.0 - 1.0).collect())
}

pub fn random_f32(rng: &mut ChaCha8Rng, dims: &[usize]) -> Tensor {
    let n = dims.iter().product();
    t(dims, (0..n).map(|_| rng.random::<f32>() * 2.0 - 1.0).collect())
}

/// Asserts `|a - b| <= tol * max(1, |b|)` elementwise, on slices of one length. NaN matches NaN
/// (the ops' edge cases expect NaN results, and the expected values spell them out); a NaN on
/// one side alone fails.
#[track_caller]
pub fn assert_close(actual: &[f64], expected: &[f64], tol: f64) {
    assert_eq!(actual.len(), expected.len(), "lengths differ");
    for (i, (&a, &b)) in actual.iter().zip(expected).enumerate() {
        let ok = (a - b).abs() <= tol * b.abs().max(1.0) || (a.is_nan() && b.is_nan()) || a == b;
        assert!(ok, "element {i}: {a} vs expected {b} (tolerance {tol})\nactual:   {actual:?}\nexpected: {expected:?}");
    }
}

pub fn conv(strides: [usize; 2], padding: Padding) -> Op {
    Op::Conv2d { strides, padding }
}
