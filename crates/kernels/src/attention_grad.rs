//! Grouped-query causal attention for the training path, forward and backward, in f32 and f64
//! (`policy::attention` wraps it as one candle op): y = softmax(c q kᵀ + mask) v per query head,
//! query head j reading key/value head j / g, c = 1/√d.
//!
//! The forward keeps one log-sum-exp per query row and the backward recomputes the
//! probabilities from them (as FlashAttention does, Dao et al. 2022, Alg. 2's recomputation).
//! Per (batch, kv head) the g query heads are one (g·t × d) block, one rayon task, and every
//! product is one `gemm` call on that task's thread ([`crate::dense`]; the masked scores are
//! computed and zeroed: dense products ran faster than skipping them row by row).
//!
//! The maths, per query row i (position p + i of s = p + t keys; it sees keys 0..=p + i):
//! sⱼ = c qᵢ·kⱼ, L = m + ln Σⱼ e^{sⱼ − m} (m = maxⱼ sⱼ), Pⱼ = e^{sⱼ − L}, yᵢ = Σⱼ Pⱼ vⱼ.
//! Backward, with dy: dPⱼ = dy·vⱼ, D = dy·yᵢ (= Σⱼ Pⱼ dPⱼ), dSⱼ = Pⱼ (dPⱼ − D),
//! dqᵢ = c Σⱼ dSⱼ kⱼ, dkⱼ += c dSⱼ qᵢ, dvⱼ += Pⱼ dy.

use crate::dense::{mm, Mat};
use crate::rows_grad::ExpRow;
use rayon::prelude::*;

/// Attention's shape: q (b, h, t, d) over keys and values (b, kv, s, d), s ≥ t, h a multiple
/// of kv.
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    pub b: usize,
    pub h: usize,
    pub kv: usize,
    pub t: usize,
    pub s: usize,
    pub d: usize,
}

/// What the backward pass reads: q, keys, values, the output and its gradient.
pub type Saved<'a, T> = (&'a [T], &'a [T], &'a [T], &'a [T], &'a [T]);

/// Keys row r of a group's (g·t) query rows sees: 0..s − t + (r mod t) + 1.
fn visible(r: usize, t: usize, s: usize) -> usize {
    s - t + r % t + 1
}

/// y and the log-sum-exps for one (batch, kv head): its g query heads as one (g·t × d) block.
fn forward_group<T: ExpRow>(dims: Dims, q: &[T], k: &[T], v: &[T], y: &mut [T], lse: &mut [f64]) {
    let Dims { h, kv, t, s, d, .. } = dims;
    let rows = h / kv * t;
    let c = T::from(1.0 / (d as f64).sqrt()).unwrap_or_else(T::one);
    let mut p = vec![T::zero(); rows * s];
    mm(rows, s, d, &mut p, Mat::rows(q, d), Mat::t(k, d), c);
    for (r, pr) in p.chunks_exact_mut(s).enumerate() {
        let n = visible(r, t, s);
        let m = pr[..n].iter().fold(T::neg_infinity(), |a, &b| a.max(b));
        pr[..n].iter_mut().for_each(|e| *e = *e - m);
        T::exp_row(&mut pr[..n]);
        let l = pr[..n].iter().fold(T::zero(), |a, &e| a + e);
        let inv = T::one() / l;
        pr[..n].iter_mut().for_each(|e| *e = *e * inv);
        pr[n..].iter_mut().for_each(|e| *e = T::zero());
        lse[r] = (m + l.ln()).to_f64().unwrap_or(f64::NAN);
    }
    mm(rows, d, s, y, Mat::rows(&p, s), Mat::rows(v, d), T::one());
}

/// dq of the group's query heads, dk and dv of its kv head.
fn backward_group<T: ExpRow>(
    dims: Dims,
    (q, k, v, y, dy): Saved<'_, T>,
    lse: &[f64],
    dq: &mut [T],
    dk: &mut [T],
    dv: &mut [T],
) {
    let Dims { h, kv, t, s, d, .. } = dims;
    let rows = h / kv * t;
    let c = T::from(1.0 / (d as f64).sqrt()).unwrap_or_else(T::one);
    let (mut p, mut ds) = (vec![T::zero(); rows * s], vec![T::zero(); rows * s]);
    // P recomputed from the scores and the forward's log-sum-exps
    mm(rows, s, d, &mut p, Mat::rows(q, d), Mat::t(k, d), c);
    // dP = dy vᵀ
    mm(rows, s, d, &mut ds, Mat::rows(dy, d), Mat::t(v, d), T::one());
    for (r, (pr, dr)) in p.chunks_exact_mut(s).zip(ds.chunks_exact_mut(s)).enumerate() {
        let n = visible(r, t, s);
        let l = T::from(lse[r]).unwrap_or_else(T::nan);
        let dd = dy[r * d..(r + 1) * d].iter().zip(&y[r * d..(r + 1) * d]).fold(T::zero(), |a, (&x, &w)| a + x * w);
        pr[..n].iter_mut().for_each(|e| *e = *e - l);
        T::exp_row(&mut pr[..n]);
        for (e, g) in pr[..n].iter().zip(dr[..n].iter_mut()) {
            *g = *e * (*g - dd) * c;
        }
        pr[n..].iter_mut().for_each(|e| *e = T::zero());
        dr[n..].iter_mut().for_each(|e| *e = T::zero());
    }
    mm(rows, d, s, dq, Mat::rows(&ds, s), Mat::rows(k, d), T::one());
    mm(s, d, rows, dk, Mat::t(&ds, s), Mat::rows(q, d), T::one());
    mm(s, d, rows, dv, Mat::t(&p, s), Mat::rows(dy, d), T::one());
}

/// The attention of `q` (b, h, t, d) over `k` and `v` (b, kv, s, d): query i sits at position
/// s − t + i and attends keys 0..=s − t + i (a prefix of s − t positions, then causally).
/// Returns y (b, h, t, d) and the log-sum-exp of each query row's scores (b, h, t), which the
/// backward pass reads. One rayon task per (batch, kv head).
pub fn causal_attention<T: ExpRow>(dims: Dims, q: &[T], k: &[T], v: &[T]) -> (Vec<T>, Vec<f64>) {
    let Dims { b, h, kv, t, s, d } = dims;
    let g = h / kv;
    let mut y = vec![T::zero(); b * h * t * d];
    let mut lse = vec![0f64; b * h * t];
    y.par_chunks_mut(g * t * d).zip(lse.par_chunks_mut(g * t)).enumerate().for_each(|(i, (y, lse))| {
        let qs = &q[i * g * t * d..(i + 1) * g * t * d];
        let (ks, vs) = (&k[i * s * d..(i + 1) * s * d], &v[i * s * d..(i + 1) * s * d]);
        forward_group(dims, qs, ks, vs, y, lse);
    });
    (y, lse)
}

/// [`causal_attention`]'s gradients (dq, dk, dv) at dy, the probabilities recomputed from the
/// forward's log-sum-exps `lse`. One rayon task per (batch, kv head).
pub fn causal_attention_grad<T: ExpRow>(
    dims: Dims,
    (q, k, v, y, dy): Saved<'_, T>,
    lse: &[f64],
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let Dims { b, h, kv, t, s, d } = dims;
    let g = h / kv;
    let (gt, sd) = (g * t * d, s * d);
    let mut dq = vec![T::zero(); b * h * t * d];
    let mut dk = vec![T::zero(); b * kv * s * d];
    let mut dv = vec![T::zero(); b * kv * s * d];
    dq.par_chunks_mut(gt).zip(dk.par_chunks_mut(sd)).zip(dv.par_chunks_mut(sd)).enumerate().for_each(
        |(i, ((dq, dk), dv))| {
            let r = i * gt..(i + 1) * gt;
            let kv = i * sd..(i + 1) * sd;
            let parts = (&q[r.clone()], &k[kv.clone()], &v[kv], &y[r.clone()], &dy[r]);
            backward_group(dims, parts, &lse[i * g * t..(i + 1) * g * t], dq, dk, dv);
        },
    );
    (dq, dk, dv)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Attention written out from its definition, one score at a time (f64): query i of t at
    /// position `offset` + i sees keys 0..=offset + i.
    fn naive(q: &[f64], k: &[f64], v: &[f64], dims: Dims, offset: usize) -> Vec<f64> {
        let Dims { b, h, kv, t, s, d } = dims;
        let mut y = vec![0.0; b * h * t * d];
        for bi in 0..b {
            for hi in 0..h {
                let kh = hi / (h / kv);
                for i in 0..t {
                    let qi = &q[((bi * h + hi) * t + i) * d..][..d];
                    let key = |j: usize| &k[((bi * kv + kh) * s + j) * d..][..d];
                    let val = |j: usize| &v[((bi * kv + kh) * s + j) * d..][..d];
                    let n = (offset + i + 1).min(s);
                    let sc: Vec<f64> = (0..n)
                        .map(|j| qi.iter().zip(key(j)).map(|(a, b)| a * b).sum::<f64>() / (d as f64).sqrt())
                        .collect();
                    let z: f64 = sc.iter().map(|x| x.exp()).sum();
                    for (j, x) in sc.iter().enumerate() {
                        for di in 0..d {
                            y[((bi * h + hi) * t + i) * d + di] += x.exp() / z * val(j)[di];
                        }
                    }
                }
            }
        }
        y
    }

    fn err(a: &[f64], b: &[f64]) -> f64 {
        a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
    }

    /// The values and the gradients (of Σ w ⊙ y, w random) against the definition and its
    /// central differences, in f64, with grouped heads and a prefix (s > t). Negative control:
    /// the definition without the prefix's offset (plain causal over s) is far off.
    #[test]
    fn values_and_gradients_match_the_definition() {
        let dims = Dims { b: 2, h: 4, kv: 2, t: 3, s: 5, d: 4 };
        let Dims { b, h, kv, t, s, d } = dims;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let mut draw = |n: usize| (0..n).map(|_| rng.random_range(-1.0..1.0)).collect::<Vec<f64>>();
        let (q, k, v, w) = (draw(b * h * t * d), draw(b * kv * s * d), draw(b * kv * s * d), draw(b * h * t * d));
        let (y, lse) = causal_attention(dims, &q, &k, &v);
        let want = naive(&q, &k, &v, dims, s - t);
        assert!(err(&y, &want) < 1e-13, "values: {:e}", err(&y, &want));
        let off = err(&naive(&q, &k, &v, dims, 0), &want);
        assert!(off > 1e-2, "negative control: the prefix offset is invisible ({off:e})");
        let (dq, dk, dv) = causal_attention_grad(dims, (&q, &k, &v, &y, &w), &lse);
        let loss = |q: &[f64], k: &[f64], v: &[f64]| {
            naive(q, k, v, dims, s - t).iter().zip(&w).map(|(a, b)| a * b).sum::<f64>()
        };
        let eps = 1e-6;
        let mut worst = 0f64;
        for (which, g) in [(0, &dq), (1, &dk), (2, &dv)] {
            let base = [&q, &k, &v][which];
            for i in 0..base.len() {
                let at = |x: f64| {
                    let mut xs = [q.clone(), k.clone(), v.clone()];
                    xs[which][i] = x;
                    loss(&xs[0], &xs[1], &xs[2])
                };
                let fd = (at(base[i] + eps) - at(base[i] - eps)) / (2.0 * eps);
                worst = worst.max((fd - g[i]).abs());
            }
            assert!(g.iter().any(|x| *x != 0.0), "input {which}: a zero gradient");
        }
        assert!(worst < 1e-8, "gradients against central differences: {worst:e}");
    }

    /// f32 gives the f64 values to f32 precision, and the same bits on one thread and on two.
    #[test]
    fn f32_is_close_to_f64_and_does_not_depend_on_the_threads() {
        let dims = Dims { b: 2, h: 9, kv: 3, t: 40, s: 40, d: 64 };
        let Dims { b, h, kv, t, s, d } = dims;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        let mut draw = |n: usize| (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect::<Vec<f32>>();
        let (q, k, v) = (draw(b * h * t * d), draw(b * kv * s * d), draw(b * kv * s * d));
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| causal_attention(dims, &q, &k, &v).0)
        };
        let (one, two) = (run(1), run(2));
        assert_eq!(one, two, "the thread count changed a bit");
        let f = |x: &[f32]| x.iter().map(|&a| a as f64).collect::<Vec<f64>>();
        let want = naive(&f(&q), &f(&k), &f(&v), dims, s - t);
        assert!(err(&f(&one), &want) < 1e-5, "f32 against f64: {:e}", err(&f(&one), &want));
    }
}
