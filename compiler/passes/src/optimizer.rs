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
//!
//! Sharded over N data-parallel replicas (`OptimizerOptions::shards`, ZeRO stage 1, Rajbhandari
//! et al.), the module is one replica's, and each dense float variable's update is built on
//! the replica's shard: the gradient is the replicas' mean (`CrossReplicaMean`, which
//! replication makes an all-reduce and a scale, as a mirrored gradient is), flattened and
//! padded to N × S elements (S = ⌈elements / N⌉); the replica takes its S of it and of the
//! variable's value (slices named `…@replica_shard`, which replication and instances move to
//! each replica's rows), its slots hold S elements (variables named `…@replica_shard`, shards
//! of the whole slot), and the new shard is all-gathered (each replica's in its slot of an
//! `[N, S]` tensor, `…/replica_slot`, summed by an all-reduce) and assigned whole. The
//! arithmetic of each element is the unsharded update's. A lookup's gradient (rows, not a
//! dense tensor) and integer variables keep the unsharded update.

use dfc_ir::{
    BinaryOp, ConstValue, DType, Graph, Initializer, Module, NodeId, Op, OptimizerKind, Shape, TensorRef, UnaryOp,
    VariableOrigin, REPLICA_SHARD, REPLICA_SLOT,
};

/// How the optimizer's update is built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OptimizerOptions {
    /// The data-parallel replicas over which each variable's optimizer state and update are
    /// sharded (ZeRO stage 1); 1: none.
    pub shards: usize,
}

impl Default for OptimizerOptions {
    fn default() -> OptimizerOptions {
        OptimizerOptions { shards: 1 }
    }
}

/// Where a sharded update's tensors lie: `elements` of the variable, padded to `shards` ×
/// `size`.
#[derive(Clone, Copy)]
struct ShardLayout {
    elements: usize,
    shards: usize,
    size: usize,
}

impl ShardLayout {
    fn padded(&self) -> usize {
        self.shards * self.size
    }
}

pub fn apply_optimizer(module: &mut Module, options: &OptimizerOptions) {
    let Some(training) = &module.training else { return };
    let optimizer = training.optimizer.clone();
    let graph = &mut module.graph;
    // Sharded: each sharded variable's gradient is first the replicas' mean, which the rest
    // (clipping, the update) reads, as a mirrored plan's update reads the all-reduced mean.
    let mut layouts = std::collections::HashMap::new();
    let mut gradients = training.gradients.clone();
    if options.shards > 1 {
        for (variable, g) in &mut gradients {
            let ty = graph.node(*variable).outputs[0].clone();
            if !ty.dtype.is_float() || matches!(graph.node(g.node).op, Op::ScatterAdd { .. }) {
                continue;
            }
            let elements = ty.shape.n_elements();
            let size = elements.div_ceil(options.shards).max(1);
            layouts.insert(*variable, ShardLayout { elements, shards: options.shards, size });
            let name = graph.node(*variable).name.clone();
            let mut u = Updater { graph, variable: Some(*variable), scope: format!("{name}/update"), shards: None };
            *g = u.add(Op::CrossReplicaMean, &[*g]);
        }
    }
    let gradients = match optimizer.clip_global_norm {
        Some(norm) => clip_global_norm(graph, &gradients, norm),
        None => gradients,
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
        let mut u = Updater { graph, variable: None, scope: "optimizer".into(), shards: None };
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
            let mut u = Updater {
                graph,
                variable: gradients.first().map(|(v, _)| *v),
                scope: "optimizer".into(),
                shards: None,
            };
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
        let mut u = Updater { graph, variable: Some(variable), scope: format!("{name}/update"), shards: None };
        let dtype = ty.dtype;
        let layout = layouts.get(&variable).copied();
        // Sharded: the replica's shards of the gradient and of the value, and slots of a shard.
        let (g, current, slot_shape) = match layout {
            Some(layout) => {
                let g = u.shard(g, layout, "gradient");
                let value = u.read(variable);
                let current = u.shard(value, layout, "value");
                (g, Some(current), Shape::from(vec![layout.size]))
            }
            None => (g, None, ty.shape.clone()),
        };
        u.shards = layout;
        let lr = match (&optimizer.schedule, global_step.filter(|_| optimizer.schedule.is_some())) {
            (Some(schedule), Some(step)) => *scheduled.entry(dtype).or_insert_with(|| {
                let op = Op::LearningRate { schedule: schedule.clone(), dtype };
                let mut shared = Updater { graph: u.graph, variable: None, scope: "optimizer".into(), shards: None };
                shared.add(op, &[step])
            }),
            _ => u.constant(dtype, optimizer.learning_rate),
        };
        learning_rate.get_or_insert(lr);
        let delta = match optimizer.kind {
            OptimizerKind::Sgd => u.mul(lr, g),
            OptimizerKind::Momentum { momentum, nesterov } => {
                let slot = u.slot(&format!("{name}/momentum"), dtype, &slot_shape, Initializer::Zeros);
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
                let m_slot = u.slot(&format!("{name}/adam_m"), dtype, &slot_shape, Initializer::Zeros);
                let v_slot = u.slot(&format!("{name}/adam_v"), dtype, &slot_shape, Initializer::Zeros);
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
                    &slot_shape,
                    Initializer::Constant { value: initial_accumulator },
                );
                let g2 = u.mul(g, g);
                let accumulated = u.add(Op::AssignAdd, &[slot.into(), g2]);
                updates.push(accumulated.node);
                let normalised = u.normalise(g, accumulated, epsilon);
                u.mul(lr, normalised)
            }
            OptimizerKind::RmsProp { rho, momentum, epsilon } => {
                let ms_slot = u.slot(&format!("{name}/rms"), dtype, &slot_shape, Initializer::Zeros);
                let ms = u.moving_average(ms_slot, g, rho, true);
                updates.push(ms.node);
                let normalised = u.normalise(g, ms, epsilon);
                let step = u.mul(lr, normalised);
                if momentum > 0.0 {
                    let mom_slot = u.slot(&format!("{name}/rms_momentum"), dtype, &slot_shape, Initializer::Zeros);
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
            let current = current.unwrap_or_else(|| u.read(variable));
            let rate = u.constant(dtype, optimizer.weight_decay);
            let decay = u.mul(lr, rate);
            let shrink = u.mul(decay, current);
            u.binary(BinaryOp::Add, delta, shrink)
        } else {
            delta
        };
        let update = match (layout, current) {
            (Some(layout), Some(current)) => {
                let new = u.binary(BinaryOp::Sub, current, delta);
                let whole = u.all_gathered(new, layout, &name, &ty.shape);
                u.add(Op::Assign, &[variable.into(), whole])
            }
            _ => u.add(Op::AssignSub, &[variable.into(), delta]),
        };
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
    let mut u = Updater { graph, variable: None, scope: "optimizer/clip".into(), shards: None };
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
    /// Sharded: slots hold the replica's shard of the whole slot.
    shards: Option<ShardLayout>,
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

    /// A node named `name` exactly (a replica shard's or slot's, which replication finds by
    /// the name's ending).
    fn add_named(&mut self, op: Op, inputs: &[TensorRef], name: &str) -> TensorRef {
        let span = self.variable.and_then(|v| self.graph.span(v));
        let id = self
            .graph
            .add(op, inputs, name, span)
            .unwrap_or_else(|e| panic!("optimizer built an ill-typed `{name}`: {}", e.message));
        assert_eq!(self.graph.node(id).name, name, "an update's names are the variable's own");
        self.follow_variable(id);
        id.into()
    }

    /// Replica 0's shard of `t`: `t` flattened, padded with zeros to the layout's whole and
    /// sliced (a slice that each replica's copy moves to its own rows).
    fn shard(&mut self, t: TensorRef, layout: ShardLayout, what: &str) -> TensorRef {
        let flat = self.add(Op::Reshape { shape: Shape::from(vec![layout.elements]) }, &[t]);
        let padded = match layout.padded() - layout.elements {
            0 => flat,
            extra => self.add(Op::Pad { before: vec![0], after: vec![extra] }, &[flat]),
        };
        let slice = Op::Slice { begin: vec![0], size: vec![layout.size] };
        self.add_named(slice, &[padded], &format!("{}/{what}{REPLICA_SHARD}", self.scope))
    }

    /// The variable's new value from each replica's new `shard`: each in its slot of a
    /// `[shards, size]` tensor, summed over the replicas, unpadded and reshaped.
    fn all_gathered(&mut self, shard: TensorRef, layout: ShardLayout, name: &str, shape: &Shape) -> TensorRef {
        let row = self.add(Op::Reshape { shape: Shape::from(vec![1, layout.size]) }, &[shard]);
        let slot = Op::Pad { before: vec![0, 0], after: vec![layout.shards - 1, 0] };
        let slot = self.add_named(slot, &[row], &format!("{}/shard{REPLICA_SLOT}", self.scope));
        let key = format!("optimizer_shards/{name}");
        let gather = Op::AllReduce { key, group_size: layout.shards as u32, replica: 0 };
        let gathered = self.add(gather, &[slot]);
        let flat = self.add(Op::Reshape { shape: Shape::from(vec![layout.padded()]) }, &[gathered]);
        let value = match layout.padded() - layout.elements {
            0 => flat,
            _ => self.add(Op::Slice { begin: vec![0], size: vec![layout.elements] }, &[flat]),
        };
        self.add(Op::Reshape { shape: shape.clone() }, &[value])
    }

    /// A non-trainable variable for the optimizer's state, beside its variable; sharded, the
    /// replica's shard of it (replica 0's rows, which each replica's copy moves to its own).
    fn slot(&mut self, name: &str, dtype: DType, shape: &dfc_ir::Shape, init: Initializer) -> NodeId {
        let ty = dfc_ir::TensorType::new(dtype, shape.clone());
        let (name, origin) = match self.shards {
            Some(layout) => {
                let whole = VariableOrigin {
                    name: name.to_string(),
                    shape: Shape::from(vec![layout.padded()]),
                    offset: 0,
                    mirror_of: None,
                };
                (format!("{name}{REPLICA_SHARD}"), Some(Box::new(whole)))
            }
            None => (name.to_string(), None),
        };
        let name = name.as_str();
        let op = Op::Variable { ty, init, trainable: false, partitions: 1, origin };
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
