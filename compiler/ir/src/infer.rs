//! Result types of ops. This is the one definition of what each op accepts: semantic analysis
//! calls it to type the program (turning a `TypeError` into a diagnostic at the source span),
//! and the verifier calls it to check every node after every pass.

use crate::op::{Op, Padding, ReduceKind};
use crate::types::{DType, Shape, TensorType};
use dfc_diag::Code;

/// Why an op does not accept its operands. `operand` names the offending operand when one
/// is to blame, so that a diagnostic can point at it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TypeError {
    pub code: Code,
    pub message: String,
    pub help: Option<String>,
    pub operand: Option<usize>,
}

impl TypeError {
    fn new(code: Code, message: impl Into<String>) -> TypeError {
        TypeError { code, message: message.into(), help: None, operand: None }
    }

    fn help(mut self, help: impl Into<String>) -> TypeError {
        self.help = Some(help.into());
        self
    }

    fn at(mut self, operand: usize) -> TypeError {
        self.operand = Some(operand);
        self
    }
}

type Result<T> = std::result::Result<T, TypeError>;

/// The types of `op`'s outputs given its operands' types.
pub fn infer(op: &Op, inputs: &[&TensorType]) -> Result<Vec<TensorType>> {
    if let Some(arity) = op.arity() {
        if inputs.len() != arity {
            return Err(TypeError::new(
                Code::ARITY,
                format!("`{}` takes {arity} operand(s), not {}", op.name(), inputs.len()),
            ));
        }
    }
    let name = op.name();
    let ty = match op {
        Op::Send { .. } => return Ok(Vec::new()),
        Op::Input { ty } | Op::Variable { ty, .. } | Op::Recv { ty, .. } => ty.clone(),
        Op::AllReduce { .. } | Op::CrossReplicaMean => {
            numeric(name, inputs[0], 0)?;
            inputs[0].clone()
        }
        Op::Const { value } => value.ty(),
        Op::Read | Op::Identity | Op::StopGradient => inputs[0].clone(),
        Op::Assign | Op::AssignAdd | Op::AssignSub => {
            if inputs[0] != inputs[1] {
                return Err(TypeError::new(
                    Code::SHAPE_MISMATCH,
                    format!("`{name}` of a {} value to a {} variable", inputs[1], inputs[0]),
                )
                .at(1));
            }
            if !matches!(op, Op::Assign) {
                numeric(name, inputs[0], 0)?;
            }
            inputs[0].clone()
        }
        Op::Unary(unary) => {
            if unary.needs_float() {
                float(name, inputs[0], 0)?;
            } else {
                numeric(name, inputs[0], 0)?;
            }
            inputs[0].clone()
        }
        Op::Binary(_) => {
            same_dtype(name, inputs[0], inputs[1])?;
            numeric(name, inputs[0], 0)?;
            TensorType::new(inputs[0].dtype, broadcast(name, &inputs[0].shape, &inputs[1].shape).map_err(|e| e.at(1))?)
        }
        Op::Compare(compare) => {
            same_dtype(name, inputs[0], inputs[1])?;
            let ordered = !matches!(compare, crate::op::CompareOp::Equal | crate::op::CompareOp::NotEqual);
            if ordered {
                numeric(name, inputs[0], 0)?;
            }
            TensorType::new(DType::Bool, broadcast(name, &inputs[0].shape, &inputs[1].shape).map_err(|e| e.at(1))?)
        }
        Op::Select => {
            if inputs[0].dtype != DType::Bool {
                return Err(TypeError::new(
                    Code::DTYPE_MISMATCH,
                    format!("the condition of `select` must be bool, not {}", inputs[0].dtype),
                )
                .help("compare values to get a bool tensor, e.g. `x > 0`")
                .at(0));
            }
            same_dtype(name, inputs[1], inputs[2]).map_err(|e| TypeError { operand: Some(2), ..e })?;
            let shape = broadcast(name, &inputs[0].shape, &inputs[1].shape).map_err(|e| e.at(1))?;
            TensorType::new(inputs[1].dtype, broadcast(name, &shape, &inputs[2].shape).map_err(|e| e.at(2))?)
        }
        Op::Cast { to } => TensorType::new(*to, inputs[0].shape.clone()),
        Op::MatMul { transpose_a, transpose_b } => matmul(inputs[0], inputs[1], *transpose_a, *transpose_b)?,
        Op::Reshape { shape } => {
            if shape.n_elements() != inputs[0].shape.n_elements() {
                return Err(TypeError::new(
                    Code::INVALID_SHAPE,
                    format!(
                        "cannot reshape {} ({} elements) to {shape} ({} elements)",
                        inputs[0],
                        inputs[0].shape.n_elements(),
                        shape.n_elements()
                    ),
                )
                .help("the number of elements must stay the same; `-1` in a shape infers one size"));
            }
            TensorType::new(inputs[0].dtype, shape.clone())
        }
        Op::Transpose { perm } => {
            let rank = inputs[0].shape.rank();
            let mut seen = vec![false; rank];
            let valid = perm.len() == rank && perm.iter().all(|&a| a < rank && !std::mem::replace(&mut seen[a], true));
            if !valid {
                return Err(TypeError::new(
                    Code::AXIS_OUT_OF_RANGE,
                    format!("{perm:?} is not a permutation of the {rank} axes of {}", inputs[0]),
                )
                .help(format!("list every axis 0..{rank} exactly once")));
            }
            let dims = perm.iter().map(|&a| inputs[0].shape.0[a]).collect::<Vec<_>>();
            TensorType::new(inputs[0].dtype, dims)
        }
        Op::Concat { axis } => concat(inputs, *axis)?,
        Op::Slice { begin, size } => {
            let shape = &inputs[0].shape;
            if begin.len() != shape.rank() || size.len() != shape.rank() {
                return Err(TypeError::new(
                    Code::AXIS_OUT_OF_RANGE,
                    format!("`slice` of {} needs {} begin and size values", inputs[0], shape.rank()),
                ));
            }
            for (axis, ((&b, &s), &d)) in begin.iter().zip(size).zip(shape.dims()).enumerate() {
                if b.checked_add(s).is_none_or(|end| end > d) {
                    return Err(TypeError::new(
                        Code::INVALID_SHAPE,
                        format!("slice of {s} from {b} on axis {axis} is outside its size {d}"),
                    ));
                }
            }
            TensorType::new(inputs[0].dtype, size.clone())
        }
        Op::Reduce { kind, axes, keep_dims } => {
            if *kind != ReduceKind::Max && *kind != ReduceKind::Min {
                numeric(name, inputs[0], 0)?;
            }
            let rank = inputs[0].shape.rank();
            check_axes(name, axes, rank, inputs[0])?;
            let dims = inputs[0]
                .shape
                .dims()
                .iter()
                .enumerate()
                .filter_map(|(a, &d)| match (axes.contains(&a), keep_dims) {
                    (false, _) => Some(d),
                    (true, true) => Some(1),
                    (true, false) => None,
                })
                .collect::<Vec<_>>();
            TensorType::new(inputs[0].dtype, dims)
        }
        Op::Softmax { axis } | Op::LogSoftmax { axis } => {
            float(name, inputs[0], 0)?;
            check_axes(name, &[*axis], inputs[0].shape.rank(), inputs[0])?;
            inputs[0].clone()
        }
        Op::LayerNorm { epsilon } => {
            float(name, inputs[0], 0)?;
            normalised_rows(name, inputs[0], *epsilon)?;
            inputs[0].clone()
        }
        Op::LayerNormGrad { epsilon } => {
            float(name, inputs[0], 0)?;
            normalised_rows(name, inputs[0], *epsilon)?;
            same_dtype(name, inputs[0], inputs[1])?;
            if inputs[0].shape != inputs[1].shape {
                return Err(TypeError::new(
                    Code::SHAPE_MISMATCH,
                    format!("the gradient {} must have the input's shape {}", inputs[1], inputs[0]),
                )
                .at(1));
            }
            inputs[0].clone()
        }
        Op::Moments => {
            float(name, inputs[0], 0)?;
            channels(name, inputs[0])?;
            moments_type(inputs[0])
        }
        Op::BatchNorm { epsilon, .. } | Op::BatchNormGradMeans { epsilon } | Op::BatchNormGrad { epsilon } => {
            float(name, inputs[0], 0)?;
            channels(name, inputs[0])?;
            normalised_rows(name, inputs[0], *epsilon)?;
            let moments = moments_type(inputs[0]);
            for (i, what) in [(1, "moments"), (3, "means")] {
                if inputs.get(i).is_some_and(|t| **t != moments) {
                    return Err(TypeError::new(
                        Code::SHAPE_MISMATCH,
                        format!("the {what} {} must be {moments}: two values per channel", inputs[i]),
                    )
                    .at(i));
                }
            }
            if let Some(g) = inputs.get(2) {
                if **g != *inputs[0] {
                    return Err(TypeError::new(
                        Code::SHAPE_MISMATCH,
                        format!("the gradient {g} must have the input's type {}", inputs[0]),
                    )
                    .at(2));
                }
            }
            if matches!(op, Op::BatchNormGradMeans { .. }) {
                moments
            } else {
                inputs[0].clone()
            }
        }
        Op::SoftmaxCrossEntropy => {
            float(name, inputs[0], 0)?;
            same_dtype(name, inputs[0], inputs[1])?;
            if inputs[0].shape != inputs[1].shape {
                return Err(TypeError::new(
                    Code::SHAPE_MISMATCH,
                    format!("logits {} and labels {} must have the same shape", inputs[0], inputs[1]),
                )
                .help("labels are a distribution over the last axis; use one_hot(labels, classes) for class ids")
                .at(1));
            }
            let rank = inputs[0].shape.rank();
            if rank == 0 {
                return Err(TypeError::new(Code::AXIS_OUT_OF_RANGE, "logits must have a class axis").at(0));
            }
            TensorType::new(inputs[0].dtype, inputs[0].shape.0[..rank - 1].to_vec())
        }
        Op::SigmoidCrossEntropy => {
            float(name, inputs[0], 0)?;
            same_dtype(name, inputs[0], inputs[1])?;
            if inputs[0].shape != inputs[1].shape {
                return Err(TypeError::new(
                    Code::SHAPE_MISMATCH,
                    format!("logits {} and labels {} must have the same shape", inputs[0], inputs[1]),
                )
                .at(1));
            }
            inputs[0].clone()
        }
        Op::OneHot { depth, dtype } => {
            if !inputs[0].dtype.is_int() {
                return Err(TypeError::new(
                    Code::DTYPE_MISMATCH,
                    format!("`one_hot` takes integer class ids, not {}", inputs[0].dtype),
                )
                .help("cast the ids with cast<i32>(...)")
                .at(0));
            }
            let mut dims = inputs[0].shape.0.clone();
            dims.push(*depth);
            TensorType::new(*dtype, dims)
        }
        Op::Conv2d { strides, padding } => conv2d(inputs[0], inputs[1], *strides, *padding)?,
        Op::MaxPool { window, strides, padding } | Op::AvgPool { window, strides, padding } => {
            if matches!(op, Op::AvgPool { .. }) {
                float(name, inputs[0], 0)?;
            } else {
                numeric(name, inputs[0], 0)?;
            }
            let x = inputs[0];
            if x.shape.rank() != 4 {
                return Err(TypeError::new(
                    Code::AXIS_OUT_OF_RANGE,
                    format!("`{name}` takes NHWC input of rank 4, not {x}"),
                )
                .help("reshape the input to [batch, height, width, channels]")
                .at(0));
            }
            let d = x.shape.dims();
            let h = window_output(name, d[1], window[0], strides[0], *padding)?;
            let w = window_output(name, d[2], window[1], strides[1], *padding)?;
            TensorType::new(x.dtype, vec![d[0], h, w, d[3]])
        }
        Op::Gather => {
            let (params, indices) = (inputs[0], inputs[1]);
            if params.shape.rank() == 0 {
                return Err(TypeError::new(Code::AXIS_OUT_OF_RANGE, "`gather` needs a table of rank ≥ 1").at(0));
            }
            if !matches!(indices.dtype, DType::I32 | DType::I64) {
                return Err(TypeError::new(
                    Code::DTYPE_MISMATCH,
                    format!("`gather` indices must be i32 or i64, not {}", indices.dtype),
                )
                .at(1));
            }
            let mut dims = indices.shape.0.clone();
            dims.extend_from_slice(&params.shape.0[1..]);
            TensorType::new(params.dtype, dims)
        }
        Op::ArgMax { axis, dtype } => {
            numeric(name, inputs[0], 0)?;
            check_axes(name, &[*axis], inputs[0].shape.rank(), inputs[0])?;
            if !matches!(dtype, DType::I32 | DType::I64) {
                return Err(TypeError::new(Code::DTYPE_MISMATCH, format!("`argmax` gives i32 or i64, not {dtype}")));
            }
            let mut dims = inputs[0].shape.0.clone();
            dims.remove(*axis);
            TensorType::new(*dtype, dims)
        }
        Op::BroadcastTo { shape } => {
            let broadcast_shape = broadcast(name, &inputs[0].shape, shape)?;
            if broadcast_shape != *shape {
                return Err(TypeError::new(
                    Code::SHAPE_MISMATCH,
                    format!("{} does not broadcast to {shape}", inputs[0]),
                ));
            }
            TensorType::new(inputs[0].dtype, shape.clone())
        }
        Op::Pad { before, after } => {
            let rank = inputs[0].shape.rank();
            if before.len() != rank || after.len() != rank {
                return Err(TypeError::new(
                    Code::AXIS_OUT_OF_RANGE,
                    format!("`pad` of {} needs {rank} sizes before and after", inputs[0]),
                ));
            }
            let dims: Option<Vec<usize>> = inputs[0]
                .shape
                .dims()
                .iter()
                .zip(before.iter().zip(after))
                .map(|(d, (b, a))| d.checked_add(*b)?.checked_add(*a))
                .collect();
            let Some(dims) = dims else {
                return Err(TypeError::new(Code::INVALID_SHAPE, format!("`pad` of {} overflows", inputs[0])));
            };
            TensorType::new(inputs[0].dtype, dims)
        }
        Op::Conv2dBackpropInput { input_shape, strides, padding } => {
            let x = TensorType::new(inputs[0].dtype, input_shape.clone());
            let out = conv2d(&x, inputs[0], *strides, *padding)?;
            same_shape(name, &out, inputs[1])?;
            x
        }
        Op::Conv2dBackpropFilter { filter_shape, strides, padding } => {
            let filter = TensorType::new(inputs[0].dtype, filter_shape.clone());
            let out = conv2d(inputs[0], &filter, *strides, *padding)?;
            same_shape(name, &out, inputs[1])?;
            filter
        }
        Op::MaxPoolGrad { window, strides, padding } => {
            let out = infer(&Op::MaxPool { window: *window, strides: *strides, padding: *padding }, &[inputs[0]])?;
            same_shape(name, &out[0], inputs[1])?;
            inputs[0].clone()
        }
        Op::AvgPoolGrad { input_shape, window, strides, padding } => {
            let x = TensorType::new(inputs[0].dtype, input_shape.clone());
            let out = infer(&Op::AvgPool { window: *window, strides: *strides, padding: *padding }, &[&x])?;
            same_shape(name, &out[0], inputs[0]).map_err(|e| TypeError { operand: Some(0), ..e })?;
            x
        }
        Op::RandomUniform { shape, .. } | Op::RandomNormal { shape, .. } => {
            for (i, input) in inputs.iter().enumerate() {
                if *input != &TensorType::scalar(DType::I64) {
                    return Err(TypeError::new(
                        Code::DTYPE_MISMATCH,
                        format!("`{name}` takes the seed and the step, i64 scalars, not {input}"),
                    )
                    .at(i));
                }
            }
            TensorType::new(DType::F32, shape.clone())
        }
        Op::TrainingFlag => TensorType::scalar(DType::Bool),
        Op::LearningRate { schedule, dtype } => {
            if inputs[0] != &TensorType::scalar(DType::I64) {
                return Err(TypeError::new(
                    Code::DTYPE_MISMATCH,
                    format!("`learning_rate` takes the global step, an i64 scalar, not {}", inputs[0]),
                )
                .at(0));
            }
            if !dtype.is_float() {
                return Err(TypeError::new(Code::DTYPE_MISMATCH, format!("a learning rate is a float, not {dtype}")));
            }
            schedule.check().map_err(|why| {
                TypeError::new(
                    Code::BAD_OPTIMIZER,
                    format!("the learning-rate schedule `{schedule}` is not one: {why}"),
                )
            })?;
            TensorType::scalar(*dtype)
        }
        Op::ScatterAdd { rows } => {
            let (indices, updates) = (inputs[0], inputs[1]);
            if !matches!(indices.dtype, DType::I32 | DType::I64) {
                return Err(TypeError::new(
                    Code::DTYPE_MISMATCH,
                    format!("`scatter_add` indices must be i32 or i64, not {}", indices.dtype),
                )
                .at(0));
            }
            let k = indices.shape.rank();
            if updates.shape.rank() < k || updates.shape.0[..k] != indices.shape.0[..] {
                return Err(TypeError::new(
                    Code::SHAPE_MISMATCH,
                    format!("`scatter_add` updates {updates} do not start with the indices' shape {}", indices.shape),
                )
                .at(1));
            }
            let mut dims = vec![*rows];
            dims.extend_from_slice(&updates.shape.0[k..]);
            TensorType::new(updates.dtype, dims)
        }
    };
    Ok(vec![ty])
}

fn same_shape(name: &str, expected: &TensorType, actual: &TensorType) -> Result<()> {
    if expected != actual {
        return Err(TypeError::new(
            Code::SHAPE_MISMATCH,
            format!("`{name}` gets an output gradient {actual}, but the forward op gives {expected}"),
        )
        .at(1));
    }
    Ok(())
}

/// NumPy broadcasting: align from the right; sizes must be equal or 1.
pub fn broadcast_shapes(a: &Shape, b: &Shape) -> Option<Shape> {
    let rank = a.rank().max(b.rank());
    let size = |s: &Shape, i: usize| if i < rank - s.rank() { 1 } else { s.0[i - (rank - s.rank())] };
    (0..rank)
        .map(|i| match (size(a, i), size(b, i)) {
            (x, y) if x == y => Some(x),
            (1, y) => Some(y),
            (x, 1) => Some(x),
            _ => None,
        })
        .collect::<Option<Vec<usize>>>()
        .map(Shape)
}

fn broadcast(name: &str, a: &Shape, b: &Shape) -> Result<Shape> {
    broadcast_shapes(a, b).ok_or_else(|| {
        TypeError::new(Code::SHAPE_MISMATCH, format!("shapes {a} and {b} do not broadcast in `{name}`"))
            .help("sizes are matched from the last axis; each pair must be equal or one of them 1")
    })
}

fn same_dtype(name: &str, a: &TensorType, b: &TensorType) -> Result<()> {
    if a.dtype != b.dtype {
        return Err(TypeError::new(
            Code::DTYPE_MISMATCH,
            format!("`{name}` of {} and {}: the element types differ", a, b),
        )
        .help(format!("dfc converts no types implicitly; use cast<{}>(...) on one side", a.dtype))
        .at(1));
    }
    Ok(())
}

fn numeric(name: &str, ty: &TensorType, operand: usize) -> Result<()> {
    if !ty.dtype.is_numeric() {
        return Err(TypeError::new(Code::DTYPE_MISMATCH, format!("`{name}` is not defined on bool values"))
            .help("cast to a number with cast<f32>(...)")
            .at(operand));
    }
    Ok(())
}

fn float(name: &str, ty: &TensorType, operand: usize) -> Result<()> {
    if !ty.dtype.is_float() {
        return Err(TypeError::new(
            Code::DTYPE_MISMATCH,
            format!("`{name}` takes f32 or f64 values, not {}", ty.dtype),
        )
        .help("cast with cast<f32>(...)")
        .at(operand));
    }
    Ok(())
}

/// A normalisation's operand has rows (a last axis) and its `epsilon` keeps the divisor away
/// from zero.
/// A batch normalisation's input: a batch axis (or several) and the channels, last.
fn channels(name: &str, ty: &TensorType) -> Result<()> {
    if ty.shape.rank() < 2 {
        return Err(TypeError::new(
            Code::AXIS_OUT_OF_RANGE,
            format!("`{name}` of {ty}: it needs a batch axis and a channel axis"),
        )
        .help("the last axis holds the channels; the statistics are over all the others")
        .at(0));
    }
    Ok(())
}

/// `[2, C]` of `x`'s element type: each channel's mean, then its variance.
fn moments_type(x: &TensorType) -> TensorType {
    TensorType::new(x.dtype, vec![2, x.shape.dims()[x.shape.rank() - 1]])
}

fn normalised_rows(name: &str, ty: &TensorType, epsilon: f64) -> Result<()> {
    if ty.shape.rank() == 0 {
        return Err(TypeError::new(
            Code::AXIS_OUT_OF_RANGE,
            format!("`{name}` of {ty}: a scalar has no axis to normalise"),
        )
        .help("normalisation runs along the last axis")
        .at(0));
    }
    if !(epsilon.is_finite() && epsilon > 0.0) {
        return Err(TypeError::new(Code::ARGUMENT_KIND, format!("`{name}` needs an epsilon above 0, not {epsilon}"))
            .help("1e-5 is the usual one"));
    }
    Ok(())
}

fn check_axes(name: &str, axes: &[usize], rank: usize, ty: &TensorType) -> Result<()> {
    for (i, &axis) in axes.iter().enumerate() {
        if axis >= rank {
            return Err(TypeError::new(
                Code::AXIS_OUT_OF_RANGE,
                format!("axis {axis} is out of range for `{name}` of {ty} (rank {rank})"),
            )
            .help(format!("axes run from 0 to {} (or -1 for the last)", rank.saturating_sub(1))));
        }
        if axes[..i].contains(&axis) {
            return Err(TypeError::new(Code::AXIS_OUT_OF_RANGE, format!("axis {axis} is given twice")));
        }
    }
    Ok(())
}

fn matmul(a: &TensorType, b: &TensorType, transpose_a: bool, transpose_b: bool) -> Result<TensorType> {
    same_dtype("matmul", a, b)?;
    numeric("matmul", a, 0)?;
    for (i, t) in [a, b].into_iter().enumerate() {
        if t.shape.rank() < 2 {
            return Err(TypeError::new(
                Code::AXIS_OUT_OF_RANGE,
                format!("`@` needs operands of rank ≥ 2; operand {} is {t}", i + 1),
            )
            .help("reshape a vector to a matrix, e.g. reshape(v, [1, -1])")
            .at(i));
        }
    }
    let (ra, rb) = (a.shape.rank(), b.shape.rank());
    let (m, ka) =
        if transpose_a { (a.shape.0[ra - 1], a.shape.0[ra - 2]) } else { (a.shape.0[ra - 2], a.shape.0[ra - 1]) };
    let (kb, n) =
        if transpose_b { (b.shape.0[rb - 1], b.shape.0[rb - 2]) } else { (b.shape.0[rb - 2], b.shape.0[rb - 1]) };
    if ka != kb {
        return Err(TypeError::new(
            Code::MATMUL_MISMATCH,
            format!("matrix product of {a} and {b}: inner dimensions {ka} and {kb} differ"),
        )
        .help(format!("the last axis of the left operand ({ka}) must equal the second-to-last of the right ({kb})"))
        .at(1));
    }
    let batch_a = Shape(a.shape.0[..ra - 2].to_vec());
    let batch_b = Shape(b.shape.0[..rb - 2].to_vec());
    let mut dims = broadcast("matmul", &batch_a, &batch_b).map_err(|e| e.at(1))?.0;
    dims.extend([m, n]);
    Ok(TensorType::new(a.dtype, dims))
}

fn concat(inputs: &[&TensorType], axis: usize) -> Result<TensorType> {
    let Some(first) = inputs.first() else {
        return Err(TypeError::new(Code::ARITY, "`concat` needs at least one operand"));
    };
    check_axes("concat", &[axis], first.shape.rank(), first)?;
    let mut dims = first.shape.0.clone();
    for (i, t) in inputs.iter().enumerate().skip(1) {
        same_dtype("concat", first, t).map_err(|e| e.at(i))?;
        let compatible = t.shape.rank() == first.shape.rank()
            && t.shape.dims().iter().zip(first.shape.dims()).enumerate().all(|(a, (x, y))| a == axis || x == y);
        if !compatible {
            return Err(TypeError::new(
                Code::SHAPE_MISMATCH,
                format!("cannot concatenate {first} and {t} along axis {axis}"),
            )
            .help("all sizes but the concatenated axis must agree")
            .at(i));
        }
        dims[axis] += t.shape.0[axis];
    }
    Ok(TensorType::new(first.dtype, dims))
}

fn window_output(name: &str, size: usize, window: usize, stride: usize, padding: Padding) -> Result<usize> {
    if stride == 0 || window == 0 {
        return Err(TypeError::new(Code::INVALID_SHAPE, format!("`{name}` window and strides must be positive")));
    }
    match padding {
        Padding::Same => Ok(size.div_ceil(stride)),
        Padding::Valid if window > size => Err(TypeError::new(
            Code::INVALID_SHAPE,
            format!("`{name}` window {window} is larger than the input size {size}"),
        )
        .help("use padding = \"same\", or a smaller window")),
        Padding::Valid => Ok((size - window) / stride + 1),
    }
}

fn conv2d(x: &TensorType, filter: &TensorType, strides: [usize; 2], padding: Padding) -> Result<TensorType> {
    float("conv2d", x, 0)?;
    same_dtype("conv2d", x, filter)?;
    if x.shape.rank() != 4 {
        return Err(TypeError::new(Code::AXIS_OUT_OF_RANGE, format!("`conv2d` takes NHWC input of rank 4, not {x}"))
            .help("reshape the input to [batch, height, width, channels]")
            .at(0));
    }
    if filter.shape.rank() != 4 {
        return Err(TypeError::new(
            Code::AXIS_OUT_OF_RANGE,
            format!("`conv2d` takes a filter [height, width, in, out] of rank 4, not {filter}"),
        )
        .at(1));
    }
    let (xd, fd) = (x.shape.dims(), filter.shape.dims());
    if xd[3] != fd[2] {
        return Err(TypeError::new(
            Code::SHAPE_MISMATCH,
            format!("`conv2d` input has {} channels but the filter {filter} expects {}", xd[3], fd[2]),
        )
        .help("the filter's third axis must equal the input's channel count")
        .at(1));
    }
    let h = window_output("conv2d", xd[1], fd[0], strides[0], padding)?;
    let w = window_output("conv2d", xd[2], fd[1], strides[1], padding)?;
    Ok(TensorType::new(x.dtype, vec![xd[0], h, w, fd[3]]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::BinaryOp;

    fn t(dtype: DType, dims: &[usize]) -> TensorType {
        TensorType::new(dtype, dims.to_vec())
    }

    #[test]
    fn broadcasting_follows_numpy() {
        let s = |d: &[usize]| Shape(d.to_vec());
        assert_eq!(broadcast_shapes(&s(&[128, 256]), &s(&[256])), Some(s(&[128, 256])));
        assert_eq!(broadcast_shapes(&s(&[3, 1]), &s(&[1, 4])), Some(s(&[3, 4])));
        assert_eq!(broadcast_shapes(&s(&[]), &s(&[2, 2])), Some(s(&[2, 2])));
        assert_eq!(broadcast_shapes(&s(&[3]), &s(&[4])), None);
    }

    #[test]
    fn matmul_checks_inner_dimensions() {
        let op = Op::MatMul { transpose_a: false, transpose_b: false };
        let ok = infer(&op, &[&t(DType::F32, &[128, 784]), &t(DType::F32, &[784, 256])]).unwrap();
        assert_eq!(ok[0], t(DType::F32, &[128, 256]));
        let err = infer(&op, &[&t(DType::F32, &[128, 784]), &t(DType::F32, &[785, 256])]).unwrap_err();
        assert_eq!(err.code, Code::MATMUL_MISMATCH);
        let batched = infer(&op, &[&t(DType::F32, &[4, 2, 3]), &t(DType::F32, &[3, 5])]).unwrap();
        assert_eq!(batched[0], t(DType::F32, &[4, 2, 5]));
    }

    #[test]
    fn convolution_and_pooling_shapes_match_keras() {
        let conv = Op::Conv2d { strides: [1, 1], padding: Padding::Valid };
        let y = infer(&conv, &[&t(DType::F32, &[64, 28, 28, 1]), &t(DType::F32, &[3, 3, 1, 32])]).unwrap();
        assert_eq!(y[0], t(DType::F32, &[64, 26, 26, 32]));
        let pool = Op::MaxPool { window: [2, 2], strides: [2, 2], padding: Padding::Valid };
        assert_eq!(infer(&pool, &[&y[0]]).unwrap()[0], t(DType::F32, &[64, 13, 13, 32]));
        let same = Op::Conv2d { strides: [2, 2], padding: Padding::Same };
        let z = infer(&same, &[&t(DType::F32, &[1, 7, 7, 3]), &t(DType::F32, &[3, 3, 3, 8])]).unwrap();
        assert_eq!(z[0], t(DType::F32, &[1, 4, 4, 8]));
    }

    #[test]
    fn batch_norm_ops_take_channels_last_and_their_moments() {
        let x = t(DType::F32, &[8, 5, 5, 3]);
        let moments = infer(&Op::Moments, &[&x]).unwrap();
        assert_eq!(moments[0], t(DType::F32, &[2, 3]));
        let norm = Op::BatchNorm { epsilon: 1e-3, synchronized: false };
        assert_eq!(infer(&norm, &[&x, &moments[0]]).unwrap()[0], x);
        let means = Op::BatchNormGradMeans { epsilon: 1e-3 };
        assert_eq!(infer(&means, &[&x, &moments[0], &x]).unwrap()[0], moments[0]);
        let grad = Op::BatchNormGrad { epsilon: 1e-3 };
        assert_eq!(infer(&grad, &[&x, &moments[0], &x, &moments[0]]).unwrap()[0], x);
        // Moments of other channels, a gradient of another shape, no batch axis, an integer
        // input, an epsilon of 0: each refused.
        let wrong = infer(&norm, &[&x, &t(DType::F32, &[2, 4])]).unwrap_err();
        assert_eq!((wrong.code, wrong.operand), (Code::SHAPE_MISMATCH, Some(1)));
        let wrong = infer(&means, &[&x, &moments[0], &t(DType::F32, &[8, 5, 5, 4])]).unwrap_err();
        assert_eq!((wrong.code, wrong.operand), (Code::SHAPE_MISMATCH, Some(2)));
        let wrong = infer(&grad, &[&x, &moments[0], &x, &t(DType::F32, &[3, 3])]).unwrap_err();
        assert_eq!((wrong.code, wrong.operand), (Code::SHAPE_MISMATCH, Some(3)));
        assert_eq!(infer(&Op::Moments, &[&t(DType::F32, &[3])]).unwrap_err().code, Code::AXIS_OUT_OF_RANGE);
        assert_eq!(infer(&Op::Moments, &[&t(DType::I32, &[4, 3])]).unwrap_err().code, Code::DTYPE_MISMATCH);
        let zero = Op::BatchNorm { epsilon: 0.0, synchronized: false };
        assert_eq!(infer(&zero, &[&x, &moments[0]]).unwrap_err().code, Code::ARGUMENT_KIND);
    }

    #[test]
    fn mixed_element_types_are_refused() {
        let err = infer(&Op::Binary(BinaryOp::Add), &[&t(DType::F32, &[2]), &t(DType::F64, &[2])]).unwrap_err();
        assert_eq!(err.code, Code::DTYPE_MISMATCH);
    }
}
