//! Semantic highlighting: every token of the file classified by what it is — a keyword, a
//! type, a layer, a built-in, a param being defined — from the lexer and the resolved names.

use crate::resolve::{DefKind, Target};
use crate::FileAnalysis;
use dfc_diag::Span;
use dfc_syntax::TokenKind as Lexical;
use std::collections::HashMap;

/// The token types, in the order the language server announces them (LSP's standard names).
pub const TOKEN_KINDS: &[&str] = &[
    "keyword",
    "type",
    "class",
    "function",
    "parameter",
    "variable",
    "property",
    "number",
    "string",
    "comment",
    "operator",
    "decorator",
];
/// The modifiers, in the order the language server announces them (bit `i` is `MODIFIERS[i]`).
pub const MODIFIERS: &[&str] = &["declaration", "readonly", "defaultLibrary"];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenKind {
    Keyword,
    Type,
    /// A model.
    Class,
    /// A layer or a built-in op, optimizer or initializer.
    Function,
    /// A layer's parameter or size name, or an argument's name.
    Parameter,
    /// Inputs, lets, consts, dims, metrics.
    Variable,
    /// A trainable param.
    Property,
    Number,
    String,
    Comment,
    Operator,
    /// `@device`, `@partitioned`.
    Decorator,
}

pub const DECLARATION: u32 = 1;
pub const READONLY: u32 = 2;
pub const DEFAULT_LIBRARY: u32 = 4;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SemanticToken {
    pub span: Span,
    pub kind: TokenKind,
    /// Bits of `DECLARATION`, `READONLY`, `DEFAULT_LIBRARY`.
    pub modifiers: u32,
}

pub fn semantic_tokens(analysis: &FileAnalysis) -> Vec<SemanticToken> {
    let names = &analysis.names;
    let defs: HashMap<u32, usize> = names.defs.iter().enumerate().map(|(i, d)| (d.span.start, i)).collect();
    let uses: HashMap<u32, Target> = names.uses.iter().map(|u| (u.span.start, u.target)).collect();
    let tokens = dfc_syntax::lex(&analysis.source);
    let mut out = Vec::with_capacity(tokens.len());
    for (i, token) in tokens.iter().enumerate() {
        let text = analysis.text(token.span);
        let after_at = i > 0 && tokens[i - 1].span.end == token.span.start && analysis.text(tokens[i - 1].span) == "@";
        let (kind, modifiers) = match token.kind {
            _ if after_at => (TokenKind::Decorator, 0),
            Lexical::Keyword if text == "true" || text == "false" => (TokenKind::Number, 0),
            Lexical::Keyword => (TokenKind::Keyword, 0),
            Lexical::DType => (TokenKind::Type, 0),
            Lexical::Int | Lexical::Float => (TokenKind::Number, 0),
            Lexical::Str => (TokenKind::String, 0),
            Lexical::LineComment | Lexical::BlockComment => (TokenKind::Comment, 0),
            Lexical::Punct
                if text == "@" && tokens.get(i + 1).is_some_and(|next| next.span.start == token.span.end) =>
            {
                (TokenKind::Decorator, 0)
            }
            Lexical::Punct => match text {
                "(" | ")" | "[" | "]" | "{" | "}" | "," | ":" => continue,
                _ => (TokenKind::Operator, 0),
            },
            Lexical::Unknown => continue,
            Lexical::Ident => {
                if let Some(&def) = defs.get(&token.span.start) {
                    let (kind, readonly) = def_kind(names.defs[def].kind);
                    (kind, DECLARATION | if readonly { READONLY } else { 0 })
                } else {
                    match uses.get(&token.span.start) {
                        Some(Target::Def(def)) => {
                            let (kind, readonly) = def_kind(names.defs[*def].kind);
                            (kind, if readonly { READONLY } else { 0 })
                        }
                        Some(Target::Builtin) => (TokenKind::Function, DEFAULT_LIBRARY),
                        // A keyword argument of a built-in (`lr = 0.01`) or an unknown name.
                        _ if is_keyword_argument(analysis, &tokens, i) => (TokenKind::Parameter, 0),
                        _ => (TokenKind::Variable, 0),
                    }
                }
            }
        };
        out.push(SemanticToken { span: token.span, kind, modifiers });
    }
    out
}

fn def_kind(kind: DefKind) -> (TokenKind, bool) {
    match kind {
        DefKind::Model => (TokenKind::Class, false),
        DefKind::Layer => (TokenKind::Function, false),
        DefKind::LayerParam | DefKind::SizeName => (TokenKind::Parameter, false),
        DefKind::Param => (TokenKind::Property, false),
        DefKind::Dim | DefKind::Const => (TokenKind::Variable, true),
        DefKind::Input | DefKind::Let | DefKind::Metric | DefKind::OutputAlias => (TokenKind::Variable, false),
    }
}

/// `name` in `f(name = value)`: followed by a single `=`.
fn is_keyword_argument(analysis: &FileAnalysis, tokens: &[dfc_syntax::Token], i: usize) -> bool {
    tokens.get(i + 1).is_some_and(|next| analysis.text(next.span) == "=")
        && i > 0
        && matches!(analysis.text(tokens[i - 1].span), "(" | ",")
}
