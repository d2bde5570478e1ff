//! Fused forward kernels with hand-written backward passes for the differentiable decoder.
//! candle's CPU kernels for RMSNorm, softmax and RoPE (`candle_nn::ops`, `rotary_emb`) have no
//! backward pass; composing them from elementwise ops (as autograd needs) costs a dozen passes
//! over every activation, forward and backward. Here the fused kernel computes the value outside
//! the graph and [`routed`] attaches it to its input with the gradient written out: on the CPU
//! a training step runs about as many passes over memory as inference does.

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
        let y = self.value.lock().ok().and_then(|mut v| v.take());
        let Some(y) = y else { candle_core::bail!("{}: the value was taken already", self.name) };
        let (st, l) = y.storage_and_layout();
        let (Storage::Cpu(s), Some((a, b))) = (&*st, l.contiguous_offsets()) else {
            candle_core::bail!("{}: expected a contiguous CPU value", self.name);
        };
        let out = match s {
            CpuStorage::F32(v) => CpuStorage::F32(v[a..b].to_vec()),
            CpuStorage::F64(v) => CpuStorage::F64(v[a..b].to_vec()),
            CpuStorage::BF16(v) => CpuStorage::BF16(v[a..b].to_vec()),
            CpuStorage::F16(v) => CpuStorage::F16(v[a..b].to_vec()),
            _ => candle_core::bail!("{}: expected a float tensor", self.name),
        };
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some((self.grad)(x, res, g)?))
    }
}

/// `y` (computed from `x` outside the graph) as a function of `x` whose gradient is `grad`.
/// Off the CPU, or when `x` needs no gradient, `y` itself.
pub fn routed(
    x: &Tensor,
    y: Tensor,
    name: &'static str,
    grad: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor> + Send + Sync + 'static,
) -> Result<Tensor> {
    if !x.device().is_cpu() || !x.track_op() {
        return Ok(y);
    }
    // the result's shape is the value's (a frozen matmul changes the last dimension)
    x.apply_op1(Routed { name, value: std::sync::Mutex::new(Some(y.contiguous()?)), grad: Box::new(grad) })
}

/// RMSNorm y = w ⊙ x·r, r = (mean x² + ε)^{-½}; ∂L/∂x = r (w ⊙ g) − x r³ ⟨w ⊙ g, x⟩ / d.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let xd = x.detach().contiguous()?;
    let y = if x.dtype() == candle_core::DType::F64 {
        // candle's fused kernel has no f64 (the exact gradient checks run in f64)
        let r = (xd.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?;
        xd.broadcast_div(&r)?.broadcast_mul(w)?
    } else {
        candle_nn::ops::rms_norm(&xd, w, eps as f32)?
    };
    let w = w.clone();
    routed(x, y, "rms-norm", move |x, _, g| {
        let d = x.dim(D::Minus1)? as f64;
        let r = (x.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
        let gw = g.broadcast_mul(&w)?;
        let dot = ((&gw * x)?.sum_keepdim(D::Minus1)? / d)?;
        gw.broadcast_mul(&r)? - x.broadcast_mul(&(r.powf(3.0)? * dot)?)?
    })
}

/// Softmax over the last dimension; ∂L/∂s = y ⊙ (g − ⟨g, y⟩).
pub fn softmax_last(s: &Tensor) -> Result<Tensor> {
    let y = candle_nn::ops::softmax_last_dim(&s.detach().contiguous()?)?;
    routed(s, y, "softmax", |_, y, g| y * g.broadcast_sub(&(g * y)?.sum_keepdim(D::Minus1)?)?)
}

/// RoPE on x (b, h, t, hd) with cos, sin (t, hd/2): rotate-half (Hugging Face) or interleaved
/// pairs (llama.cpp's row order). A rotation: its gradient is the rotation by −angle.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, interleaved: bool) -> Result<Tensor> {
    let f = if interleaved { candle_nn::rotary_emb::rope_i } else { candle_nn::rotary_emb::rope };
    let (cos, sin) = (cos.contiguous()?, sin.contiguous()?);
    let y = f(&x.detach().contiguous()?, &cos, &sin)?;
    let neg = sin.neg()?;
    routed(x, y, "rope", move |_, _, g| f(&g.contiguous()?, &cos, &neg))
}

/// log-softmax over the last dimension; ∂L/∂x = g − e^y Σg.
pub fn log_softmax_last(x: &Tensor) -> Result<Tensor> {
    let y = candle_nn::ops::log_softmax(&x.detach(), D::Minus1)?;
    routed(x, y, "log-softmax", |_, y, g| g.broadcast_sub(&y.exp()?.broadcast_mul(&g.sum_keepdim(D::Minus1)?)?))
}
