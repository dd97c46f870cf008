//! The AVX-512 single-precision product: packed panels, a 12×32 register-blocked microkernel, shared among
//! threads in chunks.
//!
//! Work of one thread (`block`), sized for the products of dfc's models, whose operands fit in the 2 MiB L2:
//! - the reduction is cut into equal blocks of at most `KC` = 384 steps, the columns into equal blocks of at most
//!   `NC` = 512;
//! - B's kc×nc block is packed in 32-column panels (kc·32 floats, step-major, 64-byte aligned) that stay in L2,
//!   or, when few row panels of A reuse it, read where it is stored (`Product::b_in_place`);
//! - A's rows are split in balanced panels of at most 12 (⌈m/12⌉ panels whose heights differ by at most one, so
//!   no product ends on a nearly empty panel). A row-major A is read in place; a transposed-stored A is packed, a
//!   group of panels at a time, reading its stored rows in order. Each panel stays in L1 while the microkernel
//!   walks every B panel of the block.
//!
//! The microkernels (`kernel`) hold a 12×32 tile of C in 24 zmm registers; the last columns of C, when 16 or
//! fewer, go to a one-vector variant. A thin C (n = 10: the logits of a classifier) would waste most of every
//! panel, so such a product is computed as `Cᵀ = Bᵀ·Aᵀ` when that costs less (`cost`), storing tiles of Cᵀ
//! through an in-register transpose.
//!
//! A of bytes (`Product::bytes`: images fed as u8) is converted to floats as it is packed, and each panel leaves out
//! the steps at which all its rows are 0 (`finite::Selection`): the black pixels that a panel's images share, 10 to
//! 20 % of the steps of Fashion-MNIST's batches. The kernels then read B's rows through the list of steps kept
//! (`SKIP`). C is the same to the bit: a step is left out only where its row of B is finite and a byte 0 reads as
//! ±0, and ±0 added to the accumulators (which start at +0) changes nothing.
//!
//! A thin product with a long reduction (C or Cᵀ of at most 16 columns, its A row-major) is computed as dot
//! products instead (`dot`) when that costs less: every lane works, where a tile would use n of 16. A product of
//! one to three rows of C (a batch of one) runs on the AVX2 kernels' pass over B in place (`avx2::rows`).
//!
//! Threads (`plan`, `parallel_product`) take chunks of rows, of columns or of the reduction (then summed), chosen by
//! the same cost estimate, through `pool::run_chunks`; while the workers spin (a program's step), a product of a few
//! microseconds is shared by rows or columns even where the estimate has one thread faster (`SPUN_MIN`), and a short
//! reduction by rows even where it has columns (`SHORT_REDUCTION`: C and its mask bound it). Row chunks are
//! runs of whole panels but in the middle, where the threads meet, half panels (`RowChunks`). A product of bytes whose
//! B each training step rewrites (the first layer's weights: `Product::b_rewritten`) takes one chunk of the reduction
//! per thread, whatever the estimate: each thread then reads the rows of B that it wrote in the update, which splits B
//! by rows; the threads sum the partials and apply the epilogue each over its own rows of C. Its chunks take the rows
//! sorted by the span of their lit bytes (`grouped`), so that a panel's images share more black. A dense layer of floats
//! whose B is never rewritten (an inference's weights, read in place) is split by rows of C, as the layer before it
//! (`keeps_rows`): each thread reads the rows of A that it wrote.

pub(crate) mod dot;
mod kernel;
mod pack;

use std::arch::x86_64::*;
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::finite::{FiniteRows, Selection, RESERVED_STEPS};
use crate::grouped::{self, Grouping};
use crate::pool;
use crate::sums::{self, RowSums};
use crate::ByteScale;
use kernel::{finish16, KERNELS};
pub(crate) use pack::{corrects, tail_mask};
use pack::{pack_a, pack_a_bytes, pack_b, Convert};

/// Rows of the microkernel tile.
const MR: usize = 12;
/// Columns of the microkernel tile: two zmm vectors.
const NR: usize = 32;
/// Depth of a block: an A panel of 12 rows × 384 steps is 18 KiB, well within L1 beside the B panel streaming
/// through; C is read and written once per block. (256, 512 and 800 measure within noise on our shapes.)
const KC: usize = 384;
/// Columns of a packed B block: 384 × 512 floats are 768 KiB, so that the block stays in L2 while A streams past.
const NC: usize = 512;
/// Rows of A packed at once when A is stored transposed (read 1 KiB of a stored row at a time).
const MC: usize = 288;
/// Most chunks a product is cut into.
const MAX_CHUNKS: usize = 64;

/// One 64-byte line, the unit of the packing buffers, so that packed B panels are aligned.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; 16]);

/// A growable, 64-byte aligned scratch buffer (the AVX2 kernels' too).
#[derive(Default)]
pub(crate) struct Buf(Vec<Line>);

impl Buf {
    /// An empty buffer (for statics).
    pub(crate) const fn new() -> Buf {
        Buf(Vec::new())
    }

    /// The buffer, grown to hold at least `floats`.
    pub(crate) fn ptr(&mut self, floats: usize) -> *mut f32 {
        let lines = floats.div_ceil(16);
        if self.0.len() < lines {
            self.0 = vec![Line([0.0; 16]); lines];
        }
        self.0.as_mut_ptr().cast()
    }

    pub(crate) fn floats(&self) -> usize {
        self.0.len() * 16
    }
}

/// The packing buffers of a thread: A's panels and a block of B, with the block's identity (call, pc, kc, jc, nc),
/// so that the chunks of one product a thread runs pack the same block of B once.
#[derive(Default)]
struct Packs {
    a: Buf,
    b: Buf,
    b_holds: Option<(u64, usize, usize, usize, usize)>,
    /// The steps that panels of bytes keep (`Selection`), and which rows of B are finite.
    steps: Vec<u32>,
    finite: FiniteRows,
}

thread_local! {
    /// This thread's packing buffers, reused by every call. Taken out while a block runs, so that a product
    /// nested on the same thread (none is expected) would only allocate its own.
    static PACK: Cell<Packs> = Cell::new(Packs::default());
}

/// Grows this thread's packing buffers to the most any block asks of them (`block`: A's groups of panels of at
/// most `KC` steps, B's blocks of `KC`×`NC`), so that a thread's first block in a later step allocates nothing.
pub(crate) fn reserve_thread() {
    let mut packs = PACK.take();
    packs.a.ptr(MC / MR * (MR * KC + 16));
    packs.b.ptr(KC * NC);
    packs.steps.reserve(MC / MR * (KC + 16));
    packs.finite.reserve(RESERVED_STEPS);
    PACK.set(packs);
}

/// Partial sums of reduction chunks, reused across calls.
pub(crate) static PARTIALS: Mutex<Vec<Buf>> = Mutex::new(Vec::new());

/// Distinguishes calls, for `Packs::b_holds`.
pub(crate) static CALLS: AtomicU64 = AtomicU64::new(1);

/// A product `C = α·A·B` (or `C += α·A·B` when `accumulate`) over raw pointers.
///
/// Element (i, p) of A is `a[i·lda + p]`, or `a[p·lda + i]` when `ta`; element (p, j) of B is `b[p·ldb + j]`, or
/// `b[j·ldb + p]` when `tb`; element (i, j) of C is `c[i·ldc + j]`, or `c[j·ldc + i]` when `tc`.
#[derive(Clone, Copy)]
pub(crate) struct Product {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: *const f32,
    pub lda: usize,
    pub ta: bool,
    pub b: *const f32,
    pub ldb: usize,
    pub tb: bool,
    pub c: *mut f32,
    pub ldc: usize,
    pub tc: bool,
    pub accumulate: bool,
    /// α, which scales each tile of the product before it is stored or added.
    pub alpha: f32,
    /// `Some`: A holds bytes (`a` is their address), each read as a float through the scale; A is then always
    /// packed, and the product never transposed or computed as dot products.
    pub bytes: Option<ByteScale>,
    /// Not null: the bias of each column of C, added to each element as its tile is stored (the epilogue);
    /// then `relu`: `max(·, 0)`. A product with an epilogue is never transposed, computed as dot products or
    /// cut along its reduction.
    pub bias: *const f32,
    pub relu: bool,
    /// Not null: an m×n matrix laid out as C (`ldc` apart); elements of C where it is not above 0 become 0.
    pub mask: *const f32,
    /// Not null: n floats that get the sums of C's finished columns (`crate::sums`). C is then never stored
    /// transposed, and the product never cut along its reduction but as the epilogue's is (by rows, after).
    pub sums: *mut f32,
    /// B is rewritten between calls by other products split among the threads (a weight that each training step
    /// updates): a product of bytes is then split along its reduction (`plan`).
    pub b_rewritten: bool,
    /// Not null: B (k×n, stored row-major: `tb` false) packed whole in the AVX2 kernels' 16-column panels of all k
    /// steps, from a 32-byte boundary (`crate::KeptPanels`), which the AVX2 kernels read instead of packing B again;
    /// other kernels ignore it.
    pub b_panels: *const f32,
    /// Set by `sgemm`.
    pub id: u64,
}

// SAFETY: a `Product` is plain data: its pointers are dereferenced only inside `unsafe` code under `sgemm`'s
// contract (every element addressed is in bounds; the threads of one call read A and B and write disjoint parts
// of C, or partial sums of their own). Moving or sharing the pointers themselves does nothing.
unsafe impl Send for Product {}
// SAFETY: as for `Send`.
unsafe impl Sync for Product {}

impl Product {
    /// Whether the product has an epilogue (`bias`, `relu`, `mask`).
    pub(crate) fn epilogue(&self) -> bool {
        !self.bias.is_null() || self.relu || !self.mask.is_null()
    }

    /// Whether the product must keep its orientation and be computed by tiles: A holds bytes, or an epilogue or
    /// column sums follow (all are C's and A's as given).
    pub(crate) fn fixed(&self) -> bool {
        self.bytes.is_some() || self.epilogue() || !self.sums.is_null()
    }

    /// Whether A is packed into panels (stored transposed, or as bytes) rather than read where it is stored.
    fn packs_a(&self) -> bool {
        self.ta || self.bytes.is_some()
    }

    /// Whether the kernels read B where it is stored (but for a last panel narrower than 32 columns) instead of
    /// packed panels. Packed panels are contiguous and stream from L2 faster than the rows of a row-major B (one
    /// 128-byte piece every ldb floats): packing pays when more than 12 row panels of A reuse it, not for the
    /// small products of a small batch (m = 128, or Cᵀ of a thin C), 5 to 10 % faster without; but it pays from 7
    /// panels on when the reduction is deeper than one block (the MLP's first layer, 128×256×784: 10 % faster).
    ///
    /// A product of bytes stored row-major reads B in place too: its threads share it by rows (see `plan`), and a
    /// packed B would be packed again by every chunk (the MLP's first layer fed bytes: 7 % faster a step).
    fn b_in_place(&self) -> bool {
        !self.tb && (self.m <= 6 * MR || (self.m <= 12 * MR && self.k <= KC) || self.row_bytes())
    }

    /// Whether A holds bytes stored row-major: converted to floats row panel by row panel, once per chunk of
    /// rows, and again by every chunk of columns or of the reduction.
    fn row_bytes(&self) -> bool {
        self.bytes.is_some() && !self.ta
    }

    /// The same product computed as `Cᵀ = Bᵀ·Aᵀ`.
    pub(crate) fn transposed(self) -> Product {
        Product {
            m: self.n,
            n: self.m,
            a: self.b,
            lda: self.ldb,
            ta: !self.tb,
            b: self.a,
            ldb: self.lda,
            tb: !self.ta,
            tc: !self.tc,
            // The panels are of B as given.
            b_panels: std::ptr::null(),
            ..self
        }
    }
}

/// Fraction of the FMA lanes of the tiles covering `n` columns that do useful work (32-column tiles, the last
/// one 16 columns wide when that covers it).
fn lane_use(n: usize) -> f64 {
    let lanes = match n % NR {
        0 => n,
        tail @ 1..=16 => n - tail + 16,
        tail => n - tail + NR,
    };
    n as f64 / lanes as f64
}

/// Rough time (ns) of packing B: a copy at ~0.1 ns a float (from L2), a transposition at ~0.16, none in place.
fn pack_b_cost(p: &Product) -> f64 {
    let per_float = match (p.tb, p.b_in_place()) {
        (true, _) => 0.16,
        (false, true) => 0.0,
        (false, false) => 0.1,
    };
    (p.k * p.n) as f64 * per_float
}

/// Rough single-thread time (ns) of `p` as oriented: the FMAs at ~170 GFLOP/s over the lanes its tiles use, plus
/// packing B and A (a copy, when stored transposed).
fn cost(p: &Product) -> f64 {
    let compute = 2.0 * (p.m * p.n * p.k) as f64 / lane_use(p.n) / 170.0;
    let pack_a = (p.m * p.k) as f64
        * match (p.bytes, p.ta) {
            (Some(_), _) => 0.04,
            (None, true) => 0.1,
            (None, false) => 0.0,
        };
    compute + pack_b_cost(p) + pack_a
}

/// Extra time (ns) of a parallel product: handing chunks to a rayon worker (waking it) and waiting at the end.
const PARALLEL_OVERHEAD: f64 = 20_000.0;
/// A product with a C of at least this many elements and at least `WIDE_MIN_MADDS` multiply-adds is shared among
/// the threads by rows or columns even where `cost` has one thread faster. Such a product over a short reduction
/// (the mlp's last input gradient, 128×256 under the relu's mask from 10 steps) is bound by C and the mask, not by
/// its multiply-adds, and in a step on two threads the products before it left half of those lines in the other
/// core's cache: on one thread in a two-thread step it took 18–25 µs on Zen 4 (15–17 in a one-thread step), split
/// 16 µs.
const WIDE_C_MIN: usize = 1 << 14;
const WIDE_MIN_MADDS: usize = 1 << 18;
/// A product estimated at least this long (ns) is shared among the threads by rows or columns, where the estimate
/// has one thread faster, when the workers spin (`pool::workers_spinning`: a program's step), so that a chunk reaches
/// them within a poll. In a step on two threads its operands were written by both (a layer's activations, split
/// among them), and one thread would read half of them from the other core's cache; split, each reads about its own
/// half. The mlp's last weight update (w3 += α·h2ᵀ·dlogits, 256×128·128×10, ~4 µs by `cost`) took 9.2–10.0 µs on one
/// thread in a two-thread step on an Intel Xeon (AVX-512, 2 vCPUs), 5.3–5.8 split; whole steps 474.8 → 468.8 µs
/// (medians of 8 processes each way, alternated); the cnn's and the logreg's steps and inference within noise.
const SPUN_MIN: f64 = 3_000.0;
/// A product of at most this many steps that the threads share by columns (`plan`'s estimate; `avx2::sgemm`'s, which
/// weighs only the packing each split repeats) is shared by rows instead. Such a product is bound by C and the mask,
/// not by B, which is small: the mlp's last input gradient (dlogits·w3ᵀ, 10 steps into 128×256 under h2's mask).
/// By columns each thread wrote half of every row of C and read half of every row of the mask, half of them in the
/// other core's cache; by rows it writes and reads whole rows, as the layers around it split their activations and
/// gradients. On an Intel Xeon (2 vCPUs, one process, `pool::run_chunks` timed per product), the caller's share of
/// that product in a training step 17.7–19.3 → 12.9–14.0 µs (AVX-512), 18.6–19.2 → 14.2–14.9 µs (`DFC_GEMM=avx2`).
pub(crate) const SHORT_REDUCTION: usize = 32;
/// Target time (ns) of a chunk of a parallel product: a worker woken late (20 µs and more on this virtual
/// machine) still finds a fair share left, and each chunk's start-up stays small.
const CHUNK_TIME: f64 = 12_000.0;

/// Computes the product, on rayon's pool when `parallel` and the product is large enough to pay for it.
///
/// # Safety
/// The CPU supports AVX-512F, AVX2 and FMA, and every element of A, B and C the product addresses is in bounds.
pub(crate) unsafe fn sgemm(p: Product, parallel: bool) {
    let threads = if parallel { rayon::current_num_threads() } else { 1 };
    // One to three rows of C (a batch of one), or of Cᵀ: the AVX2 pass over B in place, once, in order. Here the
    // tiles would pack all of B for a row or two, and dot products would pack a row-major B as Bᵀ: on Zen 4 the
    // mlp's forward pass at batch 1 took 15–19 µs so, 10–15 this way, the logreg's 3.3–3.4 against 1.4.
    if let Some(few) = crate::avx2::rows::oriented(&p) {
        // SAFETY: the caller's contract, AVX2 and FMA included; the column sums (if any) are of C as given.
        return unsafe {
            crate::avx2::rows::sgemm(&few, threads);
            sums::all(&p)
        };
    }
    // A thin product (C or Cᵀ of at most 16 columns) as dot products, where that costs less than tiles.
    // A product of bytes or with an epilogue keeps its orientation and its tiles (see `Product::fixed`).
    let as_dots = [p, p.transposed()]
        .into_iter()
        .filter(|p| !p.fixed() && dot::applies(p))
        .min_by(|x, y| dot::cost(x).total_cmp(&dot::cost(y)));
    let transpose = !p.fixed() && cost(&p.transposed()) < 0.95 * cost(&p);
    let mut p = if transpose { p.transposed() } else { p };
    if let Some(thin) = as_dots.filter(|thin| dot::cost(thin) < 0.95 * cost(&p)) {
        // SAFETY: the caller's contract.
        return unsafe { dot::sgemm(&thin, threads) };
    }
    p.id = CALLS.fetch_add(1, Ordering::Relaxed);
    match plan(&p, threads, pool::workers_spinning()) {
        // SAFETY: the caller's contract.
        None => unsafe {
            block(&p, 0, p.m, 0, p.n, 0, p.k, p.c, p.ldc, p.accumulate);
            sums::all(&p)
        },
        // SAFETY: the caller's contract.
        Some((split, chunks)) => unsafe { parallel_product(&p, split, chunks, threads) },
    }
}

/// How the threads share a product.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Split {
    /// Chunks of row panels; every thread packs all of B (once, when it is a single block).
    Rows,
    /// Chunks of 32-column panels; every chunk reads all of A (and packs it again when A is stored transposed).
    Cols,
    /// Chunks of the reduction, each but the first into a partial C summed at the end (then the epilogue, if any).
    Depth,
}

/// How `threads` threads should share `p`, and in how many chunks; `None` when one thread is faster. Estimates each
/// split's time (a thread's share of the work, the packing or reading it repeats, half a chunk of imbalance, the
/// hand-off) and takes the fastest; a wide C (`WIDE_C_MIN`), or a product of `SPUN_MIN` or more while the workers
/// are `spinning`, is split by rows or columns regardless.
fn plan(p: &Product, threads: usize, spinning: bool) -> Option<(Split, usize)> {
    if threads <= 1 {
        return None;
    }
    let (m, n, k) = (p.m, p.n, p.k);
    let single = cost(p);
    // Bytes times a B that each training step rewrites (the first layer's weights, which the update of the same
    // step writes by rows, as `Split::Rows` splits it): one chunk of the reduction per thread, so that each thread
    // reads the rows of B it wrote. Split by rows of C, each thread read all of B in place, half of it from the
    // other core's cache, and the update then had to take every line of B back from the other core. On Zen 4 (two
    // threads, timed in one process, each way alternated with the other): the MLP's first layer 252–259 → 240–242
    // µs on random bytes, 236–243 → 233–235 on Fashion-MNIST's images; its weights' update that follows 256–260 →
    // 245–249 and 215–220 → 202–209.
    if p.row_bytes() && p.b_rewritten && k >= 64 * threads && single >= 2.0 * PARALLEL_OVERHEAD {
        return Some((Split::Depth, threads));
    }
    let t = threads as f64;
    let wanted = ((single / CHUNK_TIME) as usize).clamp(threads, (4 * threads).min(MAX_CHUNKS));
    let row_chunks = wanted.min(if p.tc { m / 64 } else { m.div_ceil(MR) });
    if keeps_rows(p) && row_chunks >= 2 && single >= 2.0 * PARALLEL_OVERHEAD {
        return Some((Split::Rows, row_chunks));
    }
    let mut best: Option<(f64, Split, usize)> = None;
    let mut consider = |split: Split, chunks: usize, extra: f64| {
        if chunks >= 2 {
            let time = single / t + extra + 0.5 * single / chunks as f64 + PARALLEL_OVERHEAD;
            if best.is_none_or(|(b, _, _)| time < b) {
                best = Some((time, split, chunks));
            }
        }
    };
    // Every row chunk reads all of B again (from L2 if it fits there), and packs it unless its thread already has.
    // Rows of Cᵀ are columns of C: chunks of fewer than 64 would share most of their cache lines of C.
    {
        let chunks = row_chunks;
        let packs_per_thread = if k <= KC && n <= NC { 1.0 } else { chunks as f64 / t };
        let read_b = (k * n) as f64 * if k * n >= 1 << 18 { 0.1 } else { 0.02 };
        let extra = pack_b_cost(p) * (packs_per_thread - 1.0 / t) + read_b * (chunks as f64 - 1.0) / t;
        consider(Split::Rows, chunks, extra);
    }
    // Bytes stored row-major are converted once by chunks of rows: only those.
    if !p.row_bytes() {
        // Every column chunk reads all of A again, and packs it again when A is stored transposed or as bytes.
        let read_a = (m * k) as f64
            * if p.bytes.is_some() {
                0.04
            } else if p.ta || m * k >= 1 << 18 {
                0.1
            } else {
                0.02
            };
        let chunks = wanted.min(n.div_ceil(NR));
        consider(Split::Cols, chunks, read_a * (chunks as f64 - 1.0) / t);
        // The epilogue and the column sums need the whole sum.
        let chunks = if p.epilogue() || !p.sums.is_null() { 0 } else { wanted.min(k / 64) };
        consider(Split::Depth, chunks, chunks.saturating_sub(1) as f64 * (m * n) as f64 * 0.4);
    }
    let wide = m * n >= WIDE_C_MIN && m * n * k >= WIDE_MIN_MADDS;
    let regardless = wide || (spinning && single >= SPUN_MIN);
    let short = k <= SHORT_REDUCTION && !p.tc && row_chunks >= 2;
    best.filter(|&(time, split, _)| time < single || (regardless && split != Split::Depth)).map(|(_, split, chunks)| {
        match split {
            Split::Cols if short => (Split::Rows, row_chunks),
            _ => (split, chunks),
        }
    })
}

/// Whether `p` is a dense layer that reads its input where the layer before it left it: a product with an epilogue,
/// A of floats stored row-major, B read where it is stored and never rewritten (an inference's weights). Such a
/// product is split by rows of C, as the layer before it was: each thread reads only the rows of A that it wrote,
/// and all of B, which both cores keep in their caches. Split by columns (the estimate's choice), each thread read
/// all of A, half of it from the other core's cache, and the layer before it had to take those lines back from
/// the other core in the next step. On Zen 4 the mlp's second layer at inference (128×256·256×256), the forward
/// pass timed in one process in alternated runs of 50: 2–4 % faster in quiet spells (p10), 15–20 % in slow ones
/// (medians), and the first layer after it too (5–8 %, medians).
fn keeps_rows(p: &Product) -> bool {
    p.epilogue() && !p.b_rewritten && !p.ta && !p.tc && p.bytes.is_none() && p.b_in_place()
}

/// The row ranges of a product split by rows: `m` rows in ⌈m/MR⌉ balanced panels, in runs of whole panels from
/// either end, and (when `fine`) the `2·threads` panels in the middle each cut in two. The caller claims chunks from
/// the front and the workers from the back, so they meet in the middle, where a thread that finds nothing left
/// waits for the other's last chunk: a half panel there, not a run of them. (The mlp's first layer, 128 rows in
/// 11 panels, was cut in 8 runs of 1 or 2 panels; the weight gradient of its 784 rows in 8 runs of 8 or 9.) On
/// Zen 4 the mlp's training step went 798 → 791 µs and its forward pass 339 → 332 (medians of alternated
/// processes in the same spells).
/// The halves are cut by rows, not columns: every row chunk packs the same block of B, once per thread.
struct RowChunks {
    /// Chunk c is rows `bounds[c]..bounds[c + 1]`.
    bounds: [usize; 2 * MAX_CHUNKS + 3],
    len: usize,
}

impl RowChunks {
    /// `chunks` runs (as `plan` chose) of `m` rows, the middle ones cut finer when `fine`.
    fn new(m: usize, chunks: usize, threads: usize, fine: bool) -> RowChunks {
        let panels = m.div_ceil(MR).max(1);
        let row = |g: usize| g * (m / panels) + g.min(m % panels);
        let mut split = RowChunks { bounds: [0; 2 * MAX_CHUNKS + 3], len: 0 };
        let mut cut = |at: usize| {
            if at > split.bounds[split.len] {
                split.len += 1;
                split.bounds[split.len] = at;
            }
        };
        if !fine {
            for c in 1..=chunks {
                cut(row(panels * c / chunks));
            }
            return split;
        }
        let middle = (2 * threads).min(MAX_CHUNKS / 2).min(panels);
        let coarse = panels - middle;
        let (front, run) = (coarse / 2, coarse.div_ceil(chunks).max(1));
        for g in (run..front).step_by(run).chain([front]) {
            cut(row(g));
        }
        for g in front..front + middle {
            cut((row(g) + row(g + 1)) / 2);
            cut(row(g + 1));
        }
        for g in (front + middle + run..panels).step_by(run).chain([panels]) {
            cut(row(g));
        }
        split
    }

    fn get(&self, c: usize) -> (usize, usize) {
        (self.bounds[c], self.bounds[c + 1])
    }
}

/// Splits `0..len` in `parts` nearly equal ranges, multiples of `unit` except the last.
fn range(len: usize, unit: usize, parts: usize, t: usize) -> (usize, usize) {
    let units = len.div_ceil(unit);
    ((units * t / parts * unit).min(len), (units * (t + 1) / parts * unit).min(len))
}

/// A buffer handed to the chunks of one product: a partial sum's, to the chunk that writes it
/// (`parallel_product`), or a packed Bᵀ that every chunk reads (`dot`).
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: plain data, dereferenced only in the `unsafe` code of `parallel_product` and `dot::sgemm`: each partial
// buffer is written by one chunk, then read by the calling thread after `run_chunks` has returned (every chunk
// done); a packed Bᵀ is only read by the chunks, and outlives `run_chunks`.
unsafe impl Send for SendPtr {}
// SAFETY: as for `Send`.
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// The pointer (a method, so that a closure captures the `SendPtr`, not its field).
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// Computes `p` in `chunks` chunks cut along `split`, on this thread and `threads - 1` rayon workers.
///
/// # Safety
/// As `sgemm`.
unsafe fn parallel_product(p: &Product, split: Split, chunks: usize, threads: usize) {
    // Chunks of the reduction over bytes take the rows grouped by their black (`grouped`): then each sums into a
    // partial of its own, and the threads add them into C's rows.
    // SAFETY: A's bytes are readable (the caller's contract).
    let mut grouping = if split == Split::Depth { unsafe { Grouping::of(p, MR) } } else { None };
    // Partial sums of the reduction chunks past the first (of every chunk where grouped), laid out like C with a
    // packed leading dimension.
    let mut partials = Vec::new();
    let mut part = [SendPtr(std::ptr::null_mut()); MAX_CHUNKS];
    let part_ld = if p.tc { p.m } else { p.n };
    let partial_count = if grouping.is_some() { chunks } else { chunks - 1 };
    if split == Split::Depth {
        partials = std::mem::take(&mut *PARTIALS.lock().unwrap_or_else(|e| e.into_inner()));
        if partials.len() < partial_count {
            partials.resize_with(partial_count, Buf::default);
        }
        for (ptr, buf) in part.iter_mut().zip(&mut partials).take(partial_count) {
            *ptr = SendPtr(buf.ptr(p.m * p.n));
        }
    }
    let mut gathered = [0usize; MAX_CHUNKS];
    if let Some(g) = &mut grouping {
        g.buffers(p, chunks, &mut gathered);
    }
    // Row chunks of C: balanced panels, finer where the threads meet (rows of Cᵀ: runs of whole panels).
    let rows = RowChunks::new(p.m, chunks, threads, !p.tc);
    // Reduction chunks compute partial sums: an epilogue follows their sum.
    let whole = *p;
    let p = &match split {
        Split::Depth => {
            Product { bias: std::ptr::null(), relu: false, mask: std::ptr::null(), sums: std::ptr::null_mut(), ..whole }
        }
        _ => whole,
    };
    let chunks = if split == Split::Rows { rows.len } else { chunks };
    // Chunks of rows each sum their rows' columns apart; chunks of columns write their columns' sums.
    let row_sums = if split == Split::Rows { RowSums::new(p, chunks) } else { None };
    let work = |c: usize| {
        // SAFETY: chunks write disjoint row or column ranges of C, or (reduction chunks) chunk 0 writes C and chunk
        // c its own partial buffer of m·n floats; the caller's contract covers A and B.
        unsafe {
            match split {
                Split::Rows => {
                    let (lo, hi) = rows.get(c);
                    block(p, lo, hi, 0, p.n, 0, p.k, p.c, p.ldc, p.accumulate);
                    if let Some(sums) = &row_sums {
                        sums.chunk(p, c, lo, hi);
                    }
                }
                Split::Cols => {
                    let (lo, hi) = range(p.n, NR, chunks, c);
                    block(p, 0, p.m, lo, hi, 0, p.k, p.c, p.ldc, p.accumulate);
                    if !p.sums.is_null() {
                        sums::column_sums(p.c, p.ldc, (0, p.m), (lo, hi), p.sums);
                    }
                }
                Split::Depth => {
                    let (lo, hi) = range(p.k, 16, chunks, c);
                    match (&grouping, c) {
                        (Some(g), _) => {
                            let chunk = grouped::chunk(p, &g.order, (lo, hi), gathered[c] as *mut u8, part[c].0);
                            block(&chunk, 0, p.m, 0, p.n, 0, hi - lo, chunk.c, chunk.ldc, false)
                        }
                        (None, 0) => block(p, 0, p.m, 0, p.n, lo, hi, p.c, p.ldc, p.accumulate),
                        (None, _) => block(p, 0, p.m, 0, p.n, lo, hi, part[c - 1].0, part_ld, false),
                    }
                }
            }
        }
    };
    pool::run_chunks(chunks, threads - 1, &work);
    if split != Split::Depth {
        if let Some(sums) = row_sums {
            // SAFETY: every chunk is done; `sums` holds n floats (the caller's contract).
            unsafe { sums.finish(p) };
        }
        return;
    }
    let sorted = grouping.as_ref().map(|g| g.inverse.as_slice());
    if whole.epilogue() || !whole.sums.is_null() || sorted.is_some() {
        // The threads sum the partials into rows of C and finish them, each its own rows.
        let parts = threads.min(p.m);
        let row_sums = RowSums::new(&whole, parts);
        let sum = |c: usize| {
            let (lo, hi) = (p.m * c / parts, p.m * (c + 1) / parts);
            // SAFETY: AVX-512F (the caller's contract); the partials have C's shape, `part_ld` apart; the parts
            // write disjoint rows of C (never transposed: an epilogue's product keeps its orientation, and grouped
            // rows are C's), and the bias holds n floats, the mask C's rows (`sgemm`'s contract).
            unsafe {
                let mut parts = [std::ptr::null::<f32>(); MAX_CHUNKS];
                for (to, ptr) in parts.iter_mut().zip(&part[..partial_count]) {
                    *to = ptr.get();
                }
                add_and_finish(&whole, &parts[..partial_count], part_ld, sorted, lo, hi);
                if let Some(sums) = &row_sums {
                    sums.chunk(&whole, c, lo, hi);
                }
            }
        };
        pool::run_chunks(parts, threads - 1, &sum);
        if let Some(sums) = row_sums {
            // SAFETY: every part is done; `sums` holds n floats (the caller's contract).
            unsafe { sums.finish(&whole) };
        }
    } else {
        for ptr in &part[..chunks - 1] {
            // SAFETY: AVX-512F (the caller's contract); the partial has C's shape, `part_ld` apart.
            unsafe { add_into(p, ptr.0, part_ld) };
        }
    }
    let mut pool = PARTIALS.lock().unwrap_or_else(|e| e.into_inner());
    if pool.len() < partials.len() {
        *pool = partials;
    }
    Grouping::keep(grouping);
}

/// Rows `lo..hi` of C (stored row-major) += those of each partial (laid out like C, `ld` apart), then the epilogue
/// of `p`, in one pass over each row. Where the rows were `sorted` (row r of C is row `sorted[r]` of every partial),
/// C's rows are the partials' sums instead.
///
/// # Safety
/// Rows `lo..hi` of C and of each partial are in them; the bias (unless null) holds n floats, the mask (unless
/// null) C's rows, laid out as C; `sorted` (if given) holds C's rows, and `parts` one partial or more.
#[target_feature(enable = "avx512f")]
unsafe fn add_and_finish(p: &Product, parts: &[*const f32], ld: usize, sorted: Option<&[u32]>, lo: usize, hi: usize) {
    for r in lo..hi {
        // The partials' row, and the partials added to the first term: C's row, or the first partial's.
        let (from, first, rest) = match sorted {
            Some(sorted) => (sorted[r] as usize, Some(parts[0]), &parts[1..]),
            None => (r, None, parts),
        };
        for j in (0..p.n).step_by(16) {
            let lanes = tail_mask(p.n - j);
            // SAFETY: masked loads and stores of row r, columns j.., of C, of each partial's row `from`, of the bias's
            // columns and of the mask's row r (laid out as C).
            unsafe {
                let at = p.c.add(r * p.ldc + j);
                let mut v = _mm512_maskz_loadu_ps(lanes, first.map_or(at.cast_const(), |part| part.add(from * ld + j)));
                for &part in rest {
                    v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(lanes, part.add(from * ld + j)));
                }
                let at_j = |x: *const f32, i: usize| if x.is_null() { x } else { x.add(i) };
                let v = finish16(v, lanes, at_j(p.bias, j), p.relu, at_j(p.mask, r * p.ldc + j));
                _mm512_mask_storeu_ps(at, lanes, v);
            }
        }
    }
}

/// C += partial, the partial laid out like C, `ld` apart.
#[target_feature(enable = "avx512f")]
unsafe fn add_into(p: &Product, part: *const f32, ld: usize) {
    let rows = if p.tc { p.n } else { p.m };
    // SAFETY: the caller's contract.
    unsafe { add_rows(p, part, ld, 0, rows) }
}

/// Stored rows `lo..hi` of C += those of the partial, laid out like C, `ld` apart.
#[target_feature(enable = "avx512f")]
unsafe fn add_rows(p: &Product, part: *const f32, ld: usize, lo: usize, hi: usize) {
    let len = if p.tc { p.m } else { p.n };
    for r in lo..hi {
        // SAFETY: row r of C holds `len` elements at c + r·ldc, the partial's at part + r·ld.
        unsafe {
            let (c, s) = (p.c.add(r * p.ldc), part.add(r * ld));
            for j in (0..len).step_by(16) {
                let mask = tail_mask(len - j);
                let v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, c.add(j)), _mm512_maskz_loadu_ps(mask, s.add(j)));
                _mm512_mask_storeu_ps(c.add(j), mask, v);
            }
        }
    }
}

/// Rows `i0..i1` and columns `j0..j1` of the product over the reduction range `p0..p1`, written to `c` (laid out as
/// the product's C, `ldc` apart): overwriting it unless `accumulate`.
///
/// # Safety
/// As `sgemm`, and `c` covers the rows and columns.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
unsafe fn block(
    p: &Product,
    i0: usize,
    i1: usize,
    j0: usize,
    j1: usize,
    p0: usize,
    p1: usize,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    if i0 >= i1 || j0 >= j1 {
        return;
    }
    let depth = p1 - p0;
    if depth == 0 {
        if !accumulate {
            for i in i0..i1 {
                for j in j0..j1 {
                    // SAFETY: (i, j) is in the block.
                    unsafe { *c.add(if p.tc { j * ldc + i } else { i * ldc + j }) = 0.0 };
                }
            }
        }
        return;
    }
    let mut packs = PACK.take();
    // Equal blocks of the reduction, no deeper than KC; equal blocks of whole panels, no wider than NC.
    let k_blocks = depth.div_ceil(KC);
    let kc_max = depth.div_ceil(k_blocks);
    let n_panels = (j1 - j0).div_ceil(NR);
    let n_blocks = n_panels.div_ceil(NC / NR);
    let nc_max = n_panels.div_ceil(n_blocks) * NR;
    // Balanced row panels: ⌈rows/12⌉ of them, heights differing by at most one.
    let rows = i1 - i0;
    let panels = rows.div_ceil(MR);
    let (base, extra) = (rows / panels, rows % panels);
    // A stored transposed or as bytes is packed a group of panels at a time, each panel with 16 floats of slack
    // for the full-width stores of `pack_a`.
    // Bytes stored row-major are converted into rows of floats, `a_ld` apart, for the kernels that read A in place.
    let packs_a = p.packs_a();
    let group = if packs_a { panels.min(MC / MR) } else { panels };
    let a_ld = kc_max.next_multiple_of(16);
    let a_stride = if p.ta { MR * kc_max + 16 } else { MR * a_ld };
    let a_pack = packs.a.ptr(if packs_a { group * a_stride } else { 0 });
    // Not `map(Convert::new)`: a function with target features is not a closure.
    #[allow(clippy::manual_map)]
    let convert = match p.bytes {
        Some(scale) => Some(Convert::new(scale)),
        None => None,
    };
    // Panels of bytes leave out their all-zero steps (pixels that are black in every image of a panel).
    let select = !p.tb && convert.is_some_and(|c| c.zero_is_zero());
    let steps_stride = kc_max + 16;
    if select {
        packs.finite.start(p);
        packs.steps.resize(group * steps_stride, 0);
    }
    let mut kept = [0usize; MC / MR];
    if packs.b.floats() < kc_max * nc_max {
        packs.b_holds = None;
    }
    let b_pack = packs.b.ptr(kc_max * nc_max);
    let kernels = |skip: bool| {
        (&KERNELS[usize::from(skip)][1][usize::from(!p.ta)], &KERNELS[usize::from(skip)][0][usize::from(!p.ta)])
    };
    for nb in 0..n_blocks {
        let jc = j0 + n_panels * nb / n_blocks * NR;
        let nc = (j0 + n_panels * (nb + 1) / n_blocks * NR).min(j1) - jc;
        // Columns jc..jc+in_place are read from B as stored, the rest from packed panels.
        let in_place = if p.b_in_place() { nc - nc % NR } else { 0 };
        for kb in 0..k_blocks {
            let pc = p0 + depth * kb / k_blocks;
            let kc = p0 + depth * (kb + 1) / k_blocks - pc;
            let overwrite = kb == 0 && !accumulate;
            if in_place < nc && packs.b_holds != Some((p.id, pc, kc, jc, nc)) {
                // SAFETY: the packed block holds ⌈nc/32⌉ panels of kc·32 floats ≤ kc_max·nc_max.
                unsafe { pack_b(p, pc, kc, jc + in_place, nc - in_place, b_pack.add(in_place * kc)) };
                packs.b_holds = Some((p.id, pc, kc, jc, nc));
            }
            for g0 in (0..panels).step_by(group) {
                let g1 = (g0 + group).min(panels);
                // SAFETY: panels g0..g1 of at most 12 rows and kc ≤ kc_max steps fit a_stride each.
                unsafe {
                    match convert {
                        Some(convert) => {
                            let selection = select.then_some(Selection {
                                steps: packs.steps.as_mut_ptr(),
                                stride: steps_stride,
                                kept: &mut kept,
                                finite: &mut packs.finite,
                            });
                            let a = (a_pack, a_stride, a_ld);
                            pack_a_bytes(p, convert, pc, kc, i0, (base, extra), (g0, g1), a, selection)
                        }
                        None if p.ta => pack_a(p, pc, kc, i0, (base, extra), (g0, g1), a_pack, a_stride),
                        None => {}
                    }
                }
                for g in g0..g1 {
                    let (i, mr) = (i0 + g * base + g.min(extra), base + usize::from(g < extra));
                    // SAFETY: the kernels read mr rows × kc steps of A (packed, or in place from row i, step pc)
                    // and kc steps of a B panel (in place from step pc, column jc + jr, or packed), and write rows
                    // i..i+mr, columns jc+jr..jc+jr+nr of the block.
                    unsafe {
                        let (a, lda) = if p.ta {
                            (a_pack.add((g - g0) * a_stride).cast_const(), mr)
                        } else if packs_a {
                            (a_pack.add((g - g0) * a_stride).cast_const(), a_ld)
                        } else {
                            (p.a.add(i * p.lda + pc), p.lda)
                        };
                        // A panel that leaves out steps reads B's through its selection.
                        let (steps, kc_a) = match select && kept[g - g0] < kc {
                            true => (packs.steps.as_ptr().add((g - g0) * steps_stride), kept[g - g0]),
                            false => (std::ptr::null(), kc),
                        };
                        let (wide, narrow) = kernels(!steps.is_null());
                        for jr in (0..nc).step_by(NR) {
                            let nr = (nc - jr).min(NR);
                            let kernel = if nr > 16 { wide[mr - 1] } else { narrow[mr - 1] };
                            let (b, ldb) = if jr < in_place {
                                (p.b.add(pc * p.ldb + jc + jr), p.ldb)
                            } else {
                                (b_pack.add(jr * kc).cast_const(), NR)
                            };
                            let tile = if p.tc { c.add((jc + jr) * ldc + i) } else { c.add(i * ldc + jc + jr) };
                            // The tile's sum is complete in the last block (an epilogue's product is neither
                            // transposed nor cut along its reduction): the kernel finishes it in registers.
                            let epilogue = (kb + 1 == k_blocks && p.epilogue()).then(|| {
                                let bias = if p.bias.is_null() { p.bias } else { p.bias.add(jc + jr) };
                                let mask = if p.mask.is_null() { p.mask } else { p.mask.add(i * ldc + jc + jr) };
                                (bias, p.relu, mask)
                            });
                            kernel(kc_a, a, lda, b, ldb, steps, tile, ldc, nr, p.tc, overwrite, p.alpha, epilogue);
                        }
                    }
                }
            }
        }
    }
    PACK.set(packs);
}

/// C of `product` (given where C is) computed by `sgemm` on one thread, once checked that two threads splitting it
/// write the same bits (the AVX-512 and AVX2 kernels' tests of their splits).
#[cfg(test)]
pub(crate) fn split_writes_the_same_bits(
    sgemm: unsafe fn(Product, bool),
    what: &str,
    len: usize,
    product: impl Fn(*mut f32) -> Product,
) -> Vec<f32> {
    let two = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("a pool of two threads");
    let (mut one, mut split) = (vec![f32::NAN; len], vec![f32::NAN; len]);
    // SAFETY: the callers checked that the CPU has what `sgemm` needs; `product` addresses its operands and `len`
    // floats of C.
    unsafe { sgemm(product(one.as_mut_ptr()), false) };
    let split_product = product(split.as_mut_ptr());
    // SAFETY: as above.
    two.install(|| unsafe { sgemm(split_product, true) });
    let differ = one.iter().zip(&split).position(|(x, y)| x.to_bits() != y.to_bits());
    assert_eq!(differ, None, "{what}: split between two threads, the product differs from one thread's");
    one
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A product of these dimensions and layouts, its operands null (for `plan` and `cost`).
    pub(crate) fn product(m: usize, n: usize, k: usize, ta: bool, tb: bool) -> Product {
        let (a, b, c) = (std::ptr::null(), std::ptr::null(), std::ptr::null_mut());
        let (lda, ldb) = (if ta { m } else { k }, if tb { k } else { n });
        Product {
            m,
            n,
            k,
            a,
            lda,
            ta,
            b,
            ldb,
            tb,
            c,
            ldc: n,
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
        }
    }

    /// A wide C from a short reduction under a mask, split between two threads (`WIDE_C_MIN`), is the same to the
    /// bit as one thread's, and right.
    #[test]
    fn wide_short_products_split_to_the_same_bits() {
        if !is_x86_feature_detected!("avx512f") {
            crate::skip::skip(crate::skip::Need::Avx512, "this CPU has no AVX-512F");
            return;
        }
        let mut rng = fastrand::Rng::with_seed(7);
        // The mlp's last input gradient (Bᵀ stored, under the relu's mask), and an odd one.
        for (m, n, k) in [(128, 256, 10), (131, 200, 12)] {
            let a: Vec<f32> = (0..m * k).map(|_| rng.f32() - 0.5).collect();
            let b: Vec<f32> = (0..k * n).map(|_| rng.f32() - 0.5).collect();
            let mask: Vec<f32> = (0..m * n).map(|_| rng.f32() - 0.3).collect();
            let product = |c: *mut f32| Product {
                a: a.as_ptr(),
                b: b.as_ptr(),
                c,
                mask: mask.as_ptr(),
                sums: std::ptr::null_mut(),
                ..product(m, n, k, false, true)
            };
            assert!(plan(&product(std::ptr::null_mut()), 2, false).is_some(), "{m}×{n}×{k} is split");
            let one = split_writes_the_same_bits(sgemm, &format!("{m}×{n}×{k}, a wide C"), m * n, product);
            for (i, j) in [(0, 0), (m - 1, n - 1), (m / 2, n / 3)] {
                let sum: f64 = (0..k).map(|q| f64::from(a[i * k + q]) * f64::from(b[j * k + q])).sum();
                let want = if mask[i * n + j] > 0.0 { sum } else { 0.0 };
                assert!((f64::from(one[i * n + j]) - want).abs() <= 1e-5, "{m}×{n}×{k} at {i}, {j}");
            }
        }
    }

    /// Row chunks cover the rows once, in order, never empty; the runs from either end hold whole panels, and the
    /// middle `2·threads` panels come in halves; without `fine`, runs of whole panels as `plan` counted them.
    #[test]
    fn row_chunks_are_finer_where_the_threads_meet() {
        for (m, chunks, threads) in [(128, 8, 2), (784, 8, 2), (256, 8, 2), (7, 2, 2), (1, 2, 2), (43264, 64, 64)] {
            for fine in [true, false] {
                let split = RowChunks::new(m, chunks, threads, fine);
                let (first, last) = (split.get(0).0, split.get(split.len - 1).1);
                assert_eq!((first, last), (0, m), "{m} rows in {chunks}, fine {fine}");
                for c in 0..split.len {
                    let (lo, hi) = split.get(c);
                    assert!(lo < hi && hi <= m, "{m} rows in {chunks}, fine {fine}: chunk {c} is {lo}..{hi}");
                }
                if !fine {
                    assert_eq!(split.len, chunks.min(m.div_ceil(MR)), "{m} rows in {chunks}");
                }
            }
        }
        // The mlp's first layer: 11 panels (7 of 12 rows, 4 of 11); 3 from the front, 4 halved, 4 from the back.
        let split = RowChunks::new(128, 8, 2, true);
        let sizes: Vec<usize> = (0..split.len).map(|c| split.get(c).1 - split.get(c).0).collect();
        assert_eq!(sizes, [12, 12, 12, 6, 6, 6, 6, 6, 6, 6, 6, 11, 11, 11, 11], "{sizes:?}");
        // The first layer's weight gradient, 784 rows in 66 panels: runs of 8 panels at the ends.
        let split = RowChunks::new(784, 8, 2, true);
        assert_eq!(split.get(0), (0, 96));
        assert_eq!(split.len, 4 + 8 + 4);
    }

    /// The mlp's first layer (bytes, with a bias and relu) is split along its reduction, one chunk per thread, where
    /// its weights are rewritten between calls (a training step), by rows where they are not (inference).
    #[test]
    fn products_of_bytes_times_a_rewritten_b_are_split_along_the_reduction() {
        let layer = |b_rewritten| Product {
            bytes: Some(ByteScale::Div(255.0)),
            relu: true,
            b_rewritten,
            ..product(128, 256, 784, false, false)
        };
        assert_eq!(plan(&layer(true), 2, false), Some((Split::Depth, 2)));
        assert_eq!(plan(&layer(true), 4, false), Some((Split::Depth, 4)));
        assert_eq!(plan(&layer(false), 2, false).map(|(split, _)| split), Some(Split::Rows));
    }

    /// Images grouped by their black give the same bits as in their order (`grouped`), on the AVX-512 kernels.
    #[test]
    fn products_of_bytes_grouped_by_their_black_give_the_same_bits() {
        if !is_x86_feature_detected!("avx512f") {
            crate::skip::skip(crate::skip::Need::Avx512, "this CPU has no AVX-512F");
            return;
        }
        let splits = |p: &Product, threads| plan(p, threads, false) == Some((Split::Depth, threads));
        crate::grouped::tests::give_the_same_bits(sgemm, MR, splits);
    }

    /// A dense layer of floats whose weights no step rewrites (the mlp's second layer at inference) is split by rows,
    /// as the layer before it, where the estimate would split it by columns; a training step's (its weights
    /// rewritten), one without an epilogue, and one whose B is packed keep the estimate's split.
    #[test]
    fn inference_layers_keep_their_rows() {
        let layer = |b_rewritten, relu| Product { relu, b_rewritten, ..product(128, 256, 256, false, false) };
        assert_eq!(plan(&layer(false, true), 2, false).map(|(split, _)| split), Some(Split::Rows));
        assert_eq!(plan(&layer(true, true), 2, false).map(|(split, _)| split), Some(Split::Cols));
        assert_eq!(plan(&layer(false, false), 2, false).map(|(split, _)| split), Some(Split::Cols));
        let packed = Product { relu: true, ..product(300, 256, 256, false, false) };
        assert!(!packed.b_in_place());
        assert_ne!(plan(&packed, 2, false).map(|(split, _)| split), None);
        assert!(!keeps_rows(&packed));
        // Too little work to share: one thread.
        assert_eq!(plan(&Product { relu: true, ..product(24, 64, 64, false, false) }, 2, false), None);
    }

    /// The orientation and the split of the shapes the parallel tests in tests/sgemm.rs rely on to cover each.
    #[test]
    fn plans() {
        let oriented = |p: Product| if cost(&p.transposed()) < 0.95 * cost(&p) { p.transposed() } else { p };
        for (m, n, k, ta, tb, tc, threads, want) in [
            (128, 256, 256, false, false, false, 1, None),
            (128, 10, 256, false, false, false, 2, None),
            (256, 10, 128, true, false, true, 2, None),
            (784, 256, 128, true, false, false, 2, Some(Split::Rows)),
            (128, 256, 256, false, true, false, 2, Some(Split::Cols)),
            (32, 32, 6000, false, false, false, 2, Some(Split::Depth)),
            (288, 64, 7744, true, false, true, 2, Some(Split::Depth)),
            (1600, 64, 64, true, false, true, 2, Some(Split::Cols)),
            // A wide C from a short reduction: one thread by the cost of its multiply-adds, split all the same, and
            // by rows where the estimate has columns (`SHORT_REDUCTION`).
            (128, 256, 10, false, true, false, 2, Some(Split::Rows)),
            (128, 256, 10, false, true, false, 1, None),
        ] {
            let p = oriented(product(m, n, k, ta, tb));
            assert_eq!(p.tc, tc, "{m}×{n}×{k}");
            assert_eq!(plan(&p, threads, false).map(|(split, _)| split), want, "{m}×{n}×{k}");
        }
        // The mlp's last weight update (Cᵀ 10×256 from 128 steps, ~4 µs): one thread, but shared by columns of Cᵀ
        // (rows of the update) when the workers spin; one of ~1 µs stays on one thread either way.
        let update = oriented(product(256, 10, 128, true, false));
        assert_eq!(plan(&update, 2, true).map(|(split, _)| split), Some(Split::Cols));
        assert_eq!(plan(&update, 1, true), None);
        assert_eq!(plan(&Product { relu: true, ..product(24, 64, 64, false, false) }, 2, true), None);
    }
}
