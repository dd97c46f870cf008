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
//!
//! Soundness. Workers call the caller's `work`, which borrows from the caller's frame, through a pointer whose
//! lifetime is erased ([`Job`]); a worker may hold that pointer (in its `Arc<Job>`) long after the caller has
//! returned. It is dereferenced only to run a chunk the worker has claimed, and the caller returns (or unwinds)
//! only after [`Finish`] has closed the job to claims and seen every claimed chunk done; see [`Job::run`].
//! `pool_loom` (with the `loom` feature) checks this in every interleaving of the real code over loom's atomics.

use std::panic::{catch_unwind, AssertUnwindSafe};
use sync::{Arc, AtomicBool, AtomicU64, AtomicUsize, Mutex, Ordering};

/// The synchronisation the pool uses: the standard library's and rayon's, or, with the `loom` feature (for the
/// model tests only: never for a real build), loom's, with threads for rayon's jobs.
#[cfg(not(feature = "loom"))]
mod sync {
    pub use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
    pub use std::sync::{Arc, Mutex};

    /// Polls between checks for other rayon jobs and for the idle limit.
    pub const POLLS_PER_CHECK: u32 = 64;

    pub fn spawn(job: impl FnOnce() + Send + 'static) {
        rayon::spawn(job)
    }

    pub fn threads() -> usize {
        rayon::current_num_threads()
    }

    pub fn spin_hint() {
        std::hint::spin_loop()
    }

    pub fn yield_thread() {
        std::thread::yield_now()
    }

    /// Runs a pending rayon job, if any: whether it did.
    pub fn run_other_job() -> bool {
        rayon::yield_now() == Some(rayon::Yield::Executed)
    }

    /// How long a held worker has been without work.
    pub struct Idle(std::time::Instant);

    impl Idle {
        /// How long a held worker spins without work before it parks.
        const LIMIT: std::time::Duration = std::time::Duration::from_micros(1500);

        pub fn start() -> Idle {
            Idle(std::time::Instant::now())
        }

        /// Whether it has been idle too long (asked every `POLLS_PER_CHECK` polls).
        pub fn too_long(&self) -> bool {
            self.0.elapsed() > Self::LIMIT
        }
    }
}

#[cfg(feature = "loom")]
mod sync {
    pub use loom::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
    pub use loom::sync::{Arc, Mutex};

    pub const POLLS_PER_CHECK: u32 = 1;

    std::thread_local! {
        /// The threads spawned in this model execution (its threads all run on the test's thread).
        static SPAWNED: std::cell::RefCell<Vec<loom::thread::JoinHandle<()>>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    pub fn spawn(job: impl FnOnce() + Send + 'static) {
        let thread = loom::thread::spawn(job);
        SPAWNED.with(|spawned| spawned.borrow_mut().push(thread));
    }

    /// Waits for every thread `spawn` started (loom ends an execution's statics with its main thread).
    pub fn join_spawned() {
        while let Some(thread) = SPAWNED.with(|spawned| spawned.borrow_mut().pop()) {
            thread.join().expect("a pool thread panicked");
        }
    }

    /// The model's pool: the caller and one worker.
    pub fn threads() -> usize {
        2
    }

    pub fn spin_hint() {
        loom::thread::yield_now()
    }

    pub fn yield_thread() {
        loom::thread::yield_now()
    }

    pub fn run_other_job() -> bool {
        false
    }

    /// Time does not pass in the model: a worker is idle too long after a few polls without work.
    pub struct Idle(std::cell::Cell<u32>);

    impl Idle {
        pub fn start() -> Idle {
            Idle(std::cell::Cell::new(0))
        }

        pub fn too_long(&self) -> bool {
            self.0.set(self.0.get() + 1);
            self.0.get() > 2
        }
    }
}

/// One product's chunks: who may run which, and which are done.
struct Job {
    /// The chunks not yet claimed, `lo..hi`, as `hi << 32 | lo`; empty once the job is closed.
    left: AtomicU64,
    /// Chunks finished.
    done: AtomicUsize,
    panicked: AtomicBool,
    /// The caller's `&(dyn Fn(usize) + Sync)`, by its address in the caller's frame (lifetime erased): valid
    /// until the caller's [`Finish`] has been dropped; dereferenced only in [`Job::run`].
    work: *const (),
}

// SAFETY: `work` is the only field that is not `Send` and `Sync` of itself. It points to a `&(dyn Fn(usize) +
// Sync)`, which any thread may call, and it is dereferenced only under `Job::run`'s protocol, which keeps every
// call within the caller's borrow (see there); moving or sharing the pointer itself does nothing.
unsafe impl Send for Job {}
// SAFETY: as for `Send`.
unsafe impl Sync for Job {}

impl Job {
    /// Claims the first (or last) chunk left.
    fn claim(&self, front: bool) -> Option<usize> {
        let mut left = self.left.load(Ordering::Relaxed);
        loop {
            let (lo, hi) = (left & 0xffff_ffff, left >> 32);
            if lo >= hi {
                return None;
            }
            let (new, chunk) = if front { (left + 1, lo) } else { (left - (1 << 32), hi - 1) };
            // Relaxed: claims and `Finish`'s close are read-modify-writes of `left`, so each reads the one before
            // it in `left`'s order, and a chunk is claimed once, or not at all once closed. The chunk's results
            // reach the caller through `done`.
            match self.left.compare_exchange_weak(left, new, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return Some(chunk as usize),
                Err(now) => left = now,
            }
        }
    }

    /// Claims and runs chunks until none is left.
    fn run(&self, front: bool) {
        while let Some(c) = self.claim(front) {
            // SAFETY: this thread claimed chunk `c`, so the job was not closed yet, and the caller's `Finish`
            // (which closes it) waits until `done` counts every chunk claimed before the close, this one
            // included, before the caller's frame — where `work` points, and what the closure borrows — can go.
            // `done` is bumped (Release) only after the call returned or unwound, and `Finish` reads it with
            // Acquire: the call happens before the caller goes on. The closure is `Sync`, so calling it from
            // this thread is allowed.
            let work = unsafe { *self.work.cast::<&(dyn Fn(usize) + Sync)>() };
            if catch_unwind(AssertUnwindSafe(|| work(c))).is_err() {
                self.panicked.store(true, Ordering::Relaxed);
            }
            self.done.fetch_add(1, Ordering::Release);
        }
    }
}

/// The caller's end of a job: on drop (on return or unwind alike), closes the job to claims, clears it from the
/// held workers' board, and waits until every chunk claimed before the close is done.
struct Finish<'a> {
    job: &'a Arc<Job>,
    chunks: usize,
    held: bool,
}

impl Drop for Finish<'_> {
    fn drop(&mut self) {
        let left = self.job.left.swap(0, Ordering::Relaxed);
        let unclaimed = ((left >> 32).saturating_sub(left & 0xffff_ffff)) as usize;
        if self.held {
            // Held workers that look later find no job; the board need not keep this one alive.
            let mut board = POOL.job.lock().unwrap_or_else(|e| e.into_inner());
            if board.as_ref().is_some_and(|job| Arc::ptr_eq(job, self.job)) {
                *board = None;
            }
        }
        let mut spins = 0u32;
        while self.job.done.load(Ordering::Acquire) < self.chunks - unclaimed {
            if spins < 1 << 14 {
                sync::spin_hint();
                spins += 1;
            } else {
                sync::yield_thread();
            }
        }
    }
}

/// The pool's state: who holds it, and the job held workers help with.
struct Pool {
    /// Runs holding the pool now.
    holds: AtomicUsize,
    /// Held workers spinning now.
    spinners: AtomicUsize,
    /// The product (or kernel) whose chunks held workers should help with, and its number, bumped when it
    /// changes.
    job: Mutex<Option<Arc<Job>>>,
    job_seq: AtomicU64,
}

macro_rules! new_pool {
    () => {
        Pool {
            holds: AtomicUsize::new(0),
            spinners: AtomicUsize::new(0),
            job: Mutex::new(None),
            job_seq: AtomicU64::new(0),
        }
    };
}

#[cfg(not(feature = "loom"))]
static POOL: Pool = new_pool!();

// Each model execution starts from a fresh pool.
#[cfg(feature = "loom")]
loom::lazy_static! {
    static ref POOL: Pool = new_pool!();
}

/// Keeps rayon's workers spinning, ready for [`run_chunks`], while it lives (see the module's documentation).
#[must_use = "the workers are held only while the hold lives"]
pub struct Hold(());

/// Holds rayon's workers for the length of a program run: the workers that help with its first parallel product
/// stay spinning, so that the next ones start without waking them.
pub fn hold() -> Hold {
    POOL.holds.fetch_add(1, Ordering::AcqRel);
    holding::enter();
    Hold(())
}

/// Makes this worker a held spinner when the pool is held by one run and has room for one more. Never the thread
/// of a run that holds the pool: where that thread is one of rayon's (`dfc` makes its main thread one), it may
/// pick up a helper job of its own product that no worker took, and spinning there would stall its run.
fn become_spinner() -> bool {
    let wanted = sync::threads().saturating_sub(1);
    !holding::here()
        && POOL.holds.load(Ordering::Acquire) == 1
        && POOL.spinners.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < wanted).then_some(n + 1)).is_ok()
}

impl Drop for Hold {
    fn drop(&mut self) {
        holding::leave();
        POOL.holds.fetch_sub(1, Ordering::AcqRel);
    }
}

/// How many holds this thread has taken and not dropped.
#[cfg(not(feature = "loom"))]
mod holding {
    use std::cell::Cell;

    thread_local! {
        static HOLDS: Cell<usize> = const { Cell::new(0) };
    }

    pub fn enter() {
        HOLDS.set(HOLDS.get() + 1);
    }

    pub fn leave() {
        HOLDS.set(HOLDS.get().saturating_sub(1));
    }

    pub fn here() -> bool {
        HOLDS.get() > 0
    }
}

/// The model's threads are not the caller's: no thread of a run is one of its workers there.
#[cfg(feature = "loom")]
mod holding {
    pub fn enter() {}

    pub fn leave() {}

    pub fn here() -> bool {
        false
    }
}

/// A held worker (counted in `spinners`): runs the chunks of each new job and rayon's other jobs until it has
/// been idle for `Idle::LIMIT`, or runs hold the pool side by side.
fn spin() {
    let mut seen = POOL.job_seq.load(Ordering::Acquire);
    let mut idle = sync::Idle::start();
    let mut polls = 0u32;
    loop {
        let seq = POOL.job_seq.load(Ordering::Acquire);
        if seq != seen {
            seen = seq;
            let job = POOL.job.lock().unwrap_or_else(|e| e.into_inner()).clone();
            if let Some(job) = job {
                job.run(false);
            }
            idle = sync::Idle::start();
            continue;
        }
        sync::spin_hint();
        polls = polls.wrapping_add(1);
        if polls.is_multiple_of(sync::POLLS_PER_CHECK) {
            if sync::run_other_job() {
                idle = sync::Idle::start();
            } else if POOL.holds.load(Ordering::Acquire) > 1 || idle.too_long() {
                break;
            }
        }
    }
    POOL.spinners.fetch_sub(1, Ordering::AcqRel);
}

/// Whether held workers are spinning now: a product's chunks reach them within a poll, where a parked worker takes
/// tens of microseconds to wake.
pub(crate) fn workers_spinning() -> bool {
    POOL.holds.load(Ordering::Acquire) > 0 && POOL.spinners.load(Ordering::Acquire) > 0
}

/// Runs `work(c)` for every chunk c in `0..chunks`, on this thread and on up to `helpers` rayon jobs, and returns
/// once every chunk is done.
pub fn run_chunks(chunks: usize, helpers: usize, work: &(dyn Fn(usize) + Sync)) {
    assert!(chunks < 1 << 31);
    let job = Arc::new(Job {
        left: AtomicU64::new((chunks as u64) << 32),
        done: AtomicUsize::new(0),
        panicked: AtomicBool::new(false),
        work: std::ptr::from_ref(&work).cast(),
    });
    let held = workers_spinning();
    // Dropped before `work` (a parameter, which outlives every local), on return or unwind alike: from here on
    // workers may run chunks.
    let finish = Finish { job: &job, chunks, held };
    if held {
        *POOL.job.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::clone(&job));
        POOL.job_seq.fetch_add(1, Ordering::AcqRel);
    } else {
        for _ in 0..helpers.min(chunks.saturating_sub(1)) {
            let job = Arc::clone(&job);
            sync::spawn(move || {
                job.run(false);
                drop(job);
                if become_spinner() {
                    spin();
                }
            });
        }
    }
    job.run(true);
    drop(finish);
    assert!(!job.panicked.load(Ordering::Relaxed), "sgemm: a chunk of the product panicked");
}

#[cfg(all(test, not(feature = "loom")))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// Products whose helpers may start only after their caller has done every chunk and returned: such a helper
    /// holds a job whose `work` pointer is dangling, and must not touch it (Miri reports it if it does: CI runs
    /// these tests under Miri).
    #[test]
    fn late_helpers_touch_nothing_of_a_finished_product() {
        for round in 1..=4 {
            let data = [round; 8];
            let sum = AtomicUsize::new(0);
            run_chunks(data.len(), 3, &|c| {
                sum.fetch_add(data[c], std::sync::atomic::Ordering::Relaxed);
            });
            assert_eq!(sum.into_inner(), 8 * round);
        }
        // Held workers take later products through the board.
        let _hold = hold();
        for round in 1..=4 {
            let data = [round; 8];
            let sum = AtomicUsize::new(0);
            run_chunks(data.len(), 3, &|c| {
                sum.fetch_add(data[c], std::sync::atomic::Ordering::Relaxed);
            });
            assert_eq!(sum.into_inner(), 8 * round);
        }
    }

    #[test]
    fn a_panicking_chunk_fails_the_caller_once_every_chunk_is_done() {
        let done = AtomicUsize::new(0);
        let caught = catch_unwind(AssertUnwindSafe(|| {
            run_chunks(6, 2, &|c| {
                if c == 3 {
                    panic!("chunk 3 fails");
                }
                done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            })
        }));
        let message = caught.expect_err("the panic reaches the caller");
        assert_eq!(message.downcast_ref::<&str>(), Some(&"sgemm: a chunk of the product panicked"));
        assert_eq!(done.into_inner(), 5, "every other chunk ran before the caller went on");
    }
}

/// The pool under loom: the real code above over loom's atomics, with a thread for each rayon job. Each product's
/// `work` writes a loom cell per chunk, which the caller reads and then writes again once `run_chunks` has
/// returned (as the next use of its frame would): loom reports a chunk run twice, or a worker that touches a cell
/// (runs `work`) without that happening before the caller's return.
#[cfg(all(test, feature = "loom"))]
mod pool_loom {
    use super::*;
    use loom::cell::UnsafeCell;

    /// What the caller's frame holds: a count per chunk.
    struct Frame {
        runs: Vec<UnsafeCell<u32>>,
    }

    // SAFETY: the cells are touched only through loom, which reports any access by two threads that is not
    // ordered by a happens-before edge (the point of the model).
    unsafe impl Sync for Frame {}

    fn product(frame: &Frame, helpers: usize) {
        let work = |c: usize| {
            frame.runs[c].with_mut(|runs| {
                // SAFETY: loom reports any access to the cell that is not exclusive.
                unsafe { *runs += 1 }
            })
        };
        run_chunks(frame.runs.len(), helpers, &work);
        for (c, runs) in frame.runs.iter().enumerate() {
            runs.with_mut(|runs| {
                // SAFETY: as above.
                let runs = unsafe { &mut *runs };
                assert_eq!(*runs, 1, "chunk {c} ran once");
                *runs = 0;
            });
        }
    }

    fn model(f: impl Fn() + Sync + Send + 'static) {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(3);
        builder.check(move || {
            f();
            sync::join_spawned();
        });
    }

    fn frame(chunks: usize) -> Frame {
        Frame { runs: (0..chunks).map(|_| UnsafeCell::new(0)).collect() }
    }

    #[test]
    fn pool_loom_a_helper_shares_the_chunks() {
        model(|| product(&frame(2), 1));
    }

    #[test]
    fn pool_loom_held_workers_take_later_products() {
        model(|| {
            let _hold = hold();
            let frame = frame(2);
            product(&frame, 1);
            product(&frame, 1);
        });
    }
}
