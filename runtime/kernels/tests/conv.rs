//! The convolution kernels against the reference interpreter, on random shapes, strides and
//! paddings. Sums are compared with a relative tolerance of 1e-4 of the sum of the terms'
//! magnitudes (`common::assert_close`): the kernels add in `sgemm`'s order, not the
//! interpreter's.

#[path = "../../../tests/support/avx2_rerun.rs"]
mod avx2_rerun;
#[path = "../../../tests/support/close.rs"]
mod close;
mod common;
#[path = "../../../tests/support/skip.rs"]
mod skip;

use common::*;
use dfc_ir::{Op, Padding, Shape};
use dfc_kernels::*;

struct Case {
    input: [usize; 4],
    filter: [usize; 4],
    strides: [usize; 2],
    padding: Padding,
}

impl Case {
    fn geometry(&self) -> Conv2dGeometry {
        Conv2dGeometry::new(self.input, self.filter, self.strides, self.padding)
    }

    /// Checks all three kernels against the interpreter, with `scratch` as given.
    fn check(&self, rng: &mut fastrand::Rng, scratch: &mut Scratch) {
        let g = self.geometry();
        let what = format!("{:?} * {:?} strides {:?} {:?}", self.input, self.filter, self.strides, self.padding);
        let x = random(g.input_len(), rng);
        let f = random(g.filter_len(), rng);
        let go = random(g.output_len(), rng);
        let (xt, ft, got) =
            (tensor(&self.input, x.clone()), tensor(&self.filter, f.clone()), tensor(&g.output_dims(), go.clone()));
        let (xa, fa, goa) =
            (tensor(&self.input, abs(&x)), tensor(&self.filter, abs(&f)), tensor(&g.output_dims(), abs(&go)));

        let op = Op::Conv2d { strides: self.strides, padding: self.padding };
        let want: Vec<f32> = eval(&op, &[&xt, &ft]);
        let magnitude: Vec<f32> = eval(&op, &[&xa, &fa]);
        let mut out = vec![f32::NAN; g.output_len()];
        conv2d(&g, &x, &f, &mut out, scratch.get(conv2d_scratch_len(&g)));
        assert_close(&out, &want, &magnitude, &format!("conv2d {what}"));
        // The filter kept between calls (Winograd then takes fewer images than threads too): transformed by the
        // first call, read back by the second.
        let mut kept = KeptFilter::new();
        for pass in ["transformed", "read back"] {
            let mut out = vec![f32::NAN; g.output_len()];
            conv2d_kept(&g, &x, &f, &mut out, scratch.get(conv2d_kept_scratch_len(&g)), Some(&mut kept));
            assert_close(&out, &want, &magnitude, &format!("conv2d {what}, the filter kept: {pass}"));
        }

        let op = Op::Conv2dBackpropInput {
            input_shape: Shape::from(self.input.to_vec()),
            strides: self.strides,
            padding: self.padding,
        };
        let want: Vec<f32> = eval(&op, &[&ft, &got]);
        let magnitude: Vec<f32> = eval(&op, &[&fa, &goa]);
        let mut grad = vec![f32::NAN; g.input_len()];
        conv2d_backprop_input(&g, &f, &go, &mut grad, scratch.get(conv2d_backprop_input_scratch_len(&g)));
        assert_close(&grad, &want, &magnitude, &format!("conv2d_backprop_input {what}"));

        let op = Op::Conv2dBackpropFilter {
            filter_shape: Shape::from(self.filter.to_vec()),
            strides: self.strides,
            padding: self.padding,
        };
        let want: Vec<f32> = eval(&op, &[&xt, &got]);
        let magnitude: Vec<f32> = eval(&op, &[&xa, &goa]);
        let mut grad = vec![f32::NAN; g.filter_len()];
        conv2d_backprop_filter(&g, &x, &go, &mut grad, scratch.get(conv2d_backprop_filter_scratch_len(&g)));
        assert_close(&grad, &want, &magnitude, &format!("conv2d_backprop_filter {what}"));
    }
}

fn random_case(rng: &mut fastrand::Rng) -> Case {
    loop {
        let c = rng.usize(1..6);
        let case = Case {
            input: [rng.usize(1..4), rng.usize(1..10), rng.usize(1..10), c],
            filter: [rng.usize(1..5), rng.usize(1..5), c, rng.usize(1..6)],
            strides: [rng.usize(1..4), rng.usize(1..4)],
            padding: if rng.bool() { Padding::Same } else { Padding::Valid },
        };
        // `valid` needs the window to fit.
        if case.padding == Padding::Same || (case.filter[0] <= case.input[1] && case.filter[1] <= case.input[2]) {
            return case;
        }
    }
}

#[test]
fn random_shapes_agree_with_the_interpreter() {
    let mut rng = rng(1);
    let mut scratch = Scratch::new();
    for _ in 0..300 {
        random_case(&mut rng).check(&mut rng, &mut scratch);
    }
}

#[test]
fn same_padding_with_stride_two() {
    let mut rng = rng(2);
    let mut scratch = Scratch::new();
    for (h, w) in [(7, 7), (8, 8), (6, 9), (1, 1), (2, 5)] {
        for k in [1, 2, 3, 4] {
            Case { input: [2, h, w, 3], filter: [k, k, 3, 4], strides: [2, 2], padding: Padding::Same }
                .check(&mut rng, &mut scratch);
        }
    }
}

/// Shapes large enough to run on several threads, in chunks of whole images and of output
/// rows, with the CNN's layers among them.
#[test]
fn large_shapes_use_threads_and_chunks() {
    let mut rng = rng(3);
    let mut scratch = Scratch::new();
    let cases = [
        // The CNN's layers, at a smaller batch.
        Case { input: [5, 28, 28, 1], filter: [3, 3, 1, 32], strides: [1, 1], padding: Padding::Valid },
        Case { input: [5, 13, 13, 32], filter: [3, 3, 32, 64], strides: [1, 1], padding: Padding::Valid },
        // Windows of 576 elements: chunks of output rows within an image.
        Case { input: [3, 20, 18, 64], filter: [3, 3, 64, 8], strides: [1, 1], padding: Padding::Same },
        Case { input: [2, 33, 17, 40], filter: [5, 3, 40, 6], strides: [2, 1], padding: Padding::Same },
        // Many small images per chunk.
        Case { input: [37, 6, 6, 2], filter: [3, 3, 2, 64], strides: [1, 1], padding: Padding::Same },
    ];
    for case in &cases {
        case.check(&mut rng, &mut scratch);
    }
}

/// A scratch buffer smaller than `*_scratch_len` asks for still works, on fewer threads, as
/// long as it holds one task's share.
#[test]
fn a_smaller_scratch_uses_fewer_tasks() {
    let mut rng = rng(4);
    let case = Case { input: [6, 13, 13, 32], filter: [3, 3, 32, 16], strides: [1, 1], padding: Padding::Valid };
    let g = case.geometry();
    let x = random(g.input_len(), &mut rng);
    let f = random(g.filter_len(), &mut rng);
    let go = random(g.output_len(), &mut rng);
    let mut full = vec![0.0; g.output_len()];
    conv2d(&g, &x, &f, &mut full, &mut vec![0.0; conv2d_scratch_len(&g)]);
    let mut grad_full = vec![0.0; g.filter_len()];
    conv2d_backprop_filter(&g, &x, &go, &mut grad_full, &mut vec![0.0; conv2d_backprop_filter_scratch_len(&g)]);
    let threads = rayon::current_num_threads().max(1);
    let mut out = vec![0.0; g.output_len()];
    conv2d(&g, &x, &f, &mut out, &mut vec![0.0; conv2d_scratch_len(&g) / threads]);
    assert_near(&out, &full);
    let mut grad = vec![0.0; g.filter_len()];
    conv2d_backprop_filter(&g, &x, &go, &mut grad, &mut vec![0.0; conv2d_backprop_filter_scratch_len(&g) / threads]);
    assert_near(&grad, &grad_full);
    // The least that works: one output row's window elements, on one thread.
    let one_row = g.out_w * g.patch_len();
    let mut out = vec![0.0; g.output_len()];
    conv2d(&g, &x, &f, &mut out, &mut vec![0.0; one_row]);
    assert_near(&out, &full);
    conv2d_backprop_filter(&g, &x, &go, &mut grad, &mut vec![0.0; one_row]);
    assert_near(&grad, &grad_full);
    let mut grad_in = vec![0.0; g.input_len()];
    conv2d_backprop_input(&g, &f, &go, &mut grad_in, &mut vec![0.0; conv2d_backprop_input_scratch_len(&g)]);
    let mut small = vec![0.0; g.input_len()];
    conv2d_backprop_input(&g, &f, &go, &mut small, &mut vec![0.0; one_row]);
    assert_near(&small, &grad_in);
}

/// Other chunkings may round differently (`sgemm` may sum in another order for other sizes).
fn assert_near(got: &[f32], want: &[f32]) {
    close::assert_close("the gradient", &close::f64s(got), &close::f64s(want), 1e-4);
}

#[test]
#[should_panic(expected = "scratch too small")]
fn a_scratch_smaller_than_one_row_is_refused() {
    let g = Conv2dGeometry::new([1, 5, 5, 8], [3, 3, 8, 3], [1, 1], Padding::Valid);
    let mut out = vec![0.0; g.output_len()];
    conv2d(
        &g,
        &vec![0.0; g.input_len()],
        &vec![0.0; g.filter_len()],
        &mut out,
        &mut vec![0.0; g.out_w * g.patch_len() - 1],
    );
}

/// The kernels overwrite their outputs, whatever was there.
#[test]
fn outputs_are_overwritten() {
    let mut rng = rng(5);
    let g = Conv2dGeometry::new([2, 5, 5, 2], [3, 3, 2, 3], [2, 2], Padding::Same);
    let x = random(g.input_len(), &mut rng);
    let f = random(g.filter_len(), &mut rng);
    let go = random(g.output_len(), &mut rng);
    let mut scratch = Scratch::new();
    let run = |fill: f32, scratch: &mut Scratch| {
        let mut out = vec![fill; g.output_len()];
        conv2d(&g, &x, &f, &mut out, scratch.get(conv2d_scratch_len(&g)));
        let mut gi = vec![fill; g.input_len()];
        conv2d_backprop_input(&g, &f, &go, &mut gi, scratch.get(conv2d_backprop_input_scratch_len(&g)));
        let mut gf = vec![fill; g.filter_len()];
        conv2d_backprop_filter(&g, &x, &go, &mut gf, scratch.get(conv2d_backprop_filter_scratch_len(&g)));
        (out, gi, gf)
    };
    assert_eq!(run(0.0, &mut scratch), run(7.5, &mut scratch));
}

#[test]
fn empty_outputs() {
    // Zero images, and zero filters: nothing to do, no panic.
    let mut scratch = Scratch::new();
    for (input, filter) in [([0, 5, 5, 2], [3, 3, 2, 4]), ([2, 5, 5, 2], [3, 3, 2, 0])] {
        let g = Conv2dGeometry::new(input, filter, [1, 1], Padding::Same);
        let x = vec![1.0; g.input_len()];
        let f = vec![1.0; g.filter_len()];
        let mut out = vec![0.0; g.output_len()];
        conv2d(&g, &x, &f, &mut out, scratch.get(conv2d_scratch_len(&g)));
        let mut gi = vec![1.0; g.input_len()];
        conv2d_backprop_input(&g, &f, &out, &mut gi, scratch.get(conv2d_backprop_input_scratch_len(&g)));
        assert!(gi.iter().all(|&v| v == 0.0));
        let mut gf = vec![1.0; g.filter_len()];
        conv2d_backprop_filter(&g, &x, &out, &mut gf, scratch.get(conv2d_backprop_filter_scratch_len(&g)));
        assert!(gf.iter().all(|&v| v == 0.0));
    }
}

/// Windows of at most 32 elements are summed in the interpreter's order, without `sgemm`: the
/// forward pass is then bitwise the interpreter's.
#[test]
fn thin_windows_are_exact() {
    let mut rng = rng(6);
    for _ in 0..100 {
        let case = random_case(&mut rng);
        let g = case.geometry();
        if g.patch_len() > 32 {
            continue;
        }
        let x = random(g.input_len(), &mut rng);
        let f = random(g.filter_len(), &mut rng);
        let want: Vec<f32> = eval(
            &Op::Conv2d { strides: case.strides, padding: case.padding },
            &[&tensor(&case.input, x.clone()), &tensor(&case.filter, f.clone())],
        );
        let mut out = vec![0.0; g.output_len()];
        conv2d(&g, &x, &f, &mut out, &mut []);
        assert_same_f32(&out, &want, "thin conv2d");
    }
}

/// `pooled` (laid out as `pool`'s output) with `then`'s bias per filter added and relu taken, as the interpreter
/// adds and takes them.
fn finished_by_the_interpreter(mut pooled: Vec<f32>, pool: &PoolGeometry, then: PoolEpilogue<'_>) -> Vec<f32> {
    let dims = pool.output_dims();
    if let Some(bias) = then.bias {
        let add = Op::Binary(dfc_ir::BinaryOp::Add);
        pooled = eval(&add, &[&tensor(&dims, pooled), &tensor(&[bias.len()], bias.to_vec())]);
    }
    if then.relu {
        pooled = eval(&Op::Unary(dfc_ir::UnaryOp::Relu), &[&tensor(&dims, pooled)]);
    }
    pooled
}

/// A thin convolution and the max pooling of its output in one pass (`conv2d_max_pool`) against the
/// interpreter's two ops: bitwise, NaN and infinities in the input included, on random convolutions, pooling
/// windows and strides (the CNN's first layer among them); and the geometries it does not take refused.
#[test]
fn pooled_thin_windows_are_exact() {
    let mut rng = rng(9);
    let mut scratch = Scratch::new();
    let mut fused = 0;
    let mut cases: Vec<(Case, [usize; 2], [usize; 2], Padding)> = (0..400)
        .map(|_| {
            let pool = [rng.usize(1..4), rng.usize(1..4)];
            let strides = [rng.usize(1..4), rng.usize(1..4)];
            let padding = if rng.usize(..4) == 0 { Padding::Same } else { Padding::Valid };
            (random_case(&mut rng), pool, strides, padding)
        })
        .collect();
    let first_layer = Case { input: [64, 28, 28, 1], filter: [3, 3, 1, 32], strides: [1, 1], padding: Padding::Valid };
    cases.push((first_layer, [2, 2], [2, 2], Padding::Valid));
    // 2×2 windows computed by quads (`thin_conv_max_pool_2x2`) where the convolution's windows lie inside the
    // input, the rows that reach into its padding as before: filters not a multiple of 16, strides, channels.
    let quads = [
        (Case { input: [2, 9, 11, 1], filter: [3, 3, 1, 20], strides: [1, 1], padding: Padding::Same }, [2, 2]),
        (Case { input: [3, 10, 10, 3], filter: [3, 3, 3, 17], strides: [2, 1], padding: Padding::Same }, [1, 2]),
        (Case { input: [1, 12, 9, 2], filter: [2, 3, 2, 33], strides: [1, 1], padding: Padding::Valid }, [3, 2]),
        // 3×3 on one channel at stride 1, from the 4×4 patch under each pooled pixel (`pooled_grey_3x3`, AVX-512):
        // 32 filters and 16 at a time, the rest one by one; pooled windows that overlap.
        (Case { input: [2, 10, 9, 1], filter: [3, 3, 1, 48], strides: [1, 1], padding: Padding::Valid }, [2, 2]),
        (Case { input: [1, 9, 12, 1], filter: [3, 3, 1, 37], strides: [1, 1], padding: Padding::Same }, [1, 1]),
    ];
    cases.extend(quads.map(|(case, strides)| (case, [2, 2], strides, Padding::Valid)));
    for (case, window, strides, padding) in cases {
        let g = case.geometry();
        let pooled = [g.n, g.out_h, g.out_w, g.filters];
        if g.patch_len() > 32
            || pooled.contains(&0)
            || (padding == Padding::Valid && (window[0] > g.out_h || window[1] > g.out_w))
        {
            continue;
        }
        let pool = PoolGeometry::new(pooled, window, strides, padding);
        let applies = conv2d_max_pool_applies(&g, &pool, false);
        // Windows that reach past the convolution's output (same padding that pads) are not taken; all others here
        // are.
        let inside = pool.pad_top == 0
            && pool.pad_left == 0
            && (pool.out_h - 1) * strides[0] + window[0] <= g.out_h
            && (pool.out_w - 1) * strides[1] + window[1] <= g.out_w;
        assert_eq!(applies, inside, "{g:?} {pool:?}");
        if !applies {
            continue;
        }
        let mut x = random(g.input_len(), &mut rng);
        for _ in 0..x.len() / 50 {
            let at = rng.usize(..x.len());
            x[at] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][rng.usize(..3)];
        }
        let f = random(g.filter_len(), &mut rng);
        let conv: Vec<f32> = eval(
            &Op::Conv2d { strides: case.strides, padding: case.padding },
            &[&tensor(&case.input, x.clone()), &tensor(&case.filter, f.clone())],
        );
        let mut want: Vec<f32> = eval(&Op::MaxPool { window, strides, padding }, &[&tensor(&pooled, conv)]);
        // Then, in some cases, a bias per filter (NaN and ±0 among them) and the relu, as the interpreter adds and
        // takes them.
        let mut bias = random(g.filters, &mut rng);
        bias[0] = [f32::NAN, -0.0, 0.0, 1.0][rng.usize(..4)];
        let (with_bias, relu) = (rng.bool(), rng.bool());
        let then = PoolEpilogue { bias: with_bias.then_some(&bias[..]), relu };
        want = finished_by_the_interpreter(want, &pool, then);
        let mut out = vec![0.0; pool.output_len()];
        conv2d_max_pool(&g, &pool, &x, &f, then, &mut out, scratch.get(conv2d_max_pool_scratch_len(&g, &pool)));
        assert_same_f32(&out, &want, &format!("conv2d_max_pool of {g:?} by {pool:?}, then {then:?}"));
        fused += 1;
    }
    assert!(fused > 100, "only {fused} cases fused");
    // A window of more than 32 elements is not thin.
    let wide = Conv2dGeometry::new([1, 8, 8, 4], [3, 3, 4, 2], [1, 1], Padding::Valid);
    assert!(!conv2d_max_pool_applies(&wide, &PoolGeometry::new([1, 6, 6, 2], [2, 2], [2, 2], Padding::Valid), true));
}

/// 3×3 stride-1 windows over 16 channels or more (Winograd's F(4×4, 3×3), for the forward pass
/// and the input gradient): odd and even outputs, `same` and `valid`, channels and filters not a
/// multiple of 16, a batch split over threads in units of whole images; the filter gradient, which stays on `im2col`,
/// checked with them.
#[test]
fn winograd_shapes_agree_with_the_interpreter() {
    let mut rng = rng(6);
    let mut scratch = Scratch::new();
    for (input, filters, padding) in [
        ([4, 13, 13, 32], 64, Padding::Valid),
        // Units of 4 images that the threads claim in turn, the last of 1.
        ([21, 13, 13, 32], 64, Padding::Valid),
        ([3, 7, 10, 17], 20, Padding::Same),
        ([1, 3, 3, 16], 16, Padding::Valid),
        ([9, 6, 5, 24], 40, Padding::Same),
        // The CNN's second layer at batch 1.
        ([1, 13, 13, 32], 64, Padding::Valid),
    ] {
        Case { input, filter: [3, 3, input[3], filters], strides: [1, 1], padding }.check(&mut rng, &mut scratch);
    }
}

/// A Winograd convolution and the max pooling of its output in one pass (`conv2d_max_pool` pooling each output
/// tile as it is transformed) against `conv2d` then `max_pool` then the interpreter's bias and relu: bitwise, NaN
/// and infinities in the input included; odd outputs whose last tile is partly outside, windows of 1, 2 and 4 in
/// either direction, filters not a multiple of 16, `same` padding on the convolution, a batch split over threads
/// (the CNN's second layer among them); with the filter kept between calls (`conv2d_max_pool_kept`), which takes a
/// batch of fewer images than threads on every kernel; and the poolings whose windows cross tiles refused.
#[test]
fn pooled_winograd_tiles_are_exact() {
    let mut rng = rng(10);
    let mut scratch = Scratch::new();
    let threads = rayon::current_num_threads();
    let cases = [
        ([64, 13, 13, 32], 64, Padding::Valid, [2, 2]),
        ([3 * threads, 11, 9, 17], 20, Padding::Same, [2, 2]),
        ([threads, 10, 14, 16], 33, Padding::Valid, [1, 2]),
        ([2 * threads + 1, 14, 11, 24], 16, Padding::Same, [4, 4]),
        ([threads, 9, 8, 16], 18, Padding::Same, [4, 1]),
        // The CNN's second layer at batch 1: here with at most two threads, on the AVX2 kernels or kept.
        ([1, 13, 13, 32], 64, Padding::Valid, [2, 2]),
    ];
    for (input, filters, padding, window) in cases {
        let case = Case { input, filter: [3, 3, input[3], filters], strides: [1, 1], padding };
        let g = case.geometry();
        let pooled = [g.n, g.out_h, g.out_w, g.filters];
        let pool = PoolGeometry::new(pooled, window, window, Padding::Valid);
        let here_kept = g.n >= threads || 2 * g.n >= threads;
        let here = g.n >= threads || (here_kept && dfc_gemm::on_avx2_kernels());
        assert_eq!(conv2d_max_pool_applies(&g, &pool, false), here, "{g:?} {pool:?}");
        assert_eq!(conv2d_max_pool_applies(&g, &pool, true), here_kept, "{g:?} {pool:?} kept");
        if !here_kept {
            continue;
        }
        let mut x = random(g.input_len(), &mut rng);
        for _ in 0..x.len() / 50 {
            let at = rng.usize(..x.len());
            x[at] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][rng.usize(..3)];
        }
        let f = random(g.filter_len(), &mut rng);
        let mut conv = vec![f32::NAN; g.output_len()];
        // By Winograd, as pooled: the filter kept.
        conv2d_kept(&g, &x, &f, &mut conv, scratch.get(conv2d_kept_scratch_len(&g)), Some(&mut KeptFilter::new()));
        let mut want = vec![f32::NAN; pool.output_len()];
        max_pool(&pool, &conv, &mut want);
        let mut bias = random(g.filters, &mut rng);
        bias[0] = [f32::NAN, -0.0, 0.0, 1.0][rng.usize(..4)];
        // Transformed into the kept filter by the first call, read back by the others.
        let mut kept = KeptFilter::new();
        for (with_bias, relu) in [(false, false), (true, false), (true, true), (false, true)] {
            let then = PoolEpilogue { bias: with_bias.then_some(&bias[..]), relu };
            let want = finished_by_the_interpreter(want.clone(), &pool, then);
            let what = format!("conv2d_max_pool of {g:?} by {pool:?}, then {then:?}");
            let mut out = vec![f32::NAN; pool.output_len()];
            let scratch = scratch.get(conv2d_max_pool_scratch_len(&g, &pool));
            conv2d_max_pool_kept(&g, &pool, &x, &f, then, &mut out, scratch, Some(&mut kept));
            assert_same_f32(&out, &want, &format!("{what}, the filter kept"));
            if here {
                conv2d_max_pool(&g, &pool, &x, &f, then, &mut out, scratch);
                assert_same_f32(&out, &want, &what);
            }
        }
    }
    // Windows that cross the 4×4 tiles (wider than their strides, or of 3) are pooled apart.
    let g = Conv2dGeometry::new([threads, 13, 13, 32], [3, 3, 32, 64], [1, 1], Padding::Valid);
    for (window, strides) in [([2, 2], [1, 1]), ([3, 3], [3, 3]), ([2, 2], [2, 1]), ([3, 2], [2, 2])] {
        let pool = PoolGeometry::new([g.n, g.out_h, g.out_w, g.filters], window, strides, Padding::Valid);
        assert!(!conv2d_max_pool_applies(&g, &pool, true), "{window:?} {strides:?}");
    }
    // Fewer images than threads stay on im2col, which pools apart, but where they leave at most half the threads
    // idle on the AVX2 kernels or with the filter kept.
    if threads > 1 {
        let g = Conv2dGeometry { n: threads - 1, ..g };
        let pool = PoolGeometry::new([g.n, g.out_h, g.out_w, g.filters], [2, 2], [2, 2], Padding::Valid);
        let few_enough = 2 * g.n >= threads;
        assert_eq!(conv2d_max_pool_applies(&g, &pool, false), few_enough && dfc_gemm::on_avx2_kernels());
        assert_eq!(conv2d_max_pool_applies(&g, &pool, true), few_enough);
    }
}

/// The kernels are chosen once a process: the Winograd tests again on the AVX2 kernels (`DFC_GEMM=avx2`) with two
/// threads, where a batch of one takes the Winograd path too (`winograd::applies`), pooled or not.
#[test]
fn winograd_tests_pass_again_on_the_avx2_kernels() {
    if !avx2_rerun::in_rerun() {
        avx2_rerun::rerun_on_avx2_kernels(&["winograd"], &[("RAYON_NUM_THREADS", "2")], 3);
    }
}
