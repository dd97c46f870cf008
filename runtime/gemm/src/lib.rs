//! Single-precision matrix products for the CPU backend.
//!
//! On x86-64 CPUs (detected at run time) the products run on this crate's own kernels, with chunks shared with
//! rayon's workers through `pool`: with AVX-512F, `avx512` (packed panels, a 12×32 register-blocked
//! microkernel); with AVX2 and FMA, `avx2` (a 6×16 microkernel). On other CPUs they run on the `gemm` crate,
//! which allocates its packing buffers on every call. `DFC_GEMM=avx2` (or `portable`) picks the narrower kernels
//! on a CPU with more, to measure them there.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod finite;
#[cfg(target_arch = "x86_64")]
mod grouped;
mod pool;
#[cfg(target_arch = "x86_64")]
mod sums;

#[cfg(test)]
#[path = "../../../tests/support/skip.rs"]
mod skip;

pub use pool::{hold, run_chunks, Hold};

/// Grows the packing buffers of each of rayon's workers to the most a product asks of them, once per process.
/// A worker's buffers otherwise grow in the first product it helps with, which may come at any step: a busy
/// machine can keep a worker out of a program's first steps (tests/native_alloc.rs saw 50–512 KiB so).
pub fn reserve_workers() {
    static RESERVED: std::sync::Once = std::sync::Once::new();
    RESERVED.call_once(|| {
        #[cfg(target_arch = "x86_64")]
        match kernels() {
            Kernels::Avx512 => {
                rayon::broadcast(|_| avx512::reserve_thread());
            }
            Kernels::Avx2 => {
                rayon::broadcast(|_| avx2::reserve_thread());
            }
            Kernels::Portable => {}
        }
    });
}

/// `c = a·b` (or `c += a·b` when `accumulate`), all row-major and contiguous: `a` is m×k
/// (k×m when `transpose_a`), `b` is k×n (n×k when `transpose_b`), `c` is m×n.
/// `parallel` lets the product use the rayon pool when it is large enough to pay for it.
#[allow(clippy::too_many_arguments)]
pub fn sgemm(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    transpose_a: bool,
    b: &[f32],
    transpose_b: bool,
    c: &mut [f32],
    accumulate: bool,
    parallel: bool,
) {
    assert!(a.len() >= m * k && b.len() >= k * n && c.len() >= m * n, "sgemm operands are too small");
    let lda = if transpose_a { m } else { k };
    let ldb = if transpose_b { k } else { n };
    sgemm_strided(m, n, k, a, lda, transpose_a, b, ldb, transpose_b, c, n, accumulate, parallel);
}

/// `c += alpha·a·b`, laid out as in [`sgemm`]: a product folded into the update of its destination (a
/// gradient step `w -= lr·xᵀg` reads and writes `w` once, and no gradient is stored).
#[allow(clippy::too_many_arguments)]
pub fn sgemm_update(
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: &[f32],
    transpose_a: bool,
    b: &[f32],
    transpose_b: bool,
    c: &mut [f32],
    parallel: bool,
) {
    assert!(a.len() >= m * k && b.len() >= k * n && c.len() >= m * n, "sgemm operands are too small");
    let lda = if transpose_a { m } else { k };
    let ldb = if transpose_b { k } else { n };
    product(m, n, k, alpha, a, lda, transpose_a, b, ldb, transpose_b, c, n, true, parallel);
}

/// How a product reads an A of bytes: byte `e` as `f32(e) · c` or `f32(e) / c`, rounded once, as the
/// interpreter computes `cast<f32>(x) * c` and `cast<f32>(x) / c` (images fed as bytes, scaled to [0, 1]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ByteScale {
    Mul(f32),
    Div(f32),
}

impl ByteScale {
    /// The constant c.
    pub fn factor(self) -> f32 {
        match self {
            ByteScale::Mul(c) | ByteScale::Div(c) => c,
        }
    }

    /// Byte `e` read as a float.
    pub fn apply(self, e: u8) -> f32 {
        match self {
            ByteScale::Mul(c) => f32::from(e) * c,
            ByteScale::Div(c) => f32::from(e) / c,
        }
    }
}

/// The A of a fused product: floats, or bytes read through a scale.
#[derive(Clone, Copy, Debug)]
pub enum Left<'a> {
    Floats(&'a [f32]),
    Bytes(&'a [u8], ByteScale),
}

/// What a fused product does to each element of C before it stores it: adds the bias of its column, then takes
/// `max(·, 0)` (the interpreter's `relu`: NaN and -0 kept) where `relu`, then zeroes it where the mask is not
/// above 0. A dense layer's `relu(x·w + b)` is then one product, and the product alone is never stored.
#[derive(Debug, Default)]
pub struct Epilogue<'a> {
    pub bias: Option<&'a [f32]>,
    pub relu: bool,
    /// Then where this m×n matrix (laid out as C) is not above 0, 0 (a relu's gradient, the mask its
    /// activation).
    pub mask: Option<&'a [f32]>,
    /// `Some`: n floats that get the sums of C's finished columns (the interpreter's `sum(c, axes = [0])`: a
    /// dense layer's bias gradient), each computed by the thread that finished those elements while they are in
    /// its cache. Summed in order of rows from +0, as the interpreter adds, where one thread finishes a whole
    /// column (threads sharing the product by columns; one thread); by chunks of rows otherwise (the chunks'
    /// sums added in order).
    pub col_sums: Option<&'a mut [f32]>,
}

impl Epilogue<'_> {
    /// Whether anything changes C's elements (the column sums only read them).
    fn is_some(&self) -> bool {
        self.bias.is_some() || self.relu || self.mask.is_some()
    }

    /// Applies the epilogue to C (m rows of n, `ldc` apart) where the product did not.
    fn apply(&self, c: &mut [f32], m: usize, n: usize, ldc: usize) {
        for (i, row) in c.chunks_mut(ldc).take(m).enumerate() {
            for (j, x) in row[..n].iter_mut().enumerate() {
                if let Some(bias) = self.bias {
                    *x += bias[j];
                }
                if self.relu && 0.0 > *x {
                    *x = 0.0;
                }
                if self.mask.is_some_and(|mask| mask[i * n + j].partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater))
                {
                    *x = 0.0;
                }
            }
        }
    }
}

/// A product fused with what surrounds it in a model, contiguous operands laid out as in [`sgemm`]:
/// `c = epilogue(A·b)`, or with `update`, `c += α·A·b` (a folded update, which takes no epilogue). `A` may be
/// bytes: a layer fed bytes reads them where they are, and the floats of A are never stored. With AVX-512 or
/// AVX2, A is converted from the bytes block by block as it is packed, and the epilogue applied to each tile as
/// it is stored; elsewhere (the `gemm` crate) A is converted into a buffer first, and the epilogue applied to C
/// after.
///
/// `b_rewritten`: B is rewritten between calls by other parallel products (a weight that each training step
/// updates through [`sgemm_update`], whose threads share it by rows of B). With AVX-512 and an A of bytes stored
/// row-major, the threads then share the product along its reduction, one chunk per thread, each reading the rows
/// of B it last wrote, rather than by rows of C, each reading all of B; the epilogue follows the partial sums. (The
/// AVX2 kernels share every such product of bytes so, flag or not.)
#[allow(clippy::too_many_arguments)]
pub fn sgemm_fused(
    m: usize,
    n: usize,
    k: usize,
    a: Left<'_>,
    transpose_a: bool,
    b: &[f32],
    transpose_b: bool,
    c: &mut [f32],
    update: Option<f32>,
    epilogue: Epilogue<'_>,
    b_rewritten: bool,
    parallel: bool,
) {
    sgemm_kept(m, n, k, a, transpose_a, b, transpose_b, c, update, epilogue, b_rewritten, parallel, None);
}

/// A weight that products read as their B (`k×n`, stored row-major) and that does not change from one call to the
/// next (inference), kept packed between calls in the panels the AVX2 kernels read: the first product that reads it
/// after it went stale packs it whole, later ones read the panels and pack nothing (the mlp's inference on the AVX2
/// kernels: 330 → 318 µs a batch of 128). Whoever writes the weight marks the panels
/// [`stale`](KeptPanels::stale). On other kernels (AVX-512, the portable ones) the panels hold nothing and every
/// product packs B as it always does.
#[derive(Debug)]
pub struct KeptPanels {
    k: usize,
    n: usize,
    /// The panels from their first 64-byte boundary, or nothing until first packed.
    buf: Vec<f32>,
    fresh: bool,
}

impl KeptPanels {
    /// Panels for a `k×n` weight, stale.
    pub fn new(k: usize, n: usize) -> KeptPanels {
        KeptPanels { k, n, buf: Vec::new(), fresh: false }
    }

    /// Whether the kernels the products run on read kept panels (the AVX2 kernels): elsewhere keeping them is
    /// pointless.
    pub fn used() -> bool {
        on_avx2_kernels()
    }

    /// Forgets what the panels hold: the weight was written.
    pub fn stale(&mut self) {
        self.fresh = false;
    }

    /// The panels of `b` (the weight, `k×n` row-major), packed first if stale: ⌈n/16⌉ panels of k·16 floats from a
    /// 64-byte boundary (each step of a panel one cache line).
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `b` holds k·n floats.
    #[cfg(target_arch = "x86_64")]
    unsafe fn packed(&mut self, b: &[f32]) -> *const f32 {
        let len = avx2::packed_len(self.k, self.n) + 16;
        if self.buf.len() < len {
            self.buf = vec![0.0; len];
        }
        let skip = self.buf.as_ptr().align_offset(64).min(16);
        let buf = &mut self.buf[skip..];
        if !self.fresh {
            // SAFETY: the caller's contract; `buf` holds at least packed_len(k, n) floats from a 64-byte boundary,
            // where the panels then start.
            unsafe { avx2::pack_whole_b(self.k, self.n, b, buf) };
            self.fresh = true;
        }
        buf.as_ptr()
    }
}

/// [`sgemm_fused`] with B read from `kept`, the panels of a weight that B is (stored row-major: not `transpose_b`),
/// where the kernels read kept panels (packed there first if they are stale).
#[allow(clippy::too_many_arguments)]
pub fn sgemm_kept(
    m: usize,
    n: usize,
    k: usize,
    a: Left<'_>,
    transpose_a: bool,
    b: &[f32],
    transpose_b: bool,
    c: &mut [f32],
    update: Option<f32>,
    epilogue: Epilogue<'_>,
    b_rewritten: bool,
    parallel: bool,
    kept: Option<&mut KeptPanels>,
) {
    if let Some(panels) = &kept {
        assert!((panels.k, panels.n, transpose_b) == (k, n, false), "sgemm: kept panels of another B");
    }
    let a_len = match a {
        Left::Floats(a) => a.len(),
        Left::Bytes(a, _) => a.len(),
    };
    assert!(a_len >= m * k && b.len() >= k * n && c.len() >= m * n, "sgemm operands are too small");
    assert!(epilogue.bias.is_none_or(|bias| bias.len() >= n), "sgemm: the bias is shorter than a row of C");
    assert!(epilogue.mask.is_none_or(|mask| mask.len() >= m * n), "sgemm: the mask is smaller than C");
    assert!(epilogue.col_sums.as_ref().is_none_or(|sums| sums.len() >= n), "sgemm: the column sums are fewer than n");
    assert!(
        update.is_none() || !(epilogue.is_some() || epilogue.col_sums.is_some()),
        "sgemm: an update takes no epilogue"
    );
    let lda = if transpose_a { m } else { k };
    let ldb = if transpose_b { k } else { n };
    let (accumulate, alpha) = (update.is_some(), update.unwrap_or(1.0));
    #[cfg(target_arch = "x86_64")]
    let chosen = kernels();
    #[cfg(target_arch = "x86_64")]
    if chosen != Kernels::Portable && m > 0 && n > 0 && k > 0 {
        let (a, bytes) = match a {
            Left::Floats(a) => (a.as_ptr(), None),
            Left::Bytes(a, scale) => (a.as_ptr().cast(), Some(scale)),
        };
        let product = avx512::Product {
            m,
            n,
            k,
            a,
            lda,
            ta: transpose_a,
            b: b.as_ptr(),
            ldb,
            tb: transpose_b,
            c: c.as_mut_ptr(),
            ldc: n,
            tc: false,
            accumulate,
            alpha,
            bytes,
            bias: epilogue.bias.map_or(std::ptr::null(), <[f32]>::as_ptr),
            relu: epilogue.relu,
            mask: epilogue.mask.map_or(std::ptr::null(), <[f32]>::as_ptr),
            sums: epilogue.col_sums.map_or(std::ptr::null_mut(), <[f32]>::as_mut_ptr),
            b_rewritten,
            b_panels: std::ptr::null(),
            id: 0,
        };
        // SAFETY: the kernels' instruction sets are available (`kernels`); A holds m·k elements (floats or bytes),
        // B k·n floats, C m·n floats, the bias n floats, the mask m·n and the column sums n, contiguous, as asserted
        // above; kept panels hold ⌈n/16⌉ panels of k·16 floats from a 64-byte boundary (`KeptPanels::packed`).
        return unsafe {
            if chosen == Kernels::Avx512 {
                avx512::sgemm(product, parallel)
            } else {
                let b_panels = kept.map_or(std::ptr::null(), |panels| panels.packed(b));
                avx2::sgemm(avx512::Product { b_panels, ..product }, parallel)
            }
        };
    }
    let converted: Vec<f32>;
    let a = match a {
        Left::Floats(a) => a,
        Left::Bytes(a, scale) => {
            converted = a[..m * k].iter().map(|&e| scale.apply(e)).collect();
            &converted
        }
    };
    product(m, n, k, alpha, a, lda, transpose_a, b, ldb, transpose_b, c, n, accumulate, parallel);
    epilogue.apply(c, m, n, n);
    if let Some(sums) = epilogue.col_sums {
        sums[..n].fill(0.0);
        for row in c[..m * n].chunks_exact(n.max(1)) {
            for (s, &x) in sums.iter_mut().zip(row) {
                *s += x;
            }
        }
    }
}

/// A B of many products `C = A·B` (`k×n`, row-major), laid out once for all of them: packed into the panels the
/// AVX2 kernels read, on CPUs whose products run on those; elsewhere B as given. Made by [`pack_b`], used by
/// [`sgemm_packed`]. (A Winograd convolution multiplies 36 chunks of tiles by each of its 36 transformed filters.)
#[derive(Clone, Copy, Debug)]
pub struct PackedB<'a> {
    k: usize,
    n: usize,
    layout: Layout<'a>,
}

#[derive(Clone, Copy, Debug)]
enum Layout<'a> {
    /// B as given, multiplied by [`sgemm`].
    Plain(&'a [f32]),
    /// The AVX2 kernels' panels: 16 columns (zeros past n) of all k steps each, step-major, 32-byte aligned.
    #[cfg(target_arch = "x86_64")]
    Panels(&'a [f32]),
}

/// The floats of the buffer that [`pack_b`] needs for a `k×n` B (0 where B is used as given).
pub fn packed_b_len(k: usize, n: usize) -> usize {
    #[cfg(target_arch = "x86_64")]
    if kernels() == Kernels::Avx2 {
        return avx2::packed_len(k, n);
    }
    let _ = (k, n);
    0
}

/// `b` (`k×n`, row-major) laid out for [`sgemm_packed`], in `buf` (at least [`packed_b_len`] floats).
pub fn pack_b<'a>(k: usize, n: usize, b: &'a [f32], buf: &'a mut [f32]) -> PackedB<'a> {
    assert!(b.len() >= k * n, "pack_b: B is too small");
    #[cfg(target_arch = "x86_64")]
    if kernels() == Kernels::Avx2 {
        assert!(buf.len() >= avx2::packed_len(k, n), "pack_b: the buffer is too small");
        // SAFETY: the CPU has AVX2 and FMA (`kernels`); B holds k·n floats and `buf` packed_len(k, n).
        let panels = unsafe { avx2::pack_whole_b(k, n, b, buf) };
        return PackedB { k, n, layout: Layout::Panels(panels) };
    }
    let _ = buf;
    PackedB { k, n, layout: Layout::Plain(b) }
}

/// `b` laid out for [`sgemm_packed`] by an earlier [`pack_b`] of this same `b` into this same `buf`, which neither
/// moved nor changed since: packs nothing (a Winograd convolution's filter, kept transformed and laid out between
/// calls of an inference). Given a `buf` that holds anything else, the products read those floats as B's.
pub fn packed_b<'a>(k: usize, n: usize, b: &'a [f32], buf: &'a [f32]) -> PackedB<'a> {
    assert!(b.len() >= k * n, "packed_b: B is too small");
    #[cfg(target_arch = "x86_64")]
    if kernels() == Kernels::Avx2 {
        assert!(buf.len() >= avx2::packed_len(k, n), "packed_b: the buffer is too small");
        // Where `pack_b` put them: the same range of a buffer at the same address.
        let panels = &buf[avx2::panels_in(k, n, buf.as_ptr())];
        return PackedB { k, n, layout: Layout::Panels(panels) };
    }
    let _ = buf;
    PackedB { k, n, layout: Layout::Plain(b) }
}

/// `c = a·b` for a B laid out by [`pack_b`], on the calling thread: `a` is m×k and `c` m×n, row-major and
/// contiguous. The same bits as [`sgemm`] of the same operands without `parallel`.
pub fn sgemm_packed(m: usize, a: &[f32], b: &PackedB<'_>, c: &mut [f32]) {
    let (k, n) = (b.k, b.n);
    assert!(a.len() >= m * k && c.len() >= m * n, "sgemm_packed operands are too small");
    match b.layout {
        Layout::Plain(b) => sgemm(m, n, k, a, false, b, false, c, false, false),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Panels` are made only where the CPU has AVX2 and FMA (`pack_b`), and hold ⌈n/16⌉ panels of k·16
        // floats; A holds m·k floats and C m·n, as asserted.
        Layout::Panels(panels) => unsafe { avx2::sgemm_packed(m, n, k, a, panels, c) },
    }
}

/// [`sgemm`] with explicit leading dimensions (the distance between consecutive rows as stored): `a` holds m rows
/// of k (k rows of m when `transpose_a`) `lda` apart, `b` k rows of n (n rows of k when `transpose_b`) `ldb`
/// apart, `c` m rows of n `ldc` apart. Elements between the rows are neither read nor written.
#[allow(clippy::too_many_arguments)]
pub fn sgemm_strided(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    lda: usize,
    transpose_a: bool,
    b: &[f32],
    ldb: usize,
    transpose_b: bool,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
    parallel: bool,
) {
    product(m, n, k, 1.0, a, lda, transpose_a, b, ldb, transpose_b, c, ldc, accumulate, parallel);
}

/// `c = alpha·a·b`, or `c += alpha·a·b` when `accumulate`, with leading dimensions.
#[allow(clippy::too_many_arguments)]
fn product(
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: &[f32],
    lda: usize,
    transpose_a: bool,
    b: &[f32],
    ldb: usize,
    transpose_b: bool,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
    parallel: bool,
) {
    let (a_rows, a_cols) = if transpose_a { (k, m) } else { (m, k) };
    let (b_rows, b_cols) = if transpose_b { (n, k) } else { (k, n) };
    check("a", a.len(), a_rows, a_cols, lda);
    check("b", b.len(), b_rows, b_cols, ldb);
    check("c", c.len(), m, n, ldc);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for row in c.chunks_mut(ldc).take(m) {
                row[..n].fill(0.0);
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let (avx512, avx2) = match kernels() {
            Kernels::Avx512 => (true, false),
            Kernels::Avx2 => (false, true),
            Kernels::Portable => (false, false),
        };
        if !avx512 && !avx2 {
            return gemm_crate(m, n, k, alpha, a, lda, transpose_a, b, ldb, transpose_b, c, ldc, accumulate, parallel);
        }
        let product = avx512::Product {
            m,
            n,
            k,
            a: a.as_ptr(),
            lda,
            ta: transpose_a,
            b: b.as_ptr(),
            ldb,
            tb: transpose_b,
            c: c.as_mut_ptr(),
            ldc,
            tc: false,
            accumulate,
            alpha,
            bytes: None,
            bias: std::ptr::null(),
            relu: false,
            mask: std::ptr::null(),
            sums: std::ptr::null_mut(),
            b_rewritten: false,
            b_panels: std::ptr::null(),
            id: 0,
        };
        // SAFETY: the kernels' instruction sets are available, and `check` put every element the product
        // addresses (rows·ld at most) in bounds of the three slices.
        unsafe {
            if avx512 {
                avx512::sgemm(product, parallel)
            } else {
                avx2::sgemm(product, parallel)
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    gemm_crate(m, n, k, alpha, a, lda, transpose_a, b, ldb, transpose_b, c, ldc, accumulate, parallel);
}

/// Names the narrower kernels for every product: `avx2` (an AVX2-only CPU's) or `portable` (the `gemm`
/// crate's), to measure them on a CPU that has more (`cargo bench -p dfc-gemm --bench sgemm`).
pub const KERNELS_VARIABLE: &str = "DFC_GEMM";

/// The kernels the products run on.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernels {
    Avx512,
    Avx2,
    Portable,
}

/// The widest kernels this CPU can run, or narrower ones where `DFC_GEMM` asks for them (found once).
#[cfg(target_arch = "x86_64")]
fn kernels() -> Kernels {
    static KERNELS: std::sync::OnceLock<Kernels> = std::sync::OnceLock::new();
    *KERNELS.get_or_init(|| {
        let avx2 = std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma");
        // The AVX-512 kernels run the AVX2 ones for a batch of one (`avx2::rows`); every CPU with AVX-512F has both.
        let widest = if std::arch::is_x86_feature_detected!("avx512f") && avx2 {
            Kernels::Avx512
        } else if avx2 {
            Kernels::Avx2
        } else {
            Kernels::Portable
        };
        match std::env::var(KERNELS_VARIABLE).as_deref() {
            Ok("avx2") if avx2 => Kernels::Avx2,
            Ok("portable") => Kernels::Portable,
            _ => widest,
        }
    })
}

/// Whether the products run on the AVX2 kernels (256-bit vectors: a CPU without AVX-512, or `DFC_GEMM=avx2`), where
/// a multiply-add costs twice what it does on the AVX-512 kernels.
pub fn on_avx2_kernels() -> bool {
    #[cfg(target_arch = "x86_64")]
    return kernels() == Kernels::Avx2;
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Asserts that a slice of `len` floats holds `rows` rows of `cols`, `ld` apart.
fn check(name: &str, len: usize, rows: usize, cols: usize, ld: usize) {
    if rows == 0 || cols == 0 {
        return;
    }
    assert!(ld >= cols, "sgemm: leading dimension of {name} ({ld}) is less than its row length ({cols})");
    let needed = (rows - 1).checked_mul(ld).and_then(|n| n.checked_add(cols));
    assert!(needed.is_some_and(|needed| len >= needed), "sgemm operand {name} is too small");
}

/// The product on the `gemm` crate, with the same contract as [`product`] (bounds checked by the caller).
#[allow(clippy::too_many_arguments)]
fn gemm_crate(
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: &[f32],
    lda: usize,
    transpose_a: bool,
    b: &[f32],
    ldb: usize,
    transpose_b: bool,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
    parallel: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for row in c.chunks_mut(ldc).take(m) {
                row[..n].fill(0.0);
            }
        }
        return;
    }
    let (a_rs, a_cs) = if transpose_a { (1, lda as isize) } else { (lda as isize, 1) };
    let (b_rs, b_cs) = if transpose_b { (1, ldb as isize) } else { (ldb as isize, 1) };
    let parallelism = if parallel && m * n * k >= 1 << 18 {
        gemm::Parallelism::Rayon(rayon::current_num_threads())
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the caller checked that every index of the three matrices is in bounds.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            ldc as isize,
            accumulate,
            a.as_ptr(),
            a_cs,
            a_rs,
            b.as_ptr(),
            b_cs,
            b_rs,
            if accumulate { 1.0 } else { 0.0 },
            alpha,
            false,
            false,
            false,
            parallelism,
        );
    }
}

#[cfg(test)]
mod tests {
    /// The `gemm` crate path (taken on CPUs without AVX-512) with leading dimensions, against a naive product.
    #[test]
    fn fallback_matches_naive() {
        let mut rng = fastrand::Rng::with_seed(2);
        for _ in 0..200 {
            let (m, n, k) = (rng.usize(1..=40), rng.usize(1..=40), rng.usize(0..=40));
            let (ta, tb, accumulate) = (rng.bool(), rng.bool(), rng.bool());
            let alpha = if rng.bool() { 1.0 } else { rng.f32() * 4.0 - 2.0 };
            let lda = if ta { m } else { k } + rng.usize(0..3);
            let ldb = if tb { k } else { n } + rng.usize(0..3);
            let ldc = n + rng.usize(0..3);
            let a: Vec<f32> = (0..m.max(k) * lda).map(|_| rng.f32() - 0.5).collect();
            let b: Vec<f32> = (0..n.max(k) * ldb).map(|_| rng.f32() - 0.5).collect();
            let c0: Vec<f32> = (0..m * ldc).map(|_| rng.f32() - 0.5).collect();
            let mut c = c0.clone();
            super::gemm_crate(m, n, k, alpha, &a, lda, ta, &b, ldb, tb, &mut c, ldc, accumulate, rng.bool());
            for i in 0..m {
                for j in 0..ldc {
                    let mut sum = 0.0;
                    for p in 0..k {
                        if j < n {
                            sum += (if ta { a[p * lda + i] } else { a[i * lda + p] })
                                * (if tb { b[j * ldb + p] } else { b[p * ldb + j] });
                        }
                    }
                    let old = if accumulate || j >= n { c0[i * ldc + j] } else { 0.0 };
                    let want = old + if j < n { alpha * sum } else { 0.0 };
                    assert!((c[i * ldc + j] - want).abs() <= 1e-4 * (1.0 + want.abs()), "{m}×{n}×{k} ({i}, {j})");
                }
            }
        }
    }
}
