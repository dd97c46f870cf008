//! `Runner`: what the training loop needs of whatever runs a plan — a [`Session`] in this
//! process, or a driver of remote workers (`dfc_rpc`).

use crate::metrics::WorkerMetrics;
use crate::session::{Session, SessionProgram};
use crate::train::RunError;
use dfc_interp::{Tensor, Variables};
use dfc_plan::Plan;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

pub trait Runner {
    /// A program built once and run many times.
    type Program;

    fn plan(&self) -> &Plan;

    /// The program that fetches `fetches` (named outputs or metrics, else node names) and runs
    /// the nodes named in `targets` for their effect.
    fn program(&mut self, fetches: &[&str], targets: &[&str]) -> Result<Self::Program, RunError>;

    /// The plan inputs `program` needs.
    fn inputs(&self, program: &Self::Program) -> Vec<String>;

    /// One run of `program` on `feeds` (by plan input): the fetched values, in order.
    fn run(&mut self, program: &Self::Program, feeds: &HashMap<String, Tensor>) -> Result<Vec<Tensor>, RunError>;

    /// The logical variables (what a checkpoint holds).
    fn variables(&mut self) -> Result<Variables, RunError>;

    /// Sets the logical variables from a checkpoint read from `path`.
    fn restore(&mut self, saved: &BTreeMap<String, Tensor>, path: &Path) -> Result<(), RunError>;

    /// What each worker's runs took since the last call (nothing where there are no workers).
    fn take_worker_metrics(&mut self) -> Vec<WorkerMetrics> {
        Vec::new()
    }

    /// The plan's replicas as steppers that may run at the same time, each on its own batches
    /// (an asynchronous plan on workers that keep the replicas apart); `None` where replicas
    /// step together.
    fn free_replicas(&mut self) -> Result<Option<&dyn FreeReplicas>, RunError> {
        Ok(None)
    }

    /// Why the replicas of an asynchronous plan step together where this runner could run
    /// replicas on their own (once `free_replicas` has found that they cannot); `None` otherwise.
    fn why_replicas_step_together(&self) -> Option<&str> {
        None
    }
}

/// Replicas that train each on its own (asynchronous parameter servers, free-running).
pub trait FreeReplicas: Sync {
    /// One training step of replica `replica` on `feeds` (by its own `Input` nodes,
    /// `Plan::replicas`): its loss, and the staleness of its update where the plan measures it.
    fn step(&self, replica: usize, feeds: &HashMap<String, Tensor>) -> Result<ReplicaStep, RunError>;
}

/// What one free-running replica's step gives.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReplicaStep {
    pub loss: f64,
    /// Staleness-aware updates: τ, the updates the variables took since the replica read them,
    /// plus one.
    pub staleness: Option<f64>,
    /// Backup workers: what became of its gradient.
    pub backup: Option<BackupStep>,
}

/// What became of a free-running replica's gradient under backup workers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackupStep {
    /// Taken into an update (else dropped: an update came between its read and its gradient).
    pub accepted: bool,
    /// It completed an update, which it applied.
    pub applied: bool,
    /// The variables' version (updates applied) after its step.
    pub version: u64,
}

impl<'p> Runner for Session<'p> {
    type Program = SessionProgram;

    fn plan(&self) -> &Plan {
        Session::plan(self)
    }

    fn program(&mut self, fetches: &[&str], targets: &[&str]) -> Result<SessionProgram, RunError> {
        Session::program(self, fetches, targets)
    }

    fn inputs(&self, program: &SessionProgram) -> Vec<String> {
        crate::replicas::plan_inputs(Session::plan(self), program.inputs())
    }

    fn run(&mut self, program: &SessionProgram, feeds: &HashMap<String, Tensor>) -> Result<Vec<Tensor>, RunError> {
        Session::run(self, program, feeds)
    }

    fn variables(&mut self) -> Result<Variables, RunError> {
        Session::variables(self)
    }

    fn restore(&mut self, saved: &BTreeMap<String, Tensor>, path: &Path) -> Result<(), RunError> {
        Session::restore(self, saved, path)
    }
}
