//! The stable text form of a module. Nodes print in topological order (oldest first among the
//! ready), numbered in print order, so the text depends only on the graph, not on how it was
//! built or which nodes were removed. Tests compare this text.
//!
//! ```text
//! model mlp(batch=128) {
//!   %0 = input : u8[128,28,28]  // pixels
//!   %1 = variable[init=glorot_uniform] : f32[784,256]  // w1
//!   %2 = read %1 : f32[784,256]  // w1/read
//!   %7 = matmul %3, %2 : f32[128,256] @/job:worker/task:0/cpu:0  // hidden/matmul
//!   %9 = assign_sub %1, %8 : f32[784,256] ^%6  // control dependency on %6
//!   output logits = %9
//!   minimize %12 with sgd(lr=0.1)
//! }
//! ```

use crate::graph::{NodeId, TensorRef};
use crate::module::Module;
use std::collections::HashMap;
use std::fmt::Write;

pub fn print(module: &Module) -> String {
    print_annotated(module, &HashMap::new())
}

/// The text form with `; error: ...` lines under the nodes named in `notes`.
pub fn print_annotated(module: &Module, notes: &HashMap<NodeId, Vec<String>>) -> String {
    let graph = &module.graph;
    let order = match graph.topo_order() {
        Ok(order) => order,
        // A cyclic graph still prints (creation order) so that the verifier can show it.
        Err(_) => graph.node_ids().collect(),
    };
    let number: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, id)| (*id, i)).collect();
    let operand = |t: &TensorRef| match number.get(&t.node) {
        Some(n) if t.port == 0 => format!("%{n}"),
        Some(n) => format!("%{n}:{}", t.port),
        None => format!("%<missing {}>", t.node.index()),
    };

    let mut out = String::new();
    let dims: Vec<String> = module.dims.iter().map(|(n, v)| format!("{n}={v}")).collect();
    if dims.is_empty() {
        let _ = writeln!(out, "model {} {{", module.name);
    } else {
        let _ = writeln!(out, "model {}({}) {{", module.name, dims.join(", "));
    }
    for id in &order {
        let node = graph.node(*id);
        let mut attrs: Vec<String> = node.op.attributes().into_iter().map(|(k, v)| format!("{k}={v}")).collect();
        // Once placed, the device says it all.
        if let (Some(device), None) = (&node.requested_device, &node.device) {
            attrs.push(format!("requested_device=\"{device}\""));
        }
        if let Some(with) = node.colocate_with {
            attrs.push(format!("colocate_with={}", operand(&with.into())));
        }
        let _ = write!(out, "  %{} = {}", number[id], node.op.name());
        if !attrs.is_empty() {
            let _ = write!(out, "[{}]", attrs.join(", "));
        }
        let operands: Vec<String> = graph.inputs(*id).iter().map(operand).collect();
        if !operands.is_empty() {
            let _ = write!(out, " {}", operands.join(", "));
        }
        let types: Vec<String> = node.outputs.iter().map(|t| t.to_string()).collect();
        if !types.is_empty() {
            let _ = write!(out, " : {}", types.join(", "));
        }
        for before in graph.control_inputs(*id) {
            let _ = write!(out, " ^{}", operand(&before.into()));
        }
        if let Some(device) = &node.device {
            let _ = write!(out, " @{device}");
        }
        let _ = writeln!(out, "  // {}", node.name);
        for note in notes.get(id).into_iter().flatten() {
            let _ = writeln!(out, "  ; error: {note}");
        }
    }
    for output in &module.outputs {
        let _ = writeln!(out, "  output {} = {}", output.name, operand(&output.tensor));
    }
    for metric in &module.metrics {
        let _ = writeln!(out, "  metric {} = {}", metric.name, operand(&metric.tensor));
    }
    if let Some(training) = &module.training {
        let _ = writeln!(out, "  minimize {} with {}", operand(&training.loss), training.optimizer);
        if !training.updates.is_empty() {
            let updates: Vec<String> = training.updates.iter().map(|u| operand(&(*u).into())).collect();
            let _ = writeln!(out, "  updates {}", updates.join(", "));
        }
        if !training.averages.is_empty() {
            let averages: Vec<String> = training.averages.iter().map(|u| operand(&(*u).into())).collect();
            let _ = writeln!(out, "  averages {}", averages.join(", "));
        }
    }
    out.push_str("}\n");
    out
}
