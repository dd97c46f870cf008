//! Which rows of a product's B are finite: a step at which a panel of A is all zero may be left out of the sum only
//! where its row of B is finite, since 0·∞ and 0·NaN are NaN. Both kernels' packings of bytes ask (`avx512::pack`,
//! `avx2::bytes`).

use std::arch::x86_64::*;

use crate::avx512::Product;

/// Where the packings of bytes leave out the steps at which a panel of A is all zero: those add nothing to C. A step
/// is left out only where its row of B is finite, since 0·∞ and 0·NaN are NaN (`FiniteRows`), and a byte 0 is read
/// as ±0 (`Convert::zero_is_zero`, `Scale::zero_is_zero`); the accumulators start at +0, to which ±0 adds nothing,
/// so that C is the same to the bit.
pub(crate) struct Selection<'a> {
    /// Panel g's kept steps at `steps[(g - g0)·stride..]`: their indices into pc..pc+kc (the AVX2 kernels': those
    /// times `avx2::bytes::STEP_BYTES`); `stride` ≥ kc + 16 (they are stored 16 or 8 at a time).
    pub(crate) steps: *mut u32,
    pub(crate) stride: usize,
    /// How many steps each panel of the group keeps.
    pub(crate) kept: &'a mut [usize],
    pub(crate) finite: &'a mut FiniteRows,
}

/// The reductions whose rows `reserve_thread` makes room for: every product of dfc's examples (the first layer's 784
/// steps, a convolution's weight gradient's 7,744).
pub(crate) const RESERVED_STEPS: usize = 1 << 14;

/// Which rows of a product's B are finite, found as they are asked for: one product's (`Product::id`).
#[derive(Default)]
pub(crate) struct FiniteRows {
    of: u64,
    /// Bit q of these words: whether row q is known, and whether it is finite (one word of slack at the end).
    known: Vec<u64>,
    finite: Vec<u64>,
}

impl FiniteRows {
    /// Room for the rows of products of up to `k` steps, so that a thread's first such product allocates nothing
    /// (`reserve_thread`).
    pub(crate) fn reserve(&mut self, k: usize) {
        self.known.reserve(k / 64 + 2);
        self.finite.reserve(k / 64 + 2);
    }

    /// Forgets the rows of another product than `p` (`p.id` is the call's, not 0).
    pub(crate) fn start(&mut self, p: &Product) {
        debug_assert!(p.id != 0, "a product's rows are known by its call's id");
        let words = p.k / 64 + 2;
        if self.of != p.id || self.known.len() != words {
            self.known.clear();
            self.known.resize(words, 0);
            self.finite.clear();
            self.finite.resize(words, 0);
            self.of = p.id;
        }
    }

    /// The bits s of `want` for which row `q + s` of B (stored row-major) is finite.
    ///
    /// # Safety
    /// `start(p)` was called; the CPU has AVX2; B is stored row-major (`!p.tb`), and the rows asked for are B's.
    #[inline(always)]
    pub(crate) unsafe fn rows(&mut self, p: &Product, q: usize, want: u16) -> u16 {
        let unknown = want & !bits(&self.known, q);
        if unknown != 0 {
            // SAFETY: the caller's contract.
            unsafe { self.learn(p, q, unknown) };
        }
        want & bits(&self.finite, q)
    }

    /// Finds whether rows `q + s` are finite, for the bits s of `unknown`. Apart, and cold: once per row a product.
    ///
    /// # Safety
    /// As `rows`.
    #[cold]
    #[inline(never)]
    #[target_feature(enable = "avx2")]
    unsafe fn learn(&mut self, p: &Product, q: usize, unknown: u16) {
        for s in 0..16 {
            if unknown >> s & 1 == 1 {
                // SAFETY: row q + s is B's (the caller's contract).
                let finite = unsafe { row_finite(p, q + s) };
                let (word, bit) = ((q + s) / 64, 1 << ((q + s) % 64));
                self.known[word] |= bit;
                self.finite[word] |= if finite { bit } else { 0 };
            }
        }
    }
}

/// Bits `q..q + 16` of a bit vector (with a word of slack past them).
#[inline]
fn bits(words: &[u64], q: usize) -> u16 {
    let (word, shift) = (q / 64, q % 64);
    let low = words[word] >> shift;
    let high = if shift > 48 { words[word + 1] << (64 - shift) } else { 0 };
    (low | high) as u16
}

/// Whether all n elements of row q of B (stored row-major) are finite.
///
/// # Safety
/// The CPU has AVX2; B is stored row-major and q < k.
#[target_feature(enable = "avx2")]
unsafe fn row_finite(p: &Product, q: usize) -> bool {
    // SAFETY: row q's n elements are B's (the caller's contract).
    let row = unsafe { std::slice::from_raw_parts(p.b.add(q * p.ldb), p.n) };
    // x - x is 0 where x is finite, NaN where it is ±∞ or NaN.
    let mut sum = _mm256_setzero_ps();
    let mut vectors = row.chunks_exact(8);
    for v in &mut vectors {
        // SAFETY: 8 floats of the row.
        let x = unsafe { _mm256_loadu_ps(v.as_ptr()) };
        sum = _mm256_add_ps(sum, _mm256_sub_ps(x, x));
    }
    _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(sum, sum)) == 0
        && vectors.remainder().iter().all(|x| x.is_finite())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows with ±∞ or NaN anywhere (in a vector or the tail) are not finite; the answers are kept per product and
    /// forgotten for another.
    #[test]
    fn rows_with_infinities_or_nans_are_not_finite() {
        if !(is_x86_feature_detected!("avx2")) {
            crate::skip::skip(crate::skip::Need::Avx2, "this CPU has no AVX2");
            return;
        }
        let (k, n) = (40, 13);
        let mut b: Vec<f32> = (0..k * n).map(|x| x as f32 * 0.5 - 3.0).collect();
        let bad = [(0, 0, f32::INFINITY), (3, 12, f32::NAN), (17, 7, f32::NEG_INFINITY), (39, 8, f32::NAN)];
        for (q, j, x) in bad {
            b[q * n + j] = x;
        }
        let mut p = crate::avx512::tests::product(1, n, k, false, false);
        (p.b, p.ldb, p.id) = (b.as_ptr(), n, 7);
        let mut rows = FiniteRows::default();
        rows.start(&p);
        for q in [0, 16, 24, 32] {
            // SAFETY: AVX2; B is row-major, and rows q..q+16 past k are not asked for.
            let finite = unsafe { rows.rows(&p, q, if q + 16 <= k { 0xffff } else { (1 << (k - q)) - 1 }) };
            for s in 0..16.min(k - q) {
                let want = !bad.iter().any(|&(r, _, _)| r == q + s);
                assert_eq!(finite >> s & 1 == 1, want, "row {}", q + s);
            }
        }
        // Another product (the same B, another call) learns again: a row made finite reads as finite.
        b[3 * n + 12] = 1.0;
        p.id = 8;
        rows.start(&p);
        // SAFETY: as above.
        assert_eq!(unsafe { rows.rows(&p, 0, 0b1001) }, 0b1000);
    }
}
