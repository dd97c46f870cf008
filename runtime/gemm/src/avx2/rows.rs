//! Products of one to three rows of C (a batch of one: `x·w` for a single example), B row-major and read where it
//! is stored.
//!
//! The tiles of `block` would pack all of B for a single row of C, and their 6×16 kernel holding one or two rows
//! keeps two or four accumulators, so that it waits on the FMAs' latency: the mlp's first layer at batch 1
//! (1×784 · 784×256) took 54 µs, its weights read at 15 GB/s. Here B streams through once, in order: a single row
//! of C is summed 64 columns at a time in 8 accumulators (each step one broadcast of A and 8 FMAs on B's row),
//! two rows 32 columns at a time (8 accumulators, B's 4 vectors loaded once for both rows). A third row is a
//! single row's pass. The threads share the columns.
//!
//! The AVX-512 kernels hand their few-row products here too: their tiles pack all of B as well (on Zen 4 the mlp's
//! forward pass at batch 1 took 15–19 µs so, 10–15 here; docs/benchmarks.md).

use std::arch::x86_64::*;

use super::{convert, finish_tile, Scale, WHOLE};
use crate::avx512::Product;
use crate::pool;

/// The most rows of C computed this way; from 4 rows on the 6×16 tiles keep 8 accumulators or more.
const MAX_ROWS: usize = 3;
/// Columns of a chunk of a parallel product: a whole block of one row (8 vectors).
const CHUNK_COLUMNS: usize = 64;
/// Products whose B has at least this many floats (256 KiB, about 8 µs of one thread's reading) are shared among
/// the threads by columns.
const PARALLEL_MIN_FLOATS: usize = 1 << 16;

/// Whether `p` (as oriented) is computed here: at most `MAX_ROWS` rows, B row-major.
fn applies(p: &Product) -> bool {
    p.m <= MAX_ROWS && !p.tb
}

/// `p`, or `Cᵀ = Bᵀ·Aᵀ` where `p` may be transposed (`Product::fixed`), as computed here; `None` if neither applies.
pub(crate) fn oriented(p: &Product) -> Option<Product> {
    [*p, p.transposed()].into_iter().take(if p.fixed() { 1 } else { 2 }).find(applies)
}

/// Computes `p`, which `applies`, on this thread and, when `threads` > 1 and B is large, rayon's workers.
///
/// # Safety
/// AVX2 and FMA, and every element of A, B and C that `p` addresses is in bounds.
pub(crate) unsafe fn sgemm(p: &Product, threads: usize) {
    // Bytes are converted once, before the chunks: m·k of them, at most three rows.
    let mut whole = None;
    let p = match p.bytes {
        None => *p,
        Some(scale) => {
            let mut buf = WHOLE.take();
            let floats = buf.ptr(p.m * p.k);
            let (rows, cols) = if p.ta { (p.k, p.m) } else { (p.m, p.k) };
            // SAFETY: A's bytes are `rows` stored rows of `cols`, `lda` apart (the caller's contract); `floats`
            // holds m·k.
            unsafe { convert(p.a.cast::<u8>(), p.lda, rows, cols, floats, &Scale::new(scale)) };
            whole = Some(buf);
            Product { a: floats.cast_const(), lda: cols, bytes: None, ..*p }
        }
    };
    let units = p.n.div_ceil(CHUNK_COLUMNS);
    let chunks = if threads > 1 && p.k * p.n >= PARALLEL_MIN_FLOATS { units.min(2 * threads) } else { 1 };
    let columns = |c: usize| {
        let (lo, hi) = (units * c / chunks * CHUNK_COLUMNS, (units * (c + 1) / chunks * CHUNK_COLUMNS).min(p.n));
        // SAFETY: chunks write disjoint columns of C; the caller's contract covers A and B.
        unsafe { columns_of(&p, lo, hi) };
    };
    if chunks > 1 {
        pool::run_chunks(chunks, threads - 1, &columns);
    } else {
        columns(0);
    }
    if let Some(buf) = whole {
        WHOLE.set(buf);
    }
}

/// Columns `j0..j1` of every row of `p`: pairs of rows, then a last single row.
///
/// # Safety
/// As `sgemm`, for `p` without bytes.
#[target_feature(enable = "avx2,fma")]
unsafe fn columns_of(p: &Product, j0: usize, j1: usize) {
    // Where A's row i, step q is: a[i·row + q·step].
    let (row, step) = if p.ta { (1, p.lda) } else { (p.lda, 1) };
    let mut i = 0;
    while i < p.m {
        let rows = if p.m - i >= 2 { 2 } else { 1 };
        let width = 8 * if rows == 2 { 4 } else { 8 };
        let mut j = j0;
        while j < j1 {
            let cols = width.min(j1 - j);
            // SAFETY: rows i.. of A, columns j..j+cols of B and C are in bounds (the caller's contract).
            unsafe {
                let a = p.a.add(i * row);
                let b = p.b.add(j);
                let mut sums = [[0f32; 64]; 2];
                match rows {
                    2 => sum_rows::<2, 4>(p.k, a, row, step, b, p.ldb, cols, &mut sums),
                    _ => sum_rows::<1, 8>(p.k, a, row, step, b, p.ldb, cols, &mut sums),
                }
                store(p, i, rows, j, cols, &sums);
            }
            j += cols;
        }
        i += rows;
    }
}

/// `sums[r][..cols] = Σ_q a[r·row + q·step] · b[q·ldb + ..cols]` for the R rows, B's columns in V vectors of 8 (the
/// last read through a mask where `cols` < 8·V; vectors wholly past `cols` are not read).
///
/// # Safety
/// AVX2 and FMA; A's R rows over k steps and B's k rows of `cols` floats are in bounds; R ≤ 2 and 8·V ≤ 64.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
unsafe fn sum_rows<const R: usize, const V: usize>(
    k: usize,
    a: *const f32,
    row: usize,
    step: usize,
    b: *const f32,
    ldb: usize,
    cols: usize,
    sums: &mut [[f32; 64]; 2],
) {
    let full = cols / 8;
    if full == V {
        // SAFETY: the caller's contract, every vector whole.
        unsafe { sum_vectors::<R, V, V>(k, a, row, step, b, ldb, _mm256_setzero_si256(), sums) };
        return;
    }
    let tail = cols % 8;
    let lanes: [i32; 8] = std::array::from_fn(|l| if l < tail { -1 } else { 0 });
    // SAFETY: `lanes` is 8 i32s.
    let mask = unsafe { _mm256_loadu_si256(lanes.as_ptr().cast()) };
    // SAFETY: the caller's contract: `full` (< V) whole vectors, then one of `tail` columns through the mask.
    unsafe {
        match full {
            0 => sum_vectors::<R, V, 0>(k, a, row, step, b, ldb, mask, sums),
            1 => sum_vectors::<R, V, 1>(k, a, row, step, b, ldb, mask, sums),
            2 => sum_vectors::<R, V, 2>(k, a, row, step, b, ldb, mask, sums),
            3 => sum_vectors::<R, V, 3>(k, a, row, step, b, ldb, mask, sums),
            4 => sum_vectors::<R, V, 4>(k, a, row, step, b, ldb, mask, sums),
            5 => sum_vectors::<R, V, 5>(k, a, row, step, b, ldb, mask, sums),
            6 => sum_vectors::<R, V, 6>(k, a, row, step, b, ldb, mask, sums),
            7 => sum_vectors::<R, V, 7>(k, a, row, step, b, ldb, mask, sums),
            _ => unreachable!("a block of at most 64 columns"),
        }
    }
}

/// `sum_rows` over V vectors of which the first `FULL` are read whole and the one after them (if it is below V)
/// through `mask`; the vectors after that are left out.
///
/// # Safety
/// As `sum_rows`, with `cols` = 8·FULL plus the mask's lanes.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
unsafe fn sum_vectors<const R: usize, const V: usize, const FULL: usize>(
    k: usize,
    a: *const f32,
    row: usize,
    step: usize,
    b: *const f32,
    ldb: usize,
    mask: __m256i,
    sums: &mut [[f32; 64]; 2],
) {
    let used = if FULL < V { FULL + 1 } else { V };
    let mut acc = [[_mm256_setzero_ps(); V]; R];
    // SAFETY: step q reads A's R elements a[r·row + q·step] and B's row q, its whole vectors and the masked one
    // (lanes past `cols` not read).
    unsafe {
        let (mut a, mut b) = (a, b);
        for _ in 0..k {
            let mut bv = [_mm256_setzero_ps(); V];
            for (v, x) in bv.iter_mut().enumerate().take(used) {
                *x = if v < FULL { _mm256_loadu_ps(b.add(8 * v)) } else { _mm256_maskload_ps(b.add(8 * v), mask) };
            }
            for (r, sums) in acc.iter_mut().enumerate() {
                let x = _mm256_broadcast_ss(&*a.add(r * row));
                for (sum, y) in sums.iter_mut().zip(&bv).take(used) {
                    *sum = _mm256_fmadd_ps(x, *y, *sum);
                }
            }
            a = a.add(step);
            b = b.add(ldb);
        }
        for (out, acc) in sums.iter_mut().zip(&acc) {
            for (v, x) in acc.iter().enumerate().take(used) {
                _mm256_storeu_ps(out.as_mut_ptr().add(8 * v), *x);
            }
        }
    }
}

/// Stores rows `i..i+rows`, columns `j..j+cols` of the product from `sums`: scaled by α, added to C when
/// `accumulate`, then finished by the epilogue.
///
/// # Safety
/// As `sgemm`, for the block.
#[target_feature(enable = "avx2,fma")]
unsafe fn store(p: &Product, i: usize, rows: usize, j: usize, cols: usize, sums: &[[f32; 64]; 2]) {
    for (r, sums) in sums.iter().enumerate().take(rows) {
        for (c, &sum) in sums.iter().enumerate().take(cols) {
            let (i, j) = (i + r, j + c);
            // SAFETY: element (i, j) is in C (the caller's contract).
            unsafe {
                let at = if p.tc { p.c.add(j * p.ldc + i) } else { p.c.add(i * p.ldc + j) };
                *at = if p.accumulate { *at + p.alpha * sum } else { p.alpha * sum };
            }
        }
    }
    if p.epilogue() {
        // SAFETY: the block is in C, which is not transposed when there is an epilogue; the bias holds n floats
        // and the mask is laid out as C.
        unsafe {
            let bias = if p.bias.is_null() { p.bias } else { p.bias.add(j) };
            let mask = if p.mask.is_null() { p.mask } else { p.mask.add(i * p.ldc + j) };
            finish_tile(p.c.add(i * p.ldc + j), p.ldc, rows, cols, (bias, p.relu, mask));
        }
    }
}

#[cfg(test)]
mod tests {
    //! The few-rows products called through `avx2::sgemm`, against a naive product in f64: one to three rows, every
    //! tail of the 64- and 32-column blocks, A stored either way or as bytes, C stored transposed, α, accumulation,
    //! epilogues; and the threads' split by columns, to the bit.

    use super::super::sgemm;
    use super::super::tests::have_avx2;
    use super::*;
    use crate::avx512::split_writes_the_same_bits;
    use crate::ByteScale;

    /// A product's operands, and C as it was before.
    struct Operands {
        raw: Vec<u8>,
        floats: Vec<f32>,
        b: Vec<f32>,
        c0: Vec<f32>,
        bias: Vec<f32>,
        mask: Vec<f32>,
    }

    #[derive(Clone, Copy, Debug)]
    struct Shape {
        m: usize,
        n: usize,
        k: usize,
        ta: bool,
        tc: bool,
        bytes: bool,
        accumulate: bool,
        alpha: f32,
        /// bias, relu, mask
        epilogue: (bool, bool, bool),
    }

    impl Shape {
        fn lda(&self) -> usize {
            if self.ta {
                self.m
            } else {
                self.k
            }
        }

        fn ldc(&self) -> usize {
            if self.tc {
                self.m
            } else {
                self.n
            }
        }

        fn product(&self, o: &Operands, c: *mut f32) -> Product {
            let (bias, relu, mask) = self.epilogue;
            Product {
                m: self.m,
                n: self.n,
                k: self.k,
                a: if self.bytes { o.raw.as_ptr().cast() } else { o.floats.as_ptr() },
                lda: self.lda(),
                ta: self.ta,
                b: o.b.as_ptr(),
                ldb: self.n,
                tb: false,
                c,
                ldc: self.ldc(),
                tc: self.tc,
                accumulate: self.accumulate,
                alpha: self.alpha,
                bytes: self.bytes.then_some(ByteScale::Div(255.0)),
                bias: if bias { o.bias.as_ptr() } else { std::ptr::null() },
                relu,
                mask: if mask { o.mask.as_ptr() } else { std::ptr::null() },
                sums: std::ptr::null_mut(),
                b_rewritten: false,
                b_panels: std::ptr::null(),
                id: 0,
            }
        }

        /// Element (i, j) of C as it should be.
        fn want(&self, o: &Operands, i: usize, j: usize) -> f64 {
            let at = |q: usize| {
                let x = if self.ta { q * self.m + i } else { i * self.k + q };
                if self.bytes {
                    f64::from(ByteScale::Div(255.0).apply(o.raw[x]))
                } else {
                    f64::from(o.floats[x])
                }
            };
            let sum: f64 = (0..self.k).map(|q| at(q) * f64::from(o.b[q * self.n + j])).sum();
            let at_c = if self.tc { j * self.ldc() + i } else { i * self.ldc() + j };
            let mut want = f64::from(self.alpha) * sum + if self.accumulate { f64::from(o.c0[at_c]) } else { 0.0 };
            let (bias, relu, mask) = self.epilogue;
            if bias {
                want += f64::from(o.bias[j]);
            }
            if relu {
                want = want.max(0.0);
            }
            if mask && o.mask[i * self.n + j] <= 0.0 {
                want = 0.0;
            }
            want
        }
    }

    fn operands(rng: &mut fastrand::Rng, s: &Shape) -> Operands {
        Operands {
            raw: (0..s.m * s.k).map(|_| rng.u8(..)).collect(),
            floats: (0..s.m * s.k).map(|_| rng.f32() - 0.5).collect(),
            b: (0..s.k * s.n).map(|_| rng.f32() - 0.5).collect(),
            c0: (0..s.m * s.n).map(|_| rng.f32() - 0.5).collect(),
            bias: (0..s.n).map(|_| rng.f32() - 0.5).collect(),
            mask: (0..s.m * s.n).map(|_| rng.f32() - 0.3).collect(),
        }
    }

    #[test]
    fn few_rows_match_a_naive_product() {
        if !have_avx2() {
            return;
        }
        let mut rng = fastrand::Rng::with_seed(23);
        // The mlp's and cnn's layers at batch 1, every column tail of both blocks, short and long reductions.
        let mut sizes = vec![(1, 256, 784), (1, 256, 256), (1, 64, 1600), (2, 256, 256), (3, 300, 129)];
        for n in 1..=70 {
            sizes.push((1 + n % 3, n, 1 + rng.usize(0..40)));
        }
        for (m, n, k) in sizes {
            let epilogue_on = rng.bool();
            let s = Shape {
                m,
                n,
                k,
                ta: rng.bool(),
                tc: !epilogue_on && rng.bool(),
                bytes: rng.bool(),
                accumulate: !epilogue_on && rng.bool(),
                alpha: if epilogue_on || rng.bool() { 1.0 } else { rng.f32() * 4.0 - 2.0 },
                epilogue: if epilogue_on { (rng.bool(), rng.bool(), rng.bool()) } else { (false, false, false) },
            };
            let o = operands(&mut rng, &s);
            let p = s.product(&o, std::ptr::null_mut());
            assert!(applies(&p), "{s:?}");
            let mut c = o.c0.clone();
            // SAFETY: AVX2 and FMA are available; the operands hold every element the product addresses.
            unsafe { sgemm(s.product(&o, c.as_mut_ptr()), rng.bool()) };
            for i in 0..m {
                for j in 0..n {
                    let want = s.want(&o, i, j);
                    let got = f64::from(c[if s.tc { j * s.ldc() + i } else { i * s.ldc() + j }]);
                    let tolerance = 1e-5 * (k as f64).sqrt() * (1.0 + want.abs());
                    assert!((got - want).abs() <= tolerance, "{s:?}: c[{i}, {j}] {got} ≠ {want}");
                }
            }
        }
    }

    /// The threads share B's columns; each element's sum is the same as one thread's, to the bit.
    #[test]
    fn few_rows_split_to_the_same_bits() {
        if !have_avx2() {
            return;
        }
        let mut rng = fastrand::Rng::with_seed(24);
        for (m, n, k) in [(1, 256, 784), (2, 300, 256), (3, 200, 400)] {
            assert!(k * n >= PARALLEL_MIN_FLOATS);
            let s = Shape {
                m,
                n,
                k,
                ta: false,
                tc: false,
                bytes: m == 1,
                accumulate: false,
                alpha: 1.0,
                epilogue: (true, true, m == 2),
            };
            let o = operands(&mut rng, &s);
            let one =
                split_writes_the_same_bits(sgemm, &format!("{m}×{n}×{k}, few rows"), m * n, |c| s.product(&o, c));
            let (i, j) = (m - 1, n - 1);
            assert!((f64::from(one[i * n + j]) - s.want(&o, i, j)).abs() <= 1e-4, "{m}×{n}×{k} at {i}, {j}");
        }
    }
}
