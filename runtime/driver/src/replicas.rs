//! Feeding the replicas of an asynchronous parameter-server plan, which have inputs of their
//! own (`Plan::replicas`) so that each can also train on its own batches: replica r of R takes
//! rows `r·b .. (r+1)·b` of a batch of `R·b`.

use crate::train::RunError;
use dfc_interp::Tensor;
use dfc_ir::Op;
use dfc_plan::{Plan, ReplicaSpec};
use std::borrow::Cow;
use std::collections::HashMap;

/// The feeds by `Input` node: each replica's own inputs their rows of the plan's inputs, and
/// every other feed as it is.
pub fn node_feeds<'f>(
    plan: &Plan,
    feeds: &'f HashMap<String, Tensor>,
) -> Result<Cow<'f, HashMap<String, Tensor>>, RunError> {
    let split_here = |name: &String| plan.replicas.iter().any(|r| r.inputs.iter().any(|(input, _)| input == name));
    if !feeds.keys().any(split_here) {
        return Ok(Cow::Borrowed(feeds));
    }
    let n = plan.replicas.len();
    // Feeds of nodes pass through.
    let mut split: HashMap<String, Tensor> =
        feeds.iter().filter(|(name, _)| !split_here(name)).map(|(k, v)| (k.clone(), v.clone())).collect();
    for (r, replica) in plan.replicas.iter().enumerate() {
        for (input, node) in &replica.inputs {
            let Some(whole) = feeds.get(input) else { continue };
            split.insert(node.clone(), rows_of_replica(whole, r, n)?);
        }
    }
    Ok(Cow::Owned(split))
}

/// Replica `r`'s rows of a batch for `n` replicas.
fn rows_of_replica(whole: &Tensor, r: usize, n: usize) -> Result<Tensor, RunError> {
    let mut size = whole.shape.dims().to_vec();
    let rows = size.first().copied().unwrap_or(0);
    if rows % n != 0 {
        return Err(RunError::Usage(format!("a batch of {rows} cannot be split among {n} replicas")));
    }
    size[0] = rows / n;
    let mut begin = vec![0; size.len()];
    begin[0] = r * size[0];
    Ok(dfc_interp::eval(&Op::Slice { begin, size }, &[whole])?)
}

/// The plan inputs that a program's `Input` nodes are fed from, in declaration order.
pub fn plan_inputs(plan: &Plan, nodes: Vec<String>) -> Vec<String> {
    let from = |node: String| {
        let replica_input = plan.replicas.iter().flat_map(|r| &r.inputs).find(|(_, n)| *n == node);
        replica_input.map_or(node, |(input, _)| input.clone())
    };
    let mut inputs: Vec<String> = nodes.into_iter().map(from).collect();
    let declared = |name: &String| plan.inputs.iter().position(|i| i.name == *name).unwrap_or(usize::MAX);
    inputs.sort_by_key(declared); // stable: undeclared ones keep their order
    inputs.dedup();
    inputs
}

/// A replica's batch (by plan input) as the feeds of its own `Input` nodes.
pub fn replica_feeds(replica: &ReplicaSpec, mut batch: HashMap<String, Tensor>) -> HashMap<String, Tensor> {
    replica.inputs.iter().filter_map(|(input, node)| Some((node.clone(), batch.remove(input)?))).collect()
}
