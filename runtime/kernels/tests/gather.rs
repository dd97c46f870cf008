//! `gather` and `scatter_add` against the reference interpreter (exact: the sums run in the
//! same order).

mod common;

use common::*;
use dfc_interp::{Element, InterpError, Tensor};
use dfc_ir::Op;
use dfc_kernels::*;

fn random_dims(rng: &mut fastrand::Rng, max_rank: usize, max_dim: usize) -> Vec<usize> {
    (0..rng.usize(0..=max_rank)).map(|_| rng.usize(0..=max_dim)).collect()
}

fn check_gather<T: Element + Copy, I: Element + dfc_kernels::Index>(
    table: Vec<T>,
    table_dims: &[usize],
    indices: Vec<I>,
    index_dims: &[usize],
) {
    let rows = table_dims[0];
    let row_len: usize = table_dims[1..].iter().product();
    let reference =
        dfc_interp::eval(&Op::Gather, &[&tensor(table_dims, table.clone()), &tensor(index_dims, indices.clone())]);
    let mut out = vec![T::default(); indices.len() * row_len];
    let got = gather(&table, rows, &indices, &mut out);
    match reference {
        Ok(want) => {
            assert_eq!(got, Ok(()));
            assert_eq!(out, want.to_vec::<T>(), "gather {table_dims:?} by {index_dims:?}");
        }
        Err(InterpError::IndexOutOfRange { index, .. }) => assert_eq!(got, Err(IndexOutOfRange { index, rows })),
        Err(e) => panic!("{e}"),
    }
}

fn check_scatter<T: Element + Accumulate, I: Element + dfc_kernels::Index>(
    indices: Vec<I>,
    index_dims: &[usize],
    updates: Vec<T>,
    row_dims: &[usize],
    rows: usize,
) {
    let mut update_dims = index_dims.to_vec();
    update_dims.extend_from_slice(row_dims);
    let row_len: usize = row_dims.iter().product();
    let op = Op::ScatterAdd { rows };
    let reference =
        dfc_interp::eval(&op, &[&tensor(index_dims, indices.clone()), &tensor(&update_dims, updates.clone())]);
    let mut out = vec![T::default(); rows * row_len];
    let got = scatter_add(&indices, &updates, rows, &mut out);
    match reference {
        Ok(want) => {
            assert_eq!(got, Ok(()));
            assert_eq!(out, want.to_vec::<T>(), "scatter_add {index_dims:?} {row_dims:?} rows {rows}");
        }
        Err(InterpError::IndexOutOfRange { index, .. }) => assert_eq!(got, Err(IndexOutOfRange { index, rows })),
        Err(e) => panic!("{e}"),
    }
}

fn indices_i64(len: usize, rows: usize, bad: bool, rng: &mut fastrand::Rng) -> Vec<i64> {
    (0..len)
        .map(|_| {
            if bad && rng.u8(0..8) == 0 {
                [-1, -7, rows as i64, rows as i64 + 3][rng.usize(0..4)]
            } else {
                rng.i64(0..rows.max(1) as i64)
            }
        })
        .collect()
}

#[test]
fn gather_agrees_with_the_interpreter() {
    let mut rng = rng(21);
    for _ in 0..400 {
        let mut table_dims = vec![rng.usize(1..8)];
        table_dims.extend(random_dims(&mut rng, 2, 5));
        let index_dims = random_dims(&mut rng, 2, 5);
        let len: usize = table_dims.iter().product();
        let n: usize = index_dims.iter().product();
        let bad = rng.u8(0..4) == 0;
        let idx = indices_i64(n, table_dims[0], bad, &mut rng);
        let table = random(len, &mut rng);
        check_gather(table.clone(), &table_dims, idx.clone(), &index_dims);
        check_gather(table, &table_dims, idx.iter().map(|&i| i as i32).collect::<Vec<i32>>(), &index_dims);
        let bytes: Vec<u8> = (0..len).map(|_| rng.u8(..)).collect();
        check_gather(bytes, &table_dims, idx.clone(), &index_dims);
        let bools: Vec<bool> = (0..len).map(|_| rng.bool()).collect();
        check_gather(bools, &table_dims, idx, &index_dims);
    }
}

#[test]
fn scatter_add_agrees_with_the_interpreter() {
    let mut rng = rng(22);
    for _ in 0..400 {
        let rows = rng.usize(1..8);
        let row_dims = random_dims(&mut rng, 2, 5);
        let index_dims = random_dims(&mut rng, 2, 6);
        let n: usize = index_dims.iter().product();
        let row_len: usize = row_dims.iter().product();
        let bad = rng.u8(0..4) == 0;
        let idx = indices_i64(n, rows, bad, &mut rng);
        let updates = random(n * row_len, &mut rng);
        check_scatter(idx.clone(), &index_dims, updates, &row_dims, rows);
        let ints: Vec<i32> = (0..n * row_len).map(|_| rng.i32(..)).collect();
        check_scatter(idx.iter().map(|&i| i as i32).collect::<Vec<i32>>(), &index_dims, ints, &row_dims, rows);
    }
}

/// Large enough to run on several threads; repeated indices accumulate in order.
#[test]
fn large_gather_and_scatter() {
    let mut rng = rng(23);
    let (rows, dim, n) = (1000, 96, 3000);
    let table = random(rows * dim, &mut rng);
    let idx: Vec<i32> = (0..n).map(|_| rng.i32(0..rows as i32)).collect();
    check_gather(table, &[rows, dim], idx.clone(), &[n]);
    let updates = random(n * dim, &mut rng);
    check_scatter(idx.clone(), &[n], updates, &[dim], rows);
    // Few rows, many updates each.
    let idx: Vec<i64> = (0..n).map(|_| rng.i64(0..3)).collect();
    check_scatter(idx, &[n], random(n * dim, &mut rng), &[dim], 3);
}

#[test]
fn the_first_bad_index_is_reported_and_the_output_untouched() {
    let table = [1.0f32, 2.0, 3.0, 4.0];
    let mut out = [9.0f32; 6];
    assert_eq!(gather(&table, 2, &[1i32, 5, -1], &mut out), Err(IndexOutOfRange { index: 5, rows: 2 }));
    assert_eq!(out, [9.0; 6]);
    let mut out = [9.0f32; 4];
    assert_eq!(scatter_add(&[0i64, -2, 7], &[1.0f32; 6], 2, &mut out), Err(IndexOutOfRange { index: -2, rows: 2 }));
    assert_eq!(out, [9.0; 4]);
    assert_eq!(IndexOutOfRange { index: 5, rows: 2 }.to_string(), "index 5 is out of range for 2 rows");
    // Zero rows: every index is out of range.
    assert_eq!(gather::<f32, i32>(&[], 0, &[0], &mut []), Err(IndexOutOfRange { index: 0, rows: 0 }));
    let _ = Tensor::scalar(0.0f32);
}
