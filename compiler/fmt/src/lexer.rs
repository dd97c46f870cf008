//! The formatter's tokens: `dfc_syntax::lex`'s (everything but whitespace, comments
//! included), with how much whitespace came before each. Anything the language has no use for
//! is an `Unknown` token of one character (such text never parses, so it is only ever laid out
//! by `format_unchecked`).

use dfc_syntax::TokenKind as SyntaxKind;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Ident,
    /// `model`, `let`, `with`, `true`, ...
    Keyword,
    /// `f32`, `i32`, ...
    DType,
    Number,
    /// A string with its quotes (an unterminated one runs to the end of its line).
    Str,
    /// `// ...`, without the trailing whitespace of its line.
    LineComment,
    /// `/* ... */` (an unterminated one runs to the end of the text).
    BlockComment,
    /// An operator or bracket: `( ) [ ] { } , : = + - * / @ < > == != <= >= ->`.
    Punct,
    Unknown,
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Token<'a> {
    pub kind: Kind,
    pub text: &'a str,
    /// Line breaks in the whitespace before the token.
    pub newlines: usize,
    /// Whether the token directly follows the previous one, without whitespace.
    pub glued: bool,
}

impl Token<'_> {
    pub fn is(&self, punct: &str) -> bool {
        self.kind == Kind::Punct && self.text == punct
    }

    pub fn is_comment(&self) -> bool {
        matches!(self.kind, Kind::LineComment | Kind::BlockComment)
    }
}

/// Every token of `text` (in which line breaks are `\n`), from `dfc_syntax::lex`, with the
/// whitespace before each counted. Never fails.
pub(crate) fn lex(text: &str) -> Vec<Token<'_>> {
    let mut previous_end = 0;
    dfc_syntax::lex(text)
        .into_iter()
        .map(|token| {
            let range = token.span.range();
            let gap = &text[previous_end..range.start];
            let glued = gap.is_empty();
            let newlines = gap.matches('\n').count();
            previous_end = range.end;
            let kind = match token.kind {
                SyntaxKind::Ident => Kind::Ident,
                SyntaxKind::Keyword => Kind::Keyword,
                SyntaxKind::DType => Kind::DType,
                SyntaxKind::Int | SyntaxKind::Float => Kind::Number,
                SyntaxKind::Str => Kind::Str,
                SyntaxKind::LineComment => Kind::LineComment,
                SyntaxKind::BlockComment => Kind::BlockComment,
                SyntaxKind::Punct => Kind::Punct,
                SyntaxKind::Unknown => Kind::Unknown,
            };
            Token { kind, text: &text[range], newlines, glued }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(text: &str) -> Vec<(Kind, &str)> {
        lex(text).into_iter().map(|t| (t.kind, t.text)).collect()
    }

    #[test]
    fn numbers_follow_the_grammar() {
        for number in ["0", "784", "0.5", "1.", ".5", "1e-3", "2.5E+2", "1.e1", "3.0E+2"] {
            assert_eq!(kinds(number), [(Kind::Number, number)], "{number}");
        }
        assert_eq!(kinds("1e"), [(Kind::Number, "1"), (Kind::Ident, "e")]);
        assert_eq!(kinds("1e+x"), [(Kind::Number, "1"), (Kind::Ident, "e"), (Kind::Punct, "+"), (Kind::Ident, "x")]);
    }

    #[test]
    fn strings_comments_and_operators() {
        assert_eq!(kinds(r#""sa\"me\\" x"#), [(Kind::Str, r#""sa\"me\\""#), (Kind::Ident, "x")]);
        assert_eq!(kinds("\"open\nx"), [(Kind::Str, "\"open"), (Kind::Ident, "x")]);
        assert_eq!(kinds("a // c  \r\nb"), [(Kind::Ident, "a"), (Kind::LineComment, "// c"), (Kind::Ident, "b")]);
        assert_eq!(
            kinds("/* a\n*/b /*"),
            [(Kind::BlockComment, "/* a\n*/"), (Kind::Ident, "b"), (Kind::BlockComment, "/*")]
        );
        assert_eq!(
            kinds("->=<=!x"),
            [(Kind::Punct, "->"), (Kind::Punct, "="), (Kind::Punct, "<="), (Kind::Unknown, "!"), (Kind::Ident, "x")]
        );
        assert_eq!(kinds("let f32 é"), [(Kind::Keyword, "let"), (Kind::DType, "f32"), (Kind::Unknown, "é")]);
    }

    #[test]
    fn whitespace_is_counted() {
        let tokens = lex("a b\n\nc\u{feff}d");
        let shape: Vec<(usize, bool)> = tokens.iter().map(|t| (t.newlines, t.glued)).collect();
        assert_eq!(shape, [(0, true), (0, false), (2, false), (0, false)]);
    }
}
