//! Random ops: `random_uniform(shape)`, `random_normal(shape, mean, stddev)` and
//! `dropout(x, rate)`. Each draws from its own Philox stream (`Op::RandomUniform`,
//! `Op::RandomNormal`), keyed by the run's seed (a `random_seed` variable,
//! initialised from `--seed`) and the global step (a `global_step` variable, which the
//! optimizer increments), both checkpointed, so that a run is reproducible and a resumed one
//! draws what it would have drawn. `dropout` is the identity outside training
//! (`Op::TrainingFlag`: false in evaluation, `--fetch` and `--inference`).

use crate::lower::Lowerer;
use crate::value::{Number, Val};
use dfc_diag::{Code, Diagnostic, Span};
use dfc_ir::{BinaryOp, CompareOp, DType, Initializer, NodeId, Op, Shape, TensorRef, TensorType};

/// The variable holding the run's seed.
pub const SEED_VARIABLE: &str = "random_seed";
/// The variable counting the training steps taken (shared with the optimizer's schedules).
pub const STEP_VARIABLE: &str = "global_step";

impl Lowerer<'_> {
    /// The non-trainable i64 scalar variable `name`, made with `init` the first time.
    fn counter(&mut self, name: &str, init: Initializer) -> Option<NodeId> {
        let scalar = TensorType::scalar(DType::I64);
        let existing = self.graph.node_ids().find(|&id| {
            let node = self.graph.node(id);
            node.name == name && matches!(&node.op, Op::Variable { ty, trainable: false, .. } if *ty == scalar)
        });
        if existing.is_some() {
            return existing;
        }
        let op = Op::Variable { ty: scalar, init, trainable: false, partitions: 1, origin: None };
        self.graph.add(op, &[], name, None).ok()
    }

    /// `f32[shape]` uniform in [0, 1), a stream of its own.
    pub(crate) fn random_uniform(&mut self, shape: Shape, span: Span) -> Val {
        self.random(|salt| Op::RandomUniform { shape, salt }, span)
    }

    /// `f32[shape]` normal with `mean` and `stddev`, a stream of its own.
    pub(crate) fn random_normal(&mut self, shape: Shape, mean: f64, stddev: f64, span: Span) -> Val {
        let standard = self.random(|salt| Op::RandomNormal { shape, salt }, span);
        if (mean, stddev) == (0.0, 1.0) {
            return standard;
        }
        let Val::Tensor(z) = standard else { return Val::Error };
        let constant = |this: &mut Self, v: f64| {
            this.make_tensor(Val::Number(Number::Float(v)), span, Some(DType::F32)).map(|t| (t, span))
        };
        let (Some(scale), Some(shift)) = (constant(self, stddev), constant(self, mean)) else { return Val::Error };
        let Val::Tensor(scaled) = self.node(Op::Binary(BinaryOp::Mul), &[(z, span), scale], span) else {
            return Val::Error;
        };
        self.node(Op::Binary(BinaryOp::Add), &[(scaled, span), shift], span)
    }

    /// The random op `op(salt)` of the seed and the step, its salt its own.
    fn random(&mut self, op: impl FnOnce(u64) -> Op, span: Span) -> Val {
        let (Some(seed), Some(step)) =
            (self.counter(SEED_VARIABLE, Initializer::Seed), self.counter(STEP_VARIABLE, Initializer::Zeros))
        else {
            return Val::Error;
        };
        let read = |this: &mut Self, variable: NodeId| match this.node(Op::Read, &[(variable.into(), span)], span) {
            Val::Tensor(t) => Some(t),
            _ => None,
        };
        let (Some(seed), Some(step)) = (read(self, seed), read(self, step)) else { return Val::Error };
        // The op's own stream: its place among the model's random ops and where it is.
        let drawn = self
            .graph
            .node_ids()
            .filter(|&id| matches!(self.graph.node(id).op, Op::RandomUniform { .. } | Op::RandomNormal { .. }))
            .count();
        let salt = fnv1a(&format!("{}{}#{drawn}", self.prefix, self.hint));
        self.node(op(salt), &[(seed, span), (step, span)], span)
    }

    /// `dropout(x, rate)`: in training, each element zeroed with probability `rate` and the
    /// rest scaled by `1 / (1 - rate)`; elsewhere `x`.
    pub(crate) fn dropout(&mut self, x: (TensorRef, Span), rate: f64, rate_span: Span, span: Span) -> Val {
        if !(0.0..1.0).contains(&rate) {
            self.diagnostics.push(
                Diagnostic::error(Code::ARGUMENT_KIND, rate_span, format!("`rate` = {rate} is out of range"))
                    .with_label("must be in [0, 1): the fraction of elements dropped"),
            );
            return Val::Error;
        }
        let ty = self.graph.ty(x.0).clone();
        if !ty.dtype.is_float() {
            self.diagnostics.push(
                Diagnostic::error(Code::DTYPE_MISMATCH, x.1, format!("`dropout` takes a float tensor, not {ty}"))
                    .with_label(format!("this is {ty}")),
            );
            return Val::Error;
        }
        if rate == 0.0 {
            return Val::Tensor(x.0);
        }
        let constant = |this: &mut Self, v: f64, dtype: DType| {
            this.make_tensor(Val::Number(Number::Float(v)), span, Some(dtype)).map(|t| (t, span))
        };
        let result = (|| {
            let Val::Tensor(u) = self.random_uniform(ty.shape.clone(), span) else { return None };
            let u = (u, span);
            let threshold = constant(self, rate, DType::F32)?;
            let keep = self.op_node(Op::Compare(CompareOp::GreaterEqual), &[u, threshold], span)?;
            let scale = constant(self, 1.0 / (1.0 - rate), ty.dtype)?;
            let scaled = self.op_node(Op::Binary(BinaryOp::Mul), &[x, scale], span)?;
            let zero = constant(self, 0.0, ty.dtype)?;
            let dropped = self.op_node(Op::Select, &[keep, scaled, zero], span)?;
            let training = self.op_node(Op::TrainingFlag, &[], span)?;
            self.op_node(Op::Select, &[training, dropped, x], span)
        })();
        result.map_or(Val::Error, |(t, _)| Val::Tensor(t))
    }
}

/// FNV-1a, 64 bits: a stable hash of a random op's place, its stream's salt.
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
}
