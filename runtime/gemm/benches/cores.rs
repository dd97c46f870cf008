//! What reading another core's freshly written data costs on this machine: a buffer that one thread writes is then
//! summed by the same thread or by another, alternately, and the sum timed. A product split among threads reads what
//! the products before it wrote, in parts written by each core (a layer's activations, its gradients), so this is the
//! price of a split that does not follow the one before it.
//!
//! `cargo bench -p dfc-gemm --bench cores`: for each size, the median and p10 of the sum when the reader wrote the
//! buffer, and when the other thread did. `CORES_PREFETCH=N` also prefetches N cache lines ahead of the sum. The two
//! threads are left to the OS; on a machine of more than two CPUs they may share a core.

use std::cell::UnsafeCell;
use std::hint::black_box;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

/// Rounds per measurement (after `WARMUP`).
const ROUNDS: usize = 2000;
const WARMUP: usize = 100;

fn main() {
    let prefetch: usize = std::env::var("CORES_PREFETCH").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    println!("sum of a buffer: written by the reader | by the other thread (µs: median, p10)");
    for kib in [16usize, 64, 256] {
        let floats = kib * 256;
        let local = measure(floats, false, prefetch);
        let remote = measure(floats, true, prefetch);
        println!(
            "{kib:>4} KiB: {:>6.2} ({:.2}) | {:>6.2} ({:.2}), {:.1}×",
            local.0,
            local.1,
            remote.0,
            remote.1,
            remote.0 / local.0
        );
    }
}

/// (median, p10) µs of summing `floats` floats that thread 0 (`remote`: thread 1) wrote just before, read by thread 0.
fn measure(floats: usize, remote: bool, prefetch: usize) -> (f64, f64) {
    let buffer = Buffer(UnsafeCell::new(vec![0.0; floats]));
    // Round r: phase 2r the writer writes, phase 2r + 1 thread 0 sums.
    let phase = AtomicUsize::new(0);
    let writer = usize::from(remote);
    let mut times = Vec::with_capacity(ROUNDS);
    std::thread::scope(|scope| {
        let (buffer, phase) = (&buffer, &phase);
        // SAFETY (every `buffer.0.get()` below): the phases order the accesses. The writer writes only in phase 2r,
        // which it reaches after thread 0 stored 2r (Release) at the end of its sum; thread 0 sums only in phase
        // 2r + 1, after the writer stored it (Release) once done. Each access thus happens-after the other thread's
        // last one, and none overlap.
        let other = scope.spawn(move || {
            for round in 0..WARMUP + ROUNDS {
                wait(phase, 2 * round);
                if writer == 1 {
                    // SAFETY: phase 2r, the writer's turn (above).
                    write(unsafe { &mut *buffer.0.get() }, round);
                    phase.store(2 * round + 1, Ordering::Release);
                }
            }
        });
        for round in 0..WARMUP + ROUNDS {
            wait(phase, 2 * round);
            if writer == 0 {
                // SAFETY: phase 2r, the writer's turn (above).
                write(unsafe { &mut *buffer.0.get() }, round);
                phase.store(2 * round + 1, Ordering::Release);
            }
            wait(phase, 2 * round + 1);
            let start = Instant::now();
            // SAFETY: phase 2r + 1, thread 0's turn (above).
            black_box(sum(unsafe { &*buffer.0.get() }, prefetch));
            let elapsed = start.elapsed().as_secs_f64() * 1e6;
            if round >= WARMUP {
                times.push(elapsed);
            }
            phase.store(2 * round + 2, Ordering::Release);
        }
        other.join().expect("the other thread");
    });
    times.sort_by(f64::total_cmp);
    (times[times.len() / 2], times[times.len() / 10])
}

/// The floats the two threads take turns at.
struct Buffer(UnsafeCell<Vec<f32>>);

// SAFETY: the threads access the floats only in turns that the phases order (`measure`).
unsafe impl Sync for Buffer {}

fn wait(phase: &AtomicUsize, at_least: usize) {
    while phase.load(Ordering::Acquire) < at_least {
        std::hint::spin_loop();
    }
}

fn write(buffer: &mut [f32], round: usize) {
    buffer.fill(round as f32);
}

/// The buffer's floats summed in 16 lanes (so that the loads, not the additions, bound it), prefetching `ahead` cache
/// lines ahead where not 0.
fn sum(buffer: &[f32], ahead: usize) -> f32 {
    let mut lanes = [0f32; 16];
    let lines = buffer.chunks_exact(16);
    let rest: f32 = lines.remainder().iter().sum();
    for (line, chunk) in lines.enumerate() {
        #[cfg(target_arch = "x86_64")]
        if ahead > 0 {
            if let Some(next) = buffer.get((line + ahead) * 16) {
                // SAFETY: a prefetch of an address within the buffer; it reads nothing that the program sees.
                unsafe {
                    std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                        std::ptr::from_ref(next).cast(),
                    )
                };
            }
        }
        for (lane, x) in lanes.iter_mut().zip(chunk) {
            *lane += x;
        }
    }
    lanes.iter().sum::<f32>() + rest
}
