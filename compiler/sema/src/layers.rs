//! Layers: definitions collected from the file, instantiated at each call with a name scope
//! (`let h1 = dense(x, units = 256)` creates params `h1/w`, `h1/b`) and with the shape
//! parameters of their tensor arguments bound by unification.

use crate::args::{self, Param};
use crate::lower::{BindingKind, BlockState, Context, Lowerer};
use crate::value::{Number, Val};
use dfc_diag::{Code, Diagnostic, Span};
use dfc_syntax::ast::{Call, Expr, ExprKind, Item, LayerDef, LayerParamKind, SourceFile};
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};

/// Layer instances may nest this deep (analysis recurses through them).
const MAX_LAYER_DEPTH: usize = 32;

pub struct Layers<'a> {
    defs: HashMap<String, &'a LayerDef>,
    used: RefCell<HashSet<String>>,
}

impl<'a> Layers<'a> {
    pub fn get(&self, name: &str) -> Option<&'a LayerDef> {
        self.defs.get(name).copied()
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.defs.keys().map(|k| k.as_str())
    }
}

pub fn collect<'a>(file: &'a SourceFile, diagnostics: &mut Vec<Diagnostic>) -> Layers<'a> {
    let mut defs: HashMap<String, &LayerDef> = HashMap::new();
    for item in &file.items {
        let Item::Layer(def) = item else { continue };
        if let Some(first) = defs.get(&def.name.name) {
            diagnostics.push(
                Diagnostic::error(
                    Code::DUPLICATE_NAME,
                    def.name.span,
                    format!("layer `{}` is defined twice", def.name.name),
                )
                .with_secondary(first.name.span, "first defined here"),
            );
            continue;
        }
        if crate::builtins::is_op(&def.name.name) {
            diagnostics.push(
                Diagnostic::error(Code::DUPLICATE_NAME, def.name.span, format!("`{}` is a built-in op", def.name.name))
                    .with_help("give the layer another name"),
            );
            continue;
        }
        let mut seen: HashMap<&str, Span> = HashMap::new();
        for param in &def.params {
            if let Some(first) = seen.insert(&param.name.name, param.name.span) {
                diagnostics.push(
                    Diagnostic::error(
                        Code::DUPLICATE_NAME,
                        param.name.span,
                        format!("layer parameter `{}` is declared twice", param.name.name),
                    )
                    .with_secondary(first, "first declared here"),
                );
            }
        }
        defs.insert(def.name.name.clone(), def);
    }
    Layers { defs, used: RefCell::new(HashSet::new()) }
}

pub fn warn_unused(file: &SourceFile, layers: &Layers, diagnostics: &mut Vec<Diagnostic>) {
    let used = layers.used.borrow();
    for item in &file.items {
        if let Item::Layer(def) = item {
            if !used.contains(&def.name.name) && layers.get(&def.name.name).is_some_and(|d| std::ptr::eq(d, def)) {
                diagnostics.push(
                    Diagnostic::warning(
                        Code::UNUSED,
                        def.name.span,
                        format!("layer `{}` is never used", def.name.name),
                    )
                    .with_help("a layer is checked where it is called; call it from a model or remove it"),
                );
            }
        }
    }
}

/// How many layer calls an expression makes: one call takes the `let`'s name as its scope,
/// several get a scope each beneath it.
pub fn count_layer_calls(expr: &Expr, layers: &Layers) -> usize {
    match &expr.kind {
        ExprKind::Call(call) => {
            let own = usize::from(layers.get(&call.callee.name).is_some());
            own + call.args.iter().map(|a| count_layer_calls(&a.value, layers)).sum::<usize>()
        }
        ExprKind::Array(items) => items.iter().map(|e| count_layer_calls(e, layers)).sum(),
        ExprKind::Unary(_, e) => count_layer_calls(e, layers),
        ExprKind::Binary(_, a, b) => count_layer_calls(a, layers) + count_layer_calls(b, layers),
        _ => 0,
    }
}

impl Lowerer<'_> {
    pub fn call_layer(&mut self, def: &LayerDef, call: &Call, span: Span) -> Val {
        self.layers.used.borrow_mut().insert(def.name.name.clone());
        if self.layer_stack.contains(&def.name.name) {
            self.diagnostics.push(
                Diagnostic::error(
                    Code::RECURSIVE_LAYER,
                    call.callee.span,
                    format!("layer `{}` calls itself", def.name.name),
                )
                .with_secondary(def.name.span, "defined here")
                .with_help("layers are expanded at compile time, so they cannot recurse"),
            );
            return Val::Error;
        }
        if let Some((_, type_span)) = call.type_arg {
            self.diagnostics.push(Diagnostic::error(Code::ARGUMENT_KIND, type_span, "layers take no type argument"));
        }
        if self.layer_stack.len() >= MAX_LAYER_DEPTH {
            self.diagnostics.push(
                Diagnostic::error(
                    Code::LAYERS_TOO_DEEP,
                    call.callee.span,
                    format!("layers are nested more than {MAX_LAYER_DEPTH} deep here"),
                )
                .with_help(format!("this call is inside {}", self.layer_stack.join(" → "))),
            );
            return self.eval_args_for_errors(call);
        }
        let params: Vec<Param> =
            def.params.iter().map(|p| Param { name: &p.name.name, required: p.default.is_none() }).collect();
        let Some(bound) = args::bind(&def.name.name, span, &params, &call.args, &mut self.diagnostics) else {
            return self.eval_args_for_errors(call);
        };

        // Given arguments are evaluated in the caller's scope.
        let mut given_sizes: Vec<(&str, i64, Span)> = Vec::new();
        let mut tensors = Vec::new();
        let mut ok = true;
        for (param, arg) in def.params.iter().zip(&bound) {
            let Some(arg) = arg else { continue };
            let expr = &arg.value;
            match &param.kind {
                LayerParamKind::Dim => match self.const_int(expr, &format!("layer argument `{}`", param.name.name)) {
                    Some(v) => given_sizes.push((&param.name.name, v, expr.span)),
                    None => ok = false,
                },
                LayerParamKind::Tensor(ty) => {
                    let value = self.eval(expr);
                    match self.make_tensor(value, expr.span, Some(crate::eval::dtype_of(ty.dtype))) {
                        Some(t) => tensors.push((param, t, expr.span)),
                        None => ok = false,
                    }
                }
            }
        }
        if !ok {
            call.args.iter().for_each(|a| self.mark_used(&a.value));
            return Val::Error;
        }

        // Everything else happens in the instance's own scope: defaults, shapes, the body.
        let instance = self.instance_prefix(&def.name.name);
        let saved_scope = std::mem::take(&mut self.scope);
        let saved_prefix = std::mem::replace(&mut self.prefix, instance);
        let saved_hint = std::mem::take(&mut self.hint);
        let saved_calls = std::mem::replace(&mut self.let_layer_calls, 0);
        self.layer_stack.push(def.name.name.clone());
        let result = self.instantiate(def, &bound, given_sizes, tensors, span);
        self.layer_stack.pop();
        self.scope = saved_scope;
        self.prefix = saved_prefix;
        self.hint = saved_hint;
        self.let_layer_calls = saved_calls;
        result
    }

    /// The body of `call_layer` inside the instance's scope: defaults (which may use sizes bound
    /// so far), unification of tensor arguments with parameter shapes, the body, the result.
    fn instantiate<'d>(
        &mut self,
        def: &'d LayerDef,
        bound: &[Option<&dfc_syntax::ast::Arg>],
        given_sizes: Vec<(&str, i64, Span)>,
        mut tensors: Vec<(&'d dfc_syntax::ast::LayerParam, dfc_ir::TensorRef, Span)>,
        span: Span,
    ) -> Val {
        let mut sizes: HashMap<String, (i64, Span)> = HashMap::new();
        for (name, value, at) in given_sizes {
            sizes.insert(name.to_string(), (value, at));
            self.define_size(def, name, value);
        }
        // Unification: names in parameter shapes bind to the arguments' sizes. Given tensors
        // first, then tensor defaults, which may use the sizes bound so far.
        let mut deferred = Vec::new();
        let mut ok = true;
        for (param, tensor, arg_span) in &tensors {
            ok &= self.unify(def, param, *tensor, *arg_span, &mut sizes, &mut deferred);
        }
        if !ok {
            return Val::Error;
        }
        // `dim` parameters left to their defaults, unless unification bound them; then tensor
        // defaults, which may use every size.
        for (param, arg) in def.params.iter().zip(bound) {
            if let (None, LayerParamKind::Dim, Some(default)) = (arg, &param.kind, &param.default) {
                if sizes.contains_key(&param.name.name) {
                    continue;
                }
                match self.const_int(default, &format!("the default of `{}`", param.name.name)) {
                    Some(v) => {
                        sizes.insert(param.name.name.clone(), (v, default.span));
                        self.define_size(def, &param.name.name, v);
                    }
                    None => ok = false,
                }
            }
        }
        for (param, arg) in def.params.iter().zip(bound) {
            if let (None, LayerParamKind::Tensor(ty), Some(default)) = (arg, &param.kind, &param.default) {
                let value = self.eval(default);
                match self.make_tensor(value, default.span, Some(crate::eval::dtype_of(ty.dtype))) {
                    Some(t) => {
                        ok &= self.unify(def, param, t, default.span, &mut sizes, &mut deferred);
                        tensors.push((param, t, default.span));
                    }
                    None => ok = false,
                }
            }
        }
        if !ok {
            return Val::Error;
        }

        for (expr, size, axis, arg_span, param_name) in deferred {
            if let Some(expected) = self.const_int(expr, "a size in a layer parameter") {
                if expected != size {
                    self.diagnostics.push(
                        Diagnostic::error(Code::LAYER_UNIFICATION, arg_span, format!("argument `{param_name}` of `{}` has size {size} on axis {axis}, but the layer needs {expected}", def.name.name))
                            .with_label(format!("axis {axis} is {size}"))
                            .with_secondary(expr.span, format!("this is {expected}")),
                    );
                    ok = false;
                }
            } else {
                ok = false;
            }
        }
        if !ok {
            return Val::Error;
        }
        for (param, tensor, _) in &tensors {
            self.define(&param.name, Val::Tensor(*tensor), BindingKind::LayerArgument);
        }

        let mut state = BlockState::new(Context::Layer);
        self.block(&def.body, &mut state);
        let Some((mut result, _)) = state.returned.take() else {
            self.diagnostics.push(
                Diagnostic::error(
                    Code::LAYER_WITHOUT_RETURN,
                    def.name.span,
                    format!("layer `{}` returns nothing", def.name.name),
                )
                .with_help("end the layer with `return EXPRESSION`"),
            );
            return Val::Error;
        };
        if let (Some(declared), Val::Tensor(t)) = (&def.return_type, &result) {
            if let Some(expected) = self.resolve_type(declared) {
                let actual = self.graph.ty(*t).clone();
                if actual != expected {
                    self.diagnostics.push(
                        Diagnostic::error(
                            Code::ANNOTATION_MISMATCH,
                            span,
                            format!("layer `{}` returns {actual}, but declares {expected}", def.name.name),
                        )
                        .with_secondary(declared.span, "return type declared here"),
                    );
                    result = Val::Error;
                }
            }
        }
        result
    }

    /// Matches one tensor argument against its parameter's declared type, binding shape names
    /// to sizes; compound size expressions are checked later (`deferred`).
    fn unify<'e>(
        &mut self,
        def: &LayerDef,
        param: &'e dfc_syntax::ast::LayerParam,
        tensor: dfc_ir::TensorRef,
        arg_span: Span,
        sizes: &mut HashMap<String, (i64, Span)>,
        deferred: &mut Vec<(&'e Expr, i64, usize, Span, String)>,
    ) -> bool {
        let LayerParamKind::Tensor(declared) = &param.kind else { return true };
        let actual = self.graph.ty(tensor).clone();
        let declared_text = describe_type(declared);
        let mismatch = |reason: String| {
            Diagnostic::error(
                Code::LAYER_UNIFICATION,
                arg_span,
                format!(
                    "argument `{}` of `{}` is {actual}, but the layer takes {declared_text}",
                    param.name.name, def.name.name
                ),
            )
            .with_label(reason)
            .with_secondary(declared.span, "parameter type declared here")
        };
        if crate::eval::dtype_of(declared.dtype) != actual.dtype {
            self.diagnostics.push(mismatch(format!(
                "element type {} is not {}",
                actual.dtype,
                crate::eval::dtype_of(declared.dtype)
            )));
            return false;
        }
        if declared.shape.len() != actual.shape.rank() {
            self.diagnostics.push(mismatch(format!("rank {} is not {}", actual.shape.rank(), declared.shape.len())));
            return false;
        }
        let mut ok = true;
        for (axis, (expr, &size)) in declared.shape.iter().zip(actual.shape.dims()).enumerate() {
            let size = size as i64;
            match &expr.kind {
                ExprKind::Name(name) => match sizes.get(&name.name) {
                    Some(&(bound_size, bound_span)) if bound_size != size => {
                        self.diagnostics.push(
                            mismatch(format!("axis {axis} is {size}, but `{}` is {bound_size}", name.name))
                                .with_secondary(bound_span, format!("`{}` = {bound_size} from here", name.name)),
                        );
                        ok = false;
                    }
                    Some(_) => {}
                    None => {
                        sizes.insert(name.name.clone(), (size, arg_span));
                        self.define_size(def, &name.name, size);
                    }
                },
                ExprKind::Int(expected) if *expected != size => {
                    self.diagnostics.push(mismatch(format!("axis {axis} is {size}, not {expected}")));
                    ok = false;
                }
                ExprKind::Int(_) => {}
                _ => deferred.push((expr, size, axis, arg_span, param.name.name.clone())),
            }
        }
        ok
    }

    /// A size bound in a layer instance, visible to its shapes and body.
    fn define_size(&mut self, def: &LayerDef, name: &str, value: i64) {
        if self.scope.bindings.contains_key(name) {
            return;
        }
        let ident = dfc_syntax::ast::Ident { name: name.to_string(), span: size_name_span(def, name) };
        self.define(&ident, Val::Number(Number::Int(value)), BindingKind::LayerArgument);
    }

    /// `h1/` for the only layer call of `let h1 = ...`; `h1/dense/`, `h1/dense_1/` for several;
    /// `dense/`, `dense_1/` outside a `let`.
    fn instance_prefix(&mut self, layer: &str) -> String {
        let base = if self.let_layer_calls == 1 && !self.hint.is_empty() {
            format!("{}{}", self.prefix, self.hint)
        } else if !self.hint.is_empty() {
            format!("{}{}/{layer}", self.prefix, self.hint)
        } else {
            format!("{}{layer}", self.prefix)
        };
        let mut name = base.clone();
        let mut i = 1;
        while !self.layer_instances.insert(name.clone()) {
            name = format!("{base}_{i}");
            i += 1;
        }
        format!("{name}/")
    }
}

fn describe_type(ty: &dfc_syntax::ast::TensorType) -> String {
    let dims: Vec<String> = ty
        .shape
        .iter()
        .map(|e| match &e.kind {
            ExprKind::Name(n) => n.name.clone(),
            ExprKind::Int(v) => v.to_string(),
            _ => "…".into(),
        })
        .collect();
    format!("{}[{}]", crate::eval::dtype_of(ty.dtype), dims.join(", "))
}

/// Where a size name of a layer is introduced: its `dim` parameter, or its first use in a
/// parameter's shape (`n` in `x: f32[n, k]`); the layer's name if neither.
fn size_name_span(def: &LayerDef, name: &str) -> Span {
    let in_shapes = def.params.iter().find_map(|param| match &param.kind {
        LayerParamKind::Dim => (param.name.name == name).then_some(param.name.span),
        LayerParamKind::Tensor(ty) => ty.shape.iter().find_map(|size| match &size.kind {
            dfc_syntax::ast::ExprKind::Name(ident) if ident.name == name => Some(ident.span),
            _ => None,
        }),
    });
    in_shapes.unwrap_or(def.name.span)
}
