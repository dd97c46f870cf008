//! Reverse-mode automatic differentiation: adds to the graph the gradient of the loss with
//! respect to every trainable variable, built from ordinary IR ops, and records them in
//! `Training::gradients`.
//!
//! Gradients flow only through floating-point values. A tensor with several consumers gets the
//! sum of their contributions; a broadcast operand gets its gradient summed back to its own
//! shape; `stop_gradient`, comparisons, `argmax`, `one_hot` and integer operands stop the flow.
//! Every gradient node is named `gradients/<forward node>/<op>` and carries the span of the
//! forward node it differentiates, so an error in it still points at the source line.

use dfc_ir::{
    BinaryOp, CompareOp, ConstValue, DType, Graph, Module, NodeId, Op, ReduceKind, Shape, TensorRef, TensorType,
    UnaryOp,
};
use std::collections::{BTreeMap, BTreeSet};

/// Adds the gradients of the loss. Does nothing for a module without `minimize`. A trainable
/// variable that the loss does not depend on gets no gradient (sema warns about it).
pub fn autodiff(module: &mut Module) {
    let Some(training) = &module.training else { return };
    let loss = training.loss;
    let graph = &mut module.graph;

    let trainable: Vec<NodeId> = module
        .params
        .iter()
        .copied()
        .filter(|&v| matches!(graph.node(v).op, Op::Variable { trainable: true, .. }))
        .collect();
    let relevant = relevant_nodes(graph, &trainable, loss.node);
    let order = graph.topo_order().expect("autodiff runs on verified, acyclic graphs");

    let mut builder = Builder { graph, contributions: BTreeMap::new(), span_of: loss.node, scope: String::new() };
    let one = builder.scalar(builder.graph.ty(loss).dtype, 1.0, "gradients/loss");
    builder.contributions.entry(loss).or_default().push(one);

    let mut gradients = BTreeMap::new();
    for &id in order.iter().rev() {
        if !relevant.contains(&id) {
            continue;
        }
        let output = TensorRef { node: id, port: 0 };
        let Some(grad) = builder.gradient_of(output) else { continue };
        if let Op::Variable { .. } = builder.graph.node(id).op {
            gradients.insert(id, grad);
            continue;
        }
        builder.span_of = id;
        builder.scope = format!("gradients/{}", builder.graph.node(id).name);
        builder.backprop(id, grad, &relevant);
    }

    let training = module.training.as_mut().expect("checked above");
    training.gradients = trainable.iter().filter_map(|v| gradients.get(v).map(|g| (*v, *g))).collect();
}

/// Nodes on a path from a trainable variable to the loss, through floating-point values.
fn relevant_nodes(graph: &Graph, variables: &[NodeId], loss: NodeId) -> BTreeSet<NodeId> {
    let needed_by_loss = graph.ancestors(&[loss]);
    let mut reached = BTreeSet::new();
    let mut stack: Vec<NodeId> = variables.iter().copied().filter(|v| needed_by_loss.contains(v)).collect();
    while let Some(id) = stack.pop() {
        if !reached.insert(id) {
            continue;
        }
        if matches!(graph.node(id).op, Op::StopGradient) {
            continue;
        }
        for user in graph.users(id) {
            let floats = graph.node(user).outputs.iter().all(|t| t.dtype.is_float());
            if needed_by_loss.contains(&user) && floats && !reached.contains(&user) {
                stack.push(user);
            }
        }
    }
    reached.retain(|id| !matches!(graph.node(*id).op, Op::StopGradient));
    reached
}

struct Builder<'g> {
    graph: &'g mut Graph,
    /// Gradient contributions to each tensor, summed when the tensor is reached.
    contributions: BTreeMap<TensorRef, Vec<TensorRef>>,
    /// The forward node whose gradient is being built: new nodes take its span.
    span_of: NodeId,
    scope: String,
}

impl Builder<'_> {
    fn add(&mut self, op: Op, inputs: &[TensorRef]) -> TensorRef {
        let name = format!("{}/{}", self.scope, op.name());
        let span = self.graph.span(self.span_of);
        let id = self
            .graph
            .add(op, inputs, &name, span)
            .unwrap_or_else(|e| panic!("autodiff built an ill-typed `{name}`: {}", e.message));
        id.into()
    }

    fn ty(&self, t: TensorRef) -> TensorType {
        self.graph.ty(t).clone()
    }

    fn scalar(&mut self, dtype: DType, value: f64, scope: &str) -> TensorRef {
        let span = self.graph.span(self.span_of);
        let id = self
            .graph
            .add(Op::Const { value: ConstValue::scalar(dtype, value) }, &[], &format!("{scope}/const"), span)
            .expect("constants type");
        id.into()
    }

    fn constant(&mut self, dtype: DType, value: f64) -> TensorRef {
        let scope = self.scope.clone();
        self.scalar(dtype, value, &scope)
    }

    fn binary(&mut self, op: BinaryOp, a: TensorRef, b: TensorRef) -> TensorRef {
        self.add(Op::Binary(op), &[a, b])
    }

    fn mul(&mut self, a: TensorRef, b: TensorRef) -> TensorRef {
        self.binary(BinaryOp::Mul, a, b)
    }

    fn neg(&mut self, a: TensorRef) -> TensorRef {
        self.add(Op::Unary(UnaryOp::Neg), &[a])
    }

    fn zero_like(&mut self, t: TensorRef) -> TensorRef {
        let dtype = self.ty(t).dtype;
        self.constant(dtype, 0.0)
    }

    fn select(&mut self, cond: TensorRef, a: TensorRef, b: TensorRef) -> TensorRef {
        self.add(Op::Select, &[cond, a, b])
    }

    fn compare(&mut self, op: CompareOp, a: TensorRef, b: TensorRef) -> TensorRef {
        self.add(Op::Compare(op), &[a, b])
    }

    fn reshape(&mut self, t: TensorRef, shape: &Shape) -> TensorRef {
        if self.ty(t).shape == *shape {
            return t;
        }
        self.add(Op::Reshape { shape: shape.clone() }, &[t])
    }

    /// The gradient of `b` in `C = A · op(B)` where `B` is one matrix shared by every batch of
    /// `A` (a dense layer on `[batch, time, features]`): `A` and `g` as matrices of all their
    /// rows, one product over them, rather than a product per batch summed afterwards (which
    /// stores a `[batch, k, n]` tensor and runs `batch` small products). `None` where `B` has
    /// batches of its own or `A` is broadcast.
    fn shared_matrix_gradient(
        &mut self,
        a: TensorRef,
        g: TensorRef,
        b: TensorRef,
        transpose_b: bool,
    ) -> Option<TensorRef> {
        let (a_dims, g_dims) = (self.ty(a).shape.0, self.ty(g).shape.0);
        let rank = a_dims.len();
        if self.ty(b).shape.rank() != 2 || rank < 3 || g_dims.len() != rank || a_dims[..rank - 2] != g_dims[..rank - 2]
        {
            return None;
        }
        let rows: usize = a_dims[..rank - 1].iter().product();
        let a2 = self.reshape(a, &Shape::from(vec![rows, a_dims[rank - 1]]));
        let g2 = self.reshape(g, &Shape::from(vec![rows, g_dims[rank - 1]]));
        // B = Aᵀg, or with B transposed in the product, gᵀA.
        let (p, q) = if transpose_b { (g2, a2) } else { (a2, g2) };
        Some(self.add(Op::MatMul { transpose_a: true, transpose_b: false }, &[p, q]))
    }

    fn reduce_sum(&mut self, t: TensorRef, axes: Vec<usize>, keep_dims: bool) -> TensorRef {
        self.add(Op::Reduce { kind: ReduceKind::Sum, axes, keep_dims }, &[t])
    }

    /// `g` (of a broadcast result's shape) summed back to `shape`.
    fn unbroadcast(&mut self, g: TensorRef, shape: &Shape) -> TensorRef {
        let g_shape = self.ty(g).shape;
        if g_shape == *shape {
            return g;
        }
        let extra = g_shape.rank() - shape.rank();
        let axes: Vec<usize> =
            (0..g_shape.rank()).filter(|&i| i < extra || (shape.0[i - extra] == 1 && g_shape.0[i] != 1)).collect();
        let summed = if axes.is_empty() { g } else { self.reduce_sum(g, axes, false) };
        self.reshape(summed, shape)
    }

    /// The total gradient of `t`: the sum of its contributions, or `None` if it has none.
    fn gradient_of(&mut self, t: TensorRef) -> Option<TensorRef> {
        let parts = self.contributions.remove(&t)?;
        let mut parts = parts.into_iter();
        let first = parts.next()?;
        Some(parts.fold(first, |sum, part| {
            self.span_of = t.node;
            self.scope = format!("gradients/{}", self.graph.node(t.node).name);
            self.binary(BinaryOp::Add, sum, part)
        }))
    }

    fn contribute(&mut self, to: TensorRef, grad: TensorRef, relevant: &BTreeSet<NodeId>) {
        if relevant.contains(&to.node) {
            self.contributions.entry(to).or_default().push(grad);
        }
    }

    /// Adds the gradients of `id`'s operands, given the gradient `g` of its output.
    fn backprop(&mut self, id: NodeId, g: TensorRef, relevant: &BTreeSet<NodeId>) {
        let op = self.graph.node(id).op.clone();
        let inputs = self.graph.inputs(id);
        let y: TensorRef = id.into();
        let x = |i: usize| inputs[i];
        let shape = |this: &Self, i: usize| this.ty(inputs[i]).shape;
        let mut grads: Vec<(usize, TensorRef)> = Vec::new();
        match op {
            Op::Read | Op::Identity => grads.push((0, g)),
            Op::Unary(unary) => {
                let dx = match unary {
                    UnaryOp::Neg => self.neg(g),
                    UnaryOp::Abs => {
                        let zero = self.zero_like(x(0));
                        let positive = self.compare(CompareOp::GreaterEqual, x(0), zero);
                        let minus_g = self.neg(g);
                        self.select(positive, g, minus_g)
                    }
                    UnaryOp::Exp => self.mul(g, y),
                    UnaryOp::Log => self.binary(BinaryOp::Div, g, x(0)),
                    UnaryOp::Sqrt => {
                        let half = self.constant(self.ty(y).dtype, 0.5);
                        let half_g = self.mul(g, half);
                        self.binary(BinaryOp::Div, half_g, y)
                    }
                    UnaryOp::Rsqrt => {
                        // d/dx x^-1/2 = -1/2 x^-3/2 = -1/2 y^3
                        let minus_half = self.constant(self.ty(y).dtype, -0.5);
                        let y2 = self.mul(y, y);
                        let y3 = self.mul(y2, y);
                        let scaled = self.mul(g, minus_half);
                        self.mul(scaled, y3)
                    }
                    UnaryOp::Relu => {
                        // relu(x) > 0 exactly where x > 0 (NaN and -0 included): the gradient reads the
                        // activation, so that the pre-activation need not be stored (a product's epilogue
                        // can compute relu(a·b + bias) without it).
                        let zero = self.zero_like(y);
                        let positive = self.compare(CompareOp::Greater, y, zero);
                        self.select(positive, g, zero)
                    }
                    UnaryOp::Sigmoid => {
                        let one = self.constant(self.ty(y).dtype, 1.0);
                        let complement = self.binary(BinaryOp::Sub, one, y);
                        let slope = self.mul(y, complement);
                        self.mul(g, slope)
                    }
                    UnaryOp::Tanh => {
                        let one = self.constant(self.ty(y).dtype, 1.0);
                        let y2 = self.mul(y, y);
                        let slope = self.binary(BinaryOp::Sub, one, y2);
                        self.mul(g, slope)
                    }
                };
                grads.push((0, dx));
            }
            Op::Binary(binary) => {
                let (a, b) = (x(0), x(1));
                let (need_a, need_b) = (relevant.contains(&a.node), relevant.contains(&b.node));
                let (da, db) = match binary {
                    BinaryOp::Add => (Some(g), Some(g)),
                    BinaryOp::Sub => (Some(g), need_b.then(|| self.neg(g))),
                    BinaryOp::Mul => (need_a.then(|| self.mul(g, b)), need_b.then(|| self.mul(g, a))),
                    BinaryOp::Div => {
                        let da = need_a.then(|| self.binary(BinaryOp::Div, g, b));
                        // d(a/b)/db = -(a/b)/b = -y/b
                        let db = need_b.then(|| {
                            let gy = self.mul(g, y);
                            let gy_b = self.binary(BinaryOp::Div, gy, b);
                            self.neg(gy_b)
                        });
                        (da, db)
                    }
                    BinaryOp::Pow => {
                        // d/da a^b = b a^(b-1); d/db a^b = a^b log a
                        let da = need_a.then(|| {
                            let one = self.constant(self.ty(y).dtype, 1.0);
                            let b_minus_one = self.binary(BinaryOp::Sub, b, one);
                            let power = self.binary(BinaryOp::Pow, a, b_minus_one);
                            let slope = self.mul(b, power);
                            self.mul(g, slope)
                        });
                        let db = need_b.then(|| {
                            let log_a = self.add(Op::Unary(UnaryOp::Log), &[a]);
                            let gy = self.mul(g, y);
                            self.mul(gy, log_a)
                        });
                        (da, db)
                    }
                    BinaryOp::Maximum | BinaryOp::Minimum => {
                        let compare =
                            if binary == BinaryOp::Maximum { CompareOp::GreaterEqual } else { CompareOp::LessEqual };
                        let a_wins = self.compare(compare, a, b);
                        let zero = self.zero_like(g);
                        (need_a.then(|| self.select(a_wins, g, zero)), need_b.then(|| self.select(a_wins, zero, g)))
                    }
                };
                for (i, d) in [(0, da), (1, db)] {
                    if let Some(d) = d {
                        if relevant.contains(&inputs[i].node) {
                            let target = shape(self, i);
                            let d = self.unbroadcast(d, &target);
                            grads.push((i, d));
                        }
                    }
                }
            }
            Op::Select => {
                let zero = self.zero_like(g);
                for (i, branch) in [(1, true), (2, false)] {
                    if relevant.contains(&inputs[i].node) {
                        let d = if branch { self.select(x(0), g, zero) } else { self.select(x(0), zero, g) };
                        let target = shape(self, i);
                        let d = self.unbroadcast(d, &target);
                        grads.push((i, d));
                    }
                }
            }
            Op::Cast { .. } => {
                let from = self.ty(x(0)).dtype;
                if from.is_float() {
                    grads.push((0, self.add(Op::Cast { to: from }, &[g])));
                }
            }
            Op::MatMul { transpose_a, transpose_b } => {
                let (a, b) = (x(0), x(1));
                let mm = |this: &mut Self, p: TensorRef, q: TensorRef, ta: bool, tb: bool| {
                    this.add(Op::MatMul { transpose_a: ta, transpose_b: tb }, &[p, q])
                };
                // For C = op(A) op(B): dA and dB as products of g with the other operand.
                let (da, db) = match (transpose_a, transpose_b) {
                    (false, false) => ((g, b, false, true), (a, g, true, false)),
                    (false, true) => ((g, b, false, false), (g, a, true, false)),
                    (true, false) => ((b, g, false, true), (a, g, false, false)),
                    (true, true) => ((b, g, true, true), (g, a, true, true)),
                };
                for (i, (p, q, ta, tb)) in [(0, da), (1, db)] {
                    if relevant.contains(&inputs[i].node) {
                        if i == 1 && !transpose_a {
                            if let Some(d) = self.shared_matrix_gradient(a, g, b, transpose_b) {
                                grads.push((1, d));
                                continue;
                            }
                        }
                        let d = mm(self, p, q, ta, tb);
                        let target = shape(self, i);
                        let d = self.unbroadcast(d, &target);
                        grads.push((i, d));
                    }
                }
            }
            Op::Reshape { .. } => {
                let target = shape(self, 0);
                grads.push((0, self.reshape(g, &target)));
            }
            Op::Transpose { perm } => {
                let mut inverse = vec![0; perm.len()];
                for (i, &p) in perm.iter().enumerate() {
                    inverse[p] = i;
                }
                grads.push((0, self.add(Op::Transpose { perm: inverse }, &[g])));
            }
            Op::Concat { axis } => {
                let mut offset = 0;
                for (i, input) in inputs.iter().enumerate() {
                    let dims = self.ty(*input).shape.0;
                    if relevant.contains(&input.node) {
                        let mut begin = vec![0; dims.len()];
                        begin[axis] = offset;
                        grads.push((i, self.add(Op::Slice { begin, size: dims.clone() }, &[g])));
                    }
                    offset += dims[axis];
                }
            }
            Op::Slice { begin, size } => {
                let dims = shape(self, 0).0;
                let after = dims.iter().zip(begin.iter().zip(&size)).map(|(d, (b, s))| d - b - s).collect();
                grads.push((0, self.add(Op::Pad { before: begin, after }, &[g])));
            }
            Op::Reduce { kind, axes, keep_dims } => {
                let input_shape = shape(self, 0);
                let kept: Vec<usize> = input_shape
                    .dims()
                    .iter()
                    .enumerate()
                    .map(|(i, &d)| if axes.contains(&i) { 1 } else { d })
                    .collect();
                let kept = Shape(kept);
                let g_kept = if keep_dims { g } else { self.reshape(g, &kept) };
                let dtype = self.ty(g).dtype;
                let dx = match kind {
                    ReduceKind::Sum => self.add(Op::BroadcastTo { shape: input_shape.clone() }, &[g_kept]),
                    ReduceKind::Mean => {
                        let spread = self.add(Op::BroadcastTo { shape: input_shape.clone() }, &[g_kept]);
                        let count: usize = axes.iter().map(|&a| input_shape.0[a]).product();
                        let scale = self.constant(dtype, 1.0 / count as f64);
                        self.mul(spread, scale)
                    }
                    ReduceKind::Max | ReduceKind::Min => {
                        // The elements equal to the extreme share the gradient evenly, as in
                        // TensorFlow and JAX: ties the graph makes itself (a row gathered twice,
                        // a broadcast value) would otherwise each take all of it, and their
                        // source the sum.
                        let y_kept = if keep_dims { y } else { self.reshape(y, &kept) };
                        let extreme = self.add(Op::BroadcastTo { shape: input_shape.clone() }, &[y_kept]);
                        let is_extreme = self.compare(CompareOp::Equal, x(0), extreme);
                        let indicator = self.add(Op::Cast { to: dtype }, &[is_extreme]);
                        let ties = self.reduce_sum(indicator, axes.clone(), true);
                        let share = self.binary(BinaryOp::Div, g_kept, ties);
                        let spread = self.add(Op::BroadcastTo { shape: input_shape.clone() }, &[share]);
                        let zero = self.zero_like(g);
                        self.select(is_extreme, spread, zero)
                    }
                };
                grads.push((0, dx));
            }
            Op::Softmax { axis } => {
                // dx = y * (g - sum(g * y, axis))
                let gy = self.mul(g, y);
                let total = self.reduce_sum(gy, vec![axis], true);
                let centred = self.binary(BinaryOp::Sub, g, total);
                grads.push((0, self.mul(y, centred)));
            }
            Op::LogSoftmax { axis } => {
                // dx = g - softmax(x) * sum(g, axis)
                let softmax = self.add(Op::Unary(UnaryOp::Exp), &[y]);
                let total = self.reduce_sum(g, vec![axis], true);
                let spread = self.mul(softmax, total);
                grads.push((0, self.binary(BinaryOp::Sub, g, spread)));
            }
            Op::SoftmaxCrossEntropy => {
                let (logits, labels) = (x(0), x(1));
                let logits_ty = self.ty(logits);
                let mut kept = logits_ty.shape.0.clone();
                *kept.last_mut().expect("logits have a class axis") = 1;
                let g_kept = self.reshape(g, &Shape(kept));
                let axis = logits_ty.shape.rank() - 1;
                if relevant.contains(&logits.node) {
                    let softmax = self.add(Op::Softmax { axis }, &[logits]);
                    let error = self.binary(BinaryOp::Sub, softmax, labels);
                    grads.push((0, self.mul(error, g_kept)));
                }
                if relevant.contains(&labels.node) {
                    let log_softmax = self.add(Op::LogSoftmax { axis }, &[logits]);
                    let minus = self.neg(log_softmax);
                    grads.push((1, self.mul(minus, g_kept)));
                }
            }
            Op::SigmoidCrossEntropy => {
                let (logits, labels) = (x(0), x(1));
                if relevant.contains(&logits.node) {
                    let sigmoid = self.add(Op::Unary(UnaryOp::Sigmoid), &[logits]);
                    let error = self.binary(BinaryOp::Sub, sigmoid, labels);
                    grads.push((0, self.mul(error, g)));
                }
                if relevant.contains(&labels.node) {
                    let minus = self.neg(logits);
                    grads.push((1, self.mul(minus, g)));
                }
            }
            Op::Conv2d { strides, padding } => {
                let (input, filter) = (x(0), x(1));
                if relevant.contains(&input.node) {
                    let input_shape = shape(self, 0);
                    grads.push((0, self.add(Op::Conv2dBackpropInput { input_shape, strides, padding }, &[filter, g])));
                }
                if relevant.contains(&filter.node) {
                    let filter_shape = shape(self, 1);
                    grads.push((1, self.add(Op::Conv2dBackpropFilter { filter_shape, strides, padding }, &[input, g])));
                }
            }
            Op::MaxPool { window, strides, padding } => {
                grads.push((0, self.add(Op::MaxPoolGrad { window, strides, padding }, &[x(0), g])));
            }
            Op::AvgPool { window, strides, padding } => {
                let input_shape = shape(self, 0);
                grads.push((0, self.add(Op::AvgPoolGrad { input_shape, window, strides, padding }, &[g])));
            }
            Op::LayerNorm { epsilon } => {
                grads.push((0, self.add(Op::LayerNormGrad { epsilon }, &[x(0), g])));
            }
            // The moments are the batch's own (the verifier holds sema to it): the gradient
            // through them is part of `BatchNormGrad`'s, so none goes to `Moments`. Their
            // means are all the replicas' where the moments are.
            Op::BatchNorm { epsilon, synchronized } => {
                let mut means = self.add(Op::BatchNormGradMeans { epsilon }, &[x(0), x(1), g]);
                if synchronized {
                    means = self.add(Op::CrossReplicaMean, &[means]);
                }
                grads.push((0, self.add(Op::BatchNormGrad { epsilon }, &[x(0), x(1), g, means])));
            }
            Op::Gather => {
                let rows = shape(self, 0).0[0];
                let scatter = self.add(Op::ScatterAdd { rows }, &[x(1), g]);
                // With the lookup, which lives with its table: only the rows touched travel to
                // the table's device, as TensorFlow's IndexedSlices, not a dense gradient.
                self.graph.node_mut(scatter.node).colocate_with = self.graph.node(id).colocate_with;
                grads.push((0, scatter));
            }
            Op::BroadcastTo { .. } => {
                let target = shape(self, 0);
                grads.push((0, self.unbroadcast(g, &target)));
            }
            Op::Pad { before, .. } => {
                let size = shape(self, 0).0;
                grads.push((0, self.add(Op::Slice { begin: before, size }, &[g])));
            }
            // Every replica's loss depends on the mean: its gradient is the mean of theirs.
            Op::CrossReplicaMean => grads.push((0, self.add(Op::CrossReplicaMean, &[g]))),
            Op::ScatterAdd { .. } => {
                if relevant.contains(&inputs[1].node) {
                    grads.push((1, self.add(Op::Gather, &[g, x(0)])));
                }
            }
            // No gradient flows through these (or they never sit between a variable and a loss).
            Op::Input { .. }
            | Op::Const { .. }
            | Op::Variable { .. }
            | Op::Assign
            | Op::AssignAdd
            | Op::AssignSub
            | Op::StopGradient
            | Op::Compare(_)
            | Op::OneHot { .. }
            | Op::ArgMax { .. }
            | Op::LearningRate { .. }
            | Op::RandomUniform { .. }
            | Op::RandomNormal { .. }
            | Op::TrainingFlag
            | Op::Conv2dBackpropInput { .. }
            | Op::Conv2dBackpropFilter { .. }
            | Op::MaxPoolGrad { .. }
            | Op::AvgPoolGrad { .. }
            | Op::LayerNormGrad { .. }
            | Op::Moments
            | Op::BatchNormGradMeans { .. }
            | Op::BatchNormGrad { .. }
            // Partitioning runs after autodiff.
            | Op::Send { .. }
            | Op::Recv { .. }
            | Op::AllReduce { .. } => {}
        }
        for (i, grad) in grads {
            self.contribute(inputs[i], grad, relevant);
        }
    }
}
