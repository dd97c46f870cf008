//! The skip helper (`tests/support/skip.rs`): a skip is logged, and fails its test where its need
//! is required. Each case runs `probe` in a child process of this test binary, with its own
//! environment.

use std::process::Command;

#[path = "support/skip.rs"]
mod skip;

/// Skips for want of the need `DFC_SKIP_PROBE` names (run by the test below).
#[test]
#[ignore = "a probe that the test below runs in child processes"]
fn probe() {
    let name = std::env::var("DFC_SKIP_PROBE").expect("DFC_SKIP_PROBE names a need");
    let need = skip::Need::ALL.into_iter().find(|n| n.name() == name).expect("a need's name");
    skip::skip(need, "the probe's reason");
}

/// Runs `probe` for `need` with `env` set (and the variables that require anything unset);
/// whether it passed, its output, and what it logged.
fn run_probe(need: &str, env: &[(&str, &str)]) -> (bool, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("skips.log");
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args(["--ignored", "--exact", "probe", "--nocapture"])
        .env_remove("DFC_REQUIRE")
        .env_remove("DFC_GPU_REQUIRED")
        .env("DFC_SKIP_PROBE", need)
        .env("DFC_SKIP_LOG", &log);
    for (name, value) in env {
        command.env(name, value);
    }
    let output = command.output().unwrap();
    let text = String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr);
    (output.status.success(), text, std::fs::read_to_string(&log).unwrap_or_default())
}

#[test]
fn skips_are_logged_and_fail_where_required() {
    let (passed, output, logged) = run_probe("mpirun", &[]);
    assert!(passed, "{output}");
    assert_eq!(logged, "SKIPPED skips::probe: the probe's reason [mpirun]\n");
    assert!(output.contains("SKIPPED skips::probe: the probe's reason [mpirun]"), "said on stderr: {output}");

    let (passed, output, logged) = run_probe("mpirun", &[("DFC_REQUIRE", "slurm, mpirun")]);
    assert!(!passed, "a required need fails the test: {output}");
    assert!(output.contains("mpirun: required here (DFC_REQUIRE), but the probe's reason"), "{output}");
    assert_eq!(logged, "SKIPPED skips::probe: the probe's reason [mpirun, required here]\n");

    let (passed, output, _) = run_probe("mpirun", &[("DFC_REQUIRE", "slurm")]);
    assert!(passed, "another need's requirement: {output}");

    let (passed, output, _) = run_probe("mpirun", &[("DFC_REQUIRE", "mpi-run")]);
    assert!(!passed && output.contains("DFC_REQUIRE lists `mpi-run`, which is none of"), "{output}");

    // DFC_GPU_REQUIRED keeps its meaning: a GPU is required.
    let (passed, output, _) = run_probe("gpu", &[("DFC_GPU_REQUIRED", "1")]);
    assert!(!passed && output.contains("gpu: required here"), "{output}");
    let (passed, output, _) = run_probe("gpu", &[("DFC_REQUIRE", "gpu")]);
    assert!(!passed, "{output}");
    let (passed, output, _) = run_probe("mpirun", &[("DFC_GPU_REQUIRED", "1")]);
    assert!(passed, "{output}");

    // A log that cannot be written fails the test rather than losing the skip.
    let (passed, output, _) = run_probe("mpirun", &[("DFC_SKIP_LOG", "/nonexistent/dir/skips.log")]);
    assert!(!passed && output.contains("a skip must not go unrecorded"), "{output}");
}
