//! Differential tests of the LLVM backend against the reference interpreter: every example's
//! forward pass (outputs, loss, metrics) and training steps, on one device and partitioned;
//! and of GPU plans run by the grid emulator (their GPU kernels, thread by thread, on this CPU).
//!
//! Tolerances: f32 results within 1e-5 relative (matrix products and convolutions sum in
//! another order than the interpreter; elementwise kernels and reductions sum in its order);
//! integer and boolean results exactly; resnet within 1e-3 (`DEEP_TOLERANCE` says why).

use dfc_compile::{compile, CompileOptions, Strategy};
use dfc_driver::{Backend, Session};
use dfc_interp::Tensor;
use dfc_ir::{Cluster, DType, DeviceKind};
use dfc_plan::Plan;
use std::collections::HashMap;
use std::path::PathBuf;

const STEPS: usize = 3;
/// Every example of `examples/`.
const EXAMPLES: [&str; 10] = [
    "softmax_regression",
    "mlp",
    "cnn",
    "linear_regression",
    "ridge_regression",
    "wide_and_deep",
    "mlp_dropout",
    "two_towers",
    "resnet",
    "transformer",
];
const F32_TOLERANCE: f64 = 1e-5;
/// On a GPU: exp and log are PTX's approximations, and products sum in cuBLAS's order.
const GPU_F32_TOLERANCE: f64 = 1e-4;
/// resnet's fifteen convolutions with batch norms and ReLUs: a product summed in another order
/// moves a pre-activation within rounding of zero to the other side of its ReLU, and batch
/// norm's gradient (g − mean g − x̂·mean(g·x̂)) cancels, so differences of one rounding grow
/// with depth: after three SGD steps on the CPU, 1e-4 (a block or two of the same layers agree
/// within 2e-6, `conv_bn` alone within 1e-7).
const DEEP_TOLERANCE: f64 = 1e-3;

#[path = "support/avx2_rerun.rs"]
mod avx2_rerun;
#[path = "support/skip.rs"]
mod skip;

fn plan(example: &str, cluster: Cluster, strategy: Strategy) -> Plan {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples").join(format!("{example}.df"));
    let source = std::fs::read_to_string(&path).expect("example");
    plan_of(&source, example, cluster, strategy)
}

fn plan_of(source: &str, example: &str, cluster: Cluster, strategy: Strategy) -> Plan {
    plan_with_dims(source, example, cluster, strategy, None)
}

/// `plan_of` with `dims` set where given, else the example's test dims.
fn plan_with_dims(
    source: &str,
    example: &str,
    cluster: Cluster,
    strategy: Strategy,
    dims: Option<Vec<(String, i64)>>,
) -> Plan {
    let dims: Vec<(String, i64)> = dims.unwrap_or_else(|| match example {
        "cnn" => vec![("batch".into(), 8)],
        "wide_and_deep" => vec![("users".into(), 200)],
        // Small batches, so that the interpreter's steps are quick.
        "resnet" | "two_towers" => vec![("batch".into(), 8)],
        "transformer" => vec![("batch".into(), 4)],
        _ => vec![],
    });
    // Adam moves every weight by about ±lr on its first steps, whatever the size of its
    // gradient, so in a network whose batch norms leave many gradients near zero (resnet) it
    // turns rounding differences into whole steps: compare such a network's training with SGD.
    let optimizer = (example == "resnet").then(|| dfc_sema::check_optimizer("sgd(lr = 0.01)").expect("an optimizer"));
    let options = CompileOptions {
        sema: dfc_sema::Options { dims, optimizer },
        cluster,
        strategy,
        soft_placement: true,
        ..CompileOptions::default()
    };
    compile(source, &format!("{example}.df"), &options).unwrap_or_else(|e| panic!("{example}: {e:?}")).plan
}

fn batches(plan: &Plan) -> Vec<HashMap<String, Tensor>> {
    let mut rng = fastrand::Rng::with_seed(7);
    (0..STEPS)
        .map(|_| {
            plan.inputs
                .iter()
                .map(|input| {
                    let n = input.ty.shape.n_elements();
                    let dims = input.ty.shape.dims().to_vec();
                    let tensor = match input.ty.dtype {
                        DType::I32 => Tensor::from_vec(dims, (0..n).map(|_| rng.i32(0..10)).collect::<Vec<i32>>()),
                        DType::I64 => Tensor::from_vec(dims, (0..n).map(|_| rng.i64(0..10)).collect::<Vec<i64>>()),
                        DType::U8 => Tensor::from_vec(dims, (0..n).map(|_| rng.u8(..)).collect::<Vec<u8>>()),
                        DType::F32 => {
                            Tensor::from_vec(dims, (0..n).map(|_| rng.f32() * 2.0 - 1.0).collect::<Vec<f32>>())
                        }
                        other => panic!("no test data for {other} inputs"),
                    };
                    (input.name.clone(), tensor)
                })
                .collect()
        })
        .collect()
}

/// Per step: the forward pass's outputs, loss and metrics, then the training step's loss;
/// at the end every variable.
fn run(plan: &Plan, backend: Backend, data: &[HashMap<String, Tensor>]) -> (Vec<Tensor>, Vec<(String, Tensor)>) {
    let training = plan.training.as_ref().expect("examples train");
    let mut session = Session::with_backend(plan, 0, backend).expect("the plan loads");
    let updates: Vec<&str> = training.updates.iter().map(String::as_str).collect();
    let step = session.program(&[training.loss_node.as_str()], &updates).expect("a training step");
    let mut forward_names: Vec<&str> = plan.outputs.iter().map(|o| o.name.as_str()).collect();
    forward_names.extend(plan.metrics.iter().map(|m| m.name.as_str()));
    forward_names.push(training.loss_node.as_str());
    let forward = session.program(&forward_names, &[]).expect("a forward pass");
    if backend == Backend::GridEmulator {
        // On a GPU everything runs on the device but the exchanges between devices (and a
        // learning-rate schedule's one scalar a step).
        for (what, program) in [("training step", &step), ("forward pass", &forward)] {
            let host = program.host_steps();
            let exchanges = ["send", "recv", "all_reduce", "learning_rate"];
            assert!(
                host.iter().all(|s| exchanges.contains(&s.as_str())),
                "{}: {what} on the host: {host:?}",
                plan.model
            );
        }
    }
    if backend == Backend::Llvm && ["mlp", "cnn", "softmax_regression"].contains(&plan.model.as_str()) {
        // The standard models run every op natively.
        assert_eq!(step.library_ops(), Vec::<String>::new(), "{}: training step", plan.model);
        assert_eq!(forward.library_ops(), Vec::<String>::new(), "{}: forward pass", plan.model);
    }
    let mut seen = Vec::new();
    for feeds in data {
        seen.extend(session.run(&forward, feeds).expect("forward runs"));
        seen.extend(session.run(&step, feeds).expect("a step runs"));
    }
    let variables =
        session.all_variables().expect("the variables").iter().map(|(n, t)| (n.clone(), t.clone())).collect();
    (seen, variables)
}

fn assert_close(what: &str, reference: &Tensor, native: &Tensor) {
    assert_within(what, reference, native, F32_TOLERANCE)
}

fn assert_within(what: &str, reference: &Tensor, native: &Tensor, tolerance: f64) {
    assert_eq!(reference.ty(), native.ty(), "{what}: type");
    match reference.ty().dtype {
        DType::F32 | DType::F64 => {
            let (a, b) = (reference.to_f64_vec(), native.to_f64_vec());
            for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                let err = (x - y).abs() / (1.0 + x.abs());
                assert!(err <= tolerance, "{what}[{i}]: interpreter {x}, backend {y}");
            }
        }
        _ => assert_eq!(reference, native, "{what}"),
    }
}

fn check(example: &str, cluster: Cluster, strategy: Strategy) {
    check_plan(example, &plan(example, cluster, strategy));
}

fn check_plan(example: &str, plan: &Plan) {
    check_backend(example, plan, Backend::Llvm);
}

/// `plan` run by `backend` against the interpreter.
fn check_backend(example: &str, plan: &Plan, backend: Backend) {
    check_within(example, plan, backend, F32_TOLERANCE)
}

fn check_within(example: &str, plan: &Plan, backend: Backend, tolerance: f64) {
    let plan = plan.clone();
    let data = batches(&plan);
    let (ref_seen, ref_vars) = run(&plan, Backend::Interp, &data);
    let (seen, vars) = run(&plan, backend, &data);
    assert_eq!(ref_seen.len(), seen.len());
    for (i, (a, b)) in ref_seen.iter().zip(&seen).enumerate() {
        assert_within(&format!("{example} fetch {i}"), a, b, tolerance);
    }
    assert_eq!(ref_vars.len(), vars.len(), "{example}: variables");
    for ((name, a), (name_b, b)) in ref_vars.iter().zip(&vars) {
        assert_eq!(name, name_b, "{example}: variables");
        assert_within(&format!("{example} variable {name}"), a, b, tolerance);
    }
}

fn single(example: &str) {
    check(example, Cluster::local(1, DeviceKind::Cpu), Strategy::Single);
}

#[test]
fn softmax_regression() {
    single("softmax_regression");
}

#[test]
fn mlp() {
    single("mlp");
}

#[test]
fn cnn() {
    single("cnn");
}

#[test]
fn linear_regression() {
    single("linear_regression");
}

#[test]
fn ridge_regression() {
    single("ridge_regression");
}

#[test]
fn wide_and_deep() {
    single("wide_and_deep");
}

#[test]
fn mlp_dropout() {
    single("mlp_dropout");
}

#[test]
fn two_towers() {
    single("two_towers");
}

#[test]
fn transformer() {
    single("transformer");
}

#[test]
fn resnet() {
    let plan = plan("resnet", Cluster::local(1, DeviceKind::Cpu), Strategy::Single);
    check_within("resnet", &plan, Backend::Llvm, DEEP_TOLERANCE);
}

/// Every example's GPU plan, on one GPU and mirrored on two (their gradients all-reduced), run
/// by the grid emulator: each GPU kernel's launches thread by thread (reductions over the
/// outermost loop in their passes), every other step as on the CPU.
#[test]
fn gpu_plans_run_on_the_grid_emulator() {
    for example in EXAMPLES {
        let on_one = plan(example, Cluster::local(1, DeviceKind::Gpu), Strategy::Single);
        assert!(on_one.partitions.iter().all(|p| p.device.kind == Some(DeviceKind::Gpu)), "{example}");
        check_backend(example, &on_one, Backend::GridEmulator);
    }
    let mirrored = plan("mlp", Cluster::local(2, DeviceKind::Gpu), Strategy::Mirrored);
    assert_eq!(mirrored.partitions.len(), 2);
    check_backend("mlp mirrored on 2 GPUs", &mirrored, Backend::GridEmulator);
}

const STRIDED_MODEL: &str = r#"
    model strided {
        input images: f32[4, 9, 10, 3]
        input labels: i32[4]
        param k: f32[3, 2, 3, 5] = glorot_uniform
        param k2: f32[2, 3, 5, 4] = glorot_uniform
        param w: f32[36, 10] = glorot_uniform
        let c = relu(conv2d(images, k, strides = 2, padding = "same"))
        let c2 = relu(conv2d(c, k2, strides = 2, padding = "same"))
        let logits = flatten(c2) @ w
        let loss = mean(softmax_cross_entropy(logits, one_hot(labels, 10)))
        output logits
        minimize loss with sgd(lr = 0.1)
    }"#;

/// Strided, padded convolutions with non-square filters on non-square inputs: their im2col
/// kernels and GEMMs (forward and the filters' gradients) and the second one's input gradient
/// (a GEMM and the col2im kernel), on the device, give the interpreter's values, forward and
/// trained.
#[test]
fn strided_padded_convolutions_run_on_the_grid_emulator() {
    let on_gpu = plan_of(STRIDED_MODEL, "strided", Cluster::local(1, DeviceKind::Gpu), Strategy::Single);
    check_backend("strided", &on_gpu, Backend::GridEmulator);
}

const POOLED_MODEL: &str = r#"
    model pooled {
        input images: f32[4, 9, 10, 3]
        input labels: i32[4]
        param k: f32[2, 2, 3, 4] = glorot_uniform
        param w: f32[100, 10] = glorot_uniform
        param v: f32[100, 10] = glorot_uniform
        let c = conv2d(images, k, padding = "same")
        let m = max_pool(c, window = 3, strides = 2, padding = "same")
        let a = avg_pool(c * 2.0, window = 3, strides = 2, padding = "same")
        let logits = flatten(m) @ w + flatten(a) @ v
        let loss = mean(softmax_cross_entropy(logits, one_hot(labels, 10)))
        output logits
        minimize loss with sgd(lr = 0.1)
    }"#;

/// Overlapping, padded max and average pooling (3×3 windows, stride 2, `same`) on a
/// non-square input: their window kernels and their gradients' (which gather, per input
/// element, what the covering windows give it) on the device give the interpreter's values,
/// forward and trained.
#[test]
fn overlapping_pooling_runs_on_the_grid_emulator() {
    let on_gpu = plan_of(POOLED_MODEL, "pooled", Cluster::local(1, DeviceKind::Gpu), Strategy::Single);
    check_backend("pooled", &on_gpu, Backend::GridEmulator);
}

/// A model of layout ops: a gather by i64 ids, slices, a concat and transposes, whose
/// gradients add pads (a slice's), slices (a concat's) and transposes: their layout kernels on
/// the device give the interpreter's values, forward and trained.
const LAYOUT_MODEL: &str = r#"
    model layout {
        input x: f32[4, 6]
        input ids: i64[4]
        input labels: i32[4]
        param table: f32[10, 3] = glorot_uniform
        param v: f32[7, 4] = glorot_uniform
        param w: f32[4, 10] = glorot_uniform
        let e = gather(table, ids)
        let h = concat([e, slice(x, [0, 1], [4, 2])], axis = 1)
        let z = transpose(h @ slice(v, [1, 0], [5, 4]))
        let logits = transpose(z) @ w
        let loss = mean(softmax_cross_entropy(logits, one_hot(labels, 10)))
        output logits
        minimize loss with sgd(lr = 0.1)
    }"#;

#[test]
fn layout_ops_run_on_the_grid_emulator() {
    let on_gpu = plan_of(LAYOUT_MODEL, "layout", Cluster::local(1, DeviceKind::Gpu), Strategy::Single);
    check_backend("layout", &on_gpu, Backend::GridEmulator);
}

/// A gather's index out of range on the device is an error naming the node, the index and the
/// table's rows, as on the CPU, for an index too large and a negative one, in the forward pass
/// and in a training step (whose embedding gradient, a scatter-add on the device, meets the
/// same index: the gather's error comes first, as on the CPU).
#[test]
fn a_gather_index_out_of_range_on_the_grid_emulator_is_an_error() {
    let plan = plan_of(LAYOUT_MODEL, "layout", Cluster::local(1, DeviceKind::Gpu), Strategy::Single);
    let mut feeds = batches(&plan).remove(0);
    for bad in [10i64, -3] {
        feeds.insert("ids".into(), Tensor::from_vec(vec![4], vec![1i64, bad, 2, 0]));
        for backend in [Backend::Interp, Backend::GridEmulator] {
            let mut session = Session::with_backend(&plan, 0, backend).expect("the plan loads");
            let training = plan.training.as_ref().expect("it trains");
            let updates: Vec<&str> = training.updates.iter().map(String::as_str).collect();
            let forward = session.program(&["logits"], &[]).expect("a forward pass");
            let step = session.program(&[training.loss_node.as_str()], &updates).expect("a training step");
            for program in [&forward, &step] {
                let error = session.run(program, &feeds).expect_err("an index out of range").to_string();
                assert!(
                    error.contains(&format!("`e`: index {bad} is out of range for a size of 10")),
                    "{backend:?}: {error}"
                );
            }
        }
    }
}

/// Rows of 256 classes (`tests/ptx/long_rows.df`): the softmax, cross-entropy and argmax run
/// one row per block on the device, trees in shared memory between barriers, and train as on
/// the interpreter.
#[test]
fn long_rows_run_one_per_block_on_the_grid_emulator() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/ptx/long_rows.df");
    let source = std::fs::read_to_string(path).expect("the model");
    let on_gpu = plan_of(&source, "long_rows", Cluster::local(1, DeviceKind::Gpu), Strategy::Single);
    check_backend("long_rows", &on_gpu, Backend::GridEmulator);
}

/// Layer norms and their gradients (`tests/ptx/layer_norm.df`) on short rows (a thread a row on
/// a GPU) and long ones (a block a row), natively on a CPU and on the grid emulator's GPU.
#[test]
fn layer_norms_run_natively_and_on_the_grid_emulator() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/ptx/layer_norm.df");
    let source = std::fs::read_to_string(path).expect("the model");
    let on_cpu = plan_of(&source, "layer_norm", Cluster::local(1, DeviceKind::Cpu), Strategy::Single);
    check_backend("layer_norm", &on_cpu, Backend::Llvm);
    let on_gpu = plan_of(&source, "layer_norm", Cluster::local(1, DeviceKind::Gpu), Strategy::Single);
    check_backend("layer_norm on a GPU", &on_gpu, Backend::GridEmulator);
}

/// Causal self-attention (`tests/ptx/attention.df`): batched products with a transposed
/// operand, a masked softmax and their gradients, natively on a CPU and on the grid
/// emulator's GPU.
#[test]
fn causal_attention_runs_natively_and_on_the_grid_emulator() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/ptx/attention.df");
    let source = std::fs::read_to_string(path).expect("the model");
    let on_cpu = plan_of(&source, "attention", Cluster::local(1, DeviceKind::Cpu), Strategy::Single);
    check_backend("attention", &on_cpu, Backend::Llvm);
    let on_gpu = plan_of(&source, "attention", Cluster::local(1, DeviceKind::Gpu), Strategy::Single);
    check_backend("attention on a GPU", &on_gpu, Backend::GridEmulator);
}

/// Batch norms (`tests/ptx/batch_norm.df`), trained and evaluated, natively on a CPU and on
/// the grid emulator's GPU: the interpreter's values, the moving averages included.
#[test]
fn batch_norms_run_natively_and_on_the_grid_emulator() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/ptx/batch_norm.df");
    let source = std::fs::read_to_string(path).expect("the model");
    let on_cpu = plan_of(&source, "batch_norm", Cluster::local(1, DeviceKind::Cpu), Strategy::Single);
    check_backend("batch_norm", &on_cpu, Backend::Llvm);
    let on_gpu = plan_of(&source, "batch_norm", Cluster::local(1, DeviceKind::Gpu), Strategy::Single);
    check_backend("batch_norm on a GPU", &on_gpu, Backend::GridEmulator);
}

/// In a training step a batch norm normalises by the batch's statistics and moves the moving
/// averages towards them (`momentum` 0.75: a quarter of the way); elsewhere it normalises by
/// the moving averages.
#[test]
fn batch_norm_uses_the_batch_in_training_and_moving_averages_elsewhere() {
    let source = r#"
        model bn {
            input x: f32[8, 3]
            param w: f32[3] = ones
            let y = batch_norm(x, momentum = 0.75, epsilon = 0.01)
            let loss = sum(y * w)
            output y
            minimize loss with sgd(lr = 0.1)
        }"#;
    let plan = plan_of(source, "bn", Cluster::local(1, DeviceKind::Cpu), Strategy::Single);
    let training = plan.training.as_ref().expect("it trains");
    let feeds = batches(&plan).remove(0);
    let x = feeds["x"].to_f64_vec();
    let column = |c: usize| x.iter().skip(c).step_by(3).copied().collect::<Vec<f64>>();
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let variance = |v: &[f64]| mean(&v.iter().map(|a| (a - mean(v)).powi(2)).collect::<Vec<_>>());
    for backend in [Backend::Interp, Backend::Llvm] {
        let mut session = Session::with_backend(&plan, 0, backend).expect("the plan loads");
        let updates: Vec<&str> = training.updates.iter().map(String::as_str).collect();
        let step = session.program(&["y"], &updates).expect("a training step");
        let forward = session.program(&["y"], &[]).expect("a forward pass");
        // Before any step the moving averages are 0 and 1: y = x / sqrt(1 + epsilon).
        let y = session.run(&forward, &feeds).unwrap().remove(0).to_f64_vec();
        for (a, b) in y.iter().zip(&x) {
            assert!((a - b / 1.01f64.sqrt()).abs() < 1e-5, "{backend:?}: {a} from {b} before training");
        }
        let y = session.run(&step, &feeds).unwrap().remove(0).to_f64_vec();
        let variables: HashMap<String, Tensor> =
            session.all_variables().unwrap().iter().map(|(n, t)| (n.clone(), t.clone())).collect();
        let (moving_mean, moving_variance) =
            (variables["y/moving_mean"].to_f64_vec(), variables["y/moving_variance"].to_f64_vec());
        for c in 0..3 {
            let (m, v) = (mean(&column(c)), variance(&column(c)));
            let normalised: Vec<f64> = y.iter().skip(c).step_by(3).copied().collect();
            assert!(mean(&normalised).abs() < 1e-5, "{backend:?}: channel {c} centred in training");
            for (a, b) in normalised.iter().zip(column(c)) {
                assert!((a - (b - m) / (v + 0.01).sqrt()).abs() < 1e-4, "{backend:?}: {a} from {b} in training");
            }
            assert!((moving_mean[c] - 0.25 * m).abs() < 1e-6, "{backend:?}: moving mean {moving_mean:?}");
            assert!((moving_variance[c] - (0.75 + 0.25 * v)).abs() < 1e-6, "{backend:?}: {moving_variance:?}");
        }
        let y = session.run(&forward, &feeds).unwrap().remove(0).to_f64_vec();
        for (i, (a, b)) in y.iter().zip(&x).enumerate() {
            let c = i % 3;
            let expected = (b - moving_mean[c]) / (moving_variance[c] + 0.01).sqrt();
            assert!((a - expected).abs() < 1e-5, "{backend:?}: {a} from {b} after training");
        }
    }
}

const SCHEDULED_MODEL: &str = r#"
    model scheduled {
        input x: f32[8, 6]
        input labels: i32[8]
        param w: f32[6, 10] = glorot_uniform
        param b: f32[10] = zeros
        let logits = x @ w + b
        let loss = mean(softmax_cross_entropy(logits, one_hot(labels, 10)))
        output logits
        minimize loss with adam(lr = warmup(cosine_decay(0.05, decay_steps = 3, alpha = 0.2), steps = 2), clip_global_norm = 0.5)
    }"#;

/// A learning-rate schedule (computed from the global step, on the host) and gradient
/// clipping, natively on a CPU and on the grid emulator's GPU: the interpreter's values,
/// the global step included.
#[test]
fn schedules_and_clipping_run_natively_and_on_the_grid_emulator() {
    let on_cpu = plan_of(SCHEDULED_MODEL, "scheduled", Cluster::local(1, DeviceKind::Cpu), Strategy::Single);
    check_backend("scheduled", &on_cpu, Backend::Llvm);
    let on_gpu = plan_of(SCHEDULED_MODEL, "scheduled", Cluster::local(1, DeviceKind::Gpu), Strategy::Single);
    check_backend("scheduled on a GPU", &on_gpu, Backend::GridEmulator);
}

/// A model with dropout: its masks (Philox bits of the run's seed and the step) and the
/// identity outside training, natively on a CPU and on the grid emulator's GPU: the
/// interpreter's values, forward (no dropout) and trained (dropout).
const DROPOUT_MODEL: &str = r#"
    model dropped {
        input x: f32[8, 6]
        input labels: i32[8]
        param w: f32[6, 10] = glorot_uniform
        let h = dropout(x, 0.4)
        let logits = h @ w
        let loss = mean(softmax_cross_entropy(logits, one_hot(labels, 10)))
        output h
        output logits
        minimize loss with sgd(lr = 0.1)
    }"#;

#[test]
fn dropout_runs_natively_and_on_the_grid_emulator() {
    let on_cpu = plan_of(DROPOUT_MODEL, "dropped", Cluster::local(1, DeviceKind::Cpu), Strategy::Single);
    check_backend("dropped", &on_cpu, Backend::Llvm);
    let on_gpu = plan_of(DROPOUT_MODEL, "dropped", Cluster::local(1, DeviceKind::Gpu), Strategy::Single);
    check_backend("dropped on a GPU", &on_gpu, Backend::GridEmulator);
}

/// In a training step dropout zeroes about `rate` of the elements and scales the others by
/// 1 / (1 − rate), with a new mask every step; in any other program it is the identity.
#[test]
fn dropout_drops_in_training_only() {
    let plan = plan_of(DROPOUT_MODEL, "dropped", Cluster::local(1, DeviceKind::Cpu), Strategy::Single);
    let training = plan.training.as_ref().expect("it trains");
    let feeds = batches(&plan).remove(0);
    let x = feeds["x"].to_f64_vec();
    for backend in [Backend::Interp, Backend::Llvm] {
        let mut session = Session::with_backend(&plan, 0, backend).expect("the plan loads");
        let updates: Vec<&str> = training.updates.iter().map(String::as_str).collect();
        let step = session.program(&["h"], &updates).expect("a training step");
        let forward = session.program(&["h"], &[]).expect("a forward pass");
        if backend == Backend::Llvm {
            assert_eq!(step.library_ops(), Vec::<String>::new(), "the masks' bits come from the fused kernels");
        }
        let inferred = session.run(&forward, &feeds).unwrap().remove(0).to_f64_vec();
        assert_eq!(inferred, x, "{backend:?}: the identity outside training");
        let mut masks = Vec::new();
        for _ in 0..2 {
            let h = session.run(&step, &feeds).unwrap().remove(0).to_f64_vec();
            let kept: Vec<bool> = h.iter().map(|&v| v != 0.0).collect();
            for ((&v, &xi), &k) in h.iter().zip(&x).zip(&kept) {
                if k {
                    assert!((v - xi / 0.6).abs() < 1e-6 * (1.0 + xi.abs()), "{backend:?}: {v} kept from {xi}");
                }
            }
            let dropped = kept.iter().filter(|k| !**k).count();
            assert!((8..=32).contains(&dropped), "{backend:?}: {dropped} of 48 dropped at rate 0.4");
            masks.push(kept);
        }
        assert_ne!(masks[0], masks[1], "{backend:?}: a new mask every step");
    }
}

/// On a machine with an NVIDIA GPU: every example's GPU plan, on one GPU and mirrored on two
/// where there are two, and every model the grid emulator runs above, run on the GPU (device
/// memory, the kernels' launches, cuBLAS, the other steps on the host) against the
/// interpreter. Each model is checked whatever the others do, and the failures are listed
/// together. Elsewhere a skip (`DFC_GPU_REQUIRED=1` makes it a failure).
#[test]
fn gpu_plans_run_on_a_gpu() {
    let gpus = dfc_cuda::device_count().unwrap_or(0);
    if gpus == 0 {
        let why = if dfc_cuda::driver_present() { "no device" } else { "no driver" };
        skip::skip(skip::Need::Gpu, &format!("no GPU here ({why})"));
        return;
    }
    let on_gpu = || Cluster::local(1, DeviceKind::Gpu);
    let mut plans: Vec<(String, Box<dyn Fn() -> Plan>)> = Vec::new();
    for example in EXAMPLES {
        plans.push((example.into(), Box::new(move || plan(example, on_gpu(), Strategy::Single))));
    }
    for model in ["long_rows", "layer_norm", "attention", "batch_norm", "dropout"] {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("tests/ptx/{model}.df"));
        let source = std::fs::read_to_string(path).expect("the model");
        plans.push((model.into(), Box::new(move || plan_of(&source, model, on_gpu(), Strategy::Single))));
    }
    for (model, source) in [
        ("strided", STRIDED_MODEL),
        ("pooled", POOLED_MODEL),
        ("layout", LAYOUT_MODEL),
        ("scheduled", SCHEDULED_MODEL),
        ("dropped", DROPOUT_MODEL),
    ] {
        plans.push((model.into(), Box::new(move || plan_of(source, model, on_gpu(), Strategy::Single))));
    }
    if gpus >= 2 {
        plans.push((
            "mlp mirrored on 2 GPUs".into(),
            Box::new(|| plan("mlp", Cluster::local(2, DeviceKind::Gpu), Strategy::Mirrored)),
        ));
    }
    let mut failures = Vec::new();
    for (name, make) in &plans {
        let checked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let tolerance = if name == "resnet" { DEEP_TOLERANCE } else { GPU_F32_TOLERANCE };
            check_within(name, &make(), Backend::Llvm, tolerance)
        }));
        match checked {
            Ok(()) => println!("{name}: the GPU agrees with the interpreter"),
            Err(panic) => {
                let message = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                println!("{name}: FAILED: {message}");
                failures.push(format!("{name}: {message}"));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} models differ on the GPU:\n{}",
        failures.len(),
        plans.len(),
        failures.join("\n")
    );
}

#[test]
fn partitioned_plans_run_natively() {
    check("mlp", Cluster::local(2, DeviceKind::Cpu), Strategy::Mirrored);
    check("softmax_regression", Cluster::local(3, DeviceKind::Cpu), Strategy::Model);
}

/// A plan carries no code, only IR: its bytes are the same whatever CPU compiled it, and the
/// code generated where it runs — here for an AVX2-only CPU (Haswell) on this one — computes
/// what the interpreter does, bit for bit in the kernels.
#[test]
fn a_plan_is_data_and_runs_on_code_generated_for_another_cpu() {
    let plan = plan("softmax_regression", Cluster::local(1, DeviceKind::Cpu), Strategy::Single);
    let bytes = dfc_plan::encode(&plan);
    let host = dfc_codegen::host_target();
    for word in [host.cpu.as_bytes(), b"+avx", host.triple.as_bytes()] {
        assert!(!bytes.windows(word.len()).any(|w| w == word), "the plan names {:?}", String::from_utf8_lossy(word));
    }

    let module = &plan.partitions[0].module;
    let haswell = dfc_codegen::NativeTarget {
        triple: host.triple.clone(),
        cpu: "haswell".into(),
        features: "+avx,+avx2,+fma,+f16c,+bmi,+bmi2,+popcnt,+sse4.2,-avx512f".into(),
    };
    let cache = dfc_codegen::CodeCache::disabled();
    let jit = dfc_cpu::load_partition(&cache, module, &plan.kept_nodes(0), &haswell).expect("code for Haswell");
    let training = plan.training.as_ref().unwrap();
    let loss = module.graph.node_ids().find(|&id| module.graph.node(id).name == training.loss_node).unwrap();
    let fetches = [dfc_ir::TensorRef::from(loss)];
    let order = dfc_interp::schedule(&[module]).unwrap().remove(0);
    let native =
        dfc_cpu::NativeProgram::new(module, jit, &fetches, &[], &order, false, false).expect("a native program");
    let interp = dfc_interp::Program::with_order(module, &fetches, &[], &order).unwrap();
    let mut variables = dfc_interp::initialize(module, 0);
    for feeds in batches(&plan) {
        let expected = interp.run(module, &mut variables.clone(), &feeds).unwrap();
        let found = native.run(&mut variables, &feeds, None).unwrap();
        assert_close("the loss on code for Haswell", &expected[0], &found[0]);
    }
}

/// Fetching a value that a kernel computes inside itself compiles code that stores it.
#[test]
fn fetching_a_fused_value_stores_it() {
    let plan = plan("mlp", Cluster::local(1, DeviceKind::Cpu), Strategy::Single);
    let data = batches(&plan);
    let fetch = |backend| {
        let mut session = Session::with_backend(&plan, 0, backend).unwrap();
        let program = session.program(&["h1/add"], &[]).expect("an inner node can be fetched");
        session.run(&program, &data[0]).unwrap().remove(0)
    };
    assert_close("h1/add", &fetch(Backend::Interp), &fetch(Backend::Llvm));
}

/// The training step's update of what is stored in variable `name`s, by folded update node.
fn folded_updates(plan: &Plan) -> Vec<String> {
    let training = plan.training.as_ref().unwrap();
    let updates: Vec<&str> = training.updates.iter().map(String::as_str).collect();
    let session = Session::with_backend(plan, 0, Backend::Llvm).unwrap();
    session.program(&[training.loss_node.as_str()], &updates).unwrap().folded_updates()
}

/// SGD's update of a dense layer's weights, `w -= lr·(xᵀg)`, runs as one GEMM into `w`: the gradient is never
/// stored (the values are checked against the interpreter by `mlp` and `cnn`).
#[test]
fn sgd_updates_of_dense_weights_are_folded_into_their_products() {
    let mlp = plan("mlp", Cluster::local(1, DeviceKind::Cpu), Strategy::Single);
    let want = ["h1/w/update/assign_sub", "h2/w/update/assign_sub", "logits/w/update/assign_sub"];
    let mut folded = folded_updates(&mlp);
    folded.sort();
    assert_eq!(folded, want);
    // Convolution filters' gradients are not products; the CNN's dense layers are.
    let cnn = plan("cnn", Cluster::local(1, DeviceKind::Cpu), Strategy::Single);
    let folded = folded_updates(&cnn);
    assert_eq!(folded.len(), 2, "{folded:?}");
    assert!(folded.iter().all(|u| !u.starts_with("conv")), "{folded:?}");
    // Adam's update is not a product.
    let source = std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/mlp.df")).unwrap();
    let adam = source.replace("sgd(lr = 0.01)", "adam(lr = 0.001)");
    assert!(folded_updates(&plan_of(&adam, "mlp", Cluster::local(1, DeviceKind::Cpu), Strategy::Single)).is_empty());
}

/// The MLP's images, fed as bytes and scaled, are read as bytes by both products of its first layer (forward, and
/// its weights' gradient): the kernel that scales them does not run, in training or inference. In training the
/// forward product's weights are rewritten by the same step (`b_rewritten`). A scaled value that
/// something other than a wide product reads (here the thin products of a logistic regression), or that is fetched,
/// is computed as before. The values agree with the interpreter (`mlp`, and here with `* c` for `/ 255`).
#[test]
fn products_read_bytes_fed_in() {
    let mlp = plan("mlp", Cluster::local(1, DeviceKind::Cpu), Strategy::Single);
    let training = mlp.training.as_ref().unwrap();
    let updates: Vec<&str> = training.updates.iter().map(String::as_str).collect();
    let session = Session::with_backend(&mlp, 0, Backend::Llvm).unwrap();
    assert_eq!(session.program(&[training.loss_node.as_str()], &updates).unwrap().bytes_read(), ["x/div"]);
    assert_eq!(session.program(&["logits"], &[]).unwrap().bytes_read(), ["x/div"]);
    // The training step's first layer multiplies the bytes by weights that the same step updates; inference's not.
    assert_eq!(session.program(&[training.loss_node.as_str()], &updates).unwrap().bytes_times_rewritten(), 1);
    assert_eq!(session.program(&["logits"], &[]).unwrap().bytes_times_rewritten(), 0);
    assert!(session.program(&["x/div", "logits"], &[]).unwrap().bytes_read().is_empty());
    let logreg = plan("softmax_regression", Cluster::local(1, DeviceKind::Cpu), Strategy::Single);
    let session = Session::with_backend(&logreg, 0, Backend::Llvm).unwrap();
    assert!(session
        .program(&[logreg.training.as_ref().unwrap().loss_node.as_str()], &[])
        .unwrap()
        .bytes_read()
        .is_empty());
    let source = std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/mlp.df")).unwrap();
    let scaled = source.replace("cast<f32>(images) / 255.0", "0.0039215 * cast<f32>(images)");
    assert_ne!(scaled, source);
    let plan = plan_of(&scaled, "mlp", Cluster::local(1, DeviceKind::Cpu), Strategy::Single);
    let session = Session::with_backend(&plan, 0, Backend::Llvm).unwrap();
    assert_eq!(session.program(&["logits"], &[]).unwrap().bytes_read(), ["x/mul"]);
    check_plan("mlp", &plan);
}

/// A dense layer's `relu(x·w + b)` is one product whose epilogue adds the bias and takes the relu, in training
/// (whose relu gradient reads the activation, not the sum) and inference, and the relu's gradient
/// `select(h > 0, g·wᵀ, 0)` one product whose epilogue masks it, and sums its columns (the bias's gradient); the
/// logits' thin product keeps its kernel. A sum that something else reads too, or that is fetched, is stored by its
/// product and computed by a kernel as before. The values agree with the interpreter (`mlp`, and here).
#[test]
fn dense_layers_are_one_product_with_an_epilogue() {
    let mlp = plan("mlp", Cluster::local(1, DeviceKind::Cpu), Strategy::Single);
    let training = mlp.training.as_ref().unwrap();
    let updates: Vec<&str> = training.updates.iter().map(String::as_str).collect();
    let session = Session::with_backend(&mlp, 0, Backend::Llvm).unwrap();
    let fused = |fetches: &[&str], targets: &[&str]| session.program(fetches, targets).unwrap().fused_products();
    let training_fused = ["h1", "h2", "gradients/h2/select", "gradients/h1/select"];
    assert_eq!(fused(&[training.loss_node.as_str()], &updates), training_fused);
    // The biases' gradients, the masked products' columns summed, are summed by those products.
    let summed = |fetches: &[&str], targets: &[&str]| session.program(fetches, targets).unwrap().summed_columns();
    let training_summed = ["gradients/h2/add/sum", "gradients/h1/add/sum"];
    assert_eq!(summed(&[training.loss_node.as_str()], &updates), training_summed);
    assert!(summed(&["logits"], &[]).is_empty());
    // Fetched, a sum is stored by its product, and agrees with the interpreter's.
    let fetches = [training.loss_node.as_str(), "gradients/h2/add/sum", "gradients/h1/add/sum"];
    assert_eq!(summed(&fetches, &[]), training_summed);
    let run = |backend| {
        let mut session = Session::with_backend(&mlp, 0, backend).unwrap();
        let program = session.program(&fetches, &[]).unwrap();
        session.run(&program, &batches(&mlp)[0]).unwrap()
    };
    let (reference, native) = (run(Backend::Interp), run(Backend::Llvm));
    for (name, (want, got)) in fetches.iter().zip(reference.iter().zip(&native)) {
        assert_close(name, want, got);
    }
    assert_eq!(fused(&["logits"], &[]), ["h1", "h2"]);
    assert_eq!(fused(&["h1/matmul", "logits"], &[]), ["h2"]);
    let source = "
        model shared_sum {
            input x: f32[64, 48]
            param w: f32[48, 40] = glorot_uniform
            param b: f32[40] = zeros
            param v: f32[40, 32] = glorot_uniform
            let z = x @ w + b
            let h = relu(z) @ v
            let loss = mean(h * h) + mean(z * z)
            output h
            minimize loss with sgd(lr = 0.1)
        }";
    let plan = plan_of(source, "shared_sum", Cluster::local(1, DeviceKind::Cpu), Strategy::Single);
    check_plan("shared_sum", &plan);
    // A forward layer's stored activations summed down their columns (written twice, one sum after simplification):
    // the product computes the sum, as the interpreter does.
    let source = "
        model two_sums {
            input x: f32[64, 48]
            param w: f32[48, 40] = glorot_uniform
            param b: f32[40] = zeros
            let h = relu(x @ w + b)
            let first = sum(h, axis = 0)
            let second = sum(h, axis = 0)
            output h
            output first
            output second
        }";
    let plan = plan_of(source, "two_sums", Cluster::local(1, DeviceKind::Cpu), Strategy::Single);
    let session = Session::with_backend(&plan, 0, Backend::Llvm).unwrap();
    let fetches = ["h", "first", "second"];
    assert_eq!(session.program(&fetches, &[]).unwrap().summed_columns().len(), 1, "one sum, by the product");
    let feeds = batches(&plan).remove(0);
    let run = |backend| {
        let mut session = Session::with_backend(&plan, 0, backend).unwrap();
        let program = session.program(&fetches, &[]).unwrap();
        session.run(&program, &feeds).unwrap()
    };
    for (name, (want, got)) in fetches.iter().zip(run(Backend::Interp).iter().zip(&run(Backend::Llvm))) {
        assert_close(name, want, got);
    }
}

/// At inference the CNN's convolutions are computed with the max poolings that read them, and never stored (the
/// first, of one channel, as a thin window; the second by Winograd tiles, each pooled as it is transformed), and the
/// bias and relu after each pooling with them; in training the poolings' gradients read them, and they are stored;
/// so is a fetched one. The values agree with the interpreter (`cnn` runs forward passes; here one fetching only
/// the logits).
#[test]
fn convolutions_are_pooled_as_they_are_computed_at_inference() {
    let cnn = plan("cnn", Cluster::local(1, DeviceKind::Cpu), Strategy::Single);
    let training = cnn.training.as_ref().unwrap();
    let updates: Vec<&str> = training.updates.iter().map(String::as_str).collect();
    let session = Session::with_backend(&cnn, 0, Backend::Llvm).unwrap();
    let pooled = |fetches: &[&str], targets: &[&str]| session.program(fetches, targets).unwrap().pooled_convolutions();
    let logits = session.program(&["logits"], &[]).unwrap();
    // The second layer's Winograd tiles hold whole 2×2 windows while its batch is at least one image per thread.
    let winograd = rayon::current_num_threads() <= 64;
    let both: &[&str] = if winograd { &["c1/conv2d", "c2/conv2d"] } else { &["c1/conv2d"] };
    assert_eq!(logits.pooled_convolutions(), both);
    // The poolings' bias and relu (after them: `pool_early`) are computed with them.
    let relus: &[&str] = if winograd { &["c1/relu", "c2/relu"] } else { &["c1/relu"] };
    assert_eq!(logits.pooled_epilogues(), relus);
    assert!(pooled(&[training.loss_node.as_str()], &updates).is_empty());
    assert_eq!(pooled(&["c1/conv2d", "logits"], &[]), &both[1..]);
    // A fetched pooling is stored: its bias and relu run as a kernel of their own.
    let fetching_the_pooling = session.program(&["c1", "logits"], &[]).unwrap();
    assert_eq!(fetching_the_pooling.pooled_convolutions(), both);
    assert_eq!(fetching_the_pooling.pooled_epilogues(), &relus[1..]);
    let mut reference = Session::with_backend(&cnn, 0, Backend::Interp).unwrap();
    let mut native = session;
    let fetch = |session: &mut Session| {
        let program = session.program(&["logits"], &[]).unwrap();
        let feeds = batches(&cnn).remove(0);
        session.run(&program, &feeds).unwrap().remove(0)
    };
    assert_close("cnn logits", &fetch(&mut reference), &fetch(&mut native));
}

/// An update whose product reads the variable it updates (here through `stop_gradient`: the gradient of `w` is
/// `stop_gradient(w)ᵀ·g`, 400×400, two blocks of the reduction) is not folded, and runs as the interpreter does.
/// On one thread, so that a product overwriting what it still reads would not hide in a race.
#[test]
fn an_update_whose_product_reads_its_variable_is_not_folded() {
    let source = "
        model self_product {
            input x: f32[400, 400]
            param w: f32[400, 400] = glorot_uniform
            let y = stop_gradient(w) @ w
            let loss = mean(y * x)
            output y
            minimize loss with sgd(lr = 20000.0)
        }";
    let plan = plan_of(source, "self_product", Cluster::local(1, DeviceKind::Cpu), Strategy::Single);
    assert!(folded_updates(&plan).is_empty());
    // One thread: a product's blocks run in order, not in a race that may read `w` before it is written.
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    pool.install(|| check_plan("self_product", &plan));
}

/// `--overlap`'s schedule (`dfc_cpu::Schedule::overlapped`) of the MLP mirrored on 2 devices,
/// one all-reduce per gradient: every all-reduce but the last starts on the communication
/// thread, the last layer's first, and has a wait after it, with the backward pass's work in
/// between for the first; the last runs in place, after every start; the plain schedule has
/// neither starts nor waits. (That the sums are right is `tests/distributed.rs`'s.)
#[test]
fn an_overlapped_schedule_starts_all_reduces_early_and_waits_for_them_late() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/mlp.df");
    let source = std::fs::read_to_string(&path).expect("example");
    let options = CompileOptions {
        cluster: Cluster::local(2, DeviceKind::Cpu),
        strategy: Strategy::Mirrored,
        fusion: dfc_passes::FusionOptions { threshold_bytes: 0 },
        overlap: true,
        ..CompileOptions::default()
    };
    let plan = compile(&source, "mlp.df", &options).expect("compiles").plan;
    let modules: Vec<&dfc_ir::Module> = plan.partitions.iter().map(|p| &p.module).collect();
    let order = dfc_interp::schedule(&modules).unwrap().remove(0);
    let module = modules[0];
    let cache = dfc_codegen::CodeCache::disabled();
    let jit = dfc_cpu::load_partition(&cache, module, &plan.kept_nodes(0), &dfc_codegen::host_target()).unwrap();
    let sites: Vec<dfc_cpu::KernelSite> = jit
        .kernels()
        .iter()
        .map(|k| dfc_cpu::KernelSite { root: k.root, members: &k.members, inputs: &k.inputs })
        .collect();
    let training = plan.training.as_ref().unwrap();
    let targets: Vec<dfc_ir::NodeId> =
        module.graph.node_ids().filter(|&id| training.updates.contains(&module.graph.node(id).name)).collect();
    assert!(!targets.is_empty());
    let build = |overlap: bool| {
        let build = if overlap { dfc_cpu::Schedule::overlapped } else { dfc_cpu::Schedule::new };
        build(module, &sites, &[], &targets, &order, true).expect("a schedule").steps
    };
    use dfc_cpu::Step;
    let plain = build(false);
    assert!(plain.iter().all(|s| !matches!(s, Step::AllReduceWait { .. } | Step::AllReduce { overlapped: true, .. })));
    assert_eq!(plain.iter().filter(|s| matches!(s, Step::AllReduce { .. })).count(), 6);

    let steps = build(true);
    let starts: Vec<(usize, &str)> = steps
        .iter()
        .enumerate()
        .filter_map(|(i, s)| match s {
            Step::AllReduce { key, overlapped: true, .. } => Some((i, key.as_str())),
            _ => None,
        })
        .collect();
    assert_eq!(starts.len(), 5, "every all-reduce but the last starts on the thread");
    assert!(starts[0].1.starts_with("gradients/logits/"), "the last layer's gradients first: {starts:?}");
    let in_place: Vec<usize> =
        (0..steps.len()).filter(|&i| matches!(steps[i], Step::AllReduce { overlapped: false, .. })).collect();
    assert_eq!(in_place.len(), 1);
    assert!(starts.iter().all(|&(i, _)| i < in_place[0]), "the last all-reduce comes after every start");
    for (n, &(start, key)) in starts.iter().enumerate() {
        let wait = (start..steps.len())
            .find(|&j| matches!(&steps[j], Step::AllReduceWait { key: k, .. } if k == key))
            .unwrap_or_else(|| panic!("no wait for `{key}`"));
        let computed =
            steps[start + 1..wait].iter().filter(|s| matches!(s, Step::MatMul { .. } | Step::Kernel { .. })).count();
        if n == 0 {
            assert!(computed > 0, "nothing is computed while `{key}` is reduced");
        }
    }
}

/// A byte read as a float and divided by a constant (`cast<f32>(x) / c`: images scaled to [0, 1]) is the division's
/// bits for every byte, on the CPU and on the grid emulator, whether the kernel multiplies by the corrected
/// reciprocal (255, 7, -0.3) or divides (2e-38, whose quotients overflow; 3e38, whose reciprocal is subnormal).
#[test]
fn bytes_divided_by_a_constant_are_the_divisions_bits() {
    let source = "
        model scaled {
            input x: u8[256]
            let images = cast<f32>(x) / 255.0
            let sevenths = cast<f32>(x) / 7.0
            let negative = cast<f32>(x) / -0.3
            let overflowing = cast<f32>(x) / 2.0e-38
            let tiny = cast<f32>(x) / 3.0e38
            output images
            output sevenths
            output negative
            output overflowing
            output tiny
        }";
    let outputs = ["images", "sevenths", "negative", "overflowing", "tiny"];
    let feeds = HashMap::from([("x".to_string(), Tensor::from_vec(vec![256], (0..=255u8).collect::<Vec<u8>>()))]);
    for (device, backend) in [(DeviceKind::Cpu, Backend::Llvm), (DeviceKind::Gpu, Backend::GridEmulator)] {
        let plan = plan_of(source, "scaled", Cluster::local(1, device), Strategy::Single);
        let run = |backend| {
            let mut session = Session::with_backend(&plan, 0, backend).unwrap();
            let program = session.program(&outputs, &[]).unwrap();
            session.run(&program, &feeds).unwrap()
        };
        let (reference, found) = (run(Backend::Interp), run(backend));
        for (name, (want, got)) in outputs.iter().zip(reference.iter().zip(&found)) {
            let bits = |t: &Tensor| t.to_f64_vec().iter().map(|&v| (v as f32).to_bits()).collect::<Vec<u32>>();
            // The native runtime flushes subnormal results to 0 (the interpreter keeps them): 3e38's quotients are.
            let flushed =
                |t: &Tensor| bits(t).iter().map(|&b| if b & 0x7f80_0000 == 0 { 0 } else { b }).collect::<Vec<_>>();
            assert_eq!(flushed(want), flushed(got), "{name} on {backend:?}");
        }
    }
}

/// On the AVX2 kernels, an inference program keeps the weights its products read packed between runs (`dfc_cpu`'s
/// `kept`), and a training step keeps none (it writes them): `kept_follows_every_write`. The kernels are chosen
/// once per process: the test runs itself again with `DFC_GEMM=avx2`.
#[test]
fn kept_weights_follow_every_write_of_them() {
    const NAME: &str = "kept_weights_follow_every_write_of_them";
    if !avx2_rerun::in_rerun() {
        return avx2_rerun::rerun_on_avx2_kernels(&[NAME, "--exact"], &[], 1);
    }
    let plan = plan("mlp", Cluster::local(1, DeviceKind::Cpu), Strategy::Single);
    kept_follows_every_write(&plan, &["h1/w", "h2/w", "logits/w"]);
}

/// On every kernel, an inference program keeps the filter of the CNN's second convolution transformed for Winograd
/// between runs (`dfc_kernels::KeptFilter`), at a batch of one, where that made Winograd pay on the AVX-512 kernels
/// too, and at a batch of eight: `kept_follows_every_write`, here and again on the AVX2 kernels.
#[test]
fn kept_filters_follow_every_write_of_them() {
    const NAME: &str = "kept_filters_follow_every_write_of_them";
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/cnn.df");
    let source = std::fs::read_to_string(path).expect("the example");
    for batch in [1, 8] {
        let dims = Some(vec![("batch".to_string(), batch)]);
        let plan = plan_with_dims(&source, "cnn", Cluster::local(1, DeviceKind::Cpu), Strategy::Single, dims);
        // At a batch of eight the AVX2 kernels (a rerun's, or a CPU's without AVX-512) keep the dense layers'
        // panels too.
        let panels: &[&str] = if batch > 3 && dfc_gemm::on_avx2_kernels() { &["hidden/w", "logits/w"] } else { &[] };
        let mut weights = [&["c2/kernel"], panels].concat();
        weights.sort();
        kept_follows_every_write(&plan, &weights);
    }
    if !avx2_rerun::in_rerun() {
        avx2_rerun::rerun_on_avx2_kernels(&[NAME, "--exact"], &[], 1);
    }
}

/// An inference program keeps what it keeps of `kept` (by name, in order) between runs, and a training step keeps
/// nothing (it writes its weights). Run after run, after training steps of another program, and after the weights are
/// set from outside (a checkpoint restored), its logits are the bits of a program made afresh (which lays the weights
/// out anew) and agree with the interpreter's.
fn kept_follows_every_write(plan: &Plan, kept: &[&str]) {
    let data = batches(plan);
    let training = plan.training.as_ref().unwrap();
    let updates: Vec<&str> = training.updates.iter().map(String::as_str).collect();
    let mut native = Session::with_backend(plan, 0, Backend::Llvm).unwrap();
    let mut interp = Session::with_backend(plan, 0, Backend::Interp).unwrap();
    let loss = training.loss_node.as_str();
    let (weights, native_step) = (kept, native.program(&[loss], &updates).unwrap());
    let kept = native.program(&["logits"], &[]).unwrap();
    let interp_step = interp.program(&[loss], &updates).unwrap();
    assert_eq!(kept.kept_weights(), weights);
    assert_eq!(native_step.kept_weights(), Vec::<String>::new(), "a training step writes its weights");
    let check = |what: &str, native: &mut Session, interp: &mut Session, feeds: &HashMap<String, Tensor>| {
        let found = native.run(&kept, feeds).unwrap().remove(0);
        let afresh = native.program(&["logits"], &[]).unwrap();
        let packed_anew = native.run(&afresh, feeds).unwrap().remove(0);
        assert_eq!(found, packed_anew, "{what}: the logits from the kept weights and from a program made afresh");
        let program = interp.program(&["logits"], &[]).unwrap();
        assert_close(what, &interp.run(&program, feeds).unwrap()[0], &found);
    };
    for (i, feeds) in data.iter().enumerate() {
        check(&format!("run {i}"), &mut native, &mut interp, feeds);
    }
    for (i, feeds) in data.iter().enumerate() {
        native.run(&native_step, feeds).unwrap();
        interp.run(&interp_step, feeds).unwrap();
        check(&format!("after training step {i}"), &mut native, &mut interp, feeds);
    }
    let restored: std::collections::BTreeMap<String, Tensor> = native
        .variables()
        .unwrap()
        .iter()
        .map(|(name, value)| {
            let halved = value.to_f64_vec().iter().map(|&x| (x / 2.0) as f32).collect::<Vec<f32>>();
            (name.clone(), Tensor::from_vec(value.ty().shape.dims().to_vec(), halved))
        })
        .collect();
    let path = std::path::Path::new("halved.safetensors");
    native.restore(&restored, path).unwrap();
    interp.restore(&restored, path).unwrap();
    check("after a restore", &mut native, &mut interp, &data[0]);
}
