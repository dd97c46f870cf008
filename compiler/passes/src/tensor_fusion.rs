//! tensor_fusion: Horovod's tensor fusion. A data-parallel plan all-reduces every gradient on
//! its own, and a model with many small parameters pays a collective's latency (a ring's 2(n−1)
//! messages) for each. This pass packs the all-reduces of small float tensors into shared ones:
//! per replica, each member is flattened, the members are concatenated, one all-reduce sums the
//! buffer, and each member's sum is sliced back out and reshaped.
//!
//! The arithmetic does not change (an all-reduce sums elementwise), so a fused plan trains to
//! the same bits. Every replica builds the same buckets: members are ordered by key and buckets
//! filled greedily up to `threshold_bytes`, from the keys alone, and a key is fused only when
//! every replica of its group has it. New nodes are requested on the device of the all-reduces
//! they replace.

use dfc_ir::{DType, Module, NodeId, Op, Shape, TensorRef};
use std::collections::{BTreeMap, HashMap};

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

/// One all-reduce of a replica: its key, node, operand and element count.
struct Member {
    key: String,
    id: NodeId,
    operand: TensorRef,
    elements: usize,
}

pub fn fuse_all_reduces(module: &mut Module, options: &FusionOptions) {
    if options.threshold_bytes == 0 {
        return;
    }
    let graph = &mut module.graph;
    // (group size, dtype) → replica → members.
    let mut groups: BTreeMap<(u32, usize), BTreeMap<u32, Vec<Member>>> = BTreeMap::new();
    for id in graph.node_ids().collect::<Vec<_>>() {
        let Op::AllReduce { key, group_size, replica } = &graph.node(id).op else { continue };
        let operand = graph.inputs(id)[0];
        let ty = graph.ty(operand);
        if !matches!(ty.dtype, DType::F32 | DType::F64) || ty.size_in_bytes() > options.threshold_bytes {
            continue;
        }
        let dtype = DType::ALL.iter().position(|&d| d == ty.dtype).expect("listed");
        let member = Member { key: key.clone(), id, operand, elements: ty.shape.n_elements() };
        groups.entry((*group_size, dtype)).or_default().entry(*replica).or_default().push(member);
    }
    let mut bucket_count = 0usize;
    for ((group_size, dtype), mut replicas) in groups {
        let dtype = DType::ALL[dtype];
        let size = dtype.size_in_bytes();
        // Keys every replica of the group has, with their sizes, in key order.
        let mut keys: BTreeMap<String, (usize, u32)> = BTreeMap::new();
        for members in replicas.values() {
            for m in members {
                let entry = keys.entry(m.key.clone()).or_insert((m.elements, 0));
                entry.1 += 1;
            }
        }
        let complete = replicas.len() == group_size as usize;
        let keys: Vec<(String, usize)> = keys
            .into_iter()
            .filter(|(_, (_, count))| complete && *count == group_size)
            .map(|(key, (elements, _))| (key, elements))
            .collect();
        // Greedy buckets up to the threshold; a bucket of one stays as it is.
        let mut buckets: Vec<Vec<String>> = Vec::new();
        let mut bytes = 0;
        for (key, elements) in keys {
            if buckets.is_empty() || bytes + elements * size > options.threshold_bytes {
                buckets.push(Vec::new());
                bytes = 0;
            }
            bytes += elements * size;
            buckets.last_mut().expect("pushed").push(key);
        }
        for bucket in buckets.into_iter().filter(|b| b.len() > 1) {
            let fused_key = format!("fused_all_reduce/{bucket_count}");
            bucket_count += 1;
            for (&replica, members) in replicas.iter_mut() {
                let by_key: HashMap<&str, &Member> = members.iter().map(|m| (m.key.as_str(), m)).collect();
                let chosen: Vec<&Member> = bucket.iter().map(|k| by_key[k.as_str()]).collect();
                fuse_bucket(graph, &chosen, &fused_key, group_size, replica);
            }
        }
    }
}

/// Replaces one replica's all-reduces `members` by one over their concatenation.
fn fuse_bucket(graph: &mut dfc_ir::Graph, members: &[&Member], key: &str, group_size: u32, replica: u32) {
    let device = graph.node(members[0].id).requested_device.clone();
    let add = |graph: &mut dfc_ir::Graph, op: Op, inputs: &[TensorRef], base: &str| {
        let name = graph.unique_name(base);
        let id = graph.add(op, inputs, &name, None).expect("fusion builds well-typed nodes");
        graph.request(id, device.clone(), None);
        id
    };
    let scope = format!("replica_{replica}/{key}");
    let flat: Vec<TensorRef> = members
        .iter()
        .map(|m| {
            let shape = Shape::from(vec![m.elements]);
            add(graph, Op::Reshape { shape }, &[m.operand], &format!("{scope}/flatten")).into()
        })
        .collect();
    let joined = add(graph, Op::Concat { axis: 0 }, &flat, &format!("{scope}/concat"));
    let op = Op::AllReduce { key: key.to_string(), group_size, replica };
    let summed = add(graph, op, &[joined.into()], &format!("{scope}/all_reduce"));
    let mut offset = 0;
    for m in members {
        let slice = Op::Slice { begin: vec![offset], size: vec![m.elements] };
        offset += m.elements;
        let part = add(graph, slice, &[summed.into()], &format!("{scope}/slice"));
        let shape = graph.ty(m.operand).shape.clone();
        let back = add(graph, Op::Reshape { shape }, &[part.into()], &format!("{scope}/unflatten"));
        graph.replace_uses(m.id.into(), back.into());
        // Whatever had to run after the member's all-reduce runs after the fused one.
        for user in graph.users(m.id) {
            graph.add_control_edge(summed, user);
        }
        for before in graph.control_inputs(m.id) {
            graph.add_control_edge(before, joined);
        }
        graph.remove(m.id);
    }
}
