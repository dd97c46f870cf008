//! The training driver behind `dfc run`: data feeds, batches, epochs, evaluation, metrics, checkpoints.
//!
//! - [`data`]: loading IDX, NumPy `.npy` and CSV files (raw or gzip) into tensors whose leading
//!   axis is the example axis, fitting them to the model's inputs, and batching them.
//! - [`indices`]: the ranges a plan's ops need of its integer inputs (one_hot depths, gather
//!   tables, sharded ones included), checked on every feed when it is loaded.
//! - [`npy`]: `.npy` reading and writing ([`save_npy`] backs `dfc run --fetch NAME -o out.npy`).
//! - [`checkpoint`]: atomic safetensors checkpoints of the variables, the last few kept.
//! - [`metrics`]: the JSON-lines log of one record per epoch.
//! - [`session`]: runs any plan, one partition or many, in one process (a thread per
//!   partition); holds the variables and builds programs from names.
//! - [`replicas`]: feeding an asynchronous plan's replicas, whose inputs are their own.
//! - [`runner`]: what the loop needs of whatever runs a plan (a session, or remote workers).
//! - [`train`](mod@train): the loop: epochs, evaluation, checkpoints and resumption, and `--fetch`.
//! - [`sample`](mod@sample): text from a model trained on a text feed (`dfc sample`).

pub mod checkpoint;
pub mod data;
pub mod indices;
pub mod memory;
pub mod metrics;
pub mod npy;
pub mod replicas;
pub mod runner;
pub mod sample;
pub mod session;
mod source;
pub mod tensorboard;
pub mod timeline;
pub mod train;

pub use checkpoint::{Checkpoint, CheckpointError};
pub use data::{fit, load, load_bytes, load_csv, load_idx, load_npy, shuffled_order, DataError, Dataset};
pub use metrics::{BackupCounts, EpochRecord, MetricsLog, WorkerMetrics};
pub use npy::{save_npy, to_npy_bytes};
pub use runner::{BackupStep, FreeReplicas, ReplicaStep, Runner};
pub use session::{Backend, Session, SessionProgram, Stage};
pub use train::{
    backups_need_workers, batch_size, evaluate, infer, load_feeds, nothing_to_train, restore, train, train_with,
    Progress, RunError, TrainOptions, TrainSummary,
};
