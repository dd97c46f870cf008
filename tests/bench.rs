//! `dfc bench` end to end: the JSON report of a training and an inference benchmark on a small
//! compiled example, the human line, and the one-line refusal of a damaged plan.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

#[path = "support/timeline.rs"]
mod timeline;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn scratch(name: &str) -> PathBuf {
    let dir = root().join("target").join("bench-tests").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

fn dfc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dfc")).args(args).env("NO_COLOR", "1").output().expect("run dfc")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn s(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

fn compile(example: &str, dir: &Path) -> PathBuf {
    let plan = dir.join(format!("{example}.plan"));
    let source = root().join("examples").join(format!("{example}.df"));
    let output = dfc(&["compile", s(&source), "-o", s(&plan)]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    plan
}

const QUICK: [&str; 9] = ["--min-time", "0", "--min-steps", "3", "--warmup", "1", "--backend", "interp", "--json"];

/// Runs `dfc bench PLAN QUICK extra` and returns its one JSON object, checked field by field.
fn bench_json(plan: &Path, extra: &[&str], mode: &str) -> serde_json::Map<String, serde_json::Value> {
    let mut args = vec!["bench", s(plan)];
    args.extend_from_slice(&QUICK);
    args.extend_from_slice(extra);
    let output = dfc(&args);
    assert!(output.status.success(), "dfc bench {extra:?}: {}", text(&output.stderr));
    let stdout = text(&output.stdout);
    assert_eq!(stdout.trim_end().lines().count(), 1, "not one line of JSON:\n{stdout}");
    let value: serde_json::Value = serde_json::from_str(&stdout).expect("stdout is JSON");
    let object = value.as_object().expect("a JSON object").clone();
    let keys: Vec<&str> = object.keys().map(String::as_str).collect();
    let mut expected = vec![
        "model",
        "mode",
        "backend",
        "median_step_us",
        "p10_step_us",
        "p90_step_us",
        "steps",
        "load_ms",
        "code",
        "threads",
        "gflops",
        "predicted_step_us",
        "prediction_error",
        "calibration",
    ];
    expected.sort();
    let mut sorted = keys.clone();
    sorted.sort();
    assert_eq!(sorted, expected, "fields of {stdout}");

    assert_eq!(object["model"], "softmax_regression");
    assert_eq!(object["mode"], mode);
    assert_eq!(object["backend"], "interp");
    let number = |key: &str| object[key].as_f64().unwrap_or_else(|| panic!("{key} is not a number: {stdout}"));
    let (p10, median, p90) = (number("p10_step_us"), number("median_step_us"), number("p90_step_us"));
    assert!(p10 > 0.0 && p10 <= median && median <= p90, "p10 {p10}, median {median}, p90 {p90}");
    let steps = object["steps"].as_u64().expect("steps is an integer");
    assert!(steps >= 3, "steps {steps}");
    assert!(number("load_ms") > 0.0);
    assert_eq!(object["code"], "none", "the interpreter runs no generated code");
    let threads = object["threads"].as_u64().expect("threads is an integer");
    assert!(threads >= 1, "threads {threads}");
    // x[100, 784] @ w[784, 10]: a matmul, so FLOPs are counted.
    let gflops = number("gflops");
    assert!(gflops.is_finite() && gflops > 0.0, "gflops {gflops}");
    object
}

#[test]
fn training_and_inference_report_json() {
    let dir = scratch("json");
    let plan = compile("softmax_regression", &dir);
    let train = bench_json(&plan, &[], "train");
    let inference = bench_json(&plan, &["--inference"], "inference");
    // The forward matmul x[100, 784] @ w[784, 10]; a training step adds the weights' gradient
    // (x has none). The rates differ, so compare FLOPs per step.
    let flops = |o: &serde_json::Map<String, serde_json::Value>| {
        o["gflops"].as_f64().expect("gflops") * o["median_step_us"].as_f64().expect("median") * 1e3
    };
    let (train_flops, inference_flops) = (flops(&train), flops(&inference));
    // (The median is rounded to the nanosecond: compare to a part in 10⁴.)
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-4 * b;
    assert!(close(inference_flops, 2.0 * 100.0 * 784.0 * 10.0), "inference FLOPs {inference_flops}");
    assert!(close(train_flops, 2.0 * inference_flops), "train FLOPs {train_flops}");
}

#[test]
fn min_and_max_steps_bound_the_count() {
    let dir = scratch("counts");
    let plan = compile("softmax_regression", &dir);
    let output = dfc(&[
        "bench",
        s(&plan),
        "--backend",
        "interp",
        "--json",
        "--warmup",
        "0",
        "--min-time",
        "60",
        "--min-steps",
        "2",
        "--max-steps",
        "5",
    ]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let value: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON");
    assert_eq!(value["steps"], 5);
}

/// Native code is generated at the first load of a plan on a machine and read from the code
/// cache after: the same plan then loads in a few milliseconds. A damaged cache entry is
/// generated again.
#[test]
fn native_code_is_generated_once_then_loaded_from_the_cache() {
    let dir = scratch("cache");
    let plan = compile("mlp", &dir);
    let cache = dir.join("code-cache");
    let load = || {
        let output = Command::new(env!("CARGO_BIN_EXE_dfc"))
            .args(["bench", s(&plan), "--min-time", "0", "--min-steps", "1", "--warmup", "0", "--json"])
            .env("DFC_CACHE_DIR", &cache)
            .output()
            .expect("run dfc");
        assert!(output.status.success(), "{}", text(&output.stderr));
        let value: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON");
        (value["code"].as_str().unwrap().to_string(), value["load_ms"].as_f64().unwrap())
    };
    let (first, _) = load();
    assert_eq!(first, "generated");
    let entries: Vec<PathBuf> = std::fs::read_dir(&cache).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(entries.len(), 1, "one partition, one entry: {entries:?}");
    let (second, _) = load();
    assert_eq!(second, "cached");
    let mut damaged = std::fs::read(&entries[0]).unwrap();
    let middle = damaged.len() / 2;
    damaged[middle] ^= 0x40;
    std::fs::write(&entries[0], damaged).unwrap();
    assert_eq!(load().0, "generated", "a damaged entry is not used");
    assert_eq!(load().0, "cached", "and it was written again");
}

#[test]
fn the_human_line() {
    let dir = scratch("human");
    let plan = compile("softmax_regression", &dir);
    let output =
        dfc(&["bench", s(&plan), "--min-time", "0", "--min-steps", "3", "--warmup", "1", "--backend", "interp"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let stdout = text(&output.stdout);
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    assert!(stdout.starts_with("softmax_regression train step (interp): median "), "{stdout}");
    for part in ["us (p10 ", ", p90 ", "), n=", " thread", " steps/s", " GFLOP/s", "; loaded in ", " ms (code none)"] {
        assert!(stdout.contains(part), "no `{part}` in {stdout}");
    }
}

#[test]
fn bad_plans_are_refused_with_one_line() {
    let dir = scratch("damaged");
    let plan = compile("softmax_regression", &dir);
    let good = std::fs::read(&plan).expect("plan");
    let mut corrupted = good.clone();
    corrupted[good.len() / 2] ^= 0x5a;
    let cases: Vec<(&str, Option<Vec<u8>>, &str)> = vec![
        ("corrupted", Some(corrupted), "corrupted"),
        ("truncated", Some(good[..good.len() / 2].to_vec()), "truncated"),
        ("text", Some(b"model m { }\n".to_vec()), "not a dfc plan"),
        ("missing", None, "cannot read"),
    ];
    for (name, bytes, reason) in cases {
        let path = dir.join(format!("{name}.plan"));
        if let Some(bytes) = bytes {
            std::fs::write(&path, bytes).expect("write");
        }
        for extra in [&[][..], &["--inference", "--json"][..]] {
            let mut args = vec!["bench", s(&path), "--backend", "interp"];
            args.extend_from_slice(extra);
            let output = dfc(&args);
            let stderr = text(&output.stderr);
            assert!(!stderr.contains("panicked"), "{name}: {stderr}");
            assert_eq!(output.status.code(), Some(1), "{name}: {stderr}");
            assert_eq!(stderr.lines().count(), 1, "{name}: not one line:\n{stderr}");
            assert!(stderr.starts_with("error: ") && stderr.contains(reason), "{name}: {stderr}");
            assert!(output.stdout.is_empty(), "{name}");
        }
    }
}

/// `dfc bench --timeline FILE`: a Trace Event Format document with one span per timed step (not the warm-up's),
/// on the driver's track, and the products of each step inside it on the partition's track; the report's step
/// count is the timeline's. A timeline that cannot be written is refused by its path, after the timing.
#[test]
fn a_timeline_holds_the_timed_steps_and_their_products() {
    let dir = scratch("timeline");
    let plan = compile("mlp", &dir);
    let timeline = dir.join("bench.json");
    let args = ["--min-time", "0", "--min-steps", "4", "--max-steps", "4", "--warmup", "2", "--json"];
    let output = dfc(&[&["bench", s(&plan), "--timeline", s(&timeline)][..], &args].concat());
    assert!(output.status.success(), "{}", text(&output.stderr));
    assert!(text(&output.stderr).contains("timeline: "), "{}", text(&output.stderr));
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON");
    assert_eq!(report["steps"], 4);
    let (events, tracks) = timeline::read(&timeline);
    let spans = |category: &str| -> Vec<&serde_json::Value> {
        events.iter().filter(|e| e["ph"] == "X" && e["cat"] == category).collect()
    };
    let at = |span: &serde_json::Value| (span["ts"].as_f64().unwrap(), span["dur"].as_f64().unwrap());
    let steps = spans("step");
    assert_eq!(steps.len(), 4, "the timed steps only");
    assert!(steps.iter().all(|step| tracks[&step["tid"].as_u64().unwrap()] == "driver"));
    let products = spans("matmul");
    // The mlp's step: three products forward, five backward (the first layer's input has no gradient).
    assert_eq!(products.len(), 4 * 8, "each step's products");
    for product in products {
        let (start, length) = at(product);
        assert!(
            steps.iter().map(|step| at(step)).any(|(s, d)| start >= s - 1.0 && start + length <= s + d + 1.0),
            "a product outside every step: {product}"
        );
        assert_ne!(tracks[&product["tid"].as_u64().unwrap()], "driver", "{product}");
    }

    let nowhere = dir.join("no such directory").join("bench.json");
    let output = dfc(&[&["bench", s(&plan), "--timeline", s(&nowhere)][..], &args].concat());
    assert_eq!(output.status.code(), Some(1), "{}", text(&output.stderr));
    let stderr = text(&output.stderr);
    assert!(stderr.contains("cannot write the timeline") && stderr.contains("no such directory"), "{stderr}");
}
