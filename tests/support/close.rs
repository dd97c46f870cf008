//! Comparing floating-point results in tests so that nothing passes by accident: slices of
//! different lengths fail (where `zip` would compare the shorter prefix), and a NaN on either
//! side fails (where `f64::max` would drop it, and `d > tolerance` would be false). Shared by the
//! tests of every crate (`#[path]`-included); `tests/comparisons.rs` checks it.
#![allow(dead_code)]

/// `|actual - expected|`.
pub fn absolute(actual: f64, expected: f64) -> f64 {
    (actual - expected).abs()
}

/// `|actual - expected| / (1 + |expected|)`: relative for large values, absolute near zero.
pub fn relative(actual: f64, expected: f64) -> f64 {
    (actual - expected).abs() / (1.0 + expected.abs())
}

/// The largest `measure(actual[i], expected[i])`, or NaN if any is NaN (a NaN on either side,
/// or infinities that do not cancel); fails if the lengths differ.
#[track_caller]
pub fn worst_difference(what: &str, actual: &[f64], expected: &[f64], measure: fn(f64, f64) -> f64) -> f64 {
    assert_eq!(actual.len(), expected.len(), "{what}: {} values where {} were expected", actual.len(), expected.len());
    let mut worst = 0.0f64;
    for (&a, &e) in actual.iter().zip(expected) {
        let d = measure(a, e);
        if d.is_nan() || d > worst {
            worst = d;
        }
        if worst.is_nan() {
            break;
        }
    }
    worst
}

/// Asserts that `actual` has `expected`'s length and that every element is within `tolerance`
/// of it by [`relative`]; a NaN on either side fails.
#[track_caller]
pub fn assert_close(what: &str, actual: &[f64], expected: &[f64], tolerance: f64) {
    let worst = worst_difference(what, actual, expected, relative);
    assert!(
        worst <= tolerance,
        "{what}: differs by up to {worst:e} (tolerance {tolerance:e})\n  actual   {actual:?}\n  expected {expected:?}"
    );
}

/// `values` as f64s.
pub fn f64s(values: &[f32]) -> Vec<f64> {
    values.iter().map(|&v| f64::from(v)).collect()
}
