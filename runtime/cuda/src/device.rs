//! A GPU partition's schedule on a device: its arena, scratch, feeds and constants in device
//! memory (allocated once, when the program is made, so that a run allocates nothing), its
//! fused kernels and op kernels (convolutions' im2col and col2im, pooling, layout ops)
//! launched with their arguments prepared then, matrix products and convolutions' products as
//! GEMMs, copies on the device, and every other step (`scatter_add`, ops no kernel covers,
//! exchanges, all-reduces) on the host: its operands copied down, the CPU's implementation
//! run, its results copied up. Kernels that check what they read (a gather's indices) report
//! in statuses read once at the end of a run.
//!
//! Variables are resident on the device ([`GpuPartition`], one per GPU partition, shared by
//! its programs): a run copies up only those whose host copy is newer, and down only what it
//! fetches; the session copies the device's newer values down when it needs them
//! (checkpoints, a worker's reply).
//!
//! [`DeviceRun`] is that run, over a [`Device`]: a GPU ([`Cuda`]: cudarc's driver, one stream,
//! cuBLAS), or the grid emulator's model of one ([`EmulatedDevice`]: memory of its own, apart
//! from the host's, kernels run thread by thread, GEMMs by dfc's). The emulated device runs in
//! CI, so all of the run but `Cuda`'s few calls is tested there; `Cuda` has not run yet, as no
//! GPU was lent to the sessions that wrote it (docs/gpu.md).

use crate::emulator::Emulated;
use crate::{CudaError, Gpu};
use cudarc::cublas::sys::cublasOperation_t;
use cudarc::driver::{CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use dfc_codegen::{GpuCode, GpuKernel, STATUS_BYTES};
use dfc_cpu::{Bindings, ConvKind, HostArena, Schedule, Slot, Step};
use dfc_interp::{InterpError, Rendezvous, Tensor};
use dfc_ir::NodeId;
use std::sync::Arc;

/// A GPU partition's kernels loaded into a GPU: what its programs launch.
pub struct DeviceKernels {
    gpu: Gpu,
    module: Arc<CudaModule>,
    code: GpuCode,
    /// Per kernel, the node it computes and where it is in the source, for messages:
    /// `` `loss` at mlp.df:21 ``.
    roots: Vec<String>,
    /// The partition, for messages.
    device: String,
}

impl std::fmt::Debug for DeviceKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceKernels").field("device", &self.device).field("gpu", &self.gpu.describe()).finish()
    }
}

impl DeviceKernels {
    /// Loads `code` (the PTX of a partition placed on `device`) into `gpu`, every entry found;
    /// `describe` says what a kernel's root is and where it is in the source, for messages.
    pub fn load(
        gpu: &Gpu,
        code: GpuCode,
        device: &str,
        describe: &dyn Fn(NodeId) -> String,
    ) -> Result<DeviceKernels, CudaError> {
        if !cublas_present() {
            return Err(CudaError::NoCublas);
        }
        let module = gpu.load_module(&code, device)?;
        let launchable = code.kernels.iter().chain(&code.ops);
        let roots = launchable.map(|k| describe(k.root)).collect();
        Ok(DeviceKernels { gpu: gpu.clone(), module, code, roots, device: device.to_string() })
    }

    pub fn kernels(&self) -> &[GpuKernel] {
        &self.code.kernels
    }

    pub fn ops(&self) -> &[GpuKernel] {
        &self.code.ops
    }

    fn launchable(&self, index: usize) -> &GpuKernel {
        crate::emulator::launchable(&self.code, index)
    }

    pub fn describe(&self) -> String {
        format!("partition {} on {}", self.device, self.gpu.describe())
    }
}

/// A GPU partition's kernels, on a GPU or for the grid emulator.
#[derive(Clone, Debug)]
pub enum GpuKernels {
    Device(Arc<DeviceKernels>),
    Emulated(Arc<Emulated>),
}

impl GpuKernels {
    /// The fused kernels, one per `dfc_passes::fuse` kernel.
    pub fn kernels(&self) -> &[GpuKernel] {
        match self {
            GpuKernels::Device(code) => code.kernels(),
            GpuKernels::Emulated(code) => code.kernels(),
        }
    }

    /// The op kernels (`GpuCode::ops`): convolutions' im2col and col2im, pooling, layout ops.
    pub fn ops(&self) -> &[GpuKernel] {
        match self {
            GpuKernels::Device(code) => code.ops(),
            GpuKernels::Emulated(code) => code.ops(),
        }
    }
}

/// Whether cuBLAS can be loaded here.
fn cublas_present() -> bool {
    // SAFETY: only tries to open the library; nothing is called.
    unsafe { cudarc::cublas::sys::is_culib_present() }
}

/// A GEMM of f32 matrices at device addresses, row-major: `c = α·op(a)·op(b) + β·c`, `op(a)`
/// m×k, `op(b)` k×n.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Gemm {
    pub a: u64,
    pub b: u64,
    pub c: u64,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub ta: bool,
    pub tb: bool,
    pub alpha: f32,
    pub beta: f32,
}

/// What a GPU program's memory and launches are on. Addresses are the device's; every call
/// but `alloc` and `prepare` is on the stream of a run, in order.
pub(crate) trait Device: Send {
    /// `partition … on …`, for messages.
    fn describe(&self) -> String;
    /// Refuses device memory of `planned` bytes that the device cannot give.
    fn check_fits(&self, planned: &Planned) -> Result<(), CudaError>;
    /// Device memory of `bytes` (at least one), zeroed; its address. It lives as long as the device.
    fn alloc(&mut self, bytes: u64) -> Result<u64, CudaError>;
    /// Kernel `kernel` of `kernels`' launches over its arguments at `args` and the scratch at
    /// `scratch`, ready for `launch`: a handle.
    fn prepare(
        &mut self,
        kernels: &GpuKernels,
        kernel: usize,
        args: Vec<u64>,
        scratch: [u64; 2],
    ) -> Result<usize, CudaError>;
    /// Makes the device current on this thread, before a run.
    fn begin(&self) -> Result<(), String>;
    fn upload(&self, to: u64, from: &[u8]) -> Result<(), String>;
    fn download(&self, from: u64, to: &mut [u8]) -> Result<(), String>;
    fn copy(&self, from: u64, to: u64, bytes: usize) -> Result<(), String>;
    fn launch(&mut self, prepared: usize) -> Result<(), String>;
    fn gemm(&self, gemm: Gemm) -> Result<(), String>;
}

/// A GPU: cudarc's driver, one stream, cuBLAS.
pub(crate) struct Cuda {
    gpu: Gpu,
    /// `partition … on GPU …`, for messages.
    description: String,
    stream: Arc<CudaStream>,
    blas: cudarc::cublas::CudaBlas,
    buffers: Vec<CudaSlice<u8>>,
    prepared: Vec<Vec<Prepared>>,
}

// SAFETY: cudarc's stream, buffers and cuBLAS handle are used from one thread at a time (a
// run holds the program's lock), each call after binding the context to that thread (`begin`).
unsafe impl Send for Cuda {}

impl Cuda {
    pub(crate) fn new(kernels: &DeviceKernels) -> Result<Cuda, CudaError> {
        let description = kernels.describe();
        let failed = |what: &str| {
            let what = format!("{description}, {what}");
            move |source| CudaError::Driver { what, source }
        };
        let gpu = kernels.gpu.clone();
        gpu.context.bind_to_thread().map_err(failed("binding its context"))?;
        let stream = gpu.context.new_stream().map_err(failed("making a stream"))?;
        let blas = cudarc::cublas::CudaBlas::new(stream.clone())
            .map_err(|e| CudaError::Blas { device: description.clone(), message: e.to_string() })?;
        Ok(Cuda { gpu, description, stream, blas, buffers: Vec::new(), prepared: Vec::new() })
    }

    fn synchronize(&self) -> Result<(), String> {
        self.stream.synchronize().map_err(|e| e.to_string())
    }
}

impl Device for Cuda {
    fn describe(&self) -> String {
        self.description.clone()
    }

    fn check_fits(&self, planned: &Planned) -> Result<(), CudaError> {
        let (free, total) = cudarc::driver::result::mem_get_info().map_err(|source| CudaError::Driver {
            what: format!("{}, reading its free memory", self.describe()),
            source,
        })?;
        if planned.total() > free as u64 {
            return Err(CudaError::OutOfMemory {
                device: self.describe(),
                planned: planned.describe(),
                free: free as u64,
                total: total as u64,
            });
        }
        Ok(())
    }

    fn alloc(&mut self, bytes: u64) -> Result<u64, CudaError> {
        let buffer = self.stream.alloc_zeros::<u8>(bytes.max(1) as usize).map_err(|source| CudaError::Driver {
            what: format!("{}, allocating {bytes} bytes", self.describe()),
            source,
        })?;
        let address = buffer.device_ptr(&self.stream).0;
        self.buffers.push(buffer);
        Ok(address)
    }

    fn prepare(
        &mut self,
        kernels: &GpuKernels,
        index: usize,
        args: Vec<u64>,
        scratch: [u64; 2],
    ) -> Result<usize, CudaError> {
        let GpuKernels::Device(kernels) = kernels else {
            return Err(CudaError::Device {
                device: self.describe(),
                message: "kernels compiled for the grid emulator, not for this GPU".to_string(),
            });
        };
        let kernel = kernels.launchable(index);
        let name = format!("`{}` (computing {})", kernel.function, kernels.roots[index]);
        let failed = |what: &'static str| {
            let (device, kernel, gpu) = (kernels.device.clone(), kernel.function.clone(), kernels.gpu.describe());
            move |source| CudaError::Kernel { device, kernel, gpu, what, source }
        };
        let mut prepared = Vec::new();
        for launch in kernel.launches() {
            let function = kernels.module.load_function(&launch.function).map_err(failed("finding it"))?;
            let table: Vec<u64> = launch.buffers(&args, scratch);
            let table = self.stream.memcpy_stod(&table).map_err(failed("copying its argument table"))?;
            let config =
                LaunchConfig { grid_dim: (launch.grid, 1, 1), block_dim: (launch.block, 1, 1), shared_mem_bytes: 0 };
            prepared.push(Prepared { function, table, count: launch.count, config, name: name.clone() });
        }
        self.prepared.push(prepared);
        Ok(self.prepared.len() - 1)
    }

    fn begin(&self) -> Result<(), String> {
        self.gpu.context.bind_to_thread().map_err(|e| format!("binding its context: {e}"))
    }

    fn upload(&self, to: u64, from: &[u8]) -> Result<(), String> {
        // SAFETY: `to` is a device buffer of at least `from.len()` bytes (the caller's: a
        // slot's); the copy completes before returning (synchronised), while `from` lives.
        unsafe { cudarc::driver::result::memcpy_htod_async(to, from, self.stream.cu_stream()) }
            .map_err(|e| e.to_string())?;
        self.synchronize()
    }

    fn download(&self, from: u64, to: &mut [u8]) -> Result<(), String> {
        // SAFETY: `from` is a device buffer of at least `to.len()` bytes (a slot's); the copy
        // completes before returning (synchronised), after everything before it on the stream.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(to, from, self.stream.cu_stream()) }
            .map_err(|e| e.to_string())?;
        self.synchronize()
    }

    fn copy(&self, from: u64, to: u64, bytes: usize) -> Result<(), String> {
        // SAFETY: distinct device buffers of `bytes` each (the schedule's slots).
        unsafe { cudarc::driver::result::memcpy_dtod_async(to, from, bytes, self.stream.cu_stream()) }
            .map_err(|e| e.to_string())
    }

    fn launch(&mut self, prepared: usize) -> Result<(), String> {
        for launch in &self.prepared[prepared] {
            let mut builder = self.stream.launch_builder(&launch.function);
            builder.arg(&launch.table);
            builder.arg(&launch.count);
            // SAFETY: the entry takes (`i8** args`, `i64 count`); the table holds the device
            // addresses of the kernel's buffers, each allocated for the value the schedule
            // planned there, or its scratch, sized for it.
            unsafe { builder.launch(launch.config) }.map_err(|e| format!("launching kernel {}: {e}", launch.name))?;
        }
        Ok(())
    }

    fn gemm(&self, g: Gemm) -> Result<(), String> {
        let operation = |t: bool| if t { cublasOperation_t::CUBLAS_OP_T } else { cublasOperation_t::CUBLAS_OP_N };
        let (lda, ldb) = (if g.ta { g.m } else { g.k }, if g.tb { g.k } else { g.n });
        // Row-major C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: cuBLAS computes the
        // product with the operands swapped.
        // SAFETY: the addresses are of device buffers holding the operands' f32 values (the
        // schedule's slots, offsets within them as on the CPU); the handle's stream is the run's.
        unsafe {
            cudarc::cublas::result::sgemm(
                *self.blas.handle(),
                operation(g.tb),
                operation(g.ta),
                g.n as i32,
                g.m as i32,
                g.k as i32,
                &g.alpha,
                g.b as *const f32,
                ldb as i32,
                g.a as *const f32,
                lda as i32,
                &g.beta,
                g.c as *mut f32,
                g.n as i32,
            )
        }
        .map_err(|e| format!("a matrix product through cuBLAS: {e}"))
    }
}

/// A kernel of some emulated kernels, its argument addresses and scratch: ready to launch.
type EmulatedLaunch = (Arc<Emulated>, usize, Vec<u64>, [u64; 2]);

/// The grid emulator's model of a GPU: memory of its own (host memory, apart from the
/// session's), kernels run thread by thread (`Emulated::launch`), GEMMs by dfc's. Addresses are
/// host addresses of its buffers.
pub(crate) struct EmulatedDevice {
    buffers: Vec<Vec<u128>>,
    prepared: Vec<EmulatedLaunch>,
    /// Launches so far: each launch's threads are shuffled by a new seed.
    launches: u64,
}

impl EmulatedDevice {
    pub(crate) fn new() -> EmulatedDevice {
        EmulatedDevice { buffers: Vec::new(), prepared: Vec::new(), launches: 0 }
    }
}

impl Device for EmulatedDevice {
    fn describe(&self) -> String {
        "the grid emulator".to_string()
    }

    fn check_fits(&self, _: &Planned) -> Result<(), CudaError> {
        Ok(())
    }

    fn alloc(&mut self, bytes: u64) -> Result<u64, CudaError> {
        // Zeroed, as `Cuda`'s (cudarc's `alloc_zeros`).
        let mut buffer = vec![0u128; (bytes.max(1) as usize).div_ceil(16)];
        let address = buffer.as_mut_ptr() as u64;
        self.buffers.push(buffer);
        Ok(address)
    }

    fn prepare(
        &mut self,
        kernels: &GpuKernels,
        kernel: usize,
        args: Vec<u64>,
        scratch: [u64; 2],
    ) -> Result<usize, CudaError> {
        let GpuKernels::Emulated(kernels) = kernels else {
            return Err(CudaError::Emulator("kernels loaded into a GPU, not compiled for the emulator".to_string()));
        };
        self.prepared.push((kernels.clone(), kernel, args, scratch));
        Ok(self.prepared.len() - 1)
    }

    fn begin(&self) -> Result<(), String> {
        Ok(())
    }

    fn upload(&self, to: u64, from: &[u8]) -> Result<(), String> {
        // SAFETY: `to` is one of this device's buffers with room for `from` (a slot's), which
        // is host memory apart from it.
        unsafe { std::ptr::copy_nonoverlapping(from.as_ptr(), to as *mut u8, from.len()) };
        Ok(())
    }

    fn download(&self, from: u64, to: &mut [u8]) -> Result<(), String> {
        // SAFETY: as for `upload`, the other way.
        unsafe { std::ptr::copy_nonoverlapping(from as *const u8, to.as_mut_ptr(), to.len()) };
        Ok(())
    }

    fn copy(&self, from: u64, to: u64, bytes: usize) -> Result<(), String> {
        // SAFETY: distinct buffers of this device of `bytes` each (the schedule's slots).
        unsafe { std::ptr::copy_nonoverlapping(from as *const u8, to as *mut u8, bytes) };
        Ok(())
    }

    fn launch(&mut self, prepared: usize) -> Result<(), String> {
        let (kernels, kernel, args, scratch) = &self.prepared[prepared];
        let pointers: Vec<*mut u8> = args.iter().map(|&a| a as *mut u8).collect();
        self.launches += 1;
        // SAFETY: the arguments are this device's buffers holding the kernel's values (the
        // schedule's slots), the scratch sized for its kernels; a run is the only user.
        unsafe {
            kernels.launch(
                kernels.launchable(*kernel),
                &pointers,
                [scratch[0] as *mut u8, scratch[1] as *mut u8],
                self.launches,
            )
        }
        .map_err(|e| e.to_string())
    }

    fn gemm(&self, g: Gemm) -> Result<(), String> {
        let (a_len, b_len, c_len) = (g.m * g.k, g.k * g.n, g.m * g.n);
        // SAFETY: the addresses are this device's buffers holding the operands' f32 values
        // (the schedule's slots); `c` overlaps neither operand (a product's output is its own
        // slot, or a folded update's variable, which its operands do not read).
        let (a, b, c) = unsafe {
            (
                std::slice::from_raw_parts(g.a as *const f32, a_len),
                std::slice::from_raw_parts(g.b as *const f32, b_len),
                std::slice::from_raw_parts_mut(g.c as *mut f32, c_len),
            )
        };
        if g.beta == 0.0 && g.alpha == 1.0 {
            dfc_gemm::sgemm(g.m, g.n, g.k, a, g.ta, b, g.tb, c, false, true);
        } else {
            dfc_gemm::sgemm_update(g.m, g.n, g.k, g.alpha, a, g.ta, b, g.tb, c, true);
        }
        Ok(())
    }
}

/// One kernel launch, ready: its function, its argument table in device memory.
struct Prepared {
    function: CudaFunction,
    table: CudaSlice<u64>,
    count: u64,
    config: LaunchConfig,
    /// `kernel (root node)`, for messages.
    name: String,
}

/// A GPU partition's device, which all its programs share, with the partition's variables
/// resident there: a program's run copies up only the variables the host's copy of which is
/// newer (the session initialised, restored or wrote them), and copies down only what a host
/// step reads or the run fetches: the session asks for the device's newer values when it reads
/// its variables ([`GpuPartition::download_newer`]).
pub struct GpuPartition {
    state: std::sync::Mutex<PartitionState>,
}

struct PartitionState {
    device: Box<dyn Device>,
    /// Each variable on the device, by name.
    variables: std::collections::HashMap<String, Resident>,
}

struct Resident {
    address: u64,
    bytes: usize,
    newer: Newer,
}

/// Which copy of a variable was written last.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Newer {
    Host,
    Device,
    Neither,
}

impl std::fmt::Debug for GpuPartition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuPartition").finish_non_exhaustive()
    }
}

impl GpuPartition {
    /// The device that `kernels` are for: the GPU they were loaded into (a stream and cuBLAS
    /// on it), or the grid emulator's model of one.
    pub fn new(kernels: &GpuKernels) -> Result<GpuPartition, CudaError> {
        let device: Box<dyn Device> = match kernels {
            GpuKernels::Device(code) => Box::new(Cuda::new(code)?),
            GpuKernels::Emulated(_) => Box::new(EmulatedDevice::new()),
        };
        Ok(GpuPartition { state: std::sync::Mutex::new(PartitionState { device, variables: Default::default() }) })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, PartitionState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Copies into `host` (the session's copies of the partition's variables, or a copy of
    /// them) every value the device holds newer; with `in_sync`, `host` is the session's own,
    /// which then holds what the device does.
    pub fn download_newer(&self, host: &mut dfc_interp::Variables, in_sync: bool) -> Result<(), InterpError> {
        let mut state = self.state();
        let state = &mut *state;
        for (name, resident) in state.variables.iter_mut().filter(|(_, r)| r.newer == Newer::Device) {
            let Some(tensor) = host.get_mut(name) else { continue };
            let mut bytes = vec![0u8; resident.bytes];
            state.device.begin().and_then(|_| state.device.download(resident.address, &mut bytes)).map_err(|e| {
                InterpError::Device { device: state.device.describe(), message: format!("copying `{name}` down: {e}") }
            })?;
            *tensor = Tensor::from_le_bytes(&tensor.ty(), &bytes).ok_or_else(|| InterpError::Device {
                device: state.device.describe(),
                message: format!("`{name}` copied down is not a value of its type"),
            })?;
            if in_sync {
                resident.newer = Newer::Neither;
            }
        }
        Ok(())
    }

    /// The session wrote the host's copies of every variable: runs copy them up first.
    pub fn host_wrote(&self) {
        for resident in self.state().variables.values_mut() {
            resident.newer = Newer::Host;
        }
    }
}

/// A program's run on its partition's device: the schedule's memory there (variables shared
/// with the partition's other programs), its kernels prepared.
pub(crate) struct DeviceRun {
    partition: Arc<GpuPartition>,
    arena: u64,
    /// The columns of the convolutions (and gradients) that run on the device.
    columns: u64,
    /// The statuses of the checking kernels (`GpuKernel::checks`), `STATUS_BYTES` each, and
    /// the node of each with its table's rows.
    status: u64,
    checked: Vec<(String, usize)>,
    feeds: Vec<u64>,
    /// Per schedule variable, its name and address (the partition's).
    variables: Vec<(String, u64)>,
    consts: Vec<u64>,
    /// Per step, a kernel step's prepared launches.
    launches: Vec<Option<usize>>,
    /// The variables some step writes.
    written: Vec<usize>,
    /// The host's copy of the arena, for steps that run on the host and for fetches.
    host: HostArena,
    /// The host's convolutions' im2col columns.
    host_columns: dfc_kernels::Scratch,
}

impl DeviceRun {
    /// Device memory for `schedule` (the arena, reductions' scratch, feeds and constants, and
    /// the variables it uses that the partition has not placed yet; refused, naming the planned
    /// bytes, where the device has too little), the constants copied up, and `kernels`'
    /// launches prepared.
    pub(crate) fn new(
        partition: Arc<GpuPartition>,
        kernels: &GpuKernels,
        schedule: &Schedule,
    ) -> Result<DeviceRun, CudaError> {
        let shared = partition.clone();
        let mut state = shared.state();
        let state = &mut *state;
        let device = &mut state.device;
        let all = || kernels.kernels().iter().chain(kernels.ops());
        let scratch_bytes = [0, 1].map(|i| all().map(|k| k.scratch_bytes()[i]).max().unwrap_or(0));
        let new_variables = schedule.variables.iter().filter(|(name, _)| !state.variables.contains_key(name));
        // Convolutions and their gradients with an im2col or col2im kernel run on the device,
        // their columns in one buffer.
        let on_device = |step: &Step| match step {
            Step::Conv { node, .. }
            | Step::Pool { node, .. }
            | Step::Norm { node, .. }
            | Step::Layout { id: node, .. }
            | Step::Library { id: node, .. } => kernels.ops().iter().position(|k| k.root == *node),
            _ => None,
        };
        // Per step whose kernel checks what it reads, its status's place among the statuses.
        let mut checked = Vec::new();
        for (at, step) in schedule.steps.iter().enumerate() {
            let Some(j) = on_device(step) else { continue };
            if !kernels.ops()[j].checks {
                continue;
            }
            // The rows an index must fall within: a gather's table's, a scatter's output's.
            match step {
                Step::Layout { node, operands, .. } => {
                    checked.push((at, (node.clone(), operands[0].1.shape.dims().first().copied().unwrap_or(0))));
                }
                Step::Library { node, op: dfc_ir::Op::ScatterAdd { rows }, .. } => {
                    checked.push((at, (node.clone(), *rows)));
                }
                _ => {}
            }
        }
        let status_bytes = checked.len() as u64 * STATUS_BYTES;
        let columns_bytes = schedule
            .steps
            .iter()
            .filter(|step| on_device(step).is_some())
            .map(|step| match step {
                Step::Conv { geometry: g, .. } => 4 * (g.rows() * g.patch_len()) as u64,
                _ => 0,
            })
            .max()
            .unwrap_or(0);
        let planned = Planned {
            arena: schedule.arena_bytes as u64,
            scratch: scratch_bytes[0] + scratch_bytes[1] + columns_bytes + status_bytes,
            feeds: schedule.feeds.iter().map(|f| f.1.size_in_bytes() as u64).sum(),
            variables: new_variables.map(|v| v.1.size_in_bytes() as u64).sum(),
            consts: schedule.consts.iter().map(|c| c.ty().size_in_bytes() as u64).sum(),
        };
        device.check_fits(&planned)?;
        let arena = device.alloc(planned.arena)?;
        let scratch = [device.alloc(scratch_bytes[0])?, device.alloc(scratch_bytes[1])?];
        let columns = device.alloc(columns_bytes)?;
        let status = device.alloc(status_bytes)?;
        let feeds =
            schedule.feeds.iter().map(|f| device.alloc(f.1.size_in_bytes() as u64)).collect::<Result<Vec<_>, _>>()?;
        let consts = schedule
            .consts
            .iter()
            .map(|c| device.alloc(c.ty().size_in_bytes() as u64))
            .collect::<Result<Vec<_>, _>>()?;
        let mut variables = Vec::with_capacity(schedule.variables.len());
        for (name, ty) in &schedule.variables {
            let bytes = ty.size_in_bytes();
            let resident = match state.variables.get(name) {
                Some(resident) => resident,
                None => {
                    let address = device.alloc(bytes as u64)?;
                    state.variables.entry(name.clone()).or_insert(Resident { address, bytes, newer: Newer::Host })
                }
            };
            if resident.bytes != bytes {
                return Err(CudaError::Device {
                    device: device.describe(),
                    message: format!("variable `{name}` is {bytes} bytes here but {} on the device", resident.bytes),
                });
            }
            variables.push((name.clone(), resident.address));
        }
        let description = device.describe();
        let failed = |message: String| CudaError::Device { device: description.clone(), message };
        device.begin().map_err(&failed)?;
        for (constant, &address) in schedule.consts.iter().zip(&consts) {
            device.upload(address, &constant.to_le_bytes()).map_err(&failed)?;
        }
        let address = |slot: Slot| match slot {
            Slot::Arena(offset) => arena + offset as u64,
            Slot::Feed(i) => feeds[i],
            Slot::Variable(i) => variables[i].1,
            Slot::Const(i) => consts[i],
        };
        let mut launches = Vec::with_capacity(schedule.steps.len());
        let mut written = Vec::new();
        for (at, step) in schedule.steps.iter().enumerate() {
            launches.push(match (step, on_device(step)) {
                (Step::Kernel { kernel, args }, _) => {
                    Some(device.prepare(kernels, *kernel, args.iter().map(|&slot| address(slot)).collect(), scratch)?)
                }
                (Step::Conv { kind, a, out, .. }, Some(j)) => {
                    let index = kernels.kernels().len() + j;
                    let args = match kind {
                        ConvKind::BackpropInput => vec![columns, address(*out)],
                        _ => vec![address(*a), columns],
                    };
                    Some(device.prepare(kernels, index, args, scratch)?)
                }
                (Step::Pool { operands, out, .. } | Step::Norm { operands, out, .. }, Some(j)) => {
                    let index = kernels.kernels().len() + j;
                    let args = operands.iter().map(|o| address(o.0)).chain([address(*out)]).collect();
                    Some(device.prepare(kernels, index, args, scratch)?)
                }
                (Step::Layout { operands, out, .. } | Step::Library { operands, out, .. }, Some(j)) => {
                    let index = kernels.kernels().len() + j;
                    let own_status = checked.iter().position(|c| c.0 == at).map(|i| status + i as u64 * STATUS_BYTES);
                    let args = operands.iter().map(|o| address(o.0)).chain([address(*out)]).chain(own_status).collect();
                    Some(device.prepare(kernels, index, args, scratch)?)
                }
                _ => None,
            });
            // Assignment kernels write their variable too: `reads_writes`, not `accesses`.
            for slot in step.reads_writes().1 {
                if let Slot::Variable(i) = slot {
                    written.push(i);
                }
            }
        }
        written.sort_unstable();
        written.dedup();
        Ok(DeviceRun {
            partition,
            arena,
            columns,
            status,
            checked: checked.into_iter().map(|c| c.1).collect(),
            feeds,
            variables,
            consts,
            launches,
            written,
            host: HostArena::new(schedule.arena_bytes),
            host_columns: dfc_kernels::Scratch::new(),
        })
    }

    /// The steps of `schedule` (the one this run was made for) that run on the host, by kind
    /// (`Step::kind`): every step but kernels, products, convolutions and ops with a kernel of
    /// their own, and copies.
    pub(crate) fn host_steps(&self, schedule: &Schedule) -> Vec<String> {
        schedule
            .steps
            .iter()
            .zip(&self.launches)
            .filter(|(step, launch)| match step {
                Step::Kernel { .. } | Step::MatMul { .. } | Step::Copy { .. } => false,
                _ => launch.is_none(),
            })
            .map(|(step, _)| step.kind())
            .collect()
    }

    /// The device address of `slot`.
    fn address(&self, slot: Slot) -> u64 {
        match slot {
            Slot::Arena(offset) => self.arena + offset as u64,
            Slot::Feed(i) => self.feeds[i],
            Slot::Variable(i) => self.variables[i].1,
            Slot::Const(i) => self.consts[i],
        }
    }

    /// Runs `schedule` (the one this run was made for) with `bindings` (its host values).
    pub(crate) fn run(
        &mut self,
        schedule: &Schedule,
        bindings: &Bindings,
        rendezvous: Option<&dyn Rendezvous>,
    ) -> Result<Vec<Tensor>, InterpError> {
        let partition = self.partition.clone();
        let mut state = partition.state();
        let state = &mut *state;
        let mut run = Running { run: self, device: &mut *state.device, bindings };
        let fetched = run.steps(schedule, &mut state.variables, rendezvous);
        // Whatever happened, the device may hold newer values of the variables the steps write.
        for &i in &self.written {
            if let Some(resident) = state.variables.get_mut(&self.variables[i].0) {
                resident.newer = Newer::Device;
            }
        }
        fetched
    }
}

/// A run in progress: the program's memory, the partition's device, the host's values.
struct Running<'r> {
    run: &'r mut DeviceRun,
    device: &'r mut dyn Device,
    bindings: &'r Bindings,
}

impl Running<'_> {
    fn host(&mut self, slot: Slot) -> *mut u8 {
        self.bindings.at(self.run.host.base(), slot)
    }

    fn error(&self, message: String) -> InterpError {
        InterpError::Device { device: self.device.describe(), message }
    }

    fn steps(
        &mut self,
        schedule: &Schedule,
        resident: &mut std::collections::HashMap<String, Resident>,
        rendezvous: Option<&dyn Rendezvous>,
    ) -> Result<Vec<Tensor>, InterpError> {
        self.device.begin().map_err(|e| self.error(e))?;
        let zeros = vec![0u8; self.run.checked.len() * STATUS_BYTES as usize];
        if !zeros.is_empty() {
            self.device.upload(self.run.status, &zeros).map_err(|e| self.error(format!("zeroing statuses: {e}")))?;
        }
        // Feeds up, and the variables whose host copies are newer.
        for (i, (_, ty)) in schedule.feeds.iter().enumerate() {
            self.upload(Slot::Feed(i), ty.size_in_bytes())?;
        }
        for (i, (name, ty)) in schedule.variables.iter().enumerate() {
            let variable = resident.get_mut(name).expect("placed when the program was made");
            if variable.newer == Newer::Host {
                self.upload(Slot::Variable(i), ty.size_in_bytes())?;
                variable.newer = Newer::Neither;
            }
        }
        for (at, step) in schedule.steps.iter().enumerate() {
            match step {
                Step::Kernel { .. }
                | Step::Pool { .. }
                | Step::Norm { .. }
                | Step::Layout { .. }
                | Step::Library { .. }
                    if self.run.launches[at].is_some() =>
                {
                    let prepared = self.run.launches[at].expect("checked");
                    self.device.launch(prepared).map_err(|e| self.error(e))?;
                }
                Step::MatMul { a, b, out, m, n, k, ta, tb, batches, update, bytes: _, epilogue: _, b_rewritten: _ } => {
                    // `Schedule::floats_only`: A holds floats, and no epilogue follows.
                    let (alpha, beta) = match update {
                        Some(alpha) => (*alpha, 1.0f32),
                        None => (1.0, 0.0),
                    };
                    for (bi, &(oa, ob)) in batches.iter().enumerate() {
                        let gemm = Gemm {
                            a: self.run.address(*a) + 4 * oa as u64,
                            b: self.run.address(*b) + 4 * ob as u64,
                            c: self.run.address(*out) + 4 * (bi * m * n) as u64,
                            m: *m,
                            n: *n,
                            k: *k,
                            ta: *ta,
                            tb: *tb,
                            alpha,
                            beta,
                        };
                        self.device.gemm(gemm).map_err(|e| self.error(e))?;
                    }
                }
                Step::Conv { kind, geometry: g, a, b, out, .. } if self.run.launches[at].is_some() => {
                    let kernel = self.run.launches[at].expect("checked");
                    self.convolution(*kind, g, [*a, *b, *out], kernel)?;
                }
                Step::Copy { from, to, bytes } => {
                    let (from, to) = (self.run.address(*from), self.run.address(*to));
                    self.device.copy(from, to, *bytes).map_err(|e| self.error(format!("a copy: {e}")))?;
                }
                other => self.on_host(other, rendezvous)?,
            }
        }
        self.check_statuses()?;
        // Fetches down (variables stay on the device).
        let mut fetched = Vec::with_capacity(schedule.fetches.len());
        for (slot, ty) in &schedule.fetches {
            if matches!(slot, Slot::Arena(_) | Slot::Variable(_)) {
                self.download(*slot, ty.size_in_bytes())?;
            }
            let at = self.host(*slot);
            // SAFETY: the host's copy of the slot holds the fetched value (just copied down,
            // or a feed or constant, which live on the host), of its type.
            fetched.push(unsafe { dfc_cpu::read_tensor(at, ty) });
        }
        Ok(fetched)
    }

    /// A convolution or one of its gradients on the device, `slots` its `[a, b, out]` (see
    /// `Step::Conv`), `kernel` its prepared im2col or col2im launch. A convolution: im2col,
    /// then the columns times the filter. A filter's gradient: im2col, then the columns,
    /// transposed, times the output's gradient. An input's gradient: the output's gradient
    /// times the filter, transposed, into columns, then col2im.
    fn convolution(
        &mut self,
        kind: ConvKind,
        g: &dfc_kernels::Conv2dGeometry,
        slots: [Slot; 3],
        kernel: usize,
    ) -> Result<(), InterpError> {
        let [a, b, out] = slots.map(|slot| self.run.address(slot));
        let columns = self.run.columns;
        let gemm = |a, b, c, m, n, k, ta, tb| Gemm { a, b, c, m, n, k, ta, tb, alpha: 1.0, beta: 0.0 };
        let (before, product) = match kind {
            ConvKind::Forward => (true, gemm(columns, b, out, g.rows(), g.filters, g.patch_len(), false, false)),
            ConvKind::BackpropFilter => (true, gemm(columns, b, out, g.patch_len(), g.filters, g.rows(), true, false)),
            ConvKind::BackpropInput => (false, gemm(b, a, columns, g.rows(), g.patch_len(), g.filters, false, true)),
        };
        if before {
            self.device.launch(kernel).map_err(|e| self.error(e))?;
        }
        self.device.gemm(product).map_err(|e| self.error(e))?;
        if !before {
            self.device.launch(kernel).map_err(|e| self.error(e))?;
        }
        Ok(())
    }

    /// The checking kernels' statuses, read once at the end of the run (a read is a wait for
    /// the device): the first that met an index out of range is an error naming its node.
    fn check_statuses(&mut self) -> Result<(), InterpError> {
        if self.run.checked.is_empty() {
            return Ok(());
        }
        let mut words = vec![0u8; self.run.checked.len() * STATUS_BYTES as usize];
        self.device.download(self.run.status, &mut words).map_err(|e| self.error(format!("reading statuses: {e}")))?;
        for ((node, rows), status) in self.run.checked.iter().zip(words.chunks_exact(STATUS_BYTES as usize)) {
            let word = |i: usize| u64::from_le_bytes(status[8 * i..8 * i + 8].try_into().expect("8 bytes"));
            if word(0) != 0 {
                // Word 1 holds the index's bits (sign-extended to 64).
                let index = word(1) as i64;
                return Err(InterpError::IndexOutOfRange { node: node.clone(), index, size: *rows });
            }
        }
        Ok(())
    }

    /// A step with no device implementation, on the host: what it reads copied down, the CPU's
    /// implementation run, what it writes copied up.
    fn on_host(&mut self, step: &Step, rendezvous: Option<&dyn Rendezvous>) -> Result<(), InterpError> {
        let (reads, writes) = step.accesses();
        for (slot, bytes) in reads {
            if matches!(slot, Slot::Arena(_) | Slot::Variable(_)) {
                self.download(slot, bytes)?;
            }
        }
        let (bindings, base) = (self.bindings, self.run.host.base());
        let host = |slot: Slot| bindings.at(base, slot);
        // SAFETY: the host's copies of the step's slots hold its operands (copied down above,
        // or feeds and constants, which live on the host), each of its planned type.
        unsafe { dfc_cpu::run_host_step(step, &host, &mut self.run.host_columns, rendezvous)? };
        for (slot, bytes) in writes {
            self.upload(slot, bytes)?;
        }
        Ok(())
    }

    /// Copies the host's copy of `slot` (`bytes`) to the device.
    fn upload(&mut self, slot: Slot, bytes: usize) -> Result<(), InterpError> {
        let from = self.host(slot);
        // SAFETY: `from` is the host's copy of the slot's value, of `bytes` bytes (see
        // `Bindings::at`), alive for the run.
        let source = unsafe { std::slice::from_raw_parts(from, bytes) };
        self.device
            .upload(self.run.address(slot), source)
            .map_err(|e| self.error(format!("copying {bytes} bytes to the device: {e}")))
    }

    /// Copies `slot` (`bytes`) from the device to the host's copy of it.
    fn download(&mut self, slot: Slot, bytes: usize) -> Result<(), InterpError> {
        let to = self.host(slot);
        // SAFETY: `to` is the host's copy of the slot's value, of `bytes` bytes (see
        // `Bindings::at`), alive for the run and written by nothing else meanwhile.
        let target = unsafe { std::slice::from_raw_parts_mut(to, bytes) };
        self.device
            .download(self.run.address(slot), target)
            .map_err(|e| self.error(format!("copying {bytes} bytes from the device: {e}")))
    }
}

/// Device memory a program plans, by kind.
pub(crate) struct Planned {
    arena: u64,
    scratch: u64,
    feeds: u64,
    variables: u64,
    consts: u64,
}

impl Planned {
    fn total(&self) -> u64 {
        self.arena + self.scratch + self.feeds + self.variables + self.consts
    }

    fn describe(&self) -> String {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        format!(
            "{:.1} MiB (arena {:.1}, variables {:.1}, feeds {:.1}, reductions' scratch {:.1}, constants {:.1})",
            mib(self.total()),
            mib(self.arena),
            mib(self.variables),
            mib(self.feeds),
            mib(self.scratch),
            mib(self.consts)
        )
    }
}
