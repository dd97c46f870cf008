//! `Program`: the nodes that some fetches and targets need, checked once, run many times;
//! `schedule`: the order that lets the partitions of a plan run side by side.

use crate::kernels;
use crate::rendezvous::Rendezvous;
use crate::scalar::Fault;
use crate::tensor::Tensor;
use crate::{InterpError, Variables};
use dfc_ir::{BinaryOp, Module, NodeId, Op, TensorRef, TensorType};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap};

/// The nodes needed for some fetches and targets, in topological order, checked once.
///
/// # Semantics of a run
///
/// Nodes run one at a time in the order of [`schedule`] (for a module alone, that of
/// `Graph::topo_order`: data and control edges, the oldest ready node first), each once. An `Input` yields its feed; a `Const` its value; a `Variable` yields the variable
/// itself, which only `Read` and the assignments use: `Read` returns a copy of the variable's
/// current value, `Assign` / `AssignAdd` / `AssignSub` (operand 0 the variable, operand 1 the
/// value) replace it with `value`, `current + value`, `current - value` when they run and
/// output the new value. Nothing orders a `Read` before or after an assignment of the same
/// variable except the graph's edges (the optimizer pass adds control edges for that).
/// Fetching a `Variable` node gives its value at the end of the run.
///
/// The ops that join partitions go through the run's [`Rendezvous`]: `Send` hands its operand
/// over under its key (it has no output; run it as a target), `Recv` waits for the tensor sent
/// under its key and checks it against its type, `AllReduce` contributes its operand and waits
/// for the sum over its group. A program may hold several replicas of one all-reduce (one
/// device running more than one replica): they contribute together.
///
/// A run is atomic: the variables are written back only if the whole run succeeds
/// ([`Program::run_staged`] leaves writing them to the caller, so that the partitions of a
/// plan can commit together). The feeds and the variables' types are checked before any node
/// runs.
#[derive(Clone, Debug)]
pub struct Program {
    steps: Vec<Step>,
    /// The step of each fetch.
    fetches: Vec<usize>,
    /// The Input nodes needed, module declaration order first.
    inputs: Vec<String>,
}

#[derive(Clone, Debug)]
struct Step {
    id: NodeId,
    name: String,
    action: Action,
    /// The type of the node's output; `None` for a node without one (`Send`).
    ty: Option<TensorType>,
    /// Steps whose values are not needed after this one.
    free_after: Vec<usize>,
}

#[derive(Clone, Debug)]
enum Action {
    Feed,
    Variable,
    Read {
        variable: String,
    },
    Assign {
        op: Op,
        variable: String,
        value: usize,
    },
    Compute {
        op: Op,
        operands: Vec<usize>,
    },
    Send {
        key: String,
        value: usize,
    },
    Recv {
        key: String,
    },
    /// `peers`: the later steps of the program that reduce under the same key (replicas on
    /// one device); they contribute together with this one.
    AllReduce {
        key: String,
        group_size: u32,
        replica: u32,
        value: usize,
        peers: Vec<usize>,
    },
}

impl Action {
    /// The steps whose values this one uses.
    fn uses(&self) -> &[usize] {
        match self {
            Action::Assign { value, .. } | Action::Send { value, .. } | Action::AllReduce { value, .. } => {
                std::slice::from_ref(value)
            }
            Action::Compute { operands, .. } => operands,
            Action::Feed | Action::Variable | Action::Read { .. } | Action::Recv { .. } => &[],
        }
    }

    fn exchanges(&self) -> bool {
        matches!(self, Action::Send { .. } | Action::Recv { .. } | Action::AllReduce { .. })
    }
}

/// What a run computed, before its assignments are written to the variables.
#[derive(Clone, Debug, PartialEq)]
pub struct StagedRun {
    /// The fetched values, in order.
    pub fetched: Vec<Tensor>,
    /// The final value of every variable the run assigned.
    pub written: Vec<(String, Tensor)>,
}

impl StagedRun {
    /// Writes the assigned values to `variables` and returns the fetched values.
    pub fn commit(self, variables: &mut Variables) -> Vec<Tensor> {
        for (name, value) in self.written {
            variables.insert(name, value);
        }
        self.fetched
    }
}

impl Program {
    /// The program computing `fetches` and running `targets` (nodes run for their effect,
    /// such as assignments and `Send`s): those nodes and all they depend on, through data and
    /// control edges, in the order of `schedule(&[module])`. Every node of it is checked to be
    /// well formed (its operands, their types against `dfc_ir::infer`, variables used only by
    /// `Read` and the assignments), so that running it can only fail on the data it is given.
    pub fn new(module: &Module, fetches: &[TensorRef], targets: &[NodeId]) -> Result<Program, InterpError> {
        let order = schedule(&[module])?.pop().expect("one order per module");
        Program::with_order(module, fetches, targets, &order)
    }

    /// Like [`Program::new`], with the nodes run in `order`, which must hold every node the
    /// program needs after all of its data and control predecessors (other nodes in it are
    /// ignored). The partitions of a plan use the orders of one [`schedule`] of them all.
    pub fn with_order(
        module: &Module,
        fetches: &[TensorRef],
        targets: &[NodeId],
        order: &[NodeId],
    ) -> Result<Program, InterpError> {
        let training = targets.iter().any(|&t| {
            module.graph.contains(t) && matches!(module.graph.node(t).op, Op::Assign | Op::AssignAdd | Op::AssignSub)
        });
        Program::with_mode(module, fetches, targets, order, training)
    }

    /// Like [`Program::with_order`], in a program that trains (`training`: dropout drops) or
    /// not (`Op::TrainingFlag`'s value). `with_order` takes a program that runs an update for
    /// one that trains; a session knows better (a partition of a training step may update
    /// nothing) and says.
    pub fn with_mode(
        module: &Module,
        fetches: &[TensorRef],
        targets: &[NodeId],
        order: &[NodeId],
        training: bool,
    ) -> Result<Program, InterpError> {
        let graph = &module.graph;
        for (i, fetch) in fetches.iter().enumerate() {
            if !graph.contains(fetch.node) || fetch.port as usize >= graph.node(fetch.node).outputs.len() {
                return Err(InterpError::UnknownNode { what: format!("fetch {i}") });
            }
        }
        for (i, target) in targets.iter().enumerate() {
            if !graph.contains(*target) {
                return Err(InterpError::UnknownNode { what: format!("target {i}") });
            }
        }
        let roots: Vec<NodeId> = fetches.iter().map(|f| f.node).chain(targets.iter().copied()).collect();
        let needed = graph.ancestors(&roots);
        let mut position: HashMap<NodeId, usize> = HashMap::with_capacity(needed.len());
        let mut ordered = Vec::with_capacity(needed.len());
        for &id in order {
            if needed.contains(&id) && !position.contains_key(&id) {
                position.insert(id, ordered.len());
                ordered.push(id);
            }
        }
        let order = ordered;
        if let Some(&missing) = needed.iter().find(|id| !position.contains_key(id)) {
            return Err(InterpError::Malformed {
                node: graph.node(missing).name.clone(),
                message: "the order given for the program leaves it out".into(),
            });
        }
        for &id in &order {
            let before = graph.data_edges_into(id).into_iter().map(|(_, t)| t.node).chain(graph.control_inputs(id));
            for pred in before {
                if position[&pred] >= position[&id] {
                    return Err(InterpError::Malformed {
                        node: graph.node(id).name.clone(),
                        message: format!("the order given for the program puts it before `{}`", graph.node(pred).name),
                    });
                }
            }
        }

        let mut steps = Vec::with_capacity(order.len());
        for &id in &order {
            let node = graph.node(id);
            let malformed = |message: String| InterpError::Malformed { node: node.name.clone(), message };
            let operands = operands(module, id).map_err(malformed)?;
            let is_variable = |t: &TensorRef| matches!(graph.node(t.node).op, Op::Variable { .. });
            let takes_variable = matches!(node.op, Op::Read | Op::Assign | Op::AssignAdd | Op::AssignSub);
            for (i, operand) in operands.iter().enumerate() {
                if is_variable(operand) != (takes_variable && i == 0) {
                    return Err(malformed(if is_variable(operand) {
                        format!("operand {i} uses a variable directly; read it first")
                    } else {
                        format!("operand {i} of `{}` must be a variable", node.op.name())
                    }));
                }
            }
            check_types(&node.op, &operands.iter().map(|t| graph.ty(*t)).collect::<Vec<_>>(), &node.outputs)
                .map_err(malformed)?;

            let variable = || graph.node(operands[0].node).name.clone();
            let action = match &node.op {
                Op::Input { .. } => Action::Feed,
                Op::Variable { .. } => Action::Variable,
                Op::Read => Action::Read { variable: variable() },
                Op::Assign | Op::AssignAdd | Op::AssignSub => {
                    Action::Assign { op: node.op.clone(), variable: variable(), value: position[&operands[1].node] }
                }
                Op::Send { key, .. } => Action::Send { key: key.clone(), value: position[&operands[0].node] },
                Op::Recv { key, .. } => Action::Recv { key: key.clone() },
                Op::AllReduce { key, group_size, replica } => Action::AllReduce {
                    key: key.clone(),
                    group_size: *group_size,
                    replica: *replica,
                    value: position[&operands[0].node],
                    peers: Vec::new(),
                },
                // A program that runs updates trains; any other evaluates or infers.
                Op::TrainingFlag => Action::Compute { op: training_flag(training), operands: Vec::new() },
                op => {
                    Action::Compute { op: op.clone(), operands: operands.iter().map(|t| position[&t.node]).collect() }
                }
            };
            steps.push(Step {
                id,
                name: node.name.clone(),
                action,
                ty: node.outputs.first().cloned(),
                free_after: Vec::new(),
            });
        }

        // Replicas of one all-reduce in this program contribute together, when the first of
        // them runs: every one's operand must be computed by then.
        let mut groups: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for (i, step) in steps.iter().enumerate() {
            if let Action::AllReduce { key, .. } = &step.action {
                groups.entry(key.as_str()).or_default().push(i);
            }
        }
        let mut peers_of: Vec<(usize, Vec<usize>)> = Vec::new();
        for members in groups.values().filter(|m| m.len() > 1) {
            let first = members[0];
            for &member in &members[1..] {
                let operand = steps[member].action.uses()[0];
                if operand >= first {
                    return Err(InterpError::Malformed {
                        node: steps[member].name.clone(),
                        message: format!(
                            "it reduces with `{}` on the same device, but its operand is computed after that one",
                            steps[first].name
                        ),
                    });
                }
            }
            peers_of.push((first, members[1..].to_vec()));
        }
        for (first, peers) in peers_of {
            if let Action::AllReduce { peers: slot, .. } = &mut steps[first].action {
                *slot = peers;
            }
        }

        // Free each value after its last use, unless it is fetched.
        let fetches: Vec<usize> = fetches.iter().map(|f| position[&f.node]).collect();
        let mut last_use: BTreeMap<usize, usize> = BTreeMap::new();
        for (i, step) in steps.iter().enumerate() {
            for &u in step.action.uses() {
                last_use.insert(u, i);
            }
        }
        for (value, last) in last_use {
            if !fetches.contains(&value) {
                steps[last].free_after.push(value);
            }
        }

        let mut inputs: Vec<(usize, String)> = steps
            .iter()
            .filter(|s| matches!(s.action, Action::Feed))
            .map(|s| (module.inputs.iter().position(|&i| i == s.id).unwrap_or(usize::MAX), s.name.clone()))
            .collect();
        inputs.sort_by_key(|(declared, _)| *declared); // stable: undeclared ones keep program order
        let inputs = inputs.into_iter().map(|(_, name)| name).collect();
        Ok(Program { steps, fetches, inputs })
    }

    /// The names of the `Input` nodes the program needs, in the module's declaration order.
    pub fn inputs(&self) -> Vec<String> {
        self.inputs.clone()
    }

    /// The number of nodes the program runs.
    pub fn len(&self) -> usize {
        self.steps.len()
    }

    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }

    /// Runs the program on `module` (the one it was built from) and returns the fetched
    /// values, in order.
    ///
    /// Inputs are fed by the `Input` node's name; every input the program needs must be fed,
    /// with exactly its type. Feeds the program does not need are ignored. The variables must
    /// hold every variable the program uses, with its declared type. On an error the
    /// variables are left as they were. A program with `Send`, `Recv` or `AllReduce` nodes
    /// needs a rendezvous: see [`Program::run_with`].
    pub fn run(
        &self,
        module: &Module,
        variables: &mut Variables,
        feeds: &HashMap<String, Tensor>,
    ) -> Result<Vec<Tensor>, InterpError> {
        if let Some(step) = self.steps.iter().find(|s| s.action.exchanges()) {
            return Err(InterpError::NoRendezvous { node: step.name.clone() });
        }
        self.run_with(module, variables, feeds, &NoRendezvous)
    }

    /// [`Program::run`], exchanging tensors with other partitions through `rendezvous`.
    pub fn run_with(
        &self,
        module: &Module,
        variables: &mut Variables,
        feeds: &HashMap<String, Tensor>,
        rendezvous: &dyn Rendezvous,
    ) -> Result<Vec<Tensor>, InterpError> {
        Ok(self.run_staged(module, variables, feeds, rendezvous)?.commit(variables))
    }

    /// Runs the program like [`Program::run_with`], but leaves the variables untouched: the
    /// values its assignments wrote are returned for [`StagedRun::commit`].
    pub fn run_staged(
        &self,
        module: &Module,
        variables: &Variables,
        feeds: &HashMap<String, Tensor>,
        rendezvous: &dyn Rendezvous,
    ) -> Result<StagedRun, InterpError> {
        let graph = &module.graph;
        for step in &self.steps {
            if !graph.contains(step.id) || graph.node(step.id).name != step.name {
                return Err(InterpError::ModuleMismatch { node: step.name.clone() });
            }
            let expected = || step.ty.clone().expect("inputs and variables have an output");
            match step.action {
                Action::Feed => {
                    let feed =
                        feeds.get(&step.name).ok_or_else(|| InterpError::MissingFeed { input: step.name.clone() })?;
                    if feed.ty() != expected() {
                        return Err(InterpError::FeedType {
                            input: step.name.clone(),
                            expected: expected(),
                            found: feed.ty(),
                        });
                    }
                }
                Action::Variable => {
                    let value = variables
                        .get(&step.name)
                        .ok_or_else(|| InterpError::MissingVariable { name: step.name.clone() })?;
                    if value.ty() != expected() {
                        return Err(InterpError::VariableType {
                            name: step.name.clone(),
                            expected: expected(),
                            found: value.ty(),
                        });
                    }
                }
                _ => {}
            }
        }

        // Values written by assignments in this run, committed at the end.
        let mut written: HashMap<&str, Tensor> = HashMap::new();
        let current = |written: &HashMap<&str, Tensor>, name: &str| -> Tensor {
            written.get(name).or_else(|| variables.get(name)).expect("variables are checked before the run").clone()
        };
        let mut values: Vec<Option<Tensor>> = vec![None; self.steps.len()];
        // All-reduce results computed ahead of their step, with an earlier replica's.
        let mut reduced: HashMap<usize, Tensor> = HashMap::new();
        for (i, step) in self.steps.iter().enumerate() {
            let value = |j: usize| values[j].as_ref().expect("an operand runs before its users and is kept until used");
            let fault = |f: Fault| f.at(&step.name);
            let result = match &step.action {
                Action::Feed => Some(feeds[&step.name].clone()),
                Action::Variable => None,
                Action::Read { variable } => Some(current(&written, variable)),
                Action::Assign { op, variable, value: v } => {
                    let old = current(&written, variable);
                    let new = match op {
                        Op::Assign => value(*v).clone(),
                        Op::AssignAdd => {
                            kernels::compute(&Op::Binary(BinaryOp::Add), &[&old, value(*v)]).map_err(fault)?
                        }
                        Op::AssignSub => {
                            kernels::compute(&Op::Binary(BinaryOp::Sub), &[&old, value(*v)]).map_err(fault)?
                        }
                        _ => unreachable!("only assignments are Action::Assign"),
                    };
                    written.insert(variable, new.clone());
                    Some(new)
                }
                Action::Compute { op, operands } => {
                    let args: Vec<&Tensor> = operands.iter().map(|&j| value(j)).collect();
                    Some(kernels::compute(op, &args).map_err(fault)?)
                }
                Action::Send { key, value: v } => {
                    // The last use hands the value over without a copy.
                    let tensor = match step.free_after.contains(v) {
                        true => values[*v].take().expect("an operand runs before its users and is kept until used"),
                        false => value(*v).clone(),
                    };
                    rendezvous.send(key, tensor)?;
                    None
                }
                Action::Recv { key } => {
                    let tensor = rendezvous.recv(key)?;
                    let expected = step.ty.clone().expect("a recv has an output");
                    if tensor.ty() != expected {
                        return Err(InterpError::RecvType {
                            node: step.name.clone(),
                            key: key.clone(),
                            expected,
                            found: tensor.ty(),
                        });
                    }
                    Some(tensor)
                }
                Action::AllReduce { key, group_size, replica, value: v, peers } => match reduced.remove(&i) {
                    Some(sum) => Some(sum),
                    None if peers.is_empty() => {
                        Some(rendezvous.all_reduce(key, *group_size, *replica, value(*v).clone())?)
                    }
                    None => {
                        let mut members = vec![(i, *replica, value(*v).clone())];
                        for &p in peers {
                            let Action::AllReduce { replica, value: pv, .. } = &self.steps[p].action else {
                                unreachable!("peers are all-reduces")
                            };
                            members.push((p, *replica, value(*pv).clone()));
                        }
                        let mut sums = reduce_together(rendezvous, key, *group_size, members)?;
                        let (_, own) = sums.remove(0);
                        reduced.extend(sums);
                        Some(own)
                    }
                },
            };
            if let Some(result) = &result {
                let expected = step.ty.as_ref().expect("a node that computes a value has an output");
                if result.ty() != *expected {
                    return Err(InterpError::WrongOutput {
                        node: step.name.clone(),
                        expected: expected.clone(),
                        found: result.ty(),
                    });
                }
            }
            values[i] = result;
            for &j in &step.free_after {
                values[j] = None;
            }
        }

        let fetched = self
            .fetches
            .iter()
            .map(|&i| match &self.steps[i].action {
                Action::Variable => current(&written, &self.steps[i].name),
                _ => values[i].clone().expect("fetched values are kept"),
            })
            .collect();
        let mut written: Vec<(String, Tensor)> =
            written.into_iter().map(|(name, value)| (name.to_string(), value)).collect();
        written.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(StagedRun { fetched, written })
    }
}

/// Several replicas of one all-reduce, contributed from one program: each on its own thread
/// but the first, since every contribution waits for all the others. Returns `(step, sum)` in
/// the order of `members`. If one fails, the rendezvous is aborted so the others stop waiting.
pub fn reduce_together(
    rendezvous: &dyn Rendezvous,
    key: &str,
    group_size: u32,
    mut members: Vec<(usize, u32, Tensor)>,
) -> Result<Vec<(usize, Tensor)>, InterpError> {
    let (first, first_replica, first_value) = members.remove(0);
    let results = std::thread::scope(|scope| {
        let handles: Vec<_> = members
            .into_iter()
            .map(|(step, replica, value)| {
                scope.spawn(move || {
                    let result = rendezvous.all_reduce(key, group_size, replica, value);
                    if let Err(e) = &result {
                        rendezvous.abort(&e.to_string());
                    }
                    (step, result)
                })
            })
            .collect();
        let own = rendezvous.all_reduce(key, group_size, first_replica, first_value);
        if let Err(e) = &own {
            rendezvous.abort(&e.to_string());
        }
        let mut results = vec![(first, own)];
        results.extend(handles.into_iter().map(|h| h.join().expect("an all-reduce contribution does not panic")));
        results
    });
    let mut sums = Vec::with_capacity(results.len());
    let mut aborted = None;
    for (step, result) in results {
        match result {
            Ok(sum) => sums.push((step, sum)),
            Err(e @ InterpError::Aborted { .. }) => aborted = aborted.or(Some(e)),
            Err(e) => return Err(e),
        }
    }
    match aborted {
        Some(e) => Err(e),
        None => Ok(sums),
    }
}

/// The rendezvous of `Program::run`, which has checked that the program exchanges nothing.
struct NoRendezvous;

impl Rendezvous for NoRendezvous {
    fn send(&self, key: &str, _: Tensor) -> Result<(), InterpError> {
        Err(InterpError::NoRendezvous { node: key.to_string() })
    }

    fn recv(&self, key: &str) -> Result<Tensor, InterpError> {
        Err(InterpError::NoRendezvous { node: key.to_string() })
    }

    fn all_reduce(&self, key: &str, _: u32, _: u32, _: Tensor) -> Result<Tensor, InterpError> {
        Err(InterpError::NoRendezvous { node: key.to_string() })
    }

    fn abort(&self, _: &str) {}
}

/// An order of the nodes of each of `modules` (the partitions of a plan) in which they can run
/// side by side, each module's nodes one at a time on its own thread, without deadlock: every
/// module's order is the restriction of one topological order of all their nodes together,
/// in which each `Send` comes before the `Recv`s of its key and the `AllReduce`s of one key
/// (replicas of one reduction) take one place, after every one's operand and before every
/// one's user. Among ready nodes a Send comes first and an all-reduce last (all-reduces in the
/// order they became ready), and otherwise the first module's oldest, so for one module
/// without all-reduces or Sends this is `Graph::topo_order`. A cycle (in the graphs, or through keys)
/// is an error naming some of its nodes.
pub fn schedule(modules: &[&Module]) -> Result<Vec<Vec<NodeId>>, InterpError> {
    // Units of scheduling: a node, or all the all-reduces of one key.
    let mut members: Vec<Vec<(usize, NodeId)>> = Vec::new();
    let mut unit_of: Vec<HashMap<NodeId, usize>> = vec![HashMap::new(); modules.len()];
    let mut groups: HashMap<&str, usize> = HashMap::new();
    let mut sends: HashMap<&str, usize> = HashMap::new();
    for (m, module) in modules.iter().enumerate() {
        for id in module.graph.node_ids() {
            let op = &module.graph.node(id).op;
            let unit = match op {
                Op::AllReduce { key, .. } => *groups.entry(key.as_str()).or_insert_with(|| {
                    members.push(Vec::new());
                    members.len() - 1
                }),
                _ => {
                    members.push(Vec::new());
                    members.len() - 1
                }
            };
            members[unit].push((m, id));
            unit_of[m].insert(id, unit);
            if let Op::Send { key, .. } = op {
                sends.entry(key.as_str()).or_insert(unit);
            }
        }
    }
    let mut successors: Vec<Vec<usize>> = vec![Vec::new(); members.len()];
    let mut pending: Vec<usize> = vec![0; members.len()];
    let mut cyclic = Vec::new();
    for (m, module) in modules.iter().enumerate() {
        let graph = &module.graph;
        for id in graph.node_ids() {
            let unit = unit_of[m][&id];
            let mut before: Vec<usize> = graph
                .data_edges_into(id)
                .into_iter()
                .map(|(_, t)| t.node)
                .chain(graph.control_inputs(id))
                .map(|pred| unit_of[m][&pred])
                .collect();
            if let Op::Recv { key, .. } = &graph.node(id).op {
                before.extend(sends.get(key.as_str()));
            }
            for pred in before {
                if pred == unit {
                    cyclic.push((m, id));
                    continue;
                }
                successors[pred].push(unit);
                pending[unit] += 1;
            }
        }
    }
    let name = |(m, id): (usize, NodeId)| modules[m].graph.node(id).name.clone();
    if !cyclic.is_empty() {
        return Err(InterpError::Cycle { nodes: cyclic.into_iter().take(5).map(name).collect() });
    }
    // A ready Send comes before anything else: it never blocks, and what receives it may be
    // waiting (a pipeline stage's activations, sent before the stage computes the next
    // micro-batch). A ready all-reduce comes after everything else:
    // it blocks until every replica is there, so each module first does all the work it can
    // without it, and every replica meets it after the same work (an all-reduce between two
    // stretches of one replica's backward pass and after another's whole would serialize them).
    // All-reduces keep the order they became ready in: the order their operands are computed
    // (the last layer's gradients first), in which an overlapped program starts them.
    let mut became_ready = 0usize;
    let mut key = |unit: usize| {
        let (m, id) = members[unit][0];
        match modules[m].graph.node(id).op {
            Op::Send { .. } => (0u8, (m, id)),
            Op::AllReduce { .. } => {
                became_ready += 1;
                (2, (became_ready, id))
            }
            _ => (1, (m, id)),
        }
    };
    let mut ready: BinaryHeap<Reverse<((u8, (usize, NodeId)), usize)>> =
        (0..members.len()).filter(|&u| pending[u] == 0).map(|u| Reverse((key(u), u))).collect();
    let mut orders: Vec<Vec<NodeId>> = modules.iter().map(|m| Vec::with_capacity(m.graph.len())).collect();
    let mut done = 0;
    while let Some(Reverse((_, unit))) = ready.pop() {
        done += 1;
        for &(m, id) in &members[unit] {
            orders[m].push(id);
        }
        for &next in &successors[unit] {
            pending[next] -= 1;
            if pending[next] == 0 {
                ready.push(Reverse((key(next), next)));
            }
        }
    }
    if done < members.len() {
        let stuck: Vec<(usize, NodeId)> =
            (0..members.len()).filter(|&u| pending[u] > 0).flat_map(|u| members[u].iter().copied()).collect();
        let nodes = stuck.iter().take(5).copied().map(name).collect();
        // All-reduces on the cycle (what is stuck and leads back into what is stuck): replicas
        // that would meet them in different orders.
        let mut on_cycle: BTreeSet<usize> = (0..members.len()).filter(|&u| pending[u] > 0).collect();
        loop {
            let sinks: Vec<usize> =
                on_cycle.iter().copied().filter(|&u| !successors[u].iter().any(|s| on_cycle.contains(s))).collect();
            if sinks.is_empty() {
                break;
            }
            for u in sinks {
                on_cycle.remove(&u);
            }
        }
        let mut keys: Vec<String> = on_cycle
            .iter()
            .flat_map(|&u| members[u].iter())
            .filter_map(|&(m, id)| match &modules[m].graph.node(id).op {
                Op::AllReduce { key, .. } => Some(key.clone()),
                _ => None,
            })
            .collect();
        keys.sort();
        keys.dedup();
        if keys.len() >= 2 {
            return Err(InterpError::CrossedAllReduces { keys, nodes });
        }
        return Err(InterpError::Cycle { nodes });
    }
    Ok(orders)
}

/// The data operands of `id`, in order, checked: numbered 0..n once each, as many as the op
/// takes, each from output 0 of a single-output node.
fn operands(module: &Module, id: NodeId) -> Result<Vec<TensorRef>, String> {
    let graph = &module.graph;
    let op = &graph.node(id).op;
    let mut edges = graph.data_edges_into(id);
    edges.sort_by_key(|(input, _)| *input);
    if edges.iter().enumerate().any(|(i, (input, _))| *input as usize != i) {
        return Err("the operands are not numbered 0..n".into());
    }
    match op.arity() {
        Some(arity) if arity != edges.len() => {
            return Err(format!("`{}` takes {arity} operand(s) but has {}", op.name(), edges.len()));
        }
        None if edges.is_empty() => return Err(format!("`{}` needs at least one operand", op.name())),
        _ => {}
    }
    for (i, (_, source)) in edges.iter().enumerate() {
        let outputs = graph.node(source.node).outputs.len();
        if source.port != 0 || outputs != 1 {
            return Err(format!("operand {i} reads output {} of a node with {outputs} output(s)", source.port));
        }
    }
    Ok(edges.into_iter().map(|(_, source)| source).collect())
}

/// Checks that `op` on operands of `types` gives `outputs`, and that a constant's data fits its
/// shape.
pub(crate) fn check_types(op: &Op, types: &[&TensorType], outputs: &[TensorType]) -> Result<(), String> {
    let inferred = dfc_ir::infer(op, types).map_err(|e| format!("ill-typed: {}", e.message))?;
    if inferred != outputs {
        let show = |ts: &[TensorType]| ts.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(", ");
        return Err(format!("its output type is {}, but `{}` gives {}", show(outputs), op.name(), show(&inferred)));
    }
    if let Op::Const { value } = op {
        if value.len() != value.shape.n_elements() {
            return Err(format!("the constant has {} values for the shape {}", value.len(), value.shape));
        }
    }
    Ok(())
}

/// `Op::TrainingFlag` as the constant a program fixes it to: `training` in a program that runs
/// updates.
pub fn training_flag(training: bool) -> Op {
    Op::Const { value: dfc_ir::ConstValue::scalar(dfc_ir::DType::Bool, if training { 1.0 } else { 0.0 }) }
}
