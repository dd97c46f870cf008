//! Feeding replicas their shares of a batch: a plan's split inputs (`Plan::split_inputs`)
//! are fed to one `Input` node per replica, replica r of R taking rows `r·b .. (r+1)·b` of a
//! batch of `R·b`, so that each replica's worker receives its own rows from the driver.

use crate::train::RunError;
use dfc_interp::Tensor;
use dfc_plan::Plan;
use std::borrow::Cow;
use std::collections::HashMap;

/// The feeds by `Input` node: each split input's batch as its replicas' rows, and every other
/// feed as it is.
pub fn node_feeds<'f>(
    plan: &Plan,
    feeds: &'f HashMap<String, Tensor>,
) -> Result<Cow<'f, HashMap<String, Tensor>>, RunError> {
    let split_here = |name: &String| plan.split_inputs.iter().any(|s| s.input == *name);
    if !feeds.keys().any(split_here) {
        return Ok(Cow::Borrowed(feeds));
    }
    // Feeds of nodes pass through.
    let mut split: HashMap<String, Tensor> =
        feeds.iter().filter(|(name, _)| !split_here(name)).map(|(k, v)| (k.clone(), v.clone())).collect();
    for input in &plan.split_inputs {
        let Some(whole) = feeds.get(&input.input) else { continue };
        let n = input.nodes.len();
        for (r, node) in input.nodes.iter().enumerate() {
            split.insert(node.clone(), rows_of_replica(whole, r, n)?);
        }
    }
    Ok(Cow::Owned(split))
}

/// Replica `r`'s rows of a batch for `n` replicas: a copy of one contiguous run of it.
fn rows_of_replica(whole: &Tensor, r: usize, n: usize) -> Result<Tensor, RunError> {
    let rows = whole.shape.dims().first().copied().unwrap_or(0);
    if rows % n != 0 || whole.shape.rank() == 0 {
        return Err(RunError::Usage(format!("a batch of {rows} cannot be split among {n} replicas")));
    }
    let share = rows / n;
    Ok(whole.rows(r * share..(r + 1) * share))
}

/// The plan inputs that a program's `Input` nodes are fed from, in declaration order.
pub fn plan_inputs(plan: &Plan, nodes: Vec<String>) -> Vec<String> {
    let from = |node: String| plan.split_of(&node).map_or(node, |(input, ..)| input.to_string());
    let mut inputs: Vec<String> = nodes.into_iter().map(from).collect();
    let declared = |name: &String| plan.inputs.iter().position(|i| i.name == *name).unwrap_or(usize::MAX);
    inputs.sort_by_key(declared); // stable: undeclared ones keep their order
    inputs.dedup();
    inputs
}

/// Replica `r`'s batch (by plan input) as the feeds of its own `Input` nodes.
pub fn replica_feeds(plan: &Plan, r: usize, mut batch: HashMap<String, Tensor>) -> HashMap<String, Tensor> {
    let own = plan.replica_inputs(r);
    own.into_iter().filter_map(|(input, node)| Some((node, batch.remove(&input)?))).collect()
}
