//! What an editor asks of a `.df` file — diagnostics, hover, definitions, references, rename,
//! completion, symbols, highlighting — answered in byte offsets and plain data.
//!
//! Architecture Invariant: nothing here knows LSP (no positions in UTF-16, no JSON); the
//! language server in `src/lsp/` converts. Every question is answered from one `FileAnalysis`,
//! made once per version of the text, and none may panic on any text: a broken file still has
//! the names and types of the parts that parse.

mod complete;
mod hover;
pub mod resolve;
mod symbols;
mod tokens;

pub use complete::{Completion, CompletionKind};
pub use hover::Hover;
pub use resolve::{Def, DefKind, Names, Target, Use};
pub use symbols::Symbol;
pub use tokens::{SemanticToken, TokenKind, DECLARATION, DEFAULT_LIBRARY, MODIFIERS, READONLY, TOKEN_KINDS};

use dfc_diag::{Diagnostic, Span};
use dfc_syntax::ast::SourceFile;
use std::collections::HashMap;

/// One version of a file, analysed: the tree, the diagnostics `dfc check` would print, every
/// name resolved, and what each analysed expression stood for.
pub struct FileAnalysis {
    pub source: String,
    pub file: SourceFile,
    pub diagnostics: Vec<Diagnostic>,
    pub names: Names,
    /// Distinct type texts per span, in the order analysis met them (a layer's expressions
    /// have one per distinct instance).
    types: HashMap<Span, Vec<String>>,
}

impl FileAnalysis {
    pub fn new(source: String) -> FileAnalysis {
        let (file, syntax) = dfc_syntax::parse(&source);
        let (analyses, diagnostics) = dfc_sema::check_file(&file, syntax, &dfc_sema::Options::default());
        let mut types: HashMap<Span, Vec<String>> = HashMap::new();
        for (span, text) in analyses.into_iter().flat_map(|a| a.types) {
            let texts = types.entry(span).or_default();
            if !texts.contains(&text) {
                texts.push(text);
            }
        }
        let names = resolve::resolve(&file);
        FileAnalysis { source, file, diagnostics, names, types }
    }

    /// The types analysis found for exactly this span.
    pub fn types_at(&self, span: Span) -> &[String] {
        self.types.get(&span).map(Vec::as_slice).unwrap_or(&[])
    }

    /// The smallest analysed expression around `offset`, with its types.
    pub fn expression_at(&self, offset: usize) -> Option<(Span, &[String])> {
        self.types
            .iter()
            .filter(|(span, _)| resolve::covers(**span, offset) && !span.is_empty())
            .min_by_key(|(span, _)| (span.len(), span.start))
            .map(|(span, texts)| (*span, texts.as_slice()))
    }

    /// Where the name at `offset` is defined.
    pub fn definition(&self, offset: usize) -> Option<Span> {
        self.names.target_at(offset).map(|def| self.names.defs[def].span)
    }

    /// Every occurrence of the name at `offset`, its definition included or not.
    pub fn references(&self, offset: usize, include_definition: bool) -> Vec<Span> {
        let Some(def) = self.names.target_at(offset) else { return Vec::new() };
        let mut spans = self.names.occurrences(def);
        if !include_definition {
            spans.remove(0);
        }
        spans
    }

    /// The span of the name at `offset` and its current text, if it can be renamed.
    pub fn prepare_rename(&self, offset: usize) -> Result<(Span, String), String> {
        if let Some(def) = self.names.target_at(offset) {
            let span = self.names.def_at(offset).map(|d| self.names.defs[d].span);
            let span = span.or_else(|| self.names.use_at(offset).map(|u| u.span)).expect("a name is at the offset");
            return Ok((span, self.names.defs[def].name.clone()));
        }
        match self.names.use_at(offset) {
            Some(u) if u.target == Target::Builtin => Err(format!("`{}` is built in and cannot be renamed", u.name)),
            Some(u) => Err(format!("`{}` is not defined in this file", u.name)),
            None => Err("there is no name here to rename".to_string()),
        }
    }

    /// The edits that rename the name at `offset` to `new_name`: every occurrence's span.
    pub fn rename(&self, offset: usize, new_name: &str) -> Result<Vec<Span>, String> {
        self.prepare_rename(offset)?;
        let def = self.names.target_at(offset).expect("prepare_rename found a definition");
        if !is_identifier(new_name) {
            return Err(format!("`{new_name}` is not a name: names are letters, digits and `_`, not starting with a digit, and not a keyword or type"));
        }
        let renamed = &self.names.defs[def];
        let owner = renamed.owner;
        let clash = self.names.defs.iter().enumerate().find(|(i, d)| {
            *i != def && d.name == new_name && (d.owner.is_none() || owner.is_none() || d.owner == owner)
        });
        if let Some((_, other)) = clash {
            return Err(format!("`{new_name}` is already the name of a {} here", other.kind.word()));
        }
        if resolve::is_builtin(new_name) {
            return Err(format!("`{new_name}` is a built-in name"));
        }
        Ok(self.names.occurrences(def))
    }

    pub fn hover(&self, offset: usize) -> Option<Hover> {
        hover::hover(self, offset)
    }

    pub fn completions(&self, offset: usize) -> Vec<Completion> {
        complete::completions(self, offset)
    }

    pub fn symbols(&self) -> Vec<Symbol> {
        symbols::symbols(self)
    }

    pub fn semantic_tokens(&self) -> Vec<SemanticToken> {
        tokens::semantic_tokens(self)
    }

    pub fn text(&self, span: Span) -> &str {
        self.source.get(span.range()).unwrap_or("")
    }
}

pub use dfc_syntax::{DTYPES, KEYWORDS};

/// Whether `text` can be a name: an identifier that is not a keyword or a type.
pub fn is_identifier(text: &str) -> bool {
    let mut chars = text.chars();
    let first_ok = chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    first_ok
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !KEYWORDS.contains(&text)
        && !DTYPES.contains(&text)
}
