//! The forward convolution for thin windows (`kh * kw * c` at most [`THIN_PATCH`], like a first
//! layer on one channel): `sgemm` with so small an inner dimension spends more on packing than
//! on arithmetic, and `im2col` costs more than the product, so this reads the windows in place
//! and keeps the sums in vector registers along the filters. (The filter gradient of such
//! layers has a long inner dimension, the rows, and `sgemm` does it better than a direct loop.)
//!
//! Output rows are walked in [`Steps`]: groups of [`PIXELS`] windows side by side, all inside
//! the input (they share each filter load), or single windows, copied with zeros to the stack
//! when they reach into the padding. A convolution max-pooled 2×2 as it is computed takes the
//! four pixels of each pooling window as its group, and their maximum in registers; with
//! AVX-512, a 3×3 window of stride 1 on one channel (the first layer on grey images) reads the
//! 4×4 patch under the group once, 32 filters at a time.
//!
//! Each function is compiled three times and picks, at run time, the copy for the widest
//! vectors the processor has (AVX-512, AVX2, or the baseline).

use crate::conv::PoolEpilogue;
use crate::geometry::{valid_taps, Conv2dGeometry, PoolGeometry};
use crate::pool::beats_max;

/// The longest window (`kh * kw * c`) handled here.
pub(crate) const THIN_PATCH: usize = 32;

/// Output positions computed together.
const PIXELS: usize = 4;

/// One window as `segments` runs of `len` elements of `src`, `stride` apart from `base`: its
/// rows in the input, or one run holding a copy.
#[derive(Clone, Copy)]
struct Window<'a> {
    src: &'a [f32],
    base: usize,
    len: usize,
    stride: usize,
    segments: usize,
}

/// The window of output position `(b, oy, ox)`: in place when it lies inside the input,
/// otherwise copied into `buf` with zeros for the padding.
#[inline(always)]
fn window<'a>(
    g: &Conv2dGeometry,
    x: &'a [f32],
    (b, oy, ox): (usize, usize, usize),
    buf: &'a mut [f32; THIN_PATCH],
) -> Window<'a> {
    let kwc = g.kw * g.c;
    if g.interior(oy, ox) {
        let (iy, ix) = (oy * g.stride_h - g.pad_top, ox * g.stride_w - g.pad_left);
        return Window { src: x, base: ((b * g.h + iy) * g.w + ix) * g.c, len: kwc, stride: g.w * g.c, segments: g.kh };
    }
    let patch = g.patch_len();
    buf[..patch].fill(0.0);
    let ys = valid_taps(oy, g.stride_h, g.pad_top, g.kh, g.h);
    let xs = valid_taps(ox, g.stride_w, g.pad_left, g.kw, g.w);
    if !xs.is_empty() {
        let ix = ox * g.stride_w + xs.start - g.pad_left;
        let len = xs.len() * g.c;
        for ky in ys {
            let iy = oy * g.stride_h + ky - g.pad_top;
            let src = ((b * g.h + iy) * g.w + ix) * g.c;
            let dst = ky * kwc + xs.start * g.c;
            buf[dst..dst + len].copy_from_slice(&x[src..src + len]);
        }
    }
    Window { src: &buf[..patch], base: 0, len: patch, stride: patch, segments: 1 }
}

/// A step of the walk over output rows `row0..row0 + rows`; `r` counts rows from `row0`.
enum Step {
    /// Rows `r..r + PIXELS`, side by side in one output row, with windows inside the input
    /// starting at `bases` (each `kh` runs of `kw * c`, `w * c` apart).
    Group { r: usize, bases: [usize; PIXELS] },
    /// Row `r`, at output position `(b, oy, ox)`.
    Single { r: usize, at: (usize, usize, usize) },
}

struct Steps<'a> {
    g: &'a Conv2dGeometry,
    r: usize,
    rows: usize,
    b: usize,
    oy: usize,
    ox: usize,
}

fn steps(g: &Conv2dGeometry, row0: usize, rows: usize) -> Steps<'_> {
    let (b, oy, ox) = if rows == 0 { (0, 0, 0) } else { g.split_row(row0) };
    Steps { g, r: 0, rows, b, oy, ox }
}

impl Iterator for Steps<'_> {
    type Item = Step;

    #[inline(always)]
    fn next(&mut self) -> Option<Step> {
        let g = self.g;
        if self.r >= self.rows {
            return None;
        }
        let (r, b, oy, ox) = (self.r, self.b, self.oy, self.ox);
        let group =
            r + PIXELS <= self.rows && ox + PIXELS <= g.out_w && g.interior(oy, ox) && g.interior(oy, ox + PIXELS - 1);
        let (step, advance) = if group {
            let (iy, ix) = (oy * g.stride_h - g.pad_top, ox * g.stride_w - g.pad_left);
            let base = ((b * g.h + iy) * g.w + ix) * g.c;
            (Step::Group { r, bases: std::array::from_fn(|q| base + q * g.stride_w * g.c) }, PIXELS)
        } else {
            (Step::Single { r, at: (b, oy, ox) }, 1)
        };
        self.r += advance;
        self.ox += advance;
        if self.ox == g.out_w {
            self.ox = 0;
            self.oy += 1;
            if self.oy == g.out_h {
                self.oy = 0;
                self.b += 1;
            }
        }
        Some(step)
    }
}

/// Defines `$name`, which calls `$imp` compiled for the widest vectors the processor has; with two paths, the
/// first for AVX-512 (32 vector registers) and the second for the narrower copies.
macro_rules! widest {
    ($name:ident => $imp:ident ($($arg:ident: $ty:ty),*)) => {
        widest!($name => [$imp, $imp] ($($arg: $ty),*));
    };
    ($name:ident => [$wide:path, $narrow:path] ($($arg:ident: $ty:ty),*)) => {
        #[allow(clippy::too_many_arguments)]
        pub(crate) fn $name($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[allow(clippy::too_many_arguments)]
                #[target_feature(enable = "avx512f")]
                unsafe fn avx512($($arg: $ty),*) {
                    $wide($($arg),*)
                }
                #[allow(clippy::too_many_arguments)]
                #[target_feature(enable = "avx2")]
                unsafe fn avx2($($arg: $ty),*) {
                    $narrow($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the processor has AVX-512F.
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: the processor has AVX2.
                    return unsafe { avx2($($arg),*) };
                }
            }
            $narrow($($arg),*)
        }
    };
}

widest!(thin_conv => thin_conv_impl(g: &Conv2dGeometry, x: &[f32], filter: &[f32], row0: usize, rows: usize, out: &mut [f32]));
widest!(thin_conv_max_pool_2x2 => [thin_conv_max_pool_2x2_impl::<true>, thin_conv_max_pool_2x2_impl::<false>] (
    g: &Conv2dGeometry, pool: &PoolGeometry, x: &[f32], filter: &[f32], then: PoolEpilogue<'_>, row: (usize, usize),
    out: &mut [f32]
));

/// Whether pooled row `py` (of a pooling without padding over the convolution's output) can be computed by
/// [`thin_conv_max_pool_2x2`]: a 2×2 window whose four convolution windows lie inside the input at every pooled
/// pixel of the row.
pub(crate) fn pooled_quads_apply(g: &Conv2dGeometry, pool: &PoolGeometry, py: usize) -> bool {
    if pool.kh != 2 || pool.kw != 2 || pool.out_w == 0 || pool.pad_top != 0 || pool.pad_left != 0 {
        return false;
    }
    // The windows inside the input form a rectangle of output positions: its corners tell.
    let (oy, last) = (py * pool.stride_h, (pool.out_w - 1) * pool.stride_w + 1);
    [oy, oy + 1].into_iter().all(|oy| g.interior(oy, 0) && g.interior(oy, last))
}

/// Rows `row0..row0 + rows` of the forward pass (`out` is `rows × filters`): each output the
/// sum over its window, in order, of plain products, starting from 0 — bitwise what the
/// interpreter computes.
#[inline(always)]
fn thin_conv_impl(g: &Conv2dGeometry, x: &[f32], filter: &[f32], row0: usize, rows: usize, out: &mut [f32]) {
    debug_assert!(g.patch_len() <= THIN_PATCH);
    let n = g.filters;
    let mut buf = [0.0f32; THIN_PATCH];
    for step in steps(g, row0, rows) {
        match step {
            Step::Group { r, bases } => {
                let outs = &mut out[r * n..(r + PIXELS) * n];
                let mut f = 0;
                while f + 16 <= n {
                    conv_group::<16>(g, x, bases, filter, f, outs);
                    f += 16;
                }
                while f < n {
                    conv_group::<1>(g, x, bases, filter, f, outs);
                    f += 1;
                }
            }
            Step::Single { r, at } => {
                let window = window(g, x, at, &mut buf);
                let out = &mut out[r * n..(r + 1) * n];
                let mut f = 0;
                while f + 32 <= n {
                    conv_single::<32>(window, filter, n, f, &mut out[f..f + 32]);
                    f += 32;
                }
                while f + 8 <= n {
                    conv_single::<8>(window, filter, n, f, &mut out[f..f + 8]);
                    f += 8;
                }
                while f < n {
                    conv_single::<1>(window, filter, n, f, &mut out[f..f + 1]);
                    f += 1;
                }
            }
        }
    }
}

/// Filters `f..f + L` of the `PIXELS` outputs of a group (rows of `outs`, `filters` apart).
#[inline(always)]
fn conv_group<const L: usize>(
    g: &Conv2dGeometry,
    x: &[f32],
    bases: [usize; PIXELS],
    filter: &[f32],
    f: usize,
    outs: &mut [f32],
) {
    let n = g.filters;
    assert!((PIXELS - 1) * n + f + L <= outs.len(), "thin_conv: the output is too short");
    let acc = conv_pixels::<L>(g, x, bases, filter, f);
    for q in 0..PIXELS {
        outs[q * n + f..q * n + f + L].copy_from_slice(&acc[q]);
    }
}

/// Filters `f..f + L` of `PIXELS` outputs whose windows lie inside the input, starting at `bases` (each `kh` runs
/// of `kw * c`, `w * c` apart): the sums, held in registers.
///
/// The bounds of every element read are checked once, before the loop: checks per element kept the loop from
/// being vectorised along the filters (the cnn's first layer ran at a quarter of the speed of its multiplies and
/// adds).
#[inline(always)]
fn conv_pixels<const L: usize>(
    g: &Conv2dGeometry,
    x: &[f32],
    bases: [usize; PIXELS],
    filter: &[f32],
    f: usize,
) -> [[f32; L]; PIXELS] {
    // A 3×3 window on one channel (a first layer on grey images), its loops unrolled with the constants; any other
    // shape as it comes.
    match (g.kh, g.kw * g.c) {
        (3, 3) => sum_windows_of::<L>(g, x, bases, filter, f, 3, 3),
        (kh, len) => sum_windows_of::<L>(g, x, bases, filter, f, kh, len),
    }
}

/// `conv_pixels` over windows of `kh` runs of `len` elements (`kw · c`).
#[inline(always)]
#[allow(clippy::needless_range_loop)] // `q` and `i` index the accumulators in step with the runs and filters
fn sum_windows_of<const L: usize>(
    g: &Conv2dGeometry,
    x: &[f32],
    bases: [usize; PIXELS],
    filter: &[f32],
    f: usize,
    kh: usize,
    len: usize,
) -> [[f32; L]; PIXELS] {
    let (n, stride) = (g.filters, g.w * g.c);
    let taps = kh * len;
    let mut acc = [[0.0f32; L]; PIXELS];
    if taps == 0 {
        return acc;
    }
    // The last run of the pixel furthest in ends past every other.
    let x_end = bases.iter().max().copied().unwrap_or(0) + (kh - 1) * stride + len;
    assert!(x_end <= x.len(), "thin_conv: a window past the input");
    assert!((taps - 1) * n + f + L <= filter.len(), "thin_conv: the filter is too short");
    let mut p = 0;
    for s in 0..kh {
        for j in 0..len {
            // SAFETY: p < taps, so p·n + f + L ≤ filter.len() (asserted above); the L floats are read as an array
            // of f32 (align 4, as the slice's elements).
            let w: &[f32; L] = unsafe { &*filter.as_ptr().add(p * n + f).cast::<[f32; L]>() };
            for q in 0..PIXELS {
                // SAFETY: bases[q] + s·stride + j < max(bases) + (kh - 1)·stride + len = x_end ≤ x.len().
                let v = unsafe { *x.get_unchecked(bases[q] + s * stride + j) };
                for i in 0..L {
                    acc[q][i] += v * w[i];
                }
            }
            p += 1;
        }
    }
    acc
}

/// Pooled row `(b, py)`, row `py` of image `b` (`out`, `pool.out_w × filters`) of a 2×2 max pooling over the
/// convolution, where [`pooled_quads_apply`]: each pooled pixel from its window's four convolution outputs, summed
/// side by side in registers (as a group of [`PIXELS`] in a row is) and their maximum taken there, then `then` over
/// the row, the convolution never stored. The same bits as [`thin_conv`] then `max_pool` then `then`: the same sums,
/// and the window's elements compared in its order.
#[inline(always)]
fn thin_conv_max_pool_2x2_impl<const ZMM: bool>(
    g: &Conv2dGeometry,
    pool: &PoolGeometry,
    x: &[f32],
    filter: &[f32],
    then: PoolEpilogue<'_>,
    (b, py): (usize, usize),
    out: &mut [f32],
) {
    const { assert!(PIXELS == 4, "a 2×2 window is a group of pixels") };
    let n = g.filters;
    assert!(out.len() >= pool.out_w * n, "thin_conv_max_pool_2x2: the output is too short");
    let base =
        |oy: usize, ox: usize| ((b * g.h + oy * g.stride_h - g.pad_top) * g.w + ox * g.stride_w - g.pad_left) * g.c;
    let oy = py * pool.stride_h;
    let out = &mut out[..pool.out_w * n];
    // With AVX-512's 32 vector registers; with AVX2's 16 it ran slower than `pooled` (0.90–0.96 ms, 0.76–0.83).
    let grey_3x3 = ZMM && g.kh == 3 && g.kw == 3 && g.c == 1 && g.stride_h == 1 && g.stride_w == 1;
    for px in 0..pool.out_w {
        let ox = px * pool.stride_w;
        // The window's pixels in its order: row by row.
        let bases = [base(oy, ox), base(oy, ox + 1), base(oy + 1, ox), base(oy + 1, ox + 1)];
        let out = &mut out[px * n..(px + 1) * n];
        let mut f = 0;
        if grey_3x3 {
            while f + 32 <= n {
                pooled_grey_3x3::<32>(x, bases[0], g.w, filter, n, f, &mut out[f..f + 32]);
                f += 32;
            }
            while f + 16 <= n {
                pooled_grey_3x3::<16>(x, bases[0], g.w, filter, n, f, &mut out[f..f + 16]);
                f += 16;
            }
        }
        while f + 16 <= n {
            pooled::<16>(g, x, bases, filter, f, &mut out[f..f + 16]);
            f += 16;
        }
        while f < n {
            pooled::<1>(g, x, bases, filter, f, &mut out[f..f + 1]);
            f += 1;
        }
    }
    // The epilogue over the row, still in L1, in a pass of its own: inside the loop above it kept the compiler from
    // holding the sums in vector registers (the first layer ran 3.5 times as long).
    for pixel in out.chunks_exact_mut(n) {
        then.apply(pixel, 0);
    }
}

/// Filters `f..f + L` of one pooled pixel: the largest of its window's `PIXELS` outputs (the first NaN, if any;
/// the earlier on ties), as `max_pool` compares them.
#[inline(always)]
fn pooled<const L: usize>(
    g: &Conv2dGeometry,
    x: &[f32],
    bases: [usize; PIXELS],
    filter: &[f32],
    f: usize,
    out: &mut [f32],
) {
    let acc = conv_pixels::<L>(g, x, bases, filter, f);
    out.copy_from_slice(&largest(acc));
}

/// The largest of the window's `PIXELS` sums, lane by lane, as `max_pool` compares them.
#[inline(always)]
fn largest<const L: usize>(acc: [[f32; L]; PIXELS]) -> [f32; L] {
    let mut best = acc[0];
    for sums in &acc[1..] {
        for (best, &sum) in best.iter_mut().zip(sums) {
            if beats_max(sum, *best) {
                *best = sum;
            }
        }
    }
    best
}

/// [`pooled`] for a 3×3 window of stride 1 on one channel (a first layer on grey images), whose four windows lie
/// in a 4×4 patch of the input from `top` (rows `row` apart): each element of the patch is read once and
/// multiplied by every tap that sees it. The same sums in the same order, to the bit. Written out so, the sums
/// stay in registers and each element is broadcast once, not once per window and tap: the CNN's first layer at
/// inference on Zen 4 took 0.47–0.48 ms on one thread, 0.72–0.74 as `pooled` (two threads: 0.27–0.28, 0.38–0.40).
#[inline(always)]
#[allow(clippy::needless_range_loop)] // `r` indexes the patch and the input's rows in step
fn pooled_grey_3x3<const L: usize>(
    x: &[f32],
    top: usize,
    row: usize,
    filter: &[f32],
    n: usize,
    f: usize,
    out: &mut [f32],
) {
    assert!(top + 3 * row + 4 <= x.len(), "thin_conv: a window past the input");
    assert!(8 * n + f + L <= filter.len(), "thin_conv: the filter is too short");
    let mut patch = [[0.0f32; 4]; 4];
    for r in 0..4 {
        // SAFETY: top + r·row + 4 ≤ top + 3·row + 4 ≤ x.len() (asserted above).
        patch[r] = unsafe { *x.as_ptr().add(top + r * row).cast::<[f32; 4]>() };
    }
    let mut acc = [[0.0f32; L]; PIXELS];
    // The rows of taps written out one by one: as a loop, LLVM kept it one, reading the patch from the stack.
    grey_3x3_taps(&mut acc, &patch, 0, filter, n, f);
    grey_3x3_taps(&mut acc, &patch, 1, filter, n, f);
    grey_3x3_taps(&mut acc, &patch, 2, filter, n, f);
    out.copy_from_slice(&largest(acc));
}

/// Row `s` of [`pooled_grey_3x3`]'s taps, added to the four windows' sums.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // `q` and `i` index the patch and the sums in step
fn grey_3x3_taps<const L: usize>(
    acc: &mut [[f32; L]; PIXELS],
    patch: &[[f32; 4]; 4],
    s: usize,
    filter: &[f32],
    n: usize,
    f: usize,
) {
    for j in 0..3 {
        // SAFETY: (s·3 + j)·n + f + L ≤ 8·n + f + L ≤ filter.len() (asserted by the caller); read as an array of f32.
        let w: &[f32; L] = unsafe { &*filter.as_ptr().add((s * 3 + j) * n + f).cast::<[f32; L]>() };
        for q in 0..PIXELS {
            let v = patch[s + q / 2][j + q % 2];
            for i in 0..L {
                acc[q][i] += v * w[i];
            }
        }
    }
}

/// Filters `f..f + L` of one output.
#[inline(always)]
fn conv_single<const L: usize>(window: Window, filter: &[f32], n: usize, f: usize, out: &mut [f32]) {
    let mut acc = [0.0f32; L];
    let mut p = 0;
    for s in 0..window.segments {
        let start = window.base + s * window.stride;
        for &v in &window.src[start..start + window.len] {
            let w: &[f32; L] = filter[p * n + f..p * n + f + L].try_into().expect("L filters");
            for i in 0..L {
                acc[i] += v * w[i];
            }
            p += 1;
        }
    }
    out.copy_from_slice(&acc);
}
