//! The cost model's prediction of a step beside the step measured: `dfc bench` and
//! `dfc run --timeline` predict the program they time, as it runs (in this process, or on the
//! workers it was given), from this host's profile (`dfc calibrate`), and put the timeline's
//! measured time of each device and kind of work next to the predicted.

use dfc_interp::trace::Event;
use dfc_passes::{CostModel, CostReport, Topology};
use dfc_plan::Plan;
use std::collections::HashMap;

/// Where a plan's partitions run.
pub enum Placement<'a> {
    /// All in this process, on all the cores.
    Here,
    /// On spawned workers of this host (`dfc run --spawn`), as they were assigned the
    /// partitions, each worker on its share of the cores, as `LocalWorkers` starts them.
    Spawned(&'a dfc_ir::Assignment),
    /// On the tasks of the plan's cluster, on the hosts its addresses name.
    Cluster,
}

/// What a person is told where there is no prediction.
pub const NO_PROFILE: &str = "no prediction (no profile of this host: `dfc calibrate` makes one)";

/// A program of `plan` (its partitions cut to it: `dfc_driver::session::program_modules`)
/// predicted as `placement` runs it, from this host's profile: `None` without one.
pub fn predict(plan: &Plan, modules: &[dfc_ir::Module], placement: Placement<'_>) -> Option<CostReport> {
    let profile = crate::calibrate::host_profile()?;
    let parts: Vec<&dfc_ir::Module> = modules.iter().collect();
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let overlap = plan.strategy.overlap;
    let topology = match placement {
        Placement::Here => Topology {
            process: vec![0; parts.len()],
            host: vec![0; parts.len()],
            threads: vec![0],
            driven: false,
            overlap,
        },
        Placement::Spawned(assignment) => {
            Topology { overlap, ..Topology::spawned(&assignment.partition_worker, assignment.names.len(), cores) }
        }
        Placement::Cluster => Topology { overlap, ..Topology::of_cluster(&parts, &plan.cluster) },
    };
    Some(dfc_passes::cost::estimate_on(&parts, &CostModel::calibrated(profile), &topology))
}

/// The nodes of a training step: the loss and the updates.
pub fn training_nodes(plan: &Plan) -> Vec<&str> {
    match &plan.training {
        Some(training) => {
            std::iter::once(training.loss_node.as_str()).chain(training.updates.iter().map(String::as_str)).collect()
        }
        None => Vec::new(),
    }
}

/// A device's measured and predicted time a step in one kind of work.
#[derive(serde::Serialize)]
pub struct Breakdown {
    pub device: String,
    pub kind: String,
    /// A step's time in this kind of work, from the timeline (which adds its own cost).
    pub measured_us: f64,
    pub predicted_us: f64,
}

/// Per device and kind of work, the measured time a step (the spans on the device's track,
/// here or on a worker, over `steps`) beside the predicted.
pub fn breakdown(events: &[Event], steps: usize, predicted: &CostReport) -> Vec<Breakdown> {
    let mut rows = Vec::new();
    for device in &predicted.devices {
        let remote = format!(": {}", device.device);
        let on_device = |e: &&Event| *e.track == *device.device || e.track.ends_with(&remote);
        // Per kind: the measured microseconds and the predicted seconds.
        let mut kinds: HashMap<&str, (f64, f64)> = HashMap::new();
        let work: Vec<&Event> = events.iter().filter(on_device).filter(|e| e.category != "partition").collect();
        for event in outermost(work) {
            kinds.entry(&event.category).or_default().0 += event.duration_us;
        }
        for (kind, seconds) in &device.by_kind {
            kinds.entry(kind).or_default().1 += seconds;
        }
        let start = rows.len();
        for (kind, (measured, predicted)) in kinds {
            rows.push(Breakdown {
                device: device.device.clone(),
                kind: kind.to_string(),
                measured_us: tenths(measured / steps.max(1) as f64),
                predicted_us: tenths(predicted * 1e6),
            });
        }
        rows[start..].sort_by(|a, b| {
            b.measured_us
                .max(b.predicted_us)
                .total_cmp(&a.measured_us.max(a.predicted_us))
                .then_with(|| a.kind.cmp(&b.kind))
        });
    }
    rows
}

/// The spans of one device that lie within none of the others (a ring's phases lie within its
/// all-reduce, and are counted there once), in order of their start.
fn outermost(mut spans: Vec<&Event>) -> Vec<&Event> {
    spans.sort_by(|a, b| a.start_us.total_cmp(&b.start_us).then(b.duration_us.total_cmp(&a.duration_us)));
    let mut kept: Vec<&Event> = Vec::with_capacity(spans.len());
    let mut reach = f64::NEG_INFINITY;
    for span in spans {
        let end = span.start_us + span.duration_us;
        if end <= reach {
            continue;
        }
        reach = end;
        kept.push(span);
    }
    kept
}

/// The rows of `breakdown` for a person, a device at a time.
pub fn describe(rows: &[Breakdown]) -> String {
    let mut text = String::new();
    let mut device = "";
    for row in rows {
        if row.device != device {
            device = &row.device;
            text += &format!("\n  {device}: a step's work, measured (timeline) against predicted, us");
        }
        text += &format!("\n    {:<11} {:>10.1} {:>10.1}", row.kind, row.measured_us, row.predicted_us);
    }
    text
}

/// The median duration of the driver's `step` spans, in seconds, and how many there were.
pub fn measured_step(events: &[Event]) -> Option<(f64, usize)> {
    let mut steps: Vec<f64> =
        events.iter().filter(|e| e.category == "step" && *e.track == *"driver").map(|e| e.duration_us * 1e-6).collect();
    if steps.is_empty() {
        return None;
    }
    steps.sort_by(f64::total_cmp);
    Some((steps[steps.len() / 2], steps.len()))
}

fn tenths(us: f64) -> f64 {
    (us * 10.0).round() / 10.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn span(category: &'static str, start_us: f64, duration_us: f64) -> Event {
        Event {
            track: Arc::from("/job:localhost/task:0/cpu:0"),
            category: category.into(),
            name: Arc::from(category),
            start_us,
            duration_us,
            bytes: None,
        }
    }

    #[test]
    fn a_span_within_another_is_counted_once_and_an_overlapping_one_in_full() {
        let spans = [
            span("all_reduce", 100.0, 50.0),
            span("all_reduce", 105.0, 20.0), // its reduce-scatter
            span("all_reduce", 125.0, 20.0), // its all-gather
            span("matmul", 0.0, 80.0),
            span("all_reduce", 60.0, 30.0), // on the communication thread, past the product's end
            span("kernel", 200.0, 10.0),
        ];
        let kept: Vec<(f64, f64)> =
            outermost(spans.iter().collect()).iter().map(|e| (e.start_us, e.duration_us)).collect();
        assert_eq!(kept, [(0.0, 80.0), (60.0, 30.0), (100.0, 50.0), (200.0, 10.0)]);
    }
}
