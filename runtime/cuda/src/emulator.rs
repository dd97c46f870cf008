//! The grid emulator: a GPU kernel's launch, run on the CPU with the GPU's semantics, so that
//! CI (which has no GPU) sees what a grid of threads does with a kernel.
//!
//! A GPU kernel's entry (`dfc_codegen::compile_gpu`) computes `row = block · block_dim +
//! thread` and, for a row inside the kernel's `rows`, runs the kernel's loop nest over that one
//! row (or, for a kernel whose rows are not split, thread 0 runs them all). The emulator does
//! exactly that for every (block, thread) of the launch (`grid` blocks of `block` threads),
//! calling `body(row, row + 1)`: the caller passes the same loop nest
//! compiled for the host (`kernel::emit`'s CPU flavour, which differs from the GPU's only in
//! its transcendentals). The threads run in a shuffled order, seeded, so that a kernel whose
//! result depends on which thread runs last (every thread initialising a shared output, as
//! reductions over the launch axis did when every thread ran its own row of them) gives a
//! wrong value, as it would on a GPU.
//!
//! Not yet: running the shuffled threads from several host threads, and barriers, shared
//! memory and shuffles, for the block-wide reductions to come. Today's kernels have none of
//! them and share no output between threads.

use dfc_codegen::GpuKernel;

/// Every thread of a launch of `grid` blocks of `block` threads over `rows` rows, as its row,
/// in an order shuffled by `seed`; threads past the last row (the last block's spare ones) do
/// nothing, as the entry does.
pub fn thread_rows(rows: u64, block: u32, grid: u32, seed: u64) -> Vec<u64> {
    let threads = u64::from(grid) * u64::from(block);
    let mut order: Vec<u64> = (0..threads).filter(|&row| row < rows).collect();
    fastrand::Rng::with_seed(seed).shuffle(&mut order);
    order
}

/// Runs `kernel`'s launch as its entry does: for split rows, `body(row, row + 1)` once per
/// thread of the grid, in a shuffled order (see [`thread_rows`]); otherwise `body(0, rows)` in
/// thread 0 and nothing in the others. `body` is the kernel's loop nest over a range of rows.
pub fn run_grid(kernel: &GpuKernel, seed: u64, mut body: impl FnMut(u64, u64)) {
    if !kernel.split {
        for row in thread_rows(1, kernel.block, kernel.grid, seed) {
            debug_assert_eq!(row, 0);
            body(0, kernel.rows);
        }
        return;
    }
    for row in thread_rows(kernel.rows, kernel.block, kernel.grid, seed) {
        body(row, row + 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_row_runs_once_in_a_shuffled_order() {
        for rows in [1, 31, 32, 33, 1000, 70_000] {
            let (block, grid) = dfc_codegen::launch(rows);
            let order = thread_rows(rows, block, grid, 7);
            let mut seen = vec![0u32; rows as usize];
            for &row in &order {
                seen[row as usize] += 1;
            }
            assert!(seen.iter().all(|&n| n == 1), "{rows} rows");
            if rows > 8 {
                assert!(order.windows(2).any(|w| w[0] > w[1]), "{rows} rows: not shuffled");
            }
        }
    }
}
