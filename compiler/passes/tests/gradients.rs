//! Every gradient that autodiff builds, checked against central finite differences of the loss,
//! in f64, through the reference interpreter.
//!
//! Each case is a small model: params `a` and `b` (random, trainable), fixed random weights `c`
//! (so that the loss is not symmetric in its inputs), and a loss `sum(EXPR * c)`.

use dfc_interp::{Program, Tensor, Variables};
use dfc_ir::{Module, Op};
use std::collections::HashMap;

struct Case {
    name: &'static str,
    /// Declarations of `a` and `b` (types), separated by `; `; `c` gets the type of EXPR.
    params: &'static str,
    expr: &'static str,
}

const CASES: &[Case] = &[
    Case { name: "neg", params: "a: f64[2, 3]", expr: "-a" },
    Case { name: "abs", params: "a: f64[2, 3]", expr: "abs(a + 0.05)" },
    Case { name: "exp", params: "a: f64[2, 3]", expr: "exp(a)" },
    Case { name: "log", params: "a: f64[2, 3]", expr: "log(a * a + 1.0)" },
    Case { name: "sqrt", params: "a: f64[2, 3]", expr: "sqrt(a * a + 1.0)" },
    Case { name: "rsqrt", params: "a: f64[2, 3]", expr: "rsqrt(a * a + 1.0)" },
    Case { name: "relu", params: "a: f64[2, 3]", expr: "relu(a)" },
    Case { name: "sigmoid", params: "a: f64[2, 3]", expr: "sigmoid(a)" },
    Case { name: "tanh", params: "a: f64[2, 3]", expr: "tanh(a)" },
    Case { name: "gelu", params: "a: f64[2, 3]", expr: "gelu(a * 2.0)" },
    Case { name: "add_broadcast", params: "a: f64[2, 3]; b: f64[3]", expr: "a + b" },
    Case { name: "sub_broadcast", params: "a: f64[2, 1]; b: f64[3]", expr: "a - b" },
    Case { name: "mul_broadcast", params: "a: f64[2, 3]; b: f64[1, 3]", expr: "a * b" },
    Case { name: "div", params: "a: f64[2, 3]; b: f64[3]", expr: "a / (b * b + 1.0)" },
    Case { name: "pow", params: "a: f64[2, 3]; b: f64[3]", expr: "pow(a * a + 1.0, b)" },
    Case { name: "maximum", params: "a: f64[2, 3]; b: f64[2, 3]", expr: "maximum(a, b)" },
    Case { name: "minimum", params: "a: f64[2, 3]; b: f64[3]", expr: "minimum(a, b)" },
    Case { name: "select", params: "a: f64[2, 3]; b: f64[2, 3]", expr: "select(a > b, a * 2.0, b * 3.0)" },
    Case { name: "cast", params: "a: f64[2, 3]", expr: "cast<f64>(cast<f32>(a) * 2.0)" },
    Case { name: "matmul", params: "a: f64[2, 3]; b: f64[3, 4]", expr: "a @ b" },
    Case { name: "matmul_transpose_a", params: "a: f64[3, 2]; b: f64[3, 4]", expr: "matmul(a, b, transpose_a = true)" },
    Case { name: "matmul_transpose_b", params: "a: f64[2, 3]; b: f64[4, 3]", expr: "matmul(a, b, transpose_b = true)" },
    Case {
        name: "matmul_transpose_both",
        params: "a: f64[3, 2]; b: f64[4, 3]",
        expr: "matmul(a, b, transpose_a = true, transpose_b = true)",
    },
    Case { name: "matmul_batched", params: "a: f64[2, 2, 3]; b: f64[3, 4]", expr: "a @ b" },
    // A matrix shared by the batches: its gradient is one product over all the rows.
    Case {
        name: "matmul_batched_transpose_b",
        params: "a: f64[2, 2, 3]; b: f64[4, 3]",
        expr: "matmul(a, b, transpose_b = true)",
    },
    Case { name: "matmul_batched_rank_4", params: "a: f64[2, 3, 2, 3]; b: f64[3, 4]", expr: "a @ b" },
    Case {
        name: "matmul_batched_transpose_a",
        params: "a: f64[2, 3, 2]; b: f64[3, 4]",
        expr: "matmul(a, b, transpose_a = true)",
    },
    Case { name: "matmul_batched_both", params: "a: f64[2, 2, 3]; b: f64[2, 3, 4]", expr: "a @ b" },
    Case { name: "reshape", params: "a: f64[2, 3]", expr: "reshape(a, [3, 2]) * reshape(a, [3, 2])" },
    Case { name: "transpose", params: "a: f64[2, 3, 4]", expr: "transpose(a, perm = [2, 0, 1])" },
    Case { name: "concat", params: "a: f64[2, 3]; b: f64[2, 2]", expr: "concat([a, b, a], axis = 1)" },
    Case { name: "slice", params: "a: f64[3, 4]", expr: "slice(a, begin = [1, 1], size = [2, -1])" },
    Case { name: "sum", params: "a: f64[2, 3, 4]", expr: "sum(a, axis = [0, 2])" },
    Case { name: "sum_keep_dims", params: "a: f64[2, 3]", expr: "sum(a, axis = 1, keep_dims = true) * a" },
    Case { name: "mean", params: "a: f64[2, 3]", expr: "mean(a, axis = 0)" },
    Case { name: "max", params: "a: f64[2, 3]", expr: "max(a, axis = 1)" },
    Case { name: "min_all", params: "a: f64[2, 3]", expr: "min(a)" },
    // Ties the graph makes: each row's maximum twice, the minimum four times; they share the
    // gradient (each taking all of it made a's twice and four times too large).
    Case { name: "max_ties", params: "a: f64[2, 3]", expr: "max(concat([a, a], axis = 1), axis = 1)" },
    Case { name: "min_ties", params: "a: f64[2, 3]", expr: "min(concat([a, a, a, a], axis = 0))" },
    Case { name: "softmax", params: "a: f64[2, 5]", expr: "softmax(a)" },
    Case { name: "softmax_axis0", params: "a: f64[3, 2]", expr: "softmax(a, axis = 0)" },
    Case { name: "log_softmax", params: "a: f64[2, 5]", expr: "log_softmax(a)" },
    Case { name: "batch_norm", params: "a: f64[4, 3]", expr: "batch_norm(a * 2.0) * a" },
    Case { name: "batch_norm_images", params: "a: f64[2, 2, 2, 3]", expr: "batch_norm(a, epsilon = 0.1)" },
    Case { name: "batch_norm_synchronized", params: "a: f64[3, 2, 4]", expr: "batch_norm(a, synchronized = true) * a" },
    Case { name: "layer_norm", params: "a: f64[3, 5]", expr: "layer_norm(a * 2.0)" },
    Case { name: "layer_norm_epsilon", params: "a: f64[2, 2, 4]", expr: "layer_norm(a, epsilon = 0.5) * a" },
    Case {
        name: "softmax_cross_entropy",
        params: "a: f64[3, 4]; b: f64[3, 4]",
        expr: "softmax_cross_entropy(a, softmax(b))",
    },
    Case {
        name: "sigmoid_cross_entropy",
        params: "a: f64[2, 3]; b: f64[2, 3]",
        expr: "sigmoid_cross_entropy(a, sigmoid(b))",
    },
    Case { name: "conv2d_valid", params: "a: f64[2, 5, 5, 2]; b: f64[3, 3, 2, 3]", expr: "conv2d(a, b)" },
    Case {
        name: "conv2d_same_strided",
        params: "a: f64[1, 6, 5, 2]; b: f64[3, 2, 2, 2]",
        expr: "conv2d(a, b, strides = 2, padding = \"same\")",
    },
    Case { name: "max_pool", params: "a: f64[1, 4, 4, 2]", expr: "max_pool(a)" },
    Case {
        name: "max_pool_same_overlapping",
        params: "a: f64[1, 5, 5, 1]",
        expr: "max_pool(a, window = 3, strides = 2, padding = \"same\")",
    },
    Case { name: "avg_pool", params: "a: f64[1, 4, 4, 2]", expr: "avg_pool(a)" },
    Case {
        name: "avg_pool_same",
        params: "a: f64[1, 5, 5, 1]",
        expr: "avg_pool(a, window = 3, strides = 2, padding = \"same\")",
    },
    Case { name: "gather", params: "a: f64[5, 3]", expr: "gather(a, [0, 2, 2, 4])" },
    Case { name: "reuse", params: "a: f64[2, 3]", expr: "a * a + exp(a) * a" },
];

/// The model of a case, as source text.
fn source(case: &Case) -> String {
    let mut lines = Vec::new();
    for param in case.params.split("; ") {
        lines.push(format!("    param {param} = uniform(-1.0, 1.0)"));
    }
    lines.push(format!("    let value = {}", case.expr));
    format!("model case {{\n{}\n    minimize value_sum with sgd(lr = 1.0)\n}}\n", lines.join("\n"))
}

/// Builds the module: the expression's value weighted by fixed random `c` and summed.
fn module(case: &Case) -> Module {
    // A first pass finds the value's type, to declare `c`.
    let probe = format!(
        "model probe {{\n{}\n    let value = {}\n    output value\n}}\n",
        case.params.split("; ").map(|p| format!("    param {p}")).collect::<Vec<_>>().join("\n"),
        case.expr
    );
    let (probe_module, diagnostics) = dfc_sema::compile_source(&probe, None, &dfc_sema::Options::default());
    let probe_module = probe_module.unwrap_or_else(|| panic!("{}: {diagnostics:?}", case.name));
    let ty = probe_module.graph.ty(probe_module.outputs[0].tensor).clone();
    let dims: Vec<String> = ty.shape.dims().iter().map(|d| d.to_string()).collect();
    let text = source(case).replace(
        "    let value",
        &format!("    @trainable(false) param c: f64[{}] = uniform(-1.0, 1.0)\n    let value", dims.join(", ")),
    );
    let text = text.replace("minimize value_sum", "minimize sum(value * c)");
    let (module, diagnostics) = dfc_sema::compile_source(&text, None, &dfc_sema::Options::default());
    let mut module = module.unwrap_or_else(|| panic!("{}: {diagnostics:?}\n{text}", case.name));
    dfc_passes::autodiff(&mut module);
    assert!(
        dfc_ir::verify(&module, dfc_ir::VerifyOptions::default()).is_empty(),
        "{}: autodiff broke the IR",
        case.name
    );
    module
}

/// A program as a training step runs it (batch norms use the batch's statistics), without
/// the updates: the loss and its gradients as they are where training differentiates them.
fn training_program(module: &Module, fetches: &[dfc_ir::TensorRef]) -> Program {
    let order = dfc_interp::schedule(&[module]).expect("an order").pop().expect("one module");
    Program::with_mode(module, fetches, &[], &order, true).expect("program")
}

fn loss(module: &Module, variables: &mut Variables) -> f64 {
    let training = module.training.as_ref().expect("a loss");
    let program = training_program(module, &[training.loss]);
    program.run(module, variables, &HashMap::new()).expect("run")[0].scalar_f64()
}

fn with_value(tensor: &Tensor, index: usize, value: f64) -> Tensor {
    let mut values = tensor.to_f64_vec();
    values[index] = value;
    Tensor::from_f64(tensor.dtype(), tensor.shape.clone(), &values)
}

#[test]
fn gradients_match_finite_differences() {
    let mut failures = Vec::new();
    for case in CASES {
        let module = module(case);
        let training = module.training.as_ref().expect("a loss");
        let fetches: Vec<_> = training.gradients.iter().map(|(_, g)| *g).collect();
        let n_params = case.params.split("; ").count();
        if training.gradients.len() != n_params {
            failures.push(format!("{}: {} gradients for {n_params} params", case.name, training.gradients.len()));
            continue;
        }
        let mut variables = dfc_interp::initialize(&module, 7);
        let program = training_program(&module, &fetches);
        let analytic = program.run(&module, &mut variables, &HashMap::new()).expect("run");
        for ((variable, _), grad) in training.gradients.iter().zip(&analytic) {
            let name = module.graph.node(*variable).name.clone();
            assert!(matches!(module.graph.node(*variable).op, Op::Variable { .. }));
            let value = variables.get(&name).expect("initialised").clone();
            let grad = grad.to_f64_vec();
            // Through f32, a step must be large against f32's rounding to be measured.
            let eps = if case.expr.contains("f32") { 1e-2 } else { 1e-6 };
            for (i, x) in value.to_f64_vec().into_iter().enumerate() {
                variables.insert(name.clone(), with_value(&value, i, x + eps));
                let up = loss(&module, &mut variables);
                variables.insert(name.clone(), with_value(&value, i, x - eps));
                let down = loss(&module, &mut variables);
                variables.insert(name.clone(), value.clone());
                let numeric = (up - down) / (2.0 * eps);
                // Through f32 the loss is only as exact as f32, and so are its differences.
                let relative = if case.expr.contains("f32") { 1e-2 } else { 1e-5 };
                let tolerance = relative * (1.0 + numeric.abs().max(grad[i].abs()));
                // Written so that a NaN on either side fails (`NaN > tolerance` would not).
                if !((numeric - grad[i]).abs() <= tolerance) {
                    failures.push(format!(
                        "{}: d loss / d {name}[{i}] is {} by autodiff but {numeric} by finite differences",
                        case.name, grad[i]
                    ));
                    break;
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} gradient(s) wrong:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn stop_gradient_and_integer_paths_get_no_gradient() {
    let text = "model m {\n    param a: f64[3] = uniform(-1.0, 1.0)\n    param b: f64[3] = uniform(-1.0, 1.0)\n    \
                let frozen = stop_gradient(b) * a\n    minimize sum(frozen) with sgd(lr = 1.0)\n}\n";
    let (module, diagnostics) = dfc_sema::compile_source(text, None, &dfc_sema::Options::default());
    let mut module = module.unwrap_or_else(|| panic!("{diagnostics:?}"));
    dfc_passes::autodiff(&mut module);
    let training = module.training.as_ref().expect("a loss");
    let names: Vec<&str> = training.gradients.iter().map(|(v, _)| module.graph.node(*v).name.as_str()).collect();
    assert_eq!(names, ["a"], "only `a` reaches the loss other than through stop_gradient");
}
