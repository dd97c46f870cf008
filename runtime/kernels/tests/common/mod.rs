//! Helpers shared by the tests: random data and the reference interpreter.

#![allow(dead_code)]

use dfc_interp::{Element, Tensor};
use dfc_ir::Op;

pub fn rng(seed: u64) -> fastrand::Rng {
    fastrand::Rng::with_seed(seed)
}

/// Uniform in [-1, 1).
pub fn random(len: usize, rng: &mut fastrand::Rng) -> Vec<f32> {
    (0..len).map(|_| rng.f32() * 2.0 - 1.0).collect()
}

/// Small integers as f32, so that maxima tie often.
pub fn ties(len: usize, rng: &mut fastrand::Rng) -> Vec<f32> {
    (0..len).map(|_| rng.u8(0..3) as f32).collect()
}

pub fn tensor<T: Element>(dims: &[usize], values: Vec<T>) -> Tensor {
    Tensor::from_vec(dims.to_vec(), values)
}

/// The interpreter's result of `op` on `operands`, as a vector of `T`.
pub fn eval<T: Element>(op: &Op, operands: &[&Tensor]) -> Vec<T> {
    dfc_interp::eval(op, operands).unwrap_or_else(|e| panic!("{op:?}: {e}")).to_vec::<T>()
}

/// Bitwise equality of f32 vectors (every NaN equal to every NaN).
pub fn assert_same_f32(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()), "{what}: element {i}: {g:?} != {w:?}");
    }
}

/// Tolerance for f32 sums: `|got - want| <= 1e-4 * magnitude + 1e-6`, where `magnitude` is the
/// same sum taken over the absolute values of its terms (the reference run on |operands|), so
/// the bound is relative to the size of the terms even where they cancel.
pub fn assert_close(got: &[f32], want: &[f32], magnitude: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    for i in 0..got.len() {
        let tol = 1e-4 * magnitude[i] + 1e-6;
        assert!((got[i] - want[i]).abs() <= tol, "{what}: element {i}: {} vs {} (tolerance {tol})", got[i], want[i]);
    }
}

pub fn abs(v: &[f32]) -> Vec<f32> {
    v.iter().map(|x| x.abs()).collect()
}
