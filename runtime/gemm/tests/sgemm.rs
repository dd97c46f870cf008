//! `sgemm` and `sgemm_strided` against a naive f64 triple loop.

use dfc_gemm::{sgemm, sgemm_strided, sgemm_update};

fn random(rng: &mut fastrand::Rng, len: usize) -> Vec<f32> {
    (0..len).map(|_| rng.f32() * 2.0 - 1.0).collect()
}

/// A product to check: the operands as stored, with their leading dimensions.
struct Case {
    m: usize,
    n: usize,
    k: usize,
    ta: bool,
    tb: bool,
    lda: usize,
    ldb: usize,
    ldc: usize,
    accumulate: bool,
    parallel: bool,
    /// Not 1: the product is run by `sgemm_update` (packed operands, accumulating).
    alpha: f32,
}

impl Case {
    fn packed(m: usize, n: usize, k: usize, ta: bool, tb: bool, accumulate: bool, parallel: bool) -> Case {
        let lda = if ta { m } else { k };
        let ldb = if tb { k } else { n };
        Case { m, n, k, ta, tb, lda, ldb, ldc: n, accumulate, parallel, alpha: 1.0 }
    }

    fn run(&self, rng: &mut fastrand::Rng) {
        let Case { m, n, k, ta, tb, lda, ldb, ldc, accumulate, parallel, alpha } = *self;
        let (a_rows, a_cols) = if ta { (k, m) } else { (m, k) };
        let (b_rows, b_cols) = if tb { (n, k) } else { (k, n) };
        let a = random(rng, if a_rows == 0 { 0 } else { (a_rows - 1) * lda + a_cols });
        let b = random(rng, if b_rows == 0 { 0 } else { (b_rows - 1) * ldb + b_cols });
        // C is filled past its last row and between rows, to catch stray writes.
        let c0 = random(rng, m * ldc + 3);
        let at = |i: usize, p: usize| f64::from(if ta { a[p * lda + i] } else { a[i * lda + p] });
        let bt = |p: usize, j: usize| f64::from(if tb { b[j * ldb + p] } else { b[p * ldb + j] });
        let mut c = c0.clone();
        let packed = lda == a_cols.max(1) && ldb == b_cols.max(1) && ldc == n;
        if alpha != 1.0 {
            assert!(packed && accumulate, "sgemm_update takes packed operands and accumulates");
            sgemm_update(m, n, k, alpha, &a, ta, &b, tb, &mut c, parallel);
        } else if packed && rng.bool() {
            sgemm(m, n, k, &a, ta, &b, tb, &mut c, accumulate, parallel);
        } else {
            sgemm_strided(m, n, k, &a, lda, ta, &b, ldb, tb, &mut c, ldc, accumulate, parallel);
        }
        for i in 0..m {
            for j in 0..ldc {
                let got = c[i * ldc + j];
                if j >= n {
                    assert_eq!(got, c0[i * ldc + j], "wrote outside C at ({i}, {j})");
                    continue;
                }
                let (mut sum, mut size) = (0f64, 0f64);
                for p in 0..k {
                    sum += f64::from(alpha) * at(i, p) * bt(p, j);
                    size += (f64::from(alpha) * at(i, p) * bt(p, j)).abs();
                }
                let old = f64::from(c0[i * ldc + j]);
                if accumulate {
                    sum += old;
                    size += old.abs();
                }
                let err = (f64::from(got) - sum).abs();
                assert!(
                    err <= 1e-4 * size.max(1e-30) + 1e-30,
                    "{m}×{n}×{k} ta={ta} tb={tb} lds=({lda},{ldb},{ldc}) acc={accumulate} par={parallel} alpha={alpha}: \
                     c[{i}][{j}] = {got}, want {sum} (err {err:e}, scale {size:e})"
                );
            }
        }
        assert_eq!(&c[m * ldc..], &c0[m * ldc..], "wrote past C");
    }
}

#[test]
fn random_small_products() {
    let mut rng = fastrand::Rng::with_seed(7);
    for _ in 0..3000 {
        let (m, n, k) = (rng.usize(1..=70), rng.usize(1..=70), rng.usize(1..=70));
        let case = Case::packed(m, n, k, rng.bool(), rng.bool(), rng.bool(), rng.bool());
        case.run(&mut rng);
    }
}

#[test]
fn random_strided_products() {
    let mut rng = fastrand::Rng::with_seed(11);
    for _ in 0..1000 {
        let (m, n, k) = (rng.usize(1..=70), rng.usize(1..=70), rng.usize(1..=70));
        let mut case = Case::packed(m, n, k, rng.bool(), rng.bool(), rng.bool(), rng.bool());
        case.lda += rng.usize(0..5);
        case.ldb += rng.usize(0..5);
        case.ldc += rng.usize(0..5);
        case.run(&mut rng);
    }
}

/// `c += α·a·b` (a product folded into an update), small and large enough for every parallel split.
#[test]
fn random_updates() {
    let mut rng = fastrand::Rng::with_seed(19);
    for i in 0..600 {
        let (m, n, k) = if i % 20 == 0 {
            (rng.usize(1..=800), rng.usize(1..=300), rng.usize(1..=800))
        } else {
            (rng.usize(1..=70), rng.usize(1..=70), rng.usize(1..=70))
        };
        let mut case = Case::packed(m, n, k, rng.bool(), rng.bool(), true, rng.bool());
        case.alpha = if rng.bool() { -0.01 } else { rng.f32() * 4.0 - 2.0 };
        case.run(&mut rng);
    }
    // Each split of the MLP's weight gradients, as the update of the weights.
    for (m, n, k) in [(784, 256, 128), (256, 256, 128), (256, 10, 128), (32, 32, 6000)] {
        let mut case = Case::packed(m, n, k, true, false, true, true);
        case.alpha = -0.01;
        case.run(&mut rng);
    }
}

#[test]
fn empty_and_zero_depth_products() {
    let mut rng = fastrand::Rng::with_seed(3);
    for (m, n, k) in [(0, 5, 3), (5, 0, 3), (4, 6, 0), (1, 1, 0), (0, 0, 0)] {
        for accumulate in [false, true] {
            Case::packed(m, n, k, false, false, accumulate, false).run(&mut rng);
            Case::packed(m, n, k, true, true, accumulate, true).run(&mut rng);
        }
    }
}

/// Products large enough to take the parallel paths (rows, columns and depth splits) and several depth blocks.
#[test]
fn random_larger_products() {
    let mut rng = fastrand::Rng::with_seed(5);
    for _ in 0..40 {
        let (m, n, k) = (rng.usize(1..=300), rng.usize(1..=300), rng.usize(1..=1200));
        let case = Case::packed(m, n, k, rng.bool(), rng.bool(), rng.bool(), true);
        case.run(&mut rng);
    }
}

/// Reductions deeper than one block (384) on small and thin products, and thin products (n ≤ 16, computed
/// transposed when that is cheaper) with every layout.
#[test]
fn random_deep_and_thin_products() {
    let mut rng = fastrand::Rng::with_seed(13);
    for _ in 0..150 {
        let (m, n, k) = (rng.usize(1..=40), rng.usize(1..=80), rng.usize(385..=1000));
        Case::packed(m, n, k, rng.bool(), rng.bool(), rng.bool(), rng.bool()).run(&mut rng);
        let (m, n, k) = (rng.usize(1..=300), rng.usize(1..=16), rng.usize(1..=300));
        Case::packed(m, n, k, rng.bool(), rng.bool(), rng.bool(), rng.bool()).run(&mut rng);
    }
}

/// Thin products large enough to be computed as dot products in chunks of rows on the pool (C or Cᵀ of at most
/// 16 columns, with a long reduction), with every layout, strided, and as updates.
#[test]
fn random_thin_products_with_long_reductions() {
    let mut rng = fastrand::Rng::with_seed(19);
    for _ in 0..12 {
        let (thin, wide, k) = (rng.usize(1..=16), rng.usize(200..=700), rng.usize(64..=2000));
        let (m, n) = if rng.bool() { (wide, thin) } else { (thin, wide) };
        let mut case = Case::packed(m, n, k, rng.bool(), rng.bool(), rng.bool(), rng.bool());
        match rng.usize(0..3) {
            0 => {
                case.lda += rng.usize(1..5);
                case.ldb += rng.usize(1..5);
                case.ldc += rng.usize(1..5);
            }
            1 => (case.accumulate, case.alpha) = (true, rng.f32() * 4.0 - 2.0),
            _ => {}
        }
        case.run(&mut rng);
    }
}

/// Products split into chunks of rows, of columns and of the reduction, on pools of 1, 3 and 4 threads (the
/// calling thread is then a worker of the pool).
#[test]
fn products_on_other_pools() {
    let mut rng = fastrand::Rng::with_seed(17);
    let shapes = [
        (1000, 64, 200, false, false),
        (300, 100, 64, true, false),
        (128, 256, 256, false, true),
        (96, 200, 300, true, true),
        (32, 32, 6000, false, false),
        (20, 40, 5000, true, true),
        (50, 10, 3000, false, false),
    ];
    for threads in [1, 3, 4] {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| {
            for &(m, n, k, ta, tb) in &shapes {
                Case::packed(m, n, k, ta, tb, rng.bool(), true).run(&mut rng);
            }
        });
    }
}

/// The products of dfc's models: an MLP and logistic regression (batch 128 and 100) and a CNN (batch 64).
pub const SHAPES: &[(usize, usize, usize, bool, bool)] = &[
    (128, 256, 784, false, false),
    (128, 256, 256, false, false),
    (128, 10, 256, false, false),
    (128, 256, 10, false, true),
    (256, 10, 128, true, false),
    (128, 256, 256, false, true),
    (256, 256, 128, true, false),
    (784, 256, 128, true, false),
    (43264, 32, 9, false, false),
    (7744, 64, 288, false, false),
    (288, 64, 7744, true, false),
    (7744, 288, 64, false, true),
    (64, 64, 1600, false, false),
    (64, 10, 64, false, false),
    (64, 64, 10, false, true),
    (64, 64, 64, true, false),
    (1600, 64, 64, true, false),
    (64, 1600, 64, false, true),
    (100, 10, 784, false, false),
    (784, 10, 100, true, false),
];

#[test]
fn model_shapes() {
    let mut rng = fastrand::Rng::with_seed(1);
    for &(m, n, k, ta, tb) in SHAPES {
        for (accumulate, parallel) in [(false, true), (true, false)] {
            Case::packed(m, n, k, ta, tb, accumulate, parallel).run(&mut rng);
        }
    }
}

/// Products while runs hold the pool (`dfc_gemm::hold`): the workers that helped stay spinning for the next
/// product (thin ones, as dot products, share their rows with them), other rayon jobs still run meanwhile, and runs
/// holding it side by side on several threads each finish.
#[test]
fn products_while_the_pool_is_held() {
    use rayon::prelude::*;
    let mut rng = fastrand::Rng::with_seed(23);
    {
        let _hold = dfc_gemm::hold();
        for _ in 0..60 {
            let (m, n, k) = (rng.usize(100..=300), rng.usize(100..=300), rng.usize(100..=400));
            Case::packed(m, n, k, rng.bool(), rng.bool(), rng.bool(), true).run(&mut rng);
            thin_after_parallel(&mut rng);
            // A rayon job from this thread while a worker spins: the spinner runs it.
            let sum: u64 = (0..10_000u64).into_par_iter().sum();
            assert_eq!(sum, 49_995_000);
        }
    }
    std::thread::scope(|scope| {
        for seed in 0..3 {
            scope.spawn(move || {
                let mut rng = fastrand::Rng::with_seed(100 + seed);
                let _hold = dfc_gemm::hold();
                for _ in 0..20 {
                    let (m, n, k) = (rng.usize(100..=300), rng.usize(100..=300), rng.usize(100..=400));
                    Case::packed(m, n, k, rng.bool(), rng.bool(), rng.bool(), true).run(&mut rng);
                }
            });
        }
    });
}

/// A thin product (dot products) right after parallel ones, while the worker that helped with them spins: its rows
/// shared with the spinner (a classifier's logits after its hidden layer, in a step), against the naive product.
fn thin_after_parallel(rng: &mut fastrand::Rng) {
    let (m, n, k) = (rng.usize(100..=200), rng.usize(4..=16), rng.usize(200..=400));
    let (a, b) = (random(rng, m * k), random(rng, k * n));
    let (wide_a, wide_b, mut wide_c) = (random(rng, 200 * 300), random(rng, 300 * 200), vec![0f32; 200 * 200]);
    let mut c = vec![f32::NAN; m * n];
    for _ in 0..2 {
        dfc_gemm::sgemm(200, 200, 300, &wide_a, false, &wide_b, false, &mut wide_c, false, true);
    }
    dfc_gemm::sgemm(m, n, k, &a, false, &b, false, &mut c, false, true);
    for i in 0..m {
        for j in 0..n {
            let (want, size) = naive_sum(k, |p| f64::from(a[i * k + p]) * f64::from(b[p * n + j]));
            let got = f64::from(c[i * n + j]);
            assert!(
                (got - want).abs() <= 1e-5 * (1.0 + size),
                "{m}×{n}×{k} after parallel products at ({i}, {j}): {got} against {want}"
            );
        }
    }
}

/// The sum over p < k of `term(p)`, and of its magnitudes (what rounding errors are relative to).
fn naive_sum(k: usize, term: impl Fn(usize) -> f64) -> (f64, f64) {
    (0..k).map(term).fold((0.0, 0.0), |(sum, size), t| (sum + t, size + t.abs()))
}

/// Products of an A of bytes (`sgemm_fused`) against the naive product of A read through the scale: every
/// orientation, small and model-sized shapes (the MLP's first layer and its weights' gradient), each scale.
#[test]
fn products_of_bytes() {
    use dfc_gemm::{sgemm_fused, ByteScale, Epilogue, Left};
    let mut rng = fastrand::Rng::with_seed(25);
    let mut shapes: Vec<(usize, usize, usize)> =
        (0..60).map(|_| (rng.usize(1..=70), rng.usize(1..=90), rng.usize(1..=800))).collect();
    shapes.extend([(128, 256, 784), (784, 256, 128), (100, 10, 784), (13, 33, 17)]);
    for (case, &(m, n, k)) in shapes.iter().enumerate() {
        let (ta, parallel) = (rng.bool(), rng.bool());
        let scale = if rng.bool() { ByteScale::Div(255.0) } else { ByteScale::Mul(rng.f32() * 0.1) };
        let alpha = if case % 3 == 0 { Some(-0.01) } else { None };
        let a: Vec<u8> = (0..m * k).map(|_| rng.u8(..)).collect();
        let b = random(&mut rng, k * n);
        let c0 = random(&mut rng, m * n);
        let mut c = c0.clone();
        let rewritten = case % 3 == 1;
        sgemm_fused(
            m,
            n,
            k,
            Left::Bytes(&a, scale),
            ta,
            &b,
            false,
            &mut c,
            alpha,
            Epilogue::default(),
            rewritten,
            parallel,
        );
        let at = |i: usize, p: usize| f64::from(scale.apply(if ta { a[p * m + i] } else { a[i * k + p] }));
        for i in 0..m {
            for j in 0..n {
                let (sum, size) = naive_sum(k, |p| at(i, p) * f64::from(b[p * n + j]));
                let want = match alpha {
                    Some(alpha) => f64::from(c0[i * n + j]) + f64::from(alpha) * sum,
                    None => sum,
                };
                let got = f64::from(c[i * n + j]);
                assert!(
                    (got - want).abs() <= 1e-5 * (1.0 + size + f64::from(c0[i * n + j]).abs()),
                    "{m}×{n}×{k} (ta {ta}, {scale:?}, α {alpha:?}) at ({i}, {j}): {got} against {want}"
                );
            }
        }
    }
}

/// Products of bytes where many steps are zero in every row of a panel (the black borders of images, and whole
/// black images), which the AVX-512 kernels leave out: against the naive product, with ±∞ and NaN in some rows of
/// B, where those steps must still give NaN (0·∞), and with a scale that reads a byte 0 as NaN (0/0) in an A of
/// zeros, where nothing may be left out. Both orientations, model-sized and small, on the pool and on one thread.
#[test]
fn products_of_bytes_with_zero_steps() {
    use dfc_gemm::{sgemm_fused, ByteScale, Epilogue, Left};
    let mut rng = fastrand::Rng::with_seed(27);
    let mut shapes: Vec<(usize, usize, usize)> =
        (0..40).map(|_| (rng.usize(1..=90), rng.usize(1..=90), rng.usize(1..=900))).collect();
    shapes.extend([(128, 256, 784), (784, 256, 128), (64, 40, 784), (300, 64, 100)]);
    for (case, &(m, n, k)) in shapes.iter().enumerate() {
        let (ta, parallel) = (rng.bool(), rng.bool());
        let scale = match case % 5 {
            4 => ByteScale::Div(0.0),
            3 => ByteScale::Mul(-0.5),
            _ => ByteScale::Div(255.0),
        };
        // Row i of A (an image) over steps p (its pixels): zero near the ends of each 28-step "row", zero for
        // every fourth image, and otherwise half zero at random.
        let value = |rng: &mut fastrand::Rng, i: usize, p: usize| {
            let border = p % 28 < 3 || p % 28 >= 25 || p < 56;
            if border || i % 4 == 3 || rng.bool() {
                0
            } else {
                rng.u8(1..)
            }
        };
        let mut a = vec![0u8; m * k];
        for i in 0..m {
            for p in 0..k {
                a[if ta { p * m + i } else { i * k + p }] = value(&mut rng, i, p);
            }
        }
        if case % 5 == 4 {
            // Every byte 0, each read as NaN: every element of C is NaN.
            a.fill(0);
        }
        let mut b = random(&mut rng, k * n);
        // Non-finite elements in a few rows, some of them rows of all-zero steps (the borders).
        for (p, x) in [(0, f32::INFINITY), (1, f32::NAN), (k / 2, f32::NEG_INFINITY), (k - 1, f32::NAN)] {
            if p < k && case % 2 == 0 {
                b[p * n + rng.usize(..n)] = x;
            }
        }
        let mut c = random(&mut rng, m * n);
        let rewritten = case % 3 == 1;
        sgemm_fused(
            m,
            n,
            k,
            Left::Bytes(&a, scale),
            ta,
            &b,
            false,
            &mut c,
            None,
            Epilogue::default(),
            rewritten,
            parallel,
        );
        let at = |i: usize, p: usize| f64::from(scale.apply(if ta { a[p * m + i] } else { a[i * k + p] }));
        for i in 0..m {
            for j in 0..n {
                let (sum, size) = naive_sum(k, |p| at(i, p) * f64::from(b[p * n + j]));
                let got = f64::from(c[i * n + j]);
                let agree = if sum.is_nan() || sum.is_infinite() {
                    got.to_bits() == sum.to_bits() || (got.is_nan() && sum.is_nan())
                } else {
                    (got - sum).abs() <= 1e-5 * (1.0 + size)
                };
                assert!(agree, "{m}×{n}×{k} (ta {ta}, {scale:?}) at ({i}, {j}): {got} against {sum}");
            }
        }
    }
}

/// Products with an epilogue (`sgemm_fused`: the bias of each column, then the relu, then the mask) against the naive product
/// followed by the epilogue: thin and wide, deep (several blocks of the reduction) and shallow, of floats and of
/// bytes, on the pool and on one thread, B rewritten between calls or not (the MLP's first layer in a training step). NaN and -0 pass the relu as the interpreter's does; a mask of NaN, -0 or
/// 0 zeroes. The column sums (`Epilogue::col_sums`, in half the cases, alone in some) against C's columns summed
/// in order of rows: the same bits on one thread, within rounding on the pool (chunks of rows add their sums).
#[test]
fn products_with_an_epilogue() {
    use dfc_gemm::{sgemm_fused, ByteScale, Epilogue, Left};
    let mut rng = fastrand::Rng::with_seed(26);
    let mut shapes: Vec<(usize, usize, usize)> =
        (0..60).map(|_| (rng.usize(1..=70), rng.usize(1..=90), rng.usize(0..=900))).collect();
    shapes.extend([(128, 256, 784), (128, 256, 256), (128, 10, 256), (128, 256, 10), (1, 256, 784), (5, 3, 0)]);
    for (case, &(m, n, k)) in shapes.iter().enumerate() {
        let (ta, tb, parallel, relu, bytes) = (rng.bool(), rng.bool(), rng.bool(), rng.bool(), rng.bool());
        // The first layer of a training step (its weights rewritten between steps), on the pool: split along the
        // reduction, the epilogue after the sum.
        let (ta, parallel, bytes, rewritten) = match case {
            60 => (false, true, true, true),
            _ => (ta, parallel, bytes, case % 2 == 0),
        };
        let mut bias = random(&mut rng, n);
        if n > 2 {
            bias[0] = f32::NAN;
            bias[1] = -0.0;
        }
        let with_bias = rng.bool() || !relu;
        let floats = random(&mut rng, m * k);
        let scale = ByteScale::Div(255.0);
        let raw: Vec<u8> = (0..m * k).map(|_| rng.u8(..)).collect();
        let a: Vec<f32> = if bytes { raw.iter().map(|&e| scale.apply(e)).collect() } else { floats.clone() };
        let b = random(&mut rng, k * n);
        let mut c = random(&mut rng, m * n);
        let left = if bytes { Left::Bytes(&raw, scale) } else { Left::Floats(&floats) };
        let mut mask = random(&mut rng, m * n);
        if m * n > 3 {
            mask[0] = f32::NAN;
            mask[1] = -0.0;
            mask[2] = 0.0;
        }
        let masked = rng.bool();
        // Column sums alone too: a product that only sums.
        let (with_bias, relu, masked) = if case % 7 == 3 { (false, false, false) } else { (with_bias, relu, masked) };
        let summed = case % 7 == 3 || rng.bool();
        let mut sums = vec![7.0f32; n + 1];
        let epilogue = Epilogue {
            bias: with_bias.then_some(&bias[..]),
            relu,
            mask: masked.then_some(&mask[..]),
            col_sums: summed.then_some(&mut sums[..n]),
        };
        sgemm_fused(m, n, k, left, ta, &b, tb, &mut c, None, epilogue, rewritten, parallel);
        if summed {
            assert_eq!(sums[n], 7.0, "{m}×{n}×{k}: a sum past n");
            for j in 0..n {
                let in_order = (0..m).fold(0f32, |s, i| s + c[i * n + j]);
                let size: f32 = (0..m).map(|i| c[i * n + j].abs()).sum();
                let (got, what) = (sums[j], format!("{m}×{n}×{k} (parallel {parallel}): column {j}'s sum"));
                if in_order.is_nan() {
                    assert!(got.is_nan(), "{what}: {got} against NaN");
                } else if !parallel {
                    assert_eq!(got.to_bits(), in_order.to_bits(), "{what}: {got} against {in_order}");
                } else {
                    assert!((got - in_order).abs() <= 1e-6 * size, "{what}: {got} against {in_order}");
                }
            }
        }
        for i in 0..m {
            for j in 0..n {
                let (mut sum, mut size) = (0f64, 0f64);
                for p in 0..k {
                    let x = if ta { a[p * m + i] } else { a[i * k + p] };
                    let y = if tb { b[j * k + p] } else { b[p * n + j] };
                    sum += f64::from(x) * f64::from(y);
                    size += (f64::from(x) * f64::from(y)).abs();
                }
                let mut want = sum as f32;
                if with_bias {
                    want += bias[j];
                }
                if relu && 0.0 > want {
                    want = 0.0;
                }
                if masked && mask[i * n + j].partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
                    want = 0.0;
                }
                let got = c[i * n + j];
                let what = format!(
                    "{m}×{n}×{k} (ta {ta}, tb {tb}, bytes {bytes}, relu {relu}, bias {with_bias}, mask {masked}) at ({i}, {j})"
                );
                if want.is_nan() {
                    assert!(got.is_nan(), "{what}: {got} against NaN");
                } else if want == 0.0 && (masked || relu) {
                    // Zeroed (or the relu's 0): only a sum of the same sign can be near it.
                    let tolerance = 1e-5 * (1.0 + size);
                    assert!(f64::from(got.abs()) <= tolerance, "{what}: {got} against 0");
                } else {
                    let tolerance = 1e-5 * (1.0 + size + if with_bias { f64::from(bias[j]).abs() } else { 0.0 });
                    assert!(f64::from((got - want).abs()) <= tolerance, "{what}: {got} against {want}");
                }
            }
        }
    }
}

/// Products with a B laid out once (`pack_b`, `sgemm_packed`: a Winograd convolution's transformed filters) against
/// the naive product, and to the bit against `sgemm` where it computes the same tiles (at least 4 rows, and C wide
/// enough that it is neither transposed nor taken as dot products): edges of the tiles, reductions of several
/// blocks, no steps, a buffer that starts off a 32-byte boundary.
#[test]
fn products_with_a_b_packed_once() {
    use dfc_gemm::{pack_b, packed_b_len, sgemm_packed};
    let mut rng = fastrand::Rng::with_seed(41);
    let mut shapes: Vec<(usize, usize, usize)> =
        (0..60).map(|_| (rng.usize(4..=50), rng.usize(17..=70), rng.usize(1..=80))).collect();
    // The CNN's conv2 (36 tiles, 32 channels, 64 filters), a reduction of 3 blocks, one of 230 steps (one block
    // where L1d holds 48 KiB, two elsewhere), an odd one, none.
    shapes.extend([(36, 64, 32), (24, 40, 600), (30, 40, 230), (37, 33, 17), (8, 20, 0)]);
    for (m, n, k) in shapes {
        let (a, b) = (random(&mut rng, m * k), random(&mut rng, k * n));
        let mut buf = vec![f32::NAN; packed_b_len(k, n) + 1];
        let offset = rng.usize(0..2);
        let packed = pack_b(k, n, &b, &mut buf[offset..]);
        let mut c = vec![f32::NAN; m * n];
        sgemm_packed(m, &a, &packed, &mut c);
        let mut want = vec![f32::NAN; m * n];
        sgemm(m, n, k, &a, false, &b, false, &mut want, false, false);
        for (x, (got, want)) in c.iter().zip(&want).enumerate() {
            assert_eq!(got.to_bits(), want.to_bits(), "{m}×{n}×{k}: c[{x}] {got} ≠ sgemm's {want}");
            let (i, j) = (x / n, x % n);
            let (sum, size) = naive_sum(k, |p| f64::from(a[i * k + p]) * f64::from(b[p * n + j]));
            assert!((f64::from(*got) - sum).abs() <= 1e-4 * size + 1e-30, "{m}×{n}×{k}: c[{i}][{j}] {got}, want {sum}");
        }
    }
}
