//! Names without types: every definition in a file and every use of a name, resolved by the
//! language's scoping rules on the syntax tree alone. Navigation (definition, references,
//! rename) and symbols rest on this, so they work in layers that are never called and in files
//! with errors, where semantic analysis has nothing to say.
//!
//! Scopes: models and layers are visible everywhere in the file; every other name belongs to
//! the model or layer whose body defines it (`device` blocks do not open scopes). A layer's
//! size names (`n` and `k` of `x: f32[n, k]`) are defined by their first appearance in its
//! parameters' shapes.

use dfc_diag::Span;
use dfc_syntax::ast::{Arg, Call, Expr, ExprKind, Ident, Item, LayerParamKind, SourceFile, Stmt, StmtKind, TensorType};
use std::collections::HashMap;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DefKind {
    Model,
    Layer,
    /// A layer's parameter (`x: f32[n, k]`, `units: dim`).
    LayerParam,
    /// A size bound by a layer's parameter shapes (`n`, `k`).
    SizeName,
    Dim,
    Input,
    Param,
    Const,
    Let,
    Metric,
    /// `output logits as probabilities`: the name the caller fetches.
    OutputAlias,
}

impl DefKind {
    /// The word for it in hover and completion.
    pub fn word(self) -> &'static str {
        match self {
            DefKind::Model => "model",
            DefKind::Layer => "layer",
            DefKind::LayerParam => "layer parameter",
            DefKind::SizeName => "size",
            DefKind::Dim => "dim",
            DefKind::Input => "input",
            DefKind::Param => "param",
            DefKind::Const => "const",
            DefKind::Let => "let",
            DefKind::Metric => "metric",
            DefKind::OutputAlias => "output",
        }
    }
}

/// A name defined in the file.
#[derive(Clone, Debug, PartialEq)]
pub struct Def {
    pub name: String,
    pub kind: DefKind,
    /// The name itself.
    pub span: Span,
    /// The whole statement, parameter or item that defines it.
    pub full_span: Span,
    /// The model or layer it belongs to (an index into `Names::defs`); `None` for items.
    pub owner: Option<usize>,
}

/// What a use of a name stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    Def(usize),
    /// A built-in op, optimizer or initializer, by name.
    Builtin,
    /// Nothing by that name (semantic analysis reports it).
    Unresolved,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Use {
    pub name: String,
    pub span: Span,
    pub target: Target,
    /// Whether it is called (`relu(x)`), which tells ops from values for highlighting.
    pub called: bool,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Names {
    pub defs: Vec<Def>,
    pub uses: Vec<Use>,
}

impl Names {
    /// The definition whose name covers `offset` (a cursor just after a name counts).
    pub fn def_at(&self, offset: usize) -> Option<usize> {
        self.defs.iter().position(|d| covers(d.span, offset))
    }

    pub fn use_at(&self, offset: usize) -> Option<&Use> {
        self.uses.iter().find(|u| covers(u.span, offset))
    }

    /// The definition named at `offset`, from the definition itself or from a use of it.
    pub fn target_at(&self, offset: usize) -> Option<usize> {
        self.def_at(offset).or_else(|| match self.use_at(offset)?.target {
            Target::Def(def) => Some(def),
            _ => None,
        })
    }

    /// Every span that names `def`: the definition first, then its uses in source order.
    pub fn occurrences(&self, def: usize) -> Vec<Span> {
        let mut spans: Vec<Span> = self.uses.iter().filter(|u| u.target == Target::Def(def)).map(|u| u.span).collect();
        spans.sort();
        spans.insert(0, self.defs[def].span);
        spans
    }

    /// The model or layer whose text contains `offset`.
    pub fn item_at(&self, offset: usize) -> Option<usize> {
        self.defs.iter().position(|d| matches!(d.kind, DefKind::Model | DefKind::Layer) && covers(d.full_span, offset))
    }

    /// The names visible in the item `item` (its own definitions), then every model and layer.
    pub fn visible_in(&self, item: Option<usize>) -> impl Iterator<Item = (usize, &Def)> {
        self.defs.iter().enumerate().filter(move |(_, d)| d.owner.is_none() || (item.is_some() && d.owner == item))
    }
}

pub fn covers(span: Span, offset: usize) -> bool {
    span.start as usize <= offset && offset <= span.end as usize
}

/// Resolves every name of the file.
pub fn resolve(file: &SourceFile) -> Names {
    let mut names = Names::default();
    let mut items: HashMap<&str, usize> = HashMap::new();
    for item in &file.items {
        let (name, kind, span) = match item {
            Item::Model(model) => (&model.name, DefKind::Model, model.span),
            Item::Layer(layer) => (&layer.name, DefKind::Layer, layer.span),
        };
        let index = names.defs.len();
        names.defs.push(Def { name: name.name.clone(), kind, span: name.span, full_span: span, owner: None });
        items.entry(name.name.as_str()).or_insert(index);
    }
    let item_defs: Vec<usize> = (0..names.defs.len()).collect();
    for (item, owner) in file.items.iter().zip(item_defs) {
        let mut scope = Scope { names: &mut names, items: &items, owner, locals: HashMap::new() };
        match item {
            Item::Model(model) => {
                scope.define_block(&model.body);
                scope.use_block(&model.body);
            }
            Item::Layer(layer) => {
                for param in &layer.params {
                    scope.define(&param.name, DefKind::LayerParam, param.span);
                }
                // Size names: the first appearance in a parameter's shape defines them.
                for param in &layer.params {
                    if let LayerParamKind::Tensor(ty) = &param.kind {
                        for size in &ty.shape {
                            match &size.kind {
                                ExprKind::Name(ident) if !scope.locals.contains_key(ident.name.as_str()) => {
                                    scope.define(ident, DefKind::SizeName, ident.span)
                                }
                                _ => scope.use_expr(size),
                            }
                        }
                    }
                }
                scope.define_block(&layer.body);
                for param in &layer.params {
                    if let Some(default) = &param.default {
                        scope.use_expr(default);
                    }
                }
                if let Some(ty) = &layer.return_type {
                    scope.use_type(ty);
                }
                scope.use_block(&layer.body);
            }
        }
    }
    names
}

struct Scope<'n, 'f> {
    names: &'n mut Names,
    items: &'n HashMap<&'f str, usize>,
    owner: usize,
    /// The first definition of each name in this model or layer.
    locals: HashMap<String, usize>,
}

impl Scope<'_, '_> {
    fn define(&mut self, name: &Ident, kind: DefKind, full_span: Span) {
        let index = self.names.defs.len();
        self.names.defs.push(Def {
            name: name.name.clone(),
            kind,
            span: name.span,
            full_span,
            owner: Some(self.owner),
        });
        self.locals.entry(name.name.clone()).or_insert(index);
    }

    fn define_block(&mut self, stmts: &[Stmt]) {
        for stmt in stmts {
            let (name, kind) = match &stmt.kind {
                StmtKind::Dim { name, .. } => (name, DefKind::Dim),
                StmtKind::Input { name, .. } => (name, DefKind::Input),
                StmtKind::Param { name, .. } => (name, DefKind::Param),
                StmtKind::Const { name, .. } => (name, DefKind::Const),
                StmtKind::Let { name, .. } => (name, DefKind::Let),
                StmtKind::Metric { name, .. } => (name, DefKind::Metric),
                StmtKind::Output { items } => {
                    for item in items {
                        if let Some(alias) = &item.alias {
                            self.define(alias, DefKind::OutputAlias, item.span);
                        }
                    }
                    continue;
                }
                StmtKind::Device { body, .. } => {
                    self.define_block(body);
                    continue;
                }
                StmtKind::Invalid { name: Some(name) } => (name, DefKind::Let),
                StmtKind::Minimize { .. } | StmtKind::Return { .. } | StmtKind::Invalid { name: None } => continue,
            };
            self.define(name, kind, stmt.span);
        }
    }

    fn use_block(&mut self, stmts: &[Stmt]) {
        for stmt in stmts {
            for attr in &stmt.attrs {
                self.use_args(&attr.args);
            }
            match &stmt.kind {
                StmtKind::Dim { value, .. } => value.iter().for_each(|v| self.use_expr(v)),
                StmtKind::Input { ty, .. } => self.use_type(ty),
                StmtKind::Param { ty, init, .. } => {
                    self.use_type(ty);
                    if let Some(init) = init {
                        self.use_expr(init);
                    }
                }
                StmtKind::Const { ty, value, .. } | StmtKind::Let { ty, value, .. } => {
                    if let Some(ty) = ty {
                        self.use_type(ty);
                    }
                    self.use_expr(value);
                }
                StmtKind::Output { items } => items.iter().for_each(|item| self.use_expr(&item.value)),
                StmtKind::Metric { value, .. } | StmtKind::Return { value } => self.use_expr(value),
                StmtKind::Minimize { loss, optimizer } => {
                    self.use_expr(loss);
                    self.use_call(optimizer);
                }
                StmtKind::Device { body, .. } => self.use_block(body),
                StmtKind::Invalid { .. } => {}
            }
        }
    }

    fn use_type(&mut self, ty: &TensorType) {
        ty.shape.iter().for_each(|size| self.use_expr(size));
    }

    fn use_args(&mut self, args: &[Arg]) {
        args.iter().for_each(|arg| self.use_expr(&arg.value));
    }

    fn use_expr(&mut self, expr: &Expr) {
        match &expr.kind {
            ExprKind::Name(ident) => self.use_name(ident, false),
            ExprKind::Array(items) => items.iter().for_each(|item| self.use_expr(item)),
            ExprKind::Call(call) => self.use_call(call),
            ExprKind::Unary(_, operand) => self.use_expr(operand),
            ExprKind::Binary(_, lhs, rhs) => {
                self.use_expr(lhs);
                self.use_expr(rhs);
            }
            ExprKind::Int(_) | ExprKind::Float(_) | ExprKind::Bool(_) | ExprKind::Str(_) => {}
        }
    }

    fn use_call(&mut self, call: &Call) {
        self.use_name(&call.callee, true);
        // Keyword arguments of a layer call name its parameters.
        let layer =
            self.items.get(call.callee.name.as_str()).copied().filter(|&i| self.names.defs[i].kind == DefKind::Layer);
        for arg in &call.args {
            if let (Some(keyword), Some(layer)) = (&arg.name, layer) {
                let param =
                    self.names.defs.iter().position(|d| {
                        d.owner == Some(layer) && d.kind == DefKind::LayerParam && d.name == keyword.name
                    });
                if let Some(param) = param {
                    self.names.uses.push(Use {
                        name: keyword.name.clone(),
                        span: keyword.span,
                        target: Target::Def(param),
                        called: false,
                    });
                }
            }
            self.use_expr(&arg.value);
        }
    }

    /// A called name is a layer or a built-in; any other is a local, else an item (a misuse
    /// that analysis reports) or a built-in (an initializer).
    fn use_name(&mut self, ident: &Ident, called: bool) {
        let name = ident.name.as_str();
        let local = if called { None } else { self.locals.get(name).copied() };
        let target = match local.or_else(|| self.items.get(name).copied()) {
            Some(def) => Target::Def(def),
            None if is_builtin(name) => Target::Builtin,
            None => Target::Unresolved,
        };
        self.names.uses.push(Use { name: ident.name.clone(), span: ident.span, target, called });
    }
}

/// A built-in op, optimizer, learning-rate schedule or initializer.
pub fn is_builtin(name: &str) -> bool {
    let tables = [dfc_sema::OPS, dfc_sema::OPTIMIZERS, dfc_sema::SCHEDULES, dfc_sema::INITIALIZERS];
    tables.iter().flat_map(|t| t.iter()).any(|(n, _, _)| *n == name)
}
