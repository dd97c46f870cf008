//! Which values a plan's integer inputs may hold: the labels of a `one_hot(labels, depth)` lie in
//! `[0, depth)`, the ids of a `gather(table, ids)` in `[0, rows of table)`. An input outside
//! that range would not fail at run time: `one_hot` gives an all-zero row and a sharded
//! lookup a zero row, so a model would train silently on wrong targets. Like Keras, dfc makes
//! it an error, and checks every feed whole when it is loaded, before any step runs.
//!
//! [`index_ranges`] finds the ranges by following each input of every partition forward
//! through the ops that pass its values on unchanged (identity, reshape, transpose, broadcast,
//! concat, integer casts, slices of whole examples — a replica's rows — and Send/Recv pairs
//! between partitions) and through additions of constants, up to the `one_hot` or `gather`
//! that uses them. A sharded lookup (the shard pass's `minimum(maximum(ids - offset, 0),
//! rows - 1)` of each shard) is checked against the whole table's rows, from the shard
//! variable's `origin`; any other clamp written in the model makes every value acceptable, so
//! nothing past it is checked.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use dfc_interp::{Data, Tensor};
use dfc_ir::{BinaryOp, ConstData, Graph, NodeId, Op, TensorRef};
use dfc_plan::Plan;

use crate::data::DataError;
use crate::source::PlanSource;

/// The values an input of the plan may hold, and the op that needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexRange {
    /// The plan input.
    pub input: String,
    /// The values allowed: `lo..hi`.
    pub lo: i64,
    pub hi: i64,
    /// What a value is to the op: `label` (one_hot) or `id` (gather).
    pub noun: &'static str,
    /// The op, as the model writes it: `one_hot(labels, 10)`, `gather(user_table, user)`.
    pub op: String,
    /// Where: `at mlp.df:21` when the source file is in the working directory (and is the one
    /// the plan was compiled from), else the op's node and the source's name.
    pub at: String,
}

/// Every range that the plan's ops put on its inputs (once each, in the order found).
pub fn index_ranges(plan: &Plan) -> Vec<IndexRange> {
    let plan_input = |node: &str| -> Option<String> {
        if plan.inputs.iter().any(|i| i.name == node) {
            return Some(node.to_string());
        }
        plan.split_of(node).map(|(input, ..)| input.to_string())
    };
    let walk = Walk::new(plan);
    let mut ranges: Vec<IndexRange> = Vec::new();
    for (p, partition) in plan.partitions.iter().enumerate() {
        let graph = &partition.module.graph;
        for id in graph.node_ids() {
            let node = graph.node(id);
            if !matches!(node.op, Op::Input { .. }) {
                continue;
            }
            let Some(input) = plan_input(&node.name) else { continue };
            for found in walk.ranges_of(&input, p, id.into()) {
                if !ranges
                    .iter()
                    .any(|r| (&r.input, r.lo, r.hi, &r.op) == (&found.input, found.lo, found.hi, &found.op))
                {
                    ranges.push(found);
                }
            }
        }
    }
    ranges
}

/// Checks every value of the feed `input` (loaded from `path`, fitted to the model) against
/// `ranges`: the first value outside one is an error naming the input, the file, the example
/// and the value.
pub fn check(ranges: &[IndexRange], input: &str, path: &Path, tensor: &Tensor) -> Result<(), DataError> {
    let per_example: usize = tensor.shape.dims().iter().skip(1).product();
    for range in ranges.iter().filter(|r| r.input == input) {
        let outside = |v: i64| v < range.lo || v >= range.hi;
        let found = match &tensor.data {
            Data::I32(v) => v.iter().position(|&x| outside(i64::from(x))).map(|i| (i, i64::from(v[i]))),
            Data::I64(v) => v.iter().position(|&x| outside(x)).map(|i| (i, v[i])),
            Data::U8(v) => v.iter().position(|&x| outside(i64::from(x))).map(|i| (i, i64::from(v[i]))),
            _ => None,
        };
        if let Some((flat, value)) = found {
            let example = flat.checked_div(per_example).unwrap_or(0);
            return Err(DataError::Value {
                input: input.to_string(),
                path: path.to_path_buf(),
                message: format!(
                    "example {example} has {} {value}, outside [{}, {}) of {} {}",
                    range.noun, range.lo, range.hi, range.op, range.at
                ),
            });
        }
    }
    Ok(())
}

/// How a tensor reached from an input relates to it: `clamp(input + shift)` where `clamp` is
/// that of the `maximum`/`minimum` by constants met on the way, if any.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Relation {
    shift: i64,
    clamp: Option<(i64, i64)>,
}

/// The plan's partitions, with their Send/Recv pairs, for following tensors across them.
struct Walk<'p> {
    plan: &'p Plan,
    /// The Recv nodes (partition, node) of each key.
    recvs: HashMap<&'p str, Vec<(usize, NodeId)>>,
    /// The Send node of each key.
    sends: HashMap<&'p str, (usize, NodeId)>,
    /// Where nodes are in the source, for messages.
    source: PlanSource,
}

/// The most steps [`Walk::table`] takes back from a gather to its table's variable.
const MAX_TABLE_STEPS: usize = 64;

impl<'p> Walk<'p> {
    fn new(plan: &'p Plan) -> Walk<'p> {
        let mut recvs: HashMap<&str, Vec<(usize, NodeId)>> = HashMap::new();
        let mut sends = HashMap::new();
        for (p, partition) in plan.partitions.iter().enumerate() {
            let graph = &partition.module.graph;
            for id in graph.node_ids() {
                match &graph.node(id).op {
                    Op::Recv { key, .. } => recvs.entry(key.as_str()).or_default().push((p, id)),
                    Op::Send { key, .. } => {
                        sends.insert(key.as_str(), (p, id));
                    }
                    _ => {}
                }
            }
        }
        Walk { plan, recvs, sends, source: PlanSource::of(plan) }
    }

    fn graph(&self, p: usize) -> &'p Graph {
        &self.plan.partitions[p].module.graph
    }

    /// The ranges that the uses of `start` (the `Input` node of `input` in partition `p`) need.
    fn ranges_of(&self, input: &str, p: usize, start: TensorRef) -> Vec<IndexRange> {
        let mut found = Vec::new();
        let begin = Relation { shift: 0, clamp: None };
        let mut todo = vec![(p, start, begin)];
        let mut seen = HashSet::new();
        while let Some((p, tensor, relation)) = todo.pop() {
            if !seen.insert((p, tensor, relation)) {
                continue;
            }
            let graph = self.graph(p);
            for user in graph.users(tensor.node) {
                let operands = graph.inputs(user);
                for (operand, _) in operands.iter().enumerate().filter(|(_, t)| **t == tensor) {
                    self.step(input, p, user, &operands, operand, relation, &mut todo, &mut found);
                }
            }
        }
        found
    }

    /// Where `relation`'s tensor, operand `operand` of `user`, goes next: the tensors that
    /// carry its values on (into `todo`), or the range that `user` needs of it (into `found`).
    #[allow(clippy::too_many_arguments)]
    fn step(
        &self,
        input: &str,
        p: usize,
        user: NodeId,
        operands: &[TensorRef],
        operand: usize,
        relation: Relation,
        todo: &mut Vec<(usize, TensorRef, Relation)>,
        found: &mut Vec<IndexRange>,
    ) {
        let graph = self.graph(p);
        let node = graph.node(user);
        let on = |relation| (p, TensorRef::from(user), relation);
        let constant = |other: usize| operands.get(other).and_then(|t| integer_scalar(graph, *t));
        match &node.op {
            Op::Identity | Op::StopGradient | Op::Reshape { .. } | Op::Transpose { .. } | Op::BroadcastTo { .. } => {
                todo.push(on(relation))
            }
            // Every value of an operand is a value of the result.
            Op::Concat { .. } => todo.push(on(relation)),
            Op::Cast { to } if to.is_int() && graph.ty(operands[operand]).dtype.is_int() => todo.push(on(relation)),
            // Whole examples (a replica's rows): the checks of the feed cover them.
            Op::Slice { begin, size } => {
                let dims = graph.ty(operands[operand]).shape.dims();
                if begin.iter().skip(1).all(|&b| b == 0) && size.iter().skip(1).eq(dims.iter().skip(1)) {
                    todo.push(on(relation))
                }
            }
            Op::Send { key, .. } => {
                for &(q, recv) in self.recvs.get(key.as_str()).into_iter().flatten() {
                    todo.push((q, recv.into(), relation));
                }
            }
            Op::Binary(op @ (BinaryOp::Add | BinaryOp::Sub)) if relation.clamp.is_none() => {
                let Some(c) = constant(1 - operand.min(1)) else { return };
                let shift = match (op, operand) {
                    (BinaryOp::Add, _) => relation.shift.checked_add(c),
                    (_, 0) => relation.shift.checked_sub(c),
                    _ => None, // c - x
                };
                if let Some(shift) = shift {
                    todo.push(on(Relation { shift, clamp: None }));
                }
            }
            Op::Binary(op @ (BinaryOp::Maximum | BinaryOp::Minimum)) => {
                let Some(c) = constant(1 - operand.min(1)) else { return };
                let (lo, hi) = relation.clamp.unwrap_or((i64::MIN, i64::MAX));
                let clamp = if *op == BinaryOp::Maximum { (lo.max(c), hi) } else { (lo, hi.min(c)) };
                todo.push(on(Relation { shift: relation.shift, clamp: Some(clamp) }));
            }
            Op::OneHot { depth, .. } if relation.clamp.is_none() => {
                let op = format!("one_hot({}, {depth})", shifted(input, relation.shift));
                let depth = i64::try_from(*depth).unwrap_or(i64::MAX);
                found.push(self.range(input, user, p, relation.shift, 0, depth, "label", op));
            }
            Op::Gather if operand == 1 => {
                let Some(table) = self.table(p, operands[0]) else { return };
                let rows = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
                let (name, offset, lo_hi) = match (relation.clamp, &table.shard) {
                    (None, _) => (table.name, 0, (0, rows(table.rows))),
                    // A shard's own clamp: the ids index the whole table.
                    (Some((0, last)), Some(shard)) if last == rows(table.rows) - 1 => {
                        (shard.name.clone(), rows(shard.offset), (0, rows(shard.rows)))
                    }
                    _ => return,
                };
                // The ids, shifted by the model, index the whole table.
                let Some(shift) = relation.shift.checked_add(offset) else { return };
                let op = format!("gather({name}, {})", shifted(input, shift));
                found.push(self.range(input, user, p, shift, lo_hi.0, lo_hi.1, "id", op));
            }
            _ => {}
        }
    }

    /// The range of the input's values that puts `input + shift` in `lo..hi`.
    #[allow(clippy::too_many_arguments)]
    fn range(
        &self,
        input: &str,
        node: NodeId,
        p: usize,
        shift: i64,
        lo: i64,
        hi: i64,
        noun: &'static str,
        op: String,
    ) -> IndexRange {
        IndexRange {
            input: input.to_string(),
            lo: lo.saturating_sub(shift),
            hi: hi.saturating_sub(shift),
            noun,
            op,
            at: self.location(p, node),
        }
    }

    /// `at FILE:LINE` of a node, or its name and the source's name where the source is not at
    /// hand.
    fn location(&self, p: usize, node: NodeId) -> String {
        self.source.location(self.graph(p), node)
    }

    /// The variable that `tensor` reads (through identities and Send/Recv pairs), as a table
    /// of rows.
    fn table(&self, mut p: usize, mut tensor: TensorRef) -> Option<Table> {
        for _ in 0..MAX_TABLE_STEPS {
            let graph = self.graph(p);
            let node = graph.node(tensor.node);
            match &node.op {
                Op::Read | Op::Identity => tensor = *graph.inputs(tensor.node).first()?,
                Op::Recv { key, .. } => {
                    let &(q, send) = self.sends.get(key.as_str())?;
                    p = q;
                    tensor = *self.graph(q).inputs(send).first()?;
                }
                Op::Variable { ty, origin, .. } => {
                    let rows = *ty.shape.dims().first()?;
                    // A shard (or a replica's copy of one) holds some rows of its origin.
                    let (name, shard) = match origin {
                        Some(o) => {
                            let whole = *o.shape.dims().first()?;
                            let part = whole != rows || o.offset != 0;
                            (
                                o.name.clone(),
                                part.then(|| Shard { name: o.name.clone(), offset: o.offset, rows: whole }),
                            )
                        }
                        None => (node.name.clone(), None),
                    };
                    return Some(Table { name, rows, shard });
                }
                _ => return None,
            }
        }
        None
    }
}

/// A variable that a gather looks up.
struct Table {
    name: String,
    rows: usize,
    /// Set where the variable is a shard of a partitioned one.
    shard: Option<Shard>,
}

/// The whole variable a shard is part of: its name and rows, and the shard's first row.
struct Shard {
    name: String,
    offset: usize,
    rows: usize,
}

/// The value of a scalar integer constant.
fn integer_scalar(graph: &Graph, tensor: TensorRef) -> Option<i64> {
    let Op::Const { value } = &graph.node(tensor.node).op else { return None };
    if value.shape.rank() != 0 {
        return None;
    }
    match &value.data {
        ConstData::I32(v) => v.first().map(|&x| i64::from(x)),
        ConstData::I64(v) => v.first().copied(),
        ConstData::U8(v) => v.first().map(|&x| i64::from(x)),
        _ => None,
    }
}

/// `input`, `input + 1`, `input - 2`.
fn shifted(input: &str, shift: i64) -> String {
    match shift {
        0 => input.to_string(),
        s if s > 0 => format!("{input} + {s}"),
        s => format!("{input} - {}", s.unsigned_abs()),
    }
}
