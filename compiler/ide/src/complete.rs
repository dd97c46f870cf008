//! Completion: what may be written at a position, from the text just before it — types after
//! `:` and `<`, optimizers after `with`, argument names inside a call, statement snippets at
//! the start of a line, and otherwise names in scope, layers and ops.

use crate::resolve::{DefKind, Target};
use crate::{FileAnalysis, DTYPES};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompletionKind {
    Keyword,
    Snippet,
    Type,
    Op,
    Optimizer,
    /// A learning-rate schedule, as an optimizer's `lr`.
    Schedule,
    Initializer,
    Layer,
    /// A dim or a layer's size name.
    Dim,
    /// Any other value in scope: input, param, const, let, layer argument.
    Value,
    /// `name = ` of a call.
    Argument,
    Attribute,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Completion {
    pub label: String,
    pub kind: CompletionKind,
    pub detail: Option<String>,
    pub documentation: Option<String>,
    /// A snippet (`$1` placeholders) to insert instead of the label.
    pub snippet: Option<String>,
}

impl Completion {
    fn new(label: impl Into<String>, kind: CompletionKind) -> Completion {
        Completion { label: label.into(), kind, detail: None, documentation: None, snippet: None }
    }

    fn detail(mut self, detail: impl Into<String>) -> Completion {
        self.detail = Some(detail.into());
        self
    }

    fn doc(mut self, doc: impl Into<String>) -> Completion {
        self.documentation = Some(doc.into());
        self
    }

    fn snippet(mut self, snippet: impl Into<String>) -> Completion {
        self.snippet = Some(snippet.into());
        self
    }
}

const STATEMENT_SNIPPETS: &[(&str, &str, &str)] = &[
    ("let", "let ${1:name} = $0", "a value computed from others"),
    ("param", "param ${1:name}: f32[$2] = ${3:glorot_uniform}", "a trainable tensor"),
    ("input", "input ${1:name}: ${2:f32}[$3]", "a tensor fed at run time"),
    ("const", "const ${1:name} = $0", "a constant"),
    ("dim", "dim ${1:name} = ${2:128}", "a named size"),
    ("output", "output ${1:name}", "a value the caller fetches"),
    ("metric", "metric ${1:accuracy} = $0", "a scalar averaged over evaluation data"),
    ("minimize", "minimize ${1:loss} with ${2:sgd}(lr = ${3:0.01})", "the loss training minimizes"),
    ("device", "device \"${1:/job:worker/task:0}\" {\n\t$0\n}", "place the statements inside"),
    ("return", "return $0", "a layer's result"),
];

const ITEM_SNIPPETS: &[(&str, &str, &str)] = &[
    ("model", "model ${1:name} {\n\t$0\n}", "a model: inputs, params, outputs and a loss"),
    (
        "layer",
        "layer ${1:name}(${2:x}: f32[${3:n}, ${4:k}]) -> f32[${3:n}, ${5:units}] {\n\t$0\n}",
        "a reusable block of statements",
    ),
];

pub fn completions(analysis: &FileAnalysis, offset: usize) -> Vec<Completion> {
    let source = analysis.source.as_str();
    let mut offset = offset.min(source.len());
    while !source.is_char_boundary(offset) {
        offset -= 1;
    }
    let before = &source[..offset];
    let word_start = before.trim_end_matches(|c: char| c.is_ascii_alphanumeric() || c == '_').len();
    let head = before[..word_start].trim_end();
    let line_start = before[..word_start].rfind('\n').map_or(0, |i| i + 1);
    let at_line_start = before[line_start..word_start].trim().is_empty();
    let item = analysis.names.item_at(offset);

    if head.ends_with('@') && word_start == head.len() {
        return ["device", "partitioned"]
            .iter()
            .map(|name| {
                let snippet = if *name == "device" { "device(\"${1:/job:ps/task:0}\")" } else { "partitioned(${1:2})" };
                Completion::new(*name, CompletionKind::Attribute).snippet(snippet)
            })
            .collect();
    }
    if head.ends_with(':') || (head.ends_with('<') && previous_word(head).is_some()) || head.ends_with("->") {
        return DTYPES.iter().map(|t| Completion::new(*t, CompletionKind::Type).detail("element type")).collect();
    }
    if previous_word(head) == Some("with") {
        return builtins(dfc_sema::OPTIMIZERS, CompletionKind::Optimizer);
    }
    if head.ends_with('=') && previous_word(head.trim_end_matches('=').trim_end()) == Some("lr") {
        return builtins(dfc_sema::SCHEDULES, CompletionKind::Schedule);
    }
    if at_line_start {
        if item.is_none() {
            return snippets(ITEM_SNIPPETS);
        }
        return snippets(STATEMENT_SNIPPETS);
    }

    let mut all = Vec::new();
    if let Some(callee) = enclosing_call(head) {
        all.extend(argument_names(analysis, callee));
    }
    let in_param_init = head.ends_with('=') && {
        let statement = before[line_start..].trim_start();
        statement.starts_with("param") || statement.starts_with('@')
    };
    if in_param_init {
        all.extend(builtins(dfc_sema::INITIALIZERS, CompletionKind::Initializer));
    }
    let mut seen = std::collections::HashSet::new();
    for (index, def) in analysis.names.visible_in(item) {
        let kind = match def.kind {
            DefKind::Model | DefKind::Metric | DefKind::OutputAlias => continue,
            DefKind::Layer => CompletionKind::Layer,
            DefKind::Dim | DefKind::SizeName => CompletionKind::Dim,
            _ => CompletionKind::Value,
        };
        // Not the name being defined by the statement around the cursor.
        if crate::resolve::covers(def.full_span, offset) && def.kind != DefKind::Layer || !seen.insert(&def.name) {
            continue;
        }
        let types = analysis.types_at(def.span);
        let detail = match types.first() {
            Some(ty) => format!("{} {}: {ty}", def.kind.word(), def.name),
            None => def.kind.word().to_string(),
        };
        let mut completion = Completion::new(def.name.clone(), kind).detail(detail);
        if kind == CompletionKind::Layer {
            let calls = analysis.names.uses.iter().filter(|u| u.called && u.target == Target::Def(index)).count();
            let text = analysis.text(def.full_span);
            let header = text.split('{').next().unwrap_or(text).split_whitespace().collect::<Vec<_>>().join(" ");
            completion = completion.detail(header).doc(format!("layer, called {calls} time(s) in this file"));
        }
        all.push(completion);
    }
    all.extend(builtins(dfc_sema::OPS, CompletionKind::Op));
    for word in ["true", "false"] {
        all.push(Completion::new(word, CompletionKind::Keyword));
    }
    all
}

fn snippets(table: &[(&str, &str, &str)]) -> Vec<Completion> {
    table
        .iter()
        .map(|(keyword, snippet, doc)| {
            Completion::new(*keyword, CompletionKind::Snippet).snippet(*snippet).detail(*doc)
        })
        .collect()
}

fn builtins(table: &[(&str, &str, &str)], kind: CompletionKind) -> Vec<Completion> {
    table.iter().map(|(name, signature, doc)| Completion::new(*name, kind).detail(*signature).doc(*doc)).collect()
}

/// The word that ends `text` (after trailing spaces were trimmed by the caller).
fn previous_word(text: &str) -> Option<&str> {
    let start = text.trim_end_matches(|c: char| c.is_ascii_alphanumeric() || c == '_').len();
    let word = &text[start..];
    (!word.is_empty()).then_some(word)
}

/// The callee of the innermost call whose `(` is still open at the end of `text`.
fn enclosing_call(text: &str) -> Option<&str> {
    let mut depth = 0usize;
    for (i, c) in text.char_indices().rev() {
        match c {
            ')' | ']' => depth += 1,
            '[' if depth > 0 => depth -= 1,
            '(' if depth > 0 => depth -= 1,
            '[' | '{' | '}' => return None,
            '(' => {
                let callee = text[..i].trim_end();
                // `cast<f32>(`: skip the type argument.
                let callee = match callee.strip_suffix('>') {
                    Some(rest) => rest.rsplit_once('<').map_or(callee, |(name, _)| name),
                    None => callee,
                };
                return previous_word(callee);
            }
            _ => {}
        }
    }
    None
}

/// `name = ` for each parameter of the layer or built-in `callee`.
fn argument_names(analysis: &FileAnalysis, callee: &str) -> Vec<Completion> {
    let layer = analysis.names.defs.iter().position(|d| d.kind == DefKind::Layer && d.name == callee);
    let names: Vec<String> = match layer {
        Some(layer) => analysis
            .names
            .defs
            .iter()
            .filter(|d| d.owner == Some(layer) && d.kind == DefKind::LayerParam)
            .map(|d| d.name.clone())
            .collect(),
        None => {
            let tables = [dfc_sema::OPS, dfc_sema::OPTIMIZERS, dfc_sema::SCHEDULES, dfc_sema::INITIALIZERS];
            let Some((_, signature, _)) = tables.iter().flat_map(|t| t.iter()).find(|(n, _, _)| *n == callee) else {
                return Vec::new();
            };
            let inside = signature.split_once('(').map_or("", |(_, rest)| rest.trim_end_matches(')'));
            inside
                .split(',')
                .map(|p| p.split('=').next().unwrap_or("").trim().to_string())
                .filter(|p| crate::is_identifier(p))
                .collect()
        }
    };
    names
        .into_iter()
        .map(|name| {
            let snippet = format!("{name} = $0");
            Completion::new(format!("{name} ="), CompletionKind::Argument)
                .detail(format!("argument of `{callee}`"))
                .snippet(snippet)
        })
        .collect()
}
