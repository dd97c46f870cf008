//! NVIDIA's PTX assembler, which takes dfc's PTX or refuses it with the line at fault: the
//! nearest check of GPU code that a machine without a GPU can make. Shared by the tests that
//! generate PTX (`#[path]`-included).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// The GPUs the PTX must assemble for: Ampere (sm_80, what the PTX names) and Hopper (sm_90:
/// H100, H200).
pub const ARCHES: [&str; 2] = ["sm_80", "sm_90"];

/// Why a test goes without it, and how to get it.
pub const MISSING: &str = "no ptxas (pip install --target target/cuda-tools nvidia-cuda-nvcc-cu12; .ci/run does)";

/// The assembler: `DFC_PTXAS`, the copy `.ci/run` installs from PyPI's nvidia-cuda-nvcc-cu12
/// wheel (target/cuda-tools), or `ptxas` on the PATH.
pub fn find() -> Option<PathBuf> {
    let installed = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/cuda-tools/nvidia/cuda_nvcc/bin/ptxas");
    let candidates = [std::env::var_os("DFC_PTXAS").map(PathBuf::from), Some(installed), Some(PathBuf::from("ptxas"))];
    candidates
        .into_iter()
        .flatten()
        .find(|p| Command::new(p).arg("--version").output().is_ok_and(|o| o.status.success()))
}

/// `ptx` assembled by `ptxas` for every one of [`ARCHES`], its files named `name` in `dir`:
/// the assembler's complaint, with the lines it names, where it refuses.
pub fn assemble(ptxas: &Path, ptx: &str, dir: &Path, name: &str) -> Result<(), String> {
    let source = dir.join(format!("{name}.ptx"));
    std::fs::write(&source, ptx).map_err(|e| format!("writing {}: {e}", source.display()))?;
    for arch in ARCHES {
        let output = Command::new(ptxas)
            .args([&format!("-arch={arch}"), "-o"])
            .arg(dir.join(format!("{name}.{arch}.cubin")))
            .arg(&source)
            .output()
            .map_err(|e| format!("running {}: {e}", ptxas.display()))?;
        if !output.status.success() {
            let complaint = String::from_utf8_lossy(&output.stderr);
            return Err(format!("ptxas -arch={arch} refuses {name}'s PTX:\n{complaint}{}", cited(ptx, &complaint)));
        }
    }
    Ok(())
}

/// The PTX lines that ptxas's complaint names (`<file>, line N; error : ...`), for a failure
/// that can be read without the file, which the test's temporary directory takes with it.
fn cited(ptx: &str, complaint: &str) -> String {
    let lines: Vec<&str> = ptx.lines().collect();
    let mut cited = String::new();
    for part in complaint.split("line ").skip(1) {
        let number: String = part.chars().take_while(char::is_ascii_digit).collect();
        if let Some(line) = number.parse::<usize>().ok().and_then(|n| Some((n, lines.get(n.checked_sub(1)?)?))) {
            cited += &format!("  {}: {}\n", line.0, line.1.trim());
        }
    }
    cited
}
