//! fuse: groups elementwise chains with the reduction, row op or assignment they feed into loop
//! kernels, as XLA's loop and input fusion do, so that a chain reads its inputs and writes its
//! result once.
//!
//! A kernel has one root, the only node of it whose value leaves it; the other members are
//! computed inside the root's loop nest, at the root's index. Because every member is an
//! ancestor of the root and no member's value is needed elsewhere, a program needs a kernel
//! exactly when it needs the root: any set of fetches selects whole kernels.
//!
//! - Roots are elementwise ops ([`is_elementwise`]), reductions (`sum`, `mean`, `max`, `min`),
//!   row ops over the last axis (`softmax`, `log_softmax`, `softmax_cross_entropy`, `argmax`)
//!   and assignments (the value is computed into the variable's buffer in place).
//! - An elementwise node is fused into its consumers when every consumer is a kernel that can
//!   take it and it is not kept (fetched, controlled, or named in `keep`). A node whose
//!   consumers lie in several kernels is recomputed in each when it is cheap (one arithmetic
//!   op); otherwise it becomes a root of its own and its value is stored.
//! - Everything else (matrix products, convolutions, pooling, gathers, layout ops, exchanges)
//!   is not a kernel: the backend runs it by a library call.

use dfc_ir::{BinaryOp, DType, Module, NodeId, Op, TensorRef, UnaryOp};
use std::collections::{BTreeSet, HashMap, HashSet};

/// The kernels of a module, roots in topological order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Fusion {
    pub kernels: Vec<Kernel>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Kernel {
    pub root: NodeId,
    /// The nodes computed inside the kernel, operands before users; the root last.
    pub members: Vec<NodeId>,
    /// The values it reads from outside, in argument order (each once).
    pub inputs: Vec<TensorRef>,
}

impl Fusion {
    /// The kernel whose root is `id`.
    pub fn kernel_of(&self, id: NodeId) -> Option<&Kernel> {
        self.kernels.iter().find(|k| k.root == id)
    }
}

/// Elementwise ops the loop kernels compute, on the element types they handle.
pub fn is_elementwise(module: &Module, id: NodeId) -> bool {
    let graph = &module.graph;
    let node = graph.node(id);
    if node.outputs.len() != 1 || !supported_dtype(node.outputs[0].dtype) {
        return false;
    }
    if graph.inputs(id).iter().any(|t| !supported_dtype(graph.ty(*t).dtype)) {
        return false;
    }
    let dtype = node.outputs[0].dtype;
    match &node.op {
        Op::Unary(op) => dtype.is_float() || matches!(op, UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Relu),
        // Integer division and powers fail on some operands; the library reports it.
        Op::Binary(BinaryOp::Div | BinaryOp::Pow) => dtype.is_float(),
        Op::Binary(_) | Op::Compare(_) | Op::Select | Op::Cast { .. } | Op::BroadcastTo { .. } => true,
        Op::Identity | Op::StopGradient => true,
        Op::OneHot { .. } => true,
        Op::RandomUniform { .. } | Op::RandomNormal { .. } => true,
        Op::SigmoidCrossEntropy => dtype.is_float(),
        _ => false,
    }
}

fn supported_dtype(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F64 | DType::I32 | DType::I64 | DType::U8 | DType::Bool)
}

/// Roots that are not elementwise: reductions, row ops over the last axis, assignments.
pub fn is_reduction_root(module: &Module, id: NodeId) -> bool {
    let graph = &module.graph;
    let node = graph.node(id);
    let operands = graph.inputs(id);
    let last_axis = |axis: usize| operands.first().is_some_and(|t| axis + 1 == graph.ty(*t).shape.rank());
    match &node.op {
        Op::Reduce { kind, .. } => {
            let dtype = node.outputs[0].dtype;
            supported_dtype(dtype) && dtype != DType::Bool && (dtype.is_float() || *kind != dfc_ir::ReduceKind::Mean)
        }
        Op::Softmax { axis } | Op::LogSoftmax { axis } => node.outputs[0].dtype.is_float() && last_axis(*axis),
        Op::SoftmaxCrossEntropy | Op::LayerNorm { .. } | Op::LayerNormGrad { .. } => node.outputs[0].dtype.is_float(),
        Op::ArgMax { axis, .. } => {
            last_axis(*axis) && operands.first().is_some_and(|t| supported_dtype(graph.ty(*t).dtype))
        }
        // A plain assignment copies any element type; `+=` and `-=` need arithmetic.
        Op::Assign => supported_dtype(node.outputs[0].dtype),
        Op::AssignAdd | Op::AssignSub => supported_dtype(node.outputs[0].dtype) && node.outputs[0].dtype != DType::Bool,
        _ => false,
    }
}

/// A cheap elementwise op, recomputed rather than stored when several kernels use it.
fn is_cheap(module: &Module, id: NodeId) -> bool {
    match &module.graph.node(id).op {
        Op::Unary(op) => matches!(op, UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Relu),
        Op::Binary(op) => {
            matches!(op, BinaryOp::Add | BinaryOp::Sub | BinaryOp::Mul | BinaryOp::Maximum | BinaryOp::Minimum)
        }
        Op::Compare(_) | Op::Select | Op::Cast { .. } | Op::BroadcastTo { .. } | Op::OneHot { .. } => true,
        Op::Identity | Op::StopGradient => true,
        _ => false,
    }
}

/// The kernels of `module`. Nodes in `keep` (fetched values) stay roots so their values are
/// stored. Nodes that are neither elementwise nor reduction roots are left out.
pub fn fuse(module: &Module, keep: &[NodeId]) -> Fusion {
    let graph = &module.graph;
    let Ok(order) = graph.topo_order() else {
        return Fusion::default();
    };
    let keep: HashSet<NodeId> = keep.iter().copied().collect();
    let mut consumers: HashMap<NodeId, Vec<NodeId>> = HashMap::new();
    for &id in &order {
        for t in graph.inputs(id) {
            consumers.entry(t.node).or_default().push(id);
        }
    }
    let has_control_users = |id: NodeId| graph.users(id).iter().any(|u| graph.control_inputs(*u).contains(&id));

    // The kernels each node is computed in, decided users first.
    let mut kernels_of: HashMap<NodeId, BTreeSet<NodeId>> = HashMap::new();
    let mut roots: Vec<NodeId> = Vec::new();
    for &id in order.iter().rev() {
        let elementwise = is_elementwise(module, id);
        if !elementwise && !is_reduction_root(module, id) {
            continue;
        }
        let users = consumers.get(&id).map(Vec::as_slice).unwrap_or(&[]);
        let fusible_into = |user: &NodeId| -> Option<BTreeSet<NodeId>> {
            let set = kernels_of.get(user)?;
            // A reduction or row op takes producers of its operand; an assignment of its
            // value (operand 1), never the variable.
            let user_node = graph.node(*user);
            if matches!(user_node.op, Op::Assign | Op::AssignAdd | Op::AssignSub)
                && graph.inputs(*user).first().is_some_and(|t| t.node == id)
            {
                return None;
            }
            Some(set.clone())
        };
        let mut fused_into: BTreeSet<NodeId> = BTreeSet::new();
        let mut fusible = elementwise && !users.is_empty() && !keep.contains(&id) && !has_control_users(id);
        if fusible {
            for user in users {
                match fusible_into(user) {
                    Some(set) => fused_into.extend(set),
                    None => {
                        fusible = false;
                        break;
                    }
                }
            }
        }
        if fusible && (fused_into.len() == 1 || (is_cheap(module, id) && fused_into.len() <= 4)) {
            kernels_of.insert(id, fused_into);
        } else {
            kernels_of.insert(id, BTreeSet::from([id]));
            roots.push(id);
        }
    }

    let mut kernels = Vec::with_capacity(roots.len());
    let position: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &id)| (id, i)).collect();
    roots.sort_by_key(|r| position[r]);
    let mut members_of: HashMap<NodeId, Vec<NodeId>> = HashMap::new();
    for &id in &order {
        if let Some(set) = kernels_of.get(&id) {
            for &root in set {
                members_of.entry(root).or_default().push(id);
            }
        }
    }
    for root in roots {
        let members = members_of.remove(&root).unwrap_or_default();
        let inside: HashSet<NodeId> = members.iter().copied().collect();
        let mut inputs: Vec<TensorRef> = Vec::new();
        for &m in &members {
            for t in graph.inputs(m) {
                if !inside.contains(&t.node) && !inputs.contains(&t) {
                    inputs.push(t);
                }
            }
        }
        kernels.push(Kernel { root, members, inputs });
    }
    Fusion { kernels }
}

/// The value of a scalar f32 constant.
pub fn scalar_const(module: &Module, t: TensorRef) -> Option<f32> {
    match &module.graph.node(t.node).op {
        Op::Const { value } if value.shape.n_elements() == 1 => match &value.data {
            dfc_ir::ConstData::F32(v) => Some(v[0]),
            _ => None,
        },
        _ => None,
    }
}

/// The product and α when the assignment kernel of `root` and `members` computes `v -= c·(a·b)`
/// or `v += c·(a·b)` (c a scalar constant, or absent) of an f32 matrix product that nothing
/// else needs (`only_user(value, user)`: `value`'s only use is by `user`), which reads nothing
/// stored in `v`. The CPU back end runs it as `v += α·a·b`, one GEMM that writes `v` once and
/// stores no gradient (SGD's update of a dense layer's weights); the cost model prices it so.
pub fn folded_update(
    module: &Module,
    root: NodeId,
    members: &[NodeId],
    only_user: impl Fn(NodeId, NodeId) -> bool,
) -> Option<(NodeId, f32)> {
    let graph = &module.graph;
    let sign = match graph.node(root).op {
        Op::AssignSub => -1.0,
        Op::AssignAdd => 1.0,
        _ => return None,
    };
    let [variable, value] = graph.inputs(root)[..] else { return None };
    let is_product = |t: TensorRef| matches!(graph.node(t.node).op, Op::MatMul { .. });
    let (product, scale) = match graph.node(value.node).op {
        Op::MatMul { .. } if members == [root] => (value.node, 1.0),
        Op::Binary(BinaryOp::Mul) if members == [value.node, root] && only_user(value.node, root) => {
            match graph.inputs(value.node)[..] {
                [c, p] | [p, c] if is_product(p) && scalar_const(module, c).is_some() => {
                    (p.node, scalar_const(module, c)?)
                }
                _ => return None,
            }
        }
        _ => return None,
    };
    let ty = &graph.node(product).outputs[0];
    let stored = |t: TensorRef| {
        let mut id = t.node;
        while matches!(graph.node(id).op, Op::Read | Op::Reshape { .. } | Op::Identity | Op::StopGradient) {
            id = graph.inputs(id)[0].node;
        }
        id == variable.node
    };
    let fits = ty.dtype == DType::F32 && ty.shape.rank() == 2 && *ty == *graph.ty(variable);
    let operands = graph.inputs(product);
    let plain = operands.iter().all(|t| graph.ty(*t).shape.rank() == 2 && !stored(*t));
    let user = if product == value.node { root } else { value.node };
    (fits && plain && only_user(product, user)).then_some((product, sign * scale))
}
