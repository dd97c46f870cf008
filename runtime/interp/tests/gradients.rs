//! The gradient ops against central finite differences of their forward ops, in f64.
//!
//! For a forward op `y = f(x)` and a random output gradient `g`, the gradient of the scalar
//! `L(x) = Σ g · f(x)` is what the gradient op must compute from `g`.

mod common;

use common::{assert_close, conv, ev, random_f64, rng, t};
use dfc_interp::Tensor;
use dfc_ir::{Op, Padding, Shape};

/// `Σ a · b` over all elements.
fn dot(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.shape, b.shape, "a dot product of tensors of one shape");
    a.to_vec::<f64>().iter().zip(b.to_vec::<f64>()).map(|(x, y)| x * y).sum()
}

/// The central-difference gradient of `loss` at `x`.
fn finite_differences(x: &Tensor, eps: f64, loss: impl Fn(&Tensor) -> f64) -> Vec<f64> {
    let values = x.to_vec::<f64>();
    (0..values.len())
        .map(|i| {
            let at = |delta: f64| {
                let mut v = values.clone();
                v[i] += delta;
                loss(&Tensor::from_vec(x.shape.clone(), v))
            };
            (at(eps) - at(-eps)) / (2.0 * eps)
        })
        .collect()
}

const CONV_CASES: &[([usize; 4], [usize; 4])] = &[
    ([2, 5, 6, 2], [3, 3, 2, 3]),
    ([1, 6, 6, 1], [2, 2, 1, 2]),
    ([1, 4, 7, 3], [1, 3, 3, 2]),
    ([1, 5, 4, 1], [4, 4, 1, 1]),
];

#[test]
fn conv2d_backprop_input_is_the_gradient_of_conv2d() {
    let mut r = rng(10);
    for &(xd, fd) in CONV_CASES {
        for strides in [[1, 1], [2, 2], [1, 2]] {
            for padding in [Padding::Valid, Padding::Same] {
                let x = random_f64(&mut r, &xd);
                let f = random_f64(&mut r, &fd);
                let y = ev(conv(strides, padding), &[&x, &f]);
                let g = random_f64(&mut r, y.shape.dims());
                let op = Op::Conv2dBackpropInput { input_shape: Shape(xd.to_vec()), strides, padding };
                let analytic = ev(op, &[&f, &g]);
                assert_eq!(analytic.shape, x.shape);
                let numeric = finite_differences(&x, 1e-3, |x| dot(&g, &ev(conv(strides, padding), &[x, &f])));
                assert_close(&analytic.to_vec::<f64>(), &numeric, 1e-9);
            }
        }
    }
}

#[test]
fn conv2d_backprop_filter_is_the_gradient_of_conv2d() {
    let mut r = rng(11);
    for &(xd, fd) in CONV_CASES {
        for strides in [[1, 1], [2, 2], [2, 1]] {
            for padding in [Padding::Valid, Padding::Same] {
                let x = random_f64(&mut r, &xd);
                let f = random_f64(&mut r, &fd);
                let y = ev(conv(strides, padding), &[&x, &f]);
                let g = random_f64(&mut r, y.shape.dims());
                let op = Op::Conv2dBackpropFilter { filter_shape: Shape(fd.to_vec()), strides, padding };
                let analytic = ev(op, &[&x, &g]);
                assert_eq!(analytic.shape, f.shape);
                let numeric = finite_differences(&f, 1e-3, |f| dot(&g, &ev(conv(strides, padding), &[&x, f])));
                assert_close(&analytic.to_vec::<f64>(), &numeric, 1e-9);
            }
        }
    }
}

const POOL_CASES: &[([usize; 4], [usize; 2], [usize; 2])] = &[
    ([2, 5, 6, 2], [2, 2], [2, 2]),
    ([1, 6, 5, 3], [3, 3], [2, 2]), // overlapping windows
    ([1, 4, 4, 1], [2, 3], [1, 1]), // heavily overlapping
    ([1, 5, 3, 2], [3, 1], [3, 2]),
];

#[test]
fn max_pool_grad_is_the_gradient_of_max_pool() {
    let mut r = rng(12);
    for &(xd, window, strides) in POOL_CASES {
        for padding in [Padding::Valid, Padding::Same] {
            // Distinct random values: the maximum of each window is unique and stays so
            // under a small perturbation.
            let x = random_f64(&mut r, &xd);
            let forward = Op::MaxPool { window, strides, padding };
            let y = ev(forward.clone(), &[&x]);
            let g = random_f64(&mut r, y.shape.dims());
            let analytic = ev(Op::MaxPoolGrad { window, strides, padding }, &[&x, &g]);
            assert_eq!(analytic.shape, x.shape);
            let numeric = finite_differences(&x, 1e-6, |x| dot(&g, &ev(forward.clone(), &[x])));
            assert_close(&analytic.to_vec::<f64>(), &numeric, 1e-8);
        }
    }
}

#[test]
fn max_pool_grad_goes_to_the_first_maximum() {
    // Two overlapping 2x2 windows (stride 1) over [[1, 3, 3]]: both maxima tie at 3; each
    // window's gradient goes to its first 3.
    let x = t(&[1, 2, 3, 1], vec![1.0f32, 3.0, 3.0, 0.0, 3.0, 0.0]);
    let g = t(&[1, 1, 2, 1], vec![10.0f32, 100.0]);
    let op = Op::MaxPoolGrad { window: [2, 2], strides: [1, 1], padding: Padding::Valid };
    assert_eq!(ev(op.clone(), &[&x, &g]).to_vec::<f32>(), [0.0, 110.0, 0.0, 0.0, 0.0, 0.0]);
    // Integers take the same path.
    let xi = t(&[1, 2, 3, 1], vec![1i32, 3, 3, 0, 3, 0]);
    let gi = t(&[1, 1, 2, 1], vec![10i32, 100]);
    assert_eq!(ev(op, &[&xi, &gi]).to_vec::<i32>(), [0, 110, 0, 0, 0, 0]);
}

#[test]
fn avg_pool_grad_is_the_gradient_of_avg_pool() {
    let mut r = rng(13);
    for &(xd, window, strides) in POOL_CASES {
        for padding in [Padding::Valid, Padding::Same] {
            let x = random_f64(&mut r, &xd);
            let forward = Op::AvgPool { window, strides, padding };
            let y = ev(forward.clone(), &[&x]);
            let g = random_f64(&mut r, y.shape.dims());
            let op = Op::AvgPoolGrad { input_shape: Shape(xd.to_vec()), window, strides, padding };
            let analytic = ev(op, &[&g]);
            assert_eq!(analytic.shape, x.shape);
            let numeric = finite_differences(&x, 1e-3, |x| dot(&g, &ev(forward.clone(), &[x])));
            assert_close(&analytic.to_vec::<f64>(), &numeric, 1e-9);
        }
    }
}

#[test]
fn avg_pool_grad_by_hand() {
    // 3x3 input, 2x2 windows, stride 2, same: windows {0,1,3,4} {2,5} {6,7} {8}.
    let g = t(&[1, 2, 2, 1], vec![4.0f32, 2.0, 2.0, 1.0]);
    let op = Op::AvgPoolGrad {
        input_shape: Shape(vec![1, 3, 3, 1]),
        window: [2, 2],
        strides: [2, 2],
        padding: Padding::Same,
    };
    assert_eq!(ev(op, &[&g]).to_vec::<f32>(), [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]);
}

#[test]
fn scatter_add_is_the_gradient_of_gather() {
    let mut r = rng(14);
    let params = random_f64(&mut r, &[5, 3]);
    for indices in [t(&[4], vec![4i32, 0, 4, 2]), t(&[2, 3], vec![1i32, 1, 1, 0, 3, 1])] {
        let y = ev(Op::Gather, &[&params, &indices]);
        let g = random_f64(&mut r, y.shape.dims());
        let analytic = ev(Op::ScatterAdd { rows: 5 }, &[&indices, &g]);
        assert_eq!(analytic.shape, params.shape);
        let numeric = finite_differences(&params, 1e-3, |p| dot(&g, &ev(Op::Gather, &[p, &indices])));
        assert_close(&analytic.to_vec::<f64>(), &numeric, 1e-9);
    }
    // i64 indices, and rank-1 params.
    let table = random_f64(&mut r, &[4]);
    let indices = t(&[3], vec![3i64, 3, 0]);
    let g = random_f64(&mut r, &[3]);
    let analytic = ev(Op::ScatterAdd { rows: 4 }, &[&indices, &g]);
    let numeric = finite_differences(&table, 1e-3, |p| dot(&g, &ev(Op::Gather, &[p, &indices])));
    assert_close(&analytic.to_vec::<f64>(), &numeric, 1e-9);
}

#[test]
fn pad_is_the_gradient_of_slice() {
    let mut r = rng(15);
    let x = random_f64(&mut r, &[4, 5, 3]);
    for (begin, size) in
        [(vec![1, 0, 2], vec![2, 5, 1]), (vec![0, 2, 0], vec![4, 3, 3]), (vec![3, 4, 2], vec![1, 1, 1])]
    {
        let slice = Op::Slice { begin: begin.clone(), size: size.clone() };
        let g = random_f64(&mut r, &size);
        let after: Vec<usize> = (0..3).map(|i| x.shape.dims()[i] - begin[i] - size[i]).collect();
        let analytic = ev(Op::Pad { before: begin, after }, &[&g]);
        assert_eq!(analytic.shape, x.shape);
        let numeric = finite_differences(&x, 1e-3, |x| dot(&g, &ev(slice.clone(), &[x])));
        assert_close(&analytic.to_vec::<f64>(), &numeric, 1e-9);
    }
}
