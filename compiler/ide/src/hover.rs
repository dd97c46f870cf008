//! Hover: what a name or expression is — its dtype and shape as analysis found them, a param's
//! initializer and device, an op's signature and documentation.

use crate::resolve::{DefKind, Target};
use crate::FileAnalysis;
use dfc_diag::Span;
use dfc_syntax::ast::{Item, Stmt, StmtKind};

#[derive(Clone, Debug, PartialEq)]
pub struct Hover {
    /// The text hovered: the name, or the expression.
    pub span: Span,
    /// Markdown: a `dfc` code block, then prose.
    pub markdown: String,
}

pub fn hover(analysis: &FileAnalysis, offset: usize) -> Option<Hover> {
    let names = &analysis.names;
    if let Some(def) = names.def_at(offset) {
        return Some(Hover { span: names.defs[def].span, markdown: describe(analysis, def) });
    }
    if let Some(found) = names.use_at(offset) {
        match found.target {
            Target::Def(def) => return Some(Hover { span: found.span, markdown: describe(analysis, def) }),
            Target::Builtin => return builtin(&found.name).map(|markdown| Hover { span: found.span, markdown }),
            Target::Unresolved => {}
        }
    }
    let (span, types) = analysis.expression_at(offset)?;
    Some(Hover { span, markdown: code_block(types.iter().map(String::as_str)) })
}

/// A built-in op, optimizer, learning-rate schedule or initializer: its signature and its line
/// of documentation.
pub fn builtin(name: &str) -> Option<String> {
    let tables = [
        ("op", dfc_sema::OPS),
        ("optimizer", dfc_sema::OPTIMIZERS),
        ("learning-rate schedule", dfc_sema::SCHEDULES),
        ("initializer", dfc_sema::INITIALIZERS),
    ];
    tables.iter().find_map(|(what, table)| {
        let (_, signature, doc) = table.iter().find(|(n, _, _)| *n == name)?;
        Some(format!("{}\nBuilt-in {what}: {doc}", code_block([*signature])))
    })
}

fn code_block<'a>(lines: impl IntoIterator<Item = &'a str>) -> String {
    let lines: Vec<&str> = lines.into_iter().collect();
    format!("```dfc\n{}\n```", lines.join("\n"))
}

fn describe(analysis: &FileAnalysis, def: usize) -> String {
    let names = &analysis.names;
    let d = &names.defs[def];
    let types = analysis.types_at(d.span);
    let owner = d.owner.map(|o| &names.defs[o]);
    let in_layer = owner.filter(|o| o.kind == DefKind::Layer);
    let mut prose = Vec::new();
    let lines: Vec<String> = match d.kind {
        DefKind::Model | DefKind::Layer => {
            let text = analysis.text(d.full_span);
            let header = text.split('{').next().unwrap_or(text).split_whitespace().collect::<Vec<_>>().join(" ");
            if d.kind == DefKind::Layer {
                let calls = names.uses.iter().filter(|u| u.called && u.target == Target::Def(def)).count();
                prose.push(match calls {
                    0 => "Not called in this file.".to_string(),
                    1 => "Called once in this file.".to_string(),
                    n => format!("Called {n} times in this file."),
                });
            } else {
                let count = |kind| names.defs.iter().filter(|x| x.owner == Some(def) && x.kind == kind).count();
                prose.push(format!(
                    "{} input(s), {} param(s), {} let(s).",
                    count(DefKind::Input),
                    count(DefKind::Param),
                    count(DefKind::Let)
                ));
            }
            vec![header]
        }
        DefKind::LayerParam | DefKind::SizeName => {
            let declared = match d.kind {
                DefKind::LayerParam => analysis.text(d.full_span).to_string(),
                _ => format!("{}: dim", d.name),
            };
            if types.is_empty() {
                vec![declared]
            } else {
                prose.push(format!("Declared `{declared}`."));
                types.iter().map(|t| format!("{}: {t}", d.name)).collect()
            }
        }
        DefKind::OutputAlias => vec![format!("output {}", analysis.text(d.full_span))],
        kind => {
            let keyword = kind.word();
            let stmt = find_stmt(analysis, d.span);
            let declared = stmt.and_then(|(stmt, _)| declared_type(stmt)).map(|span| analysis.text(span).to_string());
            if let Some((stmt, device)) = stmt {
                if let StmtKind::Param { init, .. } = &stmt.kind {
                    let init = init.as_ref().map(|e| analysis.text(e.span)).unwrap_or("none (an error)");
                    prose.push(format!("Initializer: `{init}`."));
                    let attribute = stmt.attrs.iter().find(|a| a.name.name == "device").map(|a| a.span);
                    let device = attribute.or(device).map(|span| analysis.text(span).to_string());
                    prose.push(match device {
                        Some(device) => format!("Device: `{device}`."),
                        None => "Device: chosen by placement.".to_string(),
                    });
                    if let Some(part) = stmt.attrs.iter().find(|a| a.name.name == "partitioned") {
                        prose.push(format!("Partitioned: `{}`.", analysis.text(part.span)));
                    }
                }
            }
            let separator = if kind == DefKind::Dim { " = " } else { ": " };
            match (types.is_empty(), declared) {
                (false, _) => types.iter().map(|t| format!("{keyword} {}{separator}{t}", d.name)).collect(),
                (true, Some(declared)) => vec![format!("{keyword} {}{separator}{declared}", d.name)],
                (true, None) => vec![format!("{keyword} {}", d.name)],
            }
        }
    };
    if let Some(layer) = in_layer {
        if lines.len() > 1 {
            prose.push(format!("One line per distinct call of `{}`.", layer.name));
        } else if types.is_empty() && d.kind != DefKind::LayerParam {
            prose.push(format!("Its type depends on the call of `{}`; none analysed.", layer.name));
        }
    }
    let mut markdown = code_block(lines.iter().map(String::as_str));
    for line in prose {
        markdown.push('\n');
        markdown.push_str(&line);
    }
    markdown
}

/// The statement that defines the name at `name_span`, and the device of the innermost
/// `device` block around it (the span of its string).
fn find_stmt(analysis: &FileAnalysis, name_span: Span) -> Option<(&Stmt, Option<Span>)> {
    fn search(stmts: &[Stmt], name_span: Span, device: Option<Span>) -> Option<(&Stmt, Option<Span>)> {
        stmts.iter().find_map(|stmt| match &stmt.kind {
            StmtKind::Device { spec, body } => search(body, name_span, Some(spec.span)),
            StmtKind::Dim { name, .. }
            | StmtKind::Input { name, .. }
            | StmtKind::Param { name, .. }
            | StmtKind::Const { name, .. }
            | StmtKind::Let { name, .. }
            | StmtKind::Metric { name, .. }
                if name.span == name_span =>
            {
                Some((stmt, device))
            }
            _ => None,
        })
    }
    analysis.file.items.iter().find_map(|item| match item {
        Item::Model(model) => search(&model.body, name_span, None),
        Item::Layer(layer) => search(&layer.body, name_span, None),
    })
}

fn declared_type(stmt: &Stmt) -> Option<Span> {
    match &stmt.kind {
        StmtKind::Input { ty, .. } | StmtKind::Param { ty, .. } => Some(ty.span),
        StmtKind::Const { ty, .. } | StmtKind::Let { ty, .. } => ty.as_ref().map(|t| t.span),
        StmtKind::Dim { value, .. } => value.as_ref().map(|v| v.span),
        _ => None,
    }
}
