//! Every `unsafe` block and `unsafe impl` in the workspace's Rust sources says why it is sound in
//! a `// SAFETY:` comment (on its line, or in the comments and attributes right above it), and
//! every `unsafe fn` states its contract (a `# Safety` section, or a `#[target_feature]`, whose
//! contract is the CPU's features), but for the methods of a trait's impl, whose contract is the
//! trait's (stated where the trait declares them, which is checked too). Clippy's
//! `undocumented_unsafe_blocks` does the first part, but CI does not run clippy; this runs with
//! the tests.

use std::path::{Path, PathBuf};

/// The directories with the workspace's Rust sources.
const ROOTS: [&str; 5] = ["compiler", "runtime", "src", "tests", "benches"];

#[test]
fn every_unsafe_block_impl_and_fn_says_why() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in ROOTS {
        rust_files(&root.join(dir), &mut files);
    }
    assert!(files.len() > 100, "the workspace's sources: {} files", files.len());
    let mut undocumented = Vec::new();
    let mut seen = 0;
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        let found = check(&text);
        seen += found.checked;
        let shown = file.strip_prefix(root).unwrap_or(file).display().to_string();
        undocumented.extend(found.undocumented.into_iter().map(|(line, what)| format!("{shown}:{line}: {what}")));
    }
    assert!(seen > 50, "only {seen} unsafe sites found: is the scan broken?");
    assert!(undocumented.is_empty(), "unsafe code without its argument:\n{}", undocumented.join("\n"));
}

#[test]
fn the_check_finds_what_it_looks_for() {
    let documented = r#"
// SAFETY: a reason.
unsafe impl Send for A {}
fn f() {
    // SAFETY: a reason that takes
    // two lines.
    #[allow(unused)]
    let x = unsafe { g() };
    let y = h(|| unsafe { g() }); // SAFETY: said on the line.
    let s = "unsafe { in a string }";
}
/// # Safety
/// A contract.
unsafe fn g() {}
#[target_feature(enable = "avx2")]
unsafe fn k() {}
// SAFETY: forwards to the system allocator.
unsafe impl GlobalAlloc for B {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: passed on.
        unsafe { System.alloc(layout) }
    }
}
type Kernel = unsafe fn(usize);
"#;
    let found = check(documented);
    assert_eq!(found.undocumented, Vec::<(usize, String)>::new());
    assert_eq!(found.checked, 8);

    let undocumented = r#"
unsafe impl Send for A {}
fn f() {
    // A comment that is not an argument.
    let x = unsafe { g() };
    // SAFETY: a reason, separated from the block by code.
    let y = 1;
    let z = unsafe {
        g()
    };
}
/// Docs without a contract.
unsafe fn g() {}
"#;
    let lines: Vec<usize> = check(undocumented).undocumented.iter().map(|(line, _)| *line).collect();
    assert_eq!(lines, [2, 5, 8, 13]);
}

fn rust_files(dir: &Path, into: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let mut entries: Vec<_> = entries.flatten().collect();
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with('.') || name == "target" || name == "node_modules" {
            continue;
        }
        if path.is_dir() {
            rust_files(&path, into);
        } else if name.ends_with(".rs") {
            into.push(path);
        }
    }
}

struct Found {
    /// The unsafe blocks, impls and fns looked at.
    checked: usize,
    /// Those without their argument: line number (from 1) and the line.
    undocumented: Vec<(usize, String)>,
}

fn check(text: &str) -> Found {
    let lines: Vec<&str> = text.lines().collect();
    let codes = code_of(&lines);
    let mut found = Found { checked: 0, undocumented: Vec::new() };
    for (i, code) in codes.iter().enumerate() {
        for (at, _) in code.match_indices("unsafe") {
            let word_char = |c: char| c.is_alphanumeric() || c == '_';
            let before = code[..at].chars().next_back();
            let after = &code[at + "unsafe".len()..];
            if before.is_some_and(word_char) || after.chars().next().is_some_and(word_char) {
                continue;
            }
            let after = after.trim_start();
            let block = after.starts_with('{') || after.is_empty();
            let item = after.starts_with("impl") && !after["impl".len()..].starts_with(word_char);
            // `unsafe fn name` or `unsafe extern "C" fn name`, not a function pointer's type.
            let head = after
                .strip_prefix("extern")
                .map_or(after, |rest| rest.trim_start().trim_start_matches("\"\"").trim_start());
            let function = head.strip_prefix("fn").is_some_and(|rest| {
                rest.starts_with(char::is_whitespace)
                    && rest.trim_start().starts_with(|c: char| c.is_alphabetic() || c == '_')
            });
            if !(block || item || function) {
                continue;
            }
            found.checked += 1;
            let above = comments_above(&lines, i);
            let documented = if function {
                above.iter().any(|l| l.contains("# Safety") || l.contains("SAFETY:") || l.contains("#[target_feature"))
                    || inside_trait_impl(&lines, i)
            } else {
                lines[i].contains("SAFETY:") || above.iter().any(|l| l.contains("SAFETY:"))
            };
            if !documented {
                found.undocumented.push((i + 1, lines[i].trim().to_string()));
            }
        }
    }
    found
}

/// The comment, doc and attribute lines right above line `i`.
fn comments_above<'a>(lines: &[&'a str], i: usize) -> Vec<&'a str> {
    lines[..i].iter().rev().map(|l| l.trim()).take_while(|l| l.starts_with("//") || l.starts_with("#[")).collect()
}

/// Whether line `i` (an `unsafe fn`) is a method in the body of a trait's impl: the nearest line
/// above it that is indented less opens an `impl … for …` (or an `unsafe impl`).
fn inside_trait_impl(lines: &[&str], i: usize) -> bool {
    let indent = |l: &str| l.len() - l.trim_start().len();
    let own = indent(lines[i]);
    lines[..i]
        .iter()
        .rev()
        .find(|l| !l.trim().is_empty() && indent(l) < own)
        .map(|l| l.trim_start())
        .is_some_and(|l| l.starts_with("unsafe impl") || (l.starts_with("impl") && l.contains(" for ")))
}

/// Each line's code: string and character literals blanked (raw strings too), comments removed.
fn code_of(lines: &[&str]) -> Vec<String> {
    // Inside a string: `Some(hashes)` (0 for a plain string, else a raw one's `#`s).
    let mut string: Option<Option<usize>> = None;
    let mut codes = Vec::with_capacity(lines.len());
    for line in lines {
        let mut code = String::new();
        let chars: Vec<char> = line.chars().collect();
        let mut k = 0;
        while k < chars.len() {
            let c = chars[k];
            match string {
                Some(None) if c == '\\' => k += 1,
                Some(None) if c == '"' => {
                    string = None;
                    code.push('"');
                }
                Some(Some(hashes))
                    if c == '"' && chars[k + 1..].iter().take_while(|&&h| h == '#').count() >= hashes =>
                {
                    string = None;
                    code.push('"');
                    k += hashes;
                }
                Some(_) => {}
                None if c == '/' && chars.get(k + 1) == Some(&'/') => break,
                None if c == '"' => {
                    string = Some(None);
                    code.push('"');
                }
                None if c == 'r' && !code.ends_with(|p: char| p.is_alphanumeric() || p == '_') && {
                    let hashes = chars[k + 1..].iter().take_while(|&&h| h == '#').count();
                    chars.get(k + 1 + hashes) == Some(&'"')
                } =>
                {
                    let hashes = chars[k + 1..].iter().take_while(|&&h| h == '#').count();
                    string = Some(Some(hashes));
                    code.push('"');
                    k += 1 + hashes;
                }
                // A character literal such as '{' or '"'.
                None if c == '\'' && chars.get(k + 2) == Some(&'\'') => {
                    code.push_str("' '");
                    k += 2;
                }
                None if c == '\'' && chars.get(k + 1) == Some(&'\\') => {
                    let end = chars[k + 2..].iter().position(|&e| e == '\'').map_or(chars.len(), |e| k + 2 + e);
                    code.push_str("' '");
                    k = end;
                }
                None => code.push(c),
            }
            k += 1;
        }
        codes.push(code);
    }
    codes
}
