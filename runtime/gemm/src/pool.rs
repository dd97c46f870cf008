//! Sharing the chunks of one product between the calling thread and rayon's workers.
//!
//! The calling thread does not park while workers compute (waking it costs tens of microseconds on a virtual
//! machine, as much as a whole small product): it claims chunks itself and spins briefly at the end for chunks
//! still running elsewhere. A worker that wakes late (or never, when the pool is busy) simply finds fewer chunks
//! left, or none. The caller claims from the front and the workers from the back, so that repeated products on
//! the same operands tend to give each thread the same rows or columns, still in its cache.
//!
//! Waking a parked rayon worker costs 20 to 50 µs on these virtual machines, as much as one product of a small
//! model, and a training step runs a dozen of them with short single-threaded kernels between. So a program run
//! may [`hold`] the workers: for its length each worker spins, polling for the next product's chunks (and for
//! other rayon jobs, which it runs), instead of parking. A held worker leaves after `IDLE` without work, and as
//! soon as two runs hold the pool at once (programs of several devices running side by side, where spinning
//! would take their cores).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
#[derive(Clone, Copy)]
struct Work(&'static (dyn Fn(usize) + Sync));

/// Runs holding the pool now.
static HOLDS: AtomicUsize = AtomicUsize::new(0);
/// Held workers spinning now.
static SPINNERS: AtomicUsize = AtomicUsize::new(0);
/// The product (or kernel) whose chunks held workers should help with, and its number, bumped when it changes.
static JOB: Mutex<Option<(Arc<State>, Work)>> = Mutex::new(None);
static JOB_SEQ: AtomicU64 = AtomicU64::new(0);
/// How long a held worker spins without work before it parks.
const IDLE: Duration = Duration::from_micros(1500);

/// Keeps rayon's workers spinning, ready for [`run_chunks`], while it lives (see the module's documentation).
#[must_use = "the workers are held only while the hold lives"]
pub struct Hold(());

/// Holds rayon's workers for the length of a program run: the workers that help with its first parallel product
/// stay spinning, so that the next ones start without waking them.
pub fn hold() -> Hold {
    HOLDS.fetch_add(1, Ordering::AcqRel);
    Hold(())
}

/// Makes this worker a held spinner when the pool is held by one run and has room for one more.
fn become_spinner() -> bool {
    let wanted = rayon::current_num_threads().saturating_sub(1);
    HOLDS.load(Ordering::Acquire) == 1
        && SPINNERS.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < wanted).then_some(n + 1)).is_ok()
}

impl Drop for Hold {
    fn drop(&mut self) {
        HOLDS.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A held worker (counted in `SPINNERS`): runs the chunks of each new job and rayon's other jobs until it has been idle for `IDLE`, or
/// runs hold the pool side by side.
fn spin() {
    let mut seen = JOB_SEQ.load(Ordering::Acquire);
    let mut idle_since = Instant::now();
    let mut polls = 0u32;
    loop {
        let seq = JOB_SEQ.load(Ordering::Acquire);
        if seq != seen {
            seen = seq;
            let job = JOB.lock().unwrap_or_else(|e| e.into_inner()).clone();
            if let Some((state, work)) = job {
                state.run(false, work.0);
            }
            idle_since = Instant::now();
            continue;
        }
        std::hint::spin_loop();
        polls = polls.wrapping_add(1);
        if polls & 63 == 0 {
            if rayon::yield_now() == Some(rayon::Yield::Executed) {
                idle_since = Instant::now();
            } else if HOLDS.load(Ordering::Acquire) > 1 || idle_since.elapsed() > IDLE {
                break;
            }
        }
    }
    SPINNERS.fetch_sub(1, Ordering::AcqRel);
}

/// Runs `work(c)` for every chunk c in `0..chunks`, on this thread and on up to `helpers` rayon jobs, and returns
/// once every chunk is done.
pub fn run_chunks(chunks: usize, helpers: usize, work: &(dyn Fn(usize) + Sync)) {
    assert!(chunks < 1 << 31);
    let state = Arc::new(State {
        left: AtomicU64::new((chunks as u64) << 32),
        done: AtomicUsize::new(0),
        panicked: AtomicBool::new(false),
    });
    // SAFETY: a helper calls `work` only for a chunk it claimed, and this function returns only after every
    // claimed chunk is done; a helper that runs later claims nothing and never touches `work`.
    let erased: &'static (dyn Fn(usize) + Sync) = unsafe { std::mem::transmute(work) };
    let held = HOLDS.load(Ordering::Acquire) > 0 && SPINNERS.load(Ordering::Acquire) > 0;
    if held {
        *JOB.lock().unwrap_or_else(|e| e.into_inner()) = Some((Arc::clone(&state), Work(erased)));
        JOB_SEQ.fetch_add(1, Ordering::AcqRel);
    } else {
        for _ in 0..helpers.min(chunks.saturating_sub(1)) {
            let state = Arc::clone(&state);
            let work = Work(erased);
            rayon::spawn(move || {
                let work = work;
                state.run(false, work.0);
                drop(state);
                if become_spinner() {
                    spin();
                }
            });
        }
    }
    state.run(true, work);
    if held {
        // Held workers that look later find no chunk left; the job must not outlive `work`'s borrow in the slot.
        let mut job = JOB.lock().unwrap_or_else(|e| e.into_inner());
        if job.as_ref().is_some_and(|(s, _)| Arc::ptr_eq(s, &state)) {
            *job = None;
        }
    }
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
