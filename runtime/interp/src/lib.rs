//! The reference interpreter: executes any IR graph on the CPU, plainly and obviously right.
//! It is the oracle that every pass and back end is tested against.
//!
//! - [`initialize`] fills the variables of a module from their initialisers (see `init.rs`
//!   for the exact Keras semantics and the seeding).
//! - [`Program::new`] selects and checks the nodes that some fetches and targets need;
//!   [`Program::run`] runs them on feeds and variables (see [`Program`] for the semantics of
//!   a run: order, variables, atomicity).
//! - The partitions of a plan run side by side, one thread each: [`schedule`] orders their
//!   nodes so that they cannot deadlock, [`Program::with_order`] builds each one's program in
//!   that order, and [`Program::run_with`] / [`Program::run_staged`] run it, exchanging
//!   tensors (`Send`/`Recv`, `AllReduce`) through a [`Rendezvous`] shared by the step
//!   ([`InProcessRendezvous`] for threads of one process).
//! - [`eval`] computes one stateless op on tensors, for tests and constant folding.
//!
//! # Semantics of the ops
//!
//! They match TensorFlow and NumPy, on every element type that `dfc_ir::infer` accepts, and
//! give exactly the output type `infer` gives (a run checks every output against it).
//!
//! - Arithmetic (`scalar.rs`): integers wrap on overflow; integer `div` truncates toward zero
//!   and dividing by zero is an error, as is an integer `pow` with a negative exponent; floats
//!   are IEEE; `maximum`, `minimum`, `max`, `min` and `relu` propagate NaN.
//! - Broadcasting (binary ops, comparisons, `select`, `broadcast_to`, batched `matmul`) is
//!   NumPy's: shapes aligned from the right, each pair of sizes equal or one of them 1.
//! - `cast` is Rust's `as` (float → int truncates and saturates, NaN → 0); to bool is `!= 0`;
//!   bool → number is 0 or 1.
//! - `matmul` sums products in order of the inner index, as multiply-then-add.
//! - Reductions (`reduce.rs`): `sum` in row-major order; `mean` = sum / count (integers: the
//!   exact mean truncated toward zero); `max`/`min` of nothing is -inf/+inf (MIN/MAX, on bool
//!   `any`/`all`); `argmax` gives the first maximum; softmax, log-softmax and the cross
//!   entropies subtract the maximum first; `sigmoid_cross_entropy` is
//!   `max(x, 0) - x * z + ln(1 + exp(-|x|))`.
//! - `one_hot`: an index outside `0..depth` gives a row of zeros. `gather` and `scatter_add`:
//!   an index outside the table is an error.
//! - Convolution and pooling (`conv.rs`): NHWC, HWIO filters, TensorFlow's `same` padding
//!   (`pad_before = pad_total / 2`); `avg_pool` divides by the number of valid elements;
//!   the gradient ops are the exact adjoints (`max_pool_grad` gives each window's gradient to
//!   its first maximum; overlapping windows accumulate).

mod init;
mod kernels;
mod layout;
mod program;
mod rendezvous;
mod scalar;
mod tensor;
pub mod trace;

pub use init::{fans, fnv1a_64, initial_value, initialize, try_initialize, try_initialize_some};
pub use program::{reduce_together, schedule, Program, StagedRun};
pub use rendezvous::{all_reduce_through_copies, wait_on, InProcessRendezvous, Rendezvous};
pub use tensor::{Data, Element, Tensor};

use dfc_ir::{Op, TensorType};
use std::collections::BTreeMap;

/// The values of a module's variables, keyed by the `Variable` node's name.
#[derive(Clone, Debug, Default)]
pub struct Variables {
    values: BTreeMap<String, Tensor>,
    /// Changed by every access that may write a value (`get_mut`, `insert`, `remove`) to a number no other access
    /// in the process got: see [`Variables::stamp`].
    stamp: u64,
}

/// Equal values (whatever their stamps).
impl PartialEq for Variables {
    fn eq(&self, other: &Variables) -> bool {
        self.values == other.values
    }
}

impl Variables {
    pub fn new() -> Variables {
        Variables::default()
    }

    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.values.get(name)
    }

    pub fn get_mut(&mut self, name: &str) -> Option<&mut Tensor> {
        self.restamp();
        self.values.get_mut(name)
    }

    /// Sets (or replaces) the value of `name`.
    pub fn insert(&mut self, name: String, t: Tensor) {
        self.restamp();
        self.values.insert(name, t);
    }

    pub fn remove(&mut self, name: &str) -> Option<Tensor> {
        self.restamp();
        self.values.remove(name)
    }

    /// Where these values stand: unchanged since an access left this stamp, the values are what they were then
    /// (or what the holder of raw pointers taken then made them; a clone keeps the stamp of equal values). A
    /// program keeping copies of variables between runs (a weight's packed panels) trusts them only while the stamp
    /// is the one its last run left.
    pub fn stamp(&self) -> u64 {
        self.stamp
    }

    fn restamp(&mut self) {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        self.stamp = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Every variable, in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &Tensor)> {
        self.values.iter()
    }

    pub fn len(&self) -> usize {
        self.values.len()
    }

    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }
}

/// Why a program could not be built or run.
#[derive(thiserror::Error, Debug, Clone, PartialEq)]
pub enum InterpError {
    #[error("input `{input}` is not fed")]
    MissingFeed { input: String },
    #[error("input `{input}` takes {expected}, but was fed {found}")]
    FeedType { input: String, expected: TensorType, found: TensorType },
    #[error("variable `{name}` has no value (initialize the variables first)")]
    MissingVariable { name: String },
    #[error("variable `{name}` is declared {expected}, but holds {found}")]
    VariableType { name: String, expected: TensorType, found: TensorType },
    #[error("`{node}`: index {index} is out of range for a size of {size}")]
    IndexOutOfRange { node: String, index: i64, size: usize },
    #[error("`{node}`: integer division by zero")]
    DivisionByZero { node: String },
    /// A value an op is not defined on, such as an integer raised to a negative power.
    #[error("`{node}`: {message}")]
    InvalidValue { node: String, message: String },
    #[error("the graph has a cycle through {}", nodes.join(", "))]
    Cycle { nodes: Vec<String> },
    /// Partitions that would reach the all-reduces `keys` in different orders, each waiting in
    /// one for a replica that waits in another: a deadlock, refused before any step.
    #[error(
        "the replicas would wait for each other forever: their partitions reach the all-reduces {} in different orders (a cycle through {})",
        keys.iter().map(|k| format!("`{k}`")).collect::<Vec<_>>().join(" and "),
        nodes.join(", ")
    )]
    CrossedAllReduces { keys: Vec<String>, nodes: Vec<String> },
    #[error("{what} refers to a node that is not in the graph")]
    UnknownNode { what: String },
    /// The node breaks an invariant of the IR (the verifier would report it too).
    #[error("`{node}` is malformed: {message}")]
    Malformed { node: String, message: String },
    /// A device failed to run a step: a launch, a copy, a library call.
    #[error("{device}: {message}")]
    Device { device: String, message: String },
    /// `eval` was given an op that only a program can run (inputs, variables, assignments).
    #[error("`{op}` needs a program to run")]
    Stateful { op: String },
    #[error("the program does not fit this module (node `{node}`); run it on the module it was built from")]
    ModuleMismatch { node: String },
    /// A `Send`, `Recv` or `AllReduce` in a program run without a rendezvous (`Program::run`
    /// instead of `Program::run_with`).
    #[error("`{node}` exchanges tensors with other partitions; run the program with a rendezvous")]
    NoRendezvous { node: String },
    /// The step was given up because another partition failed (see that partition's error).
    #[error("aborted: {reason}")]
    Aborted { reason: String },
    /// A wait for another partition that did not end: a plan whose partitions cannot meet, or
    /// (on workers) a partition elsewhere that is slow, stopped or gone.
    #[error("waited {after:?} for `{key}` from another partition: it was never sent (do the plan's partitions meet?), or whatever sends it is slow, stopped or gone")]
    RendezvousTimeout { key: String, after: std::time::Duration },
    /// Partitions that use one key inconsistently (sent twice, reduced with different sizes).
    #[error("rendezvous `{key}`: {message}")]
    RendezvousConflict { key: String, message: String },
    #[error("`{node}` received {found} under `{key}`, but its type is {expected}")]
    RecvType { node: String, key: String, expected: TensorType, found: TensorType },
    /// A bug in the interpreter (or in `infer`): a kernel computed a type other than the node's.
    #[error("internal error: `{node}` computed {found}, but its type is {expected}")]
    WrongOutput { node: String, expected: TensorType, found: TensorType },
}

impl scalar::Fault {
    fn at(self, node: &str) -> InterpError {
        let node = node.to_string();
        match self {
            scalar::Fault::IndexOutOfRange { index, size } => InterpError::IndexOutOfRange { node, index, size },
            scalar::Fault::DivisionByZero => InterpError::DivisionByZero { node },
            scalar::Fault::Invalid(message) => InterpError::InvalidValue { node, message },
        }
    }
}

/// Computes one stateless op on `operands`, checking their types with `dfc_ir::infer` first
/// and the result against the type it gives. Errors name the op.
pub fn eval(op: &Op, operands: &[&Tensor]) -> Result<Tensor, InterpError> {
    if op.is_stateful() || matches!(op, Op::Input { .. } | Op::Read) {
        return Err(InterpError::Stateful { op: op.name().to_string() });
    }
    let name = op.name();
    let types: Vec<TensorType> = operands.iter().map(|t| t.ty()).collect();
    let type_refs: Vec<&TensorType> = types.iter().collect();
    let expected = dfc_ir::infer(op, &type_refs)
        .map_err(|e| InterpError::Malformed { node: name.to_string(), message: format!("ill-typed: {}", e.message) })?;
    program::check_types(op, &type_refs, &expected)
        .map_err(|message| InterpError::Malformed { node: name.to_string(), message })?;
    let result = kernels::compute(op, operands).map_err(|f| f.at(name))?;
    if result.ty() != expected[0] {
        return Err(InterpError::WrongOutput {
            node: name.to_string(),
            expected: expected[0].clone(),
            found: result.ty(),
        });
    }
    Ok(result)
}
