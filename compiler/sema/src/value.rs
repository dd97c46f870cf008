//! What an expression evaluates to during analysis.

use dfc_ir::TensorRef;

#[derive(Clone, Debug, PartialEq)]
pub enum Val {
    /// A value of the graph.
    Tensor(TensorRef),
    /// A literal or compile-time number (literals, dims, folded arithmetic). It takes the
    /// element type of the tensor it meets, like JAX's weakly typed scalars.
    Number(Number),
    /// `[a, b, c]`: a shape, a list of axes, a constant, or tensors for `concat`.
    List(Vec<Val>),
    Str(String),
    /// The result of an expression that already failed and was reported.
    Error,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Number {
    Int(i64),
    Float(f64),
    Bool(bool),
}

impl Number {
    pub fn as_f64(self) -> f64 {
        match self {
            Number::Int(v) => v as f64,
            Number::Float(v) => v,
            Number::Bool(v) => f64::from(u8::from(v)),
        }
    }
}

impl std::fmt::Display for Number {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Number::Int(v) => write!(f, "{v}"),
            Number::Float(v) => write!(f, "{v:?}"),
            Number::Bool(v) => write!(f, "{v}"),
        }
    }
}

impl Val {
    /// Words for "expected X, found <describe>".
    pub fn describe(&self, graph: &dfc_ir::Graph) -> String {
        match self {
            Val::Tensor(t) => format!("a tensor {}", graph.ty(*t)),
            Val::Number(n) => format!("the number {n}"),
            Val::List(items) if items.len() == 1 => "a list of 1 item".into(),
            Val::List(items) => format!("a list of {} items", items.len()),
            Val::Str(s) => format!("the string \"{s}\""),
            Val::Error => "an erroneous value".into(),
        }
    }

    /// The type as an editor shows it on hover: `f32[128, 784]`, `128` (a number), `[1, 2]`;
    /// `None` for errors.
    pub fn type_text(&self, graph: &dfc_ir::Graph) -> Option<String> {
        Some(match self {
            Val::Tensor(t) => {
                // As written in source (`f32[128, 784]`), not as in IR text.
                let ty = graph.ty(*t);
                let dims: Vec<String> = ty.shape.dims().iter().map(|d| d.to_string()).collect();
                if dims.is_empty() {
                    ty.dtype.to_string()
                } else {
                    format!("{}[{}]", ty.dtype, dims.join(", "))
                }
            }
            Val::Number(n) => n.to_string(),
            Val::List(items) => {
                let items: Option<Vec<String>> = items.iter().map(|item| item.type_text(graph)).collect();
                format!("[{}]", items?.join(", "))
            }
            Val::Str(s) => format!("\"{s}\""),
            Val::Error => return None,
        })
    }
}
