//! How a layer's weights are kept and multiplied: dense candle tensors, or packed once for the
//! products of the `kernels` crate (f32, bf16, AMX) with their fused epilogues as candle custom
//! ops (the q/k/v product with RoPE, a residual sublayer's end with RMSNorm).

use super::config::Config;
use candle_core::{DType, Tensor};
use candle_nn::VarBuilder;

/// How a layer's weights are kept: candle tensors of the model's dtype, or — a bf16 or f32 model
/// on the CPU — packed for the products of [`kernels::bf16`] and [`kernels::f32mm`], with f32
/// activations around them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Store {
    Dense,
    Bf16Cpu,
    F32Cpu,
}

/// Whether f32 products on the CPU go through candle's matmul instead of [`kernels::f32mm`]
/// (`ONEPASS_F32_KERNEL=candle`: how a benchmark measures both in one run).
pub fn f32_uses_candle() -> bool {
    std::env::var("ONEPASS_F32_KERNEL").as_deref() == Ok("candle")
}

impl Store {
    /// bf16 on the CPU takes the packed path (candle 0.11 has no bf16 CPU gemm: it would widen
    /// both sides to f32 on every product), f32 on the CPU too (weights packed once, fused
    /// epilogues); every other device and dtype stays dense.
    pub(super) fn of(vb: &VarBuilder) -> Store {
        match (vb.dtype(), vb.device().is_cpu()) {
            (DType::BF16, true) => Store::Bf16Cpu,
            (DType::F32, true) if !f32_uses_candle() => Store::F32Cpu,
            _ => Store::Dense,
        }
    }

    /// A weight that is not a matrix product's (norms, embeddings, biases) as the activations
    /// will use it: unchanged when dense or f32; its bf16 values widened to f32 when packed.
    pub(super) fn plain(self, t: Tensor) -> candle_core::Result<Tensor> {
        match self {
            Store::Dense | Store::F32Cpu => Ok(t),
            Store::Bf16Cpu => t.to_dtype(DType::F32),
        }
    }
}

/// A weight packed for one of the CPU products.
pub(super) type Packed = std::sync::Arc<dyn kernels::packed::PackedMatrix>;

#[derive(Clone)]
pub(super) enum Weight {
    Dense(Tensor),
    Packed(Packed),
}

/// A LoRA adapter of one layer, kept unmerged beside its weight: y = x Wᵀ + s·(x Aᵀ) Bᵀ, LoRA's
/// h = W₀x + (α/r)·BAx (Hu et al. 2021, eq. 3) with s = α/r. A generator on bf16 weights needs
/// it so: merged into bf16, (α/r)·BA is far below half an ulp of W and a small update would be
/// rounded away.
#[derive(Clone, Debug)]
pub struct LowRank {
    /// A: (r, in).
    pub a: Tensor,
    /// B: (out, r).
    pub b: Tensor,
    /// s = α/r.
    pub scale: f64,
}

impl LowRank {
    /// s·B rounded once to f32 (formed in f64): the B the branch multiplies by.
    pub fn scaled_b(&self) -> candle_core::Result<Tensor> {
        (self.b.to_dtype(DType::F64)? * self.scale)?.to_dtype(DType::F32)
    }
}

/// A layer's low-rank branch: the adapters of the layers it fuses, A = [A₁; A₂; …] (R × in)
/// and B' block-diagonal with the blocks s_i·B_i (out × R), in f32 whatever the weights' dtype
/// — packed for [`kernels::f32mm`] beside a packed weight (whose activations are f32: the
/// branch is added in f32), candle tensors beside a dense one (added in the activations'
/// dtype: on a dense bf16 model, bf16).
#[derive(Clone)]
pub(super) enum Low {
    Packed(LowPair),
    Dense { a: Tensor, b: Tensor },
}

impl Low {
    /// The branch of a layer whose outputs stack `parts` (each its adapter, if any, and its
    /// output count), for `inp` inputs; None when no part is adapted. `name` names the layer in
    /// errors.
    pub(super) fn of(
        parts: &[(Option<&LowRank>, usize)],
        inp: usize,
        packed: bool,
        dev: &candle_core::Device,
        name: &str,
    ) -> Result<Option<Low>, crate::Error> {
        if parts.iter().all(|p| p.0.is_none()) {
            return Ok(None);
        }
        let out: usize = parts.iter().map(|p| p.1).sum();
        let r: usize = parts.iter().filter_map(|p| p.0).map(|l| l.a.dim(0).unwrap_or(0)).sum();
        let (mut a, mut b) = (Vec::with_capacity(r * inp), vec![0f32; out * r]);
        let (mut row, mut col) = (0, 0);
        for (l, n) in parts {
            if let Some(l) = l {
                let (ra, ia) = l.a.dims2()?;
                let (nb, rb) = l.b.dims2()?;
                if ia != inp || nb != *n || rb != ra || ra == 0 {
                    return Err(crate::Error::Input(format!(
                        "adapter of {name}: A is {:?} and B {:?}, expected (r, {inp}) and ({n}, r) with r ≥ 1",
                        l.a.dims(),
                        l.b.dims()
                    )));
                }
                a.extend(l.a.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
                let sb = l.scaled_b()?.to_vec2::<f32>()?;
                for (i, v) in sb.iter().enumerate() {
                    b[(row + i) * r + col..][..ra].copy_from_slice(v);
                }
                col += ra;
            }
            row += n;
        }
        Ok(Some(if packed {
            use kernels::f32mm::F32Matrix;
            Low::Packed(std::sync::Arc::new((F32Matrix::from_f32(&a, r, inp), F32Matrix::from_f32(&b, out, r))))
        } else {
            Low::Dense { a: Tensor::from_vec(a, (r, inp), dev)?, b: Tensor::from_vec(b, (out, r), dev)? }
        }))
    }

    /// y += (x Aᵀ) B'ᵀ for x (rows, in) f32, y (rows, out) f32; packed branches only.
    fn add_into(pair: &LowPair, x: &[f32], rows: usize, y: &mut [f32]) {
        use kernels::packed::PackedMatrix;
        let t = pair.0.matmul_t(x, rows);
        for (y, d) in y.iter_mut().zip(pair.1.matmul_t(&t, rows)) {
            *y += d;
        }
    }

    /// The branch's input for a SwiGLU down projection: silu(g)·u of x = [g | u].
    fn input<'a>(x: &'a [f32], swiglu: bool, k: usize) -> std::borrow::Cow<'a, [f32]> {
        if swiglu {
            std::borrow::Cow::Owned(kernels::rows::silu_mul(x, k))
        } else {
            std::borrow::Cow::Borrowed(x)
        }
    }
}

type LowPair = std::sync::Arc<(kernels::f32mm::F32Matrix, kernels::f32mm::F32Matrix)>;

/// The packed product as a candle op: (rows, in) f32 → (rows, out) f32; with `swiglu`,
/// (rows, 2·in) = [gate | up] → (rows, out), the product of silu(gate)·up.
pub(super) struct PackedLinear {
    pub(super) w: Packed,
    pub(super) swiglu: bool,
    /// The layer's low-rank branch, added to y ([`Low`]).
    pub(super) low: Option<LowPair>,
}

impl candle_core::CustomOp1 for PackedLinear {
    fn name(&self) -> &'static str {
        "onepass-packed-linear"
    }

    fn cpu_fwd(
        &self,
        storage: &candle_core::CpuStorage,
        layout: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let candle_core::CpuStorage::F32(x) = storage else {
            use candle_core::backend::BackendStorage;
            candle_core::bail!("packed linear: expected f32 activations, got {:?}", storage.dtype());
        };
        let Some((o1, o2)) = layout.contiguous_offsets() else {
            candle_core::bail!("packed linear: expected a contiguous input");
        };
        let (rows, inp) = layout.shape().dims2()?;
        let k = self.w.k();
        if inp != if self.swiglu { 2 * k } else { k } {
            candle_core::bail!(
                "packed linear: input of {inp} features, the weight takes {k} (swiglu: {})",
                self.swiglu
            );
        }
        let x = &x[o1..o2];
        let y = match &self.low {
            // with a branch, silu(g)·u is formed once for both products (the fused SwiGLU
            // product gives the bits of silu_mul followed by the plain one)
            Some(low) => {
                let x = Low::input(x, self.swiglu, k);
                let mut y = self.w.matmul_t(&x, rows);
                Low::add_into(low, &x, rows, &mut y);
                y
            }
            None if self.swiglu => self.w.matmul_t_swiglu(x, rows),
            None => self.w.matmul_t(x, rows),
        };
        Ok((candle_core::CpuStorage::F32(y), candle_core::Shape::from((rows, self.w.n()))))
    }
}

/// [`PackedLinear`] ending a residual sublayer: (x, residual r, norm weight) → (2, rows, out) =
/// [r + y; RMSNorm(r + y)] (see [`kernels::packed::PackedMatrix::matmul_t_add_rms`]).
pub(super) struct PackedLinearAddNorm {
    pub(super) w: Packed,
    pub(super) swiglu: bool,
    pub(super) eps: f32,
    /// The layer's low-rank branch ([`Low`]): added to the residual before the fused sum, so
    /// the sum and its norm see r + x Wᵀ + (x Aᵀ) B'ᵀ.
    pub(super) low: Option<LowPair>,
}

impl candle_core::CustomOp3 for PackedLinearAddNorm {
    fn name(&self) -> &'static str {
        "onepass-packed-linear-add-rms-norm"
    }

    fn cpu_fwd(
        &self,
        sx: &candle_core::CpuStorage,
        lx: &candle_core::Layout,
        sr: &candle_core::CpuStorage,
        lr: &candle_core::Layout,
        sw: &candle_core::CpuStorage,
        lw: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        use crate::ops::contiguous_f32;
        let (x, r, w) = (
            contiguous_f32(sx, lx, "packed linear + norm: x")?,
            contiguous_f32(sr, lr, "packed linear + norm: residual")?,
            contiguous_f32(sw, lw, "packed linear + norm: norm")?,
        );
        let (rows, inp) = lx.shape().dims2()?;
        let (k, n) = (self.w.k(), self.w.n());
        if inp != if self.swiglu { 2 * k } else { k } || lr.shape().dims2()? != (rows, n) || w.len() != n {
            candle_core::bail!(
                "packed linear + norm: x {:?}, residual {:?} and norm {:?} do not fit a {n} × {k} weight (swiglu: {})",
                lx.shape(),
                lr.shape(),
                lw.shape(),
                self.swiglu
            );
        }
        let y = match &self.low {
            Some(low) => {
                let (x, mut r) = (Low::input(x, self.swiglu, k), r.to_vec());
                Low::add_into(low, &x, rows, &mut r);
                self.w.matmul_t_add_rms(&x, false, rows, &r, w, self.eps)
            }
            None => self.w.matmul_t_add_rms(x, self.swiglu, rows, r, w, self.eps),
        };
        Ok((candle_core::CpuStorage::F32(y), candle_core::Shape::from((2, rows, n))))
    }
}

/// The q/k/v product with RoPE and the attention layout as its epilogue: (rows = b·t, in) f32
/// and the cos, sin tables → the packed (b, heads + 2·kv, t, d) tensor of [`crate::ops::qkv_rope`]
/// (offset 0), bit for bit, without a separate pass over the product's output.
pub(super) struct PackedQkvRope {
    pub(super) w: Packed,
    /// (b, t, heads, d): heads = q + k + v heads.
    pub(super) dims: (usize, usize, usize, usize),
    pub(super) rotated: usize,
    pub(super) interleaved: bool,
}

impl candle_core::CustomOp3 for PackedQkvRope {
    fn name(&self) -> &'static str {
        "onepass-packed-qkv-rope"
    }

    fn cpu_fwd(
        &self,
        sx: &candle_core::CpuStorage,
        lx: &candle_core::Layout,
        sc: &candle_core::CpuStorage,
        lc: &candle_core::Layout,
        ss: &candle_core::CpuStorage,
        ls: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        use crate::ops::contiguous_f32;
        let (x, cos, sin) = (
            contiguous_f32(sx, lx, "packed qkv + rope: qkv input")?,
            contiguous_f32(sc, lc, "packed qkv + rope: cos")?,
            contiguous_f32(ss, ls, "packed qkv + rope: sin")?,
        );
        let (b, t, heads, d) = self.dims;
        let (rows, half) = lc.shape().dims2()?;
        if lx.shape().dims2()? != (b * t, self.w.k()) || self.w.n() != heads * d || half * 2 != d || t > rows {
            candle_core::bail!(
                "packed qkv + rope: input {:?}, tables {:?} against {:?} and a {} × {} weight",
                lx.shape(),
                lc.shape(),
                self.dims,
                self.w.n(),
                self.w.k()
            );
        }
        let out = kernels::packed::qkv_rope_product(
            self.w.as_ref(),
            x,
            (b, t, heads, d),
            self.rotated,
            (cos, sin),
            self.interleaved,
        );
        Ok((candle_core::CpuStorage::F32(out), candle_core::Shape::from((b, heads, t, d))))
    }
}

/// A dense layer y = x Wᵀ (+ b) applied to the flattened rows of x: one 2-D gemm per call, so
/// the weight is packed once per batch rather than once per sequence (candle_nn::Linear runs a
/// batched matmul over a broadcast weight).
#[derive(Clone)]
pub(super) struct Lin {
    pub(super) w: Weight,
    pub(super) b: Option<Tensor>,
    pub(super) out: usize,
    /// An unmerged adapter's branch ([`Low`]; `Model::with_adapters`).
    pub(super) low: Option<Low>,
}

impl Lin {
    pub(super) fn new(w: Tensor, b: Option<Tensor>, store: Store) -> candle_core::Result<Lin> {
        let (out, inp) = w.dims2()?;
        let w = match store {
            Store::Dense => Weight::Dense(w),
            Store::Bf16Cpu => {
                let bits: Vec<u16> = w
                    .to_dtype(DType::BF16)?
                    .flatten_all()?
                    .to_vec1::<half::bf16>()?
                    .iter()
                    .map(|v| v.to_bits())
                    .collect();
                Weight::Packed(std::sync::Arc::new(kernels::bf16::Bf16Matrix::from_bits(&bits, out, inp)))
            }
            Store::F32Cpu => {
                let w = w.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                Weight::Packed(std::sync::Arc::new(kernels::f32mm::F32Matrix::from_f32(&w, out, inp)))
            }
        };
        let b = b.map(|b| store.plain(b)).transpose()?;
        Ok(Lin { w, b, out, low: None })
    }

    /// Several layers that read the same input, fused along the output dimension.
    pub(super) fn load_fused(
        vb: &VarBuilder,
        names: &[(&str, usize)],
        inp: usize,
        bias: bool,
    ) -> candle_core::Result<Lin> {
        let ws = names.iter().map(|(n, out)| vb.pp(n).get((*out, inp), "weight")).collect::<Result<Vec<_>, _>>()?;
        let b = if bias {
            let bs = names.iter().map(|(n, out)| vb.pp(n).get(*out, "bias")).collect::<Result<Vec<_>, _>>()?;
            Some(Tensor::cat(&bs, 0)?)
        } else {
            None
        };
        Lin::new(Tensor::cat(&ws, 0)?, b, Store::of(vb))
    }

    pub(super) fn load(vb: VarBuilder, inp: usize, out: usize, bias: bool) -> candle_core::Result<Lin> {
        let w = vb.get((out, inp), "weight")?;
        let b = if bias { Some(vb.get(out, "bias")?) } else { None };
        Lin::new(w, b, Store::of(&vb))
    }

    /// This layer with the branch of `parts`' adapters (see [`Low::of`]), replacing any it had.
    pub(super) fn adapted(&self, parts: &[(Option<&LowRank>, usize)], name: &str) -> Result<Lin, crate::Error> {
        let (packed, inp, dev) = match &self.w {
            Weight::Packed(w) => (true, w.k(), candle_core::Device::Cpu),
            Weight::Dense(w) => (false, w.dim(1)?, w.device().clone()),
        };
        Ok(Lin { low: Low::of(parts, inp, packed, &dev, name)?, ..self.clone() })
    }

    fn low_pair(&self) -> Option<LowPair> {
        match &self.low {
            Some(Low::Packed(p)) => Some(p.clone()),
            _ => None,
        }
    }

    /// (…, in) → (…, out).
    pub(super) fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_of(x, false)
    }

    /// SwiGLU's second half: (…, 2·in) = [gate | up] → silu(gate)·up → (…, out); on the bf16 CPU
    /// path silu·up is formed while the product packs its input.
    pub(super) fn forward_swiglu(&self, gu: &Tensor) -> candle_core::Result<Tensor> {
        match &self.w {
            Weight::Packed(_) => self.forward_of(gu, true),
            Weight::Dense(_) => {
                let a = {
                    let _s = tracing::trace_span!("silu_mul").entered();
                    crate::ops::silu_mul(gu)?
                };
                self.forward_of(&a, false)
            }
        }
    }

    /// A residual sublayer's end: (r + y, norm(r + y)) for y = this layer of `x` (`swiglu`: of
    /// silu(gate)·up, see [`Lin::forward_swiglu`]); on the bf16 CPU path in one fused product.
    pub(super) fn forward_add_norm(
        &self,
        x: &Tensor,
        swiglu: bool,
        r: &Tensor,
        norm: &RmsNorm,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        if let (Weight::Packed(w), None) = (&self.w, &self.b) {
            let dims = x.dims();
            let rows = x.elem_count() / dims[dims.len() - 1].max(1);
            let x = x.reshape((rows, dims[dims.len() - 1]))?.contiguous()?;
            let op = PackedLinearAddNorm { w: w.clone(), swiglu, eps: norm.eps, low: self.low_pair() };
            let both = x.apply_op3_no_bwd(&r.reshape((rows, self.out))?.contiguous()?, &norm.w, &op)?;
            let mut out = dims.to_vec();
            *out.last_mut().expect("rank ≥ 1") = self.out;
            return Ok((both.get(0)?.reshape(out.as_slice())?, both.get(1)?.reshape(out.as_slice())?));
        }
        let y = if swiglu { self.forward_swiglu(x)? } else { self.forward(x)? };
        norm.add_forward(r, &y)
    }

    pub(super) fn forward_of(&self, x: &Tensor, swiglu: bool) -> candle_core::Result<Tensor> {
        let dims = x.dims();
        let inp = dims[dims.len() - 1];
        let rows = x.elem_count() / inp.max(1);
        let x = x.reshape((rows, inp))?;
        let y = match &self.w {
            Weight::Dense(w) => {
                let y = x.matmul(&w.t()?)?;
                match &self.low {
                    // the branch in f32 whatever the activations' dtype (forward_swiglu formed
                    // silu·up for a dense weight: x is the product's input)
                    Some(Low::Dense { a, b }) => {
                        let d = x.to_dtype(DType::F32)?.matmul(&a.t()?)?.matmul(&b.t()?)?;
                        (y + d.to_dtype(x.dtype())?)?
                    }
                    _ => y,
                }
            }
            Weight::Packed(w) => {
                x.contiguous()?.apply_op1_no_bwd(&PackedLinear { w: w.clone(), swiglu, low: self.low_pair() })?
            }
        };
        let y = match &self.b {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        };
        let mut out = dims.to_vec();
        *out.last_mut().expect("rank ≥ 1") = self.out;
        y.reshape(out)
    }
}

/// RMSNorm over the last dim (alone, or after a residual add).
#[derive(Clone)]
pub(super) struct RmsNorm {
    pub(super) w: Tensor,
    pub(super) eps: f32,
}

impl RmsNorm {
    pub(super) fn load(vb: VarBuilder, cfg: &Config) -> candle_core::Result<Self> {
        Ok(RmsNorm { w: Store::of(&vb).plain(vb.get(cfg.hidden, "weight")?)?, eps: cfg.eps as f32 })
    }
    pub(super) fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let _s = tracing::trace_span!("rms_norm").entered();
        crate::ops::rms_norm(x, &self.w, self.eps)
    }
    /// (x + a, RMSNorm(x + a)).
    pub(super) fn add_forward(&self, x: &Tensor, a: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
        let _s = tracing::trace_span!("residual_rms_norm").entered();
        crate::ops::add_rms_norm(x, a, &self.w, self.eps)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// On packed bf16 weights, an update s·BA far below half a bf16 ulp of W survives as the
    /// unmerged branch — y_adapted − y_base is x (s·BA)ᵀ to f32 rounding, since both products
    /// round x and W alike (to 1 %: y is ~10⁵ times the change, which f32 cancellation limits) — while merging it into the bf16 weights rounds it away (the negative
    /// control: the merged layer's change is nowhere near the update). Also through the SwiGLU
    /// and residual + norm epilogues.
    #[test]
    fn a_tiny_update_survives_the_branch_and_not_a_bf16_merge() {
        let dev = Device::Cpu;
        let (out, inp, r, rows) = (48, 40, 4, 9);
        let w = Tensor::randn(0f32, 0.5, (out, inp), &dev).unwrap();
        let a = Tensor::randn(0f32, 1.0, (r, inp), &dev).unwrap();
        let b = Tensor::randn(0f32, 1.0, (out, r), &dev).unwrap();
        let low = LowRank { a: a.clone(), b: b.clone(), scale: 1e-5 };
        let delta = (b.matmul(&a).unwrap() * 1e-5).unwrap();
        let base = Lin::new(w.clone(), None, Store::Bf16Cpu).unwrap();
        let adapted = base.adapted(&[(Some(&low), out)], "test").unwrap();
        let merged = Lin::new((&w + &delta).unwrap(), None, Store::Bf16Cpu).unwrap();
        let rel = |got: &Tensor, want: &Tensor| -> f64 {
            let d = (got - want).unwrap().sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() as f64;
            (d / want.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() as f64).sqrt()
        };
        // plain, then as a SwiGLU down projection (its input [g | u] of twice the width)
        for swiglu in [false, true] {
            let x = Tensor::randn(0f32, 1.0, (rows, if swiglu { 2 * inp } else { inp }), &dev).unwrap();
            let input = if swiglu { crate::ops::silu_mul(&x).unwrap() } else { x.clone() };
            let want = input.matmul(&delta.t().unwrap()).unwrap();
            let y = |l: &Lin| l.forward_of(&x, swiglu).unwrap();
            let kept = rel(&(y(&adapted) - y(&base)).unwrap(), &want);
            let lost = rel(&(y(&merged) - y(&base)).unwrap(), &want);
            assert!(kept < 1e-2, "swiglu {swiglu}: the branch's change is {kept} off the update");
            assert!(lost > 0.5, "swiglu {swiglu}: the bf16 merge kept the update ({lost})");
            // the residual sublayer's end: r + y and its norm, with the branch in y
            let res = Tensor::randn(0f32, 1.0, (rows, out), &dev).unwrap();
            let norm = RmsNorm { w: Tensor::ones(out, DType::F32, &dev).unwrap(), eps: 1e-5 };
            let (s, _) = adapted.forward_add_norm(&x, swiglu, &res, &norm).unwrap();
            let s0 = (&res + y(&base)).unwrap();
            let kept = rel(&(s - s0).unwrap(), &want);
            assert!(kept < 1e-2, "swiglu {swiglu}: residual sum with the branch is {kept} off the update");
        }
    }
}
