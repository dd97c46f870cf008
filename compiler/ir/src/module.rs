use crate::graph::{Graph, NodeId, TensorRef};
use serde::{Deserialize, Serialize};
use std::fmt;

/// One compiled model: its graph and what the graph means to a user — the inputs to feed, the
/// trainable parameters, the named outputs, and what to minimise with which optimizer.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Module {
    pub name: String,
    pub graph: Graph,
    /// Every `dim` with the value it was given, in declaration order.
    pub dims: Vec<(String, usize)>,
    /// `Input` nodes, in declaration order.
    pub inputs: Vec<NodeId>,
    /// `Variable` nodes of the model's parameters, in creation order.
    pub params: Vec<NodeId>,
    pub outputs: Vec<Output>,
    /// Scalars averaged over evaluation data (`metric accuracy = ...`).
    pub metrics: Vec<Output>,
    pub training: Option<Training>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Output {
    pub name: String,
    pub tensor: TensorRef,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Training {
    /// A floating-point scalar.
    pub loss: TensorRef,
    pub optimizer: Optimizer,
    /// The gradient of the loss for each trainable variable; filled by autodiff.
    pub gradients: Vec<(NodeId, TensorRef)>,
    /// The ops that one training step runs for their effect (variable and slot updates),
    /// filled by the optimizer pass. Empty until then.
    pub updates: Vec<NodeId>,
    /// The learning rate of this step where a schedule computes it (filled by the optimizer
    /// pass), for the metrics.
    pub learning_rate: Option<TensorRef>,
    /// Local SGD (`--sync-every`): the assignments that set every replica's copy of every
    /// float variable to the replicas' mean, run every few steps instead of all-reducing each
    /// step's gradients (filled by replication; empty otherwise).
    pub averages: Vec<NodeId>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Optimizer {
    pub kind: OptimizerKind,
    /// The learning rate: the schedule's first where there is one.
    pub learning_rate: f64,
    /// Decoupled weight decay applied by the update (0 for none).
    pub weight_decay: f64,
    /// The learning rate by step, where it is not constant.
    pub schedule: Option<crate::LrSchedule>,
    /// Gradients scaled together so that their global norm is at most this.
    pub clip_global_norm: Option<f64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum OptimizerKind {
    Sgd,
    Momentum { momentum: f64, nesterov: bool },
    Adam { beta1: f64, beta2: f64, epsilon: f64 },
    Adagrad { initial_accumulator: f64, epsilon: f64 },
    RmsProp { rho: f64, momentum: f64, epsilon: f64 },
}

impl fmt::Display for Optimizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let lr = match &self.schedule {
            Some(schedule) => schedule.to_string(),
            None => format!("{:?}", self.learning_rate),
        };
        match &self.kind {
            OptimizerKind::Sgd => write!(f, "sgd(lr={lr}")?,
            OptimizerKind::Momentum { momentum, nesterov } => {
                write!(f, "momentum(lr={lr}, momentum={momentum:?}, nesterov={nesterov}")?
            }
            OptimizerKind::Adam { beta1, beta2, epsilon } => {
                write!(f, "adam(lr={lr}, beta1={beta1:?}, beta2={beta2:?}, epsilon={epsilon:?}")?
            }
            OptimizerKind::Adagrad { initial_accumulator, epsilon } => {
                write!(f, "adagrad(lr={lr}, initial_accumulator={initial_accumulator:?}, epsilon={epsilon:?}")?
            }
            OptimizerKind::RmsProp { rho, momentum, epsilon } => {
                write!(f, "rmsprop(lr={lr}, rho={rho:?}, momentum={momentum:?}, epsilon={epsilon:?}")?
            }
        }
        if self.weight_decay != 0.0 {
            write!(f, ", weight_decay={:?}", self.weight_decay)?;
        }
        if let Some(norm) = self.clip_global_norm {
            write!(f, ", clip_global_norm={norm:?}")?;
        }
        f.write_str(")")
    }
}
