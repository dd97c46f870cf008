//! One plan, any x86-64 CPU: a plan holds IR and no code, so the plan compiled on this machine
//! (AVX-512 or not) is the byte-identical plan compiled on an AVX2-only CPU, and either runs
//! on both, each with the code generated where it runs. The AVX2-only CPU is an Intel Haswell
//! emulated by QEMU's user mode (`qemu-x86_64 -cpu Haswell`, Debian's qemu-user), which
//! reports Haswell's CPUID to dfc: dfc generates code for it (the cache entry's key says
//! `haswell`, without AVX-512) and its GEMM takes its AVX2 path.

use std::path::{Path, PathBuf};
use std::process::Command;

#[path = "support/skip.rs"]
mod skip;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn qemu() -> Option<PathBuf> {
    let path = PathBuf::from("/usr/bin/qemu-x86_64");
    path.exists().then_some(path)
}

/// `dfc args` natively, or under QEMU as a Haswell; with its own code cache.
fn dfc(haswell: bool, cache: &Path, args: &[&str]) -> String {
    let mut command = if haswell {
        let mut command = Command::new(qemu().expect("qemu"));
        command.args(["-cpu", "Haswell", env!("CARGO_BIN_EXE_dfc")]);
        command
    } else {
        Command::new(env!("CARGO_BIN_EXE_dfc"))
    };
    let output = command.args(args).env("DFC_CACHE_DIR", cache).output().expect("run dfc");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "dfc {args:?} (haswell: {haswell}):\n{stderr}");
    stderr
}

/// The bytes of every code cache entry in `dir`.
fn cache_entries(dir: &Path) -> Vec<Vec<u8>> {
    std::fs::read_dir(dir).unwrap().map(|e| std::fs::read(e.unwrap().path()).unwrap()).collect()
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn a_plan_compiled_on_one_cpu_trains_on_another() {
    if qemu().is_none() {
        skip::skip(
            skip::Need::Qemu,
            "no qemu-x86_64 to emulate an AVX2-only CPU (apt-get install qemu-user; .ci/run does)",
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let source = root().join("examples/mlp.df");
    let source = source.to_str().unwrap();
    let (native_plan, haswell_plan) = (dir.path().join("native.plan"), dir.path().join("haswell.plan"));
    let compile = |haswell: bool, plan: &Path| {
        let args = ["compile", source, "--dim", "batch=16", "-o", plan.to_str().unwrap()];
        dfc(haswell, &dir.path().join("unused-cache"), &args);
    };
    compile(false, &native_plan);
    compile(true, &haswell_plan);
    let plan = std::fs::read(&native_plan).unwrap();
    assert_eq!(plan, std::fs::read(&haswell_plan).unwrap(), "the plan does not depend on the CPU that compiled it");

    // Three batches of random images and labels: one epoch, then a checkpoint.
    let mut rng = fastrand::Rng::with_seed(5);
    let images: Vec<u8> = (0..48 * 28 * 28).map(|_| rng.u8(..)).collect();
    let labels: Vec<i32> = (0..48).map(|_| rng.i32(0..10)).collect();
    let images_path = dir.path().join("images.npy");
    let labels_path = dir.path().join("labels.npy");
    dfc_driver::save_npy(&images_path, &dfc_interp::Tensor::from_vec(vec![48, 28, 28], images)).unwrap();
    dfc_driver::save_npy(&labels_path, &dfc_interp::Tensor::from_vec(vec![48], labels)).unwrap();

    let train = |haswell: bool, name: &str| {
        let (cache, checkpoints) = (dir.path().join(format!("{name}-cache")), dir.path().join(format!("{name}-ckpt")));
        let feeds = [format!("images={}", images_path.display()), format!("labels={}", labels_path.display())];
        let args = [
            "run",
            native_plan.to_str().unwrap(),
            "--feed",
            &feeds[0],
            "--feed",
            &feeds[1],
            "--epochs",
            "1",
            "--checkpoint-dir",
            checkpoints.to_str().unwrap(),
        ];
        dfc(haswell, &cache, &args);
        let entries = cache_entries(&cache);
        assert_eq!(entries.len(), 1, "one partition's code");
        let checkpoint = std::fs::read_dir(&checkpoints)
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .expect("a checkpoint");
        (entries.into_iter().next().unwrap(), dfc_driver::checkpoint::load(&checkpoint).unwrap())
    };
    let (native_code, native) = train(false, "native");
    let (haswell_code, haswell) = train(true, "haswell");
    // The code each generated is for its own CPU.
    assert!(contains(&haswell_code, b"haswell") && !contains(&haswell_code, b"+avx512f"), "Haswell's code");
    assert!(!contains(&native_code, b"haswell"), "this machine's code");

    // The same training, to rounding: products sum in other orders on other vector widths.
    assert_eq!(native.tensors.len(), haswell.tensors.len());
    for (name, value) in &native.tensors {
        let other = &haswell.tensors[name];
        assert_eq!(value.ty(), other.ty(), "{name}");
        for (i, (a, b)) in value.to_f64_vec().iter().zip(other.to_f64_vec()).enumerate() {
            assert!((a - b).abs() <= 1e-4 * (1.0 + a.abs()), "{name}[{i}]: {a} natively, {b} on Haswell");
        }
    }
}
