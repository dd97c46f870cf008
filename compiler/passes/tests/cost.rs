//! The cost model on hand-built partitions: FLOPs of single ops against hand-computed values,
//! and step simulations whose times follow from the rates by hand.

use dfc_ir::{
    DType, DeviceSpec, Initializer, Module, NodeId, Op, Padding, ReduceKind, Shape, TensorRef, TensorType, UnaryOp,
};
use dfc_passes::cost::{estimate, estimate_on, node_flops, tensor_bytes, transfer_seconds};
use dfc_passes::{CostModel, CostReport, Topology};

fn f32(dims: &[usize]) -> TensorType {
    TensorType::new(DType::F32, dims.to_vec())
}

fn device(text: &str) -> DeviceSpec {
    DeviceSpec::parse(text).unwrap()
}

const A: &str = "/job:worker/task:0/cpu:0";
const B: &str = "/job:worker/task:1/cpu:0";
const C: &str = "/job:worker/task:2/cpu:0";
const D: &str = "/job:worker/task:3/cpu:0";
/// In the same task as `A`.
const A1: &str = "/job:worker/task:0/cpu:1";

/// A partition on `on`: whatever `build` adds, every node then placed on `on`.
fn partition(on: &str, build: impl FnOnce(&mut Module)) -> Module {
    let mut module = Module { name: "m".into(), ..Module::default() };
    build(&mut module);
    let ids: Vec<NodeId> = module.graph.node_ids().collect();
    for id in ids {
        module.graph.node_mut(id).device = Some(device(on));
    }
    module
}

fn add(module: &mut Module, op: Op, inputs: &[TensorRef], name: &str) -> TensorRef {
    module.graph.add(op, inputs, name, None).unwrap().into()
}

fn input(module: &mut Module, ty: TensorType, name: &str) -> TensorRef {
    let id = module.graph.add(Op::Input { ty }, &[], name, None).unwrap();
    module.inputs.push(id);
    id.into()
}

/// A variable and its read.
fn weight(module: &mut Module, ty: TensorType, name: &str) -> TensorRef {
    let op = Op::Variable { ty, init: Initializer::Zeros, trainable: true, partitions: 1, origin: None };
    let id = module.graph.add(op, &[], name, None).unwrap();
    module.params.push(id);
    add(module, Op::Read, &[id.into()], &format!("{name}/read"))
}

fn matmul(module: &mut Module, a: TensorRef, b: TensorRef, name: &str) -> TensorRef {
    add(module, Op::MatMul { transpose_a: false, transpose_b: false }, &[a, b], name)
}

fn send(module: &mut Module, x: TensorRef, key: &str, to: &str) {
    add(module, Op::Send { key: key.into(), to: device(to) }, &[x], &format!("{key}/send"));
}

fn recv(module: &mut Module, key: &str, from: &str, ty: TensorType) -> TensorRef {
    add(module, Op::Recv { key: key.into(), from: device(from), ty }, &[], &format!("{key}/recv"))
}

/// The FLOPs of the one node named `name`.
fn flops_of(module: &Module, name: &str) -> f64 {
    let id = module.graph.node_ids().find(|&id| module.graph.node(id).name == name).expect("node exists");
    node_flops(&module.graph, id)
}

fn close(actual: f64, expected: f64) -> bool {
    (actual - expected).abs() <= 1e-12 * expected.abs().max(1e-9)
}

fn assert_close(actual: f64, expected: f64, what: &str) {
    assert!(close(actual, expected), "{what}: {actual} ≠ {expected}");
}

fn cost_of<'r>(report: &'r CostReport, on: &str) -> &'r dfc_passes::DeviceCost {
    report.devices.iter().find(|d| d.device == on).unwrap_or_else(|| panic!("no {on} in {report:?}"))
}

#[test]
fn matmul_flops_count_two_per_multiply_add() {
    let mut m = Module::default();
    let a = input(&mut m, f32(&[64, 128]), "a");
    let b = input(&mut m, f32(&[128, 256]), "b");
    matmul(&mut m, a, b, "plain");
    // Transposes move K: a^T is [64, 128] from [128, 64], b^T is [128, 256] from [256, 128].
    let at = input(&mut m, f32(&[128, 64]), "at");
    let bt = input(&mut m, f32(&[256, 128]), "bt");
    add(&mut m, Op::MatMul { transpose_a: true, transpose_b: true }, &[at, bt], "transposed");
    // Batch axes broadcast: [4, 2, 3] @ [3, 5] is four [2, 3] @ [3, 5].
    let x = input(&mut m, f32(&[4, 2, 3]), "x");
    let y = input(&mut m, f32(&[3, 5]), "y");
    matmul(&mut m, x, y, "batched");
    let p = input(&mut m, f32(&[1, 2, 3]), "p");
    let q = input(&mut m, f32(&[6, 3, 5]), "q");
    matmul(&mut m, p, q, "broadcast_batch");

    assert_eq!(flops_of(&m, "plain"), 2.0 * 64.0 * 128.0 * 256.0);
    assert_eq!(flops_of(&m, "transposed"), 2.0 * 64.0 * 128.0 * 256.0);
    assert_eq!(flops_of(&m, "batched"), 2.0 * 4.0 * 2.0 * 5.0 * 3.0);
    assert_eq!(flops_of(&m, "broadcast_batch"), 2.0 * 6.0 * 2.0 * 5.0 * 3.0);
}

#[test]
fn convolution_flops_and_their_gradients_agree() {
    let mut m = Module::default();
    let x = input(&mut m, f32(&[64, 28, 28, 3]), "x");
    let filter = input(&mut m, f32(&[3, 3, 3, 32]), "filter");
    let y = add(&mut m, Op::Conv2d { strides: [1, 1], padding: Padding::Valid }, &[x, filter], "conv");
    assert_eq!(m.graph.ty(y), &f32(&[64, 26, 26, 32]));
    let dy = input(&mut m, f32(&[64, 26, 26, 32]), "dy");
    let input_shape = Shape(vec![64, 28, 28, 3]);
    let backprop_input = Op::Conv2dBackpropInput { input_shape, strides: [1, 1], padding: Padding::Valid };
    add(&mut m, backprop_input, &[filter, dy], "conv/grad_input");
    let filter_shape = Shape(vec![3, 3, 3, 32]);
    let backprop_filter = Op::Conv2dBackpropFilter { filter_shape, strides: [1, 1], padding: Padding::Valid };
    add(&mut m, backprop_filter, &[x, dy], "conv/grad_filter");
    let pooled = add(&mut m, Op::MaxPool { window: [2, 2], strides: [2, 2], padding: Padding::Valid }, &[y], "pool");
    assert_eq!(m.graph.ty(pooled), &f32(&[64, 13, 13, 32]));

    // 2 · N·Ho·Wo · Kh·Kw·Cin·Cout.
    let conv = 2.0 * 64.0 * 26.0 * 26.0 * 3.0 * 3.0 * 3.0 * 32.0;
    assert_eq!(flops_of(&m, "conv"), conv);
    assert_eq!(flops_of(&m, "conv/grad_input"), conv);
    assert_eq!(flops_of(&m, "conv/grad_filter"), conv);
    assert_eq!(flops_of(&m, "pool"), 4.0 * 64.0 * 13.0 * 13.0 * 32.0);
}

#[test]
fn elementwise_reductions_and_data_movement() {
    let mut m = Module::default();
    let x = input(&mut m, f32(&[10, 20]), "x");
    add(&mut m, Op::Unary(UnaryOp::Relu), &[x], "relu");
    add(&mut m, Op::Unary(UnaryOp::Exp), &[x], "exp");
    add(&mut m, Op::Binary(dfc_ir::BinaryOp::Add), &[x, x], "add");
    add(&mut m, Op::Reduce { kind: ReduceKind::Sum, axes: vec![1], keep_dims: false }, &[x], "sum");
    add(&mut m, Op::Softmax { axis: 1 }, &[x], "softmax");
    add(&mut m, Op::Reshape { shape: Shape(vec![200]) }, &[x], "reshape");
    add(&mut m, Op::Transpose { perm: vec![1, 0] }, &[x], "transpose");
    add(&mut m, Op::AllReduce { key: "x".into(), group_size: 2, replica: 0 }, &[x], "all_reduce");
    let w = weight(&mut m, f32(&[10, 20]), "w");
    let var = m.params[0];

    assert_eq!(flops_of(&m, "relu"), 200.0);
    assert_eq!(flops_of(&m, "exp"), 4.0 * 200.0);
    assert_eq!(flops_of(&m, "add"), 200.0);
    assert_eq!(flops_of(&m, "sum"), 200.0);
    assert_eq!(flops_of(&m, "softmax"), 5.0 * 200.0);
    assert_eq!(flops_of(&m, "reshape"), 0.0);
    assert_eq!(flops_of(&m, "transpose"), 0.0);
    assert_eq!(flops_of(&m, "all_reduce"), 200.0);
    assert_eq!(node_flops(&m.graph, w.node), 0.0);
    assert_eq!(node_flops(&m.graph, var), 0.0);
    assert_eq!(node_flops(&m.graph, x.node), 0.0);
}

#[test]
fn bytes_saturate_and_transfers_depend_on_where() {
    assert_eq!(tensor_bytes(&f32(&[64, 256])), 64 * 256 * 4);
    assert_eq!(tensor_bytes(&TensorType::scalar(DType::F64)), 8);
    assert_eq!(tensor_bytes(&f32(&[usize::MAX, usize::MAX])), u64::MAX);

    let model = CostModel::default();
    assert_eq!(transfer_seconds(1 << 20, &device(A), &device(A), &model), 0.0);
    assert_close(transfer_seconds(1 << 20, &device(A), &device(A1), &model), (1 << 20) as f64 / 10e9, "local");
    assert_close(
        transfer_seconds(1 << 20, &device(A), &device(B), &model),
        (1 << 20) as f64 / 1.25e9 + 50e-6,
        "remote",
    );
}

/// `x @ w1` on `first`, sent to `second`, which computes `y @ w2`.
fn chain(first: &str, second: &str) -> (Module, Module) {
    let a = partition(first, |m| {
        let x = input(m, f32(&[64, 128]), "x");
        let w1 = weight(m, f32(&[128, 256]), "w1");
        let y = matmul(m, x, w1, "y");
        send(m, y, "y", second);
    });
    let b = partition(second, |m| {
        let y = recv(m, "y", first, f32(&[64, 256]));
        let w2 = weight(m, f32(&[256, 10]), "w2");
        matmul(m, y, w2, "z");
    });
    (a, b)
}

#[test]
fn a_chain_over_two_tasks_adds_compute_transfer_and_compute() {
    let model = CostModel::default();
    let (a, b) = chain(A, B);
    let report = estimate(&[&a, &b], &model);

    let compute_a = 2.0 * 64.0 * 128.0 * 256.0 / model.flops_per_second;
    let compute_b = 2.0 * 64.0 * 256.0 * 10.0 / model.flops_per_second;
    let bytes = 64 * 256 * 4;
    let transfer = bytes as f64 / model.remote_bytes_per_second + model.remote_latency_seconds;
    assert_close(report.step_seconds, compute_a + transfer + compute_b, "step");

    let (da, db) = (cost_of(&report, A), cost_of(&report, B));
    assert_eq!((da.bytes_sent, da.bytes_received), (bytes, 0));
    assert_eq!((db.bytes_sent, db.bytes_received), (0, bytes));
    assert_eq!(da.variable_bytes, 128 * 256 * 4);
    assert_eq!(db.variable_bytes, 256 * 10 * 4);
    assert_eq!(da.flops, 2.0 * 64.0 * 128.0 * 256.0);
    assert_close(da.compute_seconds, compute_a, "compute on A");
    assert_close(da.finish_seconds, compute_a, "A finishes when it has sent");
    assert_close(db.finish_seconds, report.step_seconds, "B finishes last");

    // The path runs from A's matmul through the transfer to B's.
    assert_eq!(report.critical_path.len(), 2, "{:?}", report.critical_path);
    assert!(report.critical_path[0].starts_with(&format!("{A}: ")), "{:?}", report.critical_path);
    assert!(report.critical_path[0].ends_with(" … y/send (4 ops)"), "{:?}", report.critical_path);
    assert_eq!(report.critical_path[1], format!("{B}: y/recv … z (2 ops)"));
    assert_eq!(report.model.as_ref(), Some(&model));

    // Within one task the transfer takes the local bandwidth and no latency.
    let (a, b) = chain(A, A1);
    let report = estimate(&[&a, &b], &model);
    let local = bytes as f64 / model.local_bytes_per_second;
    assert_close(report.step_seconds, compute_a + local + compute_b, "step within a task");
}

#[test]
fn independent_work_on_two_devices_overlaps() {
    let model = CostModel::default();
    let work = |on: &str, n: usize| {
        partition(on, |m| {
            let x = input(m, f32(&[n, n]), "x");
            let w = weight(m, f32(&[n, n]), "w");
            matmul(m, x, w, "y");
        })
    };
    let (a, b) = (work(A, 256), work(B, 128));
    let report = estimate(&[&a, &b], &model);
    let compute_a = 2.0 * 256f64.powi(3) / model.flops_per_second;
    let compute_b = 2.0 * 128f64.powi(3) / model.flops_per_second;
    assert_close(report.step_seconds, compute_a.max(compute_b), "step");
    assert_close(cost_of(&report, A).finish_seconds, compute_a, "A");
    assert_close(cost_of(&report, B).finish_seconds, compute_b, "B");
    // Inputs ready at the same time tie; the path takes the one that finished last.
    assert_eq!(report.critical_path, vec![format!("{A}: w … y (3 ops)")]);
}

#[test]
fn one_device_runs_one_node_at_a_time() {
    let model = CostModel::default();
    let a = partition(A, |m| {
        let x = input(m, f32(&[128, 128]), "x");
        let w = weight(m, f32(&[128, 128]), "w");
        matmul(m, x, w, "y1");
        matmul(m, x, w, "y2");
    });
    let report = estimate(&[&a], &model);
    assert_close(report.step_seconds, 2.0 * 2.0 * 128f64.powi(3) / model.flops_per_second, "step");
    // y2 waited for the device, not for its inputs: the path goes through y1 (w, w/read, y1,
    // y2).
    assert_eq!(report.critical_path, vec![format!("{A}: w … y2 (4 ops)")]);
}

#[test]
fn an_all_reduce_costs_the_ring_formula() {
    let model = CostModel::default();
    let n = 1000;
    let replica = |on: &str, r: u32, work: bool| {
        partition(on, |m| {
            let mut g = input(m, f32(&[n]), "g");
            if work {
                g = add(m, Op::Unary(UnaryOp::Exp), &[g], "exp");
            }
            add(m, Op::AllReduce { key: "g".into(), group_size: 2, replica: r }, &[g], "g/all_reduce");
        })
    };
    let bytes = (n * 4) as u64;
    // Each member sends and receives 2(n−1)/n of the tensor; across tasks every one of the
    // 2(n−1) steps pays the latency.
    let ring = bytes as f64 / model.remote_bytes_per_second + 2.0 * model.remote_latency_seconds;

    let (a, b) = (replica(A, 0, false), replica(B, 1, false));
    let report = estimate(&[&a, &b], &model);
    assert_close(report.step_seconds, ring, "step");
    for d in &report.devices {
        assert_eq!((d.bytes_sent, d.bytes_received), (bytes, bytes), "{}", d.device);
        assert_close(d.finish_seconds, ring, &d.device);
    }

    // The reduction starts when the slower member's operand is ready, and the path says so.
    let (a, b) = (replica(A, 0, true), replica(B, 1, false));
    let report = estimate(&[&a, &b], &model);
    let exp = 4.0 * n as f64 / model.flops_per_second;
    assert_close(report.step_seconds, exp + ring, "step after work on A");
    assert!(report.critical_path[0].starts_with(&format!("{A}: g … ")), "{:?}", report.critical_path);

    // Within a task: the local bandwidth, no latency.
    let (a, b) = (replica(A, 0, false), replica(A1, 1, false));
    let report = estimate(&[&a, &b], &model);
    assert_close(report.step_seconds, bytes as f64 / model.local_bytes_per_second, "local step");
}

#[test]
fn a_round_trip_does_not_stall_on_an_early_recv() {
    // A sends x @ w forward to B and gets the result back; its Recv is a source node, so it
    // comes first in A's topological order. A device that waited for it in order would
    // never send.
    let model = CostModel::default();
    let a = partition(A, |m| {
        let back = recv(m, "back", B, f32(&[32, 32]));
        let x = input(m, f32(&[32, 32]), "x");
        let w = weight(m, f32(&[32, 32]), "w");
        let y = matmul(m, x, w, "y");
        send(m, y, "forth", B);
        add(m, Op::Unary(UnaryOp::Tanh), &[back], "out");
    });
    let b = partition(B, |m| {
        let y = recv(m, "forth", A, f32(&[32, 32]));
        let z = add(m, Op::Unary(UnaryOp::Relu), &[y], "z");
        send(m, z, "back", A);
    });
    let report = estimate(&[&a, &b], &model);
    let rate = model.flops_per_second;
    let transfer = (32 * 32 * 4) as f64 / model.remote_bytes_per_second + model.remote_latency_seconds;
    let expected = 2.0 * 32f64.powi(3) / rate + transfer + 1024.0 / rate + transfer + 4.0 * 1024.0 / rate;
    assert_close(report.step_seconds, expected, "step");
    assert_eq!(report.critical_path.len(), 3, "{:?}", report.critical_path);
    assert!(report.critical_path[2].starts_with(&format!("{A}: back/recv … out")), "{:?}", report.critical_path);
}

#[test]
fn broken_pairings_do_not_hang_or_panic() {
    let model = CostModel::default();
    // A Recv whose Send is missing arrives at the start.
    let lonely = partition(B, |m| {
        let y = recv(m, "nobody", A, f32(&[4]));
        add(m, Op::Unary(UnaryOp::Relu), &[y], "z");
    });
    let report = estimate(&[&lonely], &model);
    assert_close(report.step_seconds, 4.0 / model.flops_per_second, "step");

    // A cycle through two pairs: nothing on it ever runs, the rest does.
    let a = partition(A, |m| {
        let x = recv(m, "ab", B, f32(&[4]));
        send(m, x, "ba", B);
        input(m, f32(&[4]), "free");
    });
    let b = partition(B, |m| {
        let x = recv(m, "ba", A, f32(&[4]));
        send(m, x, "ab", A);
    });
    let report = estimate(&[&a, &b], &model);
    assert_eq!(report.devices.len(), 2);
    assert_eq!(report.step_seconds, 0.0);

    // All-reduces that programs meet in crossed orders, a key twice in one program, and a
    // group smaller than it says: what can finish does, in place and overlapped alike.
    let reduce = |m: &mut Module, key: &str, x: TensorRef, replica: u32| {
        let op = Op::AllReduce { key: key.into(), group_size: 3, replica };
        add(m, op, &[x], &format!("{key}/{replica}"))
    };
    let crossed = |on: &str, first: &str, second: &str, r: u32| {
        partition(on, |m| {
            let x = input(m, f32(&[4]), "x");
            let y = add(m, Op::Unary(UnaryOp::Exp), &[x], "y");
            reduce(m, first, y, r);
            let z = add(m, Op::Unary(UnaryOp::Exp), &[y], "z");
            reduce(m, second, z, r);
            reduce(m, "twice", z, r);
            reduce(m, "twice", y, r + 10);
        })
    };
    let (a, b) = (crossed(A, "p", "q", 0), crossed(B, "q", "p", 1));
    for overlap in [false, true] {
        let topology = Topology { overlap, ..Topology::of_tasks(&[&a, &b]) };
        let report = estimate_on(&[&a, &b], &model, &topology);
        assert!(report.step_seconds.is_finite(), "{report:?}");
    }

    let empty = estimate(&[], &model);
    assert!(empty.devices.is_empty() && empty.critical_path.is_empty());
    assert_eq!(empty.step_seconds, 0.0);
}

#[test]
fn ten_thousand_nodes_over_64_partitions() {
    let model = CostModel::default();
    let parts = 64;
    let name = |p: usize| format!("/job:worker/task:{}/cpu:{}", p / 8, p % 8);
    let partitions: Vec<Module> = (0..parts)
        .map(|p| {
            partition(&name(p), |m| {
                // Receive the previous partition's activation, run a chain of layers, send it
                // on; every partition then joins an all-reduce of its result.
                let mut h = if p == 0 {
                    input(m, f32(&[16, 16]), "x")
                } else {
                    recv(m, &format!("h{p}"), &name(p - 1), f32(&[16, 16]))
                };
                for layer in 0..40 {
                    let w = weight(m, f32(&[16, 16]), &format!("w{layer}"));
                    h = matmul(m, h, w, &format!("layer{layer}"));
                    h = add(m, Op::Unary(UnaryOp::Tanh), &[h], &format!("act{layer}"));
                }
                if p + 1 < parts {
                    send(m, h, &format!("h{}", p + 1), &name(p + 1));
                }
                let sum = Op::AllReduce { key: "h".into(), group_size: parts as u32, replica: p as u32 };
                add(m, sum, &[h], "sum");
            })
        })
        .collect();
    let refs: Vec<&Module> = partitions.iter().collect();
    let total: usize = partitions.iter().map(|m| m.graph.len()).sum();
    assert!(total >= 10_000, "{total} nodes");

    let started = std::time::Instant::now();
    let report = estimate(&refs, &model);
    eprintln!("estimate of {total} nodes over {parts} partitions: {:?}", started.elapsed());

    assert_eq!(report.devices.len(), parts);
    for p in 0..parts {
        let cost = cost_of(&report, &name(p));
        assert!(cost.finish_seconds > 0.0, "{}", cost.device);
    }
    assert!(report.step_seconds > 0.0);
    // The activation's trip through all partitions, then the all-reduce that waits for the
    // last, decide the step.
    assert!(report.critical_path.len() >= parts, "{:?}", report.critical_path);
    for (p, entry) in report.critical_path.iter().take(parts).enumerate() {
        assert!(entry.starts_with(&format!("{}: ", name(p))), "{p}: {:?}", report.critical_path);
    }
    let shown = report.to_string();
    assert!(shown.contains(&name(63)) && shown.contains("predicted step time: "), "{shown}");
}

#[test]
fn the_report_prints_a_table_the_step_the_path_and_the_rates() {
    let (a, b) = chain(A, B);
    let report = estimate(&[&a, &b], &CostModel::default());
    let text = report.to_string();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], "cost of one step (predicted)");
    assert!(lines[1].split_whitespace().eq([
        "device",
        "variables",
        "GFLOP",
        "sent",
        "received",
        "compute",
        "ms",
        "finish",
        "ms"
    ]));
    let row: Vec<&str> = lines[2].split_whitespace().collect();
    assert_eq!(row[..9], [A, "128.0", "KiB", "0.004", "64.0", "KiB", "0", "B", "0.084"], "{text}");
    assert!(lines.iter().any(|l| l.starts_with("predicted step time: ") && l.ends_with(" µs")), "{text}");
    assert!(lines.contains(&"critical path"), "{text}");
    assert!(lines.contains(&format!("  {B}: y/recv … z (2 ops)").as_str()), "{text}");
    assert_eq!(
        *lines.last().unwrap(),
        "assumed: 50 GFLOP/s per device, 10 GB/s within a task, 1.25 GB/s and 50 µs latency between tasks"
    );
}

/// A profile whose products take `2mnk / (rate · threads)` at every measured size, whose
/// kernels cost 1 µs and 1 ns a byte (at 8 kB), and whose shared memory and TCP take 10 µs + 1 ns a byte
/// and 100 µs + 10 ns a byte; measured on 1 and 2 threads of a 2-thread CPU.
fn profile(rate: f64) -> dfc_passes::Profile {
    use dfc_passes::profile::{
        ConvFactors, Cpu, Curve, DrivenStep, Factors, PoolCosts, RowCost, Run, Throughput, PROFILE_VERSION,
    };
    let sizes = vec![1u32, 16, 256];
    let run = |threads: u32| {
        let mut nn = Vec::new();
        for &m in &sizes {
            for &n in &sizes {
                for &k in &sizes {
                    nn.push(2.0 * f64::from(m) * f64::from(n) * f64::from(k) / (rate * f64::from(threads)));
                }
            }
        }
        let row = RowCost { short_length: 16, short_seconds: 0.0, long_length: 256, long_seconds: 0.0 };
        // 1 µs and 1 ns a byte, at the sizes the tests use.
        let kernel = || Curve { points: vec![[8000.0, 9e-6], [8e6, 1e-6 + 8e-3]] };
        Run {
            threads,
            tn: nn.clone(),
            nt: nn.clone(),
            nn,
            conv: ConvFactors {
                forward: Factors::constant(1.0),
                backprop_input: Factors::constant(1.0),
                backprop_filter: Factors::constant(1.0),
            },
            // Poolings as dear as kernels of their bytes.
            pool: PoolCosts { max: kernel(), max_grad: kernel(), avg: kernel(), avg_grad: kernel() },
            kernel: kernel(),
            copy: Curve { points: vec![[1e3, 1e-6], [1e9, 1.0]] },
            handoff_seconds: 30e-6,
            transcendental_seconds: 0.0,
            row,
            exp_row: row,
            program_seconds: 0.0,
        }
    };
    dfc_passes::Profile {
        version: PROFILE_VERSION,
        cpu: Cpu { name: "test".into(), vendor: String::new(), family: 0, model: 0, features: vec![], threads: 2 },
        measured_at_unix: 0,
        dfc: "test".into(),
        runs: vec![run(1), run(2)],
        gemm_sizes: sizes,
        shared_memory: Throughput { latency_seconds: 10e-6, bytes_per_second: 1e9 },
        shared_memory_rings: vec![],
        tcp: Throughput { latency_seconds: 100e-6, bytes_per_second: 1e8 },
        // Busy workers cost what idle ones do, but where a test says otherwise.
        driven_step: DrivenStep {
            latency: Curve { points: vec![[1.0, 200e-6], [2.0, 300e-6]] },
            bytes_per_second: 1e9,
            busy: vec![],
            exchanging: Curve::default(),
        },
    }
}

/// The square product of `n` that `work` builds, on every thread of the profile's CPU.
fn product_seconds(n: usize, rate: f64, threads: f64) -> f64 {
    2.0 * (n as f64).powi(3) / (rate * threads)
}

fn square_product(on: &str, n: usize) -> Module {
    partition(on, |m| {
        let x = input(m, f32(&[n, n]), "x");
        let w = weight(m, f32(&[n, n]), "w");
        matmul(m, x, w, "y");
    })
}

#[test]
fn with_a_profile_partitions_of_one_process_take_turns_on_its_threads() {
    let rate = 50e9;
    let model = CostModel::calibrated(profile(rate));
    assert_eq!(model.calibration.as_deref(), Some("test ( family 0, model 0), 2 threads, measured 1970-01-01"));
    let (a, b) = (square_product(A, 256), square_product(A1, 128));
    let both = product_seconds(256, rate, 2.0) + product_seconds(128, rate, 2.0);
    // One process (one task): one after the other, each on both threads.
    let report = estimate(&[&a, &b], &model);
    assert_close(report.step_seconds, both, "one process");
    // Two processes on one host, one thread each: side by side, each at one thread's rate.
    let apart = Topology { process: vec![0, 1], host: vec![0, 0], threads: vec![1, 1], driven: false, overlap: false };
    let report = estimate_on(&[&a, &b], &model, &apart);
    assert_close(report.step_seconds, product_seconds(256, rate, 1.0), "two processes");
    // Four processes of one thread on two: twice as slow again.
    let (c, d) = (square_product(B, 16), square_product("/job:worker/task:2/cpu:0", 16));
    let crowded =
        Topology { process: vec![0, 1, 2, 3], host: vec![0; 4], threads: vec![1; 4], driven: false, overlap: false };
    let report = estimate_on(&[&a, &b, &c, &d], &model, &crowded);
    assert_close(report.step_seconds, 2.0 * product_seconds(256, rate, 1.0), "four processes on two threads");
    // Without a profile, every device computes on its own at the assumed rate.
    let report = estimate(&[&a, &b], &CostModel::default());
    assert_close(report.step_seconds, product_seconds(256, CostModel::default().flops_per_second, 1.0), "assumed");
    // The breakdown names the products.
    let report = estimate(&[&a, &b], &model);
    let by_kind = &cost_of(&report, A).by_kind;
    assert_eq!(by_kind.len(), 1);
    assert_eq!(by_kind[0].0, "matmul");
    assert_close(by_kind[0].1, product_seconds(256, rate, 2.0), "the products");
}

#[test]
fn with_a_profile_transfers_take_the_link_between_their_processes() {
    let rate = 50e9;
    let model = CostModel::calibrated(profile(rate));
    let (a, b) = chain(A, B);
    let bytes = 64.0 * 256.0 * 4.0;
    let on = |topology: &Topology| estimate_on(&[&a, &b], &model, topology).step_seconds;
    let hosts =
        on(&Topology { process: vec![0, 1], host: vec![0, 1], threads: vec![1, 1], driven: false, overlap: false });
    let host =
        on(&Topology { process: vec![0, 1], host: vec![0, 0], threads: vec![1, 1], driven: false, overlap: false });
    // The same compute either way (each process on one of its host's two threads); the link
    // differs.
    let tcp = 100e-6 + bytes * 1e-8;
    let shared = 10e-6 + bytes * 1e-9;
    assert_close(hosts - host, tcp - shared, "TCP against shared memory");
}

/// Between processes of one host the sender copies the bytes into the queue, half the link's
/// time of them: a process's sends to two others follow one another, and the second arrives
/// that much later. Between hosts nothing keeps the sender (TCP's buffers take the bytes).
#[test]
fn with_a_profile_a_sender_copies_its_sends_one_after_another() {
    let model = CostModel::calibrated(profile(50e9));
    let ty = f32(&[64, 256]);
    let a = partition(A, |m| {
        let x = input(m, ty.clone(), "x");
        send(m, x, "to_b", B);
        send(m, x, "to_c", C);
    });
    let b = partition(B, |m| {
        recv(m, "to_b", A, ty.clone());
    });
    let c = partition(C, |m| {
        recv(m, "to_c", A, ty.clone());
    });
    let bytes = 64.0 * 256.0 * 4.0;
    // Three processes of a thread each on the host's two: its copies, as its compute, slowed
    // by 3/2.
    let copy = bytes * 1e-9 / 2.0 * 1.5;
    let host =
        Topology { process: vec![0, 1, 2], host: vec![0; 3], threads: vec![1; 3], driven: false, overlap: false };
    let report = estimate_on(&[&a, &b, &c], &model, &host);
    let shared = 10e-6 + bytes * 1e-9;
    let finish: Vec<f64> = report.devices.iter().map(|d| d.finish_seconds).collect();
    assert_close(finish[0], 2.0 * copy, "the sender, after both copies");
    assert_close(finish[1].min(finish[2]), shared + copy - copy / 1.5, "the first receiver");
    assert_close(finish[1].max(finish[2]), shared + 2.0 * copy - copy / 1.5, "the second, one copy later");
    assert_eq!(cost_of(&report, A).by_kind, [("send".to_string(), 2.0 * copy)]);

    let hosts =
        Topology { process: vec![0, 1, 2], host: vec![0, 1, 2], threads: vec![1; 3], driven: false, overlap: false };
    let report = estimate_on(&[&a, &b, &c], &model, &hosts);
    let tcp = 100e-6 + bytes * 1e-8;
    let finish: Vec<f64> = report.devices.iter().map(|d| d.finish_seconds).collect();
    assert_close(finish[0], 0.0, "a sender to other hosts");
    assert_close(finish[1], tcp, "each receiver");
    assert_close(finish[2], tcp, "each receiver");
}

#[test]
fn with_a_profile_a_fused_kernel_costs_its_fixed_cost_and_bytes() {
    let model = CostModel::calibrated(profile(50e9));
    let a = partition(A, |m| {
        let x = input(m, f32(&[1000]), "x");
        let y = add(m, Op::Unary(UnaryOp::Relu), &[x], "y");
        let z = add(m, Op::Unary(UnaryOp::Neg), &[y], "z");
        m.outputs.push(dfc_ir::Output { name: "z".into(), tensor: z });
    });
    let report = estimate(&[&a], &model);
    // One kernel (relu and neg fused): reads 4000 bytes, writes 4000.
    assert_close(report.step_seconds, 1e-6 + 8000.0 * 1e-9, "one fused kernel");
    let by_kind = &cost_of(&report, A).by_kind;
    assert_eq!(by_kind.len(), 1);
    assert_eq!(by_kind[0].0, "kernel");
    assert_close(by_kind[0].1, 1e-6 + 8000.0 * 1e-9, "the kernel");
}

#[test]
fn with_a_profile_a_driven_worker_pays_the_drivers_call_and_its_feeds() {
    let model = CostModel::calibrated(profile(50e9));
    let a = square_product(A, 256);
    let here = Topology { process: vec![0], host: vec![0], threads: vec![0], driven: false, overlap: false };
    let driven = Topology { driven: true, ..here.clone() };
    let feeds = 256.0 * 256.0 * 4.0;
    let step = |t: &Topology| estimate_on(&[&a], &model, t).step_seconds;
    assert_close(step(&driven) - step(&here), 200e-6 + feeds * 1e-9, "the call and the feeds");
}

#[test]
fn with_a_profile_a_step_driven_on_more_workers_pays_their_calls_at_once() {
    let model = CostModel::calibrated(profile(50e9));
    let (a, b) = (square_product(A, 256), square_product(B, 256));
    let here = Topology { process: vec![0, 1], host: vec![0, 0], threads: vec![1, 1], driven: false, overlap: false };
    let step = |t: &Topology| estimate_on(&[&a, &b], &model, t).step_seconds;
    let feeds = 256.0 * 256.0 * 4.0;
    // The profile's fixed cost: 200 µs on one worker, 300 on two; beyond, growing with them.
    let two = Topology { driven: true, ..here.clone() };
    assert_close(step(&two) - step(&here), 300e-6 + feeds * 1e-9, "two workers' calls");
    let four = [square_product(A, 256), square_product(B, 256), square_product(C, 256), square_product(D, 256)];
    let parts: Vec<&Module> = four.iter().collect();
    let alone =
        Topology { process: vec![0, 1, 2, 3], host: vec![0; 4], threads: vec![1; 4], driven: false, overlap: false };
    let driven = Topology { driven: true, ..alone.clone() };
    let extra = estimate_on(&parts, &model, &driven).step_seconds - estimate_on(&parts, &model, &alone).step_seconds;
    assert_close(extra, 600e-6 + feeds * 1e-9, "four workers' calls");
}

#[test]
fn with_a_profile_a_busy_driven_worker_pays_more_for_the_call_as_it_computes_longer() {
    use dfc_passes::profile::{BusyStep, Curve};
    let mut profile = profile(50e9);
    // Workers computing 1 ms cost 500 µs more than idle ones on one worker, 900 on two; 4 ms,
    // 800 and 1,500 µs more.
    profile.driven_step.busy = vec![
        BusyStep { computing_seconds: 1e-3, latency: Curve { points: vec![[1.0, 700e-6], [2.0, 1200e-6]] } },
        BusyStep { computing_seconds: 4e-3, latency: Curve { points: vec![[1.0, 1000e-6], [2.0, 1800e-6]] } },
    ];
    let model = CostModel::calibrated(profile);
    let here = Topology { process: vec![0], host: vec![0], threads: vec![0], driven: false, overlap: false };
    let driven = Topology { driven: true, ..here.clone() };
    // Linear in the worker's compute: from the idle cost to the first busy one, on to the
    // second, and beyond it at the same slope.
    let busy = |computing: f64| {
        if computing < 1e-3 {
            500e-6 * computing / 1e-3
        } else {
            500e-6 + 300e-6 * (computing - 1e-3) / 3e-3
        }
    };
    for n in [64, 256, 512, 1024] {
        let a = square_product(A, n);
        let computing = estimate_on(&[&a], &model, &here).step_seconds;
        let feeds = (n * n * 4) as f64;
        let extra = estimate_on(&[&a], &model, &driven).step_seconds - computing;
        assert_close(extra, 200e-6 + busy(computing) + feeds * 1e-9, &format!("a worker computing {computing} s"));
    }
    // Two workers, each computing on one of the two cores.
    let (a, b) = (square_product(A, 512), square_product(B, 512));
    let two = Topology { process: vec![0, 1], host: vec![0, 0], threads: vec![1, 1], driven: false, overlap: false };
    let step = |t: &Topology| estimate_on(&[&a, &b], &model, t).step_seconds;
    let computing = step(&two);
    assert!(computing > 4e-3, "each worker computes longer than the busy ones measured: {computing}");
    let extra = step(&Topology { driven: true, ..two.clone() }) - computing;
    let busy = 1500e-6 + 600e-6 * (computing - 4e-3) / 3e-3;
    assert_close(extra, 300e-6 + busy + (512 * 512 * 4) as f64 * 1e-9, "two busy workers' calls");
}

/// Driven workers that wait for each other within the step (an all-reduce among them, a
/// receive from another) pay the profile's `exchanging` cost for as many workers; workers that
/// exchange nothing, and partitions of one process, do not.
#[test]
fn with_a_profile_driven_workers_that_exchange_pay_for_waiting_on_each_other() {
    use dfc_passes::profile::Curve;
    let mut profile = profile(50e9);
    profile.driven_step.exchanging = Curve { points: vec![[2.0, 400e-6], [4.0, 1000e-6]] };
    let model = CostModel::calibrated(profile);
    let n = 1000;
    let replica = |on: &str, r: u32| {
        partition(on, |m| {
            let g = input(m, f32(&[n]), "g");
            add(m, Op::AllReduce { key: "g".into(), group_size: 2, replica: r }, &[g], "g/all_reduce");
        })
    };
    let (a, b) = (replica(A, 0), replica(B, 1));
    let two = |driven| Topology { process: vec![0, 1], host: vec![0, 0], threads: vec![1, 1], driven, overlap: false };
    let step = |parts: &[&Module], t: &Topology| estimate_on(parts, &model, t).step_seconds;
    let feeds = (n * 4) as f64 * 1e-9;
    let called = step(&[&a, &b], &two(true)) - step(&[&a, &b], &two(false));
    assert_close(called, 300e-6 + feeds + 400e-6, "two workers all-reducing");
    // A receive from the other worker waits for it too.
    let sender = partition(A, |m| {
        let x = input(m, f32(&[n]), "x");
        send(m, x, "x", B);
    });
    let receiver = partition(B, |m| {
        let x = recv(m, "x", A, f32(&[n]));
        add(m, Op::Unary(UnaryOp::Exp), &[x], "exp");
    });
    let pair = [&sender, &receiver];
    let called = step(&pair, &two(true)) - step(&pair, &two(false));
    assert!(called >= 300e-6 + 400e-6, "a receive between two workers: {called}");
    // Two workers that do not exchange: the calls alone.
    let (c, d) = (square_product(A, 64), square_product(B, 64));
    let called = step(&[&c, &d], &two(true)) - step(&[&c, &d], &two(false));
    let feeds = (64 * 64 * 4) as f64 * 1e-9;
    assert!(called < 300e-6 + feeds + 100e-6, "two workers that do not exchange: {called}");
    // Both replicas in one driven process: no other worker to wait for.
    let one = Topology { process: vec![0, 0], host: vec![0, 0], threads: vec![2], driven: true, overlap: false };
    let alone = Topology { driven: false, ..one.clone() };
    let called = step(&[&a, &b], &one) - step(&[&a, &b], &alone);
    assert_close(called, 200e-6 + 2.0 * (n * 4) as f64 * 1e-9, "one worker");
}

/// A process's devices take turns on its threads: `take_turns` makes the step at least each
/// process's compute (instances costed as the partition they copy included), and leaves a
/// process alone whose devices already finish later than that.
#[test]
fn the_devices_of_one_process_take_turns() {
    let cost = |on: &str, compute: f64, finish: f64| dfc_passes::DeviceCost {
        device: on.into(),
        compute_seconds: compute,
        finish_seconds: finish,
        ..Default::default()
    };
    let names = ["/job:worker/task:0/cpu:0", "/job:worker/task:0/cpu:1", "/job:worker/task:1/cpu:0"];
    let mut report = CostReport {
        devices: vec![cost(names[0], 2.0, 2.5), cost(names[1], 2.0, 2.5), cost(names[2], 1.0, 3.0)],
        step_seconds: 3.0,
        ..Default::default()
    };
    // The first two devices in one process, the third in another (as their tasks are).
    let processes = Topology { process: vec![0, 0, 1], host: vec![0; 3], ..Topology::default() };
    dfc_passes::cost::take_turns(&mut report, &processes);
    let finish: Vec<f64> = report.devices.iter().map(|d| d.finish_seconds).collect();
    assert_eq!(finish, [4.0, 4.0, 3.0]);
    assert_eq!(report.step_seconds, 4.0);
    // Spawned workers, one device each (`dfc compile --spawn 3`): no turns to take.
    report.devices.iter_mut().for_each(|d| d.finish_seconds = 2.5);
    report.step_seconds = 2.5;
    dfc_passes::cost::take_turns(&mut report, &Topology::spawned(&[0, 1, 2], 3, 2));
    assert_eq!(report.step_seconds, 2.5);
}

/// `profile(50e9)` whose kernels beyond its largest measured (8 MB) take 3 ns a byte.
fn profile_with_memory() -> dfc_passes::Profile {
    let mut profile = profile(50e9);
    for run in &mut profile.runs {
        run.kernel.points.push([8e8, 8e8 * 3e-9]);
    }
    profile
}

/// A variable of `ty` (not its read).
fn variable(module: &mut Module, ty: TensorType, name: &str) -> TensorRef {
    let op = Op::Variable { ty, init: Initializer::Zeros, trainable: true, partitions: 1, origin: None };
    let id = module.graph.add(op, &[], name, None).unwrap();
    module.params.push(id);
    id.into()
}

#[test]
fn with_a_profile_an_update_reads_and_writes_its_state_beyond_the_caches() {
    let model = CostModel::calibrated(profile_with_memory());
    // w -= g: reads w and g, writes w; 8,000 of its 12,000 bytes are the variable's.
    let update = partition(A, |m| {
        let w = variable(m, f32(&[1000]), "w");
        let g = input(m, f32(&[1000]), "g");
        add(m, Op::AssignSub, &[w, g], "w/update");
    });
    // The same bytes, none of them state: z = x + g.
    let sum = partition(A, |m| {
        let x = input(m, f32(&[1000]), "x");
        let g = input(m, f32(&[1000]), "g");
        let z = add(m, Op::Binary(dfc_ir::BinaryOp::Add), &[x, g], "z");
        m.outputs.push(dfc_ir::Output { name: "z".into(), tensor: z });
    });
    let in_cache = estimate(&[&sum], &model).step_seconds;
    let from_memory = 8000.0 * (3e-9 - in_cache / 12000.0);
    assert!(from_memory > 0.0);
    assert_close(estimate(&[&update], &model).step_seconds, in_cache + from_memory, "the update");
    // A small kernel's fixed cost already covers its bytes from memory.
    let small = partition(A, |m| {
        let w = variable(m, f32(&[10]), "w");
        let g = input(m, f32(&[10]), "g");
        add(m, Op::AssignSub, &[w, g], "w/update");
    });
    let model = CostModel::calibrated(profile(50e9));
    let plain_small = estimate(&[&small], &model).step_seconds;
    assert_close(estimate(&[&small], &CostModel::calibrated(profile_with_memory())).step_seconds, plain_small, "small");
}

#[test]
fn with_a_profile_an_update_by_a_scaled_product_is_priced_inside_the_product() {
    let model = CostModel::calibrated(profile_with_memory());
    let product = |m: &mut Module| {
        let x = input(m, f32(&[256, 256]), "x");
        let dy = input(m, f32(&[256, 256]), "dy");
        add(m, Op::MatMul { transpose_a: true, transpose_b: false }, &[x, dy], "dw")
    };
    // w -= 0.01·(xᵀ·dy): one GEMM into w, as the CPU back end runs it.
    let folded = partition(A, |m| {
        let w = variable(m, f32(&[256, 256]), "w");
        let dw = product(m);
        let lr = m.graph.add(Op::Const { value: dfc_ir::ConstValue::scalar(DType::F32, 0.01) }, &[], "lr", None);
        let step = add(m, Op::Binary(dfc_ir::BinaryOp::Mul), &[lr.unwrap().into(), dw], "step");
        add(m, Op::AssignSub, &[w, step], "w/update");
    });
    let alone = partition(A, |m| {
        let dw = product(m);
        m.outputs.push(dfc_ir::Output { name: "dw".into(), tensor: dw });
    });
    let step = |module: &Module| estimate(&[module], &model).step_seconds;
    assert_close(step(&folded), step(&alone), "the folded update");
    assert_close(step(&alone), product_seconds(256, 50e9, 2.0), "the product");
    // Fetched, the gradient is stored and the update is a kernel of its own.
    let fetched = {
        let mut module = folded.clone();
        let dw = module.graph.node_ids().find(|&id| module.graph.node(id).name == "dw").unwrap();
        module.outputs.push(dfc_ir::Output { name: "dw".into(), tensor: dw.into() });
        module
    };
    assert!(step(&fetched) > step(&alone) * 1.01, "{} against {}", step(&fetched), step(&alone));
}

#[test]
fn a_program_runs_its_all_reduces_one_at_a_time_in_place_unless_overlapped() {
    // Per replica: g1 = exp(x), then h = exp(g1) and g2 = exp(h); g1 and g2 all-reduced, and
    // u1 = exp(sum of g1). Each exp takes e, each all-reduce r (< e here).
    let model = CostModel { flops_per_second: 1e9, ..CostModel::default() };
    let n = 1_000_000;
    let replica = |on: &str, r: u32| {
        partition(on, |m| {
            let x = input(m, f32(&[n]), "x");
            let g1 = add(m, Op::Unary(UnaryOp::Exp), &[x], "g1");
            let h = add(m, Op::Unary(UnaryOp::Exp), &[g1], "h");
            let g2 = add(m, Op::Unary(UnaryOp::Exp), &[h], "g2");
            let s1 = add(m, Op::AllReduce { key: "g1".into(), group_size: 2, replica: r }, &[g1], "g1/all_reduce");
            add(m, Op::AllReduce { key: "g2".into(), group_size: 2, replica: r }, &[g2], "g2/all_reduce");
            add(m, Op::Unary(UnaryOp::Exp), &[s1], "u1");
        })
    };
    let (a, b) = (replica(A, 0), replica(A1, 1));
    let e = 4.0 * n as f64 / model.flops_per_second;
    // The ring, or the additions (one a element) where they take longer.
    let r = ((n * 4) as f64 / model.local_bytes_per_second).max(n as f64 / model.flops_per_second);
    assert!(r < e);
    let step = |overlap: bool| {
        let topology = Topology { overlap, ..Topology::of_tasks(&[&a, &b]) };
        estimate_on(&[&a, &b], &model, &topology).step_seconds
    };
    // In place: the program starts an all-reduce when it has nothing else to do, and waits
    // for it: g1 h g2, g1's all-reduce, u1, g2's all-reduce.
    assert_close(step(false), 4.0 * e + 2.0 * r, "in place");
    // Overlapped: g1's all-reduce runs beside h and g2, its additions (a) on the device
    // before them, and only the last, g2's, in place after u1.
    let additions = n as f64 / model.flops_per_second;
    assert_close(step(true), 4.0 * e + additions + r, "overlapped");
}

#[test]
fn a_program_runs_many_small_all_reduces_one_after_another() {
    // Unfused gradients: a program runs their all-reduces in turn, each paying the link's
    // fixed cost, where one fused all-reduce pays it once.
    let model = CostModel::default();
    let replica = |on: &str, r: u32, keys: usize| {
        partition(on, |m| {
            let x = input(m, f32(&[16]), "x");
            let g = add(m, Op::Unary(UnaryOp::Exp), &[x], "g");
            for k in 0..keys {
                let key = format!("g{k}");
                add(
                    m,
                    Op::AllReduce { key: key.clone(), group_size: 2, replica: r },
                    &[g],
                    &format!("{key}/all_reduce"),
                );
            }
        })
    };
    let step = |keys: usize| {
        let (a, b) = (replica(A, 0, keys), replica(B, 1, keys));
        estimate(&[&a, &b], &model).step_seconds
    };
    let exp = 4.0 * 16.0 / model.flops_per_second;
    assert_close(step(100) - exp, 100.0 * (step(1) - exp), "100 all-reduces");
}

#[test]
fn a_stand_in_of_exchanges_alone_meets_its_peers_in_their_order() {
    // Replicas in place: g1 and g2 computed, then their all-reduces in the order they were
    // made ready. A stand-in (an instance simulated by its exchanges alone, its operands
    // inputs) lists them the other way round; it must not make the others wait on it.
    let model = CostModel::default();
    let keys = |r: u32| {
        (
            Op::AllReduce { key: "k1".into(), group_size: 3, replica: r },
            Op::AllReduce { key: "k2".into(), group_size: 3, replica: r },
        )
    };
    let replica = |on: &str, r: u32| {
        partition(on, |m| {
            let x = input(m, f32(&[1000]), "x");
            let g1 = add(m, Op::Unary(UnaryOp::Exp), &[x], "g1");
            let g2 = add(m, Op::Unary(UnaryOp::Exp), &[g1], "g2");
            let (k1, k2) = keys(r);
            add(m, k1, &[g1], "g1/all_reduce");
            add(m, k2, &[g2], "g2/all_reduce");
        })
    };
    let stand_in = partition(C, |m| {
        let (k1, k2) = keys(2);
        let g2 = input(m, f32(&[1000]), "g2/all_reduce/operand");
        add(m, k2, &[g2], "g2/all_reduce");
        let g1 = input(m, f32(&[1000]), "g1/all_reduce/operand");
        add(m, k1, &[g1], "g1/all_reduce");
    });
    let (a, b, c) = (replica(A, 0), replica(B, 1), replica(C, 2));
    let built = estimate(&[&a, &b, &c], &model);
    let standing_in = estimate(&[&a, &b, &stand_in], &model);
    assert!(built.step_seconds.is_finite() && built.step_seconds > 0.0);
    assert_close(standing_in.step_seconds, built.step_seconds, "step with a stand-in");
    assert_close(cost_of(&standing_in, A).finish_seconds, cost_of(&built, A).finish_seconds, "A's finish");
}

#[test]
fn with_a_profile_an_overlapped_ring_shares_the_cores_with_the_compute() {
    // Two replicas in one process: g1's all-reduce overlapped (its program goes on to g2),
    // g2's last, in place, after it. Where the process computes on every core of the host,
    // the overlapped ring's thread is one more asking for them, and its ring takes longer.
    let model = CostModel::calibrated(profile(50e9));
    let replica = |on: &str, r: u32| {
        partition(on, |m| {
            let x = input(m, f32(&[1000]), "x");
            let g1 = add(m, Op::Unary(UnaryOp::Exp), &[x], "g1");
            add(m, Op::AllReduce { key: "g1".into(), group_size: 2, replica: r }, &[g1], "g1/all_reduce");
            let g2 = add(m, Op::Unary(UnaryOp::Exp), &[g1], "g2");
            add(m, Op::AllReduce { key: "g2".into(), group_size: 2, replica: r }, &[g2], "g2/all_reduce");
        })
    };
    let (a, b) = (replica(A, 0), replica(A1, 1));
    let step = |threads: u32, overlap: bool| {
        let topology =
            Topology { process: vec![0, 0], host: vec![0, 0], threads: vec![threads], driven: false, overlap };
        estimate_on(&[&a, &b], &model, &topology).step_seconds
    };
    // One thread of two cores leaves a core to the ring; two do not.
    assert!(step(2, true) > step(1, true), "{} vs {}", step(2, true), step(1, true));
    // In place, the program waits for its rings and they have the cores.
    assert_close(step(2, false), step(1, false), "in place");
}
