//! The CPU's kernels of [`crate::rm::rop`] (f32, f64): `kernels::rop`'s passes over values (the
//! adapted products with every low-rank term added into the frozen product's buffer, attention
//! one (batch, kv head) group at a time, the MLP's elementwise tangents in one pass; see its
//! doc) as functions of candle tensors: here the shapes are read, the values of contiguous CPU
//! tensors read in place and the results made tensors again. The same maths as `rop`'s composed
//! ops (which other devices run and the tests compare against).

use crate::mm::with_slices;
use candle_core::{DType, Result, Tensor};
use kernels::rop::{self as kern, AdTan, Adapter, LinDims};

/// Attention's layout: b sequences, kv key–value heads of g query heads, t positions, hd.
pub(crate) use kernels::rop::Att;

/// The element types of the kernels.
pub(crate) trait El: kern::El + candle_core::WithDType {}
impl El for f32 {}
impl El for f64 {}

/// Whether the kernels apply to `t`: a contiguous CPU tensor in f32 or f64.
pub(crate) fn applies(t: &Tensor) -> bool {
    t.device().is_cpu() && matches!(t.dtype(), DType::F32 | DType::F64)
}

/// `f` at `t`'s element type.
macro_rules! by_dtype {
    ($t:expr, $f:ident ( $($arg:expr),* )) => {
        match $t.dtype() {
            DType::F32 => $f::<f32>($($arg),*),
            DType::F64 => $f::<f64>($($arg),*),
            d => candle_core::bail!("the R-operator's CPU kernels run in f32 or f64, not {d:?}"),
        }
    };
}

fn new<T: El>(v: Vec<T>, shape: &[usize], like: &Tensor) -> Result<Tensor> {
    Tensor::from_vec(v, shape, like.device())
}

/// `f` on the values of `ts` read in place when they are given, on `None` otherwise.
fn with_some<T: El, R, const N: usize>(ts: Option<[&Tensor; N]>, f: impl FnOnce(Option<[&[T]; N]>) -> R) -> Result<R> {
    match ts {
        Some(ts) => with_slices::<T, _, N>(ts, |v| f(Some(v))),
        None => Ok(f(None)),
    }
}

/// The linear layers' products run on candle's thread count, as candle's matmul does.
fn threads() -> usize {
    candle_core::utils::get_num_threads()
}

/// The adapter of a layer: A (r, in), B (out, r), s.
pub(crate) type Ad<'a> = (&'a Tensor, &'a Tensor, f64);

/// y = x Wᵀ + b + s (x Aᵀ) Bᵀ and x Aᵀ (`crate::rm::rop::Lin::fwd`; `kernels::rop::lin_fwd`).
pub(crate) fn lin_fwd(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    ad: Option<Ad<'_>>,
) -> Result<(Tensor, Option<Tensor>)> {
    by_dtype!(x, lin_fwd_t(x, w, bias, ad))
}

fn lin_fwd_t<T: El>(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    ad: Option<Ad<'_>>,
) -> Result<(Tensor, Option<Tensor>)> {
    let ((rows, inp), (out, _)) = (x.dims2()?, w.dims2()?);
    let dims = LinDims { rows, inp, out };
    let r = ad.map(|(a, _, _)| a.dim(0)).transpose()?;
    let (y, xa) = with_slices::<T, _, 2>([x, w], |[x, w]| {
        with_some::<T, _, 1>(bias.map(|b| [b]), |bias| {
            with_some::<T, _, 2>(ad.map(|(a, b, _)| [a, b]), |ab| {
                let ad = ab.zip(ad).zip(r).map(|(([a, b], (_, _, s)), r)| Adapter { a, b, r, s });
                kern::lin_fwd(dims, x, w, bias.map(|[b]| b), ad, threads())
            })
        })
    })???;
    let xa = match (xa, r) {
        (Some(xa), Some(r)) => Some(new(xa, &[rows, r], x)?),
        _ => None,
    };
    Ok((new(y, &[rows, out], x)?, xa))
}

/// The backward pass of [`lin_fwd`] from g: (∂ℓ/∂x when `need_gx`, (∂ℓ/∂A, ∂ℓ/∂B), g B)
/// (`kernels::rop::lin_bwd`).
#[allow(clippy::type_complexity)]
pub(crate) fn lin_bwd(
    x: &Tensor,
    w: &Tensor,
    ad: Option<(Ad<'_>, &Tensor)>,
    g: &Tensor,
    need_gx: bool,
) -> Result<(Option<Tensor>, Option<(Tensor, Tensor)>, Option<Tensor>)> {
    by_dtype!(x, lin_bwd_t(x, w, ad, g, need_gx))
}

#[allow(clippy::type_complexity)]
fn lin_bwd_t<T: El>(
    x: &Tensor,
    w: &Tensor,
    ad: Option<(Ad<'_>, &Tensor)>,
    g: &Tensor,
    need_gx: bool,
) -> Result<(Option<Tensor>, Option<(Tensor, Tensor)>, Option<Tensor>)> {
    let ((rows, inp), (out, _)) = (x.dims2()?, w.dims2()?);
    let dims = LinDims { rows, inp, out };
    if !need_gx && ad.is_none() {
        return Ok((None, None, None));
    }
    let r = ad.map(|((a, _, _), _)| a.dim(0)).transpose()?;
    let (gx, grads, gb) = with_slices::<T, _, 1>([g], |[g]| {
        with_some::<T, _, 1>(need_gx.then_some([w]), |w| {
            with_some::<T, _, 4>(ad.map(|((a, b, _), xa)| [x, a, b, xa]), |v| {
                let ad = v.zip(ad).zip(r).map(|(([x, a, b, xa], ((_, _, s), _)), r)| (Adapter { a, b, r, s }, x, xa));
                kern::lin_bwd(dims, g, w.map(|[w]| w), ad, threads())
            })
        })
    })???;
    let (grads, gb) = match (grads, gb, r) {
        (Some((da, db)), Some(gb), Some(r)) => {
            (Some((new(da, &[r, inp], x)?, new(db, &[out, r], x)?)), Some(new(gb, &[rows, r], x)?))
        }
        _ => (None, None),
    };
    let gx = gx.map(|v| new(v, &[rows, inp], x)).transpose()?;
    Ok((gx, grads, gb))
}

/// The tangent of [`lin_fwd`] along (ẋ, Ȧ, Ḃ): ẏ and (x Aᵀ)˙ (`crate::rm::rop::Lin::tan`;
/// `kernels::rop::lin_tan`).
pub(crate) fn lin_tan(
    x: &Tensor,
    w: &Tensor,
    ad: Option<(Ad<'_>, &Tensor, (&Tensor, &Tensor))>,
    xd: &Tensor,
) -> Result<(Tensor, Option<Tensor>)> {
    by_dtype!(x, lin_tan_t(x, w, ad, xd))
}

fn lin_tan_t<T: El>(
    x: &Tensor,
    w: &Tensor,
    ad: Option<(Ad<'_>, &Tensor, (&Tensor, &Tensor))>,
    xd: &Tensor,
) -> Result<(Tensor, Option<Tensor>)> {
    let ((rows, inp), (out, _)) = (x.dims2()?, w.dims2()?);
    let dims = LinDims { rows, inp, out };
    let r = ad.map(|((a, _, _), _, _)| a.dim(0)).transpose()?;
    let (yd, xad) = with_slices::<T, _, 2>([xd, w], |[xd, w]| {
        with_some::<T, _, 6>(ad.map(|((a, b, _), xa, (av, bv))| [x, a, b, xa, av, bv]), |v| {
            let ad = v.zip(ad).zip(r).map(|(([x, a, b, xa, av, bv], ((_, _, s), _, _)), r)| AdTan {
                ad: Adapter { a, b, r, s },
                x,
                xa,
                av,
                bv,
            });
            kern::lin_tan(dims, xd, w, ad, threads())
        })
    })??;
    let xad = match (xad, r) {
        (Some(t), Some(r)) => Some(new(t, &[rows, r], x)?),
        _ => None,
    };
    Ok((new(yd, &[rows, out], x)?, xad))
}

/// A layer's recorded backward values for [`lin_tan_bwd`]: g, g B.
pub(crate) type Saved<'a> = (&'a Tensor, &'a Tensor);

/// The tangent of [`lin_bwd`] given ġ (`crate::rm::rop::Lin::tan_bwd`;
/// `kernels::rop::lin_tan_bwd`).
#[allow(clippy::type_complexity)]
pub(crate) fn lin_tan_bwd(
    x: &Tensor,
    w: &Tensor,
    ad: Option<(Ad<'_>, &Tensor, (&Tensor, &Tensor), &Tensor, Saved<'_>)>,
    xd: &Tensor,
    gd: &Tensor,
    need_gx: bool,
) -> Result<(Option<Tensor>, Option<(Tensor, Tensor)>)> {
    by_dtype!(x, lin_tan_bwd_t(x, w, ad, xd, gd, need_gx))
}

#[allow(clippy::type_complexity)]
fn lin_tan_bwd_t<T: El>(
    x: &Tensor,
    w: &Tensor,
    ad: Option<(Ad<'_>, &Tensor, (&Tensor, &Tensor), &Tensor, Saved<'_>)>,
    xd: &Tensor,
    gd: &Tensor,
    need_gx: bool,
) -> Result<(Option<Tensor>, Option<(Tensor, Tensor)>)> {
    let ((rows, inp), (out, _)) = (x.dims2()?, w.dims2()?);
    let dims = LinDims { rows, inp, out };
    if !need_gx && ad.is_none() {
        return Ok((None, None));
    }
    let r = ad.map(|((a, _, _), _, _, _, _)| a.dim(0)).transpose()?;
    let tensors = ad.map(|((a, b, _), xa, (av, bv), xad, (g, gb))| [x, xd, a, b, xa, av, bv, xad, g, gb]);
    let (gx, grads) = with_slices::<T, _, 1>([gd], |[gd]| {
        with_some::<T, _, 1>(need_gx.then_some([w]), |w| {
            with_some::<T, _, 10>(tensors, |v| {
                let ad = v.zip(ad).zip(r).map(|(([x, xd, a, b, xa, av, bv, xad, g, gb], ((_, _, s), ..)), r)| {
                    (AdTan { ad: Adapter { a, b, r, s }, x, xa, av, bv }, (xd, xad), (g, gb))
                });
                kern::lin_tan_bwd(dims, gd, w.map(|[w]| w), ad, threads())
            })
        })
    })???;
    let grads = match (grads, r) {
        (Some((da, db)), Some(r)) => Some((new(da, &[r, inp], x)?, new(db, &[out, r], x)?)),
        _ => None,
    };
    let gx = gx.map(|v| new(v, &[rows, inp], x)).transpose()?;
    Ok((gx, grads))
}

/// Attention's forward pass on grouped queries (b, kv, g·t, hd), keys and values (b, kv, t,
/// hd): each query row's log-sum-exp of its scaled, causally masked scores (b, kv, g·t) — what
/// the tape keeps of P, which every later pass recomputes — and O = P V (b, kv, g·t, hd)
/// (`kernels::rop::attn_fwd`).
pub(crate) fn attn_fwd(at: Att, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
    by_dtype!(q, attn_fwd_t(at, q, k, v))
}

fn attn_fwd_t<T: El>(at: Att, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
    let gt = at.g * at.t;
    let (lse, o) = with_slices::<T, _, 3>([q, k, v], |[q, k, v]| kern::attn_fwd(at, q, k, v))?;
    Ok((new(lse, &[at.b, at.kv, gt], q)?, new(o, &[at.b, at.kv, gt, at.hd], q)?))
}

/// Adjoints or their tangents of the queries (b, kv, g·t, hd), keys and values (b, kv, t, hd)
/// as tensors like `like`.
fn adjoints<T: El>(at: Att, (gq, gk, gv): (Vec<T>, Vec<T>, Vec<T>), like: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, kv, t, hd) = (at.b, at.kv, at.t, at.hd);
    Ok((new(gq, &[b, kv, at.g * t, hd], like)?, new(gk, &[b, kv, t, hd], like)?, new(gv, &[b, kv, t, hd], like)?))
}

/// Attention's backward pass from Ō = ∂ℓ/∂O (and D = ⟨Ō, O⟩ per query row, (b, kv, g·t)):
/// with S̄ = c P ⊙ (Ō Vᵀ − D), Q̄ = S̄ K, K̄ = S̄ᵀ Q, V̄ = Pᵀ Ō: (Q̄, K̄, V̄)
/// (`kernels::rop::attn_bwd`).
#[allow(clippy::type_complexity)]
pub(crate) fn attn_bwd(
    at: Att,
    (q, k, v, lse, d): (&Tensor, &Tensor, &Tensor, &Tensor, &Tensor),
    go: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    by_dtype!(q, attn_bwd_t(at, (q, k, v, lse, d), go))
}

#[allow(clippy::type_complexity)]
fn attn_bwd_t<T: El>(
    at: Att,
    (q, k, v, lse, d): (&Tensor, &Tensor, &Tensor, &Tensor, &Tensor),
    go: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let g = with_slices::<T, _, 6>([q, k, v, lse, d, go], |[q, k, v, lse, d, go]| {
        kern::attn_bwd(at, (q, k, v, lse, d), go)
    })?;
    adjoints(at, g, q)
}

/// Attention's tangent: with Ṗ = P ⊙ Z, Ȯ = Ṗ V + P V̇ (`kernels::rop::attn_tan`).
#[allow(clippy::type_complexity)]
pub(crate) fn attn_tan(
    at: Att,
    (q, k, v, lse): (&Tensor, &Tensor, &Tensor, &Tensor),
    (qd, kd, vd): (&Tensor, &Tensor, &Tensor),
) -> Result<Tensor> {
    by_dtype!(q, attn_tan_t(at, (q, k, v, lse), (qd, kd, vd)))
}

#[allow(clippy::type_complexity)]
fn attn_tan_t<T: El>(
    at: Att,
    (q, k, v, lse): (&Tensor, &Tensor, &Tensor, &Tensor),
    (qd, kd, vd): (&Tensor, &Tensor, &Tensor),
) -> Result<Tensor> {
    let od = with_slices::<T, _, 7>([q, k, v, lse, qd, kd, vd], |[q, k, v, lse, qd, kd, vd]| {
        kern::attn_tan(at, (q, k, v, lse), (qd, kd, vd))
    })?;
    new(od, &[at.b, at.kv, at.g * at.t, at.hd], q)
}

/// The recorded attention's values for [`attn_tan_bwd`]: Q, K, V, the log-sum-exps, D, Ō.
pub(crate) type AttSaved<'a> = (&'a Tensor, &'a Tensor, &'a Tensor, &'a Tensor, &'a Tensor, &'a Tensor);

/// The tangent of [`attn_bwd`] given Ō̇ and Ḋ = ⟨Ō̇, O⟩ + ⟨Ō, Ȯ⟩: (Q̄̇, K̄̇, V̄̇), P and S̄
/// recomputed (`kernels::rop::attn_tan_bwd`, which writes the maths out).
#[allow(clippy::type_complexity)]
pub(crate) fn attn_tan_bwd(
    at: Att,
    saved: AttSaved<'_>,
    tan: (&Tensor, &Tensor, &Tensor, &Tensor),
    god: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    by_dtype!(god, attn_tan_bwd_t(at, saved, tan, god))
}

#[allow(clippy::type_complexity)]
fn attn_tan_bwd_t<T: El>(
    at: Att,
    (q, k, v, lse, d, go): AttSaved<'_>,
    (qd, kd, vd, dd): (&Tensor, &Tensor, &Tensor, &Tensor),
    god: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let g = with_slices::<T, _, 11>(
        [q, k, v, lse, d, go, qd, kd, vd, dd, god],
        |[q, k, v, lse, d, go, qd, kd, vd, dd, god]| {
            kern::attn_tan_bwd(at, (q, k, v, lse, d, go), (qd, kd, vd, dd), god)
        },
    )?;
    adjoints(at, g, q)
}

/// The MLP's product a = silu(g) ⊙ u (the down projection's input, recomputed for each use;
/// `kernels::rop::mlp_out`).
pub(crate) fn mlp_out(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    by_dtype!(gate, mlp_out_t(gate, up))
}

fn mlp_out_t<T: El>(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let out = with_slices::<T, _, 2>([gate, up], |[g, u]| kern::mlp_out(g, u))?;
    new(out, gate.dims(), gate)
}

/// The MLP's tangent ȧ = silu′(g) ġ ⊙ u + silu(g) ⊙ u̇ (`kernels::rop::mlp_tan`).
pub(crate) fn mlp_tan(gate: &Tensor, up: &Tensor, gd: &Tensor, ud: &Tensor) -> Result<Tensor> {
    by_dtype!(gate, mlp_tan_t(gate, up, gd, ud))
}

fn mlp_tan_t<T: El>(gate: &Tensor, up: &Tensor, gd: &Tensor, ud: &Tensor) -> Result<Tensor> {
    let out = with_slices::<T, _, 4>([gate, up, gd, ud], |[g, u, gd, ud]| kern::mlp_tan(g, u, gd, ud))?;
    new(out, gate.dims(), gate)
}

/// The MLP's backward from ā = ∂ℓ/∂a: (ḡ = ā ⊙ u ⊙ silu′(g), ū = ā ⊙ silu(g))
/// (`kernels::rop::mlp_bwd`).
pub(crate) fn mlp_bwd(gate: &Tensor, up: &Tensor, ga: &Tensor) -> Result<(Tensor, Tensor)> {
    by_dtype!(gate, mlp_bwd_t(gate, up, ga))
}

fn mlp_bwd_t<T: El>(gate: &Tensor, up: &Tensor, ga: &Tensor) -> Result<(Tensor, Tensor)> {
    let (gg, gu) = with_slices::<T, _, 3>([gate, up, ga], |[g, u, ga]| kern::mlp_bwd(g, u, ga))?;
    Ok((new(gg, gate.dims(), gate)?, new(gu, gate.dims(), gate)?))
}

/// The tangent of [`mlp_bwd`]: ḡ̇ = (ā̇ ⊙ u + ā ⊙ u̇) ⊙ silu′ + ā ⊙ u ⊙ silu″ ⊙ ġ,
/// ū̇ = ā̇ ⊙ silu + ā ⊙ silu′ ⊙ ġ (`kernels::rop::mlp_tan_bwd`).
pub(crate) fn mlp_tan_bwd(
    gate: &Tensor,
    up: &Tensor,
    ga: &Tensor,
    gad: &Tensor,
    gd: &Tensor,
    ud: &Tensor,
) -> Result<(Tensor, Tensor)> {
    by_dtype!(gate, mlp_tan_bwd_t(gate, up, ga, gad, gd, ud))
}

fn mlp_tan_bwd_t<T: El>(
    gate: &Tensor,
    up: &Tensor,
    ga: &Tensor,
    gad: &Tensor,
    gd: &Tensor,
    ud: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let (gg, gu) = with_slices::<T, _, 6>([gate, up, ga, gad, gd, ud], |[g, u, ga, gad, gd, ud]| {
        kern::mlp_tan_bwd(g, u, ga, gad, gd, ud)
    })?;
    Ok((new(gg, gate.dims(), gate)?, new(gu, gate.dims(), gate)?))
}
