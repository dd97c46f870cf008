//! Placement search: the `model` strategy's compute and variables spread over the devices by
//! trying moves and keeping those that shorten the simulated step (`--compute-placement
//! searched`, and `--strategy auto`'s model candidates).
//!
//! The unit of a move is a colocation group (a variable with its reads, updates and slots; a
//! compute node alone). A `Problem` holds what a step costs under any assignment of the units:
//! each node's time (the cost model's, from the profile where it has one), each edge's transfer
//! time over each kind of link, and which devices share an executor (with a profile, a task's
//! devices share its process's cores). The step is simulated as a list schedule in one
//! topological order: a node starts when its executor is free and its inputs have arrived,
//! and the step ends when its last node does — the schedule `cost::estimate_on` runs on the
//! partitions, without their Send/Recv pairs and all-reduces.
//!
//! Scoring is incremental. Moving a unit changes nothing before the unit's first node in the
//! order, so a trial resumes from the last checkpoint of the executors' ready times before
//! it; a rejected trial leaves the accepted schedule as it was.
//!
//! The search is a descent: from a starting assignment (the earliest-finish-time placement),
//! every movable unit, the costliest first, tries each device it may use (on a large cluster:
//! its neighbours' devices and the least-loaded ones) and keeps the first move that shortens
//! the step; passes repeat until one changes nothing or the budget of candidates is spent.

use crate::cost::{self, CostModel};
use dfc_ir::{DeviceSpec, Graph, NodeId, Op};
use std::collections::HashMap;
use std::time::Instant;

/// How many positions lie between two checkpoints of the executors' ready times.
const STRIDE: usize = 32;

/// Beyond this many devices a unit tries its neighbours' devices and the least-loaded ones,
/// not every device.
const ALL_DEVICES_UP_TO: usize = 16;

/// The least-loaded devices a unit also tries on a large cluster.
const IDLE_CANDIDATES: usize = 4;

pub use crate::cost::Link;

/// An input of a node: the position of its producer and what moving it costs over each link.
#[derive(Clone, Copy, Debug)]
struct Edge {
    from: u32,
    seconds: [f32; 4],
}

/// One step's costs under any assignment of units to devices.
#[derive(Clone, Debug)]
pub struct Problem {
    /// By position in the topological order: the node's time, its unit, its inputs' range.
    seconds: Vec<f64>,
    unit: Vec<u32>,
    edge_start: Vec<u32>,
    edges: Vec<Edge>,
    /// By unit: its first position, the devices it may use (empty: any), its total time, and
    /// the units it exchanges tensors with.
    first: Vec<u32>,
    /// By unit: its first node's index in the graph's topological order (round-robin's order).
    topological: Vec<u32>,
    allowed: Vec<Vec<u32>>,
    unit_seconds: Vec<f64>,
    neighbours: Vec<Vec<u32>>,
    /// By device: what runs its nodes (itself, or with a profile its task's process).
    executor: Vec<u32>,
    executors: usize,
    /// `devices × devices`: the link between two devices.
    link: Vec<Link>,
    devices: usize,
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
    /// cost model's rates: node times from the profile where it has one (at `slower` times
    /// its all-cores rates, the host's oversubscription), else FLOPs at the assumed rate.
    pub fn new(
        module: &dfc_ir::Module,
        units: Units<'_>,
        devices: &[DeviceSpec],
        links: impl Fn(usize, usize) -> Link,
        model: &CostModel,
        slower: f64,
    ) -> Problem {
        let graph = &module.graph;
        let n = units.order.len();
        let count = units.allowed.len();
        let profiled = model.profile.as_ref().map(|p| cost::profiled_seconds(module, p.full()));
        let node_seconds = |id: NodeId| {
            let seconds = match &profiled {
                Some(times) => times.get(id.index()).copied().unwrap_or(0.0) * slower,
                None => cost::node_flops(graph, id) / model.flops_per_second,
            };
            if seconds.is_finite() && seconds > 0.0 {
                seconds
            } else {
                0.0
            }
        };
        let order = by_upward_rank(graph, units.order, &node_seconds, model);
        let mut position: HashMap<NodeId, u32> = HashMap::with_capacity(n);
        for (i, &id) in order.iter().enumerate() {
            position.insert(id, i as u32);
        }
        let mut problem = Problem {
            seconds: Vec::with_capacity(n),
            unit: Vec::with_capacity(n),
            edge_start: Vec::with_capacity(n + 1),
            edges: Vec::new(),
            first: vec![u32::MAX; count],
            topological: vec![u32::MAX; count],
            allowed: units.allowed,
            unit_seconds: vec![0.0; count],
            neighbours: vec![Vec::new(); count],
            executor: Vec::new(),
            executors: 0,
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
            let data = graph.inputs(id).into_iter().filter(|t| !copied_constant(graph, t.node));
            let data = data.map(|t| (t.node, cost::tensor_bytes(graph.ty(t)) as f64));
            let controls = graph.control_inputs(id).into_iter().map(|c| (c, 0.0));
            for (from, bytes) in data.chain(controls) {
                let Some(&from) = position.get(&from) else { continue };
                let seconds = [Link::Same, Link::Process, Link::Host, Link::Network]
                    .map(|link| transfer_seconds(bytes, link, model) as f32);
                problem.edges.push(Edge { from, seconds });
                let other = problem.unit[from as usize];
                if other != unit {
                    problem.neighbours[unit as usize].push(other);
                    problem.neighbours[other as usize].push(unit);
                }
            }
        }
        problem.edge_start.push(problem.edges.len() as u32);
        for (i, id) in units.order.iter().enumerate() {
            let unit = units.unit_of[id] as usize;
            problem.topological[unit] = problem.topological[unit].min(i as u32);
        }
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
        Simulator::new(self, assignment.to_vec()).step
    }

    /// Round-robin placement: each movable unit that `rotate` picks, in the graph's
    /// topological order, on the next device it may use; the others where `start` has them.
    pub fn round_robin(&self, start: &[u32], rotate: impl Fn(usize) -> bool) -> Vec<u32> {
        let mut assignment = start.to_vec();
        let mut units: Vec<usize> = (0..self.units()).filter(|&u| self.movable(u) && rotate(u)).collect();
        units.sort_by_key(|&u| self.topological[u]);
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

/// `order` (topological) re-sorted by upward rank, the longest path from each node to the
/// end of the step (its time, then the costliest chain after it, transfers within a process
/// counted), longest first: HEFT's priority, and still a topological order (a node's rank
/// exceeds its users'; equal ranks keep `order`).
fn by_upward_rank(graph: &Graph, order: &[NodeId], seconds: &dyn Fn(NodeId) -> f64, model: &CostModel) -> Vec<NodeId> {
    let index: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &id)| (id, i)).collect();
    let mut after = vec![0.0f64; order.len()];
    let mut rank = vec![0.0f64; order.len()];
    for (i, &id) in order.iter().enumerate().rev() {
        rank[i] = seconds(id) + after[i];
        for t in graph.inputs(id) {
            if let Some(&p) = index.get(&t.node) {
                let bytes = cost::tensor_bytes(graph.ty(t)) as f64;
                let chain = transfer_seconds(bytes, Link::Process, model) + rank[i];
                after[p] = after[p].max(chain);
            }
        }
        for c in graph.control_inputs(id) {
            if let Some(&p) = index.get(&c) {
                after[p] = after[p].max(rank[i]);
            }
        }
    }
    let mut sorted: Vec<usize> = (0..order.len()).collect();
    sorted.sort_by(|&a, &b| rank[b].total_cmp(&rank[a]).then(a.cmp(&b)));
    sorted.into_iter().map(|i| order[i]).collect()
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

/// The idle stretches an executor remembers, to fill with nodes whose inputs come early.
const HOLES: usize = 8;

/// One executor's schedule so far: when it is free for good, and idle stretches before that
/// (a node that waited for its inputs left its executor idle; a later node that is ready
/// sooner runs in that gap, as a list scheduler would have run it first).
#[derive(Clone, Copy, Debug)]
struct Executor {
    ready: f64,
    holes: [(f64, f64); HOLES],
}

impl Default for Executor {
    fn default() -> Executor {
        Executor { ready: 0.0, holes: [(0.0, 0.0); HOLES] }
    }
}

impl Executor {
    /// Runs a node of `seconds` whose inputs arrive at `arrival`; when it ends.
    fn run(&mut self, arrival: f64, seconds: f64) -> f64 {
        // The earliest hole it fits in.
        let mut best: Option<(usize, f64)> = None;
        for (k, &(open, close)) in self.holes.iter().enumerate() {
            let start = arrival.max(open);
            if start + seconds <= close && best.is_none_or(|(_, b)| start < b) {
                best = Some((k, start));
            }
        }
        if let Some((k, start)) = best {
            // The node takes the hole's middle: what is left after it stays a hole, and what
            // is left before it replaces the smallest hole if it is larger.
            let (open, close) = self.holes[k];
            self.holes[k] = (start + seconds, close);
            self.remember(open, start);
            return start + seconds;
        }
        let start = arrival.max(self.ready);
        self.remember(self.ready, start);
        self.ready = start + seconds;
        self.ready
    }

    /// Keeps `[open, close)` as a hole in place of the smallest, if it is larger.
    fn remember(&mut self, open: f64, close: f64) {
        let smallest = (0..HOLES)
            .min_by(|&a, &b| {
                let (x, y) = (self.holes[a], self.holes[b]);
                (x.1 - x.0).total_cmp(&(y.1 - y.0))
            })
            .expect("HOLES > 0");
        let (o, c) = self.holes[smallest];
        if close - open > c - o {
            self.holes[smallest] = (open, close);
        }
    }
}

/// A schedule of one assignment that rescored moves incrementally.
pub struct Simulator<'a> {
    problem: &'a Problem,
    assignment: Vec<u32>,
    /// By position: when the node finishes, the latest finish up to it, and the sum of the
    /// finishes up to it.
    finish: Vec<f64>,
    peak: Vec<f64>,
    total: Vec<f64>,
    /// Checkpoint `k`: each executor's schedule before position `k * STRIDE`.
    checkpoints: Vec<Executor>,
    /// The trial's own copies, valid from `trial_from`.
    trial_finish: Vec<f64>,
    trial_peak: Vec<f64>,
    trial_total: Vec<f64>,
    trial_checkpoints: Vec<Executor>,
    executors: Vec<Executor>,
    trial: Option<Trial>,
    /// The accepted assignment's step, and the sum of its nodes' finishing times (what breaks
    /// ties between equal steps: the schedule that ends its work sooner).
    pub step: f64,
    pub sum: f64,
    /// How many assignments were scored.
    pub scored: u64,
}

struct Trial {
    /// The units moved, and where each was.
    moved: Vec<(u32, u32)>,
    from: usize,
    step: f64,
    sum: f64,
}

impl<'a> Simulator<'a> {
    pub fn new(problem: &'a Problem, assignment: Vec<u32>) -> Simulator<'a> {
        let n = problem.nodes();
        let marks = n / STRIDE + 1;
        let mut simulator = Simulator {
            problem,
            assignment,
            finish: vec![0.0; n],
            peak: vec![0.0; n],
            total: vec![0.0; n],
            checkpoints: vec![Executor::default(); marks * problem.executors],
            trial_finish: vec![0.0; n],
            trial_peak: vec![0.0; n],
            trial_total: vec![0.0; n],
            trial_checkpoints: vec![Executor::default(); marks * problem.executors],
            executors: vec![Executor::default(); problem.executors],
            trial: None,
            step: 0.0,
            sum: 0.0,
            scored: 0,
        };
        (simulator.step, simulator.sum) = simulator.run(0);
        simulator.commit(0);
        simulator
    }

    pub fn assignment(&self) -> &[u32] {
        &self.assignment
    }

    /// The step with unit `unit` on `device`, and its sum of finishing times; `accept` keeps
    /// it, and another trial or `reject` drops it.
    pub fn try_move(&mut self, unit: usize, device: u32) -> (f64, f64) {
        self.try_moves(&[unit as u32], device)
    }

    /// `try_move` of several units at once, all to `device`.
    pub fn try_moves(&mut self, units: &[u32], device: u32) -> (f64, f64) {
        self.reject();
        let mut moved = Vec::with_capacity(units.len());
        let mut first = usize::MAX;
        for &unit in units {
            moved.push((unit, self.assignment[unit as usize]));
            self.assignment[unit as usize] = device;
            first = first.min(self.problem.first[unit as usize] as usize);
        }
        let from = (first.min(self.problem.nodes()) / STRIDE) * STRIDE;
        let (step, sum) = self.run(from);
        self.trial = Some(Trial { moved, from, step, sum });
        (step, sum)
    }

    pub fn accept(&mut self) {
        if let Some(trial) = self.trial.take() {
            self.commit(trial.from);
            self.step = trial.step;
            self.sum = trial.sum;
        }
    }

    pub fn reject(&mut self) {
        if let Some(trial) = self.trial.take() {
            for (unit, was) in trial.moved.into_iter().rev() {
                self.assignment[unit as usize] = was;
            }
        }
    }

    /// Simulates from position `from` (a multiple of `STRIDE`) into the trial's buffers; the
    /// step's time and the sum of the finishing times.
    fn run(&mut self, from: usize) -> (f64, f64) {
        self.scored += 1;
        let p = self.problem;
        let e = p.executors;
        let mark = from / STRIDE;
        self.executors.copy_from_slice(&self.checkpoints[mark * e..(mark + 1) * e]);
        let (mut peak, mut total) = if from == 0 { (0.0, 0.0) } else { (self.peak[from - 1], self.total[from - 1]) };
        for pos in from..p.nodes() {
            if pos % STRIDE == 0 {
                let k = pos / STRIDE;
                self.trial_checkpoints[k * e..(k + 1) * e].copy_from_slice(&self.executors);
            }
            let device = self.assignment[p.unit[pos] as usize] as usize;
            let mut arrival = 0.0f64;
            for edge in &p.edges[p.edge_start[pos] as usize..p.edge_start[pos + 1] as usize] {
                let at = edge.from as usize;
                let done = if at < from { self.finish[at] } else { self.trial_finish[at] };
                let source = self.assignment[p.unit[at] as usize] as usize;
                let link = p.link[source * p.devices + device] as usize;
                arrival = arrival.max(done + f64::from(edge.seconds[link]));
            }
            let end = if p.seconds[pos] > 0.0 {
                self.executors[p.executor[device] as usize].run(arrival, p.seconds[pos])
            } else {
                arrival
            };
            self.trial_finish[pos] = end;
            peak = peak.max(end);
            total += end;
            self.trial_peak[pos] = peak;
            self.trial_total[pos] = total;
        }
        (peak, total)
    }

    /// Makes the trial's buffers from `from` on the accepted schedule.
    fn commit(&mut self, from: usize) {
        let e = self.problem.executors;
        self.finish[from..].copy_from_slice(&self.trial_finish[from..]);
        self.peak[from..].copy_from_slice(&self.trial_peak[from..]);
        self.total[from..].copy_from_slice(&self.trial_total[from..]);
        let mark = from / STRIDE;
        let marks = self.problem.nodes().div_ceil(STRIDE).max(1);
        self.checkpoints[mark * e..marks * e].copy_from_slice(&self.trial_checkpoints[mark * e..marks * e]);
    }
}

/// How long a search may go on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Budget {
    pub candidates: u64,
    pub seconds: f64,
}

impl Default for Budget {
    /// Enough for a thousand-node graph on 64 devices to settle, in a fraction of a second.
    fn default() -> Budget {
        Budget { candidates: 200_000, seconds: 2.0 }
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
/// budget goes.
pub fn improve(problem: &Problem, start: Vec<u32>, budget: Budget) -> Outcome {
    let clock = Instant::now();
    let mut simulator = Simulator::new(problem, start);
    let start_seconds = simulator.step;
    let mut load = vec![0.0f64; problem.devices];
    for (u, &d) in simulator.assignment().iter().enumerate() {
        load[d as usize] += problem.unit_seconds[u];
    }
    let mut order: Vec<usize> = (0..problem.units()).filter(|&u| problem.movable(u)).collect();
    order.sort_by(|&a, &b| problem.unit_seconds[b].total_cmp(&problem.unit_seconds[a]).then(a.cmp(&b)));
    let mut candidates: Vec<u32> = Vec::new();
    let mut group: Vec<u32> = Vec::new();
    let spent = |s: &Simulator| s.scored >= budget.candidates || clock.elapsed().as_secs_f64() >= budget.seconds;
    'passes: loop {
        let mut moved = false;
        for &u in &order {
            devices_to_try(problem, u, simulator.assignment(), &load, &mut candidates);
            // The unit alone, then with its neighbours on its device (a layer's ops, a chain):
            // a stretch of work that one move at a time could not carry across.
            group.clear();
            let here = simulator.assignment()[u];
            group.push(u as u32);
            group.extend(
                problem.neighbours[u]
                    .iter()
                    .copied()
                    .filter(|&v| simulator.assignment()[v as usize] == here && problem.movable(v as usize)),
            );
            let moves: &[&[u32]] = if group.len() > 1 { &[&group[..1], &group] } else { &[&group[..1]] };
            for units in moves {
                for &d in &candidates {
                    if spent(&simulator) {
                        break 'passes;
                    }
                    if units.iter().any(|&v| !problem.may_use(v as usize, d)) {
                        continue;
                    }
                    let (step, sum) = (simulator.step, simulator.sum);
                    let (new_step, new_sum) = simulator.try_moves(units, d);
                    let shorter = new_step < step * (1.0 - 1e-9);
                    let sooner = new_step <= step && new_sum < sum * (1.0 - 1e-6);
                    if shorter || sooner {
                        simulator.accept();
                        for &v in *units {
                            load[here as usize] -= problem.unit_seconds[v as usize];
                            load[d as usize] += problem.unit_seconds[v as usize];
                        }
                        moved = true;
                        break;
                    }
                }
                if simulator.assignment()[u] != here {
                    break;
                }
            }
            simulator.reject();
        }
        if !moved {
            break;
        }
    }
    simulator.reject();
    Outcome {
        step_seconds: simulator.step,
        assignment: simulator.assignment().to_vec(),
        start_seconds,
        scored: simulator.scored,
        seconds: clock.elapsed().as_secs_f64(),
    }
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
