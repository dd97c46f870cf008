//! The compile pipeline, from source text to a plan for a cluster and a strategy: what
//! `dfc compile`, `dfc ir`, `dfc graph` and the tests share.
//!
//! ```text
//! sema → shard → pool_early → autodiff → optimizer → simplify ─┬────────────────────────────┬→ place → partition → plan
//!                                                               └ replicate (data parallel) ─┘
//! ```
//!
//! Data parallelism recompiles the source for the per-replica batch (the batch dim divided by
//! the number of replicas), so that every shape in a replica is its own, then `replicate`
//! joins the copies. The batch dim is the dim that sizes every input's first axis.

mod auto;
mod timings;

pub use auto::{describe_search, AutoReport, Candidate, Scored};

use timings::Clock;
pub use timings::{peak_resident_bytes, resident_bytes, StageTiming, Timings};

use dfc_diag::{Code, Diagnostic, Span};
use dfc_ir::{Cluster, DeviceKind, DeviceSpec, Module};
use dfc_passes::{
    CostModel, ModelPlacement, OptimizerOptions, ReplicateOptions, Replication, ShardOptions, VariablePlacement,
};
use dfc_plan::{IoSpec, Partition, Plan, ReplicaSpec, SplitInput, StrategySpec};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strategy {
    /// No replication: annotated nodes where they ask, the rest on the default device.
    Single,
    /// Model parallelism: compute spread over the devices by the cost model.
    Model,
    /// One replica per device, variables mirrored, gradients all-reduced.
    Mirrored,
    /// Variables on the ps tasks, one replica per worker task.
    ParameterServer { sync: bool },
    /// Variables on the local CPU, one replica per local device.
    CentralStorage,
    /// Each of the above that the cluster allows, compiled and simulated; the fastest
    /// (`auto`).
    Auto,
}

impl Strategy {
    pub const NAMES: [&'static str; 6] = ["single", "model", "mirrored", "ps", "central-storage", "auto"];

    pub fn from_name(name: &str, sync: bool) -> Option<Strategy> {
        Some(match name {
            "single" => Strategy::Single,
            "model" => Strategy::Model,
            "mirrored" => Strategy::Mirrored,
            "ps" => Strategy::ParameterServer { sync },
            "central-storage" => Strategy::CentralStorage,
            "auto" => Strategy::Auto,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Strategy::Single => "single",
            Strategy::Model => "model",
            Strategy::Mirrored => "mirrored",
            Strategy::ParameterServer { .. } => "ps",
            Strategy::CentralStorage => "central-storage",
            Strategy::Auto => "auto",
        }
    }
}

#[derive(Clone, Debug)]
pub struct CompileOptions {
    pub sema: dfc_sema::Options,
    /// Which model of the file (needed when it defines several).
    pub model: Option<String>,
    pub cluster: Cluster,
    pub strategy: Strategy,
    pub placement: VariablePlacement,
    /// `--partition-min-bytes`: shard large variables over the variable devices.
    pub partition_min_bytes: Option<u64>,
    /// Requests the cluster or strategy cannot satisfy become warnings.
    pub soft_placement: bool,
    pub cost_model: CostModel,
    /// `--model-placement`: how the `model` strategy spreads compute and variables.
    pub model_placement: ModelPlacement,
    /// `--fusion-threshold`: all-reduces of tensors up to this size share buffers (Horovod's
    /// tensor fusion).
    pub fusion: dfc_passes::FusionOptions,
    /// Mirrored on 3 or more devices: build replicas 0 and 1 in full and every other as an
    /// instance of replica 1's partition (`Plan::instances`). Off, every replica is built: what
    /// `dfc ir` and `dfc graph` show.
    pub replica_instances: bool,
    /// `--sync-every k` (mirrored only): local SGD, each replica on its own gradients, the
    /// replicas' variables averaged every k steps.
    pub sync_every: Option<u32>,
    /// Asynchronous ps: divide each replica's gradient by its staleness (Zhang et al.). `None`:
    /// on where the optimizer is SGD or momentum (whose rate that divides), off otherwise.
    pub staleness_aware: Option<bool>,
    /// `--overlap` (mirrored only): all-reduces start as soon as their gradients are computed.
    pub overlap: bool,
    /// `--backup-workers b` (synchronous ps only): each update takes the first N = replicas − b
    /// gradients of the current variables and drops the rest (TensorFlow's
    /// SyncReplicasOptimizer).
    pub backup_workers: u32,
    /// `--shard-optimizer` (mirrored only): ZeRO stage 1, each replica keeps and updates
    /// 1/N of every dense float variable's optimizer state, the new values all-gathered.
    pub shard_optimizer: bool,
    /// `--micro-batches M` (model only): a pipeline over the devices, each a stage of
    /// consecutive layers balanced by the cost model, the batch split into M micro-batches
    /// whose gradients are summed into one update (GPipe); 1: no pipeline.
    pub micro_batches: u32,
    /// `--pipeline-schedule`: with `micro_batches`, 1F1B (the default) or GPipe's.
    pub one_forward_one_backward: bool,
    /// `--spawn N`: the plan is to run on N worker processes of this machine (`dfc run --spawn
    /// N`), each on its share of the cores, and its step is predicted (and `--strategy auto`'s
    /// candidates scored) so; `None`: as the cluster says (one process for a cluster of one
    /// task).
    pub spawned_workers: Option<usize>,
}

impl Default for CompileOptions {
    fn default() -> CompileOptions {
        CompileOptions {
            sema: dfc_sema::Options::default(),
            model: None,
            cluster: Cluster::local(1, DeviceKind::Cpu),
            strategy: Strategy::Single,
            placement: VariablePlacement::RoundRobin,
            partition_min_bytes: None,
            soft_placement: false,
            cost_model: CostModel::default(),
            model_placement: ModelPlacement::EarliestFinish,
            fusion: dfc_passes::FusionOptions::default(),
            replica_instances: true,
            sync_every: None,
            staleness_aware: None,
            overlap: false,
            backup_workers: 0,
            shard_optimizer: false,
            micro_batches: 1,
            one_forward_one_backward: true,
            spawned_workers: None,
        }
    }
}

#[derive(Debug)]
pub enum CompileError {
    /// Problems in the source, located.
    Diagnostics(Vec<Diagnostic>),
    /// A problem with the options (cluster, strategy), in one line.
    Usage(String),
}

/// A compiled model: the plan, the whole placed graph with its Send/Recv pairs (for pictures
/// and `dfc ir --after partition`), and the warnings met on the way.
pub struct Compiled {
    pub plan: Plan,
    pub combined: Module,
    pub warnings: Vec<Diagnostic>,
    /// How long each stage took, and the memory after it.
    pub timings: Timings,
    /// With `ModelPlacement::Searched`: what the placement search found.
    pub search: Option<dfc_passes::SearchReport>,
    /// With `--strategy auto`: the candidates and the choice.
    pub auto: Option<AutoReport>,
}

/// The passes of `--after`, in pipeline order.
pub const STAGES: &[&str] =
    &["sema", "shard", "pool_early", "autodiff", "optimizer", "simplify", "replicate", "place", "partition"];

/// Analyses `source` and runs the passes before data parallelism; a module with no errors.
pub fn front(source: &str, options: &CompileOptions) -> Result<(Module, Vec<Diagnostic>), CompileError> {
    let (module, diagnostics) = dfc_sema::compile_source(source, options.model.as_deref(), &options.sema);
    match module {
        Some(module) if !diagnostics.iter().any(|d| d.is_error()) => Ok((module, diagnostics)),
        _ => Err(CompileError::Diagnostics(diagnostics)),
    }
}

/// The module after `stage` (one of `STAGES`): for `dfc ir` and `dfc graph`.
pub fn module_after(
    source: &str,
    stage: &str,
    options: &CompileOptions,
) -> Result<(Module, Vec<Diagnostic>), CompileError> {
    let position = STAGES.iter().position(|s| *s == stage).unwrap_or(STAGES.len() - 1);
    if position <= STAGES.iter().position(|s| *s == "simplify").expect("listed") {
        let (mut module, warnings) = front(source, options)?;
        local_passes(&mut module, Some(stage), &shard_options(options), &OptimizerOptions::default());
        return Ok((module, warnings));
    }
    let whole = CompileOptions { replica_instances: false, ..options.clone() };
    let compiled = compile(source, "", &whole)?;
    Ok((compiled.combined, compiled.warnings))
}

fn shard_options(options: &CompileOptions) -> ShardOptions {
    let ps = options.cluster.job("ps").map_or(1, |j| j.tasks.len());
    ShardOptions { min_shard_bytes: options.partition_min_bytes, max_shards: ps.max(1) as u32 }
}

/// shard → pool_early → autodiff → optimizer → simplify, up to `last`; verified after each in debug builds.
fn local_passes(module: &mut Module, last: Option<&str>, shard: &ShardOptions, optimizer: &OptimizerOptions) {
    if last == Some("sema") {
        return;
    }
    dfc_passes::shard_variables(module, shard);
    verify_after(module, "shard");
    if last != Some("shard") {
        dfc_passes::run_pipeline_with(module, last, optimizer);
    }
}

fn verify_after(module: &Module, pass: &str) {
    if cfg!(debug_assertions) {
        let problems = dfc_ir::verify(module, dfc_ir::VerifyOptions::default());
        assert!(problems.is_empty(), "the IR is broken after `{pass}`: {problems:?}");
    }
}

/// Compiles `source` into a plan for `options.cluster` under `options.strategy`.
pub fn compile(source: &str, source_name: &str, options: &CompileOptions) -> Result<Compiled, CompileError> {
    if options.strategy == Strategy::Auto && options.shard_optimizer {
        return Err(CompileError::Usage(
            "--strategy auto compares mirrored replicas with and without a sharded optimizer itself; leave out --shard-optimizer".into(),
        ));
    }
    if options.strategy == Strategy::Auto && options.overlap {
        return Err(CompileError::Usage(
            "--strategy auto compares mirrored replicas with and without overlapped all-reduces itself; leave out --overlap".into(),
        ));
    }
    if options.strategy == Strategy::Auto && options.micro_batches > 1 {
        return Err(CompileError::Usage(
            "--strategy auto compares pipelines of 2, 4 and 8 micro-batches itself; leave out --micro-batches".into(),
        ));
    }
    if options.strategy == Strategy::Auto {
        let (mut compiled, report) = auto::compile_auto(source, source_name, options)?;
        compiled.auto = Some(report);
        return Ok(compiled);
    }
    match options.sync_every {
        Some(0) => return Err(CompileError::Usage("--sync-every must be at least 1 step".into())),
        Some(_) if options.strategy != Strategy::Mirrored => {
            return Err(CompileError::Usage(format!(
                "--sync-every averages mirrored replicas' variables, but the strategy is {}; use --strategy mirrored",
                options.strategy.name()
            )))
        }
        _ => {}
    }
    if options.overlap && (options.strategy != Strategy::Mirrored || options.sync_every.is_some()) {
        return Err(CompileError::Usage(format!(
            "--overlap overlaps the gradients' all-reduces with the backward pass, but {}; use --strategy mirrored without --sync-every",
            match options.sync_every {
                Some(k) => format!("with --sync-every {k} the steps have none"),
                None => format!("the {} strategy has none", options.strategy.name()),
            }
        )));
    }
    if options.shard_optimizer && (options.strategy != Strategy::Mirrored || options.sync_every.is_some()) {
        return Err(CompileError::Usage(format!(
            "--shard-optimizer splits the optimizer's state over mirrored replicas that step together, but {}; use --strategy mirrored without --sync-every",
            match options.sync_every {
                Some(k) => format!("with --sync-every {k} each replica updates on its own"),
                None => format!("the {} strategy has no mirrored replicas", options.strategy.name()),
            }
        )));
    }
    if options.micro_batches == 0 {
        return Err(CompileError::Usage("--micro-batches must be at least 1".into()));
    }
    if options.micro_batches > 1 && options.strategy != Strategy::Model {
        return Err(CompileError::Usage(format!(
            "--micro-batches pipelines the stages of a model split over the devices, but the strategy is {}; use --strategy model",
            options.strategy.name()
        )));
    }
    let asynchronous = options.strategy == Strategy::ParameterServer { sync: false };
    if options.staleness_aware.is_some() && !asynchronous {
        return Err(CompileError::Usage(format!(
            "staleness-aware updates are for asynchronous parameter servers, but the strategy is {}{}; use --strategy ps without --sync",
            options.strategy.name(),
            if options.strategy == (Strategy::ParameterServer { sync: true }) { " --sync" } else { "" }
        )));
    }
    if options.backup_workers > 0 && options.strategy != (Strategy::ParameterServer { sync: true }) {
        return Err(CompileError::Usage(format!(
            "backup workers drop the slowest replicas' gradients from synchronous updates, but the strategy is {}{}; use --strategy ps --sync",
            options.strategy.name(),
            if options.strategy == (Strategy::ParameterServer { sync: false }) { " without --sync" } else { "" }
        )));
    }
    let mut clock = Clock::start();
    let (mut full, mut warnings) = front(source, options)?;
    clock.lap("parse and analyse");
    let shard = shard_options(options);
    dfc_passes::shard_variables(&mut full, &shard);
    verify_after(&full, "shard");
    clock.lap("shard");
    for &pass in dfc_passes::PASSES.iter().filter(|&&pass| pass != "sema") {
        dfc_passes::run_pass(&mut full, pass);
        clock.lap(pass);
    }

    let cluster = &options.cluster;
    let devices: Vec<DeviceSpec> = cluster.devices().into_iter().cloned().collect();
    let layout = Layout::new(cluster, options.strategy)?;

    let mut replica_interfaces = Vec::new();
    let mut instances: Vec<dfc_ir::Instance> = Vec::new();
    let full_inputs: Vec<IoSpec> = full
        .inputs
        .iter()
        .map(|&i| IoSpec { name: full.graph.node(i).name.clone(), ty: full.graph.node(i).outputs[0].clone() })
        .collect();
    let staleness_aware = staleness_aware(&full, options)?;
    let backup_workers = options.backup_workers as usize;
    if backup_workers > 0 && backup_workers >= layout.replicas.len() {
        return Err(CompileError::Usage(format!(
            "{backup_workers} backup worker{} leave{} none of the {} replicas to make an update; the cluster needs more workers than backups",
            if backup_workers == 1 { "" } else { "s" },
            if backup_workers == 1 { "s" } else { "" },
            layout.replicas.len()
        )));
    }
    let module = match layout.replication {
        None if options.micro_batches > 1 => {
            let module = pipelined(source, &full, &devices, options, &shard)?;
            verify_after(&module, "replicate");
            clock.lap("pipeline");
            module
        }
        None => {
            dfc_passes::drop_cross_replica_means(&mut full);
            full
        }
        Some(replication) => {
            if full.training.is_none() {
                return Err(CompileError::Usage(format!(
                    "the {} strategy replicates training, but model `{}` has no `minimize`",
                    options.strategy.name(),
                    full.name
                )));
            }
            let per_replica = per_replica_module(source, &full, layout.replicas.len(), options, &shard)?;
            clock.lap("the replicas' module");
            // Mirrored on 3 or more devices: replicas 0 and 1 built, the others instances of 1.
            if replication == Replication::Mirrored && options.replica_instances {
                instances = (2..layout.replicas.len())
                    .map(|r| dfc_ir::Instance {
                        template: 0, // the partition's index, known after partitioning
                        template_replica: 1,
                        replica: r as u32,
                        device: layout.replicas[r].clone(),
                    })
                    .collect();
            }
            let built = (!instances.is_empty()).then_some(2);
            let replicate = ReplicateOptions {
                replication,
                devices: &layout.replicas,
                variable_device: layout.variable_home.as_ref(),
                soft: options.soft_placement,
                built_replicas: built,
                local_sgd: options.sync_every.is_some(),
                staleness_aware,
                backup_workers,
                micro_batches: None,
                one_forward_one_backward: false,
            };
            let (module, found) =
                dfc_passes::replicate(&per_replica, &full, &replicate).map_err(CompileError::Diagnostics)?;
            if replication == (Replication::Shared { sync: false }) || backup_workers > 0 {
                let n = layout.replicas.len();
                replica_interfaces = dfc_passes::replica_interfaces(&per_replica, n, staleness_aware, backup_workers);
            }
            warnings.extend(found);
            verify_after(&module, "replicate");
            clock.lap("replicate");
            let mut module = module;
            // A replica alone: its all-reduces and the mean's scale by one are its own tensors,
            // which simplification removes (the plan of `single`'s work).
            if layout.replicas.len() == 1 {
                dfc_passes::simplify(&mut module);
                verify_after(&module, "simplify");
            }
            dfc_passes::fuse_all_reduces(&mut module, &options.fusion, built.map(|b| b as u32));
            verify_after(&module, "fuse_all_reduces");
            clock.lap("fuse all-reduces");
            module
        }
    };

    let index = |d: &DeviceSpec| devices.iter().position(|x| x == d).expect("layout devices are the cluster's");
    let place = dfc_passes::PlaceOptions {
        cluster,
        variable_devices: layout.variable_devices.iter().map(index).collect(),
        default_device: index(&layout.default_device),
        policy: options.placement,
        cost_model: (options.strategy == Strategy::Model).then_some(&options.cost_model),
        model_placement: options.model_placement,
        soft: options.soft_placement,
        spawned_workers: options.spawned_workers,
    };
    let (placed, found) = dfc_passes::place(module, &place).map_err(CompileError::Diagnostics)?;
    let search = placed.search.clone();
    warnings.extend(found);
    if cfg!(debug_assertions) {
        let problems = dfc_ir::verify(&placed.module, dfc_ir::VerifyOptions { require_devices: true });
        assert!(problems.is_empty(), "the IR is broken after `place`: {problems:?}");
    }
    clock.lap("place");

    let partitioned = dfc_passes::partition(placed, &devices);
    clock.lap("partition");
    if let Some(template) = layout.replicas.get(1).filter(|_| !instances.is_empty()) {
        let index = partitioned.parts.iter().position(|(d, _)| d == template).expect("replica 1 has a partition");
        for instance in &mut instances {
            instance.template = index as u32;
        }
    }
    let built_parts = partitioned.parts.len();
    let stand_ins = instance_stand_ins(&partitioned.parts, &instances);
    let parts: Vec<(&DeviceSpec, &Module)> = partitioned
        .parts
        .iter()
        .map(|(d, m)| (d, m))
        .chain(instances.iter().zip(&stand_ins).map(|(i, s)| (&i.device, &s.transfers)))
        .collect();
    let problems = dfc_ir::verify_partitions(&parts);
    assert!(problems.is_empty(), "the partitions are broken: {problems:?}");
    clock.lap("verify the partitions");
    let simulated: Vec<&Module> = partitioned
        .parts
        .iter()
        .map(|(_, m)| m)
        .chain(stand_ins.iter().map(|s| match &s.costed {
            Costed::Built(module) => module,
            Costed::As(_) => &s.transfers,
        }))
        .collect();
    // A step's cost leaves out local SGD's averages, which run every few steps apart from it.
    let stepping: Vec<Option<Module>> = simulated.iter().map(|m| dfc_passes::without_averages(m)).collect();
    let simulated: Vec<&Module> = simulated.iter().zip(&stepping).map(|(m, s)| s.as_ref().unwrap_or(m)).collect();
    let devices: Vec<&DeviceSpec> = parts.iter().map(|(d, _)| *d).collect();
    let topology = match options.spawned_workers {
        Some(workers) => {
            let assignment = dfc_ir::assign_workers(&devices, cluster, workers).map_err(CompileError::Usage)?;
            let cores = options.cost_model.profile.as_ref().map_or_else(
                || std::thread::available_parallelism().map_or(1, usize::from),
                |profile| profile.cpu.threads as usize,
            );
            dfc_passes::Topology::spawned(&assignment.partition_worker, assignment.names.len(), cores)
        }
        None => dfc_passes::Topology::of_cluster(&simulated, cluster),
    };
    let topology = dfc_passes::Topology { overlap: options.overlap, ..topology };
    let mut report = dfc_passes::cost::estimate_on(&simulated, &options.cost_model, &topology);
    // An instance simulated by its transfers alone costs what the partition standing for it does.
    for (k, (instance, stand_in)) in instances.iter().zip(&stand_ins).enumerate() {
        if let Costed::As(p) = stand_in.costed {
            let mut cost = report.devices[p].clone();
            cost.device = instance.device.to_string();
            report.devices[built_parts + k] = cost;
        }
    }
    if options.cost_model.profile.is_some() && !instances.is_empty() {
        dfc_passes::cost::take_turns(&mut report, &topology);
    }
    clock.lap("cost model");

    let strategy = StrategySpec {
        name: options.strategy.name().into(),
        // A pipeline's micro-batches are copies of the model's compute, each on a slice of the batch.
        replicas: layout.replicas.len().max(options.micro_batches as usize).max(1) as u32,
        sync: !matches!(options.strategy, Strategy::ParameterServer { sync: false }),
        placement: options.placement.name().into(),
        sync_every: options.sync_every,
        staleness_aware,
        overlap: options.overlap,
        backup_workers: options.backup_workers,
    };
    let partitions: Vec<Partition> =
        partitioned.parts.into_iter().map(|(device, module)| Partition { device, module }).collect();
    let mut plan = Plan::build(&partitioned.combined, partitions, cluster.clone(), strategy, source_name, source);
    plan.add_instances(instances);
    if layout.replication.is_some() {
        // The model's inputs, each fed to the replicas' own inputs by rows.
        plan.split_inputs = split_inputs(&partitioned.combined, &full_inputs, layout.replicas.len());
        plan.inputs = full_inputs;
    }
    plan.replicas = replica_interfaces
        .into_iter()
        .zip(&layout.replicas)
        .map(|(r, device)| ReplicaSpec {
            device: device.clone(),
            loss_node: r.loss_node,
            updates: r.updates,
            staleness: r.staleness,
            backup: r.backup,
        })
        .collect();
    plan.report = Some(report);
    clock.lap("build the plan");
    Ok(Compiled { plan, combined: partitioned.combined, warnings, timings: clock.timings, search, auto: None })
}

/// The model inputs that the replicas of `combined` (built by `replicate`) are fed by rows:
/// those with an input per replica, `replica_<r>/<name>` (replicas that are instances have
/// theirs in their partitions, named alike).
fn split_inputs(combined: &Module, inputs: &[IoSpec], replicas: usize) -> Vec<SplitInput> {
    let graph = &combined.graph;
    let own = |name: &str| combined.inputs.iter().any(|&id| graph.node(id).name == name);
    inputs
        .iter()
        .filter(|input| own(&dfc_passes::replica_name(0, &input.name)))
        .map(|input| SplitInput {
            input: input.name.clone(),
            nodes: (0..replicas).map(|r| dfc_passes::replica_name(r, &input.name)).collect(),
        })
        .collect()
}

/// Whether asynchronous replicas divide their gradients by their staleness: as asked, or by
/// default where the optimizer is SGD or momentum. The adaptive optimizers normalise the
/// gradient's scale away, so dividing it would not divide their rate: asking for it with them
/// is refused.
fn staleness_aware(full: &Module, options: &CompileOptions) -> Result<bool, CompileError> {
    if options.strategy != (Strategy::ParameterServer { sync: false }) {
        return Ok(false);
    }
    let kind = full.training.as_ref().map(|t| &t.optimizer.kind);
    let plain = matches!(kind, Some(dfc_ir::OptimizerKind::Sgd | dfc_ir::OptimizerKind::Momentum { .. }));
    match options.staleness_aware {
        None => Ok(plain),
        Some(false) => Ok(false),
        Some(true) if plain => Ok(true),
        Some(true) => Err(CompileError::Usage(format!(
            "staleness-aware updates divide the gradient, which {} normalises away; use sgd or momentum, or --no-staleness-aware",
            match kind {
                Some(dfc_ir::OptimizerKind::Adam { .. }) => "adam",
                Some(dfc_ir::OptimizerKind::Adagrad { .. }) => "adagrad",
                Some(dfc_ir::OptimizerKind::RmsProp { .. }) => "rmsprop",
                _ => "the optimizer",
            }
        ))),
    }
}

/// What stands for an instance beside the built partitions.
struct StandIn {
    /// Its transfers and all-reduces alone: what checking needs.
    transfers: Module,
    costed: Costed,
}

/// How the cost model sees an instance.
enum Costed {
    /// Built in full: the first instance of its way of meeting its peers.
    Built(Box<Module>),
    /// By its transfers, costing what partition `p` of the simulation does.
    As(usize),
}

/// The stand-in of each instance: one instance of each way of meeting its peers (within the
/// template's task or not) is built in full for the cost model, so that remote replicas are
/// simulated as remote; the others cost what it (or the template) does.
fn instance_stand_ins(parts: &[(DeviceSpec, Module)], instances: &[dfc_ir::Instance]) -> Vec<StandIn> {
    let Some(first) = instances.first() else { return Vec::new() };
    let (template_device, template) = &parts[first.template as usize];
    let graph = &template.graph;
    let peers: Vec<&DeviceSpec> = graph
        .node_ids()
        .filter_map(|id| match &graph.node(id).op {
            dfc_ir::Op::Send { to, .. } => Some(to),
            dfc_ir::Op::Recv { from, .. } => Some(from),
            _ => None,
        })
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    let signature = |d: &DeviceSpec| peers.iter().map(|p| dfc_passes::cost::same_task(d, p)).collect::<Vec<bool>>();
    let mut standing: Vec<(Vec<bool>, usize)> = vec![(signature(template_device), first.template as usize)];
    let expect = "replica 1's partition instantiates";
    instances
        .iter()
        .enumerate()
        .map(|(k, instance)| {
            let transfers = dfc_ir::instance_transfers(template, template_device, instance).expect(expect);
            let key = signature(&instance.device);
            let costed = match standing.iter().find(|(s, _)| *s == key) {
                Some(&(_, p)) => Costed::As(p),
                None => {
                    standing.push((key, parts.len() + k));
                    Costed::Built(Box::new(dfc_ir::instantiate(template, template_device, instance).expect(expect)))
                }
            };
            StandIn { transfers, costed }
        })
        .collect()
}

/// Which devices a strategy uses for what.
struct Layout {
    replication: Option<Replication>,
    /// One device per replica (empty without replication).
    replicas: Vec<DeviceSpec>,
    /// Where unrequested variables may go.
    variable_devices: Vec<DeviceSpec>,
    /// Central storage: where every variable goes.
    variable_home: Option<DeviceSpec>,
    default_device: DeviceSpec,
}

impl Layout {
    fn new(cluster: &Cluster, strategy: Strategy) -> Result<Layout, CompileError> {
        let all: Vec<DeviceSpec> = cluster.devices().into_iter().cloned().collect();
        // Compute runs on the chief and the workers (or whatever jobs there are besides ps).
        let compute_jobs: Vec<&dfc_ir::Job> = cluster.jobs.iter().filter(|j| j.name != "ps").collect();
        let ps: Vec<DeviceSpec> = cluster
            .job("ps")
            .map(|j| j.tasks.iter().flat_map(|t| t.devices.iter().cloned()).collect())
            .unwrap_or_default();
        let prefer_gpus = |devices: Vec<DeviceSpec>| -> Vec<DeviceSpec> {
            let gpus: Vec<DeviceSpec> = devices.iter().filter(|d| d.kind == Some(DeviceKind::Gpu)).cloned().collect();
            if gpus.is_empty() {
                devices
            } else {
                gpus
            }
        };
        let default_device = compute_jobs
            .first()
            .and_then(|j| j.tasks.first())
            .map(|t| prefer_gpus(t.devices.clone())[0].clone())
            .unwrap_or_else(|| all[0].clone());
        let layout = |replication, replicas, variable_devices, variable_home| Layout {
            replication,
            replicas,
            variable_devices,
            variable_home,
            default_device: default_device.clone(),
        };
        Ok(match strategy {
            Strategy::Single => {
                let vars = if ps.is_empty() { vec![default_device.clone()] } else { ps };
                layout(None, Vec::new(), vars, None)
            }
            Strategy::Model => layout(None, Vec::new(), all.clone(), None),
            Strategy::Mirrored => {
                let devices: Vec<DeviceSpec> =
                    compute_jobs.iter().flat_map(|j| &j.tasks).flat_map(|t| t.devices.iter().cloned()).collect();
                layout(Some(Replication::Mirrored), prefer_gpus(devices), Vec::new(), None)
            }
            Strategy::ParameterServer { sync } => {
                if ps.is_empty() {
                    return Err(CompileError::Usage(
                        "the ps strategy needs a cluster with a `ps` job: give --cluster FILE with \"ps\" and \"worker\" jobs"
                            .into(),
                    ));
                }
                let workers: Vec<DeviceSpec> = compute_jobs
                    .iter()
                    .flat_map(|j| &j.tasks)
                    .map(|t| prefer_gpus(t.devices.clone())[0].clone())
                    .collect();
                if workers.is_empty() {
                    return Err(CompileError::Usage(
                        "the ps strategy needs worker tasks besides the ps tasks: add a \"worker\" job to the cluster"
                            .into(),
                    ));
                }
                layout(Some(Replication::Shared { sync }), workers, ps, None)
            }
            Strategy::Auto => {
                return Err(CompileError::Usage("--strategy auto chooses a strategy before the layout".into()))
            }
            Strategy::CentralStorage => {
                let task = compute_jobs
                    .first()
                    .and_then(|j| j.tasks.first())
                    .ok_or_else(|| CompileError::Usage("central storage needs a task besides the ps tasks".into()))?;
                let home =
                    task.devices.iter().find(|d| d.kind == Some(DeviceKind::Cpu)).unwrap_or(&task.devices[0]).clone();
                layout(
                    Some(Replication::Shared { sync: true }),
                    prefer_gpus(task.devices.clone()),
                    vec![home.clone()],
                    Some(home),
                )
            }
        })
    }
}

/// The training module for one replica's share of the batch: the source recompiled with the
/// batch dim divided by `replicas`.
/// The pipeline of `--micro-batches`: one micro-batch's module, each node requested on its
/// stage's device (one stage per device), copied per micro-batch with the gradients' mean
/// beside each variable and one update (synchronous shared replication).
fn pipelined(
    source: &str,
    full: &Module,
    devices: &[DeviceSpec],
    options: &CompileOptions,
    shard: &ShardOptions,
) -> Result<Module, CompileError> {
    if full.training.is_none() {
        return Err(CompileError::Usage(format!(
            "--micro-batches pipelines training, but model `{}` has no `minimize`",
            full.name
        )));
    }
    let micro_batches = options.micro_batches as usize;
    let mut per_micro_batch = per_replica_module(source, full, micro_batches, options, shard)?;
    dfc_passes::assign_stages(&mut per_micro_batch, devices, &options.cost_model);
    let pipeline = ReplicateOptions {
        replication: Replication::Shared { sync: true },
        devices: &vec![devices[0].clone(); micro_batches],
        variable_device: None,
        soft: options.soft_placement,
        built_replicas: None,
        local_sgd: false,
        staleness_aware: false,
        backup_workers: 0,
        micro_batches: Some(devices),
        one_forward_one_backward: options.one_forward_one_backward,
    };
    let (module, _) = dfc_passes::replicate(&per_micro_batch, full, &pipeline).map_err(CompileError::Diagnostics)?;
    Ok(module)
}

fn per_replica_module(
    source: &str,
    full: &Module,
    replicas: usize,
    options: &CompileOptions,
    shard: &ShardOptions,
) -> Result<Module, CompileError> {
    let graph = &full.graph;
    let leading: Vec<(String, Option<usize>, Span)> = full
        .inputs
        .iter()
        .map(|&i| {
            let node = graph.node(i);
            (node.name.clone(), node.outputs[0].shape.dims().first().copied(), graph.span(i).unwrap_or(Span::new(0, 0)))
        })
        .collect();
    let Some((first_name, Some(batch), first_span)) = leading.first().cloned() else {
        return Err(CompileError::Usage(format!(
            "data parallelism splits the inputs along their first axis, but model `{}` has {}",
            full.name,
            if leading.is_empty() { "no inputs".to_string() } else { format!("a scalar input `{}`", leading[0].0) }
        )));
    };
    if let Some((name, dims, span)) = leading.iter().find(|(_, d, _)| *d != Some(batch)) {
        return Err(CompileError::Diagnostics(vec![Diagnostic::error(
            Code::BATCH_SPLIT,
            *span,
            format!(
                "data parallelism splits every input along its first axis, but `{name}` has {} where `{first_name}` has {batch}",
                dims.map_or("no axis".to_string(), |d| format!("{d} rows"))
            ),
        )
        .with_secondary(first_span, format!("{batch} rows here"))
        .with_help("give every input the batch as its first dimension, or use --strategy single or model")]));
    }
    if batch % replicas != 0 {
        return Err(CompileError::Diagnostics(vec![Diagnostic::error(
            Code::BATCH_SPLIT,
            first_span,
            format!(
                "the batch of {batch} examples does not split evenly over {replicas} {}",
                if options.micro_batches > 1 { "micro-batches" } else { "replicas" }
            ),
        )
        .with_label(format!("{batch} rows"))
        .with_help(format!(
            "compile with a batch that is a multiple of {replicas}, e.g. --dim {}={}",
            full.dims.iter().find(|(_, v)| *v == batch).map_or("batch", |(n, _)| n.as_str()),
            batch.div_ceil(replicas) * replicas
        ))]));
    }
    let share = batch / replicas;
    // The batch dim: a dim of that value whose change resizes every input.
    for (dim, value) in &full.dims {
        if *value != batch {
            continue;
        }
        let mut sema = options.sema.clone();
        sema.dims.retain(|(n, _)| n != dim);
        sema.dims.push((dim.clone(), share as i64));
        let per = CompileOptions { sema, ..options.clone() };
        let Ok((mut module, _)) = front(source, &per) else { continue };
        let resized =
            module.inputs.iter().all(|&i| module.graph.node(i).outputs[0].shape.dims().first() == Some(&share));
        if resized {
            let shards = if options.shard_optimizer { replicas } else { 1 };
            local_passes(&mut module, None, shard, &OptimizerOptions { shards });
            return Ok(module);
        }
    }
    Err(CompileError::Diagnostics(vec![Diagnostic::error(
        Code::BATCH_SPLIT,
        first_span,
        format!("data parallelism needs a `dim` that sizes the first axis of every input; none of the model's dims is {batch} for all of them"),
    )
    .with_help("declare the batch as a dim (`dim batch = 128`) and use it as every input's first dimension")]))
}
