//! Diagnostics shared by every stage of dfc: source spans, the stable error codes, and the
//! `Diagnostic` value that the front end, semantic analysis and the passes produce; and the
//! bounded reading of the files dfc is given (`read`), so that every stage refuses an endless or
//! oversized file in the same words.
//!
//! Architecture Invariant: nothing here renders. The command line (through miette) and the
//! language server turn the same `Diagnostic` values into text or LSP messages.

mod codes;
mod line_index;
pub mod read;

pub use codes::{Code, ALL_CODES};
pub use line_index::{LineCol, LineIndex};

use serde::{Deserialize, Serialize};
use std::fmt;

/// A byte range `start..end` into one source file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Span {
    pub start: u32,
    pub end: u32,
}

impl Span {
    pub fn new(start: usize, end: usize) -> Span {
        Span { start: start as u32, end: end.max(start) as u32 }
    }

    /// The smallest span that covers both.
    pub fn to(self, other: Span) -> Span {
        Span { start: self.start.min(other.start), end: self.end.max(other.end) }
    }

    pub fn len(self) -> usize {
        (self.end - self.start) as usize
    }

    pub fn is_empty(self) -> bool {
        self.start == self.end
    }

    pub fn range(self) -> std::ops::Range<usize> {
        self.start as usize..self.end as usize
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Severity {
    Error,
    Warning,
}

impl fmt::Display for Severity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Severity::Error => "error",
            Severity::Warning => "warning",
        })
    }
}

/// A span with a short message shown beside it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Label {
    pub span: Span,
    pub message: String,
}

/// One problem in a source file: a stable code, a message that names what is involved, the exact
/// span it is about, optional secondary spans, and a help line saying what to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Diagnostic {
    pub severity: Severity,
    pub code: Code,
    pub message: String,
    pub primary: Label,
    pub secondary: Vec<Label>,
    pub help: Option<String>,
}

impl Diagnostic {
    pub fn error(code: Code, span: Span, message: impl Into<String>) -> Diagnostic {
        Diagnostic {
            severity: Severity::Error,
            code,
            message: message.into(),
            primary: Label { span, message: String::new() },
            secondary: Vec::new(),
            help: None,
        }
    }

    pub fn warning(code: Code, span: Span, message: impl Into<String>) -> Diagnostic {
        Diagnostic { severity: Severity::Warning, ..Diagnostic::error(code, span, message) }
    }

    /// The text shown at the primary span.
    pub fn with_label(mut self, message: impl Into<String>) -> Diagnostic {
        self.primary.message = message.into();
        self
    }

    pub fn with_secondary(mut self, span: Span, message: impl Into<String>) -> Diagnostic {
        self.secondary.push(Label { span, message: message.into() });
        self
    }

    pub fn with_help(mut self, help: impl Into<String>) -> Diagnostic {
        self.help = Some(help.into());
        self
    }

    pub fn is_error(&self) -> bool {
        self.severity == Severity::Error
    }
}

/// Sorts diagnostics by position, errors before warnings at the same place, so that every
/// renderer shows them in source order.
pub fn sort(diagnostics: &mut [Diagnostic]) {
    diagnostics.sort_by_key(|d| (d.primary.span.start, d.primary.span.end, d.severity));
}

/// "one of a, b or c" for messages that list choices.
pub fn one_of<S: AsRef<str>>(choices: &[S]) -> String {
    match choices {
        [] => String::new(),
        [only] => only.as_ref().to_string(),
        [init @ .., last] => {
            let init: Vec<&str> = init.iter().map(|s| s.as_ref()).collect();
            format!("{} or {}", init.join(", "), last.as_ref())
        }
    }
}

/// The closest of `candidates` to `name` by edit distance, for "did you mean" help lines.
pub fn closest<'a>(name: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let limit = name.chars().count().div_ceil(3).max(1);
    candidates
        .into_iter()
        .filter(|c| *c != name)
        .map(|c| (edit_distance(name, c), c))
        .filter(|(d, _)| *d <= limit)
        .min()
        .map(|(_, c)| c)
}

/// Optimal string alignment distance: insertions, deletions, substitutions and transpositions
/// of neighbours each cost 1 (`reul` is one step from `relu`).
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            d[i][j] = (d[i - 1][j] + 1).min(d[i][j - 1] + 1).min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                d[i][j] = d[i][j].min(d[i - 2][j - 2] + 1);
            }
        }
    }
    d[a.len()][b.len()]
}

/// "a" or "an" before a word, by its first letter (enough for dtypes, shapes and keywords).
pub fn article(word: &str) -> &'static str {
    if word.starts_with("u8") {
        return "a";
    }
    match word.chars().next() {
        Some('a' | 'e' | 'i' | 'o' | 'u' | 'f') => "an",
        _ => "a",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closest_finds_typos_only() {
        assert_eq!(closest("reul", ["relu", "exp", "tanh"]), Some("relu"));
        assert_eq!(closest("hidden", ["w1", "b1"]), None);
        assert_eq!(closest("reul", ["mul", "relu"]), Some("relu"));
    }

    #[test]
    fn one_of_reads_as_english() {
        assert_eq!(one_of(&["a"]), "a");
        assert_eq!(one_of(&["a", "b", "c"]), "a, b or c");
    }
}
