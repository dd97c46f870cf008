//! `dfc run` end to end: training on data files, metrics, checkpoints and resumption,
//! inference with `--fetch`, and the errors for bad feeds. Synthetic data makes these fast;
//! one test trains on the real Fashion-MNIST files (Debian's dataset-fashion-mnist).

use dfc_interp::Tensor;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

#[path = "support/close.rs"]
mod close;
#[path = "support/skip.rs"]
mod skip;
#[path = "support/timeline.rs"]
mod timeline;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn scratch(name: &str) -> PathBuf {
    let dir = root().join("target").join("run-tests").join(name);
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

/// `n` examples of `y = x · w + 0.5` with 13 features, as .npy files in `dir`.
fn regression_data(dir: &Path, n: usize, seed: u64) -> (PathBuf, PathBuf) {
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let mut next = move || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((state >> 33) as f64 / (1u64 << 31) as f64) * 2.0 - 1.0
    };
    let w: Vec<f64> = (0..13).map(|i| (i as f64 - 6.0) / 6.0).collect();
    let x: Vec<f64> = (0..n * 13).map(|_| next()).collect();
    let y: Vec<f64> = (0..n).map(|i| (0..13).map(|j| x[i * 13 + j] * w[j]).sum::<f64>() + 0.5).collect();
    let x_path = dir.join("x.npy");
    let y_path = dir.join("y.npy");
    dfc_driver::save_npy(&x_path, &Tensor::from_f64(dfc_ir::DType::F32, vec![n, 13], &x)).expect("write x");
    dfc_driver::save_npy(&y_path, &Tensor::from_f64(dfc_ir::DType::F32, vec![n], &y)).expect("write y");
    (x_path, y_path)
}

fn compile(example: &str, dir: &Path, extra: &[&str]) -> PathBuf {
    let plan = dir.join(format!("{example}.plan"));
    let source = root().join("examples").join(format!("{example}.df"));
    let mut args = vec!["compile", s(&source), "-o", s(&plan)];
    args.extend_from_slice(extra);
    let output = dfc(&args);
    assert!(output.status.success(), "{}", text(&output.stderr));
    plan
}

fn metrics(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .expect("metrics written")
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect()
}

#[test]
fn training_reduces_the_loss_and_writes_metrics() {
    let dir = scratch("train");
    let (x, y) = regression_data(&dir, 256, 1);
    let (eval_x, eval_y) = {
        let eval_dir = dir.join("eval");
        std::fs::create_dir_all(&eval_dir).expect("dir");
        regression_data(&eval_dir, 96, 2)
    };
    let plan = compile("linear_regression", &dir, &["--optimizer", "sgd(lr = 0.1)"]);
    let log = dir.join("metrics.jsonl");
    let output = dfc(&[
        "run",
        s(&plan),
        "--feed",
        &format!("x={}", s(&x)),
        "--feed",
        &format!("y={}", s(&y)),
        "--eval-feed",
        &format!("x={}", s(&eval_x)),
        "--eval-feed",
        &format!("y={}", s(&eval_y)),
        "--epochs",
        "6",
        "--metrics",
        s(&log),
    ]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let stderr = text(&output.stderr);
    assert!(stderr.contains("epoch 6: train loss"), "one line per epoch when not on a terminal:\n{stderr}");
    let records = metrics(&log);
    assert_eq!(records.len(), 6);
    for (i, record) in records.iter().enumerate() {
        for key in ["epoch", "step", "train_loss", "eval_loss", "eval_accuracy", "examples_per_sec"] {
            assert!(record.get(key).is_some(), "{key} missing in {record}");
        }
        assert_eq!(record["epoch"], i as u64 + 1);
        assert_eq!(record["step"], (i as u64 + 1) * 8, "256 examples in batches of 32");
    }
    let first = records[0]["eval_loss"].as_f64().expect("eval loss");
    let last = records[5]["eval_loss"].as_f64().expect("eval loss");
    assert!(last < first / 10.0, "the loss should fall: {first} then {last}");
}

/// A run stopped after 11 steps and started again ends where an uninterrupted run ends.
#[test]
fn a_resumed_run_ends_like_an_uninterrupted_one() {
    let dir = scratch("resume");
    let (x, y) = regression_data(&dir, 256, 3);
    let plan = compile("linear_regression", &dir, &["--optimizer", "momentum(lr = 0.05)"]);
    let feeds = [format!("x={}", s(&x)), format!("y={}", s(&y))];
    let run = |checkpoints: &Path, extra: &[&str]| {
        let mut args =
            vec!["run", s(&plan), "--feed", &feeds[0], "--feed", &feeds[1], "--checkpoint-dir", s(checkpoints)];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["--seed", "5", "--shuffle-seed", "9"]);
        let output = dfc(&args);
        assert!(output.status.success(), "{}", text(&output.stderr));
        text(&output.stderr)
    };
    let whole = dir.join("whole");
    run(&whole, &["--epochs", "3"]);
    let parts = dir.join("parts");
    let log = dir.join("parts.jsonl");
    run(&parts, &["--epochs", "3", "--steps", "11", "--metrics", s(&log)]);
    let resumed = run(&parts, &["--epochs", "3", "--metrics", s(&log)]);
    assert!(resumed.contains("resuming from"), "{resumed}");
    // The resumed run adds to the metrics: epoch 1, the interrupted epoch 2, then 2 and 3 again.
    let steps: Vec<u64> = metrics(&log).iter().map(|r| r["step"].as_u64().expect("step")).collect();
    assert_eq!(steps, [8, 11, 16, 24]);

    let final_whole = dfc_driver::checkpoint::latest(&whole).expect("readable").expect("a checkpoint");
    let final_parts = dfc_driver::checkpoint::latest(&parts).expect("readable").expect("a checkpoint");
    assert_eq!(final_whole.step, 24);
    assert_eq!(final_parts.step, 24);
    assert_eq!(final_whole.tensors.keys().collect::<Vec<_>>(), final_parts.tensors.keys().collect::<Vec<_>>());
    assert!(final_whole.tensors.contains_key("w/momentum"), "optimizer slots are checkpointed too");
    for (name, tensor) in &final_whole.tensors {
        assert_eq!(tensor, &final_parts.tensors[name], "`{name}` differs after resuming");
    }
}

/// `--steps 0` saves the initial values as the checkpoint of step 0, and a run resumes from
/// it; `--no-shuffle` takes the examples in the files' order: one SGD step of
/// linear_regression from zeros then moves `w` by `0.02/32 · Σ yᵢxᵢ` and `b` by `0.02/32 · Σ
/// yᵢ` over the first 32 rows of the files.
#[test]
fn steps_0_saves_the_initial_values_and_no_shuffle_keeps_the_files_order() {
    let dir = scratch("no_shuffle");
    let (x, y) = regression_data(&dir, 256, 7);
    let plan = compile("linear_regression", &dir, &[]);
    let checkpoints = dir.join("checkpoints");
    let feeds = [format!("x={}", s(&x)), format!("y={}", s(&y))];
    let run = |extra: &[&str]| {
        let mut args =
            vec!["run", s(&plan), "--feed", &feeds[0], "--feed", &feeds[1], "--checkpoint-dir", s(&checkpoints)];
        args.extend_from_slice(extra);
        let output = dfc(&args);
        assert!(output.status.success(), "{}", text(&output.stderr));
        text(&output.stderr)
    };
    run(&["--steps", "0"]);
    let initial = dfc_driver::checkpoint::latest(&checkpoints).expect("readable").expect("a checkpoint");
    assert_eq!(initial.step, 0);
    assert!(initial.path.ends_with("ckpt-00000000.safetensors"), "{}", initial.path.display());
    assert!(initial.tensors["w"].to_f64_vec().iter().all(|&w| w == 0.0), "w starts at zeros");

    let resumed = run(&["--steps", "1", "--no-shuffle"]);
    assert!(resumed.contains("resuming from"), "{resumed}");
    let after = dfc_driver::checkpoint::latest(&checkpoints).expect("readable").expect("a checkpoint");
    assert_eq!(after.step, 1);
    let (xs, ys) = (dfc_driver::load_npy(&x).unwrap().to_f64_vec(), dfc_driver::load_npy(&y).unwrap().to_f64_vec());
    let scale = 0.02 / 32.0;
    let b: f64 = ys[..32].iter().sum::<f64>() * scale;
    let w: Vec<f64> = (0..13).map(|j| (0..32).map(|i| ys[i] * xs[i * 13 + j]).sum::<f64>() * scale).collect();
    close::assert_close("b", &after.tensors["b"].to_f64_vec(), &[b], 1e-6);
    close::assert_close("w", &after.tensors["w"].to_f64_vec(), &w, 1e-6);
}

/// A learning-rate schedule with gradient clipping: `metrics.jsonl` records each epoch's last
/// rate, the schedule's at that step; the global step is checkpointed, so a run stopped mid
/// epoch resumes with the schedule where it was and ends with the same bits as one that was
/// never stopped.
#[test]
fn a_scheduled_run_logs_its_learning_rate_and_resumes_to_the_same_bits() {
    let dir = scratch("schedule");
    let (x, y) = regression_data(&dir, 256, 4);
    let optimizer =
        "momentum(lr = warmup(exponential_decay(0.05, decay_steps = 4, decay_rate = 0.5), steps = 3), clip_global_norm = 1.0)";
    let plan = compile("linear_regression", &dir, &["--optimizer", optimizer]);
    let feeds = [format!("x={}", s(&x)), format!("y={}", s(&y))];
    let run = |checkpoints: &Path, log: &Path, extra: &[&str]| {
        let mut args = vec![
            "run",
            s(&plan),
            "--feed",
            &feeds[0],
            "--feed",
            &feeds[1],
            "--checkpoint-dir",
            s(checkpoints),
            "--metrics",
            s(log),
            "--epochs",
            "3",
            "--seed",
            "5",
        ];
        args.extend_from_slice(extra);
        let output = dfc(&args);
        assert!(output.status.success(), "{}", text(&output.stderr));
    };
    let (whole, whole_log) = (dir.join("whole"), dir.join("whole.jsonl"));
    run(&whole, &whole_log, &[]);
    // 8 steps an epoch; the last step of each is step 7, 15, 23: past the 3 warm-up steps,
    // 0.05 · 0.5^((step − 3) / 4).
    let rates: Vec<f64> = metrics(&whole_log).iter().map(|r| r["learning_rate"].as_f64().expect("a rate")).collect();
    let expected = [7.0, 15.0, 23.0].map(|step: f64| 0.05 * 0.5f64.powf((step - 3.0) / 4.0));
    for (rate, expected) in rates.iter().zip(expected) {
        assert!((rate - expected).abs() < 1e-8, "{rates:?} against {expected:?}");
    }
    let (parts, parts_log) = (dir.join("parts"), dir.join("parts.jsonl"));
    run(&parts, &parts_log, &["--steps", "11"]);
    run(&parts, &parts_log, &[]);
    let final_whole = dfc_driver::checkpoint::latest(&whole).expect("readable").expect("a checkpoint");
    let final_parts = dfc_driver::checkpoint::latest(&parts).expect("readable").expect("a checkpoint");
    let step = &final_whole.tensors["global_step"];
    assert_eq!(step, &Tensor::scalar(24i64), "the global step counts the steps");
    assert_eq!(final_whole.tensors.keys().collect::<Vec<_>>(), final_parts.tensors.keys().collect::<Vec<_>>());
    for (name, tensor) in &final_whole.tensors {
        assert_eq!(tensor, &final_parts.tensors[name], "`{name}` differs after resuming");
    }
}

/// A model with dropout and a batch norm trains to the same bits from the same seed, to other
/// bits from another, and stopped mid epoch and resumed it ends with the bits of a run never
/// stopped: its masks come from the checkpointed seed and global step, and the batch norm's
/// moving averages are checkpointed. So also mirrored over two replicas on spawned workers.
#[test]
fn a_run_with_dropout_and_batch_norm_is_reproducible_and_resumes_to_the_same_bits() {
    let dir = scratch("dropout");
    let (x, y) = regression_data(&dir, 256, 6);
    let source = dir.join("dropped.df");
    std::fs::write(
        &source,
        "model dropped {\n    dim batch = 32\n    input x: f32[batch, 13]\n    input y: f32[batch]\n    \
         param w: f32[13] = glorot_uniform\n    param b: f32 = zeros\n    let h = batch_norm(dropout(x, 0.3), momentum = 0.9)\n    \
         let p = sum(h * w, axis = 1) + b\n    \
         minimize mean((p - y) * (p - y)) with sgd(lr = 0.05)\n}\n",
    )
    .expect("write the model");
    let feeds = [format!("x={}", s(&x)), format!("y={}", s(&y))];
    for (strategy, extra) in [("single", &[][..]), ("mirrored", &["--devices", "2", "--strategy", "mirrored"][..])] {
        let plan = dir.join(format!("dropped_{strategy}.plan"));
        let mut args = vec!["compile", s(&source), "-o", s(&plan)];
        args.extend_from_slice(extra);
        let output = dfc(&args);
        assert!(output.status.success(), "{}", text(&output.stderr));
        let run = |checkpoints: &Path, seed: &str, more: &[&str]| {
            let mut args = vec!["run", s(&plan), "--feed", &feeds[0], "--feed", &feeds[1]];
            args.extend_from_slice(&["--checkpoint-dir", s(checkpoints), "--epochs", "3", "--seed", seed]);
            if strategy == "mirrored" {
                args.extend_from_slice(&["--spawn", "2"]);
            }
            args.extend_from_slice(more);
            let output = dfc(&args);
            assert!(output.status.success(), "{strategy}: {}", text(&output.stderr));
            dfc_driver::checkpoint::latest(checkpoints).expect("readable").expect("a checkpoint")
        };
        let at = |name: &str| dir.join(format!("{strategy}_{name}"));
        let first = run(&at("first"), "5", &[]);
        let again = run(&at("again"), "5", &[]);
        let other = run(&at("other"), "6", &[]);
        run(&at("parts"), "5", &["--steps", "11"]);
        let resumed = run(&at("parts"), "5", &[]);
        assert_eq!(first.tensors["global_step"], Tensor::scalar(24i64), "{strategy}");
        assert_eq!(first.tensors["random_seed"], Tensor::scalar(5i64), "{strategy}");
        let moving_mean = first.tensors["h/moving_mean"].to_f64_vec();
        assert!(moving_mean.iter().all(|m| *m != 0.0), "{strategy}: the moving means moved: {moving_mean:?}");
        for (name, tensor) in &first.tensors {
            assert_eq!(tensor, &again.tensors[name], "{strategy}: `{name}` differs between two runs of one seed");
            assert_eq!(tensor, &resumed.tensors[name], "{strategy}: `{name}` differs after resuming");
        }
        assert_ne!(first.tensors["w"], other.tensors["w"], "{strategy}: another seed draws other masks");
    }
}

/// Any plan runs: placed on two devices, a model trains bit-identically to its single-device
/// plan; mirrored over two replicas, it trains to the same variables but for rounding, and
/// its checkpoints hold the same names (no replica copies); `--fetch` works on both.
#[test]
fn partitioned_plans_train_like_the_single_device_plan() {
    let dir = scratch("partitions");
    let (x, y) = regression_data(&dir, 256, 6);
    let feeds = [format!("x={}", s(&x)), format!("y={}", s(&y))];
    let train = |strategy: &str| {
        let plan_dir = dir.join(strategy);
        std::fs::create_dir_all(&plan_dir).expect("dir");
        let extra: &[&str] = match strategy {
            "single" => &["--optimizer", "momentum(lr = 0.05)"],
            _ => &["--optimizer", "momentum(lr = 0.05)", "--devices", "2", "--strategy", strategy],
        };
        let plan = compile("linear_regression", &plan_dir, extra);
        let checkpoints = plan_dir.join("ckpt");
        let output = dfc(&[
            "run",
            s(&plan),
            "--feed",
            &feeds[0],
            "--feed",
            &feeds[1],
            "--epochs",
            "2",
            "--seed",
            "3",
            "--checkpoint-dir",
            s(&checkpoints),
        ]);
        assert!(output.status.success(), "{strategy}: {}", text(&output.stderr));
        let fetched =
            dfc(&["run", s(&plan), "--feed", &feeds[0], "--fetch", "prediction", "--checkpoint-dir", s(&checkpoints)]);
        assert!(fetched.status.success(), "{strategy}: {}", text(&fetched.stderr));
        assert!(text(&fetched.stdout).starts_with("prediction: f32[256]"), "{}", text(&fetched.stdout));
        let plan = dfc_plan::decode(&std::fs::read(&plan).expect("plan")).expect("decodes");
        let last = dfc_driver::checkpoint::latest(&checkpoints).expect("readable").expect("a checkpoint");
        (plan.partitions.len(), last)
    };
    let (partitions, single) = train("single");
    assert_eq!(partitions, 1);
    let (partitions, model) = train("model");
    assert_eq!(partitions, 2);
    assert_eq!(model.step, single.step);
    assert_eq!(model.tensors, single.tensors, "model parallelism changes no arithmetic");
    let (partitions, mirrored) = train("mirrored");
    assert_eq!(partitions, 2);
    assert_eq!(mirrored.tensors.keys().collect::<Vec<_>>(), single.tensors.keys().collect::<Vec<_>>());
    for (name, tensor) in &single.tensors {
        let (a, b) = (tensor.to_f64_vec(), mirrored.tensors[name].to_f64_vec());
        let worst = close::worst_difference(&format!("`{name}`"), &b, &a, close::absolute);
        assert!(worst < 1e-4, "`{name}` differs by {worst} between one device and two replicas");
    }
}

/// A variable split over parameter servers is saved whole, and so is each of its optimizer
/// slots, under the model's names: a plan for one device serves and resumes a ps plan's
/// checkpoint and the other way round, as do checkpoints that hold the shards by their own
/// names; a whole variable of another shape, or none, is refused naming it.
#[test]
fn checkpoints_hold_partitioned_variables_whole_for_any_plan() {
    let dir = scratch("whole-shards");
    let (x, y) = regression_data(&dir, 256, 7);
    let feeds = [format!("x={}", s(&x)), format!("y={}", s(&y))];
    let cluster = dir.join("cluster.json");
    let jobs = r#"{"cluster": {"worker": ["localhost:3000"], "ps": ["localhost:2000", "localhost:2001"]}}"#;
    std::fs::write(&cluster, jobs).unwrap();
    let plan_in = |name: &str, extra: &[&str]| {
        let plan_dir = dir.join(name);
        std::fs::create_dir_all(&plan_dir).unwrap();
        let mut args = vec!["--optimizer", "momentum(lr = 0.05)"];
        args.extend_from_slice(extra);
        compile("linear_regression", &plan_dir, &args)
    };
    let single = plan_in("single", &[]);
    let ps_args = ["--cluster", s(&cluster), "--strategy", "ps", "--sync", "--partition-min-bytes", "16"];
    let ps = plan_in("ps", &ps_args);
    let ps_plan = dfc_plan::decode(&std::fs::read(&ps).unwrap()).unwrap();
    assert_eq!(ps_plan.params.iter().find(|p| p.name == "w").map(|p| p.partitions), Some(2), "w is split");
    let run = |plan: &Path, checkpoints: &Path, epochs: &str| {
        let args = ["run", s(plan), "--feed", &feeds[0], "--feed", &feeds[1], "--no-shuffle", "--epochs", epochs];
        let output = dfc(&[&args[..], &["--checkpoint-dir", s(checkpoints)]].concat());
        (output.status.success(), text(&output.stderr))
    };
    let latest = |checkpoints: &Path| dfc_driver::checkpoint::latest(checkpoints).unwrap().expect("a checkpoint");
    let trained = |plan: &Path, checkpoints: &Path, epochs: &str| {
        let (ok, stderr) = run(plan, checkpoints, epochs);
        assert!(ok, "{}: {stderr}", plan.display());
        latest(checkpoints)
    };
    let copy = |from: &Path, to: &str| {
        let to = dir.join(to);
        std::fs::create_dir_all(&to).unwrap();
        for entry in std::fs::read_dir(from).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
        to
    };
    let first = trained(&ps, &dir.join("first"), "1");
    let names: Vec<&str> = first.tensors.keys().map(String::as_str).collect();
    assert!(names.contains(&"w") && names.contains(&"w/momentum"), "{names:?}");
    assert!(names.iter().all(|n| !n.contains("part_")), "no shard by name: {names:?}");
    assert_eq!(first.tensors["w"].shape.dims(), [13, 1]);

    // One device resumes the ps plan's checkpoint, and the ps plan one device's.
    let uninterrupted = trained(&single, &dir.join("uninterrupted"), "2");
    let single_resumed = trained(&single, &copy(&dir.join("first"), "single-resumed"), "2");
    let ps_resumed = trained(&ps, &copy(&dir.join("first"), "ps-resumed"), "2");
    let one_epoch = trained(&single, &dir.join("one-epoch"), "1");
    let ps_from_single = trained(&ps, &copy(&dir.join("one-epoch"), "ps-from-single"), "2");
    for (what, resumed) in [
        ("one device from the ps plan's", &single_resumed),
        ("the ps plan from its own", &ps_resumed),
        ("the ps plan from one device's", &ps_from_single),
    ] {
        assert_eq!(resumed.step, uninterrupted.step, "{what}");
        assert_eq!(resumed.tensors.keys().collect::<Vec<_>>(), uninterrupted.tensors.keys().collect::<Vec<_>>());
        for (name, tensor) in &uninterrupted.tensors {
            let (a, b) = (tensor.to_f64_vec(), resumed.tensors[name].to_f64_vec());
            let worst = close::worst_difference(&format!("{what}: `{name}`"), &b, &a, close::absolute);
            assert!(worst < 1e-4, "resumed {what} checkpoint, `{name}` differs by {worst}");
        }
    }
    assert_eq!(one_epoch.tensors.keys().collect::<Vec<_>>(), first.tensors.keys().collect::<Vec<_>>());
    let fetched = dfc(&[
        "run",
        s(&single),
        "--feed",
        &feeds[0],
        "--fetch",
        "prediction",
        "--checkpoint-dir",
        s(&dir.join("first")),
    ]);
    assert!(fetched.status.success(), "{}", text(&fetched.stderr));

    // A checkpoint with the shards under their own names (w/part_0, w/part_0/momentum, …).
    let shard_rows: Vec<(String, usize, usize)> = ps_plan
        .partitions
        .iter()
        .flat_map(|p| p.module.graph.node_ids().map(move |id| p.module.graph.node(id)))
        .filter_map(|node| match &node.op {
            dfc_ir::Op::Variable { ty, origin: Some(origin), .. } if origin.name == "w" => {
                Some((node.name.clone(), origin.offset, ty.shape.dims()[0]))
            }
            _ => None,
        })
        .collect();
    assert_eq!(shard_rows.len(), 2, "{shard_rows:?}");
    let mut by_shard: Vec<(String, Tensor)> = Vec::new();
    for (name, tensor) in &first.tensors {
        let Some(slot) = name.strip_prefix('w').filter(|rest| rest.is_empty() || rest.starts_with('/')) else {
            by_shard.push((name.clone(), tensor.clone()));
            continue;
        };
        for (shard, offset, rows) in &shard_rows {
            let slice = dfc_ir::Op::Slice { begin: vec![*offset, 0], size: vec![*rows, 1] };
            by_shard.push((format!("{shard}{slot}"), dfc_interp::eval(&slice, &[tensor]).unwrap()));
        }
    }
    let shards_dir = dir.join("by-shard");
    let views = by_shard.iter().map(|(n, t)| (n.as_str(), t));
    dfc_driver::checkpoint::save(&shards_dir, first.step, first.epoch, views).unwrap();
    let from_shards = trained(&ps, &shards_dir, "2");
    assert_eq!(from_shards.tensors, ps_resumed.tensors, "the shards by name are the same values");

    // A whole variable of another shape, or none.
    for (case, replace) in
        [("another shape", Some(Tensor::from_f64(dfc_ir::DType::F32, vec![5, 1], &[0.0; 5]))), ("none", None)]
    {
        let mut tensors = first.tensors.clone();
        match replace {
            Some(tensor) => tensors.insert("w".to_string(), tensor),
            None => tensors.remove("w"),
        };
        let bad = dir.join(format!("bad-{}", case.replace(' ', "-")));
        dfc_driver::checkpoint::save(&bad, first.step, first.epoch, tensors.iter().map(|(n, t)| (n.as_str(), t)))
            .unwrap();
        let (ok, stderr) = run(&ps, &bad, "2");
        let expected = match case {
            "none" => "has no variable `w`; was it written for another model?",
            _ => "holds `w` as f32[5,1], but the plan's variable is f32[13,1]; was it written for another model?",
        };
        assert!(!ok && stderr.contains(expected), "{case}: {stderr}");
    }
}

#[test]
fn fetch_runs_forward_on_every_example() {
    let dir = scratch("fetch");
    let (x, y) = regression_data(&dir, 250, 4);
    let plan = compile("linear_regression", &dir, &["--optimizer", "sgd(lr = 0.1)"]);
    let checkpoints = dir.join("ckpt");
    let feeds = [format!("x={}", s(&x)), format!("y={}", s(&y))];
    let trained = dfc(&[
        "run",
        s(&plan),
        "--feed",
        &feeds[0],
        "--feed",
        &feeds[1],
        "--epochs",
        "30",
        "--checkpoint-dir",
        s(&checkpoints),
    ]);
    assert!(trained.status.success(), "{}", text(&trained.stderr));

    let out = dir.join("prediction.npy");
    let fetched = dfc(&[
        "run",
        s(&plan),
        "--feed",
        &feeds[0],
        "--fetch",
        "prediction",
        "-o",
        s(&out),
        "--checkpoint-dir",
        s(&checkpoints),
    ]);
    assert!(fetched.status.success(), "{}", text(&fetched.stderr));
    let prediction = dfc_driver::load(&out).expect("a .npy");
    assert_eq!(prediction.shape.dims(), [250], "250 examples: 7 full batches and a padded one, trimmed");
    let expected = dfc_driver::load(&y).expect("y").to_f64_vec();
    let worst = close::worst_difference("the predictions", &prediction.to_f64_vec(), &expected, close::absolute);
    assert!(worst < 0.05, "the trained model should predict y closely; worst error {worst}");

    // Without -o, the values are printed.
    let printed =
        dfc(&["run", s(&plan), "--feed", &feeds[0], "--fetch", "prediction", "--checkpoint-dir", s(&checkpoints)]);
    assert!(text(&printed.stdout).starts_with("prediction: f32[250]"), "{}", text(&printed.stdout));
    // An unknown output names the ones there are.
    let unknown = dfc(&["run", s(&plan), "--feed", &feeds[0], "--fetch", "nope"]);
    assert_eq!(unknown.status.code(), Some(1));
    assert!(
        text(&unknown.stderr).contains("has no output `nope`; its outputs are `prediction`"),
        "{}",
        text(&unknown.stderr)
    );

    // Outputs that are not per example (the loss, a weight) are refused, naming their type:
    // the batches' values cannot be stacked (a scalar) or would belong to no example.
    let source = std::fs::read_to_string(root().join("examples/linear_regression.df")).expect("the example");
    let source = source.replace("    output prediction\n", "    output prediction, loss, w\n");
    assert!(source.contains("output prediction, loss, w"), "the example's output line moved");
    let path = dir.join("outputs.df");
    std::fs::write(&path, source).expect("write");
    let plan = dir.join("outputs.plan");
    assert!(dfc(&["compile", s(&path), "-o", s(&plan)]).status.success());
    for (output, ty) in [("loss", "f32[]"), ("w", "f32[13,1]")] {
        let refused = dfc(&["run", s(&plan), "--feed", &feeds[0], "--feed", &feeds[1], "--fetch", output]);
        assert_eq!(refused.status.code(), Some(1), "{output}: {}", text(&refused.stderr));
        let expected = format!(
            "`{output}` is {ty}, without the leading axis of the batch (32): --fetch gives an output per example"
        );
        assert!(text(&refused.stderr).contains(&expected), "{output}: {}", text(&refused.stderr));
    }
}

/// A model whose loss depends on no trainable param compiles with warning W0005, and neither
/// `dfc run` nor `dfc bench` pretends to train it; it still runs forward.
#[test]
fn a_model_that_trains_nothing_is_refused_naming_the_warning() {
    let dir = scratch("nothing-to-train");
    let (x, y) = regression_data(&dir, 16, 5);
    let model = dir.join("frozen.df");
    let source = "model frozen {\n    input x: f32[8, 13]\n    input y: f32[8]\n    @trainable(false)\n    \
                  param w: f32[13, 1] = ones\n    let prediction = reshape(x @ w, [8])\n    output prediction\n    \
                  minimize mean((prediction - y) * (prediction - y)) with sgd(lr = 0.1)\n}\n";
    std::fs::write(&model, source).unwrap();
    let plan = dir.join("frozen.plan");
    let compiled = dfc(&["compile", s(&model), "-o", s(&plan)]);
    assert!(compiled.status.success(), "{}", text(&compiled.stderr));
    assert!(text(&compiled.stderr).contains("warning[W0005]: the loss depends on no trainable param"));

    let feeds = [format!("x={}", s(&x)), format!("y={}", s(&y))];
    let trained = dfc(&["run", s(&plan), "--feed", &feeds[0], "--feed", &feeds[1]]);
    assert!(!trained.status.success());
    let refusal = "model `frozen` updates nothing in a training step: its loss depends on no trainable param (W0005)";
    assert!(
        text(&trained.stderr).contains(&format!("{refusal}; use --fetch NAME to run it")),
        "{}",
        text(&trained.stderr)
    );
    let benched = dfc(&["bench", s(&plan)]);
    assert!(!benched.status.success());
    assert!(text(&benched.stderr).contains(&format!("{refusal}; use --inference")), "{}", text(&benched.stderr));
    let forward = dfc(&["run", s(&plan), "--feed", &feeds[0], "--fetch", "prediction"]);
    assert!(forward.status.success(), "{}", text(&forward.stderr));

    // Without any variable, local SGD has nothing to average: the plan loads all the same.
    let bare = dir.join("bare.df");
    let source = "model bare {\n    dim batch = 8\n    input x: f32[batch, 13]\n    input y: f32[batch]\n    \
                  minimize mean(y * sum(x, axis = 1)) with sgd(lr = 0.1)\n}\n";
    std::fs::write(&bare, source).unwrap();
    let plan = dir.join("bare.plan");
    let compiled =
        dfc(&["compile", s(&bare), "-o", s(&plan), "--devices", "2", "--strategy", "mirrored", "--sync-every", "2"]);
    assert!(compiled.status.success(), "{}", text(&compiled.stderr));
    let trained = dfc(&["run", s(&plan), "--feed", &feeds[0], "--feed", &feeds[1]]);
    let refusal = "model `bare` updates nothing in a training step: its loss depends on no trainable param (W0005)";
    assert!(text(&trained.stderr).contains(refusal), "{}", text(&trained.stderr));
}

#[test]
fn bad_feeds_are_refused_before_any_step() {
    let dir = scratch("bad-feeds");
    let (x, y) = regression_data(&dir, 64, 5);
    let plan = compile("linear_regression", &dir, &[]);
    let write = |name: &str, tensor: Tensor| {
        let path = dir.join(name);
        dfc_driver::save_npy(&path, &tensor).expect("write");
        path
    };
    let narrow = write("narrow.npy", Tensor::from_f64(dfc_ir::DType::F32, vec![64, 12], &[0.0; 64 * 12]));
    let doubles = write("doubles.npy", Tensor::from_f64(dfc_ir::DType::F64, vec![64, 13], &[0.5; 64 * 13]));
    let short = write("short.npy", Tensor::from_f64(dfc_ir::DType::F32, vec![60], &[0.0; 60]));
    let log = dir.join("metrics.jsonl");
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec![format!("x={}", s(&narrow)), format!("y={}", s(&y))],
            "feed `x`: examples are f32[12] but the model's input `x` takes f32[13]",
        ),
        (vec![format!("x={}", s(&doubles)), format!("y={}", s(&y))], "f64"),
        (vec![format!("x={}", s(&x)), format!("y={}", s(&short))], "60"),
        (vec![format!("x={}", s(&x))], "no data for input(s) y"),
        (vec![format!("x={}", s(&x)), format!("y={}", s(&y)), format!("z={}", s(&y))], "`z` names no input"),
        (vec![format!("x={}", s(&dir.join("missing.npy"))), format!("y={}", s(&y))], "missing.npy"),
    ];
    for (feeds, expected) in cases {
        let mut args = vec!["run".to_string(), s(&plan).to_string(), "--metrics".into(), s(&log).to_string()];
        for feed in &feeds {
            args.push("--feed".into());
            args.push(feed.clone());
        }
        let args: Vec<&str> = args.iter().map(|a| a.as_str()).collect();
        let output = dfc(&args);
        let stderr = text(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{feeds:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
        assert!(
            stderr.starts_with("error: ") && stderr.contains(expected),
            "{feeds:?}: expected `{expected}` in {stderr}"
        );
        assert!(!log.exists(), "no step ran, so no metrics were written");
    }
}

#[test]
fn fashion_mnist_trains_softmax_regression() {
    let Some(data) = skip::fashion_mnist() else { return };
    let dir = scratch("fashion-mnist");
    let plan = compile("softmax_regression", &dir, &["--optimizer", "sgd(lr = 0.1)"]);
    let log = dir.join("metrics.jsonl");
    let file = |name: &str| data.join(name).display().to_string();
    let output = dfc(&[
        "run",
        s(&plan),
        "--feed",
        &format!("images={}", file("train-images-idx3-ubyte.gz")),
        "--feed",
        &format!("labels={}", file("train-labels-idx1-ubyte.gz")),
        "--eval-feed",
        &format!("images={}", file("t10k-images-idx3-ubyte.gz")),
        "--eval-feed",
        &format!("labels={}", file("t10k-labels-idx1-ubyte.gz")),
        "--epochs",
        "1",
        "--metrics",
        s(&log),
    ]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let record = &metrics(&log)[0];
    assert_eq!(record["step"], 600, "60,000 images in batches of 100");
    let accuracy = record["eval_accuracy"].as_f64().expect("accuracy");
    assert!(
        accuracy > 0.78,
        "one epoch of softmax regression reaches about 0.8 on the 10,000 test images; got {accuracy}"
    );
}

/// The transformer example, made small (`--dim`), trains on a text feed through `dfc run`: its
/// loss falls well below a uniform guess's over 256 bytes (ln 256 ≈ 5.55) on text that
/// repeats, `dfc sample` continues a prompt as the text does, and a text feed or sampling for
/// a model that does not read tokens is refused.
#[test]
fn the_transformer_trains_on_a_text_feed() {
    let dir = scratch("transformer");
    let corpus = dir.join("corpus.txt");
    let line = "the quick brown fox jumps over the lazy dog. ";
    std::fs::write(&corpus, line.repeat(200)).expect("write the corpus");
    let dims = ["--dim", "batch=8", "--dim", "context=16", "--dim", "width=32"];
    let plan = compile("transformer", &dir, &dims);
    let metrics_path = dir.join("metrics.jsonl");
    let feed = format!("text=text:{}", s(&corpus));
    let checkpoints = dir.join("ckpt");
    let output = dfc(&[
        "run",
        s(&plan),
        "--feed",
        &feed,
        "--epochs",
        "4",
        "--metrics",
        s(&metrics_path),
        "--checkpoint-dir",
        s(&checkpoints),
    ]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let losses: Vec<f64> =
        metrics(&metrics_path).iter().map(|m| m["train_loss"].as_f64().expect("a train loss")).collect();
    assert_eq!(losses.len(), 4, "{losses:?}");
    assert!(losses[0] < 5.0 && losses[3] < 2.5 && losses[3] < losses[0], "losses {losses:?}");

    let sample = |plan: &Path, extra: &[&str]| {
        let mut args = vec!["sample", s(plan), "--checkpoint-dir", s(&checkpoints), "--prompt", "the quick"];
        args.extend_from_slice(extra);
        dfc(&args)
    };
    let output = sample(&plan, &["--length", "24", "--temperature", "0.3", "--seed", "1"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let sampled = text(&output.stdout);
    assert!(sampled.starts_with("the quick brown fox jumps"), "sampled {sampled:?}");
    assert_eq!(sampled.trim_end_matches('\n').len(), "the quick".len() + 24, "{sampled:?}");
    let output = sample(&plan, &["--temperature", "0"]);
    assert!(text(&output.stderr).contains("--temperature must be a number above 0, not 0"), "{}", text(&output.stderr));

    let mlp = compile("mlp", &dir, &[]);
    let output = dfc(&["run", s(&mlp), "--feed", &format!("images=text:{}", s(&corpus))]);
    assert!(!output.status.success());
    let stderr = text(&output.stderr);
    assert!(stderr.contains("`images` is a text feed, but the input is u8[128,28,28]"), "{stderr}");
    let output = dfc(&["sample", s(&mlp), "--input", "images"]);
    let stderr = text(&output.stderr);
    assert!(stderr.contains("input `images` is u8[128,28,28], not [batch, tokens]"), "{stderr}");
}

/// The two-towers example (two text inputs through embeddings, two outputs, two weighted
/// losses) trains through `dfc run` on tickets made of Debian's fortunes
/// (`examples/two_towers_data.py`): each output's metric ends well above what guessing the
/// commonest answer scores (53% of the test tickets are attributed, 35% are of the largest
/// department).
#[test]
fn the_two_towers_train_on_fortunes() {
    if !Path::new("/usr/share/games/fortunes/computers").exists() {
        skip::skip(
            skip::Need::Fortunes,
            "Debian's fortunes are not installed (apt-get install fortunes; .ci/run does)",
        );
        return;
    }
    let dir = scratch("two_towers");
    let data = dir.join("data");
    let script = root().join("examples/two_towers_data.py");
    let made = Command::new("python3").arg(&script).arg(&data).output().expect("run python3");
    assert!(made.status.success(), "{}", text(&made.stderr));
    let plan = compile("two_towers", &dir, &[]);
    let log = dir.join("metrics.jsonl");
    let mut args = vec!["run".to_string(), s(&plan).to_string()];
    for input in ["title", "body", "tag_bits", "priority", "department"] {
        args.push("--feed".into());
        args.push(format!("{input}={}", s(&data.join(format!("train_{input}.npy")))));
        args.push("--eval-feed".into());
        args.push(format!("{input}={}", s(&data.join(format!("test_{input}.npy")))));
    }
    args.extend(["--epochs", "10", "--metrics", s(&log)].map(String::from));
    let output = dfc(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(output.status.success(), "{}", text(&output.stderr));
    let last = metrics(&log).pop().expect("a record per epoch");
    let metric = |name: &str| last[name].as_f64().unwrap_or_else(|| panic!("{name} in {last}"));
    assert!(metric("eval_priority_accuracy") > 0.75, "{last}");
    assert!(metric("eval_department_accuracy") > 0.42, "{last}");
}

/// Local SGD (`--sync-every 3`, mirrored on two replicas): each epoch of 8 steps runs the
/// averages after steps 3 and 6 (then 9, 12 and 15) and at its end, one fused all-reduce each,
/// where every-step mirrored runs one a step, as `all_reduces` in the metrics counts. A run
/// resumed from an epoch's checkpoint ends with the bits of an uninterrupted one, and so does
/// one on two spawned workers.
#[test]
fn local_sgd_averages_every_k_steps_and_resumes_to_the_same_bits() {
    let dir = scratch("local_sgd");
    let (x, y) = regression_data(&dir, 256, 8);
    let feeds = [format!("x={}", s(&x)), format!("y={}", s(&y))];
    let plan = |name: &str, extra: &[&str]| {
        let plan_dir = dir.join(name);
        std::fs::create_dir_all(&plan_dir).expect("dir");
        let mut args = vec!["--optimizer", "momentum(lr = 0.05)", "--devices", "2", "--strategy", "mirrored"];
        args.extend_from_slice(extra);
        compile("linear_regression", &plan_dir, &args)
    };
    let run = |plan: &Path, name: &str, more: &[&str]| {
        let (checkpoints, log) = (dir.join(format!("{name}.ckpt")), dir.join(format!("{name}.jsonl")));
        let mut args = vec!["run", s(plan), "--feed", &feeds[0], "--feed", &feeds[1], "--seed", "4"];
        args.extend_from_slice(&["--checkpoint-dir", s(&checkpoints), "--metrics", s(&log)]);
        args.extend_from_slice(more);
        let output = dfc(&args);
        assert!(output.status.success(), "{name}: {}", text(&output.stderr));
        let all_reduces: Vec<u64> = metrics(&log).iter().map(|r| r["all_reduces"].as_u64().expect("counted")).collect();
        (all_reduces, dfc_driver::checkpoint::latest(&checkpoints).expect("readable").expect("a checkpoint"))
    };
    let mirrored = plan("mirrored", &[]);
    let (every_step, _) = run(&mirrored, "mirrored", &["--epochs", "2"]);
    assert_eq!(every_step, [8, 8], "mirrored: one fused all-reduce of the gradients a step");

    let local = plan("local", &["--sync-every", "3"]);
    let (averages, whole) = run(&local, "whole", &["--epochs", "2"]);
    assert_eq!(averages, [3, 4], "averages after steps 3, 6, 8 (the epoch's end), 9, 12, 15 and 16");
    assert_eq!(whole.step, 16);
    run(&local, "parts", &["--epochs", "1"]);
    let (_, resumed) = run(&local, "parts", &["--epochs", "2"]);
    let (_, spawned) = run(&local, "spawned", &["--epochs", "2", "--spawn", "2"]);
    for (name, tensor) in &whole.tensors {
        assert_eq!(tensor, &resumed.tensors[name], "`{name}` differs after resuming");
        assert_eq!(tensor, &spawned.tensors[name], "`{name}` differs on spawned workers");
    }
    assert_ne!(
        whole.tensors["w"],
        dfc_driver::checkpoint::latest(&dir.join("mirrored.ckpt")).unwrap().unwrap().tensors["w"]
    );
}

/// `dfc run --timeline`: valid Trace Event Format JSON (metadata naming each track, complete
/// events with numeric times), the driver's steps and data loading, and per partition its
/// kernels, products, sends, receives and all-reduces with their bytes, inside the steps that
/// ran them; on spawned workers, each worker's partitions on tracks of their own, and the
/// ring's reduce-scatter and all-gather.
#[test]
fn a_timeline_shows_steps_kernels_and_all_reduces() {
    let dir = scratch("timeline");
    let (x, y) = regression_data(&dir, 256, 9);
    let feeds = [format!("x={}", s(&x)), format!("y={}", s(&y))];
    let plan = compile("linear_regression", &dir, &["--devices", "2", "--strategy", "mirrored"]);
    for spawned in [false, true] {
        let timeline = dir.join(format!("timeline_{spawned}.json"));
        let mut args = vec!["run", s(&plan), "--feed", &feeds[0], "--feed", &feeds[1], "--epochs", "2"];
        args.extend_from_slice(&["--timeline", s(&timeline)]);
        if spawned {
            args.extend_from_slice(&["--spawn", "2"]);
        }
        let output = dfc(&args);
        assert!(output.status.success(), "{}", text(&output.stderr));
        assert!(text(&output.stderr).contains("timeline: "), "{}", text(&output.stderr));
        let (events, tracks) = timeline::read(&timeline);
        let spans: Vec<&serde_json::Value> = events.iter().filter(|e| e["ph"] == "X").collect();
        for span in &spans {
            for key in ["ts", "dur", "pid", "tid"] {
                assert!(span[key].is_number(), "{key} of {span}");
            }
            assert!(span["name"].is_string() && span["cat"].is_string(), "{span}");
            assert!(tracks.contains_key(&span["tid"].as_u64().unwrap()), "an unnamed track: {span}");
        }
        let on =
            |category: &str| -> Vec<&&serde_json::Value> { spans.iter().filter(|s| s["cat"] == category).collect() };
        let track = |span: &serde_json::Value| tracks[&span["tid"].as_u64().unwrap()].as_str();
        let steps = on("step");
        assert_eq!(steps.len(), 16, "two epochs of 8 steps");
        assert!(steps.iter().all(|s| track(s) == "driver"));
        assert!(on("data").iter().any(|s| s["name"] == "load the --feed files"));
        let devices: std::collections::BTreeSet<&str> = on("kernel").iter().map(|s| track(s)).collect();
        assert_eq!(devices.len(), 2, "kernels on each partition's track: {devices:?}");
        if spawned {
            assert!(devices.iter().all(|d| d.starts_with("worker ")), "{devices:?}");
        }
        assert!(!on("matmul").is_empty() && !on("send").is_empty() && !on("recv").is_empty());
        let all_reduces = on("all_reduce");
        assert!(all_reduces.iter().all(|s| s["args"]["bytes"].as_u64().is_some_and(|b| b > 0)), "bytes of each");
        let phases = all_reduces.iter().filter(|s| s["name"].as_str().unwrap().starts_with("reduce-scatter")).count();
        assert_eq!(phases > 0, spawned, "the ring's phases, on workers only");
        // Every kernel ran within some step.
        let within = |s: &serde_json::Value| {
            let (t, d) = (s["ts"].as_f64().unwrap(), s["dur"].as_f64().unwrap());
            steps.iter().any(|step| {
                let (a, b) = (step["ts"].as_f64().unwrap(), step["dur"].as_f64().unwrap());
                t >= a - 1.0 && t + d <= a + b + 1.0
            })
        };
        let kernels = on("kernel");
        let outside: Vec<_> = kernels.iter().filter(|k| !within(k)).collect();
        assert!(
            outside.is_empty(),
            "{} of {} kernels outside every step (spawned: {spawned}), the first {}",
            outside.len(),
            kernels.len(),
            outside[0]
        );
    }
}

/// `dfc run --tensorboard DIR`: TensorBoard's own reader (tests/tensorboard/read_scalars.py)
/// finds every epoch's metrics at its global step, with the values of `metrics.jsonl` (as f32),
/// and a resumed run's epochs after the first run's, from a second file in the directory.
#[test]
fn tensorboard_reads_each_epochs_metrics() {
    let python = root().join("target/tb-venv/bin/python");
    let has_tensorboard =
        Command::new(&python).args(["-c", "import tensorboard"]).output().is_ok_and(|o| o.status.success());
    if !has_tensorboard {
        skip::skip(
            skip::Need::TensorBoard,
            "no Python with TensorBoard (python3 -m venv target/tb-venv && target/tb-venv/bin/pip install -r tests/tensorboard/requirements.txt; .ci/run does)",
        );
        return;
    }
    let dir = scratch("tensorboard");
    let (x, y) = regression_data(&dir, 256, 10);
    let plan = compile("linear_regression", &dir, &["--optimizer", "sgd(lr = 0.1)"]);
    let (log, events, checkpoints) = (dir.join("metrics.jsonl"), dir.join("events"), dir.join("ckpt"));
    for epochs in ["2", "3"] {
        let output = dfc(&[
            "run",
            s(&plan),
            "--feed",
            &format!("x={}", s(&x)),
            "--feed",
            &format!("y={}", s(&y)),
            "--eval-feed",
            &format!("x={}", s(&x)),
            "--eval-feed",
            &format!("y={}", s(&y)),
            "--epochs",
            epochs,
            "--metrics",
            s(&log),
            "--tensorboard",
            s(&events),
            "--checkpoint-dir",
            s(&checkpoints),
        ]);
        assert!(output.status.success(), "{}", text(&output.stderr));
    }
    let files = std::fs::read_dir(&events).expect("the event directory").count();
    assert_eq!(files, 2, "one event file per run");
    let read = Command::new(&python).arg(root().join("tests/tensorboard/read_scalars.py")).arg(&events).output();
    let read = read.expect("run the reader");
    assert!(read.status.success(), "{}", text(&read.stderr));
    let scalars: serde_json::Value = serde_json::from_slice(&read.stdout).expect("JSON");
    let records = metrics(&log);
    assert_eq!(records.len(), 3);
    for key in ["train_loss", "learning_rate", "eval_loss", "examples_per_sec", "seconds"] {
        let points = scalars[key].as_array().unwrap_or_else(|| panic!("no `{key}` in {scalars}"));
        assert_eq!(points.len(), 3, "{key}: {points:?}");
        for (point, record) in points.iter().zip(&records) {
            assert_eq!(point[0], record["step"], "{key}");
            let (value, expected) = (point[1].as_f64().unwrap(), record[key].as_f64().unwrap());
            assert!((value - expected).abs() <= 1e-6 * expected.abs().max(1.0), "{key}: {value} for {expected}");
        }
    }
}
