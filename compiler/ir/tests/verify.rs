//! The verifier finds every kind of broken invariant, all at once.

use dfc_ir::*;

fn f32(dims: &[usize]) -> TensorType {
    TensorType::new(DType::F32, dims.to_vec())
}

/// x[2,3] @ w[3,4] with w a variable: a small well-formed module.
fn small() -> (Module, NodeId, NodeId, NodeId) {
    let mut graph = Graph::new();
    let x = graph.add(Op::Input { ty: f32(&[2, 3]) }, &[], "x", None).unwrap();
    let var = Op::Variable { ty: f32(&[3, 4]), init: Initializer::Zeros, trainable: true, partitions: 1, origin: None };
    let w = graph.add(var, &[], "w", None).unwrap();
    let read = graph.add(Op::Read, &[w.into()], "w/read", None).unwrap();
    let y =
        graph.add(Op::MatMul { transpose_a: false, transpose_b: false }, &[x.into(), read.into()], "y", None).unwrap();
    let module = Module {
        name: "small".into(),
        graph,
        inputs: vec![x],
        params: vec![w],
        outputs: vec![Output { name: "y".into(), tensor: y.into() }],
        ..Module::default()
    };
    (module, x, w, y)
}

fn messages(module: &Module, options: VerifyOptions) -> Vec<String> {
    verify(module, options).into_iter().map(|e| e.message).collect()
}

#[test]
fn a_well_formed_module_verifies() {
    let (module, ..) = small();
    assert_eq!(messages(&module, VerifyOptions::default()), Vec::<String>::new());
}

#[test]
fn wrong_output_types_are_found() {
    let (mut module, _, _, y) = small();
    module.graph.node_mut(y).outputs = vec![f32(&[2, 5])];
    let found = messages(&module, VerifyOptions::default());
    assert_eq!(found, ["output type f32[2,5] should be f32[2,4]"]);
}

#[test]
fn cycles_missing_operands_and_duplicate_names_are_all_reported() {
    let (mut module, x, _, y) = small();
    // A cycle: y feeds an identity that feeds y's ordering.
    let id = module.graph.add(Op::Identity, &[y.into()], "loop", None).unwrap();
    module.graph.add_control_edge(id, y);
    // An add with one operand.
    module.graph.add_with_types(Op::Binary(BinaryOp::Add), &[x.into()], vec![f32(&[2, 3])], "half_add", None);
    // A duplicate name, forced past `add`'s renaming.
    let dup = module.graph.add(Op::Identity, &[x.into()], "dup", None).unwrap();
    module.graph.node_mut(dup).name = "x".into();
    let found = messages(&module, VerifyOptions::default());
    assert!(found.iter().any(|m| m.starts_with("the graph has a cycle")), "{found:?}");
    assert!(found.iter().any(|m| m == "`add` takes 2 operand(s) but has 1"), "{found:?}");
    assert!(found.iter().any(|m| m.contains("the name `x` is also used")), "{found:?}");
    assert_eq!(found.len(), 3, "{found:?}");
}

#[test]
fn variables_are_used_only_through_read_and_assignments() {
    let (mut module, _, w, _) = small();
    module.graph.add_with_types(Op::Identity, &[w.into()], vec![f32(&[3, 4])], "raw", None);
    let x = module.inputs[0];
    module.graph.add_with_types(Op::Read, &[x.into()], vec![f32(&[2, 3])], "read_input", None);
    let found = messages(&module, VerifyOptions::default());
    assert!(found.iter().any(|m| m == "operand 0 uses a variable directly; read it first"), "{found:?}");
    assert!(found.iter().any(|m| m == "`read` must act on a variable"), "{found:?}");
}

#[test]
fn module_references_and_the_loss_are_checked() {
    let (mut module, x, _, y) = small();
    module.training = Some(Training {
        loss: y.into(),
        optimizer: Optimizer {
            kind: OptimizerKind::Sgd,
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
    module.params.push(x);
    module.graph.remove(y);
    let found = messages(&module, VerifyOptions::default());
    assert!(found.contains(&"output `y` refers to a removed node".to_string()), "{found:?}");
    assert!(found.contains(&"the loss refers to a removed node".to_string()), "{found:?}");
    assert!(found.contains(&"a module parameter is not a variable node".to_string()), "{found:?}");
}

#[test]
fn placement_requires_a_device_on_every_node() {
    let (mut module, x, ..) = small();
    let strict = VerifyOptions { require_devices: true };
    assert_eq!(verify(&module, strict).len(), module.graph.len());
    let ids: Vec<NodeId> = module.graph.node_ids().collect();
    for id in ids {
        module.graph.node_mut(id).device = Some(DeviceSpec::parse("/job:worker/task:0/cpu:0").unwrap());
    }
    assert!(verify(&module, strict).is_empty());
    module.graph.node_mut(x).device = None;
    assert_eq!(messages(&module, strict), ["`x` has no device"]);
}

#[test]
fn the_text_form_is_independent_of_creation_order_and_removals() {
    let (module, ..) = small();
    let printed = print(&module);
    assert_eq!(
        printed,
        "model small {\n  %0 = input : f32[2,3]  // x\n  %1 = variable[init=zeros] : f32[3,4]  // w\n  %2 = read %1 : f32[3,4]  // w/read\n  %3 = matmul %0, %2 : f32[2,4]  // y\n  output y = %3\n}\n"
    );
    // The same graph built with a throwaway node first prints the same.
    let mut graph = Graph::new();
    let junk = graph.add(Op::Input { ty: f32(&[1]) }, &[], "junk", None).unwrap();
    let x = graph.add(Op::Input { ty: f32(&[2, 3]) }, &[], "x", None).unwrap();
    let var = Op::Variable { ty: f32(&[3, 4]), init: Initializer::Zeros, trainable: true, partitions: 1, origin: None };
    let w = graph.add(var, &[], "w", None).unwrap();
    let read = graph.add(Op::Read, &[w.into()], "w/read", None).unwrap();
    let y =
        graph.add(Op::MatMul { transpose_a: false, transpose_b: false }, &[x.into(), read.into()], "y", None).unwrap();
    graph.remove(junk);
    let rebuilt = Module {
        name: "small".into(),
        graph,
        inputs: vec![x],
        params: vec![w],
        outputs: vec![Output { name: "y".into(), tensor: y.into() }],
        ..Module::default()
    };
    assert_eq!(print(&rebuilt), printed);
}

#[test]
fn constants_must_hold_as_many_values_as_their_shape() {
    let (mut module, ..) = small();
    let bad = ConstValue { shape: Shape(vec![2, 2]), data: ConstData::F32(vec![1.0, 2.0, 3.0]) };
    let ty = TensorType::new(DType::F32, vec![2, 2]);
    module.graph.add_with_types(Op::Const { value: bad }, &[], vec![ty], "short", None);
    assert_eq!(messages(&module, VerifyOptions::default()), ["the constant holds 3 values for the shape [2,2]"]);
}

#[test]
fn absurd_attributes_are_type_errors_not_panics() {
    let x = TensorType::new(DType::F32, vec![4]);
    let slice = Op::Slice { begin: vec![usize::MAX], size: vec![2] };
    assert!(infer(&slice, &[&x]).is_err());
    let pad = Op::Pad { before: vec![usize::MAX], after: vec![1] };
    assert!(infer(&pad, &[&x]).is_err());
}

#[test]
fn batch_norm_must_normalise_with_its_own_moments() {
    let mut graph = Graph::new();
    let x = graph.add(Op::Input { ty: f32(&[4, 3]) }, &[], "x", None).unwrap();
    let other = graph.add(Op::Input { ty: f32(&[4, 3]) }, &[], "other", None).unwrap();
    let own = graph.add(Op::Moments, &[x.into()], "own", None).unwrap();
    let foreign = graph.add(Op::Moments, &[other.into()], "foreign", None).unwrap();
    let flag = graph.add(Op::TrainingFlag, &[], "training", None).unwrap();
    let chosen = graph.add(Op::Select, &[flag.into(), own.into(), foreign.into()], "chosen", None).unwrap();
    let swapped = graph.add(Op::Select, &[flag.into(), foreign.into(), own.into()], "swapped", None).unwrap();
    let norm = |graph: &mut Graph, moments: NodeId, name: &str| {
        graph
            .add(Op::BatchNorm { epsilon: 1e-3, synchronized: false }, &[x.into(), moments.into()], name, None)
            .unwrap()
    };
    // Synchronized: moments computed from the input's (here scaled, standing in for the
    // cross-replica means), or from another input's.
    let scale = graph.add(Op::Const { value: ConstValue::scalar(DType::F32, 2.0) }, &[], "two", None).unwrap();
    let mul = Op::Binary(BinaryOp::Mul);
    let from_own = graph.add(mul.clone(), &[own.into(), scale.into()], "from_own", None).unwrap();
    let from_foreign = graph.add(mul, &[foreign.into(), scale.into()], "from_foreign", None).unwrap();
    let synchronized = |graph: &mut Graph, moments: NodeId, name: &str| {
        let op = Op::BatchNorm { epsilon: 1e-3, synchronized: true };
        graph.add(op, &[x.into(), moments.into()], name, None).unwrap()
    };
    synchronized(&mut graph, from_own, "synchronized");
    synchronized(&mut graph, from_foreign, "synchronized_foreign");
    norm(&mut graph, from_own, "unsynchronized_from_own");
    norm(&mut graph, own, "with_own");
    norm(&mut graph, chosen, "with_own_in_training");
    norm(&mut graph, foreign, "with_foreign");
    norm(&mut graph, swapped, "with_foreign_in_training");
    let module = Module { name: "bn".into(), graph, inputs: vec![x, other], ..Module::default() };
    let found = messages(&module, VerifyOptions::default());
    let expected = |name: &str| {
        format!("`{name}` normalises with moments that are not its input's (nor selected by the training flag)")
    };
    let wrong = ["synchronized_foreign", "unsynchronized_from_own", "with_foreign", "with_foreign_in_training"];
    let (mut found, mut wrong) = (found, wrong.map(expected));
    found.sort();
    wrong.sort();
    assert_eq!(found, wrong);
}
