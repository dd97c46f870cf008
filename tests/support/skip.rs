//! Skipping a test for want of something outside it (a data set, a program, root, a GPU), so that
//! the skip cannot pass for a success. Shared by the tests of every crate (`#[path]`-included).
//!
//! [`skip`] says `SKIPPED <test>: <reason> [<need>]` on stderr (which `cargo test` shows only for
//! failing tests), appends the same line to the file `DFC_SKIP_LOG` names (`.ci/run` prints it
//! at the end), and fails the test if the need is required here: listed in `DFC_REQUIRE` (a
//! comma-separated list of [`Need`] names; `.ci/run` lists what it installs), or, for a GPU, if
//! `DFC_GPU_REQUIRED` is set (for runs on GPU machines).
#![allow(dead_code)]

use std::io::Write;

/// What a test may need that a machine may lack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// Debian's `dataset-fashion-mnist` under /usr/share/datasets/fashion-mnist.
    FashionMnist,
    /// Debian's `fortunes` (text corpora) under /usr/share/games/fortunes.
    Fortunes,
    /// Open MPI's `mpirun`.
    Mpirun,
    /// A dfc built with the `mpi` feature (`cargo test --features mpi`), to all-reduce through
    /// MPI.
    MpiBuild,
    /// A Slurm node that is up (`.ci/slurm-single-node.sh`).
    Slurm,
    /// Network namespaces (`ip netns add`, as root).
    Netns,
    /// Graphviz's `dot`.
    Graphviz,
    /// NVIDIA's PTX assembler, `ptxas`.
    Ptxas,
    /// A Python with pytest-lsp, the language server tests' client.
    LspClient,
    /// Node.js and npm, for the editor support's tests (`.ci/editor-tests.sh`).
    Npm,
    /// An NVIDIA GPU and its driver.
    Gpu,
    /// A CPU with AVX2 and FMA.
    Avx2,
    /// A CPU with AVX-512F.
    Avx512,
    /// QEMU's user mode (`qemu-x86_64`, Debian's qemu-user), to run dfc on an emulated CPU.
    Qemu,
    /// No CUDA driver (a check of what happens without one).
    NoCudaDriver,
    /// A Python with TensorBoard (target/tb-venv), which reads the event files dfc writes.
    TensorBoard,
    /// `python3`, which runs the benchmark scripts' tables (`benches/vs_jax.py`).
    Python,
}

impl Need {
    pub const ALL: [Need; 17] = [
        Need::FashionMnist,
        Need::Fortunes,
        Need::Mpirun,
        Need::MpiBuild,
        Need::Slurm,
        Need::Netns,
        Need::Graphviz,
        Need::Ptxas,
        Need::LspClient,
        Need::Npm,
        Need::Gpu,
        Need::Avx2,
        Need::Avx512,
        Need::Qemu,
        Need::NoCudaDriver,
        Need::TensorBoard,
        Need::Python,
    ];

    /// Its name in `DFC_REQUIRE` and in skip lines.
    pub fn name(self) -> &'static str {
        match self {
            Need::FashionMnist => "fashion-mnist",
            Need::Fortunes => "fortunes",
            Need::Mpirun => "mpirun",
            Need::MpiBuild => "mpi-build",
            Need::Slurm => "slurm",
            Need::Netns => "netns",
            Need::Graphviz => "graphviz",
            Need::Ptxas => "ptxas",
            Need::LspClient => "lsp-client",
            Need::Npm => "npm",
            Need::Gpu => "gpu",
            Need::Avx2 => "avx2",
            Need::Avx512 => "avx512",
            Need::Qemu => "qemu",
            Need::NoCudaDriver => "no-cuda-driver",
            Need::TensorBoard => "tensorboard",
            Need::Python => "python3",
        }
    }
}

/// Whether `need` is required here, by `DFC_REQUIRE` (whose every name must be a [`Need`]'s: a
/// misspelt one fails the test rather than requiring nothing) or `DFC_GPU_REQUIRED`.
pub fn required(need: Need) -> bool {
    let listed = std::env::var("DFC_REQUIRE").unwrap_or_default();
    let mut required = need == Need::Gpu && std::env::var_os("DFC_GPU_REQUIRED").is_some();
    for name in listed.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        let Some(listed) = Need::ALL.into_iter().find(|n| n.name() == name) else {
            let names: Vec<&str> = Need::ALL.iter().map(|n| n.name()).collect();
            panic!("DFC_REQUIRE lists `{name}`, which is none of {}", names.join(", "));
        };
        required |= listed == need;
    }
    required
}

/// The running test's name: its binary and the name libtest gave its thread.
fn test_name() -> String {
    let binary = std::env::args()
        .next()
        .and_then(|path| {
            let stem = std::path::Path::new(&path).file_stem()?.to_string_lossy().into_owned();
            // Cargo names test binaries `<target>-<hash>`.
            Some(stem.rsplit_once('-').map_or(stem.clone(), |(name, _)| name.to_string()))
        })
        .unwrap_or_default();
    match std::thread::current().name() {
        Some(test) if test != "main" => format!("{binary}::{test}"),
        _ => binary,
    }
}

/// Records that the calling test skips (what is left of it) for want of `need`, because of
/// `reason` (what is missing, and how to get it); fails the test if `need` is required here.
/// The caller returns after it.
/// Debian's Fashion-MNIST directory, or `None` where it is not installed (the test skipped,
/// saying so).
pub fn fashion_mnist() -> Option<&'static std::path::Path> {
    let data = std::path::Path::new("/usr/share/datasets/fashion-mnist");
    if data.join("train-images-idx3-ubyte.gz").exists() {
        return Some(data);
    }
    skip(Need::FashionMnist, "Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist; .ci/run does)");
    None
}

pub fn skip(need: Need, reason: &str) {
    let required = required(need);
    let line =
        format!("SKIPPED {}: {reason} [{}{}]", test_name(), need.name(), if required { ", required here" } else { "" });
    eprintln!("{line}");
    if let Some(log) = std::env::var_os("DFC_SKIP_LOG") {
        let appended = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .and_then(|mut file| file.write_all(format!("{line}\n").as_bytes()));
        if let Err(e) = appended {
            panic!("DFC_SKIP_LOG {}: {e} (a skip must not go unrecorded)", std::path::Path::new(&log).display());
        }
    }
    assert!(!required, "{}: required here (DFC_REQUIRE), but {reason}", need.name());
}
