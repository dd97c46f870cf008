//! All-reduces overlapped with the computation (PyTorch DDP's and Horovod's overlap): a bucket
//! of gradients starts its all-reduce as soon as its last gradient is computed, on a
//! communication thread, while the backward pass computes the remaining gradients; the step
//! waits for the sums only where they are first used (the optimizer's update).
//!
//! Planning ([`hoist_all_reduces`], [`split_all_reduces`]) moves each all-reduce, with the
//! reshapes and concatenations that only feed it (tensor fusion's bucket), as early as its
//! operands allow, and splits it into a start and a wait. Running ([`CommThread`]) is one
//! thread per program that takes the started all-reduces in their order.
//!
//! Only the start moves earlier and only the wait later, and starting never blocks, so a
//! program that could not deadlock with its all-reduces in place cannot with them overlapped;
//! the all-reduces keep their order, so the replicas still meet them in one order. The last
//! all-reduce, which runs in place (nothing is left to overlap it with) and so blocks, stays
//! where the given order put it.

use crate::schedule::{Slot, Step};
use dfc_interp::{InterpError, Rendezvous, Tensor};
use dfc_ir::{Graph, NodeId, Op};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{mpsc, Arc};

/// `order` (a program's nodes, each once) with every all-reduce but the last (which runs in
/// place: see [`split_all_reduces`]) and every reshape or concatenation whose users all are
/// such nodes moved to just after its last operand; the all-reduces of one key (replicas in
/// one program) move together, and all-reduces keep their order among themselves.
pub fn hoist_all_reduces(graph: &Graph, order: &[NodeId]) -> Vec<NodeId> {
    let in_order: HashSet<NodeId> = order.iter().copied().collect();
    let key_of = |id: NodeId| match &graph.node(id).op {
        Op::AllReduce { key, .. } => Some(key.as_str()),
        _ => None,
    };
    let last_key = order.iter().rev().find_map(|&id| key_of(id));
    // The nodes to hoist, found from the last: their users are hoisted too.
    let mut hoisted: HashSet<NodeId> = HashSet::new();
    for &id in order.iter().rev() {
        let hoist = match graph.node(id).op {
            Op::AllReduce { .. } => key_of(id) != last_key,
            Op::Reshape { .. } | Op::Concat { .. } => {
                let users: Vec<NodeId> = graph.users(id).into_iter().filter(|u| in_order.contains(u)).collect();
                !users.is_empty() && users.iter().all(|u| hoisted.contains(u))
            }
            _ => false,
        };
        if hoist {
            hoisted.insert(id);
        }
    }
    if hoisted.is_empty() {
        return order.to_vec();
    }
    // Units: a hoisted node, or every all-reduce of one key.
    let mut units: Vec<Vec<NodeId>> = Vec::new();
    let mut unit_of_key: HashMap<&str, usize> = HashMap::new();
    // The all-reduce units in their order, which they keep.
    let mut reductions: Vec<usize> = Vec::new();
    for &id in order.iter().filter(|id| hoisted.contains(id)) {
        let unit = match &graph.node(id).op {
            Op::AllReduce { key, .. } => *unit_of_key.entry(key.as_str()).or_insert_with(|| {
                reductions.push(units.len());
                units.push(Vec::new());
                units.len() - 1
            }),
            _ => {
                units.push(Vec::new());
                units.len() - 1
            }
        };
        units[unit].push(id);
    }
    let preds = |id: NodeId| -> Vec<NodeId> {
        graph
            .inputs(id)
            .into_iter()
            .map(|t| t.node)
            .chain(graph.control_inputs(id))
            .filter(|p| in_order.contains(p))
            .collect()
    };
    // Per unit, its operands outside it not yet placed; per node, the units waiting on it.
    let mut pending: Vec<usize> = vec![0; units.len()];
    let mut waiting: HashMap<NodeId, Vec<usize>> = HashMap::new();
    for (u, members) in units.iter().enumerate() {
        let outside: HashSet<NodeId> =
            members.iter().flat_map(|&m| preds(m)).filter(|p| !members.contains(p)).collect();
        pending[u] = outside.len();
        for p in outside {
            waiting.entry(p).or_default().push(u);
        }
    }
    let mut placed: Vec<NodeId> = Vec::with_capacity(order.len());
    let mut ready: VecDeque<usize> = (0..units.len()).filter(|&u| pending[u] == 0).collect();
    let is_reduction: HashSet<usize> = reductions.iter().copied().collect();
    let mut reduction_ready = vec![false; units.len()];
    let mut next_reduction = 0;
    // Places `id`, and notes the units it was the last operand of.
    let place = |id: NodeId, placed: &mut Vec<NodeId>, pending: &mut [usize], ready: &mut VecDeque<usize>| {
        placed.push(id);
        for &u in waiting.get(&id).into_iter().flatten() {
            pending[u] -= 1;
            if pending[u] == 0 {
                ready.push_back(u);
            }
        }
    };
    let mut originals = order.iter().copied().filter(|id| !hoisted.contains(id));
    loop {
        // Every hoisted unit that can run now; an all-reduce only after the earlier ones.
        loop {
            let unit = if let Some(u) = ready.pop_front() {
                if is_reduction.contains(&u) {
                    reduction_ready[u] = true;
                    continue;
                }
                u
            } else if reductions.get(next_reduction).is_some_and(|&u| reduction_ready[u]) {
                next_reduction += 1;
                reductions[next_reduction - 1]
            } else {
                break;
            };
            for &id in &units[unit] {
                place(id, &mut placed, &mut pending, &mut ready);
            }
        }
        match originals.next() {
            Some(id) => place(id, &mut placed, &mut pending, &mut ready),
            None => break,
        }
    }
    // Units still pending would wait on something outside the order: keep the given order.
    if placed.len() != order.len() {
        return order.to_vec();
    }
    placed
}

/// `steps` with each all-reduce but the last overlapped: it starts where it stands, and an
/// `AllReduceWait` writes its sums just before the first step that touches one of them (or at
/// the end, for the fetches). The last runs in place, after the others' (nothing is left to
/// compute while it runs, and the hand-over to the thread and back would only add latency).
pub fn split_all_reduces(steps: Vec<Step>) -> Vec<Step> {
    let last = steps.iter().rposition(|s| matches!(s, Step::AllReduce { .. }));
    let mut out = Vec::with_capacity(steps.len() + 8);
    // Started all-reduces not yet waited for: their wait step and the slots it writes.
    let mut started: Vec<(Step, HashSet<Slot>)> = Vec::new();
    for (i, step) in steps.into_iter().enumerate() {
        let step = match step {
            Step::AllReduce { key, group_size, members, ty, overlapped: false } if Some(i) != last => {
                let outs: Vec<Slot> = members.iter().map(|m| m.2).collect();
                let wait = Step::AllReduceWait { key: key.clone(), outs: outs.clone(), ty: ty.clone() };
                started.push((wait, outs.into_iter().collect()));
                out.push(Step::AllReduce { key, group_size, members, ty, overlapped: true });
                continue;
            }
            step => step,
        };
        let (reads, writes) = step.reads_writes();
        let touched: Vec<Slot> = reads.into_iter().chain(writes).collect();
        let mut i = 0;
        while i < started.len() {
            if touched.iter().any(|s| started[i].1.contains(s)) {
                out.push(started.remove(i).0);
            } else {
                i += 1;
            }
        }
        out.push(step);
    }
    out.extend(started.into_iter().map(|(wait, _)| wait));
    out
}

/// One all-reduce handed to the communication thread: its key, per member of the program its
/// index, replica and value, the run's rendezvous, and the timeline track of its spans.
struct Job {
    key: String,
    group_size: u32,
    contributions: Vec<(usize, u32, Tensor)>,
    rendezvous: LentRendezvous,
    track: Arc<str>,
}

/// A run's rendezvous, lent to the communication thread for the run.
struct LentRendezvous(*const (dyn Rendezvous + 'static));

// SAFETY: `Rendezvous: Sync`, so the thread may use a shared reference to it; the pointer is
// dereferenced only while the run that lent it lasts (see `Communicator`).
unsafe impl Send for LentRendezvous {}

/// The sums of one all-reduce, per member index.
type Sums = Result<Vec<(usize, Tensor)>, InterpError>;

/// A program's communication thread, started by its first overlapped run and kept for the
/// next ones (a thread per run would cost its start and its stack's mapping every step). It
/// runs the all-reduces handed to it one after another, in their order.
pub struct CommThread {
    jobs: Option<mpsc::Sender<Job>>,
    sums: mpsc::Receiver<(String, Sums)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl CommThread {
    pub fn start() -> Result<CommThread, InterpError> {
        let (jobs, queue) = mpsc::channel::<Job>();
        let (done, sums) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("dfc-all-reduce".into())
            .spawn(move || {
                for job in queue {
                    // SAFETY: the run that lent the rendezvous waits for this job's sums
                    // before it ends (`Communicator`), so the rendezvous is alive.
                    let rendezvous = unsafe { &*job.rendezvous.0 };
                    let key = job.key.clone();
                    let track = job.track.clone();
                    let sums = dfc_interp::trace::on_track(&track, || {
                        let bytes: u64 = job.contributions.iter().map(|c| c.2.ty().size_in_bytes() as u64).sum();
                        let mut span = dfc_interp::trace::span("all_reduce", || format!("all_reduce {}", job.key));
                        if let Some(span) = span.as_mut() {
                            span.set_bytes(bytes);
                        }
                        reduce(rendezvous, job)
                    });
                    if done.send((key, sums)).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| InterpError::Aborted { reason: format!("cannot start the all-reduce thread: {e}") })?;
        Ok(CommThread { jobs: Some(jobs), sums, thread: Some(thread) })
    }
}

impl Drop for CommThread {
    fn drop(&mut self) {
        // Its queue closed, the thread ends after its current job (none: no run is under way).
        self.jobs = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// One run's use of the communication thread. It lends the run's rendezvous to the thread,
/// so it does not end (see its `Drop`) before every all-reduce it started has its sums.
pub(crate) struct Communicator<'run> {
    thread: &'run mut CommThread,
    rendezvous: &'run dyn Rendezvous,
    arrived: HashMap<String, Sums>,
    /// All-reduces started and not yet waited for.
    started: usize,
    track: Arc<str>,
}

impl<'run> Communicator<'run> {
    /// Spans of the thread go on the timeline's track of the calling thread, suffixed
    /// ` all-reduce`.
    pub(crate) fn new(thread: &'run mut CommThread, rendezvous: &'run dyn Rendezvous) -> Self {
        let track = Arc::from(format!("{} all-reduce", dfc_interp::trace::current_track()));
        Communicator { thread, rendezvous, arrived: HashMap::new(), started: 0, track }
    }

    /// Hands an all-reduce to the thread; never blocks.
    pub(crate) fn start(&mut self, key: &str, group_size: u32, contributions: Vec<(usize, u32, Tensor)>) {
        let lent: *const (dyn Rendezvous + '_) = self.rendezvous;
        type Lent = *const (dyn Rendezvous + 'static);
        // SAFETY: only the lifetime bound changes (same fat pointer); the thread uses the
        // rendezvous only until this run's `Communicator` has the job's sums (its `Drop`).
        let lent = unsafe { std::mem::transmute::<*const (dyn Rendezvous + '_), Lent>(lent) };
        let job = Job {
            key: key.to_string(),
            group_size,
            contributions,
            rendezvous: LentRendezvous(lent),
            track: self.track.clone(),
        };
        if let Some(jobs) = &self.thread.jobs {
            if jobs.send(job).is_ok() {
                self.started += 1;
                return;
            }
        }
        // A thread that is gone (it panicked) answers at once.
        let reason = format!("the all-reduce thread is gone; `{key}` was not reduced");
        self.arrived.insert(key.to_string(), Err(InterpError::Aborted { reason }));
    }

    /// Takes the sums of every all-reduce started so far, waiting for them: before an
    /// all-reduce in place, which must come after them, and before the run ends.
    pub(crate) fn drain(&mut self) {
        while self.started > 0 {
            match self.thread.sums.recv() {
                Ok((k, sums)) => {
                    self.started -= 1;
                    self.arrived.insert(k, sums);
                }
                Err(_) => self.started = 0,
            }
        }
    }

    /// The sums of the all-reduce of `key`, waiting for them.
    pub(crate) fn wait(&mut self, key: &str) -> Sums {
        loop {
            if let Some(sums) = self.arrived.remove(key) {
                return sums;
            }
            if self.started == 0 {
                return Err(InterpError::Aborted { reason: format!("the all-reduce of `{key}` was never started") });
            }
            match self.thread.sums.recv() {
                Ok((k, sums)) => {
                    self.started -= 1;
                    self.arrived.insert(k, sums);
                }
                Err(_) => self.started = 0,
            }
        }
    }

    /// Ends the run's use of the thread: a run that failed gives up the step first, so that
    /// the thread's pending all-reduces return instead of waiting for replicas that will not
    /// come.
    pub(crate) fn finish(self, failed: Option<&InterpError>) {
        if let Some(error) = failed {
            if self.started > 0 {
                self.rendezvous.abort(&error.to_string());
            }
        }
    }
}

impl Drop for Communicator<'_> {
    fn drop(&mut self) {
        if self.started > 0 && std::thread::panicking() {
            self.rendezvous.abort("a partition panicked");
        }
        self.drain();
    }
}

fn reduce(rendezvous: &dyn Rendezvous, mut job: Job) -> Sums {
    if job.contributions.len() == 1 {
        let (_, replica, value) = job.contributions.pop().expect("one contribution");
        return Ok(vec![(0, rendezvous.all_reduce(&job.key, job.group_size, replica, value)?)]);
    }
    dfc_interp::reduce_together(rendezvous, &job.key, job.group_size, job.contributions)
}
