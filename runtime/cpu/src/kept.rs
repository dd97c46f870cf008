//! Weights kept laid out between runs: the products and convolutions of a schedule that read a weight no step of the
//! schedule writes (an inference's, an evaluation's), which read it from where it is kept rather than lay it out
//! again at every run. A program trusts what it keeps across runs only while the variables' stamp is the one its
//! last run left (`dfc_interp::Variables::stamp`): anything else that wrote the variables since (a training step's
//! program, a checkpoint restored) makes it stale.
//!
//! - The B of a product, packed (`dfc_gemm::KeptPanels`): only where the products run on the AVX2 kernels, which
//!   pack B on every call (the mlp's inference, 128 images a batch: 330 → 318 µs, an Intel Xeon with
//!   `DFC_GEMM=avx2`). A weight that a training step updates is not kept: its update would have to store each new
//!   value twice (in the weight and in its panels), which cost the mlp's training step as much as its products
//!   saved.
//! - The filter of a forward convolution that Winograd can compute, transformed (`dfc_kernels::KeptFilter`), on
//!   every kernel: at a batch of one it had cost more than the products (the CNN's inference at batch 1, two threads,
//!   an Intel Xeon: 31.4 → 22.6 µs on the AVX-512 kernels, where a batch of one now takes Winograd; 49–52 → 30–32
//!   µs on the AVX2 kernels).

use crate::schedule::{ConvKind, Schedule, Slot, Step};
use dfc_gemm::KeptPanels;
use dfc_kernels::KeptFilter;
use std::collections::{HashMap, HashSet};

/// Products of this many rows or fewer (a batch of one to three) read B where it is stored, once, in order
/// (`dfc_gemm`'s `avx2::rows`), and would never read the panels.
const FEW_ROWS: usize = 3;

/// What a program keeps of one weight (its variable's index) as one step reads it.
#[derive(Debug)]
pub enum Kept {
    Panels(KeptPanels),
    Filter(KeptFilter),
}

impl Kept {
    /// Forgets what it holds: the weight was written.
    pub fn stale(&mut self) {
        match self {
            Kept::Panels(panels) => panels.stale(),
            Kept::Filter(filter) => filter.stale(),
        }
    }
}

/// Per step of `schedule`, the index of what is kept of the weight it reads (if any), and each weight kept (its
/// variable's index) with what is kept of it: every variable that no step writes, read whole as the B (stored
/// row-major) of a product of one matrix of more than `FEW_ROWS` rows where the products' kernels read kept panels,
/// or as the filter of a forward convolution that Winograd can compute.
pub fn plan(schedule: &Schedule) -> (Vec<Option<usize>>, Vec<(usize, Kept)>) {
    let mut reads = vec![None; schedule.steps.len()];
    let written: HashSet<Slot> = schedule.steps.iter().flat_map(|step| step.reads_writes().1).collect();
    let panels_used = KeptPanels::used();
    // The kept weights, each as a B of its shape (a weight read through reshapes of two shapes has two), or as a
    // filter.
    let mut kept: Vec<(usize, Option<(usize, usize)>)> = Vec::new();
    let mut index: HashMap<(usize, Option<(usize, usize)>), usize> = HashMap::new();
    for (read, step) in reads.iter_mut().zip(&schedule.steps) {
        let weight = match step {
            Step::MatMul { b: Slot::Variable(v), m, k, n, tb: false, batches, .. } if panels_used => {
                let whole =
                    batches.len() == 1 && batches[0].1 == 0 && k * n == schedule.variables[*v].1.shape.n_elements();
                if !whole || *m <= FEW_ROWS {
                    continue;
                }
                (*v, Some((*k, *n)))
            }
            Step::Conv { kind: ConvKind::Forward, b: Slot::Variable(v), geometry, .. }
                if dfc_kernels::conv2d_keeps_filter(geometry) =>
            {
                (*v, None)
            }
            _ => continue,
        };
        if written.contains(&Slot::Variable(weight.0)) {
            continue;
        }
        *read = Some(*index.entry(weight).or_insert_with(|| {
            kept.push(weight);
            kept.len() - 1
        }));
    }
    let kept = kept
        .into_iter()
        .map(|(v, shape)| match shape {
            Some((k, n)) => (v, Kept::Panels(KeptPanels::new(k, n))),
            None => (v, Kept::Filter(KeptFilter::new())),
        })
        .collect();
    (reads, kept)
}
