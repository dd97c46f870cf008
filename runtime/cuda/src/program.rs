//! A GPU partition's program: the partition's `Schedule` (the CPU's planning: the steps some
//! fetches and targets need, values aliased where no copy is needed, every other value's place
//! in one arena planned by liveness) run with the GPU kernels' launches.
//!
//! It runs on a GPU (`device.rs`: device memory, launches on a stream, cuBLAS, the other steps
//! on the host) or on the grid emulator: there its arena is host memory, its kernels run
//! thread by thread as their GPU launches would (`Emulated::launch`), and every other step
//! (matrix products, convolutions, exchanges, …) runs as on the CPU
//! (`dfc_cpu::run_host_step`). So `dfc run --backend grid-emulator` trains a GPU plan on a
//! machine without a GPU with the GPU's kernels, and the tests check whole training steps of
//! GPU plans against the interpreter.

use crate::device::{DeviceKernels, DeviceRun};
use crate::emulator::{Emulated, Scratch};
use crate::CudaError;
use dfc_cpu::{Bindings, HostArena, KernelSite, Schedule, Slot, Step};
use dfc_interp::{InterpError, Rendezvous, Tensor, Variables};
use dfc_ir::{Module, NodeId, TensorRef};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The steps of a GPU partition for some fetches and targets, planned once, run many times (one
/// run at a time: runs share the arena).
pub struct GpuProgram {
    schedule: Schedule,
    engine: Engine,
}

/// A GPU partition's kernels, on a GPU or for the grid emulator.
#[derive(Clone, Debug)]
pub enum GpuKernels {
    Device(Arc<DeviceKernels>),
    Emulated(Arc<Emulated>),
}

impl GpuKernels {
    fn kernels(&self) -> &[dfc_codegen::GpuKernel] {
        match self {
            GpuKernels::Device(code) => code.kernels(),
            GpuKernels::Emulated(code) => code.kernels(),
        }
    }
}

enum Engine {
    Device(Mutex<DeviceRun>),
    Emulated { kernels: Arc<Emulated>, memory: Mutex<Memory> },
}

struct Memory {
    arena: HostArena,
    /// Reductions' partials.
    scratch: Scratch,
    /// The host's convolutions' im2col columns.
    columns: dfc_kernels::Scratch,
    /// How many kernels have run: each launch's threads are shuffled by a new seed.
    launches: u64,
}

// SAFETY: `Memory` owns its buffers; no pointer into them outlives a run, which holds the lock.
unsafe impl Send for Memory {}

impl std::fmt::Debug for GpuProgram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuProgram").field("steps", &self.schedule.steps.len()).finish()
    }
}

impl GpuProgram {
    /// The program computing `fetches` and running `targets` over `module` (a GPU partition)
    /// with `kernels` (its kernels, loaded into a GPU or compiled for the emulator), nodes in
    /// `order` (see `dfc_interp::Program::with_order`). On a GPU, its device memory is
    /// allocated here.
    pub fn new(
        module: &Module,
        kernels: &GpuKernels,
        fetches: &[TensorRef],
        targets: &[NodeId],
        order: &[NodeId],
    ) -> Result<GpuProgram, ProgramError> {
        let sites: Vec<KernelSite> = kernels
            .kernels()
            .iter()
            .map(|k| KernelSite { root: k.root, members: &k.members, inputs: &k.inputs })
            .collect();
        let schedule = Schedule::new(module, &sites, fetches, targets, order)?;
        let engine = match kernels {
            GpuKernels::Device(code) => Engine::Device(Mutex::new(DeviceRun::new(code.clone(), &schedule)?)),
            GpuKernels::Emulated(code) => {
                let memory = Memory {
                    arena: HostArena::new(schedule.arena_bytes),
                    scratch: Scratch::for_kernels(code.kernels()),
                    columns: dfc_kernels::Scratch::new(),
                    launches: 0,
                };
                Engine::Emulated { kernels: code.clone(), memory: Mutex::new(memory) }
            }
        };
        Ok(GpuProgram { schedule, engine })
    }

    /// The schedule the program runs.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// The inputs the program needs.
    pub fn inputs(&self) -> Vec<String> {
        self.schedule.feeds.iter().map(|f| f.0.clone()).collect()
    }

    /// Runs the program on `feeds`, updating `variables` in place, exchanging tensors through
    /// `rendezvous`; returns the fetched values.
    pub fn run(
        &self,
        variables: &mut Variables,
        feeds: &HashMap<String, Tensor>,
        rendezvous: Option<&dyn Rendezvous>,
    ) -> Result<Vec<Tensor>, InterpError> {
        let bindings = Bindings::new(&self.schedule, variables, feeds)?;
        let (kernels, memory) = match &self.engine {
            Engine::Device(run) => {
                let mut run = run.lock().unwrap_or_else(|e| e.into_inner());
                return run.run(&self.schedule, &bindings, rendezvous);
            }
            Engine::Emulated { kernels, memory } => (kernels, memory),
        };
        let mut memory = memory.lock().unwrap_or_else(|e| e.into_inner());
        let memory = &mut *memory;
        let base = memory.arena.base();
        let at = |slot: Slot| bindings.at(base, slot);
        for step in &self.schedule.steps {
            if let Step::Kernel { kernel, args } = step {
                let described = &kernels.kernels()[*kernel];
                let pointers: Vec<*mut u8> = args.iter().map(|s| at(*s)).collect();
                memory.launches += 1;
                // SAFETY: `args` holds the kernel's buffers in its order, each a slot planned
                // for the kernel's types (see `Bindings::at`); the arena and scratch are this
                // run's alone (the lock).
                unsafe { kernels.launch(described, &pointers, &mut memory.scratch, memory.launches) }
                    .map_err(|e| launch_error(e, described.function.as_str()))?;
                continue;
            }
            // SAFETY: every slot of the schedule holds a value of the type the schedule planned
            // for it (see `Bindings::at`).
            unsafe { dfc_cpu::run_host_step(step, &at, &mut memory.columns, rendezvous)? };
        }
        // SAFETY: as above.
        Ok(self.schedule.fetches.iter().map(|(slot, ty)| unsafe { dfc_cpu::read_tensor(at(*slot), ty) }).collect())
    }
}

fn launch_error(error: CudaError, kernel: &str) -> InterpError {
    InterpError::Device { device: "the grid emulator".to_string(), message: format!("kernel `{kernel}`: {error}") }
}

/// Why a GPU program could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ProgramError {
    #[error(transparent)]
    Schedule(#[from] dfc_cpu::CpuError),
    #[error(transparent)]
    Device(#[from] CudaError),
}
