//! Max pooling moved before the activation it follows: `max_pool(relu(conv + bias))` becomes
//! `relu(max_pool(conv) + bias)`, so that the bias and the activation (and, in training, their
//! gradients) run on the pooled tensor, a quarter of the size for 2×2 windows.
//!
//! The rewrite holds exactly for a chain of elementwise ops that are each non-decreasing in the
//! pooled operand and the same over every window: `relu`, `identity`, and `add`, `sub` (the
//! pooled operand first), `maximum` and `minimum` with an operand that is constant over the
//! height and width axes (broadcast along them, as a bias is). A non-decreasing `f` keeps the
//! window's order, so `max f(x) = f(max x)`; IEEE rounding is monotone, so this holds bit for
//! bit in floating point. Only the gradient's routing on ties can differ: the first maximum of
//! `f(x)` in a window, where `f` made equal values of distinct `x` (relu's zeros, whose
//! gradient is zero either way, or sums rounded alike).
//!
//! A chain qualifies when each of its nodes has the pool as its one user (directly or through
//! the chain), is no output, metric or loss of the module, has no control inputs, and is a
//! float of the pool input's shape. Runs before autodiff, so that the gradients are those of
//! the reordered graph.

use dfc_ir::{BinaryOp, Module, NodeId, Op, TensorRef, UnaryOp};
use std::collections::HashSet;

/// Moves each `max_pool` of a qualifying chain before the chain.
pub fn pool_early(module: &mut Module) {
    let order = module.graph.topo_order().expect("pool_early runs on verified, acyclic graphs");
    let mut referenced: HashSet<TensorRef> =
        module.outputs.iter().chain(&module.metrics).map(|output| output.tensor).collect();
    if let Some(training) = &module.training {
        referenced.insert(training.loss);
    }
    for pool in order {
        if !matches!(module.graph.node(pool).op, Op::MaxPool { .. }) || has_control_inputs(module, pool) {
            continue;
        }
        let chain = chain_before(module, pool, &referenced);
        if !chain.is_empty() {
            move_before(module, pool, &chain, &mut referenced);
        }
    }
}

/// The qualifying chain that feeds `pool`, from the node feeding it back to the one reading the
/// tensor to pool; each with the operand that carries the pooled value.
fn chain_before(module: &Module, pool: NodeId, referenced: &HashSet<TensorRef>) -> Vec<(NodeId, u32)> {
    let graph = &module.graph;
    let mut chain = Vec::new();
    let (mut user, mut tensor) = (pool, graph.inputs(pool)[0]);
    loop {
        let node = graph.node(tensor.node);
        let alone = graph.users(tensor.node) == [user]
            && graph.inputs(user).iter().filter(|&&input| input == tensor).count() == 1;
        if !alone
            || node.outputs.len() != 1
            || referenced.contains(&tensor)
            || has_control_inputs(module, tensor.node)
            || node.requested_device != graph.node(pool).requested_device
        {
            break;
        }
        let Some(operand) = pooled_operand(module, tensor.node) else { break };
        let source = graph.inputs(tensor.node)[operand as usize];
        if *graph.ty(source) != node.outputs[0] || !node.outputs[0].dtype.is_float() {
            break;
        }
        chain.push((tensor.node, operand));
        (user, tensor) = (tensor.node, source);
    }
    chain
}

/// Which operand of `id` the pooled value flows through, when `id` is non-decreasing in it and
/// its other operand (if any) is the same over every window.
fn pooled_operand(module: &Module, id: NodeId) -> Option<u32> {
    let graph = &module.graph;
    let inputs = graph.inputs(id);
    let rank = graph.node(id).outputs[0].shape.rank();
    let window_constant = |t: TensorRef| {
        let dims = graph.ty(t).shape.dims();
        // The height and width axes (1 and 2 of NHWC), right-aligned as broadcasting does.
        dims.len() <= rank && [1, 2].iter().all(|&axis| axis + dims.len() < rank || dims[axis + dims.len() - rank] == 1)
    };
    match graph.node(id).op {
        Op::Unary(UnaryOp::Relu) | Op::Identity => Some(0),
        Op::Binary(BinaryOp::Add | BinaryOp::Maximum | BinaryOp::Minimum) => {
            if window_constant(inputs[1]) {
                Some(0)
            } else if window_constant(inputs[0]) {
                Some(1)
            } else {
                None
            }
        }
        Op::Binary(BinaryOp::Sub) => window_constant(inputs[1]).then_some(0),
        _ => None,
    }
}

fn has_control_inputs(module: &Module, id: NodeId) -> bool {
    !module.graph.control_inputs(id).is_empty()
}

/// `pool` reads what the chain's first node read, the chain reads the pooled tensor, and the
/// pool's users (and the module's references to it) read the chain's last node. `chain` is
/// `chain_before`'s, not empty: its last entry is the first node in data order.
fn move_before(module: &mut Module, pool: NodeId, chain: &[(NodeId, u32)], referenced: &mut HashSet<TensorRef>) {
    let (first, operand) = chain[chain.len() - 1];
    let last = TensorRef::from(chain[0].0);
    let pooled = TensorRef::from(pool);
    let source = module.graph.inputs(first)[operand as usize];
    let pooled_type = module.graph.node(pool).outputs[0].clone();
    module.graph.replace_uses(pooled, last);
    module.graph.set_input(pool, 0, source);
    module.graph.set_input(first, operand, pooled);
    for &(id, _) in chain {
        module.graph.node_mut(id).outputs[0] = pooled_type.clone();
    }
    let retarget = |t: &mut TensorRef| {
        if *t == pooled {
            *t = last;
        }
    };
    for output in module.outputs.iter_mut().chain(module.metrics.iter_mut()) {
        retarget(&mut output.tensor);
    }
    if let Some(training) = &mut module.training {
        retarget(&mut training.loss);
    }
    if referenced.remove(&pooled) {
        referenced.insert(last);
    }
}
