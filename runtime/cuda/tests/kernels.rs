//! On a machine with an NVIDIA GPU: every fused kernel of every example, run on the GPU on the
//! values the reference interpreter computes for its inputs, gives the interpreter's value of
//! its root (f32 within 1e-4 relative: the GPU's exp and log are PTX approximations; integers
//! and booleans exactly). An assignment's kernel updates its variable in place, as the CPU's
//! does.
//!
//! Without a GPU (CI) it records a skip (`tests/support/skip.rs`); `DFC_GPU_REQUIRED=1` (or
//! `DFC_REQUIRE=gpu`) makes that a failure, for runs on GPU machines. The same check runs everywhere with the CPU's kernels in the GPU's place,
//! which keeps the harness itself tested, and with the grid emulator (`dfc_cuda::emulator`),
//! which runs each kernel as its GPU launch would.

use dfc_codegen::GpuKernel;
use dfc_compile::{compile, CompileOptions};
use dfc_cuda::emulator;
use dfc_interp::{Program, Tensor, Variables};
use dfc_ir::{Cluster, DType, DeviceKind, Module, NodeId, Op, TensorRef};
use std::collections::HashMap;
use std::path::PathBuf;

const F32_TOLERANCE: f64 = 1e-4;

#[path = "../../../tests/support/skip.rs"]
mod skip;

/// Whether there is a GPU; if not, records the skip (a failure where `DFC_GPU_REQUIRED` is set).
fn gpu_available() -> bool {
    match dfc_cuda::device_count() {
        Ok(n) if n > 0 => true,
        other => {
            let why = if dfc_cuda::driver_present() { "no device" } else { "no driver" };
            skip::skip(skip::Need::Gpu, &format!("no GPU here ({why}: {other:?})"));
            false
        }
    }
}

/// The PTX of a one-partition GPU plan, generated as the runtime generates it.
fn gpu_code(plan: &dfc_plan::Plan) -> dfc_codegen::GpuCode {
    dfc_codegen::compile_gpu(&plan.partitions[0].module, &plan.kept_nodes(0)).expect("the PTX is generated")
}

fn gpu_plan(example: &str) -> dfc_plan::Plan {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples");
    let source = std::fs::read_to_string(root.join(format!("{example}.df"))).unwrap();
    gpu_plan_of(example, &source)
}

/// The plan of `source` on one GPU.
fn gpu_plan_of(example: &str, source: &str) -> dfc_plan::Plan {
    let dims: &[(&str, i64)] = match example {
        "cnn" => &[("batch", 8)],
        "wide_and_deep" => &[("batch", 16), ("users", 200)],
        _ => &[],
    };
    let options = CompileOptions {
        sema: dfc_sema::Options { dims: dims.iter().map(|(n, v)| (n.to_string(), *v)).collect(), optimizer: None },
        cluster: Cluster::local(1, DeviceKind::Gpu),
        // wide_and_deep asks for ps and worker jobs that one GPU's cluster lacks.
        soft_placement: true,
        ..CompileOptions::default()
    };
    compile(source, &format!("{example}.df"), &options).unwrap_or_else(|_| panic!("{example} compiles")).plan
}

fn random_feeds(plan: &dfc_plan::Plan) -> HashMap<String, Tensor> {
    let mut rng = fastrand::Rng::with_seed(11);
    plan.inputs
        .iter()
        .map(|input| {
            let n = input.ty.shape.n_elements();
            let dims = input.ty.shape.dims().to_vec();
            let tensor = match input.ty.dtype {
                DType::I32 => Tensor::from_vec(dims, (0..n).map(|_| rng.i32(0..10)).collect::<Vec<i32>>()),
                DType::U8 => Tensor::from_vec(dims, (0..n).map(|_| rng.u8(..)).collect::<Vec<u8>>()),
                DType::F32 => Tensor::from_vec(dims, (0..n).map(|_| rng.f32() * 2.0 - 1.0).collect::<Vec<f32>>()),
                other => panic!("no test data for {other} inputs"),
            };
            (input.name.clone(), tensor)
        })
        .collect()
}

fn is_assignment(module: &Module, id: NodeId) -> bool {
    matches!(module.graph.node(id).op, Op::Assign | Op::AssignAdd | Op::AssignSub)
}

fn close(what: &str, want: &Tensor, got: &Tensor) -> Result<(), String> {
    if want.ty() != got.ty() {
        return Err(format!("{what}: type {} instead of {}", got.ty(), want.ty()));
    }
    let exact = !matches!(want.dtype(), DType::F32 | DType::F64);
    for (i, (w, g)) in want.to_f64_vec().iter().zip(got.to_f64_vec()).enumerate() {
        let ok = if exact || !w.is_finite() {
            *w == g || (w.is_nan() && g.is_nan())
        } else {
            (w - g).abs() <= F32_TOLERANCE * w.abs().max(1.0)
        };
        if !ok {
            return Err(format!("{what}: element {i} is {g}, the interpreter's {w}"));
        }
    }
    Ok(())
}

/// Runs one kernel: its index in the partition's code, the kernel, the buffers, and which
/// buffer each argument is; gives every buffer after the run.
type Runner<'r> = dyn Fn(usize, &GpuKernel, &[Vec<u8>], &[usize]) -> Result<Vec<Vec<u8>>, String> + 'r;

/// Every kernel of every example through `run` (loaded by `load` for each example), against
/// the interpreter. Returns how many kernels were checked, and what disagreed, as
/// (example, kernel function, root op, message).
fn check_every_kernel<'g>(load: &dyn Fn(&dfc_plan::Plan) -> Box<Runner<'g>>) -> (usize, Vec<Failure>) {
    let examples = ["softmax_regression", "mlp", "cnn", "linear_regression", "ridge_regression", "wide_and_deep"];
    check_kernels(examples.iter().map(|example| (example.to_string(), gpu_plan(example))).collect(), load)
}

/// [`check_every_kernel`] over the given plans, each named.
fn check_kernels<'g>(
    plans: Vec<(String, dfc_plan::Plan)>,
    load: &dyn Fn(&dfc_plan::Plan) -> Box<Runner<'g>>,
) -> (usize, Vec<Failure>) {
    let mut failures = Vec::new();
    let mut checked = 0;
    for (example, plan) in plans {
        let example = example.as_str();
        let partition = &plan.partitions[0];
        let module = &partition.module;
        let code = &gpu_code(&plan);
        let run = load(&plan);
        let feeds = random_feeds(&plan);
        let variables: Variables = dfc_interp::initialize(module, 0);
        let variable_value = |id: NodeId| variables.get(&module.graph.node(id).name).cloned();

        // Every value a kernel reads, and every root's value (an assignment's: its new value).
        let mut fetches: Vec<TensorRef> = Vec::new();
        for kernel in &code.kernels {
            fetches.extend(kernel.inputs.iter().filter(|t| variable_value(t.node).is_none()));
            if !is_assignment(module, kernel.root) {
                fetches.push(TensorRef { node: kernel.root, port: 0 });
            }
        }
        fetches.sort_by_key(|t| (t.node, t.port));
        fetches.dedup();
        let program = Program::new(module, &fetches, &[]).expect("the interpreter's program");
        let values = program.run(module, &mut variables.clone(), &feeds).expect("the interpreter runs");
        let value: HashMap<TensorRef, Tensor> = fetches.iter().copied().zip(values).collect();

        for (index, kernel) in code.kernels.iter().enumerate() {
            let what = format!("{example}: kernel {}", kernel.function);
            let bytes = |t: &TensorRef| variable_value(t.node).unwrap_or_else(|| value[t].clone()).to_le_bytes();
            let mut buffers: Vec<Vec<u8>> = kernel.inputs.iter().map(bytes).collect();
            let mut args: Vec<usize> = (0..buffers.len()).collect();
            let root = module.graph.node(kernel.root);
            let (out, want) = if is_assignment(module, kernel.root) {
                // In place: the variable's buffer is the output, as on the CPU.
                let variable = module.graph.inputs(kernel.root)[0];
                let at = match kernel.inputs.iter().position(|t| *t == variable) {
                    Some(i) => i,
                    None => {
                        buffers.push(variable_value(variable.node).unwrap().to_le_bytes());
                        buffers.len() - 1
                    }
                };
                let mut after = variables.clone();
                Program::new(module, &[], &[kernel.root]).unwrap().run(module, &mut after, &feeds).unwrap();
                (at, after.get(&module.graph.node(variable.node).name).unwrap().clone())
            } else {
                buffers.push(vec![0; Tensor::zeros(&root.outputs[0]).to_le_bytes().len()]);
                (buffers.len() - 1, value[&TensorRef { node: kernel.root, port: 0 }].clone())
            };
            args.push(out);
            let failure = |message: String| Failure {
                example: example.to_string(),
                function: kernel.function.clone(),
                root: root.op.clone(),
                message,
            };
            match run(index, kernel, &buffers, &args) {
                Ok(after) => {
                    let got = Tensor::from_le_bytes(&want.ty(), &after[out]).expect("the output's size");
                    failures.extend(close(&what, &want, &got).err().map(failure));
                }
                Err(e) => failures.push(failure(format!("{what}: {e}"))),
            }
            checked += 1;
        }
    }
    (checked, failures)
}

/// A kernel that disagreed with the interpreter.
#[derive(Debug)]
struct Failure {
    example: String,
    function: String,
    root: Op,
    message: String,
}

fn assert_none(failures: &[Failure]) {
    let messages: Vec<&str> = failures.iter().map(|f| f.message.as_str()).collect();
    assert!(failures.is_empty(), "{}", messages.join("\n"));
}

#[test]
fn every_kernel_of_every_example_agrees_with_the_interpreter() {
    if !gpu_available() {
        return;
    }
    let gpu = dfc_cuda::Gpu::open(0).expect("GPU 0 opens");
    println!("on {}", gpu.describe());
    let (checked, failures) = check_every_kernel(&|plan| {
        let partition = &plan.partitions[0];
        let kernels = gpu.load(&gpu_code(plan), &partition.device.to_string()).expect("the PTX loads");
        Box::new(move |_, kernel, buffers, args| kernels.run(kernel, buffers, args).map_err(|e| e.to_string()))
    });
    println!("{checked} kernels checked");
    assert_none(&failures);
}

/// The check above, with each kernel run by the CPU's code for the same fusion instead of the
/// GPU: it runs everywhere, and keeps the harness (buffers, arguments, in-place assignments,
/// the interpreter's values) honest for the GPU runs.
#[test]
fn the_kernel_harness_agrees_with_the_interpreter_on_the_cpu() {
    let (checked, failures) = check_every_kernel(&|plan| cpu_runner(plan, Launch::Whole));
    assert_none(&failures);
    assert!(checked > 50, "{checked} kernels");
}

/// The grid emulator (`dfc_cuda::emulator`) runs each kernel as its GPU launches would: the
/// host flavour of each launch's per-thread function once per thread of the grid, threads in
/// a shuffled order on two host threads, reductions over the outermost loop in their passes
/// (lanes into partials, then combining passes). Every kernel of every example agrees with the
/// interpreter so, and the emulated kernels are described exactly as the PTX's are.
#[test]
fn the_grid_emulator_runs_every_kernel_as_its_launches_do() {
    let (checked, failures) = check_every_kernel(&|plan| {
        let partition = &plan.partitions[0];
        let emulated = emulator::Emulated::load(&partition.module, &plan.kept_nodes(0)).expect("the host's code");
        assert_eq!(emulated.kernels(), gpu_code(plan).kernels, "the emulated kernels are the GPU's");
        Box::new(move |_, kernel, buffers, args| emulated.run(kernel, buffers, args, 5).map_err(|e| e.to_string()))
    });
    assert_none(&failures);
    assert!(checked > 100, "{checked} kernels");
}

/// Reductions over many rows, of every kind, floats and integers, run in several passes (lanes,
/// then combining passes of `FAN_IN` partials, each a tree in a block's shared memory folded
/// phase by phase between barriers, the last finishing a mean) and agree with the interpreter
/// under the emulator.
#[test]
fn large_reductions_run_in_passes_and_agree_with_the_interpreter() {
    let source = "
        model reductions {
            input x: f32[100000, 3]
            input n: i32[200000]
            let columns = sum(x, axis = 0)
            let average = mean(x * x)
            let highest = max(x, axis = 0)
            let lowest = min(x)
            let count = sum(n)
            output columns
            output average
            output highest
            output lowest
            output count
        }";
    let plan = gpu_plan_of("reductions", source);
    let code = gpu_code(&plan);
    let passes: Vec<usize> = code.kernels.iter().map(|k| k.launches().len()).collect();
    assert!(code.kernels.iter().all(|k| k.reduction.is_some()), "{:#?}", code.kernels);
    assert!(passes.iter().all(|&p| p >= 3), "two combining passes or more each: {passes:?}");
    let (checked, failures) = check_kernels(vec![("reductions".into(), plan)], &|plan| {
        let partition = &plan.partitions[0];
        let emulated = emulator::Emulated::load(&partition.module, &plan.kept_nodes(0)).expect("the host's code");
        Box::new(move |_, kernel, buffers, args| emulated.run(kernel, buffers, args, 9).map_err(|e| e.to_string()))
    });
    assert_none(&failures);
    assert_eq!(checked, 5);
}

/// The emulator catches the class of bug that running a kernel once over all its rows hides:
/// with every kernel's rows split one per thread (what the GPU entry did for every kernel
/// before reductions over the outermost loop ran in passes), each thread of such a reduction
/// initialises the shared output, adds its own row and finishes it (linear_regression's mean
/// loss: stores 0, adds one squared error, scales by 1/32). Run so, as a grid of shuffled
/// threads, the CPU's kernels disagree with the interpreter in exactly those kernels.
#[test]
fn the_grid_emulator_catches_a_reduction_split_among_threads() {
    let (checked, failures) = check_every_kernel(&|plan| cpu_runner(plan, Launch::RowPerThread { seed: 5 }));
    let across_rows = |op: &Op| matches!(op, Op::Reduce { axes, .. } if axes.contains(&0));
    let others: Vec<&Failure> = failures.iter().filter(|f| !across_rows(&f.root)).collect();
    assert!(others.is_empty(), "kernels that write their own rows disagree under the emulator: {others:#?}");
    assert!(
        failures.iter().any(|f| f.example == "linear_regression" && f.function.contains("loss")),
        "the emulator did not catch linear_regression's mean loss: {failures:#?}"
    );
    // 20 of the 22: the other two give every row's value alike on these inputs (ridge's penalty
    // sums the squares of weights that start at zero; cnn's accuracy over 8 random examples).
    assert!(failures.len() >= 20, "only {} reductions caught: {failures:#?}", failures.len());
    println!("{checked} kernels emulated; {} reductions split among threads caught", failures.len());
}

/// How the CPU runs a kernel: once over all its rows (what a CPU does), or as a GPU's grid with
/// a thread per row (every kernel's rows, reductions over them included).
#[derive(Clone, Copy)]
enum Launch {
    Whole,
    RowPerThread { seed: u64 },
}

/// A runner with the CPU's code for the plan's one partition (the same fusion as the GPU's).
fn cpu_runner<'g>(plan: &dfc_plan::Plan, launch: Launch) -> Box<Runner<'g>> {
    let partition = &plan.partitions[0];
    let cache = dfc_codegen::CodeCache::disabled();
    let host = dfc_codegen::host_target();
    let jit = dfc_cpu::load_partition(&cache, &partition.module, &plan.kept_nodes(0), &host).unwrap();
    let gpu = gpu_code(plan);
    // The same kernels in the same order (their functions' names differ: the CPU's code has
    // one function per distinct kernel).
    let fused: Vec<_> = jit.kernels().iter().map(|k| (k.root, &k.members, &k.inputs)).collect();
    let gpu_fused: Vec<_> = gpu.kernels.iter().map(|k| (k.root, &k.members, &k.inputs)).collect();
    assert_eq!(fused, gpu_fused, "the CPU and GPU code fuse alike");
    Box::new(move |index, kernel, buffers, args| {
        let function = jit.function(&jit.kernels()[index].function).ok_or("no such kernel")?;
        // 16-byte aligned copies, as the CPU's arena gives.
        let mut aligned: Vec<Vec<u128>> = buffers.iter().map(|b| vec![0u128; b.len().div_ceil(16)]).collect();
        for (a, b) in aligned.iter_mut().zip(buffers) {
            bytemuck_copy(a, b);
        }
        let pointers: Vec<*mut u8> = args.iter().map(|&i| aligned[i].as_mut_ptr() as *mut u8).collect();
        let arguments = Arguments(pointers);
        let call = |begin: u64, end: u64| {
            // SAFETY: the kernel reads and writes its arguments' types' sizes, which the buffers
            // have, for rows within its `rows`; called from one thread at a time.
            unsafe { function(arguments.as_ptr(), begin as i64, end as i64) }
        };
        match launch {
            Launch::Whole => call(0, kernel.rows),
            // One host thread: forced apart, a reduction's rows race for its output.
            Launch::RowPerThread { seed } => {
                let (block, grid) = dfc_codegen::launch(kernel.rows);
                let threads = u64::from(block) * u64::from(grid);
                emulator::run_threads(threads, seed, 1, |row| {
                    if row < kernel.rows {
                        call(row, row + 1)
                    }
                });
            }
        }
        Ok(aligned.iter().zip(buffers).map(|(a, b)| as_bytes(a)[..b.len()].to_vec()).collect())
    })
}

/// A kernel's argument pointers.
struct Arguments(Vec<*mut u8>);

impl Arguments {
    fn as_ptr(&self) -> *const *mut u8 {
        self.0.as_ptr()
    }
}

// SAFETY: the pointers are only passed to the kernel, from one thread at a time (the emulator's
// `run_threads` with one worker); the buffers outlive every call.
unsafe impl Sync for Arguments {}

fn bytemuck_copy(to: &mut [u128], from: &[u8]) {
    let bytes = as_bytes_mut(to);
    bytes[..from.len()].copy_from_slice(from);
}

fn as_bytes(words: &[u128]) -> &[u8] {
    // SAFETY: u128 has no padding; every byte is initialised.
    unsafe { std::slice::from_raw_parts(words.as_ptr() as *const u8, words.len() * 16) }
}

fn as_bytes_mut(words: &mut [u128]) -> &mut [u8] {
    // SAFETY: as above; any byte pattern is a valid u128.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr() as *mut u8, words.len() * 16) }
}
