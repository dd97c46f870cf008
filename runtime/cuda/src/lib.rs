//! NVIDIA GPUs: finding one, and loading a partition's PTX into it (the driver compiles the PTX
//! for the GPU it has, which checks it). Everything goes through cudarc with dynamic loading,
//! so that dfc builds and runs where there is no CUDA: a missing driver or GPU is an error that
//! says so, never a panic.
//!
//! `Kernels::run` runs one fused kernel (its launches: `GpuKernel::launches`) on buffers given
//! by the host: what the per-kernel tests against the interpreter (tests/kernels.rs) and the
//! bandwidth benchmark use. `emulator` runs a kernel's launches on the CPU with the GPU's
//! semantics, one call per thread of the grid. Not here yet:
//! running a whole partition (a memory pool, launches in order, cuBLAS, NCCL) — see
//! docs/gpu.md for what is and is not done.

mod device;
pub mod emulator;
pub mod program;

pub use device::DeviceKernels;

use cudarc::driver::{CudaContext, CudaModule, DevicePtr, DriverError, LaunchConfig, PushKernelArg};
use dfc_codegen::{GpuCode, GpuKernel};
use std::sync::Arc;
use std::time::Instant;

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("no NVIDIA driver: the CUDA driver library (libcuda.so.1) is not installed or not on the library path")]
    NoDriver,
    #[error("no GPU {ordinal}: this machine has {count} (CUDA_VISIBLE_DEVICES may hide some)")]
    NoDevice { ordinal: usize, count: usize },
    #[error("CUDA driver, {what}: {source}")]
    Driver {
        what: String,
        #[source]
        source: DriverError,
    },
    #[error("the PTX of {device} does not load on {gpu}: {source}")]
    Ptx {
        device: String,
        gpu: String,
        #[source]
        source: DriverError,
    },
    #[error("kernel `{kernel}` is missing from the PTX of {device}")]
    MissingKernel { device: String, kernel: String },
    #[error("kernel `{kernel}` of {device} on {gpu}, {what}: {source}")]
    Kernel {
        device: String,
        kernel: String,
        gpu: String,
        what: &'static str,
        #[source]
        source: DriverError,
    },
    #[error("kernel `{kernel}` of {device}: {message}")]
    Arguments { device: String, kernel: String, message: String },
    #[error("the grid emulator: {0}")]
    Emulator(String),
    #[error("{device}: {message}")]
    Device { device: String, message: String },
    #[error("no cuBLAS: the CUDA BLAS library (libcublas.so.12) is not installed or not on the library path; dfc's GPU partitions run their matrix products through it")]
    NoCublas,
    #[error("cuBLAS for {device}: {message}")]
    Blas { device: String, message: String },
    #[error("{device} plans {planned} of device memory, but the GPU has {} MiB free of {} MiB", free >> 20, total >> 20)]
    OutOfMemory { device: String, planned: String, free: u64, total: u64 },
}

/// Refuses arguments a kernel cannot run on: it takes one buffer per input, then its output,
/// each at least as large as its value.
fn check_arguments(kernel: &GpuKernel, buffers: &[Vec<u8>], args: &[usize], device: &str) -> Result<(), CudaError> {
    let wanted = kernel.inputs.len() + 1 + usize::from(kernel.checks);
    let small = |(&i, &bytes): (&usize, &u64)| (buffers[i].len() as u64) < bytes;
    if args.len() != wanted
        || kernel.arg_bytes.len() != wanted
        || args.iter().any(|&i| i >= buffers.len())
        || buffers.iter().any(Vec::is_empty)
        || args.iter().zip(&kernel.arg_bytes).any(small)
    {
        return Err(CudaError::Arguments {
            device: device.to_string(),
            kernel: kernel.function.clone(),
            message: format!(
                "it takes {wanted} arguments (inputs, output, status if it checks) of {:?} bytes, each one of {} non-empty buffers; given {args:?}",
                kernel.arg_bytes,
                buffers.len()
            ),
        });
    }
    Ok(())
}

fn driver(what: &str) -> impl FnOnce(DriverError) -> CudaError + '_ {
    move |source| CudaError::Driver { what: what.to_string(), source }
}

/// Whether the CUDA driver library can be loaded here.
pub fn driver_present() -> bool {
    // SAFETY: only tries to open the library; nothing is called.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// How many GPUs the driver sees (0 without a driver).
pub fn device_count() -> Result<usize, CudaError> {
    if !driver_present() {
        return Ok(0);
    }
    let count = CudaContext::device_count().map_err(driver("counting GPUs"))?;
    Ok(count.max(0) as usize)
}

/// One GPU, its primary context retained.
#[derive(Clone)]
pub struct Gpu {
    context: Arc<CudaContext>,
    ordinal: usize,
    name: String,
    capability: (i32, i32),
}

impl Gpu {
    /// GPU `ordinal` of this machine, or why there is none.
    pub fn open(ordinal: usize) -> Result<Gpu, CudaError> {
        if !driver_present() {
            return Err(CudaError::NoDriver);
        }
        let count = device_count()?;
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let context = CudaContext::new(ordinal).map_err(driver("opening the GPU"))?;
        let name = context.name().map_err(driver("reading the GPU's name"))?;
        let capability = context.compute_capability().map_err(driver("reading the GPU's architecture"))?;
        Ok(Gpu { context, ordinal, name, capability })
    }

    /// `GPU 0 (NVIDIA H100 80GB HBM3, sm_90)`.
    pub fn describe(&self) -> String {
        format!("GPU {} ({}, sm_{}{})", self.ordinal, self.name, self.capability.0, self.capability.1)
    }

    /// The memory's peak bandwidth in bytes per second: two transfers per clock (DDR) across
    /// the bus.
    pub fn peak_bandwidth(&self) -> Result<f64, CudaError> {
        use cudarc::driver::sys::CUdevice_attribute as A;
        let attribute = |a| self.context.attribute(a).map_err(driver("reading the memory's clock and bus"));
        let clock_khz = attribute(A::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE)? as f64;
        let bus_bits = attribute(A::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH)? as f64;
        Ok(2.0 * clock_khz * 1e3 * bus_bits / 8.0)
    }

    /// Loads a partition's PTX, which the driver compiles for this GPU, and finds every kernel
    /// in it. `device` names the partition in errors.
    pub fn load<'g>(&'g self, code: &GpuCode, device: &str) -> Result<Kernels<'g>, CudaError> {
        let module = self.load_module(code, device)?;
        Ok(Kernels { gpu: self, module, device: device.to_string() })
    }

    pub(crate) fn load_module(&self, code: &GpuCode, device: &str) -> Result<Arc<CudaModule>, CudaError> {
        let ptx = cudarc::nvrtc::Ptx::from_src(code.ptx.clone());
        let module = self.context.load_module(ptx).map_err(|source| CudaError::Ptx {
            device: device.to_string(),
            gpu: self.describe(),
            source,
        })?;
        let entries = code
            .kernels
            .iter()
            .flat_map(|k| std::iter::once(&k.function).chain(k.reduction.as_ref().map(|r| &r.combine)));
        for entry in entries {
            module
                .load_function(entry)
                .map_err(|_| CudaError::MissingKernel { device: device.to_string(), kernel: entry.clone() })?;
        }
        Ok(module)
    }
}

/// A partition's kernels, loaded into a GPU.
pub struct Kernels<'g> {
    gpu: &'g Gpu,
    module: Arc<CudaModule>,
    device: String,
}

impl Kernels<'_> {
    /// Runs `kernel` once over device copies of `buffers`; argument `i` of the kernel (its
    /// inputs, then its output) is buffer `args[i]`, so one buffer may be read and written (an
    /// assignment's variable). Returns every buffer's bytes after the run.
    pub fn run(&self, kernel: &GpuKernel, buffers: &[Vec<u8>], args: &[usize]) -> Result<Vec<Vec<u8>>, CudaError> {
        self.launches(kernel, buffers, args, 0).map(|(after, _)| after)
    }

    /// Seconds per launch of `kernel`, over `repeats` launches after one to warm up.
    pub fn time(
        &self,
        kernel: &GpuKernel,
        buffers: &[Vec<u8>],
        args: &[usize],
        repeats: u32,
    ) -> Result<f64, CudaError> {
        self.launches(kernel, buffers, args, repeats.max(1)).map(|(_, seconds)| seconds)
    }

    fn launches(
        &self,
        kernel: &GpuKernel,
        buffers: &[Vec<u8>],
        args: &[usize],
        timed: u32,
    ) -> Result<(Vec<Vec<u8>>, f64), CudaError> {
        let failed = |what: &'static str| {
            move |source| CudaError::Kernel {
                device: self.device.clone(),
                kernel: kernel.function.clone(),
                gpu: self.gpu.describe(),
                what,
                source,
            }
        };
        check_arguments(kernel, buffers, args, &self.device)?;
        let stream = self.gpu.context.default_stream();
        let on_device = buffers.iter().map(|b| stream.memcpy_stod(b)).collect::<Result<Vec<_>, _>>();
        let on_device = on_device.map_err(failed("copying its arguments to the GPU"))?;
        let scratch_buffers = kernel
            .scratch_bytes()
            .iter()
            .map(|&bytes| stream.alloc_zeros::<u8>(bytes.max(1) as usize))
            .collect::<Result<Vec<_>, _>>()
            .map_err(failed("allocating its scratch memory"))?;
        // Each launch's first parameter is an array of pointers, in device memory.
        let addresses: Vec<u64> = args.iter().map(|&i| on_device[i].device_ptr(&stream).0).collect();
        let scratch = [scratch_buffers[0].device_ptr(&stream).0, scratch_buffers[1].device_ptr(&stream).0];
        let mut launches = Vec::new();
        for launch in kernel.launches() {
            let function = self.module.load_function(&launch.function).map_err(failed("finding it"))?;
            let pointers: Vec<u64> = launch.buffers(&addresses, scratch);
            let table = stream.memcpy_stod(&pointers).map_err(failed("copying its argument table to the GPU"))?;
            let config =
                LaunchConfig { grid_dim: (launch.grid, 1, 1), block_dim: (launch.block, 1, 1), shared_mem_bytes: 0 };
            launches.push((function, table, launch.count, config));
        }
        let run = || {
            for (function, table, count, config) in &launches {
                let mut builder = stream.launch_builder(function);
                builder.arg(table);
                builder.arg(count);
                // SAFETY: the arguments are the entry's (`i8** args, i64 count`); every pointer
                // in the table is a live buffer of the size the kernel's types give (the
                // caller's) or its scratch (`scratch_bytes`).
                unsafe { builder.launch(*config) }?;
            }
            Ok(())
        };
        run().map_err(failed("launching it"))?;
        stream.synchronize().map_err(failed("running it"))?;
        let mut seconds = 0.0;
        if timed > 0 {
            let start = Instant::now();
            for _ in 0..timed {
                run().map_err(failed("launching it"))?;
            }
            stream.synchronize().map_err(failed("running it"))?;
            seconds = start.elapsed().as_secs_f64() / f64::from(timed);
        }
        let after = on_device.iter().map(|b| stream.memcpy_dtov(b)).collect::<Result<Vec<_>, _>>();
        Ok((after.map_err(failed("copying its results back"))?, seconds))
    }
}

#[cfg(test)]
#[path = "../../../tests/support/skip.rs"]
mod skip;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_driver_opening_a_gpu_says_so() {
        if driver_present() {
            crate::skip::skip(crate::skip::Need::NoCudaDriver, "this machine has a CUDA driver");
            return;
        }
        assert_eq!(device_count().unwrap(), 0);
        let error = Gpu::open(0).err().expect("no GPU here");
        assert!(matches!(error, CudaError::NoDriver), "{error}");
        assert!(error.to_string().contains("libcuda.so.1"), "{error}");
    }
}
