//! Layout ops on any `Copy` element: transpose, concat, slice, pad.
//!
//! Transpose, slice and pad are all one *box copy*: a box of some shape read from one buffer
//! with some strides and written to another with other strides. `copy_box` drops axes of size
//! 1, merges axes that are contiguous in both buffers, and then copies contiguous runs when the
//! innermost axis is contiguous in both, or 16 × 16 tiles (reads contiguous along one axis,
//! writes along another) when it is not. Large calls split the output's first axis over threads.

use crate::worth_parallel;
use rayon::prelude::*;

/// The most axes a layout op takes (more than any dfc program has).
const MAX_RANK: usize = 32;

/// The side of the tiles of a transposing copy.
const TILE: usize = 16;

/// Row-major strides of `dims`, in a fixed array.
fn row_major(dims: &[usize]) -> [usize; MAX_RANK] {
    assert!(dims.len() <= MAX_RANK, "layout ops take at most {MAX_RANK} axes, not {}", dims.len());
    let mut strides = [0; MAX_RANK];
    let mut s = 1;
    for (i, &d) in dims.iter().enumerate().rev() {
        strides[i] = s;
        s *= d;
    }
    strides
}

/// A box copy with size-1 axes dropped and contiguous axes merged.
struct BoxCopy {
    rank: usize,
    shape: [usize; MAX_RANK],
    src: [usize; MAX_RANK],
    dst: [usize; MAX_RANK],
}

impl BoxCopy {
    fn new(shape: &[usize], src: &[usize], dst: &[usize]) -> BoxCopy {
        assert!(shape.len() <= MAX_RANK, "layout ops take at most {MAX_RANK} axes, not {}", shape.len());
        let mut b = BoxCopy { rank: 0, shape: [0; MAX_RANK], src: [0; MAX_RANK], dst: [0; MAX_RANK] };
        for i in 0..shape.len() {
            if shape[i] == 1 {
                continue;
            }
            let r = b.rank;
            if r > 0 && b.src[r - 1] == src[i] * shape[i] && b.dst[r - 1] == dst[i] * shape[i] {
                // Axis i continues the previous one in both buffers.
                b.shape[r - 1] *= shape[i];
                b.src[r - 1] = src[i];
                b.dst[r - 1] = dst[i];
            } else {
                b.shape[r] = shape[i];
                b.src[r] = src[i];
                b.dst[r] = dst[i];
                b.rank += 1;
            }
        }
        b
    }

    /// Calls `f(src_offset, dst_offset)` for every index of the axes in `axes`, the others 0.
    fn walk(&self, axes: &[usize], si: usize, di: usize, f: &mut dyn FnMut(usize, usize)) {
        match axes.split_first() {
            None => f(si, di),
            Some((&a, rest)) => {
                for i in 0..self.shape[a] {
                    self.walk(rest, si + i * self.src[a], di + i * self.dst[a], f);
                }
            }
        }
    }

    /// The axes other than `skip`, outermost first.
    fn axes_except(&self, skip: [usize; 2]) -> ([usize; MAX_RANK], usize) {
        let mut axes = [0; MAX_RANK];
        let mut k = 0;
        for a in 0..self.rank {
            if !skip.contains(&a) {
                axes[k] = a;
                k += 1;
            }
        }
        (axes, k)
    }
}

/// Copies the box `shape` from `src` (strides `src_strides`, first element at `src_base`) to
/// `dst` (strides `dst_strides`, first element at `dst_base`).
fn copy_box<T: Copy>(
    shape: &[usize],
    src: &[T],
    src_strides: &[usize],
    src_base: usize,
    dst: &mut [T],
    dst_strides: &[usize],
    dst_base: usize,
) {
    if shape.contains(&0) {
        return;
    }
    let b = BoxCopy::new(shape, src_strides, dst_strides);
    // The last element of the box in each buffer: every index below is at most this.
    let src_last = src_base + (0..b.rank).map(|a| (b.shape[a] - 1) * b.src[a]).sum::<usize>();
    let dst_last = dst_base + (0..b.rank).map(|a| (b.shape[a] - 1) * b.dst[a]).sum::<usize>();
    assert!(src_last < src.len() && dst_last < dst.len(), "layout: box out of bounds");
    if b.rank == 0 {
        dst[dst_base] = src[src_base];
        return;
    }
    let last = b.rank - 1;
    let src_unit = (0..b.rank).find(|&a| b.src[a] == 1);
    let dst_unit = (0..b.rank).find(|&a| b.dst[a] == 1);
    match (src_unit, dst_unit) {
        (Some(a), Some(d)) if a == d => {
            // Contiguous runs along axis a (the innermost in both, after merging).
            let run = b.shape[a];
            let (axes, k) = b.axes_except([a, usize::MAX]);
            b.walk(&axes[..k], src_base, dst_base, &mut |si, di| {
                dst[di..di + run].copy_from_slice(&src[si..si + run]);
            });
        }
        (Some(a), Some(d)) => {
            // Tiles: reads contiguous along a, writes contiguous along d.
            let (na, nd) = (b.shape[a], b.shape[d]);
            let (dst_a, src_d) = (b.dst[a], b.src[d]);
            let (axes, k) = b.axes_except([a, d]);
            b.walk(&axes[..k], src_base, dst_base, &mut |si, di| {
                for a0 in (0..na).step_by(TILE) {
                    let a1 = (a0 + TILE).min(na);
                    for d0 in (0..nd).step_by(TILE) {
                        let d1 = (d0 + TILE).min(nd);
                        for id in d0..d1 {
                            let col = &src[si + id * src_d + a0..si + id * src_d + a1];
                            for (j, &v) in col.iter().enumerate() {
                                // SAFETY: an element of the box, so at most `dst_last`, checked above.
                                unsafe { *dst.get_unchecked_mut(di + (a0 + j) * dst_a + id) = v };
                            }
                        }
                    }
                }
            });
        }
        _ => {
            // No axis contiguous in one of the buffers (strides > 1 everywhere): element by element.
            let (axes, k) = b.axes_except([last, usize::MAX]);
            let (n, s, d) = (b.shape[last], b.src[last], b.dst[last]);
            b.walk(&axes[..k], src_base, dst_base, &mut |si, di| {
                for i in 0..n {
                    dst[di + i * d] = src[si + i * s];
                }
            });
        }
    }
}

/// Splits `out` (row-major `dims`) along axis 0 into blocks of whole rows and calls
/// `f(first_row, rows, block)` for each, over threads when the output is large.
fn split_rows<T: Send>(dims: &[usize], out: &mut [T], f: impl Fn(usize, usize, &mut [T]) + Sync) {
    let rows = dims.first().copied().unwrap_or(1);
    if out.is_empty() || rows == 0 {
        return;
    }
    let row_len = out.len() / rows;
    let threads = rayon::current_num_threads();
    if rows >= 2 && worth_parallel::<T>(out.len()) {
        let per_block = rows.div_ceil(4 * threads).max(1);
        out.par_chunks_mut(per_block * row_len).enumerate().for_each(|(i, block)| {
            let first = i * per_block;
            f(first, block.len() / row_len, block);
        });
    } else {
        f(0, rows, out);
    }
}

/// `output` = `input` (row-major `dims`) with its axes permuted: output axis `i` is input axis
/// `perm[i]`.
pub fn transpose<T: Copy + Send + Sync>(input: &[T], dims: &[usize], perm: &[usize], output: &mut [T]) {
    let rank = dims.len();
    assert_eq!(perm.len(), rank, "transpose: perm must name every axis");
    assert_eq!(input.len(), dims.iter().product::<usize>(), "transpose: input length does not match dims");
    assert_eq!(output.len(), input.len(), "transpose: output must be as long as input");
    let mut seen = [false; MAX_RANK];
    let in_strides = row_major(dims);
    let mut out_dims = [0; MAX_RANK];
    let mut src_strides = [0; MAX_RANK];
    for (i, &a) in perm.iter().enumerate() {
        assert!(a < rank && !seen[a], "transpose: {perm:?} is not a permutation");
        seen[a] = true;
        out_dims[i] = dims[a];
        src_strides[i] = in_strides[a];
    }
    let out_dims = &out_dims[..rank];
    let out_strides = row_major(out_dims);
    if rank == 0 {
        output.copy_from_slice(input);
        return;
    }
    split_rows(out_dims, output, |first, rows, block| {
        let mut shape = [0; MAX_RANK];
        shape[..rank].copy_from_slice(out_dims);
        shape[0] = rows;
        copy_box(&shape[..rank], input, &src_strides[..rank], first * src_strides[0], block, &out_strides[..rank], 0);
    });
}

/// `output` (row-major `output_dims`) = `parts` joined along `axis`: for each index of the axes
/// before `axis`, each part's block in turn. Each part has the output's dims except along
/// `axis`, so its length alone fixes its share of the axis.
pub fn concat<T: Copy + Send + Sync>(parts: &[&[T]], output_dims: &[usize], axis: usize, output: &mut [T]) {
    assert!(axis < output_dims.len(), "concat: axis {axis} out of range for rank {}", output_dims.len());
    assert_eq!(output.len(), output_dims.iter().product::<usize>(), "concat: output length does not match dims");
    assert_eq!(parts.iter().map(|p| p.len()).sum::<usize>(), output.len(), "concat: parts do not fill the output");
    let outer: usize = output_dims[..axis].iter().product();
    if output.is_empty() || outer == 0 {
        return;
    }
    let block = output.len() / outer;
    for p in parts {
        assert_eq!(p.len() % outer, 0, "concat: a part's length is not a multiple of the outer size {outer}");
    }
    let fill = |o: usize, out: &mut [T]| {
        let mut at = 0;
        for p in parts {
            let len = p.len() / outer;
            out[at..at + len].copy_from_slice(&p[o * len..(o + 1) * len]);
            at += len;
        }
    };
    if outer >= 2 && worth_parallel::<T>(output.len()) {
        let min_len = (4096 / block).max(1);
        output.par_chunks_mut(block).enumerate().with_min_len(min_len).for_each(|(o, out)| fill(o, out));
    } else {
        output.chunks_mut(block).enumerate().for_each(|(o, out)| fill(o, out));
    }
}

/// `output` (dims `size`) = `input[begin[i] .. begin[i] + size[i]]` along every axis `i` of
/// `input` (row-major `dims`).
pub fn slice<T: Copy + Send + Sync>(input: &[T], dims: &[usize], begin: &[usize], size: &[usize], output: &mut [T]) {
    let rank = dims.len();
    assert!(begin.len() == rank && size.len() == rank, "slice: begin and size must name every axis");
    assert_eq!(input.len(), dims.iter().product::<usize>(), "slice: input length does not match dims");
    assert_eq!(output.len(), size.iter().product::<usize>(), "slice: output length does not match size");
    for i in 0..rank {
        assert!(begin[i] + size[i] <= dims[i], "slice: axis {i} range {}+{} exceeds {}", begin[i], size[i], dims[i]);
    }
    if rank == 0 {
        output.copy_from_slice(input);
        return;
    }
    let in_strides = row_major(dims);
    let out_strides = row_major(size);
    let base: usize = (0..rank).map(|i| begin[i] * in_strides[i]).sum();
    split_rows(size, output, |first, rows, block| {
        let mut shape = [0; MAX_RANK];
        shape[..rank].copy_from_slice(size);
        shape[0] = rows;
        copy_box(
            &shape[..rank],
            input,
            &in_strides[..rank],
            base + first * in_strides[0],
            block,
            &out_strides[..rank],
            0,
        );
    });
}

/// `output` = `input` (row-major `dims`) with `before[i]` and `after[i]` elements of
/// `T::default()` (zero, `false`) around it along every axis `i`.
pub fn pad<T: Copy + Default + Send + Sync>(
    input: &[T],
    dims: &[usize],
    before: &[usize],
    after: &[usize],
    output: &mut [T],
) {
    let rank = dims.len();
    assert!(before.len() == rank && after.len() == rank, "pad: before and after must name every axis");
    assert_eq!(input.len(), dims.iter().product::<usize>(), "pad: input length does not match dims");
    assert!(rank <= MAX_RANK, "layout ops take at most {MAX_RANK} axes, not {rank}");
    let mut out_dims = [0; MAX_RANK];
    for i in 0..rank {
        out_dims[i] = before[i] + dims[i] + after[i];
    }
    let out_dims = &out_dims[..rank];
    assert_eq!(output.len(), out_dims.iter().product::<usize>(), "pad: output length does not match the padded dims");
    if rank == 0 {
        output.copy_from_slice(input);
        return;
    }
    let in_strides = row_major(dims);
    let out_strides = row_major(out_dims);
    // The offset of the input's first element in the output, axis 0 left out.
    let inner_base: usize = (1..rank).map(|i| before[i] * out_strides[i]).sum();
    split_rows(out_dims, output, |first, rows, block| {
        block.fill(T::default());
        // Output rows first..first + rows hold input rows lo..hi.
        let lo = first.max(before[0]) - before[0];
        let hi = (first + rows).saturating_sub(before[0]).min(dims[0]);
        if lo >= hi {
            return;
        }
        let mut shape = [0; MAX_RANK];
        shape[..rank].copy_from_slice(dims);
        shape[0] = hi - lo;
        let dst_base = (lo + before[0] - first) * out_strides[0] + inner_base;
        copy_box(&shape[..rank], input, &in_strides[..rank], lo * in_strides[0], block, &out_strides[..rank], dst_base);
    });
}
