//! AVX-512 single-precision GEMM: packed panels, a 12×32 register-blocked microkernel, 1..=n threads.
//!
//! Layout of the work (BLIS order, tuned for the small products of dfc's models, where every operand fits in
//! the 2 MiB L2):
//! - `jc` over blocks of `NC` columns, `pc` over blocks of `kc ≤ KC` of the reduction: B's kc×nc block is packed
//!   into 32-column panels (`kc·32` floats, k-major) that stay in L2;
//! - `ic` over panels of at most `MR = 12` rows of A, packed just in time (`kc·mr` floats, k-major) so the panel
//!   sits in L1 while the microkernel walks every B panel of the block (`jr`).
//!
//! The microkernel holds a 12×32 tile of C in 24 zmm accumulators and per k step loads two B vectors and
//! broadcasts 12 A values (folded into the FMAs as `{1to16}` memory operands): 24 FMAs against 14 loads, so the
//! two FMA ports, not the load ports, bound it. Row panels are balanced (`m` rows split into ⌈m/12⌉ panels of
//! nearly equal height) so no product ends on a nearly empty panel; columns past `n` are padded with zeros in the
//! packed B and masked off when C is written.
//!
//! A product whose `n` is small (n = 10: the logits of a classifier) would waste most of every 32-column panel, so
//! it is computed transposed, `Cᵀ = Bᵀ·Aᵀ`, which packs the same data with the roles swapped and writes the tile
//! of Cᵀ through an in-register transpose.

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::Cell;
use std::sync::Mutex;

/// Rows of the microkernel tile.
const MR: usize = 12;
/// Columns of the microkernel tile: two zmm vectors.
const NR: usize = 32;
/// Depth of a packed block. A 12-row A panel of 384 steps is 18 KiB, half of L1; a 384×288 B block is 432 KiB of
/// L2. Longer reductions are cut into equal blocks no deeper than this.
const KC: usize = 384;
/// Columns of a packed B block (at KC deep: 768 KiB, so that it stays in L2 while A's panels stream past).
const NC: usize = 512;
/// Rows of A packed at once when A is stored transposed (its rows are then read in order, 1 KiB at a time).
const MC: usize = 288;

/// One 64-byte line, the unit of the packing buffers, so that packed B panels are aligned for `vmovaps`.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; 16]);

/// A growable, 64-byte aligned scratch buffer.
#[derive(Default)]
struct Buf(Vec<Line>);

impl Buf {
    fn ptr(&mut self, floats: usize) -> *mut f32 {
        let lines = floats.div_ceil(16);
        if self.0.len() < lines {
            self.0 = vec![Line([0.0; 16]); lines];
        }
        self.0.as_mut_ptr().cast()
    }
}

thread_local! {
    /// Packing buffers of this thread (A panel, B block), taken out while a product runs so that a product
    /// nested on the same thread (rayon may run another job while this one waits) only allocates its own.
    static PACK: Cell<(Buf, Buf)> = Cell::new((Buf::default(), Buf::default()));
}

/// Partial sums of the threads that split the reduction dimension, reused across calls.
static PARTIALS: Mutex<Vec<Buf>> = Mutex::new(Vec::new());

/// A product `C = op(A)·op(B)` (or `C += …`) over raw pointers.
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
}

// SAFETY: a `Product` is only shared between the threads of one `sgemm` call, which write disjoint parts of C
// (or their own partial buffers) and read A and B.
unsafe impl Send for Product {}
unsafe impl Sync for Product {}

impl Product {
    /// The same product computed as `Cᵀ = Bᵀ·Aᵀ`.
    fn transposed(self) -> Product {
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
            ..self
        }
    }
}

/// Fraction of the FMA lanes of the tiles covering `n` columns that do useful work.
fn lane_use(n: usize) -> f64 {
    n as f64 / n.next_multiple_of(NR) as f64
}

/// Whether `parallel` work of `flops` is worth splitting across threads: waking rayon's workers and
/// duplicating the packing costs a few microseconds.
const PARALLEL_FLOPS: usize = 1 << 21;

/// Computes the product.
///
/// # Safety
/// The CPU must support AVX-512F, and every element of A, B and C the product addresses must be in bounds
/// (`sgemm`'s asserts).
pub(crate) unsafe fn sgemm(p: Product, parallel: bool) {
    let p = if lane_use(p.n) + 0.05 < lane_use(p.m) { p.transposed() } else { p };
    let flops = 2 * p.m * p.n * p.k;
    let threads = if parallel && flops >= PARALLEL_FLOPS { rayon::current_num_threads() } else { 1 };
    if threads <= 1 {
        // SAFETY: the caller's contract.
        unsafe { block(&p, 0, p.m, 0, p.n, 0, p.k, p.c, p.ldc, p.accumulate) };
        return;
    }
    parallel_product(&p, threads);
}

/// How the threads share a product.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Split {
    Rows,
    Cols,
    Depth,
}

/// Chooses how `threads` threads share `p`: each thread packs whole the operand its split does not cut (B for
/// rows, A for columns), or, cutting the reduction, sums a private copy of C at the end. Take the cheapest extra,
/// as long as each thread keeps enough rows (two 12-row panels) or 32-column panels to stay efficient.
fn choose_split(p: &Product, threads: usize) -> Split {
    let (m, n, k) = (p.m, p.n, p.k);
    let mut best = (f64::INFINITY, Split::Rows);
    let mut consider = |cost: f64, s: Split| {
        if cost < best.0 {
            best = (cost, s);
        }
    };
    let n_panels = n.div_ceil(NR);
    if m >= threads * 2 * MR {
        // Every thread packs all of B; rows split in balanced panels.
        consider((k * n) as f64, Split::Rows);
    }
    if n_panels >= threads {
        // Every thread packs all of A; whole panels per thread, so the busiest thread gets ⌈panels/threads⌉.
        let imbalance = (n_panels.div_ceil(threads) * threads) as f64 / n_panels as f64 - 1.0;
        consider((m * k) as f64 + imbalance * (m * n * k) as f64 / 8.0, Split::Cols);
    }
    if k >= threads * 128 {
        // A partial C per extra thread, summed at the end (three passes over C: write, read, add).
        consider((3 * m * n * (threads - 1)) as f64 + (m * n) as f64 * 2.0, Split::Depth);
    }
    best.1
}

/// Splits `0..len` in `parts` nearly equal ranges, multiples of `unit` except the last.
fn range(len: usize, unit: usize, parts: usize, t: usize) -> (usize, usize) {
    let units = len.div_ceil(unit);
    let lo = units * t / parts * unit;
    let hi = (units * (t + 1) / parts * unit).min(len);
    (lo.min(len), hi)
}

fn parallel_product(p: &Product, threads: usize) {
    let split = choose_split(p, threads);
    let threads = match split {
        Split::Rows => threads.min(p.m / (2 * MR)),
        Split::Cols => threads.min(p.n.div_ceil(NR)),
        Split::Depth => threads.min(p.k / 128),
    }
    .max(1);
    let mn = p.m * p.n;
    let mut partials = if split == Split::Depth {
        let mut pool = PARTIALS.lock().unwrap_or_else(|e| e.into_inner());
        let mut v: Vec<Buf> = (1..threads).map(|_| pool.pop().unwrap_or_default()).collect();
        for b in &mut v {
            b.ptr(mn);
        }
        v
    } else {
        Vec::new()
    };
    let partial_ptrs: Vec<SendPtr> =
        partials.iter_mut().map(|b| SendPtr(b.ptr(mn))).collect::<Vec<_>>();
    let work = |t: usize| {
        // SAFETY: the threads write disjoint row or column ranges of C, or (depth split) thread 0 writes C and
        // thread t its own partial buffer of m·n floats; the caller's contract covers A and B.
        unsafe {
            match split {
                Split::Rows => {
                    // Balanced in panels: a thread's rows are a multiple of its panel count.
                    let (lo, hi) = range(p.m, 1, threads, t);
                    block(p, lo, hi, 0, p.n, 0, p.k, p.c, p.ldc, p.accumulate)
                }
                Split::Cols => {
                    let (lo, hi) = range(p.n, NR, threads, t);
                    block(p, 0, p.m, lo, hi, 0, p.k, p.c, p.ldc, p.accumulate)
                }
                Split::Depth => {
                    let (lo, hi) = range(p.k, 16, threads, t);
                    if t == 0 {
                        block(p, 0, p.m, 0, p.n, lo, hi, p.c, p.ldc, p.accumulate)
                    } else {
                        // The partial is laid out like C (transposed or not) with a packed leading dimension.
                        let ld = if p.tc { p.m } else { p.n };
                        block(p, 0, p.m, 0, p.n, lo, hi, partial_ptrs[t - 1].0, ld, false)
                    }
                }
            }
        }
    };
    fork(threads, &work);
    if split == Split::Depth {
        for part in &partial_ptrs {
            // SAFETY: C and the partial share the layout; rows (columns when transposed) of length `inner`.
            unsafe { add_into(p, part.0) };
        }
        let mut pool = PARTIALS.lock().unwrap_or_else(|e| e.into_inner());
        pool.append(&mut partials);
    }
}

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: see `Product`.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

/// Runs `work(t)` for t in 0..threads: t = 0 on this thread, the others spawned on rayon's pool (a single hand-off,
/// where `rayon::join` from outside the pool would also park this thread and wake two workers).
fn fork(threads: usize, work: &(impl Fn(usize) + Sync)) {
    rayon::in_place_scope(|scope| {
        for t in 1..threads {
            scope.spawn(move |_| work(t));
        }
        work(0);
    });
}

/// C += partial, where the partial has C's layout with a packed leading dimension.
#[target_feature(enable = "avx512f")]
unsafe fn add_into(p: &Product, part: *const f32) {
    let (rows, inner) = if p.tc { (p.n, p.m) } else { (p.m, p.n) };
    for r in 0..rows {
        // SAFETY: row r of C has `inner` elements at c + r·ldc; the partial's at part + r·inner.
        unsafe {
            let c = p.c.add(r * p.ldc);
            let s = part.add(r * inner);
            let mut j = 0;
            while j < inner {
                let mask = tail_mask(inner - j);
                let v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, c.add(j)), _mm512_maskz_loadu_ps(mask, s.add(j)));
                _mm512_mask_storeu_ps(c.add(j), mask, v);
                j += 16;
            }
        }
    }
}

/// Lanes 0..min(len, 16).
#[inline(always)]
fn tail_mask(len: usize) -> __mmask16 {
    if len >= 16 {
        0xffff
    } else {
        ((1u32 << len) - 1) as __mmask16
    }
}

/// The rows `i0..i1`, columns `j0..j1` of the product, over the reduction range `p0..p1`, written to `c` (laid out
/// as the product's C, leading dimension `ldc`) — overwriting it unless `accumulate`.
///
/// # Safety
/// As `sgemm`; `c` must cover the addressed part of the tile.
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
                    // SAFETY: (i, j) is in the tile.
                    unsafe { *c.add(if p.tc { j * ldc + i } else { i * ldc + j }) = 0.0 };
                }
            }
        }
        return;
    }
    let (mut a_buf, mut b_buf) = PACK.take();
    // Equal blocks of the reduction no deeper than KC, equal blocks of whole panels no wider than NC.
    let k_blocks = depth.div_ceil(KC);
    let kc_max = depth.div_ceil(k_blocks);
    let n_panels = (j1 - j0).div_ceil(NR);
    let n_blocks = n_panels.div_ceil(NC / NR);
    let nc_max = n_panels.div_ceil(n_blocks) * NR;
    // Balanced row panels: ⌈rows/12⌉ panels, heights differing by at most one.
    let rows = i1 - i0;
    let panels = rows.div_ceil(MR);
    let (base, extra) = (rows / panels, rows % panels);
    let panel_rows = |panel: usize| base + usize::from(panel < extra);
    let panel_start = |panel: usize| i0 + panel * base + panel.min(extra);
    // A is packed (only when stored transposed) a group of panels at a time; each packed panel keeps 16 floats of
    // slack for the full-width stores of `pack_a`.
    let group = if p.ta { panels.min(MC / MR) } else { panels };
    let a_stride = MR * kc_max + 16;
    let a_pack = a_buf.ptr(if p.ta { group * a_stride } else { 0 });
    let b_pack = b_buf.ptr(kc_max * nc_max);
    for nb in 0..n_blocks {
        let jc = j0 + n_panels * nb / n_blocks * NR;
        let jc_end = (j0 + n_panels * (nb + 1) / n_blocks * NR).min(j1);
        let nc = jc_end - jc;
        for kb in 0..k_blocks {
            let pc = p0 + depth * kb / k_blocks;
            let kc = p0 + depth * (kb + 1) / k_blocks - pc;
            let overwrite = kb == 0 && !accumulate;
            // SAFETY: the packed block holds ⌈nc/32⌉ panels of kc·32 floats ≤ kc_max·nc_max.
            unsafe { pack_b(p, pc, kc, jc, nc, b_pack) };
            for g0 in (0..panels).step_by(group) {
                let g1 = (g0 + group).min(panels);
                if p.ta {
                    // SAFETY: panels g0..g1 of rows ≤ 12 and kc ≤ kc_max steps fit a_stride each.
                    unsafe { pack_a(p, pc, kc, (g0..g1).map(|g| (panel_start(g), panel_rows(g))), a_pack, a_stride) };
                }
                for panel in g0..g1 {
                    let (i, mr) = (panel_start(panel), panel_rows(panel));
                    // SAFETY: the kernel reads mr rows × kc steps of A (packed, or in place at row i, column pc)
                    // and one packed B panel, and writes rows i..i+mr, columns jc+jr..jc+jr+nr of the tile.
                    unsafe {
                        let (a, lda) = if p.ta {
                            (a_pack.add((panel - g0) * a_stride).cast_const(), mr)
                        } else {
                            (p.a.add(i * p.lda + pc), p.lda)
                        };
                        let kernel = KERNELS[usize::from(!p.ta)][mr - 1];
                        for jr in (0..nc).step_by(NR) {
                            let nr = (nc - jr).min(NR);
                            let tile = if p.tc { c.add((jc + jr) * ldc + i) } else { c.add(i * ldc + jc + jr) };
                            kernel(kc, a, lda, b_pack.add(jr * kc), tile, ldc, nr, p.tc, overwrite);
                        }
                    }
                }
            }
        }
    }
    PACK.set((a_buf, b_buf));
}

/// Packs, for each `(i, mr)` of `panels`, rows `i..i+mr` of a transposed-stored A over the reduction range
/// `pc..pc+kc` to `dst[g·stride + q·mr + r]` (g the panel's index in the list). Step q of every panel comes from
/// the same stored row, so the rows of A are read in order.
#[target_feature(enable = "avx512f")]
unsafe fn pack_a(
    p: &Product,
    pc: usize,
    kc: usize,
    panels: impl Iterator<Item = (usize, usize)> + Clone,
    dst: *mut f32,
    stride: usize,
) {
    for q in 0..kc {
        // SAFETY: masked loads read only mr elements of row pc+q of the stored A; each full-width store writes
        // 16 floats at q·mr of its panel, within the panel's mr·kc + 16 floats.
        unsafe {
            let src = p.a.add((pc + q) * p.lda);
            for (g, (i, mr)) in panels.clone().enumerate() {
                let v = _mm512_maskz_loadu_ps(tail_mask(mr), src.add(i));
                _mm512_storeu_ps(dst.add(g * stride + q * mr), v);
            }
        }
    }
}

/// Packs columns `j..j+nc` of B over the reduction range `pc..pc+kc` in panels of 32 columns: column `jr + c` of
/// step q to `dst[jr·kc + q·32 + c]`, zero past nc.
#[target_feature(enable = "avx512f")]
unsafe fn pack_b(p: &Product, pc: usize, kc: usize, j: usize, nc: usize, dst: *mut f32) {
    // SAFETY (both arms): loads touch only elements of columns j..j+nc, steps pc..pc+kc of B (masked at the
    // edge); dst holds ⌈nc/32⌉ panels of kc·32 floats, 64-byte aligned.
    unsafe {
        if !p.tb {
            // Row by row, so B is read in order.
            for q in 0..kc {
                let src = p.b.add((pc + q) * p.ldb + j);
                for jr in (0..nc).step_by(NR) {
                    let (v0, v1) = if nc - jr >= NR {
                        (_mm512_loadu_ps(src.add(jr)), _mm512_loadu_ps(src.add(jr + 16)))
                    } else {
                        let nr = nc - jr;
                        (
                            _mm512_maskz_loadu_ps(tail_mask(nr), src.add(jr)),
                            _mm512_maskz_loadu_ps(tail_mask(nr.saturating_sub(16)), src.add(jr + 16)),
                        )
                    };
                    let d = dst.add(jr * kc + q * NR);
                    _mm512_store_ps(d, v0);
                    _mm512_store_ps(d.add(16), v1);
                }
            }
        } else {
            // Bᵀ stored: transpose 16 columns × 16 steps at a time.
            for jr in (0..nc).step_by(NR) {
                let nr = (nc - jr).min(NR);
                for half in 0..2 {
                    let cols = nr.saturating_sub(16 * half).min(16);
                    let mut rows = [_mm512_setzero_ps(); 16];
                    for q in (0..kc).step_by(16) {
                        let w = (kc - q).min(16);
                        let lanes = tail_mask(w);
                        for (r, row) in rows.iter_mut().enumerate().take(cols) {
                            *row = _mm512_maskz_loadu_ps(lanes, p.b.add((j + jr + 16 * half + r) * p.ldb + pc + q));
                        }
                        let t = transpose16(rows);
                        for (s, v) in t.iter().enumerate().take(w) {
                            _mm512_store_ps(dst.add(jr * kc + (q + s) * NR + 16 * half), *v);
                        }
                    }
                }
            }
        }
    }
}

/// Transposes a 16×16 block held as 16 rows.
#[inline]
#[target_feature(enable = "avx512f")]
fn transpose16(r: [__m512; 16]) -> [__m512; 16] {
    // 32-bit, then 64-bit interleaves within 128-bit lanes: b[4g + q] holds, in its lane l, column 4l + q of
    // rows 4g..4g+4.
    let mut a = [_mm512_setzero_ps(); 16];
    for i in 0..8 {
        a[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    let mut b = [_mm512_setzero_ps(); 16];
    for g in 0..4 {
        let (x0, x1, x2, x3) = (
            _mm512_castps_pd(a[4 * g]),
            _mm512_castps_pd(a[4 * g + 1]),
            _mm512_castps_pd(a[4 * g + 2]),
            _mm512_castps_pd(a[4 * g + 3]),
        );
        b[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(x0, x2));
        b[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(x0, x2));
        b[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(x1, x3));
        b[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(x1, x3));
    }
    // Then 128-bit lanes: gather lane l of b[q], b[4 + q], b[8 + q], b[12 + q] into column 4l + q.
    let mut out = [_mm512_setzero_ps(); 16];
    for q in 0..4 {
        let lo_even = _mm512_shuffle_f32x4::<0x88>(b[q], b[4 + q]);
        let lo_odd = _mm512_shuffle_f32x4::<0xdd>(b[q], b[4 + q]);
        let hi_even = _mm512_shuffle_f32x4::<0x88>(b[8 + q], b[12 + q]);
        let hi_odd = _mm512_shuffle_f32x4::<0xdd>(b[8 + q], b[12 + q]);
        out[q] = _mm512_shuffle_f32x4::<0x88>(lo_even, hi_even);
        out[4 + q] = _mm512_shuffle_f32x4::<0x88>(lo_odd, hi_odd);
        out[8 + q] = _mm512_shuffle_f32x4::<0xdd>(lo_even, hi_even);
        out[12 + q] = _mm512_shuffle_f32x4::<0xdd>(lo_odd, hi_odd);
    }
    out
}

type Kernel = unsafe fn(usize, *const f32, usize, *const f32, *mut f32, usize, usize, bool, bool);

/// The microkernels for each panel height 1..=12: `[packed A, A in place]`.
static KERNELS: [[Kernel; MR]; 2] = [
    [
        kernel::<1, false>,
        kernel::<2, false>,
        kernel::<3, false>,
        kernel::<4, false>,
        kernel::<5, false>,
        kernel::<6, false>,
        kernel::<7, false>,
        kernel::<8, false>,
        kernel::<9, false>,
        kernel::<10, false>,
        kernel::<11, false>,
        kernel::<12, false>,
    ],
    [
        kernel::<1, true>,
        kernel::<2, true>,
        kernel::<3, true>,
        kernel::<4, true>,
        kernel::<5, true>,
        kernel::<6, true>,
        kernel::<7, true>,
        kernel::<8, true>,
        kernel::<9, true>,
        kernel::<10, true>,
        kernel::<11, true>,
        kernel::<12, true>,
    ],
];

/// `C[R×nr] (+)= A·B` for one tile. A's element (i, q) is `a[i·lda + q]` when `IN_PLACE` (A row-major as stored:
/// broadcasting from R rows saves transposing A into panels), else `a[q·R + i]` (a packed panel). `b` is a packed
/// panel (`kc·32`, aligned). Element (i, j) of the tile is `c[i·ldc + j]`, or `c[j·ldc + i]` when `tc`.
///
/// The k loop is written as one small `asm!` block per row and step (broadcast, two FMAs): left to itself, LLVM
/// merges a row's consecutive A elements into vector loads and shuffles, and spends an address computation per
/// row; here each broadcast is one load with a constant displacement and the accumulators stay in registers.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
unsafe fn kernel<const R: usize, const IN_PLACE: bool>(
    kc: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    nr: usize,
    tc: bool,
    overwrite: bool,
) {
    // Rows past R stay zero and unused (LLVM drops them).
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    // One row of one step: acc[i] += A(i, step) · (b0, b1), A's element at `[address]`.
    macro_rules! row {
        ($i:literal, $address:literal, $($operands:tt)*) => {
            if $i < R {
                asm!(
                    concat!("vbroadcastss {t}, dword ptr [", $address, "]"),
                    "vfmadd231ps {c0}, {b0}, {t}",
                    "vfmadd231ps {c1}, {b1}, {t}",
                    $($operands)*
                    c0 = inout(zmm_reg) acc[$i][0],
                    c1 = inout(zmm_reg) acc[$i][1],
                    t = out(zmm_reg) _,
                    options(pure, readonly, nostack, preserves_flags),
                );
            }
        };
    }
    // SAFETY: A's R rows and the B panel hold kc steps; the tile's elements are in C (the caller's contract).
    unsafe {
        if !tc {
            for i in 0..R {
                _mm_prefetch::<_MM_HINT_T0>(c.add(i * ldc).cast());
                _mm_prefetch::<_MM_HINT_T0>(c.add(i * ldc + nr - 1).cast());
            }
        }
        let mut b = b;
        if IN_PLACE {
            // Rows 3g..3g+3 at base g + 0, lda, 2·lda; bases past the panel are never dereferenced.
            let ld = lda * 4;
            let (mut r0, mut r3, mut r6, mut r9) =
                (a, a.wrapping_add(3 * lda), a.wrapping_add(6 * lda), a.wrapping_add(9 * lda));
            macro_rules! step {
                ($u:literal) => {
                    let b0 = _mm512_load_ps(b.add($u * NR));
                    let b1 = _mm512_load_ps(b.add($u * NR + 16));
                    row!(0, "{r} + {d}", r = in(reg) r0, d = const $u * 4, b0 = in(zmm_reg) b0, b1 = in(zmm_reg) b1,);
                    row!(1, "{r} + {ld} + {d}", r = in(reg) r0, ld = in(reg) ld, d = const $u * 4,
                        b0 = in(zmm_reg) b0, b1 = in(zmm_reg) b1,);
                    row!(2, "{r} + {ld}*2 + {d}", r = in(reg) r0, ld = in(reg) ld, d = const $u * 4,
                        b0 = in(zmm_reg) b0, b1 = in(zmm_reg) b1,);
                    row!(3, "{r} + {d}", r = in(reg) r3, d = const $u * 4, b0 = in(zmm_reg) b0, b1 = in(zmm_reg) b1,);
                    row!(4, "{r} + {ld} + {d}", r = in(reg) r3, ld = in(reg) ld, d = const $u * 4,
                        b0 = in(zmm_reg) b0, b1 = in(zmm_reg) b1,);
                    row!(5, "{r} + {ld}*2 + {d}", r = in(reg) r3, ld = in(reg) ld, d = const $u * 4,
                        b0 = in(zmm_reg) b0, b1 = in(zmm_reg) b1,);
                    row!(6, "{r} + {d}", r = in(reg) r6, d = const $u * 4, b0 = in(zmm_reg) b0, b1 = in(zmm_reg) b1,);
                    row!(7, "{r} + {ld} + {d}", r = in(reg) r6, ld = in(reg) ld, d = const $u * 4,
                        b0 = in(zmm_reg) b0, b1 = in(zmm_reg) b1,);
                    row!(8, "{r} + {ld}*2 + {d}", r = in(reg) r6, ld = in(reg) ld, d = const $u * 4,
                        b0 = in(zmm_reg) b0, b1 = in(zmm_reg) b1,);
                    row!(9, "{r} + {d}", r = in(reg) r9, d = const $u * 4, b0 = in(zmm_reg) b0, b1 = in(zmm_reg) b1,);
                    row!(10, "{r} + {ld} + {d}", r = in(reg) r9, ld = in(reg) ld, d = const $u * 4,
                        b0 = in(zmm_reg) b0, b1 = in(zmm_reg) b1,);
                    row!(11, "{r} + {ld}*2 + {d}", r = in(reg) r9, ld = in(reg) ld, d = const $u * 4,
                        b0 = in(zmm_reg) b0, b1 = in(zmm_reg) b1,);
                };
            }
            // Unrolled by 4: the loop's pointer updates and branch would otherwise take FMA ports' issue slots.
            for _ in 0..kc / 4 {
                step!(0);
                step!(1);
                step!(2);
                step!(3);
                (r0, r3, r6, r9) = (r0.wrapping_add(4), r3.wrapping_add(4), r6.wrapping_add(4), r9.wrapping_add(4));
                b = b.add(4 * NR);
            }
            for _ in 0..kc % 4 {
                step!(0);
                (r0, r3, r6, r9) = (r0.wrapping_add(1), r3.wrapping_add(1), r6.wrapping_add(1), r9.wrapping_add(1));
                b = b.add(NR);
            }
        } else {
            let mut a = a;
            macro_rules! step {
                ($u:literal) => {
                    let b0 = _mm512_load_ps(b.add($u * NR));
                    let b1 = _mm512_load_ps(b.add($u * NR + 16));
                    row!(0, "{a} + {d}", a = in(reg) a, d = const ($u * R) * 4, b0 = in(zmm_reg) b0, b1 = in(zmm_reg) b1,);
                    row!(1, "{a} + {d}", a = in(reg) a, d = const ($u * R + 1) * 4, b0 = in(zmm_reg) b0,
                        b1 = in(zmm_reg) b1,);
                    row!(2, "{a} + {d}", a = in(reg) a, d = const ($u * R + 2) * 4, b0 = in(zmm_reg) b0,
                        b1 = in(zmm_reg) b1,);
                    row!(3, "{a} + {d}", a = in(reg) a, d = const ($u * R + 3) * 4, b0 = in(zmm_reg) b0,
                        b1 = in(zmm_reg) b1,);
                    row!(4, "{a} + {d}", a = in(reg) a, d = const ($u * R + 4) * 4, b0 = in(zmm_reg) b0,
                        b1 = in(zmm_reg) b1,);
                    row!(5, "{a} + {d}", a = in(reg) a, d = const ($u * R + 5) * 4, b0 = in(zmm_reg) b0,
                        b1 = in(zmm_reg) b1,);
                    row!(6, "{a} + {d}", a = in(reg) a, d = const ($u * R + 6) * 4, b0 = in(zmm_reg) b0,
                        b1 = in(zmm_reg) b1,);
                    row!(7, "{a} + {d}", a = in(reg) a, d = const ($u * R + 7) * 4, b0 = in(zmm_reg) b0,
                        b1 = in(zmm_reg) b1,);
                    row!(8, "{a} + {d}", a = in(reg) a, d = const ($u * R + 8) * 4, b0 = in(zmm_reg) b0,
                        b1 = in(zmm_reg) b1,);
                    row!(9, "{a} + {d}", a = in(reg) a, d = const ($u * R + 9) * 4, b0 = in(zmm_reg) b0,
                        b1 = in(zmm_reg) b1,);
                    row!(10, "{a} + {d}", a = in(reg) a, d = const ($u * R + 10) * 4, b0 = in(zmm_reg) b0,
                        b1 = in(zmm_reg) b1,);
                    row!(11, "{a} + {d}", a = in(reg) a, d = const ($u * R + 11) * 4, b0 = in(zmm_reg) b0,
                        b1 = in(zmm_reg) b1,);
                };
            }
            for _ in 0..kc / 4 {
                step!(0);
                step!(1);
                step!(2);
                step!(3);
                a = a.add(4 * R);
                b = b.add(4 * NR);
            }
            for _ in 0..kc % 4 {
                step!(0);
                a = a.add(R);
                b = b.add(NR);
            }
        }
        if !tc {
            let (m0, m1) = (tail_mask(nr), tail_mask(nr.saturating_sub(16)));
            for (i, [acc0, acc1]) in acc.iter().enumerate().take(R) {
                let row = c.add(i * ldc);
                if overwrite {
                    _mm512_mask_storeu_ps(row, m0, *acc0);
                    _mm512_mask_storeu_ps(row.add(16), m1, *acc1);
                } else {
                    let v0 = _mm512_add_ps(*acc0, _mm512_maskz_loadu_ps(m0, row));
                    let v1 = _mm512_add_ps(*acc1, _mm512_maskz_loadu_ps(m1, row.add(16)));
                    _mm512_mask_storeu_ps(row, m0, v0);
                    _mm512_mask_storeu_ps(row.add(16), m1, v1);
                }
            }
        } else {
            store_transposed::<R>(&acc, c, ldc, nr, overwrite);
        }
    }
}

/// Writes the first R rows of a 12×32 tile transposed: column j (< nr) of the tile to `c[j·ldc..+R]`.
#[inline(never)]
#[target_feature(enable = "avx512f")]
unsafe fn store_transposed<const R: usize>(acc: &[[__m512; 2]; MR], c: *mut f32, ldc: usize, nr: usize, overwrite: bool) {
    let mask = tail_mask(R);
    for half in 0..2 {
        let cols = nr.saturating_sub(16 * half).min(16);
        if cols == 0 {
            break;
        }
        let mut rows = [_mm512_setzero_ps(); 16];
        for (row, acc) in rows.iter_mut().zip(acc).take(R) {
            *row = acc[half];
        }
        let t = transpose16(rows);
        for (j, v) in t.iter().enumerate().take(cols) {
            // SAFETY: column 16·half + j < nr of the tile: R elements at c + (16·half + j)·ldc.
            unsafe {
                let dst = c.add((16 * half + j) * ldc);
                let v = if overwrite { *v } else { _mm512_add_ps(*v, _mm512_maskz_loadu_ps(mask, dst)) };
                _mm512_mask_storeu_ps(dst, mask, v);
            }
        }
    }
}

#[cfg(test)]
#[path = "probe.rs"]
mod probe;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transpose16_transposes() {
        if !is_x86_feature_detected!("avx512f") {
            return;
        }
        let src: Vec<f32> = (0..256).map(|x| x as f32).collect();
        // SAFETY: AVX-512F is available; loads and stores stay within the 256-float buffers.
        unsafe {
            let mut rows = [_mm512_setzero_ps(); 16];
            for (r, row) in rows.iter_mut().enumerate() {
                *row = _mm512_loadu_ps(src.as_ptr().add(16 * r));
            }
            let t = transpose16(rows);
            let mut out = vec![0f32; 256];
            for (r, v) in t.iter().enumerate() {
                _mm512_storeu_ps(out.as_mut_ptr().add(16 * r), *v);
            }
            for i in 0..16 {
                for j in 0..16 {
                    assert_eq!(out[16 * i + j], src[16 * j + i]);
                }
            }
        }
    }
}

