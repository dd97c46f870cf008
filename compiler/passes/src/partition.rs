//! Partitioning (TensorFlow's graph_partition.cc): a placed graph becomes one subgraph per
//! device.
//!
//! - Every data edge between devices goes through a Send on the producer's device and a Recv
//!   on the consumer's, with a rendezvous key naming both devices and the tensor. There is one
//!   pair per (tensor, destination device), however many consumers the tensor has there.
//! - A control edge between devices is carried by a dummy tensor: a scalar constant that runs
//!   after the source, sent to the destination, whose Recv runs before the target. One per
//!   (source node, destination device).
//! - A constant used on another device is copied there instead of sent.
//! - The Send/Recv nodes are added to the whole graph first, so names stay unique across all
//!   partitions and spans point at the producer's line; then each device's nodes are copied
//!   into a module of their own with that device's inputs, params, outputs and metrics.
//!
//! `dfc_ir::verify_partitions` checks the result: every Send has its Recv and no partition
//! reads another's tensor.

use crate::place::Placed;
use dfc_ir::{device_slug, ConstValue, DType, DeviceSpec, Graph, Module, NodeId, Op, Output, TensorRef};
use std::collections::HashMap;

pub struct Partitioned {
    /// The whole graph with the Send/Recv pairs in it: what pictures and reports show.
    pub combined: Module,
    /// One module per device that runs anything, in the order of `devices`.
    pub parts: Vec<(DeviceSpec, Module)>,
}

/// Splits `placed` by device; `devices` gives the order of the partitions.
pub fn partition(placed: Placed, devices: &[DeviceSpec]) -> Partitioned {
    let mut module = placed.module;
    insert_transfers(&mut module.graph);
    // Each node's partition, in one pass: scanning the graph once per device made
    // partitioning quadratic in nodes × devices.
    let index: HashMap<&DeviceSpec, usize> = devices.iter().enumerate().map(|(i, d)| (d, i)).collect();
    let mut members: Vec<Vec<NodeId>> = vec![Vec::new(); devices.len()];
    for id in module.graph.node_ids() {
        if let Some(&i) = module.graph.node(id).device.as_ref().and_then(|d| index.get(d)) {
            members[i].push(id);
        }
    }
    let parts = devices
        .iter()
        .zip(&members)
        .filter(|(_, mine)| !mine.is_empty())
        .map(|(d, mine)| (d.clone(), extract(&module, mine)))
        .collect();
    Partitioned { combined: module, parts }
}

/// Each node's device, as an index into a table of the graph's devices (comparing and hashing
/// small numbers, not device strings, per edge).
struct Devices {
    table: Vec<DeviceSpec>,
    of: Vec<u32>,
}

impl Devices {
    fn new(graph: &Graph) -> Devices {
        let mut table: Vec<DeviceSpec> = Vec::new();
        let mut index: HashMap<DeviceSpec, u32> = HashMap::new();
        let mut of = vec![u32::MAX; petgraph_bound(graph)];
        for id in graph.node_ids() {
            let node = graph.node(id);
            let device = node.device.as_ref().unwrap_or_else(|| panic!("`{}` is not placed", node.name));
            let i = *index.entry(device.clone()).or_insert_with(|| {
                table.push(device.clone());
                table.len() as u32 - 1
            });
            of[id.index()] = i;
        }
        Devices { table, of }
    }

    fn of(&self, id: NodeId) -> u32 {
        self.of[id.index()]
    }

    /// Records the device of a node added after `new`.
    fn set(&mut self, id: NodeId, device: u32) {
        if self.of.len() <= id.index() {
            self.of.resize(id.index() + 1, u32::MAX);
        }
        self.of[id.index()] = device;
    }
}

fn petgraph_bound(graph: &Graph) -> usize {
    graph.node_ids().map(|id| id.index() + 1).max().unwrap_or(0)
}

fn insert_transfers(graph: &mut Graph) {
    let ids: Vec<NodeId> = graph.node_ids().collect();
    let mut devices = Devices::new(graph);
    // (tensor, destination) -> the Recv there.
    let mut received: HashMap<(TensorRef, u32), NodeId> = HashMap::new();
    let mut moves: Vec<(NodeId, u32, TensorRef)> = Vec::new();
    for &consumer in &ids {
        let here = devices.of(consumer);
        for (input, source) in graph.data_edges_into(consumer) {
            let there = devices.of(source.node);
            if there == here {
                continue;
            }
            let recv = match received.get(&(source, here)) {
                Some(&recv) => recv,
                None => {
                    let to = &devices.table[here as usize];
                    // A constant is cheaper to copy than to send.
                    let standalone = matches!(graph.node(source.node).op, Op::Const { .. })
                        && graph.control_inputs(source.node).is_empty();
                    let recv = if standalone {
                        let node = graph.node(source.node).clone();
                        let name = format!("{}/on_{}", node.name, device_slug(to));
                        let copy = graph.add_with_types(node.op, &[], node.outputs, &name, graph.span(source.node));
                        graph.node_mut(copy).device = Some(to.clone());
                        copy
                    } else {
                        let (send, recv) = transfer(graph, source, &devices.table[there as usize], to);
                        devices.set(send, there);
                        recv
                    };
                    devices.set(recv, here);
                    received.insert((source, here), recv);
                    recv
                }
            };
            moves.push((consumer, input, recv.into()));
        }
    }
    graph.set_inputs(&moves);
    // Control edges: one dummy tensor per (source node, destination device).
    let mut signalled: HashMap<(NodeId, u32), NodeId> = HashMap::new();
    for &after in &ids {
        let here = devices.of(after);
        for before in graph.control_inputs(after) {
            let there = devices.of(before);
            if there == here {
                continue;
            }
            let recv = match signalled.get(&(before, here)) {
                Some(&recv) => recv,
                None => {
                    let name = format!("{}/done", graph.node(before).name);
                    let span = graph.span(before);
                    let dummy = graph
                        .add(Op::Const { value: ConstValue::scalar(DType::F32, 0.0) }, &[], &name, span)
                        .expect("typed");
                    let (from, to) = (devices.table[there as usize].clone(), devices.table[here as usize].clone());
                    graph.node_mut(dummy).device = Some(from.clone());
                    graph.add_control_edge(before, dummy);
                    let (send, recv) = transfer(graph, dummy.into(), &from, &to);
                    for (id, device) in [(dummy, there), (send, there), (recv, here)] {
                        devices.set(id, device);
                    }
                    signalled.insert((before, here), recv);
                    recv
                }
            };
            graph.remove_control_edge(before, after);
            graph.add_control_edge(recv, after);
        }
    }
}

/// What a transfer of output `port` of the node `name` from `from` to `to` is called: the
/// rendezvous key, the Send's name and the Recv's. Data parallelism's replica stubs and
/// `dfc_ir::instantiate` name transfers this way too.
pub fn transfer_names(name: &str, port: u32, from: &DeviceSpec, to: &DeviceSpec) -> (String, String, String) {
    let shown = if port == 0 { name.to_string() } else { format!("{name}:{port}") };
    let slug = device_slug(to);
    (format!("{from};{shown};{to}"), format!("{name}/send_to_{slug}"), format!("{name}/recv_on_{slug}"))
}

/// A Send of `tensor` on `from` and its Recv on `to`.
fn transfer(graph: &mut Graph, tensor: TensorRef, from: &DeviceSpec, to: &DeviceSpec) -> (NodeId, NodeId) {
    let (key, send_name, recv_name) = transfer_names(&graph.node(tensor.node).name, tensor.port, from, to);
    let span = graph.span(tensor.node);
    let ty = graph.ty(tensor).clone();
    let send =
        graph.add(Op::Send { key: key.clone(), to: to.clone() }, &[tensor], &send_name, span).expect("sends type");
    graph.node_mut(send).device = Some(from.clone());
    let recv = graph.add(Op::Recv { key, from: from.clone(), ty }, &[], &recv_name, span).expect("recvs type");
    graph.node_mut(recv).device = Some(to.clone());
    (send, recv)
}

/// The nodes `mine` (one device's), copied into a module of their own.
fn extract(module: &Module, mine: &[NodeId]) -> Module {
    let graph = &module.graph;
    let edges = mine.iter().map(|&id| graph.data_edges_into(id).len() + graph.control_inputs(id).len()).sum();
    let mut part = Module {
        name: module.name.clone(),
        dims: module.dims.clone(),
        graph: Graph::with_capacity(mine.len(), edges),
        ..Module::default()
    };
    let mut map: HashMap<NodeId, NodeId> = HashMap::with_capacity(mine.len());
    for &id in mine {
        let node = graph.node(id);
        let copy = part.graph.add_with_types(node.op.clone(), &[], node.outputs.clone(), &node.name, graph.span(id));
        let n = part.graph.node_mut(copy);
        n.requested_device = node.requested_device.clone();
        n.device = node.device.clone();
        map.insert(id, copy);
    }
    for &id in mine {
        for (input, source) in graph.data_edges_into(id) {
            let source = TensorRef { node: map[&source.node], port: source.port };
            part.graph.set_input(map[&id], input, source);
        }
        for before in graph.control_inputs(id) {
            part.graph.add_control_edge(map[&before], map[&id]);
        }
        if let Some(with) = graph.node(id).colocate_with {
            part.graph.node_mut(map[&id]).colocate_with = map.get(&with).copied();
        }
    }
    let local = |ids: &[NodeId]| ids.iter().filter_map(|id| map.get(id).copied()).collect::<Vec<_>>();
    part.inputs = local(&module.inputs);
    part.params = local(&module.params);
    let outputs = |list: &[Output]| {
        list.iter()
            .filter_map(|o| {
                map.get(&o.tensor.node)
                    .map(|&n| Output { name: o.name.clone(), tensor: TensorRef { node: n, port: o.tensor.port } })
            })
            .collect::<Vec<_>>()
    };
    part.outputs = outputs(&module.outputs);
    part.metrics = outputs(&module.metrics);
    part
}
