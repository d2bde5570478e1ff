//! Grouped-query causal attention as one CPU op with its gradient written out (the fused path of
//! [`crate::ops::Kernels`]): y = softmax(q kᵀ / √d + mask) v per query head, query head j reading
//! key/value head j / g.
//!
//! Why: composed from candle's ops, attention keeps four (b, heads, t, s) tensors per layer in
//! the graph (the scores, their scaled and masked copies, the probabilities) and, in the backward
//! pass, allocates, zeroes and adds a gradient of that size for each — on SmolLM2 with 8 × 256
//! tokens ~19 MB each, 30 layers: the largest part of a LoRA step's memory beyond the weights.
//! This op keeps its inputs, its output and one log-sum-exp per query row, and recomputes the
//! probabilities in the backward pass (as FlashAttention does, Dao et al. 2022, Alg. 2's
//! recomputation). Per (batch, kv head) the g query heads are one (g·t × d) block and every
//! product is one `gemm` call on that task's thread (the masked scores are computed and zeroed:
//! dense products ran faster than skipping them row by row). The passes over values are
//! `kernels::attention_grad`'s; this file is their candle op.
//!
//! The maths, per query row i (position p + i of s = p + t keys; it sees keys 0..=p + i):
//! sⱼ = c qᵢ·kⱼ (c = 1/√d), L = m + ln Σⱼ e^{sⱼ − m} (m = maxⱼ sⱼ), Pⱼ = e^{sⱼ − L}, yᵢ = Σⱼ Pⱼ vⱼ.
//! Backward, with dy: dPⱼ = dy·vⱼ, D = dy·yᵢ (= Σⱼ Pⱼ dPⱼ), dSⱼ = Pⱼ (dPⱼ − D),
//! dqᵢ = c Σⱼ dSⱼ kⱼ, dkⱼ += c dSⱼ qᵢ, dvⱼ += Pⱼ dy.

use crate::mm::{slice, with_slices};
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};
use kernels::attention_grad::{self as kernel, Dims};

/// The attention of `q` (b, heads, t, d) over `keys` and `values` (b, kv, s, d), s ≥ t: query i
/// sits at position s − t + i and attends keys 0..=s − t + i (a prefix of s − t positions, then
/// causally). Returns (b, heads, t, d). CPU, f32 or f64; the gradient reaches q, keys and values.
pub fn causal_attention(q: &Tensor, keys: &Tensor, values: &Tensor) -> Result<Tensor> {
    let (b, h, t, d) = q.dims4()?;
    let (b2, kv, s, d2) = keys.dims4()?;
    if b2 != b || d2 != d || values.dims4()? != (b, kv, s, d) || kv == 0 || h % kv != 0 || s < t {
        candle_core::bail!(
            "attention: q {:?}, keys {:?}, values {:?} do not fit (b, heads, t, d) over (b, kv, s ≥ t, d)",
            q.dims(),
            keys.dims(),
            values.dims()
        );
    }
    let op = Attention { shape: Dims { b, h, kv, t, s, d }, lse: std::sync::Mutex::new(None) };
    q.contiguous()?.apply_op3(&keys.contiguous()?, &values.contiguous()?, op)
}

struct Attention {
    shape: Dims,
    /// The forward pass's log-sum-exp per query row (b, h, t), for the backward's recomputation.
    lse: std::sync::Mutex<Option<Vec<f64>>>,
}

impl CustomOp3 for Attention {
    fn name(&self) -> &'static str {
        "causal-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let Dims { b, h, t, d, .. } = self.shape;
        let (out, lse) = match s1 {
            CpuStorage::F32(_) => {
                let (y, lse) =
                    kernel::causal_attention::<f32>(self.shape, slice(s1, l1)?, slice(s2, l2)?, slice(s3, l3)?);
                (CpuStorage::F32(y), lse)
            }
            CpuStorage::F64(_) => {
                let (y, lse) =
                    kernel::causal_attention::<f64>(self.shape, slice(s1, l1)?, slice(s2, l2)?, slice(s3, l3)?);
                (CpuStorage::F64(y), lse)
            }
            _ => candle_core::bail!("attention: the fused op runs in f32 or f64"),
        };
        *self.lse.lock().map_err(|_| candle_core::Error::Msg("attention: poisoned".into()))? = Some(lse);
        Ok((out, Shape::from((b, h, t, d))))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let guard = self.lse.lock().map_err(|_| candle_core::Error::Msg("attention: poisoned".into()))?;
        let Some(lse) = guard.as_ref() else { candle_core::bail!("attention: backward before forward") };
        let dy = dy.contiguous()?;
        let dev = q.device();
        macro_rules! run {
            ($t:ty) => {{
                let (a, b, c) = with_slices::<$t, _, 5>([q, k, v, y, &dy], |[q, k, v, y, dy]| {
                    kernel::causal_attention_grad(self.shape, (q, k, v, y, dy), lse)
                })?;
                (
                    Tensor::from_vec(a, q.shape(), dev)?,
                    Tensor::from_vec(b, k.shape(), dev)?,
                    Tensor::from_vec(c, v.shape(), dev)?,
                )
            }};
        }
        let (dq, dk, dv) = match q.dtype() {
            candle_core::DType::F32 => run!(f32),
            candle_core::DType::F64 => run!(f64),
            other => candle_core::bail!("attention: no backward in {other:?}"),
        };
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};
    use rand::{Rng, SeedableRng};

    /// Attention written out from its definition, one score at a time (f64): query i of t at
    /// position `offset` + i sees keys 0..=offset + i.
    fn naive(
        q: &[f64],
        k: &[f64],
        v: &[f64],
        dims: (usize, usize, usize, usize, usize, usize),
        offset: usize,
    ) -> Vec<f64> {
        let (b, h, kv, t, s, d) = dims;
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

    /// The op's values and its gradients (of Σ w ⊙ y, w random) against the definition and its
    /// central differences, in f64, with grouped heads and a prefix (s > t). Negative control:
    /// the definition without the prefix's offset (plain causal over s) is far off.
    #[test]
    fn values_and_gradients_match_the_definition() {
        let dims @ (b, h, kv, t, s, d) = (2, 4, 2, 3, 5, 4);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let mut draw = |n: usize| (0..n).map(|_| rng.random_range(-1.0..1.0)).collect::<Vec<f64>>();
        let (q, k, v, w) = (draw(b * h * t * d), draw(b * kv * s * d), draw(b * kv * s * d), draw(b * h * t * d));
        let dev = Device::Cpu;
        let qv = Var::from_vec(q.clone(), (b, h, t, d), &dev).unwrap();
        let kv_ = Var::from_vec(k.clone(), (b, kv, s, d), &dev).unwrap();
        let vv = Var::from_vec(v.clone(), (b, kv, s, d), &dev).unwrap();
        let y = causal_attention(qv.as_tensor(), kv_.as_tensor(), vv.as_tensor()).unwrap();
        let got: Vec<f64> = y.flatten_all().unwrap().to_vec1().unwrap();
        let want = naive(&q, &k, &v, dims, s - t);
        let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(err < 1e-13, "values: {err:e}");
        let off = naive(&q, &k, &v, dims, 0).iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(off > 1e-2, "negative control: the prefix offset is invisible ({off:e})");
        let wt = Tensor::from_vec(w.clone(), (b, h, t, d), &dev).unwrap();
        let grads = (y * wt).unwrap().sum_all().unwrap().backward().unwrap();
        let loss = |q: &[f64], k: &[f64], v: &[f64]| {
            naive(q, k, v, dims, s - t).iter().zip(&w).map(|(a, b)| a * b).sum::<f64>()
        };
        let eps = 1e-6;
        let mut worst = 0f64;
        for (which, var) in [(0, &qv), (1, &kv_), (2, &vv)] {
            let g: Vec<f64> = grads.get(var.as_tensor()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            let base = [&q, &k, &v][which].clone();
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

    /// f32 at SmolLM2's head shape gives the f64 op's values to f32 precision, and the same bits
    /// on one thread and on two.
    #[test]
    fn f32_is_close_to_f64_and_does_not_depend_on_the_threads() {
        let (b, h, kv, t, s, d) = (2, 9, 3, 40, 40, 64);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        let mut draw = |n: usize| (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect::<Vec<f32>>();
        let (q, k, v) = (draw(b * h * t * d), draw(b * kv * s * d), draw(b * kv * s * d));
        let dev = Device::Cpu;
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let t32 = |x: &[f32], sh: (usize, usize, usize, usize)| Tensor::from_vec(x.to_vec(), sh, &dev).unwrap();
                causal_attention(&t32(&q, (b, h, t, d)), &t32(&k, (b, kv, s, d)), &t32(&v, (b, kv, s, d)))
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
            })
        };
        let (one, two) = (run(1), run(2));
        assert_eq!(one, two, "the thread count changed a bit");
        let f = |x: &[f32]| x.iter().map(|&a| a as f64).collect::<Vec<f64>>();
        let want = naive(&f(&q), &f(&k), &f(&v), (b, h, kv, t, s, d), s - t);
        let err = one.iter().zip(&want).map(|(a, b)| (*a as f64 - b).abs()).fold(0.0, f64::max);
        assert!(err < 1e-5, "f32 against f64: {err:e}");
    }
}

/// The layer's geometry for [`attention_routed`]: batch, positions, query heads, key/value
/// heads, head size, and the RoPE layout.
#[derive(Clone, Copy, Debug)]
pub struct Geometry {
    pub b: usize,
    pub t: usize,
    pub heads: usize,
    pub kv: usize,
    pub hd: usize,
    pub interleaved: bool,
}

/// Causal grouped-query attention from the projections' rows to the output's rows as one node of
/// the graph (the routed path, CUDA's: [`crate::ops::Kernels::Routed`]): q (b·t, heads·hd),
/// k and v (b·t, kv·hd) → (b·t, heads·hd), RoPE applied to q and k inside, `mask` the additive
/// causal mask (t, t). The value is computed
/// outside the graph with the device's kernels (candle's RoPE and softmax, cuBLAS's products);
/// the backward recomputes the probabilities P and writes the gradients out, per (batch, kv
/// head) with the g query heads as one block of rows (the maths of this module's doc):
/// dv = Pᵀ dy, dP = dy vᵀ, dS = c P ⊙ (dP − rowsum(dP ⊙ P)), dq̃ = dS k̃, dk̃ = dSᵀ q̃, then the
/// inverse rotation of q̃ and k̃. Composed, the heads' layout, RoPE, scores, mask, softmax and
/// output were ~20 nodes per layer, each with a zeroed gradient and an add in the backward.
pub fn attention_routed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    mask: &Tensor,
    geo: Geometry,
) -> Result<Tensor> {
    let Geometry { b, t, heads, kv, hd, interleaved } = geo;
    if kv == 0
        || heads % kv != 0
        || q.dims2()? != (b * t, heads * hd)
        || k.dims2()? != (b * t, kv * hd)
        || v.dims2()? != (b * t, kv * hd)
    {
        candle_core::bail!(
            "routed attention: q {:?}, k {:?}, v {:?} for {geo:?}: expected (b·t, heads·hd) and (b·t, kv·hd)",
            q.dims(),
            k.dims(),
            v.dims()
        );
    }
    let (g, c) = (heads / kv, 1.0 / (hd as f64).sqrt());
    let (cos, sin) = (cos.contiguous()?, sin.contiguous()?);
    let neg = sin.neg()?;
    // candle's RoPE kernel on a tensor outside the graph (ops::rope's routed value)
    let rope = move |x: &Tensor, cos: &Tensor, sin: &Tensor| {
        crate::ops::rope(x, cos, sin, interleaved, crate::ops::Kernels::Routed)
    };
    // rows → heads (b, n, t, hd); q̃ and k̃ rotated; P (b, kv, g·t, t)
    let heads_of = move |x: &Tensor, n: usize| x.reshape((b, t, n, hd))?.transpose(1, 2)?.contiguous();
    let probs = {
        let (cos, sin, mask) = (cos.clone(), sin.clone(), mask.clone());
        move |q: &Tensor, k: &Tensor| -> Result<(Tensor, Tensor, Tensor)> {
            let qr = rope(&heads_of(q, heads)?, &cos, &sin)?.reshape((b, kv, g * t, hd))?;
            let kr = rope(&heads_of(k, kv)?, &cos, &sin)?;
            let s = (qr.matmul(&kr.t()?)? * c)?.reshape((b, kv, g, t, t))?.broadcast_add(&mask)?;
            let p = candle_nn::ops::softmax_last_dim(&s.contiguous()?)?.reshape((b, kv, g * t, t))?;
            Ok((qr, kr, p))
        }
    };
    let (qd, kd, vd) = (q.detach(), k.detach(), v.detach());
    let (_, _, p) = probs(&qd, &kd)?;
    let vh = heads_of(&vd, kv)?;
    let rows = move |o: &Tensor, n: usize| o.reshape((b, n, t, hd))?.transpose(1, 2)?.reshape((b * t, n * hd));
    let y = rows(&p.matmul(&vh)?, heads)?;
    crate::ops::routed3((q, k, v), y, "attention", move |q, k, v, _, dy| {
        let (q, k, v) = (q.detach(), k.detach(), v.detach());
        let (qr, kr, p) = probs(&q, &k)?;
        let vh = heads_of(&v, kv)?;
        let dy = heads_of(dy, heads)?.reshape((b, kv, g * t, hd))?;
        let dv = p.t()?.matmul(&dy)?;
        let dp = dy.matmul(&vh.t()?)?;
        let ds = ((&dp - (&dp * &p)?.sum_keepdim(3)?.broadcast_as(dp.shape())?)? * &p)?;
        let ds = (ds * c)?;
        let dq = rope(&ds.matmul(&kr)?.reshape((b, heads, t, hd))?, &cos, &neg)?;
        let dk = rope(&ds.t()?.matmul(&qr)?, &cos, &neg)?;
        Ok((Some(rows(&dq, heads)?), Some(rows(&dk, kv)?), Some(rows(&dv, kv)?)))
    })
}
