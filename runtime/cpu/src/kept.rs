//! Weights kept packed between runs: the products of a schedule whose B is a weight that no step of the schedule
//! writes (an inference's, an evaluation's), which read it from the weight's kept panels (`dfc_gemm::KeptPanels`)
//! rather than pack it again at every run. A program trusts the panels across runs only while the variables' stamp
//! is the one its last run left (`dfc_interp::Variables::stamp`): anything else that wrote the variables since (a
//! training step's program, a checkpoint restored) makes them stale.
//!
//! Only where the products run on the AVX2 kernels, which pack B on every call (the mlp's inference, 128 images a
//! batch: 330 → 318 µs, an Intel Xeon with `DFC_GEMM=avx2`). A weight that a training step updates
//! is not kept: its update would have to store each new value twice (in the weight and in its panels), which cost
//! the mlp's training step as much as its products saved.

use crate::schedule::{Schedule, Slot, Step};
use dfc_gemm::KeptPanels;
use std::collections::{HashMap, HashSet};

/// Products of this many rows or fewer (a batch of one to three) read B where it is stored, once, in order
/// (`dfc_gemm`'s `avx2::rows`), and would never read the panels.
const FEW_ROWS: usize = 3;

/// Per step of `schedule`, the index of the kept panels its product reads as B (if any), and each weight kept (its
/// variable's index) with its panels: every variable read whole as the B (stored row-major) of a product of one
/// matrix of more than `FEW_ROWS` rows that no step writes. None where the products' kernels read no kept panels.
pub fn plan(schedule: &Schedule) -> (Vec<Option<usize>>, Vec<(usize, KeptPanels)>) {
    let mut reads = vec![None; schedule.steps.len()];
    if !KeptPanels::used() {
        return (reads, Vec::new());
    }
    let written: HashSet<Slot> = schedule.steps.iter().flat_map(|step| step.reads_writes().1).collect();
    // The kept weights, each as a B of its shape (a weight read through reshapes of two shapes has two).
    let mut kept: Vec<(usize, (usize, usize))> = Vec::new();
    let mut index: HashMap<(usize, (usize, usize)), usize> = HashMap::new();
    for (read, step) in reads.iter_mut().zip(&schedule.steps) {
        let Step::MatMul { b: Slot::Variable(v), m, k, n, tb: false, batches, .. } = step else { continue };
        let whole = batches.len() == 1 && batches[0].1 == 0 && k * n == schedule.variables[*v].1.shape.n_elements();
        if !whole || *m <= FEW_ROWS || written.contains(&Slot::Variable(*v)) {
            continue;
        }
        let weight = (*v, (*k, *n));
        *read = Some(*index.entry(weight).or_insert_with(|| {
            kept.push(weight);
            kept.len() - 1
        }));
    }
    let panels = kept.iter().map(|&(v, (k, n))| (v, KeptPanels::new(k, n))).collect();
    (reads, panels)
}
