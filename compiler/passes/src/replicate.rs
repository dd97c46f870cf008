//! Data parallelism: one copy of the model's compute per replica device, each on its slice of
//! the batch, with the replicas' gradients combined before the update.
//!
//! The input is the training module compiled for the per-replica batch (the batch divided by
//! the number of replicas; the caller recompiles the source for it, so every shape, reshape
//! and mean is the replica's own) and the full-batch module, for the types the user sees.
//!
//! - Each replica has an input of its own per model input (`replica_<r>/<name>`, its rows
//!   `r·b .. (r+1)·b` of the batch, on its device; a lone synchronous replica's keeps the
//!   name), which the runtime feeds directly: no replica's batch passes through another
//!   replica's device. Asynchronous replicas so step on their own batches:
//!   [`replica_interfaces`] names what each one fetches and runs. A pipeline's micro-batches
//!   instead slice the full-batch input (its type and name) where it lives.
//! - `Mirrored`: every replica has its own copy of every variable (replica 0's keeps the
//!   variable's name; the others are `replica_<r>/<name>`, mirrors of it, with the same
//!   initial value). Each gradient is summed over the replicas by an all-reduce and divided by
//!   their number, and every replica applies the same update to its copy.
//! - `Mirrored` with `local_sgd` (local SGD, periodic averaging): each replica applies its own
//!   gradients, and the module's `averages` set every replica's copy of every float variable
//!   (parameters, optimizer slots, moving statistics) to the replicas' mean: one all-reduce
//!   per variable (`average/<name>`, fused apart from a step's), run every few steps by the
//!   driver. After an average the replicas hold the same values, as after a mirrored step.
//! - `Shared { sync: true }` (parameter server, central storage): one copy of the variables
//!   and the optimizer; each gradient is the mean of the replicas' gradients, computed beside
//!   its variable, and applied once.
//! - `Shared { sync: false }` (asynchronous parameter server): each replica applies its own
//!   gradient to the shared variables with its own copy of the optimizer's update, without
//!   waiting to combine them. With `staleness_aware` (Zhang et al., "Staleness-aware
//!   Async-SGD"), each shared trainable variable counts its updates in a `<name>/version`
//!   variable beside it; a replica reads the version with the variable's value, sends it back
//!   with its gradient (`…/version_echo`, on the replica), and its update divides the gradient
//!   by the staleness τ = the updates applied since, plus one (`…/staleness`), then counts
//!   itself. For SGD and momentum that divides the learning rate by τ.
//! - `Shared { sync: true }` with `backup_workers` b (TensorFlow's SyncReplicasOptimizer):
//!   the replicas step on their own, as asynchronous ones do, but each update takes the first
//!   N = replicas − b gradients computed from the variables' current values and drops the
//!   rest. Per shared trainable variable, beside it: a `<name>/version` (updates applied), an
//!   `<name>/accumulator` of the gradients taken since and their count `<name>/accumulated`.
//!   A replica's gradient is taken if the version it read with the value is still current
//!   (`…/fresh`); the replica whose gradient is the N-th applies the mean of the accumulator
//!   (`…/complete`), counts the version and empties the accumulator. Every assignment of the
//!   replica's copy of the optimizer's update is gated by `complete` (a `select` of the new
//!   value or the old), so every optimizer works. An update that depends on one variable's
//!   gradient is gated by that variable's flag, any other (the optimizer's counters, a model's
//!   moving averages) by the first trainable variable's.
//! - The loss and scalar metrics are the mean of the replicas' (exact when they are means over
//!   the batch); batch-sized outputs are the replicas' joined along axis 0.
//!
//! The mean of the replicas' gradients is the full batch's gradient when the loss is a mean
//! over the batch's examples (plus terms that do not depend on the batch), as every example is.
//!
//! Replica r's nodes are named `replica_<r>/...` and requested on its device; a source
//! request that the replica's device does not satisfy is a diagnostic at its line.

use crate::partition::transfer_names;
use dfc_diag::{Code, Diagnostic, Span};
use dfc_ir::{
    BinaryOp, ConstValue, DeviceSpec, Graph, Module, NodeId, Op, Output, Shape, TensorRef, Training, VariableOrigin,
    REPLICA_SLOT,
};
use std::collections::{BTreeSet, HashMap};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Replication {
    Mirrored,
    Shared { sync: bool },
}

pub struct ReplicateOptions<'a> {
    pub replication: Replication,
    /// One device per replica.
    pub devices: &'a [DeviceSpec],
    /// Where the shared variables must live (central storage), if anywhere in particular.
    pub variable_device: Option<&'a DeviceSpec>,
    /// Requests that contradict the strategy are warnings and set aside, not errors.
    pub soft: bool,
    /// `Mirrored` only: how many replicas to build in full (at least 2, or all). The others
    /// are stubs: the Recvs of their parts of the loss, outputs and metrics, named as
    /// `partition` names them; their partitions (their inputs included) are instances of
    /// replica 1's (`dfc_ir::instantiate`). `None`: every replica in full.
    pub built_replicas: Option<usize>,
    /// `Mirrored` only: local SGD, each replica on its own gradients, the variables averaged
    /// by the module's `averages`.
    pub local_sgd: bool,
    /// `Shared { sync: false }` only: divide each replica's gradient by its staleness.
    pub staleness_aware: bool,
    /// `Shared { sync: true }` only: replicas beyond the N whose gradients make an update.
    pub backup_workers: usize,
    /// `Shared { sync: true }` only: the replicas are the micro-batches of a pipeline (the
    /// `model` strategy's `--micro-batches`) whose stages are these devices, in order: each
    /// copy of a node keeps the node's request, its stage's device (`devices` are unused), and
    /// the copies are made micro-batch by micro-batch, so that where the runtime has a choice
    /// it takes the earlier micro-batch.
    pub micro_batches: Option<&'a [DeviceSpec]>,
    /// With `micro_batches`: the 1F1B schedule (PipeDream-Flush) with a micro-batch of slack.
    /// Stage k of K (from 0) starts the forward pass of micro-batch r + K − k + 1 (the last
    /// stage: r + 1) only after the backward pass of micro-batch r (control edges), so that
    /// it holds at most that many micro-batches' activations and, once the pipeline is full,
    /// alternates one forward and one backward pass. PipeDream-Flush's r + K − k ties each
    /// stage's next forward pass to the round trip of the last backward one through the
    /// stages after it, and every exchange's latency is then idle time; one micro-batch more
    /// in flight hides it. Without it, GPipe's: each stage runs every forward pass it can
    /// before the backward ones.
    pub one_forward_one_backward: bool,
}

/// The key prefix of local SGD's averaging all-reduces, which tensor fusion keeps apart from
/// a step's (they run in another program).
pub const AVERAGE_KEY_PREFIX: &str = "average/";

/// The replicated module, or diagnostics when source requests contradict the strategy.
pub fn replicate(
    per_replica: &Module,
    full: &Module,
    options: &ReplicateOptions,
) -> Result<(Module, Vec<Diagnostic>), Vec<Diagnostic>> {
    let mut builder = Builder::new(per_replica, options);
    builder.build(full);
    let errors = builder.diagnostics.iter().any(|d| d.is_error());
    if errors {
        Err(builder.diagnostics)
    } else {
        Ok((builder.out, builder.diagnostics))
    }
}

/// `module` without what only local SGD's averages run (their all-reduces, what feeds them
/// alone, and what they feed), for a step's cost; `None` where it has no averages.
pub fn without_averages(module: &Module) -> Option<Module> {
    let graph = &module.graph;
    let averages =
        |id: NodeId| matches!(&graph.node(id).op, Op::AllReduce { key, .. } if key.starts_with(AVERAGE_KEY_PREFIX));
    let mut gone: BTreeSet<NodeId> = graph.node_ids().filter(|&id| averages(id)).collect();
    if gone.is_empty() {
        return None;
    }
    // What they feed, then what feeds nothing else.
    let mut todo: Vec<NodeId> = gone.iter().copied().collect();
    while let Some(id) = todo.pop() {
        for user in graph.users(id) {
            if gone.insert(user) {
                todo.push(user);
            }
        }
    }
    let mut todo: Vec<NodeId> = gone.iter().copied().collect();
    while let Some(id) = todo.pop() {
        for operand in graph.inputs(id) {
            let only_theirs = graph.users(operand.node).iter().all(|u| gone.contains(u))
                && !matches!(graph.node(operand.node).op, Op::Variable { .. });
            if only_theirs && gone.insert(operand.node) {
                todo.push(operand.node);
            }
        }
    }
    let mut stepping = module.clone();
    for id in gone {
        stepping.graph.remove(id);
    }
    Some(stepping)
}

/// Without replicas, a cross-replica mean is its operand: each use reads the operand instead.
pub fn drop_cross_replica_means(module: &mut Module) {
    let means: Vec<NodeId> =
        module.graph.node_ids().filter(|&id| matches!(module.graph.node(id).op, Op::CrossReplicaMean)).collect();
    for id in means {
        let graph = &mut module.graph;
        let operand = graph.inputs(id)[0];
        graph.replace_uses(id.into(), operand);
        graph.remove(id);
        crate::shard::redirect(module, id.into(), operand);
    }
}

/// The name of replica `r`'s copy of the node `name`.
pub fn replica_name(r: usize, name: &str) -> String {
    format!("replica_{r}/{name}")
}

/// What one replica of an asynchronous (`Shared { sync: false }`) module fetches and runs, by
/// node name, so that it can train on its own (on its own inputs, `replica_<r>/<input>`):
/// its loss and its updates.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicaInterface {
    pub loss_node: String,
    pub updates: Vec<String>,
    /// Staleness-aware: the node of the staleness τ of its last update (of its first variable).
    pub staleness: Option<String>,
    /// Backup workers: what its step reports of its first variable's accumulation.
    pub backup: Option<BackupNodes>,
}

/// Backup workers: the nodes (scalars, beside the replica's first variable) that its step's
/// second part fetches to say what became of its gradient.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BackupNodes {
    /// 1 if its gradient was taken into an update, 0 if it was dropped as stale.
    pub accepted: String,
    /// 1 if its gradient completed an update, which it then applied.
    pub applied: String,
    /// The variable's version (its updates) after the replica's step.
    pub version: String,
}

/// The interface of each of the `replicas` replicas that [`replicate`] makes of `per_replica`
/// where replicas share no step: under `Shared { sync: false }`, with or without
/// `staleness_aware` updates, and under `Shared { sync: true }` with `backup_workers`.
pub fn replica_interfaces(
    per_replica: &Module,
    replicas: usize,
    staleness_aware: bool,
    backup_workers: usize,
) -> Vec<ReplicaInterface> {
    let graph = &per_replica.graph;
    let Some(training) = &per_replica.training else { return Vec::new() };
    let variables: Vec<&str> = training.gradients.iter().map(|(v, _)| graph.node(*v).name.as_str()).collect();
    let counted: &[&str] = match (staleness_aware, backup_workers) {
        (true, _) => &["version_increment"],
        (false, 0) => &[],
        (false, _) => &["reset_accumulator", "reset_count", "version_increment"],
    };
    (0..replicas)
        .map(|r| ReplicaInterface {
            loss_node: replica_name(r, &graph.node(training.loss.node).name),
            updates: training
                .updates
                .iter()
                .map(|&u| replica_name(r, &graph.node(u).name))
                .chain(
                    variables
                        .iter()
                        .flat_map(|v| counted.iter().map(move |what| replica_name(r, &format!("{v}/{what}")))),
                )
                .collect(),
            staleness: variables
                .first()
                .filter(|_| staleness_aware)
                .map(|v| replica_name(r, &format!("{v}/staleness"))),
            backup: variables.first().filter(|_| !staleness_aware && backup_workers > 0).map(|v| BackupNodes {
                accepted: replica_name(r, &format!("{v}/accepted")),
                applied: replica_name(r, &format!("{v}/applied")),
                version: replica_name(r, &format!("{v}/version_increment")),
            }),
        })
        .collect()
}

/// Backup workers: for each assignment of the optimizer's update region, the trainable
/// variable whose flag gates it: the one variable whose gradient it depends on, else the first.
fn gates(src: &Module, update_region: &BTreeSet<NodeId>) -> HashMap<NodeId, NodeId> {
    let graph = &src.graph;
    let Some(training) = &src.training else { return HashMap::new() };
    let Some(&(first, _)) = training.gradients.first() else { return HashMap::new() };
    let assignment = |id: &NodeId| matches!(graph.node(*id).op, Op::Assign | Op::AssignAdd | Op::AssignSub);
    update_region
        .iter()
        .filter(|id| assignment(id))
        .map(|&id| {
            let above = graph.ancestors(&[id]);
            let mut from = training.gradients.iter().filter(|(_, g)| above.contains(&g.node)).map(|(v, _)| *v);
            let gate = match (from.next(), from.next()) {
                (Some(only), None) => only,
                _ => first,
            };
            (id, gate)
        })
        .collect()
}

/// Backup workers: one replica's view of a shared variable's accumulation (its nodes beside
/// the variable).
#[derive(Clone, Copy)]
struct Arrival {
    /// Bool: the version the replica read is current, so its gradient is taken.
    fresh: NodeId,
    /// Bool: its gradient is the N-th taken, so it applies the update.
    complete: NodeId,
}

struct Builder<'a> {
    src: &'a Module,
    options: &'a ReplicateOptions<'a>,
    out: Module,
    /// Per replica: source node → its copy. Shared nodes are in `shared`.
    copies: Vec<HashMap<NodeId, NodeId>>,
    shared: HashMap<NodeId, NodeId>,
    /// The optimizer's nodes (run after the gradients, for the updates only).
    update_region: BTreeSet<NodeId>,
    gradients: HashMap<TensorRef, NodeId>,
    /// The combined gradient of each variable, per replica (`None`: the shared one).
    combined: HashMap<(Option<usize>, NodeId), TensorRef>,
    diagnostics: Vec<Diagnostic>,
    /// Requests already reported (by where they are written), so that the R copies of the
    /// nodes of one device block give one report.
    reported: BTreeSet<(u32, u32, String)>,
    /// The Recvs (or copied constants) that stand for a stub replica's tensors.
    stub_parts: HashMap<(usize, TensorRef), TensorRef>,
    /// Local SGD: the assignments of the replicas' averaged variables.
    averages: Vec<NodeId>,
    /// Each shared variable's version (staleness-aware replicas, backup workers), and the
    /// staleness-aware reads of it and increments made so far (every read runs before every
    /// increment of a step).
    versions: HashMap<NodeId, NodeId>,
    version_reads: Vec<NodeId>,
    version_increments: Vec<NodeId>,
    /// Backup workers: each shared variable's accumulator and count, each replica's arrival
    /// at it, and the source variable whose flag gates each update-region node.
    accumulators: HashMap<NodeId, (NodeId, NodeId)>,
    arrivals: HashMap<(NodeId, usize), Arrival>,
    gates: HashMap<NodeId, NodeId>,
    /// Backup workers: the emptying of the accumulators and counts and the versions' counts.
    backup_updates: Vec<NodeId>,
    /// Per replica, what makes replica 0's replica-dependent ops (a sharded optimizer's) its own.
    renamers: Vec<dfc_ir::Renamer>,
}

impl<'a> Builder<'a> {
    fn new(src: &'a Module, options: &'a ReplicateOptions<'a>) -> Builder<'a> {
        let graph = &src.graph;
        let training = src.training.as_ref().expect("replication needs a training module");
        let mut roots: Vec<NodeId> = training.gradients.iter().map(|(_, g)| g.node).collect();
        roots.push(training.loss.node);
        roots.extend(src.outputs.iter().chain(&src.metrics).map(|o| o.tensor.node));
        // What a cross-replica mean averages is each replica's, even where only an update uses
        // the mean (the statistics of a batch norm whose output nothing else uses).
        let updating = graph.ancestors(&training.updates);
        let averaged = updating.iter().filter(|&&id| matches!(graph.node(id).op, Op::CrossReplicaMean));
        roots.extend(averaged.flat_map(|&id| graph.inputs(id)).map(|t| t.node));
        let compute = graph.ancestors(&roots);
        let update_region = updating.into_iter().filter(|id| !compute.contains(id)).collect();
        let gradients = training.gradients.iter().map(|(v, g)| (*g, *v)).collect();
        let gates = match options.backup_workers {
            0 => HashMap::new(),
            _ => gates(src, &update_region),
        };
        Builder {
            src,
            options,
            out: Module { name: src.name.clone(), ..Module::default() },
            copies: vec![HashMap::new(); options.devices.len()],
            shared: HashMap::new(),
            update_region,
            gradients,
            combined: HashMap::new(),
            diagnostics: Vec::new(),
            reported: BTreeSet::new(),
            stub_parts: HashMap::new(),
            averages: Vec::new(),
            versions: HashMap::new(),
            version_reads: Vec::new(),
            version_increments: Vec::new(),
            accumulators: HashMap::new(),
            arrivals: HashMap::new(),
            gates,
            backup_updates: Vec::new(),
            renamers: options
                .devices
                .iter()
                .enumerate()
                .map(|(r, device)| dfc_ir::Renamer::new(0, &options.devices[0], r as u32, device))
                .collect(),
        }
    }

    /// Whether the replicas step each on its own batches (asynchronous, or with backups).
    fn free_running(&self) -> bool {
        match self.options.replication {
            Replication::Shared { sync: false } => true,
            Replication::Shared { sync: true } => self.options.backup_workers > 0,
            Replication::Mirrored => false,
        }
    }

    fn replicas(&self) -> usize {
        self.options.devices.len()
    }

    /// The replicas built in full: all, or the first few when the others are stubs.
    fn built(&self) -> usize {
        match (self.options.replication, self.options.built_replicas) {
            (Replication::Mirrored, Some(built)) => built.max(2).min(self.replicas()),
            _ => self.replicas(),
        }
    }

    /// Where the inputs and the combined loss, outputs and metrics live: replica 0's device.
    fn home(&self) -> DeviceSpec {
        self.options.devices[0].clone()
    }

    /// Whether a source node has one copy for all replicas.
    fn is_shared(&self, id: NodeId) -> bool {
        match self.options.replication {
            Replication::Mirrored => false,
            Replication::Shared { sync } => {
                let op = &self.src.graph.node(id).op;
                // An input is sliced per replica: a shared node that uses it takes replica 0's.
                matches!(op, Op::Variable { .. })
                    || (matches!(op, Op::Read) && !self.update_region.contains(&id))
                    || (sync
                        && self.options.backup_workers == 0
                        && self.update_region.contains(&id)
                        && !matches!(op, Op::Input { .. }))
            }
        }
    }

    fn build(&mut self, full: &Module) {
        let src = self.src;
        let graph = &src.graph;
        self.out.dims = full.dims.clone();
        let order = graph.topo_order().expect("verified modules are acyclic");

        match self.options.micro_batches {
            None => self.own_inputs(),
            Some(_) => self.sliced_inputs(full),
        }

        if self.options.micro_batches.is_some() {
            // The shared state, each micro-batch's copies in turn, then the shared update.
            let computed = order.iter().filter(|&&id| !matches!(graph.node(id).op, Op::Input { .. }));
            let (shared, each): (Vec<NodeId>, Vec<NodeId>) = computed.partition(|&&id| self.is_shared(id));
            let (updates, state): (Vec<NodeId>, Vec<NodeId>) =
                shared.into_iter().partition(|id| self.update_region.contains(id));
            for id in state {
                self.shared_copy(id);
            }
            for r in 0..self.built() {
                for &id in &each {
                    let copy = self.copy(id, Some(r));
                    self.copies[r].insert(id, copy);
                }
            }
            for id in updates {
                self.shared_copy(id);
            }
        }
        for &id in order.iter().filter(|_| self.options.micro_batches.is_none()) {
            if matches!(graph.node(id).op, Op::Input { .. }) {
                continue;
            }
            if self.is_shared(id) {
                self.shared_copy(id);
            } else {
                for r in 0..self.built() {
                    let copy = self.copy(id, Some(r));
                    self.copies[r].insert(id, copy);
                }
            }
        }
        self.control_edges(&order);
        if let (Some(stages), true) = (self.options.micro_batches, self.options.one_forward_one_backward) {
            self.one_forward_one_backward(stages);
        }
        // A step's reads of the versions come before its increments of them.
        for &read in &self.version_reads {
            for &increment in &self.version_increments {
                self.out.graph.add_control_edge(read, increment);
            }
        }
        if self.local_sgd() {
            for &id in &order {
                self.average(id);
            }
        }
        self.interface(full);
    }

    /// Each replica is fed its own rows of every input (its worker receives them from the
    /// driver); a lone synchronous replica is fed the input itself.
    fn own_inputs(&mut self) {
        let src = self.src;
        let graph = &src.graph;
        for &input in &src.inputs {
            let node = graph.node(input);
            let alone = self.replicas() == 1 && !self.free_running();
            for r in 0..self.built() {
                let op = Op::Input { ty: node.outputs[0].clone() };
                let name = if alone { node.name.clone() } else { replica_name(r, &node.name) };
                let id = self.out.graph.add(op, &[], &name, graph.span(input)).expect("typed");
                let device = self.request(input, r);
                self.out.graph.node_mut(id).requested_device = device;
                self.out.inputs.push(id);
                self.copies[r].insert(input, id);
            }
        }
    }

    /// A pipeline's micro-batches: the full batch, sliced where the input lives.
    fn sliced_inputs(&mut self, full: &Module) {
        let src = self.src;
        let graph = &src.graph;
        for &input in &src.inputs {
            let node = graph.node(input);
            let full_id = full.inputs.iter().copied().find(|&i| full.graph.node(i).name == node.name);
            let full_ty = full_id.map_or_else(|| node.outputs[0].clone(), |i| full.graph.node(i).outputs[0].clone());
            let id = self.out.graph.add(Op::Input { ty: full_ty }, &[], &node.name, graph.span(input)).expect("typed");
            let home = self.request(input, 0);
            self.out.graph.node_mut(id).requested_device = home.clone();
            self.out.inputs.push(id);
            let rows = node.outputs[0].shape.dims().first().copied().unwrap_or(1);
            for r in 0..self.replicas() {
                let mut begin = vec![0; node.outputs[0].shape.rank()];
                if let Some(first) = begin.first_mut() {
                    *first = r * rows;
                }
                let slice = Op::Slice { begin, size: node.outputs[0].shape.dims().to_vec() };
                let name = replica_name(r, &node.name);
                let s = self.out.graph.add(slice, &[id.into()], &name, graph.span(input)).expect("slices type");
                self.out.graph.node_mut(s).requested_device = home.clone();
                self.copies[r].insert(input, s);
            }
        }
    }

    /// The 1F1B schedule's control edges: on stage k of K, from each end of micro-batch r's
    /// backward pass there (a backward node none of whose users is one) to each start of
    /// micro-batch r + K − k + 1's forward pass there (r + 1's on the last stage; a forward
    /// node none of whose operands is one; constants aside, which are copied wherever they
    /// are used).
    fn one_forward_one_backward(&mut self, stages: &[DeviceSpec]) {
        let graph = &self.src.graph;
        let Some(training) = &self.src.training else { return };
        let mut roots = vec![training.loss.node];
        roots.extend(self.src.outputs.iter().chain(&self.src.metrics).map(|o| o.tensor.node));
        let forward: BTreeSet<NodeId> = graph.ancestors(&roots).into_iter().collect();
        for (k, stage) in stages.iter().enumerate() {
            // The slack of one micro-batch: none on the last stage, which needs no round trip.
            let in_flight = stages.len() - k + usize::from(k + 1 < stages.len());
            let per_micro_batch = graph.node_ids().filter(|&id| {
                let node = graph.node(id);
                node.requested_device.as_ref() == Some(stage)
                    && !self.is_shared(id)
                    && !matches!(node.op, Op::Input { .. } | Op::Const { .. })
            });
            let (ahead, back): (BTreeSet<NodeId>, BTreeSet<NodeId>) =
                per_micro_batch.partition(|id| forward.contains(id));
            let starts: Vec<NodeId> =
                ahead.iter().copied().filter(|&id| graph.inputs(id).iter().all(|t| !ahead.contains(&t.node))).collect();
            let ends: Vec<NodeId> =
                back.iter().copied().filter(|&id| graph.users(id).iter().all(|u| !back.contains(u))).collect();
            for r in 0..self.replicas().saturating_sub(in_flight) {
                for &end in &ends {
                    for &start in &starts {
                        let (before, after) = (self.copies[r][&end], self.copies[r + in_flight][&start]);
                        self.out.graph.add_control_edge(before, after);
                    }
                }
            }
        }
    }

    fn local_sgd(&self) -> bool {
        self.options.local_sgd && self.options.replication == Replication::Mirrored
    }

    /// Local SGD: each built replica's copy of variable `id` (if a float one) set to the mean
    /// of the replicas' copies.
    fn average(&mut self, id: NodeId) {
        let node = self.src.graph.node(id);
        let Op::Variable { ty, .. } = &node.op else { return };
        if !ty.dtype.is_float() {
            return;
        }
        let (name, span, n) = (node.name.clone(), self.src.graph.span(id), self.replicas());
        for r in 0..self.built() {
            let variable = self.copies[r][&id];
            let device = Some(self.options.devices[r].clone());
            let at = |what: &str| replica_name(r, &format!("{name}/average/{what}"));
            let g = &mut self.out.graph;
            let read = g.add(Op::Read, &[variable.into()], &at("read"), span).expect("a read types");
            let key = format!("{AVERAGE_KEY_PREFIX}{name}");
            let op = Op::AllReduce { key, group_size: n as u32, replica: r as u32 };
            let sum = g.add(op, &[read.into()], &at("all_reduce"), span).expect("an all-reduce types");
            for id in [read, sum] {
                g.node_mut(id).requested_device = device.clone();
            }
            let mean = self.scaled_by_replicas(sum, &replica_name(r, &format!("{name}/average")), span);
            let g = &mut self.out.graph;
            let assign = g.add(Op::Assign, &[variable.into(), mean.into()], &at("assign"), span).expect("typed");
            g.node_mut(assign).requested_device = device;
            self.averages.push(assign);
        }
    }

    /// The copy of `id` for replica `r` (`None`: the shared copy), with its data operands.
    fn copy(&mut self, id: NodeId, replica: Option<usize>) -> NodeId {
        let graph = &self.src.graph;
        let node = graph.node(id);
        let span = graph.span(id);
        // The shared copy of a cross-replica mean (one that only shared updates use): the mean
        // of the replicas' operands, as a synchronous shared variable's gradient is.
        if let (Op::CrossReplicaMean, None) = (&node.op, replica) {
            let name = node.name.clone();
            return self.combine(graph.inputs(id)[0], &name, None).node;
        }
        let mut inputs = Vec::new();
        for operand in graph.inputs(id) {
            let mapped = self.operand(id, operand, replica);
            inputs.push(mapped);
        }
        let mut op = node.op.clone();
        let is_variable = matches!(op, Op::Variable { .. });
        let name = match replica {
            Some(r) if !(is_variable && r == 0) => replica_name(r, &node.name),
            _ => node.name.clone(),
        };
        // What depends on the replica (a sharded optimizer's shards, slots and all-gather) is
        // replica r's; such a variable is a shard of its own, not a mirror.
        let mut replica_specific = false;
        if let Some(r) = replica {
            let specific = self.renamers[r].replica_op(&node.name, &op);
            if let Some(specific) = specific.expect("the optimizer builds replica 0's shards") {
                op = specific;
                replica_specific = true;
            }
        }
        if let (Op::Variable { ty, origin, .. }, Some(r)) = (&mut op, replica) {
            if r > 0 && !replica_specific {
                let base = origin.as_deref().cloned().unwrap_or(VariableOrigin {
                    name: node.name.clone(),
                    shape: ty.shape.clone(),
                    offset: 0,
                    mirror_of: None,
                });
                *origin = Some(Box::new(VariableOrigin { mirror_of: Some(node.name.clone()), ..base }));
            }
        }
        // Each replica draws its own random bits (replica 0 those of the unreplicated model).
        if let (Op::RandomUniform { salt, .. } | Op::RandomNormal { salt, .. }, Some(r)) = (&mut op, replica) {
            if r > 0 {
                *salt ^= (r as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            }
        }
        // A cross-replica mean becomes the replicas' all-reduce, scaled below.
        let cross_replica = matches!(op, Op::CrossReplicaMean);
        if let (true, Some(r)) = (cross_replica, replica) {
            let at = span.unwrap_or(Span::new(0, 0));
            if self.free_running() && self.reported.insert((at.start, at.end, "cross-replica".into())) {
                let (message, help) = match self.options.backup_workers {
                    0 => (
                        "synchronised statistics average over the replicas, but asynchronous replicas do not step together",
                        "compile with --sync, or keep per-replica statistics (`synchronized = false`)",
                    ),
                    _ => (
                        "synchronised statistics average over the replicas, but replicas with backup workers do not step together",
                        "compile without --backup-workers, or keep per-replica statistics (`synchronized = false`)",
                    ),
                };
                self.diagnostics.push(
                    Diagnostic::error(Code::PLACEMENT_CONFLICT, at, message)
                        .with_label("averaged over the replicas here")
                        .with_help(help),
                );
            }
            let key = format!("cross_replica/{}", node.name);
            op = Op::AllReduce { key, group_size: self.replicas() as u32, replica: r as u32 };
        }
        if let (Some(r), true) = (replica, self.options.backup_workers > 0 && self.update_region.contains(&id)) {
            self.gate(id, r, &mut inputs);
        }
        let outputs = node.outputs.clone();
        let copy = self.out.graph.add_with_types(op, &inputs, outputs, &name, span);
        // Free-running replicas' updates are per replica but live with the shared variables.
        let async_update = self.free_running() && self.update_region.contains(&id);
        // A node that must live with a shared one (a shard's lookup) is not the replica's.
        let with_shared = node.colocate_with.is_some_and(|w| self.is_shared(w));
        let device = match replica {
            Some(_) if async_update || with_shared => node.requested_device.clone(),
            Some(r) => self.request(id, r),
            None if is_variable => self.shared_variable_request(id),
            None => node.requested_device.clone(),
        };
        let at = graph.request_span(id).filter(|_| device == node.requested_device);
        self.out.graph.request(copy, device, at);
        if let Some(with) = node.colocate_with {
            let target = match replica {
                Some(r) if !self.is_shared(with) => self.copies[r].get(&with).copied(),
                _ => self.shared.get(&with).copied(),
            };
            self.out.graph.node_mut(copy).colocate_with = target;
        }
        if cross_replica && replica.is_some() {
            return self.scaled_by_replicas(copy, &name, span);
        }
        copy
    }

    /// The mean gradient of `variable` for replica `r` when its gradient is a lookup's scatter
    /// (an embedding's): the replicas exchange the rows they touched and their indices, not the
    /// dense table, and each scatters them all (TensorFlow's IndexedSlices). The exchange is an
    /// all-gather made of all-reduces: each replica's tensor in its own slot of one per
    /// replica, zeros elsewhere (index 0 with zero rows adds nothing). `None` for other
    /// gradients.
    fn gathered_rows_gradient(
        &mut self,
        gradient: TensorRef,
        name: &str,
        r: usize,
        span: Option<Span>,
    ) -> Option<TensorRef> {
        let Op::ScatterAdd { rows } = self.src.graph.node(gradient.node).op else { return None };
        let copy = self.copies[r][&gradient.node];
        let [indices, updates] = self.out.graph.inputs(copy)[..] else { return None };
        let n = self.replicas();
        let device = Some(self.options.devices[r].clone());
        let add = |b: &mut Self, op: Op, inputs: &[TensorRef], what: &str| -> TensorRef {
            let id = b.out.graph.add(op, inputs, &format!("replica_{r}/{name}/{what}"), span).expect("typed");
            b.out.graph.node_mut(id).requested_device = device.clone();
            id.into()
        };
        let gather = |b: &mut Self, t: TensorRef, what: &str| {
            let dims = b.out.graph.ty(t).shape.dims().to_vec();
            let one = Shape::from([1].into_iter().chain(dims.iter().copied()).collect::<Vec<_>>());
            let row = add(b, Op::Reshape { shape: one }, &[t], &format!("{what}/row"));
            let (mut before, mut after) = (vec![0; dims.len() + 1], vec![0; dims.len() + 1]);
            (before[0], after[0]) = (r, n - 1 - r);
            let slot = add(b, Op::Pad { before, after }, &[row], &format!("{what}{REPLICA_SLOT}"));
            let key = format!("gradients/{name}/{what}");
            add(
                b,
                Op::AllReduce { key, group_size: n as u32, replica: r as u32 },
                &[slot],
                &format!("{what}/all_gather"),
            )
        };
        let all_indices = gather(self, indices, "indices");
        let all_rows = gather(self, updates, "rows");
        let sum = add(self, Op::ScatterAdd { rows }, &[all_indices, all_rows], "gathered_gradient");
        Some(self.scaled_by_replicas(sum.node, &format!("replica_{r}/{name}/gathered"), span).into())
    }

    /// `sum / replicas`, on `sum`'s device: the mean of a cross-replica all-reduce.
    fn scaled_by_replicas(&mut self, sum: NodeId, name: &str, span: Option<Span>) -> NodeId {
        let replicas = self.replicas() as f64;
        let g = &mut self.out.graph;
        let dtype = g.node(sum).outputs[0].dtype;
        let scale = Op::Const { value: ConstValue::scalar(dtype, 1.0 / replicas) };
        let k = g.add(scale, &[], &format!("{name}/replicas"), span).expect("constants type");
        let mean = g.add(Op::Binary(BinaryOp::Mul), &[sum.into(), k.into()], &format!("{name}/mean"), span);
        let mean = mean.expect("a scaled all-reduce types");
        let device = g.node(sum).requested_device.clone();
        for id in [k, mean] {
            g.node_mut(id).requested_device = device.clone();
        }
        mean
    }

    /// What operand `operand` of `user` becomes in the copy for `replica`.
    fn operand(&mut self, user: NodeId, operand: TensorRef, replica: Option<usize>) -> TensorRef {
        // A gradient whose mean the update takes itself (a sharded optimizer's) is combined there.
        let averaged_by_user = matches!(self.src.graph.node(user).op, Op::CrossReplicaMean);
        let in_update = self.update_region.contains(&user) && !averaged_by_user;
        if in_update {
            if let Some(&variable) = self.gradients.get(&operand) {
                // One combined gradient per replica, except for synchronous shared variables.
                let per_replica = self.free_running() || self.options.replication == Replication::Mirrored;
                let key = (replica.filter(|_| per_replica), variable);
                if let Some(&done) = self.combined.get(&key) {
                    return done;
                }
                let combined = self.combined_gradient(operand, variable, replica);
                self.combined.insert(key, combined);
                return combined;
            }
        }
        let port = operand.port;
        let node = if self.is_shared(operand.node) {
            self.shared[&operand.node]
        } else {
            match replica {
                Some(r) => self.copies[r][&operand.node],
                // A shared node uses a replicated one: a constant is copied; anything else
                // is taken from replica 0.
                None => match &self.src.graph.node(operand.node).op {
                    Op::Const { .. } => self.shared_copy(operand.node),
                    _ => self.copies[0][&operand.node],
                },
            }
        };
        TensorRef { node, port }
    }

    /// The gradient the update of `variable` uses: the all-reduced mean (mirrored), the mean
    /// computed beside the variable (shared, sync), or the replica's own (async).
    fn combined_gradient(&mut self, gradient: TensorRef, variable: NodeId, replica: Option<usize>) -> TensorRef {
        let n = self.replicas();
        let name = self.src.graph.node(variable).name.clone();
        let span = self.src.graph.span(variable);
        let ty = self.src.graph.ty(gradient).clone();
        let scale = Op::Const { value: ConstValue::scalar(ty.dtype, 1.0 / n as f64) };
        let replica_gradient =
            |b: &Self, r: usize| TensorRef { node: b.copies[r][&gradient.node], port: gradient.port };
        match (self.options.replication, replica) {
            (Replication::Mirrored, Some(r)) if self.options.local_sgd => replica_gradient(self, r),
            (Replication::Mirrored, Some(r)) => {
                if let Some(gathered) = self.gathered_rows_gradient(gradient, &name, r, span) {
                    return gathered;
                }
                let key = format!("gradients/{name}");
                let local = replica_gradient(self, r);
                let g = &mut self.out.graph;
                let summed = g
                    .add(
                        Op::AllReduce { key, group_size: n as u32, replica: r as u32 },
                        &[local],
                        &format!("replica_{r}/{name}/all_reduce"),
                        span,
                    )
                    .expect("all-reduce types");
                let device = Some(self.options.devices[r].clone());
                g.node_mut(summed).requested_device = device.clone();
                let k = g.add(scale, &[], &format!("replica_{r}/{name}/replicas"), span).expect("typed");
                let mean = g
                    .add(
                        Op::Binary(BinaryOp::Mul),
                        &[summed.into(), k.into()],
                        &format!("replica_{r}/{name}/mean_gradient"),
                        span,
                    )
                    .expect("typed");
                for id in [k, mean] {
                    g.node_mut(id).requested_device = device.clone();
                }
                mean.into()
            }
            (Replication::Shared { sync: false }, Some(r)) if self.options.staleness_aware => {
                let gradient = replica_gradient(self, r);
                self.staleness_scaled(gradient, variable, r)
            }
            (Replication::Shared { sync: false }, Some(r)) => replica_gradient(self, r),
            (Replication::Shared { sync: true }, Some(r)) if self.options.backup_workers > 0 => {
                let gradient = replica_gradient(self, r);
                self.accumulated_mean(gradient, variable, r)
            }
            _ => {
                let parts: Vec<TensorRef> = (0..n).map(|r| replica_gradient(self, r)).collect();
                let colocate = self.shared.get(&variable).copied();
                let g = &mut self.out.graph;
                let mut sum = parts[0];
                for (r, part) in parts.iter().enumerate().skip(1) {
                    let id = g
                        .add(Op::Binary(BinaryOp::Add), &[sum, *part], &format!("{name}/gradient_sum_{r}"), span)
                        .expect("typed");
                    g.node_mut(id).colocate_with = colocate;
                    sum = id.into();
                }
                let k = g.add(scale, &[], &format!("{name}/replicas"), span).expect("typed");
                let mean = g
                    .add(Op::Binary(BinaryOp::Mul), &[sum, k.into()], &format!("{name}/mean_gradient"), span)
                    .expect("typed");
                for id in [k, mean] {
                    g.node_mut(id).colocate_with = colocate;
                }
                mean.into()
            }
        }
    }

    /// Replica `r`'s `gradient` of the shared `variable` divided by its staleness τ: the
    /// variable's updates since the replica read it, plus one. The version read with the
    /// variable's value goes to the replica and comes back (an identity on its device), so
    /// that a parameter server that runs a replica's step in two parts reads it in the first
    /// and compares it with the version of the second; the increment is one of the replica's
    /// updates.
    fn staleness_scaled(&mut self, gradient: TensorRef, variable: NodeId, r: usize) -> TensorRef {
        let (then, echo, now) = self.version_read_back(variable, r);
        let version = self.versions[&variable];
        let mut beside = |op: Op, inputs: &[TensorRef], what: &str| self.beside(variable, r, op, inputs, what);
        let since = beside(Op::Binary(BinaryOp::Sub), &[now.into(), echo.into()], "updates_since");
        let since = beside(Op::Cast { to: dfc_ir::DType::F32 }, &[since.into()], "updates_since_f32");
        let one = beside(Op::Const { value: ConstValue::scalar(dfc_ir::DType::F32, 1.0) }, &[], "one");
        let tau = beside(Op::Binary(BinaryOp::Add), &[since.into(), one.into()], "staleness");
        let dtype = self.out.graph.ty(gradient).dtype;
        let mut beside = |op: Op, inputs: &[TensorRef], what: &str| self.beside(variable, r, op, inputs, what);
        let tau_as = if dtype == dfc_ir::DType::F32 {
            tau
        } else {
            beside(Op::Cast { to: dtype }, &[tau.into()], "staleness_cast")
        };
        let scaled = beside(Op::Binary(BinaryOp::Div), &[gradient, tau_as.into()], "stale_gradient");
        let count = beside(Op::Const { value: ConstValue::scalar(dfc_ir::DType::I64, 1.0) }, &[], "one_update");
        let increment = beside(Op::AssignAdd, &[version.into(), count.into()], "version_increment");
        // Counted once τ is known: in the part of the step that has the gradient.
        self.out.graph.add_control_edge(tau, increment);
        self.version_reads.extend([then, now]);
        self.version_increments.push(increment);
        scaled.into()
    }

    /// A node of replica `r` (`replica_<r>/<variable>/<what>`) beside the shared copy of
    /// `variable`.
    fn beside(&mut self, variable: NodeId, r: usize, op: Op, inputs: &[TensorRef], what: &str) -> NodeId {
        let name = replica_name(r, &format!("{}/{what}", self.src.graph.node(variable).name));
        let span = self.src.graph.span(variable);
        let shared = self.shared[&variable];
        let id = self.out.graph.add(op, inputs, &name, span).expect("typed");
        self.out.graph.node_mut(id).colocate_with = Some(shared);
        id
    }

    /// The shared copy of the source node `id`, made now if it is not yet.
    fn shared_copy(&mut self, id: NodeId) -> NodeId {
        if let Some(&copy) = self.shared.get(&id) {
            return copy;
        }
        let copy = self.copy(id, None);
        self.shared.insert(id, copy);
        copy
    }

    /// A new variable beside the shared copy of `variable`, zero to begin with.
    fn variable_beside(&mut self, variable: NodeId, ty: dfc_ir::TensorType, what: &str) -> NodeId {
        let name = format!("{}/{what}", self.src.graph.node(variable).name);
        let span = self.src.graph.span(variable);
        let shared = self.shared_copy(variable);
        let op = Op::Variable { ty, init: dfc_ir::Initializer::Zeros, trainable: false, partitions: 1, origin: None };
        let id = self.out.graph.add(op, &[], &name, span).expect("variables type");
        self.out.graph.node_mut(id).colocate_with = Some(shared);
        id
    }

    /// Replica `r`'s reads of the version of the shared `variable` (made with the first): the
    /// one made with the variable's value, its echo from the replica's device, and the one
    /// made with the replica's gradient. A parameter server that runs a replica's step in two
    /// parts reads the first in the first part and the third in the second.
    fn version_read_back(&mut self, variable: NodeId, r: usize) -> (NodeId, NodeId, NodeId) {
        let version = match self.versions.get(&variable) {
            Some(&version) => version,
            None => {
                let version = self.variable_beside(variable, dfc_ir::TensorType::scalar(dfc_ir::DType::I64), "version");
                self.versions.insert(variable, version);
                version
            }
        };
        let then = self.beside(variable, r, Op::Read, &[version.into()], "version_read");
        let name = replica_name(r, &format!("{}/version_echo", self.src.graph.node(variable).name));
        let echo =
            self.out.graph.add(Op::Identity, &[then.into()], &name, self.src.graph.span(variable)).expect("typed");
        self.out.graph.node_mut(echo).requested_device = Some(self.options.devices[r].clone());
        let now = self.beside(variable, r, Op::Read, &[version.into()], "version_now");
        (then, echo, now)
    }

    /// Backup workers: replica `r`'s arrival at the shared `variable`'s accumulation (made
    /// once): whether the version it read is current, its count among the gradients taken, and
    /// after the N-th the count emptied and the version counted.
    fn arrival(&mut self, variable: NodeId, r: usize) -> Arrival {
        if let Some(&arrival) = self.arrivals.get(&(variable, r)) {
            return arrival;
        }
        let i64_scalar = dfc_ir::TensorType::scalar(dfc_ir::DType::I64);
        if !self.accumulators.contains_key(&variable) {
            let ty = self.src.graph.node(variable).outputs[0].clone();
            let accumulator = self.variable_beside(variable, ty, "accumulator");
            let count = self.variable_beside(variable, i64_scalar.clone(), "accumulated");
            self.accumulators.insert(variable, (accumulator, count));
        }
        let (_, echo, now) = self.version_read_back(variable, r);
        let (version, (_, count)) = (self.versions[&variable], self.accumulators[&variable]);
        let aggregate = self.replicas() - self.options.backup_workers;
        let int = |value: f64| Op::Const { value: ConstValue::scalar(dfc_ir::DType::I64, value) };
        let mut beside = |op: Op, inputs: &[TensorRef], what: &str| self.beside(variable, r, op, inputs, what);
        let fresh = beside(Op::Compare(dfc_ir::CompareOp::Equal), &[now.into(), echo.into()], "fresh");
        let accepted = beside(Op::Cast { to: dfc_ir::DType::I64 }, &[fresh.into()], "accepted");
        let counted = beside(Op::AssignAdd, &[count.into(), accepted.into()], "count");
        let n = beside(int(aggregate as f64), &[], "aggregate");
        let complete = beside(Op::Compare(dfc_ir::CompareOp::Equal), &[counted.into(), n.into()], "complete");
        let zero = beside(int(0.0), &[], "no_gradients");
        let left = beside(Op::Select, &[complete.into(), zero.into(), counted.into()], "count_left");
        let reset = beside(Op::Assign, &[count.into(), left.into()], "reset_count");
        let applied = beside(Op::Cast { to: dfc_ir::DType::I64 }, &[complete.into()], "applied");
        let increment = beside(Op::AssignAdd, &[version.into(), applied.into()], "version_increment");
        self.backup_updates.extend([reset, increment]);
        let arrival = Arrival { fresh, complete };
        self.arrivals.insert((variable, r), arrival);
        arrival
    }

    /// Backup workers: replica `r`'s `gradient` of the shared `variable` added to the
    /// accumulator if it is fresh; the accumulator's mean for the update, which it applies only
    /// if it completes the N (its assignments are gated), and the accumulator emptied then.
    fn accumulated_mean(&mut self, gradient: TensorRef, variable: NodeId, r: usize) -> TensorRef {
        let arrival = self.arrival(variable, r);
        let (accumulator, _) = self.accumulators[&variable];
        let aggregate = self.replicas() - self.options.backup_workers;
        let dtype = self.out.graph.ty(gradient).dtype;
        let mut beside = |op: Op, inputs: &[TensorRef], what: &str| self.beside(variable, r, op, inputs, what);
        let zero = beside(Op::Const { value: ConstValue::scalar(dtype, 0.0) }, &[], "zero");
        // A select, not a product: a dropped gradient that overflowed adds no NaN.
        let taken = beside(Op::Select, &[arrival.fresh.into(), gradient, zero.into()], "taken_gradient");
        let summed = beside(Op::AssignAdd, &[accumulator.into(), taken.into()], "accumulate");
        let k = beside(Op::Const { value: ConstValue::scalar(dtype, 1.0 / aggregate as f64) }, &[], "aggregated");
        let mean = beside(Op::Binary(BinaryOp::Mul), &[summed.into(), k.into()], "mean_gradient");
        let left = beside(Op::Select, &[arrival.complete.into(), zero.into(), summed.into()], "accumulator_left");
        let reset = beside(Op::Assign, &[accumulator.into(), left.into()], "reset_accumulator");
        // Emptied once the update has its mean.
        self.out.graph.add_control_edge(mean, reset);
        self.backup_updates.push(reset);
        mean.into()
    }

    /// Backup workers: the value operand of replica `r`'s copy of the update-region node `id`,
    /// if an assignment, replaced by a select of it where the replica completes the update of
    /// its gate variable, and otherwise of what leaves the variable as it is.
    fn gate(&mut self, id: NodeId, r: usize, inputs: &mut [TensorRef]) {
        let op = self.src.graph.node(id).op.clone();
        if !matches!(op, Op::Assign | Op::AssignAdd | Op::AssignSub) {
            return;
        }
        let complete = self.arrival(self.gates[&id], r).complete;
        let (target, value) = (inputs[0], inputs[1]);
        let name = replica_name(r, &self.src.graph.node(id).name);
        let span = self.src.graph.span(id);
        let g = &mut self.out.graph;
        let dtype = g.ty(value).dtype;
        let unchanged = match op {
            Op::Assign => g.add(Op::Read, &[target], &format!("{name}/unchanged"), span),
            _ => g.add(Op::Const { value: ConstValue::scalar(dtype, 0.0) }, &[], &format!("{name}/unchanged"), span),
        }
        .expect("typed");
        let gated = g.add(Op::Select, &[complete.into(), value, unchanged.into()], &format!("{name}/gated"), span);
        let gated = gated.expect("a gate types as its value");
        for node in [unchanged, gated] {
            g.node_mut(node).colocate_with = Some(target.node);
        }
        inputs[1] = gated.into();
    }

    /// The device replica `r`'s copy of `id` is requested on: the replica's device, checked
    /// against what the source asked for.
    fn request(&mut self, id: NodeId, r: usize) -> Option<DeviceSpec> {
        if self.options.micro_batches.is_some() {
            return self.src.graph.node(id).requested_device.clone();
        }
        let device = self.options.devices[r].clone();
        let name = &self.src.graph.node(id).name;
        let why = format!("data parallelism runs replica {r} of `{name}` on {device}");
        let help = "drop the device request, choose a strategy that honours it (--strategy ps or single), or compile with --soft-placement";
        self.check_request(id, &device, why, help);
        Some(device)
    }

    fn shared_variable_request(&mut self, id: NodeId) -> Option<DeviceSpec> {
        let Some(home) = self.options.variable_device.cloned() else {
            return self.src.graph.node(id).requested_device.clone();
        };
        let why = format!("central storage keeps `{}` on {home}", self.src.graph.node(id).name);
        self.check_request(id, &home, why, "drop the device request, or compile with --soft-placement");
        Some(home)
    }

    /// Reports, once per request written in the source, that `id` asks for a device other than
    /// the strategy's `device` (an error, or a warning under soft placement).
    fn check_request(&mut self, id: NodeId, device: &DeviceSpec, why: String, help: &str) {
        let graph = &self.src.graph;
        let Some(asked) = &graph.node(id).requested_device else { return };
        let span = graph.request_span(id).or(graph.span(id)).unwrap_or(Span::new(0, 0));
        if asked.allows(device) || !self.reported.insert((span.start, span.end, asked.to_string())) {
            return;
        }
        let message = format!("this asks for {asked}, but {why}");
        let diagnostic = if self.options.soft {
            Diagnostic::warning(Code::SOFT_PLACEMENT, span, format!("{message}; the request is set aside"))
        } else {
            Diagnostic::error(Code::PLACEMENT_CONFLICT, span, message).with_help(help)
        };
        self.diagnostics.push(diagnostic.with_label("requested here"));
    }

    fn control_edges(&mut self, order: &[NodeId]) {
        let graph = &self.src.graph;
        let built = &self.copies[..self.built()];
        for &after in order {
            for before in graph.control_inputs(after) {
                let pairs: Vec<(NodeId, NodeId)> = match (self.is_shared(before), self.is_shared(after)) {
                    (true, true) => vec![(self.shared[&before], self.shared[&after])],
                    (true, false) => built.iter().map(|c| (self.shared[&before], c[&after])).collect(),
                    (false, true) => built.iter().map(|c| (c[&before], self.shared[&after])).collect(),
                    (false, false) => built.iter().map(|c| (c[&before], c[&after])).collect(),
                };
                for (b, a) in pairs {
                    self.out.graph.add_control_edge(b, a);
                }
            }
        }
    }

    /// Loss, outputs, metrics, params and updates of the replicated module.
    fn interface(&mut self, full: &Module) {
        let src = self.src;
        let training = src.training.as_ref().expect("checked");
        let loss = self.combine(training.loss, &src.graph.node(training.loss.node).name.clone(), None);
        let mut outputs = Vec::new();
        for o in &src.outputs {
            let full_ty = full.outputs.iter().find(|f| f.name == o.name).map(|f| full.graph.ty(f.tensor).clone());
            outputs.push(Output { name: o.name.clone(), tensor: self.combine(o.tensor, &o.name, full_ty) });
        }
        let mut metrics = Vec::new();
        for m in &src.metrics {
            let full_ty = full.metrics.iter().find(|f| f.name == m.name).map(|f| full.graph.ty(f.tensor).clone());
            metrics.push(Output { name: m.name.clone(), tensor: self.combine(m.tensor, &m.name, full_ty) });
        }
        let built = &self.copies[..self.built()];
        let mut params = Vec::new();
        for &p in &src.params {
            if self.is_shared(p) {
                params.push(self.shared[&p]);
            } else {
                params.extend(built.iter().map(|c| c[&p]));
            }
        }
        // The versions (and the backup workers' accumulators), in the order they were made.
        let accumulators = self.accumulators.values().flat_map(|&(sum, count)| [sum, count]);
        let mut versions: Vec<NodeId> = self.versions.values().copied().chain(accumulators).collect();
        versions.sort();
        params.extend(versions);
        let mut updates = Vec::new();
        for &u in &training.updates {
            if self.is_shared(u) {
                updates.push(self.shared[&u]);
            } else {
                updates.extend(built.iter().map(|c| c[&u]));
            }
        }
        updates.extend(&self.version_increments);
        updates.extend(&self.backup_updates);
        let gradients = training
            .gradients
            .iter()
            .filter_map(|(v, _)| {
                let var = if self.is_shared(*v) { self.shared[v] } else { self.copies[0][v] };
                let mean = self.combined.get(&(None, *v)).or_else(|| self.combined.get(&(Some(0), *v)))?;
                Some((var, *mean))
            })
            .collect();
        self.out.outputs = outputs;
        self.out.metrics = metrics;
        self.out.params = params;
        // The learning rate is computed once, with the optimizer's shared state.
        let learning_rate = training.learning_rate.map(|lr| {
            let node = if self.is_shared(lr.node) { self.shared[&lr.node] } else { self.copies[0][&lr.node] };
            TensorRef { node, ..lr }
        });
        self.out.training = Some(Training {
            loss,
            optimizer: training.optimizer.clone(),
            gradients,
            updates,
            learning_rate,
            averages: std::mem::take(&mut self.averages),
        });
    }

    /// One tensor from the replicas' copies of `tensor`: joined along axis 0 if the full
    /// model's is the replicas' stacked, else their mean (floats) or replica 0's.
    fn combine(&mut self, tensor: TensorRef, name: &str, full_ty: Option<dfc_ir::TensorType>) -> TensorRef {
        if self.is_shared(tensor.node) {
            return TensorRef { node: self.shared[&tensor.node], port: tensor.port };
        }
        let ty = self.src.graph.ty(tensor).clone();
        let span = self.src.graph.span(tensor.node);
        let n = self.replicas();
        let stacked = full_ty.as_ref().is_some_and(|f| {
            f.shape.rank() == ty.shape.rank()
                && f.shape.rank() > 0
                && f.shape.dims()[0] == ty.shape.dims()[0] * n
                && f.shape.dims()[1..] == ty.shape.dims()[1..]
        });
        if !stacked && !ty.dtype.is_float() {
            return self.part(tensor, 0);
        }
        let parts: Vec<TensorRef> = (0..n).map(|r| self.part(tensor, r)).collect();
        // A pipeline's micro-batches meet on the stage that computes them.
        let home = match self.options.micro_batches {
            Some(_) => self.src.graph.node(tensor.node).requested_device.clone(),
            None => Some(self.home()),
        };
        let g: &mut Graph = &mut self.out.graph;
        if stacked {
            let id = g.add(Op::Concat { axis: 0 }, &parts, name, span).expect("replicas stack");
            g.node_mut(id).requested_device = home;
            return id.into();
        }
        let mut sum = parts[0];
        for (r, part) in parts.iter().enumerate().skip(1) {
            let id = g
                .add(Op::Binary(BinaryOp::Add), &[sum, *part], &format!("{name}/replica_sum_{r}"), span)
                .expect("typed");
            g.node_mut(id).requested_device = home.clone();
            sum = id.into();
        }
        let k = g
            .add(
                Op::Const { value: ConstValue::scalar(ty.dtype, 1.0 / n as f64) },
                &[],
                &format!("{name}/replicas"),
                span,
            )
            .expect("typed");
        let mean = g.add(Op::Binary(BinaryOp::Mul), &[sum, k.into()], name, span).expect("typed");
        for id in [k, mean] {
            g.node_mut(id).requested_device = home.clone();
        }
        mean.into()
    }

    /// Replica `r`'s copy of `tensor`, or for a stub replica what `partition` would make of
    /// it on the home device: a Recv, or a copy of a constant.
    fn part(&mut self, tensor: TensorRef, r: usize) -> TensorRef {
        if r < self.built() {
            return TensorRef { node: self.copies[r][&tensor.node], port: tensor.port };
        }
        if let Some(&done) = self.stub_parts.get(&(r, tensor)) {
            return done;
        }
        let graph = &self.src.graph;
        let node = graph.node(tensor.node);
        let span = graph.span(tensor.node);
        let name = replica_name(r, &node.name);
        let home = self.home();
        let standalone = matches!(node.op, Op::Const { .. }) && graph.control_inputs(tensor.node).is_empty();
        let id = if standalone {
            let name = format!("{name}/on_{}", dfc_ir::device_slug(&home));
            self.out.graph.add_with_types(node.op.clone(), &[], node.outputs.clone(), &name, span)
        } else {
            let (key, _, recv_name) = transfer_names(&name, tensor.port, &self.options.devices[r], &home);
            let recv = Op::Recv { key, from: self.options.devices[r].clone(), ty: graph.ty(tensor).clone() };
            self.out.graph.add(recv, &[], &recv_name, span).expect("recvs type")
        };
        // Unrequested, as `partition` leaves them: placement puts them with their users.
        let part = if standalone { TensorRef { node: id, port: tensor.port } } else { id.into() };
        self.stub_parts.insert((r, tensor), part);
        part
    }
}
