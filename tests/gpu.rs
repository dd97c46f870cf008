//! GPU plans on a machine without a GPU (CI's): PTX golden tests — every example compiled for
//! one GPU, its fused kernels' PTX compared with `tests/ptx/<example>.ptx` (`UPDATE_EXPECT=1`
//! rewrites; LLVM's NVPTX back end makes it, no CUDA needed) — and the `dfc` binary compiling,
//! inspecting and running GPU plans: a run without a GPU fails with a message that names the
//! device and what is missing.

#[path = "support/expect_file.rs"]
mod expect_file;
#[path = "support/ptxas.rs"]
mod ptxas;
#[path = "support/skip.rs"]
mod skip;

use dfc_compile::{compile, CompileOptions};
use dfc_ir::{Cluster, DeviceKind};
use std::path::PathBuf;
use std::process::Command;

const DFC: &str = env!("CARGO_BIN_EXE_dfc");

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every example, each compiled for one GPU.
/// The examples, a model of long rows (`tests/ptx/long_rows.df`: row ops one row per block)
/// one with dropout (`tests/ptx/dropout.df`: Philox in a fused kernel), one with layer norms
/// (`tests/ptx/layer_norm.df`: a thread a row and a block a row, forward and backward) and one
/// with batch norms (`tests/ptx/batch_norm.df`: its moments, normalisation and gradient kernels, and the training flag), and
/// causal self-attention (`tests/ptx/attention.df`: masked scores, batched products).
const EXAMPLES: [&str; 11] = [
    "softmax_regression",
    "mlp",
    "cnn",
    "linear_regression",
    "ridge_regression",
    "wide_and_deep",
    "long_rows",
    "dropout",
    "layer_norm",
    "batch_norm",
    "attention",
];

fn gpu_plan(example: &str) -> dfc_plan::Plan {
    let in_examples = root().join("examples").join(format!("{example}.df"));
    let path = if in_examples.exists() { in_examples } else { root().join("tests/ptx").join(format!("{example}.df")) };
    let source = std::fs::read_to_string(&path).unwrap();
    let options = CompileOptions {
        cluster: Cluster::local(1, DeviceKind::Gpu),
        // wide_and_deep asks for ps and worker jobs that one GPU's cluster lacks.
        soft_placement: true,
        ..CompileOptions::default()
    };
    let compiled =
        compile(&source, &format!("{example}.df"), &options).unwrap_or_else(|_| panic!("{example} compiles for a GPU"));
    compiled.plan
}

/// The PTX of a one-partition GPU plan, as the runtime generates it where the plan runs.
fn gpu_code(plan: &dfc_plan::Plan) -> dfc_codegen::GpuCode {
    dfc_codegen::compile_gpu(&plan.partitions[0].module, &plan.kept_nodes(0)).expect("the PTX is generated")
}

#[test]
fn every_examples_kernels_have_their_expected_ptx() {
    let mut failures = Vec::new();
    for example in EXAMPLES {
        let plan = gpu_plan(example);
        assert_eq!(plan.partitions.len(), 1);
        let gpu = &gpu_code(&plan);
        assert_eq!(gpu.arch, "sm_80");
        assert!(gpu.ptx.contains(".target sm_80"), "{example}: {}", &gpu.ptx[..gpu.ptx.len().min(400)]);
        let windowed = plan.partitions[0]
            .module
            .graph
            .node_ids()
            .filter(|&id| {
                use dfc_ir::Op;
                let op = &plan.partitions[0].module.graph.node(id).op;
                matches!(
                    op,
                    Op::Conv2d { .. }
                        | Op::Conv2dBackpropFilter { .. }
                        | Op::Conv2dBackpropInput { .. }
                        | Op::MaxPool { .. }
                        | Op::MaxPoolGrad { .. }
                        | Op::AvgPool { .. }
                        | Op::AvgPoolGrad { .. }
                        | Op::Transpose { .. }
                        | Op::Concat { .. }
                        | Op::Slice { .. }
                        | Op::Pad { .. }
                        | Op::Gather
                        | Op::ScatterAdd { .. }
                        | Op::Moments
                        | Op::BatchNorm { .. }
                        | Op::BatchNormGradMeans { .. }
                        | Op::BatchNormGrad { .. }
                )
            })
            .count();
        assert_eq!(
            gpu.ops.len(),
            windowed,
            "{example}: a kernel per convolution, pooling, their gradients, layout op, scatter-add and batch-norm op"
        );
        for kernel in gpu.kernels.iter().chain(&gpu.ops) {
            for launch in kernel.launches() {
                assert!(gpu.ptx.contains(&format!(".entry {}(", launch.function)), "{example}: no entry {launch:?}");
                // Whole warps.
                assert_eq!(launch.block % 32, 0, "{example}: {launch:?}");
            }
            // A thread per row, or per lane of a reduction over the outermost loop.
            let threads = kernel.reduction.as_ref().map_or(kernel.rows, |r| r.lanes);
            assert!(u64::from(kernel.block) * u64::from(kernel.grid) >= threads, "{example}: {kernel:?}");
            if let Some(reduction) = &kernel.reduction {
                assert!(reduction.lanes * reduction.chunk >= kernel.rows, "{example}: {kernel:?}");
                assert!(
                    (reduction.lanes - 1) * reduction.chunk < kernel.rows,
                    "{example}: a lane without rows: {kernel:?}"
                );
            }
        }
        // Every kernel's arguments stay in registers: no stack in local memory.
        assert!(!gpu.ptx.contains(".local"), "{example} uses local memory");
        // The C library does not exist on a GPU: nothing may call it.
        assert!(!gpu.ptx.contains(".extern .func"), "{example} calls an external function");
        let expected = root().join("tests/ptx").join(format!("{example}.ptx"));
        failures.extend(expect_file::expect_file(&expected, &gpu.ptx));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

fn dfc(args: &[&str]) -> (bool, String, String) {
    let output = Command::new(DFC).args(args).output().expect("run dfc");
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (output.status.success(), text(&output.stdout), text(&output.stderr))
}

#[test]
fn a_gpu_plan_compiles_and_without_a_gpu_its_run_says_what_is_missing() {
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("mlp.plan");
    let plan = plan.to_str().unwrap();
    let example = root().join("examples/mlp.df");
    let (ok, _, stderr) =
        dfc(&["compile", example.to_str().unwrap(), "--devices", "gpu:2", "--strategy", "mirrored", "-o", plan]);
    assert!(ok, "{stderr}");
    let (ok, stdout, _) = dfc(&["inspect", plan]);
    assert!(ok);
    assert!(stdout.contains("/job:localhost/task:0/gpu:1"), "{stdout}");
    // The plan carries IR, not code: PTX is generated where it runs.
    assert!(stdout.contains("fused kernels (compiled for each device where the plan runs)"), "{stdout}");
    assert!(!stdout.contains("PTX") && !stdout.contains("bitcode"), "{stdout}");

    let images = "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz";
    let labels = "/usr/share/datasets/fashion-mnist/train-labels-idx1-ubyte.gz";
    if !std::path::Path::new(images).exists() {
        skip::skip(skip::Need::FashionMnist, "the runs: no Fashion-MNIST (apt-get install dataset-fashion-mnist)");
        return;
    }
    let feeds = ["--feed", &format!("images={images}"), "--feed", &format!("labels={labels}")].map(String::from);
    let feeds: Vec<&str> = feeds.iter().map(String::as_str).collect();
    let (ok, _, stderr) = dfc(&[&["run", plan, "--steps", "2"][..], &feeds].concat());
    assert!(!ok, "a GPU plan does not run on the CPU's native code");
    assert!(stderr.contains("partition /job:localhost/task:0/gpu:0 runs on a GPU, but"), "{stderr}");
    if !dfc_cuda::driver_present() {
        assert!(stderr.contains("no NVIDIA driver") && stderr.contains("libcuda.so.1"), "{stderr}");
    }
    assert!(stderr.contains("--backend interp") && stderr.contains("--backend grid-emulator"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    // The reference interpreter runs any partition, GPU ones included, on the CPU; the grid
    // emulator runs the GPU partitions' own kernels on it, in one process or on two spawned
    // workers (one replica each, all-reducing through the ring), and all train alike.
    let mut losses = Vec::new();
    let runs: [&[&str]; 3] =
        [&["--backend", "interp"], &["--backend", "grid-emulator"], &["--backend", "grid-emulator", "--spawn", "2"]];
    for run in runs {
        let (ok, stdout, stderr) = dfc(&[&["run", plan, "--steps", "30"][..], run, &feeds].concat());
        assert!(ok, "{run:?}: {stderr}");
        let text = format!("{stdout}{stderr}");
        let loss = text.split("train loss ").nth(1).and_then(|rest| rest.split(',').next()).map(str::to_string);
        losses.push(loss.unwrap_or_else(|| panic!("{run:?}: no loss in {text}")));
    }
    assert!(
        losses.iter().all(|l| *l == losses[0]),
        "training losses: interpreter, emulator, emulator on workers: {losses:?}"
    );
    // Resuming from a checkpoint restores the variables a GPU device holds: the emulator (its
    // device's variables replaced by the checkpoint's) continues as the interpreter does.
    let mut resumed = Vec::new();
    for backend in ["interp", "grid-emulator"] {
        let checkpoints = dir.path().join(format!("checkpoints-{backend}"));
        let checkpoints = checkpoints.to_str().unwrap();
        for steps in ["20", "40"] {
            let run = ["run", plan, "--steps", steps, "--backend", backend, "--checkpoint-dir", checkpoints];
            let (ok, stdout, stderr) = dfc(&[&run[..], &feeds].concat());
            assert!(ok, "{backend}, {steps} steps: {stderr}");
            if steps == "40" {
                let text = format!("{stdout}{stderr}");
                assert!(text.contains("resuming from"), "{backend}: {text}");
                resumed.push(text.split("train loss ").nth(1).and_then(|r| r.split(',').next()).map(str::to_string));
            }
        }
    }
    assert!(resumed[0].is_some() && resumed[0] == resumed[1], "losses after resuming: {resumed:?}");
}

#[test]
fn devices_are_counted_and_typed() {
    let example = root().join("examples/mlp.df");
    for (devices, message) in
        [("gpu:0", "not a number of devices"), ("tpu:2", "not a device type"), ("gpu:x", "not a number")]
    {
        let (ok, _, stderr) = dfc(&["compile", example.to_str().unwrap(), "--devices", devices, "-o", "/dev/null"]);
        assert!(!ok && stderr.contains(message), "{devices}: {stderr}");
    }
}

/// The PTX is valid for the GPUs it is meant for: NVIDIA's own assembler takes every example's
/// kernels for Ampere (sm_80, what the PTX names) and Hopper (sm_90: H100, H200).
#[test]
fn ptxas_assembles_every_examples_kernels_for_ampere_and_hopper() {
    let Some(assembler) = ptxas::find() else {
        skip::skip(skip::Need::Ptxas, ptxas::MISSING);
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    for example in EXAMPLES {
        let gpu = gpu_code(&gpu_plan(example));
        ptxas::assemble(&assembler, &gpu.ptx, dir.path(), example).unwrap_or_else(|refused| panic!("{refused}"));
    }
}
