//! The AVX2 + FMA single-precision product, for x86-64 CPUs without AVX-512: packed panels, a 6×16
//! register-blocked microkernel, shared among threads in chunks of rows or columns.
//!
//! Work of one thread (`block`), in BLIS's loop order:
//! - the reduction in equal blocks of at most `KC` = 200 steps (one block of up to 400 where L1d holds 48 KiB or
//!   more, `depth`), columns in blocks of at most `NC` = 512 (fewer past 256 steps, `columns`): B's kc×nc block is
//!   packed in 16-column panels (kc·16 floats, step-major, zero past the last column), at most 512 KiB that stay in
//!   L2, once per thread and product (`Packs::b_holds`: a thread's later row chunks of the product reuse it);
//! - rows in blocks of at most `MC` = 96: a transposed-stored A is packed in 6-row panels (the 6 elements of a step
//!   contiguous); a row-major A is read where it is stored, the kernel broadcasting from its 6 rows;
//! - each 16-column B panel (12.5 KiB; 25 in one block of 400) stays in L1 while the kernel walks the block's row
//!   panels past it. A product of a few rows (`b_in_place`) reads B's whole panels where B is stored instead.
//!
//! The microkernel holds a 6×16 tile of C in 12 ymm accumulators; with B's two vectors and a broadcast that is 15
//! of the 16 registers. A tile on the edge of C (fewer rows, fewer columns, or C stored transposed) goes through a
//! small array.
//!
//! A of bytes (`Product::bytes`: images fed as u8) is converted to floats a block at a time (mc rows × kc steps, in
//! a buffer of the thread's), then read as a float A would be; stored transposed, it is converted as it is packed
//! (`bytes`). Each 6-row panel of bytes leaves out the steps at which all its rows are 0 (`bytes`: black pixels, 17 %
//! of the first layer's steps on Fashion-MNIST's batches and 32 % of its weights' gradient's), and the kernels read
//! B's rows through the steps kept (`SKIP`); C is the same to the bit. A product with an epilogue
//! (`Product::bias`, `relu`, `mask`) finishes each tile as its sum
//! completes: a whole tile in the kernel's registers before it is stored, an edge tile in L1 after (`finish_tile`).
//! Neither product is transposed nor computed as dot products (`Product::fixed`).
//!
//! Threads take chunks of rows or of columns of C, whichever repeats less packing (rows for a short reduction,
//! `by_columns`), of products large enough (`shared`: while the workers spin, from a few microseconds on); a product
//! of bytes stored row-major (the first layer's images) takes one chunk of the reduction each instead
//! (`by_reduction`), so that each thread converts only its own steps of A and reads only those rows of B (in training,
//! the rows it wrote in the update), of the rows sorted by the span of their lit bytes (`grouped`).
//!
//! A product of one to three rows of C (a batch of one) runs in `rows` instead: B read where it is stored.
//!
//! Every buffer is the thread's own and kept across calls (the workers' grown to their largest up front,
//! `reserve_thread`), so that after the first products of a shape a training step allocates nothing here
//! (tests/native_alloc.rs).

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::Cell;

use crate::avx512::{dot, Buf, Product, CALLS, PARTIALS, SHORT_REDUCTION};
use crate::finite::{FiniteRows, Selection, RESERVED_STEPS};
use crate::grouped::{self, Grouping};
use crate::pool;
use crate::sums::{self, RowSums};
use std::sync::atomic::Ordering;

mod bytes;
pub(crate) mod rows;

use bytes::{convert, convert_selecting, pack_a_bytes, Scale};

/// Rows of the microkernel tile.
const MR: usize = 6;
/// Columns of the microkernel tile: two ymm vectors.
const NR: usize = 16;
/// Most steps in a block: a B panel of 200 steps × 16 columns is 12.5 KiB, in L1 beside A's rows. Reductions
/// are cut in equal blocks (`depth`), so 200 rather than 256 cuts those of 201 to 256 steps (the mlp's second layer
/// and its input gradient, 256) in two blocks of about 128 and leaves the first layer's (784, or 392 a thread) in
/// blocks of 196. On Zen 4 (32 KiB of L1d), those two products in one process, whole training steps alternated
/// with 256: within 2% in quiet spells, 4–13% faster (medians) in slow ones, where the core seems to share its
/// caches. Where L1d holds 48 KiB or more, a reduction of up to 800 steps is cut in blocks of up to 400 (`ONE_BLOCK`).
const KC: usize = 200;
/// The most steps in a block where L1d holds `WIDE_L1` bytes or more (a reduction of up to twice as many is cut in
/// such blocks, `depth`): a 400-step B panel is 25 KiB, beside a 6-row panel of A's 9.4 KiB. On an Intel Xeon with
/// 48 KiB (`DFC_GEMM=avx2`), the mlp's two 256-step products in its two-thread training step, one block rather than
/// two of 128: 94.1 → 91.9 and 95.7 → 92.9 µs (medians of 4 alternated processes each), the rest unchanged. Its first
/// layer at inference, each thread's 392 steps in one block rather than two of 196 (`benches/avx2_only.c`, the same
/// Xeon): 228.5–230.3 → 222.3–223.2 µs.
const ONE_BLOCK: usize = 400;
/// L1d bytes from which a reduction of up to `ONE_BLOCK` steps is one block.
const WIDE_L1: usize = 48 << 10;
/// The most steps in any block: what the packing buffers hold.
const KC_MAX: usize = if ONE_BLOCK > KC { ONE_BLOCK } else { KC };
/// Columns of a packed B block: 256 × 512 floats are 512 KiB at most (400 KiB at 200 steps), held in L2 while A's
/// rows stream past.
const NC: usize = 512;
/// Floats of a packed block of B at most (512 KiB, `columns`): L2 holds it on the CPUs with 512 KiB and more.
const B_BLOCK: usize = 256 * NC;

/// Columns of B in a block of `kc` steps: `NC`, or fewer (a multiple of 16) where that many would pass `B_BLOCK`.
fn columns(kc: usize) -> usize {
    (B_BLOCK / kc.max(1) / NR * NR).clamp(NR, NC)
}
/// Rows of A per block (16 panels).
const MC: usize = 96;
/// Panels of A in a block.
const PANELS: usize = MC / MR;
/// Room for where a panel's kept steps lie in a packed B panel (`Selection`, `bytes::STEP_BYTES`): a block's steps,
/// and the 8 past them that a store writes.
const STEPS_STRIDE: usize = KC_MAX + 16;

/// The steps of each block of a reduction of `steps`: equal blocks of at most `KC`, or, where L1d holds `WIDE_L1`
/// bytes or more (`wide_l1`), of at most `ONE_BLOCK` in a reduction of up to two such blocks. (The mlp's first layer,
/// 784 steps, in two blocks rather than four, on one thread or on two by rows: 1.2–1.6 % off its inference under
/// `benches/avx2_only.c`; the CNN's reductions of 1,600 and 7,744 steps measured 0.1–0.8 % slower in such blocks.)
fn depth(steps: usize, wide_l1: bool) -> usize {
    let most = if wide_l1 && steps <= 2 * ONE_BLOCK { ONE_BLOCK } else { KC };
    steps.div_ceil(steps.div_ceil(most).max(1)).max(1)
}

/// Whether this CPU's L1 data cache holds `WIDE_L1` bytes or more (CPUID, read once; no when it does not say).
fn wide_l1() -> bool {
    static WIDE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WIDE.get_or_init(|| cache_size::l1_cache_size().is_some_and(|bytes| bytes >= WIDE_L1))
}

/// A thread's packing buffers, with the identity of the block of B packed (call, pc, kc, jc, nc), so that the row
/// chunks of one product that a thread runs pack B once.
#[derive(Default)]
struct Packs {
    a: Buf,
    b: Buf,
    b_holds: Option<(u64, usize, usize, usize, usize)>,
    /// A block of an A of bytes, converted to floats.
    converted: Buf,
    /// The steps that panels of bytes keep (`Selection`), and which rows of B are finite.
    steps: Vec<u32>,
    finite: FiniteRows,
    /// The call whose blocks this thread no longer selects from: one of them had no all-zero step.
    unselected: u64,
}

thread_local! {
    /// This thread's packing buffers, reused by every call (taken out while a block runs).
    static PACK: Cell<Packs> = Cell::new(Packs::default());
    /// The calling thread's copy of a whole A of bytes as floats, for products of a few rows (`rows`).
    static WHOLE: Cell<Buf> = Cell::new(Buf::default());
}

/// Grows this thread's packing buffers to what every `block` asks of them, so that a thread's first block in a
/// later step allocates nothing.
pub(crate) fn reserve_thread() {
    let mut packs = PACK.take();
    packs.a.ptr(MC * KC_MAX);
    packs.b.ptr(B_BLOCK);
    packs.converted.ptr(MC * KC_MAX);
    packs.steps.reserve(PANELS * STEPS_STRIDE);
    packs.finite.reserve(RESERVED_STEPS);
    PACK.set(packs);
}

/// Products of at least this many multiply-adds (m·n·k) are shared among threads: below it a product takes less
/// than handing chunks to a rayon worker (20 µs and more to wake one on these virtual machines) saves.
const PARALLEL_MIN: usize = 1 << 20;

/// ... and so are products of a quarter as many with a C of at least this many elements. Such a product (a short
/// reduction into a wide C: the mlp's last input gradient, 128×256 by 10 steps, under the ReLU's mask) is bound by
/// C and the mask rather than by its multiply-adds, and in a step on two threads the products before it left half
/// of those in the other core's cache: one thread pulling them across took 41–44 µs (22 in a one-thread step),
/// two threads sharing it by columns 23, by rows 14.8 on a later day (`SHORT_REDUCTION`, as it is shared now).
const WIDE_C_MIN: usize = 1 << 14;

/// ... and so, while the pool's workers spin (a program's step), is a product that `cost` puts at this many vector
/// operations or more (about 3 µs on one core), as the AVX-512 kernels' `SPUN_MIN`: a chunk then reaches a worker
/// within a poll, not a wake-up. In a step on two threads its operands were written by both (a layer's activations,
/// split among them), and one thread would read half of them from the other core's cache. The mlp's last weight
/// update (w3 += α·h2ᵀ·dlogits, 256×128·128×10, below `PARALLEL_MIN`) took 12.3 µs on one thread in a two-thread
/// step (an Intel Xeon, `DFC_GEMM=avx2`), 7.0–7.1 shared.
const SPUN_MIN: f64 = 24_000.0;

/// Computes the product, on rayon's pool when `parallel` and the product is large enough to pay for it.
///
/// # Safety
/// The CPU supports AVX2 and FMA, and every element of A, B and C the product addresses is in bounds, and of
/// `b_panels` where not null (`Product::b_panels`).
pub(crate) unsafe fn sgemm(p: Product, parallel: bool) {
    let threads = if parallel { rayon::current_num_threads() } else { 1 };
    // One to three rows of C (a batch of one), or of Cᵀ: B read in place, once, in order.
    if let Some(few) = rows::oriented(&p) {
        // SAFETY: the caller's contract; the column sums (if any) are of C as given.
        return unsafe {
            rows::sgemm(&few, threads);
            sums::all(&p)
        };
    }
    // A product of bytes or with an epilogue keeps its orientation and its tiles (`Product::fixed`).
    let mut p = if !p.fixed() && cost(&p.transposed()) < 0.9 * cost(&p) { p.transposed() } else { p };
    // A thin product (C or Cᵀ of at most 16 columns) as dot products, where that costs less than tiles.
    let as_dots = [p, p.transposed()]
        .into_iter()
        .filter(|p| !p.fixed() && dot::applies(p))
        .min_by(|x, y| dot_cost(x).total_cmp(&dot_cost(y)))
        .filter(|thin| dot_cost(thin) < 0.95 * cost(&p));
    if let Some(thin) = as_dots {
        // SAFETY: the caller's contract.
        return unsafe { dot::sgemm_avx2(&thin, threads) };
    }
    p.id = CALLS.fetch_add(1, Ordering::Relaxed);
    if !shared(&p, threads, pool::workers_spinning()) {
        // SAFETY: the caller's contract.
        unsafe {
            block(&p, 0, p.m, 0, p.n, 0, p.k);
            sums::all(&p)
        };
        return;
    }
    if splits_reduction(&p, threads) {
        // SAFETY: the caller's contract.
        return unsafe { by_reduction(&p, threads) };
    }
    let by_columns = by_columns(&p, threads);
    let Some(split) = Split::of(&p, by_columns, threads, pool::workers_spinning()) else {
        // SAFETY: the caller's contract.
        unsafe {
            block(&p, 0, p.m, 0, p.n, 0, p.k);
            sums::all(&p)
        };
        return;
    };
    let chunks = split.chunks;
    let range = |c: usize| (split.bound(c), split.bound(c + 1));
    // Chunks of rows each sum their rows' columns apart; chunks of columns write their columns' sums.
    let row_sums = if by_columns { None } else { RowSums::new(&p, chunks) };
    let work = |c: usize| {
        let (lo, hi) = range(c);
        // SAFETY: chunks write disjoint row or column ranges of C, and sum them (`sums`) into disjoint columns of
        // the sums or rows of the partials; the caller's contract covers A and B.
        unsafe {
            if by_columns {
                block(&p, 0, p.m, lo, hi, 0, p.k);
                if !p.sums.is_null() {
                    sums::column_sums(p.c, p.ldc, (0, p.m), (lo, hi), p.sums);
                }
            } else {
                block(&p, lo, hi, 0, p.n, 0, p.k);
                if let Some(sums) = &row_sums {
                    sums.chunk(&p, c, lo, hi);
                }
            }
        }
    };
    pool::run_chunks(chunks, threads - 1, &work);
    if let Some(sums) = row_sums {
        // SAFETY: every chunk is done; `sums` holds n floats (the caller's contract).
        unsafe { sums.finish(&p) };
    }
}

/// Whether `threads` threads share `p` (as oriented): a product of `PARALLEL_MIN` multiply-adds or more (a quarter as
/// many with a wide C), or of `SPUN_MIN` by `cost` while the workers are `spinning`.
fn shared(p: &Product, threads: usize, spinning: bool) -> bool {
    let parallel_min = if p.m * p.n >= WIDE_C_MIN { PARALLEL_MIN / 4 } else { PARALLEL_MIN };
    threads > 1 && (p.m * p.n * p.k >= parallel_min || (spinning && cost(p) >= SPUN_MIN))
}

/// Whether the threads share `p` (as oriented) by columns of C rather than by rows. Column chunks each pack their own
/// share of B and read all of A again (in place, packing it again when stored transposed or converting it again from
/// bytes); row chunks each pack all of B again, but for B read from kept panels, which nothing packs. Whichever
/// repeats less, given enough columns; rows for a short reduction, which C and the mask bound (`SHORT_REDUCTION`).
/// (Rows for kept panels, in the mlp's inference under `benches/avx2_only.c`, an Intel Xeon: its second layer
/// 83.8–84.4 → 79.7–81.9 µs, and the logits after it 11.2–11.3 → 8.6–8.7, whose rows of A each thread then wrote.)
fn by_columns(p: &Product, threads: usize) -> bool {
    let again_a = p.m * p.k * if p.ta && p.bytes.is_none() { 2 } else { 1 };
    let again_b = if p.b_panels.is_null() { p.k * p.n * if p.tb { 4 } else { 1 } } else { 0 };
    p.n >= NR * threads && again_a < again_b && p.k > SHORT_REDUCTION
}

/// The chunks that `threads` threads share `p` (as oriented) in, by columns or by rows of C (`Split::of`: `None` where
/// that would be one chunk). Chunks are 16-column panels or 6-row panels, twice as many as the threads (a late worker
/// finds fewer left), but for rows of an A read in rows (not packed) while the workers spin: one chunk a thread, an
/// even number of rows each, which `row_panels` cuts into panels of 4 to 6 (the mlp's 128 rows in two of 64, ten
/// panels of 6 and one of 4 each, where twice as many chunks gave one thread 66 rows and the other four panels of 4:
/// the mlp's inference under `benches/avx2_only.c`, an Intel Xeon, its second layer 72.2–72.4 → 70.8–71.3 µs).
#[derive(Clone, Copy, Debug)]
struct Split {
    chunks: usize,
    /// Panels (of `unit` columns or rows) in the `len` columns or rows.
    units: usize,
    unit: usize,
    len: usize,
    /// One chunk a thread, an even number of rows each.
    even_rows: bool,
}

impl Split {
    fn of(p: &Product, by_columns: bool, threads: usize, spinning: bool) -> Option<Split> {
        let (units, unit, len) = if by_columns { (p.n.div_ceil(NR), NR, p.n) } else { (p.m.div_ceil(MR), MR, p.m) };
        let even_rows = !by_columns && !p.ta && spinning && len >= 2 * threads;
        let chunks = if even_rows { threads } else { units.min(2 * threads) };
        (chunks >= 2).then_some(Split { chunks, units, unit, len, even_rows })
    }

    /// Where chunk `c` starts (`c` ≤ `chunks`; the last ends at `len`).
    fn bound(&self, c: usize) -> usize {
        match self.even_rows {
            _ if c >= self.chunks => self.len,
            true => (self.len * c / self.chunks) & !1,
            false => (self.units * c / self.chunks * self.unit).min(self.len),
        }
    }
}

/// Whether the threads share `p` along its reduction (`by_reduction`): an A of bytes stored row-major (the first
/// layer's images), at least 64 steps a thread. Each thread then converts only its own steps of A, block by block in
/// its own buffer, and reads only those rows of B. Split by columns, the threads converted A once between them and
/// each read all its floats, half of them from the other core's cache. In a training step B is the first layer's
/// weights, which the update splits by rows (its product, `xᵀ·dy`, by rows of C), the caller's chunks first and the
/// worker's last, as the reduction's chunks are claimed: each thread reads the rows of B that it wrote, where split by
/// columns each read half of B from the other core's cache, and the update took those lines back.
///
/// Not where B is read from kept panels (an inference's first layer): nothing writes them, so each thread reads all of
/// them from its own cache, and split by rows no partial sums cross between the cores. (The mlp's inference under
/// `benches/avx2_only.c`, an Intel Xeon, with the rows in halves, `Split`: 306.9–310.5 → 297.5–298.7 µs.)
fn splits_reduction(p: &Product, threads: usize) -> bool {
    p.bytes.is_some() && !p.ta && !p.tc && p.k >= 64 * threads && p.b_panels.is_null()
}

/// The most threads that share a product by its reduction (each past the first sums into a partial of its own).
const MAX_PARTS: usize = 64;

/// `p` in one chunk of the reduction per thread: the caller's into C, each worker's into a partial sum of its own
/// (every chunk's into its own where the rows are grouped by their black, `grouped`), then each thread adds the
/// partials into its share of C's rows and finishes them (the epilogue).
///
/// # Safety
/// As `sgemm`; C is not stored transposed.
unsafe fn by_reduction(p: &Product, threads: usize) {
    let threads = threads.min(MAX_PARTS);
    // The rows grouped by their black (`grouped`): then every chunk sums into a partial of its own.
    // SAFETY: A's bytes are readable (the caller's contract).
    let mut grouping = unsafe { Grouping::of(p, MR) };
    let partial_count = if grouping.is_some() { threads } else { threads - 1 };
    let mut partials = std::mem::take(&mut *PARTIALS.lock().unwrap_or_else(|e| e.into_inner()));
    if partials.len() < partial_count {
        partials.resize_with(partial_count, Buf::default);
    }
    // Addresses, not pointers: the closures are shared with the workers.
    let mut addresses = [0usize; MAX_PARTS];
    for (address, buf) in addresses.iter_mut().zip(&mut partials).take(partial_count) {
        *address = buf.ptr(p.m * p.n) as usize;
    }
    let parts = &addresses[..partial_count];
    let mut gathered = [0usize; MAX_PARTS];
    if let Some(g) = &mut grouping {
        g.buffers(p, threads, &mut gathered);
    }
    let sums =
        Product { bias: std::ptr::null(), relu: false, mask: std::ptr::null(), sums: std::ptr::null_mut(), ..*p };
    // Equal chunks of steps, cut at multiples of 8 (784 steps: 392 and 392).
    let steps =
        |c: usize| ((p.k * c / threads) & !7, if c + 1 == threads { p.k } else { (p.k * (c + 1) / threads) & !7 });
    let work = |c: usize| {
        let (k0, k1) = steps(c);
        if let Some(g) = &grouping {
            // SAFETY: chunk c gathers into its own buffer of m·k bytes and writes its own partial of m·n floats; the
            // caller's contract covers A and B.
            return unsafe {
                let chunk = grouped::chunk(p, &g.order, (k0, k1), gathered[c] as *mut u8, parts[c] as *mut f32);
                block(&chunk, 0, p.m, 0, p.n, 0, k1 - k0)
            };
        }
        let into = match c {
            0 => sums,
            _ => Product { c: parts[c - 1] as *mut f32, ldc: p.n, accumulate: false, ..sums },
        };
        // SAFETY: chunk 0 writes C, chunk c its own partial of m·n floats; the caller's contract covers A and B.
        unsafe { block(&into, 0, p.m, 0, p.n, k0, k1) };
    };
    pool::run_chunks(threads, threads - 1, &work);
    let rows = threads.min(p.m);
    let row_sums = RowSums::new(p, rows);
    let sorted = grouping.as_ref().map(|g| g.inverse.as_slice());
    let finish = |c: usize| {
        let (lo, hi) = (p.m * c / rows, p.m * (c + 1) / rows);
        // SAFETY: AVX2 (the caller's contract); the partials hold C's m×n, n apart; the chunks write disjoint rows of
        // C (row-major), and the bias holds n floats, the mask C's rows; each sums its rows into its own partials.
        unsafe {
            add_and_finish(p, parts, sorted, lo, hi);
            if let Some(sums) = &row_sums {
                sums.chunk(p, c, lo, hi);
            }
        }
    };
    pool::run_chunks(rows, threads - 1, &finish);
    if let Some(sums) = row_sums {
        // SAFETY: every chunk is done; `sums` holds n floats (the caller's contract).
        unsafe { sums.finish(p) };
    }
    let mut pool = PARTIALS.lock().unwrap_or_else(|e| e.into_inner());
    if pool.len() < partials.len() {
        *pool = partials;
    }
    Grouping::keep(grouping);
}

/// Rows `lo..hi` of C (row-major) += those of each partial (m×n, n apart, at the addresses `parts`), then the
/// epilogue of `p` over them: in one pass over each row's whole vectors, the rest of the row after. Where the rows
/// were `sorted` (row r of C is row `sorted[r]` of every partial), C's rows are the partials' sums instead.
///
/// # Safety
/// As `finish_tile`, for those rows of `p`'s C; each partial holds m·n floats; `sorted` (if given) holds m rows.
#[target_feature(enable = "avx2,fma")]
unsafe fn add_and_finish(p: &Product, parts: &[usize], sorted: Option<&[u32]>, lo: usize, hi: usize) {
    let whole = p.n / 8 * 8;
    for r in lo..hi {
        // The row of the partials, and the partials added to the first term: C's row, or the first partial's.
        let (from, first, rest) = match sorted {
            Some(sorted) => (sorted[r] as usize, Some(parts[0]), &parts[1..]),
            None => (r, None, parts),
        };
        // SAFETY: row r of C holds n floats at c + r·ldc, each partial's row `from` at part + from·n; the bias holds n
        // floats and the mask's row r (laid out as C) n at mask + r·ldc.
        unsafe {
            let c = p.c.add(r * p.ldc);
            let row = |part: usize| (part as *const f32).add(from * p.n);
            let mask = if p.mask.is_null() { p.mask } else { p.mask.add(r * p.ldc) };
            for j in (0..whole).step_by(8) {
                let mut v = _mm256_loadu_ps(first.map_or(c.cast_const(), row).add(j));
                for &part in rest {
                    v = _mm256_add_ps(v, _mm256_loadu_ps(row(part).add(j)));
                }
                let at = |x: *const f32| if x.is_null() { x } else { x.add(j) };
                _mm256_storeu_ps(c.add(j), finish8(v, at(p.bias), p.relu, at(mask)));
            }
            for j in whole..p.n {
                if let Some(first) = first {
                    *c.add(j) = *row(first).add(j);
                }
                for &part in rest {
                    *c.add(j) += *row(part).add(j);
                }
            }
            if p.epilogue() && whole < p.n {
                let at = |x: *const f32| if x.is_null() { x } else { x.add(whole) };
                finish_tile(c.add(whole), p.ldc, 1, p.n - whole, (at(p.bias), p.relu, at(mask)));
            }
        }
    }
}

/// The epilogue of 8 elements of C: `v` plus the bias's 8 floats at `bias` (unless null), then `max(0, ·)` where
/// `relu`, then 0 where the mask's 8 floats at `mask` (unless null) are not above 0; as `finish_tile` computes it.
///
/// # Safety
/// `bias` and `mask` (unless null) each hold 8 floats.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn finish8(mut v: __m256, bias: *const f32, relu: bool, mask: *const f32) -> __m256 {
    let zero = _mm256_setzero_ps();
    // SAFETY: the caller's contract.
    unsafe {
        if !bias.is_null() {
            v = _mm256_add_ps(v, _mm256_loadu_ps(bias));
        }
        if relu {
            v = _mm256_max_ps(zero, v);
        }
        if !mask.is_null() {
            v = _mm256_and_ps(v, _mm256_cmp_ps::<_CMP_GT_OQ>(_mm256_loadu_ps(mask), zero));
        }
    }
    v
}

/// The floats `pack_whole_b` needs for a `k×n` B: ⌈n/16⌉ panels of k·16, and room to align them.
pub(crate) fn packed_len(k: usize, n: usize) -> usize {
    n.div_ceil(NR) * NR * k + 8
}

/// Packs all of `b` (`k×n`, row-major) into 16-column panels of all k steps (`pack_b`'s layout for one block of
/// every step), in `buf` from its first 32-byte boundary; the panels.
///
/// # Safety
/// The CPU has AVX2 and FMA; `b` holds k·n floats and `buf` at least `packed_len(k, n)`.
pub(crate) unsafe fn pack_whole_b<'a>(k: usize, n: usize, b: &[f32], buf: &'a mut [f32]) -> &'a [f32] {
    let range = panels_in(k, n, buf.as_ptr());
    let panels = &mut buf[range];
    if k > 0 && n > 0 {
        let p = Product {
            m: 0,
            n,
            k,
            a: std::ptr::null(),
            lda: 0,
            ta: false,
            b: b.as_ptr(),
            ldb: n,
            tb: false,
            c: std::ptr::null_mut(),
            ldc: 0,
            tc: false,
            accumulate: false,
            alpha: 1.0,
            bytes: None,
            bias: std::ptr::null(),
            relu: false,
            mask: std::ptr::null(),
            sums: std::ptr::null_mut(),
            b_rewritten: false,
            b_panels: std::ptr::null(),
            id: 0,
        };
        // SAFETY: B's k steps and n columns are in `b`; `panels` holds ⌈n/16⌉ panels of k·16 floats from a 32-byte
        // boundary.
        unsafe { pack_b(&p, 0, k, 0, n, panels.as_mut_ptr()) };
    }
    panels
}

/// Where in a buffer at `start` (of at least `packed_len(k, n)` floats) `pack_whole_b` puts the panels of a `k×n`
/// B: from its first 32-byte boundary.
pub(crate) fn panels_in(k: usize, n: usize, start: *const f32) -> std::ops::Range<usize> {
    let skip = start.align_offset(32).min(8);
    skip..skip + n.div_ceil(NR) * NR * k
}

/// `c = a·B` for B packed by `pack_whole_b` (`panels`), A m×k and C m×n row-major, on this thread: the sums of
/// `block`'s tiles (the reduction in the same equal blocks), without packing B again.
///
/// # Safety
/// The CPU has AVX2 and FMA; `a` holds m·k floats, `c` m·n, and `panels` ⌈n/16⌉ panels of k·16 from a 32-byte
/// boundary.
pub(crate) unsafe fn sgemm_packed(m: usize, n: usize, k: usize, a: &[f32], panels: &[f32], c: &mut [f32]) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        c[..m * n].fill(0.0);
        return;
    }
    let depth = depth(k, wide_l1());
    for pc in (0..k).step_by(depth) {
        let kc = depth.min(k - pc);
        for jr in (0..n).step_by(NR) {
            let nr = NR.min(n - jr);
            for (ir, mr) in row_panels(m, true) {
                // SAFETY: the kernel reads mr rows of A from row ir, steps pc..pc+kc (in `a`), the panel's steps
                // pc..pc+kc (aligned: a panel is 64·k bytes, a step 64), and writes rows ir.., columns jr.. of C
                // (mr × nr of them, in `c`).
                unsafe {
                    let panel = panels.as_ptr().add(jr * k + pc * NR);
                    let tile = c.as_mut_ptr().add(ir * n + jr);
                    KERNELS[0][1][mr - 1](
                        kc,
                        a.as_ptr().add(ir * k + pc),
                        k,
                        panel,
                        NR,
                        std::ptr::null(),
                        tile,
                        n,
                        nr,
                        false,
                        pc == 0,
                        1.0,
                        None,
                    );
                }
            }
        }
    }
}

/// Rough cost of `p` as oriented, in vector operations: the FMAs over whole tiles (a thin C wastes most lanes of
/// its 16-column tiles, where `Cᵀ = Bᵀ·Aᵀ` fills 6-row ones), packing B (a transposed-stored B at a higher
/// price, set when it was packed element by element; now 8×8 at a time through registers) and packing a
/// transposed-stored A.
fn cost(p: &Product) -> f64 {
    let tiles = (p.m.div_ceil(MR) * MR * p.n.div_ceil(NR) * NR * p.k) as f64 / 8.0;
    let pack_b = (p.k * p.n) as f64 / 8.0 * if p.tb { 8.0 } else { 1.0 };
    let pack_a = if p.ta { (p.m * p.k) as f64 / 2.0 } else { 0.0 };
    tiles + pack_b + pack_a
}

/// `cost`'s estimate for `p` computed as dot products (`dot`): FMAs of 8 full lanes, about four operations to add
/// up each result's lanes, and packing a row-major B into Bᵀ element by element.
fn dot_cost(p: &Product) -> f64 {
    let computed = p.n.div_ceil(5).min(p.n.div_ceil(4)) as f64 * 5.0;
    let fmas = p.m as f64 * computed * p.k as f64 / 8.0;
    let sums = p.m as f64 * computed * 4.0;
    let pack = if p.tb { 0.0 } else { (p.k * p.n) as f64 };
    fmas + sums + pack
}

/// Rows `i0..i1` and columns `j0..j1` of the product over the steps `k0..k1`, written to C: overwriting it unless
/// `accumulate`, and finished by the epilogue when the steps end at k.
///
/// # Safety
/// As `sgemm`.
#[target_feature(enable = "avx2,fma")]
unsafe fn block(p: &Product, i0: usize, i1: usize, j0: usize, j1: usize, k0: usize, k1: usize) {
    if i0 >= i1 || j0 >= j1 {
        return;
    }
    let mut packs = PACK.take();
    if packs.b.floats() < B_BLOCK {
        packs.b_holds = None;
    }
    let b_pack = packs.b.ptr(B_BLOCK);
    let a_pack = packs.a.ptr(if p.ta { MC * KC_MAX } else { 0 });
    let converted = packs.converted.ptr(if p.bytes.is_some() && !p.ta { MC * KC_MAX } else { 0 });
    let scale = p.bytes.map(Scale::new);
    // Panels of bytes leave out their all-zero steps (pixels black in every image of a panel, or a panel's pixels
    // black in an image) where B is stored row-major and packed (the kernels read its kept steps at offsets into a
    // panel); a product is known by its call's id (`FiniteRows`). Not in a chunk of the reduction over rows in their
    // order (`by_reduction`, the first layer of a training step on two threads): the halves of an image differ in
    // black (Fashion-MNIST's top half 16–23 % of the steps, its bottom half 9–13 %), and the caller waited for the
    // slower; its step took 4 µs longer so (`DFC_GEMM=avx2`, an Intel Xeon). Rows grouped by their black
    // (`grouped`) share far more, and each of their chunks is a product of its own, which selects. A block of bytes
    // without an all-zero step in any panel (random bytes, as benchmarks feed) ends the selection for the rest of the
    // call on this thread: finding none cost the mlp's weight gradient 6–7 µs a step on the two threads.
    // B's whole panels where it is stored, unless kept panels hold it.
    let b_stored = b_in_place(p) && p.b_panels.is_null();
    let mut select = !p.tb
        && !b_stored
        && p.id != 0
        && packs.unselected != p.id
        && (k0, k1) == (0, p.k)
        && scale.is_some_and(|scale| scale.zero_is_zero());
    if select {
        packs.finite.start(p);
        packs.steps.resize(PANELS * STEPS_STRIDE, 0);
    }
    let mut kept = [0usize; PANELS];
    // Equal blocks of the reduction: a last block of a few steps would load and store C for little work
    // (784 steps: 4 blocks of 196, not 256, 256, 256 and 16).
    let depth = depth(k1 - k0, wide_l1());
    let most_columns = columns(depth);
    for jc in (j0..j1).step_by(most_columns) {
        let nc = most_columns.min(j1 - jc);
        // Columns jc..jc+in_place are read from B as stored, the rest from packed panels (kept ones where given).
        let in_place = if b_stored { nc - nc % NR } else { 0 };
        for pc in (k0..k1).step_by(depth) {
            let kc = depth.min(k1 - pc);
            let overwrite = pc == k0 && !p.accumulate;
            let finish = pc + kc == p.k && p.epilogue();
            // The thread's earlier row chunk of this product packed the same block (a product built elsewhere, with
            // no call's id, packs it every time).
            let block_of_b = (p.id, pc, kc, jc, nc);
            if p.b_panels.is_null() && in_place < nc && (p.id == 0 || packs.b_holds != Some(block_of_b)) {
                // SAFETY: the block's steps and columns are in B; the packed block holds ⌈nc/16⌉ panels of kc·16.
                unsafe { pack_b(p, pc, kc, jc + in_place, nc - in_place, b_pack) };
                packs.b_holds = Some(block_of_b);
            }
            for ic in (i0..i1).step_by(MC) {
                let mc = MC.min(i1 - ic);
                // Where the kernels read A's block of floats: A itself, or the block converted from bytes (mc rows
                // of kc); a transposed-stored A is packed into panels, bytes converted on the way.
                let mut selection = select.then_some(Selection {
                    steps: packs.steps.as_mut_ptr(),
                    stride: STEPS_STRIDE,
                    kept: &mut kept,
                    finite: &mut packs.finite,
                });
                let (a, lda, (a_pc, a_ic)) = match scale {
                    Some(scale) if !p.ta => {
                        let bytes = (p.a.cast::<u8>().add(ic * p.lda + pc), p.lda);
                        // SAFETY: the block's rows and steps of A's bytes are in A, and `converted` holds MC·KC_MAX
                        // floats; the selection holds a block's panels of STEPS_STRIDE steps.
                        unsafe {
                            match selection.as_mut() {
                                Some(s) => convert_selecting(p, pc, bytes, mc, kc, converted, &scale, s),
                                None => convert(bytes.0, bytes.1, mc, kc, converted, &scale),
                            }
                        };
                        (converted.cast_const(), kc, (0, 0))
                    }
                    _ => (p.a, p.lda, (pc, ic)),
                };
                match scale {
                    // SAFETY: the block's rows and steps are in A; ⌈mc/6⌉ panels of kc·6 fit MC·KC_MAX; the selection
                    // as above.
                    Some(scale) if p.ta => unsafe {
                        pack_a_bytes(p, (pc, kc), (ic, mc), a_pack, &scale, selection.as_mut())
                    },
                    // SAFETY: as above.
                    None if p.ta => unsafe { pack_a(a, lda, a_pc, kc, a_ic, mc, a_pack) },
                    _ => {}
                }
                if select && kept[..mc.div_ceil(MR)].iter().all(|&kept| kept == kc) {
                    (select, packs.unselected) = (false, p.id);
                }
                // Panels of A read as stored (in place or converted) may split their last rows evenly.
                let even = !p.ta && !select;
                for jr in (0..nc).step_by(NR) {
                    let nr = NR.min(nc - jr);
                    for (ir, mr) in row_panels(mc, even) {
                        // A panel that leaves out steps reads B's through its selection.
                        let (steps, kc_a) = match select && kept[ir / MR] < kc {
                            // SAFETY: panel ir/6's steps, within the selection's.
                            true => (unsafe { packs.steps.as_ptr().add(ir / MR * STEPS_STRIDE) }, kept[ir / MR]),
                            false => (std::ptr::null(), kc),
                        };
                        // SAFETY: the kernel reads mr rows × kc steps of A (packed panel ir/6, or in place from
                        // row a_ic + ir, step a_pc), kc steps of B's 16 columns from jc+jr (where B is stored, all
                        // 16 columns in B, or packed panel (jr - in_place)/16; a selection's kc_a steps of A, and
                        // B's steps at its offsets, each within the packed panel), and writes rows ic+ir.., columns
                        // jc+jr.. of C (mr × nr of them); the epilogue reads the bias's columns and the mask's
                        // elements of the same tile (laid out as C, which is not transposed when there is one).
                        unsafe {
                            let (a, lda) = if p.ta {
                                (a_pack.add(ir * kc).cast_const(), 0)
                            } else {
                                (a.add((a_ic + ir) * lda + a_pc), lda)
                            };
                            let (i, j) = (ic + ir, jc + jr);
                            let tile = if p.tc { p.c.add(j * p.ldc + i) } else { p.c.add(i * p.ldc + j) };
                            let (b, ldb) = if jr < in_place {
                                (p.b.add(pc * p.ldb + j), p.ldb)
                            } else if !p.b_panels.is_null() {
                                (p.b_panels.add(j / NR * p.k * NR + pc * NR), NR)
                            } else {
                                (b_pack.add((jr - in_place) * kc).cast_const(), NR)
                            };
                            let kernel = KERNELS[usize::from(!steps.is_null())][usize::from(!p.ta)][mr - 1];
                            let epilogue = finish.then(|| {
                                let bias = if p.bias.is_null() { p.bias } else { p.bias.add(j) };
                                let mask = if p.mask.is_null() { p.mask } else { p.mask.add(i * p.ldc + j) };
                                (bias, p.relu, mask)
                            });
                            // Whole tiles of a C stored as laid out are finished in the kernel, in registers.
                            let in_kernel = !p.tc && nr == NR;
                            let (with, after) = if in_kernel { (epilogue, None) } else { (None, epilogue) };
                            kernel(kc_a, a, lda, b, ldb, steps, tile, p.ldc, nr, p.tc, overwrite, p.alpha, with);
                            if let Some(epilogue) = after {
                                finish_tile(tile, p.ldc, mr, nr, epilogue);
                            }
                        }
                    }
                }
            }
        }
    }
    PACK.set(packs);
}

/// The row panels of a block of `mc` rows, as (first row, rows): 6 rows each and the rest after, or, where `even`,
/// the last 7 to 9 rows in two panels of 3 to 5 rather than 6 and 1 to 3. A kernel of fewer than 4 rows holds fewer
/// than 8 accumulators, too few to cover the FMA's latency (4 cycles) on two ports: it takes as long per step as one
/// of 4 rows. (The mlp's first layer, 128 rows: its block of 32 rows in 6, 6, 6, 6, 4, 4.)
fn row_panels(mc: usize, even: bool) -> impl Iterator<Item = (usize, usize)> {
    let rest = mc % MR;
    let split = even && mc > MR && (1..=3).contains(&rest);
    let panels = if split { mc / MR + 1 } else { mc.div_ceil(MR) };
    // Where split: the second-to-last panel's rows, from 6·(panels - 2).
    let before_last = (MR + rest) / 2;
    (0..panels).map(move |g| match split && g + 2 >= panels {
        false => (g * MR, MR.min(mc - g * MR)),
        true if g + 2 == panels => (g * MR, before_last),
        true => ((g - 1) * MR + before_last, MR + rest - before_last),
    })
}

/// Whether `block` reads B's whole 16-column panels where B is stored (row-major), `ldb` apart, rather than packing
/// them: where at most 4 row panels of A reuse each (the mlp's last weight gradient, computed as `Cᵀ`, 10 rows:
/// 13.4–13.7 against 15.4–16.3 µs in a step; a logistic regression's, 784×10×100: 28–29 against 32–33). With more
/// it measured no faster (the mlp's 128-row products, 64-byte-aligned operands) or slower (its weight gradients
/// of 256 and 784 rows, 3–5 %; 15–20 % where B's rows were not aligned to cache lines).
fn b_in_place(p: &Product) -> bool {
    !p.tb && p.m <= 4 * MR
}

/// Packs rows `i..i+mc` of an A stored transposed (at `a`, its stored rows `lda` apart) over the steps `pc..pc+kc`
/// in panels of 6 rows: element (row r of panel g, step q) to `dst[g·6·kc + q·mr + r]`, where the panel has mr rows
/// (6 but for the last).
///
/// # Safety
/// The rows and steps are in A; `dst` holds ⌈mc/6⌉·6·kc floats.
#[target_feature(enable = "avx2,fma")]
unsafe fn pack_a(a: *const f32, lda: usize, pc: usize, kc: usize, i: usize, mc: usize, dst: *mut f32) {
    let full = mc / MR;
    for q in 0..kc {
        // SAFETY: row pc+q of the stored A holds the block's mc elements from column i; panel g's step q lies
        // at g·6·kc + q·mr in dst.
        unsafe {
            // Step q of every panel comes from the same stored row, so A is read in order.
            let src = a.add((pc + q) * lda + i);
            for g in 0..full {
                // The panel's 6 floats as 4 and 2: a load and a store of 8 could pass A's end and the panel's step.
                let (s, d) = (src.add(g * MR), dst.add(g * MR * kc + q * MR));
                _mm_storeu_ps(d, _mm_loadu_ps(s));
                _mm_storel_epi64(d.add(4).cast(), _mm_loadl_epi64(s.add(4).cast()));
            }
            let mr = mc - full * MR;
            let (s, d) = (src.add(full * MR), dst.add(full * MR * kc + q * mr));
            for r in 0..mr {
                *d.add(r) = *s.add(r);
            }
        }
    }
}

/// The epilogue of a tile of `rows` × `cols` at `c` (`ldc` apart): adds the bias of each column (from `bias`
/// unless null), then `max(·, 0)` where `relu` (`vmaxps(0, x)`: 0 only where 0 > x, so NaN and -0 stay), then
/// zeroes the elements where the mask's (unless null; laid out as the tile) are not above 0.
///
/// # Safety
/// The tile is in C, `bias` (unless null) holds `cols` floats, and `mask` (unless null) a tile like C's.
#[target_feature(enable = "avx2,fma")]
unsafe fn finish_tile(
    c: *mut f32,
    ldc: usize,
    rows: usize,
    cols: usize,
    (bias, relu, mask): (*const f32, bool, *const f32),
) {
    let zero = _mm256_setzero_ps();
    let finish = |mut v: __m256, b: __m256, m: __m256| {
        if !bias.is_null() {
            v = _mm256_add_ps(v, b);
        }
        if relu {
            v = _mm256_max_ps(zero, v);
        }
        if !mask.is_null() {
            v = _mm256_and_ps(v, _mm256_cmp_ps::<_CMP_GT_OQ>(m, zero));
        }
        v
    };
    for r in 0..rows {
        let mut j = 0;
        // SAFETY: loads and stores of the tile's row r, columns j..j+8 (or its tail through copies), of the
        // bias's columns and of the mask's row r (none of an absent one's).
        unsafe {
            let row = c.add(r * ldc);
            // `len` floats from `at` (an absent operand's are not read: `finish` leaves them out).
            let load = |from: *const f32, at: usize, len: usize| {
                let mut part = [0f32; 8];
                if from.is_null() {
                    _mm256_setzero_ps()
                } else if len == 8 {
                    _mm256_loadu_ps(from.add(at))
                } else {
                    std::ptr::copy_nonoverlapping(from.add(at), part.as_mut_ptr(), len);
                    _mm256_loadu_ps(part.as_ptr())
                }
            };
            while j < cols {
                let len = (cols - j).min(8);
                let v = finish(load(row, j, len), load(bias, j, len), load(mask, r * ldc + j, len));
                if len == 8 {
                    _mm256_storeu_ps(row.add(j), v);
                } else {
                    let mut part = [0f32; 8];
                    _mm256_storeu_ps(part.as_mut_ptr(), v);
                    std::ptr::copy_nonoverlapping(part.as_ptr(), row.add(j), len);
                }
                j += 8;
            }
        }
    }
}

/// Packs columns `j..j+nc` of B over the steps `pc..pc+kc` in panels of 16 columns: element (step q, column
/// jr + c) to `dst[jr·kc + q·16 + c]`, zero past nc.
///
/// # Safety
/// The columns and steps are in B; `dst` holds ⌈nc/16⌉ panels of `kc·16` floats and is 32-byte aligned.
#[target_feature(enable = "avx2,fma")]
unsafe fn pack_b(p: &Product, pc: usize, kc: usize, j: usize, nc: usize, dst: *mut f32) {
    // SAFETY: (both arms) reads touch only columns j..j+nc, steps pc..pc+kc of B; writes stay in dst's panels.
    unsafe {
        for jr in (0..nc).step_by(NR) {
            let nr = NR.min(nc - jr);
            let panel = dst.add(jr * kc);
            if !p.tb {
                // Row-major B: a panel's step is up to 16 contiguous floats.
                for q in 0..kc {
                    let src = p.b.add((pc + q) * p.ldb + j + jr);
                    let d = panel.add(q * NR);
                    if nr == NR {
                        _mm256_store_ps(d, _mm256_loadu_ps(src));
                        _mm256_store_ps(d.add(8), _mm256_loadu_ps(src.add(8)));
                    } else {
                        std::ptr::write_bytes(d, 0, NR);
                        std::ptr::copy_nonoverlapping(src, d, nr);
                    }
                }
            } else {
                // Bᵀ stored: column j + jr + c is a stored row, read in order; 8 of them at a time, 8 steps of each
                // transposed in registers into the 8 steps' halves of the panel.
                if nr < NR {
                    std::ptr::write_bytes(panel, 0, kc * NR);
                }
                let whole = nr / 8 * 8;
                for c0 in (0..whole).step_by(8) {
                    let src = p.b.add((j + jr + c0) * p.ldb + pc);
                    let mut q = 0;
                    while q + 8 <= kc {
                        let rows: [__m256; 8] = std::array::from_fn(|r| _mm256_loadu_ps(src.add(r * p.ldb + q)));
                        for (t, v) in transpose8(rows).into_iter().enumerate() {
                            _mm256_store_ps(panel.add((q + t) * NR + c0), v);
                        }
                        q += 8;
                    }
                    for c in c0..c0 + 8 {
                        for q in q..kc {
                            *panel.add(q * NR + c) = *src.add((c - c0) * p.ldb + q);
                        }
                    }
                }
                for c in whole..nr {
                    let src = p.b.add((j + jr + c) * p.ldb + pc);
                    for q in 0..kc {
                        *panel.add(q * NR + c) = *src.add(q);
                    }
                }
            }
        }
    }
}

/// The 8×8 transpose of `r` (row i of the result holds element i of each of `r`'s rows).
#[target_feature(enable = "avx2,fma")]
pub(crate) fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
    // Pairs of rows interleaved, then pairs of pairs, then the 128-bit halves exchanged.
    let t: [__m256; 8] = std::array::from_fn(|i| {
        let (a, b) = (r[i / 2 * 2], r[i / 2 * 2 + 1]);
        if i % 2 == 0 {
            _mm256_unpacklo_ps(a, b)
        } else {
            _mm256_unpackhi_ps(a, b)
        }
    });
    let u: [__m256; 8] = std::array::from_fn(|i| {
        let (g, half) = (i / 4 * 4, i % 4 / 2);
        let (a, b) = (t[g + half], t[g + half + 2]);
        if i % 2 == 0 {
            _mm256_shuffle_ps::<0x44>(a, b)
        } else {
            _mm256_shuffle_ps::<0xEE>(a, b)
        }
    });
    std::array::from_fn(|i| {
        let (a, b) = (u[i % 4], u[i % 4 + 4]);
        if i < 4 {
            _mm256_permute2f128_ps::<0x20>(a, b)
        } else {
            _mm256_permute2f128_ps::<0x31>(a, b)
        }
    })
}

/// `kernel::<R, IN_PLACE, SKIP>(kc, a, lda, b, ldb, steps, c, ldc, nr, tc, overwrite, alpha, finish)`.
type Kernel = unsafe fn(
    usize,
    *const f32,
    usize,
    *const f32,
    usize,
    *const u32,
    *mut f32,
    usize,
    usize,
    bool,
    bool,
    f32,
    Option<(*const f32, bool, *const f32)>,
);

/// Instantiates `kernel::<R, IN_PLACE, SKIP>` for R = 1..=6.
macro_rules! heights {
    ($in_place:literal, $skip:literal) => {
        [
            kernel::<1, $in_place, $skip>,
            kernel::<2, $in_place, $skip>,
            kernel::<3, $in_place, $skip>,
            kernel::<4, $in_place, $skip>,
            kernel::<5, $in_place, $skip>,
            kernel::<6, $in_place, $skip>,
        ]
    };
}

/// The microkernels, `KERNELS[skip][in_place][R - 1]`.
static KERNELS: [[[Kernel; MR]; 2]; 2] =
    [[heights!(false, false), heights!(true, false)], [heights!(false, true), heights!(true, true)]];

/// `C[R×nr] (+)= α·A·B` for one tile: overwrites the tile when `overwrite`, else adds to it.
///
/// - A (R rows × kc steps): element (i, q) at `a[i·lda + q]` when `IN_PLACE` (A as stored, row-major), else at
///   `a[q·R + i]` (a packed panel).
/// - B: step q's 16 floats at `b[q·ldb..]`: a packed panel (ldb = 16) or B where it is stored; when `SKIP`, `steps[q]`
///   bytes past `b` in a packed panel instead: A's steps are a selection of B's (those where a panel of bytes is not
///   all zero, `bytes::convert_selecting`, `bytes::pack_a_bytes`), and `steps` holds kc offsets.
/// - C: element (i, j) of the tile at `c[i·ldc + j]`, or `c[j·ldc + i]` when `tc`; only columns `j < nr` are
///   written.
/// - `finish` (only for a whole tile, nr = 16, C not transposed): the epilogue applied before the store, as
///   `finish_tile` would after it: the bias of the tile's 16 columns (unless null), relu, and the mask (unless null)
///   laid out as the tile, `ldc` apart. (The mlp's masked input gradients 3–29 % faster than finishing in a second
///   pass over the stored tile, its second layer 3–7 %.)
///
/// Per step: two B loads, and per row a broadcast into two FMAs: 12 FMAs against 8 loads at R = 6, so the two
/// FMA ports bound it. As in the AVX-512 kernels, the k loop is unrolled by 4 and each row's step is one small
/// `asm!` block, a broadcast at a constant displacement: compiled from intrinsics, the loop computed three row
/// addresses and advanced its pointers every step, 27 instructions for 12 FMAs. (On Zen 4, the mlp's training
/// step's products on these kernels, whole steps alternated in one process: 5–7 % faster.)
///
/// # Safety
/// AVX2 and FMA; A's R rows, B's steps and the tile's elements addressed as above are in bounds.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
unsafe fn kernel<const R: usize, const IN_PLACE: bool, const SKIP: bool>(
    kc: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    ldb: usize,
    steps: *const u32,
    c: *mut f32,
    ldc: usize,
    nr: usize,
    tc: bool,
    overwrite: bool,
    alpha: f32,
    finish: Option<(*const f32, bool, *const f32)>,
) {
    let mut acc = [[_mm256_setzero_ps(); 2]; MR];
    // One row of one step: acc[i] += A(i, step) · (b0, b1), A's element at `[address]`.
    macro_rules! row {
        ($i:expr, $address:literal, $b0:ident, $b1:ident, $($operands:tt)*) => {
            if $i < R {
                asm!(
                    concat!("vbroadcastss {t}, dword ptr [", $address, "]"),
                    "vfmadd231ps {c0}, {b0}, {t}",
                    "vfmadd231ps {c1}, {b1}, {t}",
                    $($operands)*
                    b0 = in(ymm_reg) $b0,
                    b1 = in(ymm_reg) $b1,
                    c0 = inout(ymm_reg) acc[$i][0],
                    c1 = inout(ymm_reg) acc[$i][1],
                    t = out(ymm_reg) _,
                    options(pure, readonly, nostack, preserves_flags),
                );
            }
        };
    }
    // SAFETY: the caller's contract covers every address below.
    unsafe {
        if !tc {
            for i in 0..R {
                _mm_prefetch::<_MM_HINT_T0>(c.add(i * ldc).cast());
                _mm_prefetch::<_MM_HINT_T0>(c.add(i * ldc + nr - 1).cast());
            }
        }
        debug_assert!(!SKIP || ldb == NR, "a selection's steps are offsets into a packed panel");
        let (mut b, mut steps) = (b, steps);
        // Step u's two vectors of B, from the current step (the u-th next kept one when `SKIP`).
        macro_rules! load_b {
            ($u:literal) => {{
                let row = if SKIP { b.byte_add(*steps.add($u) as usize) } else { b.add($u * ldb) };
                (_mm256_loadu_ps(row), _mm256_loadu_ps(row.add(8)))
            }};
        }
        // Past `n` steps: B's pointer, or the selection's.
        macro_rules! advance {
            ($n:expr) => {
                if SKIP {
                    steps = steps.add($n);
                } else {
                    b = b.add($n * ldb);
                }
            };
        }
        if IN_PLACE {
            // Rows 3g, 3g + 1, 3g + 2 at base g + 0, lda, 2·lda (lda in bytes in `ld`); the base of a group past R
            // is never dereferenced.
            let ld = lda * 4;
            let (mut r0, mut r3) = (a, a.wrapping_add(3 * lda));
            macro_rules! group {
                ($u:literal, $g:literal, $base:ident, $b0:ident, $b1:ident) => {
                    row!(3 * $g, "{r} + {d}", $b0, $b1, r = in(reg) $base, d = const $u * 4,);
                    row!(3 * $g + 1, "{r} + {l} + {d}", $b0, $b1,
                        r = in(reg) $base, l = in(reg) ld, d = const $u * 4,);
                    row!(3 * $g + 2, "{r} + {l}*2 + {d}", $b0, $b1,
                        r = in(reg) $base, l = in(reg) ld, d = const $u * 4,);
                };
            }
            macro_rules! step {
                ($u:literal) => {
                    let (b0, b1) = load_b!($u);
                    group!($u, 0, r0, b0, b1);
                    group!($u, 1, r3, b0, b1);
                };
            }
            // Unrolled by 4: fewer pointer updates and branches per FMA.
            for _ in 0..kc / 4 {
                step!(0);
                step!(1);
                step!(2);
                step!(3);
                (r0, r3) = (r0.wrapping_add(4), r3.wrapping_add(4));
                advance!(4);
            }
            for _ in 0..kc % 4 {
                step!(0);
                (r0, r3) = (r0.wrapping_add(1), r3.wrapping_add(1));
                advance!(1);
            }
        } else {
            let mut a = a;
            macro_rules! step {
                ($u:literal) => {
                    let (b0, b1) = load_b!($u);
                    row!(0, "{a} + {d}", b0, b1, a = in(reg) a, d = const ($u * R) * 4,);
                    row!(1, "{a} + {d}", b0, b1, a = in(reg) a, d = const ($u * R + 1) * 4,);
                    row!(2, "{a} + {d}", b0, b1, a = in(reg) a, d = const ($u * R + 2) * 4,);
                    row!(3, "{a} + {d}", b0, b1, a = in(reg) a, d = const ($u * R + 3) * 4,);
                    row!(4, "{a} + {d}", b0, b1, a = in(reg) a, d = const ($u * R + 4) * 4,);
                    row!(5, "{a} + {d}", b0, b1, a = in(reg) a, d = const ($u * R + 5) * 4,);
                };
            }
            for _ in 0..kc / 4 {
                step!(0);
                step!(1);
                step!(2);
                step!(3);
                a = a.add(4 * R);
                advance!(4);
            }
            for _ in 0..kc % 4 {
                step!(0);
                a = a.add(R);
                advance!(1);
            }
        }
        if alpha != 1.0 {
            let alpha = _mm256_set1_ps(alpha);
            for row in acc.iter_mut().take(R) {
                *row = [_mm256_mul_ps(row[0], alpha), _mm256_mul_ps(row[1], alpha)];
            }
        }
        if !tc && nr == NR {
            for (i, &[mut v0, mut v1]) in acc.iter().enumerate().take(R) {
                let row = c.add(i * ldc);
                if !overwrite {
                    v0 = _mm256_add_ps(v0, _mm256_loadu_ps(row));
                    v1 = _mm256_add_ps(v1, _mm256_loadu_ps(row.add(8)));
                }
                if let Some((bias, relu, mask)) = finish {
                    let at = |x: *const f32, j: usize| if x.is_null() { x } else { x.add(j) };
                    let m = at(mask, i * ldc);
                    v0 = finish8(v0, bias, relu, m);
                    v1 = finish8(v1, at(bias, 8), relu, at(m, 8));
                }
                _mm256_storeu_ps(row, v0);
                _mm256_storeu_ps(row.add(8), v1);
            }
            return;
        }
        debug_assert!(finish.is_none(), "an edge tile is finished by `finish_tile`");
        let mut tile = [[0f32; NR]; R];
        for (row, [v0, v1]) in tile.iter_mut().zip(&acc) {
            _mm256_storeu_ps(row.as_mut_ptr(), *v0);
            _mm256_storeu_ps(row.as_mut_ptr().add(8), *v1);
        }
        for (i, row) in tile.iter().enumerate() {
            for (j, &v) in row.iter().enumerate().take(nr) {
                let dst = if tc { c.add(j * ldc + i) } else { c.add(i * ldc + j) };
                *dst = if overwrite { v } else { *dst + v };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! The AVX2 kernels called directly (tests/sgemm.rs reaches them only on CPUs without AVX-512, or with
    //! `DFC_GEMM=avx2`), against a naive product: every edge of the tiles and blocks, both layouts of each operand,
    //! C stored transposed, α, accumulation, the parallel splits, thin products as dot products, A of bytes and
    //! epilogues.

    use super::*;
    use crate::avx512::split_writes_the_same_bits;
    use crate::ByteScale;

    /// Whether the CPU runs the AVX2 kernels (a skip line if not).
    pub(super) fn have_avx2() -> bool {
        let have = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
        if !have {
            crate::skip::skip(crate::skip::Need::Avx2, "this CPU has no AVX2 and FMA");
        }
        have
    }

    /// Row panels cover a block's rows once, in order, 6 or fewer each; split evenly, no panel of fewer than 3
    /// rows follows a whole one, and the mlp's 32 rows end in two of 4.
    #[test]
    fn row_panels_cover_the_rows_and_split_short_last_ones() {
        for mc in 1..=MC {
            for even in [false, true] {
                let panels: Vec<_> = row_panels(mc, even).collect();
                let mut next = 0;
                for &(at, rows) in &panels {
                    assert_eq!(at, next, "{mc} rows, even {even}: {panels:?}");
                    assert!((1..=MR).contains(&rows), "{mc} rows, even {even}: {panels:?}");
                    next += rows;
                }
                assert_eq!(next, mc, "{mc} rows, even {even}: {panels:?}");
                if even && mc > MR {
                    assert!(panels.iter().all(|&(_, rows)| rows >= 3), "{mc} rows: {panels:?}");
                }
                if !even {
                    assert!(panels.iter().all(|&(at, _)| at % MR == 0), "{mc} rows: {panels:?}");
                }
            }
        }
        assert_eq!(row_panels(32, true).map(|(_, rows)| rows).collect::<Vec<_>>(), [6, 6, 6, 6, 4, 4]);
        assert_eq!(row_panels(32, false).map(|(_, rows)| rows).collect::<Vec<_>>(), [6, 6, 6, 6, 6, 2]);
    }

    /// Products are shared in twice as many chunks as threads, of whole panels, but for rows of A read in rows while
    /// the workers spin: one chunk a thread, of an even number of rows.
    #[test]
    fn products_are_split_in_panels_or_in_even_rows() {
        let bounds = |split: Split| (0..=split.chunks).map(|c| split.bound(c)).collect::<Vec<_>>();
        let rows = crate::avx512::tests::product(128, 256, 256, false, false);
        assert_eq!(bounds(Split::of(&rows, false, 2, true).unwrap()), [0, 64, 128]);
        assert_eq!(bounds(Split::of(&rows, false, 2, false).unwrap()), [0, 30, 66, 96, 128]);
        assert_eq!(bounds(Split::of(&rows, true, 2, true).unwrap()), [0, 64, 128, 192, 256]);
        let packed = crate::avx512::tests::product(256, 256, 128, true, false);
        assert_eq!(bounds(Split::of(&packed, false, 2, true).unwrap()), [0, 60, 126, 192, 256]);
        assert!(Split::of(&crate::avx512::tests::product(5, 16, 8, false, false), true, 2, true).is_none());
        for m in 1..=40 {
            for threads in 2..=5 {
                let p = crate::avx512::tests::product(m, 32, 8, false, false);
                let Some(split) = Split::of(&p, false, threads, true) else { continue };
                let b = bounds(split);
                assert!(b.windows(2).all(|w| w[0] < w[1]) && b[0] == 0 && b[split.chunks] == m, "{m} rows: {b:?}");
                if split.even_rows {
                    assert_eq!(split.chunks, threads);
                    assert!(b[..split.chunks].iter().all(|x| x % 2 == 0), "{m} rows: {b:?}");
                }
            }
        }
    }

    /// A reduction is cut in equal blocks of at most `KC` steps, but is one block of up to `ONE_BLOCK` where L1d is
    /// wide; a reduction of 0 steps has blocks of 1 (no step loop is empty-stepped). A packed block of B stays within
    /// `B_BLOCK`.
    #[test]
    fn reductions_are_cut_in_equal_blocks_or_one_where_l1_is_wide_and_columns_fit_l2() {
        assert_eq!(depth(256, false), 128);
        assert_eq!(depth(256, true), 256);
        assert_eq!(depth(200, false), 200);
        assert_eq!(depth(201, true), 201);
        assert_eq!(depth(784, false), 196);
        assert_eq!(depth(784, true), 392);
        assert_eq!(depth(800, true), 400);
        assert_eq!(depth(801, true), 161);
        assert_eq!(depth(1600, false), 200);
        assert_eq!(depth(392, true), 392);
        assert_eq!(depth(392, false), 196);
        assert_eq!(depth(401, true), 201);
        assert_eq!(depth(1600, true), 200);
        assert_eq!(depth(0, true), 1);
        assert_eq!(depth(0, false), 1);
        // A packed block of B stays within 512 KiB: all 512 columns up to 256 steps, fewer past them.
        for kc in 1..=KC_MAX {
            assert!(columns(kc).is_multiple_of(NR) && kc * columns(kc) <= B_BLOCK.max(kc * NR), "{kc} steps");
        }
        assert_eq!((columns(200), columns(256), columns(392), columns(400)), (512, 512, 320, 320));
    }

    /// `transpose8` puts element i of row r at element r of row i.
    #[test]
    fn transpose8_transposes() {
        if !have_avx2() {
            return;
        }
        let rows: [[f32; 8]; 8] = std::array::from_fn(|r| std::array::from_fn(|i| (10 * r + i) as f32));
        // SAFETY: AVX2 is available; loads and stores of 8 floats each from arrays of 8.
        let out: [[f32; 8]; 8] = unsafe {
            let t = transpose8(std::array::from_fn(|r| _mm256_loadu_ps(rows[r].as_ptr())));
            std::array::from_fn(|i| {
                let mut row = [0f32; 8];
                _mm256_storeu_ps(row.as_mut_ptr(), t[i]);
                row
            })
        };
        for (i, row) in out.iter().enumerate() {
            for (r, &x) in row.iter().enumerate() {
                assert_eq!(x, rows[r][i], "element {r} of row {i}");
            }
        }
    }

    /// Bytes convert to the floats `ByteScale::apply` gives, to the bit: every byte, at every position of a row
    /// (the vectors and the tail), for products, divisions by the corrected reciprocal, and the division itself.
    #[test]
    fn bytes_convert_as_the_interpreter_does() {
        if !have_avx2() {
            return;
        }
        let scales = [
            (ByteScale::Div(255.0), Scale::new(ByteScale::Div(255.0))),
            (ByteScale::Div(7.3), Scale::new(ByteScale::Div(7.3))),
            (ByteScale::Mul(0.1), Scale::new(ByteScale::Mul(0.1))),
            (ByteScale::Div(255.0), Scale::Div(255.0)),
        ];
        for (scale, converted) in scales {
            let bytes: Vec<u8> = (0..=255).chain(0..=12).collect();
            for cols in [256, 263, 5] {
                let mut out = vec![0f32; cols];
                // SAFETY: AVX2 and FMA are available; one row of `cols` bytes into `cols` floats.
                unsafe { convert(bytes.as_ptr(), cols, 1, cols, out.as_mut_ptr(), &converted) };
                for (e, x) in bytes.iter().zip(&out) {
                    assert_eq!(x.to_bits(), scale.apply(*e).to_bits(), "{scale:?} of {e}");
                }
            }
        }
    }

    /// Bytes over a short reduction (fewer than 64 steps a thread) are split by columns, each chunk converting A
    /// again: the same bits as one thread.
    #[test]
    fn bytes_split_by_columns_convert_to_the_same_bits() {
        if !have_avx2() {
            return;
        }
        let mut rng = fastrand::Rng::with_seed(5);
        for (m, n, k) in [(128, 256, 100), (37, 300, 120), (300, 512, 64)] {
            let raw: Vec<u8> = (0..m * k).map(|_| rng.u8(..)).collect();
            let b: Vec<f32> = (0..k * n).map(|_| rng.f32() - 0.5).collect();
            let bias: Vec<f32> = (0..n).map(|_| rng.f32() - 0.5).collect();
            let product = |c: *mut f32| Product {
                m,
                n,
                k,
                a: raw.as_ptr().cast(),
                lda: k,
                ta: false,
                b: b.as_ptr(),
                ldb: n,
                tb: false,
                c,
                ldc: n,
                tc: false,
                accumulate: false,
                alpha: 1.0,
                bytes: Some(ByteScale::Div(255.0)),
                bias: bias.as_ptr(),
                relu: true,
                mask: std::ptr::null(),
                sums: std::ptr::null_mut(),
                b_rewritten: false,
                b_panels: std::ptr::null(),
                id: 0,
            };
            assert!(!splits_reduction(&product(std::ptr::null_mut()), 2) && m * k < k * n && m * n * k >= PARALLEL_MIN);
            let one = split_writes_the_same_bits(sgemm, &format!("{m}×{n}×{k} of bytes"), m * n, product);
            // And both are the product (the bytes divided by 255): spot checks against a naive sum.
            for (i, j) in [(0, 0), (m - 1, n - 1), (m / 2, n / 3)] {
                let sum: f64 = (0..k).map(|q| f64::from(raw[i * k + q]) / 255.0 * f64::from(b[q * n + j])).sum();
                let want = (sum + f64::from(bias[j])).max(0.0);
                assert!(
                    (f64::from(one[i * n + j]) - want).abs() <= 1e-4 * (1.0 + want.abs()),
                    "{m}×{n}×{k} at {i}, {j}"
                );
            }
        }
    }

    /// While the workers spin, the mlp's last weight update (Cᵀ 10×256 from 128 steps, a few µs) is shared among
    /// the threads, below `PARALLEL_MIN`; a product of about 1 µs is not, nor any without spinning workers or on one
    /// thread.
    #[test]
    fn spinning_workers_share_products_of_a_few_microseconds() {
        let dims = |m, n, k, ta| Product {
            accumulate: true,
            alpha: -0.1,
            ..crate::avx512::tests::product(m, n, k, ta, false)
        };
        let oriented = |p: Product| if cost(&p.transposed()) < 0.9 * cost(&p) { p.transposed() } else { p };
        let update = oriented(dims(256, 10, 128, true));
        assert!(
            update.m * update.n * update.k < PARALLEL_MIN
                && update.m * update.n < WIDE_C_MIN
                && cost(&update) >= SPUN_MIN
        );
        assert!(shared(&update, 2, true));
        assert!(!shared(&update, 2, false) && !shared(&update, 1, true));
        let small = oriented(dims(24, 64, 64, false));
        assert!(!shared(&small, 2, true));
        // Large products are shared either way.
        let layer = dims(128, 256, 256, false);
        assert!(shared(&layer, 2, false) && shared(&layer, 2, true) && !shared(&layer, 1, false));
    }

    /// The mlp's products shared by columns where that repeats less packing, but for the short reduction of its last
    /// input gradient (10 steps into 128×256), which is shared by rows as the products around it, and for a B read
    /// from kept panels (an inference's second layer), which no row chunk packs again.
    #[test]
    fn short_reductions_and_kept_panels_are_shared_by_rows() {
        let dims = |m, n, k, ta, tb| crate::avx512::tests::product(m, n, k, ta, tb);
        assert!(by_columns(&dims(128, 256, 256, false, true), 2));
        assert!(by_columns(&dims(128, 256, 256, false, false), 2));
        assert!(!by_columns(&dims(128, 256, 10, false, true), 2));
        assert!(!by_columns(&dims(784, 256, 128, true, false), 2));
        assert!(!by_columns(&dims(128, 10, 256, false, false), 2));
        let panels = vec![0.0f32; 256 * 256];
        let kept = Product { b_panels: panels.as_ptr(), ..dims(128, 256, 256, false, false) };
        assert!(!by_columns(&kept, 2));
    }

    #[test]
    fn wide_short_products_split_to_the_same_bits() {
        if !have_avx2() {
            return;
        }
        let mut rng = fastrand::Rng::with_seed(6);
        // The mlp's last input gradient (Bᵀ stored, under the ReLU's mask), and an odd one.
        for (m, n, k) in [(128, 256, 10), (131, 200, 12)] {
            assert!(m * n >= WIDE_C_MIN && m * n * k >= PARALLEL_MIN / 4 && m * n * k < PARALLEL_MIN);
            let a: Vec<f32> = (0..m * k).map(|_| rng.f32() - 0.5).collect();
            let b: Vec<f32> = (0..k * n).map(|_| rng.f32() - 0.5).collect();
            let mask: Vec<f32> = (0..m * n).map(|_| rng.f32() - 0.3).collect();
            let product = |c: *mut f32| Product {
                m,
                n,
                k,
                a: a.as_ptr(),
                lda: k,
                ta: false,
                b: b.as_ptr(),
                ldb: k,
                tb: true,
                c,
                ldc: n,
                tc: false,
                accumulate: false,
                alpha: 1.0,
                bytes: None,
                bias: std::ptr::null(),
                relu: false,
                mask: mask.as_ptr(),
                sums: std::ptr::null_mut(),
                b_rewritten: false,
                b_panels: std::ptr::null(),
                id: 0,
            };
            let one = split_writes_the_same_bits(sgemm, &format!("{m}×{n}×{k}, a wide C"), m * n, product);
            let (i, j) = (m - 1, n - 1);
            let sum: f64 = (0..k).map(|q| f64::from(a[i * k + q]) * f64::from(b[j * k + q])).sum();
            let want = if mask[i * n + j] > 0.0 { sum } else { 0.0 };
            assert!((f64::from(one[i * n + j]) - want).abs() <= 1e-5, "{m}×{n}×{k} at {i}, {j}");
        }
    }

    /// Products of bytes and with an epilogue (bias, relu, mask) or column sums, called directly: against a naive
    /// product, the sums against C's columns summed in order.
    #[test]
    fn fused_products_match_a_naive_one() {
        if !have_avx2() {
            return;
        }
        let mut rng = fastrand::Rng::with_seed(11);
        let mut shapes: Vec<(usize, usize, usize)> =
            (0..80).map(|_| (rng.usize(1..=110), rng.usize(1..=60), rng.usize(1..=300))).collect();
        shapes.extend([(128, 256, 784), (784, 256, 128), (128, 256, 256), (97, 513, 257)]);
        for (m, n, k) in shapes {
            let (ta, bytes, parallel) = (rng.bool(), rng.bool(), rng.bool());
            let (bias_on, relu, mask_on) = (rng.bool(), rng.bool(), rng.bool());
            let scale = if rng.bool() { ByteScale::Div(255.0) } else { ByteScale::Mul(0.01) };
            let raw: Vec<u8> = (0..m * k).map(|_| if rng.u8(..4) == 0 { 0 } else { rng.u8(..) }).collect();
            let floats: Vec<f32> = (0..m * k).map(|_| rng.f32() - 0.5).collect();
            let b: Vec<f32> = (0..k * n).map(|_| rng.f32() - 0.5).collect();
            let bias: Vec<f32> = (0..n).map(|_| rng.f32() - 0.5).collect();
            let mask: Vec<f32> = (0..m * n).map(|_| rng.f32() - 0.3).collect();
            let mut c = vec![f32::NAN; m * n];
            let summed = rng.bool();
            let mut sums = vec![f32::NAN; n];
            let p = Product {
                m,
                n,
                k,
                a: if bytes { raw.as_ptr().cast() } else { floats.as_ptr() },
                lda: if ta { m } else { k },
                ta,
                b: b.as_ptr(),
                ldb: n,
                tb: false,
                c: c.as_mut_ptr(),
                ldc: n,
                tc: false,
                accumulate: false,
                alpha: 1.0,
                bytes: bytes.then_some(scale),
                bias: if bias_on { bias.as_ptr() } else { std::ptr::null() },
                relu,
                mask: if mask_on { mask.as_ptr() } else { std::ptr::null() },
                sums: if summed { sums.as_mut_ptr() } else { std::ptr::null_mut() },
                b_rewritten: false,
                b_panels: std::ptr::null(),
                id: 0,
            };
            // SAFETY: AVX2 and FMA are available; the operands hold every element the product addresses.
            unsafe { sgemm(p, parallel) };
            for j in (0..n).filter(|_| summed) {
                // C's column in order of rows: the same bits on one thread, within rounding in chunks of rows.
                let in_order = (0..m).fold(0f32, |s, i| s + c[i * n + j]);
                let size: f32 = (0..m).map(|i| c[i * n + j].abs()).sum();
                let what = format!("{m}×{n}×{k} ta {ta} bytes {bytes} parallel {parallel}: column {j}'s sum");
                match parallel {
                    false => assert_eq!(sums[j].to_bits(), in_order.to_bits(), "{what}: {} ≠ {in_order}", sums[j]),
                    true => assert!((sums[j] - in_order).abs() <= 1e-6 * size, "{what}: {} ≠ {in_order}", sums[j]),
                }
            }
            let at = |i: usize, q: usize| {
                let x = if ta { q * m + i } else { i * k + q };
                f64::from(if bytes { scale.apply(raw[x]) } else { floats[x] })
            };
            for i in 0..m {
                for j in 0..n {
                    let mut want: f64 = (0..k).map(|q| at(i, q) * f64::from(b[q * n + j])).sum();
                    if bias_on {
                        want += f64::from(bias[j]);
                    }
                    if relu {
                        want = want.max(0.0);
                    }
                    if mask_on && mask[i * n + j] <= 0.0 {
                        want = 0.0;
                    }
                    let got = f64::from(c[i * n + j]);
                    let tolerance = 1e-5 * (k as f64).sqrt() * (1.0 + want.abs());
                    assert!(
                        (got - want).abs() <= tolerance,
                        "{m}×{n}×{k} ta {ta} bytes {bytes} bias {bias_on} relu {relu} mask {mask_on}: \
                         c[{i}, {j}] {got} ≠ {want}"
                    );
                }
            }
        }
    }

    /// A B read from kept panels (`Product::b_panels`, `crate::KeptPanels`: all of B packed once, from a 64-byte
    /// boundary) gives the bits of the same product packing B itself: floats and bytes (with all-zero steps, which
    /// the kernels then read B's kept steps of from the panels, and ±∞ in B), every split, products of at most 24 rows
    /// (which read B where it is stored when given no panels), epilogues, accumulation. But for bytes stored row-major
    /// on several threads: packing B, such a product may be split along its reduction (`splits_reduction`), and from
    /// kept panels it is split by rows, its sums added in another order, so it agrees within rounding.
    #[test]
    fn products_reading_kept_panels_give_the_same_bits() {
        if !have_avx2() {
            return;
        }
        let mut rng = fastrand::Rng::with_seed(17);
        let mut shapes: Vec<(usize, usize, usize)> =
            (0..40).map(|_| (rng.usize(4..=110), rng.usize(1..=70), rng.usize(1..=450))).collect();
        shapes.extend([(128, 256, 784), (128, 256, 256), (128, 10, 256), (20, 256, 784), (97, 530, 300)]);
        for (case, &(m, n, k)) in shapes.iter().enumerate() {
            let (ta, bytes, parallel, epilogue) = (rng.bool(), rng.bool(), rng.bool(), rng.bool());
            let (accumulate, alpha) = if !epilogue && rng.bool() { (true, -0.5) } else { (false, 1.0) };
            let raw: Vec<u8> =
                (0..m * k).map(|q| if q % 28 < 4 || rng.u8(..3) == 0 { 0 } else { rng.u8(..) }).collect();
            let floats: Vec<f32> = (0..m * k).map(|_| rng.f32() - 0.5).collect();
            let mut b: Vec<f32> = (0..k * n).map(|_| rng.f32() - 0.5).collect();
            if case % 3 == 0 {
                b[rng.usize(..k * n)] = f32::INFINITY;
            }
            let bias: Vec<f32> = (0..n).map(|_| rng.f32() - 0.5).collect();
            let c0: Vec<f32> = (0..m * n).map(|_| rng.f32() - 0.5).collect();
            let mut buf = vec![0f32; packed_len(k, n) + 16];
            let skip = buf.as_ptr().align_offset(64);
            // SAFETY: AVX2 and FMA are available; B holds k·n floats, the buffer packed_len(k, n) from a 64-byte
            // boundary.
            let panels = unsafe { pack_whole_b(k, n, &b, &mut buf[skip..]) }.as_ptr();
            let product = |b_panels: *const f32| {
                let mut c = c0.clone();
                let p = Product {
                    a: if bytes { raw.as_ptr().cast() } else { floats.as_ptr() },
                    b: b.as_ptr(),
                    c: c.as_mut_ptr(),
                    accumulate,
                    alpha,
                    bytes: bytes.then_some(ByteScale::Div(255.0)),
                    bias: if epilogue { bias.as_ptr() } else { std::ptr::null() },
                    relu: epilogue,
                    b_rewritten: case % 2 == 0,
                    b_panels,
                    ..crate::avx512::tests::product(m, n, k, ta, false)
                };
                // SAFETY: AVX2 and FMA are available; the operands hold every element the product addresses, and
                // the panels (when given) all of B.
                unsafe { sgemm(p, parallel) };
                c
            };
            let (packing, kept) = (product(std::ptr::null()), product(panels));
            let reduction_split = bytes && !ta && parallel;
            for (i, (x, y)) in packing.iter().zip(&kept).enumerate() {
                let rounding = reduction_split && (x - y).abs() <= 1e-5 * (k as f32).sqrt() * (1.0 + x.abs());
                assert!(
                    x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()) || rounding,
                    "{m}×{n}×{k} (ta {ta}, bytes {bytes}, parallel {parallel}) at {i}: {y} from kept panels, {x} without"
                );
            }
        }
    }

    /// Products of bytes where many steps are zero in every row of a panel (black borders, black images), which
    /// the panels leave out (`bytes`), called directly: against a naive product, with ±∞ and NaN in some rows of B
    /// (those steps must still give NaN), a scale that reads a byte 0 as NaN, accumulation, α and epilogues; both
    /// orientations, on one thread, on the pool (split along the reduction for the first layer, which leaves out
    /// nothing), and past a block of rows, steps and columns.
    #[test]
    fn products_of_bytes_leave_out_zero_steps_exactly() {
        if !have_avx2() {
            return;
        }
        let mut rng = fastrand::Rng::with_seed(13);
        let mut shapes: Vec<(usize, usize, usize)> =
            (0..40).map(|_| (rng.usize(1..=110), rng.usize(1..=70), rng.usize(1..=450))).collect();
        shapes.extend([(128, 256, 784), (784, 256, 128), (100, 530, 300), (97, 40, 401)]);
        for (case, &(m, n, k)) in shapes.iter().enumerate() {
            let (ta, parallel, epilogue) = (rng.bool(), rng.bool(), rng.bool());
            let (accumulate, alpha) = if rng.bool() { (true, -0.5) } else { (false, 1.0) };
            let scale = match case % 5 {
                4 => ByteScale::Div(0.0),
                3 => ByteScale::Mul(-0.5),
                _ => ByteScale::Div(255.0),
            };
            let mut raw = vec![0u8; m * k];
            for i in 0..m {
                for q in 0..k {
                    let black = q % 28 < 3 || q % 28 >= 25 || i % 4 == 3 || rng.bool();
                    raw[if ta { q * m + i } else { i * k + q }] = if black { 0 } else { rng.u8(1..) };
                }
            }
            let mut b: Vec<f32> = (0..k * n).map(|_| rng.f32() - 0.5).collect();
            for (q, x) in [(0, f32::INFINITY), (1, f32::NAN), (k / 2, f32::NEG_INFINITY), (k - 1, f32::NAN)] {
                if case % 2 == 0 {
                    b[q * n + rng.usize(..n)] = x;
                }
            }
            let bias: Vec<f32> = (0..n).map(|_| rng.f32() - 0.5).collect();
            let c0: Vec<f32> = (0..m * n).map(|_| rng.f32() - 0.5).collect();
            let mut c = c0.clone();
            let p = Product {
                a: raw.as_ptr().cast(),
                b: b.as_ptr(),
                c: c.as_mut_ptr(),
                accumulate,
                alpha,
                bytes: Some(scale),
                bias: if epilogue { bias.as_ptr() } else { std::ptr::null() },
                relu: epilogue,
                b_rewritten: case % 3 == 0,
                b_panels: std::ptr::null(),
                ..crate::avx512::tests::product(m, n, k, ta, false)
            };
            // SAFETY: AVX2 and FMA are available; the operands hold every element the product addresses.
            unsafe { sgemm(p, parallel) };
            let at = |i: usize, q: usize| f64::from(scale.apply(raw[if ta { q * m + i } else { i * k + q }]));
            for i in 0..m {
                for j in 0..n {
                    let terms = (0..k).map(|q| at(i, q) * f64::from(b[q * n + j]));
                    let size: f64 = terms.clone().map(f64::abs).sum();
                    let old = if accumulate { f64::from(c0[i * n + j]) } else { 0.0 };
                    let mut want = old + f64::from(alpha) * terms.sum::<f64>();
                    if epilogue {
                        // The relu keeps NaN (`finish8`).
                        want += f64::from(bias[j]);
                        want = if want.is_nan() { want } else { want.max(0.0) };
                    }
                    let got = f64::from(c[i * n + j]);
                    let agree = match want.is_finite() {
                        true => (got - want).abs() <= 1e-5 * (1.0 + size + old.abs()),
                        false => got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                    };
                    assert!(
                        agree,
                        "{m}×{n}×{k} (ta {ta}, {scale:?}, parallel {parallel}) at ({i}, {j}): {got} ≠ {want}"
                    );
                }
            }
        }
    }

    /// The first layer (bytes stored row-major times its weights) on a pool of 2 and of 3 threads: one chunk of the
    /// reduction each, the partials summed and the epilogue applied after; against a naive product, with
    /// accumulation and α too. Only such products split so.
    #[test]
    fn products_of_bytes_are_split_along_the_reduction() {
        if !have_avx2() {
            return;
        }
        let shape = |m, n, k, b_rewritten, ta| Product {
            m,
            n,
            k,
            a: std::ptr::null(),
            lda: if ta { m } else { k },
            ta,
            b: std::ptr::null(),
            ldb: n,
            tb: false,
            c: std::ptr::null_mut(),
            ldc: n,
            tc: false,
            accumulate: false,
            alpha: 1.0,
            bytes: Some(ByteScale::Div(255.0)),
            bias: std::ptr::null(),
            relu: true,
            mask: std::ptr::null(),
            sums: std::ptr::null_mut(),
            b_rewritten,
            b_panels: std::ptr::null(),
            id: 0,
        };
        assert!(splits_reduction(&shape(128, 256, 784, true, false), 2));
        assert!(splits_reduction(&shape(128, 256, 784, false, false), 2));
        assert!(!splits_reduction(&shape(128, 256, 784, true, true), 2));
        assert!(!splits_reduction(&shape(128, 256, 100, true, false), 2));
        assert!(!splits_reduction(&Product { bytes: None, ..shape(128, 256, 784, true, false) }, 2));
        let panels = [0f32; 16];
        assert!(!splits_reduction(&Product { b_panels: panels.as_ptr(), ..shape(128, 256, 784, false, false) }, 2));
        let mut rng = fastrand::Rng::with_seed(12);
        for (threads, (m, n, k)) in
            [(2, (128, 256, 784)), (3, (37, 100, 500)), (2, (64, 96, 300)), (3, (128, 256, 784))]
        {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a pool");
            let raw: Vec<u8> = (0..m * k).map(|_| rng.u8(..)).collect();
            let b: Vec<f32> = (0..k * n).map(|_| rng.f32() - 0.5).collect();
            let bias: Vec<f32> = (0..n).map(|_| rng.f32() - 0.5).collect();
            let mask: Vec<f32> = (0..m * n).map(|_| rng.f32() - 0.3).collect();
            let c0: Vec<f32> = (0..m * n).map(|_| rng.f32() - 0.5).collect();
            for (accumulate, alpha, epilogue) in [(false, 1.0, true), (true, -0.25, false), (false, 0.5, false)] {
                let mut c = c0.clone();
                let p = Product {
                    a: raw.as_ptr().cast(),
                    b: b.as_ptr(),
                    c: c.as_mut_ptr(),
                    accumulate,
                    alpha,
                    bias: if epilogue { bias.as_ptr() } else { std::ptr::null() },
                    relu: epilogue,
                    mask: if epilogue { mask.as_ptr() } else { std::ptr::null() },
                    sums: std::ptr::null_mut(),
                    ..shape(m, n, k, true, false)
                };
                assert!(splits_reduction(&p, threads) && m * n * k >= PARALLEL_MIN / 4);
                // SAFETY: AVX2 and FMA are available; the operands hold every element the product addresses.
                pool.install(|| unsafe { sgemm(p, true) });
                for i in 0..m {
                    for j in 0..n {
                        let sum: f64 =
                            (0..k).map(|q| f64::from(raw[i * k + q]) / 255.0 * f64::from(b[q * n + j])).sum();
                        let old = if accumulate { f64::from(c0[i * n + j]) } else { 0.0 };
                        let mut want = old + f64::from(alpha) * sum;
                        if epilogue {
                            want = (want + f64::from(bias[j])).max(0.0);
                            if mask[i * n + j] <= 0.0 {
                                want = 0.0;
                            }
                        }
                        let got = f64::from(c[i * n + j]);
                        assert!(
                            (got - want).abs() <= 1e-5 * (k as f64).sqrt() * (1.0 + want.abs()),
                            "{m}×{n}×{k} on {threads} threads, accumulate {accumulate}, α {alpha}, epilogue {epilogue}: \
                             c[{i}, {j}] {got} ≠ {want}"
                        );
                    }
                }
            }
        }
    }

    /// Images grouped by their black give the same bits as in their order (`grouped`), on the AVX2 kernels.
    #[test]
    fn products_of_bytes_grouped_by_their_black_give_the_same_bits() {
        if !have_avx2() {
            return;
        }
        let splits = |p: &Product, threads| splits_reduction(p, threads) && shared(p, threads, false);
        crate::grouped::tests::give_the_same_bits(sgemm, MR, splits);
    }

    #[test]
    fn products_match_a_naive_one() {
        if !have_avx2() {
            return;
        }
        let mut rng = fastrand::Rng::with_seed(7);
        let mut shapes: Vec<(usize, usize, usize)> =
            (0..300).map(|_| (rng.usize(1..=40), rng.usize(1..=40), rng.usize(1..=40))).collect();
        // Past one block of rows (96), of the reduction (200; 230 steps are one block where L1d is wide) and of
        // columns (512), and products large enough to be shared among threads.
        shapes.extend([
            (97, 17, 257),
            (50, 40, 230),
            (13, 513, 300),
            (200, 130, 90),
            (128, 256, 784),
            (784, 256, 128),
            (128, 10, 256),
            // Thin, with long reductions: dot products (`dot::sgemm_avx2`), reductions not a multiple of 8.
            (100, 10, 784),
            (9, 300, 1001),
            (257, 3, 130),
            (70, 16, 64),
        ]);
        for (m, n, k) in shapes {
            let (ta, tb, tc, accumulate) = (rng.bool(), rng.bool(), rng.bool(), rng.bool());
            let alpha = if rng.bool() { 1.0 } else { rng.f32() * 4.0 - 2.0 };
            let lda = if ta { m } else { k } + rng.usize(0..3);
            let ldb = if tb { k } else { n } + rng.usize(0..3);
            let ldc = if tc { m } else { n } + rng.usize(0..3);
            let a: Vec<f32> = (0..m.max(k) * lda).map(|_| rng.f32() - 0.5).collect();
            let b: Vec<f32> = (0..n.max(k) * ldb).map(|_| rng.f32() - 0.5).collect();
            let c0: Vec<f32> = (0..m.max(n) * ldc).map(|_| rng.f32() - 0.5).collect();
            let mut c = c0.clone();
            let p = Product {
                m,
                n,
                k,
                a: a.as_ptr(),
                lda,
                ta,
                b: b.as_ptr(),
                ldb,
                tb,
                c: c.as_mut_ptr(),
                ldc,
                tc,
                accumulate,
                alpha,
                bytes: None,
                bias: std::ptr::null(),
                relu: false,
                mask: std::ptr::null(),
                sums: std::ptr::null_mut(),
                b_rewritten: false,
                b_panels: std::ptr::null(),
                id: 0,
            };
            // SAFETY: AVX2 and FMA are available; the operands hold every element the product addresses.
            unsafe { sgemm(p, rng.bool()) };
            let at = |i: usize, q: usize| f64::from(if ta { a[q * lda + i] } else { a[i * lda + q] });
            let bt = |q: usize, j: usize| f64::from(if tb { b[j * ldb + q] } else { b[q * ldb + j] });
            let mut want = c0.clone();
            for i in 0..m {
                for j in 0..n {
                    let sum: f64 = (0..k).map(|q| at(i, q) * bt(q, j)).sum();
                    let at_c = if tc { j * ldc + i } else { i * ldc + j };
                    let old = if accumulate { f64::from(c0[at_c]) } else { 0.0 };
                    want[at_c] = (old + f64::from(alpha) * sum) as f32;
                }
            }
            for (x, (got, want)) in c.iter().zip(&want).enumerate() {
                let tolerance = 1e-5 * (k as f32).sqrt() * (1.0 + want.abs());
                assert!((got - want).abs() <= tolerance, "{m}×{n}×{k} ta {ta} tb {tb} tc {tc}: c[{x}] {got} ≠ {want}");
            }
        }
    }
}
