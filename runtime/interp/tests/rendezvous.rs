//! Partitions that meet: `Send`/`Recv` and `AllReduce` through a rendezvous, `schedule`, aborts
//! and timeouts, and the initial values of shards and replicas' copies.

use dfc_interp::{initialize, schedule, try_initialize, InProcessRendezvous, InterpError, Program, Rendezvous, Tensor};
use dfc_ir::{
    BinaryOp, ConstValue, DType, DeviceSpec, Graph, Initializer, Module, NodeId, Op, Shape, TensorType, VariableOrigin,
};
use std::collections::HashMap;
use std::time::{Duration, Instant};

fn f32_ty(dims: &[usize]) -> TensorType {
    TensorType::new(DType::F32, dims.to_vec())
}

fn device(i: u32) -> DeviceSpec {
    DeviceSpec::parse(&format!("/job:localhost/task:0/cpu:{i}")).unwrap()
}

fn constant(dims: &[usize], values: &[f64]) -> Op {
    Op::Const { value: ConstValue::from_f64(DType::F32, Shape(dims.to_vec()), values) }
}

fn feeds(name: &str, t: Tensor) -> HashMap<String, Tensor> {
    HashMap::from([(name.to_string(), t)])
}

/// Partition A: `x`, sends `2x` as `there`, receives `back` and outputs `back + x`. Its `Recv`
/// is created first, so that A alone would run it before its `Send`.
/// Partition B: receives `there`, sends `there + 1` as `back`.
struct Exchange {
    a: Module,
    b: Module,
    out: NodeId,
    a_send: NodeId,
    b_send: NodeId,
}

fn exchange() -> Exchange {
    let mut g = Graph::new();
    let back = g.add(Op::Recv { key: "back".into(), from: device(1), ty: f32_ty(&[3]) }, &[], "back", None).unwrap();
    let x = g.add(Op::Input { ty: f32_ty(&[3]) }, &[], "x", None).unwrap();
    let two = g.add(constant(&[], &[2.0]), &[], "two", None).unwrap();
    let twice = g.add(Op::Binary(BinaryOp::Mul), &[x.into(), two.into()], "twice", None).unwrap();
    let a_send = g.add(Op::Send { key: "there".into(), to: device(1) }, &[twice.into()], "send_there", None).unwrap();
    let out = g.add(Op::Binary(BinaryOp::Add), &[back.into(), x.into()], "out", None).unwrap();
    let a = Module { name: "a".into(), graph: g, inputs: vec![x], ..Module::default() };

    let mut g = Graph::new();
    let there = g.add(Op::Recv { key: "there".into(), from: device(0), ty: f32_ty(&[3]) }, &[], "there", None).unwrap();
    let one = g.add(constant(&[], &[1.0]), &[], "one", None).unwrap();
    let plus = g.add(Op::Binary(BinaryOp::Add), &[there.into(), one.into()], "plus", None).unwrap();
    let b_send = g.add(Op::Send { key: "back".into(), to: device(0) }, &[plus.into()], "send_back", None).unwrap();
    let b = Module { name: "b".into(), graph: g, ..Module::default() };
    for m in [&a, &b] {
        let problems = dfc_ir::verify(m, Default::default());
        assert!(problems.is_empty(), "{problems:?}");
    }
    Exchange { a, b, out, a_send, b_send }
}

/// Runs A (fetching `out`) and B on two threads with one rendezvous.
fn run_pair(e: &Exchange, a: &Program, b: &Program, rendezvous: &InProcessRendezvous) -> Result<Tensor, InterpError> {
    let x = Tensor::from_vec(vec![3], vec![1.0f32, -2.0, 0.5]);
    let mut vars_a = initialize(&e.a, 0);
    let mut vars_b = initialize(&e.b, 0);
    std::thread::scope(|s| {
        let other = s.spawn(|| {
            let result = b.run_with(&e.b, &mut vars_b, &HashMap::new(), rendezvous);
            if let Err(err) = &result {
                rendezvous.abort(&err.to_string());
            }
            result
        });
        let result = a.run_with(&e.a, &mut vars_a, &feeds("x", x), rendezvous);
        if let Err(err) = &result {
            rendezvous.abort(&err.to_string());
        }
        let other = other.join().unwrap();
        // The root cause, not the other partition's "aborted".
        match (result, other) {
            (Ok(mut out), Ok(_)) => Ok(out.remove(0)),
            (Err(InterpError::Aborted { .. }), Err(e)) | (Err(e), _) | (_, Err(e)) => Err(e),
        }
    })
}

#[test]
fn two_partitions_exchange_tensors_both_ways() {
    let e = exchange();
    let orders = schedule(&[&e.a, &e.b]).unwrap();
    let a = Program::with_order(&e.a, &[e.out.into()], &[e.a_send], &orders[0]).unwrap();
    let b = Program::with_order(&e.b, &[], &[e.b_send], &orders[1]).unwrap();
    assert_eq!(a.inputs(), ["x"]);
    for _ in 0..20 {
        let out = run_pair(&e, &a, &b, &InProcessRendezvous::new()).unwrap();
        // (2x + 1) + x
        assert_eq!(out.to_vec::<f32>(), [4.0, -5.0, 2.5]);
    }
}

#[test]
fn the_joint_schedule_sends_before_it_waits() {
    let e = exchange();
    let orders = schedule(&[&e.a, &e.b]).unwrap();
    let name = |id: &NodeId| e.a.graph.node(*id).name.clone();
    let a_order: Vec<String> = orders[0].iter().map(name).collect();
    let position = |n: &str| a_order.iter().position(|m| m == n).unwrap();
    assert!(position("send_there") < position("back"), "{a_order:?}");

    // Alone, A's oldest-first order receives before it sends: run that way, the partitions
    // wait for each other, and the timeout turns the deadlock into an error naming the key.
    let a = Program::new(&e.a, &[e.out.into()], &[e.a_send]).unwrap();
    let b = Program::new(&e.b, &[], &[e.b_send]).unwrap();
    let started = Instant::now();
    let error = run_pair(&e, &a, &b, &InProcessRendezvous::with_timeout(Duration::from_millis(200))).unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(10));
    match error {
        InterpError::RendezvousTimeout { key, .. } => assert!(key == "back" || key == "there", "{key}"),
        other => panic!("expected a timeout, got {other}"),
    }
}

#[test]
fn a_program_that_exchanges_needs_a_rendezvous() {
    let e = exchange();
    let a = Program::new(&e.a, &[e.out.into()], &[e.a_send]).unwrap();
    let mut vars = initialize(&e.a, 0);
    let x = Tensor::from_vec(vec![3], vec![1.0f32, 2.0, 3.0]);
    let error = a.run(&e.a, &mut vars, &feeds("x", x)).unwrap_err();
    assert!(matches!(&error, InterpError::NoRendezvous { node } if node == "back" || node == "send_there"), "{error}");
}

#[test]
fn a_received_tensor_is_checked_against_its_type() {
    let e = exchange();
    let orders = schedule(&[&e.a, &e.b]).unwrap();
    let a = Program::with_order(&e.a, &[e.out.into()], &[e.a_send], &orders[0]).unwrap();
    let rendezvous = InProcessRendezvous::new();
    rendezvous.send("back", Tensor::from_vec(vec![2], vec![1.0f32, 2.0])).unwrap();
    let mut vars = initialize(&e.a, 0);
    let x = Tensor::from_vec(vec![3], vec![1.0f32, 2.0, 3.0]);
    let error = a.run_with(&e.a, &mut vars, &feeds("x", x), &rendezvous).unwrap_err();
    assert!(matches!(&error, InterpError::RecvType { node, key, .. } if node == "back" && key == "back"), "{error}");
    assert!(error.to_string().contains("received f32[2]"), "{error}");
}

#[test]
fn a_key_sent_twice_is_a_conflict() {
    let rendezvous = InProcessRendezvous::new();
    rendezvous.send("k", Tensor::scalar(1.0f32)).unwrap();
    let error = rendezvous.send("k", Tensor::scalar(2.0f32)).unwrap_err();
    assert!(matches!(error, InterpError::RendezvousConflict { .. }), "{error}");
    // Every receiver gets the value.
    assert_eq!(rendezvous.recv("k").unwrap(), Tensor::scalar(1.0f32));
    assert_eq!(rendezvous.recv("k").unwrap(), Tensor::scalar(1.0f32));
}

/// One replica of an all-reduce over `group` replicas: `out = all_reduce(x)`.
fn replica(key: &str, group: u32, replicas: &[u32]) -> (Module, Vec<NodeId>) {
    let mut g = Graph::new();
    let mut outs = Vec::new();
    let mut inputs = Vec::new();
    for &r in replicas {
        let x = g.add(Op::Input { ty: f32_ty(&[4]) }, &[], &format!("x{r}"), None).unwrap();
        let op = Op::AllReduce { key: key.into(), group_size: group, replica: r };
        outs.push(g.add(op, &[x.into()], &format!("sum{r}"), None).unwrap());
        inputs.push(x);
    }
    (Module { name: "replica".into(), graph: g, inputs, ..Module::default() }, outs)
}

/// Values whose f32 sum depends on the order of the additions.
fn contribution(r: u32) -> Tensor {
    let values = match r {
        0 => [1.0e8f32, 0.1, 3.0, -7.5],
        1 => [1.0, 1.0e8, 0.2, 1.0e-3],
        _ => [-1.0e8, -1.0e8, 1.0e7, 2.5],
    };
    Tensor::from_vec(vec![4], values.to_vec())
}

fn in_order_sum(n: u32) -> Vec<f32> {
    let mut sum = contribution(0).to_vec::<f32>();
    for r in 1..n {
        for (s, v) in sum.iter_mut().zip(contribution(r).to_vec::<f32>()) {
            *s += v;
        }
    }
    sum
}

#[test]
fn three_replicas_get_the_identical_sum_in_replica_order() {
    let modules: Vec<(Module, Vec<NodeId>)> = (0..3).map(|r| replica("g", 3, &[r])).collect();
    let refs: Vec<&Module> = modules.iter().map(|(m, _)| m).collect();
    let orders = schedule(&refs).unwrap();
    let programs: Vec<Program> = modules
        .iter()
        .zip(&orders)
        .map(|((m, outs), order)| Program::with_order(m, &[outs[0].into()], &[], order).unwrap())
        .collect();
    let expected = in_order_sum(3);
    let reversed: Vec<f32> = (0..4)
        .map(|i| {
            let v = |r| contribution(r).to_vec::<f32>()[i];
            (v(2) + v(1)) + v(0)
        })
        .collect();
    assert_ne!(expected, reversed, "the check needs data whose sum depends on the order");
    for _ in 0..10 {
        let rendezvous = InProcessRendezvous::new();
        let results: Vec<Tensor> = std::thread::scope(|s| {
            // Replica 2 first, so arrival order differs from replica order.
            let handles: Vec<_> = (0..3usize)
                .rev()
                .map(|r| {
                    let (module, _) = &modules[r];
                    let (program, rendezvous) = (&programs[r], &rendezvous);
                    s.spawn(move || {
                        let mut vars = initialize(module, 0);
                        let fed = feeds(&format!("x{r}"), contribution(r as u32));
                        (r, program.run_with(module, &mut vars, &fed, rendezvous).unwrap().remove(0))
                    })
                })
                .collect();
            let mut results: Vec<(usize, Tensor)> = handles.into_iter().map(|h| h.join().unwrap()).collect();
            results.sort_by_key(|(r, _)| *r);
            results.into_iter().map(|(_, t)| t).collect()
        });
        for result in &results {
            let bits: Vec<u32> = result.to_vec::<f32>().iter().map(|v| v.to_bits()).collect();
            let want: Vec<u32> = expected.iter().map(|v| v.to_bits()).collect();
            assert_eq!(bits, want);
        }
    }
}

#[test]
fn replicas_on_one_device_reduce_together() {
    // Replicas 0 and 2 in one program, replica 1 in another.
    let (two, two_outs) = replica("g", 3, &[0, 2]);
    let (one, one_outs) = replica("g", 3, &[1]);
    let orders = schedule(&[&two, &one]).unwrap();
    let fetches: Vec<_> = two_outs.iter().map(|&o| o.into()).collect();
    let p_two = Program::with_order(&two, &fetches, &[], &orders[0]).unwrap();
    let p_one = Program::with_order(&one, &[one_outs[0].into()], &[], &orders[1]).unwrap();
    let rendezvous = InProcessRendezvous::new();
    let (from_two, from_one) = std::thread::scope(|s| {
        let handle = s.spawn(|| {
            let mut vars = initialize(&one, 0);
            p_one.run_with(&one, &mut vars, &feeds("x1", contribution(1)), &rendezvous).unwrap()
        });
        let mut vars = initialize(&two, 0);
        let fed = HashMap::from([("x0".to_string(), contribution(0)), ("x2".to_string(), contribution(2))]);
        let from_two = p_two.run_with(&two, &mut vars, &fed, &rendezvous).unwrap();
        (from_two, handle.join().unwrap())
    });
    let expected = in_order_sum(3);
    assert_eq!(from_two[0].to_vec::<f32>(), expected);
    assert_eq!(from_two[1].to_vec::<f32>(), expected);
    assert_eq!(from_one[0].to_vec::<f32>(), expected);
}

#[test]
fn all_reduce_checks_its_group() {
    let rendezvous = InProcessRendezvous::with_timeout(Duration::from_millis(100));
    let error = rendezvous.all_reduce("g", 2, 2, Tensor::scalar(1.0f32)).unwrap_err();
    assert!(matches!(error, InterpError::RendezvousConflict { .. }), "{error}");
    // Replica 0 of 2 alone: nobody joins, and the wait ends in a timeout naming the key.
    let error = rendezvous.all_reduce("g", 2, 0, Tensor::scalar(1.0f32)).unwrap_err();
    assert!(matches!(&error, InterpError::RendezvousTimeout { key, .. } if key == "g"), "{error}");
    assert!(error.to_string().contains("`g`"), "{error}");
    let error = rendezvous.all_reduce("g", 3, 1, Tensor::scalar(1.0f32)).unwrap_err();
    assert!(error.to_string().contains("group size"), "{error}");
    let error = rendezvous.all_reduce("g", 2, 1, Tensor::scalar(1.0f64)).unwrap_err();
    assert!(error.to_string().contains("f64"), "{error}");
}

#[test]
fn abort_wakes_a_blocked_recv() {
    let rendezvous = InProcessRendezvous::new(); // 60 s: only the abort can end the wait
    let started = Instant::now();
    let error = std::thread::scope(|s| {
        let waiter = s.spawn(|| rendezvous.recv("never"));
        let reducer = s.spawn(|| rendezvous.all_reduce("r", 2, 0, Tensor::scalar(1.0f32)));
        std::thread::sleep(Duration::from_millis(50));
        rendezvous.abort("partition /cpu:1 failed");
        let reduced = reducer.join().unwrap().unwrap_err();
        assert!(matches!(reduced, InterpError::Aborted { .. }), "{reduced}");
        waiter.join().unwrap().unwrap_err()
    });
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(error, InterpError::Aborted { reason: "partition /cpu:1 failed".into() });
    // Later calls fail too, with the first reason.
    rendezvous.abort("another");
    assert_eq!(rendezvous.recv("k").unwrap_err(), InterpError::Aborted { reason: "partition /cpu:1 failed".into() });
    assert!(rendezvous.send("k", Tensor::scalar(1.0f32)).is_err());
}

#[test]
fn abort_stops_a_program_waiting_in_recv() {
    let e = exchange();
    let orders = schedule(&[&e.a, &e.b]).unwrap();
    let a = Program::with_order(&e.a, &[e.out.into()], &[e.a_send], &orders[0]).unwrap();
    let rendezvous = InProcessRendezvous::new();
    let mut vars = initialize(&e.a, 0);
    let x = Tensor::from_vec(vec![3], vec![1.0f32, 2.0, 3.0]);
    let error = std::thread::scope(|s| {
        let run = s.spawn(|| a.run_with(&e.a, &mut vars, &feeds("x", x), &rendezvous));
        std::thread::sleep(Duration::from_millis(50));
        rendezvous.abort("b failed");
        run.join().unwrap().unwrap_err()
    });
    assert_eq!(error, InterpError::Aborted { reason: "b failed".into() });
}

#[test]
fn schedule_reports_a_cycle_through_keys() {
    // A: recv k2 -> send k1; B: recv k1 -> send k2.
    let make = |recv: &str, send: &str| {
        let mut g = Graph::new();
        let r = g.add(Op::Recv { key: recv.into(), from: device(0), ty: f32_ty(&[]) }, &[], recv, None).unwrap();
        g.add(Op::Send { key: send.into(), to: device(1) }, &[r.into()], &format!("send_{send}"), None).unwrap();
        Module { graph: g, ..Module::default() }
    };
    let (a, b) = (make("k2", "k1"), make("k1", "k2"));
    let error = schedule(&[&a, &b]).unwrap_err();
    assert!(matches!(error, InterpError::Cycle { .. }), "{error}");
}

fn variable(dims: &[usize], init: Initializer, origin: Option<VariableOrigin>) -> Op {
    Op::Variable { ty: f32_ty(dims), init, trainable: true, partitions: 1, origin: origin.map(Box::new) }
}

fn origin(name: &str, shape: &[usize], offset: usize, mirror_of: Option<&str>) -> Option<VariableOrigin> {
    Some(VariableOrigin {
        name: name.into(),
        shape: Shape(shape.to_vec()),
        offset,
        mirror_of: mirror_of.map(String::from),
    })
}

fn rows(t: &Tensor, begin: usize, n: usize) -> Vec<f32> {
    let width: usize = t.shape.dims()[1..].iter().product();
    t.to_vec::<f32>()[begin * width..(begin + n) * width].to_vec()
}

#[test]
fn shards_and_copies_start_from_their_origins_value() {
    for init in [Initializer::GlorotUniform, Initializer::HeNormal, Initializer::Normal { mean: 1.0, stddev: 2.0 }] {
        let mut g = Graph::new();
        g.add(variable(&[7, 5], init.clone(), None), &[], "emb", None).unwrap();
        let whole = Module { graph: g, ..Module::default() };
        let whole = initialize(&whole, 42).get("emb").unwrap().clone();

        let mut g = Graph::new();
        g.add(variable(&[3, 5], init.clone(), origin("emb", &[7, 5], 0, None)), &[], "emb/part_0", None).unwrap();
        g.add(variable(&[4, 5], init.clone(), origin("emb", &[7, 5], 3, None)), &[], "emb/part_1", None).unwrap();
        // A replica's copy of shard 1, and a whole copy.
        let copy = origin("emb", &[7, 5], 3, Some("emb/part_1"));
        g.add(variable(&[4, 5], init.clone(), copy), &[], "replica_1/emb/part_1", None).unwrap();
        g.add(variable(&[7, 5], init.clone(), origin("emb", &[7, 5], 0, Some("emb"))), &[], "r1/emb", None).unwrap();
        let sharded = Module { graph: g, ..Module::default() };
        let values = initialize(&sharded, 42);
        assert_eq!(values.get("emb/part_0").unwrap().to_vec::<f32>(), rows(&whole, 0, 3), "{init}");
        assert_eq!(values.get("emb/part_1").unwrap().to_vec::<f32>(), rows(&whole, 3, 4), "{init}");
        assert_eq!(values.get("replica_1/emb/part_1").unwrap(), values.get("emb/part_1").unwrap());
        assert_eq!(values.get("r1/emb").unwrap(), &whole);
        assert_eq!(values.get("emb/part_1").unwrap().shape, Shape(vec![4, 5]));
    }
}

#[test]
fn an_origin_that_does_not_contain_the_variable_is_an_error() {
    for (dims, offset) in [(&[4usize, 5][..], 4usize), (&[3, 6][..], 0), (&[3][..], 0), (&[][..], 0)] {
        let mut g = Graph::new();
        let op = variable(dims, Initializer::GlorotUniform, origin("emb", &[7, 5], offset, None));
        g.add(op, &[], "emb/part_1", None).unwrap();
        let module = Module { graph: g, ..Module::default() };
        let error = try_initialize(&module, 0).unwrap_err();
        assert!(matches!(&error, InterpError::Malformed { node, .. } if node == "emb/part_1"), "{error}");
    }
}

#[test]
fn an_order_must_put_every_node_after_its_operands() {
    let e = exchange();
    let mut order = schedule(&[&e.a]).unwrap().remove(0);
    // Every node after the ones it depends on: fine, in any such order.
    Program::with_order(&e.a, &[e.out.into()], &[e.a_send], &order).unwrap();
    order.reverse();
    let error = Program::with_order(&e.a, &[e.out.into()], &[e.a_send], &order).unwrap_err();
    assert!(matches!(error, InterpError::Malformed { .. }), "{error}");
    let error = Program::with_order(&e.a, &[e.out.into()], &[e.a_send], &order[1..]).unwrap_err();
    assert!(error.to_string().contains("leaves it out"), "{error}");
    // A send has no output to fetch.
    let error = Program::new(&e.a, &[e.a_send.into()], &[]).unwrap_err();
    assert!(matches!(error, InterpError::UnknownNode { .. }), "{error}");
}
