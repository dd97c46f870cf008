//! `dfc fmt [--check] FILE...`, without the command line parsing: the binary's `src/fmt.rs`
//! passes its arguments and standard streams here.
//!
//! - Without `--check`, each file that is not formatted is rewritten in place (`formatted FILE`).
//! - With `--check`, nothing is written; each file that is not formatted is listed
//!   (`would reformat FILE`).
//! - A directory stands for every `.df` file beneath it (hidden entries skipped), in name order.
//! - `-` is standard input: its formatted text goes to standard output (nothing with `--check`).
//! - A file with syntax errors is left alone and its errors are printed to standard error as
//!   `FILE:LINE:COLUMN: error[CODE]: message`.
//!
//! The result is success unless a file has errors or cannot be read or written, or, with
//! `--check`, a file would be reformatted.

use dfc_diag::{Code, Diagnostic, LineIndex};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// The standard streams of a run.
pub struct Streams<'a> {
    pub stdin: &'a mut dyn Read,
    pub stdout: &'a mut dyn Write,
    pub stderr: &'a mut dyn Write,
}

/// Formats or checks `files`; returns whether all went well (exit status 0).
pub fn run(files: &[PathBuf], check: bool, streams: &mut Streams) -> bool {
    let mut ok = true;
    for file in files {
        if file.as_os_str() == "-" {
            ok &= stdin(check, streams);
            continue;
        }
        match df_files(file) {
            Ok(paths) => {
                for path in paths {
                    ok &= one_file(&path, check, streams);
                }
            }
            Err(error) => {
                let _ = writeln!(streams.stderr, "error: cannot read `{}`: {error}", file.display());
                ok = false;
            }
        }
    }
    ok
}

fn stdin(check: bool, streams: &mut Streams) -> bool {
    let bytes = match dfc_diag::read::read_stream_at_most(&mut streams.stdin, dfc_diag::read::MAX_SOURCE_BYTES) {
        Ok(bytes) => bytes,
        Err(error) => {
            let _ = writeln!(streams.stderr, "error: cannot read standard input: {error}");
            return false;
        }
    };
    let name = "<stdin>";
    let Some((text, formatted)) = format_bytes(name, &bytes, streams.stderr) else { return false };
    if check {
        if formatted != text {
            let _ = writeln!(streams.stdout, "would reformat {name}");
            return false;
        }
        return true;
    }
    streams.stdout.write_all(formatted.as_bytes()).is_ok()
}

fn one_file(path: &Path, check: bool, streams: &mut Streams) -> bool {
    let shown = path.display();
    let bytes = match dfc_diag::read::read_at_most(path, dfc_diag::read::MAX_SOURCE_BYTES) {
        Ok(bytes) => bytes,
        Err(error) => {
            let _ = writeln!(streams.stderr, "error: cannot read `{shown}`: {error}");
            return false;
        }
    };
    let Some((text, formatted)) = format_bytes(&shown.to_string(), &bytes, streams.stderr) else { return false };
    if formatted == text {
        return true;
    }
    if check {
        let _ = writeln!(streams.stdout, "would reformat {shown}");
        return false;
    }
    if let Err(error) = std::fs::write(path, formatted) {
        let _ = writeln!(streams.stderr, "error: cannot write `{shown}`: {error}");
        return false;
    }
    let _ = writeln!(streams.stdout, "formatted {shown}");
    true
}

/// The text and its formatted form, or `None` after printing why there is none.
fn format_bytes<'b>(name: &str, bytes: &'b [u8], stderr: &mut dyn Write) -> Option<(&'b str, String)> {
    let text = match std::str::from_utf8(bytes) {
        Ok(text) => text,
        Err(error) => {
            let valid = std::str::from_utf8(&bytes[..error.valid_up_to()]).unwrap_or_default();
            let line = valid.matches('\n').count() + 1;
            let column = valid.rsplit('\n').next().unwrap_or("").chars().count() + 1;
            let _ = writeln!(stderr, "{name}:{line}:{column}: error[{}]: the file is not valid UTF-8", Code::NOT_UTF8);
            return None;
        }
    };
    match crate::format(text) {
        Ok(formatted) => Some((text, formatted)),
        Err(errors) => {
            let _ = stderr.write_all(render(name, text, &errors).as_bytes());
            None
        }
    }
}

/// `FILE:LINE:COLUMN: error[CODE]: message`, one diagnostic a line.
pub fn render(name: &str, text: &str, diagnostics: &[Diagnostic]) -> String {
    let index = LineIndex::new(text);
    let mut out = String::new();
    for d in diagnostics {
        let at = index.line_col(text, d.primary.span.start as usize);
        out += &format!("{name}:{}:{}: {}[{}]: {}\n", at.line, at.column, d.severity, d.code, d.message);
    }
    out
}

/// `path` itself, or the `.df` files beneath it if it is a directory.
fn df_files(path: &Path) -> std::io::Result<Vec<PathBuf>> {
    if !path.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut entries: Vec<(PathBuf, bool)> = Vec::new();
    for entry in std::fs::read_dir(path)? {
        let entry = entry?;
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        // Symbolic links to directories are not followed (they could make a loop).
        entries.push((entry.path(), entry.file_type()?.is_dir()));
    }
    entries.sort();
    let mut found = Vec::new();
    for (entry, is_dir) in entries {
        if is_dir {
            found.extend(df_files(&entry)?);
        } else if entry.extension().is_some_and(|x| x == "df") {
            found.push(entry);
        }
    }
    Ok(found)
}
