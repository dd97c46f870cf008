//! `fuse_all_reduces` (Horovod's tensor fusion) on the modules `replicate` builds and on a
//! hand-made one: the buckets (per replica, group size and dtype; members in key order, filled
//! greedily up to the threshold, alike on every replica), what is left alone (integers, tensors
//! over the threshold, keys some replica lacks, all-reduces that depend on others), fresh keys,
//! spans, device requests, control edges and the module's interface carried over, and the
//! same bits as the unfused module over training steps in the interpreter. The whole pipeline
//! (plans, partitions, sessions) is `tensor_fusion_packs_small_gradients_into_shared_all_reduces`
//! in `tests/distributed.rs`.

use dfc_diag::Span;
use dfc_interp::{InProcessRendezvous, Program, Tensor};
use dfc_ir::{
    Cluster, DType, DeviceKind, DeviceSpec, Graph, Module, NodeId, Op, Output, TensorRef, TensorType, UnaryOp,
};
use dfc_passes::{fuse_all_reduces, FusionOptions, ReplicateOptions, Replication};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn devices(n: usize) -> Vec<DeviceSpec> {
    Cluster::local(n, DeviceKind::Cpu).devices().into_iter().cloned().collect()
}

/// The training module of an example under `dims`, after the pipeline (autodiff, optimizer,
/// simplify).
fn training_module(example: &str, dims: &[(&str, i64)]) -> Module {
    let path = workspace().join("examples").join(format!("{example}.df"));
    let source = std::fs::read_to_string(&path).expect("example");
    let options = dfc_sema::Options { dims: dims.iter().map(|(n, v)| (n.to_string(), *v)).collect(), optimizer: None };
    let (module, diagnostics) = dfc_sema::compile_source(&source, None, &options);
    let mut module = module.unwrap_or_else(|| panic!("{example} does not compile: {diagnostics:?}"));
    dfc_passes::run_pipeline(&mut module, None);
    module
}

/// An example mirrored on `replicas` devices, as `dfc_compile` replicates it (before fusion).
fn mirrored(example: &str, replicas: usize) -> Module {
    let (batch, others): (i64, &[(&str, i64)]) = match example {
        "mlp" => (16, &[]),
        "linear_regression" => (32, &[]),
        "wide_and_deep" => (16, &[("users", 200)]),
        other => panic!("no dims for {other}"),
    };
    let dims = |b: i64| -> Vec<(&str, i64)> { [("batch", b)].into_iter().chain(others.iter().copied()).collect() };
    let full = training_module(example, &dims(batch));
    let per_replica = training_module(example, &dims(batch / replicas as i64));
    let devices = devices(replicas);
    // wide_and_deep asks for ps and worker jobs the local cluster lacks.
    let options = ReplicateOptions {
        replication: Replication::Mirrored,
        devices: &devices,
        variable_device: None,
        soft: true,
        built_replicas: None,
        local_sgd: false,
        staleness_aware: false,
        backup_workers: 0,
        micro_batches: None,
        one_forward_one_backward: false,
    };
    let (module, _) = dfc_passes::replicate(&per_replica, &full, &options).expect("replicates");
    module
}

fn fused(module: &Module, threshold_bytes: usize) -> Module {
    let mut module = module.clone();
    fuse_all_reduces(&mut module, &FusionOptions { threshold_bytes }, None);
    let problems = dfc_ir::verify(&module, dfc_ir::VerifyOptions::default());
    assert!(problems.is_empty(), "the IR is broken after fusion at {threshold_bytes} bytes: {problems:?}");
    module
}

/// Replica → the keys of its all-reduces, sorted.
fn keys(module: &Module) -> BTreeMap<u32, Vec<String>> {
    let graph = &module.graph;
    let mut keys: BTreeMap<u32, Vec<String>> = BTreeMap::new();
    for id in graph.node_ids() {
        if let Op::AllReduce { key, replica, .. } = &graph.node(id).op {
            keys.entry(*replica).or_default().push(key.clone());
        }
    }
    keys.values_mut().for_each(|k| k.sort());
    keys
}

fn all_reduce(module: &Module, key: &str, replica: u32) -> NodeId {
    let graph = &module.graph;
    graph
        .node_ids()
        .find(|&id| matches!(&graph.node(id).op, Op::AllReduce { key: k, replica: r, .. } if k == key && *r == replica))
        .unwrap_or_else(|| panic!("no all-reduce `{key}` on replica {replica}"))
}

/// The tensors a fused all-reduce packs, in order (the operands of its flattening reshapes).
fn packed(module: &Module, fused: NodeId) -> Vec<TensorRef> {
    let graph = &module.graph;
    let concat = graph.inputs(fused)[0].node;
    assert!(matches!(graph.node(concat).op, Op::Concat { axis: 0 }));
    graph
        .inputs(concat)
        .iter()
        .map(|flat| {
            assert!(matches!(graph.node(flat.node).op, Op::Reshape { .. }));
            assert_eq!(graph.ty(*flat).shape.rank(), 1, "members are flattened");
            graph.inputs(flat.node)[0]
        })
        .collect()
}

/// The MLP's six gradients (784-256-256-10: h1/w 802,816 bytes, h2/w 262,144, logits/w 10,240,
/// the biases 1,024, 1,024 and 40) under a few thresholds, mirrored on 2 replicas.
#[test]
fn buckets_of_the_mlp_gradients() {
    let module = mirrored("mlp", 2);
    let gradients: Vec<String> =
        ["h1/b", "h1/w", "h2/b", "h2/w", "logits/b", "logits/w"].iter().map(|v| format!("gradients/{v}")).collect();
    let unfused = keys(&module);
    assert_eq!(unfused, BTreeMap::from([(0, gradients.clone()), (1, gradients.clone())]));

    // Horovod's default, 64 MiB: everything in one buffer per replica, members in the order the
    // backward pass computes them: the last layer's first, a layer's bias before its weights.
    let all = fused(&module, FusionOptions::default().threshold_bytes);
    let one = vec!["fused_all_reduce/0".to_string()];
    assert_eq!(keys(&all), BTreeMap::from([(0, one.clone()), (1, one)]));
    let sizes = [10, 256 * 10, 256, 256 * 256, 256, 784 * 256];
    for replica in 0..2 {
        let members = packed(&all, all_reduce(&all, "fused_all_reduce/0", replica));
        let found: Vec<usize> = members.iter().map(|&m| all.graph.ty(m).shape.n_elements()).collect();
        assert_eq!(found, sizes, "replica {replica}: members out of the order they are computed in");
        let buffer = all.graph.ty(all_reduce(&all, "fused_all_reduce/0", replica).into()).clone();
        assert_eq!(buffer, TensorType::new(DType::F32, vec![sizes.iter().sum()]));
    }

    // 0 turns fusion off: the module is unchanged.
    assert_eq!(dfc_ir::print(&fused(&module, 0)), dfc_ir::print(&module));

    // Between the sizes: h1/w's gradient stays alone, the other five share one buffer.
    let some = fused(&module, 300_000);
    for replica in 0..2 {
        assert_eq!(some_keys(&some, replica), ["fused_all_reduce/0", "gradients/h1/w"]);
        assert_eq!(packed(&some, all_reduce(&some, "fused_all_reduce/0", replica)).len(), 5);
    }

    // Greedy in that order, the weights above 12,000 bytes left out: logits/b, logits/w and
    // h2/b (11,304 bytes) fill a bucket that h1/b (1,024) would take past 12,000; h1/b is then
    // alone, so not fused.
    let small = fused(&module, 12_000);
    for replica in 0..2 {
        let expected = ["fused_all_reduce/0", "gradients/h1/b", "gradients/h1/w", "gradients/h2/w"];
        assert_eq!(some_keys(&small, replica), expected, "replica {replica}");
        let members = packed(&small, all_reduce(&small, "fused_all_reduce/0", replica));
        let found: Vec<usize> = members.iter().map(|&m| small.graph.ty(m).shape.n_elements()).collect();
        assert_eq!(found, [10, 2560, 256]);
    }
}

fn some_keys(module: &Module, replica: u32) -> Vec<String> {
    keys(module).remove(&replica).unwrap_or_default()
}

/// Fused and unfused modules run training steps in the interpreter (every replica in one
/// program, the all-reduces through an in-process rendezvous) to the same bits.
#[test]
fn fused_modules_train_to_the_same_bits() {
    for example in ["mlp", "linear_regression", "wide_and_deep"] {
        for replicas in [2, 4] {
            let module = mirrored(example, replicas);
            let all = fused(&module, FusionOptions::default().threshold_bytes);
            let count = |m: &Module| keys(m).values().map(Vec::len).sum::<usize>();
            assert!(count(&all) < count(&module), "{example} on {replicas}: nothing fused");
            let feeds = random_feeds(&module, 3);
            let a = train(&module, &feeds);
            let b = train(&all, &feeds);
            assert_eq!(a.0, b.0, "{example} on {replicas}: the losses differ");
            assert_eq!(a.1.keys().collect::<Vec<_>>(), b.1.keys().collect::<Vec<_>>());
            for (name, bytes) in &a.1 {
                assert!(*bytes == b.1[name], "{example} on {replicas}: `{name}` differs after fusion");
            }
        }
    }
}

/// Random feeds for every input: floats in [-1, 1), integers in 0..10.
fn random_feeds(module: &Module, steps: usize) -> Vec<HashMap<String, Tensor>> {
    let mut rng = fastrand::Rng::with_seed(7);
    (0..steps)
        .map(|_| {
            module
                .inputs
                .iter()
                .map(|&id| {
                    let ty = &module.graph.node(id).outputs[0];
                    let values: Vec<f64> = (0..ty.shape.n_elements())
                        .map(|_| match ty.dtype {
                            DType::F32 | DType::F64 => rng.f64() * 2.0 - 1.0,
                            _ => rng.u32(0..10) as f64,
                        })
                        .collect();
                    (module.graph.node(id).name.clone(), Tensor::from_f64(ty.dtype, ty.shape.clone(), &values))
                })
                .collect()
        })
        .collect()
}

/// The loss of each step (as bytes) and every variable's bytes after the last.
fn train(module: &Module, feeds: &[HashMap<String, Tensor>]) -> (Vec<Vec<u8>>, BTreeMap<String, Vec<u8>>) {
    let training = module.training.as_ref().expect("a training module");
    let program = Program::new(module, &[training.loss], &training.updates).expect("a training step");
    let mut variables = dfc_interp::initialize(module, 1);
    let losses = feeds
        .iter()
        .map(|feeds| {
            let rendezvous = InProcessRendezvous::new();
            let fetched = program.run_with(module, &mut variables, feeds, &rendezvous).expect("a step runs");
            fetched[0].to_le_bytes()
        })
        .collect();
    (losses, variables.iter().map(|(name, t)| (name.clone(), t.to_le_bytes())).collect())
}

/// A hand-made module of two replicas (and one all-reduce of a group of its own) that meets
/// every rule of the pass at a threshold of 128 bytes.
struct Handmade {
    module: Module,
    /// Replica → key → the all-reduce's operand.
    operands: Vec<HashMap<&'static str, TensorRef>>,
    /// Replica → key → the all-reduce's span.
    spans: Vec<HashMap<&'static str, Span>>,
    before: NodeId,
    after: NodeId,
}

const F32: DType = DType::F32;
const F64: DType = DType::F64;

/// Key, dtype, shape, and whether replica 1 has it.
const MEMBERS: &[(&str, DType, &[usize], bool)] = &[
    ("gradients/a", F32, &[3, 4], true),      // 48 bytes
    ("gradients/b", F32, &[10], true),        // 40
    ("gradients/x", F32, &[4], true),         // 16: a, b, x = 104 bytes
    ("gradients/y", F32, &[9], true),         // 36: a new bucket
    ("gradients/z", F32, &[], true),          // 4: y, z = 40 bytes
    ("gradients/c", F64, &[2], true),         // 16: another dtype, another bucket
    ("gradients/d", F64, &[5], true),         // 40
    ("gradients/e", DType::I32, &[4], true),  // integers are left alone
    ("gradients/big", F32, &[100], true),     // 400 bytes: over the threshold
    ("gradients/lonely", F32, &[2], false),   // replica 1 lacks it
    ("fused_all_reduce/0", F32, &[50], true), // a key already taken (200 bytes)
];

fn handmade() -> Handmade {
    let mut module = Module { name: "handmade".into(), ..Module::default() };
    let devices = devices(2);
    let g: &mut Graph = &mut module.graph;
    let mut operands = vec![HashMap::new(), HashMap::new()];
    let mut spans = vec![HashMap::new(), HashMap::new()];
    let mut results: Vec<HashMap<&str, NodeId>> = vec![HashMap::new(), HashMap::new()];
    let mut position = 0;
    let mut before = None;
    let mut after = None;
    for replica in 0..2u32 {
        let device = Some(devices[replica as usize].clone());
        let mut add = |g: &mut Graph, op: Op, inputs: &[TensorRef], name: &str| -> NodeId {
            position += 10;
            let span = Span::new(position, position + 5);
            let id = g.add(op, inputs, &format!("replica_{replica}/{name}"), Some(span)).expect("typed");
            g.request(id, device.clone(), Some(Span::new(position + 5, position + 9)));
            id
        };
        for &(key, dtype, shape, both) in MEMBERS {
            if replica == 1 && !both {
                continue;
            }
            let ty = TensorType::new(dtype, shape.to_vec());
            let input = add(g, Op::Input { ty }, &[], &format!("{key}/local"));
            module.inputs.push(input);
            let sum = add(g, Op::AllReduce { key: key.into(), group_size: 2, replica }, &[input.into()], key);
            operands[replica as usize].insert(key, input.into());
            spans[replica as usize].insert(key, g.span(sum).expect("a span"));
            results[replica as usize].insert(key, sum);
            add(g, Op::Unary(UnaryOp::Neg), &[sum.into()], &format!("{key}/use"));
        }
        // An all-reduce whose operand is another's sum: fusing the two would make a cycle.
        let b = results[replica as usize]["gradients/b"];
        let neg = add(g, Op::Unary(UnaryOp::Neg), &[b.into()], "gradients/chain/local");
        let chain =
            add(g, Op::AllReduce { key: "gradients/chain".into(), group_size: 2, replica }, &[neg.into()], "chain");
        add(g, Op::Unary(UnaryOp::Neg), &[chain.into()], "gradients/chain/use");
        // A group of one replica, of its own.
        if replica == 0 {
            for key in ["solo/p", "solo/q"] {
                let ty = TensorType::new(F32, vec![2]);
                let input = add(g, Op::Input { ty }, &[], &format!("{key}/local"));
                module.inputs.push(input);
                let sum = add(g, Op::AllReduce { key: key.into(), group_size: 1, replica: 0 }, &[input.into()], key);
                add(g, Op::Unary(UnaryOp::Neg), &[sum.into()], &format!("{key}/use"));
                operands[0].insert(key, input.into());
            }
            // Control edges into one member and out of another.
            let ty = TensorType::new(F32, vec![1]);
            let b_input = add(g, Op::Input { ty: ty.clone() }, &[], "before");
            let a_input = add(g, Op::Input { ty }, &[], "after");
            module.inputs.extend([b_input, a_input]);
            g.add_control_edge(b_input, results[0]["gradients/a"]);
            g.add_control_edge(results[0]["gradients/y"], a_input);
            before = Some(b_input);
            after = Some(a_input);
            // The interface names one all-reduce's value.
            module.outputs.push(Output { name: "x_sum".into(), tensor: results[0]["gradients/x"].into() });
        }
    }
    let problems = dfc_ir::verify(&module, dfc_ir::VerifyOptions::default());
    assert!(problems.is_empty(), "{problems:?}");
    Handmade { module, operands, spans, before: before.expect("made"), after: after.expect("made") }
}

#[test]
fn buckets_and_what_is_left_alone() {
    let made = handmade();
    let module = fused(&made.module, 128);
    let left = ["fused_all_reduce/0", "gradients/big", "gradients/chain", "gradients/e"];
    let mut replica0: Vec<String> = left.iter().chain(&["gradients/lonely"]).map(|k| k.to_string()).collect::<Vec<_>>();
    // Groups in order of group size, then dtype; buckets in key order. The group of one: [p, q];
    // f32 of group 2: [a, b, x] and [y, z]; f64 of group 2: [c, d]. Keys count on from 0,
    // skipping the one already taken.
    let fused_keys = ["fused_all_reduce/1", "fused_all_reduce/2", "fused_all_reduce/3", "fused_all_reduce/4"];
    replica0.extend(fused_keys.iter().map(|k| k.to_string()));
    replica0.sort();
    let mut replica1: Vec<String> = left.iter().chain(&fused_keys[1..]).map(|k| k.to_string()).collect::<Vec<_>>();
    replica1.sort();
    assert_eq!(keys(&module), BTreeMap::from([(0, replica0), (1, replica1)]));

    let buckets: [(&str, &[&str]); 4] = [
        ("fused_all_reduce/1", &["solo/p", "solo/q"]),
        ("fused_all_reduce/2", &["gradients/a", "gradients/b", "gradients/x"]),
        ("fused_all_reduce/3", &["gradients/y", "gradients/z"]),
        ("fused_all_reduce/4", &["gradients/c", "gradients/d"]),
    ];
    let devices = devices(2);
    for (key, members) in buckets {
        for replica in 0..2u32 {
            if replica == 1 && key == "fused_all_reduce/1" {
                continue;
            }
            let r = replica as usize;
            let fused = all_reduce(&module, key, replica);
            let expected: Vec<TensorRef> = members.iter().map(|m| made.operands[r][m]).collect();
            assert_eq!(packed(&module, fused), expected, "{key} on replica {replica}");
            let group = if key == "fused_all_reduce/1" { 1 } else { 2 };
            assert_eq!(module.graph.node(fused).op, Op::AllReduce { key: key.into(), group_size: group, replica });
            // Every new node is requested where the all-reduces were, with a span.
            let graph = &module.graph;
            for id in
                graph.node_ids().filter(|&id| graph.node(id).name.starts_with(&format!("replica_{replica}/{key}/")))
            {
                assert_eq!(graph.node(id).requested_device.as_ref(), Some(&devices[r]), "{}", graph.node(id).name);
                assert!(graph.span(id).is_some() && graph.request_span(id).is_some(), "{}", graph.node(id).name);
            }
            if let Some(span) = made.spans[r].get(members[0]) {
                assert_eq!(graph.span(fused), Some(*span), "the bucket's first member's span");
            }
            // Every member's users now read its slice of the sum, reshaped back.
            for member in members {
                let user_name = format!("replica_{replica}/{member}/use");
                let user = graph.node_ids().find(|&id| graph.node(id).name == user_name).expect("the user");
                let back = graph.inputs(user)[0];
                assert!(matches!(graph.node(back.node).op, Op::Reshape { .. }));
                assert_eq!(graph.ty(back), graph.ty(made.operands[r][member]));
                let slice = graph.inputs(back.node)[0];
                assert!(matches!(graph.node(slice.node).op, Op::Slice { .. }));
                assert_eq!(graph.inputs(slice.node)[0], fused.into());
            }
        }
    }
    // Control edges moved to the fused all-reduces.
    let graph = &module.graph;
    assert!(graph.control_inputs(all_reduce(&module, "fused_all_reduce/2", 0)).contains(&made.before));
    assert!(graph.control_inputs(made.after).contains(&all_reduce(&module, "fused_all_reduce/3", 0)));
    // The output now names x's slice of the sum, reshaped back.
    let output = module.outputs[0].tensor;
    assert!(matches!(graph.node(output.node).op, Op::Reshape { .. }));
    assert_eq!(graph.ty(output), graph.ty(made.operands[0]["gradients/x"]));
    let slice = graph.inputs(output.node)[0].node;
    assert_eq!(graph.node(slice).op, Op::Slice { begin: vec![12 + 10], size: vec![4] });
    assert_eq!(graph.inputs(slice)[0], all_reduce(&module, "fused_all_reduce/2", 0).into());
    // No all-reduce of a fused key's members is left.
    for (key, members) in buckets {
        for member in members {
            assert!(keys(&module).values().all(|k| !k.iter().any(|k| k == member)), "{member} of {key} is still there");
        }
    }
}

/// The threshold bounds a bucket inclusively, and one too small for any pair fuses nothing.
#[test]
fn threshold_bounds_buckets() {
    let made = handmade();
    let count = |m: &Module| keys(m).values().map(Vec::len).sum::<usize>();
    let before = count(&made.module);
    // 104 bytes: a, b, x exactly fill a bucket.
    let exact = fused(&made.module, 104);
    assert_eq!(packed(&exact, all_reduce(&exact, "fused_all_reduce/2", 1)).len(), 3);
    // 7 bytes: only z (4) fits, alone.
    let tiny = fused(&made.module, 7);
    assert_eq!(count(&tiny), before);
    assert_eq!(dfc_ir::print(&tiny), dfc_ir::print(&made.module));
}
