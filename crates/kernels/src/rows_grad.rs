//! The training path's fused row kernels, forward and backward, in f32 and f64 (`policy::ops`
//! wraps them as candle custom ops): RMSNorm, the head layout with RoPE, SwiGLU's silu(g)·u,
//! and e^x on a row for either type ([`ExpRow`]). Each works row by row (or chunk by chunk) on
//! rayon's pool and writes its gradient out in one pass, where candle's composed ops took a
//! dozen passes over every activation.

use num_traits::Float;
use rayon::prelude::*;

/// e^x in place over a row.
pub trait ExpRow: Float + Send + Sync + 'static {
    fn exp_row(x: &mut [Self]);
}

impl ExpRow for f32 {
    /// The vectorised kernel of the inference path ([`crate::rows::exp_in_place`]: relative
    /// error < 3e-7): libm's scalar `expf` was 7% of an f32 training step (attention's softmax
    /// forward and recomputed in the backward, SwiGLU's sigmoid).
    fn exp_row(x: &mut [f32]) {
        crate::rows::exp_in_place(x)
    }
}

impl ExpRow for f64 {
    /// libm: the f64 path is the exact gradient checks'.
    fn exp_row(x: &mut [f64]) {
        x.iter_mut().for_each(|v| *v = v.exp())
    }
}

/// RMSNorm y = x / m · w per row of d = w.len() values, m = (Σ x² / d + ε)^{½}: candle's
/// RMSNorm kernel's arithmetic (Σ x² in order), so in f32 the same values as candle's.
pub fn rms_norm<T: Float + Send + Sync>(x: &[T], w: &[T], eps: f64) -> Vec<T> {
    let eps = T::from(eps).unwrap_or_else(T::zero);
    let d = w.len();
    let mut y = vec![T::zero(); x.len()];
    y.par_chunks_mut(d).zip(x.par_chunks(d)).with_min_len(16).for_each(|(y, x)| {
        let ss = x.iter().fold(T::zero(), |a, &v| a + v * v);
        let m = (ss / T::from(d).unwrap_or_else(T::one) + eps).sqrt();
        y.iter_mut().zip(x).zip(w).for_each(|((y, &x), &w)| *y = x / m * w);
    });
    y
}

/// [`rms_norm`]'s gradient of x at ∂L/∂y = g, one pass per row: with r = (Σ x² / d + ε)^{-½},
/// ∂L/∂x = r (w ⊙ g) − x r³ ⟨w ⊙ g, x⟩ / d.
pub fn rms_norm_grad<T: Float + Send + Sync>(x: &[T], g: &[T], w: &[T], eps: f64) -> Vec<T> {
    let eps = T::from(eps).unwrap_or_else(T::zero);
    let d = w.len();
    let dn = T::from(d).unwrap_or_else(T::one);
    let mut dx = vec![T::zero(); x.len()];
    dx.par_chunks_mut(d).zip(x.par_chunks(d).zip(g.par_chunks(d))).with_min_len(16).for_each(|(dx, (x, g))| {
        let ss = x.iter().fold(T::zero(), |a, &v| a + v * v);
        let r = T::one() / (ss / dn + eps).sqrt();
        let dot = x.iter().zip(g).zip(w).fold(T::zero(), |a, ((&x, &g), &w)| a + w * g * x);
        let c = r * r * r * dot / dn;
        dx.iter_mut().zip(x).zip(g.iter().zip(w)).for_each(|((o, &x), (&g, &w))| *o = r * w * g - x * c);
    });
    dx
}

/// The rotation of one head's row: pairs (x_i, x_{i+hd/2}) (rotate-half) or (x_{2i}, x_{2i+1})
/// (interleaved), each turned by its angle, (a, b) ↦ (a c − b s, a s + b c) — candle's RoPE
/// kernels' arithmetic, in their order — with `sin` negated for the inverse rotation.
#[inline]
fn turn_row<T: Float>(src: &[T], dst: &mut [T], cos: &[T], sin: &[T], interleaved: bool, inverse: bool) {
    let half = cos.len();
    for i in 0..half {
        let (c, s) = (cos[i], if inverse { -sin[i] } else { sin[i] });
        let (ia, ib) = if interleaved { (2 * i, 2 * i + 1) } else { (i, i + half) };
        let (a, b) = (src[ia], src[ib]);
        dst[ia] = a * c - b * s;
        dst[ib] = a * s + b * c;
    }
}

/// A projection's rows (b·t, n·hd) as heads (b, n, t, hd) (`to_heads`) or back, each head's
/// row turned on the way by RoPE when `rope` gives its tables (cos, sin: (t, hd/2)) and the
/// layout (interleaved or rotate-half) — by the inverse rotation with `inverse`. A permutation
/// and a rotation, so the gradient of either direction is the other with the inverse rotation.
pub fn heads<T: Float + Send + Sync>(
    (b, t, n, hd): (usize, usize, usize, usize),
    src: &[T],
    rope: Option<(&[T], &[T], bool)>,
    to_heads: bool,
    inverse: bool,
) -> Vec<T> {
    let half = hd / 2;
    let mut dst = vec![T::zero(); b * t * n * hd];
    let rot = |src: &[T], dst: &mut [T], pos: usize| match rope {
        Some((c, s, interleaved)) => {
            turn_row(src, dst, &c[pos * half..][..half], &s[pos * half..][..half], interleaved, inverse)
        }
        None => dst.copy_from_slice(src),
    };
    if to_heads {
        // one task per (sequence, head): its t rows of hd
        dst.par_chunks_mut(t * hd).enumerate().for_each(|(bn, out)| {
            let (bi, ni) = (bn / n, bn % n);
            for (ti, o) in out.chunks_exact_mut(hd).enumerate() {
                rot(&src[((bi * t + ti) * n + ni) * hd..][..hd], o, ti);
            }
        });
    } else {
        // one task per row (sequence, position): its n heads of hd
        dst.par_chunks_mut(n * hd).enumerate().with_min_len(8).for_each(|(bt, out)| {
            let (bi, ti) = (bt / t, bt % t);
            for (ni, o) in out.chunks_exact_mut(hd).enumerate() {
                rot(&src[((bi * n + ni) * t + ti) * hd..][..hd], o, ti);
            }
        });
    }
    dst
}

/// Elements per task of [`silu_mul`]'s and [`silu_mul_grad`]'s passes.
pub const SILU_CHUNK: usize = 1 << 14;

/// e^{−g} of a chunk into `e` (the sigmoid's exponential, on the vectorised kernel).
fn exp_neg<T: ExpRow>(g: &[T], e: &mut [T]) {
    e.iter_mut().zip(g).for_each(|(e, &x)| *e = -x);
    T::exp_row(e);
}

/// SwiGLU's product a = silu(g) ⊙ u, silu(x) = x / (1 + e^{−x}) (candle's silu, then the
/// product), one pass in chunks of [`SILU_CHUNK`].
pub fn silu_mul<T: ExpRow>(g: &[T], u: &[T]) -> Vec<T> {
    let mut a = vec![T::zero(); g.len()];
    a.par_chunks_mut(SILU_CHUNK).enumerate().for_each(|(c, out)| {
        let at = c * SILU_CHUNK;
        let (g, u) = (&g[at..at + out.len()], &u[at..at + out.len()]);
        exp_neg(g, out);
        for ((o, &x), &up) in out.iter_mut().zip(g).zip(u) {
            // candle's silu, x / (1 + e^{−x}), then the product
            *o = x / (T::one() + *o) * up;
        }
    });
    a
}

/// [`silu_mul`]'s gradients at ∂L/∂a = `da`, with σ = σ(g): (∂L/∂g = da ⊙ u ⊙ σ (1 + g (1 − σ)),
/// ∂L/∂u = da ⊙ g σ), one pass.
pub fn silu_mul_grad<T: ExpRow>(g: &[T], u: &[T], da: &[T]) -> (Vec<T>, Vec<T>) {
    let (mut dg, mut du) = (vec![T::zero(); g.len()], vec![T::zero(); g.len()]);
    dg.par_chunks_mut(SILU_CHUNK).zip(du.par_chunks_mut(SILU_CHUNK)).enumerate().for_each(|(c, (dg, du))| {
        let at = c * SILU_CHUNK;
        let (g, u, da) = (&g[at..at + dg.len()], &u[at..at + dg.len()], &da[at..at + dg.len()]);
        exp_neg(g, dg);
        for (i, (dgi, dui)) in dg.iter_mut().zip(du.iter_mut()).enumerate() {
            let (x, up, d) = (g[i], u[i], da[i]);
            let sig = T::one() / (T::one() + *dgi);
            *dgi = d * up * sig * (T::one() + x * (T::one() - sig));
            *dui = d * x * sig;
        }
    });
    (dg, du)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draw(n: usize, s: f64) -> Vec<f64> {
        (0..n).map(|i| (i as f64 * 0.61 + s).sin() * 2.0).collect()
    }

    fn err(a: &[f64], b: &[f64]) -> f64 {
        assert_eq!(a.len(), b.len());
        a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
    }

    /// The gradient of x ↦ Σ c ⊙ f(x) by central differences.
    fn numeric(x: &[f64], c: &[f64], f: impl Fn(&[f64]) -> Vec<f64>) -> Vec<f64> {
        let h = 1e-6;
        let loss = |x: &[f64]| f(x).iter().zip(c).map(|(a, b)| a * b).sum::<f64>();
        (0..x.len())
            .map(|i| {
                let (mut p, mut m) = (x.to_vec(), x.to_vec());
                p[i] += h;
                m[i] -= h;
                (loss(&p) - loss(&m)) / (2.0 * h)
            })
            .collect()
    }

    /// RMSNorm's values against the definition row by row and its gradient against central
    /// differences (f64, rows over several rayon tasks); f32 against a plain sequential loop bit
    /// for bit. Negative control: the gradient without the norm's projection term (r w ⊙ g
    /// alone) is measurably different, so the comparison sees that term.
    #[test]
    fn rms_norm_matches_its_definition_and_gradient() {
        let (rows, d, eps) = (70, 9, 1e-5);
        let (x, w, c) = (draw(rows * d, 0.3), draw(d, 1.1), draw(rows * d, 2.7));
        let want: Vec<f64> = x
            .chunks(d)
            .flat_map(|r| {
                let m = (r.iter().map(|v| v * v).sum::<f64>() / d as f64 + eps).sqrt();
                r.iter().zip(&w).map(move |(x, w)| x / m * w).collect::<Vec<_>>()
            })
            .collect();
        assert!(err(&rms_norm(&x, &w, eps), &want) < 1e-14);
        let g = rms_norm_grad(&x, &c, &w, eps);
        assert!(err(&g, &numeric(&x, &c, |x| rms_norm(x, &w, eps))) < 1e-7);
        let partial: Vec<f64> = (0..rows * d)
            .map(|i| {
                let row = &x[i / d * d..(i / d + 1) * d];
                let r = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / d as f64 + eps).sqrt();
                r * w[i % d] * c[i]
            })
            .collect();
        assert!(err(&partial, &g) > 1e-2, "negative control: the projection term is invisible");
        let (x32, w32): (Vec<f32>, Vec<f32>) =
            (x.iter().map(|&v| v as f32).collect(), w.iter().map(|&v| v as f32).collect());
        let plain: Vec<f32> = x32
            .chunks(d)
            .flat_map(|r| {
                let mut ss = 0f32;
                r.iter().for_each(|v| ss += v * v);
                let m = (ss / d as f32 + eps as f32).sqrt();
                r.iter().zip(&w32).map(move |(x, w)| x / m * w).collect::<Vec<_>>()
            })
            .collect();
        assert_eq!(rms_norm(&x32, &w32, eps), plain);
    }

    /// The head layout against its index definition, with either RoPE layout or none; the
    /// inverse direction with the inverse rotation brings the rows back. Negative control: the
    /// other RoPE layout gives other values.
    #[test]
    fn heads_permute_and_rotate_as_defined() {
        let (b, t, n, hd) = (2, 5, 3, 8);
        let half = hd / 2;
        let angle = draw(t * half, 0.2);
        let cos: Vec<f64> = angle.iter().map(|a| a.cos()).collect();
        let sin: Vec<f64> = angle.iter().map(|a| a.sin()).collect();
        let x = draw(b * t * n * hd, 0.7);
        for rope in [None, Some(false), Some(true)] {
            let tabs = rope.map(|i| (&cos[..], &sin[..], i));
            let y = heads((b, t, n, hd), &x, tabs, true, false);
            for bi in 0..b {
                for ni in 0..n {
                    for ti in 0..t {
                        let src = &x[((bi * t + ti) * n + ni) * hd..][..hd];
                        let got = &y[((bi * n + ni) * t + ti) * hd..][..hd];
                        for i in 0..half {
                            let (ia, ib) = if rope == Some(true) { (2 * i, 2 * i + 1) } else { (i, i + half) };
                            let (c, s) =
                                if rope.is_some() { (cos[ti * half + i], sin[ti * half + i]) } else { (1.0, 0.0) };
                            assert!((got[ia] - (src[ia] * c - src[ib] * s)).abs() < 1e-15);
                            assert!((got[ib] - (src[ia] * s + src[ib] * c)).abs() < 1e-15);
                        }
                    }
                }
            }
            let back = heads((b, t, n, hd), &y, tabs, false, true);
            assert!(err(&back, &x) < 1e-14, "{rope:?}: the round trip");
            if let Some(i) = rope {
                let other = heads((b, t, n, hd), &x, Some((&cos[..], &sin[..], !i)), true, false);
                assert!(err(&other, &y) > 1e-2, "negative control: the RoPE layout is invisible");
            }
        }
    }

    /// SwiGLU's product against x / (1 + e^{−x}) · u and its gradients against central
    /// differences (f64, more than one chunk); negative control: the roles of gate and up
    /// swapped give other gradients.
    #[test]
    fn silu_mul_matches_its_definition_and_gradients() {
        let n = 3 * SILU_CHUNK / 2;
        let (g, u, c) = (draw(n, 1.0), draw(n, 2.0), draw(n, 3.0));
        let want: Vec<f64> = g.iter().zip(&u).map(|(&x, &u)| x / (1.0 + (-x).exp()) * u).collect();
        assert!(err(&silu_mul(&g, &u), &want) < 1e-14);
        let (dg, du) = silu_mul_grad(&g, &u, &c);
        // the product is elementwise: each element's derivative by its own central difference
        let h = 1e-6;
        let f = |x: f64, u: f64| x / (1.0 + (-x).exp()) * u;
        let ng: Vec<f64> = (0..n).map(|i| c[i] * (f(g[i] + h, u[i]) - f(g[i] - h, u[i])) / (2.0 * h)).collect();
        let nu: Vec<f64> = (0..n).map(|i| c[i] * (f(g[i], u[i] + h) - f(g[i], u[i] - h)) / (2.0 * h)).collect();
        assert!(err(&dg, &ng) < 1e-7 && err(&du, &nu) < 1e-7, "{:e} {:e}", err(&dg, &ng), err(&du, &nu));
        let (sg, _) = silu_mul_grad(&u, &g, &c);
        assert!(err(&sg, &dg) > 1e-2, "negative control: the roles of gate and up are invisible");
    }
}
