use crate::device::DeviceSpec;
use crate::infer::{infer, TypeError};
use crate::op::Op;
use crate::types::TensorType;
use dfc_diag::Span;
use petgraph::stable_graph::{NodeIndex, StableGraph};
use petgraph::visit::EdgeRef;
use petgraph::Direction;
use serde::{Deserialize, Serialize};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet};

/// A node's identity. Stable across removals of other nodes; printed renumbered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NodeId(u32);

impl NodeId {
    pub fn index(self) -> usize {
        self.0 as usize
    }

    fn from_petgraph(index: NodeIndex) -> NodeId {
        NodeId(index.index() as u32)
    }

    fn to_petgraph(self) -> NodeIndex {
        NodeIndex::new(self.0 as usize)
    }
}

/// One output of one node: what a data edge carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TensorRef {
    pub node: NodeId,
    pub port: u32,
}

impl From<NodeId> for TensorRef {
    fn from(node: NodeId) -> TensorRef {
        TensorRef { node, port: 0 }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Node {
    pub op: Op,
    /// Unique in the graph; `/` separates name scopes (`h1/w`, `hidden/matmul`).
    pub name: String,
    pub outputs: Vec<TensorType>,
    /// The device the source asked for (`@device`, `device "..." { }`), possibly partial.
    pub requested_device: Option<DeviceSpec>,
    /// The device placement chose. `None` until placement runs.
    pub device: Option<DeviceSpec>,
    /// A node this one must be placed with (TensorFlow's colocation): an optimizer's slot
    /// with its variable, a shard's gather with the shard.
    pub colocate_with: Option<NodeId>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Edge {
    /// Output `output` of the source feeds operand `input` of the target.
    Data { output: u32, input: u32 },
    /// The target runs after the source; nothing flows.
    Control,
}

/// A dataflow graph: nodes are ops, edges data or control dependencies. Source spans live in a
/// table beside the graph, not in the nodes.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Graph {
    #[serde(with = "wire")]
    graph: StableGraph<Node, Edge>,
    spans: BTreeMap<NodeId, Span>,
    /// Where a node's device request was written (the `@device` or `device` block), when the
    /// source wrote one: placement diagnostics point there.
    request_spans: BTreeMap<NodeId, Span>,
    #[serde(skip)]
    names: HashSet<String>,
    /// The next suffix to try per base name, so that naming n nodes alike is linear, not
    /// quadratic.
    #[serde(skip)]
    next_suffix: HashMap<String, usize>,
}

impl Graph {
    pub fn new() -> Graph {
        Graph::default()
    }

    /// An empty graph with room for `nodes` nodes and `edges` edges: building a large graph
    /// of known size without regrowing (and copying) its tables.
    pub fn with_capacity(nodes: usize, edges: usize) -> Graph {
        Graph { graph: StableGraph::with_capacity(nodes, edges), ..Graph::default() }
    }

    /// Adds a node whose output types are inferred from `inputs`. The name is made unique by a
    /// numeric suffix where needed.
    pub fn add(&mut self, op: Op, inputs: &[TensorRef], name: &str, span: Option<Span>) -> Result<NodeId, TypeError> {
        let types: Vec<&TensorType> = inputs.iter().map(|t| self.ty(*t)).collect();
        let outputs = infer(&op, &types)?;
        Ok(self.add_with_types(op, inputs, outputs, name, span))
    }

    /// Adds a node with the given output types, unchecked (the verifier checks them).
    pub fn add_with_types(
        &mut self,
        op: Op,
        inputs: &[TensorRef],
        outputs: Vec<TensorType>,
        name: &str,
        span: Option<Span>,
    ) -> NodeId {
        let name = self.unique_name(name);
        self.names.insert(name.clone());
        let node = Node { op, name, outputs, requested_device: None, device: None, colocate_with: None };
        let id = NodeId::from_petgraph(self.graph.add_node(node));
        for (i, input) in inputs.iter().enumerate() {
            self.graph.add_edge(
                input.node.to_petgraph(),
                id.to_petgraph(),
                Edge::Data { output: input.port, input: i as u32 },
            );
        }
        if let Some(span) = span {
            self.spans.insert(id, span);
        }
        id
    }

    /// `base`, or `base_1`, `base_2`, ... whichever is free.
    pub fn unique_name(&mut self, base: &str) -> String {
        self.refresh_names();
        self.free_name(base)
    }

    /// Drops the set of names after nodes were renamed in place; it is rebuilt when next needed.
    pub(crate) fn forget_names(&mut self) {
        self.names.clear();
        self.next_suffix.clear();
    }

    /// Rebuilds the set of names where it is stale (a graph read from a plan has none).
    fn refresh_names(&mut self) {
        if self.names.len() != self.graph.node_count() {
            self.names = self.graph.node_weights().map(|n| n.name.clone()).collect();
        }
    }

    /// `unique_name` on a set of names known to be current.
    fn free_name(&mut self, base: &str) -> String {
        let base = if base.is_empty() { "node" } else { base };
        if !self.names.contains(base) {
            return base.to_string();
        }
        let start = self.next_suffix.get(base).copied().unwrap_or(1);
        let (i, name) =
            (start..).map(|i| (i, format!("{base}_{i}"))).find(|(_, n)| !self.names.contains(n)).expect("unbounded");
        self.next_suffix.insert(base.to_string(), i + 1);
        name
    }

    /// Renames a node; the new name is made unique like `add` does. Returns the name given.
    pub fn rename(&mut self, id: NodeId, name: &str) -> String {
        // Refreshed first: once the old name is out, the set is one short of the nodes, which
        // would look stale and be rebuilt on every rename.
        self.refresh_names();
        let old = std::mem::take(&mut self.node_mut(id).name);
        self.names.remove(&old);
        let name = self.free_name(name);
        self.names.insert(name.clone());
        self.node_mut(id).name = name.clone();
        name
    }

    pub fn add_control_edge(&mut self, before: NodeId, after: NodeId) {
        self.graph.add_edge(before.to_petgraph(), after.to_petgraph(), Edge::Control);
    }

    /// Makes every operand that reads `old` read `new` instead, keeping its operand index;
    /// control edges stay where they are. Returns how many operands moved. The caller keeps the
    /// graph acyclic (`new` must not depend on a user of `old`) and the types equal.
    pub fn replace_uses(&mut self, old: TensorRef, new: TensorRef) -> usize {
        let moved: Vec<_> = self
            .graph
            .edges_directed(old.node.to_petgraph(), Direction::Outgoing)
            .filter_map(|e| match *e.weight() {
                Edge::Data { output, input } if output == old.port => Some((e.id(), e.target(), input)),
                _ => None,
            })
            .collect();
        for &(edge, target, input) in &moved {
            self.graph.remove_edge(edge);
            self.graph.add_edge(new.node.to_petgraph(), target, Edge::Data { output: new.port, input });
        }
        moved.len()
    }

    /// Many `set_input`s at once: each `(node, operand, tensor)` makes `tensor` that operand of
    /// the node. Linear in the graph's edges, where `set_input` one at a time walks the old
    /// source's list of edges each time: quadratic for a tensor with thousands of users (a
    /// learning rate all updates share, sent to each device).
    pub fn set_inputs(&mut self, changes: &[(NodeId, u32, TensorRef)]) {
        if changes.len() < 64 {
            for &(id, input, tensor) in changes {
                self.set_input(id, input, tensor);
            }
            return;
        }
        let mut moved: HashMap<(NodeId, u32), TensorRef> =
            changes.iter().map(|&(id, input, tensor)| ((id, input), tensor)).collect();
        let mut edges: Vec<(NodeIndex, NodeIndex, Edge)> = Vec::with_capacity(self.graph.edge_count());
        for e in self.graph.edge_indices() {
            let (source, target) = self.graph.edge_endpoints(e).expect("an edge of the graph");
            let weight = self.graph[e];
            match weight {
                Edge::Data { input, .. } => match moved.remove(&(NodeId::from_petgraph(target), input)) {
                    Some(t) => edges.push((t.node.to_petgraph(), target, Edge::Data { output: t.port, input })),
                    None => edges.push((source, target, weight)),
                },
                Edge::Control => edges.push((source, target, weight)),
            }
        }
        // Operands that had no edge yet.
        let mut added: Vec<_> = moved.into_iter().collect();
        added.sort_by_key(|((id, input), _)| (*id, *input));
        for ((id, input), t) in added {
            edges.push((t.node.to_petgraph(), id.to_petgraph(), Edge::Data { output: t.port, input }));
        }
        self.graph.clear_edges();
        for (source, target, weight) in edges {
            self.graph.add_edge(source, target, weight);
        }
    }

    /// Makes operand `input` of `id` read `tensor` instead (the caller keeps types equal and
    /// the graph acyclic).
    pub fn set_input(&mut self, id: NodeId, input: u32, tensor: TensorRef) {
        let old: Vec<_> = self
            .graph
            .edges_directed(id.to_petgraph(), Direction::Incoming)
            .filter(|e| matches!(*e.weight(), Edge::Data { input: i, .. } if i == input))
            .map(|e| e.id())
            .collect();
        for edge in old {
            self.graph.remove_edge(edge);
        }
        self.graph.add_edge(tensor.node.to_petgraph(), id.to_petgraph(), Edge::Data { output: tensor.port, input });
    }

    /// Removes the control edges from `before` to `after`.
    pub fn remove_control_edge(&mut self, before: NodeId, after: NodeId) {
        while let Some(edge) = self
            .graph
            .edges_connecting(before.to_petgraph(), after.to_petgraph())
            .find(|e| *e.weight() == Edge::Control)
            .map(|e| e.id())
        {
            self.graph.remove_edge(edge);
        }
    }

    /// Removes every data edge into `id`, keeping its control inputs: for replacing a node's op
    /// in place by one without operands (a folded constant).
    pub fn clear_inputs(&mut self, id: NodeId) {
        let edges: Vec<_> = self
            .graph
            .edges_directed(id.to_petgraph(), Direction::Incoming)
            .filter(|e| matches!(e.weight(), Edge::Data { .. }))
            .map(|e| e.id())
            .collect();
        for edge in edges {
            self.graph.remove_edge(edge);
        }
    }

    pub fn remove(&mut self, id: NodeId) -> Option<Node> {
        self.spans.remove(&id);
        self.request_spans.remove(&id);
        let node = self.graph.remove_node(id.to_petgraph())?;
        self.names.remove(&node.name);
        Some(node)
    }

    pub fn contains(&self, id: NodeId) -> bool {
        self.graph.contains_node(id.to_petgraph())
    }

    pub fn node(&self, id: NodeId) -> &Node {
        &self.graph[id.to_petgraph()]
    }

    pub fn node_mut(&mut self, id: NodeId) -> &mut Node {
        &mut self.graph[id.to_petgraph()]
    }

    /// The type of one output.
    pub fn ty(&self, tensor: TensorRef) -> &TensorType {
        &self.node(tensor.node).outputs[tensor.port as usize]
    }

    pub fn len(&self) -> usize {
        self.graph.node_count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every node, in creation order.
    pub fn node_ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.graph.node_indices().map(NodeId::from_petgraph)
    }

    /// Data operands in operand order. A malformed graph may have gaps or duplicates; the
    /// verifier reports those, `data_edges` shows them.
    pub fn inputs(&self, id: NodeId) -> Vec<TensorRef> {
        let mut edges = self.data_edges_into(id);
        edges.sort_by_key(|(input, _)| *input);
        edges.into_iter().map(|(_, tensor)| tensor).collect()
    }

    /// `(operand index, source)` of every data edge into `id`.
    pub fn data_edges_into(&self, id: NodeId) -> Vec<(u32, TensorRef)> {
        self.graph
            .edges_directed(id.to_petgraph(), Direction::Incoming)
            .filter_map(|e| match *e.weight() {
                Edge::Data { output, input } => {
                    Some((input, TensorRef { node: NodeId::from_petgraph(e.source()), port: output }))
                }
                Edge::Control => None,
            })
            .collect()
    }

    pub fn control_inputs(&self, id: NodeId) -> Vec<NodeId> {
        let mut before: Vec<NodeId> = self
            .graph
            .edges_directed(id.to_petgraph(), Direction::Incoming)
            .filter(|e| *e.weight() == Edge::Control)
            .map(|e| NodeId::from_petgraph(e.source()))
            .collect();
        before.sort();
        before
    }

    /// Nodes that use any output of `id`, by data or control edge, each once.
    pub fn users(&self, id: NodeId) -> Vec<NodeId> {
        let mut users: Vec<NodeId> =
            self.graph.neighbors_directed(id.to_petgraph(), Direction::Outgoing).map(NodeId::from_petgraph).collect();
        users.sort();
        users.dedup();
        users
    }

    pub fn span(&self, id: NodeId) -> Option<Span> {
        self.spans.get(&id).copied()
    }

    pub fn set_span(&mut self, id: NodeId, span: Span) {
        self.spans.insert(id, span);
    }

    /// Where the source asked for `id`'s device, if it did.
    pub fn request_span(&self, id: NodeId) -> Option<Span> {
        self.request_spans.get(&id).copied()
    }

    /// Sets `id`'s requested device and where it was asked for.
    pub fn request(&mut self, id: NodeId, device: Option<DeviceSpec>, at: Option<Span>) {
        self.node_mut(id).requested_device = device;
        match at {
            Some(span) => self.request_spans.insert(id, span),
            None => self.request_spans.remove(&id),
        };
    }

    /// `roots` and every node they depend on, through data and control edges.
    pub fn ancestors(&self, roots: &[NodeId]) -> std::collections::BTreeSet<NodeId> {
        let mut seen = std::collections::BTreeSet::new();
        let mut stack: Vec<NodeId> = roots.to_vec();
        while let Some(id) = stack.pop() {
            if seen.insert(id) {
                stack.extend(
                    self.graph.neighbors_directed(id.to_petgraph(), Direction::Incoming).map(NodeId::from_petgraph),
                );
            }
        }
        seen
    }

    /// A topological order, stable: among ready nodes the oldest comes first, so the same
    /// graph always prints the same. `Err` holds the nodes on or behind a cycle.
    pub fn topo_order(&self) -> Result<Vec<NodeId>, Vec<NodeId>> {
        // Pending operand counts by node index (a Vec: this runs after every pass).
        let mut pending: Vec<u32> = vec![0; petgraph::visit::NodeIndexable::node_bound(&self.graph)];
        let mut ready = BinaryHeap::new();
        for id in self.node_ids() {
            let n = self.graph.edges_directed(id.to_petgraph(), Direction::Incoming).count();
            if n == 0 {
                ready.push(Reverse(id));
            } else {
                pending[id.index()] = n as u32;
            }
        }
        let mut order = Vec::with_capacity(self.len());
        while let Some(Reverse(id)) = ready.pop() {
            order.push(id);
            for edge in self.graph.edges_directed(id.to_petgraph(), Direction::Outgoing) {
                let target = NodeId::from_petgraph(edge.target());
                let n = &mut pending[target.index()];
                *n -= 1;
                if *n == 0 {
                    ready.push(Reverse(target));
                }
            }
        }
        if order.len() == self.len() {
            Ok(order)
        } else {
            Err(self.node_ids().filter(|id| pending[id.index()] > 0).collect())
        }
    }
}

/// The graph's serialized form: its nodes in index order (`None` for a removed node's index,
/// so that node ids survive), then its edges by endpoints. Decoding checks every endpoint
/// instead of trusting the input: a plan file comes from outside, and petgraph's own
/// deserializer panics (a debug assertion) on inconsistent holes.
mod wire {
    use super::{Edge, Node};
    use crate::op::Op;
    use crate::types::{DType, TensorType};
    use petgraph::stable_graph::{NodeIndex, StableGraph};
    use petgraph::visit::{EdgeRef, IntoEdgeReferences};
    use serde::de::Error as _;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Serialize)]
    struct Borrowed<'a> {
        nodes: Vec<Option<&'a Node>>,
        edges: Vec<(u32, u32, &'a Edge)>,
    }

    #[derive(Deserialize)]
    struct Owned {
        nodes: Vec<Option<Node>>,
        edges: Vec<(u32, u32, Edge)>,
    }

    pub fn serialize<S: Serializer>(graph: &StableGraph<Node, Edge>, serializer: S) -> Result<S::Ok, S::Error> {
        let bound = graph.node_indices().map(|i| i.index() + 1).max().unwrap_or(0);
        let nodes = (0..bound).map(|i| graph.node_weight(NodeIndex::new(i))).collect();
        let edges = graph
            .edge_references()
            .map(|e| (e.source().index() as u32, e.target().index() as u32, e.weight()))
            .collect();
        Borrowed { nodes, edges }.serialize(serializer)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<StableGraph<Node, Edge>, D::Error> {
        let Owned { nodes, edges } = Owned::deserialize(deserializer)?;
        if nodes.len() >= u32::MAX as usize || edges.len() >= u32::MAX as usize {
            return Err(D::Error::custom("the graph has more nodes or edges than a graph can"));
        }
        let mut graph = StableGraph::with_capacity(nodes.len(), edges.len());
        let is_hole: Vec<bool> = nodes.iter().map(Option::is_none).collect();
        for node in nodes {
            // A removed node's index is taken by a placeholder, removed again below.
            graph.add_node(node.unwrap_or_else(placeholder));
        }
        for (source, target, edge) in edges {
            let [source, target] = [source, target].map(|i| NodeIndex::new(i as usize));
            let exists = |i: NodeIndex| is_hole.get(i.index()) == Some(&false);
            if !exists(source) || !exists(target) {
                return Err(D::Error::custom(format!(
                    "an edge joins node {} and node {}, which the graph does not both have",
                    source.index(),
                    target.index()
                )));
            }
            graph.add_edge(source, target, edge);
        }
        for (index, _) in is_hole.iter().enumerate().filter(|(_, &hole)| hole) {
            graph.remove_node(NodeIndex::new(index));
        }
        Ok(graph)
    }

    fn placeholder() -> Node {
        Node {
            op: Op::Input { ty: TensorType::new(DType::F32, Vec::<usize>::new()) },
            name: String::new(),
            outputs: Vec::new(),
            requested_device: None,
            device: None,
            colocate_with: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::DType;

    fn input(graph: &mut Graph, name: &str) -> NodeId {
        graph.add(Op::Input { ty: TensorType::new(DType::F32, vec![2]) }, &[], name, None).unwrap()
    }

    #[test]
    fn a_graph_with_removed_nodes_round_trips_with_its_ids() {
        let mut graph = Graph::new();
        let a = input(&mut graph, "a");
        let gone = input(&mut graph, "gone");
        let b = input(&mut graph, "b");
        let sum = graph.add(Op::Binary(crate::op::BinaryOp::Add), &[a.into(), b.into()], "sum", None).unwrap();
        graph.add_control_edge(a, sum);
        graph.remove(gone);
        let text = serde_json::to_string(&graph).unwrap();
        let back: Graph = serde_json::from_str(&text).unwrap();
        let ids: Vec<NodeId> = back.node_ids().collect();
        assert_eq!(ids, graph.node_ids().collect::<Vec<_>>());
        assert!(!back.contains(gone));
        for id in ids {
            assert_eq!(back.node(id), graph.node(id));
            assert_eq!(back.inputs(id), graph.inputs(id));
        }
        assert_eq!(serde_json::to_string(&back).unwrap(), text, "encoding again gives the same text");
    }

    /// Node lists and edges that do not fit (as a damaged or crafted plan has them) are errors,
    /// never a panic.
    #[test]
    fn edges_to_nodes_the_graph_lacks_are_errors() {
        let mut graph = Graph::new();
        let a = input(&mut graph, "a");
        let b = input(&mut graph, "b");
        graph.add(Op::Binary(crate::op::BinaryOp::Add), &[a.into(), b.into()], "sum", None).unwrap();
        graph.remove(b);
        let text = serde_json::to_string(&graph).unwrap();
        // The edge from `b` was removed with it; put one back, to the hole and past the end.
        for bad in [r#"[1,2,{"Data":{"output":0,"input":1}}]"#, r#"[9,2,{"Data":{"output":0,"input":1}}]"#] {
            let damaged = text.replacen(r#""edges":["#, &format!(r#""edges":[{bad},"#), 1);
            assert_ne!(damaged, text);
            let error = serde_json::from_str::<Graph>(&damaged).unwrap_err().to_string();
            assert!(error.contains("which the graph does not both have"), "{error}");
        }
    }
}
