//! The graph as Graphviz DOT, for `dfc graph`: nodes filled by device (the one placement chose,
//! else the one the source asked for), name scopes drawn as nested boxes, control edges dashed,
//! transfers between devices (Send → Recv) bold red with their size, all-reduces as octagons.
//! Scopes deeper than `collapse_depth` fold into one node each, so a large graph stays readable.

use crate::graph::{NodeId, TensorRef};
use crate::module::Module;
use crate::op::Op;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write;

#[derive(Clone, Copy, Debug, Default)]
pub struct DotOptions {
    /// Fold every name scope nested deeper than this into a single node (`None`: fold nothing).
    pub collapse_depth: Option<usize>,
}

/// Fill colours for devices, in order of first appearance.
const PALETTE: &[&str] =
    &["#a6cee3", "#b2df8a", "#fdbf6f", "#cab2d6", "#fb9a99", "#ffff99", "#1f78b4", "#33a02c", "#e31a1c", "#ff7f00"];

/// What one drawn node stands for: a node of the graph, or a folded scope.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Box_ {
    Node(NodeId),
    /// A folded scope's nodes on one device.
    Scope(String, Option<String>),
}

pub fn to_dot(module: &Module, options: &DotOptions) -> String {
    let graph = &module.graph;
    let order: Vec<NodeId> = graph.topo_order().unwrap_or_else(|_| graph.node_ids().collect());
    let number: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, id)| (*id, i)).collect();

    let device_of = |id: NodeId| -> Option<String> {
        let node = graph.node(id);
        Some(node.device.as_ref().or(node.requested_device.as_ref())?.to_string())
    };

    // Which drawn box each node belongs to: a folded scope splits by device, so every box has
    // one colour; a scope that would fold one node shows the node.
    let mut members: BTreeMap<Box_, Vec<NodeId>> = BTreeMap::new();
    for &id in &order {
        let scopes = scopes(&graph.node(id).name);
        let drawn = match options.collapse_depth {
            Some(depth) if scopes.len() > depth => Box_::Scope(scopes[depth].clone(), device_of(id)),
            _ => Box_::Node(id),
        };
        members.entry(drawn).or_default().push(id);
    }
    let singletons: Vec<Box_> =
        members.iter().filter(|(b, n)| matches!(b, Box_::Scope(..)) && n.len() == 1).map(|(b, _)| b.clone()).collect();
    for scope in singletons {
        let nodes = members.remove(&scope).expect("listed");
        members.insert(Box_::Node(nodes[0]), nodes);
    }
    let assigned: HashMap<NodeId, Box_> =
        members.iter().flat_map(|(b, nodes)| nodes.iter().map(move |n| (*n, b.clone()))).collect();
    let box_of = |id: NodeId| -> Box_ { assigned[&id].clone() };

    // Devices in order of first appearance, each with its colour.
    let mut colours: BTreeMap<String, &str> = BTreeMap::new();
    for &id in &order {
        if let Some(device) = device_of(id) {
            let next = PALETTE[colours.len() % PALETTE.len()];
            colours.entry(device).or_insert(next);
        }
    }

    // A node whose name is also a scope (`h1/w` beside `h1/w/read`) is drawn inside it.
    let all_scopes: BTreeSet<String> = order.iter().flat_map(|&id| scopes(&graph.node(id).name)).collect();
    // Boxes nest in the scope tree: each box sits in the scope that encloses it.
    let mut tree = ScopeTree::default();
    let mut lines: BTreeMap<Box_, String> = BTreeMap::new();
    for (drawn, nodes) in &members {
        let first = nodes[0];
        let (id, label, enclosing, device) = match drawn {
            Box_::Node(id) => {
                let node = graph.node(*id);
                let types: Vec<String> = node.outputs.iter().map(|t| t.to_string()).collect();
                let short = node.name.rsplit('/').next().unwrap_or(&node.name).to_string();
                let label = format!("{short}\\n{} {}", node.op.name(), types.join(", "));
                let enclosing = if all_scopes.contains(&node.name) {
                    Some(node.name.clone())
                } else {
                    scopes(&node.name).last().cloned()
                };
                (format!("n{}", number[id]), label, enclosing, device_of(*id))
            }
            Box_::Scope(scope, device) => {
                let label = format!("{}/…\\n{} nodes", scope.rsplit('/').next().unwrap_or(scope), nodes.len());
                let parent = scope.rsplit_once('/').map(|(p, _)| p.to_string());
                (format!("s{}", number[&first]), label, parent, device.clone())
            }
        };
        let fill = device.as_ref().map_or("white", |d| colours[d]);
        let shape = match drawn {
            Box_::Scope(..) => "box3d",
            Box_::Node(id) => match graph.node(*id).op {
                Op::Send { .. } => "rarrow",
                Op::Recv { .. } => "larrow",
                Op::AllReduce { .. } => "octagon",
                _ => "box",
            },
        };
        let tooltip = device.unwrap_or_else(|| "no device".into());
        lines.insert(
            drawn.clone(),
            format!(
                "\"{id}\" [label=\"{}\", shape={shape}, style=filled, fillcolor=\"{fill}\", tooltip=\"{}\"];",
                escape(&label),
                escape(&tooltip)
            ),
        );
        tree.insert(enclosing.as_deref(), drawn.clone());
    }

    let id_of = |drawn: &Box_| -> String {
        match drawn {
            Box_::Node(id) => format!("n{}", number[id]),
            Box_::Scope(..) => format!("s{}", number[&members[drawn][0]]),
        }
    };

    let mut out = String::new();
    let _ = writeln!(out, "digraph \"{}\" {{", escape(&module.name));
    let _ = writeln!(out, "  rankdir=TB;\n  node [fontname=\"monospace\", fontsize=10];\n  edge [fontsize=8];");
    tree.write(&mut out, "", &lines, 1);

    // Edges between boxes, each once; an edge inside a folded scope is not drawn.
    let mut edges: BTreeSet<(String, String, bool)> = BTreeSet::new();
    for &id in &order {
        let to = box_of(id);
        let data: Vec<TensorRef> = graph.inputs(id);
        for (source, control) in
            data.iter().map(|t| (t.node, false)).chain(graph.control_inputs(id).into_iter().map(|n| (n, true)))
        {
            let from = box_of(source);
            if from != to {
                edges.insert((id_of(&from), id_of(&to), control));
            }
        }
    }
    for (from, to, control) in edges {
        let style = if control { " [style=dashed]" } else { "" };
        let _ = writeln!(out, "  \"{from}\" -> \"{to}\"{style};");
    }
    // Transfers: each Send to the Recv of its key.
    let sends: HashMap<&str, NodeId> = order
        .iter()
        .filter_map(|&id| match &graph.node(id).op {
            Op::Send { key, .. } => Some((key.as_str(), id)),
            _ => None,
        })
        .collect();
    let mut transfers: BTreeMap<(String, String), u64> = BTreeMap::new();
    for &id in &order {
        let Op::Recv { key, ty, .. } = &graph.node(id).op else { continue };
        let Some(&send) = sends.get(key.as_str()) else { continue };
        let (from, to) = (box_of(send), box_of(id));
        if from != to {
            *transfers.entry((id_of(&from), id_of(&to))).or_default() += ty.size_in_bytes() as u64;
        }
    }
    for ((from, to), bytes) in transfers {
        let _ = writeln!(
            out,
            "  \"{from}\" -> \"{to}\" [color=\"#d62728\", penwidth=2, label=\"{}\"];",
            human_bytes(bytes)
        );
    }
    if !colours.is_empty() {
        let _ = writeln!(out, "  subgraph cluster_legend {{\n    label=\"devices\"; style=dashed;");
        for (i, (device, colour)) in colours.iter().enumerate() {
            let _ = writeln!(
                out,
                "    \"legend{i}\" [label=\"{}\", shape=box, style=filled, fillcolor=\"{colour}\"];",
                escape(device)
            );
        }
        let _ = writeln!(out, "  }}");
    }
    out.push_str("}\n");
    out
}

/// `512 B`, `1.5 KiB`, `3.0 MiB`: exact below a KiB, one decimal above.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut value = n as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// `h1/w/read` → `["h1", "h1/w"]`: the scopes enclosing a node, outermost first.
fn scopes(name: &str) -> Vec<String> {
    let parts: Vec<&str> = name.split('/').collect();
    (1..parts.len()).map(|i| parts[..i].join("/")).collect()
}

fn escape(text: &str) -> String {
    text.replace('\\', "\\\\").replace('"', "\\\"").replace("\\\\n", "\\n")
}

/// Drawn boxes arranged by the scope that encloses them.
#[derive(Default)]
struct ScopeTree {
    boxes: Vec<Box_>,
    children: BTreeMap<String, ScopeTree>,
}

impl ScopeTree {
    fn insert(&mut self, scope: Option<&str>, drawn: Box_) {
        let Some(scope) = scope else {
            self.boxes.push(drawn);
            return;
        };
        let mut here = self;
        let mut path = String::new();
        for part in scope.split('/') {
            if !path.is_empty() {
                path.push('/');
            }
            path.push_str(part);
            here = here.children.entry(path.clone()).or_default();
        }
        here.boxes.push(drawn);
    }

    fn write(&self, out: &mut String, name: &str, lines: &BTreeMap<Box_, String>, depth: usize) {
        let indent = "  ".repeat(depth);
        if !name.is_empty() {
            let label = name.rsplit('/').next().unwrap_or(name);
            let _ = writeln!(out, "{indent}subgraph \"cluster_{}\" {{", escape(name));
            let _ = writeln!(out, "{indent}  label=\"{}\"; style=rounded; color=gray;", escape(label));
        }
        for drawn in &self.boxes {
            let _ = writeln!(out, "{indent}  {}", lines[drawn]);
        }
        for (child, tree) in &self.children {
            tree.write(out, child, lines, depth + 1);
        }
        if !name.is_empty() {
            let _ = writeln!(out, "{indent}}}");
        }
    }
}
