//! Pearlmutter's passes of the decoder's sublayers: a linear layer's (adapted) forward,
//! backward, tangent and tangent-of-backward ([`Lin`]), RMSNorm's, and σ.

use crate::lora::Linear;
use crate::rm::rop_cpu as cpu;
use candle_core::{Result, Tensor, D};

/// A linear layer's parts as detached tensors: W (out, in), its bias, and (A, B, s) where it
/// has an adapter.
pub(super) struct Lin {
    pub(super) w: Tensor,
    pub(super) bias: Option<Tensor>,
    pub(super) ad: Option<(Tensor, Tensor, f64)>,
    /// The CPU's kernels ([`cpu`]) rather than composed ops.
    pub(super) fused: bool,
}

impl Lin {
    pub(super) fn of(l: &Linear, fused: bool) -> Result<Lin> {
        let ad = match &l.adapter {
            Some(a) => Some((a.a.as_tensor().detach().contiguous()?, a.b.as_tensor().detach().contiguous()?, a.scale)),
            None => None,
        };
        let bias = l.bias.as_ref().map(|b| b.detach().contiguous()).transpose()?;
        Ok(Lin { w: l.w.detach().contiguous()?, bias, ad, fused })
    }

    pub(super) fn ad(&self) -> Option<cpu::Ad<'_>> {
        self.ad.as_ref().map(|(a, b, s)| (a, b, *s))
    }

    /// y = x Wᵀ + b + s (x Aᵀ) Bᵀ, and x Aᵀ.
    pub(super) fn fwd(&self, x: &Tensor) -> Result<(Tensor, Option<Tensor>)> {
        if self.fused && cpu::applies(x) {
            return cpu::lin_fwd(x, &self.w, self.bias.as_ref(), self.ad());
        }
        let mut y = x.matmul(&self.w.t()?)?;
        if let Some(b) = &self.bias {
            y = y.broadcast_add(b)?;
        }
        let xa = match &self.ad {
            Some((a, b, s)) => {
                let xa = x.matmul(&a.t()?)?;
                y = (y + (xa.matmul(&b.t()?)? * *s)?)?;
                Some(xa)
            }
            None => None,
        };
        Ok((y, xa))
    }

    /// The backward pass of [`Lin::fwd`] from g = ∂ℓ/∂y: ∂ℓ/∂x = g W + s (g B) A (when
    /// `need_gx`), ∂ℓ/∂A = s (g B)ᵀ x, ∂ℓ/∂B = s gᵀ (x Aᵀ); and g B, which the tangent pass
    /// reuses.
    pub(super) fn bwd(&self, x: &Tensor, xa: Option<&Tensor>, g: &Tensor, need_gx: bool) -> Result<LinBwd> {
        if self.fused && cpu::applies(x) {
            let ad = self.ad().zip(xa);
            let (gx, grads, gb) = cpu::lin_bwd(x, &self.w, ad, g, need_gx)?;
            return Ok(LinBwd { gx, grads, gb });
        }
        let mut gx = if need_gx { Some(g.matmul(&self.w)?) } else { None };
        let (mut grads, mut gb) = (None, None);
        if let (Some((a, b, s)), Some(xa)) = (&self.ad, xa) {
            let gbv = g.matmul(b)?;
            if let Some(gx) = &mut gx {
                *gx = (&*gx + (gbv.matmul(a)? * *s)?)?;
            }
            grads = Some(((gbv.t()?.matmul(x)? * *s)?, (g.t()?.matmul(xa)? * *s)?));
            gb = Some(gbv);
        }
        Ok(LinBwd { gx, grads, gb })
    }

    /// The tangent of [`Lin::fwd`] along (ẋ, Ȧ, Ḃ): ẏ = ẋ Wᵀ + s ((ẋ Aᵀ + x Ȧᵀ) Bᵀ + (x Aᵀ) Ḃᵀ),
    /// and the tangent of x Aᵀ.
    pub(super) fn tan(
        &self,
        x: &Tensor,
        xa: Option<&Tensor>,
        xd: &Tensor,
        v: Option<&(Tensor, Tensor)>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        if self.fused && cpu::applies(x) {
            let ad = match (self.ad(), xa, v) {
                (Some(ad), Some(xa), Some((av, bv))) => Some((ad, xa, (av, bv))),
                _ => None,
            };
            return cpu::lin_tan(x, &self.w, ad, xd);
        }
        let mut yd = xd.matmul(&self.w.t()?)?;
        let mut xad = None;
        if let (Some((a, b, s)), Some(xa), Some((av, bv))) = (&self.ad, xa, v) {
            let t = (xd.matmul(&a.t()?)? + x.matmul(&av.t()?)?)?;
            yd = (yd + ((t.matmul(&b.t()?)? + xa.matmul(&bv.t()?)?)? * *s)?)?;
            xad = Some(t);
        }
        Ok((yd, xad))
    }

    /// The tangent of [`Lin::bwd`] given ġ = the tangent of ∂ℓ/∂y: with (gB)˙ = ġ B + g Ḃ,
    /// (∂ℓ/∂x)˙ = ġ W + s ((gB)˙ A + (g B) Ȧ), (∂ℓ/∂A)˙ = s ((gB)˙ᵀ x + (g B)ᵀ ẋ),
    /// (∂ℓ/∂B)˙ = s (ġᵀ (x Aᵀ) + gᵀ (x Aᵀ)˙). The pairs: the input x and x Aᵀ, their tangents
    /// ẋ and (x Aᵀ)˙, the adjoint g and g B (x Aᵀ, (x Aᵀ)˙ and g B for an adapted layer only).
    pub(super) fn tan_bwd(
        &self,
        (x, xa): (&Tensor, Option<&Tensor>),
        (xd, xad): (&Tensor, Option<&Tensor>),
        (g, gb): (&Tensor, Option<&Tensor>),
        gd: &Tensor,
        v: Option<&(Tensor, Tensor)>,
        need_gx: bool,
    ) -> Result<LinBwd> {
        if self.fused && cpu::applies(x) {
            let ad = match (self.ad(), xa, v, xad, gb) {
                (Some(ad), Some(xa), Some((av, bv)), Some(xad), Some(gb)) => Some((ad, xa, (av, bv), xad, (g, gb))),
                _ => None,
            };
            let (gx, grads) = cpu::lin_tan_bwd(x, &self.w, ad, xd, gd, need_gx)?;
            return Ok(LinBwd { gx, grads, gb: None });
        }
        let mut gx = if need_gx { Some(gd.matmul(&self.w)?) } else { None };
        let mut grads = None;
        if let (Some((a, b, s)), Some(xa), Some(xad), Some(gb), Some((av, bv))) = (&self.ad, xa, xad, gb, v) {
            let gbd = (gd.matmul(b)? + g.matmul(bv)?)?;
            if let Some(gx) = &mut gx {
                *gx = (&*gx + ((gbd.matmul(a)? + gb.matmul(av)?)? * *s)?)?;
            }
            let da = ((gbd.t()?.matmul(x)? + gb.t()?.matmul(xd)?)? * *s)?;
            let db = ((gd.t()?.matmul(xa)? + g.t()?.matmul(xad)?)? * *s)?;
            grads = Some((da, db));
        }
        Ok(LinBwd { gx, grads, gb: None })
    }
}

/// What [`Lin::bwd`] gives: ∂ℓ/∂x, (∂ℓ/∂A, ∂ℓ/∂B) for an adapted layer, and g B.
pub(super) struct LinBwd {
    pub(super) gx: Option<Tensor>,
    pub(super) grads: Option<(Tensor, Tensor)>,
    pub(super) gb: Option<Tensor>,
}

/// A linear layer's adjoint on the tape: g = ∂ℓ/∂y and g B.
pub(super) struct LinBwdSaved {
    pub(super) g: Option<Tensor>,
    pub(super) gb: Option<Tensor>,
}

/// RMSNorm h = γ ⊙ x·r, r = (mean x² + ε)^{-½} per row: (r (rows, 1), h).
pub(super) fn norm_fwd(x: &Tensor, gamma: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let r = (x.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
    let h = x.broadcast_mul(&r)?.broadcast_mul(gamma)?;
    Ok((r, h))
}

/// RMSNorm's backward: with u = γ ⊙ ∂ℓ/∂h, ∂ℓ/∂x = r u − (r³ ⟨x, u⟩ / d) x.
pub(super) fn norm_bwd(x: &Tensor, r: &Tensor, gamma: &Tensor, gh: &Tensor) -> Result<Tensor> {
    let d = x.dim(D::Minus1)? as f64;
    let u = gh.broadcast_mul(gamma)?;
    let xu = (x * &u)?.sum_keepdim(D::Minus1)?;
    let c = ((r.powf(3.0)? * xu)? / d)?;
    u.broadcast_mul(r)? - x.broadcast_mul(&c)?
}

/// RMSNorm's tangent: ṙ = −r³ ⟨x, ẋ⟩ / d, ḣ = γ ⊙ (ẋ r + x ṙ). (ṙ, ḣ).
pub(super) fn norm_tan(x: &Tensor, r: &Tensor, gamma: &Tensor, xd: &Tensor) -> Result<(Tensor, Tensor)> {
    let d = x.dim(D::Minus1)? as f64;
    let rd = ((r.powf(3.0)? * (x * xd)?.sum_keepdim(D::Minus1)?)? * (-1.0 / d))?;
    let hd = (xd.broadcast_mul(r)? + x.broadcast_mul(&rd)?)?.broadcast_mul(gamma)?;
    Ok((rd, hd))
}

/// The tangent of [`norm_bwd`]: with u = γ ⊙ ∂ℓ/∂h, u̇ = γ ⊙ its tangent, k = ⟨x, u⟩,
/// k̇ = ⟨ẋ, u⟩ + ⟨x, u̇⟩: ṙ u + r u̇ − ((3 r² ṙ k + r³ k̇) / d) x − (r³ k / d) ẋ.
pub(super) fn norm_tan_bwd(
    x: &Tensor,
    xd: &Tensor,
    r: &Tensor,
    rd: &Tensor,
    gamma: &Tensor,
    gh: &Tensor,
    ghd: &Tensor,
) -> Result<Tensor> {
    let d = x.dim(D::Minus1)? as f64;
    let (u, ud) = (gh.broadcast_mul(gamma)?, ghd.broadcast_mul(gamma)?);
    let k = (x * &u)?.sum_keepdim(D::Minus1)?;
    let kd = ((xd * &u)?.sum_keepdim(D::Minus1)? + (x * &ud)?.sum_keepdim(D::Minus1)?)?;
    let r2 = r.sqr()?;
    let r3 = (&r2 * r)?;
    let cx = (((r2 * rd)? * &k)? * 3.0 + (&r3 * kd)?)?;
    let cx = (cx / d)?;
    let cxd = ((r3 * k)? / d)?;
    u.broadcast_mul(rd)? + ud.broadcast_mul(r)? - x.broadcast_mul(&cx)? - xd.broadcast_mul(&cxd)?
}

/// σ(x) = 1 / (1 + e^{−x}).
pub(super) fn sigmoid(x: &Tensor) -> Result<Tensor> {
    (x.neg()?.exp()? + 1.0)?.recip()
}
