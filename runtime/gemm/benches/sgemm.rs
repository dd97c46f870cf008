//! Median time and GFLOP/s of `dfc_gemm::sgemm` against the `gemm` crate on the products of dfc's models,
//! single-threaded and on rayon's pool, and of `dfc_gemm::sgemm_fused` alone on the MLP's first layer fed bytes
//! (the products a training step on images runs; the `gemm` crate reads no bytes): on random bytes, and on a batch of
//! Fashion-MNIST's images where that is installed (`FASHION_MNIST`, default /usr/share/datasets/fashion-mnist), whose
//! black pixels the kernels leave out.
//! `cargo bench -p dfc-gemm --bench sgemm [-- FILTER]`: FILTER keeps the shapes whose label contains it;
//! `SGEMM_RUNS` sets the minimum number of runs per measurement (default 300).

use std::hint::black_box;
use std::time::{Duration, Instant};

/// (label, m, n, k, transpose_a, transpose_b); the first eight are the MLP's training step.
const SHAPES: &[(&str, usize, usize, usize, bool, bool)] = &[
    ("mlp fc1", 128, 256, 784, false, false),
    ("mlp fc2", 128, 256, 256, false, false),
    ("mlp fc3", 128, 10, 256, false, false),
    ("mlp fc3 dx", 128, 256, 10, false, true),
    ("mlp fc3 dw", 256, 10, 128, true, false),
    ("mlp fc2 dx", 128, 256, 256, false, true),
    ("mlp fc2 dw", 256, 256, 128, true, false),
    ("mlp fc1 dw", 784, 256, 128, true, false),
    ("cnn conv1", 43264, 32, 9, false, false),
    ("cnn conv2", 7744, 64, 288, false, false),
    ("cnn conv2 dw", 288, 64, 7744, true, false),
    ("cnn conv2 dx", 7744, 288, 64, false, true),
    ("cnn fc1", 64, 64, 1600, false, false),
    ("cnn fc2", 64, 10, 64, false, false),
    ("cnn fc2 dx", 64, 64, 10, false, true),
    ("cnn fc2 dw", 64, 10, 64, true, false),
    ("cnn fc1 dx", 64, 1600, 64, false, true),
    ("cnn fc1 dw", 1600, 64, 64, true, false),
    ("logreg", 100, 10, 784, false, false),
    ("logreg dw", 784, 10, 100, true, false),
    // Inference at batch 1: one row of C.
    ("mlp b1 fc1", 1, 256, 784, false, false),
    ("mlp b1 fc2", 1, 256, 256, false, false),
    ("mlp b1 fc3", 1, 10, 256, false, false),
    ("cnn b1 fc1", 1, 64, 1600, false, false),
    ("logreg b1", 1, 10, 784, false, false),
];
const MLP: usize = 8;

/// The MLP's first layer as a training step runs it on images fed as bytes (`sgemm_fused`, A read through
/// `ByteScale::Div(255)`, the weights rewritten by each step's update): (label, m, n, k, transpose_a, update).
/// Its forward product takes the bias and relu; its weight gradient is folded into the update.
const BYTE_SHAPES: &[(&str, usize, usize, usize, bool, bool)] =
    &[("mlp fc1 u8", 128, 256, 784, false, false), ("mlp fc1 dw u8", 784, 256, 128, true, true)];

/// Operands of a `BYTE_SHAPES` product: random bytes, a fifth of them 0 (black pixels).
struct ByteOperands {
    shape: (usize, usize, usize, bool, bool),
    a: Vec<u8>,
    b: Vec<f32>,
    bias: Vec<f32>,
    c: Vec<f32>,
}

impl ByteOperands {
    /// Random bytes, or the first m·k of `images` (whole images, as a batch stores them).
    fn new(&(_, m, n, k, ta, update): &(&str, usize, usize, usize, bool, bool), images: Option<&[u8]>) -> ByteOperands {
        let mut rng = fastrand::Rng::with_seed(1);
        let a = match images {
            Some(images) => images[..m * k].to_vec(),
            None => (0..m * k).map(|_| if rng.u8(..) < 51 { 0 } else { rng.u8(..) }).collect(),
        };
        let b = (0..k * n).map(|_| rng.f32() - 0.5).collect();
        let bias = (0..n).map(|_| rng.f32() - 0.5).collect();
        ByteOperands { shape: (m, n, k, ta, update), a, b, bias, c: vec![0.0; m * n] }
    }

    fn flops(&self) -> f64 {
        let (m, n, k, _, _) = self.shape;
        2.0 * (m * n * k) as f64
    }

    fn ours(&mut self, parallel: bool) {
        let (m, n, k, ta, update) = self.shape;
        let a = dfc_gemm::Left::Bytes(&self.a, dfc_gemm::ByteScale::Div(255.0));
        let (update, epilogue) = match update {
            true => (Some(-1e-6), dfc_gemm::Epilogue::default()),
            false => (None, dfc_gemm::Epilogue { bias: Some(&self.bias), relu: true, ..Default::default() }),
        };
        dfc_gemm::sgemm_fused(m, n, k, a, ta, &self.b, false, &mut self.c, update, epilogue, true, parallel);
        black_box(&mut self.c);
    }
}

struct Operands {
    m: usize,
    n: usize,
    k: usize,
    ta: bool,
    tb: bool,
    a: Vec<f32>,
    b: Vec<f32>,
    c: Vec<f32>,
}

impl Operands {
    fn new(&(_, m, n, k, ta, tb): &(&str, usize, usize, usize, bool, bool)) -> Operands {
        let mut rng = fastrand::Rng::with_seed(1);
        let mut random = |len: usize| (0..len).map(|_| rng.f32() - 0.5).collect::<Vec<f32>>();
        Operands { m, n, k, ta, tb, a: random(m * k), b: random(k * n), c: vec![0.0; m * n] }
    }

    fn flops(&self) -> f64 {
        2.0 * (self.m * self.n * self.k) as f64
    }

    fn ours(&mut self, parallel: bool) {
        dfc_gemm::sgemm(self.m, self.n, self.k, &self.a, self.ta, &self.b, self.tb, &mut self.c, false, parallel);
        black_box(&mut self.c);
    }

    fn crate_gemm(&mut self, parallel: bool) {
        let (m, n, k) = (self.m, self.n, self.k);
        let (a_rs, a_cs) = if self.ta { (1, m as isize) } else { (k as isize, 1) };
        let (b_rs, b_cs) = if self.tb { (1, k as isize) } else { (n as isize, 1) };
        let parallelism = if parallel && m * n * k >= 1 << 18 {
            gemm::Parallelism::Rayon(rayon::current_num_threads())
        } else {
            gemm::Parallelism::None
        };
        // SAFETY: the operands are m×k, k×n and m×n, contiguous.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                self.c.as_mut_ptr(),
                1,
                n as isize,
                false,
                self.a.as_ptr(),
                a_cs,
                a_rs,
                self.b.as_ptr(),
                b_cs,
                b_rs,
                0.0,
                1.0,
                false,
                false,
                false,
                parallelism,
            );
        }
        black_box(&mut self.c);
    }
}

/// Fashion-MNIST's first 128 training images (784 bytes each), where the dataset is installed.
fn fashion_mnist_batch() -> Option<Vec<u8>> {
    use std::io::Read;
    let dir = std::env::var("FASHION_MNIST").unwrap_or_else(|_| "/usr/share/datasets/fashion-mnist".into());
    let file = std::fs::File::open(format!("{dir}/train-images-idx3-ubyte.gz")).ok()?;
    let mut bytes = Vec::new();
    // The IDX header (16 bytes), then the images.
    flate2::read::GzDecoder::new(file).take(16 + 128 * 784).read_to_end(&mut bytes).ok()?;
    (bytes.len() == 16 + 128 * 784).then(|| bytes.split_off(16))
}

/// Median seconds of `f` over at least `runs` runs and 0.1 s, after a warm-up.
fn median(runs: usize, mut f: impl FnMut()) -> f64 {
    let warm = Instant::now();
    while warm.elapsed() < Duration::from_millis(20) {
        f();
    }
    let mut times = Vec::with_capacity(runs);
    let start = Instant::now();
    while times.len() < runs || start.elapsed() < Duration::from_millis(100) {
        let t = Instant::now();
        f();
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn main() {
    let filter = std::env::args().skip(1).find(|a| !a.starts_with('-')).unwrap_or_default();
    let runs = std::env::var("SGEMM_RUNS").ok().and_then(|s| s.parse().ok()).unwrap_or(300);
    println!("rayon threads: {}; medians of ≥{runs} runs; µs (GFLOP/s)", rayon::current_num_threads());
    println!(
        "{:<14} {:>17} {:>22} {:>22} {:>22} {:>22}",
        "shape", "m×n×k", "ours 1 thread", "gemm 1 thread", "ours parallel", "gemm parallel"
    );
    let mut totals = [0.0f64; 4];
    let mut mlp_flops = 0.0;
    for (index, shape) in SHAPES.iter().enumerate() {
        if !shape.0.contains(filter.as_str()) {
            continue;
        }
        let mut ops = Operands::new(shape);
        let times = [
            median(runs, || ops.ours(false)),
            median(runs, || ops.crate_gemm(false)),
            median(runs, || ops.ours(true)),
            median(runs, || ops.crate_gemm(true)),
        ];
        let flops = ops.flops();
        let (_, m, n, k, ta, tb) = *shape;
        let dims = format!("{m}×{n}×{k}{}{}", if ta { " ta" } else { "" }, if tb { " tb" } else { "" });
        let cells: Vec<String> = times.iter().map(|t| format!("{:>9.1} ({:>6.1})", t * 1e6, flops / t / 1e9)).collect();
        println!("{:<14} {:>17} {:>22} {:>22} {:>22} {:>22}", shape.0, dims, cells[0], cells[1], cells[2], cells[3]);
        if index < MLP {
            mlp_flops += flops;
            for (total, t) in totals.iter_mut().zip(times) {
                *total += t;
            }
        }
    }
    let images = fashion_mnist_batch();
    for shape in BYTE_SHAPES.iter().filter(|shape| shape.0.contains(filter.as_str())) {
        for (source, images) in [("", None), (" fmnist", images.as_deref())] {
            let (label, m, n, k, ta, _) = *shape;
            if source.is_empty() || images.is_some() {
                let mut ops = ByteOperands::new(shape, images);
                let times = [median(runs, || ops.ours(false)), median(runs, || ops.ours(true))];
                let dims = format!("{m}×{n}×{k}{}", if ta { " ta" } else { "" });
                let cells: Vec<String> =
                    times.iter().map(|t| format!("{:>9.1} ({:>6.1})", t * 1e6, ops.flops() / t / 1e9)).collect();
                let label = format!("{label}{source}");
                println!("{label:<14} {dims:>17} {:>22} {:>22} {:>22} {:>22}", cells[0], "", cells[1], "");
            } else {
                println!("{label} fmnist: skipped, no Fashion-MNIST images (FASHION_MNIST)");
            }
        }
    }
    if mlp_flops > 0.0 {
        let cells: Vec<String> =
            totals.iter().map(|t| format!("{:>9.1} ({:>6.1})", t * 1e6, mlp_flops / t / 1e9)).collect();
        println!(
            "{:<14} {:>17} {:>22} {:>22} {:>22} {:>22}",
            "MLP sum",
            format!("{:.1} MFLOP", mlp_flops / 1e6),
            cells[0],
            cells[1],
            cells[2],
            cells[3]
        );
    }
    if filter.is_empty() || "mlp step".contains(filter.as_str()) {
        // The eight MLP products back to back, as a training step runs them.
        let mut ops: Vec<Operands> = SHAPES[..MLP].iter().map(Operands::new).collect();
        let step = |ops: &mut Vec<Operands>, ours: bool, parallel: bool| {
            for o in ops.iter_mut() {
                if ours {
                    o.ours(parallel)
                } else {
                    o.crate_gemm(parallel)
                }
            }
        };
        let times = [
            median(runs, || step(&mut ops, true, false)),
            median(runs, || step(&mut ops, false, false)),
            median(runs, || step(&mut ops, true, true)),
            median(runs, || step(&mut ops, false, true)),
        ];
        let flops: f64 = ops.iter().map(Operands::flops).sum();
        let cells: Vec<String> = times.iter().map(|t| format!("{:>9.1} ({:>6.1})", t * 1e6, flops / t / 1e9)).collect();
        println!(
            "{:<14} {:>17} {:>22} {:>22} {:>22} {:>22}",
            "MLP step",
            format!("{:.1} MFLOP", flops / 1e6),
            cells[0],
            cells[1],
            cells[2],
            cells[3]
        );
    }
}
