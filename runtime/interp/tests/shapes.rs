//! Data movement: reshape, transpose, concat, slice, pad, broadcast_to, gather, scatter_add,
//! one_hot — hand-computed values.

mod common;

use common::{ev, ev_err, t};
use dfc_interp::InterpError;
use dfc_ir::{DType, Op, Shape};

fn iota_f32(dims: &[usize]) -> dfc_interp::Tensor {
    let n = dims.iter().product::<usize>();
    t(dims, (0..n).map(|i| i as f32).collect())
}

#[test]
fn reshape_keeps_the_data() {
    let x = iota_f32(&[2, 3]);
    let y = ev(Op::Reshape { shape: Shape(vec![3, 1, 2]) }, &[&x]);
    assert_eq!(y.shape.dims(), [3, 1, 2]);
    assert_eq!(y.to_vec::<f32>(), x.to_vec::<f32>());
    let s = ev(Op::Reshape { shape: Shape(vec![]) }, &[&t(&[1, 1], vec![7u8])]);
    assert_eq!(s, t(&[], vec![7u8]));
}

#[test]
fn transpose_permutes_axes() {
    let x = iota_f32(&[2, 3]);
    let y = ev(Op::Transpose { perm: vec![1, 0] }, &[&x]);
    assert_eq!(y.shape.dims(), [3, 2]);
    assert_eq!(y.to_vec::<f32>(), [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
    // [2,3,4] with perm [2,0,1]: out[k,i,j] = x[i,j,k] = 12i + 4j + k.
    let x = t(&[2, 3, 4], (0..24).collect::<Vec<i32>>());
    let y = ev(Op::Transpose { perm: vec![2, 0, 1] }, &[&x]);
    assert_eq!(y.shape.dims(), [4, 2, 3]);
    let expected: Vec<i32> =
        (0..4).flat_map(|k| (0..2).flat_map(move |i| (0..3).map(move |j| 12 * i + 4 * j + k))).collect();
    assert_eq!(y.to_vec::<i32>(), expected);
}

#[test]
fn concat_joins_along_an_axis() {
    let a = t(&[2, 2], vec![1i64, 2, 3, 4]);
    let b = t(&[2, 1], vec![5i64, 6]);
    let c = t(&[2, 3], vec![7i64, 8, 9, 10, 11, 12]);
    let y = ev(Op::Concat { axis: 1 }, &[&a, &b, &c]);
    assert_eq!(y.shape.dims(), [2, 6]);
    assert_eq!(y.to_vec::<i64>(), [1, 2, 5, 7, 8, 9, 3, 4, 6, 10, 11, 12]);
    let d = t(&[1, 2], vec![0i64, 0]);
    let y = ev(Op::Concat { axis: 0 }, &[&a, &d]);
    assert_eq!(y.shape.dims(), [3, 2]);
    assert_eq!(y.to_vec::<i64>(), [1, 2, 3, 4, 0, 0]);
    let y = ev(Op::Concat { axis: 0 }, &[&t(&[1], vec![true]), &t(&[2], vec![false, true])]);
    assert_eq!(y.to_vec::<bool>(), [true, false, true]);
}

#[test]
fn slice_takes_a_box() {
    let x = t(&[3, 4], (0..12).collect::<Vec<i32>>());
    let y = ev(Op::Slice { begin: vec![1, 1], size: vec![2, 2] }, &[&x]);
    assert_eq!(y.shape.dims(), [2, 2]);
    assert_eq!(y.to_vec::<i32>(), [5, 6, 9, 10]);
    let y = ev(Op::Slice { begin: vec![0, 3], size: vec![3, 1] }, &[&x]);
    assert_eq!(y.to_vec::<i32>(), [3, 7, 11]);
    let empty = ev(Op::Slice { begin: vec![2, 0], size: vec![0, 4] }, &[&x]);
    assert_eq!(empty.shape.dims(), [0, 4]);
    assert!(empty.is_empty());
}

#[test]
fn pad_surrounds_with_zeros() {
    let x = t(&[2, 2], vec![1.0f64, 2.0, 3.0, 4.0]);
    let y = ev(Op::Pad { before: vec![1, 0], after: vec![0, 2] }, &[&x]);
    assert_eq!(y.shape.dims(), [3, 4]);
    assert_eq!(y.to_vec::<f64>(), [0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 0.0, 0.0, 3.0, 4.0, 0.0, 0.0]);
    let b = ev(Op::Pad { before: vec![1], after: vec![1] }, &[&t(&[1], vec![true])]);
    assert_eq!(b.to_vec::<bool>(), [false, true, false]);
}

#[test]
fn broadcast_to_repeats() {
    let x = t(&[3, 1], vec![1u8, 2, 3]);
    let y = ev(Op::BroadcastTo { shape: Shape(vec![2, 3, 2]) }, &[&x]);
    assert_eq!(y.shape.dims(), [2, 3, 2]);
    assert_eq!(y.to_vec::<u8>(), [1, 1, 2, 2, 3, 3, 1, 1, 2, 2, 3, 3]);
    let s = ev(Op::BroadcastTo { shape: Shape(vec![2]) }, &[&t(&[], vec![9.0f32])]);
    assert_eq!(s.to_vec::<f32>(), [9.0, 9.0]);
}

#[test]
fn gather_picks_rows() {
    let params = t(&[4, 2], vec![0.0f32, 1.0, 10.0, 11.0, 20.0, 21.0, 30.0, 31.0]);
    let idx = t(&[2, 2], vec![3i32, 0, 1, 1]);
    let y = ev(Op::Gather, &[&params, &idx]);
    assert_eq!(y.shape.dims(), [2, 2, 2]);
    assert_eq!(y.to_vec::<f32>(), [30.0, 31.0, 0.0, 1.0, 10.0, 11.0, 10.0, 11.0]);
    let y = ev(Op::Gather, &[&t(&[3], vec![5i64, 6, 7]), &t(&[], vec![2i64])]);
    assert_eq!(y, t(&[], vec![7i64]));
}

#[test]
fn gather_out_of_range_is_an_error() {
    let params = t(&[4, 2], vec![0.0f32; 8]);
    let err = ev_err(Op::Gather, &[&params, &t(&[3], vec![0i32, 4, 1])]);
    assert_eq!(err, InterpError::IndexOutOfRange { node: "gather".into(), index: 4, size: 4 });
    assert_eq!(err.to_string(), "`gather`: index 4 is out of range for a size of 4");
    let err = ev_err(Op::Gather, &[&params, &t(&[1], vec![-1i64])]);
    assert_eq!(err, InterpError::IndexOutOfRange { node: "gather".into(), index: -1, size: 4 });
}

#[test]
fn scatter_add_sums_rows() {
    let idx = t(&[3], vec![2i32, 0, 2]);
    let updates = t(&[3, 2], vec![1.0f64, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let y = ev(Op::ScatterAdd { rows: 4 }, &[&idx, &updates]);
    assert_eq!(y.shape.dims(), [4, 2]);
    assert_eq!(y.to_vec::<f64>(), [3.0, 4.0, 0.0, 0.0, 6.0, 8.0, 0.0, 0.0]);
    // Indices of rank 2; integer updates.
    let idx = t(&[2, 2], vec![1i64, 1, 0, 1]);
    let updates = t(&[2, 2], vec![1i32, 2, 3, 4]);
    assert_eq!(ev(Op::ScatterAdd { rows: 2 }, &[&idx, &updates]).to_vec::<i32>(), [3, 7]);
    let err = ev_err(Op::ScatterAdd { rows: 2 }, &[&t(&[1], vec![2i32]), &t(&[1], vec![1.0f32])]);
    assert_eq!(err, InterpError::IndexOutOfRange { node: "scatter_add".into(), index: 2, size: 2 });
}

#[test]
fn one_hot_gives_zero_rows_out_of_range() {
    let ids = t(&[4], vec![0i32, 2, 3, -1]);
    let y = ev(Op::OneHot { depth: 3, dtype: DType::F32 }, &[&ids]);
    assert_eq!(y.shape.dims(), [4, 3]);
    assert_eq!(y.to_vec::<f32>(), [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
    let ids = t(&[2, 1], vec![1u8, 0]);
    let y = ev(Op::OneHot { depth: 2, dtype: DType::Bool }, &[&ids]);
    assert_eq!(y.shape.dims(), [2, 1, 2]);
    assert_eq!(y.to_vec::<bool>(), [false, true, true, false]);
    let y = ev(Op::OneHot { depth: 2, dtype: DType::I64 }, &[&t(&[1], vec![1i64])]);
    assert_eq!(y.to_vec::<i64>(), [0, 1]);
}
