//! The dfc dataflow IR.
//!
//! A `Module` is a `Graph` of nodes plus what the graph means to a user (inputs, parameters,
//! outputs, the loss and optimizer). Each node holds one op from the closed `Op` enum, the
//! static type (`DType` and `Shape`) of each output, a unique name whose `/`-separated prefix is
//! its name scope, the device the source requested and, after placement, the device chosen.
//!
//! Edges are data edges (output port → operand index) or control edges (ordering only).
//! Evaluation rule: a node runs once all its data and control predecessors have run; stateful
//! ops (`Variable`, the assignments) are never merged or removed by passes that do not know them.
//!
//! Invariants, all checked by `verify`: the graph is acyclic; each node has exactly the
//! operands its op takes, numbered 0..n, each from an existing output; output types equal
//! `infer(op, operand types)`; names are unique; only `read` and the assignments consume a
//! variable directly; after placement, every node has a device.
//!
//! Source spans live beside the graph (node → span); a pass that creates a node copies the span
//! of the node it came from.
//!
//! Architecture Invariant: this crate knows nothing of pest, LLVM, CUDA or gRPC.

mod cluster;
mod device;
mod dot;
mod graph;
mod infer;
mod instance;
mod module;
mod op;
mod print;
mod schedule;
mod types;
mod verify;
mod workers;

pub use cluster::{address_host, task_profiles, Cluster, Job, Task};
pub use device::{DeviceKind, DeviceSpec};
pub use dot::{human_bytes, to_dot, DotOptions};
pub use graph::{Edge, Graph, Node, NodeId, TensorRef};
pub use infer::{broadcast_shapes, infer, TypeError};
pub use instance::{
    device_slug, instance_transfers, instantiate, replica_prefix, replica_shard, Instance, Renamer, REPLICA_SHARD,
    REPLICA_SLOT,
};
pub use module::{Module, Optimizer, OptimizerKind, Output, Training};
pub use op::{
    BinaryOp, CompareOp, ConstData, ConstValue, Initializer, Op, Padding, ReduceKind, UnaryOp, VariableOrigin,
};
pub use print::{print, print_annotated};
pub use schedule::{Decay, LrSchedule, MAX_BOUNDARIES};
pub use types::{DType, Shape, TensorType};
pub use verify::{verify, verify_graph, verify_partitions, VerifyError, VerifyOptions};
pub use workers::{assign_workers, Assignment};
