//! Unary, binary, comparison, select and cast: hand-computed values on every element type.

mod common;

use common::{assert_close, ev, ev_err, t};
use dfc_interp::{InterpError, Tensor};
use dfc_ir::{BinaryOp, CompareOp, DType, Op, UnaryOp};

fn unary(op: UnaryOp, x: &Tensor) -> Tensor {
    ev(Op::Unary(op), &[x])
}

fn binary(op: BinaryOp, a: &Tensor, b: &Tensor) -> Tensor {
    ev(Op::Binary(op), &[a, b])
}

#[test]
fn unary_ops_on_floats() {
    let x = t(&[4], vec![-2.0f64, -0.5, 0.0, 1.5]);
    let e = std::f64::consts::E;
    assert_eq!(unary(UnaryOp::Neg, &x).to_vec::<f64>(), [2.0, 0.5, -0.0, -1.5]);
    assert_eq!(unary(UnaryOp::Abs, &x).to_vec::<f64>(), [2.0, 0.5, 0.0, 1.5]);
    assert_eq!(unary(UnaryOp::Relu, &x).to_vec::<f64>(), [0.0, 0.0, 0.0, 1.5]);
    assert_close(&unary(UnaryOp::Exp, &x).to_vec::<f64>(), &[1.0 / (e * e), 1.0 / e.sqrt(), 1.0, e.powf(1.5)], 1e-15);
    assert_close(
        &unary(UnaryOp::Tanh, &x).to_vec::<f64>(),
        &[-0.964_027_580_075_817, -0.462_117_157_260_009_8, 0.0, 0.905_148_253_644_866_6],
        1e-15,
    );
    assert_close(
        &unary(UnaryOp::Sigmoid, &x).to_vec::<f64>(),
        &[0.119_202_922_022_117_57, 0.377_540_668_798_145_4, 0.5, 0.817_574_476_193_643_6],
        1e-15,
    );

    let p = t(&[3], vec![0.25f32, 1.0, 4.0]);
    assert_eq!(unary(UnaryOp::Sqrt, &p).to_vec::<f32>(), [0.5, 1.0, 2.0]);
    assert_eq!(unary(UnaryOp::Rsqrt, &p).to_vec::<f32>(), [2.0, 1.0, 0.5]);
    assert_close(
        &unary(UnaryOp::Log, &p).to_vec::<f32>().iter().map(|&v| f64::from(v)).collect::<Vec<_>>(),
        &[-1.386_294_4, 0.0, 1.386_294_4],
        1e-6,
    );
    // Edge values: log 0 = -inf, sqrt of a negative = NaN, relu keeps NaN.
    let edge = t(&[3], vec![0.0f32, -1.0, f32::NAN]);
    assert_eq!(unary(UnaryOp::Log, &edge).to_vec::<f32>()[0], f32::NEG_INFINITY);
    assert!(unary(UnaryOp::Sqrt, &edge).to_vec::<f32>()[1].is_nan());
    assert!(unary(UnaryOp::Relu, &edge).to_vec::<f32>()[2].is_nan());
}

#[test]
fn sigmoid_does_not_overflow() {
    let x = t(&[4], vec![-1000.0f32, -90.0, 90.0, 1000.0]);
    let y = unary(UnaryOp::Sigmoid, &x).to_vec::<f32>();
    assert_eq!(y[0], 0.0);
    assert!(y[1] > 0.0 && y[1] < 1e-38, "{}", y[1]);
    assert_eq!(y[2], 1.0);
    assert_eq!(y[3], 1.0);
}

#[test]
fn unary_ops_on_integers_wrap() {
    let x = t(&[4], vec![-3i32, 0, 5, i32::MIN]);
    assert_eq!(unary(UnaryOp::Neg, &x).to_vec::<i32>(), [3, 0, -5, i32::MIN]);
    assert_eq!(unary(UnaryOp::Abs, &x).to_vec::<i32>(), [3, 0, 5, i32::MIN]);
    assert_eq!(unary(UnaryOp::Relu, &x).to_vec::<i32>(), [0, 0, 5, 0]);
    let y = t(&[2], vec![-7i64, 7]);
    assert_eq!(unary(UnaryOp::Neg, &y).to_vec::<i64>(), [7, -7]);
    assert_eq!(unary(UnaryOp::Abs, &y).to_vec::<i64>(), [7, 7]);
    let u = t(&[3], vec![0u8, 1, 200]);
    assert_eq!(unary(UnaryOp::Neg, &u).to_vec::<u8>(), [0, 255, 56]);
    assert_eq!(unary(UnaryOp::Abs, &u).to_vec::<u8>(), [0, 1, 200]);
    assert_eq!(unary(UnaryOp::Relu, &u).to_vec::<u8>(), [0, 1, 200]);
}

#[test]
fn transcendental_ops_refuse_integers() {
    let x = t(&[1], vec![4i32]);
    let err = ev_err(Op::Unary(UnaryOp::Sqrt), &[&x]);
    assert!(matches!(err, InterpError::Malformed { .. }), "{err}");
    assert!(err.to_string().contains("takes f32 or f64"), "{err}");
}

#[test]
fn binary_ops_on_floats() {
    let a = t(&[4], vec![1.0f32, -2.0, 3.0, 2.0]);
    let b = t(&[4], vec![4.0f32, 0.5, -3.0, 0.0]);
    assert_eq!(binary(BinaryOp::Add, &a, &b).to_vec::<f32>(), [5.0, -1.5, 0.0, 2.0]);
    assert_eq!(binary(BinaryOp::Sub, &a, &b).to_vec::<f32>(), [-3.0, -2.5, 6.0, 2.0]);
    assert_eq!(binary(BinaryOp::Mul, &a, &b).to_vec::<f32>(), [4.0, -1.0, -9.0, 0.0]);
    assert_eq!(binary(BinaryOp::Div, &a, &b).to_vec::<f32>(), [0.25, -4.0, -1.0, f32::INFINITY]);
    let pow: Vec<f64> = binary(BinaryOp::Pow, &a, &b).to_vec::<f32>().iter().map(|&v| f64::from(v)).collect();
    assert_close(&pow, &[1.0, f64::NAN, 1.0 / 27.0, 1.0], 1e-7);
    assert_eq!(binary(BinaryOp::Maximum, &a, &b).to_vec::<f32>(), [4.0, 0.5, 3.0, 2.0]);
    assert_eq!(binary(BinaryOp::Minimum, &a, &b).to_vec::<f32>(), [1.0, -2.0, -3.0, 0.0]);
}

#[test]
fn maximum_and_minimum_propagate_nan() {
    let a = t(&[3], vec![f64::NAN, 1.0, 2.0]);
    let b = t(&[3], vec![1.0, f64::NAN, 3.0]);
    let max = binary(BinaryOp::Maximum, &a, &b).to_vec::<f64>();
    let min = binary(BinaryOp::Minimum, &a, &b).to_vec::<f64>();
    assert!(max[0].is_nan() && max[1].is_nan() && max[2] == 3.0, "{max:?}");
    assert!(min[0].is_nan() && min[1].is_nan() && min[2] == 2.0, "{min:?}");
}

#[test]
fn binary_ops_on_integers() {
    let a = t(&[6], vec![7i32, -7, 7, -7, 2, i32::MAX]);
    let b = t(&[6], vec![2i32, 2, -2, -2, 10, 1]);
    assert_eq!(binary(BinaryOp::Add, &a, &b).to_vec::<i32>(), [9, -5, 5, -9, 12, i32::MIN]);
    assert_eq!(binary(BinaryOp::Sub, &a, &b).to_vec::<i32>(), [5, -9, 9, -5, -8, i32::MAX - 1]);
    assert_eq!(binary(BinaryOp::Mul, &a, &b).to_vec::<i32>(), [14, -14, -14, 14, 20, i32::MAX]);
    // Division truncates toward zero.
    assert_eq!(binary(BinaryOp::Div, &a, &b).to_vec::<i32>(), [3, -3, -3, 3, 0, i32::MAX]);
    assert_eq!(binary(BinaryOp::Maximum, &a, &b).to_vec::<i32>(), [7, 2, 7, -2, 10, i32::MAX]);
    assert_eq!(binary(BinaryOp::Minimum, &a, &b).to_vec::<i32>(), [2, -7, -2, -7, 2, 1]);
    let base = t(&[5], vec![3i64, -2, 0, 5, 2]);
    let exp = t(&[5], vec![4i64, 3, 0, 1, 63]);
    assert_eq!(binary(BinaryOp::Pow, &base, &exp).to_vec::<i64>(), [81, -8, 1, 5, i64::MIN]);
    let u = t(&[3], vec![200u8, 10, 3]);
    let v = t(&[3], vec![100u8, 20, 2]);
    assert_eq!(binary(BinaryOp::Add, &u, &v).to_vec::<u8>(), [44, 30, 5]);
    assert_eq!(binary(BinaryOp::Sub, &u, &v).to_vec::<u8>(), [100, 246, 1]);
    assert_eq!(binary(BinaryOp::Div, &u, &v).to_vec::<u8>(), [2, 0, 1]);
    assert_eq!(binary(BinaryOp::Pow, &u, &v).to_vec::<u8>(), [0, 0, 9]);
}

#[test]
fn integer_division_by_zero_is_an_error() {
    let a = t(&[2], vec![1i32, 2]);
    let b = t(&[2], vec![1i32, 0]);
    let err = ev_err(Op::Binary(BinaryOp::Div), &[&a, &b]);
    assert_eq!(err, InterpError::DivisionByZero { node: "div".into() });
    assert_eq!(err.to_string(), "`div`: integer division by zero");
    let err = ev_err(Op::Binary(BinaryOp::Div), &[&t(&[1], vec![5u8]), &t(&[], vec![0u8])]);
    assert!(matches!(err, InterpError::DivisionByZero { .. }));
}

#[test]
fn integer_negative_powers_are_an_error() {
    let err = ev_err(Op::Binary(BinaryOp::Pow), &[&t(&[1], vec![2i64]), &t(&[1], vec![-1i64])]);
    assert!(matches!(err, InterpError::InvalidValue { .. }), "{err}");
    assert!(err.to_string().contains("negative integer powers"), "{err}");
}

#[test]
fn broadcasting_follows_numpy() {
    // [2,3] + [3]
    let a = t(&[2, 3], vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let b = t(&[3], vec![10.0f32, 20.0, 30.0]);
    let y = binary(BinaryOp::Add, &a, &b);
    assert_eq!(y.shape.dims(), [2, 3]);
    assert_eq!(y.to_vec::<f32>(), [11.0, 22.0, 33.0, 14.0, 25.0, 36.0]);
    // [3] - [2,3]: the left operand broadcasts.
    assert_eq!(binary(BinaryOp::Sub, &b, &a).to_vec::<f32>(), [9.0, 18.0, 27.0, 6.0, 15.0, 24.0]);
    // [3,1] * [1,4] -> [3,4]
    let c = t(&[3, 1], vec![1i32, 2, 3]);
    let d = t(&[1, 4], vec![1i32, 10, 100, 1000]);
    let y = binary(BinaryOp::Mul, &c, &d);
    assert_eq!(y.shape.dims(), [3, 4]);
    assert_eq!(y.to_vec::<i32>(), [1, 10, 100, 1000, 2, 20, 200, 2000, 3, 30, 300, 3000]);
    // scalar with a matrix, both ways round.
    let s = t(&[], vec![2.0f64]);
    let m = t(&[2, 2], vec![1.0f64, 2.0, 3.0, 4.0]);
    assert_eq!(binary(BinaryOp::Div, &m, &s).to_vec::<f64>(), [0.5, 1.0, 1.5, 2.0]);
    assert_eq!(binary(BinaryOp::Div, &s, &m).to_vec::<f64>(), [2.0, 1.0, 2.0 / 3.0, 0.5]);
    // [2,1,3] + [4,1] -> [2,4,3]
    let e = t(&[2, 1, 3], vec![0i64, 1, 2, 10, 11, 12]);
    let f = t(&[4, 1], vec![100i64, 200, 300, 400]);
    let y = binary(BinaryOp::Add, &e, &f);
    assert_eq!(y.shape.dims(), [2, 4, 3]);
    let expected: Vec<i64> =
        (0..2).flat_map(|i| (1..=4).flat_map(move |j| (0..3).map(move |k| 100 * j + 10 * i + k))).collect();
    assert_eq!(y.to_vec::<i64>(), expected);
    // Shapes that do not broadcast are refused before anything runs.
    let err = ev_err(Op::Binary(BinaryOp::Add), &[&t(&[3], vec![0.0f32; 3]), &t(&[4], vec![0.0f32; 4])]);
    assert!(err.to_string().contains("do not broadcast"), "{err}");
}

#[test]
fn comparisons_give_bool_with_broadcasting() {
    let a = t(&[2, 2], vec![1.0f32, 2.0, 3.0, f32::NAN]);
    let b = t(&[2], vec![2.0f32, 2.0]);
    let cmp = |op| ev(Op::Compare(op), &[&a, &b]).to_vec::<bool>();
    assert_eq!(cmp(CompareOp::Equal), [false, true, false, false]);
    assert_eq!(cmp(CompareOp::NotEqual), [true, false, true, true]);
    assert_eq!(cmp(CompareOp::Less), [true, false, false, false]);
    assert_eq!(cmp(CompareOp::LessEqual), [true, true, false, false]);
    assert_eq!(cmp(CompareOp::Greater), [false, false, true, false]);
    assert_eq!(cmp(CompareOp::GreaterEqual), [false, true, true, false]);
    let i = t(&[3], vec![-1i64, 0, 1]);
    let zero = t(&[], vec![0i64]);
    assert_eq!(ev(Op::Compare(CompareOp::Greater), &[&i, &zero]).to_vec::<bool>(), [false, false, true]);
    let u = t(&[2], vec![3u8, 200]);
    assert_eq!(ev(Op::Compare(CompareOp::Less), &[&u, &t(&[], vec![100u8])]).to_vec::<bool>(), [true, false]);
    let p = t(&[3], vec![true, false, true]);
    let q = t(&[1], vec![true]);
    assert_eq!(ev(Op::Compare(CompareOp::Equal), &[&p, &q]).to_vec::<bool>(), [true, false, true]);
    assert_eq!(ev(Op::Compare(CompareOp::NotEqual), &[&p, &q]).to_vec::<bool>(), [false, true, false]);
}

#[test]
fn select_broadcasts_all_three_operands() {
    let cond = t(&[2, 1], vec![true, false]);
    let a = t(&[3], vec![1i32, 2, 3]);
    let b = t(&[], vec![-1i32]);
    let y = ev(Op::Select, &[&cond, &a, &b]);
    assert_eq!(y.shape.dims(), [2, 3]);
    assert_eq!(y.to_vec::<i32>(), [1, 2, 3, -1, -1, -1]);
    let c = t(&[3], vec![false, true, false]);
    let x = t(&[2, 3], vec![1.0f64, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let z = t(&[2, 1], vec![0.0f64, 10.0]);
    assert_eq!(ev(Op::Select, &[&c, &x, &z]).to_vec::<f64>(), [0.0, 2.0, 0.0, 10.0, 5.0, 10.0]);
    let bools = ev(Op::Select, &[&c, &t(&[3], vec![true; 3]), &t(&[3], vec![false; 3])]);
    assert_eq!(bools.to_vec::<bool>(), [false, true, false]);
}

#[test]
fn cast_is_rust_as() {
    let x = t(&[7], vec![-1.7f32, -0.0, 0.4, 2.9, 300.5, f32::NAN, 1e20]);
    assert_eq!(ev(Op::Cast { to: DType::I32 }, &[&x]).to_vec::<i32>(), [-1, 0, 0, 2, 300, 0, i32::MAX]);
    assert_eq!(ev(Op::Cast { to: DType::U8 }, &[&x]).to_vec::<u8>(), [0, 0, 0, 2, 255, 0, 255]);
    assert_eq!(ev(Op::Cast { to: DType::I64 }, &[&x]).to_vec::<i64>(), [-1, 0, 0, 2, 300, 0, i64::MAX]);
    assert_eq!(ev(Op::Cast { to: DType::Bool }, &[&x]).to_vec::<bool>(), [true, false, true, true, true, true, true]);
    assert_eq!(
        ev(Op::Cast { to: DType::F64 }, &[&x]).to_vec::<f64>()[..5],
        [-1.7f32 as f64, -0.0, 0.4f32 as f64, 2.9f32 as f64, 300.5]
    );

    let b = t(&[2], vec![true, false]);
    assert_eq!(ev(Op::Cast { to: DType::F32 }, &[&b]).to_vec::<f32>(), [1.0, 0.0]);
    assert_eq!(ev(Op::Cast { to: DType::F64 }, &[&b]).to_vec::<f64>(), [1.0, 0.0]);
    assert_eq!(ev(Op::Cast { to: DType::I32 }, &[&b]).to_vec::<i32>(), [1, 0]);
    assert_eq!(ev(Op::Cast { to: DType::I64 }, &[&b]).to_vec::<i64>(), [1, 0]);
    assert_eq!(ev(Op::Cast { to: DType::U8 }, &[&b]).to_vec::<u8>(), [1, 0]);
    assert_eq!(ev(Op::Cast { to: DType::Bool }, &[&b]).to_vec::<bool>(), [true, false]);

    let i = t(&[4], vec![-1i64, 256, 0, (1 << 53) + 1]);
    assert_eq!(ev(Op::Cast { to: DType::U8 }, &[&i]).to_vec::<u8>(), [255, 0, 0, 1]);
    assert_eq!(ev(Op::Cast { to: DType::I32 }, &[&i]).to_vec::<i32>(), [-1, 256, 0, 1]);
    assert_eq!(ev(Op::Cast { to: DType::Bool }, &[&i]).to_vec::<bool>(), [true, true, false, true]);
    // Direct conversion, not through f64: (2^53 + 1) as f32 rounds once.
    assert_eq!(ev(Op::Cast { to: DType::F32 }, &[&i]).to_vec::<f32>()[3], ((1i64 << 53) + 1) as f32);
    assert_eq!(ev(Op::Cast { to: DType::F64 }, &[&i]).to_vec::<f64>()[..3], [-1.0, 256.0, 0.0]);
    let u = t(&[2], vec![255u8, 0]);
    assert_eq!(ev(Op::Cast { to: DType::I32 }, &[&u]).to_vec::<i32>(), [255, 0]);
    assert_eq!(ev(Op::Cast { to: DType::F32 }, &[&u]).to_vec::<f32>(), [255.0, 0.0]);
    let n = t(&[2], vec![-1i32, 300]);
    assert_eq!(ev(Op::Cast { to: DType::U8 }, &[&n]).to_vec::<u8>(), [255, 44]);
    assert_eq!(ev(Op::Cast { to: DType::I64 }, &[&n]).to_vec::<i64>(), [-1, 300]);
}

#[test]
fn identity_and_stop_gradient_copy() {
    let x = t(&[2], vec![true, false]);
    assert_eq!(ev(Op::Identity, &[&x]), x);
    let y = t(&[1, 2], vec![1.5f64, 2.5]);
    assert_eq!(ev(Op::StopGradient, &[&y]), y);
}
