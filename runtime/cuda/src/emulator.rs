//! The grid emulator: a GPU kernel's launches, run on the CPU with the GPU's semantics, so that
//! CI (which has no GPU) sees what a grid of threads does with a kernel.
//!
//! Every GPU entry (`dfc_codegen::compile_gpu`) calls a per-thread function, `fn(args, count,
//! thread)`, with the thread's index in the grid; all that a GPU thread does is in it (which
//! row it runs, a reduction's lane and its partial, a combining pass's group).
//! `dfc_codegen::compile_gpu_emulated` compiles the same per-thread functions for the host
//! (the CPU flavour of the same code, which differs from the GPU's only in its
//! transcendentals), and [`Emulated::run`] calls them once per thread of each launch
//! (`GpuKernel::launches`), in the launches' order, on host copies of the buffers and of the
//! scratch memory a reduction's passes use. The threads of a launch run in a shuffled order,
//! seeded, dealt out to several host threads running side by side
//! ([`run_threads`]), so that a kernel whose result depends on which thread runs when (every
//! thread initialising a shared output, as reductions over the launch axis did when every
//! thread ran its own row of them) gives a wrong value, as it would on a GPU. Scratch memory
//! starts filled with all-ones bytes (NaN for floats), as a GPU's is not zeroed: a pass that
//! reads a partial no earlier pass wrote gives NaN.
//!
//! Kernels with barriers (a reduction's combining passes fold a tree in shared memory) are
//! compiled as phase functions, `fn(args, count, thread, shared, phase)`: the code between two
//! barriers is one phase. [`run_blocks`] runs them as a GPU's barriers order them: every
//! thread of a block runs phase `p` (in a shuffled order) before any runs phase `p + 1`, over
//! the block's own shared memory, NaN-filled at first. A kernel that reads shared memory
//! another thread writes in the same phase (a missing barrier) depends on the order and fails.
//! Not here: warp shuffles; the kernels use none.

use crate::{check_arguments, CudaError};
use dfc_codegen::{GpuKernel, PHASE_SUFFIX, THREAD_SUFFIX};
use dfc_cpu::{Jitted, KernelFn, PhaseFn};
use dfc_ir::{Module, NodeId};
use std::sync::Arc;

/// Host threads that run a launch's GPU threads side by side.
const HOST_THREADS: usize = 2;

/// A GPU partition's kernels, compiled for this CPU to run as their launches would.
pub struct Emulated {
    jit: Arc<Jitted>,
    /// The kernels as `compile_gpu` describes them (no PTX).
    code: dfc_codegen::GpuCode,
}

impl std::fmt::Debug for Emulated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Emulated").field("kernels", &self.code.kernels.len()).finish()
    }
}

impl Emulated {
    /// The kernels of `module` (a GPU partition), keeping the nodes of `keep` as kernel roots,
    /// as `dfc_codegen::compile_gpu` makes them.
    pub fn load(module: &Module, keep: &[NodeId]) -> Result<Emulated, CudaError> {
        let target = dfc_codegen::host_target();
        let (native, code) =
            dfc_codegen::compile_gpu_emulated(module, keep, &target).map_err(|e| CudaError::Emulator(e.to_string()))?;
        let jit = dfc_cpu::link_code(native).map_err(|e| CudaError::Emulator(e.to_string()))?;
        Ok(Emulated { jit, code })
    }

    /// One per fused kernel, as `compile_gpu` describes them.
    pub fn kernels(&self) -> &[GpuKernel] {
        &self.code.kernels
    }

    /// Its op kernels (`GpuCode::ops`), as `compile_gpu` describes them.
    pub fn ops(&self) -> &[GpuKernel] {
        &self.code.ops
    }

    /// Launchable kernel `index`: a fused kernel, or past them an op kernel.
    pub fn launchable(&self, index: usize) -> &GpuKernel {
        launchable(&self.code, index)
    }

    /// [`crate::Kernels::run`] on the CPU: runs `kernel`'s launches over copies of `buffers`
    /// (argument `i` of the kernel is buffer `args[i]`), each launch's threads in an order
    /// shuffled by `seed`, and returns every buffer after the run.
    pub fn run(
        &self,
        kernel: &GpuKernel,
        buffers: &[Vec<u8>],
        args: &[usize],
        seed: u64,
    ) -> Result<Vec<Vec<u8>>, CudaError> {
        check_arguments(kernel, buffers, args, "the emulated GPU")?;
        // 16-byte aligned copies, as device memory is (more than) aligned.
        let mut memory: Vec<Vec<u128>> = buffers.iter().map(|b| aligned(b, 0)).collect();
        let mut partials = Scratch::for_kernels(std::slice::from_ref(kernel));
        let scratch = partials.pointers();
        let pointers: Vec<*mut u8> = args.iter().map(|&i| memory[i].as_mut_ptr() as *mut u8).collect();
        // SAFETY: the pointers are copies of the buffers, which `check_arguments` found to be
        // one per argument, each as large as the kernel's value there; the scratch was made
        // for this kernel.
        unsafe { self.launch(kernel, &pointers, scratch, seed)? };
        Ok(memory.iter().zip(buffers).map(|(m, b)| as_bytes(m)[..b.len()].to_vec()).collect())
    }

    /// Runs `kernel`'s launches over `args` (its inputs, then its output), with the two
    /// buffers at `scratch` for a reduction's passes, each launch's threads in an order
    /// shuffled by `seed`.
    ///
    /// # Safety
    /// `args` are the kernel's arguments, each pointing to a value of the type the kernel
    /// reads or writes there, alive and used by nothing else until this returns; `scratch`
    /// points to buffers of at least the kernel's `scratch_bytes`.
    pub unsafe fn launch(
        &self,
        kernel: &GpuKernel,
        args: &[*mut u8],
        scratch: [*mut u8; 2],
        seed: u64,
    ) -> Result<(), CudaError> {
        for (n, launch) in kernel.launches().iter().enumerate() {
            let missing =
                || CudaError::MissingKernel { device: "the emulated GPU".to_string(), kernel: launch.function.clone() };
            let pointers: Vec<*mut u8> = launch.buffers(args, scratch);
            let table = Arguments(pointers);
            let count = launch.count as i64;
            let seed = seed.wrapping_add(n as u64);
            if launch.phases > 0 {
                let name = format!("{}{PHASE_SUFFIX}", launch.function);
                let function = self.jit.phase_function(&name).ok_or_else(missing)?;
                let blocks = Blocks {
                    grid: u64::from(launch.grid),
                    block: u64::from(launch.block),
                    phases: launch.phases,
                    shared_bytes: launch.shared_bytes as usize,
                };
                run_blocks(&blocks, seed, HOST_THREADS, |shared, phase, thread| {
                    call_phase(function, &table, count, thread, shared, phase)
                });
            } else {
                let name = format!("{}{THREAD_SUFFIX}", launch.function);
                let function = self.jit.function(&name).ok_or_else(missing)?;
                let threads = u64::from(launch.block) * u64::from(launch.grid);
                run_threads(threads, seed, HOST_THREADS, |thread| call(function, &table, count, thread));
            }
        }
        Ok(())
    }
}

/// Kernel `index` of `code`: a fused kernel, or past them an op kernel.
pub(crate) fn launchable(code: &dfc_codegen::GpuCode, index: usize) -> &GpuKernel {
    code.kernels.get(index).unwrap_or_else(|| &code.ops[index - code.kernels.len()])
}

/// Scratch memory for reductions' passes: two buffers, as large as the largest of some
/// kernels' (`GpuKernel::scratch_bytes`), filled at first with all-ones bytes (NaN for floats),
/// as a GPU's memory is not zeroed.
pub struct Scratch {
    buffers: [Vec<u128>; 2],
}

impl Scratch {
    pub fn for_kernels(kernels: &[GpuKernel]) -> Scratch {
        let most = |i: usize| kernels.iter().map(|k| k.scratch_bytes()[i]).max().unwrap_or(0) as usize;
        let filled = |bytes: usize| vec![u128::MAX; bytes.div_ceil(16)];
        Scratch { buffers: [filled(most(0)), filled(most(1))] }
    }

    /// Where the two buffers are.
    pub fn pointers(&mut self) -> [*mut u8; 2] {
        let [first, second] = &mut self.buffers;
        [first.as_mut_ptr() as *mut u8, second.as_mut_ptr() as *mut u8]
    }
}

fn call(function: KernelFn, table: &Arguments, count: i64, thread: u64) {
    // SAFETY: `function` is a per-thread function of the kernel whose launch built `table`: its
    // pointers are the launch's buffers, each as large as the kernel's types say (checked by
    // `check_arguments`) or as `scratch_bytes` says, alive until every call returns (the host
    // threads are scoped). Concurrent calls write disjoint elements: each GPU thread of
    // dfc's kernels writes only its own rows, partial or group.
    unsafe { function(table.0.as_ptr(), count, thread as i64) }
}

fn call_phase(function: PhaseFn, table: &Arguments, count: i64, thread: u64, shared: *mut u8, phase: u32) {
    // SAFETY: as for `call`; `shared` is the block's own buffer of the launch's `shared_bytes`
    // (`run_blocks`), which only this block's threads use, one at a time.
    unsafe { function(table.0.as_ptr(), count, thread as i64, shared, phase as i32) }
}

/// The shape of a launch whose threads meet at barriers.
pub struct Blocks {
    pub grid: u64,
    pub block: u64,
    pub phases: u32,
    pub shared_bytes: usize,
}

/// Calls `body(shared, phase, thread)` for every thread of every block of `blocks`, phase by
/// phase as a GPU's barriers order them: a block's threads all run phase `p` before any runs
/// phase `p + 1`, each time in a new shuffled order. `shared` is the block's own memory,
/// filled at first with all-ones bytes (NaN), as a GPU's is not zeroed. Blocks run in an
/// order shuffled by `seed`, dealt out to `workers` host threads side by side, as a GPU's
/// blocks run in no set order; within a block the threads run one at a time.
pub fn run_blocks(blocks: &Blocks, seed: u64, workers: usize, body: impl Fn(*mut u8, u32, u64) + Sync) {
    let order = thread_order(blocks.grid, seed);
    let run_block = |b: u64| {
        let mut shared = vec![u128::MAX; blocks.shared_bytes.div_ceil(16).max(1)];
        let at = shared.as_mut_ptr() as *mut u8;
        for phase in 0..blocks.phases {
            let phase_seed = seed ^ b.rotate_left(17) ^ u64::from(phase).rotate_left(40);
            for t in thread_order(blocks.block, phase_seed) {
                body(at, phase, b * blocks.block + t);
            }
        }
    };
    if workers <= 1 {
        return order.into_iter().for_each(run_block);
    }
    std::thread::scope(|scope| {
        for w in 0..workers {
            let (order, run_block) = (&order, &run_block);
            scope.spawn(move || order.iter().skip(w).step_by(workers).for_each(|&b| run_block(b)));
        }
    });
}

/// A launch's argument pointers, shared by the host threads that emulate its GPU threads.
struct Arguments(Vec<*mut u8>);

// SAFETY: the pointers are only passed to the kernel's per-thread function (see `call`).
unsafe impl Sync for Arguments {}

fn aligned(bytes: &[u8], fill: u8) -> Vec<u128> {
    let mut words = vec![u128::from_ne_bytes([fill; 16]); bytes.len().div_ceil(16)];
    as_bytes_mut(&mut words)[..bytes.len()].copy_from_slice(bytes);
    words
}

fn as_bytes(words: &[u128]) -> &[u8] {
    // SAFETY: u128 has no padding; every byte is initialised.
    unsafe { std::slice::from_raw_parts(words.as_ptr() as *const u8, words.len() * 16) }
}

fn as_bytes_mut(words: &mut [u128]) -> &mut [u8] {
    // SAFETY: as above; any byte pattern is a valid u128.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr() as *mut u8, words.len() * 16) }
}

/// The threads `0..threads` of a launch in an order shuffled by `seed`.
pub fn thread_order(threads: u64, seed: u64) -> Vec<u64> {
    let mut order: Vec<u64> = (0..threads).collect();
    fastrand::Rng::with_seed(seed).shuffle(&mut order);
    order
}

/// Calls `body(thread)` for every thread of a launch of `threads` threads, in an order
/// shuffled by `seed`, dealt out round-robin to `workers` host threads running side by side.
/// With more than one worker `body` is called concurrently: only for kernels whose threads
/// write disjoint elements (dfc's do).
pub fn run_threads(threads: u64, seed: u64, workers: usize, body: impl Fn(u64) + Sync) {
    let order = thread_order(threads, seed);
    if workers <= 1 {
        return order.into_iter().for_each(body);
    }
    std::thread::scope(|scope| {
        for w in 0..workers {
            let (order, body) = (&order, &body);
            scope.spawn(move || order.iter().skip(w).step_by(workers).for_each(|&thread| body(thread)));
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Phase by phase: every thread of a block sees what the others wrote in earlier phases
    /// (in its own block's memory, NaN-filled at first); run thread by thread instead (no
    /// barriers), the same reads see NaN.
    #[test]
    fn blocks_run_phase_by_phase_over_their_own_shared_memory() {
        let blocks = Blocks { grid: 7, block: 64, phases: 2, shared_bytes: 64 * 4 };
        let wrong = std::sync::atomic::AtomicU32::new(0);
        let body = |shared: *mut u8, phase: u32, thread: u64| {
            let (block, t) = (thread / 64, (thread % 64) as usize);
            // SAFETY: `shared` is the block's buffer of 64 f32s; its threads run one at a time.
            let cells = unsafe { std::slice::from_raw_parts_mut(shared as *mut f32, 64) };
            if phase == 0 {
                cells[t] = (block * 64) as f32 + t as f32;
            } else if cells[(t + 1) % 64] != (block * 64) as f32 + ((t + 1) % 64) as f32 {
                wrong.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        };
        run_blocks(&blocks, 3, 2, body);
        assert_eq!(wrong.load(std::sync::atomic::Ordering::Relaxed), 0);
        // Without the barrier: each thread's phases back to back, in a shuffled order.
        let mut shared = vec![u128::MAX; 64 * 4 / 16];
        for thread in thread_order(64, 3) {
            body(shared.as_mut_ptr() as *mut u8, 0, thread);
            body(shared.as_mut_ptr() as *mut u8, 1, thread);
        }
        assert!(wrong.load(std::sync::atomic::Ordering::Relaxed) > 0, "a missing barrier went unseen");
    }

    #[test]
    fn every_thread_runs_once_in_a_shuffled_order() {
        for threads in [1, 31, 32, 33, 1000, 70_000] {
            let seen: Vec<std::sync::atomic::AtomicU32> = (0..threads).map(|_| Default::default()).collect();
            run_threads(threads, 3, 4, |thread| {
                seen[thread as usize].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            });
            assert!(seen.iter().all(|n| n.load(std::sync::atomic::Ordering::Relaxed) == 1), "{threads} threads");
            if threads > 8 {
                let order = thread_order(threads, 7);
                assert!(order.windows(2).any(|w| w[0] > w[1]), "{threads} threads: not shuffled");
            }
        }
    }
}
