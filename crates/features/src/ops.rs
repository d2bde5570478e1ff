//! The fused row kernels of the forward pass (`kernels::rows`: causal softmax, attention, RoPE,
//! RMSNorm, silu·up) as candle custom ops on CPU f32 tensors, with the plain candle composition
//! as the fallback (other devices and dtypes) and as the reference the tests compare against.
//! Each op checks its tensors' shapes and hands the kernel plain slices.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};

/// softmax(scale · s) over the last dim with a causal mask: the rows are query positions, grouped
/// as (…, groups · t, t) so that row `r` of a (groups · t)-row block is position `r mod t` and sees
/// keys `0..=r mod t` (grouped-query attention stacks the query heads of one key/value head).
struct CausalSoftmax {
    scale: f32,
    t: usize,
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "onepass-causal-softmax"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(src) = storage else {
            candle_core::bail!("causal softmax: expected f32, got {:?}", storage.dtype());
        };
        let Some((o1, o2)) = layout.contiguous_offsets() else {
            candle_core::bail!("causal softmax: expected a contiguous input");
        };
        let src = &src[o1..o2];
        let (t, scale) = (self.t, self.scale);
        let dims = layout.shape().dims();
        if dims.last() != Some(&t) || dims.len() < 2 || !dims[dims.len() - 2].is_multiple_of(t) {
            candle_core::bail!("causal softmax: shape {dims:?} is not (…, k·{t}, {t})");
        }
        Ok((CpuStorage::F32(kernels::rows::causal_softmax(src, t, scale)), layout.shape().clone()))
    }
}

/// The plain composition: scale, add a −∞ mask above the diagonal, softmax.
pub fn causal_softmax_reference(s: &Tensor, scale: f64, t: usize) -> Result<Tensor> {
    let dims = s.dims().to_vec();
    let n = dims.len();
    let groups = dims[n - 2] / t;
    let m: Vec<f32> = (0..t).flat_map(|i| (0..t).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY })).collect();
    let mask = Tensor::from_vec(m, (t, t), s.device())?.to_dtype(s.dtype())?;
    let mut grouped = dims[..n - 2].to_vec();
    grouped.extend([groups, t, t]);
    let x = (s * scale)?.reshape(grouped)?.broadcast_add(&mask)?;
    candle_nn::ops::softmax_last_dim(&x)?.reshape(dims)
}

/// Causal softmax of attention scores `s` (…, groups · t, t), scaled by `scale`.
pub fn causal_softmax(s: &Tensor, scale: f64, t: usize) -> Result<Tensor> {
    if s.device().is_cpu() && s.dtype() == DType::F32 {
        s.contiguous()?.apply_op1_no_bwd(&CausalSoftmax { scale: scale as f32, t })
    } else {
        causal_softmax_reference(s, scale, t)
    }
}

/// Causal attention softmax(scale · q kᵀ) v for q (b, h, t, d) and k, v (b, kv, t, d)
/// (`kernels::rows::attention`): (b, t, h, d), the layout the output projection reads.
struct CausalAttention {
    scale: f32,
}

/// The f32 values of a contiguous CPU tensor (a custom op's input named `what`).
pub(crate) fn contiguous_f32<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    let CpuStorage::F32(v) = s else {
        candle_core::bail!("{what} is {:?}, expected f32", s.dtype());
    };
    let Some((o1, o2)) = l.contiguous_offsets() else {
        candle_core::bail!("{what} is not contiguous");
    };
    Ok(&v[o1..o2])
}

impl CustomOp3 for CausalAttention {
    fn name(&self) -> &'static str {
        "onepass-causal-attention"
    }

    fn cpu_fwd(
        &self,
        sq: &CpuStorage,
        lq: &Layout,
        sk: &CpuStorage,
        lk: &Layout,
        sv: &CpuStorage,
        lv: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (q, k, v) = (
            contiguous_f32(sq, lq, "causal attention: q")?,
            contiguous_f32(sk, lk, "causal attention: k")?,
            contiguous_f32(sv, lv, "causal attention: v")?,
        );
        let (b, h, t, d) = lq.shape().dims4()?;
        let (bk, kv, tk, dk) = lk.shape().dims4()?;
        if (bk, tk, dk) != (b, t, d) || lv.shape() != lk.shape() || kv == 0 || h % kv != 0 {
            candle_core::bail!(
                "causal attention: q {:?}, k {:?}, v {:?} do not fit (b, h, t, d) / (b, kv, t, d)",
                lq.shape(),
                lk.shape(),
                lv.shape()
            );
        }
        let out = kernels::rows::attention(q, k, v, (b, h, kv, t, d), self.scale);
        Ok((CpuStorage::F32(out), Shape::from((b, t, h, d))))
    }
}

/// [`CausalAttention`] reading q, k and v from one (b, h + 2·kv, t, d) tensor (what
/// [`qkv_rope`] writes): query heads first, then the key heads, then the value heads.
struct CausalAttentionPacked {
    scale: f32,
    heads: usize,
    kv_heads: usize,
}

impl CustomOp1 for CausalAttentionPacked {
    fn name(&self) -> &'static str {
        "onepass-causal-attention-packed"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = contiguous_f32(s, l, "causal attention: qkv")?;
        let (b, heads, t, d) = l.shape().dims4()?;
        let (h, kv) = (self.heads, self.kv_heads);
        if heads != h + 2 * kv || kv == 0 || h % kv != 0 {
            candle_core::bail!("causal attention: {:?} is not (b, {h} + 2·{kv}, t, d)", l.shape());
        }
        let out = kernels::rows::attention_packed(x, (b, h, kv, t, d), self.scale);
        Ok((CpuStorage::F32(out), Shape::from((b, t, h, d))))
    }
}

/// Causal grouped-query attention over a packed (b, h + 2·kv, t, d) tensor → (b, t, h, d); CPU
/// f32. The bf16-weight model uses it too: bf16 products here measured no faster (the scores'
/// softmax and the small products' overheads dominate) and f32 keeps prefill and decoding alike.
pub fn causal_attention_packed(qkv: &Tensor, heads: usize, kv_heads: usize, scale: f64) -> Result<Tensor> {
    qkv.contiguous()?.apply_op1_no_bwd(&CausalAttentionPacked { scale: scale as f32, heads, kv_heads })
}

/// q, k and v of a fused projection, rotated and laid out for attention: `qkv` (b, t, H, d) with
/// H = heads + 2·kv heads → (b, H, t, d), RoPE applied to the first `rotated` heads (q and k) at
/// positions offset..offset + t, v copied. The rotation is candle_nn's `rope` (rotate-half) or
/// `rope_i` (interleaved pairs), expression for expression, so the bits match the composition.
struct QkvRope {
    rotated: usize,
    offset: usize,
    interleaved: bool,
}

impl CustomOp3 for QkvRope {
    fn name(&self) -> &'static str {
        "onepass-qkv-rope"
    }

    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        l: &Layout,
        sc: &CpuStorage,
        lc: &Layout,
        ss: &CpuStorage,
        ls: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, cos, sin) = (
            contiguous_f32(s, l, "qkv rope: qkv")?,
            contiguous_f32(sc, lc, "qkv rope: cos")?,
            contiguous_f32(ss, ls, "qkv rope: sin")?,
        );
        let (b, t, heads, d) = l.shape().dims4()?;
        let (rows, half) = lc.shape().dims2()?;
        if d % 2 != 0 || half * 2 != d || self.offset + t > rows || ls.shape() != lc.shape() || self.rotated > heads {
            candle_core::bail!("qkv rope: {:?} against tables {:?} at offset {}", l.shape(), lc.shape(), self.offset);
        }
        let out = kernels::rows::qkv_rope(x, (b, t, heads, d), self.rotated, self.offset, (cos, sin), self.interleaved);
        Ok((CpuStorage::F32(out), Shape::from((b, heads, t, d))))
    }
}

/// q, k and v of a fused projection, rotated and laid out for attention: `qkv` (b, t, H, d) →
/// (b, H, t, d), RoPE (candle_nn's `rope`, or `rope_i` when `interleaved`, bit for bit) applied
/// to the first `rotated` heads at positions offset..offset + t, the rest copied; `cos`, `sin`
/// (max_len, d/2), f32 on the CPU.
pub fn qkv_rope(
    qkv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    rotated: usize,
    offset: usize,
    interleaved: bool,
) -> Result<Tensor> {
    qkv.contiguous()?.apply_op3_no_bwd(
        &cos.contiguous()?,
        &sin.contiguous()?,
        &QkvRope { rotated, offset, interleaved },
    )
}

/// RMSNorm over the last dim, `candle_nn::ops::rms_norm` bit for bit; rows in parallel.
struct RmsNormOp {
    eps: f32,
}

impl CustomOp2 for RmsNormOp {
    fn name(&self) -> &'static str {
        "onepass-rms-norm"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout, sw: &CpuStorage, lw: &Layout) -> Result<(CpuStorage, Shape)> {
        let (x, w) = (contiguous_f32(s, l, "rms norm: x")?, contiguous_f32(sw, lw, "rms norm: weight")?);
        let n = w.len();
        if l.dims().last() != Some(&n) || n == 0 {
            candle_core::bail!("rms norm: {:?} against a weight of {n}", l.shape());
        }
        let out = kernels::rows::rms_norm(x, w, self.eps);
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }
}

/// x + a and RMSNorm(x + a) in one pass: a (2, …) tensor, [sum; normalised].
struct AddRmsNorm {
    eps: f32,
}

impl CustomOp3 for AddRmsNorm {
    fn name(&self) -> &'static str {
        "onepass-add-rms-norm"
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sa: &CpuStorage,
        la: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, a, w) = (
            contiguous_f32(sx, lx, "add + rms norm: x")?,
            contiguous_f32(sa, la, "add + rms norm: a")?,
            contiguous_f32(sw, lw, "add + rms norm: weight")?,
        );
        let n = w.len();
        if lx.shape() != la.shape() || lx.dims().last() != Some(&n) || n == 0 {
            candle_core::bail!("add + rms norm: {:?} + {:?} against a weight of {n}", lx.shape(), la.shape());
        }
        let out = kernels::rows::add_rms_norm(x, a, w, self.eps);
        let mut dims = vec![2];
        dims.extend_from_slice(lx.dims());
        Ok((CpuStorage::F32(out), Shape::from(dims)))
    }
}

/// RMSNorm over the last dim (candle_nn's `rms_norm`, which it matches bit for bit on the CPU).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
    if x.device().is_cpu() && x.dtype() == DType::F32 && w.dtype() == DType::F32 {
        x.contiguous()?.apply_op2_no_bwd(&w.contiguous()?, &RmsNormOp { eps })
    } else {
        candle_nn::ops::rms_norm(&x.contiguous()?, w, eps)
    }
}

/// (x + a, RMSNorm(x + a)): the residual sum and the next sublayer's input in one pass.
pub fn add_rms_norm(x: &Tensor, a: &Tensor, w: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
    if x.device().is_cpu() && x.dtype() == DType::F32 && a.dtype() == DType::F32 && w.dtype() == DType::F32 {
        let both = x.contiguous()?.apply_op3_no_bwd(&a.contiguous()?, &w.contiguous()?, &AddRmsNorm { eps })?;
        Ok((both.get(0)?, both.get(1)?))
    } else {
        let sum = (x + a)?;
        let normed = candle_nn::ops::rms_norm(&sum.contiguous()?, w, eps)?;
        Ok((sum, normed))
    }
}

/// The plain composition (any device and dtype): grouped scores, [`causal_softmax`], values.
pub fn causal_attention_reference(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    let (b, h, t, d) = q.dims4()?;
    let kv = k.dim(1)?;
    let q = q.contiguous()?.reshape((b, kv, (h / kv) * t, d))?;
    let s = q.matmul(&k.t()?)?;
    let p = causal_softmax(&s, scale, t)?;
    p.matmul(&v.contiguous()?)?.reshape((b, h, t, d))?.transpose(1, 2)?.contiguous()
}

/// Causal grouped-query attention: q (b, h, t, d), k and v (b, kv, t, d) → (b, t, h, d).
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    if q.device().is_cpu() && q.dtype() == DType::F32 {
        q.contiguous()?.apply_op3_no_bwd(&k.contiguous()?, &v.contiguous()?, &CausalAttention { scale: scale as f32 })
    } else {
        causal_attention_reference(q, k, v, scale)
    }
}

/// silu(gate) · up for `x` = [gate | up] along the last dim: (…, 2i) → (…, i).
struct SiluMul;

impl CustomOp1 for SiluMul {
    fn name(&self) -> &'static str {
        "onepass-silu-mul"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(src) = storage else {
            candle_core::bail!("silu·mul: expected f32, got {:?}", storage.dtype());
        };
        let Some((o1, o2)) = layout.contiguous_offsets() else {
            candle_core::bail!("silu·mul: expected a contiguous input");
        };
        let src = &src[o1..o2];
        let mut dims = layout.shape().dims().to_vec();
        let two = *dims.last().unwrap_or(&0);
        if !two.is_multiple_of(2) || two == 0 {
            candle_core::bail!("silu·mul: last dim {two} is not even");
        }
        let i = two / 2;
        let dst = kernels::rows::silu_mul(src, i);
        *dims.last_mut().expect("non-empty") = i;
        Ok((CpuStorage::F32(dst), Shape::from(dims)))
    }
}

/// The plain composition.
pub fn silu_mul_reference(x: &Tensor) -> Result<Tensor> {
    let last = x.rank() - 1;
    let i = x.dim(last)? / 2;
    x.narrow(last, 0, i)?.silu()? * x.narrow(last, i, i)?
}

/// silu(gate) · up for `x` = [gate | up] along the last dim.
pub fn silu_mul(x: &Tensor) -> Result<Tensor> {
    if x.device().is_cpu() && x.dtype() == DType::F32 {
        x.contiguous()?.apply_op1_no_bwd(&SiluMul)
    } else {
        silu_mul_reference(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn max_abs(a: &Tensor, b: &Tensor) -> f32 {
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
    }

    #[test]
    fn causal_softmax_matches_the_masked_composition() {
        let dev = Device::Cpu;
        for (b, groups, t) in [(2, 3, 7), (1, 1, 1), (3, 2, 33)] {
            let s = (Tensor::randn(0f32, 3.0, (b, 2, groups * t, t), &dev).unwrap()).contiguous().unwrap();
            let fast = causal_softmax(&s, 0.125, t).unwrap();
            let slow = causal_softmax_reference(&s, 0.125, t).unwrap();
            assert!(max_abs(&fast, &slow) < 1e-6, "b {b} groups {groups} t {t}");
            // Rows sum to one and nothing above the diagonal leaks.
            let v = fast.reshape((b * 2 * groups * t, t)).unwrap().to_vec2::<f32>().unwrap();
            for (r, row) in v.iter().enumerate() {
                let p = r % t;
                assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-5);
                assert!(row[p + 1..].iter().all(|&x| x == 0.0), "row {r} sees the future");
            }
        }
        let bad = Tensor::zeros((2, 5, 4), DType::F32, &Device::Cpu).unwrap();
        assert!(causal_softmax(&bad, 1.0, 4).is_err(), "5 rows are not a multiple of t = 4");
    }

    #[test]
    fn causal_attention_matches_the_composition() {
        let dev = Device::Cpu;
        // t not a multiple of the query block, GQA 6/2, and plain multi-head.
        for (b, h, kv, t, d) in [(2, 6, 2, 150, 16), (1, 4, 4, 64, 8), (3, 3, 1, 5, 4), (1, 2, 1, 1, 2)] {
            let q = Tensor::randn(0f32, 1.0, (b, h, t, d), &dev).unwrap();
            let k = Tensor::randn(0f32, 1.0, (b, kv, t, d), &dev).unwrap();
            let v = Tensor::randn(0f32, 1.0, (b, kv, t, d), &dev).unwrap();
            let fast = causal_attention(&q, &k, &v, 0.3).unwrap();
            assert_eq!(fast.dims(), &[b, t, h, d]);
            // An independent reference: each head on its own, its key/value head repeated,
            // with a −∞ mask and softmax_last_dim.
            let rep = h / kv;
            let mask: Vec<f32> =
                (0..t).flat_map(|i| (0..t).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY })).collect();
            let mask = Tensor::from_vec(mask, (t, t), &dev).unwrap();
            for head in 0..h {
                let qh = q.narrow(1, head, 1).unwrap().squeeze(1).unwrap();
                let kh = k.narrow(1, head / rep, 1).unwrap().squeeze(1).unwrap();
                let vh = v.narrow(1, head / rep, 1).unwrap().squeeze(1).unwrap();
                let s = (qh.matmul(&kh.t().unwrap()).unwrap() * 0.3).unwrap().broadcast_add(&mask).unwrap();
                let want = candle_nn::ops::softmax_last_dim(&s).unwrap().matmul(&vh).unwrap();
                let got = fast.narrow(2, head, 1).unwrap().squeeze(2).unwrap();
                assert!(max_abs(&got, &want) < 1e-5, "b {b} h {h} kv {kv} t {t} head {head}");
            }
            let slow = causal_attention_reference(&q, &k, &v, 0.3).unwrap();
            assert!(max_abs(&fast, &slow) < 1e-5);
        }
        let q = Tensor::zeros((1, 3, 4, 2), DType::F32, &dev).unwrap();
        let k = Tensor::zeros((1, 2, 4, 2), DType::F32, &dev).unwrap();
        assert!(causal_attention(&q, &k, &k, 1.0).is_err(), "3 query heads over 2 kv heads");
    }

    #[test]
    fn silu_mul_matches_the_composition() {
        let x = Tensor::randn(0f32, 4.0, (3, 5, 2 * 37), &Device::Cpu).unwrap();
        let fast = silu_mul(&x).unwrap();
        assert_eq!(fast.dims(), &[3, 5, 37]);
        assert!(max_abs(&fast, &silu_mul_reference(&x).unwrap()) < 1e-5);
        let odd = Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap();
        assert!(silu_mul(&odd).is_err());
    }

    fn same_bits(a: &Tensor, b: &Tensor) -> bool {
        let (a, b) =
            (a.flatten_all().unwrap().to_vec1::<f32>().unwrap(), b.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        a.len() == b.len() && a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits())
    }

    /// The fused norms give candle_nn's bits (so the f32 path's φ did not move), for row counts
    /// around the 8-row interleave.
    #[test]
    fn fused_norms_match_candle_bit_for_bit() {
        let dev = Device::Cpu;
        let w = Tensor::randn(1f32, 0.3, 40, &dev).unwrap();
        for rows in [1, 7, 8, 9, 23, 300] {
            let x = Tensor::randn(0f32, 2.0, (rows, 40), &dev).unwrap();
            let a = Tensor::randn(0f32, 1.0, (rows, 40), &dev).unwrap();
            let want = candle_nn::ops::rms_norm(&x, &w, 1e-5).unwrap();
            assert!(same_bits(&rms_norm(&x, &w, 1e-5).unwrap(), &want), "rows {rows}");
            let sum = (&x + &a).unwrap();
            let (s, n) = add_rms_norm(&x, &a, &w, 1e-5).unwrap();
            assert!(same_bits(&s, &sum));
            assert!(same_bits(&n, &candle_nn::ops::rms_norm(&sum, &w, 1e-5).unwrap()), "rows {rows}");
            // Negative control: another ε changes the bits.
            assert!(!same_bits(&rms_norm(&x, &w, 1e-2).unwrap(), &want));
        }
    }

    /// qkv_rope = split, candle_nn's rope (both layouts) on q and k at an offset, v untouched.
    #[test]
    fn qkv_rope_matches_candle_rope() {
        let dev = Device::Cpu;
        let (b, t, h, kv, d, max_len) = (2, 5, 6, 2, 8, 12);
        let qkv = Tensor::randn(0f32, 1.0, (b, t, h + 2 * kv, d), &dev).unwrap();
        let cos = Tensor::randn(0f32, 1.0, (max_len, d / 2), &dev).unwrap();
        let sin = Tensor::randn(0f32, 1.0, (max_len, d / 2), &dev).unwrap();
        for interleaved in [false, true] {
            for offset in [0, 3] {
                let got = qkv_rope(&qkv, &cos, &sin, h + kv, offset, interleaved).unwrap();
                assert_eq!(got.dims(), &[b, h + 2 * kv, t, d]);
                let (c, s) = (cos.narrow(0, offset, t).unwrap(), sin.narrow(0, offset, t).unwrap());
                let rot = |x: &Tensor| {
                    let x = x.transpose(1, 2).unwrap().contiguous().unwrap();
                    if interleaved {
                        candle_nn::rotary_emb::rope_i(&x, &c, &s).unwrap()
                    } else {
                        candle_nn::rotary_emb::rope(&x, &c, &s).unwrap()
                    }
                };
                let q = rot(&qkv.narrow(2, 0, h + kv).unwrap());
                assert!(same_bits(&got.narrow(1, 0, h + kv).unwrap(), &q), "interleaved {interleaved} offset {offset}");
                let v = qkv.narrow(2, h + kv, kv).unwrap().transpose(1, 2).unwrap();
                assert!(same_bits(&got.narrow(1, h + kv, kv).unwrap(), &v));
                // The attention over the packed tensor equals the one over separate q, k, v.
                let packed = causal_attention_packed(&got, h, kv, 0.3).unwrap();
                let sep = causal_attention(
                    &got.narrow(1, 0, h).unwrap(),
                    &got.narrow(1, h, kv).unwrap(),
                    &got.narrow(1, h + kv, kv).unwrap(),
                    0.3,
                )
                .unwrap();
                assert!(same_bits(&packed, &sep));
            }
        }
        // The other layout rotates different pairs: a negative control.
        let a = qkv_rope(&qkv, &cos, &sin, h + kv, 0, false).unwrap();
        let b2 = qkv_rope(&qkv, &cos, &sin, h + kv, 0, true).unwrap();
        assert!(!same_bits(&a, &b2));
    }
}
