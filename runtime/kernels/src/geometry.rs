//! Window geometry, as TensorFlow defines it. Along each spatial axis, with input size `in`,
//! window `k` and stride `s`:
//!
//! - `valid`: `out = (in - k) / s + 1` (0 if `k > in`), no padding;
//! - `same`: `out = ceil(in / s)`, `pad_total = max((out - 1) * s + k - in, 0)`,
//!   `pad_before = pad_total / 2` (the odd one out goes after).
//!
//! Output position `o` sees input positions `o * s - pad_before + j` for `j` in `0..k`; those
//! outside `0..in` are padding (zeros for a convolution, skipped by pooling).

use dfc_ir::Padding;
use std::ops::Range;

/// `(out, pad_before)` of one spatial axis.
fn axis(input: usize, window: usize, stride: usize, padding: Padding) -> (usize, usize) {
    assert!(window > 0 && stride > 0, "windows and strides must be positive");
    match padding {
        Padding::Valid => (if input >= window { (input - window) / stride + 1 } else { 0 }, 0),
        Padding::Same => {
            let out = input.div_ceil(stride);
            let pad_total = if out == 0 { 0 } else { ((out - 1) * stride + window).saturating_sub(input) };
            (out, pad_total / 2)
        }
    }
}

/// The window offsets `j` of output position `o` that fall inside `0..input`.
#[inline]
pub(crate) fn valid_taps(o: usize, stride: usize, pad: usize, window: usize, input: usize) -> Range<usize> {
    let start = o * stride; // input position of tap j is start + j - pad
    let lo = pad.saturating_sub(start);
    let hi = (input + pad).saturating_sub(start).min(window);
    lo..hi.max(lo)
}

/// A 2-d convolution: input `[n, h, w, c]` (NHWC), filter `[kh, kw, c, filters]` (HWIO),
/// output `[n, out_h, out_w, filters]`. Output position `(oy, ox)` sees input rows
/// `oy * stride_h - pad_top + 0..kh` and columns `ox * stride_w - pad_left + 0..kw`.
///
/// Build it with [`Conv2dGeometry::new`] for TensorFlow's `valid`/`same` rules, or fill the
/// fields for any other padding (every field is free, as long as `kh, kw, stride_h, stride_w`
/// are positive).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Conv2dGeometry {
    pub n: usize,
    pub h: usize,
    pub w: usize,
    pub c: usize,
    pub kh: usize,
    pub kw: usize,
    pub filters: usize,
    pub stride_h: usize,
    pub stride_w: usize,
    pub pad_top: usize,
    pub pad_left: usize,
    pub out_h: usize,
    pub out_w: usize,
}

impl Conv2dGeometry {
    /// The geometry of `Op::Conv2d { strides, padding }` on an input of dims `input` (NHWC)
    /// and a filter of dims `filter` (HWIO).
    pub fn new(input: [usize; 4], filter: [usize; 4], strides: [usize; 2], padding: Padding) -> Conv2dGeometry {
        let [n, h, w, c] = input;
        let [kh, kw, fc, filters] = filter;
        assert_eq!(fc, c, "the filter's input channels must match the input's channels");
        let (out_h, pad_top) = axis(h, kh, strides[0], padding);
        let (out_w, pad_left) = axis(w, kw, strides[1], padding);
        Conv2dGeometry {
            n,
            h,
            w,
            c,
            kh,
            kw,
            filters,
            stride_h: strides[0],
            stride_w: strides[1],
            pad_top,
            pad_left,
            out_h,
            out_w,
        }
    }

    /// [`Conv2dGeometry::new`] with the dims as slices (of length 4), as tensors carry them.
    pub fn from_dims(input: &[usize], filter: &[usize], strides: [usize; 2], padding: Padding) -> Conv2dGeometry {
        let input: [usize; 4] = input.try_into().expect("conv2d input must be NHWC (rank 4)");
        let filter: [usize; 4] = filter.try_into().expect("conv2d filter must be HWIO (rank 4)");
        Conv2dGeometry::new(input, filter, strides, padding)
    }

    pub fn input_dims(&self) -> [usize; 4] {
        [self.n, self.h, self.w, self.c]
    }

    pub fn filter_dims(&self) -> [usize; 4] {
        [self.kh, self.kw, self.c, self.filters]
    }

    pub fn output_dims(&self) -> [usize; 4] {
        [self.n, self.out_h, self.out_w, self.filters]
    }

    pub fn input_len(&self) -> usize {
        self.n * self.h * self.w * self.c
    }

    pub fn filter_len(&self) -> usize {
        self.patch_len() * self.filters
    }

    pub fn output_len(&self) -> usize {
        self.rows() * self.filters
    }

    /// The length of one window, flattened `(ky, kx, c)`: a row of `im2col`.
    pub fn patch_len(&self) -> usize {
        self.kh * self.kw * self.c
    }

    /// The number of output positions, `n * out_h * out_w`: the rows of `im2col`.
    pub fn rows(&self) -> usize {
        self.n * self.out_h * self.out_w
    }

    pub(crate) fn check(&self) {
        assert!(self.kh > 0 && self.kw > 0 && self.stride_h > 0 && self.stride_w > 0, "bad conv2d geometry {self:?}");
    }

    /// Output row `row` (numbered `(b * out_h + oy) * out_w + ox`) as `(b, oy, ox)`.
    pub(crate) fn split_row(&self, row: usize) -> (usize, usize, usize) {
        let ox = row % self.out_w;
        let rest = row / self.out_w;
        (rest / self.out_h, rest % self.out_h, ox)
    }

    /// Whether the window of output position `(oy, ox)` lies wholly inside the input.
    #[inline(always)]
    pub(crate) fn interior(&self, oy: usize, ox: usize) -> bool {
        valid_taps(oy, self.stride_h, self.pad_top, self.kh, self.h).len() == self.kh
            && valid_taps(ox, self.stride_w, self.pad_left, self.kw, self.w).len() == self.kw
    }
}

/// A 2-d pooling window over NHWC input `[n, h, w, c]`, output `[n, out_h, out_w, c]`; output
/// position `(oy, ox)` sees input rows `oy * stride_h - pad_top + 0..kh` and columns
/// `ox * stride_w - pad_left + 0..kw`, padding excluded. Every window must hold at least one
/// input element (TensorFlow's rules, [`PoolGeometry::new`], guarantee it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PoolGeometry {
    pub n: usize,
    pub h: usize,
    pub w: usize,
    pub c: usize,
    pub kh: usize,
    pub kw: usize,
    pub stride_h: usize,
    pub stride_w: usize,
    pub pad_top: usize,
    pub pad_left: usize,
    pub out_h: usize,
    pub out_w: usize,
}

impl PoolGeometry {
    /// The geometry of `Op::MaxPool { window, strides, padding }` (and the other pooling ops)
    /// on an input of dims `input` (NHWC).
    pub fn new(input: [usize; 4], window: [usize; 2], strides: [usize; 2], padding: Padding) -> PoolGeometry {
        let [n, h, w, c] = input;
        let (out_h, pad_top) = axis(h, window[0], strides[0], padding);
        let (out_w, pad_left) = axis(w, window[1], strides[1], padding);
        PoolGeometry {
            n,
            h,
            w,
            c,
            kh: window[0],
            kw: window[1],
            stride_h: strides[0],
            stride_w: strides[1],
            pad_top,
            pad_left,
            out_h,
            out_w,
        }
    }

    /// [`PoolGeometry::new`] with the input dims as a slice (of length 4).
    pub fn from_dims(input: &[usize], window: [usize; 2], strides: [usize; 2], padding: Padding) -> PoolGeometry {
        let input: [usize; 4] = input.try_into().expect("pooling input must be NHWC (rank 4)");
        PoolGeometry::new(input, window, strides, padding)
    }

    pub fn input_dims(&self) -> [usize; 4] {
        [self.n, self.h, self.w, self.c]
    }

    pub fn output_dims(&self) -> [usize; 4] {
        [self.n, self.out_h, self.out_w, self.c]
    }

    pub fn input_len(&self) -> usize {
        self.n * self.h * self.w * self.c
    }

    pub fn output_len(&self) -> usize {
        self.n * self.out_h * self.out_w * self.c
    }

    /// Panics unless every window holds at least one input element.
    pub(crate) fn check(&self) {
        assert!(self.kh > 0 && self.kw > 0 && self.stride_h > 0 && self.stride_w > 0, "bad pool geometry {self:?}");
        let nonempty = |out: usize, s: usize, pad: usize, k: usize, input: usize| {
            out == 0 || (input > 0 && pad < k && (out - 1) * s < input + pad)
        };
        assert!(
            nonempty(self.out_h, self.stride_h, self.pad_top, self.kh, self.h)
                && nonempty(self.out_w, self.stride_w, self.pad_left, self.kw, self.w),
            "a pooling window holds no input element: {self:?}"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn valid_taps_match_the_definition() {
        for input in 1..9 {
            for window in 1..5 {
                for stride in 1..4 {
                    for pad in 0..4 {
                        for o in 0..8 {
                            let want: Vec<usize> = (0..window)
                                .filter(|&j: &usize| (o * stride + j).checked_sub(pad).is_some_and(|i| i < input))
                                .collect();
                            let got: Vec<usize> = valid_taps(o, stride, pad, window, input).collect();
                            assert_eq!(got, want, "in {input} k {window} s {stride} pad {pad} o {o}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn same_padding_puts_the_odd_one_after() {
        assert_eq!(axis(6, 4, 2, Padding::Same), (3, 1));
        assert_eq!(axis(5, 2, 1, Padding::Same), (5, 0));
        assert_eq!(axis(28, 3, 1, Padding::Valid), (26, 0));
        assert_eq!(axis(2, 3, 1, Padding::Valid), (0, 0));
    }
}
