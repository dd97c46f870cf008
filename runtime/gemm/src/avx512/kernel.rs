//! The microkernels: one tile of C, up to 12 rows × 32 columns, in zmm accumulators.

use std::arch::asm;
use std::arch::x86_64::*;

use super::pack::{tail_mask, transpose16};
use super::MR;

/// `kernel::<R, IN_PLACE, WIDE, SKIP>(kc, a, lda, b, ldb, steps, c, ldc, nr, tc, overwrite, alpha, finish)`.
pub(super) type Kernel = unsafe fn(
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

/// Instantiates `kernel::<R, IN_PLACE, WIDE, SKIP>` for R = 1..=12.
macro_rules! heights {
    ($in_place:literal, $wide:literal, $skip:literal) => {
        [
            kernel::<1, $in_place, $wide, $skip>,
            kernel::<2, $in_place, $wide, $skip>,
            kernel::<3, $in_place, $wide, $skip>,
            kernel::<4, $in_place, $wide, $skip>,
            kernel::<5, $in_place, $wide, $skip>,
            kernel::<6, $in_place, $wide, $skip>,
            kernel::<7, $in_place, $wide, $skip>,
            kernel::<8, $in_place, $wide, $skip>,
            kernel::<9, $in_place, $wide, $skip>,
            kernel::<10, $in_place, $wide, $skip>,
            kernel::<11, $in_place, $wide, $skip>,
            kernel::<12, $in_place, $wide, $skip>,
        ]
    };
}

/// The microkernels, `KERNELS[skip][wide][in_place][R - 1]`.
pub(super) static KERNELS: [[[[Kernel; MR]; 2]; 2]; 2] = [
    [
        [heights!(false, false, false), heights!(true, false, false)],
        [heights!(false, true, false), heights!(true, true, false)],
    ],
    [
        [heights!(false, false, true), heights!(true, false, true)],
        [heights!(false, true, true), heights!(true, true, true)],
    ],
];

/// `C[R×nr] (+)= α·A·B` for one tile: overwrites the tile when `overwrite`, else adds to it.
///
/// - A (R rows × kc steps): element (i, q) at `a[i·lda + q]` when `IN_PLACE` (A as stored, row-major:
///   broadcasting from R rows spares transposing A into a panel), else at `a[q·R + i]` (a packed panel).
/// - B (kc steps × nr columns): step q at `b[q·ldb..]`, 32 floats (16 unless `WIDE`), from a packed panel
///   (ldb = 32) or B as stored; when `SKIP`, at `b[steps[q]·ldb..]` instead: A's steps are a selection of B's (the
///   steps where a panel of A is not all zero, `pack_a_bytes`), and `steps` holds kc indices.
/// - C: element (i, j) of the tile at `c[i·ldc + j]`, or `c[j·ldc + i]` when `tc`; only columns `j < nr` (≤ 32,
///   ≤ 16 unless `WIDE`) are written.
/// - `finish` (C not transposed): the epilogue (`finish16`) applied to the sums before they are stored: the bias of
///   the tile's columns (unless null), relu, and the mask (unless null) laid out as the tile, `ldc` apart. (Applied
///   in a second pass over the stored tile instead, the mlp's masked input gradients took 2–11 % more, its last
///   layer 3–6 %.)
///
/// Per step the kernel loads one or two B vectors and, per row, broadcasts one A element into two FMAs: 24 FMAs
/// against 14 loads at R = 12, so the two FMA ports bound it (~180 of the 210 GFLOP/s peak with operands in L1 or
/// L2). The k loop is one small `asm!` block per row and step: left to itself, LLVM merges a row's consecutive A
/// elements into a vector load that it shuffles apart, and computes an address per row; here each broadcast is
/// one load at a constant displacement and the accumulators stay in registers.
///
/// # Safety
/// AVX-512F; A's R rows, B's steps and the tile's elements addressed as above are in bounds.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
unsafe fn kernel<const R: usize, const IN_PLACE: bool, const WIDE: bool, const SKIP: bool>(
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
    // R rows of two vectors; the second stays zero and unused unless WIDE: LLVM drops it.
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    // One row of one step: acc[i] += A(i, step) · (b0, b1), A's element at `[address]`.
    macro_rules! row {
        ($i:expr, $address:literal, $b0:ident, $b1:ident, $($operands:tt)*) => {
            if $i < R {
                if WIDE {
                    asm!(
                        concat!("vbroadcastss {t}, dword ptr [", $address, "]"),
                        "vfmadd231ps {c0}, {b0}, {t}",
                        "vfmadd231ps {c1}, {b1}, {t}",
                        $($operands)*
                        b0 = in(zmm_reg) $b0,
                        b1 = in(zmm_reg) $b1,
                        c0 = inout(zmm_reg) acc[$i][0],
                        c1 = inout(zmm_reg) acc[$i][1],
                        t = out(zmm_reg) _,
                        options(pure, readonly, nostack, preserves_flags),
                    );
                } else {
                    asm!(
                        concat!("vbroadcastss {t}, dword ptr [", $address, "]"),
                        "vfmadd231ps {c0}, {b0}, {t}",
                        $($operands)*
                        b0 = in(zmm_reg) $b0,
                        c0 = inout(zmm_reg) acc[$i][0],
                        t = out(zmm_reg) _,
                        options(pure, readonly, nostack, preserves_flags),
                    );
                }
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
        let mut b = b;
        let mut steps = steps;
        // B's two vectors of step u (the second only when WIDE).
        macro_rules! load_b {
            ($u:literal) => {{
                let row = if SKIP { b.add(*steps.add($u) as usize * ldb) } else { b.add($u * ldb) };
                let b0 = _mm512_loadu_ps(row);
                (b0, if WIDE { _mm512_loadu_ps(row.add(16)) } else { b0 })
            }};
        }
        // Past `n` steps: of B's rows, or of the selection.
        macro_rules! advance_b {
            ($n:literal) => {
                if SKIP {
                    steps = steps.add($n);
                } else {
                    b = b.add($n * ldb);
                }
            };
        }
        if IN_PLACE {
            // Rows 3g, 3g + 1, 3g + 2 at base g + 0, lda, 2·lda (lda in bytes in `ld`); the bases of groups past R
            // are never dereferenced.
            let ld = lda * 4;
            let (mut r0, mut r3, mut r6, mut r9) =
                (a, a.wrapping_add(3 * lda), a.wrapping_add(6 * lda), a.wrapping_add(9 * lda));
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
                    group!($u, 2, r6, b0, b1);
                    group!($u, 3, r9, b0, b1);
                };
            }
            // Unrolled by 4: the loop's pointer updates and branch would otherwise take FMA ports' issue slots.
            for _ in 0..kc / 4 {
                step!(0);
                step!(1);
                step!(2);
                step!(3);
                (r0, r3, r6, r9) = (r0.wrapping_add(4), r3.wrapping_add(4), r6.wrapping_add(4), r9.wrapping_add(4));
                advance_b!(4);
            }
            for _ in 0..kc % 4 {
                step!(0);
                (r0, r3, r6, r9) = (r0.wrapping_add(1), r3.wrapping_add(1), r6.wrapping_add(1), r9.wrapping_add(1));
                advance_b!(1);
            }
        } else {
            let mut a = a;
            macro_rules! group {
                ($u:literal, $g:literal, $b0:ident, $b1:ident) => {
                    row!(3 * $g, "{a} + {d}", $b0, $b1, a = in(reg) a, d = const ($u * R + 3 * $g) * 4,);
                    row!(3 * $g + 1, "{a} + {d}", $b0, $b1, a = in(reg) a, d = const ($u * R + 3 * $g + 1) * 4,);
                    row!(3 * $g + 2, "{a} + {d}", $b0, $b1, a = in(reg) a, d = const ($u * R + 3 * $g + 2) * 4,);
                };
            }
            macro_rules! step {
                ($u:literal) => {
                    let (b0, b1) = load_b!($u);
                    group!($u, 0, b0, b1);
                    group!($u, 1, b0, b1);
                    group!($u, 2, b0, b1);
                    group!($u, 3, b0, b1);
                };
            }
            for _ in 0..kc / 4 {
                step!(0);
                step!(1);
                step!(2);
                step!(3);
                a = a.add(4 * R);
                advance_b!(4);
            }
            for _ in 0..kc % 4 {
                step!(0);
                a = a.add(R);
                advance_b!(1);
            }
        }
        if alpha != 1.0 {
            let alpha = _mm512_set1_ps(alpha);
            for row in acc.iter_mut() {
                *row = [_mm512_mul_ps(row[0], alpha), _mm512_mul_ps(row[1], alpha)];
            }
        }
        debug_assert!(finish.is_none() || !tc, "an epilogue's product keeps C as laid out");
        if tc {
            // By value: a reference would let the accumulators' address escape, and the array would be zeroed in
            // memory (a call of `memset`) on every call of the kernel, transposed or not.
            store_transposed::<R>(acc, c, ldc, nr, overwrite);
            return;
        }
        let (m0, m1) = (tail_mask(nr), tail_mask(nr.saturating_sub(16)));
        // The rows stored from a copy: a loop over `acc` itself, not unrolled at R = 12, made it an array in memory,
        // zeroed (a call of `memset`, 1.5 KiB) on every call of the kernel: the mlp's training step took 3–4 % longer,
        // the CNN's second layer at inference (products of 32 steps) 5 %.
        let sums: [[__m512; 2]; R] = std::array::from_fn(|i| acc[i]);
        for (i, &[mut v0, mut v1]) in sums.iter().enumerate() {
            let row = c.add(i * ldc);
            if !overwrite {
                v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(m0, row));
                if WIDE {
                    v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(m1, row.add(16)));
                }
            }
            if let Some((bias, relu, mask)) = finish {
                let at = |x: *const f32, j: usize| if x.is_null() { x } else { x.add(j) };
                let m = at(mask, i * ldc);
                v0 = finish16(v0, m0, bias, relu, m);
                if WIDE {
                    v1 = finish16(v1, m1, at(bias, 16), relu, at(m, 16));
                }
            }
            _mm512_mask_storeu_ps(row, m0, v0);
            if WIDE {
                _mm512_mask_storeu_ps(row.add(16), m1, v1);
            }
        }
    }
}

/// The epilogue of the lanes `lanes` of 16 elements of C: `v` plus the bias's floats at `bias` (unless null), then
/// `max(·, 0)` where `relu` (`vmaxps(0, x)`: 0 only where 0 > x, so NaN and -0 stay), then 0 where the mask's floats
/// at `mask` (unless null; laid out as C) are not above 0.
///
/// # Safety
/// `bias` and `mask` (unless null) hold the lanes' floats.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn finish16(
    mut v: __m512,
    lanes: __mmask16,
    bias: *const f32,
    relu: bool,
    mask: *const f32,
) -> __m512 {
    let zero = _mm512_setzero_ps();
    // SAFETY: the caller's contract; masked loads read only the lanes.
    unsafe {
        if !bias.is_null() {
            v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(lanes, bias));
        }
        if relu {
            v = _mm512_max_ps(zero, v);
        }
        if !mask.is_null() {
            let m = _mm512_maskz_loadu_ps(lanes, mask);
            v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_GT_OQ>(m, zero), v);
        }
    }
    v
}

/// Writes the first R rows of a tile transposed: column j (< nr) of the tile to `c[j·ldc..+R]`, through two 16×16
/// transposes (a tile of Cᵀ when the product is computed as `Cᵀ = Bᵀ·Aᵀ`).
#[inline(never)]
#[target_feature(enable = "avx512f")]
unsafe fn store_transposed<const R: usize>(acc: [[__m512; 2]; R], c: *mut f32, ldc: usize, nr: usize, overwrite: bool) {
    let mask = tail_mask(R);
    for half in 0..2 {
        let cols = nr.saturating_sub(16 * half).min(16);
        if cols == 0 {
            break;
        }
        let mut rows = [_mm512_setzero_ps(); 16];
        for (row, acc) in rows.iter_mut().zip(&acc).take(R) {
            *row = acc[half];
        }
        for (j, v) in transpose16(rows).iter().enumerate().take(cols) {
            // SAFETY: column 16·half + j < nr of the tile: R elements at c + (16·half + j)·ldc.
            unsafe {
                let dst = c.add((16 * half + j) * ldc);
                let v = if overwrite { *v } else { _mm512_add_ps(*v, _mm512_maskz_loadu_ps(mask, dst)) };
                _mm512_mask_storeu_ps(dst, mask, v);
            }
        }
    }
}
