//! Data-driven tests: every input file under tests/ is run through a stage and compared with
//! the expected output file beside it. `UPDATE_EXPECT=1 cargo test` rewrites the expected files.
//!
//! - `tests/parser/ok/*.df`   → `*.ast`  (normalised AST; no diagnostics allowed)
//! - `tests/parser/err/*.df`  → `*.diag` (every diagnostic, with line:column)
//! - `tests/ir/*.df`, `examples/*.df` → `tests/ir/*.ir`, `tests/examples/*.ir` (IR text; verified)
//! - `tests/passes/*.df` → `*.pool_early.ir`, `*.autodiff.ir`, `*.optimizer.ir`, `*.simplify.ir` (IR after
//!   each pass)
//! - `tests/diagnostics/*.df` carry their expectations inline: a comment line of carets under
//!   the faulty text, then the code and optionally part of the message (or of its label). Every
//!   diagnostic needs a marker and every marker a diagnostic:
//!   ```text
//!       let h = x @ w
//!   //          ^^^^^ E0203: inner dimensions
//!   ```

use dfc_diag::{Diagnostic, LineIndex};
use std::path::{Path, PathBuf};

#[path = "support/expect_file.rs"]
mod expect_file;

use expect_file::expect_file;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn df_files(dir: &str) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(root().join(dir))
        .unwrap_or_else(|e| panic!("cannot read {dir}: {e}"))
        .map(|e| e.expect("directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "df"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no .df files in {dir}");
    files
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

fn finish(failures: Vec<String>) {
    if !failures.is_empty() {
        panic!("{} failure(s):\n\n{}", failures.len(), failures.join("\n\n"));
    }
}

/// `line:col-line:col severity[code]: message` plus label and help, one diagnostic per block.
fn plain(text: &str, diagnostics: &[Diagnostic]) -> String {
    let index = LineIndex::new(text);
    let mut out = String::new();
    for d in diagnostics {
        let start = index.line_col(text, d.primary.span.start as usize);
        let end = index.line_col(text, d.primary.span.end as usize);
        out += &format!(
            "{}:{}-{}:{} {}[{}]: {}\n",
            start.line, start.column, end.line, end.column, d.severity, d.code, d.message
        );
        if !d.primary.message.is_empty() {
            out += &format!("    label: {}\n", d.primary.message);
        }
        for label in &d.secondary {
            let at = index.line_col(text, label.span.start as usize);
            out += &format!("    note at {}:{}: {}\n", at.line, at.column, label.message);
        }
        if let Some(help) = &d.help {
            out += &format!("    help: {help}\n");
        }
    }
    out
}

#[test]
fn parser_accepts_valid_files() {
    let mut failures = Vec::new();
    for path in df_files("tests/parser/ok") {
        let text = read(&path);
        let (file, diagnostics) = dfc_syntax::parse(&text);
        if !diagnostics.is_empty() {
            failures.push(format!("{}: unexpected syntax errors:\n{}", path.display(), plain(&text, &diagnostics)));
            continue;
        }
        failures.extend(expect_file(&path.with_extension("ast"), &dfc_syntax::dump(&file)));
    }
    finish(failures);
}

#[test]
fn parser_reports_syntax_errors() {
    let mut failures = Vec::new();
    for path in df_files("tests/parser/err") {
        let text = read(&path);
        let (_, diagnostics) = dfc_syntax::parse(&text);
        if diagnostics.is_empty() {
            failures.push(format!("{}: expected syntax errors, found none", path.display()));
            continue;
        }
        failures.extend(expect_file(&path.with_extension("diag"), &plain(&text, &diagnostics)));
    }
    finish(failures);
}

/// The IR of every model, verified, against its golden text.
fn ir_golden(dir: &str, expected_dir: &str) {
    let mut failures = Vec::new();
    for path in df_files(dir) {
        let text = read(&path);
        let (analyses, diagnostics) = dfc_sema::check_source(&text, &dfc_sema::Options::default());
        if diagnostics.iter().any(|d| d.is_error()) || analyses.is_empty() {
            failures.push(format!("{}: does not compile:\n{}", path.display(), plain(&text, &diagnostics)));
            continue;
        }
        let mut printed = String::new();
        for analysis in analyses {
            let module = analysis.module.expect("no errors, so a module");
            let problems = dfc_ir::verify(&module, dfc_ir::VerifyOptions::default());
            if !problems.is_empty() {
                failures.push(format!("{}: IR fails verification: {problems:?}", path.display()));
            }
            printed += &dfc_ir::print(&module);
        }
        let stem = path.file_stem().expect("file name").to_string_lossy().into_owned();
        failures.extend(expect_file(&root().join(expected_dir).join(format!("{stem}.ir")), &printed));
    }
    finish(failures);
}

#[test]
fn ir_of_test_models() {
    ir_golden("tests/ir", "tests/ir");
}

#[test]
fn ir_of_examples() {
    ir_golden("examples", "tests/examples");
}

/// The IR after each pass, verified: `tests/passes/*.df` → `tests/passes/*.{pool_early,autodiff,
/// optimizer,simplify}.ir`, and the examples after the whole pipeline → `tests/passes/examples/*.simplify.ir`.
#[test]
fn ir_after_passes() {
    let mut failures = Vec::new();
    let all: &[&str] = &["pool_early", "autodiff", "optimizer", "simplify"];
    for (dir, expected_dir, passes) in
        [("tests/passes", "tests/passes", all), ("examples", "tests/passes/examples", &["simplify"])]
    {
        for path in df_files(dir) {
            let text = read(&path);
            let (analyses, diagnostics) = dfc_sema::check_source(&text, &dfc_sema::Options::default());
            if diagnostics.iter().any(|d| d.is_error()) || analyses.is_empty() {
                failures.push(format!("{}: does not compile:\n{}", path.display(), plain(&text, &diagnostics)));
                continue;
            }
            let modules: Vec<dfc_ir::Module> =
                analyses.into_iter().map(|a| a.module.expect("no errors, so a module")).collect();
            for pass in passes {
                let mut printed = String::new();
                for module in &modules {
                    let mut module = module.clone();
                    dfc_passes::run_pipeline(&mut module, Some(pass));
                    let problems = dfc_ir::verify(&module, dfc_ir::VerifyOptions::default());
                    if !problems.is_empty() {
                        failures.push(format!("{}: IR fails verification after {pass}: {problems:?}", path.display()));
                    }
                    printed += &dfc_ir::print(&module);
                }
                let stem = path.file_stem().expect("file name").to_string_lossy().into_owned();
                let expected = root().join(expected_dir).join(format!("{stem}.{pass}.ir"));
                failures.extend(expect_file(&expected, &printed));
            }
        }
    }
    finish(failures);
}

struct Marker {
    line: usize,
    column: usize,
    width: usize,
    code: String,
    message: Option<String>,
}

/// Markers: `// ^^^ CODE[: message part]` under the line they point into.
fn markers(text: &str) -> Vec<Marker> {
    let mut found = Vec::new();
    let mut target_line = 0;
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        let Some(rest) = trimmed.strip_prefix("//") else {
            target_line = i + 1;
            continue;
        };
        let Some(caret_offset) = rest.find('^').filter(|&o| rest[..o].trim().is_empty()) else {
            target_line = i + 1;
            continue;
        };
        let before = line.len() - trimmed.len() + 2 + caret_offset;
        let column = line[..before].chars().count() + 1;
        let after = &rest[caret_offset..];
        let width = after.chars().take_while(|&c| c == '^').count();
        let spec = after[width..].trim();
        let (code, message) = match spec.split_once(':') {
            Some((code, message)) => (code.trim().to_string(), Some(message.trim().to_string())),
            None => (spec.to_string(), None),
        };
        found.push(Marker { line: target_line, column, width, code, message });
    }
    found
}

#[test]
fn diagnostics_match_inline_markers() {
    let mut failures = Vec::new();
    for path in df_files("tests/diagnostics") {
        let text = read(&path);
        let index = LineIndex::new(&text);
        let (_, diagnostics) = dfc_sema::check_source(&text, &dfc_sema::Options::default());
        let mut expected = markers(&text);
        assert!(!expected.is_empty(), "{} has no markers", path.display());
        let mut unexpected = Vec::new();
        for d in &diagnostics {
            let start = index.line_col(&text, d.primary.span.start as usize);
            let end = index.line_col(&text, d.primary.span.end as usize);
            let width = if start.line == end.line { (end.column - start.column).max(1) } else { 0 };
            let hit = expected.iter().position(|m| {
                m.line == start.line
                    && m.column == start.column
                    && (width == 0 || m.width == width)
                    && m.code == d.code.as_str()
                    && m.message.as_ref().is_none_or(|part| {
                        d.message.contains(part.as_str()) || d.primary.message.contains(part.as_str())
                    })
            });
            match hit {
                Some(i) => {
                    expected.remove(i);
                }
                None => unexpected
                    .push(format!("  {}:{} (width {width}) {}: {}", start.line, start.column, d.code, d.message)),
            }
        }
        let missing: Vec<String> = expected
            .iter()
            .map(|m| {
                format!(
                    "  {}:{} (width {}) {}{}",
                    m.line,
                    m.column,
                    m.width,
                    m.code,
                    m.message.as_ref().map(|s| format!(": {s}")).unwrap_or_default()
                )
            })
            .collect();
        if !unexpected.is_empty() || !missing.is_empty() {
            failures.push(format!(
                "{}:\n unexpected diagnostics:\n{}\n markers with no diagnostic:\n{}",
                path.display(),
                unexpected.join("\n"),
                missing.join("\n")
            ));
        }
    }
    finish(failures);
}

#[test]
fn every_diagnostic_code_is_documented() {
    let docs = read(&root().join("docs/diagnostics.md"));
    let missing: Vec<&str> =
        dfc_diag::ALL_CODES.iter().map(|(c, _)| c.as_str()).filter(|c| !docs.contains(c)).collect();
    assert!(missing.is_empty(), "docs/diagnostics.md does not mention {missing:?}");
}

#[test]
fn every_op_is_documented() {
    let docs = read(&root().join("docs/language.md"));
    let missing: Vec<&str> = dfc_sema::OPS
        .iter()
        .chain(dfc_sema::SCHEDULES)
        .map(|(name, _, _)| *name)
        .filter(|n| !docs.contains(&format!("`{n}")))
        .collect();
    assert!(missing.is_empty(), "docs/language.md does not document {missing:?}");
}

/// Pictures: `dfc graph`'s DOT for the models with devices, whole and with scopes folded, in
/// `tests/graph/`.
#[test]
fn graph_pictures() {
    let mut failures = Vec::new();
    for path in
        [root().join("tests/ir/devices.df"), root().join("examples/wide_and_deep.df"), root().join("examples/mlp.df")]
    {
        let text = read(&path);
        let (module, diagnostics) = dfc_sema::compile_source(&text, None, &dfc_sema::Options::default());
        let Some(mut module) = module else {
            failures.push(format!("{}: {}", path.display(), plain(&text, &diagnostics)));
            continue;
        };
        dfc_passes::run_pipeline(&mut module, None);
        let stem = path.file_stem().expect("file name").to_string_lossy().into_owned();
        for (suffix, collapse) in [("dot", None), ("collapsed.dot", Some(1))] {
            let dot = dfc_ir::to_dot(&module, &dfc_ir::DotOptions { collapse_depth: collapse });
            failures.extend(expect_file(&root().join("tests/graph").join(format!("{stem}.{suffix}")), &dot));
        }
    }
    finish(failures);
}

/// Partitioned IR: `dfc ir FILE --after partition ARGS`, with the ARGS of the file's first line
/// (`// dfc-args: ...`), compared with `tests/partitions/NAME.ir`. The partitions print as one
/// graph whose every node shows its device, with the Send/Recv pairs between them.
#[test]
fn partitioned_ir() {
    let dir = root().join("tests/partitions");
    let mut failures = Vec::new();
    for path in df_files("tests/partitions") {
        let text = read(&path);
        let Some(args) = text.lines().next().and_then(|l| l.strip_prefix("// dfc-args:")) else {
            failures.push(format!("{}: the first line must be `// dfc-args: ...`", path.display()));
            continue;
        };
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_dfc"))
            .current_dir(&dir)
            .args(["ir", path.file_name().unwrap().to_str().unwrap(), "--after", "partition"])
            .args(args.split_whitespace())
            .output()
            .expect("dfc runs");
        if !output.status.success() {
            failures.push(format!("{}: dfc failed:\n{}", path.display(), String::from_utf8_lossy(&output.stderr)));
            continue;
        }
        let ir = String::from_utf8(output.stdout).expect("utf-8");
        failures.extend(expect_file(&path.with_extension("ir"), &ir));
    }
    finish(failures);
}
