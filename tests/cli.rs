//! End-to-end tests of the `dfc` binary: every example checks, compiles and inspects; broken
//! variants of the examples fail with located diagnostics; damaged plans are refused cleanly.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

#[path = "support/skip.rs"]
mod skip;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn dfc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dfc")).args(args).env("NO_COLOR", "1").output().expect("run dfc")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn examples() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(root().join("examples"))
        .expect("examples/")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "df"))
        .collect();
    files.sort();
    assert!(files.len() >= 6, "expected the six examples, found {files:?}");
    files
}

fn scratch(name: &str) -> PathBuf {
    let dir = root().join("target").join("cli-tests");
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir.join(name)
}

fn assert_no_panic(output: &Output) {
    let stderr = text(&output.stderr);
    assert!(!stderr.contains("panicked"), "dfc panicked:\n{stderr}");
    assert!(output.status.code().is_some(), "dfc was killed by a signal:\n{stderr}");
}

#[test]
fn every_example_checks_clean() {
    for path in examples() {
        let output = dfc(&["check", path.to_str().expect("utf-8 path")]);
        assert!(output.status.success(), "{}:\n{}", path.display(), text(&output.stderr));
        assert!(output.stderr.is_empty(), "{} has warnings:\n{}", path.display(), text(&output.stderr));
    }
}

/// `dfc compile` then `dfc inspect`: the plan holds the same IR that `dfc ir --after` the last
/// pass prints, and the
/// summary names the model's inputs, params and outputs.
#[test]
fn every_example_compiles_and_inspects() {
    for path in examples() {
        let stem = path.file_stem().expect("stem").to_string_lossy().into_owned();
        let plan_path = scratch(&format!("{stem}.plan"));
        let source = path.to_str().expect("utf-8 path");
        // wide_and_deep asks for ps and worker jobs: on one device, those requests are set aside.
        let compiled = dfc(&["compile", source, "--soft-placement", "-o", plan_path.to_str().expect("utf-8")]);
        assert!(compiled.status.success(), "{stem}: {}", text(&compiled.stderr));

        // The plan holds the IR after the whole pipeline (the loss and updates are named at
        // the plan's level, not in its partitions).
        let ir = dfc(&["ir", source, "--soft-placement", "--after", "partition"]);
        assert!(ir.status.success());
        let plan = dfc_plan::decode(&std::fs::read(&plan_path).expect("plan written")).expect("plan decodes");
        assert_eq!(plan.partitions.len(), 1);
        let module = &plan.partitions[0].module;
        for id in module.graph.node_ids() {
            assert_eq!(
                module.graph.node(id).device.as_ref(),
                Some(&plan.partitions[0].device),
                "{stem}: a node is off its partition's device"
            );
        }
        let whole: String = text(&ir.stdout)
            .lines()
            .filter(|l| !l.starts_with("  minimize ") && !l.starts_with("  updates "))
            .map(|l| format!("{l}\n"))
            .collect();
        assert_eq!(dfc_ir::print(module), whole, "{stem}: the plan's IR differs from `dfc ir`");
        let training = plan.training.as_ref().expect("every example trains");
        assert!(
            module.graph.node_ids().any(|id| module.graph.node(id).name == training.loss_node),
            "{stem}: no loss node"
        );

        let human = dfc(&["inspect", plan_path.to_str().expect("utf-8")]);
        assert!(human.status.success(), "{stem}: {}", text(&human.stderr));
        let shown = text(&human.stdout);
        assert!(shown.contains(&plan.model), "{stem}: inspect does not name the model:\n{shown}");

        let json = dfc(&["inspect", "--json", plan_path.to_str().expect("utf-8")]);
        assert!(json.status.success());
        let summary: serde_json::Value = serde_json::from_slice(&json.stdout).expect("inspect --json is JSON");
        assert_eq!(summary["model"], plan.model.as_str());
        let names = |key: &str| -> Vec<String> {
            summary[key].as_array().expect(key).iter().map(|v| v["name"].as_str().expect("name").to_string()).collect()
        };
        assert_eq!(names("inputs"), plan.inputs.iter().map(|i| i.name.clone()).collect::<Vec<_>>());
        assert_eq!(names("params"), plan.params.iter().map(|p| p.name.clone()).collect::<Vec<_>>());
        assert_eq!(names("outputs"), plan.outputs.iter().map(|o| o.name.clone()).collect::<Vec<_>>());
        assert!(!plan.params.is_empty(), "{stem}: no params");
    }
}

/// A broken variant of an example: `find` replaced by `replace`; the diagnostic `code` must
/// point at `at` (a substring of the broken text, first occurrence after the replacement start).
struct Breakage {
    example: &'static str,
    find: &'static str,
    replace: &'static str,
    code: &'static str,
    at: &'static str,
}

const BREAKAGES: &[Breakage] = &[
    Breakage { example: "mlp.df", find: "relu(dense(h1,", replace: "relu(dense(h9,", code: "E0101", at: "h9" },
    Breakage {
        example: "softmax_regression.df",
        find: "f32[784, classes]",
        replace: "f32[785, classes]",
        code: "E0203",
        at: "w + b",
    },
    Breakage {
        example: "cnn.df",
        find: "max_pool(conv(x, filters = 32), window = 2)",
        replace: "max_pool(conv(x, filters = 32), 2, 2, \"valid\", 7)",
        code: "E0301",
        at: "7)",
    },
    Breakage {
        example: "linear_regression.df",
        find: "mean((prediction - y)",
        replace: "mean((prediction - y",
        code: "E0001",
        at: "output prediction",
    },
    Breakage {
        example: "ridge_regression.df",
        find: "sum(w * w)",
        replace: "sum(w * w, 1, 2, 3)",
        code: "E0301",
        at: "3)",
    },
    Breakage { example: "wide_and_deep.df", find: "axis = 1)", replace: "axis = 2)", code: "E0205", at: "2)" },
    Breakage { example: "mlp.df", find: "units = 10)", replace: "units = x)", code: "E0208", at: "x)" },
];

fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().expect("a line").chars().count() + 1;
    (line, column)
}

#[test]
fn broken_examples_are_located() {
    for b in BREAKAGES {
        let original = std::fs::read_to_string(root().join("examples").join(b.example)).expect("example");
        let start = original.find(b.find).unwrap_or_else(|| panic!("{}: `{}` not found", b.example, b.find));
        let broken = original.replacen(b.find, b.replace, 1);
        let at = start + broken[start..].find(b.at).unwrap_or_else(|| panic!("`{}` not in the replacement", b.at));
        let (line, column) = line_col(&broken, at);
        let path = scratch(&format!("broken-{}-{}", b.code, b.example));
        std::fs::write(&path, &broken).expect("write");

        let output = dfc(&["check", "--message-format", "json", path.to_str().expect("utf-8")]);
        assert_no_panic(&output);
        assert_eq!(output.status.code(), Some(1), "{} ({}) should fail", b.example, b.code);
        let diagnostics: Vec<serde_json::Value> =
            text(&output.stdout).lines().map(|l| serde_json::from_str(l).expect("one JSON object per line")).collect();
        let hit = diagnostics.iter().find(|d| d["code"] == b.code);
        let hit = hit.unwrap_or_else(|| panic!("{}: no {} in {diagnostics:#?}", b.example, b.code));
        assert_eq!(
            (hit["line"].as_u64(), hit["column"].as_u64()),
            (Some(line as u64), Some(column as u64)),
            "{}: {hit}",
            b.example
        );
        for key in ["file", "end_line", "end_column", "severity", "message"] {
            assert!(!hit[key].is_null(), "{key} missing in {hit}");
        }

        // The human rendering names the file, line and column, and shows the help line.
        let human = dfc(&["check", path.to_str().expect("utf-8")]);
        let stderr = text(&human.stderr);
        assert_eq!(human.status.code(), Some(1));
        assert!(stderr.contains(&format!(":{line}:{column}]")), "{}: no {line}:{column} in\n{stderr}", b.example);
        assert!(stderr.contains(&format!("error[{}]", b.code)), "{stderr}");
    }
}

#[test]
fn garbage_bytes_are_a_located_error() {
    let mut bytes = std::fs::read(root().join("examples/mlp.df")).expect("example");
    let at = text(&bytes).find("let h1").expect("let h1");
    bytes.splice(at..at, [0xff, 0xfe, 0x00, 0x80]);
    let path = scratch("garbage.df");
    std::fs::write(&path, &bytes).expect("write");
    let output = dfc(&["check", "--message-format", "json", path.to_str().expect("utf-8")]);
    assert_no_panic(&output);
    assert_eq!(output.status.code(), Some(1));
    let first: serde_json::Value =
        serde_json::from_str(text(&output.stdout).lines().next().expect("a diagnostic")).expect("json");
    assert_eq!(first["code"], "E0004");
    let (line, column) = line_col(&text(&bytes[..at]), at.min(text(&bytes[..at]).len()));
    assert_eq!((first["line"].as_u64(), first["column"].as_u64()), (Some(line as u64), Some(column as u64)));

    // Pure noise: still a clean failure, never a crash.
    let noise: Vec<u8> = (0..4096u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    let path = scratch("noise.df");
    std::fs::write(&path, &noise).expect("write");
    for command in ["check", "ir", "compile"] {
        let output = dfc(&[command, path.to_str().expect("utf-8")]);
        assert_no_panic(&output);
        assert_eq!(output.status.code(), Some(1), "{command} on noise");
    }
}

#[test]
fn many_errors_are_reported_in_one_run() {
    let original = std::fs::read_to_string(root().join("examples/mlp.df")).expect("example");
    let broken = original
        .replacen("relu(dense(x,", "relu(dense(xx,", 1)
        .replacen("one_hot(labels, 10)", "one_hot(labels)", 1)
        .replacen("sgd(lr = 0.01)", "sgd(rate = 0.01)", 1);
    let path = scratch("many.df");
    std::fs::write(&path, broken).expect("write");
    let output = dfc(&["check", "--message-format", "json", path.to_str().expect("utf-8")]);
    let codes: Vec<String> = text(&output.stdout)
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).expect("json")["code"].as_str().expect("code").to_string()
        })
        .collect();
    assert_eq!(codes, ["W0001", "E0101", "E0305", "E0302"], "{}", text(&output.stdout));
}

fn compiled_mlp() -> Vec<u8> {
    let path = scratch("mlp-for-damage.plan");
    let output =
        dfc(&["compile", root().join("examples/mlp.df").to_str().expect("utf-8"), "-o", path.to_str().expect("utf-8")]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    std::fs::read(path).expect("plan")
}

#[test]
fn damaged_plans_are_refused_with_one_line() {
    let good = compiled_mlp();
    let mut corrupted = good.clone();
    let middle = good.len() / 2;
    corrupted[middle] ^= 0x5a;
    let mut newer = good.clone();
    newer[8..12].copy_from_slice(&99u32.to_le_bytes());
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("truncated", good[..good.len() / 2].to_vec(), "truncated"),
        ("header-only", good[..10].to_vec(), "too short"),
        ("corrupted", corrupted, "corrupted"),
        ("newer", newer, "version 99"),
        ("text", b"model m { }\n".to_vec(), "not a dfc plan"),
        ("empty", Vec::new(), "too short"),
    ];
    for (name, bytes, reason) in cases {
        let path = scratch(&format!("{name}.plan"));
        std::fs::write(&path, bytes).expect("write");
        for args in [vec!["inspect"], vec!["inspect", "--json"]] {
            let mut args = args.clone();
            args.push(path.to_str().expect("utf-8"));
            let output = dfc(&args);
            assert_no_panic(&output);
            assert_eq!(output.status.code(), Some(1), "{name}");
            let stderr = text(&output.stderr);
            assert_eq!(stderr.lines().count(), 1, "{name}: not one line:\n{stderr}");
            assert!(stderr.starts_with("error: ") && stderr.contains(reason), "{name}: {stderr}");
            assert!(output.stdout.is_empty());
        }
    }
}

#[test]
fn command_errors_are_one_line() {
    let missing = scratch("does-not-exist.df");
    let cases: Vec<Vec<String>> = vec![
        vec!["check".into(), missing.display().to_string()],
        vec!["compile".into(), missing.display().to_string()],
        vec!["inspect".into(), missing.display().to_string()],
        vec!["check".into(), root().join("examples").display().to_string()],
    ];
    for args in cases {
        let args: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
        let output = dfc(&args);
        assert_no_panic(&output);
        assert_eq!(output.status.code(), Some(1), "{args:?}");
        let stderr = text(&output.stderr);
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.starts_with("error: cannot read"), "{args:?}: {stderr}");
    }
    let unwritable = dfc(&["compile", root().join("examples/mlp.df").to_str().expect("utf-8"), "-o", "/proc/dfc/plan"]);
    assert_eq!(unwritable.status.code(), Some(1));
    assert!(text(&unwritable.stderr).contains("error: cannot write"), "{}", text(&unwritable.stderr));
}

/// A file that never ends (`/dev/zero`) or is far larger than its kind ever is, named where a
/// source, cluster, token or TLS file goes, is refused in one line once past that kind's
/// limit, not read until the machine's memory is gone.
#[test]
fn endless_files_are_refused_at_their_limit() {
    let mlp = root().join("examples/mlp.df");
    let mlp = mlp.to_str().expect("utf-8");
    let plan = scratch("endless.plan");
    assert!(dfc(&["compile", mlp, "-o", plan.to_str().expect("utf-8")]).status.success());
    let plan = plan.to_str().expect("utf-8");
    let tls = scratch("endless-tls");
    std::fs::create_dir_all(&tls).unwrap();
    let _ = std::fs::remove_file(tls.join("ca.pem"));
    std::os::unix::fs::symlink("/dev/zero", tls.join("ca.pem")).unwrap();
    let cases: [(&[&str], &str); 6] = [
        (&["check", "/dev/zero"], "16 MiB"),
        (&["fmt", "--check", "/dev/zero"], "16 MiB"),
        (&["compile", mlp, "--cluster", "/dev/zero"], "1 MiB"),
        (&["run", plan, "--cluster", "/dev/zero"], "1 MiB"),
        (&["run", plan, "--spawn", "1", "--token-file", "/dev/zero"], "64 KiB"),
        (&["run", plan, "--spawn", "1", "--tls-dir", tls.to_str().expect("utf-8")], "1 MiB"),
    ];
    for (args, limit) in cases {
        let output = dfc(args);
        assert_no_panic(&output);
        let stderr = text(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
        assert!(
            stderr.contains(&format!("/dev/zero`: it holds more than {limit}"))
                || stderr.contains(&format!("ca.pem`: it holds more than {limit}")),
            "{args:?}: {stderr}"
        );
    }
}

/// Numbers that no run could use (a wait past the end of time, an empty buffer) are refused by
/// the command line, not left to panic where they are used.
#[test]
fn numbers_out_of_range_are_refused_by_the_command_line() {
    let plan = scratch("numbers.plan");
    let mlp = root().join("examples/mlp.df");
    assert!(dfc(&["compile", mlp.to_str().expect("utf-8"), "-o", plan.to_str().expect("utf-8")]).status.success());
    let plan = plan.to_str().expect("utf-8");
    let cases: [&[&str]; 6] = [
        &["run", plan, "--spawn", "1", "--wait", "inf"],
        &["run", plan, "--spawn", "1", "--wait", "1e20"],
        &["run", plan, "--spawn", "1", "--wait", "NaN"],
        &["bench", plan, "--min-time", "1e300"],
        &["bench-allreduce", "--sizes-mib", "0"],
        &["bench-allreduce", "--sizes-mib", "4,2048"],
    ];
    for args in cases {
        let output = dfc(args);
        assert_no_panic(&output);
        let stderr = text(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.starts_with("error: invalid value"), "{args:?}: {stderr}");
    }
}

/// A plan names the file it was compiled from, and a run reads that file (when the working
/// directory has it) to name lines in its messages. That name is data: a FIFO or a device
/// there must not stop the run.
#[test]
fn a_plan_whose_source_is_now_a_fifo_still_runs() {
    let dir = scratch("fifo-source");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let model = "model m {\n    dim batch = 2\n    input x: f32[batch, 2]\n    input y: f32[batch, 2]\n    param w: f32[2, 2]\n    let error = x @ w - y\n    minimize mean(error * error) with sgd(lr = 0.1)\n}\n";
    std::fs::write(dir.join("m.df"), model).unwrap();
    std::fs::write(dir.join("x.csv"), "0.5,1\n1.5,-1\n").unwrap();
    std::fs::write(dir.join("y.csv"), "0,1\n2,3\n").unwrap();
    let run = |args: &[&str]| {
        let mut child = Command::new(env!("CARGO_BIN_EXE_dfc"))
            .args(args)
            .current_dir(&dir)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("run dfc");
        let started = std::time::Instant::now();
        while child.try_wait().unwrap().is_none() {
            if started.elapsed() > std::time::Duration::from_secs(60) {
                let _ = child.kill();
                panic!("dfc {args:?} did not end in 60 s");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        child.wait_with_output().unwrap()
    };
    let compiled = run(&["compile", "m.df", "-o", "m.plan"]);
    assert!(compiled.status.success(), "{}", text(&compiled.stderr));
    std::fs::remove_file(dir.join("m.df")).unwrap();
    let name = std::ffi::CString::new(dir.join("m.df").to_str().expect("utf-8")).unwrap();
    // SAFETY: `name` is a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
    let trained = run(&["run", "m.plan", "--feed", "x=x.csv", "--feed", "y=y.csv", "--steps", "2"]);
    assert_no_panic(&trained);
    assert!(trained.status.success(), "{}", text(&trained.stderr));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--overlap` overlaps mirrored replicas' all-reduces: under another strategy, or with local
/// SGD's steps that have none, it is refused in one line; a mirrored plan says it overlaps.
#[test]
fn overlap_needs_mirrored_all_reduces() {
    let mlp = root().join("examples/mlp.df");
    let mlp = mlp.to_str().expect("utf-8");
    let plan = scratch("overlap.plan");
    let plan = plan.to_str().expect("utf-8");
    let ps = dfc(&["compile", mlp, "--devices", "2", "--strategy", "ps", "--sync", "--overlap", "-o", plan]);
    assert_no_panic(&ps);
    assert_eq!(ps.status.code(), Some(1));
    assert_eq!(
        text(&ps.stderr).trim_end(),
        "error: --overlap overlaps the gradients' all-reduces with the backward pass, but the ps strategy has none; use --strategy mirrored without --sync-every"
    );
    let local = dfc(&[
        "compile",
        mlp,
        "--devices",
        "2",
        "--strategy",
        "mirrored",
        "--sync-every",
        "4",
        "--overlap",
        "-o",
        plan,
    ]);
    assert_eq!(local.status.code(), Some(1));
    assert!(text(&local.stderr).contains("with --sync-every 4 the steps have none"), "{}", text(&local.stderr));
    let overlapped = dfc(&["compile", mlp, "--devices", "2", "--strategy", "mirrored", "--overlap", "-o", plan]);
    assert!(overlapped.status.success(), "{}", text(&overlapped.stderr));
    let inspected = text(&dfc(&["inspect", plan]).stdout);
    assert!(inspected.contains("all-reduces overlapped with the backward pass"), "{inspected}");
}

/// `--sync-every` is mirrored's local SGD: under another strategy, or as 0 steps, it is refused
/// in one line.
#[test]
fn sync_every_needs_mirrored_and_a_step() {
    let mlp = root().join("examples/mlp.df");
    let mlp = mlp.to_str().expect("utf-8");
    let plan = scratch("sync_every.plan");
    let plan = plan.to_str().expect("utf-8");
    let single = dfc(&["compile", mlp, "--sync-every", "4", "-o", plan]);
    assert_no_panic(&single);
    assert_eq!(single.status.code(), Some(1));
    let stderr = text(&single.stderr);
    assert_eq!(stderr.trim_end(), "error: --sync-every averages mirrored replicas' variables, but the strategy is single; use --strategy mirrored");
    let zero = dfc(&["compile", mlp, "--devices", "2", "--strategy", "mirrored", "--sync-every", "0", "-o", plan]);
    assert_no_panic(&zero);
    assert!(!zero.status.success());
    assert!(text(&zero.stderr).contains("0 is not in 1..=1000000"), "{}", text(&zero.stderr));
    let local = dfc(&["compile", mlp, "--devices", "2", "--strategy", "mirrored", "--sync-every", "4", "-o", plan]);
    assert!(local.status.success(), "{}", text(&local.stderr));
    let inspected = dfc(&["inspect", plan]);
    assert!(
        text(&inspected.stdout).contains("mirrored, 2 replicas, variables averaged every 4 steps"),
        "{}",
        text(&inspected.stdout)
    );
}

/// Staleness-aware updates are for asynchronous parameter servers, with an optimizer whose rate
/// dividing the gradient divides: otherwise refused in one line.
#[test]
fn staleness_aware_needs_asynchronous_ps_and_a_plain_optimizer() {
    let mlp = root().join("examples/mlp.df");
    let mlp = mlp.to_str().expect("utf-8");
    let cluster = scratch("staleness_cluster.json");
    std::fs::write(&cluster, r#"{"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"], "ps": ["127.0.0.1:3"]}}"#)
        .expect("cluster file");
    let cluster = cluster.to_str().expect("utf-8");
    let plan = scratch("staleness.plan");
    let plan = plan.to_str().expect("utf-8");
    let cases: [(&[&str], &str); 3] = [
        (&["--devices", "2", "--strategy", "mirrored", "--staleness-aware"], "but the strategy is mirrored"),
        (&["--cluster", cluster, "--strategy", "ps", "--sync", "--staleness-aware"], "but the strategy is ps --sync"),
        (
            &["--cluster", cluster, "--strategy", "ps", "--staleness-aware", "--optimizer", "adam(lr = 0.001)"],
            "which adam normalises away",
        ),
    ];
    for (extra, expected) in cases {
        let mut args = vec!["compile", mlp, "-o", plan];
        args.extend_from_slice(extra);
        let output = dfc(&args);
        assert_no_panic(&output);
        assert_eq!(output.status.code(), Some(1), "{extra:?}");
        let stderr = text(&output.stderr);
        assert!(stderr.starts_with("error: ") && stderr.lines().count() == 1 && stderr.contains(expected), "{stderr}");
    }
    let adam =
        dfc(&["compile", mlp, "-o", plan, "--cluster", cluster, "--strategy", "ps", "--optimizer", "adam(lr = 0.001)"]);
    assert!(adam.status.success(), "{}", text(&adam.stderr));
    assert!(!text(&dfc(&["inspect", plan]).stdout).contains("staleness-aware"), "off by default with adam");
    let sgd = dfc(&["compile", mlp, "-o", plan, "--cluster", cluster, "--strategy", "ps"]);
    assert!(sgd.status.success(), "{}", text(&sgd.stderr));
    assert!(text(&dfc(&["inspect", plan]).stdout).contains("asynchronous updates, staleness-aware"));
}

/// Backup workers are for synchronous parameter servers with more workers than backups, and
/// train only where each replica has a worker of its own: otherwise refused in one line.
#[test]
fn backup_workers_need_synchronous_ps_and_workers_of_their_own() {
    let mlp = root().join("examples/mlp.df");
    let mlp = mlp.to_str().expect("utf-8");
    let cluster = scratch("backup_cluster.json");
    std::fs::write(&cluster, r#"{"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"], "ps": ["127.0.0.1:3"]}}"#)
        .expect("cluster file");
    let cluster = cluster.to_str().expect("utf-8");
    let plan = scratch("backup.plan");
    let plan = plan.to_str().expect("utf-8");
    let cases: [(&[&str], &str); 3] = [
        (&["--devices", "2", "--strategy", "mirrored", "--backup-workers", "1"], "but the strategy is mirrored"),
        (&["--cluster", cluster, "--strategy", "ps", "--backup-workers", "1"], "but the strategy is ps without --sync"),
        (
            &["--cluster", cluster, "--strategy", "ps", "--sync", "--backup-workers", "2"],
            "leave none of the 2 replicas",
        ),
    ];
    for (extra, expected) in cases {
        let mut args = vec!["compile", mlp, "-o", plan];
        args.extend_from_slice(extra);
        let output = dfc(&args);
        assert_no_panic(&output);
        assert_eq!(output.status.code(), Some(1), "{extra:?}");
        let stderr = text(&output.stderr);
        assert!(stderr.starts_with("error: ") && stderr.lines().count() == 1 && stderr.contains(expected), "{stderr}");
    }
    let compiled =
        dfc(&["compile", mlp, "-o", plan, "--cluster", cluster, "--strategy", "ps", "--sync", "--backup-workers", "1"]);
    assert!(compiled.status.success(), "{}", text(&compiled.stderr));
    let inspected = text(&dfc(&["inspect", plan]).stdout);
    assert!(
        inspected.contains("synchronous updates, 1 backup worker (each update takes the first gradient)"),
        "{inspected}"
    );
    // In one process every replica would read before any gradient arrives: refused before a step.
    // (Before the feeds are read: these name none that exist.)
    let (images, labels) = ("images=no-such-images.npy", "labels=no-such-labels.npy");
    for run in [vec!["run", plan, "--feed", images, "--feed", labels], vec!["bench", plan]] {
        let output = dfc(&run);
        assert_no_panic(&output);
        assert_eq!(output.status.code(), Some(1), "{run:?}");
        let stderr = text(&output.stderr);
        assert!(
            stderr.contains(
                "its 2 replicas must step on their own, each on a worker of its own; run it with --spawn or --cluster"
            ),
            "{stderr}"
        );
    }
}

#[test]
fn dims_can_be_overridden() {
    let mlp = root().join("examples/mlp.df");
    let mlp = mlp.to_str().expect("utf-8");
    let output = dfc(&["ir", mlp, "--dim", "batch=256"]);
    assert!(output.status.success());
    assert!(text(&output.stdout).contains("input : u8[256,28,28]"));
    let unknown = dfc(&["check", mlp, "--dim", "batches=256", "--message-format", "json"]);
    assert_eq!(unknown.status.code(), Some(1));
    assert!(text(&unknown.stdout).contains("E0207"));
    let bad = dfc(&["check", mlp, "--dim", "batch=many"]);
    assert_eq!(bad.status.code(), Some(2), "clap rejects a malformed --dim");
    let zero = dfc(&["check", mlp, "--dim", "batch=0", "--message-format", "json"]);
    assert_eq!(zero.status.code(), Some(1));
}

#[test]
fn a_file_with_several_models_needs_model() {
    let file = root().join("tests/ir/optimizers.df");
    let file = file.to_str().expect("utf-8");
    let ambiguous = dfc(&["ir", file]);
    assert_eq!(ambiguous.status.code(), Some(1));
    assert!(text(&ambiguous.stderr).contains("E0104"), "{}", text(&ambiguous.stderr));
    let chosen = dfc(&["ir", file, "--model", "with_adam"]);
    assert!(chosen.status.success());
    assert!(text(&chosen.stdout).starts_with("model with_adam"));
    let absent = dfc(&["ir", file, "--model", "nope"]);
    assert_eq!(absent.status.code(), Some(1));
    assert!(text(&absent.stderr).contains("with_sgd"));
}

#[test]
fn plan_paths_default_next_to_the_source() {
    let source = scratch("defaulted.df");
    std::fs::copy(root().join("examples/linear_regression.df"), &source).expect("copy");
    let plan = source.with_extension("plan");
    let _ = std::fs::remove_file(&plan);
    let output = dfc(&["compile", source.to_str().expect("utf-8")]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    assert!(Path::new(&plan).exists());
}

#[test]
fn graphs_are_drawn_as_dot_and_svg() {
    let model = root().join("examples/wide_and_deep.df");
    let model = model.to_str().expect("utf-8");
    let cluster = root().join("tests/partitions/cluster_2ps_2workers.json");
    let placed = ["--cluster", cluster.to_str().expect("utf-8"), "--strategy", "ps", "--sync", "--dim", "users=1000"];
    let printed = dfc(&[&["graph", model, "--collapse", "1"][..], &placed].concat());
    assert!(printed.status.success(), "{}", text(&printed.stderr));
    let dot = text(&printed.stdout);
    assert!(dot.starts_with("digraph \"wide_and_deep\""), "{dot}");
    assert!(dot.contains("fillcolor=\"#a6cee3\"") && dot.contains("/job:ps"), "nodes are coloured by device:\n{dot}");
    assert!(dot.contains("color=\"#d62728\""), "transfers between devices are drawn:\n{dot}");

    // Before placement, the colours are the requests of the source.
    let requested = dfc(&["graph", model, "--after", "sema"]);
    assert!(requested.status.success(), "{}", text(&requested.stderr));
    assert!(text(&requested.stdout).contains("/job:ps") && !text(&requested.stdout).contains("#d62728"));

    let file = scratch("wide_and_deep.dot");
    let written =
        dfc(&[&["graph", model, "--collapse", "1", "-o", file.to_str().expect("utf-8")][..], &placed].concat());
    assert!(written.status.success(), "{}", text(&written.stderr));
    assert_eq!(std::fs::read_to_string(&file).expect("written"), dot);

    if Command::new("dot").arg("-V").output().is_err() {
        skip::skip(
            skip::Need::Graphviz,
            "the SVG check needs Graphviz's `dot` (apt-get install graphviz; .ci/run does)",
        );
        return;
    }
    let svg = scratch("wide_and_deep.svg");
    let drawn = dfc(&[&["graph", model, "-o", svg.to_str().expect("utf-8")][..], &placed].concat());
    assert!(drawn.status.success(), "{}", text(&drawn.stderr));
    let svg = std::fs::read_to_string(&svg).expect("svg written");
    assert!(svg.contains("<svg") && svg.contains("user_table"), "not an SVG of the model");
}

/// `dfc ir model.df | head -1`: a reader that goes away ends the printing quietly, as for any
/// Unix filter, not with a panic.
#[test]
fn a_closed_pipe_ends_printing_without_a_panic() {
    use std::os::unix::process::ExitStatusExt;
    let example = root().join("examples/cnn.df");
    let mut child = Command::new(env!("CARGO_BIN_EXE_dfc"))
        .args(["ir", example.to_str().unwrap(), "--after", "optimizer"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let output = child.wait_with_output().unwrap();
    assert!(!text(&output.stderr).contains("panicked"), "{}", text(&output.stderr));
    let quiet = output.status.success() || output.status.signal() == Some(libc::SIGPIPE);
    assert!(quiet, "{:?}: {}", output.status, text(&output.stderr));
}

/// `--timings`: a line per stage, in pipeline order, the replication stages under a data
/// parallel strategy, and a total whose time is the sum of the stages'.
#[test]
fn compile_timings_list_every_stage() {
    let path = scratch("mlp-timings.plan");
    let source = root().join("examples/mlp.df");
    let output = dfc(&[
        "compile",
        source.to_str().expect("utf-8"),
        "--devices",
        "2",
        "--strategy",
        "mirrored",
        "--timings",
        "-o",
        path.to_str().expect("utf-8"),
    ]);
    let stderr = text(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    let lines: Vec<(f64, &str)> = stderr
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix("time:")?;
            let (seconds, _) = rest.trim_start().split_once(" s ")?;
            let stage = line.rsplit("  ").next()?;
            Some((seconds.parse().expect("a time"), stage))
        })
        .collect();
    let stages: Vec<&str> = lines.iter().map(|(_, stage)| *stage).collect();
    let expected = [
        "read the source",
        "parse and analyse",
        "shard",
        "pool_early",
        "autodiff",
        "optimizer",
        "simplify",
        "the replicas' module",
        "replicate",
        "fuse all-reduces",
        "place",
        "partition",
        "verify the partitions",
        "cost model",
        "build the plan",
        "encode and write the plan",
        "total",
    ];
    assert_eq!(stages, expected, "{stderr}");
    let (total, stages) = lines.split_last().expect("lines");
    let sum: f64 = stages.iter().map(|(seconds, _)| seconds).sum();
    assert!((total.0 - sum).abs() < 0.01, "{stderr}");
    assert!(stderr.contains("peak rss:"), "{stderr}");
}

/// What `dfc args` says when it refuses them: exit status 1 without a panic, and its stderr.
fn refused(args: &[&str]) -> String {
    let output = dfc(args);
    assert_no_panic(&output);
    assert_eq!(output.status.code(), Some(1), "dfc {}", args.join(" "));
    text(&output.stderr).trim_end().to_string()
}

/// `--shard-optimizer` shards mirrored replicas' optimizer state: under another strategy, or
/// with local SGD's replicas that update on their own, it is refused in one line; a mirrored
/// plan says so, and each device keeps a quarter of the state plain mirrored keeps on 4.
#[test]
fn shard_optimizer_needs_mirrored_replicas_and_keeps_a_share_each() {
    let mlp = root().join("examples/mlp.df");
    let mlp = mlp.to_str().expect("utf-8");
    let plan = scratch("shard_optimizer.plan");
    let plan = plan.to_str().expect("utf-8");
    assert_eq!(
        refused(&["compile", mlp, "--devices", "2", "--strategy", "ps", "--sync", "--shard-optimizer", "-o", plan]),
        "error: --shard-optimizer splits the optimizer's state over mirrored replicas that step together, but the ps strategy has no mirrored replicas; use --strategy mirrored without --sync-every"
    );
    let local = ["--strategy", "mirrored", "--sync-every", "4", "--shard-optimizer"];
    let stderr = refused(&[&["compile", mlp, "--devices", "2", "-o", plan][..], &local].concat());
    assert!(stderr.contains("with --sync-every 4 each replica updates on its own"), "{stderr}");
    let state = |sharded: bool| {
        let mut args =
            vec!["compile", mlp, "--devices", "4", "--strategy", "mirrored", "--optimizer", "adam(lr = 0.001)"];
        args.extend(sharded.then_some("--shard-optimizer"));
        args.extend(["-o", plan]);
        let compiled = dfc(&args);
        assert!(compiled.status.success(), "{}", text(&compiled.stderr));
        let inspected = text(&dfc(&["inspect", plan]).stdout);
        assert_eq!(inspected.contains("optimizer state sharded over the replicas (ZeRO-1)"), sharded, "{inspected}");
        let json: serde_json::Value = serde_json::from_slice(&dfc(&["inspect", "--json", plan]).stdout).unwrap();
        let devices = json["devices"].as_array().expect("devices").clone();
        devices.iter().map(|d| d["optimizer_state_bytes"].as_u64().expect("bytes")).collect::<Vec<u64>>()
    };
    let (whole, shares) = (state(false), state(true));
    // Adam's two slots of 269,322 parameters, and its step: each replica a quarter of the slots.
    let slots = 2 * 4 * (784 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10);
    assert_eq!(whole, [slots + 4; 4]);
    let padded = 2 * 4 * (784 * 256 / 4 + 256 / 4 + 256 * 256 / 4 + 256 / 4 + 256 * 10 / 4 + 12 / 4);
    assert_eq!(shares, [padded + 4; 4]);
}

/// `--micro-batches` pipelines the `model` strategy's stages: under another strategy, or as 0,
/// it is refused in one line; a batch that does not split is located; a pipelined plan says
/// how many micro-batches it runs.
#[test]
fn micro_batches_need_the_model_strategy() {
    let mlp = root().join("examples/mlp.df");
    let mlp = mlp.to_str().expect("utf-8");
    let plan = scratch("micro_batches.plan");
    let plan = plan.to_str().expect("utf-8");
    assert_eq!(
        refused(&["compile", mlp, "--devices", "2", "--strategy", "mirrored", "--micro-batches", "4", "-o", plan]),
        "error: --micro-batches pipelines the stages of a model split over the devices, but the strategy is mirrored; use --strategy model"
    );
    let zero = dfc(&["compile", mlp, "--devices", "2", "--strategy", "model", "--micro-batches", "0", "-o", plan]);
    assert_no_panic(&zero);
    assert_eq!(zero.status.code(), Some(2), "clap refuses 0: {}", text(&zero.stderr));
    let stderr =
        refused(&["compile", mlp, "--devices", "2", "--strategy", "model", "--micro-batches", "3", "-o", plan]);
    assert!(
        stderr.contains("does not split evenly over 3 micro-batches") && stderr.contains("mlp.df:13:5"),
        "{stderr}"
    );
    let pipelined = dfc(&["compile", mlp, "--devices", "2", "--strategy", "model", "--micro-batches", "4", "-o", plan]);
    assert!(pipelined.status.success(), "{}", text(&pipelined.stderr));
    let inspected = text(&dfc(&["inspect", plan]).stdout);
    assert!(inspected.contains("strategy: model, a pipeline of 4 micro-batches"), "{inspected}");
}

/// `--strategy auto` compares overlapped all-reduces, sharded optimizers and pipelines itself: asking for one
/// beside it is refused in one line, and so is a schedule without micro-batches.
#[test]
fn auto_and_pipeline_schedules_refuse_what_they_choose_themselves() {
    let mlp = root().join("examples/mlp.df");
    let mlp = mlp.to_str().expect("utf-8");
    let plan = scratch("auto_refusals.plan");
    let plan = plan.to_str().expect("utf-8");
    let cases: [(&[&str], &str); 4] = [
        (&["--strategy", "auto", "--overlap"], "--strategy auto compares mirrored replicas with and without overlapped all-reduces itself; leave out --overlap"),
        (&["--strategy", "auto", "--shard-optimizer"], "--strategy auto compares mirrored replicas with and without a sharded optimizer itself; leave out --shard-optimizer"),
        (&["--strategy", "auto", "--micro-batches", "4"], "--strategy auto compares pipelines of 2, 4 and 8 micro-batches itself; leave out --micro-batches"),
        (&["--strategy", "model", "--pipeline-schedule", "gpipe"], "--pipeline-schedule orders a pipeline's micro-batches: give --micro-batches M too"),
    ];
    for (extra, expected) in cases {
        let mut args = vec!["compile", mlp, "--devices", "2", "-o", plan];
        args.extend_from_slice(extra);
        assert_eq!(refused(&args), format!("error: {expected}"), "{extra:?}");
    }
}
