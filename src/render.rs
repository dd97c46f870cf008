//! Rendering diagnostics for people (miette, with carets) and for tools (JSON lines).
//! The language server renders the same `Diagnostic` values as LSP messages.

use dfc_diag::{Diagnostic, LineIndex, Severity};
use miette::{GraphicalReportHandler, GraphicalTheme, LabeledSpan, NamedSource};
use std::fmt;
use std::io::IsTerminal;

/// A source file as the command read it.
pub struct Source {
    pub path: String,
    pub text: String,
}

/// A diagnostic with its source, in the shape miette renders.
struct Report<'a> {
    diagnostic: &'a Diagnostic,
    source: NamedSource<String>,
    text_len: usize,
}

impl fmt::Debug for Report<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.diagnostic.message)
    }
}

impl fmt::Display for Report<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.diagnostic.message)
    }
}

impl std::error::Error for Report<'_> {}

impl miette::Diagnostic for Report<'_> {
    fn severity(&self) -> Option<miette::Severity> {
        Some(match self.diagnostic.severity {
            Severity::Error => miette::Severity::Error,
            Severity::Warning => miette::Severity::Warning,
        })
    }

    fn help<'b>(&'b self) -> Option<Box<dyn fmt::Display + 'b>> {
        self.diagnostic.help.as_ref().map(|h| Box::new(h) as Box<dyn fmt::Display>)
    }

    fn source_code(&self) -> Option<&dyn miette::SourceCode> {
        Some(&self.source)
    }

    fn labels(&self) -> Option<Box<dyn Iterator<Item = LabeledSpan> + '_>> {
        let clip = |span: dfc_diag::Span| {
            let start = (span.start as usize).min(self.text_len);
            let end = (span.end as usize).min(self.text_len);
            (start, end - start)
        };
        let primary = &self.diagnostic.primary;
        let text = (!primary.message.is_empty()).then(|| primary.message.clone());
        let mut labels = vec![LabeledSpan::new_primary_with_span(text, clip(primary.span))];
        for label in &self.diagnostic.secondary {
            labels.push(LabeledSpan::new_with_span(Some(label.message.clone()), clip(label.span)));
        }
        Some(Box::new(labels.into_iter()))
    }
}

/// Whether stderr gets colour: a terminal, and NO_COLOR unset.
pub fn use_color() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none()
}

/// A diagnostic as text with the source lines and carets.
pub fn human(source: &Source, diagnostic: &Diagnostic, color: bool) -> String {
    let mut theme = if color { GraphicalTheme::unicode() } else { GraphicalTheme::unicode_nocolor() };
    // rustc's header, `error[E0101]: message`, in place of miette's icon and separate code line.
    let code = diagnostic.code;
    theme.characters.error = format!("error[{code}]:");
    theme.characters.warning = format!("warning[{code}]:");
    let handler = GraphicalReportHandler::new_themed(theme).with_width(100);
    let report =
        Report { diagnostic, source: NamedSource::new(&source.path, source.text.clone()), text_len: source.text.len() };
    let mut out = String::new();
    if handler.render_report(&mut out, &report).is_err() {
        out = format!("{}[{}]: {}\n", diagnostic.severity, diagnostic.code, diagnostic.message);
    }
    out
}

/// A diagnostic as one JSON object, 1-based lines and columns (columns in characters).
pub fn json(source: &Source, index: &LineIndex, diagnostic: &Diagnostic) -> serde_json::Value {
    let start = index.line_col(&source.text, diagnostic.primary.span.start as usize);
    let end = index.line_col(&source.text, diagnostic.primary.span.end as usize);
    serde_json::json!({
        "file": source.path,
        "line": start.line,
        "column": start.column,
        "end_line": end.line,
        "end_column": end.column,
        "severity": diagnostic.severity.to_string(),
        "code": diagnostic.code.as_str(),
        "message": diagnostic.message,
        "label": diagnostic.primary.message,
        "help": diagnostic.help,
    })
}
