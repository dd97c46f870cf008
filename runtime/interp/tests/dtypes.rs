//! Every op on every element type: where `infer` accepts the operands the interpreter computes
//! a value of exactly the inferred type; where it refuses them the interpreter refuses too
//! (and never panics).

use dfc_interp::{eval, InterpError, Tensor};
use dfc_ir::{BinaryOp, CompareOp, DType, Op, Padding, ReduceKind, Shape, TensorType, UnaryOp};

/// Role of an operand: the main element type, the index type, or bool.
#[derive(Clone, Copy)]
enum Kind {
    Main,
    Index,
    Bool,
}

use Kind::*;

/// Small positive values 1, 2, 3, 1, ... (true for bool): no division by zero, no negative
/// exponent, every index in range.
fn operand(dtype: DType, dims: &[usize]) -> Tensor {
    let n = dims.iter().product::<usize>();
    let values: Vec<f64> = (0..n).map(|i| (i % 3 + 1) as f64).collect();
    Tensor::from_f64(dtype, dims.to_vec(), &values)
}

/// An op and its operands' roles and shapes.
type Case = (Op, Vec<(Kind, Vec<usize>)>);

fn cases() -> Vec<Case> {
    let m = |dims: &[usize]| (Main, dims.to_vec());
    let mut cases: Vec<Case> = Vec::new();
    for u in UnaryOp::ALL {
        cases.push((Op::Unary(u), vec![m(&[2, 3])]));
    }
    for b in BinaryOp::ALL {
        cases.push((Op::Binary(b), vec![m(&[2, 3]), m(&[3])]));
    }
    for c in CompareOp::ALL {
        cases.push((Op::Compare(c), vec![m(&[2, 3]), m(&[2, 1])]));
    }
    for to in DType::ALL {
        cases.push((Op::Cast { to }, vec![m(&[2, 2])]));
        cases.push((Op::OneHot { depth: 4, dtype: to }, vec![(Index, vec![3])]));
    }
    for kind in [ReduceKind::Sum, ReduceKind::Mean, ReduceKind::Max, ReduceKind::Min] {
        cases.push((Op::Reduce { kind, axes: vec![1], keep_dims: false }, vec![m(&[2, 3])]));
    }
    for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
        cases.push((Op::MatMul { transpose_a: ta, transpose_b: tb }, vec![m(&[2, 3, 3]), m(&[3, 3])]));
    }
    let w = [2, 2];
    let s = [1, 2];
    for padding in [Padding::Valid, Padding::Same] {
        cases.extend([
            (Op::Conv2d { strides: s, padding }, vec![m(&[1, 4, 5, 2]), m(&[2, 2, 2, 3])]),
            (Op::MaxPool { window: w, strides: s, padding }, vec![m(&[1, 4, 5, 2])]),
            (Op::AvgPool { window: w, strides: s, padding }, vec![m(&[1, 4, 5, 2])]),
        ]);
        let out = if padding == Padding::Valid { [1, 3, 2] } else { [1, 4, 3] };
        cases.extend([
            (
                Op::Conv2dBackpropInput { input_shape: Shape(vec![1, 4, 5, 2]), strides: s, padding },
                vec![m(&[2, 2, 2, 3]), m(&[out[0], out[1], out[2], 3])],
            ),
            (
                Op::Conv2dBackpropFilter { filter_shape: Shape(vec![2, 2, 2, 3]), strides: s, padding },
                vec![m(&[1, 4, 5, 2]), m(&[out[0], out[1], out[2], 3])],
            ),
            (
                Op::MaxPoolGrad { window: w, strides: s, padding },
                vec![m(&[1, 4, 5, 2]), m(&[out[0], out[1], out[2], 2])],
            ),
            (
                Op::AvgPoolGrad { input_shape: Shape(vec![1, 4, 5, 2]), window: w, strides: s, padding },
                vec![m(&[out[0], out[1], out[2], 2])],
            ),
        ]);
    }
    cases.extend([
        (Op::Identity, vec![m(&[2])]),
        (Op::StopGradient, vec![m(&[2])]),
        (Op::Select, vec![(Bool, vec![2, 1]), m(&[3]), m(&[2, 3])]),
        (Op::Reshape { shape: Shape(vec![3, 2]) }, vec![m(&[2, 3])]),
        (Op::Transpose { perm: vec![1, 0] }, vec![m(&[2, 3])]),
        (Op::Concat { axis: 1 }, vec![m(&[2, 3]), m(&[2, 1])]),
        (Op::Slice { begin: vec![1, 0], size: vec![1, 2] }, vec![m(&[2, 3])]),
        (Op::Softmax { axis: 1 }, vec![m(&[2, 3])]),
        (Op::LogSoftmax { axis: 0 }, vec![m(&[2, 3])]),
        (Op::SoftmaxCrossEntropy, vec![m(&[2, 3]), m(&[2, 3])]),
        (Op::SigmoidCrossEntropy, vec![m(&[2, 3]), m(&[2, 3])]),
        (Op::Gather, vec![m(&[4, 2]), (Index, vec![2, 2])]),
        (Op::ArgMax { axis: 1, dtype: DType::I32 }, vec![m(&[2, 3])]),
        (Op::ArgMax { axis: 0, dtype: DType::I64 }, vec![m(&[2, 3])]),
        (Op::BroadcastTo { shape: Shape(vec![2, 2, 3]) }, vec![m(&[2, 1, 3])]),
        (Op::Pad { before: vec![1, 0], after: vec![0, 2] }, vec![m(&[2, 3])]),
        (Op::ScatterAdd { rows: 4 }, vec![(Index, vec![3]), m(&[3, 2])]),
        (Op::Const { value: dfc_ir::ConstValue::scalar(DType::U8, 3.0) }, vec![]),
    ]);
    cases
}

#[test]
fn every_op_on_every_element_type() {
    let mut accepted = 0;
    for (op, operands) in cases() {
        for main in DType::ALL {
            for index in DType::ALL {
                let tensors: Vec<Tensor> = operands
                    .iter()
                    .map(|(kind, dims)| match kind {
                        Main => operand(main, dims),
                        Index => operand(index, dims),
                        Bool => operand(DType::Bool, dims),
                    })
                    .collect();
                let types: Vec<TensorType> = tensors.iter().map(|t| t.ty()).collect();
                let refs: Vec<&TensorType> = types.iter().collect();
                let args: Vec<&Tensor> = tensors.iter().collect();
                match (dfc_ir::infer(&op, &refs), eval(&op, &args)) {
                    (Ok(types), Ok(result)) => {
                        assert_eq!(result.ty(), types[0], "{} on {main}/{index}", op.name());
                        accepted += 1;
                    }
                    (Err(_), Err(InterpError::Malformed { .. })) => {}
                    (inferred, result) => {
                        panic!("{} on {main}/{index}: infer gives {inferred:?} but eval {result:?}", op.name())
                    }
                }
            }
        }
    }
    assert!(accepted > 500, "{accepted}");
}
