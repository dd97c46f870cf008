//! `Program`: the nodes that some fetches and targets need, checked once, run many times.

use crate::kernels;
use crate::scalar::Fault;
use crate::tensor::Tensor;
use crate::{InterpError, Variables};
use dfc_ir::{BinaryOp, Module, NodeId, Op, TensorRef, TensorType};
use std::collections::{BTreeMap, HashMap};

/// The nodes needed for some fetches and targets, in topological order, checked once.
///
/// # Semantics of a run
///
/// Nodes run one at a time in the order of `Graph::topo_order` (data and control edges), each
/// once. An `Input` yields its feed; a `Const` its value; a `Variable` yields the variable
/// itself, which only `Read` and the assignments use: `Read` returns a copy of the variable's
/// current value, `Assign` / `AssignAdd` / `AssignSub` (operand 0 the variable, operand 1 the
/// value) replace it with `value`, `current + value`, `current - value` when they run and
/// output the new value. Nothing orders a `Read` before or after an assignment of the same
/// variable except the graph's edges (the optimizer pass adds control edges for that).
/// Fetching a `Variable` node gives its value at the end of the run.
///
/// A run is atomic: the variables are written back only if the whole run succeeds. The feeds
/// and the variables' types are checked before any node runs.
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
    /// The type of the node's output.
    ty: TensorType,
    /// Steps whose values are not needed after this one.
    free_after: Vec<usize>,
}

#[derive(Clone, Debug)]
enum Action {
    Feed,
    Variable,
    Read { variable: String },
    Assign { op: Op, variable: String, value: usize },
    Compute { op: Op, operands: Vec<usize> },
}

impl Program {
    /// The program computing `fetches` and running `targets` (nodes run for their effect,
    /// such as assignments): those nodes and all they depend on, through data and control
    /// edges, in topological order. Every node of it is checked to be well formed (its
    /// operands, their types against `dfc_ir::infer`, variables used only by `Read` and the
    /// assignments), so that running it can only fail on the data it is given.
    pub fn new(module: &Module, fetches: &[TensorRef], targets: &[NodeId]) -> Result<Program, InterpError> {
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
        let order = graph.topo_order().map_err(|cyclic| InterpError::Cycle {
            nodes: cyclic.iter().take(5).map(|id| graph.node(*id).name.clone()).collect(),
        })?;
        let order: Vec<NodeId> = order.into_iter().filter(|id| needed.contains(id)).collect();
        let position: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &id)| (id, i)).collect();

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
                op => {
                    Action::Compute { op: op.clone(), operands: operands.iter().map(|t| position[&t.node]).collect() }
                }
            };
            steps.push(Step {
                id,
                name: node.name.clone(),
                action,
                ty: node.outputs[0].clone(),
                free_after: Vec::new(),
            });
        }

        // Free each value after its last use, unless it is fetched.
        let fetches: Vec<usize> = fetches.iter().map(|f| position[&f.node]).collect();
        let mut last_use: BTreeMap<usize, usize> = BTreeMap::new();
        for (i, step) in steps.iter().enumerate() {
            let used: &[usize] = match &step.action {
                Action::Assign { value, .. } => std::slice::from_ref(value),
                Action::Compute { operands, .. } => operands,
                _ => &[],
            };
            for &u in used {
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
    /// variables are left as they were.
    pub fn run(
        &self,
        module: &Module,
        variables: &mut Variables,
        feeds: &HashMap<String, Tensor>,
    ) -> Result<Vec<Tensor>, InterpError> {
        let graph = &module.graph;
        for step in &self.steps {
            if !graph.contains(step.id) || graph.node(step.id).name != step.name {
                return Err(InterpError::ModuleMismatch { node: step.name.clone() });
            }
            match step.action {
                Action::Feed => {
                    let feed =
                        feeds.get(&step.name).ok_or_else(|| InterpError::MissingFeed { input: step.name.clone() })?;
                    if feed.ty() != step.ty {
                        return Err(InterpError::FeedType {
                            input: step.name.clone(),
                            expected: step.ty.clone(),
                            found: feed.ty(),
                        });
                    }
                }
                Action::Variable => {
                    let value = variables
                        .get(&step.name)
                        .ok_or_else(|| InterpError::MissingVariable { name: step.name.clone() })?;
                    if value.ty() != step.ty {
                        return Err(InterpError::VariableType {
                            name: step.name.clone(),
                            expected: step.ty.clone(),
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
            };
            if let Some(result) = &result {
                if result.ty() != step.ty {
                    return Err(InterpError::WrongOutput {
                        node: step.name.clone(),
                        expected: step.ty.clone(),
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
        for (name, value) in written {
            variables.insert(name.to_string(), value);
        }
        Ok(fetched)
    }
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
