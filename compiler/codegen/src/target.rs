//! The CPU that code is generated for.

use crate::code::NativeTarget;
use crate::CodegenError;
use inkwell::targets::{CodeModel, InitializationConfig, RelocMode, Target, TargetMachine, TargetTriple};
use inkwell::OptimizationLevel;

/// This machine: LLVM's host triple, CPU name and feature string.
pub fn host_target() -> NativeTarget {
    let _ = Target::initialize_native(&InitializationConfig::default());
    NativeTarget {
        triple: TargetMachine::get_default_triple().as_str().to_string_lossy().into_owned(),
        cpu: TargetMachine::get_host_cpu_name().to_string(),
        features: TargetMachine::get_host_cpu_features().to_string(),
    }
}

pub fn target_machine(target: &NativeTarget) -> Result<TargetMachine, CodegenError> {
    Target::initialize_native(&InitializationConfig::default())
        .map_err(|message| CodegenError::Target { triple: target.triple.clone(), message })?;
    let triple = TargetTriple::create(&target.triple);
    let llvm_target = Target::from_triple(&triple)
        .map_err(|e| CodegenError::Target { triple: target.triple.clone(), message: e.to_string() })?;
    llvm_target
        .create_target_machine(
            &triple,
            &target.cpu,
            &target.features,
            OptimizationLevel::Aggressive,
            // An object that the JIT linker may load anywhere: every address absolute, 64-bit
            // (what MCJIT chose for itself).
            RelocMode::Static,
            CodeModel::Large,
        )
        .ok_or_else(|| CodegenError::Target { triple: target.triple.clone(), message: "no target machine".into() })
}
