//! Matrix products, convolution (against a naive direct convolution) and pooling.

mod common;

use common::{assert_close, conv, ev, random_f32, random_f64, rng, t};
use dfc_interp::Tensor;
use dfc_ir::{Op, Padding};

fn matmul(a: &Tensor, b: &Tensor, transpose_a: bool, transpose_b: bool) -> Tensor {
    ev(Op::MatMul { transpose_a, transpose_b }, &[a, b])
}

#[test]
fn matmul_by_hand() {
    let a = t(&[2, 3], vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let b = t(&[3, 2], vec![7.0f32, 8.0, 9.0, 10.0, 11.0, 12.0]);
    let c = matmul(&a, &b, false, false);
    assert_eq!(c.shape.dims(), [2, 2]);
    assert_eq!(c.to_vec::<f32>(), [58.0, 64.0, 139.0, 154.0]);
    // The same product from transposed storage.
    let at = ev(Op::Transpose { perm: vec![1, 0] }, &[&a]);
    let bt = ev(Op::Transpose { perm: vec![1, 0] }, &[&b]);
    assert_eq!(matmul(&at, &b, true, false), c);
    assert_eq!(matmul(&a, &bt, false, true), c);
    assert_eq!(matmul(&at, &bt, true, true), c);
    // bᵀ aᵀ = (a b)ᵀ
    assert_eq!(matmul(&b, &a, true, true).to_vec::<f32>(), [58.0, 139.0, 64.0, 154.0]);
}

#[test]
fn matmul_on_integers_wraps() {
    let a = t(&[1, 2], vec![i32::MAX, 2]);
    let b = t(&[2, 1], vec![2i32, 3]);
    assert_eq!(matmul(&a, &b, false, false).to_vec::<i32>(), [i32::MAX.wrapping_mul(2).wrapping_add(6)]);
    let u = t(&[2, 2], vec![1u8, 2, 3, 4]);
    assert_eq!(matmul(&u, &u, false, false).to_vec::<u8>(), [7, 10, 15, 22]);
    let l = t(&[1, 3], vec![1i64, -2, 3]);
    assert_eq!(matmul(&l, &l, false, true).to_vec::<i64>(), [14]);
}

/// `a @ b` for batched operands by the definition, with NumPy broadcasting of batch axes.
fn naive_batched(a: &[f64], a_dims: &[usize], b: &[f64], b_dims: &[usize]) -> (Vec<usize>, Vec<f64>) {
    let (m, k) = (a_dims[a_dims.len() - 2], a_dims[a_dims.len() - 1]);
    let n = b_dims[b_dims.len() - 1];
    let (ab, bb) = (&a_dims[..a_dims.len() - 2], &b_dims[..b_dims.len() - 2]);
    let rank = ab.len().max(bb.len());
    let pad = |d: &[usize]| -> Vec<usize> { std::iter::repeat_n(1, rank - d.len()).chain(d.iter().copied()).collect() };
    let (ab, bb) = (pad(ab), pad(bb));
    let batch: Vec<usize> = ab.iter().zip(&bb).map(|(&x, &y)| x.max(y)).collect();
    let count: usize = batch.iter().product();
    let mut out = Vec::new();
    for flat in 0..count {
        // The batch index, and the matching index into each operand (size-1 axes repeat).
        let mut rest = flat;
        let mut index = vec![0; rank];
        for axis in (0..rank).rev() {
            index[axis] = rest % batch[axis];
            rest /= batch[axis];
        }
        let offset = |dims: &[usize]| index.iter().zip(dims).fold(0, |o, (&i, &d)| o * d + if d == 1 { 0 } else { i });
        let (ao, bo) = (offset(&ab) * m * k, offset(&bb) * k * n);
        for i in 0..m {
            for j in 0..n {
                out.push((0..k).map(|p| a[ao + i * k + p] * b[bo + p * n + j]).sum());
            }
        }
    }
    let mut dims = batch;
    dims.extend([m, n]);
    (dims, out)
}

#[test]
fn batched_matmul_broadcasts_batch_axes() {
    let mut r = rng(1);
    for (a_dims, b_dims) in [
        (vec![2, 2, 3], vec![3, 4]),
        (vec![3, 4], vec![2, 4, 5]),
        (vec![2, 1, 2, 3], vec![3, 3, 2]),
        (vec![1, 3, 2], vec![4, 1, 2, 2]),
    ] {
        let a = random_f64(&mut r, &a_dims);
        let b = random_f64(&mut r, &b_dims);
        let c = matmul(&a, &b, false, false);
        let (dims, expected) = naive_batched(&a.to_vec(), &a_dims, &b.to_vec(), &b_dims);
        assert_eq!(c.shape.dims(), dims);
        assert_close(&c.to_vec::<f64>(), &expected, 1e-14);
    }
}

#[test]
fn larger_matmul_matches_the_definition() {
    let mut r = rng(2);
    let (m, k, n) = (37, 53, 29);
    let a = random_f32(&mut r, &[m, k]);
    let b = random_f32(&mut r, &[k, n]);
    let c = matmul(&a, &b, false, false).to_vec::<f32>();
    let (av, bv) = (a.to_vec::<f32>(), b.to_vec::<f32>());
    let expected: Vec<f64> = (0..m)
        .flat_map(|i| (0..n).map(move |j| (i, j)))
        .map(|(i, j)| (0..k).map(|p| f64::from(av[i * k + p]) * f64::from(bv[p * n + j])).sum())
        .collect();
    assert_close(&c.iter().map(|&v| f64::from(v)).collect::<Vec<_>>(), &expected, 1e-5);
}

/// TensorFlow's padding before the first element along one axis, and the output size.
fn geometry(input: usize, window: usize, stride: usize, padding: Padding) -> (usize, i64) {
    match padding {
        Padding::Valid => ((input - window) / stride + 1, 0),
        Padding::Same => {
            let out = input.div_ceil(stride);
            let pad_total = ((out - 1) * stride + window).saturating_sub(input);
            (out, (pad_total / 2) as i64)
        }
    }
}

/// The direct convolution: seven nested loops over the definition.
fn naive_conv(x: &[f64], xd: [usize; 4], f: &[f64], fd: [usize; 4], strides: [usize; 2], padding: Padding) -> Vec<f64> {
    let [n, h, w, c] = xd;
    let [kh, kw, _, o] = fd;
    let (oh, ph) = geometry(h, kh, strides[0], padding);
    let (ow, pw) = geometry(w, kw, strides[1], padding);
    let mut out = vec![0.0; n * oh * ow * o];
    for b in 0..n {
        for y in 0..oh {
            for x_ in 0..ow {
                for oc in 0..o {
                    let mut sum = 0.0;
                    for ky in 0..kh {
                        for kx in 0..kw {
                            for ic in 0..c {
                                let iy = (y * strides[0] + ky) as i64 - ph;
                                let ix = (x_ * strides[1] + kx) as i64 - pw;
                                if iy < 0 || ix < 0 || iy >= h as i64 || ix >= w as i64 {
                                    continue;
                                }
                                let (iy, ix) = (iy as usize, ix as usize);
                                sum += x[((b * h + iy) * w + ix) * c + ic] * f[((ky * kw + kx) * c + ic) * o + oc];
                            }
                        }
                    }
                    out[((b * oh + y) * ow + x_) * o + oc] = sum;
                }
            }
        }
    }
    out
}

const CONV_CASES: &[([usize; 4], [usize; 4])] = &[
    ([2, 7, 6, 3], [3, 3, 3, 4]),
    ([1, 8, 8, 2], [2, 2, 2, 3]),
    ([2, 5, 9, 1], [1, 3, 1, 2]),
    ([1, 6, 5, 2], [5, 4, 2, 1]),
    ([1, 3, 3, 1], [3, 3, 1, 1]),
];

#[test]
fn conv2d_matches_the_direct_convolution() {
    let mut r = rng(3);
    for &(xd, fd) in CONV_CASES {
        for strides in [[1, 1], [2, 2], [2, 1]] {
            for padding in [Padding::Valid, Padding::Same] {
                let x = random_f64(&mut r, &xd);
                let f = random_f64(&mut r, &fd);
                let y = ev(conv(strides, padding), &[&x, &f]);
                let expected = naive_conv(&x.to_vec(), xd, &f.to_vec(), fd, strides, padding);
                let (oh, _) = geometry(xd[1], fd[0], strides[0], padding);
                let (ow, _) = geometry(xd[2], fd[1], strides[1], padding);
                assert_eq!(y.shape.dims(), [xd[0], oh, ow, fd[3]], "{xd:?} {fd:?} {strides:?} {padding:?}");
                assert_close(&y.to_vec::<f64>(), &expected, 1e-13);

                // f32 as well.
                let (x32, f32_) =
                    (ev(Op::Cast { to: dfc_ir::DType::F32 }, &[&x]), ev(Op::Cast { to: dfc_ir::DType::F32 }, &[&f]));
                let y32 = ev(conv(strides, padding), &[&x32, &f32_]).to_vec::<f32>();
                let (x64, f64_) = (x32.to_f64_vec(), f32_.to_f64_vec());
                let expected32 = naive_conv(&x64, xd, &f64_, fd, strides, padding);
                assert_close(&y32.iter().map(|&v| f64::from(v)).collect::<Vec<_>>(), &expected32, 1e-5);
            }
        }
    }
}

#[test]
fn conv2d_by_hand() {
    // A 3x3 image 1..9 and a 2x2 filter of ones: sums of 2x2 blocks.
    let x = t(&[1, 3, 3, 1], (1..=9).map(|v| v as f32).collect());
    let f = t(&[2, 2, 1, 1], vec![1.0f32; 4]);
    assert_eq!(ev(conv([1, 1], Padding::Valid), &[&x, &f]).to_vec::<f32>(), [12.0, 16.0, 24.0, 28.0]);
    // Same padding with an even filter pads after only: the last row and column see zeros.
    let same = ev(conv([1, 1], Padding::Same), &[&x, &f]);
    assert_eq!(same.shape.dims(), [1, 3, 3, 1]);
    assert_eq!(same.to_vec::<f32>(), [12.0, 16.0, 9.0, 24.0, 28.0, 15.0, 15.0, 17.0, 9.0]);
}

#[test]
fn pooling_by_hand() {
    // 1 2 3
    // 4 5 6
    // 7 8 9
    let x = t(&[1, 3, 3, 1], (1..=9).map(|v| v as f64).collect());
    let max = |window, strides, padding| ev(Op::MaxPool { window, strides, padding }, &[&x]).to_vec::<f64>();
    let avg = |window, strides, padding| ev(Op::AvgPool { window, strides, padding }, &[&x]).to_vec::<f64>();
    assert_eq!(max([2, 2], [1, 1], Padding::Valid), [5.0, 6.0, 8.0, 9.0]);
    assert_eq!(avg([2, 2], [1, 1], Padding::Valid), [3.0, 4.0, 6.0, 7.0]);
    // Same, stride 2: pad_total = 1, all after. Windows {1,2,4,5} {3,6} {7,8} {9}.
    assert_eq!(max([2, 2], [2, 2], Padding::Same), [5.0, 6.0, 8.0, 9.0]);
    assert_eq!(avg([2, 2], [2, 2], Padding::Same), [3.0, 4.5, 7.5, 9.0]);
    // Same, 3x3 stride 1: one row/column of padding on each side; the average counts only the
    // valid elements.
    assert_eq!(avg([3, 3], [1, 1], Padding::Same), [3.0, 3.5, 4.0, 4.5, 5.0, 5.5, 6.0, 6.5, 7.0]);
    assert_eq!(max([3, 3], [1, 1], Padding::Same), [5.0, 6.0, 6.0, 8.0, 9.0, 9.0, 8.0, 9.0, 9.0]);

    // Channels pool independently; max_pool takes integers; negative values are not beaten by
    // padding.
    let x = t(&[1, 2, 2, 2], vec![-1i32, 10, -2, 20, -3, 30, -4, 40]);
    let y = ev(Op::MaxPool { window: [3, 3], strides: [1, 1], padding: Padding::Same }, &[&x]);
    assert_eq!(y.shape.dims(), [1, 2, 2, 2]);
    assert_eq!(y.to_vec::<i32>(), [-1, 40, -1, 40, -1, 40, -1, 40]);
    let u = t(&[1, 1, 3, 1], vec![3u8, 200, 7]);
    assert_eq!(
        ev(Op::MaxPool { window: [1, 2], strides: [1, 2], padding: Padding::Same }, &[&u]).to_vec::<u8>(),
        [200, 7]
    );
}
