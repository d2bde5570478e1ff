//! The CPU kernels of Pearlmutter's R-operator over a decoder with low-rank adapters (`policy`'s
//! `rm::rop` runs its CPU passes on them through `rm::rop_cpu`), in f32 and f64: each adapted
//! linear layer's forward, backward, tangent and tangent-of-backward with every low-rank term
//! added into the frozen product's buffer (one `gemm` call each, [`crate::dense`]; no zero fill,
//! no temporary sums), attention's passes one (batch, kv head) group at a time with each
//! probability row's work in one pass over its visible keys, and the MLP's elementwise passes
//! and tangents in one pass each.

use crate::dense::{mm, mm_acc, mm_into, product, Mat};
use crate::rows_grad::ExpRow;
use rayon::prelude::*;

/// The element types of the kernels (f32, f64).
pub trait El: ExpRow + num_traits::NumAssign {}
impl El for f32 {}
impl El for f64 {}

fn c<T: El>(x: f64) -> T {
    T::from(x).unwrap_or_else(T::nan)
}

/// A linear layer's shape: x (rows × inp), W (out × inp).
#[derive(Clone, Copy, Debug)]
pub struct LinDims {
    pub rows: usize,
    pub inp: usize,
    pub out: usize,
}

/// A layer's adapter: A (r × inp), B (out × r), the scale s.
#[derive(Clone, Copy)]
pub struct Adapter<'a, T> {
    pub a: &'a [T],
    pub b: &'a [T],
    pub r: usize,
    pub s: f64,
}

/// y = x Wᵀ + b + s (x Aᵀ) Bᵀ, and x Aᵀ when there is an adapter; the products on `threads`.
pub fn lin_fwd<T: El>(
    LinDims { rows, inp, out }: LinDims,
    x: &[T],
    w: &[T],
    bias: Option<&[T]>,
    ad: Option<Adapter<'_, T>>,
    threads: usize,
) -> (Vec<T>, Option<Vec<T>>) {
    let mut y = product((rows, out, inp), Mat::rows(x, inp), Mat::t(w, inp), T::one(), threads, false);
    if let Some(b) = bias {
        y.chunks_exact_mut(out).for_each(|r| r.iter_mut().zip(b).for_each(|(y, &b)| *y += b));
    }
    let xa = ad.map(|Adapter { a, b, r, s }| {
        let xa = product((rows, r, inp), Mat::rows(x, inp), Mat::t(a, inp), T::one(), threads, false);
        mm_into((rows, out, r), &mut y, Mat::rows(&xa, r), Mat::t(b, r), c(s), threads, true);
        xa
    });
    (y, xa)
}

/// The backward pass of [`lin_fwd`] from g = ∂ℓ/∂y: ∂ℓ/∂x = g W + s (g B) A when `w` is given,
/// and with an adapter (its input x and x Aᵀ given) (∂ℓ/∂A = s (g B)ᵀ x, ∂ℓ/∂B = s gᵀ (x Aᵀ))
/// and g B, which the tangent pass reuses.
#[allow(clippy::type_complexity)]
pub fn lin_bwd<T: El>(
    LinDims { rows, inp, out }: LinDims,
    g: &[T],
    w: Option<&[T]>,
    ad: Option<(Adapter<'_, T>, &[T], &[T])>,
    threads: usize,
) -> (Option<Vec<T>>, Option<(Vec<T>, Vec<T>)>, Option<Vec<T>>) {
    let mut gx = w.map(|w| product((rows, inp, out), Mat::rows(g, out), Mat::rows(w, inp), T::one(), threads, false));
    let (mut grads, mut gbt) = (None, None);
    if let Some((Adapter { a, b, r, s }, x, xa)) = ad {
        let gb = product((rows, r, out), Mat::rows(g, out), Mat::rows(b, r), T::one(), threads, false);
        if let Some(gx) = &mut gx {
            mm_into((rows, inp, r), gx, Mat::rows(&gb, r), Mat::rows(a, inp), c(s), threads, true);
        }
        let da = product((r, inp, rows), Mat::t(&gb, r), Mat::rows(x, inp), c(s), threads, false);
        let db = product((out, r, rows), Mat::t(g, out), Mat::rows(xa, r), c(s), threads, false);
        grads = Some((da, db));
        gbt = Some(gb);
    }
    (gx, grads, gbt)
}

/// An adapted layer's values for its tangent passes: the adapter, the input x, x Aᵀ, the
/// tangents (Ȧ, Ḃ) of the adapter.
#[derive(Clone, Copy)]
pub struct AdTan<'a, T> {
    pub ad: Adapter<'a, T>,
    pub x: &'a [T],
    pub xa: &'a [T],
    pub av: &'a [T],
    pub bv: &'a [T],
}

/// The tangent of [`lin_fwd`] along (ẋ, Ȧ, Ḃ): ẏ = ẋ Wᵀ + s ((ẋ Aᵀ + x Ȧᵀ) Bᵀ + (x Aᵀ) Ḃᵀ),
/// and (x Aᵀ)˙ = ẋ Aᵀ + x Ȧᵀ with an adapter.
pub fn lin_tan<T: El>(
    LinDims { rows, inp, out }: LinDims,
    xd: &[T],
    w: &[T],
    ad: Option<AdTan<'_, T>>,
    threads: usize,
) -> (Vec<T>, Option<Vec<T>>) {
    let mut yd = product((rows, out, inp), Mat::rows(xd, inp), Mat::t(w, inp), T::one(), threads, false);
    let xad = ad.map(|AdTan { ad: Adapter { a, b, r, s }, x, xa, av, bv }| {
        let mut t = product((rows, r, inp), Mat::rows(xd, inp), Mat::t(a, inp), T::one(), threads, false);
        mm_into((rows, r, inp), &mut t, Mat::rows(x, inp), Mat::t(av, inp), T::one(), threads, true);
        mm_into((rows, out, r), &mut yd, Mat::rows(&t, r), Mat::t(b, r), c(s), threads, true);
        mm_into((rows, out, r), &mut yd, Mat::rows(xa, r), Mat::t(bv, r), c(s), threads, true);
        t
    });
    (yd, xad)
}

/// The tangent of [`lin_bwd`] given ġ: with (gB)˙ = ġ B + g Ḃ, (∂ℓ/∂x)˙ = ġ W + s ((gB)˙ A +
/// (g B) Ȧ) when `w` is given, and with an adapter (∂ℓ/∂A)˙ = s ((gB)˙ᵀ x + (g B)ᵀ ẋ),
/// (∂ℓ/∂B)˙ = s (ġᵀ (x Aᵀ) + gᵀ (x Aᵀ)˙). `ad` adds ẋ, (x Aᵀ)˙, g and g B to the layer's values.
#[allow(clippy::type_complexity)]
pub fn lin_tan_bwd<T: El>(
    LinDims { rows, inp, out }: LinDims,
    gd: &[T],
    w: Option<&[T]>,
    ad: Option<(AdTan<'_, T>, (&[T], &[T]), (&[T], &[T]))>,
    threads: usize,
) -> (Option<Vec<T>>, Option<(Vec<T>, Vec<T>)>) {
    let mut gx = w.map(|w| product((rows, inp, out), Mat::rows(gd, out), Mat::rows(w, inp), T::one(), threads, false));
    let mut grads = None;
    if let Some((AdTan { ad: Adapter { a, b, r, s }, x, xa, av, bv }, (xd, xad), (g, gb))) = ad {
        // (g B)˙ = ġ B + g Ḃ
        let mut gbd = product((rows, r, out), Mat::rows(gd, out), Mat::rows(b, r), T::one(), threads, false);
        mm_into((rows, r, out), &mut gbd, Mat::rows(g, out), Mat::rows(bv, r), T::one(), threads, true);
        if let Some(gx) = &mut gx {
            mm_into((rows, inp, r), gx, Mat::rows(&gbd, r), Mat::rows(a, inp), c(s), threads, true);
            mm_into((rows, inp, r), gx, Mat::rows(gb, r), Mat::rows(av, inp), c(s), threads, true);
        }
        let mut da = product((r, inp, rows), Mat::t(&gbd, r), Mat::rows(x, inp), c(s), threads, false);
        mm_into((r, inp, rows), &mut da, Mat::t(gb, r), Mat::rows(xd, inp), c(s), threads, true);
        let mut db = product((out, r, rows), Mat::t(gd, out), Mat::rows(xa, r), c(s), threads, false);
        mm_into((out, r, rows), &mut db, Mat::t(g, out), Mat::rows(xad, r), c(s), threads, true);
        grads = Some((da, db));
    }
    (gx, grads)
}

/// Attention's layout: b sequences, kv key–value heads of g query heads, t positions, hd.
/// Queries are grouped (b, kv, g·t, hd), keys and values (b, kv, t, hd), causal.
#[derive(Clone, Copy, Debug)]
pub struct Att {
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

/// Attention's forward pass on grouped queries q, keys k and values v: each query row's
/// log-sum-exp of its scaled, causally masked scores (b, kv, g·t) — what the tape keeps of P,
/// which every later pass recomputes — and O = P V (b, kv, g·t, hd). One rayon task per group.
pub fn attn_fwd<T: El>(at: Att, q: &[T], k: &[T], v: &[T]) -> (Vec<T>, Vec<T>) {
    let (gt, qs, ks, ps) = at.sizes();
    let (t, hd) = (at.t, at.hd);
    let groups = at.b * at.kv;
    let mut lse = vec![T::zero(); groups * gt];
    let mut o = vec![T::zero(); groups * qs];
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
    });
    (lse, o)
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
fn group_adjoints<T: El>(at: Att, f: impl Fn(usize, &mut [T], &mut [T], &mut [T]) + Sync) -> (Vec<T>, Vec<T>, Vec<T>) {
    let (_, qs, ks, _) = at.sizes();
    let groups = at.b * at.kv;
    let (mut gq, mut gk, mut gv) =
        (vec![T::zero(); groups * qs], vec![T::zero(); groups * ks], vec![T::zero(); groups * ks]);
    gq.par_chunks_mut(qs)
        .zip(gk.par_chunks_mut(ks))
        .zip(gv.par_chunks_mut(ks))
        .enumerate()
        .for_each(|(i, ((gq, gk), gv))| f(i, gq, gk, gv));
    (gq, gk, gv)
}

/// Attention's backward pass from Ō = ∂ℓ/∂O (and D = ⟨Ō, O⟩ per query row, (b, kv, g·t)):
/// with S̄ = c P ⊙ (Ō Vᵀ − D), Q̄ = S̄ K, K̄ = S̄ᵀ Q, V̄ = Pᵀ Ō: (Q̄, K̄, V̄).
#[allow(clippy::type_complexity)]
pub fn attn_bwd<T: El>(
    at: Att,
    (q, k, v, lse, d): (&[T], &[T], &[T], &[T], &[T]),
    go: &[T],
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let (gt, qs, ks, ps) = at.sizes();
    let (t, hd) = (at.t, at.hd);
    group_adjoints(at, |i, gq: &mut [T], gk, gv| {
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
}

/// Attention's tangent along (Q̇, K̇, V̇): with Ṗ = P ⊙ Z ([`score_tangent`]'s Z),
/// Ȯ = Ṗ V + P V̇ (b, kv, g·t, hd).
#[allow(clippy::type_complexity)]
pub fn attn_tan<T: El>(at: Att, (q, k, v, lse): (&[T], &[T], &[T], &[T]), (qd, kd, vd): (&[T], &[T], &[T])) -> Vec<T> {
    let (gt, qs, ks, ps) = at.sizes();
    let (t, hd) = (at.t, at.hd);
    let groups = at.b * at.kv;
    let mut od = vec![T::zero(); groups * qs];
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
    });
    od
}

/// The recorded attention's values for [`attn_tan_bwd`]: Q, K, V, the log-sum-exps, D, Ō.
pub type AttSaved<'a, T> = (&'a [T], &'a [T], &'a [T], &'a [T], &'a [T], &'a [T]);

/// The tangent of [`attn_bwd`] given Ō̇ and Ḋ = ⟨Ō̇, O⟩ + ⟨Ō, Ȯ⟩: P̄̇ = Ō̇ Vᵀ + Ō V̇ᵀ,
/// S̄̇ = Z ⊙ S̄ + c P ⊙ (P̄̇ − Ḋ) (with Ṗ = P ⊙ Z, Ṗ ⊙ (P̄ − D) = Z ⊙ S̄/c), then
/// Q̄̇ = S̄̇ K + S̄ K̇, K̄̇ = S̄̇ᵀ Q + S̄ᵀ Q̇, V̄̇ = Ṗᵀ Ō + Pᵀ Ō̇: (Q̄̇, K̄̇, V̄̇). P and S̄ are
/// recomputed, and Z ([`score_tangent`]). `tan` is (Q̇, K̇, V̇, Ḋ).
#[allow(clippy::type_complexity)]
pub fn attn_tan_bwd<T: El>(
    at: Att,
    (q, k, v, lse, d, go): AttSaved<'_, T>,
    (qd, kd, vd, dd): (&[T], &[T], &[T], &[T]),
    god: &[T],
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let (gt, qs, ks, ps) = at.sizes();
    let (t, hd) = (at.t, at.hd);
    group_adjoints(at, |i, gqd: &mut [T], gkd, gvd| {
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
pub fn mlp_out<T: El>(g: &[T], u: &[T]) -> Vec<T> {
    let mut out = vec![T::zero(); g.len()];
    out.par_chunks_mut(CHUNK).enumerate().for_each(|(i, o)| {
        let at = i * CHUNK;
        for (j, o) in o.iter_mut().enumerate() {
            *o = silu3(g[at + j]).0 * u[at + j];
        }
    });
    out
}

/// The MLP's tangent ȧ = silu′(g) ġ ⊙ u + silu(g) ⊙ u̇ (σ(g) recomputed).
pub fn mlp_tan<T: El>(g: &[T], u: &[T], gd: &[T], ud: &[T]) -> Vec<T> {
    let mut out = vec![T::zero(); g.len()];
    out.par_chunks_mut(CHUNK).enumerate().for_each(|(i, o)| {
        let at = i * CHUNK;
        for (j, o) in o.iter_mut().enumerate() {
            let (silu, d1, _) = silu3(g[at + j]);
            *o = d1 * gd[at + j] * u[at + j] + silu * ud[at + j];
        }
    });
    out
}

/// The MLP's backward from ā = ∂ℓ/∂a: (ḡ = ā ⊙ u ⊙ silu′(g), ū = ā ⊙ silu(g)).
pub fn mlp_bwd<T: El>(g: &[T], u: &[T], ga: &[T]) -> (Vec<T>, Vec<T>) {
    let n = g.len();
    let (mut gg, mut gu) = (vec![T::zero(); n], vec![T::zero(); n]);
    gg.par_chunks_mut(CHUNK).zip(gu.par_chunks_mut(CHUNK)).enumerate().for_each(|(i, (gg, gu))| {
        let at = i * CHUNK;
        for (j, (gg, gu)) in gg.iter_mut().zip(gu.iter_mut()).enumerate() {
            let (silu, d1, _) = silu3(g[at + j]);
            *gg = ga[at + j] * u[at + j] * d1;
            *gu = ga[at + j] * silu;
        }
    });
    (gg, gu)
}

/// The tangent of [`mlp_bwd`] along (ġ, u̇) with ā̇ = `gad`: ḡ̇ = (ā̇ ⊙ u + ā ⊙ u̇) ⊙ silu′ +
/// ā ⊙ u ⊙ silu″ ⊙ ġ, ū̇ = ā̇ ⊙ silu + ā ⊙ silu′ ⊙ ġ.
pub fn mlp_tan_bwd<T: El>(g: &[T], u: &[T], ga: &[T], gad: &[T], gd: &[T], ud: &[T]) -> (Vec<T>, Vec<T>) {
    let n = g.len();
    let (mut gg, mut gu) = (vec![T::zero(); n], vec![T::zero(); n]);
    gg.par_chunks_mut(CHUNK).zip(gu.par_chunks_mut(CHUNK)).enumerate().for_each(|(i, (gg, gu))| {
        let at = i * CHUNK;
        for (j, (gg, gu)) in gg.iter_mut().zip(gu.iter_mut()).enumerate() {
            let x = at + j;
            let (silu, d1, d2) = silu3(g[x]);
            *gg = (gad[x] * u[x] + ga[x] * ud[x]) * d1 + ga[x] * u[x] * d2 * gd[x];
            *gu = gad[x] * silu + ga[x] * d1 * gd[x];
        }
    });
    (gg, gu)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn draw(n: usize, seed: u64) -> Vec<f64> {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| r.random_range(-1.0..1.0)).collect()
    }

    fn err(a: &[f64], b: &[f64]) -> f64 {
        assert_eq!(a.len(), b.len());
        a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
    }

    /// d/dε f(ε) at 0 by central differences.
    fn fd(f: impl Fn(f64) -> Vec<f64>) -> Vec<f64> {
        let h = 1e-6;
        f(h).iter().zip(f(-h)).map(|(a, b)| (a - b) / (2.0 * h)).collect()
    }

    /// x + ε d.
    fn at(x: &[f64], d: &[f64], e: f64) -> Vec<f64> {
        x.iter().zip(d).map(|(x, d)| x + e * d).collect()
    }

    /// x yᵀ for row-major x (m × k), y (n × k), by the definition.
    fn xyt(x: &[f64], y: &[f64], k: usize) -> Vec<f64> {
        let (m, n) = (x.len() / k, y.len() / k);
        (0..m * n).map(|i| (0..k).map(|l| x[i / n * k + l] * y[i % n * k + l]).sum()).collect()
    }

    /// The transpose of row-major (·, cols).
    fn tr(x: &[f64], cols: usize) -> Vec<f64> {
        let rows = x.len() / cols;
        (0..x.len()).map(|i| x[(i % rows) * cols + i / rows]).collect()
    }

    /// Σ x ⊙ y.
    fn inner(x: &[f64], y: &[f64]) -> f64 {
        x.iter().zip(y).map(|(a, b)| a * b).sum()
    }

    /// The linear layer's four passes: the forward against x Wᵀ + b + s (x Aᵀ) Bᵀ, the backward
    /// against the gradient of ⟨g, y⟩ by central differences, the tangents against central
    /// differences of the forward and the backward along (ẋ, Ȧ, Ḃ, ġ). Negative controls: the
    /// adapter's term and the tangent's Ȧ term are visible.
    #[test]
    fn linear_passes_match_their_definitions() {
        let d @ LinDims { rows, inp, out } = LinDims { rows: 5, inp: 6, out: 4 };
        let (r, s, th) = (3, 0.7, 2);
        let (x, w, bias) = (draw(rows * inp, 1), draw(out * inp, 2), draw(out, 3));
        let (a, b, av, bv) = (draw(r * inp, 4), draw(out * r, 5), draw(r * inp, 6), draw(out * r, 7));
        let (xd, g, gd) = (draw(rows * inp, 8), draw(rows * out, 9), draw(rows * out, 10));
        let naive = |x: &[f64], a: &[f64], b: &[f64]| -> Vec<f64> {
            let (xw, xab) = (xyt(x, &w, inp), xyt(&xyt(x, a, inp), b, r));
            (0..rows * out).map(|i| xw[i] + bias[i % out] + s * xab[i]).collect()
        };
        let ad = |a: &'static [f64], b: &'static [f64]| Adapter { a, b, r, s };
        let leak = |v: &Vec<f64>| -> &'static [f64] { Box::leak(v.clone().into_boxed_slice()) };
        let (y, xa) = lin_fwd(d, &x, &w, Some(&bias), Some(ad(leak(&a), leak(&b))), th);
        let xa = xa.unwrap();
        assert!(err(&y, &naive(&x, &a, &b)) < 1e-12 && err(&xa, &xyt(&x, &a, inp)) < 1e-12, "forward");
        let (plain, none) = lin_fwd(d, &x, &w, Some(&bias), None, th);
        assert!(none.is_none() && err(&plain, &y) > 1e-2, "negative control: the adapter's term is invisible");
        // backward: ∂⟨g, y⟩ one coordinate at a time
        let grad = |which: usize, len: usize| -> Vec<f64> {
            (0..len)
                .map(|i| {
                    fd(|e| {
                        let mut xs = [x.clone(), a.clone(), b.clone()];
                        xs[which][i] += e;
                        vec![inner(&g, &naive(&xs[0], &xs[1], &xs[2]))]
                    })[0]
                })
                .collect()
        };
        let (gx, grads, gb) = lin_bwd(d, &g, Some(&w), Some((ad(leak(&a), leak(&b)), &x[..], &xa[..])), th);
        let ((da, db), gb, gx) = (grads.unwrap(), gb.unwrap(), gx.unwrap());
        assert!(err(&gx, &grad(0, x.len())) < 1e-7, "∂x");
        assert!(err(&da, &grad(1, a.len())) < 1e-7 && err(&db, &grad(2, b.len())) < 1e-7, "∂A, ∂B");
        assert!(err(&gb, &xyt(&g, &tr(&b, r), out)) < 1e-12, "g B");
        // tangents along (ẋ, Ȧ, Ḃ) and ġ
        let tan = AdTan { ad: ad(leak(&a), leak(&b)), x: &x, xa: &xa, av: &av, bv: &bv };
        let (yd, xad) = lin_tan(d, &xd, &w, Some(tan), th);
        let xad = xad.unwrap();
        assert!(err(&yd, &fd(|e| naive(&at(&x, &xd, e), &at(&a, &av, e), &at(&b, &bv, e)))) < 1e-7, "ẏ");
        assert!(err(&xad, &fd(|e| xyt(&at(&x, &xd, e), &at(&a, &av, e), inp))) < 1e-7, "(x Aᵀ)˙");
        let bwd_at = |e: f64, part: usize| -> Vec<f64> {
            let (xe, ae, be, ge) = (at(&x, &xd, e), at(&a, &av, e), at(&b, &bv, e), at(&g, &gd, e));
            let xae = xyt(&xe, &ae, inp);
            let (gx, grads, _) = lin_bwd(d, &ge, Some(&w), Some((ad(leak(&ae), leak(&be)), &xe[..], &xae[..])), th);
            let (da, db) = grads.unwrap();
            [gx.unwrap(), da, db][part].clone()
        };
        let (gxd, grads) = lin_tan_bwd(d, &gd, Some(&w), Some((tan, (&xd[..], &xad[..]), (&g[..], &gb[..]))), th);
        let (dad, dbd) = grads.unwrap();
        for (part, got) in [gxd.unwrap(), dad, dbd].iter().enumerate() {
            assert!(err(got, &fd(|e| bwd_at(e, part))) < 1e-7, "the backward's tangent, part {part}");
        }
        let still = AdTan { av: &vec![0.0; av.len()], ..tan };
        let (off, _) = lin_tan_bwd(d, &gd, Some(&w), Some((still, (&xd[..], &xad[..]), (&g[..], &gb[..]))), th);
        assert!(err(&off.unwrap(), &fd(|e| bwd_at(e, 0))) > 1e-3, "negative control: Ȧ's term is invisible");
    }

    /// Grouped attention written out from its definition (f64), causal or not: (log-sum-exps, O).
    fn naive_attn(geo: Att, q: &[f64], k: &[f64], v: &[f64], causal: bool) -> (Vec<f64>, Vec<f64>) {
        let Att { b, kv, g, t, hd } = geo;
        let (mut lse, mut o) = (vec![], vec![]);
        for grp in 0..b * kv {
            for row in 0..g * t {
                let qi = &q[(grp * g * t + row) * hd..][..hd];
                let n = if causal { row % t + 1 } else { t };
                let sc: Vec<f64> =
                    (0..n).map(|j| inner(qi, &k[(grp * t + j) * hd..][..hd]) / (hd as f64).sqrt()).collect();
                let z: f64 = sc.iter().map(|x| x.exp()).sum();
                lse.push(z.ln());
                for di in 0..hd {
                    o.push((0..n).map(|j| sc[j].exp() / z * v[(grp * t + j) * hd + di]).sum());
                }
            }
        }
        (lse, o)
    }

    /// ⟨Ō, O⟩ per query row.
    fn row_dots(go: &[f64], o: &[f64], hd: usize) -> Vec<f64> {
        go.chunks(hd).zip(o.chunks(hd)).map(|(a, b)| inner(a, b)).collect()
    }

    /// Attention's four passes against the definition and central differences: the forward's
    /// values and log-sum-exps, the backward as the gradient of ⟨Ō, O⟩, the tangent of O and the
    /// tangent of the backward. Negative controls: the causal mask and Ḋ are visible.
    #[test]
    fn attention_passes_match_their_definitions() {
        let geo = Att { b: 2, kv: 2, g: 2, t: 4, hd: 3 };
        let Att { b, kv, g, t, hd } = geo;
        let (nq, nk) = (b * kv * g * t * hd, b * kv * t * hd);
        let (q, k, v, go) = (draw(nq, 11), draw(nk, 12), draw(nk, 13), draw(nq, 14));
        let (qd, kd, vd, god) = (draw(nq, 15), draw(nk, 16), draw(nk, 17), draw(nq, 18));
        let (lse, o) = attn_fwd(geo, &q, &k, &v);
        let (wl, wo) = naive_attn(geo, &q, &k, &v, true);
        assert!(err(&lse, &wl) < 1e-13 && err(&o, &wo) < 1e-13, "forward");
        let unmasked = naive_attn(geo, &q, &k, &v, false).1;
        assert!(err(&unmasked, &o) > 1e-2, "negative control: the mask is invisible");
        let d = row_dots(&go, &o, hd);
        let (gq, gk, gv) = attn_bwd(geo, (&q, &k, &v, &lse, &d), &go);
        for (which, got) in [(0, &gq), (1, &gk), (2, &gv)] {
            let want: Vec<f64> = (0..got.len())
                .map(|i| {
                    fd(|e| {
                        let mut xs = [q.clone(), k.clone(), v.clone()];
                        xs[which][i] += e;
                        vec![inner(&go, &naive_attn(geo, &xs[0], &xs[1], &xs[2], true).1)]
                    })[0]
                })
                .collect();
            assert!(err(got, &want) < 1e-7, "backward, input {which}: {:e}", err(got, &want));
        }
        let od = attn_tan(geo, (&q, &k, &v, &lse), (&qd, &kd, &vd));
        assert!(
            err(&od, &fd(|e| naive_attn(geo, &at(&q, &qd, e), &at(&k, &kd, e), &at(&v, &vd, e), true).1)) < 1e-7,
            "Ȯ"
        );
        let dd: Vec<f64> = row_dots(&god, &o, hd).iter().zip(row_dots(&go, &od, hd)).map(|(a, b)| a + b).collect();
        let bwd_at = |e: f64, part: usize| -> Vec<f64> {
            let (qe, ke, ve, goe) = (at(&q, &qd, e), at(&k, &kd, e), at(&v, &vd, e), at(&go, &god, e));
            let (lse, o) = attn_fwd(geo, &qe, &ke, &ve);
            let d = row_dots(&goe, &o, hd);
            let (a, b, c) = attn_bwd(geo, (&qe, &ke, &ve, &lse, &d), &goe);
            [a, b, c][part].clone()
        };
        let saved = (&q[..], &k[..], &v[..], &lse[..], &d[..], &go[..]);
        let (gqd, gkd, gvd) = attn_tan_bwd(geo, saved, (&qd, &kd, &vd, &dd), &god);
        for (part, got) in [gqd, gkd, gvd].iter().enumerate() {
            let want = fd(|e| bwd_at(e, part));
            assert!(err(got, &want) < 1e-7, "the backward's tangent, part {part}: {:e}", err(got, &want));
        }
        let (off, _, _) = attn_tan_bwd(geo, saved, (&qd, &kd, &vd, &vec![0.0; dd.len()]), &god);
        assert!(err(&off, &fd(|e| bwd_at(e, 0))) > 1e-3, "negative control: Ḋ is invisible");
    }

    /// The MLP's passes against silu(g) ⊙ u and central differences, over more than one task's
    /// chunk. Negative control: the tangent of the backward without ġ's terms is far off.
    #[test]
    fn mlp_passes_match_their_definitions() {
        let n = CHUNK + 100;
        let (g, u, ga) = (draw(n, 21).iter().map(|x| 4.0 * x).collect::<Vec<_>>(), draw(n, 22), draw(n, 23));
        let (gd, ud, gad) = (draw(n, 24), draw(n, 25), draw(n, 26));
        let want: Vec<f64> = g.iter().zip(&u).map(|(&x, &u)| x / (1.0 + (-x).exp()) * u).collect();
        assert!(err(&mlp_out(&g, &u), &want) < 1e-14, "a");
        assert!(err(&mlp_tan(&g, &u, &gd, &ud), &fd(|e| mlp_out(&at(&g, &gd, e), &at(&u, &ud, e)))) < 1e-7, "ȧ");
        let ones = vec![1.0; n];
        let (gg, gu) = mlp_bwd(&g, &u, &ga);
        let dg: Vec<f64> = fd(|e| mlp_out(&at(&g, &ones, e), &u)).iter().zip(&ga).map(|(a, b)| a * b).collect();
        let du: Vec<f64> = fd(|e| mlp_out(&g, &at(&u, &ones, e))).iter().zip(&ga).map(|(a, b)| a * b).collect();
        assert!(err(&gg, &dg) < 1e-7 && err(&gu, &du) < 1e-7, "ḡ, ū");
        let (ggd, gud) = mlp_tan_bwd(&g, &u, &ga, &gad, &gd, &ud);
        let bwd_at = |e: f64, part: usize| {
            let (a, b) = mlp_bwd(&at(&g, &gd, e), &at(&u, &ud, e), &at(&ga, &gad, e));
            [a, b][part].clone()
        };
        assert!(err(&ggd, &fd(|e| bwd_at(e, 0))) < 1e-7 && err(&gud, &fd(|e| bwd_at(e, 1))) < 1e-7, "the tangents");
        let (off, _) = mlp_tan_bwd(&g, &u, &ga, &gad, &vec![0.0; n], &ud);
        assert!(err(&off, &ggd) > 1e-2, "negative control: ġ's terms are invisible");
    }
}
