//! Random programs, as Csmith is for C compilers: models built at random from the language's
//! ops (broadcasting, reductions over any axes, row ops, products, layout ops, convolution,
//! pooling, gathers, casts of integers and bytes, comparisons, random ops, batch norms, shared
//! subexpressions, layers called once or more; f32 or f64; every optimizer).
//!
//! - Each is trained for two steps by the reference interpreter and by every backend and
//!   placement, which must agree: the forward pass's outputs, the losses, and every variable
//!   after the steps (so the gradients too). The PTX of its plans on one GPU and placed on two
//!   is generated, with an entry for every launch, and NVIDIA's `ptxas` assembles it for sm_80
//!   and sm_90 (where it is installed: `.ci/run` does).
//! - Per-example programs (every input leads with the `batch` axis, no op mixes two examples'
//!   rows, batch norms are synchronised, the loss and metric are means over the batch) are
//!   trained by replicas, mirrored, on parameter servers and in central storage, which must
//!   give the interpreter's results on one device, every replica's copy of a variable alike;
//!   the PTX of their plan mirrored on two GPUs is assembled as above.
//!   Through the `dfc` binary, from .npy files, one process and spawned `dfc worker`s
//!   (mirrored, overlapped and unfused, local SGD, the model split over two, sync ps with
//!   variables split over two ps over TLS, one asynchronous worker with them split over two
//!   ps, and mirrored on four workers of two hosts, whose all-reduces are then hierarchical:
//!   shared memory within a host, TCP between the hosts) must end an epoch with the same
//!   checkpoint, and two asynchronous ones (variables split over two ps) in lockstep with that
//!   of their plan in one process, and free running the same epoch; `--fetch` of each output
//!   from the checkpoints gives the same values on workers as in one process.
//! - All of them differentiate with the same autodiff: small f64 programs' gradients are checked
//!   against central finite differences of their loss.
//! - `dfc fmt` of each is stable and the same model.
//! - The language server reads each without an error, answers at every offset, and renaming
//!   any of the model's names gives the same model under the new name.
//!
//! `DFC_RANDOM_PROGRAMS=N` runs N programs in each test (by default 100, 100, 10, 1,000, 1,000 and 300), from
//! seed `DFC_RANDOM_SEED` (default 0): a failure names its seed and prints the program, which
//! `dfc check` reads as it is.

use dfc_compile::{compile, CompileOptions, Strategy};
use dfc_driver::{Backend, Session};
use dfc_interp::Tensor;
use dfc_ir::{Cluster, DType, DeviceKind};
use dfc_plan::Plan;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

#[path = "support/ps_cluster.rs"]
mod ps_cluster;
use ps_cluster::ps_cluster;
#[path = "support/ptxas.rs"]
mod ptxas;
#[path = "support/skip.rs"]
mod skip;

/// f32 results within this, relative to 1 + |reference|: products, convolutions and the
/// gradients' sums add in other orders than the interpreter's.
const TOLERANCE: f64 = 1e-4;
const STEPS: usize = 2;

/// The example axis of a per-example program's shapes, written `batch`: a size no other axis
/// has, so that an op that would move it or mix its rows is seen.
const BATCH: usize = 1 << 20;

/// Whether `shape`'s leading axis is the batch's: a value computed per example.
fn batched(shape: &[usize]) -> bool {
    shape.first() == Some(&BATCH)
}

/// How an input is fed.
#[derive(Clone, Copy)]
enum Feed {
    /// Floats in [-1, 1).
    Floats,
    /// Integers in [-4, 4].
    Integers,
    /// Bytes.
    Bytes,
    /// Indices in [0, n).
    Indices(i32),
    /// A `one_hot` of depth d's labels: in [0, d], where d (out of range) gives a row of zeros.
    Labels(i32),
}

/// A model being built: its declarations, its `let`s in order, and the `let`s a leaf may reuse.
struct Generator {
    rng: fastrand::Rng,
    /// The program's float type: `f32`, or now and then `f64`.
    float: &'static str,
    declarations: Vec<String>,
    lets: Vec<String>,
    shared: Vec<(String, Vec<usize>)>,
    feeds: HashMap<String, Feed>,
    names: usize,
    /// No large axes: a finite-difference check runs the loss twice per parameter element.
    small: bool,
    /// The layers defined so far, and the shape each takes and returns.
    layers: Vec<(String, Vec<usize>)>,
    /// Inside a layer's body: the shape of its argument `x` (no model inputs there).
    in_layer: Option<Vec<usize>>,
    /// A per-example program's batch size: every input leads with the `batch` axis, no op mixes
    /// two examples' rows, and a value without the axis is computed from params alone, so that
    /// data parallelism must give one device's results.
    batch: Option<usize>,
}

fn typed(dtype: &str, shape: &[usize]) -> String {
    if shape.is_empty() {
        dtype.to_string()
    } else {
        format!("{dtype}[{}]", list(shape))
    }
}

fn list(values: &[usize]) -> String {
    let dim = |&d: &usize| if d == BATCH { "batch".to_string() } else { d.to_string() };
    values.iter().map(dim).collect::<Vec<_>>().join(", ")
}

impl Generator {
    fn new(seed: u64) -> Generator {
        let mut rng = fastrand::Rng::with_seed(seed);
        let float = if rng.u8(..5) == 0 { "f64" } else { "f32" };
        Generator::with(rng, float, false)
    }

    fn with(rng: fastrand::Rng, float: &'static str, small: bool) -> Generator {
        Generator {
            rng,
            float,
            declarations: Vec::new(),
            lets: Vec::new(),
            shared: Vec::new(),
            feeds: HashMap::new(),
            names: 0,
            small,
            layers: Vec::new(),
            in_layer: None,
            batch: None,
        }
    }

    /// A per-example program's generator: a batch of 4 or 8.
    fn per_example(seed: u64) -> Generator {
        let mut rng = fastrand::Rng::with_seed(seed ^ 0xba7c4);
        let float = if rng.u8(..5) == 0 { "f64" } else { "f32" };
        let mut generator = Generator::with(rng, float, false);
        generator.batch = Some(if generator.rng.u8(..4) == 0 { 8 } else { 4 });
        generator
    }

    fn name(&mut self, prefix: &str) -> String {
        self.names += 1;
        format!("{prefix}{}", self.names)
    }

    /// `expression` as one value that can be written twice: a `let` of it, unless it is a name
    /// or a number. Written out twice, a layer call in it would be two calls (each with params
    /// of its own) and a random op two draws, so that `y * y + 1.0` could come near 0.
    fn once(&mut self, expression: String) -> String {
        let plain = expression.parse::<f64>().is_ok() || expression.chars().all(|c| c.is_alphanumeric() || c == '_');
        if plain {
            return expression;
        }
        let name = self.name("v");
        self.lets.push(format!("let {name} = {expression}"));
        name
    }

    fn input(&mut self, dtype: &str, shape: &[usize], feed: Feed) -> String {
        let name = self.name("x");
        self.declarations.push(format!("input {name}: {}", typed(dtype, shape)));
        self.feeds.insert(name.clone(), feed);
        name
    }

    fn param(&mut self, shape: &[usize]) -> String {
        let name = self.name("w");
        self.declarations.push(format!("param {name}: {} = uniform(-1, 1)", typed(self.float, shape)));
        name
    }

    /// A size for a new axis of a tensor of `shape` without it: mostly small, now and then
    /// past codegen's unrolled rows (16), or large enough for blocked products and threads.
    fn size(&mut self, shape: &[usize]) -> usize {
        let elements: usize = shape.iter().product();
        match self.rng.u8(..30) {
            0..=2 if !self.small => self.rng.usize(17..40),
            3 if elements <= 4096 && !self.small => self.rng.usize(64..160),
            _ => self.rng.usize(1..6),
        }
    }

    /// A shape that broadcasts to `shape`: leading axes dropped, some axes 1.
    fn broadcast_shape(&mut self, shape: &[usize]) -> Vec<usize> {
        let dropped = self.rng.usize(..=shape.len());
        shape[dropped..].iter().map(|&d| if self.rng.u8(..10) < 3 { 1 } else { d }).collect()
    }

    /// An expression of exactly `shape`.
    fn exact(&mut self, shape: &[usize], depth: u32) -> String {
        if depth == 0 || self.rng.u8(..10) < 2 {
            return self.leaf(shape);
        }
        let expression = self.op(shape, depth - 1);
        if self.rng.u8(..10) < 2 {
            let name = self.name("v");
            self.lets.push(format!("let {name} = {expression}"));
            self.shared.push((name.clone(), shape.to_vec()));
            name
        } else {
            expression
        }
    }

    /// An expression that broadcasts to `shape`: of it, of a broadcast shape, or a number.
    fn operand(&mut self, shape: &[usize], depth: u32) -> String {
        match self.rng.u8(..10) {
            0 => format!("{:.2}", self.rng.f32() * 2.0 - 0.5),
            1..=3 => {
                let smaller = self.broadcast_shape(shape);
                self.exact(&smaller, depth)
            }
            _ => self.exact(shape, depth),
        }
    }

    fn leaf(&mut self, shape: &[usize]) -> String {
        let reusable: Vec<String> =
            self.shared.iter().filter(|(_, s)| s.as_slice() == shape).map(|(n, _)| n.clone()).collect();
        let argument = self.in_layer.as_deref() == Some(shape);
        // In a per-example program, only a value without the batch axis may be a param, and
        // only one with it an input.
        let per_example = batched(shape);
        match self.rng.u8(..10) {
            0..=1 if !reusable.is_empty() => reusable[self.rng.usize(..reusable.len())].clone(),
            0..=4 if !per_example => self.param(shape),
            _ if argument => "x".to_string(),
            _ if per_example && self.in_layer.is_some() => self.from_argument(shape),
            // Most values without the batch axis are an operand's broadcast: scale some inputs
            // by a param, so that most per-example programs have something to train.
            _ if per_example && self.rng.u8(..3) == 0 => {
                let x = self.input(self.float, shape, Feed::Floats);
                let weight = self.param(&shape[1..]);
                format!("({x} * {weight})")
            }
            _ if self.in_layer.is_some() || self.batch.is_some() && !per_example => self.param(shape),
            _ => self.input(self.float, shape, Feed::Floats),
        }
    }

    /// Inside a layer of a per-example program, a value of `shape` (batched) from the argument
    /// `x`: each example's sum, times a param.
    fn from_argument(&mut self, shape: &[usize]) -> String {
        let rank = self.in_layer.as_ref().map_or(1, Vec::len);
        let summed = if rank > 1 {
            format!("sum(x, axis = [{}])", list(&(1..rank).collect::<Vec<_>>()))
        } else {
            "x".to_string()
        };
        if shape.len() == 1 {
            return summed;
        }
        let weight = self.param(&shape[1..]);
        format!("(reshape({summed}, [{}]) * {weight})", list(&[vec![BATCH], vec![1; shape.len() - 1]].concat()))
    }

    /// A call of a layer that takes and returns `shape`: one defined before, or a new one.
    fn layer_call(&mut self, shape: &[usize], depth: u32) -> String {
        let fitting: Vec<usize> = (0..self.layers.len()).filter(|&i| self.layers[i].1 == shape).collect();
        let index = if !fitting.is_empty() && self.rng.bool() {
            fitting[self.rng.usize(..fitting.len())]
        } else {
            self.define_layer(shape, depth)
        };
        let argument = self.exact(shape, depth);
        format!("l{index}({argument})")
    }

    /// A layer of `x` of `shape` to a value of `shape`, with params, `let`s and random ops of
    /// its own; some axes of its signature are shape parameters, bound at each call.
    fn define_layer(&mut self, shape: &[usize], depth: u32) -> usize {
        let outer =
            (std::mem::take(&mut self.declarations), std::mem::take(&mut self.lets), std::mem::take(&mut self.shared));
        self.in_layer = Some(shape.to_vec());
        let body = self.exact(shape, depth);
        self.in_layer = None;
        let declarations = std::mem::replace(&mut self.declarations, outer.0);
        let lets = std::mem::replace(&mut self.lets, outer.1);
        self.shared = outer.2;
        let axes: Vec<String> = shape
            .iter()
            .enumerate()
            .map(|(i, &d)| match d {
                BATCH => "batch".to_string(),
                _ if self.rng.bool() => format!("d{i}"),
                _ => d.to_string(),
            })
            .collect();
        let ty = if shape.is_empty() { self.float.to_string() } else { format!("{}[{}]", self.float, axes.join(", ")) };
        let statements: String = declarations.iter().chain(&lets).map(|l| format!("    {l}\n")).collect();
        let index = self.layers.len();
        let text = format!("layer l{index}(x: {ty}) -> {ty} {{\n{statements}    return {body}\n}}\n");
        self.layers.push((text, shape.to_vec()));
        index
    }

    fn op(&mut self, shape: &[usize], depth: u32) -> String {
        let rank = shape.len();
        loop {
            let outside = self.in_layer.is_none();
            // Model inputs of their own: not in a layer, nor in a per-example program's value
            // without the batch axis.
            let fed = outside && (self.batch.is_none() || batched(shape));
            let chosen = match self.rng.u8(..23) {
                0..=2 => Some(self.unary(shape, depth)),
                3..=5 => Some(self.binary(shape, depth)),
                6 => Some(self.select(shape, depth)),
                7..=8 => self.reduction(shape, depth),
                9 => self.row_op(shape, depth),
                10 => self.product(shape, depth),
                11 => self.transpose(shape, depth),
                12 => self.concat(shape, depth),
                13 => self.slice(shape, depth),
                14 => self.reshape(shape, depth),
                15 if fed => self.gather(shape),
                16 if fed => self.one_hot(shape),
                17 if rank == 4 => Some(self.window(shape, depth)),
                18 if rank >= 2 => Some(self.batch_norm(shape, depth)),
                // Each replica draws bits of its own.
                19 if self.batch.is_none() => Some(self.random(shape, depth)),
                20 if fed => Some(self.integers(shape, depth)),
                21 => Some(self.comparison(shape, depth)),
                22 if outside => Some(self.layer_call(shape, depth)),
                _ => None,
            };
            if let Some(expression) = chosen {
                return expression;
            }
        }
    }

    fn unary(&mut self, shape: &[usize], depth: u32) -> String {
        let x = self.exact(shape, depth);
        let ops = [
            "-",
            "abs",
            "relu",
            "tanh",
            "sigmoid",
            "gelu",
            "exp_tanh",
            "log_sigmoid",
            "rsqrt_square",
            "sqrt_shifted",
            "identity",
            "stop_gradient",
        ];
        // Finite differences see through `stop_gradient`: leave it out of the programs they check.
        let choices = if self.small { ops.len() - 1 } else { ops.len() };
        match ops[self.rng.usize(..choices)] {
            "-" => format!("-{x}"),
            "exp_tanh" => format!("exp(tanh({x}))"),
            "log_sigmoid" => format!("log(sigmoid({x}))"),
            "rsqrt_square" => {
                let x = self.once(x);
                format!("rsqrt({x} * {x} + 1.0)")
            }
            "sqrt_shifted" => format!("sqrt(abs({x}) + 0.5)"),
            op => format!("{op}({x})"),
        }
    }

    fn binary(&mut self, shape: &[usize], depth: u32) -> String {
        let x = self.exact(shape, depth);
        let y = self.operand(shape, depth);
        let (x, y) = if self.rng.bool() { (x, y) } else { (y, x) };
        match self.rng.u8(..7) {
            0 => format!("({x} + {y})"),
            1 => format!("({x} - {y})"),
            2 => format!("({x} * {y})"),
            3 => {
                let y = self.once(y);
                format!("({x} / ({y} * {y} + 1.0))")
            }
            4 => format!("maximum({x}, {y})"),
            5 => format!("minimum({x}, {y})"),
            // The base's own operand, not a number: `sigmoid(0.5)` would be an f32.
            _ => format!("pow(sigmoid({}) + 0.5, {y})", self.exact(shape, depth)),
        }
    }

    /// A batch norm; in a per-example program synchronised, so that replicas normalise by the
    /// whole batch's statistics as one device does.
    fn batch_norm(&mut self, shape: &[usize], depth: u32) -> String {
        let x = self.exact(shape, depth);
        if self.batch.is_some() {
            format!("batch_norm({x}, synchronized = true)")
        } else {
            format!("batch_norm({x})")
        }
    }

    /// Random bits, which every backend must draw alike.
    fn random(&mut self, shape: &[usize], depth: u32) -> String {
        let x = self.exact(shape, depth);
        let rate = [0.0, 0.25, 0.5][self.rng.usize(..3)];
        let dims = format!("[{}]", list(shape));
        let cast = |bits: String, float: &str| if float == "f32" { bits } else { format!("cast<{float}>({bits})") };
        match self.rng.u8(..3) {
            0 => format!("dropout({x}, {rate})"),
            1 => format!("({x} * {})", cast(format!("random_uniform({dims})"), self.float)),
            _ => format!("({x} + {})", cast(format!("random_normal({dims}, stddev = 0.5)"), self.float)),
        }
    }

    /// Integers and bytes, cast to the float type: no gradient flows through them.
    fn integers(&mut self, shape: &[usize], depth: u32) -> String {
        let float = self.float;
        let i = self.input("i32", shape, Feed::Integers);
        let mut j_shape = self.broadcast_shape(shape);
        if self.batch.is_some() && !batched(&j_shape) {
            j_shape = shape.to_vec();
        }
        let j = self.input("i32", &j_shape, Feed::Integers);
        let integers = match self.rng.u8(..7) {
            0 => format!("({i} + {j})"),
            1 => format!("({i} * {j} - 3)"),
            2 => format!("maximum({i}, {j})"),
            3 => format!("abs({i}) / (abs({j}) + 1)"),
            4 => format!("relu(-{i})"),
            5 => {
                let bytes = self.input("u8", shape, Feed::Bytes);
                return format!("(cast<{float}>({bytes}) / 255.0)");
            }
            _ => {
                let mut inner = shape.to_vec();
                inner.push(self.rng.usize(1..8));
                return format!("cast<{float}>(argmax({}))", self.exact(&inner, depth));
            }
        };
        format!("(cast<{float}>({integers}) * 0.1)")
    }

    /// A comparison's booleans as floats.
    fn comparison(&mut self, shape: &[usize], depth: u32) -> String {
        let x = self.exact(shape, depth);
        let y = self.operand(shape, depth);
        let op = ["<", "<=", ">", ">=", "==", "!="][self.rng.usize(..6)];
        format!("cast<{}>({x} {op} {y})", self.float)
    }

    fn select(&mut self, shape: &[usize], depth: u32) -> String {
        let a = self.exact(shape, depth);
        let b = self.operand(shape, depth);
        // One branch typed by an operand: of two numbers, the select would be an f32.
        let x = self.exact(shape, depth);
        let y = self.operand(shape, depth);
        let (x, y) = if self.rng.bool() { (x, y) } else { (y, x) };
        format!("select({a} > {b}, {x}, {y})")
    }

    fn reduction(&mut self, shape: &[usize], depth: u32) -> Option<String> {
        let op = ["sum", "mean", "max", "min"][self.rng.usize(..4)];
        let ones: Vec<usize> = (0..shape.len()).filter(|&a| shape[a] == 1).collect();
        if !ones.is_empty() && self.rng.bool() {
            let axis = ones[self.rng.usize(..ones.len())];
            let mut inner = shape.to_vec();
            inner[axis] = self.size(shape);
            let x = self.exact(&inner, depth);
            return Some(format!("{op}({x}, axis = {axis}, keep_dims = true)"));
        }
        if shape.len() >= 4 {
            return None;
        }
        let mut inner = shape.to_vec();
        // Never over the examples, nor before them.
        let lowest = usize::from(batched(shape));
        let first = self.rng.usize(lowest..=inner.len());
        let size = self.size(shape);
        inner.insert(first, size);
        let mut axes = vec![first];
        if inner.len() < 4 && self.rng.bool() {
            let second = self.rng.usize(lowest..=inner.len());
            let size = self.rng.usize(1..5);
            inner.insert(second, size);
            axes = axes.into_iter().map(|a| if a >= second { a + 1 } else { a }).collect();
            axes.push(second);
        }
        let x = self.exact(&inner, depth);
        Some(if axes.len() == inner.len() && self.rng.bool() {
            format!("{op}({x})")
        } else if axes.len() == 1 {
            let axis = if self.rng.bool() { axes[0] as i64 } else { axes[0] as i64 - inner.len() as i64 };
            format!("{op}({x}, axis = {axis})")
        } else {
            format!("{op}({x}, axis = [{}])", list(&axes))
        })
    }

    fn row_op(&mut self, shape: &[usize], depth: u32) -> Option<String> {
        // Rows within an example: the batch axis is never a row's.
        let lowest = usize::from(batched(shape));
        if shape.len() <= lowest {
            return None;
        }
        let x = self.exact(shape, depth);
        let axis = self.rng.usize(lowest..shape.len());
        Some(match self.rng.u8(..5) {
            0 => format!("softmax({x})"),
            1 => format!("softmax({x}, axis = {axis})"),
            2 => format!("log_softmax({x}, axis = {axis})"),
            3 => format!("layer_norm({x})"),
            _ => format!("sigmoid_cross_entropy({x}, sigmoid({}))", self.exact(shape, depth)),
        })
    }

    fn product(&mut self, shape: &[usize], depth: u32) -> Option<String> {
        let rank = shape.len();
        if !(2..=3).contains(&rank) {
            if rank == 1 && self.rng.bool() {
                // softmax cross-entropy drops the last axis
                let mut logits = shape.to_vec();
                logits.push(self.size(shape));
                let x = self.exact(&logits, depth);
                let labels = self.exact(&logits, depth);
                return Some(format!("softmax_cross_entropy({x}, softmax({labels}))"));
            }
            return None;
        }
        let (m, n) = (shape[rank - 2], shape[rank - 1]);
        let k = self.size(shape);
        // A transposed operand of a batch's rows would put the examples on its last axis.
        let (ta, tb) = (self.rng.bool() && m != BATCH, self.rng.bool());
        let batch = &shape[..rank - 2];
        let mut a: Vec<usize> = batch.to_vec();
        a.extend(if ta { [k, m] } else { [m, k] });
        let mut b: Vec<usize> = if self.rng.bool() { batch.to_vec() } else { Vec::new() };
        b.extend(if tb { [n, k] } else { [k, n] });
        let x = self.exact(&a, depth);
        let y = self.exact(&b, depth);
        Some(if !ta && !tb && self.rng.bool() {
            format!("({x} @ {y})")
        } else {
            format!("matmul({x}, {y}, transpose_a = {ta}, transpose_b = {tb})")
        })
    }

    fn transpose(&mut self, shape: &[usize], depth: u32) -> Option<String> {
        if shape.len() < 2 {
            return None;
        }
        let mut perm: Vec<usize> = (0..shape.len()).collect();
        let fixed = usize::from(batched(shape));
        self.rng.shuffle(&mut perm[fixed..]);
        // Result axis i is input axis perm[i].
        let mut inner = vec![0; shape.len()];
        for (i, &p) in perm.iter().enumerate() {
            inner[p] = shape[i];
        }
        let x = self.exact(&inner, depth);
        Some(format!("transpose({x}, perm = [{}])", list(&perm)))
    }

    fn concat(&mut self, shape: &[usize], depth: u32) -> Option<String> {
        let lowest = usize::from(batched(shape));
        let axes: Vec<usize> = (lowest..shape.len()).filter(|&a| shape[a] >= 2).collect();
        if axes.is_empty() {
            return None;
        }
        let axis = axes[self.rng.usize(..axes.len())];
        let first = self.rng.usize(1..shape[axis]);
        let (mut a, mut b) = (shape.to_vec(), shape.to_vec());
        a[axis] = first;
        b[axis] = shape[axis] - first;
        let (x, y) = (self.exact(&a, depth), self.exact(&b, depth));
        Some(format!("concat([{x}, {y}], axis = {axis})"))
    }

    fn slice(&mut self, shape: &[usize], depth: u32) -> Option<String> {
        if shape.is_empty() {
            return None;
        }
        let mut extra: Vec<usize> = shape.iter().map(|_| self.rng.usize(..3)).collect();
        if batched(shape) {
            extra[0] = 0;
        }
        let inner: Vec<usize> = shape.iter().zip(&extra).map(|(d, e)| d + e).collect();
        let begin: Vec<usize> = extra.iter().map(|&e| self.rng.usize(..=e)).collect();
        let x = self.exact(&inner, depth);
        Some(format!("slice({x}, [{}], [{}])", list(&begin), list(shape)))
    }

    fn reshape(&mut self, shape: &[usize], depth: u32) -> Option<String> {
        if batched(shape) {
            return self.reshape_examples(shape, depth);
        }
        let count: usize = shape.iter().product();
        let inner: Vec<usize> = match self.rng.u8(..3) {
            0 => vec![count],
            1 => shape.iter().rev().copied().collect(),
            _ if shape.len() >= 2 => {
                let mut s = shape.to_vec();
                let last = s.pop().unwrap();
                *s.last_mut().unwrap() *= last;
                s
            }
            _ => return None,
        };
        let x = self.exact(&inner, depth);
        Some(if shape.len() >= 2 && self.rng.bool() {
            format!("reshape({x}, [-1, {}])", list(&shape[1..]))
        } else {
            format!("reshape({x}, [{}])", list(shape))
        })
    }

    /// A reshape of each example: the batch axis stays first.
    fn reshape_examples(&mut self, shape: &[usize], depth: u32) -> Option<String> {
        let rest = &shape[1..];
        let inner_rest: Vec<usize> = match self.rng.u8(..3) {
            0 => vec![rest.iter().product()],
            1 => rest.iter().rev().copied().collect(),
            _ if rest.len() >= 2 => {
                let mut s = rest.to_vec();
                let last = s.pop().unwrap();
                *s.last_mut().unwrap() *= last;
                s
            }
            _ => return None,
        };
        let x = self.exact(&[vec![BATCH], inner_rest].concat(), depth);
        Some(if !rest.is_empty() && self.rng.bool() {
            format!("reshape({x}, [-1, {}])", list(rest))
        } else {
            format!("reshape({x}, [{}])", list(shape))
        })
    }

    fn gather(&mut self, shape: &[usize]) -> Option<String> {
        if shape.len() < 2 {
            return None;
        }
        let split = self.rng.usize(1..shape.len());
        let rows = self.rng.usize(1..8);
        let mut table = vec![rows];
        table.extend(&shape[split..]);
        let table = self.param(&table);
        let indices = self.input("i32", &shape[..split], Feed::Indices(rows as i32));
        Some(format!("gather({table}, {indices})"))
    }

    fn one_hot(&mut self, shape: &[usize]) -> Option<String> {
        let (&depth, outer) = shape.split_last()?;
        if self.batch.is_some() && !batched(outer) {
            return None;
        }
        let indices = self.input("i32", outer, Feed::Labels(depth as i32));
        Some(format!("one_hot<{}>({indices}, {depth})", self.float))
    }

    /// A convolution or pooling whose output is `shape` (NHWC).
    fn window(&mut self, shape: &[usize], depth: u32) -> String {
        let stride = self.rng.usize(1..3);
        let window = self.rng.usize(1..4);
        let same = self.rng.bool();
        // The input size whose output is `out`: valid (in − k) / s + 1, same ⌈in / s⌉.
        let input_size = |out: usize, rng: &mut fastrand::Rng| {
            if same {
                (out - 1) * stride + rng.usize(1..=stride)
            } else {
                (out - 1) * stride + window
            }
        };
        let (h, w) = (input_size(shape[1], &mut self.rng), input_size(shape[2], &mut self.rng));
        let padding = if same { "same" } else { "valid" };
        let options = format!("strides = {stride}, padding = \"{padding}\"");
        match self.rng.u8(..3) {
            0 => {
                let channels = self.rng.usize(1..5);
                let x = self.exact(&[shape[0], h, w, channels], depth);
                let filter = self.param(&[window, window, channels, shape[3]]);
                format!("conv2d({x}, {filter}, {options})")
            }
            pool => {
                let x = self.exact(&[shape[0], h, w, shape[3]], depth);
                let op = if pool == 1 { "max_pool" } else { "avg_pool" };
                format!("{op}({x}, window = {window}, {options})")
            }
        }
    }
}

/// The model of `seed`, and how each input is fed.
fn program(seed: u64) -> (String, HashMap<String, Feed>) {
    program_of(Generator::new(seed))
}

fn program_of(mut generator: Generator) -> (String, HashMap<String, Feed>) {
    let rank = generator.rng.usize(..5);
    let mut shape: Vec<usize> = (0..rank).map(|_| generator.rng.usize(1..6)).collect();
    let per_example = generator.batch.is_some();
    if per_example {
        shape.insert(0, BATCH);
        shape.truncate(4);
    }
    let depth = generator.rng.u32(2..6);
    let y = generator.exact(&shape, depth);
    let target = generator.input(generator.float, &shape, Feed::Floats);
    let optimizer = optimizer(&mut generator.rng);
    // Now and then a shared value is an output too: fetched, not only consumed.
    let mut outputs = vec!["y".to_string()];
    if !generator.shared.is_empty() && generator.rng.bool() {
        outputs.push(generator.shared[generator.rng.usize(..generator.shared.len())].0.clone());
    }
    let mut lines: Vec<String> = generator.batch.iter().map(|b| format!("dim batch = {b}")).collect();
    lines.extend(generator.declarations);
    lines.extend(generator.lets);
    lines.push(format!("let y = {y}"));
    lines.push(format!("output {}", outputs.join(", ")));
    // An output and a metric of expressions of their own.
    if generator.rng.bool() {
        lines.push("output exp(tanh(y) * 2.0) as scaled".to_string());
    }
    // A per-example program's metric and loss are means over the batch, which replicas give
    // as the mean of theirs.
    if generator.rng.bool() {
        lines
            .push(if per_example { "metric centre = mean(tanh(y))" } else { "metric spread = max(y) - min(y)" }.into());
    }
    let total = if per_example { "mean" } else { "sum" };
    lines.push(format!("minimize {total}(y * {target}) with {optimizer}"));
    let body: String = lines.iter().map(|l| format!("    {l}\n")).collect();
    let layers: String = generator.layers.iter().map(|(text, _)| format!("{text}\n")).collect();
    (format!("{layers}model random {{\n{body}}}\n"), generator.feeds)
}

/// An optimizer: each kind, now and then with decay, clipping or a schedule. Adam's and
/// RMSProp's epsilons are large, so that a gradient of rounding's size (a difference of two
/// orders of summation) does not become a whole step of one backend's and not the other's.
fn optimizer(rng: &mut fastrand::Rng) -> String {
    let lr = if rng.u8(..4) == 0 { "exponential_decay(0.1, 1, 0.5)" } else { "0.05" };
    let mut arguments = vec![format!("lr = {lr}")];
    let name = match rng.u8(..5) {
        0 => "sgd",
        1 => {
            arguments.push(format!("nesterov = {}", rng.bool()));
            "momentum"
        }
        2 => {
            arguments.push("epsilon = 0.1".into());
            "adam"
        }
        3 => "adagrad",
        _ => {
            arguments.push("momentum = 0.5, epsilon = 0.1".into());
            "rmsprop"
        }
    };
    if rng.u8(..4) == 0 {
        arguments.push("weight_decay = 0.01".into());
    }
    if rng.u8(..4) == 0 {
        arguments.push("clip_global_norm = 1.0".into());
    }
    format!("{name}({})", arguments.join(", "))
}

fn batches(plan: &Plan, feeds: &HashMap<String, Feed>, seed: u64) -> Vec<HashMap<String, Tensor>> {
    let inputs: Vec<(String, dfc_ir::TensorType)> =
        plan.inputs.iter().map(|i| (i.name.clone(), i.ty.clone())).collect();
    feeds_of(&inputs, feeds, seed)
}

/// `STEPS` batches for `inputs` (names and types).
fn feeds_of(
    inputs: &[(String, dfc_ir::TensorType)],
    feeds: &HashMap<String, Feed>,
    seed: u64,
) -> Vec<HashMap<String, Tensor>> {
    let mut rng = fastrand::Rng::with_seed(seed ^ 0x5eed);
    (0..STEPS)
        .map(|_| {
            inputs
                .iter()
                .map(|(name, ty)| {
                    let n = ty.shape.n_elements();
                    let dims = ty.shape.dims().to_vec();
                    let tensor = match feeds[name] {
                        Feed::Floats if ty.dtype == DType::F64 => {
                            Tensor::from_vec(dims, (0..n).map(|_| rng.f64() * 2.0 - 1.0).collect::<Vec<f64>>())
                        }
                        Feed::Floats => {
                            Tensor::from_vec(dims, (0..n).map(|_| rng.f32() * 2.0 - 1.0).collect::<Vec<f32>>())
                        }
                        Feed::Integers => Tensor::from_vec(dims, (0..n).map(|_| rng.i32(-4..=4)).collect::<Vec<i32>>()),
                        Feed::Bytes => Tensor::from_vec(dims, (0..n).map(|_| rng.u8(..)).collect::<Vec<u8>>()),
                        Feed::Labels(depth) => {
                            Tensor::from_vec(dims, (0..n).map(|_| rng.i32(0..=depth)).collect::<Vec<i32>>())
                        }
                        Feed::Indices(end) => {
                            Tensor::from_vec(dims, (0..n).map(|_| rng.i32(0..end)).collect::<Vec<i32>>())
                        }
                    };
                    (name.clone(), tensor)
                })
                .collect()
        })
        .collect()
}

/// What a run shows: per step the forward pass's outputs and metrics and the step's loss,
/// then every variable (a partitioned one's shards joined).
fn run(plan: &Plan, backend: Backend, data: &[HashMap<String, Tensor>]) -> Result<Vec<(String, Tensor)>, String> {
    let training = plan.training.as_ref().ok_or("the plan does not train")?;
    let mut session = Session::with_backend(plan, 0, backend).map_err(|e| format!("load: {e}"))?;
    let updates: Vec<&str> = training.updates.iter().map(String::as_str).collect();
    let step = session.program(&[training.loss_node.as_str()], &updates).map_err(|e| format!("step: {e}"))?;
    let outputs: Vec<&str> = plan.outputs.iter().chain(&plan.metrics).map(|o| o.name.as_str()).collect();
    let forward = session.program(&outputs, &[]).map_err(|e| format!("forward: {e}"))?;
    // Local SGD's averaging of the replicas' variables, after every step.
    let averages: Vec<&str> = training.averages.iter().map(String::as_str).collect();
    let average = session.program(&[], &averages).map_err(|e| format!("averages: {e}"))?;
    let mut seen = Vec::new();
    for (i, feeds) in data.iter().enumerate() {
        let fetched = session.run(&forward, feeds).map_err(|e| format!("forward run: {e}"))?;
        seen.extend(fetched.into_iter().zip(&outputs).map(|(t, name)| (format!("step {i}: {name}"), t)));
        let loss = session.run(&step, feeds).map_err(|e| format!("step run: {e}"))?;
        seen.extend(loss.into_iter().map(|t| (format!("step {i}: loss"), t)));
        if !averages.is_empty() {
            session.run(&average, &HashMap::new()).map_err(|e| format!("averages run: {e}"))?;
        }
    }
    let all = session.all_variables().map_err(|e| format!("variables: {e}"))?;
    let variables: Vec<(String, Tensor)> = if plan.strategy.replicas > 1 {
        let logical = session.variables().map_err(|e| format!("variables: {e}"))?;
        same_copies(&all, &logical)?;
        logical.iter().map(|(n, t)| (n.clone(), t.clone())).collect()
    } else {
        all.iter().map(|(n, t)| (n.clone(), t.clone())).collect()
    };
    // Not the model's: asynchronous replicas' count of the updates of each variable.
    let variables = variables.into_iter().filter(|(name, _)| !name.ends_with("/version")).collect();
    let mut variables = joined_shards(variables);
    variables.sort_by(|a, b| a.0.cmp(&b.0));
    seen.extend(variables.into_iter().map(|(n, t)| (format!("variable {n}"), t)));
    Ok(seen)
}

/// Each replica's copy of a variable (`replica_1/w`) as its logical one (`w`): the replicas
/// stepped together.
fn same_copies(all: &dfc_interp::Variables, logical: &dfc_interp::Variables) -> Result<(), String> {
    for (name, copy) in all.iter() {
        let Some((_, of)) = name.strip_prefix("replica_").and_then(|rest| rest.split_once('/')) else { continue };
        let Some(value) = logical.get(of) else { continue };
        let pair = [(of.to_string(), value.clone())];
        if let Some(problem) = difference(&pair, &[(of.to_string(), copy.clone())]) {
            return Err(format!("the copy {name}: {problem}"));
        }
    }
    Ok(())
}

/// A partitioned variable's shards (`w/part_0`, `w/part_1`, and their slots `w/part_0/m`)
/// joined along axis 0 under the name of the variable the plan without partitions has.
fn joined_shards(variables: Vec<(String, Tensor)>) -> Vec<(String, Tensor)> {
    let mut shards: std::collections::BTreeMap<String, Vec<(usize, Tensor)>> = Default::default();
    let mut whole = Vec::new();
    for (name, tensor) in variables {
        let parts: Vec<&str> = name.split('/').collect();
        let shard = parts.iter().position(|p| p.starts_with("part_") && p[5..].parse::<usize>().is_ok());
        match shard {
            Some(at) => {
                let index: usize = parts[at][5..].parse().expect("checked");
                let logical = parts.iter().enumerate().filter(|(i, _)| *i != at).map(|(_, p)| *p).collect::<Vec<_>>();
                shards.entry(logical.join("/")).or_default().push((index, tensor));
            }
            None => whole.push((name, tensor)),
        }
    }
    for (name, mut parts) in shards {
        parts.sort_by_key(|(index, _)| *index);
        let operands: Vec<&Tensor> = parts.iter().map(|(_, t)| t).collect();
        let joined = dfc_interp::eval(&dfc_ir::Op::Concat { axis: 0 }, &operands).expect("shards of one variable");
        whole.push((name, joined));
    }
    whole
}

/// The first difference between two runs' results.
fn difference(reference: &[(String, Tensor)], other: &[(String, Tensor)]) -> Option<String> {
    if reference.len() != other.len() {
        let names = |r: &[(String, Tensor)]| r.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
        return Some(format!("results {:?} against {:?}", names(reference), names(other)));
    }
    for ((what, a), (what_b, b)) in reference.iter().zip(other) {
        if what != what_b || a.ty() != b.ty() {
            return Some(format!("{what}: {:?} against {what_b}: {:?}", a.ty(), b.ty()));
        }
        if matches!(a.ty().dtype, DType::F32 | DType::F64) {
            let (x, y) = (a.to_f64_vec(), b.to_f64_vec());
            for (i, (x, y)) in x.iter().zip(&y).enumerate() {
                let close = (x - y).abs() <= TOLERANCE * (1.0 + x.abs()) || (x.is_nan() && y.is_nan());
                if !close {
                    return Some(format!("{what}[{i}]: interpreter {x}, backend {y}"));
                }
            }
        } else if a != b {
            return Some(format!("{what}: interpreter {a:?}, backend {b:?}"));
        }
    }
    None
}

/// The plan `dfc compile` would write for `source`, read back from its bytes as `dfc run` reads
/// it (which, without replica instances, must give the same bytes again).
fn plan_for(source: &str, cluster: Cluster, strategy: Strategy) -> Result<Plan, String> {
    plan_with(source, CompileOptions { cluster, strategy, soft_placement: true, ..CompileOptions::default() })
}

/// `plan_for` with all of `dfc compile`'s options.
fn plan_with(source: &str, options: CompileOptions) -> Result<Plan, String> {
    let compiled = compile(source, "random.df", &options).map_err(|e| format!("does not compile: {e:?}"))?.plan;
    let bytes = dfc_plan::encode(&compiled);
    // Decoding builds a mirrored plan's replica instances in full, which then encode as such.
    let plan = dfc_plan::decode(&bytes).map_err(|e| format!("its plan does not decode: {e}"))?;
    if compiled.instances.is_empty() && dfc_plan::encode(&plan) != bytes {
        return Err("its plan changes through its bytes".into());
    }
    Ok(plan)
}

fn message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

/// The seed's program on every configuration against the interpreter on one CPU: the
/// problems found.
fn check(seed: u64, assembler: Option<&Path>) -> Result<(), String> {
    let (source, feeds) = program(seed);
    let fail = |what: String| format!("seed {seed}: {what}\n{source}");
    let single = plan_for(&source, Cluster::local(1, DeviceKind::Cpu), Strategy::Single).map_err(fail)?;
    let data = batches(&single, &feeds, seed);
    let reference = run(&single, Backend::Interp, &data).map_err(|e| fail(format!("interpreter: {e}")))?;
    let (on_cpus, on_gpus) = (placed(&source, seed, "cpu"), placed(&source, seed, "gpu"));
    let configurations = [
        ("llvm, one cpu", &source, Cluster::local(1, DeviceKind::Cpu), Strategy::Single, Backend::Llvm),
        ("llvm, model on two cpus", &source, Cluster::local(2, DeviceKind::Cpu), Strategy::Model, Backend::Llvm),
        ("llvm, model on three cpus", &source, Cluster::local(3, DeviceKind::Cpu), Strategy::Model, Backend::Llvm),
        ("llvm, placed on two cpus", &on_cpus, Cluster::local(2, DeviceKind::Cpu), Strategy::Single, Backend::Llvm),
        (
            "grid emulator, one gpu",
            &source,
            Cluster::local(1, DeviceKind::Gpu),
            Strategy::Single,
            Backend::GridEmulator,
        ),
        (
            "grid emulator, placed on two gpus",
            &on_gpus,
            Cluster::local(2, DeviceKind::Gpu),
            Strategy::Single,
            Backend::GridEmulator,
        ),
    ];
    for (name, source, cluster, strategy, backend) in configurations {
        let results = std::panic::catch_unwind(|| run(&plan_for(source, cluster, strategy)?, backend, &data))
            .unwrap_or_else(|panic| Err(format!("panicked: {}", message(&panic))))
            .map_err(|e| fail(format!("{name}: {e}\n{source}")))?;
        if let Some(problem) = difference(&reference, &results) {
            return Err(fail(format!("{name}: {problem}\n{source}")));
        }
    }
    ptx(&source, Cluster::local(1, DeviceKind::Gpu), assembler).map_err(fail)?;
    ptx(&on_gpus, Cluster::local(2, DeviceKind::Gpu), assembler)
        .map_err(|e| fail(format!("placed on two gpus: {e}\n{on_gpus}")))
}

/// The seed's per-example program trained by replicas (mirrored, on parameter servers, in
/// central storage) against the interpreter on one device: the same outputs, metrics, losses
/// and variables, as the mean of the replicas' gradients is the whole batch's; and the PTX of
/// its plan mirrored on two GPUs.
fn check_data_parallel(seed: u64, assembler: Option<&Path>) -> Result<(), String> {
    let (source, feeds) = program_of(Generator::per_example(seed));
    let fail = |what: String| format!("seed {seed} (per example): {what}\n{source}");
    let options = |cluster: Cluster, strategy: Strategy| CompileOptions {
        cluster,
        strategy,
        soft_placement: true,
        ..CompileOptions::default()
    };
    let single = plan_for(&source, Cluster::local(1, DeviceKind::Cpu), Strategy::Single).map_err(fail)?;
    let data = batches(&single, &feeds, seed);
    let reference = run(&single, Backend::Interp, &data).map_err(|e| fail(format!("interpreter: {e}")))?;
    let batch = single.inputs[0].ty.shape.dims()[0];
    let cpus = |n| Cluster::local(n, DeviceKind::Cpu);
    let mut configurations = vec![
        ("interpreter, mirrored on two cpus", options(cpus(2), Strategy::Mirrored), Backend::Interp),
        ("llvm, mirrored on two cpus", options(cpus(2), Strategy::Mirrored), Backend::Llvm),
        (
            "llvm, mirrored on two cpus, overlapped, unfused",
            CompileOptions {
                overlap: true,
                fusion: dfc_passes::FusionOptions { threshold_bytes: 0 },
                ..options(cpus(2), Strategy::Mirrored)
            },
            Backend::Llvm,
        ),
        (
            "llvm, ps --sync, two workers",
            options(ps_cluster(2), Strategy::ParameterServer { sync: true }),
            Backend::Llvm,
        ),
        (
            "llvm, ps --sync, variables split over two ps, greedy",
            CompileOptions {
                partition_min_bytes: Some(16),
                placement: dfc_passes::VariablePlacement::Greedy,
                ..options(ps_cluster(2), Strategy::ParameterServer { sync: true })
            },
            Backend::Llvm,
        ),
        ("llvm, central storage on two cpus", options(cpus(2), Strategy::CentralStorage), Backend::Llvm),
        (
            "grid emulator, mirrored on two gpus",
            options(Cluster::local(2, DeviceKind::Gpu), Strategy::Mirrored),
            Backend::GridEmulator,
        ),
    ];
    // Averaging the replicas' variables after each step of plain SGD is averaging their
    // gradients (clipping by each replica's norm is not).
    let optimizer = source.lines().find_map(|l| l.trim().strip_prefix("minimize ")).unwrap_or_default();
    if optimizer.contains("with sgd(") && !optimizer.contains("clip") {
        let local = CompileOptions { sync_every: Some(1), ..options(cpus(2), Strategy::Mirrored) };
        configurations.push(("llvm, local sgd on two cpus, averaged every step", local, Backend::Llvm));
    }
    // One asynchronous replica steps as one device does; it refuses synchronised statistics.
    if !source.contains("synchronized = true") {
        let asynchronous = options(ps_cluster(1), Strategy::ParameterServer { sync: false });
        configurations.push(("llvm, ps, one worker", asynchronous, Backend::Llvm));
    }
    if batch % 4 == 0 {
        configurations.push(("llvm, mirrored on four cpus", options(cpus(4), Strategy::Mirrored), Backend::Llvm));
    }
    for (name, options, backend) in configurations {
        let results = std::panic::catch_unwind(|| run(&plan_with(&source, options)?, backend, &data))
            .unwrap_or_else(|panic| Err(format!("panicked: {}", message(&panic))))
            .map_err(|e| fail(format!("{name}: {e}")))?;
        if let Some(problem) = difference(&reference, &results) {
            return Err(fail(format!("{name}: {problem}")));
        }
    }
    // The replicas' kernels as a GPU would load them (synchronised batch norms' among them).
    let on_gpus = plan_with(&source, options(Cluster::local(2, DeviceKind::Gpu), Strategy::Mirrored)).map_err(fail)?;
    ptx_of(&on_gpus, assembler).map_err(|e| fail(format!("mirrored on two gpus: {e}")))
}

/// The TLS files of spawned workers on loopback (`dfc certs`), made once per test run.
fn loopback_tls() -> Result<std::path::PathBuf, String> {
    static TLS: std::sync::OnceLock<Result<std::path::PathBuf, String>> = std::sync::OnceLock::new();
    TLS.get_or_init(|| {
        let out = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("random-spawned-pki");
        let _ = std::fs::remove_dir_all(&out);
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_dfc"))
            .args(["certs", "--out", &out.display().to_string(), "localhost"])
            .output()
            .map_err(|e| e.to_string())?;
        match output.status.success() {
            true => Ok(out.join("localhost")),
            false => Err(format!("dfc certs: {}", String::from_utf8_lossy(&output.stderr))),
        }
    })
    .clone()
}

/// A cluster file of `workers` worker tasks and `ps` parameter-server tasks; `--spawn` gives
/// each task a worker of its own, so the addresses are never dialled.
fn cluster_file(dir: &std::path::Path, workers: usize, ps: usize) -> Result<String, String> {
    let addresses =
        |first: usize, n: usize| (first..first + n).map(|p| format!("\"localhost:{p}\"")).collect::<Vec<_>>();
    let mut jobs = vec![format!("\"worker\": [{}]", addresses(3000, workers).join(", "))];
    if ps > 0 {
        jobs.push(format!("\"ps\": [{}]", addresses(2000, ps).join(", ")));
    }
    let path = dir.join(format!("cluster-{workers}-{ps}.json"));
    std::fs::write(&path, format!("{{\"cluster\": {{{}}}}}", jobs.join(", "))).map_err(|e| e.to_string())?;
    Ok(path.display().to_string())
}

/// Four `dfc worker` processes, two listening on 127.0.0.1 and two on 127.0.0.2. dfc tells
/// hosts apart by the workers' addresses, so to it they are two hosts of two workers each.
struct TwoHostWorkers {
    workers: Vec<std::process::Child>,
    /// The cluster file (TF_CONFIG's shape) of their addresses.
    cluster: String,
    token_file: String,
}

impl TwoHostWorkers {
    fn start(dir: &Path) -> Result<TwoHostWorkers, String> {
        let token_file = dir.join("two-hosts.token");
        std::fs::write(&token_file, "random-programs-on-two-hosts-0123456789\n").map_err(|e| e.to_string())?;
        let token_file = token_file.display().to_string();
        let mut hosts = TwoHostWorkers { workers: Vec::new(), cluster: String::new(), token_file };
        let mut addresses = Vec::new();
        for host in ["127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"] {
            let mut worker = std::process::Command::new(env!("CARGO_BIN_EXE_dfc"))
                .args(["worker", "--listen", &format!("{host}:0"), "--threads", "1"])
                .args(["--token-file", &hosts.token_file])
                .stdout(std::process::Stdio::piped())
                .spawn()
                .map_err(|e| format!("dfc worker: {e}"))?;
            let stdout = worker.stdout.take().ok_or("a worker's stdout")?;
            hosts.workers.push(worker);
            // `dfc worker listening on HOST:PORT`
            let mut line = String::new();
            std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line).map_err(|e| e.to_string())?;
            let address =
                line.trim().strip_prefix("dfc worker listening on ").ok_or(format!("dfc worker said {line:?}"))?;
            addresses.push(format!("\"{address}\""));
        }
        let cluster = dir.join("two-hosts.json");
        std::fs::write(&cluster, format!("{{\"cluster\": {{\"worker\": [{}]}}}}", addresses.join(", ")))
            .map_err(|e| e.to_string())?;
        hosts.cluster = cluster.display().to_string();
        Ok(hosts)
    }
}

impl Drop for TwoHostWorkers {
    fn drop(&mut self) {
        for worker in &mut self.workers {
            let _ = worker.kill();
            let _ = worker.wait();
        }
    }
}

/// The seed's per-example program through the `dfc` binary: its inputs written as .npy files
/// of two batches, trained one epoch in one process compiled for one device, and on spawned
/// `dfc worker` processes (mirrored, the model split over two, on parameter servers, over
/// TLS) and on four workers of two hosts (mirrored, hierarchical all-reduces), whose
/// checkpoints must all agree with the one process's.
fn check_spawned(seed: u64) -> Result<(), String> {
    let (source, feeds) = program_of(Generator::per_example(seed));
    let fail = |what: String| format!("seed {seed} (spawned workers): {what}\n{source}");
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("random-spawned-{seed}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| fail(format!("{}: {e}", dir.display())))?;
    let model = dir.join("random.df");
    std::fs::write(&model, &source).map_err(|e| fail(e.to_string()))?;
    let single = plan_for(&source, Cluster::local(1, DeviceKind::Cpu), Strategy::Single).map_err(fail)?;
    // `dfc run` refuses a label outside a one_hot's depth in a data file.
    let in_range = |(name, feed): (&String, &Feed)| match *feed {
        Feed::Labels(depth) => (name.clone(), Feed::Indices(depth)),
        other => (name.clone(), other),
    };
    let feeds: HashMap<String, Feed> = feeds.iter().map(in_range).collect();
    let mut arguments = Vec::new();
    let data = batches(&single, &feeds, seed);
    for input in &single.inputs {
        let batches: Vec<Tensor> = data.iter().map(|b| b[&input.name].clone()).collect();
        let both = dfc_interp::eval(&dfc_ir::Op::Concat { axis: 0 }, &batches.iter().collect::<Vec<_>>())
            .map_err(|e| fail(e.to_string()))?;
        let path = dir.join(format!("{}.npy", input.name));
        dfc_driver::save_npy(&path, &both).map_err(|e| fail(e.to_string()))?;
        arguments.extend(["--feed".to_string(), format!("{}={}", input.name, path.display())]);
    }
    // What it said on stderr, or why it failed.
    let dfc = |args: &[String]| -> Result<String, String> {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_dfc"))
            .args(args)
            .env("NO_COLOR", "1")
            .env_remove("DFC_TOKEN")
            .output()
            .map_err(|e| e.to_string())?;
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        match output.status.success() {
            true => Ok(stderr),
            false => Err(format!("dfc {}: {stderr}", args.join(" "))),
        }
    };
    // The last checkpoint of a run, and what the run said.
    let trained =
        |name: &str, compile: &[String], run: &[String]| -> Result<(dfc_driver::Checkpoint, String), String> {
            let plan = dir.join(format!("{name}.plan")).display().to_string();
            let mut args: Vec<String> =
                ["compile", &model.display().to_string(), "-o", &plan].map(String::from).to_vec();
            args.extend(compile.iter().cloned());
            dfc(&args)?;
            let checkpoints = dir.join(name).display().to_string();
            let mut args: Vec<String> =
                ["run", &plan, "--no-shuffle", "--checkpoint-dir", &checkpoints].map(String::from).to_vec();
            args.extend(arguments.iter().cloned());
            args.extend(run.iter().cloned());
            let said = dfc(&args)?;
            let checkpoint = dfc_driver::checkpoint::latest(std::path::Path::new(&checkpoints))
                .map_err(|e| e.to_string())?
                .ok_or_else(|| format!("no checkpoint in {checkpoints}"))?;
            Ok((checkpoint, said))
        };
    let strings = |args: &[&str]| args.iter().map(|a| a.to_string()).collect::<Vec<_>>();
    let cluster = |workers, ps| cluster_file(&dir, workers, ps).map_err(fail);
    let tls = loopback_tls().map_err(fail)?.display().to_string();
    let (two, ps_of_two, one_of_two) = (cluster(2, 0)?, cluster(2, 2)?, cluster(1, 2)?);
    let split = ["--strategy", "ps", "--partition-min-bytes", "16"];
    // (what, `dfc compile`'s options, `dfc run`'s, what the run must say of its all-reduces)
    let mut configurations = vec![
        (
            "mirrored on two workers",
            strings(&["--devices", "2", "--strategy", "mirrored"]),
            strings(&["--spawn", "2"]),
            "",
        ),
        (
            "split over two workers",
            strings(&["--cluster", &two, "--strategy", "model"]),
            strings(&["--spawn", "2"]),
            "",
        ),
        (
            "ps --sync, variables split over two ps, greedy, over tls",
            strings(&[
                "--cluster",
                &ps_of_two,
                "--strategy",
                "ps",
                "--sync",
                "--partition-min-bytes",
                "16",
                "--placement",
                "greedy",
            ]),
            strings(&["--spawn", "4", "--tls-dir", &tls]),
            "",
        ),
    ];
    // One asynchronous replica steps as one device does, behind servers that take turns; it
    // refuses synchronised statistics.
    if !source.contains("synchronized = true") {
        let compile = strings(&[&["--cluster", &one_of_two][..], &split].concat());
        configurations.push(("ps, one worker, variables split over two ps", compile, strings(&["--spawn", "3"]), ""));
    }
    let mirrored = ["--cluster", &two, "--strategy", "mirrored"];
    let overlapped = strings(&[&mirrored[..], &["--overlap", "--fusion-threshold", "0"]].concat());
    configurations.push(("mirrored, overlapped, unfused", overlapped, strings(&["--spawn", "2"]), ""));
    // Four replicas on two hosts: the replicas' all-reduces run hierarchically, in shared memory
    // within each host and over TCP between the hosts' leaders.
    let hosts = TwoHostWorkers::start(&dir).map_err(fail)?;
    let on_hosts = strings(&["--cluster", &hosts.cluster, "--strategy", "mirrored"]);
    let run_on_hosts = strings(&["--cluster", &hosts.cluster, "--token-file", &hosts.token_file]);
    let hierarchical = "all-reduces: hierarchical (4 worker(s) on 2 host(s)";
    configurations.push(("mirrored on four workers on two hosts", on_hosts, run_on_hosts, hierarchical));
    // Averaging the replicas' variables after each step of plain SGD is averaging their
    // gradients (clipping by each replica's norm is not).
    let optimizer = source.lines().find_map(|l| l.trim().strip_prefix("minimize ")).unwrap_or_default();
    if optimizer.contains("with sgd(") && !optimizer.contains("clip") {
        let local = strings(&[&mirrored[..], &["--sync-every", "1"]].concat());
        configurations.push(("local sgd, averaged every step", local, strings(&["--spawn", "2"]), ""));
    }
    let reference = match trained("single", &[], &[]) {
        Ok((checkpoint, _)) => checkpoint,
        // A loss of no trainable param (W0005) is not trained, in one process or on workers.
        Err(one) if one.contains("(W0005)") => {
            let (_, compile, run, _) = &configurations[0];
            return match trained("mirrored", compile, run) {
                Err(two) if two.contains("(W0005)") => Ok(std::fs::remove_dir_all(&dir).unwrap_or(())),
                other => Err(fail(format!("one process: {one}\ntwo workers: {:?}", other.err()))),
            };
        }
        Err(one) => return Err(fail(format!("one process: {one}"))),
    };
    // Asynchronous updates count the variables' versions, which one device has no need of.
    let listed = |c: &dfc_driver::Checkpoint| {
        let versions = |name: &&String| !name.ends_with("/version");
        c.tensors.iter().filter(|(n, _)| versions(n)).map(|(n, t)| (n.clone(), t.clone())).collect::<Vec<_>>()
    };
    for (i, (name, compile, run, says)) in configurations.iter().enumerate() {
        let (other, said) = trained(&format!("spawned-{i}"), compile, run).map_err(|e| fail(format!("{name}: {e}")))?;
        // A run that all-reduces says how (a program without params has nothing to reduce).
        if said.contains("all-reduces:") && !said.contains(says) {
            return Err(fail(format!("{name}: the run did not say `{says}`:\n{said}")));
        }
        if (reference.step, reference.epoch) != (other.step, other.epoch) {
            let (step, epoch) = (other.step, other.epoch);
            return Err(fail(format!("{name}: step {step} of epoch {epoch}, one process {}", reference.step)));
        }
        // A checkpoint holds a partitioned variable whole, under the model's name.
        if let Some(problem) = difference(&listed(&reference), &listed(&other)) {
            return Err(fail(format!("one process against {name}: {problem}")));
        }
    }
    // The trained model forward on the workers, split over two ps in TLS, as in one process.
    let (_, _, ps_run, _) = &configurations[2];
    for output in &single.outputs {
        let fetched = |plan: &str, checkpoints: &str, run: &[String]| -> Result<Tensor, String> {
            let out = dir.join(format!("{plan}-{}.npy", output.name.replace('/', "_")));
            let plan = dir.join(format!("{plan}.plan")).display().to_string();
            let checkpoints = dir.join(checkpoints).display().to_string();
            let mut args = strings(&["run", &plan, "--fetch", &output.name, "--checkpoint-dir", &checkpoints]);
            args.extend(["-o".to_string(), out.display().to_string()]);
            args.extend(arguments.iter().cloned());
            args.extend(run.iter().cloned());
            dfc(&args)?;
            dfc_driver::load_npy(&out).map_err(|e| e.to_string())
        };
        let name = format!("--fetch {}", output.name);
        let one = fetched("single", "single", &[]);
        let spawned = fetched("spawned-2", "spawned-2", ps_run);
        match (one, spawned) {
            (Ok(one), Ok(spawned)) => {
                if let Some(problem) = difference(&[(name.clone(), one)], &[(name.clone(), spawned)]) {
                    return Err(fail(format!("{name}, one process against ps on workers: {problem}")));
                }
            }
            // A value of the whole batch is refused, alike.
            (Err(one), Err(spawned)) if one.contains("the batch") && spawned.contains("the batch") => {}
            (one, spawned) => {
                return Err(fail(format!("{name}: one process {:?}, on workers {:?}", one.err(), spawned.err())))
            }
        }
    }
    // Two asynchronous replicas with their variables split over two ps: in lockstep on workers
    // they step as they do in one process; free, taking turns on the servers, they train the
    // epoch too.
    if !source.contains("synchronized = true") {
        let compile = strings(&[&["--cluster", &ps_of_two][..], &split].concat());
        let name = "async ps, two workers, variables split over two ps";
        let (embedded, _) = trained("async", &compile, &[]).map_err(|e| fail(format!("{name}, one process: {e}")))?;
        let run = strings(&["--spawn", "4", "--lockstep"]);
        let (spawned, _) =
            trained("async-lockstep", &compile, &run).map_err(|e| fail(format!("{name}, lockstep: {e}")))?;
        let all =
            |c: &dfc_driver::Checkpoint| c.tensors.iter().map(|(n, t)| (n.clone(), t.clone())).collect::<Vec<_>>();
        if let Some(problem) = difference(&all(&embedded), &all(&spawned)) {
            return Err(fail(format!("{name}, lockstep against one process: {problem}")));
        }
        let metrics = dir.join("async-free.jsonl").display().to_string();
        let (free, _) =
            trained("async-free", &compile, &strings(&["--spawn", "4", "--wait", "20", "--metrics", &metrics]))
                .map_err(|e| fail(format!("{name}, free: {e}")))?;
        if (free.step, free.epoch) != (spawned.step, spawned.epoch) {
            return Err(fail(format!(
                "{name}, free: step {} of epoch {}, in lockstep {}",
                free.step, free.epoch, spawned.step
            )));
        }
        // Free running, a server counts a step per replica step (in lockstep, one per step).
        let records = std::fs::read_to_string(&metrics).map_err(|e| fail(format!("{metrics}: {e}")))?;
        let records: Vec<serde_json::Value> = records
            .lines()
            .map(serde_json::from_str)
            .collect::<Result<_, _>>()
            .map_err(|e| fail(format!("{metrics}: {e}")))?;
        // Per worker of the job, its steps over the epochs.
        let steps = |job: &str| -> Vec<u64> {
            let mut steps = BTreeMap::new();
            for worker in records.iter().flat_map(|r| r["workers"].as_array().into_iter().flatten()) {
                let Some(name) = worker["name"].as_str().filter(|n| n.starts_with(job)) else { continue };
                *steps.entry(name.to_string()).or_insert(0) += worker["steps"].as_u64().unwrap_or(0);
            }
            steps.into_values().collect()
        };
        let replica_steps: u64 = steps("/job:worker/").iter().sum();
        let servers = steps("/job:ps/");
        if servers.iter().any(|&s| s != 0 && s != replica_steps) || servers.iter().all(|&s| s == 0) {
            return Err(fail(format!("{name}, free: servers' steps {servers:?}, replicas' {replica_steps}: not free")));
        }
    }
    Ok(std::fs::remove_dir_all(&dir).unwrap_or(()))
}

/// `ptx_of` the plan of `source` on `cluster`.
fn ptx(source: &str, cluster: Cluster, assembler: Option<&Path>) -> Result<(), String> {
    ptx_of(&plan_for(source, cluster, Strategy::Single)?, assembler)
}

/// The PTX of `plan`'s GPU partitions, as a GPU's runtime generates it (the grid emulator
/// compiles the same kernels for this CPU instead): generated, with an entry for every launch,
/// and taken by NVIDIA's assembler where there is one.
fn ptx_of(plan: &Plan, assembler: Option<&Path>) -> Result<(), String> {
    let on_gpu = |i: &usize| plan.partitions[*i].device.kind == Some(DeviceKind::Gpu);
    let gpu_partitions: Vec<usize> = (0..plan.partitions.len()).filter(on_gpu).collect();
    if gpu_partitions.is_empty() {
        return Err("a GPU plan without a GPU partition".into());
    }
    let dir = tempfile::tempdir().map_err(|e| format!("a directory for the PTX: {e}"))?;
    for i in gpu_partitions {
        let partition = &plan.partitions[i];
        let generate = || dfc_codegen::compile_gpu(&partition.module, &plan.kept_nodes(i));
        let code = std::panic::catch_unwind(generate)
            .map_err(|panic| format!("PTX: panicked: {}", message(&panic)))?
            .map_err(|e| format!("PTX: {e}"))?;
        for kernel in code.kernels.iter().chain(&code.ops) {
            for launch in kernel.launches() {
                if !code.ptx.contains(&format!(".entry {}(", launch.function)) {
                    return Err(format!("PTX: no entry for {launch:?}"));
                }
            }
        }
        if let Some(assembler) = assembler {
            ptxas::assemble(assembler, &code.ptx, dir.path(), &format!("partition_{i}"))?;
        }
    }
    Ok(())
}

/// `source` with placements on two devices of `kind`: some `let`s in `device` blocks, some params
/// with `@device`, some split in two with `@partitioned(2)`.
fn placed(source: &str, seed: u64, kind: &str) -> String {
    let mut rng = fastrand::Rng::with_seed(seed ^ 0xde71ce);
    let mut lines = Vec::new();
    for line in source.lines() {
        let device = format!("{kind}:{}", rng.usize(..2));
        let statement = line.trim();
        let rows = statement.split_once('[').and_then(|(_, dims)| dims.split([',', ']']).next()?.parse::<usize>().ok());
        lines.push(match rng.u8(..3) {
            0 if statement.starts_with("let v") => format!("    device \"{device}\" {{ {statement} }}"),
            0 if statement.starts_with("param") => format!("    @device(\"{device}\") {statement}"),
            1 if statement.starts_with("param") && rows.is_some_and(|r| r % 2 == 0) => {
                format!("    @partitioned(2) {statement}")
            }
            _ => line.to_string(),
        });
    }
    lines.join("\n") + "\n"
}

/// `check` on `default` programs from seed 0, or `DFC_RANDOM_PROGRAMS` from `DFC_RANDOM_SEED`:
/// fails with every program that fails it (a panic included), each named by its seed.
fn each_program(default: u64, check: impl Fn(u64) -> Result<(), String> + std::panic::RefUnwindSafe) {
    let number =
        |name: &str| std::env::var(name).ok().map(|v| v.parse().unwrap_or_else(|_| panic!("{name}={v}: not a number")));
    let first = number("DFC_RANDOM_SEED").unwrap_or(0);
    let count = number("DFC_RANDOM_PROGRAMS").unwrap_or(default);
    let failures: Vec<String> = (first..first + count)
        .filter_map(|seed| match std::panic::catch_unwind(|| check(seed)) {
            Ok(result) => result.err(),
            Err(panic) => Some(format!("seed {seed}: panicked: {}", message(&panic))),
        })
        .collect();
    assert!(failures.is_empty(), "{} of {count} programs fail:\n\n{}", failures.len(), failures.join("\n\n"));
}

#[test]
fn random_programs_agree_everywhere() {
    let assembler = assembler();
    each_program(100, |seed| check(seed, assembler.as_deref()));
}

#[test]
fn random_per_example_programs_agree_under_data_parallelism() {
    let assembler = assembler();
    each_program(100, |seed| check_data_parallel(seed, assembler.as_deref()));
}

/// `ptxas`, or a skip of what would assemble the programs' PTX.
fn assembler() -> Option<std::path::PathBuf> {
    let assembler = ptxas::find();
    if assembler.is_none() {
        skip::skip(skip::Need::Ptxas, &format!("assembling the programs' PTX: {}", ptxas::MISSING));
    }
    assembler
}

#[test]
fn random_per_example_programs_train_alike_on_spawned_workers() {
    each_program(10, check_spawned);
}

/// The seed's f64 program's gradients, by autodiff, against central finite differences of its
/// loss, both through the interpreter as a training step computes them (batch norms by the
/// batch, dropout's mask that of the step): what the backends above are all compared with.
fn check_gradients(seed: u64) -> Result<(), String> {
    let (source, feeds) = program_of(Generator::with(fastrand::Rng::with_seed(seed), "f64", true));
    let fail = |what: String| format!("seed {seed} (f64, small): {what}\n{source}");
    let (module, diagnostics) = dfc_sema::compile_source(&source, None, &dfc_sema::Options::default());
    let mut module = module.ok_or_else(|| fail(format!("does not compile: {diagnostics:?}")))?;
    dfc_passes::autodiff(&mut module);
    let problems = dfc_ir::verify(&module, dfc_ir::VerifyOptions::default());
    if !problems.is_empty() {
        return Err(fail(format!("autodiff broke the IR: {problems:?}")));
    }
    let training = module.training.as_ref().ok_or_else(|| fail("no loss".into()))?;
    let order = dfc_interp::schedule(&[&module]).map_err(|e| fail(format!("{e}")))?.pop().expect("one module");
    let program = |fetches: &[dfc_ir::TensorRef]| {
        dfc_interp::Program::with_mode(&module, fetches, &[], &order, true).map_err(|e| fail(format!("{e}")))
    };
    let gradients: Vec<_> = training.gradients.iter().map(|(_, g)| *g).collect();
    let (gradient_program, loss_program) = (program(&gradients)?, program(&[training.loss])?);
    let mut variables = dfc_interp::initialize(&module, 7);
    let plan_inputs: Vec<(String, dfc_ir::TensorType)> = module
        .inputs
        .iter()
        .map(|&i| (module.graph.node(i).name.clone(), module.graph.node(i).outputs[0].clone()))
        .collect();
    let data = feeds_of(&plan_inputs, &feeds, seed).pop().expect("a batch");
    let analytic = gradient_program.run(&module, &mut variables, &data).map_err(|e| fail(format!("gradients: {e}")))?;
    let loss = |variables: &mut dfc_interp::Variables| -> Result<f64, String> {
        Ok(loss_program.run(&module, variables, &data).map_err(|e| fail(format!("loss: {e}")))?[0].scalar_f64())
    };
    const EPS: f64 = 1e-6;
    for ((variable, _), gradient) in training.gradients.iter().zip(&analytic) {
        let name = module.graph.node(*variable).name.clone();
        let value = variables.get(&name).expect("initialised").clone();
        let values = value.to_f64_vec();
        for (i, gradient) in gradient.to_f64_vec().into_iter().enumerate() {
            let at = |x: f64, variables: &mut dfc_interp::Variables| {
                let mut moved = values.clone();
                moved[i] = x;
                variables.insert(name.clone(), Tensor::from_f64(value.dtype(), value.shape.clone(), &moved));
                loss(variables)
            };
            let numeric = (at(values[i] + EPS, &mut variables)? - at(values[i] - EPS, &mut variables)?) / (2.0 * EPS);
            variables.insert(name.clone(), value.clone());
            let tolerance = 1e-4 * (1.0 + numeric.abs().max(gradient.abs()));
            // Written so that a NaN on either side fails.
            if !((numeric - gradient).abs() <= tolerance) {
                return Err(fail(format!(
                    "d loss / d {name}[{i}] is {gradient} by autodiff, {numeric} by differences"
                )));
            }
        }
    }
    Ok(())
}

#[test]
fn random_gradients_match_finite_differences() {
    each_program(1000, check_gradients);
}

/// The IR that `text` compiles to, printed.
fn ir(text: &str) -> Result<String, String> {
    let (module, diagnostics) = dfc_sema::compile_source(text, None, &dfc_sema::Options::default());
    module.map(|m| dfc_ir::print(&m)).ok_or_else(|| format!("does not compile: {diagnostics:?}\n{text}"))
}

/// The seed's program through `dfc fmt`: formatted once it stays as it is, and it is the same
/// model (the same IR).
fn check_format(seed: u64) -> Result<(), String> {
    let (source, _) = program(seed);
    let fail = |what: String| format!("seed {seed}: {what}\n{source}");
    let formatted = dfc_fmt::format(&source).map_err(|d| fail(format!("does not format: {d:?}")))?;
    let again = dfc_fmt::format(&formatted).map_err(|d| fail(format!("its formatting does not format: {d:?}")))?;
    if again != formatted {
        return Err(fail(format!("formatting twice changes it:\n{formatted}\n---\n{again}")));
    }
    if ir(&source).map_err(fail)? != ir(&formatted).map_err(fail)? {
        return Err(fail(format!("formatted, it is another model:\n{formatted}")));
    }
    Ok(())
}

#[test]
fn random_programs_format_to_the_same_model() {
    each_program(1000, check_format);
}

/// IR text without the random ops' salts, which come from their names (a random op's stream
/// is its own: docs/language.md, "Randomness").
fn unsalted(ir: &str) -> String {
    ir.split("salt=0x")
        .enumerate()
        .map(|(i, part)| if i == 0 { part } else { part.trim_start_matches(|c: char| c.is_ascii_hexdigit()) })
        .collect::<Vec<_>>()
        .join("salt=")
}

/// `text` with every whole word `from` (letters, digits and `_`) replaced by `to`, and every
/// `from_N` (a layer's scope when it is called again) by `to_N`.
fn rename_words(text: &str, from: &str, to: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut word = String::new();
    let numbered = |word: &str| {
        let n = word.strip_prefix(from).and_then(|rest| rest.strip_prefix('_'));
        n.is_some_and(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()))
    };
    let flush = |word: &mut String, out: &mut String| {
        if word == from || numbered(word) {
            out.push_str(to);
            out.push_str(&word[from.len()..]);
        } else {
            out.push_str(word);
        }
        word.clear();
    };
    for c in text.chars() {
        if c.is_alphanumeric() || c == '_' {
            word.push(c);
        } else {
            flush(&mut word, &mut out);
            out.push(c);
        }
    }
    flush(&mut word, &mut out);
    out
}

/// The seed's program as the language server sees it: no error; hover, definition, references,
/// completion and rename's check at every offset, symbols and semantic tokens, without a panic;
/// and each of the model's names renamed gives the same model under the new name.
fn check_editor(seed: u64) -> Result<(), String> {
    let (source, _) = program(seed);
    let fail = |what: String| format!("seed {seed}: {what}\n{source}");
    let analysis = dfc_ide::FileAnalysis::new(source.clone());
    let errors: Vec<_> = analysis.diagnostics.iter().filter(|d| d.severity == dfc_diag::Severity::Error).collect();
    if !errors.is_empty() {
        return Err(fail(format!("the editor sees errors: {errors:?}")));
    }
    for offset in 0..=source.len() {
        analysis.hover(offset);
        analysis.definition(offset);
        analysis.references(offset, true);
        analysis.completions(offset);
        let _ = analysis.prepare_rename(offset);
    }
    analysis.symbols();
    analysis.semantic_tokens();
    let original = ir(&source).map_err(fail)?;
    for line in source.lines() {
        let statement = line.trim();
        let Some(name) = ["let ", "param ", "input ", "layer "].iter().find_map(|k| statement.strip_prefix(k)) else {
            continue;
        };
        let name: String = name.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        if !name.starts_with(['v', 'w', 'x', 'l']) || name.len() < 2 {
            continue;
        }
        let offset = source.find(line).expect("a line of it") + line.find(&name).expect("its name");
        let new_name = format!("renamed_{name}");
        let mut spans = analysis.rename(offset, &new_name).map_err(|e| fail(format!("rename {name}: {e}")))?;
        spans.sort_by_key(|span| std::cmp::Reverse(span.start));
        let mut renamed = source.clone();
        for span in spans {
            if &renamed[span.range()] != name {
                return Err(fail(format!("rename {name}: an edit at {span:?} covers `{}`", &renamed[span.range()])));
            }
            renamed.replace_range(span.range(), &new_name);
        }
        let after = ir(&renamed).map_err(|e| fail(format!("renamed {name}: {e}")))?;
        if unsalted(&after) != unsalted(&rename_words(&original, &name, &new_name)) {
            return Err(fail(format!("renamed {name}, it is another model:\n{renamed}")));
        }
    }
    Ok(())
}

#[test]
fn random_programs_are_read_alike_by_the_language_server() {
    each_program(300, check_editor);
}
