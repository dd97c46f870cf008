//! Row-major layout: strides, strided walks and NumPy broadcasting. Every data-movement op
//! (transpose, slice, pad, broadcast, the reductions' regrouping) is one strided walk.

use std::borrow::Cow;

/// Row-major strides of `dims`, in elements.
pub(crate) fn strides(dims: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; dims.len()];
    for axis in (0..dims.len().saturating_sub(1)).rev() {
        strides[axis] = strides[axis + 1] * dims[axis + 1];
    }
    strides
}

pub(crate) fn n_elements(dims: &[usize]) -> usize {
    dims.iter().product()
}

/// Calls `f` with `base + Σ index[i] * strides[i]` for every index of `dims`, in row-major
/// order.
pub(crate) fn for_each_offset(dims: &[usize], strides: &[usize], base: usize, mut f: impl FnMut(usize)) {
    debug_assert_eq!(dims.len(), strides.len());
    if dims.contains(&0) {
        return;
    }
    let Some((&last, outer)) = dims.split_last() else {
        f(base);
        return;
    };
    let last_stride = strides[dims.len() - 1];
    let mut index = vec![0; outer.len()];
    let mut offset = base; // the offset of `index` with the last axis at 0
    loop {
        for j in 0..last {
            f(offset + j * last_stride);
        }
        // Advance the odometer over the outer axes.
        let mut axis = outer.len();
        loop {
            if axis == 0 {
                return;
            }
            axis -= 1;
            index[axis] += 1;
            offset += strides[axis];
            if index[axis] < outer[axis] {
                break;
            }
            offset -= strides[axis] * outer[axis];
            index[axis] = 0;
        }
    }
}

/// The elements `src[base + Σ index[i] * strides[i]]` for every index of `dims`, row-major.
pub(crate) fn gather_strided<T: Copy>(src: &[T], dims: &[usize], strides: &[usize], base: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(n_elements(dims));
    for_each_offset(dims, strides, base, |offset| out.push(src[offset]));
    out
}

/// Strides for reading an operand of shape `from` as if it had the (broadcast) shape `to`:
/// axes are aligned from the right; a size-1 or missing axis repeats (stride 0).
pub(crate) fn broadcast_strides(from: &[usize], to: &[usize]) -> Vec<usize> {
    assert!(from.len() <= to.len(), "cannot broadcast {from:?} to {to:?}");
    let lead = to.len() - from.len();
    let from_strides = strides(from);
    (0..to.len())
        .map(|axis| {
            if axis < lead {
                return 0;
            }
            let size = from[axis - lead];
            assert!(size == to[axis] || size == 1, "cannot broadcast {from:?} to {to:?}");
            if size == 1 {
                0
            } else {
                from_strides[axis - lead]
            }
        })
        .collect()
}

/// `values` (shaped `from`) broadcast to `to`, borrowed when the shapes are equal.
pub(crate) fn broadcast<'a, T: Copy>(values: &'a [T], from: &[usize], to: &[usize]) -> Cow<'a, [T]> {
    if from == to {
        Cow::Borrowed(values)
    } else {
        Cow::Owned(gather_strided(values, to, &broadcast_strides(from, to), 0))
    }
}

/// Splits `dims` around `axis` into (product before, size of axis, product after): element
/// `(o, a, i)` is at `(o * size + a) * inner + i`.
pub(crate) fn split_at_axis(dims: &[usize], axis: usize) -> (usize, usize, usize) {
    (n_elements(&dims[..axis]), dims[axis], n_elements(&dims[axis + 1..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strided_walks() {
        assert_eq!(strides(&[2, 3, 4]), [12, 4, 1]);
        assert_eq!(strides(&[]), [] as [usize; 0]);
        let mut seen = Vec::new();
        for_each_offset(&[2, 3], &[1, 2], 10, |o| seen.push(o));
        assert_eq!(seen, [10, 12, 14, 11, 13, 15]);
        let mut scalar = Vec::new();
        for_each_offset(&[], &[], 7, |o| scalar.push(o));
        assert_eq!(scalar, [7]);
        let mut none = Vec::new();
        for_each_offset(&[3, 0], &[1, 1], 0, |o| none.push(o));
        assert!(none.is_empty());
    }

    #[test]
    fn broadcasting_strides() {
        assert_eq!(broadcast_strides(&[3], &[2, 3]), [0, 1]);
        assert_eq!(broadcast_strides(&[3, 1], &[2, 3, 4]), [0, 1, 0]);
        assert_eq!(broadcast(&[1, 2, 3], &[3, 1], &[3, 2]).into_owned(), [1, 1, 2, 2, 3, 3]);
        assert_eq!(split_at_axis(&[2, 3, 4], 1), (2, 3, 4));
    }
}
