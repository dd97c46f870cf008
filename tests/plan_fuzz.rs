//! Damaged plans with a recomputed checksum (a bit flip before the checksum was computed, a
//! bad disk, a crafted file): each is refused with a message or runs correctly — never a
//! panic, an abort, a signal or a hang. Plans are data: `decode` verifies their IR in full and
//! code is generated from it where the plan runs.
//!
//! In process, thousands of mutations of plans of every strategy go through `decode`, the
//! summary `dfc inspect` prints, and a session on both backends that runs training steps on
//! random inputs (a panic is caught and reported with the mutation that caused it; an abort
//! would end the test). Through the binary, a sample of them goes through `dfc inspect`,
//! `dfc bench` and `dfc run`, each of which must end with status 0 or 1, no panic, within a
//! deadline.

use dfc_compile::{compile, CompileOptions, Strategy};
use dfc_driver::{Backend, Session};
use dfc_interp::Tensor;
use dfc_ir::{Cluster, DType, DeviceKind, TensorType};
use dfc_plan::{Plan, HEADER_LEN};
use std::collections::HashMap;
use std::io::Read as _;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn scratch() -> PathBuf {
    let dir = root().join("target").join("plan-fuzz");
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// Plans of every strategy: the examples on one device, the MLP mirrored and model-parallel,
/// wide_and_deep on parameter servers (sync and async).
fn plans() -> Vec<(String, Vec<u8>)> {
    let cases: [(&str, &str, Option<&str>, Strategy); 9] = [
        ("mlp", "mlp", None, Strategy::Single),
        ("cnn", "cnn", None, Strategy::Single),
        ("linear_regression", "linear_regression", None, Strategy::Single),
        ("mlp mirrored on 2", "mlp", Some("2"), Strategy::Mirrored),
        // Replicas 2 and 3 as instances of replica 1's partition.
        ("mlp mirrored on 4", "mlp", Some("4"), Strategy::Mirrored),
        ("mlp model-parallel on 3", "mlp", Some("3"), Strategy::Model),
        // Local SGD: its averages, replicas 2 and 3's as instances.
        ("mlp local SGD on 4", "mlp", Some("4"), Strategy::Mirrored),
        ("wide_and_deep ps sync", "wide_and_deep", Some("ps"), Strategy::ParameterServer { sync: true }),
        ("wide_and_deep ps async", "wide_and_deep", Some("ps"), Strategy::ParameterServer { sync: false }),
    ];
    cases
        .iter()
        .map(|(name, example, devices, strategy)| {
            let path = root().join("examples").join(format!("{example}.df"));
            let source = std::fs::read_to_string(&path).expect("example");
            let cluster = match *devices {
                None => Cluster::local(1, DeviceKind::Cpu),
                Some("ps") => Cluster::from_json(
                    r#"{"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"], "ps": ["127.0.0.1:3", "127.0.0.1:4"]}}"#,
                )
                .expect("cluster"),
                Some(n) => Cluster::local(n.parse().unwrap(), DeviceKind::Cpu),
            };
            let sync_every = name.contains("local SGD").then_some(2);
            let mut options = CompileOptions { cluster, strategy: *strategy, sync_every, ..CompileOptions::default() };
            // Small batches keep each mutated run short.
            options.sema.dims.push(("batch".into(), 8));
            let compiled = compile(&source, &format!("{example}.df"), &options)
                .unwrap_or_else(|e| panic!("{name} compiles: {e:?}"));
            (name.to_string(), dfc_plan::encode(&compiled.plan))
        })
        .collect()
}

/// A mutation of a plan file's payload, the checksum then made right again.
fn mutate(plan: &[u8], rng: &mut fastrand::Rng) -> Vec<u8> {
    let mut bytes = plan.to_vec();
    let payload_len = bytes.len() - HEADER_LEN;
    let at = HEADER_LEN + rng.usize(..payload_len);
    match rng.u8(..6) {
        0 => bytes[at] ^= 1 << rng.u8(..8),
        1 => bytes[at] = [0x00, 0x01, 0x7f, 0x80, 0xff][rng.usize(..5)],
        2 => bytes[at] = rng.u8(..),
        3 => {
            // A varint made long: a length or a dimension becomes huge.
            let run = rng.usize(1..6).min(bytes.len() - at);
            bytes[at..at + run].fill(0xff);
            if at + run < bytes.len() {
                bytes[at + run] = 0x0f;
            }
        }
        4 => {
            bytes.remove(at);
        }
        _ => bytes.insert(at, rng.u8(..)),
    }
    let payload = &bytes[HEADER_LEN..];
    let (length, checksum) = (payload.len() as u64, crc32fast::hash(payload));
    bytes[12..20].copy_from_slice(&length.to_le_bytes());
    bytes[20..24].copy_from_slice(&checksum.to_le_bytes());
    bytes
}

/// Random inputs of every type the plan declares (integers in 0..10: valid labels and ids of
/// the examples).
fn random_feeds(plan: &Plan, rng: &mut fastrand::Rng) -> HashMap<String, Tensor> {
    plan.inputs.iter().map(|input| (input.name.clone(), random_tensor(&input.ty, rng))).collect()
}

fn random_tensor(ty: &TensorType, rng: &mut fastrand::Rng) -> Tensor {
    let shape = ty.shape.clone();
    let n = shape.n_elements();
    match ty.dtype {
        DType::F32 => Tensor::from_vec(shape, (0..n).map(|_| rng.f32() - 0.5).collect::<Vec<f32>>()),
        DType::F64 => Tensor::from_vec(shape, (0..n).map(|_| rng.f64() - 0.5).collect::<Vec<f64>>()),
        DType::U8 => Tensor::from_vec(shape, (0..n).map(|_| rng.u8(..)).collect::<Vec<u8>>()),
        DType::I32 => Tensor::from_vec(shape, (0..n).map(|_| rng.i32(0..10)).collect::<Vec<i32>>()),
        DType::I64 => Tensor::from_vec(shape, (0..n).map(|_| rng.i64(0..10)).collect::<Vec<i64>>()),
        DType::Bool => Tensor::from_vec(shape, (0..n).map(|_| rng.bool()).collect::<Vec<bool>>()),
    }
}

/// What a decoded plan must survive: the summary, and two training steps (or forward passes)
/// on `backend`, whose fetched values it returns if both ran. Errors are fine; the caller
/// catches panics.
fn exercise(plan: &Plan, backend: Backend, rng: &mut fastrand::Rng) -> Option<Vec<Tensor>> {
    let summary = dfc_plan::summary(plan);
    let _ = summary.to_string();
    let _ = serde_json::to_string(&summary);
    let mut session = Session::with_backend(plan, 0, backend).ok()?;
    let (fetches, targets): (Vec<&str>, Vec<&str>) = match &plan.training {
        Some(t) => (vec![t.loss_node.as_str()], t.updates.iter().map(String::as_str).collect()),
        None => (plan.outputs.iter().map(|o| o.name.as_str()).collect(), Vec::new()),
    };
    let program = session.program(&fetches, &targets).ok()?;
    let feeds = random_feeds(plan, rng);
    let mut fetched = Vec::new();
    for _ in 0..2 {
        fetched.extend(session.run(&program, &feeds).ok()?);
    }
    Some(fetched)
}

/// Where the two backends' values of a plan that both ran differ by more than rounding (a
/// product sums in another order natively); NaNs must be NaNs on both sides.
fn disagreement(interp: &[Tensor], native: &[Tensor]) -> Option<String> {
    if interp.len() != native.len() {
        return Some(format!("{} values from the interpreter, {} natively", interp.len(), native.len()));
    }
    for (i, (a, b)) in interp.iter().zip(native).enumerate() {
        if a.ty() != b.ty() {
            return Some(format!("value {i}: {} from the interpreter, {} natively", a.ty(), b.ty()));
        }
        for (j, (x, y)) in a.to_f64_vec().into_iter().zip(b.to_f64_vec()).enumerate() {
            let same = (x.is_nan() && y.is_nan()) || x == y || (x - y).abs() <= 1e-3 * (1.0 + x.abs());
            if !same {
                return Some(format!("value {i}, element {j}: {x} from the interpreter, {y} natively"));
            }
        }
    }
    None
}

#[test]
fn mutated_plans_are_refused_or_run_in_process() {
    let mutations: usize = std::env::var("DFC_PLAN_FUZZ_MUTATIONS").ok().and_then(|n| n.parse().ok()).unwrap_or(3000);
    // Code generated for mutated plans is not worth keeping.
    std::env::set_var(dfc_codegen::CACHE_DIR_VARIABLE, "off");
    let plans = plans();
    let mut rng = fastrand::Rng::with_seed(0x706c_616e);
    let (mut accepted, mut panics, mut disagreements, mut ran_both) = (0, Vec::new(), Vec::new(), 0);
    let started = Instant::now();
    for i in 0..mutations {
        let (name, good) = &plans[i % plans.len()];
        let bytes = mutate(good, &mut rng);
        let Ok(plan) = dfc_plan::decode(&bytes) else { continue };
        accepted += 1;
        // Both backends: the interpreter always, native code for one plan in four (each
        // generates code, which takes a while), on the same inputs; where both run, they
        // agree, so that "runs" means "runs correctly".
        let backends: &[Backend] =
            if accepted % 4 == 0 { &[Backend::Interp, Backend::Llvm] } else { &[Backend::Interp] };
        let seed = rng.u64(..);
        let mut results = Vec::new();
        for &backend in backends {
            let result =
                catch_unwind(AssertUnwindSafe(|| exercise(&plan, backend, &mut fastrand::Rng::with_seed(seed))));
            match result {
                Ok(values) => results.push(values),
                Err(_) => {
                    let path = scratch().join(format!("panic-{i}.plan"));
                    std::fs::write(&path, &bytes).expect("write the plan");
                    panics.push(format!("mutation {i} of {name} ({backend:?}): see {}", path.display()));
                }
            }
        }
        if let [Some(interp), Some(native)] = &results[..] {
            ran_both += 1;
            // Asynchronous replicas update shared variables without waiting for each other:
            // which replica's update another's second step reads first is theirs to race for
            // (the interpreter stages a run's updates, native code makes them in place), so
            // only their first step is compared.
            let compared = if plan.replicas.is_empty() { interp.len() } else { interp.len() / 2 };
            if let Some(why) = disagreement(&interp[..compared], &native[..compared.min(native.len())]) {
                let path = scratch().join(format!("disagreement-{i}.plan"));
                std::fs::write(&path, &bytes).expect("write the plan");
                disagreements.push(format!("mutation {i} of {name}: {why}; see {}", path.display()));
            }
        }
    }
    println!(
        "{mutations} mutations, {accepted} decoded, {ran_both} ran on both backends, in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    assert!(panics.is_empty(), "{} panics:\n{}", panics.len(), panics.join("\n"));
    assert!(disagreements.is_empty(), "{} disagreements:\n{}", disagreements.len(), disagreements.join("\n"));
    assert!(accepted > 0, "no mutation decoded: the test exercises nothing past decode");
}

/// Runs `dfc` with `args`, killing it after `deadline`: its exit status, and its stderr.
fn dfc_within(args: &[&str], deadline: Duration) -> (Option<i32>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_dfc"))
        .args(args)
        .env("NO_COLOR", "1")
        .env(dfc_codegen::CACHE_DIR_VARIABLE, "off")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run dfc");
    let mut stderr = child.stderr.take().expect("stderr");
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if started.elapsed() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("dfc {args:?} did not end within {deadline:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let text = reader.join().expect("reader");
    use std::os::unix::process::ExitStatusExt;
    if let Some(signal) = status.signal() {
        panic!("dfc {args:?} was killed by signal {signal}:\n{text}");
    }
    (status.code(), text)
}

fn write_feeds(plan: &Plan, dir: &Path, rng: &mut fastrand::Rng) -> Vec<String> {
    let mut args = Vec::new();
    for (name, tensor) in random_feeds(plan, rng) {
        let path = dir.join(format!("{name}.npy"));
        dfc_driver::save_npy(&path, &tensor).expect("write a feed");
        args.push("--feed".to_string());
        args.push(format!("{name}={}", path.display()));
    }
    args
}

#[test]
fn mutated_plans_are_refused_or_run_by_the_binary() {
    let per_plan: usize = std::env::var("DFC_PLAN_FUZZ_PROCESSES").ok().and_then(|n| n.parse().ok()).unwrap_or(12);
    let dir = scratch().join("binary");
    std::fs::create_dir_all(&dir).expect("dir");
    let mut rng = fastrand::Rng::with_seed(0x6269_6e61);
    let deadline = Duration::from_secs(120);
    let mut ran = 0;
    for (name, good) in plans().iter().filter(|(name, _)| !name.contains("ps")) {
        // Half mutations that decode (they reach the runtime), half any.
        let mut chosen = Vec::new();
        let mut tries = 0;
        while chosen.len() < per_plan && tries < 100_000 {
            tries += 1;
            let bytes = mutate(good, &mut rng);
            if chosen.len() % 2 == 1 || dfc_plan::decode(&bytes).is_ok() {
                chosen.push(bytes);
            }
        }
        let good_plan = dfc_plan::decode(good).expect("the unmutated plan decodes");
        let feeds = write_feeds(&good_plan, &dir, &mut rng);
        for (i, bytes) in chosen.iter().enumerate() {
            let path = dir.join(format!("{}-{i}.plan", name.replace(' ', "_")));
            std::fs::write(&path, bytes).expect("write the plan");
            let plan = path.to_str().expect("utf-8");
            let mut run: Vec<&str> = vec!["run", plan, "--steps", "2"];
            run.extend(feeds.iter().map(String::as_str));
            for args in [
                vec!["inspect", plan],
                vec!["bench", plan, "--warmup", "1", "--min-time", "0", "--min-steps", "1"],
                run,
            ] {
                let (code, stderr) = dfc_within(&args, deadline);
                assert!(
                    matches!(code, Some(0 | 1)) && !stderr.contains("panicked") && !stderr.contains("RUST_BACKTRACE"),
                    "dfc {args:?} ({name}, mutation {i}) ended with {code:?}:\n{stderr}"
                );
                if code == Some(1) {
                    assert!(stderr.contains("error"), "dfc {args:?} failed without saying why:\n{stderr}");
                }
                ran += 1;
            }
        }
    }
    println!("{ran} runs of dfc on mutated plans");
}

/// A local-SGD plan whose averages and their period disagree is refused on reading, naming
/// the problem.
#[test]
fn a_local_sgd_plan_needs_its_averages_and_their_period() {
    let (_, bytes) = plans().into_iter().find(|(name, _)| name.contains("local SGD")).expect("a local SGD plan");
    let plan = dfc_plan::decode(&bytes).expect("the plan decodes");
    assert_eq!(plan.training.as_ref().unwrap().averages.len(), 6 * 4, "each replica's copy of each parameter");
    let refused = |change: &dyn Fn(&mut Plan), expected: &str| {
        let mut damaged = plan.clone();
        damaged.instances.clear(); // decode built them; encode the built partitions
        change(&mut damaged);
        let error = dfc_plan::decode(&dfc_plan::encode(&damaged)).expect_err(expected).to_string();
        assert!(error.contains(expected), "{error}");
    };
    refused(&|p| p.strategy.sync_every = Some(0), "every 0 steps");
    refused(&|p| p.strategy.sync_every = None, "says not how often");
    refused(&|p| p.training.as_mut().unwrap().averages.clear(), "the plan has no averages");
    refused(
        &|p| p.training.as_mut().unwrap().averages.push("nowhere".into()),
        "the average `nowhere` is in no partition",
    );
}
