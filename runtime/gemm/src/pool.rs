//! Sharing the chunks of one product between the calling thread and rayon's workers.
//!
//! The calling thread does not park while workers compute (waking it costs tens of microseconds on a virtual
//! machine, as much as a whole small product): it claims chunks itself and spins briefly at the end for chunks
//! still running elsewhere. A worker that wakes late (or never, when the pool is busy) simply finds fewer chunks
//! left, or none. The caller claims from the front and the workers from the back, so that repeated products on
//! the same operands tend to give each thread the same rows or columns, still in its cache.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

struct State {
    /// The chunks not yet claimed, `lo..hi`, as `hi << 32 | lo`.
    left: AtomicU64,
    /// Chunks finished.
    done: AtomicUsize,
    panicked: AtomicBool,
}

impl State {
    /// Claims the first (or last) chunk left.
    fn claim(&self, front: bool) -> Option<usize> {
        let mut left = self.left.load(Ordering::Relaxed);
        loop {
            let (lo, hi) = (left & 0xffff_ffff, left >> 32);
            if lo >= hi {
                return None;
            }
            let (new, chunk) = if front { (left + 1, lo) } else { (left - (1 << 32), hi - 1) };
            match self.left.compare_exchange_weak(left, new, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return Some(chunk as usize),
                Err(now) => left = now,
            }
        }
    }

    /// Claims and runs chunks until none is left.
    fn run(&self, front: bool, work: &(dyn Fn(usize) + Sync)) {
        while let Some(c) = self.claim(front) {
            if catch_unwind(AssertUnwindSafe(|| work(c))).is_err() {
                self.panicked.store(true, Ordering::Relaxed);
            }
            self.done.fetch_add(1, Ordering::Release);
        }
    }
}

/// `work`, with its lifetime erased for `rayon::spawn`.
struct Work(&'static (dyn Fn(usize) + Sync));

/// Runs `work(c)` for every chunk c in `0..chunks`, on this thread and on up to `helpers` rayon jobs, and returns
/// once every chunk is done.
pub(crate) fn run_chunks(chunks: usize, helpers: usize, work: &(dyn Fn(usize) + Sync)) {
    assert!(chunks < 1 << 31);
    let state = Arc::new(State {
        left: AtomicU64::new((chunks as u64) << 32),
        done: AtomicUsize::new(0),
        panicked: AtomicBool::new(false),
    });
    // SAFETY: a helper calls `work` only for a chunk it claimed, and this function returns only after every
    // claimed chunk is done; a helper that runs later claims nothing and never touches `work`.
    let erased: &'static (dyn Fn(usize) + Sync) = unsafe { std::mem::transmute(work) };
    for _ in 0..helpers.min(chunks.saturating_sub(1)) {
        let state = Arc::clone(&state);
        let work = Work(erased);
        rayon::spawn(move || {
            let work = work;
            state.run(false, work.0);
        });
    }
    state.run(true, work);
    let mut spins = 0u32;
    while state.done.load(Ordering::Acquire) < chunks {
        if spins < 1 << 14 {
            std::hint::spin_loop();
            spins += 1;
        } else {
            std::thread::yield_now();
        }
    }
    assert!(!state.panicked.load(Ordering::Relaxed), "sgemm: a chunk of the product panicked");
}
