//! The passes over the IR. Each is a module with one entry function and no printing; the
//! verifier runs after each in tests (`run_pipeline` verifies in debug builds).
//!
//! Order for training: pool_early → autodiff → optimizer → simplify. `prune` selects what a given set of
//! fetches and targets needs, for running.

mod autodiff;
pub mod cost;
pub mod fuse;
mod optimizer;
mod partition;
mod pipeline;
mod place;
mod pool_early;
pub mod profile;
mod prune;
mod replicate;
pub mod search;
mod shard;
mod simplify;
mod tensor_fusion;

pub use autodiff::autodiff;
pub use cost::{CostModel, CostReport, DeviceCost, TaskProfile, Topology};
pub use fuse::{fuse, Fusion, Kernel};
pub use optimizer::{apply_optimizer, OptimizerOptions};
pub use partition::{partition, transfer_names, Partitioned};
pub use pipeline::assign_stages;
pub use place::{balance, place, ModelPlacement, PlaceOptions, Placed, SearchReport, VariablePlacement};
pub use pool_early::pool_early;
pub use profile::Profile;
pub use prune::{prune, PruneError};
pub use replicate::{
    drop_cross_replica_means, replica_interfaces, replica_name, replicate, without_averages, BackupNodes,
    ReplicaInterface, ReplicateOptions, Replication, AVERAGE_KEY_PREFIX,
};
pub use shard::{shard_rows, shard_variables, ShardOptions};
pub use simplify::simplify;
pub use tensor_fusion::{fuse_all_reduces, FusionOptions};

use dfc_ir::Module;

/// The passes `dfc ir --after` and `dfc compile` know, in pipeline order.
pub const PASSES: &[&str] = &["sema", "pool_early", "autodiff", "optimizer", "simplify"];

/// Runs the pipeline up to and including `last` (`None`: all of it). Debug builds verify the IR
/// after every pass and panic on a broken invariant, naming the pass: that is a compiler bug.
pub fn run_pipeline(module: &mut Module, last: Option<&str>) {
    run_pipeline_with(module, last, &OptimizerOptions::default());
}

/// `run_pipeline` with the optimizer's update built as `optimizer` says (a replica's module
/// whose optimizer is sharded over the replicas).
pub fn run_pipeline_with(module: &mut Module, last: Option<&str>, optimizer: &OptimizerOptions) {
    for &pass in PASSES {
        run_pass_with(module, pass, optimizer);
        if Some(pass) == last {
            break;
        }
    }
}

/// Runs one pass of `PASSES` (`sema` has run already: nothing to do), verified as above.
pub fn run_pass(module: &mut Module, pass: &str) {
    run_pass_with(module, pass, &OptimizerOptions::default());
}

fn run_pass_with(module: &mut Module, pass: &str, optimizer: &OptimizerOptions) {
    match pass {
        "pool_early" => pool_early(module),
        "autodiff" => autodiff(module),
        "optimizer" => apply_optimizer(module, optimizer),
        "simplify" => simplify(module),
        _ => {}
    }
    if cfg!(debug_assertions) {
        let problems = dfc_ir::verify(module, dfc_ir::VerifyOptions::default());
        assert!(problems.is_empty(), "the IR is broken after `{pass}`: {problems:?}");
    }
}
