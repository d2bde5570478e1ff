//! A frozen weight packed once for the CPU's products ([`PackedWeight`]: bf16, or f32 for the
//! short passes), and its product with the gradient of x alone ([`packed_matmul`]).

use candle_core::{Result, Tensor};

/// A frozen weight W (out, in) packed once for the CPU's products, in the layouts of the
/// `kernels::packed` kernels.
/// - bf16 ([`PackedWeight::bf16`], `kernels::bf16`: each weight and each input rounded to
///   bf16, the products summed in f32 — `VDPBF16PS`'s arithmetic on AVX-512 BF16): W for the
///   forward's x Wᵀ and Wᵀ for the backward's g W, both streaming half the bytes of f32; two
///   bf16 copies take the memory of one f32 copy.
/// - f32 ([`PackedWeight::f32`], `kernels::f32mm`: each output one fused multiply-add chain
///   from 0 over the inputs in order, the bits φ's extraction and generation compute): W
///   packed for the forward of passes of at most [`F32_PACKED_MAX_ROWS`] rows, where `gemm`
///   packs W again on every call; the `gemm` call of onepass's own products
///   (`crate::mm::product`) for longer forwards and for every backward g W. Measured in whole
///   passes (session 33, README): the online loop's chunk 16.3–16.5 s with the decoder packed
///   against 18.9–19.0 s all on `gemm`; `train_step` 8 × 256 (2,048 rows) and the backward
///   faster on `gemm`. One more f32 copy of each frozen weight.
pub struct PackedWeight {
    /// W itself (f32, contiguous; f32 only): `gemm`'s products where the packed kernel is the
    /// slower. It shares the weight's storage where the weight is f32 and contiguous.
    w: Option<Tensor>,
    fwd: Box<dyn kernels::packed::PackedMatrix>,
    /// Wᵀ packed (bf16 only).
    bwd: Option<Box<dyn kernels::packed::PackedMatrix>>,
    /// The products round their inputs to bf16 (a merge would round its update away).
    pub bf16: bool,
}

/// The longest pass (rows = sequences × tokens) whose f32 forward runs on the packed kernel;
/// longer ones take `gemm` ([`PackedWeight`]'s measurements).
pub const F32_PACKED_MAX_ROWS: usize = 1024;

impl PackedWeight {
    /// Packs `w` (out, in) for the bf16 kernel.
    pub fn bf16(w: &Tensor) -> Result<PackedWeight> {
        let (v, vt, out, inp) = both_layouts(w)?;
        Ok(PackedWeight {
            w: None,
            fwd: Box::new(kernels::bf16::Bf16Matrix::from_f32(&v, out, inp)),
            bwd: Some(Box::new(kernels::bf16::Bf16Matrix::from_f32(&vt, inp, out))),
            bf16: true,
        })
    }

    /// Packs `w` (out, in) for the f32 kernel.
    pub fn f32(w: &Tensor) -> Result<PackedWeight> {
        let (out, inp) = w.dims2()?;
        let w = w.to_dtype(candle_core::DType::F32)?.contiguous()?;
        let v: Vec<f32> = w.flatten_all()?.to_vec1()?;
        Ok(PackedWeight {
            w: Some(w),
            fwd: Box::new(kernels::f32mm::F32Matrix::from_f32(&v, out, inp)),
            bwd: None,
            bf16: false,
        })
    }

    /// Whether a forward of `rows` rows runs on the packed kernel.
    fn packed_forward(&self, rows: usize) -> bool {
        self.w.is_none() || rows <= F32_PACKED_MAX_ROWS
    }

    /// [`Self::forward`] on values: x (rows × in, row-major; T must be f32) to (rows × out),
    /// with no tensor made or copied around the product.
    pub(crate) fn forward_values<T: num_traits::Float + candle_core::WithDType>(
        &self,
        x: &[T],
        rows: usize,
    ) -> Result<Vec<T>> {
        use crate::mm::{product, Mat};
        let x = f32_values(x)?;
        let y = match &self.w {
            Some(w) if !self.packed_forward(rows) => {
                let (out, inp) = w.dims2()?;
                crate::mm::with_slices::<f32, _, 1>([w], |[w]| {
                    product(rows, out, inp, Mat::rows(x, inp), Mat::t(w, inp))
                })?
            }
            _ => self.fwd.matmul_t(x, rows),
        };
        Ok(y.into_iter().map(|v| T::from(v).unwrap_or_else(T::nan)).collect())
    }

    /// [`Self::backward`] on values: g (rows × out; T must be f32) to g W (rows × in).
    pub(crate) fn backward_values<T: num_traits::Float + candle_core::WithDType>(
        &self,
        g: &[T],
        rows: usize,
    ) -> Result<Vec<T>> {
        use crate::mm::{product, Mat};
        let g = f32_values(g)?;
        let dx = match (&self.bwd, &self.w) {
            (Some(b), _) => b.matmul_t(g, rows),
            (None, Some(w)) => {
                let (out, inp) = w.dims2()?;
                crate::mm::with_slices::<f32, _, 1>([w], |[w]| {
                    product(rows, inp, out, Mat::rows(g, out), Mat::rows(w, inp))
                })?
            }
            (None, None) => candle_core::bail!("a packed weight with neither Wᵀ packed nor W kept"),
        };
        Ok(dx.into_iter().map(|v| T::from(v).unwrap_or_else(T::nan)).collect())
    }

    /// x Wᵀ for x (rows, in) f32 on the CPU: (rows, out).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let rows = check_input(x, self.fwd.k(), self.fwd.n())?;
        let y = crate::mm::with_slices::<f32, _, 1>([&x.contiguous()?], |[x]| self.forward_values(x, rows))??;
        Tensor::from_vec(y, (rows, self.fwd.n()), x.device())
    }

    /// g W for g (rows, out) f32 on the CPU: (rows, in) — the gradient of x.
    pub fn backward(&self, g: &Tensor) -> Result<Tensor> {
        let rows = check_input(g, self.fwd.n(), self.fwd.k())?;
        let dx = crate::mm::with_slices::<f32, _, 1>([&g.contiguous()?], |[g]| self.backward_values(g, rows))??;
        Tensor::from_vec(dx, (rows, self.fwd.k()), g.device())
    }
}

/// W (out, in) row-major as f32 values, and Wᵀ's: (W, Wᵀ, out, in).
fn both_layouts(w: &Tensor) -> Result<(Vec<f32>, Vec<f32>, usize, usize)> {
    let (out, inp) = w.dims2()?;
    let v: Vec<f32> = w.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1()?;
    let vt: Vec<f32> = w.t()?.to_dtype(candle_core::DType::F32)?.contiguous()?.flatten_all()?.to_vec1()?;
    Ok((v, vt, out, inp))
}

/// A packed weight's input: (rows, k) f32 on the CPU, for a weight of n outputs; its rows.
fn check_input(x: &Tensor, k: usize, n: usize) -> Result<usize> {
    let (rows, xk) = x.dims2()?;
    if xk != k || x.dtype() != candle_core::DType::F32 || !x.device().is_cpu() {
        candle_core::bail!(
            "a packed product of a ({rows}, {xk}) {:?} input on {:?} with a ({n}, {k}) weight: expected f32 on the CPU",
            x.dtype(),
            x.device(),
        );
    }
    Ok(rows)
}

/// x Wᵀ on the packed bf16 kernel with the gradient of x alone (g W, on the same kernel):
/// [`crate::lora::frozen_matmul`]'s routing for a weight that trains with bf16 products.
pub fn packed_matmul(x: &Tensor, p: &std::sync::Arc<PackedWeight>) -> Result<Tensor> {
    let y = p.forward(&x.detach())?;
    let p = p.clone();
    crate::ops::routed(x, y, "frozen-matmul-bf16", move |_, _, g| p.backward(&g.contiguous()?))
}

/// `x` as f32 values (the packed bf16 kernels' input): an error for f64.
fn f32_values<T: candle_core::WithDType>(x: &[T]) -> Result<&[f32]> {
    if T::DTYPE != candle_core::DType::F32 {
        candle_core::bail!("bf16 products take f32 inputs, not {:?}", T::DTYPE);
    }
    // SAFETY: T is f32 (checked above): the same type, size and alignment.
    Ok(unsafe { std::slice::from_raw_parts(x.as_ptr() as *const f32, x.len()) })
}
