//! `dfc bench`: times training steps (or, with `--inference`, forward passes) of a plan on
//! random data of the plan's input shapes, the way the peer benchmarks time theirs
//! (`shared/bench/peers/common.py`): warm-up steps, then steps until both a minimum time and a
//! minimum count are reached; the median, p10 and p90 of the per-step wall times.
//!
//! The programs are the ones `dfc run` runs: training fetches the loss and runs the plan's
//! updates (as `dfc_driver::train` does), inference fetches the plan's outputs. The random
//! batches are made before the timed region and cycled, a few of them, so that a step does not
//! always see the same bytes.

use crate::RunBackend;
use crate::{read_plan, Failure, Outcome};
use dfc_driver::{Session, SessionProgram};
use dfc_interp::Tensor;
use dfc_ir::{DType, Op};
use dfc_plan::Plan;
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// How many distinct random batches the steps cycle through.
const BATCHES: usize = 4;

#[derive(clap::Args)]
#[command(after_help = "The inputs are random, of each input's type and shape: floats standard normal, u8 uniform in \
0..=255, bool fair coin flips, and integers uniform in 0..10, so that integer labels of up to 10 classes are valid.")]
pub struct BenchArgs {
    /// The plan file (from `dfc compile`).
    plan: PathBuf,
    /// Time forward passes (the plan's outputs) instead of training steps.
    #[arg(long)]
    inference: bool,
    /// What runs the plan.
    #[arg(long, value_enum, default_value_t = RunBackend::Llvm)]
    backend: RunBackend,
    /// Untimed steps first.
    #[arg(long, value_name = "N", default_value_t = 10)]
    warmup: u64,
    /// Time steps until at least this many seconds have passed (and --min-steps are done).
    #[arg(long, value_name = "SECS", default_value_t = 3.0, value_parser = seconds)]
    min_time: f64,
    /// Time at least this many steps.
    #[arg(long, value_name = "N", default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
    min_steps: u64,
    /// Time at most this many steps.
    #[arg(long, value_name = "N", default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(1..))]
    max_steps: u64,
    /// Seed of the initial values and of the random inputs.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print one JSON object on stdout instead of a line for a person.
    #[arg(long)]
    json: bool,
    /// Write a timeline of the timed steps to this file (Trace Event Format JSON, as `dfc run --timeline`): each
    /// step, and its kernels, products and exchanges. Recording adds its own cost to the times reported.
    #[arg(long, value_name = "FILE")]
    timeline: Option<PathBuf>,
}

/// A number of seconds from the command line: 0 to a day (a `Duration` of more would be of no
/// use, and past 2^64 s it could not be made at all).
pub fn seconds(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(v) if (0.0..=86_400.0).contains(&v) => Ok(v),
        _ => Err(format!("`{text}` is not a number of seconds from 0 to 86400 (a day)")),
    }
}

/// What `dfc bench --json` prints.
#[derive(serde::Serialize)]
struct Report {
    model: String,
    mode: &'static str,
    backend: &'static str,
    median_step_us: f64,
    p10_step_us: f64,
    p90_step_us: f64,
    steps: usize,
    /// From reading the plan file (decoding and verifying it) to a program ready to run: code
    /// generation (or the code cache) and JIT compilation included.
    load_ms: f64,
    /// Where the native code came from: `generated` (now), `cached` (the disk cache), or
    /// `none` (the interpreter).
    code: &'static str,
    threads: usize,
    /// Matmul and convolution FLOPs per step over the median step time; `None` (null) when the
    /// program has none.
    gflops: Option<f64>,
    /// The cost model's step for this program as it runs here, from this host's profile
    /// (`dfc calibrate`); null without one.
    predicted_step_us: Option<f64>,
    /// predicted / measured − 1.
    prediction_error: Option<f64>,
    /// The profile the prediction used.
    calibration: Option<String>,
    /// With --timeline and a profile: per device and kind of work, measured and predicted.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    breakdown: Vec<crate::predict::Breakdown>,
}

pub fn bench(args: &BenchArgs) -> Outcome {
    let load_started = Instant::now();
    let plan = read_plan(&args.plan)?;
    crate::run::compute_on_this_thread(&plan);
    let failure = |e: dfc_driver::RunError| Failure(e.to_string());
    let mut session = Session::with_backend(&plan, args.seed, args.backend.backend()).map_err(failure)?;
    let (fetches, targets): (Vec<&str>, Vec<&str>) = if args.inference {
        if plan.outputs.is_empty() {
            return Err(Failure(format!("model `{}` has no outputs to run forward", plan.model)));
        }
        (plan.outputs.iter().map(|o| o.name.as_str()).collect(), Vec::new())
    } else {
        let Some(training) = &plan.training else {
            return Err(Failure(format!(
                "model `{}` has no `minimize`, so there is no training step; use --inference",
                plan.model
            )));
        };
        if training.updates.is_empty() {
            return Err(Failure(dfc_driver::nothing_to_train(&plan, "use --inference")));
        }
        if plan.strategy.backup_workers > 0 {
            return Err(failure(dfc_driver::backups_need_workers(&plan)));
        }
        (vec![training.loss_node.as_str()], training.updates.iter().map(String::as_str).collect())
    };
    let program = session.program(&fetches, &targets).map_err(failure)?;
    let load = load_started.elapsed();
    let code = code_origin(&session);
    let feeds = random_feeds(&plan, &program, args.seed)?;
    // The program's nodes by name: a fetched output's is its tensor's node.
    let output_node = |name: &str| -> Option<&str> {
        plan.partitions.iter().find_map(|p| {
            let output = p.module.outputs.iter().find(|o| o.name == name)?;
            Some(p.module.graph.node(output.tensor.node).name.as_str())
        })
    };
    let nodes: Vec<&str> =
        fetches.iter().map(|&f| output_node(f).unwrap_or(f)).chain(targets.iter().copied()).collect();
    let modules = dfc_driver::session::program_modules(&plan, &nodes).map_err(failure)?;
    let flops = matmul_conv_flops(&modules);
    let prediction = crate::predict::predict(&plan, &modules, crate::predict::Placement::Here);

    let mut step = 0usize;
    let mut run = |session: &mut Session| -> Result<Vec<Tensor>, Failure> {
        let out = session.run(&program, &feeds[step % feeds.len()]).map_err(failure);
        step += 1;
        out
    };
    for _ in 0..args.warmup {
        run(&mut session)?;
    }
    let min_time = Duration::from_secs_f64(args.min_time);
    let mut times: Vec<f64> = Vec::new();
    if args.timeline.is_some() {
        dfc_interp::trace::enable();
    }
    let started = Instant::now();
    let mut last = Vec::new();
    while (times.len() < args.min_steps as usize || started.elapsed() < min_time)
        && times.len() < args.max_steps as usize
    {
        let timed = times.len();
        let (out, took) = dfc_interp::trace::on_track("driver", || {
            let t0 = Instant::now();
            let out = run(&mut session);
            let end = Instant::now();
            dfc_interp::trace::record_span("step", || format!("step {timed}"), t0, end, None);
            (out, end.duration_since(t0))
        });
        last = out?;
        times.push(took.as_secs_f64());
    }
    let mut by_kind = Vec::new();
    if let Some(path) = &args.timeline {
        dfc_interp::trace::set_enabled(false);
        let events = dfc_interp::trace::take();
        if let Some(prediction) = &prediction {
            by_kind = crate::predict::breakdown(&events, times.len(), prediction);
        }
        let name = format!("dfc bench {}", plan.model);
        dfc_driver::timeline::write(path, &[dfc_driver::timeline::Process { name, events: &events }])
            .map_err(|e| Failure(format!("cannot write the timeline {}: {e}", path.display())))?;
        eprintln!("timeline: {} spans in {}", events.len(), path.display());
    }
    if !args.inference {
        if let Some(loss) = last.first().map(Tensor::scalar_f64).filter(|l| !l.is_finite()) {
            eprintln!("warning: the loss became {loss} on the random data; the timings may not be representative");
        }
    }

    times.sort_by(|a, b| a.total_cmp(b));
    let n = times.len();
    let (median, p10, p90) = (times[n / 2], times[n / 10], times[(9 * n) / 10]);
    let report = Report {
        model: plan.model.clone(),
        mode: if args.inference { "inference" } else { "train" },
        backend: args.backend.name(),
        median_step_us: microseconds(median),
        p10_step_us: microseconds(p10),
        p90_step_us: microseconds(p90),
        steps: n,
        load_ms: (load.as_secs_f64() * 1e6).round() / 1e3,
        code,
        threads: rayon::current_num_threads(),
        gflops: (flops > 0.0).then(|| flops / median / 1e9),
        predicted_step_us: prediction.as_ref().map(|p| microseconds(p.step_seconds)),
        prediction_error: prediction.as_ref().map(|p| ((p.step_seconds / median - 1.0) * 1e4).round() / 1e4),
        calibration: prediction.as_ref().and_then(|p| p.model.as_ref()?.calibration.clone()),
        breakdown: by_kind,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report).expect("reports serialise"));
    } else {
        println!("{}", human(&report));
    }
    Ok(ExitCode::SUCCESS)
}

/// Seconds in microseconds, to the nanosecond (what `Instant` resolves).
fn microseconds(seconds: f64) -> f64 {
    (seconds * 1e9).round() / 1e3
}

/// `mlp train step (llvm): median 1234.5 us (p10 1200.0, p90 1300.1), n=2000, 2 threads, 810.4 steps/s, 12.3 GFLOP/s`
fn human(report: &Report) -> String {
    let what = if report.mode == "train" { "train step" } else { "inference" };
    let mut line = format!(
        "{} {what} ({}): median {:.1} us (p10 {:.1}, p90 {:.1}), n={}, {} thread{}, {:.1} steps/s",
        report.model,
        report.backend,
        report.median_step_us,
        report.p10_step_us,
        report.p90_step_us,
        report.steps,
        report.threads,
        if report.threads == 1 { "" } else { "s" },
        1e6 / report.median_step_us
    );
    if let Some(gflops) = report.gflops {
        line += &format!(", {gflops:.2} GFLOP/s");
    }
    line += &format!("; loaded in {:.1} ms (code {})", report.load_ms, report.code);
    match (report.predicted_step_us, report.prediction_error) {
        (Some(predicted), Some(error)) => line += &format!("; predicted {predicted:.1} us ({:+.1}%)", error * 100.0),
        _ => line += &format!("; {}", crate::predict::NO_PROFILE),
    }
    line += &crate::predict::describe(&report.breakdown);
    line
}

/// `generated` if any partition's code was generated at this load (the grid emulator's always
/// is), else `cached`; `none` without native code.
fn code_origin(session: &Session) -> &'static str {
    let code: Vec<_> = session.native_code().iter().flatten().collect();
    if session.gpu_code().iter().any(Option::is_some) {
        "generated"
    } else if code.is_empty() {
        "none"
    } else if code.iter().any(|jit| jit.origin() == dfc_codegen::Origin::Generated) {
        "generated"
    } else {
        "cached"
    }
}

/// `BATCHES` sets of feeds: a random tensor of its type for every input the program needs.
fn random_feeds(plan: &Plan, program: &SessionProgram, seed: u64) -> Result<Vec<HashMap<String, Tensor>>, Failure> {
    let mut rng = Rng::new(seed ^ 0x6265_6e63_6821_2121);
    let needed = dfc_driver::replicas::plan_inputs(plan, program.inputs());
    let mut feeds = vec![HashMap::new(); BATCHES];
    for name in &needed {
        let Some(input) = plan.inputs.iter().find(|i| i.name == *name) else {
            return Err(Failure(format!(
                "the plan is malformed: its program needs input `{name}`, which it does not declare"
            )));
        };
        for batch in &mut feeds {
            batch.insert(name.clone(), random_tensor(&input.ty, &mut rng));
        }
    }
    // Split for an asynchronous plan's replicas before the clock starts.
    feeds
        .iter()
        .map(|batch| dfc_driver::replicas::node_feeds(plan, batch).map(|f| f.into_owned()))
        .collect::<Result<_, _>>()
        .map_err(|e: dfc_driver::RunError| Failure(e.to_string()))
}

fn random_tensor(ty: &dfc_ir::TensorType, rng: &mut Rng) -> Tensor {
    let shape = ty.shape.clone();
    let n: usize = shape.dims().iter().product();
    match ty.dtype {
        DType::F32 => Tensor::from_vec(shape, (0..n).map(|_| rng.normal() as f32).collect::<Vec<f32>>()),
        DType::F64 => Tensor::from_vec(shape, (0..n).map(|_| rng.normal()).collect::<Vec<f64>>()),
        DType::U8 => Tensor::from_vec(shape, (0..n).map(|_| rng.below(256) as u8).collect::<Vec<u8>>()),
        DType::I32 => Tensor::from_vec(shape, (0..n).map(|_| rng.below(10) as i32).collect::<Vec<i32>>()),
        DType::I64 => Tensor::from_vec(shape, (0..n).map(|_| rng.below(10) as i64).collect::<Vec<i64>>()),
        DType::Bool => Tensor::from_vec(shape, (0..n).map(|_| rng.below(2) == 1).collect::<Vec<bool>>()),
    }
}

/// SplitMix64: small, seeded, plenty for benchmark inputs.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn uniform(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in 0..n (n small: the modulo bias is negligible).
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// Standard normal (Box–Muller).
    fn normal(&mut self) -> f64 {
        let u = 1.0 - self.uniform(); // (0, 1]
        let v = self.uniform();
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
}

/// The FLOPs of the matmuls and convolutions (forward and gradients) one run of the program
/// performs, by the cost model's count (`dfc_passes::cost::node_flops`), over the nodes it
/// computes in each partition (`dfc_driver::session::program_modules`).
fn matmul_conv_flops(modules: &[dfc_ir::Module]) -> f64 {
    let mut flops = 0.0;
    for module in modules {
        let graph = &module.graph;
        for id in graph.node_ids() {
            if matches!(
                graph.node(id).op,
                Op::MatMul { .. }
                    | Op::Conv2d { .. }
                    | Op::Conv2dBackpropInput { .. }
                    | Op::Conv2dBackpropFilter { .. }
            ) {
                flops += dfc_passes::cost::node_flops(graph, id);
            }
        }
    }
    flops
}
