//! The training loop behind `dfc run`: epochs of shuffled batches through the training step,
//! evaluation after each epoch, metrics lines, checkpoints and resumption.
//!
//! Determinism: the initial values come from `seed`, the example order of epoch e from
//! `shuffle_seed` and e (or the files' order, with `no_shuffle`). Checkpoints are written at
//! the end of each epoch (and when `--steps` stops a run; `--steps 0` writes the initial
//! values), so a run that is stopped and started again continues from the newest
//! checkpoint and ends with the same variables as a run that was never stopped.

use crate::checkpoint;
use crate::data::{self, Dataset};
use crate::metrics::{BackupCounts, EpochRecord, MetricsLog};
use crate::runner::{FreeReplicas, ReplicaStep, Runner};
use crate::session::{self, Session};
use crate::tensorboard::EventWriter;
use dfc_interp::{trace, InterpError, Tensor, Variables};
use dfc_ir::{DType, Op};
use dfc_plan::Plan;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Clone, Debug, Default)]
pub struct TrainOptions {
    pub feeds: Vec<(String, PathBuf)>,
    pub eval_feeds: Vec<(String, PathBuf)>,
    /// Whole passes over the training data (default 1).
    pub epochs: Option<u64>,
    /// Stop after this many steps in all (may end mid-epoch).
    pub steps: Option<u64>,
    pub seed: u64,
    pub shuffle_seed: u64,
    /// Take the training examples in their files' order every epoch instead of shuffling.
    pub no_shuffle: bool,
    pub metrics: Option<PathBuf>,
    /// Write each epoch's metrics as TensorBoard scalars to an event file in this directory.
    pub tensorboard: Option<PathBuf>,
    pub checkpoint_dir: Option<PathBuf>,
    pub backend: crate::session::Backend,
    /// Step an asynchronous plan's replicas together even where they could step on their own.
    pub lockstep: bool,
}

/// What the loop tells the user interface as it goes.
pub trait Progress {
    /// Training of an epoch starts: `steps` batches.
    fn epoch_started(&mut self, epoch: u64, epochs: u64, steps: u64);
    fn step(&mut self, loss: f64, examples_per_sec: f64);
    fn epoch_finished(&mut self, record: &EpochRecord);
    fn resumed(&mut self, step: u64, epoch: u64, path: &std::path::Path);
    /// Something the user should know about how the run goes (once per run).
    fn note(&mut self, _note: &str) {}
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("{0}")]
    Data(#[from] data::DataError),
    #[error("{0}")]
    Interp(#[from] InterpError),
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// A checkpoint file that cannot be read or does not fit the plan (the message names it).
    #[error("{0}")]
    CheckpointFile(#[from] checkpoint::CheckpointError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Usage(String),
    /// A plan whose partitions do not fit together.
    #[error("{0}")]
    Plan(String),
}

pub struct TrainSummary {
    pub steps: u64,
    pub epochs: u64,
    pub records: Vec<EpochRecord>,
    /// The logical variables at the end (what a checkpoint holds).
    pub variables: Variables,
}

/// The batch size: the leading size shared by every input of the model.
pub fn batch_size(plan: &Plan) -> Result<usize, RunError> {
    let mut sizes = plan.inputs.iter().map(|input| (input.name.clone(), input.ty.clone()));
    let Some((first_name, first)) = sizes.next() else {
        return Err(RunError::Usage(format!("model `{}` has no inputs to feed", plan.model)));
    };
    let Some(&batch) = first.shape.dims().first() else {
        return Err(RunError::Usage(format!(
            "input `{first_name}` is a scalar; `dfc run` feeds examples along the leading axis"
        )));
    };
    for (name, ty) in sizes {
        if ty.shape.dims().first() != Some(&batch) {
            return Err(RunError::Usage(format!(
                "inputs `{first_name}` ({first}) and `{name}` ({ty}) do not share a leading batch size; `dfc run` feeds examples along the leading axis"
            )));
        }
    }
    Ok(batch)
}

/// Loads the feeds named on the command line and checks them against the model's inputs: their
/// types, and the values its ops can take ([`crate::indices`]). Every runner's feeds are loaded
/// here, in the driver's process, so the checks hold for remote workers too.
pub fn load_feeds(plan: &Plan, feeds: &[(String, PathBuf)], what: &str) -> Result<Dataset, RunError> {
    let ranges = crate::indices::index_ranges(plan);
    let mut tensors = Vec::new();
    for (name, path) in feeds {
        let Some(input) = plan.inputs.iter().find(|input| input.name == *name) else {
            let names: Vec<String> = plan.inputs.iter().map(|input| format!("`{}`", input.name)).collect();
            return Err(RunError::Usage(format!(
                "{what} `{name}` names no input of model `{}`; its inputs are {}",
                plan.model,
                names.join(", ")
            )));
        };
        let tensor = match text_feed(path) {
            Some(text) => {
                let dims = input.ty.shape.dims();
                if dims.len() != 2 || !matches!(input.ty.dtype, DType::U8 | DType::I32 | DType::I64) {
                    return Err(RunError::Usage(format!(
                        "{what} `{name}` is a text feed, but the input is {}: a text feed's examples are \
                         windows of tokens (bytes), [batch, tokens] of u8, i32 or i64",
                        input.ty
                    )));
                }
                data::load_text_windows(&text, dims[1])?
            }
            None => data::load(path)?,
        };
        let tensor = data::fit(name, tensor, &input.ty)?;
        crate::indices::check(&ranges, name, path, &tensor)?;
        tensors.push((name.clone(), tensor));
    }
    Ok(Dataset::new(tensors)?)
}

/// The file of a text feed, `text:PATH` (its bytes as tokens, windowed to the input's length).
fn text_feed(path: &Path) -> Option<PathBuf> {
    path.to_str()?.strip_prefix("text:").map(PathBuf::from)
}

fn require_inputs(inputs: Vec<String>, dataset: &Dataset, what: &str) -> Result<(), RunError> {
    let fed: Vec<&str> = dataset.names().collect();
    let missing: Vec<String> = inputs.into_iter().filter(|i| !fed.contains(&i.as_str())).collect();
    if missing.is_empty() {
        return Ok(());
    }
    let flags: Vec<String> = missing.iter().map(|m| format!("{what} {m}=FILE")).collect();
    Err(RunError::Usage(format!("no data for input(s) {}; add {}", missing.join(", "), flags.join(" "))))
}

/// Trains the plan (any number of partitions) in this process as `options` say, from its
/// initial values or the newest checkpoint.
pub fn train(plan: &Plan, options: &TrainOptions, progress: &mut dyn Progress) -> Result<TrainSummary, RunError> {
    let mut session = Session::with_backend(plan, options.seed, options.backend)?;
    train_with(&mut session, options, progress)
}

/// Why a plan whose step updates nothing is not trained (what warning W0005 said at compile
/// time), and `instead`, what to do.
pub fn nothing_to_train(plan: &Plan, instead: &str) -> String {
    format!(
        "model `{}` updates nothing in a training step: its loss depends on no trainable param (W0005); {instead}",
        plan.model
    )
}

/// Trains what `runner` runs (its own plan) as `options` say (`seed` and `backend` are the
/// runner's business), from its initial values or the newest checkpoint.
pub fn train_with<R: Runner>(
    runner: &mut R,
    options: &TrainOptions,
    progress: &mut dyn Progress,
) -> Result<TrainSummary, RunError> {
    let plan = runner.plan().clone();
    let plan = &plan;
    let Some(training) = &plan.training else {
        return Err(RunError::Usage(format!(
            "model `{}` has no `minimize`, so there is nothing to train; use --fetch NAME to run it",
            plan.model
        )));
    };
    if training.updates.is_empty() {
        return Err(RunError::Usage(nothing_to_train(plan, "use --fetch NAME to run it")));
    }
    if plan.strategy.backup_workers > 0 && (options.lockstep || runner.free_replicas()?.is_none()) {
        return Err(backups_need_workers(plan));
    }
    let batch = batch_size(plan)?;
    let train_data = {
        let _span = trace::span("data", || "load the --feed files");
        load_feeds(plan, &options.feeds, "--feed")?
    };
    let eval_data = if options.eval_feeds.is_empty() {
        None
    } else {
        let _span = trace::span("data", || "load the --eval-feed files");
        Some(load_feeds(plan, &options.eval_feeds, "--eval-feed")?)
    };

    let session = runner;
    let updates: Vec<&str> = training.updates.iter().map(String::as_str).collect();
    let mut step_fetches = vec![training.loss_node.as_str()];
    step_fetches.extend(training.learning_rate.as_deref());
    let step_program = session.program(&step_fetches, &updates)?;
    // Local SGD (`--sync-every`): the program that averages the replicas' variables, run every
    // `every` global steps and before an evaluation or a checkpoint that would otherwise see
    // replica 0's values alone.
    let averages: Vec<&str> = training.averages.iter().map(String::as_str).collect();
    let averaging = match averages.is_empty() {
        true => None,
        false => Some(Averaging {
            program: session.program(&[], &averages)?,
            every: u64::from(plan.strategy.sync_every.unwrap_or(1).max(1)),
            all_reduces: session::all_reduce_keys(plan, &averages)?.len() as u64,
        }),
    };
    let step_all_reduces = {
        let roots: Vec<&str> = step_fetches.iter().chain(&updates).copied().collect();
        session::all_reduce_keys(plan, &roots)?.len() as u64
    };
    // The learning rate of the last step: the schedule's, fetched with the loss, or the
    // constant one.
    let mut learning_rate = match training.learning_rate {
        Some(_) => None,
        None => Some(training.optimizer.learning_rate),
    };
    require_inputs(session.inputs(&step_program), &train_data, "--feed")?;
    let mut eval_fetches = vec![training.loss_node.as_str()];
    eval_fetches.extend(plan.metrics.iter().map(|m| m.name.as_str()));
    let eval_program = session.program(&eval_fetches, &[])?;
    if let Some(eval) = &eval_data {
        require_inputs(session.inputs(&eval_program), eval, "--eval-feed")?;
    }
    let steps_per_epoch = (train_data.len() / batch) as u64;
    if steps_per_epoch == 0 {
        return Err(RunError::Usage(format!(
            "the training data has {} examples, fewer than one batch of {batch}; compile with a smaller --dim batch",
            train_data.len()
        )));
    }

    let (mut step, mut start_epoch) = (0u64, 0u64);
    if let Some(dir) = &options.checkpoint_dir {
        std::fs::create_dir_all(dir)?;
        if let Some(found) = checkpoint::latest(dir)? {
            restore(session, &found)?;
            step = found.step;
            start_epoch = found.epoch;
            progress.resumed(step, start_epoch, &found.path);
        } else if options.steps == Some(0) {
            // `--steps 0` saves the initial values: a run (or another framework) can start
            // from exactly them.
            let variables = session.variables()?;
            let variables = checkpoint::whole_variables(session.plan(), &variables);
            checkpoint::save(dir, 0, 0, variables.iter().map(|(n, t)| (n, t)))
                .map_err(|e| RunError::Checkpoint(e.to_string()))?;
        }
    }

    let epochs = options.epochs.unwrap_or(1);
    // A resumed run adds to the metrics of the run it continues.
    let resumed = step > 0;
    let mut metrics_log = match &options.metrics {
        Some(path) if resumed => Some(MetricsLog::append(path)?),
        Some(path) => Some(MetricsLog::create(path)?),
        None => None,
    };
    let mut tensorboard = match &options.tensorboard {
        Some(dir) => Some(EventWriter::create(dir).map_err(|e| {
            RunError::Usage(format!("cannot write a TensorBoard event file in {}: {e}", dir.display()))
        })?),
        None => None,
    };
    let mut records = Vec::new();
    // Where the runner must step an asynchronous plan's replicas together, the user hears why.
    if !options.lockstep && start_epoch < epochs && session.free_replicas()?.is_none() {
        if let Some(why) = session.why_replicas_step_together() {
            progress.note(&format!("the asynchronous replicas step together: {why}"));
        }
    }
    'epochs: for epoch in start_epoch..epochs {
        if options.steps.is_some_and(|limit| step >= limit) {
            break;
        }
        // A resumed run continues an interrupted epoch: the same order, without the batches
        // it had already trained on.
        let first_step_of_epoch = epoch * steps_per_epoch;
        let skip = step.saturating_sub(first_step_of_epoch);
        let order = if options.no_shuffle {
            (0..train_data.len()).collect()
        } else {
            data::shuffled_order(train_data.len(), options.shuffle_seed, epoch)
        };
        progress.epoch_started(epoch + 1, epochs, steps_per_epoch);
        // The epoch's worker metrics count its training steps only, not the last evaluation.
        session.take_worker_metrics();
        let started = Instant::now();
        let (mut loss_sum, mut loss_count, mut trained) = (0.0, 0u64, 0u64);
        let (mut all_reduces, mut unaveraged) = (0u64, false);
        let mut staleness: Option<(f64, f64)> = None;
        let mut backup = None;
        let limit = options.steps.map_or(u64::MAX, |limit| limit.saturating_sub(step));
        // An asynchronous plan's replicas step on their own where the runner can run them so.
        let mut free_running = false;
        let free_replicas = if options.lockstep { None } else { session.free_replicas()? };
        if let Some(replicas) = free_replicas {
            let todo = steps_per_epoch.saturating_sub(skip).min(limit);
            let epoch_data = EpochData { data: &train_data, order: &order, batch, skip, steps: todo };
            let free = train_free_running(plan, replicas, epoch_data, started, progress)?;
            (loss_sum, loss_count, trained) = (free.loss_sum, free.steps, free.steps);
            staleness = free.staleness;
            backup = free.backup;
            step += free.steps;
            free_running = true;
        }
        let mut batches = train_data.batches(batch, &order).enumerate();
        loop {
            if free_running {
                break;
            }
            let next = {
                let _span = trace::span("data", || "batch");
                batches.next()
            };
            let Some((i, feeds)) = next else { break };
            if (i as u64) < skip {
                continue;
            }
            if options.steps.is_some_and(|limit| step >= limit) {
                break;
            }
            let out = {
                let _span = trace::span("step", || format!("step {}", step + 1));
                session.run(&step_program, &feeds)?
            };
            let loss = out[0].scalar_f64();
            if let Some(lr) = out.get(1) {
                learning_rate = Some(lr.scalar_f64());
            }
            if !loss.is_finite() {
                return Err(RunError::Usage(format!("the loss became {loss} at step {step}; lower the learning rate")));
            }
            step += 1;
            trained += 1;
            loss_sum += loss;
            loss_count += 1;
            all_reduces += step_all_reduces;
            if let Some(averaging) = &averaging {
                unaveraged = step % averaging.every != 0;
                if !unaveraged {
                    all_reduces += averaging.run(session)?;
                }
            }
            let seconds = started.elapsed().as_secs_f64().max(1e-9);
            progress.step(loss, (trained * batch as u64) as f64 / seconds);
        }
        let finished_epoch = step >= first_step_of_epoch + steps_per_epoch;
        if let Some(averaging) = averaging.as_ref().filter(|_| unaveraged) {
            all_reduces += averaging.run(session)?;
        }
        let seconds = started.elapsed().as_secs_f64();
        let workers = session.take_worker_metrics();
        let mut record = EpochRecord {
            epoch: epoch + 1,
            step,
            train_loss: if loss_count > 0 { loss_sum / loss_count as f64 } else { f64::NAN },
            learning_rate,
            eval_loss: None,
            eval_accuracy: None,
            examples_per_sec: (trained * batch as u64) as f64 / seconds.max(1e-9),
            seconds,
            metrics: BTreeMap::new(),
            all_reduces,
            staleness,
            backup,
            workers,
        };
        if let Some(eval) = &eval_data {
            let _span = trace::span("evaluate", || format!("evaluate epoch {}", epoch + 1));
            let values = evaluate(session, &eval_program, eval, batch)?;
            record.eval_loss = Some(values[0]);
            for (metric, value) in plan.metrics.iter().zip(&values[1..]) {
                if metric.name == "accuracy" {
                    record.eval_accuracy = Some(*value);
                } else {
                    record.metrics.insert(metric.name.clone(), *value);
                }
            }
        }
        if let Some(log) = &mut metrics_log {
            log.write(&record)?;
        }
        if let Some(events) = &mut tensorboard {
            events.scalars(step, &record.scalars())?;
        }
        if let Some(dir) = &options.checkpoint_dir {
            let _span = trace::span("checkpoint", || format!("checkpoint at step {step}"));
            let completed_epochs = if finished_epoch { epoch + 1 } else { epoch };
            let variables = session.variables()?;
            let variables = checkpoint::whole_variables(session.plan(), &variables);
            checkpoint::save(dir, step, completed_epochs, variables.iter().map(|(n, t)| (n, t)))
                .map_err(|e| RunError::Checkpoint(e.to_string()))?;
        }
        progress.epoch_finished(&record);
        records.push(record);
        if !finished_epoch {
            break 'epochs;
        }
    }
    Ok(TrainSummary { steps: step, epochs, records, variables: session.variables()? })
}

/// Why a plan with backup workers cannot train where its replicas step together (in one
/// process, or under `--lockstep`): which gradients come first is a race between processes.
pub fn backups_need_workers(plan: &Plan) -> RunError {
    let n = plan.strategy.replicas;
    RunError::Usage(format!(
        "the plan has {} backup worker{}: its {n} replicas must step on their own, each on a worker of its own; run it with --spawn or --cluster, without --lockstep",
        plan.strategy.backup_workers,
        if plan.strategy.backup_workers == 1 { "" } else { "s" },
    ))
}

/// Local SGD's averaging of the replicas' variables.
struct Averaging<P> {
    program: P,
    /// Global steps between averages.
    every: u64,
    /// All-reduces per average.
    all_reduces: u64,
}

impl<P> Averaging<P> {
    /// Averages the replicas' variables; returns the all-reduces that took.
    fn run<R: Runner<Program = P>>(&self, session: &mut R) -> Result<u64, RunError> {
        let _span = trace::span("average", || "average the replicas' variables");
        session.run(&self.program, &HashMap::new())?;
        Ok(self.all_reduces)
    }
}

/// The batches of an epoch that a training loop works through.
struct EpochData<'a> {
    data: &'a Dataset,
    order: &'a [usize],
    /// The plan's batch size.
    batch: usize,
    /// Batches already trained on (a resumed epoch).
    skip: u64,
    /// Batches to train on now.
    steps: u64,
}

/// What an epoch of free-running replicas did.
struct FreeEpoch {
    /// The summed mean loss of each plan batch's replica steps.
    loss_sum: f64,
    /// Steps, counted in the plan's batches.
    steps: u64,
    /// The mean and the largest staleness of the replicas' updates, where measured.
    staleness: Option<(f64, f64)>,
    /// Backup workers: the updates applied and the gradients dropped.
    backup: Option<BackupCounts>,
}

/// An epoch of free-running replicas: each takes the next replica-sized batch as soon as it is
/// done with one (the epoch's batches, in order, each split into as many as there are
/// replicas) and steps on its own. Steps are counted in the plan's batches (the replicas'
/// steps over their number).
fn train_free_running(
    plan: &Plan,
    replicas: &dyn FreeReplicas,
    epoch: EpochData,
    started: Instant,
    progress: &mut dyn Progress,
) -> Result<FreeEpoch, RunError> {
    let n = plan.replicas.len();
    let rows = epoch.batch / n;
    let order = &epoch.order[(epoch.skip as usize) * epoch.batch..];
    let batches = std::sync::Mutex::new(epoch.data.batches(rows, order).take(epoch.steps as usize * n));
    let failed = std::sync::atomic::AtomicBool::new(false);
    let updates = UpdateBarrier::new(n);
    let (losses, received) = std::sync::mpsc::channel::<ReplicaStep>();
    let results = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let (batches, failed, losses, updates) = (&batches, &failed, losses.clone(), &updates);
                scope.spawn(move || -> Result<(), RunError> {
                    let _leaves = updates.stepper();
                    let mut taken_at = None;
                    while !failed.load(std::sync::atomic::Ordering::Relaxed) {
                        if let Some(version) = taken_at.take() {
                            updates.wait_past(version, failed);
                        }
                        let next = batches.lock().unwrap_or_else(|e| e.into_inner()).next();
                        let Some(feeds) = next else { return Ok(()) };
                        let feeds = crate::replicas::replica_feeds(plan, r, feeds);
                        match replicas.step(r, &feeds) {
                            Ok(step) if step.loss.is_finite() => {
                                if let Some(backup) = step.backup {
                                    updates.saw(backup.version);
                                    taken_at = (backup.accepted && !backup.applied).then_some(backup.version);
                                }
                                let _ = losses.send(step);
                            }
                            Ok(ReplicaStep { loss, .. }) => {
                                failed.store(true, std::sync::atomic::Ordering::Relaxed);
                                return Err(RunError::Usage(format!(
                                    "the loss of replica {r} became {loss}; lower the learning rate"
                                )));
                            }
                            Err(error) => {
                                failed.store(true, std::sync::atomic::Ordering::Relaxed);
                                return Err(error);
                            }
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        drop(losses);
        // Progress moves by the plan's batches: one per `n` replica steps.
        let (mut pending, mut steps) = (Vec::with_capacity(n), 0u64);
        let mut sum = 0.0;
        let (mut stale_sum, mut stale_max, mut stale_count) = (0.0f64, 0.0f64, 0u64);
        let mut backup: Option<BackupCounts> = None;
        for step in received {
            if let Some(tau) = step.staleness {
                (stale_sum, stale_max, stale_count) = (stale_sum + tau, stale_max.max(tau), stale_count + 1);
            }
            if let Some(step) = step.backup {
                let counts = backup.get_or_insert_with(BackupCounts::default);
                counts.dropped += u64::from(!step.accepted);
                counts.updates += u64::from(step.applied);
            }
            let loss = step.loss;
            pending.push(loss);
            if pending.len() == n {
                let mean = pending.drain(..).sum::<f64>() / n as f64;
                sum += mean;
                steps += 1;
                let seconds = started.elapsed().as_secs_f64().max(1e-9);
                progress.step(mean, (steps * epoch.batch as u64) as f64 / seconds);
            }
        }
        let results: Vec<Result<(), RunError>> =
            handles.into_iter().map(|h| h.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))).collect();
        let staleness = (stale_count > 0).then(|| (stale_sum / stale_count as f64, stale_max));
        (results, FreeEpoch { loss_sum: sum, steps, staleness, backup })
    });
    let (results, free) = results;
    // The first replica's failure (the others stop after their step).
    for result in results {
        result?;
    }
    Ok(free)
}

/// Backup workers' pacing (TensorFlow's sync tokens): a replica whose gradient was taken but
/// did not complete the update waits for the update before its next step, since a gradient of
/// the variables it already has would be dropped. It stops waiting when no other replica is
/// stepping (they all wait, or the epoch's batches are done), so that nothing waits for ever.
struct UpdateBarrier {
    state: std::sync::Mutex<BarrierState>,
    changed: std::sync::Condvar,
}

struct BarrierState {
    /// The latest version (updates applied) a step reported.
    version: u64,
    /// Replicas neither waiting nor finished.
    stepping: usize,
}

/// Counts a replica out of the stepping ones when its thread ends, however it ends.
struct Stepper<'a>(&'a UpdateBarrier);

impl Drop for Stepper<'_> {
    fn drop(&mut self) {
        self.0.lock().stepping -= 1;
        self.0.changed.notify_all();
    }
}

impl UpdateBarrier {
    fn new(replicas: usize) -> UpdateBarrier {
        let state = BarrierState { version: 0, stepping: replicas };
        UpdateBarrier { state: std::sync::Mutex::new(state), changed: std::sync::Condvar::new() }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BarrierState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn stepper(&self) -> Stepper<'_> {
        Stepper(self)
    }

    /// A step reported the variables at `version`.
    fn saw(&self, version: u64) {
        let mut state = self.lock();
        if version > state.version {
            state.version = version;
            self.changed.notify_all();
        }
    }

    /// Waits until a step reports a version past `version`, while another replica steps.
    fn wait_past(&self, version: u64, failed: &std::sync::atomic::AtomicBool) {
        let mut state = self.lock();
        state.stepping -= 1;
        self.changed.notify_all();
        while state.version <= version && state.stepping > 0 && !failed.load(std::sync::atomic::Ordering::Relaxed) {
            // A failing replica stops stepping, which wakes this one.
            state = self.changed.wait(state).unwrap_or_else(|e| e.into_inner());
        }
        state.stepping += 1;
    }
}

/// Replaces initial values by a checkpoint's, which must hold every logical variable with
/// its type (a partitioned one whole or as the plan's shards): checked here, naming the file,
/// before anything changes on whatever runs the plan (see [`checkpoint::for_plan`]).
pub fn restore<R: Runner>(session: &mut R, checkpoint: &checkpoint::Checkpoint) -> Result<(), RunError> {
    let values = checkpoint::for_plan(session.plan(), checkpoint)?;
    session.restore(&values, &checkpoint.path)
}

/// Mean loss and metrics over every full batch of `data`, in order.
pub fn evaluate<R: Runner>(
    session: &mut R,
    program: &R::Program,
    data: &Dataset,
    batch: usize,
) -> Result<Vec<f64>, RunError> {
    let order: Vec<usize> = (0..data.len()).collect();
    let mut sums: Vec<f64> = Vec::new();
    let mut batches = 0usize;
    for feeds in data.batches(batch, &order) {
        let out = session.run(program, &feeds)?;
        if sums.is_empty() {
            sums = vec![0.0; out.len()];
        }
        for (sum, value) in sums.iter_mut().zip(&out) {
            *sum += value.scalar_f64();
        }
        batches += 1;
    }
    if batches == 0 {
        return Err(RunError::Usage(format!(
            "the evaluation data has {} examples, fewer than one batch of {batch}",
            data.len()
        )));
    }
    Ok(sums.into_iter().map(|s| s / batches as f64).collect())
}

/// Runs the model forward on every example of the feeds and returns the named output for all
/// of them (stacked along the leading axis). The last batch is padded by repeating its last
/// example, and the padding is dropped from the result, so every example is computed.
pub fn infer<R: Runner>(session: &mut R, output: &str, feeds: &[(String, PathBuf)]) -> Result<Tensor, RunError> {
    let plan = session.plan().clone();
    let plan = &plan;
    let ty = lookup_output(plan, output)?;
    let batch = batch_size(plan)?;
    if ty.shape.dims().first() != Some(&batch) {
        // Stacking batches of anything else along its leading axis would give values that
        // belong to no example (a scalar cannot be stacked at all).
        return Err(RunError::Usage(format!(
            "`{output}` is {ty}, without the leading axis of the batch ({batch}): --fetch \
             gives an output per example; a value of a whole batch (a mean, a loss, a metric) is \
             what `dfc run --eval-feed` reports"
        )));
    }
    let data = load_feeds(plan, feeds, "--feed")?;
    let program = session.program(&[output], &[])?;
    require_inputs(session.inputs(&program), &data, "--feed")?;
    let n = data.len();
    if n == 0 {
        return Err(RunError::Usage("the feeds hold no examples".into()));
    }
    let padded: Vec<usize> = (0..n.div_ceil(batch) * batch).map(|i| i.min(n - 1)).collect();
    let mut parts = Vec::new();
    for feeds in data.batches(batch, &padded) {
        let mut out = session.run(&program, &feeds)?;
        parts.push(out.remove(0));
    }
    stack_examples(&parts, n)
}

/// Batches joined along the leading axis, keeping the first `n` examples: the interpreter's
/// own `concat` and `slice`.
fn stack_examples(parts: &[Tensor], n: usize) -> Result<Tensor, RunError> {
    let operands: Vec<&Tensor> = parts.iter().collect();
    let joined = dfc_interp::eval(&Op::Concat { axis: 0 }, &operands)?;
    let mut size = joined.shape.dims().to_vec();
    size[0] = n;
    let begin = vec![0; size.len()];
    Ok(dfc_interp::eval(&Op::Slice { begin, size }, &[&joined])?)
}

/// The type of the plan's output or metric `name`.
fn lookup_output<'p>(plan: &'p Plan, name: &str) -> Result<&'p dfc_ir::TensorType, RunError> {
    if let Some(found) = plan.outputs.iter().chain(&plan.metrics).find(|o| o.name == name) {
        return Ok(&found.ty);
    }
    let names: Vec<String> = plan.outputs.iter().chain(&plan.metrics).map(|o| format!("`{}`", o.name)).collect();
    Err(RunError::Usage(format!(
        "model `{}` has no output `{name}`; its outputs are {}",
        plan.model,
        if names.is_empty() { "none".into() } else { names.join(", ") }
    )))
}
