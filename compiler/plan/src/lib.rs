//! The execution plan: what `dfc compile` writes and `dfc inspect` / `dfc run` read.
//!
//! A `Plan` is the compiled model split into one `Partition` per device, plus a name-level
//! description of its interface (inputs, outputs, parameters, training) so that tools can show
//! and check a plan without walking graphs. The on-disk form is a fixed header (magic, format
//! version, payload length, CRC-32) followed by the postcard-encoded `Plan`; see
//! `docs/plan-format.md`.

mod format;
mod summary;

pub use format::{decode, encode, write, PlanError, FORMAT_VERSION, HEADER_LEN, MAGIC};
pub use summary::{summary, DeviceSummary, ParamSummary, Summary, TensorSummary, TrainingSummary};

use dfc_ir::{DeviceKind, DeviceSpec, Initializer, Module, Op, Optimizer, TensorRef, TensorType};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Plan {
    /// The version of the dfc that wrote the plan, for bug reports; readers check
    /// `FORMAT_VERSION`, not this.
    pub dfc_version: String,
    /// File name of the `.df` source.
    pub source_name: String,
    /// `source_hash` of the source text, so a tool can tell whether a plan is stale.
    pub source_hash: u64,
    pub model: String,
    pub dims: Vec<(String, usize)>,
    pub cluster: Cluster,
    /// One per device. Each holds a self-contained module whose own `inputs`, `params`,
    /// `outputs` and `training` refer to its graph.
    pub partitions: Vec<Partition>,
    pub inputs: Vec<IoSpec>,
    pub outputs: Vec<IoSpec>,
    pub params: Vec<ParamSpec>,
    pub training: Option<TrainingSpec>,
}

/// The machines a plan runs on, in TensorFlow's terms: jobs of tasks, each task with devices.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Cluster {
    pub jobs: Vec<Job>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Job {
    pub name: String,
    pub tasks: Vec<Task>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Task {
    pub devices: Vec<DeviceSpec>,
}

/// The part of the model one device runs; every node of `module.graph` has `device` set.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Partition {
    pub device: DeviceSpec,
    pub module: Module,
}

/// A model input or named output, by name: what a user feeds or fetches.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct IoSpec {
    pub name: String,
    pub ty: TensorType,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ParamSpec {
    pub name: String,
    pub ty: TensorType,
    pub init: Initializer,
    pub trainable: bool,
    pub partitions: u32,
    /// The device the source asked for (`@device`, `device` blocks), if any.
    pub requested_device: Option<String>,
    /// Size of the variable's buffer.
    pub bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainingSpec {
    /// The named output that is the loss, or else the loss node's name (`name:port` for a port
    /// other than 0).
    pub loss: String,
    pub optimizer: Optimizer,
}

impl Plan {
    /// A plan that runs the whole of `module` on the local CPU. `module` must have passed
    /// `dfc_ir::verify`: its `inputs` and `params` name `Input` and `Variable` nodes.
    pub fn single_device(module: Module, source_name: &str, source_text: &str) -> Plan {
        let device = DeviceSpec {
            job: Some("localhost".into()),
            replica: None,
            task: Some(0),
            kind: Some(DeviceKind::Cpu),
            index: Some(0),
        };
        let mut module = module;
        let ids: Vec<_> = module.graph.node_ids().collect();
        for id in ids {
            module.graph.node_mut(id).device = Some(device.clone());
        }

        let graph = &module.graph;
        let inputs = module
            .inputs
            .iter()
            .map(|&id| {
                let node = graph.node(id);
                let ty = match &node.op {
                    Op::Input { ty } => ty.clone(),
                    _ => graph.ty(id.into()).clone(),
                };
                IoSpec { name: node.name.clone(), ty }
            })
            .collect();
        let outputs =
            module.outputs.iter().map(|o| IoSpec { name: o.name.clone(), ty: graph.ty(o.tensor).clone() }).collect();
        let params = module
            .params
            .iter()
            .map(|&id| {
                let node = graph.node(id);
                let Op::Variable { ty, init, trainable, partitions } = &node.op else {
                    panic!("module.params lists `{}`, which is not a variable", node.name);
                };
                ParamSpec {
                    name: node.name.clone(),
                    ty: ty.clone(),
                    init: init.clone(),
                    trainable: *trainable,
                    partitions: *partitions,
                    requested_device: node.requested_device.as_ref().map(|d| d.to_string()),
                    bytes: tensor_bytes(ty),
                }
            })
            .collect();
        let training = module
            .training
            .as_ref()
            .map(|t| TrainingSpec { loss: tensor_name(&module, t.loss), optimizer: t.optimizer.clone() });

        Plan {
            dfc_version: env!("CARGO_PKG_VERSION").into(),
            source_name: source_name.into(),
            source_hash: source_hash(source_text),
            model: module.name.clone(),
            dims: module.dims.clone(),
            cluster: Cluster {
                jobs: vec![Job { name: "localhost".into(), tasks: vec![Task { devices: vec![device.clone()] }] }],
            },
            inputs,
            outputs,
            params,
            training,
            partitions: vec![Partition { device, module }],
        }
    }
}

/// The name a user knows a tensor by: a named output if one is that tensor, else its node.
fn tensor_name(module: &Module, tensor: TensorRef) -> String {
    if let Some(output) = module.outputs.iter().find(|o| o.tensor == tensor) {
        return output.name.clone();
    }
    let name = &module.graph.node(tensor.node).name;
    match tensor.port {
        0 => name.clone(),
        port => format!("{name}:{port}"),
    }
}

/// Bytes of a tensor's buffer, saturating: a decoded plan may hold absurd shapes, and sizes
/// are only shown, so they must not overflow (a panic in debug builds).
pub(crate) fn tensor_bytes(ty: &TensorType) -> u64 {
    ty.shape.dims().iter().fold(ty.dtype.size_in_bytes() as u64, |acc, &d| acc.saturating_mul(d as u64))
}

/// FNV-1a, 64 bit: a stable fingerprint of the source text (not a security measure; it only
/// tells whether a plan was compiled from this text).
pub fn source_hash(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, byte| (hash ^ byte as u64).wrapping_mul(0x0000_0100_0000_01b3))
}
