//! Each optimizer's update ops, run by the interpreter for a few steps, against the same update
//! rule written out plainly here (TensorFlow's and Keras's formulas, in f64).

use dfc_interp::{Program, Tensor};
use std::collections::HashMap;

#[path = "../../../tests/support/close.rs"]
mod close;

/// The loss `sum(w * w * c) / 2` of `w: f64[3]` has the gradient `w * c`: it changes as `w` does,
/// so slot arithmetic that is off shows up within a few steps.
const C: [f64; 3] = [1.0, -2.0, 0.5];
const W0: [f64; 3] = [0.5, -1.0, 2.0];
const STEPS: usize = 4;

fn trained(optimizer: &str) -> Vec<f64> {
    let text = format!(
        "model m {{\n    param w: f64[3] = zeros\n    @trainable(false) param c: f64[3] = zeros\n    \
         minimize sum(w * w * c) / 2.0 with {optimizer}\n}}\n"
    );
    let (module, diagnostics) = dfc_sema::compile_source(&text, None, &dfc_sema::Options::default());
    let mut module = module.unwrap_or_else(|| panic!("{optimizer}: {diagnostics:?}"));
    dfc_passes::run_pipeline(&mut module, None);
    let mut variables = dfc_interp::initialize(&module, 0);
    variables.insert("w".into(), Tensor::from_f64(dfc_ir::DType::F64, vec![3], &W0));
    variables.insert("c".into(), Tensor::from_f64(dfc_ir::DType::F64, vec![3], &C));
    let training = module.training.as_ref().expect("a loss");
    let program = Program::new(&module, &[training.loss], &training.updates).expect("program");
    for _ in 0..STEPS {
        program.run(&module, &mut variables, &HashMap::new()).expect("step");
    }
    variables.get("w").expect("w").to_f64_vec()
}

/// Runs `update(w, g, step)` for every element, `STEPS` times; `g = w * c`.
fn reference(mut update: impl FnMut(usize, f64, f64, usize) -> f64) -> Vec<f64> {
    let mut w = W0.to_vec();
    for t in 1..=STEPS {
        for i in 0..3 {
            let g = w[i] * C[i];
            w[i] = update(i, w[i], g, t);
        }
    }
    w
}

fn assert_close(optimizer: &str, actual: &[f64], expected: &[f64]) {
    close::assert_close(optimizer, actual, expected, 1e-12);
}

#[test]
fn sgd() {
    let expected = reference(|_, w, g, _| w - 0.1 * g);
    assert_close("sgd", &trained("sgd(lr = 0.1)"), &expected);
}

#[test]
fn sgd_with_weight_decay() {
    let expected = reference(|_, w, g, _| w - 0.1 * g - 0.1 * 0.01 * w);
    assert_close("sgd wd", &trained("sgd(lr = 0.1, weight_decay = 0.01)"), &expected);
}

#[test]
fn momentum_and_nesterov() {
    for nesterov in [false, true] {
        let mut v = [0.0; 3];
        let expected = reference(|i, w, g, _| {
            v[i] = 0.9 * v[i] + g;
            if nesterov {
                w - 0.1 * (g + 0.9 * v[i])
            } else {
                w - 0.1 * v[i]
            }
        });
        let spec = format!("momentum(lr = 0.1, momentum = 0.9, nesterov = {nesterov})");
        assert_close(&spec, &trained(&spec), &expected);
    }
}

#[test]
fn adam() {
    let (mut m, mut v) = ([0.0; 3], [0.0; 3]);
    let (b1, b2, eps, lr) = (0.8, 0.9, 1e-7, 0.05);
    let expected = reference(|i, w, g, t| {
        m[i] = b1 * m[i] + (1.0 - b1) * g;
        v[i] = b2 * v[i] + (1.0 - b2) * g * g;
        let lr_t = lr * (1.0 - b2.powi(t as i32)).sqrt() / (1.0 - b1.powi(t as i32));
        w - lr_t * m[i] / (v[i].sqrt() + eps)
    });
    assert_close("adam", &trained("adam(lr = 0.05, beta1 = 0.8, beta2 = 0.9)"), &expected);
}

#[test]
fn adagrad() {
    let mut a = [0.1; 3];
    let expected = reference(|i, w, g, _| {
        a[i] += g * g;
        w - 0.2 * g / (a[i].sqrt() + 1e-7)
    });
    assert_close("adagrad", &trained("adagrad(lr = 0.2)"), &expected);
}

#[test]
fn rmsprop_with_and_without_momentum() {
    for momentum in [0.0, 0.5] {
        let (mut s, mut u) = ([0.0; 3], [0.0; 3]);
        let expected = reference(|i, w, g, _| {
            s[i] = 0.9 * s[i] + 0.1 * g * g;
            let step = 0.01 * g / (s[i].sqrt() + 1e-7);
            if momentum > 0.0 {
                u[i] = momentum * u[i] + step;
                w - u[i]
            } else {
                w - step
            }
        });
        let spec = format!("rmsprop(lr = 0.01, momentum = {momentum:?})");
        assert_close(&spec, &trained(&spec), &expected);
    }
}
