//! Partitioned variables, with TensorFlow's `fixed_size_partitioner` semantics: a variable of
//! N rows in k shards is split along axis 0 into shards of N / k rows, the first N % k shards
//! taking one row more; k is at most N.
//!
//! Each shard is a variable of its own (`table/part_0`, ...) whose `origin` names the source
//! variable, so it starts from the rows of the value the whole variable would have had. Uses
//! are rewritten so the model computes exactly what it did before:
//!
//! - `gather(table, indices)` becomes a sharded gather: each shard looks up the indices that
//!   fall in its rows (shifted and clamped into range), zeroes the others, and the partial
//!   results are summed; each shard's gather is colocated with its shard, so only the rows
//!   looked up leave the shard's device. (An index outside the whole table gives zeros.)
//! - any other use reads the concatenation of the shards.
//!
//! It runs before autodiff, so gradients come out per shard: the gradient of a concat is a
//! slice per shard, that of a gather a scatter into the shard's own rows, colocated with the
//! lookup. A lookup of a whole (unsplit) variable is colocated with it too: what crosses
//! devices is the rows a step touches, both ways, never the table or a dense gradient.
//!
//! A variable is split if the source asks for it (`@partitioned(k)`), or, with a minimum shard
//! size, if it is large enough for at least two shards of that size (at most `max_shards`).

use dfc_ir::{BinaryOp, CompareOp, ConstValue, Module, NodeId, Op, Shape, TensorRef, TensorType, VariableOrigin};

#[derive(Clone, Debug)]
pub struct ShardOptions {
    /// Split variables not partitioned in the source into shards of at least this many bytes.
    pub min_shard_bytes: Option<u64>,
    /// The most shards `min_shard_bytes` may make (typically the number of parameter servers).
    pub max_shards: u32,
}

impl Default for ShardOptions {
    fn default() -> ShardOptions {
        ShardOptions { min_shard_bytes: None, max_shards: 1 }
    }
}

/// The rows of each of `k` shards of `rows` rows: fixed_size_partitioner's split.
pub fn shard_rows(rows: usize, k: usize) -> Vec<usize> {
    let k = k.clamp(1, rows.max(1));
    (0..k).map(|i| rows / k + usize::from(i < rows % k)).collect()
}

pub fn shard_variables(module: &mut Module, options: &ShardOptions) {
    let candidates: Vec<(NodeId, usize)> = module
        .params
        .iter()
        .filter_map(|&v| {
            let node = module.graph.node(v);
            let Op::Variable { ty, partitions, origin: None, .. } = &node.op else { return None };
            let rows = *ty.shape.dims().first()?;
            let only_reads = module.graph.users(v).iter().all(|&u| matches!(module.graph.node(u).op, Op::Read));
            let k = if *partitions > 1 {
                *partitions as usize
            } else if let Some(min) = options.min_shard_bytes.filter(|&m| m > 0) {
                let bytes =
                    ty.shape.dims().iter().fold(ty.dtype.size_in_bytes() as u64, |b, &d| b.saturating_mul(d as u64));
                ((bytes / min) as usize).min(options.max_shards as usize)
            } else {
                1
            };
            let k = k.min(rows);
            (k >= 2 && only_reads).then_some((v, k))
        })
        .collect();
    for (variable, k) in candidates {
        split(module, variable, k);
    }
    colocate_lookups(module);
}

/// Puts each lookup of a whole variable that asks for no device of its own with the variable,
/// as its shards' lookups are: the rows looked up travel, not the table, and the gradient (a
/// scatter colocated with the lookup) comes back as those rows.
fn colocate_lookups(module: &mut Module) {
    let graph = &mut module.graph;
    for &variable in &module.params {
        for read in graph.users(variable) {
            for user in graph.users(read) {
                let node = graph.node(user);
                let lookup = matches!(node.op, Op::Gather) && graph.inputs(user).first() == Some(&read.into());
                if lookup && node.requested_device.is_none() && node.colocate_with.is_none() {
                    graph.node_mut(user).colocate_with = Some(variable);
                }
            }
        }
    }
}

fn split(module: &mut Module, variable: NodeId, k: usize) {
    let graph = &mut module.graph;
    let node = graph.node(variable).clone();
    let Op::Variable { ty, init, trainable, .. } = &node.op else { unreachable!("candidates are variables") };
    let span = graph.span(variable);
    let rows = shard_rows(ty.shape.dims()[0], k);

    let mut shards = Vec::new();
    let mut offset = 0;
    for (i, &n) in rows.iter().enumerate() {
        let mut dims = ty.shape.dims().to_vec();
        dims[0] = n;
        let op = Op::Variable {
            ty: TensorType::new(ty.dtype, dims),
            init: init.clone(),
            trainable: *trainable,
            partitions: 1,
            origin: Some(Box::new(VariableOrigin {
                name: node.name.clone(),
                shape: ty.shape.clone(),
                offset,
                mirror_of: None,
            })),
        };
        let part = graph.add(op, &[], &format!("{}/part_{i}", node.name), span).expect("variables type");
        let read = graph.add(Op::Read, &[part.into()], &format!("{}/part_{i}/read", node.name), span).expect("typed");
        let at = graph.request_span(variable);
        for id in [part, read] {
            graph.request(id, node.requested_device.clone(), at);
        }
        shards.push(Shard { variable: part, read: read.into(), offset, rows: n });
        offset += n;
    }

    let reads: Vec<NodeId> = graph.users(variable);
    for read in reads {
        let graph = &mut module.graph;
        let (lookups, _): (Vec<NodeId>, Vec<NodeId>) = graph.users(read).into_iter().partition(|&user| {
            matches!(graph.node(user).op, Op::Gather)
                && graph.data_edges_into(user).iter().all(|(i, t)| (*i == 0) == (t.node == read))
        });
        for gather in lookups {
            sharded_gather(module, gather, &shards);
        }
        let graph = &mut module.graph;
        let read_ref = TensorRef::from(read);
        let data_users = graph.users(read).into_iter().any(|u| graph.inputs(u).contains(&read_ref));
        let named = module.outputs.iter().chain(&module.metrics).any(|o| o.tensor == read_ref)
            || module.training.as_ref().is_some_and(|t| t.loss == read_ref);
        if data_users || named {
            let inputs: Vec<TensorRef> = shards.iter().map(|s| s.read).collect();
            let joined = graph
                .add(Op::Concat { axis: 0 }, &inputs, &format!("{}/concat", node.name), span)
                .expect("shards concatenate to the whole");
            let at = graph.request_span(variable);
            graph.request(joined, node.requested_device.clone(), at);
            graph.replace_uses(read_ref, joined.into());
            redirect(module, read_ref, joined.into());
        }
        let graph = &mut module.graph;
        for after in graph.users(read) {
            for shard in &shards {
                graph.add_control_edge(shard.read.node, after);
            }
        }
        graph.remove(read);
    }
    module.graph.remove(variable);
    let at = module.params.iter().position(|&p| p == variable).expect("a param");
    module.params.splice(at..=at, shards.iter().map(|s| s.variable));
}

struct Shard {
    variable: NodeId,
    read: TensorRef,
    offset: usize,
    rows: usize,
}

/// Replaces `gather(table, indices)` by the sum over shards of each shard's masked lookup.
fn sharded_gather(module: &mut Module, gather: NodeId, shards: &[Shard]) {
    let graph = &mut module.graph;
    let node = graph.node(gather).clone();
    let span = graph.span(gather);
    let indices = graph.inputs(gather)[1];
    let index_ty = graph.ty(indices).clone();
    let out_ty = node.outputs[0].clone();
    let index_rank = index_ty.shape.rank();
    let asked_at = graph.request_span(gather);
    let row_rank = out_ty.shape.rank() - index_rank;

    let add = |graph: &mut dfc_ir::Graph, op: Op, inputs: &[TensorRef], name: String| -> TensorRef {
        let id =
            graph.add(op, inputs, &name, span).unwrap_or_else(|e| panic!("sharded gather `{name}`: {}", e.message));
        graph.request(id, node.requested_device.clone(), asked_at);
        id.into()
    };
    let scalar = |dtype, value: f64| Op::Const { value: ConstValue::scalar(dtype, value) };

    let mut total: Option<TensorRef> = None;
    for (i, shard) in shards.iter().enumerate() {
        let scope = format!("{}/part_{i}", node.name);
        let offset = add(graph, scalar(index_ty.dtype, shard.offset as f64), &[], format!("{scope}/offset"));
        let local = add(graph, Op::Binary(BinaryOp::Sub), &[indices, offset], format!("{scope}/local"));
        let zero = add(graph, scalar(index_ty.dtype, 0.0), &[], format!("{scope}/first"));
        let last = add(graph, scalar(index_ty.dtype, (shard.rows - 1) as f64), &[], format!("{scope}/last"));
        let above = add(graph, Op::Binary(BinaryOp::Maximum), &[local, zero], format!("{scope}/above"));
        let clamped = add(graph, Op::Binary(BinaryOp::Minimum), &[above, last], format!("{scope}/clamped"));
        let inside = add(graph, Op::Compare(CompareOp::Equal), &[clamped, local], format!("{scope}/inside"));
        let rows = add(graph, Op::Gather, &[shard.read, clamped], format!("{scope}/gather"));
        graph.node_mut(rows.node).colocate_with = Some(shard.variable);
        // The mask broadcasts over the row's own axes.
        let mask = if row_rank == 0 {
            inside
        } else {
            let mut dims = index_ty.shape.dims().to_vec();
            dims.extend(std::iter::repeat_n(1, row_rank));
            add(graph, Op::Reshape { shape: Shape::from(dims) }, &[inside], format!("{scope}/mask"))
        };
        let nothing = add(graph, scalar(out_ty.dtype, 0.0), &[], format!("{scope}/zero"));
        let part = add(graph, Op::Select, &[mask, rows, nothing], format!("{scope}/rows"));
        total = Some(match total {
            None => part,
            Some(sum) => add(graph, Op::Binary(BinaryOp::Add), &[sum, part], format!("{scope}/sum")),
        });
    }
    let total = total.expect("at least two shards");
    graph.replace_uses(gather.into(), total);
    for before in graph.control_inputs(gather) {
        graph.add_control_edge(before, total.node);
    }
    let users: Vec<NodeId> = graph.users(gather);
    for after in users {
        graph.add_control_edge(total.node, after);
    }
    graph.remove(gather);
    graph.rename(total.node, &node.name);
    redirect(module, gather.into(), total);
}

/// Named outputs, metrics and the loss that were `old` become `new`.
pub(crate) fn redirect(module: &mut Module, old: TensorRef, new: TensorRef) {
    for output in module.outputs.iter_mut().chain(module.metrics.iter_mut()) {
        if output.tensor == old {
            output.tensor = new;
        }
    }
    if let Some(training) = &mut module.training {
        if training.loss == old {
            training.loss = new;
        }
    }
}
