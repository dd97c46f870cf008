//! The kernels of the stateless ops, and `compute`, which picks one by op and element type.
//!
//! Kernels assume well-typed operands: `compute` is only called on operands whose types
//! `dfc_ir::infer` accepts (`Program::new` and `eval` check that first), so a dtype that
//! `infer` rejects is unreachable here. Each kernel computes its own output shape; the caller
//! checks it against the type `infer` gives, which cross-checks both.

pub(crate) mod conv;
mod elementwise;
mod matmul;
pub mod random;
mod reduce;
mod shape;

use crate::scalar::Fault;
use crate::tensor::{Data, Element, Tensor};
use dfc_ir::{DType, Op};

/// `$body` with `$v` bound to the elements of `$data`, whatever their type.
macro_rules! any_type {
    ($data:expr, $v:ident => $body:expr) => {
        match $data {
            Data::F32($v) => $body,
            Data::F64($v) => $body,
            Data::I32($v) => $body,
            Data::I64($v) => $body,
            Data::U8($v) => $body,
            Data::Bool($v) => $body,
        }
    };
}

/// `$body` with `$v` bound to the elements of `$data`, which are numbers.
macro_rules! numeric {
    ($data:expr, $v:ident => $body:expr) => {
        match $data {
            Data::F32($v) => $body,
            Data::F64($v) => $body,
            Data::I32($v) => $body,
            Data::I64($v) => $body,
            Data::U8($v) => $body,
            Data::Bool(_) => unreachable!("`infer` admits no bool operand here"),
        }
    };
}

/// `$body` with `$v` bound to the elements of `$data`, which are floats.
macro_rules! float {
    ($data:expr, $v:ident => $body:expr) => {
        match $data {
            Data::F32($v) => $body,
            Data::F64($v) => $body,
            _ => unreachable!("`infer` admits only float operands here"),
        }
    };
}

/// The elements of `t`, which `infer` has checked to be of the same type as `like`'s.
fn same<'a, T: Element>(_like: &[T], t: &'a Tensor) -> &'a [T] {
    t.as_slice::<T>().expect("`infer` checked that the element types agree")
}

/// Integer indices (i32, i64 or u8) as i64.
fn indices(t: &Tensor) -> Vec<i64> {
    match &t.data {
        Data::I32(v) => v.iter().map(|&i| i64::from(i)).collect(),
        Data::I64(v) => v.clone(),
        Data::U8(v) => v.iter().map(|&i| i64::from(i)).collect(),
        _ => unreachable!("`infer` requires integer indices"),
    }
}

fn tensor<T: Element>((dims, values): (Vec<usize>, Vec<T>)) -> Tensor {
    Tensor::from_vec(dims, values)
}

/// Computes a stateless op on well-typed operands.
pub(crate) fn compute(op: &Op, operands: &[&Tensor]) -> Result<Tensor, Fault> {
    let x = || operands[0];
    let dims = |i: usize| operands[i].shape.dims();
    Ok(match op {
        Op::Input { .. }
        | Op::Variable { .. }
        | Op::Read
        | Op::Assign
        | Op::AssignAdd
        | Op::AssignSub
        | Op::Send { .. }
        | Op::Recv { .. }
        | Op::AllReduce { .. } => {
            unreachable!("`{}` is run by the program, not a kernel", op.name())
        }
        Op::Const { value } => Tensor::from_const(value),
        // Without replicas (the only place the interpreter meets it) the mean is the operand.
        Op::Identity | Op::StopGradient | Op::CrossReplicaMean => x().clone(),
        Op::Unary(u) if u.needs_float() => {
            float!(&x().data, v => Tensor::from_vec(x().shape.clone(), elementwise::unary_float(*u, v)))
        }
        Op::Unary(u) => numeric!(&x().data, v => Tensor::from_vec(x().shape.clone(), elementwise::unary_num(*u, v))),
        Op::Binary(b) => {
            numeric!(&x().data, v => tensor(elementwise::binary(*b, v, dims(0), same(v, operands[1]), dims(1))?))
        }
        Op::Compare(c) => {
            any_type!(&x().data, v => tensor(elementwise::compare(*c, v, dims(0), same(v, operands[1]), dims(1))))
        }
        Op::Select => {
            let cond = operands[0].as_slice::<bool>().expect("`infer` requires a bool condition");
            any_type!(&operands[1].data, v => tensor(elementwise::select(cond, dims(0), v, dims(1), same(v, operands[2]), dims(2))))
        }
        Op::Cast { to } => Tensor::new(x().shape.clone(), any_type!(&x().data, v => elementwise::cast(v, *to))),
        Op::MatMul { transpose_a, transpose_b } => numeric!(&x().data, v => tensor(matmul::matmul(
            v, dims(0), same(v, operands[1]), dims(1), *transpose_a, *transpose_b
        ))),
        Op::Reshape { shape } => Tensor::new(shape.clone(), x().data.clone()),
        Op::Transpose { perm } => any_type!(&x().data, v => tensor(shape::transpose(v, dims(0), perm))),
        Op::Concat { axis } => any_type!(&x().data, v => {
            let parts: Vec<_> = operands.iter().map(|t| (same(v, t), t.shape.dims())).collect();
            tensor(shape::concat(&parts, *axis))
        }),
        Op::Slice { begin, size } => {
            any_type!(&x().data, v => Tensor::from_vec(size.clone(), shape::slice(v, dims(0), begin, size)))
        }
        Op::Pad { before, after } => any_type!(&x().data, v => tensor(shape::pad(v, dims(0), before, after))),
        Op::BroadcastTo { shape } => {
            any_type!(&x().data, v => Tensor::from_vec(shape.clone(), shape::broadcast_to(v, dims(0), shape.dims())))
        }
        Op::Reduce { kind, axes, keep_dims } => match &x().data {
            Data::Bool(v) => tensor(reduce::reduce_order(*kind, v, dims(0), axes, *keep_dims)),
            data => numeric!(data, v => tensor(reduce::reduce_num(*kind, v, dims(0), axes, *keep_dims)?)),
        },
        Op::ArgMax { axis, dtype } => {
            let (out_dims, idx) = numeric!(&x().data, v => reduce::argmax(v, dims(0), *axis)?);
            match dtype {
                DType::I32 => Tensor::from_vec(out_dims, idx.into_iter().map(|i| i as i32).collect()),
                DType::I64 => Tensor::from_vec(out_dims, idx),
                _ => unreachable!("`infer` requires an i32 or i64 argmax"),
            }
        }
        Op::Softmax { axis } => {
            float!(&x().data, v => Tensor::from_vec(x().shape.clone(), reduce::softmax(v, dims(0), *axis)))
        }
        Op::LogSoftmax { axis } => {
            float!(&x().data, v => Tensor::from_vec(x().shape.clone(), reduce::log_softmax(v, dims(0), *axis)))
        }
        Op::LayerNorm { epsilon } => {
            float!(&x().data, v => Tensor::from_vec(x().shape.clone(), reduce::layer_norm(v, dims(0), *epsilon)))
        }
        Op::LayerNormGrad { epsilon } => float!(&x().data, v => Tensor::from_vec(
            x().shape.clone(),
            reduce::layer_norm_grad(v, same(v, operands[1]), dims(0), *epsilon)
        )),
        Op::Moments => {
            let channels = dims(0).last().copied().unwrap_or(1);
            float!(&x().data, v => Tensor::from_vec(vec![2, channels], reduce::moments(v, dims(0))))
        }
        Op::BatchNorm { epsilon, .. } => float!(&x().data, v => Tensor::from_vec(
            x().shape.clone(),
            reduce::batch_norm(v, same(v, operands[1]), *epsilon)
        )),
        Op::BatchNormGradMeans { epsilon } => float!(&x().data, v => Tensor::from_vec(
            operands[1].shape.clone(),
            reduce::batch_norm_grad_means(v, same(v, operands[1]), same(v, operands[2]), *epsilon)
        )),
        Op::BatchNormGrad { epsilon } => float!(&x().data, v => Tensor::from_vec(
            x().shape.clone(),
            reduce::batch_norm_grad(v, same(v, operands[1]), same(v, operands[2]), same(v, operands[3]), *epsilon)
        )),
        Op::SoftmaxCrossEntropy => {
            float!(&x().data, v => tensor(reduce::softmax_cross_entropy(v, same(v, operands[1]), dims(0))))
        }
        Op::SigmoidCrossEntropy => float!(&x().data, v => Tensor::from_vec(
            x().shape.clone(),
            reduce::sigmoid_cross_entropy(v, same(v, operands[1]))
        )),
        Op::OneHot { depth, dtype } => {
            let ids = indices(x());
            match dtype {
                DType::F32 => tensor(shape::one_hot::<f32>(&ids, dims(0), *depth)),
                DType::F64 => tensor(shape::one_hot::<f64>(&ids, dims(0), *depth)),
                DType::I32 => tensor(shape::one_hot::<i32>(&ids, dims(0), *depth)),
                DType::I64 => tensor(shape::one_hot::<i64>(&ids, dims(0), *depth)),
                DType::U8 => tensor(shape::one_hot::<u8>(&ids, dims(0), *depth)),
                DType::Bool => tensor(shape::one_hot::<bool>(&ids, dims(0), *depth)),
            }
        }
        Op::RandomUniform { shape, salt } => {
            let (seed, step) = (indices(operands[0])[0], indices(operands[1])[0]);
            let (key, upper) = random::stream(seed, *salt, step);
            let values: Vec<f32> = (0..shape.n_elements() as u64).map(|e| random::uniform_at(key, upper, e)).collect();
            Tensor::from_vec(shape.clone(), values)
        }
        Op::RandomNormal { shape, salt } => {
            let (seed, step) = (indices(operands[0])[0], indices(operands[1])[0]);
            let (key, upper) = random::stream(seed, *salt, step);
            let values: Vec<f32> = (0..shape.n_elements() as u64).map(|e| random::normal_at(key, upper, e)).collect();
            Tensor::from_vec(shape.clone(), values)
        }
        Op::TrainingFlag => unreachable!("a program fixes `training_flag` when it is made"),
        Op::LearningRate { schedule, dtype } => {
            // A step below zero (a damaged checkpoint's) counts as the first.
            let step = u64::try_from(indices(x())[0]).unwrap_or(0);
            let lr = schedule.at(step);
            match dtype {
                DType::F64 => Tensor::scalar(lr),
                _ => Tensor::scalar(lr as f32),
            }
        }
        Op::Gather => any_type!(&x().data, v => tensor(shape::gather(v, dims(0), &indices(operands[1]), dims(1))?)),
        Op::ScatterAdd { rows } => any_type!(&operands[1].data, v => tensor(shape::scatter_add(
            &indices(operands[0]), dims(0), v, dims(1), *rows
        )?)),
        Op::Conv2d { strides, padding } => {
            float!(&x().data, v => tensor(conv::conv2d(v, dims(0), same(v, operands[1]), dims(1), *strides, *padding)))
        }
        Op::Conv2dBackpropInput { input_shape, strides, padding } => float!(&x().data, v => Tensor::from_vec(
            input_shape.clone(),
            conv::conv2d_backprop_input(input_shape.dims(), v, dims(0), same(v, operands[1]), *strides, *padding)
        )),
        Op::Conv2dBackpropFilter { filter_shape, strides, padding } => float!(&x().data, v => Tensor::from_vec(
            filter_shape.clone(),
            conv::conv2d_backprop_filter(v, dims(0), filter_shape.dims(), same(v, operands[1]), *strides, *padding)
        )),
        Op::MaxPool { window, strides, padding } => {
            numeric!(&x().data, v => tensor(conv::max_pool(v, dims(0), *window, *strides, *padding)))
        }
        Op::MaxPoolGrad { window, strides, padding } => numeric!(&x().data, v => Tensor::from_vec(
            x().shape.clone(),
            conv::max_pool_grad(v, dims(0), same(v, operands[1]), *window, *strides, *padding)
        )),
        Op::AvgPool { window, strides, padding } => {
            float!(&x().data, v => tensor(conv::avg_pool(v, dims(0), *window, *strides, *padding)))
        }
        Op::AvgPoolGrad { input_shape, window, strides, padding } => float!(&x().data, v => Tensor::from_vec(
            input_shape.clone(),
            conv::avg_pool_grad(input_shape.dims(), v, *window, *strides, *padding)
        )),
    })
}
