//! `dfc run`: trains a plan on data files, or runs it forward with `--fetch`; the progress
//! bar and the lines a person reads.

use dfc_driver::{EpochRecord, Progress, TrainOptions};
use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

/// A progress bar on a terminal; one line per epoch otherwise (logs, CI).
pub struct Reporter {
    bar: Option<ProgressBar>,
    interactive: bool,
    recent_loss: f64,
}

impl Reporter {
    pub fn new() -> Reporter {
        Reporter { bar: None, interactive: std::io::stderr().is_terminal(), recent_loss: f64::NAN }
    }
}

impl Progress for Reporter {
    fn epoch_started(&mut self, epoch: u64, epochs: u64, steps: u64) {
        if !self.interactive {
            return;
        }
        let bar = ProgressBar::new(steps);
        bar.set_style(
            ProgressStyle::with_template(
                "epoch {prefix} {bar:30} {pos}/{len} steps  {msg}  [{elapsed_precise}<{eta_precise}]",
            )
            .expect("valid template"),
        );
        bar.set_prefix(format!("{epoch}/{epochs}"));
        self.bar = Some(bar);
    }

    fn step(&mut self, loss: f64, examples_per_sec: f64) {
        // An exponential average reads better than the noisy per-batch loss.
        self.recent_loss = if self.recent_loss.is_nan() { loss } else { 0.95 * self.recent_loss + 0.05 * loss };
        if let Some(bar) = &self.bar {
            bar.set_message(format!("loss {:.4}  {:.0} examples/s", self.recent_loss, examples_per_sec));
            bar.inc(1);
        }
    }

    fn epoch_finished(&mut self, record: &EpochRecord) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
        let mut line = format!(
            "epoch {}: train loss {:.4}, {:.0} examples/s, {:.1} s",
            record.epoch, record.train_loss, record.examples_per_sec, record.seconds
        );
        if let Some(loss) = record.eval_loss {
            line += &format!("; eval loss {loss:.4}");
        }
        if let Some(accuracy) = record.eval_accuracy {
            line += &format!(", accuracy {accuracy:.4}");
        }
        for (name, value) in &record.metrics {
            line += &format!(", {name} {value:.4}");
        }
        eprintln!("{line}");
    }

    fn resumed(&mut self, step: u64, epoch: u64, path: &Path) {
        eprintln!("resuming from {} (step {step}, {epoch} epoch(s) done)", path.display());
    }
}

pub struct RunArgs {
    pub train: TrainOptions,
    pub fetch: Option<String>,
    pub output: Option<PathBuf>,
}

/// Trains, or with `--fetch` runs forward, any plan (one partition or many); prints what a
/// person reads, or returns the error.
pub fn run(plan: &dfc_plan::Plan, args: &RunArgs) -> Result<(), String> {
    if args.train.backend == dfc_driver::Backend::Llvm {
        note_foreign_code(plan);
    }
    if let Some(name) = &args.fetch {
        let mut session =
            dfc_driver::Session::with_backend(plan, args.train.seed, args.train.backend).map_err(|e| e.to_string())?;
        match &args.train.checkpoint_dir {
            Some(dir) => match dfc_driver::checkpoint::latest(dir).map_err(|e| format!("checkpoint: {e}"))? {
                Some(found) => {
                    eprintln!("using the variables of {} (step {})", found.path.display(), found.step);
                    // The checkpoint must match the plan's variables, as when training resumes.
                    session.restore(&found.tensors, &found.path).map_err(|e| e.to_string())?;
                }
                None => return Err(format!("no checkpoint in {}", dir.display())),
            },
            None => {
                eprintln!(
                    "note: no --checkpoint-dir, so the variables have their initial values (seed {})",
                    args.train.seed
                );
            }
        }
        let result = dfc_driver::infer(&mut session, name, &args.train.feeds).map_err(|e| e.to_string())?;
        match &args.output {
            Some(path) => {
                dfc_driver::save_npy(path, &result).map_err(|e| format!("cannot write `{}`: {e}", path.display()))?;
                eprintln!("wrote `{name}` ({}) to {}", result.ty(), path.display());
            }
            None => print_tensor(name, &result),
        }
        return Ok(());
    }
    let mut reporter = Reporter::new();
    let started = std::time::Instant::now();
    let summary = dfc_driver::train(plan, &args.train, &mut reporter).map_err(|e| e.to_string())?;
    eprintln!("trained {} steps in {:.1} s", summary.steps, started.elapsed().as_secs_f64());
    Ok(())
}

/// Says which partitions carry code for a CPU this one is not (the session compiles them
/// again for this one at load).
pub fn note_foreign_code(plan: &dfc_plan::Plan) {
    let host = dfc_codegen::host_target();
    for partition in &plan.partitions {
        if let Some(code) = &partition.native {
            let missing = dfc_codegen::missing_features(&code.target, &host);
            if !missing.is_empty() {
                eprintln!(
                    "note: {}'s code was compiled for {} ({}), which this CPU ({}) cannot run: it lacks {}; compiling it for this CPU",
                    partition.device,
                    code.target.cpu,
                    code.target.triple,
                    host.cpu,
                    missing.join(", ")
                );
            }
        }
    }
}

/// A tensor for a person: its type, then its values (the first rows of a large one).
fn print_tensor(name: &str, tensor: &dfc_interp::Tensor) {
    println!("{name}: {}", tensor.ty());
    let values = tensor.to_f64_vec();
    let row = tensor.shape.dims().last().copied().unwrap_or(1).max(1);
    const ROWS: usize = 10;
    for chunk in values.chunks(row).take(ROWS) {
        let items: Vec<String> = chunk.iter().map(|v| format!("{v:.6}")).collect();
        println!("  [{}]", items.join(", "));
    }
    let rows = values.len().div_ceil(row);
    if rows > ROWS {
        println!("  ... {} more rows (use -o FILE.npy to save them all)", rows - ROWS);
    }
}
