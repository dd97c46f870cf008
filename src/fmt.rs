//! `dfc fmt [--check] FILE...`: formats .df files in place, or lists those that are not formatted.
//! The work, and its tests, are in `dfc_fmt::cli`; the rules are in docs/language.md,
//! "Formatting".

use std::path::PathBuf;
use std::process::ExitCode;

/// Formats `files` (a directory: its `.df` files; `-`: standard input to standard output), or with
/// `check` only lists the files that would change. Exit status 1 if a file has syntax errors or
/// cannot be read or written, or, with `check`, if a file would be reformatted.
pub fn run(files: &[PathBuf], check: bool) -> ExitCode {
    let (stdin, stdout, stderr) = (std::io::stdin(), std::io::stdout(), std::io::stderr());
    let mut streams =
        dfc_fmt::cli::Streams { stdin: &mut stdin.lock(), stdout: &mut stdout.lock(), stderr: &mut stderr.lock() };
    if dfc_fmt::cli::run(files, check, &mut streams) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
