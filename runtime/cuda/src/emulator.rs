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
//! [`run_grid_threaded`] also deals the shuffled threads out to several host threads. Not yet:
//! barriers, shared memory and shuffles, for the block-wide reductions to come. Today's
//! kernels have none of them and share no output between threads.

use dfc_codegen::GpuKernel;

/// A kernel's launch: `grid` blocks of `block` threads over `rows` rows, one per thread where
/// they are `split`, else all of them in thread 0 (`GpuKernel`'s fields of the same names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grid {
    pub rows: u64,
    pub block: u32,
    pub grid: u32,
    pub split: bool,
}

impl From<&GpuKernel> for Grid {
    fn from(kernel: &GpuKernel) -> Grid {
        Grid { rows: kernel.rows, block: kernel.block, grid: kernel.grid, split: kernel.split }
    }
}

/// Every thread of a launch of `grid` blocks of `block` threads over `rows` rows, as its row,
/// in an order shuffled by `seed`; threads past the last row (the last block's spare ones) do
/// nothing, as the entry does.
pub fn thread_rows(rows: u64, block: u32, grid: u32, seed: u64) -> Vec<u64> {
    let threads = u64::from(grid) * u64::from(block);
    let mut order: Vec<u64> = (0..threads).filter(|&row| row < rows).collect();
    fastrand::Rng::with_seed(seed).shuffle(&mut order);
    order
}

/// [`run_grid`], with the shuffled threads dealt out round-robin to `workers` host threads
/// running side by side, so that the GPU's threads also interleave. Only for kernels whose
/// threads write disjoint elements (every kernel codegen makes: a `split` kernel's rows write
/// their own parts of the output, and an unsplit one runs in one thread): `body` is called
/// concurrently.
pub fn run_grid_threaded(launch: Grid, seed: u64, workers: usize, body: impl Fn(u64, u64) + Sync) {
    if !launch.split || workers <= 1 {
        return run_grid(launch, seed, body);
    }
    let order = thread_rows(launch.rows, launch.block, launch.grid, seed);
    std::thread::scope(|scope| {
        for w in 0..workers {
            let (order, body) = (&order, &body);
            scope.spawn(move || {
                for &row in order.iter().skip(w).step_by(workers) {
                    body(row, row + 1);
                }
            });
        }
    });
}

/// Runs a kernel's launch as its entry does: for split rows, `body(row, row + 1)` once per
/// thread of the grid, in a shuffled order (see [`thread_rows`]); otherwise `body(0, rows)` in
/// thread 0 and nothing in the others. `body` is the kernel's loop nest over a range of rows.
pub fn run_grid(launch: Grid, seed: u64, mut body: impl FnMut(u64, u64)) {
    if !launch.split {
        for row in thread_rows(1, launch.block, launch.grid, seed) {
            debug_assert_eq!(row, 0);
            body(0, launch.rows);
        }
        return;
    }
    for row in thread_rows(launch.rows, launch.block, launch.grid, seed) {
        body(row, row + 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threaded_grids_run_every_row_once() {
        let rows = 10_000u64;
        let (block, grid) = dfc_codegen::launch(rows);
        let seen: Vec<std::sync::atomic::AtomicU32> = (0..rows).map(|_| Default::default()).collect();
        run_grid_threaded(Grid { rows, block, grid, split: true }, 3, 4, |begin, end| {
            assert_eq!(end, begin + 1);
            seen[begin as usize].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        });
        assert!(seen.iter().all(|n| n.load(std::sync::atomic::Ordering::Relaxed) == 1));
    }

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
