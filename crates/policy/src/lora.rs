//! LoRA (Hu et al. 2021): a frozen linear layer y = x Wᵀ + b gains a trainable low-rank update,
//! y = x Wᵀ + b + (α/r)·(x Aᵀ) Bᵀ with A ∈ R^{r×in}, B ∈ R^{out×r}. As in PEFT, A starts
//! Kaiming-uniform (bound 1/√in) and B at zero, so the adapted model starts as the base model.

use crate::ops::Kernels;
use candle_core::{Device, Result, Tensor, Var};
use rand::{Rng, SeedableRng};

/// A linear layer of a decoder block that can carry an adapter (PEFT's `target_modules` names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Target {
    QProj,
    KProj,
    VProj,
    OProj,
    GateProj,
    UpProj,
    DownProj,
}

impl Target {
    /// Every linear layer of a block (PEFT's `all-linear` without the LM head).
    pub const ALL: [Target; 7] = [
        Target::QProj,
        Target::KProj,
        Target::VProj,
        Target::OProj,
        Target::GateProj,
        Target::UpProj,
        Target::DownProj,
    ];

    /// PEFT's module name.
    pub fn name(&self) -> &'static str {
        match self {
            Target::QProj => "q_proj",
            Target::KProj => "k_proj",
            Target::VProj => "v_proj",
            Target::OProj => "o_proj",
            Target::GateProj => "gate_proj",
            Target::UpProj => "up_proj",
            Target::DownProj => "down_proj",
        }
    }

    /// (in, out) features of the module in a block of `cfg` (the adapter's A is r × in, B out × r).
    pub fn dims(&self, cfg: &features::model::Config) -> (usize, usize) {
        let (h, q, kv, i) = (cfg.hidden, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.intermediate);
        match self {
            Target::QProj => (h, q),
            Target::KProj | Target::VProj => (h, kv),
            Target::OProj => (q, h),
            Target::GateProj | Target::UpProj => (h, i),
            Target::DownProj => (i, h),
        }
    }

    /// The module's path inside a block, as Hugging Face names it.
    pub fn path(&self) -> &'static str {
        match self {
            Target::QProj => "self_attn.q_proj",
            Target::KProj => "self_attn.k_proj",
            Target::VProj => "self_attn.v_proj",
            Target::OProj => "self_attn.o_proj",
            Target::GateProj => "mlp.gate_proj",
            Target::UpProj => "mlp.up_proj",
            Target::DownProj => "mlp.down_proj",
        }
    }
}

/// Rank, scale, placement and dropout of the adapters.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraConfig {
    pub rank: usize,
    pub alpha: f64,
    pub targets: Vec<Target>,
    /// Seed of A's initial draw (and, with the step count, of the dropout masks).
    pub seed: u64,
    /// PEFT's `lora_dropout`: the probability of dropping an input of the adapters' branch in a
    /// training pass ([`Dropout`]); 0 (the default) turns it off. Scoring and generation never drop.
    pub dropout: f64,
}

impl Default for LoraConfig {
    /// PEFT's common choice for causal LMs: r = 8, α = 16 on q_proj and v_proj, no dropout.
    fn default() -> Self {
        LoraConfig { rank: 8, alpha: 16.0, targets: vec![Target::QProj, Target::VProj], seed: 0, dropout: 0.0 }
    }
}

/// PEFT's LoRA dropout (`lora_dropout`): in a training pass the adapters' branch reads
/// dropout(x) — each input kept with probability 1 − p and scaled by 1/(1 − p) (inverted
/// dropout, as torch.nn.Dropout) — while the frozen path reads x. The masks come from one ChaCha20
/// stream per training step, drawn in the model's fixed layer order, so a step (and a resumed
/// run) is reproducible.
pub struct Dropout {
    p: f64,
    rng: std::sync::Mutex<rand_chacha::ChaCha20Rng>,
}

impl Dropout {
    /// The masks of one training step: `seed` (the adapters' seed) and `step` (the optimiser's
    /// step count) name the stream.
    pub fn new(p: f64, seed: u64, step: u64) -> Dropout {
        let mut h = blake3::Hasher::new();
        h.update(b"onepass-lora-dropout");
        h.update(&seed.to_le_bytes());
        h.update(&step.to_le_bytes());
        Dropout { p, rng: std::sync::Mutex::new(rand_chacha::ChaCha20Rng::from_seed(*h.finalize().as_bytes())) }
    }

    /// A (rows, inp) mask of 0 and 1/(1 − p).
    fn mask(&self, rows: usize, inp: usize, dev: &Device, dtype: candle_core::DType) -> Result<Tensor> {
        let keep = 1.0 / (1.0 - self.p);
        let mut rng = self.rng.lock().map_err(|_| candle_core::Error::Msg("dropout stream poisoned".into()))?;
        let m: Vec<f32> =
            (0..rows * inp).map(|_| if rng.random::<f64>() < self.p { 0.0 } else { keep as f32 }).collect();
        Tensor::from_vec(m, (rows, inp), dev)?.to_dtype(dtype)
    }
}

/// What a forward pass computes: with or without the adapters, with dropout on their branch
/// (training passes only), and whether it is a scoring pass that builds no graph.
#[derive(Clone, Copy)]
pub struct Pass<'a> {
    pub adapters: bool,
    pub dropout: Option<&'a Dropout>,
    /// The adapters enter as detached tensors: nothing of the pass is tracked, so the fused ops
    /// keep no activation for a backward (their values are the tracked pass's, bit for bit).
    /// A full-parameter policy's weights are variables everywhere and stay tracked.
    pub no_grad: bool,
}

impl Pass<'_> {
    /// The reference (base) model.
    pub const BASE: Pass<'static> = Pass { adapters: false, dropout: None, no_grad: false };
    /// The adapted model, deterministic (evaluation, and what a backward goes through).
    pub const ADAPTED: Pass<'static> = Pass { adapters: true, dropout: None, no_grad: false };
    /// [`Pass::ADAPTED`] without a graph: scoring (a rollout's old log-probabilities).
    pub const SCORE: Pass<'static> = Pass { adapters: true, dropout: None, no_grad: true };

    /// [`Pass::ADAPTED`] or [`Pass::BASE`].
    pub fn of(adapters: bool) -> Pass<'static> {
        if adapters {
            Pass::ADAPTED
        } else {
            Pass::BASE
        }
    }
}

impl LoraConfig {
    /// α/r.
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }
}

/// The trainable pair of one layer.
pub struct Adapter {
    /// A: (r, in).
    pub a: Var,
    /// B: (out, r).
    pub b: Var,
    pub scale: f64,
}

impl Adapter {
    /// A Kaiming-uniform with bound 1/√in (PEFT's `kaiming_uniform_(a=√5)`), B = 0.
    pub fn new(
        inp: usize,
        out: usize,
        rank: usize,
        scale: f64,
        rng: &mut rand_chacha::ChaCha20Rng,
        dev: &Device,
        dtype: candle_core::DType,
    ) -> Result<Adapter> {
        let bound = 1.0 / (inp as f64).sqrt();
        let a: Vec<f32> = (0..rank * inp).map(|_| rng.random_range(-bound..bound) as f32).collect();
        Ok(Adapter {
            a: Var::from_tensor(&Tensor::from_vec(a, (rank, inp), dev)?.to_dtype(dtype)?)?,
            b: Var::from_tensor(&Tensor::zeros((out, rank), dtype, dev)?)?,
            scale,
        })
    }

    /// (α/r)·B·A, the update merged into W.
    pub fn delta(&self) -> Result<Tensor> {
        self.b.as_tensor().matmul(self.a.as_tensor())? * self.scale
    }

    /// A fresh start: A drawn anew as in [`Adapter::new`], B = 0 (the adapted layer is W again).
    pub fn reset(&self, rng: &mut rand_chacha::ChaCha20Rng) -> Result<()> {
        let (rank, inp) = self.a.as_tensor().dims2()?;
        let bound = 1.0 / (inp as f64).sqrt();
        let a: Vec<f32> = (0..rank * inp).map(|_| rng.random_range(-bound..bound) as f32).collect();
        let t = self.a.as_tensor();
        self.a.set(&Tensor::from_vec(a, (rank, inp), t.device())?.to_dtype(t.dtype())?)?;
        self.b.set(&self.b.as_tensor().zeros_like()?)
    }
}

/// What a layer's reference pass (`Pass::adapters` false: the policy the KL is measured
/// against) computes.
#[derive(Clone)]
pub enum Reference {
    /// x Wᵀ + b: the frozen weight alone — the initial policy, or after a merge with the
    /// reference moved to it, the chunk's start.
    Frozen,
    /// x Wᵀ + b + (α/r)(x aᵀ)bᵀ with a frozen copy (a, b) of the adapter: the policy at a
    /// chunk's start while the adapter persists.
    Snapshot { a: Tensor, b: Tensor },
    /// x W₀ᵀ + b with W₀ a weight from before merges: the initial policy after adapters were
    /// merged into W.
    Weight(Tensor),
}

/// A frozen linear layer with an optional adapter.
pub struct Linear {
    /// W: (out, in), frozen (adapters of past chunks merged in, when they are merged).
    pub w: Tensor,
    pub bias: Option<Tensor>,
    pub adapter: Option<Adapter>,
    pub reference: Reference,
    /// W packed for the CPU's bf16 or f32 products ([`PackedWeight`]) when the model runs them
    /// ([`crate::PolicyModel::use_packed_products`]); None: candle's products in W's dtype.
    pub packed: Option<std::sync::Arc<PackedWeight>>,
    /// The reference weight of [`Reference::Weight`] packed likewise, so the policy and its
    /// reference round their products the same way (a KL of exactly 0 at the reference).
    pub packed_reference: Option<std::sync::Arc<PackedWeight>>,
}

/// Why a policy that trains with bf16 products does not merge its adapters.
pub const BF16_MERGE: &str = "merging adapters into weights that train with bf16 products would round the \
     merged update away (at RLHF learning rates (α/r)BA is far below half a bf16 ulp of W): use persistent \
     adapters (policy.adapter = \"persistent\") with bf16 products, or f32";

/// A frozen weight W (out, in) packed once for the CPU's products, in the layouts of the
/// `kernels::packed` kernels.
/// - bf16 ([`PackedWeight::bf16`], `kernels::bf16`: each weight and each input rounded to
///   bf16, the products summed in f32 — `VDPBF16PS`'s arithmetic on AVX-512 BF16): W for the
///   forward's x Wᵀ and Wᵀ for the backward's g W, both streaming half the bytes of f32; two
///   bf16 copies take the memory of one f32 copy.
/// - f32 ([`PackedWeight::f32`], `kernels::f32mm`: each output one fused multiply-add chain
///   from 0 over the inputs in order, the bits φ's extraction and generation compute): W
///   packed for the forward of passes of at most [`F32_PACKED_MAX_ROWS`] rows, where `gemm`
///   packs W again on every call; the `gemm` call of onepass's own products
///   (`crate::mm::product`) for longer forwards and for every backward g W. Measured in whole
///   passes (session 33, README): the online loop's chunk 16.3–16.5 s with the decoder packed
///   against 18.9–19.0 s all on `gemm`; `train_step` 8 × 256 (2,048 rows) and the backward
///   faster on `gemm`. One more f32 copy of each frozen weight.
pub struct PackedWeight {
    /// W itself (f32, contiguous; f32 only): `gemm`'s products where the packed kernel is the
    /// slower. It shares the weight's storage where the weight is f32 and contiguous.
    w: Option<Tensor>,
    fwd: Box<dyn kernels::packed::PackedMatrix>,
    /// Wᵀ packed (bf16 only).
    bwd: Option<Box<dyn kernels::packed::PackedMatrix>>,
    /// The products round their inputs to bf16 (a merge would round its update away).
    pub bf16: bool,
}

/// The longest pass (rows = sequences × tokens) whose f32 forward runs on the packed kernel;
/// longer ones take `gemm` ([`PackedWeight`]'s measurements).
pub const F32_PACKED_MAX_ROWS: usize = 1024;

impl PackedWeight {
    /// Packs `w` (out, in) for the bf16 kernel.
    pub fn bf16(w: &Tensor) -> Result<PackedWeight> {
        let (v, vt, out, inp) = both_layouts(w)?;
        Ok(PackedWeight {
            w: None,
            fwd: Box::new(kernels::bf16::Bf16Matrix::from_f32(&v, out, inp)),
            bwd: Some(Box::new(kernels::bf16::Bf16Matrix::from_f32(&vt, inp, out))),
            bf16: true,
        })
    }

    /// Packs `w` (out, in) for the f32 kernel.
    pub fn f32(w: &Tensor) -> Result<PackedWeight> {
        let (out, inp) = w.dims2()?;
        let w = w.to_dtype(candle_core::DType::F32)?.contiguous()?;
        let v: Vec<f32> = w.flatten_all()?.to_vec1()?;
        Ok(PackedWeight {
            w: Some(w),
            fwd: Box::new(kernels::f32mm::F32Matrix::from_f32(&v, out, inp)),
            bwd: None,
            bf16: false,
        })
    }

    /// Whether a forward of `rows` rows runs on the packed kernel.
    fn packed_forward(&self, rows: usize) -> bool {
        self.w.is_none() || rows <= F32_PACKED_MAX_ROWS
    }

    /// [`Self::forward`] on values: x (rows × in, row-major; T must be f32) to (rows × out),
    /// with no tensor made or copied around the product.
    pub(crate) fn forward_values<T: num_traits::Float + candle_core::WithDType>(
        &self,
        x: &[T],
        rows: usize,
    ) -> Result<Vec<T>> {
        use crate::mm::{product, Mat};
        let x = f32_values(x)?;
        let y = match &self.w {
            Some(w) if !self.packed_forward(rows) => {
                let (out, inp) = w.dims2()?;
                crate::mm::with_slices::<f32, _, 1>([w], |[w]| {
                    product(rows, out, inp, Mat::rows(x, inp), Mat::t(w, inp))
                })?
            }
            _ => self.fwd.matmul_t(x, rows),
        };
        Ok(y.into_iter().map(|v| T::from(v).unwrap_or_else(T::nan)).collect())
    }

    /// [`Self::backward`] on values: g (rows × out; T must be f32) to g W (rows × in).
    pub(crate) fn backward_values<T: num_traits::Float + candle_core::WithDType>(
        &self,
        g: &[T],
        rows: usize,
    ) -> Result<Vec<T>> {
        use crate::mm::{product, Mat};
        let g = f32_values(g)?;
        let dx = match (&self.bwd, &self.w) {
            (Some(b), _) => b.matmul_t(g, rows),
            (None, Some(w)) => {
                let (out, inp) = w.dims2()?;
                crate::mm::with_slices::<f32, _, 1>([w], |[w]| {
                    product(rows, inp, out, Mat::rows(g, out), Mat::rows(w, inp))
                })?
            }
            (None, None) => candle_core::bail!("a packed weight with neither Wᵀ packed nor W kept"),
        };
        Ok(dx.into_iter().map(|v| T::from(v).unwrap_or_else(T::nan)).collect())
    }

    /// x Wᵀ for x (rows, in) f32 on the CPU: (rows, out).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let rows = check_input(x, self.fwd.k(), self.fwd.n())?;
        let y = crate::mm::with_slices::<f32, _, 1>([&x.contiguous()?], |[x]| self.forward_values(x, rows))??;
        Tensor::from_vec(y, (rows, self.fwd.n()), x.device())
    }

    /// g W for g (rows, out) f32 on the CPU: (rows, in) — the gradient of x.
    pub fn backward(&self, g: &Tensor) -> Result<Tensor> {
        let rows = check_input(g, self.fwd.n(), self.fwd.k())?;
        let dx = crate::mm::with_slices::<f32, _, 1>([&g.contiguous()?], |[g]| self.backward_values(g, rows))??;
        Tensor::from_vec(dx, (rows, self.fwd.k()), g.device())
    }
}

/// W (out, in) row-major as f32 values, and Wᵀ's: (W, Wᵀ, out, in).
fn both_layouts(w: &Tensor) -> Result<(Vec<f32>, Vec<f32>, usize, usize)> {
    let (out, inp) = w.dims2()?;
    let v: Vec<f32> = w.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1()?;
    let vt: Vec<f32> = w.t()?.to_dtype(candle_core::DType::F32)?.contiguous()?.flatten_all()?.to_vec1()?;
    Ok((v, vt, out, inp))
}

/// A packed weight's input: (rows, k) f32 on the CPU, for a weight of n outputs; its rows.
fn check_input(x: &Tensor, k: usize, n: usize) -> Result<usize> {
    let (rows, xk) = x.dims2()?;
    if xk != k || x.dtype() != candle_core::DType::F32 || !x.device().is_cpu() {
        candle_core::bail!(
            "a packed product of a ({rows}, {xk}) {:?} input on {:?} with a ({n}, {k}) weight: expected f32 on the CPU",
            x.dtype(),
            x.device(),
        );
    }
    Ok(rows)
}

/// x Wᵀ on the packed bf16 kernel with the gradient of x alone (g W, on the same kernel):
/// [`frozen_matmul`]'s routing for a weight that trains with bf16 products.
pub fn packed_matmul(x: &Tensor, p: &std::sync::Arc<PackedWeight>) -> Result<Tensor> {
    let y = p.forward(&x.detach())?;
    let p = p.clone();
    crate::ops::routed(x, y, "frozen-matmul-bf16", move |_, _, g| p.backward(&g.contiguous()?))
}

impl Linear {
    /// (…, in) → (…, out): x Wᵀ + b + (α/r)(x Aᵀ)Bᵀ, on the flattened rows; without the
    /// adapter's term when `pass.adapters` is false (the reference policy); the adapter's x
    /// through [`Dropout`] when the pass has one.
    pub fn forward(&self, x: &Tensor, pass: Pass<'_>, k: Kernels) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let inp = *dims.last().expect("rank ≥ 1");
        let rows = x.elem_count() / inp.max(1);
        // rows already (the decoder's activations are two-dimensional): no reshape node
        let x2 = if dims.len() == 2 { x.clone() } else { x.reshape((rows, inp))? };
        let fused = k == Kernels::Fused;
        // the adapted product as one op: the adapted pass without dropout, or a snapshot reference
        let low_rank = match (&self.adapter, pass.adapters, &self.reference) {
            (Some(ad), true, _) if pass.dropout.is_none_or(|d| d.p == 0.0) => {
                let (a, b) = match pass.no_grad {
                    true => (ad.a.as_tensor().detach(), ad.b.as_tensor().detach()),
                    false => (ad.a.as_tensor().clone(), ad.b.as_tensor().clone()),
                };
                Some((a, b, ad.scale))
            }
            (Some(ad), false, Reference::Snapshot { a, b }) => Some((a.clone(), b.clone(), ad.scale)),
            _ => None,
        };
        if let (true, Some((a, b, scale))) = (fused && lora_fuses(x.dtype()), low_rank.clone()) {
            let mut y = lora_matmul(&x2, &self.w, self.packed.as_ref(), &a, &b, scale)?;
            if let Some(bias) = &self.bias {
                y = y.broadcast_add(bias)?;
            }
            return self.shaped(y, dims);
        }
        if let (Kernels::Routed, Some((a, b, scale)), false) = (k, low_rank, self.w.is_variable()) {
            let mut y = lora_matmul_routed(&x2, &self.w, &a, &b, scale)?;
            if let Some(bias) = &self.bias {
                y = y.broadcast_add(bias)?;
            }
            return self.shaped(y, dims);
        }
        let mut y = match (&self.reference, pass.adapters) {
            (Reference::Weight(w0), false) => match &self.packed_reference {
                Some(p) if fused => packed_matmul(&x2, p)?,
                _ => frozen_matmul(&x2, w0, k)?,
            },
            _ => match &self.packed {
                Some(p) if fused => packed_matmul(&x2, p)?,
                _ => frozen_matmul(&x2, &self.w, k)?,
            },
        };
        if let Some(b) = &self.bias {
            y = y.broadcast_add(b)?;
        }
        match (&self.adapter, pass.adapters, &self.reference) {
            (Some(ad), true, _) => {
                let xa = match pass.dropout {
                    Some(d) if d.p > 0.0 => (&x2 * d.mask(rows, inp, x2.device(), x2.dtype())?)?,
                    _ => x2.clone(),
                };
                let (a, b) = match pass.no_grad {
                    true => (ad.a.as_tensor().detach(), ad.b.as_tensor().detach()),
                    false => (ad.a.as_tensor().clone(), ad.b.as_tensor().clone()),
                };
                let low = xa.matmul(&a.t()?)?.matmul(&b.t()?)?;
                y = (y + (low * ad.scale)?)?;
            }
            (Some(ad), false, Reference::Snapshot { a, b }) => {
                let low = x2.matmul(&a.t()?)?.matmul(&b.t()?)?;
                y = (y + (low * ad.scale)?)?;
            }
            _ => {}
        }
        self.shaped(y, dims)
    }

    /// [`Linear::forward`] of rows x (b·t, in) written as heads (b, n, t, hd), RoPE on the way
    /// ([`crate::ops::HeadsOut`]) — `forward` then [`crate::ops::split_heads`], the same values
    /// and gradients. On the fused kernels without a bias, an adapted product writes its output
    /// in heads itself ([`lora_matmul_to`]) and a frozen one is one routed node over x whose
    /// gradient is the product's (g ↦ g W after split_heads' backward): the rows (n·hd values
    /// per token) never enter the graph. Otherwise the two ops.
    pub fn forward_heads(&self, x: &Tensor, pass: Pass<'_>, k: Kernels, heads: crate::ops::HeadsOut) -> Result<Tensor> {
        let two = || {
            let (b, t, n, hd) = heads.dims;
            crate::ops::split_heads(
                &self.forward(x, pass, k)?,
                (b, t, n, hd),
                heads.rope.as_ref().map(|(c, s, i)| (c, s, *i)),
            )
        };
        if k != Kernels::Fused || self.bias.is_some() || x.rank() != 2 || !lora_fuses(x.dtype()) {
            return two();
        }
        if let Some(xg) = self.frozen_x_grad(pass, k) {
            if !x.track_op() {
                return two();
            }
            let (b, t, n, hd) = heads.dims;
            let rope = heads.rope.as_ref().map(|(c, s, i)| (c, s, *i));
            let v = crate::ops::heads_values(&self.forward(&x.detach(), pass, k)?, (b, t, n, hd), rope, true, false)?;
            return crate::ops::routed(x, v, "frozen-matmul-heads", move |_, _, g| xg.apply(&heads.rows_grad(g)?));
        }
        match (&self.adapter, pass.adapters) {
            (Some(ad), true) if pass.dropout.is_none_or(|d| d.p == 0.0) => {
                let (a, b) = match pass.no_grad {
                    true => (ad.a.as_tensor().detach(), ad.b.as_tensor().detach()),
                    false => (ad.a.as_tensor().clone(), ad.b.as_tensor().clone()),
                };
                lora_matmul_to(x, &self.w, self.packed.as_ref(), &a, &b, ad.scale, Some(heads))
            }
            _ => two(),
        }
    }

    /// y (rows, out) in the input's leading dimensions (itself for two-dimensional input).
    fn shaped(&self, y: Tensor, dims: Vec<usize>) -> Result<Tensor> {
        if dims.len() == 2 {
            return Ok(y);
        }
        let mut out = dims;
        *out.last_mut().expect("rank ≥ 1") = self.w.dim(0)?;
        y.reshape(out)
    }

    /// W + (α/r)·B·A (W itself without an adapter).
    pub fn merged(&self) -> Result<Tensor> {
        match &self.adapter {
            Some(ad) => &self.w + ad.delta()?,
            None => Ok(self.w.clone()),
        }
    }

    /// The weight the reference pass multiplies by, with any snapshot folded in.
    fn reference_weight(&self) -> Result<Tensor> {
        match (&self.reference, &self.adapter) {
            (Reference::Frozen, _) => Ok(self.w.clone()),
            (Reference::Weight(w0), _) => Ok(w0.clone()),
            (Reference::Snapshot { a, b }, Some(ad)) => Ok((&self.w + (b.matmul(a)? * ad.scale)?)?.detach()),
            (Reference::Snapshot { .. }, None) => Ok(self.w.clone()),
        }
    }

    /// W ← W + (α/r)·B·A in W's dtype, the reference unchanged (it keeps the weight it had,
    /// as [`Reference::Weight`] when it was W). The adapter is then reset by the caller.
    pub fn merge(&mut self) -> Result<()> {
        let Some(ad) = &self.adapter else { return Ok(()) };
        if self.packed.as_ref().is_some_and(|p| p.bf16) {
            candle_core::bail!("{}", BF16_MERGE);
        }
        if !matches!(self.reference, Reference::Weight(_)) {
            let was_w = matches!(self.reference, Reference::Frozen);
            self.reference = Reference::Weight(self.reference_weight()?);
            // f32 products: the reference's packing is W's own when the reference was W
            self.packed_reference = match (&self.packed, &self.reference) {
                (Some(p), _) if was_w => Some(p.clone()),
                (Some(_), Reference::Weight(w0)) => Some(std::sync::Arc::new(PackedWeight::f32(w0)?)),
                _ => None,
            };
        }
        // detached: W stays frozen (no path from it back to the adapter's variables)
        self.w = (&self.w + ad.delta()?.detach().to_dtype(self.w.dtype())?)?.detach();
        if self.packed.is_some() {
            self.packed = Some(std::sync::Arc::new(PackedWeight::f32(&self.w)?));
        }
        Ok(())
    }

    /// Packs W (and a reference weight) for the CPU's packed products ([`PackedWeight`]): bf16
    /// or f32.
    pub fn pack(&mut self, bf16: bool) -> Result<()> {
        let pack = |w: &Tensor| if bf16 { PackedWeight::bf16(w) } else { PackedWeight::f32(w) };
        self.packed = Some(std::sync::Arc::new(pack(&self.w)?));
        self.packed_reference = match &self.reference {
            Reference::Weight(w0) => Some(std::sync::Arc::new(pack(w0)?)),
            _ => None,
        };
        Ok(())
    }

    /// The gradient of x of this layer's product in `pass` when that product is a frozen one
    /// (no adapter term in the pass: no adapter, or the reference pass of an adapter whose
    /// reference is W or a merged W₀), with fused kernels and a W that is no variable: what the
    /// product's own backward computes (the packed kernel's g W, or [`FrozenMatmul`]'s), as an
    /// owned value a fused op's backward can keep. None otherwise.
    pub(crate) fn frozen_x_grad(&self, pass: Pass<'_>, k: Kernels) -> Option<XGrad> {
        let low_rank = matches!(
            (&self.adapter, pass.adapters, &self.reference),
            (Some(_), true, _) | (Some(_), false, Reference::Snapshot { .. })
        );
        if low_rank
            || k != Kernels::Fused
            || self.w.is_variable()
            || self.bias.as_ref().is_some_and(|b| b.is_variable())
        {
            return None;
        }
        let (w, packed) = match (&self.reference, pass.adapters) {
            (Reference::Weight(w0), false) => (w0, &self.packed_reference),
            _ => (&self.w, &self.packed),
        };
        Some(match packed {
            Some(p) => XGrad::Packed(p.clone()),
            None => XGrad::Frozen(w.clone()),
        })
    }

    /// This layer's product in `pass` for a fused op that holds it ([`Inner`]): frozen as
    /// [`Linear::frozen_x_grad`], or adapted — the adapted pass of a training or evaluation
    /// pass that tracks (not a scoring pass), without dropout, on the fused kernels, with no
    /// bias and a frozen W — as LoRA's op. None otherwise (the layer's own ops then).
    pub(crate) fn inner(&self, pass: Pass<'_>, k: Kernels) -> Option<Inner> {
        if let Some(xg) = self.frozen_x_grad(pass, k) {
            return Some(Inner::Frozen(xg));
        }
        let ad = self.adapter.as_ref()?;
        let plain = pass.adapters && !pass.no_grad && pass.dropout.is_none_or(|d| d.p == 0.0);
        if !plain || k != Kernels::Fused || self.bias.is_some() || self.w.is_variable() {
            return None;
        }
        let op = LoraMatmul {
            w: self.w.contiguous().ok()?,
            packed: self.packed.clone(),
            scale: ad.scale,
            xa: std::sync::Mutex::new(None),
            heads: None,
        };
        Some(Inner::Adapted { op, a: ad.a.as_tensor().clone(), b: ad.b.as_tensor().clone() })
    }

    /// The reference becomes this layer's current function: W itself when B = 0, else a
    /// frozen copy of the adapter.
    pub fn reference_here(&mut self) -> Result<()> {
        self.reference = match &self.adapter {
            Some(ad) if !is_zero(ad.b.as_tensor())? => {
                // copies outside the graph: the reference never carries a gradient
                Reference::Snapshot { a: ad.a.as_tensor().copy()?.detach(), b: ad.b.as_tensor().copy()?.detach() }
            }
            _ => Reference::Frozen,
        };
        self.packed_reference = None;
        Ok(())
    }
}

/// Every element exactly 0.
pub fn is_zero(t: &Tensor) -> Result<bool> {
    Ok(t.abs()?.max_all()?.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()? == 0.0)
}

/// The gradient of x of a frozen product x Wᵀ, g ↦ g W, held by value
/// ([`Linear::frozen_x_grad`]): the product's own backward, so a fused op that calls it gives
/// the bits the product's graph node would.
pub(crate) enum XGrad {
    /// The packed kernel's backward ([`PackedWeight::backward`]).
    Packed(std::sync::Arc<PackedWeight>),
    /// [`FrozenMatmul`]'s backward (f32 or f64 on the CPU; other dtypes candle's matmul, as
    /// [`frozen_matmul`] routes them).
    Frozen(Tensor),
}

impl XGrad {
    /// g W for g (rows, out).
    pub(crate) fn apply(&self, g: &Tensor) -> Result<Tensor> {
        let g = g.contiguous()?;
        match self {
            XGrad::Packed(p) => p.backward(&g),
            XGrad::Frozen(w) => {
                let op = FrozenMatmul { w: w.contiguous()? };
                match (g.dtype(), w.dtype()) {
                    (candle_core::DType::F32, candle_core::DType::F32) => op.bwd_t::<f32>(&g),
                    (candle_core::DType::F64, candle_core::DType::F64) => op.bwd_t::<f64>(&g),
                    _ => g.matmul(w),
                }
            }
        }
    }
}

/// A layer's product in a pass, held by a fused op that computes it outside the graph
/// ([`Linear::inner`]): frozen (its backward g ↦ g W), or adapted — LoRA's op itself, kept with
/// the x Aᵀ its forward saved, so its backward is the graph node's, bit for bit.
pub(crate) enum Inner {
    Frozen(XGrad),
    Adapted {
        op: LoraMatmul,
        /// A and B as the graph holds them (the variables' tensors).
        a: Tensor,
        b: Tensor,
    },
}

impl Inner {
    /// The adapter's (A, B) when adapted: what the fused op's graph node must take as inputs.
    pub(crate) fn adapter(&self) -> Option<(&Tensor, &Tensor)> {
        match self {
            Inner::Frozen(_) => None,
            Inner::Adapted { a, b, .. } => Some((a, b)),
        }
    }

    /// y = x Wᵀ (+ the low-rank term) for x (rows, in) outside the graph: `lin.forward` on a
    /// detached x when frozen, LoRA's op's forward when adapted (which saves x Aᵀ).
    pub(crate) fn forward(&self, lin: &Linear, x: &Tensor, pass: Pass<'_>, k: Kernels) -> Result<Tensor> {
        match self {
            Inner::Frozen(_) => lin.forward(&x.detach(), pass, k),
            Inner::Adapted { op, a, b } => {
                let (x, a, b) = (x.detach().contiguous()?, a.detach().contiguous()?, b.detach().contiguous()?);
                let rows = x.dim(0)?;
                let out = op.w.dim(0)?;
                match x.dtype() {
                    candle_core::DType::F32 => {
                        let y = crate::mm::with_slices::<f32, _, 3>([&x, &a, &b], |[x, a, b]| op.fwd(x, a, b, rows))??;
                        Tensor::from_vec(y, (rows, out), x.device())
                    }
                    candle_core::DType::F64 => {
                        let y = crate::mm::with_slices::<f64, _, 3>([&x, &a, &b], |[x, a, b]| op.fwd(x, a, b, rows))??;
                        Tensor::from_vec(y, (rows, out), x.device())
                    }
                    other => candle_core::bail!("lora-matmul: the fused op runs in f32 or f64, not {other:?}"),
                }
            }
        }
    }

    /// ∂x (and, adapted, (∂A, ∂B)) at ∂L/∂y = g; `x`, the forward's input, is read by an
    /// adapted product alone (its ∂A), and an error there when missing.
    pub(crate) fn backward(&self, x: Option<&Tensor>, g: &Tensor) -> Result<(Tensor, Option<(Tensor, Tensor)>)> {
        match self {
            Inner::Frozen(xg) => Ok((xg.apply(g)?, None)),
            Inner::Adapted { op, a, b } => {
                let Some(x) = x else { candle_core::bail!("lora-matmul: the backward needs the forward's input") };
                let (dx, da, db) = op.grads(&x.detach(), &a.detach(), &b.detach(), &g.contiguous()?, true)?;
                let dx = dx.ok_or_else(|| candle_core::Error::Msg("lora-matmul: no gradient of x".into()))?;
                Ok((dx, Some((da, db))))
            }
        }
    }
}

/// x Wᵀ for a frozen W (rows, in) × (out, in) whose backward pass computes only ∂/∂x = g W.
/// candle's matmul backward also forms the weight's gradient xᵀg, a second matmul as large as
/// the forward one, even for a weight that is no variable; over every frozen layer and the LM
/// head that is a third of a training step. With the fused kernels (the CPU) the product is
/// [`FrozenMatmul`], an op of x alone whose gradient is g W; routed (CUDA), the device's
/// product with that gradient; composed, the plain matmul (W is no variable: its gradient is
/// computed and never read). A W that is a variable (a full-parameter model) takes
/// [`WeightMatmul`] on the fused path, elsewhere the plain matmul: both give W its gradient.
pub fn frozen_matmul(x: &Tensor, w: &Tensor, k: Kernels) -> Result<Tensor> {
    if w.is_variable()
        && k == Kernels::Fused
        && x.device().is_cpu()
        && matches!(x.dtype(), candle_core::DType::F32 | candle_core::DType::F64)
        && x.dtype() == w.dtype()
    {
        return x.contiguous()?.apply_op2(&w.contiguous()?, WeightMatmul);
    }
    if k == Kernels::Composed || w.is_variable() {
        return x.matmul(&w.t()?);
    }
    if k == Kernels::Routed {
        // the device's product outside the graph, the gradient of x alone (no xᵀg for W)
        let y = x.detach().matmul(&w.t()?)?;
        let w = w.clone();
        return crate::ops::routed(x, y, "frozen-matmul", move |_, _, g| g.matmul(&w));
    }
    if !x.device().is_cpu() {
        candle_core::bail!("frozen-matmul: the fused kernels are CPU-only (use Kernels::Composed on {:?})", x.device());
    }
    if !matches!(x.dtype(), candle_core::DType::F32 | candle_core::DType::F64) || x.dtype() != w.dtype() {
        // other dtypes: candle's product, routed to carry the gradient of x alone
        let y = x.detach().matmul(&w.t()?)?;
        let w = w.clone();
        return crate::ops::routed(x, y, "frozen-matmul", move |_, _, g| g.matmul(&w));
    }
    x.contiguous()?.apply_op1(FrozenMatmul { w: w.contiguous()? })
}

/// x Wᵀ of x (rows, in), W (out, in) f32 or f64 on the CPU, and its gradient g W: each product
/// one `gemm` call (candle's matmul's, with its operands, strides and threads: the same values)
/// written straight into the op's output, where candle's matmul zero-filled its output and
/// `routed` then copied the value into the graph — two passes over every activation, on one
/// thread, for each of the step's ~400 frozen products.
struct FrozenMatmul {
    w: Tensor,
}

impl FrozenMatmul {
    fn fwd<T: num_traits::Float + candle_core::WithDType>(&self, x: &[T], rows: usize, inp: usize) -> Result<Vec<T>> {
        let out = self.w.dim(0)?;
        if self.w.dim(1)? != inp || x.len() != rows * inp {
            candle_core::bail!("frozen-matmul: a ({rows}, {inp}) input for a {:?} weight", self.w.dims());
        }
        crate::mm::with_slices::<T, _, 1>([&self.w], |[w]| x_wt(x, rows, inp, w, out))
    }

    fn bwd_t<T: num_traits::Float + candle_core::WithDType>(&self, g: &Tensor) -> Result<Tensor> {
        let (out, inp) = self.w.dims2()?;
        let (rows, n) = g.dims2()?;
        if n != out {
            candle_core::bail!("frozen-matmul: a ({rows}, {n}) gradient for a {:?} weight", self.w.dims());
        }
        let dx = crate::mm::with_slices::<T, _, 2>([g, &self.w], |[g, w]| g_w(g, rows, out, w, inp))?;
        Tensor::from_vec(dx, (rows, inp), g.device())
    }
}

impl candle_core::CustomOp1 for FrozenMatmul {
    fn name(&self) -> &'static str {
        "frozen-matmul"
    }

    fn cpu_fwd(
        &self,
        s: &candle_core::CpuStorage,
        l: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        use candle_core::CpuStorage;
        let (rows, inp) = l.shape().dims2()?;
        let out = match s {
            CpuStorage::F32(_) => CpuStorage::F32(self.fwd(crate::mm::slice(s, l)?, rows, inp)?),
            CpuStorage::F64(_) => CpuStorage::F64(self.fwd(crate::mm::slice(s, l)?, rows, inp)?),
            _ => candle_core::bail!("frozen-matmul: the fused op runs in f32 or f64"),
        };
        Ok((out, candle_core::Shape::from((rows, self.w.dim(0)?))))
    }

    fn bwd(&self, _: &Tensor, _: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        let g = g.contiguous()?;
        Ok(Some(match g.dtype() {
            candle_core::DType::F32 => self.bwd_t::<f32>(&g)?,
            candle_core::DType::F64 => self.bwd_t::<f64>(&g)?,
            other => candle_core::bail!("frozen-matmul: no backward in {other:?}"),
        }))
    }
}

/// x Wᵀ (rows, out) of row-major x (rows, in) and W (out, in): candle's matmul's `gemm` call.
fn x_wt<T: num_traits::Float + 'static>(x: &[T], rows: usize, inp: usize, w: &[T], out: usize) -> Vec<T> {
    crate::mm::product(rows, out, inp, crate::mm::Mat::rows(x, inp), crate::mm::Mat::t(w, inp))
}

/// g W (rows, in) of row-major g (rows, out) and W (out, in): the input's gradient of x Wᵀ, as
/// candle's matmul backward forms it.
fn g_w<T: num_traits::Float + 'static>(g: &[T], rows: usize, out: usize, w: &[T], inp: usize) -> Vec<T> {
    crate::mm::product(rows, inp, out, crate::mm::Mat::rows(g, out), crate::mm::Mat::rows(w, inp))
}

/// x Wᵀ of x (rows, in) and a W (out, in) that trains (a full-parameter model's weight, issue
/// 30's `update = "full"`), f32 or f64 on the CPU, with both gradients: ∂x = g W and
/// ∂W = (xᵀ g)ᵀ. Each product is the `gemm` call candle's matmul and its backward make (the
/// same operands, strides and threads: the same bits, tested), written straight into fresh
/// memory; candle's composition `x.matmul(&w.t())` zero-filled each product's output, put a
/// transpose node in the graph and added the (in, out) gradient into W's (out, in) one through
/// a strided view. On SmolLM2 (`rm_step`, every weight, 2 pairs × 256 tokens, 2 threads) a step
/// took 6.7–7.0 s with this op against 7.5–8.5 s without (session 29).
struct WeightMatmul;

impl WeightMatmul {
    fn fwd<T: num_traits::Float + candle_core::WithDType>(
        x: &[T],
        (rows, inp): (usize, usize),
        w: &[T],
        (out, w_in): (usize, usize),
    ) -> Result<Vec<T>> {
        if w_in != inp || x.len() != rows * inp || w.len() != out * inp {
            candle_core::bail!("weight-matmul: a ({rows}, {inp}) input for a ({out}, {w_in}) weight");
        }
        Ok(x_wt(x, rows, inp, w, out))
    }

    fn bwd_t<T: num_traits::Float + candle_core::WithDType>(
        x: &Tensor,
        w: &Tensor,
        g: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let (out, inp) = w.dims2()?;
        let (rows, n) = g.dims2()?;
        if n != out || x.dims2()? != (rows, inp) {
            candle_core::bail!(
                "weight-matmul: a ({rows}, {n}) gradient for {:?} x and a {:?} weight",
                x.dims(),
                w.dims()
            );
        }
        use crate::mm::Mat;
        let (dx, dw) = crate::mm::with_slices::<T, _, 3>([x, w, g], |[x, w, g]| {
            // ∂W: xᵀ g (in, out) as candle forms it, stored as (out, in)
            let dw = crate::mm::product_transposed(inp, out, rows, Mat::t(x, inp), Mat::rows(g, out));
            (g_w(g, rows, out, w, inp), dw)
        })?;
        Ok((Tensor::from_vec(dx, (rows, inp), g.device())?, Tensor::from_vec(dw, (out, inp), g.device())?))
    }
}

impl candle_core::CustomOp2 for WeightMatmul {
    fn name(&self) -> &'static str {
        "weight-matmul"
    }

    fn cpu_fwd(
        &self,
        s1: &candle_core::CpuStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CpuStorage,
        l2: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        use crate::mm::slice;
        use candle_core::CpuStorage;
        let (xd, wd) = (l1.shape().dims2()?, l2.shape().dims2()?);
        let out = match (s1, s2) {
            (CpuStorage::F32(_), CpuStorage::F32(_)) => {
                CpuStorage::F32(Self::fwd(slice(s1, l1)?, xd, slice(s2, l2)?, wd)?)
            }
            (CpuStorage::F64(_), CpuStorage::F64(_)) => {
                CpuStorage::F64(Self::fwd(slice(s1, l1)?, xd, slice(s2, l2)?, wd)?)
            }
            _ => candle_core::bail!("weight-matmul: the fused op runs in f32 or f64, x and W alike"),
        };
        Ok((out, candle_core::Shape::from((xd.0, wd.0))))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = g.contiguous()?;
        let (dx, dw) = match g.dtype() {
            candle_core::DType::F32 => Self::bwd_t::<f32>(x, w, &g)?,
            candle_core::DType::F64 => Self::bwd_t::<f64>(x, w, &g)?,
            other => candle_core::bail!("weight-matmul: no backward in {other:?}"),
        };
        Ok((Some(dx), Some(dw)))
    }
}

/// [`lora_matmul`]'s function on the routed path (CUDA's): y = x Wᵀ + s (x Aᵀ) Bᵀ by the
/// device's products outside the graph, one node over (x, A, B) whose gradients are
/// ∂x = g W + s (g B) A, ∂A = s (g B)ᵀ x, ∂B = s gᵀ (x Aᵀ) (x Aᵀ recomputed). Autograd through
/// the composition kept five nodes per layer, each with a zeroed gradient and an add, and formed
/// the frozen W's dropped gradient xᵀ g.
pub fn lora_matmul_routed(x: &Tensor, w: &Tensor, a: &Tensor, b: &Tensor, scale: f64) -> Result<Tensor> {
    let xd = x.detach();
    let y = (xd.matmul(&w.t()?)? + (xd.matmul(&a.t()?)?.matmul(&b.t()?)? * scale)?)?;
    let w = w.clone();
    crate::ops::routed3((x, a, b), y, "lora-matmul", move |x, a, b, _, g| {
        let gb = (g.matmul(b)? * scale)?;
        let dx = match x.track_op() {
            true => Some((g.matmul(&w)? + gb.matmul(a)?)?),
            false => None,
        };
        let da = match a.track_op() {
            true => Some(gb.t()?.matmul(x)?),
            false => None,
        };
        let db = match b.track_op() {
            true => Some((g.t()?.matmul(&x.matmul(&a.t()?)?)? * scale)?),
            false => None,
        };
        Ok((dx, da, db))
    })
}

/// Whether [`lora_matmul`] computes in `dtype` (else the composition of candle's ops).
fn lora_fuses(dtype: candle_core::DType) -> bool {
    matches!(dtype, candle_core::DType::F32 | candle_core::DType::F64)
}

/// LoRA's adapted product y = x Wᵀ + s (x Aᵀ) Bᵀ as one op of (x, A, B) on the CPU (f32, f64;
/// W frozen, on the packed bf16 kernel when `packed`). Backward, with g = ∂L/∂y and
/// gB = g B (rows × r): ∂/∂x = g W + s gB A, ∂/∂A = s gBᵀ x, ∂/∂B = s gᵀ (x Aᵀ) — x Aᵀ
/// recomputed (rows × r). The composition (frozen product, two adapter matmuls, the scale, the
/// sum) put five (rows × out) tensors in the graph and, in the backward, a zero-filled
/// accumulator and a sum for each: ten passes over each adapted layer's output per step.
pub fn lora_matmul(
    x: &Tensor,
    w: &Tensor,
    packed: Option<&std::sync::Arc<PackedWeight>>,
    a: &Tensor,
    b: &Tensor,
    scale: f64,
) -> Result<Tensor> {
    lora_matmul_to(x, w, packed, a, b, scale, None)
}

/// [`lora_matmul`] with its output written in heads (`heads`: [`crate::ops::HeadsOut`], RoPE
/// on the way) — split_heads' forward after the product, its backward before the product's,
/// so the same values and gradients with the rows never in the graph.
pub(crate) fn lora_matmul_to(
    x: &Tensor,
    w: &Tensor,
    packed: Option<&std::sync::Arc<PackedWeight>>,
    a: &Tensor,
    b: &Tensor,
    scale: f64,
    heads: Option<crate::ops::HeadsOut>,
) -> Result<Tensor> {
    let ((rows, inp), (r, ain), (out, br)) = (x.dims2()?, a.dims2()?, b.dims2()?);
    if w.dims2()? != (out, inp) || ain != inp || br != r || !x.device().is_cpu() || !lora_fuses(x.dtype()) {
        candle_core::bail!(
            "lora-matmul: x ({rows}, {inp}) {:?} on {:?}, W {:?}, A {:?}, B {:?}: expected (rows, in), (out, in), (r, in), (out, r), f32 or f64 on the CPU",
            x.dtype(),
            x.device(),
            w.dims(),
            a.dims(),
            b.dims()
        );
    }
    if packed.is_some() && x.dtype() != candle_core::DType::F32 {
        candle_core::bail!("lora-matmul: bf16 products take f32 inputs, not {:?}", x.dtype());
    }
    if let Some(h) = &heads {
        let (hb, ht, hn, hhd) = h.dims;
        if hb * ht != rows || hn * hhd != out {
            candle_core::bail!("lora-matmul: ({rows}, {out}) output as heads {:?}", h.dims);
        }
    }
    let op = LoraMatmul { w: w.contiguous()?, packed: packed.cloned(), scale, xa: std::sync::Mutex::new(None), heads };
    x.contiguous()?.apply_op3(&a.contiguous()?, &b.contiguous()?, op)
}

pub(crate) struct LoraMatmul {
    w: Tensor,
    packed: Option<std::sync::Arc<PackedWeight>>,
    scale: f64,
    /// x Aᵀ (rows × r) as the forward computed it, for the backward's ∂B = s gᵀ (x Aᵀ): kept
    /// (rows·r values, ~1/70 of x for SmolLM2 at r 8) rather than recomputed, which was a
    /// further pass over x per adapted layer. The same values either way (one `gemm` call of
    /// the same operands).
    xa: std::sync::Mutex<Option<SavedXa>>,
    /// The output written in heads ([`lora_matmul_to`]).
    heads: Option<crate::ops::HeadsOut>,
}

/// [`LoraMatmul`]'s saved x Aᵀ in the op's dtype.
enum SavedXa {
    F32(Vec<f32>),
    F64(Vec<f64>),
}

/// A dtype's slot in [`SavedXa`].
trait Saves: Sized {
    fn save(v: Vec<Self>) -> SavedXa;
    fn saved(s: &SavedXa) -> Option<&[Self]>;
}

macro_rules! saves {
    ($t:ty, $mine:ident, $other:ident) => {
        impl Saves for $t {
            fn save(v: Vec<$t>) -> SavedXa {
                SavedXa::$mine(v)
            }
            fn saved(s: &SavedXa) -> Option<&[$t]> {
                match s {
                    SavedXa::$mine(v) => Some(v),
                    SavedXa::$other(_) => None,
                }
            }
        }
    };
}
saves!(f32, F32, F64);
saves!(f64, F64, F32);

impl LoraMatmul {
    /// x Wᵀ (rows × out) on the packed kernel or by one `gemm` call.
    fn frozen<T: num_traits::Float + candle_core::WithDType>(&self, x: &[T], rows: usize) -> Result<Vec<T>> {
        use crate::mm::{product, Mat};
        let (out, inp) = self.w.dims2()?;
        match &self.packed {
            Some(p) => p.forward_values(x, rows),
            None => crate::mm::with_slices::<T, _, 1>([&self.w], |[w]| {
                product(rows, out, inp, Mat::rows(x, inp), Mat::t(w, inp))
            }),
        }
    }

    fn fwd<T: num_traits::Float + candle_core::WithDType + Saves>(
        &self,
        x: &[T],
        a: &[T],
        b: &[T],
        rows: usize,
    ) -> Result<Vec<T>> {
        use crate::mm::{mm_add, product, Mat};
        let (out, inp) = self.w.dims2()?;
        let r = a.len() / inp;
        let mut y = self.frozen(x, rows)?;
        let xa = product(rows, r, inp, Mat::rows(x, inp), Mat::t(a, inp));
        let s = T::from(self.scale).unwrap_or_else(T::nan);
        mm_add(rows, out, r, &mut y, Mat::rows(&xa, r), Mat::t(b, r), s);
        *self.xa.lock().map_err(|_| candle_core::Error::Msg("lora-matmul: a poisoned lock".into()))? =
            Some(T::save(xa));
        match &self.heads {
            Some(h) => h.to_heads(&y),
            None => Ok(y),
        }
    }

    #[allow(clippy::type_complexity)]
    fn bwd_t<T: num_traits::Float + candle_core::WithDType + Saves>(
        &self,
        x: &Tensor,
        a: &Tensor,
        b: &Tensor,
        g: &Tensor,
        want_dx: bool,
    ) -> Result<(Option<Tensor>, Tensor, Tensor)> {
        use crate::mm::with_slices;
        use crate::mm::{mm_add, product, scaled_product, Mat};
        let (out, inp) = self.w.dims2()?;
        let (rows, r) = (x.dim(0)?, a.dim(0)?);
        let s = T::from(self.scale).unwrap_or_else(T::nan);
        let saved = self.xa.lock().map_err(|_| candle_core::Error::Msg("lora-matmul: a poisoned lock".into()))?;
        let xa = saved.as_ref().and_then(T::saved).filter(|v| v.len() == rows * r).ok_or_else(|| {
            candle_core::Error::Msg(format!("lora-matmul: no saved x Aᵀ of {rows} × {r} for the backward pass"))
        })?;
        let (dx, da, db) = with_slices::<T, _, 4>([x, a, b, g], |[x, a, b, g]| -> Result<_> {
            let gb = product(rows, r, out, Mat::rows(g, out), Mat::rows(b, r));
            let da = scaled_product(r, inp, rows, Mat::t(&gb, r), Mat::rows(x, inp), s);
            let db = scaled_product(out, r, rows, Mat::t(g, out), Mat::rows(xa, r), s);
            let dx = if want_dx {
                let mut dx = match &self.packed {
                    Some(p) => p.backward_values(g, rows)?,
                    None => with_slices::<T, _, 1>([&self.w], |[w]| {
                        product(rows, inp, out, Mat::rows(g, out), Mat::rows(w, inp))
                    })?,
                };
                mm_add(rows, inp, r, &mut dx, Mat::rows(&gb, r), Mat::rows(a, inp), s);
                Some(dx)
            } else {
                None
            };
            Ok((dx, da, db))
        })??;
        let dev = x.device();
        Ok((
            dx.map(|v| Tensor::from_vec(v, (rows, inp), dev)).transpose()?,
            Tensor::from_vec(da, (r, inp), dev)?,
            Tensor::from_vec(db, (out, r), dev)?,
        ))
    }
}

impl LoraMatmul {
    /// [`LoraMatmul::bwd_t`] in x's dtype: (∂x when `want_dx`, ∂A, ∂B) at ∂L/∂y = `g`.
    fn grads(
        &self,
        x: &Tensor,
        a: &Tensor,
        b: &Tensor,
        g: &Tensor,
        want_dx: bool,
    ) -> Result<(Option<Tensor>, Tensor, Tensor)> {
        match x.dtype() {
            candle_core::DType::F32 => self.bwd_t::<f32>(x, a, b, g, want_dx),
            candle_core::DType::F64 => self.bwd_t::<f64>(x, a, b, g, want_dx),
            other => candle_core::bail!("lora-matmul: no backward in {other:?}"),
        }
    }
}

/// `x` as f32 values (the packed bf16 kernels' input): an error for f64.
fn f32_values<T: candle_core::WithDType>(x: &[T]) -> Result<&[f32]> {
    if T::DTYPE != candle_core::DType::F32 {
        candle_core::bail!("bf16 products take f32 inputs, not {:?}", T::DTYPE);
    }
    // SAFETY: T is f32 (checked above): the same type, size and alignment.
    Ok(unsafe { std::slice::from_raw_parts(x.as_ptr() as *const f32, x.len()) })
}

impl candle_core::CustomOp3 for LoraMatmul {
    fn name(&self) -> &'static str {
        "lora-matmul"
    }

    fn cpu_fwd(
        &self,
        s1: &candle_core::CpuStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CpuStorage,
        l2: &candle_core::Layout,
        s3: &candle_core::CpuStorage,
        l3: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        use crate::mm::slice;
        use candle_core::CpuStorage;
        let rows = l1.shape().dims2()?.0;
        let out = match s1 {
            CpuStorage::F32(_) => CpuStorage::F32(self.fwd(slice(s1, l1)?, slice(s2, l2)?, slice(s3, l3)?, rows)?),
            CpuStorage::F64(_) => CpuStorage::F64(self.fwd(slice(s1, l1)?, slice(s2, l2)?, slice(s3, l3)?, rows)?),
            _ => candle_core::bail!("lora-matmul: the fused op runs in f32 or f64"),
        };
        let shape = match &self.heads {
            Some(h) => h.shape(),
            None => candle_core::Shape::from((rows, self.w.dim(0)?)),
        };
        Ok((out, shape))
    }

    fn bwd(
        &self,
        x: &Tensor,
        a: &Tensor,
        b: &Tensor,
        _: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let g = match &self.heads {
            Some(h) => h.rows_grad(g)?,
            None => g.contiguous()?,
        };
        let (dx, da, db) = self.grads(x, a, b, &g, x.track_op())?;
        Ok((dx, Some(da), Some(db)))
    }
}

/// The generator of the adapters' initial draws.
pub fn init_rng(seed: u64) -> rand_chacha::ChaCha20Rng {
    rand_chacha::ChaCha20Rng::seed_from_u64(seed)
}
