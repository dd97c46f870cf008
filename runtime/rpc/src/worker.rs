//! `dfc worker`: a gRPC server that runs the partitions of a registered plan that the driver
//! gives it, step by step, exchanging tensors with the other workers.
//!
//! One registration at a time (a new one replaces the old); runs of one worker are serialised
//! (they share the variables); pushes from other workers are taken at any time, also before
//! the step they belong to has started here. Every malformed or out-of-order call is an error
//! answer: a plan that does not decode or does not match its hash, a call naming another plan,
//! a program that was never prepared, a tensor whose bytes do not fit its type.

use crate::auth::{AddToken, CheckToken};
use crate::proto::worker_server::{Worker, WorkerServer};
use crate::proto::*;
use crate::rendezvous::{hosts_of, Algorithm, Client, NetRendezvous, Peers, Routes};
use crate::{plan_sha256, tensor, MAX_MESSAGE_BYTES};
use dfc_driver::{Backend, Session, SessionProgram, Stage};
use dfc_interp::{Data, Tensor};
use dfc_ir::Op;
use dfc_plan::Plan;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;
use tonic::{Request, Response, Status};

/// How a worker's data plane is set up, and how slowly it serves.
#[derive(Clone, Copy, Debug)]
pub struct DataPlane {
    /// The port it listens on (0: any free port), on the gRPC listener's address.
    pub port: u16,
    /// Whether to offer the workers this one sends to a queue in shared memory (taken by
    /// those on the same machine).
    pub shared_memory: bool,
    /// A delay before each run of a step (`dfc worker --delay-ms`): a straggler, for tests and
    /// experiments.
    pub step_delay: Duration,
}

impl Default for DataPlane {
    fn default() -> DataPlane {
        DataPlane { port: 0, shared_memory: true, step_delay: Duration::ZERO }
    }
}

/// Serves the worker API on `listener` until a `Shutdown` call; every call must carry `token`.
/// The data plane listens as `data` says, on the same address. Without TLS, `listener` must be
/// on loopback (see `crate::tls`).
pub async fn serve(
    listener: TcpListener,
    token: String,
    tls: Option<crate::Tls>,
    data: DataPlane,
) -> Result<(), String> {
    if tls.is_none() {
        crate::tls::plaintext_listener(listener.local_addr().map_err(|e| e.to_string())?)?;
    }
    let (stop, stopped) = tokio::sync::oneshot::channel();
    let hosts = Hosts { registered: Arc::new(Mutex::new(None)), benches: Arc::new(Mutex::new(HashMap::new())) };
    let data_port = serve_data(&listener, data.port, &token, tls.as_ref(), &hosts).await?;
    let service = WorkerService {
        token: token.clone(),
        tls: tls.clone(),
        hosts,
        stop: Arc::new(Mutex::new(Some(stop))),
        data_port,
        shared_memory: data.shared_memory,
        step_delay: data.step_delay,
    };
    let server = tonic::service::interceptor::InterceptedService::new(
        WorkerServer::new(service)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES),
        CheckToken::new(&token),
    );
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = &tls {
        builder = builder.tls_config(tls.server()).map_err(|e| format!("TLS: {e}"))?;
    }
    builder
        .initial_stream_window_size(Some(crate::STREAM_WINDOW))
        .initial_connection_window_size(Some(crate::CONNECTION_WINDOW))
        .max_frame_size(Some(crate::MAX_FRAME))
        .max_concurrent_streams(Some(crate::MAX_CALLS_PER_CONNECTION as u32))
        .concurrency_limit_per_connection(crate::MAX_CALLS_PER_CONNECTION)
        .http2_max_header_list_size(Some(crate::MAX_HEADER_BYTES))
        .http2_keepalive_interval(Some(crate::KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(crate::KEEPALIVE_TIMEOUT))
        .add_service(server)
        // Connections held to the deadline and caps of `crate::limits` until they prove the token.
        .serve_with_incoming_shutdown(crate::limits::incoming(listener), async {
            let _ = stopped.await;
        })
        .await
        .map_err(|e| format!("the worker's server failed: {e}"))
}

/// Starts the data plane on `port` of the gRPC listener's address; the port it listens on.
async fn serve_data(
    listener: &TcpListener,
    port: u16,
    token: &str,
    tls: Option<&crate::Tls>,
    hosts: &Hosts,
) -> Result<u32, String> {
    let ip = listener.local_addr().map_err(|e| e.to_string())?.ip();
    // tokio's listeners queue 1,024 connections for `accept` where the standard library's queue
    // 128: a burst of connections waits there rather than for the client's SYN to be sent again.
    let data =
        TcpListener::bind((ip, port)).await.map_err(|e| format!("cannot listen on data port {ip}:{port}: {e}"))?;
    let bound = data.local_addr().map_err(|e| e.to_string())?.port();
    let hosts = hosts.clone();
    let lookup: crate::data::Lookup = Arc::new(move |id: &[u8]| {
        let id = prost::bytes::Bytes::copy_from_slice(id);
        // A benchmark's first segment may come before this worker's own call has set it up.
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        loop {
            match hosts.host(&id) {
                Ok(host) => return Some(host as Arc<dyn crate::data::Deliver>),
                Err(_) if std::time::Instant::now() < deadline && hosts.registered_elsewhere(&id) => {
                    std::thread::sleep(Duration::from_millis(5))
                }
                Err(_) => return None,
            }
        }
    });
    crate::data::serve(data, token, tls.map(crate::Tls::data_server), lookup)?;
    Ok(u32::from(bound))
}

struct WorkerService {
    token: String,
    tls: Option<crate::Tls>,
    hosts: Hosts,
    stop: Arc<Mutex<Option<tokio::sync::oneshot::Sender<()>>>>,
    /// The data plane's port (0: none).
    data_port: u32,
    /// Whether the data plane offers shared-memory queues.
    shared_memory: bool,
    /// Slept before each run (`DataPlane::step_delay`).
    step_delay: Duration,
}

/// The registration and the benchmarks under way: what calls and data connections name.
#[derive(Clone)]
struct Hosts {
    registered: Arc<Mutex<Option<Arc<Registered>>>>,
    /// All-reduce benchmarks under way, by id.
    benches: Arc<Mutex<HashMap<prost::bytes::Bytes, Arc<StepHost>>>>,
}

/// A registered plan: its session (this worker's partitions), prepared programs and steps.
/// Dropping it (a new registration replaces it) frees the plan, its variables and its code.
struct Registered {
    sha256: prost::bytes::Bytes,
    running: Mutex<PlanSession>,
    host: Arc<StepHost>,
    turns: EndedTurns,
}

/// The turns of free-running replicas' Runs on a worker that serves several
/// (`RunRequest::turn`): the last turn whose Run ended here.
#[derive(Default)]
struct EndedTurns {
    ended: Mutex<u64>,
    changed: Condvar,
}

impl EndedTurns {
    /// Waits until the Run of turn `after` has ended here (`after` 0: none), as long as some
    /// Run ends here at least every `wait`.
    fn wait_for(&self, after: u64, wait: Duration) -> Result<(), String> {
        let mut ended = self.ended.lock().unwrap_or_else(|e| e.into_inner());
        while *ended < after {
            let before = *ended;
            let timeout;
            (ended, timeout) = self
                .changed
                .wait_timeout_while(ended, wait, |ended| *ended == before)
                .unwrap_or_else(|e| e.into_inner());
            if timeout.timed_out() && *ended == before {
                return Err(format!(
                    "waited {:.1}s for its turn, after turn {after}, but no Run ended here meanwhile (the last to end was turn {before})",
                    wait.as_secs_f64()
                ));
            }
        }
        Ok(())
    }

    /// Records that the Run of `turn` ended (on drop, so that a Run that fails or panics ends
    /// its turn too).
    fn end(&self, turn: u64) -> TurnEnds<'_> {
        TurnEnds { turns: self, turn }
    }
}

/// Ends a turn when dropped (`EndedTurns::end`).
struct TurnEnds<'t> {
    turns: &'t EndedTurns,
    turn: u64,
}

impl Drop for TurnEnds<'_> {
    fn drop(&mut self) {
        let mut ended = self.turns.ended.lock().unwrap_or_else(|e| e.into_inner());
        *ended = (*ended).max(self.turn);
        self.turns.changed.notify_all();
    }
}

self_cell::self_cell!(
    /// A registered plan and what runs it, which borrows it.
    struct PlanSession {
        owner: Plan,
        #[covariant]
        dependent: Running,
    }
);

/// What the steps of a registration (or a benchmark) meet through: where keys go, the other
/// workers, and the rendezvous of the steps under way (created by the first Run or Push of a
/// step, dropped when its Run ends).
struct StepHost {
    routes: Arc<Routes>,
    peers: Arc<Peers>,
    steps: Mutex<HashMap<u64, Arc<NetRendezvous>>>,
    wait: Duration,
}

struct Running<'p> {
    session: Session<'p>,
    programs: HashMap<u64, (SessionProgram, Vec<usize>, Stage)>,
}

impl StepHost {
    fn step(&self, step: u64) -> Arc<NetRendezvous> {
        let mut steps = self.steps.lock().unwrap_or_else(|e| e.into_inner());
        steps
            .entry(step)
            .or_insert_with(|| Arc::new(NetRendezvous::new(step, self.routes.clone(), self.peers.clone(), self.wait)))
            .clone()
    }

    fn finish(&self, step: u64) {
        self.steps.lock().unwrap_or_else(|e| e.into_inner()).remove(&step);
    }

    /// What the partitions wait for in the steps under way, longest first.
    fn waits(&self) -> Vec<crate::proto::Wait> {
        let steps: Vec<(u64, Arc<NetRendezvous>)> =
            self.steps.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|(s, r)| (*s, r.clone())).collect();
        let mut waits: Vec<crate::proto::Wait> = steps
            .iter()
            .flat_map(|(step, rendezvous)| {
                rendezvous.waits().into_iter().map(move |w| crate::proto::Wait {
                    step: *step,
                    key: w.key,
                    all_reduce: w.all_reduce,
                    from: w.from.map(|r| r as u32),
                    through_mpi: w.through_mpi,
                    seconds: w.since.elapsed().as_secs_f64(),
                })
            })
            .collect();
        waits.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
        waits
    }
}

impl crate::data::Deliver for StepHost {
    fn deliver_chunk(
        &self,
        step: u64,
        key: &str,
        total: u64,
        offset: u64,
        chunk: crate::data::Chunk,
    ) -> Result<(), String> {
        self.step(step).deliver_chunk(key, total, offset, chunk);
        Ok(())
    }

    fn place(&self, step: u64, key: &str, total: u64, offset: u64, len: u64) -> Option<crate::data::Placement> {
        self.step(step).place_ring_chunk(key, total, offset, len)
    }

    fn placed(&self, step: u64, key: &str, offset: u64, len: u64, ok: bool) {
        self.step(step).placed_ring_chunk(key, offset, len, ok);
    }

    fn chunk_timeout(&self) -> Duration {
        self.wait
    }
}

/// Clients of the workers at `addresses`, holding `token` (over TLS when `tls` is given).
fn clients(addresses: &[String], token: &str, tls: Option<&crate::Tls>) -> Result<Vec<Client>, Status> {
    let mut clients: Vec<Client> = Vec::with_capacity(addresses.len());
    for address in addresses {
        let channel = crate::tls::endpoint(address, tls).map_err(bad)?.connect_lazy();
        clients.push(
            crate::proto::worker_client::WorkerClient::with_interceptor(channel, AddToken::new(token))
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
        );
    }
    Ok(clients)
}

fn bad(message: impl Into<String>) -> Status {
    Status::invalid_argument(message.into())
}

impl Hosts {
    /// The registration or benchmark that `id` names.
    fn host(&self, id: &prost::bytes::Bytes) -> Result<Arc<StepHost>, Status> {
        if let Some(host) = self.benches.lock().unwrap_or_else(|e| e.into_inner()).get(id) {
            return Ok(host.clone());
        }
        self.current(id).map(|r| r.host.clone())
    }

    /// Whether `id` may name a benchmark not set up here yet (it names no registered plan).
    fn registered_elsewhere(&self, id: &[u8]) -> bool {
        self.registered.lock().unwrap_or_else(|e| e.into_inner()).as_ref().is_none_or(|r| r.sha256 != id)
    }

    fn current(&self, sha256: &[u8]) -> Result<Arc<Registered>, Status> {
        let registered = self.registered.lock().unwrap_or_else(|e| e.into_inner()).clone();
        match registered {
            None => Err(Status::failed_precondition("no plan is registered with this worker")),
            Some(r) if r.sha256 != sha256 => {
                Err(Status::failed_precondition("the call names another plan than the one registered (hash mismatch)"))
            }
            Some(r) => Ok(r),
        }
    }
}

impl WorkerService {
    fn current(&self, sha256: &[u8]) -> Result<Arc<Registered>, Status> {
        self.hosts.current(sha256)
    }

    fn host(&self, id: &prost::bytes::Bytes) -> Result<Arc<StepHost>, Status> {
        self.hosts.host(id)
    }

    /// Links to the data ports of the workers at `addresses` (in TLS with it), through shared
    /// memory where they can be unless `tcp_only`.
    fn links(
        &self,
        id: &[u8],
        rank: usize,
        addresses: &[String],
        data_ports: &[u32],
        tcp_only: bool,
    ) -> crate::data::Links {
        let shared_memory = self.shared_memory && !tcp_only;
        crate::data::Links::new(&self.token, id, rank, addresses, data_ports, shared_memory, self.tls.as_ref())
    }
}

/// Runs blocking work (a session's run, a plan's loading) off the async threads.
async fn blocking<T: Send + 'static>(work: impl FnOnce() -> Result<T, Status> + Send + 'static) -> Result<T, Status> {
    tokio::task::spawn_blocking(work).await.map_err(|e| Status::internal(format!("the work panicked: {e}")))?
}

#[tonic::async_trait]
impl Worker for WorkerService {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<RegisterReply>, Status> {
        let request = request.into_inner();
        if plan_sha256(&request.plan) != request.plan_sha256 {
            return Err(bad("the plan's bytes do not match its hash"));
        }
        let plan = dfc_plan::decode(&request.plan).map_err(|e| bad(format!("the plan does not load: {e}")))?;
        let n = request.workers.len();
        let rank = request.rank as usize;
        if rank >= n || request.names.len() != n {
            return Err(bad(format!("rank {rank} among {n} workers ({} names)", request.names.len())));
        }
        if request.partition_worker.len() != plan.partitions.len()
            || request.partition_worker.iter().any(|&w| w as usize >= n)
        {
            return Err(bad("every partition of the plan needs a worker among those given"));
        }
        let backend = match request.backend.as_str() {
            "llvm" => Backend::Llvm,
            "interp" => Backend::Interp,
            "grid-emulator" => Backend::GridEmulator,
            other => return Err(bad(format!("unknown backend `{other}`"))),
        };
        let worker_of: Vec<usize> = request.partition_worker.iter().map(|&w| w as usize).collect();
        let hosted: Vec<usize> = (0..plan.partitions.len()).filter(|&p| worker_of[p] == rank).collect();
        let mut routes = routes(&plan, &worker_of, rank);
        match Algorithm::from_wire_name(&request.all_reduce).map_err(bad)? {
            Algorithm::Ring => {}
            Algorithm::Hierarchical => routes.hosts = Some(hosts_of(&request.workers)),
            Algorithm::Mpi => {
                if crate::mpi::world() != Some((rank, n)) {
                    return Err(bad(format!(
                        "all-reduces through MPI need every worker to be a rank of one MPI job (rank {rank} of {n}; `dfc run --all-reduce mpi` under mpirun), but this worker is {}",
                        match crate::mpi::world() {
                            Some((r, size)) => format!("MPI's rank {r} of {size}"),
                            None => "not in an MPI job".into(),
                        }
                    )));
                }
                if plan.strategy.overlap {
                    return Err(bad(
                        "all-reduces through MPI run one at a time, in order: the plan overlaps them (--overlap)",
                    ));
                }
                if let Some((key, _)) = routes.reductions.iter().find(|(_, (_, local))| *local > 1) {
                    return Err(bad(format!(
                        "all-reduces through MPI need one replica per worker, but this worker holds several of `{key}`"
                    )));
                }
                routes.mpi = true;
            }
        }
        let routes = Arc::new(routes);
        let clients = clients(&request.workers, &self.token, self.tls.as_ref())?;
        let peers = Arc::new(Peers {
            clients,
            names: request.names.clone(),
            plan_sha256: request.plan_sha256.clone(),
            runtime: tokio::runtime::Handle::current(),
            links: self.links(&request.plan_sha256, rank, &request.workers, &request.data_ports, false),
            detached: Default::default(),
        });
        let wait = Duration::from_millis(request.wait_ms.max(1));
        let seed = request.seed;
        let sha256 = request.plan_sha256.clone();
        let count = hosted.len() as u32;
        let registered = blocking(move || {
            let running = PlanSession::try_new(plan, |plan| {
                let session = Session::hosting(plan, seed, backend, &hosted).map_err(|e| bad(e.to_string()))?;
                Ok::<_, Status>(Running { session, programs: HashMap::new() })
            })?;
            Ok(Registered {
                sha256,
                running: Mutex::new(running),
                host: Arc::new(StepHost { routes, peers, steps: Mutex::new(HashMap::new()), wait }),
                turns: EndedTurns::default(),
            })
        })
        .await?;
        *self.hosts.registered.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(registered));
        Ok(Response::new(RegisterReply { partitions: count }))
    }

    async fn prepare(&self, request: Request<PrepareRequest>) -> Result<Response<PrepareReply>, Status> {
        let request = request.into_inner();
        let registered = self.current(&request.plan_sha256)?;
        blocking(move || {
            let mut cell = registered.running.lock().unwrap_or_else(|e| e.into_inner());
            cell.with_dependent_mut(|_, running| {
                let fetches: Vec<&str> = request.fetches.iter().map(String::as_str).collect();
                let targets: Vec<&str> = request.targets.iter().map(String::as_str).collect();
                let stage = match request.stage {
                    0 => Stage::Whole,
                    1 => Stage::BeforeRecvs,
                    2 => Stage::AfterRecvs,
                    other => return Err(bad(format!("no stage {other}"))),
                };
                let program =
                    running.session.program_stage(&fetches, &targets, stage).map_err(|e| bad(e.to_string()))?;
                let provides = program.hosted_fetches();
                let reply = PrepareReply {
                    takes_part: !program.partitions().is_empty(),
                    inputs: program.inputs(),
                    provides: provides.iter().map(|&i| i as u32).collect(),
                    sends_to: program.sends_to().iter().map(|&p| p as u32).collect(),
                    receives_from: program.receives_from().iter().map(|&p| p as u32).collect(),
                };
                running.programs.insert(request.program, (program, provides, stage));
                Ok(Response::new(reply))
            })
        })
        .await
    }

    async fn run(&self, request: Request<RunRequest>) -> Result<Response<RunReply>, Status> {
        let arrived = std::time::Instant::now();
        let request = request.into_inner();
        let registered = self.current(&request.plan_sha256)?;
        let mut feeds = HashMap::new();
        for feed in &request.feeds {
            let tensor = feed.tensor.as_ref().ok_or_else(|| bad(format!("feed `{}` has no tensor", feed.name)))?;
            feeds.insert(feed.name.clone(), tensor::from_proto(tensor).map_err(bad)?);
        }
        if request.turn != 0 && request.after_turn >= request.turn {
            return Err(bad(format!("turn {} cannot come after turn {}", request.turn, request.after_turn)));
        }
        let delay = self.step_delay;
        blocking(move || {
            let step = request.step;
            std::thread::sleep(delay);
            // A free-running replica's Run on a server waits for its turn, and ends it.
            let _turn = if request.turn == 0 {
                None
            } else {
                let host = &registered.host;
                registered
                    .turns
                    .wait_for(request.after_turn, host.wait)
                    .map_err(|e| Status::aborted(format!("{}: {e}", host.peers.names[host.routes.rank])))?;
                Some(registered.turns.end(request.turn))
            };
            dfc_interp::trace::set_enabled(request.trace);
            let rendezvous = registered.host.step(step);
            let started = std::time::Instant::now();
            let (result, stage) = {
                let mut cell = registered.running.lock().unwrap_or_else(|e| e.into_inner());
                cell.with_dependent_mut(|_, running| {
                    let Running { session, programs } = running;
                    let (program, provides, stage) = programs.get(&request.program).ok_or_else(|| {
                        Status::failed_precondition(format!("program {} was not prepared", request.program))
                    })?;
                    // A server does not wait on a free-running replica it sends the variables.
                    rendezvous.detach_sends(*stage == Stage::BeforeRecvs);
                    let result = session.run_with(program, &feeds, &*rendezvous).map(|fetched| {
                        provides.iter().map(|&i| fetched[i].clone().expect("a hosted fetch")).collect::<Vec<Tensor>>()
                    });
                    Ok::<_, Status>((result, *stage))
                })?
            };
            // The step goes on in a later Run (its Recvs), which may wait for what this one sent
            // to this worker's own partitions.
            if stage != Stage::BeforeRecvs || result.is_err() {
                registered.host.finish(step);
            }
            // A traced run's spans leave with its reply, or are dropped with its failure, so
            // that none pile up on the worker.
            let spans = if request.trace { trace_spans() } else { Vec::new() };
            match result {
                Ok(fetched) => Ok(Response::new(RunReply {
                    fetched: fetched.iter().map(tensor::to_proto).collect(),
                    run_seconds: started.elapsed().as_secs_f64(),
                    exchange_seconds: rendezvous.exchange_seconds(),
                    spans,
                    trace_origin_unix_us: dfc_interp::trace::origin_unix_us(),
                    trace_arrived_us: dfc_interp::trace::micros_at(arrived),
                    trace_replied_us: dfc_interp::trace::now_us(),
                })),
                Err(error) => {
                    let host = &registered.host;
                    let reason = format!("{}: {error}", host.peers.names[host.routes.rank]);
                    if !matches!(error, dfc_driver::RunError::Interp(dfc_interp::InterpError::Aborted { .. })) {
                        host.peers.abort_others(host.routes.rank, step, &reason);
                    }
                    Err(Status::aborted(reason))
                }
            }
        })
        .await
    }

    async fn push(&self, request: Request<tonic::Streaming<TensorChunk>>) -> Result<Response<PushReply>, Status> {
        let mut stream = request.into_inner();
        let first = stream.message().await?.ok_or_else(|| bad("an empty push"))?;
        // A benchmark's first push may come before this worker's own call has set it up.
        let mut host = self.host(&first.plan_sha256);
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        while host.is_err()
            && std::time::Instant::now() < deadline
            && self.hosts.registered_elsewhere(&first.plan_sha256)
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
            host = self.host(&first.plan_sha256);
        }
        let host = host?;
        let ty = tensor::type_of(first.dtype, &first.dims).map_err(bad)?;
        let total = ty.size_in_bytes();
        if total > MAX_MESSAGE_BYTES {
            return Err(bad(format!("push of `{}`: a {ty} is larger than a message may be", first.key)));
        }
        let mut bytes = Vec::with_capacity(total);
        let (step, key) = (first.step, first.key.clone());
        let mut chunk = Some(first);
        while let Some(c) = chunk {
            if c.step != step || c.key != key || c.offset as usize != bytes.len() {
                return Err(bad(format!("push of `{key}`: a chunk out of order")));
            }
            if bytes.len() + c.data.len() > total {
                return Err(bad(format!("push of `{key}`: more bytes than a {ty}")));
            }
            bytes.extend_from_slice(&c.data);
            chunk = stream.message().await?;
        }
        if bytes.len() != total {
            return Err(bad(format!("push of `{key}`: {} bytes, not the {total} of a {ty}", bytes.len())));
        }
        let value = crate::rendezvous::Received::Bytes(ty, std::sync::Arc::new(bytes));
        host.step(step).deliver(&key, value).map_err(Status::already_exists)?;
        Ok(Response::new(PushReply {}))
    }

    async fn abort(&self, request: Request<AbortRequest>) -> Result<Response<AbortReply>, Status> {
        let request = request.into_inner();
        let host = self.host(&request.plan_sha256)?;
        dfc_interp::Rendezvous::abort(&*host.step(request.step), &request.reason);
        Ok(Response::new(AbortReply {}))
    }

    async fn get_variables(&self, request: Request<VariablesRequest>) -> Result<Response<VariablesReply>, Status> {
        let registered = self.current(&request.into_inner().plan_sha256)?;
        blocking(move || {
            let cell = registered.running.lock().unwrap_or_else(|e| e.into_inner());
            let variables = cell
                .borrow_dependent()
                .session
                .variables()
                .map_err(|e| Status::internal(format!("reading the variables: {e}")))?
                .iter()
                .map(|(name, value)| NamedTensor { name: name.clone(), tensor: Some(tensor::to_proto(value)) })
                .collect();
            Ok(Response::new(VariablesReply { variables }))
        })
        .await
    }

    async fn restore(&self, request: Request<RestoreRequest>) -> Result<Response<RestoreReply>, Status> {
        let request = request.into_inner();
        let registered = self.current(&request.plan_sha256)?;
        let mut saved = BTreeMap::new();
        for variable in &request.variables {
            let tensor = variable.tensor.as_ref().ok_or_else(|| bad(format!("`{}` has no tensor", variable.name)))?;
            saved.insert(variable.name.clone(), tensor::from_proto(tensor).map_err(bad)?);
        }
        blocking(move || {
            let mut cell = registered.running.lock().unwrap_or_else(|e| e.into_inner());
            cell.with_dependent_mut(|_, running| {
                running.session.restore(&saved, std::path::Path::new("the driver's checkpoint"))
            })
            .map_err(|e| bad(e.to_string()))?;
            Ok(Response::new(RestoreReply {}))
        })
        .await
    }

    async fn health(&self, _request: Request<HealthRequest>) -> Result<Response<HealthReply>, Status> {
        let registered = self.hosts.registered.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let waits = registered.as_ref().map(|r| r.host.waits()).unwrap_or_default();
        Ok(Response::new(HealthReply {
            plan_sha256: registered.map(|r| r.sha256.clone()).unwrap_or_default(),
            data_port: self.data_port,
            threads: rayon::current_num_threads() as u32,
            waits,
        }))
    }

    async fn bench_all_reduce(
        &self,
        request: Request<BenchAllReduceRequest>,
    ) -> Result<Response<BenchAllReduceReply>, Status> {
        let request = request.into_inner();
        let (n, rank) = (request.workers.len(), request.rank as usize);
        if rank >= n || request.names.len() != n || request.id.is_empty() {
            return Err(bad(format!("rank {rank} among {n} workers ({} names)", request.names.len())));
        }
        if request.bytes == 0
            || !request.bytes.is_multiple_of(4)
            || request.bytes > MAX_MESSAGE_BYTES as u64
            || request.iterations > 1000
        {
            return Err(bad(
                "the buffer is a whole number of f32 (at least one, at most 1 GiB), timed at most 1000 times",
            ));
        }
        let routes = Routes {
            rank,
            receiver: HashMap::new(),
            sender: HashMap::new(),
            reductions: HashMap::from([
                ("bench".to_string(), ((0..n).collect(), 1)),
                ("barrier".to_string(), ((0..n).collect(), 1)),
                ("barrier after".to_string(), ((0..n).collect(), 1)),
            ]),
            hosts: match Algorithm::from_wire_name(&request.all_reduce).map_err(bad)? {
                Algorithm::Ring => None,
                Algorithm::Hierarchical => Some(hosts_of(&request.workers)),
                Algorithm::Mpi => {
                    return Err(bad("MPI's all-reduce is benchmarked under mpirun: `dfc bench-allreduce --mpi`"))
                }
            },
            mpi: false,
        };
        let host_of = hosts_of(&request.workers);
        let peers = Peers {
            clients: clients(&request.workers, &self.token, self.tls.as_ref())?,
            names: request.names.clone(),
            plan_sha256: request.id.clone(),
            runtime: tokio::runtime::Handle::current(),
            links: self.links(&request.id, rank, &request.workers, &request.data_ports, request.tcp_only),
            detached: Default::default(),
        };
        let wait = Duration::from_millis(request.wait_ms.max(1));
        let host = Arc::new(StepHost {
            routes: Arc::new(routes),
            peers: Arc::new(peers),
            steps: Mutex::new(HashMap::new()),
            wait,
        });
        self.hosts.benches.lock().unwrap_or_else(|e| e.into_inner()).insert(request.id.clone(), host.clone());
        let benches = self.hosts.benches.clone();
        let id = request.id.clone();
        let result = blocking(move || {
            let elements = request.bytes as usize / 4;
            // Element i of worker r is (r + 1)·(i mod 1021 + 1), so that the sum, n(n + 1)/2 times
            // that factor (exact in f32), also shows any segment put in the wrong place.
            let factor = |i: usize| (i % 1021 + 1) as f32;
            let fill = |values: &mut [f32]| {
                values.iter_mut().enumerate().for_each(|(i, x)| *x = (rank + 1) as f32 * factor(i))
            };
            let total = (n * (n + 1) / 2) as f32;
            // One buffer throughout, refilled after each check: the time is the all-reduce's,
            // not the allocator's.
            let mut values = vec![0f32; elements];
            fill(&mut values);
            let mut value = Tensor::from_vec(vec![elements], values);
            let mut seconds = Vec::new();
            let links = &host.peers.links;
            let to_other_hosts =
                || -> u64 { (0..n).filter(|&r| host_of[r] != host_of[rank]).map(|r| links.bytes_sent(r)).sum() };
            let mut bytes_to_other_hosts = 0;
            for iteration in 0..=request.iterations as u64 {
                let rendezvous = host.step(iteration);
                // Every worker is done checking the last sum before any starts the next (they
                // share the cores).
                dfc_interp::Rendezvous::all_reduce(&*rendezvous, "barrier", n as u32, 0, Tensor::scalar(0f32))
                    .map_err(|e| Status::aborted(e.to_string()))?;
                let (started, sent_before) = (std::time::Instant::now(), to_other_hosts());
                let sum = dfc_interp::Rendezvous::all_reduce(&*rendezvous, "bench", n as u32, 0, value)
                    .map_err(|e| Status::aborted(e.to_string()))?;
                let elapsed = started.elapsed().as_secs_f64();
                if iteration > 0 {
                    bytes_to_other_hosts += to_other_hosts() - sent_before;
                }
                // And every worker is done with its timed all-reduce before any checks its sum:
                // a check takes a core for longer than the all-reduce.
                dfc_interp::Rendezvous::all_reduce(&*rendezvous, "barrier after", n as u32, 0, Tensor::scalar(0f32))
                    .map_err(|e| Status::aborted(e.to_string()))?;
                host.finish(iteration);
                let Data::F32(mut sum) = sum.data else {
                    return Err(Status::internal("the all-reduce changed the type"));
                };
                if let Some(i) =
                    (0..sum.len()).find(|&i| sum[i] != total * factor(i)).or((sum.len() != elements).then_some(0))
                {
                    return Err(Status::internal(format!(
                        "the all-reduce summed wrong: element {i} is {:?}, not {}",
                        sum.get(i),
                        total * factor(i)
                    )));
                }
                fill(&mut sum);
                value = Tensor::from_vec(vec![elements], sum);
                if iteration > 0 {
                    seconds.push(elapsed);
                }
            }
            let shared_memory = host.peers.links.is_shared((rank + 1) % n);
            Ok(Response::new(BenchAllReduceReply { seconds, shared_memory, bytes_to_other_hosts }))
        })
        .await;
        benches.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
        result
    }

    async fn shutdown(&self, _request: Request<ShutdownRequest>) -> Result<Response<ShutdownReply>, Status> {
        if let Some(stop) = self.stop.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = stop.send(());
        }
        Ok(Response::new(ShutdownReply {}))
    }
}

/// Where each key of `plan` goes, for the worker `rank` (partition p runs on `worker_of[p]`).
pub fn routes(plan: &Plan, worker_of: &[usize], rank: usize) -> Routes {
    let mut routes = Routes { rank, ..Routes::default() };
    let mut replicas: HashMap<String, Vec<usize>> = HashMap::new();
    for (p, partition) in plan.partitions.iter().enumerate() {
        let graph = &partition.module.graph;
        for id in graph.node_ids() {
            match &graph.node(id).op {
                Op::Recv { key, .. } => {
                    routes.receiver.insert(key.clone(), worker_of[p]);
                }
                Op::Send { key, .. } => {
                    routes.sender.insert(key.clone(), worker_of[p]);
                }
                Op::AllReduce { key, .. } => replicas.entry(key.clone()).or_default().push(worker_of[p]),
                _ => {}
            }
        }
    }
    for (key, workers) in replicas {
        let local = workers.iter().filter(|&&w| w == rank).count();
        let mut ranks = workers;
        ranks.sort_unstable();
        ranks.dedup();
        routes.reductions.insert(key, (ranks, local));
    }
    routes
}

/// The spans this worker recorded since it last sent them, for a traced Run's reply.
fn trace_spans() -> Vec<crate::proto::TraceSpan> {
    dfc_interp::trace::take()
        .into_iter()
        .map(|e| crate::proto::TraceSpan {
            track: e.track.to_string(),
            category: e.category.into_owned(),
            name: e.name.to_string(),
            start_us: e.start_us,
            duration_us: e.duration_us,
            bytes: e.bytes,
        })
        .collect()
}
