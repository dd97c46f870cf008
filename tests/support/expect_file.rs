//! Expected-output files: compares an actual output with the file, or rewrites the file under
//! `UPDATE_EXPECT=1`. Shared by the data-driven tests (`#[path]`-included).

use std::path::Path;

/// Compares `actual` with the file at `expected`, or rewrites it under UPDATE_EXPECT=1.
/// Returns a failure message instead of panicking, so one run reports every mismatch.
pub fn expect_file(expected: &Path, actual: &str) -> Option<String> {
    if std::env::var_os("UPDATE_EXPECT").is_some() {
        std::fs::write(expected, actual).expect("write expected file");
        return None;
    }
    let want = std::fs::read_to_string(expected).unwrap_or_default();
    if want == actual {
        return None;
    }
    let first_difference = want
        .lines()
        .zip(actual.lines())
        .position(|(a, b)| a != b)
        .unwrap_or(want.lines().count().min(actual.lines().count()));
    Some(format!(
        "{} differs from the actual output at line {} (run with UPDATE_EXPECT=1 to accept):\n--- actual ---\n{actual}",
        expected.display(),
        first_difference + 1
    ))
}
