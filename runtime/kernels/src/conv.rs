//! 2-d convolution and its gradients: `im2col` + `sgemm`, over chunks of output rows.
//!
//! `im2col` makes, for each output position `(b, oy, ox)` (a *row*, numbered row-major), its
//! window flattened `(ky, kx, c)` with zeros in the padding; the filter `[kh, kw, c, filters]`
//! is already the `[patch, filters]` matrix. Then
//!
//! - forward: `out[rows, filters] = cols[rows, patch] · filter[patch, filters]`;
//! - input gradient: `cols = grad_out[rows, filters] · filterᵀ`, scattered back and summed by
//!   `col2im`;
//! - filter gradient: `grad_filter = colsᵀ · grad_out`, summed over every row.
//!
//! The rows are never expanded all at once: the work goes in runs of whole images, walked in
//! chunks of about [`CHUNK_FLOATS`] expanded elements, which stay in cache between `im2col` and
//! the product. In the forward pass and the input gradient each thread claims the next run of
//! images when done with its last ([`claim_units`]: a descheduled virtual CPU holds up one run,
//! not a thread's fixed share), and since runs are whole images `col2im` never races. The filter
//! gradient gives each thread a fixed range of images and adds their partial sums in order, so
//! that its rounding does not depend on which thread was late.
//!
//! Windows of at most [`THIN_PATCH`] elements (a first layer on one channel) skip all this in
//! the forward pass: see `thin`. So do 3×3 stride-1 windows over enough channels and filters,
//! given the scratch for it, in the forward pass and the input gradient: see `winograd`. A thin
//! or Winograd forward pass whose output only a max pooling reads can run with it, never storing
//! the convolution: [`conv2d_max_pool`].
//!
//! Rounding: each output is a sum of products taken in the order `sgemm` chooses (and the filter
//! gradient adds per-task partial sums), not the interpreter's strict left-to-right order, so
//! results differ from `dfc_interp` by rounding only. (The thin forward pass adds in the
//! interpreter's order, and is bitwise equal.)

use crate::geometry::{valid_taps, Conv2dGeometry, PoolGeometry};
use crate::pool::max_pool_image;
use crate::thin::{pooled_quads_apply, thin_conv, thin_conv_max_pool_2x2, THIN_PATCH};
use crate::winograd::{self, KeptFilter};
use dfc_gemm::sgemm;
use rayon::prelude::*;
use std::ops::Range;

/// The number of `im2col` elements a chunk aims at (4 bytes each): big enough for `sgemm` to
/// run at speed, small enough to stay in L2 with the filter and the chunk's output.
const CHUNK_FLOATS: usize = 1 << 16;

/// Work (multiply-adds) below which a convolution runs on the calling thread.
const PARALLEL_MIN_MACS: usize = 1 << 19;

#[derive(Clone, Copy, Debug)]
enum Chunk {
    /// This many whole images at a time (the last chunk of a task may have fewer).
    Images(usize),
    /// This many output rows (`oy`) of one image at a time.
    OutRows(usize),
}

/// How one call splits its rows: `tasks` tasks (threads), walking images in `chunk`s of at most
/// `chunk_rows` rows; in the filter gradient task `t` owns images `t * images_per_task ..` (at most
/// `images_per_task` of them), elsewhere tasks claim runs of images ([`claim_units`]).
#[derive(Clone, Copy, Debug)]
struct Plan {
    tasks: usize,
    images_per_task: usize,
    chunk: Chunk,
    chunk_rows: usize,
}

impl Plan {
    /// The plan for `tasks` tasks whose chunks hold at most `max_floats` `im2col` elements
    /// (but always at least one output row).
    fn new(g: &Conv2dGeometry, tasks: usize, max_floats: usize) -> Plan {
        let (tasks, images_per_task) = share_images(g.n, tasks);
        let image_rows = g.out_h * g.out_w;
        let budget_rows = (max_floats.min(CHUNK_FLOATS) / g.patch_len().max(1)).max(1);
        let chunk = if image_rows <= budget_rows {
            Chunk::Images((budget_rows / image_rows.max(1)).clamp(1, images_per_task))
        } else {
            Chunk::OutRows((budget_rows / g.out_w.max(1)).clamp(1, g.out_h.max(1)))
        };
        let chunk_rows = match chunk {
            Chunk::Images(k) => k * image_rows,
            Chunk::OutRows(r) => r * g.out_w,
        };
        Plan { tasks, images_per_task, chunk, chunk_rows }
    }

    /// The images of a chunk, where a chunk holds whole images (else 1): a unit that threads claim holds as many.
    fn unit_images(&self) -> usize {
        match self.chunk {
            Chunk::Images(k) => k,
            Chunk::OutRows(_) => 1,
        }
    }

    fn images(&self, g: &Conv2dGeometry, task: usize) -> Range<usize> {
        let start = task * self.images_per_task;
        start..(start + self.images_per_task).min(g.n)
    }

    /// Calls `f(first_row, rows)` for each chunk of the images `images`, in order.
    fn for_each_chunk(&self, g: &Conv2dGeometry, images: Range<usize>, mut f: impl FnMut(usize, usize)) {
        let image_rows = g.out_h * g.out_w;
        match self.chunk {
            Chunk::Images(k) => {
                for b in images.clone().step_by(k) {
                    f(b * image_rows, k.min(images.end - b) * image_rows);
                }
            }
            Chunk::OutRows(r) => {
                for b in images {
                    for oy in (0..g.out_h).step_by(r) {
                        f((b * g.out_h + oy) * g.out_w, r.min(g.out_h - oy) * g.out_w);
                    }
                }
            }
        }
    }
}

/// `n` images shared by at most `tasks` tasks in runs of equal length (but the last): the tasks
/// that get images, and the images of each.
pub(crate) fn share_images(n: usize, tasks: usize) -> (usize, usize) {
    let n = n.max(1);
    let images_per_task = n.div_ceil(tasks.clamp(1, n));
    (n.div_ceil(images_per_task), images_per_task)
}

/// Units of whole images for `tasks` threads to claim in turn ([`claim_units`]): about four a thread, so that
/// one late thread delays the call by a quarter of its share, and about `least` images each at least (a chunk's).
fn images_per_unit(n: usize, tasks: usize, least: usize) -> usize {
    balanced_unit(n, tasks, n.div_ceil(4 * tasks.max(1)).max(least))
}

/// The images of a unit of about `want` (at most), `n` images making a multiple of `tasks` units, so that threads
/// that run alike end together (64 images in units of 20 would give one thread 40 and the other 24).
pub(crate) fn balanced_unit(n: usize, tasks: usize, want: usize) -> usize {
    let units = n.div_ceil(want.max(1)).next_multiple_of(tasks.max(1));
    n.div_ceil(units.max(1)).max(1)
}

/// Runs `run(images, out, slab)` over a batch of `n` images in units of `images_per_unit` images, `out` a unit's
/// part of `output` (`image_out` floats an image), on `tasks` threads, thread `t` with slab `t` of `slab` floats in
/// `slabs`: each thread claims the next unit once it is done with its last. A thread that the machine takes away (a
/// virtual CPU descheduled by its host for a millisecond or more) then holds up only the unit it is on, where a
/// fixed share of the batch per thread would leave the others waiting for all of its share. Each image's output is
/// computed alone, so the results do not depend on which thread took which unit.
#[allow(clippy::too_many_arguments)]
pub(crate) fn claim_units(
    n: usize,
    images_per_unit: usize,
    image_out: usize,
    output: &mut [f32],
    tasks: usize,
    slabs: &mut [f32],
    slab: usize,
    run: impl Fn(Range<usize>, &mut [f32], &mut [f32]) + Sync,
) {
    let per_unit = images_per_unit.max(1);
    let units = std::sync::Mutex::new(output.chunks_mut((per_unit * image_out).max(1)).enumerate());
    // Each claim holds the lock only to take the next unit; a poisoned lock (a panic in another thread's
    // `run`, which rayon passes on to the caller) still hands out units.
    let claim = || units.lock().unwrap_or_else(std::sync::PoisonError::into_inner).next();
    let work = |slab: &mut [f32]| {
        while let Some((unit, out)) = claim() {
            let start = unit * per_unit;
            run(start..(start + per_unit).min(n), out, slab);
        }
    };
    // (Slabs of no floats are no chunks of `slabs`.)
    match slab {
        0 => (0..tasks).into_par_iter().for_each(|_| work(&mut [])),
        _ => slabs[..tasks * slab].par_chunks_mut(slab).for_each(work),
    }
}

/// The number of tasks worth using for a convolution of this size.
fn wanted_tasks(g: &Conv2dGeometry) -> usize {
    if g.n >= 2 && g.rows() * g.patch_len() * g.filters >= PARALLEL_MIN_MACS {
        rayon::current_num_threads().min(g.n)
    } else {
        1
    }
}

/// The scratch elements each task of `plan` needs: its chunk of `im2col`, plus a partial
/// filter gradient (`extra`) when there are several tasks.
fn slab_len(g: &Conv2dGeometry, plan: &Plan, extra: usize) -> usize {
    if plan.tasks > 1 {
        separated(plan.chunk_rows * g.patch_len() + extra)
    } else {
        plan.chunk_rows * g.patch_len()
    }
}

/// `len` rounded up to whole cache lines, plus one: the stride of the slabs of several tasks,
/// so that no two tasks ever write to the same cache line (the buffer itself need not be
/// aligned).
pub(crate) fn separated(len: usize) -> usize {
    len.div_ceil(16) * 16 + 16
}

/// The plan with the most tasks (up to the wanted number) whose slabs fit in `scratch_len`,
/// with chunks as large as fit; and the length of a slab.
fn fitting_plan(g: &Conv2dGeometry, extra: usize, scratch_len: usize) -> (Plan, usize) {
    let mut tasks = wanted_tasks(g);
    loop {
        let per_task = scratch_len / tasks;
        let plan = Plan::new(g, tasks, per_task.saturating_sub(if tasks > 1 { extra } else { 0 }));
        let slab = slab_len(g, &plan, extra);
        if slab * plan.tasks <= scratch_len {
            return (plan, slab);
        }
        assert!(plan.tasks > 1, "conv2d scratch too small: {scratch_len} < {slab} elements (see conv2d_scratch_len)");
        tasks = plan.tasks - 1;
    }
}

fn scratch_len_for(g: &Conv2dGeometry, extra: usize) -> usize {
    let plan = Plan::new(g, wanted_tasks(g), usize::MAX);
    slab_len(g, &plan, extra) * plan.tasks
}

/// Scratch elements (`f32`) that [`conv2d`] needs for geometry `g`, with the current rayon pool
/// (a smaller pool needs no more; a bigger one uses only the threads the scratch allows).
pub fn conv2d_scratch_len(g: &Conv2dGeometry) -> usize {
    if winograd::applies(g, false) {
        winograd::scratch_len(g)
    } else if g.patch_len() <= THIN_PATCH {
        0
    } else {
        scratch_len_for(g, 0)
    }
}

/// Scratch elements (`f32`) that [`conv2d_kept`] needs for geometry `g` with a kept filter.
pub fn conv2d_kept_scratch_len(g: &Conv2dGeometry) -> usize {
    if winograd::applies(g, true) {
        winograd::scratch_len(g)
    } else {
        conv2d_scratch_len(g)
    }
}

/// Scratch elements (`f32`) that [`conv2d_backprop_input`] needs for geometry `g`.
pub fn conv2d_backprop_input_scratch_len(g: &Conv2dGeometry) -> usize {
    if winograd::backprop_input_applies(g) {
        winograd::backprop_input_scratch_len(g)
    } else {
        scratch_len_for(g, 0)
    }
}

/// Scratch elements (`f32`) that [`conv2d_backprop_filter`] needs for geometry `g`.
pub fn conv2d_backprop_filter_scratch_len(g: &Conv2dGeometry) -> usize {
    scratch_len_for(g, g.filter_len())
}

/// Calls `f(r, ky, kx_taps, input_offset)` for rows `row0..row0 + rows` (`r` counted from 0)
/// and each of their window rows `ky` that is inside the input: `kx_taps` are the window
/// columns inside the input, and `input_offset` the offset in `x` (images counted from
/// `image0`) of the first of them. Window rows in the padding are skipped.
#[inline(always)]
fn for_each_window_row(
    g: &Conv2dGeometry,
    row0: usize,
    rows: usize,
    image0: usize,
    mut f: impl FnMut(usize, usize, Range<usize>, usize),
) {
    if rows == 0 {
        return;
    }
    let (mut b, mut oy, mut ox) = g.split_row(row0);
    for r in 0..rows {
        let ys = valid_taps(oy, g.stride_h, g.pad_top, g.kh, g.h);
        let xs = valid_taps(ox, g.stride_w, g.pad_left, g.kw, g.w);
        if !xs.is_empty() {
            let ix = ox * g.stride_w + xs.start - g.pad_left;
            for ky in ys {
                let iy = oy * g.stride_h + ky - g.pad_top;
                f(r, ky, xs.clone(), (((b - image0) * g.h + iy) * g.w + ix) * g.c);
            }
        }
        ox += 1;
        if ox == g.out_w {
            ox = 0;
            oy += 1;
            if oy == g.out_h {
                oy = 0;
                b += 1;
            }
        }
    }
}

/// Rows `row0..row0 + rows` of `im2col(x)` into `cols` (`rows × patch`).
fn im2col(g: &Conv2dGeometry, x: &[f32], row0: usize, rows: usize, cols: &mut [f32]) {
    if rows == 0 {
        return;
    }
    let patch = g.patch_len();
    let kwc = g.kw * g.c;
    let (mut b, mut oy, mut ox) = g.split_row(row0);
    for row in cols[..rows * patch].chunks_exact_mut(patch) {
        let ys = valid_taps(oy, g.stride_h, g.pad_top, g.kh, g.h);
        let xs = valid_taps(ox, g.stride_w, g.pad_left, g.kw, g.w);
        if ys.len() < g.kh || xs.len() < g.kw {
            row.fill(0.0);
        }
        if !xs.is_empty() {
            let ix = ox * g.stride_w + xs.start - g.pad_left;
            let len = xs.len() * g.c;
            for ky in ys {
                let iy = oy * g.stride_h + ky - g.pad_top;
                let src = ((b * g.h + iy) * g.w + ix) * g.c;
                let dst = ky * kwc + xs.start * g.c;
                copy(&mut row[dst..dst + len], &x[src..src + len]);
            }
        }
        ox += 1;
        if ox == g.out_w {
            ox = 0;
            oy += 1;
            if oy == g.out_h {
                oy = 0;
                b += 1;
            }
        }
    }
}

/// `dst.copy_from_slice(src)`, inline for the few elements of a thin window row.
#[inline(always)]
fn copy(dst: &mut [f32], src: &[f32]) {
    if dst.len() <= 4 {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = s;
        }
    } else {
        dst.copy_from_slice(src);
    }
}

/// Adds rows `row0..row0 + rows` of `cols` (`rows × patch`) back into `x`, whose first image
/// is image `image0`: the adjoint of `im2col`.
fn col2im(g: &Conv2dGeometry, cols: &[f32], row0: usize, rows: usize, x: &mut [f32], image0: usize) {
    let patch = g.patch_len();
    let kwc = g.kw * g.c;
    for_each_window_row(g, row0, rows, image0, |r, ky, xs, dst| {
        let src = r * patch + ky * kwc + xs.start * g.c;
        let len = xs.len() * g.c;
        for (d, &s) in x[dst..dst + len].iter_mut().zip(&cols[src..src + len]) {
            *d += s;
        }
    });
}

fn check_lens(g: &Conv2dGeometry, input: usize, filter: usize, output: usize) {
    g.check();
    assert_eq!(input, g.input_len(), "conv2d input length does not match {g:?}");
    assert_eq!(filter, g.filter_len(), "conv2d filter length does not match {g:?}");
    assert_eq!(output, g.output_len(), "conv2d output length does not match {g:?}");
}

/// `output[b, oy, ox, f] = Σ_{ky, kx, c} input[b, oy*sh - pad_top + ky, ox*sw - pad_left + kx, c]
/// * filter[ky, kx, c, f]`, padding read as zeros. `input` is `[n, h, w, c]`, `filter`
/// `[kh, kw, c, filters]`, `output` `[n, out_h, out_w, filters]`; `scratch` holds at least
/// [`conv2d_scratch_len`]`(g)` elements.
pub fn conv2d(g: &Conv2dGeometry, input: &[f32], filter: &[f32], output: &mut [f32], scratch: &mut [f32]) {
    conv2d_kept(g, input, filter, output, scratch, None)
}

/// Whether [`conv2d_kept`] (or [`conv2d_max_pool_kept`]) would ever fill a kept filter for `g`: a convolution that
/// Winograd can compute (a 3×3 window at stride 1 over enough channels and filters), whatever the batch.
pub fn conv2d_keeps_filter(g: &Conv2dGeometry) -> bool {
    winograd::fits(g)
}

/// [`conv2d`] with the filter kept transformed in `kept` (where given) from one call to the next, for a filter that
/// does not change between them (an inference's): a Winograd convolution transforms it there when `kept` is stale,
/// and reads it there when not. The same results as [`conv2d`].
pub fn conv2d_kept(
    g: &Conv2dGeometry,
    input: &[f32],
    filter: &[f32],
    output: &mut [f32],
    scratch: &mut [f32],
    kept: Option<&mut KeptFilter>,
) {
    check_lens(g, input.len(), filter.len(), output.len());
    let (patch, filters) = (g.patch_len(), g.filters);
    if output.is_empty() {
        return;
    }
    if patch == 0 {
        output.fill(0.0);
        return;
    }
    if winograd::applies(g, kept.is_some()) && winograd::conv2d(g, input, filter, output, scratch, kept) {
        return;
    }
    let image_rows = g.out_h * g.out_w;
    let image_out = image_rows * filters;
    if patch <= THIN_PATCH {
        let plan = Plan::new(g, wanted_tasks(g), CHUNK_FLOATS);
        if plan.tasks == 1 {
            thin_conv(g, input, filter, 0, g.rows(), output);
        } else {
            let per_unit = images_per_unit(g.n, plan.tasks, 1);
            claim_units(g.n, per_unit, image_out, output, plan.tasks, &mut [], 0, |images, out, _| {
                thin_conv(g, input, filter, images.start * image_rows, images.len() * image_rows, out)
            });
        }
        return;
    }
    let (plan, slab) = fitting_plan(g, 0, scratch.len());
    let run = |images: Range<usize>, out: &mut [f32], slab: &mut [f32], parallel_gemm: bool| {
        let first = images.start * image_rows;
        plan.for_each_chunk(g, images, |row0, rows| {
            let out = &mut out[(row0 - first) * filters..(row0 - first + rows) * filters];
            im2col(g, input, row0, rows, slab);
            sgemm(rows, filters, patch, slab, false, filter, false, out, false, parallel_gemm);
        });
    };
    if plan.tasks == 1 {
        run(0..g.n, output, scratch, true);
    } else {
        let per_unit = images_per_unit(g.n, plan.tasks, plan.unit_images());
        claim_units(g.n, per_unit, image_out, output, plan.tasks, scratch, slab, |images, out, slab| {
            run(images, out, slab, false)
        });
    }
}

/// Whether [`conv2d_max_pool`] computes `max_pool(conv2d(input, filter))` for these geometries in one pass, and that
/// pays: a pooling over the convolution's output whose every window lies inside it (no padding), of a thin window
/// (`thin`: a first layer on one channel) or of a Winograd convolution whose tiles hold whole windows
/// (`winograd::pools_by_tiles`: a 3×3 layer over enough channels, pooled 2×2 by strides of 2) where Winograd pays
/// for the batch (`winograd::applies`), the filter kept between calls where `filter_kept` ([`conv2d_max_pool_kept`]).
pub fn conv2d_max_pool_applies(g: &Conv2dGeometry, pool: &PoolGeometry, filter_kept: bool) -> bool {
    in_one_pass(g, pool) && (g.patch_len() <= THIN_PATCH || winograd::applies(g, filter_kept))
}

/// Whether [`conv2d_max_pool`] can compute `max_pool(conv2d(input, filter))` for these geometries in one pass
/// (`conv2d_max_pool_applies`, whatever the batch).
fn in_one_pass(g: &Conv2dGeometry, pool: &PoolGeometry) -> bool {
    let patch = g.patch_len();
    let inside = |out: usize, stride: usize, window: usize, input: usize| {
        out > 0 && window > 0 && stride > 0 && (out - 1) * stride + window <= input
    };
    patch > 0
        && (patch <= THIN_PATCH || winograd::pools_by_tiles(g, pool))
        && pool.input_dims() == [g.n, g.out_h, g.out_w, g.filters]
        && pool.pad_top == 0
        && pool.pad_left == 0
        && inside(pool.out_h, pool.stride_h, pool.kh, pool.h)
        && inside(pool.out_w, pool.stride_w, pool.kw, pool.w)
}

/// The scratch floats [`conv2d_max_pool`] needs: per task, the rows of convolution under one pooled row (thin), or
/// the Winograd convolution's.
pub fn conv2d_max_pool_scratch_len(g: &Conv2dGeometry, pool: &PoolGeometry) -> usize {
    if g.patch_len() <= THIN_PATCH {
        share_images(g.n, wanted_tasks(g)).0 * pool.kh * g.out_w * g.filters
    } else {
        winograd::scratch_len(g)
    }
}

/// `output = max_pool(conv2d(input, filter))` for geometries that [`conv2d_max_pool_applies`] to, without storing
/// the convolution. A thin window: a 2×2 window's pooled pixel from its four convolution outputs, summed in
/// registers, where their windows lie inside the input; other pooled rows from the `pool.kh` rows of convolution
/// under them, computed into `scratch` (a few KiB, in L1) just before. A Winograd convolution: each output tile
/// pooled as it is transformed. The convolution's output (the CNN's first layer: 5.5 MB at batch 64; its second,
/// 2 MB) is neither written out nor read back, by one core or the other; the results are bitwise those of
/// [`conv2d`] then [`max_pool`](crate::max_pool), then `then` (a bias per filter added, the relu taken). `scratch`
/// holds at least [`conv2d_max_pool_scratch_len`] floats.
pub fn conv2d_max_pool(
    g: &Conv2dGeometry,
    pool: &PoolGeometry,
    input: &[f32],
    filter: &[f32],
    then: PoolEpilogue<'_>,
    output: &mut [f32],
    scratch: &mut [f32],
) {
    conv2d_max_pool_kept(g, pool, input, filter, then, output, scratch, None)
}

/// [`conv2d_max_pool`] with the filter kept transformed in `kept` (where given), as [`conv2d_kept`].
#[allow(clippy::too_many_arguments)]
pub fn conv2d_max_pool_kept(
    g: &Conv2dGeometry,
    pool: &PoolGeometry,
    input: &[f32],
    filter: &[f32],
    then: PoolEpilogue<'_>,
    output: &mut [f32],
    scratch: &mut [f32],
    kept: Option<&mut KeptFilter>,
) {
    assert!(in_one_pass(g, pool), "conv2d_max_pool does not take {g:?} pooled by {pool:?}");
    check_lens(g, input.len(), filter.len(), g.output_len());
    assert_eq!(output.len(), pool.output_len(), "conv2d_max_pool output length does not match {pool:?}");
    assert!(then.bias.is_none_or(|b| b.len() == g.filters), "conv2d_max_pool: the bias is not one per filter");
    if output.is_empty() {
        return;
    }
    if g.patch_len() > THIN_PATCH {
        let ran = winograd::conv2d_max_pool(g, pool, input, filter, then, output, scratch, kept);
        assert!(ran, "conv2d_max_pool: scratch too small");
        return;
    }
    let slab = pool.kh * g.out_w * g.filters;
    let tasks = share_images(g.n, wanted_tasks(g)).0;
    assert!(scratch.len() >= tasks * slab, "conv2d_max_pool: scratch too small");
    // The convolution rows under one pooled row, as an image of `kh` rows pooled to one.
    let rows = PoolGeometry { n: 1, h: pool.kh, out_h: 1, ..*pool };
    let pooled_row = pool.out_w * pool.c;
    let run = |images: Range<usize>, out: &mut [f32], slab: &mut [f32]| {
        for b in images.clone() {
            for py in 0..pool.out_h {
                let o = ((b - images.start) * pool.out_h + py) * pooled_row;
                if pooled_quads_apply(g, pool, py) {
                    thin_conv_max_pool_2x2(g, pool, input, filter, then, (b, py), &mut out[o..o + pooled_row]);
                    continue;
                }
                let row0 = (b * g.out_h + py * pool.stride_h) * g.out_w;
                thin_conv(g, input, filter, row0, pool.kh * g.out_w, slab);
                max_pool_image(&rows, slab, &mut out[o..o + pooled_row]);
                for pixel in out[o..o + pooled_row].chunks_exact_mut(g.filters) {
                    then.apply(pixel, 0);
                }
            }
        }
    };
    let image_out = pool.out_h * pooled_row;
    if tasks == 1 {
        run(0..g.n, output, &mut scratch[..slab]);
    } else {
        claim_units(g.n, images_per_unit(g.n, tasks, 1), image_out, output, tasks, scratch, slab, run);
    }
}

/// What [`conv2d_max_pool`] does to each pooled element after the pooling, as the interpreter would after it: adds
/// the bias of its filter, then takes the relu (`max(·, 0)`: NaN and -0 kept). (A convolutional layer whose pooling
/// comes before its bias and activation, `pool_early`'s rewrite, then needs no pass of its own over the pooling.)
#[derive(Clone, Copy, Debug, Default)]
pub struct PoolEpilogue<'a> {
    pub bias: Option<&'a [f32]>,
    pub relu: bool,
}

impl PoolEpilogue<'_> {
    /// Applies it to `pixel`, the pooled elements of filters `f..f + pixel.len()`: 16 lanes at a time (arrays of a
    /// length known when compiled, which the compiler keeps in vector registers), then the rest.
    #[inline(always)]
    pub(crate) fn apply(&self, pixel: &mut [f32], f: usize) {
        const LANES: usize = 16;
        let len = pixel.len();
        let whole = len - len % LANES;
        for at in (0..whole).step_by(LANES) {
            let lanes: &mut [f32; LANES] = (&mut pixel[at..at + LANES]).try_into().expect("16 lanes");
            self.apply_lanes(lanes, f + at);
        }
        for (at, x) in pixel.iter_mut().enumerate().skip(whole) {
            let mut lane = [*x];
            self.apply_lanes(&mut lane, f + at);
            *x = lane[0];
        }
    }

    /// On a copy of the lanes (a local array, held in registers: through the reference the compiler added lane by
    /// lane), written back once.
    #[inline(always)]
    fn apply_lanes<const L: usize>(&self, lanes: &mut [f32; L], f: usize) {
        let mut v = *lanes;
        if let Some(bias) = self.bias {
            let bias: [f32; L] = bias[f..f + L].try_into().expect("L filters");
            for (x, b) in v.iter_mut().zip(bias) {
                *x += b;
            }
        }
        if self.relu {
            for x in &mut v {
                *x = if 0.0 > *x { 0.0 } else { *x };
            }
        }
        *lanes = v;
    }
}

/// The gradient of [`conv2d`] with respect to its input: `grad_input` (`[n, h, w, c]`, fully
/// overwritten) from `filter` and `grad_output` (`[n, out_h, out_w, filters]`). `scratch`
/// holds at least [`conv2d_backprop_input_scratch_len`]`(g)` elements.
pub fn conv2d_backprop_input(
    g: &Conv2dGeometry,
    filter: &[f32],
    grad_output: &[f32],
    grad_input: &mut [f32],
    scratch: &mut [f32],
) {
    check_lens(g, grad_input.len(), filter.len(), grad_output.len());
    let (patch, filters) = (g.patch_len(), g.filters);
    if grad_input.is_empty() {
        return;
    }
    if patch == 0 || g.rows() == 0 {
        grad_input.fill(0.0);
        return;
    }
    if winograd::backprop_input_applies(g)
        && winograd::conv2d_backprop_input(g, filter, grad_output, grad_input, scratch)
    {
        return;
    }
    let (plan, slab) = fitting_plan(g, 0, scratch.len());
    let image_in = g.h * g.w * g.c;
    let run = |images: Range<usize>, grad_in: &mut [f32], slab: &mut [f32], parallel_gemm: bool| {
        grad_in.fill(0.0);
        let image0 = images.start;
        plan.for_each_chunk(g, images, |row0, rows| {
            let go = &grad_output[row0 * filters..(row0 + rows) * filters];
            sgemm(rows, patch, filters, go, false, filter, true, slab, false, parallel_gemm);
            col2im(g, slab, row0, rows, grad_in, image0);
        });
    };
    if plan.tasks == 1 {
        run(0..g.n, grad_input, scratch, true);
    } else {
        let per_unit = images_per_unit(g.n, plan.tasks, plan.unit_images());
        claim_units(g.n, per_unit, image_in, grad_input, plan.tasks, scratch, slab, |images, grad_in, slab| {
            run(images, grad_in, slab, false)
        });
    }
}

/// The gradient of [`conv2d`] with respect to its filter: `grad_filter` (`[kh, kw, c, filters]`,
/// fully overwritten) from `input` and `grad_output`. `scratch` holds at least
/// [`conv2d_backprop_filter_scratch_len`]`(g)` elements.
///
/// With several threads each sums the rows of its images and the partial sums are added in
/// task order, so the rounding depends on the number of tasks (at most the rayon pool's size).
pub fn conv2d_backprop_filter(
    g: &Conv2dGeometry,
    input: &[f32],
    grad_output: &[f32],
    grad_filter: &mut [f32],
    scratch: &mut [f32],
) {
    check_lens(g, input.len(), grad_filter.len(), grad_output.len());
    let (patch, filters) = (g.patch_len(), g.filters);
    if grad_filter.is_empty() {
        return;
    }
    if g.rows() == 0 {
        grad_filter.fill(0.0);
        return;
    }
    let (plan, slab) = fitting_plan(g, grad_filter.len(), scratch.len());
    let cols_len = plan.chunk_rows * patch;
    let run = |images: Range<usize>, cols: &mut [f32], partial: &mut [f32], parallel_gemm: bool| {
        let mut accumulate = false;
        plan.for_each_chunk(g, images, |row0, rows| {
            im2col(g, input, row0, rows, cols);
            let go = &grad_output[row0 * filters..(row0 + rows) * filters];
            sgemm(patch, filters, rows, cols, true, go, false, partial, accumulate, parallel_gemm);
            accumulate = true;
        });
    };
    if plan.tasks == 1 {
        run(0..g.n, &mut scratch[..cols_len], grad_filter, true);
        return;
    }
    let scratch = &mut scratch[..slab * plan.tasks];
    scratch.par_chunks_mut(slab).enumerate().for_each(|(t, slab)| {
        let (cols, partial) = slab.split_at_mut(cols_len);
        run(plan.images(g, t), cols, partial, false);
    });
    add_partials(scratch, slab, cols_len, grad_filter);
}

/// `out` = the sum, in order, of the partial sums at `offset` in each `slab` of `slabs`.
fn add_partials(slabs: &[f32], slab: usize, offset: usize, out: &mut [f32]) {
    let (first, rest) = slabs.split_at(slab);
    out.copy_from_slice(&first[offset..offset + out.len()]);
    for slab in rest.chunks_exact(slab) {
        for (d, &s) in out.iter_mut().zip(&slab[offset..]) {
            *d += s;
        }
    }
}
