//! The optimizer's update ops: for each trainable variable with a gradient, the slot variables
//! its optimizer keeps and the assignments of one training step, recorded in
//! `Training::updates`. The rules are TensorFlow's and Keras's:
//!
//! - sgd: `w -= lr * g`
//! - momentum: `v = momentum * v + g; w -= lr * v` (nesterov: `w -= lr * (g + momentum * v)`)
//! - adam: `t += 1; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g²;
//!   w -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)`
//! - adagrad: `a += g²; w -= lr * g / (sqrt(a) + eps)`
//! - rmsprop: `s = rho s + (1 - rho) g²`; without momentum `w -= lr * g / (sqrt(s) + eps)`;
//!   with it `u = momentum * u + lr * g / (sqrt(s) + eps); w -= u`
//!
//! Weight decay is decoupled: `w -= lr * weight_decay * w` in the same assignment.
//!
//! With a learning-rate schedule, `lr` is `Op::LearningRate` of the global step: a variable
//! `global_step` (i64, the steps taken), read before the step increments it. With
//! `clip_global_norm = c`, every gradient is first scaled by `c / max(c, ‖g‖)`, `‖g‖` the
//! norm of all the gradients together (TensorFlow's `clip_by_global_norm`).
//!
//! The model's own assignments (batch norms' moving averages) are updates of the step too.
//!
//! Ordering: every read of a variable runs before its update (a control edge from each `read`
//! to the assignment), so a step computes all gradients from the values it started with.

use dfc_ir::{BinaryOp, ConstValue, DType, Graph, Initializer, Module, NodeId, Op, OptimizerKind, TensorRef, UnaryOp};

pub fn apply_optimizer(module: &mut Module) {
    let Some(training) = &module.training else { return };
    let optimizer = training.optimizer.clone();
    let graph = &mut module.graph;
    let gradients = match optimizer.clip_global_norm {
        Some(norm) => clip_global_norm(graph, &training.gradients, norm),
        None => training.gradients.clone(),
    };
    // The model's own state updates (batch norms' moving averages), made before this pass:
    // each runs in the training step, after every read of its variable.
    let mut updates: Vec<NodeId> = graph
        .node_ids()
        .filter(|&id| matches!(graph.node(id).op, Op::Assign | Op::AssignAdd | Op::AssignSub))
        .collect();
    for &update in &updates {
        let variable = graph.inputs(update)[0].node;
        let reads: Vec<NodeId> =
            graph.users(variable).into_iter().filter(|r| matches!(graph.node(*r).op, Op::Read)).collect();
        for read in reads {
            graph.add_control_edge(read, update);
        }
    }
    // The global step (made by the model's random ops, or here for a schedule), counted by
    // every training step after every read of it.
    let scalar = dfc_ir::TensorType::scalar(DType::I64);
    let existing = graph.node_ids().find(|&id| {
        let node = graph.node(id);
        node.name == "global_step" && matches!(&node.op, Op::Variable { ty, trainable: false, .. } if *ty == scalar)
    });
    let global_step = if existing.is_some() || optimizer.schedule.is_some() {
        let mut u = Updater { graph, variable: None, scope: "optimizer".into() };
        let counter =
            existing.unwrap_or_else(|| u.slot("global_step", DType::I64, &dfc_ir::Shape::scalar(), Initializer::Zeros));
        let step = u.read(counter);
        let one = u.constant(DType::I64, 1.0);
        let increment = u.add(Op::AssignAdd, &[counter.into(), one]);
        let reads: Vec<NodeId> =
            graph.users(counter).into_iter().filter(|r| matches!(graph.node(*r).op, Op::Read)).collect();
        for read in reads {
            graph.add_control_edge(read, increment.node);
        }
        updates.push(increment.node);
        Some(step)
    } else {
        None
    };
    let mut scheduled: std::collections::HashMap<DType, TensorRef> = std::collections::HashMap::new();
    let mut learning_rate = None;

    // Adam's step counter, shared by all variables.
    let step = match optimizer.kind {
        OptimizerKind::Adam { .. } => {
            let dtype = gradients.first().map_or(DType::F32, |(v, _)| graph.node(*v).outputs[0].dtype);
            let mut u = Updater { graph, variable: gradients.first().map(|(v, _)| *v), scope: "optimizer".into() };
            let counter = u.slot("optimizer/step", dtype, &dfc_ir::Shape::scalar(), Initializer::Zeros);
            let one = u.constant(dtype, 1.0);
            let t = u.add(Op::AssignAdd, &[counter.into(), one]);
            updates.push(t.node);
            Some(t)
        }
        _ => None,
    };

    for (variable, g) in gradients {
        let ty = graph.node(variable).outputs[0].clone();
        let name = graph.node(variable).name.clone();
        let mut u = Updater { graph, variable: Some(variable), scope: format!("{name}/update") };
        let dtype = ty.dtype;
        let lr = match (&optimizer.schedule, global_step.filter(|_| optimizer.schedule.is_some())) {
            (Some(schedule), Some(step)) => *scheduled.entry(dtype).or_insert_with(|| {
                let op = Op::LearningRate { schedule: schedule.clone(), dtype };
                let mut shared = Updater { graph: u.graph, variable: None, scope: "optimizer".into() };
                shared.add(op, &[step])
            }),
            _ => u.constant(dtype, optimizer.learning_rate),
        };
        learning_rate.get_or_insert(lr);
        let delta = match optimizer.kind {
            OptimizerKind::Sgd => u.mul(lr, g),
            OptimizerKind::Momentum { momentum, nesterov } => {
                let slot = u.slot(&format!("{name}/momentum"), dtype, &ty.shape, Initializer::Zeros);
                let old = u.read(slot);
                let m = u.constant(dtype, momentum);
                let decayed = u.mul(m, old);
                let new = u.binary(BinaryOp::Add, decayed, g);
                let velocity = u.add(Op::Assign, &[slot.into(), new]);
                updates.push(velocity.node);
                if nesterov {
                    let ahead = u.mul(m, velocity);
                    let direction = u.binary(BinaryOp::Add, g, ahead);
                    u.mul(lr, direction)
                } else {
                    u.mul(lr, velocity)
                }
            }
            OptimizerKind::Adam { beta1, beta2, epsilon } => {
                let t = step.expect("adam has a step counter");
                let m_slot = u.slot(&format!("{name}/adam_m"), dtype, &ty.shape, Initializer::Zeros);
                let v_slot = u.slot(&format!("{name}/adam_v"), dtype, &ty.shape, Initializer::Zeros);
                let m = u.moving_average(m_slot, g, beta1, false);
                let v = u.moving_average(v_slot, g, beta2, true);
                updates.extend([m.node, v.node]);
                // lr_t = lr * sqrt(1 - b2^t) / (1 - b1^t)
                let one = u.constant(dtype, 1.0);
                let b1 = u.constant(dtype, beta1);
                let b2 = u.constant(dtype, beta2);
                let b1_t = u.binary(BinaryOp::Pow, b1, t);
                let b2_t = u.binary(BinaryOp::Pow, b2, t);
                let c1 = u.binary(BinaryOp::Sub, one, b1_t);
                let c2 = u.binary(BinaryOp::Sub, one, b2_t);
                let root_c2 = u.add(Op::Unary(UnaryOp::Sqrt), &[c2]);
                let scaled = u.mul(lr, root_c2);
                let lr_t = u.binary(BinaryOp::Div, scaled, c1);
                let eps = u.constant(dtype, epsilon);
                let root_v = u.add(Op::Unary(UnaryOp::Sqrt), &[v]);
                let denominator = u.binary(BinaryOp::Add, root_v, eps);
                let ratio = u.binary(BinaryOp::Div, m, denominator);
                u.mul(lr_t, ratio)
            }
            OptimizerKind::Adagrad { initial_accumulator, epsilon } => {
                let slot = u.slot(
                    &format!("{name}/adagrad"),
                    dtype,
                    &ty.shape,
                    Initializer::Constant { value: initial_accumulator },
                );
                let g2 = u.mul(g, g);
                let accumulated = u.add(Op::AssignAdd, &[slot.into(), g2]);
                updates.push(accumulated.node);
                let normalised = u.normalise(g, accumulated, epsilon);
                u.mul(lr, normalised)
            }
            OptimizerKind::RmsProp { rho, momentum, epsilon } => {
                let ms_slot = u.slot(&format!("{name}/rms"), dtype, &ty.shape, Initializer::Zeros);
                let ms = u.moving_average(ms_slot, g, rho, true);
                updates.push(ms.node);
                let normalised = u.normalise(g, ms, epsilon);
                let step = u.mul(lr, normalised);
                if momentum > 0.0 {
                    let mom_slot = u.slot(&format!("{name}/rms_momentum"), dtype, &ty.shape, Initializer::Zeros);
                    let old = u.read(mom_slot);
                    let m = u.constant(dtype, momentum);
                    let decayed = u.mul(m, old);
                    let new = u.binary(BinaryOp::Add, decayed, step);
                    let velocity = u.add(Op::Assign, &[mom_slot.into(), new]);
                    updates.push(velocity.node);
                    velocity
                } else {
                    step
                }
            }
        };
        let delta = if optimizer.weight_decay > 0.0 {
            let current = u.read(variable);
            let rate = u.constant(dtype, optimizer.weight_decay);
            let decay = u.mul(lr, rate);
            let shrink = u.mul(decay, current);
            u.binary(BinaryOp::Add, delta, shrink)
        } else {
            delta
        };
        let update = u.add(Op::AssignSub, &[variable.into(), delta]);
        updates.push(update.node);

        // Every read of the variable happens before its update.
        let reads: Vec<NodeId> =
            graph.users(variable).into_iter().filter(|r| matches!(graph.node(*r).op, Op::Read)).collect();
        for read in reads {
            graph.add_control_edge(read, update.node);
        }
    }
    let training = module.training.as_mut().expect("checked above");
    training.updates = updates;
    training.learning_rate = learning_rate.filter(|_| optimizer.schedule.is_some());
}

/// The gradients scaled together so that their global norm is at most `norm`: each times
/// `norm / max(norm, sqrt(Σ Σ g²))`, the sum over every element of every gradient (in f32,
/// then in each gradient's type).
fn clip_global_norm(graph: &mut Graph, gradients: &[(NodeId, TensorRef)], norm: f64) -> Vec<(NodeId, TensorRef)> {
    let mut u = Updater { graph, variable: None, scope: "optimizer/clip".into() };
    let mut total: Option<TensorRef> = None;
    for &(_, g) in gradients {
        let ty = u.graph.ty(g).clone();
        let squares = u.mul(g, g);
        let axes: Vec<usize> = (0..ty.shape.rank()).collect();
        let sum = u.add(Op::Reduce { kind: dfc_ir::ReduceKind::Sum, axes, keep_dims: false }, &[squares]);
        let sum = if ty.dtype == DType::F32 { sum } else { u.add(Op::Cast { to: DType::F32 }, &[sum]) };
        total = Some(match total {
            Some(t) => u.binary(BinaryOp::Add, t, sum),
            None => sum,
        });
    }
    let Some(total) = total else { return gradients.to_vec() };
    let global = u.add(Op::Unary(UnaryOp::Sqrt), &[total]);
    let limit = u.constant(DType::F32, norm);
    let larger = u.binary(BinaryOp::Maximum, global, limit);
    let scale = u.binary(BinaryOp::Div, limit, larger);
    gradients
        .iter()
        .map(|&(v, g)| {
            let dtype = u.graph.ty(g).dtype;
            let factor = if dtype == DType::F32 { scale } else { u.add(Op::Cast { to: dtype }, &[scale]) };
            (v, u.mul(g, factor))
        })
        .collect()
}

struct Updater<'g> {
    graph: &'g mut Graph,
    /// New nodes take this variable's span and requested device (an update lives with its
    /// variable).
    variable: Option<NodeId>,
    scope: String,
}

impl Updater<'_> {
    fn add(&mut self, op: Op, inputs: &[TensorRef]) -> TensorRef {
        let name = format!("{}/{}", self.scope, op.name());
        let span = self.variable.and_then(|v| self.graph.span(v));
        let id = self
            .graph
            .add(op, inputs, &name, span)
            .unwrap_or_else(|e| panic!("optimizer built an ill-typed `{name}`: {}", e.message));
        self.follow_variable(id);
        id.into()
    }

    fn constant(&mut self, dtype: DType, value: f64) -> TensorRef {
        self.add(Op::Const { value: ConstValue::scalar(dtype, value) }, &[])
    }

    fn binary(&mut self, op: BinaryOp, a: TensorRef, b: TensorRef) -> TensorRef {
        self.add(Op::Binary(op), &[a, b])
    }

    fn mul(&mut self, a: TensorRef, b: TensorRef) -> TensorRef {
        self.binary(BinaryOp::Mul, a, b)
    }

    fn read(&mut self, variable: NodeId) -> TensorRef {
        self.add(Op::Read, &[variable.into()])
    }

    /// A non-trainable variable for the optimizer's state, beside its variable.
    fn slot(&mut self, name: &str, dtype: DType, shape: &dfc_ir::Shape, init: Initializer) -> NodeId {
        let ty = dfc_ir::TensorType::new(dtype, shape.clone());
        let op = Op::Variable { ty, init, trainable: false, partitions: 1, origin: None };
        let span = self.variable.and_then(|v| self.graph.span(v));
        let id = self.graph.add(op, &[], name, span).expect("variables type");
        self.follow_variable(id);
        self.graph.node_mut(id).colocate_with = self.variable;
        id
    }

    /// The variable's device request, for a node of its update.
    fn follow_variable(&mut self, id: NodeId) {
        if let Some(v) = self.variable {
            let (device, at) = (self.graph.node(v).requested_device.clone(), self.graph.request_span(v));
            self.graph.request(id, device, at);
        }
    }

    /// `slot = decay * slot + (1 - decay) * g` (of `g²` when `squared`); yields the new value.
    fn moving_average(&mut self, slot: NodeId, g: TensorRef, decay: f64, squared: bool) -> TensorRef {
        let dtype = self.graph.ty(g).dtype;
        let old = self.read(slot);
        let d = self.constant(dtype, decay);
        let rest = self.constant(dtype, 1.0 - decay);
        let kept = self.mul(d, old);
        let sample = if squared { self.mul(g, g) } else { g };
        let added = self.mul(rest, sample);
        let new = self.binary(BinaryOp::Add, kept, added);
        self.add(Op::Assign, &[slot.into(), new])
    }

    /// `g / (sqrt(accumulator) + eps)`.
    fn normalise(&mut self, g: TensorRef, accumulator: TensorRef, epsilon: f64) -> TensorRef {
        let dtype = self.graph.ty(g).dtype;
        let root = self.add(Op::Unary(UnaryOp::Sqrt), &[accumulator]);
        let eps = self.constant(dtype, epsilon);
        let denominator = self.binary(BinaryOp::Add, root, eps);
        self.binary(BinaryOp::Div, g, denominator)
    }
}
