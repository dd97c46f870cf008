//! A partition's schedule: the steps some fetches and targets need (whole fused kernels,
//! matrix products, convolutions, exchanges, …), which values alias which, and every other
//! value's place in one arena planned by liveness. The CPU's `NativeProgram` runs it with its
//! JIT-compiled kernels over host memory; the GPU's program (`dfc_cuda::program`) runs the same
//! schedule with its kernels' launches. Planning knows nothing of how kernels run.

use crate::memory::{self, Lifetime};
use crate::CpuError;
use dfc_gemm::ByteScale;
use dfc_interp::{InterpError, Tensor};
use dfc_ir::{DType, Module, NodeId, Op, TensorRef, TensorType};
use dfc_kernels::{Conv2dGeometry, PoolGeometry};
use std::collections::{HashMap, HashSet};

/// A fused kernel as a schedule sees it: the node it computes, the nodes it computes inside
/// itself, and the values it reads (`dfc_passes::Kernel`'s fields, which the compiled kernel
/// descriptions of both back ends repeat).
#[derive(Clone, Copy, Debug)]
pub struct KernelSite<'k> {
    pub root: NodeId,
    pub members: &'k [NodeId],
    pub inputs: &'k [TensorRef],
}

/// A slot a step reads or writes, and its value's bytes.
pub type Access = (Slot, usize);

/// The planned steps of a partition for some fetches and targets, with every value's slot.
#[derive(Debug)]
pub struct Schedule {
    pub steps: Vec<Step>,
    /// The updates run as one GEMM into their variable (`dfc_passes::fuse::folded_update`), by node name.
    pub folded_updates: Vec<String>,
    /// The kernels that scale bytes fed in whose products read the bytes instead (`byte_operands`), by node name.
    pub bytes_read: Vec<String>,
    /// The kernels computed by the product they add a bias to (`fused_product`), by node name.
    pub fused_products: Vec<String>,
    /// The kernels that sum a fused product's columns, computed by the product (`column_sums`), by node name.
    pub summed_columns: Vec<String>,
    /// The convolutions computed with the max pooling that reads them (`pooled_convolutions`), by node name.
    pub pooled_convolutions: Vec<String>,
    /// The kernels (a bias, then a relu) computed by the pooled convolution they follow, by node name.
    pub pooled_epilogues: Vec<String>,
    /// Each fetched value's slot and type.
    pub fetches: Vec<(Slot, TensorType)>,
    /// `Slot::Feed(i)` is input `feeds[i]`.
    pub feeds: Vec<(String, TensorType)>,
    /// `Slot::Variable(i)` is variable `variables[i]`.
    pub variables: Vec<(String, TensorType)>,
    /// `Slot::Const(i)` is `consts[i]`.
    pub consts: Vec<Tensor>,
    /// Bytes of the arena: `Slot::Arena(offset)` is at `offset` in it (aligned to `memory::ALIGN`).
    pub arena_bytes: usize,
}

/// Where a value lives during a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Slot {
    /// A planned buffer (an index into `buffers` until offsets are assigned).
    Arena(usize),
    Feed(usize),
    Variable(usize),
    Const(usize),
}

#[derive(Debug)]
pub enum Step {
    /// Fused kernel `kernel` (an index into the schedule's kernels) over `args`: its inputs,
    /// then its output.
    Kernel {
        kernel: usize,
        args: Vec<Slot>,
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
        /// `Some`: `a` holds bytes, read through the scale (`byte_operands`).
        bytes: Option<ByteScale>,
        /// `Some`: the bias and relu of the kernel this product is fused with (`fused_product`).
        epilogue: Option<Epilogue>,
        /// `b` is a variable that a step of this schedule writes (a weight the training step updates): the
        /// product's threads then read it by columns where `a` is bytes (`dfc_gemm::sgemm_fused`).
        b_rewritten: bool,
    },
    /// A convolution or its gradients (im2col and GEMM): `(a, b)` are `(input, filter)`,
    /// `(filter, grad_out)` or `(input, grad_out)`.
    Conv {
        /// The convolution node.
        node: NodeId,
        kind: ConvKind,
        geometry: Conv2dGeometry,
        a: Slot,
        b: Slot,
        out: Slot,
        out_len: usize,
        /// `Some`: a forward convolution max-pooled in the same pass (`pooled_convolutions`); `out` is the
        /// pooling's (or what follows it there), and the convolution's own output is never stored.
        pool: Option<Pooling>,
    },
    /// Pooling or its gradients on f32: `operands` are `[input]`, `[input, grad_out]` (max) or
    /// `[grad_out]` (avg).
    Pool {
        /// The pooling node.
        node: NodeId,
        kind: PoolKind,
        geometry: PoolGeometry,
        operands: Vec<(Slot, usize)>,
        out: Slot,
        out_len: usize,
    },
    /// Batch normalisation on f32 (`Moments`, `BatchNorm`, `BatchNormGradMeans`,
    /// `BatchNormGrad`): `operands` are `x`, then the moments, the output's gradient and its
    /// means as the op takes them, with their lengths, of `channels` channels (the last axis).
    Norm {
        /// The node.
        node: NodeId,
        op: Op,
        channels: usize,
        operands: Vec<(Slot, usize)>,
        out: Slot,
        out_len: usize,
    },
    /// Data movement (transpose, concat, slice, pad, gather): copies of elements of
    /// `element_bytes` each, whatever their type.
    Layout {
        /// The node, and its name.
        id: NodeId,
        node: String,
        op: Op,
        element_bytes: usize,
        operands: Vec<(Slot, TensorType)>,
        out: Slot,
        ty: TensorType,
    },
    Library {
        /// The node, and its name.
        id: NodeId,
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
    /// The sum of every replica's value under `key`: per member of this program, its replica,
    /// its value's slot and its sum's. `overlapped`: the step only starts the all-reduce, on
    /// the program's communication thread, and the matching `AllReduceWait` writes the sums.
    AllReduce {
        key: String,
        group_size: u32,
        members: Vec<(u32, Slot, Slot)>,
        ty: TensorType,
        overlapped: bool,
    },
    /// Waits for the overlapped all-reduce of `key` and writes its sums into `outs`.
    AllReduceWait {
        key: String,
        outs: Vec<Slot>,
        ty: TensorType,
    },
}

#[derive(Clone, Copy, Debug)]
pub enum ConvKind {
    Forward,
    BackpropInput,
    BackpropFilter,
}

/// What a product does to each element before storing it: adds the bias of its column (`Some`: a vector of n
/// floats), then the relu where `relu` (`dfc_gemm::Epilogue`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Epilogue {
    pub bias: Option<Slot>,
    pub relu: bool,
    /// `Some`: an m×n matrix; elements where it is not above 0 are 0.
    pub mask: Option<Slot>,
    /// `Some`: n floats that get the sums of C's finished columns (`column_sums`).
    pub col_sums: Option<Slot>,
}

/// The max pooling computed with a forward convolution (`Step::Conv::pool`), and what each pooled element then
/// gets there (`dfc_kernels::PoolEpilogue`): the bias of its filter (`Some`: a vector of one per filter), then the
/// relu.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Pooling {
    pub geometry: PoolGeometry,
    pub bias: Option<Slot>,
    pub relu: bool,
}

#[derive(Clone, Copy, Debug)]
pub enum PoolKind {
    Max,
    MaxGrad,
    Avg,
    AvgGrad,
}

impl Step {
    /// The slots the step reads, and those it writes.
    pub fn reads_writes(&self) -> (Vec<Slot>, Vec<Slot>) {
        match self {
            Step::Kernel { args, .. } => (args[..args.len() - 1].to_vec(), vec![*args.last().unwrap()]),
            Step::MatMul { a, b, out, epilogue, .. } => {
                let extra = epilogue.iter().flat_map(|e| e.bias.into_iter().chain(e.mask));
                let sums = epilogue.and_then(|e| e.col_sums);
                (extra.chain([*a, *b]).collect(), [*out].into_iter().chain(sums).collect())
            }
            Step::Library { operands, out, .. } | Step::Layout { operands, out, .. } => {
                (operands.iter().map(|o| o.0).collect(), vec![*out])
            }
            Step::Conv { a, b, out, pool, .. } => {
                (pool.and_then(|p| p.bias).into_iter().chain([*a, *b]).collect(), vec![*out])
            }
            Step::Pool { operands, out, .. } | Step::Norm { operands, out, .. } => {
                (operands.iter().map(|o| o.0).collect(), vec![*out])
            }
            Step::Update { variable, value, .. } => (vec![*variable, value.0], vec![*variable]),
            Step::Copy { from, to, .. } => (vec![*from], vec![*to]),
            Step::Send { value, .. } => (vec![*value], vec![]),
            Step::Recv { out, .. } => (vec![], vec![*out]),
            Step::AllReduce { members, overlapped, .. } => {
                let reads = members.iter().map(|m| m.1).collect();
                (reads, if *overlapped { Vec::new() } else { members.iter().map(|m| m.2).collect() })
            }
            Step::AllReduceWait { outs, .. } => (Vec::new(), outs.clone()),
        }
    }

    /// The slots the step reads and those it writes, each with its value's bytes (what a back
    /// end whose memory is elsewhere copies to run the step on the host).
    pub fn accesses(&self) -> (Vec<Access>, Vec<Access>) {
        let typed = |operands: &[(Slot, TensorType)]| -> Vec<Access> {
            operands.iter().map(|(s, t)| (*s, t.size_in_bytes())).collect()
        };
        const F32: usize = 4;
        match self {
            Step::Kernel { .. } => (Vec::new(), Vec::new()),
            Step::MatMul { a, b, out, m, n, k, batches, update, bytes, epilogue, .. } => {
                // The furthest any batch reaches into each operand.
                let a_len = batches.iter().map(|&(oa, _)| oa + m * k).max().unwrap_or(0);
                let b_len = batches.iter().map(|&(_, ob)| ob + k * n).max().unwrap_or(0);
                let out_len = batches.len() * m * n;
                let a_element = if bytes.is_some() { 1 } else { F32 };
                let mut reads = vec![(*a, a_len * a_element), (*b, b_len * F32)];
                if let Some(bias) = epilogue.and_then(|e| e.bias) {
                    reads.push((bias, n * F32));
                }
                if let Some(mask) = epilogue.and_then(|e| e.mask) {
                    reads.push((mask, out_len * F32));
                }
                if update.is_some() {
                    reads.push((*out, out_len * F32));
                }
                let sums = epilogue.and_then(|e| e.col_sums).map(|sums| (sums, n * F32));
                (reads, [(*out, out_len * F32)].into_iter().chain(sums).collect())
            }
            Step::Conv { kind, geometry: g, a, b, out, out_len, pool, .. } => {
                let (a_len, b_len) = match kind {
                    ConvKind::Forward => (g.input_len(), g.filter_len()),
                    ConvKind::BackpropInput => (g.filter_len(), g.output_len()),
                    ConvKind::BackpropFilter => (g.input_len(), g.output_len()),
                };
                let bias = pool.and_then(|p| p.bias).map(|bias| (bias, g.filters * F32));
                (bias.into_iter().chain([(*a, a_len * F32), (*b, b_len * F32)]).collect(), vec![(*out, out_len * F32)])
            }
            Step::Pool { operands, out, out_len, .. } | Step::Norm { operands, out, out_len, .. } => {
                (operands.iter().map(|&(s, len)| (s, len * F32)).collect(), vec![(*out, out_len * F32)])
            }
            Step::Layout { operands, out, ty, .. } | Step::Library { operands, out, ty, .. } => {
                (typed(operands), vec![(*out, ty.size_in_bytes())])
            }
            Step::Update { variable, value, ty, .. } => {
                let bytes = ty.size_in_bytes();
                (vec![(*variable, bytes), (value.0, value.1.size_in_bytes())], vec![(*variable, bytes)])
            }
            Step::Copy { from, to, bytes } => (vec![(*from, *bytes)], vec![(*to, *bytes)]),
            Step::Send { value, ty, .. } => (vec![(*value, ty.size_in_bytes())], Vec::new()),
            Step::Recv { out, ty, .. } => (Vec::new(), vec![(*out, ty.size_in_bytes())]),
            Step::AllReduce { members, ty, overlapped, .. } => {
                let bytes = ty.size_in_bytes();
                let writes = if *overlapped { Vec::new() } else { members.iter().map(|m| (m.2, bytes)).collect() };
                (members.iter().map(|m| (m.1, bytes)).collect(), writes)
            }
            Step::AllReduceWait { outs, ty, .. } => {
                (Vec::new(), outs.iter().map(|&o| (o, ty.size_in_bytes())).collect())
            }
        }
    }

    fn slots_mut(&mut self) -> Vec<&mut Slot> {
        match self {
            Step::Kernel { args, .. } => args.iter_mut().collect(),
            Step::MatMul { a, b, out, epilogue, .. } => {
                let extra = epilogue
                    .iter_mut()
                    .flat_map(|e| e.bias.iter_mut().chain(e.mask.iter_mut()).chain(e.col_sums.iter_mut()));
                extra.chain([a, b, out]).collect()
            }
            Step::Library { operands, out, .. } | Step::Layout { operands, out, .. } => {
                operands.iter_mut().map(|o| &mut o.0).chain([out]).collect()
            }
            Step::Conv { a, b, out, pool, .. } => {
                pool.iter_mut().flat_map(|p| p.bias.iter_mut()).chain([a, b, out]).collect()
            }
            Step::Pool { operands, out, .. } | Step::Norm { operands, out, .. } => {
                operands.iter_mut().map(|o| &mut o.0).chain([out]).collect()
            }
            Step::Update { variable, value, .. } => vec![variable, &mut value.0],
            Step::Copy { from, to, .. } => vec![from, to],
            Step::Send { value, .. } => vec![value],
            Step::Recv { out, .. } => vec![out],
            Step::AllReduce { members, .. } => members.iter_mut().flat_map(|m| [&mut m.1, &mut m.2]).collect(),
            Step::AllReduceWait { outs, .. } => outs.iter_mut().collect(),
        }
    }
}

fn malformed(module: &Module, id: NodeId, message: impl Into<String>) -> CpuError {
    CpuError::Interp(InterpError::Malformed { node: module.graph.node(id).name.clone(), message: message.into() })
}

impl Step {
    /// What the step does, in a word: its op's name (`conv2d`, `max_pool`, `transpose`, …),
    /// `kernel`, `matmul`, `copy`, `send`, `recv` or `all_reduce`.
    pub fn kind(&self) -> String {
        match self {
            Step::Kernel { .. } => "kernel".into(),
            Step::MatMul { .. } => "matmul".into(),
            Step::Conv { pool: Some(_), .. } => "conv2d_max_pool".into(),
            Step::Conv { kind, .. } => match kind {
                ConvKind::Forward => "conv2d",
                ConvKind::BackpropInput => "conv2d_backprop_input",
                ConvKind::BackpropFilter => "conv2d_backprop_filter",
            }
            .into(),
            Step::Pool { kind, .. } => match kind {
                PoolKind::Max => "max_pool",
                PoolKind::MaxGrad => "max_pool_grad",
                PoolKind::Avg => "avg_pool",
                PoolKind::AvgGrad => "avg_pool_grad",
            }
            .into(),
            Step::Layout { op, .. } | Step::Library { op, .. } | Step::Update { op, .. } | Step::Norm { op, .. } => {
                op.name().to_string()
            }
            Step::Copy { .. } => "copy".into(),
            Step::Send { .. } => "send".into(),
            Step::Recv { .. } => "recv".into(),
            Step::AllReduce { .. } => "all_reduce".into(),
            Step::AllReduceWait { .. } => "all_reduce_wait".into(),
        }
    }
}

impl Schedule {
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

    /// The schedule computing `fetches` and running `targets` over `module` (a partition)
    /// whose fused kernels are `kernels` (`dfc_passes::fuse` of this module, as compiled), nodes
    /// in `order` (see `dfc_interp::Program::with_order`), in a program that trains or not
    /// (`training`: see `dfc_interp::Program::with_mode`).
    pub fn new(
        module: &Module,
        kernels: &[KernelSite<'_>],
        fetches: &[TensorRef],
        targets: &[NodeId],
        order: &[NodeId],
        training: bool,
    ) -> Result<Schedule, CpuError> {
        Schedule::build(module, kernels, fetches, targets, order, training, false, true)
    }

    /// Like [`Schedule::new`], for a back end whose products take floats and nothing else: every kernel that
    /// scales bytes for a product runs (see `byte_operands`), none is fused into its product
    /// (`fused_product`), and no convolution is pooled as it is computed (`pooled_convolutions`).
    pub fn floats_only(
        module: &Module,
        kernels: &[KernelSite<'_>],
        fetches: &[TensorRef],
        targets: &[NodeId],
        order: &[NodeId],
        training: bool,
    ) -> Result<Schedule, CpuError> {
        Schedule::build(module, kernels, fetches, targets, order, training, false, false)
    }

    /// Like [`Schedule::new`], with the all-reduces overlapped with the computation: each
    /// starts as soon as its operands are computed (with the reshapes and concatenations that
    /// only feed it) and runs on a communication thread while the steps go on, and an
    /// `AllReduceWait` takes its sums just before their first use. The all-reduces start in the
    /// order `order` gives them, so replicas meet them in one order.
    pub fn overlapped(
        module: &Module,
        kernels: &[KernelSite<'_>],
        fetches: &[TensorRef],
        targets: &[NodeId],
        order: &[NodeId],
        training: bool,
    ) -> Result<Schedule, CpuError> {
        Schedule::build(module, kernels, fetches, targets, order, training, true, true)
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        module: &Module,
        kernels: &[KernelSite<'_>],
        fetches: &[TensorRef],
        targets: &[NodeId],
        order: &[NodeId],
        training: bool,
        overlap: bool,
        fuse_products: bool,
    ) -> Result<Schedule, CpuError> {
        let graph = &module.graph;
        // The interpreter's program checks every node: the same checks hold here.
        dfc_interp::Program::with_mode(module, fetches, targets, order, training)?;
        let roots: Vec<NodeId> = fetches.iter().map(|f| f.node).chain(targets.iter().copied()).collect();
        let needed = graph.ancestors(&roots);
        let order: Vec<NodeId> = {
            let mut seen = HashSet::new();
            order.iter().copied().filter(|id| needed.contains(id) && seen.insert(*id)).collect()
        };
        let order = if overlap { crate::overlap::hoist_all_reduces(graph, &order) } else { order };
        let index_of: HashMap<NodeId, usize> = kernels.iter().enumerate().map(|(i, k)| (k.root, i)).collect();
        let kernels: HashMap<NodeId, &KernelSite> = kernels.iter().map(|k| (k.root, k)).collect();
        // Nodes computed inside the kernels the program runs, and those kernels' roots.
        let mut inside: HashMap<NodeId, Vec<NodeId>> = HashMap::new();
        for &id in &order {
            if let Some(kernel) = kernels.get(&id) {
                for &m in kernel.members {
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
            .filter_map(|kernel| {
                dfc_passes::fuse::folded_update(module, kernel.root, kernel.members, |id, user| {
                    !fetched.contains(&id) && graph.users(id).into_iter().filter(|u| needed.contains(u)).eq([user])
                })
                .map(|f| (kernel.root, f))
            })
            .collect();
        let epilogues: HashMap<NodeId, FusedProduct> = if fuse_products {
            // How many of the kernels run read each value: a product that another kernel reads too (one that
            // recomputes the sum inside itself) is stored.
            let mut kernels_reading: HashMap<NodeId, usize> = HashMap::new();
            for kernel in order.iter().filter_map(|id| kernels.get(id)) {
                for node in kernel.inputs.iter().map(|t| t.node).collect::<HashSet<_>>() {
                    *kernels_reading.entry(node).or_default() += 1;
                }
            }
            order
                .iter()
                .filter_map(|id| kernels.get(id))
                .filter_map(|kernel| fused_product(module, kernel, &needed, &fetched).map(|f| (kernel.root, f)))
                .filter(|(_, fused)| kernels_reading.get(&fused.product) == Some(&1))
                .collect()
        } else {
            HashMap::new()
        };
        // The kernel that only sums a fused product's columns, by fused kernel root (one: simplification leaves no
        // second such sum of a result, and one would run as a kernel); and each such kernel's fused kernel.
        let mut sums_of: HashMap<NodeId, NodeId> = HashMap::new();
        for kernel in order.iter().filter_map(|id| kernels.get(id)) {
            if let Some(fused) = column_sums(module, kernel, &epilogues) {
                sums_of.entry(fused).or_insert(kernel.root);
            }
        }
        let summed: HashMap<NodeId, NodeId> = sums_of.iter().map(|(&fused, &sum)| (sum, fused)).collect();
        let pooled =
            if fuse_products { pooled_convolutions(module, &order, &needed, &fetched) } else { HashMap::new() };
        // Kernels that only add a bias to a pooling computed with its convolution and take the relu, by root: the
        // pooling (then not stored), the bias, the relu.
        let pooled_epilogues: HashMap<NodeId, PooledEpilogue> = order
            .iter()
            .filter_map(|id| kernels.get(id))
            .filter_map(|kernel| pooled_epilogue(module, kernel, &pooled, &needed, &fetched).map(|e| (kernel.root, e)))
            .collect();
        let folded_products: HashSet<NodeId> = folded
            .values()
            .map(|f| f.0)
            .chain(epilogues.values().map(|f| f.product))
            .chain(pooled.values().map(|p| p.conv))
            .chain(pooled_epilogues.values().map(|e| e.pool))
            .collect();
        let byte_operands =
            if fuse_products { byte_operands(module, &kernels, &needed, &fetched) } else { HashMap::new() };
        let bytes_read: HashMap<NodeId, ByteScale> = byte_operands.iter().map(|(&root, &(_, s))| (root, s)).collect();
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
                (None, Some(_)) if epilogues.contains_key(&id) => {
                    let fused = &epilogues[&id];
                    fused.bias.into_iter().chain(fused.mask).chain(graph.inputs(fused.product)).collect()
                }
                (None, Some(_)) if pooled_epilogues.contains_key(&id) => {
                    let then = &pooled_epilogues[&id];
                    then.bias.into_iter().chain(graph.inputs(pooled[&then.pool].conv)).collect()
                }
                (None, Some(kernel)) => kernel.inputs.to_vec(),
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
        // Whether the variable that `id` (a read or an assignment) yields a view of is assigned
        // again before that value's last use: then the value is copied.
        let overwritten = |id: NodeId| {
            let variable = graph.inputs(id)[0].node;
            let at = position[&id];
            let next_assign = assigns_of.get(&variable).and_then(|a| a.iter().copied().filter(|&p| p > at).min());
            matches!((next_assign, last_use.get(&id)), (Some(a), Some(&l)) if l > a)
        };
        let copied = |ops: fn(&Op) -> bool| -> HashSet<NodeId> {
            order.iter().copied().filter(|&id| ops(&graph.node(id).op) && overwritten(id)).collect()
        };
        let copied_reads = copied(|op| matches!(op, Op::Read));
        // An assignment yields its variable's new value, which is the variable's buffer.
        let copied_assigns = copied(|op| matches!(op, Op::Assign | Op::AssignAdd | Op::AssignSub));
        let keep_value = |id: NodeId, builder: &mut Builder, steps: &mut Vec<Step>, variable: Slot| -> Slot {
            if !copied_assigns.contains(&id) {
                return variable;
            }
            let ty = graph.node(id).outputs[0].clone();
            let out = builder.buffer(&ty);
            steps.push(Step::Copy { from: variable, to: out, bytes: ty.size_in_bytes() });
            out
        };

        let mut builder = Builder::default();
        let mut slot_of: HashMap<NodeId, Slot> = HashMap::new();
        let mut steps: Vec<Step> = Vec::new();
        // Replicas of an all-reduce that an earlier one of this program contributes.
        let mut reduced_later: HashSet<NodeId> = HashSet::new();
        for &id in &order {
            // A column sum's slot is its product's, written there.
            if reduced_later.contains(&id) || computed_inside(id) || summed.contains_key(&id) {
                continue;
            }
            let node = graph.node(id);
            let operand_slots = |ids: &[TensorRef], slot_of: &HashMap<NodeId, Slot>| -> Vec<Slot> {
                ids.iter().map(|t| slot_of[&t.node]).collect()
            };
            let ty = node.outputs.first().cloned();
            if let Some(&(product, alpha)) = folded.get(&id) {
                let out = slot_of[&graph.inputs(id)[0].node];
                steps.push(product_step(module, product, &slot_of, &bytes_read, out, Some(alpha), None));
                let value = keep_value(id, &mut builder, &mut steps, out);
                slot_of.insert(id, value);
                continue;
            }
            if let Some(fused) = epilogues.get(&id) {
                let out = builder.buffer(ty.as_ref().unwrap());
                let col_sums = sums_of.get(&id).map(|&sum| {
                    let slot = builder.buffer(&graph.node(sum).outputs[0]);
                    slot_of.insert(sum, slot);
                    slot
                });
                let epilogue = Epilogue {
                    bias: fused.bias.map(|t| slot_of[&t.node]),
                    relu: fused.relu,
                    mask: fused.mask.map(|t| slot_of[&t.node]),
                    col_sums,
                };
                steps.push(product_step(module, fused.product, &slot_of, &bytes_read, out, None, Some(epilogue)));
                slot_of.insert(id, out);
                continue;
            }
            // A pooled convolution at its pooling, or at the kernel that finishes the pooling (then not stored).
            let then = pooled_epilogues.get(&id);
            if let Some(p) = then.map_or_else(|| pooled.get(&id), |then| pooled.get(&then.pool)) {
                let ty = ty.as_ref().unwrap();
                let out = builder.buffer(ty);
                let operands = graph.inputs(p.conv);
                let (a, b) = (slot_of[&operands[0].node], slot_of[&operands[1].node]);
                let pool = Pooling {
                    geometry: p.pool,
                    bias: then.and_then(|then| then.bias).map(|t| slot_of[&t.node]),
                    relu: then.is_some_and(|then| then.relu),
                };
                steps.push(Step::Conv {
                    node: p.conv,
                    kind: ConvKind::Forward,
                    geometry: p.geometry,
                    a,
                    b,
                    out,
                    out_len: ty.shape.n_elements(),
                    pool: Some(pool),
                });
                slot_of.insert(id, out);
                continue;
            }
            if let Some(&(input, _)) = byte_operands.get(&id) {
                // Its products read the input's bytes.
                slot_of.insert(id, slot_of[&input]);
                continue;
            }
            if let Some(kernel) = kernels.get(&id) {
                let mut args = operand_slots(kernel.inputs, &slot_of);
                let out = match node.op {
                    Op::Assign | Op::AssignAdd | Op::AssignSub => slot_of[&graph.inputs(id)[0].node],
                    _ => builder.buffer(ty.as_ref().unwrap()),
                };
                args.push(out);
                steps.push(Step::Kernel { kernel: index_of[&id], args });
                let value = match node.op {
                    Op::Assign | Op::AssignAdd | Op::AssignSub => keep_value(id, &mut builder, &mut steps, out),
                    _ => out,
                };
                slot_of.insert(id, value);
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
                // A program that runs updates trains; any other evaluates or infers.
                Op::TrainingFlag => {
                    slot_of.insert(id, Slot::Const(builder.consts.len()));
                    builder.consts.push(Tensor::scalar(training));
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
                    let value = keep_value(id, &mut builder, &mut steps, variable);
                    slot_of.insert(id, value);
                }
                Op::MatMul { .. } if ty.as_ref().unwrap().dtype == DType::F32 => {
                    let out = builder.buffer(ty.as_ref().unwrap());
                    steps.push(product_step(module, id, &slot_of, &bytes_read, out, None, None));
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
                    let out_len = ty.shape.n_elements();
                    steps.push(Step::Conv { node: id, kind, geometry, a, b, out, out_len, pool: None });
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
                    steps.push(Step::Pool { node: id, kind, geometry, operands, out, out_len: ty.shape.n_elements() });
                    slot_of.insert(id, out);
                }
                Op::Moments | Op::BatchNorm { .. } | Op::BatchNormGradMeans { .. } | Op::BatchNormGrad { .. }
                    if operands.iter().all(|t| graph.ty(*t).dtype == DType::F32) =>
                {
                    let ty = ty.unwrap();
                    let x = graph.ty(operands[0]).shape.dims();
                    let channels = x[x.len() - 1];
                    let out = builder.buffer(&ty);
                    let operands =
                        operands.iter().map(|t| (slot_of[&t.node], graph.ty(*t).shape.n_elements())).collect();
                    let (op, out_len) = (node.op.clone(), ty.shape.n_elements());
                    steps.push(Step::Norm { node: id, op, channels, operands, out, out_len });
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
                    let replicas = order[position[&id]..]
                        .iter()
                        .filter(|&&other| matches!(&graph.node(other).op, Op::AllReduce { key: k, .. } if k == key))
                        .count();
                    let mut members = Vec::new();
                    for &other in &order[position[&id]..] {
                        if let Op::AllReduce { key: k, replica, .. } = &graph.node(other).op {
                            if k == key {
                                let operand = graph.inputs(other)[0].node;
                                let value = *slot_of.get(&operand).ok_or_else(|| {
                                    malformed(
                                        module,
                                        other,
                                        "its operand is not computed when the first replica reduces",
                                    )
                                })?;
                                // A lone replica's sum takes its operand's buffer where nothing
                                // reads the operand after: the ring then sums in place, uncopied.
                                let dies_here = matches!(value, Slot::Arena(_))
                                    && !aliases_operand(operand)
                                    && !fetched.contains(&operand)
                                    && last_use.get(&operand) == Some(&position[&other]);
                                let out = if replicas == 1 && dies_here { value } else { builder.buffer(&ty) };
                                slot_of.insert(other, out);
                                reduced_later.insert(other);
                                members.push((*replica, value, out));
                            }
                        }
                    }
                    let (key, group_size) = (key.clone(), *group_size);
                    steps.push(Step::AllReduce { key, group_size, members, ty, overlapped: false });
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
                        Step::Layout { id, node, op, element_bytes, operands, out, ty }
                    } else {
                        Step::Library { id, node, op, operands, out, ty }
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

        if overlap {
            steps = crate::overlap::split_all_reduces(steps);
        }

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
        mark_rewritten_operands(&mut steps);
        let folded_updates = order.iter().filter(|id| folded.contains_key(id)).map(|&id| graph.node(id).name.clone());
        let bytes_read =
            order.iter().filter(|id| byte_operands.contains_key(id)).map(|&id| graph.node(id).name.clone());
        let fused_products =
            order.iter().filter(|id| epilogues.contains_key(id)).map(|&id| graph.node(id).name.clone());
        let summed_columns = order.iter().filter(|id| summed.contains_key(id)).map(|&id| graph.node(id).name.clone());
        let pooled_convolutions = order.iter().filter_map(|id| pooled.get(id)).map(|p| graph.node(p.conv).name.clone());
        let pooled_epilogues =
            order.iter().filter(|id| pooled_epilogues.contains_key(id)).map(|&id| graph.node(id).name.clone());
        Ok(Schedule {
            steps,
            fused_products: fused_products.collect(),
            summed_columns: summed_columns.collect(),
            pooled_convolutions: pooled_convolutions.collect(),
            pooled_epilogues: pooled_epilogues.collect(),
            folded_updates: folded_updates.collect(),
            bytes_read: bytes_read.collect(),
            fetches,
            feeds: builder.feeds,
            variables: builder.variables,
            consts: builder.consts,
            arena_bytes,
        })
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

/// The step of the f32 product `id` into `out`, or with `update`, added to `out` scaled by α; reading the bytes
/// of its A where `bytes` (by the kernel it would read, see `byte_operands`) says so.
fn product_step(
    module: &Module,
    id: NodeId,
    slot_of: &HashMap<NodeId, Slot>,
    bytes: &HashMap<NodeId, ByteScale>,
    out: Slot,
    update: Option<f32>,
    epilogue: Option<Epilogue>,
) -> Step {
    let graph = &module.graph;
    let bytes = bytes.get(&through_aliases(module, graph.inputs(id)[0].node)).copied();
    let Op::MatMul { transpose_a: ta, transpose_b: tb } = graph.node(id).op else {
        unreachable!("a product step is built for a matmul")
    };
    let operands = graph.inputs(id);
    let (a_dims, b_dims) = (graph.ty(operands[0]).shape.dims(), graph.ty(operands[1]).shape.dims());
    let o_dims = graph.node(id).outputs[0].shape.dims();
    let (ra, rb, ro) = (a_dims.len(), b_dims.len(), o_dims.len());
    let (m, n) = (o_dims[ro - 2], o_dims[ro - 1]);
    let k = if ta { a_dims[ra - 2] } else { a_dims[ra - 1] };
    let (a, b) = (slot_of[&operands[0].node], slot_of[&operands[1].node]);
    // One matrix times every batch of rows (a dense layer on [batch, time, features]): the
    // batches' rows lie one after another in `a` and in `out`, so one product of all of them,
    // large enough to share among threads, where a product per batch might not be.
    if rb == 2 && !ta && a_dims[..ra - 2] == o_dims[..ro - 2] {
        let rows = o_dims[..ro - 1].iter().product();
        let batches = vec![(0, 0)];
        return Step::MatMul { a, b, out, m: rows, n, k, ta, tb, batches, update, bytes, epilogue, b_rewritten: false };
    }
    let batches = batch_offsets(&a_dims[..ra - 2], &b_dims[..rb - 2], &o_dims[..ro - 2], m * k, k * n);
    Step::MatMul { a, b, out, m, n, k, ta, tb, batches, update, bytes, epilogue, b_rewritten: false }
}

/// Marks the products whose `b` is a variable that a step writes (`Step::MatMul::b_rewritten`).
fn mark_rewritten_operands(steps: &mut [Step]) {
    let written: HashSet<Slot> =
        steps.iter().flat_map(|step| step.reads_writes().1).filter(|slot| matches!(slot, Slot::Variable(_))).collect();
    for step in steps {
        if let Step::MatMul { b, b_rewritten, .. } = step {
            *b_rewritten = written.contains(b);
        }
    }
}

/// The node `id` views: itself, or what the reshapes, identities and stop-gradients it is one of read.
fn through_aliases(module: &Module, mut id: NodeId) -> NodeId {
    while matches!(module.graph.node(id).op, Op::Reshape { .. } | Op::Identity | Op::StopGradient) {
        id = module.graph.inputs(id)[0].node;
    }
    id
}

/// A product fused with the kernel that adds a bias to it, then takes the relu (or either alone): one step
/// (`dfc_gemm::Epilogue`).
struct FusedProduct {
    product: NodeId,
    bias: Option<TensorRef>,
    relu: bool,
    /// `select(mask > 0, product, 0)`: a relu's gradient.
    mask: Option<TensorRef>,
}

/// `select(m > 0, p, 0)` of a product p and a stored tensor m (a relu's gradient: m the activation), computed
/// as kernel `kernel` (its non-constant members `computed`): the product, and m.
fn masked_product(module: &Module, kernel: &KernelSite<'_>, computed: &[NodeId]) -> Option<FusedProduct> {
    let graph = &module.graph;
    let root = kernel.root;
    let zero = |t: TensorRef, signed: bool| {
        dfc_passes::fuse::scalar_const(module, t).is_some_and(|c| c.to_bits() == 0 || (signed && c == 0.0))
    };
    let (Op::Select, [cond, p, otherwise]) = (&graph.node(root).op, &graph.inputs(root)[..]) else { return None };
    let (Op::Compare(dfc_ir::CompareOp::Greater), [mask, limit]) =
        (&graph.node(cond.node).op, &graph.inputs(cond.node)[..])
    else {
        return None;
    };
    let stored = kernel.inputs.contains(mask) && kernel.inputs.contains(p);
    let typed = graph.ty(*mask) == graph.ty(*p);
    (computed.len() == 2
        && computed.contains(&cond.node)
        && matches!(graph.node(p.node).op, Op::MatMul { .. })
        && zero(*limit, true)
        && zero(*otherwise, false)
        && stored
        && typed)
        .then_some(FusedProduct { product: p.node, bias: None, relu: false, mask: Some(*mask) })
}

/// The product that kernel `kernel` only adds a bias to, then takes the relu of (or either alone), or masks as a
/// relu's gradient (`masked_product`), when nothing else needs the product and it is wide (`wide_product`): a
/// dense layer's
/// `relu(x·w + b)` in one GEMM, whose tiles are finished while still in cache, where a kernel on one core would
/// read the product (written by both) and write the activations (read by both) again. Thin products keep their
/// dot products and orientations.
fn fused_product(
    module: &Module,
    kernel: &KernelSite<'_>,
    needed: &std::collections::BTreeSet<NodeId>,
    fetched: &HashSet<NodeId>,
) -> Option<FusedProduct> {
    let graph = &module.graph;
    let root = kernel.root;
    let computed = computed_members(module, kernel);
    let is_product = |t: TensorRef| matches!(graph.node(t.node).op, Op::MatMul { .. });
    let is_add = |id: NodeId| matches!(graph.node(id).op, Op::Binary(dfc_ir::BinaryOp::Add));
    let relu = matches!(graph.node(root).op, Op::Unary(dfc_ir::UnaryOp::Relu));
    // The fused product, and the node it feeds: the select, the sum with the bias, or the relu alone.
    let (fused, fed) = match (masked_product(module, kernel, &computed), relu, computed.len()) {
        (Some(fused), _, _) => (fused, root),
        (None, true, 1) => {
            let product = graph.inputs(root)[0];
            (FusedProduct { product: product.node, bias: None, relu, mask: None }, root)
        }
        (None, true, 2) | (None, false, 1) => {
            let sum = if relu { graph.inputs(root)[0].node } else { root };
            if !is_add(sum) || !computed.contains(&sum) {
                return None;
            }
            match graph.inputs(sum)[..] {
                [p, b] | [b, p] if is_product(p) && !is_product(b) => {
                    (FusedProduct { product: p.node, bias: Some(b), relu, mask: None }, sum)
                }
                _ => return None,
            }
        }
        _ => return None,
    };
    let product = fused.product;
    if !matches!(graph.node(product).op, Op::MatMul { .. }) || !wide_product(module, product) {
        return None;
    }
    let out = &graph.node(product).outputs[0];
    let bias_fits = fused.bias.is_none_or(|b| {
        let ty = graph.ty(b);
        ty.dtype == DType::F32 && out.shape.dims().last().is_some_and(|&n| ty.shape.dims() == [n])
    });
    let only_user =
        !fetched.contains(&product) && graph.users(product).into_iter().filter(|u| needed.contains(u)).eq([fed]);
    let same_shape = graph.node(root).outputs[0] == *out;
    (bias_fits && only_user && same_shape).then_some(fused)
}

/// The fused kernel (`fused_product`) whose result kernel `kernel` only sums down its columns, `sum(g, axes = [0])` of
/// an m×n matrix g: a dense layer's bias gradient, whose product (the gradient's, masked by the relu) then sums
/// each part of C as its thread finishes it (`dfc_gemm::Epilogue::col_sums`), and the kernel does not run.
fn column_sums(module: &Module, kernel: &KernelSite<'_>, epilogues: &HashMap<NodeId, FusedProduct>) -> Option<NodeId> {
    let graph = &module.graph;
    let root = kernel.root;
    let (Op::Reduce { kind: dfc_ir::ReduceKind::Sum, axes, keep_dims: false }, [g]) =
        (&graph.node(root).op, &graph.inputs(root)[..])
    else {
        return None;
    };
    let matrix = graph.ty(*g);
    let floats = matrix.dtype == DType::F32 && graph.node(root).outputs[0].dtype == DType::F32;
    let only_sum = computed_members(module, kernel) == [root] && kernel.inputs == [*g];
    (epilogues.contains_key(&g.node)
        && g.port == 0
        && axes[..] == [0]
        && matrix.shape.rank() == 2
        && floats
        && only_sum)
        .then_some(g.node)
}

/// Whether the product `id` (of f32 matrices) is at least 32 wide each way: one that runs by tiles, and that
/// its threads share.
fn wide_product(module: &Module, id: NodeId) -> bool {
    let graph = &module.graph;
    let out = &graph.node(id).outputs[0];
    let dims = out.shape.dims();
    out.dtype == DType::F32
        && dims.len() == 2
        && dims[0] >= 32
        && dims[1] >= 32
        && graph.inputs(id).iter().all(|t| graph.ty(*t).shape.rank() == 2)
}

/// The members of `kernel` that it computes (its constants left out).
fn computed_members(module: &Module, kernel: &KernelSite<'_>) -> Vec<NodeId> {
    kernel.members.iter().copied().filter(|m| !matches!(module.graph.node(*m).op, Op::Const { .. })).collect()
}

/// The kernels that only scale bytes fed in (`cast<f32>(x) * c`, `c * cast<f32>(x)` or `cast<f32>(x) / c`, x a
/// u8 input, c a scalar f32 constant) and whose every use is as the A of an f32 product of two matrices at least
/// 32 rows and columns wide: those products read the bytes where they are fed (`dfc_gemm::sgemm_fused`), and
/// the kernel does not run. A layer fed images as bytes then never stores them as floats, which its two products
/// (forward, and the weights' gradient) would read from the other core's cache; thin products keep their dot
/// products over floats. By kernel root: the input, and the scale.
fn byte_operands(
    module: &Module,
    kernels: &HashMap<NodeId, &KernelSite<'_>>,
    needed: &std::collections::BTreeSet<NodeId>,
    fetched: &HashSet<NodeId>,
) -> HashMap<NodeId, (NodeId, ByteScale)> {
    let graph = &module.graph;
    let scaled_bytes = |kernel: &KernelSite<'_>| -> Option<(NodeId, ByteScale)> {
        let root = kernel.root;
        let [l, r] = graph.inputs(root)[..] else { return None };
        let cast_of_input = |t: TensorRef| match graph.node(t.node).op {
            Op::Cast { to: DType::F32 } if kernel.members.contains(&t.node) => {
                let x = graph.inputs(t.node)[0];
                let input = matches!(graph.node(x.node).op, Op::Input { .. }) && graph.ty(x).dtype == DType::U8;
                input.then_some(x.node)
            }
            _ => None,
        };
        let (x, scale) = match graph.node(root).op {
            Op::Binary(dfc_ir::BinaryOp::Div) => {
                (cast_of_input(l)?, ByteScale::Div(dfc_passes::fuse::scalar_const(module, r)?))
            }
            Op::Binary(dfc_ir::BinaryOp::Mul) => match (cast_of_input(l), cast_of_input(r)) {
                (Some(x), None) => (x, ByteScale::Mul(dfc_passes::fuse::scalar_const(module, r)?)),
                (None, Some(x)) => (x, ByteScale::Mul(dfc_passes::fuse::scalar_const(module, l)?)),
                _ => return None,
            },
            _ => return None,
        };
        let computed = computed_members(module, kernel).len();
        (computed == 2 && graph.node(root).outputs[0].dtype == DType::F32).then_some((x, scale))
    };
    // Whether every use of `id` (through views) is as the A of a wide enough product of matrices.
    fn only_products_read(
        module: &Module,
        id: NodeId,
        needed: &std::collections::BTreeSet<NodeId>,
        fetched: &HashSet<NodeId>,
    ) -> bool {
        let graph = &module.graph;
        !fetched.contains(&id)
            && graph.users(id).into_iter().filter(|u| needed.contains(u)).all(|user| match graph.node(user).op {
                Op::Reshape { .. } | Op::Identity | Op::StopGradient => {
                    only_products_read(module, user, needed, fetched)
                }
                Op::MatMul { .. } => {
                    let operands = graph.inputs(user);
                    operands[0].node == id && operands[1].node != id && wide_product(module, user)
                }
                _ => false,
            })
    }
    kernels
        .values()
        .filter(|kernel| needed.contains(&kernel.root))
        .filter_map(|kernel| scaled_bytes(kernel).map(|found| (kernel.root, found)))
        .filter(|&(root, _)| only_products_read(module, root, needed, fetched))
        .collect()
}

/// A forward convolution that one max pooling reads, computed with it (`Step::Conv::pool`).
struct PooledConvolution {
    conv: NodeId,
    geometry: Conv2dGeometry,
    pool: PoolGeometry,
}

/// The max poolings of f32 convolutions that nothing else reads, nor fetches, which `dfc_kernels::conv2d_max_pool`
/// computes in one pass (a thin window: a first layer on one channel; or Winograd tiles holding whole windows), by
/// pooling node: at inference the CNN's layers then never store their convolutions (5.5 and 2 MB at batch 64),
/// which the poolings would read back. In training the pooling's gradient reads the convolution too, so it is
/// stored.
fn pooled_convolutions(
    module: &Module,
    order: &[NodeId],
    needed: &std::collections::BTreeSet<NodeId>,
    fetched: &HashSet<NodeId>,
) -> HashMap<NodeId, PooledConvolution> {
    let graph = &module.graph;
    let f32s = |ts: &[TensorRef]| ts.iter().all(|t| graph.ty(*t).dtype == DType::F32);
    order
        .iter()
        .filter_map(|&id| {
            let Op::MaxPool { window, strides, padding } = &graph.node(id).op else { return None };
            let conv = graph.inputs(id).first()?.node;
            let Op::Conv2d { strides: conv_strides, padding: conv_padding } = &graph.node(conv).op else {
                return None;
            };
            let operands = graph.inputs(conv);
            let (x, f) = (graph.ty(*operands.first()?), graph.ty(*operands.get(1)?));
            let out = &graph.node(conv).outputs[0];
            let typed = f32s(&operands) && out.dtype == DType::F32 && graph.node(id).outputs[0].dtype == DType::F32;
            let ranks = [x.shape.rank(), f.shape.rank(), out.shape.rank()] == [4, 4, 4];
            let only_user =
                !fetched.contains(&conv) && graph.users(conv).into_iter().filter(|u| needed.contains(u)).eq([id]);
            if !(typed && ranks && only_user) {
                return None;
            }
            let geometry = Conv2dGeometry::from_dims(x.shape.dims(), f.shape.dims(), *conv_strides, *conv_padding);
            let pool = PoolGeometry::from_dims(out.shape.dims(), *window, *strides, *padding);
            dfc_kernels::conv2d_max_pool_applies(&geometry, &pool, filter_kept(module, operands[1].node, needed))
                .then_some((id, PooledConvolution { conv, geometry, pool }))
        })
        .collect()
}

/// Whether the filter `filter` of a forward convolution is a variable, read as it is, that no node `needed` writes (an
/// inference's weight): what `kept::plan` keeps transformed between runs (`dfc_kernels::KeptFilter`). A guess where
/// the slots are not yet known, which costs time where wrong, never results: `conv2d_max_pool` pools any batch.
fn filter_kept(module: &Module, filter: NodeId, needed: &std::collections::BTreeSet<NodeId>) -> bool {
    let graph = &module.graph;
    let mut id = through_aliases(module, filter);
    if matches!(graph.node(id).op, Op::Read) {
        id = through_aliases(module, graph.inputs(id)[0].node);
    }
    let assigns = |n: &NodeId| {
        matches!(graph.node(*n).op, Op::Assign | Op::AssignAdd | Op::AssignSub) && graph.inputs(*n)[0].node == id
    };
    matches!(graph.node(id).op, Op::Variable { .. }) && !needed.iter().any(assigns)
}

/// What kernel `kernel` does to a pooling computed with its convolution (`Step::Conv::pool`), when that is all it
/// does: `relu(pool + b)` (a convolutional layer pooled before its bias and activation, `pool_early`), `pool + b`
/// or `relu(pool)`, b one f32 per filter.
struct PooledEpilogue {
    pool: NodeId,
    bias: Option<TensorRef>,
    relu: bool,
}

/// The pooled convolution (in `pooled`, by pooling node) whose pooling kernel `kernel` only finishes, when nothing
/// else needs nor fetches the pooling: the pooled pixels then get their bias and relu while still in registers
/// (`dfc_kernels::PoolEpilogue`), and the pooling is never stored and read back (at inference the CNN's first
/// layer, 1.4 MB at batch 64).
fn pooled_epilogue(
    module: &Module,
    kernel: &KernelSite<'_>,
    pooled: &HashMap<NodeId, PooledConvolution>,
    needed: &std::collections::BTreeSet<NodeId>,
    fetched: &HashSet<NodeId>,
) -> Option<PooledEpilogue> {
    let graph = &module.graph;
    let root = kernel.root;
    let computed = computed_members(module, kernel);
    let relu = matches!(graph.node(root).op, Op::Unary(dfc_ir::UnaryOp::Relu));
    let is_pooling = |t: TensorRef| pooled.contains_key(&t.node);
    // The pooling, the bias, and the node that reads the pooling.
    let (pool, bias, reader) = match (relu, computed.len()) {
        (true, 1) => (graph.inputs(root)[0], None, root),
        (true, 2) | (false, 1) => {
            let sum = if relu { graph.inputs(root)[0].node } else { root };
            if !matches!(graph.node(sum).op, Op::Binary(dfc_ir::BinaryOp::Add)) || !computed.contains(&sum) {
                return None;
            }
            match graph.inputs(sum)[..] {
                [p, b] | [b, p] if is_pooling(p) && !is_pooling(b) => (p, Some(b), sum),
                _ => return None,
            }
        }
        _ => return None,
    };
    let filters = pooled.get(&pool.node)?.geometry.filters;
    let bias_fits = bias.is_none_or(|b| {
        let ty = graph.ty(b);
        ty.dtype == DType::F32 && ty.shape.dims() == [filters] && kernel.inputs.contains(&b)
    });
    let same_type = graph.node(root).outputs.first() == Some(graph.ty(pool));
    let only_reader =
        !fetched.contains(&pool.node) && graph.users(pool.node).into_iter().filter(|u| needed.contains(u)).eq([reader]);
    (is_pooling(pool) && kernel.inputs.contains(&pool) && bias_fits && same_type && only_reader)
        .then_some(PooledEpilogue { pool: pool.node, bias, relu })
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
