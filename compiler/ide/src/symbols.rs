//! The outline of a file: models and layers, each with the names it defines.

use crate::resolve::DefKind;
use crate::FileAnalysis;
use dfc_diag::Span;

#[derive(Clone, Debug, PartialEq)]
pub struct Symbol {
    pub name: String,
    pub kind: DefKind,
    /// The type analysis found, or the declaration's own text.
    pub detail: Option<String>,
    /// The whole definition.
    pub span: Span,
    /// The name.
    pub selection: Span,
    pub children: Vec<Symbol>,
}

pub fn symbols(analysis: &FileAnalysis) -> Vec<Symbol> {
    let defs = &analysis.names.defs;
    let symbol = |index: usize| {
        let def = &defs[index];
        let detail = analysis.types_at(def.span).first().cloned().or_else(|| match def.kind {
            DefKind::LayerParam => Some(analysis.text(def.full_span).to_string()),
            _ => None,
        });
        Symbol {
            name: def.name.clone(),
            kind: def.kind,
            detail,
            // The editor wants the name inside the whole: keep it so even for odd trees.
            span: def.full_span.to(def.span),
            selection: def.span,
            children: Vec::new(),
        }
    };
    (0..defs.len())
        .filter(|&i| defs[i].owner.is_none())
        .map(|item| {
            let mut parent = symbol(item);
            parent.children = (0..defs.len()).filter(|&i| defs[i].owner == Some(item)).map(symbol).collect();
            parent
        })
        .collect()
}
