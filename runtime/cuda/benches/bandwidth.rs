//! A large fused elementwise kernel on the GPU, `relu(x * 1.5 + y)` over 64 Mi f32 (768 MiB
//! moved per launch): its achieved bandwidth as a fraction of the memory's peak (the CUDA
//! issue's bar is 70%). `cargo bench -p dfc-cuda --bench bandwidth`; without a GPU it says
//! SKIPPED. Not a test: nothing is asserted but the kernel's shape.

use dfc_compile::{compile, CompileOptions};
use dfc_interp::Tensor;
use dfc_ir::{Cluster, DeviceKind, Op};

#[path = "../../../tests/support/skip.rs"]
mod skip;

fn main() {
    // Compiled everywhere (the kernel is checked); run where there is a GPU.
    let source = "model stream {\n    dim n = 67108864\n    input x: f32[n]\n    input y: f32[n]\n    output relu(x * 1.5 + y) as z\n}\n";
    let options = CompileOptions { cluster: Cluster::local(1, DeviceKind::Gpu), ..CompileOptions::default() };
    let plan = compile(source, "stream.df", &options).unwrap_or_else(|_| panic!("the model compiles")).plan;
    let code =
        &dfc_codegen::compile_gpu(&plan.partitions[0].module, &plan.kept_nodes(0)).expect("the PTX is generated");
    assert_eq!(code.kernels.len(), 1, "one fused kernel: {:?}", code.kernels);
    let kernel = &code.kernels[0];
    let module = &plan.partitions[0].module;
    // x, y, and the constant 1.5.
    let n = 1usize << 26;
    let streamed = kernel.inputs.iter().filter(|t| matches!(module.graph.node(t.node).op, Op::Input { .. })).count();
    assert_eq!(streamed, 2, "x and y");
    match dfc_cuda::device_count() {
        Ok(n) if n > 0 => {}
        other => {
            let reason = format!("no GPU here ({other:?}; driver present: {})", dfc_cuda::driver_present());
            skip::skip(skip::Need::Gpu, &reason);
            return;
        }
    }
    let mut buffers: Vec<Vec<u8>> = kernel
        .inputs
        .iter()
        .map(|t| match &module.graph.node(t.node).op {
            Op::Input { .. } => (0..n).flat_map(|i| ((i % 1000) as f32 / 500.0 - 1.0).to_le_bytes()).collect(),
            Op::Const { value } => Tensor::from_const(value).to_le_bytes(),
            other => panic!("the kernel reads a {}", other.name()),
        })
        .collect();
    buffers.push(vec![0u8; 4 * n]);
    let args: Vec<usize> = (0..buffers.len()).collect();
    let gpu = dfc_cuda::Gpu::open(0).expect("GPU 0 opens");
    let kernels = gpu.load(code, "stream").unwrap();
    let seconds = kernels.time(kernel, &buffers, &args, 20).unwrap();
    let moved = (3 * 4 * n) as f64;
    let peak = gpu.peak_bandwidth().unwrap();
    println!(
        "{}: {:.3} ms per launch, {:.0} GB/s of {:.0} GB/s peak: {:.0}%",
        gpu.describe(),
        seconds * 1e3,
        moved / seconds / 1e9,
        peak / 1e9,
        100.0 * moved / seconds / peak
    );
}
