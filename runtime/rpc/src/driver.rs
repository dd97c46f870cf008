//! The driver of remote workers: `RemoteSession` runs a plan's partitions on `dfc worker`
//! processes, as a [`Runner`] for the training loop; `assign` decides which worker runs which
//! partition; `LocalWorkers` starts worker processes on loopback (`dfc run --spawn N`).
//!
//! Faults: every call has a deadline; a worker that fails, dies or does not answer in time is
//! reported by its task name, the step is aborted on the others, and the error ends the run.

use crate::auth::AddToken;
use crate::proto::worker_client::WorkerClient;
use crate::proto::*;
use crate::rendezvous::Client;
use crate::{plan_sha256, tensor, MAX_MESSAGE_BYTES};
use dfc_driver::{Backend, BackupStep, FreeReplicas, ReplicaStep, RunError, Runner, Stage, WorkerMetrics};
use dfc_interp::{Tensor, Variables};
use dfc_plan::Plan;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

pub use dfc_ir::Assignment;

/// Spreads `plan`'s partitions over `workers` workers, as `dfc_ir::assign_workers` does.
pub fn assign(plan: &Plan, workers: usize) -> Result<Assignment, String> {
    let devices: Vec<&dfc_ir::DeviceSpec> = plan.partitions.iter().map(|p| &p.device).collect();
    dfc_ir::assign_workers(&devices, &plan.cluster, workers)
}

/// Whether connecting failed because nothing listens there (yet), not for another reason (a
/// TLS handshake refused, an unknown host), which waiting would not change.
fn refused(error: &tonic::transport::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = source {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            return io.kind() == std::io::ErrorKind::ConnectionRefused;
        }
        source = e.source();
    }
    false
}

/// How long the driver keeps trying to reach a worker that does not listen yet.
const CONNECT_PATIENCE: Duration = Duration::from_secs(30);

/// How long a call may take beyond the waits inside a step.
const CALL_MARGIN: Duration = Duration::from_secs(10);

/// How often the driver asks the workers it is waiting on whether they are alive at all, and
/// how long it waits for that answer: a worker whose process is stopped or hung answers
/// nothing, not even `Health`, which a busy worker answers at once. After a step has failed on
/// one worker and been aborted on all, the others are asked sooner.
const HEARTBEAT: Duration = Duration::from_secs(5);
const ABORT_GRACE: Duration = Duration::from_secs(2);
const HEALTH_PATIENCE: Duration = Duration::from_secs(3);

/// A plan's partitions running on remote workers.
pub struct RemoteSession {
    plan: Plan,
    sha256: prost::bytes::Bytes,
    clients: Vec<Client>,
    addresses: Vec<String>,
    names: Vec<String>,
    runtime: tokio::runtime::Runtime,
    next_program: u64,
    /// Step ids, unique across replicas that step at the same time.
    next_step: AtomicU64,
    wait: Duration,
    /// Per worker, what its runs took since `take_worker_metrics` last drained them.
    worker_metrics: Mutex<Vec<WorkerMetrics>>,
    /// Per worker, the shifts from its time line to this process's that its traced runs
    /// allow so far (`TraceWindow::shift`).
    trace_bounds: Mutex<Vec<Option<(f64, f64)>>>,
    /// The free-running replicas' programs, once asked for; else why they cannot run so (if
    /// the plan has replicas).
    free: Option<Result<Vec<ReplicaPrograms>, Option<String>>>,
    /// The turns of the free-running replicas' Runs on their servers (`RunRequest::turn`),
    /// taken where a replica's step has several servers.
    turns: Option<Mutex<Turns>>,
    /// The worker (rank) of each partition.
    partition_worker: Vec<usize>,
    /// Per worker, the threads it computes on (as it said when connected).
    worker_threads: Vec<usize>,
    /// Where the stall inspector's reports go (a step still waiting after a heartbeat).
    on_stall: Option<Box<dyn Fn(&str) + Send + Sync>>,
}

/// When this process sent a Run and when it had the replies, on its time line: a worker's
/// run lies between, whatever the two machines' clocks say.
#[derive(Clone, Copy)]
struct TraceWindow {
    sent_us: f64,
    replied_us: f64,
}

impl TraceWindow {
    fn open() -> Self {
        let now = dfc_interp::trace::now_us();
        TraceWindow { sent_us: now, replied_us: now }
    }

    fn close(self) -> Self {
        TraceWindow { replied_us: dfc_interp::trace::now_us(), ..self }
    }

    /// What to add to the times of `reply`'s spans to put them on this process's time line:
    /// the shift between the two processes' clock origins, kept to the shifts that put the
    /// worker's run (from its arrival to its reply) inside this window and every earlier one
    /// (`bounds`, narrowed here). Two readings of the system clock, taken apart, can disagree by
    /// more than a kernel lasts (busy or virtual machines; other hosts), which put a worker's
    /// spans outside the steps that ran them.
    fn shift(self, reply: &RunReply, bounds: &mut Option<(f64, f64)>) -> f64 {
        // A reply's times are another process's word: one not finite counts as 0.
        let finite = |x: f64| if x.is_finite() { x } else { 0.0 };
        let low = self.sent_us - finite(reply.trace_arrived_us);
        let high = self.replied_us - finite(reply.trace_replied_us);
        // Earlier windows narrow this one unless none fits both (the clocks run at other rates).
        let (low, high) = match *bounds {
            Some((l, h)) if l.max(low) <= h.min(high) => (l.max(low), h.min(high)),
            _ => (low, high),
        };
        *bounds = Some((low, high));
        let guess = finite(reply.trace_origin_unix_us - dfc_interp::trace::origin_unix_us());
        if low <= high {
            guess.clamp(low, high)
        } else {
            (low + high) / 2.0
        }
    }
}

/// `span`'s start on this process's time line and its duration, or `None` for times that are
/// not a span's (not finite, or a negative duration): a worker's word, which would otherwise
/// reach the timeline's JSON as `null`.
fn placed(span: &crate::proto::TraceSpan, shift: f64) -> Option<(f64, f64)> {
    let start_us = span.start_us + shift;
    (start_us.is_finite() && span.duration_us.is_finite() && span.duration_us >= 0.0)
        .then_some((start_us, span.duration_us))
}

/// What one free-running replica runs: its step on its own worker, and on each worker that
/// serves it (a parameter server) the step's part that needs no Recv (sending it the
/// variables) and the rest (receiving its gradients, applying its updates), as separate Runs
/// so that the server holds its variables only while it computes.
struct ReplicaPrograms {
    worker: usize,
    program: u64,
    /// The replica's `Input` nodes, which its worker is fed.
    inputs: Vec<String>,
    /// `(rank, program before its Recvs, program after them)`; `None`: nothing to run then.
    servers: Vec<(usize, Option<u64>, Option<u64>)>,
    /// What the servers' second programs report of the step ([`Reported`]): per report, the
    /// server that returns it and where among its fetched values.
    reports: [Option<(usize, usize)>; 4],
}

/// Where the free-running replicas' Runs on their servers are in their one order: the next
/// turn, and per worker the turn of the last Run it was sent (0: none).
struct Turns {
    next: u64,
    last: Vec<u64>,
}

impl Turns {
    /// A round of Runs on servers (`(rank, request)`), each made to take the round's turn.
    fn take(&mut self, mut round: Vec<(usize, RunRequest)>) -> Vec<(usize, RunRequest)> {
        let turn = self.next;
        self.next += 1;
        for (rank, request) in &mut round {
            request.turn = turn;
            request.after_turn = std::mem::replace(&mut self.last[*rank], turn);
        }
        round
    }
}

/// The scalars a free-running replica's step reports from its servers, in the order of
/// `ReplicaPrograms::reports`: its staleness, and with backup workers whether its gradient was
/// taken, whether it completed an update and the version after its step.
fn reported(replica: &dfc_plan::ReplicaSpec) -> [Option<&str>; 4] {
    let backup = replica.backup.as_ref();
    [
        replica.staleness.as_deref(),
        backup.map(|b| b.accepted.as_str()),
        backup.map(|b| b.applied.as_str()),
        backup.map(|b| b.version.as_str()),
    ]
}

/// A program prepared on every worker.
pub struct RemoteProgram {
    id: u64,
    fetches: usize,
    /// `(rank, inputs it needs, fetch indices it returns)` of each worker that takes part.
    parts: Vec<(usize, Vec<String>, Vec<usize>)>,
}

/// Whether the call's deadline passed: the server says so, or tonic's client ends the call
/// itself (as `Cancelled`) when the server says nothing, as a stopped process does.
fn timed_out(status: &tonic::Status) -> bool {
    status.code() == tonic::Code::DeadlineExceeded
        || (status.code() == tonic::Code::Cancelled && status.message().contains("Timeout expired"))
}

fn status_error(name: &str, address: &str, status: &tonic::Status) -> RunError {
    let what = match status.code() {
        tonic::Code::Unavailable => "cannot be reached (is it running?)",
        _ if timed_out(status) => "did not answer in time",
        tonic::Code::Unauthenticated => "refused the token",
        tonic::Code::Unknown if status.message().contains("transport") => "lost its connection (did its process die?)",
        _ => "failed",
    };
    RunError::Plan(format!("worker {name} at {address} {what}: {}", status.message()))
}

impl RemoteSession {
    /// Connects to the workers at `addresses` (by rank), registers `plan` with each (its
    /// partitions spread by `assignment`, its all-reduces by `all_reduce`) and initialises the
    /// variables from `seed`.
    #[allow(clippy::too_many_arguments)]
    pub fn connect(
        plan: &Plan,
        addresses: &[String],
        assignment: &Assignment,
        token: &str,
        seed: u64,
        backend: Backend,
        wait: Duration,
        tls: Option<&crate::Tls>,
        all_reduce: crate::rendezvous::Algorithm,
    ) -> Result<RemoteSession, RunError> {
        let runtime =
            tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().map_err(RunError::Io)?;
        let bytes = prost::bytes::Bytes::from(dfc_plan::encode(plan));
        let sha256 = plan_sha256(&bytes);
        let mut clients = Vec::new();
        for address in addresses {
            let endpoint = crate::tls::endpoint(address, tls).map_err(RunError::Usage)?;
            // Workers started by a launcher beside this process may not listen yet: try for a while.
            let deadline = std::time::Instant::now() + CONNECT_PATIENCE;
            let channel = loop {
                match runtime.block_on(endpoint.connect()) {
                    Ok(channel) => break channel,
                    Err(e) if refused(&e) && std::time::Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(100))
                    }
                    Err(e) => {
                        return Err(RunError::Plan(format!(
                            "cannot connect to worker at {address} for {} s: {e} (is `dfc worker` running there?)",
                            CONNECT_PATIENCE.as_secs()
                        )))
                    }
                }
            };
            let client = WorkerClient::with_interceptor(channel, AddToken::new(token))
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES);
            // A call at once proves the token on the new connection, which the worker would
            // otherwise close as unproven while this waits for the next workers to listen
            // (`crate::limits`). Its failures are reported by the `Health` calls below.
            let mut request = tonic::Request::new(HealthRequest {});
            request.set_timeout(HEALTH_PATIENCE);
            let _ = runtime.block_on(client.clone().health(request));
            clients.push(client);
        }
        let mut session = RemoteSession {
            plan: plan.clone(),
            sha256,
            clients,
            addresses: addresses.to_vec(),
            names: assignment.names.clone(),
            runtime,
            next_program: 0,
            next_step: AtomicU64::new(0),
            wait,
            worker_metrics: Mutex::new(
                assignment
                    .names
                    .iter()
                    .map(|name| WorkerMetrics { name: name.clone(), ..WorkerMetrics::default() })
                    .collect(),
            ),
            trace_bounds: Mutex::new(vec![None; assignment.names.len()]),
            free: None,
            turns: None,
            partition_worker: assignment.partition_worker.clone(),
            worker_threads: Vec::new(),
            on_stall: None,
        };
        let addresses: Vec<String> = addresses.to_vec();
        // Each worker's data port, which the others send all-reduce segments to.
        let health = vec![HealthRequest {}; addresses.len()];
        let health = session.on_all(health, Duration::from_secs(30), |mut c, r| async move { c.health(r).await })?;
        let data_ports: Vec<u32> = health.iter().map(|h| h.data_port).collect();
        session.worker_threads = health.iter().map(|h| h.threads as usize).collect();
        let requests: Vec<RegisterRequest> = (0..addresses.len())
            .map(|rank| RegisterRequest {
                plan: bytes.clone(),
                plan_sha256: session.sha256.clone(),
                rank: rank as u32,
                workers: addresses.clone(),
                names: assignment.names.clone(),
                partition_worker: assignment.partition_worker.iter().map(|&w| w as u32).collect(),
                seed,
                backend: match backend {
                    Backend::Llvm => "llvm".into(),
                    Backend::Interp => "interp".into(),
                    Backend::GridEmulator => "grid-emulator".into(),
                },
                wait_ms: wait.as_millis() as u64,
                data_ports: data_ports.clone(),
                all_reduce: all_reduce.wire_name().to_string(),
            })
            .collect();
        session.on_all(requests, Duration::from_secs(120), |mut c, r| async move { c.register(r).await })?;
        Ok(session)
    }

    /// Calls every worker (rank i gets `requests[i]`) at once; the replies by rank, or the first
    /// failure (a worker's own failure before one that only reports the step aborted).
    fn on_all<Q, A, F, Fut>(&self, requests: Vec<Q>, timeout: Duration, call: F) -> Result<Vec<A>, RunError>
    where
        Q: Send + 'static,
        A: Send + 'static,
        F: Fn(Client, tonic::Request<Q>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<A>, tonic::Status>> + Send + 'static,
    {
        self.on_some(requests.into_iter().enumerate().collect(), timeout, None, call)
            .map(|replies| replies.into_iter().map(|(_, a)| a).collect())
    }

    /// Calls some workers at once, `requests` by rank; the replies by rank, or the failure that
    /// caused the others: a worker that cannot be reached or did not answer in time before one
    /// that failed, before one that only reports the step aborted. When `step` is given, the
    /// first failure aborts that step on every worker, so that none waits for the failed one.
    /// A worker that stops answering altogether (see [`HEARTBEAT`]) is the failure.
    fn on_some<Q, A, F, Fut>(
        &self,
        requests: Vec<(usize, Q)>,
        timeout: Duration,
        step: Option<u64>,
        call: F,
    ) -> Result<Vec<(usize, A)>, RunError>
    where
        Q: Send + 'static,
        A: Send + 'static,
        F: Fn(Client, tonic::Request<Q>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<A>, tonic::Status>> + Send + 'static,
    {
        let _entered = self.runtime.enter();
        let mut calls = tokio::task::JoinSet::new();
        let mut pending = std::collections::BTreeSet::new();
        for (rank, q) in requests {
            let mut request = tonic::Request::new(q);
            request.set_timeout(timeout);
            let call = call(self.clients[rank].clone(), request);
            calls.spawn(async move { (rank, call.await) });
            pending.insert(rank);
        }
        let mut replies = Vec::new();
        let mut failure: Option<(u8, RunError)> = None;
        // When to check on the workers yet to answer.
        let mut check_at = tokio::time::Instant::now() + HEARTBEAT;
        self.runtime.block_on(async {
            loop {
                let joined = match tokio::time::timeout_at(check_at, calls.join_next()).await {
                    Ok(joined) => joined,
                    Err(_) => {
                        if let Some(silent) = self.inspect(&pending, step).await {
                            failure = Some((0, silent));
                            return;
                        }
                        check_at = tokio::time::Instant::now() + HEARTBEAT;
                        continue;
                    }
                };
                let Some(joined) = joined else { return };
                let (rank, result) = match joined {
                    Ok(done) => done,
                    Err(e) => {
                        failure = failure.take().or(Some((1, RunError::Plan(format!("a call panicked: {e}")))));
                        continue;
                    }
                };
                pending.remove(&rank);
                match result {
                    Ok(reply) => replies.push((rank, reply.into_inner())),
                    Err(status) => {
                        let rank_of_failure = match status.code() {
                            _ if timed_out(&status) => 0,
                            tonic::Code::Unavailable | tonic::Code::Unknown => 0,
                            tonic::Code::Aborted if status.message().contains("aborted:") => 2,
                            _ => 1,
                        };
                        if let (Some(step), None) = (step, &failure) {
                            check_at = check_at.min(tokio::time::Instant::now() + ABORT_GRACE);
                            let reason = format!("worker {} failed", self.names[rank]);
                            for client in &self.clients {
                                let mut client = client.clone();
                                let abort =
                                    AbortRequest { plan_sha256: self.sha256.clone(), step, reason: reason.clone() };
                                tokio::spawn(async move {
                                    let mut request = tonic::Request::new(abort);
                                    request.set_timeout(Duration::from_secs(5));
                                    let _ = client.abort(request).await;
                                });
                            }
                        }
                        let error = status_error(&self.names[rank], self.address(rank), &status);
                        if failure.as_ref().is_none_or(|(r, _)| rank_of_failure < *r) {
                            failure = Some((rank_of_failure, error));
                        }
                    }
                }
            }
        });
        match failure {
            Some((_, error)) => Err(error),
            None => {
                replies.sort_by_key(|(rank, _)| *rank);
                Ok(replies)
            }
        }
    }

    /// The stall inspector, when the calls of `ranks` are still under way after a heartbeat:
    /// asks every worker for `Health`. The first of `ranks` that does not answer in time (or
    /// at all) is the reason the step failed, and the error names what the others wait for;
    /// otherwise, where the step's partitions wait for other workers, `on_stall` hears which
    /// tensor or all-reduce each waits for, from whom, and for how long.
    async fn inspect(&self, ranks: &std::collections::BTreeSet<usize>, step: Option<u64>) -> Option<RunError> {
        let mut probes = tokio::task::JoinSet::new();
        for rank in 0..self.clients.len() {
            let mut client = self.clients[rank].clone();
            probes.spawn(async move {
                let mut request = tonic::Request::new(HealthRequest {});
                request.set_timeout(HEALTH_PATIENCE);
                let answer = tokio::time::timeout(HEALTH_PATIENCE, client.health(request)).await;
                (rank, answer.ok().and_then(Result::ok).map(|reply| reply.into_inner()))
            });
        }
        let mut answers = probes.join_all().await;
        answers.sort_by_key(|(rank, _)| *rank);
        let waits: Vec<String> = answers
            .iter()
            .filter_map(|(rank, answer)| Some((*rank, answer.as_ref()?)))
            .flat_map(|(rank, health)| {
                health.waits.iter().filter(|w| step.is_none_or(|s| w.step == s)).map(move |w| self.describe(rank, w))
            })
            .collect();
        let silent = answers.iter().find(|(rank, answer)| answer.is_none() && ranks.contains(rank));
        if let Some((rank, _)) = silent {
            let mut message = format!(
                "{} at {} stopped answering: it answered neither its call nor a health check within {} s (is its process stopped or hung?)",
                self.worker(*rank),
                self.address(*rank),
                HEALTH_PATIENCE.as_secs()
            );
            if !waits.is_empty() {
                message += &format!("; meanwhile {}", waits.join("; "));
            }
            return Some(RunError::Plan(message));
        }
        if let (Some(report), false) = (&self.on_stall, waits.is_empty()) {
            let step = step.map_or(String::new(), |s| format!("step {s} ({})", self.plan.model));
            report(&format!("{step} is still under way: {}", waits.join("; ")));
        }
        None
    }

    /// `worker 1 (…) has waited 6.2 s for all-reduce `k` from worker 0 (…)`.
    fn describe(&self, rank: usize, wait: &crate::proto::Wait) -> String {
        let what = if wait.all_reduce { "all-reduce" } else { "tensor" };
        let from = match wait.from.map(|r| r as usize) {
            _ if wait.through_mpi => " in MPI's library, from every other rank".into(),
            Some(r) if r < self.names.len() => format!(" from {}", self.worker(r)),
            Some(r) => format!(" from the worker of rank {r}"),
            None => " from its own replicas".into(),
        };
        format!("{} has waited {:.1} s for {what} `{}`{from}", self.worker(rank), wait.seconds, wait.key)
    }

    /// `worker /job:worker/task:1`, `worker 0 (of 2 devices of one task)`.
    fn worker(&self, rank: usize) -> String {
        let name = &self.names[rank];
        if name.starts_with("worker ") {
            name.clone()
        } else {
            format!("worker {name}")
        }
    }

    /// Where the stall inspector reports steps that still wait on other workers after a
    /// heartbeat (every 5 s).
    pub fn on_stall(&mut self, report: impl Fn(&str) + Send + Sync + 'static) {
        self.on_stall = Some(Box::new(report));
    }

    /// Per worker (by rank), the threads it computes on.
    pub fn worker_threads(&self) -> &[usize] {
        &self.worker_threads
    }

    fn address(&self, rank: usize) -> &str {
        &self.addresses[rank]
    }

    /// Prepares the program of `fetches` and `targets` (its part `stage`) on the workers `ranks`.
    fn prepare(
        &mut self,
        ranks: &[usize],
        fetches: &[&str],
        targets: &[&str],
        stage: Stage,
    ) -> Result<(u64, Vec<(usize, PrepareReply)>), RunError> {
        let id = self.next_program;
        self.next_program += 1;
        let request = PrepareRequest {
            plan_sha256: self.sha256.clone(),
            program: id,
            fetches: fetches.iter().map(|f| f.to_string()).collect(),
            targets: targets.iter().map(|t| t.to_string()).collect(),
            stage: match stage {
                Stage::Whole => 0,
                Stage::BeforeRecvs => 1,
                Stage::AfterRecvs => 2,
            },
        };
        let requests = ranks.iter().map(|&rank| (rank, request.clone())).collect();
        let replies =
            self.on_some(requests, Duration::from_secs(120), None, |mut c, r| async move { c.prepare(r).await })?;
        Ok((id, replies))
    }

    /// Each replica's programs for free-running steps, if the workers keep the replicas apart:
    /// no replica's own worker takes part in another replica's step (it holds its variables
    /// for the whole of its step), so replicas meet only on workers that serve several, which
    /// run each step as two Runs, each in its turn (`Turns`).
    /// Plans whose replicas could deadlock so (`would_deadlock`) step in lockstep instead.
    fn prepare_free_replicas(&mut self) -> Result<Result<Vec<ReplicaPrograms>, Option<String>>, RunError> {
        let replicas = self.plan.replicas.clone();
        if replicas.is_empty() {
            return Ok(Err(None));
        }
        let all: Vec<usize> = (0..self.clients.len()).collect();
        let mut steps = Vec::new();
        for replica in &replicas {
            let updates: Vec<&str> = replica.updates.iter().map(String::as_str).collect();
            let (id, replies) = self.prepare(&all, &[&replica.loss_node], &updates, Stage::Whole)?;
            let taking: Vec<(usize, PrepareReply)> = replies.into_iter().filter(|(_, r)| r.takes_part).collect();
            let Some((worker, own)) = taking.iter().find(|(_, r)| r.provides == [0]) else {
                return Err(RunError::Plan(format!("no worker computes `{}`", replica.loss_node)));
            };
            let servers: Vec<usize> = taking.iter().map(|(rank, _)| *rank).filter(|rank| rank != worker).collect();
            steps.push((*worker, id, own.inputs.clone(), servers));
        }
        for (i, (worker, ..)) in steps.iter().enumerate() {
            let name = &self.names[*worker];
            for (j, (other, _, _, servers)) in steps.iter().enumerate().filter(|(j, _)| i != *j) {
                let why = if other == worker {
                    format!("replicas {i} and {j} both compute on {name}")
                } else if servers.contains(worker) {
                    format!(
                        "{name}, replica {i}'s worker, takes part in replica {j}'s step too (it holds a variable \
                         that replica uses); let the parameter servers hold the variables"
                    )
                } else {
                    continue;
                };
                return self.cannot_run_free(why);
            }
        }
        let mut programs = Vec::new();
        for (replica, (worker, program, inputs, server_ranks)) in replicas.iter().zip(steps) {
            let updates: Vec<&str> = replica.updates.iter().map(String::as_str).collect();
            // The server that applies the updates returns what they reported (the staleness
            // they had, whether they were taken).
            let mut fetches = vec![replica.loss_node.as_str()];
            let reported = reported(replica);
            let kinds: Vec<usize> = (0..reported.len()).filter(|&k| reported[k].is_some()).collect();
            fetches.extend(reported.iter().flatten());
            let mut servers = Vec::new();
            let mut reports = [None; 4];
            // Per server, the workers its first Run waits for and those its second sends to.
            let mut exchanges = Vec::new();
            for rank in server_ranks {
                let (before, reply) = self.prepare(&[rank], &fetches[..1], &updates, Stage::BeforeRecvs)?;
                let waits_for = self.ranks(rank, &reply[0].1.receives_from)?;
                let before = reply[0].1.takes_part.then_some(before);
                let (after, reply) = self.prepare(&[rank], &fetches, &updates, Stage::AfterRecvs)?;
                exchanges.push((rank, waits_for, self.ranks(rank, &reply[0].1.sends_to)?));
                for (position, &fetch) in reply[0].1.provides.iter().enumerate() {
                    if let Some(&kind) = (fetch as usize).checked_sub(1).and_then(|i| kinds.get(i)) {
                        reports[kind] = Some((rank, position));
                    }
                }
                // A server whose part all comes first still gets a second Run: it ends the
                // step there (its rendezvous), and counts it.
                let after = (reply[0].1.takes_part || before.is_some()).then_some(after);
                servers.push((rank, before, after));
            }
            if let Some(why) = self.would_deadlock(worker, &exchanges) {
                return self.cannot_run_free(why);
            }
            programs.push(ReplicaPrograms { worker, program, inputs, servers, reports });
        }
        if programs.iter().any(|replica| replica.servers.len() > 1) {
            self.turns = Some(Mutex::new(Turns { next: 1, last: vec![0; self.clients.len()] }));
        }
        Ok(Ok(programs))
    }

    /// The workers of the partitions a worker (`rank`) named.
    fn ranks(&self, rank: usize, partitions: &[u32]) -> Result<BTreeSet<usize>, RunError> {
        let worker = |&p: &u32| {
            self.partition_worker.get(p as usize).copied().ok_or_else(|| {
                RunError::Plan(format!("worker {} names partition {p}, which the plan lacks", self.names[rank]))
            })
        };
        partitions.iter().map(worker).collect()
    }

    /// Replicas that cannot step on their own (`why`) step together, unless the plan has backup
    /// workers, which must: then the run is refused with the reason.
    fn cannot_run_free(&self, why: String) -> Result<Result<Vec<ReplicaPrograms>, Option<String>>, RunError> {
        if self.plan.strategy.backup_workers > 0 {
            return Err(RunError::Usage(format!(
                "the plan has backup workers, whose replicas must step on their own, but they cannot: {why}"
            )));
        }
        Ok(Err(Some(why)))
    }

    /// Why a replica's step (on `worker`, its servers' first Runs beside it, then their second)
    /// could deadlock, given per server the workers its first Run waits for and those its second
    /// sends to; `None` if it cannot: what a second Run sends comes after every first Run has
    /// ended. (Replicas cannot deadlock each other: their Runs take turns on the servers.)
    fn would_deadlock(&self, worker: usize, exchanges: &[(usize, BTreeSet<usize>, BTreeSet<usize>)]) -> Option<String> {
        for (server, _, sends_to) in exchanges {
            let first_waits =
                |to: &usize| *to == worker || exchanges.iter().any(|(s, waits, _)| s == to && waits.contains(server));
            if let Some(to) = sends_to.iter().find(|to| first_waits(to)) {
                return Some(format!(
                    "{} sends {} what it computes from the replica's results, within the step that waits for it",
                    self.names[*server], self.names[*to]
                ));
            }
        }
        None
    }

    /// Adds a Run's reply to its worker's metrics (`step`: count it as a step), and its spans
    /// to the timeline; `window`: when this process sent the Run and had the reply.
    fn count(&self, rank: usize, reply: &RunReply, step: bool, window: TraceWindow) {
        {
            let mut metrics = self.worker_metrics.lock().unwrap_or_else(|e| e.into_inner());
            let metrics = &mut metrics[rank];
            metrics.steps += u64::from(step);
            metrics.run_seconds += reply.run_seconds;
            metrics.exchange_seconds += reply.exchange_seconds;
        }
        if reply.spans.is_empty() {
            return;
        }
        // A traced run's spans, on this process's time line, each on a track of its worker's.
        let shift = {
            let mut bounds = self.trace_bounds.lock().unwrap_or_else(|e| e.into_inner());
            window.shift(reply, &mut bounds[rank])
        };
        let mut tracks: HashMap<&str, std::sync::Arc<str>> = HashMap::new();
        for span in &reply.spans {
            let Some((start_us, duration_us)) = placed(span, shift) else { continue };
            let track =
                tracks.entry(&span.track).or_insert_with(|| format!("{}: {}", self.names[rank], span.track).into());
            dfc_interp::trace::record(dfc_interp::trace::Event {
                track: track.clone(),
                category: span.category.clone().into(),
                name: span.name.as_str().into(),
                start_us,
                duration_us,
                bytes: span.bytes,
            });
        }
    }

    /// Asks every worker to stop.
    pub fn shutdown(&self) {
        let requests = vec![ShutdownRequest {}; self.clients.len()];
        let _ = self.on_all(requests, Duration::from_secs(5), |mut c, r| async move { c.shutdown(r).await });
    }
}

impl Runner for RemoteSession {
    type Program = RemoteProgram;

    fn plan(&self) -> &Plan {
        &self.plan
    }

    fn program(&mut self, fetches: &[&str], targets: &[&str]) -> Result<RemoteProgram, RunError> {
        let all: Vec<usize> = (0..self.clients.len()).collect();
        let (id, replies) = self.prepare(&all, fetches, targets, Stage::Whole)?;
        let mut provided = vec![false; fetches.len()];
        let mut parts = Vec::new();
        for (rank, reply) in replies {
            if !reply.takes_part {
                continue;
            }
            let provides: Vec<usize> = reply.provides.iter().map(|&i| i as usize).collect();
            for &i in &provides {
                if i >= fetches.len() || std::mem::replace(&mut provided[i], true) {
                    return Err(RunError::Plan(format!(
                        "worker {} returns fetch {i} twice or out of range",
                        self.names[rank]
                    )));
                }
            }
            parts.push((rank, reply.inputs, provides));
        }
        if let Some(i) = provided.iter().position(|p| !p) {
            return Err(RunError::Plan(format!("no worker computes `{}`", fetches[i])));
        }
        Ok(RemoteProgram { id, fetches: fetches.len(), parts })
    }

    fn inputs(&self, program: &RemoteProgram) -> Vec<String> {
        let nodes: Vec<String> = program.parts.iter().flat_map(|p| p.1.clone()).collect();
        dfc_driver::replicas::plan_inputs(&self.plan, nodes)
    }

    fn run(&mut self, program: &RemoteProgram, feeds: &HashMap<String, Tensor>) -> Result<Vec<Tensor>, RunError> {
        let feeds = dfc_driver::replicas::node_feeds(&self.plan, feeds)?;
        let step = self.next_step.fetch_add(1, Ordering::Relaxed);
        let mut requests = Vec::new();
        for (rank, inputs, _) in &program.parts {
            let mut sent = Vec::new();
            for name in inputs {
                let tensor = feeds.get(name).ok_or_else(|| RunError::Usage(format!("no feed for input `{name}`")))?;
                sent.push(NamedTensor { name: name.clone(), tensor: Some(tensor::to_proto(tensor)) });
            }
            let request = RunRequest {
                plan_sha256: self.sha256.clone(),
                program: program.id,
                step,
                feeds: sent,
                trace: dfc_interp::trace::enabled(),
                turn: 0,
                after_turn: 0,
            };
            requests.push((*rank, request));
        }
        let timeout = self.wait + CALL_MARGIN;
        let window = TraceWindow::open();
        let replies = self.on_some(requests, timeout, Some(step), |mut c, r| async move { c.run(r).await })?;
        let window = window.close();
        let mut fetched: Vec<Option<Tensor>> = vec![None; program.fetches];
        for (rank, reply) in replies {
            self.count(rank, &reply, true, window);
            let part = program.parts.iter().find(|p| p.0 == rank).expect("a reply from a part");
            if reply.fetched.len() != part.2.len() {
                return Err(RunError::Plan(format!(
                    "worker {} returned {} values, not {}",
                    self.names[rank],
                    reply.fetched.len(),
                    part.2.len()
                )));
            }
            for (&i, value) in part.2.iter().zip(&reply.fetched) {
                fetched[i] = Some(
                    tensor::from_proto(value)
                        .map_err(|e| RunError::Plan(format!("worker {}: {e}", self.names[rank])))?,
                );
            }
        }
        Ok(fetched.into_iter().map(|f| f.expect("every fetch is provided")).collect())
    }

    fn take_worker_metrics(&mut self) -> Vec<WorkerMetrics> {
        self.worker_metrics
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .iter_mut()
            .map(|m| std::mem::replace(m, WorkerMetrics { name: m.name.clone(), ..WorkerMetrics::default() }))
            .collect()
    }

    fn variables(&mut self) -> Result<Variables, RunError> {
        let request = VariablesRequest { plan_sha256: self.sha256.clone() };
        let replies =
            self.on_all(vec![request; self.clients.len()], Duration::from_secs(120), |mut c, r| async move {
                c.get_variables(r).await
            })?;
        let mut variables = Variables::new();
        for reply in replies {
            for v in reply.variables {
                let tensor = v
                    .tensor
                    .as_ref()
                    .ok_or_else(|| RunError::Plan(format!("variable `{}` came without a value", v.name)))?;
                variables.insert(v.name, tensor::from_proto(tensor).map_err(RunError::Plan)?);
            }
        }
        Ok(variables)
    }

    fn restore(&mut self, saved: &BTreeMap<String, Tensor>, _path: &Path) -> Result<(), RunError> {
        let variables: Vec<NamedTensor> = saved
            .iter()
            .map(|(name, t)| NamedTensor { name: name.clone(), tensor: Some(tensor::to_proto(t)) })
            .collect();
        let request = RestoreRequest { plan_sha256: self.sha256.clone(), variables };
        self.on_all(vec![request; self.clients.len()], Duration::from_secs(120), |mut c, r| async move {
            c.restore(r).await
        })?;
        Ok(())
    }

    fn why_replicas_step_together(&self) -> Option<&str> {
        match &self.free {
            Some(Err(why)) => why.as_deref(),
            _ => None,
        }
    }

    fn free_replicas(&mut self) -> Result<Option<&dyn FreeReplicas>, RunError> {
        if self.free.is_none() {
            let found = self.prepare_free_replicas()?;
            self.free = Some(found);
        }
        Ok(match &self.free {
            Some(Ok(_)) => Some(self as &dyn FreeReplicas),
            _ => None,
        })
    }
}

impl FreeReplicas for RemoteSession {
    fn step(&self, replica: usize, feeds: &HashMap<String, Tensor>) -> Result<ReplicaStep, RunError> {
        let Some(Ok(replicas)) = &self.free else { unreachable!("free_replicas prepared them") };
        let programs = &replicas[replica];
        let step = self.next_step.fetch_add(1, Ordering::Relaxed);
        let mut sent = Vec::new();
        for name in &programs.inputs {
            let tensor = feeds.get(name).ok_or_else(|| RunError::Usage(format!("no feed for input `{name}`")))?;
            sent.push(NamedTensor { name: name.clone(), tensor: Some(tensor::to_proto(tensor)) });
        }
        let request = |program: u64, feeds: Vec<NamedTensor>| RunRequest {
            plan_sha256: self.sha256.clone(),
            program,
            step,
            feeds,
            trace: dfc_interp::trace::enabled(),
            turn: 0,
            after_turn: 0,
        };
        // Behind several servers, each round of Runs on them takes its turn there, so that
        // every server runs the replicas' Runs in one order: a Run waits only for Runs of its
        // own round and of earlier ones, which end, so no two replicas can each hold a server
        // that the other waits for.
        let take_turn = |round| match &self.turns {
            Some(turns) => turns.lock().unwrap_or_else(|e| e.into_inner()).take(round),
            None => round,
        };
        // The servers send the variables while the replica computes; once it has sent its
        // gradients, they apply them.
        let mut first = vec![(programs.worker, request(programs.program, sent))];
        first.extend(take_turn(
            programs.servers.iter().filter_map(|&(rank, before, _)| Some((rank, request(before?, vec![])))).collect(),
        ));
        let timeout = self.wait + CALL_MARGIN;
        let window = TraceWindow::open();
        let replies = self.on_some(first, timeout, Some(step), |mut c, r| async move { c.run(r).await })?;
        let window = window.close();
        let mut loss = None;
        for (rank, reply) in replies {
            // A server's step counts once, when it applies the replica's updates.
            self.count(rank, &reply, rank == programs.worker, window);
            if rank == programs.worker {
                let value = reply
                    .fetched
                    .first()
                    .ok_or_else(|| RunError::Plan(format!("worker {} returned no loss", self.names[rank])))?;
                let value = tensor::from_proto(value)
                    .map_err(|e| RunError::Plan(format!("worker {}: {e}", self.names[rank])))?;
                loss = Some(value.scalar_f64());
            }
        }
        let mut values = [None; 4];
        let second =
            programs.servers.iter().filter_map(|&(rank, _, after)| Some((rank, request(after?, vec![])))).collect();
        let second = take_turn(second);
        let window = TraceWindow::open();
        let replies = self.on_some(second, timeout, Some(step), |mut c, r| async move { c.run(r).await })?;
        let window = window.close();
        for (rank, reply) in replies {
            self.count(rank, &reply, true, window);
            for (kind, report) in programs.reports.iter().enumerate() {
                let Some((_, position)) = report.filter(|(server, _)| *server == rank) else { continue };
                let value = reply.fetched.get(position).ok_or_else(|| {
                    RunError::Plan(format!("worker {} returned fewer values than asked", self.names[rank]))
                })?;
                let value = tensor::from_proto(value)
                    .map_err(|e| RunError::Plan(format!("worker {}: {e}", self.names[rank])))?;
                values[kind] = Some(value.scalar_f64());
            }
        }
        let [staleness, accepted, applied, version] = values;
        let backup = match (accepted, applied, version) {
            (Some(accepted), Some(applied), Some(version)) => {
                Some(BackupStep { accepted: accepted != 0.0, applied: applied != 0.0, version: version as u64 })
            }
            _ => None,
        };
        Ok(ReplicaStep { loss: loss.expect("the replica's worker replied"), staleness, backup })
    }
}

/// Set for the workers `LocalWorkers` starts: they exit when their standard input closes, that
/// is when the process that started them is gone, even if it was killed.
pub const EXIT_WITH_PARENT: &str = "DFC_WORKER_EXIT_WITH_PARENT";

/// Worker processes started on loopback by this process (`dfc run --spawn N`); they are
/// killed when this is dropped.
pub struct LocalWorkers {
    children: Vec<std::process::Child>,
    pub addresses: Vec<String>,
}

impl LocalWorkers {
    /// Starts `n` `dfc worker --listen 127.0.0.1:0` processes of the executable `dfc` with
    /// `token` in their environment, and reads the address each one bound.
    ///
    /// They share this machine's cores: unless `RAYON_NUM_THREADS` says otherwise, each computes
    /// on its share of them (at least one), as oversubscribed workers slow each other down.
    pub fn spawn(dfc: &Path, n: usize, token: &str, tls_dir: Option<&Path>) -> Result<LocalWorkers, String> {
        use std::io::BufRead;
        let mut workers = LocalWorkers { children: Vec::new(), addresses: Vec::new() };
        for i in 0..n {
            let mut command = std::process::Command::new(dfc);
            command.args(["worker", "--listen", "127.0.0.1:0"]);
            if std::env::var_os("RAYON_NUM_THREADS").is_none() {
                let cores = std::thread::available_parallelism().map_or(1, usize::from);
                command.arg("--threads").arg((cores / n).max(1).to_string());
            }
            if let Some(dir) = tls_dir {
                command.arg("--tls-dir").arg(dir);
            }
            let mut child = command
                .env(crate::auth::TOKEN_VARIABLE, token)
                .env(EXIT_WITH_PARENT, "1")
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .spawn()
                .map_err(|e| format!("cannot start worker {i} ({}): {e}", dfc.display()))?;
            let stdout = child.stdout.take().expect("piped");
            workers.children.push(child);
            let mut line = String::new();
            std::io::BufReader::new(stdout)
                .read_line(&mut line)
                .map_err(|e| format!("worker {i} said nothing: {e}"))?;
            let address = line
                .trim()
                .rsplit(' ')
                .next()
                .filter(|a| a.contains(':'))
                .ok_or_else(|| format!("worker {i} did not say where it listens (it said `{}`)", line.trim()))?;
            workers.addresses.push(address.to_string());
        }
        Ok(workers)
    }
}

impl Drop for LocalWorkers {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(origin_unix_us: f64, arrived_us: f64, replied_us: f64) -> RunReply {
        RunReply {
            trace_origin_unix_us: dfc_interp::trace::origin_unix_us() + origin_unix_us,
            trace_arrived_us: arrived_us,
            trace_replied_us: replied_us,
            ..RunReply::default()
        }
    }

    /// A worker's spans go where its system clock says while that fits the Run's exchange, and
    /// within the exchange when the clocks disagree: its run from arrival to reply lies inside
    /// the window, narrowed by every earlier window.
    #[test]
    fn worker_spans_stay_within_the_runs_that_made_them() {
        let window = |sent_us, replied_us| TraceWindow { sent_us, replied_us };
        let mut bounds = None;
        // Sent at 1000, replied at 2000; the worker had it from 100 to 900 on its time line:
        // shifts from 900 to 1100 fit, and its clock's 950 is one of them.
        assert_eq!(window(1000.0, 2000.0).shift(&reply(950.0, 100.0, 900.0), &mut bounds), 950.0);
        assert_eq!(bounds, Some((900.0, 1100.0)));
        // A clock off by a millisecond: the nearest shift that fits.
        assert_eq!(window(1000.0, 2000.0).shift(&reply(-50.0, 100.0, 900.0), &mut bounds), 900.0);
        assert_eq!(window(1000.0, 2000.0).shift(&reply(5000.0, 100.0, 900.0), &mut bounds), 1100.0);
        // A later exchange narrows what fits: its run from 2100 to 2500, sent at 3050, replied
        // at 3700: shifts from 950 to 1200, and with the first, 950 to 1100.
        assert_eq!(window(3050.0, 3700.0).shift(&reply(0.0, 2100.0, 2500.0), &mut bounds), 950.0);
        assert_eq!(bounds, Some((950.0, 1100.0)));
        // One that fits none of the earlier ones (clocks at other rates) stands alone.
        assert_eq!(window(9000.0, 9100.0).shift(&reply(0.0, 4000.0, 4050.0), &mut bounds), 5000.0);
        assert_eq!(bounds, Some((5000.0, 5050.0)));
        // Times that are not numbers count as 0; the shift stays a number.
        let mut fresh = None;
        let shift = window(10.0, 20.0).shift(&reply(f64::NAN, f64::INFINITY, f64::NAN), &mut fresh);
        assert_eq!(shift, 10.0);
        assert_eq!(fresh, Some((10.0, 20.0)));
    }

    /// A worker's spans with times that are not a span's stay off the timeline.
    #[test]
    fn spans_with_times_that_are_not_numbers_are_left_out() {
        let span = |start_us, duration_us| crate::proto::TraceSpan { start_us, duration_us, ..Default::default() };
        assert_eq!(placed(&span(5.0, 2.0), 10.0), Some((15.0, 2.0)));
        assert_eq!(placed(&span(5.0, 0.0), -5.0), Some((0.0, 0.0)));
        for (start, duration) in
            [(f64::NAN, 1.0), (1.0, f64::INFINITY), (f64::NEG_INFINITY, 1.0), (1.0, -1.0), (f64::MAX, 0.0)]
        {
            let shift = if start == f64::MAX { f64::MAX } else { 0.0 };
            assert_eq!(placed(&span(start, duration), shift), None, "{start} {duration}");
        }
    }
}
