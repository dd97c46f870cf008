//! Convolution and pooling over NHWC tensors (filters HWIO), and their gradients.
//!
//! Window geometry follows TensorFlow. Along each spatial axis, with input size `in`, window
//! `k` and stride `s`:
//!
//! - `valid`: `out = (in - k) / s + 1`, no padding;
//! - `same`: `out = ceil(in / s)`, `pad_total = max((out - 1) * s + k - in, 0)`,
//!   `pad_before = pad_total / 2` (the odd one out goes after).
//!
//! Output position `o` sees input positions `o * s - pad_before + j` for `j` in `0..k`; those
//! outside `0..in` are padding. A convolution reads padding as zeros; pooling ignores it (max
//! over, and average over, the valid elements only). With these rules every window holds at
//! least one valid element.
//!
//! The convolution is `im2col` (each output position's window, flattened `(kh, kw, c)`, as one
//! row) times the filter reshaped to `[kh * kw * c, out_channels]`. Its gradient with respect
//! to the input is the output gradient times the filter transposed, scattered back with
//! `col2im`; with respect to the filter it is `im2col(input)` transposed times the output
//! gradient.

use super::matmul::gemm;
use crate::scalar::{beats_max, Float, Num, Scalar};
use dfc_ir::Padding;

/// The geometry of one spatial axis of a window op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Axis {
    pub input: usize,
    pub window: usize,
    pub stride: usize,
    pub output: usize,
    pub pad_before: usize,
}

impl Axis {
    pub(crate) fn new(input: usize, window: usize, stride: usize, padding: Padding) -> Axis {
        assert!(window > 0 && stride > 0, "`infer` requires positive windows and strides");
        let (output, pad_before) = match padding {
            Padding::Valid => (if input >= window { (input - window) / stride + 1 } else { 0 }, 0),
            Padding::Same => {
                let output = input.div_ceil(stride);
                let pad_total = if output == 0 { 0 } else { ((output - 1) * stride + window).saturating_sub(input) };
                (output, pad_total / 2)
            }
        };
        Axis { input, window, stride, output, pad_before }
    }

    /// The input position under element `j` of the window of output position `o`, or `None`
    /// where that is padding.
    pub(crate) fn input_at(&self, o: usize, j: usize) -> Option<usize> {
        (o * self.stride + j).checked_sub(self.pad_before).filter(|&i| i < self.input)
    }
}

/// NHWC sizes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Nhwc {
    pub n: usize,
    pub h: usize,
    pub w: usize,
    pub c: usize,
}

impl Nhwc {
    pub(crate) fn from_dims(dims: &[usize]) -> Nhwc {
        assert_eq!(dims.len(), 4, "`infer` requires NHWC tensors");
        Nhwc { n: dims[0], h: dims[1], w: dims[2], c: dims[3] }
    }

    /// The offset of pixel `(b, y, x)` (its first channel).
    fn pixel(&self, b: usize, y: usize, x: usize) -> usize {
        ((b * self.h + y) * self.w + x) * self.c
    }
}

/// Calls `f(out_pixel, window)` for every output position, with the offset of its first
/// channel in the output and the offsets (first channel) of the valid input pixels of its
/// window, in row-major window order.
fn for_each_window(x: Nhwc, ah: Axis, aw: Axis, mut f: impl FnMut(usize, &[usize])) {
    let out = Nhwc { n: x.n, h: ah.output, w: aw.output, c: x.c };
    let mut window = Vec::with_capacity(ah.window * aw.window);
    for b in 0..x.n {
        for oy in 0..ah.output {
            for ox in 0..aw.output {
                window.clear();
                for ky in 0..ah.window {
                    let Some(iy) = ah.input_at(oy, ky) else { continue };
                    for kx in 0..aw.window {
                        let Some(ix) = aw.input_at(ox, kx) else { continue };
                        window.push(x.pixel(b, iy, ix));
                    }
                }
                f(out.pixel(b, oy, ox), &window);
            }
        }
    }
}

/// For each output position `(b, oy, ox)` in row-major order, one row of `kh * kw * c` values:
/// its window, `(ky, kx, c)` row-major, zeros in the padding.
fn im2col<T: Scalar>(x: &[T], xs: Nhwc, ah: Axis, aw: Axis) -> Vec<T> {
    let c = xs.c;
    let row_len = ah.window * aw.window * c;
    let mut cols = vec![T::zero(); xs.n * ah.output * aw.output * row_len];
    let mut row = 0;
    for b in 0..xs.n {
        for oy in 0..ah.output {
            for ox in 0..aw.output {
                for ky in 0..ah.window {
                    let Some(iy) = ah.input_at(oy, ky) else { continue };
                    for kx in 0..aw.window {
                        let Some(ix) = aw.input_at(ox, kx) else { continue };
                        let src = xs.pixel(b, iy, ix);
                        let dst = row * row_len + (ky * aw.window + kx) * c;
                        cols[dst..dst + c].copy_from_slice(&x[src..src + c]);
                    }
                }
                row += 1;
            }
        }
    }
    cols
}

/// The adjoint of `im2col`: every value of `cols` added to the input element it was read from
/// (padding positions dropped).
fn col2im<T: Scalar>(cols: &[T], xs: Nhwc, ah: Axis, aw: Axis) -> Vec<T> {
    let c = xs.c;
    let row_len = ah.window * aw.window * c;
    let mut x = vec![T::zero(); xs.n * xs.h * xs.w * c];
    let mut row = 0;
    for b in 0..xs.n {
        for oy in 0..ah.output {
            for ox in 0..aw.output {
                for ky in 0..ah.window {
                    let Some(iy) = ah.input_at(oy, ky) else { continue };
                    for kx in 0..aw.window {
                        let Some(ix) = aw.input_at(ox, kx) else { continue };
                        let dst = xs.pixel(b, iy, ix);
                        let src = row * row_len + (ky * aw.window + kx) * c;
                        for (d, &s) in x[dst..dst + c].iter_mut().zip(&cols[src..src + c]) {
                            *d = d.accumulate(s);
                        }
                    }
                }
                row += 1;
            }
        }
    }
    x
}

/// The geometry of a convolution of input `x_dims` with filter `f_dims`.
fn conv_axes(x_dims: &[usize], f_dims: &[usize], strides: [usize; 2], padding: Padding) -> (Nhwc, Axis, Axis) {
    let xs = Nhwc::from_dims(x_dims);
    let ah = Axis::new(xs.h, f_dims[0], strides[0], padding);
    let aw = Axis::new(xs.w, f_dims[1], strides[1], padding);
    (xs, ah, aw)
}

/// `out[b, oy, ox, o] = Σ_{ky, kx, c} x[b, oy*s - pad + ky, ox*s - pad + kx, c] * f[ky, kx, c, o]`.
pub(crate) fn conv2d<T: Float>(
    x: &[T],
    x_dims: &[usize],
    f: &[T],
    f_dims: &[usize],
    strides: [usize; 2],
    padding: Padding,
) -> (Vec<usize>, Vec<T>) {
    let (xs, ah, aw) = conv_axes(x_dims, f_dims, strides, padding);
    let patch = f_dims[0] * f_dims[1] * f_dims[2];
    let out_channels = f_dims[3];
    let rows = xs.n * ah.output * aw.output;
    let out = gemm(&im2col(x, xs, ah, aw), f, rows, patch, out_channels, false, false);
    (vec![xs.n, ah.output, aw.output, out_channels], out)
}

/// The gradient of `conv2d` with respect to its input (of shape `x_dims`), given the filter and
/// the gradient of the output.
pub(crate) fn conv2d_backprop_input<T: Float>(
    x_dims: &[usize],
    f: &[T],
    f_dims: &[usize],
    grad_out: &[T],
    strides: [usize; 2],
    padding: Padding,
) -> Vec<T> {
    let (xs, ah, aw) = conv_axes(x_dims, f_dims, strides, padding);
    let patch = f_dims[0] * f_dims[1] * f_dims[2];
    let out_channels = f_dims[3];
    let rows = xs.n * ah.output * aw.output;
    // d(cols) = grad_out[rows, O] @ f[patch, O]ᵀ
    let grad_cols = gemm(grad_out, f, rows, out_channels, patch, false, true);
    col2im(&grad_cols, xs, ah, aw)
}

/// The gradient of `conv2d` with respect to its filter (of shape `f_dims`), given the input and
/// the gradient of the output.
pub(crate) fn conv2d_backprop_filter<T: Float>(
    x: &[T],
    x_dims: &[usize],
    f_dims: &[usize],
    grad_out: &[T],
    strides: [usize; 2],
    padding: Padding,
) -> Vec<T> {
    let (xs, ah, aw) = conv_axes(x_dims, f_dims, strides, padding);
    let patch = f_dims[0] * f_dims[1] * f_dims[2];
    let out_channels = f_dims[3];
    let rows = xs.n * ah.output * aw.output;
    // d(f) = im2col(x)[rows, patch]ᵀ @ grad_out[rows, O]
    gemm(&im2col(x, xs, ah, aw), grad_out, patch, rows, out_channels, true, false)
}

fn pool_axes(x_dims: &[usize], window: [usize; 2], strides: [usize; 2], padding: Padding) -> (Nhwc, Axis, Axis) {
    let xs = Nhwc::from_dims(x_dims);
    let ah = Axis::new(xs.h, window[0], strides[0], padding);
    let aw = Axis::new(xs.w, window[1], strides[1], padding);
    (xs, ah, aw)
}

/// For each window and channel, the offset in `x` of its largest element: the first in window
/// order on ties (NaN counting as largest). Returns `(out_offset + channel, argmax)` pairs.
fn window_argmax<T: Num>(x: &[T], xs: Nhwc, ah: Axis, aw: Axis, mut f: impl FnMut(usize, usize)) {
    for_each_window(xs, ah, aw, |out_pixel, window| {
        let (&first, rest) = window.split_first().expect("every window has a valid element");
        for ch in 0..xs.c {
            let mut best = first + ch;
            for &pixel in rest {
                if beats_max(x[pixel + ch], x[best]) {
                    best = pixel + ch;
                }
            }
            f(out_pixel + ch, best);
        }
    });
}

/// The largest valid element of each window, per channel.
pub(crate) fn max_pool<T: Num>(
    x: &[T],
    x_dims: &[usize],
    window: [usize; 2],
    strides: [usize; 2],
    padding: Padding,
) -> (Vec<usize>, Vec<T>) {
    let (xs, ah, aw) = pool_axes(x_dims, window, strides, padding);
    let mut out = vec![T::zero(); xs.n * ah.output * aw.output * xs.c];
    window_argmax(x, xs, ah, aw, |o, best| out[o] = x[best]);
    (vec![xs.n, ah.output, aw.output, xs.c], out)
}

/// The gradient of `max_pool`: each output's gradient added to its window's largest element
/// (the first on ties); overlapping windows accumulate.
pub(crate) fn max_pool_grad<T: Num>(
    x: &[T],
    x_dims: &[usize],
    grad_out: &[T],
    window: [usize; 2],
    strides: [usize; 2],
    padding: Padding,
) -> Vec<T> {
    let (xs, ah, aw) = pool_axes(x_dims, window, strides, padding);
    let mut grad = vec![T::zero(); x.len()];
    window_argmax(x, xs, ah, aw, |o, best| grad[best] = grad[best].add(grad_out[o]));
    grad
}

/// The mean of the valid elements of each window (padding is not counted), per channel.
pub(crate) fn avg_pool<T: Float>(
    x: &[T],
    x_dims: &[usize],
    window: [usize; 2],
    strides: [usize; 2],
    padding: Padding,
) -> (Vec<usize>, Vec<T>) {
    let (xs, ah, aw) = pool_axes(x_dims, window, strides, padding);
    let mut out = vec![T::zero(); xs.n * ah.output * aw.output * xs.c];
    for_each_window(xs, ah, aw, |out_pixel, window| {
        let count = T::from_f64(window.len() as f64);
        for ch in 0..xs.c {
            let sum = window.iter().fold(T::zero(), |s, &pixel| s.add(x[pixel + ch]));
            out[out_pixel + ch] = sum.div(count);
        }
    });
    (vec![xs.n, ah.output, aw.output, xs.c], out)
}

/// The gradient of `avg_pool` for an input of shape `x_dims`: each output's gradient divided
/// by its window's count of valid elements and added to each of them.
pub(crate) fn avg_pool_grad<T: Float>(
    x_dims: &[usize],
    grad_out: &[T],
    window: [usize; 2],
    strides: [usize; 2],
    padding: Padding,
) -> Vec<T> {
    let (xs, ah, aw) = pool_axes(x_dims, window, strides, padding);
    let mut grad = vec![T::zero(); xs.n * xs.h * xs.w * xs.c];
    for_each_window(xs, ah, aw, |out_pixel, window| {
        let count = T::from_f64(window.len() as f64);
        for ch in 0..xs.c {
            let share = grad_out[out_pixel + ch].div(count);
            for &pixel in window {
                grad[pixel + ch] = grad[pixel + ch].add(share);
            }
        }
    });
    grad
}

#[cfg(test)]
mod tests {
    use super::*;
    use dfc_ir::{infer, DType, Op, TensorType};

    /// The geometry here and the output sizes `infer` gives are the same rule.
    #[test]
    fn geometry_agrees_with_infer() {
        for input in 1..12 {
            for window in 1..6 {
                for stride in 1..5 {
                    for padding in [Padding::Valid, Padding::Same] {
                        let op = Op::MaxPool { window: [window, 1], strides: [stride, 1], padding };
                        let x = TensorType::new(DType::F32, vec![1, input, 1, 1]);
                        let axis = Axis::new(input, window, stride, padding);
                        match infer(&op, &[&x]) {
                            Ok(types) => assert_eq!(types[0].shape.dims()[1], axis.output),
                            Err(_) => assert!(padding == Padding::Valid && window > input),
                        }
                        // Every window holds at least one valid element.
                        for o in 0..axis.output {
                            assert!((0..window).any(|j| axis.input_at(o, j).is_some()));
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn same_padding_puts_the_odd_one_after() {
        // in 6, window 4, stride 2: out 3, pad_total (3 - 1) * 2 + 4 - 6 = 2, split 1 + 1.
        let a = Axis::new(6, 4, 2, Padding::Same);
        assert_eq!((a.output, a.pad_before), (3, 1));
        // in 5, window 2, stride 1: out 5, pad_total 1, all after.
        let a = Axis::new(5, 2, 1, Padding::Same);
        assert_eq!((a.output, a.pad_before), (5, 0));
        assert_eq!(a.input_at(4, 1), None);
        assert_eq!(a.input_at(0, 0), Some(0));
    }
}
