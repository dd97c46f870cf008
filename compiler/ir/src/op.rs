//! The closed set of IR operations. Attributes that determine an op's result type live in the
//! op itself, so that `infer` is a pure function of the op and its operand types.

use crate::device::DeviceSpec;
use crate::types::{DType, Shape, TensorType};
use serde::{Deserialize, Serialize};
use std::fmt;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Op {
    /// A placeholder fed with data at every step.
    Input {
        ty: TensorType,
    },
    /// A compile-time constant.
    Const {
        value: ConstValue,
    },
    /// A variable: owns a buffer that lives across steps. Its output is the variable itself
    /// (a reference); `Read` yields its value.
    Variable {
        ty: TensorType,
        init: Initializer,
        trainable: bool,
        /// Shards requested in the source (`@partitioned(n)`); the shard pass splits the
        /// variable and leaves 1.
        partitions: u32,
        /// Set on the shards of a partitioned variable and on replicas' copies: where the
        /// initial value comes from and what a checkpoint holds.
        origin: Option<Box<VariableOrigin>>,
    },
    Read,
    /// `variable = value`, `+=`, `-=`; yields the new value.
    Assign,
    AssignAdd,
    AssignSub,
    Identity,
    StopGradient,
    Unary(UnaryOp),
    Binary(BinaryOp),
    Compare(CompareOp),
    /// `select(cond, a, b)`, broadcast.
    Select,
    Cast {
        to: DType,
    },
    /// Batched matrix product of the last two axes; batch axes broadcast.
    MatMul {
        transpose_a: bool,
        transpose_b: bool,
    },
    Reshape {
        shape: Shape,
    },
    Transpose {
        perm: Vec<usize>,
    },
    /// Any number of operands, joined along `axis`.
    Concat {
        axis: usize,
    },
    Slice {
        begin: Vec<usize>,
        size: Vec<usize>,
    },
    Reduce {
        kind: ReduceKind,
        axes: Vec<usize>,
        keep_dims: bool,
    },
    Softmax {
        axis: usize,
    },
    LogSoftmax {
        axis: usize,
    },
    /// `(logits[..., C], labels[..., C]) -> loss[...]`, over the last axis.
    SoftmaxCrossEntropy,
    /// Elementwise `(logits, labels) -> loss`.
    SigmoidCrossEntropy,
    /// Integer indices `[...]` to `[..., depth]` of `dtype`.
    OneHot {
        depth: usize,
        dtype: DType,
    },
    /// NHWC input, HWIO filter.
    Conv2d {
        strides: [usize; 2],
        padding: Padding,
    },
    MaxPool {
        window: [usize; 2],
        strides: [usize; 2],
        padding: Padding,
    },
    AvgPool {
        window: [usize; 2],
        strides: [usize; 2],
        padding: Padding,
    },
    /// `(params[V, ...], indices[...]) -> [indices..., params[1..]]` along axis 0.
    Gather,
    /// Index of the largest element along `axis` (the first on ties), as `dtype` (i32 or i64).
    ArgMax {
        axis: usize,
        dtype: DType,
    },
    /// Each row of the last axis normalised to mean 0 and variance 1:
    /// `(x - mean) / sqrt(variance + epsilon)`, the variance the biased one (as TensorFlow's
    /// and Keras's `LayerNormalization`). The scale and offset are the caller's elementwise ops.
    LayerNorm {
        epsilon: f64,
    },
    /// `x[..., C] -> [2, C]`: each channel's (last axis's) mean over all the other axes, and
    /// its biased variance: the batch's statistics that `BatchNorm` normalises with.
    Moments,
    /// `(x[..., C], moments[2, C]) -> x`: each channel normalised with its moments,
    /// `(x - mean) · rsqrt(variance + epsilon)`. In a training step the moments are those of
    /// the batch, `Moments` of `x` itself or, `synchronized`, of all the replicas' batches
    /// (cross-replica means over `Moments` of `x`; the verifier holds sema to it), and the
    /// gradient is the one through them too (`BatchNormGradMeans`, `BatchNormGrad`), as
    /// TensorFlow's `FusedBatchNorm` with `is_training`.
    BatchNorm {
        epsilon: f64,
        synchronized: bool,
    },

    // The ops below exist for gradients; the language does not name them.
    /// Broadcasts (NumPy rules) to `shape`.
    BroadcastTo {
        shape: Shape,
    },
    /// Zero padding: `before[i]` and `after[i]` zeros around axis i. The gradient of `Slice`.
    Pad {
        before: Vec<usize>,
        after: Vec<usize>,
    },
    /// `(filter, grad_out) -> grad_input` of `Conv2d` with these attributes.
    Conv2dBackpropInput {
        input_shape: Shape,
        strides: [usize; 2],
        padding: Padding,
    },
    /// `(input, grad_out) -> grad_filter` of `Conv2d` with these attributes.
    Conv2dBackpropFilter {
        filter_shape: Shape,
        strides: [usize; 2],
        padding: Padding,
    },
    /// `(input, grad_out) -> grad_input` of `MaxPool`: each window's gradient goes to its
    /// (first) largest element.
    MaxPoolGrad {
        window: [usize; 2],
        strides: [usize; 2],
        padding: Padding,
    },
    /// `grad_out -> grad_input` of `AvgPool` (each output spreads evenly over its window's valid
    /// elements).
    AvgPoolGrad {
        input_shape: Shape,
        window: [usize; 2],
        strides: [usize; 2],
        padding: Padding,
    },
    /// `(indices[I...], updates[I..., D...]) -> [rows, D...]`: sums each update into the row its
    /// index names (out-of-range indices are an error at run time). The gradient of `Gather`.
    ScatterAdd {
        rows: usize,
    },
    /// `(x, grad_out) -> grad_x` of `LayerNorm`: with `x̂` the normalised row and `r` the
    /// reciprocal of its deviation, `r · (g - mean(g) - x̂ · mean(g · x̂))` along the last axis.
    LayerNormGrad {
        epsilon: f64,
    },
    /// `(x, moments, grad_out) -> [2, C]`: of `BatchNorm`'s gradient, each channel's means of
    /// `g` and of `g · x̂` over all but the last axis (`x̂` the normalised value).
    BatchNormGradMeans {
        epsilon: f64,
    },
    /// `(x, moments, grad_out, means[2, C]) -> grad_x` of `BatchNorm` with the batch's own
    /// moments: with `r` the reciprocal deviation of its channel, `r · (g - mean(g) - x̂ ·
    /// mean(g · x̂))`, the means `BatchNormGradMeans`' (of the replicas' batches together, for
    /// a synchronized one).
    BatchNormGrad {
        epsilon: f64,
    },
    /// `(seed, step) (i64 scalars) -> f32[shape]` uniform in [0, 1): Philox-4x32-10 bits, a
    /// stream per seed, step and `salt` (the op's own: its name's hash, mixed with the replica's
    /// index), element `e` from block `e / 4` of the counter, word `e % 4`.
    RandomUniform {
        shape: Shape,
        salt: u64,
    },
    /// `(seed, step) (i64 scalars) -> f32[shape]` standard normal: Box-Muller on Philox bits of
    /// the same stream as `RandomUniform`'s, element `e` from words `2(e % 2)` and `2(e % 2) + 1`
    /// of block `e / 2`.
    RandomNormal {
        shape: Shape,
        salt: u64,
    },
    /// `true` in a program that trains (runs updates), `false` in one that evaluates or infers:
    /// a `bool` scalar each program fixes, so that dropout is the identity outside training.
    TrainingFlag,
    /// `step (i64 scalar) -> the learning rate at that step (a `dtype` scalar)`: the
    /// optimizer's schedule, computed from the global step.
    LearningRate {
        schedule: crate::LrSchedule,
        dtype: DType,
    },

    // The ops below join the partitions of a placed graph; the language does not name them.
    /// Hands its operand to the device `to` under `key`: one Send per tensor and destination
    /// device. It has no output and runs as a target.
    Send {
        key: String,
        to: DeviceSpec,
    },
    /// The tensor that the `Send` with the same `key` on device `from` sends.
    Recv {
        key: String,
        from: DeviceSpec,
        ty: TensorType,
    },
    /// The sum of its operand over the `group_size` replicas whose `AllReduce` has the same
    /// `key`; this one is replica `replica`. Every replica gets the same value: the operands
    /// summed in replica order.
    AllReduce {
        key: String,
        group_size: u32,
        replica: u32,
    },
    /// The mean of its operand over the replicas of a data-parallel plan (synchronised batch
    /// statistics): replication makes it an `AllReduce` and a scale, and without replicas it is
    /// its operand. Plans never hold it.
    CrossReplicaMean,
}

/// A variable that stands for (part of) another: a shard of a partitioned variable, or a
/// replica's copy of a mirrored one.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VariableOrigin {
    /// The source model's variable whose initial value this one starts from (its seed is
    /// this name's).
    pub name: String,
    /// That variable's full shape.
    pub shape: Shape,
    /// The first row (along axis 0) this variable holds; 0 for a whole copy.
    pub offset: usize,
    /// A replica's copy of the variable named here: it holds the same value as that one at
    /// every step, so checkpoints keep that one only.
    pub mirror_of: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum UnaryOp {
    Neg,
    Abs,
    Exp,
    Log,
    Sqrt,
    Rsqrt,
    Relu,
    Sigmoid,
    Tanh,
}

impl UnaryOp {
    pub const ALL: [UnaryOp; 9] = [
        UnaryOp::Neg,
        UnaryOp::Abs,
        UnaryOp::Exp,
        UnaryOp::Log,
        UnaryOp::Sqrt,
        UnaryOp::Rsqrt,
        UnaryOp::Relu,
        UnaryOp::Sigmoid,
        UnaryOp::Tanh,
    ];

    pub fn name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "neg",
            UnaryOp::Abs => "abs",
            UnaryOp::Exp => "exp",
            UnaryOp::Log => "log",
            UnaryOp::Sqrt => "sqrt",
            UnaryOp::Rsqrt => "rsqrt",
            UnaryOp::Relu => "relu",
            UnaryOp::Sigmoid => "sigmoid",
            UnaryOp::Tanh => "tanh",
        }
    }

    /// Transcendental functions are defined on floating point only.
    pub fn needs_float(self) -> bool {
        !matches!(self, UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Relu)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    Pow,
    Maximum,
    Minimum,
}

impl BinaryOp {
    pub const ALL: [BinaryOp; 7] = [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::Pow,
        BinaryOp::Maximum,
        BinaryOp::Minimum,
    ];

    pub fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::Pow => "pow",
            BinaryOp::Maximum => "maximum",
            BinaryOp::Minimum => "minimum",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CompareOp {
    Equal,
    NotEqual,
    Less,
    LessEqual,
    Greater,
    GreaterEqual,
}

impl CompareOp {
    pub const ALL: [CompareOp; 6] = [
        CompareOp::Equal,
        CompareOp::NotEqual,
        CompareOp::Less,
        CompareOp::LessEqual,
        CompareOp::Greater,
        CompareOp::GreaterEqual,
    ];

    pub fn name(self) -> &'static str {
        match self {
            CompareOp::Equal => "equal",
            CompareOp::NotEqual => "not_equal",
            CompareOp::Less => "less",
            CompareOp::LessEqual => "less_equal",
            CompareOp::Greater => "greater",
            CompareOp::GreaterEqual => "greater_equal",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ReduceKind {
    Sum,
    Mean,
    Max,
    Min,
}

impl ReduceKind {
    pub fn name(self) -> &'static str {
        match self {
            ReduceKind::Sum => "sum",
            ReduceKind::Mean => "mean",
            ReduceKind::Max => "max",
            ReduceKind::Min => "min",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Padding {
    Valid,
    Same,
}

impl Padding {
    pub fn name(self) -> &'static str {
        match self {
            Padding::Valid => "valid",
            Padding::Same => "same",
        }
    }
}

/// How a variable's buffer is filled before the first step. Fan-in and fan-out follow Keras:
/// for a matrix `[in, out]`; for a convolution filter `[h, w, in, out]`, each times `h * w`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Initializer {
    Zeros,
    Ones,
    Constant {
        value: f64,
    },
    Uniform {
        min: f64,
        max: f64,
    },
    Normal {
        mean: f64,
        stddev: f64,
    },
    TruncatedNormal {
        mean: f64,
        stddev: f64,
    },
    GlorotUniform,
    HeNormal,
    /// The run's seed (`--seed`), for an i64 scalar: the key of the random ops' streams.
    Seed,
}

impl fmt::Display for Initializer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Initializer::Zeros => f.write_str("zeros"),
            Initializer::Ones => f.write_str("ones"),
            Initializer::Constant { value } => write!(f, "constant({value:?})"),
            Initializer::Uniform { min, max } => write!(f, "uniform({min:?}, {max:?})"),
            Initializer::Normal { mean, stddev } => write!(f, "normal({mean:?}, {stddev:?})"),
            Initializer::TruncatedNormal { mean, stddev } => {
                write!(f, "truncated_normal({mean:?}, {stddev:?})")
            }
            Initializer::GlorotUniform => f.write_str("glorot_uniform"),
            Initializer::HeNormal => f.write_str("he_normal"),
            Initializer::Seed => f.write_str("seed"),
        }
    }
}

/// The data of a constant, row-major.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ConstValue {
    pub shape: Shape,
    pub data: ConstData,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ConstData {
    F32(Vec<f32>),
    F64(Vec<f64>),
    I32(Vec<i32>),
    I64(Vec<i64>),
    U8(Vec<u8>),
    Bool(Vec<bool>),
}

impl ConstValue {
    /// A constant of `dtype` holding `values` (converted as `as` would), shaped `shape`.
    pub fn from_f64(dtype: DType, shape: Shape, values: &[f64]) -> ConstValue {
        let data = match dtype {
            DType::F32 => ConstData::F32(values.iter().map(|&v| v as f32).collect()),
            DType::F64 => ConstData::F64(values.to_vec()),
            DType::I32 => ConstData::I32(values.iter().map(|&v| v as i32).collect()),
            DType::I64 => ConstData::I64(values.iter().map(|&v| v as i64).collect()),
            DType::U8 => ConstData::U8(values.iter().map(|&v| v as u8).collect()),
            DType::Bool => ConstData::Bool(values.iter().map(|&v| v != 0.0).collect()),
        };
        ConstValue { shape, data }
    }

    pub fn scalar(dtype: DType, value: f64) -> ConstValue {
        ConstValue::from_f64(dtype, Shape::scalar(), &[value])
    }

    pub fn dtype(&self) -> DType {
        match self.data {
            ConstData::F32(_) => DType::F32,
            ConstData::F64(_) => DType::F64,
            ConstData::I32(_) => DType::I32,
            ConstData::I64(_) => DType::I64,
            ConstData::U8(_) => DType::U8,
            ConstData::Bool(_) => DType::Bool,
        }
    }

    pub fn len(&self) -> usize {
        match &self.data {
            ConstData::F32(v) => v.len(),
            ConstData::F64(v) => v.len(),
            ConstData::I32(v) => v.len(),
            ConstData::I64(v) => v.len(),
            ConstData::U8(v) => v.len(),
            ConstData::Bool(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn ty(&self) -> TensorType {
        TensorType::new(self.dtype(), self.shape.clone())
    }

    /// The values as f64, for printing and folding.
    pub fn to_f64(&self) -> Vec<f64> {
        match &self.data {
            ConstData::F32(v) => v.iter().map(|&x| x as f64).collect(),
            ConstData::F64(v) => v.clone(),
            ConstData::I32(v) => v.iter().map(|&x| x as f64).collect(),
            ConstData::I64(v) => v.iter().map(|&x| x as f64).collect(),
            ConstData::U8(v) => v.iter().map(|&x| x as f64).collect(),
            ConstData::Bool(v) => v.iter().map(|&x| if x { 1.0 } else { 0.0 }).collect(),
        }
    }
}

impl fmt::Display for ConstValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let values = self.to_f64();
        let show = |v: f64| -> String {
            match self.dtype() {
                DType::Bool => (v != 0.0).to_string(),
                // An f32 shown as the shortest text that reads back as the same f32.
                DType::F32 => format!("{:?}", v as f32),
                DType::F64 => format!("{v:?}"),
                _ => format!("{}", v as i64),
            }
        };
        if self.shape.rank() == 0 && values.len() == 1 {
            return f.write_str(&show(values[0]));
        }
        const SHOWN: usize = 8;
        f.write_str("[")?;
        for (i, v) in values.iter().take(SHOWN).enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            f.write_str(&show(*v))?;
        }
        if values.len() > SHOWN {
            write!(f, ", ... {} more", values.len() - SHOWN)?;
        }
        f.write_str("]")
    }
}

impl Op {
    /// The op's name in the text form.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Input { .. } => "input",
            Op::Const { .. } => "const",
            Op::Variable { .. } => "variable",
            Op::Read => "read",
            Op::Assign => "assign",
            Op::AssignAdd => "assign_add",
            Op::AssignSub => "assign_sub",
            Op::Identity => "identity",
            Op::StopGradient => "stop_gradient",
            Op::Unary(op) => op.name(),
            Op::Binary(op) => op.name(),
            Op::Compare(op) => op.name(),
            Op::Select => "select",
            Op::Cast { .. } => "cast",
            Op::MatMul { .. } => "matmul",
            Op::Reshape { .. } => "reshape",
            Op::Transpose { .. } => "transpose",
            Op::Concat { .. } => "concat",
            Op::Slice { .. } => "slice",
            Op::Reduce { kind, .. } => kind.name(),
            Op::Softmax { .. } => "softmax",
            Op::LogSoftmax { .. } => "log_softmax",
            Op::SoftmaxCrossEntropy => "softmax_cross_entropy",
            Op::SigmoidCrossEntropy => "sigmoid_cross_entropy",
            Op::OneHot { .. } => "one_hot",
            Op::Conv2d { .. } => "conv2d",
            Op::MaxPool { .. } => "max_pool",
            Op::AvgPool { .. } => "avg_pool",
            Op::Gather => "gather",
            Op::ArgMax { .. } => "argmax",
            Op::LayerNorm { .. } => "layer_norm",
            Op::LayerNormGrad { .. } => "layer_norm_grad",
            Op::Moments => "moments",
            Op::BatchNorm { .. } => "batch_norm",
            Op::BatchNormGradMeans { .. } => "batch_norm_grad_means",
            Op::BatchNormGrad { .. } => "batch_norm_grad",
            Op::BroadcastTo { .. } => "broadcast_to",
            Op::Pad { .. } => "pad",
            Op::Conv2dBackpropInput { .. } => "conv2d_backprop_input",
            Op::Conv2dBackpropFilter { .. } => "conv2d_backprop_filter",
            Op::MaxPoolGrad { .. } => "max_pool_grad",
            Op::AvgPoolGrad { .. } => "avg_pool_grad",
            Op::ScatterAdd { .. } => "scatter_add",
            Op::LearningRate { .. } => "learning_rate",
            Op::RandomUniform { .. } => "random_uniform",
            Op::RandomNormal { .. } => "random_normal",
            Op::TrainingFlag => "training_flag",
            Op::Send { .. } => "send",
            Op::Recv { .. } => "recv",
            Op::AllReduce { .. } => "all_reduce",
            Op::CrossReplicaMean => "cross_replica_mean",
        }
    }

    /// The number of data operands, or `None` for variadic ops (`concat`).
    pub fn arity(&self) -> Option<usize> {
        Some(match self {
            Op::Input { .. } | Op::Const { .. } | Op::Variable { .. } | Op::Recv { .. } | Op::TrainingFlag => 0,
            Op::Read
            | Op::Identity
            | Op::StopGradient
            | Op::Unary(_)
            | Op::Cast { .. }
            | Op::Reshape { .. }
            | Op::Transpose { .. }
            | Op::Slice { .. }
            | Op::Reduce { .. }
            | Op::Softmax { .. }
            | Op::LogSoftmax { .. }
            | Op::OneHot { .. }
            | Op::MaxPool { .. }
            | Op::AvgPool { .. }
            | Op::ArgMax { .. }
            | Op::LayerNorm { .. }
            | Op::Moments
            | Op::BroadcastTo { .. }
            | Op::Pad { .. }
            | Op::AvgPoolGrad { .. }
            | Op::LearningRate { .. }
            | Op::Send { .. }
            | Op::AllReduce { .. }
            | Op::CrossReplicaMean => 1,
            Op::Assign
            | Op::AssignAdd
            | Op::AssignSub
            | Op::Binary(_)
            | Op::Compare(_)
            | Op::MatMul { .. }
            | Op::SoftmaxCrossEntropy
            | Op::SigmoidCrossEntropy
            | Op::Conv2d { .. }
            | Op::Gather
            | Op::Conv2dBackpropInput { .. }
            | Op::Conv2dBackpropFilter { .. }
            | Op::MaxPoolGrad { .. }
            | Op::ScatterAdd { .. }
            | Op::LayerNormGrad { .. }
            | Op::BatchNorm { .. }
            | Op::RandomUniform { .. }
            | Op::RandomNormal { .. } => 2,
            Op::Select | Op::BatchNormGradMeans { .. } => 3,
            Op::BatchNormGrad { .. } => 4,
            Op::Concat { .. } => return None,
        })
    }

    /// Ops with effects beyond their outputs: they may not be removed or reordered freely.
    pub fn is_stateful(&self) -> bool {
        matches!(
            self,
            Op::Variable { .. }
                | Op::Assign
                | Op::AssignAdd
                | Op::AssignSub
                | Op::Send { .. }
                | Op::Recv { .. }
                | Op::AllReduce { .. }
        )
    }

    /// Attributes in the text form, `name=value`, in a fixed order.
    pub fn attributes(&self) -> Vec<(&'static str, String)> {
        fn list(values: &[usize]) -> String {
            let items: Vec<String> = values.iter().map(|v| v.to_string()).collect();
            format!("[{}]", items.join(","))
        }
        match self {
            Op::Const { value } => vec![("value", value.to_string())],
            Op::Variable { init, trainable, partitions, origin, .. } => {
                let mut attrs = vec![("init", init.to_string())];
                if !trainable {
                    attrs.push(("trainable", "false".into()));
                }
                if *partitions > 1 {
                    attrs.push(("partitions", partitions.to_string()));
                }
                if let Some(origin) = origin {
                    attrs.push(("origin", format!("{}{}@{}", origin.name, origin.shape, origin.offset)));
                    if let Some(of) = &origin.mirror_of {
                        attrs.push(("mirror_of", of.clone()));
                    }
                }
                attrs
            }
            Op::Send { key, to } => vec![("key", format!("{key:?}")), ("to", format!("\"{to}\""))],
            Op::Recv { key, from, .. } => vec![("key", format!("{key:?}")), ("from", format!("\"{from}\""))],
            Op::AllReduce { key, group_size, replica } => vec![
                ("key", format!("{key:?}")),
                ("group_size", group_size.to_string()),
                ("replica", replica.to_string()),
            ],
            Op::MatMul { transpose_a, transpose_b } => {
                let mut attrs = Vec::new();
                if *transpose_a {
                    attrs.push(("transpose_a", "true".into()));
                }
                if *transpose_b {
                    attrs.push(("transpose_b", "true".into()));
                }
                attrs
            }
            Op::Transpose { perm } => vec![("perm", list(perm))],
            Op::Concat { axis } | Op::Softmax { axis } | Op::LogSoftmax { axis } => {
                vec![("axis", axis.to_string())]
            }
            Op::Slice { begin, size } => vec![("begin", list(begin)), ("size", list(size))],
            Op::Reduce { axes, keep_dims, .. } => {
                let mut attrs = vec![("axes", list(axes))];
                if *keep_dims {
                    attrs.push(("keep_dims", "true".into()));
                }
                attrs
            }
            Op::OneHot { depth, .. } => vec![("depth", depth.to_string())],
            Op::ArgMax { axis, .. } => vec![("axis", axis.to_string())],
            Op::Pad { before, after } => vec![("before", list(before)), ("after", list(after))],
            Op::Conv2dBackpropInput { strides, padding, .. } | Op::Conv2dBackpropFilter { strides, padding, .. } => {
                vec![("strides", list(strides)), ("padding", padding.name().into())]
            }
            Op::MaxPoolGrad { window, strides, padding } | Op::AvgPoolGrad { window, strides, padding, .. } => {
                vec![("window", list(window)), ("strides", list(strides)), ("padding", padding.name().into())]
            }
            Op::ScatterAdd { rows } => vec![("rows", rows.to_string())],
            Op::LayerNorm { epsilon }
            | Op::LayerNormGrad { epsilon }
            | Op::BatchNormGradMeans { epsilon }
            | Op::BatchNormGrad { epsilon } => vec![("epsilon", epsilon.to_string())],
            Op::BatchNorm { epsilon, synchronized } => {
                let mut attrs = vec![("epsilon", epsilon.to_string())];
                if *synchronized {
                    attrs.push(("synchronized", "true".into()));
                }
                attrs
            }
            Op::LearningRate { schedule, .. } => vec![("schedule", format!("{:?}", schedule.to_string()))],
            Op::RandomUniform { salt, .. } | Op::RandomNormal { salt, .. } => vec![("salt", format!("{salt:#x}"))],
            Op::Conv2d { strides, padding } => {
                vec![("strides", list(strides)), ("padding", padding.name().into())]
            }
            Op::MaxPool { window, strides, padding } | Op::AvgPool { window, strides, padding } => {
                vec![("window", list(window)), ("strides", list(strides)), ("padding", padding.name().into())]
            }
            _ => Vec::new(),
        }
    }
}
