//! The placement search and `--strategy auto`: trial moves scored as a fresh simulation scores
//! them, the same placement found on any number of threads, a search that never ends worse
//! than it began, the searched placement against round-robin's in the cost report, and `dfc
//! compile --strategy auto` choosing the candidate its own report predicts fastest.

use dfc_compile::{module_after, CompileOptions, Strategy};
use dfc_ir::{Cluster, DeviceKind, DeviceSpec, NodeId};
use dfc_passes::search::{improve, improve_on, Budget, Link, Problem, Share, Units};
use dfc_passes::CostModel;
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A branchy model: `towers` chains of `depth` dense layers of different widths from one
/// input, summed (what model parallelism can spread).
fn branchy(towers: usize, depth: usize) -> String {
    let mut text = String::from(
        "layer dense(x: f32[n, k], units: dim) -> f32[n, units] {\n    param w: f32[k, units] = glorot_uniform\n    param b: f32[units] = zeros\n    return x @ w + b\n}\n\nmodel branchy {\n    dim batch = 64\n    input x: f32[batch, 64]\n    input y: f32[batch, 64]\n",
    );
    let mut ends = Vec::new();
    for t in 0..towers {
        let width = 64 * (1 + t % 4);
        let mut previous = "x".to_string();
        for l in 0..depth {
            text += &format!("    let t{t}_{l} = relu(dense({previous}, units = {width}))\n");
            previous = format!("t{t}_{l}");
        }
        text += &format!("    let e{t} = dense({previous}, units = 64)\n");
        ends.push(format!("e{t}"));
    }
    text += &format!("    let out = {}\n", ends.join(" + "));
    text += "    let loss = mean((out - y) * (out - y))\n    output out\n    minimize loss with sgd(lr = 0.01)\n}\n";
    text
}

/// The branchy model's training graph as a placement problem on `devices` devices of two
/// tasks (so that every kind of link occurs), each node a unit of its own.
fn problem(devices: usize) -> (Problem, usize) {
    let options = CompileOptions::default();
    let (module, _) = module_after(&branchy(4, 2), "simplify", &options).expect("the model compiles");
    let order = module.graph.topo_order().expect("acyclic");
    let unit_of: HashMap<NodeId, u32> = order.iter().enumerate().map(|(i, &id)| (id, i as u32)).collect();
    let specs: Vec<DeviceSpec> = (0..devices)
        .map(|d| DeviceSpec::parse(&format!("/job:worker/task:{}/cpu:{}", d % 2, d / 2)).expect("a device"))
        .collect();
    let links = |a: usize, b: usize| match (a == b, a % 2 == b % 2) {
        (true, _) => Link::Same,
        (false, true) => Link::Process,
        (false, false) => Link::Network,
    };
    let units = Units { order: &order, unit_of: &unit_of, allowed: vec![Vec::new(); order.len()] };
    (Problem::new(&module, units, &specs, links, &CostModel::default(), Share::ALL), order.len())
}

#[test]
fn a_trial_move_scores_as_a_fresh_simulation_of_the_moved_assignment() {
    let (problem, units) = problem(6);
    let mut rng = fastrand::Rng::with_seed(24);
    let mut assignment: Vec<u32> = (0..units).map(|_| rng.u32(0..6)).collect();
    for trial in 0..400 {
        let count = if trial % 3 == 0 { 3 } else { 1 };
        let moved: Vec<u32> = (0..count).map(|_| rng.u32(0..units as u32)).collect();
        let device = rng.u32(0..6);
        let (step, _) = problem.score_move(&assignment, &moved, device);
        let mut after = assignment.clone();
        for &unit in &moved {
            after[unit as usize] = device;
        }
        assert_eq!(step, problem.step_seconds(&after), "trial {trial}");
        if rng.bool() {
            assignment = after;
        }
    }
}

#[test]
fn the_search_ends_no_worse_than_it_starts_and_scores_what_it_returns() {
    let (problem, units) = problem(8);
    let everything_on_one = vec![0u32; units];
    let outcome =
        improve(&problem, everything_on_one.clone(), Budget { candidates: 3_000, nodes: u64::MAX, seconds: 600.0 });
    let start = problem.step_seconds(&everything_on_one);
    assert!((outcome.start_seconds - start).abs() <= 1e-12 * start);
    assert!(outcome.step_seconds < 0.9 * start, "8 devices beat one: {} vs {start}", outcome.step_seconds);
    let rescored = problem.step_seconds(&outcome.assignment);
    assert!((outcome.step_seconds - rescored).abs() <= 1e-9 * rescored);
    assert!(outcome.scored > 0 && outcome.scored <= 3_000);
}

#[test]
fn the_search_finds_the_same_placement_on_any_number_of_threads() {
    let (problem, units) = problem(8);
    let start = problem.round_robin(&vec![0u32; units], |_| true);
    let budget = Budget { candidates: 2_000, nodes: u64::MAX, seconds: 600.0 };
    let alone = improve_on(&problem, start.clone(), budget, 1);
    assert!(alone.step_seconds < alone.start_seconds, "the search improves on round-robin");
    for threads in [2, 3, 8] {
        let together = improve_on(&problem, start.clone(), budget, threads);
        assert_eq!(together.assignment, alone.assignment, "{threads} threads");
        assert_eq!(together.step_seconds, alone.step_seconds, "{threads} threads");
        assert_eq!(together.scored, alone.scored, "{threads} threads");
    }
}

fn dfc(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_dfc")).args(args).env("NO_COLOR", "1").output().expect("run dfc")
}

/// Milliseconds of a report's step column (`1.23 ms`, `456.7 µs`, `1.2 s`).
fn milliseconds(text: &str) -> f64 {
    let (number, unit) = text.trim().split_once(' ').expect("a number and a unit");
    let value: f64 = number.parse().expect("a number");
    match unit {
        "s" => value * 1e3,
        "ms" => value,
        "µs" => value * 1e-3,
        "ns" => value * 1e-6,
        other => panic!("unit {other}"),
    }
}

#[test]
fn strategy_auto_chooses_the_fastest_candidate_it_reports() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let model = dir.path().join("branchy.df");
    std::fs::write(&model, branchy(4, 2)).expect("write the model");
    let plan = dir.path().join("branchy.plan");
    // Two ps tasks: auto also places the variables by size and partitions the large ones.
    let cluster = dir.path().join("cluster.json");
    let tasks = r#"{"cluster": {"ps": ["127.0.0.1:1", "127.0.0.1:2"], "worker": ["127.0.0.1:3", "127.0.0.1:4"]}}"#;
    std::fs::write(&cluster, tasks).expect("write the cluster");
    // Overlapped all-reduces in buckets of three sizes, or of the one given.
    let cases: [(&[&str], usize); 4] = [
        (&["--devices", "4"], 14),
        (&["--devices", "1"], 8),
        (&["--cluster", cluster.to_str().unwrap()], 16),
        (&["--devices", "4", "--fusion-threshold", "65536"], 12),
    ];
    for (devices, expected) in cases {
        let mut args = vec!["compile", model.to_str().unwrap(), "--strategy", "auto", "--no-profile", "--report"];
        args.extend_from_slice(devices);
        args.extend_from_slice(&["-o", plan.to_str().unwrap()]);
        let out = dfc(&args);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stdout}{stderr}");
        // `  → label    1.23 ms  chosen; ...` and `    label    1.50 ms  +22%; ...`
        let mut scored: Vec<(String, f64, bool, bool)> = Vec::new();
        for line in stdout.lines().skip(1).take_while(|l| l.starts_with("  ")) {
            let chosen = line.starts_with("  →");
            let body = line.trim_start_matches("  →").trim();
            let columns: Vec<&str> = body.split("  ").map(str::trim).filter(|c| !c.is_empty()).collect();
            if columns[1] == "—" {
                assert!(columns[2].starts_with("set aside: "), "{line}");
                continue;
            }
            scored.push((columns[0].to_string(), milliseconds(columns[1]), chosen, line.contains("(reference")));
        }
        let chosen: Vec<&(String, f64, bool, bool)> = scored.iter().filter(|c| c.2).collect();
        assert_eq!(chosen.len(), 1, "{stdout}");
        let fastest = scored.iter().filter(|c| !c.3).map(|c| c.1).fold(f64::INFINITY, f64::min);
        // Near a tie the earlier, simpler candidate is kept (within 2%).
        assert!(chosen[0].1 <= fastest * 1.021, "{stdout}");
        let strategy = chosen[0].0.split(',').next().unwrap().trim_end_matches(" --sync").to_string();
        assert!(
            stderr.contains(&format!("{strategy}, chosen by --strategy auto")),
            "the plan is the chosen candidate's: {stderr}"
        );
        assert!(stdout.starts_with(&format!("strategy auto: {expected} candidates")), "{stdout}");
        let sizes = ["256 KiB", "1 MiB", "4 MiB"].map(|size| format!("all-reduces overlapped in buckets of {size}"));
        let given = devices.contains(&"--fusion-threshold");
        assert!(sizes.iter().all(|s| stdout.contains(s.as_str()) != given), "{stdout}");
        let inspect = dfc(&["inspect", plan.to_str().unwrap()]);
        assert!(inspect.status.success(), "the chosen plan is an ordinary plan");
    }
}

#[test]
fn the_searched_placement_beats_round_robin_on_a_branchy_model() {
    let source = branchy(8, 2);
    let predicted = |placement| {
        let options = CompileOptions {
            cluster: Cluster::local(8, DeviceKind::Cpu),
            strategy: Strategy::Model,
            model_placement: placement,
            ..CompileOptions::default()
        };
        let compiled = dfc_compile::compile(&source, "branchy.df", &options).expect("compiles");
        (compiled.plan.report.expect("a cost report").step_seconds, compiled.search)
    };
    let (round_robin, _) = predicted(dfc_passes::ModelPlacement::RoundRobin);
    let (earliest, _) = predicted(dfc_passes::ModelPlacement::EarliestFinish);
    let (searched, search) = predicted(dfc_passes::ModelPlacement::Searched(Budget::default()));
    let search = search.expect("the search reports");
    assert!(search.searched_seconds <= search.earliest_finish_seconds);
    // The search's simulation is the cost report's list schedule, without Send/Recv nodes.
    let near = |simulated: f64, reported: f64| (simulated / reported - 1.0).abs() < 0.02;
    assert!(near(search.round_robin_seconds, round_robin), "{} vs {round_robin}", search.round_robin_seconds);
    assert!(near(search.earliest_finish_seconds, earliest), "{} vs {earliest}", search.earliest_finish_seconds);
    assert!(searched < 0.9 * round_robin, "searched {searched} vs round-robin {round_robin}");
}

#[test]
fn model_placement_is_for_the_model_strategy() {
    let mlp = root().join("examples/mlp.df");
    let out = dfc(&["compile", mlp.to_str().unwrap(), "--model-placement", "searched", "--strategy", "mirrored"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--model-placement applies to --strategy model, not mirrored"), "{stderr}");
}
