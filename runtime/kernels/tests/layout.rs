//! The layout ops against the reference interpreter (exact), on random shapes of every rank
//! up to 5 and several element types.

mod common;

use common::*;
use dfc_interp::Element;
use dfc_ir::Op;
use dfc_kernels::*;

fn random_dims(rng: &mut fastrand::Rng, max_rank: usize, max_dim: usize) -> Vec<usize> {
    (0..rng.usize(0..=max_rank)).map(|_| rng.usize(0..=max_dim)).collect()
}

fn values<T>(len: usize, mut f: impl FnMut(usize) -> T) -> Vec<T> {
    (0..len).map(&mut f).collect()
}

fn permutation(rank: usize, rng: &mut fastrand::Rng) -> Vec<usize> {
    let mut perm: Vec<usize> = (0..rank).collect();
    rng.shuffle(&mut perm);
    perm
}

fn check_transpose<T: Element>(x: Vec<T>, dims: &[usize], perm: &[usize]) {
    let want: Vec<T> = eval(&Op::Transpose { perm: perm.to_vec() }, &[&tensor(dims, x.clone())]);
    let mut out = vec![T::default(); x.len()];
    transpose(&x, dims, perm, &mut out);
    assert_eq!(out, want, "transpose {dims:?} by {perm:?}");
}

fn check_slice<T: Element>(x: Vec<T>, dims: &[usize], begin: &[usize], size: &[usize]) {
    let op = Op::Slice { begin: begin.to_vec(), size: size.to_vec() };
    let want: Vec<T> = eval(&op, &[&tensor(dims, x.clone())]);
    let mut out = vec![T::default(); size.iter().product()];
    slice(&x, dims, begin, size, &mut out);
    assert_eq!(out, want, "slice {dims:?} at {begin:?} size {size:?}");
}

fn check_pad<T: Element>(x: Vec<T>, dims: &[usize], before: &[usize], after: &[usize], fill: T) {
    let op = Op::Pad { before: before.to_vec(), after: after.to_vec() };
    let want: Vec<T> = eval(&op, &[&tensor(dims, x.clone())]);
    let mut out = vec![fill; want.len()];
    pad(&x, dims, before, after, &mut out);
    assert_eq!(out, want, "pad {dims:?} by {before:?} {after:?}");
}

fn check_concat<T: Element>(parts: &[Vec<T>], dims: &[Vec<usize>], axis: usize) {
    let tensors: Vec<_> = parts.iter().zip(dims).map(|(p, d)| tensor(d, p.clone())).collect();
    let refs: Vec<_> = tensors.iter().collect();
    let want: Vec<T> = eval(&Op::Concat { axis }, &refs);
    let mut out_dims = dims[0].clone();
    out_dims[axis] = dims.iter().map(|d| d[axis]).sum();
    let slices: Vec<&[T]> = parts.iter().map(|p| &p[..]).collect();
    let mut out = vec![T::default(); want.len()];
    concat(&slices, &out_dims, axis, &mut out);
    assert_eq!(out, want, "concat {dims:?} along {axis}");
}

#[test]
fn transpose_agrees_with_the_interpreter() {
    let mut rng = rng(31);
    for _ in 0..500 {
        let dims = random_dims(&mut rng, 5, 6);
        let len = dims.iter().product();
        let perm = permutation(dims.len(), &mut rng);
        check_transpose(values(len, |i| i as f32), &dims, &perm);
        check_transpose(values(len, |i| i as u8), &dims, &perm);
        check_transpose(values(len, |i| i % 3 == 0), &dims, &perm);
        check_transpose(values(len, |i| i as i64), &dims, &perm);
    }
}

#[test]
fn large_transposes() {
    let mut rng = rng(32);
    for (dims, perm) in [
        (vec![300, 200], vec![1, 0]),
        (vec![64, 13, 13, 32], vec![0, 3, 1, 2]),
        (vec![64, 32, 13, 13], vec![0, 2, 3, 1]),
        (vec![7, 50, 3, 60], vec![3, 1, 0, 2]),
        (vec![2, 100, 300], vec![0, 2, 1]),
        (vec![40, 30, 20, 10], vec![3, 2, 1, 0]),
        (vec![1, 70000], vec![1, 0]),
    ] {
        let len = dims.iter().product();
        check_transpose(random(len, &mut rng), &dims, &perm);
        check_transpose(values(len, |i| i as i32), &dims, &perm);
    }
}

#[test]
fn slice_agrees_with_the_interpreter() {
    let mut rng = rng(33);
    for _ in 0..500 {
        let dims = random_dims(&mut rng, 5, 6);
        let begin: Vec<usize> = dims.iter().map(|&d| rng.usize(0..=d)).collect();
        let size: Vec<usize> = dims.iter().zip(&begin).map(|(&d, &b)| rng.usize(0..=d - b)).collect();
        let len = dims.iter().product();
        check_slice(values(len, |i| i as f32), &dims, &begin, &size);
        check_slice(values(len, |i| i % 2 == 1), &dims, &begin, &size);
    }
    for (dims, begin, size) in [
        (vec![64, 1600], vec![0, 100], vec![64, 1000]),
        (vec![500, 300], vec![10, 0], vec![400, 300]),
        (vec![20, 30, 40, 10], vec![1, 2, 3, 4], vec![18, 25, 30, 5]),
    ] {
        let len = dims.iter().product();
        check_slice(random(len, &mut rng), &dims, &begin, &size);
    }
}

#[test]
fn pad_agrees_with_the_interpreter() {
    let mut rng = rng(34);
    for _ in 0..500 {
        let dims = random_dims(&mut rng, 5, 5);
        let before: Vec<usize> = dims.iter().map(|_| rng.usize(0..3)).collect();
        let after: Vec<usize> = dims.iter().map(|_| rng.usize(0..3)).collect();
        let len = dims.iter().product();
        check_pad(values(len, |i| i as f32 + 1.0), &dims, &before, &after, f32::NAN);
        check_pad(values(len, |i| (i as u8).wrapping_add(1)), &dims, &before, &after, 200);
        check_pad(values(len, |_| true), &dims, &before, &after, true);
    }
    for (dims, before, after) in [
        (vec![64, 1000], vec![0, 100], vec![0, 500]),
        (vec![300, 300], vec![7, 0], vec![93, 0]),
        (vec![16, 13, 13, 32], vec![0, 1, 1, 0], vec![0, 1, 1, 0]),
    ] {
        let len = dims.iter().product();
        check_pad(random(len, &mut rng), &dims, &before, &after, f32::NAN);
    }
}

#[test]
fn concat_agrees_with_the_interpreter() {
    let mut rng = rng(35);
    for _ in 0..500 {
        let mut dims = random_dims(&mut rng, 4, 5);
        if dims.is_empty() {
            dims.push(2);
        }
        let axis = rng.usize(0..dims.len());
        let parts = rng.usize(1..5);
        let all_dims: Vec<Vec<usize>> = (0..parts)
            .map(|_| {
                let mut d = dims.clone();
                d[axis] = rng.usize(0..5);
                d
            })
            .collect();
        let mut next = 0;
        let data: Vec<Vec<f32>> = all_dims
            .iter()
            .map(|d| {
                let len: usize = d.iter().product();
                next += len;
                values(len, |i| (next - len + i) as f32)
            })
            .collect();
        check_concat(&data, &all_dims, axis);
        let data: Vec<Vec<i32>> = data.iter().map(|p| p.iter().map(|&v| v as i32).collect()).collect();
        check_concat(&data, &all_dims, axis);
    }
    let dims = vec![vec![64, 1000], vec![64, 600], vec![64, 1]];
    let data: Vec<Vec<f32>> = dims.iter().map(|d| random(d.iter().product(), &mut rng)).collect();
    check_concat(&data, &dims, 1);
    let dims = vec![vec![300, 200], vec![200, 200]];
    let data: Vec<Vec<f32>> = dims.iter().map(|d| random(d.iter().product(), &mut rng)).collect();
    check_concat(&data, &dims, 0);
}
