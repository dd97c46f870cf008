//! Variable initialisation, with Keras's semantics.
//!
//! Each variable draws from its own random stream: `ChaCha8Rng` seeded with
//! `seed ^ fnv1a_64(name)`. A variable's initial value therefore depends only on the seed,
//! its name, its type and its initialiser — adding, removing or reordering other variables
//! changes nothing. Values are drawn as f64 and converted to the variable's type with `as`.
//!
//! Fans (Keras's `_compute_fans`): rank 0 → (1, 1); rank 1 `[n]` → (n, n); rank 2
//! `[in, out]` → (in, out); rank ≥ 3 (a convolution filter `[h, w, in, out]`) → with the
//! receptive field `rf` = the product of all but the last two sizes, (`shape[-2] * rf`,
//! `shape[-1] * rf`).
//!
//! - `zeros`, `ones`, `constant(v)`: every element the same (converted with `as`).
//! - `uniform(min, max)`: `min + (max - min) * u`, `u` uniform in [0, 1).
//! - `normal(mean, stddev)`: `mean + stddev * z`, `z` standard normal.
//! - `truncated_normal(mean, stddev)`: the same, a `z` with `|z| > 2` drawn again (so values
//!   lie within two standard deviations of the mean).
//! - `glorot_uniform`: uniform in [-limit, limit), `limit = sqrt(6 / (fan_in + fan_out))`.
//! - `he_normal`: Keras's `VarianceScaling(scale=2, mode="fan_in",
//!   distribution="truncated_normal")`: truncated normal with mean 0 and stddev
//!   `sqrt(2 / fan_in) / 0.87962566103423978`, the divisor being the standard deviation of a
//!   standard normal truncated to [-2, 2]; so the values' standard deviation is
//!   `sqrt(2 / fan_in)`.
//!
//! Fans below 1 count as 1 (as in Keras), so an empty tensor never divides by zero. The
//! front end gives non-float variables only `zeros`, `ones` and `constant`; a random
//! initialiser on one would be drawn as f64 and converted with `as`.
//!
//! A variable with an `origin` (a shard of a partitioned variable, or a replica's copy) starts
//! from the value that the source variable `origin.name` of the full shape `origin.shape`
//! would get — drawn with that name's seed and that shape's fans — cut to rows
//! `offset .. offset + rows` of axis 0. So a sharded or mirrored model starts bit-identical to
//! the model it came from.

use crate::tensor::Tensor;
use crate::{InterpError, Variables};
use dfc_ir::{DType, Initializer, Module, Op, TensorType, VariableOrigin};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};
use std::collections::HashMap;

/// The 64-bit FNV-1a hash: a stable hash of a name (the same on every platform and release).
pub fn fnv1a_64(bytes: &[u8]) -> u64 {
    const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    bytes.iter().fold(OFFSET_BASIS, |hash, &b| (hash ^ u64::from(b)).wrapping_mul(PRIME))
}

/// The standard deviation of a standard normal truncated to [-2, 2].
const TRUNCATED_STDDEV: f64 = 0.879_625_661_034_239_8;

/// Fills every `Variable` node of the module's graph (parameters and optimizer slots alike)
/// from its initialiser, deterministically from `seed` and the variable's name (or its
/// origin's: see the module documentation).
///
/// Panics on a variable whose origin does not contain it (a plan that `try_initialize`
/// rejects).
pub fn initialize(module: &Module, seed: u64) -> Variables {
    try_initialize(module, seed).unwrap_or_else(|e| panic!("{e}"))
}

/// [`initialize`], with an error for a variable whose origin does not contain it (its rows
/// fall outside the origin's shape, or the other axes differ), as a decoded plan may have.
pub fn try_initialize(module: &Module, seed: u64) -> Result<Variables, InterpError> {
    try_initialize_some(module, seed, &|_| true)
}

/// [`try_initialize`] of the variables whose names `keep` accepts (a worker's own, and the
/// originals its replicas' copies start from), each with the value it has in the whole module.
pub fn try_initialize_some(module: &Module, seed: u64, keep: &dyn Fn(&str) -> bool) -> Result<Variables, InterpError> {
    let mut variables = Variables::default();
    // Full values of the origins, each drawn once.
    let mut origins: HashMap<&str, Tensor> = HashMap::new();
    for id in module.graph.node_ids() {
        let node = module.graph.node(id);
        let Op::Variable { ty, init, origin, .. } = &node.op else { continue };
        if !keep(&node.name) {
            continue;
        }
        let value = match origin.as_deref() {
            None => initial_value(ty, init, &node.name, seed),
            Some(origin) => {
                let malformed = |message: String| InterpError::Malformed { node: node.name.clone(), message };
                let rows = origin_rows(ty, origin).map_err(malformed)?;
                let full = origins.entry(origin.name.as_str()).or_insert_with(|| {
                    initial_value(&TensorType::new(ty.dtype, origin.shape.clone()), init, &origin.name, seed)
                });
                if full.dtype() != ty.dtype || full.shape != origin.shape {
                    return Err(malformed(format!(
                        "it is a part of `{}` as {}, but another part says {}",
                        origin.name,
                        TensorType::new(ty.dtype, origin.shape.clone()),
                        full.ty()
                    )));
                }
                match rows {
                    None => full.clone(),
                    Some(slice) => crate::eval(&slice, &[full]).map_err(|e| malformed(e.to_string()))?,
                }
            }
        };
        variables.insert(node.name.clone(), value);
    }
    Ok(variables)
}

/// The slice of its origin a variable of type `ty` holds: `None` for the whole of it, else
/// the `slice` op that cuts it out.
fn origin_rows(ty: &TensorType, origin: &VariableOrigin) -> Result<Option<Op>, String> {
    let (dims, full) = (ty.shape.dims(), origin.shape.dims());
    if dims == full && origin.offset == 0 {
        return Ok(None);
    }
    let fits = !dims.is_empty()
        && dims.len() == full.len()
        && dims[1..] == full[1..]
        && origin.offset.checked_add(dims[0]).is_some_and(|end| end <= full[0]);
    if !fits {
        return Err(format!(
            "its origin `{}` of shape {} has no rows {}..{} of shape {}",
            origin.name,
            origin.shape,
            origin.offset,
            origin.offset.saturating_add(dims.first().copied().unwrap_or(0)),
            ty.shape
        ));
    }
    let mut begin = vec![0; dims.len()];
    begin[0] = origin.offset;
    Ok(Some(Op::Slice { begin, size: dims.to_vec() }))
}

/// The initial value of the variable `name` of type `ty`, as `initialize` computes it.
pub fn initial_value(ty: &TensorType, init: &Initializer, name: &str, seed: u64) -> Tensor {
    if *init == Initializer::Seed {
        let n = ty.shape.n_elements();
        return match ty.dtype {
            // The run's seed itself, bit for bit (an f64 would round seeds past 2^53).
            DType::I64 => Tensor::new(ty.shape.clone(), crate::Data::I64(vec![seed as i64; n])),
            dtype => Tensor::from_f64(dtype, ty.shape.clone(), &vec![seed as f64; n]),
        };
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ fnv1a_64(name.as_bytes()));
    let n = ty.shape.n_elements();
    let (fan_in, fan_out) = fans(ty.shape.dims());
    let values: Vec<f64> = match *init {
        Initializer::Zeros => vec![0.0; n],
        Initializer::Ones => vec![1.0; n],
        Initializer::Constant { value } => vec![value; n],
        Initializer::Uniform { min, max } => (0..n).map(|_| uniform(&mut rng, min, max)).collect(),
        Initializer::Normal { mean, stddev } => (0..n).map(|_| mean + stddev * standard_normal(&mut rng)).collect(),
        Initializer::TruncatedNormal { mean, stddev } => {
            (0..n).map(|_| mean + stddev * truncated_standard_normal(&mut rng)).collect()
        }
        Initializer::GlorotUniform => {
            let limit = (6.0 / (fan_in + fan_out)).sqrt();
            (0..n).map(|_| uniform(&mut rng, -limit, limit)).collect()
        }
        Initializer::HeNormal => {
            let stddev = (2.0 / fan_in).sqrt() / TRUNCATED_STDDEV;
            (0..n).map(|_| stddev * truncated_standard_normal(&mut rng)).collect()
        }
        Initializer::Seed => unreachable!("returned above"),
    };
    Tensor::from_f64(ty.dtype, ty.shape.clone(), &values)
}

/// Keras's fans of a weight of shape `dims`, each at least 1.
pub fn fans(dims: &[usize]) -> (f64, f64) {
    let (fan_in, fan_out) = match dims {
        [] => (1, 1),
        [n] => (*n, *n),
        [fan_in, fan_out] => (*fan_in, *fan_out),
        [spatial @ .., fan_in, fan_out] => {
            let receptive_field: usize = spatial.iter().product();
            (fan_in * receptive_field, fan_out * receptive_field)
        }
    };
    (fan_in.max(1) as f64, fan_out.max(1) as f64)
}

fn uniform(rng: &mut ChaCha8Rng, min: f64, max: f64) -> f64 {
    min + (max - min) * rng.random::<f64>()
}

fn standard_normal(rng: &mut ChaCha8Rng) -> f64 {
    StandardNormal.sample(rng)
}

/// A standard normal value, drawn again while it lies outside [-2, 2].
fn truncated_standard_normal(rng: &mut ChaCha8Rng) -> f64 {
    loop {
        let z = standard_normal(rng);
        if z.abs() <= 2.0 {
            return z;
        }
    }
}
