//! The abstract syntax tree of a `.df` file. Every node carries the span of the text it came
//! from; semantic analysis reports errors at these spans.

use dfc_diag::Span;

#[derive(Clone, Debug, Default, PartialEq)]
pub struct SourceFile {
    pub items: Vec<Item>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Item {
    Model(Model),
    Layer(LayerDef),
}

#[derive(Clone, Debug, PartialEq)]
pub struct Ident {
    pub name: String,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Model {
    pub name: Ident,
    pub body: Vec<Stmt>,
    pub span: Span,
}

/// `layer dense(x: f32[n, k], units: dim) -> f32[n, units] { ... }`
#[derive(Clone, Debug, PartialEq)]
pub struct LayerDef {
    pub name: Ident,
    pub params: Vec<LayerParam>,
    pub return_type: Option<TensorType>,
    pub body: Vec<Stmt>,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq)]
pub struct LayerParam {
    pub name: Ident,
    pub kind: LayerParamKind,
    pub default: Option<Expr>,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq)]
pub enum LayerParamKind {
    /// An integer size, usable in shapes inside the layer.
    Dim,
    /// A tensor; names in its shape that are not otherwise bound are bound by unification.
    Tensor(TensorType),
}

/// `@device("/job:ps/task:0")`, `@partitioned(3)`.
#[derive(Clone, Debug, PartialEq)]
pub struct Attribute {
    pub name: Ident,
    pub args: Vec<Arg>,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Stmt {
    pub attrs: Vec<Attribute>,
    pub kind: StmtKind,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq)]
pub enum StmtKind {
    Dim {
        name: Ident,
        value: Option<Expr>,
    },
    Input {
        name: Ident,
        ty: TensorType,
    },
    Param {
        name: Ident,
        ty: TensorType,
        init: Option<Expr>,
    },
    Const {
        name: Ident,
        ty: Option<TensorType>,
        value: Expr,
    },
    Let {
        name: Ident,
        ty: Option<TensorType>,
        value: Expr,
    },
    Output {
        items: Vec<OutputItem>,
    },
    /// `metric accuracy = mean(...)`: a scalar averaged over evaluation data.
    Metric {
        name: Ident,
        value: Expr,
    },
    Minimize {
        loss: Expr,
        optimizer: Call,
    },
    Device {
        spec: StrLit,
        body: Vec<Stmt>,
    },
    Return {
        value: Expr,
    },
    /// A statement that did not parse (already reported). If it began `let NAME`, `param NAME`
    /// and so on, `name` holds NAME, so that later uses of it are not reported as undefined.
    Invalid {
        name: Option<Ident>,
    },
}

impl StmtKind {
    /// The keyword that starts the statement, for messages.
    pub fn keyword(&self) -> &'static str {
        match self {
            StmtKind::Dim { .. } => "dim",
            StmtKind::Input { .. } => "input",
            StmtKind::Param { .. } => "param",
            StmtKind::Const { .. } => "const",
            StmtKind::Let { .. } => "let",
            StmtKind::Output { .. } => "output",
            StmtKind::Metric { .. } => "metric",
            StmtKind::Minimize { .. } => "minimize",
            StmtKind::Device { .. } => "device",
            StmtKind::Return { .. } => "return",
            StmtKind::Invalid { .. } => "statement",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct OutputItem {
    pub value: Expr,
    pub alias: Option<Ident>,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq)]
pub struct StrLit {
    pub value: String,
    pub span: Span,
}

/// `f32[batch, 784]`; `shape` is `None` for a bare `f32` (a scalar).
#[derive(Clone, Debug, PartialEq)]
pub struct TensorType {
    pub dtype: DTypeName,
    pub dtype_span: Span,
    pub shape: Vec<Expr>,
    pub span: Span,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DTypeName {
    F32,
    F64,
    I32,
    I64,
    U8,
    Bool,
}

impl DTypeName {
    pub fn parse(text: &str) -> Option<DTypeName> {
        Some(match text {
            "f32" => DTypeName::F32,
            "f64" => DTypeName::F64,
            "i32" => DTypeName::I32,
            "i64" => DTypeName::I64,
            "u8" => DTypeName::U8,
            "bool" => DTypeName::Bool,
            _ => return None,
        })
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Expr {
    pub kind: ExprKind,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq)]
pub enum ExprKind {
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    Name(Ident),
    Array(Vec<Expr>),
    Call(Call),
    Unary(UnaryOp, Box<Expr>),
    Binary(BinaryOp, Box<Expr>, Box<Expr>),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnaryOp {
    Neg,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    MatMul,
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

impl BinaryOp {
    pub fn symbol(self) -> &'static str {
        match self {
            BinaryOp::Add => "+",
            BinaryOp::Sub => "-",
            BinaryOp::Mul => "*",
            BinaryOp::Div => "/",
            BinaryOp::MatMul => "@",
            BinaryOp::Eq => "==",
            BinaryOp::Ne => "!=",
            BinaryOp::Lt => "<",
            BinaryOp::Le => "<=",
            BinaryOp::Gt => ">",
            BinaryOp::Ge => ">=",
        }
    }
}

/// `name<dtype>(args)`; the type argument is only meaningful for `cast`.
#[derive(Clone, Debug, PartialEq)]
pub struct Call {
    pub callee: Ident,
    pub type_arg: Option<(DTypeName, Span)>,
    pub args: Vec<Arg>,
    pub span: Span,
}

/// A positional (`name` is `None`) or keyword argument.
#[derive(Clone, Debug, PartialEq)]
pub struct Arg {
    pub name: Option<Ident>,
    pub value: Expr,
    pub span: Span,
}
