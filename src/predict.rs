//! The cost model's prediction of a step beside the step measured: `dfc bench` and
//! `dfc run --timeline` predict the program they time, as it runs (in this process, or on the
//! workers it was given), from this host's profile (`dfc calibrate`), and put the timeline's
//! measured time of each device and kind of work next to the predicted.

use dfc_interp::trace::Event;
use dfc_passes::{CostModel, CostReport, Topology};
use dfc_plan::Plan;

/// Where a plan's partitions run.
pub enum Placement<'a> {
    /// All in this process, on all the cores.
    Here,
    /// On spawned workers of this host (`dfc run --spawn`): partition `p` on worker
    /// `partition_worker[p]`, each worker on its share of the cores, as `LocalWorkers` starts
    /// them.
    Spawned { partition_worker: &'a [usize], workers: usize },
    /// On the tasks of the plan's cluster, on the hosts its addresses name.
    Cluster,
}

/// The program of the nodes named `nodes` predicted as `placement` runs it, from this host's
/// profile: `None` without one, or for a plan the cost model cannot cut to the program.
pub fn predict(plan: &Plan, nodes: &[&str], placement: Placement<'_>) -> Option<CostReport> {
    let profile = crate::calibrate::host_profile()?;
    let modules = dfc_driver::session::program_modules(plan, nodes).ok()?;
    let parts: Vec<&dfc_ir::Module> = modules.iter().collect();
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let topology = match placement {
        Placement::Here => {
            Topology { process: vec![0; parts.len()], host: vec![0; parts.len()], threads: vec![0], driven: false }
        }
        Placement::Spawned { partition_worker, workers } => Topology {
            process: partition_worker.iter().map(|&w| w as u32).collect(),
            host: vec![0; parts.len()],
            threads: vec![(cores / workers.max(1)).max(1) as u32; workers],
            driven: true,
        },
        Placement::Cluster => Topology {
            driven: true,
            ..Topology::of_tasks_on(&parts, |device| dfc_compile::host_of(&plan.cluster, device))
        },
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
        let mut measured: Vec<(String, f64)> = Vec::new();
        for event in events.iter().filter(on_device).filter(|e| e.category != "partition") {
            match measured.iter_mut().find(|(k, _)| *k == event.category) {
                Some((_, total)) => *total += event.duration_us,
                None => measured.push((event.category.to_string(), event.duration_us)),
            }
        }
        let mut kinds: Vec<&str> = measured.iter().map(|(k, _)| k.as_str()).collect();
        kinds.extend(device.by_kind.iter().map(|(k, _)| k.as_str()).filter(|k| !measured.iter().any(|(m, _)| m == k)));
        let start = rows.len();
        for kind in kinds {
            let of = |list: &[(String, f64)]| list.iter().find(|(k, _)| k == kind).map_or(0.0, |(_, t)| *t);
            rows.push(Breakdown {
                device: device.device.clone(),
                kind: kind.to_string(),
                measured_us: tenths(of(&measured) / steps.max(1) as f64),
                predicted_us: tenths(of(&device.by_kind) * 1e6),
            });
        }
        rows[start..].sort_by(|a, b| b.measured_us.max(b.predicted_us).total_cmp(&a.measured_us.max(a.predicted_us)));
    }
    rows
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
