//! The frozen and adapted products as single graph nodes with their backward passes written
//! out: x Wᵀ for a frozen W ([`frozen_matmul`], [`FrozenMatmul`]; [`WeightMatmul`] for a W that
//! trains), LoRA's y = x Wᵀ + s (x Aᵀ) Bᵀ ([`lora_matmul`], [`LoraMatmul`]; routed on CUDA,
//! [`lora_matmul_routed`]), and the gradient g ↦ g W a fused op keeps ([`XGrad`]).

use super::packed::PackedWeight;
use crate::ops::Kernels;
use candle_core::{Result, Tensor};

/// The gradient of x of a frozen product x Wᵀ, g ↦ g W, held by value
/// ([`crate::lora::Linear::frozen_x_grad`]): the product's own backward, so a fused op that calls it gives
/// the bits the product's graph node would.
pub(crate) enum XGrad {
    /// The packed kernel's backward ([`PackedWeight::backward`]).
    Packed(std::sync::Arc<PackedWeight>),
    /// [`FrozenMatmul`]'s backward (f32 or f64 on the CPU; other dtypes candle's matmul, as
    /// [`frozen_matmul`] routes them).
    Frozen(Tensor),
}

impl XGrad {
    /// g W for g (rows, out).
    pub(crate) fn apply(&self, g: &Tensor) -> Result<Tensor> {
        let g = g.contiguous()?;
        match self {
            XGrad::Packed(p) => p.backward(&g),
            XGrad::Frozen(w) => {
                let op = FrozenMatmul { w: w.contiguous()? };
                match (g.dtype(), w.dtype()) {
                    (candle_core::DType::F32, candle_core::DType::F32) => op.bwd_t::<f32>(&g),
                    (candle_core::DType::F64, candle_core::DType::F64) => op.bwd_t::<f64>(&g),
                    _ => g.matmul(w),
                }
            }
        }
    }
}

/// x Wᵀ for a frozen W (rows, in) × (out, in) whose backward pass computes only ∂/∂x = g W.
/// candle's matmul backward also forms the weight's gradient xᵀg, a second matmul as large as
/// the forward one, even for a weight that is no variable; over every frozen layer and the LM
/// head that is a third of a training step. With the fused kernels (the CPU) the product is
/// [`FrozenMatmul`], an op of x alone whose gradient is g W; routed (CUDA), the device's
/// product with that gradient; composed, the plain matmul (W is no variable: its gradient is
/// computed and never read). A W that is a variable (a full-parameter model) takes
/// [`WeightMatmul`] on the fused path, elsewhere the plain matmul: both give W its gradient.
pub fn frozen_matmul(x: &Tensor, w: &Tensor, k: Kernels) -> Result<Tensor> {
    if w.is_variable()
        && k == Kernels::Fused
        && x.device().is_cpu()
        && matches!(x.dtype(), candle_core::DType::F32 | candle_core::DType::F64)
        && x.dtype() == w.dtype()
    {
        return x.contiguous()?.apply_op2(&w.contiguous()?, WeightMatmul);
    }
    if k == Kernels::Composed || w.is_variable() {
        return x.matmul(&w.t()?);
    }
    if k == Kernels::Routed {
        // the device's product outside the graph, the gradient of x alone (no xᵀg for W)
        let y = x.detach().matmul(&w.t()?)?;
        let w = w.clone();
        return crate::ops::routed(x, y, "frozen-matmul", move |_, _, g| g.matmul(&w));
    }
    if !x.device().is_cpu() {
        candle_core::bail!("frozen-matmul: the fused kernels are CPU-only (use Kernels::Composed on {:?})", x.device());
    }
    if !matches!(x.dtype(), candle_core::DType::F32 | candle_core::DType::F64) || x.dtype() != w.dtype() {
        // other dtypes: candle's product, routed to carry the gradient of x alone
        let y = x.detach().matmul(&w.t()?)?;
        let w = w.clone();
        return crate::ops::routed(x, y, "frozen-matmul", move |_, _, g| g.matmul(&w));
    }
    x.contiguous()?.apply_op1(FrozenMatmul { w: w.contiguous()? })
}

/// x Wᵀ of x (rows, in), W (out, in) f32 or f64 on the CPU, and its gradient g W: each product
/// one `gemm` call (candle's matmul's, with its operands, strides and threads: the same values)
/// written straight into the op's output, where candle's matmul zero-filled its output and
/// `routed` then copied the value into the graph — two passes over every activation, on one
/// thread, for each of the step's ~400 frozen products.
struct FrozenMatmul {
    w: Tensor,
}

impl FrozenMatmul {
    fn fwd<T: num_traits::Float + candle_core::WithDType>(&self, x: &[T], rows: usize, inp: usize) -> Result<Vec<T>> {
        let out = self.w.dim(0)?;
        if self.w.dim(1)? != inp || x.len() != rows * inp {
            candle_core::bail!("frozen-matmul: a ({rows}, {inp}) input for a {:?} weight", self.w.dims());
        }
        crate::mm::with_slices::<T, _, 1>([&self.w], |[w]| x_wt(x, rows, inp, w, out))
    }

    fn bwd_t<T: num_traits::Float + candle_core::WithDType>(&self, g: &Tensor) -> Result<Tensor> {
        let (out, inp) = self.w.dims2()?;
        let (rows, n) = g.dims2()?;
        if n != out {
            candle_core::bail!("frozen-matmul: a ({rows}, {n}) gradient for a {:?} weight", self.w.dims());
        }
        let dx = crate::mm::with_slices::<T, _, 2>([g, &self.w], |[g, w]| g_w(g, rows, out, w, inp))?;
        Tensor::from_vec(dx, (rows, inp), g.device())
    }
}

impl candle_core::CustomOp1 for FrozenMatmul {
    fn name(&self) -> &'static str {
        "frozen-matmul"
    }

    fn cpu_fwd(
        &self,
        s: &candle_core::CpuStorage,
        l: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        use candle_core::CpuStorage;
        let (rows, inp) = l.shape().dims2()?;
        let out = match s {
            CpuStorage::F32(_) => CpuStorage::F32(self.fwd(crate::mm::slice(s, l)?, rows, inp)?),
            CpuStorage::F64(_) => CpuStorage::F64(self.fwd(crate::mm::slice(s, l)?, rows, inp)?),
            _ => candle_core::bail!("frozen-matmul: the fused op runs in f32 or f64"),
        };
        Ok((out, candle_core::Shape::from((rows, self.w.dim(0)?))))
    }

    fn bwd(&self, _: &Tensor, _: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        let g = g.contiguous()?;
        Ok(Some(match g.dtype() {
            candle_core::DType::F32 => self.bwd_t::<f32>(&g)?,
            candle_core::DType::F64 => self.bwd_t::<f64>(&g)?,
            other => candle_core::bail!("frozen-matmul: no backward in {other:?}"),
        }))
    }
}

/// x Wᵀ (rows, out) of row-major x (rows, in) and W (out, in): candle's matmul's `gemm` call.
fn x_wt<T: num_traits::Float + 'static>(x: &[T], rows: usize, inp: usize, w: &[T], out: usize) -> Vec<T> {
    crate::mm::product(rows, out, inp, crate::mm::Mat::rows(x, inp), crate::mm::Mat::t(w, inp))
}

/// g W (rows, in) of row-major g (rows, out) and W (out, in): the input's gradient of x Wᵀ, as
/// candle's matmul backward forms it.
fn g_w<T: num_traits::Float + 'static>(g: &[T], rows: usize, out: usize, w: &[T], inp: usize) -> Vec<T> {
    crate::mm::product(rows, inp, out, crate::mm::Mat::rows(g, out), crate::mm::Mat::rows(w, inp))
}

/// x Wᵀ of x (rows, in) and a W (out, in) that trains (a full-parameter model's weight, issue
/// 30's `update = "full"`), f32 or f64 on the CPU, with both gradients: ∂x = g W and
/// ∂W = (xᵀ g)ᵀ. Each product is the `gemm` call candle's matmul and its backward make (the
/// same operands, strides and threads: the same bits, tested), written straight into fresh
/// memory; candle's composition `x.matmul(&w.t())` zero-filled each product's output, put a
/// transpose node in the graph and added the (in, out) gradient into W's (out, in) one through
/// a strided view. On SmolLM2 (`rm_step`, every weight, 2 pairs × 256 tokens, 2 threads) a step
/// took 6.7–7.0 s with this op against 7.5–8.5 s without (session 29).
struct WeightMatmul;

impl WeightMatmul {
    fn fwd<T: num_traits::Float + candle_core::WithDType>(
        x: &[T],
        (rows, inp): (usize, usize),
        w: &[T],
        (out, w_in): (usize, usize),
    ) -> Result<Vec<T>> {
        if w_in != inp || x.len() != rows * inp || w.len() != out * inp {
            candle_core::bail!("weight-matmul: a ({rows}, {inp}) input for a ({out}, {w_in}) weight");
        }
        Ok(x_wt(x, rows, inp, w, out))
    }

    fn bwd_t<T: num_traits::Float + candle_core::WithDType>(
        x: &Tensor,
        w: &Tensor,
        g: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let (out, inp) = w.dims2()?;
        let (rows, n) = g.dims2()?;
        if n != out || x.dims2()? != (rows, inp) {
            candle_core::bail!(
                "weight-matmul: a ({rows}, {n}) gradient for {:?} x and a {:?} weight",
                x.dims(),
                w.dims()
            );
        }
        use crate::mm::Mat;
        let (dx, dw) = crate::mm::with_slices::<T, _, 3>([x, w, g], |[x, w, g]| {
            // ∂W: xᵀ g (in, out) as candle forms it, stored as (out, in)
            let dw = crate::mm::product_transposed(inp, out, rows, Mat::t(x, inp), Mat::rows(g, out));
            (g_w(g, rows, out, w, inp), dw)
        })?;
        Ok((Tensor::from_vec(dx, (rows, inp), g.device())?, Tensor::from_vec(dw, (out, inp), g.device())?))
    }
}

impl candle_core::CustomOp2 for WeightMatmul {
    fn name(&self) -> &'static str {
        "weight-matmul"
    }

    fn cpu_fwd(
        &self,
        s1: &candle_core::CpuStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CpuStorage,
        l2: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        use crate::mm::slice;
        use candle_core::CpuStorage;
        let (xd, wd) = (l1.shape().dims2()?, l2.shape().dims2()?);
        let out = match (s1, s2) {
            (CpuStorage::F32(_), CpuStorage::F32(_)) => {
                CpuStorage::F32(Self::fwd(slice(s1, l1)?, xd, slice(s2, l2)?, wd)?)
            }
            (CpuStorage::F64(_), CpuStorage::F64(_)) => {
                CpuStorage::F64(Self::fwd(slice(s1, l1)?, xd, slice(s2, l2)?, wd)?)
            }
            _ => candle_core::bail!("weight-matmul: the fused op runs in f32 or f64, x and W alike"),
        };
        Ok((out, candle_core::Shape::from((xd.0, wd.0))))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = g.contiguous()?;
        let (dx, dw) = match g.dtype() {
            candle_core::DType::F32 => Self::bwd_t::<f32>(x, w, &g)?,
            candle_core::DType::F64 => Self::bwd_t::<f64>(x, w, &g)?,
            other => candle_core::bail!("weight-matmul: no backward in {other:?}"),
        };
        Ok((Some(dx), Some(dw)))
    }
}

/// [`lora_matmul`]'s function on the routed path (CUDA's): y = x Wᵀ + s (x Aᵀ) Bᵀ by the
/// device's products outside the graph, one node over (x, A, B) whose gradients are
/// ∂x = g W + s (g B) A, ∂A = s (g B)ᵀ x, ∂B = s gᵀ (x Aᵀ) (x Aᵀ recomputed). Autograd through
/// the composition kept five nodes per layer, each with a zeroed gradient and an add, and formed
/// the frozen W's dropped gradient xᵀ g.
pub fn lora_matmul_routed(x: &Tensor, w: &Tensor, a: &Tensor, b: &Tensor, scale: f64) -> Result<Tensor> {
    let xd = x.detach();
    let y = (xd.matmul(&w.t()?)? + (xd.matmul(&a.t()?)?.matmul(&b.t()?)? * scale)?)?;
    let w = w.clone();
    crate::ops::routed3((x, a, b), y, "lora-matmul", move |x, a, b, _, g| {
        let gb = (g.matmul(b)? * scale)?;
        let dx = match x.track_op() {
            true => Some((g.matmul(&w)? + gb.matmul(a)?)?),
            false => None,
        };
        let da = match a.track_op() {
            true => Some(gb.t()?.matmul(x)?),
            false => None,
        };
        let db = match b.track_op() {
            true => Some((g.t()?.matmul(&x.matmul(&a.t()?)?)? * scale)?),
            false => None,
        };
        Ok((dx, da, db))
    })
}

/// Whether [`lora_matmul`] computes in `dtype` (else the composition of candle's ops).
pub(super) fn lora_fuses(dtype: candle_core::DType) -> bool {
    matches!(dtype, candle_core::DType::F32 | candle_core::DType::F64)
}

/// LoRA's adapted product y = x Wᵀ + s (x Aᵀ) Bᵀ as one op of (x, A, B) on the CPU (f32, f64;
/// W frozen, on the packed bf16 kernel when `packed`). Backward, with g = ∂L/∂y and
/// gB = g B (rows × r): ∂/∂x = g W + s gB A, ∂/∂A = s gBᵀ x, ∂/∂B = s gᵀ (x Aᵀ) — x Aᵀ
/// recomputed (rows × r). The composition (frozen product, two adapter matmuls, the scale, the
/// sum) put five (rows × out) tensors in the graph and, in the backward, a zero-filled
/// accumulator and a sum for each: ten passes over each adapted layer's output per step.
pub fn lora_matmul(
    x: &Tensor,
    w: &Tensor,
    packed: Option<&std::sync::Arc<PackedWeight>>,
    a: &Tensor,
    b: &Tensor,
    scale: f64,
) -> Result<Tensor> {
    lora_matmul_to(x, w, packed, a, b, scale, None)
}

/// [`lora_matmul`] with its output written in heads (`heads`: [`crate::ops::HeadsOut`], RoPE
/// on the way) — split_heads' forward after the product, its backward before the product's,
/// so the same values and gradients with the rows never in the graph.
pub(crate) fn lora_matmul_to(
    x: &Tensor,
    w: &Tensor,
    packed: Option<&std::sync::Arc<PackedWeight>>,
    a: &Tensor,
    b: &Tensor,
    scale: f64,
    heads: Option<crate::ops::HeadsOut>,
) -> Result<Tensor> {
    let ((rows, inp), (r, ain), (out, br)) = (x.dims2()?, a.dims2()?, b.dims2()?);
    if w.dims2()? != (out, inp) || ain != inp || br != r || !x.device().is_cpu() || !lora_fuses(x.dtype()) {
        candle_core::bail!(
            "lora-matmul: x ({rows}, {inp}) {:?} on {:?}, W {:?}, A {:?}, B {:?}: expected (rows, in), (out, in), (r, in), (out, r), f32 or f64 on the CPU",
            x.dtype(),
            x.device(),
            w.dims(),
            a.dims(),
            b.dims()
        );
    }
    if packed.is_some() && x.dtype() != candle_core::DType::F32 {
        candle_core::bail!("lora-matmul: bf16 products take f32 inputs, not {:?}", x.dtype());
    }
    if let Some(h) = &heads {
        let (hb, ht, hn, hhd) = h.dims;
        if hb * ht != rows || hn * hhd != out {
            candle_core::bail!("lora-matmul: ({rows}, {out}) output as heads {:?}", h.dims);
        }
    }
    let op = LoraMatmul::new(w.contiguous()?, packed.cloned(), scale, heads);
    x.contiguous()?.apply_op3(&a.contiguous()?, &b.contiguous()?, op)
}

pub(crate) struct LoraMatmul {
    w: Tensor,
    packed: Option<std::sync::Arc<PackedWeight>>,
    scale: f64,
    /// x Aᵀ (rows × r) as the forward computed it, for the backward's ∂B = s gᵀ (x Aᵀ): kept
    /// (rows·r values, ~1/70 of x for SmolLM2 at r 8) rather than recomputed, which was a
    /// further pass over x per adapted layer. The same values either way (one `gemm` call of
    /// the same operands).
    xa: std::sync::Mutex<Option<SavedXa>>,
    /// The output written in heads ([`lora_matmul_to`]).
    heads: Option<crate::ops::HeadsOut>,
}

/// [`LoraMatmul`]'s saved x Aᵀ in the op's dtype.
enum SavedXa {
    F32(Vec<f32>),
    F64(Vec<f64>),
}

/// A dtype's slot in [`SavedXa`].
trait Saves: Sized {
    fn save(v: Vec<Self>) -> SavedXa;
    fn saved(s: &SavedXa) -> Option<&[Self]>;
}

macro_rules! saves {
    ($t:ty, $mine:ident, $other:ident) => {
        impl Saves for $t {
            fn save(v: Vec<$t>) -> SavedXa {
                SavedXa::$mine(v)
            }
            fn saved(s: &SavedXa) -> Option<&[$t]> {
                match s {
                    SavedXa::$mine(v) => Some(v),
                    SavedXa::$other(_) => None,
                }
            }
        }
    };
}
saves!(f32, F32, F64);
saves!(f64, F64, F32);

impl LoraMatmul {
    /// x Wᵀ (rows × out) on the packed kernel or by one `gemm` call.
    fn frozen<T: num_traits::Float + candle_core::WithDType>(&self, x: &[T], rows: usize) -> Result<Vec<T>> {
        use crate::mm::{product, Mat};
        let (out, inp) = self.w.dims2()?;
        match &self.packed {
            Some(p) => p.forward_values(x, rows),
            None => crate::mm::with_slices::<T, _, 1>([&self.w], |[w]| {
                product(rows, out, inp, Mat::rows(x, inp), Mat::t(w, inp))
            }),
        }
    }

    fn fwd<T: num_traits::Float + candle_core::WithDType + Saves>(
        &self,
        x: &[T],
        a: &[T],
        b: &[T],
        rows: usize,
    ) -> Result<Vec<T>> {
        use crate::mm::{mm_add, product, Mat};
        let (out, inp) = self.w.dims2()?;
        let r = a.len() / inp;
        let mut y = self.frozen(x, rows)?;
        let xa = product(rows, r, inp, Mat::rows(x, inp), Mat::t(a, inp));
        let s = T::from(self.scale).unwrap_or_else(T::nan);
        mm_add(rows, out, r, &mut y, Mat::rows(&xa, r), Mat::t(b, r), s);
        *self.xa.lock().map_err(|_| candle_core::Error::Msg("lora-matmul: a poisoned lock".into()))? =
            Some(T::save(xa));
        match &self.heads {
            Some(h) => h.to_heads(&y),
            None => Ok(y),
        }
    }

    #[allow(clippy::type_complexity)]
    fn bwd_t<T: num_traits::Float + candle_core::WithDType + Saves>(
        &self,
        x: &Tensor,
        a: &Tensor,
        b: &Tensor,
        g: &Tensor,
        want_dx: bool,
    ) -> Result<(Option<Tensor>, Tensor, Tensor)> {
        use crate::mm::with_slices;
        use crate::mm::{mm_add, product, scaled_product, Mat};
        let (out, inp) = self.w.dims2()?;
        let (rows, r) = (x.dim(0)?, a.dim(0)?);
        let s = T::from(self.scale).unwrap_or_else(T::nan);
        let saved = self.xa.lock().map_err(|_| candle_core::Error::Msg("lora-matmul: a poisoned lock".into()))?;
        let xa = saved.as_ref().and_then(T::saved).filter(|v| v.len() == rows * r).ok_or_else(|| {
            candle_core::Error::Msg(format!("lora-matmul: no saved x Aᵀ of {rows} × {r} for the backward pass"))
        })?;
        let (dx, da, db) = with_slices::<T, _, 4>([x, a, b, g], |[x, a, b, g]| -> Result<_> {
            let gb = product(rows, r, out, Mat::rows(g, out), Mat::rows(b, r));
            let da = scaled_product(r, inp, rows, Mat::t(&gb, r), Mat::rows(x, inp), s);
            let db = scaled_product(out, r, rows, Mat::t(g, out), Mat::rows(xa, r), s);
            let dx = if want_dx {
                let mut dx = match &self.packed {
                    Some(p) => p.backward_values(g, rows)?,
                    None => with_slices::<T, _, 1>([&self.w], |[w]| {
                        product(rows, inp, out, Mat::rows(g, out), Mat::rows(w, inp))
                    })?,
                };
                mm_add(rows, inp, r, &mut dx, Mat::rows(&gb, r), Mat::rows(a, inp), s);
                Some(dx)
            } else {
                None
            };
            Ok((dx, da, db))
        })??;
        let dev = x.device();
        Ok((
            dx.map(|v| Tensor::from_vec(v, (rows, inp), dev)).transpose()?,
            Tensor::from_vec(da, (r, inp), dev)?,
            Tensor::from_vec(db, (out, r), dev)?,
        ))
    }
}

impl LoraMatmul {
    /// The op of y = x Wᵀ + `scale` (x Aᵀ) Bᵀ for a contiguous W, nothing saved yet; its output
    /// in `heads` when given.
    pub(super) fn new(
        w: Tensor,
        packed: Option<std::sync::Arc<PackedWeight>>,
        scale: f64,
        heads: Option<crate::ops::HeadsOut>,
    ) -> LoraMatmul {
        LoraMatmul { w, packed, scale, xa: std::sync::Mutex::new(None), heads }
    }

    /// y = x Wᵀ + s (x Aᵀ) Bᵀ (rows, out) for x (rows, in) outside the graph: the op's forward
    /// on detached inputs (which saves x Aᵀ for [`LoraMatmul::grads`]).
    pub(super) fn forward_detached(&self, x: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        let (x, a, b) = (x.detach().contiguous()?, a.detach().contiguous()?, b.detach().contiguous()?);
        let rows = x.dim(0)?;
        let out = self.w.dim(0)?;
        match x.dtype() {
            candle_core::DType::F32 => {
                let y = crate::mm::with_slices::<f32, _, 3>([&x, &a, &b], |[x, a, b]| self.fwd(x, a, b, rows))??;
                Tensor::from_vec(y, (rows, out), x.device())
            }
            candle_core::DType::F64 => {
                let y = crate::mm::with_slices::<f64, _, 3>([&x, &a, &b], |[x, a, b]| self.fwd(x, a, b, rows))??;
                Tensor::from_vec(y, (rows, out), x.device())
            }
            other => candle_core::bail!("lora-matmul: the fused op runs in f32 or f64, not {other:?}"),
        }
    }

    /// [`LoraMatmul::bwd_t`] in x's dtype: (∂x when `want_dx`, ∂A, ∂B) at ∂L/∂y = `g`.
    pub(super) fn grads(
        &self,
        x: &Tensor,
        a: &Tensor,
        b: &Tensor,
        g: &Tensor,
        want_dx: bool,
    ) -> Result<(Option<Tensor>, Tensor, Tensor)> {
        match x.dtype() {
            candle_core::DType::F32 => self.bwd_t::<f32>(x, a, b, g, want_dx),
            candle_core::DType::F64 => self.bwd_t::<f64>(x, a, b, g, want_dx),
            other => candle_core::bail!("lora-matmul: no backward in {other:?}"),
        }
    }
}

impl candle_core::CustomOp3 for LoraMatmul {
    fn name(&self) -> &'static str {
        "lora-matmul"
    }

    fn cpu_fwd(
        &self,
        s1: &candle_core::CpuStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CpuStorage,
        l2: &candle_core::Layout,
        s3: &candle_core::CpuStorage,
        l3: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        use crate::mm::slice;
        use candle_core::CpuStorage;
        let rows = l1.shape().dims2()?.0;
        let out = match s1 {
            CpuStorage::F32(_) => CpuStorage::F32(self.fwd(slice(s1, l1)?, slice(s2, l2)?, slice(s3, l3)?, rows)?),
            CpuStorage::F64(_) => CpuStorage::F64(self.fwd(slice(s1, l1)?, slice(s2, l2)?, slice(s3, l3)?, rows)?),
            _ => candle_core::bail!("lora-matmul: the fused op runs in f32 or f64"),
        };
        let shape = match &self.heads {
            Some(h) => h.shape(),
            None => candle_core::Shape::from((rows, self.w.dim(0)?)),
        };
        Ok((out, shape))
    }

    fn bwd(
        &self,
        x: &Tensor,
        a: &Tensor,
        b: &Tensor,
        _: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let g = match &self.heads {
            Some(h) => h.rows_grad(g)?,
            None => g.contiguous()?,
        };
        let (dx, da, db) = self.grads(x, a, b, &g, x.track_op())?;
        Ok((dx, Some(da), Some(db)))
    }
}
