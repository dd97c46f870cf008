//! The column sums of a product's finished C (`Product::sums`, from `Epilogue::col_sums`): a dense layer's bias
//! gradient, `sum(g, axes = [0])` of the gradient the product makes. Each thread sums the part of C it finished,
//! while those lines are in its core's cache; a separate kernel on one thread would read half of C from the other
//! core's (the mlp's two such sums took 8.0 and 4.6 µs in a two-thread step on an Intel Xeon, 1.35 each in a
//! one-thread step). Summed so, the mlp's training step on that Xeon took 463.6 → 458.9 µs with the AVX-512 kernels
//! and 738.9 → 733.8 with the AVX2 ones (medians of 8 processes each way, alternated; faster in all 8 pairs): less
//! than the kernels' time, as the products after them now take from the other core the halves of C that the kernel
//! had brought over.
//!
//! A chunk that finishes whole columns (threads sharing the product by columns, or one thread) writes their sums
//! directly, added in order of rows from +0 as the interpreter adds: the same bits. Chunks of rows each sum into a
//! row of partials (`RowSums`), which the caller adds in order of chunks once every chunk is done.

use std::arch::x86_64::*;
use std::sync::Mutex;

use crate::avx512::{Buf, Product};

/// Columns summed at once: 4 ymm accumulators.
const WIDTH: usize = 32;

/// Rows `i0..i1`, columns `j0..j1` of C (row-major, `ldc` apart) summed down each column into `out[j0..j1]`
/// (overwritten), from +0 and in order of rows.
///
/// # Safety
/// The CPU has AVX; those elements of C are in it, and `out` holds at least `j1` floats.
#[target_feature(enable = "avx")]
pub(crate) unsafe fn column_sums(
    c: *const f32,
    ldc: usize,
    (i0, i1): (usize, usize),
    (j0, j1): (usize, usize),
    out: *mut f32,
) {
    let mut j = j0;
    while j + WIDTH <= j1 {
        let mut acc = [_mm256_setzero_ps(); WIDTH / 8];
        for i in i0..i1 {
            // SAFETY: row i, columns j..j + 32 of C (the caller's contract).
            let row = unsafe { c.add(i * ldc + j) };
            for (v, a) in acc.iter_mut().enumerate() {
                // SAFETY: as above.
                *a = _mm256_add_ps(*a, unsafe { _mm256_loadu_ps(row.add(8 * v)) });
            }
        }
        for (v, a) in acc.iter().enumerate() {
            // SAFETY: `out` holds columns j..j + 32 (the caller's contract).
            unsafe { _mm256_storeu_ps(out.add(j + 8 * v), *a) };
        }
        j += WIDTH;
    }
    for j in j..j1 {
        let mut s = 0.0f32;
        for i in i0..i1 {
            // SAFETY: element (i, j) of C (the caller's contract).
            s += unsafe { *c.add(i * ldc + j) };
        }
        // SAFETY: `out` holds column j.
        unsafe { *out.add(j) = s };
    }
}

/// The whole of C's column sums, on the calling thread (the products that do not share out their sums).
///
/// # Safety
/// As `column_sums`, for the whole of `p`'s C (not stored transposed) and `p.sums`.
pub(crate) unsafe fn all(p: &Product) {
    if !p.sums.is_null() {
        debug_assert!(!p.tc, "column sums of a C stored transposed");
        // SAFETY: the caller's contract.
        unsafe { column_sums(p.c, p.ldc, (0, p.m), (0, p.n), p.sums) };
    }
}

/// Partial column sums of products shared by chunks of rows, reused across calls.
static PARTIALS: Mutex<Buf> = Mutex::new(Buf::new());

/// The column sums of a product whose chunks each finish rows `lo..hi` of C, all its columns: chunk c sums its rows
/// into row c of the partials, and `finish` adds the rows in order of chunks into `Product::sums`.
pub(crate) struct RowSums {
    buf: Buf,
    /// The partials' address (shared with the workers), n floats a chunk.
    base: usize,
    chunks: usize,
}

impl RowSums {
    /// Partials for `chunks` chunks of `p`, when it has column sums.
    pub(crate) fn new(p: &Product, chunks: usize) -> Option<RowSums> {
        if p.sums.is_null() {
            return None;
        }
        let mut buf = std::mem::take(&mut *PARTIALS.lock().unwrap_or_else(|e| e.into_inner()));
        let base = buf.ptr(chunks * p.n) as usize;
        Some(RowSums { buf, base, chunks })
    }

    /// Chunk `c`'s sums of rows `lo..hi` of C (row-major).
    ///
    /// # Safety
    /// As `column_sums`, for those rows of `p`'s C; `c` < the chunks, each summed by one thread at a time.
    pub(crate) unsafe fn chunk(&self, p: &Product, c: usize, lo: usize, hi: usize) {
        debug_assert!(c < self.chunks);
        // SAFETY: row c of the partials holds n floats (`new`); the caller's contract covers C.
        unsafe { column_sums(p.c, p.ldc, (lo, hi), (0, p.n), (self.base as *mut f32).add(c * p.n)) };
    }

    /// `Product::sums` = the chunks' sums added in order, once every chunk is done.
    ///
    /// # Safety
    /// `p.sums` holds n floats; every chunk has been summed (`chunk`) and no thread writes the partials.
    pub(crate) unsafe fn finish(self, p: &Product) {
        let parts = self.base as *const f32;
        for j in 0..p.n {
            // SAFETY: the partials hold chunks·n floats, `p.sums` n (the caller's contract).
            unsafe {
                let mut s = *parts.add(j);
                for c in 1..self.chunks {
                    s += *parts.add(c * p.n + j);
                }
                *p.sums.add(j) = s;
            }
        }
        let mut pool = PARTIALS.lock().unwrap_or_else(|e| e.into_inner());
        if pool.floats() < self.buf.floats() {
            *pool = self.buf;
        }
    }
}
