//! The cost model: FLOPs and bytes of every op, device compute rates and link bandwidths, and a
//! simulation of one step of a partitioned graph that predicts its time, per-device load and
//! critical path. Placement (`model` strategy) and `dfc compile --report` both use it.
//!
//! The simulation (`estimate`) is a list schedule, the way a dataflow executor runs a graph:
//!
//! - Every device runs its partition's compute nodes one at a time. A node is ready when all its
//!   inputs, data and control, are done; when the device is free it starts the ready node that
//!   comes first in the partition's topological order (`Graph::topo_order`). A node takes
//!   `node_flops / flops_per_second`.
//! - Communication does not occupy a device (it is the transport's work, as TensorFlow's Send,
//!   Recv and collectives are asynchronous kernels): a `Send` is done as soon as its operand is;
//!   its `Recv` (same key) is done `transfer_seconds` later. An `AllReduce` is done on every
//!   member when the last member's program has started it plus the time of a ring all-reduce,
//!   `2(n−1)/n · bytes / bandwidth`, plus `2(n−1)` latencies when the members span tasks (its
//!   additions overlap the transfers; it takes at least their compute time). A partition's
//!   program starts its all-reduces one at a time, in the order their operands are done. In
//!   place (`Topology::overlap` off, as the runtime runs them without `--overlap`) it starts
//!   one only when it has no compute node ready or running, and runs nothing else until it is
//!   done; overlapped, every one but the last starts as soon as its operand is done.
//! - The critical path is found by walking back from the node that finishes last through
//!   whatever decided each node's start: the input that arrived last or, where the node waited
//!   for its device, the node the device ran before it.
//!
//! Nothing here panics on a malformed plan: a `Recv` without its `Send` counts as arriving at
//! the start, an all-reduce with missing members reduces over those present, and nodes behind a
//! cycle are never started (they count in the load, not in the times).

use crate::profile::{ConvForm, Profile, Rates};
use dfc_ir::{BinaryOp, Cluster, DeviceSpec, Graph, Module, NodeId, Op, TensorRef, TensorType, UnaryOp};
use serde::{Deserialize, Serialize};
use std::cmp::{Ordering, Reverse};
use std::collections::{BinaryHeap, HashMap, HashSet, VecDeque};
use std::fmt;
use std::sync::Arc;

/// The rates the model assumes; every one can be overridden on the command line.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CostModel {
    /// Floating-point operations per second of one device.
    pub flops_per_second: f64,
    /// Bandwidth between two devices of one task (same process), bytes per second.
    pub local_bytes_per_second: f64,
    /// Bandwidth between tasks (the network), bytes per second.
    pub remote_bytes_per_second: f64,
    /// Fixed cost of one transfer between tasks, in seconds.
    pub remote_latency_seconds: f64,
    /// What the profile the prediction used says of itself (`Profile::describe`), when it
    /// used one: then the rates above are not what it assumed.
    pub calibration: Option<String>,
    /// The machine's measured costs (`dfc calibrate`), which replace the rates above where
    /// given: node times from the measured products and kernels, transfers from the measured
    /// links, and the devices of one host sharing its cores. Not part of a plan.
    #[serde(skip)]
    pub profile: Option<Arc<Profile>>,
    /// The profiles of particular tasks' hosts (a cluster file's `"profile"`s), which replace
    /// `profile` for those tasks' devices: their nodes' times, their host's cores and the
    /// shared memory between its tasks. `profile` stays the driver's host and the network's.
    /// Not part of a plan.
    #[serde(skip)]
    pub task_profiles: Vec<TaskProfile>,
}

/// A task's own machine profile.
#[derive(Clone, Debug, PartialEq)]
pub struct TaskProfile {
    pub job: String,
    pub task: u32,
    pub profile: Arc<Profile>,
}

impl CostModel {
    /// The model that predicts from `profile`; its FLOP rate (what placement balances by) is
    /// the profile's rate on a square product of 256.
    pub fn calibrated(profile: Profile) -> CostModel {
        let full = profile.full();
        let square = full.gemm_seconds(256, 256, 256, false, false, 1);
        CostModel {
            flops_per_second: 2.0 * 256f64.powi(3) / square,
            local_bytes_per_second: 1e6 / full.run.copy.seconds(1e6),
            remote_bytes_per_second: profile.tcp.bytes_per_second,
            remote_latency_seconds: profile.tcp.latency_seconds,
            calibration: Some(profile.describe()),
            profile: Some(Arc::new(profile)),
            task_profiles: Vec::new(),
        }
    }

    /// The model with `profiles` for their tasks; where it has no profile of its own, the
    /// first of them stands for the driver's host and the network.
    pub fn with_task_profiles(self, profiles: Vec<TaskProfile>) -> CostModel {
        let Some(first) = profiles.first() else { return self };
        let mut model = match self.profile {
            Some(_) => self,
            None => CostModel::calibrated((*first.profile).clone()),
        };
        let tasks: Vec<String> = profiles.iter().map(|t| format!("/job:{}/task:{}", t.job, t.task)).collect();
        let described = model.calibration.take().unwrap_or_default();
        model.calibration = Some(format!("{described}; {} from profiles of their own", tasks.join(", ")));
        model.task_profiles = profiles;
        model
    }

    /// The profile that prices `device`'s work: its task's own, else the model's.
    pub fn profile_of(&self, device: Option<&DeviceSpec>) -> Option<&Arc<Profile>> {
        let own = device.and_then(|d| {
            let (job, task) = (d.job.as_deref()?, d.task?);
            self.task_profiles.iter().find(|t| t.job == job && t.task == task)
        });
        own.map(|t| &t.profile).or(self.profile.as_ref())
    }
}

/// Rates of a commodity CPU cluster, the machines dfc's runtime targets:
///
/// - 50 GFLOP/s per device: a few cores with AVX2 FMA peak at 30–100 GFLOP/s each in f32;
///   real kernels (matmul well, elementwise ops far less) reach a fraction of that, so a
///   device (one task's CPU thread pool) sustains tens of GFLOP/s.
/// - 10 GB/s within a task: a copy between devices of one process is a large `memcpy`, bound
///   by memory bandwidth (reading and writing); one thread copies at about 10 GB/s.
/// - 1.25 GB/s between tasks: 10 Gigabit Ethernet, the usual link between servers.
/// - 50 µs per transfer between tasks: one gRPC message over a data-centre network (kernel,
///   serialisation and switch latency), the order TensorFlow's distributed runtime sees.
impl Default for CostModel {
    fn default() -> CostModel {
        CostModel {
            flops_per_second: 50e9,
            local_bytes_per_second: 10e9,
            remote_bytes_per_second: 1.25e9,
            remote_latency_seconds: 50e-6,
            calibration: None,
            profile: None,
            task_profiles: Vec::new(),
        }
    }
}

/// The cost model's view of one training step (see `docs/architecture.md`, "cost model").
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CostReport {
    pub devices: Vec<DeviceCost>,
    /// Predicted time of one step, in seconds.
    pub step_seconds: f64,
    /// The chain of nodes that decides the step time, first to last, as `device: node`; a run
    /// of nodes on one device is one entry, `device: first … last (N ops)`.
    pub critical_path: Vec<String>,
    /// The rates the prediction assumed.
    pub model: Option<CostModel>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DeviceCost {
    pub device: String,
    pub variable_bytes: u64,
    /// Floating-point operations of one step, all-reduce additions included.
    pub flops: f64,
    /// Bytes this device's Sends hand over, plus its share of all-reduce traffic.
    pub bytes_sent: u64,
    /// Bytes its Recvs take in, plus its share of all-reduce traffic.
    pub bytes_received: u64,
    /// Busy time on this device in one step, in seconds (compute only: the nodes that occupy
    /// the device, i.e. all but Send, Recv and AllReduce).
    pub compute_seconds: f64,
    /// When this device finishes its part of the step, in seconds from the step's start.
    pub finish_seconds: f64,
    /// `compute_seconds` by the kind of work, as the timeline names it (`matmul`, `kernel`,
    /// `conv`, `pool`, `norm`, `layout`), and the time of its exchanges (`all_reduce`: each
    /// all-reduce's ring; `recv`: each receive's transfer), the largest first.
    pub by_kind: Vec<(String, f64)>,
}

/// FLOPs of a transcendental function (exp, log, sqrt, rsqrt, sigmoid, tanh, pow) per element:
/// a few multiply-adds of a polynomial approximation.
const TRANSCENDENTAL_FLOPS: f64 = 4.0;

/// FLOPs per element of softmax, log-softmax and the cross entropies: max, subtract, exp,
/// sum and divide (or log).
const SOFTMAX_FLOPS: f64 = 5.0;

/// The floating-point operations node `id` performs in one step, from its op and its operand
/// and output types. Ops that only move data (reshape, gather, concat, ...) cost 0: their time
/// is negligible beside arithmetic in this model.
pub fn node_flops(graph: &Graph, id: NodeId) -> f64 {
    let node = graph.node(id);
    let inputs = graph.inputs(id);
    let operand = |i: usize| -> Option<&TensorType> {
        let tensor = inputs.get(i)?;
        graph.node(tensor.node).outputs.get(tensor.port as usize)
    };
    let operand_elements = |i: usize| operand(i).map_or(0.0, elements);
    let output_elements = node.outputs.first().map_or(0.0, elements);
    // Kh · Kw · Cin of an HWIO filter: the multiply-adds per output element of a convolution.
    let taps = |dims: &[usize]| -> f64 {
        if dims.len() == 4 {
            dims[..3].iter().map(|&d| d as f64).product()
        } else {
            0.0
        }
    };
    let window_size = |window: &[usize; 2]| window[0] as f64 * window[1] as f64;
    match &node.op {
        // Sources, state and plain copies.
        Op::Input { .. }
        | Op::Const { .. }
        | Op::Variable { .. }
        | Op::Read
        | Op::Assign
        | Op::Identity
        | Op::StopGradient
        | Op::CrossReplicaMean => 0.0,
        Op::AssignAdd | Op::AssignSub => output_elements,
        Op::Unary(unary) => {
            let per_element = match unary {
                UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Relu => 1.0,
                UnaryOp::Exp | UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt | UnaryOp::Sigmoid | UnaryOp::Tanh => {
                    TRANSCENDENTAL_FLOPS
                }
            };
            per_element * output_elements
        }
        Op::Binary(binary) => {
            let per_element = match binary {
                BinaryOp::Add
                | BinaryOp::Sub
                | BinaryOp::Mul
                | BinaryOp::Div
                | BinaryOp::Maximum
                | BinaryOp::Minimum => 1.0,
                // exp(y · log x).
                BinaryOp::Pow => TRANSCENDENTAL_FLOPS,
            };
            per_element * output_elements
        }
        Op::Compare(_) | Op::Select | Op::Cast { .. } => output_elements,
        Op::MatMul { transpose_a, .. } => {
            // The output holds batch · M · N elements, each a dot product of length K.
            let k = operand(0)
                .and_then(|a| {
                    let dims = a.shape.dims();
                    let axis = if *transpose_a { dims.len().checked_sub(2) } else { dims.len().checked_sub(1) };
                    axis.map(|axis| dims[axis] as f64)
                })
                .unwrap_or(0.0);
            2.0 * output_elements * k
        }
        // Data movement only.
        Op::Reshape { .. }
        | Op::Transpose { .. }
        | Op::Concat { .. }
        | Op::Slice { .. }
        | Op::OneHot { .. }
        | Op::Gather
        | Op::BroadcastTo { .. }
        | Op::Pad { .. } => 0.0,
        // A scalar a step.
        Op::LearningRate { .. } | Op::TrainingFlag => 1.0,
        // Philox-4x32-10: ten rounds of two multiplications and some xors per four elements.
        Op::RandomUniform { shape, .. } => 10.0 * shape.n_elements() as f64,
        // Two words an element, then a logarithm, a square root and a cosine.
        Op::RandomNormal { shape, .. } => (20.0 + 3.0 * TRANSCENDENTAL_FLOPS) * shape.n_elements() as f64,
        Op::Reduce { .. } | Op::ArgMax { .. } => operand_elements(0),
        Op::Softmax { .. } | Op::LogSoftmax { .. } | Op::SoftmaxCrossEntropy | Op::SigmoidCrossEntropy => {
            SOFTMAX_FLOPS * operand_elements(0)
        }
        // Two passes for the statistics and one to write; the gradient has two more sums.
        Op::LayerNorm { .. } => 5.0 * operand_elements(0),
        Op::LayerNormGrad { .. } => 10.0 * operand_elements(0),
        Op::Moments => 4.0 * operand_elements(0),
        Op::BatchNorm { .. } => 2.0 * operand_elements(0),
        Op::BatchNormGradMeans { .. } => 5.0 * operand_elements(0),
        Op::BatchNormGrad { .. } => 5.0 * operand_elements(0),
        // 2 · N·Ho·Wo·Cout · Kh·Kw·Cin, and the same for both gradients.
        Op::Conv2d { .. } => 2.0 * output_elements * operand(1).map_or(0.0, |f| taps(f.shape.dims())),
        Op::Conv2dBackpropInput { .. } => 2.0 * operand_elements(1) * operand(0).map_or(0.0, |f| taps(f.shape.dims())),
        Op::Conv2dBackpropFilter { filter_shape, .. } => 2.0 * operand_elements(1) * taps(filter_shape.dims()),
        Op::MaxPool { window, .. } | Op::AvgPool { window, .. } => window_size(window) * output_elements,
        // Per pooled element, its window: (input, grad_out) and (grad_out).
        Op::MaxPoolGrad { window, .. } => window_size(window) * operand_elements(1),
        Op::AvgPoolGrad { window, .. } => window_size(window) * operand_elements(0),
        // One addition per update element.
        Op::ScatterAdd { .. } => operand_elements(1),
        Op::Send { .. } | Op::Recv { .. } => 0.0,
        // The additions of the reduction.
        Op::AllReduce { .. } => operand_elements(0),
    }
}

/// The time of every node of `module` at a profile's `rates`, by node index: a fused loop
/// kernel's fixed cost and bytes at its root (its other members are inside it), products and
/// convolutions from the measured table, other ops that compute as a kernel over the bytes
/// they touch, and nothing for sources, state and transfers.
pub fn profiled_seconds(module: &Module, profile: Rates<'_>) -> Vec<f64> {
    let graph = &module.graph;
    let slots = graph.node_ids().map(|id| id.index() + 1).max().unwrap_or(0);
    let mut times = vec![0.0; slots];
    let kept: Vec<NodeId> = module
        .outputs
        .iter()
        .chain(&module.metrics)
        .map(|o| o.tensor.node)
        .chain(module.training.as_ref().map(|t| t.loss.node))
        .collect();
    let fusion = crate::fuse::fuse(module, &kept);
    let mut fused = vec![false; slots];
    let type_of = |t: &TensorRef| graph.node(t.node).outputs.get(t.port as usize).map_or(0, tensor_bytes);
    let only_user = |id: NodeId, user: NodeId| !kept.contains(&id) && graph.users(id).into_iter().eq([user]);
    for kernel in &fusion.kernels {
        for member in &kernel.members {
            fused[member.index()] = true;
        }
        if crate::fuse::folded_update(module, kernel.root, &kernel.members, only_user).is_some() {
            // Inside its product: the GEMM adds into the variable.
            continue;
        }
        let read: u64 = kernel.inputs.iter().map(type_of).sum();
        let written: u64 = graph.node(kernel.root).outputs.iter().map(tensor_bytes).sum();
        let transcendentals: f64 = kernel.members.iter().map(|&m| transcendental_elements(graph, m)).sum();
        let rows: f64 = kernel.members.iter().map(|&m| row_seconds(graph, m, profile)).sum();
        let assigns = matches!(graph.node(kernel.root).op, Op::Assign | Op::AssignAdd | Op::AssignSub);
        let state = kernel.inputs.iter().filter(|t| is_state(graph, **t)).map(type_of).sum::<u64>()
            + if assigns { written } else { 0 };
        times[kernel.root.index()] = kernel_seconds(&profile.run.kernel, read + written, state)
            + transcendentals * profile.run.transcendental_seconds
            + rows;
    }
    for id in graph.node_ids() {
        if !fused[id.index()] {
            times[id.index()] = unfused_seconds(graph, id, profile);
        }
    }
    times
}

/// Whether `t` is a variable's value (or the variable an assignment writes): state that a step
/// touches once, its last touch a step's worth of other values ago.
fn is_state(graph: &Graph, t: TensorRef) -> bool {
    let mut id = t.node;
    loop {
        match graph.node(id).op {
            Op::Variable { .. } => return true,
            Op::Read | Op::Identity | Op::StopGradient | Op::Reshape { .. } => id = graph.inputs(id)[0].node,
            _ => return false,
        }
    }
}

/// A kernel's time over `bytes`, `state` of them read or written outside the caches: those at
/// the rate of the largest kernel calibrated (tens of MB, beyond any cache), where that is
/// slower. A step's state (weights, an optimizer's slots) is touched by its update long after
/// the forward pass read it, and by then a step's other values (and a shared host's other
/// tenants) have pushed it out of the caches that the kernel's calibration runs in.
fn kernel_seconds(curve: &crate::profile::Curve, bytes: u64, state: u64) -> f64 {
    let seconds = curve.seconds(bytes as f64);
    let Some(&[largest, largest_seconds]) = curve.points.last() else { return seconds };
    if state == 0 || bytes == 0 || largest <= 0.0 {
        return seconds;
    }
    // A small kernel's fixed cost already exceeds what its bytes would take from memory.
    let in_cache = seconds / bytes as f64;
    seconds + state as f64 * (largest_seconds / largest - in_cache).max(0.0)
}

/// The elements on which node `id` computes a transcendental function (an exponential, a
/// logarithm, a root, a hyperbolic function).
fn transcendental_elements(graph: &Graph, id: NodeId) -> f64 {
    let node = graph.node(id);
    let output = || node.outputs.first().map_or(0.0, elements);
    let operand =
        || graph.inputs(id).first().and_then(|t| graph.node(t.node).outputs.get(t.port as usize)).map_or(0.0, elements);
    match &node.op {
        Op::Unary(UnaryOp::Exp | UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt | UnaryOp::Sigmoid | UnaryOp::Tanh)
        | Op::Binary(BinaryOp::Pow) => output(),
        Op::SigmoidCrossEntropy => operand(),
        _ => 0.0,
    }
}

/// What node `id` spends folding its operand row by row, where it is a row op, at a
/// profile's `rates` (the calibrated costs per element include a softmax's exponentials).
fn row_seconds(graph: &Graph, id: NodeId, rates: Rates<'_>) -> f64 {
    let operand = graph.inputs(id).first().and_then(|t| graph.node(t.node).outputs.get(t.port as usize));
    let Some(operand) = operand else { return 0.0 };
    let (count, length) = (elements(operand), operand.shape.dims().last().map_or(1.0, |&d| d as f64));
    let run = rates.run;
    match &graph.node(id).op {
        Op::Softmax { .. } | Op::LogSoftmax { .. } | Op::SoftmaxCrossEntropy => run.exp_row.seconds(count, length),
        Op::LayerNorm { .. } | Op::ArgMax { .. } => run.row.seconds(count, length),
        // Two passes over the row for its sums, one to write.
        Op::LayerNormGrad { .. } => 2.0 * run.row.seconds(count, length),
        _ => 0.0,
    }
}

/// What the runtime's timeline calls the work of node `id` (`kernel`, `matmul`, `conv`, ...),
/// where it computes on its own; `kernel` for a fused kernel's root.
pub fn work_kind(graph: &Graph, id: NodeId) -> &'static str {
    match &graph.node(id).op {
        Op::MatMul { .. } => "matmul",
        Op::Conv2d { .. } | Op::Conv2dBackpropInput { .. } | Op::Conv2dBackpropFilter { .. } => "conv",
        Op::MaxPool { .. } | Op::AvgPool { .. } | Op::MaxPoolGrad { .. } | Op::AvgPoolGrad { .. } => "pool",
        Op::Moments | Op::BatchNorm { .. } | Op::BatchNormGradMeans { .. } | Op::BatchNormGrad { .. } => "norm",
        Op::Transpose { .. }
        | Op::Concat { .. }
        | Op::Slice { .. }
        | Op::Pad { .. }
        | Op::Gather
        | Op::ScatterAdd { .. }
        | Op::BroadcastTo { .. }
        | Op::OneHot { .. } => "layout",
        _ => "kernel",
    }
}

/// A node outside the fused kernels at a profile's rates.
fn unfused_seconds(graph: &Graph, id: NodeId, profile: Rates<'_>) -> f64 {
    let node = graph.node(id);
    let inputs = graph.inputs(id);
    let dims_of = |i: usize| -> &[usize] {
        inputs.get(i).and_then(|t| graph.node(t.node).outputs.get(t.port as usize)).map_or(&[], |ty| ty.shape.dims())
    };
    let product = |dims: &[usize]| dims.iter().product::<usize>();
    match &node.op {
        Op::Input { .. }
        | Op::Const { .. }
        | Op::Variable { .. }
        | Op::Read
        | Op::Identity
        | Op::StopGradient
        | Op::CrossReplicaMean
        | Op::Reshape { .. }
        | Op::Send { .. }
        | Op::Recv { .. }
        | Op::AllReduce { .. } => 0.0,
        Op::MatMul { transpose_a, transpose_b } => {
            let (a, b) = (dims_of(0), dims_of(1));
            let (Some(out), true) = (node.outputs.first(), a.len() >= 2 && b.len() >= 2) else { return 0.0 };
            let out = out.shape.dims();
            let (n, k) = (out[out.len() - 1], if *transpose_a { a[a.len() - 2] } else { a[a.len() - 1] });
            if b.len() == 2 && !*transpose_a {
                // Batches of rows times one matrix: one product of all the rows.
                profile.gemm_seconds(product(&out[..out.len() - 1]), n, k, false, *transpose_b, 1)
            } else {
                let m = out[out.len() - 2];
                profile.gemm_seconds(m, n, k, *transpose_a, *transpose_b, product(&out[..out.len() - 2]))
            }
        }
        Op::Conv2d { .. } => {
            let (out, filter) = (node.outputs.first().map_or(&[][..], |t| t.shape.dims()), dims_of(1));
            conv(profile, ConvForm::Forward, out, filter)
        }
        Op::Conv2dBackpropInput { .. } => conv(profile, ConvForm::BackpropInput, dims_of(1), dims_of(0)),
        Op::Conv2dBackpropFilter { filter_shape, .. } => {
            conv(profile, ConvForm::BackpropFilter, dims_of(1), filter_shape.dims())
        }
        _ => {
            // A kernel of its own over what it reads and writes; a pooling, its measured op's
            // time over as many bytes; data movement, a copy.
            let read: u64 =
                inputs.iter().filter_map(|t| graph.node(t.node).outputs.get(t.port as usize)).map(tensor_bytes).sum();
            let written: u64 = node.outputs.iter().map(tensor_bytes).sum();
            let touched = (read + written) as f64;
            let pool = &profile.run.pool;
            match &node.op {
                Op::MaxPool { .. } => return pool.max.seconds(touched),
                Op::MaxPoolGrad { .. } => return pool.max_grad.seconds(touched),
                Op::AvgPool { .. } => return pool.avg.seconds(touched),
                Op::AvgPoolGrad { .. } => return pool.avg_grad.seconds(touched),
                _ => {}
            }
            if work_kind(graph, id) == "layout" {
                return profile.run.copy.seconds(touched);
            }
            profile.run.kernel.seconds(touched)
                + transcendental_elements(graph, id) * profile.run.transcendental_seconds
                + row_seconds(graph, id, profile)
        }
    }
}

/// A convolution of output (or output gradient) `out` (NHWC) and filter `filter` (HWIO) as its
/// im2col product.
fn conv(profile: Rates<'_>, form: ConvForm, out: &[usize], filter: &[usize]) -> f64 {
    if out.len() != 4 || filter.len() != 4 {
        return 0.0;
    }
    let pixels = out[0] * out[1] * out[2];
    profile.conv_seconds(form, pixels, filter[3], filter[0] * filter[1] * filter[2])
}

fn elements(ty: &TensorType) -> f64 {
    ty.shape.dims().iter().map(|&d| d as f64).product()
}

/// Bytes of a tensor's buffer, saturating at `u64::MAX` for absurd shapes.
pub fn tensor_bytes(ty: &TensorType) -> u64 {
    ty.shape.dims().iter().fold(ty.dtype.size_in_bytes() as u64, |acc, &d| acc.saturating_mul(d as u64))
}

/// Whether two devices are in the same task (job and task equal): they share a process.
/// Whether two devices are of one task (transfers between them are local).
pub fn same_task(a: &DeviceSpec, b: &DeviceSpec) -> bool {
    a.job == b.job && a.task == b.task
}

/// Time to move `bytes` from device `from` to device `to`: nothing on one device, the local
/// bandwidth within a task, the remote bandwidth plus the latency between tasks.
pub fn transfer_seconds(bytes: u64, from: &DeviceSpec, to: &DeviceSpec, model: &CostModel) -> f64 {
    if from == to {
        0.0
    } else if same_task(from, to) {
        seconds(bytes as f64, model.local_bytes_per_second)
    } else {
        seconds(bytes as f64, model.remote_bytes_per_second) + model.remote_latency_seconds.max(0.0)
    }
}

/// `amount / rate`, without NaN: nothing takes no time, and a rate that is not positive takes
/// forever.
fn seconds(amount: f64, rate: f64) -> f64 {
    if amount.is_nan() || amount <= 0.0 {
        0.0
    } else if rate > 0.0 {
        amount / rate
    } else {
        f64::INFINITY
    }
}

/// `2(n−1)/n · bytes`: what each member of a ring all-reduce of `n` sends (and receives).
fn ring_bytes(bytes: u64, n: u32) -> u64 {
    if n <= 1 {
        return 0;
    }
    let n = n as u128;
    u64::try_from(2 * (n - 1) * bytes as u128 / n).unwrap_or(u64::MAX)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// Occupies its device while it runs.
    Compute,
    Send,
    Recv,
    AllReduce,
}

/// One node of the simulation.
#[derive(Clone, Copy)]
struct SimNode {
    partition: u32,
    /// What runs it, one node at a time: its device, or with a profile, its process.
    executor: u32,
    id: NodeId,
    /// Position in its partition's topological order: the device runs the first ready one.
    priority: u32,
    kind: Kind,
    /// Compute time; for an all-reduce, the time of its additions.
    seconds: f64,
}

struct Group {
    members: Vec<u32>,
    /// The largest `group_size` its members claim.
    size: u32,
    bytes: u64,
    /// Members whose programs have started it.
    arrived: usize,
    latest: f64,
    latest_member: u32,
}

/// A time in the event queue, ordered totally (times are never NaN here).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Time(f64);

impl Eq for Time {}

impl PartialOrd for Time {
    fn partial_cmp(&self, other: &Time) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Time {
    fn cmp(&self, other: &Time) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// Event classes at one instant: every finish (and what it makes ready) first, then devices
/// pick their next node, so that a device chooses among everything ready at that instant.
const FINISH: u8 = 0;
const DISPATCH: u8 = 1;

const NONE: u32 = u32::MAX;

/// Simulates one step of `partitions` (one module per device, joined by Send/Recv pairs and
/// all-reduces) under `model`: per-device load and finish time, the step time and the critical
/// path. Linear in the graph size apart from the event queue's logarithm.
pub fn estimate(partitions: &[&Module], model: &CostModel) -> CostReport {
    estimate_on(partitions, model, &Topology::of_tasks(partitions))
}

/// Where the partitions of a step run: each one's process and host, numbered from 0, and the
/// threads each process computes on. Partitions of one process share its memory (a transfer
/// is a copy) and its threads (with a profile, one runs at a time); processes of one host
/// share its cores (with a profile, each runs at the rates measured on its threads, slowed
/// where the host's processes ask for more threads than it has) and talk through shared
/// memory; hosts talk through TCP.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Topology {
    pub process: Vec<u32>,
    pub host: Vec<u32>,
    /// By process: the threads it computes on, 0 for all of its host's.
    pub threads: Vec<u32>,
    /// Whether the processes are workers that a driver calls for every step, sending their
    /// feeds (with a profile, each step of each then costs the profile's `driven_step` for so
    /// many workers).
    pub driven: bool,
    /// Whether the programs start their all-reduces as soon as their operands are computed
    /// and go on computing (`--overlap`), all but the last, rather than run each in place,
    /// waiting for it.
    pub overlap: bool,
}

impl Topology {
    /// A process per task (job and task index), each on a host of its own, on all its cores.
    pub fn of_tasks(partitions: &[&Module]) -> Topology {
        Topology::of_tasks_on(partitions, |_| None)
    }

    /// A process per task of `cluster` on all its host's cores, tasks on the hosts their
    /// addresses name (loopback's names as one; a cluster without addresses, this machine's
    /// devices, on one), driven by a driver where the tasks have addresses (workers).
    pub fn of_cluster(partitions: &[&Module], cluster: &Cluster) -> Topology {
        let mut topology = Topology::of_tasks_on(partitions, |device| host_of(cluster, device));
        topology.driven = cluster.jobs.iter().flat_map(|j| &j.tasks).any(|t| t.address.is_some());
        topology
    }

    /// Worker processes of this host, as `dfc run --spawn` starts them: partition `p` on
    /// worker `partition_worker[p]`, each of the `workers` computing on its share of `cores`
    /// (at least one thread), called by the driver every step.
    pub fn spawned(partition_worker: &[usize], workers: usize, cores: usize) -> Topology {
        let workers = workers.max(1);
        Topology {
            process: partition_worker.iter().map(|&w| w as u32).collect(),
            host: vec![0; partition_worker.len()],
            threads: vec![(cores / workers).max(1) as u32; workers],
            driven: true,
            overlap: false,
        }
    }

    /// A process per task on all its host's cores; tasks for which `host_of` names the same
    /// host share it, and any other task is on a host of its own.
    fn of_tasks_on(partitions: &[&Module], host_of: impl Fn(&DeviceSpec) -> Option<String>) -> Topology {
        let mut tasks: Vec<(Option<String>, Option<u32>)> = Vec::new();
        // Each task's host, and the hosts' names (`None`: a host of its own).
        let mut task_host: Vec<u32> = Vec::new();
        let mut hosts: Vec<Option<String>> = Vec::new();
        let mut process = Vec::with_capacity(partitions.len());
        for module in partitions {
            let device = device_of(module);
            let task = device.map_or((None, None), |d| (d.job.clone(), d.task));
            let index = tasks.iter().position(|t| *t == task).unwrap_or_else(|| {
                // A task's partitions are all on its first partition's host.
                let name = device.and_then(&host_of);
                let known = name.as_ref().and_then(|_| hosts.iter().position(|h| *h == name));
                task_host.push(known.unwrap_or_else(|| {
                    hosts.push(name);
                    hosts.len() - 1
                }) as u32);
                tasks.push(task);
                tasks.len() - 1
            });
            process.push(index as u32);
        }
        let host = process.iter().map(|&p| task_host[p as usize]).collect();
        Topology { process, host, threads: vec![0; tasks.len()], driven: false, overlap: false }
    }

    /// With profiles (`cores_of` a partition's host's threads, as its profile measured): the
    /// threads each partition's process computes on, and how much slower than on those threads
    /// alone (the host's processes asking for more threads than it has take turns).
    pub(crate) fn compute_shares(&self, partitions: usize, cores_of: impl Fn(usize) -> u32) -> Vec<(u32, f64)> {
        self.thread_counts(partitions, cores_of)
            .into_iter()
            .map(|(threads, asked, cores)| (threads, (asked as f64 / f64::from(cores)).max(1.0)))
            .collect()
    }

    /// With profiles: how much longer an overlapped all-reduce's ring takes on each
    /// partition's host than alone, its communication thread one more asking for the cores.
    fn communication_slowdowns(&self, partitions: usize, cores_of: impl Fn(usize) -> u32) -> Vec<f64> {
        self.thread_counts(partitions, cores_of)
            .into_iter()
            .map(|(_, asked, cores)| ((asked + 1) as f64 / f64::from(cores)).max(1.0))
            .collect()
    }

    /// By partition: the threads its process computes on, the threads its host's processes
    /// ask for together, and the host's cores.
    fn thread_counts(&self, partitions: usize, cores_of: impl Fn(usize) -> u32) -> Vec<(u32, u64, u32)> {
        // A host's cores: what the profile of its first partition says.
        let mut host_cores: HashMap<u32, u32> = HashMap::new();
        for p in 0..partitions {
            host_cores.entry(self.process_of(p).1).or_insert_with(|| cores_of(p).max(1));
        }
        let threads_of = |process: u32, host: u32| match self.threads.get(process as usize) {
            Some(&t) if t > 0 => t,
            _ => host_cores[&host],
        };
        let mut asked: HashMap<u32, u64> = HashMap::new();
        let mut counted: HashSet<u32> = HashSet::new();
        for p in 0..partitions {
            let (process, host) = self.process_of(p);
            if counted.insert(process) {
                *asked.entry(host).or_default() += u64::from(threads_of(process, host));
            }
        }
        (0..partitions)
            .map(|p| {
                let (process, host) = self.process_of(p);
                (threads_of(process, host), asked[&host], host_cores[&host])
            })
            .collect()
    }

    /// Partition `p`'s process, or one of its own where the topology does not say.
    fn process_of(&self, p: usize) -> (u32, u32) {
        match (self.process.get(p), self.host.get(p)) {
            (Some(&process), Some(&host)) => (process, host),
            _ => (u32::MAX - p as u32, u32::MAX - p as u32),
        }
    }
}

/// The host a device's task runs on, as the cost model groups tasks: the host part of its
/// address (loopback's names as one), or for a cluster of this machine's devices (no
/// addresses), this machine.
pub(crate) fn host_of(cluster: &Cluster, device: &DeviceSpec) -> Option<String> {
    let job = cluster.job(device.job.as_deref()?)?;
    let task = job.tasks.get(device.task? as usize)?;
    let Some(address) = &task.address else { return Some("this machine".into()) };
    let host = dfc_ir::address_host(address);
    let loopback = host == "localhost" || host == "::1" || host.starts_with("127.");
    Some(if loopback { "this machine".into() } else { host.to_ascii_lowercase() })
}

/// The device a partition's nodes are placed on (the first that names one).
fn device_of(module: &Module) -> Option<&DeviceSpec> {
    module.graph.node_ids().find_map(|id| module.graph.node(id).device.as_ref())
}

/// How two partitions (or devices) are joined.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Link {
    Same,
    /// Two devices of one task (one process).
    Process,
    /// Two tasks of one host.
    Host,
    /// Two hosts.
    Network,
}

/// How partitions `a` and `b` of `topology` are joined.
pub(crate) fn link_between(topology: &Topology, a: usize, b: usize) -> Link {
    let (pa, ha) = topology.process_of(a);
    let (pb, hb) = topology.process_of(b);
    if a == b {
        Link::Same
    } else if pa == pb {
        Link::Process
    } else if ha == hb {
        Link::Host
    } else {
        Link::Network
    }
}

/// Seconds to move `bytes` over `link` on a machine of `profile`: handed from one thread to
/// another and copied within a process, its shared-memory queues within a host, TCP between
/// hosts.
pub(crate) fn link_seconds(bytes: f64, link: Link, profile: &Profile) -> f64 {
    let run = &profile.full().run;
    match link {
        Link::Same => 0.0,
        Link::Process => run.handoff_seconds + run.copy.seconds(2.0 * bytes),
        Link::Host => profile.shared_memory.seconds(bytes),
        Link::Network => profile.tcp.seconds(bytes),
    }
}

/// Of `link_seconds`, the part in which the sender's thread is busy: between processes of one
/// host, its copy of the bytes into the shared queue, half the bytes' time (the receiver's
/// copy out is the other); the rest of the transfer follows the send.
pub(crate) fn sender_seconds(bytes: f64, link: Link, profile: &Profile) -> f64 {
    match link {
        Link::Host => (profile.shared_memory.seconds(bytes) - profile.shared_memory.latency_seconds) / 2.0,
        Link::Same | Link::Process | Link::Network => 0.0,
    }
}

/// Adds `seconds` of `work` to a device's time by kind of work.
fn add_work(by_kind: &mut Vec<(String, f64)>, work: &str, seconds: f64) {
    match by_kind.iter_mut().find(|(k, _)| k == work) {
        Some((_, total)) => *total += seconds,
        None => by_kind.push((work.to_string(), seconds)),
    }
}

/// With a profile, the partitions of one process take turns on its threads, so a step takes at
/// least their compute one after another. `estimate_on` simulates that for the partitions it
/// is given; this applies it to `report` (whose devices run as `topology` says) where some
/// stood for others, replica instances simulated by their transfers alone and costed as the
/// partition they copy, whose compute must take its turn too.
pub fn take_turns(report: &mut CostReport, topology: &Topology) {
    let mut busy: HashMap<u32, f64> = HashMap::new();
    for (p, cost) in report.devices.iter().enumerate() {
        *busy.entry(topology.process_of(p).0).or_default() += cost.compute_seconds;
    }
    for (p, cost) in report.devices.iter_mut().enumerate() {
        cost.finish_seconds = cost.finish_seconds.max(busy[&topology.process_of(p).0]);
        report.step_seconds = report.step_seconds.max(cost.finish_seconds);
    }
}

/// `estimate` with the partitions run as `topology` says (a run on spawned workers: the
/// workers' processes, all on this host).
pub fn estimate_on(partitions: &[&Module], model: &CostModel, topology: &Topology) -> CostReport {
    let unknown = DeviceSpec::default();
    let specs: Vec<Option<&DeviceSpec>> = partitions.iter().map(|m| device_of(m)).collect();
    let spec = |p: u32| specs[p as usize].unwrap_or(&unknown);
    // With a profile, a process's partitions take turns on its threads; without, each device
    // computes on its own.
    let executor: Vec<u32> = (0..partitions.len())
        .map(|p| if model.profile.is_some() { topology.process_of(p).0 } else { p as u32 })
        .collect();
    let profiles: Vec<Option<&Arc<Profile>>> = specs.iter().map(|&s| model.profile_of(s)).collect();
    let shares = model
        .profile
        .as_ref()
        .map(|_| topology.compute_shares(partitions.len(), |p| profiles[p].map_or(1, |profile| profile.cpu.threads)));
    let communication_slowdowns = match (&model.profile, topology.overlap) {
        (Some(_), true) => {
            topology.communication_slowdowns(partitions.len(), |p| profiles[p].map_or(1, |profile| profile.cpu.threads))
        }
        _ => vec![1.0; partitions.len()],
    };
    let mut executors: Vec<u32> = executor.clone();
    executors.sort_unstable();
    executors.dedup();
    let executor: Vec<u32> = executor.iter().map(|e| executors.binary_search(e).expect("listed") as u32).collect();
    let names: Vec<String> = specs
        .iter()
        .enumerate()
        .map(|(i, s)| match s {
            Some(s) => s.to_string(),
            None => format!("partition {i}"),
        })
        .collect();

    // Number the nodes of all partitions, each partition in topological order.
    let mut nodes: Vec<SimNode> = Vec::new();
    let mut global: Vec<Vec<u32>> = Vec::with_capacity(partitions.len());
    let mut devices: Vec<DeviceCost> =
        names.iter().map(|name| DeviceCost { device: name.clone(), ..DeviceCost::default() }).collect();
    for (p, module) in partitions.iter().enumerate() {
        let graph = &module.graph;
        // A cyclic partition (never in a verified plan) keeps creation order; the nodes on the
        // cycle never become ready.
        let order = graph.topo_order().unwrap_or_else(|_| graph.node_ids().collect());
        let slots = graph.node_ids().map(|id| id.index() + 1).max().unwrap_or(0);
        let mut map = vec![NONE; slots];
        let profiled = profiles[p].zip(shares.as_ref()).map(|(profile, shares)| {
            let (threads, slower) = shares[p];
            let mut times = profiled_seconds(module, profile.rates(threads));
            times.iter_mut().for_each(|t| *t *= slower);
            times
        });
        let device = &mut devices[p];
        for (priority, &id) in order.iter().enumerate() {
            let node = graph.node(id);
            let flops = node_flops(graph, id);
            device.flops += flops;
            let kind = match &node.op {
                Op::Send { .. } => {
                    let bytes = graph.inputs(id).first().map_or(0, |t| tensor_bytes(graph.ty(*t)));
                    device.bytes_sent = device.bytes_sent.saturating_add(bytes);
                    Kind::Send
                }
                Op::Recv { ty, .. } => {
                    device.bytes_received = device.bytes_received.saturating_add(tensor_bytes(ty));
                    Kind::Recv
                }
                Op::AllReduce { group_size, .. } => {
                    let bytes = ring_bytes(node.outputs.first().map_or(0, tensor_bytes), *group_size);
                    device.bytes_sent = device.bytes_sent.saturating_add(bytes);
                    device.bytes_received = device.bytes_received.saturating_add(bytes);
                    Kind::AllReduce
                }
                Op::Variable { ty, .. } => {
                    device.variable_bytes = device.variable_bytes.saturating_add(tensor_bytes(ty));
                    Kind::Compute
                }
                _ => Kind::Compute,
            };
            let seconds = match &profiled {
                // An all-reduce's additions go with the transfers, at the kernels' rate.
                Some(_) if kind == Kind::AllReduce => {
                    seconds(3.0 * node.outputs.first().map_or(0, tensor_bytes) as f64, model.local_bytes_per_second)
                }
                Some(times) => times.get(id.index()).copied().unwrap_or(0.0),
                None => seconds(flops, model.flops_per_second),
            };
            if kind == Kind::Compute && seconds > 0.0 {
                device.compute_seconds += seconds;
                add_work(&mut device.by_kind, work_kind(graph, id), seconds);
            }
            map[id.index()] = nodes.len() as u32;
            nodes.push(SimNode {
                partition: p as u32,
                executor: executor[p],
                id,
                priority: priority as u32,
                kind,
                seconds,
            });
        }
        global.push(map);
    }
    let n = nodes.len();

    // Dependencies: data and control edges within partitions, each predecessor once.
    let mut successors: Vec<Vec<u32>> = vec![Vec::new(); n];
    let mut pending = vec![0u32; n];
    let mut before: Vec<NodeId> = Vec::new();
    for (g, node) in nodes.iter().enumerate() {
        let graph = &partitions[node.partition as usize].graph;
        before.clear();
        before.extend(graph.data_edges_into(node.id).into_iter().map(|(_, t)| t.node));
        before.extend(graph.control_inputs(node.id));
        before.sort_unstable();
        before.dedup();
        for pred in &before {
            let pg = global[node.partition as usize].get(pred.index()).copied().unwrap_or(NONE);
            if pg != NONE {
                successors[pg as usize].push(g as u32);
                pending[g] += 1;
            }
        }
    }

    // Each Recv waits for its Send (same key; the one between the same two devices if several
    // share a key). Sends are indexed by key once.
    let op_of = |node: &SimNode| &partitions[node.partition as usize].graph.node(node.id).op;
    let mut sends: HashMap<&str, Vec<u32>> = HashMap::new();
    let mut groups: Vec<Group> = Vec::new();
    let mut group_index: HashMap<&str, usize> = HashMap::new();
    let mut group_of = vec![NONE; n];
    for (g, node) in nodes.iter().enumerate() {
        match op_of(node) {
            Op::Send { key, .. } => sends.entry(key.as_str()).or_default().push(g as u32),
            Op::AllReduce { key, group_size, .. } => {
                let graph = &partitions[node.partition as usize].graph;
                let bytes = graph.node(node.id).outputs.first().map_or(0, tensor_bytes);
                let index = *group_index.entry(key.as_str()).or_insert_with(|| {
                    groups.push(Group {
                        members: Vec::new(),
                        size: 0,
                        bytes: 0,
                        arrived: 0,
                        latest: f64::NEG_INFINITY,
                        latest_member: NONE,
                    });
                    groups.len() - 1
                });
                let group = &mut groups[index];
                group.members.push(g as u32);
                group.size = group.size.max(*group_size);
                group.bytes = group.bytes.max(bytes);
                group_of[g] = index as u32;
            }
            _ => {}
        }
    }
    let mut transfer = vec![0.0f64; n];
    let mut recv_source = vec![NONE; n];
    // Sends that keep their device busy, and for how long (see `sender_seconds`).
    let mut busy_sends: Vec<(u32, f64)> = Vec::new();
    for (g, node) in nodes.iter().enumerate() {
        let Op::Recv { key, from, ty } = op_of(node) else { continue };
        let Some(candidates) = sends.get(key.as_str()) else { continue };
        let receiver = specs[node.partition as usize];
        let to_of = |s: u32| match op_of(&nodes[s as usize]) {
            Op::Send { to, .. } => Some(to),
            _ => None,
        };
        let between = |s: &&u32| {
            let sender = specs[nodes[**s as usize].partition as usize];
            receiver.is_none_or(|d| Some(d) == to_of(**s)) && sender.is_none_or(|d| d == from)
        };
        let Some(&s) = candidates.iter().find(between).or(candidates.first()) else { continue };
        // The partitions' devices, or where those are unknown, what the pair says.
        let there = specs[nodes[s as usize].partition as usize].unwrap_or(from);
        let here = receiver.or(to_of(s)).unwrap_or(&unknown);
        transfer[g] = match &model.profile {
            Some(profile) => {
                let (from, to) = (nodes[s as usize].partition as usize, node.partition as usize);
                let link = link_between(topology, from, to);
                // Within a host, the host's own profile; between hosts, the network's.
                let profile = if link == Link::Network { profile } else { profiles[to].unwrap_or(profile) };
                let whole = link_seconds(tensor_bytes(ty) as f64, link, profile);
                let sender = sender_seconds(tensor_bytes(ty) as f64, link, profile).min(whole);
                if sender > 0.0 {
                    busy_sends.push((s, sender));
                }
                whole - sender
            }
            None => transfer_seconds(tensor_bytes(ty), there, here, model),
        };
        recv_source[g] = s;
        successors[s as usize].push(g as u32);
        pending[g] += 1;
    }

    for (s, seconds) in busy_sends {
        let node = &mut nodes[s as usize];
        // A copy on a crowded host's cores, slowed as its compute is.
        let seconds = seconds * shares.as_ref().map_or(1.0, |shares| shares[node.partition as usize].1);
        node.kind = Kind::Compute;
        node.seconds += seconds;
        // As the programs run them: a send as soon as its value is made, before other work.
        node.priority = 0;
        add_work(&mut devices[node.partition as usize].by_kind, "send", seconds);
    }

    // The ring all-reduce time of each group, from its members' devices.
    let ring_seconds: Vec<f64> = groups
        .iter()
        .map(|group| {
            let Some(&first) = group.members.first() else { return 0.0 };
            let host_profile = profiles[nodes[first as usize].partition as usize];
            if let (Some(profile), true) = (host_profile, group.size <= 1) {
                // Alone, it still reads its operand and writes its result.
                return profile.full().run.copy.seconds(2.0 * group.bytes as f64);
            }
            if group.size <= 1 {
                return 0.0;
            }
            let bytes = ring_bytes(group.bytes, group.size);
            let steps = 2.0 * (group.size - 1) as f64;
            if let Some(profile) = &model.profile {
                let partition = |m: u32| nodes[m as usize].partition as usize;
                let link = group
                    .members
                    .iter()
                    .map(|&m| link_between(topology, partition(first), partition(m)))
                    .max()
                    .unwrap_or(Link::Same);
                let host = host_profile.unwrap_or(profile);
                let through = match link {
                    // Each member's slice read from the others and summed (its bytes three
                    // times), once every member's thread has handed its part over.
                    Link::Same | Link::Process => {
                        let run = &host.full().run;
                        return run.handoff_seconds + run.copy.seconds(3.0 * bytes as f64);
                    }
                    Link::Host => host.host_ring(group.size),
                    Link::Network => profile.tcp,
                };
                // Each of the ring's 2(n − 1) steps pays the link's fixed cost.
                return through.seconds(bytes as f64) + (steps - 1.0) * through.latency_seconds;
            }
            let first = spec(nodes[first as usize].partition);
            let remote = group.members.iter().any(|&m| !same_task(spec(nodes[m as usize].partition), first));
            if remote {
                seconds(bytes as f64, model.remote_bytes_per_second) + steps * model.remote_latency_seconds.max(0.0)
            } else {
                seconds(bytes as f64, model.local_bytes_per_second)
            }
        })
        .collect();

    // The exchanges' times in the breakdown: each member's all-reduce, each receive's transfer.
    for (g, node) in nodes.iter().enumerate() {
        let exchange = match node.kind {
            Kind::AllReduce => Some(("all_reduce", ring_seconds.get(group_of[g] as usize).copied().unwrap_or(0.0))),
            Kind::Recv => Some(("recv", transfer[g])),
            _ => None,
        };
        if let Some((work, seconds)) = exchange.filter(|(_, s)| *s > 0.0 && s.is_finite()) {
            add_work(&mut devices[node.partition as usize].by_kind, work, seconds);
        }
    }

    // A program runs its all-reduces one at a time. In place, it waits for each; overlapped,
    // only for its last (the one it starts last: the largest topological position, and the
    // other replicas' members of that reduction in the program).
    let mut in_place = vec![!topology.overlap; n];
    if topology.overlap {
        let mut last: Vec<Option<u32>> = vec![None; partitions.len()];
        let all_reduces = || nodes.iter().enumerate().filter(|(_, node)| node.kind == Kind::AllReduce);
        for (g, node) in all_reduces() {
            let last = &mut last[node.partition as usize];
            if last.is_none_or(|l| nodes[l as usize].priority < node.priority) {
                *last = Some(g as u32);
            }
        }
        for (g, node) in all_reduces() {
            in_place[g] = last[node.partition as usize].is_some_and(|l| group_of[l as usize] == group_of[g]);
        }
    }

    // An overlapped all-reduce's additions run on its process's cores beside the compute, on
    // its program's communication thread: a compute node of their time, ready when the ring
    // starts, first in its executor's queue (as a busy send is), that nothing waits for.
    let mut shadow_of = vec![NONE; n];
    for g in 0..n {
        let node = &nodes[g];
        if node.kind == Kind::AllReduce && !in_place[g] && node.seconds > 0.0 {
            shadow_of[g] = nodes.len() as u32;
            let shadow = SimNode { kind: Kind::Compute, priority: 0, ..*node };
            nodes.push(shadow);
            successors.push(Vec::new());
            pending.push(1);
        }
    }
    let with_shadows = nodes.len();

    // A partition of inputs and exchanges alone stands for another (`dfc_ir::instance_transfers`).
    let programs: Vec<bool> = partitions
        .iter()
        .map(|module| {
            let graph = &module.graph;
            let exchange =
                |op: &Op| matches!(op, Op::Input { .. } | Op::Send { .. } | Op::Recv { .. } | Op::AllReduce { .. });
            graph.node_ids().any(|id| !exchange(&graph.node(id).op))
        })
        .collect();

    // Driven with a profile: the processes that wait for another within the step (a receive
    // from another, an all-reduce among several).
    let mut exchanging: HashSet<u32> = HashSet::new();
    if topology.driven && model.profile.is_some() {
        let process = |g: u32| topology.process_of(nodes[g as usize].partition as usize).0;
        for (g, &s) in recv_source.iter().enumerate() {
            if s != NONE && process(s) != process(g as u32) {
                exchanging.extend([process(s), process(g as u32)]);
            }
        }
        for group in &groups {
            let members: HashSet<u32> = group.members.iter().map(|&m| process(m)).collect();
            if members.len() > 1 {
                exchanging.extend(members);
            }
        }
    }

    let mut sim = Simulation {
        nodes: &nodes,
        ready: vec![f64::NEG_INFINITY; with_shadows],
        cause: vec![NONE; with_shadows],
        finish: vec![f64::NAN; with_shadows],
        finish_order: vec![0; with_shadows],
        finished: 0,
        events: BinaryHeap::new(),
        seq: 0,
        queues: (0..executors.len()).map(|_| BinaryHeap::new()).collect(),
        running: vec![false; executors.len()],
        dispatch_pending: vec![false; executors.len()],
        last_run: vec![NONE; executors.len()],
        groups,
        group_of,
        ring_seconds,
        in_place,
        collectives: vec![VecDeque::new(); partitions.len()],
        collective_running: vec![None; partitions.len()],
        waiting: vec![false; partitions.len()],
        active: vec![0; partitions.len()],
        programs,
        shadow_of,
        communication_slowdowns,
    };
    for (g, &waiting) in pending.iter().enumerate() {
        if waiting == 0 {
            sim.ready[g] = 0.0;
            sim.make_ready(g as u32, 0.0);
        }
    }
    while let Some(Reverse((Time(now), class, _, what))) = sim.events.pop() {
        if class == DISPATCH {
            sim.dispatch(what, now);
            continue;
        }
        let g = what as usize;
        sim.finish[g] = now;
        sim.finished += 1;
        sim.finish_order[g] = sim.finished;
        let node = &nodes[g];
        let p = node.partition as usize;
        match node.kind {
            Kind::Compute => {
                let e = node.executor as usize;
                sim.running[e] = false;
                sim.last_run[e] = what;
                sim.active[p] -= 1;
                sim.request_dispatch(node.executor, now);
            }
            Kind::AllReduce => {
                // (Replicas in one program: its members finish together, the first ends it.)
                if sim.collective_running[p] == Some(sim.group_of[g]) {
                    sim.collective_running[p] = None;
                    if std::mem::take(&mut sim.waiting[p]) {
                        sim.request_dispatch(node.executor, now);
                    }
                }
            }
            Kind::Send | Kind::Recv => {}
        }
        for &s in &successors[g] {
            let arrival = if recv_source[s as usize] == what { now + transfer[s as usize] } else { now };
            if arrival >= sim.ready[s as usize] {
                sim.ready[s as usize] = arrival;
                sim.cause[s as usize] = what;
            }
            pending[s as usize] -= 1;
            if pending[s as usize] == 0 {
                sim.make_ready(s, sim.ready[s as usize]);
            }
        }
        // With what it made ready counted, the program may now start its next all-reduce.
        if matches!(node.kind, Kind::Compute | Kind::AllReduce) {
            sim.start_collective(p, now);
        }
    }

    // Per-device finish, the step time, and the critical path back from the last node.
    let mut last: Option<u32> = None;
    for (g, node) in nodes.iter().enumerate() {
        let finish = sim.finish[g];
        if finish.is_nan() {
            continue;
        }
        let device = &mut devices[node.partition as usize];
        device.finish_seconds = device.finish_seconds.max(finish);
        let later = match last {
            None => true,
            Some(l) => (finish, sim.finish_order[g]) > (sim.finish[l as usize], sim.finish_order[l as usize]),
        };
        if later {
            last = Some(g as u32);
        }
    }
    for device in &mut devices {
        device.by_kind.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    }
    // A process's fixed cost of running its program (the feeds, the fetches, its threads).
    if let (Some(profile), Some(shares)) = (&model.profile, &shares) {
        for ((device, &(threads, _)), own) in devices.iter_mut().zip(shares).zip(&profiles) {
            device.finish_seconds += own.unwrap_or(profile).rates(threads).run.program_seconds;
        }
        // A driven worker's step: the driver's call, with the feeds of its partitions.
        if topology.driven {
            let mut feeds: HashMap<u32, u64> = HashMap::new();
            for (p, module) in partitions.iter().enumerate() {
                let bytes: u64 = module
                    .inputs
                    .iter()
                    .filter_map(|&id| module.graph.node(id).outputs.first())
                    .map(tensor_bytes)
                    .sum();
                *feeds.entry(topology.process_of(p).0).or_default() += bytes;
            }
            // Each worker's computing on its cores alone (its partitions take turns; the
            // host's processes' turns on its cores are not the driver's cost).
            let mut computing: HashMap<u32, f64> = HashMap::new();
            for (p, (device, &(_, slower))) in devices.iter().zip(shares).enumerate() {
                *computing.entry(topology.process_of(p).0).or_default() += device.compute_seconds / slower;
            }
            // The driver calls every worker at once; together they cost more than one alone,
            // and busy ones more than idle ones.
            let workers = feeds.len();
            // Workers that wait for each other within the step wait for the latest one's call.
            let waiting = profile.driven_step.exchanging_seconds(workers);
            for (p, device) in devices.iter_mut().enumerate() {
                let process = topology.process_of(p).0;
                let (bytes, computing) = (feeds[&process] as f64, computing[&process]);
                device.finish_seconds += profile.driven_step.seconds(workers, bytes, computing);
                if exchanging.contains(&process) {
                    device.finish_seconds += waiting;
                }
            }
        }
    }
    let step_seconds = devices.iter().map(|d| d.finish_seconds).fold(0.0, f64::max);
    let mut path = Vec::new();
    let mut at = last.unwrap_or(NONE);
    while at != NONE && path.len() <= with_shadows {
        path.push(at);
        at = sim.cause[at as usize];
    }
    path.reverse();
    let name = |g: u32| {
        let node = &nodes[g as usize];
        partitions[node.partition as usize].graph.node(node.id).name.as_str()
    };
    let mut critical_path = Vec::new();
    for run in path.chunk_by(|a, b| nodes[*a as usize].partition == nodes[*b as usize].partition) {
        let device = &names[nodes[run[0] as usize].partition as usize];
        critical_path.push(match run {
            [one] => format!("{device}: {}", name(*one)),
            [first, .., last] => format!("{device}: {} … {} ({} ops)", name(*first), name(*last), run.len()),
            [] => unreachable!("chunks are never empty"),
        });
    }

    CostReport { devices, step_seconds, critical_path, model: Some(model.clone()) }
}

/// The state of `estimate`'s event-driven simulation.
struct Simulation<'a> {
    nodes: &'a [SimNode],
    /// When each node's last input arrived.
    ready: Vec<f64>,
    /// What decided each node's start: its last input, or the node its device ran before it.
    cause: Vec<u32>,
    /// NaN until the node is done.
    finish: Vec<f64>,
    /// The order nodes finished in, to break ties between equal times.
    finish_order: Vec<u64>,
    finished: u64,
    events: BinaryHeap<Reverse<(Time, u8, u64, u32)>>,
    seq: u64,
    /// Per executor, the ready compute nodes by topological position.
    queues: Vec<BinaryHeap<Reverse<(u32, u32)>>>,
    running: Vec<bool>,
    dispatch_pending: Vec<bool>,
    last_run: Vec<u32>,
    groups: Vec<Group>,
    group_of: Vec<u32>,
    ring_seconds: Vec<f64>,
    /// By node: an all-reduce its program runs in place, waiting for it.
    in_place: Vec<bool>,
    /// By partition: its all-reduces whose operands are done, not yet started, in order.
    collectives: Vec<VecDeque<u32>>,
    /// By partition: the group of its all-reduce started and not done.
    collective_running: Vec<Option<u32>>,
    /// By partition: its program waits for an all-reduce in place and starts nothing else.
    waiting: Vec<bool>,
    /// By partition: its compute nodes ready or running.
    active: Vec<u32>,
    /// By partition: whether it computes. One that does not (an instance simulated by its
    /// exchanges alone) does not order its all-reduces: it starts each when its operand is
    /// done, and its peers' programs decide when the ring starts.
    programs: Vec<bool>,
    /// By all-reduce member: the compute node of its additions when it is overlapped.
    shadow_of: Vec<u32>,
    /// By partition: how much longer its overlapped all-reduces' rings take.
    communication_slowdowns: Vec<f64>,
}

impl Simulation<'_> {
    fn push(&mut self, time: f64, class: u8, what: u32) {
        self.seq += 1;
        self.events.push(Reverse((Time(time), class, self.seq, what)));
    }

    fn request_dispatch(&mut self, executor: u32, now: f64) {
        let p = executor as usize;
        if !self.running[p] && !self.dispatch_pending[p] && !self.queues[p].is_empty() {
            self.dispatch_pending[p] = true;
            self.push(now, DISPATCH, executor);
        }
    }

    /// Node `g`'s inputs are all done; the last arrived at `ready` (which is no earlier than
    /// the event being processed).
    fn make_ready(&mut self, g: u32, ready: f64) {
        let node = &self.nodes[g as usize];
        match node.kind {
            Kind::Compute => {
                self.active[node.partition as usize] += 1;
                self.queues[node.executor as usize].push(Reverse((node.priority, g)));
                self.request_dispatch(node.executor, ready);
            }
            Kind::Send | Kind::Recv => self.push(ready, FINISH, g),
            Kind::AllReduce => {
                let p = node.partition as usize;
                if !self.programs[p] || self.collective_running[p] == Some(self.group_of[g as usize]) {
                    // A stand-in's member (it meets its peers as the replica it copies does),
                    // or another replica's in this program, whose all-reduce is under way.
                    self.arrive(g, ready);
                } else {
                    self.collectives[p].push_back(g);
                    self.start_collective(p, ready);
                }
            }
        }
    }

    /// Partition `p`'s program starts its next all-reduce at `now` if it can: when none of
    /// its all-reduces is running, and for one run in place, when the program has nothing
    /// else to do (`dfc_interp::schedule` puts a ready all-reduce after all other ready work).
    fn start_collective(&mut self, p: usize, now: f64) {
        while let Some(&g) = self.collectives[p].front() {
            let group = self.group_of[g as usize];
            match self.collective_running[p] {
                Some(running) if running != group => return,
                None if self.in_place[g as usize] && self.active[p] > 0 => return,
                _ => {}
            }
            self.collectives[p].pop_front();
            self.collective_running[p] = Some(group);
            self.waiting[p] |= self.in_place[g as usize];
            self.arrive(g, now);
        }
    }

    /// All-reduce member `g`'s program starts it at `now`; the last member to start starts
    /// the ring.
    fn arrive(&mut self, g: u32, now: f64) {
        let index = self.group_of[g as usize] as usize;
        let group = &mut self.groups[index];
        group.arrived += 1;
        if now >= group.latest {
            group.latest = now;
            group.latest_member = g;
        }
        if group.arrived < group.members.len() {
            return;
        }
        let (latest, latest_member) = (group.latest, group.latest_member);
        let members = std::mem::take(&mut group.members);
        let additions = members.iter().map(|&m| self.nodes[m as usize].seconds).fold(0.0, f64::max);
        // Overlapped, its thread shares the cores with the compute.
        let slowdown = members
            .iter()
            .filter(|&&m| !self.in_place[m as usize])
            .map(|&m| self.communication_slowdowns[self.nodes[m as usize].partition as usize])
            .fold(1.0, f64::max);
        let done = latest + (self.ring_seconds[index] * slowdown).max(additions);
        for &m in &members {
            if m != latest_member {
                self.cause[m as usize] = latest_member;
            }
        }
        for &m in &members {
            self.push(done, FINISH, m);
            let shadow = self.shadow_of[m as usize];
            if shadow != NONE {
                self.ready[shadow as usize] = latest;
                self.make_ready(shadow, latest);
            }
        }
    }

    /// Executor `executor` (a device, or a host's cores) is free at `now`: it starts its first
    /// ready node.
    fn dispatch(&mut self, executor: u32, now: f64) {
        let p = executor as usize;
        self.dispatch_pending[p] = false;
        if self.running[p] {
            return;
        }
        // The first ready node whose program is not waiting for an all-reduce.
        let mut set_aside = Vec::new();
        let next = loop {
            match self.queues[p].pop() {
                Some(Reverse((priority, g))) if self.waiting[self.nodes[g as usize].partition as usize] => {
                    set_aside.push(Reverse((priority, g)));
                }
                other => break other,
            }
        };
        self.queues[p].extend(set_aside);
        let Some(Reverse((_, g))) = next else { return };
        // It waited for the device: what the device ran before decided its start.
        if self.ready[g as usize] < now && self.last_run[p] != NONE {
            self.cause[g as usize] = self.last_run[p];
        }
        self.running[p] = true;
        self.push(now + self.nodes[g as usize].seconds, FINISH, g);
    }
}

pub use dfc_ir::human_bytes;

/// `12.345 ms`, `50 µs`, `1.5 s`, `0.96 ns`: three decimals at most, trailing zeros dropped.
pub fn human_seconds(s: f64) -> String {
    if !s.is_finite() {
        return "unbounded".into();
    }
    if s == 0.0 {
        "0 s".into()
    } else if s < 1e-6 {
        format!("{} ns", compact(s * 1e9))
    } else if s < 1e-3 {
        format!("{} µs", compact(s * 1e6))
    } else if s < 1.0 {
        format!("{} ms", compact(s * 1e3))
    } else {
        format!("{} s", compact(s))
    }
}

/// `1.25 GB/s`, `10 GB/s`, `800 MB/s` (decimal units, as links are sold).
fn human_rate(bytes_per_second: f64) -> String {
    let (value, unit) = if bytes_per_second >= 1e9 {
        (bytes_per_second / 1e9, "GB/s")
    } else if bytes_per_second >= 1e6 {
        (bytes_per_second / 1e6, "MB/s")
    } else if bytes_per_second >= 1e3 {
        (bytes_per_second / 1e3, "kB/s")
    } else {
        (bytes_per_second, "B/s")
    };
    format!("{} {unit}", compact(value))
}

/// At most three decimals, without trailing zeros: `50`, `1.25`, `0.001`.
fn compact(x: f64) -> String {
    let text = format!("{x:.3}");
    if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        text
    }
}

/// One step's cost per device, as `dfc compile --report` and `dfc inspect` print it:
///
/// ```text
/// cost of one step (predicted)
///   device                    variables  GFLOP  sent     received  compute ms  finish ms
///   /job:worker/task:0/cpu:0   12.5 MiB  1.234  1.0 MiB       0 B      24.680     25.101
/// predicted step time: 25.101 ms
/// critical path
///   /job:worker/task:0/cpu:0: x … y/send (12 ops)
/// assumed: 50 GFLOP/s per device, 10 GB/s within a task, 1.25 GB/s and 50 µs latency between tasks
/// ```
impl fmt::Display for CostReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "cost of one step (predicted)")?;
        let mut rows: Vec<Vec<String>> =
            vec![["device", "variables", "GFLOP", "sent", "received", "compute ms", "finish ms"]
                .iter()
                .map(|s| s.to_string())
                .collect()];
        for d in &self.devices {
            rows.push(vec![
                d.device.clone(),
                human_bytes(d.variable_bytes),
                format!("{:.3}", d.flops / 1e9),
                human_bytes(d.bytes_sent),
                human_bytes(d.bytes_received),
                format!("{:.3}", d.compute_seconds * 1e3),
                format!("{:.3}", d.finish_seconds * 1e3),
            ]);
        }
        let columns = rows[0].len();
        let widths: Vec<usize> =
            (0..columns).map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0)).collect();
        for row in &rows {
            let mut line = String::new();
            for (c, cell) in row.iter().enumerate() {
                line.push_str("  ");
                if c == 0 {
                    line.push_str(&format!("{cell:<w$}", w = widths[c]));
                } else {
                    line.push_str(&format!("{cell:>w$}", w = widths[c]));
                }
            }
            writeln!(f, "{}", line.trim_end())?;
        }
        writeln!(f, "predicted step time: {}", human_seconds(self.step_seconds))?;
        if !self.critical_path.is_empty() {
            writeln!(f, "critical path")?;
            for entry in &self.critical_path {
                writeln!(f, "  {entry}")?;
            }
        }
        if let Some(calibration) = self.model.as_ref().and_then(|m| m.calibration.as_ref()) {
            writeln!(f, "calibrated: {calibration}")?;
        } else if let Some(m) = &self.model {
            writeln!(
                f,
                "assumed: {} GFLOP/s per device, {} within a task, {} and {} latency between tasks",
                compact(m.flops_per_second / 1e9),
                human_rate(m.local_bytes_per_second),
                human_rate(m.remote_bytes_per_second),
                human_seconds(m.remote_latency_seconds),
            )?;
        }
        Ok(())
    }
}
