//! A normalised text form of the AST, for parser golden tests: one statement per line,
//! every operator application parenthesised so that precedence is visible.

use crate::ast::*;
use std::fmt::Write;

pub fn dump(file: &SourceFile) -> String {
    let mut out = String::new();
    for item in &file.items {
        match item {
            Item::Model(model) => {
                let _ = writeln!(out, "model {} {{", model.name.name);
                block(&mut out, &model.body, 1);
                out.push_str("}\n");
            }
            Item::Layer(layer) => {
                let params: Vec<String> = layer
                    .params
                    .iter()
                    .map(|p| {
                        let kind = match &p.kind {
                            LayerParamKind::Dim => "dim".to_string(),
                            LayerParamKind::Tensor(ty) => tensor_type(ty),
                        };
                        match &p.default {
                            Some(d) => format!("{}: {kind} = {}", p.name.name, expr(d)),
                            None => format!("{}: {kind}", p.name.name),
                        }
                    })
                    .collect();
                let ret = layer.return_type.as_ref().map(|t| format!(" -> {}", tensor_type(t))).unwrap_or_default();
                let _ = writeln!(out, "layer {}({}){ret} {{", layer.name.name, params.join(", "));
                block(&mut out, &layer.body, 1);
                out.push_str("}\n");
            }
        }
    }
    out
}

fn block(out: &mut String, stmts: &[Stmt], depth: usize) {
    let indent = "    ".repeat(depth);
    for stmt in stmts {
        out.push_str(&indent);
        for attr in &stmt.attrs {
            let _ = write!(out, "@{}({}) ", attr.name.name, args(&attr.args));
        }
        let annotated =
            |ty: &Option<TensorType>| ty.as_ref().map(|t| format!(": {}", tensor_type(t))).unwrap_or_default();
        match &stmt.kind {
            StmtKind::Dim { name, value: Some(v) } => {
                let _ = writeln!(out, "dim {} = {}", name.name, expr(v));
            }
            StmtKind::Dim { name, value: None } => {
                let _ = writeln!(out, "dim {}", name.name);
            }
            StmtKind::Input { name, ty } => {
                let _ = writeln!(out, "input {}: {}", name.name, tensor_type(ty));
            }
            StmtKind::Param { name, ty, init } => {
                let init = init.as_ref().map(|e| format!(" = {}", expr(e))).unwrap_or_default();
                let _ = writeln!(out, "param {}: {}{init}", name.name, tensor_type(ty));
            }
            StmtKind::Const { name, ty, value } => {
                let _ = writeln!(out, "const {}{} = {}", name.name, annotated(ty), expr(value));
            }
            StmtKind::Let { name, ty, value } => {
                let _ = writeln!(out, "let {}{} = {}", name.name, annotated(ty), expr(value));
            }
            StmtKind::Output { items } => {
                let items: Vec<String> = items
                    .iter()
                    .map(|i| match &i.alias {
                        Some(a) => format!("{} as {}", expr(&i.value), a.name),
                        None => expr(&i.value),
                    })
                    .collect();
                let _ = writeln!(out, "output {}", items.join(", "));
            }
            StmtKind::Metric { name, value } => {
                let _ = writeln!(out, "metric {} = {}", name.name, expr(value));
            }
            StmtKind::Minimize { loss, optimizer } => {
                let _ = writeln!(out, "minimize {} with {}", expr(loss), call(optimizer));
            }
            StmtKind::Device { spec, body } => {
                let _ = writeln!(out, "device {:?} {{", spec.value);
                block(out, body, depth + 1);
                let _ = writeln!(out, "{indent}}}");
            }
            StmtKind::Return { value } => {
                let _ = writeln!(out, "return {}", expr(value));
            }
            StmtKind::Invalid { name } => {
                let _ = writeln!(
                    out,
                    "<invalid{}>",
                    name.as_ref().map(|n| format!(" defining {}", n.name)).unwrap_or_default()
                );
            }
        }
    }
}

fn tensor_type(ty: &TensorType) -> String {
    let dims: Vec<String> = ty.shape.iter().map(expr).collect();
    format!("{}[{}]", dtype(ty.dtype), dims.join(", "))
}

fn dtype(d: DTypeName) -> &'static str {
    match d {
        DTypeName::F32 => "f32",
        DTypeName::F64 => "f64",
        DTypeName::I32 => "i32",
        DTypeName::I64 => "i64",
        DTypeName::U8 => "u8",
        DTypeName::Bool => "bool",
    }
}

fn args(args: &[Arg]) -> String {
    let items: Vec<String> = args
        .iter()
        .map(|a| match &a.name {
            Some(n) => format!("{}={}", n.name, expr(&a.value)),
            None => expr(&a.value),
        })
        .collect();
    items.join(", ")
}

fn call(c: &Call) -> String {
    let type_arg = c.type_arg.map(|(d, _)| format!("<{}>", dtype(d))).unwrap_or_default();
    format!("{}{type_arg}({})", c.callee.name, args(&c.args))
}

pub fn expr(e: &Expr) -> String {
    match &e.kind {
        ExprKind::Int(v) => v.to_string(),
        ExprKind::Float(v) => format!("{v:?}"),
        ExprKind::Bool(v) => v.to_string(),
        ExprKind::Str(s) => format!("{s:?}"),
        ExprKind::Name(n) => n.name.clone(),
        ExprKind::Array(items) => format!("[{}]", items.iter().map(expr).collect::<Vec<_>>().join(", ")),
        ExprKind::Call(c) => call(c),
        ExprKind::Unary(UnaryOp::Neg, x) => format!("(-{})", expr(x)),
        ExprKind::Binary(op, a, b) => format!("({} {} {})", expr(a), op.symbol(), expr(b)),
    }
}
