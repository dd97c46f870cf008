//! The built-in ops callable from `.df` source: their signatures, and their lowering to IR ops.

use crate::args::{self, Param};
use crate::lower::Lowerer;
use crate::normalization::BatchNormOptions;
use crate::value::Val;
use dfc_diag::{Code, Diagnostic, Span};
use dfc_ir::{BinaryOp, CompareOp, ConstValue, DType, Op, Padding, ReduceKind, Shape, TensorRef, UnaryOp};
use dfc_syntax::ast::{Arg, Call, ExprKind};

/// Every built-in op: name, signature, one line of documentation. The language reference and
/// editors (hover, completion) show these.
pub const OPS: &[(&str, &str, &str)] = &[
    ("neg", "neg(x)", "Elementwise negation, as unary `-`."),
    ("abs", "abs(x)", "Elementwise absolute value."),
    ("exp", "exp(x)", "Elementwise e^x."),
    ("log", "log(x)", "Elementwise natural logarithm."),
    ("sqrt", "sqrt(x)", "Elementwise square root."),
    ("rsqrt", "rsqrt(x)", "Elementwise 1/sqrt(x)."),
    ("relu", "relu(x)", "Elementwise max(x, 0)."),
    ("sigmoid", "sigmoid(x)", "Elementwise 1/(1+e^-x)."),
    ("tanh", "tanh(x)", "Elementwise hyperbolic tangent."),
    (
        "dropout",
        "dropout(x, rate)",
        "In training, each element zeroed with probability `rate` and the rest scaled by 1/(1 - rate); the identity in evaluation and inference.",
    ),
    (
        "random_uniform",
        "random_uniform(shape)",
        "f32 uniform in [0, 1), a Philox stream of its own per run seed and training step.",
    ),
    (
        "random_normal",
        "random_normal(shape, mean=0, stddev=1)",
        "f32 normally distributed (Box-Muller on Philox bits), a stream of its own per run seed and training step.",
    ),
    (
        "gelu",
        "gelu(x)",
        "Elementwise GELU, tanh form: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) (JAX's default, GPT-2's).",
    ),
    ("add", "add(x, y)", "Elementwise sum, broadcast; as `x + y`."),
    ("sub", "sub(x, y)", "Elementwise difference, broadcast; as `x - y`."),
    ("mul", "mul(x, y)", "Elementwise product, broadcast; as `x * y`."),
    ("div", "div(x, y)", "Elementwise quotient, broadcast; as `x / y`."),
    ("pow", "pow(x, y)", "Elementwise x^y, broadcast."),
    ("maximum", "maximum(x, y)", "Elementwise larger value, broadcast."),
    ("minimum", "minimum(x, y)", "Elementwise smaller value, broadcast."),
    ("equal", "equal(x, y)", "Elementwise x == y as bool, broadcast."),
    ("not_equal", "not_equal(x, y)", "Elementwise x != y as bool, broadcast."),
    ("less", "less(x, y)", "Elementwise x < y as bool, broadcast."),
    ("less_equal", "less_equal(x, y)", "Elementwise x <= y as bool, broadcast."),
    ("greater", "greater(x, y)", "Elementwise x > y as bool, broadcast."),
    ("greater_equal", "greater_equal(x, y)", "Elementwise x >= y as bool, broadcast."),
    ("select", "select(cond, x, y)", "Elementwise `cond ? x : y`, broadcast."),
    ("cast", "cast<T>(x)", "Converts elements to type T."),
    (
        "matmul",
        "matmul(a, b, transpose_a=false, transpose_b=false)",
        "Batched matrix product of the last two axes; as `a @ b`.",
    ),
    ("reshape", "reshape(x, shape)", "The same elements in a new shape; one size may be -1."),
    ("flatten", "flatten(x)", "Reshapes [n, ...] to [n, product of the rest]."),
    ("transpose", "transpose(x, perm=reversed)", "Permutes the axes."),
    ("concat", "concat([x, y, ...], axis=0)", "Joins tensors along an axis."),
    ("slice", "slice(x, begin, size)", "The block starting at `begin` of `size` (-1: to the end)."),
    ("sum", "sum(x, axis=all, keep_dims=false)", "Sum over the given axes."),
    ("mean", "mean(x, axis=all, keep_dims=false)", "Mean over the given axes."),
    ("max", "max(x, axis=all, keep_dims=false)", "Maximum over the given axes."),
    ("min", "min(x, axis=all, keep_dims=false)", "Minimum over the given axes."),
    ("softmax", "softmax(x, axis=-1)", "e^x normalised to sum 1 along an axis."),
    ("log_softmax", "log_softmax(x, axis=-1)", "log(softmax(x)), computed stably."),
    (
        "batch_norm",
        "batch_norm(x, momentum=0.99, epsilon=1e-3, synchronized=false)",
        "Each channel (last axis) normalised over the other axes: by the batch's statistics in training, which move its moving averages; by the moving averages elsewhere. With `synchronized`, data-parallel replicas share one batch's statistics.",
    ),
    (
        "layer_norm",
        "layer_norm(x, epsilon=1e-5)",
        "Each row of the last axis normalised: (x - mean) / sqrt(variance + epsilon); scale and shift it with your own params.",
    ),
    (
        "softmax_cross_entropy",
        "softmax_cross_entropy(logits, labels)",
        "Per-example cross-entropy of softmax(logits) against label distributions over the last axis.",
    ),
    (
        "sigmoid_cross_entropy",
        "sigmoid_cross_entropy(logits, labels)",
        "Elementwise cross-entropy of sigmoid(logits) against labels in [0, 1].",
    ),
    ("one_hot", "one_hot<T=f32>(indices, depth)", "Integer class ids to one-hot vectors of length `depth`."),
    (
        "range",
        "range<T=i32>(n)",
        "The constant vector [0, 1, …, n − 1]: positions, and masks such as the causal one, range(n) <= reshape(range(n), [n, 1]).",
    ),
    (
        "conv2d",
        "conv2d(x, filter, strides=1, padding=\"valid\")",
        "2-D convolution: x is NHWC, filter is [height, width, in, out].",
    ),
    ("max_pool", "max_pool(x, window=2, strides=window, padding=\"valid\")", "Maximum over windows of NHWC input."),
    ("avg_pool", "avg_pool(x, window=2, strides=window, padding=\"valid\")", "Mean over windows of NHWC input."),
    ("gather", "gather(table, indices)", "Rows of `table` at integer `indices` (embedding lookup)."),
    ("argmax", "argmax<T=i32>(x, axis=-1)", "Index of the largest element along an axis (the first of equals)."),
    ("stop_gradient", "stop_gradient(x)", "x, through which no gradient flows."),
    ("identity", "identity(x)", "x unchanged."),
];

/// Every optimizer of `minimize ... with`: name, signature with defaults, one line of
/// documentation. Every `lr` is a number or a learning-rate schedule (`SCHEDULES`);
/// `clip_global_norm = c` scales the gradients together to a global norm of at most `c`.
pub const OPTIMIZERS: &[(&str, &str, &str)] = &[
    ("sgd", "sgd(lr, weight_decay=0, clip_global_norm=none)", "Stochastic gradient descent: w -= lr · g."),
    (
        "momentum",
        "momentum(lr, momentum=0.9, nesterov=false, weight_decay=0, clip_global_norm=none)",
        "SGD with a velocity that accumulates past gradients (Nesterov's variant on request).",
    ),
    (
        "adam",
        "adam(lr=0.001, beta1=0.9, beta2=0.999, epsilon=1e-7, weight_decay=0, clip_global_norm=none)",
        "Adam: per-weight steps from running means of the gradient and its square.",
    ),
    (
        "adagrad",
        "adagrad(lr=0.01, initial_accumulator=0.1, epsilon=1e-7, weight_decay=0, clip_global_norm=none)",
        "Adagrad: steps shrink with the sum of past squared gradients.",
    ),
    (
        "rmsprop",
        "rmsprop(lr=0.001, rho=0.9, momentum=0, epsilon=1e-7, weight_decay=0, clip_global_norm=none)",
        "RMSProp: steps scaled by a running mean of squared gradients.",
    ),
];

/// Every initializer of a `param`: name, signature with defaults, one line of documentation.
pub const INITIALIZERS: &[(&str, &str, &str)] = &[
    ("zeros", "zeros", "Every element 0."),
    ("ones", "ones", "Every element 1."),
    ("constant", "constant(value)", "Every element `value` (a plain number does the same)."),
    ("uniform", "uniform(min=-0.05, max=0.05)", "Uniformly random in [min, max)."),
    ("normal", "normal(mean=0, stddev=0.05)", "Normally distributed."),
    (
        "truncated_normal",
        "truncated_normal(mean=0, stddev=0.05)",
        "Normally distributed, redrawn beyond two standard deviations.",
    ),
    ("glorot_uniform", "glorot_uniform", "Uniform in ±sqrt(6 / (fan_in + fan_out)) (Glorot and Bengio)."),
    ("he_normal", "he_normal", "Truncated normal with stddev sqrt(2 / fan_in) (He et al.)."),
];

/// The longest `range`: its values are a constant of the plan.
const MAX_RANGE: usize = 1 << 24;

pub fn is_op(name: &str) -> bool {
    OPS.iter().any(|(n, _, _)| *n == name)
}

fn params_of(name: &str) -> &'static [Param<'static>] {
    match name {
        "neg" | "abs" | "exp" | "log" | "sqrt" | "rsqrt" | "relu" | "sigmoid" | "tanh" | "gelu" | "cast"
        | "flatten" | "stop_gradient" | "identity" => &[Param { name: "x", required: true }],
        "add" | "sub" | "mul" | "div" | "pow" | "maximum" | "minimum" | "equal" | "not_equal" | "less"
        | "less_equal" | "greater" | "greater_equal" => {
            &[Param { name: "x", required: true }, Param { name: "y", required: true }]
        }
        "select" => &[
            Param { name: "cond", required: true },
            Param { name: "x", required: true },
            Param { name: "y", required: true },
        ],
        "matmul" => &[
            Param { name: "a", required: true },
            Param { name: "b", required: true },
            Param { name: "transpose_a", required: false },
            Param { name: "transpose_b", required: false },
        ],
        "reshape" => &[Param { name: "x", required: true }, Param { name: "shape", required: true }],
        "transpose" => &[Param { name: "x", required: true }, Param { name: "perm", required: false }],
        "concat" => &[Param { name: "values", required: true }, Param { name: "axis", required: false }],
        "slice" => &[
            Param { name: "x", required: true },
            Param { name: "begin", required: true },
            Param { name: "size", required: true },
        ],
        "sum" | "mean" | "max" | "min" => &[
            Param { name: "x", required: true },
            Param { name: "axis", required: false },
            Param { name: "keep_dims", required: false },
        ],
        "softmax" | "log_softmax" | "argmax" => {
            &[Param { name: "x", required: true }, Param { name: "axis", required: false }]
        }
        "softmax_cross_entropy" | "sigmoid_cross_entropy" => {
            &[Param { name: "logits", required: true }, Param { name: "labels", required: true }]
        }
        "one_hot" => &[Param { name: "indices", required: true }, Param { name: "depth", required: true }],
        "range" => &[Param { name: "n", required: true }],
        "dropout" => &[Param { name: "x", required: true }, Param { name: "rate", required: true }],
        "layer_norm" => &[Param { name: "x", required: true }, Param { name: "epsilon", required: false }],
        "batch_norm" => &[
            Param { name: "x", required: true },
            Param { name: "momentum", required: false },
            Param { name: "epsilon", required: false },
            Param { name: "synchronized", required: false },
        ],
        "random_uniform" => &[Param { name: "shape", required: true }],
        "random_normal" => &[
            Param { name: "shape", required: true },
            Param { name: "mean", required: false },
            Param { name: "stddev", required: false },
        ],
        "conv2d" => &[
            Param { name: "x", required: true },
            Param { name: "filter", required: true },
            Param { name: "strides", required: false },
            Param { name: "padding", required: false },
        ],
        "max_pool" | "avg_pool" => &[
            Param { name: "x", required: true },
            Param { name: "window", required: false },
            Param { name: "strides", required: false },
            Param { name: "padding", required: false },
        ],
        "gather" => &[Param { name: "table", required: true }, Param { name: "indices", required: true }],
        _ => &[],
    }
}

impl Lowerer<'_> {
    pub fn call(&mut self, call: &Call, span: Span) -> Val {
        let name = call.callee.name.as_str();
        if let Some(def) = self.layers.get(name) {
            return self.call_layer(def, call, span);
        }
        if !is_op(name) {
            let mut d = Diagnostic::error(
                Code::UNKNOWN_FUNCTION,
                call.callee.span,
                format!("`{name}` is neither an op nor a layer"),
            )
            .with_label("unknown");
            let candidates = OPS.iter().map(|(n, _, _)| *n).chain(self.layers.names());
            if let Some(best) = dfc_diag::closest(name, candidates) {
                d = d.with_help(format!("did you mean `{best}`?"));
            } else {
                d = d.with_help("docs/language.md lists the ops; define a `layer` for your own");
            }
            self.diagnostics.push(d);
            return self.eval_args_for_errors(call);
        }
        if let Some((_, type_span)) = call.type_arg {
            if !["cast", "one_hot", "argmax", "range"].contains(&name) {
                self.diagnostics.push(
                    Diagnostic::error(Code::ARGUMENT_KIND, type_span, format!("`{name}` takes no type argument"))
                        .with_help("only cast<T>, one_hot<T>, argmax<T> and range<T> take one"),
                );
            }
        }
        let Some(bound) = args::bind(name, span, params_of(name), &call.args, &mut self.diagnostics) else {
            return self.eval_args_for_errors(call);
        };
        let result = self.builtin(name, call, &bound, span);
        if result == Val::Error {
            // Arguments after a failed one were not evaluated; they are still used.
            call.args.iter().for_each(|a| self.mark_used(&a.value));
        }
        result
    }

    /// Marks every name in `expr` used, without evaluating it.
    pub fn mark_used(&mut self, expr: &dfc_syntax::ast::Expr) {
        match &expr.kind {
            ExprKind::Name(ident) => {
                if let Some(binding) = self.scope.bindings.get_mut(&ident.name) {
                    binding.used = true;
                }
            }
            ExprKind::Array(items) => items.iter().for_each(|e| self.mark_used(e)),
            ExprKind::Call(call) => call.args.iter().for_each(|a| self.mark_used(&a.value)),
            ExprKind::Unary(_, e) => self.mark_used(e),
            ExprKind::Binary(_, a, b) => {
                self.mark_used(a);
                self.mark_used(b);
            }
            _ => {}
        }
    }

    /// After a call that cannot be made, its arguments are still checked for their own errors
    /// (and count as uses of the names in them).
    pub fn eval_args_for_errors(&mut self, call: &Call) -> Val {
        for arg in &call.args {
            self.eval(&arg.value);
        }
        Val::Error
    }

    /// A bound tensor argument: evaluated and made a tensor.
    fn tensor_arg(&mut self, arg: Option<&Arg>) -> Option<(TensorRef, Span)> {
        let arg = arg?;
        let value = self.eval(&arg.value);
        self.make_tensor(value, arg.value.span, None).map(|t| (t, arg.value.span))
    }

    /// `gelu(x)` as the elementwise ops it is made of, which fusion makes one kernel (and
    /// autodiff differentiates): `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
    fn gelu(&mut self, x: TensorRef, x_span: Span, span: Span) -> Val {
        let dtype = self.graph.ty(x).dtype;
        if !dtype.is_float() {
            // `tanh` reports a non-float operand at `x`.
            return self.node(Op::Unary(UnaryOp::Tanh), &[(x, x_span)], span);
        }
        let constant = |this: &mut Self, v: f64| {
            this.make_tensor(Val::Number(crate::value::Number::Float(v)), span, Some(dtype)).map(|t| (t, span))
        };
        let (Some(half), Some(one), Some(cubic), Some(scale)) = (
            constant(self, 0.5),
            constant(self, 1.0),
            constant(self, 0.044715),
            constant(self, (2.0 / std::f64::consts::PI).sqrt()),
        ) else {
            return Val::Error;
        };
        let x = (x, x_span);
        let op = |this: &mut Self, op: Op, operands: &[(TensorRef, Span)]| this.op_node(op, operands, span);
        let mul = Op::Binary(BinaryOp::Mul);
        let add = Op::Binary(BinaryOp::Add);
        let result = (|| {
            let square = op(self, mul.clone(), &[x, x])?;
            let cube = op(self, mul.clone(), &[square, x])?;
            let term = op(self, mul.clone(), &[cubic, cube])?;
            let inner = op(self, add.clone(), &[x, term])?;
            let scaled = op(self, mul.clone(), &[scale, inner])?;
            let t = op(self, Op::Unary(UnaryOp::Tanh), &[scaled])?;
            let shifted = op(self, add.clone(), &[one, t])?;
            let halved = op(self, mul.clone(), &[half, x])?;
            op(self, mul.clone(), &[halved, shifted])
        })();
        result.map_or(Val::Error, |(t, _)| Val::Tensor(t))
    }

    /// A normalisation's `epsilon`, above 0 (`default` when not given).
    fn epsilon(&mut self, arg: Option<&Arg>, default: f64) -> Option<f64> {
        let Some(arg) = arg else { return Some(default) };
        let e = self.const_f64(&arg.value, "`epsilon`")?;
        if e.is_finite() && e > 0.0 {
            return Some(e);
        }
        self.diagnostics.push(
            Diagnostic::error(Code::ARGUMENT_KIND, arg.value.span, format!("`epsilon` = {e} is out of range"))
                .with_label("must be above 0: it keeps the divisor away from zero")
                .with_help(format!("{default:e} is the usual one")),
        );
        None
    }

    fn builtin(&mut self, name: &str, call: &Call, bound: &[Option<&Arg>], span: Span) -> Val {
        let unary = |op: UnaryOp| Op::Unary(op);
        let simple_unary = match name {
            "neg" => Some(unary(UnaryOp::Neg)),
            "abs" => Some(unary(UnaryOp::Abs)),
            "exp" => Some(unary(UnaryOp::Exp)),
            "log" => Some(unary(UnaryOp::Log)),
            "sqrt" => Some(unary(UnaryOp::Sqrt)),
            "rsqrt" => Some(unary(UnaryOp::Rsqrt)),
            "relu" => Some(unary(UnaryOp::Relu)),
            "sigmoid" => Some(unary(UnaryOp::Sigmoid)),
            "tanh" => Some(unary(UnaryOp::Tanh)),
            "stop_gradient" => Some(Op::StopGradient),
            "identity" => Some(Op::Identity),
            _ => None,
        };
        if let Some(op) = simple_unary {
            let Some(x) = self.tensor_arg(bound[0]) else { return Val::Error };
            return self.node(op, &[x], span);
        }
        let binary = match name {
            "add" => Some(Op::Binary(BinaryOp::Add)),
            "sub" => Some(Op::Binary(BinaryOp::Sub)),
            "mul" => Some(Op::Binary(BinaryOp::Mul)),
            "div" => Some(Op::Binary(BinaryOp::Div)),
            "pow" => Some(Op::Binary(BinaryOp::Pow)),
            "maximum" => Some(Op::Binary(BinaryOp::Maximum)),
            "minimum" => Some(Op::Binary(BinaryOp::Minimum)),
            "equal" => Some(Op::Compare(CompareOp::Equal)),
            "not_equal" => Some(Op::Compare(CompareOp::NotEqual)),
            "less" => Some(Op::Compare(CompareOp::Less)),
            "less_equal" => Some(Op::Compare(CompareOp::LessEqual)),
            "greater" => Some(Op::Compare(CompareOp::Greater)),
            "greater_equal" => Some(Op::Compare(CompareOp::GreaterEqual)),
            "softmax_cross_entropy" => Some(Op::SoftmaxCrossEntropy),
            "sigmoid_cross_entropy" => Some(Op::SigmoidCrossEntropy),
            _ => None,
        };
        if let Some(op) = binary {
            let (x, y) = (bound[0].expect("required"), bound[1].expect("required"));
            let a = self.eval(&x.value);
            let b = self.eval(&y.value);
            return self.binary_op(op, (a, x.value.span), (b, y.value.span), span);
        }
        match name {
            "dropout" => {
                let Some(x) = self.tensor_arg(bound[0]) else { return Val::Error };
                let rate_expr = &bound[1].expect("required").value;
                let Some(rate) = self.const_f64(rate_expr, "`rate`") else { return Val::Error };
                self.dropout(x, rate, rate_expr.span, span)
            }
            "random_uniform" | "random_normal" => {
                let shape_expr = &bound[0].expect("required").value;
                let Some(dims) = self.const_int_list(shape_expr, "`shape`") else { return Val::Error };
                if dims.iter().any(|&d| d < 0) {
                    self.diagnostics.push(
                        Diagnostic::error(Code::ARGUMENT_KIND, shape_expr.span, "a shape's sizes are ≥ 0")
                            .with_label("a negative size"),
                    );
                    return Val::Error;
                }
                let shape = Shape(dims.into_iter().map(|d| d as usize).collect());
                if !self.check_size(&dfc_ir::TensorType::new(DType::F32, shape.clone()), shape_expr.span) {
                    return Val::Error;
                }
                if name == "random_uniform" {
                    return self.random_uniform(shape, span);
                }
                let mut moment = |arg: Option<&Arg>, what: &str, default: f64| match arg {
                    Some(a) => self.const_f64(&a.value, what).map(|v| (v, a.value.span)),
                    None => Some((default, span)),
                };
                let (Some((mean, mean_span)), Some((stddev, stddev_span))) =
                    (moment(bound[1], "`mean`", 0.0), moment(bound[2], "`stddev`", 1.0))
                else {
                    return Val::Error;
                };
                for (what, value, at, ok) in [
                    ("mean", mean, mean_span, mean.is_finite()),
                    ("stddev", stddev, stddev_span, stddev.is_finite() && stddev >= 0.0),
                ] {
                    if !ok {
                        self.diagnostics.push(
                            Diagnostic::error(Code::ARGUMENT_KIND, at, format!("`{what}` = {value} is out of range"))
                                .with_label(if what == "mean" { "must be finite" } else { "must be finite and ≥ 0" }),
                        );
                        return Val::Error;
                    }
                }
                self.random_normal(shape, mean, stddev, span)
            }
            "layer_norm" => {
                let Some(x) = self.tensor_arg(bound[0]) else { return Val::Error };
                let Some(epsilon) = self.epsilon(bound[1], 1e-5) else { return Val::Error };
                self.node(Op::LayerNorm { epsilon }, &[x], span)
            }
            "batch_norm" => {
                let Some(x) = self.tensor_arg(bound[0]) else { return Val::Error };
                let momentum = match bound[1] {
                    Some(arg) => match self.const_f64(&arg.value, "`momentum`") {
                        Some(m) if (0.0..1.0).contains(&m) => m,
                        Some(m) => {
                            self.diagnostics.push(
                                Diagnostic::error(
                                    Code::ARGUMENT_KIND,
                                    arg.value.span,
                                    format!("`momentum` = {m} is out of range"),
                                )
                                .with_label("must be in [0, 1): the share of the moving averages a step keeps"),
                            );
                            return Val::Error;
                        }
                        None => return Val::Error,
                    },
                    None => 0.99,
                };
                let Some(epsilon) = self.epsilon(bound[2], 1e-3) else { return Val::Error };
                let synchronized = match bound[3] {
                    Some(arg) => match self.const_bool(&arg.value, "`synchronized`") {
                        Some(s) => s,
                        None => return Val::Error,
                    },
                    None => false,
                };
                self.batch_norm(x, BatchNormOptions { momentum, epsilon, synchronized }, span)
            }
            "gelu" => {
                let Some((x, x_span)) = self.tensor_arg(bound[0]) else { return Val::Error };
                self.gelu(x, x_span, span)
            }
            "select" => {
                let Some(cond) = self.tensor_arg(bound[0]) else { return Val::Error };
                let (x, y) = (bound[1].expect("required"), bound[2].expect("required"));
                let (a, b) = (self.eval(&x.value), self.eval(&y.value));
                let a_dtype = if let Val::Tensor(t) = &a { Some(self.graph.ty(*t).dtype) } else { None };
                let b_dtype = if let Val::Tensor(t) = &b { Some(self.graph.ty(*t).dtype) } else { None };
                let Some(a) = self.make_tensor(a, x.value.span, b_dtype) else { return Val::Error };
                let Some(b) = self.make_tensor(b, y.value.span, a_dtype) else { return Val::Error };
                self.node(Op::Select, &[cond, (a, x.value.span), (b, y.value.span)], span)
            }
            "cast" => {
                let Some((to, _)) = call.type_arg else {
                    self.diagnostics.push(
                        Diagnostic::error(Code::MISSING_ARGUMENT, call.callee.span, "`cast` needs the type to cast to")
                            .with_help("write it in angle brackets: cast<f32>(x)"),
                    );
                    return Val::Error;
                };
                let Some(x) = self.tensor_arg(bound[0]) else { return Val::Error };
                self.node(Op::Cast { to: crate::eval::dtype_of(to) }, &[x], span)
            }
            "matmul" => {
                let flag = |this: &mut Self, arg: Option<&Arg>, what: &str| match arg {
                    Some(a) => this.const_bool(&a.value, what),
                    None => Some(false),
                };
                let transpose_a = flag(self, bound[2], "`transpose_a`");
                let transpose_b = flag(self, bound[3], "`transpose_b`");
                let (a, b) = (bound[0].expect("required"), bound[1].expect("required"));
                let (va, vb) = (self.eval(&a.value), self.eval(&b.value));
                let (Some(transpose_a), Some(transpose_b)) = (transpose_a, transpose_b) else { return Val::Error };
                self.binary_op(Op::MatMul { transpose_a, transpose_b }, (va, a.value.span), (vb, b.value.span), span)
            }
            "reshape" => {
                let Some(x) = self.tensor_arg(bound[0]) else { return Val::Error };
                let shape_arg = bound[1].expect("required");
                let Some(dims) = self.const_int_list(&shape_arg.value, "a size in the new shape") else {
                    return Val::Error;
                };
                let Some(shape) = self.reshape_target(x.0, &dims, shape_arg.value.span) else { return Val::Error };
                self.node(Op::Reshape { shape }, &[x], span)
            }
            "flatten" => {
                let Some(x) = self.tensor_arg(bound[0]) else { return Val::Error };
                let dims = self.graph.ty(x.0).shape.dims().to_vec();
                if dims.is_empty() {
                    self.diagnostics.push(
                        Diagnostic::error(
                            Code::AXIS_OUT_OF_RANGE,
                            x.1,
                            "`flatten` needs a tensor with a leading axis, not a scalar",
                        )
                        .with_help("flatten keeps axis 0 and joins the rest"),
                    );
                    return Val::Error;
                }
                let rest = Shape(dims[1..].to_vec()).n_elements();
                self.node(Op::Reshape { shape: Shape(vec![dims[0], rest]) }, &[x], span)
            }
            "transpose" => {
                let Some(x) = self.tensor_arg(bound[0]) else { return Val::Error };
                let rank = self.graph.ty(x.0).shape.rank();
                let perm = match bound[1] {
                    None => (0..rank).rev().collect(),
                    Some(arg) => {
                        let Some(values) = self.const_int_list(&arg.value, "an axis") else { return Val::Error };
                        let resolved: Option<Vec<usize>> =
                            values.iter().map(|&v| self.axis(v, rank, arg.value.span)).collect();
                        let Some(perm) = resolved else { return Val::Error };
                        perm
                    }
                };
                self.node(Op::Transpose { perm }, &[x], span)
            }
            "concat" => {
                let values_arg = bound[0].expect("required");
                let ExprKind::Array(items) = &values_arg.value.kind else {
                    self.diagnostics.push(
                        Diagnostic::error(
                            Code::ARGUMENT_KIND,
                            values_arg.value.span,
                            "`concat` takes a list of tensors",
                        )
                        .with_help("write them in brackets: concat([a, b], axis = 1)"),
                    );
                    return Val::Error;
                };
                let mut operands = Vec::new();
                for item in items {
                    let value = self.eval(item);
                    operands.push(self.make_tensor(value, item.span, None).map(|t| (t, item.span)));
                }
                let Some(operands) = operands.into_iter().collect::<Option<Vec<_>>>() else { return Val::Error };
                if operands.is_empty() {
                    self.diagnostics.push(Diagnostic::error(
                        Code::ARITY,
                        values_arg.value.span,
                        "`concat` needs at least one tensor",
                    ));
                    return Val::Error;
                }
                let rank = self.graph.ty(operands[0].0).shape.rank();
                let axis = match bound[1] {
                    Some(arg) => match self.const_int(&arg.value, "the axis") {
                        Some(v) => self.axis(v, rank, arg.value.span),
                        None => None,
                    },
                    None => self.axis(0, rank, values_arg.value.span),
                };
                let Some(axis) = axis else { return Val::Error };
                self.node(Op::Concat { axis }, &operands, span)
            }
            "slice" => {
                let Some(x) = self.tensor_arg(bound[0]) else { return Val::Error };
                let (begin_arg, size_arg) = (bound[1].expect("required"), bound[2].expect("required"));
                let begin = self.const_int_list(&begin_arg.value, "a slice start");
                let size = self.const_int_list(&size_arg.value, "a slice size");
                let (Some(begin), Some(size)) = (begin, size) else { return Val::Error };
                let dims = self.graph.ty(x.0).shape.dims().to_vec();
                if begin.len() != dims.len() || size.len() != dims.len() {
                    self.diagnostics.push(
                        Diagnostic::error(
                            Code::AXIS_OUT_OF_RANGE,
                            span,
                            format!(
                                "`slice` of a rank-{} tensor needs {} starts and {} sizes",
                                dims.len(),
                                dims.len(),
                                dims.len()
                            ),
                        )
                        .with_help("give one start and one size per axis"),
                    );
                    return Val::Error;
                }
                let mut starts = Vec::new();
                let mut sizes = Vec::new();
                for ((&b, &s), &d) in begin.iter().zip(&size).zip(&dims) {
                    if b < 0 || b as usize > d {
                        self.diagnostics.push(Diagnostic::error(
                            Code::INVALID_SHAPE,
                            begin_arg.value.span,
                            format!("slice start {b} is outside an axis of size {d}"),
                        ));
                        return Val::Error;
                    }
                    let s = if s == -1 { d as i64 - b } else { s };
                    if s < 1 {
                        self.diagnostics.push(
                            Diagnostic::error(
                                Code::INVALID_SHAPE,
                                size_arg.value.span,
                                format!("slice size {s} is not positive"),
                            )
                            .with_help("-1 means to the end of the axis"),
                        );
                        return Val::Error;
                    }
                    starts.push(b as usize);
                    sizes.push(s as usize);
                }
                self.node(Op::Slice { begin: starts, size: sizes }, &[x], span)
            }
            "sum" | "mean" | "max" | "min" => {
                let Some(x) = self.tensor_arg(bound[0]) else { return Val::Error };
                let rank = self.graph.ty(x.0).shape.rank();
                let axes = match bound[1] {
                    None => (0..rank).collect(),
                    Some(arg) => {
                        let Some(values) = self.const_int_list(&arg.value, "an axis") else { return Val::Error };
                        let resolved: Option<Vec<usize>> =
                            values.iter().map(|&v| self.axis(v, rank, arg.value.span)).collect();
                        let Some(axes) = resolved else { return Val::Error };
                        axes
                    }
                };
                let keep_dims = match bound[2] {
                    Some(arg) => self.const_bool(&arg.value, "`keep_dims`"),
                    None => Some(false),
                };
                let Some(keep_dims) = keep_dims else { return Val::Error };
                let kind = match name {
                    "sum" => ReduceKind::Sum,
                    "mean" => ReduceKind::Mean,
                    "max" => ReduceKind::Max,
                    _ => ReduceKind::Min,
                };
                self.node(Op::Reduce { kind, axes, keep_dims }, &[x], span)
            }
            "softmax" | "log_softmax" => {
                let Some(x) = self.tensor_arg(bound[0]) else { return Val::Error };
                let rank = self.graph.ty(x.0).shape.rank();
                let axis = match bound[1] {
                    Some(arg) => {
                        self.const_int(&arg.value, "the axis").and_then(|v| self.axis(v, rank, arg.value.span))
                    }
                    None => self.axis(-1, rank, x.1),
                };
                let Some(axis) = axis else { return Val::Error };
                let op = if name == "softmax" { Op::Softmax { axis } } else { Op::LogSoftmax { axis } };
                self.node(op, &[x], span)
            }
            "argmax" => {
                let Some(x) = self.tensor_arg(bound[0]) else { return Val::Error };
                let rank = self.graph.ty(x.0).shape.rank();
                let axis = match bound[1] {
                    Some(arg) => {
                        self.const_int(&arg.value, "the axis").and_then(|v| self.axis(v, rank, arg.value.span))
                    }
                    None => self.axis(-1, rank, x.1),
                };
                let Some(axis) = axis else { return Val::Error };
                let dtype = call.type_arg.map(|(d, _)| crate::eval::dtype_of(d)).unwrap_or(DType::I32);
                self.node(Op::ArgMax { axis, dtype }, &[x], span)
            }
            "range" => {
                let n_expr = &bound[0].expect("required").value;
                let Some(n) = self.size(n_expr, "the length of range") else { return Val::Error };
                if n > MAX_RANGE {
                    self.diagnostics.push(
                        Diagnostic::error(
                            Code::INVALID_SHAPE,
                            n_expr.span,
                            format!("range({n}) is too long a constant"),
                        )
                        .with_label(format!("at most {MAX_RANGE} elements")),
                    );
                    return Val::Error;
                }
                let dtype = call.type_arg.map(|(d, _)| crate::eval::dtype_of(d)).unwrap_or(DType::I32);
                if !dtype.is_numeric() {
                    let at = call.type_arg.map_or(span, |(_, at)| at);
                    self.diagnostics.push(
                        Diagnostic::error(Code::DTYPE_MISMATCH, at, format!("range<{dtype}> is not defined"))
                            .with_label("a numeric type is needed"),
                    );
                    return Val::Error;
                }
                if dtype == DType::U8 && n > 256 {
                    self.diagnostics.push(
                        Diagnostic::error(Code::INVALID_SHAPE, n_expr.span, format!("range<u8>({n}) does not fit u8"))
                            .with_label("at most 256 elements"),
                    );
                    return Val::Error;
                }
                let values: Vec<f64> = (0..n).map(|i| i as f64).collect();
                Val::Tensor(self.constant(ConstValue::from_f64(dtype, Shape(vec![n]), &values), span))
            }
            "one_hot" => {
                let Some(x) = self.tensor_arg(bound[0]) else { return Val::Error };
                let depth_arg = bound[1].expect("required");
                let Some(depth) = self.size(&depth_arg.value, "the depth of one_hot") else { return Val::Error };
                let dtype = call.type_arg.map(|(d, _)| crate::eval::dtype_of(d)).unwrap_or(DType::F32);
                self.node(Op::OneHot { depth, dtype }, &[x], span)
            }
            "conv2d" => {
                let Some(x) = self.tensor_arg(bound[0]) else { return Val::Error };
                let Some(filter) = self.tensor_arg(bound[1]) else { return Val::Error };
                let strides = self.pair(bound[2], 1, "a stride");
                let padding = self.padding(bound[3]);
                let (Some(strides), Some(padding)) = (strides, padding) else { return Val::Error };
                self.node(Op::Conv2d { strides, padding }, &[x, filter], span)
            }
            "max_pool" | "avg_pool" => {
                let Some(x) = self.tensor_arg(bound[0]) else { return Val::Error };
                let window = self.pair(bound[1], 2, "a window size");
                let Some(window) = window else { return Val::Error };
                let strides = match bound[2] {
                    Some(_) => self.pair(bound[2], 1, "a stride"),
                    None => Some(window),
                };
                let padding = self.padding(bound[3]);
                let (Some(strides), Some(padding)) = (strides, padding) else { return Val::Error };
                let op = if name == "max_pool" {
                    Op::MaxPool { window, strides, padding }
                } else {
                    Op::AvgPool { window, strides, padding }
                };
                self.node(op, &[x], span)
            }
            "gather" => {
                let Some(table) = self.tensor_arg(bound[0]) else { return Val::Error };
                let indices_arg = bound[1].expect("required");
                let value = self.eval(&indices_arg.value);
                let Some(indices) = self.make_tensor(value, indices_arg.value.span, Some(DType::I32)) else {
                    return Val::Error;
                };
                self.node(Op::Gather, &[table, (indices, indices_arg.value.span)], span)
            }
            _ => unreachable!("every op in OPS is lowered above: {name}"),
        }
    }

    /// `3` or `[3, 3]` for a 2-D window or stride.
    fn pair(&mut self, arg: Option<&Arg>, default: usize, what: &str) -> Option<[usize; 2]> {
        let Some(arg) = arg else { return Some([default, default]) };
        let values = self.const_int_list(&arg.value, what)?;
        let valid = values.iter().all(|&v| v >= 1);
        match values.as_slice() {
            [v] if valid => Some([*v as usize, *v as usize]),
            [h, w] if valid => Some([*h as usize, *w as usize]),
            _ => {
                self.diagnostics.push(
                    Diagnostic::error(
                        Code::ARGUMENT_KIND,
                        arg.value.span,
                        format!("{what} is one positive integer or a pair [height, width]"),
                    )
                    .with_label("not a size or pair of sizes"),
                );
                None
            }
        }
    }

    fn padding(&mut self, arg: Option<&Arg>) -> Option<Padding> {
        let Some(arg) = arg else { return Some(Padding::Valid) };
        match &arg.value.kind {
            ExprKind::Str(s) if s == "valid" => Some(Padding::Valid),
            ExprKind::Str(s) if s == "same" => Some(Padding::Same),
            _ => {
                self.diagnostics.push(
                    Diagnostic::error(Code::ARGUMENT_KIND, arg.value.span, "padding is \"valid\" or \"same\"")
                        .with_label("not a padding"),
                );
                None
            }
        }
    }

    /// The shape `reshape` produces, with a single `-1` inferred.
    fn reshape_target(&mut self, x: TensorRef, dims: &[i64], span: Span) -> Option<Shape> {
        let ty = self.graph.ty(x).clone();
        let n = ty.shape.n_elements();
        let unknown: Vec<usize> = dims.iter().enumerate().filter(|(_, &d)| d == -1).map(|(i, _)| i).collect();
        if unknown.len() > 1 || dims.iter().any(|&d| d < -1 || d == 0) {
            self.diagnostics.push(
                Diagnostic::error(Code::INVALID_SHAPE, span, format!("{dims:?} is not a shape"))
                    .with_help("sizes are positive; at most one may be -1 (inferred)"),
            );
            return None;
        }
        let known =
            dims.iter().filter(|&&d| d > 0).try_fold(1usize, |n, &d| n.checked_mul(d as usize)).unwrap_or(usize::MAX);
        let mut shape: Vec<usize> = dims.iter().map(|&d| d.max(0) as usize).collect();
        if let Some(&i) = unknown.first() {
            if known == 0 || !n.is_multiple_of(known) {
                self.diagnostics.push(
                    Diagnostic::error(
                        Code::INVALID_SHAPE,
                        span,
                        format!("cannot reshape {ty} ({n} elements) to {dims:?}"),
                    )
                    .with_help(format!("{n} is not a multiple of {known}")),
                );
                return None;
            }
            shape[i] = n / known;
        }
        Some(Shape(shape))
    }
}
