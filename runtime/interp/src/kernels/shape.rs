//! Data movement: transpose, concat, slice, pad, broadcast_to, gather, scatter_add, one_hot.
//! None of them computes with the values, so all take every element type.

use crate::layout::{broadcast, for_each_offset, gather_strided, n_elements, strides};
use crate::scalar::{Fault, Scalar};

/// Output axis `i` is input axis `perm[i]`.
pub(crate) fn transpose<T: Scalar>(x: &[T], dims: &[usize], perm: &[usize]) -> (Vec<usize>, Vec<T>) {
    let in_strides = strides(dims);
    let out_dims: Vec<usize> = perm.iter().map(|&a| dims[a]).collect();
    let out_strides: Vec<usize> = perm.iter().map(|&a| in_strides[a]).collect();
    let values = gather_strided(x, &out_dims, &out_strides, 0);
    (out_dims, values)
}

/// The operands one after the other along `axis`: for each index of the axes before `axis`,
/// each operand's block in turn.
pub(crate) fn concat<T: Scalar>(parts: &[(&[T], &[usize])], axis: usize) -> (Vec<usize>, Vec<T>) {
    let first_dims = parts[0].1;
    let outer = n_elements(&first_dims[..axis]);
    let mut out_dims = first_dims.to_vec();
    out_dims[axis] = parts.iter().map(|(_, dims)| dims[axis]).sum();
    let mut values = Vec::with_capacity(n_elements(&out_dims));
    for o in 0..outer {
        for (data, dims) in parts {
            let block = n_elements(&dims[axis..]);
            values.extend_from_slice(&data[o * block..(o + 1) * block]);
        }
    }
    (out_dims, values)
}

/// `x[begin[i] .. begin[i] + size[i]]` along every axis.
pub(crate) fn slice<T: Scalar>(x: &[T], dims: &[usize], begin: &[usize], size: &[usize]) -> Vec<T> {
    let in_strides = strides(dims);
    let base = begin.iter().zip(&in_strides).map(|(b, s)| b * s).sum();
    gather_strided(x, size, &in_strides, base)
}

/// `x` surrounded by `before[i]` and `after[i]` zeros (`false` for bool) along axis `i`.
pub(crate) fn pad<T: Scalar>(x: &[T], dims: &[usize], before: &[usize], after: &[usize]) -> (Vec<usize>, Vec<T>) {
    let out_dims: Vec<usize> = (0..dims.len()).map(|i| before[i] + dims[i] + after[i]).collect();
    let out_strides = strides(&out_dims);
    let mut out = vec![T::zero(); n_elements(&out_dims)];
    let base = before.iter().zip(&out_strides).map(|(b, s)| b * s).sum();
    let mut values = x.iter();
    for_each_offset(dims, &out_strides, base, |offset| {
        out[offset] = *values.next().expect("one offset per input element");
    });
    (out_dims, out)
}

pub(crate) fn broadcast_to<T: Scalar>(x: &[T], dims: &[usize], to: &[usize]) -> Vec<T> {
    broadcast(x, dims, to).into_owned()
}

/// Checks that every index is in `0..size`.
fn check_indices(indices: &[i64], size: usize) -> Result<(), Fault> {
    match indices.iter().find(|&&i| i < 0 || i as u64 >= size as u64) {
        Some(&index) => Err(Fault::IndexOutOfRange { index, size }),
        None => Ok(()),
    }
}

/// Rows of `params` (axis 0) picked by `indices`: `out[i..., rest...] = params[indices[i...], rest...]`.
/// An index outside `0..rows` is an error.
pub(crate) fn gather<T: Scalar>(
    params: &[T],
    params_dims: &[usize],
    indices: &[i64],
    indices_dims: &[usize],
) -> Result<(Vec<usize>, Vec<T>), Fault> {
    let rows = params_dims[0];
    check_indices(indices, rows)?;
    let row_len = n_elements(&params_dims[1..]);
    let mut values = Vec::with_capacity(indices.len() * row_len);
    for &index in indices {
        let row = index as usize;
        values.extend_from_slice(&params[row * row_len..(row + 1) * row_len]);
    }
    let mut out_dims = indices_dims.to_vec();
    out_dims.extend_from_slice(&params_dims[1..]);
    Ok((out_dims, values))
}

/// `out[rows, rest...]`, zero, then `out[indices[i...], rest...] += updates[i..., rest...]` for
/// every index in order (repeated indices accumulate). An index outside `0..rows` is an error.
pub(crate) fn scatter_add<T: Scalar>(
    indices: &[i64],
    indices_dims: &[usize],
    updates: &[T],
    updates_dims: &[usize],
    rows: usize,
) -> Result<(Vec<usize>, Vec<T>), Fault> {
    check_indices(indices, rows)?;
    let rest = &updates_dims[indices_dims.len()..];
    let row_len = n_elements(rest);
    let mut out = vec![T::zero(); rows * row_len];
    for (i, &index) in indices.iter().enumerate() {
        let row = index as usize;
        let target = &mut out[row * row_len..(row + 1) * row_len];
        for (t, &u) in target.iter_mut().zip(&updates[i * row_len..(i + 1) * row_len]) {
            *t = t.accumulate(u);
        }
    }
    let mut out_dims = vec![rows];
    out_dims.extend_from_slice(rest);
    Ok((out_dims, out))
}

/// `out[i..., c] = (indices[i...] == c) ? 1 : 0`; an index outside `0..depth` (negative
/// included) gives a row of zeros, as in TensorFlow.
pub(crate) fn one_hot<T: Scalar>(indices: &[i64], indices_dims: &[usize], depth: usize) -> (Vec<usize>, Vec<T>) {
    let mut out = vec![T::zero(); indices.len() * depth];
    for (i, &index) in indices.iter().enumerate() {
        if index >= 0 && (index as u64) < depth as u64 {
            out[i * depth + index as usize] = T::one();
        }
    }
    let mut out_dims = indices_dims.to_vec();
    out_dims.push(depth);
    (out_dims, out)
}
