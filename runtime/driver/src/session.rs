//! `Session`: runs any plan — one partition or many — in one process, one thread per partition.
//!
//! A session holds the variables of every partition and builds [`SessionProgram`]s from names:
//! what to fetch (named outputs and metrics, or node names) and what to run for its effect
//! (node names, such as the plan's updates). Each name belongs to one partition; a program
//! then closes over what crosses partitions — the `Send` of every key a needed `Recv` waits
//! for, every replica of a needed all-reduce — until nothing more is needed, and partitions
//! that need nothing sit the program out. Running it runs one `dfc_interp::Program` per
//! partition, each on its own thread with its own variables, meeting through a fresh
//! `InProcessRendezvous` per run. The nodes run in the orders of one `dfc_interp::schedule`
//! of all the partitions, so they cannot wait for each other in a circle.
//!
//! A run is atomic across partitions: the variables are written only if every partition
//! succeeds. A partition that fails aborts the rendezvous, so the others stop waiting, and
//! the run reports the failure itself (not the others' "aborted").
//!
//! Checkpoints hold the logical variables: every variable that is not a replica's copy
//! (`origin.mirror_of`), under its node name (a shard keeps its shard's name). Restoring sets
//! those and copies each mirror's value from the variable it mirrors, so a checkpoint does
//! not depend on how many replicas a mirrored plan has.

use crate::train::RunError;
use dfc_cpu::{CpuError, Jitted, NativeProgram};
use dfc_cuda::program::{GpuKernels, GpuPartition, GpuProgram, ProgramError};
use dfc_interp::{InProcessRendezvous, InterpError, Program, Rendezvous, StagedRun, Tensor, Variables};
use dfc_ir::{DeviceSpec, Module, NodeId, Op, TensorRef};
use dfc_plan::Plan;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

/// Which of a program's nodes a run runs: all of them, or (for a worker that serves several
/// free-running replicas) those that assign nothing and wait on nothing computed from the
/// partition's own part of the step or in another's second stage, or the rest
/// (`Session::second_stage`). A parameter server's first stage reads and
/// sends the variables, and looks up rows of them by ids a replica sends (which it computes
/// from its batch alone); the second receives what the replica computed from them (its
/// gradients) and applies it, and counts the step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Stage {
    #[default]
    Whole,
    BeforeRecvs,
    AfterRecvs,
}

/// What runs a partition's nodes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Backend {
    /// Native code: the plan's fused kernels generated for this CPU and JIT-compiled through
    /// LLVM (`dfc_cpu`).
    #[default]
    Llvm,
    /// The reference interpreter (`dfc_interp`): slow, plainly right.
    Interp,
    /// As `Llvm`, but a GPU partition runs on this CPU with its GPU kernels, each launch thread
    /// by thread through the grid emulator (`dfc_cuda::program`): slow; for checking a GPU
    /// plan where there is no GPU.
    GridEmulator,
}

/// The variables of a plan's partitions, and the programs that run over them.
pub struct Session<'p> {
    plan: &'p Plan,
    backend: Backend,
    /// One per partition.
    variables: Vec<Variables>,
    /// Every node, by its (plan-wide unique) name.
    nodes: HashMap<&'p str, (usize, NodeId)>,
    /// Named outputs and metrics of the partitions' modules.
    outputs: HashMap<&'p str, (usize, TensorRef)>,
    sends: HashMap<&'p str, (usize, NodeId)>,
    /// The partition that receives each key's tensor.
    receivers: HashMap<&'p str, usize>,
    reductions: HashMap<&'p str, Vec<(usize, NodeId)>>,
    /// `dfc_interp::schedule` of all the partitions.
    orders: Vec<Vec<NodeId>>,
    /// The variables a checkpoint holds: `(partition, name)`.
    logical: Vec<(usize, &'p str)>,
    /// Replicas' copies: `(partition, name, partition of the original, its name)`.
    mirrors: Vec<(usize, &'p str, usize, &'p str)>,
    /// Per hosted partition, with the LLVM backend: its kernels' machine code.
    native: Vec<Option<Arc<Jitted>>>,
    /// Per partition, its GPU kernels, loaded into its GPU (`Llvm`) or compiled for the grid
    /// emulator (`GridEmulator`) (hosted GPU partitions).
    gpu: Vec<Option<(Arc<GpuPartition>, GpuKernels)>>,
    /// The partitions this session runs (all, but on a worker of a distributed run).
    hosted: Vec<bool>,
    /// `second_stage`, found once the first staged program asks for it.
    second_stage: std::sync::OnceLock<Vec<HashSet<NodeId>>>,
}

/// What one run of a session computes: a `Program` for each partition that takes part.
#[derive(Debug)]
pub struct SessionProgram {
    parts: Vec<Part>,
    /// Where each fetch comes from: `(index in parts, index in that part's fetches)`; `None`
    /// for a fetch of a partition the session does not host.
    fetches: Vec<Option<(usize, usize)>>,
    inputs: Vec<String>,
    /// The partitions the hosted parts send to, and those they receive from.
    sends_to: BTreeSet<usize>,
    receives_from: BTreeSet<usize>,
}

#[derive(Debug)]
struct Part {
    partition: usize,
    program: Executable,
}

#[derive(Debug)]
enum Executable {
    Interp(Program),
    Native(NativeProgram),
    Gpu(GpuProgram),
}

impl Executable {
    fn inputs(&self) -> Vec<String> {
        match self {
            Executable::Interp(program) => program.inputs(),
            Executable::Native(program) => program.inputs(),
            Executable::Gpu(program) => program.inputs(),
        }
    }
}

/// What one partition's run gives: the interpreter stages its assignments, native code has
/// made them.
enum PartRun {
    Staged(StagedRun),
    Done(Vec<Tensor>),
}

impl SessionProgram {
    /// The `Input` nodes the program needs, in the plan's declaration order.
    pub fn inputs(&self) -> Vec<String> {
        self.inputs.clone()
    }

    /// The ops of the native programs that run through the interpreter's kernels.
    pub fn library_ops(&self) -> Vec<String> {
        self.parts
            .iter()
            .flat_map(|p| match &p.program {
                Executable::Native(program) => program.library_ops(),
                Executable::Gpu(program) => program.schedule().library_ops(),
                Executable::Interp(_) => Vec::new(),
            })
            .collect()
    }

    /// The steps of the GPU programs that run on the host (see `GpuProgram::host_steps`).
    pub fn host_steps(&self) -> Vec<String> {
        self.parts
            .iter()
            .flat_map(|p| match &p.program {
                Executable::Gpu(program) => program.host_steps(),
                Executable::Native(_) | Executable::Interp(_) => Vec::new(),
            })
            .collect()
    }

    /// The updates of the native programs that run as one matrix product into their variable.
    pub fn folded_updates(&self) -> Vec<String> {
        self.parts
            .iter()
            .flat_map(|p| match &p.program {
                Executable::Native(program) => program.folded_updates(),
                Executable::Gpu(program) => program.schedule().folded_updates.clone(),
                Executable::Interp(_) => Vec::new(),
            })
            .collect()
    }

    /// The kernels of the native programs that scale bytes fed in and do not run: their products read the
    /// bytes.
    pub fn bytes_read(&self) -> Vec<String> {
        self.of_native(NativeProgram::bytes_read)
    }

    /// How many products of the native programs read bytes fed in times a variable that the program also writes
    /// (a training step's first layer, split along its reduction).
    pub fn bytes_times_rewritten(&self) -> usize {
        let count = |part: &Part| match &part.program {
            Executable::Native(program) => program.bytes_times_rewritten(),
            Executable::Gpu(_) | Executable::Interp(_) => 0,
        };
        self.parts.iter().map(count).sum()
    }

    /// The variables whose packed panels the native programs keep between runs, their products reading them there.
    pub fn kept_weights(&self) -> Vec<String> {
        self.of_native(NativeProgram::kept_weights)
    }

    /// The kernels of the native programs (a bias, then a relu) computed by the product they follow.
    pub fn fused_products(&self) -> Vec<String> {
        self.of_native(NativeProgram::fused_products)
    }

    /// The kernels of the native programs that sum a fused product's columns, computed by the product instead.
    pub fn summed_columns(&self) -> Vec<String> {
        self.of_native(NativeProgram::summed_columns)
    }

    /// The convolutions of the native programs computed with the max pooling that reads them, never stored.
    pub fn pooled_convolutions(&self) -> Vec<String> {
        self.of_native(NativeProgram::pooled_convolutions)
    }

    /// The kernels of the native programs (a bias, then a relu) computed by the pooled convolution they follow.
    pub fn pooled_epilogues(&self) -> Vec<String> {
        self.of_native(NativeProgram::pooled_epilogues)
    }

    /// `list` of each native program, one after another (other programs have none).
    fn of_native(&self, list: fn(&NativeProgram) -> Vec<String>) -> Vec<String> {
        self.parts
            .iter()
            .flat_map(|p| match &p.program {
                Executable::Native(program) => list(program),
                Executable::Gpu(_) | Executable::Interp(_) => Vec::new(),
            })
            .collect()
    }

    /// The indices of the fetches that this session's partitions compute.
    pub fn hosted_fetches(&self) -> Vec<usize> {
        self.fetches.iter().enumerate().filter(|(_, f)| f.is_some()).map(|(i, _)| i).collect()
    }

    /// The partitions (indices into `plan.partitions`) that take part, in order.
    pub fn partitions(&self) -> Vec<usize> {
        self.parts.iter().map(|p| p.partition).collect()
    }

    /// The partitions (indices into `plan.partitions`) a run of it sends tensors to.
    pub fn sends_to(&self) -> &BTreeSet<usize> {
        &self.sends_to
    }

    /// The partitions a run of it may wait for tensors from.
    pub fn receives_from(&self) -> &BTreeSet<usize> {
        &self.receives_from
    }
}

/// The type a variable of the plan is declared with.
fn variable_type(plan: &Plan, nodes: &HashMap<&str, (usize, NodeId)>, name: &str) -> Option<dfc_ir::TensorType> {
    let &(p, id) = nodes.get(name)?;
    match &plan.partitions[p].module.graph.node(id).op {
        Op::Variable { ty, .. } => Some(ty.clone()),
        _ => None,
    }
}

/// A schedule's error, with where the model makes the all-reduces that replicas would reach in
/// different orders (`at FILE:LINE` where the source is at hand).
fn located(plan: &Plan, error: InterpError) -> RunError {
    let InterpError::CrossedAllReduces { keys, .. } = &error else { return error.into() };
    let source = crate::source::PlanSource::of(plan);
    let places: Vec<String> = keys
        .iter()
        .filter_map(|key| {
            plan.partitions.iter().find_map(|partition| {
                let graph = &partition.module.graph;
                let id = graph
                    .node_ids()
                    .find(|&id| matches!(&graph.node(id).op, Op::AllReduce { key: k, .. } if k == key))?;
                Some(format!("`{key}` {}", source.location(graph, id)))
            })
        })
        .collect();
    RunError::Plan(format!("{error}; made {}", places.join(", ")))
}

/// Closes a program's `roots` (per partition) over what crosses partitions, to a fixed point:
/// the Send of every key a needed Recv waits for, and every replica of a needed all-reduce.
/// Returns the keys of the all-reduces the program runs.
fn close_over_partitions(
    plan: &Plan,
    sends: &HashMap<&str, (usize, NodeId)>,
    reductions: &HashMap<&str, Vec<(usize, NodeId)>>,
    roots: &mut [BTreeSet<NodeId>],
) -> BTreeSet<String> {
    let mut keys = BTreeSet::new();
    loop {
        let mut more: Vec<(usize, NodeId)> = Vec::new();
        for (p, partition_roots) in roots.iter().enumerate() {
            if partition_roots.is_empty() {
                continue;
            }
            let graph = &plan.partitions[p].module.graph;
            for id in graph.ancestors(&partition_roots.iter().copied().collect::<Vec<_>>()) {
                match &graph.node(id).op {
                    Op::Recv { key, .. } => more.extend(sends.get(key.as_str())),
                    Op::AllReduce { key, .. } => {
                        more.extend(reductions.get(key.as_str()).into_iter().flatten());
                        keys.insert(key.clone());
                    }
                    _ => {}
                }
            }
        }
        let mut grew = false;
        for (p, id) in more {
            grew |= roots[p].insert(id);
        }
        if !grew {
            return keys;
        }
    }
}

/// The all-reduces (by key: one per group of replicas, a fused bucket once) that one run of
/// the program of the nodes named `nodes` performs, over every partition of `plan`: what the
/// training loop counts, the same for a `Session` and for workers.
pub fn all_reduce_keys(plan: &Plan, nodes: &[&str]) -> Result<BTreeSet<String>, RunError> {
    Ok(program_nodes(plan, nodes)?.1)
}

/// Each partition of `plan` as the program of the nodes named `nodes` runs it (the nodes it
/// computes there): what the cost model predicts that program's step from.
pub fn program_modules(plan: &Plan, nodes: &[&str]) -> Result<Vec<Module>, RunError> {
    let (roots, _) = program_nodes(plan, nodes)?;
    plan.partitions
        .iter()
        .zip(roots)
        .map(|(partition, roots)| {
            let roots: Vec<NodeId> = roots.into_iter().collect();
            dfc_passes::prune(&partition.module, &[], &[], &roots)
                .map_err(|e| malformed(format!("a partition cannot be cut to its program: {e:?}")))
        })
        .collect()
}

/// Per partition, what one run of the program of the nodes named `nodes` needs computed there
/// (closed over the transfers and all-reduces between partitions), and the all-reduces it runs.
fn program_nodes(plan: &Plan, nodes: &[&str]) -> Result<(Vec<BTreeSet<NodeId>>, BTreeSet<String>), RunError> {
    let mut named: HashMap<&str, (usize, NodeId)> = HashMap::new();
    let mut sends: HashMap<&str, (usize, NodeId)> = HashMap::new();
    let mut reductions: HashMap<&str, Vec<(usize, NodeId)>> = HashMap::new();
    for (p, partition) in plan.partitions.iter().enumerate() {
        let graph = &partition.module.graph;
        for id in graph.node_ids() {
            let node = graph.node(id);
            named.insert(node.name.as_str(), (p, id));
            match &node.op {
                Op::Send { key, .. } => {
                    sends.insert(key.as_str(), (p, id));
                }
                Op::AllReduce { key, .. } => reductions.entry(key.as_str()).or_default().push((p, id)),
                _ => {}
            }
        }
    }
    let mut roots: Vec<BTreeSet<NodeId>> = vec![BTreeSet::new(); plan.partitions.len()];
    for name in nodes {
        let &(p, id) = named.get(name).ok_or_else(|| RunError::Usage(format!("the plan has no node `{name}`")))?;
        roots[p].insert(id);
    }
    let keys = close_over_partitions(plan, &sends, &reductions, &mut roots);
    Ok((roots, keys))
}

fn malformed(message: String) -> RunError {
    RunError::Plan(format!("the plan is malformed: {message}"))
}

impl<'p> Session<'p> {
    /// A session over `plan` with every variable at its initial value for `seed`
    /// (`dfc_interp::initialize` of each partition). Checks that the partitions fit together:
    /// unique node names, `dfc_ir::verify_partitions` (Send/Recv pairs, devices, all-reduce
    /// groups), mirrors of existing variables of their own type.
    pub fn new(plan: &'p Plan, seed: u64) -> Result<Session<'p>, RunError> {
        Session::with_backend(plan, seed, Backend::Interp)
    }

    /// Like [`Session::new`], running the partitions on `backend`.
    pub fn with_backend(plan: &'p Plan, seed: u64, backend: Backend) -> Result<Session<'p>, RunError> {
        let all: Vec<usize> = (0..plan.partitions.len()).collect();
        Session::hosting(plan, seed, backend, &all)
    }

    /// A session that runs only the partitions `hosted` (a worker's share of a distributed
    /// run); the others' parts of a program run elsewhere, meeting this one's through the
    /// rendezvous given to [`Session::run_with`]. It holds the variables of the hosted
    /// partitions only: a copy whose original is elsewhere starts from the original's initial
    /// value (or restored value), computed here, as every worker computes it alike.
    pub fn hosting(plan: &'p Plan, seed: u64, backend: Backend, hosted: &[usize]) -> Result<Session<'p>, RunError> {
        if !plan.instances.is_empty() {
            return Err(malformed("the plan's replica instances are not built: `Plan::expand_instances` builds them, as `dfc_plan::decode` does".into()));
        }
        if let Some(&p) = hosted.iter().find(|&&p| p >= plan.partitions.len()) {
            return Err(malformed(format!("there is no partition {p}")));
        }
        let hosted: Vec<bool> = (0..plan.partitions.len()).map(|p| hosted.contains(&p)).collect();
        let mut nodes: HashMap<&str, (usize, NodeId)> = HashMap::new();
        let mut outputs: HashMap<&str, (usize, TensorRef)> = HashMap::new();
        let mut sends: HashMap<&str, (usize, NodeId)> = HashMap::new();
        let mut receivers: HashMap<&str, usize> = HashMap::new();
        let mut reductions: HashMap<&str, Vec<(usize, NodeId)>> = HashMap::new();
        let mut logical = Vec::new();
        let mut copies = Vec::new();
        for (p, partition) in plan.partitions.iter().enumerate() {
            let graph = &partition.module.graph;
            for id in graph.node_ids() {
                let node = graph.node(id);
                if nodes.insert(node.name.as_str(), (p, id)).is_some() {
                    return Err(malformed(format!("two partitions have a node `{}`", node.name)));
                }
                match &node.op {
                    Op::Send { key, .. } => {
                        sends.insert(key.as_str(), (p, id));
                    }
                    Op::Recv { key, .. } => {
                        receivers.insert(key.as_str(), p);
                    }
                    Op::AllReduce { key, .. } => reductions.entry(key.as_str()).or_default().push((p, id)),
                    Op::Variable { origin, .. } => match origin.as_ref().and_then(|o| o.mirror_of.as_deref()) {
                        None => logical.push((p, node.name.as_str())),
                        Some(of) => copies.push((p, node.name.as_str(), of)),
                    },
                    _ => {}
                }
            }
            for output in partition.module.outputs.iter().chain(&partition.module.metrics) {
                if !graph.contains(output.tensor.node) || graph.node(output.tensor.node).outputs.is_empty() {
                    return Err(malformed(format!("output `{}` names no node", output.name)));
                }
                outputs.insert(output.name.as_str(), (p, output.tensor));
            }
        }
        // Send/Recv pairs, keys, devices and all-reduce groups: the IR's own check.
        let parts: Vec<(&DeviceSpec, &Module)> = plan.partitions.iter().map(|p| (&p.device, &p.module)).collect();
        if let Some(problem) = dfc_ir::verify_partitions(&parts).into_iter().next() {
            return Err(malformed(problem.message));
        }
        let mut mirrors = Vec::new();
        for (p, name, of) in copies {
            let original = logical.iter().find(|(_, n)| *n == of).copied();
            let Some((q, of)) = original else {
                return Err(malformed(format!("`{name}` mirrors `{of}`, which is not a variable of the plan")));
            };
            if variable_type(plan, &nodes, name) != variable_type(plan, &nodes, of) {
                return Err(malformed(format!("`{name}` mirrors `{of}` but has another type")));
            }
            if hosted[p] {
                mirrors.push((p, name, q, of));
            }
        }
        check_memory(plan, &hosted)?;
        let originals: BTreeSet<&str> = mirrors.iter().map(|&(_, _, _, of)| of).collect();
        let mut variables = Vec::with_capacity(plan.partitions.len());
        for (p, partition) in plan.partitions.iter().enumerate() {
            let keep = |name: &str| hosted[p] || originals.contains(name);
            variables.push(dfc_interp::try_initialize_some(&partition.module, seed, &keep)?);
        }
        let modules: Vec<&dfc_ir::Module> = plan.partitions.iter().map(|p| &p.module).collect();
        let orders = dfc_interp::schedule(&modules).map_err(|e| located(plan, e))?;
        let mut native = Vec::with_capacity(plan.partitions.len());
        let mut gpu: Vec<Option<(Arc<GpuPartition>, GpuKernels)>> = vec![None; plan.partitions.len()];
        if backend != Backend::Interp {
            let host = dfc_codegen::host_target();
            let cache = dfc_codegen::CodeCache::from_env();
            let on_gpu = |p: usize| plan.partitions[p].device.kind == Some(dfc_ir::DeviceKind::Gpu);
            let mut mine: Vec<usize> = (0..plan.partitions.len()).filter(|&p| hosted[p]).collect();
            for &p in mine.iter().filter(|&&p| on_gpu(p)) {
                let kernels = gpu_kernels(plan, p, &plan.kept_nodes(p), backend)?;
                let partition = GpuPartition::new(&kernels)
                    .map_err(|e| RunError::Plan(format!("partition {}: {e}", plan.partitions[p].device)))?;
                gpu[p] = Some((Arc::new(partition), kernels));
            }
            // The hosted CPU partitions compiled together: what they have in common, once.
            mine.retain(|&p| !on_gpu(p));
            let keeps: Vec<Vec<NodeId>> = mine.iter().map(|&p| plan.kept_nodes(p)).collect();
            let parts: Vec<(&dfc_ir::Module, &[NodeId])> =
                mine.iter().zip(&keeps).map(|(&p, keep)| (&plan.partitions[p].module, keep.as_slice())).collect();
            let devices = || mine.iter().map(|&p| plan.partitions[p].device.to_string()).collect::<Vec<_>>().join(", ");
            let mut jits = dfc_cpu::load_partitions(&cache, &parts, &host)
                .map_err(|e| RunError::Plan(format!("compiling the partitions of {}: {e}", devices())))?
                .into_iter();
            native.extend((0..plan.partitions.len()).map(|p| if hosted[p] { jits.next() } else { None }));
        } else {
            native.resize_with(plan.partitions.len(), || None);
        }
        let mut session = Session {
            plan,
            backend,
            variables,
            nodes,
            outputs,
            sends,
            receivers,
            reductions,
            orders,
            logical,
            mirrors,
            native,
            gpu,
            hosted,
            second_stage: std::sync::OnceLock::new(),
        };
        // Copies start as their originals do; make sure of it.
        session.copy_mirrors();
        Ok(session)
    }

    pub fn plan(&self) -> &'p Plan {
        self.plan
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Per partition, its GPU kernels (hosted GPU partitions): loaded into its GPU, or
    /// compiled for the grid emulator (generated at every load, never cached).
    pub fn gpu_code(&self) -> &[Option<(Arc<GpuPartition>, GpuKernels)>] {
        &self.gpu
    }

    /// Per partition, the machine code of its kernels (hosted partitions, LLVM backend).
    pub fn native_code(&self) -> &[Option<Arc<Jitted>>] {
        &self.native
    }

    /// The program that fetches `fetches` (named outputs or metrics of the partitions, else
    /// node names; output 0) and runs the nodes named in `targets` for their effect.
    pub fn program(&self, fetches: &[&str], targets: &[&str]) -> Result<SessionProgram, RunError> {
        self.program_stage(fetches, targets, Stage::Whole)
    }

    /// The part `stage` of the program of `fetches` and `targets`: what of each partition's
    /// share needs no `Recv`, or the rest. A worker that serves several free-running replicas
    /// (a parameter server) runs the two as separate calls of one step, so that it never
    /// holds its variables while it waits for a replica.
    pub fn program_stage(&self, fetches: &[&str], targets: &[&str], stage: Stage) -> Result<SessionProgram, RunError> {
        // A program that runs updates trains (dropout drops) in every partition of it.
        let training = !targets.is_empty();
        let n = self.plan.partitions.len();
        let mut roots: Vec<BTreeSet<NodeId>> = vec![BTreeSet::new(); n];
        let mut part_fetches: Vec<Vec<TensorRef>> = vec![Vec::new(); n];
        let mut fetch_at: Vec<(usize, usize)> = Vec::with_capacity(fetches.len());
        for name in fetches {
            let (p, tensor) = match self.outputs.get(name) {
                Some(&found) => found,
                None => match self.nodes.get(name) {
                    Some(&(p, id)) if !self.node(p, id).outputs.is_empty() => (p, TensorRef::from(id)),
                    Some(_) => return Err(RunError::Usage(format!("`{name}` has no output to fetch"))),
                    None => return Err(self.unknown(name)),
                },
            };
            roots[p].insert(tensor.node);
            fetch_at.push((p, part_fetches[p].len()));
            part_fetches[p].push(tensor);
        }
        for name in targets {
            let &(p, id) = self.nodes.get(name).ok_or_else(|| self.unknown(name))?;
            roots[p].insert(id);
        }

        close_over_partitions(self.plan, &self.sends, &self.reductions, &mut roots);

        if stage != Stage::Whole {
            let second = self.second_stage.get_or_init(|| self.second_stage());
            for (p, partition_roots) in roots.iter_mut().enumerate() {
                if partition_roots.is_empty() || !self.hosted[p] {
                    continue;
                }
                partition_roots.retain(|id| second[p].contains(id) == (stage == Stage::AfterRecvs));
                // A fetch of the other stage is not this one's to compute or return.
                let mut kept = Vec::new();
                let mut new_index = vec![usize::MAX; part_fetches[p].len()];
                for (i, fetch) in part_fetches[p].iter().enumerate() {
                    if partition_roots.contains(&fetch.node) {
                        new_index[i] = kept.len();
                        kept.push(*fetch);
                    }
                }
                part_fetches[p] = kept;
                for at in fetch_at.iter_mut().filter(|at| at.0 == p) {
                    *at = if new_index[at.1] == usize::MAX { (usize::MAX, 0) } else { (p, new_index[at.1]) };
                }
            }
        }

        let mut parts = Vec::new();
        let mut part_index = vec![usize::MAX; n];
        let (mut sends_to, mut receives_from) = (BTreeSet::new(), BTreeSet::new());
        for (p, partition_roots) in roots.iter().enumerate() {
            if partition_roots.is_empty() || !self.hosted[p] {
                continue;
            }
            let targets: Vec<NodeId> = partition_roots.iter().copied().collect();
            let module = &self.plan.partitions[p].module;
            for id in module.graph.ancestors(&targets) {
                match &module.graph.node(id).op {
                    Op::Send { key, .. } => sends_to.extend(self.receivers.get(key.as_str())),
                    Op::Recv { key, .. } => receives_from.extend(self.sends.get(key.as_str()).map(|s| s.0)),
                    _ => {}
                }
            }
            let program = match (&self.native[p], &self.gpu[p]) {
                (Some(jit), _) => {
                    Executable::Native(self.native_program(p, jit, &part_fetches[p], &targets, training)?)
                }
                (None, Some((partition, kernels))) => {
                    Executable::Gpu(self.gpu_program(p, partition, kernels, &part_fetches[p], &targets, training)?)
                }
                (None, None) if self.backend != Backend::Interp => {
                    unreachable!("hosted partitions have native code")
                }
                (None, None) => {
                    let order = &self.orders[p];
                    Executable::Interp(Program::with_mode(module, &part_fetches[p], &targets, order, training)?)
                }
            };
            part_index[p] = parts.len();
            parts.push(Part { partition: p, program });
        }
        let fetches = fetch_at
            .into_iter()
            .map(|(p, i)| (p != usize::MAX && part_index[p] != usize::MAX).then(|| (part_index[p], i)))
            .collect();
        let mut inputs: Vec<String> = parts.iter().flat_map(|part| part.program.inputs()).collect();
        let declared = |name: &String| self.plan.inputs.iter().position(|i| i.name == *name).unwrap_or(usize::MAX);
        inputs.sort_by_key(|name| declared(name)); // stable: undeclared ones keep partition order
        inputs.dedup();
        Ok(SessionProgram { parts, fetches, inputs, sends_to, receives_from })
    }

    /// Per partition, the nodes of the second stage of a free-running replica's step
    /// (`Stage::AfterRecvs`): assignments, so that a step reads what the step before it left
    /// (its learning rate the step count), as in one process; what a partition receives of what
    /// was computed from its own nodes (through the others: gradients of the variables it sent)
    /// or of another's second stage; and everything computed from those.
    fn second_stage(&self) -> Vec<HashSet<NodeId>> {
        let n = self.plan.partitions.len();
        let mut second: Vec<HashSet<NodeId>> = vec![HashSet::new(); n];
        let mut fed_back: HashMap<(&str, usize), bool> = HashMap::new();
        loop {
            let mut grew = false;
            for p in 0..n {
                let graph = &self.plan.partitions[p].module.graph;
                for &id in &self.orders[p] {
                    if second[p].contains(&id) {
                        continue;
                    }
                    let late = match &graph.node(id).op {
                        Op::Assign | Op::AssignAdd | Op::AssignSub => true,
                        Op::Recv { key, .. } => {
                            let sent = self.sends.get(key.as_str());
                            sent.is_some_and(|(q, send)| second[*q].contains(send))
                                || *fed_back.entry((key.as_str(), p)).or_insert_with(|| self.computed_from(key, p))
                        }
                        _ => false,
                    };
                    let mut before = graph.data_edges_into(id).into_iter().map(|(_, t)| t.node);
                    if late
                        || before.any(|pred| second[p].contains(&pred))
                        || graph.control_inputs(id).iter().any(|pred| second[p].contains(pred))
                    {
                        second[p].insert(id);
                        grew = true;
                    }
                }
            }
            if !grew {
                return second;
            }
        }
    }

    /// Whether what the `Send` of `key` sends is computed, through any partitions, from a node
    /// of partition `p`.
    fn computed_from(&self, key: &str, p: usize) -> bool {
        let mut seen: BTreeSet<&str> = BTreeSet::new();
        let mut keys = vec![key];
        while let Some(key) = keys.pop() {
            let Some(&(q, send)) = self.sends.get(key) else { continue };
            if q == p {
                return true;
            }
            if !seen.insert(key) {
                continue;
            }
            let graph = &self.plan.partitions[q].module.graph;
            for id in graph.ancestors(&[send]) {
                if let Op::Recv { key, .. } = &graph.node(id).op {
                    keys.push(key.as_str());
                }
            }
        }
        false
    }

    /// The native program of partition `p`; a fetch that the plan's kernels compute inside
    /// themselves gets code compiled for this program that stores it.
    fn native_program(
        &self,
        p: usize,
        jit: &Arc<Jitted>,
        fetches: &[TensorRef],
        targets: &[NodeId],
        training: bool,
    ) -> Result<NativeProgram, RunError> {
        let module = &self.plan.partitions[p].module;
        let order = &self.orders[p];
        let backend_error = |e: CpuError| match e {
            CpuError::Interp(e) => RunError::Interp(e),
            other => RunError::Plan(other.to_string()),
        };
        match NativeProgram::new(module, jit.clone(), fetches, targets, order, training, self.plan.strategy.overlap) {
            Err(CpuError::NotStored(_)) => {
                let mut keep = self.plan.kept_nodes(p);
                keep.extend(fetches.iter().map(|f| f.node));
                let cache = dfc_codegen::CodeCache::from_env();
                let jit = dfc_cpu::load_partition(&cache, module, &keep, &dfc_codegen::host_target())
                    .map_err(backend_error)?;
                NativeProgram::new(module, jit, fetches, targets, order, training, self.plan.strategy.overlap)
                    .map_err(backend_error)
            }
            other => other.map_err(backend_error),
        }
    }

    /// The program of GPU partition `p`, as `native_program` makes the CPU's.
    fn gpu_program(
        &self,
        p: usize,
        partition: &Arc<GpuPartition>,
        kernels: &GpuKernels,
        fetches: &[TensorRef],
        targets: &[NodeId],
        training: bool,
    ) -> Result<GpuProgram, RunError> {
        let module = &self.plan.partitions[p].module;
        let order = &self.orders[p];
        let backend_error = |e: ProgramError| match e {
            ProgramError::Schedule(CpuError::Interp(e)) => RunError::Interp(e),
            other => RunError::Plan(other.to_string()),
        };
        match GpuProgram::new(module, partition, kernels, fetches, targets, order, training) {
            Err(ProgramError::Schedule(CpuError::NotStored(_))) => {
                let mut keep = self.plan.kept_nodes(p);
                keep.extend(fetches.iter().map(|f| f.node));
                let kernels = gpu_kernels(self.plan, p, &keep, self.backend)?;
                GpuProgram::new(module, partition, &kernels, fetches, targets, order, training).map_err(backend_error)
            }
            other => other.map_err(backend_error),
        }
    }

    fn node(&self, p: usize, id: NodeId) -> &dfc_ir::Node {
        self.plan.partitions[p].module.graph.node(id)
    }

    fn unknown(&self, name: &str) -> RunError {
        RunError::Usage(format!("plan of model `{}` has no output or node `{name}`", self.plan.model))
    }

    /// Runs `program` (built by this session) once on `feeds` (by input name, each to the
    /// partition that has the input; an asynchronous plan's replicas get their rows) and
    /// returns the fetched values, in order. The variables change only if every partition
    /// succeeds.
    pub fn run(&mut self, program: &SessionProgram, feeds: &HashMap<String, Tensor>) -> Result<Vec<Tensor>, RunError> {
        let feeds = &*crate::replicas::node_feeds(self.plan, feeds)?;
        let rendezvous = InProcessRendezvous::new();
        let fetched = self.run_with(program, feeds, &rendezvous)?;
        fetched
            .into_iter()
            .map(|f| {
                f.ok_or_else(|| RunError::Usage("a fetch belongs to a partition this session does not host".into()))
            })
            .collect()
    }

    /// Runs the hosted parts of `program` once, exchanging tensors through `rendezvous` (with
    /// the parts that run elsewhere too); returns the fetched values of the hosted partitions
    /// (`None` for the others). The hosted partitions' variables change only if all of them
    /// succeed.
    pub fn run_with(
        &mut self,
        program: &SessionProgram,
        feeds: &HashMap<String, Tensor>,
        rendezvous: &dyn Rendezvous,
    ) -> Result<Vec<Option<Tensor>>, RunError> {
        let plan = self.plan;
        let run_part = |part: &Part, variables: &mut Variables| -> Result<PartRun, InterpError> {
            let partition = &plan.partitions[part.partition];
            let module = &partition.module;
            let mut run = move || match &part.program {
                Executable::Interp(program) => {
                    program.run_staged(module, variables, feeds, rendezvous).map(PartRun::Staged)
                }
                Executable::Native(program) => program.run(variables, feeds, Some(rendezvous)).map(PartRun::Done),
                Executable::Gpu(program) => program.run(variables, feeds, Some(rendezvous)).map(PartRun::Done),
            };
            if !dfc_interp::trace::enabled() {
                return run();
            }
            // On the timeline, each partition's work on a track of its own, the device's.
            let device = partition.device.to_string();
            dfc_interp::trace::on_track(&device, || {
                let _span = dfc_interp::trace::span("partition", || format!("run on {device}"));
                run()
            })
        };
        let run_aborting = |part: &Part, variables: &mut Variables| {
            // A panic must not leave the other partitions waiting.
            let _guard = AbortOnPanic(rendezvous);
            let result = run_part(part, variables);
            if let Err(error) = &result {
                let device = &plan.partitions[part.partition].device;
                rendezvous.abort(&format!("partition {device} failed: {error}"));
            }
            result
        };
        // Each partition's variables go to the thread that runs it.
        let mut free: Vec<Option<&mut Variables>> = self.variables.iter_mut().map(Some).collect();
        let mut jobs: Vec<(&Part, &mut Variables)> = Vec::with_capacity(program.parts.len());
        for part in &program.parts {
            let variables = free[part.partition].take().expect("a partition takes part once");
            jobs.push((part, variables));
        }
        let results: Vec<(Result<PartRun, InterpError>, &mut Variables)> = match jobs.len() {
            0 => Vec::new(),
            1 => {
                let (part, variables) = jobs.pop().unwrap();
                vec![(run_part(part, variables), variables)]
            }
            // The first partition runs on this thread, each other one on its own.
            _ => std::thread::scope(|scope| {
                let run_aborting = &run_aborting;
                let mut jobs = jobs.into_iter();
                let (first, first_vars) = jobs.next().unwrap();
                let handles: Vec<_> = jobs
                    .map(|(part, variables)| scope.spawn(move || (run_aborting(part, variables), variables)))
                    .collect();
                let own = run_aborting(first, first_vars);
                let mut results = vec![(own, first_vars)];
                for handle in handles {
                    results.push(handle.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)));
                }
                results
            }),
        };
        let mut done = Vec::with_capacity(results.len());
        let mut aborted = None;
        let mut failed = None;
        for (result, variables) in results {
            match result {
                Ok(run) => done.push((run, variables)),
                Err(error @ InterpError::Aborted { .. }) => aborted = aborted.or(Some(error)),
                Err(error) => failed = failed.or(Some(error)),
            }
        }
        if let Some(error) = failed.or(aborted) {
            return Err(error.into());
        }
        let fetched: Vec<Vec<Tensor>> = done
            .into_iter()
            .map(|(run, variables)| match run {
                PartRun::Staged(staged) => staged.commit(variables),
                PartRun::Done(fetched) => fetched,
            })
            .collect();
        Ok(program.fetches.iter().map(|f| f.map(|(part, i)| fetched[part][i].clone())).collect())
    }

    /// The logical variables of the hosted partitions (of all of them in one process), what a
    /// checkpoint holds: every variable that is not a replica's copy, by node name.
    pub fn variables(&self) -> Result<Variables, RunError> {
        let current = self.current_variables()?;
        let mut logical = Variables::new();
        for &(p, name) in self.logical.iter().filter(|(p, _)| self.hosted[*p]) {
            let value = current[p].get(name).expect("hosted variables are initialised");
            logical.insert(name.to_string(), value.clone());
        }
        Ok(logical)
    }

    /// Every variable of the hosted partitions, replicas' copies included.
    pub fn all_variables(&self) -> Result<Variables, RunError> {
        let mut all = Variables::new();
        for variables in self.current_variables()? {
            for (name, value) in variables.iter() {
                all.insert(name.clone(), value.clone());
            }
        }
        Ok(all)
    }

    /// Per partition, its variables as they are now: a GPU partition's, with the values its
    /// device holds newer (the host's copies are brought up to date only here, on request).
    fn current_variables(&self) -> Result<Vec<std::borrow::Cow<'_, Variables>>, RunError> {
        let mut current = Vec::with_capacity(self.variables.len());
        for (variables, gpu) in self.variables.iter().zip(&self.gpu) {
            current.push(match gpu {
                Some((partition, _)) => {
                    let mut copy = variables.clone();
                    partition.download_newer(&mut copy, false)?;
                    std::borrow::Cow::Owned(copy)
                }
                None => std::borrow::Cow::Borrowed(variables),
            });
        }
        Ok(current)
    }

    /// Sets the logical variables from `saved` (a checkpoint read from `path`), which must
    /// hold every one with its type, and each replica's copy from the variable it mirrors.
    pub fn restore(&mut self, saved: &BTreeMap<String, Tensor>, path: &std::path::Path) -> Result<(), RunError> {
        // Check everything before changing anything.
        for &(_, name) in &self.logical {
            let current = variable_type(self.plan, &self.nodes, name).expect("logical variables are variable nodes");
            match saved.get(name) {
                Some(tensor) if tensor.ty() == current => {}
                Some(tensor) => {
                    return Err(RunError::Checkpoint(format!(
                    "{} holds `{name}` as {}, but the plan's variable is {current}; was it written for another model?",
                    path.display(),
                    tensor.ty()
                )))
                }
                None => {
                    return Err(RunError::Checkpoint(format!(
                        "{} has no variable `{name}`; was it written for another model?",
                        path.display()
                    )))
                }
            }
        }
        for &(p, name) in self.logical.iter().filter(|(p, _)| self.hosted[*p]) {
            self.variables[p].insert(name.to_string(), saved[name].clone());
        }
        for &(p, name, _, of) in &self.mirrors {
            self.variables[p].insert(name.to_string(), saved[of].clone());
        }
        // The host's copies are now the newer: runs copy them to the devices.
        for (partition, _) in self.gpu.iter().flatten() {
            partition.host_wrote();
        }
        Ok(())
    }

    /// Sets each hosted copy to its original's value, then lets go of the originals hosted
    /// elsewhere (initialised here only for this).
    fn copy_mirrors(&mut self) {
        for &(p, name, q, of) in &self.mirrors {
            let value = self.variables[q].get(of).expect("originals of hosted copies are initialised").clone();
            self.variables[p].insert(name.to_string(), value);
        }
        for (variables, hosted) in self.variables.iter_mut().zip(&self.hosted) {
            if !hosted {
                *variables = Variables::default();
            }
        }
    }
}

/// Refuses a plan whose hosted partitions cannot fit in this machine's available memory: their
/// variables (and the whole values that shards and copies start from) and their largest
/// tensor, rather than abort mid-allocation. A plan is data from outside: its sizes are
/// checked, not trusted.
fn check_memory(plan: &Plan, hosted: &[bool]) -> Result<(), RunError> {
    let Some(available) = crate::memory::available_bytes() else { return Ok(()) };
    let bytes = dfc_passes::cost::tensor_bytes;
    let (mut variables, mut largest) = (0u64, None::<(u64, &str)>);
    let mut origins = BTreeSet::new();
    for (p, partition) in plan.partitions.iter().enumerate().filter(|(p, _)| hosted[*p]) {
        let graph = &partition.module.graph;
        for id in graph.node_ids() {
            let node = graph.node(id);
            if let Op::Variable { ty, origin, .. } = &node.op {
                variables = variables.saturating_add(bytes(ty));
                if let Some(o) = origin.as_ref().filter(|o| origins.insert((p, o.name.as_str()))) {
                    variables = variables.saturating_add(bytes(&dfc_ir::TensorType::new(ty.dtype, o.shape.clone())));
                }
            }
            for ty in &node.outputs {
                if largest.is_none_or(|(most, _)| bytes(ty) > most) {
                    largest = Some((bytes(ty), node.name.as_str()));
                }
            }
        }
    }
    let (largest, name) = largest.unwrap_or((0, ""));
    if variables.saturating_add(largest) > available {
        let human = dfc_passes::cost::human_bytes;
        return Err(RunError::Plan(format!(
            "the plan needs more memory than this machine has available ({}): its variables take {} and its largest tensor (`{name}`) {}",
            human(available),
            human(variables),
            human(largest)
        )));
    }
    Ok(())
}

/// Aborts the rendezvous if the thread unwinds.
struct AbortOnPanic<'a>(&'a dyn Rendezvous);

impl Drop for AbortOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.abort("a partition panicked");
        }
    }
}

/// The kernels of GPU partition `p`, keeping the nodes of `keep` as kernel roots: its PTX
/// (through the code cache) loaded into the partition's GPU, or under `GridEmulator` compiled
/// for this CPU. Without a GPU (or driver, or cuBLAS), says which and what runs the partition
/// instead.
fn gpu_kernels(plan: &Plan, p: usize, keep: &[NodeId], backend: Backend) -> Result<GpuKernels, RunError> {
    let partition = &plan.partitions[p];
    let device = &partition.device;
    if backend == Backend::GridEmulator {
        let code = dfc_cuda::emulator::Emulated::load(&partition.module, keep)
            .map_err(|e| RunError::Plan(format!("compiling partition {device}: {e}")))?;
        return Ok(GpuKernels::Emulated(Arc::new(code)));
    }
    let fallback = "`--backend interp` runs it on this machine's CPU with the reference interpreter, \
        `--backend grid-emulator` with its GPU kernels run thread by thread as on a GPU";
    let gpu = dfc_cuda::Gpu::open(device.index.unwrap_or(0) as usize)
        .map_err(|e| RunError::Plan(format!("partition {device} runs on a GPU, but {e}; {fallback}")))?;
    let cache = dfc_codegen::CodeCache::from_env();
    let (code, _) = cache
        .gpu(&partition.module, keep)
        .map_err(|e| RunError::Plan(format!("generating the PTX of partition {device}: {e}")))?;
    let source = crate::source::PlanSource::of(plan);
    let describe = |node: NodeId| source.describe(&partition.module.graph, node);
    let kernels = dfc_cuda::DeviceKernels::load(&gpu, code, &device.to_string(), &describe)
        .map_err(|e| RunError::Plan(format!("partition {device}: {e}; {fallback}")))?;
    Ok(GpuKernels::Device(Arc::new(kernels)))
}
