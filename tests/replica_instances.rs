//! Replica instances against replicas built in full: a mirrored plan on 3 or more devices
//! stores replica 1's partition once and the others as instances of it; decoded, every
//! partition, parameter and update must be exactly what building every replica gives.

use dfc_compile::{compile, CompileOptions, Strategy};
use dfc_ir::{Cluster, DeviceKind, Module};
use dfc_plan::Plan;
use std::collections::BTreeMap;
use std::path::PathBuf;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn cluster(spec: &str) -> Cluster {
    match spec {
        "local 3" => Cluster::local(3, DeviceKind::Cpu),
        "local 4" => Cluster::local(4, DeviceKind::Cpu),
        // Two tasks of two devices: transfers and all-reduces between tasks.
        _ => Cluster::from_json(
            r#"{"cluster": {"worker": [{"address": "localhost:3100", "devices": ["cpu:0", "cpu:1"]},
                                      {"address": "localhost:3101", "devices": ["cpu:0", "cpu:1"]}]}}"#,
        )
        .expect("a valid cluster"),
    }
}

/// A model that fetches its inputs as they are (each replica's slice of one is an output that
/// lives where the input does), one only so, and has one it does not use; and whose slice is
/// named as a sharded optimizer's replica shards are not (they end in `@replica_shard`), so
/// that instances leave it as it is.
const ECHO: &str = "
model echo {
    dim batch = 24
    input x: f32[batch, 4]
    input shown: f32[batch, 3]
    input unused: f32[batch, 2]
    param w: f32[4, 4] = glorot_uniform
    let y = x @ w
    let replica_shard = slice(y, begin = [0, 1], size = [-1, 2])
    output x, y, shown, replica_shard
    minimize mean((y - x) * (y - x)) with sgd(lr = 0.1)
}
";

/// The source of an example, or of `ECHO`.
fn source(example: &str) -> String {
    if example == "echo" {
        return ECHO.to_string();
    }
    std::fs::read_to_string(root().join("examples").join(format!("{example}.df"))).expect("example")
}

/// The plan as `dfc compile` writes it and a reader gets it back.
fn compiled(example: &str, cluster: Cluster, instances: bool) -> (Plan, usize) {
    compiled_sharded(example, cluster, instances, false)
}

/// `compiled`, with Adam's state sharded over the replicas (`--shard-optimizer`) if `sharded`.
fn compiled_sharded(example: &str, cluster: Cluster, instances: bool, sharded: bool) -> (Plan, usize) {
    let source = source(example);
    let optimizer = sharded.then(|| dfc_sema::check_optimizer("adam(lr = 0.01)").expect("an optimizer"));
    let mut dims = vec![("batch".to_string(), 24)];
    if example == "wide_and_deep" {
        dims.push(("users".to_string(), 200));
    }
    let options = CompileOptions {
        sema: dfc_sema::Options { dims, optimizer },
        cluster,
        strategy: Strategy::Mirrored,
        soft_placement: true,
        replica_instances: instances,
        shard_optimizer: sharded,
        ..CompileOptions::default()
    };
    let plan = compile(&source, &format!("{example}.df"), &options).unwrap_or_else(|e| panic!("{example}: {e:?}")).plan;
    let stored = plan.partitions.len();
    (dfc_plan::decode(&dfc_plan::encode(&plan)).expect("the plan reads back"), stored)
}

/// A partition's nodes by name, each with everything that defines it, operands by name.
fn canonical(module: &Module) -> BTreeMap<String, String> {
    let graph = &module.graph;
    let name = |id| graph.node(id).name.clone();
    let listed = |ids: &[dfc_ir::NodeId]| ids.iter().map(|&id| name(id)).collect::<Vec<_>>();
    let mut nodes: BTreeMap<String, String> = graph
        .node_ids()
        .map(|id| {
            let node = graph.node(id);
            let operands: Vec<String> =
                graph.inputs(id).iter().map(|t| format!("{}:{}", name(t.node), t.port)).collect();
            let mut after: Vec<String> = graph.control_inputs(id).into_iter().map(name).collect();
            after.sort();
            let text = format!(
                "{:?} {:?} ({}) ^({}) on {:?} asked {:?} with {:?} at {:?}",
                node.op,
                node.outputs,
                operands.join(", "),
                after.join(", "),
                node.device,
                node.requested_device,
                node.colocate_with.map(name),
                graph.span(id),
            );
            (node.name.clone(), text)
        })
        .collect();
    let outputs = |list: &[dfc_ir::Output]| {
        list.iter().map(|o| format!("{}={}:{}", o.name, name(o.tensor.node), o.tensor.port)).collect::<Vec<_>>()
    };
    nodes.insert(
        " lists".into(),
        format!(
            "inputs {:?} params {:?} outputs {:?} metrics {:?}",
            listed(&module.inputs),
            listed(&module.params),
            outputs(&module.outputs),
            outputs(&module.metrics)
        ),
    );
    nodes
}

#[test]
fn instances_are_the_replicas_built_in_full() {
    let examples = ["linear_regression", "mlp", "cnn", "softmax_regression", "wide_and_deep", "echo"];
    // With a sharded optimizer, the instances' slices and slots are their replicas' shards.
    let cases = examples.iter().map(|&e| (e, false)).chain([("mlp", true), ("wide_and_deep", true)]);
    for (example, sharded) in cases {
        for spec in ["local 3", "local 4", "two tasks of two"] {
            let what = format!("{example} mirrored on {spec}{}", if sharded { ", optimizer sharded" } else { "" });
            let (compact, stored) = compiled_sharded(example, cluster(spec), true, sharded);
            let (full, _) = compiled_sharded(example, cluster(spec), false, sharded);
            assert_eq!(stored, 2, "{what}: the plan stores replica 0's and replica 1's partitions only");
            assert_eq!(compact.partitions.len(), full.partitions.len(), "{what}");
            let by_device = |plan: &Plan| {
                plan.partitions.iter().map(|p| (p.device.to_string(), canonical(&p.module))).collect::<BTreeMap<_, _>>()
            };
            let (a, b) = (by_device(&compact), by_device(&full));
            for (device, nodes) in &b {
                let built = &a[device];
                for (name, text) in nodes {
                    assert_eq!(built.get(name), Some(text), "{what}: `{name}` on {device}");
                }
                assert_eq!(built.len(), nodes.len(), "{what}: {device} has nodes the full build lacks");
            }
            assert_eq!(compact.params, full.params, "{what}");
            assert_eq!(compact.training, full.training, "{what}");
            assert_eq!(
                (&compact.inputs, &compact.outputs, &compact.metrics),
                (&full.inputs, &full.outputs, &full.metrics)
            );
            let (a, b) = (compact.report.expect("a report"), full.report.expect("a report"));
            assert!(
                (a.step_seconds - b.step_seconds).abs() <= 1e-9 * b.step_seconds.max(1e-9),
                "{what}: predicted {} s against {} s",
                a.step_seconds,
                b.step_seconds
            );
            // The same costs; each kind of work's sum may differ in its last bit (added in
            // another order).
            let without_kinds = |devices: &[dfc_passes::DeviceCost]| -> Vec<dfc_passes::DeviceCost> {
                devices.iter().map(|d| dfc_passes::DeviceCost { by_kind: Vec::new(), ..d.clone() }).collect()
            };
            assert_eq!(without_kinds(&a.devices), without_kinds(&b.devices), "{what}");
            for (x, y) in a.devices.iter().zip(&b.devices) {
                assert_eq!(x.by_kind.len(), y.by_kind.len(), "{what}: {x:?} against {y:?}");
                // By name: kinds of near-equal time may sort either way.
                let by_name = |kinds: &[(String, f64)]| {
                    let mut kinds = kinds.to_vec();
                    kinds.sort_by(|a, b| a.0.cmp(&b.0));
                    kinds
                };
                for ((kx, tx), (ky, ty)) in by_name(&x.by_kind).iter().zip(&by_name(&y.by_kind)) {
                    assert_eq!(kx, ky, "{what}: {x:?} against {y:?}");
                    assert!((tx - ty).abs() <= 1e-9 * ty.abs().max(1e-12), "{what}: {kx} {tx} against {ty}");
                }
            }
        }
    }
}

/// A crafted plan whose instances would build more than a plan may hold is refused, and so is
/// one whose template is not a replica's partition, each with a message.
#[test]
fn damaged_instances_are_refused() {
    let (plan, _) = compiled("linear_regression", cluster("local 4"), true);
    let source = std::fs::read_to_string(root().join("examples/linear_regression.df")).unwrap();
    let options = CompileOptions {
        cluster: cluster("local 4"),
        strategy: Strategy::Mirrored,
        sema: dfc_sema::Options { dims: vec![("batch".into(), 24)], optimizer: None },
        ..CompileOptions::default()
    };
    let stored = compile(&source, "linear_regression.df", &options).unwrap().plan;
    assert_eq!(plan.partitions.len(), 4);
    let refused = |plan: &Plan| match dfc_plan::decode(&dfc_plan::encode(plan)) {
        Ok(_) => panic!("a damaged plan was read"),
        Err(e) => e.to_string(),
    };

    let mut many = stored.clone();
    let one = many.instances[0].clone();
    many.instances = vec![one.clone(); 9];
    assert!(refused(&many).contains("only 4 devices"), "{}", refused(&many));

    let mut missing = stored.clone();
    missing.instances[0].template = 7;
    assert!(refused(&missing).contains("does not have"), "{}", refused(&missing));

    // Replica 0's partition (the inputs, the combined loss) is no replica 1's.
    let mut head = stored.clone();
    head.instances[0].template = 0;
    assert!(refused(&head).contains("is not a node of replica 1"), "{}", refused(&head));

    // Two instances on one device.
    let mut twice = stored.clone();
    twice.instances[1].device = twice.instances[0].device.clone();
    assert!(refused(&twice).contains("two partitions are on"), "{}", refused(&twice));

    // A wrong replica index: its all-reduces join no group.
    let mut wrong = stored;
    wrong.instances[0].replica = 9;
    assert!(refused(&wrong).contains("do not fit together"), "{}", refused(&wrong));

    // A sharded optimizer's template whose shards are not replica 1's, or whose instance's
    // shard would lie past the whole.
    let options = CompileOptions {
        sema: dfc_sema::Options {
            dims: vec![("batch".into(), 24)],
            optimizer: Some(dfc_sema::check_optimizer("adam(lr = 0.01)").unwrap()),
        },
        shard_optimizer: true,
        ..options
    };
    let mlp = std::fs::read_to_string(root().join("examples/mlp.df")).unwrap();
    let sharded = compile(&mlp, "mlp.df", &options).unwrap().plan;
    assert_eq!((sharded.partitions.len(), sharded.instances.len()), (2, 2));
    assert!(dfc_plan::decode(&dfc_plan::encode(&sharded)).is_ok(), "the sharded plan as compiled");
    let shard_of = |plan: &mut Plan, op: &str| {
        let graph = &mut plan.partitions[1].module.graph;
        let id = graph
            .node_ids()
            .find(|&id| graph.node(id).name.ends_with(dfc_ir::REPLICA_SHARD) && graph.node(id).op.name() == op)
            .expect("a replica shard");
        id
    };
    let mut moved = sharded.clone();
    let id = shard_of(&mut moved, "slice");
    if let dfc_ir::Op::Slice { begin, .. } = &mut moved.partitions[1].module.graph.node_mut(id).op {
        begin[0] += 1;
    }
    assert!(refused(&moved).contains("is not replica 1's"), "{}", refused(&moved));
    let mut past = sharded;
    let id = shard_of(&mut past, "variable");
    if let dfc_ir::Op::Variable { origin: Some(origin), ty, .. } = &mut past.partitions[1].module.graph.node_mut(id).op
    {
        origin.shape = dfc_ir::Shape::from(vec![2 * ty.shape.dims()[0]]);
    }
    assert!(refused(&past).contains("does not fit in"), "{}", refused(&past));
}

/// Replicas alike but for their names, devices and keys share their code: a session of the
/// mlp mirrored on 4 devices links one group of code, with two partitions' kernel tables
/// (replica 0's, with the inputs and the combined loss, and one for replicas 1 to 3), not
/// four. The only test of this binary that links code, so that the process's count is this
/// session's.
#[test]
fn instances_share_their_code() {
    let (plan, _) = compiled("mlp", cluster("local 4"), true);
    let cache = tempfile::tempdir().unwrap();
    std::env::set_var(dfc_codegen::CACHE_DIR_VARIABLE, cache.path());
    let session = dfc_driver::Session::with_backend(&plan, 1, dfc_driver::Backend::Llvm).expect("the plan loads");
    assert_eq!(plan.partitions.len(), 4);
    assert_eq!(dfc_cpu::live_count(), 1, "the session's partitions are linked together");
    let code = session.native_code();
    let same = |a: usize, b: usize| std::sync::Arc::ptr_eq(code[a].as_ref().unwrap(), code[b].as_ref().unwrap());
    assert!(same(1, 2) && same(1, 3) && !same(0, 1));
}
