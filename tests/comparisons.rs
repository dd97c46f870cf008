//! The tests' comparison helpers (`tests/support/close.rs`) fail on a NaN and on a length
//! mismatch, and pass what is within tolerance.

#[path = "support/close.rs"]
mod close;

use std::panic::catch_unwind;

fn fails(f: impl FnOnce() + std::panic::UnwindSafe) -> bool {
    catch_unwind(f).is_err()
}

#[test]
fn nan_and_length_mismatches_fail() {
    assert!(!fails(|| close::assert_close("within", &[1.0, 2.0 + 1e-9], &[1.0, 2.0], 1e-6)));
    assert!(fails(|| close::assert_close("beyond", &[1.0, 2.1], &[1.0, 2.0], 1e-6)));
    assert!(fails(|| close::assert_close("NaN actual", &[f64::NAN, 2.0], &[1.0, 2.0], 1e-6)));
    assert!(fails(|| close::assert_close("NaN expected", &[1.0, 2.0], &[1.0, f64::NAN], 1e-6)));
    assert!(fails(|| close::assert_close("both NaN", &[f64::NAN], &[f64::NAN], 1e-6)));
    assert!(fails(|| close::assert_close("infinities", &[f64::INFINITY], &[f64::INFINITY], 1e-6)));
    assert!(fails(|| close::assert_close("shorter", &[1.0], &[1.0, 2.0], 1e-6)));
    assert!(fails(|| close::assert_close("longer", &[1.0, 2.0, 3.0], &[1.0, 2.0], 1e-6)));
    assert!(fails(|| close::assert_close("empty", &[], &[1.0], 1e-6)));

    // The worst difference: a NaN anywhere makes it NaN, which no bound admits.
    let worst = close::worst_difference("w", &[0.0, f64::NAN, 5.0], &[0.0, 0.0, 0.0], close::absolute);
    assert!(worst.is_nan());
    let worst = close::worst_difference("w", &[1.0, 5.0, f64::NAN], &[0.0, 0.0, 0.0], close::absolute);
    assert!(!(worst < 1e9), "a NaN after the largest difference still counts");
    assert_eq!(close::worst_difference("w", &[1.0, -3.0], &[0.0, 0.0], close::absolute), 3.0);
    assert!(fails(|| {
        close::worst_difference("w", &[1.0], &[1.0, 1.0], close::absolute);
    }));
}
