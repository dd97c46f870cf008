//! NVIDIA GPUs: finding one, and loading a partition's PTX into it (the driver compiles the PTX
//! for the GPU it has, which checks it). Everything goes through cudarc with dynamic loading,
//! so that dfc builds and runs where there is no CUDA: a missing driver or GPU is an error that
//! says so, never a panic.
//!
//! Not here yet: running a partition (device memory, kernel launches, cuBLAS, NCCL) — see
//! docs/gpu.md for what is and is not done.

use cudarc::driver::{CudaContext, CudaModule, DriverError};
use dfc_plan::GpuCode;
use std::sync::Arc;

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

    /// Loads a partition's PTX, which the driver compiles for this GPU, and finds every kernel
    /// in it. `device` names the partition in errors.
    pub fn load(&self, code: &GpuCode, device: &str) -> Result<Arc<CudaModule>, CudaError> {
        let ptx = cudarc::nvrtc::Ptx::from_src(code.ptx.clone());
        let module = self.context.load_module(ptx).map_err(|source| CudaError::Ptx {
            device: device.to_string(),
            gpu: self.describe(),
            source,
        })?;
        for kernel in &code.kernels {
            module.load_function(&kernel.function).map_err(|_| CudaError::MissingKernel {
                device: device.to_string(),
                kernel: kernel.function.clone(),
            })?;
        }
        Ok(module)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_driver_opening_a_gpu_says_so() {
        if driver_present() {
            println!("SKIPPED: this machine has a CUDA driver");
            return;
        }
        assert_eq!(device_count().unwrap(), 0);
        let error = Gpu::open(0).err().expect("no GPU here");
        assert!(matches!(error, CudaError::NoDriver), "{error}");
        assert!(error.to_string().contains("libcuda.so.1"), "{error}");
    }
}
