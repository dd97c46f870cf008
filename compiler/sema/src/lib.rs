//! Semantic analysis: AST → IR `Module`.
//!
//! Resolves names, evaluates `dim`s and constants, instantiates layers (binding their shape
//! parameters by unification), infers the dtype and static shape of every value (through
//! `dfc_ir::infer`, the one definition of op typing) and records placement requests. Every
//! problem becomes a `Diagnostic`; analysis goes on after an error (the failed value is
//! "poisoned" so that it causes no further reports), so one run reports them all.
//!
//! Architecture Invariant: no input makes analysis panic, and a module is returned only when
//! there are no errors.

mod args;
mod builtins;
mod eval;
mod layers;
mod lower;
mod normalization;
mod random;
mod schedule;
mod value;

pub use builtins::{INITIALIZERS, OPS, OPTIMIZERS};
use dfc_diag::{Code, Diagnostic};
use dfc_ir::Module;
use dfc_syntax::ast::{Item, SourceFile};
pub use schedule::SCHEDULES;

/// What the command line may change about a model.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// `--dim NAME=VALUE` overrides, applied to every model analysed.
    pub dims: Vec<(String, i64)>,
    /// `--optimizer`: replaces the optimizer of every `minimize` (its spans are offsets into
    /// the option's text, so check it with `check_optimizer` first).
    pub optimizer: Option<dfc_syntax::ast::Call>,
}

/// Checks an optimizer given on the command line, as `minimize` would; diagnostics are
/// positioned in `text`.
pub fn check_optimizer(text: &str) -> Result<dfc_syntax::ast::Call, Vec<Diagnostic>> {
    let call = dfc_syntax::parse_call(text)?;
    // The same checks as in a model, on a model that minimises something trivial.
    let options = Options::default();
    let file = dfc_syntax::ast::SourceFile::default();
    let layers = layers::collect(&file, &mut Vec::new());
    let mut diagnostics = lower::check_optimizer_call(&call, &layers, &options);
    diagnostics.retain(|d| d.is_error());
    if diagnostics.is_empty() {
        Ok(call)
    } else {
        Err(diagnostics)
    }
}

/// The result of analysing one model.
pub struct Analysis {
    pub model: String,
    /// `None` when the model has errors.
    pub module: Option<Module>,
    /// What each analysed expression and defined name stood for (`f32[128, 784]`, `128`), in
    /// evaluation order; a layer's text appears once per instance. Editors show these on hover.
    pub types: Vec<(dfc_diag::Span, String)>,
}

/// Analyses every model of a file (layers are checked where they are used). Diagnostics of
/// the whole file come back sorted by position.
pub fn analyze(file: &SourceFile, options: &Options) -> (Vec<Analysis>, Vec<Diagnostic>) {
    analyze_models(file, options, None)
}

/// Analyses every model, or only the one named `only` (then layers unused by it are not
/// reported: another model may use them).
fn analyze_models(file: &SourceFile, options: &Options, only: Option<&str>) -> (Vec<Analysis>, Vec<Diagnostic>) {
    let mut diagnostics = Vec::new();
    let layers = layers::collect(file, &mut diagnostics);
    let mut analyses = Vec::new();
    let mut unused_overrides: Vec<&(String, i64)> = options.dims.iter().collect();
    let mut first_model = None;
    for item in &file.items {
        let Item::Model(model) = item else { continue };
        if only.is_some_and(|name| name != model.name.name) {
            continue;
        }
        first_model.get_or_insert(model.name.span);
        let (module, mut found, types) = lower::lower_model(model, &layers, options);
        let declared = lower::declared_dims(&model.body);
        unused_overrides.retain(|(name, _)| !declared.contains(&name.as_str()));
        let has_errors = found.iter().any(|d| d.is_error());
        diagnostics.append(&mut found);
        analyses.push(Analysis { model: model.name.name.clone(), module: (!has_errors).then_some(module), types });
    }
    if only.is_none() {
        layers::warn_unused(file, &layers, &mut diagnostics);
    }
    if let (Some((name, _)), Some(span)) = (unused_overrides.first(), first_model) {
        let scope = if only.is_some() { "the model" } else { "any model in this file" };
        diagnostics.push(
            Diagnostic::error(Code::BAD_DIM, span, format!("`--dim {name}` names no dim of {scope}"))
                .with_help("declare it with `dim NAME = VALUE` or drop the override"),
        );
    }
    dfc_diag::sort(&mut diagnostics);
    (analyses, diagnostics)
}

/// Analyses the model named `name`, or the only model of the file when `name` is `None`.
pub fn analyze_one(file: &SourceFile, name: Option<&str>, options: &Options) -> (Option<Module>, Vec<Diagnostic>) {
    let models: Vec<&dfc_syntax::ast::Model> = file
        .items
        .iter()
        .filter_map(|i| match i {
            Item::Model(m) => Some(m),
            Item::Layer(_) => None,
        })
        .collect();
    let exists = name.is_none_or(|n| models.iter().any(|m| m.name.name == n));
    let (analyses, mut diagnostics) =
        if exists { analyze_models(file, options, name) } else { (Vec::new(), Vec::new()) };
    let names: Vec<String> = models.iter().map(|m| format!("`{}`", m.name.name)).collect();
    let chosen = match name {
        Some(name) => analyses.into_iter().find(|a| a.model == name).ok_or_else(|| {
            let help = if names.is_empty() {
                "the file defines no model".to_string()
            } else {
                format!("the file defines {}", dfc_diag::one_of(&names))
            };
            Diagnostic::error(Code::NO_MODEL, dfc_diag::Span::default(), format!("no model named `{name}`"))
                .with_help(help)
        }),
        None if analyses.len() == 1 => Ok(analyses.into_iter().next().expect("one")),
        None if analyses.is_empty() => {
            Err(Diagnostic::error(Code::NO_MODEL, dfc_diag::Span::default(), "the file defines no model")
                .with_help("a model is `model NAME { ... }`; see docs/language.md"))
        }
        None => Err(Diagnostic::error(
            Code::NO_MODEL,
            models[1].name.span,
            format!("the file defines {} models; say which one to use", models.len()),
        )
        .with_help(format!("pass --model with {}", dfc_diag::one_of(&names)))),
    };
    match chosen {
        Ok(analysis) => (analysis.module, diagnostics),
        Err(diagnostic) => {
            diagnostics.push(diagnostic);
            (None, diagnostics)
        }
    }
}

/// Parses and analyses source text: the whole front end in one call, as `dfc check` and the
/// language server run it.
pub fn check_source(source: &str, options: &Options) -> (Vec<Analysis>, Vec<Diagnostic>) {
    let (file, syntax) = dfc_syntax::parse(source);
    check_file(&file, syntax, options)
}

/// Analyses a parsed file, given the parser's diagnostics: `check_source` for callers that keep
/// the tree (the language server).
pub fn check_file(file: &SourceFile, syntax: Vec<Diagnostic>, options: &Options) -> (Vec<Analysis>, Vec<Diagnostic>) {
    let (analyses, found) = analyze(file, options);
    (analyses, merge(syntax, found))
}

/// Parses and analyses source text for one model (`name`, or the only one), as `dfc compile`
/// runs it. The module is `None` when there is any error.
pub fn compile_source(source: &str, name: Option<&str>, options: &Options) -> (Option<Module>, Vec<Diagnostic>) {
    let (file, syntax) = dfc_syntax::parse(source);
    let (module, found) = analyze_one(&file, name, options);
    let diagnostics = merge(syntax, found);
    let has_errors = diagnostics.iter().any(|d| d.is_error());
    (module.filter(|_| !has_errors), diagnostics)
}

/// Syntax and semantic diagnostics in source order. After a syntax error, statements are
/// missing from the tree, so "never used" and "nothing to run" warnings would be noise.
fn merge(mut syntax: Vec<Diagnostic>, semantic: Vec<Diagnostic>) -> Vec<Diagnostic> {
    let had_syntax_errors = !syntax.is_empty();
    syntax.extend(semantic.into_iter().filter(|d| d.is_error() || !had_syntax_errors));
    dfc_diag::sort(&mut syntax);
    syntax.dedup();
    syntax
}
