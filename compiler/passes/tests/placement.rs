//! Placement and partitioning on random graphs and clusters: every request and colocation is
//! honoured, every cross-device edge goes through exactly one Send/Recv pair per tensor and
//! destination, and the variable balancing keeps its promises (brute force on small cases).

use dfc_ir::{
    BinaryOp, Cluster, DType, DeviceSpec, Graph, Initializer, Module, NodeId, Op, Output, ReduceKind, TensorRef,
    TensorType, UnaryOp,
};
use dfc_passes::{balance, PlaceOptions, VariablePlacement};
use std::collections::{HashMap, HashSet};

fn random_cluster(rng: &mut fastrand::Rng) -> Cluster {
    let mut jobs = Vec::new();
    let workers: Vec<String> = (0..rng.usize(1..=3))
        .map(|t| {
            let devices: Vec<String> = (0..rng.usize(1..=2)).map(|d| format!("\"cpu:{d}\"")).collect();
            format!("{{\"address\": \"w{t}:1\", \"devices\": [{}]}}", devices.join(", "))
        })
        .collect();
    jobs.push(format!("\"worker\": [{}]", workers.join(", ")));
    let ps = rng.usize(0..=3);
    if ps > 0 {
        let tasks: Vec<String> = (0..ps).map(|t| format!("\"ps{t}:1\"")).collect();
        jobs.push(format!("\"ps\": [{}]", tasks.join(", ")));
    }
    Cluster::from_json(&format!("{{\"cluster\": {{{}}}}}", jobs.join(", "))).unwrap()
}

/// A request that some device of the cluster satisfies: a job, a task, or a whole device.
fn random_request(rng: &mut fastrand::Rng, cluster: &Cluster) -> DeviceSpec {
    let devices = cluster.devices();
    let device = devices[rng.usize(..devices.len())].clone();
    match rng.usize(0..3) {
        0 => DeviceSpec { job: device.job, ..DeviceSpec::default() },
        1 => DeviceSpec { job: device.job, task: device.task, ..DeviceSpec::default() },
        _ => device,
    }
}

fn vector() -> TensorType {
    TensorType::new(DType::F32, vec![4])
}

/// Variables of random sizes with their reads; compute on f32[4] values; some updates; some
/// requests on variables and compute (never on a variable's reads and updates, which follow it).
fn random_module(rng: &mut fastrand::Rng, cluster: &Cluster) -> Module {
    let mut module = Module { name: "random".into(), ..Module::default() };
    let g: &mut Graph = &mut module.graph;
    let mut values: Vec<TensorRef> = Vec::new();
    let mut variables = Vec::new();
    for i in 0..rng.usize(1..=6) {
        let rows = rng.usize(1..=8);
        let ty = TensorType::new(DType::F32, vec![rows, 4]);
        let op = Op::Variable { ty, init: Initializer::Zeros, trainable: true, partitions: 1, origin: None };
        let v = g.add(op, &[], &format!("v{i}"), None).unwrap();
        if rng.f32() < 0.4 {
            g.node_mut(v).requested_device = Some(random_request(rng, cluster));
        }
        let read = g.add(Op::Read, &[v.into()], &format!("v{i}/read"), None).unwrap();
        let reduce = Op::Reduce { kind: ReduceKind::Sum, axes: vec![0], keep_dims: false };
        let summed = g.add(reduce, &[read.into()], &format!("v{i}/sum"), None).unwrap();
        values.push(summed.into());
        variables.push((v, rows));
        module.params.push(v);
    }
    for i in 0..rng.usize(0..=2) {
        let x = g.add(Op::Input { ty: vector() }, &[], &format!("x{i}"), None).unwrap();
        module.inputs.push(x);
        values.push(x.into());
    }
    for i in 0..rng.usize(1..=30) {
        let a = values[rng.usize(..values.len())];
        let id = if rng.bool() {
            let b = values[rng.usize(..values.len())];
            g.add(Op::Binary(BinaryOp::Add), &[a, b], &format!("add{i}"), None).unwrap()
        } else {
            g.add(Op::Unary(UnaryOp::Relu), &[a], &format!("relu{i}"), None).unwrap()
        };
        if rng.f32() < 0.25 {
            g.node_mut(id).requested_device = Some(random_request(rng, cluster));
        }
        if rng.f32() < 0.1 {
            let (v, _) = variables[rng.usize(..variables.len())];
            if g.node(v).requested_device.is_none() {
                g.node_mut(id).colocate_with = Some(v);
                g.node_mut(id).requested_device = None;
            }
        }
        values.push(id.into());
    }
    // Control edges between compute nodes, earlier to later (creation order is topological):
    // across devices they must travel as dummy tensors.
    for _ in 0..rng.usize(0..=4) {
        let (a, b) = (rng.usize(..values.len()), rng.usize(..values.len()));
        if a < b && values[a].node != values[b].node {
            g.add_control_edge(values[a].node, values[b].node);
        }
    }
    for (i, &(v, rows)) in variables.iter().enumerate() {
        if rng.bool() {
            let value = values[rng.usize(..values.len())];
            let spread = g.add(Op::BroadcastTo { shape: vec![rows, 4].into() }, &[value], &format!("spread{i}"), None);
            let spread = spread.unwrap();
            let update = g.add(Op::AssignAdd, &[v.into(), spread.into()], &format!("update{i}"), None).unwrap();
            if rng.bool() {
                let read = g.users(v).into_iter().find(|&u| matches!(g.node(u).op, Op::Read)).unwrap();
                g.add_control_edge(read, update);
            }
        }
    }
    let last = *values.last().unwrap();
    module.outputs.push(Output { name: "out".into(), tensor: last });
    assert!(dfc_ir::verify(&module, dfc_ir::VerifyOptions::default()).is_empty());
    module
}

fn options<'a>(rng: &mut fastrand::Rng, cluster: &'a Cluster) -> PlaceOptions<'a> {
    let n = cluster.devices().len();
    let ps: Vec<usize> =
        cluster.devices().iter().enumerate().filter(|(_, d)| d.job.as_deref() == Some("ps")).map(|(i, _)| i).collect();
    let policy =
        [VariablePlacement::RoundRobin, VariablePlacement::Greedy, VariablePlacement::GreedySorted][rng.usize(0..3)];
    PlaceOptions {
        cluster,
        variable_devices: if ps.is_empty() { (0..n).collect() } else { ps },
        default_device: 0,
        policy,
        cost_model: None,
        model_placement: dfc_passes::ModelPlacement::EarliestFinish,
        soft: false,
        spawned_workers: None,
    }
}

#[test]
fn random_graphs_are_placed_and_partitioned_soundly() {
    let cost = dfc_passes::CostModel::default();
    let mut carried = 0;
    for seed in 0..300u64 {
        let mut rng = fastrand::Rng::with_seed(seed);
        let cluster = random_cluster(&mut rng);
        let module = random_module(&mut rng, &cluster);
        let mut place = options(&mut rng, &cluster);
        if seed % 3 == 0 {
            place.cost_model = Some(&cost);
        }
        let (placed, warnings) = dfc_passes::place(module.clone(), &place)
            .unwrap_or_else(|d| panic!("seed {seed}: placement failed: {d:?}"));
        assert!(warnings.is_empty(), "seed {seed}: {warnings:?}");
        let graph = &placed.module.graph;

        // Requests and colocation are honoured.
        for id in graph.node_ids() {
            let node = graph.node(id);
            let device = node.device.as_ref().unwrap_or_else(|| panic!("seed {seed}: `{}` unplaced", node.name));
            if let Some(request) = &node.requested_device {
                assert!(request.allows(device), "seed {seed}: `{}` asked for {request}, got {device}", node.name);
            }
            let with = match node.op {
                Op::Read | Op::AssignAdd => Some(graph.inputs(id)[0].node),
                _ => node.colocate_with,
            };
            if let Some(with) = with {
                assert_eq!(
                    graph.node(with).device.as_ref(),
                    Some(device),
                    "seed {seed}: `{}` left its group",
                    node.name
                );
            }
        }
        // Unrequested variables go to the variable devices.
        let devices = cluster.devices();
        for &v in &module.params {
            if module.graph.node(v).requested_device.is_none() {
                let at = devices.iter().position(|d| Some(*d) == graph.node(v).device.as_ref()).unwrap();
                assert!(place.variable_devices.contains(&at), "seed {seed}: variable off the variable devices");
            }
        }

        let placed_devices: HashMap<NodeId, Option<DeviceSpec>> =
            graph.node_ids().map(|id| (id, graph.node(id).device.clone())).collect();
        let order: Vec<DeviceSpec> = devices.iter().map(|d| (*d).clone()).collect();
        let partitioned = dfc_passes::partition(placed, &order);
        let combined = &partitioned.combined.graph;
        // Every data and control edge stays on one device; one Send per (tensor, destination).
        let mut pairs = HashSet::new();
        for id in combined.node_ids() {
            let here = combined.node(id).device.clone();
            for t in combined.inputs(id) {
                assert_eq!(combined.node(t.node).device, here, "seed {seed}: a data edge crosses devices");
            }
            for c in combined.control_inputs(id) {
                assert_eq!(combined.node(c).device, here, "seed {seed}: a control edge crosses devices");
            }
            if let Op::Send { to, .. } = &combined.node(id).op {
                let tensor = combined.inputs(id)[0];
                assert!(pairs.insert((tensor, to.clone())), "seed {seed}: two Sends of one tensor to {to}");
            }
        }
        let parts: Vec<(&DeviceSpec, &Module)> = partitioned.parts.iter().map(|(d, m)| (d, m)).collect();
        let problems = dfc_ir::verify_partitions(&parts);
        assert!(problems.is_empty(), "seed {seed}: {problems:?}");
        for (_, part) in &partitioned.parts {
            let problems = dfc_ir::verify(part, dfc_ir::VerifyOptions { require_devices: true });
            assert!(problems.is_empty(), "seed {seed}: a partition is malformed: {problems:?}");
        }
        let crossing = module.graph.node_ids().flat_map(|id| {
            let placed = &placed_devices;
            module.graph.control_inputs(id).into_iter().map(move |c| placed[&c] != placed[&id])
        });
        carried += crossing.filter(|&x| x).count();
        let nodes: usize = partitioned.parts.iter().map(|(_, m)| m.graph.len()).sum();
        assert_eq!(nodes, combined.len(), "seed {seed}: partitions must hold every node once");
    }
    assert!(carried > 20, "the random graphs should cross devices with control edges ({carried})");
}

fn max_load(sizes: &[u64], chosen: &[usize], m: usize) -> u64 {
    let mut load = vec![0u64; m];
    for (s, d) in sizes.iter().zip(chosen) {
        load[*d] += s;
    }
    load.into_iter().max().unwrap()
}

/// The best possible maximum load, by trying every assignment.
fn optimum(sizes: &[u64], m: usize) -> u64 {
    let n = sizes.len();
    let mut best = u64::MAX;
    let mut chosen = vec![0usize; n];
    loop {
        best = best.min(max_load(sizes, &chosen, m));
        let mut i = 0;
        while i < n {
            chosen[i] += 1;
            if chosen[i] < m {
                break;
            }
            chosen[i] = 0;
            i += 1;
        }
        if i == n {
            return best;
        }
    }
}

#[test]
fn greedy_sorted_is_within_four_thirds_of_the_optimum_and_never_worse_than_round_robin() {
    let mut rng = fastrand::Rng::with_seed(7);
    for case in 0..400 {
        let m = rng.usize(2..=4);
        let n = rng.usize(1..=8);
        let sizes: Vec<u64> = (0..n).map(|_| rng.u64(1..=100)).collect();
        let allowed = vec![(0..m).collect::<Vec<_>>(); n];
        let initial = vec![0; m];
        let greedy = max_load(&sizes, &balance(&sizes, &allowed, &initial, VariablePlacement::GreedySorted), m);
        let best = optimum(&sizes, m);
        assert!(3 * greedy <= 4 * best, "case {case}: greedy-sorted {greedy} vs optimum {best} for {sizes:?} on {m}");
        let mut sorted = sizes.clone();
        sorted.sort_by(|a, b| b.cmp(a));
        let round_robin = max_load(&sorted, &balance(&sorted, &allowed, &initial, VariablePlacement::RoundRobin), m);
        assert!(greedy <= round_robin, "case {case}: greedy-sorted {greedy} > round-robin {round_robin} on {sorted:?}");
        let unsorted = max_load(&sizes, &balance(&sizes, &allowed, &initial, VariablePlacement::Greedy), m);
        assert!(unsorted < 2 * best, "case {case}: greedy {unsorted} vs optimum {best}");
    }
}

#[test]
fn round_robin_follows_creation_order_and_greedy_the_least_loaded() {
    let allowed = vec![vec![0, 1]; 4];
    let sizes = [10, 1, 1, 1];
    assert_eq!(balance(&sizes, &allowed, &[0, 0], VariablePlacement::RoundRobin), [0, 1, 0, 1]);
    assert_eq!(balance(&sizes, &allowed, &[0, 0], VariablePlacement::Greedy), [0, 1, 1, 1]);
    // Sorting first fixes an order that greedy alone gets wrong: 1, 1, 2 on two devices.
    let sizes = [1, 1, 2];
    let allowed = vec![vec![0, 1]; 3];
    assert_eq!(max_load(&sizes, &balance(&sizes, &allowed, &[0, 0], VariablePlacement::Greedy), 2), 3);
    assert_eq!(max_load(&sizes, &balance(&sizes, &allowed, &[0, 0], VariablePlacement::GreedySorted), 2), 2);
}

#[test]
fn an_unknown_job_and_a_broken_colocation_are_diagnostics_naming_the_conflict() {
    let cluster = Cluster::from_json(r#"{"cluster": {"worker": ["a:1"], "ps": ["b:1"]}}"#).unwrap();
    let mut module = Module { name: "m".into(), ..Module::default() };
    let g = &mut module.graph;
    let ty = TensorType::new(DType::F32, vec![2, 4]);
    let v = g
        .add(
            Op::Variable { ty, init: Initializer::Zeros, trainable: true, partitions: 1, origin: None },
            &[],
            "table",
            None,
        )
        .unwrap();
    let at = |start| Some(dfc_diag::Span::new(start, start + 5));
    g.request(v, Some(DeviceSpec::parse("/job:ps").unwrap()), at(10));
    let read = g.add(Op::Read, &[v.into()], "table/read", None).unwrap();
    let lookup = g
        .add(Op::Reduce { kind: ReduceKind::Sum, axes: vec![0], keep_dims: false }, &[read.into()], "lookup", None)
        .unwrap();
    g.node_mut(lookup).colocate_with = Some(v);
    g.request(lookup, Some(DeviceSpec::parse("/job:worker").unwrap()), at(30));
    let stray = g.add(Op::Unary(UnaryOp::Neg), &[lookup.into()], "stray", None).unwrap();
    g.request(stray, Some(DeviceSpec::parse("/job:evaluator").unwrap()), at(50));
    module.params.push(v);
    module.outputs.push(Output { name: "out".into(), tensor: NodeId::into(stray) });
    let place = PlaceOptions {
        cluster: &cluster,
        variable_devices: vec![1],
        default_device: 0,
        policy: VariablePlacement::RoundRobin,
        cost_model: None,
        model_placement: dfc_passes::ModelPlacement::EarliestFinish,
        soft: false,
        spawned_workers: None,
    };
    let errors = dfc_passes::place(module.clone(), &place).expect_err("the requests cannot be met");
    let by_code: HashMap<&str, &dfc_diag::Diagnostic> = errors.iter().map(|d| (d.code.as_str(), d)).collect();
    let unknown = by_code["E0601"];
    assert_eq!(unknown.primary.span.start, 50);
    assert!(unknown.message.contains("no job `evaluator`"), "{}", unknown.message);
    let conflict = by_code["E0602"];
    assert_eq!(conflict.primary.span.start, 30);
    assert!(conflict.message.contains("`table`") && conflict.message.contains("/job:ps"), "{}", conflict.message);

    // Soft placement sets both aside, with warnings, and places everything.
    let soft = PlaceOptions { soft: true, ..place };
    let (placed, warnings) = dfc_passes::place(module, &soft).expect("soft placement always places");
    assert_eq!(warnings.len(), 2);
    assert!(warnings.iter().all(|w| !w.is_error()));
    let lookup_device = placed.module.graph.node(lookup).device.clone().unwrap();
    assert_eq!(lookup_device.job.as_deref(), Some("ps"), "the lookup stays with its table");
}
