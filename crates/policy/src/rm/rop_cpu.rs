//! The CPU's kernels of [`crate::rm::rop`] (f32, f64): the adapted products with every low-rank
//! term added into the frozen product's buffer (one `gemm` call each, no zero fill, no
//! temporary sums), attention's passes one (batch, kv head) group at a time with each
//! probability row's work in one pass over its visible keys, and the MLP's elementwise
//! tangents in one pass. The same maths as `rop`'s composed ops (which other devices run and
//! the tests compare against).

use crate::mm::{mm, mm_acc, mm_add, product, scaled_product, with_slices, ExpRow, Mat};
use candle_core::{DType, Result, Tensor};
use rayon::prelude::*;

/// The element types of the kernels.
pub(crate) trait El: ExpRow + candle_core::WithDType {}
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

fn c<T: El>(x: f64) -> T {
    T::from(x).unwrap_or_else(T::nan)
}

fn new<T: El>(v: Vec<T>, shape: &[usize], like: &Tensor) -> Result<Tensor> {
    Tensor::from_vec(v, shape, like.device())
}

/// The adapter of a layer: A (r, in), B (out, r), s.
pub(crate) type Ad<'a> = (&'a Tensor, &'a Tensor, f64);

/// y = x Wᵀ + b + s (x Aᵀ) Bᵀ and x Aᵀ (`crate::rm::rop::Lin::fwd`).
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
    let mut y = with_slices::<T, _, 2>([x, w], |[x, w]| product(rows, out, inp, Mat::rows(x, inp), Mat::t(w, inp)))?;
    if let Some(b) = bias {
        with_slices::<T, _, 1>([b], |[b]| {
            y.chunks_exact_mut(out).for_each(|r| r.iter_mut().zip(b).for_each(|(y, &b)| *y += b))
        })?;
    }
    let xa = match ad {
        Some((a, b, s)) => {
            let r = a.dim(0)?;
            let xa = with_slices::<T, _, 3>([x, a, b], |[x, a, b]| {
                let xa = product(rows, r, inp, Mat::rows(x, inp), Mat::t(a, inp));
                mm_add(rows, out, r, &mut y, Mat::rows(&xa, r), Mat::t(b, r), c(s));
                xa
            })?;
            Some(new(xa, &[rows, r], x)?)
        }
        None => None,
    };
    Ok((new(y, &[rows, out], x)?, xa))
}

/// The backward pass of [`lin_fwd`] from g: (∂ℓ/∂x when `need_gx`, (∂ℓ/∂A, ∂ℓ/∂B), g B).
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
    let mut gx = match need_gx {
        true => Some(with_slices::<T, _, 2>([g, w], |[g, w]| {
            product(rows, inp, out, Mat::rows(g, out), Mat::rows(w, inp))
        })?),
        false => None,
    };
    let (mut grads, mut gbt) = (None, None);
    if let Some(((a, b, s), xa)) = ad {
        let r = a.dim(0)?;
        let (da, db, gb) = with_slices::<T, _, 5>([x, a, b, g, xa], |[x, a, b, g, xa]| {
            let gb = product(rows, r, out, Mat::rows(g, out), Mat::rows(b, r));
            if let Some(gx) = &mut gx {
                mm_add(rows, inp, r, gx, Mat::rows(&gb, r), Mat::rows(a, inp), c(s));
            }
            let da = scaled_product(r, inp, rows, Mat::t(&gb, r), Mat::rows(x, inp), c(s));
            let db = scaled_product(out, r, rows, Mat::t(g, out), Mat::rows(xa, r), c(s));
            (da, db, gb)
        })?;
        grads = Some((new(da, &[r, inp], x)?, new(db, &[out, r], x)?));
        gbt = Some(new(gb, &[rows, r], x)?);
    }
    let gx = gx.map(|v| new(v, &[rows, inp], x)).transpose()?;
    Ok((gx, grads, gbt))
}

/// The tangent of [`lin_fwd`] along (ẋ, Ȧ, Ḃ): ẏ and (x Aᵀ)˙ (`crate::rm::rop::Lin::tan`).
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
    let mut yd =
        with_slices::<T, _, 2>([xd, w], |[xd, w]| product(rows, out, inp, Mat::rows(xd, inp), Mat::t(w, inp)))?;
    let mut xad = None;
    if let Some(((a, b, s), xa, (av, bv))) = ad {
        let r = a.dim(0)?;
        let t = with_slices::<T, _, 7>([x, xd, a, b, xa, av, bv], |[x, xd, a, b, xa, av, bv]| {
            let mut t = product(rows, r, inp, Mat::rows(xd, inp), Mat::t(a, inp));
            mm_add(rows, r, inp, &mut t, Mat::rows(x, inp), Mat::t(av, inp), T::one());
            mm_add(rows, out, r, &mut yd, Mat::rows(&t, r), Mat::t(b, r), c(s));
            mm_add(rows, out, r, &mut yd, Mat::rows(xa, r), Mat::t(bv, r), c(s));
            t
        })?;
        xad = Some(new(t, &[rows, r], x)?);
    }
    Ok((new(yd, &[rows, out], x)?, xad))
}

/// A layer's recorded backward values for [`lin_tan_bwd`]: g, g B.
pub(crate) type Saved<'a> = (&'a Tensor, &'a Tensor);

/// The tangent of [`lin_bwd`] given ġ (`crate::rm::rop::Lin::tan_bwd`).
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
    let mut gx = match need_gx {
        true => Some(with_slices::<T, _, 2>([gd, w], |[gd, w]| {
            product(rows, inp, out, Mat::rows(gd, out), Mat::rows(w, inp))
        })?),
        false => None,
    };
    let mut grads = None;
    if let Some(((a, b, s), xa, (av, bv), xad, (g, gb))) = ad {
        let r = a.dim(0)?;
        let (da, db) = with_slices::<T, _, 11>(
            [x, xd, a, b, xa, av, bv, xad, g, gb, gd],
            |[x, xd, a, b, xa, av, bv, xad, g, gb, gd]| {
                // (g B)˙ = ġ B + g Ḃ
                let mut gbd = product(rows, r, out, Mat::rows(gd, out), Mat::rows(b, r));
                mm_add(rows, r, out, &mut gbd, Mat::rows(g, out), Mat::rows(bv, r), T::one());
                if let Some(gx) = &mut gx {
                    mm_add(rows, inp, r, gx, Mat::rows(&gbd, r), Mat::rows(a, inp), c(s));
                    mm_add(rows, inp, r, gx, Mat::rows(gb, r), Mat::rows(av, inp), c(s));
                }
                let mut da = scaled_product(r, inp, rows, Mat::t(&gbd, r), Mat::rows(x, inp), c(s));
                mm_add(r, inp, rows, &mut da, Mat::t(gb, r), Mat::rows(xd, inp), c(s));
                let mut db = scaled_product(out, r, rows, Mat::t(gd, out), Mat::rows(xa, r), c(s));
                mm_add(out, r, rows, &mut db, Mat::t(g, out), Mat::rows(xad, r), c(s));
                (da, db)
            },
        )?;
        grads = Some((new(da, &[r, inp], x)?, new(db, &[out, r], x)?));
    }
    let gx = gx.map(|v| new(v, &[rows, inp], x)).transpose()?;
    Ok((gx, grads))
}

/// Attention's layout: b sequences, kv key–value heads of g query heads, t positions, hd.
#[derive(Clone, Copy)]
pub(crate) struct Att {
    pub b: usize,
    pub kv: usize,
    pub g: usize,
    pub t: usize,
    pub hd: usize,
}

impl Att {
    fn scale<T: El>(&self) -> T {
        c(1.0 / (self.hd as f64).sqrt())
    }
    /// Query rows of a group and their size, key rows' size, probabilities' size.
    fn sizes(&self) -> (usize, usize, usize, usize) {
        let gt = self.g * self.t;
        (gt, gt * self.hd, self.t * self.hd, gt * self.t)
    }
}

/// Keys query row r of a group sees (causal): 0..=r mod t.
fn visible(r: usize, t: usize) -> usize {
    r % t + 1
}

fn dot<T: El>(a: &[T], b: &[T]) -> T {
    a.iter().zip(b).fold(T::zero(), |s, (&x, &y)| s + x * y)
}

/// One group's probabilities P = softmax(c Q Kᵀ + causal mask) (g·t × t) into `p`, as
/// e^{c q·k − lse} from the rows' log-sum-exps (every use recomputes the same values).
fn probs<T: El>(at: Att, q: &[T], k: &[T], lse: &[T], p: &mut [T]) {
    let (gt, t, hd) = (at.g * at.t, at.t, at.hd);
    mm(gt, t, hd, p, Mat::rows(q, hd), Mat::t(k, hd), at.scale());
    for (r, pr) in p.chunks_exact_mut(t).enumerate() {
        let n = visible(r, t);
        pr[..n].iter_mut().for_each(|e| *e -= lse[r]);
        T::exp_row(&mut pr[..n]);
        pr[n..].iter_mut().for_each(|e| *e = T::zero());
    }
}

/// Attention's forward pass on grouped queries (b, kv, g·t, hd), keys and values (b, kv, t,
/// hd): each query row's log-sum-exp of its scaled, causally masked scores (b, kv, g·t) —
/// what the tape keeps of P, which [`probs`] recomputes — and O = P V (b, kv, g·t, hd).
pub(crate) fn attn_fwd(at: Att, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
    by_dtype!(q, attn_fwd_t(at, q, k, v))
}

fn attn_fwd_t<T: El>(at: Att, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
    let (gt, qs, ks, ps) = at.sizes();
    let (t, hd) = (at.t, at.hd);
    let groups = at.b * at.kv;
    let mut lse = vec![T::zero(); groups * gt];
    let mut o = vec![T::zero(); groups * qs];
    with_slices::<T, _, 3>([q, k, v], |[q, k, v]| {
        lse.par_chunks_mut(gt).zip(o.par_chunks_mut(qs)).enumerate().for_each(|(i, (lse, o))| {
            let (q, k, v) = (&q[i * qs..(i + 1) * qs], &k[i * ks..(i + 1) * ks], &v[i * ks..(i + 1) * ks]);
            let mut p = vec![T::zero(); ps];
            mm(gt, t, hd, &mut p, Mat::rows(q, hd), Mat::t(k, hd), at.scale());
            for (r, pr) in p.chunks_exact_mut(t).enumerate() {
                let n = visible(r, t);
                let m = pr[..n].iter().fold(T::neg_infinity(), |a, &b| num_traits::Float::max(a, b));
                let mut e = pr[..n].to_vec();
                e.iter_mut().for_each(|x| *x -= m);
                T::exp_row(&mut e);
                lse[r] = m + e.iter().fold(T::zero(), |a, &x| a + x).ln();
            }
            probs(at, q, k, lse, &mut p);
            mm(gt, hd, t, o, Mat::rows(&p, t), Mat::rows(v, hd), T::one());
        })
    })?;
    Ok((new(lse, &[at.b, at.kv, gt], q)?, new(o, &[at.b, at.kv, gt, hd], q)?))
}

/// One group's S̄ = c P ⊙ (Ō Vᵀ − D) (the adjoint of Q Kᵀ) into `gs`, D = ⟨Ō, O⟩ per row.
fn scores_adjoint<T: El>(at: Att, p: &[T], v: &[T], d: &[T], go: &[T], gs: &mut [T]) {
    let (gt, t, hd) = (at.g * at.t, at.t, at.hd);
    mm(gt, t, hd, gs, Mat::rows(go, hd), Mat::t(v, hd), T::one());
    for (r, (sr, pr)) in gs.chunks_exact_mut(t).zip(p.chunks_exact(t)).enumerate() {
        let n = visible(r, t);
        sr[..n].iter_mut().zip(&pr[..n]).for_each(|(s, &p)| *s = at.scale::<T>() * p * (*s - d[r]));
        sr[n..].iter_mut().for_each(|s| *s = T::zero());
    }
}

/// One group's Z = Ṡ − ⟨P, Ṡ⟩ per row, Ṡ = c (Q̇ Kᵀ + Q K̇ᵀ), into `z` (Ṗ = P ⊙ Z).
fn score_tangent<T: El>(at: Att, q: &[T], k: &[T], qd: &[T], kd: &[T], p: &[T], z: &mut [T]) {
    let (gt, t, hd) = (at.g * at.t, at.t, at.hd);
    mm(gt, t, hd, z, Mat::rows(qd, hd), Mat::t(k, hd), at.scale());
    mm_acc(gt, t, hd, z, Mat::rows(q, hd), Mat::t(kd, hd), at.scale());
    for (zr, pr) in z.chunks_exact_mut(t).zip(p.chunks_exact(t)) {
        let m = dot(pr, zr);
        zr.iter_mut().for_each(|z| *z -= m);
    }
}

/// Adjoints of the queries (b, kv, g·t, hd), keys and values (b, kv, t, hd), each group's
/// filled by `f(group, q̄, k̄, v̄)`, one group per rayon task.
fn group_adjoints<T: El>(
    at: Att,
    like: &Tensor,
    f: impl Fn(usize, &mut [T], &mut [T], &mut [T]) + Sync,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (gt, qs, ks, _) = at.sizes();
    let groups = at.b * at.kv;
    let (mut gq, mut gk, mut gv) =
        (vec![T::zero(); groups * qs], vec![T::zero(); groups * ks], vec![T::zero(); groups * ks]);
    gq.par_chunks_mut(qs)
        .zip(gk.par_chunks_mut(ks))
        .zip(gv.par_chunks_mut(ks))
        .enumerate()
        .for_each(|(i, ((gq, gk), gv))| f(i, gq, gk, gv));
    let (b, kv, t, hd) = (at.b, at.kv, at.t, at.hd);
    Ok((new(gq, &[b, kv, gt, hd], like)?, new(gk, &[b, kv, t, hd], like)?, new(gv, &[b, kv, t, hd], like)?))
}

/// Attention's backward pass from Ō = ∂ℓ/∂O (and D = ⟨Ō, O⟩ per query row, (b, kv, g·t)):
/// with S̄ = c P ⊙ (Ō Vᵀ − D), Q̄ = S̄ K, K̄ = S̄ᵀ Q, V̄ = Pᵀ Ō: (Q̄, K̄, V̄).
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
    let (gt, qs, ks, ps) = at.sizes();
    let (t, hd) = (at.t, at.hd);
    let like = q.clone();
    with_slices::<T, _, 6>([q, k, v, lse, d, go], |[q, k, v, lse, d, go]| {
        group_adjoints(at, &like, |i, gq: &mut [T], gk, gv| {
            let (qr, kr) = (i * qs..(i + 1) * qs, i * ks..(i + 1) * ks);
            let (q, k, v, lse) = (&q[qr.clone()], &k[kr.clone()], &v[kr], &lse[i * gt..(i + 1) * gt]);
            let (d, go) = (&d[i * gt..(i + 1) * gt], &go[qr]);
            let (mut p, mut gs) = (vec![T::zero(); ps], vec![T::zero(); ps]);
            probs(at, q, k, lse, &mut p);
            scores_adjoint(at, &p, v, d, go, &mut gs);
            mm(gt, hd, t, gq, Mat::rows(&gs, t), Mat::rows(k, hd), T::one());
            mm(t, hd, gt, gk, Mat::t(&gs, t), Mat::rows(q, hd), T::one());
            mm(t, hd, gt, gv, Mat::t(&p, t), Mat::rows(go, hd), T::one());
        })
    })?
}

/// Attention's tangent: with Ṗ = P ⊙ Z ([`score_tangent`]), Ȯ = Ṗ V + P V̇.
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
    let (gt, qs, ks, ps) = at.sizes();
    let (t, hd) = (at.t, at.hd);
    let groups = at.b * at.kv;
    let mut od = vec![T::zero(); groups * qs];
    with_slices::<T, _, 7>([q, k, v, lse, qd, kd, vd], |[q, k, v, lse, qd, kd, vd]| {
        od.par_chunks_mut(qs).enumerate().for_each(|(i, od)| {
            let (qr, kr) = (i * qs..(i + 1) * qs, i * ks..(i + 1) * ks);
            let (q, qd, lse) = (&q[qr.clone()], &qd[qr], &lse[i * gt..(i + 1) * gt]);
            let (k, v, kd, vd) = (&k[kr.clone()], &v[kr.clone()], &kd[kr.clone()], &vd[kr]);
            let (mut p, mut z) = (vec![T::zero(); ps], vec![T::zero(); ps]);
            probs(at, q, k, lse, &mut p);
            mm(gt, hd, t, od, Mat::rows(&p, t), Mat::rows(vd, hd), T::one());
            score_tangent(at, q, k, qd, kd, &p, &mut z);
            // Ṗ = P ⊙ Z in P's place (zero past the visible keys, where P is)
            p.iter_mut().zip(&z).for_each(|(p, &z)| *p *= z);
            mm_acc(gt, hd, t, od, Mat::rows(&p, t), Mat::rows(v, hd), T::one());
        })
    })?;
    new(od, &[at.b, at.kv, gt, hd], q)
}

/// The recorded attention's values for [`attn_tan_bwd`]: Q, K, V, the log-sum-exps, D, Ō.
pub(crate) type AttSaved<'a> = (&'a Tensor, &'a Tensor, &'a Tensor, &'a Tensor, &'a Tensor, &'a Tensor);

/// The tangent of [`attn_bwd`] given Ō̇ and Ḋ = ⟨Ō̇, O⟩ + ⟨Ō, Ȯ⟩: P̄̇ = Ō̇ Vᵀ + Ō V̇ᵀ,
/// S̄̇ = Z ⊙ S̄ + c P ⊙ (P̄̇ − Ḋ) (with Ṗ = P ⊙ Z, Ṗ ⊙ (P̄ − D) = Z ⊙ S̄/c), then
/// Q̄̇ = S̄̇ K + S̄ K̇, K̄̇ = S̄̇ᵀ Q + S̄ᵀ Q̇, V̄̇ = Ṗᵀ Ō + Pᵀ Ō̇: (Q̄̇, K̄̇, V̄̇). P and S̄ are
/// recomputed, and Z ([`score_tangent`]).
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
    let (gt, qs, ks, ps) = at.sizes();
    let (t, hd) = (at.t, at.hd);
    let like = q.clone();
    with_slices::<T, _, 11>([q, k, v, lse, d, go, qd, kd, vd, dd, god], |[q, k, v, lse, d, go, qd, kd, vd, dd, god]| {
        group_adjoints(at, &like, |i, gqd: &mut [T], gkd, gvd| {
            let (qr, kr, rr) = (i * qs..(i + 1) * qs, i * ks..(i + 1) * ks, i * gt..(i + 1) * gt);
            let (q, go, qd, god) = (&q[qr.clone()], &go[qr.clone()], &qd[qr.clone()], &god[qr]);
            let (k, v, kd, vd) = (&k[kr.clone()], &v[kr.clone()], &kd[kr.clone()], &vd[kr]);
            let (lse, d, dd) = (&lse[rr.clone()], &d[rr.clone()], &dd[rr]);
            let sc = at.scale::<T>();
            let (mut p, mut gs, mut gsd, mut z) =
                (vec![T::zero(); ps], vec![T::zero(); ps], vec![T::zero(); ps], vec![T::zero(); ps]);
            probs(at, q, k, lse, &mut p);
            scores_adjoint(at, &p, v, d, go, &mut gs);
            score_tangent(at, q, k, qd, kd, &p, &mut z);
            mm(gt, t, hd, &mut gsd, Mat::rows(god, hd), Mat::t(v, hd), T::one());
            mm_acc(gt, t, hd, &mut gsd, Mat::rows(go, hd), Mat::t(vd, hd), T::one());
            for (r, sr) in gsd.chunks_exact_mut(t).enumerate() {
                let n = visible(r, t);
                let (pr, zr, gr) = (&p[r * t..r * t + n], &z[r * t..r * t + n], &gs[r * t..r * t + n]);
                for (((s, &p), &z), &g) in sr[..n].iter_mut().zip(pr).zip(zr).zip(gr) {
                    *s = z * g + sc * p * (*s - dd[r]);
                }
                sr[n..].iter_mut().for_each(|s| *s = T::zero());
            }
            mm(gt, hd, t, gqd, Mat::rows(&gsd, t), Mat::rows(k, hd), T::one());
            mm_acc(gt, hd, t, gqd, Mat::rows(&gs, t), Mat::rows(kd, hd), T::one());
            mm(t, hd, gt, gkd, Mat::t(&gsd, t), Mat::rows(q, hd), T::one());
            mm_acc(t, hd, gt, gkd, Mat::t(&gs, t), Mat::rows(qd, hd), T::one());
            mm(t, hd, gt, gvd, Mat::t(&p, t), Mat::rows(god, hd), T::one());
            // Ṗ = P ⊙ Z in P's place
            p.iter_mut().zip(&z).for_each(|(p, &z)| *p *= z);
            mm_acc(t, hd, gt, gvd, Mat::t(&p, t), Mat::rows(go, hd), T::one());
        })
    })?
}

/// Elements per rayon task of the elementwise kernels.
const CHUNK: usize = 1 << 14;

/// The silu factors at gate g with σ = σ(g) = 1/(1 + e^{−g}): (silu, silu′, silu″).
#[inline]
fn silu3<T: El>(g: T) -> (T, T, T) {
    let one = T::one();
    let two = one + one;
    let s = one / (one + (-g).exp());
    (g * s, s * (one + g * (one - s)), s * (one - s) * (two + g * (one - two * s)))
}

/// The MLP's product a = silu(g) ⊙ u (the down projection's input, recomputed for each use).
pub(crate) fn mlp_out(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    by_dtype!(gate, mlp_out_t(gate, up))
}

fn mlp_out_t<T: El>(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let mut out = vec![T::zero(); gate.elem_count()];
    with_slices::<T, _, 2>([gate, up], |[g, u]| {
        out.par_chunks_mut(CHUNK).enumerate().for_each(|(i, o)| {
            let at = i * CHUNK;
            for (j, o) in o.iter_mut().enumerate() {
                *o = silu3(g[at + j]).0 * u[at + j];
            }
        })
    })?;
    new(out, gate.dims(), gate)
}

/// The MLP's tangent ȧ = silu′(g) ġ ⊙ u + silu(g) ⊙ u̇ (σ(g) recomputed).
pub(crate) fn mlp_tan(gate: &Tensor, up: &Tensor, gd: &Tensor, ud: &Tensor) -> Result<Tensor> {
    by_dtype!(gate, mlp_tan_t(gate, up, gd, ud))
}

fn mlp_tan_t<T: El>(gate: &Tensor, up: &Tensor, gd: &Tensor, ud: &Tensor) -> Result<Tensor> {
    let mut out = vec![T::zero(); gate.elem_count()];
    with_slices::<T, _, 4>([gate, up, gd, ud], |[g, u, gd, ud]| {
        out.par_chunks_mut(CHUNK).enumerate().for_each(|(i, o)| {
            let at = i * CHUNK;
            for (j, o) in o.iter_mut().enumerate() {
                let (silu, d1, _) = silu3(g[at + j]);
                *o = d1 * gd[at + j] * u[at + j] + silu * ud[at + j];
            }
        })
    })?;
    new(out, gate.dims(), gate)
}

/// The MLP's backward from ā = ∂ℓ/∂a: (ḡ = ā ⊙ u ⊙ silu′(g), ū = ā ⊙ silu(g)).
pub(crate) fn mlp_bwd(gate: &Tensor, up: &Tensor, ga: &Tensor) -> Result<(Tensor, Tensor)> {
    by_dtype!(gate, mlp_bwd_t(gate, up, ga))
}

fn mlp_bwd_t<T: El>(gate: &Tensor, up: &Tensor, ga: &Tensor) -> Result<(Tensor, Tensor)> {
    let n = gate.elem_count();
    let (mut gg, mut gu) = (vec![T::zero(); n], vec![T::zero(); n]);
    with_slices::<T, _, 3>([gate, up, ga], |[g, u, ga]| {
        gg.par_chunks_mut(CHUNK).zip(gu.par_chunks_mut(CHUNK)).enumerate().for_each(|(i, (gg, gu))| {
            let at = i * CHUNK;
            for (j, (gg, gu)) in gg.iter_mut().zip(gu.iter_mut()).enumerate() {
                let (silu, d1, _) = silu3(g[at + j]);
                *gg = ga[at + j] * u[at + j] * d1;
                *gu = ga[at + j] * silu;
            }
        })
    })?;
    Ok((new(gg, gate.dims(), gate)?, new(gu, gate.dims(), gate)?))
}

/// The tangent of [`mlp_bwd`]: ḡ̇ = (ā̇ ⊙ u + ā ⊙ u̇) ⊙ silu′ + ā ⊙ u ⊙ silu″ ⊙ ġ,
/// ū̇ = ā̇ ⊙ silu + ā ⊙ silu′ ⊙ ġ.
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
    let n = gate.elem_count();
    let (mut gg, mut gu) = (vec![T::zero(); n], vec![T::zero(); n]);
    with_slices::<T, _, 6>([gate, up, ga, gad, gd, ud], |[g, u, ga, gad, gd, ud]| {
        gg.par_chunks_mut(CHUNK).zip(gu.par_chunks_mut(CHUNK)).enumerate().for_each(|(i, (gg, gu))| {
            let at = i * CHUNK;
            for (j, (gg, gu)) in gg.iter_mut().zip(gu.iter_mut()).enumerate() {
                let x = at + j;
                let (silu, d1, d2) = silu3(g[x]);
                *gg = (gad[x] * u[x] + ga[x] * ud[x]) * d1 + ga[x] * u[x] * d2 * gd[x];
                *gu = gad[x] * silu + ga[x] * d1 * gd[x];
            }
        })
    })?;
    Ok((new(gg, gate.dims(), gate)?, new(gu, gate.dims(), gate)?))
}
