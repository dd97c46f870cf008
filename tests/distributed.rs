//! Differential tests of the strategies: every example, trained for a few steps on the same
//! data from the same initial values, ends with the same losses and parameters whether it runs
//! on one device, mirrored on 2 and 4, on parameter servers (synchronous), in central storage,
//! or spread by the cost model. Data-parallel runs sum in another order, so they agree within
//! float tolerance; model parallelism runs the same arithmetic and agrees exactly.

use dfc_compile::{compile, CompileOptions, Strategy};
use dfc_driver::{Session, Stage};
use dfc_interp::Tensor;
use dfc_ir::{Cluster, DType, DeviceKind};
use dfc_plan::Plan;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

#[path = "support/close.rs"]
mod support;

#[path = "support/ps_cluster.rs"]
mod ps_cluster;
use ps_cluster::ps_cluster;

const STEPS: usize = 3;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Smaller dims than the examples' own where they are large, every batch divisible by 4.
fn dims(example: &str) -> Vec<(String, i64)> {
    let pairs: &[(&str, i64)] = match example {
        "cnn" => &[("batch", 8)],
        "mlp" => &[("batch", 16)],
        "softmax_regression" => &[("batch", 20)],
        "wide_and_deep" => &[("batch", 16), ("users", 200)],
        _ => &[],
    };
    pairs.iter().map(|(n, v)| (n.to_string(), *v)).collect()
}

fn plan(example: &str, cluster: Cluster, strategy: Strategy) -> Plan {
    plan_with(example, CompileOptions { cluster, strategy, ..CompileOptions::default() })
}

fn plan_with(example: &str, options: CompileOptions) -> Plan {
    let strategy = options.strategy;
    let path = root().join("examples").join(format!("{example}.df"));
    let source = std::fs::read_to_string(&path).expect("example");
    let options = CompileOptions {
        sema: dfc_sema::Options { dims: dims(example), optimizer: None },
        // wide_and_deep asks for ps and worker jobs that some of these clusters lack.
        soft_placement: true,
        ..options
    };
    match compile(&source, &format!("{example}.df"), &options) {
        Ok(compiled) => {
            let mut plan = compiled.plan;
            plan.expand_instances().expect("replica instances build");
            plan
        }
        Err(e) => panic!("{example} ({}): does not compile: {e:?}", strategy.name()),
    }
}

/// Random batches for the plan's inputs: small non-negative integers (labels, ids), bytes,
/// floats in [-1, 1).
fn batches(plan: &Plan) -> Vec<HashMap<String, Tensor>> {
    let mut rng = fastrand::Rng::with_seed(42);
    (0..STEPS)
        .map(|_| {
            plan.inputs
                .iter()
                .map(|input| {
                    let n = input.ty.shape.n_elements();
                    let dims = input.ty.shape.dims().to_vec();
                    let tensor = match input.ty.dtype {
                        DType::I32 => Tensor::from_vec(dims, (0..n).map(|_| rng.i32(0..10)).collect::<Vec<i32>>()),
                        DType::U8 => Tensor::from_vec(dims, (0..n).map(|_| rng.u8(..)).collect::<Vec<u8>>()),
                        DType::F32 => {
                            Tensor::from_vec(dims, (0..n).map(|_| rng.f32() * 2.0 - 1.0).collect::<Vec<f32>>())
                        }
                        other => panic!("no test data for {other} inputs"),
                    };
                    (input.name.clone(), tensor)
                })
                .collect()
        })
        .collect()
}

/// The loss of each step, and the parameters after the last.
fn train(plan: &Plan, data: &[HashMap<String, Tensor>]) -> (Vec<f64>, BTreeMap<String, Vec<f64>>) {
    train_on(plan, data, dfc_driver::Backend::Interp)
}

/// `train` on `backend`.
fn train_on(
    plan: &Plan,
    data: &[HashMap<String, Tensor>],
    backend: dfc_driver::Backend,
) -> (Vec<f64>, BTreeMap<String, Vec<f64>>) {
    let (losses, session) = trained(plan, data, backend);
    let variables = session.variables().unwrap().iter().map(|(name, t)| (name.clone(), t.to_f64_vec())).collect();
    (losses, variables)
}

/// The loss of each step of `plan` on `data`, and the session that took them.
fn trained<'p>(
    plan: &'p Plan,
    data: &[HashMap<String, Tensor>],
    backend: dfc_driver::Backend,
) -> (Vec<f64>, Session<'p>) {
    let training = plan.training.as_ref().expect("examples train");
    let mut session = Session::with_backend(plan, 0, backend).expect("the plan loads");
    let updates: Vec<&str> = training.updates.iter().map(String::as_str).collect();
    let step = session.program(&[training.loss_node.as_str()], &updates).expect("a training step");
    let losses = data.iter().map(|feeds| session.run(&step, feeds).expect("a step runs")[0].scalar_f64()).collect();
    (losses, session)
}

fn close(a: f64, b: f64, tolerance: f64) -> bool {
    (a - b).abs() <= tolerance * (1.0 + a.abs().max(b.abs()))
}

fn assert_same(
    what: &str,
    reference: &(Vec<f64>, BTreeMap<String, Vec<f64>>),
    other: &(Vec<f64>, BTreeMap<String, Vec<f64>>),
    tolerance: f64,
) {
    assert_eq!(reference.0.len(), other.0.len(), "{what}: steps");
    for (step, (a, b)) in reference.0.iter().zip(&other.0).enumerate() {
        assert!(close(*a, *b, tolerance), "{what}: the loss of step {step} is {b}, single-device gives {a}");
    }
    let names = |m: &BTreeMap<String, Vec<f64>>| m.keys().cloned().collect::<Vec<_>>();
    assert_eq!(names(&reference.1), names(&other.1), "{what}: other variables");
    for (name, values) in &reference.1 {
        let theirs = &other.1[name];
        let worst = support::worst_difference(&format!("{what}: `{name}`"), theirs, values, support::relative);
        assert!(worst <= tolerance, "{what}: `{name}` differs from single-device by up to {worst:e}");
    }
}

fn check(example: &str) {
    let single = plan(example, Cluster::local(1, DeviceKind::Cpu), Strategy::Single);
    let data = batches(&single);
    let reference = train(&single, &data);
    assert!(reference.0.iter().all(|l| l.is_finite()), "{example}: losses {:?}", reference.0);

    let cases = [
        ("mirrored on 2 devices", Cluster::local(2, DeviceKind::Cpu), Strategy::Mirrored, 2),
        ("mirrored on 4 devices", Cluster::local(4, DeviceKind::Cpu), Strategy::Mirrored, 4),
        ("ps --sync, 2 workers and 2 ps", ps_cluster(2), Strategy::ParameterServer { sync: true }, 2),
        ("ps --sync, 4 workers and 2 ps", ps_cluster(4), Strategy::ParameterServer { sync: true }, 4),
        ("central storage on 2 devices", Cluster::local(2, DeviceKind::Cpu), Strategy::CentralStorage, 2),
    ];
    for (what, cluster, strategy, replicas) in cases {
        let plan = plan(example, cluster, strategy);
        assert_eq!(plan.strategy.replicas, replicas, "{example}, {what}");
        assert!(plan.partitions.len() > 1, "{example}, {what}: one partition");
        assert_fed_apart(&format!("{example}, {what}"), &plan);
        assert_same(&format!("{example}, {what}"), &reference, &train(&plan, &data), 1e-4);
    }

    // A replica alone does single's work: no all-reduce, the same numbers exactly.
    let alone = plan(example, Cluster::local(1, DeviceKind::Cpu), Strategy::Mirrored);
    assert_eq!(all_reduces(&alone), [0], "{example}, mirrored on 1 device");
    assert!(alone.split_inputs.is_empty(), "{example}, mirrored on 1 device: its inputs are the model's");
    assert_same(&format!("{example}, mirrored on 1 device"), &reference, &train(&alone, &data), 0.0);

    // Model parallelism moves tensors, not arithmetic: the same numbers exactly.
    let model = plan(example, Cluster::local(3, DeviceKind::Cpu), Strategy::Model);
    assert_same(&format!("{example}, model parallel on 3 devices"), &reference, &train(&model, &data), 0.0);
}

#[test]
fn linear_regression() {
    check("linear_regression");
}

#[test]
fn ridge_regression() {
    check("ridge_regression");
}

#[test]
fn softmax_regression() {
    check("softmax_regression");
}

#[test]
fn mlp() {
    check("mlp");
}

#[test]
fn cnn() {
    check("cnn");
}

#[test]
fn wide_and_deep() {
    check("wide_and_deep");
}

/// Asynchronous parameter servers apply each worker's gradient as it comes: not the
/// single-device numbers, but training still goes downhill.
#[test]
fn asynchronous_parameter_servers_train() {
    let async_plan = plan("linear_regression", ps_cluster(2), Strategy::ParameterServer { sync: false });
    assert!(!async_plan.strategy.sync);
    let data: Vec<HashMap<String, Tensor>> = batches(&async_plan).into_iter().cycle().take(30).collect();
    let (losses, _) = train(&async_plan, &data);
    assert!(losses.iter().all(|l| l.is_finite()));
    assert!(
        losses[27..].iter().sum::<f64>() < losses[..3].iter().sum::<f64>(),
        "async training does not learn: {losses:?}"
    );
}

/// Free-running replicas need workers that keep them apart: where every variable lives on a
/// parameter server, a replica computes nothing on another replica's worker, its updates'
/// constants included (Adam's bias correction shares its `1.0` with the loss's gradient, which
/// once drew the correction to worker 0 for every replica and stepped them in lockstep).
#[test]
fn asynchronous_replicas_compute_on_their_own_workers_and_the_servers() {
    for example in ["linear_regression", "mlp", "cnn", "softmax_regression", "resnet", "transformer", "two_towers"] {
        let plan = plan(example, ps_cluster(2), Strategy::ParameterServer { sync: false });
        let on_workers = plan.partitions.iter().filter(|p| p.device.job.as_deref() == Some("worker"));
        for partition in on_workers {
            let task = partition.device.task.expect("a worker task");
            let graph = &partition.module.graph;
            for id in graph.node_ids() {
                let node = graph.node(id);
                let Some(replica) = node.name.strip_prefix("replica_").and_then(|r| r.split('/').next()) else {
                    continue;
                };
                let received_or_copied = matches!(node.op, dfc_ir::Op::Recv { .. } | dfc_ir::Op::Const { .. });
                assert!(
                    replica == task.to_string() || received_or_copied,
                    "{example}: `{}` ({}) of replica {replica} on {}",
                    node.name,
                    node.op.name(),
                    partition.device
                );
            }
        }
    }
}

/// Staleness-aware asynchronous replicas (the default with SGD): each shared variable counts its
/// updates in `<name>/version`, and every replica names the node of its staleness. Stepped
/// together in one process, every replica reads the versions before any counts, so each
/// update's staleness is 1 and the run ends with the bits of the fixed rate's, the versions
/// having counted every replica's update of every variable.
#[test]
fn staleness_aware_replicas_stepped_together_train_as_the_fixed_rate() {
    let cluster = || ps_cluster(2);
    let aware = plan("linear_regression", cluster(), Strategy::ParameterServer { sync: false });
    assert!(aware.strategy.staleness_aware, "on by default with sgd");
    let options = CompileOptions {
        cluster: cluster(),
        strategy: Strategy::ParameterServer { sync: false },
        staleness_aware: Some(false),
        ..CompileOptions::default()
    };
    let fixed = plan_with("linear_regression", options);
    assert!(!fixed.strategy.staleness_aware && fixed.replicas.iter().all(|r| r.staleness.is_none()));
    let staleness: Vec<&str> = aware.replicas.iter().map(|r| r.staleness.as_deref().expect("named")).collect();
    assert_eq!(staleness, ["replica_0/w/staleness", "replica_1/w/staleness"]);

    let data: Vec<HashMap<String, Tensor>> = batches(&aware).into_iter().cycle().take(5).collect();
    let (aware_losses, aware_vars) = train(&aware, &data);
    let (fixed_losses, fixed_vars) = train(&fixed, &data);
    assert_eq!(aware_losses, fixed_losses);
    for (name, value) in &fixed_vars {
        assert_eq!(value, &aware_vars[name], "`{name}`");
    }
    for variable in ["w", "b"] {
        assert_eq!(aware_vars[&format!("{variable}/version")], [10.0], "two replicas' updates of 5 steps");
    }
}

/// An asynchronous plan names each replica's own inputs, loss and updates; one replica's step
/// run as its two stages (what waits on nothing computed from its own partition's values, then
/// the rest, on one rendezvous, as a parameter server serving free-running replicas runs it)
/// ends as the whole step does: the replica's partition computes its loss in the first stage,
/// from the variables the servers send in theirs, and the second applies the updates.
#[test]
fn a_replica_step_in_two_stages_ends_like_the_whole_step() {
    let plan = plan("mlp", ps_cluster(2), Strategy::ParameterServer { sync: false });
    assert_eq!(plan.replicas.len(), 2);
    let replica = &plan.replicas[1];
    assert_eq!(replica.device.to_string(), "/job:worker/task:1/cpu:0");
    let own = plan.replica_inputs(1);
    let names: Vec<&str> = own
        .iter()
        .map(|(input, node)| {
            assert_eq!(*node, format!("replica_1/{input}"));
            input.as_str()
        })
        .collect();
    assert_eq!(names, ["images", "labels"]);
    let updates: Vec<&str> = replica.updates.iter().map(String::as_str).collect();
    let whole_batch = batches(&plan).remove(0);
    let feeds = dfc_driver::replicas::node_feeds(&plan, &whole_batch).unwrap().into_owned();
    let fetches = [replica.loss_node.as_str()];

    let mut whole = Session::new(&plan, 0).unwrap();
    let program = whole.program(&fetches, &updates).unwrap();
    let rendezvous = dfc_interp::InProcessRendezvous::new();
    let loss = whole.run_with(&program, &feeds, &rendezvous).unwrap()[0].clone().expect("the loss");

    let mut staged = Session::new(&plan, 0).unwrap();
    let before = staged.program_stage(&fetches, &updates, Stage::BeforeRecvs).unwrap();
    let after = staged.program_stage(&fetches, &updates, Stage::AfterRecvs).unwrap();
    let rendezvous = dfc_interp::InProcessRendezvous::new();
    let first = staged.run_with(&before, &feeds, &rendezvous).unwrap();
    assert_eq!(first[0].as_ref().expect("the loss").to_f64_vec(), loss.to_f64_vec());
    let second = staged.run_with(&after, &feeds, &rendezvous).unwrap();
    assert!(second[0].is_none(), "the first stage's loss");
    let (a, b) = (whole.variables().unwrap(), staged.variables().unwrap());
    assert_eq!(a.len(), b.len());
    for (name, value) in a.iter() {
        assert_eq!(value.to_f64_vec(), b.get(name).unwrap().to_f64_vec(), "`{name}`");
    }
    // The step changed the variables (the stages did not just both skip the updates).
    let fresh = Session::new(&plan, 0).unwrap().variables().unwrap();
    assert!(fresh.iter().any(|(name, v)| v.to_f64_vec() != a.get(name).unwrap().to_f64_vec()));
}

/// Staleness divides a stale update: replica 0 reads the variables (its step's first stage),
/// replica 1 takes a whole step, then replica 0's gradient arrives. Its update is one step
/// late, τ = 2, so with SGD it moves each variable half as far as the fixed rate moves it from
/// the same place; replica 1's own update was fresh (τ = 1) and is the same in both.
#[test]
fn a_stale_update_moves_the_variables_by_its_gradient_over_its_staleness() {
    let compiled = |staleness_aware| {
        let options = CompileOptions {
            cluster: ps_cluster(2),
            strategy: Strategy::ParameterServer { sync: false },
            staleness_aware: Some(staleness_aware),
            ..CompileOptions::default()
        };
        plan_with("linear_regression", options)
    };
    let moves = |plan: &Plan| -> (BTreeMap<String, Vec<f64>>, BTreeMap<String, Vec<f64>>, Option<f64>) {
        let whole_batch = batches(plan).remove(0);
        let feeds = dfc_driver::replicas::node_feeds(plan, &whole_batch).unwrap().into_owned();
        let mut session = Session::new(plan, 0).unwrap();
        let step = |r: usize| {
            let replica = &plan.replicas[r];
            let mut fetches = vec![replica.loss_node.as_str()];
            fetches.extend(replica.staleness.as_deref());
            (fetches, replica.updates.iter().map(String::as_str).collect::<Vec<&str>>())
        };
        let (fetches0, updates0) = step(0);
        let (fetches1, updates1) = step(1);
        let before = session.program_stage(&fetches0, &updates0, Stage::BeforeRecvs).unwrap();
        let after = session.program_stage(&fetches0, &updates0, Stage::AfterRecvs).unwrap();
        let other = session.program(&fetches1, &updates1).unwrap();
        let stale = dfc_interp::InProcessRendezvous::new();
        session.run_with(&before, &feeds, &stale).unwrap();
        session.run_with(&other, &feeds, &dfc_interp::InProcessRendezvous::new()).unwrap();
        let snapshot = |s: &Session| -> BTreeMap<String, Vec<f64>> {
            s.variables().unwrap().iter().map(|(n, t)| (n.clone(), t.to_f64_vec())).collect()
        };
        let between = snapshot(&session);
        let fetched = session.run_with(&after, &feeds, &stale).unwrap();
        let tau = fetched.get(1).and_then(|t| t.as_ref()).map(|t| t.scalar_f64());
        (between, snapshot(&session), tau)
    };
    let (aware_between, aware_end, tau) = moves(&compiled(true));
    let (fixed_between, fixed_end, no_tau) = moves(&compiled(false));
    assert_eq!((tau, no_tau), (Some(2.0), None), "replica 0's update is one late");
    for name in ["w", "b"] {
        assert_eq!(aware_between[name], fixed_between[name], "`{name}` after replica 1's fresh step");
        for (i, ((start, aware), fixed)) in
            aware_between[name].iter().zip(&aware_end[name]).zip(&fixed_end[name]).enumerate()
        {
            let (aware_move, fixed_move) = (aware - start, fixed - start);
            assert!(fixed_move != 0.0, "`{name}`[{i}] moved");
            assert!(
                close(aware_move, fixed_move / 2.0, 1e-5),
                "`{name}`[{i}]: moved {aware_move}, fixed rate {fixed_move}"
            );
        }
    }
}

/// `--partition-min-bytes`: large variables are sharded over the parameter servers (at most one
/// shard per ps task), start from the slices of the unsharded value, and train the same.
#[test]
fn variables_above_a_size_are_partitioned_over_the_parameter_servers() {
    let single = plan("mlp", Cluster::local(1, DeviceKind::Cpu), Strategy::Single);
    let sharded = plan_with(
        "mlp",
        CompileOptions {
            cluster: ps_cluster(2),
            strategy: Strategy::ParameterServer { sync: true },
            partition_min_bytes: Some(100_000),
            ..CompileOptions::default()
        },
    );
    let spec = |name: &str| sharded.params.iter().find(|p| p.name == name).expect("a param");
    let w1 = spec("h1/w"); // 784 x 256 floats: 802,816 bytes
    assert_eq!(w1.partitions, 2);
    assert_eq!(w1.devices, ["/job:ps/task:0/cpu:0", "/job:ps/task:1/cpu:0"]);
    assert_eq!(spec("h1/b").partitions, 1, "a small variable stays whole");
    let data = batches(&single);
    let reference = train(&single, &data);
    let (losses, variables) = train(&sharded, &data);
    assert_eq!(reference.0.len(), losses.len(), "steps");
    for (step, (a, b)) in reference.0.iter().zip(&losses).enumerate() {
        assert!(close(*a, *b, 1e-4), "step {step}: {b} vs {a}");
    }
    // The shards, joined, are the single-device variable.
    let joined: Vec<f64> = ["h1/w/part_0", "h1/w/part_1"].iter().flat_map(|n| variables[*n].clone()).collect();
    let whole = &reference.1["h1/w"];
    assert_eq!(joined.len(), whole.len());
    assert!(joined.iter().zip(whole).all(|(a, b)| close(*a, *b, 1e-4)));
}

/// All-reduces in each partition of a plan.
/// Each replica is fed its own rows of every input on its own device: every plan input is
/// split among one `Input` node per replica, each in another partition, and no partition sends
/// an input's value on.
fn assert_fed_apart(what: &str, plan: &Plan) {
    let split: Vec<&str> = plan.split_inputs.iter().map(|s| s.input.as_str()).collect();
    let declared: Vec<&str> = plan.inputs.iter().map(|i| i.name.as_str()).collect();
    assert_eq!(split, declared, "{what}: the split inputs");
    let partition_of = |node: &str| {
        let holds = |p: &dfc_plan::Partition| p.module.graph.node_ids().any(|id| p.module.graph.node(id).name == node);
        plan.partitions.iter().position(holds).unwrap_or_else(|| panic!("{what}: no partition holds `{node}`"))
    };
    for input in &plan.split_inputs {
        assert_eq!(input.nodes.len(), plan.strategy.replicas as usize, "{what}: `{}`", input.input);
        let mut parts: Vec<usize> = input.nodes.iter().map(|n| partition_of(n)).collect();
        parts.sort();
        parts.dedup();
        assert_eq!(parts.len(), input.nodes.len(), "{what}: `{}`'s replicas share a partition", input.input);
    }
    for partition in &plan.partitions {
        let graph = &partition.module.graph;
        for id in graph.node_ids().filter(|&id| matches!(graph.node(id).op, dfc_ir::Op::Send { .. })) {
            let sent = graph.inputs(id)[0].node;
            assert!(
                !matches!(graph.node(sent).op, dfc_ir::Op::Input { .. }),
                "{what}: `{}` sends the input `{}` on",
                graph.node(id).name,
                graph.node(sent).name
            );
        }
    }
}

fn all_reduces(plan: &Plan) -> Vec<usize> {
    plan.partitions
        .iter()
        .map(|p| {
            let graph = &p.module.graph;
            graph.node_ids().filter(|&id| matches!(graph.node(id).op, dfc_ir::Op::AllReduce { .. })).count()
        })
        .collect()
}

fn mirrored(example: &str, devices: usize, threshold_bytes: usize) -> Plan {
    plan_with(
        example,
        CompileOptions {
            cluster: Cluster::local(devices, DeviceKind::Cpu),
            strategy: Strategy::Mirrored,
            fusion: dfc_passes::FusionOptions { threshold_bytes },
            ..CompileOptions::default()
        },
    )
}

/// Tensor fusion (Horovod's): the MLP's six gradients share one all-reduce per replica under the
/// default 64 MiB threshold, none with threshold 0, and a threshold below the first layer's
/// weights (784×256 f32, 802,816 bytes) leaves that one alone; fused plans verify and train to
/// the same bits as unfused ones.
#[test]
fn tensor_fusion_packs_small_gradients_into_shared_all_reduces() {
    assert_eq!(all_reduces(&mirrored("mlp", 2, 64 << 20)), [1, 1]);
    assert_eq!(all_reduces(&mirrored("mlp", 2, 0)), [6, 6]);
    assert_eq!(all_reduces(&mirrored("mlp", 2, 300_000)), [2, 2]);
    for example in ["mlp", "linear_regression", "wide_and_deep"] {
        for devices in [2, 4] {
            let fused = mirrored(example, devices, 64 << 20);
            let unfused = mirrored(example, devices, 0);
            assert!(all_reduces(&fused)[0] < all_reduces(&unfused)[0], "{example} on {devices}: nothing fused");
            let parts: Vec<(&dfc_ir::DeviceSpec, &dfc_ir::Module)> =
                fused.partitions.iter().map(|p| (&p.device, &p.module)).collect();
            assert!(dfc_ir::verify_partitions(&parts).is_empty(), "{example} on {devices}");
            for p in &fused.partitions {
                let problems = dfc_ir::verify(&p.module, dfc_ir::VerifyOptions::default());
                assert!(problems.is_empty(), "{example} on {devices}: {problems:?}");
            }
            let data = batches(&fused);
            let (a, b) = (train(&unfused, &data), train(&fused, &data));
            assert_eq!(a, b, "{example} on {devices}: fusion changed the arithmetic");
        }
    }
}

/// All-reduces overlapped with the backward pass (`--overlap`) sum the same values, only
/// sooner: on the native back end, whose programs run them on a thread of their own, every
/// example trains to the same bits as without overlap, with the same buckets, on 2 and 4
/// devices (4: replicas 2 and 3 instances of replica 1).
#[test]
fn overlapped_all_reduces_train_to_the_same_bits() {
    let threshold_bytes = dfc_passes::FusionOptions::overlapped().threshold_bytes;
    for example in ["mlp", "cnn", "wide_and_deep"] {
        for devices in [2, 4] {
            let options = |overlap| CompileOptions {
                cluster: Cluster::local(devices, DeviceKind::Cpu),
                strategy: Strategy::Mirrored,
                fusion: dfc_passes::FusionOptions { threshold_bytes },
                overlap,
                ..CompileOptions::default()
            };
            let (plain, overlapped) = (plan_with(example, options(false)), plan_with(example, options(true)));
            assert!(overlapped.strategy.overlap && !plain.strategy.overlap);
            assert!(all_reduces(&overlapped)[0] >= 2, "{example} on {devices}: one bucket leaves nothing to overlap");
            let data = batches(&plain);
            let native = |plan: &Plan| train_on(plan, &data, dfc_driver::Backend::Llvm);
            assert_eq!(native(&plain), native(&overlapped), "{example} on {devices}: overlap changed the arithmetic");
        }
    }
}

/// The bytes a device's partitions send (`sent`) or receive per step: the sizes of the tensors
/// of their `Send`s or `Recv`s.
fn bytes_exchanged(plan: &Plan, device_prefix: &str, sent: bool) -> usize {
    let mut bytes = 0;
    for p in plan.partitions.iter().filter(|p| p.device.to_string().starts_with(device_prefix)) {
        let graph = &p.module.graph;
        for id in graph.node_ids() {
            bytes += match graph.node(id).op {
                dfc_ir::Op::Send { .. } if sent => graph.ty(graph.inputs(id)[0]).size_in_bytes(),
                dfc_ir::Op::Recv { .. } if !sent => graph.node(id).outputs[0].size_in_bytes(),
                _ => 0,
            };
        }
    }
    bytes
}

/// Embedding gradients travel as the rows a step touches (TensorFlow's IndexedSlices): the
/// lookups of wide_and_deep's 100,000 × 32 table, whole or in 4 shards on the parameter servers,
/// live with the table, and so do their gradients' scatters. A worker sends its ids, the
/// gradient of the 256 rows it looked up and the small layers' gradients, never the 12.8 MB
/// table's dense gradient (nor receives the table). `wide_and_deep()` checks that they train
/// as one device does.
#[test]
fn embedding_gradients_reach_the_parameter_servers_as_rows() {
    let source = std::fs::read_to_string(root().join("examples/wide_and_deep.df")).expect("example");
    let whole = source.replace("@partitioned(4)", "");
    for (label, source) in [("partitioned", &source), ("whole", &whole)] {
        for sync in [true, false] {
            let options = CompileOptions {
                cluster: ps_cluster(2),
                strategy: Strategy::ParameterServer { sync },
                ..CompileOptions::default()
            };
            let plan = compile(source, "wide_and_deep.df", &options).expect("compiles").plan;
            for worker in ["/job:worker/task:0", "/job:worker/task:1"] {
                let (sent, received) = (bytes_exchanged(&plan, worker, true), bytes_exchanged(&plan, worker, false));
                assert!(sent < 200_000, "{label}, sync {sync}: {worker} sends {sent} bytes a step");
                assert!(received < 200_000, "{label}, sync {sync}: {worker} receives {received} bytes a step");
            }
        }
    }
    // Mirrored, the replicas all-gather the rows and their ids (an all-reduce of one slot per
    // replica), not the table: 256 rows of 32 floats and 256 ids, whatever the replicas.
    for devices in [2, 4] {
        let options = CompileOptions {
            cluster: Cluster::local(devices, DeviceKind::Cpu),
            strategy: Strategy::Mirrored,
            soft_placement: true,
            ..CompileOptions::default()
        };
        let mut plan = compile(&whole, "wide_and_deep.df", &options).expect("compiles").plan;
        plan.expand_instances().expect("replica instances build");
        for p in &plan.partitions {
            let graph = &p.module.graph;
            let reduced: usize = graph
                .node_ids()
                .filter(|&id| matches!(graph.node(id).op, dfc_ir::Op::AllReduce { .. }))
                .map(|id| graph.node(id).outputs[0].size_in_bytes())
                .sum();
            assert!(reduced < 200_000, "mirrored on {devices}: {} all-reduces {reduced} bytes a step", p.device);
        }
    }
}

/// A model with a batch norm between two layers, its statistics synchronised or not.
fn batch_norm_model(synchronized: bool) -> String {
    format!(
        "model bn {{\n    dim batch = 8\n    input x: f32[batch, 3]\n    input y: f32[batch]\n    \
         param w: f32[3, 4] = glorot_uniform\n    param v: f32[4, 1] = glorot_uniform\n    \
         let h = relu(batch_norm(x @ w, momentum = 0.5, synchronized = {synchronized}))\n    \
         let p = reshape(h @ v, [batch])\n    let loss = mean((p - y) * (p - y))\n    \
         minimize loss with sgd(lr = 0.1)\n}}\n"
    )
}

fn compiled(source: &str, cluster: Cluster, strategy: Strategy) -> Result<Plan, String> {
    let options = CompileOptions { cluster, strategy, ..CompileOptions::default() };
    match compile(source, "bn.df", &options) {
        Ok(compiled) => {
            let mut plan = compiled.plan;
            plan.expand_instances().expect("replica instances build");
            Ok(plan)
        }
        Err(e) => Err(format!("{e:?}")),
    }
}

/// Synchronised batch statistics (`batch_norm(..., synchronized = true)`): mirrored on 2 and 4
/// devices (replicas 2 and 3 instances of 1) and on synchronous parameter servers, the replicas
/// all-reduce each batch's mean and variance, so training is single-device training on the whole
/// batch: the same losses, weights and moving averages. With per-replica statistics (the
/// default) each replica normalises its own quarter or half, and the losses differ. Asynchronous
/// replicas cannot share statistics: refused with a message.
#[test]
fn synchronised_batch_norm_trains_as_one_device_on_the_whole_batch() {
    let synced = batch_norm_model(true);
    let single = compiled(&synced, Cluster::local(1, DeviceKind::Cpu), Strategy::Single).expect("compiles");
    let data = batches(&single);
    let reference = train(&single, &data);
    let cases = [
        ("mirrored on 2", Cluster::local(2, DeviceKind::Cpu), Strategy::Mirrored),
        ("mirrored on 4", Cluster::local(4, DeviceKind::Cpu), Strategy::Mirrored),
        ("sync ps", ps_cluster(2), Strategy::ParameterServer { sync: true }),
    ];
    for (what, cluster, strategy) in cases {
        let plan = compiled(&synced, cluster, strategy).expect("compiles");
        assert_same(what, &reference, &train(&plan, &data), 1e-5);
    }

    let per_replica = compiled(&batch_norm_model(false), Cluster::local(2, DeviceKind::Cpu), Strategy::Mirrored);
    let (losses, _) = train(&per_replica.expect("compiles"), &data);
    assert!(!close(losses[0], reference.0[0], 1e-3), "per-replica statistics: {losses:?} against {:?}", reference.0);

    let refused = compiled(&synced, ps_cluster(2), Strategy::ParameterServer { sync: false }).expect_err("refused");
    assert!(refused.contains("asynchronous replicas do not step together"), "{refused}");
    let options = CompileOptions {
        cluster: ps_cluster(4),
        strategy: Strategy::ParameterServer { sync: true },
        backup_workers: 1,
        ..CompileOptions::default()
    };
    let refused = match compile(&synced, "bn.df", &options) {
        Err(e) => format!("{e:?}"),
        Ok(_) => panic!("synchronised statistics with backup workers compiled"),
    };
    assert!(refused.contains("replicas with backup workers do not step together"), "{refused}");
}

/// One example per replica: where a param's gradient is a fed tensor itself (`x + w` in a loss
/// of `mean((x + w) * t)` over one example is `t`), the replicas still average it, and train as
/// one device on the whole batch.
#[test]
fn replicas_of_one_example_each_average_their_gradients() {
    for replicas in [2, 4] {
        let source = format!(
            "model one {{\n    dim batch = {replicas}\n    input x: f32[batch]\n    input t: f32[batch]\n    \
             param w: f32[1] = uniform(-1, 1)\n    minimize mean((x + w) * t) with sgd(lr = 0.5)\n}}\n"
        );
        let single = compiled(&source, Cluster::local(1, DeviceKind::Cpu), Strategy::Single).expect("compiles");
        let data = batches(&single);
        let reference = train(&single, &data);
        let what = format!("mirrored on {replicas}, one example each");
        let mirrored = compiled(&source, Cluster::local(replicas, DeviceKind::Cpu), Strategy::Mirrored);
        let plan = mirrored.expect("compiles");
        assert_same(&what, &reference, &train(&plan, &data), 1e-6);
        let copies: Vec<Vec<f64>> = Session::new(&plan, 0)
            .map(|mut session| {
                let training = plan.training.as_ref().unwrap();
                let updates: Vec<&str> = training.updates.iter().map(String::as_str).collect();
                let step = session.program(&[training.loss_node.as_str()], &updates).unwrap();
                for feeds in &data {
                    session.run(&step, feeds).unwrap();
                }
                session.all_variables().unwrap().iter().map(|(_, t)| t.to_f64_vec()).collect()
            })
            .expect("the plan loads");
        assert!(copies.windows(2).all(|pair| pair[0] == pair[1]), "{what}: the replicas' copies differ: {copies:?}");
    }
}

/// A synchronised batch norm whose output nothing uses still moves its moving averages in each
/// training step, by the whole batch's statistics as on one device: mirrored on 2 and 4 and on
/// synchronous parameter servers (where only updates use its statistics, which the replicas
/// compute from their slices). Unsynchronised, it compiles and trains there too.
#[test]
fn an_unused_batch_norm_moves_its_averages_as_on_one_device() {
    let model = |synchronized: bool| {
        format!(
            "model bn {{\n    dim batch = 8\n    input x: f32[batch, 3]\n    input y: f32[batch]\n    \
             param w: f32[3, 1] = glorot_uniform\n    \
             let unused = batch_norm(x, momentum = 0.5, synchronized = {synchronized})\n    \
             let p = reshape(x @ w, [batch])\n    minimize mean((p - y) * (p - y)) with sgd(lr = 0.1)\n}}\n"
        )
    };
    let single = compiled(&model(true), Cluster::local(1, DeviceKind::Cpu), Strategy::Single).expect("compiles");
    let data = batches(&single);
    let reference = train(&single, &data);
    let averages: Vec<&String> = reference.1.keys().filter(|name| name.contains("moving")).collect();
    assert!(!averages.is_empty(), "no moving averages among {:?}", reference.1.keys());
    for name in averages {
        assert!(reference.1[name].iter().any(|&v| v != 0.0 && v != 1.0), "`{name}` did not move");
    }
    let cases = [
        ("mirrored on 2", Cluster::local(2, DeviceKind::Cpu), Strategy::Mirrored),
        ("mirrored on 4", Cluster::local(4, DeviceKind::Cpu), Strategy::Mirrored),
        ("sync ps", ps_cluster(2), Strategy::ParameterServer { sync: true }),
    ];
    for (what, cluster, strategy) in cases {
        let plan = compiled(&model(true), cluster, strategy).expect("compiles");
        assert_same(what, &reference, &train(&plan, &data), 1e-5);
    }
    let unsynchronised = compiled(&model(false), ps_cluster(2), Strategy::ParameterServer { sync: true });
    let (losses, _) = train(&unsynchronised.expect("compiles"), &data);
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
}

/// The loss of each step and the parameters at the end of local SGD: each step, then the
/// replicas' averages after every `every` steps; also whether the replicas' copies of the
/// parameters were all equal at the end.
fn train_local(
    plan: &Plan,
    data: &[HashMap<String, Tensor>],
    every: usize,
) -> ((Vec<f64>, BTreeMap<String, Vec<f64>>), bool) {
    let training = plan.training.as_ref().expect("examples train");
    let mut session = Session::new(plan, 0).expect("the plan loads");
    let updates: Vec<&str> = training.updates.iter().map(String::as_str).collect();
    let averages: Vec<&str> = training.averages.iter().map(String::as_str).collect();
    let step = session.program(&[training.loss_node.as_str()], &updates).expect("a training step");
    let average = session.program(&[], &averages).expect("the averages");
    let mut losses = Vec::new();
    for (i, feeds) in data.iter().enumerate() {
        losses.push(session.run(&step, feeds).expect("a step runs")[0].scalar_f64());
        if (i + 1) % every == 0 {
            session.run(&average, &HashMap::new()).expect("an average runs");
        }
    }
    let variables = session.variables().unwrap().iter().map(|(name, t)| (name.clone(), t.to_f64_vec())).collect();
    let all = session.all_variables().unwrap();
    let mut same = true;
    for (name, copy) in all.iter() {
        if let Some(original) = name.strip_prefix("replica_").and_then(|rest| rest.split_once('/')).map(|(_, n)| n) {
            same &= all.get(original).is_some_and(|t| t == copy);
        }
    }
    ((losses, variables), same)
}

/// Local SGD (`--sync-every`): a step runs no all-reduce, the average one (the replicas'
/// variables fused into one bucket); with plain SGD and an average after every step, the mean
/// of the replicas' own updates is the update by their mean gradient, so the run ends as
/// mirrored does, on 2 and 4 replicas; between averages the replicas part ways.
#[test]
fn local_sgd_averaging_every_step_trains_as_mirrored() {
    for devices in [2, 4] {
        let cluster = || Cluster::local(devices, DeviceKind::Cpu);
        let mirrored = plan("mlp", cluster(), Strategy::Mirrored);
        let options = CompileOptions {
            cluster: cluster(),
            strategy: Strategy::Mirrored,
            sync_every: Some(1),
            ..CompileOptions::default()
        };
        let local = plan_with("mlp", options);
        let training = local.training.as_ref().unwrap();
        let mut step_roots = vec![training.loss_node.as_str()];
        step_roots.extend(training.updates.iter().map(String::as_str));
        let averages: Vec<&str> = training.averages.iter().map(String::as_str).collect();
        assert_eq!(dfc_driver::session::all_reduce_keys(&local, &step_roots).unwrap().len(), 0, "a local step");
        assert_eq!(dfc_driver::session::all_reduce_keys(&local, &averages).unwrap().len(), 1, "an average");
        assert_eq!(averages.len(), 6 * devices, "each replica's copy of each parameter");

        let data = batches(&mirrored);
        let (reference, (averaged, same)) = (train(&mirrored, &data), train_local(&local, &data, 1));
        assert!(same, "{devices} replicas: the copies differ after an average");
        assert_same(&format!("local SGD on {devices}"), &reference, &averaged, 1e-5);
        let (_, same) = train_local(&local, &data, usize::MAX);
        assert!(!same, "{devices} replicas: without averages the replicas' copies stay equal");
    }
}

/// Replicas that would meet in their all-reduces in different orders deadlock, as Horovod's
/// ranks do when they submit tensors in different orders: a plan whose second replica's two
/// synchronised statistics swap keys (its mean all-reduced under the variance's key and the
/// other way round) is refused before any step, naming the all-reduces and where the model
/// makes them.
#[test]
fn replicas_that_all_reduce_in_different_orders_are_refused() {
    let mut plan =
        compiled(&batch_norm_model(true), Cluster::local(2, DeviceKind::Cpu), Strategy::Mirrored).expect("compiles");
    let module = &mut plan.partitions[1].module;
    let graph = &module.graph;
    let reductions: Vec<dfc_ir::NodeId> = graph
        .node_ids()
        .filter(
            |&id| matches!(&graph.node(id).op, dfc_ir::Op::AllReduce { key, .. } if key.starts_with("cross_replica/")),
        )
        .collect();
    let (first, second) = reductions
        .iter()
        .flat_map(|&a| reductions.iter().map(move |&b| (a, b)))
        .find(|&(a, b)| a != b && graph.ancestors(&[b]).contains(&a) && graph.node(a).outputs == graph.node(b).outputs)
        .expect("one statistic all-reduced after another of its type");
    let key = |id| match &module.graph.node(id).op {
        dfc_ir::Op::AllReduce { key, .. } => key.clone(),
        _ => unreachable!(),
    };
    let (a, b) = (key(first), key(second));
    for (id, key) in [(first, b.clone()), (second, a.clone())] {
        if let dfc_ir::Op::AllReduce { key: k, .. } = &mut module.graph.node_mut(id).op {
            *k = key;
        }
    }
    let error = Session::new(&plan, 0).err().expect("the crossed plan is refused").to_string();
    assert!(error.contains("would wait for each other forever") && error.contains(&a) && error.contains(&b), "{error}");
    assert!(
        error.contains(&format!("`{a}` (node `")) && error.contains("of bn.df)"),
        "where the model makes them: {error}"
    );
}

const MOMENTUM: &str = "momentum(lr = 0.1, momentum = 0.9)";

/// The MLP with `batch` and `optimizer`, compiled for `cluster` under `strategy`.
fn mlp_with(optimizer: &str, cluster: Cluster, strategy: Strategy, batch: i64, backup_workers: u32) -> Plan {
    let source = std::fs::read_to_string(root().join("examples/mlp.df")).expect("example");
    let optimizer = dfc_sema::check_optimizer(optimizer).expect("an optimizer");
    let options = CompileOptions {
        sema: dfc_sema::Options { dims: vec![("batch".into(), batch)], optimizer: Some(optimizer) },
        cluster,
        strategy,
        backup_workers,
        ..CompileOptions::default()
    };
    let compiled = compile(&source, "mlp.df", &options).unwrap_or_else(|e| panic!("does not compile: {e:?}"));
    compiled.plan
}

/// Backup workers (3 + 1): all four replicas read the variables (their steps' first stages),
/// then their gradients arrive in order. The first three are taken and the third applies their
/// mean, which is the step one device takes on those three replicas' rows; the fourth was
/// computed from the values before that update and is dropped. With momentum and with Adam,
/// whose slots (and Adam's step) must not move until an update is complete, this shows every
/// assignment is gated. A second round, all four fresh again, applies once more.
#[test]
fn backup_workers_apply_the_first_gradients_and_drop_the_late_one() {
    for backend in [dfc_driver::Backend::Interp, dfc_driver::Backend::Llvm] {
        backup_workers_on(MOMENTUM, backend);
    }
    backup_workers_on("adam(lr = 0.01)", dfc_driver::Backend::Llvm);
}

fn backup_workers_on(optimizer: &str, backend: dfc_driver::Backend) {
    let sync = Strategy::ParameterServer { sync: true };
    let plan = mlp_with(optimizer, ps_cluster(4), sync, 16, 1);
    assert_eq!(plan.strategy.backup_workers, 1);
    assert_eq!(plan.replicas.len(), 4);
    let whole_batch = batches(&plan).remove(0);
    let feeds = dfc_driver::replicas::node_feeds(&plan, &whole_batch).unwrap().into_owned();
    let mut session = Session::with_backend(&plan, 0, backend).unwrap();
    let stages: Vec<_> = plan
        .replicas
        .iter()
        .map(|replica| {
            let updates: Vec<&str> = replica.updates.iter().map(String::as_str).collect();
            let backup = replica.backup.as_ref().expect("backup workers report");
            let fetches = [replica.loss_node.as_str(), &backup.accepted, &backup.applied];
            let before = session.program_stage(&fetches, &updates, Stage::BeforeRecvs).unwrap();
            let after = session.program_stage(&fetches, &updates, Stage::AfterRecvs).unwrap();
            (before, after)
        })
        .collect();
    let round = |session: &mut Session| -> Vec<(f64, f64)> {
        let rendezvous: Vec<_> = stages.iter().map(|_| dfc_interp::InProcessRendezvous::new()).collect();
        for ((before, _), rendezvous) in stages.iter().zip(&rendezvous) {
            session.run_with(before, &feeds, rendezvous).unwrap();
        }
        let mut reports = Vec::new();
        for ((_, after), rendezvous) in stages.iter().zip(&rendezvous) {
            let out = session.run_with(after, &feeds, rendezvous).unwrap();
            let value = |i: usize| out[i].as_ref().expect("reported").scalar_f64();
            reports.push((value(1), value(2)));
        }
        reports
    };
    assert_eq!(round(&mut session), [(1.0, 0.0), (1.0, 0.0), (1.0, 1.0), (0.0, 0.0)], "(taken, applied) per replica");
    let after_one = session.variables().unwrap();

    // One device on the first three replicas' rows (4 each) takes the same step.
    let single = mlp_with(optimizer, Cluster::local(1, DeviceKind::Cpu), Strategy::Single, 12, 0);
    let rows: HashMap<String, Tensor> = whole_batch
        .iter()
        .map(|(name, t)| {
            let mut size = t.shape.dims().to_vec();
            size[0] = 12;
            let begin = vec![0; size.len()];
            (name.clone(), dfc_interp::eval(&dfc_ir::Op::Slice { begin, size }, &[t]).unwrap())
        })
        .collect();
    let (_, reference) = train(&single, &[rows]);
    for (name, expected) in &reference {
        let got = after_one.get(name).unwrap_or_else(|| panic!("no `{name}`")).to_f64_vec();
        let worst = support::worst_difference(name, &got, expected, support::relative);
        // Adam's first step is about lr·sign(g): summed in another order, a gradient near 0
        // moves it more than the sum moves.
        let tolerance = if optimizer.starts_with("adam") { 1e-4 } else { 1e-5 };
        assert!(
            worst <= tolerance,
            "{optimizer} on {backend:?}: `{name}` differs from one device's step by up to {worst:e}"
        );
    }
    for variable in ["h1/w", "logits/b"] {
        assert_eq!(after_one.get(&format!("{variable}/version")).unwrap().to_f64_vec(), [1.0]);
        assert_eq!(after_one.get(&format!("{variable}/accumulated")).unwrap().to_f64_vec(), [0.0]);
        let emptied = after_one.get(&format!("{variable}/accumulator")).unwrap().to_f64_vec();
        assert!(emptied.iter().all(|&x| x == 0.0), "`{variable}`'s accumulator is emptied by the update");
    }

    // All read version 1 now: the first three are taken again, the fourth dropped.
    assert_eq!(round(&mut session), [(1.0, 0.0), (1.0, 0.0), (1.0, 1.0), (0.0, 0.0)]);
    let after_two = session.variables().unwrap();
    assert_eq!(after_two.get("h1/w/version").unwrap().to_f64_vec(), [2.0]);
    assert_ne!(after_two.get("h1/w").unwrap().to_f64_vec(), after_one.get("h1/w").unwrap().to_f64_vec());
}

/// `plan` changed by `change`, written and read back: refused as invalid, saying `expected`.
fn refused_when_read(plan: &Plan, change: &dyn Fn(&mut Plan), expected: &str) {
    let mut plan = plan.clone();
    change(&mut plan);
    match dfc_plan::decode(&dfc_plan::encode(&plan)) {
        Err(dfc_plan::PlanError::Invalid(message)) => assert!(message.contains(expected), "{message}"),
        other => panic!("expected a refusal saying {expected:?}, got {:?}", other.map(|_| "a plan")),
    }
}

/// A backup-worker plan whose replicas' reports do not match its strategy is refused when read.
#[test]
fn backup_plans_whose_reports_do_not_fit_are_refused() {
    let plan = mlp_with(MOMENTUM, ps_cluster(3), Strategy::ParameterServer { sync: true }, 12, 1);
    let refused = |change: &dyn Fn(&mut Plan), expected: &str| refused_when_read(&plan, change, expected);
    dfc_plan::decode(&dfc_plan::encode(&plan)).expect("the plan as compiled reads back");
    refused(&|plan| plan.strategy.backup_workers = 0, "reports dropped gradients, but the plan has no backup workers");
    refused(&|plan| plan.replicas[2].backup = None, "does not report its dropped gradients");
    refused(&|plan| plan.strategy.backup_workers = 3, "keeps 3 of its 3 replicas as backups");
    refused(&|plan| plan.strategy.sync = false, "and asynchronous updates");
    refused(
        &|plan| plan.replicas[1].backup.as_mut().unwrap().version = "h1/w".into(),
        "`h1/w` is not a node with a scalar",
    );
    refused(&|plan| plan.replicas[0].backup.as_mut().unwrap().applied = "nowhere".into(), "`nowhere` is not a node");
}

/// A plan whose split inputs do not fit its replicas is refused when read, and says how.
#[test]
fn plans_whose_split_inputs_do_not_fit_are_refused() {
    let plan = plan("mlp", Cluster::local(2, DeviceKind::Cpu), Strategy::Mirrored);
    let refused = |change: &dyn Fn(&mut Plan), expected: &str| refused_when_read(&plan, change, expected);
    dfc_plan::decode(&dfc_plan::encode(&plan)).expect("the plan as compiled reads back");
    refused(&|plan| plan.split_inputs[0].input = "pixels".into(), "the replicas' input `pixels` is not one");
    refused(&|plan| plan.split_inputs[1].input = "images".into(), "`images` is split among the replicas twice");
    let one_short = |plan: &mut Plan| {
        plan.split_inputs[0].nodes.pop();
    };
    refused(&one_short, "split among 1 nodes, but the strategy has 2");
    refused(&|plan| plan.split_inputs[0].nodes[1] = "replica_0/images".into(), "`replica_0/images` is fed twice");
    refused(&|plan| plan.split_inputs[0].nodes[1] = "h1/w".into(), "`h1/w` names no input node");
    refused(
        &|plan| plan.split_inputs[0].nodes[0] = "replica_0/labels".into(),
        "takes i32[8], not its share of `images`",
    );
    refused(&|plan| plan.split_inputs.clear(), "input `images` names no input node");
    refused(&|plan| plan.strategy.replicas = 4, "split among 2 nodes, but the strategy has 4");
}

/// Backup workers are refused where they cannot apply, with the reason.
#[test]
fn backup_workers_are_refused_without_a_synchronous_parameter_server_or_enough_workers() {
    let source = std::fs::read_to_string(root().join("examples/mlp.df")).expect("example");
    let refused = |strategy, cluster, backup_workers| {
        let options = CompileOptions { cluster, strategy, backup_workers, ..CompileOptions::default() };
        match compile(&source, "mlp.df", &options) {
            Err(dfc_compile::CompileError::Usage(message)) => message,
            Err(other) => panic!("{other:?}"),
            Ok(_) => panic!("compiled"),
        }
    };
    let asynchronous = refused(Strategy::ParameterServer { sync: false }, ps_cluster(2), 1);
    assert!(asynchronous.contains("strategy is ps without --sync; use --strategy ps --sync"), "{asynchronous}");
    let mirrored = refused(Strategy::Mirrored, Cluster::local(2, DeviceKind::Cpu), 1);
    assert!(mirrored.contains("the strategy is mirrored"), "{mirrored}");
    let all = refused(Strategy::ParameterServer { sync: true }, ps_cluster(2), 2);
    assert!(all.contains("2 backup workers leave none of the 2 replicas"), "{all}");
}

/// The optimizer state each partition of `plan` keeps (`dfc inspect`'s: slots beside a
/// trainable variable), in bytes.
fn optimizer_state_bytes(plan: &Plan) -> Vec<u64> {
    dfc_plan::summary(plan).devices.iter().map(|d| d.optimizer_state_bytes).collect()
}

/// ZeRO stage 1 (`--shard-optimizer`): each of N mirrored replicas keeps 1/N of each dense
/// variable's optimizer state and updates 1/N of it, and the replicas gather the new values.
/// Each element's arithmetic is plain mirrored's, so every example trains to the same bits,
/// with optimizers that keep slots (and clipping, and weight decay, which read the shard),
/// on 2, 3 (shards padded) and 4 devices (replicas 2 and 3 instances of replica 1), on the
/// interpreter and on native code; each replica's state is 1/N of mirrored's, to the padding.
/// Embeddings' gradients (rows, not dense tensors) keep mirrored's update.
#[test]
fn a_sharded_optimizer_trains_as_mirrored_with_a_share_of_its_state() {
    let optimizers = [
        "adam(lr = 0.01, weight_decay = 0.01, clip_global_norm = 1.0)",
        "momentum(lr = 0.1, momentum = 0.9, nesterov = true)",
        "rmsprop(lr = 0.01, momentum = 0.5)",
        "adagrad(lr = 0.1)",
    ];
    let cases = [("mlp", 2, 0), ("mlp", 3, 1), ("mlp", 4, 2), ("mlp", 4, 3), ("cnn", 2, 0), ("wide_and_deep", 4, 0)];
    for (example, devices, which) in cases {
        let optimizer = dfc_sema::check_optimizer(optimizers[which]).expect("an optimizer");
        let mut dims = dims(example);
        if devices == 3 {
            dims.retain(|(name, _)| name != "batch");
            dims.push(("batch".into(), 12));
        }
        let options = |shard_optimizer| CompileOptions {
            sema: dfc_sema::Options { dims: dims.clone(), optimizer: Some(optimizer.clone()) },
            cluster: Cluster::local(devices, DeviceKind::Cpu),
            strategy: Strategy::Mirrored,
            shard_optimizer,
            soft_placement: true,
            ..CompileOptions::default()
        };
        let source = std::fs::read_to_string(root().join("examples").join(format!("{example}.df"))).unwrap();
        let build = |shard| {
            let compiled = compile(&source, "example.df", &options(shard));
            let mut plan = compiled.unwrap_or_else(|e| panic!("{example} on {devices}: {e:?}")).plan;
            plan.expand_instances().expect("replica instances build");
            plan
        };
        let (mirrored, sharded) = (build(false), build(true));
        let what = format!("{example} with {} on {devices}", optimizers[which]);
        if example == "mlp" {
            // The gradients in one bucket, the new values in another (a level below).
            assert_eq!(all_reduces(&sharded), vec![2; devices], "{what}");
        }
        let (whole, shares) = (optimizer_state_bytes(&mirrored), optimizer_state_bytes(&sharded));
        assert!(shares.iter().all(|&s| s == shares[0]) && shares[0] > 0, "{what}: {shares:?}");
        if example != "wide_and_deep" {
            let spread = (shares[0] * devices as u64) as f64 / whole[0] as f64;
            assert!((0.99..1.01).contains(&spread), "{what}: state {shares:?} per replica, {whole:?} mirrored");
        } else {
            assert!(shares[0] < whole[0], "{what}: state {shares:?} per replica, {whole:?} mirrored");
        }
        let data = batches(&mirrored);
        let backends: &[dfc_driver::Backend] = match example {
            "mlp" => &[dfc_driver::Backend::Interp, dfc_driver::Backend::Llvm],
            _ => &[dfc_driver::Backend::Interp],
        };
        for &backend in backends {
            let (a, b) = (train_whole(&mirrored, &data, backend), train_whole(&sharded, &data, backend));
            assert_eq!(a.0, b.0, "{what} on {backend:?}: the losses");
            assert_eq!(a.1.keys().collect::<Vec<_>>(), b.1.keys().collect::<Vec<_>>(), "{what}: the variables");
            for (name, values) in &a.1 {
                // A sharded slot is whole in a checkpoint, flat and padded (with what the update
                // makes of its initial value where the gradient is zero).
                let kept = &b.1[name][..values.len().min(b.1[name].len())];
                assert_eq!(values, kept, "{what} on {backend:?}: `{name}`");
            }
        }
    }
}

/// The loss of each step on `backend`, and the variables a checkpoint would then hold (each
/// partitioned or sharded variable whole).
fn train_whole(
    plan: &Plan,
    data: &[HashMap<String, Tensor>],
    backend: dfc_driver::Backend,
) -> (Vec<f64>, BTreeMap<String, Vec<f64>>) {
    let (losses, session) = trained(plan, data, backend);
    let variables = session.variables().unwrap();
    let whole = dfc_driver::checkpoint::whole_variables(plan, &variables);
    (losses, whole.into_iter().map(|(name, t)| (name, t.to_f64_vec())).collect())
}

/// A pipeline (`--strategy model --micro-batches M`, GPipe): each device a stage of the
/// model, the batch in M micro-batches whose gradients are averaged into one update, trains
/// as one device does on the whole batch, within float tolerance (the micro-batches' means are
/// summed in another order); on the interpreter and native code. Every device holds a stage:
/// compute and variables of its own.
#[test]
fn a_pipeline_of_micro_batches_trains_as_one_device() {
    for (example, devices, micro_batches) in [("mlp", 2, 4), ("mlp", 3, 2), ("cnn", 2, 2), ("linear_regression", 2, 4)]
    {
        let single = plan(example, Cluster::local(1, DeviceKind::Cpu), Strategy::Single);
        let data = batches(&single);
        let options = CompileOptions {
            cluster: Cluster::local(devices, DeviceKind::Cpu),
            strategy: Strategy::Model,
            micro_batches,
            ..CompileOptions::default()
        };
        let pipeline = plan_with(example, options);
        let what = format!("{example} in {micro_batches} micro-batches on {devices} stages");
        assert_eq!(pipeline.strategy.replicas, micro_batches, "{what}");
        assert_eq!(pipeline.partitions.len(), devices, "{what}: a stage on each device");
        for partition in &pipeline.partitions {
            let graph = &partition.module.graph;
            let compute = graph.node_ids().filter(|&id| node_flops(graph, id) > 0.0).count();
            assert!(compute > 0, "{what}: {} computes nothing", partition.device);
        }
        let variables = |p: &dfc_plan::Partition| {
            let graph = &p.module.graph;
            graph.node_ids().filter(|&id| matches!(graph.node(id).op, dfc_ir::Op::Variable { .. })).count()
        };
        if example != "linear_regression" {
            assert!(pipeline.partitions.iter().all(|p| variables(p) > 0), "{what}: a stage without parameters");
        }
        let backends: &[dfc_driver::Backend] = match example {
            "cnn" => &[dfc_driver::Backend::Interp],
            _ => &[dfc_driver::Backend::Interp, dfc_driver::Backend::Llvm],
        };
        for &backend in backends {
            let reference = train_on(&single, &data, backend);
            assert_same(&format!("{what} on {backend:?}"), &reference, &train_on(&pipeline, &data, backend), 1e-4);
        }
    }
}

fn node_flops(graph: &dfc_ir::Graph, id: dfc_ir::NodeId) -> f64 {
    dfc_passes::cost::node_flops(graph, id)
}

/// The order of a pipeline's passes on its first stage (of 2, 4 micro-batches), as the
/// runtime runs them (`dfc_interp::schedule`): 1F1B holds three micro-batches at a time (two
/// stages from it to the last, and one of slack) and alternates once the pipeline is full; GPipe's runs every forward pass first. Both train
/// to the same values. Either way each micro-batch's gradient joins the sum of the gradients
/// as soon as it is computed, so that a stage never holds all M of them.
#[test]
fn a_pipeline_s_first_stage_runs_its_passes_in_the_schedule_s_order() {
    let single = plan("mlp", Cluster::local(1, DeviceKind::Cpu), Strategy::Single);
    let data = batches(&single);
    let mut trained = Vec::new();
    for (one_forward_one_backward, expected) in
        [(true, "F0 F1 F2 B0 F3 B1 S1 B2 S2 B3 S3"), (false, "F0 F1 F2 F3 B0 B1 S1 B2 S2 B3 S3")]
    {
        let options = CompileOptions {
            cluster: Cluster::local(2, DeviceKind::Cpu),
            strategy: Strategy::Model,
            micro_batches: 4,
            one_forward_one_backward,
            ..CompileOptions::default()
        };
        let pipeline = plan_with("mlp", options);
        let modules: Vec<&dfc_ir::Module> = pipeline.partitions.iter().map(|p| &p.module).collect();
        let orders = dfc_interp::schedule(&modules).expect("a schedule");
        let graph = &modules[0].graph;
        // The first stage's products: a forward one per micro-batch, then its weights'
        // gradient, which joins the sum of the micro-batches' (S) as it comes.
        let summed = orders[0].iter().find_map(|&id| graph.node(id).name.split_once("/gradient_sum_").map(|(v, _)| v));
        let first_weight = summed.expect("a sum of the micro-batches' gradients").to_string();
        let passes: Vec<String> = orders[0]
            .iter()
            .filter_map(|&id| {
                let name = &graph.node(id).name;
                if let Some(r) = name.strip_prefix(&format!("{first_weight}/gradient_sum_")) {
                    return Some(format!("S{r}"));
                }
                if !matches!(graph.node(id).op, dfc_ir::Op::MatMul { .. }) {
                    return None;
                }
                let replica = name.strip_prefix("replica_").and_then(|r| r.split('/').next()).expect("a micro-batch's");
                Some(format!("{}{replica}", if name.contains("/gradients/") { "B" } else { "F" }))
            })
            .collect();
        assert_eq!(passes.join(" "), expected, "1F1B: {one_forward_one_backward}");
        trained.push(train(&pipeline, &data));
    }
    assert_eq!(trained[0], trained[1], "the schedule changes the order, not the arithmetic");
}
