//! Pipeline stages: the `model` strategy with micro-batches (`--micro-batches M`, GPipe).
//!
//! `assign_stages` runs on one micro-batch's training module, before replication makes its
//! copies, and requests each node on its stage's device, so that every micro-batch's copy of a
//! node runs on one stage:
//!
//! - The forward pass's compute (what the loss, outputs and metrics need, but for inputs,
//!   constants, variables and their reads) is cut, in topological order, into one contiguous
//!   run per device, each of about the same cost: a node's time in the cost model (from this
//!   host's profile where it has one, else its FLOPs at the assumed rate) and that of the
//!   backward nodes that differentiate it.
//! - A variable and its reads are on the stage of the variable's first forward use; an input
//!   or a constant on its first user's.
//! - Every other node (the backward pass, the optimizer's update) is on the stage of what it
//!   derives from: the node its name is scoped under (autodiff names a gradient
//!   `gradients/<node>/…`, the optimizer an update `<variable>/update/…`), else the node it is
//!   colocated with, else its latest operand's.

use crate::cost::{self, CostModel};
use dfc_ir::{DeviceSpec, Module, NodeId, Op};
use std::collections::{HashMap, HashSet};

/// Requests every node of `module` on one of `devices`, its pipeline stage (see the module's
/// comment). Nothing is requested where `devices` is empty.
pub fn assign_stages(module: &mut Module, devices: &[DeviceSpec], model: &CostModel) {
    let Some(stages) = stages(module, devices.len(), model) else { return };
    for (id, stage) in stages {
        let device = devices[stage].clone();
        module.graph.request(id, Some(device), None);
    }
}

/// Each node's stage of `n`, or `None` for a module that is not a training module or an empty
/// pipeline.
fn stages(module: &Module, n: usize, model: &CostModel) -> Option<HashMap<NodeId, usize>> {
    let training = module.training.as_ref()?;
    if n == 0 {
        return None;
    }
    let graph = &module.graph;
    let order = graph.topo_order().ok()?;
    let mut roots = vec![training.loss.node];
    roots.extend(module.outputs.iter().chain(&module.metrics).map(|o| o.tensor.node));
    let forward: HashSet<NodeId> = graph.ancestors(&roots).into_iter().collect();
    let by_name: HashMap<&str, NodeId> = order.iter().map(|&id| (graph.node(id).name.as_str(), id)).collect();
    let is_source =
        |id: NodeId| matches!(graph.node(id).op, Op::Input { .. } | Op::Const { .. } | Op::Variable { .. } | Op::Read);

    // The forward node each other node derives from by its name, where there is one.
    let scope_of = |id: NodeId| -> Option<NodeId> {
        let name = graph.node(id).name.as_str();
        let name = name.strip_prefix("gradients/").unwrap_or(name);
        let mut end = name.len();
        while let Some(slash) = name[..end].rfind('/') {
            end = slash;
            if let Some(&owner) = by_name.get(&name[..end]) {
                return (owner != id).then_some(owner);
            }
        }
        by_name.get(name).copied().filter(|&owner| owner != id && forward.contains(&owner))
    };

    // The forward compute's weights: its own time and its backward nodes'. A node of no time
    // (one inside a fused kernel, whose root has the kernel's) weighs a nanosecond, so that
    // every node has a place in the cut.
    let profiled = model.profile.as_ref().map(|p| cost::profiled_seconds(module, p.full()));
    let seconds = |id: NodeId| {
        let s = match &profiled {
            Some(times) => times.get(id.index()).copied().unwrap_or(0.0),
            None => cost::node_flops(graph, id) / model.flops_per_second,
        };
        if s.is_finite() {
            s.max(1e-9)
        } else {
            1e-9
        }
    };
    let mut weight: HashMap<NodeId, f64> = HashMap::new();
    for &id in &order {
        let owner = if forward.contains(&id) { Some(id) } else { scope_of(id).filter(|o| forward.contains(o)) };
        if let Some(owner) = owner.filter(|&o| !is_source(o)) {
            *weight.entry(owner).or_default() += seconds(id);
        }
    }
    let compute: Vec<NodeId> = order.iter().copied().filter(|id| forward.contains(id) && !is_source(*id)).collect();
    let total: f64 = compute.iter().map(|id| weight[id]).sum();
    let mut stage: HashMap<NodeId, usize> = HashMap::new();
    let mut before = 0.0;
    for &id in &compute {
        let middle = before + weight[&id] / 2.0;
        stage.insert(id, ((middle / total * n as f64) as usize).min(n - 1));
        before += weight[&id];
    }

    // Variables with their first forward use; inputs and constants with their first user.
    let first_user = |id: NodeId, stage: &HashMap<NodeId, usize>| -> Option<usize> {
        graph.users(id).into_iter().filter_map(|u| stage.get(&u).copied()).min()
    };
    for &id in &order {
        if let Op::Variable { .. } = graph.node(id).op {
            let reads: Vec<NodeId> =
                graph.users(id).into_iter().filter(|&r| matches!(graph.node(r).op, Op::Read)).collect();
            let used = reads.iter().filter_map(|&r| first_user(r, &stage)).min();
            if let Some(s) = used {
                stage.insert(id, s);
                for read in reads {
                    stage.insert(read, s);
                }
            }
        }
    }
    for &id in order.iter().rev() {
        if matches!(graph.node(id).op, Op::Input { .. } | Op::Const { .. }) {
            if let Some(s) = first_user(id, &stage) {
                stage.insert(id, s);
            }
        }
    }
    // The rest in order: by scope, colocation, then operands.
    for &id in &order {
        if stage.contains_key(&id) {
            continue;
        }
        let node = graph.node(id);
        let derived = scope_of(id)
            .and_then(|owner| stage.get(&owner).copied())
            .or_else(|| node.colocate_with.and_then(|with| stage.get(&with).copied()))
            .or_else(|| graph.inputs(id).iter().filter_map(|t| stage.get(&t.node).copied()).max());
        stage.insert(id, derived.unwrap_or(0));
    }
    // A variable's reads and assignments live with it (placement colocates them).
    for &id in &order {
        if let Op::Read | Op::Assign | Op::AssignAdd | Op::AssignSub = graph.node(id).op {
            let variable = graph.inputs(id)[0].node;
            if let Some(&s) = stage.get(&variable) {
                stage.insert(id, s);
            }
        }
    }
    Some(stage)
}
