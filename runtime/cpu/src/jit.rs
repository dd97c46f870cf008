//! JIT compilation of a partition's bitcode through LLVM's MCJIT, once per distinct bitcode
//! per process.

use crate::CpuError;
use dfc_plan::NativeCode;
use inkwell::context::Context;
use inkwell::memory_buffer::MemoryBuffer;
use inkwell::module::Module;
use inkwell::OptimizationLevel;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// `kernel(args, begin, end)`: see `dfc_codegen`.
pub type KernelFn = unsafe extern "C" fn(*const *mut u8, i64, i64);

/// The machine code of one partition's kernels, by function name.
#[derive(Debug)]
pub struct Jitted {
    functions: HashMap<String, usize>,
}

impl Jitted {
    pub fn function(&self, name: &str) -> Option<KernelFn> {
        // SAFETY: every address was returned by MCJIT for a function of type `KernelFn`.
        self.functions.get(name).map(|&address| unsafe { std::mem::transmute::<usize, KernelFn>(address) })
    }
}

/// The code of `native`, compiled on first use. The LLVM context and engine of a compiled
/// bitcode live as long as the process (they are shared by every session that loads it).
pub fn load(native: &NativeCode) -> Result<Arc<Jitted>, CpuError> {
    static CACHE: OnceLock<Mutex<HashMap<u64, Arc<Jitted>>>> = OnceLock::new();
    let key = dfc_interp::fnv1a_64(&native.bitcode);
    let cache = CACHE.get_or_init(Default::default);
    let mut cache = cache.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(found) = cache.get(&key) {
        return Ok(found.clone());
    }
    let jitted = Arc::new(compile(native)?);
    cache.insert(key, jitted.clone());
    Ok(jitted)
}

fn compile(native: &NativeCode) -> Result<Jitted, CpuError> {
    inkwell::targets::Target::initialize_native(&Default::default()).map_err(CpuError::Jit)?;
    let context: &'static Context = Box::leak(Box::new(Context::create()));
    let buffer = MemoryBuffer::create_from_memory_range_copy(&native.bitcode, "plan");
    let module = Module::parse_bitcode_from_buffer(&buffer, context)
        .map_err(|e| CpuError::Jit(format!("the plan's bitcode does not load: {e}")))?;
    let engine =
        module.create_jit_execution_engine(OptimizationLevel::Aggressive).map_err(|e| CpuError::Jit(e.to_string()))?;
    let mut functions = HashMap::new();
    for kernel in &native.kernels {
        let address = engine
            .get_function_address(&kernel.function)
            .map_err(|e| CpuError::Jit(format!("kernel `{}`: {e}", kernel.function)))?;
        functions.insert(kernel.function.clone(), address);
    }
    // The code must stay mapped for the functions' addresses.
    std::mem::forget(engine);
    Ok(Jitted { functions })
}
