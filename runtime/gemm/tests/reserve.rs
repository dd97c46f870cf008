//! After `reserve_workers`, the first product a rayon worker computes allocates no packing buffer: a worker that a
//! busy machine keeps out of a training run's first steps must not allocate when it first helps, steps in
//! (tests/native_alloc.rs failed so in CI). Each worker here computes its first products on its own, blocks as
//! large as either kernel family packs (deeper than a block's reduction, wider than its columns, A both ways, A of
//! bytes), allocations counted on that thread alone.

use dfc_gemm::{sgemm, sgemm_fused, ByteScale, Epilogue, Left};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

#[path = "../../../tests/support/skip.rs"]
mod skip;

struct Counting;

thread_local! {
    /// Whether this thread's allocations are counted, and the largest counted.
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: forwards every call to the system allocator, noting sizes on the way (const thread-locals without
// destructors, which neither allocate nor fail while a thread exits).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.try_with(Cell::get).unwrap_or(false) {
            let _ = LARGEST.try_with(|l| l.set(l.get().max(layout.size())));
        }
        // SAFETY: `GlobalAlloc::alloc`'s contract, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` above, that is from `System`, with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Whether the products run on dfc-gemm's own kernels (AVX2 and FMA at least), which keep their buffers.
fn own_kernels() -> bool {
    #[cfg(target_arch = "x86_64")]
    return std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

#[test]
fn a_workers_first_products_after_reserve_workers_allocate_no_buffer() {
    if !own_kernels() {
        // The `gemm` crate's products (other CPUs) allocate their packing on every call.
        skip::skip(skip::Need::Avx2, "this CPU has no AVX2 and FMA, so its products run on the gemm crate");
        return;
    }
    let (m, n, k) = (300, 1100, 800);
    let a: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32 - 3.0).collect();
    let bytes: Vec<u8> = (0..m * k).map(|i| (i % 251) as u8).collect();
    let b: Vec<f32> = (0..k * n).map(|i| (i % 5) as f32 - 2.0).collect();
    dfc_gemm::reserve_workers();
    let largest = rayon::broadcast(|_| {
        let mut c = vec![0.0f32; m * n];
        COUNTING.set(true);
        for transpose_a in [false, true] {
            sgemm(m, n, k, &a, transpose_a, &b, false, &mut c, false, false);
        }
        let scaled = Left::Bytes(&bytes, ByteScale::Div(255.0));
        sgemm_fused(m, n, k, scaled, false, &b, false, &mut c, None, Epilogue::default(), false, false);
        COUNTING.set(false);
        LARGEST.get()
    });
    // Packing buffers are 98 KiB and more; what little a product may still note (which rows of B are finite, for
    // A of bytes) is far below a page.
    for (worker, bytes) in largest.iter().enumerate() {
        assert!(*bytes < 4096, "worker {worker}: an allocation of {bytes} bytes in its first products");
    }
}
