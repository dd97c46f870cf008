//! Subnormal floats flushed to zero during native runs, as TensorFlow's executor and XLA's CPU
//! runtime do: arithmetic on subnormals takes a microcode assist of about a hundred cycles per
//! operation on x86, and an optimizer's running averages of squared gradients (Adam's second
//! moment) drift into that range after an epoch or so — the CNN's Adam epoch went from 8 to 12 s.
//!
//! The interpreter keeps IEEE subnormals: the two backends differ by less than 1.2e-38 in a value
//! that one of them holds as a subnormal.

/// Flush-to-zero (results) and denormals-are-zero (operands) in MXCSR.
#[cfg(target_arch = "x86_64")]
const FLUSH: u32 = 0x8000 | 0x0040;

/// While it lives, this thread flushes subnormals; dropping it restores the thread's mode. The first
/// one in a process also sets rayon's workers (the global pool's), which run native code only.
pub(crate) struct FlushDenormals {
    #[cfg(target_arch = "x86_64")]
    saved: u32,
}

impl FlushDenormals {
    pub(crate) fn new() -> FlushDenormals {
        #[cfg(target_arch = "x86_64")]
        {
            // Read first: where this thread is one of rayon's (`dfc` makes its main thread one), the broadcast
            // sets it too, and dropping this restores the mode it had.
            let saved = mxcsr();
            static WORKERS: std::sync::Once = std::sync::Once::new();
            WORKERS.call_once(|| {
                rayon::broadcast(|_| set_mxcsr(mxcsr() | FLUSH));
            });
            set_mxcsr(saved | FLUSH);
            FlushDenormals { saved }
        }
        #[cfg(not(target_arch = "x86_64"))]
        FlushDenormals {}
    }
}

impl Drop for FlushDenormals {
    fn drop(&mut self) {
        #[cfg(target_arch = "x86_64")]
        set_mxcsr(self.saved);
    }
}

#[cfg(target_arch = "x86_64")]
fn mxcsr() -> u32 {
    let mut value = 0u32;
    // SAFETY: stores the 32-bit MXCSR register to a local.
    unsafe { std::arch::asm!("stmxcsr [{}]", in(reg) &mut value, options(nostack, preserves_flags)) };
    value
}

#[cfg(target_arch = "x86_64")]
fn set_mxcsr(value: u32) {
    // SAFETY: loads MXCSR from a value whose reserved bits are those read from it, with FTZ and DAZ (both
    // supported since SSE2, which x86-64 has) possibly set.
    unsafe { std::arch::asm!("ldmxcsr [{}]", in(reg) &value, options(nostack, readonly, preserves_flags)) };
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    #[test]
    fn subnormals_are_flushed_while_the_guard_lives() {
        let tiny = std::hint::black_box(f32::MIN_POSITIVE);
        let half = || std::hint::black_box(tiny) / std::hint::black_box(2.0f32);
        assert!(half() > 0.0, "IEEE subnormal before");
        {
            let _flush = FlushDenormals::new();
            assert_eq!(half(), 0.0);
            let on_worker = rayon::broadcast(|_| std::hint::black_box(tiny) / std::hint::black_box(2.0f32));
            assert!(on_worker.iter().all(|&x| x == 0.0));
        }
        assert!(half() > 0.0, "restored after");
    }
}
