//! Times the library kernels of one training step of the CNN (batch 64): conv1 3×3 1→32 on
//! 28×28 valid, max pool 2, conv2 3×3 32→64 on 13×13 valid, max pool 2. Each line is the
//! median of `RUNS` calls after warm-up; the total is the sum of the kernels a training step
//! runs (conv1's input gradient is not one of them: the images need none; nor is the first convolution pooled as
//! it is computed, which inference runs).
//!
//! `cargo bench -p dfc-kernels --bench conv` (`-- --runs N` to change the count, `-- --only WORD`
//! for the kernels whose name holds WORD).

use dfc_kernels::*;
use std::hint::black_box;
use std::time::Instant;

const RUNS: usize = 100;

fn random(len: usize, rng: &mut fastrand::Rng) -> Vec<f32> {
    (0..len).map(|_| rng.f32() * 2.0 - 1.0).collect()
}

/// The median time of `runs` calls of `f`, in milliseconds.
fn median_ms(runs: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..5 {
        f();
    }
    let mut times: Vec<f64> = (0..runs)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[runs / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let runs = args
        .iter()
        .position(|a| a == "--runs")
        .and_then(|i| args.get(i + 1))
        .and_then(|n| n.parse().ok())
        .unwrap_or(RUNS)
        .max(1);
    // `--only WORD`: time only the kernels whose name contains WORD.
    let only = args.iter().position(|a| a == "--only").and_then(|i| args.get(i + 1)).cloned();
    let mut rng = fastrand::Rng::with_seed(7);
    let n = 64;
    let g1 = Conv2dGeometry::new([n, 28, 28, 1], [3, 3, 1, 32], [1, 1], Padding::Valid);
    let p1 = PoolGeometry::new(g1.output_dims(), [2, 2], [2, 2], Padding::Valid);
    let g2 = Conv2dGeometry::new(p1.output_dims(), [3, 3, 32, 64], [1, 1], Padding::Valid);
    let p2 = PoolGeometry::new(g2.output_dims(), [2, 2], [2, 2], Padding::Valid);

    let x = random(g1.input_len(), &mut rng);
    let f1 = random(g1.filter_len(), &mut rng);
    let f2 = random(g2.filter_len(), &mut rng);
    let mut y1 = vec![0.0; g1.output_len()];
    let mut a1 = vec![0.0; p1.output_len()];
    let mut y2 = vec![0.0; g2.output_len()];
    let mut a2 = vec![0.0; p2.output_len()];
    let d_a2 = random(p2.output_len(), &mut rng);
    let mut d_y2 = vec![0.0; g2.output_len()];
    let mut d_a1 = vec![0.0; g2.input_len()];
    let mut d_f2 = vec![0.0; g2.filter_len()];
    let mut d_y1 = vec![0.0; g1.output_len()];
    let mut d_f1 = vec![0.0; g1.filter_len()];
    let mut d_x = vec![0.0; g1.input_len()];
    let mut scratch = Scratch::new();

    // Fill the activations once so the gradients see realistic data.
    conv2d(&g1, &x, &f1, &mut y1, scratch.get(conv2d_scratch_len(&g1)));
    max_pool(&p1, &y1, &mut a1);
    conv2d(&g2, &a1, &f2, &mut y2, scratch.get(conv2d_scratch_len(&g2)));
    max_pool(&p2, &y2, &mut a2);
    max_pool_grad(&p2, &y2, &d_a2, &mut d_y2);
    conv2d_backprop_input(&g2, &f2, &d_y2, &mut d_a1, scratch.get(conv2d_backprop_input_scratch_len(&g2)));
    max_pool_grad(&p1, &y1, &d_a1, &mut d_y1);

    println!("rayon threads: {}, {runs} runs each, median", rayon::current_num_threads());
    let mut rows: Vec<(&str, f64, bool)> = Vec::new();
    let mut time = |name: &'static str, in_step, f: &mut dyn FnMut()| {
        if only.as_ref().is_none_or(|w| name.contains(w.as_str())) {
            rows.push((name, median_ms(runs, f), in_step));
        }
    };
    time("conv1 forward            64x28x28x1 * 3x3x1x32", true, &mut || {
        conv2d(&g1, &x, &f1, &mut y1, scratch.get(conv2d_scratch_len(&g1)));
        black_box(&y1);
    });
    time("max_pool1                64x26x26x32 2/2", true, &mut || {
        max_pool(&p1, &y1, &mut a1);
        black_box(&a1);
    });
    time("conv2 forward            64x13x13x32 * 3x3x32x64", true, &mut || {
        conv2d(&g2, &a1, &f2, &mut y2, scratch.get(conv2d_scratch_len(&g2)));
        black_box(&y2);
    });
    time("max_pool2                64x11x11x64 2/2", true, &mut || {
        max_pool(&p2, &y2, &mut a2);
        black_box(&a2);
    });
    time("max_pool2 grad", true, &mut || {
        max_pool_grad(&p2, &y2, &d_a2, &mut d_y2);
        black_box(&d_y2);
    });
    time("conv2 backprop input", true, &mut || {
        conv2d_backprop_input(&g2, &f2, &d_y2, &mut d_a1, scratch.get(conv2d_backprop_input_scratch_len(&g2)));
        black_box(&d_a1);
    });
    time("conv2 backprop filter", true, &mut || {
        conv2d_backprop_filter(&g2, &a1, &d_y2, &mut d_f2, scratch.get(conv2d_backprop_filter_scratch_len(&g2)));
        black_box(&d_f2);
    });
    time("max_pool1 grad", true, &mut || {
        max_pool_grad(&p1, &y1, &d_a1, &mut d_y1);
        black_box(&d_y1);
    });
    time("conv1 backprop filter", true, &mut || {
        conv2d_backprop_filter(&g1, &x, &d_y1, &mut d_f1, scratch.get(conv2d_backprop_filter_scratch_len(&g1)));
        black_box(&d_f1);
    });
    let b1 = random(g1.filters, &mut rng);
    time("conv1 + max_pool1 + bias + relu at inference (not in a step)", false, &mut || {
        let then = PoolEpilogue { bias: Some(&b1), relu: true };
        conv2d_max_pool(&g1, &p1, &x, &f1, then, &mut a1, scratch.get(conv2d_max_pool_scratch_len(&g1, &p1)));
        black_box(&a1);
    });

    time("conv1 backprop input (not in a step)", false, &mut || {
        conv2d_backprop_input(&g1, &f1, &d_y1, &mut d_x, scratch.get(conv2d_backprop_input_scratch_len(&g1)));
        black_box(&d_x);
    });
    let mut total = 0.0;
    for (name, ms, in_step) in &rows {
        println!("{name:<52} {ms:>8.3} ms");
        if *in_step {
            total += ms;
        }
    }
    println!("{:<52} {total:>8.3} ms", "total of a training step's kernels");
}
