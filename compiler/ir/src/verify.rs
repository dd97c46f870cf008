//! The IR verifier: checks every invariant and reports every violation, not the first.
//! It runs after every pass in tests and debug builds.

use crate::graph::{Graph, NodeId, TensorRef};
use crate::infer::infer;
use crate::module::Module;
use crate::op::Op;
use crate::types::TensorType;
use std::collections::{HashMap, HashSet};
use std::fmt;

#[derive(Clone, Copy, Debug, Default)]
pub struct VerifyOptions {
    /// After placement every node must have a device.
    pub require_devices: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerifyError {
    /// The node at fault, when one is.
    pub node: Option<NodeId>,
    pub message: String,
}

impl fmt::Display for VerifyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// Every broken invariant of `module`, or an empty list.
pub fn verify(module: &Module, options: VerifyOptions) -> Vec<VerifyError> {
    let graph = &module.graph;
    let mut errors = verify_graph(graph, options);
    let mut check_ref = |what: &str, t: TensorRef| {
        if !graph.contains(t.node) {
            errors.push(VerifyError { node: None, message: format!("{what} refers to a removed node") });
        } else if t.port as usize >= graph.node(t.node).outputs.len() {
            errors.push(VerifyError { node: Some(t.node), message: format!("{what} refers to a missing output") });
        }
    };
    for output in &module.outputs {
        check_ref(&format!("output `{}`", output.name), output.tensor);
    }
    for metric in &module.metrics {
        check_ref(&format!("metric `{}`", metric.name), metric.tensor);
    }
    if let Some(training) = &module.training {
        check_ref("the loss", training.loss);
        for (variable, gradient) in &training.gradients {
            check_ref("a gradient", *gradient);
            check_ref("a gradient's variable", (*variable).into());
        }
        for update in &training.updates {
            check_ref("an update", (*update).into());
        }
        for average in &training.averages {
            check_ref("an average", (*average).into());
        }
    }
    for &id in &module.inputs {
        if !graph.contains(id) || !matches!(graph.node(id).op, Op::Input { .. }) {
            errors.push(VerifyError { node: None, message: "a module input is not an input node".into() });
        }
    }
    for &id in &module.params {
        if !graph.contains(id) || !matches!(graph.node(id).op, Op::Variable { .. }) {
            errors.push(VerifyError { node: None, message: "a module parameter is not a variable node".into() });
        }
    }
    if let Some(training) = &module.training {
        if graph.contains(training.loss.node) {
            let loss = graph.ty(training.loss);
            if loss.shape.rank() != 0 || !loss.dtype.is_float() {
                errors.push(VerifyError {
                    node: Some(training.loss.node),
                    message: format!("the loss must be a floating-point scalar, not {loss}"),
                });
            }
        }
    }
    errors
}

pub fn verify_graph(graph: &Graph, options: VerifyOptions) -> Vec<VerifyError> {
    let mut errors = Vec::new();
    let mut error = |node: NodeId, message: String| errors.push(VerifyError { node: Some(node), message });

    if let Err(cyclic) = graph.topo_order() {
        let names: Vec<&str> = cyclic.iter().take(5).map(|id| graph.node(*id).name.as_str()).collect();
        error(cyclic[0], format!("the graph has a cycle through {}", names.join(", ")));
    }

    let mut names: HashMap<&str, NodeId> = HashMap::new();
    for id in graph.node_ids() {
        let node = graph.node(id);
        if let Some(first) = names.insert(&node.name, id) {
            error(id, format!("the name `{}` is also used by another node ({first:?})", node.name));
        }

        // Operands: every index 0..n exactly once, each from an existing output.
        let mut edges = graph.data_edges_into(id);
        edges.sort_by_key(|(input, _)| *input);
        let mut seen = HashSet::new();
        for (input, source) in &edges {
            if !seen.insert(*input) {
                error(id, format!("operand {input} is connected twice"));
            }
            if source.port as usize >= graph.node(source.node).outputs.len() {
                error(id, format!("operand {input} reads output {} of a node that has fewer", source.port));
            }
        }
        let n_inputs = edges.len();
        if seen.len() == n_inputs && (0..n_inputs as u32).any(|i| !seen.contains(&i)) {
            error(id, "the operands are not numbered 0..n".into());
        }
        match node.op.arity() {
            Some(arity) if arity != n_inputs => {
                error(id, format!("`{}` takes {arity} operand(s) but has {n_inputs}", node.op.name()));
                continue;
            }
            _ => {}
        }

        // Stateful operands: `read` and the assignments act on a variable itself.
        if matches!(node.op, Op::Read | Op::Assign | Op::AssignAdd | Op::AssignSub) {
            if let Some((_, target)) = edges.iter().find(|(input, _)| *input == 0) {
                if !matches!(graph.node(target.node).op, Op::Variable { .. }) {
                    error(id, format!("`{}` must act on a variable", node.op.name()));
                }
            }
        }
        for (input, source) in &edges {
            let is_variable = matches!(graph.node(source.node).op, Op::Variable { .. });
            let takes_variable =
                *input == 0 && matches!(node.op, Op::Read | Op::Assign | Op::AssignAdd | Op::AssignSub);
            if is_variable && !takes_variable {
                error(id, format!("operand {input} uses a variable directly; read it first"));
            }
        }

        // Types: the stored output types are what the op gives for these operands.
        if edges.iter().all(|(_, s)| (s.port as usize) < graph.node(s.node).outputs.len()) {
            let operand_types: Vec<&TensorType> = graph.inputs(id).iter().map(|t| graph.ty(*t)).collect();
            match infer(&node.op, &operand_types) {
                Ok(types) if types != node.outputs => {
                    let want: Vec<String> = types.iter().map(|t| t.to_string()).collect();
                    let have: Vec<String> = node.outputs.iter().map(|t| t.to_string()).collect();
                    error(id, format!("output type {} should be {}", have.join(", "), want.join(", ")));
                }
                Ok(_) => {}
                Err(e) => error(id, format!("ill-typed: {}", e.message)),
            }
        }

        if let Op::Const { value } = &node.op {
            if value.len() != value.shape.n_elements() {
                error(id, format!("the constant holds {} values for the shape {}", value.len(), value.shape));
            }
        }

        if matches!(node.op, Op::BatchNorm { .. })
            && !options.require_devices
            && !normalises_with_own_moments(graph, id)
        {
            error(
                id,
                format!(
                    "`{}` normalises with moments that are not its input's (nor selected by the training flag)",
                    node.name
                ),
            );
        }
        if options.require_devices && node.device.is_none() {
            error(id, format!("`{}` has no device", node.name));
        }
        if options.require_devices && matches!(node.op, Op::CrossReplicaMean) {
            error(id, format!("`{}` is a cross-replica mean left after replication", node.name));
        }
    }
    errors
}

/// Whether a `BatchNorm`'s moments are the batch's, or chosen between those and others by the
/// training flag: `Moments` of its own input itself or, synchronized, computed from it (through
/// the cross-replica means). Autodiff's gradient is the one through the batch's own moments,
/// so that is what a training step must normalise with. (Placement may put the two apart, so
/// placed modules are not held to it.)
fn normalises_with_own_moments(graph: &Graph, id: NodeId) -> bool {
    let operands = graph.inputs(id);
    let [x, moments] = operands[..] else { return false };
    let synchronized = matches!(graph.node(id).op, Op::BatchNorm { synchronized: true, .. });
    let is_own = |t: crate::TensorRef| matches!(graph.node(t.node).op, Op::Moments) && graph.inputs(t.node)[..] == [x];
    let batch = match graph.node(moments.node).op {
        Op::Select => {
            let choice = graph.inputs(moments.node);
            if choice.len() != 3 || !matches!(graph.node(choice[0].node).op, Op::TrainingFlag) {
                return false;
            }
            choice[1]
        }
        _ => moments,
    };
    if !synchronized {
        return is_own(batch);
    }
    // The batch's moments of all replicas: computed from this input's `Moments`.
    let mut seen = HashSet::new();
    let mut next = vec![batch];
    while let Some(t) = next.pop() {
        if is_own(t) {
            return true;
        }
        if seen.insert(t.node) {
            next.extend(graph.inputs(t.node));
        }
    }
    false
}

/// The invariants of a partitioned plan: every node of a partition is on its device; every
/// Send has exactly one Recv with its key, on the device it names, of its tensor's type, and
/// the other way round; keys are unique; each all-reduce group has one member per replica
/// index, all of one type. Partitions share no nodes, so a tensor of another partition can
/// only be reached through these pairs.
pub fn verify_partitions(parts: &[(&crate::DeviceSpec, &Module)]) -> Vec<VerifyError> {
    use crate::DeviceSpec;
    let mut errors = Vec::new();
    let mut sends: HashMap<&str, (&DeviceSpec, &DeviceSpec, &TensorType)> = HashMap::new();
    let mut recvs: HashMap<&str, (&DeviceSpec, &DeviceSpec, &TensorType, &str)> = HashMap::new();
    let mut groups: HashMap<&str, Vec<(u32, u32, &TensorType)>> = HashMap::new();
    let mut error = |message: String| errors.push(VerifyError { node: None, message });
    for (device, module) in parts {
        let graph = &module.graph;
        for id in graph.node_ids() {
            let node = graph.node(id);
            if node.device.as_ref() != Some(*device) {
                error(format!("`{}` is in the partition of {device} but placed on {:?}", node.name, node.device));
            }
            match &node.op {
                Op::Send { key, to } => {
                    let Some(operand) = graph.inputs(id).first().copied() else { continue };
                    if sends.insert(key, (device, to, graph.ty(operand))).is_some() {
                        error(format!("two Sends have the key `{key}`"));
                    }
                    if to == *device {
                        error(format!("`{}` sends to its own device", node.name));
                    }
                }
                Op::Recv { key, from, ty } if recvs.insert(key, (from, device, ty, &node.name)).is_some() => {
                    error(format!("two Recvs have the key `{key}`"));
                }
                Op::AllReduce { key, group_size, replica } => {
                    let Some(ty) = node.outputs.first() else { continue };
                    groups.entry(key).or_default().push((*replica, *group_size, ty));
                }
                _ => {}
            }
        }
    }
    for (key, (from, to, ty)) in &sends {
        match recvs.get(key) {
            None => error(format!("the Send `{key}` has no Recv")),
            Some((rfrom, rto, rty, _)) => {
                if rfrom != from || rto != to {
                    error(format!("the Recv of `{key}` expects {rfrom} → {rto}, but the Send goes {from} → {to}"));
                }
                if rty != ty {
                    error(format!("the Recv of `{key}` expects {rty}, but the Send sends {ty}"));
                }
            }
        }
    }
    for (key, (.., name)) in &recvs {
        if !sends.contains_key(key) {
            error(format!("`{name}` receives `{key}`, which no partition sends"));
        }
    }
    for (key, members) in &groups {
        let size = members[0].1;
        let mut replicas: Vec<u32> = members.iter().map(|m| m.0).collect();
        replicas.sort();
        // The length first: a group size read from a damaged plan may be anything.
        let numbered = replicas.len() == size as usize && replicas.iter().enumerate().all(|(i, &r)| r as usize == i);
        if !numbered || members.iter().any(|m| m.1 != size || m.2 != members[0].2) {
            error(format!(
                "the all-reduce `{key}` does not have one member of one type for each of its {size} replicas"
            ));
        }
    }
    errors
}
