//! LoRA (Hu et al. 2021): a frozen linear layer y = x Wᵀ + b gains a trainable low-rank update,
//! y = x Wᵀ + b + (α/r)·(x Aᵀ) Bᵀ with A ∈ R^{r×in}, B ∈ R^{out×r}. As in PEFT, A starts
//! Kaiming-uniform (bound 1/√in) and B at zero, so the adapted model starts as the base model.
//!
//! Its files from the bottom up, each naming only files before it: `packed` (a frozen weight
//! packed for the CPU's products, [`PackedWeight`]), `matmul` (the frozen and adapted products
//! as single graph nodes: [`frozen_matmul`], [`lora_matmul`]), then this `mod.rs` (the
//! adapters, [`Linear`] and its passes, re-exporting the two files' public items).

mod matmul;
mod packed;

use crate::ops::Kernels;
use candle_core::{Device, Result, Tensor, Var};
use matmul::{lora_fuses, lora_matmul_to, LoraMatmul, XGrad};
use rand::{Rng, SeedableRng};

pub use matmul::{frozen_matmul, lora_matmul, lora_matmul_routed};
pub use packed::{packed_matmul, PackedWeight, F32_PACKED_MAX_ROWS};

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
    /// product's own backward computes (the packed kernel's g W, or [`matmul::FrozenMatmul`]'s),
    /// as an owned value a fused op's backward can keep. None otherwise.
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
        let op = LoraMatmul::new(self.w.contiguous().ok()?, self.packed.clone(), ad.scale, None);
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
            Inner::Adapted { op, a, b } => op.forward_detached(x, a, b),
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

/// The generator of the adapters' initial draws.
pub fn init_rng(seed: u64) -> rand_chacha::ChaCha20Rng {
    rand_chacha::ChaCha20Rng::seed_from_u64(seed)
}
