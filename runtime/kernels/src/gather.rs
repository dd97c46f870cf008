//! Rows of a table picked (`gather`) or summed into (`scatter_add`) by integer indices.

use crate::worth_parallel;
use rayon::prelude::*;
use std::fmt;

/// An integer index element.
pub trait Index: Copy + Send + Sync {
    fn to_i64(self) -> i64;
}

macro_rules! index {
    ($($t:ty),*) => {$(
        impl Index for $t {
            #[inline(always)]
            fn to_i64(self) -> i64 {
                self as i64
            }
        }
    )*};
}
index!(i32, i64, u8, u32);

/// An element that `scatter_add` can sum: `+` for floats, wrapping `+` for integers, `||` for
/// bool, as the interpreter does.
pub trait Accumulate: Copy + Send + Sync {
    const ZERO: Self;
    fn accumulate(self, other: Self) -> Self;
}

macro_rules! float_accumulate {
    ($($t:ty),*) => {$(
        impl Accumulate for $t {
            const ZERO: Self = 0.0;
            #[inline(always)]
            fn accumulate(self, other: Self) -> Self {
                self + other
            }
        }
    )*};
}
macro_rules! int_accumulate {
    ($($t:ty),*) => {$(
        impl Accumulate for $t {
            const ZERO: Self = 0;
            #[inline(always)]
            fn accumulate(self, other: Self) -> Self {
                self.wrapping_add(other)
            }
        }
    )*};
}
float_accumulate!(f32, f64);
int_accumulate!(i32, i64, u8);

impl Accumulate for bool {
    const ZERO: Self = false;
    #[inline(always)]
    fn accumulate(self, other: Self) -> Self {
        self || other
    }
}

/// An index outside `0..rows`: the first one, in index order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexOutOfRange {
    pub index: i64,
    pub rows: usize,
}

impl fmt::Display for IndexOutOfRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "index {} is out of range for {} rows", self.index, self.rows)
    }
}

impl std::error::Error for IndexOutOfRange {}

/// The first index outside `0..rows`, if any.
fn check<I: Index>(indices: &[I], rows: usize) -> Result<(), IndexOutOfRange> {
    match indices.iter().map(|i| i.to_i64()).find(|&i| i < 0 || i as u64 >= rows as u64) {
        Some(index) => Err(IndexOutOfRange { index, rows }),
        None => Ok(()),
    }
}

/// The length of a row of a `[rows, ...]` buffer of `len` elements.
fn row_len(len: usize, rows: usize, what: &str) -> usize {
    if rows == 0 {
        assert_eq!(len, 0, "{what}: a table of 0 rows must be empty");
        return 0;
    }
    assert_eq!(len % rows, 0, "{what}: {len} elements do not make {rows} rows");
    len / rows
}

/// `output[i, ...] = table[indices[i], ...]`: rows (along axis 0) of `table` (`[rows, ...]`)
/// picked by `indices` (flattened; `output` is `[indices..., table dims[1..]...]`). An index
/// outside `0..rows` is an error (the first such in order), and `output` is then left as it was.
pub fn gather<T: Copy + Send + Sync, I: Index>(
    table: &[T],
    rows: usize,
    indices: &[I],
    output: &mut [T],
) -> Result<(), IndexOutOfRange> {
    let row_len = row_len(table.len(), rows, "gather");
    check(indices, rows)?;
    assert_eq!(output.len(), indices.len() * row_len, "gather: output length must be indices × row length");
    if row_len == 0 {
        return Ok(());
    }
    let copy = |(out, &i): (&mut [T], &I)| {
        let i = i.to_i64() as usize;
        out.copy_from_slice(&table[i * row_len..(i + 1) * row_len]);
    };
    if worth_parallel::<T>(output.len()) {
        let min_rows = (1024 / row_len).max(1);
        output.par_chunks_mut(row_len).zip(indices.par_iter()).with_min_len(min_rows).for_each(copy);
    } else {
        output.chunks_mut(row_len).zip(indices).for_each(copy);
    }
    Ok(())
}

/// `output` (`[rows, ...]`) = zeros, then `output[indices[i], ...] += updates[i, ...]` for each
/// index in order (repeated indices accumulate). `updates` is `[indices..., output dims[1..]...]`.
/// An index outside `0..rows` is an error (the first such in order), and `output` is then left
/// as it was.
pub fn scatter_add<T: Accumulate, I: Index>(
    indices: &[I],
    updates: &[T],
    rows: usize,
    output: &mut [T],
) -> Result<(), IndexOutOfRange> {
    let row_len = row_len(output.len(), rows, "scatter_add");
    check(indices, rows)?;
    assert_eq!(updates.len(), indices.len() * row_len, "scatter_add: updates length must be indices × row length");
    if row_len == 0 {
        return Ok(());
    }
    // Rows `first..` of the output: the updates whose index falls among them, in order.
    let scatter = |first: usize, out: &mut [T]| {
        out.fill(T::ZERO);
        let end = first + out.len() / row_len;
        for (&i, update) in indices.iter().zip(updates.chunks_exact(row_len)) {
            let i = i.to_i64() as usize;
            if (first..end).contains(&i) {
                let row = &mut out[(i - first) * row_len..(i - first + 1) * row_len];
                for (o, &u) in row.iter_mut().zip(update) {
                    *o = o.accumulate(u);
                }
            }
        }
    };
    let threads = rayon::current_num_threads();
    if worth_parallel::<T>(updates.len().max(output.len())) && rows >= threads {
        // Each task owns a range of output rows and adds, in index order, the updates that
        // land there: the same order of additions per element as one thread.
        let rows_per_task = rows.div_ceil(threads);
        output.par_chunks_mut(rows_per_task * row_len).enumerate().for_each(|(t, out)| scatter(t * rows_per_task, out));
    } else {
        scatter(0, output);
    }
    Ok(())
}
