//! `simplify` and `prune` checked against the reference interpreter: a simplified model computes
//! what the original computes.
//!
//! For every example and every `tests/passes/*.df` model: a training step (fetching the loss,
//! the outputs and the metrics; running the updates) on random feeds, from the same initial
//! variables, with and without `simplify`, then a second step (the first only ever sees the
//! optimizers' slots at zero). Losses, outputs, metrics and every variable after each step must
//! agree (floats to 1e-5, relative above 1; integers exactly). A step that fails must fail alike
//! in both.

use dfc_interp::{Program, Tensor, Variables};
use dfc_ir::{DType, Module, NodeId, Op, TensorRef};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn df_files(dir: &str) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(workspace().join(dir))
        .unwrap_or_else(|e| panic!("cannot read {dir}: {e}"))
        .map(|e| e.expect("directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "df"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no .df files in {dir}");
    files
}

/// Every model of every file in `examples/` and `tests/passes/`, after the optimizer pass.
fn models() -> Vec<(String, Module)> {
    let mut models = Vec::new();
    for path in df_files("examples").into_iter().chain(df_files("tests/passes")) {
        let text = std::fs::read_to_string(&path).expect("readable");
        let (analyses, diagnostics) = dfc_sema::check_source(&text, &dfc_sema::Options::default());
        assert!(!diagnostics.iter().any(|d| d.is_error()), "{} does not compile: {diagnostics:?}", path.display());
        for analysis in analyses {
            let mut module = analysis.module.expect("no errors, so a module");
            dfc_passes::run_pipeline(&mut module, Some("optimizer"));
            models.push((format!("{}: {}", path.file_name().unwrap().to_string_lossy(), analysis.model), module));
        }
    }
    models
}

/// A small deterministic generator (xorshift), so that the tests need no random crate.
struct Random(u64);

impl Random {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn uniform(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Random values for every input: floats in [-1, 1), integers (class ids, indices) in 0..10,
/// u8 (image bytes) in 0..=255, bools either way.
fn feeds(module: &Module, seed: u64) -> HashMap<String, Tensor> {
    let mut random = Random(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    module
        .inputs
        .iter()
        .map(|&id| {
            let ty = &module.graph.node(id).outputs[0];
            let values: Vec<f64> = (0..ty.shape.n_elements())
                .map(|_| match ty.dtype {
                    DType::F32 | DType::F64 => random.uniform() * 2.0 - 1.0,
                    DType::I32 | DType::I64 => (random.next() % 10) as f64,
                    DType::U8 => (random.next() % 256) as f64,
                    DType::Bool => (random.next() % 2) as f64,
                })
                .collect();
            (module.graph.node(id).name.clone(), Tensor::from_f64(ty.dtype, ty.shape.clone(), &values))
        })
        .collect()
}

/// What one step gives: the fetched values (loss first when there is one, then outputs, then
/// metrics) and every variable afterwards, by name; or the run's error.
type Step = Result<(Vec<Tensor>, Vec<(String, Tensor)>), String>;

fn fetches(module: &Module) -> Vec<TensorRef> {
    let loss = module.training.as_ref().map(|t| t.loss);
    loss.into_iter().chain(module.outputs.iter().chain(&module.metrics).map(|o| o.tensor)).collect()
}

fn variable_names(module: &Module) -> Vec<String> {
    let mut names: Vec<String> = module
        .graph
        .node_ids()
        .filter(|&id| matches!(module.graph.node(id).op, Op::Variable { .. }))
        .map(|id| module.graph.node(id).name.clone())
        .collect();
    names.sort();
    names
}

/// Training steps from `variables`, one per set of feeds, each seeing the variables the one
/// before left; the first failure ends the run.
fn steps(module: &Module, mut variables: Variables, feeds: &[HashMap<String, Tensor>]) -> Vec<Step> {
    let targets: Vec<NodeId> = module.training.as_ref().map(|t| t.updates.clone()).unwrap_or_default();
    let program = match Program::new(module, &fetches(module), &targets) {
        Ok(program) => program,
        Err(e) => return vec![Err(e.to_string())],
    };
    let mut done = Vec::new();
    for feeds in feeds {
        let step = program.run(module, &mut variables, feeds).map_err(|e| e.to_string()).map(|values| {
            let after = variable_names(module)
                .into_iter()
                .map(|name| {
                    let value = variables.get(name.as_str()).unwrap_or_else(|| panic!("no variable `{name}`")).clone();
                    (name, value)
                })
                .collect();
            (values, after)
        });
        let failed = step.is_err();
        done.push(step);
        if failed {
            break;
        }
    }
    done
}

/// Why `b` differs from `a`, if it does.
fn difference(a: &Tensor, b: &Tensor) -> Option<String> {
    if a.dtype() != b.dtype() || a.shape != b.shape {
        return Some(format!("{} vs {}", a.ty(), b.ty()));
    }
    let exact = !a.dtype().is_float();
    let tolerance = if a.dtype() == DType::F64 { 1e-12 } else { 1e-5 };
    for (i, (x, y)) in a.to_f64_vec().into_iter().zip(b.to_f64_vec()).enumerate() {
        let same = if exact {
            x == y
        } else {
            // NaN in both is the same result (an op's edge case, computed alike before and after
            // the pass); NaN in one alone fails, as `<=` is false for it.
            (x.is_nan() && y.is_nan()) || x == y || (x - y).abs() <= tolerance * x.abs().max(y.abs()).max(1.0)
        };
        if !same {
            return Some(format!("element {i}: {x} vs {y}"));
        }
    }
    None
}

/// Compares two steps; returns whether they ran (rather than failing alike).
fn compare(what: &str, original: &Step, simplified: &Step, failures: &mut Vec<String>) -> bool {
    match (original, simplified) {
        (Ok((values_a, variables_a)), Ok((values_b, variables_b))) => {
            assert_eq!(values_a.len(), values_b.len(), "{what}: fetched a different number of values");
            for (i, (a, b)) in values_a.iter().zip(values_b).enumerate() {
                if let Some(d) = difference(a, b) {
                    failures.push(format!("{what}: fetched value {i} differs: {d}"));
                }
            }
            assert_eq!(variables_a.len(), variables_b.len(), "{what}: a different number of variables");
            for ((name, a), (name_b, b)) in variables_a.iter().zip(variables_b) {
                assert_eq!(name, name_b, "{what}: the variables differ");
                if let Some(d) = difference(a, b) {
                    failures.push(format!("{what}: variable `{name}` after the step differs: {d}"));
                }
            }
            true
        }
        (Err(a), Err(b)) if a == b => false,
        (a, b) => {
            failures.push(format!(
                "{what}: {} without simplify, {} with it",
                a.as_ref().err().map_or("ran", |e| e.as_str()),
                b.as_ref().err().map_or("ran", |e| e.as_str())
            ));
            false
        }
    }
}

#[test]
fn simplify_preserves_training_steps() {
    let mut failures = Vec::new();
    let mut failed_alike = Vec::new();
    for (what, module) in models() {
        let mut simplified = module.clone();
        dfc_passes::simplify(&mut simplified);
        let problems = dfc_ir::verify(&simplified, dfc_ir::VerifyOptions::default());
        assert!(problems.is_empty(), "{what}: simplify broke the IR: {problems:?}");
        assert_eq!(variable_names(&module), variable_names(&simplified), "{what}: simplify changed the variables");
        for seed in [1, 2] {
            let feeds = [feeds(&module, seed), feeds(&module, seed + 100)];
            let variables = dfc_interp::initialize(&module, seed);
            let original = steps(&module, variables.clone(), &feeds);
            let after = steps(&simplified, variables, &feeds);
            assert_eq!(original.len(), after.len(), "{what}: failed at different steps");
            for (i, (original, after)) in original.iter().zip(&after).enumerate() {
                if !compare(&format!("{what} (seed {seed}, step {})", i + 1), original, after, &mut failures) {
                    failed_alike.push(what.clone());
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} difference(s):\n{}", failures.len(), failures.join("\n"));
    // Only the model of run-time errors fails to run (integer division by zero).
    failed_alike.dedup();
    assert_eq!(failed_alike, ["folding.df: unfoldable"]);
}

#[test]
fn simplify_is_idempotent_and_shrinks_the_examples() {
    for (what, module) in models() {
        let mut once = module.clone();
        dfc_passes::simplify(&mut once);
        let mut twice = once.clone();
        dfc_passes::simplify(&mut twice);
        assert_eq!(dfc_ir::print(&once), dfc_ir::print(&twice), "{what}: a second simplify changed the IR");
        assert!(once.graph.len() <= module.graph.len(), "{what}: simplify grew the graph");
        if what.starts_with("mlp") || what.starts_with("cnn") {
            assert!(once.graph.len() < module.graph.len(), "{what}: simplify found nothing");
        }
    }
}

fn input_names(module: &Module) -> Vec<String> {
    module.inputs.iter().map(|&id| module.graph.node(id).name.clone()).collect()
}

#[test]
fn pruning_to_the_loss_keeps_the_loss() {
    let mut failures = Vec::new();
    for (what, module) in models() {
        let Some(training) = &module.training else { continue };
        let loss = training.loss;
        let pruned = dfc_passes::prune(&module, &input_names(&module), &[loss], &[]).expect("prunable");
        let problems = dfc_ir::verify(&pruned, dfc_ir::VerifyOptions::default());
        assert!(problems.is_empty(), "{what}: the pruned module is broken: {problems:?}");
        assert!(pruned.graph.len() < module.graph.len(), "{what}: pruning to the loss removed nothing");
        let pruned_training = pruned.training.as_ref().expect("the loss survives, so training does");
        assert!(pruned_training.updates.is_empty(), "{what}: the loss does not need the updates");
        assert!(
            pruned
                .graph
                .node_ids()
                .all(|id| !pruned.graph.node(id).op.is_stateful()
                    || matches!(pruned.graph.node(id).op, Op::Variable { .. })),
            "{what}: an assignment survived pruning to the loss"
        );

        let feeds = feeds(&module, 3);
        let variables = dfc_interp::initialize(&module, 3);
        let run = |m: &Module| -> Result<f64, String> {
            let mut variables = variables.clone();
            let program = Program::new(m, &[loss], &[]).map_err(|e| e.to_string())?;
            Ok(program.run(m, &mut variables, &feeds).map_err(|e| e.to_string())?[0].scalar_f64())
        };
        match (run(&module), run(&pruned)) {
            (Ok(a), Ok(b)) if a == b => {}
            (a, b) => failures.push(format!("{what}: the loss is {a:?} in full, {b:?} pruned")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

fn mlp() -> Module {
    models().into_iter().find(|(what, _)| what.starts_with("mlp")).expect("examples/mlp.df").1
}

#[test]
fn pruning_to_an_output_drops_training_and_unneeded_inputs() {
    let module = mlp();
    let logits = module.outputs[0].tensor;
    let pruned = dfc_passes::prune(&module, &["images".to_string()], &[logits], &[]).expect("prunable");
    assert!(dfc_ir::verify(&pruned, dfc_ir::VerifyOptions::default()).is_empty());
    assert_eq!(input_names(&pruned), ["images"], "labels are not needed for the logits");
    assert!(pruned.training.is_none(), "the loss is not needed for the logits");
    assert!(pruned.metrics.is_empty(), "accuracy is not needed for the logits");
    assert_eq!(pruned.outputs.len(), 1);
    assert_eq!(pruned.params.len(), module.params.len(), "every layer's params are");
    // Ids are kept: the fetch still names the same node.
    assert_eq!(pruned.graph.node(logits.node).name, module.graph.node(logits.node).name);
}

#[test]
fn pruning_to_the_updates_keeps_the_assignments() {
    let module = mlp();
    let training = module.training.as_ref().expect("mlp trains");
    let pruned = dfc_passes::prune(&module, &input_names(&module), &[], &training.updates).expect("prunable");
    assert!(dfc_ir::verify(&pruned, dfc_ir::VerifyOptions::default()).is_empty());
    assert!(training.updates.iter().all(|&u| pruned.graph.contains(u)));
    assert!(pruned.metrics.is_empty(), "the updates do not need accuracy");
    // The gradients need the logits but not the mean that is the loss: without the loss, the
    // module has no training (the assignments stay in the graph).
    assert!(!pruned.graph.contains(training.loss.node));
    assert!(pruned.training.is_none());
    // With the loss fetched too, training stays, updates and all.
    let both = dfc_passes::prune(&module, &input_names(&module), &[training.loss], &training.updates).unwrap();
    assert_eq!(both.training.as_ref().map(|t| t.updates.len()), Some(training.updates.len()));
    assert_eq!(both.training.as_ref().map(|t| t.gradients.len()), Some(training.gradients.len()));
}

#[test]
fn a_fed_input_cannot_be_fetched() {
    let module = mlp();
    let images = module.inputs[0];
    let error = dfc_passes::prune(&module, &input_names(&module), &[images.into()], &[]).unwrap_err();
    assert_eq!(error, dfc_passes::PruneError::FedAndFetched { input: "images".into() });
    assert!(error.to_string().contains("`images`"), "{error}");
    // The rule is about fed inputs: fetching one that is not fed is pruning's business.
    assert!(dfc_passes::prune(&module, &["labels".to_string()], &[images.into()], &[]).is_ok());
}

#[test]
fn only_inputs_can_be_fed() {
    let module = mlp();
    let loss = module.training.as_ref().expect("mlp trains").loss;
    for name in ["pixels", "logits", "h1/w"] {
        let error = dfc_passes::prune(&module, &[name.to_string()], &[loss], &[]).unwrap_err();
        assert_eq!(error, dfc_passes::PruneError::UnknownFeed { name: name.into() });
        assert!(error.to_string().contains(&format!("`{name}`")), "{error}");
    }
}
