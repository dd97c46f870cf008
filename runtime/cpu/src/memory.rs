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

/// Offsets for `values` (largest first, each at the lowest offset clear of the values placed
/// so far that are live at the same time) and the arena's size.
pub fn assign(values: &[Lifetime]) -> (Vec<usize>, usize) {
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
            assert!(size <= total);
        }
    }
}
