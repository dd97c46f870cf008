//! Variable initialisation: Keras's semantics, determinism and independence of the variables.

use dfc_interp::{fans, fnv1a_64, initial_value, initialize, Tensor};
use dfc_ir::{DType, Graph, Initializer, Module, Op, TensorType};

fn ty(dtype: DType, dims: &[usize]) -> TensorType {
    TensorType::new(dtype, dims.to_vec())
}

fn module(variables: &[(&str, TensorType, Initializer)]) -> Module {
    let mut graph = Graph::new();
    for (name, ty, init) in variables {
        let op = Op::Variable { ty: ty.clone(), init: init.clone(), trainable: true, partitions: 1, origin: None };
        graph.add(op, &[], name, None).unwrap();
    }
    Module { graph, ..Module::default() }
}

fn mean_std(t: &Tensor) -> (f64, f64) {
    let v = t.to_f64_vec();
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
    (mean, var.sqrt())
}

#[test]
fn fnv1a_matches_the_reference_values() {
    assert_eq!(fnv1a_64(b""), 0xcbf2_9ce4_8422_2325);
    assert_eq!(fnv1a_64(b"a"), 0xaf63_dc4c_8601_ec8c);
    assert_eq!(fnv1a_64(b"foobar"), 0x8594_4171_f739_67e8);
}

#[test]
fn fans_follow_keras() {
    assert_eq!(fans(&[]), (1.0, 1.0));
    assert_eq!(fans(&[7]), (7.0, 7.0));
    assert_eq!(fans(&[784, 256]), (784.0, 256.0));
    assert_eq!(fans(&[3, 3, 16, 32]), (144.0, 288.0));
    assert_eq!(fans(&[5, 4, 2]), (20.0, 10.0));
    assert_eq!(fans(&[0, 5]), (1.0, 5.0));
}

#[test]
fn constant_initializers_on_every_type() {
    for dtype in DType::ALL {
        let zeros = initial_value(&ty(dtype, &[3]), &Initializer::Zeros, "z", 0);
        assert_eq!(zeros, Tensor::zeros(&ty(dtype, &[3])));
        let ones = initial_value(&ty(dtype, &[2, 2]), &Initializer::Ones, "o", 0);
        assert_eq!(ones.to_f64_vec(), [1.0; 4], "{dtype}");
        assert_eq!(ones.dtype(), dtype);
    }
    let c = initial_value(&ty(DType::I32, &[2]), &Initializer::Constant { value: 7.0 }, "c", 0);
    assert_eq!(c.to_vec::<i32>(), [7, 7]);
    let c = initial_value(&ty(DType::F64, &[]), &Initializer::Constant { value: -0.25 }, "c", 0);
    assert_eq!(c.to_vec::<f64>(), [-0.25]);
}

#[test]
fn glorot_uniform_respects_its_limit() {
    let t = initial_value(&ty(DType::F32, &[784, 256]), &Initializer::GlorotUniform, "w", 1);
    let limit = (6.0f64 / (784.0 + 256.0)).sqrt();
    let values = t.to_vec::<f32>();
    assert!(values.iter().all(|&v| f64::from(v.abs()) <= limit), "a value beyond ±{limit}");
    // Uniform on [-limit, limit): mean 0, std limit / sqrt(3); the extremes come close.
    let (mean, std) = mean_std(&t);
    assert!(mean.abs() < 0.002, "mean {mean}");
    assert!((std / (limit / 3f64.sqrt()) - 1.0).abs() < 0.01, "std {std}");
    let max = values.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    assert!(f64::from(max) > 0.999 * limit);
    // Conv filter: fans include the receptive field.
    let f = initial_value(&ty(DType::F64, &[3, 3, 16, 32]), &Initializer::GlorotUniform, "f", 1);
    let limit = (6.0f64 / (144.0 + 288.0)).sqrt();
    assert!(f.to_vec::<f64>().iter().all(|v| v.abs() <= limit));
}

#[test]
fn he_normal_is_a_truncated_normal_of_the_keras_stddev() {
    let t = initial_value(&ty(DType::F32, &[512, 512]), &Initializer::HeNormal, "w", 2);
    let target = (2.0f64 / 512.0).sqrt();
    let (mean, std) = mean_std(&t);
    assert!(mean.abs() < 0.001, "mean {mean}");
    // Keras scales the underlying normal by 1/0.8796 so that the *truncated* values have
    // stddev sqrt(2 / fan_in).
    assert!((std / target - 1.0).abs() < 0.01, "std {std} vs {target}");
    let bound = 2.0 * target / 0.879_625_661_034_239_8;
    assert!(t.to_vec::<f32>().iter().all(|&v| f64::from(v.abs()) <= bound * (1.0 + 1e-6)));
}

#[test]
fn normal_uniform_and_truncated_normal_statistics() {
    let n = ty(DType::F64, &[200_000]);
    let (mean, std) = mean_std(&initial_value(&n, &Initializer::Normal { mean: 3.0, stddev: 2.0 }, "n", 3));
    assert!((mean - 3.0).abs() < 0.02 && (std - 2.0).abs() < 0.02, "{mean} {std}");

    let u = initial_value(&n, &Initializer::Uniform { min: -1.0, max: 3.0 }, "u", 3);
    assert!(u.to_vec::<f64>().iter().all(|&v| (-1.0..3.0).contains(&v)));
    let (mean, std) = mean_std(&u);
    assert!((mean - 1.0).abs() < 0.02 && (std - 4.0 / 12f64.sqrt()).abs() < 0.02, "{mean} {std}");

    let tn = initial_value(&n, &Initializer::TruncatedNormal { mean: -1.0, stddev: 0.5 }, "t", 3);
    assert!(tn.to_vec::<f64>().iter().all(|&v| (v + 1.0).abs() <= 1.0), "beyond two standard deviations");
    let (mean, std) = mean_std(&tn);
    assert!((mean + 1.0).abs() < 0.01 && (std - 0.5 * 0.879_625_661_034_239_8).abs() < 0.01, "{mean} {std}");
}

#[test]
fn initialization_is_deterministic_and_per_variable() {
    let w = ("w", ty(DType::F32, &[30, 20]), Initializer::GlorotUniform);
    let b = ("b", ty(DType::F32, &[20]), Initializer::Normal { mean: 0.0, stddev: 1.0 });
    let v = ("v", ty(DType::F64, &[4, 4]), Initializer::HeNormal);
    let one = module(std::slice::from_ref(&w));
    let three = module(&[b.clone(), v.clone(), w.clone()]);

    let first = initialize(&one, 42);
    assert_eq!(first, initialize(&one, 42), "the same seed gives the same values");
    assert_ne!(first.get("w"), initialize(&one, 43).get("w"), "another seed gives other values");
    let all = initialize(&three, 42);
    assert_eq!(all.len(), 3);
    assert_eq!(all.get("w"), first.get("w"), "other variables do not change w");
    // Two variables of the same type and initialiser still differ: the name seeds the stream.
    let twins = module(&[
        ("p", ty(DType::F32, &[8]), Initializer::GlorotUniform),
        ("q", ty(DType::F32, &[8]), Initializer::GlorotUniform),
    ]);
    let twins = initialize(&twins, 42);
    assert_ne!(twins.get("p"), twins.get("q"));
    assert_eq!(twins.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), ["p", "q"]);
}
