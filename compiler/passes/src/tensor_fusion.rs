//! tensor_fusion: Horovod's tensor fusion. A data-parallel plan all-reduces every gradient on
//! its own, and a model with many small parameters pays a collective's latency (a ring's 2(n−1)
//! messages) for each. This pass packs the all-reduces of small float tensors into shared ones:
//! per replica, each member is flattened, the members are concatenated, one all-reduce sums the
//! buffer, and each member's sum is sliced back out and reshaped.
//!
//! The arithmetic does not change (an all-reduce sums elementwise), so a fused plan trains to
//! the same bits. Every replica builds the same buckets: members are ordered by where their
//! values are computed (the earliest replica's place in the topological order: the backward
//! pass computes the last layer's gradients first), then by key, and buckets filled greedily
//! up to `threshold_bytes`, keys named alike on every replica (so that replicas left as
//! instances of replica 1 get replica 1's buckets), and a key is fused only when
//! every replica of its group has it once, with one size. All-reduces are fused only with
//! those of their level, the most all-reduces on a path to them (an all-reduce that depends
//! on another is a level above it, so no bucket holds both, which would make a cycle; a
//! sharded optimizer's all-gathers, which follow the gradients', are fused among themselves).
//! A key whose replicas' all-reduces are of different levels stays alone. Fused keys are
//! `fused_all_reduce/<i>`, numbered in that order and never one the module already uses.
//! Local SGD's averages (keys `average/…`) run in a program of their own, so they are fused
//! only with each other, under `average/fused_all_reduce/<i>`.
//!
//! New nodes copy the span, the device request and the colocation of the all-reduce they come
//! from (the buffer and its all-reduce: the bucket's first member's), so placement puts them on
//! the replica's device. Control edges of a replaced all-reduce move to the fused one; uses of its
//! value, in the graph and in the module's interface, move to its slice.

use crate::replicate::AVERAGE_KEY_PREFIX;
use dfc_ir::{DType, Graph, Module, NodeId, Op, Shape, TensorRef};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FusionOptions {
    /// The largest bucket, and the largest tensor fused; 0 turns fusion off.
    pub threshold_bytes: usize,
}

impl Default for FusionOptions {
    /// Horovod's default fusion buffer, 64 MiB.
    fn default() -> FusionOptions {
        FusionOptions { threshold_bytes: 64 << 20 }
    }
}

impl FusionOptions {
    /// Buckets for all-reduces overlapped with the backward pass: small enough that the
    /// first ones start while most gradients are still to compute, 256 KiB.
    pub fn overlapped() -> FusionOptions {
        FusionOptions { threshold_bytes: 256 << 10 }
    }
}

/// One all-reduce of a replica: its key, node, operand and element count.
struct Member {
    key: String,
    id: NodeId,
    operand: TensorRef,
    elements: usize,
}

/// What the replicas of one key have in common, to decide whether the key can be fused.
#[derive(Default)]
struct KeyInfo {
    /// Element counts met (one, for a key that can be fused).
    elements: BTreeSet<usize>,
    /// Replica indices met, and how many members in all.
    replicas: BTreeSet<u32>,
    members: usize,
    /// The members' levels (one, for a key that can be fused).
    levels: BTreeSet<usize>,
    /// The earliest place of a member's operand in the graph's topological order.
    computed: Option<usize>,
}

/// `built`: how many replicas of each group the module holds, when the others are instances
/// of replica 1 (built like it, `dfc_ir::instantiate`); `None`: all of them.
pub fn fuse_all_reduces(module: &mut Module, options: &FusionOptions, built: Option<u32>) {
    if options.threshold_bytes == 0 {
        return;
    }
    let graph = &module.graph;
    // A cyclic graph is the verifier's to report.
    let Ok(order) = graph.topo_order() else { return };
    let position: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &id)| (id, i)).collect();
    let mut taken: HashSet<String> = HashSet::new();
    // Each node's level: the most all-reduces on a path to it, through data or control edges.
    let mut level: HashMap<NodeId, usize> = HashMap::with_capacity(order.len());
    for &id in &order {
        let below = level.get(&id).copied().unwrap_or(0) + usize::from(is_all_reduce(graph, id));
        for user in graph.users(id) {
            let user_level = level.entry(user).or_insert(0);
            *user_level = (*user_level).max(below);
        }
    }
    // (group size, dtype, an average's) → replica → members.
    let mut groups: BTreeMap<(u32, DType, bool), BTreeMap<u32, Vec<Member>>> = BTreeMap::new();
    for &id in &order {
        let Op::AllReduce { key, group_size, replica } = &graph.node(id).op else { continue };
        taken.insert(key.clone());
        let Some(&operand) = graph.inputs(id).first() else { continue };
        let ty = graph.ty(operand);
        if !matches!(ty.dtype, DType::F32 | DType::F64) || ty.size_in_bytes() > options.threshold_bytes {
            continue;
        }
        let member = Member { key: key.clone(), id, operand, elements: ty.shape.n_elements() };
        let average = key.starts_with(AVERAGE_KEY_PREFIX);
        groups.entry((*group_size, ty.dtype, average)).or_default().entry(*replica).or_default().push(member);
    }
    let mut next_key = 0usize;
    let mut replaced: HashMap<NodeId, TensorRef> = HashMap::new();
    for ((group_size, dtype, average), replicas) in groups {
        let size = dtype.size_in_bytes();
        let mut keys: BTreeMap<&str, KeyInfo> = BTreeMap::new();
        for (&replica, members) in &replicas {
            for m in members {
                let info = keys.entry(m.key.as_str()).or_default();
                info.elements.insert(m.elements);
                info.replicas.insert(replica);
                info.members += 1;
                info.levels.insert(level.get(&m.id).copied().unwrap_or(0));
                let computed = position[&m.operand.node];
                info.computed = Some(info.computed.map_or(computed, |c| c.min(computed)));
            }
        }
        // Keys with one member of one size on each of the group's replicas, in the order their
        // values are computed (then by key), so that a bucket's all-reduce can start while
        // later buckets' gradients are still being computed.
        let present = built.map_or(group_size, |b| b.min(group_size));
        let every_replica: BTreeSet<u32> = (0..present).collect();
        let mut keys: Vec<(&str, &KeyInfo)> = keys
            .iter()
            .filter(|(_, info)| {
                info.replicas == every_replica
                    && info.members == present as usize
                    && info.elements.len() == 1
                    && info.levels.len() == 1
            })
            .map(|(key, info)| (*key, info))
            .collect();
        let level_of = |info: &KeyInfo| *info.levels.first().expect("one level");
        keys.sort_by_key(|(key, info)| (level_of(info), info.computed, *key));
        let keys = keys.into_iter().map(|(key, info)| (key, level_of(info), *info.elements.first().expect("one size")));
        // Greedy buckets of one level up to the threshold; a bucket of one stays as it is.
        let mut buckets: Vec<Vec<&str>> = Vec::new();
        let (mut bytes, mut bucket_level) = (0, None);
        for (key, level, elements) in keys {
            if buckets.is_empty() || bucket_level != Some(level) || bytes + elements * size > options.threshold_bytes {
                buckets.push(Vec::new());
                (bytes, bucket_level) = (0, Some(level));
            }
            bytes += elements * size;
            buckets.last_mut().expect("pushed").push(key);
        }
        for bucket in buckets.iter().filter(|b| b.len() > 1) {
            let fused_key = loop {
                let key = format!("{}fused_all_reduce/{next_key}", if average { AVERAGE_KEY_PREFIX } else { "" });
                next_key += 1;
                if taken.insert(key.clone()) {
                    break key;
                }
            };
            for replica in 0..present {
                let members = &replicas[&replica];
                let by_key: HashMap<&str, &Member> = members.iter().map(|m| (m.key.as_str(), m)).collect();
                let chosen: Vec<&Member> = bucket.iter().map(|k| by_key[k]).collect();
                let graph = &mut module.graph;
                replaced.extend(fuse_bucket(graph, &chosen, &fused_key, group_size, replica));
            }
        }
    }
    retarget(module, &replaced);
}

fn is_all_reduce(graph: &Graph, id: NodeId) -> bool {
    matches!(graph.node(id).op, Op::AllReduce { .. })
}

/// Replaces one replica's all-reduces `members` by one over their concatenation; returns what
/// each removed all-reduce's value became.
fn fuse_bucket(
    graph: &mut Graph,
    members: &[&Member],
    key: &str,
    group_size: u32,
    replica: u32,
) -> Vec<(NodeId, TensorRef)> {
    let scope = format!("replica_{replica}/{key}");
    let flat: Vec<TensorRef> = members
        .iter()
        .map(|m| {
            let shape = Shape::from(vec![m.elements]);
            add_like(graph, m.id, Op::Reshape { shape }, &[m.operand], &format!("{scope}/flatten")).into()
        })
        .collect();
    let first = members[0].id;
    let joined = add_like(graph, first, Op::Concat { axis: 0 }, &flat, &format!("{scope}/concat"));
    let op = Op::AllReduce { key: key.to_string(), group_size, replica };
    let summed = add_like(graph, first, op, &[joined.into()], &format!("{scope}/all_reduce"));
    let mut replaced = Vec::with_capacity(members.len());
    let mut offset = 0;
    for m in members {
        let slice = Op::Slice { begin: vec![offset], size: vec![m.elements] };
        offset += m.elements;
        let part = add_like(graph, m.id, slice, &[summed.into()], &format!("{scope}/slice"));
        let shape = graph.ty(m.operand).shape.clone();
        let back: TensorRef =
            add_like(graph, m.id, Op::Reshape { shape }, &[part.into()], &format!("{scope}/unflatten")).into();
        graph.replace_uses(m.id.into(), back);
        // What ran after or before the member's all-reduce runs after or before the fused one.
        for user in graph.users(m.id) {
            graph.add_control_edge(summed, user);
        }
        for before in graph.control_inputs(m.id) {
            graph.add_control_edge(before, summed);
        }
        graph.remove(m.id);
        replaced.push((m.id, back));
    }
    replaced
}

/// Adds a node like `from`: its span, device request and colocation, under a unique name.
fn add_like(graph: &mut Graph, from: NodeId, op: Op, inputs: &[TensorRef], base: &str) -> NodeId {
    let name = graph.unique_name(base);
    let id = graph.add(op, inputs, &name, graph.span(from)).expect("fusion builds well-typed nodes");
    let (device, colocate) = (graph.node(from).requested_device.clone(), graph.node(from).colocate_with);
    graph.request(id, device, graph.request_span(from));
    graph.node_mut(id).colocate_with = colocate;
    id
}

/// Points the module's interface and colocations at what the removed all-reduces became.
fn retarget(module: &mut Module, replaced: &HashMap<NodeId, TensorRef>) {
    if replaced.is_empty() {
        return;
    }
    let map = |t: &mut TensorRef| {
        if t.port == 0 {
            if let Some(&new) = replaced.get(&t.node) {
                *t = new;
            }
        }
    };
    for output in module.outputs.iter_mut().chain(module.metrics.iter_mut()) {
        map(&mut output.tensor);
    }
    if let Some(training) = &mut module.training {
        map(&mut training.loss);
        for (_, gradient) in &mut training.gradients {
            map(gradient);
        }
    }
    let graph = &mut module.graph;
    for id in graph.node_ids().collect::<Vec<_>>() {
        if let Some(with) = graph.node(id).colocate_with {
            if let Some(new) = replaced.get(&with) {
                graph.node_mut(id).colocate_with = Some(new.node);
            }
        }
    }
}
