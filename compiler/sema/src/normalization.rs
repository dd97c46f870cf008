//! `batch_norm(x, momentum, epsilon)`: each channel (the last axis) normalised over all the
//! other axes. In training it uses the batch's mean and (biased) variance and moves the
//! channel's moving averages towards them, `moving -= (1 - momentum) · (moving - batch)`
//! (Keras's `BatchNormalization`); elsewhere (evaluation, `--fetch`, inference) it uses the
//! moving averages. They are non-trainable variables, `NAME/moving_mean` and
//! `NAME/moving_variance`, checkpointed with the rest; their assignments are updates of the
//! training step (the optimizer pass adds them to `Training::updates`).
//!
//! With `synchronized`, the statistics are those of all the replicas' batches together (Keras's
//! `synchronized=True`): the mean and the variance are `CrossReplicaMean`s of each replica's
//! (the variance with each mean's squared distance from the whole's added first), which data
//! parallelism makes all-reduces of a value per channel, and the gradient's two means per
//! channel are all-reduced too. Without replicas the statistics are the batch's either way.
//!
//! The ops are fused, as TensorFlow's `FusedBatchNorm`: `Moments` (the batch's means and
//! variances, one pass), `BatchNorm` (one pass) and, from autodiff, `BatchNormGradMeans` (two
//! sums per channel, one pass) and `BatchNormGrad` (one pass).

use crate::lower::Lowerer;
use crate::value::{Number, Val};
use dfc_diag::{Code, Diagnostic, Span};
use dfc_ir::{BinaryOp, DType, Initializer, NodeId, Op, Shape, TensorRef, TensorType};

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
        let momentum = options.momentum;
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
        let constant = |this: &mut Self, v: f64| {
            this.make_tensor(Val::Number(Number::Float(v)), span, Some(ty.dtype)).map(|t| (t, span))
        };
        let result = (|| {
            let (moving_mean, moving_variance) = (moving_mean?, moving_variance?);
            let read = |this: &mut Self, variable: NodeId| this.op_node(Op::Read, &[(variable.into(), span)], span);
            let (mean_now, variance_now) = (read(self, moving_mean)?, read(self, moving_variance)?);
            let training = self.op_node(Op::TrainingFlag, &[], span)?;
            let now = (mean_now, variance_now);
            let (normalised, batch_mean, batch_variance) =
                self.fused_batch_norm(x, training, now, &options, channels.dims()[0], span)?;
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

    /// `Moments` of the batch (one pass), `BatchNorm` with them in training and with the
    /// moving averages elsewhere, and from autodiff its gradient (`BatchNormGradMeans`,
    /// `BatchNormGrad`). Returns the normalised value and the batch's mean and variance.
    fn fused_batch_norm(
        &mut self,
        x: (TensorRef, Span),
        training: (TensorRef, Span),
        (mean_now, variance_now): ((TensorRef, Span), (TensorRef, Span)),
        options: &BatchNormOptions,
        channels: usize,
        span: Span,
    ) -> Option<Norm> {
        let local = self.op_node(Op::Moments, &[x], span)?;
        let statistic = |this: &mut Self, at: usize| {
            let sliced = this.op_node(Op::Slice { begin: vec![at, 0], size: vec![1, channels] }, &[local], span)?;
            this.op_node(Op::Reshape { shape: Shape(vec![channels]) }, &[sliced], span)
        };
        let (mut mean, mut variance) = (statistic(self, 0)?, statistic(self, 1)?);
        let row = Shape(vec![1, channels]);
        let as_rows = |this: &mut Self, mean, variance| {
            let as_row = |this: &mut Self, t| this.op_node(Op::Reshape { shape: row.clone() }, &[t], span);
            let (mean_row, variance_row) = (as_row(this, mean)?, as_row(this, variance)?);
            this.op_node(Op::Concat { axis: 0 }, &[mean_row, variance_row], span)
        };
        let batch = if options.synchronized {
            // Replicas' batches are of one size: the whole batch's mean is the mean of theirs,
            // and its variance the mean of each one's variance plus its mean's squared distance
            // from the whole's (no cancellation, unlike E[x²] - mean²).
            let local_mean = mean;
            mean = self.op_node(Op::CrossReplicaMean, &[local_mean], span)?;
            let gap = self.op_node(Op::Binary(BinaryOp::Sub), &[local_mean, mean], span)?;
            let squared = self.op_node(Op::Binary(BinaryOp::Mul), &[gap, gap], span)?;
            let spread = self.op_node(Op::Binary(BinaryOp::Add), &[variance, squared], span)?;
            variance = self.op_node(Op::CrossReplicaMean, &[spread], span)?;
            as_rows(self, mean, variance)?
        } else {
            local
        };
        let moving = as_rows(self, mean_now, variance_now)?;
        let moments = self.op_node(Op::Select, &[training, batch, moving], span)?;
        let op = Op::BatchNorm { epsilon: options.epsilon, synchronized: options.synchronized };
        let normalised = self.op_node(op, &[x, moments], span)?;
        Some((normalised, mean, variance))
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
