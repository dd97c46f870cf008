//! `--strategy auto`: every strategy the cluster allows, compiled in full and scored by the
//! cost model's simulation of its plan; the fastest becomes the plan, an ordinary one.
//!
//! The candidates, in order: single; model with the searched placement and with the
//! earliest-finish one; model as a pipeline of 2, 4 and 8 micro-batches; mirrored; mirrored
//! with its all-reduces overlapped with the backward pass, in buckets of 256 KiB (what
//! `--overlap` makes), 1 MiB and 4 MiB;
//! mirrored with the optimizer sharded over the replicas (ZeRO-1: the same training in less
//! memory); synchronous ps, and where the cluster has two ps tasks or more, with the variables
//! placed by size (greedy-sorted) and with large variables partitioned over the ps tasks;
//! central storage. A candidate that the cluster
//! or the model rules out (no `ps` job, no `minimize`, a batch that does not split) is listed
//! with the reason and set aside. A later candidate wins only if it is predicted more than
//! `MARGIN` faster than the best before it: near a tie the simpler plan is kept, since the
//! prediction is not finer than that. Asynchronous ps is not a candidate: it changes what
//! training computes (stale gradients), not only how fast — choose it by name.
//!
//! `model` with the round-robin placement is compiled beside them as a reference (what the
//! search is measured against) and is never chosen.

use crate::{compile, CompileError, CompileOptions, Compiled, Strategy};
use dfc_passes::cost::human_seconds;
use dfc_passes::search::Budget;
use dfc_passes::{CostReport, FusionOptions, ModelPlacement, SearchReport, VariablePlacement};
use std::fmt;
use std::time::Instant;

/// A later candidate must be predicted this much faster than the best before it to win.
const MARGIN: f64 = 0.02;

/// The micro-batch counts of the pipelines compared (1F1B, or the user's schedule).
const PIPELINE_MICRO_BATCHES: [u32; 3] = [2, 4, 8];

/// The fusion thresholds of the overlapped all-reduces compared: smaller buckets start
/// earlier, larger ones pay fewer rings' fixed costs. The first is `FusionOptions::overlapped`'s.
const OVERLAP_BUCKET_BYTES: [usize; 3] = [256 << 10, 1 << 20, 4 << 20];

/// `262144` as `256 KiB`, `1048576` as `1 MiB`.
fn kib(bytes: usize) -> String {
    if bytes >= 1 << 20 && bytes % (1 << 20) == 0 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    }
}

/// The smallest shard of a partitioned variable, as TensorFlow's min-max partitioner's
/// default slice: variables of twice this or more are split over the ps tasks.
const PARTITION_MIN_BYTES: u64 = 256 << 10;

/// What `--strategy auto` compared.
#[derive(Clone, Debug, PartialEq)]
pub struct AutoReport {
    pub candidates: Vec<Candidate>,
    /// The index of the chosen candidate.
    pub chosen: usize,
    /// The model candidate's placement search.
    pub search: Option<SearchReport>,
    pub seconds: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    pub label: String,
    /// Predicted step and what decides it, or why the candidate was set aside.
    pub outcome: Result<Scored, String>,
    /// A reference point, never chosen.
    pub reference: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Scored {
    pub step_seconds: f64,
    /// The busiest kind of work on the device that finishes last, and its share of the step.
    pub bottleneck: Option<(String, String, f64)>,
}

fn candidates(options: &CompileOptions) -> Vec<(String, CompileOptions, bool)> {
    let with = |strategy, model_placement| CompileOptions {
        strategy,
        model_placement,
        shard_optimizer: false,
        micro_batches: 1,
        overlap: false,
        ..options.clone()
    };
    let searched = ModelPlacement::Searched(Budget::default());
    let mut list = vec![("single".to_string(), with(Strategy::Single, ModelPlacement::EarliestFinish), false)];
    if options.cluster.devices().len() > 1 {
        list.push(("model, searched placement".into(), with(Strategy::Model, searched), false));
        list.push((
            "model, earliest-finish placement".into(),
            with(Strategy::Model, ModelPlacement::EarliestFinish),
            false,
        ));
        for micro_batches in PIPELINE_MICRO_BATCHES {
            let pipeline = CompileOptions { micro_batches, ..with(Strategy::Model, ModelPlacement::EarliestFinish) };
            list.push((format!("model, a pipeline of {micro_batches} micro-batches"), pipeline, false));
        }
    }
    list.push(("mirrored".into(), with(Strategy::Mirrored, ModelPlacement::EarliestFinish), false));
    // Overlapped, in smaller buckets that let the first all-reduces start early, of each of
    // `OVERLAP_BUCKET_BYTES` (unless the fusion threshold was given).
    let buckets: Vec<(String, FusionOptions)> = if options.fusion == FusionOptions::default() {
        OVERLAP_BUCKET_BYTES
            .iter()
            .map(|&threshold_bytes| {
                (format!(" in buckets of {}", kib(threshold_bytes)), FusionOptions { threshold_bytes })
            })
            .collect()
    } else {
        vec![(String::new(), options.fusion)]
    };
    for (buckets, fusion) in buckets {
        let overlapped =
            CompileOptions { overlap: true, fusion, ..with(Strategy::Mirrored, ModelPlacement::EarliestFinish) };
        list.push((format!("mirrored, all-reduces overlapped{buckets}"), overlapped, false));
    }
    let sharded = CompileOptions { shard_optimizer: true, ..with(Strategy::Mirrored, ModelPlacement::EarliestFinish) };
    list.push(("mirrored, sharded optimizer".into(), sharded, false));
    let ps = with(Strategy::ParameterServer { sync: true }, ModelPlacement::EarliestFinish);
    list.push(("ps --sync".into(), ps.clone(), false));
    // Over several ps tasks, where the variables go (unless given).
    if options.cluster.job("ps").is_some_and(|job| job.tasks.len() > 1) {
        if options.placement == VariablePlacement::RoundRobin {
            let by_size = CompileOptions { placement: VariablePlacement::GreedySorted, ..ps.clone() };
            list.push(("ps --sync, variables placed by size".into(), by_size, false));
        }
        if options.partition_min_bytes.is_none() {
            let partitioned = CompileOptions { partition_min_bytes: Some(PARTITION_MIN_BYTES), ..ps };
            list.push(("ps --sync, large variables partitioned".into(), partitioned, false));
        }
    }
    list.push(("central-storage".into(), with(Strategy::CentralStorage, ModelPlacement::EarliestFinish), false));
    if options.cluster.devices().len() > 1 {
        list.push(("model, round-robin placement".into(), with(Strategy::Model, ModelPlacement::RoundRobin), true));
    }
    list
}

/// Compiles every candidate and returns the fastest, with the comparison.
pub(crate) fn compile_auto(
    source: &str,
    source_name: &str,
    options: &CompileOptions,
) -> Result<(Compiled, AutoReport), CompileError> {
    let clock = Instant::now();
    let mut best: Option<(usize, f64, Compiled)> = None;
    let mut first_error: Option<CompileError> = None;
    let mut listed = Vec::new();
    let mut search = None;
    for (index, (label, candidate, reference)) in candidates(options).into_iter().enumerate() {
        let outcome = match compile(source, source_name, &candidate) {
            Ok(compiled) => {
                let report = compiled.plan.report.clone().unwrap_or_default();
                let step = report.step_seconds;
                if matches!(candidate.model_placement, ModelPlacement::Searched(_)) {
                    search = compiled.search.clone();
                }
                let wins = match &best {
                    None => true,
                    Some((_, fastest, _)) => step < fastest * (1.0 - MARGIN),
                };
                if !reference && step.is_finite() && wins {
                    best = Some((index, step, compiled));
                }
                Ok(Scored { step_seconds: step, bottleneck: bottleneck(&report) })
            }
            Err(error) => {
                let reason = match &error {
                    CompileError::Usage(message) => message.clone(),
                    CompileError::Diagnostics(d) => {
                        d.iter().find(|d| d.is_error()).map_or("it does not compile".into(), |d| d.message.clone())
                    }
                };
                first_error.get_or_insert(error);
                Err(reason)
            }
        };
        listed.push(Candidate { label, outcome, reference });
    }
    let Some((chosen, _, compiled)) = best else {
        return Err(first_error.unwrap_or_else(|| CompileError::Usage("no strategy fits this cluster".into())));
    };
    let report = AutoReport { candidates: listed, chosen, search, seconds: clock.elapsed().as_secs_f64() };
    Ok((compiled, report))
}

/// The device that finishes last, its busiest kind of work, and that work's share of the step.
fn bottleneck(report: &CostReport) -> Option<(String, String, f64)> {
    let last = report.devices.iter().max_by(|a, b| a.finish_seconds.total_cmp(&b.finish_seconds))?;
    let (kind, seconds) = last.by_kind.iter().max_by(|a, b| a.1.total_cmp(&b.1))?;
    let share = if report.step_seconds > 0.0 { seconds / report.step_seconds } else { 0.0 };
    Some((last.device.clone(), kind.clone(), share))
}

impl fmt::Display for AutoReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let chosen = &self.candidates[self.chosen];
        let best = chosen.outcome.as_ref().map_or(f64::NAN, |s| s.step_seconds);
        writeln!(
            f,
            "strategy auto: {} candidates compiled in {:.2} s; chose {}",
            self.candidates.len(),
            self.seconds,
            chosen.label
        )?;
        let width = self.candidates.iter().map(|c| c.label.len()).max().unwrap_or(0);
        for (i, candidate) in self.candidates.iter().enumerate() {
            let mark = if i == self.chosen { "→" } else { " " };
            let label = &candidate.label;
            match &candidate.outcome {
                Ok(scored) => {
                    let versus = if i == self.chosen {
                        "chosen".to_string()
                    } else {
                        format!("{:+.0}%", 100.0 * (scored.step_seconds / best - 1.0))
                    };
                    let why = scored.bottleneck.as_ref().map_or(String::new(), |(device, kind, share)| {
                        format!("; {device} finishes last, {:.0}% of the step in {kind}", 100.0 * share)
                    });
                    let reference = if candidate.reference { " (reference, not a candidate)" } else { "" };
                    writeln!(
                        f,
                        "  {mark} {label:<width$}  {:>10}  {versus}{why}{reference}",
                        human_seconds(scored.step_seconds)
                    )?;
                }
                Err(reason) => writeln!(f, "    {label:<width$}  {:>10}  set aside: {reason}", "—")?,
            }
        }
        match &self.search {
            Some(search) => write!(f, "{}", describe_search(search)),
            None => Ok(()),
        }
    }
}

/// The placement search's line of a report: what it looked at, how fast, and what it found.
pub fn describe_search(search: &SearchReport) -> String {
    format!(
        "placement search: {} nodes, {} of {} units movable; {} candidates in {:.3} s ({:.0} a second); simulated step: round-robin {}, earliest-finish {}, searched {}\n",
        search.nodes,
        search.movable,
        search.units,
        search.scored,
        search.seconds,
        search.scored as f64 / search.seconds.max(1e-9),
        human_seconds(search.round_robin_seconds),
        human_seconds(search.earliest_finish_seconds),
        human_seconds(search.searched_seconds)
    )
}
