//! Batch normalisation over the channels (the last axis) of `[rows, channels]` f32 data: the
//! batch's moments, the normalisation with given moments, and its gradient through the batch's
//! own moments, its two means per channel and then the gradient itself
//! (`dfc_ir::Op::{Moments, BatchNorm, BatchNormGradMeans, BatchNormGrad}`).
//!
//! The per-channel sums run in f64 over chunks of rows of a size fixed by the shape
//! ([`chunk_rows`]), each chunk into its own partial sums, which are then added in chunk
//! order: the result is the same bits whatever the number of threads. The moments are one pass
//! (sums of `x` and `x²`; in f64 the variance's cancellation costs nothing at f32 precision
//! unless the mean is some 10⁴ deviations from 0); the interpreter computes the variance from
//! the deviations, so the two agree up to f32 rounding.

use crate::worth_parallel;
use rayon::prelude::*;

/// Elements of `x` per chunk of rows: enough to pay for a task, few enough to split a batch.
const CHUNK_ELEMENTS: usize = 1 << 14;

/// Rows per chunk of the column sums for `channels` channels.
fn chunk_rows(channels: usize) -> usize {
    (CHUNK_ELEMENTS / channels.max(1)).max(1)
}

/// f64 scratch that [`moments`] and [`batch_norm_grad_means`] need for `len` elements of `channels`
/// channels: two partial sums per channel per chunk.
pub fn norm_partials_len(len: usize, channels: usize) -> usize {
    let rows = len / channels.max(1);
    rows.div_ceil(chunk_rows(channels)).max(1) * 2 * channels
}

/// f32 scratch that [`batch_norm`] and the gradient's kernels need: two values per channel.
pub fn norm_scales_len(channels: usize) -> usize {
    2 * channels
}

/// Runs `body` compiled for the widest vectors the processor has: inlined into a function with
/// those features, its loops over the channels vectorise wider. No FMA contraction happens
/// either way (Rust does not contract), so every path gives the same bits.
#[inline(always)]
fn widest(body: impl FnOnce()) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f")]
        unsafe fn avx512(body: impl FnOnce()) {
            body()
        }
        #[target_feature(enable = "avx2")]
        unsafe fn avx2(body: impl FnOnce()) {
            body()
        }
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the processor has the features `avx512` is compiled for.
            return unsafe { avx512(body) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the processor has AVX2.
            return unsafe { avx2(body) };
        }
    }
    body()
}

/// Per chunk of rows, the sums of `first(x, g)` and `second(x, g)` per channel, then their
/// totals over the chunks in order, in `partials[..2 * channels]`.
fn column_sums(
    x: &[f32],
    g: &[f32],
    channels: usize,
    partials: &mut [f64],
    sums: impl Fn(&[f32], &[f32], &mut [f64], &mut [f64]) + Sync,
) {
    let chunk = chunk_rows(channels) * channels;
    let partials = &mut partials[..x.len().div_ceil(chunk).max(1) * 2 * channels];
    // Without rows no chunk runs: the totals are the zeros of the first.
    partials[..2 * channels].fill(0.0);
    let fold = |(p, (x, g)): (&mut [f64], (&[f32], &[f32]))| {
        p.fill(0.0);
        let (first, second) = p.split_at_mut(channels);
        widest(|| {
            for (row, g_row) in x.chunks_exact(channels).zip(g.chunks_exact(channels)) {
                sums(row, g_row, first, second);
            }
        })
    };
    // Without a gradient, `g` is `x` (the sums ignore it).
    if worth_parallel::<f32>(x.len()) {
        partials.par_chunks_mut(2 * channels).zip(x.par_chunks(chunk).zip(g.par_chunks(chunk))).for_each(fold);
    } else {
        partials.chunks_mut(2 * channels).zip(x.chunks(chunk).zip(g.chunks(chunk))).for_each(fold);
    }
    let (total, rest) = partials.split_at_mut(2 * channels);
    for p in rest.chunks(2 * channels) {
        total.iter_mut().zip(p).for_each(|(t, v)| *t += v);
    }
}

/// Each channel's mean and biased variance over the rows of `x`, as `out = [means, variances]`
/// (`2 * channels` values); `partials` holds at least [`norm_partials_len`] values.
pub fn moments(x: &[f32], channels: usize, out: &mut [f32], partials: &mut [f64]) {
    if channels == 0 {
        return;
    }
    let rows = (x.len() / channels.max(1)).max(1) as f64;
    column_sums(x, x, channels, partials, |row, _, sum, squares| {
        for ((s, q), &v) in sum.iter_mut().zip(squares.iter_mut()).zip(row) {
            let v = v as f64;
            *s += v;
            *q += v * v;
        }
    });
    let (means, variances) = out.split_at_mut(channels);
    for c in 0..channels {
        let mean = partials[c] / rows;
        means[c] = mean as f32;
        variances[c] = (partials[channels + c] / rows - mean * mean).max(0.0) as f32;
    }
}

/// Each channel's mean and reciprocal deviation `1 / sqrt(variance + epsilon)` from moments,
/// into `scales[..2 * channels]`, as the interpreter computes them (in f32).
fn channel_scales(moments: &[f32], channels: usize, epsilon: f64, scales: &mut [f32]) {
    let (mean, r) = scales[..2 * channels].split_at_mut(channels);
    mean.copy_from_slice(&moments[..channels]);
    for (r, &v) in r.iter_mut().zip(&moments[channels..2 * channels]) {
        *r = 1.0 / (v + epsilon as f32).sqrt();
    }
}

/// Applies `f(x_row, g_row, out_row)` to every row, over threads when large.
fn map_rows(x: &[f32], g: &[f32], channels: usize, out: &mut [f32], f: impl Fn(&[f32], &[f32], &mut [f32]) + Sync) {
    let chunk = chunk_rows(channels) * channels;
    let run = |(o, (x, g)): (&mut [f32], (&[f32], &[f32]))| {
        widest(|| {
            for ((o, x), g) in o.chunks_exact_mut(channels).zip(x.chunks_exact(channels)).zip(g.chunks_exact(channels))
            {
                f(x, g, o);
            }
        })
    };
    if worth_parallel::<f32>(x.len()) {
        out.par_chunks_mut(chunk).zip(x.par_chunks(chunk).zip(g.par_chunks(chunk))).for_each(run);
    } else {
        out.chunks_mut(chunk).zip(x.chunks(chunk).zip(g.chunks(chunk))).for_each(run);
    }
}

/// `out = (x - mean) · rsqrt(variance + epsilon)` per channel, the `moments` as [`moments`]
/// gives them; `scales` holds at least [`norm_scales_len`] values.
pub fn batch_norm(x: &[f32], moments: &[f32], channels: usize, epsilon: f64, out: &mut [f32], scales: &mut [f32]) {
    if channels == 0 {
        return;
    }
    channel_scales(moments, channels, epsilon, scales);
    let (mean, r) = scales[..2 * channels].split_at(channels);
    map_rows(x, x, channels, out, |x, _, o| {
        for (((o, &v), &m), &r) in o.iter_mut().zip(x).zip(mean).zip(r) {
            *o = (v - m) * r;
        }
    });
}

/// Of [`batch_norm`]'s gradient, each channel's means of `g` and of `g · x̂` over the rows,
/// as `out = [g means, g·x̂ means]` (`2 * channels` values); `scales` and `partials` as for
/// [`batch_norm`] and [`moments`].
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_grad_means(
    x: &[f32],
    moments: &[f32],
    g: &[f32],
    channels: usize,
    epsilon: f64,
    out: &mut [f32],
    scales: &mut [f32],
    partials: &mut [f64],
) {
    if channels == 0 {
        return;
    }
    let rows = (x.len() / channels).max(1) as f64;
    channel_scales(moments, channels, epsilon, scales);
    let (mean, r) = scales[..2 * channels].split_at(channels);
    column_sums(x, g, channels, partials, |x, g, g_sum, gx_sum| {
        let sums = g_sum.iter_mut().zip(gx_sum.iter_mut());
        for ((gs, gxs), ((&v, &g), (&m, &r))) in sums.zip(x.iter().zip(g).zip(mean.iter().zip(r))) {
            let normalised = (v - m) * r;
            *gs += g as f64;
            *gxs += (g * normalised) as f64;
        }
    });
    for (m, &s) in out[..2 * channels].iter_mut().zip(&partials[..2 * channels]) {
        *m = (s / rows) as f32;
    }
}

/// The gradient of [`batch_norm`] with the batch's own moments: per channel
/// `r · (g - mean(g) - x̂ · mean(g · x̂))`, those means in `means` (as
/// [`batch_norm_grad_means`] gives them); `scales` as for [`batch_norm`].
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_grad(
    x: &[f32],
    moments: &[f32],
    g: &[f32],
    means: &[f32],
    channels: usize,
    epsilon: f64,
    out: &mut [f32],
    scales: &mut [f32],
) {
    if channels == 0 {
        return;
    }
    channel_scales(moments, channels, epsilon, scales);
    let (mean, r) = scales[..2 * channels].split_at(channels);
    let (g_mean, gx_mean) = means[..2 * channels].split_at(channels);
    map_rows(x, g, channels, out, |x, g, o| {
        let scales = mean.iter().zip(r).zip(g_mean.iter().zip(gx_mean));
        for ((o, (&v, &g)), ((&m, &r), (&gm, &gxm))) in o.iter_mut().zip(x.iter().zip(g)).zip(scales) {
            let normalised = (v - m) * r;
            *o = r * (g - gm - normalised * gxm);
        }
    });
}
