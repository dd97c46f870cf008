//! Differential tests of the LLVM backend against the reference interpreter: every example's
//! forward pass (outputs, loss, metrics) and training steps, on one device and partitioned.
//!
//! Tolerances: f32 results within 1e-5 relative (matrix products and convolutions sum in
//! another order than the interpreter; elementwise kernels and reductions sum in its order);
//! integer and boolean results exactly.

use dfc_compile::{compile, CompileOptions, Strategy};
use dfc_driver::{Backend, Session};
use dfc_interp::Tensor;
use dfc_ir::{Cluster, DType, DeviceKind};
use dfc_plan::Plan;
use std::collections::HashMap;
use std::path::PathBuf;

const STEPS: usize = 3;
const F32_TOLERANCE: f64 = 1e-5;

fn plan(example: &str, cluster: Cluster, strategy: Strategy) -> Plan {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples").join(format!("{example}.df"));
    let source = std::fs::read_to_string(&path).expect("example");
    plan_of(&source, example, cluster, strategy)
}

fn plan_of(source: &str, example: &str, cluster: Cluster, strategy: Strategy) -> Plan {
    let dims: Vec<(String, i64)> = match example {
        "cnn" => vec![("batch".into(), 8)],
        "wide_and_deep" => vec![("users".into(), 200)],
        _ => vec![],
    };
    let options = CompileOptions {
        sema: dfc_sema::Options { dims, optimizer: None },
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
    let variables = session.all_variables().iter().map(|(n, t)| (n.clone(), t.clone())).collect();
    (seen, variables)
}

fn assert_close(what: &str, reference: &Tensor, native: &Tensor) {
    assert_eq!(reference.ty(), native.ty(), "{what}: type");
    match reference.ty().dtype {
        DType::F32 | DType::F64 => {
            let (a, b) = (reference.to_f64_vec(), native.to_f64_vec());
            for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                let err = (x - y).abs() / (1.0 + x.abs());
                assert!(err <= F32_TOLERANCE, "{what}[{i}]: interpreter {x}, llvm {y}");
            }
        }
        _ => assert_eq!(reference, native, "{what}"),
    }
}

fn check(example: &str, cluster: Cluster, strategy: Strategy) {
    check_plan(example, &plan(example, cluster, strategy));
}

fn check_plan(example: &str, plan: &Plan) {
    let plan = plan.clone();
    let data = batches(&plan);
    let (ref_seen, ref_vars) = run(&plan, Backend::Interp, &data);
    let (seen, vars) = run(&plan, Backend::Llvm, &data);
    assert_eq!(ref_seen.len(), seen.len());
    for (i, (a, b)) in ref_seen.iter().zip(&seen).enumerate() {
        assert_close(&format!("{example} fetch {i}"), a, b);
    }
    assert_eq!(ref_vars.len(), vars.len(), "{example}: variables");
    for ((name, a), (name_b, b)) in ref_vars.iter().zip(&vars) {
        assert_eq!(name, name_b, "{example}: variables");
        assert_close(&format!("{example} variable {name}"), a, b);
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
fn partitioned_plans_run_natively() {
    check("mlp", Cluster::local(2, DeviceKind::Cpu), Strategy::Mirrored);
    check("softmax_regression", Cluster::local(3, DeviceKind::Cpu), Strategy::Model);
}

/// A plan carries its kernels compiled for the CPU that compiled it; a CPU without one of
/// its features compiles them again at load instead of running code it cannot.
#[test]
fn code_for_features_the_host_lacks_is_compiled_again_at_load() {
    let mut plan = plan("softmax_regression", Cluster::local(1, DeviceKind::Cpu), Strategy::Single);
    let own = Session::with_backend(&plan, 0, Backend::Llvm).expect("loads");
    assert!(own.recompiled().is_empty(), "the plan's own code fits this CPU");
    let code = plan.partitions[0].native.as_mut().expect("compile carries native code");
    assert!(!code.kernels.is_empty() && !code.bitcode.is_empty());
    code.target.features.push_str(",+dfc-imaginary-feature");
    let missing = dfc_codegen::missing_features(&code.target, &dfc_codegen::host_target());
    assert_eq!(missing, ["dfc-imaginary-feature"]);
    let mut session = Session::with_backend(&plan, 0, Backend::Llvm).expect("compiled again");
    assert_eq!(session.recompiled(), &[0]);
    let training = plan.training.as_ref().unwrap();
    let updates: Vec<&str> = training.updates.iter().map(String::as_str).collect();
    let step = session.program(&[training.loss_node.as_str()], &updates).unwrap();
    let loss = session.run(&step, &batches(&plan)[0]).unwrap()[0].scalar_f64();
    assert!(loss.is_finite());
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
