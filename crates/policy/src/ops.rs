//! The differentiable decoder's non-linear ops, in two implementations that compute the same
//! function ([`Kernels`]):
//!
//! - **Fused** (the CPU): candle's CPU kernels for RMSNorm, softmax and RoPE (`candle_nn::ops`,
//!   `rotary_emb`) have no backward pass; composing them from elementwise ops (as autograd needs)
//!   costs a dozen passes over every activation, forward and backward. Here each op is a candle
//!   custom op that computes its value straight into its output (RMSNorm, SwiGLU, the head
//!   layout with RoPE, attention in `crate::attention`, the frozen and LoRA products in
//!   `crate::lora`), or a value computed outside the graph that [`routed`] attaches to its input
//!   (the LM head's log-probabilities in `crate::head`, softmax), each with its gradient written out: on the CPU
//!   a training step runs about as many passes over memory as inference does, and its graph holds
//!   a dozen nodes per decoder block (in candle's autograd each node costs a zeroed gradient and
//!   an add in the backward). These ops are CPU-only: they refuse any other device.
//! - **Routed** (CUDA): the device's own kernels where candle has them (RMSNorm, softmax, RoPE,
//!   log-softmax: `candle_nn`'s, which have no backward), each value attached to its input by
//!   [`routed`] with its gradient written as a few tensor ops; the LoRA product
//!   (`crate::lora::lora_matmul_routed`) and attention (`crate::attention::attention_routed`) as
//!   one node each; the frozen products as x Wᵀ with the gradient g W alone; every other op
//!   composed. On a GPU a step's cost is mostly the
//!   number of kernels it launches (session 25's H100 run: README, "A reward model whose features
//!   learn"): autograd through a composed op launches each of its elementwise kernels and, per
//!   graph node, a zeroed gradient and an add, and candle's matmul backward also forms xᵀg for
//!   a frozen W, a product as large as the forward one whose result is dropped. It runs on the
//!   CPU too, where the tests check it against the fused and composed paths; only the copy of a
//!   routed value into the graph differs on CUDA (`Routed::cuda_fwd`).
//!   `ONEPASS_GPU_KERNELS=composed` keeps the composed path on a GPU.
//! - **Composed** (Metal, and on request CUDA): the same functions written with candle's
//!   differentiable tensor ops, so autograd derives the gradient. The tests run it on the CPU
//!   against the fused path (values and every adapter's gradient), which is how its maths is
//!   checked on a machine without a GPU.

/// Which implementation of the ops a model uses (see the module's doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernels {
    /// Fused CPU kernels with hand-written gradients ([`routed`]); CPU only.
    Fused,
    /// The device's kernels with routed gradients where candle has them, composed ops
    /// elsewhere; the CPU and CUDA.
    Routed,
    /// candle's differentiable ops; any device.
    Composed,
}

impl Kernels {
    /// Fused on the CPU, routed on CUDA (composed with `ONEPASS_GPU_KERNELS=composed`),
    /// composed elsewhere.
    pub fn for_device(dev: &candle_core::Device) -> Kernels {
        if dev.is_cpu() {
            Kernels::Fused
        } else if dev.is_cuda() && std::env::var("ONEPASS_GPU_KERNELS").as_deref() != Ok("composed") {
            Kernels::Routed
        } else {
            Kernels::Composed
        }
    }
}

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Storage, Tensor, D};

/// The gradient of an op: (input x, output y, ∂L/∂y) → ∂L/∂x.
type Grad = Box<dyn Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor> + Send + Sync>;

/// A value computed outside the graph, handed out as the result of an op on x; the gradient
/// flows to x through `grad`. The value is taken on the forward pass (copied into the result,
/// then dropped), so each activation is held once, by the graph.
struct Routed {
    name: &'static str,
    value: std::sync::Mutex<Option<Tensor>>,
    grad: Grad,
}

impl CustomOp1 for Routed {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        value_cpu(&self.value, self.name)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, _: &candle_core::CudaStorage, _: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        value_cuda(&self.value, self.name)
    }

    fn bwd(&self, x: &Tensor, res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some((self.grad)(x, res, g)?))
    }
}

/// A routed op's value, taken (each is used once), copied into the op's CPU output.
fn value_cpu(value: &std::sync::Mutex<Option<Tensor>>, name: &str) -> Result<(CpuStorage, Shape)> {
    let y = value.lock().ok().and_then(|mut v| v.take());
    let Some(y) = y else { candle_core::bail!("{name}: the value was taken already") };
    let (st, l) = y.storage_and_layout();
    let (Storage::Cpu(s), Some((a, b))) = (&*st, l.contiguous_offsets()) else {
        candle_core::bail!("{name}: expected a contiguous CPU value");
    };
    let out = match s {
        CpuStorage::F32(v) => CpuStorage::F32(v[a..b].to_vec()),
        CpuStorage::F64(v) => CpuStorage::F64(v[a..b].to_vec()),
        CpuStorage::BF16(v) => CpuStorage::BF16(v[a..b].to_vec()),
        CpuStorage::F16(v) => CpuStorage::F16(v[a..b].to_vec()),
        _ => candle_core::bail!("{name}: expected a float tensor"),
    };
    Ok((out, l.shape().clone()))
}

/// A routed op's value copied into a fresh CUDA buffer of exactly its elements (the value may
/// be a view: `try_clone` would copy its whole allocation).
#[cfg(feature = "cuda")]
fn value_cuda(value: &std::sync::Mutex<Option<Tensor>>, name: &str) -> Result<(candle_core::CudaStorage, Shape)> {
    use candle_core::backend::{BackendDevice, BackendStorage};
    let y = value.lock().ok().and_then(|mut v| v.take());
    let Some(y) = y else { candle_core::bail!("{name}: the value was taken already") };
    let (st, l) = y.storage_and_layout();
    let Storage::Cuda(s) = &*st else { candle_core::bail!("{name}: expected a CUDA value") };
    // SAFETY: every element is written by the copy below
    let mut out = unsafe { s.device().alloc_uninit(l.shape(), s.dtype())? };
    s.copy_strided_src(&mut out, 0, l)?;
    Ok((out, l.shape().clone()))
}

/// The gradients of a two-input routed op: (x, a, y, ∂L/∂y) → (∂L/∂x, ∂L/∂a).
type Grad2 = Box<dyn Fn(&Tensor, &Tensor, &Tensor, &Tensor) -> Result<Grads2> + Send + Sync>;
type Grads2 = (Option<Tensor>, Option<Tensor>);

/// [`Routed`] with two inputs.
struct Routed2 {
    name: &'static str,
    value: std::sync::Mutex<Option<Tensor>>,
    grad: Grad2,
}

impl candle_core::CustomOp2 for Routed2 {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        value_cpu(&self.value, self.name)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        value_cuda(&self.value, self.name)
    }

    fn bwd(&self, x: &Tensor, a: &Tensor, res: &Tensor, g: &Tensor) -> Result<Grads2> {
        (self.grad)(x, a, res, g)
    }
}

/// `y` (computed from x and a outside the graph) as one node of the graph over the two, their
/// gradients by `grad`; `y` itself when neither needs a gradient. The CPU and CUDA.
pub fn routed2(
    (x, a): (&Tensor, &Tensor),
    y: Tensor,
    name: &'static str,
    grad: impl Fn(&Tensor, &Tensor, &Tensor, &Tensor) -> Result<Grads2> + Send + Sync + 'static,
) -> Result<Tensor> {
    if !(x.device().is_cpu() || x.device().is_cuda()) {
        candle_core::bail!(
            "{name}: routed gradients run on the CPU and CUDA (use Kernels::Composed on {:?})",
            x.device()
        );
    }
    if !(x.track_op() || a.track_op()) {
        return Ok(y);
    }
    x.apply_op2(a, Routed2 { name, value: std::sync::Mutex::new(Some(y.contiguous()?)), grad: Box::new(grad) })
}

/// The gradients of a three-input routed op: (x, a, b, y, ∂L/∂y) → (∂L/∂x, ∂L/∂a, ∂L/∂b).
type Grad3 = Box<dyn Fn(&Tensor, &Tensor, &Tensor, &Tensor, &Tensor) -> Result<Grads3> + Send + Sync>;
type Grads3 = (Option<Tensor>, Option<Tensor>, Option<Tensor>);

/// [`Routed`] with three inputs.
struct Routed3 {
    name: &'static str,
    value: std::sync::Mutex<Option<Tensor>>,
    grad: Grad3,
}

impl candle_core::CustomOp3 for Routed3 {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        value_cpu(&self.value, self.name)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        value_cuda(&self.value, self.name)
    }

    fn bwd(&self, x: &Tensor, a: &Tensor, b: &Tensor, res: &Tensor, g: &Tensor) -> Result<Grads3> {
        (self.grad)(x, a, b, res, g)
    }
}

/// `y` (computed from x, a, b outside the graph) as one node of the graph over the three,
/// their gradients by `grad`; `y` itself when none of them needs a gradient. The CPU and CUDA.
pub fn routed3(
    (x, a, b): (&Tensor, &Tensor, &Tensor),
    y: Tensor,
    name: &'static str,
    grad: impl Fn(&Tensor, &Tensor, &Tensor, &Tensor, &Tensor) -> Result<Grads3> + Send + Sync + 'static,
) -> Result<Tensor> {
    if !(x.device().is_cpu() || x.device().is_cuda()) {
        candle_core::bail!(
            "{name}: routed gradients run on the CPU and CUDA (use Kernels::Composed on {:?})",
            x.device()
        );
    }
    if !(x.track_op() || a.track_op() || b.track_op()) {
        return Ok(y);
    }
    x.apply_op3(a, b, Routed3 { name, value: std::sync::Mutex::new(Some(y.contiguous()?)), grad: Box::new(grad) })
}

/// `y` (computed from `x` outside the graph) as a function of `x` whose gradient is `grad`;
/// `y` itself when `x` needs no gradient. The CPU and CUDA; an error elsewhere, where the value
/// would reach the graph without its gradient (the composed ops are the path there).
pub fn routed(
    x: &Tensor,
    y: Tensor,
    name: &'static str,
    grad: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor> + Send + Sync + 'static,
) -> Result<Tensor> {
    if !(x.device().is_cpu() || x.device().is_cuda()) {
        candle_core::bail!(
            "{name}: routed gradients run on the CPU and CUDA (use Kernels::Composed on {:?})",
            x.device()
        );
    }
    if !x.track_op() {
        return Ok(y);
    }
    // the result's shape is the value's (a frozen matmul changes the last dimension)
    x.apply_op1(Routed { name, value: std::sync::Mutex::new(Some(y.contiguous()?)), grad: Box::new(grad) })
}

/// RMSNorm y = w ⊙ x·r, r = (mean x² + ε)^{-½}; ∂L/∂x = r (w ⊙ g) − x r³ ⟨w ⊙ g, x⟩ / d.
/// Fused (the CPU, f32 or f64): [`RmsNorm`], one op whose forward and backward are each one
/// pass per row. Fused with a w that is a variable (a full-parameter policy): x·r fused with
/// unit weight, then ⊙ w in the graph, so w gets its gradient Σ g ⊙ x·r.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64, k: Kernels) -> Result<Tensor> {
    if k != Kernels::Composed && w.is_variable() {
        return rms_norm(x, &w.detach().ones_like()?, eps, k)?.broadcast_mul(w);
    }
    if k == Kernels::Composed {
        let r = (x.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?;
        return x.broadcast_div(&r)?.broadcast_mul(w);
    }
    if k == Kernels::Routed {
        return rms_norm_routed(x, w, eps);
    }
    let d = x.dim(D::Minus1)?;
    if w.dims() != [d]
        || w.dtype() != x.dtype()
        || !matches!(x.dtype(), candle_core::DType::F32 | candle_core::DType::F64)
    {
        candle_core::bail!(
            "rms-norm: a {:?} {:?} input with a {:?} {:?} weight: expected f32 or f64, the weight (last dim)",
            x.dims(),
            x.dtype(),
            w.dims(),
            w.dtype()
        );
    }
    x.contiguous()?.apply_op1(RmsNorm { w: w.contiguous()?, eps })
}

/// The fused [`rms_norm`]'s gradient of x, ∂L/∂x = r (w ⊙ g) − x r³ ⟨w ⊙ g, x⟩ / d, for a
/// fused op that holds the norm inside it (its op's backward, the same values); x f32 or f64
/// on the CPU, w frozen.
pub(crate) fn rms_norm_x_grad(x: &Tensor, w: &Tensor, eps: f64, g: &Tensor) -> Result<Tensor> {
    let op = RmsNorm { w: w.contiguous()?, eps };
    let (x, g) = (x.contiguous()?, g.contiguous()?);
    match x.dtype() {
        candle_core::DType::F32 => op.bwd_t::<f32>(&x, &g),
        candle_core::DType::F64 => op.bwd_t::<f64>(&x, &g),
        other => candle_core::bail!("rms-norm: no backward in {other:?}"),
    }
}

/// [`rms_norm`] with routed kernels: the value by candle's RMSNorm kernel (f32, bf16, f16; its
/// CUDA kernel sums in f32 whatever the type, so f64 takes the composed forward, outside the
/// graph), the gradient ∂L/∂x = r (w ⊙ g) − x r³ ⟨w ⊙ g, x⟩ / d as tensor ops.
fn rms_norm_routed(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let xd = x.detach().contiguous()?;
    let y = match x.dtype() {
        candle_core::DType::F64 => {
            xd.broadcast_div(&(xd.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?)?.broadcast_mul(&w.detach())?
        }
        _ => candle_nn::ops::rms_norm(&xd, &w.detach().contiguous()?, eps as f32)?,
    };
    let (w, d) = (w.detach(), x.dim(D::Minus1)? as f64);
    routed(x, y, "rms-norm", move |x, _, g| {
        let r = (x.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
        let wg = g.broadcast_mul(&w)?;
        let dot = (&wg * x)?.sum_keepdim(D::Minus1)?;
        let coef = ((r.sqr()? * &r)? * dot)?.affine(1.0 / d, 0.0)?;
        wg.broadcast_mul(&r)? - x.broadcast_mul(&coef)?
    })
}

/// [`rms_norm`]'s fused op. The forward is candle's RMSNorm kernel's arithmetic (Σ x² in order,
/// m = (Σ/d + ε)^{½}, y = x / m · w: the same f32 values), computed into the op's output where
/// `routed` copied candle's result into the graph; the backward is one pass per row where the
/// composed gradient took seven passes over the activation.
struct RmsNorm {
    w: Tensor,
    eps: f64,
}

impl RmsNorm {
    /// The values (`kernels::rows_grad::rms_norm`).
    fn fwd<T: num_traits::Float + candle_core::WithDType>(&self, x: &[T]) -> Result<Vec<T>> {
        crate::mm::with_slices::<T, _, 1>([&self.w], |[w]| kernels::rows_grad::rms_norm(x, w, self.eps))
    }

    /// The gradient of x (`kernels::rows_grad::rms_norm_grad`).
    fn bwd_t<T: num_traits::Float + candle_core::WithDType>(&self, x: &Tensor, g: &Tensor) -> Result<Tensor> {
        let dx = crate::mm::with_slices::<T, _, 3>([x, g, &self.w], |[x, g, w]| {
            kernels::rows_grad::rms_norm_grad(x, g, w, self.eps)
        })?;
        Tensor::from_vec(dx, x.shape(), x.device())
    }
}

impl CustomOp1 for RmsNorm {
    fn name(&self) -> &'static str {
        "rms-norm"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = match s {
            CpuStorage::F32(_) => CpuStorage::F32(self.fwd(crate::mm::slice(s, l)?)?),
            CpuStorage::F64(_) => CpuStorage::F64(self.fwd(crate::mm::slice(s, l)?)?),
            _ => candle_core::bail!("rms-norm: the fused op runs in f32 or f64"),
        };
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        let g = g.contiguous()?;
        Ok(Some(match x.dtype() {
            candle_core::DType::F32 => self.bwd_t::<f32>(x, &g)?,
            candle_core::DType::F64 => self.bwd_t::<f64>(x, &g)?,
            other => candle_core::bail!("rms-norm: no backward in {other:?}"),
        }))
    }
}

/// Softmax over the last dimension; ∂L/∂s = y ⊙ (g − ⟨g, y⟩). Composed: e^{s − max s} / Σ,
/// the max a constant (softmax does not depend on it, so its gradient is not needed).
pub fn softmax_last(s: &Tensor, k: Kernels) -> Result<Tensor> {
    if k == Kernels::Composed {
        let e = s.broadcast_sub(&s.max_keepdim(D::Minus1)?.detach())?.exp()?;
        return e.broadcast_div(&e.sum_keepdim(D::Minus1)?);
    }
    let y = candle_nn::ops::softmax_last_dim(&s.detach().contiguous()?)?;
    routed(s, y, "softmax", |_, y, g| y * g.broadcast_sub(&(g * y)?.sum_keepdim(D::Minus1)?)?)
}

/// RoPE on x (b, h, t, hd) with cos, sin (t, hd/2): rotate-half (Hugging Face: the pairs are
/// (x_i, x_{i+hd/2})) or interleaved pairs (x_{2i}, x_{2i+1}: llama.cpp's row order); each pair
/// turned by its angle, (a, b) ↦ (a cos − b sin, a sin + b cos). A rotation: its gradient is
/// the rotation by −angle.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, interleaved: bool, k: Kernels) -> Result<Tensor> {
    if k == Kernels::Composed {
        return rope_composed(x, cos, sin, interleaved);
    }
    let f = if interleaved { candle_nn::rotary_emb::rope_i } else { candle_nn::rotary_emb::rope };
    let (cos, sin) = (cos.contiguous()?, sin.contiguous()?);
    let y = f(&x.detach().contiguous()?, &cos, &sin)?;
    let neg = sin.neg()?;
    routed(x, y, "rope", move |_, _, g| f(&g.contiguous()?, &cos, &neg))
}

/// A projection's rows (b·t, n·hd) as heads (b, n, t, hd), RoPE applied on the way when `rope`
/// gives the position tables (t, hd/2) and the layout: [`Heads`], one op each way. The
/// composition (reshape, transpose, a contiguous copy, RoPE routed into the graph with a copy in
/// and out) put four tensors of the projection's size into the graph, each with a zeroed
/// gradient and an add in the backward, where this op is one pass each way. Fused kernels only.
pub fn split_heads(
    y: &Tensor,
    (b, t, n, hd): (usize, usize, usize, usize),
    rope: Option<(&Tensor, &Tensor, bool)>,
) -> Result<Tensor> {
    if y.elem_count() != b * t * n * hd || !matches!(y.dtype(), candle_core::DType::F32 | candle_core::DType::F64) {
        candle_core::bail!(
            "split-heads: a {:?} {:?} tensor is not (b·t, n·hd) = ({}, {}) in f32 or f64",
            y.dims(),
            y.dtype(),
            b * t,
            n * hd
        );
    }
    if let Some((c, _, _)) = rope.filter(|(c, _, _)| c.dtype() != y.dtype()) {
        candle_core::bail!("split-heads: {:?} RoPE tables for a {:?} tensor", c.dtype(), y.dtype());
    }
    y.contiguous()?.apply_op1(HeadsOut::new((b, t, n, hd), rope)?.op(true))
}

/// [`split_heads`]' layout change outside the graph, either way: rows (b·t, n·hd) to heads
/// (b, n, t, hd) (`to_heads`) or back, turned by RoPE (`rope`: tables (t, hd/2) and the
/// layout) on the way — by its inverse rotation with `inverse`. The CPU, f32 or f64, contiguous.
pub(crate) fn heads_values(
    y: &Tensor,
    (b, t, n, hd): (usize, usize, usize, usize),
    rope: Option<(&Tensor, &Tensor, bool)>,
    to_heads: bool,
    inverse: bool,
) -> Result<Tensor> {
    let rope = rope.map(|(c, s, i)| Ok::<_, candle_core::Error>((c.contiguous()?, s.contiguous()?, i))).transpose()?;
    let op = Heads { b, t, n, hd, rope, split: to_heads };
    let y = y.contiguous()?;
    let v = match y.dtype() {
        candle_core::DType::F32 => {
            let v = crate::mm::with_slices::<f32, _, 1>([&y], |[y]| op.run(y, to_heads, inverse))??;
            Tensor::from_vec(v, op.shape(to_heads), y.device())?
        }
        candle_core::DType::F64 => {
            let v = crate::mm::with_slices::<f64, _, 1>([&y], |[y]| op.run(y, to_heads, inverse))??;
            Tensor::from_vec(v, op.shape(to_heads), y.device())?
        }
        other => candle_core::bail!("heads: the fused layout change runs in f32 or f64, not {other:?}"),
    };
    Ok(v)
}

/// A product's output in [`split_heads`]' layout: rows (b·t, n·hd) become heads (b, n, t, hd),
/// turned by RoPE (tables (t, hd/2), the layout) when given — for an op that writes its output
/// in heads directly ([`crate::lora::Linear::forward_heads`]), so the rows never enter the graph.
#[derive(Clone)]
pub struct HeadsOut {
    pub dims: (usize, usize, usize, usize),
    pub rope: Option<(Tensor, Tensor, bool)>,
}

impl HeadsOut {
    /// The layout of (b, t, n, hd), RoPE's tables checked as [`split_heads`] checks them.
    pub fn new(
        (b, t, n, hd): (usize, usize, usize, usize),
        rope: Option<(&Tensor, &Tensor, bool)>,
    ) -> Result<HeadsOut> {
        let rope = match rope {
            Some((c, s, i)) => {
                if c.dims() != [t, hd / 2] || s.dims() != [t, hd / 2] {
                    candle_core::bail!(
                        "split-heads: RoPE tables {:?}, {:?} for {t} positions of {hd}",
                        c.dims(),
                        s.dims()
                    );
                }
                Some((c.contiguous()?, s.contiguous()?, i))
            }
            None => None,
        };
        Ok(HeadsOut { dims: (b, t, n, hd), rope })
    }

    fn op(&self, to_heads: bool) -> Heads {
        let (b, t, n, hd) = self.dims;
        Heads { b, t, n, hd, rope: self.rope.clone(), split: to_heads }
    }

    /// Rows to heads (split_heads' forward) on values.
    pub(crate) fn to_heads<T: num_traits::Float + candle_core::WithDType>(&self, rows: &[T]) -> Result<Vec<T>> {
        self.op(true).run(rows, true, false)
    }

    /// The gradient of the rows from the heads' (split_heads' backward).
    pub(crate) fn rows_grad(&self, g: &Tensor) -> Result<Tensor> {
        let (b, t, n, hd) = self.dims;
        heads_values(g, (b, t, n, hd), self.rope.as_ref().map(|(c, s, i)| (c, s, *i)), false, true)
    }

    /// (b, n, t, hd).
    pub fn shape(&self) -> Shape {
        self.op(true).shape(true)
    }
}

/// Heads (b, n, t, hd) back into rows (b·t, n·hd) for the output projection ([`Heads`]).
pub fn merge_heads(y: &Tensor) -> Result<Tensor> {
    let (b, n, t, hd) = y.dims4()?;
    if !matches!(y.dtype(), candle_core::DType::F32 | candle_core::DType::F64) {
        candle_core::bail!("merge-heads: expected f32 or f64, not {:?}", y.dtype());
    }
    y.contiguous()?.apply_op1(Heads { b, t, n, hd, rope: None, split: false })
}

/// The head-layout change ([`split_heads`], [`merge_heads`]) with an optional RoPE: a
/// permutation and a rotation, so its gradient is the inverse permutation and rotation.
struct Heads {
    b: usize,
    t: usize,
    n: usize,
    hd: usize,
    rope: Option<(Tensor, Tensor, bool)>,
    split: bool,
}

impl Heads {
    /// rows (b·t, n·hd) → heads (b, n, t, hd) (`to_heads`) or back, rotating (or, `inverse`,
    /// rotating back) each head's row on the way (`kernels::rows_grad::heads`).
    fn run<T: num_traits::Float + candle_core::WithDType>(
        &self,
        src: &[T],
        to_heads: bool,
        inverse: bool,
    ) -> Result<Vec<T>> {
        let Heads { b, t, n, hd, .. } = *self;
        let run =
            |rope: Option<(&[T], &[T], bool)>| kernels::rows_grad::heads((b, t, n, hd), src, rope, to_heads, inverse);
        match &self.rope {
            Some((c, s, interleaved)) => {
                crate::mm::with_slices::<T, _, 2>([c, s], |[c, s]| run(Some((c, s, *interleaved))))
            }
            None => Ok(run(None)),
        }
    }

    fn shape(&self, heads: bool) -> Shape {
        let Heads { b, t, n, hd, .. } = *self;
        if heads {
            Shape::from((b, n, t, hd))
        } else {
            Shape::from((b * t, n * hd))
        }
    }
}

impl CustomOp1 for Heads {
    fn name(&self) -> &'static str {
        if self.split {
            "split-heads"
        } else {
            "merge-heads"
        }
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = match s {
            CpuStorage::F32(_) => CpuStorage::F32(self.run(crate::mm::slice(s, l)?, self.split, false)?),
            CpuStorage::F64(_) => CpuStorage::F64(self.run(crate::mm::slice(s, l)?, self.split, false)?),
            _ => candle_core::bail!("{}: the fused op runs in f32 or f64", self.name()),
        };
        Ok((out, self.shape(self.split)))
    }

    fn bwd(&self, x: &Tensor, _: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        let g = g.contiguous()?;
        let dx = match g.dtype() {
            candle_core::DType::F32 => {
                let v = crate::mm::with_slices::<f32, _, 1>([&g], |[g]| self.run(g, !self.split, true))??;
                Tensor::from_vec(v, x.shape(), x.device())?
            }
            candle_core::DType::F64 => {
                let v = crate::mm::with_slices::<f64, _, 1>([&g], |[g]| self.run(g, !self.split, true))??;
                Tensor::from_vec(v, x.shape(), x.device())?
            }
            other => candle_core::bail!("{}: no backward in {other:?}", self.name()),
        };
        Ok(Some(dx))
    }
}

/// The rotation of [`rope`] in candle's differentiable ops.
fn rope_composed(x: &Tensor, cos: &Tensor, sin: &Tensor, interleaved: bool) -> Result<Tensor> {
    let (b, h, t, hd) = x.dims4()?;
    let half = hd / 2;
    let (cos, sin) = (cos.reshape((1, 1, t, half))?, sin.reshape((1, 1, t, half))?);
    let turn = |a: &Tensor, b: &Tensor| -> Result<(Tensor, Tensor)> {
        let ra = (a.broadcast_mul(&cos)? - b.broadcast_mul(&sin)?)?;
        let rb = (a.broadcast_mul(&sin)? + b.broadcast_mul(&cos)?)?;
        Ok((ra, rb))
    };
    if interleaved {
        let pairs = x.reshape((b, h, t, half, 2))?;
        let (a, c) = (pairs.narrow(4, 0, 1)?.squeeze(4)?, pairs.narrow(4, 1, 1)?.squeeze(4)?);
        let (ra, rc) = turn(&a, &c)?;
        Tensor::stack(&[ra, rc], 4)?.reshape((b, h, t, hd))
    } else {
        let (a, c) = (x.narrow(3, 0, half)?, x.narrow(3, half, half)?);
        let (ra, rc) = turn(&a, &c)?;
        Tensor::cat(&[ra, rc], 3)
    }
}

/// log-softmax over the last dimension; ∂L/∂x = g − e^y Σg. Composed: x − m − log Σ e^{x − m}
/// with m = max x a constant.
pub fn log_softmax_last(x: &Tensor, k: Kernels) -> Result<Tensor> {
    if k == Kernels::Composed {
        let c = x.broadcast_sub(&x.max_keepdim(D::Minus1)?.detach())?;
        return c.broadcast_sub(&c.exp()?.sum_keepdim(D::Minus1)?.log()?);
    }
    let y = candle_nn::ops::log_softmax(&x.detach(), D::Minus1)?;
    routed(x, y, "log-softmax", |_, y, g| g.broadcast_sub(&y.exp()?.broadcast_mul(&g.sum_keepdim(D::Minus1)?)?))
}

/// SwiGLU's product a = silu(g) ⊙ u (silu(x) = x σ(x)); ∂L/∂g = da ⊙ u ⊙ σ(g)(1 + g(1 − σ(g))),
/// ∂L/∂u = da ⊙ silu(g). Fused (the CPU): one op whose forward and backward are each one pass
/// over the (tokens × intermediate) tensors, where candle's silu and mul kept both outputs in
/// the graph and spent about a dozen passes in the backward (silu's derivative alone is six
/// elementwise ops). Composed: candle's `silu` then `*`.
pub fn silu_mul(g: &Tensor, u: &Tensor, k: Kernels) -> Result<Tensor> {
    if k != Kernels::Fused || !matches!(g.dtype(), candle_core::DType::F32 | candle_core::DType::F64) {
        return candle_nn::ops::silu(g)? * u;
    }
    if g.shape() != u.shape() {
        candle_core::bail!("silu-mul: gate {:?} and up {:?} differ in shape", g.dims(), u.dims());
    }
    g.contiguous()?.apply_op2(&u.contiguous()?, SiluMul)
}

/// [`silu_mul`]'s fused op: its passes are `kernels::rows_grad::{silu_mul, silu_mul_grad}`.
struct SiluMul;

/// The fused [`silu_mul`]'s gradients (∂L/∂g, ∂L/∂u) of a = silu(g) ⊙ u at ∂L/∂a = `da`: its
/// op's backward, for a fused op that holds the product inside it.
pub(crate) fn silu_mul_grads(g: &Tensor, u: &Tensor, da: &Tensor) -> Result<(Tensor, Tensor)> {
    match candle_core::CustomOp2::bwd(&SiluMul, &g.contiguous()?, &u.contiguous()?, g, da)? {
        (Some(dg), Some(du)) => Ok((dg, du)),
        _ => candle_core::bail!("silu-mul: a gradient is missing"),
    }
}

impl candle_core::CustomOp2 for SiluMul {
    fn name(&self) -> &'static str {
        "silu-mul"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = match s1 {
            CpuStorage::F32(_) => {
                CpuStorage::F32(kernels::rows_grad::silu_mul(crate::mm::slice(s1, l1)?, crate::mm::slice(s2, l2)?))
            }
            CpuStorage::F64(_) => {
                CpuStorage::F64(kernels::rows_grad::silu_mul(crate::mm::slice(s1, l1)?, crate::mm::slice(s2, l2)?))
            }
            _ => candle_core::bail!("silu-mul: the fused op runs in f32 or f64"),
        };
        Ok((out, l1.shape().clone()))
    }

    fn bwd(&self, g: &Tensor, u: &Tensor, _: &Tensor, da: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let da = da.contiguous()?;
        macro_rules! run {
            ($t:ty) => {{
                let (dg, du) = crate::mm::with_slices::<$t, _, 3>([g, u, &da], |[g, u, d]| {
                    kernels::rows_grad::silu_mul_grad(g, u, d)
                })?;
                (Tensor::from_vec(dg, g.shape(), g.device())?, Tensor::from_vec(du, u.shape(), u.device())?)
            }};
        }
        let (dg, du) = match g.dtype() {
            candle_core::DType::F32 => run!(f32),
            candle_core::DType::F64 => run!(f64),
            other => candle_core::bail!("silu-mul: no backward in {other:?}"),
        };
        Ok((Some(dg), Some(du)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};
    use kernels::rows_grad::SILU_CHUNK;

    /// The fused RMSNorm gives the composed ops' values and autograd's gradient of x (f64, rows
    /// over several rayon tasks), and in f32 candle's own RMSNorm kernel's values bit for bit.
    /// Negative control: the gradient without the norm's projection term (r w ⊙ g alone) is
    /// measurably different, so the comparison sees that term.
    #[test]
    fn rms_norm_matches_the_composed_ops_and_candles_kernel() {
        let (rows, d, eps) = (70, 37, 1e-5);
        let dev = Device::Cpu;
        let draw = |n: usize, s: f64| -> Vec<f64> { (0..n).map(|i| (i as f64 * 0.61 + s).sin() * 2.0).collect() };
        let (xv, wv, cv) = (draw(rows * d, 0.3), draw(d, 1.1), draw(rows * d, 2.7));
        let w = Tensor::from_vec(wv.clone(), d, &dev).unwrap();
        let c = Tensor::from_vec(cv, (rows, d), &dev).unwrap();
        let run = |k: Kernels| {
            let x = Var::from_vec(xv.clone(), (rows, d), &dev).unwrap();
            let y = rms_norm(x.as_tensor(), &w, eps, k).unwrap();
            let grads = (&y * &c).unwrap().sum_all().unwrap().backward().unwrap();
            let v = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f64>().unwrap();
            (v(&y), v(grads.get(x.as_tensor()).unwrap()))
        };
        let (fy, fg) = run(Kernels::Fused);
        let err = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
        for k in [Kernels::Composed, Kernels::Routed] {
            let (cy, cg) = run(k);
            assert!(
                err(&fy, &cy) < 1e-13 && err(&fg, &cg) < 1e-12,
                "{k:?}: values {:e}, gradient {:e}",
                err(&fy, &cy),
                err(&fg, &cg)
            );
        }
        // r w ⊙ g alone, without − x r³ ⟨w ⊙ g, x⟩ / d
        let partial: Vec<f64> = (0..rows * d)
            .map(|i| {
                let row = &xv[i / d * d..(i / d + 1) * d];
                let r = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / d as f64 + eps).sqrt();
                r * wv[i % d] * c.flatten_all().unwrap().to_vec1::<f64>().unwrap()[i]
            })
            .collect();
        assert!(err(&partial, &fg) > 1e-2, "negative control: the projection term is invisible");
        let x32 = Tensor::from_vec(xv.clone(), (rows, d), &dev).unwrap().to_dtype(candle_core::DType::F32).unwrap();
        let w32 = w.to_dtype(candle_core::DType::F32).unwrap();
        let ours: Vec<f32> =
            rms_norm(&x32, &w32, eps, Kernels::Fused).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let theirs: Vec<f32> =
            candle_nn::ops::rms_norm(&x32, &w32, eps as f32).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(ours, theirs);
        // routed in f32: candle's kernel's value, with a gradient
        let x = Var::from_tensor(&x32).unwrap();
        let y = rms_norm(x.as_tensor(), &w32, eps, Kernels::Routed).unwrap();
        assert_eq!(y.flatten_all().unwrap().to_vec1::<f32>().unwrap(), theirs);
        let c32 = c.to_dtype(candle_core::DType::F32).unwrap();
        let g = (&y * &c32).unwrap().sum_all().unwrap().backward().unwrap();
        let g: Vec<f64> = g
            .get(x.as_tensor())
            .unwrap()
            .to_dtype(candle_core::DType::F64)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert!(err(&g, &fg) < 1e-4, "routed f32 gradient {:e}", err(&g, &fg));
    }

    /// The head-layout ops give the composition's values and gradients (f64): rows (b·t, n·hd)
    /// reshaped, transposed to (b, n, t, hd) and rotated (both RoPE layouts, or not), and back.
    /// Negative control: the other RoPE layout gives other values.
    #[test]
    fn split_and_merge_heads_match_reshape_transpose_and_rope() {
        let (b, t, n, hd) = (2, 5, 3, 8);
        let dev = Device::Cpu;
        let draw = |len: usize, s: f64| -> Vec<f64> { (0..len).map(|i| (i as f64 * 0.83 + s).sin()).collect() };
        let cos = Tensor::from_vec(draw(t * hd / 2, 0.2), (t, hd / 2), &dev).unwrap();
        let sin = Tensor::from_vec(draw(t * hd / 2, 1.9), (t, hd / 2), &dev).unwrap();
        let c = Tensor::from_vec(draw(b * n * t * hd, 3.3), (b, n, t, hd), &dev).unwrap();
        let v = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let err = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
        for rope_mode in [None, Some(false), Some(true)] {
            let run = |fused: bool| {
                let x = Var::from_vec(draw(b * t * n * hd, 0.7), (b * t, n * hd), &dev).unwrap();
                let y = if fused {
                    split_heads(x.as_tensor(), (b, t, n, hd), rope_mode.map(|i| (&cos, &sin, i))).unwrap()
                } else {
                    let y = x.as_tensor().reshape((b, t, n, hd)).unwrap().transpose(1, 2).unwrap();
                    match rope_mode {
                        Some(i) => rope(&y, &cos, &sin, i, Kernels::Composed).unwrap(),
                        None => y,
                    }
                };
                let back = if fused {
                    merge_heads(&y).unwrap()
                } else {
                    y.transpose(1, 2).unwrap().reshape((b * t, n * hd)).unwrap()
                };
                let loss = ((&y * &c).unwrap().sum_all().unwrap() + back.sqr().unwrap().sum_all().unwrap()).unwrap();
                let g = loss.backward().unwrap();
                (v(&y), v(&back), v(g.get(x.as_tensor()).unwrap()))
            };
            let (fy, fb, fg) = run(true);
            let (cy, cb, cg) = run(false);
            assert!(err(&fy, &cy) < 1e-14 && err(&fb, &cb) < 1e-14, "{rope_mode:?}: values");
            assert!(err(&fg, &cg) < 1e-13, "{rope_mode:?}: gradient {:e}", err(&fg, &cg));
            if let Some(i) = rope_mode {
                let x = Tensor::from_vec(draw(b * t * n * hd, 0.7), (b * t, n * hd), &dev).unwrap();
                let other = split_heads(&x, (b, t, n, hd), Some((&cos, &sin, !i))).unwrap();
                assert!(err(&v(&other), &fy) > 1e-2, "negative control: the RoPE layout is invisible");
            }
        }
    }

    /// The fused SwiGLU product gives candle's silu-then-mul values and autograd's gradients
    /// (f64), on rows longer than one task's chunk; negative control: a loss that weights the two
    /// inputs' roles the other way round (u silu-ed) has other gradients.
    #[test]
    fn silu_mul_matches_candles_ops_and_their_gradients() {
        let n = 3 * SILU_CHUNK / 2;
        let dev = Device::Cpu;
        let draw = |seed: u64| -> Vec<f64> { (0..n).map(|i| (i as f64 * 0.37 + seed as f64).sin() * 4.0).collect() };
        let (g, u, w) = (draw(1), draw(2), draw(3));
        let run = |k: Kernels, swap: bool| {
            let gv = Var::from_vec(g.clone(), (3, n / 3), &dev).unwrap();
            let uv = Var::from_vec(u.clone(), (3, n / 3), &dev).unwrap();
            let wt = Tensor::from_vec(w.clone(), (3, n / 3), &dev).unwrap();
            let (a, b) = if swap { (uv.as_tensor(), gv.as_tensor()) } else { (gv.as_tensor(), uv.as_tensor()) };
            let y = silu_mul(a, b, k).unwrap();
            let grads = (&y * &wt).unwrap().sum_all().unwrap().backward().unwrap();
            let v = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f64>().unwrap();
            (v(&y), v(grads.get(gv.as_tensor()).unwrap()), v(grads.get(uv.as_tensor()).unwrap()))
        };
        let (fy, fg, fu) = run(Kernels::Fused, false);
        let (cy, cg, cu) = run(Kernels::Composed, false);
        let err = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
        assert!(err(&fy, &cy) < 1e-13, "values {:e}", err(&fy, &cy));
        assert!(err(&fg, &cg) < 1e-12 && err(&fu, &cu) < 1e-12, "gradients {:e} {:e}", err(&fg, &cg), err(&fu, &cu));
        let (_, sg, _) = run(Kernels::Composed, true);
        assert!(err(&sg, &fg) > 1e-2, "negative control: the roles of gate and up are invisible");
    }
}
