//! Expressions: names, literals, operators, and the constant evaluation that shapes, axes and
//! hyper-parameters need.

use crate::lower::Lowerer;
use crate::value::{Number, Val};
use dfc_diag::{article, Code, Diagnostic, Span};
use dfc_ir::{BinaryOp, CompareOp, ConstValue, DType, Op, Shape, TensorRef, UnaryOp};
use dfc_syntax::ast::{self, Expr, ExprKind};

/// The largest tensor analysis accepts: 2^40 elements (4 TiB of f32).
pub const MAX_TENSOR_ELEMENTS: usize = 1 << 40;
/// The largest constant: constants travel inside the plan.
pub const MAX_CONSTANT_ELEMENTS: usize = 1 << 24;

impl Lowerer<'_> {
    /// Evaluates an expression, noting its type for editors (`Lowerer::types`).
    pub fn eval(&mut self, expr: &Expr) -> Val {
        let value = self.eval_uncounted(expr);
        self.note_type(expr.span, &value);
        value
    }

    /// Notes what the text at `span` evaluated to; errors are not noted.
    pub fn note_type(&mut self, span: Span, value: &Val) {
        if let Some(text) = value.type_text(&self.graph) {
            self.types.push((span, text));
        }
    }

    fn eval_uncounted(&mut self, expr: &Expr) -> Val {
        match &expr.kind {
            ExprKind::Int(v) => Val::Number(Number::Int(*v)),
            ExprKind::Float(v) => Val::Number(Number::Float(*v)),
            ExprKind::Bool(v) => Val::Number(Number::Bool(*v)),
            ExprKind::Str(s) => Val::Str(s.clone()),
            ExprKind::Name(ident) => self.lookup(ident),
            ExprKind::Array(items) => Val::List(items.iter().map(|e| self.eval(e)).collect()),
            ExprKind::Call(call) => self.call(call, expr.span),
            ExprKind::Unary(ast::UnaryOp::Neg, operand) => {
                let value = self.eval(operand);
                match value {
                    Val::Number(Number::Int(v)) => Val::Number(Number::Int(v.wrapping_neg())),
                    Val::Number(Number::Float(v)) => Val::Number(Number::Float(-v)),
                    Val::Number(Number::Bool(_)) => {
                        self.diagnostics.push(
                            Diagnostic::error(Code::DTYPE_MISMATCH, expr.span, "`-` is not defined on true and false")
                                .with_help("booleans can only be compared with == and !="),
                        );
                        Val::Error
                    }
                    Val::Tensor(t) => self.node(Op::Unary(UnaryOp::Neg), &[(t, operand.span)], expr.span),
                    Val::Error => Val::Error,
                    other => self.wrong_kind(operand.span, "a number or tensor to negate", &other),
                }
            }
            ExprKind::Binary(op, lhs, rhs) => {
                let a = self.eval(lhs);
                let b = self.eval(rhs);
                self.binary(*op, (a, lhs.span), (b, rhs.span), expr.span)
            }
        }
    }

    /// A binary operator or op on two evaluated operands: folds numbers, gives a number the
    /// element type of the tensor it meets.
    pub fn binary(&mut self, op: ast::BinaryOp, (a, a_span): (Val, Span), (b, b_span): (Val, Span), span: Span) -> Val {
        use ast::BinaryOp as B;
        if a == Val::Error || b == Val::Error {
            return Val::Error;
        }
        if let (Val::Number(x), Val::Number(y)) = (&a, &b) {
            if op != B::MatMul {
                return self.fold(op, *x, *y, span);
            }
        }
        let ir_op = match op {
            B::Add => Op::Binary(BinaryOp::Add),
            B::Sub => Op::Binary(BinaryOp::Sub),
            B::Mul => Op::Binary(BinaryOp::Mul),
            B::Div => Op::Binary(BinaryOp::Div),
            B::MatMul => Op::MatMul { transpose_a: false, transpose_b: false },
            B::Eq => Op::Compare(CompareOp::Equal),
            B::Ne => Op::Compare(CompareOp::NotEqual),
            B::Lt => Op::Compare(CompareOp::Less),
            B::Le => Op::Compare(CompareOp::LessEqual),
            B::Gt => Op::Compare(CompareOp::Greater),
            B::Ge => Op::Compare(CompareOp::GreaterEqual),
        };
        self.binary_op(ir_op, (a, a_span), (b, b_span), span)
    }

    /// Two operands of an elementwise or matrix op; a number takes the other side's dtype.
    pub fn binary_op(&mut self, op: Op, (a, a_span): (Val, Span), (b, b_span): (Val, Span), span: Span) -> Val {
        let a_dtype = self.tensor_dtype(&a);
        let b_dtype = self.tensor_dtype(&b);
        let Some(x) = self.make_tensor(a, a_span, b_dtype) else { return Val::Error };
        let Some(y) = self.make_tensor(b, b_span, a_dtype) else { return Val::Error };
        self.node(op, &[(x, a_span), (y, b_span)], span)
    }

    fn tensor_dtype(&self, value: &Val) -> Option<DType> {
        match value {
            Val::Tensor(t) => Some(self.graph.ty(*t).dtype),
            _ => None,
        }
    }

    fn fold(&mut self, op: ast::BinaryOp, x: Number, y: Number, span: Span) -> Val {
        use ast::BinaryOp as B;
        use Number::{Float, Int};
        let (fx, fy) = (x.as_f64(), y.as_f64());
        let is_bool = matches!(x, Number::Bool(_)) || matches!(y, Number::Bool(_));
        if is_bool && !matches!(op, B::Eq | B::Ne) {
            self.diagnostics.push(
                Diagnostic::error(
                    Code::DTYPE_MISMATCH,
                    span,
                    format!("`{}` is not defined on true and false", op.symbol()),
                )
                .with_help("booleans can only be compared with == and !="),
            );
            return Val::Error;
        }
        let result = match (op, x, y) {
            (B::Add, Int(a), Int(b)) => a.checked_add(b).map(Int),
            (B::Sub, Int(a), Int(b)) => a.checked_sub(b).map(Int),
            (B::Mul, Int(a), Int(b)) => a.checked_mul(b).map(Int),
            (B::Div, _, _) if fy == 0.0 => {
                self.diagnostics.push(
                    Diagnostic::error(Code::BAD_LITERAL, span, "division by zero in a constant expression")
                        .with_label("the divisor is 0"),
                );
                return Val::Error;
            }
            // Integer division stays an integer when exact, so that `784 / 2` is a size.
            (B::Div, Int(a), Int(b)) if a % b == 0 => Some(Int(a / b)),
            (B::Add, ..) => Some(Float(fx + fy)),
            (B::Sub, ..) => Some(Float(fx - fy)),
            (B::Mul, ..) => Some(Float(fx * fy)),
            (B::Div, ..) => Some(Float(fx / fy)),
            (B::Eq, ..) => Some(Number::Bool(fx == fy)),
            (B::Ne, ..) => Some(Number::Bool(fx != fy)),
            (B::Lt, ..) => Some(Number::Bool(fx < fy)),
            (B::Le, ..) => Some(Number::Bool(fx <= fy)),
            (B::Gt, ..) => Some(Number::Bool(fx > fy)),
            (B::Ge, ..) => Some(Number::Bool(fx >= fy)),
            (B::MatMul, ..) => None,
        };
        match result {
            Some(Float(v)) if !v.is_finite() => {
                self.diagnostics.push(Diagnostic::error(Code::BAD_LITERAL, span, "this constant expression overflows"));
                Val::Error
            }
            Some(n) => Val::Number(n),
            None => {
                self.diagnostics.push(
                    Diagnostic::error(Code::BAD_LITERAL, span, "this integer expression overflows 64 bits")
                        .with_help("use smaller sizes"),
                );
                Val::Error
            }
        }
    }

    /// Adds a node, reporting a type error at the expression with each operand's type beside it.
    /// [`Self::node`] for lowering code that builds ops in a row: the op's tensor, with `span`,
    /// or `None` where it failed (its diagnostic is reported).
    pub(crate) fn op_node(&mut self, op: Op, operands: &[(TensorRef, Span)], span: Span) -> Option<(TensorRef, Span)> {
        match self.node(op, operands, span) {
            Val::Tensor(t) => Some((t, span)),
            _ => None,
        }
    }

    pub fn node(&mut self, op: Op, operands: &[(TensorRef, Span)], span: Span) -> Val {
        let inputs: Vec<TensorRef> = operands.iter().map(|(t, _)| *t).collect();
        let name = if self.hint.is_empty() {
            format!("{}{}", self.prefix, op.name())
        } else {
            format!("{}{}/{}", self.prefix, self.hint, op.name())
        };
        match self.graph.add(op, &inputs, &name, Some(span)) {
            Ok(id) => {
                self.request(id);
                let ty = self.graph.node(id).outputs[0].clone();
                if !self.check_size(&ty, span) {
                    return Val::Error;
                }
                Val::Tensor(id.into())
            }
            Err(error) => {
                // Point at the operand to blame, with the types of the operands beside them;
                // labels nested inside the whole expression's span render poorly.
                let blamed =
                    error.operand.filter(|&i| operands.get(i).is_some_and(|(_, s)| !s.is_empty() && *s != span));
                let type_of = |this: &Self, t: TensorRef| this.graph.ty(t).to_string();
                let mut d = match blamed {
                    Some(i) => {
                        let (tensor, operand_span) = operands[i];
                        let mut d = Diagnostic::error(error.code, operand_span, error.message)
                            .with_label(format!("this is {}", type_of(self, tensor)));
                        for (j, (other, other_span)) in operands.iter().enumerate() {
                            if j != i && !other_span.is_empty() && *other_span != span {
                                d = d.with_secondary(*other_span, format!("this is {}", type_of(self, *other)));
                            }
                        }
                        d
                    }
                    None => {
                        let types: Vec<String> = operands.iter().map(|(t, _)| type_of(self, *t)).collect();
                        let label = match types.as_slice() {
                            [] => String::new(),
                            [one] => format!("the operand is {one}"),
                            _ => format!("the operands are {}", dfc_diag::one_of(&types).replacen(" or ", " and ", 1)),
                        };
                        Diagnostic::error(error.code, span, error.message).with_label(label)
                    }
                };
                if let Some(help) = error.help {
                    d = d.with_help(help);
                }
                self.diagnostics.push(d);
                Val::Error
            }
        }
    }

    /// Refuses tensors of more than `MAX_TENSOR_ELEMENTS` elements (and so every product of
    /// sizes that would overflow).
    pub fn check_size(&mut self, ty: &dfc_ir::TensorType, span: Span) -> bool {
        if ty.shape.n_elements() <= MAX_TENSOR_ELEMENTS {
            return true;
        }
        self.diagnostics.push(
            Diagnostic::error(Code::INVALID_SHAPE, span, format!("{ty} has more elements than dfc supports (2^40)"))
                .with_label("too large"),
        );
        false
    }

    /// A constant node.
    pub fn constant(&mut self, value: ConstValue, span: Span) -> TensorRef {
        let name = if self.hint.is_empty() {
            format!("{}const", self.prefix)
        } else {
            format!("{}{}/const", self.prefix, self.hint)
        };
        let id = self.graph.add(Op::Const { value }, &[], &name, Some(span)).expect("constants always type");
        self.request(id);
        id.into()
    }

    /// A value as a tensor, creating a constant node if need be: numbers and lists of numbers become constants (of `dtype` where
    /// given, else f32 for fractions, i32 for integers, bool for booleans).
    pub fn make_tensor(&mut self, value: Val, span: Span, dtype: Option<DType>) -> Option<TensorRef> {
        match value {
            Val::Tensor(t) => Some(t),
            Val::Error => None,
            Val::Number(n) => {
                let dtype = dtype.unwrap_or(match n {
                    Number::Int(_) => DType::I32,
                    Number::Float(_) => DType::F32,
                    Number::Bool(_) => DType::Bool,
                });
                self.check_representable(n, dtype, span)?;
                Some(self.constant(ConstValue::scalar(dtype, n.as_f64()), span))
            }
            Val::List(items) => {
                let (shape, numbers) = self.list_constant(&items, span)?;
                let dtype = dtype.unwrap_or(if numbers.iter().any(|n| matches!(n, Number::Float(_))) {
                    DType::F32
                } else if numbers.iter().all(|n| matches!(n, Number::Bool(_))) && !numbers.is_empty() {
                    DType::Bool
                } else {
                    DType::I32
                });
                for n in &numbers {
                    self.check_representable(*n, dtype, span)?;
                }
                let values: Vec<f64> = numbers.iter().map(|n| n.as_f64()).collect();
                Some(self.constant(ConstValue::from_f64(dtype, shape, &values), span))
            }
            Val::Str(_) => {
                self.wrong_kind(span, "a tensor", &value);
                None
            }
        }
    }

    pub fn check_representable(&mut self, n: Number, dtype: DType, span: Span) -> Option<()> {
        let ok = match (n, dtype) {
            (_, DType::Bool) => matches!(n, Number::Bool(_)),
            (Number::Bool(_), _) => false,
            (Number::Float(v), d) if d.is_int() => v.fract() == 0.0,
            _ => true,
        };
        let v = n.as_f64();
        let in_range = match dtype {
            DType::U8 => (0.0..=255.0).contains(&v),
            DType::I32 => (i32::MIN as f64..=i32::MAX as f64).contains(&v),
            // 2^63 itself is out of range; every i64 literal is within.
            DType::I64 => matches!(n, Number::Int(_)) || (-(2f64.powi(63))..2f64.powi(63)).contains(&v),
            DType::F32 => v.abs() <= f32::MAX as f64,
            DType::F64 | DType::Bool => true,
        };
        if ok && in_range {
            return Some(());
        }
        self.diagnostics.push(
            Diagnostic::error(
                Code::DTYPE_MISMATCH,
                span,
                format!("the value {n} cannot be {} {dtype}", article(dtype.name())),
            )
            .with_label(format!("used where {} {dtype} value is needed", article(dtype.name())))
            .with_help(format!(
                "cast the other operand, e.g. cast<f32>(...), or write {} {dtype} value",
                article(dtype.name())
            )),
        );
        None
    }

    /// A nested list of numbers as a shape and row-major values.
    fn list_constant(&mut self, items: &[Val], span: Span) -> Option<(Shape, Vec<Number>)> {
        if items.contains(&Val::Error) {
            return None;
        }
        if items.iter().all(|v| matches!(v, Val::Number(_))) {
            let numbers = items.iter().map(|v| match v {
                Val::Number(n) => *n,
                _ => unreachable!("checked above"),
            });
            return Some((Shape(vec![items.len()]), numbers.collect()));
        }
        let mut inner_shape: Option<Shape> = None;
        let mut numbers = Vec::new();
        for item in items {
            let Val::List(sub) = item else {
                self.wrong_kind(span, "a list of numbers (a constant)", item);
                return None;
            };
            let (shape, mut values) = self.list_constant(sub, span)?;
            if inner_shape.as_ref().is_some_and(|s| *s != shape) {
                self.diagnostics.push(
                    Diagnostic::error(Code::INVALID_SHAPE, span, "the rows of this list have different lengths")
                        .with_help("a constant tensor needs rows of equal length"),
                );
                return None;
            }
            inner_shape = Some(shape);
            numbers.append(&mut values);
        }
        let mut dims = vec![items.len()];
        dims.extend(inner_shape.unwrap_or_default().0);
        Some((Shape(dims), numbers))
    }

    pub fn wrong_kind(&mut self, span: Span, expected: &str, found: &Val) -> Val {
        if *found != Val::Error {
            let found = found.describe(&self.graph);
            self.diagnostics.push(
                Diagnostic::error(Code::ARGUMENT_KIND, span, format!("expected {expected}, found {found}"))
                    .with_label(format!("this is {found}")),
            );
        }
        Val::Error
    }

    // ---- compile-time constants ---------------------------------------------------------------

    /// A number known at compile time.
    pub fn const_number(&mut self, expr: &Expr, what: &str) -> Option<Number> {
        match self.eval(expr) {
            Val::Number(n) => Some(n),
            Val::Error => None,
            Val::Tensor(t) if matches!(self.known.get(&t), Some(Val::Number(_))) => match self.known[&t] {
                Val::Number(n) => Some(n),
                _ => unreachable!("matched above"),
            },
            Val::Tensor(t) => {
                let ty = self.graph.ty(t).clone();
                self.diagnostics.push(
                    Diagnostic::error(Code::NOT_CONSTANT, expr.span, format!("{what} must be a compile-time constant"))
                        .with_label(format!(
                            "this is {} {ty} tensor computed when the model runs",
                            article(&ty.to_string())
                        ))
                        .with_help("use literals, dims and `const` values here"),
                );
                None
            }
            other => {
                self.wrong_kind(expr.span, &format!("a number for {what}"), &other);
                None
            }
        }
    }

    pub fn const_int(&mut self, expr: &Expr, what: &str) -> Option<i64> {
        match self.const_number(expr, what)? {
            Number::Int(v) => Some(v),
            other => {
                self.diagnostics.push(
                    Diagnostic::error(
                        Code::ARGUMENT_KIND,
                        expr.span,
                        format!("{what} must be an integer, not {other}"),
                    )
                    .with_label("not an integer"),
                );
                None
            }
        }
    }

    pub fn const_f64(&mut self, expr: &Expr, what: &str) -> Option<f64> {
        match self.const_number(expr, what)? {
            Number::Bool(_) => {
                self.diagnostics.push(Diagnostic::error(
                    Code::ARGUMENT_KIND,
                    expr.span,
                    format!("{what} must be a number"),
                ));
                None
            }
            n => Some(n.as_f64()),
        }
    }

    pub fn const_bool(&mut self, expr: &Expr, what: &str) -> Option<bool> {
        match self.const_number(expr, what)? {
            Number::Bool(v) => Some(v),
            other => {
                self.diagnostics.push(
                    Diagnostic::error(
                        Code::ARGUMENT_KIND,
                        expr.span,
                        format!("{what} must be true or false, not {other}"),
                    )
                    .with_label("not a bool"),
                );
                None
            }
        }
    }

    /// An integer, or a list of integers, known at compile time: a literal list, or a name
    /// bound to one (`const shape = [2, 6]`).
    pub fn const_int_list(&mut self, expr: &Expr, what: &str) -> Option<Vec<i64>> {
        if let ExprKind::Array(items) = &expr.kind {
            let values: Vec<Option<i64>> = items.iter().map(|e| self.const_int(e, what)).collect();
            return values.into_iter().collect();
        }
        if let ExprKind::Name(_) = &expr.kind {
            let value = match self.eval(expr) {
                Val::Tensor(t) => self.known.get(&t).cloned().unwrap_or(Val::Tensor(t)),
                other => other,
            };
            if let Val::List(items) = value {
                let values: Option<Vec<i64>> = items
                    .iter()
                    .map(|v| match v {
                        Val::Number(Number::Int(i)) => Some(*i),
                        _ => None,
                    })
                    .collect();
                if values.is_none() {
                    self.diagnostics.push(
                        Diagnostic::error(Code::ARGUMENT_KIND, expr.span, format!("{what} must be a list of integers"))
                            .with_label("not a list of integers"),
                    );
                }
                return values;
            }
        }
        Some(vec![self.const_int(expr, what)?])
    }

    /// A size: a positive integer known at compile time.
    pub fn size(&mut self, expr: &Expr, what: &str) -> Option<usize> {
        let value = self.const_int(expr, what)?;
        if value < 1 {
            self.diagnostics.push(
                Diagnostic::error(Code::INVALID_SHAPE, expr.span, format!("{what} must be positive, not {value}"))
                    .with_label("not a positive size"),
            );
            return None;
        }
        usize::try_from(value).ok()
    }

    /// A type annotation `f32[batch, 784]` with every size evaluated.
    pub fn resolve_type(&mut self, ty: &ast::TensorType) -> Option<dfc_ir::TensorType> {
        let dims: Vec<Option<usize>> = ty.shape.iter().map(|e| self.size(e, "a size in a shape")).collect();
        let dims: Option<Vec<usize>> = dims.into_iter().collect();
        let resolved = dfc_ir::TensorType::new(dtype_of(ty.dtype), dims?);
        self.check_size(&resolved, ty.span).then_some(resolved)
    }

    /// An axis given as a possibly negative integer, checked against `rank`.
    pub fn axis(&mut self, value: i64, rank: usize, span: Span) -> Option<usize> {
        let resolved = if value < 0 { value + rank as i64 } else { value };
        if (0..rank as i64).contains(&resolved) {
            return Some(resolved as usize);
        }
        let range = if rank == 0 {
            "a scalar has no axes".to_string()
        } else {
            format!("axes run from {} to {}", -(rank as i64), rank - 1)
        };
        self.diagnostics.push(
            Diagnostic::error(
                Code::AXIS_OUT_OF_RANGE,
                span,
                format!("axis {value} is out of range for a tensor of rank {rank}"),
            )
            .with_label("no such axis")
            .with_help(range),
        );
        None
    }
}

pub fn dtype_of(name: ast::DTypeName) -> DType {
    match name {
        ast::DTypeName::F32 => DType::F32,
        ast::DTypeName::F64 => DType::F64,
        ast::DTypeName::I32 => DType::I32,
        ast::DTypeName::I64 => DType::I64,
        ast::DTypeName::U8 => DType::U8,
        ast::DTypeName::Bool => DType::Bool,
    }
}
