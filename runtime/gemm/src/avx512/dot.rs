//! Thin products as dot products: `C (m × n) = α·A·B` with few columns (n ≤ 16) and a long reduction, A row-major
//! (the logits of a classifier, `x·w` with w of 10 columns). The tiles of `block` would use n of each 16 lanes
//! (10 of 16 for the logreg's product); here every lane works: `C[i][j]` is the dot product of A's row i and B's
//! column j, both contiguous over the reduction (B's columns are B stored transposed, or packed so, n·k floats).
//!
//! The kernel holds a block of R = 3 rows × N (4 or 5) columns of C in 12–15 zmm accumulators, each summing 16
//! steps of the reduction at once; per 16 steps it loads R vectors of A and N of Bᵀ for R·N FMAs. (With 4 rows
//! and 5 columns LLVM spilled accumulators to the stack, and the step's time then depended on the stack's
//! alignment: 58 or 67 µs for the logreg's step, from one process to the next.) At the end each
//! accumulator's 16 lanes are added up. Rows and columns past the block's end repeat the last one, and are not
//! stored.
//!
//! CPUs with AVX2 but not AVX-512 (`sgemm_avx2`) have 16 ymm registers of 8 lanes: R = 2 rows × N columns in 8–10
//! accumulators, the rest alike.

use std::arch::x86_64::*;
use std::cell::Cell;

use super::pack::tail_mask;
use super::{Buf, Product, SendPtr};
use crate::pool;

/// The most columns of C taken this way.
const MAX_N: usize = 16;
/// The fewest reduction steps: below, the lanes of the final sums cost more than the tiles' wasted lanes.
const MIN_K: usize = 64;
/// Rows of C a kernel call computes.
const R: usize = 3;
/// Rows of C per chunk of a parallel product.
const CHUNK_ROWS: usize = 32;
/// Extra time (ns) of sharing the rows with workers that spin (`pool::workers_spinning`, a program's step): the
/// hand-off within a poll, and waiting for the last chunk. With the pool's `PARALLEL_OVERHEAD` (a parked worker
/// woken), the mlp's logits (128×256·256×10, ~5.5 µs by `cost`) ran on one thread: 12.5 µs, against 8.7 split
/// (Zen 4, in one process, alternated).
const SPINNING_OVERHEAD: f64 = 2_000.0;

thread_local! {
    /// Bᵀ packed, when B is stored row-major.
    static BT: Cell<Buf> = Cell::new(Buf::default());
}

/// Whether `p` (as oriented) can be computed as dot products.
pub(crate) fn applies(p: &Product) -> bool {
    p.n <= MAX_N && !p.ta && p.k >= MIN_K
}

/// Rough single-thread time (ns), on the scale of `super::cost`: the FMAs at full lanes (plus the columns that
/// the blocks of N repeat), the final sums, and packing Bᵀ.
pub(super) fn cost(p: &Product) -> f64 {
    let computed = p.n.div_ceil(columns(p.n)) * columns(p.n);
    let compute = 2.0 * (p.m * computed * p.k) as f64 / 170.0;
    let sums = (p.m * computed) as f64 * 1.0;
    let pack = if p.tb { 0.0 } else { (p.k * p.n) as f64 * 0.16 };
    compute + sums + pack
}

/// Columns per kernel call: 4 or 5, whichever repeats fewer.
fn columns(n: usize) -> usize {
    if n.div_ceil(5) * 5 < n.div_ceil(4) * 4 {
        5
    } else {
        4
    }
}

/// Computes `p`, which `applies`, on this thread and, when `threads` > 1 and it pays, rayon's workers.
///
/// # Safety
/// AVX-512F, and every element of A, B and C that `p` addresses is in bounds.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn sgemm(p: &Product, threads: usize) {
    // SAFETY: the caller's contract; `rows_of` needs AVX-512F, which the caller's CPU has.
    let rows = |i0, i1, bt, ldbt| unsafe { rows_of(p, i0, i1, bt, ldbt) };
    // SAFETY: the caller's contract.
    unsafe { sgemm_with(p, threads, cost(p), rows) }
}

/// `sgemm` on a CPU with AVX2 and FMA.
///
/// # Safety
/// AVX2 and FMA, and every element of A, B and C that `p` addresses is in bounds.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn sgemm_avx2(p: &Product, threads: usize) {
    // SAFETY: the caller's contract; `rows_of_avx2` needs AVX2 and FMA, which the caller's CPU has.
    let rows = |i0, i1, bt, ldbt| unsafe { rows_of_avx2(p, i0, i1, bt, ldbt) };
    // SAFETY: the caller's contract.
    unsafe { sgemm_with(p, threads, cost(p), rows) }
}

/// Packs Bᵀ where B is row-major, then `rows(i0, i1, bt, ldbt)` over C's rows, in chunks on the pool where the
/// product's `cost` pays for it.
///
/// # Safety
/// Every element of A, B and C that `p` addresses is in bounds, and `rows` computes C's rows `i0..i1` from Bᵀ.
#[inline(always)]
unsafe fn sgemm_with(p: &Product, threads: usize, cost: f64, rows: impl Fn(usize, usize, *const f32, usize) + Sync) {
    let mut packed = BT.take();
    let (bt, ldbt) = if p.tb {
        (p.b, p.ldb)
    } else {
        let dst = packed.ptr(p.n * p.k);
        // SAFETY: B's k×n elements are in bounds (the caller's contract); the buffer holds n·k floats; both callers'
        // CPUs have AVX2 (`crate::kernels` picks the AVX-512 kernels only where the CPU has AVX2 and FMA too).
        unsafe { transpose_b(p, dst) };
        (dst.cast_const(), p.k)
    };
    let chunks = p.m.div_ceil(CHUNK_ROWS);
    if shared(cost, chunks, threads, pool::workers_spinning()) {
        let bt = SendPtr(bt.cast_mut());
        let work = |c: usize| {
            // Chunks write disjoint rows of C; Bᵀ is read-only until `run_chunks` returns.
            rows(c * CHUNK_ROWS, ((c + 1) * CHUNK_ROWS).min(p.m), bt.get().cast_const(), ldbt);
        };
        pool::run_chunks(chunks, threads - 1, &work);
    } else {
        rows(0, p.m, bt, ldbt);
    }
    BT.set(packed);
}

/// Bᵀ (n rows of k) at `dst`, from B stored row-major: 8×8 blocks through registers, the last columns and steps one
/// by one. (The mlp's logits, 256×10: 2.1–2.6 µs element by element at the start of the product, on one thread.)
///
/// # Safety
/// AVX2; B's k×n elements are in bounds and `dst` holds n·k floats.
#[target_feature(enable = "avx2,fma")]
unsafe fn transpose_b(p: &Product, dst: *mut f32) {
    let (k8, n8) = (p.k / 8 * 8, p.n / 8 * 8);
    // SAFETY: every element read is B's (q < k, j < n), every one written is within n·k (the caller's contract).
    unsafe {
        for q in (0..k8).step_by(8) {
            for j in (0..n8).step_by(8) {
                let rows = std::array::from_fn(|r| _mm256_loadu_ps(p.b.add((q + r) * p.ldb + j)));
                for (i, column) in crate::avx2::transpose8(rows).into_iter().enumerate() {
                    _mm256_storeu_ps(dst.add((j + i) * p.k + q), column);
                }
            }
        }
        for j in 0..p.n {
            let from = if j < n8 { k8 } else { 0 };
            for q in from..p.k {
                *dst.add(j * p.k + q) = *p.b.add(q * p.ldb + j);
            }
        }
    }
}

/// Whether `threads` threads share the `chunks` chunks of a product that `cost` estimates: where a thread's half of
/// the work outweighs handing it over, to workers that spin (`spinning`) or that must be woken.
fn shared(cost: f64, chunks: usize, threads: usize, spinning: bool) -> bool {
    let overhead = if spinning { SPINNING_OVERHEAD } else { super::PARALLEL_OVERHEAD };
    threads > 1 && chunks > 1 && cost > 2.0 * overhead
}

/// Rows `i0..i1` of C, from Bᵀ at `bt` (n rows of k, `ldbt` apart).
///
/// # Safety
/// As `sgemm`.
#[target_feature(enable = "avx512f")]
unsafe fn rows_of(p: &Product, i0: usize, i1: usize, bt: *const f32, ldbt: usize) {
    let nc = columns(p.n);
    for i in (i0..i1).step_by(R) {
        let rows = std::array::from_fn(|r| (i + r).min(i1 - 1));
        for j in (0..p.n).step_by(nc) {
            // SAFETY: the rows and columns are in C, A and Bᵀ (repeated ones too).
            unsafe {
                if nc == 5 {
                    block::<5>(p, rows, i1 - i, j, bt, ldbt);
                } else {
                    block::<4>(p, rows, i1 - i, j, bt, ldbt);
                }
            }
        }
    }
}

/// One block: C's rows `rows` (the first `live_rows` stored) × columns `j..j + N` (those below n stored).
///
/// # Safety
/// As `sgemm`; the rows are rows of C.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn block<const N: usize>(
    p: &Product,
    rows: [usize; R],
    live_rows: usize,
    j: usize,
    bt: *const f32,
    ldbt: usize,
) {
    let cols: [usize; N] = std::array::from_fn(|c| (j + c).min(p.n - 1));
    let mut acc = [[_mm512_setzero_ps(); N]; R];
    // SAFETY: every load reads steps q..q+16 (masked to k) of a row of A or of Bᵀ, in bounds by the contract.
    unsafe {
        let a: [*const f32; R] = rows.map(|i| p.a.add(i * p.lda));
        let b: [*const f32; N] = cols.map(|c| bt.add(c * ldbt));
        let mut q = 0;
        while q + 16 <= p.k {
            let av = a.map(|row| _mm512_loadu_ps(row.add(q)));
            for (c, col) in b.iter().enumerate() {
                let bv = _mm512_loadu_ps(col.add(q));
                for r in 0..R {
                    acc[r][c] = _mm512_fmadd_ps(av[r], bv, acc[r][c]);
                }
            }
            q += 16;
        }
        if q < p.k {
            let mask = tail_mask(p.k - q);
            let av = a.map(|row| _mm512_maskz_loadu_ps(mask, row.add(q)));
            for (c, col) in b.iter().enumerate() {
                let bv = _mm512_maskz_loadu_ps(mask, col.add(q));
                for r in 0..R {
                    acc[r][c] = _mm512_fmadd_ps(av[r], bv, acc[r][c]);
                }
            }
        }
        for (&i, row) in rows.iter().zip(&acc).take(live_rows.min(R)) {
            for (c, lanes) in row.iter().enumerate().take(p.n - j) {
                let sum = p.alpha * _mm512_reduce_add_ps(*lanes);
                let at = if p.tc { p.c.add((j + c) * p.ldc + i) } else { p.c.add(i * p.ldc + j + c) };
                *at = if p.accumulate { *at + sum } else { sum };
            }
        }
    }
}

/// Rows of C an AVX2 kernel call computes: 2 × 5 accumulators, 2 rows of A and a column of Bᵀ fill 13 of the 16
/// ymm registers.
const R_AVX2: usize = 2;

/// `rows_of` with AVX2 and FMA.
///
/// # Safety
/// As `sgemm_avx2`.
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_of_avx2(p: &Product, i0: usize, i1: usize, bt: *const f32, ldbt: usize) {
    let nc = columns(p.n);
    for i in (i0..i1).step_by(R_AVX2) {
        let rows = std::array::from_fn(|r| (i + r).min(i1 - 1));
        for j in (0..p.n).step_by(nc) {
            // SAFETY: the rows and columns are in C, A and Bᵀ (repeated ones too).
            unsafe {
                if nc == 5 {
                    block_avx2::<5>(p, rows, i1 - i, j, bt, ldbt);
                } else {
                    block_avx2::<4>(p, rows, i1 - i, j, bt, ldbt);
                }
            }
        }
    }
}

/// `block` with AVX2 and FMA: 8 steps of the reduction per vector.
///
/// # Safety
/// As `sgemm_avx2`; the rows are rows of C.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn block_avx2<const N: usize>(
    p: &Product,
    rows: [usize; R_AVX2],
    live_rows: usize,
    j: usize,
    bt: *const f32,
    ldbt: usize,
) {
    let cols: [usize; N] = std::array::from_fn(|c| (j + c).min(p.n - 1));
    let mut acc = [[_mm256_setzero_ps(); N]; R_AVX2];
    // SAFETY: every load reads steps q..q+8 (masked to k) of a row of A or of Bᵀ, in bounds by the contract.
    unsafe {
        let a: [*const f32; R_AVX2] = rows.map(|i| p.a.add(i * p.lda));
        let b: [*const f32; N] = cols.map(|c| bt.add(c * ldbt));
        let mut q = 0;
        while q + 8 <= p.k {
            let av = a.map(|row| _mm256_loadu_ps(row.add(q)));
            for (c, col) in b.iter().enumerate() {
                let bv = _mm256_loadu_ps(col.add(q));
                for r in 0..R_AVX2 {
                    acc[r][c] = _mm256_fmadd_ps(av[r], bv, acc[r][c]);
                }
            }
            q += 8;
        }
        if q < p.k {
            // Lanes below the steps left: all ones.
            let mask =
                _mm256_cmpgt_epi32(_mm256_set1_epi32((p.k - q) as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            let av = a.map(|row| _mm256_maskload_ps(row.add(q), mask));
            for (c, col) in b.iter().enumerate() {
                let bv = _mm256_maskload_ps(col.add(q), mask);
                for r in 0..R_AVX2 {
                    acc[r][c] = _mm256_fmadd_ps(av[r], bv, acc[r][c]);
                }
            }
        }
        for (&i, row) in rows.iter().zip(&acc).take(live_rows.min(R_AVX2)) {
            for (c, lanes) in row.iter().enumerate().take(p.n - j) {
                let sum = p.alpha * sum_lanes(*lanes);
                let at = if p.tc { p.c.add((j + c) * p.ldc + i) } else { p.c.add(i * p.ldc + j + c) };
                *at = if p.accumulate { *at + sum } else { sum };
            }
        }
    }
}

/// The sum of a vector's 8 lanes.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn sum_lanes(v: __m256) -> f32 {
    let halves = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
    _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `transpose_b` gives Bᵀ exactly: whole 8×8 blocks, and columns and steps past them, B's rows padded or not.
    #[test]
    fn b_is_transposed_exactly() {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            crate::skip::skip(crate::skip::Need::Avx2, "this CPU has no AVX2 and FMA");
            return;
        }
        for (k, n, ldb) in [(256, 10, 10), (19, 17, 20), (8, 8, 8), (7, 3, 5), (64, 16, 19), (1, 1, 1)] {
            let b: Vec<f32> = (0..k * ldb).map(|x| x as f32).collect();
            let mut product = crate::avx512::tests::product(1, n, k, false, false);
            (product.b, product.ldb) = (b.as_ptr(), ldb);
            let mut bt = vec![f32::NAN; n * k];
            // SAFETY: AVX2 and FMA are available; B holds k rows of ldb ≥ n floats, `bt` n·k.
            unsafe { transpose_b(&product, bt.as_mut_ptr()) };
            for j in 0..n {
                for q in 0..k {
                    assert_eq!(bt[j * k + q], b[q * ldb + j], "{k}×{n} (ldb {ldb}): Bᵀ[{j}, {q}]");
                }
            }
        }
    }

    /// The mlp's logits (128×256·256×10) are shared between two threads when a worker spins (a program's step,
    /// after its first parallel product), not when one would be woken; a small thin product never is.
    #[test]
    fn logits_are_shared_with_a_spinning_worker() {
        let logits = crate::avx512::tests::product(128, 10, 256, false, false);
        assert!(applies(&logits));
        let chunks = logits.m.div_ceil(CHUNK_ROWS);
        assert!(shared(cost(&logits), chunks, 2, true));
        assert!(!shared(cost(&logits), chunks, 2, false));
        assert!(!shared(cost(&logits), chunks, 1, true));
        let small = crate::avx512::tests::product(64, 10, 64, false, false);
        assert!(!shared(cost(&small), small.m.div_ceil(CHUNK_ROWS), 2, true));
    }
}
