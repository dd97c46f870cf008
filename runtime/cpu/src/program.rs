//! `NativeProgram`: the steps of one partition for some fetches and targets, with every value's
//! memory planned, run over raw buffers.

use crate::jit::{Jitted, KernelFn};
use crate::memory::{self, Lifetime};
use crate::CpuError;
use dfc_interp::{Data, InterpError, Rendezvous, Tensor, Variables};
use dfc_ir::{DType, Module, NodeId, Op, TensorRef, TensorType};
use dfc_kernels::{Conv2dGeometry, PoolGeometry};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

/// Where a value lives during a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Slot {
    /// A planned buffer (an index into `buffers` until offsets are assigned).
    Arena(usize),
    Feed(usize),
    Variable(usize),
    Const(usize),
}

#[derive(Debug)]
enum Step {
    Kernel {
        function: KernelFn,
        args: Vec<Slot>,
        rows: u64,
        parallel: bool,
    },
    MatMul {
        a: Slot,
        b: Slot,
        out: Slot,
        m: usize,
        n: usize,
        k: usize,
        ta: bool,
        tb: bool,
        batches: Vec<(usize, usize)>,
        /// `Some(α)`: the product is folded into an update of the variable at `out`, `out += α·a·b`.
        update: Option<f32>,
    },
    /// A convolution or its gradients (im2col and GEMM): `(a, b)` are `(input, filter)`,
    /// `(filter, grad_out)` or `(input, grad_out)`.
    Conv {
        kind: ConvKind,
        geometry: Conv2dGeometry,
        a: Slot,
        b: Slot,
        out: Slot,
        out_len: usize,
    },
    /// Pooling or its gradients on f32: `operands` are `[input]`, `[input, grad_out]` (max) or
    /// `[grad_out]` (avg).
    Pool {
        kind: PoolKind,
        geometry: PoolGeometry,
        operands: Vec<(Slot, usize)>,
        out: Slot,
        out_len: usize,
    },
    /// Data movement (transpose, concat, slice, pad, gather): copies of elements of
    /// `element_bytes` each, whatever their type.
    Layout {
        node: String,
        op: Op,
        element_bytes: usize,
        operands: Vec<(Slot, TensorType)>,
        out: Slot,
        ty: TensorType,
    },
    Library {
        node: String,
        op: Op,
        operands: Vec<(Slot, TensorType)>,
        out: Slot,
        ty: TensorType,
    },
    /// A stateful op the kernels do not cover: the interpreter's semantics on the variable.
    Update {
        node: String,
        op: Op,
        variable: Slot,
        value: (Slot, TensorType),
        ty: TensorType,
    },
    Copy {
        from: Slot,
        to: Slot,
        bytes: usize,
    },
    Send {
        key: String,
        value: Slot,
        ty: TensorType,
    },
    Recv {
        node: String,
        key: String,
        out: Slot,
        ty: TensorType,
    },
    AllReduce {
        key: String,
        group_size: u32,
        members: Vec<(u32, Slot, Slot)>,
        ty: TensorType,
    },
}

#[derive(Clone, Copy, Debug)]
enum ConvKind {
    Forward,
    BackpropInput,
    BackpropFilter,
}

#[derive(Clone, Copy, Debug)]
enum PoolKind {
    Max,
    MaxGrad,
    Avg,
    AvgGrad,
}

impl Step {
    fn reads_writes(&self) -> (Vec<Slot>, Vec<Slot>) {
        match self {
            Step::Kernel { args, .. } => (args[..args.len() - 1].to_vec(), vec![*args.last().unwrap()]),
            Step::MatMul { a, b, out, .. } => (vec![*a, *b], vec![*out]),
            Step::Library { operands, out, .. } | Step::Layout { operands, out, .. } => {
                (operands.iter().map(|o| o.0).collect(), vec![*out])
            }
            Step::Conv { a, b, out, .. } => (vec![*a, *b], vec![*out]),
            Step::Pool { operands, out, .. } => (operands.iter().map(|o| o.0).collect(), vec![*out]),
            Step::Update { variable, value, .. } => (vec![*variable, value.0], vec![*variable]),
            Step::Copy { from, to, .. } => (vec![*from], vec![*to]),
            Step::Send { value, .. } => (vec![*value], vec![]),
            Step::Recv { out, .. } => (vec![], vec![*out]),
            Step::AllReduce { members, .. } => {
                (members.iter().map(|m| m.1).collect(), members.iter().map(|m| m.2).collect())
            }
        }
    }

    fn slots_mut(&mut self) -> Vec<&mut Slot> {
        match self {
            Step::Kernel { args, .. } => args.iter_mut().collect(),
            Step::MatMul { a, b, out, .. } => vec![a, b, out],
            Step::Library { operands, out, .. } | Step::Layout { operands, out, .. } => {
                operands.iter_mut().map(|o| &mut o.0).chain([out]).collect()
            }
            Step::Conv { a, b, out, .. } => vec![a, b, out],
            Step::Pool { operands, out, .. } => operands.iter_mut().map(|o| &mut o.0).chain([out]).collect(),
            Step::Update { variable, value, .. } => vec![variable, &mut value.0],
            Step::Copy { from, to, .. } => vec![from, to],
            Step::Send { value, .. } => vec![value],
            Step::Recv { out, .. } => vec![out],
            Step::AllReduce { members, .. } => members.iter_mut().flat_map(|m| [&mut m.1, &mut m.2]).collect(),
        }
    }
}

/// The steps of a partition for some fetches and targets, checked and planned once, run many
/// times (one run at a time: runs share the arena).
pub struct NativeProgram {
    steps: Vec<Step>,
    /// The updates run as one GEMM into their variable (`folded_update`), by node name.
    folded_updates: Vec<String>,
    fetches: Vec<(Slot, TensorType)>,
    feeds: Vec<(String, TensorType)>,
    variables: Vec<(String, TensorType)>,
    consts: Vec<Tensor>,
    arena: Mutex<Arena>,
    /// Keeps the kernels' code alive.
    _jit: Arc<Jitted>,
}

/// 64-byte aligned bytes.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

struct Arena {
    lines: Vec<Line>,
    /// im2col columns of the convolutions, grown on the first run.
    scratch: dfc_kernels::Scratch,
    /// Scratch for kernel argument arrays.
    args: Vec<*mut u8>,
}

// SAFETY: the raw pointers in `args` are scratch, rewritten before every use.
unsafe impl Send for Arena {}

impl std::fmt::Debug for NativeProgram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NativeProgram").field("steps", &self.steps.len()).finish()
    }
}

fn malformed(module: &Module, id: NodeId, message: impl Into<String>) -> CpuError {
    CpuError::Interp(InterpError::Malformed { node: module.graph.node(id).name.clone(), message: message.into() })
}

impl NativeProgram {
    /// The program computing `fetches` and running `targets` over `module` (a partition) with
    /// its kernels compiled in `jit` (`jit::load_partition` of this module), nodes in `order`
    /// (see `dfc_interp::Program::with_order`).
    pub fn new(
        module: &Module,
        jit: Arc<Jitted>,
        fetches: &[TensorRef],
        targets: &[NodeId],
        order: &[NodeId],
    ) -> Result<NativeProgram, CpuError> {
        let graph = &module.graph;
        // The interpreter's program checks every node: the same checks hold here.
        dfc_interp::Program::with_order(module, fetches, targets, order)?;
        let roots: Vec<NodeId> = fetches.iter().map(|f| f.node).chain(targets.iter().copied()).collect();
        let needed = graph.ancestors(&roots);
        let order: Vec<NodeId> = {
            let mut seen = HashSet::new();
            order.iter().copied().filter(|id| needed.contains(id) && seen.insert(*id)).collect()
        };
        let kernels: HashMap<NodeId, &dfc_codegen::NativeKernel> = jit.kernels().iter().map(|k| (k.root, k)).collect();
        // Nodes computed inside the kernels the program runs, and those kernels' roots.
        let mut inside: HashMap<NodeId, Vec<NodeId>> = HashMap::new();
        for &id in &order {
            if let Some(kernel) = kernels.get(&id) {
                for &m in &kernel.members {
                    if m != id {
                        inside.entry(m).or_default().push(id);
                    }
                }
            }
        }
        // Updates whose value is a scaled product, run as one GEMM into the variable; the product is not stored.
        let fetched: HashSet<NodeId> = fetches.iter().map(|f| f.node).collect();
        let folded: HashMap<NodeId, (NodeId, f32)> = order
            .iter()
            .filter_map(|id| kernels.get(id))
            .filter_map(|kernel| folded_update(module, kernel, &needed, &fetched).map(|f| (kernel.root, f)))
            .collect();
        let folded_products: HashSet<NodeId> = folded.values().map(|f| f.0).collect();
        let computed_inside =
            |id: NodeId| (inside.contains_key(&id) && !kernels.contains_key(&id)) || folded_products.contains(&id);
        for fetch in fetches {
            if computed_inside(fetch.node) {
                return Err(CpuError::NotStored(graph.node(fetch.node).name.clone()));
            }
        }
        let position: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &id)| (id, i)).collect();

        // A read aliases its variable unless the variable is assigned before the read's last
        // use: then it is copied.
        let aliases_operand = |id: NodeId| {
            matches!(graph.node(id).op, Op::Reshape { .. } | Op::Identity | Op::StopGradient) && !computed_inside(id)
        };
        let mut last_use: HashMap<NodeId, usize> = HashMap::new();
        for &id in &order {
            if computed_inside(id) {
                continue;
            }
            let inputs = match (folded.get(&id), kernels.get(&id)) {
                (Some(&(product, _)), _) => [graph.inputs(id)[0]].into_iter().chain(graph.inputs(product)).collect(),
                (None, Some(kernel)) => kernel.inputs.clone(),
                (None, None) => graph.inputs(id),
            };
            let at = position[&id];
            for t in inputs {
                let entry = last_use.entry(t.node).or_insert(at);
                *entry = (*entry).max(at);
            }
        }
        // Through aliases, a read is used as long as its aliases are.
        for &id in order.iter().rev() {
            if aliases_operand(id) {
                let operand = graph.inputs(id)[0].node;
                if let Some(&l) = last_use.get(&id) {
                    let e = last_use.entry(operand).or_insert(l);
                    *e = (*e).max(l);
                }
            }
        }
        let mut assigns_of: HashMap<NodeId, Vec<usize>> = HashMap::new();
        for &id in &order {
            if matches!(graph.node(id).op, Op::Assign | Op::AssignAdd | Op::AssignSub) {
                assigns_of.entry(graph.inputs(id)[0].node).or_default().push(position[&id]);
            }
        }
        let copied_reads: HashSet<NodeId> = order
            .iter()
            .copied()
            .filter(|&id| matches!(graph.node(id).op, Op::Read))
            .filter(|&id| {
                let variable = graph.inputs(id)[0].node;
                let at = position[&id];
                let next_assign = assigns_of.get(&variable).and_then(|a| a.iter().copied().filter(|&p| p > at).min());
                matches!((next_assign, last_use.get(&id)), (Some(a), Some(&l)) if l > a)
            })
            .collect();

        let mut builder = Builder::default();
        let mut slot_of: HashMap<NodeId, Slot> = HashMap::new();
        let mut steps: Vec<Step> = Vec::new();
        // Replicas of an all-reduce that an earlier one of this program contributes.
        let mut reduced_later: HashSet<NodeId> = HashSet::new();
        for &id in &order {
            if reduced_later.contains(&id) || computed_inside(id) {
                continue;
            }
            let node = graph.node(id);
            let operand_slots = |ids: &[TensorRef], slot_of: &HashMap<NodeId, Slot>| -> Vec<Slot> {
                ids.iter().map(|t| slot_of[&t.node]).collect()
            };
            let ty = node.outputs.first().cloned();
            if let Some(&(product, alpha)) = folded.get(&id) {
                let out = slot_of[&graph.inputs(id)[0].node];
                steps.push(product_step(module, product, &slot_of, out, Some(alpha)));
                slot_of.insert(id, out);
                continue;
            }
            if let Some(kernel) = kernels.get(&id) {
                let function = jit
                    .function(&kernel.function)
                    .ok_or_else(|| malformed(module, id, format!("kernel `{}` is not in the code", kernel.function)))?;
                let mut args = operand_slots(&kernel.inputs, &slot_of);
                let out = match node.op {
                    Op::Assign | Op::AssignAdd | Op::AssignSub => slot_of[&graph.inputs(id)[0].node],
                    _ => builder.buffer(ty.as_ref().unwrap()),
                };
                args.push(out);
                slot_of.insert(id, out);
                steps.push(Step::Kernel { function, args, rows: kernel.rows, parallel: kernel.parallel });
                continue;
            }
            let operands = graph.inputs(id);
            match &node.op {
                Op::Input { ty } => {
                    slot_of.insert(id, Slot::Feed(builder.feeds.len()));
                    builder.feeds.push((node.name.clone(), ty.clone()));
                }
                Op::Const { value } => {
                    slot_of.insert(id, Slot::Const(builder.consts.len()));
                    builder.consts.push(Tensor::new(value.shape.clone(), value.data.clone()));
                }
                Op::Variable { ty, .. } => {
                    slot_of.insert(id, Slot::Variable(builder.variables.len()));
                    builder.variables.push((node.name.clone(), ty.clone()));
                }
                Op::Read if copied_reads.contains(&id) => {
                    let ty = ty.unwrap();
                    let out = builder.buffer(&ty);
                    steps.push(Step::Copy { from: slot_of[&operands[0].node], to: out, bytes: ty.size_in_bytes() });
                    slot_of.insert(id, out);
                }
                Op::Read | Op::Reshape { .. } | Op::Identity | Op::StopGradient => {
                    slot_of.insert(id, slot_of[&operands[0].node]);
                }
                Op::Assign | Op::AssignAdd | Op::AssignSub => {
                    let variable = slot_of[&operands[0].node];
                    let value = (slot_of[&operands[1].node], graph.ty(operands[1]).clone());
                    steps.push(Step::Update {
                        node: node.name.clone(),
                        op: node.op.clone(),
                        variable,
                        value,
                        ty: ty.unwrap(),
                    });
                    slot_of.insert(id, variable);
                }
                Op::MatMul { .. } if ty.as_ref().unwrap().dtype == DType::F32 => {
                    let out = builder.buffer(ty.as_ref().unwrap());
                    steps.push(product_step(module, id, &slot_of, out, None));
                    slot_of.insert(id, out);
                }
                Op::Conv2d { strides, padding }
                | Op::Conv2dBackpropInput { strides, padding, .. }
                | Op::Conv2dBackpropFilter { strides, padding, .. }
                    if ty.as_ref().unwrap().dtype == DType::F32 =>
                {
                    let ty = ty.unwrap();
                    let (x, y) = (graph.ty(operands[0]).shape.dims(), graph.ty(operands[1]).shape.dims());
                    let out_dims = ty.shape.dims();
                    let (kind, input, filter) = match node.op {
                        Op::Conv2d { .. } => (ConvKind::Forward, x, y),
                        Op::Conv2dBackpropInput { .. } => (ConvKind::BackpropInput, out_dims, x),
                        _ => (ConvKind::BackpropFilter, x, out_dims),
                    };
                    let geometry = Conv2dGeometry::from_dims(input, filter, *strides, *padding);
                    let out = builder.buffer(&ty);
                    let (a, b) = (slot_of[&operands[0].node], slot_of[&operands[1].node]);
                    steps.push(Step::Conv { kind, geometry, a, b, out, out_len: ty.shape.n_elements() });
                    slot_of.insert(id, out);
                }
                Op::MaxPool { window, strides, padding }
                | Op::MaxPoolGrad { window, strides, padding }
                | Op::AvgPool { window, strides, padding }
                | Op::AvgPoolGrad { window, strides, padding, .. }
                    if ty.as_ref().unwrap().dtype == DType::F32
                        && operands.iter().all(|t| graph.ty(*t).dtype == DType::F32) =>
                {
                    let ty = ty.unwrap();
                    let (kind, input_dims) = match &node.op {
                        Op::MaxPool { .. } => (PoolKind::Max, graph.ty(operands[0]).shape.dims().to_vec()),
                        Op::MaxPoolGrad { .. } => (PoolKind::MaxGrad, graph.ty(operands[0]).shape.dims().to_vec()),
                        Op::AvgPool { .. } => (PoolKind::Avg, graph.ty(operands[0]).shape.dims().to_vec()),
                        Op::AvgPoolGrad { input_shape, .. } => (PoolKind::AvgGrad, input_shape.dims().to_vec()),
                        _ => unreachable!(),
                    };
                    let geometry = PoolGeometry::from_dims(&input_dims, *window, *strides, *padding);
                    let out = builder.buffer(&ty);
                    let operands =
                        operands.iter().map(|t| (slot_of[&t.node], graph.ty(*t).shape.n_elements())).collect();
                    steps.push(Step::Pool { kind, geometry, operands, out, out_len: ty.shape.n_elements() });
                    slot_of.insert(id, out);
                }
                Op::Send { key, .. } => {
                    let value = slot_of[&operands[0].node];
                    steps.push(Step::Send { key: key.clone(), value, ty: graph.ty(operands[0]).clone() });
                }
                Op::Recv { key, ty, .. } => {
                    let out = builder.buffer(ty);
                    steps.push(Step::Recv { node: node.name.clone(), key: key.clone(), out, ty: ty.clone() });
                    slot_of.insert(id, out);
                }
                Op::AllReduce { key, group_size, .. } => {
                    // Replicas of one key in this program contribute together, at the first.
                    let ty = ty.unwrap();
                    let mut members = Vec::new();
                    for &other in &order[position[&id]..] {
                        if let Op::AllReduce { key: k, replica, .. } = &graph.node(other).op {
                            if k == key {
                                let value = *slot_of.get(&graph.inputs(other)[0].node).ok_or_else(|| {
                                    malformed(
                                        module,
                                        other,
                                        "its operand is not computed when the first replica reduces",
                                    )
                                })?;
                                let out = builder.buffer(&ty);
                                slot_of.insert(other, out);
                                reduced_later.insert(other);
                                members.push((*replica, value, out));
                            }
                        }
                    }
                    steps.push(Step::AllReduce { key: key.clone(), group_size: *group_size, members, ty });
                }
                op => {
                    let ty = ty.unwrap();
                    let out = builder.buffer(&ty);
                    let operands: Vec<(Slot, TensorType)> =
                        operands.iter().map(|t| (slot_of[&t.node], graph.ty(*t).clone())).collect();
                    let element_bytes = ty.dtype.size_in_bytes();
                    let layout = match op {
                        Op::Transpose { .. } | Op::Concat { .. } | Op::Slice { .. } | Op::Pad { .. } => true,
                        Op::Gather => matches!(operands[1].1.dtype, DType::I32 | DType::I64),
                        _ => false,
                    };
                    let node = node.name.clone();
                    let op = op.clone();
                    steps.push(if layout {
                        Step::Layout { node, op, element_bytes, operands, out, ty }
                    } else {
                        Step::Library { node, op, operands, out, ty }
                    });
                    slot_of.insert(id, out);
                }
            }
        }

        let fetches: Vec<(Slot, TensorType)> = fetches
            .iter()
            .map(|f| {
                let ty = match &graph.node(f.node).op {
                    Op::Variable { ty, .. } => ty.clone(),
                    _ => graph.ty(*f).clone(),
                };
                (slot_of[&f.node], ty)
            })
            .collect();

        // Lifetimes of the planned buffers, then their offsets.
        let mut lifetimes: Vec<Option<(usize, usize)>> = vec![None; builder.buffers.len()];
        let mut touch = |slot: Slot, at: usize| {
            if let Slot::Arena(b) = slot {
                let l = lifetimes[b].get_or_insert((at, at));
                l.0 = l.0.min(at);
                l.1 = l.1.max(at);
            }
        };
        for (i, step) in steps.iter().enumerate() {
            let (reads, writes) = step.reads_writes();
            for s in reads.into_iter().chain(writes) {
                touch(s, i);
            }
        }
        for (slot, _) in &fetches {
            touch(*slot, steps.len());
        }
        let values: Vec<Lifetime> = builder
            .buffers
            .iter()
            .zip(&lifetimes)
            .map(|(&bytes, l)| {
                let (first, last) = l.unwrap_or((0, 0));
                Lifetime { bytes: bytes.max(1), first, last }
            })
            .collect();
        let (offsets, arena_bytes) = memory::assign(&values);
        let relocate = |slot: &mut Slot| {
            if let Slot::Arena(b) = *slot {
                *slot = Slot::Arena(offsets[b]);
            }
        };
        for step in &mut steps {
            for slot in step.slots_mut() {
                relocate(slot);
            }
        }
        let mut fetches = fetches;
        for (slot, _) in &mut fetches {
            relocate(slot);
        }
        let lines = vec![Line([0; 64]); arena_bytes.div_ceil(64)];
        let folded_updates = order.iter().filter(|id| folded.contains_key(id)).map(|&id| graph.node(id).name.clone());
        Ok(NativeProgram {
            steps,
            folded_updates: folded_updates.collect(),
            fetches,
            feeds: builder.feeds,
            variables: builder.variables,
            consts: builder.consts,
            arena: Mutex::new(Arena { lines, scratch: dfc_kernels::Scratch::new(), args: Vec::new() }),
            _jit: jit,
        })
    }

    /// The ops that run through the interpreter's kernels (no native step), one per node.
    pub fn library_ops(&self) -> Vec<String> {
        self.steps
            .iter()
            .filter_map(|s| match s {
                Step::Library { op, .. } | Step::Update { op, .. } => Some(op.name().to_string()),
                _ => None,
            })
            .collect()
    }

    /// The updates whose value, a scaled product, is computed by one GEMM into the variable, by node name.
    pub fn folded_updates(&self) -> Vec<String> {
        self.folded_updates.clone()
    }

    /// The inputs the program needs.
    pub fn inputs(&self) -> Vec<String> {
        self.feeds.iter().map(|f| f.0.clone()).collect()
    }

    /// Bytes of the arena: every intermediate value of a run.
    pub fn arena_bytes(&self) -> usize {
        self.arena.lock().map(|a| a.lines.len() * 64).unwrap_or(0)
    }

    /// Runs the program on `feeds`, updating `variables` in place, exchanging tensors through
    /// `rendezvous`; returns the fetched values.
    pub fn run(
        &self,
        variables: &mut Variables,
        feeds: &HashMap<String, Tensor>,
        rendezvous: Option<&dyn Rendezvous>,
    ) -> Result<Vec<Tensor>, InterpError> {
        let mut feed_ptrs = Vec::with_capacity(self.feeds.len());
        for (name, ty) in &self.feeds {
            let tensor = feeds.get(name).ok_or_else(|| InterpError::MissingFeed { input: name.clone() })?;
            if tensor.ty() != *ty {
                return Err(InterpError::FeedType { input: name.clone(), expected: ty.clone(), found: tensor.ty() });
            }
            feed_ptrs.push(data_ptr(&tensor.data) as *mut u8);
        }
        for (name, ty) in &self.variables {
            let value = variables.get(name).ok_or_else(|| InterpError::MissingVariable { name: name.clone() })?;
            if value.ty() != *ty {
                return Err(InterpError::VariableType { name: name.clone(), expected: ty.clone(), found: value.ty() });
            }
        }
        let mut var_ptrs = Vec::with_capacity(self.variables.len());
        for (name, _) in &self.variables {
            let tensor = variables.get_mut(name).expect("checked above");
            var_ptrs.push(data_ptr_mut(&mut tensor.data));
        }
        let const_ptrs: Vec<*mut u8> = self.consts.iter().map(|c| data_ptr(&c.data) as *mut u8).collect();
        let mut arena = self.arena.lock().unwrap_or_else(|e| e.into_inner());
        let arena = &mut *arena;
        let base = arena.lines.as_mut_ptr() as *mut u8;
        let at = |slot: Slot| -> *mut u8 {
            match slot {
                // SAFETY: offsets were planned within the arena.
                Slot::Arena(offset) => unsafe { base.add(offset) },
                Slot::Feed(i) => feed_ptrs[i],
                Slot::Variable(i) => var_ptrs[i],
                Slot::Const(i) => const_ptrs[i],
            }
        };
        // SAFETY: every slot of this program holds a value of the type the program planned
        // for it, which is the type its steps name with it: feeds and variables were checked
        // above, constants are the builder's, arena offsets were planned with room for their
        // values; slots written (arena, variables) are not feeds or constants.
        let read = |slot: Slot, ty: &TensorType| unsafe { read_tensor(at(slot), ty) };
        // SAFETY: as for `read`.
        let write = |slot: Slot, tensor: &Tensor, ty: &TensorType| unsafe { write_tensor(at(slot), tensor, ty) };
        let exchange = |node: &str| rendezvous.ok_or_else(|| InterpError::NoRendezvous { node: node.to_string() });
        // The products of a run start without waking rayon's workers (see `dfc_gemm::hold`).
        let _hold = dfc_gemm::hold();
        let _flush = crate::denormals::FlushDenormals::new();
        for step in &self.steps {
            match step {
                Step::Kernel { function, args, rows, parallel } => {
                    arena.args.clear();
                    arena.args.extend(args.iter().map(|s| at(*s)));
                    // SAFETY: `args` holds the kernel's buffers in its order, each a slot planned for
                    // the kernel's types (as for `read`).
                    unsafe { run_kernel(*function, &arena.args, *rows, *parallel) };
                }
                Step::MatMul { a, b, out, m, n, k, ta, tb, batches, update } => {
                    let (pa, pb, po) = (at(*a) as *const f32, at(*b) as *const f32, at(*out) as *mut f32);
                    for (bi, &(oa, ob)) in batches.iter().enumerate() {
                        // SAFETY: the shapes were checked by the interpreter's program; the
                        // offsets stay within each operand.
                        unsafe {
                            let a = std::slice::from_raw_parts(pa.add(oa), m * k);
                            let b = std::slice::from_raw_parts(pb.add(ob), k * n);
                            let c = std::slice::from_raw_parts_mut(po.add(bi * m * n), m * n);
                            match update {
                                Some(alpha) => dfc_gemm::sgemm_update(*m, *n, *k, *alpha, a, *ta, b, *tb, c, true),
                                None => dfc_gemm::sgemm(*m, *n, *k, a, *ta, b, *tb, c, false, true),
                            }
                        }
                    }
                }
                Step::Conv { kind, geometry, a, b, out, out_len } => {
                    let g = geometry;
                    let (a_len, b_len) = match kind {
                        ConvKind::Forward => (g.input_len(), g.filter_len()),
                        ConvKind::BackpropInput => (g.filter_len(), g.output_len()),
                        ConvKind::BackpropFilter => (g.input_len(), g.output_len()),
                    };
                    // SAFETY: each slot holds a value of the node's (checked) type, whose
                    // length the geometry gives.
                    let (x, y, o) = unsafe {
                        (
                            std::slice::from_raw_parts(at(*a) as *const f32, a_len),
                            std::slice::from_raw_parts(at(*b) as *const f32, b_len),
                            std::slice::from_raw_parts_mut(at(*out) as *mut f32, *out_len),
                        )
                    };
                    match kind {
                        ConvKind::Forward => {
                            let scratch = arena.scratch.get(dfc_kernels::conv2d_scratch_len(g));
                            dfc_kernels::conv2d(g, x, y, o, scratch)
                        }
                        ConvKind::BackpropInput => {
                            let scratch = arena.scratch.get(dfc_kernels::conv2d_backprop_input_scratch_len(g));
                            dfc_kernels::conv2d_backprop_input(g, x, y, o, scratch)
                        }
                        ConvKind::BackpropFilter => {
                            let scratch = arena.scratch.get(dfc_kernels::conv2d_backprop_filter_scratch_len(g));
                            dfc_kernels::conv2d_backprop_filter(g, x, y, o, scratch)
                        }
                    }
                }
                Step::Pool { kind, geometry, operands, out, out_len } => {
                    let input = |i: usize| {
                        let (slot, len) = operands[i];
                        // SAFETY: as for convolutions: the slot holds `len` floats.
                        unsafe { std::slice::from_raw_parts(at(slot) as *const f32, len) }
                    };
                    // SAFETY: as for convolutions; the output is none of the inputs.
                    let o = unsafe { std::slice::from_raw_parts_mut(at(*out) as *mut f32, *out_len) };
                    match kind {
                        PoolKind::Max => dfc_kernels::max_pool(geometry, input(0), o),
                        PoolKind::MaxGrad => dfc_kernels::max_pool_grad(geometry, input(0), input(1), o),
                        PoolKind::Avg => dfc_kernels::avg_pool(geometry, input(0), o),
                        PoolKind::AvgGrad => dfc_kernels::avg_pool_grad(geometry, input(0), o),
                    }
                }
                Step::Layout { node, op, element_bytes, operands, out, ty } => {
                    let inputs: Vec<(*const u8, &TensorType)> =
                        operands.iter().map(|(s, t)| (at(*s) as *const u8, t)).collect();
                    // SAFETY: the operands' and the output's slots hold values of their types (as for
                    // `read`), whose elements are `element_bytes` wide; the output is not an operand.
                    unsafe {
                        match element_bytes {
                            1 => move_elements::<u8>(op, &inputs, at(*out), ty),
                            4 => move_elements::<u32>(op, &inputs, at(*out), ty),
                            _ => move_elements::<u64>(op, &inputs, at(*out), ty),
                        }
                    }
                    .map_err(|e| InterpError::IndexOutOfRange {
                        node: node.clone(),
                        index: e.index,
                        size: e.rows,
                    })?;
                }
                Step::Library { node, op, operands, out, ty } => {
                    let tensors: Vec<Tensor> = operands.iter().map(|(s, t)| read(*s, t)).collect();
                    let refs: Vec<&Tensor> = tensors.iter().collect();
                    let result = dfc_interp::eval(op, &refs).map_err(|e| rename(e, node))?;
                    write(*out, &result, ty);
                }
                Step::Update { node, op, variable, value, ty } => {
                    let v = read(value.0, &value.1);
                    let result = match op {
                        Op::Assign => v,
                        Op::AssignAdd | Op::AssignSub => {
                            let current = read(*variable, ty);
                            let kind =
                                if matches!(op, Op::AssignAdd) { dfc_ir::BinaryOp::Add } else { dfc_ir::BinaryOp::Sub };
                            dfc_interp::eval(&Op::Binary(kind), &[&current, &v]).map_err(|e| rename(e, node))?
                        }
                        _ => unreachable!("updates are assignments"),
                    };
                    write(*variable, &result, ty);
                }
                Step::Copy { from, to, bytes } => {
                    // SAFETY: distinct buffers of `bytes` each.
                    unsafe { std::ptr::copy_nonoverlapping(at(*from), at(*to), *bytes) };
                }
                Step::Send { key, value, ty } => {
                    exchange(key)?.send(key, read(*value, ty))?;
                }
                Step::Recv { node, key, out, ty } => {
                    let tensor = exchange(node)?.recv(key)?;
                    if tensor.ty() != *ty {
                        return Err(InterpError::RecvType {
                            node: node.clone(),
                            key: key.clone(),
                            expected: ty.clone(),
                            found: tensor.ty(),
                        });
                    }
                    write(*out, &tensor, ty);
                }
                Step::AllReduce { key, group_size, members, ty } => {
                    let rendezvous = exchange(key)?;
                    let contributions: Vec<(usize, u32, Tensor)> =
                        members.iter().enumerate().map(|(i, m)| (i, m.0, read(m.1, ty))).collect();
                    let sums = if contributions.len() == 1 {
                        let (_, replica, value) = contributions.into_iter().next().unwrap();
                        vec![(0, rendezvous.all_reduce(key, *group_size, replica, value)?)]
                    } else {
                        dfc_interp::reduce_together(rendezvous, key, *group_size, contributions)?
                    };
                    for (i, sum) in sums {
                        write(members[i].2, &sum, ty);
                    }
                }
            }
        }
        Ok(self.fetches.iter().map(|(slot, ty)| read(*slot, ty)).collect())
    }
}

#[derive(Default)]
struct Builder {
    buffers: Vec<usize>,
    feeds: Vec<(String, TensorType)>,
    variables: Vec<(String, TensorType)>,
    consts: Vec<Tensor>,
}

impl Builder {
    fn buffer(&mut self, ty: &TensorType) -> Slot {
        self.buffers.push(ty.size_in_bytes());
        Slot::Arena(self.buffers.len() - 1)
    }
}

/// The step of the f32 product `id` into `out`, or with `update`, added to `out` scaled by α.
fn product_step(module: &Module, id: NodeId, slot_of: &HashMap<NodeId, Slot>, out: Slot, update: Option<f32>) -> Step {
    let graph = &module.graph;
    let Op::MatMul { transpose_a: ta, transpose_b: tb } = graph.node(id).op else {
        unreachable!("a product step is built for a matmul")
    };
    let operands = graph.inputs(id);
    let (a_dims, b_dims) = (graph.ty(operands[0]).shape.dims(), graph.ty(operands[1]).shape.dims());
    let o_dims = graph.node(id).outputs[0].shape.dims();
    let (ra, rb, ro) = (a_dims.len(), b_dims.len(), o_dims.len());
    let (m, n) = (o_dims[ro - 2], o_dims[ro - 1]);
    let k = if ta { a_dims[ra - 2] } else { a_dims[ra - 1] };
    let batches = batch_offsets(&a_dims[..ra - 2], &b_dims[..rb - 2], &o_dims[..ro - 2], m * k, k * n);
    let (a, b) = (slot_of[&operands[0].node], slot_of[&operands[1].node]);
    Step::MatMul { a, b, out, m, n, k, ta, tb, batches, update }
}

/// The product and α when the assignment kernel `kernel` computes `v -= c·(a·b)` or `v += c·(a·b)` (c a scalar
/// constant, or absent) of an f32 matrix product that nothing else needs, which reads nothing stored in `v`: run as
/// `v += α·a·b`, one GEMM that writes `v` once and stores no gradient (SGD's update of a dense layer's weights).
fn folded_update(
    module: &Module,
    kernel: &dfc_codegen::NativeKernel,
    needed: &std::collections::BTreeSet<NodeId>,
    fetched: &HashSet<NodeId>,
) -> Option<(NodeId, f32)> {
    let graph = &module.graph;
    let root = kernel.root;
    let sign = match graph.node(root).op {
        Op::AssignSub => -1.0,
        Op::AssignAdd => 1.0,
        _ => return None,
    };
    let [variable, value] = graph.inputs(root)[..] else { return None };
    let only_user = |id: NodeId, user: NodeId| {
        !fetched.contains(&id) && graph.users(id).into_iter().filter(|u| needed.contains(u)).eq([user])
    };
    let scalar_const = |t: TensorRef| match &graph.node(t.node).op {
        Op::Const { value } if value.shape.n_elements() == 1 => match &value.data {
            Data::F32(v) => Some(v[0]),
            _ => None,
        },
        _ => None,
    };
    let is_product = |t: TensorRef| matches!(graph.node(t.node).op, Op::MatMul { .. });
    let (product, scale) = match graph.node(value.node).op {
        Op::MatMul { .. } if kernel.members == [root] => (value.node, 1.0),
        Op::Binary(dfc_ir::BinaryOp::Mul) if kernel.members == [value.node, root] && only_user(value.node, root) => {
            match graph.inputs(value.node)[..] {
                [c, p] | [p, c] if is_product(p) && scalar_const(c).is_some() => (p.node, scalar_const(c)?),
                _ => return None,
            }
        }
        _ => return None,
    };
    let ty = &graph.node(product).outputs[0];
    let stored = |t: TensorRef| {
        let mut id = t.node;
        while matches!(graph.node(id).op, Op::Read | Op::Reshape { .. } | Op::Identity | Op::StopGradient) {
            id = graph.inputs(id)[0].node;
        }
        id == variable.node
    };
    let fits = ty.dtype == DType::F32 && ty.shape.rank() == 2 && *ty == *graph.ty(variable);
    let operands = graph.inputs(product);
    let plain = operands.iter().all(|t| graph.ty(*t).shape.rank() == 2 && !stored(*t));
    let user = if product == value.node { root } else { value.node };
    (fits && plain && only_user(product, user)).then_some((product, sign * scale))
}

/// Element offsets of `a` and `b` for each batch of a batched product, batch axes broadcast.
fn batch_offsets(a: &[usize], b: &[usize], out: &[usize], a_matrix: usize, b_matrix: usize) -> Vec<(usize, usize)> {
    let count: usize = out.iter().product();
    let strides = |dims: &[usize], matrix: usize| -> Vec<usize> {
        // Right-aligned to `out`; broadcast axes have stride 0.
        let mut strides = vec![0; out.len()];
        let mut s = matrix;
        for j in (0..dims.len()).rev() {
            let o = j + out.len() - dims.len();
            strides[o] = if dims[j] == 1 { 0 } else { s };
            s *= dims[j];
        }
        strides
    };
    let (sa, sb) = (strides(a, a_matrix), strides(b, b_matrix));
    (0..count)
        .map(|mut i| {
            let (mut oa, mut ob) = (0, 0);
            for d in (0..out.len()).rev() {
                let idx = i % out[d];
                i /= out[d];
                oa += idx * sa[d];
                ob += idx * sb[d];
            }
            (oa, ob)
        })
        .collect()
}

/// Transpose, concat, slice, pad or gather on elements of `T`'s size.
///
/// # Safety
/// Each input points to a value of its type, and `out` to room for a value of `ty`, elements of
/// `T`'s size (a gather's indices: i32 or i64, as their type says); `out` overlaps no input.
unsafe fn move_elements<T: Copy + Default + Send + Sync>(
    op: &Op,
    inputs: &[(*const u8, &TensorType)],
    out: *mut u8,
    ty: &TensorType,
) -> Result<(), dfc_kernels::IndexOutOfRange> {
    let slice = |(ptr, ty): (*const u8, &TensorType)| {
        // SAFETY: the function's contract: a value of `ty`, of `T`'s size per element.
        unsafe { std::slice::from_raw_parts(ptr as *const T, ty.shape.n_elements()) }
    };
    // SAFETY: the function's contract: room for `ty`'s elements, overlapping no input.
    let output = unsafe { std::slice::from_raw_parts_mut(out as *mut T, ty.shape.n_elements()) };
    let dims = |i: usize| inputs[i].1.shape.dims();
    match op {
        Op::Transpose { perm } => dfc_kernels::transpose(slice(inputs[0]), dims(0), perm, output),
        Op::Concat { axis } => {
            let parts: Vec<&[T]> = inputs.iter().map(|&i| slice(i)).collect();
            dfc_kernels::concat(&parts, ty.shape.dims(), *axis, output)
        }
        Op::Slice { begin, size } => dfc_kernels::slice(slice(inputs[0]), dims(0), begin, size, output),
        Op::Pad { before, after } => dfc_kernels::pad(slice(inputs[0]), dims(0), before, after, output),
        Op::Gather => {
            let rows = dims(0).first().copied().unwrap_or(0);
            let n = inputs[1].1.shape.n_elements();
            return match inputs[1].1.dtype {
                DType::I32 => {
                    // SAFETY: the function's contract: the indices are n i32s, as their type says.
                    let indices = unsafe { std::slice::from_raw_parts(inputs[1].0 as *const i32, n) };
                    dfc_kernels::gather(slice(inputs[0]), rows, indices, output)
                }
                _ => {
                    // SAFETY: the function's contract: otherwise the indices are n i64s.
                    let indices = unsafe { std::slice::from_raw_parts(inputs[1].0 as *const i64, n) };
                    dfc_kernels::gather(slice(inputs[0]), rows, indices, output)
                }
            };
        }
        other => unreachable!("`{}` is not a layout step", other.name()),
    }
    Ok(())
}

fn rename(error: InterpError, node: &str) -> InterpError {
    match error {
        InterpError::IndexOutOfRange { index, size, .. } => {
            InterpError::IndexOutOfRange { node: node.into(), index, size }
        }
        InterpError::DivisionByZero { .. } => InterpError::DivisionByZero { node: node.into() },
        InterpError::InvalidValue { message, .. } => InterpError::InvalidValue { node: node.into(), message },
        other => other,
    }
}

/// Splits a kernel's rows over the rayon pool when it is marked parallel.
///
/// # Safety
/// `args` holds every buffer `function` reads and writes, in its order, each with room for the
/// kernel's `rows`.
unsafe fn run_kernel(function: KernelFn, args: &[*mut u8], rows: u64, parallel: bool) {
    let threads = rayon::current_num_threads() as u64;
    if !parallel || threads < 2 || rows < 2 {
        // SAFETY: the function's contract.
        unsafe { function(args.as_ptr(), 0, rows as i64) };
        return;
    }
    let chunks = threads.min(rows);
    let args_addr = args.as_ptr() as usize;
    dfc_gemm::run_chunks(chunks as usize, threads as usize - 1, &|c| {
        let (begin, end) = (rows * c as u64 / chunks, rows * (c as u64 + 1) / chunks);
        // SAFETY: the function's contract; ranges of rows are disjoint, and a kernel writes only
        // its own rows' outputs.
        unsafe { function(args_addr as *const *mut u8, begin as i64, end as i64) };
    });
}

fn data_ptr(data: &Data) -> *const u8 {
    match data {
        Data::F32(v) => v.as_ptr() as *const u8,
        Data::F64(v) => v.as_ptr() as *const u8,
        Data::I32(v) => v.as_ptr() as *const u8,
        Data::I64(v) => v.as_ptr() as *const u8,
        Data::U8(v) => v.as_ptr(),
        Data::Bool(v) => v.as_ptr() as *const u8,
    }
}

fn data_ptr_mut(data: &mut Data) -> *mut u8 {
    match data {
        Data::F32(v) => v.as_mut_ptr() as *mut u8,
        Data::F64(v) => v.as_mut_ptr() as *mut u8,
        Data::I32(v) => v.as_mut_ptr() as *mut u8,
        Data::I64(v) => v.as_mut_ptr() as *mut u8,
        Data::U8(v) => v.as_mut_ptr(),
        Data::Bool(v) => v.as_mut_ptr() as *mut u8,
    }
}

/// A copy of the `ty` value at `ptr`.
///
/// # Safety
/// `ptr` points to a value of `ty` (bools as bytes).
unsafe fn read_tensor(ptr: *const u8, ty: &TensorType) -> Tensor {
    let n = ty.shape.n_elements();
    // SAFETY: the function's contract; any byte is read as a bool (non-zero: true).
    let data = unsafe {
        match ty.dtype {
            DType::F32 => Data::F32(std::slice::from_raw_parts(ptr as *const f32, n).to_vec()),
            DType::F64 => Data::F64(std::slice::from_raw_parts(ptr as *const f64, n).to_vec()),
            DType::I32 => Data::I32(std::slice::from_raw_parts(ptr as *const i32, n).to_vec()),
            DType::I64 => Data::I64(std::slice::from_raw_parts(ptr as *const i64, n).to_vec()),
            DType::U8 => Data::U8(std::slice::from_raw_parts(ptr, n).to_vec()),
            DType::Bool => Data::Bool(std::slice::from_raw_parts(ptr, n).iter().map(|&b| b != 0).collect()),
        }
    };
    Tensor::new(ty.shape.clone(), data)
}

/// Writes `tensor`, a value of `ty`, at `ptr`.
///
/// # Safety
/// `ptr` has room for a value of `ty`, and nothing else reads or writes it meanwhile.
unsafe fn write_tensor(ptr: *mut u8, tensor: &Tensor, ty: &TensorType) {
    assert_eq!(tensor.ty(), *ty, "a value of the slot's type");
    let bytes = ty.size_in_bytes();
    // SAFETY: the function's contract, and `tensor` is a value of `ty` (asserted): its data has
    // `bytes` bytes.
    unsafe { std::ptr::copy_nonoverlapping(data_ptr(&tensor.data), ptr, bytes) };
}
