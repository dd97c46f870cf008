//! Buffer assignment: every value that needs memory gets an offset in one arena, values whose
//! lifetimes overlap never share bytes.

/// A value's size in bytes and the steps it lives over: written at `first`, last read at
/// `last` (inclusive; a step's inputs and outputs are live together).
#[derive(Clone, Copy, Debug)]
pub struct Lifetime {
    pub bytes: usize,
    pub first: usize,
    pub last: usize,
}

/// Alignment of every buffer: one cache line, and the widest vector load.
pub const ALIGN: usize = 64;

/// Above this many values, [`by_size`]'s pairwise checks (quadratic: for each value, every
/// value placed before it and live with it) cost seconds — a 10,000-layer model's plan took
/// 15 s to load — and values are placed in the order they are written instead.
const BY_SIZE_MAX: usize = 4096;

/// Offsets for `values`, none sharing bytes with a value live at the same time, and the
/// arena's size.
pub fn assign(values: &[Lifetime]) -> (Vec<usize>, usize) {
    if values.len() <= BY_SIZE_MAX {
        by_size(values)
    } else {
        in_order_written(values)
    }
}

/// Largest first, each at the lowest offset clear of the values placed so far that are live at
/// the same time: the tighter arena, in time quadratic in the values.
fn by_size(values: &[Lifetime]) -> (Vec<usize>, usize) {
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(values[i].bytes), values[i].first));
    let mut offsets = vec![0usize; values.len()];
    let mut placed: Vec<usize> = Vec::with_capacity(values.len());
    let mut size = 0;
    for i in order {
        let v = values[i];
        let bytes = v.bytes.div_ceil(ALIGN) * ALIGN;
        let mut busy: Vec<(usize, usize)> = placed
            .iter()
            .filter(|&&j| values[j].first <= v.last && v.first <= values[j].last)
            .map(|&j| (offsets[j], offsets[j] + values[j].bytes.div_ceil(ALIGN) * ALIGN))
            .collect();
        busy.sort_unstable();
        let mut at = 0;
        for (start, end) in busy {
            if at + bytes <= start {
                break;
            }
            at = at.max(end);
        }
        offsets[i] = at;
        size = size.max(at + bytes);
        placed.push(i);
    }
    (offsets, size)
}

/// In the order values are written, each in the smallest free hole that holds it (else at the
/// arena's end), holes freed after their value's last read and merged with their neighbours:
/// an allocator's simulation, in O(n log n).
fn in_order_written(values: &[Lifetime]) -> (Vec<usize>, usize) {
    use std::cmp::Reverse;
    use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
    let aligned = |v: &Lifetime| v.bytes.div_ceil(ALIGN) * ALIGN;
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by_key(|&i| values[i].first);
    let mut offsets = vec![0usize; values.len()];
    // Free holes, by (size, offset) for the best fit and by offset for merging.
    let mut by_size: BTreeSet<(usize, usize)> = BTreeSet::new();
    let mut by_offset: BTreeMap<usize, usize> = BTreeMap::new();
    let mut live: BinaryHeap<Reverse<(usize, usize)>> = BinaryHeap::new();
    let mut size = 0;
    for i in order {
        let v = values[i];
        while let Some(&Reverse((last, j))) = live.peek() {
            if last >= v.first {
                break;
            }
            live.pop();
            let (mut start, mut bytes) = (offsets[j], aligned(&values[j]));
            if let Some((&before, &before_bytes)) = by_offset.range(..start).next_back() {
                if before + before_bytes == start {
                    by_offset.remove(&before);
                    by_size.remove(&(before_bytes, before));
                    (start, bytes) = (before, before_bytes + bytes);
                }
            }
            if let Some(after_bytes) = by_offset.remove(&(start + bytes)) {
                by_size.remove(&(after_bytes, start + bytes));
                bytes += after_bytes;
            }
            by_offset.insert(start, bytes);
            by_size.insert((bytes, start));
        }
        let bytes = aligned(&v);
        if bytes == 0 {
            continue;
        }
        offsets[i] = match by_size.range((bytes, 0)..).next().copied() {
            Some((hole, at)) => {
                by_size.remove(&(hole, at));
                by_offset.remove(&at);
                if hole > bytes {
                    by_size.insert((hole - bytes, at + bytes));
                    by_offset.insert(at + bytes, hole - bytes);
                }
                at
            }
            None => {
                size += bytes;
                size - bytes
            }
        };
        live.push(Reverse((v.last, i)));
    }
    (offsets, size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlapping_lifetimes_never_share_bytes() {
        let mut rng = 12345u64;
        let mut next = |n: usize| {
            rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (rng >> 33) as usize % n
        };
        for _ in 0..200 {
            let values: Vec<Lifetime> = (0..30)
                .map(|_| {
                    let first = next(40);
                    Lifetime { bytes: 1 + next(5000), first, last: first + next(10) }
                })
                .collect();
            for assign in [by_size, in_order_written] {
                let (offsets, size) = assign(&values);
                for i in 0..values.len() {
                    assert!(offsets[i] % ALIGN == 0 && offsets[i] + values[i].bytes <= size);
                    for j in 0..i {
                        let live_together = values[i].first <= values[j].last && values[j].first <= values[i].last;
                        let apart =
                            offsets[i] + values[i].bytes <= offsets[j] || offsets[j] + values[j].bytes <= offsets[i];
                        assert!(!live_together || apart, "{i} and {j} overlap");
                    }
                }
                // Sharing happens: the arena is smaller than the sum of the sizes.
                let total: usize = values.iter().map(|v| v.bytes.div_ceil(ALIGN) * ALIGN).sum();
                assert!(size < total);
            }
        }
    }
}
