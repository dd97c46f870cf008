//! `NativeProgram`: a partition's [`Schedule`] run on the CPU over host memory, its kernels
//! JIT-compiled; and the host's implementation of every step but a kernel
//! ([`run_host_step`]), which the grid emulator's GPU programs share.

use crate::jit::{Jitted, KernelFn};
use crate::kept;
use crate::overlap::{CommThread, Communicator};
use crate::schedule::{ConvKind, KernelSite, PoolKind, Schedule, Slot, Step};
use crate::CpuError;
use dfc_interp::{Data, InterpError, Rendezvous, Tensor, Variables};
use dfc_ir::{DType, Module, NodeId, Op, TensorRef, TensorType};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The steps of a partition for some fetches and targets, checked and planned once, run many
/// times (one run at a time: runs share the arena).
pub struct NativeProgram {
    schedule: Schedule,
    /// Per kernel of the schedule that a step runs: its function, rows, and whether to split them
    /// among threads.
    functions: Vec<Option<(KernelFn, u64, bool)>>,
    arena: Mutex<Arena>,
    /// The thread that runs overlapped all-reduces, from the first run that has one.
    comm: Mutex<Option<CommThread>>,
    /// Per step, its category and name on the timeline (`dfc_interp::trace`).
    labels: Vec<(&'static str, Arc<str>)>,
    /// Per step, what is kept of the weight it reads (its product's B, its convolution's filter), if any (`kept`).
    kept_reads: Vec<Option<usize>>,
    /// Keeps the kernels' code alive.
    _jit: Arc<Jitted>,
}

/// A run's memory for planned values: 64-byte aligned bytes (`memory::ALIGN`).
pub struct HostArena(Vec<Line>);

/// 64-byte aligned bytes.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

impl HostArena {
    pub fn new(bytes: usize) -> HostArena {
        HostArena(vec![Line([0; 64]); bytes.div_ceil(64)])
    }

    pub fn bytes(&self) -> usize {
        self.0.len() * 64
    }

    pub fn base(&mut self) -> *mut u8 {
        self.0.as_mut_ptr() as *mut u8
    }
}

struct Arena {
    lines: HostArena,
    /// im2col columns of the convolutions, grown on the first run.
    scratch: dfc_kernels::Scratch,
    /// Scratch for kernel argument arrays.
    args: Vec<*mut u8>,
    /// What is kept of the weights (`kept::plan`), and the variables' stamp the last run that ended left, while it
    /// holds what those variables hold (none during a run, and after one that failed).
    kept: Vec<(usize, kept::Kept)>,
    kept_stamp: Option<u64>,
}

// SAFETY: the raw pointers in `args` are scratch, rewritten before every use.
unsafe impl Send for Arena {}

impl std::fmt::Debug for NativeProgram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NativeProgram").field("steps", &self.schedule.steps.len()).finish()
    }
}

impl NativeProgram {
    /// The program computing `fetches` and running `targets` over `module` (a partition) with
    /// its kernels compiled in `jit` (`jit::load_partition` of this module), nodes in `order`
    /// (see `dfc_interp::Program::with_order`); `overlap`: its all-reduces run on a thread of
    /// their own while the steps go on (`Schedule::overlapped`).
    pub fn new(
        module: &Module,
        jit: Arc<Jitted>,
        fetches: &[TensorRef],
        targets: &[NodeId],
        order: &[NodeId],
        training: bool,
        overlap: bool,
    ) -> Result<NativeProgram, CpuError> {
        let sites: Vec<KernelSite> =
            jit.kernels().iter().map(|k| KernelSite { root: k.root, members: &k.members, inputs: &k.inputs }).collect();
        let schedule = match overlap {
            true => Schedule::overlapped(module, &sites, fetches, targets, order, training)?,
            false => Schedule::new(module, &sites, fetches, targets, order, training)?,
        };
        let mut functions = vec![None; sites.len()];
        for step in &schedule.steps {
            if let Step::Kernel { kernel, .. } = *step {
                let described = &jit.kernels()[kernel];
                let function = jit.function(&described.function).ok_or_else(|| {
                    CpuError::Interp(InterpError::Malformed {
                        node: module.graph.node(described.root).name.clone(),
                        message: format!("kernel `{}` is not in the code", described.function),
                    })
                })?;
                functions[kernel] = Some((function, described.rows, described.parallel));
            }
        }
        // Every buffer a step's products use is in place before its first step.
        dfc_gemm::reserve_workers();
        let lines = HostArena::new(schedule.arena_bytes);
        let (kept_reads, kept) = kept::plan(&schedule);
        let arena =
            Mutex::new(Arena { lines, scratch: dfc_kernels::Scratch::new(), args: Vec::new(), kept, kept_stamp: None });
        let kernel_name = |kernel: usize| jit.kernels()[kernel].function.clone();
        let labels = schedule
            .steps
            .iter()
            .map(|step| {
                let (category, name) = step_label(step, module, &kernel_name);
                (category, Arc::from(name))
            })
            .collect();
        Ok(NativeProgram { schedule, functions, arena, comm: Mutex::new(None), labels, kept_reads, _jit: jit })
    }

    /// The schedule the program runs.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// The ops that run through the interpreter's kernels (no native step), one per node.
    pub fn library_ops(&self) -> Vec<String> {
        self.schedule.library_ops()
    }

    /// The updates whose value, a scaled product, is computed by one GEMM into the variable, by node name.
    pub fn folded_updates(&self) -> Vec<String> {
        self.schedule.folded_updates.clone()
    }

    /// The kernels scaling bytes fed in that do not run: their products read the bytes, by node name.
    pub fn bytes_read(&self) -> Vec<String> {
        self.schedule.bytes_read.clone()
    }

    /// How many products read bytes fed in times a variable that this program also writes (a training step's
    /// first layer): their threads split them along the reduction (`dfc_gemm::sgemm_fused`'s `b_rewritten`).
    pub fn bytes_times_rewritten(&self) -> usize {
        let counted = |step: &&Step| matches!(step, Step::MatMul { bytes: Some(_), b_rewritten: true, .. });
        self.schedule.steps.iter().filter(counted).count()
    }

    /// The kernels (a bias, then a relu) computed by the product they follow, by node name.
    pub fn fused_products(&self) -> Vec<String> {
        self.schedule.fused_products.clone()
    }

    /// The kernels that sum a fused product's columns, computed by the product instead, by node name.
    pub fn summed_columns(&self) -> Vec<String> {
        self.schedule.summed_columns.clone()
    }

    /// The convolutions computed with the max pooling that reads them, never stored, by node name.
    pub fn pooled_convolutions(&self) -> Vec<String> {
        self.schedule.pooled_convolutions.clone()
    }

    /// The kernels (a bias, then a relu) computed by the pooled convolution they follow, by node name.
    pub fn pooled_epilogues(&self) -> Vec<String> {
        self.schedule.pooled_epilogues.clone()
    }

    /// The variables that the program keeps laid out between runs (`kept`), by name, in order: packed panels (none
    /// but on the AVX2 kernels) or a convolution's filter.
    pub fn kept_weights(&self) -> Vec<String> {
        let arena = self.arena.lock().unwrap_or_else(|e| e.into_inner());
        let mut names: Vec<String> = arena.kept.iter().map(|(v, _)| self.schedule.variables[*v].0.clone()).collect();
        // A weight read in two shapes (through reshapes) has panels of each.
        names.sort();
        names.dedup();
        names
    }

    /// The inputs the program needs.
    pub fn inputs(&self) -> Vec<String> {
        self.schedule.feeds.iter().map(|f| f.0.clone()).collect()
    }

    /// Bytes of the arena: every intermediate value of a run.
    pub fn arena_bytes(&self) -> usize {
        self.arena.lock().map(|a| a.lines.bytes()).unwrap_or(0)
    }

    /// Runs the program on `feeds`, updating `variables` in place, exchanging tensors through
    /// `rendezvous`; returns the fetched values.
    pub fn run(
        &self,
        variables: &mut Variables,
        feeds: &HashMap<String, Tensor>,
        rendezvous: Option<&dyn Rendezvous>,
    ) -> Result<Vec<Tensor>, InterpError> {
        let stamp = variables.stamp();
        let bindings = Bindings::new(&self.schedule, variables, feeds)?;
        let bound = variables.stamp();
        let mut arena = self.arena.lock().unwrap_or_else(|e| e.into_inner());
        let arena = &mut *arena;
        // What is kept holds the variables as the last run left them, if nothing wrote them since.
        if arena.kept_stamp != Some(stamp) {
            arena.kept.iter_mut().for_each(|(_, kept)| kept.stale());
        }
        arena.kept_stamp = None;
        let base = arena.lines.base();
        let at = |slot: Slot| bindings.at(base, slot);
        // The products of a run start without waking rayon's workers (see `dfc_gemm::hold`).
        let _hold = dfc_gemm::hold();
        let _flush = crate::denormals::FlushDenormals::new();
        let overlapped = self.schedule.steps.iter().any(|s| matches!(s, Step::AllReduce { overlapped: true, .. }));
        match rendezvous {
            Some(rendezvous) if overlapped => {
                let mut thread = self.comm.lock().unwrap_or_else(|e| e.into_inner());
                if thread.is_none() {
                    *thread = Some(CommThread::start()?);
                }
                let thread = thread.as_mut().expect("started above");
                let mut communicator = Communicator::new(thread, rendezvous);
                let result = self.run_steps(&at, arena, Some(rendezvous), Some(&mut communicator));
                communicator.finish(result.as_ref().err());
                result
            }
            _ => self.run_steps(&at, arena, rendezvous, None),
        }?;
        arena.kept_stamp = Some(bound);
        // SAFETY: as above.
        Ok(self.schedule.fetches.iter().map(|(slot, ty)| unsafe { read_tensor(at(*slot), ty) }).collect())
    }

    /// Runs every step, overlapped all-reduces through `communicator`.
    fn run_steps(
        &self,
        at: &dyn Fn(Slot) -> *mut u8,
        arena: &mut Arena,
        rendezvous: Option<&dyn Rendezvous>,
        mut communicator: Option<&mut Communicator<'_>>,
    ) -> Result<(), InterpError> {
        for ((step, label), kept) in self.schedule.steps.iter().zip(&self.labels).zip(&self.kept_reads) {
            let mut span = dfc_interp::trace::span(label.0, || label.1.clone());
            if let Some(span) = span.as_mut() {
                if let Some(bytes) = exchanged_bytes(step) {
                    span.set_bytes(bytes);
                }
            }
            match (step, communicator.as_deref_mut(), kept.map(|i| &mut arena.kept[i].1)) {
                (Step::MatMul { .. }, _, Some(kept::Kept::Panels(panels))) => {
                    // SAFETY: every slot of the schedule holds a value of the type the schedule planned for it
                    // (see `Bindings::at`); `kept::plan` gave panels to a product of one matrix whose B is the
                    // whole weight, of the panels' shape.
                    unsafe { product(step, at, Some(panels)) };
                }
                (Step::Conv { .. }, _, Some(kept::Kept::Filter(filter))) => {
                    // SAFETY: as above.
                    unsafe { convolution(step, at, &mut arena.scratch, Some(filter)) };
                }
                (Step::Kernel { kernel, args }, _, _) => {
                    let (function, rows, parallel) = self.functions[*kernel].expect("looked up for every kernel step");
                    arena.args.clear();
                    arena.args.extend(args.iter().map(|s| at(*s)));
                    // SAFETY: `args` holds the kernel's buffers in its order, each a slot planned
                    // for the kernel's types (see `Bindings::at`).
                    unsafe { run_kernel(function, &arena.args, rows, parallel) };
                }
                (Step::AllReduce { key, group_size, members, ty, overlapped: true }, Some(communicator), _) => {
                    // The values are copied out now: the thread never touches the arena.
                    let contributions = members
                        .iter()
                        .enumerate()
                        // SAFETY: the slot holds a value of `ty` (see `Bindings::at`).
                        .map(|(i, m)| (i, m.0, unsafe { read_tensor(at(m.1), ty) }))
                        .collect();
                    communicator.start(key, *group_size, contributions);
                }
                (Step::AllReduceWait { key, outs, ty }, Some(communicator), _) => {
                    for (i, sum) in communicator.wait(key)? {
                        // SAFETY: the slot has room for a value of `ty` (see `Bindings::at`),
                        // and no step uses it until this one wrote it.
                        unsafe { write_tensor(at(outs[i]), &sum, ty) };
                    }
                }
                (step, communicator, _) => {
                    if let (Step::AllReduce { .. }, Some(communicator)) = (step, communicator) {
                        // In place, after the all-reduces started before it (their order).
                        communicator.drain();
                    }
                    // SAFETY: every slot of the schedule holds a value of the type the schedule
                    // planned for it (see `Bindings::at`).
                    unsafe { run_host_step(step, at, &mut arena.scratch, rendezvous)? }
                }
            }
        }
        Ok(())
    }
}

/// A step's category and name on the timeline: a kernel's function, a product's shape, the
/// node or key of the others.
pub fn step_label(step: &Step, module: &Module, kernel_name: &dyn Fn(usize) -> String) -> (&'static str, String) {
    let name = |id: NodeId| module.graph.node(id).name.clone();
    match step {
        Step::Kernel { kernel, .. } => ("kernel", kernel_name(*kernel)),
        Step::MatMul { m, n, k, batches, .. } if batches.len() > 1 => {
            ("matmul", format!("matmul {}×[{m}×{k}]·[{k}×{n}]", batches.len()))
        }
        Step::MatMul { m, n, k, .. } => ("matmul", format!("matmul [{m}×{k}]·[{k}×{n}]")),
        Step::Conv { node, kind, pool, .. } => {
            let pooled = if pool.is_some() { " and MaxPool" } else { "" };
            ("conv", format!("{kind:?}{pooled} {}", name(*node)))
        }
        Step::Pool { node, kind, .. } => ("pool", format!("{kind:?} {}", name(*node))),
        Step::Norm { node, op, .. } => ("norm", format!("{} {}", op.name(), name(*node))),
        Step::Layout { node, op, .. } => ("layout", format!("{} {node}", op.name())),
        Step::Library { node, op, .. } => ("library", format!("{} {node}", op.name())),
        Step::Update { node, op, .. } => ("update", format!("{} {node}", op.name())),
        Step::Copy { bytes, .. } => ("copy", format!("copy {bytes} B")),
        Step::Send { key, .. } => ("send", format!("send {key}")),
        Step::Recv { key, .. } => ("recv", format!("recv {key}")),
        Step::AllReduce { key, overlapped: true, .. } => ("all_reduce", format!("start all_reduce {key}")),
        Step::AllReduce { key, .. } => ("all_reduce", format!("all_reduce {key}")),
        Step::AllReduceWait { key, .. } => ("wait", format!("wait all_reduce {key}")),
    }
}

/// The bytes an exchange step moves: its tensor's (per member, for an all-reduce).
fn exchanged_bytes(step: &Step) -> Option<u64> {
    let bytes = |ty: &TensorType| ty.size_in_bytes() as u64;
    match step {
        Step::Send { ty, .. } | Step::Recv { ty, .. } => Some(bytes(ty)),
        Step::AllReduce { ty, members, overlapped: false, .. } => Some(bytes(ty) * members.len() as u64),
        _ => None,
    }
}

/// The memory of a run's feeds, variables and constants, checked against a schedule.
pub struct Bindings {
    feeds: Vec<*mut u8>,
    variables: Vec<*mut u8>,
    consts: Vec<*mut u8>,
}

impl Bindings {
    /// Checks that `feeds` and `variables` have every value `schedule` needs, of its type, and
    /// points at them (the variables to be updated in place) and at the schedule's constants.
    pub fn new(
        schedule: &Schedule,
        variables: &mut Variables,
        feeds: &HashMap<String, Tensor>,
    ) -> Result<Bindings, InterpError> {
        let mut feed_ptrs = Vec::with_capacity(schedule.feeds.len());
        for (name, ty) in &schedule.feeds {
            let tensor = feeds.get(name).ok_or_else(|| InterpError::MissingFeed { input: name.clone() })?;
            if tensor.ty() != *ty {
                return Err(InterpError::FeedType { input: name.clone(), expected: ty.clone(), found: tensor.ty() });
            }
            feed_ptrs.push(data_ptr(&tensor.data) as *mut u8);
        }
        for (name, ty) in &schedule.variables {
            let value = variables.get(name).ok_or_else(|| InterpError::MissingVariable { name: name.clone() })?;
            if value.ty() != *ty {
                return Err(InterpError::VariableType { name: name.clone(), expected: ty.clone(), found: value.ty() });
            }
        }
        let mut var_ptrs = Vec::with_capacity(schedule.variables.len());
        for (name, _) in &schedule.variables {
            let tensor = variables.get_mut(name).expect("checked above");
            var_ptrs.push(data_ptr_mut(&mut tensor.data));
        }
        let consts = schedule.consts.iter().map(|c| data_ptr(&c.data) as *mut u8).collect();
        Ok(Bindings { feeds: feed_ptrs, variables: var_ptrs, consts })
    }

    /// Where `slot` is, with the arena at `base`. Every slot of the schedule then holds a value
    /// of the type the schedule planned for it, which is the type its steps name with it:
    /// feeds and variables were checked, constants are the schedule's, arena offsets were
    /// planned with room for their values (an arena of `arena_bytes` at `base`); slots written
    /// (arena, variables) are not feeds or constants. The pointers live as long as the feeds
    /// and variables `new` was given.
    pub fn at(&self, base: *mut u8, slot: Slot) -> *mut u8 {
        match slot {
            Slot::Arena(offset) => base.wrapping_add(offset),
            Slot::Feed(i) => self.feeds[i],
            Slot::Variable(i) => self.variables[i],
            Slot::Const(i) => self.consts[i],
        }
    }
}

/// Runs `step`, any but a kernel, on the host, with its slots at `at`.
///
/// # Safety
/// Every slot the step names is at `at(slot)` and holds a value of the type the schedule
/// planned for it (see [`Bindings::at`]); nothing else reads or writes them meanwhile.
pub unsafe fn run_host_step(
    step: &Step,
    at: &dyn Fn(Slot) -> *mut u8,
    scratch: &mut dfc_kernels::Scratch,
    rendezvous: Option<&dyn Rendezvous>,
) -> Result<(), InterpError> {
    // SAFETY: the function's contract.
    let read = |slot: Slot, ty: &TensorType| unsafe { read_tensor(at(slot), ty) };
    // SAFETY: the function's contract.
    let write = |slot: Slot, tensor: &Tensor, ty: &TensorType| unsafe { write_tensor(at(slot), tensor, ty) };
    let exchange = |node: &str| rendezvous.ok_or_else(|| InterpError::NoRendezvous { node: node.to_string() });
    match step {
        Step::Kernel { .. } => unreachable!("kernels run on their back end"),
        Step::MatMul { bytes, epilogue, .. } if bytes.is_some() || epilogue.is_some() => {
            // SAFETY: the caller's contract.
            unsafe { product(step, at, None) }
        }
        Step::MatMul { a, b, out, m, n, k, ta, tb, batches, update, .. } => {
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
        // SAFETY: the caller's contract.
        Step::Conv { .. } => unsafe { convolution(step, at, scratch, None) },
        Step::Pool { kind, geometry, operands, out, out_len, .. } => {
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
        Step::Norm { op, channels, operands, out, out_len, .. } => {
            let input = |i: usize| {
                let (slot, len) = operands[i];
                // SAFETY: as for convolutions: the slot holds `len` floats.
                unsafe { std::slice::from_raw_parts(at(slot) as *const f32, len) }
            };
            // SAFETY: as for convolutions; the output is none of the inputs.
            let o = unsafe { std::slice::from_raw_parts_mut(at(*out) as *mut f32, *out_len) };
            let (x, channels) = (input(0), *channels);
            let (scales, partials) = scratch
                .split(dfc_kernels::norm_scales_len(channels), dfc_kernels::norm_partials_len(x.len(), channels));
            match op {
                Op::Moments => dfc_kernels::moments(x, channels, o, partials),
                Op::BatchNorm { epsilon, .. } => dfc_kernels::batch_norm(x, input(1), channels, *epsilon, o, scales),
                Op::BatchNormGradMeans { epsilon } => {
                    dfc_kernels::batch_norm_grad_means(x, input(1), input(2), channels, *epsilon, o, scales, partials)
                }
                Op::BatchNormGrad { epsilon } => {
                    dfc_kernels::batch_norm_grad(x, input(1), input(2), input(3), channels, *epsilon, o, scales)
                }
                _ => unreachable!("normalisation steps are of these ops"),
            }
        }
        Step::Layout { node, op, element_bytes, operands, out, ty, .. } => {
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
        Step::Library { node, op, operands, out, ty, .. } => {
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
                    let kind = if matches!(op, Op::AssignAdd) { dfc_ir::BinaryOp::Add } else { dfc_ir::BinaryOp::Sub };
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
        // Numbers go as the bytes of their slots (native, here little-endian), uncopied into a
        // tensor on the way.
        Step::Send { key, value, ty } if ty.dtype != DType::Bool && cfg!(target_endian = "little") => {
            // SAFETY: the slot holds a value of `ty` (see `Bindings::at`): its bytes.
            let bytes = unsafe { std::slice::from_raw_parts(at(*value), ty.size_in_bytes()) };
            exchange(key)?.send_bytes(key, ty, bytes)?;
        }
        Step::Recv { node, key, out, ty } if ty.dtype != DType::Bool && cfg!(target_endian = "little") => {
            let (found, bytes) = exchange(node)?.recv_bytes(key)?;
            if found != *ty || bytes.len() != ty.size_in_bytes() {
                return Err(InterpError::RecvType {
                    node: node.clone(),
                    key: key.clone(),
                    expected: ty.clone(),
                    found,
                });
            }
            // SAFETY: the slot has room for a value of `ty`, `bytes` of its bytes (checked).
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), at(*out), bytes.len()) };
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
        Step::AllReduce { key, overlapped: true, .. } | Step::AllReduceWait { key, .. } => {
            return Err(InterpError::Malformed {
                node: key.clone(),
                message: "an overlapped all-reduce runs only in a native program's run".into(),
            })
        }
        Step::AllReduce { key, group_size, members, ty, overlapped: false }
            if members.len() == 1 && ty.dtype != DType::Bool && cfg!(target_endian = "little") =>
        {
            // One replica here: the sum is made in the output's own memory, not in a tensor
            // copied out of the arena and back (two copies of a whole fused gradient).
            let (replica, value, out) = members[0];
            let bytes = ty.size_in_bytes();
            if value != out {
                // SAFETY: two slots of the step, distinct (checked), each of `bytes` bytes.
                unsafe { std::ptr::copy_nonoverlapping(at(value), at(out), bytes) };
            }
            // SAFETY: the output slot holds `bytes` bytes, a number type's native (here
            // little-endian) representation, which no other step touches while this one runs.
            let sum = unsafe { std::slice::from_raw_parts_mut(at(out), bytes) };
            exchange(key)?.all_reduce_in_place(key, *group_size, replica, ty, sum)?;
        }
        Step::AllReduce { key, group_size, members, ty, overlapped: false } => {
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
    Ok(())
}

/// A convolution step (`Step::Conv`), a forward convolution's filter kept transformed in `kept` where given.
///
/// # Safety
/// As [`run_host_step`].
unsafe fn convolution(
    step: &Step,
    at: &dyn Fn(Slot) -> *mut u8,
    scratch: &mut dfc_kernels::Scratch,
    kept: Option<&mut dfc_kernels::KeptFilter>,
) {
    let Step::Conv { kind, geometry, a, b, out, out_len, pool, .. } = step else { unreachable!("a convolution") };
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
    match (kind, pool) {
        (ConvKind::Forward, Some(pool)) => {
            // SAFETY: the bias slot holds one f32 per filter (the schedule checked its type), and is not
            // the output.
            let bias = pool.bias.map(|b| unsafe { std::slice::from_raw_parts(at(b) as *const f32, g.filters) });
            let then = dfc_kernels::PoolEpilogue { bias, relu: pool.relu };
            let scratch = scratch.get(dfc_kernels::conv2d_max_pool_scratch_len(g, &pool.geometry));
            dfc_kernels::conv2d_max_pool_kept(g, &pool.geometry, x, y, then, o, scratch, kept)
        }
        (ConvKind::Forward, None) => {
            let len = match kept {
                Some(_) => dfc_kernels::conv2d_kept_scratch_len(g),
                None => dfc_kernels::conv2d_scratch_len(g),
            };
            dfc_kernels::conv2d_kept(g, x, y, o, scratch.get(len), kept)
        }
        (ConvKind::BackpropInput, _) => {
            let scratch = scratch.get(dfc_kernels::conv2d_backprop_input_scratch_len(g));
            dfc_kernels::conv2d_backprop_input(g, x, y, o, scratch)
        }
        (ConvKind::BackpropFilter, _) => {
            let scratch = scratch.get(dfc_kernels::conv2d_backprop_filter_scratch_len(g));
            dfc_kernels::conv2d_backprop_filter(g, x, y, o, scratch)
        }
    }
}

/// A product of one matrix (`Step::MatMul` with one batch) through `dfc_gemm::sgemm_kept`: fused with what
/// surrounds it (bytes read through a scale, an epilogue, an update folded into it), B read from a weight's kept
/// panels where given.
///
/// # Safety
/// As [`run_host_step`]: the shapes were checked by the interpreter's program: `a` holds m·k floats, or bytes (a u8
/// input) where `bytes` says so, `b` k·n floats, `out` m·n floats, an epilogue's bias n floats, mask m·n and column
/// sums n (a slot of its own, `Schedule`'s `column_sums`); kept panels are of B's k×n.
unsafe fn product(step: &Step, at: &dyn Fn(Slot) -> *mut u8, kept: Option<&mut dfc_gemm::KeptPanels>) {
    let Step::MatMul { a, b, out, m, n, k, ta, tb, batches, update, bytes, epilogue, b_rewritten } = step else {
        unreachable!("a product")
    };
    let [(oa, ob)] = batches[..] else { unreachable!("a fused product is a product of matrices") };
    // SAFETY: the caller's contract.
    unsafe {
        let left = match bytes {
            Some(scale) => {
                dfc_gemm::Left::Bytes(std::slice::from_raw_parts((at(*a) as *const u8).add(oa), m * k), *scale)
            }
            None => dfc_gemm::Left::Floats(std::slice::from_raw_parts((at(*a) as *const f32).add(oa), m * k)),
        };
        let b = std::slice::from_raw_parts((at(*b) as *const f32).add(ob), k * n);
        let c = std::slice::from_raw_parts_mut(at(*out) as *mut f32, m * n);
        let epilogue = epilogue.map_or(dfc_gemm::Epilogue::default(), |e| dfc_gemm::Epilogue {
            bias: e.bias.map(|bias| std::slice::from_raw_parts(at(bias) as *const f32, *n)),
            relu: e.relu,
            mask: e.mask.map(|mask| std::slice::from_raw_parts(at(mask) as *const f32, m * n)),
            col_sums: e.col_sums.map(|sums| std::slice::from_raw_parts_mut(at(sums) as *mut f32, *n)),
        });
        dfc_gemm::sgemm_kept(*m, *n, *k, left, *ta, b, *tb, c, *update, epilogue, *b_rewritten, true, kept);
    }
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
pub unsafe fn read_tensor(ptr: *const u8, ty: &TensorType) -> Tensor {
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
