//! A deterministic fuzz test of the front end (`dfc_syntax::parse` and `dfc_sema::check_source`).
//!
//! Architecture Invariant under test: no input makes the front end panic (or overflow its stack),
//! every diagnostic's spans lie within the source (`start <= end <= len`, both on char
//! boundaries), and every module that sema returns passes `dfc_ir::verify` and prints.
//!
//! The inputs are mutations of every `examples/*.df` (byte ranges deleted, duplicated, swapped,
//! tokens inserted, names and numbers replaced, truncation), soups of tokens, random ASCII, and
//! very deeply nested expressions. Every input comes from a fixed seed, so a failure reproduces:
//! the report names the seed and the mutations, and writes the input to
//! `target/tmp/front_end_fuzz/`. `DFC_FUZZ_SCALE=N` runs N times as many inputs (new seeds), for
//! a longer search than the test suite can afford. For open-ended fuzzing see `fuzz/`.

use std::cell::RefCell;
use std::fmt::Write as _;
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Once;

/// Mutated inputs per example file (times `DFC_FUZZ_SCALE`).
const MUTANTS_PER_EXAMPLE: usize = 1000;
/// Token soups and random ASCII strings (each, times `DFC_FUZZ_SCALE`).
const SOUPS: usize = 800;
const RANDOM_ASCII: usize = 500;
/// The main nesting depth of the deep inputs; `DEEP` tries each at several depths, because
/// pest's own stack guard turns the deepest inputs into a syntax error while somewhat shallower
/// ones (about 1,000 to 3,000 levels) used to overflow the stack after pest had succeeded. Only a
/// front end that bounds its recursion (or does not recurse) gets through them all on an 8 MiB
/// stack in a debug build: do not lower these depths to make the test pass.
const DEPTH: usize = 5_000;
/// The stack the front end runs on here: what a Linux main thread (the `dfc` CLI) gets.
const STACK: usize = 8 << 20;
/// Report at most this many kinds of failure per test (each minimized and written to a file).
const MAX_FAILURES: usize = 20;

/// The largest single allocation the front end may make here. A bigger one (a constant of
/// 10^10 elements, say) is refused, which aborts the process with "memory allocation of N bytes
/// failed" instead of exhausting the machine; the input being checked is then in
/// `target/tmp/front_end_fuzz/<test>-current.df`.
const ALLOCATION_CAP: usize = 2 << 30;

struct CappedAllocator;

thread_local! {
    /// The test this thread runs, for the message when an allocation is refused.
    static CURRENT_TEST: std::cell::Cell<&'static str> = const { std::cell::Cell::new("") };
}

// SAFETY: forwards to `System`, or reports failure (null) as `GlobalAlloc` allows.
unsafe impl std::alloc::GlobalAlloc for CappedAllocator {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        if layout.size() > ALLOCATION_CAP {
            refused(layout.size());
            return std::ptr::null_mut();
        }
        std::alloc::System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        if layout.size() > ALLOCATION_CAP {
            refused(layout.size());
            return std::ptr::null_mut();
        }
        std::alloc::System.alloc_zeroed(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        std::alloc::System.dealloc(ptr, layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        if new_size > ALLOCATION_CAP {
            refused(new_size);
            return std::ptr::null_mut();
        }
        std::alloc::System.realloc(ptr, layout, new_size)
    }
}

fn refused(size: usize) {
    let test = CURRENT_TEST.with(|t| t.get());
    eprintln!(
        "front_end_fuzz: refused an allocation of {size} bytes (the cap is {ALLOCATION_CAP}); \
         the input being checked is in target/tmp/front_end_fuzz/{test}-current.df"
    );
}

#[global_allocator]
static ALLOCATOR: CappedAllocator = CappedAllocator;

const TOKENS: &[&str] = &[
    "(",
    ")",
    "[",
    "]",
    "{",
    "}",
    ",",
    "=",
    "@",
    "-",
    ":",
    "->",
    "<",
    ">",
    "==",
    "+",
    "*",
    "/",
    ".",
    "1e999",
    "99999999999999999999",
    "-1",
    "0",
    "1.5",
    "\"",
    "\\",
    "/*",
    "*/",
    "//",
    "let",
    "param",
    "layer",
    "model",
    "dim",
    "device",
    "return",
    "input",
    "const",
    "output",
    "minimize",
    "with",
    "as",
    "true",
    "false",
    "f32[",
    "f32",
    "u8",
    "bool",
    "i64",
    "x",
    "relu(",
    "@device(\"",
    "partitioned(0)",
    "@partitioned(",
    "cast<",
    "sgd(lr = 0.01)",
    "é",
    "\u{feff}",
    "\0",
    "\u{1F600}",
    "\r",
    "\t",
    "\n",
    " ",
    "\"/job:ps\"",
    "\"\\q\"",
    "zeros",
    "glorot_uniform",
    "reshape(",
    "one_hot(",
    "concat([",
];

/// Replacements for names.
const NAMES: &[&str] = &[
    "x",
    "y",
    "_",
    "batch",
    "n",
    "units",
    "dense",
    "conv",
    "relu",
    "reshape",
    "gather",
    "concat",
    "mean",
    "sum",
    "zeros",
    "glorot_uniform",
    "truncated_normal",
    "sgd",
    "adam",
    "softmax",
    "sigmoid",
    "flatten",
    "max_pool",
    "conv2d",
    "one_hot",
    "cast",
    "matmul",
    "let",
    "dim",
    "model",
    "layer",
    "param",
    "f32",
    "u8",
    "bool",
    "true",
    "as",
    "with",
    "é",
    "x\u{301}",
    "a0",
    "",
];

/// Replacements for numbers.
const NUMBERS: &[&str] = &[
    "0",
    "1",
    "2",
    "-1",
    "0.0",
    "1.5",
    "1e999",
    "1e-999",
    "99999999999999999999",
    "9223372036854775807",
    "9223372036854775808",
    "-9223372036854775808",
    "4294967296",
    "2147483648",
    "65536",
    "1000000000000",
    "3037000500",
    "0.",
    ".5",
    "1e3",
];

// ---------------------------------------------------------------------------------------------
// Checking one input.

/// A caught panic: its message, where it was raised, and the innermost frame of our own code
/// (a panic inside `core`, such as an overflow in `Iterator::product`, says little by itself).
struct Caught {
    message: String,
    location: String,
    frame: String,
}

thread_local! {
    /// Set while the front end runs: the panic hook records the panic here instead of printing.
    static CAUGHT: RefCell<Option<Option<Caught>>> = const { RefCell::new(None) };
}

/// The innermost frame of the workspace's own code (`compiler/...`, `src/...`) in a backtrace.
fn compiler_frame() -> String {
    let trace = std::backtrace::Backtrace::force_capture().to_string();
    let mut function = "";
    for line in trace.lines() {
        let line = line.trim();
        if let Some(at) = line.strip_prefix("at ") {
            let ours = (at.contains("compiler/") || at.starts_with("./src/")) && !at.contains("/registry/");
            if ours {
                return format!("{function} at {at}");
            }
        } else if let Some((_, name)) = line.split_once(": ") {
            function = name;
        }
    }
    "?".into()
}

fn install_panic_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let default = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            let recording = CAUGHT.with(|c| c.borrow().is_some());
            if !recording {
                return default(info);
            }
            let message = info
                .payload()
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| info.payload().downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "<non-string panic payload>".into());
            let location = info.location().map(|l| l.to_string()).unwrap_or_default();
            let caught = Caught { message, location, frame: compiler_frame() };
            CAUGHT.with(|c| *c.borrow_mut() = Some(Some(caught)));
        }));
    });
}

/// Runs `f`, turning a panic into a `Problem` of `stage`.
fn guarded<T>(stage: &str, f: impl FnOnce() -> T) -> Result<T, Problem> {
    install_panic_hook();
    CAUGHT.with(|c| *c.borrow_mut() = Some(None));
    let result = panic::catch_unwind(AssertUnwindSafe(f));
    let caught = CAUGHT.with(|c| c.borrow_mut().take()).flatten();
    result.map_err(|_| {
        let Caught { message, location, frame } =
            caught.unwrap_or(Caught { message: "panic".into(), location: "?".into(), frame: "?".into() });
        Problem {
            // The message may quote the input; where it comes from does not.
            kind: format!("{stage} panicked at {location} (in {frame})"),
            detail: format!("{stage} panicked: {message}\n    at {location}\n    in {frame}"),
        }
    })
}

/// A violated invariant: `kind` groups failures with the same cause (it leaves out what varies
/// with the input); `detail` says everything.
#[derive(Debug)]
struct Problem {
    kind: String,
    detail: String,
}

fn check_span(source: &str, stage: &str, d: &dfc_diag::Diagnostic, span: dfc_diag::Span) -> Result<(), Problem> {
    let (start, end) = (span.start as usize, span.end as usize);
    let ok = start <= end && end <= source.len() && source.is_char_boundary(start) && source.is_char_boundary(end);
    if ok {
        return Ok(());
    }
    Err(Problem {
        kind: format!("{stage}: diagnostic {:?} has a span outside the source", d.code),
        detail: format!(
            "{stage}: span {start}..{end} of diagnostic {:?} `{}` is not a char range of the {}-byte source",
            d.code,
            d.message,
            source.len()
        ),
    })
}

fn check_diagnostics(source: &str, stage: &str, diagnostics: &[dfc_diag::Diagnostic]) -> Result<(), Problem> {
    for d in diagnostics {
        check_span(source, stage, d, d.primary.span)?;
        for label in &d.secondary {
            check_span(source, &format!("{stage} (secondary label)"), d, label.span)?;
        }
    }
    Ok(())
}

/// One iteration: the whole front end on `source`, every invariant checked. Returns how many
/// modules were verified.
fn check(source: &str) -> Result<usize, Problem> {
    check_with(source, &dfc_sema::Options::default())
}

/// `check` with `--dim` overrides.
fn check_with(source: &str, options: &dfc_sema::Options) -> Result<usize, Problem> {
    let (_file, diagnostics) = guarded("dfc_syntax::parse", || dfc_syntax::parse(source))?;
    check_diagnostics(source, "dfc_syntax::parse", &diagnostics)?;
    let (analyses, diagnostics) = guarded("dfc_sema::check_source", || dfc_sema::check_source(source, options))?;
    check_diagnostics(source, "dfc_sema::check_source", &diagnostics)?;
    let mut modules = 0;
    for analysis in &analyses {
        let Some(module) = &analysis.module else { continue };
        modules += 1;
        let errors = guarded("dfc_ir::verify", || dfc_ir::verify(module, dfc_ir::VerifyOptions::default()))?;
        if !errors.is_empty() {
            let printed = guarded("dfc_ir::print", || dfc_ir::print(module)).unwrap_or_else(|p| p.detail);
            return Err(Problem {
                kind: "a module sema returned fails dfc_ir::verify".into(),
                detail: format!("the module of model `{}` fails verification: {errors:?}\n{printed}", analysis.model),
            });
        }
        guarded("dfc_ir::print", || dfc_ir::print(module))?;
    }
    Ok(modules)
}

/// Whether `source` still fails in the same way.
fn fails_alike(source: &str, options: &dfc_sema::Options, kind: &str) -> bool {
    matches!(check_with(source, options), Err(p) if p.kind == kind)
}

/// Shrinks a failing input by deleting ever smaller chunks while it fails alike (at most
/// `budget` checks).
fn minimize(source: &str, options: &dfc_sema::Options, kind: &str, mut budget: usize) -> String {
    let mut best = source.to_string();
    let mut chunk = (best.len() / 2).max(1);
    loop {
        let mut progressed = false;
        let mut start = 0;
        while start < best.len() && budget > 0 {
            let a = floor_boundary(&best, start);
            let mut b = floor_boundary(&best, a + chunk);
            if b == a {
                b = a + best[a..].chars().next().map_or(0, char::len_utf8);
            }
            let candidate = format!("{}{}", &best[..a], &best[b..]);
            budget -= 1;
            if fails_alike(&candidate, options, kind) {
                best = candidate;
                progressed = true;
            } else {
                start = b;
            }
        }
        if budget == 0 || (!progressed && chunk == 1) {
            return best;
        }
        if !progressed {
            chunk = (chunk / 2).max(1);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Reporting.

fn out_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("front_end_fuzz");
    std::fs::create_dir_all(&dir).expect("create target/tmp/front_end_fuzz");
    dir
}

fn escaped_preview(source: &str) -> String {
    let preview: String = source.chars().take(600).collect();
    let more =
        if preview.len() < source.len() { format!(" … ({} bytes in all)", source.len()) } else { String::new() };
    format!("{preview:?}{more}")
}

/// The first (and smallest) failing input of one kind of failure.
struct Failure {
    count: usize,
    options: dfc_sema::Options,
    name: String,
    seed: u64,
    how: String,
    source: String,
}

struct Campaign {
    test: &'static str,
    started: std::time::Instant,
    inputs: usize,
    modules: usize,
    /// By `Problem::kind`, in the order found.
    failures: Vec<(String, Failure)>,
}

impl Campaign {
    fn new(test: &'static str) -> Campaign {
        CURRENT_TEST.with(|t| t.set(test));
        Campaign { test, started: std::time::Instant::now(), inputs: 0, modules: 0, failures: Vec::new() }
    }

    fn run(&mut self, name: &str, seed: u64, how: &str, source: &str) {
        self.run_with(name, seed, how, source, &dfc_sema::Options::default());
    }

    fn run_with(&mut self, name: &str, seed: u64, how: &str, source: &str, options: &dfc_sema::Options) {
        self.inputs += 1;
        // Should the process die (an abort, a refused allocation), this is the input it was on.
        let current = out_dir().join(format!("{}-current.df", self.test));
        std::fs::write(&current, source).expect("write the current input");
        match check_with(source, options) {
            Ok(modules) => self.modules += modules,
            Err(problem) => {
                let failure = Failure {
                    count: 1,
                    options: options.clone(),
                    name: name.into(),
                    seed,
                    how: how.into(),
                    source: source.into(),
                };
                match self.failures.iter_mut().find(|(kind, _)| *kind == problem.kind) {
                    Some((_, known)) => {
                        failure_seen_again(known, failure);
                    }
                    None => self.failures.push((problem.kind, failure)),
                }
            }
        }
    }

    /// Reports every kind of failure with a minimized input (also written under target/tmp/).
    fn finish(self) {
        let test = self.test;
        println!(
            "{test}: {} inputs checked, {} modules verified, in {:.1?}",
            self.inputs,
            self.modules,
            self.started.elapsed()
        );
        if self.failures.is_empty() {
            return;
        }
        let mut report = String::new();
        for (index, (kind, failure)) in self.failures.iter().take(MAX_FAILURES).enumerate() {
            let dir = out_dir();
            let original = dir.join(format!("{test}-{index}.df"));
            std::fs::write(&original, &failure.source).expect("write failing input");
            let small = minimize(&failure.source, &failure.options, kind, 1500);
            let minimized = dir.join(format!("{test}-{index}-min.df"));
            std::fs::write(&minimized, &small).expect("write minimized input");
            let detail = match check_with(&small, &failure.options) {
                Err(problem) => problem.detail,
                Ok(_) => "(the minimized input passes?)".into(),
            };
            let _ = write!(
                report,
                "\n[{index}] {kind} ({} input(s) of this kind)\n  smallest: {} seed {:#018x}: {}{}\n  \
                 input written to {}\n  minimized ({} bytes, written to {}):\n    {}\n  {detail}\n",
                failure.count,
                failure.name,
                failure.seed,
                failure.how,
                if failure.options.dims.is_empty() {
                    String::new()
                } else {
                    format!(" (with --dim overrides {:?})", failure.options.dims)
                },
                original.display(),
                small.len(),
                minimized.display(),
                escaped_preview(&small),
            );
        }
        panic!(
            "{test}: {} kind(s) of failure in {} inputs (showing up to {MAX_FAILURES}):\n{report}",
            self.failures.len(),
            self.inputs
        );
    }
}

/// Keeps the shorter input of two failures of the same kind.
fn failure_seen_again(known: &mut Failure, new: Failure) {
    let count = known.count + 1;
    if new.source.len() < known.source.len() {
        *known = new;
    }
    known.count = count;
}

/// Runs `body` on a thread with the stack the CLI's main thread has, so that the result does
/// not depend on the test harness's (smaller) thread stacks or on RUST_MIN_STACK.
fn on_big_stack(body: impl FnOnce() + Send + 'static) {
    let handle = std::thread::Builder::new().stack_size(STACK).spawn(body).expect("spawn");
    if let Err(payload) = handle.join() {
        panic::resume_unwind(payload);
    }
}

fn scale() -> usize {
    std::env::var("DFC_FUZZ_SCALE").ok().and_then(|s| s.parse().ok()).unwrap_or(1).max(1)
}

// ---------------------------------------------------------------------------------------------
// Inputs.

fn examples() -> Vec<(String, String)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    let mut files: Vec<(String, String)> = std::fs::read_dir(&dir)
        .expect("read examples/")
        .map(|entry| entry.expect("examples/ entry").path())
        .filter(|path| path.extension().is_some_and(|e| e == "df"))
        .map(|path| {
            let name = path.file_stem().expect("file name").to_string_lossy().into_owned();
            let text = std::fs::read_to_string(&path).expect("read example");
            (name, text)
        })
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no examples/*.df found");
    files
}

fn floor_boundary(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// A random char-boundary position in `s` (0..=len).
fn pos(rng: &mut fastrand::Rng, s: &str) -> usize {
    floor_boundary(s, rng.usize(..=s.len()))
}

/// A random range of `s`, usually short.
fn range(rng: &mut fastrand::Rng, s: &str) -> (usize, usize) {
    let start = pos(rng, s);
    let max_len = if rng.u8(..4) == 0 { s.len() } else { 40 };
    let end = floor_boundary(s, start + rng.usize(..=max_len.max(1)));
    (start, end.max(start))
}

fn pick<'a>(rng: &mut fastrand::Rng, items: &[&'a str]) -> &'a str {
    items[rng.usize(..items.len())]
}

/// Byte ranges of ASCII words (names, keywords, and runs of digits) in `s`.
fn words(s: &str, numbers: bool) -> Vec<(usize, usize)> {
    let bytes = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        let starts = if numbers { b.is_ascii_digit() } else { b.is_ascii_alphabetic() || b == b'_' };
        if starts && (i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_')) {
            let mut j = i + 1;
            while j < bytes.len()
                && (bytes[j].is_ascii_alphanumeric() || bytes[j] == b'_' || (numbers && bytes[j] == b'.'))
            {
                j += 1;
            }
            out.push((i, j));
            i = j;
        } else {
            i += 1;
        }
    }
    out
}

/// Applies one random mutation to `s`, describing it in `log`.
fn mutate(rng: &mut fastrand::Rng, s: &mut String, corpus: &[(String, String)], log: &mut String) {
    if s.is_empty() {
        let token = pick(rng, TOKENS);
        s.push_str(token);
        let _ = write!(log, "insert {token:?}; ");
        return;
    }
    match rng.u8(..11) {
        0 => {
            let (a, b) = range(rng, s);
            s.replace_range(a..b, "");
            let _ = write!(log, "delete {a}..{b}; ");
        }
        1 => {
            let (a, b) = range(rng, s);
            let piece = s[a..b].to_string();
            let at = pos(rng, s);
            s.insert_str(at, &piece);
            let _ = write!(log, "duplicate {a}..{b} at {at}; ");
        }
        2 => {
            let (a, b) = range(rng, s);
            let (c, d) = range(rng, s);
            let ((a, b), (c, d)) = if a <= c { ((a, b), (c, d)) } else { ((c, d), (a, b)) };
            if b <= c {
                let swapped = format!("{}{}{}{}{}", &s[..a], &s[c..d], &s[b..c], &s[a..b], &s[d..]);
                *s = swapped;
                let _ = write!(log, "swap {a}..{b} with {c}..{d}; ");
            } else {
                s.replace_range(c..d.max(c), "");
                let _ = write!(log, "delete {c}..{d}; ");
            }
        }
        3 | 4 => {
            let n = 1 + rng.usize(..3);
            for _ in 0..n {
                let token = pick(rng, TOKENS);
                let at = pos(rng, s);
                let padded = match rng.u8(..3) {
                    0 => token.to_string(),
                    1 => format!(" {token} "),
                    _ => format!("\n{token}"),
                };
                s.insert_str(at, &padded);
                let _ = write!(log, "insert {padded:?} at {at}; ");
            }
        }
        5 | 6 => {
            let names = words(s, false);
            if names.is_empty() {
                return;
            }
            let (a, b) = names[rng.usize(..names.len())];
            let old = s[a..b].to_string();
            let new = if rng.bool() {
                let (c, d) = names[rng.usize(..names.len())];
                s[c..d].to_string()
            } else if rng.u8(..20) == 0 {
                "v".repeat(1 + rng.usize(..2000))
            } else {
                pick(rng, NAMES).to_string()
            };
            if rng.bool() {
                // Rename consistently: every occurrence of the word.
                for &(c, d) in names.iter().rev() {
                    if s[c..d] == old {
                        s.replace_range(c..d, &new);
                    }
                }
                let _ = write!(log, "rename every {old:?} to {new:?}; ");
            } else {
                s.replace_range(a..b, &new);
                let _ = write!(log, "replace {old:?} at {a} with {new:?}; ");
            }
        }
        7 => {
            let numbers = words(s, true);
            if numbers.is_empty() {
                return;
            }
            let (a, b) = numbers[rng.usize(..numbers.len())];
            let new = pick(rng, NUMBERS);
            let _ = write!(log, "replace number {:?} at {a} with {new:?}; ", &s[a..b]);
            s.replace_range(a..b, new);
        }
        8 => {
            let at = pos(rng, s);
            s.truncate(at);
            let _ = write!(log, "truncate at {at}; ");
        }
        9 => {
            // Splice in a piece of another example.
            let (name, other) = &corpus[rng.usize(..corpus.len())];
            let (a, b) = range(rng, other);
            let at = pos(rng, s);
            s.insert_str(at, &other[a..b]);
            let _ = write!(log, "splice {name}[{a}..{b}] at {at}; ");
        }
        _ => {
            // Overwrite one byte with a random one; invalid UTF-8 becomes U+FFFD.
            let mut bytes = std::mem::take(s).into_bytes();
            let at = rng.usize(..bytes.len());
            let byte = rng.u8(..);
            bytes[at] = byte;
            *s = String::from_utf8_lossy(&bytes).into_owned();
            let _ = write!(log, "set byte {at} to {byte:#04x}; ");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Tests.

#[test]
fn examples_are_accepted() {
    for (name, text) in examples() {
        let modules = check(&text).unwrap_or_else(|problem| panic!("examples/{name}.df: {}", problem.detail));
        assert!(modules >= 1, "examples/{name}.df produced no module");
    }
}

/// Text inside brackets nested too deep is blanked before parsing; a multi-byte character
/// there must not put any span inside a character of the real source (found by `cargo fuzz`:
/// a model missing its `}` after 64 `(` and a `\u{e9}` pointed into the `\u{e9}`).
#[test]
fn multibyte_text_inside_too_deep_brackets() {
    let deep = "(".repeat(64);
    let bodies = [
        format!("    let y = {deep}\u{e9}x"),
        format!("    let y = {deep}\u{e9}"),
        format!("    let y = {deep}\u{1f600}\u{e9} x\n    output y"),
        format!("    let y = {deep}\u{e9}){}\n    output y", ")".repeat(63)),
        format!("    let y = {deep}\u{e9}\n\u{4e2d}x + 1"),
    ];
    for body in bodies {
        for close in ["}\n", ""] {
            let source = format!("model m {{\n    dim batch = 4\n    input x: f32[batch, 3]\n{body}\n{close}");
            if let Err(problem) = check(&source) {
                panic!("{}\n  on {}", problem.detail, escaped_preview(&source));
            }
        }
    }
}

/// Two halves of the example files, so that the test harness runs them on two threads.
fn mutated_examples(half: usize) {
    let corpus = examples();
    let per_file = MUTANTS_PER_EXAMPLE * scale();
    let test = if half == 0 { "mutated_examples_even" } else { "mutated_examples_odd" };
    on_big_stack(move || {
        let mut campaign = Campaign::new(test);
        for (index, (name, text)) in corpus.iter().enumerate() {
            if index % 2 != half {
                continue;
            }
            for i in 0..per_file {
                let seed = 0xdf00_0000_0000 ^ ((index as u64) << 32) ^ i as u64;
                let mut rng = fastrand::Rng::with_seed(seed);
                let mut input = text.clone();
                let mut log = String::new();
                let rounds = 1 + rng.usize(..4);
                for _ in 0..rounds {
                    mutate(&mut rng, &mut input, &corpus, &mut log);
                }
                // Now and then, as if run with `--dim NAME=VALUE`.
                let mut options = dfc_sema::Options::default();
                if rng.u8(..8) == 0 {
                    let all: Vec<&str> = words(text, false).into_iter().map(|(a, b)| &text[a..b]).collect();
                    let dims: Vec<&str> = all.windows(2).filter(|w| w[0] == "dim").map(|w| w[1]).collect();
                    let name = if dims.is_empty() || rng.u8(..4) == 0 { "nope" } else { dims[rng.usize(..dims.len())] };
                    let value = [0, -1, 1, 2, 7, 1 << 40, i64::MAX, i64::MIN][rng.usize(..8)];
                    options.dims.push((name.to_string(), value));
                }
                campaign.run_with(name, seed, log.trim_end(), &input, &options);
            }
        }
        campaign.finish();
    });
}

#[test]
fn mutated_examples_even() {
    mutated_examples(0);
}

#[test]
fn mutated_examples_odd() {
    mutated_examples(1);
}

#[test]
fn token_soup_and_random_ascii() {
    let corpus = examples();
    on_big_stack(move || {
        let mut campaign = Campaign::new("token_soup_and_random_ascii");
        // Soups: a model or layer header, then a random run of tokens and names.
        for i in 0..SOUPS * scale() {
            let seed = 0x5000_0000_0000 ^ i as u64;
            let mut rng = fastrand::Rng::with_seed(seed);
            let mut input = String::from(match rng.u8(..4) {
                0 => "",
                1 => "model m {\n",
                2 => "layer l(x: f32[n, k], units: dim) -> f32[n, units] {\n",
                _ => "model m {\n    dim batch = 4\n    input x: f32[batch, 3]\n    let y = ",
            });
            for _ in 0..rng.usize(..60) {
                let word = if rng.bool() { pick(&mut rng, TOKENS) } else { pick(&mut rng, NAMES) };
                input.push_str(word);
                input.push_str(pick(&mut rng, &[" ", " ", "", "\n"]));
            }
            if rng.bool() {
                input.push_str("\n}\n");
            }
            let mut log = String::from("token soup; ");
            if rng.u8(..4) == 0 {
                mutate(&mut rng, &mut input, &corpus, &mut log);
            }
            campaign.run("soup", seed, log.trim_end(), &input);
        }
        // Random ASCII, printable characters and newlines.
        for i in 0..RANDOM_ASCII * scale() {
            let seed = 0xa500_0000_0000 ^ i as u64;
            let mut rng = fastrand::Rng::with_seed(seed);
            let len = rng.usize(..300);
            let input: String = (0..len).map(|_| if rng.u8(..16) == 0 { '\n' } else { rng.char(' '..='~') }).collect();
            campaign.run("ascii", seed, "random ASCII", &input);
        }
        // Whole examples with their text cut at every 7th byte (prefixes).
        for (name, text) in &corpus {
            for end in (0..=text.len()).step_by(7) {
                let end = floor_boundary(text, end);
                campaign.run(name, end as u64, "prefix", &text[..end]);
            }
        }
        campaign.finish();
    });
}

/// Deeply nested inputs, by name, and the depths each is tried at. Each runs in a child process
/// (this test binary, re-run on `deep_nesting_child`), because a stack overflow aborts the
/// process and cannot be caught.
const DEEP: &[(&str, &[usize])] = &[
    ("open_parens_alone", &[DEPTH, 100_000]),
    ("open_parens", &[1_000, 2_000, DEPTH, 20_000]),
    ("parens", &[1_000, 2_000, DEPTH, 20_000]),
    ("brackets", &[1_000, 2_000, DEPTH, 20_000]),
    ("calls", &[1_000, 2_000, DEPTH, 20_000]),
    ("negations", &[1_000, 2_000, DEPTH, 20_000]),
    ("sum_chain", &[1_000, 2_000, DEPTH, 20_000]),
    ("sum_of_x", &[2_000]),
    ("device_blocks", &[1_000, 2_000, DEPTH, 20_000]),
    ("dim_chain", &[1_000, DEPTH]),
    ("layer_chain", &[100, 1_000]),
    ("layer_cycle", &[1, 2, 100]),
    ("attributes", &[DEPTH]),
    ("outputs", &[DEPTH]),
    ("long_literals", &[DEPTH]),
];

fn deep_input(case: &str, d: usize) -> String {
    let model = |body: &str| format!("model m {{\n    dim batch = 4\n    input x: f32[batch, 3]\n{body}\n}}\n");
    match case {
        "open_parens_alone" => "(".repeat(d),
        "open_parens" => model(&format!("    let y = {}", "(".repeat(d))),
        "parens" => model(&format!("    let y = {}x{}\n    output y", "(".repeat(d), ")".repeat(d))),
        "brackets" => model(&format!("    const c = {}1{}", "[".repeat(d), "]".repeat(d))),
        "calls" => model(&format!("    let y = {}x{}\n    output y", "relu(".repeat(d), ")".repeat(d))),
        // Constants, not `x`: a graph with thousands of nodes takes seconds to build in debug.
        "negations" => model(&format!("    const c = {}1", "-".repeat(d))),
        "sum_chain" => model(&format!("    const c = 1{}", " + 1".repeat(d))),
        "sum_of_x" => model(&format!("    let y = x{}\n    output y", " + x".repeat(d))),
        "device_blocks" => {
            model(&format!("{}    let y = x\n    output y\n{}", "device \"/cpu:0\" {\n".repeat(d), "}\n".repeat(d)))
        }
        "dim_chain" => {
            let dims: String = (1..d).map(|i| format!("    dim d{i} = d{} + 1\n", i - 1)).collect();
            model(&format!("    dim d0 = 1\n{dims}    let y = reshape(x, [d{}, 1])", d - 1))
        }
        "layer_chain" => {
            let layers: String = (0..d)
                .map(|i| format!("layer l{i}(x: f32[n, k]) -> f32[n, k] {{\n    return l{}(x)\n}}\n", i + 1))
                .collect();
            let last = format!("layer l{d}(x: f32[n, k]) -> f32[n, k] {{\n    return relu(x)\n}}\n");
            format!("{layers}{last}{}", model("    let y = l0(x)\n    output y"))
        }
        "layer_cycle" => {
            let layers: String = (0..d)
                .map(|i| format!("layer l{i}(x: f32[n, k]) -> f32[n, k] {{\n    return l{}(x)\n}}\n", (i + 1) % d))
                .collect();
            format!("{layers}{}", model("    let y = l0(x)\n    output y"))
        }
        "attributes" => model(&format!("    {}let y = x\n    output y", "@device(\"/cpu:0\") ".repeat(d))),
        "outputs" => model(&format!("    output {}", vec!["x"; d].join(", "))),
        "long_literals" => model(&format!(
            "    let y = x // {}\n    const s = \"{}\"\n    output y",
            "\u{e9}\u{feff}".repeat(d * 10),
            "\\\\\\q\\\"".repeat(d)
        )),
        _ => unreachable!("no deep case {case}"),
    }
}

/// Every deep case through the `dfc` binary (`dfc check`), on the main thread's stack as a user
/// runs it: a stack overflow aborts the process, so it must happen in a child to be reported.
#[test]
fn deep_nesting() {
    let started = std::time::Instant::now();
    let mut failures = Vec::new();
    let mut inputs = 0;
    for &(case, depths) in DEEP {
        for &depth in depths {
            inputs += 1;
            let source = deep_input(case, depth);
            let path = out_dir().join(format!("deep-{case}-{depth}.df"));
            std::fs::write(&path, &source).expect("write deep input");
            let output = Command::new(env!("CARGO_BIN_EXE_dfc"))
                .args(["check", "--message-format", "json"])
                .arg(&path)
                .output()
                .expect("run dfc");
            let stderr = String::from_utf8_lossy(&output.stderr);
            let clean_exit = matches!(output.status.code(), Some(0 | 1)) && !stderr.contains("panicked");
            if clean_exit {
                println!("deep_nesting: {case} at depth {depth}: ok (exit {:?})", output.status.code());
                continue;
            }
            let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
            let problem = format!(
                "dfc check ended with {}: {}",
                output.status,
                lines[lines.len().saturating_sub(2)..].join(" | ")
            );
            println!("deep_nesting: {case} at depth {depth}: FAILED: {problem}");
            failures.push(format!(
                "[deep {case} at depth {depth}] {} bytes, written to {}, begins {}:\n  {problem}",
                source.len(),
                path.display(),
                escaped_preview(&source.chars().take(120).collect::<String>()),
            ));
        }
    }
    println!("deep_nesting: {inputs} inputs checked through `dfc check`, in {:.1?}", started.elapsed());
    assert!(failures.is_empty(), "deep_nesting: {} failing input(s):\n\n{}", failures.len(), failures.join("\n\n"));
}
