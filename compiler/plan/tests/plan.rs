use dfc_ir::{
    DType, Graph, Initializer, Module, Op, Optimizer, OptimizerKind, Output, ReduceKind, TensorType, Training,
};
use dfc_plan::{decode, encode, summary, Plan, PlanError, FORMAT_VERSION, HEADER_LEN};

/// `y = x @ w`, trained to minimise `mean(y)` with SGD.
fn module() -> Module {
    let mut g = Graph::new();
    let x = g.add(Op::Input { ty: TensorType::new(DType::F32, vec![4, 3]) }, &[], "x", None).unwrap();
    let variable = Op::Variable {
        ty: TensorType::new(DType::F32, vec![3, 2]),
        init: Initializer::GlorotUniform,
        trainable: true,
        partitions: 1,
        origin: None,
    };
    let w = g.add(variable, &[], "w", None).unwrap();
    let w_read = g.add(Op::Read, &[w.into()], "w/read", None).unwrap();
    let matmul = Op::MatMul { transpose_a: false, transpose_b: false };
    let y = g.add(matmul, &[x.into(), w_read.into()], "y", None).unwrap();
    let mean = Op::Reduce { kind: ReduceKind::Mean, axes: vec![0, 1], keep_dims: false };
    let loss = g.add(mean, &[y.into()], "loss", None).unwrap();
    Module {
        name: "mlp".into(),
        graph: g,
        dims: vec![("batch".into(), 4)],
        inputs: vec![x],
        params: vec![w],
        outputs: vec![Output { name: "y".into(), tensor: y.into() }],
        training: Some(Training {
            loss: loss.into(),
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
        }),
        metrics: Vec::new(),
    }
}

fn plan() -> Plan {
    Plan::single_device(module(), "mlp.df", "model mlp { }")
}

#[test]
fn single_device_fills_the_interface_and_places_every_node() {
    let plan = plan();
    assert_eq!(plan.partitions.len(), 1);
    let device = &plan.partitions[0].device;
    assert_eq!(device.to_string(), "/job:localhost/task:0/cpu:0");
    let graph = &plan.partitions[0].module.graph;
    assert!(graph.node_ids().all(|id| graph.node(id).device.as_ref() == Some(device)));
    assert_eq!(plan.cluster.jobs[0].name, "localhost");
    assert_eq!(plan.inputs[0].name, "x");
    assert_eq!(plan.inputs[0].ty.to_string(), "f32[4,3]");
    assert_eq!(plan.outputs[0].ty.to_string(), "f32[4,2]");
    assert_eq!((plan.params[0].name.as_str(), plan.params[0].bytes), ("w", 24));
    assert_eq!(plan.training.as_ref().unwrap().loss, "loss");
    assert_eq!(plan.source_hash, dfc_plan::source_hash("model mlp { }"));
    assert_ne!(plan.source_hash, dfc_plan::source_hash("model mlp {}"));
}

#[test]
fn encode_then_decode_round_trips() {
    let plan = plan();
    let decoded = decode(&encode(&plan)).unwrap();
    assert_eq!(dfc_ir::print(&decoded.partitions[0].module), dfc_ir::print(&plan.partitions[0].module));
    assert_eq!(decoded.partitions[0].device, plan.partitions[0].device);
    assert_eq!(decoded.inputs, plan.inputs);
    assert_eq!(decoded.params, plan.params);
    assert_eq!(decoded.training, plan.training);
    assert_eq!(summary(&decoded).to_string(), summary(&plan).to_string());
    // Deterministic: the same plan always encodes to the same bytes.
    assert_eq!(encode(&decoded), encode(&plan));
}

#[test]
fn every_truncation_is_an_error() {
    let bytes = encode(&plan());
    for len in 0..bytes.len() {
        let err = decode(&bytes[..len]).unwrap_err();
        match len {
            0..HEADER_LEN => assert_eq!(err, PlanError::TooShort { len }),
            _ => assert!(matches!(err, PlanError::Truncated { .. }), "{len}: {err}"),
        }
    }
}

#[test]
fn every_flipped_byte_is_an_error() {
    let bytes = encode(&plan());
    for at in 0..bytes.len() {
        for flip in [0x01, 0x80, 0xff] {
            let mut bad = bytes.clone();
            bad[at] ^= flip;
            let err = decode(&bad).unwrap_err();
            if at >= HEADER_LEN {
                assert!(matches!(err, PlanError::ChecksumMismatch { .. }), "{at}: {err}");
            }
        }
    }
}

#[test]
fn header_errors_say_what_is_wrong() {
    let bytes = encode(&plan());
    let mut newer = bytes.clone();
    newer[8..12].copy_from_slice(&(FORMAT_VERSION + 1).to_le_bytes());
    assert_eq!(decode(&newer).unwrap_err(), PlanError::NewerVersion { found: FORMAT_VERSION + 1 });
    assert!(decode(&newer).unwrap_err().to_string().contains("use a newer dfc"));

    let mut older = bytes.clone();
    older[8..12].copy_from_slice(&0u32.to_le_bytes());
    assert!(decode(&older).unwrap_err().to_string().contains("recompile the model"));

    let mut magic = bytes.clone();
    magic[0] = b'X';
    assert_eq!(decode(&magic).unwrap_err(), PlanError::NotAPlan);
    assert_eq!(decode(b"model mlp {}").unwrap_err(), PlanError::NotAPlan);

    let mut longer = bytes.clone();
    longer.push(0);
    assert_eq!(decode(&longer).unwrap_err(), PlanError::TrailingBytes { extra: 1 });
}

/// A payload with a correct checksum but content that is not a plan, as a buggy or hostile
/// writer could make.
#[test]
fn malformed_payloads_with_valid_checksums_are_errors() {
    let good = encode(&plan());
    let payload = &good[HEADER_LEN..];
    let reframe = |payload: &[u8]| {
        let mut bytes = good[..12].to_vec();
        bytes.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        bytes.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
        bytes.extend_from_slice(payload);
        bytes
    };
    for len in 0..payload.len() {
        assert!(decode(&reframe(&payload[..len])).is_err(), "{len}");
    }
    for at in 0..payload.len() {
        let mut bad = payload.to_vec();
        bad[at] ^= 0xff;
        let _ = decode(&reframe(&bad)); // Any result but a panic.
    }
    let mut longer = payload.to_vec();
    longer.push(0);
    assert!(matches!(decode(&reframe(&longer)), Err(PlanError::Malformed(_))));

    // An output that names a node the graph does not have.
    let mut plan = plan();
    plan.partitions[0].module.outputs[0].tensor.port = 7;
    let err = decode(&encode(&plan)).unwrap_err();
    assert!(matches!(err, PlanError::Invalid(ref m) if m.contains("missing output")), "{err}");
}

/// Plans that encode well but whose content is wrong: `decode` verifies the IR and the
/// interface in full, so that nothing downstream meets them.
#[test]
fn plans_whose_content_is_wrong_are_refused() {
    let refused = |change: &dyn Fn(&mut Plan), expected: &str| {
        let mut plan = plan();
        change(&mut plan);
        match decode(&encode(&plan)) {
            Err(PlanError::Invalid(message)) => assert!(message.contains(expected), "{message}"),
            other => panic!("expected a refusal saying {expected:?}, got {other:?}"),
        }
    };
    let node = |plan: &mut Plan, name: &str| {
        let graph = &plan.partitions[0].module.graph;
        graph.node_ids().find(|&id| graph.node(id).name == name).unwrap()
    };
    // A type that is not what the op gives for its operands.
    refused(
        &|plan| {
            let y = node(plan, "y");
            plan.partitions[0].module.graph.node_mut(y).outputs[0] = TensorType::new(DType::F32, vec![4, 3]);
        },
        "output type f32[4,3] should be f32[4,2]",
    );
    // A tensor whose size cannot be a tensor's (the graph is otherwise consistent).
    refused(
        &|plan| {
            let device = plan.partitions[0].device.clone();
            let graph = &mut plan.partitions[0].module.graph;
            let huge = Op::Input { ty: TensorType::new(DType::F32, vec![1 << 40, 1 << 20]) };
            let big = graph.add(huge, &[], "big", None).unwrap();
            graph.node_mut(big).device = Some(device);
        },
        "larger than any tensor can be",
    );
    refused(
        &|plan| {
            let y = node(plan, "y");
            plan.partitions[0].module.graph.node_mut(y).device = None;
        },
        "has no device",
    );
    refused(&|plan| plan.inputs[0].name = "images".into(), "input `images` names no input node");
    refused(&|plan| plan.inputs[0].ty = TensorType::new(DType::U8, vec![4, 3]), "is declared u8[4,3]");
    refused(&|plan| plan.outputs[0].name = "logits".into(), "output `logits` is in no partition");
    refused(&|plan| plan.training.as_mut().unwrap().loss_node = "y".into(), "floating-point scalar");
    refused(&|plan| plan.training.as_mut().unwrap().updates.push("w/update".into()), "`w/update` is in no partition");
    refused(&|plan| plan.cluster.jobs[0].tasks[0].devices[0].index = Some(5), "the plan's cluster does not have");
    refused(&|plan| plan.partitions.clear(), "no partitions");
    refused(&|plan| plan.strategy.backup_workers = 1, "keeps 1 of its 1 replicas as backups, but the plan has 0");
}

#[test]
fn summary_shows_the_model() {
    let summary = summary(&plan());
    assert_eq!(summary.total_param_bytes, 24);
    assert_eq!(summary.devices[0].n_nodes, 5);
    assert_eq!(summary.devices[0].n_variables, 1);
    assert_eq!(summary.devices[0].ops["matmul"], 1);
    let text = summary.to_string();
    assert!(text.starts_with(&format!(
        "model mlp from mlp.df (dfc {}, plan format {FORMAT_VERSION})\n",
        env!("CARGO_PKG_VERSION")
    )));
    for line in [
        "dims: batch=4",
        "  x  f32[4,3]",
        "  w  f32[3,2]  24 B  glorot_uniform",
        "training: minimize loss with sgd(lr=0.1)",
    ] {
        assert!(text.lines().any(|l| l == line), "no line `{line}` in:\n{text}");
    }
    assert!(
        text.contains(
            "/job:localhost/task:0/cpu:0  5 nodes  1 variable  24 B  (input 1, matmul 1, mean 1, read 1, variable 1)"
        ),
        "{text}"
    );
}

#[test]
fn write_replaces_the_file_atomically() {
    let dir = std::env::temp_dir().join(format!("dfc-plan-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("plan.bin");
    std::fs::write(&path, b"old").unwrap();
    dfc_plan::write(&path, &plan()).unwrap();
    let plan = decode(&std::fs::read(&path).unwrap()).unwrap();
    assert_eq!(plan.model, "mlp");
    // No temporary file is left behind.
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Inputs the `plan` fuzz target (fuzz/) found crashing, kept so that they stay fixed: each
/// file as the target reads it (its length and checksum fields made right first) decodes to an
/// error or a valid plan, never a panic. `graph-holes.plan`: a graph whose removed-node holes
/// did not fit its node list (petgraph's deserializer asserted; the graph now has its own
/// checked form).
#[test]
fn inputs_the_fuzzer_found_decode_without_a_panic() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzzed");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let mut bytes = std::fs::read(&path).unwrap();
        assert!(bytes.len() >= HEADER_LEN, "{}", path.display());
        let payload = &bytes[HEADER_LEN..];
        let (length, checksum) = (payload.len() as u64, crc32fast::hash(payload));
        bytes[12..20].copy_from_slice(&length.to_le_bytes());
        bytes[20..24].copy_from_slice(&checksum.to_le_bytes());
        if let Ok(plan) = decode(&bytes) {
            let _ = summary(&plan).to_string();
        }
        seen += 1;
    }
    assert!(seen >= 1, "no inputs in {}", dir.display());
}
