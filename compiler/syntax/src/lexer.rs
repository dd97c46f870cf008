//! The tokens of `.df` text, comments included: what highlighting and formatting work on. The
//! parser does not use it (pest reads characters); the two agree on what a name, number, string
//! and comment are, which the tests check on every example.

use dfc_diag::Span;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TokenKind {
    Ident,
    /// `model`, `let`, `with`, `true`, ...
    Keyword,
    /// `f32`, `i32`, ...
    DType,
    Int,
    Float,
    /// A string with its quotes (an unterminated one runs to the end of its line).
    Str,
    LineComment,
    /// `/* ... */` (an unterminated one runs to the end of the text).
    BlockComment,
    /// An operator or bracket: `( ) [ ] { } , : = + - * / @ < > == != <= >= ->`.
    Punct,
    /// A character the language has no use for.
    Unknown,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Token {
    pub kind: TokenKind,
    pub span: Span,
}

pub const KEYWORDS: &[&str] = &[
    "model", "layer", "dim", "input", "param", "const", "let", "output", "metric", "minimize", "with", "device",
    "return", "as", "true", "false",
];
pub const DTYPES: &[&str] = &["f32", "f64", "i32", "i64", "u8", "bool"];

/// Every token of `source`, whitespace left out. Never fails: anything unexpected is an
/// `Unknown` token of one character.
pub fn lex(source: &str) -> Vec<Token> {
    let bytes = source.as_bytes();
    let mut tokens = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let start = i;
        let c = bytes[i];
        let kind = match c {
            b' ' | b'\t' | b'\r' | b'\n' => {
                i += 1;
                continue;
            }
            // The grammar counts a byte-order mark anywhere as whitespace.
            _ if source[i..].starts_with('\u{feff}') => {
                i += '\u{feff}'.len_utf8();
                continue;
            }
            b'/' if bytes.get(i + 1) == Some(&b'/') => {
                // Without the line's trailing whitespace (a `\r` of CRLF included).
                let end = memchr(bytes, i, b'\n');
                i += source[i..end].trim_end().len();
                TokenKind::LineComment
            }
            b'/' if bytes.get(i + 1) == Some(&b'*') => {
                i = source[i + 2..].find("*/").map_or(bytes.len(), |end| i + 2 + end + 2);
                TokenKind::BlockComment
            }
            b'"' => {
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' && bytes[i] != b'\n' {
                    if bytes[i] == b'\\' {
                        i += 1;
                        if i >= bytes.len() {
                            break;
                        }
                    }
                    // Whole characters: an escaped one may be several bytes.
                    i += source[i..].chars().next().map_or(1, char::len_utf8);
                }
                if bytes.get(i) == Some(&b'"') {
                    i += 1;
                }
                TokenKind::Str
            }
            b'0'..=b'9' => number(bytes, &mut i),
            b'.' if bytes.get(i + 1).is_some_and(u8::is_ascii_digit) => number(bytes, &mut i),
            b'a'..=b'z' | b'A'..=b'Z' | b'_' => {
                while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
                    i += 1;
                }
                let word = &source[start..i];
                if KEYWORDS.contains(&word) {
                    TokenKind::Keyword
                } else if DTYPES.contains(&word) {
                    TokenKind::DType
                } else {
                    TokenKind::Ident
                }
            }
            b'=' | b'!' | b'<' | b'>' if bytes.get(i + 1) == Some(&b'=') => {
                i += 2;
                TokenKind::Punct
            }
            b'-' if bytes.get(i + 1) == Some(&b'>') => {
                i += 2;
                TokenKind::Punct
            }
            b'(' | b')' | b'[' | b']' | b'{' | b'}' | b',' | b':' | b'=' | b'+' | b'-' | b'*' | b'/' | b'@' | b'<'
            | b'>' => {
                i += 1;
                TokenKind::Punct
            }
            _ => {
                // One character, whole (it may be several bytes).
                i += source[i..].chars().next().map_or(1, char::len_utf8);
                TokenKind::Unknown
            }
        };
        tokens.push(Token { kind, span: Span::new(start, i) });
    }
    tokens
}

fn memchr(bytes: &[u8], from: usize, byte: u8) -> usize {
    bytes[from..].iter().position(|&b| b == byte).map_or(bytes.len(), |at| from + at)
}

/// `12`, `1.5`, `.5`, `1e-3`, `2.5E+4`: the grammar's `int` and `float`.
fn number(bytes: &[u8], i: &mut usize) -> TokenKind {
    let digits = |i: &mut usize| {
        while *i < bytes.len() && bytes[*i].is_ascii_digit() {
            *i += 1;
        }
    };
    digits(i);
    let mut kind = TokenKind::Int;
    if bytes.get(*i) == Some(&b'.') {
        *i += 1;
        digits(i);
        kind = TokenKind::Float;
    }
    if matches!(bytes.get(*i), Some(b'e' | b'E')) {
        let mut j = *i + 1;
        if matches!(bytes.get(j), Some(b'+' | b'-')) {
            j += 1;
        }
        if bytes.get(j).is_some_and(u8::is_ascii_digit) {
            *i = j;
            digits(i);
            kind = TokenKind::Float;
        }
    }
    kind
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(source: &str) -> Vec<(TokenKind, &str)> {
        lex(source).into_iter().map(|t| (t.kind, &source[t.span.range()])).collect()
    }

    #[test]
    fn tokens_cover_every_kind() {
        use TokenKind::*;
        assert_eq!(
            kinds("let x: f32[n] = cast<f32>(y) @ w // note\n/* a */ 1.5e-3 .5 3 \"s\\\"q\" -> == é"),
            vec![
                (Keyword, "let"),
                (Ident, "x"),
                (Punct, ":"),
                (DType, "f32"),
                (Punct, "["),
                (Ident, "n"),
                (Punct, "]"),
                (Punct, "="),
                (Ident, "cast"),
                (Punct, "<"),
                (DType, "f32"),
                (Punct, ">"),
                (Punct, "("),
                (Ident, "y"),
                (Punct, ")"),
                (Punct, "@"),
                (Ident, "w"),
                (LineComment, "// note"),
                (BlockComment, "/* a */"),
                (Float, "1.5e-3"),
                (Float, ".5"),
                (Int, "3"),
                (Str, "\"s\\\"q\""),
                (Punct, "->"),
                (Punct, "=="),
                (Unknown, "é"),
            ]
        );
    }

    #[test]
    fn unterminated_strings_and_comments_end_the_line_or_text() {
        assert_eq!(kinds("\"abc\nx"), vec![(TokenKind::Str, "\"abc"), (TokenKind::Ident, "x")]);
        assert_eq!(kinds("/* abc"), vec![(TokenKind::BlockComment, "/* abc")]);
        assert_eq!(kinds("\"a\\"), vec![(TokenKind::Str, "\"a\\")]);
        assert_eq!(kinds("\"\\é\" x"), vec![(TokenKind::Str, "\"\\é\""), (TokenKind::Ident, "x")]);
        assert_eq!(
            kinds("a // c  \r\n\u{feff}b"),
            vec![(TokenKind::Ident, "a"), (TokenKind::LineComment, "// c"), (TokenKind::Ident, "b")]
        );
    }
}
