//! `dfc run`: trains a plan on data files, or runs it forward with `--fetch`; the progress
//! bar and the lines a person reads.

use dfc_driver::{EpochRecord, Progress, TrainOptions};
use dfc_rpc::rendezvous::Algorithm;
use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

/// A progress bar on a terminal; one line per epoch otherwise (logs, CI).
pub struct Reporter {
    bar: Option<ProgressBar>,
    interactive: bool,
    recent_loss: f64,
}

impl Reporter {
    pub fn new() -> Reporter {
        Reporter { bar: None, interactive: std::io::stderr().is_terminal(), recent_loss: f64::NAN }
    }
}

impl Progress for Reporter {
    fn epoch_started(&mut self, epoch: u64, epochs: u64, steps: u64) {
        if !self.interactive {
            return;
        }
        let bar = ProgressBar::new(steps);
        bar.set_style(
            ProgressStyle::with_template(
                "epoch {prefix} {bar:30} {pos}/{len} steps  {msg}  [{elapsed_precise}<{eta_precise}]",
            )
            .expect("valid template"),
        );
        bar.set_prefix(format!("{epoch}/{epochs}"));
        self.bar = Some(bar);
    }

    fn step(&mut self, loss: f64, examples_per_sec: f64) {
        // An exponential average reads better than the noisy per-batch loss.
        self.recent_loss = if self.recent_loss.is_nan() { loss } else { 0.95 * self.recent_loss + 0.05 * loss };
        if let Some(bar) = &self.bar {
            bar.set_message(format!("loss {:.4}  {:.0} examples/s", self.recent_loss, examples_per_sec));
            bar.inc(1);
        }
    }

    fn epoch_finished(&mut self, record: &EpochRecord) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
        let mut line = format!(
            "epoch {}: train loss {:.4}, {:.0} examples/s, {:.1} s",
            record.epoch, record.train_loss, record.examples_per_sec, record.seconds
        );
        if let Some(loss) = record.eval_loss {
            line += &format!("; eval loss {loss:.4}");
        }
        if let Some(accuracy) = record.eval_accuracy {
            line += &format!(", accuracy {accuracy:.4}");
        }
        for (name, value) in &record.metrics {
            line += &format!(", {name} {value:.4}");
        }
        if let Some((mean, max)) = record.staleness {
            line += &format!("; staleness mean {mean:.1}, max {max:.0}");
        }
        if let Some(backup) = record.backup {
            let rate = backup.updates as f64 / record.seconds.max(1e-9);
            line += &format!("; {} updates ({rate:.0}/s), {} gradients dropped", backup.updates, backup.dropped);
        }
        eprintln!("{line}");
        for worker in &record.workers {
            eprintln!(
                "  {}: {} steps in {:.2} s, {:.2} s of it in exchanges with other workers",
                worker.name, worker.steps, worker.run_seconds, worker.exchange_seconds
            );
        }
    }

    fn resumed(&mut self, step: u64, epoch: u64, path: &Path) {
        eprintln!("resuming from {} (step {step}, {epoch} epoch(s) done)", path.display());
    }

    fn note(&mut self, note: &str) {
        eprintln!("note: {note}");
    }
}

pub struct RunArgs {
    pub train: TrainOptions,
    pub fetch: Option<String>,
    pub output: Option<PathBuf>,
    /// `--timeline FILE`: record the run's spans and write them there.
    pub timeline: Option<PathBuf>,
    pub remote: RemoteArgs,
}

/// Where the partitions run: in this process (the default), or on workers.
#[derive(clap::Args, Default)]
pub struct RemoteArgs {
    /// Run on the workers of this cluster (TF_CONFIG's JSON shape: {"cluster": {"worker":
    /// ["host:port", ...], "ps": [...]}}), one per task of the plan; each runs `dfc worker`.
    #[arg(long, value_name = "FILE", conflicts_with = "spawn")]
    pub cluster: Option<PathBuf>,
    /// Start N worker processes on loopback and run on them (one machine, several processes).
    #[arg(long, value_name = "N")]
    pub spawn: Option<usize>,
    /// A file whose first line is the workers' shared token [default: the DFC_TOKEN variable;
    /// with --spawn, a fresh random one].
    #[arg(long)]
    pub token_file: Option<PathBuf>,
    /// Talk to the workers over TLS with client certificates: DIR holds ca.pem, cert.pem and
    /// key.pem (`dfc certs` makes them). Spawned workers get the same directory. Required for
    /// workers beyond loopback.
    #[arg(long, value_name = "DIR")]
    pub tls_dir: Option<PathBuf>,
    /// How long a worker waits for another within a step before the step fails (seconds).
    #[arg(long, default_value_t = 30.0, value_name = "SECONDS", value_parser = crate::bench::seconds)]
    pub wait: f64,
    /// How all-reduces go between workers: `hierarchical` reduces within each host (through
    /// shared memory), runs the ring between hosts and spreads the sums again, where a group's
    /// workers are on several hosts with as many on each (hosts told apart by the workers'
    /// addresses); `auto` picks it where some all-reduce of the plan is so, and `ring`
    /// otherwise. `mpi` runs all-reduces over every worker through the
    /// MPI library of a job that mpirun launched (one rank per worker; a dfc built with the
    /// `mpi` feature).
    #[arg(long, value_enum, default_value_t = AllReduceArg::Auto)]
    pub all_reduce: AllReduceArg,
}

/// `--all-reduce`.
#[derive(Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum AllReduceArg {
    #[default]
    Auto,
    Ring,
    Hierarchical,
    Mpi,
}

/// The all-reduce algorithm for `plan`'s all-reduces on the workers at `addresses` (partition
/// p on `partition_worker[p]`), and a line for the person running it. The hierarchical one
/// applies to a group of replicas whose workers are on several hosts with as many on each.
fn all_reduce_algorithm(
    asked: AllReduceArg,
    plan: &dfc_plan::Plan,
    addresses: &[String],
    partition_worker: &[usize],
) -> Result<(Algorithm, String), String> {
    let hosts = dfc_rpc::rendezvous::hosts_of(addresses);
    let count = hosts.iter().max().map_or(0, |h| h + 1);
    let groups = dfc_rpc::worker::routes(plan, partition_worker, 0).reductions;
    let hierarchical =
        groups.values().filter(|(ranks, _)| dfc_rpc::rendezvous::host_groups(ranks, &hosts).is_some()).count();
    let described = format!("{} worker(s) on {count} host(s)", addresses.len());
    match asked {
        AllReduceArg::Mpi => Ok((Algorithm::Mpi, format!("all-reduces: through MPI ({described})"))),
        AllReduceArg::Ring => Ok((Algorithm::Ring, format!("all-reduces: one ring ({described})"))),
        AllReduceArg::Auto if hierarchical == 0 => {
            Ok((Algorithm::Ring, format!("all-reduces: one ring ({described})")))
        }
        AllReduceArg::Hierarchical if hierarchical == 0 => Err(format!(
            "--all-reduce hierarchical needs workers on several hosts, as many of an all-reduce's on each, but the \
             {described} have no such all-reduce (hosts are told apart by the workers' addresses)"
        )),
        _ => Ok((
            Algorithm::Hierarchical,
            format!(
                "all-reduces: hierarchical ({described}; {hierarchical} of {} all-reduce(s) within each host, then a ring between hosts)",
                groups.len()
            ),
        )),
    }
}

/// Trains, or with `--fetch` runs forward, any plan (one partition or many); prints what a
/// person reads, or returns the error.
pub fn run(plan: &dfc_plan::Plan, args: &RunArgs) -> Result<(), String> {
    let Some(path) = &args.timeline else { return run_untraced(plan, args) };
    dfc_interp::trace::enable();
    // The driver's own spans on a track of their own; each partition's go on its device's.
    let result = dfc_interp::trace::on_track("driver", || run_untraced(plan, args));
    let events = dfc_interp::trace::take();
    if result.is_ok() && args.fetch.is_none() {
        report_prediction(plan, args, &events);
    }
    let process = dfc_driver::timeline::Process { name: format!("dfc run {}", plan.model), events: &events };
    dfc_driver::timeline::write(path, &[process])
        .map_err(|e| format!("cannot write the timeline {}: {e}", path.display()))?;
    eprintln!("timeline: {} spans in {}", events.len(), path.display());
    result
}

/// After a traced training run: its median step beside the cost model's for the way it ran,
/// and per device and kind of work, the timeline's time a step beside the predicted.
fn report_prediction(plan: &dfc_plan::Plan, args: &RunArgs, events: &[dfc_interp::trace::Event]) {
    let Some((measured, steps)) = crate::predict::measured_step(events) else { return };
    let assignment = args.remote.spawn.and_then(|n| dfc_rpc::assign(plan, n).ok());
    let placement = match (&assignment, cluster_source(&args.remote)) {
        (Some(a), _) => crate::predict::Placement::Spawned(a),
        (None, Ok(Some(_))) => crate::predict::Placement::Cluster,
        _ => crate::predict::Placement::Here,
    };
    let modules = dfc_driver::session::program_modules(plan, &crate::predict::training_nodes(plan));
    let Some(predicted) = modules.ok().and_then(|modules| crate::predict::predict(plan, &modules, placement)) else {
        eprintln!("step: median {:.3} ms over {steps} steps; {}", measured * 1e3, crate::predict::NO_PROFILE);
        return;
    };
    eprintln!(
        "step: median {:.3} ms over {steps} steps; predicted {:.3} ms ({:+.1}%){}",
        measured * 1e3,
        predicted.step_seconds * 1e3,
        (predicted.step_seconds / measured - 1.0) * 100.0,
        crate::predict::describe(&crate::predict::breakdown(events, steps, &predicted))
    );
}

/// Makes this thread one of rayon's, where it runs all of `plan`'s steps itself (one partition, in this
/// process): the pool is then this thread and one worker fewer than it would have (one per core, or
/// `RAYON_NUM_THREADS`). Otherwise the steps ran on this thread beside as many workers as cores, and while a
/// worker spun for the next product (`dfc_gemm::hold`), this thread and both workers shared two cores: a process
/// now and then ran the CNN's training step at 9 ms against 5.5. Not where partitions run on threads of their
/// own, or on workers of this process: this thread waits for them there, and a pool of one thread (this one)
/// could not run their work. Call it before anything starts the pool (compiling the plan's code does).
pub fn compute_on_this_thread(plan: &dfc_plan::Plan) {
    if plan.partitions.len() == 1 {
        // An error means the pool exists already: it stays as it is.
        let _ = rayon::ThreadPoolBuilder::new().use_current_thread().build_global();
    }
}

fn run_untraced(plan: &dfc_plan::Plan, args: &RunArgs) -> Result<(), String> {
    let cluster = cluster_source(&args.remote)?;
    if cluster.is_some() || args.remote.spawn.is_some() {
        return run_remote(plan, args, cluster);
    }
    compute_on_this_thread(plan);
    if args.remote.all_reduce != AllReduceArg::Auto {
        return Err("--all-reduce chooses how workers all-reduce: give it with --cluster, TF_CONFIG or --spawn".into());
    }
    if let Some(name) = &args.fetch {
        let mut session =
            dfc_driver::Session::with_backend(plan, args.train.seed, args.train.backend).map_err(|e| e.to_string())?;
        restore_for_fetch(&mut session, &args.train)?;
        let result = dfc_driver::infer(&mut session, name, &args.train.feeds).map_err(|e| e.to_string())?;
        return save_or_print(name, &result, args.output.as_deref());
    }
    let mut reporter = Reporter::new();
    let started = std::time::Instant::now();
    let summary = dfc_driver::train(plan, &args.train, &mut reporter).map_err(|e| e.to_string())?;
    eprintln!("trained {} steps in {:.1} s", summary.steps, started.elapsed().as_secs_f64());
    Ok(())
}

/// `dfc sample`: prints the prompt and the bytes the plan generates after it.
pub fn sample(
    plan: &dfc_plan::Plan,
    options: &dfc_driver::sample::SampleOptions,
    checkpoint_dir: Option<PathBuf>,
    backend: dfc_driver::Backend,
) -> Result<(), String> {
    compute_on_this_thread(plan);
    let mut session = dfc_driver::Session::with_backend(plan, options.seed, backend).map_err(|e| e.to_string())?;
    let train = TrainOptions { checkpoint_dir, seed: options.seed, ..TrainOptions::default() };
    restore_for_fetch(&mut session, &train)?;
    let text = dfc_driver::sample::sample(&mut session, options).map_err(|e| e.to_string())?;
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    out.write_all(&text).and_then(|()| out.write_all(b"\n")).map_err(|e| format!("cannot write the text: {e}"))
}

/// With --checkpoint-dir, the newest checkpoint's variables (which must match the plan's).
fn restore_for_fetch<R: dfc_driver::Runner>(session: &mut R, train: &TrainOptions) -> Result<(), String> {
    match &train.checkpoint_dir {
        Some(dir) => match dfc_driver::checkpoint::latest(dir).map_err(|e| e.to_string())? {
            Some(found) => {
                eprintln!("using the variables of {} (step {})", found.path.display(), found.step);
                dfc_driver::restore(session, &found).map_err(|e| e.to_string())
            }
            None => Err(format!("no checkpoint in {}", dir.display())),
        },
        None => {
            eprintln!("note: no --checkpoint-dir, so the variables have their initial values (seed {})", train.seed);
            Ok(())
        }
    }
}

fn save_or_print(name: &str, result: &dfc_interp::Tensor, output: Option<&Path>) -> Result<(), String> {
    match output {
        Some(path) => {
            dfc_driver::save_npy(path, result).map_err(|e| format!("cannot write `{}`: {e}", path.display()))?;
            eprintln!("wrote `{name}` ({}) to {}", result.ty(), path.display());
        }
        None => print_tensor(name, result),
    }
    Ok(())
}

/// A tensor for a person: its type, then its values (the first rows of a large one).
fn print_tensor(name: &str, tensor: &dfc_interp::Tensor) {
    println!("{name}: {}", tensor.ty());
    let values = tensor.to_f64_vec();
    let row = tensor.shape.dims().last().copied().unwrap_or(1).max(1);
    const ROWS: usize = 10;
    for chunk in values.chunks(row).take(ROWS) {
        let items: Vec<String> = chunk.iter().map(|v| format!("{v:.6}")).collect();
        println!("  [{}]", items.join(", "));
    }
    let rows = values.len().div_ceil(row);
    if rows > ROWS {
        println!("  ... {} more rows (use -o FILE.npy to save them all)", rows - ROWS);
    }
}

/// `dfc worker`: serves until a driver shuts it down. Prints `dfc worker listening on ADDR`
/// (the bound address) on its first line of output.
pub fn worker(
    listen: &str,
    token_file: Option<&Path>,
    tls_dir: Option<&Path>,
    data: dfc_rpc::DataPlane,
    threads: Option<u16>,
) -> Result<std::process::ExitCode, String> {
    let token = dfc_rpc::auth::load_token(token_file)?;
    if let Some(threads) = threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads.into())
            .build_global()
            .map_err(|e| format!("cannot start {threads} compute threads: {e}"))?;
    }
    let tls = tls_dir.map(dfc_rpc::Tls::load).transpose()?;
    dfc_rpc::keep_freed_memory();
    if std::env::var_os(dfc_rpc::driver::EXIT_WITH_PARENT).is_some() {
        // Started by `dfc run --spawn`: end with the driver, however it ends.
        std::thread::spawn(|| {
            let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
            std::process::exit(0);
        });
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(|e| e.to_string())?;
    runtime.block_on(async {
        let listener =
            tokio::net::TcpListener::bind(listen).await.map_err(|e| format!("cannot listen on {listen}: {e}"))?;
        let address = listener.local_addr().map_err(|e| e.to_string())?;
        if tls.is_none() {
            dfc_rpc::tls::plaintext_listener(address)?;
        }
        println!("dfc worker listening on {address}");
        use std::io::Write;
        let _ = std::io::stdout().flush();
        dfc_rpc::serve(listener, token, tls, data).await
    })?;
    Ok(std::process::ExitCode::SUCCESS)
}

/// The most a cluster file may hold (a thousand tasks take about 30 KiB).
const MAX_CLUSTER_BYTES: u64 = 1 << 20;

/// The text of a cluster file (`--cluster`, of `dfc compile` and `dfc run`).
pub fn read_cluster(path: &Path) -> Result<String, String> {
    let bytes = dfc_diag::read::read_at_most(path, MAX_CLUSTER_BYTES)
        .map_err(|e| format!("cannot read `{}`: {}", path.display(), crate::io_reason(&e)))?;
    String::from_utf8(bytes).map_err(|_| format!("`{}` is not UTF-8 text", path.display()))
}

/// Where a run's cluster is described: `--cluster FILE`, or (without it and without `--spawn`)
/// the TF_CONFIG environment variable, as TensorFlow's multi-worker strategies read it.
enum ClusterSource {
    File(PathBuf),
    TfConfig(String),
}

/// The cluster of this run, if it has one; an empty TF_CONFIG counts as none.
fn cluster_source(remote: &RemoteArgs) -> Result<Option<ClusterSource>, String> {
    if let Some(file) = &remote.cluster {
        return Ok(Some(ClusterSource::File(file.clone())));
    }
    if remote.spawn.is_some() {
        return Ok(None);
    }
    match std::env::var("TF_CONFIG") {
        Ok(text) if text.trim().is_empty() => Ok(None),
        Ok(text) => Ok(Some(ClusterSource::TfConfig(text))),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => Err("TF_CONFIG is not valid UTF-8".into()),
    }
}

/// Trains (or with --fetch runs) the plan on remote workers: those of the `cluster` (--cluster
/// or TF_CONFIG), or --spawn N local ones.
fn run_remote(plan: &dfc_plan::Plan, args: &RunArgs, cluster: Option<ClusterSource>) -> Result<(), String> {
    let remote = &args.remote;
    let tls = remote.tls_dir.as_deref().map(dfc_rpc::Tls::load).transpose()?;
    let mut _spawned = None;
    let mut own_server = None;
    let mut mpi_job: Option<dfc_rpc::mpi::Job> = None;
    let (token, addresses, assignment) = match (cluster, remote.spawn) {
        (_, Some(n)) => {
            let token = match &remote.token_file {
                Some(_) => dfc_rpc::auth::load_token(remote.token_file.as_deref())?,
                None => dfc_rpc::auth::random_token(),
            };
            let assignment = dfc_rpc::assign(plan, n)?;
            let started = assignment.names.len();
            if started < n {
                eprintln!("note: the plan has {started} partition(s): {started} worker(s), not {n}");
            }
            let exe = std::env::current_exe().map_err(|e| format!("cannot find the dfc executable: {e}"))?;
            let workers = dfc_rpc::LocalWorkers::spawn(&exe, started, &token, remote.tls_dir.as_deref())?;
            let addresses = workers.addresses.clone();
            _spawned = Some(workers);
            (token, addresses, assignment)
        }
        (Some(source), None) => {
            let (text, origin) = match source {
                ClusterSource::TfConfig(text) => (text, "TF_CONFIG".to_string()),
                ClusterSource::File(file) => (read_cluster(&file)?, file.display().to_string()),
            };
            let (token, addresses, assignment) = cluster_workers(plan, &text, &origin, remote)?;
            // Under a launcher (mpirun, srun) or TF_CONFIG's `task`, every process runs this
            // command: the first drives (and serves its own task), the others serve.
            if let Some((rank, source)) = launcher_rank(&text, &assignment)? {
                let address = addresses.get(rank).ok_or_else(|| {
                    format!("{source} gives rank {rank}, but the plan has {} task(s)", addresses.len())
                })?;
                if remote.all_reduce == AllReduceArg::Mpi {
                    if plan.strategy.overlap {
                        return Err("--all-reduce mpi runs all-reduces one at a time, in order: compile the plan without --overlap".into());
                    }
                    // Finalised when this function returns, after the job's last all-reduce.
                    let patience = std::time::Duration::from_secs_f64(remote.wait.max(0.001));
                    mpi_job = Some(init_mpi(addresses.len(), rank, patience)?);
                }
                if rank > 0 {
                    let name = &assignment.names[rank];
                    let listening = || eprintln!("serving {name} at {address} ({source})");
                    return serve_blocking(address, token, tls, listening).map(|_| ());
                }
                own_server = Some(start_server(address, token.clone(), tls.clone())?);
            }
            (token, addresses, assignment)
        }
        (None, None) => unreachable!("called for remote runs"),
    };
    if remote.all_reduce == AllReduceArg::Mpi && mpi_job.is_none() {
        return Err("--all-reduce mpi needs a job launched by mpirun (or srun), one rank per worker of --cluster, \
             every rank running this `dfc run`"
            .into());
    }
    let driven = drive(plan, args, &token, &addresses, &assignment, tls, _spawned.is_some(), own_server);
    match (driven, mpi_job) {
        // The other ranks may wait in an MPI all-reduce that will never end (and MPI's
        // finalisation with them): say why, and end the whole job.
        (Err(e), Some(job)) => {
            eprintln!("error: {e}");
            job.abort(1)
        }
        (driven, job) => {
            drop(job);
            driven
        }
    }
}

/// Initialises MPI as rank `rank` of `size`. MPI's initialisation waits for every rank of the
/// job, silently: a rank that is stopped or never started would hang this one with no word. So
/// after `patience` (--wait) this says what it waits for, once, and goes on waiting, since a
/// launcher may be slow to start ranks on many hosts.
fn init_mpi(size: usize, rank: usize, patience: std::time::Duration) -> Result<dfc_rpc::mpi::Job, String> {
    let (initialised, waited) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        if waited.recv_timeout(patience) == Err(std::sync::mpsc::RecvTimeoutError::Timeout) {
            eprintln!(
                "warning: rank {rank}: MPI's initialisation has waited {:.1} s for the job's other ranks \
                 (is one stopped, or not started? the job needs {size} ranks, one per worker of the cluster)",
                patience.as_secs_f64()
            );
        }
    });
    let job = dfc_rpc::mpi::Job::init(size, rank);
    drop(initialised);
    job
}

/// Runs the plan on the workers at `addresses` (some `spawned` here, one served by
/// `own_server`), then stops them.
#[allow(clippy::too_many_arguments)]
fn drive(
    plan: &dfc_plan::Plan,
    args: &RunArgs,
    token: &str,
    addresses: &[String],
    assignment: &dfc_rpc::Assignment,
    tls: Option<dfc_rpc::Tls>,
    spawned: bool,
    own_server: Option<std::thread::JoinHandle<()>>,
) -> Result<(), String> {
    let remote = &args.remote;
    let wait = std::time::Duration::from_secs_f64(remote.wait.max(0.001));
    let (algorithm, described) =
        all_reduce_algorithm(remote.all_reduce, plan, addresses, &assignment.partition_worker)?;
    let mut session = dfc_rpc::RemoteSession::connect(
        plan,
        addresses,
        assignment,
        token,
        args.train.seed,
        args.train.backend,
        wait,
        tls.as_ref(),
        algorithm,
    )
    .map_err(|e| e.to_string())?;
    // The stall inspector: a step still waiting on other workers after a heartbeat says on what.
    session.on_stall(|report| eprintln!("warning: {report}"));
    if plan
        .partitions
        .iter()
        .any(|p| p.module.graph.node_ids().any(|id| matches!(p.module.graph.node(id).op, dfc_ir::Op::AllReduce { .. })))
    {
        eprintln!("{described}");
    }
    for ((name, address), threads) in assignment.names.iter().zip(addresses).zip(session.worker_threads()) {
        let count = assignment.partition_worker.iter().filter(|&&w| assignment.names[w] == *name).count();
        eprintln!("worker {name} at {address}: {count} partition(s), {threads} compute thread(s)");
    }
    let result = if let Some(name) = &args.fetch {
        restore_for_fetch(&mut session, &args.train)?;
        let result = dfc_driver::infer(&mut session, name, &args.train.feeds).map_err(|e| e.to_string())?;
        save_or_print(name, &result, args.output.as_deref())
    } else {
        let mut reporter = Reporter::new();
        let started = std::time::Instant::now();
        let summary = dfc_driver::train_with(&mut session, &args.train, &mut reporter).map_err(|e| e.to_string())?;
        eprintln!("trained {} steps in {:.1} s", summary.steps, started.elapsed().as_secs_f64());
        Ok(())
    };
    if spawned || own_server.is_some() {
        session.shutdown();
    }
    if let Some(server) = own_server {
        let _ = server.join();
    }
    result
}

/// The token, the workers' addresses (by rank) and the assignment of a plan to the tasks of a
/// cluster (TF_CONFIG's JSON shape, read from `origin`).
fn cluster_workers(
    plan: &dfc_plan::Plan,
    text: &str,
    origin: &str,
    remote: &RemoteArgs,
) -> Result<(String, Vec<String>, dfc_rpc::Assignment), String> {
    let token = dfc_rpc::auth::load_token(remote.token_file.as_deref())?;
    let cluster = dfc_ir::Cluster::from_json(text).map_err(|e| format!("{origin}: {e}"))?;
    let tasks = cluster.jobs.iter().map(|j| j.tasks.len()).sum::<usize>();
    let assignment = dfc_rpc::assign(plan, tasks)?;
    let mut addresses = Vec::new();
    for name in &assignment.names {
        // `/job:NAME/task:I`
        let address = name
            .strip_prefix("/job:")
            .and_then(|rest| rest.split_once("/task:"))
            .and_then(|(job, task)| {
                let task: usize = task.parse().ok()?;
                cluster.jobs.iter().find(|j| j.name == job)?.tasks.get(task)?.address.clone()
            })
            .ok_or_else(|| format!("{origin} has no address for the plan's task {name}"))?;
        addresses.push(address);
    }
    Ok((token, addresses, assignment))
}

/// The launchers' rank variables, in the order they are looked for.
const RANK_VARIABLES: [&str; 4] = ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"];

/// This process's rank among the tasks: from a launcher's variable (mpirun, srun), or from
/// TF_CONFIG's `task` ({"type": "worker", "index": 1}) in the cluster text; `None` when
/// neither is there (this process only drives).
fn launcher_rank(cluster_text: &str, assignment: &dfc_rpc::Assignment) -> Result<Option<(usize, String)>, String> {
    for variable in RANK_VARIABLES {
        if let Ok(value) = std::env::var(variable) {
            let rank = value.trim().parse::<usize>().map_err(|_| format!("{variable}={value} is not a rank"))?;
            return Ok(Some((rank, format!("{variable}={rank}"))));
        }
    }
    let config: serde_json::Value = serde_json::from_str(cluster_text).map_err(|e| e.to_string())?;
    let Some(task) = config.get("task") else { return Ok(None) };
    let (Some(job), Some(index)) =
        (task.get("type").and_then(|t| t.as_str()), task.get("index").and_then(|i| i.as_u64()))
    else {
        return Err("TF_CONFIG's `task` needs a `type` and an `index`".into());
    };
    let name = format!("/job:{job}/task:{index}");
    let rank = assignment
        .names
        .iter()
        .position(|n| *n == name)
        .ok_or_else(|| format!("TF_CONFIG's task {name} runs no partition of the plan"))?;
    Ok(Some((rank, format!("TF_CONFIG task {name}"))))
}

/// Serves as a worker at `address` until the driver shuts it down; `listening` runs once the
/// address is bound, so that what it says (and a launcher's log) is true.
fn serve_blocking(
    address: &str,
    token: String,
    tls: Option<dfc_rpc::Tls>,
    listening: impl FnOnce(),
) -> Result<std::process::ExitCode, String> {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(|e| e.to_string())?;
    runtime.block_on(async {
        let listener =
            tokio::net::TcpListener::bind(address).await.map_err(|e| format!("cannot listen on {address}: {e}"))?;
        listening();
        dfc_rpc::serve(listener, token, tls, dfc_rpc::DataPlane::default()).await
    })?;
    Ok(std::process::ExitCode::SUCCESS)
}

/// A worker for this process's own task, on a thread, listening before this returns.
fn start_server(
    address: &str,
    token: String,
    tls: Option<dfc_rpc::Tls>,
) -> Result<std::thread::JoinHandle<()>, String> {
    let listener = std::net::TcpListener::bind(address).map_err(|e| format!("cannot listen on {address}: {e}"))?;
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    Ok(std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("a runtime");
        runtime.block_on(async {
            let listener = tokio::net::TcpListener::from_std(listener).expect("a listener");
            if let Err(e) = dfc_rpc::serve(listener, token, tls, dfc_rpc::DataPlane::default()).await {
                eprintln!("error: {e}");
            }
        });
    }))
}

/// `dfc certs`: a CA and a `--tls-dir` per host (see `dfc_rpc::certs`); says what to copy where.
pub fn certs(out: &Path, hosts: &[String]) -> Result<std::process::ExitCode, String> {
    let made = dfc_rpc::certs::make(out, hosts)?;
    let ca = if made.new_ca { "made a CA" } else { "used the CA" };
    eprintln!("{ca} in {} (keep ca-key.pem there: it signs more hosts when this is run again)", out.display());
    for (dir, names) in &made.hosts {
        println!("{}: a certificate for {}", dir.display(), names.join(", "));
    }
    eprintln!("copy each host's directory to it and give it as --tls-dir to `dfc worker` and `dfc run` there");
    Ok(std::process::ExitCode::SUCCESS)
}
