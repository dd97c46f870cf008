//! What `decode` checks of a plan beyond its encoding, so that every reader (inspect, the
//! runtime, a worker's Register) may rely on it: a plan is data from outside, and a payload
//! with a valid checksum can still be crafted, or written by a buggy dfc.
//!
//! - every partition's module passes `dfc_ir::verify` with devices required (types are what
//!   the ops give, operands numbered, no cycle, constants of their shape, variables used
//!   through reads and assignments), and every node is on its partition's device, one
//!   partition per device of the plan's cluster;
//! - the partitions fit together (`dfc_ir::verify_partitions`: Send/Recv pairs, keys,
//!   all-reduce groups) and node names are unique across them;
//! - every tensor's size is a number of bytes this machine can address;
//! - the name-level interface resolves: inputs, outputs, metrics, the loss and the updates,
//!   and each replica's share of a split input, name nodes of the right kind and type.

use crate::Plan;
use dfc_ir::{Op, TensorType, VerifyOptions};
use std::collections::{HashMap, HashSet};

/// No tensor of a plan may be larger than this (2^48 bytes, 256 TiB): a larger one is a
/// damaged or crafted plan, and sizes below it cannot overflow the runtime's arithmetic.
pub const MAX_TENSOR_BYTES: u64 = 1 << 48;

pub(crate) fn validate(plan: &Plan) -> Result<(), String> {
    if plan.partitions.is_empty() {
        return Err("the plan has no partitions".into());
    }
    let cluster_devices = plan.cluster.devices();
    let mut devices = HashSet::new();
    for partition in &plan.partitions {
        let device = &partition.device;
        if !devices.insert(device) {
            return Err(format!("two partitions are on {device}"));
        }
        if !cluster_devices.contains(&device) {
            return Err(format!("partition {device} is on a device the plan's cluster does not have"));
        }
        let problems = dfc_ir::verify(&partition.module, VerifyOptions { require_devices: true });
        if let Some(first) = problems.first() {
            let node = first.node.filter(|&id| partition.module.graph.contains(id));
            let at = node.map(|id| format!(" at `{}`", partition.module.graph.node(id).name)).unwrap_or_default();
            let more = match problems.len() {
                1 => String::new(),
                n => format!(" (and {} more problems)", n - 1),
            };
            return Err(format!("partition {device} is not valid IR{at}: {first}{more}"));
        }
        check_sizes(partition)?;
    }
    let parts: Vec<_> = plan.partitions.iter().map(|p| (&p.device, &p.module)).collect();
    if let Some(problem) = dfc_ir::verify_partitions(&parts).into_iter().next() {
        return Err(format!("the partitions do not fit together: {problem}"));
    }
    check_interface(plan)
}

fn check_sizes(partition: &crate::Partition) -> Result<(), String> {
    let graph = &partition.module.graph;
    let sized = |ty: &TensorType| dfc_passes::cost::tensor_bytes(ty) <= MAX_TENSOR_BYTES;
    for id in graph.node_ids() {
        let node = graph.node(id);
        let mut declared = Vec::new();
        match &node.op {
            Op::Input { ty } | Op::Recv { ty, .. } => declared.push(ty.clone()),
            Op::Variable { ty, origin, .. } => {
                declared.push(ty.clone());
                // A shard or copy starts from its whole origin's initial value.
                declared.extend(origin.iter().map(|o| TensorType::new(ty.dtype, o.shape.clone())));
            }
            _ => {}
        }
        if let Some(ty) = node.outputs.iter().chain(&declared).find(|ty| !sized(ty)) {
            return Err(format!(
                "`{}` in partition {} has type {ty}, larger than any tensor can be",
                node.name, partition.device
            ));
        }
    }
    Ok(())
}

/// The name-level interface against the partitions.
fn check_interface(plan: &Plan) -> Result<(), String> {
    // Every node by name (unique across partitions), with its partition.
    let mut nodes: HashMap<&str, (usize, dfc_ir::NodeId)> = HashMap::new();
    for (p, partition) in plan.partitions.iter().enumerate() {
        let graph = &partition.module.graph;
        for id in graph.node_ids() {
            if nodes.insert(graph.node(id).name.as_str(), (p, id)).is_some() {
                return Err(format!("two partitions have a node `{}`", graph.node(id).name));
            }
        }
    }
    let node = |name: &str| nodes.get(name).map(|&(p, id)| plan.partitions[p].module.graph.node(id));
    let input_type = |name: &str| match node(name).map(|n| &n.op) {
        Some(Op::Input { ty }) => Some(ty),
        _ => None,
    };

    check_split_inputs(plan, &input_type)?;
    let split_inputs: HashSet<&str> = plan.split_inputs.iter().map(|s| s.input.as_str()).collect();
    for input in &plan.inputs {
        if split_inputs.contains(input.name.as_str()) {
            continue;
        }
        match input_type(&input.name) {
            Some(ty) if *ty == input.ty => {}
            Some(ty) => return Err(format!("input `{}` is declared {} but its node takes {ty}", input.name, input.ty)),
            None => return Err(format!("input `{}` names no input node", input.name)),
        }
    }

    let named: HashMap<&str, &TensorType> = plan
        .partitions
        .iter()
        .flat_map(|p| {
            p.module
                .outputs
                .iter()
                .chain(&p.module.metrics)
                .map(move |o| (o.name.as_str(), p.module.graph.ty(o.tensor)))
        })
        .collect();
    for (what, list) in [("output", &plan.outputs), ("metric", &plan.metrics)] {
        for item in list {
            match named.get(item.name.as_str()) {
                Some(ty) if **ty == item.ty => {}
                Some(ty) => return Err(format!("{what} `{}` is declared {} but is {ty}", item.name, item.ty)),
                None => return Err(format!("{what} `{}` is in no partition", item.name)),
            }
        }
    }

    let scalar_loss = |name: &str| {
        let ok =
            node(name).and_then(|n| n.outputs.first()).is_some_and(|ty| ty.shape.rank() == 0 && ty.dtype.is_float());
        if ok {
            Ok(())
        } else {
            Err(format!("the loss `{name}` is not a node with a floating-point scalar output"))
        }
    };
    let existing = |names: &[String], what: &str| match names.iter().find(|n| node(n).is_none()) {
        Some(missing) => Err(format!("{what} `{missing}` is in no partition")),
        None => Ok(()),
    };
    if let Some(training) = &plan.training {
        scalar_loss(&training.loss_node)?;
        existing(&training.updates, "the update")?;
        existing(&training.averages, "the average")?;
        match plan.strategy.sync_every {
            Some(0) => return Err("the strategy averages the replicas every 0 steps".into()),
            None if !training.averages.is_empty() => {
                return Err("the plan averages its replicas' variables but says not how often".into())
            }
            // Without float variables (a model with nothing to train) there is nothing to average.
            Some(_) if training.averages.is_empty() && has_float_variables(plan) => {
                return Err("the strategy averages the replicas' variables, but the plan has no averages".into())
            }
            _ => {}
        }
        if let Some(lr) = &training.learning_rate {
            let scalar = node(lr).and_then(|n| n.outputs.first()).is_some_and(|ty| ty.shape.rank() == 0);
            if !scalar {
                return Err(format!("the learning rate `{lr}` is not a node with a scalar output"));
            }
        }
    }
    let replicas = plan.replicas.len();
    let backups = plan.strategy.backup_workers as usize;
    if backups > 0 && !(plan.strategy.sync && replicas > backups && replicas == plan.strategy.replicas as usize) {
        return Err(format!(
            "the strategy keeps {backups} of its {} replicas as backups, but the plan has {replicas} that step on their own{}",
            plan.strategy.replicas,
            if plan.strategy.sync { "" } else { ", and asynchronous updates" }
        ));
    }
    if replicas > 0 && replicas != plan.strategy.replicas as usize {
        return Err(format!(
            "the plan has {replicas} replicas that step on their own, but its strategy {}",
            plan.strategy.replicas
        ));
    }
    for replica in &plan.replicas {
        scalar_loss(&replica.loss_node)?;
        existing(&replica.updates, "the update")?;
        let scalar = |name: &str| node(name).and_then(|n| n.outputs.first()).is_some_and(|ty| ty.shape.rank() == 0);
        if let Some(staleness) = replica.staleness.as_deref().filter(|s| !scalar(s)) {
            return Err(format!("the staleness `{staleness}` is not a node with a scalar output"));
        }
        match &replica.backup {
            Some(nodes) => {
                if backups == 0 {
                    return Err("a replica reports dropped gradients, but the plan has no backup workers".into());
                }
                let names = [&nodes.accepted, &nodes.applied, &nodes.version];
                if let Some(name) = names.into_iter().find(|n| !scalar(n)) {
                    return Err(format!("the backup workers' report `{name}` is not a node with a scalar output"));
                }
            }
            None if backups > 0 => {
                return Err("the plan has backup workers, but a replica does not report its dropped gradients".into())
            }
            None => {}
        }
    }
    Ok(())
}

/// Each split input is a declared input, split once, among one `Input` node per replica of
/// the strategy, each of its share's type and fed from no other.
fn check_split_inputs<'p>(plan: &'p Plan, input_type: &dyn Fn(&str) -> Option<&'p TensorType>) -> Result<(), String> {
    let replicas = plan.strategy.replicas as usize;
    let mut split = HashSet::new();
    let mut fed = HashSet::new();
    for crate::SplitInput { input, nodes } in &plan.split_inputs {
        let Some(whole) = plan.inputs.iter().find(|i| i.name == *input) else {
            return Err(format!("the replicas' input `{input}` is not one the plan declares"));
        };
        if !split.insert(input.as_str()) {
            return Err(format!("the input `{input}` is split among the replicas twice"));
        }
        if nodes.len() != replicas {
            return Err(format!(
                "the input `{input}` is split among {} nodes, but the strategy has {replicas} replicas",
                nodes.len()
            ));
        }
        let mut rows = whole.ty.shape.dims().to_vec();
        let fits = rows.first().is_some_and(|&n| n % replicas == 0);
        if let Some(first) = rows.first_mut() {
            *first /= replicas;
        }
        let share = TensorType::new(whole.ty.dtype, rows);
        for node_name in nodes {
            if !fed.insert(node_name.as_str()) {
                return Err(format!("the replicas' input node `{node_name}` is fed twice"));
            }
            let Some(ty) = input_type(node_name) else {
                return Err(format!("a replica's input `{node_name}` names no input node"));
            };
            if !fits || *ty != share {
                return Err(format!(
                    "a replica's input `{node_name}` takes {ty}, not its share of `{input}` ({})",
                    whole.ty
                ));
            }
        }
    }
    Ok(())
}

/// Whether any partition holds a float variable: one that local SGD would average.
fn has_float_variables(plan: &Plan) -> bool {
    plan.partitions.iter().any(|p| {
        let graph = &p.module.graph;
        graph.node_ids().any(|id| matches!(&graph.node(id).op, Op::Variable { ty, .. } if ty.dtype.is_float()))
    })
}
