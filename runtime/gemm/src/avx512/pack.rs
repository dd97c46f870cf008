//! Packing A and B into the panels the microkernels read, and the 16×16 transpose it (and the transposed store of
//! C) relies on.

use std::arch::x86_64::*;

use super::{Product, NR};

/// Lanes `0..min(len, 16)`.
#[inline(always)]
pub(super) fn tail_mask(len: usize) -> __mmask16 {
    if len >= 16 {
        0xffff
    } else {
        ((1u32 << len) - 1) as __mmask16
    }
}

/// Packs panels `g0..g1` of an A stored transposed (panel g: `base + (g < extra)` rows from row
/// `i0 + g·base + min(g, extra)`) over the reduction range `pc..pc+kc`: element (row r of the panel, step q) to
/// `dst[(g - g0)·stride + q·mr + r]`. Step q of every panel comes from the same stored row, so A is read in order.
///
/// # Safety
/// The panels' rows and steps are in A; each panel's `stride` ≥ `mr·kc + 16` floats (its stores are 16 wide).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn pack_a(
    p: &Product,
    pc: usize,
    kc: usize,
    i0: usize,
    (base, extra): (usize, usize),
    (g0, g1): (usize, usize),
    dst: *mut f32,
    stride: usize,
) {
    for q in 0..kc {
        // SAFETY: masked loads read only the mr elements of each panel in row pc+q of the stored A; each
        // full-width store writes 16 floats at q·mr of its panel, within the panel's mr·kc + 16 floats.
        unsafe {
            let src = p.a.add((pc + q) * p.lda + i0);
            for g in g0..g1 {
                let (i, mr) = (g * base + g.min(extra), base + usize::from(g < extra));
                let v = _mm512_maskz_loadu_ps(tail_mask(mr), src.add(i));
                _mm512_storeu_ps(dst.add((g - g0) * stride + q * mr), v);
            }
        }
    }
}

/// Packs columns `j..j+nc` of B over the reduction range `pc..pc+kc` in panels of 32 columns: element (step q,
/// column jr + c) to `dst[jr·kc + q·32 + c]`, zero past nc.
///
/// # Safety
/// The columns and steps are in B; `dst` holds ⌈nc/32⌉ panels of `kc·32` floats and is 64-byte aligned.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn pack_b(p: &Product, pc: usize, kc: usize, j: usize, nc: usize, dst: *mut f32) {
    // SAFETY: (both arms) loads touch only elements of columns j..j+nc, steps pc..pc+kc of B (masked at the
    // edge); the stores stay in dst's panels.
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

/// Transposes a 16×16 block held as 16 rows (64 shuffles).
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) fn transpose16(r: [__m512; 16]) -> [__m512; 16] {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transpose16_transposes() {
        if !is_x86_feature_detected!("avx512f") {
            return;
        }
        let src: Vec<f32> = (0..256).map(|x| x as f32).collect();
        let mut out = vec![0f32; 256];
        // SAFETY: AVX-512F is available; loads and stores stay within the 256-float buffers.
        unsafe {
            let mut rows = [_mm512_setzero_ps(); 16];
            for (r, row) in rows.iter_mut().enumerate() {
                *row = _mm512_loadu_ps(src.as_ptr().add(16 * r));
            }
            for (r, v) in transpose16(rows).iter().enumerate() {
                _mm512_storeu_ps(out.as_mut_ptr().add(16 * r), *v);
            }
        }
        for i in 0..16 {
            for j in 0..16 {
                assert_eq!(out[16 * i + j], src[16 * j + i]);
            }
        }
    }
}
