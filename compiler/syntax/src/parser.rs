//! pest parse tree → AST, with syntax diagnostics.
//!
//! The grammar swallows unparseable statements and items into `bad_stmt` / `bad_item`; for each,
//! the text is parsed again with the strict rule so that the error points at the exact token
//! and says what was expected there.

use crate::ast::*;
use dfc_diag::{Code, Diagnostic, Span};
use pest::iterators::Pair;
use pest::pratt_parser::{Assoc, Op, PrattParser};
use pest::Parser as _;
use std::sync::LazyLock;

#[derive(pest_derive::Parser)]
#[grammar = "../../grammar/dfc.pest"]
struct DfcParser;

static PRATT: LazyLock<PrattParser<Rule>> = LazyLock::new(|| {
    PrattParser::new()
        .op(Op::infix(Rule::eq, Assoc::Left)
            | Op::infix(Rule::ne, Assoc::Left)
            | Op::infix(Rule::lt, Assoc::Left)
            | Op::infix(Rule::le, Assoc::Left)
            | Op::infix(Rule::gt, Assoc::Left)
            | Op::infix(Rule::ge, Assoc::Left))
        .op(Op::infix(Rule::add, Assoc::Left) | Op::infix(Rule::sub, Assoc::Left))
        .op(Op::infix(Rule::mul, Assoc::Left)
            | Op::infix(Rule::div, Assoc::Left)
            | Op::infix(Rule::matmul, Assoc::Left))
        .op(Op::prefix(Rule::neg))
});

/// Brackets may nest this deep; pest's recursive descent would overflow the stack on
/// pathological nesting, so deeper text is reported and blanked before parsing.
const MAX_NESTING: usize = 64;
/// How deep one expression's tree may be (operator chains are flat in the parse tree but
/// nested in the AST), so that later stages, which recurse over expressions, stay well within
/// the stack. Long flat lists are fine.
const MAX_EXPRESSION_DEPTH: usize = 500;

/// Parses a whole file. Never fails: what cannot be parsed is reported and left out.
pub fn parse(source: &str) -> (SourceFile, Vec<Diagnostic>) {
    pest::set_error_detail(true);
    let (limited, too_deep) = limit_nesting(source);
    let source = limited.as_ref();
    let mut builder = Builder { source, diagnostics: too_deep.into_iter().collect(), expr_depth: 0 };
    let file = match DfcParser::parse(Rule::file, source) {
        Ok(mut pairs) => builder.file(pairs.next().expect("file rule")),
        Err(error) => {
            // The recovery rules make this unreachable in practice; keep the error all the same.
            builder.diagnostics.push(syntax_error(source, 0, &error));
            SourceFile::default()
        }
    };
    (file, builder.diagnostics)
}

/// Parses one call, such as an optimizer given on the command line. Spans are offsets into
/// `text`.
pub fn parse_call(text: &str) -> Result<Call, Vec<Diagnostic>> {
    pest::set_error_detail(true);
    match DfcParser::parse(Rule::call_entry, text) {
        Ok(mut pairs) => {
            let mut builder = Builder { source: text, diagnostics: Vec::new(), expr_depth: 0 };
            let call = pairs.next().and_then(|entry| entry.into_inner().next()).map(|pair| builder.call(pair));
            match call {
                Some(call) if builder.diagnostics.is_empty() => Ok(call),
                _ => Err(builder.diagnostics),
            }
        }
        Err(error) => Err(vec![syntax_error(text, 0, &error)]),
    }
}

struct Builder<'s> {
    source: &'s str,
    diagnostics: Vec<Diagnostic>,
    /// How many `expr` rules enclose the one being built (the size check runs at the top).
    expr_depth: usize,
}

/// The source with the inside of every bracket nested deeper than `MAX_NESTING` replaced by
/// `0` and spaces (newlines kept, so positions and lines do not move), and a diagnostic at the
/// first such bracket. Strings and comments are skipped.
fn limit_nesting(source: &str) -> (std::borrow::Cow<'_, str>, Option<Diagnostic>) {
    let bytes = source.as_bytes();
    let mut depth = 0usize;
    let mut first_too_deep = None;
    let mut blank: Vec<(usize, usize)> = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => {
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' && bytes[i] != b'\n' {
                    i += if bytes[i] == b'\\' { 2 } else { 1 };
                }
            }
            b'/' if bytes.get(i + 1) == Some(&b'/') => {
                while i < bytes.len() && bytes[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if bytes.get(i + 1) == Some(&b'*') => {
                i += 2;
                while i + 1 < bytes.len() && !(bytes[i] == b'*' && bytes[i + 1] == b'/') {
                    i += 1;
                }
                i += 1;
            }
            b'(' | b'[' | b'{' => {
                depth += 1;
                if depth > MAX_NESTING {
                    first_too_deep.get_or_insert(i);
                    let end = matching_close(bytes, i).unwrap_or(bytes.len());
                    blank.push((i + 1, end));
                    // Skip the blanked region and its closing bracket; the depth is back to the limit.
                    depth -= 1;
                    i = end + 1;
                    continue;
                }
            }
            b')' | b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        i += 1;
    }
    let Some(at) = first_too_deep else { return (std::borrow::Cow::Borrowed(source), None) };
    let mut text = bytes.to_vec();
    for (start, end) in blank {
        blank_region(source, &mut text[start..end], start);
    }
    // Multi-byte characters inside a blanked region become spaces byte by byte: still UTF-8.
    let text = String::from_utf8(text).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned());
    let diagnostic = Diagnostic::error(
        Code::SYNTAX,
        Span::new(at, at + 1),
        format!("brackets are nested more than {MAX_NESTING} deep"),
    )
    .with_label("too deep from here")
    .with_help("split the expression into several `let`s");
    (std::borrow::Cow::Owned(text), Some(diagnostic))
}

/// Blanks `region` (the bytes of `source` from `offset`) to spaces, newlines kept, with a `0`
/// in place of its first one-byte character so that the brackets still hold an expression.
/// The `0` never stands on part of a multi-byte character: every span the parser reports in
/// the blanked text must also be a char range of `source`.
fn blank_region(source: &str, region: &mut [u8], offset: usize) {
    let mut placeholder = true;
    for (k, c) in source[offset..offset + region.len()].char_indices() {
        if c == '\n' {
            continue;
        }
        let zero = placeholder && c.is_ascii();
        placeholder &= !zero;
        for (i, byte) in region[k..k + c.len_utf8()].iter_mut().enumerate() {
            *byte = if zero && i == 0 { b'0' } else { b' ' };
        }
    }
}

/// The depth of the AST an `expr` pair will become, computed without recursion: parse-tree
/// depth, plus, inside an `expr`, one level per operator of its flat operator chain.
fn expression_depth(expr: &Pair<Rule>) -> usize {
    // Open ancestors as (end offset, depth of their children).
    let mut open: Vec<(usize, usize)> = Vec::new();
    let mut deepest = 0;
    for pair in expr.clone().into_inner().flatten() {
        let span = pair.as_span();
        while open.last().is_some_and(|&(end, _)| end <= span.start()) {
            open.pop();
        }
        let depth = open.last().map_or(1, |&(_, children)| children);
        deepest = deepest.max(depth);
        let operators = if pair.as_rule() == Rule::expr { operator_count(&pair) } else { 0 };
        open.push((span.end(), depth + 1 + operators));
    }
    deepest + operator_count(expr)
}

/// Operators among an `expr`'s own elements: each nests the AST one level deeper.
fn operator_count(expr: &Pair<Rule>) -> usize {
    expr.clone()
        .into_inner()
        .filter(|p| {
            matches!(
                p.as_rule(),
                Rule::neg
                    | Rule::add
                    | Rule::sub
                    | Rule::mul
                    | Rule::div
                    | Rule::matmul
                    | Rule::eq
                    | Rule::ne
                    | Rule::lt
                    | Rule::le
                    | Rule::gt
                    | Rule::ge
            )
        })
        .count()
}

/// The index of the bracket closing the one at `open` (any kind; it is only a limit).
fn matching_close(bytes: &[u8], open: usize) -> Option<usize> {
    let mut depth = 0usize;
    for (i, &b) in bytes.iter().enumerate().skip(open) {
        match b {
            b'(' | b'[' | b'{' => depth += 1,
            b')' | b']' | b'}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => {}
        }
    }
    None
}

fn span_of(pair: &Pair<Rule>) -> Span {
    let span = pair.as_span();
    Span::new(span.start(), span.end())
}

/// The span of a non-atomic rule without the whitespace and comments that pest consumed after
/// its last element (when an optional tail did not match): it ends where its last child ends.
fn trimmed_span(pair: &Pair<Rule>) -> Span {
    let start = pair.as_span().start();
    match pair.clone().into_inner().map(|p| p.as_span().end()).max() {
        Some(end) => Span::new(start, end),
        None => span_of(pair),
    }
}

impl Builder<'_> {
    fn file(&mut self, pair: Pair<Rule>) -> SourceFile {
        let mut items = Vec::new();
        for pair in pair.into_inner() {
            match pair.as_rule() {
                Rule::model => items.push(Item::Model(self.model(pair))),
                Rule::layer_def => items.push(Item::Layer(self.layer_def(pair))),
                Rule::bad_item => self.bad_region(&pair, Rule::strict_item_entry),
                _ => {}
            }
        }
        SourceFile { items }
    }

    fn model(&mut self, pair: Pair<Rule>) -> Model {
        let span = trimmed_span(&pair);
        let mut inner = significant(pair);
        let name = ident(inner.next().expect("model name"));
        let body = self.block(inner, "model", &name, span);
        Model { name, body, span }
    }

    /// Statements up to the optional closing brace; reports a missing one.
    fn block<'i>(
        &mut self,
        pairs: impl Iterator<Item = Pair<'i, Rule>>,
        what: &str,
        name: &Ident,
        span: Span,
    ) -> Vec<Stmt> {
        let mut body = Vec::new();
        let mut closed = false;
        for pair in pairs {
            match pair.as_rule() {
                Rule::close => closed = true,
                _ => body.extend(self.stmt(pair)),
            }
        }
        if !closed {
            // At the block's last character: an empty span at the end of a file shows no label.
            let end = last_char(self.source, span.end as usize);
            self.diagnostics.push(
                Diagnostic::error(
                    Code::UNCLOSED_BLOCK,
                    end,
                    format!("{what} `{}` is missing its closing `}}`", name.name),
                )
                .with_label("expected `}` after this")
                .with_secondary(name.span, format!("{what} opened here"))
                .with_help("add `}` after the last statement of the block"),
            );
        }
        body
    }

    fn layer_def(&mut self, pair: Pair<Rule>) -> LayerDef {
        let span = trimmed_span(&pair);
        let mut inner = significant(pair).peekable();
        let name = ident(inner.next().expect("layer name"));
        let mut params = Vec::new();
        if inner.peek().map(|p| p.as_rule()) == Some(Rule::layer_params) {
            for param in inner.next().expect("peeked").into_inner() {
                params.push(self.layer_param(param));
            }
        }
        let mut return_type = None;
        if inner.peek().map(|p| p.as_rule()) == Some(Rule::tensor_type) {
            return_type = Some(self.tensor_type(inner.next().expect("peeked")));
        }
        let body = self.block(inner, "layer", &name, span);
        LayerDef { name, params, return_type, body, span }
    }

    fn layer_param(&mut self, pair: Pair<Rule>) -> LayerParam {
        let span = trimmed_span(&pair);
        let mut inner = pair.into_inner();
        let name = ident(inner.next().expect("param name"));
        let kind_pair = inner.next().expect("param kind");
        let kind = match kind_pair.as_rule() {
            Rule::dim_kind => LayerParamKind::Dim,
            _ => LayerParamKind::Tensor(self.tensor_type(kind_pair)),
        };
        let default = inner.next().map(|p| self.expr(p));
        LayerParam { name, kind, default, span }
    }

    fn stmt(&mut self, pair: Pair<Rule>) -> Option<Stmt> {
        let span = if pair.as_rule() == Rule::bad_stmt { span_of(&pair) } else { trimmed_span(&pair) };
        let rule = pair.as_rule();
        if rule == Rule::bad_stmt {
            self.bad_region(&pair, Rule::strict_stmt_entry);
            return Some(Stmt { attrs: Vec::new(), kind: StmtKind::Invalid { name: defined_name(&pair) }, span });
        }
        let mut attrs = Vec::new();
        let mut inner = significant(pair).peekable();
        while inner.peek().map(|p| p.as_rule()) == Some(Rule::attribute) {
            attrs.push(self.attribute(inner.next().expect("peeked")));
        }
        let kind = match rule {
            Rule::dim_stmt => {
                let name = ident(inner.next()?);
                StmtKind::Dim { name, value: inner.next().map(|p| self.expr(p)) }
            }
            Rule::input_stmt => {
                let name = ident(inner.next()?);
                StmtKind::Input { name, ty: self.tensor_type(inner.next()?) }
            }
            Rule::param_stmt => {
                let name = ident(inner.next()?);
                let ty = self.tensor_type(inner.next()?);
                StmtKind::Param { name, ty, init: inner.next().map(|p| self.expr(p)) }
            }
            Rule::const_stmt | Rule::let_stmt => {
                let name = ident(inner.next()?);
                let mut ty = None;
                let mut next = inner.next()?;
                if next.as_rule() == Rule::tensor_type {
                    ty = Some(self.tensor_type(next));
                    next = inner.next()?;
                }
                let value = self.expr(next);
                if rule == Rule::const_stmt {
                    StmtKind::Const { name, ty, value }
                } else {
                    StmtKind::Let { name, ty, value }
                }
            }
            Rule::output_stmt => StmtKind::Output {
                items: inner
                    .map(|item| {
                        let span = trimmed_span(&item);
                        let mut parts = significant(item);
                        let value = self.expr(parts.next().expect("output expr"));
                        OutputItem { value, alias: parts.next().map(ident), span }
                    })
                    .collect(),
            },
            Rule::metric_stmt => {
                let name = ident(inner.next()?);
                StmtKind::Metric { name, value: self.expr(inner.next()?) }
            }
            Rule::minimize_stmt => {
                let loss = self.expr(inner.next()?);
                StmtKind::Minimize { loss, optimizer: self.call(inner.next()?) }
            }
            Rule::device_block => {
                let spec_pair = inner.next()?;
                let spec = if spec_pair.as_rule() == Rule::bad_device_spec {
                    let text = spec_pair.as_str().trim();
                    let span = Span::new(spec_pair.as_span().start(), spec_pair.as_span().start() + text.len());
                    // The device as meant, so that the help shows it quoted once and later
                    // checks do not report the same slip again.
                    let (message, label, value) = match text.strip_prefix('"') {
                        None => ("a device is written as a string", "not a string", text),
                        Some(rest) => match rest.split_once('"') {
                            None => ("the device's string is never closed", "no closing quote", rest.trim()),
                            Some((inside, _)) => {
                                ("a device block's `{` must follow its string", "text after the string", inside)
                            }
                        },
                    };
                    self.diagnostics.push(
                        Diagnostic::error(Code::SYNTAX, span, message)
                            .with_label(label)
                            .with_help(format!("write it as: device \"{value}\" {{ ... }}")),
                    );
                    StrLit { value: value.to_string(), span }
                } else {
                    self.string(spec_pair)
                };
                let name = Ident { name: spec.value.clone(), span: spec.span };
                let body = self.block(inner, "device block", &name, span);
                StmtKind::Device { spec, body }
            }
            Rule::return_stmt => StmtKind::Return { value: self.expr(inner.next()?) },
            _ => return None,
        };
        Some(Stmt { attrs, kind, span })
    }

    fn attribute(&mut self, pair: Pair<Rule>) -> Attribute {
        let span = span_of(&pair);
        let mut inner = pair.into_inner();
        let name = ident(inner.next().expect("attribute name"));
        let args = inner.next().and_then(|p| p.into_inner().next()).map(|p| self.args(p)).unwrap_or_default();
        Attribute { name, args, span }
    }

    fn tensor_type(&mut self, pair: Pair<Rule>) -> TensorType {
        let span = trimmed_span(&pair);
        let mut inner = pair.into_inner();
        let dtype_pair = inner.next().expect("dtype");
        let dtype = DTypeName::parse(dtype_pair.as_str()).expect("grammar admits only dtypes");
        let shape = inner.next().map(|shape| shape.into_inner().map(|p| self.expr(p)).collect()).unwrap_or_default();
        TensorType { dtype, dtype_span: span_of(&dtype_pair), shape, span }
    }

    fn string(&mut self, pair: Pair<Rule>) -> StrLit {
        let span = span_of(&pair);
        let body = pair.into_inner().next().map(|p| p.as_str()).unwrap_or("");
        StrLit { value: self.unescape(body, span), span }
    }

    fn unescape(&mut self, body: &str, span: Span) -> String {
        let mut out = String::with_capacity(body.len());
        let mut chars = body.chars();
        while let Some(c) = chars.next() {
            if c != '\\' {
                out.push(c);
                continue;
            }
            match chars.next() {
                Some('n') => out.push('\n'),
                Some('t') => out.push('\t'),
                Some(c @ ('\\' | '"')) => out.push(c),
                other => {
                    let shown = other.map(|c| format!("\\{c}")).unwrap_or_else(|| "\\".into());
                    self.diagnostics.push(
                        Diagnostic::error(Code::BAD_LITERAL, span, format!("unknown escape `{shown}` in string"))
                            .with_help("the escapes are \\n, \\t, \\\\ and \\\""),
                    );
                }
            }
        }
        out
    }

    fn args(&mut self, pair: Pair<Rule>) -> Vec<Arg> {
        pair.into_inner()
            .map(|arg| {
                let span = span_of(&arg);
                if arg.as_rule() == Rule::kwarg {
                    let mut inner = arg.into_inner();
                    let name = ident(inner.next().expect("kwarg name"));
                    let value = self.expr(inner.next().expect("kwarg value"));
                    Arg { name: Some(name), value, span }
                } else {
                    Arg { name: None, value: self.expr(arg), span }
                }
            })
            .collect()
    }

    fn call(&mut self, pair: Pair<Rule>) -> Call {
        let span = span_of(&pair);
        let mut inner = pair.into_inner().peekable();
        let callee = ident(inner.next().expect("callee"));
        let mut type_arg = None;
        if inner.peek().map(|p| p.as_rule()) == Some(Rule::type_args) {
            let dtype = inner.next().expect("peeked").into_inner().next().expect("dtype");
            let parsed = DTypeName::parse(dtype.as_str()).expect("grammar admits only dtypes");
            type_arg = Some((parsed, span_of(&dtype)));
        }
        let args = inner.next().map(|p| self.args(p)).unwrap_or_default();
        Call { callee, type_arg, args, span }
    }

    fn expr(&mut self, pair: Pair<Rule>) -> Expr {
        // `expr` holds a flat sequence of operands and operators; the Pratt parser nests them.
        if pair.as_rule() != Rule::expr {
            return self.primary(pair);
        }
        if self.expr_depth == 0 {
            let depth = expression_depth(&pair);
            if depth > MAX_EXPRESSION_DEPTH {
                let span = span_of(&pair);
                self.diagnostics.push(
                    Diagnostic::error(
                        Code::SYNTAX,
                        span,
                        format!("this expression nests {depth} operations deep; the limit is {MAX_EXPRESSION_DEPTH}"),
                    )
                    .with_help("split it into several `let`s"),
                );
                return Expr { kind: ExprKind::Int(0), span };
            }
        }
        self.expr_depth += 1;
        let expr = self.expr_inner(pair);
        self.expr_depth -= 1;
        expr
    }

    fn expr_inner(&mut self, pair: Pair<Rule>) -> Expr {
        let pairs = pair.into_inner();
        // The closures below all need `self`; a RefCell-free way is to collect diagnostics apart.
        let mut diagnostics = Vec::new();
        let source = self.source;
        let depth = self.expr_depth;
        let expr = PRATT
            .map_primary(|p| {
                let mut builder = Builder { source, diagnostics: Vec::new(), expr_depth: depth };
                let e = builder.primary(p);
                diagnostics.append(&mut builder.diagnostics);
                e
            })
            .map_prefix(|op, operand| Expr {
                span: span_of(&op).to(operand.span),
                kind: ExprKind::Unary(UnaryOp::Neg, Box::new(operand)),
            })
            .map_infix(|lhs, op, rhs| {
                let op = match op.as_rule() {
                    Rule::add => BinaryOp::Add,
                    Rule::sub => BinaryOp::Sub,
                    Rule::mul => BinaryOp::Mul,
                    Rule::div => BinaryOp::Div,
                    Rule::matmul => BinaryOp::MatMul,
                    Rule::eq => BinaryOp::Eq,
                    Rule::ne => BinaryOp::Ne,
                    Rule::lt => BinaryOp::Lt,
                    Rule::le => BinaryOp::Le,
                    Rule::gt => BinaryOp::Gt,
                    _ => BinaryOp::Ge,
                };
                Expr { span: lhs.span.to(rhs.span), kind: ExprKind::Binary(op, Box::new(lhs), Box::new(rhs)) }
            })
            .parse(pairs);
        self.diagnostics.append(&mut diagnostics);
        expr
    }

    fn primary(&mut self, pair: Pair<Rule>) -> Expr {
        let span = span_of(&pair);
        let kind = match pair.as_rule() {
            Rule::int => match pair.as_str().parse::<i64>() {
                Ok(value) => ExprKind::Int(value),
                Err(_) => {
                    self.diagnostics.push(
                        Diagnostic::error(Code::BAD_LITERAL, span, format!("integer `{}` is too large", pair.as_str()))
                            .with_label("does not fit in 64 bits")
                            .with_help(format!("integers range up to {}", i64::MAX)),
                    );
                    ExprKind::Int(0)
                }
            },
            Rule::float => match pair.as_str().parse::<f64>() {
                Ok(value) if value.is_finite() => ExprKind::Float(value),
                _ => {
                    self.diagnostics.push(
                        Diagnostic::error(
                            Code::BAD_LITERAL,
                            span,
                            format!("number `{}` is out of range", pair.as_str()),
                        )
                        .with_help("floating-point literals must be finite f64 values"),
                    );
                    ExprKind::Float(0.0)
                }
            },
            Rule::boolean => ExprKind::Bool(pair.as_str() == "true"),
            Rule::string => ExprKind::Str(self.string(pair).value),
            Rule::ident => ExprKind::Name(ident(pair)),
            Rule::array => ExprKind::Array(pair.into_inner().map(|p| self.expr(p)).collect()),
            Rule::call => ExprKind::Call(self.call(pair)),
            Rule::paren => {
                // Keep the parenthesised expression's own span, so messages point inside.
                let inner = pair.into_inner().next().expect("paren expr");
                return self.expr(inner);
            }
            _ => return self.expr(pair),
        };
        Expr { kind, span }
    }

    /// Reports the syntax error inside a region the grammar had to skip.
    fn bad_region(&mut self, pair: &Pair<Rule>, strict_rule: Rule) {
        let start = pair.as_span().start();
        let diagnostic = match DfcParser::parse(strict_rule, &self.source[start..]) {
            Err(error) => syntax_error(self.source, start, &error),
            Ok(_) => Diagnostic::error(Code::SYNTAX, span_of(pair), "this cannot be parsed")
                .with_help("see docs/language.md for the statement forms"),
        };
        self.diagnostics.push(diagnostic);
    }
}

/// `NAME` in a bad statement that starts `let NAME`, `param NAME`, `const NAME`, `input NAME`
/// or `dim NAME`.
fn defined_name(pair: &Pair<Rule>) -> Option<Ident> {
    let text = pair.as_str();
    // Skip leading attributes: `@name` and an optional `( ... )`.
    let mut at = 0;
    loop {
        let rest = &text[at..];
        at += rest.len() - rest.trim_start().len();
        let Some(attribute) = text[at..].strip_prefix('@') else { break };
        let spaces = attribute.len() - attribute.trim_start().len();
        let attribute = attribute.trim_start();
        let name_len = attribute.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(attribute.len());
        at += 1 + spaces + name_len;
        if text[at..].starts_with('(') {
            at += text[at..].find(')').map_or(text.len() - at, |close| close + 1);
        }
    }
    let rest = &text[at..];
    let keyword = ["let", "param", "const", "input", "dim"]
        .into_iter()
        .find(|k| rest.strip_prefix(k).is_some_and(|r| r.starts_with(|c: char| c.is_whitespace())))?;
    let after = &rest[keyword.len()..];
    let skipped = after.len() - after.trim_start().len();
    let name: String = after.trim_start().chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
    let first = name.chars().next()?;
    if first.is_ascii_digit() || KEYWORDS.contains(&name.as_str()) {
        return None;
    }
    let name_at = pair.as_span().start() + at + keyword.len() + skipped;
    Some(Ident { span: Span::new(name_at, name_at + name.len()), name })
}

/// The children of `pair` without keyword tokens.
fn significant(pair: Pair<'_, Rule>) -> impl Iterator<Item = Pair<'_, Rule>> {
    pair.into_inner().filter(|p| {
        !matches!(
            p.as_rule(),
            Rule::kw_model
                | Rule::kw_layer
                | Rule::kw_dim
                | Rule::kw_input
                | Rule::kw_param
                | Rule::kw_const
                | Rule::kw_let
                | Rule::kw_output
                | Rule::kw_minimize
                | Rule::kw_metric
                | Rule::kw_with
                | Rule::kw_device
                | Rule::kw_return
                | Rule::kw_as
        )
    })
}

fn ident(pair: Pair<Rule>) -> Ident {
    Ident { name: pair.as_str().to_string(), span: span_of(&pair) }
}

/// Turns a pest error (in `source[offset..]`) into a diagnostic: the offending token, and what
/// could stand there instead, in words.
fn syntax_error(source: &str, offset: usize, error: &pest::error::Error<Rule>) -> Diagnostic {
    let at = offset
        + match error.location {
            pest::error::InputLocation::Pos(pos) => pos,
            pest::error::InputLocation::Span((start, _)) => start,
        };
    let found = token_at(source, at);
    let found_text = match &source[found.range()] {
        "" => "end of file".to_string(),
        "\n" | "\r" => "a line break".to_string(),
        " " | "\t" => "a space".to_string(),
        token => format!("`{token}`"),
    };

    let mut expected: Vec<String> = Vec::new();
    if let pest::error::ErrorVariant::ParsingError { positives, .. } = &error.variant {
        for rule in positives {
            if let Some(name) = rule_description(*rule) {
                expected.push(name.to_string());
            }
        }
    }
    if let Some(attempts) = error.parse_attempts() {
        // pest does not export its token type; its Display shows a literal as itself.
        for token in attempts.expected_tokens().iter().map(|t| t.to_string()) {
            let is_literal = !token.trim().is_empty()
                && !matches!(token.as_str(), "//" | "/*" | "\u{feff}")
                && token != "BUILTIN_RULE"
                && (token.len() <= 2 || !token.contains(".."));
            if is_literal {
                expected.push(format!("`{token}`"));
            }
        }
    }
    expected.sort();
    expected.dedup();
    // Keywords that only serve to rule words out are noise in "expected" lists.
    expected.retain(|e| !KEYWORD_NOISE.contains(&e.as_str()));
    // "an expression" already says name, number, call, ...; and a list of every statement
    // keyword reads better as one phrase.
    if expected.iter().any(|e| e == "an expression") {
        expected.retain(|e| !EXPRESSION_PARTS.contains(&e.as_str()));
    }
    if expected.iter().any(|e| e.starts_with("a type")) {
        expected.retain(|e| !DTYPES.contains(&e.as_str()));
    }
    if expected.iter().any(|e| e == "an operator") {
        expected.retain(|e| !OPERATORS.contains(&e.as_str()));
    }
    let n_keywords = expected.iter().filter(|e| STATEMENT_KEYWORDS.contains(&e.as_str())).count();
    if n_keywords >= 4 {
        expected.retain(|e| {
            !STATEMENT_KEYWORDS.contains(&e.as_str()) && !matches!(e.as_str(), "`@`" | "`model`" | "`layer`")
        });
        expected.push("a statement".into());
        expected.dedup();
    }

    let message = if expected.is_empty() {
        format!("unexpected {}", found_text.trim_start_matches("a "))
    } else {
        format!("expected {}, found {found_text}", dfc_diag::one_of(&expected))
    };
    // At the end of the file, label the last character: miette shows no label on an empty span.
    let label_span = if found.is_empty() { last_char(source, at) } else { found };
    let mut diagnostic = Diagnostic::error(Code::SYNTAX, label_span, message).with_label(if found.is_empty() {
        "the input ends after this".to_string()
    } else {
        "unexpected here".to_string()
    });
    if let Some(help) = syntax_help(source, at, &found_text, &expected) {
        diagnostic = diagnostic.with_help(help);
    }
    if expected.iter().any(|e| e == "`)`" || e == "`]`") {
        // Only when the statement ran on past its line is the bracket the likely culprit.
        let unclosed = unclosed_bracket(&source[offset..at])
            .map(|open| offset + open)
            .filter(|&open| source[open..at].contains('\n'));
        if let Some(open) = unclosed {
            diagnostic = diagnostic.with_secondary(Span::new(open, open + 1), "this bracket is never closed");
        }
    }
    diagnostic
}

const KEYWORD_NOISE: &[&str] = &["`\"`", "`\\`", "`e`", "`E`", "`_`"];
const EXPRESSION_PARTS: &[&str] = &[
    "a name",
    "a number",
    "an integer",
    "a string",
    "a call",
    "`[`",
    "`(`",
    "`-`",
    "`.`",
    "`true`",
    "`false`",
    "`true` or `false`",
];
const DTYPES: &[&str] = &["`f32`", "`f64`", "`i32`", "`i64`", "`u8`", "`bool`"];
const OPERATORS: &[&str] = &["`!=`", "`*`", "`+`", "`-`", "`/`", "`<=`", "`<`", "`==`", "`>=`", "`>`", "`@`"];
const STATEMENT_KEYWORDS: &[&str] = &[
    "`dim`",
    "`metric`",
    "`input`",
    "`param`",
    "`const`",
    "`let`",
    "`output`",
    "`minimize`",
    "`device`",
    "`return`",
    "a statement",
];

/// The innermost `(` or `[` in `text` that is not closed within it, ignoring strings and
/// comments only roughly (good enough to point at the likely culprit).
fn unclosed_bracket(text: &str) -> Option<usize> {
    let mut open = Vec::new();
    let mut in_string = false;
    for (i, c) in text.char_indices() {
        match c {
            '"' => in_string = !in_string,
            '(' | '[' if !in_string => open.push(i),
            ')' | ']' if !in_string => {
                open.pop();
            }
            _ => {}
        }
    }
    open.pop()
}

/// The last character before `end` that is not whitespace (miette shows no label on an empty
/// span at the end of a file, so errors there are put on the text they follow).
fn last_char(source: &str, end: usize) -> Span {
    let text = source[..end.min(source.len())].trim_end();
    let len = text.chars().next_back().map_or(0, char::len_utf8);
    Span::new(text.len() - len, text.len())
}

/// The token starting at `at` (an identifier or number, or one character), for "found ...".
fn token_at(source: &str, at: usize) -> Span {
    let at = at.min(source.len());
    let rest = &source[at..];
    let mut chars = rest.char_indices();
    let Some((_, first)) = chars.next() else { return Span::new(at, at) };
    let len = if first.is_alphanumeric() || first == '_' {
        rest.find(|c: char| !(c.is_alphanumeric() || c == '_' || c == '.')).unwrap_or(rest.len())
    } else {
        first.len_utf8()
    };
    Span::new(at, at + len)
}

const KEYWORDS: &[&str] = &[
    "model", "layer", "dim", "input", "param", "const", "let", "output", "metric", "minimize", "with", "device",
    "return", "as", "true", "false", "f32", "f64", "i32", "i64", "u8", "bool",
];

fn syntax_help(source: &str, at: usize, found: &str, expected: &[String]) -> Option<String> {
    let before = source[..at.min(source.len())].trim_end();
    if found == "`;`" {
        return Some("statements need no `;`: end a statement with a new line".into());
    }
    if before.ends_with(',') && (found == "`)`" || found == "`]`") {
        return None;
    }
    if found == "end of file" {
        return Some("the file ends in the middle of a statement or block".into());
    }
    let word = found.trim_matches('`');
    if KEYWORDS.contains(&word) && expected.iter().any(|e| e == "a name") {
        return Some(format!("`{word}` is a keyword and cannot be used as a name"));
    }
    if expected.iter().any(|e| e == "an `@attribute`") && STATEMENT_KEYWORDS.contains(&found) {
        return Some(format!("attributes stand before `input`, `param`, `const` or `let`, not {found}"));
    }
    if before.ends_with('@') && matches!(found, "a space" | "a line break") {
        return Some("attributes are written without spaces: `@device(\"...\")`".into());
    }
    if found == "`\"`" {
        return Some("a string ends on the line where it starts; add the closing `\"`".into());
    }
    let expects_statement = expected.iter().any(|e| e == "a statement");
    if expects_statement && found.starts_with("`=") && before.ends_with(|c: char| c.is_alphanumeric()) {
        return Some("definitions start with `let`, `const`, `param`, `input` or `dim`".into());
    }
    None
}

fn rule_description(rule: Rule) -> Option<&'static str> {
    Some(match rule {
        Rule::expr | Rule::primary | Rule::paren | Rule::neg => "an expression",
        Rule::ident => "a name",
        Rule::int => "an integer",
        Rule::float => "a number",
        Rule::string => "a string",
        Rule::tensor_type | Rule::dtype => "a type (f32, f64, i32, i64, u8 or bool)",
        Rule::call => "a call",
        Rule::shape | Rule::array => "`[`",
        Rule::close => "`}`",
        Rule::attribute => "an `@attribute`",
        Rule::eq | Rule::ne | Rule::lt | Rule::le | Rule::gt | Rule::ge => "an operator",
        Rule::add | Rule::sub | Rule::mul | Rule::div | Rule::matmul => "an operator",
        Rule::dim_stmt
        | Rule::input_stmt
        | Rule::param_stmt
        | Rule::const_stmt
        | Rule::let_stmt
        | Rule::output_stmt
        | Rule::metric_stmt
        | Rule::minimize_stmt
        | Rule::device_block
        | Rule::return_stmt => "a statement",
        Rule::model | Rule::layer_def => "`model` or `layer`",
        Rule::layer_param | Rule::layer_params => "a layer parameter",
        Rule::args | Rule::kwarg => "an argument",
        Rule::type_args => "`<`",
        Rule::dim_kind => "`dim`",
        Rule::output_item => "an output",
        Rule::boolean => "`true` or `false`",
        _ => return None,
    })
}
