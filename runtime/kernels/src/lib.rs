//! CPU library kernels of the native backend: the ops that are not elementwise fusions.
//!
//! Every kernel works on plain slices that the caller allocated: inputs `&[T]`, outputs
//! `&mut [T]` of exactly the output's length, shapes passed explicitly. The results agree with
//! the reference interpreter (`dfc_interp::eval`): exactly for the layout ops, gathers and
//! pooling (which add in the interpreter's order), and up to rounding for the convolutions,
//! whose sums run in another order (see `conv`).
//!
//! - [`conv2d`], [`conv2d_backprop_input`], [`conv2d_backprop_filter`]: NHWC input, HWIO filter,
//!   described by a [`Conv2dGeometry`]; `im2col` + [`dfc_gemm::sgemm`] over chunks of output rows,
//!   and the forward 3×3 stride-1 convolution over 16 channels or more by Winograd's F(4×4, 3×3), its filter
//!   transformed at every call or kept transformed between calls ([`KeptFilter`], [`conv2d_kept`]).
//! - [`max_pool`], [`max_pool_grad`], [`avg_pool`], [`avg_pool_grad`]: described by a
//!   [`PoolGeometry`].
//! - [`gather`], [`scatter_add`]: rows of a table by integer [`Index`]; an index out of range is
//!   an [`IndexOutOfRange`] error.
//! - [`transpose`], [`concat()`], [`slice()`], [`pad`]: any rank, any `Copy` element.
//! - [`moments`], [`batch_norm`], [`batch_norm_grad_means`], [`batch_norm_grad`]: per channel (the last axis) of f32 data,
//!   with f32 scales and f64 partial sums from the caller ([`Scratch::split`]).
//!
//! **Scratch memory.** The convolutions need a scratch buffer of `f32`s of at least
//! [`conv2d_scratch_len`], [`conv2d_backprop_input_scratch_len`] or
//! [`conv2d_backprop_filter_scratch_len`] elements (0 for the forward pass of a thin window);
//! pass any slice that long, for example from a [`Scratch`] kept across calls
//! (`scratch.get(len)` allocates only when it must grow). A shorter slice still works, on fewer
//! threads or smaller chunks, down to one output row's windows. No kernel allocates on the heap
//! (called from outside the rayon pool, rayon itself allocates a queue block every 63 parallel
//! calls; from inside it, nothing).
//!
//! **Threads.** Kernels split large work (see [`PARALLEL_MIN_ELEMENTS`]) over the current rayon
//! pool, by image for the window ops and by outer index for the others; small work runs on the
//! calling thread. Layout ops, gathers, pooling and the thin forward convolution give bitwise
//! the same result whatever the number of threads; the `sgemm` convolutions may round
//! differently (the filter gradient adds per-task partial sums, see [`conv2d_backprop_filter`]).

mod conv;
mod gather;
mod geometry;
mod layout;
mod norm;
mod pool;
#[macro_use]
mod thin;
mod winograd;

pub use conv::{
    conv2d, conv2d_backprop_filter, conv2d_backprop_filter_scratch_len, conv2d_backprop_input,
    conv2d_backprop_input_scratch_len, conv2d_keeps_filter, conv2d_kept, conv2d_kept_scratch_len, conv2d_max_pool,
    conv2d_max_pool_applies, conv2d_max_pool_kept, conv2d_max_pool_scratch_len, conv2d_scratch_len, PoolEpilogue,
};
pub use dfc_ir::Padding;
pub use gather::{gather, scatter_add, Accumulate, Index, IndexOutOfRange};
pub use geometry::{Conv2dGeometry, PoolGeometry};
pub use layout::{concat, pad, slice, transpose};
pub use norm::{batch_norm, batch_norm_grad, batch_norm_grad_means, moments, norm_partials_len, norm_scales_len};
pub use pool::{avg_pool, avg_pool_grad, max_pool, max_pool_grad};
pub use winograd::KeptFilter;

/// Outputs smaller than this many elements (of 4 bytes; scaled by size for other types) are
/// computed on the calling thread; larger ones are split over the rayon pool.
pub const PARALLEL_MIN_ELEMENTS: usize = 1 << 15;

/// Whether work producing `len` elements of `T` is worth splitting over threads.
fn worth_parallel<T>(len: usize) -> bool {
    len * size_of::<T>() >= PARALLEL_MIN_ELEMENTS * 4 && rayon::current_num_threads() > 1
}

/// A reusable scratch buffer for the convolutions: `get(len)` returns a slice of at least `len`
/// elements, allocating only when the buffer must grow, so a kernel called again with the same
/// (or smaller) shapes allocates nothing.
#[derive(Clone, Debug, Default)]
pub struct Scratch {
    buf: Vec<f32>,
    /// The f64 partial sums of the normalisation kernels.
    wide: Vec<f64>,
}

impl Scratch {
    pub fn new() -> Scratch {
        Scratch::default()
    }

    /// A buffer that already holds `len` elements.
    pub fn with_len(len: usize) -> Scratch {
        Scratch { buf: vec![0.0; len], wide: Vec::new() }
    }

    /// The whole buffer, at least `len` elements long (its contents are unspecified).
    pub fn get(&mut self, len: usize) -> &mut [f32] {
        if self.buf.len() < len {
            self.buf.resize(len, 0.0);
        }
        &mut self.buf
    }

    /// At least `len` f32s and `wide` f64s, apart (contents unspecified), growing as `get` does.
    pub fn split(&mut self, len: usize, wide: usize) -> (&mut [f32], &mut [f64]) {
        if self.wide.len() < wide {
            self.wide.resize(wide, 0.0);
        }
        if self.buf.len() < len {
            self.buf.resize(len, 0.0);
        }
        (&mut self.buf, &mut self.wide)
    }

    /// The number of elements held.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
}
