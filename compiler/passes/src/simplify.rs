//! Graph simplification in the manner of TensorFlow's Grappler, repeated until nothing changes:
//!
//! - **Constant folding.** A node whose operands are all constants becomes a constant in place
//!   (keeping its name, span, devices and control inputs) when its op is a cheap elementwise or
//!   shape op (`Unary`, `Binary`, `Compare`, `select`, `cast`, `reshape`, `broadcast_to`,
//!   `identity`) or a `sum`/`mean`, and the result has at most `MAX_FOLDED_ELEMENTS` elements.
//!   Values are computed in f64 (integers exactly) and converted to the node's dtype once. A
//!   fold whose result the runtime might compute differently, or fail on, is not done: NaN
//!   operands, integer results out of their type's range (the runtime wraps), integer division
//!   by zero and negative integer powers (run-time errors), float-to-integer casts out of range
//!   (the runtime saturates).
//! - **Algebraic identities**, only where the result has the type of `x` (broadcasting may
//!   change a shape): `x * 1`, `1 * x`, `x + 0`, `0 + x`, `x - 0`, `x / 1`, `neg(neg(x))`,
//!   `identity(x)`, `reshape` to `x`'s own shape, `transpose` by the identity permutation,
//!   `cast` to `x`'s own dtype, a slice of all of `x` and an all-reduce over one member are
//!   `x`. (`stop_gradient` stays: it matters to autodiff.)
//! - **Common subexpressions.** Nodes with the same op and attributes (constants compared bit
//!   for bit), the same operands in order, the same control inputs and the same requested and
//!   assigned devices are merged into the first in topological order. Stateful ops, `read`
//!   (two reads of one variable may see different values) and `input` are never merged.
//! - **Dead nodes.** Nodes that no output, metric, loss, gradient or update needs are removed;
//!   inputs, variables, assignments and exchanges stay, whatever uses them, except an
//!   all-reduce over one member.
//!
//! Users of a replaced tensor, and the module's outputs, metrics, loss and gradients, are
//! rewired to its replacement, except that the module's references never move to an `input`
//! (fetching a fed input is an error, see `prune`): the replaced node stays for them. Nor do a
//! gradient's users move to an input: replication finds the gradient that an update uses by the
//! module's reference to it. A node that has control inputs is never bypassed (its users would
//! lose the ordering).

use dfc_ir::{
    broadcast_shapes, BinaryOp, CompareOp, ConstData, ConstValue, DType, Graph, Module, NodeId, Op, ReduceKind, Shape,
    TensorRef, UnaryOp,
};
use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};

/// The largest constant that folding creates.
const MAX_FOLDED_ELEMENTS: usize = 1 << 16;

/// Simplifies `module` to a fixed point of the rules above.
pub fn simplify(module: &mut Module) {
    loop {
        let mut changed = fold_constants(module);
        changed |= apply_identities(module);
        changed |= merge_common_subexpressions(module);
        changed |= remove_dead_nodes(module);
        if !changed {
            break;
        }
    }
}

/// Makes every operand use of `old` a use of `new`, and records the move for the module's
/// references (`retarget`, once per rule: scanning every gradient per replacement made
/// simplifying quadratic in the layers).
fn replace(module: &mut Module, old: TensorRef, new: TensorRef, moved: &mut HashMap<TensorRef, TensorRef>) -> bool {
    // A gradient's users stay with it rather than move to an input (`gradient * 1` where the
    // gradient is a fed tensor, as with one example per replica): the module's references never
    // move to an input, and replication finds the gradient an update uses by that reference to
    // all-reduce it.
    if matches!(module.graph.node(new.node).op, Op::Input { .. }) && is_gradient(module, old, moved) {
        return false;
    }
    let changed = module.graph.replace_uses(old, new) > 0;
    moved.insert(old, new);
    changed
}

/// Whether `tensor` is a gradient of the module's training, where the replacements of this
/// rule so far (`moved`) are taking its references.
fn is_gradient(module: &Module, tensor: TensorRef, moved: &HashMap<TensorRef, TensorRef>) -> bool {
    let Some(training) = &module.training else { return false };
    training.gradients.iter().any(|&(_, mut gradient)| loop {
        if gradient == tensor {
            return true;
        }
        match moved.get(&gradient) {
            Some(&next) => gradient = next,
            None => return false,
        }
    })
}

/// Moves the module's references (outputs, metrics, loss, gradients) along `moved`. They are
/// not moved to an input: a caller that feeds the input could not fetch them (a tensor may not
/// be both fed and fetched), so the old tensor stays for them.
fn retarget(module: &mut Module, moved: &HashMap<TensorRef, TensorRef>) -> bool {
    if moved.is_empty() {
        return false;
    }
    let graph = &module.graph;
    let target = |mut t: TensorRef| {
        while let Some(&next) = moved.get(&t) {
            if matches!(graph.node(next.node).op, Op::Input { .. }) {
                break;
            }
            t = next;
        }
        t
    };
    let mut changed = false;
    let mut update = |t: &mut TensorRef| {
        let new = target(*t);
        changed |= new != *t;
        *t = new;
    };
    for output in module.outputs.iter_mut().chain(module.metrics.iter_mut()) {
        update(&mut output.tensor);
    }
    if let Some(training) = &mut module.training {
        update(&mut training.loss);
        for (_, gradient) in training.gradients.iter_mut() {
            update(gradient);
        }
    }
    changed
}

fn order(graph: &Graph) -> Vec<NodeId> {
    graph.topo_order().expect("simplify runs on verified, acyclic graphs")
}

// ---------------------------------------------------------------------------------------------
// Constant folding

fn fold_constants(module: &mut Module) -> bool {
    let mut changed = false;
    for id in order(&module.graph) {
        let graph = &module.graph;
        let node = graph.node(id);
        let foldable = matches!(
            node.op,
            Op::Unary(_)
                | Op::Binary(_)
                | Op::Compare(_)
                | Op::Select
                | Op::Cast { .. }
                | Op::Reshape { .. }
                | Op::BroadcastTo { .. }
                | Op::Identity
                | Op::Reduce { kind: ReduceKind::Sum | ReduceKind::Mean, .. }
        );
        if !foldable || node.outputs.len() != 1 || node.outputs[0].shape.n_elements() > MAX_FOLDED_ELEMENTS {
            continue;
        }
        let inputs = graph.inputs(id);
        let operands: Option<Vec<&ConstValue>> = inputs
            .iter()
            .map(|t| match &graph.node(t.node).op {
                Op::Const { value } => Some(value),
                _ => None,
            })
            .collect();
        let Some(operands) = operands.filter(|o| !o.is_empty()) else { continue };
        let ty = &node.outputs[0];
        let Some(value) = evaluate(&node.op, &operands, ty.dtype, &ty.shape) else { continue };
        debug_assert_eq!(value.ty(), *ty, "folding `{}` changed its type", node.name);
        module.graph.clear_inputs(id);
        module.graph.node_mut(id).op = Op::Const { value };
        changed = true;
    }
    changed
}

/// Values while folding: floats as f64 (already rounded to their dtype), integers and booleans
/// exactly.
enum Values {
    Float(Vec<f64>),
    Int(Vec<i128>),
}

fn load(value: &ConstValue) -> Values {
    match &value.data {
        ConstData::F32(v) => Values::Float(v.iter().map(|&x| x as f64).collect()),
        ConstData::F64(v) => Values::Float(v.clone()),
        ConstData::I32(v) => Values::Int(v.iter().map(|&x| x as i128).collect()),
        ConstData::I64(v) => Values::Int(v.iter().map(|&x| x as i128).collect()),
        ConstData::U8(v) => Values::Int(v.iter().map(|&x| x as i128).collect()),
        ConstData::Bool(v) => Values::Int(v.iter().map(|&x| x as i128).collect()),
    }
}

/// `values` as a constant of `dtype`, or `None` when an integer does not fit.
fn store(dtype: DType, shape: &Shape, values: Values) -> Option<ConstValue> {
    let ints = |v: Vec<i128>, min: i128, max: i128| v.iter().all(|x| (min..=max).contains(x)).then_some(v);
    let data = match (dtype, values) {
        (DType::F32, Values::Float(v)) => ConstData::F32(v.iter().map(|&x| x as f32).collect()),
        (DType::F64, Values::Float(v)) => ConstData::F64(v),
        (DType::I32, Values::Int(v)) => {
            ConstData::I32(ints(v, i32::MIN.into(), i32::MAX.into())?.into_iter().map(|x| x as i32).collect())
        }
        (DType::I64, Values::Int(v)) => {
            ConstData::I64(ints(v, i64::MIN.into(), i64::MAX.into())?.into_iter().map(|x| x as i64).collect())
        }
        (DType::U8, Values::Int(v)) => ConstData::U8(ints(v, 0, 255)?.into_iter().map(|x| x as u8).collect()),
        (DType::Bool, Values::Int(v)) => ConstData::Bool(ints(v, 0, 1)?.into_iter().map(|x| x == 1).collect()),
        _ => return None,
    };
    Some(ConstValue { shape: shape.clone(), data })
}

/// The value of `op` on constant operands, of type `dtype[shape]` (the node's output type).
fn evaluate(op: &Op, operands: &[&ConstValue], dtype: DType, shape: &Shape) -> Option<ConstValue> {
    let values: Vec<Values> = operands.iter().map(|c| load(c)).collect();
    if values.iter().any(|v| matches!(v, Values::Float(f) if f.iter().any(|x| x.is_nan()))) {
        return None;
    }
    // Each operand's values at every element of the (broadcast) result.
    let spread = |i: usize| broadcast_index(&operands[i].shape, shape);
    let result = match op {
        Op::Identity | Op::Reshape { .. } => values.into_iter().next()?,
        Op::BroadcastTo { .. } => gather(&values[0], &spread(0)?),
        Op::Unary(unary) => unary_values(*unary, &values[0])?,
        Op::Binary(binary) => {
            let (a, b) = (gather(&values[0], &spread(0)?), gather(&values[1], &spread(1)?));
            binary_values(*binary, a, b)?
        }
        Op::Compare(compare) => {
            let (a, b) = (gather(&values[0], &spread(0)?), gather(&values[1], &spread(1)?));
            let holds = |o: std::cmp::Ordering| match compare {
                CompareOp::Equal => o.is_eq(),
                CompareOp::NotEqual => o.is_ne(),
                CompareOp::Less => o.is_lt(),
                CompareOp::LessEqual => o.is_le(),
                CompareOp::Greater => o.is_gt(),
                CompareOp::GreaterEqual => o.is_ge(),
            };
            let flags: Vec<bool> = match (a, b) {
                (Values::Float(a), Values::Float(b)) => {
                    a.iter().zip(&b).map(|(x, y)| x.partial_cmp(y).is_some_and(holds)).collect()
                }
                (Values::Int(a), Values::Int(b)) => a.iter().zip(&b).map(|(x, y)| holds(x.cmp(y))).collect(),
                _ => return None,
            };
            Values::Int(flags.into_iter().map(i128::from).collect())
        }
        Op::Select => {
            let Values::Int(cond) = gather(&values[0], &spread(0)?) else { return None };
            match (gather(&values[1], &spread(1)?), gather(&values[2], &spread(2)?)) {
                (Values::Float(a), Values::Float(b)) => Values::Float(
                    cond.iter().zip(a.iter().zip(&b)).map(|(c, (x, y))| if *c != 0 { *x } else { *y }).collect(),
                ),
                (Values::Int(a), Values::Int(b)) => Values::Int(
                    cond.iter().zip(a.iter().zip(&b)).map(|(c, (x, y))| if *c != 0 { *x } else { *y }).collect(),
                ),
                _ => return None,
            }
        }
        Op::Cast { to } => cast_values(&values[0], *to)?,
        Op::Reduce { kind, axes, .. } => reduce_values(*kind, axes, &operands[0].shape, &values[0])?,
        _ => return None,
    };
    store(dtype, shape, round_to(dtype, result))
}

/// Floats rounded to `dtype`'s precision, so that every later step sees what the runtime holds.
fn round_to(dtype: DType, values: Values) -> Values {
    match (dtype, values) {
        (DType::F32, Values::Float(v)) => Values::Float(v.into_iter().map(|x| x as f32 as f64).collect()),
        (_, values) => values,
    }
}

/// For each element of a result of shape `to`, the index of the element of `from` that NumPy
/// broadcasting reads there; `None` if `from` does not broadcast to `to`.
fn broadcast_index(from: &Shape, to: &Shape) -> Option<Vec<usize>> {
    if broadcast_shapes(from, to).as_ref() != Some(to) {
        return None;
    }
    let (rank, extra) = (to.rank(), to.rank() - from.rank());
    // The stride of each result axis in `from`: 0 where it is broadcast.
    let mut strides = vec![0; rank];
    let mut stride = 1;
    for axis in (extra..rank).rev() {
        let size = from.0[axis - extra];
        if size != 1 {
            strides[axis] = stride;
        }
        stride *= size;
    }
    let mut index = Vec::with_capacity(to.n_elements());
    let mut position = vec![0; rank];
    for _ in 0..to.n_elements() {
        index.push(position.iter().zip(&strides).map(|(p, s)| p * s).sum());
        for axis in (0..rank).rev() {
            position[axis] += 1;
            if position[axis] < to.0[axis] {
                break;
            }
            position[axis] = 0;
        }
    }
    Some(index)
}

fn gather(values: &Values, index: &[usize]) -> Values {
    match values {
        Values::Float(v) => Values::Float(index.iter().map(|&i| v[i]).collect()),
        Values::Int(v) => Values::Int(index.iter().map(|&i| v[i]).collect()),
    }
}

fn unary_values(op: UnaryOp, values: &Values) -> Option<Values> {
    Some(match values {
        Values::Float(v) => Values::Float(
            v.iter()
                .map(|&x| match op {
                    UnaryOp::Neg => -x,
                    UnaryOp::Abs => x.abs(),
                    UnaryOp::Exp => x.exp(),
                    UnaryOp::Log => x.ln(),
                    UnaryOp::Sqrt => x.sqrt(),
                    UnaryOp::Rsqrt => 1.0 / x.sqrt(),
                    // max(x, 0) keeping -0.0, as the runtime's `maximum(x, 0)`.
                    UnaryOp::Relu => {
                        if x < 0.0 {
                            0.0
                        } else {
                            x
                        }
                    }
                    UnaryOp::Sigmoid => 1.0 / (1.0 + (-x).exp()),
                    UnaryOp::Tanh => x.tanh(),
                })
                .collect(),
        ),
        Values::Int(v) => Values::Int(
            v.iter()
                .map(|&x| match op {
                    UnaryOp::Neg => Some(-x),
                    UnaryOp::Abs => Some(x.abs()),
                    UnaryOp::Relu => Some(x.max(0)),
                    _ => None,
                })
                .collect::<Option<_>>()?,
        ),
    })
}

fn binary_values(op: BinaryOp, a: Values, b: Values) -> Option<Values> {
    Some(match (a, b) {
        (Values::Float(a), Values::Float(b)) => Values::Float(
            a.iter()
                .zip(&b)
                .map(|(&x, &y)| match op {
                    BinaryOp::Add => x + y,
                    BinaryOp::Sub => x - y,
                    BinaryOp::Mul => x * y,
                    BinaryOp::Div => x / y,
                    BinaryOp::Pow => x.powf(y),
                    BinaryOp::Maximum => x.max(y),
                    BinaryOp::Minimum => x.min(y),
                })
                .collect(),
        ),
        (Values::Int(a), Values::Int(b)) => Values::Int(
            a.iter()
                .zip(&b)
                .map(|(&x, &y)| match op {
                    // Operands fit in 64 bits, so these cannot overflow 128; `store` checks the
                    // result's range.
                    BinaryOp::Add => Some(x + y),
                    BinaryOp::Sub => Some(x - y),
                    BinaryOp::Mul => Some(x * y),
                    // Truncating; division by zero is left to the runtime.
                    BinaryOp::Div => (y != 0).then(|| x / y),
                    BinaryOp::Pow => u32::try_from(y).ok().and_then(|y| x.checked_pow(y)),
                    BinaryOp::Maximum => Some(x.max(y)),
                    BinaryOp::Minimum => Some(x.min(y)),
                })
                .collect::<Option<_>>()?,
        ),
        _ => return None,
    })
}

fn cast_values(values: &Values, to: DType) -> Option<Values> {
    Some(match (values, to) {
        (Values::Float(v), DType::Bool) => Values::Int(v.iter().map(|&x| i128::from(x != 0.0)).collect()),
        (Values::Float(v), to) if to.is_float() => Values::Float(v.clone()),
        // Truncation toward zero, as `as` and C do; values out of range are not folded.
        (Values::Float(v), _) => Values::Int(
            v.iter().map(|&x| (x.is_finite() && x.abs() < 1e30).then(|| x.trunc() as i128)).collect::<Option<_>>()?,
        ),
        (Values::Int(v), DType::Bool) => Values::Int(v.iter().map(|&x| i128::from(x != 0)).collect()),
        // One rounding, straight to the target precision.
        (Values::Int(v), DType::F32) => Values::Float(v.iter().map(|&x| x as f32 as f64).collect()),
        (Values::Int(v), DType::F64) => Values::Float(v.iter().map(|&x| x as f64).collect()),
        (Values::Int(v), _) => Values::Int(v.clone()),
    })
}

fn reduce_values(kind: ReduceKind, axes: &[usize], shape: &Shape, values: &Values) -> Option<Values> {
    // The result element each input element adds to: its index with the reduced axes dropped.
    let dims = shape.dims();
    let kept: Vec<usize> = (0..dims.len()).filter(|a| !axes.contains(a)).collect();
    let n_out: usize = kept.iter().map(|&a| dims[a]).product();
    let mut target = Vec::with_capacity(shape.n_elements());
    let mut position = vec![0; dims.len()];
    for _ in 0..shape.n_elements() {
        target.push(kept.iter().fold(0, |flat, &a| flat * dims[a] + position[a]));
        for axis in (0..dims.len()).rev() {
            position[axis] += 1;
            if position[axis] < dims[axis] {
                break;
            }
            position[axis] = 0;
        }
    }
    let count = axes.iter().map(|&a| dims[a]).product::<usize>();
    Some(match (kind, values) {
        (ReduceKind::Sum | ReduceKind::Mean, Values::Float(v)) => {
            let mut sums = vec![0.0; n_out];
            for (x, &t) in v.iter().zip(&target) {
                sums[t] += x;
            }
            if kind == ReduceKind::Mean {
                sums.iter_mut().for_each(|s| *s /= count as f64);
            }
            Values::Float(sums)
        }
        // Exact sums (the operands fit in 64 bits, so no more than 2^64 of them overflow); an
        // integer mean truncates toward zero.
        (ReduceKind::Sum | ReduceKind::Mean, Values::Int(v)) => {
            let mut sums = vec![0i128; n_out];
            for (x, &t) in v.iter().zip(&target) {
                sums[t] = sums[t].checked_add(*x)?;
            }
            if kind == ReduceKind::Mean {
                let count = i128::try_from(count).ok().filter(|&c| c > 0)?;
                sums.iter_mut().for_each(|s| *s /= count);
            }
            Values::Int(sums)
        }
        _ => return None,
    })
}

// ---------------------------------------------------------------------------------------------
// Algebraic identities

fn apply_identities(module: &mut Module) -> bool {
    let mut changed = false;
    let mut moved = HashMap::new();
    for id in order(&module.graph) {
        if let Some(x) = identity_operand(&module.graph, id) {
            changed |= replace(module, id.into(), x, &mut moved);
        }
    }
    changed | retarget(module, &moved)
}

/// The operand `x` that node `id` equals by an algebraic identity, with the same type.
fn identity_operand(graph: &Graph, id: NodeId) -> Option<TensorRef> {
    let node = graph.node(id);
    if node.outputs.len() != 1 || !graph.control_inputs(id).is_empty() {
        return None;
    }
    let inputs = graph.inputs(id);
    let constant = |t: TensorRef, value: f64| match &graph.node(t.node).op {
        Op::Const { value: c } => c.to_f64().iter().all(|&v| v == value),
        _ => false,
    };
    let x = match &node.op {
        Op::Identity => inputs[0],
        Op::Reshape { shape } if *shape == graph.ty(inputs[0]).shape => inputs[0],
        Op::Transpose { perm } if perm.iter().enumerate().all(|(i, &p)| i == p) => inputs[0],
        Op::Cast { to } if *to == graph.ty(inputs[0]).dtype => inputs[0],
        // Summed over one member (a replica alone).
        Op::AllReduce { group_size: 1, .. } => inputs[0],
        Op::Slice { begin, .. } if begin.iter().all(|&b| b == 0) => inputs[0],
        Op::Unary(UnaryOp::Neg) => {
            let inner = inputs[0].node;
            let double =
                matches!(graph.node(inner).op, Op::Unary(UnaryOp::Neg)) && graph.control_inputs(inner).is_empty();
            if !double {
                return None;
            }
            graph.inputs(inner)[0]
        }
        Op::Binary(op) => {
            let (a, b) = (inputs[0], inputs[1]);
            match op {
                BinaryOp::Mul if constant(b, 1.0) => a,
                BinaryOp::Mul if constant(a, 1.0) => b,
                BinaryOp::Add if constant(b, 0.0) => a,
                BinaryOp::Add if constant(a, 0.0) => b,
                BinaryOp::Sub if constant(b, 0.0) => a,
                BinaryOp::Div if constant(b, 1.0) => a,
                _ => return None,
            }
        }
        _ => return None,
    };
    (*graph.ty(x) == node.outputs[0]).then_some(x)
}

// ---------------------------------------------------------------------------------------------
// Common subexpressions

fn merge_common_subexpressions(module: &mut Module) -> bool {
    let mut changed = false;
    let mut moved = HashMap::new();
    // Candidates by (op fingerprint, operands, control inputs).
    let mut seen: HashMap<(u64, Vec<TensorRef>, Vec<NodeId>), Vec<NodeId>> = HashMap::new();
    for id in order(&module.graph) {
        let graph = &module.graph;
        let node = graph.node(id);
        if matches!(node.op, Op::Input { .. } | Op::Read) || node.op.is_stateful() {
            continue;
        }
        let key = (fingerprint(&node.op), graph.inputs(id), graph.control_inputs(id));
        let candidates = seen.entry(key).or_default();
        let twin = candidates.iter().copied().find(|&other| {
            let first = graph.node(other);
            same_op(&first.op, &node.op)
                && first.requested_device == node.requested_device
                && first.device == node.device
                && first.outputs == node.outputs
        });
        let ports = node.outputs.len() as u32;
        match twin {
            Some(first) => {
                for port in 0..ports {
                    let (old, new) = (TensorRef { node: id, port }, TensorRef { node: first, port });
                    changed |= replace(module, old, new, &mut moved);
                }
            }
            None => candidates.push(id),
        }
    }
    changed | retarget(module, &moved)
}

/// A hash of the op with its attributes; constants by the bits of their values.
fn fingerprint(op: &Op) -> u64 {
    let mut hasher = DefaultHasher::new();
    match op {
        Op::Const { value } => {
            value.shape.hash(&mut hasher);
            const_bits(value).hash(&mut hasher);
        }
        // No other mergeable op holds a float, so the debug text is exact.
        op => format!("{op:?}").hash(&mut hasher),
    }
    hasher.finish()
}

/// Ops equal, constants bit for bit (so that 0.0 and -0.0 differ and NaN equals itself).
fn same_op(a: &Op, b: &Op) -> bool {
    match (a, b) {
        (Op::Const { value: x }, Op::Const { value: y }) => x.shape == y.shape && const_bits(x) == const_bits(y),
        _ => a == b,
    }
}

/// The dtype and the bits of every element.
fn const_bits(value: &ConstValue) -> (DType, Vec<u64>) {
    let bits = match &value.data {
        ConstData::F32(v) => v.iter().map(|x| x.to_bits() as u64).collect(),
        ConstData::F64(v) => v.iter().map(|x| x.to_bits()).collect(),
        ConstData::I32(v) => v.iter().map(|&x| x as u64).collect(),
        ConstData::I64(v) => v.iter().map(|&x| x as u64).collect(),
        ConstData::U8(v) => v.iter().map(|&x| x as u64).collect(),
        ConstData::Bool(v) => v.iter().map(|&x| x as u64).collect(),
    };
    (value.dtype(), bits)
}

// ---------------------------------------------------------------------------------------------
// Dead nodes

fn remove_dead_nodes(module: &mut Module) -> bool {
    let graph = &module.graph;
    let mut roots: Vec<NodeId> = module.outputs.iter().chain(&module.metrics).map(|o| o.tensor.node).collect();
    if let Some(training) = &module.training {
        roots.push(training.loss.node);
        roots.extend(training.gradients.iter().flat_map(|(v, g)| [*v, g.node]));
        roots.extend(&training.updates);
    }
    // An all-reduce over one member waits for no one: unused, it is dead like any other node.
    roots.extend(graph.node_ids().filter(|&id| {
        let op = &graph.node(id).op;
        matches!(op, Op::Input { .. }) || (op.is_stateful() && !matches!(op, Op::AllReduce { group_size: 1, .. }))
    }));
    let live = graph.ancestors(&roots);
    let dead: Vec<NodeId> = graph.node_ids().filter(|id| !live.contains(id)).collect();
    for &id in &dead {
        module.graph.remove(id);
    }
    !dead.is_empty()
}
