//! The `dfc` command: check, ir, compile, inspect.

mod bench;
mod bench_allreduce;
mod calibrate;
mod fmt;
mod lsp;
mod predict;
mod render;
mod run;

use clap::{Parser, Subcommand, ValueEnum};
use dfc_diag::{Code, Diagnostic, LineIndex, Span};
use render::Source;
use std::path::{Path, PathBuf};

/// mimalloc: compiling a large model allocates and frees millions of small nodes, names and
/// vectors; glibc's allocator spent a quarter of a 10,000-layer compile consolidating its free
/// lists (1.45 s against 2.0 s with it).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "dfc", version, about = "A compiler and runtime for dataflow graphs")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// `--backend`: what runs a plan's partitions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum RunBackend {
    /// Native code: the plan's fused kernels JIT-compiled through LLVM.
    Llvm,
    /// The reference interpreter: slow, plainly right.
    Interp,
    /// Native code, but GPU partitions run their GPU kernels on this CPU, thread by thread as
    /// a GPU launch would (the grid emulator): slow; checks a GPU plan without a GPU.
    GridEmulator,
}

impl RunBackend {
    pub(crate) fn backend(self) -> dfc_driver::Backend {
        match self {
            RunBackend::Llvm => dfc_driver::Backend::Llvm,
            RunBackend::Interp => dfc_driver::Backend::Interp,
            RunBackend::GridEmulator => dfc_driver::Backend::GridEmulator,
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            RunBackend::Llvm => "llvm",
            RunBackend::Interp => "interp",
            RunBackend::GridEmulator => "grid-emulator",
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// The language server, on stdio: diagnostics, hover, definitions, completion and more in
    /// editors (docs/editors.md).
    Lsp {
        /// Accepted for clients that pass it (vscode-languageclient does); stdio is the only
        /// transport.
        #[arg(long)]
        stdio: bool,
    },
    /// Format .df files in place (a directory: its .df files; `-`: stdin to stdout).
    Fmt {
        /// Files or directories to format; `-` reads standard input.
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Write nothing: list the files that are not formatted, exit 1 if there are any.
        #[arg(long)]
        check: bool,
    },
    /// Check .df files and report every problem (exit 1 if there are errors).
    Check {
        #[arg(required = true)]
        files: Vec<PathBuf>,
        #[command(flatten)]
        model: ModelArgs,
        /// How to print diagnostics.
        #[arg(long, value_enum, default_value_t = MessageFormat::Human)]
        message_format: MessageFormat,
    },
    /// Print the IR of a model in its text form.
    Ir {
        file: PathBuf,
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        distribute: DistributeArgs,
        /// Show the IR after this pass (sema: as analysed, before any pass).
        #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(dfc_compile::STAGES), default_value = "sema")]
        after: String,
    },
    /// Draw a model's graph: Graphviz DOT, or SVG through Graphviz's `dot`.
    Graph {
        file: PathBuf,
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        distribute: DistributeArgs,
        /// Draw the graph after this pass [default: partition, nodes coloured by the device
        /// placement chose].
        #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(dfc_compile::STAGES), default_value = "partition")]
        after: String,
        /// Fold name scopes nested deeper than this into one node each (0: every top-level scope).
        #[arg(long, value_name = "DEPTH")]
        collapse: Option<usize>,
        /// Where to write it: FILE.dot, or FILE.svg (needs Graphviz) [default: DOT on stdout].
        #[arg(short, long)]
        output: Option<PathBuf>,
    },
    /// Compile a model into a plan file.
    Compile {
        file: PathBuf,
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        distribute: DistributeArgs,
        /// Where to write the plan [default: the source name with extension .plan].
        #[arg(short, long)]
        output: Option<PathBuf>,
        /// Print the cost model's prediction per device: variable bytes, FLOPs, bytes sent and
        /// received per step, predicted step time and its critical path.
        #[arg(long)]
        report: bool,
        /// Print, on stderr, the time of every stage of the compile (parsing, each pass,
        /// writing the plan) and the process's resident memory after it, then the total and
        /// the peak.
        #[arg(long)]
        timings: bool,
    },
    /// Train a plan on data files, or run it forward with --fetch.
    Run {
        plan: PathBuf,
        /// Bind an input to a data file (IDX raw or .gz, .npy, CSV): --feed images=train.gz
        #[arg(long = "feed", value_name = "INPUT=PATH", value_parser = parse_feed)]
        feeds: Vec<(String, PathBuf)>,
        /// Evaluation data, used after each epoch: --eval-feed images=test.gz
        #[arg(long = "eval-feed", value_name = "INPUT=PATH", value_parser = parse_feed)]
        eval_feeds: Vec<(String, PathBuf)>,
        /// Passes over the training data [default: 1].
        #[arg(long)]
        epochs: Option<u64>,
        /// Stop after this many training steps in all (0 with --checkpoint-dir: save the initial
        /// values as the checkpoint of step 0).
        #[arg(long)]
        steps: Option<u64>,
        /// Seed of the initial values.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Seed of the example order (epoch e shuffles with this seed and e).
        #[arg(long, default_value_t = 0)]
        shuffle_seed: u64,
        /// Take the training examples in their files' order every epoch (to train on the same
        /// batches as another framework).
        #[arg(long, conflicts_with = "shuffle_seed")]
        no_shuffle: bool,
        /// Write one JSON object per epoch to this file.
        #[arg(long)]
        metrics: Option<PathBuf>,
        /// Write each epoch's metrics as TensorBoard scalars to an event file in this directory
        /// (`tensorboard --logdir DIR` shows them).
        #[arg(long, value_name = "DIR")]
        tensorboard: Option<PathBuf>,
        /// Save the variables after each epoch here, and resume from the newest checkpoint.
        #[arg(long)]
        checkpoint_dir: Option<PathBuf>,
        /// Write a timeline of the run to this file (Trace Event Format JSON, which Perfetto
        /// and chrome://tracing open): the driver's steps, data loading and evaluations, and
        /// per partition its kernels, products, sends, receives and all-reduces.
        #[arg(long, value_name = "FILE", conflicts_with = "fetch")]
        timeline: Option<PathBuf>,
        /// Run forward and print (or with -o save as .npy) this output instead of training.
        #[arg(long)]
        fetch: Option<String>,
        /// With --fetch: the .npy file to write.
        #[arg(short, long, requires = "fetch")]
        output: Option<PathBuf>,
        /// What runs the plan: native code (LLVM), the reference interpreter, or native code with
        /// GPU partitions on the grid emulator.
        #[arg(long, value_enum, default_value_t = RunBackend::Llvm)]
        backend: RunBackend,
        /// Step an asynchronous ps plan's replicas together, as one process does (repeatable
        /// numbers), instead of each on its own on workers.
        #[arg(long)]
        lockstep: bool,
        #[command(flatten)]
        remote: run::RemoteArgs,
    },
    /// Generate text with a plan trained on a text feed: each next byte drawn from the model's
    /// scores for the last position it reads (docs/language.md, "The command line").
    Sample {
        plan: PathBuf,
        /// Use the variables of the newest checkpoint here [default: the initial values].
        #[arg(long)]
        checkpoint_dir: Option<PathBuf>,
        /// The text to continue [default: a newline].
        #[arg(long, default_value = "")]
        prompt: String,
        /// How many bytes to generate.
        #[arg(long, default_value_t = 200)]
        length: usize,
        /// Below 1: likelier bytes; above 1: more varied ones.
        #[arg(long, default_value_t = 1.0)]
        temperature: f64,
        /// Seed of the draws (and of the initial values without --checkpoint-dir).
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// The input the tokens go to [default: the model's only input].
        #[arg(long)]
        input: Option<String>,
        /// The output that scores the next token [default: the model's only output].
        #[arg(long)]
        output: Option<String>,
        #[arg(long, value_enum, default_value_t = RunBackend::Llvm)]
        backend: RunBackend,
    },
    /// Serve as a worker of distributed runs: run the partitions a driver (`dfc run
    /// --cluster/--spawn`) registers, exchanging tensors with the other workers.
    Worker {
        /// Where to listen (host:port; port 0 picks a free one). Binds loopback unless told
        /// otherwise: anyone who can reach the port and holds the token can run code here.
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: String,
        /// A file whose first line is the shared token [default: the DFC_TOKEN variable].
        #[arg(long)]
        token_file: Option<PathBuf>,
        /// Serve over TLS and require client certificates: DIR holds ca.pem, cert.pem and key.pem
        /// (`dfc certs` makes them). Required to listen beyond loopback.
        #[arg(long, value_name = "DIR")]
        tls_dir: Option<PathBuf>,
        /// The port of the data plane, the TCP connections (in TLS with --tls-dir) that carry
        /// all-reduce segments between workers (on --listen's host; 0 picks a free one).
        #[arg(long, default_value_t = 0)]
        data_port: u16,
        /// Send every frame of the data plane over TCP, also to workers on this machine (which
        /// otherwise take a queue in shared memory, see docs/distributed.md).
        #[arg(long)]
        no_shared_memory: bool,
        /// The threads to compute on [default: one per core, or RAYON_NUM_THREADS]. Give each of
        /// several workers on one machine its share of the cores.
        #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
        threads: Option<u16>,
        /// Wait this long before each run of a step: a straggler on purpose, to see what a slow
        /// worker does to a run (the stall inspector's reports, asynchronous training).
        #[arg(long, value_name = "MS", default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=600_000))]
        delay_ms: u64,
    },
    /// Make the TLS files for workers on several machines: a CA, and for each host a directory
    /// to give its `dfc worker` (and a driver there) as --tls-dir.
    Certs {
        /// Where to write: DIR/ca.pem and DIR/ca-key.pem (the CA, which signs more hosts when run
        /// again), DIR/HOST/{ca.pem,cert.pem,key.pem} for each host.
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// The hosts, as the cluster file names them: NAME, or NAME,OTHER,... for a host known
        /// by several names or addresses (all go into its certificate; NAME names its directory).
        #[arg(value_name = "HOST", required = true)]
        hosts: Vec<String>,
    },
    /// Time training steps (or with --inference forward passes) of a plan on random data.
    Bench(bench::BenchArgs),
    /// Time the ring all-reduce across local worker processes, next to raw loopback TCP.
    BenchAllreduce(bench_allreduce::BenchAllReduceArgs),
    /// Measure this machine for the cost model (products, convolutions, kernels, the links
    /// between worker processes) into a profile that `dfc compile` predicts from.
    Calibrate(calibrate::CalibrateArgs),
    /// Describe what a plan file holds.
    Inspect {
        plan: PathBuf,
        /// Print the summary as JSON, for tools.
        #[arg(long)]
        json: bool,
    },
}

#[derive(clap::Args)]
struct ModelArgs {
    /// Which model of the file (needed when it defines several).
    #[arg(long)]
    model: Option<String>,
    /// Give a dim a value: --dim batch=256 (repeatable).
    #[arg(long = "dim", value_name = "NAME=VALUE", value_parser = parse_dim)]
    dims: Vec<(String, i64)>,
    /// Train with this optimizer instead of the model's: --optimizer "adam(lr = 0.001)"
    #[arg(long, value_name = "OPTIMIZER")]
    optimizer: Option<String>,
}

/// Where the model runs and how it is spread over the devices.
#[derive(clap::Args)]
struct DistributeArgs {
    /// Run on devices of this machine (one task of job `localhost`): N CPUs, or `gpu:N` for N
    /// GPUs (`cpu:N` is N CPUs).
    #[arg(long, value_name = "N|gpu:N", conflicts_with = "cluster", value_parser = parse_devices)]
    devices: Option<(u32, dfc_ir::DeviceKind)>,
    /// The cluster, in TF_CONFIG's JSON shape: {"cluster": {"worker": [...], "ps": [...]}}.
    #[arg(long, value_name = "FILE")]
    cluster: Option<PathBuf>,
    /// The plan is for `dfc run --spawn N`: N worker processes of this machine, each on its
    /// share of the cores. The cost model predicts its step so (and --strategy auto chooses
    /// by that) instead of for one process [default devices: N].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=4096))]
    spawn: Option<u16>,
    /// How to spread the model: single, model, mirrored, ps or central-storage.
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(dfc_compile::Strategy::NAMES), default_value = "single")]
    strategy: String,
    /// With --strategy ps: combine the workers' gradients into one update per step (the
    /// default is asynchronous: each worker applies its own).
    #[arg(long)]
    sync: bool,
    /// Asynchronous ps: divide each replica's gradient by its staleness, the updates its
    /// variables took since it read them plus one (on by default with sgd and momentum).
    #[arg(long, conflicts_with = "no_staleness_aware")]
    staleness_aware: bool,
    /// Asynchronous ps: apply every replica's gradient at the full rate, however stale.
    #[arg(long)]
    no_staleness_aware: bool,
    /// With --strategy ps --sync: B of the workers are backups. The replicas step on their own,
    /// and each update takes the first (workers − B) gradients computed from the current
    /// variables and drops the rest, so that a slow worker does not hold up the others
    /// (TensorFlow's SyncReplicasOptimizer). Needs workers of their own (--spawn, --cluster).
    #[arg(long, value_name = "B", default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=4096))]
    backup_workers: u32,
    /// With --strategy model: how compute and variables are spread over the devices.
    /// earliest-finish: each op where the cost model says it would finish first (the
    /// default); searched: that, then improved by moves scored by the simulated step;
    /// round-robin: each op on the next device in turn (a baseline to compare with).
    #[arg(long, value_name = "HOW", value_parser = clap::builder::PossibleValuesParser::new(dfc_passes::ModelPlacement::NAMES))]
    model_placement: Option<String>,
    /// How variables are spread over their devices.
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(dfc_passes::VariablePlacement::NAMES), default_value = "round-robin")]
    placement: String,
    /// Shard every variable of at least twice this size over the ps tasks (fixed-size
    /// partitioning), in shards of at least this size.
    #[arg(long, value_name = "BYTES")]
    partition_min_bytes: Option<u64>,
    /// Pack gradients of at most this many bytes into shared all-reduces (Horovod's tensor
    /// fusion), in the order they are computed; 0 turns it off. Default: 64 MiB, 256 KiB with
    /// --overlap.
    #[arg(long, value_name = "BYTES")]
    fusion_threshold: Option<usize>,
    /// With --strategy mirrored: start each bucket's all-reduce as soon as its last gradient
    /// is computed, while the backward pass computes the others (PyTorch DDP's overlap).
    #[arg(long)]
    overlap: bool,
    /// With --strategy mirrored: local SGD. Each replica applies its own gradients, and every
    /// K steps (and before each evaluation and checkpoint) the replicas' variables are
    /// averaged: one all-reduce of the variables every K steps instead of the gradients' every
    /// step.
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    sync_every: Option<u32>,
    /// With --strategy mirrored: ZeRO stage 1. Each of the N replicas keeps 1/N of the
    /// optimizer's state and updates 1/N of each variable, and the new values are gathered
    /// by every replica: the same training, with 1/N of the optimizer's memory per replica.
    #[arg(long)]
    shard_optimizer: bool,
    /// With --strategy model: a pipeline. Each device is a stage of consecutive layers, of
    /// about equal cost; the batch is split into M micro-batches that flow through the stages
    /// one after another, their gradients summed into one update (GPipe).
    #[arg(long, value_name = "M", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=4096))]
    micro_batches: u32,
    /// With --micro-batches: the order of each stage's passes. 1f1b: once the pipeline is
    /// full, one forward and one backward pass in turn, so that a stage holds at most one
    /// more micro-batch's activations than there are stages from it to the last (the last
    /// stage: one; the default); gpipe: every forward pass first.
    #[arg(long, value_name = "SCHEDULE", value_parser = ["1f1b", "gpipe"])]
    pipeline_schedule: Option<String>,
    /// Set aside device requests the cluster or the strategy cannot satisfy (with a warning)
    /// instead of failing.
    #[arg(long)]
    soft_placement: bool,
    /// Cost model: floating-point operations per second of one device.
    #[arg(long, value_name = "RATE")]
    device_flops: Option<f64>,
    /// Cost model: bytes per second between devices of one task.
    #[arg(long, value_name = "RATE")]
    local_bandwidth: Option<f64>,
    /// Cost model: bytes per second between tasks.
    #[arg(long, value_name = "RATE")]
    remote_bandwidth: Option<f64>,
    /// Cost model: predict from this machine profile (`dfc calibrate -o FILE`) [default: this
    /// host's profile, where `dfc calibrate` has made one]
    #[arg(long, value_name = "FILE", conflicts_with_all = ["device_flops", "local_bandwidth", "remote_bandwidth", "no_profile"])]
    profile: Option<PathBuf>,
    /// Cost model: predict from the assumed rates (or those given), not from this host's profile.
    #[arg(long)]
    no_profile: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum MessageFormat {
    Human,
    Json,
}

fn parse_feed(text: &str) -> Result<(String, PathBuf), String> {
    let (name, path) = text.split_once('=').ok_or_else(|| format!("`{text}` is not INPUT=PATH"))?;
    Ok((name.trim().to_string(), PathBuf::from(path)))
}

/// `4`, `cpu:4` or `gpu:2`: how many local devices of which kind.
fn parse_devices(text: &str) -> Result<(u32, dfc_ir::DeviceKind), String> {
    let (kind, count) = match text.split_once(':') {
        Some((kind, count)) => (kind.parse::<dfc_ir::DeviceKind>()?, count),
        None => (dfc_ir::DeviceKind::Cpu, text),
    };
    match count.trim().parse::<u32>() {
        Ok(n @ 1..=4096) => Ok((n, kind)),
        _ => Err(format!("`{count}` is not a number of devices from 1 to 4096 (try 4, cpu:4 or gpu:2)")),
    }
}

fn parse_dim(text: &str) -> Result<(String, i64), String> {
    let (name, value) = text.split_once('=').ok_or_else(|| format!("`{text}` is not NAME=VALUE"))?;
    let value = value.trim().parse().map_err(|_| format!("the value of `{name}` is not an integer: `{value}`"))?;
    Ok((name.trim().to_string(), value))
}

/// A failure of the command itself, printed as one line.
struct Failure(String);

type Outcome = Result<ExitCode, Failure>;

fn main() -> ExitCode {
    let cli = Cli::parse();
    if matches!(
        cli.command,
        Command::Check { .. }
            | Command::Ir { .. }
            | Command::Inspect { .. }
            | Command::Graph { .. }
            | Command::Fmt { .. }
    ) {
        stop_quietly_on_a_closed_pipe();
    }
    let result = match cli.command {
        Command::Fmt { files, check } => Ok(fmt::run(&files, check)),
        Command::Lsp { stdio: _ } => lsp::serve_stdio().map(|()| ExitCode::SUCCESS).map_err(Failure),
        Command::Check { files, model, message_format } => check(&files, &model, message_format),
        Command::Ir { file, model, distribute, after } => ir(&file, &model, &distribute, &after),
        Command::Compile { file, model, distribute, output, report, timings } => {
            compile(&file, &model, &distribute, output, report, timings)
        }
        Command::Inspect { plan, json } => inspect(&plan, json),
        Command::Bench(args) => bench::bench(&args),
        Command::BenchAllreduce(args) => bench_allreduce::bench_allreduce(&args).map_err(Failure),
        Command::Calibrate(args) => calibrate::calibrate(&args),
        Command::Certs { out, hosts } => run::certs(&out, &hosts).map_err(Failure),
        Command::Graph { file, model, distribute, after, collapse, output } => {
            graph(&file, &model, &distribute, &after, collapse, output)
        }
        Command::Run {
            plan,
            feeds,
            eval_feeds,
            epochs,
            steps,
            seed,
            shuffle_seed,
            no_shuffle,
            metrics,
            tensorboard,
            checkpoint_dir,
            timeline,
            fetch,
            output,
            backend,
            lockstep,
            remote,
        } => {
            let train = dfc_driver::TrainOptions {
                backend: backend.backend(),
                feeds,
                eval_feeds,
                epochs,
                steps,
                seed,
                shuffle_seed,
                no_shuffle,
                metrics,
                tensorboard,
                checkpoint_dir,
                lockstep,
            };
            run_plan(&plan, &run::RunArgs { train, fetch, output, timeline, remote })
        }
        Command::Sample { plan, checkpoint_dir, prompt, length, temperature, seed, input, output, backend } => {
            let options = dfc_driver::sample::SampleOptions {
                input,
                output,
                prompt: prompt.into_bytes(),
                length,
                temperature,
                seed,
            };
            read_plan(&plan).and_then(|plan| {
                run::sample(&plan, &options, checkpoint_dir, backend.backend()).map_err(Failure)?;
                Ok(ExitCode::SUCCESS)
            })
        }
        Command::Worker { listen, token_file, tls_dir, data_port, no_shared_memory, threads, delay_ms } => {
            let data = dfc_rpc::DataPlane {
                port: data_port,
                shared_memory: !no_shared_memory,
                step_delay: std::time::Duration::from_millis(delay_ms),
            };
            run::worker(&listen, token_file.as_deref(), tls_dir.as_deref(), data, threads).map_err(Failure)
        }
    };
    match result {
        Ok(code) => code,
        Err(Failure(message)) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}

/// `dfc inspect plan | head` ends like any Unix filter when `head` closes the pipe, instead of
/// panicking in `println!` (Rust ignores SIGPIPE). Only for the commands that just print: the
/// others hold sockets, where a closed peer must be an error, not a signal.
fn stop_quietly_on_a_closed_pipe() {
    // SAFETY: sets a signal disposition before any thread is started.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Reads a source file. Bytes that are not UTF-8 are a diagnostic at the first bad byte, so
/// even garbage input gets a located message.
fn read_source(path: &Path) -> Result<(Source, Vec<Diagnostic>), Failure> {
    let bytes = dfc_diag::read::read_at_most(path, dfc_diag::read::MAX_SOURCE_BYTES)
        .map_err(|e| Failure(format!("cannot read `{}`: {}", path.display(), io_reason(&e))))?;
    let shown = path.display().to_string();
    match String::from_utf8(bytes) {
        Ok(text) => Ok((Source { path: shown, text }, Vec::new())),
        Err(error) => {
            let at = error.utf8_error().valid_up_to();
            let text = String::from_utf8_lossy(error.as_bytes()).into_owned();
            let offset = text[..]
                .char_indices()
                .nth(error.as_bytes()[..at].iter().filter(|b| (**b & 0xC0) != 0x80).count())
                .map_or(text.len(), |(i, _)| i);
            let diagnostic =
                Diagnostic::error(Code::NOT_UTF8, Span::new(offset, offset + 1), "the file is not valid UTF-8")
                    .with_label("invalid byte here")
                    .with_help("dfc reads UTF-8 text; is this a .df file?");
            Ok((Source { path: shown, text }, vec![diagnostic]))
        }
    }
}

fn io_reason(error: &std::io::Error) -> String {
    match error.kind() {
        std::io::ErrorKind::NotFound => "no such file".into(),
        std::io::ErrorKind::PermissionDenied => "permission denied".into(),
        std::io::ErrorKind::IsADirectory => "it is a directory".into(),
        // dfc's own words (`dfc_diag::read`), already as they should read.
        std::io::ErrorKind::FileTooLarge => error.to_string(),
        _ => {
            let text = error.to_string();
            text.split(" (os error").next().unwrap_or(&text).to_lowercase()
        }
    }
}

fn options(model: &ModelArgs) -> Result<dfc_sema::Options, Failure> {
    let optimizer = match &model.optimizer {
        None => None,
        Some(text) => match dfc_sema::check_optimizer(text) {
            Ok(call) => Some(call),
            Err(diagnostics) => {
                let source = Source { path: "--optimizer".into(), text: text.clone() };
                report(&source, &diagnostics, MessageFormat::Human);
                return Err(Failure(format!("--optimizer `{text}` is not a valid optimizer")));
            }
        },
    };
    Ok(dfc_sema::Options { dims: model.dims.clone(), optimizer })
}

/// Prints diagnostics; returns (errors, warnings).
fn report(source: &Source, diagnostics: &[Diagnostic], format: MessageFormat) -> (usize, usize) {
    let index = LineIndex::new(&source.text);
    let color = render::use_color();
    for diagnostic in diagnostics {
        match format {
            MessageFormat::Human => eprint!("{}", render::human(source, diagnostic, color)),
            MessageFormat::Json => println!("{}", render::json(source, &index, diagnostic)),
        }
    }
    let errors = diagnostics.iter().filter(|d| d.is_error()).count();
    (errors, diagnostics.len() - errors)
}

fn plural(n: usize, word: &str) -> String {
    if n == 1 {
        format!("1 {word}")
    } else {
        format!("{n} {word}s")
    }
}

/// The front end on one file. A file that is not UTF-8 is not analysed further.
fn front_end(
    source: &Source,
    early: Vec<Diagnostic>,
    model: &ModelArgs,
    one: bool,
) -> Result<(Option<dfc_ir::Module>, Vec<Diagnostic>), Failure> {
    if !early.is_empty() {
        return Ok((None, early));
    }
    let options = options(model)?;
    Ok(if one {
        dfc_sema::compile_source(&source.text, model.model.as_deref(), &options)
    } else {
        (None, dfc_sema::check_source(&source.text, &options).1)
    })
}

fn check(files: &[PathBuf], model: &ModelArgs, format: MessageFormat) -> Outcome {
    let mut failed = false;
    for path in files {
        let (source, early) = read_source(path)?;
        // With --model, check that model only (and that it exists).
        let (_, diagnostics) = front_end(&source, early, model, model.model.is_some())?;
        let (errors, warnings) = report(&source, &diagnostics, format);
        if format == MessageFormat::Human && errors + warnings > 0 {
            let what = if errors > 0 { "could not check" } else { "checked" };
            let mut counts = Vec::new();
            if errors > 0 {
                counts.push(plural(errors, "error"));
            }
            if warnings > 0 {
                counts.push(plural(warnings, "warning"));
            }
            eprintln!(
                "{}: {what} `{}`: {}",
                if errors > 0 { "error" } else { "warning" },
                source.path,
                counts.join(", ")
            );
        }
        failed |= errors > 0;
    }
    Ok(if failed { ExitCode::FAILURE } else { ExitCode::SUCCESS })
}

/// The machine profiles the cluster file `path` gives its tasks, each path read relative to
/// the file's directory.
fn task_profiles(path: &std::path::Path, text: &str) -> Result<Vec<dfc_passes::TaskProfile>, Failure> {
    let listed = dfc_ir::task_profiles(text).map_err(|e| Failure(format!("cluster `{}`: {e}", path.display())))?;
    let dir = path.parent().unwrap_or(std::path::Path::new(""));
    let mut loaded: Vec<(PathBuf, std::sync::Arc<dfc_passes::Profile>)> = Vec::new();
    let mut profiles = Vec::new();
    for (job, task, file) in listed {
        let file = dir.join(file);
        // Tasks of one host share its profile: read once.
        let profile = match loaded.iter().find(|(p, _)| *p == file) {
            Some((_, profile)) => profile.clone(),
            None => {
                let profile =
                    std::sync::Arc::new(calibrate::load_profile(&file).map_err(|e| {
                        Failure(format!("cluster `{}`, job `{job}`, task {task}: {e}", path.display()))
                    })?);
                loaded.push((file, profile.clone()));
                profile
            }
        };
        profiles.push(dfc_passes::TaskProfile { job, task, profile });
    }
    Ok(profiles)
}

fn compile_options(model: &ModelArgs, args: &DistributeArgs) -> Result<dfc_compile::CompileOptions, Failure> {
    let mut cluster_text = None;
    let cluster = match (&args.cluster, args.devices) {
        (Some(path), _) => {
            let text = run::read_cluster(path).map_err(Failure)?;
            let cluster =
                dfc_ir::Cluster::from_json(&text).map_err(|e| Failure(format!("cluster `{}`: {e}", path.display())))?;
            cluster_text = Some((path, text));
            cluster
        }
        (None, devices) => {
            let spawned = args.spawn.map(u32::from);
            let (n, kind) = devices.unwrap_or((spawned.unwrap_or(1), dfc_ir::DeviceKind::Cpu));
            dfc_ir::Cluster::local(n as usize, kind)
        }
    };
    if args.sync && args.strategy != "ps" {
        return Err(Failure(
            "--sync applies to --strategy ps only (mirrored and central storage are always synchronous)".into(),
        ));
    }
    if args.pipeline_schedule.is_some() && args.micro_batches < 2 {
        return Err(Failure(
            "--pipeline-schedule orders a pipeline's micro-batches: give --micro-batches M too".into(),
        ));
    }
    if args.model_placement.is_some() && args.strategy != "model" {
        return Err(Failure(format!(
            "--model-placement applies to --strategy model, not {}{}",
            args.strategy,
            if args.strategy == "auto" {
                " (which tries the searched and earliest-finish placements itself)"
            } else {
                ""
            }
        )));
    }
    let mut cost_model = dfc_passes::CostModel::default();
    let positive = |value: Option<f64>, flag: &str| -> Result<Option<f64>, Failure> {
        match value {
            Some(v) if !(v.is_finite() && v > 0.0) => {
                Err(Failure(format!("{flag} must be a positive number, not {v}")))
            }
            other => Ok(other),
        }
    };
    if let Some(v) = positive(args.device_flops, "--device-flops")? {
        cost_model.flops_per_second = v;
    }
    if let Some(v) = positive(args.local_bandwidth, "--local-bandwidth")? {
        cost_model.local_bytes_per_second = v;
    }
    if let Some(v) = positive(args.remote_bandwidth, "--remote-bandwidth")? {
        cost_model.remote_bytes_per_second = v;
    }
    let rates_given = args.device_flops.is_some() || args.local_bandwidth.is_some() || args.remote_bandwidth.is_some();
    if let Some(path) = &args.profile {
        cost_model = dfc_passes::CostModel::calibrated(calibrate::load_profile(path).map_err(Failure)?);
    } else if !(args.no_profile || rates_given) {
        if let Some(profile) = calibrate::host_profile() {
            cost_model = dfc_passes::CostModel::calibrated(profile);
        }
    }
    if let (Some((path, text)), false) = (cluster_text, args.no_profile || rates_given) {
        cost_model = cost_model.with_task_profiles(task_profiles(path, &text)?);
    }
    Ok(dfc_compile::CompileOptions {
        sema: options(model)?,
        model: model.model.clone(),
        cluster,
        strategy: dfc_compile::Strategy::from_name(&args.strategy, args.sync).expect("clap checks the name"),
        placement: dfc_passes::VariablePlacement::from_name(&args.placement).expect("clap checks the name"),
        partition_min_bytes: args.partition_min_bytes,
        soft_placement: args.soft_placement,
        cost_model,
        model_placement: match &args.model_placement {
            Some(name) => dfc_passes::ModelPlacement::from_name(name).expect("clap checks the name"),
            None => dfc_passes::ModelPlacement::EarliestFinish,
        },
        fusion: match (args.fusion_threshold, args.overlap) {
            (Some(threshold_bytes), _) => dfc_passes::FusionOptions { threshold_bytes },
            (None, true) => dfc_passes::FusionOptions::overlapped(),
            (None, false) => dfc_passes::FusionOptions::default(),
        },
        overlap: args.overlap,
        replica_instances: true,
        sync_every: args.sync_every,
        staleness_aware: match (args.staleness_aware, args.no_staleness_aware) {
            (true, _) => Some(true),
            (_, true) => Some(false),
            _ => None,
        },
        backup_workers: args.backup_workers,
        shard_optimizer: args.shard_optimizer,
        micro_batches: args.micro_batches,
        one_forward_one_backward: args.pipeline_schedule.as_deref() != Some("gpipe"),
        spawned_workers: args.spawn.map(usize::from),
    })
}

/// Prints what a compile error says: located diagnostics, or one line for a bad option.
fn report_compile_error(source: &Source, error: dfc_compile::CompileError) -> Outcome {
    match error {
        dfc_compile::CompileError::Diagnostics(diagnostics) => {
            let (errors, _) = report(source, &diagnostics, MessageFormat::Human);
            eprintln!("error: could not compile `{}`: {}", source.path, plural(errors.max(1), "error"));
            Ok(ExitCode::FAILURE)
        }
        dfc_compile::CompileError::Usage(message) => Err(Failure(message)),
    }
}

/// The source text, or the diagnostic of a file that is not UTF-8 (printed).
fn read_checked(path: &Path) -> Result<Result<Source, ExitCode>, Failure> {
    let (source, early) = read_source(path)?;
    if early.is_empty() {
        return Ok(Ok(source));
    }
    let (errors, _) = report(&source, &early, MessageFormat::Human);
    eprintln!("error: could not compile `{}`: {}", source.path, plural(errors.max(1), "error"));
    Ok(Err(ExitCode::FAILURE))
}

fn ir(path: &Path, model: &ModelArgs, distribute: &DistributeArgs, after: &str) -> Outcome {
    let source = match read_checked(path)? {
        Ok(source) => source,
        Err(code) => return Ok(code),
    };
    let options = compile_options(model, distribute)?;
    match dfc_compile::module_after(&source.text, after, &options) {
        Ok((module, warnings)) => {
            report(&source, &warnings, MessageFormat::Human);
            print!("{}", dfc_ir::print(&module));
            Ok(ExitCode::SUCCESS)
        }
        Err(error) => report_compile_error(&source, error),
    }
}

fn graph(
    path: &Path,
    model: &ModelArgs,
    distribute: &DistributeArgs,
    after: &str,
    collapse: Option<usize>,
    output: Option<PathBuf>,
) -> Outcome {
    let source = match read_checked(path)? {
        Ok(source) => source,
        Err(code) => return Ok(code),
    };
    let options = compile_options(model, distribute)?;
    let module = match dfc_compile::module_after(&source.text, after, &options) {
        Ok((module, warnings)) => {
            report(&source, &warnings, MessageFormat::Human);
            module
        }
        Err(error) => return report_compile_error(&source, error),
    };
    // A big graph folds its scopes unless told otherwise, so that it stays readable.
    let collapse = collapse.or((module.graph.len() > 2000).then_some(1));
    let dot = dfc_ir::to_dot(&module, &dfc_ir::DotOptions { collapse_depth: collapse });
    let Some(output) = output else {
        print!("{dot}");
        return Ok(ExitCode::SUCCESS);
    };
    let write_error = |e: std::io::Error| Failure(format!("cannot write `{}`: {}", output.display(), io_reason(&e)));
    if output.extension().is_some_and(|e| e == "svg") {
        use std::io::Write as _;
        let mut child = std::process::Command::new("dot")
            .args(["-Tsvg", "-o"])
            .arg(&output)
            .stdin(std::process::Stdio::piped())
            .spawn()
            .map_err(|_| {
                Failure("cannot run Graphviz's `dot` to draw SVG: install graphviz, or write a .dot file".into())
            })?;
        child.stdin.take().expect("piped").write_all(dot.as_bytes()).map_err(write_error)?;
        let status = child.wait().map_err(write_error)?;
        if !status.success() {
            return Err(Failure(format!("Graphviz's `dot` failed ({status}) drawing `{}`", output.display())));
        }
    } else {
        std::fs::write(&output, dot).map_err(write_error)?;
    }
    eprintln!("drew model `{}` to `{}`", module.name, output.display());
    Ok(ExitCode::SUCCESS)
}

fn compile(
    path: &Path,
    model: &ModelArgs,
    distribute: &DistributeArgs,
    output: Option<PathBuf>,
    show_report: bool,
    show_timings: bool,
) -> Outcome {
    let started = std::time::Instant::now();
    let source = match read_checked(path)? {
        Ok(source) => source,
        Err(code) => return Ok(code),
    };
    let options = compile_options(model, distribute)?;
    let name = path.file_name().map_or_else(|| source.path.clone(), |n| n.to_string_lossy().into_owned());
    let compiled = match dfc_compile::compile(&source.text, &name, &options) {
        Ok(compiled) => compiled,
        Err(error) => return report_compile_error(&source, error),
    };
    report(&source, &compiled.warnings, MessageFormat::Human);
    let plan = compiled.plan;
    let chosen_by_auto = compiled.auto.is_some();
    let mut timings = compiled.timings;
    // Reading the source and the options came before the compile's own stages.
    let read = started.elapsed().as_secs_f64() - timings.total_seconds();
    timings
        .stages
        .insert(0, dfc_compile::StageTiming { stage: "read the source".into(), seconds: read, resident_bytes: None });
    let output = output.unwrap_or_else(|| path.with_extension("plan"));
    let writing = std::time::Instant::now();
    dfc_plan::write(&output, &plan)
        .map_err(|e| Failure(format!("cannot write `{}`: {}", output.display(), io_reason(&e))))?;
    timings.stages.push(dfc_compile::StageTiming {
        stage: "encode and write the plan".into(),
        seconds: writing.elapsed().as_secs_f64(),
        resident_bytes: dfc_compile::resident_bytes(),
    });
    if show_timings {
        eprint!("{timings}");
    }
    if show_report {
        if let Some(auto) = &compiled.auto {
            print!("{auto}");
        } else if let Some(search) = &compiled.search {
            print!("{}", dfc_compile::describe_search(search));
        }
        if let Some(report) = &plan.report {
            print!("{report}");
        }
    }
    let devices = plan.partitions.len() + plan.instances.len();
    eprintln!(
        "compiled `{}` (model `{}`, {}{} on {}{}) to `{}`",
        source.path,
        plan.model,
        plan.strategy.name,
        if chosen_by_auto { ", chosen by --strategy auto" } else { "" },
        plural(devices, "device"),
        distribute.spawn.map_or(String::new(), |n| format!(", for `dfc run --spawn {n}`")),
        output.display()
    );
    Ok(ExitCode::SUCCESS)
}

fn read_plan(path: &Path) -> Result<dfc_plan::Plan, Failure> {
    // A plan larger than a worker accepts could not run on workers either.
    let bytes = dfc_diag::read::read_at_most(path, dfc_rpc::MAX_MESSAGE_BYTES as u64)
        .map_err(|e| Failure(format!("cannot read `{}`: {}", path.display(), io_reason(&e))))?;
    dfc_plan::decode(&bytes).map_err(|e| Failure(format!("`{}`: {e}", path.display())))
}

fn run_plan(path: &Path, args: &run::RunArgs) -> Outcome {
    let plan = read_plan(path)?;
    run::run(&plan, args).map_err(Failure)?;
    Ok(ExitCode::SUCCESS)
}

fn inspect(path: &Path, json: bool) -> Outcome {
    let plan = read_plan(path)?;
    let summary = dfc_plan::summary(&plan);
    if json {
        println!("{}", serde_json::to_string_pretty(&summary).expect("summaries serialise"));
    } else {
        print!("{summary}");
    }
    Ok(ExitCode::SUCCESS)
}
