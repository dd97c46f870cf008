//! Reductions and the ops built on them: reduce, argmax, softmax, log_softmax and the two
//! cross-entropy losses.

use crate::layout::{gather_strided, n_elements, split_at_axis, strides};
use crate::scalar::{beats_max, maximum, minimum, Fault, Float, Num, Scalar};
use dfc_ir::ReduceKind;

/// Regroups `x` so that the reduced axes come last: the result is one contiguous group of
/// `Π dims[axes]` elements per output element, in row-major order of both the kept and the
/// reduced axes. Returns the kept dims (with 1 in place of reduced axes if `keep_dims`), the
/// group size and the regrouped values.
fn regroup<T: Scalar>(x: &[T], dims: &[usize], axes: &[usize], keep_dims: bool) -> (Vec<usize>, usize, Vec<T>) {
    let in_strides = strides(dims);
    let reduced = |a: &usize| axes.contains(a);
    let order: Vec<usize> = (0..dims.len()).filter(|a| !reduced(a)).chain((0..dims.len()).filter(reduced)).collect();
    let moved_dims: Vec<usize> = order.iter().map(|&a| dims[a]).collect();
    let moved_strides: Vec<usize> = order.iter().map(|&a| in_strides[a]).collect();
    let values = gather_strided(x, &moved_dims, &moved_strides, 0);
    let group = n_elements(&moved_dims[dims.len() - axes.len()..]);
    let out_dims = (0..dims.len())
        .filter_map(|a| match (reduced(&a), keep_dims) {
            (false, _) => Some(dims[a]),
            (true, true) => Some(1),
            (true, false) => None,
        })
        .collect();
    (out_dims, group, values)
}

/// Applies `f` to each group of the regrouped values.
fn reduce_groups<T: Scalar, U>(
    x: &[T],
    dims: &[usize],
    axes: &[usize],
    keep_dims: bool,
    mut f: impl FnMut(&[T]) -> Result<U, Fault>,
) -> Result<(Vec<usize>, Vec<U>), Fault> {
    let (out_dims, group, values) = regroup(x, dims, axes, keep_dims);
    let n_out = n_elements(&out_dims);
    let out = (0..n_out).map(|i| f(&values[i * group..(i + 1) * group])).collect::<Result<Vec<U>, Fault>>()?;
    Ok((out_dims, out))
}

/// `max` and `min` over `axes` (any element type; on bool they are `any` and `all`). NaN
/// propagates. Over no elements they give the identity: -inf/+inf, the type's MIN/MAX,
/// false/true (as TensorFlow).
pub(crate) fn reduce_order<T: Scalar>(
    kind: ReduceKind,
    x: &[T],
    dims: &[usize],
    axes: &[usize],
    keep_dims: bool,
) -> (Vec<usize>, Vec<T>) {
    let result = match kind {
        ReduceKind::Max => {
            reduce_groups(x, dims, axes, keep_dims, |g| Ok(g.iter().fold(T::lowest(), |m, &v| maximum(m, v))))
        }
        ReduceKind::Min => {
            reduce_groups(x, dims, axes, keep_dims, |g| Ok(g.iter().fold(T::highest(), |m, &v| minimum(m, v))))
        }
        ReduceKind::Sum | ReduceKind::Mean => unreachable!("sum and mean are reduce_num's"),
    };
    result.expect("max and min cannot fail")
}

/// Every reduction on numbers. `sum` adds in row-major order (integers wrap; over no elements
/// it is 0); `mean` is described at `Num::mean`.
pub(crate) fn reduce_num<T: Num>(
    kind: ReduceKind,
    x: &[T],
    dims: &[usize],
    axes: &[usize],
    keep_dims: bool,
) -> Result<(Vec<usize>, Vec<T>), Fault> {
    match kind {
        ReduceKind::Sum => reduce_groups(x, dims, axes, keep_dims, |g| Ok(g.iter().fold(T::zero(), |s, &v| s.add(v)))),
        ReduceKind::Mean => reduce_groups(x, dims, axes, keep_dims, T::mean),
        ReduceKind::Max | ReduceKind::Min => Ok(reduce_order(kind, x, dims, axes, keep_dims)),
    }
}

/// The index of the largest element along `axis`, the first on ties (a NaN counts as largest,
/// the first NaN winning). An empty axis is an error.
pub(crate) fn argmax<T: Scalar>(x: &[T], dims: &[usize], axis: usize) -> Result<(Vec<usize>, Vec<i64>), Fault> {
    let (outer, len, inner) = split_at_axis(dims, axis);
    let mut out_dims = dims.to_vec();
    out_dims.remove(axis);
    if len == 0 && outer * inner > 0 {
        return Err(Fault::Invalid(format!("argmax over axis {axis}, which is empty")));
    }
    let mut out = Vec::with_capacity(outer * inner);
    for o in 0..outer {
        for i in 0..inner {
            let at = |a: usize| x[(o * len + a) * inner + i];
            let mut best = 0;
            for a in 1..len {
                if beats_max(at(a), at(best)) {
                    best = a;
                }
            }
            out.push(best as i64);
        }
    }
    Ok((out_dims, out))
}

/// Applies `f` to every 1-D lane of `x` along `axis` (gathered into a contiguous buffer),
/// writing the lane `f` returns in its place.
fn map_lanes<T: Float>(x: &[T], dims: &[usize], axis: usize, mut f: impl FnMut(&[T], &mut [T])) -> Vec<T> {
    let (outer, len, inner) = split_at_axis(dims, axis);
    let mut out = vec![T::zero(); x.len()];
    let mut lane = vec![T::zero(); len];
    let mut result = vec![T::zero(); len];
    for o in 0..outer {
        for i in 0..inner {
            for a in 0..len {
                lane[a] = x[(o * len + a) * inner + i];
            }
            f(&lane, &mut result);
            for a in 0..len {
                out[(o * len + a) * inner + i] = result[a];
            }
        }
    }
    out
}

/// `max(lane)` and `ln Σ exp(lane - max)`: the log-sum-exp is their sum, computed without
/// overflow.
fn max_and_log_sum_exp<T: Float>(lane: &[T]) -> (T, T) {
    let max = lane.iter().fold(T::lowest(), |m, &v| maximum(m, v));
    let sum = lane.iter().fold(T::zero(), |s, &v| s.add(v.sub(max).exp()));
    (max, sum.ln())
}

/// `exp(x - max) / Σ exp(x - max)` along `axis`.
pub(crate) fn softmax<T: Float>(x: &[T], dims: &[usize], axis: usize) -> Vec<T> {
    map_lanes(x, dims, axis, |lane, out| {
        let max = lane.iter().fold(T::lowest(), |m, &v| maximum(m, v));
        for (o, &v) in out.iter_mut().zip(lane) {
            *o = v.sub(max).exp();
        }
        let sum = out.iter().fold(T::zero(), |s, &v| s.add(v));
        for o in out.iter_mut() {
            *o = o.div(sum);
        }
    })
}

/// `x - max - ln Σ exp(x - max)` along `axis`.
pub(crate) fn log_softmax<T: Float>(x: &[T], dims: &[usize], axis: usize) -> Vec<T> {
    map_lanes(x, dims, axis, |lane, out| {
        let (max, log_sum) = max_and_log_sum_exp(lane);
        for (o, &v) in out.iter_mut().zip(lane) {
            *o = v.sub(max).sub(log_sum);
        }
    })
}

/// A row's mean and the reciprocal of its deviation, `1 / sqrt(variance + epsilon)`: two
/// passes, the variance the biased one.
fn mean_and_reciprocal_deviation<T: Float>(row: &[T], epsilon: f64) -> (T, T) {
    let n = T::from_f64(row.len() as f64);
    let mean = row.iter().fold(T::zero(), |s, &v| s.add(v)).div(n);
    let variance = row.iter().fold(T::zero(), |s, &v| s.add(v.sub(mean).mul(v.sub(mean)))).div(n);
    (mean, T::one().div(variance.add(T::from_f64(epsilon)).sqrt()))
}

/// `(x - mean) / sqrt(variance + epsilon)` along the last axis.
pub(crate) fn layer_norm<T: Float>(x: &[T], dims: &[usize], epsilon: f64) -> Vec<T> {
    let row_len = dims.last().copied().unwrap_or(1).max(1);
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(row_len) {
        let (mean, r) = mean_and_reciprocal_deviation(row, epsilon);
        out.extend(row.iter().map(|&v| v.sub(mean).mul(r)));
    }
    out
}

/// The gradient of `layer_norm` along the last axis: `r · (g - mean(g) - x̂ · mean(g · x̂))`.
pub(crate) fn layer_norm_grad<T: Float>(x: &[T], g: &[T], dims: &[usize], epsilon: f64) -> Vec<T> {
    let row_len = dims.last().copied().unwrap_or(1).max(1);
    let n = T::from_f64(row_len as f64);
    let mut out = Vec::with_capacity(x.len());
    for (row, g) in x.chunks(row_len).zip(g.chunks(row_len)) {
        let (mean, r) = mean_and_reciprocal_deviation(row, epsilon);
        let g_mean = g.iter().fold(T::zero(), |s, &v| s.add(v)).div(n);
        let gx_mean = row.iter().zip(g).fold(T::zero(), |s, (&v, &gv)| s.add(gv.mul(v.sub(mean).mul(r)))).div(n);
        out.extend(row.iter().zip(g).map(|(&v, &gv)| r.mul(gv.sub(g_mean).sub(v.sub(mean).mul(r).mul(gx_mean)))));
    }
    out
}

/// Each channel's (last axis's) mean and biased variance over all the other axes, as
/// `[means..., variances...]`; sums in f64, the variance from the deviations (two passes).
pub(crate) fn moments<T: Float>(x: &[T], dims: &[usize]) -> Vec<T> {
    let channels = dims.last().copied().unwrap_or(0);
    if channels == 0 {
        return Vec::new();
    }
    let n = (x.len() / channels).max(1) as f64;
    let mut mean = vec![0.0f64; channels];
    for row in x.chunks(channels) {
        mean.iter_mut().zip(row).for_each(|(m, &v)| *m += v.to_f64());
    }
    mean.iter_mut().for_each(|m| *m /= n);
    let mut variance = vec![0.0f64; channels];
    for row in x.chunks(channels) {
        variance.iter_mut().zip(row).zip(&mean).for_each(|((s, &v), m)| *s += (v.to_f64() - m) * (v.to_f64() - m));
    }
    mean.iter().copied().chain(variance.iter().map(|s| s / n)).map(T::from_f64).collect()
}

/// Each channel's mean and reciprocal deviation `1 / sqrt(variance + epsilon)` from moments.
fn channel_scales<T: Float>(moments: &[T], epsilon: f64) -> (&[T], Vec<T>) {
    let (mean, variance) = moments.split_at(moments.len() / 2);
    (mean, variance.iter().map(|&v| T::one().div(v.add(T::from_f64(epsilon)).sqrt())).collect())
}

/// `(x - mean) · rsqrt(variance + epsilon)` per channel (the last axis), with `moments`.
pub(crate) fn batch_norm<T: Float>(x: &[T], moments: &[T], epsilon: f64) -> Vec<T> {
    let (mean, r) = channel_scales(moments, epsilon);
    let channels = mean.len();
    if channels == 0 {
        return Vec::new();
    }
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(channels) {
        out.extend(row.iter().zip(mean).zip(&r).map(|((&v, &m), &r)| v.sub(m).mul(r)));
    }
    out
}

/// Of `batch_norm`'s gradient, each channel's means of `g` and of `g · x̂` over all the other
/// axes (summed in f64), as `[g means..., g·x̂ means...]`.
pub(crate) fn batch_norm_grad_means<T: Float>(x: &[T], moments: &[T], g: &[T], epsilon: f64) -> Vec<T> {
    let (mean, r) = channel_scales(moments, epsilon);
    let channels = mean.len();
    if channels == 0 {
        return Vec::new();
    }
    let n = (x.len() / channels).max(1) as f64;
    let (mut g_sum, mut gx_sum) = (vec![0.0f64; channels], vec![0.0f64; channels]);
    for (row, g) in x.chunks(channels).zip(g.chunks(channels)) {
        for c in 0..row.len() {
            let normalised = row[c].sub(mean[c]).mul(r[c]);
            g_sum[c] += g[c].to_f64();
            gx_sum[c] += g[c].mul(normalised).to_f64();
        }
    }
    g_sum.iter().chain(&gx_sum).map(|s| T::from_f64(s / n)).collect()
}

/// The gradient of `batch_norm` through the batch's own moments, per channel:
/// `r · (g - mean(g) - x̂ · mean(g · x̂))`, with those means from `means`.
pub(crate) fn batch_norm_grad<T: Float>(x: &[T], moments: &[T], g: &[T], means: &[T], epsilon: f64) -> Vec<T> {
    let (mean, r) = channel_scales(moments, epsilon);
    let channels = mean.len();
    if channels == 0 {
        return Vec::new();
    }
    let (g_mean, gx_mean) = means.split_at(channels);
    let mut out = Vec::with_capacity(x.len());
    for (row, g) in x.chunks(channels).zip(g.chunks(channels)) {
        out.extend((0..row.len()).map(|c| {
            let normalised = row[c].sub(mean[c]).mul(r[c]);
            r[c].mul(g[c].sub(g_mean[c]).sub(normalised.mul(gx_mean[c])))
        }));
    }
    out
}

/// `-Σ labels * log_softmax(logits)` over the last axis; the result drops that axis.
pub(crate) fn softmax_cross_entropy<T: Float>(logits: &[T], labels: &[T], dims: &[usize]) -> (Vec<usize>, Vec<T>) {
    let (&classes, out_dims) = dims.split_last().expect("`infer` requires a class axis");
    let n = n_elements(out_dims);
    let mut out = Vec::with_capacity(n);
    for r in 0..n {
        let x = &logits[r * classes..(r + 1) * classes];
        let z = &labels[r * classes..(r + 1) * classes];
        let (max, log_sum) = max_and_log_sum_exp(x);
        let mut loss = T::zero();
        for (&xi, &zi) in x.iter().zip(z) {
            loss = loss.sub(zi.mul(xi.sub(max).sub(log_sum)));
        }
        out.push(loss);
    }
    (out_dims.to_vec(), out)
}

/// `max(x, 0) - x * z + ln(1 + exp(-|x|))` elementwise: the logistic loss of logits `x`
/// against labels `z`, in the form that neither overflows nor loses precision.
pub(crate) fn sigmoid_cross_entropy<T: Float>(logits: &[T], labels: &[T]) -> Vec<T> {
    logits
        .iter()
        .zip(labels)
        .map(|(&x, &z)| maximum(x, T::zero()).sub(x.mul(z)).add(x.abs().neg().exp().ln_1p()))
        .collect()
}
