//! Rows of an A of bytes grouped by how much of them is black, for the products that a training step's first layer
//! splits along its reduction (`avx512`'s `Split::Depth`, `avx2`'s `by_reduction`). A panel of A leaves out the steps
//! at which all its rows are 0 (`finite::Selection`); images taken in their batch's order share few such steps (on
//! Fashion-MNIST's, 9–11 % of a 12-row panel's steps, 15–16 % of a 6-row panel's), images sorted by the distance
//! from their first lit byte to their last share 24–26 % and 29–33 % (docs/benchmarks.md, the fortieth session).
//! Each chunk of the reduction then computes its steps of the sorted rows, gathered into a buffer of its own, into a
//! partial sum of its own (`chunk`), and C's row r is the sum of the partials' rows at `inverse[r]`. Each row's sum
//! is computed as before, step by step in the same order, so C is the same to the bit.

use std::sync::Mutex;

use crate::avx512::{Buf, Product, CALLS};

/// The sort of a product's rows, and the buffers its chunks gather their bytes into.
#[derive(Default)]
pub(crate) struct Grouping {
    /// Row `order[j]` of A is row j of the sorted rows; row r of A is row `inverse[r]` of them.
    pub(crate) order: Vec<u32>,
    pub(crate) inverse: Vec<u32>,
    keys: Vec<(u32, u32)>,
    /// Each chunk's steps of the sorted rows.
    gathered: Vec<Buf>,
}

/// Rows looked at before the rest (`Grouping::of`).
const SAMPLED_ROWS: usize = 16;

/// The vectors of the last grouping, reused by the next (so that a step allocates nothing).
static REUSED: Mutex<Option<Grouping>> = Mutex::new(None);

impl Grouping {
    /// The rows of `p` sorted by the distance from their first nonzero byte to their last (rows of nothing but zeros
    /// first, ties in their order), where A holds bytes stored row-major, C is written (not accumulated, not
    /// transposed), and the rows' spans differ and are not in order already; `None` otherwise. Hand it back to
    /// `keep` once the product is done.
    ///
    /// # Safety
    /// A's m rows of k bytes, `lda` apart, are readable.
    pub(crate) unsafe fn of(p: &Product, panel_rows: usize) -> Option<Grouping> {
        let mut g = REUSED.lock().unwrap_or_else(|e| e.into_inner()).take().unwrap_or_default();
        // SAFETY: the caller's contract.
        let sorted = unsafe { g.sort(p, panel_rows) };
        if !sorted {
            Grouping::keep(Some(g));
            return None;
        }
        Some(g)
    }

    /// Keeps a grouping's vectors for the next product's.
    pub(crate) fn keep(g: Option<Grouping>) {
        if g.is_some() {
            *REUSED.lock().unwrap_or_else(|e| e.into_inner()) = g;
        }
    }

    /// `of`'s sort into these vectors; whether it sorted them.
    ///
    /// # Safety
    /// As `of`.
    unsafe fn sort(&mut self, p: &Product, panel_rows: usize) -> bool {
        if p.bytes.is_none() || p.ta || p.tc || p.accumulate || p.m < 2 * panel_rows || p.k == 0 {
            return false;
        }
        self.keys.clear();
        for r in 0..p.m {
            // SAFETY: row r's k bytes are readable (the caller's contract).
            let row = unsafe { std::slice::from_raw_parts(p.a.cast::<u8>().add(r * p.lda), p.k) };
            self.keys.push((lit_span(row) as u32, r as u32));
            // The first 16 rows all lit within a sixteenth of their ends: random bytes, most likely (the benchmarks'),
            // whose rows the scan of all would take 1–2 µs to find so, cold in the cache as they come (the mlp's
            // first layer on random bytes, AVX-512, in a training step). 65 % of Fashion-MNIST's images are so: one
            // batch in 900.
            if r == SAMPLED_ROWS - 1 && self.keys.iter().all(|&(span, _)| span as usize >= p.k - p.k / 16) {
                return false;
            }
        }
        // Rows whose spans differ by less than an eighth of a row gain too little to pay for gathering them (random
        // bytes, as benchmarks feed, span whole rows).
        let (least, most) =
            self.keys.iter().fold((u32::MAX, 0), |(least, most), &(span, _)| (least.min(span), most.max(span)));
        if ((most - least) as usize) < p.k / 8 || self.keys.windows(2).all(|w| w[0] <= w[1]) {
            return false;
        }
        self.keys.sort_unstable();
        self.order.clear();
        self.order.extend(self.keys.iter().map(|&(_, r)| r));
        self.inverse.clear();
        self.inverse.resize(p.m, 0);
        for (j, &r) in self.order.iter().enumerate() {
            self.inverse[r as usize] = j as u32;
        }
        true
    }

    /// Room for `chunks` chunks' gathered bytes of `p` (each at most m·k bytes), and their addresses.
    pub(crate) fn buffers(&mut self, p: &Product, chunks: usize, addresses: &mut [usize]) {
        if self.gathered.len() < chunks {
            self.gathered.resize_with(chunks, Buf::default);
        }
        for (address, buf) in addresses.iter_mut().zip(&mut self.gathered).take(chunks) {
            *address = buf.ptr((p.m * p.k).div_ceil(4)) as usize;
        }
    }
}

/// How many bytes lie from a row's first nonzero byte to its last, both included (0 for a row of zeros): a
/// silhouette's extent, which images of one kind share (shirts, trousers, shoes).
fn lit_span(row: &[u8]) -> usize {
    // Eight bytes at a time from either end (a random row, as benchmarks feed, is lit at both: one word each), and
    // the last few bytes of a row not a multiple of 8 long.
    let word = |bytes: &[u8]| u64::from_le_bytes(bytes.try_into().expect("8 bytes"));
    let whole = row.len() / 8 * 8;
    let in_words = |(w, bytes): (usize, &[u8])| Some((w, word(bytes))).filter(|&(_, v)| v != 0);
    let first =
        row.chunks_exact(8).enumerate().find_map(in_words).map(|(w, v)| w * 8 + v.trailing_zeros() as usize / 8);
    let Some(first) = first.or_else(|| row[whole..].iter().position(|&b| b != 0).map(|q| whole + q)) else {
        return 0;
    };
    let last = row[whole..].iter().rposition(|&b| b != 0).map(|q| whole + q).or_else(|| {
        let back = row.chunks_exact(8).enumerate().rev().find_map(in_words);
        back.map(|(w, v)| w * 8 + 7 - v.leading_zeros() as usize / 8)
    });
    last.unwrap_or(first) + 1 - first
}

/// Chunk `chunk`'s product: steps `k0..k1` of the sorted rows (gathered at `gathered`, k1 − k0 bytes a row) times
/// rows `k0..k1` of B, into the partial sum at `partial` (m×n, n apart), without the epilogue; a call of its own
/// (`id`), since the packed blocks a thread keeps are known by their call and steps.
///
/// # Safety
/// A's sorted rows' bytes `k0..k1` are readable, and the gathered buffer holds m·(k1 − k0) bytes.
pub(crate) unsafe fn chunk(
    p: &Product,
    order: &[u32],
    (k0, k1): (usize, usize),
    gathered: *mut u8,
    partial: *mut f32,
) -> Product {
    let steps = k1 - k0;
    for (j, &r) in order.iter().enumerate() {
        // SAFETY: row r's bytes k0..k1 are in A, and row j of the buffer holds `steps` bytes (the caller's contract).
        unsafe {
            std::ptr::copy_nonoverlapping(p.a.cast::<u8>().add(r as usize * p.lda + k0), gathered.add(j * steps), steps)
        };
    }
    let b = if p.tb { p.b.wrapping_add(k0) } else { p.b.wrapping_add(k0 * p.ldb) };
    Product {
        k: steps,
        a: gathered.cast_const().cast(),
        lda: steps,
        b,
        c: partial,
        ldc: p.n,
        tc: false,
        accumulate: false,
        bias: std::ptr::null(),
        relu: false,
        mask: std::ptr::null(),
        sums: std::ptr::null_mut(),
        b_panels: std::ptr::null(),
        id: CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        ..*p
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::avx512::tests::product;
    use crate::ByteScale;

    /// Images whose black differs (a lit span of its own length each, black pixels within it too), split along the
    /// reduction on 2 and 3 threads by `sgemm` (which `splits` says it does): in the order of their spans (not
    /// grouped) and shuffled (grouped into panels of `panel_rows`), C's rows are the same to the bit, with the
    /// epilogue, α and accumulation.
    pub(crate) fn give_the_same_bits(
        sgemm: unsafe fn(Product, bool),
        panel_rows: usize,
        splits: impl Fn(&Product, usize) -> bool,
    ) {
        let mut rng = fastrand::Rng::with_seed(40);
        for (threads, (m, n, k)) in [(2, (128, 256, 784)), (3, (97, 120, 700))] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a pool");
            // Row i (in span order) lit over `i·(k − 60)/m + 60` bytes from a random start, a third of them black.
            let sorted: Vec<u8> = (0..m)
                .flat_map(|i| {
                    let span = i * (k - 60) / m + 60;
                    let start = rng.usize(..=k - span);
                    let mut row = vec![0u8; k];
                    for (q, byte) in row.iter_mut().enumerate().skip(start).take(span) {
                        let edge = q == start || q + 1 == start + span;
                        *byte = if edge || rng.u8(..) > 85 { rng.u8(1..) } else { 0 };
                    }
                    row
                })
                .collect();
            let mut shuffled_rows: Vec<usize> = (0..m).collect();
            rng.shuffle(&mut shuffled_rows);
            let shuffle = |x: &[f32], width: usize| -> Vec<f32> {
                shuffled_rows.iter().flat_map(|&i| x[i * width..(i + 1) * width].to_vec()).collect()
            };
            let shuffled_bytes: Vec<u8> =
                shuffled_rows.iter().flat_map(|&i| sorted[i * k..(i + 1) * k].to_vec()).collect();
            let b: Vec<f32> = (0..k * n).map(|_| rng.f32() - 0.5).collect();
            let bias: Vec<f32> = (0..n).map(|_| rng.f32() - 0.5).collect();
            let mask: Vec<f32> = (0..m * n).map(|_| rng.f32() - 0.3).collect();
            let c0: Vec<f32> = (0..m * n).map(|_| rng.f32() - 0.5).collect();
            for (accumulate, alpha, epilogue) in [(false, 1.0, true), (true, -0.25, false), (false, 0.5, false)] {
                let product = |bytes: &[u8], mask: &[f32], c: &mut [f32]| Product {
                    a: bytes.as_ptr().cast(),
                    b: b.as_ptr(),
                    c: c.as_mut_ptr(),
                    accumulate,
                    alpha,
                    bytes: Some(ByteScale::Div(255.0)),
                    bias: if epilogue { bias.as_ptr() } else { std::ptr::null() },
                    relu: epilogue,
                    mask: if epilogue { mask.as_ptr() } else { std::ptr::null() },
                    b_rewritten: true,
                    ..product(m, n, k, false, false)
                };
                let mut in_order = c0.clone();
                let in_order_product = product(&sorted, &mask, &mut in_order);
                let (shuffled_mask, mut grouped) = (shuffle(&mask, n), shuffle(&c0, n));
                let grouped_product = product(&shuffled_bytes, &shuffled_mask, &mut grouped);
                assert!(splits(&grouped_product, threads), "{m}×{n}×{k} is split along its reduction");
                // SAFETY: the bytes hold m rows of k.
                let groups = |p: &Product| unsafe { Grouping::of(p, panel_rows) }.is_some();
                assert!(!groups(&in_order_product), "rows in the order of their spans stay as they are");
                // (Where C is accumulated into, the product leaves its rows in place: asked of the same rows written.)
                assert!(groups(&Product { accumulate: false, ..grouped_product }), "shuffled rows are grouped");
                // SAFETY: the caller's kernels run here; the operands hold every element the products address.
                pool.install(|| unsafe {
                    sgemm(in_order_product, true);
                    sgemm(grouped_product, true);
                });
                let want = shuffle(&in_order, n);
                let same = grouped.iter().zip(&want).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(
                    same,
                    "{m}×{n}×{k} on {threads} threads, accumulate {accumulate}, α {alpha}, epilogue {epilogue}"
                );
            }
        }
    }

    /// Random bytes span whole rows: not grouped.
    #[test]
    fn random_bytes_are_not_grouped() {
        let mut rng = fastrand::Rng::with_seed(3);
        let (m, k) = (128, 784);
        let bytes: Vec<u8> = (0..m * k).map(|_| rng.u8(..)).collect();
        let p = Product {
            a: bytes.as_ptr().cast(),
            bytes: Some(ByteScale::Div(255.0)),
            b_rewritten: true,
            ..product(m, 16, k, false, false)
        };
        // SAFETY: the bytes hold m rows of k.
        assert!(unsafe { Grouping::of(&p, 6) }.is_none());
    }

    #[test]
    fn a_rows_lit_span_runs_from_its_first_lit_byte_to_its_last() {
        let mut row = vec![0u8; 100];
        assert_eq!(lit_span(&row), 0);
        row[40] = 1;
        assert_eq!(lit_span(&row), 1);
        row[97] = 3;
        assert_eq!(lit_span(&row), 58);
        row[0] = 9;
        assert_eq!(lit_span(&row), 98);
        let mut tail = vec![0u8; 70];
        tail[66] = 1;
        tail[68] = 1;
        assert_eq!(lit_span(&tail), 3, "lit only past the last whole piece");
        assert_eq!(lit_span(&[]), 0);
        // Against a naive count, rows of every length up to 40 with a few lit bytes anywhere.
        let mut rng = fastrand::Rng::with_seed(5);
        for len in 0..40 {
            for _ in 0..50 {
                let row: Vec<u8> = (0..len).map(|_| if rng.u8(..) < 20 { rng.u8(1..) } else { 0 }).collect();
                let lit: Vec<usize> = (0..len).filter(|&q| row[q] != 0).collect();
                let want = lit.last().map_or(0, |last| last + 1 - lit[0]);
                assert_eq!(lit_span(&row), want, "{row:?}");
            }
        }
    }
}
