//! Running tests of this test binary again on `dfc_gemm`'s AVX2 kernels, which a process chooses once, from
//! `DFC_GEMM` (`avx2`) and its CPU. Needs the including crate's `skip` module (`support/skip.rs`) at its root.
#![allow(dead_code)]

/// Whether this process is such a rerun (`DFC_GEMM=avx2`): the test then runs its body.
pub fn in_rerun() -> bool {
    std::env::var("DFC_GEMM").as_deref() == Ok("avx2")
}

/// Runs the tests of this binary that `args` select again, under `DFC_GEMM=avx2` and `env`, and asserts that they
/// pass and that `passed` of them ran; on a CPU without AVX2 and FMA records a skip instead.
pub fn rerun_on_avx2_kernels(args: &[&str], env: &[(&str, &str)], passed: usize) {
    #[cfg(target_arch = "x86_64")]
    let avx2 = std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma");
    #[cfg(not(target_arch = "x86_64"))]
    let avx2 = false;
    if !avx2 {
        return crate::skip::skip(crate::skip::Need::Avx2, "this CPU has no AVX2 and FMA");
    }
    let test = std::process::Command::new(std::env::current_exe().expect("the test binary"))
        .args(args)
        .arg("--nocapture")
        .env("DFC_GEMM", "avx2")
        .envs(env.iter().copied())
        .output()
        .expect("the test binary runs");
    let output = String::from_utf8_lossy(&test.stdout);
    assert!(test.status.success(), "under DFC_GEMM=avx2: {output}{}", String::from_utf8_lossy(&test.stderr));
    assert!(
        output.contains(&format!("{passed} passed")),
        "the tests {args:?} did not all run under DFC_GEMM=avx2: {output}"
    );
}
