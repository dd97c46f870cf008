//! Distributed runs on real `dfc worker` processes on 127.0.0.1: training on workers ends with
//! the parameters of the same plan run in one process (within float tolerance: the ring sums in
//! another order), a wrong or missing token is refused, plain connections beyond loopback are
//! refused, TLS runs work with the files `dfc certs` makes, a flood of unauthenticated
//! connections does not stop a worker, and a killed worker is reported by its task name.

use dfc_interp::Tensor;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

#[path = "support/close.rs"]
mod close;
#[path = "support/skip.rs"]
mod skip;

const TOKEN: &str = "test-token-0123456789abcdef";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn scratch(name: &str) -> PathBuf {
    let dir = root().join("target").join("worker-tests").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

fn dfc(args: &[&str], token: Option<&str>) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_dfc"));
    command.args(args).env("NO_COLOR", "1").env_remove("DFC_TOKEN");
    if let Some(token) = token {
        command.env("DFC_TOKEN", token);
    }
    command.output().expect("run dfc")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn s(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

/// A `dfc worker` process on loopback, killed when dropped.
struct Worker {
    child: Child,
    address: String,
}

impl Worker {
    fn start(token: &str) -> Worker {
        let mut command = Command::new(env!("CARGO_BIN_EXE_dfc"));
        command.args(["worker", "--listen", "127.0.0.1:0"]);
        Worker::launch(command, token, "127.0.0.1")
    }

    /// `command` starts a worker that listens on `host`.
    fn launch(mut command: Command, token: &str, host: &str) -> Worker {
        let mut child = command.env("DFC_TOKEN", token).stdout(Stdio::piped()).spawn().expect("start a worker");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).expect("the worker says");
        let address = line.trim().rsplit(' ').next().expect("an address").to_string();
        assert!(line.starts_with(&format!("dfc worker listening on {host}:")), "{line}");
        Worker { child, address }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A cluster file (TF_CONFIG's shape) naming the workers' addresses.
fn cluster_file(dir: &Path, jobs: &[(&str, &[&Worker])]) -> PathBuf {
    let jobs: Vec<String> = jobs
        .iter()
        .map(|(name, workers)| {
            let addresses: Vec<String> = workers.iter().map(|w| format!("\"{}\"", w.address)).collect();
            format!("\"{name}\": [{}]", addresses.join(", "))
        })
        .collect();
    let path = dir.join("cluster.json");
    std::fs::write(&path, format!("{{\"cluster\": {{{}}}}}", jobs.join(", "))).expect("cluster file");
    path
}

/// `n` examples of `y = x · w + 0.5` with 13 features, as .npy files in `dir`.
fn regression_data(dir: &Path, n: usize) -> [String; 2] {
    let mut state = 42u64;
    let mut next = move || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((state >> 33) as f64 / (1u64 << 31) as f64) * 2.0 - 1.0
    };
    let x: Vec<f64> = (0..n * 13).map(|_| next()).collect();
    let y: Vec<f64> =
        (0..n).map(|i| (0..13).map(|j| x[i * 13 + j] * (j as f64 - 6.0) / 6.0).sum::<f64>() + 0.5).collect();
    let (x_path, y_path) = (dir.join("x.npy"), dir.join("y.npy"));
    dfc_driver::save_npy(&x_path, &Tensor::from_f64(dfc_ir::DType::F32, vec![n, 13], &x)).expect("write x");
    dfc_driver::save_npy(&y_path, &Tensor::from_f64(dfc_ir::DType::F32, vec![n], &y)).expect("write y");
    [format!("x={}", s(&x_path)), format!("y={}", s(&y_path))]
}

fn compile(dir: &Path, extra: &[&str]) -> PathBuf {
    let plan = dir.join("model.plan");
    let source = root().join("examples").join("linear_regression.df");
    let mut args = vec!["compile", s(&source), "-o", s(&plan), "--optimizer", "momentum(lr = 0.05)"];
    args.extend_from_slice(extra);
    let output = dfc(&args, None);
    assert!(output.status.success(), "{}", text(&output.stderr));
    plan
}

/// Trains `plan` (for two epochs unless `extra` says) and returns the final checkpoint.
fn train(
    plan: &Path,
    feeds: &[String; 2],
    checkpoints: &Path,
    extra: &[&str],
    token: Option<&str>,
) -> dfc_driver::Checkpoint {
    let mut args = vec!["run", s(plan), "--feed", &feeds[0], "--feed", &feeds[1], "--seed", "3"];
    if !extra.contains(&"--epochs") {
        args.extend_from_slice(&["--epochs", "2"]);
    }
    args.extend_from_slice(&["--checkpoint-dir", s(checkpoints)]);
    args.extend_from_slice(extra);
    let output = dfc(&args, token);
    assert!(output.status.success(), "dfc {}: {}", args.join(" "), text(&output.stderr));
    dfc_driver::checkpoint::latest(checkpoints).expect("readable").expect("a checkpoint")
}

fn assert_same_parameters(what: &str, reference: &dfc_driver::Checkpoint, distributed: &dfc_driver::Checkpoint) {
    assert_eq!(reference.step, distributed.step, "{what}");
    assert_eq!(reference.tensors.keys().collect::<Vec<_>>(), distributed.tensors.keys().collect::<Vec<_>>(), "{what}");
    for (name, tensor) in &reference.tensors {
        let (a, b) = (tensor.to_f64_vec(), distributed.tensors[name].to_f64_vec());
        let worst = close::worst_difference(&format!("{what}: `{name}`"), &b, &a, close::absolute);
        assert!(worst < 1e-4, "{what}: `{name}` differs by {worst} from the one-process run");
    }
}

#[test]
fn mirrored_training_on_2_and_4_spawned_workers_matches_one_process() {
    for n in [2usize, 4] {
        let dir = scratch(&format!("mirrored-{n}"));
        let feeds = regression_data(&dir, 256);
        let plan = compile(&dir, &["--devices", &n.to_string(), "--strategy", "mirrored"]);
        let embedded = train(&plan, &feeds, &dir.join("embedded"), &[], None);
        let metrics = dir.join("metrics.jsonl");
        let spawned =
            train(&plan, &feeds, &dir.join("spawned"), &["--spawn", &n.to_string(), "--metrics", s(&metrics)], None);
        assert_same_parameters(&format!("mirrored on {n} workers"), &embedded, &spawned);
        // Each epoch's record tells what each worker's 8 training steps took.
        let records = std::fs::read_to_string(&metrics).unwrap();
        assert_eq!(records.lines().count(), 2);
        for line in records.lines() {
            let record: serde_json::Value = serde_json::from_str(line).unwrap();
            let workers = record["workers"].as_array().unwrap_or_else(|| panic!("no workers in {line}"));
            assert_eq!(workers.len(), n, "{line}");
            for worker in workers {
                let (run, exchange) =
                    (worker["run_seconds"].as_f64().unwrap(), worker["exchange_seconds"].as_f64().unwrap());
                assert_eq!(worker["steps"], 8, "{line}");
                assert!(run > 0.0 && exchange > 0.0 && exchange <= run, "{line}");
            }
        }
    }
}

#[test]
fn spawned_workers_share_the_cores_unless_told() {
    let dir = scratch("threads");
    let feeds = regression_data(&dir, 64);
    let plan = compile(&dir, &["--devices", "2", "--strategy", "mirrored"]);
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    for (rayon_threads, each) in [(None, (cores / 2).max(1)), (Some("3"), 3)] {
        let mut command = Command::new(env!("CARGO_BIN_EXE_dfc"));
        command.args(["run", s(&plan), "--feed", &feeds[0], "--feed", &feeds[1], "--epochs", "1", "--spawn", "2"]);
        command.env_remove("DFC_TOKEN").env_remove("RAYON_NUM_THREADS");
        if let Some(threads) = rayon_threads {
            command.env("RAYON_NUM_THREADS", threads);
        }
        let output = command.output().expect("run dfc");
        let stderr = text(&output.stderr);
        assert!(output.status.success(), "{stderr}");
        let said = format!("1 partition(s), {each} compute thread(s)");
        assert_eq!(stderr.matches(&said).count(), 2, "each worker computes on {each} thread(s): {stderr}");
    }
    let refused = dfc(&["worker", "--threads", "0"], Some(TOKEN));
    assert!(!refused.status.success());
    assert!(text(&refused.stderr).contains("--threads"), "{}", text(&refused.stderr));
}

#[test]
fn tensors_larger_than_a_frame_cross_the_data_plane_in_pieces() {
    // Replica 1's slice of x (32,768 × 13 f32, 1.6 MiB) goes from worker 0 to worker 1 in two
    // data-plane frames, reassembled there before its Recv.
    let dir = scratch("large-sends");
    let feeds = regression_data(&dir, 65_536);
    let plan = compile(&dir, &["--devices", "2", "--strategy", "mirrored", "--dim", "batch=65536"]);
    let embedded = train(&plan, &feeds, &dir.join("embedded"), &["--epochs", "3"], None);
    let spawned = train(&plan, &feeds, &dir.join("spawned"), &["--epochs", "3", "--spawn", "2"], None);
    assert_same_parameters("large sends on 2 workers", &embedded, &spawned);
}

#[test]
fn unfused_all_reduces_on_3_workers_run_side_by_side_and_match_one_process() {
    // One all-reduce per gradient, under way at once on the data plane, over a ring of three.
    let dir = scratch("mirrored-3-unfused");
    let feeds = regression_data(&dir, 240);
    let plan =
        compile(&dir, &["--devices", "3", "--strategy", "mirrored", "--fusion-threshold", "0", "--dim", "batch=24"]);
    let embedded = train(&plan, &feeds, &dir.join("embedded"), &[], None);
    let spawned = train(&plan, &feeds, &dir.join("spawned"), &["--spawn", "3"], None);
    assert_same_parameters("unfused, mirrored on 3 workers", &embedded, &spawned);
}

#[test]
fn overlapped_all_reduces_on_3_workers_match_one_process() {
    // Each gradient its own all-reduce (the weights' started on each worker's communication
    // thread while the bias's gradient is computed), over a ring of three.
    let dir = scratch("mirrored-3-overlap");
    let feeds = regression_data(&dir, 240);
    let plan = compile(
        &dir,
        &["--devices", "3", "--strategy", "mirrored", "--overlap", "--fusion-threshold", "0", "--dim", "batch=24"],
    );
    let embedded = train(&plan, &feeds, &dir.join("embedded"), &[], None);
    let spawned = train(&plan, &feeds, &dir.join("spawned"), &["--spawn", "3"], None);
    assert_same_parameters("overlapped, mirrored on 3 workers", &embedded, &spawned);
}

#[test]
fn synchronous_parameter_servers_on_workers_match_one_process() {
    let dir = scratch("ps-sync");
    let feeds = regression_data(&dir, 256);
    let workers: Vec<Worker> = (0..4).map(|_| Worker::start(TOKEN)).collect();
    let cluster = cluster_file(&dir, &[("worker", &[&workers[0], &workers[1]]), ("ps", &[&workers[2], &workers[3]])]);
    let plan = compile(&dir, &["--cluster", s(&cluster), "--strategy", "ps", "--sync"]);
    let embedded = train(&plan, &feeds, &dir.join("embedded"), &[], None);
    let remote = train(&plan, &feeds, &dir.join("remote"), &["--cluster", s(&cluster)], Some(TOKEN));
    assert_same_parameters("ps --sync on 2 workers and 2 ps", &embedded, &remote);
}

/// A plan compiled for a cluster runs on that cluster even where a task holds nothing (here a
/// second parameter server, for a model of one variable): its worker idles.
#[test]
fn a_task_without_partitions_gets_an_idle_worker() {
    let dir = scratch("idle-task");
    let feeds = regression_data(&dir, 256);
    let model = dir.join("one_param.df");
    std::fs::write(
        &model,
        "model one_param {
    dim batch = 16
    input x: f32[batch, 13]
    input y: f32[batch]
    param w: f32[13] = zeros
    let error = sum(x * w, axis = 1) + 0.5 - y
    minimize mean(error * error) with sgd(lr = 0.05)
}
",
    )
    .unwrap();
    let workers: Vec<Worker> = (0..4).map(|_| Worker::start(TOKEN)).collect();
    let cluster = cluster_file(&dir, &[("worker", &[&workers[0], &workers[1]]), ("ps", &[&workers[2], &workers[3]])]);
    let plan = dir.join("one_param.plan");
    let compiled =
        dfc(&["compile", s(&model), "-o", s(&plan), "--cluster", s(&cluster), "--strategy", "ps", "--sync"], None);
    assert!(compiled.status.success(), "{}", text(&compiled.stderr));
    let embedded = train(&plan, &feeds, &dir.join("embedded"), &[], None);
    let remote = train(&plan, &feeds, &dir.join("remote"), &["--cluster", s(&cluster)], Some(TOKEN));
    assert_same_parameters("on the cluster's 4 workers", &embedded, &remote);
    for n in ["4", "3"] {
        let spawned = train(&plan, &feeds, &dir.join(format!("spawned-{n}")), &["--spawn", n], None);
        assert_same_parameters(&format!("on {n} spawned workers"), &embedded, &spawned);
    }
    let five = dfc(&["run", s(&plan), "--feed", &feeds[0], "--feed", &feeds[1], "--spawn", "5"], None);
    let refusal = text(&five.stderr);
    assert!(
        refusal.contains("the plan was compiled for 4 task(s), 3 of them with partitions (3 in all); it cannot be spread over 5 worker(s)"),
        "{refusal}"
    );
}

/// `--lockstep` steps an asynchronous plan's replicas together on workers, as one process does:
/// the same parameters as the embedded run (free-running steps are not repeatable).
#[test]
fn asynchronous_parameter_servers_in_lockstep_match_one_process() {
    let dir = scratch("ps-async-lockstep");
    let feeds = regression_data(&dir, 256);
    let workers: Vec<Worker> = (0..3).map(|_| Worker::start(TOKEN)).collect();
    let cluster = cluster_file(&dir, &[("worker", &[&workers[0], &workers[1]]), ("ps", &[&workers[2]])]);
    let plan = compile(&dir, &["--cluster", s(&cluster), "--strategy", "ps"]);
    let embedded = train(&plan, &feeds, &dir.join("embedded"), &[], None);
    let remote = train(&plan, &feeds, &dir.join("remote"), &["--cluster", s(&cluster), "--lockstep"], Some(TOKEN));
    assert_same_parameters("async ps in lockstep on 2 workers and a ps", &embedded, &remote);
}

#[test]
fn a_wrong_or_missing_token_is_refused() {
    let dir = scratch("token");
    let feeds = regression_data(&dir, 64);
    let worker = Worker::start(TOKEN);
    let cluster = cluster_file(&dir, &[("worker", &[&worker])]);
    let plan = compile(&dir, &["--cluster", s(&cluster)]);
    let args = ["run", s(&plan), "--feed", &feeds[0], "--feed", &feeds[1], "--cluster", s(&cluster)];
    let wrong = dfc(&args, Some("another-token-0123456789"));
    assert!(!wrong.status.success());
    assert!(text(&wrong.stderr).contains("refused the token"), "{}", text(&wrong.stderr));
    let missing = dfc(&args, None);
    assert!(!missing.status.success());
    assert!(text(&missing.stderr).contains("no token"), "{}", text(&missing.stderr));
    // A worker does not start without a token either.
    let no_token = dfc(&["worker", "--listen", "127.0.0.1:0"], None);
    assert!(!no_token.status.success());
    assert!(text(&no_token.stderr).contains("no token"), "{}", text(&no_token.stderr));
    // With the right one, the same run trains.
    let right = dfc(&args, Some(TOKEN));
    assert!(right.status.success(), "{}", text(&right.stderr));
}

/// Reads a child's stderr as it comes, on a thread (a full pipe would stop the child), and
/// returns all of it once the child has closed it.
fn drain_stderr(child: &mut Child) -> std::thread::JoinHandle<String> {
    let mut stderr = child.stderr.take().expect("piped stderr");
    std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut text);
        text
    })
}

/// `drain_stderr`, and each line sent as it comes.
fn stderr_lines(child: &mut Child) -> (std::sync::mpsc::Receiver<String>, std::thread::JoinHandle<String>) {
    let stderr = child.stderr.take().expect("piped stderr");
    let (sender, lines) = std::sync::mpsc::channel();
    let whole = std::thread::spawn(move || {
        let mut text = String::new();
        for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            text.push_str(&line);
            text.push('\n');
            let _ = sender.send(line);
        }
        text
    });
    (lines, whole)
}

/// Waits (up to 120 s) for the first line of `lines` that starts with `prefix`.
fn wait_for_line(lines: &std::sync::mpsc::Receiver<String>, prefix: &str) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while let Ok(line) = lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        if line.starts_with(prefix) {
            return;
        }
    }
    panic!("no line starting with {prefix:?} within 120 s");
}

/// Stops `worker`'s process (SIGSTOP) for `how_long`, then lets it go on.
fn pause(worker: &Worker, how_long: Duration) {
    let pid = worker.child.id().to_string();
    assert!(Command::new("kill").args(["-STOP", &pid]).status().expect("kill").success());
    std::thread::sleep(how_long);
    assert!(Command::new("kill").args(["-CONT", &pid]).status().expect("kill").success());
}

/// Trains on two workers, does `fault` to the second after two seconds, and returns the run's
/// stderr once it has failed, which it must within 30 s.
fn a_fault_on_the_second_worker(name: &str, wait: &str, fault: impl FnOnce(&mut Vec<Worker>)) -> String {
    a_timed_fault_on_the_second_worker(name, wait, 0, fault).0
}

/// The same, with how long after the fault the run ended; the second worker waits
/// `second_delay_ms` before each of its runs (`dfc worker --delay-ms`).
fn a_timed_fault_on_the_second_worker(
    name: &str,
    wait: &str,
    second_delay_ms: u64,
    fault: impl FnOnce(&mut Vec<Worker>),
) -> (String, Duration) {
    let dir = scratch(name);
    let feeds = regression_data(&dir, 256);
    let mut second = Command::new(env!("CARGO_BIN_EXE_dfc"));
    second.args(["worker", "--listen", "127.0.0.1:0", "--delay-ms", &second_delay_ms.to_string()]);
    let mut workers: Vec<Worker> = vec![Worker::start(TOKEN), Worker::launch(second, TOKEN, "127.0.0.1")];
    let cluster = cluster_file(&dir, &[("worker", &[&workers[0], &workers[1]])]);
    let plan = compile(&dir, &["--cluster", s(&cluster), "--strategy", "mirrored"]);
    let mut run = Command::new(env!("CARGO_BIN_EXE_dfc"))
        .args(["run", s(&plan), "--feed", &feeds[0], "--feed", &feeds[1], "--epochs", "100000"])
        .args(["--cluster", s(&cluster), "--wait", wait])
        .env("DFC_TOKEN", TOKEN)
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the run");
    let stderr = drain_stderr(&mut run);
    std::thread::sleep(Duration::from_secs(2));
    fault(&mut workers);
    let faulted = Instant::now();
    let status = loop {
        if let Some(status) = run.try_wait().expect("wait") {
            break status;
        }
        assert!(faulted.elapsed() < Duration::from_secs(30), "{name}: the run did not end within 30 s of the fault");
        std::thread::sleep(Duration::from_millis(100));
    };
    let ended = faulted.elapsed();
    let stderr = stderr.join().unwrap();
    assert!(!status.success(), "{stderr}");
    (stderr, ended)
}

#[test]
fn a_killed_worker_is_reported_by_name_and_the_run_fails() {
    let stderr = a_fault_on_the_second_worker("killed", "5", |workers| drop(workers.pop()));
    assert!(stderr.contains("/job:worker/task:1"), "the error names the dead worker's task: {stderr}");
}

/// Open MPI's own `mpirun` starts the job: one `dfc run` per rank, rank 0 drives.
#[test]
fn mpirun_launches_a_job_with_one_command() {
    let Ok(version) = Command::new("mpirun").arg("--version").output() else {
        skip::skip(skip::Need::Mpirun, "mpirun is not installed (apt-get install openmpi-bin; .ci/run does)");
        return;
    };
    assert!(version.status.success(), "{}", text(&version.stderr));
    let mut mpirun = Command::new("mpirun");
    mpirun
        .args(["-n", "2", "--oversubscribe", "-x", "DFC_TOKEN"])
        // CI runs as root, which mpirun refuses unless told.
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    a_launcher_starts_a_job("mpirun", mpirun, "(OMPI_COMM_WORLD_RANK=1)");
}

/// `mpirun` with MPI's all-reduce (`--all-reduce mpi`, a dfc built with the `mpi` feature): on
/// 2 and 4 ranks, training ends as the run in one process does.
#[test]
fn training_through_mpis_all_reduce_ends_like_one_process() {
    let Some(mpirun) = mpirun_with_mpi_build() else { return };
    for n in [2usize, 4] {
        let dir = scratch(&format!("mpi-{n}"));
        let feeds = regression_data(&dir, 256);
        let addresses = free_addresses(n);
        let quoted: Vec<String> = addresses.iter().map(|a| format!("\"{a}\"")).collect();
        let cluster = dir.join("cluster.json");
        std::fs::write(&cluster, format!("{{\"cluster\": {{\"worker\": [{}]}}}}", quoted.join(", "))).unwrap();
        let plan = compile(&dir, &["--cluster", s(&cluster), "--strategy", "mirrored"]);
        let embedded = train(&plan, &feeds, &dir.join("embedded"), &[], None);
        let checkpoints = dir.join("mpi");
        let output = mpirun(n)
            .args([env!("CARGO_BIN_EXE_dfc"), "run", s(&plan), "--cluster", s(&cluster), "--all-reduce", "mpi"])
            .args(["--feed", &feeds[0], "--feed", &feeds[1], "--epochs", "2", "--seed", "3"])
            .args(["--checkpoint-dir", s(&checkpoints)])
            .env("DFC_TOKEN", TOKEN)
            .output()
            .expect("run mpirun");
        let stderr = text(&output.stderr);
        assert!(output.status.success(), "{n} ranks: {stderr}{}", text(&output.stdout));
        assert!(stderr.contains(&format!("all-reduces: through MPI ({n} worker(s)")), "{stderr}");
        let launched = dfc_driver::checkpoint::latest(&checkpoints).unwrap().expect("the driver checkpoints");
        assert_same_parameters(&format!("MPI's all-reduce on {n} ranks"), &embedded, &launched);
    }
}

/// For a job of two ranks in scratch dir `name`: the regression data's feeds, a cluster file of
/// two workers on free loopback ports, and the model's plan mirrored on them.
fn two_rank_job(name: &str) -> ([String; 2], PathBuf, PathBuf) {
    let dir = scratch(name);
    let feeds = regression_data(&dir, 256);
    let addresses = free_addresses(2);
    let cluster = dir.join("cluster.json");
    std::fs::write(&cluster, format!("{{\"cluster\": {{\"worker\": [\"{}\", \"{}\"]}}}}", addresses[0], addresses[1]))
        .unwrap();
    let plan = compile(&dir, &["--cluster", s(&cluster), "--strategy", "mirrored"]);
    (feeds, cluster, plan)
}

/// A rank stopped in the middle of training through MPI's all-reduce: the driver names it
/// within seconds and ends the whole job (MPI_Abort), where the other ranks would otherwise
/// wait in MPI's all-reduce, or its finalisation, for ever.
#[test]
fn a_stopped_rank_under_mpi_is_named_and_the_job_ends() {
    let Some(mpirun) = mpirun_with_mpi_build() else { return };
    let (feeds, cluster, plan) = two_rank_job("mpi-stopped");
    let mut run = mpirun(2)
        .args([env!("CARGO_BIN_EXE_dfc"), "run", s(&plan), "--cluster", s(&cluster), "--all-reduce", "mpi"])
        .args(["--feed", &feeds[0], "--feed", &feeds[1], "--epochs", "100000", "--wait", "3"])
        .env("DFC_TOKEN", TOKEN)
        .stderr(Stdio::piped())
        .spawn()
        .expect("start mpirun");
    let (lines, stderr) = stderr_lines(&mut run);
    // The driver names each worker once it has registered the plan there: the stop then lands
    // in training (on a loaded machine a stop at a fixed time could land before rank 1 listens,
    // where the driver's 30 s of patience with a worker yet to listen would outlast the test).
    wait_for_line(&lines, "worker /job:worker/task:1 at");
    // Rank 1: the dfc process of this plan that mpirun gave rank 1.
    let rank_one = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .find(|pid| {
            let read = |what: &str| std::fs::read(format!("/proc/{pid}/{what}")).unwrap_or_default();
            let (command, environment) = (read("cmdline"), read("environ"));
            let has = |bytes: &[u8], part: &str| bytes.split(|&b| b == 0).any(|p| p == part.as_bytes());
            has(&command, env!("CARGO_BIN_EXE_dfc"))
                && has(&command, s(&plan))
                && has(&environment, "OMPI_COMM_WORLD_RANK=1")
        })
        .expect("rank 1's process");
    let stop = Command::new("kill").args(["-STOP", &rank_one.to_string()]).status();
    assert!(stop.expect("kill").success());
    let stopped = Instant::now();
    let status = loop {
        if let Some(status) = run.try_wait().expect("wait") {
            break status;
        }
        if stopped.elapsed() > Duration::from_secs(30) {
            let _ = Command::new("kill").args(["-CONT", &rank_one.to_string()]).status();
            let _ = run.kill();
            panic!("the job did not end within 30 s of the stop: {}", stderr.join().unwrap());
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let stderr = stderr.join().unwrap();
    assert!(!status.success(), "{stderr}");
    assert!(stderr.contains("worker /job:worker/task:1") && stderr.contains("stopped answering"), "{stderr}");
}

/// A rank that starts late (MPMD: rank 1 sleeps first): rank 0's MPI initialisation, which
/// waits for every rank, says after --wait what it waits for; the job then goes on once rank 1
/// is there and ends well.
#[test]
fn a_late_rank_under_mpi_is_waited_for_with_a_word() {
    let Some(mpirun) = mpirun_with_mpi_build() else { return };
    let (feeds, cluster, plan) = two_rank_job("mpi-late");
    let run = [env!("CARGO_BIN_EXE_dfc"), "run", s(&plan), "--cluster", s(&cluster), "--all-reduce", "mpi"];
    let options = ["--feed", &feeds[0], "--feed", &feeds[1], "--epochs", "1", "--wait", "3"];
    let output = mpirun(1)
        .args(run)
        .args(options)
        .args([":", "-n", "1", "sh", "-c", "sleep 8; exec \"$0\" \"$@\""])
        .args(run)
        .args(options)
        .env("DFC_TOKEN", TOKEN)
        .output()
        .expect("run mpirun");
    let stderr = text(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(
        stderr.contains("warning: rank 0: MPI's initialisation has waited 3.0 s for the job's other ranks"),
        "{stderr}"
    );
    assert!(!stderr.contains("warning: rank 1"), "rank 1 came last and waited for no one: {stderr}");
    assert!(stderr.contains("trained "), "{stderr}");
}

/// `dfc bench-allreduce --mpi` under mpirun reports MPI's bus bandwidth next to dfc's ring's,
/// from one run (each all-reduce's every element checked by every rank).
#[test]
fn bench_allreduce_under_mpirun_reports_mpi_next_to_the_ring() {
    let Some(mpirun) = mpirun_with_mpi_build() else { return };
    let output = mpirun(2)
        .args([env!("CARGO_BIN_EXE_dfc"), "bench-allreduce", "--mpi", "--sizes-mib", "1"])
        .args(["--iterations", "2", "--transport", "shared-memory", "--json"])
        .output()
        .expect("run mpirun");
    assert!(output.status.success(), "{}", text(&output.stderr));
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).expect("one JSON report, from rank 0");
    assert!(report["library"].as_str().unwrap().contains("Open MPI"), "{report}");
    for kind in ["ring", "mpi"] {
        let rows = report[kind].as_array().unwrap();
        assert_eq!(rows.len(), 1, "{report}");
        assert_eq!(rows[0]["workers"], 2, "{report}");
        assert!(rows[0]["bus_bytes_per_second"].as_f64().unwrap() > 0.0, "{report}");
    }
}

/// `mpirun -n N` (as root, oversubscribed, passing DFC_TOKEN on), if mpirun is here and this
/// dfc was built with the `mpi` feature; else the test's skip is recorded.
fn mpirun_with_mpi_build() -> Option<impl Fn(usize) -> Command> {
    if Command::new("mpirun").arg("--version").output().is_err() {
        skip::skip(skip::Need::Mpirun, "mpirun is not installed (apt-get install openmpi-bin; .ci/run does)");
        return None;
    }
    if !dfc_rpc::mpi::BUILT {
        skip::skip(
            skip::Need::MpiBuild,
            "dfc was built without the mpi feature (cargo test --features mpi --test workers; .ci/run runs it so)",
        );
        return None;
    }
    Some(|n: usize| {
        let mut mpirun = Command::new("mpirun");
        mpirun
            .args(["-n", &n.to_string(), "--oversubscribe", "-x", "DFC_TOKEN"])
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
        mpirun
    })
}

/// Slurm's own `srun` launches the job, on a single-node Slurm (`.ci/slurm-single-node.sh`,
/// which `.ci/run` runs): one `dfc run` per task, task 0 drives.
#[test]
fn srun_launches_a_job_with_one_command() {
    let Ok(state) = Command::new("sinfo").args(["--noheader", "--format", "%t"]).output() else {
        skip::skip(
            skip::Need::Slurm,
            "Slurm is not installed (bash .ci/slurm-single-node.sh sets one up; .ci/run does)",
        );
        return;
    };
    let state = text(&state.stdout);
    if !["idle", "mix", "alloc"].iter().any(|s| state.contains(s)) {
        skip::skip(
            skip::Need::Slurm,
            &format!("no Slurm node is up (sinfo says {state:?}); bash .ci/slurm-single-node.sh starts one"),
        );
        return;
    }
    let mut srun = Command::new("srun");
    // srun passes this process's environment (DFC_TOKEN with it) to every task.
    srun.args(["--ntasks", "2", "--immediate=60", "--kill-on-bad-exit=1"]);
    a_launcher_starts_a_job("srun", srun, "(SLURM_PROCID=1)");
}

/// `launcher` (its arguments before the command) starts two `dfc run` processes of a mirrored
/// plan: the one of rank 0 drives and ends with the parameters of a run in one process, the
/// other serves (and says which variable gave its rank: `rank_one`).
fn a_launcher_starts_a_job(name: &str, mut launcher: Command, rank_one: &str) {
    let dir = scratch(name);
    let feeds = regression_data(&dir, 256);
    let addresses = free_addresses(2);
    let cluster = dir.join("cluster.json");
    std::fs::write(&cluster, format!("{{\"cluster\": {{\"worker\": [\"{}\", \"{}\"]}}}}", addresses[0], addresses[1]))
        .unwrap();
    let plan = compile(&dir, &["--cluster", s(&cluster), "--strategy", "mirrored"]);
    let embedded = train(&plan, &feeds, &dir.join("embedded"), &[], None);
    let checkpoints = dir.join("launched");
    let output = launcher
        .args([env!("CARGO_BIN_EXE_dfc"), "run", s(&plan)])
        .args(["--cluster", s(&cluster), "--feed", &feeds[0], "--feed", &feeds[1], "--epochs", "2", "--seed", "3"])
        .args(["--checkpoint-dir", s(&checkpoints)])
        .env("DFC_TOKEN", TOKEN)
        .output()
        .unwrap_or_else(|e| panic!("run {name}: {e}"));
    let stderr = text(&output.stderr);
    assert!(output.status.success(), "{stderr}{}", text(&output.stdout));
    assert!(stderr.contains(rank_one), "rank 1 serves: {stderr}");
    let launched = dfc_driver::checkpoint::latest(&checkpoints).unwrap().expect("the driver checkpoints");
    assert_same_parameters(name, &embedded, &launched);
}

#[test]
fn a_stopped_worker_is_reported_by_name_and_the_run_fails() {
    // Stopped as a hung process would be: its connections stay open, but it answers nothing.
    let stderr = a_fault_on_the_second_worker("stopped", "3", |workers| {
        let stop = Command::new("kill").args(["-STOP", &workers[1].child.id().to_string()]).status();
        assert!(stop.expect("kill").success());
    });
    assert!(
        stderr.contains("worker /job:worker/task:1") && stderr.contains("stopped answering"),
        "the error names the stopped worker's task: {stderr}"
    );
}

/// The stall inspector: a worker stopped in the middle of training, the steps' own wait left
/// at 30 s: within 10 s the driver names it, and what the other worker waits for from it (the
/// all-reduce of the gradients, or a tensor of the step).
#[test]
fn a_stopped_worker_is_named_with_what_the_others_wait_for() {
    // The second worker starts each step a second late, so that the first is nearly always
    // waiting for it in the step's all-reduce when it stops (stopped between two steps, it
    // would leave no one waiting).
    let (stderr, ended) = a_timed_fault_on_the_second_worker("stalled", "30", 1000, |workers| {
        let stop = Command::new("kill").args(["-STOP", &workers[1].child.id().to_string()]).status();
        assert!(stop.expect("kill").success());
    });
    assert!(ended < Duration::from_secs(10), "named after {ended:?}: {stderr}");
    assert!(stderr.contains("worker /job:worker/task:1") && stderr.contains("stopped answering"), "{stderr}");
    assert!(
        stderr.contains("meanwhile worker /job:worker/task:0 has waited")
            && stderr.contains("from worker /job:worker/task:1"),
        "the waiting worker, what it waits for and from whom: {stderr}"
    );
}

/// The stall inspector on a slow worker that answers (`dfc worker --delay-ms 6000`): the step
/// waits past a heartbeat, the driver prints what the other worker waits for and from whom,
/// and the run goes on to its end.
#[test]
fn a_slow_step_is_reported_with_what_it_waits_for() {
    let dir = scratch("slow");
    let feeds = regression_data(&dir, 256);
    let mut slow = Command::new(env!("CARGO_BIN_EXE_dfc"));
    slow.args(["worker", "--listen", "127.0.0.1:0", "--delay-ms", "6000"]);
    let workers = [Worker::start(TOKEN), Worker::launch(slow, TOKEN, "127.0.0.1")];
    let cluster = cluster_file(&dir, &[("worker", &[&workers[0], &workers[1]])]);
    let plan = compile(&dir, &["--cluster", s(&cluster), "--strategy", "mirrored"]);
    let output = Command::new(env!("CARGO_BIN_EXE_dfc"))
        .args(["run", s(&plan), "--feed", &feeds[0], "--feed", &feeds[1], "--steps", "1"])
        .args(["--cluster", s(&cluster)])
        .env("DFC_TOKEN", TOKEN)
        .output()
        .expect("run");
    let stderr = text(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    let warning = stderr.lines().find(|l| l.starts_with("warning: step 0 (linear_regression) is still under way"));
    let warning = warning.unwrap_or_else(|| panic!("no stall report: {stderr}"));
    assert!(
        warning.contains("worker /job:worker/task:0 has waited") && warning.contains("from worker /job:worker/task:1"),
        "{warning}"
    );
}

/// Two network namespaces joined by a virtual Ethernet link: two hosts, as far as the workers
/// can tell, each with its own address and no loopback between them. Removed when dropped.
struct TwoHosts {
    namespaces: [String; 2],
    addresses: [String; 2],
    /// The veth ends, one in each namespace.
    links: [String; 2],
    /// What the second host's processes see as `/dev/shm`.
    second_shm: PathBuf,
}

impl TwoHosts {
    /// `None` where this process may not make namespaces (it is not root).
    fn new() -> Option<TwoHosts> {
        // Tests of one process make hosts at once: each pair gets names and a subnet of its own.
        static PAIRS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let pair = PAIRS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let id = std::process::id() % 10_000 * 10 + pair % 10;
        let namespaces = [format!("dfc-a-{id}"), format!("dfc-b-{id}")];
        let subnet = format!("10.{}.{}", 231 + pair % 10, id % 250);
        let addresses = [format!("{subnet}.1"), format!("{subnet}.2")];
        let ip = |args: &[&str]| Command::new("ip").args(args).output().is_ok_and(|o| o.status.success());
        if !ip(&["netns", "add", &namespaces[0]]) {
            return None;
        }
        let links = [format!("dfa{}", id % 100_000), format!("dfb{}", id % 100_000)];
        let second_shm = std::env::temp_dir().join(format!("dfc-second-host-shm-{id}"));
        std::fs::create_dir_all(&second_shm).expect("a directory for the second host's /dev/shm");
        let hosts = TwoHosts { namespaces, addresses, links, second_shm };
        let [a, b] = &hosts.namespaces;
        let [link_a, link_b] = &hosts.links;
        let (net_a, net_b) = (format!("{}/24", hosts.addresses[0]), format!("{}/24", hosts.addresses[1]));
        let steps: [Vec<&str>; 8] = [
            vec!["netns", "add", b],
            vec!["link", "add", link_a, "netns", a, "type", "veth", "peer", "name", link_b, "netns", b],
            vec!["-n", a, "addr", "add", &net_a, "dev", link_a],
            vec!["-n", b, "addr", "add", &net_b, "dev", link_b],
            vec!["-n", a, "link", "set", link_a, "up"],
            vec!["-n", b, "link", "set", link_b, "up"],
            vec!["-n", a, "link", "set", "lo", "up"],
            vec!["-n", b, "link", "set", "lo", "up"],
        ];
        for step in &steps {
            let output = Command::new("ip").args(step).output().expect("run ip");
            assert!(output.status.success(), "ip {}: {}", step.join(" "), text(&output.stderr));
        }
        Some(hosts)
    }

    /// `dfc ARGS` in host `i`'s namespace. The second host has a `/dev/shm` of its own (one
    /// directory, bound there for each of its processes), as another machine has, so its
    /// workers share memory with each other but not with the first's: the data plane's offers
    /// of shared-memory queues between the hosts are declined both ways and frames cross the
    /// link.
    fn dfc(&self, i: usize) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", &self.namespaces[i]]);
        if i == 1 {
            // `ip netns exec` runs the command in a mount namespace of its own.
            command.args(["sh", "-c", r#"mount --bind "$DFC_SECOND_SHM" /dev/shm && exec "$0" "$@""#]);
            command.env("DFC_SECOND_SHM", &self.second_shm);
        }
        command.arg(env!("CARGO_BIN_EXE_dfc"));
        command
    }

    /// `dfc certs` for the two hosts' addresses into `pki`.
    fn certs(&self, pki: &Path) {
        certs(pki, &[&self.addresses[0], &self.addresses[1]]);
    }

    /// Host `i`'s `--tls-dir` among the files `certs` made in `pki`.
    fn tls_dir(&self, pki: &Path, i: usize) -> String {
        pki.join(&self.addresses[i]).display().to_string()
    }

    /// A worker on host `i` at `port`, its data port the next, in TLS.
    fn worker(&self, i: usize, port: u16, pki: &Path) -> Worker {
        let mut command = self.dfc(i);
        let listen = format!("{}:{port}", self.addresses[i]);
        command.args(["worker", "--listen", &listen, "--data-port", &(port + 1).to_string()]);
        command.args(["--tls-dir", &self.tls_dir(pki, i)]);
        Worker::launch(command, TOKEN, &self.addresses[i])
    }

    /// Trains `plan` for 2 epochs on the workers of `cluster`, driven from the first host (the
    /// second is reachable only over the link), checkpointing to `checkpoints`.
    fn train(&self, plan: &Path, cluster: &Path, feeds: &[String; 2], checkpoints: &Path, pki: &Path) -> Output {
        self.dfc(0)
            .args(["run", s(plan), "--cluster", s(cluster), "--feed", &feeds[0], "--feed", &feeds[1]])
            .args(["--epochs", "2", "--seed", "3", "--checkpoint-dir", s(checkpoints)])
            .args(["--tls-dir", &self.tls_dir(pki, 0)])
            .env("DFC_TOKEN", TOKEN)
            .output()
            .expect("run dfc")
    }

    /// Bytes host `i` has sent over the link between the hosts so far (its veth end's count).
    fn bytes_sent(&self, i: usize) -> u64 {
        let counter = format!("/sys/class/net/{}/statistics/tx_bytes", self.links[i]);
        let output = Command::new("ip").args(["netns", "exec", &self.namespaces[i], "cat", &counter]).output();
        let output = output.expect("run ip");
        assert!(output.status.success(), "{counter}: {}", text(&output.stderr));
        text(&output.stdout).trim().parse().expect("a count of bytes")
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        for namespace in &self.namespaces {
            let _ = Command::new("ip").args(["netns", "del", namespace]).output();
        }
        let _ = std::fs::remove_dir_all(&self.second_shm);
    }
}

/// Workers on two hosts (network namespaces), each listening on its own address, with the
/// data plane between them on the hosts' network, all of it in TLS with the files `dfc certs`
/// made: training ends as in one process. Without TLS, a worker will not listen there.
#[test]
fn workers_on_two_hosts_train_like_one_process() {
    let Some(hosts) = TwoHosts::new() else {
        skip::skip(skip::Need::Netns, "cannot make network namespaces here (the test needs root, as CI has)");
        return;
    };
    let dir = scratch("two-hosts");
    let feeds = regression_data(&dir, 256);
    let pki = dir.join("pki");
    hosts.certs(&pki);
    let plain = hosts
        .dfc(0)
        .args(["worker", "--listen", &format!("{}:7000", hosts.addresses[0])])
        .env("DFC_TOKEN", TOKEN)
        .output()
        .unwrap();
    assert!(!plain.status.success() && text(&plain.stderr).contains("dfc certs"), "{}", text(&plain.stderr));
    let workers: Vec<Worker> = (0..2).map(|i| hosts.worker(i, 7000, &pki)).collect();
    let cluster = cluster_file(&dir, &[("worker", &[&workers[0], &workers[1]])]);
    let plan = compile(&dir, &["--cluster", s(&cluster), "--strategy", "mirrored"]);
    let embedded = train(&plan, &feeds, &dir.join("embedded"), &[], None);
    let checkpoints = dir.join("two-hosts");
    let output = hosts.train(&plan, &cluster, &feeds, &checkpoints, &pki);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let distributed = dfc_driver::checkpoint::latest(&checkpoints).unwrap().expect("a checkpoint");
    assert_same_parameters("workers on two hosts", &embedded, &distributed);
}

/// Two hosts (network namespaces) with two workers each, in TLS: `--all-reduce auto` picks the
/// hierarchical all-reduce, which trains as one process does; and `dfc bench-allreduce` over
/// the four workers sends fewer bytes over the link between the hosts with it than with the
/// flat ring, as counted by the link itself: each host sends the tensor once to the other,
/// where the flat ring's links between the hosts carry 2(n − 1)/n = 1.5 times it (2/3).
#[test]
fn the_hierarchical_all_reduce_across_two_hosts_trains_alike_with_fewer_bytes_on_the_link() {
    let Some(hosts) = TwoHosts::new() else {
        skip::skip(skip::Need::Netns, "cannot make network namespaces here (the test needs root, as CI has)");
        return;
    };
    let dir = scratch("hierarchical");
    let feeds = regression_data(&dir, 256);
    let pki = dir.join("pki");
    hosts.certs(&pki);
    let workers: Vec<Worker> = (0..4).map(|w| hosts.worker(w / 2, 7000 + 2 * (w % 2) as u16, &pki)).collect();
    let cluster = cluster_file(&dir, &[("worker", &workers.iter().collect::<Vec<_>>())]);
    let plan = compile(&dir, &["--cluster", s(&cluster), "--strategy", "mirrored"]);
    let embedded = train(&plan, &feeds, &dir.join("embedded"), &[], None);
    let checkpoints = dir.join("two-hosts");
    let output = hosts.train(&plan, &cluster, &feeds, &checkpoints, &pki);
    let stderr = text(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(stderr.contains("all-reduces: hierarchical (4 worker(s) on 2 host(s)"), "{stderr}");
    let distributed = dfc_driver::checkpoint::latest(&checkpoints).unwrap().expect("a checkpoint");
    assert_same_parameters("hierarchical on two hosts", &embedded, &distributed);

    let addresses: Vec<&str> = workers.iter().map(|w| w.address.as_str()).collect();
    let at = addresses.join(",");
    let bench = |algorithm: &str| -> (u64, serde_json::Value) {
        let before = hosts.bytes_sent(0) + hosts.bytes_sent(1);
        let output = hosts
            .dfc(0)
            .args(["bench-allreduce", "--at", &at, "--tls-dir", &hosts.tls_dir(&pki, 0), "--algorithm", algorithm])
            .args(["--sizes-mib", "8", "--iterations", "2", "--transport", "shared-memory", "--json"])
            .env("DFC_TOKEN", TOKEN)
            .output()
            .expect("run dfc bench-allreduce");
        assert!(output.status.success(), "{algorithm}: {}", text(&output.stderr));
        let on_the_link = hosts.bytes_sent(0) + hosts.bytes_sent(1) - before;
        let report: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON");
        (on_the_link, report["results"][0].clone())
    };
    let (flat, flat_report) = bench("ring");
    let (hierarchical, hierarchical_report) = bench("hierarchical");
    assert_eq!(hierarchical_report["algorithm"], "hierarchical", "{hierarchical_report}");
    assert_eq!(hierarchical_report["hosts"], 2, "{hierarchical_report}");
    // Three all-reduces of 8 MiB each (one untimed): 3 × 8 × 1.5 × 2 = 72 MiB for the ring's,
    // 48 MiB for the hierarchical ones, with the framing, TLS and TCP on top of both.
    let ratio = hierarchical as f64 / flat as f64;
    eprintln!("on the link: flat ring {flat} bytes, hierarchical {hierarchical} bytes ({ratio:.3})");
    assert!(flat as f64 > 72.0 * (1 << 20) as f64, "the ring's bytes crossed the link: {flat}");
    assert!((0.6..0.72).contains(&ratio), "hierarchical/flat bytes on the link: {ratio}");
    let reported = |r: &serde_json::Value| r["bytes_between_hosts"].as_f64().unwrap();
    let reported_ratio = reported(&hierarchical_report) / reported(&flat_report);
    assert!((reported_ratio - 2.0 / 3.0).abs() < 0.01, "{flat_report} {hierarchical_report}");
}

/// `--all-reduce`: `auto` keeps one ring for workers on one host (and says so); the
/// hierarchical all-reduce asked for there is refused in one line, and so is the option in a
/// run without workers.
#[test]
fn the_all_reduce_algorithm_is_chosen_by_hosts_and_refused_where_it_cannot_apply() {
    let dir = scratch("all-reduce-choice");
    let feeds = regression_data(&dir, 256);
    let plan = compile(&dir, &["--devices", "2", "--strategy", "mirrored"]);
    let run = |extra: &[&str]| {
        let mut args = vec!["run", s(&plan), "--feed", &feeds[0], "--feed", &feeds[1], "--epochs", "1"];
        args.extend_from_slice(extra);
        dfc(&args, None)
    };
    let auto = run(&["--spawn", "2"]);
    assert!(auto.status.success(), "{}", text(&auto.stderr));
    assert!(text(&auto.stderr).contains("all-reduces: one ring (2 worker(s) on 1 host(s))"), "{}", text(&auto.stderr));
    let hierarchical = run(&["--spawn", "2", "--all-reduce", "hierarchical"]);
    let stderr = text(&hierarchical.stderr);
    assert!(!hierarchical.status.success(), "{stderr}");
    assert!(stderr.contains("--all-reduce hierarchical needs workers on several hosts"), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    let without_launcher = run(&["--spawn", "2", "--all-reduce", "mpi"]);
    let stderr = text(&without_launcher.stderr);
    assert!(!without_launcher.status.success() && stderr.contains("needs a job launched by mpirun"), "{stderr}");
    let in_process = run(&["--all-reduce", "ring"]);
    let stderr = text(&in_process.stderr);
    assert!(
        !in_process.status.success() && stderr.contains("give it with --cluster, TF_CONFIG or --spawn"),
        "{stderr}"
    );
}

/// Two free loopback addresses (bound and released: another process could take one meanwhile,
/// which a test run on this machine does not).
fn free_addresses(n: usize) -> Vec<String> {
    let listeners: Vec<std::net::TcpListener> =
        (0..n).map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("a free port")).collect();
    listeners.iter().map(|l| l.local_addr().unwrap().to_string()).collect()
}

/// As under mpirun or srun, or with TF_CONFIG: every process runs the same `dfc run`, and the
/// rank (or TF_CONFIG's task) decides which drives and which serve.
#[test]
fn launcher_ranks_and_tf_config_start_a_job_with_one_command() {
    let dir = scratch("launcher");
    let feeds = regression_data(&dir, 256);
    let addresses = free_addresses(2);
    let cluster_json = format!("{{\"cluster\": {{\"worker\": [\"{}\", \"{}\"]}}}}", addresses[0], addresses[1]);
    let cluster = dir.join("cluster.json");
    std::fs::write(&cluster, &cluster_json).unwrap();
    let plan = compile(&dir, &["--cluster", s(&cluster), "--strategy", "mirrored"]);
    let embedded = train(&plan, &feeds, &dir.join("embedded"), &[], None);
    let checkpoints = dir.join("launched");
    let command = |configure: &dyn Fn(&mut Command)| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_dfc"));
        command.args(["run", s(&plan), "--feed", &feeds[0], "--feed", &feeds[1], "--epochs", "2", "--seed", "3"]);
        command.args(["--checkpoint-dir", s(&checkpoints)]).env("DFC_TOKEN", TOKEN).stderr(Stdio::piped());
        for variable in ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID", "TF_CONFIG"] {
            command.env_remove(variable);
        }
        configure(&mut command);
        command.spawn().expect("start a rank")
    };
    // mpirun's variables: both ranks get --cluster.
    let rank1 = command(&|c| {
        c.args(["--cluster", s(&cluster)]).env("OMPI_COMM_WORLD_RANK", "1");
    });
    let rank0 = command(&|c| {
        c.args(["--cluster", s(&cluster)]).env("OMPI_COMM_WORLD_RANK", "0");
    });
    // A process that trained alone would end with the same parameters: its words tell which
    // process served task 1 (and why) and which drove.
    let roles = |processes: [(&str, std::process::Child, bool); 2], why: &str| {
        for (name, child, serves) in processes {
            let output = child.wait_with_output().unwrap();
            let stderr = text(&output.stderr);
            assert!(output.status.success(), "{name}: {stderr}");
            let serving = format!("serving /job:worker/task:1 at {} ({why}", addresses[1]);
            assert_eq!(stderr.contains(&serving), serves, "{name}: {stderr}");
            assert_eq!(stderr.contains("worker /job:worker/task:1 at"), !serves, "{name}: {stderr}");
        }
    };
    roles([("rank 0", rank0, false), ("rank 1", rank1, true)], "OMPI_COMM_WORLD_RANK=1)");
    let launched = dfc_driver::checkpoint::latest(&checkpoints).unwrap().expect("the driver checkpoints");
    assert_same_parameters("mpirun-style ranks", &embedded, &launched);

    // TF_CONFIG: the cluster and each process's task from the environment, no --cluster.
    let _ = std::fs::remove_dir_all(&checkpoints);
    std::fs::create_dir_all(&checkpoints).unwrap();
    let with_task = |index: usize| {
        format!(
            "{{\"cluster\": {{\"worker\": [\"{}\", \"{}\"]}}, \"task\": {{\"type\": \"worker\", \"index\": {index}}}}}",
            addresses[0], addresses[1]
        )
    };
    let task1 = command(&|c| {
        c.env("TF_CONFIG", with_task(1));
    });
    let task0 = command(&|c| {
        c.env("TF_CONFIG", with_task(0));
    });
    roles([("task 0", task0, false), ("task 1", task1, true)], "TF_CONFIG task");
    let launched = dfc_driver::checkpoint::latest(&checkpoints).unwrap().expect("the driver checkpoints");
    assert_same_parameters("TF_CONFIG tasks", &embedded, &launched);
}

/// A run on workers killed part-way and started again resumes from its newest checkpoint and
/// ends exactly where a run that was never stopped ends (the ring sums in a fixed order).
#[test]
fn a_killed_distributed_run_resumes_and_ends_like_an_uninterrupted_one() {
    let dir = scratch("resume");
    let feeds = regression_data(&dir, 256);
    let plan = compile(&dir, &["--devices", "2", "--strategy", "mirrored"]);
    let epochs = ["--epochs", "40", "--spawn", "2"];
    let uninterrupted = train(&plan, &feeds, &dir.join("uninterrupted"), &epochs, None);
    let checkpoints = dir.join("interrupted");
    let mut run = Command::new(env!("CARGO_BIN_EXE_dfc"))
        .args(["run", s(&plan), "--feed", &feeds[0], "--feed", &feeds[1], "--seed", "3"])
        .args(epochs)
        .args(["--checkpoint-dir", s(&checkpoints)])
        .env_remove("DFC_TOKEN")
        .stderr(Stdio::null())
        .spawn()
        .expect("start the run");
    let started = Instant::now();
    loop {
        let saved = std::fs::read_dir(&checkpoints).map(|d| d.count()).unwrap_or(0);
        if saved >= 2 || started.elapsed() > Duration::from_secs(60) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    run.kill().expect("kill the driver");
    run.wait().unwrap();
    let partial = dfc_driver::checkpoint::latest(&checkpoints).unwrap().expect("a checkpoint before the kill");
    assert!(partial.step < uninterrupted.step, "killed after the end: {} of {}", partial.step, uninterrupted.step);
    let resumed = train(&plan, &feeds, &checkpoints, &epochs, None);
    assert_eq!(resumed.step, uninterrupted.step);
    assert_eq!(
        resumed.tensors, uninterrupted.tensors,
        "a resumed run ends bit for bit where the uninterrupted one does"
    );
}

/// Asynchronous parameter servers (each worker applies its own gradients, stepping on its own)
/// on 2 workers and a ps, three epochs of the MLP on Fashion-MNIST: the training loss falls
/// every epoch, and the accuracy is what the training issue reached in one process (0.84 after
/// 2 epochs; 0.849–0.851 after 3 here, the eval accuracy of free-running steps moving by about
/// ±0.01 from epoch to epoch).
#[test]
fn asynchronous_parameter_servers_converge_on_fashion_mnist() {
    let Some(data) = skip::fashion_mnist() else { return };
    let dir = scratch("ps-async-fashion");
    let cluster = dir.join("cluster.json");
    // Addresses do not matter to --spawn, which starts a worker per task.
    std::fs::write(&cluster, r#"{"cluster": {"worker": ["localhost:1", "localhost:2"], "ps": ["localhost:3"]}}"#)
        .unwrap();
    let plan = dir.join("mlp.plan");
    let source = root().join("examples/mlp.df");
    let optimizer = "momentum(lr = 0.01, momentum = 0.9)";
    let args =
        ["compile", s(&source), "--cluster", s(&cluster), "--strategy", "ps", "--optimizer", optimizer, "-o", s(&plan)];
    let output = dfc(&args, None);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let file = |name: &str| data.join(name).display().to_string();
    let log = dir.join("metrics.jsonl");
    let output = dfc(
        &[
            "run",
            s(&plan),
            "--spawn",
            "3",
            "--feed",
            &format!("images={}", file("train-images-idx3-ubyte.gz")),
            "--feed",
            &format!("labels={}", file("train-labels-idx1-ubyte.gz")),
            "--eval-feed",
            &format!("images={}", file("t10k-images-idx3-ubyte.gz")),
            "--eval-feed",
            &format!("labels={}", file("t10k-labels-idx1-ubyte.gz")),
            "--metrics",
            s(&log),
            "--epochs",
            "3",
        ],
        None,
    );
    assert!(output.status.success(), "{}", text(&output.stderr));
    let records: Vec<serde_json::Value> =
        std::fs::read_to_string(&log).unwrap().lines().map(|line| serde_json::from_str(line).unwrap()).collect();
    let losses: Vec<f64> = records.iter().map(|r| r["train_loss"].as_f64().unwrap()).collect();
    assert!(losses.windows(2).all(|w| w[1] < w[0]), "the training loss falls every epoch: {losses:?}");
    let accuracy = records[2]["eval_accuracy"].as_f64().unwrap();
    assert!(accuracy > 0.83, "three epochs of asynchronous ps reach about 0.85; got {accuracy}");
}

/// Asynchronous ps replicas step on their own: while one replica's worker is stopped for two
/// seconds, the other goes on taking batches (steps in lockstep would wait for it), and every
/// batch is still trained on once.
#[test]
fn asynchronous_replicas_do_not_wait_for_each_other() {
    let dir = scratch("free-running");
    let feeds = regression_data(&dir, 65_536);
    let workers: Vec<Worker> = (0..3).map(|_| Worker::start(TOKEN)).collect();
    let cluster = cluster_file(&dir, &[("worker", &[&workers[0], &workers[1]]), ("ps", &[&workers[2]])]);
    let plan = compile(&dir, &["--cluster", s(&cluster), "--strategy", "ps", "--dim", "batch=16"]);
    let metrics = dir.join("metrics.jsonl");
    let mut run = Command::new(env!("CARGO_BIN_EXE_dfc"))
        .args(["run", s(&plan), "--feed", &feeds[0], "--feed", &feeds[1], "--cluster", s(&cluster)])
        .args(["--epochs", "3", "--metrics", s(&metrics)])
        .env("DFC_TOKEN", TOKEN)
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the run");
    let (lines, stderr) = stderr_lines(&mut run);
    // From the end of the first epoch to the end of the run, the second worker is stopped two
    // seconds of every three: its replica's share of the last two epochs is then set by time,
    // not by how fast a loaded machine steps (one 2 s stop gave a margin of 2,600 steps here and
    // of 268 in a CI run with the other tests beside it). A stop stays under the heartbeat's
    // health check patience, after which a silent worker fails the run.
    wait_for_line(&lines, "epoch 1:");
    while run.try_wait().expect("poll the run").is_none() {
        pause(&workers[1], Duration::from_secs(2));
        std::thread::sleep(Duration::from_secs(1));
    }
    let status = run.wait().expect("wait");
    let stderr = stderr.join().unwrap();
    assert!(status.success(), "{stderr}");
    let records: Vec<serde_json::Value> =
        std::fs::read_to_string(&metrics).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    // Over the whole run, each epoch's record counting its own steps.
    let steps = |task: &str| {
        let of_epoch = |record: &serde_json::Value| {
            let workers = record["workers"].as_array().expect("per-worker metrics");
            let worker = workers.iter().find(|w| w["name"] == task).unwrap_or_else(|| panic!("no {task} in {record}"));
            worker["steps"].as_u64().unwrap()
        };
        records.iter().map(of_epoch).sum::<u64>()
    };
    let (first, second) = (steps("/job:worker/task:0"), steps("/job:worker/task:1"));
    // 65,536 examples in batches of 16, three times: 12,288 steps, each two replica steps of 8.
    assert_eq!(records.last().and_then(|r| r["step"].as_u64()), Some(12_288), "{records:?}");
    assert_eq!(first + second, 24_576, "every replica batch once: {first} + {second}");
    assert_eq!(steps("/job:ps/task:0"), 24_576, "the ps applies every replica step");
    // Stopped two thirds of the time, the second replica takes about a third of the last two
    // epochs' 16,384 batches: about 8,000 fewer than the first in all.
    assert!(first > second + 4_000, "the running replica went on while the other was stopped: {first} vs {second}");
}

/// A model whose table lives on the parameter servers, looked up by ids from the batch (an
/// embedding, as wide_and_deep's): the server gathers the rows within the replica's step.
const LOOKUP: &str = "model lookup {
    dim batch = 16
    input id: i32[batch]
    input x: f32[batch, 4]
    input y: f32[batch]
    @partitioned(2)
    param table: f32[40, 4] = uniform(-0.5, 0.5)
    param w: f32[4] = ones
    let score = sum(gather(table, id) * x * w, axis = 1)
    minimize mean((score - y) * (score - y)) with momentum(lr = exponential_decay(0.1, 4, 0.5))
}
";

/// 256 examples of ids into a table of 40 rows, 4 features and a target, as .npy files in
/// `dir`: the `--feed` arguments.
fn lookup_feeds(dir: &Path) -> Vec<String> {
    let n = 256;
    let ids: Vec<f64> = (0..n).map(|i| ((i * 7) % 40) as f64).collect();
    let x: Vec<f64> = (0..n * 4).map(|i| ((i * 13) % 17) as f64 / 17.0).collect();
    let y: Vec<f64> = (0..n).map(|i| x[i * 4..i * 4 + 4].iter().sum::<f64>() * (ids[i] % 5.0 - 2.0) / 2.0).collect();
    let mut feeds = Vec::new();
    for (name, dtype, shape, values) in [
        ("id", dfc_ir::DType::I32, vec![n], &ids),
        ("x", dfc_ir::DType::F32, vec![n, 4], &x),
        ("y", dfc_ir::DType::F32, vec![n], &y),
    ] {
        let path = dir.join(format!("{name}.npy"));
        dfc_driver::save_npy(&path, &Tensor::from_f64(dtype, shape, values)).expect("write a feed");
        feeds.extend(["--feed".to_string(), format!("{name}={}", s(&path))]);
    }
    feeds
}

/// Asynchronous replicas that cannot step on their own, as a variable lives on one replica's
/// worker and the other replica updates it too, step together, and the run says why (once);
/// with backup workers, which must step on their own, the run is refused with that reason.
#[test]
fn replicas_that_must_step_together_say_why() {
    let dir = scratch("ps-together");
    let model = dir.join("together.df");
    std::fs::write(
        &model,
        "model together {
    dim batch = 16
    input id: i32[batch]
    input x: f32[batch, 4]
    input y: f32[batch]
    param table: f32[40, 4] = uniform(-0.5, 0.5)
    @device(\"/job:worker/task:0\") param w: f32[4] = ones
    let score = sum(gather(table, id) * x * w, axis = 1)
    minimize mean((score - y) * (score - y)) with sgd(lr = 0.1)
}
",
    )
    .unwrap();
    let feeds = lookup_feeds(&dir);
    let why = "/job:worker/task:0, replica 0's worker, takes part in replica 1's step too (it holds a variable that replica uses)";
    for (workers, extra) in [(2, &[][..]), (3, &["--sync", "--backup-workers", "1", "--dim", "batch=24"][..])] {
        let cluster = dir.join(format!("cluster-{workers}.json"));
        let tasks: Vec<String> = (0..workers).map(|t| format!("\"localhost:{}\"", 3000 + t)).collect();
        let jobs = format!("{{\"cluster\": {{\"worker\": [{}], \"ps\": [\"localhost:2000\"]}}}}", tasks.join(", "));
        std::fs::write(&cluster, jobs).unwrap();
        let plan = dir.join(format!("together-{workers}.plan"));
        let mut args = vec!["compile", s(&model), "-o", s(&plan), "--cluster", s(&cluster), "--strategy", "ps"];
        args.extend_from_slice(extra);
        let compiled = dfc(&args, None);
        assert!(compiled.status.success(), "{}", text(&compiled.stderr));
        let spawn = (workers + 1).to_string();
        let run = |more: &[&str]| {
            let mut args = vec!["run", s(&plan), "--epochs", "2", "--wait", "10", "--spawn", &spawn];
            args.extend(feeds.iter().map(String::as_str));
            args.extend_from_slice(more);
            dfc(&args, None)
        };
        let output = run(&[]);
        let stderr = text(&output.stderr);
        if extra.is_empty() {
            assert!(output.status.success(), "{stderr}");
            let note = format!("note: the asynchronous replicas step together: {why}");
            assert_eq!(stderr.matches(&note).count(), 1, "said once: {stderr}");
            let asked = run(&["--lockstep"]);
            assert!(asked.status.success() && !text(&asked.stderr).contains("note:"), "{}", text(&asked.stderr));
        } else {
            let refusal =
                format!("the plan has backup workers, whose replicas must step on their own, but they cannot: {why}");
            assert!(!output.status.success() && stderr.contains(&refusal), "{stderr}");
        }
    }
}

/// A parameter server whose part of a free-running replica's step all comes first (a frozen
/// table the replica looks rows up in) still ends each step, as its count of steps shows: one
/// per replica step, like the server that applies the updates (before, it ended none, and
/// kept every step's rendezvous).
#[test]
fn a_server_with_nothing_to_update_ends_each_replica_step() {
    let dir = scratch("ps-frozen");
    let model = dir.join("frozen.df");
    std::fs::write(
        &model,
        "model frozen {
    dim batch = 16
    input id: i32[batch]
    input x: f32[batch, 4]
    input y: f32[batch]
    @trainable(false) @device(\"/job:ps/task:0\") param table: f32[40, 4] = uniform(-0.5, 0.5)
    @device(\"/job:ps/task:1\") param w: f32[4] = ones
    let score = sum(gather(table, id) * x * w, axis = 1)
    minimize mean((score - y) * (score - y)) with sgd(lr = 0.1)
}
",
    )
    .unwrap();
    let feeds = lookup_feeds(&dir);
    let cluster = dir.join("cluster.json");
    let jobs = r#"{"cluster": {"worker": ["localhost:3000"], "ps": ["localhost:2000", "localhost:2001"]}}"#;
    std::fs::write(&cluster, jobs).unwrap();
    let plan = dir.join("frozen.plan");
    let compiled = dfc(&["compile", s(&model), "-o", s(&plan), "--cluster", s(&cluster), "--strategy", "ps"], None);
    assert!(compiled.status.success(), "{}", text(&compiled.stderr));
    let metrics = dir.join("metrics.jsonl");
    let mut args = vec!["run", s(&plan), "--no-shuffle", "--wait", "10", "--spawn", "3", "--metrics", s(&metrics)];
    args.extend(feeds.iter().map(String::as_str));
    let output = dfc(&args, None);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let record: serde_json::Value =
        serde_json::from_str(std::fs::read_to_string(&metrics).unwrap().lines().last().unwrap()).unwrap();
    let steps = |task: &str| {
        let workers = record["workers"].as_array().expect("per-worker metrics");
        workers.iter().find(|w| w["name"] == task).and_then(|w| w["steps"].as_u64())
    };
    assert_eq!(steps("/job:ps/task:1"), Some(16), "the server that updates `w`");
    assert_eq!(steps("/job:ps/task:0"), Some(16), "the server of the frozen table");
}

/// Asynchronous replicas whose servers look rows up for them train on spawned workers, free
/// running behind one such server or two (whose Runs take turns): a replica alone ends as one
/// process does, its learning rate's schedule included; two take every batch once, and with
/// `--lockstep` end as one process does too.
#[test]
fn lookups_on_parameter_servers_train_on_spawned_workers() {
    let dir = scratch("ps-lookups");
    let model = dir.join("lookup.df");
    std::fs::write(&model, LOOKUP).unwrap();
    let feeds = lookup_feeds(&dir);
    let addresses =
        |first: usize, n: usize| (first..first + n).map(|p| format!("\"localhost:{p}\"")).collect::<Vec<_>>();
    for (workers, ps) in [(1, 1), (1, 2), (2, 2), (2, 1)] {
        let what = format!("async ps, {workers} worker(s) and {ps} ps");
        let cluster = dir.join(format!("cluster-{workers}-{ps}.json"));
        let jobs = format!(
            "\"worker\": [{}], \"ps\": [{}]",
            addresses(3000, workers).join(", "),
            addresses(2000, ps).join(", ")
        );
        std::fs::write(&cluster, format!("{{\"cluster\": {{{jobs}}}}}")).unwrap();
        let plan = dir.join(format!("lookup-{workers}-{ps}.plan"));
        let compiled = dfc(&["compile", s(&model), "-o", s(&plan), "--cluster", s(&cluster), "--strategy", "ps"], None);
        assert!(compiled.status.success(), "{what}: {}", text(&compiled.stderr));
        let train = |name: &str, extra: &[&str]| {
            let checkpoints = dir.join(format!("{name}-{workers}-{ps}"));
            let metrics = dir.join(format!("{name}-{workers}-{ps}.jsonl"));
            let mut args = vec!["run", s(&plan), "--no-shuffle", "--epochs", "2", "--wait", "10"];
            args.extend(feeds.iter().map(String::as_str));
            args.extend(["--checkpoint-dir", s(&checkpoints), "--metrics", s(&metrics)]);
            args.extend_from_slice(extra);
            let output = dfc(&args, None);
            assert!(output.status.success(), "{what}, {name}: {}", text(&output.stderr));
            let records = std::fs::read_to_string(&metrics).unwrap();
            let records: Vec<serde_json::Value> = records.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
            let checkpoint = dfc_driver::checkpoint::latest(&checkpoints).expect("readable").expect("a checkpoint");
            (checkpoint, records)
        };
        let (embedded, _) = train("embedded", &[]);
        let tasks = (workers + ps).to_string();
        let (spawned, records) = train("spawned", &["--spawn", &tasks]);
        let steps = |task: &str| {
            let of_epoch = |record: &serde_json::Value| {
                let workers = record["workers"].as_array().expect("per-worker metrics");
                workers.iter().find(|w| w["name"] == task).map_or(0, |w| w["steps"].as_u64().unwrap())
            };
            records.iter().map(of_epoch).sum::<u64>()
        };
        let replica_steps: u64 = (0..workers).map(|t| steps(&format!("/job:worker/task:{t}"))).sum();
        assert_eq!(replica_steps, 32 * workers as u64, "{what}: every replica batch once");
        // Free-running, a server counts a step per replica step (in lockstep, one per step).
        for task in 0..ps {
            assert_eq!(steps(&format!("/job:ps/task:{task}")), 32 * workers as u64, "{what}: ps {task} runs free");
        }
        if workers == 1 {
            assert_same_parameters(&what, &embedded, &spawned);
        }
        if workers == 2 && ps == 2 {
            let (lockstep, _) = train("lockstep", &["--spawn", &tasks, "--lockstep"]);
            assert_same_parameters(&what, &embedded, &lockstep);
        }
    }
    // Backup workers, whose replicas must step free, train behind one server that looks rows
    // up and behind two.
    for ps in [1, 2] {
        let cluster = dir.join(format!("cluster-3-{ps}.json"));
        let jobs =
            format!("\"worker\": [{}], \"ps\": [{}]", addresses(3000, 3).join(", "), addresses(2000, ps).join(", "));
        std::fs::write(&cluster, format!("{{\"cluster\": {{{jobs}}}}}")).unwrap();
        let plan = dir.join(format!("backup-3-{ps}.plan"));
        let mut args = vec!["compile", s(&model), "-o", s(&plan), "--cluster", s(&cluster), "--strategy", "ps"];
        args.extend(["--sync", "--backup-workers", "1", "--dim", "batch=24"]);
        let compiled = dfc(&args, None);
        assert!(compiled.status.success(), "{}", text(&compiled.stderr));
        let tasks = (3 + ps).to_string();
        let mut args = vec!["run", s(&plan), "--epochs", "1", "--wait", "10", "--spawn", &tasks];
        args.extend(feeds.iter().map(String::as_str));
        let output = dfc(&args, None);
        assert!(output.status.success(), "backup workers behind {ps} ps: {}", text(&output.stderr));
    }
}

/// Backup workers: 3 synchronous replicas and a backup, one of whose workers is stopped for two
/// seconds. The others go on making updates of three gradients each (synchronous steps would
/// wait for the stopped one), the stopped replica's late gradient is dropped, and training
/// still fits the data as synchronous ps without a stop does.
#[test]
fn backup_workers_go_on_without_a_stopped_worker() {
    let dir = scratch("backup-workers");
    let feeds = regression_data(&dir, 32_768);
    let workers: Vec<Worker> = (0..5).map(|_| Worker::start(TOKEN)).collect();
    let replicas = [&workers[0], &workers[1], &workers[2], &workers[3]];
    let cluster = cluster_file(&dir, &[("worker", &replicas), ("ps", &[&workers[4]])]);
    let plan = compile(&dir, &["--cluster", s(&cluster), "--strategy", "ps", "--sync", "--backup-workers", "1"]);
    let metrics = dir.join("metrics.jsonl");
    let mut run = Command::new(env!("CARGO_BIN_EXE_dfc"))
        .args(["run", s(&plan), "--feed", &feeds[0], "--feed", &feeds[1], "--cluster", s(&cluster)])
        .args(["--epochs", "3", "--metrics", s(&metrics)])
        .env("DFC_TOKEN", TOKEN)
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the run");
    let (lines, stderr) = stderr_lines(&mut run);
    // The stop comes once the first epoch has ended (training is under way, however slowly the run started, and
    // two epochs are left), and lasts 2 s: less than the 3 s after which a silent worker fails the run.
    wait_for_line(&lines, "epoch 1:");
    pause(&workers[1], Duration::from_secs(2));
    let status = run.wait().expect("wait");
    let stderr = stderr.join().unwrap();
    assert!(status.success(), "{stderr}");
    let records: Vec<serde_json::Value> =
        std::fs::read_to_string(&metrics).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let total =
        |key: &str| records.iter().map(|r| r[key].as_u64().unwrap_or_else(|| panic!("{key} in {r}"))).sum::<u64>();
    let (updates, dropped) = (total("updates"), total("gradients_dropped"));
    // 32,768 examples in batches of 32, three times: 3,072 plan steps of 4 replica steps of 8
    // rows. Each is taken into an update or dropped, but for up to 2 taken into an update not
    // made.
    assert_eq!(records[2]["step"].as_u64(), Some(3072), "{records:?}");
    let accounted = 3 * updates + dropped;
    assert!((4 * 3072 - 2..=4 * 3072).contains(&accounted), "{updates} updates, {dropped} dropped");
    assert!(dropped > 0, "a late gradient is dropped");
    let epoch_line = stderr.lines().find(|l| l.starts_with("epoch 1:")).unwrap_or_else(|| panic!("{stderr}"));
    assert!(epoch_line.contains(&format!("; {} updates (", records[0]["updates"])), "{epoch_line}");
    assert!(epoch_line.ends_with(&format!("{} gradients dropped", records[0]["gradients_dropped"])), "{epoch_line}");
    // Over the whole run: the stop may come in any epoch.
    let steps = |task: &str| {
        let of_epoch = |record: &serde_json::Value| {
            let workers = record["workers"].as_array().expect("per-worker metrics");
            let worker = workers.iter().find(|w| w["name"] == task).unwrap_or_else(|| panic!("no {task}"));
            worker["steps"].as_u64().unwrap()
        };
        records.iter().map(of_epoch).sum::<u64>()
    };
    let (stopped, running) = (steps("/job:worker/task:1"), steps("/job:worker/task:0"));
    assert!(running > stopped + 200, "the others went on while one was stopped: {running} vs {stopped}");
    let loss = records[2]["train_loss"].as_f64().unwrap();
    assert!(loss < 1e-3, "the regression is fitted: the last epoch's loss is {loss}");
}

/// `dfc certs --out OUT HOSTS...`: a CA in `out` (or the one there) and a directory per host.
fn certs(out: &Path, hosts: &[&str]) {
    let mut args = vec!["certs", "--out", s(out)];
    args.extend_from_slice(hosts);
    let output = dfc(&args, None);
    assert!(output.status.success(), "dfc {}: {}", args.join(" "), text(&output.stderr));
}

/// With --tls-dir (made by `dfc certs`) the driver and its workers talk TLS with client
/// certificates, the data plane included: the run trains as over plain connections; a driver
/// without TLS, or with a certificate another CA signed, does not get through.
#[test]
fn tls_with_client_certificates() {
    let dir = scratch("tls");
    let feeds = regression_data(&dir, 256);
    let (pki, other_pki) = (dir.join("pki"), dir.join("other-pki"));
    certs(&pki, &["localhost"]);
    // The driver's directory is signed later by the same CA (`dfc certs` run again).
    certs(&pki, &["127.0.0.1"]);
    certs(&other_pki, &["localhost"]);
    let (workers_tls, driver_tls, theirs) = (pki.join("localhost"), pki.join("127.0.0.1"), other_pki.join("localhost"));
    let plan = compile(&dir, &["--devices", "2", "--strategy", "mirrored"]);
    let plain = train(&plan, &feeds, &dir.join("plain"), &["--spawn", "2"], None);
    let encrypted = train(&plan, &feeds, &dir.join("tls"), &["--spawn", "2", "--tls-dir", s(&workers_tls)], None);
    assert_eq!(plain.tensors, encrypted.tensors, "TLS changes nothing in the arithmetic");

    // Two workers serving TLS, sending to each other over the data plane's TCP in TLS (not
    // through shared memory), and drivers that are not let in.
    let workers: Vec<Worker> = (0..2)
        .map(|_| {
            let mut command = Command::new(env!("CARGO_BIN_EXE_dfc"));
            command.args(["worker", "--listen", "127.0.0.1:0", "--no-shared-memory", "--tls-dir", s(&workers_tls)]);
            Worker::launch(command, TOKEN, "127.0.0.1")
        })
        .collect();
    let cluster = cluster_file(&dir, &[("worker", &[&workers[0], &workers[1]])]);
    let plan = compile(&dir, &["--cluster", s(&cluster), "--strategy", "mirrored"]);
    let embedded = train(&plan, &feeds, &dir.join("embedded"), &[], None);
    let run = |extra: &[&str]| {
        let mut args = vec!["run", s(&plan), "--feed", &feeds[0], "--feed", &feeds[1], "--cluster", s(&cluster)];
        args.extend_from_slice(extra);
        dfc(&args, Some(TOKEN))
    };
    let without = run(&[]);
    assert!(!without.status.success(), "a plain connection to a TLS worker");
    let other_ca = run(&["--tls-dir", s(&theirs)]);
    assert!(!other_ca.status.success(), "a certificate from another CA");
    let with = train(
        &plan,
        &feeds,
        &dir.join("remote"),
        &["--cluster", s(&cluster), "--tls-dir", s(&driver_tls)],
        Some(TOKEN),
    );
    assert_same_parameters("workers in TLS", &embedded, &with);
}

/// Without TLS nothing crosses the network: a worker will not listen beyond loopback, and a
/// driver will not send the token to a worker beyond it; both say to use `dfc certs`.
#[test]
fn plain_connections_beyond_loopback_are_refused() {
    let listening = dfc(&["worker", "--listen", "0.0.0.0:0"], Some(TOKEN));
    let stderr = text(&listening.stderr);
    assert!(!listening.status.success() && stderr.contains("--tls-dir") && stderr.contains("dfc certs"), "{stderr}");
    assert!(text(&listening.stdout).is_empty(), "it never said it listens: {}", text(&listening.stdout));

    let dir = scratch("plain-beyond-loopback");
    let feeds = regression_data(&dir, 64);
    // A documentation address (TEST-NET-1): the driver refuses before any connection.
    let cluster = dir.join("cluster.json");
    std::fs::write(&cluster, r#"{"cluster": {"worker": ["192.0.2.1:7000"]}}"#).unwrap();
    let plan = compile(&dir, &["--cluster", s(&cluster)]);
    let started = Instant::now();
    let run = dfc(&["run", s(&plan), "--feed", &feeds[0], "--feed", &feeds[1], "--cluster", s(&cluster)], Some(TOKEN));
    let stderr = text(&run.stderr);
    assert!(!run.status.success() && stderr.contains("in clear") && stderr.contains("dfc certs"), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(10), "refused at once, not after trying to connect");
}

/// The thread count and resident memory of process `pid`, from /proc.
fn threads_and_rss(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc/PID/status");
    let field = |name: &str| {
        let line = status.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("no {name} in {status}"));
        line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap()
    };
    (field("Threads:"), field("VmRSS:") * 1024)
}

/// Lets this process hold `n` descriptors (CI's default limit may be 1,024).
fn allow_open_files(n: u64) {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit and setrlimit read and write the one struct passed, which lives here.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit), 0);
        if limit.rlim_cur < n {
            assert!(limit.rlim_max >= n, "the hard limit of open files ({}) is below {n}", limit.rlim_max);
            limit.rlim_cur = n;
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &limit), 0);
        }
    }
}

/// Whether the other end closed `stream` (end of stream or reset) within `within`.
fn closed_by_peer(mut stream: &std::net::TcpStream, within: Duration) -> bool {
    stream.set_read_timeout(Some(within.max(Duration::from_millis(1)))).unwrap();
    let mut buffer = [0u8; 4096];
    loop {
        match std::io::Read::read(&mut stream, &mut buffer) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) => return e.kind() == std::io::ErrorKind::ConnectionReset,
        }
    }
}

/// A thousand connections that never prove the token, held open on each of a worker's two
/// ports (every other one sending garbage): the worker's threads and memory barely move; an
/// authenticated training run on it meanwhile ends as the one-process run does; and the worker
/// closes every one of them within its deadline.
#[test]
fn a_thousand_unauthenticated_connections_do_not_stop_a_worker() {
    const FLOOD: usize = 1000;
    allow_open_files(4 * FLOOD as u64 + 1024);
    let dir = scratch("flood");
    let feeds = regression_data(&dir, 256);
    let data_address = free_addresses(1).remove(0);
    let data_port = data_address.rsplit_once(':').unwrap().1;
    let mut command = Command::new(env!("CARGO_BIN_EXE_dfc"));
    command.args(["worker", "--listen", "127.0.0.1:0", "--data-port", data_port]);
    let workers = [Worker::launch(command, TOKEN, "127.0.0.1"), Worker::start(TOKEN)];
    let cluster = cluster_file(&dir, &[("worker", &[&workers[0], &workers[1]])]);
    let plan = compile(&dir, &["--cluster", s(&cluster), "--strategy", "mirrored"]);
    let embedded = train(&plan, &feeds, &dir.join("embedded"), &[], None);
    // A first run starts the threads a worker keeps (its compute pool, the data plane's readers).
    train(&plan, &feeds, &dir.join("warm-up"), &["--cluster", s(&cluster)], Some(TOKEN));
    let pid = workers[0].child.id();
    std::thread::sleep(Duration::from_millis(500));
    let before = threads_and_rss(pid);

    // The most threads and memory the worker has while the connections come and are held.
    let mut during = before;
    let mut look = || {
        let (threads, rss) = threads_and_rss(pid);
        during = (during.0.max(threads), during.1.max(rss));
    };
    let flood_started = Instant::now();
    let mut flood = Vec::new();
    let mut random = fastrand::Rng::with_seed(7);
    for port in [workers[0].address.as_str(), data_address.as_str()] {
        for i in 0..FLOOD {
            let mut stream = std::net::TcpStream::connect(port).expect("a connection to the worker");
            if i % 2 == 1 {
                let garbage: Vec<u8> = (0..1024).map(|_| random.u8(..)).collect();
                let _ = std::io::Write::write_all(&mut stream, &garbage);
            }
            flood.push(stream);
            if i % 50 == 0 {
                look();
            }
        }
    }
    let opened = Instant::now();
    for _ in 0..10 {
        std::thread::sleep(Duration::from_millis(100));
        look();
    }
    let run = train(&plan, &feeds, &dir.join("flooded"), &["--cluster", s(&cluster)], Some(TOKEN));
    assert_same_parameters("a run on a flooded worker", &embedded, &run);
    // The worker's deadline is 5 s from taking a connection; 3 s more for a loaded machine.
    let deadline = opened + Duration::from_secs(8);
    let open = flood.iter().filter(|s| !closed_by_peer(s, deadline.saturating_duration_since(Instant::now()))).count();
    let after = threads_and_rss(pid);
    eprintln!(
        "worker with {} connections held on its two ports (opened in {:.1} s): {} threads before, {} at most during, {} after; RSS {:.1} MiB before, {:.1} MiB at most during, {:.1} MiB after",
        flood.len(),
        (opened - flood_started).as_secs_f64(),
        before.0,
        during.0,
        after.0,
        before.1 as f64 / (1 << 20) as f64,
        during.1 as f64 / (1 << 20) as f64,
        after.1 as f64 / (1 << 20) as f64
    );
    assert_eq!(open, 0, "every unauthenticated connection is closed within the deadline");
    // A thread per connection would be 2,000 more; a few may come and go with tokio's pool.
    assert!(during.0 <= before.0 + 4, "threads: {} before, {} during the flood", before.0, during.0);
    // At most 256 waiting connections per port, each a socket and a task with small buffers.
    assert!(during.1 <= before.1 + (16 << 20), "RSS: {} before, {} during the flood", before.1, during.1);
}

#[test]
fn bench_allreduce_reports_bus_bandwidth_next_to_raw_tcp() {
    let output = dfc(&["bench-allreduce", "--workers", "2", "--sizes-mib", "1,2", "--iterations", "2", "--json"], None);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).expect("a JSON report");
    assert!(report["loopback_tcp_bytes_per_second"].as_f64().unwrap() > 0.0, "{report}");
    let through_memory = report["loopback_ring_tcp_through_memory_bytes_per_second"].as_array().unwrap();
    let sizes: Vec<u64> = through_memory.iter().map(|r| r[1].as_u64().unwrap()).collect();
    assert_eq!(sizes, [1 << 20, 2 << 20], "{report}");
    let results = report["results"].as_array().unwrap();
    let measured: Vec<(u64, &str, bool)> = results
        .iter()
        .map(|r| {
            (r["bytes"].as_u64().unwrap(), r["transport"].as_str().unwrap(), r["shared_memory"].as_bool().unwrap())
        })
        .collect();
    // Both transports at each size; local workers take the shared-memory queues when offered.
    let (one, two) = (1 << 20, 2 << 20);
    let expected =
        [(one, "shared-memory", true), (one, "tcp", false), (two, "shared-memory", true), (two, "tcp", false)];
    assert_eq!(measured, expected, "{report}");
    for result in results {
        assert_eq!(result["workers"], 2);
        assert!(result["bus_bytes_per_second"].as_f64().unwrap() > 0.0, "{report}");
    }
}

/// ZeRO stage 1 (`--shard-optimizer`) on 3 spawned workers: each keeps a third of the
/// momentum (the 13 weights padded to 15, 5 a worker) and updates a third of the weights, and
/// training ends as plain mirrored in one process does. A run given one epoch, then started
/// again for two, resumes from its checkpoint, where each slot is whole (flat, padded), and
/// ends the same.
#[test]
fn a_sharded_optimizer_on_3_workers_trains_and_resumes_as_mirrored() {
    let (plain_dir, sharded_dir) = (scratch("sharded-3-plain"), scratch("sharded-3"));
    let feeds = regression_data(&plain_dir, 240);
    let args = ["--devices", "3", "--strategy", "mirrored", "--dim", "batch=24"];
    let plain = compile(&plain_dir, &args);
    let sharded = compile(&sharded_dir, &[&args[..], &["--shard-optimizer"]].concat());
    let reference = train(&plain, &feeds, &plain_dir.join("embedded"), &[], None);
    let checkpoints = sharded_dir.join("spawned");
    let first = train(&sharded, &feeds, &checkpoints, &["--spawn", "3", "--epochs", "1"], None);
    assert_eq!(first.tensors["w/momentum"].shape.dims(), [15], "a sharded slot is whole in a checkpoint");
    let resumed = train(&sharded, &feeds, &checkpoints, &["--spawn", "3"], None);
    assert_eq!(resumed.step, reference.step);
    assert_eq!(resumed.tensors.keys().collect::<Vec<_>>(), reference.tensors.keys().collect::<Vec<_>>());
    for (name, tensor) in &reference.tensors {
        let expected = tensor.to_f64_vec();
        let got = &resumed.tensors[name].to_f64_vec()[..expected.len()];
        let worst = close::worst_difference(&format!("sharded: `{name}`"), got, &expected, close::absolute);
        assert!(worst < 1e-4, "sharded on 3 workers: `{name}` differs by {worst} from mirrored in one process");
    }
}
