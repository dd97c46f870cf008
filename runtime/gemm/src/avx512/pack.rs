//! Packing A and B into the panels the microkernels read, and the 16×16 transpose it (and the transposed store of
//! C) relies on.

use std::arch::x86_64::*;

use super::{Product, KC, NR};
use crate::finite::Selection;
use crate::ByteScale;

/// Lanes `0..min(len, 16)`.
#[inline(always)]
pub(crate) fn tail_mask(len: usize) -> __mmask16 {
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

/// Packs panels `g0..g1` of an A of bytes, each byte read as a float through `scale`: stored transposed, as
/// `pack_a` lays them out (step-major); otherwise row-major, row r of panel g at `dst[(g - g0)·stride + r·ld]`,
/// for the kernels that read A in place (`ld` a multiple of 16, at least kc: rows are written 16 floats at a time).
/// With a `Selection`, each panel holds only the steps it keeps, in order, and the selection says which.
///
/// # Safety
/// As `pack_a`, with `stride` ≥ `12·ld` for an A stored row-major; `p.a` is the address of A's bytes, `lda` apart.
/// With a selection, B is stored row-major, its `steps` hold `g1 - g0` panels of `stride` indices, and its `kept`
/// at least `g1 - g0` counts.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,popcnt")]
pub(super) unsafe fn pack_a_bytes(
    p: &Product,
    scale: Convert,
    pc: usize,
    kc: usize,
    i0: usize,
    (base, extra): (usize, usize),
    (g0, g1): (usize, usize),
    (dst, stride, ld): (*mut f32, usize, usize),
    mut selection: Option<Selection>,
) {
    let bytes = p.a.cast::<u8>();
    let (rows, cols) = if p.ta { (p.k, p.m) } else { (p.m, p.k) };
    // A's bytes end here: 16-byte loads that would pass it go through a copy.
    let end = (rows - 1) * p.lda + cols;
    let chunks = kc.div_ceil(16);
    for g in g0..g1 {
        let (i, mr) = (i0 + g * base + g.min(extra), base + usize::from(g < extra));
        // Bit s of zero[c]: step 16c + s is all zero in the panel.
        let mut zero = [0u16; KC.div_ceil(16)];
        // SAFETY: loads read mr bytes of each step's stored row (transposed), or the panel's mr rows over
        // pc..pc+kc, all in A (which ends at `end`); full-width stores write 16 floats at q·mr of the panel,
        // within its mr·kc + 16 (transposed), or up to ld floats of each row (row-major).
        unsafe {
            let panel = dst.add((g - g0) * stride);
            if p.ta {
                // Every step, then (below) the kept ones moved together.
                let (lanes, select) = (tail_mask(mr), selection.is_some());
                for (c, zero) in zero.iter_mut().enumerate().take(chunks) {
                    let mut bits = 0u16;
                    for q in 16 * c..(16 * c + 16).min(kc) {
                        let v = load_bytes(bytes, end, (pc + q) * p.lda + i, mr, scale);
                        _mm512_storeu_ps(panel.add(q * mr), v);
                        if select {
                            let all_zero = _mm512_mask_cmpneq_ps_mask(lanes, v, _mm512_setzero_ps()) == 0;
                            bits |= u16::from(all_zero) << (q % 16);
                        }
                    }
                    *zero = bits;
                }
            } else if selection.is_some() {
                for (c, zero) in zero.iter_mut().enumerate().take(chunks) {
                    let (q, len) = (16 * c, (kc - 16 * c).min(16));
                    let mut any = _mm_setzero_si128();
                    for r in 0..mr {
                        any = _mm_or_si128(any, raw_bytes(bytes, end, (i + r) * p.lda + pc + q, len));
                    }
                    *zero = _mm_movemask_epi8(_mm_cmpeq_epi8(any, _mm_setzero_si128())) as u16;
                }
            }
        }
        // Bit s of keep[c]: step 16c + s stays (all without a selection).
        let mut keep = [0xffffu16; KC.div_ceil(16)];
        let mut kept = kc;
        if let Some(s) = selection.as_mut() {
            for c in 0..chunks {
                let len = tail_mask(kc - 16 * c);
                // SAFETY: rows pc + 16c + s of B, for s < len, are B's (steps of the block).
                keep[c] = !unsafe { s.finite.rows(p, pc + 16 * c, zero[c] & len) };
            }
            kept = (0..chunks).map(|c| (keep[c] & tail_mask(kc - 16 * c)).count_ones() as usize).sum();
            s.kept[g - g0] = kept;
        }
        // SAFETY: as above, and: a panel stored transposed moves each kept step's mr floats to its place among the
        // kept, never after where it was (masked loads and stores of mr floats, so that no step is overwritten
        // before it moves); indices are written 16 at a time at the count of those before, within the panel's
        // kc + 16.
        unsafe {
            let panel = dst.add((g - g0) * stride);
            if p.ta {
                if kept < kc {
                    let (lanes, mut at) = (tail_mask(mr), 0);
                    for (c, &keep) in keep.iter().enumerate().take(chunks) {
                        let mut bits = keep & tail_mask(kc - 16 * c);
                        while bits != 0 {
                            let q = 16 * c + bits.trailing_zeros() as usize;
                            bits &= bits - 1;
                            if at < q {
                                let v = _mm512_maskz_loadu_ps(lanes, panel.add(q * mr));
                                _mm512_mask_storeu_ps(panel.add(at * mr), lanes, v);
                            }
                            at += 1;
                        }
                    }
                }
            } else {
                for r in 0..mr {
                    let (from, to) = ((i + r) * p.lda + pc, panel.add(r * ld));
                    if kept == kc {
                        for q in (0..kc).step_by(16) {
                            _mm512_storeu_ps(to.add(q), load_bytes(bytes, end, from + q, (kc - q).min(16), scale));
                        }
                    } else {
                        let mut at = 0;
                        for (c, &keep) in keep.iter().enumerate().take(chunks) {
                            let (q, len) = (16 * c, (kc - 16 * c).min(16));
                            let v = load_bytes(bytes, end, from + q, len, scale);
                            _mm512_storeu_ps(to.add(at), _mm512_maskz_compress_ps(keep, v));
                            at += (keep & tail_mask(len)).count_ones() as usize;
                        }
                    }
                }
            }
            if let Some(s) = selection.as_ref().filter(|_| kept < kc) {
                let (steps, mut at) = (s.steps.add((g - g0) * s.stride), 0);
                let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
                for (c, &keep) in keep.iter().enumerate().take(chunks) {
                    let keep = keep & tail_mask(kc - 16 * c);
                    let index = _mm512_add_epi32(lanes, _mm512_set1_epi32(16 * c as i32));
                    _mm512_storeu_si512(steps.add(at).cast(), _mm512_maskz_compress_epi32(keep, index));
                    at += keep.count_ones() as usize;
                }
            }
        }
    }
}

/// How the packing turns a byte into a float: `f32(e)·mul`, or for a division by c, the quotient of
/// `f32(e)·mul` (mul the reciprocal of c) corrected by one fused multiply-add step where that gives the
/// correctly rounded `f32(e) / c` for every byte (checked), else the division itself.
#[derive(Clone, Copy)]
pub(super) struct Convert {
    mul: __m512,
    /// c, for the corrected reciprocal.
    corrected: Option<__m512>,
    /// c, for the division.
    divided: Option<__m512>,
}

impl Convert {
    #[target_feature(enable = "avx512f")]
    pub(super) fn new(scale: ByteScale) -> Convert {
        match scale {
            ByteScale::Mul(c) => Convert { mul: _mm512_set1_ps(c), corrected: None, divided: None },
            ByteScale::Div(c) => {
                let r = 1.0 / c;
                let exact = corrects(c);
                let v = _mm512_set1_ps(c);
                match exact {
                    true => Convert { mul: _mm512_set1_ps(r), corrected: Some(v), divided: None },
                    false => Convert { mul: v, corrected: None, divided: Some(v) },
                }
            }
        }
    }
}

/// Whether the corrected reciprocal of `Convert` divides every byte by `c` exactly (the last divisor's answer is
/// kept: a step's products divide by the same constant).
pub(crate) fn corrects(c: f32) -> bool {
    thread_local! {
        static LAST: std::cell::Cell<Option<(u32, bool)>> = const { std::cell::Cell::new(None) };
    }
    if let Some((bits, exact)) = LAST.get() {
        if bits == c.to_bits() {
            return exact;
        }
    }
    let r = 1.0 / c;
    let exact = (0..=255u8).all(|e| {
        let (x, q0) = (f32::from(e), f32::from(e) * r);
        let q = (-q0).mul_add(c, x).mul_add(r, q0);
        q.to_bits() == (x / c).to_bits()
    });
    LAST.set(Some((c.to_bits(), exact)));
    exact
}

/// 16 bytes of A from offset `at`; only `len` of them are needed: those past `end` are not read (and are 0).
///
/// # Safety
/// Bytes `at..at + len` are in A, which ends at `end`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn raw_bytes(bytes: *const u8, end: usize, at: usize, len: usize) -> __m128i {
    // SAFETY: a full 16-byte load only within A; otherwise the `len` bytes that are in it, copied.
    unsafe {
        if at + 16 <= end {
            _mm_loadu_si128(bytes.add(at).cast())
        } else {
            let mut copy = [0u8; 16];
            std::ptr::copy_nonoverlapping(bytes.add(at), copy.as_mut_ptr(), len);
            _mm_loadu_si128(copy.as_ptr().cast())
        }
    }
}

/// 16 bytes of A from offset `at` (only `len` of them are needed: those past `end` are not read) as floats.
///
/// # Safety
/// Bytes `at..at + len` are in A, which ends at `end`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load_bytes(bytes: *const u8, end: usize, at: usize, len: usize, convert: Convert) -> __m512 {
    // SAFETY: the caller's contract.
    let v = unsafe { raw_bytes(bytes, end, at, len) };
    convert.apply(v)
}

impl Convert {
    /// Whether a byte 0 is read as ±0 (not NaN: a scale 0/0 or 0·∞).
    #[target_feature(enable = "avx512f")]
    pub(super) fn zero_is_zero(self) -> bool {
        _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(self.apply(_mm_setzero_si128()), _mm512_setzero_ps()) == 0xffff
    }

    /// 16 bytes as floats.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn apply(self, v: __m128i) -> __m512 {
        let convert = self;
        let x = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v));
        match (convert.corrected, convert.divided) {
            (Some(c), _) => {
                let q0 = _mm512_mul_ps(x, convert.mul);
                _mm512_fmadd_ps(_mm512_fnmadd_ps(q0, c, x), convert.mul, q0)
            }
            (None, Some(c)) => _mm512_div_ps(x, c),
            (None, None) => _mm512_mul_ps(x, convert.mul),
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
