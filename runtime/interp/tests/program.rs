//! `Program`: selection and order of nodes, variables and assignments, feeds and their errors.

mod common;

use common::t;
use dfc_interp::{initialize, InterpError, Program, Tensor, Variables};
use dfc_ir::{BinaryOp, ConstValue, DType, Graph, Initializer, Module, NodeId, Op, Shape, TensorType};
use std::collections::HashMap;

fn variable(dtype: DType, dims: &[usize], init: Initializer) -> Op {
    Op::Variable { ty: TensorType::new(dtype, dims.to_vec()), init, trainable: true, partitions: 1, origin: None }
}

fn constant(dims: &[usize], values: &[f64]) -> Op {
    Op::Const { value: ConstValue::from_f64(DType::F32, Shape(dims.to_vec()), values) }
}

struct Linear {
    module: Module,
    x: NodeId,
    w: NodeId,
    y: NodeId,
    update: NodeId,
}

const DELTA: [f64; 6] = [0.5, 0.25, -1.0, 2.0, 0.0, 1.0];

/// `y = x @ read(w) + read(b)` with `w -= DELTA`, the update ordered after the read by a
/// control edge. The update is created first, so only the edge puts it after the read.
fn linear() -> Linear {
    let mut g = Graph::new();
    let x = g.add(Op::Input { ty: TensorType::new(DType::F32, vec![2, 3]) }, &[], "x", None).unwrap();
    let w = g.add(variable(DType::F32, &[3, 2], Initializer::Ones), &[], "w", None).unwrap();
    let b = g.add(variable(DType::F32, &[2], Initializer::Constant { value: 0.5 }), &[], "b", None).unwrap();
    let delta = g.add(constant(&[3, 2], &DELTA), &[], "delta", None).unwrap();
    let update = g.add(Op::AssignSub, &[w.into(), delta.into()], "w/update", None).unwrap();
    let w_read = g.add(Op::Read, &[w.into()], "w/read", None).unwrap();
    let b_read = g.add(Op::Read, &[b.into()], "b/read", None).unwrap();
    let xw =
        g.add(Op::MatMul { transpose_a: false, transpose_b: false }, &[x.into(), w_read.into()], "xw", None).unwrap();
    let y = g.add(Op::Binary(BinaryOp::Add), &[xw.into(), b_read.into()], "y", None).unwrap();
    g.add_control_edge(w_read, update);
    let module = Module { name: "linear".into(), graph: g, inputs: vec![x], params: vec![w, b], ..Module::default() };
    assert!(dfc_ir::verify(&module, Default::default()).is_empty());
    Linear { module, x, w, y, update }
}

const X: [f32; 6] = [1.0, 2.0, 3.0, -1.0, 0.5, 2.0];

fn feeds(x: Tensor) -> HashMap<String, Tensor> {
    HashMap::from([("x".to_string(), x)])
}

/// `x @ w + 0.5` by hand.
fn expected_y(w: &[f32]) -> Vec<f32> {
    (0..2).flat_map(|i| (0..2).map(move |j| (0..3).map(|k| X[i * 3 + k] * w[k * 2 + j]).sum::<f32>() + 0.5)).collect()
}

#[test]
fn the_variable_changes_exactly_once_per_run() {
    let l = linear();
    let program = Program::new(&l.module, &[l.y.into()], &[l.update]).unwrap();
    assert_eq!(program.inputs(), ["x"]);
    let mut vars = initialize(&l.module, 7);
    assert_eq!(vars.get("w").unwrap().to_vec::<f32>(), [1.0; 6]);
    assert_eq!(vars.get("b").unwrap().to_vec::<f32>(), [0.5; 2]);
    let feeds = feeds(t(&[2, 3], X.to_vec()));

    let mut w: Vec<f32> = vec![1.0; 6];
    for _ in 0..3 {
        let out = program.run(&l.module, &mut vars, &feeds).unwrap();
        assert_eq!(out.len(), 1);
        // The read precedes the update: y uses the value before this run's update.
        assert_eq!(out[0].shape.dims(), [2, 2]);
        assert_eq!(out[0].to_vec::<f32>(), expected_y(&w));
        for (wi, d) in w.iter_mut().zip(DELTA) {
            *wi -= d as f32;
        }
        assert_eq!(vars.get("w").unwrap().to_vec::<f32>(), w);
        assert_eq!(vars.get("b").unwrap().to_vec::<f32>(), [0.5; 2]);
    }
}

#[test]
fn fetches_without_targets_change_nothing() {
    let l = linear();
    let program = Program::new(&l.module, &[l.y.into()], &[]).unwrap();
    let mut vars = initialize(&l.module, 0);
    let before = vars.clone();
    let out = program.run(&l.module, &mut vars, &feeds(t(&[2, 3], X.to_vec()))).unwrap();
    assert_eq!(out[0].to_vec::<f32>(), expected_y(&[1.0; 6]));
    assert_eq!(vars, before);
}

#[test]
fn an_assignment_yields_the_new_value_and_a_fetched_variable_its_final_value() {
    let l = linear();
    // Fetch the update itself and the variable node; no input is needed.
    let program = Program::new(&l.module, &[l.update.into(), l.w.into()], &[]).unwrap();
    assert!(program.inputs().is_empty());
    let mut vars = initialize(&l.module, 0);
    let out = program.run(&l.module, &mut vars, &HashMap::new()).unwrap();
    let expected: Vec<f32> = DELTA.iter().map(|d| 1.0 - *d as f32).collect();
    assert_eq!(out[0].to_vec::<f32>(), expected);
    assert_eq!(out[1].to_vec::<f32>(), expected);
}

#[test]
fn a_control_edge_from_an_assignment_orders_a_read_after_it() {
    let mut g = Graph::new();
    let step = g.add(variable(DType::I64, &[], Initializer::Zeros), &[], "step", None).unwrap();
    let one = g.add(Op::Const { value: ConstValue::scalar(DType::I64, 1.0) }, &[], "one", None).unwrap();
    let read = g.add(Op::Read, &[step.into()], "step/read", None).unwrap();
    let increment = g.add(Op::AssignAdd, &[step.into(), one.into()], "step/increment", None).unwrap();
    let doubled = g.add(Op::Binary(BinaryOp::Add), &[read.into(), read.into()], "doubled", None).unwrap();
    g.add_control_edge(increment, read);
    let module = Module { graph: g, ..Module::default() };
    let program = Program::new(&module, &[doubled.into(), read.into()], &[increment]).unwrap();
    let mut vars = initialize(&module, 0);
    for n in 1..=3i64 {
        let out = program.run(&module, &mut vars, &HashMap::new()).unwrap();
        assert_eq!(out[0], t(&[], vec![2 * n]));
        assert_eq!(out[1], t(&[], vec![n]));
        assert_eq!(vars.get("step").unwrap(), &t(&[], vec![n]));
    }
}

#[test]
fn assign_replaces_the_value() {
    let mut g = Graph::new();
    let v = g.add(variable(DType::F32, &[2], Initializer::Zeros), &[], "v", None).unwrap();
    let c = g.add(constant(&[2], &[3.0, 4.0]), &[], "c", None).unwrap();
    let assign = g.add(Op::Assign, &[v.into(), c.into()], "v/assign", None).unwrap();
    let module = Module { graph: g, ..Module::default() };
    let program = Program::new(&module, &[], &[assign]).unwrap();
    let mut vars = initialize(&module, 0);
    assert_eq!(program.run(&module, &mut vars, &HashMap::new()).unwrap(), Vec::<Tensor>::new());
    assert_eq!(vars.get("v").unwrap().to_vec::<f32>(), [3.0, 4.0]);
}

#[test]
fn feed_errors_name_the_input_and_the_types() {
    let l = linear();
    let program = Program::new(&l.module, &[l.y.into()], &[l.update]).unwrap();
    let mut vars = initialize(&l.module, 0);
    let before = vars.clone();

    let err = program.run(&l.module, &mut vars, &HashMap::new()).unwrap_err();
    assert_eq!(err, InterpError::MissingFeed { input: "x".into() });
    assert_eq!(err.to_string(), "input `x` is not fed");

    let wrong_shape = feeds(t(&[3, 3], vec![0.0f32; 9]));
    let err = program.run(&l.module, &mut vars, &wrong_shape).unwrap_err();
    assert_eq!(err.to_string(), "input `x` takes f32[2,3], but was fed f32[3,3]");
    assert!(matches!(err, InterpError::FeedType { .. }));

    let wrong_dtype = feeds(t(&[2, 3], vec![0.0f64; 6]));
    let err = program.run(&l.module, &mut vars, &wrong_dtype).unwrap_err();
    assert_eq!(
        err,
        InterpError::FeedType {
            input: "x".into(),
            expected: TensorType::new(DType::F32, vec![2, 3]),
            found: TensorType::new(DType::F64, vec![2, 3]),
        }
    );
    assert_eq!(err.to_string(), "input `x` takes f32[2,3], but was fed f64[2,3]");

    // A feed the program does not need is ignored.
    let mut extra = feeds(t(&[2, 3], X.to_vec()));
    extra.insert("labels".into(), t(&[1], vec![1i32]));
    program.run(&l.module, &mut vars, &extra).unwrap();
    assert_ne!(vars, before);
    let _ = l.x;
}

#[test]
fn failed_runs_leave_the_variables_alone() {
    let l = linear();
    let program = Program::new(&l.module, &[l.y.into()], &[l.update]).unwrap();
    let mut vars = initialize(&l.module, 0);
    let before = vars.clone();
    assert!(program.run(&l.module, &mut vars, &HashMap::new()).is_err());
    assert_eq!(vars, before);

    // An error after the assignment ran (an out-of-range gather ordered after it).
    let mut g = Graph::new();
    let v = g.add(variable(DType::F32, &[2], Initializer::Zeros), &[], "v", None).unwrap();
    let c = g.add(constant(&[2], &[1.0, 1.0]), &[], "c", None).unwrap();
    let add = g.add(Op::AssignAdd, &[v.into(), c.into()], "v/add", None).unwrap();
    let ids = g.add(Op::Input { ty: TensorType::new(DType::I32, vec![1]) }, &[], "ids", None).unwrap();
    let gather = g.add(Op::Gather, &[add.into(), ids.into()], "lookup", None).unwrap();
    let module = Module { graph: g, inputs: vec![ids], ..Module::default() };
    let program = Program::new(&module, &[gather.into()], &[]).unwrap();
    let mut vars = initialize(&module, 0);
    let out = program.run(&module, &mut vars, &HashMap::from([("ids".to_string(), t(&[1], vec![1i32]))])).unwrap();
    assert_eq!(out[0].to_vec::<f32>(), [1.0]);
    assert_eq!(vars.get("v").unwrap().to_vec::<f32>(), [1.0, 1.0]);
    let err = program.run(&module, &mut vars, &HashMap::from([("ids".to_string(), t(&[1], vec![2i32]))])).unwrap_err();
    assert_eq!(err, InterpError::IndexOutOfRange { node: "lookup".into(), index: 2, size: 2 });
    assert_eq!(err.to_string(), "`lookup`: index 2 is out of range for a size of 2");
    assert_eq!(vars.get("v").unwrap().to_vec::<f32>(), [1.0, 1.0]);
}

#[test]
fn variables_must_be_present_with_their_type() {
    let l = linear();
    let program = Program::new(&l.module, &[l.y.into()], &[]).unwrap();
    let feeds = feeds(t(&[2, 3], X.to_vec()));
    let mut empty = Variables::new();
    let err = program.run(&l.module, &mut empty, &feeds).unwrap_err();
    assert_eq!(err, InterpError::MissingVariable { name: "w".into() });
    assert_eq!(err.to_string(), "variable `w` has no value (initialize the variables first)");

    let mut vars = initialize(&l.module, 0);
    vars.insert("b".into(), t(&[3], vec![0.0f32; 3]));
    let err = program.run(&l.module, &mut vars, &feeds).unwrap_err();
    assert_eq!(err.to_string(), "variable `b` is declared f32[2], but holds f32[3]");
}

#[test]
fn only_needed_nodes_run() {
    let l = linear();
    // `xw` alone does not need `b`: a program without it runs with `b` missing.
    let xw = l.module.graph.node_ids().find(|&id| l.module.graph.node(id).name == "xw").unwrap();
    let program = Program::new(&l.module, &[xw.into()], &[]).unwrap();
    let mut vars = initialize(&l.module, 0);
    vars.remove("b");
    let out = program.run(&l.module, &mut vars, &feeds(t(&[2, 3], X.to_vec()))).unwrap();
    assert_eq!(out[0].to_vec::<f32>(), expected_y(&[1.0; 6]).iter().map(|v| v - 0.5).collect::<Vec<_>>());
    assert_eq!(program.len(), 4); // x, w, w/read, xw
}

#[test]
fn malformed_graphs_are_refused_when_the_program_is_built() {
    // A node whose stored type disagrees with `infer`.
    let mut g = Graph::new();
    let a = g.add(constant(&[2], &[1.0, 2.0]), &[], "a", None).unwrap();
    let bad = g.add_with_types(
        Op::Unary(dfc_ir::UnaryOp::Neg),
        &[a.into()],
        vec![TensorType::new(DType::F32, vec![3])],
        "neg",
        None,
    );
    let module = Module { graph: g, ..Module::default() };
    let err = Program::new(&module, &[bad.into()], &[]).unwrap_err();
    assert!(matches!(&err, InterpError::Malformed { node, .. } if node == "neg"), "{err}");
    assert!(err.to_string().contains("f32[3]") && err.to_string().contains("f32[2]"), "{err}");

    // A variable used directly by an op other than read and the assignments.
    let mut g = Graph::new();
    let v = g.add(variable(DType::F32, &[2], Initializer::Zeros), &[], "v", None).unwrap();
    let neg = g.add(Op::Unary(dfc_ir::UnaryOp::Neg), &[v.into()], "neg", None).unwrap();
    let module = Module { graph: g, ..Module::default() };
    let err = Program::new(&module, &[neg.into()], &[]).unwrap_err();
    assert_eq!(err.to_string(), "`neg` is malformed: operand 0 uses a variable directly; read it first");

    // A cycle.
    let mut g = Graph::new();
    let a = g.add(constant(&[1], &[1.0]), &[], "a", None).unwrap();
    let b = g.add(Op::Identity, &[a.into()], "b", None).unwrap();
    let c = g.add(Op::Identity, &[b.into()], "c", None).unwrap();
    g.add_control_edge(c, b);
    let module = Module { graph: g, ..Module::default() };
    let err = Program::new(&module, &[c.into()], &[]).unwrap_err();
    assert!(matches!(&err, InterpError::Cycle { nodes } if nodes.contains(&"b".to_string())), "{err}");

    // Fetching a missing output.
    let l = linear();
    let err = Program::new(&l.module, &[dfc_ir::TensorRef { node: l.y, port: 1 }], &[]).unwrap_err();
    assert_eq!(err.to_string(), "fetch 0 refers to a node that is not in the graph");
}

#[test]
fn a_program_runs_only_on_its_module() {
    let l = linear();
    let program = Program::new(&l.module, &[l.y.into()], &[]).unwrap();
    let other = Module::default();
    let err = program.run(&other, &mut Variables::new(), &HashMap::new()).unwrap_err();
    assert!(matches!(err, InterpError::ModuleMismatch { .. }), "{err}");
}

#[test]
fn eval_refuses_what_needs_a_program_and_malformed_constants() {
    let err = dfc_interp::eval(&Op::Read, &[&t(&[1], vec![1.0f32])]).unwrap_err();
    assert_eq!(err.to_string(), "`read` needs a program to run");
    let bad = Op::Const { value: ConstValue { shape: Shape(vec![3]), data: dfc_ir::ConstData::F32(vec![1.0, 2.0]) } };
    let err = dfc_interp::eval(&bad, &[]).unwrap_err();
    assert_eq!(err.to_string(), "`const` is malformed: the constant has 2 values for the shape [3]");
}
