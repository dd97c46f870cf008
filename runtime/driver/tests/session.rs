//! `Session`: plans of several partitions train exactly like the same model in one partition;
//! a failing partition is an error, not a hang; mirrored variables and checkpoints.

use dfc_driver::{EpochRecord, Progress, RunError, Session, TrainOptions};
use dfc_interp::{InterpError, Tensor};
use dfc_ir::{
    BinaryOp, Cluster, ConstValue, DType, DeviceKind, DeviceSpec, Graph, Initializer, Module, NodeId, Op, Optimizer,
    OptimizerKind, Output, ReduceKind, Shape, TensorRef, TensorType, Training, UnaryOp, VariableOrigin,
};
use dfc_plan::{Partition, Plan, StrategySpec};
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

fn f32_ty(dims: &[usize]) -> TensorType {
    TensorType::new(DType::F32, dims.to_vec())
}

fn devices(n: usize) -> Vec<DeviceSpec> {
    Cluster::local(n, DeviceKind::Cpu).devices().into_iter().cloned().collect()
}

/// Adds nodes on a current device.
struct Builder {
    graph: Graph,
    device: DeviceSpec,
}

impl Builder {
    fn new() -> Builder {
        Builder { graph: Graph::new(), device: devices(1)[0].clone() }
    }

    fn on(&mut self, device: &DeviceSpec) {
        self.device = device.clone();
    }

    fn add(&mut self, op: Op, inputs: &[NodeId], name: &str) -> NodeId {
        let inputs: Vec<TensorRef> = inputs.iter().map(|&i| i.into()).collect();
        let id = self.graph.add(op, &inputs, name, None).unwrap_or_else(|e| panic!("{name}: {}", e.message));
        assert_eq!(self.graph.node(id).name, name);
        self.graph.node_mut(id).device = Some(self.device.clone());
        id
    }

    fn input(&mut self, name: &str, ty: TensorType) -> NodeId {
        self.add(Op::Input { ty }, &[], name)
    }

    fn variable(&mut self, name: &str, dims: &[usize], origin: Option<VariableOrigin>) -> NodeId {
        let op = Op::Variable {
            ty: f32_ty(dims),
            init: Initializer::GlorotUniform,
            trainable: true,
            partitions: 1,
            origin: origin.map(Box::new),
        };
        self.add(op, &[], name)
    }

    fn scalar(&mut self, name: &str, value: f64) -> NodeId {
        self.add(Op::Const { value: ConstValue::scalar(DType::F32, value) }, &[], name)
    }

    fn binary(&mut self, op: BinaryOp, a: NodeId, b: NodeId, name: &str) -> NodeId {
        self.add(Op::Binary(op), &[a, b], name)
    }

    fn matmul(&mut self, a: NodeId, b: NodeId, transpose: (bool, bool), name: &str) -> NodeId {
        self.add(Op::MatMul { transpose_a: transpose.0, transpose_b: transpose.1 }, &[a, b], name)
    }

    fn mean(&mut self, x: NodeId, rank: usize, name: &str) -> NodeId {
        self.add(Op::Reduce { kind: ReduceKind::Mean, axes: (0..rank).collect(), keep_dims: false }, &[x], name)
    }

    /// `variable -= lr * gradient`, after `read`.
    fn sgd(&mut self, variable: NodeId, read: NodeId, gradient: NodeId, lr: NodeId, name: &str) -> NodeId {
        let step = self.binary(BinaryOp::Mul, gradient, lr, &format!("{name}/step"));
        let update = self.add(Op::AssignSub, &[variable, step], name);
        self.graph.add_control_edge(read, update);
        update
    }
}

/// Splits a module whose nodes have devices into one module per device: each data edge
/// between devices becomes a Send on the source's device and a Recv on the user's (one pair
/// per tensor and device). Names stay as they are, so the plans compare by name.
fn split(module: &Module, devices: &[DeviceSpec]) -> Vec<Partition> {
    let graph = &module.graph;
    let at = |id: NodeId| {
        let device = graph.node(id).device.as_ref().expect("placed");
        devices.iter().position(|d| d == device).expect("a device of the cluster")
    };
    let mut graphs: Vec<Graph> = devices.iter().map(|_| Graph::new()).collect();
    let mut new_id: HashMap<NodeId, NodeId> = HashMap::new();
    let mut received: HashMap<(NodeId, usize), NodeId> = HashMap::new();
    for id in graph.topo_order().expect("acyclic") {
        let node = graph.node(id);
        let p = at(id);
        let mut inputs = Vec::new();
        for operand in graph.inputs(id) {
            let q = at(operand.node);
            if q == p {
                inputs.push(TensorRef { node: new_id[&operand.node], port: operand.port });
                continue;
            }
            let recv = match received.get(&(operand.node, p)) {
                Some(&recv) => recv,
                None => {
                    let source = &graph.node(operand.node).name;
                    let key = format!("{source}->{p}");
                    let send = graphs[q].add(
                        Op::Send { key: key.clone(), to: devices[p].clone() },
                        &[new_id[&operand.node].into()],
                        &format!("{source}/send_{p}"),
                        None,
                    );
                    graphs[q].node_mut(send.unwrap()).device = Some(devices[q].clone());
                    let ty = graph.ty(operand).clone();
                    let op = Op::Recv { key, from: devices[q].clone(), ty };
                    let recv = graphs[p].add(op, &[], &format!("{source}/recv_{p}"), None).unwrap();
                    graphs[p].node_mut(recv).device = Some(devices[p].clone());
                    received.insert((operand.node, p), recv);
                    recv
                }
            };
            inputs.push(recv.into());
        }
        let copy = graphs[p].add_with_types(node.op.clone(), &inputs, node.outputs.clone(), &node.name, None);
        assert_eq!(graphs[p].node(copy).name, node.name);
        graphs[p].node_mut(copy).device = node.device.clone();
        for before in graph.control_inputs(id) {
            assert_eq!(at(before), p, "the test splits no control edge");
            graphs[p].add_control_edge(new_id[&before], copy);
        }
        new_id.insert(id, copy);
    }
    let mut partitions = Vec::new();
    for (p, graph) in graphs.into_iter().enumerate() {
        let mine = |ids: &[NodeId]| ids.iter().filter(|&&id| at(id) == p).map(|id| new_id[id]).collect();
        let outputs = |outputs: &[Output]| {
            outputs
                .iter()
                .filter(|o| at(o.tensor.node) == p)
                .map(|o| Output { name: o.name.clone(), tensor: TensorRef { node: new_id[&o.tensor.node], port: 0 } })
                .collect()
        };
        let part = Module {
            name: module.name.clone(),
            graph,
            dims: module.dims.clone(),
            inputs: mine(&module.inputs),
            params: mine(&module.params),
            outputs: outputs(&module.outputs),
            metrics: outputs(&module.metrics),
            training: None,
        };
        let problems = dfc_ir::verify(&part, Default::default());
        assert!(problems.is_empty(), "partition {p}: {problems:?}");
        partitions.push(Partition { device: devices[p].clone(), module: part });
    }
    let parts: Vec<_> = partitions.iter().map(|p| (&p.device, &p.module)).collect();
    let problems = dfc_ir::verify_partitions(&parts);
    assert!(problems.is_empty(), "{problems:?}");
    partitions
}

const BATCH: usize = 4;
const LR: f64 = 0.05;

/// A two-layer linear model with hand-written gradients and SGD. With `devices = [a, b]`:
/// `x`, `w` and its update on `a`; `v`, the loss, `y`, the gradients of `v` and `h` on `b`.
/// Tensors cross both ways: `h` from a to b, its gradient from b to a.
fn two_layer(devices: &[DeviceSpec]) -> Module {
    let (a, b) = (&devices[0], &devices[devices.len() - 1]);
    let mut m = Builder::new();
    m.on(a);
    let x = m.input("x", f32_ty(&[BATCH, 3]));
    let w = m.variable("w", &[3, 2], None);
    let read_w = m.add(Op::Read, &[w], "w/read");
    let h = m.matmul(x, read_w, (false, false), "h");
    let lr_a = m.scalar("lr_a", LR);
    m.on(b);
    let y = m.input("y", f32_ty(&[BATCH, 1]));
    let v = m.variable("v", &[2, 1], None);
    let read_v = m.add(Op::Read, &[v], "v/read");
    let prediction = m.matmul(h, read_v, (false, false), "prediction");
    let error = m.binary(BinaryOp::Sub, prediction, y, "error");
    let squared = m.binary(BinaryOp::Mul, error, error, "squared");
    let loss = m.mean(squared, 2, "loss");
    let absolute = m.add(Op::Unary(UnaryOp::Abs), &[error], "absolute");
    let mae = m.mean(absolute, 2, "mae");
    let scale = m.scalar("scale", 2.0 / BATCH as f64);
    let grad_prediction = m.binary(BinaryOp::Mul, error, scale, "grad/prediction");
    let grad_v = m.matmul(h, grad_prediction, (true, false), "grad/v");
    let grad_h = m.matmul(grad_prediction, read_v, (false, true), "grad/h");
    let lr_b = m.scalar("lr_b", LR);
    let update_v = m.sgd(v, read_v, grad_v, lr_b, "v/update");
    m.on(a);
    let grad_w = m.matmul(x, grad_h, (true, false), "grad/w");
    let update_w = m.sgd(w, read_w, grad_w, lr_a, "w/update");
    let module = Module {
        name: "two_layer".into(),
        graph: m.graph,
        dims: Vec::new(),
        inputs: vec![x, y],
        params: vec![w, v],
        outputs: vec![Output { name: "prediction".into(), tensor: prediction.into() }],
        metrics: vec![Output { name: "mae".into(), tensor: mae.into() }],
        training: Some(Training {
            loss: loss.into(),
            optimizer: Optimizer {
                kind: OptimizerKind::Sgd,
                learning_rate: LR,
                weight_decay: 0.0,
                schedule: None,
                clip_global_norm: None,
            },
            gradients: vec![(w, grad_w.into()), (v, grad_v.into())],
            updates: vec![update_w, update_v],
            learning_rate: None,
            averages: Vec::new(),
        }),
    };
    let problems = dfc_ir::verify(&module, Default::default());
    assert!(problems.is_empty(), "{problems:?}");
    module
}

fn single_plan(module: Module) -> Plan {
    Plan::single_device(module, "test.df", "")
}

fn partitioned_plan(module: &Module, devices: &[DeviceSpec]) -> Plan {
    let partitions = split(module, devices);
    let cluster = Cluster::local(devices.len(), DeviceKind::Cpu);
    let strategy = StrategySpec { name: "model".into(), ..StrategySpec::default() };
    let plan = Plan::build(module, partitions, cluster, strategy, "test.df", "");
    // Through the file format and back, as `dfc run` gets it.
    dfc_plan::decode(&dfc_plan::encode(&plan)).expect("the plan reads back")
}

/// Deterministic data for `step`: `x` in [-1, 1), `y` a function of `x`.
fn batch(step: usize) -> HashMap<String, Tensor> {
    let x: Vec<f32> = (0..BATCH * 3).map(|i| (((i * 7 + step * 13) % 17) as f32 - 8.0) / 8.0).collect();
    let y: Vec<f32> = (0..BATCH).map(|i| x[i * 3] * 0.5 - x[i * 3 + 1] + 0.25 * x[i * 3 + 2] + 0.1).collect();
    HashMap::from([
        ("x".to_string(), Tensor::from_vec(vec![BATCH, 3], x)),
        ("y".to_string(), Tensor::from_vec(vec![BATCH, 1], y)),
    ])
}

/// Trains `steps` steps and returns the losses, bit for bit, and the metric after each.
fn train_steps(session: &mut Session<'_>, steps: usize) -> (Vec<u32>, Vec<u32>) {
    let training = session.plan().training.clone().expect("a training plan");
    let updates: Vec<&str> = training.updates.iter().map(String::as_str).collect();
    let step = session.program(&[&training.loss_node], &updates).unwrap();
    let eval = session.program(&["mae", "prediction"], &[]).unwrap();
    let (mut losses, mut metrics) = (Vec::new(), Vec::new());
    for i in 0..steps {
        let out = session.run(&step, &batch(i)).unwrap();
        losses.push(out[0].to_vec::<f32>()[0].to_bits());
        let out = session.run(&eval, &batch(100 + i)).unwrap();
        metrics.push(out[0].to_vec::<f32>()[0].to_bits());
    }
    (losses, metrics)
}

#[test]
fn two_partitions_train_exactly_like_one() {
    let devs = devices(2);
    let single = single_plan(two_layer(&devs[..1]));
    let split = partitioned_plan(&two_layer(&devs), &devs);
    assert_eq!(split.partitions.len(), 2);
    assert!(split.partitions.iter().all(|p| p.module.training.is_none()));

    let mut one = Session::new(&single, 7).unwrap();
    let mut two = Session::new(&split, 7).unwrap();
    assert_eq!(one.variables().unwrap(), two.variables().unwrap(), "the same initial values");
    let (losses_one, metrics_one) = train_steps(&mut one, 6);
    let (losses_two, metrics_two) = train_steps(&mut two, 6);
    assert_eq!(losses_one, losses_two);
    assert_eq!(metrics_one, metrics_two);
    assert_eq!(one.variables().unwrap(), two.variables().unwrap());
    let first = f32::from_bits(losses_one[0]);
    let last = f32::from_bits(losses_one[5]);
    assert!(last < first, "training should lower the loss: {first} then {last}");
    let names: Vec<String> = two.variables().unwrap().iter().map(|(n, _)| n.clone()).collect();
    assert_eq!(names, ["v", "w"]);
}

#[test]
fn a_program_runs_only_the_partitions_it_needs() {
    let devs = devices(2);
    let plan = partitioned_plan(&two_layer(&devs), &devs);
    let session = Session::new(&plan, 0).unwrap();
    // `h` is on the first device and needs nothing from the second.
    let program = session.program(&["h"], &[]).unwrap();
    assert_eq!(program.partitions(), [0]);
    assert_eq!(program.inputs(), ["x"]);
    // The prediction is on the second, and needs `h` from the first.
    let program = session.program(&["prediction"], &[]).unwrap();
    assert_eq!(program.partitions(), [0, 1]);
    assert_eq!(program.inputs(), ["x"]);
    // The update of `w` needs the gradient of `h`, so the loss's inputs too.
    let program = session.program(&[], &["w/update"]).unwrap();
    assert_eq!(program.partitions(), [0, 1]);
    assert_eq!(program.inputs(), ["x", "y"]);
    let error = session.program(&["nothing"], &[]).unwrap_err();
    assert!(error.to_string().contains("no output or node `nothing`"), "{error}");
}

/// Discards what the loop reports.
struct Quiet;

impl Progress for Quiet {
    fn epoch_started(&mut self, _: u64, _: u64, _: u64) {}
    fn step(&mut self, _: f64, _: f64) {}
    fn epoch_finished(&mut self, _: &EpochRecord) {}
    fn resumed(&mut self, _: u64, _: u64, _: &std::path::Path) {}
}

#[test]
fn the_training_loop_runs_a_partitioned_plan_and_resumes_it() {
    let dir = tempfile::tempdir().unwrap();
    let n = BATCH * 5;
    let x: Vec<f32> = (0..n * 3).map(|i| ((i * 11 % 23) as f32 - 11.0) / 11.0).collect();
    let y: Vec<f32> = (0..n).map(|i| x[i * 3] - 0.5 * x[i * 3 + 2]).collect();
    let (x_path, y_path) = (dir.path().join("x.npy"), dir.path().join("y.npy"));
    dfc_driver::save_npy(&x_path, &Tensor::from_vec(vec![n, 3], x)).unwrap();
    dfc_driver::save_npy(&y_path, &Tensor::from_vec(vec![n, 1], y)).unwrap();
    let feeds = vec![("x".to_string(), x_path), ("y".to_string(), y_path)];
    let options = |checkpoints: &str, steps: Option<u64>| TrainOptions {
        backend: dfc_driver::Backend::Interp,
        feeds: feeds.clone(),
        eval_feeds: feeds.clone(),
        epochs: Some(3),
        steps,
        seed: 3,
        shuffle_seed: 4,
        no_shuffle: false,
        metrics: None,
        tensorboard: None,
        checkpoint_dir: Some(dir.path().join(checkpoints)),
        lockstep: false,
    };
    let devs = devices(2);
    let single = single_plan(two_layer(&devs[..1]));
    let split = partitioned_plan(&two_layer(&devs), &devs);
    let one = dfc_driver::train(&single, &options("one", None), &mut Quiet).unwrap();
    let two = dfc_driver::train(&split, &options("two", None), &mut Quiet).unwrap();
    assert_eq!(one.steps, 15);
    assert_eq!(one.variables, two.variables);
    let eval = |records: &[EpochRecord]| -> Vec<(u64, u64)> {
        records.iter().map(|r| (r.train_loss.to_bits(), r.metrics["mae"].to_bits())).collect()
    };
    assert_eq!(eval(&one.records), eval(&two.records));

    // Stopped after 7 steps and resumed: the same end.
    dfc_driver::train(&split, &options("resumed", Some(7)), &mut Quiet).unwrap();
    let resumed = dfc_driver::train(&split, &options("resumed", None), &mut Quiet).unwrap();
    assert_eq!(resumed.variables, two.variables);
    // A checkpoint of the partitioned plan restores into the single one.
    let saved = dfc_driver::checkpoint::latest(&dir.path().join("two")).unwrap().unwrap();
    let mut session = Session::new(&single, 0).unwrap();
    session.restore(&saved.tensors, &saved.path).unwrap();
    assert_eq!(session.variables().unwrap(), two.variables);
}

/// On the first device: `ids` (fed), sent to the second, which gathers rows of `table` and
/// sends them back; the first sums them into `total` and counts its runs in `runs`.
fn gather_plan() -> Plan {
    let devs = devices(2);
    let mut m = Builder::new();
    m.on(&devs[0]);
    let ids = m.input("ids", TensorType::new(DType::I32, vec![3]));
    let runs = m.add(
        Op::Variable { ty: f32_ty(&[]), init: Initializer::Zeros, trainable: false, partitions: 1, origin: None },
        &[],
        "runs",
    );
    let one = m.scalar("one", 1.0);
    let count = m.add(Op::AssignAdd, &[runs, one], "count");
    m.on(&devs[1]);
    let table = m.variable("table", &[5, 2], None);
    let read = m.add(Op::Read, &[table], "table/read");
    let rows = m.add(Op::Gather, &[read, ids], "rows");
    m.on(&devs[0]);
    let total = m.add(Op::Reduce { kind: ReduceKind::Sum, axes: vec![0, 1], keep_dims: false }, &[rows], "total");
    let module = Module {
        name: "gather".into(),
        graph: m.graph,
        inputs: vec![ids],
        params: vec![table],
        outputs: vec![Output { name: "total".into(), tensor: total.into() }],
        ..Module::default()
    };
    let _ = count;
    let cluster = Cluster::local(2, DeviceKind::Cpu);
    Plan::build(&module, split(&module, &devs), cluster, StrategySpec::default(), "gather.df", "")
}

#[test]
fn a_failing_partition_is_the_error_and_nothing_hangs() {
    let plan = gather_plan();
    let mut session = Session::new(&plan, 0).unwrap();
    let program = session.program(&["total"], &["count"]).unwrap();
    assert_eq!(program.partitions(), [0, 1]);
    let feeds = |ids: Vec<i32>| HashMap::from([("ids".to_string(), Tensor::from_vec(vec![3], ids))]);
    let good = session.run(&program, &feeds(vec![0, 4, 4])).unwrap();
    assert!(good[0].to_vec::<f32>()[0].is_finite());
    assert_eq!(session.variables().unwrap().get("runs").unwrap(), &Tensor::scalar(1.0f32));

    // Index 9 of 5 rows, fed on the first device, fails on the second while the first waits
    // for the rows.
    let started = Instant::now();
    let error = session.run(&program, &feeds(vec![1, 9, 0])).unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(10), "the waiting partition is woken");
    match &error {
        RunError::Interp(InterpError::IndexOutOfRange { node, index, size }) => {
            assert_eq!((node.as_str(), *index, *size), ("rows", 9, 5));
        }
        other => panic!("expected the gather's error, got {other}"),
    }
    // The step is atomic across partitions: the first device's count was not written.
    assert_eq!(session.variables().unwrap().get("runs").unwrap(), &Tensor::scalar(1.0f32));
    let again = session.run(&program, &feeds(vec![0, 4, 4])).unwrap();
    assert_eq!(again, good);
    assert_eq!(session.variables().unwrap().get("runs").unwrap(), &Tensor::scalar(2.0f32));
}

#[test]
fn plans_whose_partitions_do_not_meet_are_refused() {
    let mut plan = gather_plan();
    // Drop the Send of the ids: the second partition's Recv would wait for ever.
    let graph = &mut plan.partitions[0].module.graph;
    let send = graph.node_ids().find(|&id| matches!(graph.node(id).op, Op::Send { .. })).unwrap();
    graph.remove(send);
    let error = Session::new(&plan, 0).err().expect("refused");
    assert!(error.to_string().contains("which no partition sends"), "{error}");
}

/// Data parallelism by hand: `replicas` copies of `pred = x_r @ w_r`, each on its own device
/// with its slice of the batch; `w` on the first, mirrored as `replica_r/w` on the others;
/// the gradients and losses summed by all-reduces, every copy updated alike.
fn mirrored_plan(replicas: usize) -> Plan {
    let devs = devices(replicas);
    let rows = BATCH / replicas;
    let mut m = Builder::new();
    let mut inputs = Vec::new();
    let mut params = Vec::new();
    let mut updates = Vec::new();
    let mut loss = None;
    for (r, device) in devs.iter().enumerate() {
        m.on(device);
        let scope = |name: &str| if r == 0 { name.to_string() } else { format!("replica_{r}/{name}") };
        let x = m.input(&scope("x"), f32_ty(&[rows, 3]));
        let y = m.input(&scope("y"), f32_ty(&[rows, 1]));
        let origin = (r > 0).then(|| VariableOrigin {
            name: "w".into(),
            shape: Shape(vec![3, 1]),
            offset: 0,
            mirror_of: Some("w".into()),
        });
        let w = m.variable(&scope("w"), &[3, 1], origin);
        let read = m.add(Op::Read, &[w], &scope("w/read"));
        let prediction = m.matmul(x, read, (false, false), &scope("prediction"));
        let error = m.binary(BinaryOp::Sub, prediction, y, &scope("error"));
        let squared = m.binary(BinaryOp::Mul, error, error, &scope("squared"));
        let sum =
            m.add(Op::Reduce { kind: ReduceKind::Sum, axes: vec![0, 1], keep_dims: false }, &[squared], &scope("sum"));
        let group = |key: &str| Op::AllReduce { key: key.into(), group_size: replicas as u32, replica: r as u32 };
        let total = m.add(group("loss"), &[sum], &scope("total"));
        let inverse = m.scalar(&scope("inverse_batch"), 1.0 / BATCH as f64);
        let mean = m.binary(BinaryOp::Mul, total, inverse, &scope("loss"));
        let scale = m.scalar(&scope("scale"), 2.0 / BATCH as f64);
        let grad_prediction = m.binary(BinaryOp::Mul, error, scale, &scope("grad/prediction"));
        let grad = m.matmul(x, grad_prediction, (true, false), &scope("grad/w"));
        let reduced = m.add(group("grad/w"), &[grad], &scope("grad/w/all"));
        let lr = m.scalar(&scope("lr"), LR);
        updates.push(m.sgd(w, read, reduced, lr, &scope("w/update")));
        inputs.extend([x, y]);
        params.push(w);
        loss.get_or_insert(mean);
    }
    let module = Module {
        name: "mirrored".into(),
        graph: m.graph,
        inputs,
        params,
        training: Some(Training {
            loss: loss.unwrap().into(),
            optimizer: Optimizer {
                kind: OptimizerKind::Sgd,
                learning_rate: LR,
                weight_decay: 0.0,
                schedule: None,
                clip_global_norm: None,
            },
            gradients: Vec::new(),
            updates,
            learning_rate: None,
            averages: Vec::new(),
        }),
        ..Module::default()
    };
    let cluster = Cluster::local(replicas, DeviceKind::Cpu);
    let strategy = StrategySpec { name: "mirrored".into(), replicas: replicas as u32, ..StrategySpec::default() };
    Plan::build(&module, split(&module, &devs), cluster, strategy, "mirrored.df", "")
}

/// `batch(step)` cut into `replicas` slices, fed as `x`, `replica_1/x`, ...
fn sliced(step: usize, replicas: usize) -> HashMap<String, Tensor> {
    let whole = batch(step);
    let rows = BATCH / replicas;
    let mut feeds = HashMap::new();
    for r in 0..replicas {
        for (name, width) in [("x", 3), ("y", 1)] {
            let values = whole[name].to_vec::<f32>()[r * rows * width..(r + 1) * rows * width].to_vec();
            let name = if r == 0 { name.to_string() } else { format!("replica_{r}/{name}") };
            feeds.insert(name, Tensor::from_vec(vec![rows, width], values));
        }
    }
    feeds
}

#[test]
fn mirrored_copies_stay_identical_and_checkpoints_ignore_the_replica_count() {
    let (one_plan, two_plan) = (mirrored_plan(1), mirrored_plan(2));
    let mut one = Session::new(&one_plan, 11).unwrap();
    let mut two = Session::new(&two_plan, 11).unwrap();
    let all = two.all_variables().unwrap();
    assert_eq!(all.get("replica_1/w"), all.get("w"), "a copy starts as its original");
    assert_eq!(one.variables().unwrap(), two.variables().unwrap());
    let names: Vec<String> = two.variables().unwrap().iter().map(|(n, _)| n.clone()).collect();
    assert_eq!(names, ["w"], "checkpoints hold no copies");

    let run = |session: &mut Session<'_>, replicas: usize| -> Vec<f32> {
        let training = session.plan().training.clone().unwrap();
        let updates: Vec<&str> = training.updates.iter().map(String::as_str).collect();
        let program = session.program(&[&training.loss_node], &updates).unwrap();
        assert_eq!(program.partitions().len(), replicas);
        (0..4).map(|i| session.run(&program, &sliced(i, replicas)).unwrap()[0].to_vec::<f32>()[0]).collect()
    };
    let (losses_one, losses_two) = (run(&mut one, 1), run(&mut two, 2));
    for (a, b) in losses_one.iter().zip(&losses_two) {
        assert!((a - b).abs() <= 1e-5 * a.abs().max(1.0), "{losses_one:?} vs {losses_two:?}");
    }
    let all = two.all_variables().unwrap();
    assert_eq!(all.get("replica_1/w"), all.get("w"), "every copy takes the same update");

    // A checkpoint of two replicas restores into one, and into two (copies included).
    let saved: BTreeMap<String, Tensor> =
        two.variables().unwrap().iter().map(|(n, t)| (n.clone(), t.clone())).collect();
    let path = std::path::Path::new("saved.safetensors");
    let mut fresh_one = Session::new(&one_plan, 0).unwrap();
    fresh_one.restore(&saved, path).unwrap();
    assert_eq!(fresh_one.variables().unwrap(), two.variables().unwrap());
    let mut fresh_two = Session::new(&two_plan, 0).unwrap();
    fresh_two.restore(&saved, path).unwrap();
    assert_eq!(fresh_two.all_variables().unwrap(), two.all_variables().unwrap());

    // A checkpoint that lacks a variable changes nothing.
    let before = fresh_two.all_variables().unwrap();
    let error = fresh_two.restore(&BTreeMap::new(), path).unwrap_err();
    assert!(error.to_string().contains("has no variable `w`"), "{error}");
    assert_eq!(fresh_two.all_variables().unwrap(), before);
}

#[test]
fn a_worker_holds_the_variables_of_its_own_partitions_only() {
    let plan = mirrored_plan(2);
    let whole = Session::new(&plan, 11).unwrap();
    let first = Session::hosting(&plan, 11, dfc_driver::Backend::Interp, &[0]).unwrap();
    let mut second = Session::hosting(&plan, 11, dfc_driver::Backend::Interp, &[1]).unwrap();
    let names = |session: &Session<'_>| -> Vec<String> {
        session.all_variables().unwrap().iter().map(|(n, _)| n.clone()).collect()
    };
    assert_eq!(names(&first), ["w"]);
    assert_eq!(names(&second), ["replica_1/w"], "not the original, which the other worker holds");
    assert_eq!(
        second.all_variables().unwrap().get("replica_1/w"),
        whole.variables().unwrap().get("w"),
        "a copy starts as its original"
    );
    assert_eq!(first.variables().unwrap(), whole.variables().unwrap());
    assert!(second.variables().unwrap().iter().next().is_none(), "checkpoints take the original from its own worker");

    // A checkpoint restores the copy from the original's saved value.
    let saved = BTreeMap::from([("w".to_string(), Tensor::from_vec(vec![3, 1], vec![1f32, 2.0, 3.0]))]);
    second.restore(&saved, std::path::Path::new("saved.safetensors")).unwrap();
    assert_eq!(second.all_variables().unwrap().get("replica_1/w"), Some(&saved["w"]));
    assert_eq!(names(&second), ["replica_1/w"]);
}

/// An assignment yields its variable's new value, and that value stays what it was when the
/// variable is assigned again before the value is used: `counted = (runs += 1)`, then
/// `runs = 0`, then `twice = counted * 2` gives 2, not 0, on every backend. (The native
/// scheduler once handed out the variable's own buffer, which the reset had overwritten.)
#[test]
fn an_assignments_value_outlives_a_later_assignment() {
    let devs = devices(1);
    let mut m = Builder::new();
    m.on(&devs[0]);
    let runs = m.add(
        Op::Variable { ty: f32_ty(&[4]), init: Initializer::Zeros, trainable: false, partitions: 1, origin: None },
        &[],
        "runs",
    );
    let ones = Op::Const { value: ConstValue::from_f64(DType::F32, Shape::from(vec![4]), &[1.0; 4]) };
    let one = m.add(ones, &[], "ones");
    let counted = m.add(Op::AssignAdd, &[runs, one], "counted");
    let zero = m.scalar("zero", 0.0);
    let zeros = m.binary(BinaryOp::Mul, counted, zero, "zeros");
    let reset = m.add(Op::Assign, &[runs, zeros], "reset");
    let two = m.scalar("two", 2.0);
    let twice = m.binary(BinaryOp::Mul, counted, two, "twice");
    m.graph.add_control_edge(reset, twice);
    let module = Module {
        name: "reset".into(),
        graph: m.graph,
        params: vec![runs],
        outputs: vec![Output { name: "twice".into(), tensor: twice.into() }],
        ..Module::default()
    };
    let plan = Plan::build(
        &module,
        split(&module, &devs),
        Cluster::local(1, DeviceKind::Cpu),
        StrategySpec::default(),
        "reset.df",
        "",
    );
    for backend in [dfc_driver::Backend::Interp, dfc_driver::Backend::Llvm] {
        let mut session = Session::with_backend(&plan, 0, backend).unwrap();
        let program = session.program(&["twice"], &["reset"]).unwrap();
        let out = session.run(&program, &HashMap::new()).unwrap();
        assert_eq!(out[0].to_vec::<f32>(), [2.0; 4], "{backend:?}");
        assert_eq!(session.variables().unwrap().get("runs").unwrap().to_vec::<f32>(), [0.0; 4], "{backend:?}");
    }
}
