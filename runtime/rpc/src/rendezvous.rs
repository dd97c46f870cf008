//! `NetRendezvous`: the rendezvous of one step on one worker, when the partitions of a plan run
//! on several workers.
//!
//! - Send: a key whose Recv runs on this worker is kept here; any other goes to the receiver's
//!   worker, where it waits for its Recv: on the data plane when that worker has a data port
//!   (one frame per 1 MiB, the key naming the tensor's type), else pushed over gRPC (`Push`,
//!   in chunks of `CHUNK_BYTES`).
//! - All-reduce: the replicas on this worker contribute here and are summed in replica order;
//!   then, when the group spans several workers, the last local replica to arrive runs the ring
//!   over them ([`ring`]: on the data plane, pipelined by chunks), or, where `Routes::hosts`
//!   asks for it and the workers sit on several hosts with as many on each, the hierarchical
//!   all-reduce ([`hierarchy`]: within hosts, then a ring between them), or, where it asks for
//!   MPI and the group is every worker, `MPI_Allreduce` (`crate::mpi`).
//! - Abort: from a failing partition here, or from another worker (`Abort`); every wait ends.

use crate::auth::AddToken;
use crate::data::{Chunk, Links};
use crate::proto::worker_client::WorkerClient;
use crate::proto::{self, TensorChunk};
use crate::{tensor, CHUNK_BYTES};
use dfc_interp::{InterpError, Rendezvous, Tensor};
use dfc_ir::{BinaryOp, Op, TensorType};
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

mod hierarchy;
mod ring;

pub use hierarchy::{host_groups, hosts_of, Algorithm};

pub type Client = WorkerClient<InterceptedService<Channel, AddToken>>;

/// Where each key of a plan goes, from one worker's point of view.
#[derive(Debug, Default)]
pub struct Routes {
    /// This worker's rank.
    pub rank: usize,
    /// The rank whose partition receives each Send key.
    pub receiver: HashMap<String, usize>,
    /// The rank whose partition sends each key, for the stall inspector's reports.
    pub sender: HashMap<String, usize>,
    /// Per all-reduce key: the ranks that hold replicas (ascending) and how many replicas this
    /// worker holds.
    pub reductions: HashMap<String, (Vec<usize>, usize)>,
    /// Each worker's host (by rank, [`hosts_of`]) where all-reduces go hierarchically across
    /// hosts; `None`: one flat ring.
    pub hosts: Option<Vec<usize>>,
    /// Whether all-reduces over every worker go through MPI (`crate::mpi`).
    pub mpi: bool,
}

/// Connections to the other workers of a run.
pub struct Peers {
    pub clients: Vec<Client>,
    pub names: Vec<String>,
    pub plan_sha256: prost::bytes::Bytes,
    pub runtime: tokio::runtime::Handle,
    /// The data plane's connections, for ring segments.
    pub links: Links,
    /// Sends handed over to a thread per destination rather than waited for.
    pub detached: DetachedSends,
}

/// Sends that a step hands over rather than waits for: a parameter server's first part of a
/// free-running replica's step, which sends the replica the variables. A thread per destination
/// sends them in order, so that a stopped replica holds up its own sends, not the server. A
/// driver's replica steps queue at most one step's worth per destination (a replica's next step
/// waits for the one before, which needs what was sent); whatever calls, no destination has
/// more than `MAX_DETACHED_BYTES` queued: past that, a send waits as any other does.
#[derive(Default)]
pub struct DetachedSends {
    queues: Mutex<HashMap<usize, DetachedQueue>>,
}

/// The bytes queued for one destination at most.
pub const MAX_DETACHED_BYTES: usize = 1 << 30;

struct DetachedQueue {
    jobs: std::sync::mpsc::Sender<DetachedSend>,
    /// Bytes queued and not yet sent.
    queued: Arc<std::sync::atomic::AtomicUsize>,
}

struct DetachedSend {
    step: u64,
    wire: String,
    bytes: Vec<u8>,
    timeout: Duration,
}

impl Peers {
    /// Queues `bytes` under the data plane's key `wire` for step `step` to worker `rank`;
    /// gives them back, for the caller to send and wait, where no sending thread can be started
    /// or `MAX_DETACHED_BYTES` are queued for that worker already.
    fn send_detached(
        self: &Arc<Self>,
        rank: usize,
        step: u64,
        wire: String,
        bytes: Vec<u8>,
        timeout: Duration,
    ) -> Result<(), Vec<u8>> {
        use std::sync::atomic::Ordering::Relaxed;
        let mut queues = self.detached.queues.lock().unwrap_or_else(|e| e.into_inner());
        if !queues.contains_key(&rank) {
            let (queue, jobs) = std::sync::mpsc::channel::<DetachedSend>();
            let queued = Arc::new(std::sync::atomic::AtomicUsize::new(0));
            // Weak: the thread ends with the registration that owns the queue, not the other way.
            let (peers, sent_bytes) = (Arc::downgrade(self), queued.clone());
            let started = std::thread::Builder::new().name(format!("dfc-send-{rank}")).spawn(move || {
                for job in jobs {
                    let Some(peers) = peers.upgrade() else { return };
                    let sent = peers.links.send(rank, job.step, &job.wire, &job.bytes, 0, job.bytes.len(), job.timeout);
                    sent_bytes.fetch_sub(job.bytes.len(), Relaxed);
                    // The replica's Recv times out and fails its step, naming the tensor; this
                    // says why on the sender's side.
                    if let Err(e) = sent {
                        eprintln!("dfc worker: step {}: {e}", job.step);
                    }
                }
            });
            if started.is_err() {
                return Err(bytes);
            }
            queues.insert(rank, DetachedQueue { jobs: queue, queued });
        }
        let queue = &queues[&rank];
        if queue.queued.load(Relaxed).saturating_add(bytes.len()) > MAX_DETACHED_BYTES {
            return Err(bytes);
        }
        queue.queued.fetch_add(bytes.len(), Relaxed);
        let job = DetachedSend { step, wire, bytes, timeout };
        queue.jobs.send(job).map_err(|e| {
            queue.queued.fetch_sub(e.0.bytes.len(), Relaxed);
            e.0.bytes
        })
    }

    /// Pushes `value` under `key` for step `step` to worker `rank`, in chunks; waits until it is
    /// delivered (not until it is received).
    pub fn push(&self, rank: usize, step: u64, key: &str, value: &Tensor, timeout: Duration) -> Result<(), String> {
        let bytes = prost::bytes::Bytes::from(value.to_le_bytes());
        self.push_bytes(rank, step, key, &value.ty(), bytes, timeout)
    }

    /// Pushes the little-endian bytes of a value of type `ty`.
    pub fn push_bytes(
        &self,
        rank: usize,
        step: u64,
        key: &str,
        ty: &TensorType,
        bytes: prost::bytes::Bytes,
        timeout: Duration,
    ) -> Result<(), String> {
        let dims: Vec<u64> = ty.shape.dims().iter().map(|&d| d as u64).collect();
        let dtype = tensor::dtype_code(ty.dtype);
        let chunks: Vec<TensorChunk> = (0..bytes.len().div_ceil(CHUNK_BYTES).max(1))
            .map(|c| {
                let (lo, hi) = (c * CHUNK_BYTES, ((c + 1) * CHUNK_BYTES).min(bytes.len()));
                TensorChunk {
                    plan_sha256: self.plan_sha256.clone(),
                    step,
                    key: key.to_string(),
                    dtype,
                    dims: if c == 0 { dims.clone() } else { Vec::new() },
                    offset: lo as u64,
                    // A view of the one buffer: no copy per chunk.
                    data: bytes.slice(lo..hi),
                }
            })
            .collect();
        let mut client = self.clients[rank].clone();
        let mut request = tonic::Request::new(tokio_stream::iter(chunks));
        request.set_timeout(timeout);
        self.runtime
            .block_on(client.push(request))
            .map(|_| ())
            .map_err(|status| format!("sending `{key}` to {}: {}", self.names[rank], status.message()))
    }

    /// Tells every other worker that step `step` is given up (best effort, not waited for).
    pub fn abort_others(&self, rank: usize, step: u64, reason: &str) {
        for (r, client) in self.clients.iter().enumerate() {
            if r == rank {
                continue;
            }
            let mut client = client.clone();
            let request =
                proto::AbortRequest { plan_sha256: self.plan_sha256.clone(), step, reason: reason.to_string() };
            self.runtime.spawn(async move {
                let mut request = tonic::Request::new(request);
                request.set_timeout(Duration::from_secs(5));
                let _ = client.abort(request).await;
            });
        }
    }
}

/// A value sent to this worker: a tensor from a partition here, or the bytes of one pushed by
/// another worker (turned into a tensor when a Recv takes it; a ring step adds them as they are;
/// shared, not copied, with each Recv of them: `Rendezvous::recv_bytes`).
#[derive(Clone)]
pub enum Received {
    Tensor(Tensor),
    Bytes(TensorType, Arc<Vec<u8>>),
}

impl Received {
    fn into_tensor(self) -> Result<Tensor, String> {
        match self {
            Received::Tensor(t) => Ok(t),
            Received::Bytes(ty, bytes) => {
                Tensor::from_le_bytes(&ty, &bytes).ok_or_else(|| format!("{} bytes do not hold a {ty}", bytes.len()))
            }
        }
    }

    fn into_bytes(self) -> Vec<u8> {
        match self {
            Received::Tensor(t) => t.to_le_bytes(),
            Received::Bytes(_, bytes) => Arc::try_unwrap(bytes).unwrap_or_else(|shared| shared.to_vec()),
        }
    }
}

/// The data-plane key of a tensor sent under `key`: `tensor <dtype code> <dims, comma-separated>
/// <key>`, so that the receiver knows its type before its Recv runs. (A ring segment's key ends
/// in `#<step>`, and no all-reduce key starts so.)
fn tensor_wire_key(key: &str, ty: &TensorType) -> String {
    let dims: Vec<String> = ty.shape.dims().iter().map(usize::to_string).collect();
    format!("tensor {} {} {key}", tensor::dtype_code(ty.dtype), dims.join(","))
}

/// The type and key of a tensor's data-plane key; `None` for any other key.
fn parse_tensor_wire_key(wire: &str) -> Option<Result<(TensorType, &str), String>> {
    let rest = wire.strip_prefix("tensor ")?;
    let mut parts = rest.splitn(3, ' ');
    let (Some(code), Some(dims), Some(key)) = (parts.next(), parts.next(), parts.next()) else {
        return Some(Err(format!("a tensor's data-plane key without a type: `{wire}`")));
    };
    let bad = || format!("a tensor's data-plane key with a malformed type: `{wire}`");
    let parsed = (|| {
        let code: u32 = code.parse().map_err(|_| bad())?;
        let dims: Vec<u64> = if dims.is_empty() {
            Vec::new()
        } else {
            dims.split(',').map(|d| d.parse().map_err(|_| bad())).collect::<Result<_, _>>()?
        };
        tensor::type_of(code, &dims)
    })();
    Some(parsed.map(|ty| (ty, key)))
}

/// The bytes of a tensor of type `ty`, if they can be counted.
fn byte_len(ty: &TensorType) -> Option<usize> {
    ty.shape.dims().iter().try_fold(ty.dtype.size_in_bytes(), |bytes, &d| bytes.checked_mul(d))
}

#[derive(Default)]
struct State {
    /// Values sent to this worker (locally or pushed), by key.
    received: HashMap<String, Received>,
    aborted: Option<String>,
    reductions: HashMap<String, LocalReduction>,
    /// Chunks of ring segments from the data plane that came before their ring was under way
    /// here, by key: (the segment's bytes, the chunk's offset, the chunk).
    early: ring::EarlyChunks,
    /// The all-reduces under way here on the data plane, by key.
    rings: HashMap<String, ring::RingProgress>,
    /// Tensors arriving on the data plane in several chunks, by key: their bytes so far and how
    /// many have come.
    assembling: HashMap<String, (Vec<u8>, usize)>,
}

#[derive(Default)]
struct LocalReduction {
    contributions: Vec<(u32, Tensor)>,
    sum: Option<Result<Tensor, String>>,
}

pub struct NetRendezvous {
    step: u64,
    routes: Arc<Routes>,
    peers: Arc<Peers>,
    state: Mutex<State>,
    changed: Condvar,
    wait: Duration,
    /// Nanoseconds spent in exchanges, summed over the partitions.
    exchanging: std::sync::atomic::AtomicU64,
    /// What the partitions wait for now, for `Health` (the stall inspector): by an id each.
    waits: Mutex<Vec<(u64, Wait)>>,
    next_wait: std::sync::atomic::AtomicU64,
    /// Whether the run under way hands its sends to other workers over (`Peers::detached`).
    detach_sends: std::sync::atomic::AtomicBool,
}

/// A wait of one of this worker's partitions within a step.
#[derive(Clone, Debug)]
pub struct Wait {
    /// The tensor's key, or the all-reduce's.
    pub key: String,
    pub all_reduce: bool,
    /// The worker it waits for: a tensor's sender, the previous worker of an all-reduce's ring;
    /// `None` for this worker's own replicas.
    pub from: Option<usize>,
    /// An all-reduce inside MPI's library, which waits on every rank.
    pub through_mpi: bool,
    pub since: std::time::Instant,
}

/// Removes its wait from the list when the wait ends.
struct Waiting<'a> {
    rendezvous: &'a NetRendezvous,
    id: u64,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.rendezvous.waits.lock().unwrap_or_else(|e| e.into_inner()).retain(|(id, _)| *id != self.id);
    }
}

impl NetRendezvous {
    pub fn new(step: u64, routes: Arc<Routes>, peers: Arc<Peers>, wait: Duration) -> NetRendezvous {
        NetRendezvous {
            step,
            routes,
            peers,
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            wait,
            exchanging: Default::default(),
            waits: Mutex::new(Vec::new()),
            next_wait: Default::default(),
            detach_sends: Default::default(),
        }
    }

    /// Whether the run about to start hands its sends to other workers over to a thread per
    /// destination instead of waiting until each is delivered: for the part of a free-running
    /// replica's step that a parameter server runs before the replica's gradients come.
    pub fn detach_sends(&self, detach: bool) {
        self.detach_sends.store(detach, std::sync::atomic::Ordering::Relaxed);
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A value pushed by another worker (or sent by a partition here).
    pub fn deliver(&self, key: &str, value: Received) -> Result<(), String> {
        let mut state = self.lock();
        if state.received.contains_key(key) {
            return Err(format!("`{key}` was sent twice in step {}", self.step));
        }
        state.received.insert(key.to_string(), value);
        drop(state);
        self.changed.notify_all();
        Ok(())
    }

    /// A chunk from the data plane: of a tensor sent here, or of a ring segment.
    pub fn deliver_chunk(&self, wire: &str, total: u64, offset: u64, chunk: Chunk) {
        match parse_tensor_wire_key(wire) {
            None => self.deliver_ring_chunk(wire, total, offset, chunk),
            Some(tensor) => {
                if let Err(reason) =
                    tensor.and_then(|(ty, key)| self.deliver_tensor_chunk(&ty, key, total, offset, chunk))
                {
                    self.abort(&reason);
                }
            }
        }
    }

    /// A chunk of a tensor of type `ty` sent under `key`: delivered once all its bytes are here.
    fn deliver_tensor_chunk(
        &self,
        ty: &TensorType,
        key: &str,
        total: u64,
        offset: u64,
        chunk: Chunk,
    ) -> Result<(), String> {
        let bytes = byte_len(ty).filter(|&b| b as u64 == total);
        let Some(total) = bytes else {
            return Err(format!("`{key}` came as {total} bytes, which do not hold a {ty}"));
        };
        let (offset, part) = (offset as usize, chunk.as_slice());
        if offset == 0 && part.len() == total {
            return self.deliver(key, Received::Bytes(ty.clone(), Arc::new(part.to_vec())));
        }
        let mut state = self.lock();
        let (buffer, filled) = state.assembling.entry(key.to_string()).or_insert_with(|| (vec![0; total], 0));
        // The data plane checked that the chunk lies within `total` bytes.
        if buffer.len() != total || *filled + part.len() > total {
            return Err(format!("`{key}`: chunks that do not add up to one {ty}"));
        }
        buffer[offset..offset + part.len()].copy_from_slice(part);
        *filled += part.len();
        if *filled < total {
            return Ok(());
        }
        let (buffer, _) = state.assembling.remove(key).expect("assembling");
        drop(state);
        self.deliver(key, Received::Bytes(ty.clone(), Arc::new(buffer)))
    }

    /// Notes that a partition waits for `key` from worker `from` until the result is dropped.
    fn waiting(&self, key: &str, all_reduce: bool, from: Option<usize>) -> Waiting<'_> {
        self.note_wait(Wait {
            key: key.to_string(),
            all_reduce,
            from,
            through_mpi: false,
            since: std::time::Instant::now(),
        })
    }

    /// Notes `wait` until the result is dropped.
    fn note_wait(&self, wait: Wait) -> Waiting<'_> {
        let id = self.next_wait.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.waits.lock().unwrap_or_else(|e| e.into_inner()).push((id, wait));
        Waiting { rendezvous: self, id }
    }

    /// What this step's partitions wait for now.
    pub fn waits(&self) -> Vec<Wait> {
        self.waits.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|(_, w)| w.clone()).collect()
    }

    fn wait_for<T>(&self, key: &str, ready: impl FnMut(&mut State) -> Option<T>) -> Result<T, InterpError> {
        dfc_interp::wait_on(&self.changed, self.lock(), key, self.wait, |state| state.aborted.clone(), ready)
    }

    fn fail(&self, reason: String) -> InterpError {
        self.abort(&reason);
        InterpError::Aborted { reason }
    }
}

/// Exchanges as the partitions call them, timed (see [`NetRendezvous::exchange_seconds`]).
impl Rendezvous for NetRendezvous {
    fn send(&self, key: &str, value: Tensor) -> Result<(), InterpError> {
        self.timed(|| self.send_now(key, value))
    }

    fn recv(&self, key: &str) -> Result<Tensor, InterpError> {
        self.timed(|| self.recv_now(key))
    }

    fn send_bytes(&self, key: &str, ty: &TensorType, bytes: &[u8]) -> Result<(), InterpError> {
        self.timed(|| self.send_bytes_now(key, ty, bytes))
    }

    fn recv_bytes(&self, key: &str) -> Result<(TensorType, Arc<Vec<u8>>), InterpError> {
        self.timed(|| match self.received(key)? {
            Received::Bytes(ty, bytes) => Ok((ty, bytes)),
            Received::Tensor(value) => Ok((value.ty(), Arc::new(value.to_le_bytes()))),
        })
    }

    fn all_reduce(&self, key: &str, group_size: u32, replica: u32, value: Tensor) -> Result<Tensor, InterpError> {
        self.timed(|| self.all_reduce_now(key, group_size, replica, value))
    }

    fn all_reduce_in_place(
        &self,
        key: &str,
        group_size: u32,
        replica: u32,
        ty: &TensorType,
        bytes: &mut [u8],
    ) -> Result<(), InterpError> {
        if !self.rings_alone(key) {
            return dfc_interp::all_reduce_through_copies(self, key, group_size, replica, ty, bytes);
        }
        self.timed(|| {
            if let Some(reason) = &self.lock().aborted {
                return Err(InterpError::Aborted { reason: reason.clone() });
            }
            let (ranks, _) = &self.routes.reductions[key];
            if ranks.len() == 1 {
                return Ok(());
            }
            let me = ranks.iter().position(|&r| r == self.routes.rank).unwrap_or(0);
            let _waiting = self.waiting(key, true, Some(ranks[(me + ranks.len() - 1) % ranks.len()]));
            self.ring_in_place(key, ranks, ty, bytes)
        })
    }

    fn abort(&self, reason: &str) {
        let mut state = self.lock();
        if state.aborted.is_none() {
            state.aborted = Some(reason.to_string());
        }
        drop(state);
        self.changed.notify_all();
    }
}

impl NetRendezvous {
    /// Seconds the partitions of this step have spent in exchanges so far (summed over them).
    pub fn exchange_seconds(&self) -> f64 {
        self.exchanging.load(std::sync::atomic::Ordering::Relaxed) as f64 * 1e-9
    }

    fn timed<T>(&self, exchange: impl FnOnce() -> T) -> T {
        let started = std::time::Instant::now();
        let result = exchange();
        let nanos = started.elapsed().as_nanos().min(u64::MAX as u128) as u64;
        self.exchanging.fetch_add(nanos, std::sync::atomic::Ordering::Relaxed);
        result
    }

    fn send_now(&self, key: &str, value: Tensor) -> Result<(), InterpError> {
        if let Some(reason) = &self.lock().aborted {
            return Err(InterpError::Aborted { reason: reason.clone() });
        }
        match self.routes.receiver.get(key) {
            Some(&rank) if rank != self.routes.rank && self.peers.links.reaches(rank) => {
                let wire = tensor_wire_key(key, &value.ty());
                let mut value = value;
                if self.detach_sends.load(std::sync::atomic::Ordering::Relaxed) {
                    let bytes = value.to_le_bytes();
                    let Err(bytes) = self.peers.send_detached(rank, self.step, wire.clone(), bytes, self.wait) else {
                        return Ok(());
                    };
                    return self.send_on_link(rank, &wire, &bytes);
                }
                match value.le_bytes_mut() {
                    Some(bytes) => self.send_on_link(rank, &wire, bytes),
                    None => self.send_on_link(rank, &wire, &value.to_le_bytes()),
                }
            }
            Some(&rank) if rank != self.routes.rank => {
                self.peers.push(rank, self.step, key, &value, self.wait).map_err(|e| self.fail(e))
            }
            Some(_) => self
                .deliver(key, Received::Tensor(value))
                .map_err(|message| InterpError::RendezvousConflict { key: key.to_string(), message }),
            None => Err(InterpError::RendezvousConflict {
                key: key.to_string(),
                message: "no partition of the plan receives it".into(),
            }),
        }
    }

    fn recv_now(&self, key: &str) -> Result<Tensor, InterpError> {
        self.received(key)?
            .into_tensor()
            .map_err(|message| InterpError::RendezvousConflict { key: key.to_string(), message })
    }

    /// The value sent under `key`, once it is here. It stays for the step's other Recvs of it
    /// (a partition run in stages receives some values in each).
    fn received(&self, key: &str) -> Result<Received, InterpError> {
        let _waiting = self.waiting(key, false, self.routes.sender.get(key).copied());
        self.wait_for(key, |state| state.received.get(key).cloned())
    }

    /// `bytes` onto the data plane to worker `rank` under `wire`.
    fn send_on_link(&self, rank: usize, wire: &str, bytes: &[u8]) -> Result<(), InterpError> {
        self.peers.links.send(rank, self.step, wire, bytes, 0, bytes.len(), self.wait).map_err(|e| self.fail(e))
    }

    /// [`Rendezvous::send_bytes`]: the bytes as they are onto the data plane, where the value
    /// goes there and now (not handed over to a thread); else through a tensor.
    fn send_bytes_now(&self, key: &str, ty: &TensorType, bytes: &[u8]) -> Result<(), InterpError> {
        let fail = || self.fail(format!("send `{key}` of {ty}: given {} bytes", bytes.len()));
        if Some(bytes.len()) != byte_len(ty) {
            return Err(fail());
        }
        let detached = self.detach_sends.load(std::sync::atomic::Ordering::Relaxed);
        match self.routes.receiver.get(key) {
            Some(&rank) if rank != self.routes.rank && self.peers.links.reaches(rank) && !detached => {
                if let Some(reason) = &self.lock().aborted {
                    return Err(InterpError::Aborted { reason: reason.clone() });
                }
                self.send_on_link(rank, &tensor_wire_key(key, ty), bytes)
            }
            _ => self.send_now(key, Tensor::from_le_bytes(ty, bytes).ok_or_else(fail)?),
        }
    }

    /// Whether the all-reduce `key` is this worker's alone among its replicas and runs as a flat
    /// ring (or over this worker alone): then it may reduce in the caller's memory.
    fn rings_alone(&self, key: &str) -> bool {
        let Some((ranks, local)) = self.routes.reductions.get(key) else { return false };
        let through_mpi = self.routes.mpi && ranks.len() > 1 && ranks.len() == self.peers.names.len();
        let hierarchical = self.routes.hosts.as_deref().and_then(|hosts| host_groups(ranks, hosts)).is_some();
        *local == 1 && !through_mpi && !hierarchical
    }

    fn all_reduce_now(&self, key: &str, _group_size: u32, replica: u32, value: Tensor) -> Result<Tensor, InterpError> {
        let Some((ranks, local)) = self.routes.reductions.get(key) else {
            return Err(InterpError::RendezvousConflict { key: key.to_string(), message: "no such all-reduce".into() });
        };
        let mut state = self.lock();
        if let Some(reason) = &state.aborted {
            return Err(InterpError::Aborted { reason: reason.clone() });
        }
        let reduction = state.reductions.entry(key.to_string()).or_default();
        reduction.contributions.push((replica, value));
        if reduction.contributions.len() == *local {
            // The last local replica sums them in replica order, then runs the ring.
            let mut parts = std::mem::take(&mut reduction.contributions);
            drop(state);
            parts.sort_by_key(|(replica, _)| *replica);
            let mut parts = parts.into_iter().map(|(_, t)| t);
            let mut sum = parts.next().expect("at least one local replica");
            for part in parts {
                sum = dfc_interp::eval(&Op::Binary(BinaryOp::Add), &[&sum, &part])
                    .map_err(|e| self.fail(format!("all-reduce `{key}`: {e}")))?;
            }
            let hosts = self.routes.hosts.as_deref().and_then(|hosts| host_groups(ranks, hosts));
            let result = if self.routes.mpi && ranks.len() > 1 && ranks.len() == self.peers.names.len() {
                let now = std::time::Instant::now();
                let wait = Wait { key: key.to_string(), all_reduce: true, from: None, through_mpi: true, since: now };
                let _waiting = self.note_wait(wait);
                let started = std::time::Instant::now();
                let mut sum = sum;
                crate::mpi::all_reduce(&mut sum)
                    .map_err(|e| self.fail(format!("all-reduce `{key}` through MPI: {e}")))?;
                let bytes = byte_len(&sum.ty()).unwrap_or(0) as u64;
                dfc_interp::trace::record_span(
                    "all_reduce",
                    || format!("MPI {key}"),
                    started,
                    std::time::Instant::now(),
                    Some(bytes),
                );
                Ok(sum)
            } else if let Some(hosts) = hosts {
                self.hierarchical(key, &hosts, sum)
            } else if ranks.len() > 1 {
                // The ring waits, in the end, for the worker before this one.
                let me = ranks.iter().position(|&r| r == self.routes.rank).unwrap_or(0);
                let _waiting = self.waiting(key, true, Some(ranks[(me + ranks.len() - 1) % ranks.len()]));
                self.ring(key, ranks, sum)
            } else {
                Ok(sum)
            };
            if *local == 1 {
                return result;
            }
            // The other local replicas take copies.
            let mut state = self.lock();
            state.reductions.entry(key.to_string()).or_default().sum = Some(match &result {
                Ok(sum) => Ok(sum.clone()),
                Err(e) => Err(e.to_string()),
            });
            drop(state);
            self.changed.notify_all();
            return result;
        }
        drop(state);
        let _waiting = self.waiting(key, true, None);
        self.wait_for(key, |state| state.reductions.get(key).and_then(|r| r.sum.clone()))?
            .map_err(|reason| InterpError::Aborted { reason })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dfc_ir::DType;

    /// Worker 0 of 2 (whose peer is never reached) in step 0, waiting up to `wait`.
    pub(super) fn worker_of_two(wait: Duration) -> (tokio::runtime::Runtime, NetRendezvous) {
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let names = vec!["127.0.0.1:1".to_string(), "127.0.0.1:2".to_string()];
        let peers = Peers {
            clients: Vec::new(),
            links: crate::data::Links::new("token", b"run", 0, &names, &[0, 0], false, None),
            names,
            plan_sha256: Default::default(),
            runtime: runtime.handle().clone(),
            detached: Default::default(),
        };
        let rendezvous = NetRendezvous::new(0, Arc::new(Routes::default()), Arc::new(peers), wait);
        (runtime, rendezvous)
    }

    #[test]
    fn a_value_received_is_shared_by_its_receives_and_never_sent_again() {
        let (_runtime, rendezvous) = worker_of_two(Duration::from_secs(30));
        let ty = TensorType::new(DType::F32, vec![2]);
        let bytes: Vec<u8> = [1.5f32, -2.0].iter().flat_map(|x| x.to_le_bytes()).collect();
        rendezvous.deliver("k", Received::Bytes(ty.clone(), Arc::new(bytes.clone()))).unwrap();
        let (found, first) = rendezvous.recv_bytes("k").unwrap();
        assert_eq!((&found, first.as_slice()), (&ty, bytes.as_slice()));
        let (_, again) = rendezvous.recv_bytes("k").unwrap();
        assert!(Arc::ptr_eq(&first, &again), "the bytes as they came, not a copy");
        assert_eq!(rendezvous.recv("k").unwrap().to_le_bytes(), bytes);
        let resent = rendezvous.deliver("k", Received::Bytes(ty.clone(), Arc::new(bytes))).unwrap_err();
        assert!(resent.contains("sent twice"), "{resent}");

        // A tensor sent here by a partition of this worker comes as its bytes too.
        let value = Tensor::from_le_bytes(&ty, &[0, 0, 64, 64, 0, 0, 128, 64]).unwrap();
        rendezvous.deliver("t", Received::Tensor(value.clone())).unwrap();
        let (found, got) = rendezvous.recv_bytes("t").unwrap();
        assert_eq!((found, got.to_vec()), (ty, value.to_le_bytes()));
    }

    #[test]
    fn a_tensors_data_plane_key_carries_its_type() {
        for ty in [
            TensorType::new(DType::F32, vec![64, 784]),
            TensorType::new(DType::I32, Vec::<usize>::new()),
            TensorType::new(DType::U8, vec![0, 3]),
        ] {
            let key = "/job:worker/task:0/cpu:0;replica_1/x;/job:worker/task:1/cpu:0";
            let wire = tensor_wire_key(key, &ty);
            assert_eq!(parse_tensor_wire_key(&wire), Some(Ok((ty.clone(), key))), "{wire}");
        }
        assert_eq!(parse_tensor_wire_key("gradients/all_reduce#3"), None, "a ring segment's key");
        for malformed in ["tensor ", "tensor 0 64", "tensor x 64 k", "tensor 0 6x4 k", "tensor 99 1 k"] {
            assert!(matches!(parse_tensor_wire_key(malformed), Some(Err(_))), "{malformed}");
        }
        let huge = format!("tensor 0 {},{} k", u64::MAX, 2);
        assert!(matches!(parse_tensor_wire_key(&huge), Some(Err(_))), "an impossible size");
    }
}
