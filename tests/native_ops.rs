//! Every op on the LLVM backend, and placed on a GPU under the grid emulator, against the
//! reference interpreter: each expression below is a one-output model run forward on both, on
//! random inputs (broadcasting, every element type, fused chains, reductions over each axis,
//! row ops, matrix products, convolution, pooling, layout ops).
//!
//! Tolerances: floats within 1e-6 relative (the same operations in the same order; products
//! and convolutions within 1e-5, GEMM sums in blocks); integers and booleans exactly.

use dfc_compile::{compile, CompileOptions};
use dfc_driver::{Backend, Session};
use dfc_interp::Tensor;
use dfc_ir::{Cluster, DType, DeviceKind};
use std::collections::HashMap;

const DECLS: &str = "
    input a: f32[3,4]
    input b: f32[4]
    input p: f32[3,4]
    input i: i32[3,4]
    input j: i32[4]
    input u: u8[3,4]
    input k: i32[3]
    input d: f64[3,4]
    input m: f32[2,4,5]
    input n: f32[5,3]
    input o: f32[3,5]
    input img: f32[2,6,6,3]
    input f: f32[3,3,3,4]
    input table: f32[6,4]
    input wide: f32[3,20]
    input wide_i: i32[3,20]
    input long: f32[3,300]
    input long_i: i32[3,300]
    input deep: f32[2,3,200]
    input many: i32[3]
";

const EXPRESSIONS: &[&str] = &[
    // elementwise, f32, with broadcasting
    "-a",
    "abs(a)",
    "relu(a)",
    "exp(a)",
    "log(p)",
    "sqrt(p)",
    "rsqrt(p)",
    "sigmoid(a * 8.0)",
    "tanh(a)",
    "gelu(a)",
    "gelu(a * 3.0) * b",
    // Philox bits: the fused kernels' must be the interpreter's, bit for bit
    "random_uniform([3, 4])",
    "random_uniform([2, 4, 5]) * m + 1.0",
    "random_uniform([101]) - random_uniform([101])",
    "random_normal([3, 4])",
    "random_normal([2, 4, 5], mean = 1.0, stddev = 0.5) * m",
    "random_normal([101]) + random_uniform([101])",
    "random_uniform([]) * 2.0 + random_normal([])",
    "a + b",
    "a - b",
    "a * b",
    "a / p",
    "pow(p, b)",
    "maximum(a, b)",
    "minimum(a, b)",
    "relu(a * 2.0 + b) - 0.5",
    "select(a > b, a, b * 3.0)",
    "stop_gradient(a) + identity(b)",
    "sigmoid_cross_entropy(a, sigmoid(b) + a * 0.0)",
    // comparisons and booleans
    "a == b",
    "a != b",
    "a < b",
    "a <= b",
    "a > b",
    "a >= b",
    "(a > 0.0) == (b > 0.0)",
    // integers and bytes
    "i + j",
    "i - j",
    "i * j",
    "maximum(i, j)",
    "minimum(i, j)",
    "-i",
    "abs(i)",
    "relu(i)",
    "i / (abs(j) + 1)",
    "u + u",
    "maximum(u, u * 2)",
    "u > u * 2",
    // casts
    "cast<f32>(u) / 255.0",
    "cast<i32>(a * 100.0)",
    "cast<u8>(a * 300.0)",
    "cast<bool>(a)",
    "cast<f64>(a)",
    "cast<f32>(d) + a",
    "cast<i64>(i) * 3",
    "cast<f32>(a > b)",
    "cast<u8>(i)",
    // f64
    "exp(d) * 2.0 - d",
    "softmax(d)",
    // reductions
    "sum(a)",
    "sum(a, axis = 0)",
    "sum(a, axis = 1)",
    "sum(a * b, axis = 1, keep_dims = true)",
    "mean(a)",
    "mean(exp(a), axis = 0)",
    "max(a, axis = 1)",
    "min(a, axis = 0)",
    "max(i)",
    "sum(i, axis = 1)",
    "sum(m, axis = [0, 2])",
    "mean(m, axis = 1)",
    "max(m, axis = [1, 2])",
    // a scalar's reductions, whose one output is set anew at each run
    "sum(sum(a)) + mean(max(a))",
    "min(min(a) * 2.0)",
    // row ops
    "softmax(a)",
    "log_softmax(a * b)",
    "argmax(a)",
    "argmax<i64>(a - b)",
    "argmax(i)",
    "softmax_cross_entropy(a, one_hot(k, 4))",
    "one_hot(k, 4)",
    "one_hot<f64>(k, 5)",
    "cast<f32>(range(4)) * b",
    "select(range(4) <= reshape(range(3), [3, 1]), a, -1.0)",
    "range<f64>(5) + 0.5",
    "softmax(m)",
    "softmax(a, axis = 0)",
    "layer_norm(a)",
    // one row: a vector's row ops
    "softmax(b)",
    "log_softmax(b * 2.0)",
    "layer_norm(b)",
    "argmax(b)",
    "softmax_cross_entropy(b, softmax(b * 3.0))",
    "layer_norm(d * 3.0, epsilon = 0.1)",
    "layer_norm(m) * sum(n, axis = 1) + 1.0",
    // rows longer than codegen writes out in full (`UNROLLED_MAX`, 16): loops instead
    "softmax(wide)",
    "log_softmax(wide * 2.0)",
    "layer_norm(wide)",
    "argmax(wide)",
    "argmax(wide_i)",
    "softmax_cross_entropy(wide, one_hot(k, 20))",
    "sum(wide, axis = 1)",
    "max(wide, axis = 1)",
    // rows of at least `BLOCK_ROW_MIN` (128) elements: one row per block on a GPU
    "softmax(long)",
    "log_softmax(long * 2.0 - 1.0)",
    "argmax(long)",
    "argmax(long_i)",
    "argmax(minimum(long, 0.5))",
    "softmax_cross_entropy(long, one_hot(many, 300))",
    "softmax(deep)",
    "argmax(deep)",
    "layer_norm(long * 2.0 - 1.0)",
    "layer_norm(deep)",
    // matrix products
    "a @ slice(n, [0, 0], [4, 3]) + 1.0",
    "matmul(a, a, transpose_b = true)",
    "matmul(a, a, transpose_a = true)",
    "m @ n",
    "matmul(m, o, transpose_b = true)",
    "relu(m @ n) + 1.0",
    "matmul(m, m, transpose_b = true)",
    // convolution and pooling
    "conv2d(img, f)",
    "conv2d(img, f, strides = 2, padding = \"same\")",
    "relu(conv2d(img, f) + b)",
    "max_pool(img)",
    "max_pool(img, window = 3, strides = 2, padding = \"same\")",
    "avg_pool(img, window = 2)",
    "avg_pool(img, window = 3, strides = 2, padding = \"same\")",
    // layout
    "transpose(a)",
    "transpose(m, perm = [2, 0, 1])",
    "concat([a, a * 2.0], axis = 1)",
    "slice(a, [1, 0], [2, 3])",
    "reshape(a, [4, 3]) * 2.0",
    "flatten(m) + 1.0",
    "gather(table, k)",
    "gather(table, j) * 2.0",
];

fn feeds(rng: &mut fastrand::Rng, plan: &dfc_plan::Plan) -> HashMap<String, Tensor> {
    plan.inputs
        .iter()
        .map(|input| {
            let n = input.ty.shape.n_elements();
            let dims = input.ty.shape.dims().to_vec();
            let tensor = match (input.name.as_str(), input.ty.dtype) {
                ("p", _) => Tensor::from_vec(dims, (0..n).map(|_| 0.1 + rng.f32() * 2.0).collect::<Vec<f32>>()),
                ("k" | "j", _) => Tensor::from_vec(dims, (0..n).map(|_| rng.i32(0..4)).collect::<Vec<i32>>()),
                ("many", _) => Tensor::from_vec(dims, (0..n).map(|_| rng.i32(0..300)).collect::<Vec<i32>>()),
                (_, DType::F32) => Tensor::from_vec(dims, (0..n).map(|_| rng.f32() * 4.0 - 2.0).collect::<Vec<f32>>()),
                (_, DType::F64) => Tensor::from_vec(dims, (0..n).map(|_| rng.f64() * 4.0 - 2.0).collect::<Vec<f64>>()),
                (_, DType::I32) => Tensor::from_vec(dims, (0..n).map(|_| rng.i32(-50..50)).collect::<Vec<i32>>()),
                (_, DType::U8) => Tensor::from_vec(dims, (0..n).map(|_| rng.u8(..)).collect::<Vec<u8>>()),
                (_, other) => panic!("no data for {other}"),
            };
            (input.name.clone(), tensor)
        })
        .collect()
}

/// Each expression as a one-output model, compiled for `cluster`, run on `backend` and on the
/// interpreter over three random feeds: the expressions whose results disagree.
fn disagreements(cluster: Cluster, backend: Backend) -> Vec<String> {
    let mut rng = fastrand::Rng::with_seed(3);
    let mut failures = Vec::new();
    let options = CompileOptions { cluster, soft_placement: true, ..CompileOptions::default() };
    for expression in EXPRESSIONS {
        let source = format!("model t {{\n{DECLS}\n    let y = {expression}\n    output y\n}}\n");
        let plan = match compile(&source, "t.df", &options) {
            Ok(compiled) => {
                let mut plan = compiled.plan;
                plan.expand_instances().expect("replica instances build");
                plan
            }
            Err(e) => panic!("`{expression}` does not compile: {e:?}"),
        };
        // One session per backend for the three feeds: a run must not see the last one's values.
        let mut sessions: Vec<_> = [Backend::Interp, backend]
            .into_iter()
            .map(|backend| {
                let session = Session::with_backend(&plan, 0, backend).unwrap();
                let program = session.program(&["y"], &[]).unwrap();
                (session, program)
            })
            .collect();
        for _ in 0..3 {
            let data = feeds(&mut rng, &plan);
            let mut results =
                sessions.iter_mut().map(|(session, program)| session.run(program, &data).unwrap().remove(0));
            let (reference, native) = (results.next().unwrap(), results.next().unwrap());
            let tolerance = if expression.contains('@') || expression.contains("matmul") || expression.contains("conv")
            {
                1e-5
            } else {
                1e-6
            };
            let agree = reference.ty() == native.ty()
                && match reference.ty().dtype {
                    DType::F32 | DType::F64 => reference
                        .to_f64_vec()
                        .iter()
                        .zip(native.to_f64_vec())
                        // Equal types, so equal lengths; NaN in both is the same result (an op's
                        // edge case, such as the log of a negative), NaN in one alone fails.
                        .all(|(x, y)| (x - y).abs() <= tolerance * (1.0 + x.abs()) || (x.is_nan() && y.is_nan())),
                    _ => reference == native,
                };
            if !agree {
                failures.push(format!("`{expression}`:\n  interpreter {:?}\n  {backend:?} {:?}", reference, native));
                break;
            }
        }
    }
    failures
}

#[test]
fn every_op_agrees_with_the_interpreter() {
    let failures = disagreements(Cluster::local(1, DeviceKind::Cpu), Backend::Llvm);
    assert!(failures.is_empty(), "{} of {} ops disagree:\n{}", failures.len(), EXPRESSIONS.len(), failures.join("\n"));
}

/// Every op placed on a GPU, run by the grid emulator on its emulated device: the fused
/// kernels' and window kernels' (convolution, pooling) launches thread by thread in a shuffled
/// order, the products as GEMMs, the rest on the host.
#[test]
fn every_op_agrees_with_the_interpreter_on_the_grid_emulator() {
    let failures = disagreements(Cluster::local(1, DeviceKind::Gpu), Backend::GridEmulator);
    assert!(failures.is_empty(), "{} of {} ops disagree:\n{}", failures.len(), EXPRESSIONS.len(), failures.join("\n"));
}

/// `gelu` is the tanh form JAX computes by default (`jax.nn.gelu(x, approximate=True)`): its
/// values at a few points, computed with that formula in f64, and its fused kernel on the
/// CPU agrees.
#[test]
fn gelu_is_the_tanh_form() {
    let source = "model g {\n    input x: f32[5]\n    let y = gelu(x)\n    output y\n}\n";
    let plan = compile(source, "g.df", &CompileOptions::default()).expect("compiles").plan;
    let x = [-3.0f32, -1.0, 0.0, 1.0, 3.0];
    // 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), to 6 places.
    let expected = [-0.003637, -0.158808, 0.0, 0.841192, 2.996363];
    for backend in [Backend::Interp, Backend::Llvm] {
        let mut session = Session::with_backend(&plan, 0, backend).unwrap();
        let program = session.program(&["y"], &[]).unwrap();
        let feeds = HashMap::from([("x".to_string(), Tensor::from_vec(vec![5], x.to_vec()))]);
        let y = session.run(&program, &feeds).unwrap().remove(0).to_f64_vec();
        for (got, want) in y.iter().zip(expected) {
            assert!((got - want).abs() < 2e-6, "{backend:?}: {y:?} against {expected:?}");
        }
        if backend == Backend::Llvm {
            assert_eq!(program.library_ops(), Vec::<String>::new(), "gelu runs natively");
        }
    }
}

/// `y = op(x)` run natively on `x`, and the ops of its program that ran in the library (not natively).
fn native_unary(op: &str, x: &[f32]) -> (Vec<f64>, Vec<String>) {
    native_unary_of(op, Tensor::from_vec(vec![x.len()], x.to_vec()))
}

/// `y = op(x)` run natively on `x` of any float type.
fn native_unary_of(op: &str, x: Tensor) -> (Vec<f64>, Vec<String>) {
    let ty = format!("{}[{}]", x.dtype().name(), x.len());
    let source = format!("model g {{\n    input x: {ty}\n    let y = {op}(x)\n    output y\n}}\n");
    let plan = compile(&source, "g.df", &CompileOptions::default()).expect("compiles").plan;
    let mut session = Session::with_backend(&plan, 0, Backend::Llvm).unwrap();
    let program = session.program(&["y"], &[]).unwrap();
    let feeds = HashMap::from([("x".to_string(), x)]);
    let y = session.run(&program, &feeds).unwrap().remove(0).to_f64_vec();
    (y, program.library_ops())
}

/// Ulps between two f64 of one sign (or zero).
fn ulps64(a: f64, b: f64) -> u64 {
    (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs()
}

/// f64 `exp` is a polynomial with the exponent built from bits, the code a GPU runs (PTX has no
/// f64 `ex2`; `tests/random_programs.rs` assembles it): within 2 ulp of Rust's `exp` wherever that
/// is a normal float, within a step of the subnormals below, +∞ above 709.79, 0 below -745.2,
/// NaN for NaN.
#[test]
fn native_f64_exp_is_within_two_ulps() {
    let mut x: Vec<f64> = (-750 * 64..=712 * 64).map(|i| i as f64 / 64.0).collect();
    x.extend((-20_000..20_000).map(|i| i as f64 * 1.234_567e-4));
    x.extend([-0.0, 1e-300, -1e-17, 709.78, 709.7827, 709.79, -708.39, -745.13, -745.2, -1e10, 1e10]);
    x.extend([f64::INFINITY, f64::NEG_INFINITY, f64::NAN, f64::MIN_POSITIVE, f64::MAX, f64::MIN]);
    let (y, library_ops) = native_unary_of("exp", Tensor::from_vec(vec![x.len()], x.clone()));
    for (&x, y) in x.iter().zip(y) {
        let want = x.exp();
        if x.is_nan() {
            assert!(y.is_nan(), "exp(NaN) = {y}");
        } else if want == f64::INFINITY || want == 0.0 {
            assert!(y == want || (want == 0.0 && y <= 5e-324), "exp({x}) = {y}, not {want}");
        } else if want < f64::MIN_POSITIVE {
            assert!(y == 0.0 || (y - want).abs() <= 5e-324, "exp({x}) = {y}, not {want}");
        } else {
            assert!(ulps64(y, want) <= 2, "exp({x}) = {y:e}, not {want:e}: {} ulp", ulps64(y, want));
        }
    }
    assert_eq!(library_ops, Vec::<String>::new(), "exp runs natively");
}

/// f64 `ln` is a series in bits and multiplies, the code a GPU runs (PTX has no f64 `lg2`):
/// within 2 ulp of Rust's `ln` over every binade, -∞ at ±0 and at subnormals (which native runs
/// read as 0), NaN below 0, +∞ at +∞.
#[test]
fn native_f64_log_is_within_two_ulps() {
    // 64 mantissas in each of the 2047 exponent fields (0: the subnormals).
    let mantissa = |i: u64| i * ((1 << 52) / 64) + i * i * 977;
    let mut x: Vec<f64> =
        (0..2047u64).flat_map(|field| (0..64).map(move |i| f64::from_bits(field << 52 | mantissa(i)))).collect();
    x.extend((1..40_000).map(|i| 0.5 + i as f64 * 3.7e-5));
    x.extend([0.0, -0.0, -1.0, -1e-310, 1.0, f64::MAX, f64::MIN_POSITIVE, 5e-324, std::f64::consts::SQRT_2]);
    x.extend([f64::from_bits(3), f64::from_bits(0xf_ffff), f64::INFINITY, f64::NEG_INFINITY, f64::NAN]);
    let (y, library_ops) = native_unary_of("log", Tensor::from_vec(vec![x.len()], x.clone()));
    for (&x, y) in x.iter().zip(y) {
        let want = x.ln();
        if x != 0.0 && x.abs() < f64::MIN_POSITIVE && y == f64::NEG_INFINITY {
            // A subnormal reads as ±0 in native runs (`denormals.rs`); a GPU scales it by 2⁵⁴.
        } else if want.is_nan() {
            assert!(y.is_nan(), "ln({x}) = {y}");
        } else if want.is_infinite() || want == 0.0 {
            assert_eq!(y, want, "ln({x})");
        } else {
            assert!(
                ulps64(y, want) <= 2 || (y - want).abs() <= 1e-16,
                "ln({x:e}) = {y:e}, not {want:e}: {} ulp",
                ulps64(y, want)
            );
        }
    }
    assert_eq!(library_ops, Vec::<String>::new(), "log runs natively");
}

/// Native f32 `tanh` is a rational approximation (it vectorises, where libm's is a call per
/// element): within 5e-7 of f64 tanh from -12 to 12 in steps of 1/1024, exact at 0, x itself
/// for tiny x, ±1 for large and infinite x, NaN for NaN.
#[test]
fn native_tanh_is_close_everywhere() {
    let mut x: Vec<f32> = (-12 * 1024..=12 * 1024).map(|i| i as f32 / 1024.0).collect();
    x.extend([1e-30, -3e-5, 3.9e-4, 4.1e-4, 7.9, 7.91, 100.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN]);
    let (y, library_ops) = native_unary("tanh", &x);
    for (&x, y) in x.iter().zip(y) {
        let want = (x as f64).tanh();
        if x.is_nan() {
            assert!(y.is_nan(), "tanh(NaN) = {y}");
        } else {
            assert!((y - want).abs() <= 5e-7, "tanh({x}) = {y}, not {want}");
            assert!(y.abs() <= 1.0, "tanh({x}) = {y}");
        }
    }
    assert_eq!(library_ops, Vec::<String>::new(), "tanh runs natively");
}

/// Native f32 `exp` is a polynomial with the exponent built from bits (it vectorises, where
/// `llvm.exp` is a call of `expf` per element on x86): within 1 ulp of f64 exp wherever that is
/// a normal float (-110 to 90 in steps of 1/256, and at the edges), a subnormal or 0 (native
/// kernels flush subnormal results: `denormals.rs`) below, +∞ above 88.73, NaN for NaN.
#[test]
fn native_exp_is_within_an_ulp() {
    let mut x: Vec<f32> = (-110 * 256..=90 * 256).map(|i| i as f32 / 256.0).collect();
    x.extend([-0.0, 1e-30, -87.33, -87.34, 88.72, 88.7228, 88.73, -103.97, -104.0, -1e10, 1e10]);
    x.extend([f32::INFINITY, f32::NEG_INFINITY, f32::NAN, f32::MIN_POSITIVE]);
    let (y, library_ops) = native_unary("exp", &x);
    for (&x, y) in x.iter().zip(y) {
        let want = (x as f64).exp();
        let y = y as f32;
        if x.is_nan() {
            assert!(y.is_nan(), "exp(NaN) = {y}");
        } else if want as f32 == f32::INFINITY || want == 0.0 {
            assert_eq!(y, want as f32, "exp({x})");
        } else if (want as f32) < f32::MIN_POSITIVE {
            assert!(y == 0.0 || (f64::from(y) - want).abs() <= 1.5e-45, "exp({x}) = {y}, not {want}");
        } else {
            let ulps = (i64::from(y.to_bits()) - i64::from((want as f32).to_bits())).abs();
            assert!(ulps <= 1, "exp({x}) = {y}, not {want}: {ulps} ulp");
        }
    }
    assert_eq!(library_ops, Vec::<String>::new(), "exp runs natively");
}
