//! The fused CPU path's dense products and exponentials, shared by its ops (the frozen, weight
//! and LoRA products, the LM head): the products are `kernels::dense`'s (one call of the
//! `gemm` crate, candle's CPU matmul, so the same results for the same shapes, written straight
//! into the op's output), here given candle's thread count; e^x on a whole row at a time, and
//! the values of contiguous CPU tensors read in place ([`with_slices`]).

use candle_core::{CpuStorage, Layout, Result, Tensor};
use num_traits::Float;

/// A matrix in a slice at row and column strides (`Mat::rows`, `Mat::t`: a transpose is a view).
pub(crate) use kernels::dense::Mat;

/// The m × n product a · b written as its transpose, a new n × m row-major matrix, on candle's
/// thread count: candle's matmul backward forms a weight's gradient xᵀg as (in, out) and a
/// transpose node then adds it into the (out, in) weight's gradient through a strided view;
/// this is the same gemm call (the same operands and blocking) writing (out, in) at once.
pub(crate) fn product_transposed<T: Float + 'static>(m: usize, n: usize, k: usize, a: Mat<T>, b: Mat<T>) -> Vec<T> {
    kernels::dense::product((m, n, k), a, b, T::one(), candle_core::utils::get_num_threads(), true)
}

/// dst (m × n, row-major, initialised) += c · a · b, on candle's thread count: a low-rank term
/// added onto a product in place.
pub(crate) fn mm_add<T: Float + 'static>(m: usize, n: usize, k: usize, dst: &mut [T], a: Mat<T>, b: Mat<T>, c: T) {
    kernels::dense::mm_into((m, n, k), dst, a, b, c, candle_core::utils::get_num_threads(), true)
}

/// A new m × n row-major product a · b on candle's thread count (`RAYON_NUM_THREADS`), written
/// straight into fresh memory (`kernels::dense::product`: no zero fill first, no copy after; a
/// value handed to the graph through `routed`).
pub(crate) fn product<T: Float + 'static>(m: usize, n: usize, k: usize, a: Mat<T>, b: Mat<T>) -> Vec<T> {
    scaled_product(m, n, k, a, b, T::one())
}

/// [`product`] times c.
pub(crate) fn scaled_product<T: Float + 'static>(m: usize, n: usize, k: usize, a: Mat<T>, b: Mat<T>, c: T) -> Vec<T> {
    kernels::dense::product((m, n, k), a, b, c, candle_core::utils::get_num_threads(), false)
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

/// e^x in place over a row: `kernels::rows_grad::ExpRow` (f32 on the inference path's vectorised
/// kernel, f64 on libm).
pub(crate) use kernels::rows_grad::ExpRow;
