//! Matrix products. One kernel, `gemm`, does all the arithmetic (the convolutions use it too):
//! `C[i, j] = Σ_p A[i, p] * B[p, j]`, the sum taken in order of increasing `p`, as plain
//! multiply-then-add (no fused multiply-add), integers wrapping.

use crate::layout::{broadcast_strides, for_each_offset, n_elements};
use crate::scalar::Num;

/// `a` (`rows × cols`, row-major) transposed.
pub(crate) fn transpose_2d<T: Num>(a: &[T], rows: usize, cols: usize) -> Vec<T> {
    let mut out = vec![T::zero(); a.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = a[r * cols + c];
        }
    }
    out
}

/// `C = op(A) @ op(B)` with `op(A)` of `m × k` and `op(B)` of `k × n`, row-major. `A` is
/// stored `m × k`, or `k × m` if `transpose_a`; `B` is stored `k × n`, or `n × k` if
/// `transpose_b`.
///
/// The loops run so that the innermost one walks contiguous rows of `B` and `C`
/// (`C[i, :] += A[i, p] * B[p, :]`), which the compiler vectorises.
pub(crate) fn gemm<T: Num>(
    a: &[T],
    b: &[T],
    m: usize,
    k: usize,
    n: usize,
    transpose_a: bool,
    transpose_b: bool,
) -> Vec<T> {
    debug_assert_eq!(a.len(), m * k);
    debug_assert_eq!(b.len(), k * n);
    let transposed;
    let b = if transpose_b {
        transposed = transpose_2d(b, n, k);
        &transposed[..]
    } else {
        b
    };
    let mut c = vec![T::zero(); m * n];
    if n == 0 {
        return c;
    }
    if transpose_a {
        // A is stored k × m: row p of A holds A[:, p] of op(A).
        for p in 0..k {
            let a_col = &a[p * m..(p + 1) * m];
            let b_row = &b[p * n..(p + 1) * n];
            for (c_row, &a_ip) in c.chunks_exact_mut(n).zip(a_col) {
                for (c_ij, &b_pj) in c_row.iter_mut().zip(b_row) {
                    *c_ij = c_ij.add(a_ip.mul(b_pj));
                }
            }
        }
    } else {
        for (c_row, a_row) in c.chunks_exact_mut(n).zip(a.chunks_exact(k.max(1))) {
            for (&a_ip, b_row) in a_row.iter().zip(b.chunks_exact(n)) {
                for (c_ij, &b_pj) in c_row.iter_mut().zip(b_row) {
                    *c_ij = c_ij.add(a_ip.mul(b_pj));
                }
            }
        }
    }
    c
}

/// The batched product of the last two axes, the batch axes broadcast (NumPy `matmul`).
pub(crate) fn matmul<T: Num>(
    a: &[T],
    a_dims: &[usize],
    b: &[T],
    b_dims: &[usize],
    transpose_a: bool,
    transpose_b: bool,
) -> (Vec<usize>, Vec<T>) {
    let (ra, rb) = (a_dims.len(), b_dims.len());
    let (a_batch, a_mat) = a_dims.split_at(ra - 2);
    let (b_batch, b_mat) = b_dims.split_at(rb - 2);
    let (m, k) = if transpose_a { (a_mat[1], a_mat[0]) } else { (a_mat[0], a_mat[1]) };
    let n = if transpose_b { b_mat[0] } else { b_mat[1] };
    let batch = super::elementwise::broadcast_dims(a_batch, b_batch);

    // The offset of each batch's matrix in `a` and `b`.
    let matrix_offsets = |dims: &[usize], size: usize| {
        let mut offsets = Vec::new();
        let strides: Vec<usize> = broadcast_strides(dims, &batch).iter().map(|s| s * size).collect();
        for_each_offset(&batch, &strides, 0, |o| offsets.push(o));
        offsets
    };
    let a_offsets = matrix_offsets(a_batch, m * k);
    let b_offsets = matrix_offsets(b_batch, k * n);

    let mut out = Vec::with_capacity(n_elements(&batch) * m * n);
    for (&ao, &bo) in a_offsets.iter().zip(&b_offsets) {
        out.extend(gemm(&a[ao..ao + m * k], &b[bo..bo + k * n], m, k, n, transpose_a, transpose_b));
    }
    let mut out_dims = batch;
    out_dims.extend([m, n]);
    (out_dims, out)
}
