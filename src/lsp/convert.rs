//! Between dfc's byte offsets and LSP's positions (line and character, where a character is a
//! UTF-16 code unit unless the client agreed to UTF-8), and from dfc's values to LSP's.

use dfc_diag::{Diagnostic, Severity, Span};
use lsp_types as lsp;

/// How the client counts characters within a line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Encoding {
    Utf8,
    Utf16,
}

/// Line starts of one text, for conversions both ways.
pub struct Lines<'t> {
    text: &'t str,
    starts: Vec<usize>,
    encoding: Encoding,
}

impl<'t> Lines<'t> {
    pub fn new(text: &'t str, encoding: Encoding) -> Lines<'t> {
        let mut starts = vec![0];
        starts.extend(text.match_indices('\n').map(|(i, _)| i + 1));
        Lines { text, starts, encoding }
    }

    /// The byte offset of a position; positions past a line's end or the text's end clamp to
    /// them, and a position inside a character goes to the character's start (the protocol
    /// asks servers to be lenient).
    pub fn offset(&self, position: lsp::Position) -> usize {
        let Some(&start) = self.starts.get(position.line as usize) else { return self.text.len() };
        let end = self.starts.get(position.line as usize + 1).map_or(self.text.len(), |next| next - 1);
        let line = &self.text[start..end];
        let mut units = 0u32;
        for (i, c) in line.char_indices() {
            let width = match self.encoding {
                Encoding::Utf8 => c.len_utf8() as u32,
                Encoding::Utf16 => c.len_utf16() as u32,
            };
            if units + width > position.character {
                return start + i;
            }
            units += width;
        }
        end
    }

    pub fn position(&self, offset: usize) -> lsp::Position {
        let mut offset = offset.min(self.text.len());
        while !self.text.is_char_boundary(offset) {
            offset -= 1;
        }
        let line = self.starts.partition_point(|&start| start <= offset) - 1;
        let prefix = &self.text[self.starts[line]..offset];
        let character = match self.encoding {
            Encoding::Utf8 => prefix.len(),
            Encoding::Utf16 => prefix.encode_utf16().count(),
        };
        lsp::Position { line: line as u32, character: character as u32 }
    }

    pub fn range(&self, span: Span) -> lsp::Range {
        lsp::Range { start: self.position(span.start as usize), end: self.position(span.end as usize) }
    }

    pub fn span(&self, range: lsp::Range) -> Span {
        Span::new(self.offset(range.start), self.offset(range.end))
    }

    /// The pieces of `span` on each of its lines (semantic tokens may not span lines).
    pub fn split_by_line(&self, span: Span) -> Vec<Span> {
        let mut pieces = Vec::new();
        let mut start = span.start as usize;
        let end = span.end as usize;
        while start < end {
            let line_end = self.text[start..end].find('\n').map_or(end, |i| start + i);
            if line_end > start {
                pieces.push(Span::new(start, line_end));
            }
            start = line_end + 1;
        }
        pieces
    }

    /// The length of `span` (on one line) in the client's units.
    pub fn width(&self, span: Span) -> u32 {
        let text = &self.text[span.range()];
        match self.encoding {
            Encoding::Utf8 => text.len() as u32,
            Encoding::Utf16 => text.encode_utf16().count() as u32,
        }
    }
}

/// The LSP form of a diagnostic: the same code, message and span as `dfc check` prints; the
/// label and help line follow the message, and secondary labels are related information.
pub fn diagnostic(d: &Diagnostic, lines: &Lines, uri: &lsp::Uri) -> lsp::Diagnostic {
    let mut message = d.message.clone();
    if !d.primary.message.is_empty() {
        message.push_str(&format!("\n{}", d.primary.message));
    }
    if let Some(help) = &d.help {
        message.push_str(&format!("\nhelp: {help}"));
    }
    let related: Vec<lsp::DiagnosticRelatedInformation> = d
        .secondary
        .iter()
        .map(|label| lsp::DiagnosticRelatedInformation {
            location: lsp::Location { uri: uri.clone(), range: lines.range(label.span) },
            message: label.message.clone(),
        })
        .collect();
    lsp::Diagnostic {
        range: lines.range(d.primary.span),
        severity: Some(match d.severity {
            Severity::Error => lsp::DiagnosticSeverity::ERROR,
            Severity::Warning => lsp::DiagnosticSeverity::WARNING,
        }),
        code: Some(lsp::NumberOrString::String(d.code.as_str().to_string())),
        source: Some("dfc".to_string()),
        message,
        related_information: (!related.is_empty()).then_some(related),
        ..lsp::Diagnostic::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_count_utf16_units_or_bytes() {
        let text = "ab\nx𝄞y\n";
        let lines = Lines::new(text, Encoding::Utf16);
        // 𝄞 is 4 bytes and 2 UTF-16 units.
        assert_eq!(lines.position(8), lsp::Position { line: 1, character: 3 });
        assert_eq!(lines.offset(lsp::Position { line: 1, character: 3 }), 8);
        assert_eq!(lines.offset(lsp::Position { line: 1, character: 2 }), 4, "inside 𝄞: its start");
        assert_eq!(lines.offset(lsp::Position { line: 1, character: 99 }), 9, "past the end of the line");
        assert_eq!(lines.offset(lsp::Position { line: 9, character: 0 }), text.len());
        let lines = Lines::new(text, Encoding::Utf8);
        assert_eq!(lines.position(8), lsp::Position { line: 1, character: 5 });
        assert_eq!(lines.offset(lsp::Position { line: 1, character: 5 }), 8);
        assert_eq!(lines.split_by_line(Span::new(1, 8)), vec![Span::new(1, 2), Span::new(3, 8)]);
    }
}
