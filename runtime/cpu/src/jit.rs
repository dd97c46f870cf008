//! Linking a partition's kernels into the process, once per distinct code per process, freed
//! when no session uses it any more.
//!
//! [`load_partition`] generates the code of a partition (from its verified IR, through the
//! disk cache, `dfc_codegen::CodeCache`) as object files and links them into the process with
//! LLVM's ORC JIT (`LLJIT`): loading cached code is a link, not a compilation.
//! [`load_partitions`] compiles and links the partitions a session runs together, so that the
//! kernels they share are compiled once. Sessions that load the same partitions share their
//! linked code: the in-memory table holds it weakly, by its cache key (compared in full), so a
//! worker that serves registration after registration keeps only the code its live
//! registrations use.

use crate::CpuError;
use dfc_codegen::{CacheKey, CodeCache, NativeCode, NativeKernel, NativeTarget, Origin};
use dfc_ir::{Module, NodeId};
use llvm_sys::error::{LLVMDisposeErrorMessage, LLVMErrorRef, LLVMGetErrorMessage};
use llvm_sys::orc2::lljit::{
    LLVMOrcCreateLLJIT, LLVMOrcDisposeLLJIT, LLVMOrcLLJITAddObjectFile, LLVMOrcLLJITGetGlobalPrefix,
    LLVMOrcLLJITGetMainJITDylib, LLVMOrcLLJITLookup, LLVMOrcLLJITRef,
};
use llvm_sys::orc2::{LLVMOrcCreateDynamicLibrarySearchGeneratorForProcess, LLVMOrcJITDylibAddGenerator};
use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::sync::{Arc, Mutex, OnceLock, Weak};

/// `kernel(args, begin, end)`: see `dfc_codegen`.
pub type KernelFn = unsafe extern "C" fn(*const *mut u8, i64, i64);

/// `phase(args, count, thread, shared, phase)`: a phase of a thread of a GPU kernel with
/// barriers, compiled for the grid emulator (`dfc_codegen::PHASE_SUFFIX`).
pub type PhaseFn = unsafe extern "C" fn(*const *mut u8, i64, i64, *mut u8, i32);

/// One ORC JIT instance holding a group of partitions' linked code; disposing of it unmaps the
/// code.
struct Linked(LLVMOrcLLJITRef);

// SAFETY: an LLJIT is thread-safe (its execution session locks), and `Linked` only disposes
// of it, once, in `drop`, after every user of its code (holders of an `Arc<Jitted>`, each of
// which holds the `Arc<Group>` that owns the `Linked`) is gone.
unsafe impl Send for Linked {}
// SAFETY: no method of `Linked` is callable through `&Linked`.
unsafe impl Sync for Linked {}

impl Drop for Linked {
    fn drop(&mut self) {
        // SAFETY: `self.0` was made by `LLVMOrcCreateLLJIT` and is disposed of only here.
        let error = unsafe { LLVMOrcDisposeLLJIT(self.0) };
        let _ = take_error(error);
    }
}

/// The linked code of partitions compiled together (those one session runs), shared by each.
struct Group {
    key: CacheKey,
    /// Per distinct partition of the group, its kernel table.
    partitions: Vec<Vec<NativeKernel>>,
    functions: HashMap<String, usize>,
    /// Whether the code came from the disk cache.
    origin: Origin,
    /// Keeps the functions' code mapped.
    _linked: Linked,
}

/// The machine code of one partition's kernels, by function name, and the kernel table.
pub struct Jitted {
    group: Arc<Group>,
    /// Which of the group's partitions this is.
    index: usize,
}

impl std::fmt::Debug for Jitted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Jitted")
            .field("key", &self.group.key.hex())
            .field("partition", &self.index)
            .field("kernels", &self.kernels().len())
            .finish()
    }
}

impl Jitted {
    pub fn function(&self, name: &str) -> Option<KernelFn> {
        if name.ends_with(dfc_codegen::PHASE_SUFFIX) {
            return None;
        }
        // SAFETY: every address was looked up in the linked objects for a function that codegen
        // emitted with the signature `KernelFn` (all but the phase functions, whose names end in
        // `PHASE_SUFFIX`, refused above), and the group's `_linked`, which `self` keeps alive,
        // keeps its code mapped.
        self.group.functions.get(name).map(|&address| unsafe { std::mem::transmute::<usize, KernelFn>(address) })
    }

    /// A phase function of the grid emulator's code (its name ends in
    /// `dfc_codegen::PHASE_SUFFIX`).
    pub fn phase_function(&self, name: &str) -> Option<PhaseFn> {
        if !name.ends_with(dfc_codegen::PHASE_SUFFIX) {
            return None;
        }
        // SAFETY: codegen emits the functions whose names end in `PHASE_SUFFIX` (which no other
        // name does) with the signature `PhaseFn`; the code stays mapped as for `function`.
        self.group.functions.get(name).map(|&address| unsafe { std::mem::transmute::<usize, PhaseFn>(address) })
    }

    /// One per fused kernel (`dfc_passes::fuse`), with its function's name.
    pub fn kernels(&self) -> &[NativeKernel] {
        &self.group.partitions[self.index]
    }

    /// Whether the code was read from the disk cache rather than generated now.
    pub fn origin(&self) -> Origin {
        self.group.origin
    }
}

/// The kernels of `module` (a verified CPU partition) for `target`, keeping the nodes of
/// `keep` as kernel roots: shared with any live session that loaded the same, else from the
/// disk cache or generated, then linked.
pub fn load_partition(
    cache: &CodeCache,
    module: &Module,
    keep: &[NodeId],
    target: &NativeTarget,
) -> Result<Arc<Jitted>, CpuError> {
    Ok(load_partitions(cache, &[(module, keep)], target)?.remove(0))
}

/// The kernels of several verified CPU partitions, compiled and linked together, so that a
/// kernel they have in common is compiled once (`dfc_codegen::compile_group`): one per part.
/// Parts alike but for their names (data parallelism's replicas) get one `Jitted`. The group
/// is shared with any live session that loaded the same, else from the disk cache or
/// generated, then linked.
pub fn load_partitions(
    cache: &CodeCache,
    parts: &[(&Module, &[NodeId])],
    target: &NativeTarget,
) -> Result<Vec<Arc<Jitted>>, CpuError> {
    // The distinct parts (with their key material), and which each part is.
    let mut seen: HashMap<Vec<u8>, usize> = HashMap::new();
    let mut distinct: Vec<(&Module, &[NodeId])> = Vec::new();
    let mut materials: Vec<Vec<u8>> = Vec::new();
    let which: Vec<usize> = parts
        .iter()
        .map(|&(module, keep)| {
            let material = CacheKey::partition_material(module, keep);
            *seen.entry(material.clone()).or_insert_with(|| {
                distinct.push((module, keep));
                materials.push(material);
                distinct.len() - 1
            })
        })
        .collect();
    let key = CacheKey::native_of(&materials, target);
    let group = {
        // Holding the lock while generating keeps two sessions from generating the same code twice.
        let mut live = live_table().lock().unwrap_or_else(|e| e.into_inner());
        live.retain(|_, group| group.strong_count() > 0);
        match live.get(key.digest()).and_then(Weak::upgrade).filter(|found| found.key == key) {
            Some(found) => found,
            None => {
                let (code, origin) =
                    cache.native_group(&key, &distinct, target).map_err(|e| CpuError::Jit(e.to_string()))?;
                let group = Arc::new(link(key, code, origin)?);
                live.insert(*group.key.digest(), Arc::downgrade(&group));
                group
            }
        }
    };
    let jitted: Vec<Arc<Jitted>> =
        (0..distinct.len()).map(|index| Arc::new(Jitted { group: Arc::clone(&group), index })).collect();
    Ok(which.into_iter().map(|i| Arc::clone(&jitted[i])).collect())
}

/// Links code generated elsewhere, outside the cache and the table of live groups: the grid
/// emulator's per-thread functions of a GPU partition (`dfc_codegen::compile_gpu_emulated`),
/// which have `KernelFn`'s signature. The `Jitted` is its first partition.
pub fn link_code(code: NativeCode) -> Result<Arc<Jitted>, CpuError> {
    let key = CacheKey::native_of(&[], &code.target);
    Ok(Arc::new(Jitted { group: Arc::new(link(key, code, Origin::Generated)?), index: 0 }))
}

/// How many groups of partitions' code are linked and in use in this process: what a
/// long-lived worker's memory for code grows with.
pub fn live_count() -> usize {
    let live = live_table().lock().unwrap_or_else(|e| e.into_inner());
    live.values().filter(|group| group.strong_count() > 0).count()
}

/// The groups linked and still used, by their cache key's digest.
fn live_table() -> &'static Mutex<HashMap<[u8; 32], Weak<Group>>> {
    static LIVE: OnceLock<Mutex<HashMap<[u8; 32], Weak<Group>>>> = OnceLock::new();
    LIVE.get_or_init(Default::default)
}

/// The message of an LLVM error, which it consumes; `Ok` for no error.
fn take_error(error: LLVMErrorRef) -> Result<(), String> {
    if error.is_null() {
        return Ok(());
    }
    // SAFETY: `error` is a live error that LLVMGetErrorMessage consumes; the message it
    // returns is a C string we own until LLVMDisposeErrorMessage.
    unsafe {
        let message = LLVMGetErrorMessage(error);
        let text = CStr::from_ptr(message).to_string_lossy().into_owned();
        LLVMDisposeErrorMessage(message);
        Err(text)
    }
}

fn link(key: CacheKey, code: NativeCode, origin: Origin) -> Result<Group, CpuError> {
    fn failed(what: impl std::fmt::Display) -> impl FnOnce(String) -> CpuError {
        move |message| CpuError::Jit(format!("{what}: {message}"))
    }
    inkwell::targets::Target::initialize_native(&Default::default()).map_err(failed("LLVM's native target"))?;
    let mut jit: LLVMOrcLLJITRef = std::ptr::null_mut();
    // SAFETY: a null builder asks for the default LLJIT for this host; on success `jit` is a
    // live instance, which `Linked` owns from here on (and disposes of on every path).
    take_error(unsafe { LLVMOrcCreateLLJIT(&mut jit, std::ptr::null_mut()) }).map_err(failed("creating a JIT"))?;
    let linked = Linked(jit);
    // SAFETY: `jit` is live; the main dylib belongs to it. The generator resolves the C
    // library's functions the kernels call (expf, logf, ...) in this process; the dylib takes
    // ownership of it.
    unsafe {
        let dylib = LLVMOrcLLJITGetMainJITDylib(jit);
        let mut generator = std::ptr::null_mut();
        let prefix = LLVMOrcLLJITGetGlobalPrefix(jit);
        let made =
            LLVMOrcCreateDynamicLibrarySearchGeneratorForProcess(&mut generator, prefix, None, std::ptr::null_mut());
        take_error(made).map_err(failed("resolving the C library"))?;
        LLVMOrcJITDylibAddGenerator(dylib, generator);
        // Each object is copied into a buffer that the JIT takes ownership of.
        for object in &code.objects {
            let buffer = llvm_sys::core::LLVMCreateMemoryBufferWithMemoryRangeCopy(
                object.as_ptr().cast(),
                object.len(),
                c"partition".as_ptr(),
            );
            take_error(LLVMOrcLLJITAddObjectFile(jit, dylib, buffer)).map_err(failed("linking the kernels"))?;
        }
    }
    let mut functions = HashMap::new();
    for kernel in code.partitions.iter().flatten() {
        if functions.contains_key(&kernel.function) {
            continue;
        }
        let name = CString::new(kernel.function.as_str())
            .map_err(|_| CpuError::Jit(format!("kernel `{}` has a NUL in its name", kernel.function)))?;
        let mut address = 0;
        // SAFETY: `jit` is live and `name` a C string; the lookup links what the symbol needs.
        take_error(unsafe { LLVMOrcLLJITLookup(jit, &mut address, name.as_ptr()) })
            .map_err(failed(format_args!("kernel `{}`", kernel.function).to_string()))?;
        let address = usize::try_from(address).ok().filter(|&a| a != 0);
        let address = address.ok_or_else(|| CpuError::Jit(format!("kernel `{}` has no address", kernel.function)))?;
        functions.insert(kernel.function.clone(), address);
    }
    Ok(Group { key, partitions: code.partitions, functions, origin, _linked: linked })
}
