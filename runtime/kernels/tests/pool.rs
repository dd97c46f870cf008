//! The pooling kernels against the reference interpreter: bitwise equal, ties, NaNs and
//! overlapping windows included.

mod common;

use common::*;
use dfc_ir::{Op, Padding, Shape};
use dfc_kernels::*;

struct Case {
    input: [usize; 4],
    window: [usize; 2],
    strides: [usize; 2],
    padding: Padding,
}

impl Case {
    fn check(&self, x: &[f32], rng: &mut fastrand::Rng) {
        let g = PoolGeometry::new(self.input, self.window, self.strides, self.padding);
        let go = random(g.output_len(), rng);
        self.check_with(x, &go);
    }

    /// Checks the four kernels on input `x` and output gradient `go`.
    fn check_with(&self, x: &[f32], go: &[f32]) {
        let g = PoolGeometry::new(self.input, self.window, self.strides, self.padding);
        let what = format!("{:?} window {:?} strides {:?} {:?}", self.input, self.window, self.strides, self.padding);
        let (window, strides, padding) = (self.window, self.strides, self.padding);
        let xt = tensor(&self.input, x.to_vec());
        let got = tensor(&g.output_dims(), go.to_vec());

        let want: Vec<f32> = eval(&Op::MaxPool { window, strides, padding }, &[&xt]);
        let mut out = vec![0.5; g.output_len()];
        max_pool(&g, x, &mut out);
        assert_same_f32(&out, &want, &format!("max_pool {what}"));

        let want: Vec<f32> = eval(&Op::MaxPoolGrad { window, strides, padding }, &[&xt, &got]);
        let mut grad = vec![0.5; g.input_len()];
        max_pool_grad(&g, x, go, &mut grad);
        assert_same_f32(&grad, &want, &format!("max_pool_grad {what}"));

        let want: Vec<f32> = eval(&Op::AvgPool { window, strides, padding }, &[&xt]);
        let mut out = vec![0.5; g.output_len()];
        avg_pool(&g, x, &mut out);
        assert_same_f32(&out, &want, &format!("avg_pool {what}"));

        let input_shape = Shape::from(self.input.to_vec());
        let want: Vec<f32> = eval(&Op::AvgPoolGrad { input_shape, window, strides, padding }, &[&got]);
        let mut grad = vec![0.5; g.input_len()];
        avg_pool_grad(&g, go, &mut grad);
        assert_same_f32(&grad, &want, &format!("avg_pool_grad {what}"));
    }
}

fn random_case(rng: &mut fastrand::Rng, max_c: usize) -> Case {
    loop {
        let case = Case {
            input: [rng.usize(1..4), rng.usize(1..10), rng.usize(1..10), rng.usize(1..max_c)],
            window: [rng.usize(1..5), rng.usize(1..5)],
            strides: [rng.usize(1..4), rng.usize(1..4)],
            padding: if rng.bool() { Padding::Same } else { Padding::Valid },
        };
        if case.padding == Padding::Same || (case.window[0] <= case.input[1] && case.window[1] <= case.input[2]) {
            return case;
        }
    }
}

fn len(input: [usize; 4]) -> usize {
    input.iter().product()
}

#[test]
fn random_shapes_agree_with_the_interpreter() {
    let mut rng = rng(11);
    for _ in 0..400 {
        // Channels up to 40: whole vectors of 16 and the rest.
        let case = random_case(&mut rng, 41);
        let x = random(len(case.input), &mut rng);
        case.check(&x, &mut rng);
    }
}

#[test]
fn ties_go_to_the_first_maximum() {
    let mut rng = rng(12);
    for _ in 0..300 {
        let case = random_case(&mut rng, 35);
        let x = ties(len(case.input), &mut rng);
        case.check(&x, &mut rng);
    }
}

#[test]
fn signed_zeros_and_nans() {
    let mut rng = rng(13);
    let values = [0.0, -0.0, 1.0, -1.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY];
    for _ in 0..300 {
        let case = random_case(&mut rng, 35);
        let x: Vec<f32> = (0..len(case.input)).map(|_| values[rng.usize(..values.len())]).collect();
        let g = PoolGeometry::new(case.input, case.window, case.strides, case.padding);
        let go: Vec<f32> = (0..g.output_len()).map(|_| values[rng.usize(..values.len())]).collect();
        case.check_with(&x, &go);
    }
}

/// Windows that tile the image exactly (each element in one window) take another path.
#[test]
fn windows_that_tile_the_image() {
    let mut rng = rng(17);
    let values = [0.0, -0.0, 1.0, -1.0, f32::NAN];
    for (h, w, k) in [(4, 4, 2), (6, 9, 3), (26, 26, 2), (3, 3, 3), (5, 5, 1)] {
        for c in [1, 2, 16, 17, 35, 64] {
            let case = Case { input: [2, h, w, c], window: [k, k], strides: [k, k], padding: Padding::Valid };
            let g = PoolGeometry::new(case.input, case.window, case.strides, case.padding);
            let x = ties(len(case.input), &mut rng);
            case.check(&x, &mut rng);
            let go: Vec<f32> = (0..g.output_len()).map(|_| values[rng.usize(..values.len())]).collect();
            case.check_with(&x, &go);
        }
    }
}

/// Windows of 3 with stride 2 overlap: a maximum shared by two windows gets both gradients.
#[test]
fn overlapping_windows_of_three_stride_two() {
    let mut rng = rng(14);
    for padding in [Padding::Valid, Padding::Same] {
        for (h, w) in [(5, 5), (7, 6), (9, 9), (3, 4)] {
            for c in [1, 3, 16, 19, 32] {
                let case = Case { input: [2, h, w, c], window: [3, 3], strides: [2, 2], padding };
                let x = ties(len(case.input), &mut rng);
                case.check(&x, &mut rng);
                let x = random(len(case.input), &mut rng);
                case.check(&x, &mut rng);
            }
        }
    }
}

/// The CNN's pools, and others large enough to run on several threads.
#[test]
fn large_shapes() {
    let mut rng = rng(15);
    let cases = [
        Case { input: [16, 26, 26, 32], window: [2, 2], strides: [2, 2], padding: Padding::Valid },
        Case { input: [16, 11, 11, 64], window: [2, 2], strides: [2, 2], padding: Padding::Valid },
        Case { input: [4, 31, 29, 24], window: [3, 3], strides: [2, 2], padding: Padding::Same },
        Case { input: [3, 40, 40, 5], window: [3, 2], strides: [1, 3], padding: Padding::Same },
    ];
    for case in &cases {
        let x = ties(len(case.input), &mut rng);
        case.check(&x, &mut rng);
    }
}

/// `max_pool` takes any ordered element: i32 here.
#[test]
fn max_pool_of_integers() {
    let mut rng = rng(16);
    for _ in 0..50 {
        let case = random_case(&mut rng, 20);
        let g = PoolGeometry::new(case.input, case.window, case.strides, case.padding);
        let x: Vec<i32> = (0..len(case.input)).map(|_| rng.i32(-3..4)).collect();
        let op = Op::MaxPool { window: case.window, strides: case.strides, padding: case.padding };
        let want: Vec<i32> = eval(&op, &[&tensor(&case.input, x.clone())]);
        let mut out = vec![0; g.output_len()];
        max_pool(&g, &x, &mut out);
        assert_eq!(out, want);
    }
}
