//! Where a plan's nodes are in its `.df` source, for messages: `at mlp.df:21` when the working
//! directory holds the file the plan was compiled from (same name, same hash), else the node's
//! name and the source's name. A plan carries spans (byte ranges), not the source text.

use std::path::Path;

use dfc_diag::LineIndex;
use dfc_ir::{Graph, NodeId};
use dfc_plan::Plan;

/// A plan's source, as far as it is at hand.
pub(crate) struct PlanSource {
    name: String,
    /// The text and its lines, when the working directory has the file.
    text: Option<(String, LineIndex)>,
}

impl PlanSource {
    pub(crate) fn of(plan: &Plan) -> PlanSource {
        let text = source_text(plan).map(|text| {
            let lines = LineIndex::new(&text);
            (text, lines)
        });
        PlanSource { name: plan.source_name.clone(), text }
    }

    /// `at FILE:LINE` of `node` of `graph`, or `(node `NAME` of FILE)` where the source (or
    /// the node's span) is not at hand.
    pub(crate) fn location(&self, graph: &Graph, node: NodeId) -> String {
        let name = &self.name;
        match (graph.span(node), &self.text) {
            (Some(span), Some((text, lines))) => {
                format!("at {name}:{}", lines.line_col(text, span.start as usize).line)
            }
            _ => format!("(node `{}` of {name})", graph.node(node).name),
        }
    }
}

impl PlanSource {
    /// `` `NAME` at FILE:LINE `` of `node`, or `` `NAME` of FILE `` where the source is not at
    /// hand: what a message calls the op.
    pub(crate) fn describe(&self, graph: &Graph, node: NodeId) -> String {
        let (name, file) = (&graph.node(node).name, &self.name);
        match (graph.span(node), &self.text) {
            (Some(span), Some((text, lines))) => {
                format!("`{name}` at {file}:{}", lines.line_col(text, span.start as usize).line)
            }
            _ => format!("`{name}` of {file}"),
        }
    }
}

/// The text of the plan's source, if the working directory holds the file it was compiled
/// from (same name, same hash). The name comes from the plan: only a regular file of a
/// source's size is read (not a FIFO that would never answer, nor `/dev/zero`).
fn source_text(plan: &Plan) -> Option<String> {
    let path = Path::new(&plan.source_name);
    let bytes = dfc_diag::read::read_regular_at_most(path, dfc_diag::read::MAX_SOURCE_BYTES).ok()?;
    let text = String::from_utf8(bytes).ok()?;
    (dfc_plan::source_hash(&text) == plan.source_hash).then_some(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loss_node(plan: &Plan) -> (&Graph, NodeId) {
        let graph = &plan.partitions[0].module.graph;
        let loss = graph.node_ids().find(|&id| graph.node(id).name == "loss").expect("a loss node");
        (graph, loss)
    }

    /// With the source at hand, a node is named with its line; without it (another file of
    /// that name, or none), with the source's name only.
    #[test]
    fn nodes_are_described_with_their_line_when_the_source_is_at_hand() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/mlp.df");
        let text = std::fs::read_to_string(path).expect("the example");
        let line = text.lines().position(|l| l.trim_start().starts_with("let loss")).expect("a loss line") + 1;
        let plan = dfc_compile::compile(&text, path, &dfc_compile::CompileOptions::default()).expect("compiles").plan;
        let (graph, loss) = loss_node(&plan);
        assert_eq!(PlanSource::of(&plan).describe(graph, loss), format!("`loss` at {path}:{line}"));

        let edited = text.replace("let loss", "let  loss");
        let stale =
            dfc_compile::compile(&edited, path, &dfc_compile::CompileOptions::default()).expect("compiles").plan;
        let (graph, loss) = loss_node(&stale);
        assert_eq!(PlanSource::of(&stale).describe(graph, loss), format!("`loss` of {path}"));
    }
}
