//! `batch_norm(x, momentum, epsilon)`: each channel (the last axis) normalised over all the
//! other axes. In training it uses the batch's mean and (biased) variance and moves the
//! channel's moving averages towards them, `moving -= (1 - momentum) · (moving - batch)`
//! (Keras's `BatchNormalization`); elsewhere (evaluation, `--fetch`, inference) it uses the
//! moving averages. They are non-trainable variables, `NAME/moving_mean` and
//! `NAME/moving_variance`, checkpointed with the rest; their assignments are updates of the
//! training step (the optimizer pass adds them to `Training::updates`).
//!
//! With `synchronized`, the statistics are those of all the replicas' batches together (Keras's
//! `synchronized=True`): each mean is a `CrossReplicaMean`, which data parallelism makes an
//! all-reduce, and its gradient the mean of the replicas' gradients. The variance is the mean of
//! squared deviations from the shared mean, so it is the whole batch's too. Without replicas
//! the statistics are the batch's either way.
//!
//! Per-replica statistics are fused ops, as TensorFlow's `FusedBatchNorm`: `Moments` (the
//! batch's means and variances, one pass), `BatchNorm` (one pass) and, from autodiff, its
//! gradient `BatchNormGrad` (a pass for two sums per channel, one for the gradient). The
//! synchronised form stays the reductions and elementwise ops it is made of, since an
//! all-reduce sits between its reductions.

use crate::lower::Lowerer;
use crate::value::{Number, Val};
use dfc_diag::{Code, Diagnostic, Span};
use dfc_ir::{BinaryOp, DType, Initializer, NodeId, Op, ReduceKind, Shape, TensorRef, TensorType, UnaryOp};

/// A batch normalisation's value, and its batch's mean and variance.
type Norm = ((TensorRef, Span), (TensorRef, Span), (TensorRef, Span));

/// `batch_norm`'s arguments.
pub(crate) struct BatchNormOptions {
    pub momentum: f64,
    pub epsilon: f64,
    /// The statistics of the replicas' whole batch, not each replica's own.
    pub synchronized: bool,
}

impl Lowerer<'_> {
    pub(crate) fn batch_norm(&mut self, x: (TensorRef, Span), options: BatchNormOptions, span: Span) -> Val {
        let BatchNormOptions { momentum, epsilon, synchronized } = options;
        let ty = self.graph.ty(x.0).clone();
        if !ty.dtype.is_float() {
            self.diagnostics.push(
                Diagnostic::error(Code::DTYPE_MISMATCH, x.1, format!("`batch_norm` takes a float tensor, not {ty}"))
                    .with_label(format!("this is {ty}")),
            );
            return Val::Error;
        }
        let rank = ty.shape.rank();
        if rank < 2 {
            self.diagnostics.push(
                Diagnostic::error(
                    Code::AXIS_OUT_OF_RANGE,
                    x.1,
                    format!("`batch_norm` of {ty}: it needs a batch axis and a channel axis"),
                )
                .with_label(format!("this is {ty}"))
                .with_help("the last axis holds the channels; the statistics are over all the others"),
            );
            return Val::Error;
        }
        let channels = Shape(vec![ty.shape.dims()[rank - 1]]);
        let base = if self.hint.is_empty() {
            format!("{}batch_norm", self.prefix)
        } else {
            format!("{}{}", self.prefix, self.hint)
        };
        let moving_mean = self.moving_average(&format!("{base}/moving_mean"), ty.dtype, &channels, Initializer::Zeros);
        let moving_variance =
            self.moving_average(&format!("{base}/moving_variance"), ty.dtype, &channels, Initializer::Ones);
        let axes: Vec<usize> = (0..rank - 1).collect();
        let constant = |this: &mut Self, v: f64| {
            this.make_tensor(Val::Number(Number::Float(v)), span, Some(ty.dtype)).map(|t| (t, span))
        };
        let result = (|| {
            let (moving_mean, moving_variance) = (moving_mean?, moving_variance?);
            let read = |this: &mut Self, variable: NodeId| this.op_node(Op::Read, &[(variable.into(), span)], span);
            let (mean_now, variance_now) = (read(self, moving_mean)?, read(self, moving_variance)?);
            let training = self.op_node(Op::TrainingFlag, &[], span)?;
            let (normalised, batch_mean, batch_variance) = if synchronized {
                self.synchronized_batch_norm(x, training, (mean_now, variance_now), epsilon, &axes, span)?
            } else {
                self.fused_batch_norm(x, training, (mean_now, variance_now), epsilon, channels.dims()[0], span)?
            };
            // The moving averages' updates, from the batch's statistics (no gradient flows
            // into an update: autodiff starts from the loss).
            let rate = constant(self, 1.0 - momentum)?;
            let (sub, mul) = (Op::Binary(BinaryOp::Sub), Op::Binary(BinaryOp::Mul));
            for (variable, now, batch) in
                [(moving_mean, mean_now, batch_mean), (moving_variance, variance_now, batch_variance)]
            {
                let gap = self.op_node(sub.clone(), &[now, batch], span)?;
                let step = self.op_node(mul.clone(), &[rate, gap], span)?;
                self.op_node(Op::AssignSub, &[(variable.into(), span), step], span)?;
            }
            Some(normalised)
        })();
        result.map_or(Val::Error, |(t, _)| Val::Tensor(t))
    }

    /// The fused form: `Moments` of the batch (one pass), `BatchNorm` with them in training and
    /// with the moving averages elsewhere, and its gradient `BatchNormGrad` (autodiff).
    /// Returns the normalised value and the batch's mean and variance.
    fn fused_batch_norm(
        &mut self,
        x: (TensorRef, Span),
        training: (TensorRef, Span),
        (mean_now, variance_now): ((TensorRef, Span), (TensorRef, Span)),
        epsilon: f64,
        channels: usize,
        span: Span,
    ) -> Option<Norm> {
        let row = Shape(vec![1, channels]);
        let batch = self.op_node(Op::Moments, &[x], span)?;
        let as_row = |this: &mut Self, t| this.op_node(Op::Reshape { shape: row.clone() }, &[t], span);
        let (mean_row, variance_row) = (as_row(self, mean_now)?, as_row(self, variance_now)?);
        let moving = self.op_node(Op::Concat { axis: 0 }, &[mean_row, variance_row], span)?;
        let moments = self.op_node(Op::Select, &[training, batch, moving], span)?;
        let normalised = self.op_node(Op::BatchNorm { epsilon }, &[x, moments], span)?;
        let statistic = |this: &mut Self, at: usize| {
            let sliced = this.op_node(Op::Slice { begin: vec![at, 0], size: vec![1, channels] }, &[batch], span)?;
            this.op_node(Op::Reshape { shape: Shape(vec![channels]) }, &[sliced], span)
        };
        Some((normalised, statistic(self, 0)?, statistic(self, 1)?))
    }

    /// The composed form, whose means are `CrossReplicaMean`s: data parallelism puts an
    /// all-reduce between the reductions, so no one kernel can hold them.
    fn synchronized_batch_norm(
        &mut self,
        x: (TensorRef, Span),
        training: (TensorRef, Span),
        (mean_now, variance_now): ((TensorRef, Span), (TensorRef, Span)),
        epsilon: f64,
        axes: &[usize],
        span: Span,
    ) -> Option<Norm> {
        let mean_of = |this: &mut Self, t: (TensorRef, Span)| {
            let mean = Op::Reduce { kind: ReduceKind::Mean, axes: axes.to_vec(), keep_dims: false };
            let local = this.op_node(mean, &[t], span)?;
            // Replicas' batches are of one size: the mean of their means is the whole's.
            this.op_node(Op::CrossReplicaMean, &[local], span)
        };
        let (sub, mul) = (Op::Binary(BinaryOp::Sub), Op::Binary(BinaryOp::Mul));
        let batch_mean = mean_of(self, x)?;
        let centred = self.op_node(sub.clone(), &[x, batch_mean], span)?;
        let squares = self.op_node(mul.clone(), &[centred, centred], span)?;
        let batch_variance = mean_of(self, squares)?;
        let mean = self.op_node(Op::Select, &[training, batch_mean, mean_now], span)?;
        let variance = self.op_node(Op::Select, &[training, batch_variance, variance_now], span)?;
        let eps = self.make_tensor(Val::Number(Number::Float(epsilon)), span, Some(self.graph.ty(x.0).dtype))?;
        let shifted = self.op_node(Op::Binary(BinaryOp::Add), &[variance, (eps, span)], span)?;
        let scale = self.op_node(Op::Unary(UnaryOp::Rsqrt), &[shifted], span)?;
        let deviation = self.op_node(sub, &[x, mean], span)?;
        let normalised = self.op_node(mul, &[deviation, scale], span)?;
        Some((normalised, batch_mean, batch_variance))
    }

    /// A non-trainable variable of the layer's statistics, named `name` (made unique).
    fn moving_average(&mut self, name: &str, dtype: DType, shape: &Shape, init: Initializer) -> Option<NodeId> {
        let op = Op::Variable {
            ty: TensorType::new(dtype, shape.clone()),
            init,
            trainable: false,
            partitions: 1,
            origin: None,
        };
        let id = self.graph.add(op, &[], name, None).ok()?;
        self.request(id);
        Some(id)
    }
}
