//! The front end of dfc: `.df` text → AST with spans, plus syntax diagnostics.
//!
//! Architecture Invariant: parsing never fails. `parse` always returns a tree (possibly with
//! statements left out) and every syntax error it found, so that later stages and the editor
//! always have something to work with. No input may make it panic (see the fuzz target).

pub mod ast;
mod dump;
mod lexer;
mod parser;

pub use dump::dump;
pub use lexer::{lex, Token, TokenKind, DTYPES, KEYWORDS};
pub use parser::{parse, parse_call};
