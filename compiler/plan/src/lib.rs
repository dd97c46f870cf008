//! The execution plan: what `dfc compile` writes and `dfc inspect` / `dfc run` read.
//!
//! A `Plan` is the compiled model split into one `Partition` per device, plus a name-level
//! description of its interface (inputs, outputs, parameters, training) so that tools can show
//! and check a plan without walking graphs. The on-disk form is a fixed header (magic, format
//! version, payload length, CRC-32) followed by the postcard-encoded `Plan`; see
//! `docs/plan-format.md`.

mod format;
mod summary;
mod validate;

pub use format::{decode, encode, write, PlanError, FORMAT_VERSION, HEADER_LEN, MAGIC};
pub use summary::{summary, DeviceSummary, KernelSummary, ParamSummary, Summary, TensorSummary, TrainingSummary};
pub use validate::MAX_TENSOR_BYTES;

pub use dfc_ir::{Cluster, Job, Task};
use dfc_ir::{DeviceKind, DeviceSpec, Initializer, Module, NodeId, Op, Optimizer, TensorRef, TensorType};
use dfc_passes::cost::tensor_bytes;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Plan {
    /// The version of the dfc that wrote the plan, for bug reports; readers check
    /// `FORMAT_VERSION`, not this.
    pub dfc_version: String,
    /// File name of the `.df` source.
    pub source_name: String,
    /// `source_hash` of the source text, so a tool can tell whether a plan is stale.
    pub source_hash: u64,
    pub model: String,
    pub dims: Vec<(String, usize)>,
    pub cluster: Cluster,
    /// How the model was spread over the cluster.
    pub strategy: StrategySpec,
    /// One per device that runs anything. Each holds a module whose every node is on that
    /// device; partitions meet only through Send/Recv pairs (same key) and all-reduces. The
    /// modules list their own inputs, params, outputs and metrics; `training` is `None` in
    /// them: the plan's `training` names the loss and the updates across partitions.
    pub partitions: Vec<Partition>,
    /// Partitions stored as copies of another one (data parallelism's replicas): `decode`
    /// builds each with `dfc_ir::instantiate` and appends it to `partitions`, so that a read
    /// plan has none left. A plan for 64 replicas stores two of them.
    pub instances: Vec<dfc_ir::Instance>,
    pub inputs: Vec<IoSpec>,
    /// The inputs fed to replicas by rows (data parallelism, but for a pipeline's
    /// micro-batches): the runtime splits each such input's batch and feeds every replica its
    /// share directly, as TensorFlow's distributed datasets do, so that no replica's batch
    /// passes through another one's device.
    pub split_inputs: Vec<SplitInput>,
    pub outputs: Vec<IoSpec>,
    pub metrics: Vec<IoSpec>,
    /// The model's parameters as the source declares them (a partitioned one once, with its
    /// shards' devices).
    pub params: Vec<ParamSpec>,
    pub training: Option<TrainingSpec>,
    /// Asynchronous parameter server, or synchronous with backup workers (else empty): what
    /// each replica feeds, fetches and runs by itself, so that replicas can train without
    /// waiting for each other.
    pub replicas: Vec<ReplicaSpec>,
    /// The cost model's prediction for one training step, per device.
    pub report: Option<CostReport>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StrategySpec {
    /// `single`, `model`, `mirrored`, `ps` or `central-storage`.
    pub name: String,
    /// Copies of the model's compute that each take a slice of the batch (1 without data
    /// parallelism): replicas, or under `model` a pipeline's micro-batches.
    pub replicas: u32,
    /// Parameter server only: whether the workers' gradients are combined into one update.
    pub sync: bool,
    /// How variables were spread: `round-robin`, `greedy`, `greedy-sorted`.
    pub placement: String,
    /// Mirrored local SGD (`--sync-every k`): each replica applies its own gradients, and every
    /// k steps the replicas' variables are averaged (`TrainingSpec::averages`).
    pub sync_every: Option<u32>,
    /// Asynchronous ps: each replica's gradient divided by its staleness.
    pub staleness_aware: bool,
    /// Mirrored: each all-reduce starts as soon as its gradients are computed and runs while
    /// the rest of the step goes on (`dfc compile --overlap`).
    pub overlap: bool,
    /// Synchronous ps: replicas beyond the N = `replicas − backup_workers` whose gradients make
    /// an update; the replicas step on their own (`Plan::replicas`) and each update takes the
    /// first N fresh gradients (`dfc compile --backup-workers`).
    pub backup_workers: u32,
}

impl Default for StrategySpec {
    fn default() -> StrategySpec {
        StrategySpec {
            name: "single".into(),
            replicas: 1,
            sync: true,
            placement: "round-robin".into(),
            sync_every: None,
            staleness_aware: false,
            overlap: false,
            backup_workers: 0,
        }
    }
}

/// At most this many nodes in the partitions a plan's instances make (8 Mi, a few GiB of
/// graph): a larger expansion is a crafted plan, refused before it takes the memory.
pub const MAX_INSTANCE_NODES: usize = 1 << 23;

/// The part of the model one device runs; every node of `module.graph` has `device` set to
/// `device`. A plan carries no code: native code and PTX are generated from `module` where the
/// plan runs (`dfc_codegen`), after `decode` has verified it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Partition {
    pub device: DeviceSpec,
    pub module: Module,
}

/// A model input or named output, by name: what a user feeds or fetches.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct IoSpec {
    pub name: String,
    pub ty: TensorType,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ParamSpec {
    pub name: String,
    pub ty: TensorType,
    pub init: Initializer,
    pub trainable: bool,
    pub partitions: u32,
    /// The device the source asked for (`@device`, `device` blocks), if any.
    pub requested_device: Option<String>,
    /// Size of the variable's buffer.
    pub bytes: u64,
    /// Where its shards (or, mirrored, its copies) live, in order.
    pub devices: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainingSpec {
    /// The named output that is the loss, or else the loss node's name (`name:port` for a port
    /// other than 0).
    pub loss: String,
    /// The node that computes the loss (output 0), in whichever partition holds it.
    pub loss_node: String,
    pub optimizer: Optimizer,
    /// The nodes a training step runs for their effect (the updates), by name, across all
    /// partitions.
    pub updates: Vec<String>,
    /// The node computing the step's learning rate (output 0), where a schedule sets it.
    pub learning_rate: Option<String>,
    /// Local SGD: the assignments that average the replicas' variables, run every
    /// `StrategySpec::sync_every` steps and before evaluations and checkpoints.
    pub averages: Vec<String>,
}

/// A plan input whose batch is split by rows among `Input` nodes, one per replica: node r of
/// R takes rows `r·b .. (r+1)·b` (b = batch / R).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SplitInput {
    pub input: String,
    pub nodes: Vec<String>,
}

/// One replica's own training step (asynchronous parameter server): fed its own batches
/// (its nodes of `Plan::split_inputs`), it updates the shared variables without waiting for
/// the other replicas.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReplicaSpec {
    /// The device its compute runs on.
    pub device: DeviceSpec,
    /// Its loss (output 0 of this node).
    pub loss_node: String,
    /// Its updates of the shared variables, by node name.
    pub updates: Vec<String>,
    /// Staleness-aware updates: the node of the staleness τ of its update (the updates the
    /// variable took since the replica read it, plus one), for the metrics.
    pub staleness: Option<String>,
    /// Backup workers: the nodes that say what became of its gradient (taken or dropped, an
    /// update applied or not, the version after it), for the metrics and for its next step.
    pub backup: Option<BackupNodes>,
}

pub use dfc_passes::{BackupNodes, CostReport, DeviceCost};

impl Plan {
    /// A plan of the placed `combined` module (every node has a device; cross-device edges
    /// already go through Send/Recv) split into `partitions`. The interface (inputs, outputs,
    /// params, training) is read from `combined`.
    pub fn build(
        combined: &Module,
        partitions: Vec<Partition>,
        cluster: Cluster,
        strategy: StrategySpec,
        source_name: &str,
        source_text: &str,
    ) -> Plan {
        let graph = &combined.graph;
        let io = |id: NodeId| {
            let node = graph.node(id);
            let ty = match &node.op {
                Op::Input { ty } => ty.clone(),
                _ => node.outputs[0].clone(),
            };
            IoSpec { name: node.name.clone(), ty }
        };
        let named = |outputs: &[dfc_ir::Output]| {
            outputs.iter().map(|o| IoSpec { name: o.name.clone(), ty: graph.ty(o.tensor).clone() }).collect()
        };
        let training = combined.training.as_ref().map(|t| TrainingSpec {
            loss: tensor_name(combined, t.loss),
            loss_node: graph.node(t.loss.node).name.clone(),
            optimizer: t.optimizer.clone(),
            updates: t.updates.iter().map(|&u| graph.node(u).name.clone()).collect(),
            learning_rate: t.learning_rate.map(|lr| graph.node(lr.node).name.clone()),
            averages: t.averages.iter().map(|&u| graph.node(u).name.clone()).collect(),
        });
        Plan {
            dfc_version: env!("CARGO_PKG_VERSION").into(),
            source_name: source_name.into(),
            source_hash: source_hash(source_text),
            model: combined.name.clone(),
            dims: combined.dims.clone(),
            cluster,
            strategy,
            inputs: combined.inputs.iter().map(|&id| io(id)).collect(),
            split_inputs: Vec::new(),
            outputs: named(&combined.outputs),
            metrics: named(&combined.metrics),
            params: param_specs(combined),
            training,
            replicas: Vec::new(),
            partitions,
            instances: Vec::new(),
            report: None,
        }
    }

    /// Adds `instances` of its partitions, with their replicas' parameters and updates: each
    /// listed after its template's, as if every replica had been built.
    pub fn add_instances(&mut self, instances: Vec<dfc_ir::Instance>) {
        for instance in &instances {
            assert!((instance.template as usize) < self.partitions.len(), "an instance copies a partition of the plan");
        }
        let Some(first) = instances.first() else { return };
        let template = &self.partitions[first.template as usize];
        let template_device = template.device.to_string();
        let renamers: Vec<dfc_ir::Renamer> = instances
            .iter()
            .map(|i| dfc_ir::Renamer::new(i.template_replica, &template.device, i.replica, &i.device))
            .collect();
        if let Some(training) = &mut self.training {
            let with_copies = |names: &mut Vec<String>| {
                let mut all = Vec::with_capacity(names.len() * (instances.len() + 1));
                for name in names.drain(..) {
                    let copies: Vec<String> = renamers.iter().filter_map(|r| r.name(&name).ok()).collect();
                    all.push(name);
                    all.extend(copies);
                }
                *names = all;
            };
            with_copies(&mut training.updates);
            with_copies(&mut training.averages);
        }
        // Each copy of the template's (of each shard's, for a partitioned parameter) is followed by the instances'.
        for param in &mut self.params {
            let mut devices = Vec::with_capacity(param.devices.len() * (instances.len() + 1));
            for device in param.devices.drain(..) {
                let template = device == template_device;
                devices.push(device);
                if template {
                    devices.extend(instances.iter().map(|i| i.device.to_string()));
                }
            }
            param.devices = devices;
        }
        self.instances = instances;
    }

    /// Builds the partitions that `instances` describe and appends them to `partitions`; a
    /// plan whose copies would hold more than `MAX_INSTANCE_NODES` nodes is refused before
    /// any is made.
    pub fn expand_instances(&mut self) -> Result<(), String> {
        let instances = std::mem::take(&mut self.instances);
        if instances.len() > self.cluster.devices().len() {
            return Err(format!(
                "the plan has {} instances of partitions but its cluster only {} devices",
                instances.len(),
                self.cluster.devices().len()
            ));
        }
        let mut nodes = 0usize;
        for (i, instance) in instances.iter().enumerate() {
            let template = self.partitions.get(instance.template as usize).ok_or_else(|| {
                format!("instance {i} copies partition {}, which the plan does not have", instance.template)
            })?;
            nodes = nodes.saturating_add(template.module.graph.len());
        }
        if nodes > MAX_INSTANCE_NODES {
            return Err(format!(
                "the plan's instances would make {nodes} nodes, more than the {MAX_INSTANCE_NODES} a plan may hold"
            ));
        }
        self.partitions.reserve(instances.len());
        for instance in &instances {
            let template = &self.partitions[instance.template as usize];
            let module = dfc_ir::instantiate(&template.module, &template.device, instance)
                .map_err(|e| format!("instance of replica {} on {}: {e}", instance.replica, instance.device))?;
            self.partitions.push(Partition { device: instance.device.clone(), module });
        }
        Ok(())
    }

    /// The plan input that feeds the `Input` node `node`, and `node`'s share of its rows
    /// (`Some((input, r, R))`: rows `r·b .. (r+1)·b` of R), or `None` if no split input feeds it.
    pub fn split_of(&self, node: &str) -> Option<(&str, usize, usize)> {
        self.split_inputs.iter().find_map(|split| {
            let r = split.nodes.iter().position(|n| n == node)?;
            Some((split.input.as_str(), r, split.nodes.len()))
        })
    }

    /// `(plan input, Input node)` of replica `r`'s own share of every split input.
    pub fn replica_inputs(&self, r: usize) -> Vec<(String, String)> {
        let share = |split: &SplitInput| split.nodes.get(r).map(|node| (split.input.clone(), node.clone()));
        self.split_inputs.iter().filter_map(share).collect()
    }

    /// The nodes of partition `p` whose values a run of the plan may fetch: the partition's
    /// outputs and metrics, and the loss nodes (the plan's and every replica's) it holds. Code
    /// generation keeps them as kernel roots, so that their values are stored.
    pub fn kept_nodes(&self, p: usize) -> Vec<NodeId> {
        let module = &self.partitions[p].module;
        let graph = &module.graph;
        let losses: Vec<&str> = self
            .training
            .iter()
            .map(|t| t.loss_node.as_str())
            .chain(self.replicas.iter().map(|r| r.loss_node.as_str()))
            .collect();
        let mut keep: Vec<NodeId> = module.outputs.iter().chain(&module.metrics).map(|o| o.tensor.node).collect();
        keep.extend(graph.node_ids().filter(|&id| losses.contains(&graph.node(id).name.as_str())));
        keep
    }

    /// A plan that runs the whole of `module` on the local CPU. `module` must have passed
    /// `dfc_ir::verify`: its `inputs` and `params` name `Input` and `Variable` nodes.
    pub fn single_device(module: Module, source_name: &str, source_text: &str) -> Plan {
        let cluster = Cluster::local(1, DeviceKind::Cpu);
        let device = cluster.devices()[0].clone();
        let mut module = module;
        let ids: Vec<_> = module.graph.node_ids().collect();
        for id in ids {
            module.graph.node_mut(id).device = Some(device.clone());
        }
        let mut local = module.clone();
        local.training = None;
        let partitions = vec![Partition { device, module: local }];
        Plan::build(&module, partitions, cluster, StrategySpec::default(), source_name, source_text)
    }
}

/// The source's parameters: shards of one partitioned variable and replicas' copies count
/// once, under the source's name, with the devices of their parts.
fn param_specs(module: &Module) -> Vec<ParamSpec> {
    let graph = &module.graph;
    let mut specs: Vec<ParamSpec> = Vec::new();
    let mut by_name: HashMap<String, usize> = HashMap::new();
    for &id in &module.params {
        let node = graph.node(id);
        let Op::Variable { ty, init, trainable, partitions, origin } = &node.op else {
            panic!("module.params lists `{}`, which is not a variable", node.name);
        };
        let (name, full) = match origin {
            Some(o) => (o.name.clone(), TensorType::new(ty.dtype, o.shape.clone())),
            None => (node.name.clone(), ty.clone()),
        };
        let device = node.device.as_ref().map(|d| d.to_string());
        if let Some(spec) = by_name.get(&name).map(|&i| &mut specs[i]) {
            spec.devices.extend(device);
            if origin.as_ref().is_some_and(|o| o.mirror_of.is_none()) {
                spec.partitions += 1;
            }
            continue;
        }
        let is_shard = origin.as_ref().is_some_and(|o| o.mirror_of.is_none() && o.shape != ty.shape);
        by_name.insert(name.clone(), specs.len());
        specs.push(ParamSpec {
            name,
            bytes: tensor_bytes(&full),
            ty: full,
            init: init.clone(),
            trainable: *trainable,
            partitions: if is_shard { 1 } else { *partitions },
            requested_device: node.requested_device.as_ref().map(|d| d.to_string()),
            devices: device.into_iter().collect(),
        });
    }
    specs
}

/// The name a user knows a tensor by: a named output if one is that tensor, else its node.
fn tensor_name(module: &Module, tensor: TensorRef) -> String {
    if let Some(output) = module.outputs.iter().find(|o| o.tensor == tensor) {
        return output.name.clone();
    }
    let name = &module.graph.node(tensor.node).name;
    match tensor.port {
        0 => name.clone(),
        port => format!("{name}:{port}"),
    }
}

/// FNV-1a, 64 bit: a stable fingerprint of the source text (not a security measure; it only
/// tells whether a plan was compiled from this text).
pub fn source_hash(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, byte| (hash ^ byte as u64).wrapping_mul(0x0000_0100_0000_01b3))
}
