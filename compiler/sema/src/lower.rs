//! Statements: the model body and layer bodies, names and their scopes.

use crate::args::{self, Param};
use crate::layers::Layers;
use crate::value::{Number, Val};
use crate::Options;
use dfc_diag::{Code, Diagnostic, Span};
use dfc_ir::{
    ConstValue, DType, DeviceSpec, Graph, Initializer, Module, NodeId, Op, Optimizer, OptimizerKind, Output, Training,
};
use dfc_syntax::ast::{self, Attribute, Expr, ExprKind, Ident, Stmt, StmtKind};
use std::collections::{HashMap, HashSet};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BindingKind {
    Dim,
    Input,
    Param,
    Const,
    Let,
    LayerArgument,
}

impl BindingKind {
    fn word(self) -> &'static str {
        match self {
            BindingKind::Dim => "dim",
            BindingKind::Input => "input",
            BindingKind::Param => "param",
            BindingKind::Const => "const",
            BindingKind::Let => "let",
            BindingKind::LayerArgument => "layer argument",
        }
    }
}

pub struct Binding {
    pub value: Val,
    pub span: Span,
    pub kind: BindingKind,
    pub used: bool,
    /// Set when the name was used before any definition: the index of that use's E0101 in the
    /// diagnostics, so that a definition later on points there rather than being "defined twice".
    pub used_before_defined: Option<usize>,
}

/// The names visible in a model or in one layer instance.
#[derive(Default)]
pub struct Scope {
    pub bindings: HashMap<String, Binding>,
    /// Definition order, for deterministic warnings.
    pub order: Vec<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Context {
    Model,
    Layer,
}

/// What a block of statements declares besides names.
pub struct BlockState {
    pub context: Context,
    pub dims: Vec<(String, usize)>,
    pub inputs: Vec<NodeId>,
    pub outputs: Vec<(Output, Span)>,
    pub metrics: Vec<(Output, Span)>,
    pub training: Option<(Training, Span)>,
    pub returned: Option<(Val, Span)>,
}

impl BlockState {
    pub fn new(context: Context) -> BlockState {
        BlockState {
            context,
            dims: Vec::new(),
            inputs: Vec::new(),
            outputs: Vec::new(),
            metrics: Vec::new(),
            training: None,
            returned: None,
        }
    }
}

pub struct Lowerer<'a> {
    pub graph: Graph,
    pub diagnostics: Vec<Diagnostic>,
    pub layers: &'a Layers<'a>,
    pub options: &'a Options,
    pub scope: Scope,
    /// Name scope of the nodes being created, `""` or ending in `/` (`h1/`).
    pub prefix: String,
    /// The name nodes are created under (the `let` being lowered).
    pub hint: String,
    /// The device requested by enclosing `device` blocks and attributes, and where the
    /// innermost of them is written.
    pub device: Option<DeviceSpec>,
    pub device_span: Option<Span>,
    pub params: Vec<NodeId>,
    /// Layers being instantiated, innermost last, to refuse recursion.
    pub layer_stack: Vec<String>,
    /// How many layer calls the current `let` makes, and how many were instantiated so far.
    pub let_layer_calls: usize,
    pub layer_instances: HashSet<String>,
    /// Compile-time values of typed constants (`const n: i32 = 4`), so that they can serve
    /// as sizes and axes although they are tensors.
    pub known: HashMap<dfc_ir::TensorRef, Val>,
    /// Where each param's name stands, for warnings about the param.
    pub param_names: HashMap<NodeId, Span>,
    /// What each evaluated expression and each defined name stood for, in evaluation order (a
    /// layer's text once per instance): hover in editors.
    pub types: Vec<(Span, String)>,
}

/// The diagnostics of an optimizer call, checked on its own.
pub fn check_optimizer_call(call: &ast::Call, layers: &Layers, options: &Options) -> Vec<Diagnostic> {
    let mut lowerer = Lowerer::new(layers, options);
    lowerer.optimizer(call);
    lowerer.diagnostics
}

/// A model's IR, its diagnostics, and the types noted for editors (`Lowerer::types`).
pub fn lower_model(
    model: &ast::Model,
    layers: &Layers,
    options: &Options,
) -> (Module, Vec<Diagnostic>, Vec<(Span, String)>) {
    let mut lowerer = Lowerer::new(layers, options);
    let mut state = BlockState::new(Context::Model);
    lowerer.block(&model.body, &mut state);
    lowerer.warn_unused();
    let declares_results = model.body.iter().any(declares_results);
    if !declares_results {
        lowerer.diagnostics.push(
            Diagnostic::warning(
                Code::NOTHING_TO_RUN,
                model.name.span,
                format!("model `{}` has neither outputs nor a `minimize`", model.name.name),
            )
            .with_help("add `output NAME` or `minimize LOSS with sgd(lr = 0.01)`"),
        );
    }
    if let Some((training, _)) = &state.training {
        lowerer.warn_untrained(training.loss.node);
    }
    let module = Module {
        name: model.name.name.clone(),
        graph: lowerer.graph,
        dims: state.dims,
        inputs: state.inputs,
        params: lowerer.params,
        outputs: state.outputs.into_iter().map(|(o, _)| o).collect(),
        metrics: state.metrics.into_iter().map(|(o, _)| o).collect(),
        training: state.training.map(|(t, _)| t),
    };
    (module, lowerer.diagnostics, lowerer.types)
}

impl<'a> Lowerer<'a> {
    pub fn new(layers: &'a Layers<'a>, options: &'a Options) -> Lowerer<'a> {
        Lowerer {
            graph: Graph::new(),
            diagnostics: Vec::new(),
            layers,
            options,
            scope: Scope::default(),
            prefix: String::new(),
            hint: String::new(),
            device: None,
            device_span: None,
            params: Vec::new(),
            layer_stack: Vec::new(),
            let_layer_calls: 0,
            layer_instances: HashSet::new(),
            known: HashMap::new(),
            param_names: HashMap::new(),
            types: Vec::new(),
        }
    }

    pub fn block(&mut self, stmts: &[Stmt], state: &mut BlockState) {
        for stmt in stmts {
            self.stmt(stmt, state);
        }
    }

    fn stmt(&mut self, stmt: &Stmt, state: &mut BlockState) {
        let allowed = match (&stmt.kind, state.context) {
            (
                StmtKind::Dim { .. }
                | StmtKind::Input { .. }
                | StmtKind::Output { .. }
                | StmtKind::Metric { .. }
                | StmtKind::Minimize { .. },
                Context::Layer,
            ) => Err(
                "a layer body holds `param`, `const`, `let`, `device` and `return`; inputs, outputs, metrics, dims and `minimize` belong to the model",
            ),
            (StmtKind::Return { .. }, Context::Model) => Err("`return` ends a layer; a model names its results with `output`"),
            _ => Ok(()),
        };
        if let Err(help) = allowed {
            let keyword = stmt.kind.keyword();
            let place = if state.context == Context::Layer { "a layer" } else { "a model" };
            self.diagnostics.push(
                Diagnostic::error(
                    Code::MISPLACED_STATEMENT,
                    stmt.span,
                    format!("`{keyword}` is not allowed in {place}"),
                )
                .with_label(format!("`{keyword}` here"))
                .with_help(help),
            );
            return;
        }
        let attrs = self.attributes(stmt);
        let saved_device = (self.device.clone(), self.device_span);
        if let Some((device, at)) = &attrs.device {
            self.device = Some(merge_device(self.device.as_ref(), device));
            self.device_span = Some(*at);
        }
        match &stmt.kind {
            StmtKind::Dim { name, value } => self.dim(name, value.as_ref(), state),
            StmtKind::Input { name, ty } => {
                if let Some(ty) = self.resolve_type(ty) {
                    self.hint = name.name.clone();
                    let id =
                        self.graph.add(Op::Input { ty }, &[], &name.name, Some(stmt.span)).expect("inputs always type");
                    self.request(id);
                    state.inputs.push(id);
                    self.define(name, Val::Tensor(id.into()), BindingKind::Input);
                } else {
                    self.define(name, Val::Error, BindingKind::Input);
                }
            }
            StmtKind::Param { name, ty, init } => self.param(name, ty, init.as_ref(), &attrs, stmt.span),
            StmtKind::Const { name, ty, value } => self.constant_stmt(name, ty.as_ref(), value),
            StmtKind::Let { name, ty, value } => self.let_stmt(name, ty.as_ref(), value),
            StmtKind::Output { items } => {
                for item in items {
                    self.output(item, state);
                }
            }
            StmtKind::Minimize { loss, optimizer } => self.minimize(loss, optimizer, stmt.span, state),
            StmtKind::Metric { name, value } => self.metric(name, value, state),
            StmtKind::Device { spec, body } => match DeviceSpec::parse(&spec.value) {
                Ok(device) => {
                    self.device = Some(merge_device(self.device.as_ref(), &device));
                    self.device_span = Some(spec.span);
                    self.block(body, state);
                }
                Err(message) => {
                    self.bad_device(spec.span, &message);
                    self.block(body, state);
                }
            },
            StmtKind::Invalid { name } => {
                if let Some(name) = name {
                    if !self.scope.bindings.contains_key(&name.name) {
                        self.scope.bindings.insert(
                            name.name.clone(),
                            Binding {
                                value: Val::Error,
                                span: name.span,
                                kind: BindingKind::Let,
                                used: true,
                                used_before_defined: None,
                            },
                        );
                    }
                }
            }
            StmtKind::Return { value } => {
                self.hint = String::new();
                let result = self.eval(value);
                if let Some((_, first)) = &state.returned {
                    self.diagnostics.push(
                        Diagnostic::error(Code::MISPLACED_STATEMENT, stmt.span, "a layer returns once")
                            .with_secondary(*first, "it already returned here")
                            .with_help("combine the results, or split the layer in two"),
                    );
                } else {
                    state.returned = Some((result, value.span));
                }
            }
        }
        (self.device, self.device_span) = saved_device;
    }

    /// Gives a new node the device its enclosing blocks and attributes request.
    pub fn request(&mut self, id: NodeId) {
        self.graph.request(id, self.device.clone(), self.device.as_ref().and(self.device_span));
    }

    // ---- names ------------------------------------------------------------------------------

    pub fn define(&mut self, name: &Ident, value: Val, kind: BindingKind) {
        let forward_use = self.scope.bindings.get(&name.name).and_then(|b| b.used_before_defined);
        if let Some(index) = forward_use {
            // The earlier use was the mistake (reported then); this is the name's one definition.
            let use_before = &mut self.diagnostics[index];
            use_before.message = format!("`{}` is used before it is defined", name.name);
            use_before.primary.message = "used here".into();
            use_before
                .secondary
                .push(dfc_diag::Label { span: name.span, message: "defined here, after the use".into() });
            use_before.help = Some("move the definition above its first use".into());
            self.scope.bindings.remove(&name.name);
        }
        if let Some(previous) = self.scope.bindings.get(&name.name) {
            let previous_span = previous.span;
            let previous_kind = previous.kind.word();
            self.diagnostics.push(
                Diagnostic::error(Code::DUPLICATE_NAME, name.span, format!("`{}` is defined twice", name.name))
                    .with_label("defined again here")
                    .with_secondary(
                        previous_span,
                        format!("first defined here ({} {previous_kind})", dfc_diag::article(previous_kind)),
                    )
                    .with_help("names are defined once per model or layer; rename one of them"),
            );
            return;
        }
        let builtin = crate::builtins::is_op(&name.name);
        if builtin || self.layers.get(&name.name).is_some() {
            let what = if builtin { "a built-in op" } else { "a layer" };
            self.diagnostics.push(
                Diagnostic::error(Code::DUPLICATE_NAME, name.span, format!("`{}` is the name of {what}", name.name))
                    .with_help("choose another name, so that calls stay unambiguous"),
            );
        }
        self.note_type(name.span, &value);
        let used = name.name.starts_with('_') || kind == BindingKind::LayerArgument || forward_use.is_some();
        self.scope.order.push(name.name.clone());
        self.scope
            .bindings
            .insert(name.name.clone(), Binding { value, span: name.span, kind, used, used_before_defined: None });
    }

    pub fn lookup(&mut self, ident: &Ident) -> Val {
        if let Some(binding) = self.scope.bindings.get_mut(&ident.name) {
            binding.used = true;
            return binding.value.clone();
        }
        let is_op = crate::builtins::is_op(&ident.name);
        if is_op || self.layers.get(&ident.name).is_some() {
            let what = if is_op { "an op" } else { "a layer" };
            self.diagnostics.push(
                Diagnostic::error(
                    Code::WRONG_KIND_OF_NAME,
                    ident.span,
                    format!("`{}` is {what}, not a value", ident.name),
                )
                .with_label("used as a value")
                .with_help(format!("call it: `{}(...)`", ident.name)),
            );
            return Val::Error;
        }
        let mut d = Diagnostic::error(Code::UNDEFINED_NAME, ident.span, format!("`{}` is not defined", ident.name))
            .with_label("not defined");
        let candidates: Vec<&str> = self.scope.bindings.keys().map(|k| k.as_str()).collect();
        if let Some(best) = dfc_diag::closest(&ident.name, candidates) {
            d = d.with_help(format!("did you mean `{best}`?"));
        } else if self.layer_stack.is_empty() {
            d = d.with_help(
                "names must be defined (with `let`, `param`, `input`, `const` or `dim`) before they are used",
            );
        } else {
            d = d.with_help("a layer sees only its arguments and its own definitions, not the model's");
        }
        self.diagnostics.push(d);
        // Define it as poisoned so that later uses report nothing more.
        self.scope.bindings.insert(
            ident.name.clone(),
            Binding {
                value: Val::Error,
                span: ident.span,
                kind: BindingKind::Let,
                used: true,
                used_before_defined: Some(self.diagnostics.len() - 1),
            },
        );
        Val::Error
    }

    /// A trainable param the loss does not depend on would never change; a loss that depends
    /// on none trains nothing.
    fn warn_untrained(&mut self, loss: NodeId) {
        let needed = self.graph.ancestors(&[loss]);
        let trainable = |node: &dfc_ir::Node| matches!(node.op, Op::Variable { trainable: true, .. });
        if !self.params.iter().any(|&param| trainable(self.graph.node(param)) && needed.contains(&param)) {
            self.diagnostics.push(
                Diagnostic::warning(
                    Code::NOTHING_TO_TRAIN,
                    self.graph.span(loss).unwrap_or_default(),
                    "the loss depends on no trainable param, so the optimizer has nothing to change",
                )
                .with_help("make the loss depend on a `param`, or run the model forward with `dfc run --fetch`"),
            );
        }
        for &param in &self.params {
            let node = self.graph.node(param);
            if trainable(node) && !needed.contains(&param) {
                let span = self.param_names.get(&param).copied().unwrap_or_default();
                self.diagnostics.push(
                    Diagnostic::warning(
                        Code::NOT_TRAINED,
                        span,
                        format!("param `{}` does not affect the loss, so training never changes it", node.name),
                    )
                    .with_help("use it in the loss, or mark it `@trainable(false)`"),
                );
            }
        }
    }

    fn warn_unused(&mut self) {
        for name in &self.scope.order {
            let binding = &self.scope.bindings[name];
            if binding.used || binding.kind == BindingKind::Dim {
                continue;
            }
            self.diagnostics.push(
                Diagnostic::warning(
                    Code::UNUSED,
                    binding.span,
                    format!("{} `{name}` is never used", binding.kind.word()),
                )
                .with_help(format!("remove it, or name it `_{name}` to keep it quietly")),
            );
        }
    }

    // ---- statements -------------------------------------------------------------------------

    fn dim(&mut self, name: &Ident, value: Option<&Expr>, state: &mut BlockState) {
        let overridden = self.options.dims.iter().rev().find(|(n, _)| *n == name.name).map(|(_, v)| *v);
        let resolved = match (overridden, value) {
            (Some(v), _) if v >= 1 => Some(v),
            (Some(v), _) => {
                self.diagnostics.push(
                    Diagnostic::error(
                        Code::BAD_DIM,
                        name.span,
                        format!("`--dim {}={v}` is not a positive size", name.name),
                    )
                    .with_help("dims are sizes: positive integers"),
                );
                None
            }
            (None, Some(expr)) => self.size(expr, &format!("dim `{}`", name.name)).map(|v| v as i64),
            (None, None) => {
                self.diagnostics.push(
                    Diagnostic::error(Code::BAD_DIM, name.span, format!("dim `{}` has no value", name.name))
                        .with_label("declared without a value")
                        .with_help(format!("give it a default (`dim {0} = 128`) or pass `--dim {0}=N`", name.name)),
                );
                None
            }
        };
        match resolved {
            Some(v) => {
                state.dims.push((name.name.clone(), v as usize));
                self.define(name, Val::Number(Number::Int(v)), BindingKind::Dim);
            }
            None => self.define(name, Val::Error, BindingKind::Dim),
        }
    }

    fn param(&mut self, name: &Ident, ty: &ast::TensorType, init: Option<&Expr>, attrs: &Attributes, span: Span) {
        let init_expr = init;
        let Some(resolved) = self.resolve_type(ty) else {
            self.define(name, Val::Error, BindingKind::Param);
            return;
        };
        let trainable = attrs.trainable.unwrap_or(true);
        if trainable && !resolved.dtype.is_float() {
            self.diagnostics.push(
                Diagnostic::error(
                    Code::DTYPE_MISMATCH,
                    ty.dtype_span,
                    format!("a trainable param must be f32 or f64, not {}", resolved.dtype),
                )
                .with_help("use a float type, or mark it `@trainable(false)`"),
            );
        }
        let init = match init {
            Some(expr) => self.initializer(expr),
            // Keras's defaults: Glorot for weight matrices and filters, zeros for biases (and for
            // everything that is not floating point).
            None if resolved.shape.rank() >= 2 && resolved.dtype.is_float() => Some(Initializer::GlorotUniform),
            None => Some(Initializer::Zeros),
        };
        let mut partitions = 1;
        if let Some((n, n_span)) = attrs.partitioned {
            let rows = resolved.shape.dims().first().copied().unwrap_or(0);
            if resolved.shape.rank() == 0 {
                self.diagnostics.push(
                    Diagnostic::error(Code::BAD_PARTITIONING, n_span, "a scalar cannot be partitioned")
                        .with_help("partitioning splits axis 0 of a param into shards"),
                );
            } else if n < 1 || n as usize > rows {
                self.diagnostics.push(
                    Diagnostic::error(
                        Code::BAD_PARTITIONING,
                        n_span,
                        format!("cannot split {} rows into {n} shards", rows),
                    )
                    .with_label(format!("must be between 1 and {rows}"))
                    .with_help("each shard gets at least one row of axis 0"),
                );
            } else {
                partitions = n as u32;
            }
        }
        // A bad initialiser is reported; the param is still created so its uses are checked.
        let init = init.unwrap_or(Initializer::Zeros);
        if let Some(expr) = init_expr {
            self.check_initializer_dtype(&init, resolved.dtype, expr.span);
        }
        let full_name = format!("{}{}", self.prefix, name.name);
        let op = Op::Variable { ty: resolved, init, trainable, partitions, origin: None };
        let variable = self.graph.add(op, &[], &full_name, Some(span)).expect("variables always type");
        let read =
            self.graph.add(Op::Read, &[variable.into()], &format!("{full_name}/read"), Some(span)).expect("reads type");
        for id in [variable, read] {
            self.request(id);
        }
        self.params.push(variable);
        self.param_names.insert(variable, name.span);
        self.define(name, Val::Tensor(read.into()), BindingKind::Param);
    }

    fn constant_stmt(&mut self, name: &Ident, ty: Option<&ast::TensorType>, value: &Expr) {
        self.hint = name.name.clone();
        let evaluated = self.eval(value);
        let result = match (&evaluated, ty) {
            (Val::Error, _) => Val::Error,
            (Val::Tensor(t), _) => {
                let ty = self.graph.ty(*t).clone();
                self.diagnostics.push(
                    Diagnostic::error(
                        Code::NOT_CONSTANT,
                        value.span,
                        format!("`const {}` must be known at compile time", name.name),
                    )
                    .with_label(format!(
                        "this is {} {ty} tensor computed when the model runs",
                        dfc_diag::article(&ty.to_string())
                    ))
                    .with_help("use `let` for values computed from inputs and params"),
                );
                Val::Error
            }
            (Val::Str(_), _) => self.wrong_kind(value.span, "a number or a list of numbers", &evaluated),
            (_, None) => evaluated,
            (_, Some(ty)) => self.typed_constant(evaluated, ty, value.span),
        };
        if let Val::Tensor(t) = &result {
            let full = format!("{}{}", self.prefix, name.name);
            self.graph.rename(t.node, &full);
        }
        self.define(name, result, BindingKind::Const);
    }

    /// `const c: f32[2, 2] = [[1, 2], [3, 4]]`; a single number fills the shape.
    fn typed_constant(&mut self, value: Val, ty: &ast::TensorType, span: Span) -> Val {
        let result = self.typed_constant_tensor(value, ty, span);
        if let Val::Tensor(t) = &result {
            // The value as converted to its type: `const k: i32 = 2.0` is the integer 2.
            if let Op::Const { value } = &self.graph.node(t.node).op {
                let dtype = value.dtype();
                let numbers: Vec<Val> = value
                    .to_f64()
                    .into_iter()
                    .map(|v| {
                        Val::Number(match dtype {
                            DType::Bool => Number::Bool(v != 0.0),
                            d if d.is_int() => Number::Int(v as i64),
                            _ => Number::Float(v),
                        })
                    })
                    .collect();
                let known = if value.shape.rank() == 0 { numbers[0].clone() } else { Val::List(numbers) };
                self.known.insert(*t, known);
            }
        }
        result
    }

    fn typed_constant_tensor(&mut self, value: Val, ty: &ast::TensorType, span: Span) -> Val {
        let Some(ty) = self.resolve_type(ty) else { return Val::Error };
        let filled = match value {
            Val::Number(_) if ty.shape.n_elements() > crate::eval::MAX_CONSTANT_ELEMENTS => {
                self.diagnostics.push(
                    Diagnostic::error(
                        Code::INVALID_SHAPE,
                        span,
                        format!("a constant of {ty} is too large to keep in the plan"),
                    )
                    .with_help(
                        "constants hold at most 2^24 elements; use a param with `constant(...)` for large fills",
                    ),
                );
                return Val::Error;
            }
            Val::Number(n) if ty.shape.rank() > 0 => {
                let tensor = self.make_tensor(Val::Number(n), span, Some(ty.dtype));
                let Some(scalar) = tensor else { return Val::Error };
                let values = vec![n.as_f64(); ty.shape.n_elements()];
                // The scalar node served only to check the value; the filled constant replaces it.
                self.graph.remove(scalar.node);
                return Val::Tensor(self.constant(ConstValue::from_f64(ty.dtype, ty.shape, &values), span));
            }
            other => other,
        };
        let Some(tensor) = self.make_tensor(filled, span, Some(ty.dtype)) else { return Val::Error };
        self.check_annotation(tensor, &ty, span)
    }

    fn check_annotation(&mut self, tensor: dfc_ir::TensorRef, expected: &dfc_ir::TensorType, span: Span) -> Val {
        let actual = self.graph.ty(tensor).clone();
        if actual != *expected {
            let code = if actual.dtype != expected.dtype { Code::DTYPE_MISMATCH } else { Code::ANNOTATION_MISMATCH };
            let code = if code == Code::DTYPE_MISMATCH { Code::ANNOTATION_MISMATCH } else { code };
            self.diagnostics.push(
                Diagnostic::error(code, span, format!("this is {actual}, but it is annotated {expected}"))
                    .with_label(format!("{actual}"))
                    .with_help("fix the annotation, or reshape/cast the value"),
            );
            return Val::Error;
        }
        Val::Tensor(tensor)
    }

    fn let_stmt(&mut self, name: &Ident, ty: Option<&ast::TensorType>, value: &Expr) {
        self.hint = name.name.clone();
        self.let_layer_calls = crate::layers::count_layer_calls(value, self.layers);
        let first_new = self.graph.len();
        let mut result = self.eval(value);
        self.let_layer_calls = 0;
        if let Some(ty) = ty {
            result = match result {
                Val::Error => Val::Error,
                Val::Tensor(t) => match self.resolve_type(ty) {
                    Some(expected) => self.check_annotation(t, &expected, value.span),
                    None => Val::Error,
                },
                other => self.typed_constant(other, ty, value.span),
            };
        }
        // The node computing the value takes the let's name (`hidden`, not `hidden/add`).
        if let Val::Tensor(t) = &result {
            let created_here = t.node.index() >= first_new
                && !matches!(self.graph.node(t.node).op, Op::Variable { .. } | Op::Read | Op::Input { .. });
            if created_here {
                let full = format!("{}{}", self.prefix, name.name);
                self.graph.rename(t.node, &full);
            }
        }
        self.define(name, result, BindingKind::Let);
    }

    fn output(&mut self, item: &ast::OutputItem, state: &mut BlockState) {
        let name = match (&item.alias, &item.value.kind) {
            (Some(alias), _) => alias.clone(),
            (None, ExprKind::Name(ident)) => ident.clone(),
            (None, _) => {
                self.diagnostics.push(
                    Diagnostic::error(Code::BAD_OUTPUT, item.value.span, "an output computed in place needs a name")
                        .with_label("unnamed output")
                        .with_help("add `as NAME`: `output softmax(logits) as probabilities`"),
                );
                self.hint = "output".into();
                self.eval(&item.value);
                return;
            }
        };
        if let Some((_, first)) = state.outputs.iter().find(|(o, _)| o.name == name.name) {
            let first = *first;
            self.diagnostics.push(
                Diagnostic::error(Code::BAD_OUTPUT, name.span, format!("output `{}` is named twice", name.name))
                    .with_secondary(first, "first named here"),
            );
            return;
        }
        self.hint = name.name.clone();
        self.let_layer_calls = crate::layers::count_layer_calls(&item.value, self.layers);
        let value = self.eval(&item.value);
        self.let_layer_calls = 0;
        if let Some(tensor) = self.make_tensor(value, item.value.span, None) {
            state.outputs.push((Output { name: name.name.clone(), tensor }, name.span));
        }
    }

    /// `metric NAME = EXPR`: a numeric scalar, averaged over evaluation batches by `dfc run`.
    fn metric(&mut self, name: &Ident, value: &Expr, state: &mut BlockState) {
        if let Some((_, first)) = state.metrics.iter().find(|(m, _)| m.name == name.name) {
            let first = *first;
            self.diagnostics.push(
                Diagnostic::error(Code::BAD_OUTPUT, name.span, format!("metric `{}` is defined twice", name.name))
                    .with_secondary(first, "first defined here"),
            );
            return;
        }
        self.hint = name.name.clone();
        let evaluated = self.eval(value);
        let Some(tensor) = self.make_tensor(evaluated, value.span, Some(DType::F32)) else { return };
        let ty = self.graph.ty(tensor).clone();
        if ty.shape.rank() != 0 || !ty.dtype.is_numeric() {
            self.diagnostics.push(
                Diagnostic::error(Code::BAD_OUTPUT, value.span, format!("a metric is a numeric scalar, not {ty}"))
                    .with_label(format!("{ty}"))
                    .with_help("reduce it over the batch, e.g. `mean(cast<f32>(argmax(logits) == labels))`"),
            );
            return;
        }
        state.metrics.push((Output { name: name.name.clone(), tensor }, name.span));
    }

    fn minimize(&mut self, loss: &Expr, optimizer: &ast::Call, span: Span, state: &mut BlockState) {
        if let Some((_, first)) = &state.training {
            self.diagnostics.push(
                Diagnostic::error(Code::DUPLICATE_MINIMIZE, span, "a model minimizes one loss")
                    .with_secondary(*first, "the loss is already given here")
                    .with_help("add the losses into one: `minimize a + b with ...`"),
            );
            return;
        }
        self.hint = "loss".into();
        let value = self.eval(loss);
        let tensor = self.make_tensor(value, loss.span, Some(DType::F32));
        let optimizer = match &self.options.optimizer {
            Some(replacement) => self.optimizer(replacement),
            None => self.optimizer(optimizer),
        };
        let Some(tensor) = tensor else { return };
        let ty = self.graph.ty(tensor).clone();
        if ty.shape.rank() != 0 || !ty.dtype.is_float() {
            let help = if ty.dtype.is_float() {
                "reduce it to a scalar, e.g. `mean(...)`"
            } else {
                "the loss must be f32 or f64; cast it with cast<f32>(...)"
            };
            self.diagnostics.push(
                Diagnostic::error(
                    Code::BAD_LOSS,
                    loss.span,
                    format!("the loss must be a floating-point scalar, not {ty}"),
                )
                .with_label(format!("{ty}"))
                .with_help(help),
            );
            return;
        }
        if let Some(optimizer) = optimizer {
            state.training = Some((
                Training {
                    loss: tensor,
                    optimizer,
                    gradients: Vec::new(),
                    updates: Vec::new(),
                    learning_rate: None,
                    averages: Vec::new(),
                },
                span,
            ));
        }
    }

    // ---- attributes, initialisers, optimizers -------------------------------------------------

    fn attributes(&mut self, stmt: &Stmt) -> Attributes {
        let mut out = Attributes::default();
        let allowed: &[&str] = match stmt.kind {
            StmtKind::Param { .. } => &["device", "partitioned", "trainable"],
            StmtKind::Input { .. } | StmtKind::Let { .. } | StmtKind::Const { .. } => &["device"],
            _ => &[],
        };
        let mut seen: HashMap<&str, Span> = HashMap::new();
        for attr in &stmt.attrs {
            let name = attr.name.name.as_str();
            if !allowed.contains(&name) {
                let mut d = Diagnostic::error(
                    Code::UNKNOWN_ATTRIBUTE,
                    attr.name.span,
                    format!("`@{name}` is not an attribute of `{}`", stmt.kind.keyword()),
                );
                let all = ["device", "partitioned", "trainable"];
                d = match (all.contains(&name), dfc_diag::closest(name, all)) {
                    (true, _) => d.with_help(format!("`{}` takes {}", stmt.kind.keyword(), list_attrs(allowed))),
                    (false, Some(best)) if allowed.contains(&best) => d.with_help(format!("did you mean `@{best}`?")),
                    _ => d.with_help(format!(
                        "`{}` takes {}; for a matrix product, put spaces around `@`",
                        stmt.kind.keyword(),
                        list_attrs(allowed)
                    )),
                };
                self.diagnostics.push(d);
                continue;
            }
            if let Some(first) = seen.insert(name, attr.span) {
                self.diagnostics.push(
                    Diagnostic::error(Code::DUPLICATE_ARGUMENT, attr.span, format!("`@{name}` is given twice"))
                        .with_secondary(first, "first given here"),
                );
                continue;
            }
            self.attribute(attr, &mut out);
        }
        out
    }

    fn attribute(&mut self, attr: &Attribute, out: &mut Attributes) {
        let callee = format!("@{}", attr.name.name);
        match attr.name.name.as_str() {
            "device" => {
                let Some(bound) = args::bind(
                    &callee,
                    attr.span,
                    &[Param { name: "spec", required: true }],
                    &attr.args,
                    &mut self.diagnostics,
                ) else {
                    return;
                };
                let Some(arg) = bound[0] else { return };
                match &arg.value.kind {
                    ExprKind::Str(text) => match DeviceSpec::parse(text) {
                        Ok(spec) => out.device = Some((spec, attr.span)),
                        Err(message) => self.bad_device(arg.value.span, &message),
                    },
                    _ => {
                        self.diagnostics.push(
                            Diagnostic::error(Code::BAD_DEVICE, arg.value.span, "a device is given as a string")
                                .with_help("e.g. @device(\"/job:ps/task:0\") or @device(\"gpu:0\")"),
                        );
                    }
                }
            }
            "partitioned" => {
                let Some(bound) = args::bind(
                    &callee,
                    attr.span,
                    &[Param { name: "shards", required: true }],
                    &attr.args,
                    &mut self.diagnostics,
                ) else {
                    return;
                };
                if let Some(arg) = bound[0] {
                    if let Some(n) = self.const_int(&arg.value, "the number of shards") {
                        out.partitioned = Some((n, arg.value.span));
                    }
                }
            }
            _ => {
                let Some(bound) = args::bind(
                    &callee,
                    attr.span,
                    &[Param { name: "enabled", required: true }],
                    &attr.args,
                    &mut self.diagnostics,
                ) else {
                    return;
                };
                if let Some(arg) = bound[0] {
                    out.trainable = self.const_bool(&arg.value, "`@trainable`");
                }
            }
        }
    }

    /// Random initialisers fill floats; a constant must fit the element type.
    fn check_initializer_dtype(&mut self, init: &Initializer, dtype: DType, span: Span) {
        let value = match init {
            Initializer::Zeros => 0.0,
            Initializer::Ones => 1.0,
            Initializer::Constant { value } => *value,
            _ if dtype.is_float() => return,
            _ => {
                self.diagnostics.push(
                    Diagnostic::error(
                        Code::BAD_INITIALIZER,
                        span,
                        format!(
                            "`{init}` draws real numbers; it cannot fill {} {dtype} param",
                            dfc_diag::article(dtype.name())
                        ),
                    )
                    .with_help("use zeros, ones or a constant for integer and bool params"),
                );
                return;
            }
        };
        // Initial values travel as f64: integers beyond 2^53 would silently change.
        if dtype.is_int() && value.abs() > 2f64.powi(53) {
            self.diagnostics.push(
                Diagnostic::error(Code::BAD_INITIALIZER, span, format!("{value} cannot be an initial value exactly"))
                    .with_help("initial values of integer params must lie within ±2^53"),
            );
            return;
        }
        let number = if dtype == DType::Bool && (value == 0.0 || value == 1.0) {
            Number::Bool(value == 1.0)
        } else if value.fract() == 0.0 {
            Number::Int(value as i64)
        } else {
            Number::Float(value)
        };
        if self.check_representable(number, dtype, span).is_none() {
            if let Some(d) = self.diagnostics.last_mut() {
                d.help = Some(format!("the initial value must fit the param's type, {dtype}"));
            }
        }
    }

    fn bad_device(&mut self, span: Span, message: &str) {
        self.diagnostics.push(
            Diagnostic::error(Code::BAD_DEVICE, span, format!("malformed device: {message}"))
                .with_label("not a device")
                .with_help(
                    "devices look like \"/job:worker/task:0/device:GPU:0\", \"/job:ps/task:1\", \"cpu:0\" or \"gpu:1\"",
                ),
        );
    }

    fn initializer(&mut self, expr: &Expr) -> Option<Initializer> {
        let names: Vec<&str> = crate::builtins::INITIALIZERS.iter().map(|(name, _, _)| *name).collect();
        let (name, call) = match &expr.kind {
            ExprKind::Name(ident) => (ident, None),
            ExprKind::Call(call) => (&call.callee, Some(call)),
            ExprKind::Int(_) | ExprKind::Float(_) | ExprKind::Unary(..) => {
                let value = self.const_f64(expr, "a constant initial value")?;
                return Some(Initializer::Constant { value });
            }
            _ => {
                self.diagnostics.push(
                    Diagnostic::error(
                        Code::BAD_INITIALIZER,
                        expr.span,
                        "a param is initialised by an initialiser or a number",
                    )
                    .with_help(format!("the initialisers are {}", dfc_diag::one_of(&names))),
                );
                return None;
            }
        };
        let params: &[Param] = match name.name.as_str() {
            "zeros" | "ones" | "glorot_uniform" | "he_normal" => &[],
            "constant" => &[Param { name: "value", required: true }],
            "uniform" => &[Param { name: "min", required: false }, Param { name: "max", required: false }],
            "normal" | "truncated_normal" => {
                &[Param { name: "mean", required: false }, Param { name: "stddev", required: false }]
            }
            other => {
                let mut d =
                    Diagnostic::error(Code::BAD_INITIALIZER, name.span, format!("`{other}` is not an initialiser"));
                d = match dfc_diag::closest(other, names.iter().copied()) {
                    Some(best) => d.with_help(format!("did you mean `{best}`?")),
                    None => d.with_help(format!("the initialisers are {}", dfc_diag::one_of(&names))),
                };
                self.diagnostics.push(d);
                return None;
            }
        };
        let empty = Vec::new();
        let call_args = call.map(|c| &c.args).unwrap_or(&empty);
        let bound = args::bind(&name.name, expr.span, params, call_args, &mut self.diagnostics)?;
        let mut value = |i: usize, default: f64, what: &str| -> Option<f64> {
            match args::expr(bound[i]) {
                Some(e) => self.const_f64(e, what),
                None => Some(default),
            }
        };
        // Keras's defaults for the random initialisers.
        let init = match name.name.as_str() {
            "zeros" => Initializer::Zeros,
            "ones" => Initializer::Ones,
            "glorot_uniform" => Initializer::GlorotUniform,
            "he_normal" => Initializer::HeNormal,
            "constant" => Initializer::Constant { value: value(0, 0.0, "the constant")? },
            "uniform" => {
                let (min, max) = (value(0, -0.05, "min")?, value(1, 0.05, "max")?);
                if min >= max {
                    self.diagnostics.push(
                        Diagnostic::error(
                            Code::BAD_INITIALIZER,
                            expr.span,
                            format!("uniform({min}, {max}) is an empty range"),
                        )
                        .with_help("min must be below max"),
                    );
                    return None;
                }
                Initializer::Uniform { min, max }
            }
            kind => {
                let (mean, stddev) = (value(0, 0.0, "mean")?, value(1, 0.05, "stddev")?);
                if stddev <= 0.0 {
                    self.diagnostics.push(Diagnostic::error(
                        Code::BAD_INITIALIZER,
                        expr.span,
                        format!("stddev must be positive, not {stddev}"),
                    ));
                    return None;
                }
                if kind == "normal" {
                    Initializer::Normal { mean, stddev }
                } else {
                    Initializer::TruncatedNormal { mean, stddev }
                }
            }
        };
        Some(init)
    }

    fn optimizer(&mut self, call: &ast::Call) -> Option<Optimizer> {
        let names: Vec<&str> = crate::builtins::OPTIMIZERS.iter().map(|(name, _, _)| *name).collect();
        let name = call.callee.name.as_str();
        let params: &[Param] = match name {
            "sgd" => &[
                Param { name: "lr", required: true },
                Param { name: "weight_decay", required: false },
                Param { name: "clip_global_norm", required: false },
            ],
            "momentum" => &[
                Param { name: "lr", required: true },
                Param { name: "momentum", required: false },
                Param { name: "nesterov", required: false },
                Param { name: "weight_decay", required: false },
                Param { name: "clip_global_norm", required: false },
            ],
            "adam" => &[
                Param { name: "lr", required: false },
                Param { name: "beta1", required: false },
                Param { name: "beta2", required: false },
                Param { name: "epsilon", required: false },
                Param { name: "weight_decay", required: false },
                Param { name: "clip_global_norm", required: false },
            ],
            "adagrad" => &[
                Param { name: "lr", required: false },
                Param { name: "initial_accumulator", required: false },
                Param { name: "epsilon", required: false },
                Param { name: "weight_decay", required: false },
                Param { name: "clip_global_norm", required: false },
            ],
            "rmsprop" => &[
                Param { name: "lr", required: false },
                Param { name: "rho", required: false },
                Param { name: "momentum", required: false },
                Param { name: "epsilon", required: false },
                Param { name: "weight_decay", required: false },
                Param { name: "clip_global_norm", required: false },
            ],
            _ => {
                let mut d =
                    Diagnostic::error(Code::BAD_OPTIMIZER, call.callee.span, format!("`{name}` is not an optimizer"));
                d = match dfc_diag::closest(name, names.iter().copied()) {
                    Some(best) => d.with_help(format!("did you mean `{best}`?")),
                    None => d.with_help(format!("the optimizers are {}", dfc_diag::one_of(&names))),
                };
                self.diagnostics.push(d);
                return None;
            }
        };
        let bound = args::bind(name, call.span, params, &call.args, &mut self.diagnostics)?;
        let index = |key: &str| params.iter().position(|p| p.name == key);
        // `lr`: a number, or a schedule of the global step.
        let lr_expr = index("lr").and_then(|i| args::expr(bound[i]));
        let (schedule, schedule_ok) = match lr_expr.map(|e| self.lr_schedule(e)) {
            Some(Ok(schedule)) => (schedule, true),
            Some(Err(())) => (None, false),
            None => (None, true),
        };
        let mut ok = schedule_ok;
        let mut number = |this: &mut Self, key: &str, default: f64, valid: fn(f64) -> bool, rule: &str| -> f64 {
            let Some(i) = index(key) else { return default };
            let Some(expr) = args::expr(bound[i]) else { return default };
            match this.const_f64(expr, &format!("`{key}`")) {
                Some(v) if valid(v) => v,
                Some(v) => {
                    this.diagnostics.push(
                        Diagnostic::error(Code::BAD_OPTIMIZER, expr.span, format!("`{key}` = {v} is out of range"))
                            .with_label(format!("must be {rule}")),
                    );
                    ok = false;
                    default
                }
                None => {
                    ok = false;
                    default
                }
            }
        };
        let positive = |v: f64| v > 0.0 && v.is_finite();
        let unit = |v: f64| (0.0..1.0).contains(&v);
        let non_negative = |v: f64| v >= 0.0 && v.is_finite();
        let default_lr = match name {
            "adagrad" => 0.01,
            _ => 0.001,
        };
        let learning_rate = match &schedule {
            Some(schedule) => schedule.at(0),
            None if schedule_ok => number(self, "lr", default_lr, positive, "positive"),
            None => default_lr,
        };
        let weight_decay = number(self, "weight_decay", 0.0, non_negative, "≥ 0");
        let clip_global_norm = index("clip_global_norm")
            .and_then(|i| args::expr(bound[i]))
            .map(|_| number(self, "clip_global_norm", 1.0, positive, "positive"));
        let kind = match name {
            "sgd" => OptimizerKind::Sgd,
            "momentum" => {
                let momentum = number(self, "momentum", 0.9, unit, "in [0, 1)");
                let nesterov = match index("nesterov").and_then(|i| args::expr(bound[i])) {
                    Some(e) => self.const_bool(e, "`nesterov`").unwrap_or(false),
                    None => false,
                };
                OptimizerKind::Momentum { momentum, nesterov }
            }
            "adam" => OptimizerKind::Adam {
                beta1: number(self, "beta1", 0.9, unit, "in [0, 1)"),
                beta2: number(self, "beta2", 0.999, unit, "in [0, 1)"),
                epsilon: number(self, "epsilon", 1e-7, positive, "positive"),
            },
            "adagrad" => OptimizerKind::Adagrad {
                initial_accumulator: number(self, "initial_accumulator", 0.1, non_negative, "≥ 0"),
                epsilon: number(self, "epsilon", 1e-7, positive, "positive"),
            },
            _ => OptimizerKind::RmsProp {
                rho: number(self, "rho", 0.9, unit, "in [0, 1)"),
                momentum: number(self, "momentum", 0.0, unit, "in [0, 1)"),
                epsilon: number(self, "epsilon", 1e-7, positive, "positive"),
            },
        };
        ok.then_some(Optimizer { kind, learning_rate, weight_decay, schedule, clip_global_norm })
    }
}

/// The names of every `dim` a block declares, nested blocks included.
pub fn declared_dims(stmts: &[Stmt]) -> Vec<&str> {
    stmts
        .iter()
        .flat_map(|stmt| match &stmt.kind {
            StmtKind::Dim { name, .. } => vec![name.name.as_str()],
            StmtKind::Device { body, .. } => declared_dims(body),
            _ => Vec::new(),
        })
        .collect()
}

fn declares_results(stmt: &Stmt) -> bool {
    match &stmt.kind {
        StmtKind::Output { .. } | StmtKind::Minimize { .. } | StmtKind::Metric { .. } => true,
        StmtKind::Device { body, .. } => body.iter().any(declares_results),
        _ => false,
    }
}

#[derive(Default)]
pub struct Attributes {
    pub device: Option<(DeviceSpec, Span)>,
    pub partitioned: Option<(i64, Span)>,
    pub trainable: Option<bool>,
}

fn list_attrs(allowed: &[&str]) -> String {
    if allowed.is_empty() {
        return "no attributes".into();
    }
    let names: Vec<String> = allowed.iter().map(|a| format!("`@{a}`")).collect();
    dfc_diag::one_of(&names)
}

/// Nested device scopes, as in TensorFlow: what the inner scope sets wins; the rest is kept.
pub fn merge_device(outer: Option<&DeviceSpec>, inner: &DeviceSpec) -> DeviceSpec {
    let Some(outer) = outer else { return inner.clone() };
    DeviceSpec {
        job: inner.job.clone().or_else(|| outer.job.clone()),
        replica: inner.replica.or(outer.replica),
        task: inner.task.or(outer.task),
        kind: inner.kind.or(outer.kind),
        index: inner.index.or(outer.index),
    }
}
