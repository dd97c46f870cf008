//! Reductions, argmax, softmax, log-softmax and the cross entropies: hand-computed values.

mod common;

use common::{assert_close, ev, ev_err, t};
use dfc_interp::{InterpError, Tensor};
use dfc_ir::{DType, Op, ReduceKind};

fn reduce(kind: ReduceKind, axes: &[usize], keep_dims: bool, x: &Tensor) -> Tensor {
    ev(Op::Reduce { kind, axes: axes.to_vec(), keep_dims }, &[x])
}

#[test]
fn reductions_on_floats() {
    // [[1, 2, 3], [4, 5, 6]]
    let x = t(&[2, 3], vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let sum0 = reduce(ReduceKind::Sum, &[0], false, &x);
    assert_eq!(sum0.shape.dims(), [3]);
    assert_eq!(sum0.to_vec::<f32>(), [5.0, 7.0, 9.0]);
    let sum1 = reduce(ReduceKind::Sum, &[1], true, &x);
    assert_eq!(sum1.shape.dims(), [2, 1]);
    assert_eq!(sum1.to_vec::<f32>(), [6.0, 15.0]);
    let all = reduce(ReduceKind::Sum, &[0, 1], false, &x);
    assert_eq!(all, t(&[], vec![21.0f32]));
    let all = reduce(ReduceKind::Mean, &[1, 0], true, &x);
    assert_eq!(all, t(&[1, 1], vec![3.5f32]));
    assert_eq!(reduce(ReduceKind::Mean, &[0], false, &x).to_vec::<f32>(), [2.5, 3.5, 4.5]);
    assert_eq!(reduce(ReduceKind::Max, &[1], false, &x).to_vec::<f32>(), [3.0, 6.0]);
    assert_eq!(reduce(ReduceKind::Min, &[0], false, &x).to_vec::<f32>(), [1.0, 2.0, 3.0]);
    // No axes: the identity.
    assert_eq!(reduce(ReduceKind::Sum, &[], false, &x), x);
}

#[test]
fn reductions_over_middle_axes() {
    // x[i,j,k] = 100i + 10j + k, shape [2,3,2]; sum over axes 0 and 2 -> [3].
    let x = t(
        &[2, 3, 2],
        (0..2)
            .flat_map(|i| (0..3).flat_map(move |j| (0..2).map(move |k| 100.0 * i as f64 + 10.0 * j as f64 + k as f64)))
            .collect(),
    );
    let y = reduce(ReduceKind::Sum, &[0, 2], false, &x);
    assert_eq!(y.to_vec::<f64>(), [202.0, 242.0, 282.0]);
    let y = reduce(ReduceKind::Max, &[1], true, &x);
    assert_eq!(y.shape.dims(), [2, 1, 2]);
    assert_eq!(y.to_vec::<f64>(), [20.0, 21.0, 120.0, 121.0]);
}

#[test]
fn reductions_on_integers_and_bool() {
    let x = t(&[2, 3], vec![1i32, -2, 6, 4, 5, i32::MAX]);
    assert_eq!(reduce(ReduceKind::Sum, &[1], false, &x).to_vec::<i32>(), [5, 9i32.wrapping_add(i32::MAX)]);
    // The integer mean is the exact mean, truncated toward zero: (4 + 5 + MAX) / 3 does not
    // overflow, and 5 / 3 = 1.
    assert_eq!(reduce(ReduceKind::Mean, &[1], false, &x).to_vec::<i32>(), [1, ((9 + i32::MAX as i64) / 3) as i32]);
    assert_eq!(reduce(ReduceKind::Mean, &[0], false, &t(&[3], vec![-1i64, -1, -2])).to_vec::<i64>(), [-1]);
    let u = t(&[3], vec![250u8, 250, 1]);
    assert_eq!(reduce(ReduceKind::Sum, &[0], false, &u).to_vec::<u8>(), [245]);
    assert_eq!(reduce(ReduceKind::Mean, &[0], false, &u).to_vec::<u8>(), [167]);
    assert_eq!(reduce(ReduceKind::Max, &[0], false, &u).to_vec::<u8>(), [250]);
    assert_eq!(reduce(ReduceKind::Min, &[0], false, &u).to_vec::<u8>(), [1]);
    let b = t(&[2, 2], vec![true, false, false, false]);
    assert_eq!(reduce(ReduceKind::Max, &[1], false, &b).to_vec::<bool>(), [true, false]);
    assert_eq!(reduce(ReduceKind::Min, &[0], false, &b).to_vec::<bool>(), [false, false]);
}

#[test]
fn reductions_over_nothing() {
    let x = t(&[2, 0], Vec::<f32>::new());
    assert_eq!(reduce(ReduceKind::Sum, &[1], false, &x).to_vec::<f32>(), [0.0, 0.0]);
    assert_eq!(reduce(ReduceKind::Max, &[1], false, &x).to_vec::<f32>(), [f32::NEG_INFINITY; 2]);
    assert_eq!(reduce(ReduceKind::Min, &[1], false, &x).to_vec::<f32>(), [f32::INFINITY; 2]);
    assert!(reduce(ReduceKind::Mean, &[1], false, &x).to_vec::<f32>()[0].is_nan());
    let i = t(&[2, 0], Vec::<i32>::new());
    assert_eq!(reduce(ReduceKind::Max, &[1], false, &i).to_vec::<i32>(), [i32::MIN; 2]);
    let err = ev_err(Op::Reduce { kind: ReduceKind::Mean, axes: vec![1], keep_dims: false }, &[&i]);
    assert!(matches!(err, InterpError::InvalidValue { .. }), "{err}");
}

#[test]
fn max_propagates_nan() {
    let x = t(&[3], vec![1.0f64, f64::NAN, 3.0]);
    assert!(reduce(ReduceKind::Max, &[0], false, &x).to_vec::<f64>()[0].is_nan());
    assert!(reduce(ReduceKind::Min, &[0], false, &x).to_vec::<f64>()[0].is_nan());
}

#[test]
fn argmax_takes_the_first_maximum() {
    let x = t(&[2, 4], vec![1.0f32, 3.0, 3.0, 2.0, -1.0, -1.0, -5.0, -1.0]);
    let y = ev(Op::ArgMax { axis: 1, dtype: DType::I64 }, &[&x]);
    assert_eq!(y, t(&[2], vec![1i64, 0]));
    let y = ev(Op::ArgMax { axis: 0, dtype: DType::I32 }, &[&x]);
    assert_eq!(y, t(&[4], vec![0i32, 0, 0, 0]));
    let u = t(&[3, 2], vec![0u8, 9, 7, 9, 7, 10]);
    assert_eq!(ev(Op::ArgMax { axis: 0, dtype: DType::I32 }, &[&u]).to_vec::<i32>(), [1, 2]);
    let n = t(&[3], vec![1.0f64, f64::NAN, 5.0]);
    assert_eq!(ev(Op::ArgMax { axis: 0, dtype: DType::I32 }, &[&n]).to_vec::<i32>(), [1]);
}

#[test]
fn softmax_and_log_softmax() {
    let x = t(&[2, 3], vec![1.0f64, 2.0, 3.0, 0.0, 0.0, 0.0]);
    let s = ev(Op::Softmax { axis: 1 }, &[&x]).to_vec::<f64>();
    let z = 1.0 + std::f64::consts::E + std::f64::consts::E.powi(2);
    let first = [1.0 / z, std::f64::consts::E / z, std::f64::consts::E.powi(2) / z];
    assert_close(&s, &[first[0], first[1], first[2], 1.0 / 3.0, 1.0 / 3.0, 1.0 / 3.0], 1e-15);
    let l = ev(Op::LogSoftmax { axis: 1 }, &[&x]).to_vec::<f64>();
    let expected: Vec<f64> =
        [first[0], first[1], first[2], 1.0 / 3.0, 1.0 / 3.0, 1.0 / 3.0].iter().map(|p| p.ln()).collect();
    assert_close(&l, &expected, 1e-15);
    // Along axis 0 of the same matrix: columns.
    let s0 = ev(Op::Softmax { axis: 0 }, &[&x]).to_vec::<f64>();
    let e = std::f64::consts::E;
    let c = |v: f64| e.powf(v) / (e.powf(v) + 1.0);
    assert_close(&s0, &[c(1.0), c(2.0), c(3.0), 1.0 - c(1.0), 1.0 - c(2.0), 1.0 - c(3.0)], 1e-15);
    // Stable for large logits (f32).
    let big = t(&[3], vec![1000.0f32, 1000.0, -1000.0]);
    assert_eq!(ev(Op::Softmax { axis: 0 }, &[&big]).to_vec::<f32>(), [0.5, 0.5, 0.0]);
    let ls = ev(Op::LogSoftmax { axis: 0 }, &[&big]).to_vec::<f32>();
    assert_close(
        &ls.iter().map(|&v| f64::from(v)).collect::<Vec<_>>(),
        &[-std::f64::consts::LN_2, -std::f64::consts::LN_2, -2000.0 - std::f64::consts::LN_2],
        1e-6,
    );
}

#[test]
fn softmax_cross_entropy_over_the_last_axis() {
    let logits = t(&[2, 3], vec![1.0f64, 2.0, 3.0, 0.0, 0.0, 0.0]);
    let labels = t(&[2, 3], vec![0.0f64, 0.0, 1.0, 0.5, 0.5, 0.0]);
    let y = ev(Op::SoftmaxCrossEntropy, &[&logits, &labels]);
    assert_eq!(y.shape.dims(), [2]);
    let z = 1.0 + std::f64::consts::E + std::f64::consts::E.powi(2);
    assert_close(&y.to_vec::<f64>(), &[-(std::f64::consts::E.powi(2) / z).ln(), 3f64.ln()], 1e-15);
    // Stable: a confident right answer has a loss near 0, a confident wrong one near 1000.
    let logits = t(&[2, 2], vec![1000.0f32, -1000.0, 1000.0, -1000.0]);
    let labels = t(&[2, 2], vec![1.0f32, 0.0, 0.0, 1.0]);
    assert_eq!(ev(Op::SoftmaxCrossEntropy, &[&logits, &labels]).to_vec::<f32>(), [0.0, 2000.0]);
    // Rank 1: a scalar loss.
    let y = ev(Op::SoftmaxCrossEntropy, &[&t(&[2], vec![0.0f32, 0.0]), &t(&[2], vec![1.0f32, 0.0])]);
    assert_eq!(y.shape.dims(), [] as [usize; 0]);
    assert_close(&[f64::from(y.to_vec::<f32>()[0])], &[std::f64::consts::LN_2], 1e-7);
}

#[test]
fn sigmoid_cross_entropy_is_stable() {
    let x = t(&[5], vec![0.0f64, 2.0, -3.0, 800.0, -800.0]);
    let z = t(&[5], vec![1.0f64, 0.0, 1.0, 0.0, 1.0]);
    let y = ev(Op::SigmoidCrossEntropy, &[&x, &z]).to_vec::<f64>();
    let sig = |v: f64| 1.0 / (1.0 + (-v).exp());
    let naive = |x: f64, z: f64| -(z * sig(x).ln() + (1.0 - z) * (1.0 - sig(x)).ln());
    assert_close(&y[..3], &[naive(0.0, 1.0), naive(2.0, 0.0), naive(-3.0, 1.0)], 1e-14);
    assert_eq!(y[3..], [800.0, 800.0]);
}
