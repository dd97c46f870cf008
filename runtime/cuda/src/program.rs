//! A GPU partition's program: the partition's `Schedule` (the CPU's planning: the steps some
//! fetches and targets need, values aliased where no copy is needed, every other value's place
//! in one arena planned by liveness) run with the GPU kernels' launches.
//!
//! It runs through `device.rs`'s `DeviceRun` on a GPU (device memory, launches on a stream,
//! cuBLAS, the other steps on the host) or on the grid emulator's model of one (memory apart
//! from the host's, kernels run thread by thread as their GPU launches would, GEMMs by dfc's):
//! one run loop for both, so that `dfc run --backend grid-emulator` trains a GPU plan with the
//! GPU's kernels and memory traffic on a machine without a GPU, and the tests check whole
//! training steps of GPU plans against the interpreter.

use crate::device::DeviceRun;
pub use crate::device::{GpuKernels, GpuPartition};
use crate::CudaError;
use dfc_cpu::{Bindings, KernelSite, Schedule};
use dfc_interp::{InterpError, Rendezvous, Tensor, Variables};
use dfc_ir::{Module, NodeId, TensorRef};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The steps of a GPU partition for some fetches and targets, planned once, run many times (one
/// run at a time).
pub struct GpuProgram {
    schedule: Schedule,
    run: Mutex<DeviceRun>,
}

impl std::fmt::Debug for GpuProgram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuProgram").field("steps", &self.schedule.steps.len()).finish()
    }
}

impl GpuProgram {
    /// The program computing `fetches` and running `targets` over `module` (a GPU partition,
    /// whose device and resident variables are `partition`) with `kernels` (its kernels, loaded
    /// into that GPU or compiled for the emulator), nodes in `order` (see
    /// `dfc_interp::Program::with_order`). Its device memory is allocated here.
    pub fn new(
        module: &Module,
        partition: &Arc<GpuPartition>,
        kernels: &GpuKernels,
        fetches: &[TensorRef],
        targets: &[NodeId],
        order: &[NodeId],
        training: bool,
    ) -> Result<GpuProgram, ProgramError> {
        let sites: Vec<KernelSite> = kernels
            .kernels()
            .iter()
            .map(|k| KernelSite { root: k.root, members: &k.members, inputs: &k.inputs })
            .collect();
        let schedule = Schedule::floats_only(module, &sites, fetches, targets, order, training)?;
        let run = DeviceRun::new(partition.clone(), kernels, &schedule)?;
        Ok(GpuProgram { schedule, run: Mutex::new(run) })
    }

    /// The schedule the program runs.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// The steps that run on the host, by kind (everything the device has no kernel for:
    /// exchanges, all-reduces, ops no kernel covers).
    pub fn host_steps(&self) -> Vec<String> {
        self.run.lock().unwrap_or_else(|e| e.into_inner()).host_steps(&self.schedule)
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
        self.run.lock().unwrap_or_else(|e| e.into_inner()).run(&self.schedule, &bindings, rendezvous)
    }
}

/// Why a GPU program could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ProgramError {
    #[error(transparent)]
    Schedule(#[from] dfc_cpu::CpuError),
    #[error(transparent)]
    Device(#[from] CudaError),
}
