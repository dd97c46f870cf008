//! Placement: every node gets a device of the cluster.
//!
//! 1. Requests. A node's requested device (from `@device`, `device` blocks, or a strategy's
//!    replica) must match a device of the cluster; one that matches none is a diagnostic at its
//!    line naming what is missing (a warning and set aside under soft placement).
//! 2. Colocation. A variable, its reads and assignments, the nodes that name it in
//!    `colocate_with` (an optimizer's slots, a shard's lookups, a gradient's aggregation) form
//!    one group that lives on one device. Requests of a group's members must agree; when they
//!    cannot, the diagnostic names both lines.
//! 3. Variables. Groups with a variable go to the allowed variable devices by the policy:
//!    `RoundRobin` (replica_device_setter: in creation order, device after device),
//!    `Greedy` (GreedyLoadBalancingStrategy: each to the least-loaded device, load = bytes, in
//!    creation order) or `GreedySorted` (the same, largest first: at most 4/3 of the best
//!    possible maximum load, and insensitive to the order of creation).
//! 4. Compute. With a cost model (model parallelism), in topological order each node goes where
//!    it would finish first, counting its inputs' transfers (earliest-finish-time list
//!    scheduling). Otherwise a node goes where all its users are, else with its first input
//!    that is not a constant (which is copied to where it is used), else to the default
//!    device: the graph's requests and colocations decide.
//!
//! The result is a `Placed` module: the only input `partition` takes, so nothing downstream
//! can see an unplaced graph.

use crate::cost::{self, CostModel};
use crate::search::{self, Budget};
use dfc_diag::{Code, Diagnostic, Span};
use dfc_ir::{Cluster, DeviceSpec, Module, NodeId, Op};
use std::collections::{BTreeMap, BTreeSet, HashMap};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VariablePlacement {
    RoundRobin,
    Greedy,
    GreedySorted,
}

impl VariablePlacement {
    pub const NAMES: [&'static str; 3] = ["round-robin", "greedy", "greedy-sorted"];

    pub fn from_name(name: &str) -> Option<VariablePlacement> {
        match name {
            "round-robin" => Some(VariablePlacement::RoundRobin),
            "greedy" => Some(VariablePlacement::Greedy),
            "greedy-sorted" => Some(VariablePlacement::GreedySorted),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            VariablePlacement::RoundRobin => "round-robin",
            VariablePlacement::Greedy => "greedy",
            VariablePlacement::GreedySorted => "greedy-sorted",
        }
    }
}

pub struct PlaceOptions<'a> {
    pub cluster: &'a Cluster,
    /// Indices (in `cluster.devices()` order) of the devices unrequested variables may go to.
    pub variable_devices: Vec<usize>,
    /// Where unrequested compute goes when nothing else decides.
    pub default_device: usize,
    pub policy: VariablePlacement,
    /// Model parallelism: place compute by this cost model, as `model_placement` says.
    pub cost_model: Option<&'a CostModel>,
    pub model_placement: ModelPlacement,
    /// Requests the cluster cannot satisfy are warnings and set aside.
    pub soft: bool,
    /// The plan is for so many worker processes of this host (`dfc run --spawn N`): the
    /// placement search scores its moves for them.
    pub spawned_workers: Option<usize>,
}

/// How the `model` strategy spreads the units (colocation groups) over the devices.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ModelPlacement {
    /// Earliest-finish-time list scheduling of the compute; variables by the policy.
    EarliestFinish,
    /// Every unit that holds no variable on the next device in turn, in topological order:
    /// the naive placement a search is measured against.
    RoundRobin,
    /// Earliest finish, then the placement search (`search`) over compute and variables.
    Searched(Budget),
}

impl ModelPlacement {
    pub const NAMES: [&'static str; 3] = ["earliest-finish", "round-robin", "searched"];

    pub fn from_name(name: &str) -> Option<ModelPlacement> {
        match name {
            "earliest-finish" => Some(ModelPlacement::EarliestFinish),
            "round-robin" => Some(ModelPlacement::RoundRobin),
            "searched" => Some(ModelPlacement::Searched(Budget::default())),
            _ => None,
        }
    }
}

/// What the placement search found, in the search's own simulation of a step.
#[derive(Clone, Debug, PartialEq)]
pub struct SearchReport {
    pub nodes: usize,
    /// Units it could move, of all units.
    pub movable: usize,
    pub units: usize,
    pub round_robin_seconds: f64,
    pub earliest_finish_seconds: f64,
    pub searched_seconds: f64,
    /// Assignments scored, and the time the search took.
    pub scored: u64,
    pub seconds: f64,
}

/// A module whose every node has a device of its cluster.
#[derive(Clone, Debug)]
pub struct Placed {
    pub module: Module,
    /// With `ModelPlacement::Searched`: what the search found.
    pub search: Option<SearchReport>,
}

/// Assigns items of the given sizes to devices; `allowed[i]` lists item i's candidate devices
/// (never empty). Returns each item's device. The loads start at `initial`.
pub fn balance(sizes: &[u64], allowed: &[Vec<usize>], initial: &[u64], policy: VariablePlacement) -> Vec<usize> {
    let mut load = initial.to_vec();
    let mut chosen = vec![usize::MAX; sizes.len()];
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    if policy == VariablePlacement::GreedySorted {
        order.sort_by_key(|&i| std::cmp::Reverse(sizes[i])); // stable: creation order among equals
    }
    let mut cursor = 0usize;
    for i in order {
        let candidates = &allowed[i];
        let device = match policy {
            VariablePlacement::RoundRobin => {
                // The next device in cyclic order that this item may use.
                let n = load.len();
                let pick = (0..n).map(|k| (cursor + k) % n).find(|d| candidates.contains(d)).unwrap_or(candidates[0]);
                cursor = pick + 1;
                pick
            }
            VariablePlacement::Greedy | VariablePlacement::GreedySorted => {
                *candidates.iter().min_by_key(|&&d| (load[d], d)).expect("candidates are never empty")
            }
        };
        load[device] = load[device].saturating_add(sizes[i]);
        chosen[i] = device;
    }
    chosen
}

pub fn place(mut module: Module, options: &PlaceOptions) -> Result<(Placed, Vec<Diagnostic>), Vec<Diagnostic>> {
    let devices: Vec<DeviceSpec> = options.cluster.devices().into_iter().cloned().collect();
    let mut placer = Placer {
        module: &module,
        options,
        devices: &devices,
        diagnostics: Vec::new(),
        reported: BTreeSet::new(),
        search: None,
    };
    let assignment = placer.run();
    let search = placer.search.take();
    let diagnostics = placer.diagnostics;
    if diagnostics.iter().any(|d| d.is_error()) {
        return Err(diagnostics);
    }
    let assignment = assignment.expect("no errors, so every node is placed");
    for (id, device) in assignment {
        module.graph.node_mut(id).device = Some(devices[device].clone());
    }
    Ok((Placed { module, search }, diagnostics))
}

struct Placer<'a> {
    module: &'a Module,
    options: &'a PlaceOptions<'a>,
    devices: &'a [DeviceSpec],
    diagnostics: Vec<Diagnostic>,
    /// (span, request) pairs already reported: a device block yields one report, not one per op.
    reported: BTreeSet<(u32, u32, String)>,
    search: Option<SearchReport>,
}

impl Placer<'_> {
    fn run(&mut self) -> Option<BTreeMap<NodeId, usize>> {
        let graph = &self.module.graph;
        let ids: Vec<NodeId> = graph.node_ids().collect();
        let order = graph.topo_order().expect("placement runs on verified graphs");

        // 1. Requests against the cluster.
        let mut allowed: HashMap<NodeId, Vec<usize>> = HashMap::new();
        for &id in &ids {
            let Some(spec) = &graph.node(id).requested_device else { continue };
            let matching = self.options.cluster.matching(spec);
            if matching.is_empty() {
                self.no_such_device(id, spec);
            } else {
                allowed.insert(id, matching);
            }
        }

        // 2. Colocation groups.
        let mut groups = UnionFind::new(&ids);
        for &id in &ids {
            let node = graph.node(id);
            if let Some(with) = node.colocate_with {
                if graph.contains(with) {
                    groups.union(id, with);
                }
            }
            if matches!(node.op, Op::Read | Op::Assign | Op::AssignAdd | Op::AssignSub) {
                if let Some(variable) = graph.inputs(id).first() {
                    groups.union(id, variable.node);
                }
            }
        }
        let mut members: BTreeMap<NodeId, Vec<NodeId>> = BTreeMap::new();
        for &id in &ids {
            members.entry(groups.find(id)).or_default().push(id);
        }
        // A group's allowed devices: what all its members' requests allow.
        let mut group_allowed: BTreeMap<NodeId, Vec<usize>> = BTreeMap::new();
        for (root, list) in &members {
            let mut anchor: Option<(NodeId, Vec<usize>)> = None;
            // Variables first: a lookup conflicting with its table is reported at the lookup.
            let mut ordered = list.clone();
            ordered.sort_by_key(|&m| (!matches!(graph.node(m).op, Op::Variable { .. }), m));
            for m in ordered {
                let Some(mine) = allowed.get(&m) else { continue };
                match &mut anchor {
                    None => anchor = Some((m, mine.clone())),
                    Some((first, set)) => {
                        let both: Vec<usize> = set.iter().copied().filter(|d| mine.contains(d)).collect();
                        if both.is_empty() {
                            self.conflict(m, *first);
                        } else {
                            *set = both;
                        }
                    }
                }
            }
            if let Some((_, set)) = anchor {
                group_allowed.insert(*root, set);
            }
        }
        if self.diagnostics.iter().any(|d| d.is_error()) {
            return None;
        }

        let mut device_of: BTreeMap<NodeId, usize> = BTreeMap::new(); // by group root

        // 3. Variables.
        // In creation order: the order of the model's params (a partitioned variable's shards
        // stand where it stood), then other variables by id.
        let declared: HashMap<NodeId, usize> = self.module.params.iter().enumerate().map(|(i, &p)| (p, i)).collect();
        let mut variable_groups: Vec<(usize, NodeId, NodeId)> = members
            .iter()
            .filter_map(|(root, list)| {
                let variables = list.iter().filter(|&&m| matches!(graph.node(m).op, Op::Variable { .. }));
                let first = variables.map(|&m| (declared.get(&m).copied().unwrap_or(usize::MAX), m)).min()?;
                Some((first.0, first.1, *root))
            })
            .collect();
        variable_groups.sort();
        let variable_groups: Vec<NodeId> = variable_groups.into_iter().map(|(_, _, root)| root).collect();
        let mut sizes = Vec::new();
        let mut candidates = Vec::new();
        for root in &variable_groups {
            let bytes = members[root]
                .iter()
                .filter_map(|&m| match &graph.node(m).op {
                    Op::Variable { ty, .. } => Some(cost::tensor_bytes(ty)),
                    _ => None,
                })
                .fold(0u64, u64::saturating_add);
            sizes.push(bytes);
            let preferred = &self.options.variable_devices;
            let set = match group_allowed.get(root) {
                Some(set) => {
                    let within: Vec<usize> = set.iter().copied().filter(|d| preferred.contains(d)).collect();
                    if within.is_empty() {
                        set.clone()
                    } else {
                        within
                    }
                }
                None if preferred.is_empty() => (0..self.devices.len()).collect(),
                None => preferred.clone(),
            };
            candidates.push(set);
        }
        let initial = vec![0u64; self.devices.len()];
        for (root, device) in variable_groups.iter().zip(balance(&sizes, &candidates, &initial, self.options.policy)) {
            device_of.insert(*root, device);
        }

        // 4. Compute: groups that a request pins to one device, then the rest.
        for (root, set) in &group_allowed {
            if !device_of.contains_key(root) && set.len() == 1 {
                device_of.insert(*root, set[0]);
            }
        }
        match self.options.cost_model {
            Some(model) => {
                self.schedule(&order, &mut groups, &group_allowed, &mut device_of, model);
                if self.options.model_placement != ModelPlacement::EarliestFinish {
                    self.search(&order, &mut groups, &group_allowed, &mut device_of, model);
                }
            }
            None => self.follow_neighbours(&order, &mut groups, &group_allowed, &mut device_of),
        }
        Some(ids.iter().map(|&id| (id, device_of[&groups.find(id)])).collect())
    }

    /// Unplaced nodes go where all their users are, else with their first input that is not a
    /// constant, else to the default device.
    fn follow_neighbours(
        &self,
        order: &[NodeId],
        groups: &mut UnionFind,
        allowed: &BTreeMap<NodeId, Vec<usize>>,
        device_of: &mut BTreeMap<NodeId, usize>,
    ) {
        let graph = &self.module.graph;
        let fits = |root: NodeId, d: usize| allowed.get(&root).is_none_or(|set| set.contains(&d));
        for &id in order.iter().rev() {
            let root = groups.find(id);
            if device_of.contains_key(&root) {
                continue;
            }
            let users: Vec<Option<usize>> =
                graph.users(id).iter().map(|&u| device_of.get(&groups.find(u)).copied()).collect();
            if let Some(Some(first)) = users.first() {
                if users.iter().all(|u| *u == Some(*first)) && fits(root, *first) {
                    device_of.insert(root, *first);
                }
            }
        }
        for &id in order {
            let root = groups.find(id);
            if device_of.contains_key(&root) {
                continue;
            }
            // A constant is copied to each device that uses it (`partition`), so it does not
            // decide where its users go.
            let copied = |t: &&dfc_ir::TensorRef| {
                matches!(graph.node(t.node).op, Op::Const { .. }) && graph.control_inputs(t.node).is_empty()
            };
            let from_inputs = graph
                .inputs(id)
                .iter()
                .filter(|t| !copied(t))
                .filter_map(|t| device_of.get(&groups.find(t.node)).copied())
                .find(|&d| fits(root, d));
            let from_users = || {
                graph.users(id).iter().filter_map(|&u| device_of.get(&groups.find(u)).copied()).find(|&d| fits(root, d))
            };
            let fallback = || match allowed.get(&root) {
                Some(set) if !set.contains(&self.options.default_device) => set[0],
                _ => self.options.default_device,
            };
            let device = from_inputs.or_else(from_users).unwrap_or_else(fallback);
            device_of.insert(root, device);
        }
    }

    /// Earliest-finish-time list scheduling over the devices each node may use.
    fn schedule(
        &self,
        order: &[NodeId],
        groups: &mut UnionFind,
        allowed: &BTreeMap<NodeId, Vec<usize>>,
        device_of: &mut BTreeMap<NodeId, usize>,
        model: &CostModel,
    ) {
        let graph = &self.module.graph;
        let all: Vec<usize> = (0..self.devices.len()).collect();
        let mut ready_at = vec![0.0f64; self.devices.len()];
        let mut finish: HashMap<NodeId, f64> = HashMap::new();
        // Hosts with profiles of their own compute at their own speed.
        let slowness: Vec<f64> = self.devices.iter().map(|d| search::slowness(model, d)).collect();
        for &id in order {
            let root = groups.find(id);
            let inputs = graph.inputs(id);
            let controls = graph.control_inputs(id);
            let seconds = cost::node_flops(graph, id) / model.flops_per_second;
            let start_on = |d: usize, device_of: &BTreeMap<NodeId, usize>, groups: &mut UnionFind| -> f64 {
                let mut start = ready_at[d];
                for t in &inputs {
                    let Some(&from) = device_of.get(&groups.find(t.node)) else { continue };
                    let bytes = cost::tensor_bytes(graph.ty(*t));
                    let arrive = finish.get(&t.node).copied().unwrap_or(0.0)
                        + cost::transfer_seconds(bytes, &self.devices[from], &self.devices[d], model);
                    start = start.max(arrive);
                }
                for c in &controls {
                    start = start.max(finish.get(c).copied().unwrap_or(0.0));
                }
                start
            };
            let device = match device_of.get(&root) {
                Some(&d) => d,
                None => {
                    let set = allowed.get(&root).unwrap_or(&all);
                    let mut best = (f64::INFINITY, set[0]);
                    for &d in set {
                        let end = start_on(d, device_of, groups) + seconds * slowness[d];
                        if end < best.0 {
                            best = (end, d);
                        }
                    }
                    device_of.insert(root, best.1);
                    best.1
                }
            };
            let end = start_on(device, device_of, groups) + seconds * slowness[device];
            ready_at[device] = end;
            finish.insert(id, end);
        }
    }

    /// Round-robin or searched placement, from the earliest-finish one in `device_of`.
    fn search(
        &mut self,
        order: &[NodeId],
        groups: &mut UnionFind,
        allowed: &BTreeMap<NodeId, Vec<usize>>,
        device_of: &mut BTreeMap<NodeId, usize>,
        model: &CostModel,
    ) {
        let module = self.module;
        let graph = &module.graph;
        let mut roots: Vec<NodeId> = Vec::new();
        let mut unit_of: HashMap<NodeId, u32> = HashMap::with_capacity(order.len());
        let mut index: HashMap<NodeId, u32> = HashMap::new();
        for &id in order {
            let root = groups.find(id);
            let unit = *index.entry(root).or_insert_with(|| {
                roots.push(root);
                (roots.len() - 1) as u32
            });
            unit_of.insert(id, unit);
        }
        let allowed_units: Vec<Vec<u32>> = roots
            .iter()
            .map(|r| allowed.get(r).map_or_else(Vec::new, |set| set.iter().map(|&d| d as u32).collect()))
            .collect();
        let mut holds_variable = vec![false; roots.len()];
        for &id in order {
            if matches!(graph.node(id).op, Op::Variable { .. }) {
                holds_variable[unit_of[&id] as usize] = true;
            }
        }
        let cluster = self.options.cluster;
        let hosts: Vec<Option<String>> = self.devices.iter().map(|d| cost::host_of(cluster, d)).collect();
        // With `--spawn N`, the devices' worker processes as `dfc run --spawn N` gives them out
        // (all the devices taken as having work: the placement decides which do).
        let spawned = self.options.spawned_workers.and_then(|n| {
            let devices: Vec<&DeviceSpec> = self.devices.iter().collect();
            let assignment = dfc_ir::assign_workers(&devices, cluster, n).ok()?;
            let cores = model.profile.as_ref().map_or(1, |p| p.cpu.threads as usize);
            Some(cost::Topology::spawned(&assignment.partition_worker, assignment.names.len(), cores))
        });
        let links = |a: usize, b: usize| {
            let (x, y) = (&self.devices[a], &self.devices[b]);
            if let Some(spawned) = &spawned {
                cost::link_between(spawned, a, b)
            } else if a == b {
                cost::Link::Same
            } else if cost::same_task(x, y) {
                cost::Link::Process
            } else if hosts[a].is_some() && hosts[a] == hosts[b] {
                cost::Link::Host
            } else {
                cost::Link::Network
            }
        };
        let share = match (&spawned, &model.profile) {
            (Some(spawned), Some(profile)) => {
                let (threads, slower) = spawned.compute_shares(self.devices.len(), |_| profile.cpu.threads)[0];
                search::Share { threads, slower }
            }
            _ => search::Share { slower: oversubscription(self.devices, &hosts, model), ..search::Share::ALL },
        };
        let units = search::Units { order, unit_of: &unit_of, allowed: allowed_units };
        let problem = search::Problem::new(module, units, self.devices, links, model, share);
        let earliest: Vec<u32> = roots.iter().map(|r| device_of[r] as u32).collect();
        let round_robin = problem.round_robin(&earliest, |u| !holds_variable[u]);
        let chosen = match self.options.model_placement {
            ModelPlacement::Searched(budget) => {
                // From the earliest-finish placement and from round-robin, half the budget each.
                let half = budget.half();
                let from_earliest = search::improve(&problem, earliest.clone(), half);
                let from_round_robin = search::improve(&problem, round_robin.clone(), half);
                let scored = from_earliest.scored + from_round_robin.scored;
                let seconds = from_earliest.seconds + from_round_robin.seconds;
                let mut outcome = if from_round_robin.step_seconds < from_earliest.step_seconds {
                    search::Outcome { start_seconds: from_earliest.start_seconds, ..from_round_robin }
                } else {
                    from_earliest
                };
                (outcome.scored, outcome.seconds) = (scored, seconds);
                self.search = Some(SearchReport {
                    nodes: problem.nodes(),
                    movable: problem.movable_units(),
                    units: problem.units(),
                    round_robin_seconds: problem.step_seconds(&round_robin),
                    earliest_finish_seconds: outcome.start_seconds,
                    searched_seconds: outcome.step_seconds,
                    scored: outcome.scored,
                    seconds: outcome.seconds,
                });
                outcome.assignment
            }
            _ => round_robin,
        };
        for (root, device) in roots.iter().zip(chosen) {
            device_of.insert(*root, device as usize);
        }
    }

    fn span(&self, id: NodeId) -> Span {
        self.module.graph.span(id).unwrap_or(Span::new(0, 0))
    }

    /// Where `id`'s device request is written, else its own span.
    fn request_span(&self, id: NodeId) -> Span {
        self.module.graph.request_span(id).unwrap_or_else(|| self.span(id))
    }

    fn no_such_device(&mut self, id: NodeId, spec: &DeviceSpec) {
        let span = self.request_span(id);
        if !self.reported.insert((span.start, span.end, spec.to_string())) {
            return;
        }
        let reason = self.options.cluster.explain_mismatch(spec);
        let devices: Vec<String> = self.devices.iter().map(|d| d.to_string()).collect();
        let shown = if devices.len() > 4 {
            format!("{}, ... ({} in all)", devices[..4].join(", "), devices.len())
        } else {
            devices.join(", ")
        };
        let message = format!("device {spec} is not in the cluster: {reason}");
        let diagnostic = if self.options.soft {
            Diagnostic::warning(Code::SOFT_PLACEMENT, span, format!("{message}; placing it where the strategy puts it"))
                .with_label("set aside")
        } else {
            Diagnostic::error(Code::NO_SUCH_DEVICE, span, message)
                .with_label(format!("asks for {spec}"))
                .with_help(format!(
                    "the cluster's devices are {shown}; describe the cluster with --cluster FILE, or compile with --soft-placement"
                ))
        };
        self.diagnostics.push(diagnostic);
    }

    /// `culprit` must live with `anchor` but their requests share no device.
    fn conflict(&mut self, culprit: NodeId, anchor: NodeId) {
        let graph = &self.module.graph;
        let (c, a) = (graph.node(culprit), graph.node(anchor));
        let why = colocation_reason(graph, culprit, anchor);
        let (cs, as_) =
            (c.requested_device.clone().unwrap_or_default(), a.requested_device.clone().unwrap_or_default());
        let span = self.request_span(culprit);
        if !self.reported.insert((span.start, span.end, format!("{cs}~{as_}"))) {
            return;
        }
        let message = format!(
            "`{}` must be placed with `{}` ({why}), but it asks for {cs} and `{}` asks for {as_}",
            c.name, a.name, a.name
        );
        let diagnostic = if self.options.soft {
            Diagnostic::warning(
                Code::SOFT_PLACEMENT,
                span,
                format!("{message}; the request of `{}` is set aside", c.name),
            )
        } else {
            Diagnostic::error(Code::PLACEMENT_CONFLICT, span, message)
                .with_label(format!("asks for {cs}"))
                .with_secondary(self.request_span(anchor), format!("`{}` asks for {as_} here", a.name))
                .with_help("make the two requests agree, or drop one of them")
        };
        self.diagnostics.push(diagnostic);
    }
}

/// With a profile, how much slower than its all-cores rates a device computes: its host's
/// tasks each ask for all of its cores (the most crowded host's share, as `estimate_on` counts
/// a host's processes).
fn oversubscription(devices: &[DeviceSpec], hosts: &[Option<String>], model: &CostModel) -> f64 {
    if model.profile.is_none() {
        return 1.0;
    }
    let mut tasks: BTreeMap<Option<&String>, BTreeSet<(Option<&String>, Option<u32>)>> = BTreeMap::new();
    for (device, host) in devices.iter().zip(hosts) {
        tasks.entry(host.as_ref()).or_default().insert((device.job.as_ref(), device.task));
    }
    tasks.values().map(|t| t.len()).max().unwrap_or(1).max(1) as f64
}

/// Why two nodes are in one colocation group, in words.
fn colocation_reason(graph: &dfc_ir::Graph, a: NodeId, b: NodeId) -> &'static str {
    let ops = [&graph.node(a).op, &graph.node(b).op];
    if ops.iter().any(|op| matches!(op, Op::Gather)) {
        "a lookup runs where its shard lives"
    } else if ops.iter().any(|op| matches!(op, Op::Assign | Op::AssignAdd | Op::AssignSub)) {
        "an update lives with its variable"
    } else if ops.iter().all(|op| matches!(op, Op::Variable { .. })) {
        "an optimizer's slot lives with its variable"
    } else {
        "they are colocated"
    }
}

struct UnionFind {
    parent: HashMap<NodeId, NodeId>,
}

impl UnionFind {
    fn new(ids: &[NodeId]) -> UnionFind {
        UnionFind { parent: ids.iter().map(|&id| (id, id)).collect() }
    }

    fn find(&mut self, id: NodeId) -> NodeId {
        let mut root = id;
        while self.parent[&root] != root {
            root = self.parent[&root];
        }
        let mut at = id;
        while at != root {
            let next = self.parent[&at];
            self.parent.insert(at, root);
            at = next;
        }
        root
    }

    /// Joins two groups; the older root (smaller id) stays the root.
    fn union(&mut self, a: NodeId, b: NodeId) {
        let (ra, rb) = (self.find(a), self.find(b));
        if ra != rb {
            let (keep, drop) = if ra < rb { (ra, rb) } else { (rb, ra) };
            self.parent.insert(drop, keep);
        }
    }
}
