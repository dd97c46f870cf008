//! `dfc calibrate` end to end: a quick profile of this machine (its links between two spawned
//! workers included), which `dfc compile --profile`,
//! this host's profile (`DFC_PROFILE`) and `dfc bench` predict from; damaged profiles refused
//! with the field they break, or set aside with a warning where they were only found.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

#[path = "support/skip.rs"]
mod skip;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn scratch(name: &str) -> PathBuf {
    let dir = root().join("target").join("calibrate-tests").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// `dfc ARGS` with `DFC_PROFILE` set to `profile` (`off`: none).
fn dfc(args: &[&str], profile: &str) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dfc"))
        .args(args)
        .env("NO_COLOR", "1")
        .env("DFC_PROFILE", profile)
        .output()
        .expect("run dfc")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn s(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

/// One quick profile for every test, its links measured between two spawned workers.
fn quick_profile() -> &'static PathBuf {
    static PROFILE: OnceLock<PathBuf> = OnceLock::new();
    PROFILE.get_or_init(|| {
        let path = scratch("profile").join("quick.json");
        let output = dfc(&["calibrate", "--quick", "-o", s(&path)], "off");
        assert!(output.status.success(), "{}", text(&output.stderr));
        let printed = text(&output.stdout);
        assert!(printed.contains("GFLOP/s at 256³"), "{printed}");
        assert!(printed.contains("shared memory between workers: "), "{printed}");
        assert!(printed.contains("a step driven on workers: "), "{printed}");
        assert!(printed.contains("workers that wait for each other within a step: "), "{printed}");
        assert!(printed.contains(&format!("profile: {}", path.display())), "{printed}");
        path
    })
}

fn mlp() -> PathBuf {
    root().join("examples").join("mlp.df")
}

#[test]
fn a_quick_profile_is_json_of_this_cpu_with_a_run_per_thread_count() {
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(quick_profile()).unwrap()).unwrap();
    assert_eq!(json["version"], 3);
    let threads = json["cpu"]["threads"].as_u64().unwrap();
    let runs = json["runs"].as_array().unwrap();
    assert_eq!(runs[0]["threads"], 1);
    assert_eq!(runs.last().unwrap()["threads"].as_u64().unwrap(), threads);
    let sizes = json["gemm_sizes"].as_array().unwrap().len();
    assert_eq!(runs[0]["nn"].as_array().unwrap().len(), sizes.pow(3));
    for link in ["shared_memory", "tcp", "driven_step"] {
        assert!(json[link]["bytes_per_second"].as_f64().unwrap() > 0.0, "{link}: {}", json[link]);
    }
    // A step's fixed cost on 1, 2 and 4 workers, never less on more of them.
    let driven: Vec<[f64; 2]> = serde_json::from_value(json["driven_step"]["latency"]["points"].clone()).unwrap();
    assert_eq!(driven.iter().map(|p| p[0]).collect::<Vec<_>>(), [1.0, 2.0, 4.0], "{driven:?}");
    assert!(driven.windows(2).all(|w| w[1][1] >= w[0][1]) && driven[0][1] > 0.0, "{driven:?}");
    // And with workers busy for longer and longer: never less than idle ones or a shorter
    // chain's, nor on more of them.
    let chains = json["driven_step"]["busy"].as_array().unwrap();
    assert_eq!(chains.len(), 3, "{chains:?}");
    let (mut shorter, mut computing) = (driven.clone(), 0.0);
    for chain in chains {
        let seconds = chain["computing_seconds"].as_f64().unwrap();
        assert!(seconds > computing, "{chains:?}");
        computing = seconds;
        let busy: Vec<[f64; 2]> = serde_json::from_value(chain["latency"]["points"].clone()).unwrap();
        assert_eq!(busy.iter().map(|p| p[0]).collect::<Vec<_>>(), [1.0, 2.0, 4.0], "{busy:?}");
        assert!(busy.windows(2).all(|w| w[1][1] >= w[0][1]), "{busy:?}");
        assert!(busy.iter().zip(&shorter).all(|(b, d)| b[1] >= d[1]), "{busy:?} against {shorter:?}");
        shorter = busy;
    }
    // Workers that wait for each other within a step, on 2 and 4 of them: more, never less
    // on more.
    let exchanging: Vec<[f64; 2]> =
        serde_json::from_value(json["driven_step"]["exchanging"]["points"].clone()).unwrap();
    assert_eq!(exchanging.iter().map(|p| p[0]).collect::<Vec<_>>(), [2.0, 4.0], "{exchanging:?}");
    assert!(exchanging.windows(2).all(|w| w[1][1] >= w[0][1]) && exchanging[0][1] > 0.0, "{exchanging:?}");
    // Rings of 3 and 4 workers beside the pair's link.
    let rings = json["shared_memory_rings"].as_array().unwrap();
    assert_eq!(rings.iter().map(|r| r["members"].as_u64().unwrap()).collect::<Vec<_>>(), [3, 4], "{rings:?}");
    assert!(rings.iter().all(|r| r["link"]["bytes_per_second"].as_f64().unwrap() > 0.0), "{rings:?}");
    // Products of more work take longer: the largest square against the smallest.
    let nn = runs[0]["nn"].as_array().unwrap();
    assert!(nn.last().unwrap().as_f64().unwrap() > 100.0 * nn[0].as_f64().unwrap(), "{nn:?}");
}

#[test]
fn compile_predicts_from_the_profile_given_or_found_and_says_so() {
    let dir = scratch("compile");
    let plan = dir.join("mlp.plan");
    let profile = quick_profile();
    let given = dfc(&["compile", s(&mlp()), "--report", "--profile", s(profile), "-o", s(&plan)], "off");
    assert!(given.status.success(), "{}", text(&given.stderr));
    let report = text(&given.stdout);
    assert!(report.contains("calibrated: "), "{report}");
    assert!(!report.contains("assumed: "), "{report}");
    // This host's profile, found through DFC_PROFILE, is the same prediction.
    let found = dfc(&["compile", s(&mlp()), "--report", "-o", s(&plan)], s(profile));
    assert_eq!(text(&found.stdout), report);
    // --no-profile, or rates given, predict from the assumed rates.
    let assumed = dfc(&["compile", s(&mlp()), "--report", "--no-profile", "-o", s(&plan)], s(profile));
    assert!(text(&assumed.stdout).contains("assumed: 50 GFLOP/s per device"), "{}", text(&assumed.stdout));
    let rates = dfc(&["compile", s(&mlp()), "--report", "--device-flops", "1e11", "-o", s(&plan)], s(profile));
    assert!(text(&rates.stdout).contains("assumed: 100 GFLOP/s per device"), "{}", text(&rates.stdout));
    let both = dfc(&["compile", s(&mlp()), "--profile", s(profile), "--device-flops", "1e11"], "off");
    assert!(!both.status.success());
    assert!(text(&both.stderr).contains("cannot be used with"), "{}", text(&both.stderr));
}

#[test]
fn bench_puts_the_prediction_beside_the_measured_step() {
    let dir = scratch("bench");
    let plan = dir.join("mlp.plan");
    let compiled = dfc(&["compile", s(&mlp()), "-o", s(&plan)], "off");
    assert!(compiled.status.success(), "{}", text(&compiled.stderr));
    let timeline = dir.join("timeline.json");
    let quick = ["--warmup", "1", "--min-time", "0", "--min-steps", "3", "--json"];
    let mut args = vec!["bench", s(&plan)];
    args.extend(quick);
    args.extend(["--timeline", s(&timeline)]);
    let output = dfc(&args, s(quick_profile()));
    assert!(output.status.success(), "{}", text(&output.stderr));
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let predicted = report["predicted_step_us"].as_f64().expect("a prediction");
    assert!(predicted > 0.0, "{report}");
    let error = report["prediction_error"].as_f64().unwrap();
    let measured = report["median_step_us"].as_f64().unwrap();
    assert!((error - (predicted / measured - 1.0)).abs() < 1e-3, "{report}");
    assert!(report["calibration"].as_str().unwrap().contains("thread"), "{report}");
    // The timeline's breakdown: the products, measured and predicted, on the plan's device.
    let rows = report["breakdown"].as_array().expect("a breakdown");
    let products = rows.iter().find(|r| r["kind"] == "matmul").expect("the products");
    assert_eq!(products["device"], "/job:localhost/task:0/cpu:0");
    assert!(products["measured_us"].as_f64().unwrap() > 0.0 && products["predicted_us"].as_f64().unwrap() > 0.0);
    // Without a profile: no prediction, and a person is told how to make one.
    let mut args = vec!["bench", s(&plan)];
    args.extend(&quick[..quick.len() - 1]);
    let output = dfc(&args, "off");
    assert!(text(&output.stdout).contains("no prediction (no profile of this host: `dfc calibrate` makes one)"));
}

/// A cluster file gives a task its host's profile: its partition is priced by it (a host whose
/// products take three times as long computes a mirrored replica's products in three times the
/// time), the report says so, and a profile that cannot be read is refused naming its task.
#[test]
fn a_cluster_file_gives_a_task_the_profile_of_its_host() {
    let dir = scratch("task-profiles");
    let mut slow: serde_json::Value = serde_json::from_slice(&std::fs::read(quick_profile()).unwrap()).unwrap();
    for run in slow["runs"].as_array_mut().unwrap() {
        for table in ["nn", "tn", "nt"] {
            for time in run[table].as_array_mut().unwrap() {
                *time = serde_json::json!(time.as_f64().unwrap() * 3.0);
            }
        }
    }
    std::fs::write(dir.join("slow host.json"), slow.to_string()).unwrap();
    let cluster = dir.join("cluster.json");
    let write_cluster = |profile: &str| {
        let text = format!(
            r#"{{"cluster": {{"worker": ["fast:2222", {{"address": "slow:2222", "profile": "{profile}"}}]}}}}"#
        );
        std::fs::write(&cluster, text).unwrap();
    };
    write_cluster("slow host.json");
    let (plan, model) = (dir.join("mlp.plan"), mlp());
    let args = ["compile", s(&model), "--strategy", "mirrored", "--cluster", s(&cluster), "--report", "-o", s(&plan)];
    let output = dfc(&[&args[..], &["--profile", s(quick_profile())]].concat(), "off");
    assert!(output.status.success(), "{}", text(&output.stderr));
    assert!(text(&output.stdout).contains("/job:worker/task:1 from profiles of their own"), "{}", text(&output.stdout));
    let products = |plan: &Path| -> Vec<f64> {
        let inspected = dfc(&["inspect", s(plan), "--json"], "off");
        let json: serde_json::Value = serde_json::from_slice(&inspected.stdout).expect("inspect's JSON");
        let devices = json["report"]["devices"].as_array().expect("a report").clone();
        let matmul = |d: &serde_json::Value| {
            let kinds = d["by_kind"].as_array().unwrap();
            kinds.iter().find(|k| k[0] == "matmul").map_or(0.0, |k| k[1].as_f64().unwrap())
        };
        devices.iter().map(matmul).collect()
    };
    let seconds = products(&plan);
    assert_eq!(seconds.len(), 2, "{seconds:?}");
    assert!((seconds[1] / seconds[0] - 3.0).abs() < 0.01, "the slow host's products: {seconds:?}");
    // Without the task's profile, both replicas' products cost the same.
    std::fs::write(&cluster, r#"{"cluster": {"worker": ["fast:2222", "slow:2222"]}}"#).unwrap();
    let output = dfc(&[&args[..], &["--profile", s(quick_profile())]].concat(), "off");
    assert!(output.status.success(), "{}", text(&output.stderr));
    let same = products(&plan);
    assert!((same[1] / same[0] - 1.0).abs() < 1e-9, "{same:?}");
    // Placement gives the slow hosts less to do: four towers of products on four tasks, two of
    // them on slow hosts, under `model` (earliest-finish placement).
    let towers: String = (0..4)
        .map(|t| format!("    param w{t}a: f32[64, 256] = glorot_uniform\n    param w{t}b: f32[256, 64] = glorot_uniform\n    let t{t} = relu(relu(x @ w{t}a) @ w{t}b)\n"))
        .collect();
    let source = format!(
        "model towers {{\n    input x: f32[128, 64]\n    input y: f32[128, 64]\n{towers}    let out = t0 + t1 + t2 + t3\n    let loss = mean((out - y) * (out - y))\n    output out\n    minimize loss with sgd(lr = 0.01)\n}}\n"
    );
    let towers = dir.join("towers.df");
    std::fs::write(&towers, source).unwrap();
    let slow_share = |profiles: [Option<&str>; 4]| -> f64 {
        let tasks: Vec<String> = profiles
            .iter()
            .enumerate()
            .map(|(i, p)| match p {
                Some(p) => format!(r#"{{"address": "h{i}:1", "profile": "{p}"}}"#),
                None => format!(r#""h{i}:1""#),
            })
            .collect();
        std::fs::write(&cluster, format!(r#"{{"cluster": {{"worker": [{}]}}}}"#, tasks.join(", "))).unwrap();
        let placed = dir.join("towers.plan");
        let args = ["compile", s(&towers), "--strategy", "model", "--cluster", s(&cluster), "-o", s(&placed)];
        let output = dfc(&[&args[..], &["--profile", s(quick_profile())]].concat(), "off");
        assert!(output.status.success(), "{}", text(&output.stderr));
        let inspected = dfc(&["inspect", s(&placed), "--json"], "off");
        let json: serde_json::Value = serde_json::from_slice(&inspected.stdout).expect("inspect's JSON");
        let flops = |d: &serde_json::Value| d["flops"].as_f64().unwrap();
        let devices = json["report"]["devices"].as_array().unwrap().clone();
        let slow: f64 = devices
            .iter()
            .filter(|d| {
                ["/job:worker/task:2/cpu:0", "/job:worker/task:3/cpu:0"].contains(&d["device"].as_str().unwrap())
            })
            .map(flops)
            .sum();
        slow / devices.iter().map(flops).sum::<f64>()
    };
    let alike = slow_share([None; 4]);
    let slow = slow_share([None, None, Some("slow host.json"), Some("slow host.json")]);
    assert!(slow < alike, "the slow hosts' share of the FLOPs: {slow:.3} with their profiles, {alike:.3} without");

    // A profile that cannot be read: refused, naming the task.
    write_cluster("missing.json");
    let output = dfc(&[&args[..], &["--profile", s(quick_profile())]].concat(), "off");
    assert!(!output.status.success());
    let stderr = text(&output.stderr);
    assert!(stderr.contains("job `worker`, task 1: cannot read the profile"), "{stderr}");
    assert!(stderr.contains("missing.json"), "{stderr}");
}

/// With a profile, the devices of one process take turns on its threads: mirrored on 4 devices
/// of one process (replicas 2 and 3 stored as instances of replica 1) is predicted to take at
/// least all four replicas' compute, one after another.
#[test]
fn replicas_of_one_process_take_turns_in_the_prediction() {
    let dir = scratch("one-process");
    let (plan, model) = (dir.join("mlp.plan"), mlp());
    let args = ["compile", s(&model), "--strategy", "mirrored", "--devices", "4", "-o", s(&plan)];
    let output = dfc(&[&args[..], &["--profile", s(quick_profile())]].concat(), "off");
    assert!(output.status.success(), "{}", text(&output.stderr));
    let inspected = dfc(&["inspect", s(&plan), "--json"], "off");
    let json: serde_json::Value = serde_json::from_slice(&inspected.stdout).expect("inspect's JSON");
    let report = &json["report"];
    let devices = report["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 4);
    let computing: f64 = devices.iter().map(|d| d["compute_seconds"].as_f64().unwrap()).sum();
    let step = report["step_seconds"].as_f64().unwrap();
    // Within rounding: the step and the devices' compute are sums of the same times in other orders.
    assert!(step >= computing * (1.0 - 1e-12), "a step of {step} s for {computing} s of the process's compute");
}

/// `dfc compile --spawn N` predicts the step of the plan on N spawned workers, each on its
/// share of the cores: what `dfc run --spawn N --timeline` predicts for it as it runs, and not
/// the one-process step. A plan of fewer partitions runs on as many workers (and is predicted
/// so); a cluster whose tasks cannot be spread over N workers is refused.
#[test]
fn compile_for_spawned_workers_predicts_what_the_run_on_them_does() {
    let Some(data) = skip::fashion_mnist() else { return };
    let dir = scratch("spawned");
    let (plan, model) = (dir.join("mlp.plan"), mlp());
    let profile = quick_profile();
    let predicted = |plan: &Path| -> f64 {
        let inspected = dfc(&["inspect", s(plan), "--json"], "off");
        let json: serde_json::Value = serde_json::from_slice(&inspected.stdout).expect("inspect's JSON");
        json["report"]["step_seconds"].as_f64().expect("a prediction")
    };
    let feeds = [
        format!("images={}", data.join("train-images-idx3-ubyte.gz").display()),
        format!("labels={}", data.join("train-labels-idx1-ubyte.gz").display()),
    ];
    let one_process_plan = dir.join("one-process.plan");
    for strategy in ["mirrored", "single"] {
        let args = ["compile", s(&model), "--strategy", strategy, "--devices", "2", "-o"];
        let output = dfc(&[&args[..], &[s(&plan), "--spawn", "2"]].concat(), s(profile));
        assert!(output.status.success(), "{}", text(&output.stderr));
        assert!(text(&output.stderr).contains("for `dfc run --spawn 2`"), "{}", text(&output.stderr));
        let spawned = predicted(&plan);
        let output = dfc(&[&args[..], &[s(&one_process_plan)]].concat(), s(profile));
        assert!(output.status.success(), "{}", text(&output.stderr));
        let one_process = predicted(&one_process_plan);
        assert!(
            (spawned / one_process - 1.0).abs() > 0.01,
            "{strategy}: {spawned} s spawned, {one_process} s in one process"
        );
        let timeline = dir.join("timeline.json");
        let run = ["run", s(&plan), "--spawn", "2", "--steps", "6", "--timeline", s(&timeline)];
        let output = dfc(&[&run[..], &["--feed", &feeds[0], "--feed", &feeds[1]]].concat(), s(profile));
        assert!(output.status.success(), "{}", text(&output.stderr));
        let stderr = text(&output.stderr);
        if strategy == "single" {
            assert!(stderr.contains("note: the plan has 1 partition(s): 1 worker(s), not 2"), "{stderr}");
        }
        let line = stderr.lines().find(|l| l.starts_with("step: median")).expect("the run's prediction");
        let ms: f64 = line.split("predicted ").nth(1).and_then(|t| t.split(' ').next()).unwrap().parse().unwrap();
        assert!((ms / 1e3 / spawned - 1.0).abs() < 0.01, "{strategy}: compiled {spawned} s, run: {line}");
    }
    // The placement search scores its moves for the workers too: with a profile, two devices of
    // one process take turns on its threads, and two workers compute at once, each on its share.
    let searched = |spawn: &[&str]| -> String {
        let args = ["compile", s(&model), "--strategy", "model", "--model-placement", "searched", "--devices", "2"];
        let output = dfc(&[&args[..], spawn, &["--report", "-o", s(&plan)]].concat(), s(profile));
        assert!(output.status.success(), "{}", text(&output.stderr));
        let report = text(&output.stdout);
        let line = report.lines().find(|l| l.starts_with("placement search: ")).expect("the search's line");
        line.split("simulated step: ").nth(1).expect("its steps").to_string()
    };
    let (one_process, spawned) = (searched(&[]), searched(&["--spawn", "2"]));
    assert_ne!(one_process, spawned, "the search's simulated steps");
    // Three tasks (a ps and two workers) on two workers: refused, saying why.
    let cluster = dir.join("cluster.json");
    std::fs::write(&cluster, r#"{"cluster": {"worker": ["localhost:1", "localhost:2"], "ps": ["localhost:3"]}}"#)
        .unwrap();
    let args = ["compile", s(&model), "--strategy", "ps", "--sync", "--cluster", s(&cluster), "--spawn", "2"];
    let output = dfc(&args, s(profile));
    assert!(!output.status.success());
    assert!(text(&output.stderr).contains("cannot be spread over 2 worker(s)"), "{}", text(&output.stderr));
}

#[test]
fn damaged_profiles_are_refused_by_name_or_set_aside_with_a_warning() {
    let dir = scratch("damaged");
    let good: serde_json::Value = serde_json::from_slice(&std::fs::read(quick_profile()).unwrap()).unwrap();
    let write = |name: &str, bytes: &[u8]| {
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        path
    };
    let mut short = good.clone();
    short["runs"][0]["tn"].as_array_mut().unwrap().pop();
    let mut negative = good.clone();
    negative["tcp"]["bytes_per_second"] = serde_json::json!(-1.0);
    let mut newer = good.clone();
    newer["version"] = serde_json::json!(7);
    let mut older = good.clone();
    older["version"] = serde_json::json!(1);
    let mut unordered = good.clone();
    unordered["driven_step"]["latency"]["points"] = serde_json::json!([[2.0, 3e-4], [1.0, 2e-4]]);
    let mut waiting = good.clone();
    waiting["driven_step"]["exchanging"]["points"] = serde_json::json!([[2.0, f64::MAX], [4.0, -1.0]]);
    let mut huge_sizes = good.clone();
    huge_sizes["gemm_sizes"] = serde_json::json!((1..=40).collect::<Vec<u32>>());
    let cases = [
        (write("short.json", short.to_string().as_bytes()), "runs[0].tn: expected"),
        (write("negative.json", negative.to_string().as_bytes()), "tcp.bytes_per_second: -1"),
        (write("newer.json", newer.to_string().as_bytes()), "version 7"),
        (write("older.json", older.to_string().as_bytes()), "run `dfc calibrate` again"),
        (write("unordered.json", unordered.to_string().as_bytes()), "driven_step.latency.points: expected ascending"),
        (write("sizes.json", huge_sizes.to_string().as_bytes()), "gemm_sizes: expected 1 to 16 sizes"),
        (write("waiting.json", waiting.to_string().as_bytes()), "driven_step.exchanging.points"),
        (write("text.json", b"not json"), "not a dfc profile"),
        (write("binary.json", &[0xff, 0xfe, 0x00]), "is not UTF-8"),
        (write("large.json", &vec![b' '; (4 << 20) + 1]), "cannot read the profile"),
        (dir.join("missing.json"), "cannot read the profile"),
        (dir.clone(), "cannot read the profile"),
    ];
    for (path, message) in &cases {
        let output = dfc(&["compile", s(&mlp()), "--profile", s(path), "-o", s(&dir.join("x.plan"))], "off");
        assert!(!output.status.success(), "{}", path.display());
        let stderr = text(&output.stderr);
        assert!(stderr.contains(message), "{}: {stderr}", path.display());
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
    }
    // Found rather than given: a warning, and the assumed rates.
    let output = dfc(&["compile", s(&mlp()), "--report", "-o", s(&dir.join("x.plan"))], s(&cases[0].0));
    assert!(output.status.success(), "{}", text(&output.stderr));
    assert!(text(&output.stderr).contains("warning: the profile"), "{}", text(&output.stderr));
    assert!(text(&output.stdout).contains("assumed: 50 GFLOP/s"), "{}", text(&output.stdout));
    // Measured on another CPU: set aside too.
    let mut elsewhere = good.clone();
    elsewhere["cpu"]["name"] = serde_json::json!("Some Other CPU");
    let path = write("elsewhere.json", elsewhere.to_string().as_bytes());
    let output = dfc(&["compile", s(&mlp()), "--report", "-o", s(&dir.join("x.plan"))], s(&path));
    assert!(text(&output.stderr).contains("was measured on another CPU (Some Other CPU"), "{}", text(&output.stderr));
}
