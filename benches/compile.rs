//! How compile time grows with the size of the model and the number of devices: a generated
//! deep model (a chain of dense layers, trained with adam), compiled with model parallelism
//! (every compute op placed by the cost model) and with mirrored data parallelism.
//!
//! `cargo bench --bench compile` prints, per case, the IR nodes of the plan, the devices, and
//! the median of 5 compiles (seconds). Not a test: nothing is asserted.

use dfc_compile::{compile, CompileOptions, Strategy};
use dfc_ir::{Cluster, DeviceKind};
use std::time::Instant;

/// A model of `layers` dense layers of width 16, batch 64, with a loss and an optimizer.
fn model(layers: usize) -> String {
    let mut text = String::from(
        "layer dense(x: f32[n, k], units: dim) -> f32[n, units] {\n    param w: f32[k, units] = glorot_uniform\n    param b: f32[units] = zeros\n    return x @ w + b\n}\n\nmodel deep {\n    dim batch = 64\n    input x: f32[batch, 16]\n    input y: f32[batch, 16]\n    let h0 = x\n",
    );
    for l in 1..=layers {
        text += &format!("    let h{l} = tanh(dense(h{}, units = 16))\n", l - 1);
    }
    text += &format!("    let loss = mean((h{layers} - y) * (h{layers} - y))\n    output h{layers}\n    minimize loss with adam(lr = 0.001)\n}}\n");
    text
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(|a, b| a.total_cmp(b));
    xs[xs.len() / 2]
}

fn main() {
    println!("{:>8} {:>8} {:>8} {:>10} {:>12}", "strategy", "layers", "devices", "IR nodes", "median s");
    let cases: &[(Strategy, usize, usize)] = &[
        (Strategy::Model, 100, 64),
        (Strategy::Model, 200, 64),
        (Strategy::Model, 400, 64),
        (Strategy::Model, 400, 8),
        (Strategy::Model, 400, 16),
        (Strategy::Model, 400, 32),
        (Strategy::Mirrored, 10, 64),
        (Strategy::Mirrored, 20, 64),
        (Strategy::Mirrored, 20, 16),
    ];
    for &(strategy, layers, devices) in cases {
        let source = model(layers);
        let options =
            CompileOptions { cluster: Cluster::local(devices, DeviceKind::Cpu), strategy, ..CompileOptions::default() };
        let mut times = Vec::new();
        let mut nodes = 0;
        for _ in 0..5 {
            let start = Instant::now();
            let compiled =
                compile(&source, "deep.df", &options).unwrap_or_else(|_| panic!("the generated model compiles"));
            times.push(start.elapsed().as_secs_f64());
            nodes = compiled.combined.graph.len();
        }
        println!("{:>8} {:>8} {:>8} {:>10} {:>12.3}", strategy.name(), layers, devices, nodes, median(times));
    }
}
