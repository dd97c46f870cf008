//! The forward 3×3 stride-1 convolution, and its input gradient, by Winograd's minimal filtering, F(4×4, 3×3) (Lavin and
//! Gray, "Fast Algorithms for Convolutional Neural Networks", 2016): each 4×4 tile of output
//! comes from a 6×6 tile of input in 36 multiplications per (channel, filter) instead of 144, so
//! the products do a quarter of the multiply-adds of `im2col` + GEMM (F(2×2, 3×3), which this
//! replaced, did 4/9: the CNN's conv2 took 1.27 ms by it).
//!
//! For a tile `d` (6×6, zeros outside the input) and a filter `g` (3×3), the output tile is
//! `Aᵀ [(G g Gᵀ) ⊙ (Bᵀ d B)] A`, with
//!
//! ```text
//!      | 4  0 -5  0  1  0 |         |  1/4    0     0   |
//!      | 0 -4 -4  1  1  0 |         | -1/6  -1/6  -1/6  |         | 1  1  1  1  1  0 |
//! Bᵀ = | 0  4 -4 -1  1  0 |     G = | -1/6   1/6  -1/6  |    Aᵀ = | 0  1 -1  2 -2  0 |
//!      | 0 -2 -1  2  1  0 |         |  1/24  1/12  1/6  |         | 0  1  1  4  4  0 |
//!      | 0  2 -1 -2  1  0 |         |  1/24 -1/12  1/6  |         | 0  1 -1  8 -8  1 |
//!      | 0  4  0 -5  0  1 |         |  0     0     1    |
//! ```
//!
//! Summed over channels, each of the 36 positions ξ of the transformed tile is a matrix
//! product: `M[ξ] (tiles × filters) = V[ξ] (tiles × channels) · U[ξ] (channels × filters)`, with
//! `U = G g Gᵀ` (the filter, transformed once per call) and `V = Bᵀ d B` (the input, a chunk of
//! tiles at a time). The transforms work on runs of channels (or filters), contiguous in NHWC,
//! 16 at a time.
//!
//! A max pooling whose windows lie within the output tiles (as wide as their strides, which divide
//! 4: the CNN's 2×2 windows of stride 2) can be taken as each tile is transformed
//! (`conv2d_max_pool`), so that the convolution is never stored.
//!
//! It pays where the products dominate: enough channels and filters that the transforms are a
//! small share (`applies`). The rounding differs from `im2col`'s (the transforms scale and add
//! before multiplying, by factors up to 8), within the tolerance the convolutions are tested at.

use crate::conv::{balanced_unit, claim_units, separated, share_images, PoolEpilogue};
use crate::geometry::{Conv2dGeometry, PoolGeometry};
use crate::pool::beats_max;
use dfc_gemm::{pack_b, packed_b, packed_b_len, sgemm_packed, PackedB};
use std::ops::Range;

/// The side of an output tile.
const M: usize = 4;
/// The side of an input tile: M + 3 − 1.
const ALPHA: usize = M + 2;
/// Positions of a transformed tile.
const XI: usize = ALPHA * ALPHA;
/// Channels (or filters) a transform handles at once: one zmm register of f32s.
const LANES: usize = 16;
/// The fewest input channels and filters with which Winograd is used: the transforms' work per
/// tile grows with channels + filters, the products' with channels × filters. Measured with
/// `cargo bench -p dfc-kernels --bench conv`, the CNN's conv2 (32 → 64) takes 0.86–0.90 ms
/// against 1.34–1.36 ms by F(2×2, 3×3) and 1.43 ms by `im2col` (AMD EPYC, AVX-512, 2 threads);
/// a first layer of one channel would spend its time in the transforms (and takes the `thin`
/// path).
const MIN_CHANNELS: usize = 16;
const MIN_FILTERS: usize = 16;
/// The transformed input and products of a chunk of tiles aim at this many floats (512 KiB), so
/// that a chunk stays in L2 between the transforms and the products (2^16 and 2^18 measured
/// slower on the CNN's conv2, with F(2×2, 3×3)).
const CHUNK_FLOATS: usize = 1 << 17;
/// Tiles below which the work stays on the calling thread.
const PARALLEL_MIN_TILES: usize = 64;

/// Whether the forward convolution of `g` runs here rather than through `im2col`, its filter kept transformed from
/// one call to the next where `filter_kept` (`KeptFilter`). The work is shared among threads by whole images, so a
/// batch smaller than the pool (an inference at batch 1) runs here only if it leaves at most half the threads idle
/// (measured on two), and then only where the filter is kept or the products run on the AVX2 kernels. The CNN at
/// batch 1 on two threads, an Intel Xeon, a forward pass, alternated processes:
/// - on the AVX-512 kernels: 31.4–31.5 µs by `im2col`, whose products use every thread; 34.9–37.1 here with the
///   filter transformed at every call; 22.4–23.0 with the filter kept;
/// - on the AVX2 kernels (under `benches/avx2_only.c`), whose multiply-adds cost twice as much: 55.3–55.8 µs by
///   `im2col`'s four times as many; 49.2–51.5 here with the filter transformed at every call; 29.8–30.2 kept.
pub(crate) fn applies(g: &Conv2dGeometry, filter_kept: bool) -> bool {
    let threads = rayon::current_num_threads();
    let few_pay = filter_kept || dfc_gemm::on_avx2_kernels();
    let enough_images = g.n >= threads || (g.n > 0 && 2 * g.n >= threads && few_pay);
    enough_images && fits(g)
}

/// Whether Winograd can compute the forward convolution of `g`, and pays for its transforms: a 3×3 window, stride 1,
/// enough channels and filters.
pub(crate) fn fits(g: &Conv2dGeometry) -> bool {
    g.kh == 3
        && g.kw == 3
        && g.stride_h == 1
        && g.stride_w == 1
        && g.c >= MIN_CHANNELS
        && g.filters >= MIN_FILTERS
        && g.out_h > 0
        && g.out_w > 0
}

/// The input gradient of `g` as a forward convolution that Winograd computes: the output
/// gradient as the input (its filters as channels), padded by 2 − `g`'s padding so that each
/// input pixel's window covers the outputs it fed, and the filter turned half a circle with its
/// channels and filters swapped (`flip`); `None` unless `g` is 3×3 with stride 1.
fn transposed(g: &Conv2dGeometry) -> Option<Conv2dGeometry> {
    (g.kh == 3 && g.kw == 3 && g.stride_h == 1 && g.stride_w == 1 && g.pad_top <= 2 && g.pad_left <= 2).then(|| {
        Conv2dGeometry {
            h: g.out_h,
            w: g.out_w,
            c: g.filters,
            filters: g.c,
            pad_top: 2 - g.pad_top,
            pad_left: 2 - g.pad_left,
            out_h: g.h,
            out_w: g.w,
            ..*g
        }
    })
}

/// Whether the input gradient of `g` runs here rather than through `im2col` and `col2im`.
pub(crate) fn backprop_input_applies(g: &Conv2dGeometry) -> bool {
    transposed(g).is_some_and(|t| applies(&t, false))
}

/// Scratch floats that `conv2d_backprop_input` uses at most: the turned filter, then a forward
/// convolution's.
pub(crate) fn backprop_input_scratch_len(g: &Conv2dGeometry) -> usize {
    transposed(g).map_or(0, |t| t.filter_len() + scratch_len(&t))
}

/// `grad_input` of `conv2d` for a geometry whose input gradient `backprop_input_applies`, if
/// `scratch` is large enough; returns whether it ran (as `conv2d`).
pub(crate) fn conv2d_backprop_input(
    g: &Conv2dGeometry,
    filter: &[f32],
    grad_output: &[f32],
    grad_input: &mut [f32],
    scratch: &mut [f32],
) -> bool {
    let Some(t) = transposed(g) else { return false };
    if scratch.len() < t.filter_len() {
        return false;
    }
    let (turned, rest) = scratch.split_at_mut(t.filter_len());
    flip(g, filter, turned);
    conv2d(&t, grad_output, turned, grad_input, rest, None)
}

/// `turned[ky][kx][f][c] = filter[2 − ky][2 − kx][c][f]` for a 3×3 filter (HWIO).
fn flip(g: &Conv2dGeometry, filter: &[f32], turned: &mut [f32]) {
    let (c, f) = (g.c, g.filters);
    for ky in 0..3 {
        for kx in 0..3 {
            let from = &filter[((2 - ky) * 3 + 2 - kx) * c * f..][..c * f];
            let to = &mut turned[(ky * 3 + kx) * f * c..][..f * c];
            for ch in 0..c {
                for k in 0..f {
                    to[k * c + ch] = from[ch * f + k];
                }
            }
        }
    }
}

/// How one call splits its work: `tasks` threads, each with a slab of its own, claiming units of
/// `images_per_unit` whole images in turn ([`claim_units`]) and walking each unit's tiles in chunks of at most
/// `chunk` tiles.
#[derive(Clone, Copy, Debug)]
struct Plan {
    tasks: usize,
    images_per_unit: usize,
    chunk: usize,
}

impl Plan {
    /// The floats of one task's slab: the chunk's transformed input and products.
    fn slab(&self, g: &Conv2dGeometry) -> usize {
        separated(XI * self.chunk * (g.c + g.filters))
    }

    /// The scratch floats of the whole call: the transformed filter, then the slabs.
    fn scratch(&self, g: &Conv2dGeometry) -> usize {
        filter_len(g) + self.slab(g) * self.tasks
    }
}

fn tiles_per_image(g: &Conv2dGeometry) -> (usize, usize) {
    (g.out_h.div_ceil(M), g.out_w.div_ceil(M))
}

/// The transformed filter's floats, then each of its 36 products' B laid out once (`dfc_gemm::pack_b`).
fn filter_len(g: &Conv2dGeometry) -> usize {
    transformed_len(g) + XI * packed_b_len(g.c, g.filters)
}

fn transformed_len(g: &Conv2dGeometry) -> usize {
    (XI * g.c * g.filters).div_ceil(16) * 16
}

/// The plan this machine's thread pool would use, with scratch to spare.
fn wanted_plan(g: &Conv2dGeometry) -> Plan {
    let (th, tw) = tiles_per_image(g);
    let image_tiles = th * tw;
    let tasks = if g.n >= 2 && g.n * image_tiles >= PARALLEL_MIN_TILES { rayon::current_num_threads() } else { 1 };
    let tasks = share_images(g.n, tasks).0;
    // Whole panels of the GEMM's 12-row microkernel.
    let chunk = (CHUNK_FLOATS / (XI * (g.c + g.filters)) / 12 * 12).max(12);
    plan_of(g, tasks, chunk)
}

/// `tasks` threads walking chunks of at most `chunk` tiles: a unit is at most as many whole images as a chunk
/// holds (at least one), the units a multiple of the threads, and no chunk is longer than a unit.
fn plan_of(g: &Conv2dGeometry, tasks: usize, chunk: usize) -> Plan {
    let (th, tw) = tiles_per_image(g);
    let image_tiles = (th * tw).max(1);
    let images_per_unit = balanced_unit(g.n, tasks, chunk / image_tiles);
    Plan { tasks, images_per_unit, chunk: chunk.min(images_per_unit * image_tiles).max(1) }
}

/// Scratch floats that a Winograd convolution of `g` uses at most.
pub(crate) fn scratch_len(g: &Conv2dGeometry) -> usize {
    wanted_plan(g).scratch(g)
}

/// The plan that fits in `scratch_len` floats, with as many tasks and as large chunks as the
/// wanted plan where they fit; `None` if not even one tile at a time does.
fn fitting_plan(g: &Conv2dGeometry, scratch_len: usize) -> Option<Plan> {
    let wanted = wanted_plan(g);
    for tasks in (1..=wanted.tasks).rev() {
        let room = scratch_len.checked_sub(filter_len(g))? / tasks;
        let chunk = (room.saturating_sub(16) / (XI * (g.c + g.filters))).min(wanted.chunk);
        if chunk > 0 {
            let plan = plan_of(g, tasks, chunk);
            if plan.scratch(g) <= scratch_len {
                return Some(plan);
            }
        }
    }
    None
}

/// A forward convolution's filter kept transformed between calls where it does not change (an inference's weights):
/// the first Winograd convolution that finds it stale transforms the filter (and lays out its 36 products' B) here,
/// later ones read it. At a batch of one, the transform had taken more time than the products (the CNN's conv2, 32
/// channels by 64 filters: 295 KB transformed, then laid out again, against 0.66 M multiply-adds). Whoever writes
/// the filter marks it [`stale`](KeptFilter::stale); a call of other channels or filters transforms it again.
#[derive(Debug, Default)]
pub struct KeptFilter {
    buf: Vec<f32>,
    /// The channels and filters of the filter that `buf` holds transformed, while it holds what the filter holds.
    holds: Option<(usize, usize)>,
}

impl KeptFilter {
    /// Room for a filter, stale.
    pub fn new() -> KeptFilter {
        KeptFilter::default()
    }

    /// Forgets what it holds: the filter was written.
    pub fn stale(&mut self) {
        self.holds = None;
    }
}

/// `output = conv2d(input, filter)` for a geometry that `fits`, if `scratch` is large enough
/// for one tile at a time; returns whether it ran (else the caller convolves another way). The
/// filter is transformed into `kept` where given, unless it holds it already.
pub(crate) fn conv2d(
    g: &Conv2dGeometry,
    input: &[f32],
    filter: &[f32],
    output: &mut [f32],
    scratch: &mut [f32],
    kept: Option<&mut KeptFilter>,
) -> bool {
    debug_assert!(fits(g));
    convolve(g, input, filter, Outputs::Stored, output, scratch, kept)
}

/// Whether [`conv2d_max_pool`] can pool `g`'s output by tiles: a convolution that `fits`, under windows as
/// wide as their strides that divide the output tile's side, so that every window lies in one tile (the CNN's
/// second layer, 2×2 windows of stride 2 over 4×4 tiles). The caller checks that the pooling reads exactly the
/// convolution's output, unpadded.
pub(crate) fn pools_by_tiles(g: &Conv2dGeometry, pool: &PoolGeometry) -> bool {
    let divides = |window: usize, stride: usize| window == stride && window > 0 && M.is_multiple_of(window);
    fits(g) && divides(pool.kh, pool.stride_h) && divides(pool.kw, pool.stride_w)
}

/// `output = then(max_pool(conv2d(input, filter)))` for geometries that [`pools_by_tiles`] takes: each output
/// tile is pooled as the output transform makes it, so the convolution is never stored nor read back (the CNN's
/// second layer at inference: 2 MB at batch 64). Bitwise the results of [`conv2d`], then `max_pool`, then
/// `then`. Returns whether it ran, as [`conv2d`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn conv2d_max_pool(
    g: &Conv2dGeometry,
    pool: &PoolGeometry,
    input: &[f32],
    filter: &[f32],
    then: PoolEpilogue<'_>,
    output: &mut [f32],
    scratch: &mut [f32],
    kept: Option<&mut KeptFilter>,
) -> bool {
    debug_assert!(pools_by_tiles(g, pool));
    convolve(g, input, filter, Outputs::Pooled(pool, then), output, scratch, kept)
}

/// What the output transform does with each output tile.
#[derive(Clone, Copy)]
enum Outputs<'a> {
    /// Stores it where it lies inside the output.
    Stored,
    /// Max-pools it (the windows lie in the tile: `pools_by_tiles`), applies the epilogue, and stores the pooled
    /// pixels where they lie inside the pooling's output.
    Pooled(&'a PoolGeometry, PoolEpilogue<'a>),
}

impl Outputs<'_> {
    /// The floats of one image's output.
    fn image_len(&self, g: &Conv2dGeometry) -> usize {
        match self {
            Outputs::Stored => g.out_h * g.out_w * g.filters,
            Outputs::Pooled(pool, _) => pool.out_h * pool.out_w * pool.c,
        }
    }
}

/// The forward convolution, its output tiles going where `outputs` says; the filter transformed in `kept` where
/// given (unless it holds it), else in `scratch` (which has room for it either way: the plans are the same).
fn convolve(
    g: &Conv2dGeometry,
    input: &[f32],
    filter: &[f32],
    outputs: Outputs<'_>,
    output: &mut [f32],
    scratch: &mut [f32],
    kept: Option<&mut KeptFilter>,
) -> bool {
    let Some(plan) = fitting_plan(g, scratch.len()) else { return false };
    let (here, rest) = scratch.split_at_mut(filter_len(g));
    let (c, f, per) = (g.c, g.filters, packed_b_len(g.c, g.filters));
    let transformed: &[f32] = match kept {
        Some(kept) if kept.holds == Some((c, f)) => &kept.buf,
        Some(kept) => {
            // Not moved again until it next goes stale: where the panels lie in it depends on its address.
            kept.buf.resize(filter_len(g), 0.0);
            transform_and_lay_out(g, filter, &mut kept.buf);
            kept.holds = Some((c, f));
            &kept.buf
        }
        None => {
            transform_and_lay_out(g, filter, here);
            here
        }
    };
    let (u, mut packed) = transformed[..filter_len(g)].split_at(transformed_len(g));
    let u: [PackedB<'_>; XI] = std::array::from_fn(|xi| {
        let (buf, rest) = packed.split_at(per);
        packed = rest;
        packed_b(c, f, &u[xi * c * f..(xi + 1) * c * f], buf)
    });
    let u = &u;
    let image_out = outputs.image_len(g);
    let slab = plan.slab(g);
    if plan.tasks == 1 {
        run(g, &plan, input, u, outputs, 0..g.n, output, &mut rest[..slab]);
    } else {
        claim_units(g.n, plan.images_per_unit, image_out, output, plan.tasks, rest, slab, |images, out, slab| {
            run(g, &plan, input, u, outputs, images, out, slab)
        });
    }
    true
}

/// The filter transformed (`U`, `transformed_len` floats), then each position's filter, the B of its product with
/// every chunk of tiles, laid out once for them all (`filter_len` floats in all).
fn transform_and_lay_out(g: &Conv2dGeometry, filter: &[f32], to: &mut [f32]) {
    let (u, mut packed) = to[..filter_len(g)].split_at_mut(transformed_len(g));
    transform_filter(g, filter, u);
    let (c, f, per) = (g.c, g.filters, packed_b_len(g.c, g.filters));
    for xi in 0..XI {
        let (buf, rest) = std::mem::take(&mut packed).split_at_mut(per);
        packed = rest;
        pack_b(c, f, &u[xi * c * f..(xi + 1) * c * f], buf);
    }
}

/// The images `images` of one task, their output `out` (from the first of them on).
#[allow(clippy::too_many_arguments)]
fn run(
    g: &Conv2dGeometry,
    plan: &Plan,
    input: &[f32],
    u: &[PackedB<'_>; XI],
    outputs: Outputs<'_>,
    images: Range<usize>,
    out: &mut [f32],
    slab: &mut [f32],
) {
    let (th, tw) = tiles_per_image(g);
    let image_tiles = th * tw;
    let (first, end) = (images.start * image_tiles, images.end * image_tiles);
    let (v, m) = slab.split_at_mut(XI * plan.chunk * g.c);
    for tile0 in (first..end).step_by(plan.chunk) {
        let tiles = plan.chunk.min(end - tile0);
        transform_inputs(g, input, tile0, tiles, v);
        for (xi, ux) in u.iter().enumerate() {
            let vx = &v[xi * tiles * g.c..(xi + 1) * tiles * g.c];
            let mx = &mut m[xi * tiles * g.filters..(xi + 1) * tiles * g.filters];
            sgemm_packed(tiles, vx, ux, mx);
        }
        match outputs {
            Outputs::Stored => transform_outputs(g, m, tile0, tiles, images.start, out),
            Outputs::Pooled(pool, then) => transform_outputs_pooled(g, pool, then, m, tile0, tiles, images.start, out),
        }
    }
}

widest!(transform_filter => transform_filter_impl(g: &Conv2dGeometry, filter: &[f32], u: &mut [f32]));
widest!(transform_inputs => transform_inputs_impl(g: &Conv2dGeometry, input: &[f32], tile0: usize, tiles: usize, v: &mut [f32]));
widest!(transform_outputs => transform_outputs_impl(
    g: &Conv2dGeometry, m: &[f32], tile0: usize, tiles: usize, image0: usize, out: &mut [f32]
));
widest!(transform_outputs_pooled => transform_outputs_pooled_impl(
    g: &Conv2dGeometry, pool: &PoolGeometry, then: PoolEpilogue<'_>, m: &[f32], tile0: usize, tiles: usize,
    image0: usize, out: &mut [f32]
));

/// `body` for each run of `len` channels (or filters), with `start` and `lanes` bound: whole runs with
/// `lanes` the constant `LANES`, so that their loads and stores are vector moves (with `lanes` a
/// variable, the compiler merged the whole and partial copies into calls of `memcpy`), then the
/// rest. A macro, where a closure would be compiled apart from the caller's vector width.
macro_rules! for_runs {
    ($len:expr, |$start:ident, $lanes:ident| $body:block) => {{
        let len: usize = $len;
        let whole = len - len % LANES;
        for $start in (0..whole).step_by(LANES) {
            let $lanes = LANES;
            $body
        }
        if whole < len {
            let ($start, $lanes) = (whole, len - whole);
            $body
        }
    }};
}

/// Lanes of one position: a run of channels (or filters).
type Run = [f32; LANES];

/// An ALPHA×ALPHA tile of runs, position `i·ALPHA + j`.
type Tile = [Run; XI];

/// A tile on the stack, each run on a cache line of its own: unaligned, a tile's loads and stores would straddle
/// lines by where the stack happens to be (which varies between processes).
#[repr(C, align(64))]
struct AlignedTile(Tile);

/// `U[ξ][c][f] = (G g Gᵀ)[ξ]` for every channel and filter.
#[inline(always)]
fn transform_filter_impl(g: &Conv2dGeometry, filter: &[f32], u: &mut [f32]) {
    let (c, f) = (g.c, g.filters);
    for ch in 0..c {
        for_runs!(f, |f0, lanes| {
            // The taps, position ky·3 + kx.
            let taps = gather::<9>(|k| load(&filter[(k * c + ch) * f + f0..], lanes), 0, 1);
            // G g, by columns kx (ALPHA rows each), then (G g) Gᵀ by rows i. Built whole rather than into zeroed
            // arrays, whose zeroing (3.4 KiB a run, as calls of memset) took more than a fifth of the CNN's
            // forward pass at batch 1, where this transform runs once an image.
            let columns: [[Run; ALPHA]; 3] =
                std::array::from_fn(|kx| lanewise(&gather::<3>(|k| taps[k], kx, 3), g_times));
            for i in 0..ALPHA {
                let row = lanewise(&[columns[0][i], columns[1][i], columns[2][i]], g_times);
                for (j, run) in row.iter().enumerate() {
                    store(&mut u[((i * ALPHA + j) * c + ch) * f + f0..], run, lanes);
                }
            }
        });
    }
}

/// The first `lanes` floats of `from` (at most `LANES`), zeros after them. A whole run is one
/// fixed-size copy (a vector load) where `lanes` is known to be `LANES` (`for_runs`).
#[inline(always)]
fn load(from: &[f32], lanes: usize) -> [f32; LANES] {
    if lanes == LANES {
        from[..LANES].try_into().expect("LANES floats")
    } else {
        let mut run = [0.0; LANES];
        run[..lanes].copy_from_slice(&from[..lanes]);
        run
    }
}

/// Writes the first `lanes` floats of `run` to the start of `to`.
#[inline(always)]
fn store(to: &mut [f32], run: &[f32; LANES], lanes: usize) {
    if lanes == LANES {
        to[..LANES].copy_from_slice(run);
    } else {
        to[..lanes].copy_from_slice(&run[..lanes]);
    }
}

/// `G · [g0, g1, g2]`.
#[inline(always)]
fn g_times([g0, g1, g2]: [f32; 3]) -> [f32; ALPHA] {
    let (even, odd) = (g0 + g2, g1);
    let (quarter, half) = (0.25 * g0 + g2, 0.5 * g1);
    [0.25 * g0, -(even + odd) / 6.0, -(even - odd) / 6.0, (quarter + half) / 6.0, (quarter - half) / 6.0, g2]
}

/// `Bᵀ · [d0, ..., d5]`.
#[inline(always)]
fn bt_times([d0, d1, d2, d3, d4, d5]: [f32; ALPHA]) -> [f32; ALPHA] {
    let (a, b) = (d4 - 4.0 * d2, d3 - 4.0 * d1);
    let (c, e) = (d4 - d2, 2.0 * (d3 - d1));
    [4.0 * d0 - 5.0 * d2 + d4, a + b, a - b, c + e, c - e, 4.0 * d1 - 5.0 * d3 + d5]
}

/// `Aᵀ · [m0, ..., m5]`.
#[inline(always)]
fn at_times([m0, m1, m2, m3, m4, m5]: [f32; ALPHA]) -> [f32; M] {
    let (sum12, dif12, sum34, dif34) = (m1 + m2, m1 - m2, m3 + m4, m3 - m4);
    [m0 + sum12 + sum34, dif12 + 2.0 * dif34, sum12 + 4.0 * sum34, dif12 + 8.0 * dif34 + m5]
}

/// `f` applied lane by lane to N runs, giving K runs: a loop over the lanes that compiles to
/// vector operations, one per operation of `f`. (Plain loops throughout: `std::array::from_fn`
/// left calls of its closure and copies of whole tiles in the compiled transforms.)
#[inline(always)]
#[allow(clippy::needless_range_loop)] // lane `l` of every run at once: one vector operation each
fn lanewise<const N: usize, const K: usize>(runs: &[Run; N], f: impl Fn([f32; N]) -> [f32; K]) -> [Run; K] {
    let mut out = [[0.0; LANES]; K];
    for l in 0..LANES {
        let mut x = [0.0; N];
        for i in 0..N {
            x[i] = runs[i][l];
        }
        let y = f(x);
        for k in 0..K {
            out[k][l] = y[k];
        }
    }
    out
}

/// Runs `at(first)`, `at(first + step)`, ..., N of them.
#[inline(always)]
fn gather<const N: usize>(at: impl Fn(usize) -> Run, first: usize, step: usize) -> [Run; N] {
    let mut runs = [[0.0; LANES]; N];
    for (i, run) in runs.iter_mut().enumerate() {
        *run = at(first + i * step);
    }
    runs
}

/// `Bᵀ d B` of a tile, in place.
#[inline(always)]
fn input_transform(d: &mut Tile) {
    for j in 0..ALPHA {
        let column = lanewise(&gather::<ALPHA>(|xi| d[xi], j, ALPHA), bt_times);
        for (i, run) in column.into_iter().enumerate() {
            d[i * ALPHA + j] = run;
        }
    }
    for i in 0..ALPHA {
        let row = lanewise(&gather::<ALPHA>(|xi| d[xi], i * ALPHA, 1), bt_times);
        d[i * ALPHA..(i + 1) * ALPHA].copy_from_slice(&row);
    }
}

/// `Aᵀ m A` of a tile, run `at(ξ)` holding position ξ: `emit(i·M + j, run)` for each of the
/// M×M outputs, with `rows` for the first pass (the caller's, so that it is not zeroed per tile).
#[inline(always)]
fn output_transform(at: impl Fn(usize) -> Run, rows: &mut [Run; M * ALPHA], mut emit: impl FnMut(usize, &Run)) {
    for j in 0..ALPHA {
        let column = lanewise(&gather::<ALPHA>(&at, j, ALPHA), at_times);
        for (i, run) in column.into_iter().enumerate() {
            rows[i * ALPHA + j] = run;
        }
    }
    for i in 0..M {
        let row = lanewise(&gather::<ALPHA>(|xi| rows[xi], i * ALPHA, 1), at_times);
        for (j, run) in row.iter().enumerate() {
            emit(i * M + j, run);
        }
    }
}

/// The image and the top-left output position of tile `tile` (numbered over all images).
fn tile_at(g: &Conv2dGeometry, tile: usize) -> (usize, usize, usize) {
    let (th, tw) = tiles_per_image(g);
    (tile / (th * tw), tile / tw % th * M, tile % tw * M)
}

/// `V[ξ][t][c] = (Bᵀ d B)[ξ]` of tiles `tile0..tile0 + tiles` (the chunk's `t`-th at `t`).
#[inline(always)]
fn transform_inputs_impl(g: &Conv2dGeometry, input: &[f32], tile0: usize, tiles: usize, v: &mut [f32]) {
    let c = g.c;
    // One tile for the call: zeroed again only where a tile reaches outside the input.
    let AlignedTile(d) = &mut AlignedTile([[0.0; LANES]; XI]);
    for t in 0..tiles {
        let (b, oy, ox) = tile_at(g, tile0 + t);
        // The input row (or column) of tap i, if inside the input.
        let row = |i: usize| (oy + i).checked_sub(g.pad_top).filter(|&y| y < g.h);
        let col = |j: usize| (ox + j).checked_sub(g.pad_left).filter(|&x| x < g.w);
        let inside = row(0).is_some() && row(ALPHA - 1).is_some() && col(0).is_some() && col(ALPHA - 1).is_some();
        for_runs!(c, |c0, lanes| {
            if !inside {
                *d = [[0.0; LANES]; XI];
            }
            for i in 0..ALPHA {
                let Some(y) = row(i) else { continue };
                for j in 0..ALPHA {
                    if let Some(x) = col(j) {
                        d[i * ALPHA + j] = load(&input[((b * g.h + y) * g.w + x) * c + c0..], lanes);
                    }
                }
            }
            input_transform(d);
            for (xi, run) in d.iter().enumerate() {
                store(&mut v[(xi * tiles + t) * c + c0..], run, lanes);
            }
        });
    }
}

/// The output tiles of tiles `tile0..tile0 + tiles` from `M`: `Aᵀ m A`, written where they lie
/// inside the output (`out` starts at image `image0`).
#[inline(always)]
fn transform_outputs_impl(g: &Conv2dGeometry, m: &[f32], tile0: usize, tiles: usize, image0: usize, out: &mut [f32]) {
    let f = g.filters;
    let rows = &mut [[0.0f32; LANES]; M * ALPHA];
    for t in 0..tiles {
        let (b, oy, ox) = tile_at(g, tile0 + t);
        for_runs!(f, |f0, lanes| {
            output_transform(
                |xi| load(&m[(xi * tiles + t) * f + f0..], lanes),
                rows,
                |k, run| {
                    let (y, x) = (oy + k / M, ox + k % M);
                    if y < g.out_h && x < g.out_w {
                        store(&mut out[(((b - image0) * g.out_h + y) * g.out_w + x) * f + f0..], run, lanes);
                    }
                },
            )
        });
    }
}

/// `transform_outputs`, each tile max-pooled by `pool` (its windows lie in the tile: `pools_by_tiles`) and finished
/// by `then`: the pooled pixels written where they lie inside the pooling's output (`out` starts at image
/// `image0`). Each window's elements come in the tile's row-major order, as `max_pool` visits them, and are
/// compared as it compares them (`beats_max`: the first NaN wins, ties keep the earlier).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn transform_outputs_pooled_impl(
    g: &Conv2dGeometry,
    pool: &PoolGeometry,
    then: PoolEpilogue<'_>,
    m: &[f32],
    tile0: usize,
    tiles: usize,
    image0: usize,
    out: &mut [f32],
) {
    let f = g.filters;
    let (kh, kw) = (pool.kh, pool.kw);
    // Pooled pixels per tile row; for each output of a tile, its window (numbered row-major in the tile) and
    // whether it comes first in it, worked out once (divided out for each output, they made the CNN's second
    // layer 10–25% slower).
    let across = M / kw;
    let window: [usize; M * M] = std::array::from_fn(|k| k / M / kh * across + k % M / kw);
    let first: [bool; M * M] = std::array::from_fn(|k| (k / M).is_multiple_of(kh) && (k % M).is_multiple_of(kw));
    let rows = &mut [[0.0f32; LANES]; M * ALPHA];
    let best = &mut [[0.0f32; LANES]; M * M];
    for t in 0..tiles {
        let (b, oy, ox) = tile_at(g, tile0 + t);
        let (py0, px0) = (oy / kh, ox / kw);
        for_runs!(f, |f0, lanes| {
            output_transform(
                |xi| load(&m[(xi * tiles + t) * f + f0..], lanes),
                rows,
                |k, run| {
                    let best = &mut best[window[k]];
                    if first[k] {
                        *best = *run;
                    } else {
                        for (best, &x) in best.iter_mut().zip(run) {
                            *best = if beats_max(x, *best) { x } else { *best };
                        }
                    }
                },
            );
            for (py, windows) in (py0..pool.out_h).zip(best.chunks_exact_mut(across).take(M / kh)) {
                for (px, pixel) in (px0..pool.out_w).zip(windows) {
                    then.apply(&mut pixel[..lanes], f0);
                    store(&mut out[(((b - image0) * pool.out_h + py) * pool.out_w + px) * f + f0..], pixel, lanes);
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dfc_ir::Padding;

    /// The convolution by its definition, summed in f64.
    fn direct(g: &Conv2dGeometry, x: &[f32], f: &[f32]) -> Vec<f64> {
        let mut out = vec![0.0; g.output_len()];
        for b in 0..g.n {
            for oy in 0..g.out_h {
                for ox in 0..g.out_w {
                    for k in 0..g.filters {
                        let mut sum = 0.0f64;
                        for ky in 0..3 {
                            for kx in 0..3 {
                                let (Some(y), Some(xx)) =
                                    ((oy + ky).checked_sub(g.pad_top), (ox + kx).checked_sub(g.pad_left))
                                else {
                                    continue;
                                };
                                if y >= g.h || xx >= g.w {
                                    continue;
                                }
                                for c in 0..g.c {
                                    sum += f64::from(x[((b * g.h + y) * g.w + xx) * g.c + c])
                                        * f64::from(f[((ky * 3 + kx) * g.c + c) * g.filters + k]);
                                }
                            }
                        }
                        out[((b * g.out_h + oy) * g.out_w + ox) * g.filters + k] = sum;
                    }
                }
            }
        }
        out
    }

    /// The input gradient by its definition, summed in f64.
    fn direct_backprop_input(g: &Conv2dGeometry, f: &[f32], go: &[f32]) -> Vec<f64> {
        let mut grad = vec![0.0; g.input_len()];
        for b in 0..g.n {
            for oy in 0..g.out_h {
                for ox in 0..g.out_w {
                    for ky in 0..3 {
                        for kx in 0..3 {
                            let (Some(y), Some(x)) =
                                ((oy + ky).checked_sub(g.pad_top), (ox + kx).checked_sub(g.pad_left))
                            else {
                                continue;
                            };
                            if y >= g.h || x >= g.w {
                                continue;
                            }
                            for c in 0..g.c {
                                for k in 0..g.filters {
                                    grad[((b * g.h + y) * g.w + x) * g.c + c] +=
                                        f64::from(go[((b * g.out_h + oy) * g.out_w + ox) * g.filters + k])
                                            * f64::from(f[((ky * 3 + kx) * g.c + c) * g.filters + k]);
                                }
                            }
                        }
                    }
                }
            }
        }
        grad
    }

    /// The input gradient as a forward convolution of the output gradient (valid and same
    /// padding, odd and even sizes), against the definition.
    #[test]
    fn input_gradient_agrees_with_the_definition() {
        let mut rng = fastrand::Rng::with_seed(12);
        for (mut input, filters, padding) in [
            ([2, 13, 13, 32], 64, Padding::Valid),
            ([3, 6, 9, 17], 18, Padding::Same),
            ([1, 8, 5, 20], 33, Padding::Valid),
        ] {
            input[0] *= rayon::current_num_threads();
            let g = Conv2dGeometry::new(input, [3, 3, input[3], filters], [1, 1], padding);
            assert!(backprop_input_applies(&g));
            let f: Vec<f32> = (0..g.filter_len()).map(|_| rng.f32() * 2.0 - 1.0).collect();
            let go: Vec<f32> = (0..g.output_len()).map(|_| rng.f32() * 2.0 - 1.0).collect();
            let want = direct_backprop_input(&g, &f, &go);
            let bound = (9 * g.filters) as f64 * 1e-6;
            let mut grad = vec![f32::NAN; g.input_len()];
            let mut scratch = vec![0.0; backprop_input_scratch_len(&g)];
            assert!(conv2d_backprop_input(&g, &f, &go, &mut grad, &mut scratch), "{input:?}");
            for (i, (&got, &want)) in grad.iter().zip(&want).enumerate() {
                assert!((f64::from(got) - want).abs() <= bound, "{input:?} {i}: {got} against {want}");
            }
        }
    }

    /// Odd and even outputs (a last tile half outside), channels and filters not a multiple of
    /// 16, `same` padding, one tile per chunk and several tasks: all against the definition.
    #[test]
    fn agrees_with_the_definition() {
        let mut rng = fastrand::Rng::with_seed(11);
        let shapes = [
            ([2, 13, 13, 32], 64, Padding::Valid),
            ([3, 6, 9, 17], 18, Padding::Same),
            ([1, 4, 4, 16], 16, Padding::Valid),
            ([5, 3, 8, 20], 33, Padding::Same),
        ];
        for (mut input, filters, padding) in shapes {
            // A batch of at least one image per thread.
            input[0] *= rayon::current_num_threads();
            let g = Conv2dGeometry::new(input, [3, 3, input[3], filters], [1, 1], padding);
            assert!(applies(&g, false) && applies(&g, true));
            let threads = rayon::current_num_threads();
            let fewer = Conv2dGeometry { n: threads - 1, ..g };
            let few_enough = fewer.n > 0 && 2 * fewer.n >= threads;
            let here = few_enough && dfc_gemm::on_avx2_kernels();
            assert_eq!(applies(&fewer, false), here, "fewer images than threads: here only on the AVX2 kernels…");
            assert_eq!(applies(&fewer, true), few_enough, "… or with the filter kept");
            let x: Vec<f32> = (0..g.input_len()).map(|_| rng.f32() * 2.0 - 1.0).collect();
            let f: Vec<f32> = (0..g.filter_len()).map(|_| rng.f32() * 2.0 - 1.0).collect();
            let want = direct(&g, &x, &f);
            let bound = (9 * g.c) as f64 * 1e-6;
            for scratch_len in [scratch_len(&g), filter_len(&g) + XI * (g.c + g.filters) + 48] {
                let mut out = vec![f32::NAN; g.output_len()];
                assert!(
                    conv2d(&g, &x, &f, &mut out, &mut vec![0.0; scratch_len], None),
                    "{input:?}: scratch {scratch_len}"
                );
                for (i, (&got, &want)) in out.iter().zip(&want).enumerate() {
                    assert!((f64::from(got) - want).abs() <= bound, "{input:?} {i}: {got} against {want}");
                }
            }
            // Too little scratch for one tile: the caller convolves another way.
            assert!(!conv2d(&g, &x, &f, &mut vec![0.0; g.output_len()], &mut vec![0.0; filter_len(&g)], None));
        }
    }

    /// A kept filter gives the bits of one transformed at the call: when it transforms the filter and when it reads
    /// it back. It is read without looking at the filter until marked stale (a changed filter still gives the old
    /// filter's output), and transformed again for a filter of other channels or filters.
    #[test]
    fn a_kept_filter_gives_the_bits_of_one_transformed_at_the_call() {
        let mut rng = fastrand::Rng::with_seed(12);
        let mut random = |len: usize| (0..len).map(|_| rng.f32() * 2.0 - 1.0).collect::<Vec<f32>>();
        let threads = rayon::current_num_threads();
        let mut kept = KeptFilter::new();
        for (input, filters) in [([threads, 13, 13, 32], 64), ([1, 13, 13, 32], 64), ([1, 6, 9, 17], 18)] {
            let g = Conv2dGeometry::new(input, [3, 3, input[3], filters], [1, 1], Padding::Valid);
            let (x, f, other) = (random(g.input_len()), random(g.filter_len()), random(g.filter_len()));
            let mut scratch = vec![0.0; scratch_len(&g)];
            let mut convolve = |filter: &[f32], kept: Option<&mut KeptFilter>| {
                let mut out = vec![f32::NAN; g.output_len()];
                assert!(conv2d(&g, &x, filter, &mut out, &mut scratch, kept));
                out.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
            };
            let want = convolve(&f, None);
            // Another filter than the last case's, of the same channels and filters or not.
            kept.stale();
            assert!(convolve(&f, Some(&mut kept)) == want, "{input:?}: transformed into the kept filter");
            assert!(convolve(&f, Some(&mut kept)) == want, "{input:?}: read from the kept filter");
            assert!(convolve(&other, Some(&mut kept)) == want, "{input:?}: kept, the filter is not read again");
            kept.stale();
            assert!(convolve(&other, Some(&mut kept)) == convolve(&other, None), "{input:?}: after stale");
        }
    }
}
