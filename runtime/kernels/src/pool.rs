//! Max and average pooling over NHWC input, and their gradients.
//!
//! Each image is independent, so large calls split the batch over threads. Within an image the
//! windows are visited in output order and each window's elements in row-major window order,
//! exactly as the interpreter does, so results (ties, NaNs and the order in which overlapping
//! windows add their gradients included) are bitwise the same.

use crate::geometry::{valid_taps, PoolGeometry};
use crate::worth_parallel;
use rayon::prelude::*;
use std::ops::Range;

/// Whether `candidate` replaces `best` as the maximum: larger, or NaN over a number (so the
/// first NaN wins); ties keep the earlier element.
#[inline(always)]
#[allow(clippy::eq_op)]
pub(crate) fn beats_max<T: PartialOrd>(candidate: T, best: T) -> bool {
    (candidate > best) | ((candidate != candidate) & (best == best))
}

/// The windows of one image, in output order: `(out_pixel, rows, cols)`, with the output
/// pixel numbered `oy * out_w + ox` and the input rows and columns the window covers (padding
/// excluded). An iterator rather than a callback, so that the loop bodies stay in the
/// functions compiled for wider vectors.
struct Windows<'a> {
    g: &'a PoolGeometry,
    oy: usize,
    ox: usize,
    rows: Range<usize>,
}

impl Windows<'_> {
    #[inline(always)]
    fn rows(g: &PoolGeometry, oy: usize) -> Range<usize> {
        let ys = valid_taps(oy, g.stride_h, g.pad_top, g.kh, g.h);
        oy * g.stride_h + ys.start - g.pad_top..oy * g.stride_h + ys.end - g.pad_top
    }
}

#[inline(always)]
fn windows(g: &PoolGeometry) -> Windows<'_> {
    Windows { g, oy: 0, ox: 0, rows: Windows::rows(g, 0) }
}

impl Iterator for Windows<'_> {
    type Item = (usize, Range<usize>, Range<usize>);

    #[inline(always)]
    fn next(&mut self) -> Option<Self::Item> {
        let g = self.g;
        if self.oy >= g.out_h || g.out_w == 0 {
            return None;
        }
        let xs = valid_taps(self.ox, g.stride_w, g.pad_left, g.kw, g.w);
        let cols = self.ox * g.stride_w + xs.start - g.pad_left..self.ox * g.stride_w + xs.end - g.pad_left;
        let item = (self.oy * g.out_w + self.ox, self.rows.clone(), cols);
        self.ox += 1;
        if self.ox == g.out_w {
            self.ox = 0;
            self.oy += 1;
            self.rows = Windows::rows(g, self.oy);
        }
        Some(item)
    }
}

/// Runs `f(input_image, output_image)` for every image, over threads when the output is large.
fn per_image<A: Sync, B: Send>(
    len: usize,
    input: &[A],
    input_image: usize,
    output: &mut [B],
    output_image: usize,
    f: impl Fn(&[A], &mut [B]) + Sync,
) {
    if input_image == 0 || output_image == 0 {
        return;
    }
    if worth_parallel::<B>(len) {
        output.par_chunks_mut(output_image).zip(input.par_chunks(input_image)).for_each(|(o, i)| f(i, o));
    } else {
        output.chunks_mut(output_image).zip(input.chunks(input_image)).for_each(|(o, i)| f(i, o));
    }
}

fn check_lens(g: &PoolGeometry, input: usize, output: usize) {
    g.check();
    assert_eq!(input, g.input_len(), "pooling input length does not match {g:?}");
    assert_eq!(output, g.output_len(), "pooling output length does not match {g:?}");
}

/// Channels handled together in registers (fixed-size arrays, so that the compiler keeps them
/// in vector registers and turns the comparisons into selects).
const LANES: usize = 16;

#[inline(always)]
fn lanes<T: Copy>(x: &[T], at: usize) -> [T; LANES] {
    x[at..at + LANES].try_into().expect("LANES elements")
}

/// For the window `rows × cols` of image `x` (`w` pixels wide, `c` channels), channels
/// `c0..c0 + LANES`: the largest values and the pixels (`iy * w + ix`) holding them, the first
/// in window order on ties (the first NaN, if any).
#[inline(always)]
fn window_max<T: Copy + PartialOrd>(
    x: &[T],
    w: usize,
    c: usize,
    c0: usize,
    rows: Range<usize>,
    cols: Range<usize>,
) -> ([T; LANES], [u32; LANES]) {
    let first = rows.start * w + cols.start;
    let mut best = lanes(x, first * c + c0);
    let mut arg = [first as u32; LANES];
    for iy in rows {
        for ix in cols.clone() {
            let p = iy * w + ix;
            let s = lanes(x, p * c + c0);
            for i in 0..LANES {
                let beats = beats_max(s[i], best[i]);
                best[i] = if beats { s[i] } else { best[i] };
                arg[i] = if beats { p as u32 } else { arg[i] };
            }
        }
    }
    (best, arg)
}

/// `window_max` for one channel `ch`.
#[inline(always)]
fn window_max1<T: Copy + PartialOrd>(
    x: &[T],
    w: usize,
    c: usize,
    ch: usize,
    rows: Range<usize>,
    cols: Range<usize>,
) -> (T, usize) {
    let mut arg = rows.start * w + cols.start;
    for iy in rows {
        for ix in cols.clone() {
            let p = iy * w + ix;
            if beats_max(x[p * c + ch], x[arg * c + ch]) {
                arg = p;
            }
        }
    }
    (x[arg * c + ch], arg)
}

/// `max_pool` of one image, for the widest vectors the processor has.
pub(crate) fn max_pool_image<T: Copy + PartialOrd>(g: &PoolGeometry, x: &[T], out: &mut [T]) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512bw")]
        unsafe fn avx512<T: Copy + PartialOrd>(g: &PoolGeometry, x: &[T], out: &mut [T]) {
            max_pool_image_impl(g, x, out)
        }
        #[target_feature(enable = "avx2")]
        unsafe fn avx2<T: Copy + PartialOrd>(g: &PoolGeometry, x: &[T], out: &mut [T]) {
            max_pool_image_impl(g, x, out)
        }
        if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512bw") {
            // SAFETY: the processor has the features `avx512` is compiled for.
            return unsafe { avx512(g, x, out) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the processor has AVX2.
            return unsafe { avx2(g, x, out) };
        }
    }
    max_pool_image_impl(g, x, out)
}

#[inline(always)]
fn max_pool_image_impl<T: Copy + PartialOrd>(g: &PoolGeometry, x: &[T], out: &mut [T]) {
    let c = g.c;
    let vector = c - c % LANES;
    for (o, rows, cols) in windows(g) {
        for c0 in (0..vector).step_by(LANES) {
            let (best, _) = window_max(x, g.w, c, c0, rows.clone(), cols.clone());
            out[o * c + c0..o * c + c0 + LANES].copy_from_slice(&best);
        }
        for ch in vector..c {
            out[o * c + ch] = window_max1(x, g.w, c, ch, rows.clone(), cols.clone()).0;
        }
    }
}

/// `output[b, oy, ox, c]`: the largest input element of the window, padding excluded (NaN if
/// the window holds one). `input` is `[n, h, w, c]`, `output` `[n, out_h, out_w, c]`.
pub fn max_pool<T: Copy + PartialOrd + Send + Sync>(g: &PoolGeometry, input: &[T], output: &mut [T]) {
    check_lens(g, input.len(), output.len());
    let c = g.c;
    per_image(output.len(), input, g.h * g.w * c, output, g.out_h * g.out_w * c, |x, out| max_pool_image(g, x, out));
}

/// `max_pool_grad` of one image, for the widest vectors the processor has.
fn max_pool_grad_image<T: Copy + PartialOrd>(g: &PoolGeometry, x: &[T], go: &[f32], grad: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512bw")]
        unsafe fn avx512<T: Copy + PartialOrd>(g: &PoolGeometry, x: &[T], go: &[f32], grad: &mut [f32]) {
            max_pool_grad_image_impl(g, x, go, grad)
        }
        #[target_feature(enable = "avx2")]
        unsafe fn avx2<T: Copy + PartialOrd>(g: &PoolGeometry, x: &[T], go: &[f32], grad: &mut [f32]) {
            max_pool_grad_image_impl(g, x, go, grad)
        }
        if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512bw") {
            // SAFETY: the processor has the features `avx512` is compiled for.
            return unsafe { avx512(g, x, go, grad) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the processor has AVX2.
            return unsafe { avx2(g, x, go, grad) };
        }
    }
    max_pool_grad_image_impl(g, x, go, grad)
}

/// Every element of a window gets `(its pixel is the argmax) ? grad : 0`, so that the work
/// vectorises. Where the windows tile the image exactly (stride = window, no padding, nothing
/// left over), each element is in one window and is written once; otherwise the image is
/// zeroed and the windows add, in output order. Adding +0.0 changes no sum (they start at +0.0
/// and so are never -0.0), and a written `grad + 0.0` is what `0.0 + grad` gives.
#[inline(always)]
fn max_pool_grad_image_impl<T: Copy + PartialOrd>(g: &PoolGeometry, x: &[T], go: &[f32], grad: &mut [f32]) {
    let c = g.c;
    let vector = c - c % LANES;
    let tiles = g.stride_h == g.kh
        && g.stride_w == g.kw
        && g.pad_top == 0
        && g.pad_left == 0
        && g.out_h * g.kh == g.h
        && g.out_w * g.kw == g.w;
    if !tiles {
        grad.fill(0.0);
    }
    for (o, rows, cols) in windows(g) {
        for c0 in (0..vector).step_by(LANES) {
            let (_, arg) = window_max(x, g.w, c, c0, rows.clone(), cols.clone());
            let d = lanes(go, o * c + c0);
            for iy in rows.clone() {
                for ix in cols.clone() {
                    let p = iy * g.w + ix;
                    let dst: &mut [f32; LANES] = (&mut grad[p * c + c0..p * c + c0 + LANES]).try_into().expect("LANES");
                    if tiles {
                        for i in 0..LANES {
                            dst[i] = if arg[i] == p as u32 { d[i] + 0.0 } else { 0.0 };
                        }
                    } else {
                        for i in 0..LANES {
                            dst[i] += if arg[i] == p as u32 { d[i] } else { 0.0 };
                        }
                    }
                }
            }
        }
        for ch in vector..c {
            let (_, arg) = window_max1(x, g.w, c, ch, rows.clone(), cols.clone());
            if tiles {
                for iy in rows.clone() {
                    for ix in cols.clone() {
                        grad[(iy * g.w + ix) * c + ch] = 0.0;
                    }
                }
            }
            grad[arg * c + ch] += go[o * c + ch];
        }
    }
}

/// The gradient of [`max_pool`]: `grad_input` (`[n, h, w, c]`, fully overwritten) gets each
/// window's `grad_output` at the window's largest element (the first in row-major window order
/// on ties; the first NaN if any); overlapping windows add up, in output order.
pub fn max_pool_grad<T: Copy + PartialOrd + Send + Sync>(
    g: &PoolGeometry,
    input: &[T],
    grad_output: &[f32],
    grad_input: &mut [f32],
) {
    check_lens(g, input.len(), grad_output.len());
    assert_eq!(grad_input.len(), input.len(), "max_pool_grad: grad_input must be as long as input");
    assert!(g.h * g.w <= u32::MAX as usize, "max_pool_grad: images of more than 2^32 pixels");
    let (in_image, out_image) = (g.h * g.w * g.c, g.out_h * g.out_w * g.c);
    if in_image == 0 {
        return;
    }
    if out_image == 0 {
        grad_input.fill(0.0);
        return;
    }
    if worth_parallel::<f32>(grad_input.len()) {
        grad_input
            .par_chunks_mut(in_image)
            .zip(input.par_chunks(in_image))
            .zip(grad_output.par_chunks(out_image))
            .for_each(|((grad, x), go)| max_pool_grad_image(g, x, go, grad));
    } else {
        for ((grad, x), go) in
            grad_input.chunks_mut(in_image).zip(input.chunks(in_image)).zip(grad_output.chunks(out_image))
        {
            max_pool_grad_image(g, x, go, grad);
        }
    }
}

/// `output[b, oy, ox, c]`: the mean of the window's input elements, padding excluded (their
/// sum in row-major window order, divided by their count).
pub fn avg_pool(g: &PoolGeometry, input: &[f32], output: &mut [f32]) {
    check_lens(g, input.len(), output.len());
    let c = g.c;
    per_image(output.len(), input, g.h * g.w * c, output, g.out_h * g.out_w * c, |x, out| {
        for (o, rows, cols) in windows(g) {
            let dst = &mut out[o * c..(o + 1) * c];
            dst.fill(0.0);
            let count = (rows.len() * cols.len()) as f32;
            for iy in rows {
                for ix in cols.clone() {
                    let src = &x[(iy * g.w + ix) * c..(iy * g.w + ix + 1) * c];
                    for (d, &s) in dst.iter_mut().zip(src) {
                        *d += s;
                    }
                }
            }
            for d in dst {
                *d /= count;
            }
        }
    });
}

/// The gradient of [`avg_pool`]: `grad_input` (`[n, h, w, c]`, fully overwritten) gets, from
/// each window, its `grad_output` divided by the window's count of input elements, added to
/// each of them (in output order).
pub fn avg_pool_grad(g: &PoolGeometry, grad_output: &[f32], grad_input: &mut [f32]) {
    check_lens(g, grad_input.len(), grad_output.len());
    let c = g.c;
    let (in_image, out_image) = (g.h * g.w * c, g.out_h * g.out_w * c);
    if in_image == 0 {
        return;
    }
    if out_image == 0 {
        grad_input.fill(0.0);
        return;
    }
    per_image(grad_input.len(), grad_output, out_image, grad_input, in_image, |go, grad| {
        grad.fill(0.0);
        for (o, rows, cols) in windows(g) {
            let count = (rows.len() * cols.len()) as f32;
            let go = &go[o * c..(o + 1) * c];
            for iy in rows {
                for ix in cols.clone() {
                    let dst = &mut grad[(iy * g.w + ix) * c..(iy * g.w + ix + 1) * c];
                    for (d, &s) in dst.iter_mut().zip(go) {
                        *d += s / count;
                    }
                }
            }
        }
    });
}
