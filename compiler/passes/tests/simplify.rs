//! `simplify` on hand-built graphs, for what the language cannot write: control inputs, reads
//! and assignments outside an optimizer, constants that differ only in their bits, spans.

use dfc_diag::Span;
use dfc_ir::{
    BinaryOp, ConstValue, DType, Initializer, Module, NodeId, Op, Output, Shape, TensorRef, TensorType, UnaryOp,
};

fn ty() -> TensorType {
    TensorType::new(DType::F32, vec![2])
}

fn module_with(build: impl FnOnce(&mut Module) -> Vec<TensorRef>) -> Module {
    let mut module = Module { name: "m".into(), ..Module::default() };
    let outputs = build(&mut module);
    module.outputs =
        outputs.into_iter().enumerate().map(|(i, tensor)| Output { name: format!("out{i}"), tensor }).collect();
    assert!(dfc_ir::verify(&module, dfc_ir::VerifyOptions::default()).is_empty(), "the test builds a valid module");
    module
}

fn simplified(mut module: Module) -> Module {
    dfc_passes::simplify(&mut module);
    let problems = dfc_ir::verify(&module, dfc_ir::VerifyOptions::default());
    assert!(problems.is_empty(), "simplify broke the IR: {problems:?}\n{}", dfc_ir::print(&module));
    module
}

fn input(module: &mut Module, name: &str) -> NodeId {
    let id = module.graph.add(Op::Input { ty: ty() }, &[], name, None).unwrap();
    module.inputs.push(id);
    id
}

fn variable(module: &mut Module, name: &str) -> NodeId {
    let op = Op::Variable { ty: ty(), init: Initializer::Zeros, trainable: true, partitions: 1, origin: None };
    let id = module.graph.add(op, &[], name, None).unwrap();
    module.params.push(id);
    id
}

fn constant(module: &mut Module, values: &[f32], name: &str) -> TensorRef {
    let value = ConstValue { shape: Shape(vec![values.len()]), data: dfc_ir::ConstData::F32(values.to_vec()) };
    module.graph.add(Op::Const { value }, &[], name, None).unwrap().into()
}

fn add(module: &mut Module, op: Op, inputs: &[TensorRef], name: &str) -> TensorRef {
    module.graph.add(op, inputs, name, None).unwrap().into()
}

#[test]
fn a_node_with_control_inputs_is_not_bypassed() {
    let module = module_with(|m| {
        let x = input(m, "x");
        let v = variable(m, "v");
        let read = add(m, Op::Read, &[v.into()], "read");
        let same = add(m, Op::Identity, &[x.into()], "same");
        m.graph.add_control_edge(read.node, same.node);
        let y = add(m, Op::Unary(UnaryOp::Exp), &[same], "y");
        vec![y, read]
    });
    let module = simplified(module);
    let y = module.outputs[0].tensor;
    let operand = module.graph.inputs(y.node)[0];
    assert_eq!(module.graph.node(operand.node).name, "same", "exp still waits for the read through `same`");
}

#[test]
fn reads_and_what_they_feed_are_not_merged() {
    let module = module_with(|m| {
        let v = variable(m, "v");
        let first = add(m, Op::Read, &[v.into()], "first");
        let second = add(m, Op::Read, &[v.into()], "second");
        let a = add(m, Op::Unary(UnaryOp::Exp), &[first], "a");
        let b = add(m, Op::Unary(UnaryOp::Exp), &[second], "b");
        vec![a, b]
    });
    let module = simplified(module);
    assert_eq!(module.graph.len(), 5, "{}", dfc_ir::print(&module));
    assert_ne!(module.outputs[0].tensor, module.outputs[1].tensor);
}

#[test]
fn constants_merge_only_when_their_bits_are_equal() {
    let module = module_with(|m| {
        let zero = constant(m, &[0.0, 1.0], "zero");
        let minus_zero = constant(m, &[-0.0, 1.0], "minus_zero");
        let nan = constant(m, &[f32::NAN, 1.0], "nan");
        let nan_again = constant(m, &[f32::NAN, 1.0], "nan_again");
        let zero_again = constant(m, &[0.0, 1.0], "zero_again");
        vec![zero, minus_zero, nan, nan_again, zero_again]
    });
    let module = simplified(module);
    let out: Vec<TensorRef> = module.outputs.iter().map(|o| o.tensor).collect();
    assert_ne!(out[0], out[1], "0.0 and -0.0 differ");
    assert_eq!(out[2], out[3], "the same NaN is the same constant");
    assert_eq!(out[0], out[4]);
    assert_eq!(module.graph.len(), 3);
}

#[test]
fn a_folded_constant_keeps_the_name_span_and_device_of_its_node() {
    let span = Span::new(10, 20);
    let mut requested = None;
    let module = module_with(|m| {
        let a = constant(m, &[1.0, 2.0], "a");
        let b = constant(m, &[3.0, 4.0], "b");
        let sum = m.graph.add(Op::Binary(BinaryOp::Add), &[a, b], "sum", Some(span)).unwrap();
        let device = dfc_ir::DeviceSpec::parse("/job:ps").unwrap();
        m.graph.node_mut(sum).requested_device = Some(device.clone());
        requested = Some(device);
        vec![sum.into()]
    });
    let sum = module.outputs[0].tensor.node;
    let module = simplified(module);
    assert_eq!(module.outputs[0].tensor.node, sum, "folded in place");
    let node = module.graph.node(sum);
    assert_eq!(node.name, "sum");
    assert_eq!(node.requested_device, requested);
    assert_eq!(module.graph.span(sum), Some(span));
    let Op::Const { value } = &node.op else { panic!("not folded: {}", dfc_ir::print(&module)) };
    assert_eq!(value.to_f64(), [4.0, 6.0]);
    assert_eq!(module.graph.len(), 1, "the operands are dead");
}

#[test]
fn assignments_stay_though_nothing_needs_them() {
    let module = module_with(|m| {
        let v = variable(m, "v");
        let one = constant(m, &[1.0, 1.0], "one");
        add(m, Op::AssignAdd, &[v.into(), one], "increment");
        let x = input(m, "x");
        vec![x.into()]
    });
    let module = simplified(module);
    assert_eq!(module.graph.len(), 4, "{}", dfc_ir::print(&module));
}

#[test]
fn dead_nodes_go_but_inputs_and_variables_stay() {
    let module = module_with(|m| {
        let x = input(m, "x");
        let _unused = input(m, "unused");
        let v = variable(m, "v");
        let read = add(m, Op::Read, &[v.into()], "read");
        add(m, Op::Binary(BinaryOp::Mul), &[read, x.into()], "dead");
        let y = add(m, Op::Unary(UnaryOp::Tanh), &[x.into()], "y");
        vec![y]
    });
    let module = simplified(module);
    let names: Vec<&str> = module.graph.node_ids().map(|id| module.graph.node(id).name.as_str()).collect();
    assert_eq!(names, ["x", "unused", "v", "y"]);
}

#[test]
fn the_loss_and_gradients_are_rewired() {
    let module = module_with(|m| {
        let x = input(m, "x");
        let e = add(m, Op::Unary(UnaryOp::Exp), &[x.into()], "e");
        let scalar = add(m, Op::Reduce { kind: dfc_ir::ReduceKind::Sum, axes: vec![0], keep_dims: false }, &[e], "s");
        let loss = add(m, Op::Identity, &[scalar], "loss");
        m.training = Some(dfc_ir::Training {
            loss,
            optimizer: dfc_ir::Optimizer {
                kind: dfc_ir::OptimizerKind::Sgd,
                learning_rate: 0.1,
                weight_decay: 0.0,
                schedule: None,
                clip_global_norm: None,
            },
            gradients: Vec::new(),
            updates: Vec::new(),
            learning_rate: None,
            averages: Vec::new(),
        });
        vec![]
    });
    let module = simplified(module);
    let loss = module.training.as_ref().unwrap().loss;
    assert_eq!(module.graph.node(loss.node).name, "s", "the identity is bypassed");
    assert!(!module.graph.node_ids().any(|id| module.graph.node(id).name == "loss"));
}

#[test]
fn a_lone_replicas_all_reduce_and_whole_slice_are_their_operands_and_go_when_unused() {
    let all_reduce = |group_size: u32| Op::AllReduce { key: "gradients/v".into(), group_size, replica: 0 };
    let whole = Op::Slice { begin: vec![0], size: vec![2] };
    let module = module_with(|m| {
        let x = input(m, "x");
        let sliced = add(m, whole.clone(), &[x.into()], "sliced");
        let summed = add(m, all_reduce(1), &[sliced], "summed");
        let y = add(m, Op::Unary(UnaryOp::Exp), &[summed], "y");
        // Unused: a lone all-reduce goes; one of two members must still be entered.
        add(m, all_reduce(1), &[x.into()], "lone");
        add(m, Op::AllReduce { key: "other".into(), group_size: 2, replica: 0 }, &[x.into()], "shared");
        vec![y]
    });
    let module = simplified(module);
    let names: Vec<&str> = module.graph.node_ids().map(|id| module.graph.node(id).name.as_str()).collect();
    assert_eq!(names, ["x", "y", "shared"], "{}", dfc_ir::print(&module));
    let y = module.outputs[0].tensor;
    assert_eq!(module.graph.node(module.graph.inputs(y.node)[0].node).name, "x");
}

#[test]
fn a_slice_of_part_of_its_operand_stays() {
    let module = module_with(|m| {
        let x = input(m, "x");
        let tail = add(m, Op::Slice { begin: vec![1], size: vec![1] }, &[x.into()], "tail");
        let head = add(m, Op::Slice { begin: vec![0], size: vec![1] }, &[x.into()], "head");
        vec![tail, head]
    });
    let module = simplified(module);
    assert_eq!(module.graph.len(), 3, "{}", dfc_ir::print(&module));
}
