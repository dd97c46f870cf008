//! A quick speed check of the heaviest kernels (not a test):
//! `cargo run --release -p dfc-interp --example speed`.

use dfc_interp::{eval, initialize, Program, Tensor};
use dfc_ir::{
    BinaryOp, CompareOp, ConstValue, DType, Graph, Initializer, Module, Op, Padding, ReduceKind, Shape, TensorRef,
    TensorType, UnaryOp,
};
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::time::Instant;

fn random(rng: &mut rand_chacha::ChaCha8Rng, dims: &[usize]) -> Tensor {
    let n = dims.iter().product();
    Tensor::from_vec(dims.to_vec(), (0..n).map(|_| rng.random::<f32>() - 0.5).collect::<Vec<f32>>())
}

/// Runs `op` a few times and prints the best time and the rate of multiply-adds.
fn time(label: &str, op: Op, operands: &[&Tensor], macs: f64) {
    let mut best = f64::INFINITY;
    for _ in 0..10 {
        let start = Instant::now();
        let out = eval(&op, operands).expect("the op runs");
        std::hint::black_box(out);
        best = best.min(start.elapsed().as_secs_f64());
    }
    println!("{label:<48} {:>8.2} ms  {:>6.2} GMAC/s", best * 1e3, macs / best / 1e9);
}

fn main() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    let mm = Op::MatMul { transpose_a: false, transpose_b: false };
    let (x, w) = (random(&mut rng, &[128, 784]), random(&mut rng, &[784, 256]));
    time("matmul f32 [128,784] @ [784,256]", mm, &[&x, &w], 128.0 * 784.0 * 256.0);
    let dy = random(&mut rng, &[128, 256]);
    let dw = Op::MatMul { transpose_a: true, transpose_b: false };
    time("matmul f32 [128,784]ᵀ @ [128,256] (weight grad)", dw, &[&x, &dy], 128.0 * 784.0 * 256.0);
    let dx = Op::MatMul { transpose_a: false, transpose_b: true };
    time("matmul f32 [128,256] @ [784,256]ᵀ (input grad)", dx, &[&dy, &w], 128.0 * 784.0 * 256.0);

    let (img, f) = (random(&mut rng, &[64, 28, 28, 1]), random(&mut rng, &[3, 3, 1, 32]));
    for padding in [Padding::Valid, Padding::Same] {
        let out = if padding == Padding::Valid { 26.0 } else { 28.0 };
        let macs = 64.0 * out * out * 32.0 * 9.0;
        let op = Op::Conv2d { strides: [1, 1], padding };
        time(&format!("conv2d f32 [64,28,28,1] * [3,3,1,32] {}", padding.name()), op, &[&img, &f], macs);
    }
    let (h, f2) = (random(&mut rng, &[64, 13, 13, 32]), random(&mut rng, &[3, 3, 32, 64]));
    let g2 = random(&mut rng, &[64, 11, 11, 64]);
    let macs = 64.0 * 11.0 * 11.0 * 64.0 * 9.0 * 32.0;
    let conv = Op::Conv2d { strides: [1, 1], padding: Padding::Valid };
    time("conv2d f32 [64,13,13,32] * [3,3,32,64] valid", conv, &[&h, &f2], macs);
    let bi =
        Op::Conv2dBackpropInput { input_shape: Shape(vec![64, 13, 13, 32]), strides: [1, 1], padding: Padding::Valid };
    time("  its backprop_input", bi, &[&f2, &g2], macs);
    let bf =
        Op::Conv2dBackpropFilter { filter_shape: Shape(vec![3, 3, 32, 64]), strides: [1, 1], padding: Padding::Valid };
    time("  its backprop_filter", bf, &[&h, &g2], macs);
    mlp_step();
}

/// One SGD step of the MLP 784-256-256-10 on a batch of 128, its backward pass written out by
/// hand, run as a `Program`.
fn mlp_step() {
    let mut g = Graph::new();
    let mut add = |op: Op, inputs: &[TensorRef], name: &str| -> TensorRef {
        g.add(op, inputs, name, None).expect("well-typed").into()
    };
    let f32_ty = |dims: &[usize]| TensorType::new(DType::F32, dims.to_vec());
    let x = add(Op::Input { ty: f32_ty(&[128, 784]) }, &[], "x");
    let labels = add(Op::Input { ty: f32_ty(&[128, 10]) }, &[], "labels");
    let mm = |ta, tb| Op::MatMul { transpose_a: ta, transpose_b: tb };
    let bin = Op::Binary;
    let sizes = [784, 256, 256, 10];
    let mut vars = Vec::new();
    let mut reads = Vec::new();
    for l in 0..3 {
        let w = add(
            Op::Variable {
                ty: f32_ty(&[sizes[l], sizes[l + 1]]),
                init: Initializer::GlorotUniform,
                trainable: true,
                partitions: 1,
                origin: None,
            },
            &[],
            &format!("w{l}"),
        );
        let b = add(
            Op::Variable {
                ty: f32_ty(&[sizes[l + 1]]),
                init: Initializer::Zeros,
                trainable: true,
                partitions: 1,
                origin: None,
            },
            &[],
            &format!("b{l}"),
        );
        let (rw, rb) = (add(Op::Read, &[w], &format!("w{l}/read")), add(Op::Read, &[b], &format!("b{l}/read")));
        vars.push((w, b));
        reads.push((rw, rb));
    }
    // Forward.
    let mut acts = vec![x];
    for (l, &(rw, rb)) in reads.iter().enumerate() {
        let z = add(mm(false, false), &[acts[l], rw], "mm");
        let z = add(bin(BinaryOp::Add), &[z, rb], "z");
        acts.push(if l < 2 { add(Op::Unary(UnaryOp::Relu), &[z], "relu") } else { z });
    }
    let logits = acts[3];
    let ce = add(Op::SoftmaxCrossEntropy, &[logits, labels], "ce");
    let loss = add(Op::Reduce { kind: ReduceKind::Mean, axes: vec![0], keep_dims: false }, &[ce], "loss");
    // Backward: d logits = (softmax - labels) / batch.
    let sm = add(Op::Softmax { axis: 1 }, &[logits], "softmax");
    let diff = add(bin(BinaryOp::Sub), &[sm, labels], "diff");
    let scale = add(Op::Const { value: ConstValue::scalar(DType::F32, 0.1 / 128.0) }, &[], "lr_over_batch");
    let zero = add(Op::Const { value: ConstValue::scalar(DType::F32, 0.0) }, &[], "zero");
    let mut dz = add(bin(BinaryOp::Mul), &[diff, scale], "dz"); // already times the learning rate
    let mut updates = Vec::new();
    for l in (0..3).rev() {
        let (w, b) = vars[l];
        let (rw, _) = reads[l];
        let dw = add(mm(true, false), &[acts[l], dz], "dw");
        let db = add(Op::Reduce { kind: ReduceKind::Sum, axes: vec![0], keep_dims: false }, &[dz], "db");
        if l > 0 {
            let dh = add(mm(false, true), &[dz, rw], "dh");
            let positive = add(Op::Compare(CompareOp::Greater), &[acts[l], zero], "positive");
            dz = add(Op::Select, &[positive, dh, zero], "drelu");
        }
        updates.push(add(Op::AssignSub, &[w, dw], "w/update").node);
        updates.push(add(Op::AssignSub, &[b, db], "b/update").node);
    }
    // Every read runs before any update.
    for &(rw, rb) in &reads {
        for &u in &updates {
            g.add_control_edge(rw.node, u);
            g.add_control_edge(rb.node, u);
        }
    }
    let module = Module { graph: g, ..Module::default() };
    let program = Program::new(&module, &[loss], &updates).expect("the program builds");
    let mut variables = initialize(&module, 0);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    let xs = random(&mut rng, &[128, 784]);
    let ids: Vec<usize> = (0..128).map(|_| rng.random_range(0..10)).collect();
    let onehot: Vec<f32> = ids.iter().flat_map(|&c| (0..10).map(move |k| if k == c { 1.0 } else { 0.0 })).collect();
    let feeds = HashMap::from([("x".to_string(), xs), ("labels".to_string(), Tensor::from_vec(vec![128, 10], onehot))]);
    let start = Instant::now();
    let steps = 20;
    let mut losses = Vec::new();
    for _ in 0..steps {
        losses.push(program.run(&module, &mut variables, &feeds).expect("the step runs")[0].scalar_f64());
    }
    let per_step = start.elapsed().as_secs_f64() / steps as f64;
    println!(
        "{:<48} {:>8.2} ms  (loss {:.3} -> {:.3} over {steps} steps on one batch)",
        "MLP 784-256-256-10 SGD step, batch 128",
        per_step * 1e3,
        losses[0],
        losses[steps - 1]
    );
}
