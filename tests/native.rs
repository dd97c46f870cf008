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
    compile(&source, &format!("{example}.df"), &options).unwrap_or_else(|e| panic!("{example}: {e:?}")).plan
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
    let plan = plan(example, cluster, strategy);
    let data = batches(&plan);
    let (ref_seen, ref_vars) = run(&plan, Backend::Interp, &data);
    let (seen, vars) = run(&plan, Backend::Llvm, &data);
    assert_eq!(ref_seen.len(), seen.len());
    for (i, (a, b)) in ref_seen.iter().zip(&seen).enumerate() {
        assert_close(&format!("{example} fetch {i}"), a, b);
    }
    for ((name, a), (_, b)) in ref_vars.iter().zip(&vars) {
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
