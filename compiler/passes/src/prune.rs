//! Pruning for a run, as TensorFlow's `PruneForTargets`: a step that fetches some tensors and
//! runs some nodes for their effect needs only their ancestors, through data and control edges.
//! `prune` returns a new module holding just those nodes; the module's interface (inputs,
//! parameters, outputs, metrics, training) is filtered to what survives.
//!
//! Feeding and fetching the same tensor is refused, as TensorFlow refuses it: here only inputs
//! are fed, so every fed name must be an input of the module, and no fetch may be a fed input.

use dfc_ir::{Module, NodeId, Op, TensorRef};
use std::collections::BTreeSet;
use std::fmt;

/// Why a set of feeds, fetches and targets cannot be run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PruneError {
    /// A fed name is not an input of the module.
    UnknownFeed { name: String },
    /// A fetched tensor is an input that is also fed.
    FedAndFetched { input: String },
    /// A fetch names a node that does not exist or an output it does not have.
    UnknownFetch { node: NodeId, port: u32 },
    /// A target names a node that does not exist.
    UnknownTarget { node: NodeId },
}

impl fmt::Display for PruneError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PruneError::UnknownFeed { name } => write!(f, "`{name}` is fed but is not an input of the model"),
            PruneError::FedAndFetched { input } => {
                write!(f, "the input `{input}` is both fed and fetched; fetch what is computed from it instead")
            }
            PruneError::UnknownFetch { node, port } => {
                write!(f, "the fetched tensor {}:{port} is not in the graph", node.index())
            }
            PruneError::UnknownTarget { node } => write!(f, "the target node {} is not in the graph", node.index()),
        }
    }
}

impl std::error::Error for PruneError {}

/// The part of `module` that fetching `fetches` and running `targets` needs, with the inputs
/// named in `feeds` fed. Node ids of the surviving nodes are unchanged.
pub fn prune(
    module: &Module,
    feeds: &[String],
    fetches: &[TensorRef],
    targets: &[NodeId],
) -> Result<Module, PruneError> {
    let graph = &module.graph;
    let input_name = |id: NodeId| match graph.node(id).op {
        Op::Input { .. } => Some(graph.node(id).name.as_str()),
        _ => None,
    };
    let inputs: BTreeSet<&str> = graph.node_ids().filter_map(input_name).collect();
    if let Some(name) = feeds.iter().find(|name| !inputs.contains(name.as_str())) {
        return Err(PruneError::UnknownFeed { name: name.clone() });
    }
    for fetch in fetches {
        if !graph.contains(fetch.node) || fetch.port as usize >= graph.node(fetch.node).outputs.len() {
            return Err(PruneError::UnknownFetch { node: fetch.node, port: fetch.port });
        }
        if let Some(name) = input_name(fetch.node).filter(|name| feeds.iter().any(|f| f == name)) {
            return Err(PruneError::FedAndFetched { input: name.to_string() });
        }
    }
    if let Some(&node) = targets.iter().find(|t| !graph.contains(**t)) {
        return Err(PruneError::UnknownTarget { node });
    }

    let roots: Vec<NodeId> = fetches.iter().map(|t| t.node).chain(targets.iter().copied()).collect();
    let keep = graph.ancestors(&roots);
    let mut pruned = module.clone();
    let unneeded: Vec<NodeId> = graph.node_ids().filter(|id| !keep.contains(id)).collect();
    for id in unneeded {
        pruned.graph.remove(id);
    }

    let alive = |id: NodeId| keep.contains(&id);
    pruned.inputs.retain(|&id| alive(id));
    pruned.params.retain(|&id| alive(id));
    pruned.outputs.retain(|o| alive(o.tensor.node));
    pruned.metrics.retain(|m| alive(m.tensor.node));
    if pruned.training.as_ref().is_some_and(|t| !alive(t.loss.node)) {
        pruned.training = None;
    }
    if let Some(training) = &mut pruned.training {
        training.gradients.retain(|(variable, gradient)| alive(*variable) && alive(gradient.node));
        training.updates.retain(|&id| alive(id));
    }
    Ok(pruned)
}
