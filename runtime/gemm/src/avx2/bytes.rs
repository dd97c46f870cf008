//! A of bytes (images fed as u8) as the AVX2 kernels read it: converted to floats a block at a time (row-major, for
//! the kernels that read A in place) or as it is packed into 6-row panels (stored transposed), each byte through
//! `Scale`. A panel leaves out the steps at which all its rows are 0 (`Selection`: the black pixels that the 6
//! images of a panel share, or the 6 pixels of a panel that an image has black), where B's row is finite; the
//! kernels then read B's rows through the list of steps kept (`SKIP`). C is the same to the bit.

use std::arch::x86_64::*;

use super::MR;
use crate::avx512::{tail_mask, Product};
use crate::finite::Selection;
use crate::ByteScale;

/// How bytes become floats, as `ByteScale::apply` computes them: `f32(e)·c`; for a division by c, the quotient of
/// `f32(e)·(1/c)` corrected by one fused multiply-add where that is the correctly rounded `f32(e) / c` for every
/// byte (`corrects`), else the division itself.
#[derive(Clone, Copy)]
pub(super) enum Scale {
    Mul(f32),
    Corrected { c: f32, reciprocal: f32 },
    Div(f32),
}

impl Scale {
    pub(super) fn new(scale: ByteScale) -> Scale {
        match scale {
            ByteScale::Mul(c) => Scale::Mul(c),
            ByteScale::Div(c) if crate::avx512::corrects(c) => Scale::Corrected { c, reciprocal: 1.0 / c },
            ByteScale::Div(c) => Scale::Div(c),
        }
    }

    /// Eight bytes' floats.
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn apply(&self, x: __m256) -> __m256 {
        match *self {
            Scale::Mul(c) => _mm256_mul_ps(x, _mm256_set1_ps(c)),
            Scale::Corrected { c, reciprocal } => {
                let r = _mm256_set1_ps(reciprocal);
                let q = _mm256_mul_ps(x, r);
                _mm256_fmadd_ps(_mm256_fnmadd_ps(q, _mm256_set1_ps(c), x), r, q)
            }
            Scale::Div(c) => _mm256_div_ps(x, _mm256_set1_ps(c)),
        }
    }

    /// Whether a byte 0 is read as ±0 (not NaN: a scale 0/0 or 0·∞), so that steps of zeros may be left out.
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn zero_is_zero(&self) -> bool {
        let zero = _mm256_setzero_ps();
        _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(self.apply(zero), zero)) == 0xff
    }

    /// The floats of 8 bytes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn floats(&self, bytes: __m128i) -> __m256 {
        self.apply(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)))
    }
}

/// Bytes `q..q + 8` of a row of `cols` (at `row`), those past `cols` 0: one 8-byte load where the row holds them,
/// else a copy of the rest.
///
/// # Safety
/// The row's `cols` bytes are readable.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn eight(row: *const u8, q: usize, cols: usize) -> __m128i {
    // SAFETY: an 8-byte load only where the row holds 8 more bytes; its tail through a copy of at most 7.
    unsafe {
        if q + 8 <= cols {
            _mm_loadl_epi64(row.add(q).cast())
        } else {
            let mut last = [0u8; 8];
            std::ptr::copy_nonoverlapping(row.add(q), last.as_mut_ptr(), cols.saturating_sub(q));
            _mm_loadl_epi64(last.as_ptr().cast())
        }
    }
}

/// Stores the first `len` (≤ 8) floats of `v` at `dst`: all 8 where `wide` (the 8 past `dst` are writable).
///
/// # Safety
/// `dst` holds `len` floats, or 8 where `wide`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn store(dst: *mut f32, v: __m256, len: usize, wide: bool) {
    // SAFETY: the caller's contract.
    unsafe {
        if wide {
            _mm256_storeu_ps(dst, v);
        } else {
            let mut part = [0f32; 8];
            _mm256_storeu_ps(part.as_mut_ptr(), v);
            std::ptr::copy_nonoverlapping(part.as_ptr(), dst, len);
        }
    }
}

/// Converts `rows` rows of `cols` bytes (`ld` apart, from `src`) to floats, `cols` apart at `dst`.
///
/// # Safety
/// The bytes addressed are in A; `dst` holds rows·cols floats.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn convert(src: *const u8, ld: usize, rows: usize, cols: usize, dst: *mut f32, scale: &Scale) {
    // SAFETY: the caller's contract; nothing is noted.
    unsafe { convert_noting::<false>(src, ld, rows, cols, dst, scale, &mut []) }
}

/// `convert`, and where `NOTE`, each 8 steps' bytes of every row ORed into `any[q / 8]` (0 past cols): the steps at
/// which all rows are zero are the zero bytes of `any`.
///
/// # Safety
/// As `convert`; where `NOTE`, `any` holds ⌈cols/8⌉ words.
#[target_feature(enable = "avx2,fma")]
unsafe fn convert_noting<const NOTE: bool>(
    src: *const u8,
    ld: usize,
    rows: usize,
    cols: usize,
    dst: *mut f32,
    scale: &Scale,
    any: &mut [u64],
) {
    for r in 0..rows {
        // SAFETY: 8-byte loads only where the row holds 8 more bytes; its tail (`eight`) through a copy of at most
        // 7; each store writes within the row's cols.
        unsafe {
            let (row, out) = (src.add(r * ld), dst.add(r * cols));
            let mut q = 0;
            while q + 8 <= cols {
                let bytes = _mm_loadl_epi64(row.add(q).cast());
                _mm256_storeu_ps(out.add(q), scale.floats(bytes));
                if NOTE {
                    any[q / 8] |= _mm_cvtsi128_si64(bytes) as u64;
                }
                q += 8;
            }
            if q < cols {
                let bytes = eight(row, q, cols);
                store(out.add(q), scale.floats(bytes), cols - q, false);
                if NOTE {
                    any[q / 8] |= _mm_cvtsi128_si64(bytes) as u64;
                }
            }
        }
    }
}

/// For each mask of 8 lanes, the indices of its lanes that are set, in order, one a byte (the rest 0): the
/// permutation that moves the kept lanes of a vector to its front.
static LEFT_PACK: [u64; 256] = left_pack();

const fn left_pack() -> [u64; 256] {
    let mut lut = [0u64; 256];
    let mut mask = 0;
    while mask < 256 {
        let (mut word, mut at, mut lane) = (0u64, 0, 0);
        while lane < 8 {
            if mask >> lane & 1 == 1 {
                word |= (lane as u64) << (8 * at);
                at += 1;
            }
            lane += 1;
        }
        lut[mask] = word;
        mask += 1;
    }
    lut
}

/// The permutation that moves the lanes of `mask` to the front (`_mm256_permutevar8x32_*`).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn left_pack_lanes(mask: u8) -> __m256i {
    _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(LEFT_PACK[usize::from(mask)] as i64))
}

/// Bit s of word c of a panel's: step 16c + s (of a block of at most `KC_MAX` steps).
type StepBits = [u16; super::KC_MAX.div_ceil(16)];

/// Which of the 16-step groups' steps a panel keeps: bit s of `keep[c]` for step 16c + s of `kc` (no bit past
/// kc), given the steps at which the panel is all zero (`zero`, likewise), leaving out those whose row of B
/// (`pc` + the step) is finite; and how many it keeps.
///
/// # Safety
/// As `FiniteRows::rows` for B's rows `pc..pc+kc`.
unsafe fn keep(p: &Product, pc: usize, kc: usize, zero: &StepBits, s: &mut Selection, keeps: &mut StepBits) -> usize {
    let mut kept = 0;
    for (c, (keep, &zero)) in keeps.iter_mut().zip(zero).enumerate().take(kc.div_ceil(16)) {
        let len = tail_mask(kc - 16 * c);
        // SAFETY: rows pc + 16c + s of B, for the bits s of len, are the block's (the caller's contract).
        *keep = !unsafe { s.finite.rows(p, pc + 16 * c, zero & len) } & len;
        kept += keep.count_ones() as usize;
    }
    kept
}

/// The bytes from one step of a packed B panel (16 floats) to the next: the kernels read B's kept steps at these
/// multiples of their indices, so that no multiplication competes with their FMAs (on Intel, `imul` issues to one
/// of the two ports that run 256-bit FMAs).
pub(super) const STEP_BYTES: u32 = (super::NR * std::mem::size_of::<f32>()) as u32;

/// Writes where the steps `keep` keeps (bit s of `keep[c]`: step 16c + s) lie in a packed B panel, in order, at
/// `steps`: their indices times `STEP_BYTES`.
///
/// # Safety
/// `steps` holds the kept steps and 8 more.
#[target_feature(enable = "avx2,fma")]
unsafe fn write_steps(keep: &[u16], steps: *mut u32) {
    // Lane l: the offset of step l of 8.
    let lanes = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(STEP_BYTES as i32));
    let mut at = 0;
    for (c, &keep) in keep.iter().enumerate() {
        for half in 0..2 {
            let bits = (keep >> (8 * half)) as u8;
            let first = _mm256_set1_epi32(((16 * c + 8 * half) as u32 * STEP_BYTES) as i32);
            let index = _mm256_add_epi32(first, lanes);
            // SAFETY: `at` indices kept before these, and 8 stored: within the caller's contract.
            unsafe {
                _mm256_storeu_si256(steps.add(at).cast(), _mm256_permutevar8x32_epi32(index, left_pack_lanes(bits)))
            };
            at += bits.count_ones() as usize;
        }
    }
}

/// `convert` for the block's rows `0..rows` (`ld` apart from `src`, the steps `pc..pc+cols` of `p`), panel by panel
/// (6 rows, the last fewer), each leaving out the steps at which its rows are all zero and B's row is finite: row r
/// at `dst + r·cols` holds its panel's kept steps, in order; panel g's kept steps (`write_steps`: their indices from
/// 0 times `STEP_BYTES`) are at `s.steps + g·s.stride` and their count at `s.kept[g]`.
///
/// # Safety
/// As `convert`, and `Scale::zero_is_zero`; B is stored row-major; `s` holds ⌈rows/6⌉ panels of `stride` ≥ cols +
/// 16 indices and counts, and `cols` ≤ `KC_MAX`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn convert_selecting(
    p: &Product,
    pc: usize,
    (src, ld): (*const u8, usize),
    rows: usize,
    cols: usize,
    dst: *mut f32,
    scale: &Scale,
    s: &mut Selection,
) {
    let groups = cols.div_ceil(16);
    for (g, r0) in (0..rows).step_by(MR).enumerate() {
        let mr = MR.min(rows - r0);
        // Converted as `convert` converts, the panel's bytes ORed 8 steps at a time on the way: where no step is all
        // zero (as on random bytes), that is all.
        let mut any = [0u64; super::KC_MAX.div_ceil(16) * 2];
        // SAFETY: the panel's rows (the caller's contract); `any` holds ⌈KC_MAX/8⌉ words.
        unsafe { convert_noting::<true>(src.add(r0 * ld), ld, mr, cols, dst.add(r0 * cols), scale, &mut any) };
        let mut zero = StepBits::default();
        let mut none = true;
        for (c, zero) in zero.iter_mut().enumerate().take(groups) {
            let both = _mm_set_epi64x(any[2 * c + 1] as i64, any[2 * c] as i64);
            *zero = _mm_movemask_epi8(_mm_cmpeq_epi8(both, _mm_setzero_si128())) as u16 & tail_mask(cols - 16 * c);
            none &= *zero == 0;
        }
        if none {
            s.kept[g] = cols;
            continue;
        }
        let mut keeps = StepBits::default();
        // SAFETY: the block's rows of B (the caller's contract).
        let kept = unsafe { keep(p, pc, cols, &zero, s, &mut keeps) };
        s.kept[g] = kept;
        if kept == cols {
            continue;
        }
        for r in r0..r0 + mr {
            let mut at = 0;
            // SAFETY: each row's floats move to the front in order: 8 loaded at q (or the rest of the row), the kept
            // ones stored at `at` ≤ q; a store of 8 only where q + 8 ≤ cols (it ends before q + 8: within the row,
            // and on floats already loaded), else of the kept floats alone.
            unsafe {
                let out = dst.add(r * cols);
                for q in (0..cols).step_by(8) {
                    let bits = (keeps[q / 16] >> (q % 16)) as u8;
                    let len = bits.count_ones() as usize;
                    if len == 0 || (len == 8 && at == q) {
                        at += len;
                        continue;
                    }
                    let floats = if q + 8 <= cols {
                        _mm256_loadu_ps(out.add(q))
                    } else {
                        let mut part = [0f32; 8];
                        std::ptr::copy_nonoverlapping(out.add(q), part.as_mut_ptr(), cols - q);
                        _mm256_loadu_ps(part.as_ptr())
                    };
                    store(out.add(at), _mm256_permutevar8x32_ps(floats, left_pack_lanes(bits)), len, q + 8 <= cols);
                    at += len;
                }
            }
        }
        // SAFETY: panel g's steps: at most cols, and 8 past them, within its stride.
        unsafe { write_steps(&keeps[..groups], s.steps.add(g * s.stride)) };
    }
}

/// `pack_a` for an A of bytes: rows `i..i+mc` of A stored transposed (at `a`, its stored rows `lda` apart) over the
/// steps `pc..pc+kc`, converted as `convert` converts them (the same floats) into the same panels. With a
/// selection, each panel keeps only the steps at which its rows are not all zero or B's row is not finite, in
/// order: panel g's kept steps (as `convert_selecting`'s) at `s.steps + g·s.stride`, their count at `s.kept[g]`.
///
/// # Safety
/// The rows and steps are in A; `dst` holds ⌈mc/6⌉·6·kc floats. With a selection, as `convert_selecting`'s.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn pack_a_bytes(
    p: &Product,
    (pc, kc): (usize, usize),
    (i, mc): (usize, usize),
    dst: *mut f32,
    scale: &Scale,
    selection: Option<&mut Selection>,
) {
    let block = ((pc, kc), (i, mc));
    let Some(s) = selection else {
        // SAFETY: the caller's contract.
        return unsafe { pack_steps(p, block, dst, scale) };
    };
    let mut zero = [StepBits::default(); super::PANELS];
    // SAFETY: the caller's contract.
    let any = unsafe { zero_steps(p, block, &mut zero) };
    let (panels, groups) = (mc.div_ceil(MR), kc.div_ceil(16));
    let mut keeps = [StepBits::default(); super::PANELS];
    let mut all = true;
    for (g, (zero, keeps)) in zero.iter().zip(&mut keeps).enumerate().take(panels) {
        // SAFETY: the block's rows of B (the caller's contract).
        let kept = if any { unsafe { keep(p, pc, kc, zero, s, keeps) } } else { kc };
        s.kept[g] = kept;
        all &= kept == kc;
        if kept < kc {
            // SAFETY: panel g's steps: at most kc, and 8 past them, within its stride.
            unsafe { write_steps(&keeps[..groups], s.steps.add(g * s.stride)) };
        }
    }
    // SAFETY: the caller's contract.
    unsafe {
        match all {
            true => pack_steps(p, block, dst, scale),
            false => pack_kept(p, block, dst, scale, &keeps),
        }
    };
}

/// Notes in `zero` the steps at which each panel of the block (of A stored transposed, as `pack_a_bytes` packs
/// it) is all zero; whether any is. A step's bytes are compared 16 at a time, 8 panels (48 bytes) together: the
/// panels whose 6 bytes are all 0 (on random bytes, none) are found from the bits of the bytes that are.
///
/// # Safety
/// As `pack_a_bytes`.
#[target_feature(enable = "avx2,fma")]
unsafe fn zero_steps(
    p: &Product,
    ((pc, kc), (i, mc)): ((usize, usize), (usize, usize)),
    zero: &mut [StepBits; super::PANELS],
) -> bool {
    /// Bit 6g of 8 panels' 48: the first byte of each.
    const FIRST: u64 = 0x0410_4104_1041;
    let (a, lda) = (p.a.cast::<u8>(), p.lda);
    let mut any = false;
    // 8 panels (48 bytes of a step) at a time, every step: where the 48 bytes are all in the block, three loads.
    for eight in (0..mc).step_by(8 * MR) {
        let whole = eight + 8 * MR <= mc;
        // A last panel of fewer rows (`short` of them, from bit `last`) is padded with ones past mc: looked at alone.
        let (last, short) = ((mc - eight) / MR * MR, if whole { 0 } else { (mc - eight) % MR });
        for q in 0..kc {
            // SAFETY: the block's mc bytes of step q (stored row pc+q, from column i) are in A; past them, no byte is
            // read (a copy, padded with ones, which are not 0).
            let parts: [__m128i; 3] = unsafe {
                let from = a.add((pc + q) * lda + i + eight);
                if whole {
                    std::array::from_fn(|part| _mm_loadu_si128(from.add(16 * part).cast()))
                } else {
                    let mut rest = [1u8; 48];
                    std::ptr::copy_nonoverlapping(from, rest.as_mut_ptr(), mc - eight);
                    std::array::from_fn(|part| _mm_loadu_si128(rest.as_ptr().add(16 * part).cast()))
                }
            };
            // Bit b: byte `eight + b` of step q is 0.
            let zeros = parts.iter().enumerate().fold(0u64, |zeros, (part, &bytes)| {
                let mask = _mm_movemask_epi8(_mm_cmpeq_epi8(bytes, _mm_setzero_si128())) as u16;
                zeros | u64::from(mask) << (16 * part)
            });
            // Bit 6g: panel g's 6 bytes are 0 (bytes past mc read as ones).
            let mut panels = zeros & zeros >> 1 & zeros >> 2 & zeros >> 3 & zeros >> 4 & zeros >> 5 & FIRST;
            if short > 0 {
                let rows = (1u64 << short) - 1;
                panels |= u64::from(zeros >> last & rows == rows) << last;
            }
            any |= panels != 0;
            while panels != 0 {
                let g = (eight + panels.trailing_zeros() as usize) / MR;
                zero[g][q / 16] |= 1 << (q % 16);
                panels &= panels - 1;
            }
        }
    }
    any
}

/// Packs every step of the block's panels as `pack_a_bytes` lays them out.
///
/// # Safety
/// As `pack_a_bytes`.
#[target_feature(enable = "avx2,fma")]
unsafe fn pack_steps(p: &Product, ((pc, kc), (i, mc)): ((usize, usize), (usize, usize)), dst: *mut f32, scale: &Scale) {
    let (a, lda) = (p.a.cast::<u8>(), p.lda);
    let (full, tail) = (mc / MR, mc % MR);
    for q in 0..kc {
        // SAFETY: row pc+q of the stored A holds the block's mc bytes from column i, read 6 at a time (an 8-byte
        // load could pass A's end), the last panel's through a copy; panel g's step q lies at g·6·kc + q·6 in dst
        // (the last panel's at full·6·kc + q·tail), and each store writes only that step's 6 (or tail) floats.
        unsafe {
            let src = a.add((pc + q) * lda + i);
            for g in 0..full {
                store_six(src.add(g * MR), dst.add(g * MR * kc + q * MR), scale);
            }
            if tail > 0 {
                store_few(src.add(full * MR), tail, dst.add(full * MR * kc + q * tail), scale);
            }
        }
    }
}

/// Packs the steps of the block's panels that `keeps` keeps (bit s of `keeps[g][c]`: step 16c + s of panel g), in
/// order, as `pack_a_bytes` lays them out: a panel at a time (the block's bytes, kc·mc, stay in L1 meanwhile), so
/// that where its next step goes stays in a register. Every step is stored there, and the place moves on past the
/// kept ones.
///
/// # Safety
/// As `pack_a_bytes`; `keeps` holds the block's panels.
#[target_feature(enable = "avx2,fma")]
unsafe fn pack_kept(
    p: &Product,
    ((pc, kc), (i, mc)): ((usize, usize), (usize, usize)),
    dst: *mut f32,
    scale: &Scale,
    keeps: &[StepBits],
) {
    let (a, lda) = (p.a.cast::<u8>(), p.lda);
    for (g, keeps) in keeps.iter().enumerate().take(mc.div_ceil(MR)) {
        let mr = MR.min(mc - g * MR);
        let (from, panel) = (a.wrapping_add(pc * lda + i + g * MR), dst.wrapping_add(g * MR * kc));
        let mut at = 0;
        for q in 0..kc {
            // SAFETY: row pc+q of the stored A holds the panel's mr bytes; its kept steps lie at g·6·kc + at·mr in
            // dst, at ≤ q < kc, and each store writes only that step's mr floats.
            unsafe {
                match mr {
                    MR => store_six(from.add(q * lda), panel.add(at * MR), scale),
                    _ => store_few(from.add(q * lda), mr, panel.add(at * mr), scale),
                }
            }
            at += usize::from(keeps[q / 16] >> (q % 16) & 1);
        }
    }
}

/// Stores the floats of the 6 bytes at `from` at `to`.
///
/// # Safety
/// 6 bytes at `from`, 6 floats at `to`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn store_six(from: *const u8, to: *mut f32, scale: &Scale) {
    // SAFETY: the caller's contract.
    unsafe {
        // The 6 bytes as 4 and 2, into a register (through memory, a store of 6 and a load of 8 would stall).
        let (four, two) = (from.cast::<i32>().read_unaligned(), from.add(4).cast::<u16>().read_unaligned());
        let row = scale.floats(_mm_insert_epi16::<2>(_mm_cvtsi32_si128(four), i32::from(two)));
        _mm_storeu_ps(to, _mm256_castps256_ps128(row));
        _mm_storel_epi64(to.add(4).cast(), _mm_castps_si128(_mm256_extractf128_ps::<1>(row)));
    }
}

/// Stores the floats of the `len` (< 6) bytes at `from` at `to`.
///
/// # Safety
/// `len` bytes at `from`, `len` floats at `to`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn store_few(from: *const u8, len: usize, to: *mut f32, scale: &Scale) {
    let (mut bytes, mut floats) = ([0u8; 8], [0f32; 8]);
    // SAFETY: the caller's contract.
    unsafe {
        std::ptr::copy_nonoverlapping(from, bytes.as_mut_ptr(), len);
        _mm256_storeu_ps(floats.as_mut_ptr(), scale.floats(_mm_loadl_epi64(bytes.as_ptr().cast())));
        std::ptr::copy_nonoverlapping(floats.as_ptr(), to, len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::finite::FiniteRows;

    /// A panel's selection as the packings make it, by rule: the steps of `0..kc` at which a row of the panel is
    /// not 0 or B's row (pc + the step) is not finite.
    fn kept_steps(
        byte: impl Fn(usize, usize) -> u8,
        rows: std::ops::Range<usize>,
        kc: usize,
        finite: &[bool],
    ) -> Vec<u32> {
        (0..kc).filter(|&q| !finite[q] || rows.clone().any(|r| byte(r, q) != 0)).map(|q| q as u32).collect()
    }

    /// Bytes with black borders, black images and a few non-finite rows of B, packed both ways (`convert_selecting`
    /// for A row-major, `pack_a_bytes` for A stored transposed) from a block that starts past step 0: each panel
    /// keeps exactly the steps that the rule keeps, in order, with the floats `convert` gives them; a scale that
    /// reads 0 as NaN selects nothing.
    #[test]
    fn panels_keep_the_steps_that_are_not_zero() {
        if !super::super::tests::have_avx2() {
            return;
        }
        let (m, n, k, pc, kc) = (23, 5, 250, 30, 197);
        let mut rng = fastrand::Rng::with_seed(31);
        // Image i's pixel q: black near the ends of each 28-pixel row, every fifth image black, else half black.
        let image: Vec<u8> = (0..m * k)
            .map(|x| {
                let (i, q) = (x / k, x % k);
                let border = q % 28 < 4 || q % 28 >= 24;
                if border || i % 5 == 4 || rng.bool() {
                    0
                } else {
                    rng.u8(1..)
                }
            })
            .collect();
        let mut b: Vec<f32> = (0..k * n).map(|_| rng.f32() - 0.5).collect();
        // Non-finite rows of B in both blocks below (steps from 30, and from 2).
        for (q, x) in
            [(pc, f32::INFINITY), (pc + 1, f32::NAN), (pc + 100, f32::NEG_INFINITY), (3, f32::NAN), (7, f32::INFINITY)]
        {
            b[q * n + 2] = x;
        }
        let finite: Vec<bool> = (0..k).map(|q| b[q * n..(q + 1) * n].iter().all(|x| x.is_finite())).collect();
        let scale = Scale::new(ByteScale::Div(255.0));
        // SAFETY: AVX2 and FMA are available.
        assert!(unsafe { scale.zero_is_zero() && !Scale::new(ByteScale::Div(0.0)).zero_is_zero() });
        let want_float = |e: u8| {
            let mut out = [0f32; 1];
            // SAFETY: AVX2 and FMA; one byte into one float.
            unsafe { convert([e].as_ptr(), 1, 1, 1, out.as_mut_ptr(), &scale) };
            out[0]
        };
        for ta in [false, true] {
            // The images as A (m×k, row-major: the first layer), or as Aᵀ stored (its weights' gradient: A's rows are
            // the pixels, its steps the images).
            let mut p = crate::avx512::tests::product(if ta { k } else { m }, n, if ta { m } else { k }, ta, false);
            (p.a, p.b, p.id) = (image.as_ptr().cast(), b.as_ptr(), 1 + u64::from(ta));
            // The block: A's rows i0..i0+mc over the steps pc..pc+kc (for Aᵀ: pixels 40..63 of images 2..20).
            let (i0, mc, pc, kc) = if ta { (40, 23, 2, 19) } else { (0, m, pc, kc) };
            let byte = |r: usize, q: usize| match ta {
                true => image[(pc + q) * p.lda + i0 + r],
                false => image[r * p.lda + pc + q],
            };
            let b_finite = &finite[pc..pc + kc];
            let mut finite_rows = FiniteRows::default();
            finite_rows.start(&p);
            let mut steps = vec![u32::MAX; super::super::PANELS * super::super::STEPS_STRIDE];
            let mut kept = [usize::MAX; super::super::PANELS];
            let mut s = Selection {
                steps: steps.as_mut_ptr(),
                stride: super::super::STEPS_STRIDE,
                kept: &mut kept,
                finite: &mut finite_rows,
            };
            let mut dst = vec![f32::NAN; super::super::MC * super::super::KC_MAX];
            // SAFETY: AVX2 and FMA; the block's bytes are in A, B row-major with its rows; dst and the selection hold a
            // block's panels.
            unsafe {
                match ta {
                    false => {
                        let bytes = (p.a.cast::<u8>().add(pc), p.lda);
                        convert_selecting(&p, pc, bytes, mc, kc, dst.as_mut_ptr(), &scale, &mut s)
                    }
                    true => pack_a_bytes(&p, (pc, kc), (i0, mc), dst.as_mut_ptr(), &scale, Some(&mut s)),
                }
            }
            let mut some_left_out = false;
            for (g, r0) in (0..mc).step_by(MR).enumerate() {
                let mr = MR.min(mc - r0);
                let want = kept_steps(byte, r0..r0 + mr, kc, b_finite);
                let offsets: Vec<u32> = want.iter().map(|q| q * STEP_BYTES).collect();
                assert_eq!(kept[g], want.len(), "ta {ta}: panel {g} keeps {} steps, not {}", kept[g], want.len());
                some_left_out |= want.len() < kc;
                if want.len() < kc {
                    assert_eq!(
                        &steps[g * super::super::STEPS_STRIDE..][..want.len()],
                        &offsets[..],
                        "ta {ta}: panel {g}"
                    );
                }
                for (at, &q) in want.iter().enumerate() {
                    for r in r0..r0 + mr {
                        let got = if ta { dst[r0 * kc + at * mr + (r - r0)] } else { dst[r * kc + at] };
                        let e = byte(r, q as usize);
                        assert_eq!(got.to_bits(), want_float(e).to_bits(), "ta {ta}: row {r}, step {q} (kept {at})");
                    }
                }
            }
            assert!(some_left_out, "ta {ta}: the black steps are left out");
        }
    }
}
