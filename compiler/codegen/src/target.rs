//! The CPU that code is generated for.

use crate::CodegenError;
use dfc_plan::NativeTarget;
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

/// The features code for `target` uses that `host` lacks (`+avx512f` …), and a differing
/// triple first if there is one: empty when code for `target` runs on `host`.
pub fn missing_features(target: &NativeTarget, host: &NativeTarget) -> Vec<String> {
    let mut missing = Vec::new();
    if target.triple != host.triple {
        missing.push(format!("triple {}", target.triple));
    }
    let has: std::collections::HashSet<&str> = host.features.split(',').filter_map(|f| f.strip_prefix('+')).collect();
    for feature in target.features.split(',').filter_map(|f| f.strip_prefix('+')) {
        if !has.contains(feature) {
            missing.push(feature.to_string());
        }
    }
    missing
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
            RelocMode::Default,
            CodeModel::JITDefault,
        )
        .ok_or_else(|| CodegenError::Target { triple: target.triple.clone(), message: "no target machine".into() })
}
