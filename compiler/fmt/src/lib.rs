//! The source formatter for `.df` files, for `dfc fmt` and the language server.
//!
//! It works on the token stream, comments included, never on the AST: every token and every
//! comment stays, in order, and the user's line breaks stay where they are. What it decides is
//! the whitespace between tokens (docs/language.md, "Formatting"):
//!
//! - indentation: 4 spaces per open `{`; a line inside `(` or `[` is indented one step (4
//!   spaces) more than the line that opened the innermost one, a line that begins with a closing
//!   bracket as much as the line of its opening one; the continuation lines of a statement split
//!   outside brackets one step more than the statement; a comment line as the code that follows it;
//! - spacing within a line: one space around binary operators, `=` and `->`, one after `,` and
//!   `:`, none inside brackets (nor in `{}`), none after a unary minus, none in `f32[...]`, `f(...)`,
//!   `cast<f32>(...)` and `@device(...)`, one between other tokens;
//! - blank lines: at most one in a row, none after `{` or before `}`, none at the start; the file
//!   ends with one `\n`, has no trailing whitespace, `\n` line ends and no byte-order mark;
//! - alignment: the `=` of consecutive one-line `let NAME = ...` statements, and the trailing
//!   `//` comments of consecutive lines (two spaces after the longest code).
//!
//! Architecture Invariant: `format` never panics, is idempotent, and changes only whitespace
//! outside strings and comments, and trailing whitespace in comments; the AST of its output is
//! the AST of its input.

pub mod cli;
mod lexer;

use dfc_diag::Diagnostic;
use lexer::{Kind, Token};

/// Formats a whole file. Files with syntax errors are not formatted: their diagnostics come back
/// (the errors only, in source order; spans are offsets into `source`).
pub fn format(source: &str) -> Result<String, Vec<Diagnostic>> {
    let (_, diagnostics) = dfc_syntax::parse(source);
    let mut errors: Vec<Diagnostic> = diagnostics.into_iter().filter(Diagnostic::is_error).collect();
    if !errors.is_empty() {
        dfc_diag::sort(&mut errors);
        return Err(errors);
    }
    Ok(format_unchecked(source))
}

/// Lays out any text as `format` would, without checking its syntax first. On text that does not
/// parse the result is only "something reasonable" (not necessarily idempotent); it never
/// panics. For tests and tools that must format broken text anyway.
#[doc(hidden)]
pub fn format_unchecked(source: &str) -> String {
    let text = source.strip_prefix('\u{feff}').unwrap_or(source).replace("\r\n", "\n");
    let tokens = lexer::lex(&text);
    Layout::new(&tokens).render()
}

/// The statements an `@attribute` may precede (`attributes_ahead` in the grammar).
const ATTRIBUTED: &[&str] =
    &["input", "param", "const", "let", "dim", "output", "metric", "minimize", "device", "return"];
/// Keywords that begin a statement or an item.
const STATEMENT_STARTS: &[&str] =
    &["model", "layer", "dim", "input", "param", "const", "let", "output", "metric", "minimize", "device", "return"];

/// The deepest indentation, in steps: text that parses nests at most 64 deep, so this only bounds
/// the output for text that does not.
const MAX_LEVEL: usize = 100;

/// What a token is, where its text alone does not say.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Role {
    #[default]
    Plain,
    /// A `-` that negates.
    Unary,
    /// The `@` of an attribute (not the matrix product).
    AttrAt,
    AttrName,
    /// The `(` of an attribute's arguments.
    AttrParen,
    /// `<`, `f32`, `>` of type arguments, as in `cast<f32>(x)`.
    TypeOpen,
    TypeArg,
    TypeClose,
}

/// One output line: the tokens between two line breaks of the input.
#[derive(Clone, Copy, Debug)]
struct Line {
    start: usize,
    end: usize,
    /// Whether a blank line is printed before it.
    blank_before: bool,
    /// Indentation, in steps of 4 spaces.
    level: usize,
}

struct Layout<'t, 'a> {
    tokens: &'t [Token<'a>],
    roles: Vec<Role>,
    lines: Vec<Line>,
    /// For each token, the first code token (not a comment) at or after it.
    next_code: Vec<Option<usize>>,
}

impl<'t, 'a> Layout<'t, 'a> {
    fn new(tokens: &'t [Token<'a>]) -> Self {
        let mut next_code = vec![None; tokens.len() + 1];
        for i in (0..tokens.len()).rev() {
            next_code[i] = if tokens[i].is_comment() { next_code[i + 1] } else { Some(i) };
        }
        let mut layout = Layout { tokens, roles: vec![Role::Plain; tokens.len()], lines: Vec::new(), next_code };
        layout.classify();
        layout.split_lines();
        layout.indent();
        layout
    }

    fn is(&self, i: usize, punct: &str) -> bool {
        self.tokens.get(i).is_some_and(|t| t.is(punct))
    }

    fn previous_code(&self, i: usize) -> Option<usize> {
        (0..i).rev().find(|&j| !self.tokens[j].is_comment())
    }

    /// Finds type arguments, unary minuses and attributes.
    fn classify(&mut self) {
        let n = self.tokens.len();
        for i in 0..n {
            let token = self.tokens[i];
            if token.is("<")
                && i > 0
                && self.tokens[i - 1].kind == Kind::Ident
                && self.tokens.get(i + 1).is_some_and(|t| t.kind == Kind::DType)
                && self.is(i + 2, ">")
            {
                self.roles[i] = Role::TypeOpen;
                self.roles[i + 1] = Role::TypeArg;
                self.roles[i + 2] = Role::TypeClose;
            } else if token.is("-") && self.roles[i] == Role::Plain {
                let unary = match self.previous_code(i) {
                    None => true,
                    Some(p) => {
                        let prev = self.tokens[p];
                        match prev.kind {
                            Kind::Punct => !matches!(prev.text, ")" | "]" | "}") && self.roles[p] != Role::TypeClose,
                            Kind::Keyword => !matches!(prev.text, "true" | "false"),
                            _ => false,
                        }
                    }
                };
                if unary {
                    self.roles[i] = Role::Unary;
                }
            } else if token.is("@") && self.roles[i] == Role::Plain {
                if let Some(marks) = self.attributes_at(i) {
                    for (at, name, paren) in marks {
                        self.roles[at] = Role::AttrAt;
                        self.roles[name] = Role::AttrName;
                        if let Some(paren) = paren {
                            self.roles[paren] = Role::AttrParen;
                        }
                    }
                }
            }
        }
    }

    /// If the `@` at `i` begins attributes of a statement (`@a @b(1) let ...`, each `@NAME(`
    /// written without spaces), the `@`, name and `(` of each; otherwise it is a matrix product.
    fn attributes_at(&self, mut at: usize) -> Option<Vec<(usize, usize, Option<usize>)>> {
        let tokens = self.tokens;
        let mut marks = Vec::new();
        loop {
            let name = at + 1;
            let t = tokens.get(name)?;
            if !t.glued || !matches!(t.kind, Kind::Ident | Kind::Keyword | Kind::DType) {
                return None;
            }
            let mut next = name + 1;
            let mut paren = None;
            if self.is(next, "(") && tokens[next].glued {
                paren = Some(next);
                let mut depth = 0usize;
                loop {
                    let t = tokens.get(next)?;
                    if t.is("(") {
                        depth += 1;
                    } else if t.is(")") {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    next += 1;
                }
                next += 1;
            }
            marks.push((at, name, paren));
            let next = self.next_code[next.min(tokens.len())]?;
            let t = tokens[next];
            if t.is("@") {
                at = next;
            } else if t.kind == Kind::Keyword && ATTRIBUTED.contains(&t.text) {
                return Some(marks);
            } else {
                return None;
            }
        }
    }

    /// Whether the code token `i` begins a statement or an item (or a block).
    fn starts_statement(&self, i: usize) -> bool {
        let t = self.tokens[i];
        (t.kind == Kind::Keyword && STATEMENT_STARTS.contains(&t.text))
            || self.roles[i] == Role::AttrAt
            || t.is("{")
            || t.is("}")
    }

    fn split_lines(&mut self) {
        let mut start = 0;
        for i in 1..=self.tokens.len() {
            if i == self.tokens.len() || self.tokens[i].newlines > 0 {
                let blank_before = start > 0 && self.tokens[start].newlines > 1;
                self.lines.push(Line { start, end: i, blank_before, level: 0 });
                start = i;
            }
        }
        // No blank line after `{` or before `}`.
        for l in 1..self.lines.len() {
            let (previous, line) = (self.lines[l - 1], self.lines[l]);
            let last = (previous.start..previous.end).rev().find(|&i| !self.tokens[i].is_comment());
            if last.is_some_and(|i| self.tokens[i].is("{")) || self.tokens[line.start].is("}") {
                self.lines[l].blank_before = false;
            }
        }
    }

    /// Sets the indentation of every line.
    fn indent(&mut self) {
        // Open brackets, with the line each was opened on.
        let mut open: Vec<(&str, usize)> = Vec::new();
        let mut last_code: Option<usize> = None;
        for l in 0..self.lines.len() {
            let Line { start, end, .. } = self.lines[l];
            // A comment line is indented as the code after it, but inside any bracket that code
            // closes.
            let (lead, closes) = match (start..end).find(|&i| !self.tokens[i].is_comment()) {
                Some(i) => (Some(i), true),
                None => (self.next_code[end], false),
            };
            let braces = open.iter().filter(|(b, _)| *b == "{").count();
            let innermost = open.last().copied();
            let closer = lead.filter(|_| closes).map(|i| self.tokens[i].text);
            let level = match (closer, innermost) {
                (Some("}"), _) => braces.saturating_sub(1),
                (Some(")" | "]"), Some(("(" | "[", line))) => self.lines[line].level,
                (Some(")" | "]"), _) => braces,
                (_, Some(("(" | "[", line))) => self.lines[line].level + 1,
                _ => {
                    let continues = last_code.is_some_and(|i| !self.is(i, "{") && !self.is(i, "}"))
                        && lead.is_some_and(|i| !self.starts_statement(i));
                    braces + usize::from(continues)
                }
            };
            self.lines[l].level = level.min(MAX_LEVEL);
            for i in start..end {
                let t = self.tokens[i];
                if t.is_comment() {
                    continue;
                }
                match t.text {
                    "{" | "(" | "[" if t.kind == Kind::Punct => open.push((t.text, l)),
                    "}" | ")" | "]" if t.kind == Kind::Punct => {
                        open.pop();
                    }
                    _ => {}
                }
                last_code = Some(i);
            }
        }
    }

    /// Spaces between token `i` and the one before it on the same line.
    fn space_before(&self, i: usize) -> usize {
        let (prev, token) = (self.tokens[i - 1], self.tokens[i]);
        let glued = match self.roles[i] {
            Role::AttrName | Role::AttrParen | Role::TypeOpen | Role::TypeArg | Role::TypeClose => true,
            _ => match self.roles[i - 1] {
                Role::TypeClose => token.is("("),
                // `-x`, `-(a + b)`, `--x`; never `- >`, which would read as `->`.
                Role::Unary => {
                    matches!(token.kind, Kind::Ident | Kind::Keyword | Kind::DType | Kind::Number | Kind::Str)
                        || token.is("(")
                        || token.is("[")
                        || token.is("-")
                }
                _ => {
                    prev.is("(")
                        || prev.is("[")
                        || (token.kind == Kind::Punct && matches!(token.text, ")" | "]" | "," | ":"))
                        || (token.is("(") && prev.kind == Kind::Ident)
                        || (token.is("[") && prev.kind == Kind::DType)
                        || (token.is("}") && prev.is("{"))
                }
            },
        };
        usize::from(!glued)
    }

    /// Whether line `l` is a whole `let NAME = ...` statement without a type, whose `=` may be
    /// aligned with its neighbours'.
    fn aligns_let(&self, l: usize) -> bool {
        let Line { start, end, .. } = self.lines[l];
        let t = &self.tokens[start..end];
        t.len() > 3
            && t[0].kind == Kind::Keyword
            && t[0].text == "let"
            && t[1].kind == Kind::Ident
            && t[2].is("=")
            && t.iter().all(|t| !t.text.contains('\n') && !t.is("{") && !t.is("}"))
            && self.next_code[end].is_none_or(|i| self.starts_statement(i))
    }

    fn render(&self) -> String {
        // Pad the names of aligned lets.
        let mut let_width: Vec<Option<usize>> = vec![None; self.lines.len()];
        let mut l = 0;
        while l < self.lines.len() {
            if !self.aligns_let(l) {
                l += 1;
                continue;
            }
            let mut end = l + 1;
            while end < self.lines.len()
                && !self.lines[end].blank_before
                && self.lines[end].level == self.lines[l].level
                && self.aligns_let(end)
            {
                end += 1;
            }
            let width = (l..end).map(|l| self.tokens[self.lines[l].start + 1].text.len()).max().unwrap_or(0);
            for slot in &mut let_width[l..end] {
                *slot = Some(width);
            }
            l = end;
        }

        // Each line's code, and its trailing `//` comment.
        let mut rendered: Vec<(String, Option<&str>)> = Vec::with_capacity(self.lines.len());
        for (l, line) in self.lines.iter().enumerate() {
            let mut end = line.end;
            let mut trailing = None;
            if end - line.start > 1 && self.tokens[end - 1].kind == Kind::LineComment {
                end -= 1;
                trailing = Some(self.tokens[end].text);
            }
            let mut code = " ".repeat(4 * line.level);
            for i in line.start..end {
                if i > line.start {
                    let spaces = match let_width[l] {
                        Some(width) if i == line.start + 2 => width + 1 - self.tokens[i - 1].text.len(),
                        _ => self.space_before(i),
                    };
                    code.extend(std::iter::repeat_n(' ', spaces));
                }
                push_token(&mut code, self.tokens[i]);
            }
            rendered.push((code, trailing));
        }

        // Align the trailing comments of consecutive lines.
        let mut column: Vec<usize> = vec![0; rendered.len()];
        let single_line = |l: usize| rendered[l].1.is_some() && !rendered[l].0.contains('\n');
        let mut l = 0;
        while l < rendered.len() {
            if !single_line(l) {
                l += 1;
                continue;
            }
            let mut end = l + 1;
            while end < rendered.len() && !self.lines[end].blank_before && single_line(end) {
                end += 1;
            }
            let width = (l..end).map(|l| rendered[l].0.chars().count()).max().unwrap_or(0);
            for slot in &mut column[l..end] {
                *slot = width + 2;
            }
            l = end;
        }

        let mut out = String::new();
        for (l, (code, trailing)) in rendered.iter().enumerate() {
            if l > 0 {
                out.push('\n');
                if self.lines[l].blank_before {
                    out.push('\n');
                }
            }
            out.push_str(code);
            if let Some(comment) = trailing {
                let width = code.rsplit('\n').next().unwrap_or("").chars().count();
                // A comment after a multi-line block comment is not aligned.
                let spaces = if column[l] == 0 { 2 } else { column[l] - width };
                out.extend(std::iter::repeat_n(' ', spaces));
                out.push_str(comment);
            }
        }
        if !out.is_empty() {
            out.push('\n');
        }
        out
    }
}

/// Appends a token; a block comment loses the trailing whitespace of its lines.
fn push_token(out: &mut String, token: Token) {
    if token.kind == Kind::BlockComment && token.text.contains('\n') {
        let mut lines = token.text.split('\n');
        out.push_str(lines.next().unwrap_or("").trim_end());
        for line in lines {
            out.push('\n');
            out.push_str(line.trim_end());
        }
    } else {
        out.push_str(token.text);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fmt(text: &str) -> String {
        match format(text) {
            Ok(out) => out,
            Err(errors) => panic!("{text:?} does not parse: {errors:?}"),
        }
    }

    #[test]
    fn spacing_within_lines() {
        assert_eq!(fmt("model m{input x:f32[ 2,3 ] output x}"), "model m { input x: f32[2, 3] output x }\n");
        assert_eq!(fmt("model m  {  }"), "model m {}\n");
        assert_eq!(
            fmt("model m {\n  input x : f32 [2]\n  let y=cast < f64 > ( - x )*-2@x-1\n  output y }"),
            "model m {\n    input x: f32[2]\n    let y = cast<f64>(-x) * -2 @ x - 1\n    output y }\n"
        );
        assert_eq!(
            fmt("model m {\n @device( \"cpu\" )  @partitioned(2) param w:f32[4]=uniform(min= -1,max=1)\n output w }"),
            "model m {\n    @device(\"cpu\") @partitioned(2) param w: f32[4] = uniform(min = -1, max = 1)\n    output w }\n"
        );
    }

    #[test]
    fn an_at_glued_to_a_name_before_a_statement_stays_an_attribute() {
        let text = "model m {\n    input x: f32[2, 2]\n    let y = x@x+x\n    let z = x @w\n    @w\n    let w = x\n    output y }\n";
        let out = fmt(text);
        assert!(out.contains("let y = x @ x + x\n"), "{out}");
        assert!(out.contains("let z = x @w\n"), "{out}");
        assert_eq!(dfc_syntax::dump(&dfc_syntax::parse(text).0), dfc_syntax::dump(&dfc_syntax::parse(&out).0));
    }

    #[test]
    fn errors_come_back() {
        let errors = format("model m { let = }").unwrap_err();
        assert!(errors.iter().all(Diagnostic::is_error) && !errors.is_empty());
    }

    #[test]
    fn empty_files_stay_empty() {
        assert_eq!(fmt(""), "");
        assert_eq!(fmt("\u{feff}\r\n  \n"), "");
        assert_eq!(fmt("// just a comment"), "// just a comment\n");
    }
}
