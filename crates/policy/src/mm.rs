//! The fused CPU path's dense products and exponentials, shared by its ops (attention, the
//! frozen matmul, SwiGLU, the LM head): one call of the `gemm` crate (candle's CPU matmul, so
//! the same results for the same shapes) written straight into the op's output, e^x on a
//! whole row at a time, and the values of contiguous CPU tensors read in place
//! ([`with_slices`]).

use candle_core::{CpuStorage, Layout, Result, Tensor};
use num_traits::Float;

/// A matrix in memory: its first element and its row and column strides (so a transpose is a
/// view).
#[derive(Clone, Copy)]
pub(crate) struct Mat<T> {
    ptr: *const T,
    rs: isize,
    cs: isize,
}

impl<T> Mat<T> {
    /// Row-major (·, cols).
    pub(crate) fn rows(x: &[T], cols: usize) -> Mat<T> {
        Mat { ptr: x.as_ptr(), rs: cols as isize, cs: 1 }
    }
    /// The transpose of row-major (·, cols).
    pub(crate) fn t(x: &[T], cols: usize) -> Mat<T> {
        Mat { ptr: x.as_ptr(), rs: 1, cs: cols as isize }
    }
}

/// A product's destination: its first element and its row and column strides.
#[derive(Clone, Copy)]
struct MatMut<T> {
    /// The first element.
    ptr: *mut T,
    /// Row stride (elements).
    rs: isize,
    /// Column stride (elements).
    cs: isize,
}

/// dst (m × n, row-major) = c · a (m × k) · b (k × n), or with `add` dst += c · a · b; on the
/// calling thread (`threads` 1: an op that runs one product per rayon task) or split over
/// `threads` of rayon's pool, as candle's matmul does.
///
/// # Safety
/// `dst` must be valid for m × n writes (initialised when `add`; otherwise it is never read),
/// `a` and `b` must view memory holding m × k and k × n values at their strides.
pub(crate) unsafe fn mm_raw<T: Float + 'static>(
    (m, n, k): (usize, usize, usize),
    dst: *mut T,
    a: Mat<T>,
    b: Mat<T>,
    c: T,
    threads: usize,
    add: bool,
) {
    // SAFETY: the caller's contract; row-major dst.
    unsafe { mm_strided((m, n, k), MatMut { ptr: dst, rs: n as isize, cs: 1 }, a, b, c, threads, add) }
}

/// [`mm_raw`] with dst's row and column strides given.
///
/// # Safety
/// As [`mm_raw`], dst valid at those strides.
unsafe fn mm_strided<T: Float + 'static>(
    (m, n, k): (usize, usize, usize),
    dst: MatMut<T>,
    a: Mat<T>,
    b: Mat<T>,
    c: T,
    threads: usize,
    add: bool,
) {
    let par = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    // gemm computes dst = α·dst + β·a·b, reading dst only when asked to
    let alpha = if add { T::one() } else { T::zero() };
    // SAFETY: the caller's contract.
    unsafe {
        gemm::gemm(
            m, n, k, dst.ptr, dst.cs, dst.rs, add, a.ptr, a.cs, a.rs, b.ptr, b.cs, b.rs, alpha, c, false, false, false,
            par,
        )
    }
}

/// The m × n product a · b written as its transpose, a new n × m row-major matrix, on candle's
/// thread count: candle's matmul backward forms a weight's gradient xᵀg as (in, out) and a
/// transpose node then adds it into the (out, in) weight's gradient through a strided view;
/// this is the same gemm call (the same operands and blocking) writing (out, in) at once.
pub(crate) fn product_transposed<T: Float + 'static>(m: usize, n: usize, k: usize, a: Mat<T>, b: Mat<T>) -> Vec<T> {
    fresh(m, n, k, a, b, T::one(), true)
}

/// dst (m × n, row-major, initialised) += c · a · b, on candle's thread count: a low-rank term
/// added onto a product in place.
pub(crate) fn mm_add<T: Float + 'static>(m: usize, n: usize, k: usize, dst: &mut [T], a: Mat<T>, b: Mat<T>, c: T) {
    assert!(dst.len() >= m * n);
    // SAFETY: dst holds m × n initialised values (read, then written); the callers' views hold
    // the stated shapes (the LoRA op checks its operands' dimensions).
    unsafe { mm_raw((m, n, k), dst.as_mut_ptr(), a, b, c, candle_core::utils::get_num_threads(), true) }
}

/// dst (m × n, row-major, initialised) += c · a · b on the calling thread.
pub(crate) fn mm_acc<T: Float + 'static>(m: usize, n: usize, k: usize, dst: &mut [T], a: Mat<T>, b: Mat<T>, c: T) {
    assert!(dst.len() >= m * n);
    // SAFETY: dst holds m × n initialised values; the callers' views hold the stated shapes.
    unsafe { mm_raw((m, n, k), dst.as_mut_ptr(), a, b, c, 1, true) }
}

/// [`mm_raw`] into `dst` (≥ m × n values), on the calling thread.
pub(crate) fn mm<T: Float + 'static>(m: usize, n: usize, k: usize, dst: &mut [T], a: Mat<T>, b: Mat<T>, c: T) {
    assert!(dst.len() >= m * n);
    // SAFETY: dst holds m × n values; every caller passes `a` and `b` over a block of the op's
    // inputs or its own buffers of the stated shapes.
    unsafe { mm_raw((m, n, k), dst.as_mut_ptr(), a, b, c, 1, false) }
}

/// A new m × n row-major product a · b on candle's thread count (`RAYON_NUM_THREADS`), written
/// straight into fresh memory: no zero fill first (candle's matmul clears its output, then
/// `gemm` overwrites it) and no copy after (a value handed to the graph through `routed`).
pub(crate) fn product<T: Float + 'static>(m: usize, n: usize, k: usize, a: Mat<T>, b: Mat<T>) -> Vec<T> {
    scaled_product(m, n, k, a, b, T::one())
}

/// [`product`] times c.
pub(crate) fn scaled_product<T: Float + 'static>(m: usize, n: usize, k: usize, a: Mat<T>, b: Mat<T>, c: T) -> Vec<T> {
    fresh(m, n, k, a, b, c, false)
}

/// c · a · b (m × n) in fresh memory, row-major or (`transposed`) as its n × m transpose.
fn fresh<T: Float + 'static>(m: usize, n: usize, k: usize, a: Mat<T>, b: Mat<T>, c: T, transposed: bool) -> Vec<T> {
    let len = m * n;
    if k == 0 {
        return vec![T::zero(); len];
    }
    let (rs, cs) = if transposed { (1, m as isize) } else { (n as isize, 1) };
    let mut out: Vec<T> = Vec::with_capacity(len);
    // SAFETY: `out` has capacity for m × n values, which gemm writes (every one: read_dst is
    // false and k > 0; element (i, j) at i·rs + j·cs) before the length covers them; `a`, `b`
    // are the caller's views (the callers check the slices' lengths).
    unsafe {
        mm_strided(
            (m, n, k),
            MatMut { ptr: out.as_mut_ptr(), rs, cs },
            a,
            b,
            c,
            candle_core::utils::get_num_threads(),
            false,
        );
        out.set_len(len);
    }
    out
}

/// The values of a contiguous CPU storage under `l`.
pub(crate) fn slice<'a, T: candle_core::WithDType>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [T]> {
    let v = s.as_slice::<T>()?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&v[a..b]),
        None => candle_core::bail!("expected a contiguous tensor"),
    }
}

/// `f` on the values of contiguous CPU tensors, read in place (a backward pass reads its
/// saved activations without copying them out).
pub(crate) fn with_slices<T: candle_core::WithDType, R, const N: usize>(
    ts: [&Tensor; N],
    f: impl FnOnce([&[T]; N]) -> R,
) -> Result<R> {
    let held = ts.map(|t| t.storage_and_layout());
    let mut vals: Vec<&[T]> = Vec::with_capacity(N);
    for (st, l) in &held {
        match &**st {
            candle_core::Storage::Cpu(s) => vals.push(slice(s, l)?),
            _ => candle_core::bail!("expected CPU tensors"),
        }
    }
    let vals: [&[T]; N] = vals.try_into().map_err(|_| candle_core::Error::Msg("tensor count".into()))?;
    Ok(f(vals))
}

/// e^x in place over a row.
pub(crate) trait ExpRow: Float + Send + Sync + 'static {
    fn exp_row(x: &mut [Self]);
}

impl ExpRow for f32 {
    /// The vectorised kernel of the inference path (`kernels::rows::exp_in_place`: relative
    /// error < 3e-7): libm's scalar `expf` was 7% of an f32 training step (attention's softmax
    /// forward and recomputed in the backward, SwiGLU's sigmoid).
    fn exp_row(x: &mut [f32]) {
        kernels::rows::exp_in_place(x)
    }
}

impl ExpRow for f64 {
    /// libm: the f64 path is the exact gradient checks'.
    fn exp_row(x: &mut [f64]) {
        x.iter_mut().for_each(|v| *v = v.exp())
    }
}
