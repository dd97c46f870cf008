//! Data-driven tests of the formatter.
//!
//! - `tests/format/*.df` (the workspace's) → `*.formatted`; `UPDATE_EXPECT=1 cargo test -p dfc-fmt`
//!   rewrites the expected files.
//! - Every expected output, every `examples/*.df` and every `tests/**/*.df` that parses: the
//!   formatter is idempotent, keeps every non-whitespace character in order and keeps the AST.
//! - Every `examples/*.df` is already formatted.
//! - Random mutations of the examples: never a panic; what formats is idempotent and preserved.
//! - `dfc fmt` (`dfc_fmt::cli::run`): in place, `--check`, standard input, errors.

use dfc_fmt::cli::{self, Streams};
use std::path::{Path, PathBuf};

#[path = "../../../tests/support/expect_file.rs"]
mod expect_file;

use expect_file::expect_file;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The `.df` files under `dir` (relative to the workspace), recursively, sorted.
fn df_files(dir: &str) -> Vec<PathBuf> {
    fn walk(dir: &Path, found: &mut Vec<PathBuf>) {
        let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()));
        for entry in entries {
            let path = entry.expect("directory entry").path();
            if path.is_dir() {
                walk(&path, found);
            } else if path.extension().is_some_and(|x| x == "df") {
                found.push(path);
            }
        }
    }
    let mut found = Vec::new();
    walk(&workspace().join(dir), &mut found);
    found.sort();
    assert!(!found.is_empty(), "no .df files in {dir}");
    found
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

fn name(path: &Path) -> String {
    path.strip_prefix(workspace()).unwrap_or(path).display().to_string()
}

fn finish(failures: Vec<String>) {
    if !failures.is_empty() {
        panic!("{} failure(s):\n\n{}", failures.len(), failures.join("\n\n"));
    }
}

/// The text without whitespace (a byte-order mark counts as whitespace, as in the grammar).
fn significant(text: &str) -> String {
    text.chars().filter(|c| !c.is_whitespace() && *c != '\u{feff}').collect()
}

fn ast(text: &str) -> String {
    dfc_syntax::dump(&dfc_syntax::parse(text).0)
}

/// What must hold of `formatted`, the formatting of `original`; `None` if it does.
fn check_formatted(what: &str, original: &str, formatted: &str) -> Option<String> {
    match dfc_fmt::format(formatted) {
        Err(errors) => return Some(format!("{what}: the formatted text does not parse: {errors:?}\n{formatted}")),
        Ok(again) if again != formatted => {
            return Some(format!("{what}: not idempotent:\n--- once ---\n{formatted}\n--- twice ---\n{again}"))
        }
        Ok(_) => {}
    }
    if significant(original) != significant(formatted) {
        return Some(format!(
            "{what}: the non-whitespace text changed:\n--- original ---\n{original}\n--- formatted ---\n{formatted}"
        ));
    }
    if ast(original) != ast(formatted) {
        return Some(format!("{what}: the AST changed:\n--- original ---\n{original}\n--- formatted ---\n{formatted}"));
    }
    if formatted.contains('\r') && !original.contains('\r') {
        return Some(format!("{what}: a carriage return appeared"));
    }
    if formatted.lines().any(|line| line.ends_with([' ', '\t'])) {
        return Some(format!("{what}: trailing whitespace:\n{formatted}"));
    }
    if !(formatted.is_empty() || formatted.ends_with('\n') && !formatted.ends_with("\n\n")) {
        return Some(format!("{what}: does not end with exactly one newline:\n{formatted:?}"));
    }
    // (Block comments keep their blank lines.)
    if formatted.contains("\n\n\n") && !formatted.contains("/*") {
        return Some(format!("{what}: two blank lines in a row:\n{formatted}"));
    }
    None
}

#[test]
fn golden_files() {
    let mut failures = Vec::new();
    let inputs = df_files("tests/format");
    for input in &inputs {
        let text = read(input);
        let expected = input.with_extension("formatted");
        match dfc_fmt::format(&text) {
            Ok(formatted) => {
                failures.extend(expect_file(&expected, &formatted));
                failures.extend(check_formatted(&name(input), &text, &formatted));
            }
            Err(errors) => failures.push(format!("{} does not parse: {errors:?}", name(input))),
        }
    }
    // Every expected file has its input.
    for entry in std::fs::read_dir(workspace().join("tests/format")).expect("tests/format") {
        let path = entry.expect("directory entry").path();
        if path.extension().is_some_and(|x| x == "formatted") && !path.with_extension("df").exists() {
            failures.push(format!("{} has no input", name(&path)));
        }
    }
    finish(failures);
}

#[test]
fn examples_are_formatted() {
    let mut failures = Vec::new();
    for path in df_files("examples") {
        let text = read(&path);
        match dfc_fmt::format(&text) {
            Ok(formatted) if formatted == text => {}
            Ok(formatted) => failures.push(format!("{} is not formatted; it would be:\n{formatted}", name(&path))),
            Err(errors) => failures.push(format!("{} does not parse: {errors:?}", name(&path))),
        }
    }
    finish(failures);
}

#[test]
fn idempotent_and_preserving_on_every_file() {
    let mut failures = Vec::new();
    let mut formatted_files = 0;
    let mut files = df_files("examples");
    files.extend(df_files("tests"));
    for path in files {
        let text = read(&path);
        // Files with syntax errors (tests/parser/err) must come back as errors, untouched.
        let Ok(formatted) = dfc_fmt::format(&text) else { continue };
        formatted_files += 1;
        failures.extend(check_formatted(&name(&path), &text, &formatted));
    }
    assert!(formatted_files > 20, "only {formatted_files} files formatted");
    finish(failures);
}

/// The `df` code blocks of the documentation that parse (their trailing comments are aligned by
/// hand, so not all are formatted).
#[test]
fn idempotent_and_preserving_on_the_documentation() {
    let mut failures = Vec::new();
    let mut blocks = 0;
    for doc in ["docs/language.md", "README.md"] {
        let Ok(text) = std::fs::read_to_string(workspace().join(doc)) else { continue };
        // The examples of the section on formatting are formatted.
        let formatting = text.find("\n## Formatting\n").unwrap_or(text.len());
        let mut at = 0;
        for (n, block) in text.split("```df\n").enumerate() {
            let start = at;
            at += block.len() + "```df\n".len();
            if n == 0 {
                continue;
            }
            let code = block.split("```").next().unwrap_or_default();
            if let Ok(formatted) = dfc_fmt::format(code) {
                blocks += 1;
                let what = format!("{doc}, block {n}");
                failures.extend(check_formatted(&what, code, &formatted));
                if start > formatting && formatted != code {
                    failures.push(format!("{what} is not formatted; it would be:\n{formatted}"));
                }
            }
        }
    }
    assert!(blocks > 10, "only {blocks} blocks formatted");
    finish(failures);
}

#[test]
fn syntax_errors_are_returned() {
    for path in df_files("tests/parser/err") {
        let text = read(&path);
        let errors = dfc_fmt::format(&text).expect_err(&name(&path));
        assert!(!errors.is_empty() && errors.iter().all(|d| d.is_error()), "{}", name(&path));
    }
}

/// Random edits of the examples: characters, tokens and whitespace deleted, inserted, doubled.
fn mutate(rng: &mut fastrand::Rng, text: &str) -> String {
    const SNIPPETS: &[&str] = &[
        " ",
        "  ",
        "\n",
        "\n\n\n",
        "\t",
        "\r\n",
        "(",
        ")",
        "[",
        "]",
        "{",
        "}",
        ",",
        ":",
        "=",
        "==",
        "-",
        "- ",
        "+",
        "*",
        "/",
        "@",
        "@device(\"cpu\")",
        "<",
        ">",
        "->",
        "\"",
        "\\",
        "//",
        "// c\n",
        "/*",
        "*/",
        "/* c */",
        "/* a\n  b */",
        "1",
        ".5",
        "1e-3",
        "x",
        "let",
        "let y = 1\n",
        "f32",
        "cast<f32>(",
        "\u{feff}",
        "é",
        "model",
        "device",
        ";",
        "!",
    ];
    let mut chars: Vec<char> = text.chars().collect();
    for _ in 0..rng.usize(1..=4) {
        let at = rng.usize(0..=chars.len());
        match rng.u8(0..8) {
            // Delete a few characters.
            0 => {
                let end = (at + rng.usize(1..=3)).min(chars.len());
                chars.drain(at..end);
            }
            // Insert a snippet.
            1 | 2 => {
                let snippet = SNIPPETS[rng.usize(0..SNIPPETS.len())];
                chars.splice(at..at, snippet.chars());
            }
            // Double a slice.
            3 => {
                let end = (at + rng.usize(1..=12)).min(chars.len());
                let slice: Vec<char> = chars[at..end].to_vec();
                chars.splice(at..at, slice);
            }
            // Delete a word.
            4 => {
                let end = chars[at..].iter().position(|c| c.is_whitespace()).map_or(chars.len(), |n| at + n);
                chars.drain(at..end);
            }
            // Change the whitespace around a point: more, less, other.
            _ => {
                let start = chars[..at].iter().rposition(|c| !c.is_whitespace()).map_or(0, |n| n + 1);
                let end = chars[at..].iter().position(|c| !c.is_whitespace()).map_or(chars.len(), |n| at + n);
                let had_newline = chars[start..end].contains(&'\n');
                let replacement: &str = match rng.u8(0..6) {
                    0 => "",
                    1 => " ",
                    2 => "   \t ",
                    3 => "\n",
                    4 => "\n\n\n   ",
                    _ if had_newline => "  // a comment\n",
                    _ => " /* c */ ",
                };
                chars.splice(start..end, replacement.chars());
            }
        }
    }
    chars.into_iter().collect()
}

#[test]
fn random_mutations() {
    let mut rng = fastrand::Rng::with_seed(0x0df0_0df0);
    let mut sources: Vec<(String, String)> = Vec::new();
    for dir in ["examples", "tests/format", "tests/parser/ok"] {
        for path in df_files(dir) {
            sources.push((name(&path), read(&path)));
        }
    }
    let mut failures = Vec::new();
    let (mut tried, mut formatted) = (0, 0);
    for (source, text) in &sources {
        for round in 0..200 {
            let mutated = mutate(&mut rng, text);
            tried += 1;
            // The unchecked layout must not panic on anything either.
            let _ = dfc_fmt::format_unchecked(&mutated);
            if let Ok(out) = dfc_fmt::format(&mutated) {
                formatted += 1;
                if let Some(failure) = check_formatted(&format!("{source}, mutation {round}"), &mutated, &out) {
                    failures.push(format!("{failure}\n--- input ---\n{mutated:?}"));
                    if failures.len() > 5 {
                        break;
                    }
                }
            }
        }
    }
    eprintln!("{tried} mutations, {formatted} formatted");
    assert!(formatted * 5 > tried, "too few mutations parse ({formatted} of {tried}): the test tests little");
    finish(failures);
}

/// `text` with every run of whitespace between tokens replaced by another with the same line
/// breaks (spaces, tabs, trailing whitespace, carriage returns), strings and comments untouched.
fn respace(rng: &mut fastrand::Rng, text: &str) -> String {
    const HORIZONTAL: &[&str] = &["", " ", "  ", "\t", " \t  ", "        "];
    let mut out = String::new();
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        let end = if rest.starts_with("//") {
            rest.find('\n').unwrap_or(rest.len())
        } else if let Some(body) = rest.strip_prefix("/*") {
            body.find("*/").map_or(rest.len(), |n| n + 4)
        } else if c == '"' {
            let mut escaped = false;
            rest.char_indices()
                .skip(1)
                .find(|&(_, c)| {
                    let end = !escaped && (c == '"' || c == '\n');
                    escaped = !escaped && c == '\\';
                    end
                })
                .map_or(rest.len(), |(n, c)| if c == '"' { n + 1 } else { n })
        } else if c.is_ascii_whitespace() {
            let run = rest.find(|c: char| !c.is_ascii_whitespace()).unwrap_or(rest.len());
            let newlines = rest[..run].matches('\n').count();
            let horizontal = |rng: &mut fastrand::Rng| HORIZONTAL[rng.usize(0..HORIZONTAL.len())];
            if newlines == 0 {
                out.push_str(HORIZONTAL[rng.usize(1..HORIZONTAL.len())]);
            } else {
                for _ in 0..newlines {
                    out.push_str(horizontal(rng));
                    out.push_str(if rng.bool() { "\r\n" } else { "\n" });
                }
                out.push_str(horizontal(rng));
            }
            rest = &rest[run..];
            continue;
        } else {
            c.len_utf8()
        };
        out.push_str(&rest[..end]);
        rest = &rest[end..];
    }
    out
}

/// Spaces, tabs and indentation do not matter: only the tokens and the line breaks do.
#[test]
fn layout_depends_only_on_tokens_and_line_breaks() {
    let mut rng = fastrand::Rng::with_seed(42);
    let mut failures = Vec::new();
    let mut files = df_files("examples");
    files.extend(df_files("tests"));
    let mut checked = 0;
    for path in files {
        let text = read(&path);
        let Ok(want) = dfc_fmt::format(&text) else { continue };
        for round in 0..20 {
            let variant = respace(&mut rng, &text);
            checked += 1;
            match dfc_fmt::format(&variant) {
                Ok(got) if got == want => {}
                Ok(got) => failures.push(format!(
                    "{}, variant {round}: formats differently:\n--- variant ---\n{variant:?}\n--- formatted ---\n{got}",
                    name(&path)
                )),
                Err(errors) => failures.push(format!("{}, variant {round}: {errors:?}\n{variant:?}", name(&path))),
            }
            if failures.len() > 5 {
                finish(failures);
                return;
            }
        }
    }
    assert!(checked > 400, "only {checked} variants");
    finish(failures);
}

#[test]
fn arbitrary_text_never_panics() {
    let mut rng = fastrand::Rng::with_seed(7);
    let alphabet: Vec<char> = "abf32 \n\t\r{}()[]<>,:=+-*/@\"\\.e1_!;é\u{feff}".chars().collect();
    for _ in 0..2000 {
        let text: String = (0..rng.usize(0..60)).map(|_| alphabet[rng.usize(0..alphabet.len())]).collect();
        let _ = dfc_fmt::format_unchecked(&text);
        if let Ok(out) = dfc_fmt::format(&text) {
            assert_eq!(dfc_fmt::format(&out).ok().as_deref(), Some(out.as_str()), "{text:?}");
        }
    }
    let deep = format!("model m {{ let x = {}1{} output x }}", "(".repeat(5000), ")".repeat(5000));
    assert!(dfc_fmt::format(&deep).is_err());
    let _ = dfc_fmt::format_unchecked(&deep);
    let unbalanced = "model m {\n    let x = f(]]]\n)))\n}}}\n{{{ [[[ (((";
    let _ = dfc_fmt::format_unchecked(unbalanced);
}

// ---------------------------------------------------------------------------------------------
// `dfc fmt`

struct Run {
    ok: bool,
    stdout: String,
    stderr: String,
}

fn run(files: &[PathBuf], check: bool, stdin: &str) -> Run {
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    let mut input = stdin.as_bytes();
    let ok = cli::run(files, check, &mut Streams { stdin: &mut input, stdout: &mut stdout, stderr: &mut stderr });
    Run { ok, stdout: String::from_utf8(stdout).expect("utf-8"), stderr: String::from_utf8(stderr).expect("utf-8") }
}

/// A fresh, empty directory for one test.
fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("dfc-fmt-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create scratch directory");
    dir
}

const MESSY: &str = "model m{\n  input x:f32[2]\n\n\n  output x}\n";
const TIDY: &str = "model m {\n    input x: f32[2]\n\n    output x }\n";
const BROKEN: &str = "model m {\n    let = 1\n}\n";

#[test]
fn fmt_rewrites_files_in_place() {
    let dir = scratch("in-place");
    let (messy, tidy, broken) = (dir.join("messy.df"), dir.join("tidy.df"), dir.join("broken.df"));
    std::fs::write(&messy, MESSY).unwrap();
    std::fs::write(&tidy, TIDY).unwrap();

    let out = run(&[messy.clone(), tidy.clone()], false, "");
    assert!(out.ok, "{}", out.stderr);
    assert_eq!(out.stdout, format!("formatted {}\n", messy.display()));
    assert_eq!(read(&messy), TIDY);
    assert_eq!(read(&tidy), TIDY);

    std::fs::write(&broken, BROKEN).unwrap();
    let out = run(&[broken.clone(), messy.clone()], false, "");
    assert!(!out.ok);
    assert_eq!(out.stdout, "");
    assert!(out.stderr.starts_with(&format!("{}:2:9: error[E0001]: ", broken.display())), "{}", out.stderr);
    assert_eq!(read(&broken), BROKEN, "a file with errors is left alone");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn fmt_check_lists_what_would_change() {
    let dir = scratch("check");
    let (messy, tidy) = (dir.join("messy.df"), dir.join("sub/tidy.df"));
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    std::fs::write(&messy, MESSY).unwrap();
    std::fs::write(&tidy, TIDY).unwrap();
    std::fs::write(dir.join("notes.txt"), "not a model").unwrap();

    let out = run(std::slice::from_ref(&tidy), true, "");
    assert!(out.ok && out.stdout.is_empty() && out.stderr.is_empty());
    // A directory stands for its .df files.
    let out = run(std::slice::from_ref(&dir), true, "");
    assert!(!out.ok);
    assert_eq!(out.stdout, format!("would reformat {}\n", messy.display()));
    assert_eq!(read(&messy), MESSY, "--check writes nothing");

    let missing = dir.join("missing.df");
    let out = run(std::slice::from_ref(&missing), true, "");
    assert!(!out.ok && out.stderr.starts_with("error: cannot read"), "{}", out.stderr);

    std::fs::write(&messy, b"model m {\n  input \xff\n}\n").unwrap();
    let out = run(std::slice::from_ref(&messy), true, "");
    assert!(!out.ok);
    assert_eq!(out.stderr, format!("{}:2:9: error[E0004]: the file is not valid UTF-8\n", messy.display()));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn fmt_reads_standard_input() {
    let stdin = [PathBuf::from("-")];
    let out = run(&stdin, false, MESSY);
    assert!(out.ok);
    assert_eq!(out.stdout, TIDY);
    let out = run(&stdin, true, MESSY);
    assert!(!out.ok);
    assert_eq!(out.stdout, "would reformat <stdin>\n");
    let out = run(&stdin, true, TIDY);
    assert!(out.ok && out.stdout.is_empty());
    let out = run(&stdin, false, BROKEN);
    assert!(!out.ok && out.stdout.is_empty());
    assert!(out.stderr.starts_with("<stdin>:2:9: error[E0001]: "), "{}", out.stderr);
}
