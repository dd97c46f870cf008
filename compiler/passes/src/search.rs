//! Placement search: the `model` strategy's compute and variables spread over the devices by
//! trying moves and keeping those that shorten the simulated step (`--model-placement
//! searched`, and `--strategy auto`'s model candidates).
//!
//! The unit of a move is a colocation group (a variable with its reads, updates and slots; a
//! compute node alone). A `Problem` holds what a step costs under any assignment of the units:
//! each node's time (the cost model's, from the profile where it has one), each edge's transfer
//! time over each kind of link, and which devices share an executor (with a profile, a task's
//! devices share its process's cores).
//!
//! A placement is scored by the list schedule `cost::estimate_on` runs on the partitions, run
//! on the unpartitioned graph: an executor that is free starts its ready node that comes first
//! in creation order; an input from another device arrives its transfer's time after it is
//! done (a Recv) without occupying an executor; a control edge between devices waits for a
//! dummy on the producer's executor, after the nodes ready there, and a constant for a copy on
//! its user's (as `partition` builds them). On the round-robin and earliest-finish placements
//! the two agree to the microsecond. They part where a partition's own topological order (the
//! report's priority) ranks a node that waits on a Recv later than creation order does, since
//! the Recv is created last: on searched placements the report is up to 30% slower. Every trial
//! is simulated from the start (a schedule's buffers are kept between trials): 7,000–12,000 a
//! second on a thousand-node graph on one core of this project's VMs. Resuming a trial from a
//! checkpoint of the accepted schedule was tried and does not pay: three trials in four move
//! a node that is ready at the start (a variable), takes an input done at the start, or waits
//! for a constant's copy (which its device runs at its first idle moment), so they part from
//! the accepted schedule at its first instant, and the rest saved less than the checkpoints
//! cost (6% of the trials' instructions against 10% for the accepted schedules'). Cutting a
//! trial short once it must end past the accepted step (its executor's work left, or its
//! longest chain of users, past it) was tried too: half the trials were cut, but late, 10% of
//! the events saved on the 1,211-node model, less than the bound's bookkeeping cost.
//!
//! The search is a descent: from a starting assignment (the earliest-finish-time placement,
//! and round-robin), every movable unit, the costliest first, tries each device it may use (on
//! a large cluster: its neighbours' devices and the least-loaded ones), alone and with its
//! neighbours on its device, and keeps the first move that shortens the step (or, at an equal
//! step, ends the work sooner: a smaller sum of finishing times); passes repeat until one
//! changes nothing or the `Budget` is spent. A unit's moves are scored on every core, each
//! thread taking the next in order, and the first better one kept: the outcome is the
//! one-thread search's, found about 1.6 times as fast on two cores.

use crate::cost::{self, CostModel};
use dfc_ir::{DeviceSpec, Graph, NodeId, Op};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError, RwLock};
use std::time::Instant;

/// Beyond this many devices a unit tries its neighbours' devices and the least-loaded ones,
/// not every device.
const ALL_DEVICES_UP_TO: usize = 16;

/// The most threads a search scores its moves on: a unit tries 2 × 7 moves at most on 8
/// devices, about as many on a larger cluster.
const MAX_THREADS: usize = 8;

/// The least-loaded devices a unit also tries on a large cluster.
const IDLE_CANDIDATES: usize = 4;

pub use crate::cost::Link;

/// An input of a node: the position of its producer and what moving it costs over each link.
#[derive(Clone, Copy, Debug)]
struct Edge {
    from: u32,
    seconds: [f32; 4],
    kind: EdgeKind,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum EdgeKind {
    Data,
    /// An order without a tensor: between devices, `partition` carries it by a dummy scalar
    /// that runs on the producer's device after the nodes ready before it.
    Control,
    /// A constant's value, which `partition` copies to a user on another device: the copy
    /// runs there after the nodes ready before it.
    Constant,
}

/// One step's costs under any assignment of units to devices.
#[derive(Clone, Debug)]
pub struct Problem {
    /// By position in the topological order: the node's time, its unit, its inputs' range.
    seconds: Vec<f64>,
    unit: Vec<u32>,
    edge_start: Vec<u32>,
    edges: Vec<Edge>,
    /// By position: which of an executor's ready nodes it runs first (lowest first): the
    /// node's place in creation order, which is how a partition's own topological order
    /// (`Graph::topo_order`, smallest id first among the ready) ranks the nodes it holds.
    priority: Vec<u32>,
    /// By position: its users' range in `user_edges`, each (user, edge).
    user_start: Vec<u32>,
    user_edges: Vec<(u32, u32)>,
    /// By unit: its first position, the devices it may use (empty: any), its total time, and
    /// the units it exchanges tensors with.
    first: Vec<u32>,
    /// By unit: its nodes' range in `unit_nodes` (positions, ascending).
    unit_node_start: Vec<u32>,
    unit_nodes: Vec<u32>,
    allowed: Vec<Vec<u32>>,
    unit_seconds: Vec<f64>,
    neighbours: Vec<Vec<u32>>,
    /// By device: what runs its nodes (itself, or with a profile its task's process).
    executor: Vec<u32>,
    executors: usize,
    /// By executor: how many times the model's profile's time a node takes there (its task's
    /// own profile's product rate against the model's; 1 without profiles of tasks).
    slowness: Vec<f64>,
    /// `devices × devices`: the link between two devices.
    link: Vec<Link>,
    devices: usize,
}

/// How many times the model's profile's time a node takes on `device`: the ratio of a square
/// product of 256's time on its task's own profile to the model's (1 where it has none).
pub(crate) fn slowness(model: &CostModel, device: &DeviceSpec) -> f64 {
    let square = |p: &crate::profile::Profile| p.full().gemm_seconds(256, 256, 256, false, false, 1);
    match (model.profile_of(Some(device)), &model.profile) {
        (Some(own), Some(base)) if !std::sync::Arc::ptr_eq(own, base) => {
            let ratio = square(own) / square(base);
            if ratio.is_finite() && ratio > 0.0 {
                ratio
            } else {
                1.0
            }
        }
        _ => 1.0,
    }
}

/// With a profile, what a device computes on: so many threads of its host (`u32::MAX`: all
/// it measured), at `slower` times their rates (its host's processes asking for more threads
/// than it has).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Share {
    pub threads: u32,
    pub slower: f64,
}

impl Share {
    /// All the host's threads, alone.
    pub const ALL: Share = Share { threads: u32::MAX, slower: 1.0 };
}

/// Where the units of a graph are, as `place` groups them.
pub struct Units<'a> {
    /// The graph's nodes in topological order.
    pub order: &'a [NodeId],
    /// Each node's unit (dense, from 0).
    pub unit_of: &'a HashMap<NodeId, u32>,
    /// By unit: the devices it may use (empty: any).
    pub allowed: Vec<Vec<u32>>,
}

impl Problem {
    /// The problem of placing `units` of `graph` on `devices` (linked as `links` says) at the
    /// cost model's rates: node times from the profile where it has one (on the `share` of its
    /// host each device computes on), else FLOPs at the assumed rate.
    pub fn new(
        module: &dfc_ir::Module,
        units: Units<'_>,
        devices: &[DeviceSpec],
        links: impl Fn(usize, usize) -> Link,
        model: &CostModel,
        share: Share,
    ) -> Problem {
        let graph = &module.graph;
        let n = units.order.len();
        let count = units.allowed.len();
        let profiled = model.profile.as_ref().map(|p| cost::profiled_seconds(module, p.rates(share.threads)));
        let node_seconds = |id: NodeId| {
            let seconds = match &profiled {
                Some(times) => times.get(id.index()).copied().unwrap_or(0.0) * share.slower,
                None => cost::node_flops(graph, id) / model.flops_per_second,
            };
            if seconds.is_finite() && seconds > 0.0 {
                seconds
            } else {
                0.0
            }
        };
        let order = units.order;
        let mut position: HashMap<NodeId, u32> = HashMap::with_capacity(n);
        for (i, &id) in order.iter().enumerate() {
            position.insert(id, i as u32);
        }
        let mut problem = Problem {
            seconds: Vec::with_capacity(n),
            unit: Vec::with_capacity(n),
            edge_start: Vec::with_capacity(n + 1),
            edges: Vec::new(),
            priority: Vec::new(),
            user_start: Vec::new(),
            user_edges: Vec::new(),
            first: vec![u32::MAX; count],
            unit_node_start: Vec::new(),
            unit_nodes: Vec::new(),
            allowed: units.allowed,
            unit_seconds: vec![0.0; count],
            neighbours: vec![Vec::new(); count],
            executor: Vec::new(),
            executors: 0,
            slowness: Vec::new(),
            link: Vec::with_capacity(devices.len() * devices.len()),
            devices: devices.len(),
        };
        for (i, &id) in order.iter().enumerate() {
            let unit = units.unit_of[&id];
            let seconds = node_seconds(id);
            problem.seconds.push(seconds);
            problem.unit.push(unit);
            problem.first[unit as usize] = problem.first[unit as usize].min(i as u32);
            problem.unit_seconds[unit as usize] += seconds;
            problem.edge_start.push(problem.edges.len() as u32);
            let data = graph.inputs(id).into_iter().map(|t| {
                let kind = if copied_constant(graph, t.node) { EdgeKind::Constant } else { EdgeKind::Data };
                (t.node, cost::tensor_bytes(graph.ty(t)) as f64, kind)
            });
            let controls = graph.control_inputs(id).into_iter().map(|c| (c, 0.0, EdgeKind::Control));
            let mine = problem.edges.len();
            for (from, bytes, kind) in data.chain(controls) {
                let Some(&from) = position.get(&from) else { continue };
                let seconds = [Link::Same, Link::Process, Link::Host, Link::Network]
                    .map(|link| transfer_seconds(bytes, link, model) as f32);
                // One edge per producer, as one Recv per tensor: the costliest.
                if let Some(edge) = problem.edges[mine..].iter_mut().find(|e| e.from == from) {
                    for (kept, new) in edge.seconds.iter_mut().zip(seconds) {
                        *kept = kept.max(new);
                    }
                    if kind == EdgeKind::Data {
                        edge.kind = kind;
                    }
                    continue;
                }
                problem.edges.push(Edge { from, seconds, kind });
                let other = problem.unit[from as usize];
                if other != unit && kind != EdgeKind::Constant {
                    problem.neighbours[unit as usize].push(other);
                    problem.neighbours[other as usize].push(unit);
                }
            }
        }
        problem.edge_start.push(problem.edges.len() as u32);
        // Each node's users, with the edge that leads to each.
        let mut users = vec![0u32; n + 1];
        for edge in &problem.edges {
            users[edge.from as usize + 1] += 1;
        }
        for i in 0..n {
            users[i + 1] += users[i];
        }
        let mut filled = users.clone();
        problem.user_edges = vec![(0, 0); problem.edges.len()];
        for to in 0..n {
            for e in problem.edge_start[to]..problem.edge_start[to + 1] {
                let from = problem.edges[e as usize].from as usize;
                problem.user_edges[filled[from] as usize] = (to as u32, e);
                filled[from] += 1;
            }
        }
        problem.user_start = users;
        let mut starts = vec![0u32; count + 1];
        for &unit in &problem.unit {
            starts[unit as usize + 1] += 1;
        }
        for u in 0..count {
            starts[u + 1] += starts[u];
        }
        let mut filled = starts.clone();
        problem.unit_nodes = vec![0; n];
        for (at, &unit) in problem.unit.iter().enumerate() {
            problem.unit_nodes[filled[unit as usize] as usize] = at as u32;
            filled[unit as usize] += 1;
        }
        problem.unit_node_start = starts;
        problem.priority = order.iter().map(|id| u32::try_from(id.index()).unwrap_or(LAST - 1)).collect();
        for list in &mut problem.neighbours {
            list.sort_unstable();
            list.dedup();
        }
        // With a profile a task's devices take turns on its process's cores.
        let mut executors: Vec<usize> = Vec::with_capacity(devices.len());
        for a in 0..devices.len() {
            for b in 0..devices.len() {
                problem.link.push(links(a, b));
            }
            let shared = model.profile.is_some();
            let executor = match (0..a).find(|&b| shared && links(a, b) == Link::Process) {
                Some(b) => executors[b],
                None => a,
            };
            executors.push(executor);
        }
        let mut distinct = executors.clone();
        distinct.sort_unstable();
        distinct.dedup();
        problem.executor = executors.iter().map(|e| distinct.binary_search(e).expect("listed") as u32).collect();
        problem.executors = distinct.len();
        problem.slowness = distinct.iter().map(|&d| slowness(model, &devices[d])).collect();
        problem
    }

    pub fn nodes(&self) -> usize {
        self.seconds.len()
    }

    pub fn units(&self) -> usize {
        self.first.len()
    }

    /// The units that may go to more than one device.
    pub fn movable_units(&self) -> usize {
        (0..self.units()).filter(|&u| self.movable(u)).count()
    }

    /// Whether unit `u` may go to more than one device.
    fn movable(&self, u: usize) -> bool {
        self.allowed[u].len() != 1 && self.first[u] != u32::MAX
    }

    fn may_use(&self, u: usize, device: u32) -> bool {
        self.allowed[u].is_empty() || self.allowed[u].contains(&device)
    }

    /// The step's time under `assignment` (by unit), simulated from the start.
    pub fn step_seconds(&self, assignment: &[u32]) -> f64 {
        Schedule::default().run(self, assignment, &[], 0).0
    }

    /// The step with `units` moved to `device` from `assignment`, and the sum of the nodes'
    /// finishing times: a trial move as the search scores it.
    pub fn score_move(&self, assignment: &[u32], units: &[u32], device: u32) -> (f64, f64) {
        Schedule::default().run(self, assignment, units, device)
    }

    /// The positions of unit `u`'s nodes.
    fn nodes_of(&self, u: usize) -> &[u32] {
        &self.unit_nodes[self.unit_node_start[u] as usize..self.unit_node_start[u + 1] as usize]
    }

    /// Round-robin placement: each movable unit that `rotate` picks, in the graph's
    /// topological order, on the next device it may use; the others where `start` has them.
    pub fn round_robin(&self, start: &[u32], rotate: impl Fn(usize) -> bool) -> Vec<u32> {
        let mut assignment = start.to_vec();
        let mut units: Vec<usize> = (0..self.units()).filter(|&u| self.movable(u) && rotate(u)).collect();
        units.sort_by_key(|&u| self.first[u]);
        let mut next = 0usize;
        for u in units {
            let pick = (0..self.devices)
                .map(|k| (next + k) % self.devices)
                .find(|&d| self.may_use(u, d as u32))
                .unwrap_or(assignment[u] as usize);
            assignment[u] = pick as u32;
            next = pick + 1;
        }
        assignment
    }
}

/// Whether `node` is a constant that `partition` copies to every device that uses it.
fn copied_constant(graph: &Graph, node: NodeId) -> bool {
    matches!(graph.node(node).op, Op::Const { .. }) && graph.control_inputs(node).is_empty()
}

/// Seconds to move `bytes` over `link` under `model`: as `estimate_on` prices a Recv.
fn transfer_seconds(bytes: f64, link: Link, model: &CostModel) -> f64 {
    let seconds = match (&model.profile, link) {
        (_, Link::Same) => 0.0,
        (Some(profile), link) => cost::link_seconds(bytes, link, profile),
        (None, Link::Process) => bytes / model.local_bytes_per_second,
        (None, Link::Host | Link::Network) => {
            bytes / model.remote_bytes_per_second + model.remote_latency_seconds.max(0.0)
        }
    };
    if seconds.is_finite() && seconds >= 0.0 {
        seconds
    } else {
        f64::from(f32::MAX)
    }
}

/// Marks an event's node as a transfer's arrival at it rather than its own finish.
const ARRIVAL: u32 = 1 << 31;
/// Marks a queued node or a finish as a node `partition` adds (a control edge's dummy, a
/// constant's copy: the edge's index), not a node of the graph.
const DUMMY: u32 = 1 << 30;
/// Where such a node waits among its executor's ready nodes: after them all, as the last
/// nodes added rank in a partition's topological order.
const LAST: u32 = u32::MAX;

/// A ready node's entry in its executor's queue: its priority, then its position (or a
/// dummy's mark), in one number so that the queue compares once.
fn queued(priority: u32, at: u32) -> u64 {
    u64::from(priority) << 32 | u64::from(at)
}

/// The list schedule's working memory, kept between trials.
#[derive(Default)]
struct Schedule {
    pending: Vec<u32>,
    /// By position: the device its unit is on.
    device: Vec<u32>,
    /// Finishes and arrivals as `time's bits << 64 | sequence << 32 | what`: times are never
    /// negative, so their bits order them, and equal times keep the order they were pushed in.
    events: BinaryHeap<Reverse<u128>>,
    /// Per executor, its ready nodes (`queued`), the lowest priority first.
    queues: Vec<BinaryHeap<Reverse<u64>>>,
    running: Vec<bool>,
    /// The executors that may start a node once every event of this instant is done.
    dispatching: Vec<bool>,
    idle: Vec<u32>,
    sequence: u32,
    /// By edge: a dummy's user, and the executor it runs on.
    dummy: Vec<(u32, u32)>,
}

impl Schedule {
    /// Simulates the step under `assignment`: its time and the sum of the nodes' finishing
    /// times. The same list schedule as `cost::estimate_on`: an executor that is free starts
    /// the ready node of the lowest priority; a transfer delays its user's
    /// readiness (a Recv) without occupying an executor.
    /// `moved` units are on `to` whatever `assignment` says.
    fn run(&mut self, p: &Problem, assignment: &[u32], moved: &[u32], to: u32) -> (f64, f64) {
        let n = p.nodes();
        self.pending.clear();
        self.pending.extend((0..n).map(|i| p.edge_start[i + 1] - p.edge_start[i]));
        self.events.clear();
        self.queues.resize_with(p.executors, BinaryHeap::new);
        self.queues.iter_mut().for_each(BinaryHeap::clear);
        self.running.clear();
        self.running.resize(p.executors, false);
        self.dispatching.clear();
        self.dispatching.resize(p.executors, false);
        self.idle.clear();
        self.sequence = 0;
        self.dummy.resize(p.edges.len(), (0, 0));
        self.device.clear();
        self.device.extend(p.unit.iter().map(|&u| assignment[u as usize]));
        for &unit in moved {
            for &at in p.nodes_of(unit as usize) {
                self.device[at as usize] = to;
            }
        }
        let devices = std::mem::take(&mut self.device);
        let device = |at: u32| devices[at as usize] as usize;
        for at in 0..n as u32 {
            if self.pending[at as usize] == 0 {
                self.make_ready(p, device(at), at);
            }
        }
        // A constant used on another device is copied there: the copy, the last node
        // `partition` adds, runs when that device has nothing else ready.
        for to in 0..n as u32 {
            for e in p.edge_start[to as usize]..p.edge_start[to as usize + 1] {
                let edge = &p.edges[e as usize];
                if edge.kind == EdgeKind::Constant && device(edge.from) != device(to) {
                    let executor = p.executor[device(to)] as usize;
                    self.dummy[e as usize] = (to, executor as u32);
                    self.queues[executor].push(Reverse(queued(LAST, e | DUMMY)));
                    self.request_dispatch(executor);
                }
            }
        }
        self.dispatch(p, 0.0);
        let (mut step, mut sum) = (0.0f64, 0.0f64);
        while let Some(Reverse(key)) = self.events.pop() {
            let bits = (key >> 64) as u64;
            let what = key as u32;
            let now = f64::from_bits(bits);
            if what & ARRIVAL != 0 {
                let at = what & !ARRIVAL;
                self.arrive(p, device(at), at);
            } else if what & DUMMY != 0 {
                // A dummy ran: a control edge's order travels on from its producer's device, a
                // constant's copy is there for its user.
                let e = (what & !DUMMY) as usize;
                let (user, executor) = self.dummy[e];
                self.running[executor as usize] = false;
                self.request_dispatch(executor as usize);
                let edge = &p.edges[e];
                let link = match edge.kind {
                    EdgeKind::Constant => Link::Same,
                    _ => p.link[device(edge.from) * p.devices + device(user)],
                };
                let delay = f64::from(edge.seconds[link as usize]);
                self.push(now + delay, user | ARRIVAL);
            } else {
                step = step.max(now);
                sum += now;
                let here = device(what);
                let executor = p.executor[here] as usize;
                self.running[executor] = false;
                let users = p.user_start[what as usize] as usize..p.user_start[what as usize + 1] as usize;
                for &(user, edge) in &p.user_edges[users] {
                    let there = device(user);
                    let link = p.link[here * p.devices + there];
                    match p.edges[edge as usize].kind {
                        EdgeKind::Constant if link != Link::Same => continue,
                        EdgeKind::Control if link != Link::Same => {
                            self.dummy[edge as usize] = (user, executor as u32);
                            self.queues[executor].push(Reverse(queued(LAST, edge | DUMMY)));
                            continue;
                        }
                        _ => {}
                    }
                    let delay = f64::from(p.edges[edge as usize].seconds[link as usize]);
                    if delay > 0.0 {
                        self.push(now + delay, user | ARRIVAL);
                    } else {
                        self.arrive(p, there, user);
                    }
                }
                self.request_dispatch(executor);
            }
            // Once every finish and arrival of this instant is in, the free executors start
            // their first ready nodes.
            let later = self.events.peek().is_none_or(|Reverse(next)| (next >> 64) as u64 != bits);
            if later {
                self.dispatch(p, now);
            }
        }
        self.device = devices;
        (step, sum)
    }

    fn push(&mut self, time: f64, what: u32) {
        self.sequence = self.sequence.wrapping_add(1);
        let time = if time > 0.0 { time } else { 0.0 };
        self.events
            .push(Reverse(u128::from(time.to_bits()) << 64 | u128::from(self.sequence) << 32 | u128::from(what)));
    }

    /// An input of node `at` (on `device`) is there at `now`.
    fn arrive(&mut self, p: &Problem, device: usize, at: u32) {
        let i = at as usize;
        self.pending[i] -= 1;
        if self.pending[i] == 0 {
            self.make_ready(p, device, at);
        }
    }

    fn make_ready(&mut self, p: &Problem, device: usize, at: u32) {
        let executor = p.executor[device] as usize;
        self.queues[executor].push(Reverse(queued(p.priority[at as usize], at)));
        self.request_dispatch(executor);
    }

    fn request_dispatch(&mut self, executor: usize) {
        if !self.running[executor] && !self.dispatching[executor] && !self.queues[executor].is_empty() {
            self.dispatching[executor] = true;
            self.idle.push(executor as u32);
        }
    }

    /// The executors that were asked for at `now` and are free start their first ready nodes.
    fn dispatch(&mut self, p: &Problem, now: f64) {
        for k in 0..self.idle.len() {
            let executor = self.idle[k] as usize;
            self.dispatching[executor] = false;
            if self.running[executor] {
                continue;
            }
            let Some(Reverse(entry)) = self.queues[executor].pop() else { continue };
            let at = entry as u32;
            self.running[executor] = true;
            let seconds = if at & DUMMY != 0 { 0.0 } else { p.seconds[at as usize] * p.slowness[executor] };
            self.push(now + seconds, at);
        }
        self.idle.clear();
    }
}

/// Whether a trial's step and sum of finishing times beat the accepted ones: a shorter step,
/// or an equal one whose work ends sooner.
fn better(step: f64, sum: f64, new_step: f64, new_sum: f64) -> bool {
    let shorter = new_step < step * (1.0 - 1e-9);
    let sooner = new_step <= step && new_sum < sum * (1.0 - 1e-6);
    shorter || sooner
}

/// A list of trial moves against one assignment, in the order the search tries them.
#[derive(Default)]
struct Batch {
    assignment: Vec<u32>,
    step: f64,
    sum: f64,
    /// The sets of units that move, and each move: a set and the device it goes to.
    sets: [Vec<u32>; 2],
    moves: Vec<(usize, u32)>,
}

/// The threads that score a batch: the searching thread, and helpers that wait for the next
/// batch spinning (a batch takes a millisecond or so, less than waking a sleeping thread can
/// take on a VM). Each thread claims the next move of the batch in order, and none is scored
/// past a move already found better, so the first better move is the one a single thread
/// would find, with fewer moves scored in vain than threads.
struct Crew<'p> {
    problem: &'p Problem,
    batch: RwLock<Batch>,
    helpers: usize,
    /// The batch's number: a helper scores a batch once.
    posted: AtomicU64,
    next: AtomicUsize,
    /// The first move found better so far (`usize::MAX`: none), and its score.
    kept: AtomicUsize,
    kept_score: Mutex<(f64, f64)>,
    /// How many helpers are done with the batch.
    finished: AtomicUsize,
    quit: AtomicBool,
}

impl<'p> Crew<'p> {
    fn new(problem: &'p Problem, batch: Batch, helpers: usize) -> Crew<'p> {
        Crew {
            problem,
            batch: RwLock::new(batch),
            helpers,
            posted: AtomicU64::new(0),
            next: AtomicUsize::new(0),
            kept: AtomicUsize::new(usize::MAX),
            kept_score: Mutex::new((0.0, 0.0)),
            finished: AtomicUsize::new(0),
            quit: AtomicBool::new(false),
        }
    }

    /// A helper's life: each batch posted, scored, until the crew is dismissed.
    fn help(&self) {
        let _dismissal = Dismissal(self);
        let mut schedule = Schedule::default();
        let mut seen = 0;
        loop {
            let mut spins = 0u32;
            while self.posted.load(Ordering::Acquire) == seen && !self.quit.load(Ordering::Acquire) {
                wait_a_moment(&mut spins);
            }
            if self.quit.load(Ordering::Acquire) {
                return;
            }
            seen = self.posted.load(Ordering::Acquire);
            {
                let batch = self.batch.read().unwrap_or_else(PoisonError::into_inner);
                self.score(&batch, &mut schedule);
            }
            self.finished.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Scores the batch's moves this thread claims, in order, until none is left or a move
    /// before the next one was found better.
    fn score(&self, batch: &Batch, schedule: &mut Schedule) {
        loop {
            let k = self.next.fetch_add(1, Ordering::AcqRel);
            if k >= batch.moves.len() || k > self.kept.load(Ordering::Acquire) {
                return;
            }
            let (set, device) = batch.moves[k];
            let (step, sum) = schedule.run(self.problem, &batch.assignment, &batch.sets[set], device);
            if better(batch.step, batch.sum, step, sum) {
                let mut kept_score = self.kept_score.lock().unwrap_or_else(PoisonError::into_inner);
                if k < self.kept.load(Ordering::Acquire) {
                    self.kept.store(k, Ordering::Release);
                    *kept_score = (step, sum);
                }
            }
        }
    }

    /// Scores the posted batch with the helpers: the first move better than its assignment,
    /// and that move's step and sum.
    fn first_better(&self, schedule: &mut Schedule) -> Option<(usize, f64, f64)> {
        self.next.store(0, Ordering::Release);
        self.kept.store(usize::MAX, Ordering::Release);
        self.finished.store(0, Ordering::Release);
        self.posted.fetch_add(1, Ordering::AcqRel);
        self.score(&self.batch.read().unwrap_or_else(PoisonError::into_inner), schedule);
        let mut spins = 0u32;
        while self.finished.load(Ordering::Acquire) < self.helpers && !self.quit.load(Ordering::Acquire) {
            wait_a_moment(&mut spins);
        }
        let k = self.kept.load(Ordering::Acquire);
        let (step, sum) = *self.kept_score.lock().unwrap_or_else(PoisonError::into_inner);
        (k != usize::MAX).then_some((k, step, sum))
    }

    fn batch(&self) -> std::sync::RwLockWriteGuard<'_, Batch> {
        self.batch.write().unwrap_or_else(PoisonError::into_inner)
    }

    fn dismiss(&self) {
        self.quit.store(true, Ordering::Release);
    }
}

/// Dismisses the crew when dropped: when the search ends, and when one of its threads
/// panics, so that no thread waits for one that is gone (the panic goes on when the threads
/// are joined).
struct Dismissal<'a, 'p>(&'a Crew<'p>);

impl Drop for Dismissal<'_, '_> {
    fn drop(&mut self) {
        self.0.dismiss();
    }
}

/// Spins, and now and then lets another thread have the core.
fn wait_a_moment(spins: &mut u32) {
    *spins = spins.wrapping_add(1);
    if spins.is_multiple_of(64) {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
}

/// How far a search may go: placements scored, nodes simulated over all of them (what makes
/// the search's length follow the graph's size, and the same on every machine, so that a
/// compile is reproducible), and, only as a guard, seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Budget {
    pub candidates: u64,
    pub nodes: u64,
    pub seconds: f64,
}

impl Default for Budget {
    /// About 16,000 placements of a thousand-node graph: a second or two.
    fn default() -> Budget {
        Budget { candidates: 200_000, nodes: 20_000_000, seconds: 60.0 }
    }
}

impl Budget {
    /// Half of this budget (for each of two starts).
    pub fn half(self) -> Budget {
        Budget { candidates: self.candidates / 2, nodes: self.nodes / 2, seconds: self.seconds / 2.0 }
    }
}

/// What a search found and how far it looked.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    pub assignment: Vec<u32>,
    pub step_seconds: f64,
    pub start_seconds: f64,
    pub scored: u64,
    pub seconds: f64,
}

/// Descends from `start` (by unit) to an assignment no single move improves, or as far as the
/// budget goes, scoring moves on as many threads as the machine has cores (at most
/// `MAX_THREADS`).
pub fn improve(problem: &Problem, start: Vec<u32>, budget: Budget) -> Outcome {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    improve_on(problem, start, budget, cores.min(MAX_THREADS))
}

/// `improve` on `threads` threads: the same outcome on any number.
pub fn improve_on(problem: &Problem, start: Vec<u32>, budget: Budget, threads: usize) -> Outcome {
    let clock = Instant::now();
    let mut schedule = Schedule::default();
    let (step, sum) = schedule.run(problem, &start, &[], 0);
    let batch = Batch { assignment: start, step, sum, ..Batch::default() };
    let crew = Crew::new(problem, batch, threads.max(1) - 1);
    let (scored, assignment) = std::thread::scope(|scope| {
        for _ in 0..crew.helpers {
            scope.spawn(|| crew.help());
        }
        let dismissal = Dismissal(&crew);
        let scored = descend(&crew, &mut schedule, budget, clock);
        drop(dismissal);
        (scored, std::mem::take(&mut crew.batch().assignment))
    });
    let step_seconds = crew.batch().step;
    Outcome { assignment, step_seconds, start_seconds: step, scored, seconds: clock.elapsed().as_secs_f64() }
}

/// The descent: every movable unit, the costliest first, tries its devices alone and then
/// with its neighbours on its device, and the first move that shortens the step is kept;
/// passes repeat until one changes nothing or the budget is spent. Returns the placements
/// scored.
fn descend(crew: &Crew, schedule: &mut Schedule, budget: Budget, clock: Instant) -> u64 {
    let problem = crew.problem;
    let mut assignment = crew.batch().assignment.clone();
    let mut load = vec![0.0f64; problem.devices];
    for (u, &d) in assignment.iter().enumerate() {
        load[d as usize] += problem.unit_seconds[u];
    }
    let mut order: Vec<usize> = (0..problem.units()).filter(|&u| problem.movable(u)).collect();
    order.sort_by(|&a, &b| problem.unit_seconds[b].total_cmp(&problem.unit_seconds[a]).then(a.cmp(&b)));
    let mut candidates: Vec<u32> = Vec::new();
    let size = problem.nodes().max(1) as u64;
    let last = budget.candidates.min(budget.nodes.div_ceil(size));
    let mut scored = 1u64;
    'passes: loop {
        let mut moved = false;
        for &u in &order {
            devices_to_try(problem, u, &assignment, &load, &mut candidates);
            if candidates.is_empty() {
                continue;
            }
            let left = last.saturating_sub(scored) as usize;
            if left == 0 || clock.elapsed().as_secs_f64() >= budget.seconds {
                break 'passes;
            }
            let here = assignment[u];
            let mut batch = crew.batch();
            let Batch { sets: [alone, group], moves, .. } = &mut *batch;
            // The unit alone, then with its neighbours on its device (a layer's ops, a chain):
            // a stretch of work that one move at a time could not carry across.
            alone.clear();
            alone.push(u as u32);
            group.clear();
            group.push(u as u32);
            group.extend(
                problem.neighbours[u]
                    .iter()
                    .copied()
                    .filter(|&v| assignment[v as usize] == here && problem.movable(v as usize)),
            );
            moves.clear();
            let sets = if group.len() > 1 { 2 } else { 1 };
            for (set, units) in [&*alone, &*group].into_iter().enumerate().take(sets) {
                let allowed = candidates.iter().filter(|&&d| units.iter().all(|&v| problem.may_use(v as usize, d)));
                moves.extend(allowed.map(|&d| (set, d)));
            }
            let cut = moves.len() > left;
            moves.truncate(left);
            drop(batch);
            match crew.first_better(schedule) {
                Some((k, step, sum)) => {
                    scored += k as u64 + 1;
                    let mut batch = crew.batch();
                    let (set, d) = batch.moves[k];
                    let units = std::mem::take(&mut batch.sets[set]);
                    for &v in &units {
                        assignment[v as usize] = d;
                        batch.assignment[v as usize] = d;
                        load[here as usize] -= problem.unit_seconds[v as usize];
                        load[d as usize] += problem.unit_seconds[v as usize];
                    }
                    batch.sets[set] = units;
                    (batch.step, batch.sum) = (step, sum);
                    moved = true;
                }
                None => {
                    scored += crew.batch().moves.len() as u64;
                    if cut {
                        break 'passes;
                    }
                }
            }
        }
        if !moved {
            break;
        }
    }
    scored
}

/// The devices unit `u` tries, other than its own: all it may use on a small cluster; on a
/// large one, its neighbours' devices and the least-loaded devices.
fn devices_to_try(problem: &Problem, u: usize, assignment: &[u32], load: &[f64], out: &mut Vec<u32>) {
    out.clear();
    let own = assignment[u];
    if problem.devices <= ALL_DEVICES_UP_TO {
        out.extend((0..problem.devices as u32).filter(|&d| d != own && problem.may_use(u, d)));
        return;
    }
    out.extend(problem.neighbours[u].iter().map(|&v| assignment[v as usize]));
    let mut idle: Vec<u32> = (0..problem.devices as u32).collect();
    idle.sort_by(|&a, &b| load[a as usize].total_cmp(&load[b as usize]).then(a.cmp(&b)));
    out.extend(idle.into_iter().take(IDLE_CANDIDATES));
    out.sort_unstable();
    out.dedup();
    out.retain(|&d| d != own && problem.may_use(u, d));
}
