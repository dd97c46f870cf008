//! The batch-normalisation kernels against the reference interpreter, on shapes of one chunk
//! of rows and of many (split over threads), with the same bits on one thread as on several.

mod common;

use common::*;
use dfc_ir::Op;
use dfc_kernels::*;

const EPSILON: f64 = 1e-3;

/// The four kernels on `[rows, channels]` data shifted by `offset` (a mean far from 0).
fn run(rows: usize, channels: usize, offset: f32, seed: u64) -> [Vec<f32>; 4] {
    let mut rng = rng(seed);
    let len = rows * channels;
    let x: Vec<f32> = random(len, &mut rng).iter().map(|v| v * 3.0 + offset).collect();
    let g = random(len, &mut rng);
    let mut scratch = Scratch::new();
    let (scales, partials) = scratch.split(norm_scales_len(channels), norm_partials_len(len, channels));
    // Scratch holds whatever it held before: nothing may be read before it is written.
    scales.fill(f32::NAN);
    partials.fill(f64::NAN);
    let mut m = vec![f32::NAN; 2 * channels];
    moments(&x, channels, &mut m, partials);
    let mut y = vec![f32::NAN; len];
    batch_norm(&x, &m, channels, EPSILON, &mut y, scales);
    let mut means = vec![f32::NAN; 2 * channels];
    batch_norm_grad_means(&x, &m, &g, channels, EPSILON, &mut means, scales, partials);
    let mut dx = vec![f32::NAN; len];
    batch_norm_grad(&x, &m, &g, &means, channels, EPSILON, &mut dx, scales);

    let what = format!("[{rows}, {channels}] + {offset}");
    let (xt, gt) = (tensor(&[rows, channels], x.clone()), tensor(&[rows, channels], g));
    let want: Vec<f32> = eval(&Op::Moments, &[&xt]);
    for (i, (&got, &want)) in m.iter().zip(&want).enumerate() {
        // The variance's one pass against the interpreter's two: equal to f32 rounding.
        let tolerance = 1e-5 * want.abs().max(1.0);
        assert!((got - want).abs() <= tolerance, "moments {what}: value {i}: {got} vs {want}");
    }
    let mt = tensor(&[2, channels], want);
    let want: Vec<f32> = eval(&Op::BatchNorm { epsilon: EPSILON, synchronized: false }, &[&xt, &mt]);
    assert_close(&y, &want, &abs(&want), &format!("batch_norm {what}"));
    let want: Vec<f32> = eval(&Op::BatchNormGradMeans { epsilon: EPSILON }, &[&xt, &mt, &gt]);
    assert_close(&means, &want, &vec![1.0; 2 * channels], &format!("batch_norm_grad_means {what}"));
    let means_t = tensor(&[2, channels], want);
    let want: Vec<f32> = eval(&Op::BatchNormGrad { epsilon: EPSILON }, &[&xt, &mt, &gt, &means_t]);
    assert_close(&dx, &want, &vec![1.0; len], &format!("batch_norm_grad {what}"));
    [m, y, means, dx]
}

#[test]
fn normalisation_kernels_agree_with_the_interpreter() {
    // One row; one chunk; several chunks and a ragged last one (16,384 elements a chunk);
    // large enough to split over threads; one channel; more channels than a chunk's elements.
    // No rows, and no channels (a plan may hold such shapes): empty sums, nothing written.
    let shapes = [(1, 5), (7, 3), (300, 64), (1500, 33), (5000, 16), (20000, 1), (3, 20000), (0, 3), (4, 0)];
    for (i, &(rows, channels)) in shapes.iter().enumerate() {
        for offset in [0.0, 100.0] {
            run(rows, channels, offset, i as u64);
        }
    }
}

#[test]
fn normalisation_is_the_same_bits_on_one_thread_and_on_two() {
    let on = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| run(6000, 24, 1.0, 7))
    };
    let (one, two) = (on(1), on(2));
    for (a, b) in one.iter().zip(&two) {
        assert_same_f32(a, b, "one thread against two");
    }
}
