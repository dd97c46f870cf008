//! A GPU partition's schedule on a GPU: its arena, scratch, feeds, variables and constants in
//! device memory (allocated once, when the program is made, so that a run allocates nothing),
//! its fused kernels launched on one stream with their argument tables prepared in device
//! memory, matrix products through cuBLAS, copies on the device, and every other step
//! (convolutions, pooling, layout ops, exchanges, all-reduces) on the host: its operands copied
//! down, the CPU's implementation run, its results copied up.
//!
//! A run copies the feeds and the variables up first and the variables it assigns down last:
//! the session keeps variables on the host (checkpoints, mirrors, fetches read them there).
//! Variables resident on the GPU between runs are the next step.
//!
//! Written against cudarc's driver and cuBLAS bindings; no GPU was lent to the sessions that
//! wrote it, so it has not run (docs/gpu.md). The same schedule and kernels run in CI on the
//! grid emulator (`program.rs`).

use crate::{CudaError, Gpu};
use cudarc::cublas::sys::cublasOperation_t;
use cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DriverError, LaunchConfig, PushKernelArg,
};
use dfc_codegen::{GpuCode, GpuKernel, LaunchBuffer};
use dfc_cpu::{Bindings, HostArena, Schedule, Slot, Step};
use dfc_interp::{InterpError, Rendezvous, Tensor};
use dfc_ir::Module;
use std::sync::Arc;

/// A GPU partition's kernels loaded into a GPU: what its programs launch.
pub struct DeviceKernels {
    gpu: Gpu,
    module: Arc<CudaModule>,
    code: GpuCode,
    /// Per kernel, the name of the node it computes, for messages.
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
    /// Loads `code` (the PTX of `partition`, placed on `device`) into `gpu`, every entry found.
    pub fn load(gpu: &Gpu, code: GpuCode, partition: &Module, device: &str) -> Result<DeviceKernels, CudaError> {
        if !cublas_present() {
            return Err(CudaError::NoCublas);
        }
        let module = gpu.load_module(&code, device)?;
        let roots = code.kernels.iter().map(|k| partition.graph.node(k.root).name.clone()).collect();
        Ok(DeviceKernels { gpu: gpu.clone(), module, code, roots, device: device.to_string() })
    }

    pub fn kernels(&self) -> &[GpuKernel] {
        &self.code.kernels
    }

    pub fn describe(&self) -> String {
        format!("partition {} on {}", self.device, self.gpu.describe())
    }
}

/// Whether cuBLAS can be loaded here.
fn cublas_present() -> bool {
    // SAFETY: only tries to open the library; nothing is called.
    unsafe { cudarc::cublas::sys::is_culib_present() }
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

/// Device memory and launches of one program.
pub(crate) struct DeviceRun {
    kernels: Arc<DeviceKernels>,
    stream: Arc<CudaStream>,
    blas: cudarc::cublas::CudaBlas,
    /// Owned device buffers (freed with the run) and their addresses.
    _buffers: Vec<CudaSlice<u8>>,
    arena: u64,
    feeds: Vec<u64>,
    variables: Vec<u64>,
    consts: Vec<u64>,
    /// Per step, a kernel step's launches (empty for other steps).
    launches: Vec<Vec<Prepared>>,
    /// The variables some step writes, copied down after a run.
    written: Vec<usize>,
    /// The host's copy of the arena, for steps that run on the host.
    host: HostArena,
    /// The host's convolutions' im2col columns.
    columns: std::sync::Mutex<dfc_kernels::Scratch>,
}

// SAFETY: the raw device addresses are of buffers the run owns; a run uses them under the
// program's lock, from one thread at a time.
unsafe impl Send for DeviceRun {}

impl DeviceRun {
    /// Device memory for `schedule` (the arena, reductions' scratch, feeds, variables and
    /// constants) and its kernels' launches prepared. Refuses, naming the planned bytes, a
    /// schedule that does not fit the GPU's free memory.
    pub(crate) fn new(kernels: Arc<DeviceKernels>, schedule: &Schedule) -> Result<DeviceRun, CudaError> {
        let gpu = &kernels.gpu;
        let failed = |what: &'static str| {
            let device = kernels.describe();
            move |source: DriverError| CudaError::Driver { what: format!("{device}, {what}"), source }
        };
        gpu.context.bind_to_thread().map_err(failed("binding its context"))?;
        let stream = gpu.context.new_stream().map_err(failed("making a stream"))?;
        let blas = cudarc::cublas::CudaBlas::new(stream.clone())
            .map_err(|e| CudaError::Blas { device: kernels.describe(), message: e.to_string() })?;
        let scratch = [0, 1].map(|i| kernels.kernels().iter().map(|k| k.scratch_bytes()[i]).max().unwrap_or(0));
        let sizes = Planned {
            arena: schedule.arena_bytes as u64,
            scratch: scratch[0] + scratch[1],
            feeds: schedule.feeds.iter().map(|f| f.1.size_in_bytes() as u64).sum(),
            variables: schedule.variables.iter().map(|v| v.1.size_in_bytes() as u64).sum(),
            consts: schedule.consts.iter().map(|c| c.ty().size_in_bytes() as u64).sum(),
        };
        let (free, total) = cudarc::driver::result::mem_get_info().map_err(failed("reading its free memory"))?;
        if sizes.total() > free as u64 {
            return Err(CudaError::OutOfMemory {
                device: kernels.describe(),
                planned: sizes.describe(),
                free: free as u64,
                total: total as u64,
            });
        }
        let mut buffers = Vec::new();
        let mut allocate = |bytes: u64| -> Result<u64, CudaError> {
            let buffer = stream.alloc_zeros::<u8>(bytes.max(1) as usize).map_err(|_| CudaError::OutOfMemory {
                device: kernels.describe(),
                planned: sizes.describe(),
                free: free as u64,
                total: total as u64,
            })?;
            let address = buffer.device_ptr(&stream).0;
            buffers.push(buffer);
            Ok(address)
        };
        let arena = allocate(sizes.arena)?;
        let scratch = [allocate(scratch[0])?, allocate(scratch[1])?];
        let feeds = schedule.feeds.iter().map(|f| allocate(f.1.size_in_bytes() as u64)).collect::<Result<_, _>>()?;
        let variables =
            schedule.variables.iter().map(|v| allocate(v.1.size_in_bytes() as u64)).collect::<Result<_, _>>()?;
        let consts: Vec<u64> =
            schedule.consts.iter().map(|c| allocate(c.ty().size_in_bytes() as u64)).collect::<Result<_, _>>()?;
        let mut run = DeviceRun {
            kernels: kernels.clone(),
            stream,
            blas,
            _buffers: buffers,
            arena,
            feeds,
            variables,
            consts,
            launches: Vec::new(),
            written: Vec::new(),
            host: HostArena::new(schedule.arena_bytes),
            columns: std::sync::Mutex::new(dfc_kernels::Scratch::new()),
        };
        for (constant, &address) in schedule.consts.iter().zip(&run.consts) {
            let bytes = constant.to_le_bytes();
            // SAFETY: `address` is a buffer of the constant's size, allocated above; the copy
            // completes before `bytes` is dropped (synchronised below).
            unsafe { cudarc::driver::result::memcpy_htod_async(address, &bytes, run.stream.cu_stream()) }
                .map_err(failed("copying a constant to the GPU"))?;
            run.stream.synchronize().map_err(failed("copying a constant to the GPU"))?;
        }
        for step in &schedule.steps {
            let prepared = match step {
                Step::Kernel { kernel, args } => run.prepare(*kernel, args, scratch)?,
                _ => Vec::new(),
            };
            run.launches.push(prepared);
            // Assignment kernels write their variable too: `reads_writes`, not `accesses`.
            for slot in step.reads_writes().1 {
                if let Slot::Variable(i) = slot {
                    run.written.push(i);
                }
            }
        }
        run.written.sort_unstable();
        run.written.dedup();
        Ok(run)
    }

    /// The launches of `kernel` over `args` (slots), their tables in device memory.
    fn prepare(&self, index: usize, args: &[Slot], scratch: [u64; 2]) -> Result<Vec<Prepared>, CudaError> {
        let kernel = &self.kernels.kernels()[index];
        let name = format!("`{}` (computing `{}`)", kernel.function, self.kernels.roots[index]);
        let failed = |what: &'static str| {
            let device = self.kernels.device.clone();
            let kernel = kernel.function.clone();
            let gpu = self.kernels.gpu.describe();
            move |source: DriverError| CudaError::Kernel { device, kernel, gpu, what, source }
        };
        kernel
            .launches()
            .into_iter()
            .map(|launch| {
                let function = self.kernels.module.load_function(&launch.function).map_err(failed("finding it"))?;
                let table: Vec<u64> = launch
                    .args
                    .iter()
                    .map(|buffer| match *buffer {
                        LaunchBuffer::Arg(i) => self.address(args[i]),
                        LaunchBuffer::Scratch(s) => scratch[s],
                    })
                    .collect();
                let table = self.stream.memcpy_stod(&table).map_err(failed("copying its argument table"))?;
                let config = LaunchConfig {
                    grid_dim: (launch.grid, 1, 1),
                    block_dim: (launch.block, 1, 1),
                    shared_mem_bytes: 0,
                };
                Ok(Prepared { function, table, count: launch.count, config, name: name.clone() })
            })
            .collect()
    }

    /// The device address of `slot`.
    fn address(&self, slot: Slot) -> u64 {
        match slot {
            Slot::Arena(offset) => self.arena + offset as u64,
            Slot::Feed(i) => self.feeds[i],
            Slot::Variable(i) => self.variables[i],
            Slot::Const(i) => self.consts[i],
        }
    }

    fn device_error(&self, what: impl std::fmt::Display) -> InterpError {
        InterpError::Device { device: self.kernels.describe(), message: what.to_string() }
    }

    /// Runs `schedule` (the one this run was made for) with `bindings` (its host values).
    pub(crate) fn run(
        &mut self,
        schedule: &Schedule,
        bindings: &Bindings,
        rendezvous: Option<&dyn Rendezvous>,
    ) -> Result<Vec<Tensor>, InterpError> {
        // The raw driver and cuBLAS calls below act on the thread's current context.
        self.kernels
            .gpu
            .context
            .bind_to_thread()
            .map_err(|e| self.device_error(format!("binding its context: {e}")))?;
        let host_base = self.host.base();
        let host = |slot: Slot| bindings.at(host_base, slot);
        let stream = self.stream.cu_stream();
        // Feeds and variables up.
        for (i, (_, ty)) in schedule.feeds.iter().enumerate() {
            self.upload(host(Slot::Feed(i)), self.feeds[i], ty.size_in_bytes())?;
        }
        for (i, (_, ty)) in schedule.variables.iter().enumerate() {
            self.upload(host(Slot::Variable(i)), self.variables[i], ty.size_in_bytes())?;
        }
        let mut columns = self.columns.lock().unwrap_or_else(|e| e.into_inner());
        for (step, launches) in schedule.steps.iter().zip(&self.launches) {
            match step {
                Step::Kernel { .. } => {
                    for launch in launches {
                        let mut builder = self.stream.launch_builder(&launch.function);
                        builder.arg(&launch.table);
                        builder.arg(&launch.count);
                        // SAFETY: the entry takes (`i8** args`, `i64 count`); the table holds
                        // the device addresses of the kernel's buffers, each allocated for the
                        // value the schedule planned there, or its scratch, sized for it.
                        unsafe { builder.launch(launch.config) }
                            .map_err(|e| self.device_error(format!("launching kernel {}: {e}", launch.name)))?;
                    }
                }
                Step::MatMul { a, b, out, m, n, k, ta, tb, batches, update } => {
                    let (alpha, beta) = match update {
                        Some(alpha) => (*alpha, 1.0f32),
                        None => (1.0, 0.0),
                    };
                    let operation =
                        |t: bool| if t { cublasOperation_t::CUBLAS_OP_T } else { cublasOperation_t::CUBLAS_OP_N };
                    let (lda, ldb) = (if *ta { *m } else { *k }, if *tb { *k } else { *n });
                    for (bi, &(oa, ob)) in batches.iter().enumerate() {
                        let a = self.address(*a) + 4 * oa as u64;
                        let b = self.address(*b) + 4 * ob as u64;
                        let c = self.address(*out) + 4 * (bi * m * n) as u64;
                        // Row-major C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: cuBLAS
                        // computes the product with the operands swapped.
                        // SAFETY: the addresses are of device buffers holding the operands'
                        // f32 values (the schedule's slots), the offsets within them as on the
                        // CPU; the handle's stream is this run's.
                        unsafe {
                            cudarc::cublas::result::sgemm(
                                *self.blas.handle(),
                                operation(*tb),
                                operation(*ta),
                                *n as i32,
                                *m as i32,
                                *k as i32,
                                &alpha,
                                b as *const f32,
                                ldb as i32,
                                a as *const f32,
                                lda as i32,
                                &beta,
                                c as *mut f32,
                                *n as i32,
                            )
                        }
                        .map_err(|e| self.device_error(format!("a matrix product through cuBLAS: {e}")))?;
                    }
                }
                Step::Copy { from, to, bytes } => {
                    // SAFETY: distinct device buffers of `bytes` each (the schedule's slots).
                    unsafe {
                        cudarc::driver::result::memcpy_dtod_async(
                            self.address(*to),
                            self.address(*from),
                            *bytes,
                            stream,
                        )
                    }
                    .map_err(|e| self.device_error(format!("a copy on the GPU: {e}")))?;
                }
                other => self.on_host(other, &host, &mut columns, rendezvous)?,
            }
        }
        // Fetches and assigned variables down.
        let mut fetched = Vec::with_capacity(schedule.fetches.len());
        for (slot, ty) in &schedule.fetches {
            if matches!(slot, Slot::Arena(_) | Slot::Variable(_)) {
                self.download(self.address(*slot), host(*slot), ty.size_in_bytes())?;
            }
            // SAFETY: the host's copy of the slot holds the fetched value (just copied down,
            // or a feed or constant, which live on the host).
            fetched.push(unsafe { dfc_cpu::read_tensor(host(*slot), ty) });
        }
        for &i in &self.written {
            self.download(self.variables[i], host(Slot::Variable(i)), schedule.variables[i].1.size_in_bytes())?;
        }
        Ok(fetched)
    }

    /// A step with no GPU implementation, on the host: what it reads copied down, the CPU's
    /// implementation run, what it writes copied up.
    fn on_host(
        &self,
        step: &Step,
        host: &dyn Fn(Slot) -> *mut u8,
        columns: &mut dfc_kernels::Scratch,
        rendezvous: Option<&dyn Rendezvous>,
    ) -> Result<(), InterpError> {
        let (reads, writes) = step.accesses();
        for (slot, bytes) in reads {
            if matches!(slot, Slot::Arena(_) | Slot::Variable(_)) {
                self.download(self.address(slot), host(slot), bytes)?;
            }
        }
        // SAFETY: the host's copies of the step's slots hold its operands (copied down above,
        // or feeds and constants, which live on the host), each of its planned type.
        unsafe { dfc_cpu::run_host_step(step, host, columns, rendezvous)? };
        for (slot, bytes) in writes {
            self.upload(host(slot), self.address(slot), bytes)?;
        }
        Ok(())
    }

    fn upload(&self, from: *const u8, to: u64, bytes: usize) -> Result<(), InterpError> {
        // SAFETY: `from` is the host's copy of a value of `bytes` bytes (a slot's), `to` a device
        // buffer of that size; the copy completes before returning (synchronised).
        let source = unsafe { std::slice::from_raw_parts(from, bytes) };
        // SAFETY: as above.
        unsafe { cudarc::driver::result::memcpy_htod_async(to, source, self.stream.cu_stream()) }
            .and_then(|_| self.stream.synchronize())
            .map_err(|e| self.device_error(format!("copying {bytes} bytes to the GPU: {e}")))
    }

    fn download(&self, from: u64, to: *mut u8, bytes: usize) -> Result<(), InterpError> {
        // SAFETY: `to` is the host's copy of a value of `bytes` bytes (a slot's), `from` a device
        // buffer of that size; the copy completes before returning (synchronised), after
        // everything launched before it on the stream.
        let target = unsafe { std::slice::from_raw_parts_mut(to, bytes) };
        // SAFETY: as above.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(target, from, self.stream.cu_stream()) }
            .and_then(|_| self.stream.synchronize())
            .map_err(|e| self.device_error(format!("copying {bytes} bytes from the GPU: {e}")))
    }
}

/// Device memory a program plans, by kind.
struct Planned {
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
