//! The decoder of `features::model` (Llama family, Qwen2) written with differentiable candle ops
//! and LoRA adapters on chosen layers: RMSNorm as x·(mean x² + ε)^{-½}·w, RoPE (rotate-half, or
//! interleaved for llama.cpp's permuted q/k rows), grouped-query causal attention, SiLU(gate)·up;
//! RMSNorm, RoPE, the softmaxes and the frozen matmuls are fused kernels with hand-written
//! gradients (`crate::ops`). The fused CPU kernels of `features` have no backward pass; this path is
//! for training and log-probabilities, `features` stays the path for generation and φ
//! (with [`PolicyModel::merged_weights`]).
//!
//! Its files from the bottom up, each naming only files before it: this `mod.rs` (the model,
//! its blocks' layers, the passes over the whole decoder, the adapters' life cycle), `load`
//! (building a model from a checkpoint's tensors), `blocks` (a decoder block's pass: attention
//! and the MLP). The two add methods to [`PolicyModel`].

mod blocks;
mod load;

use crate::lora::{frozen_matmul, init_rng, is_zero, Adapter, Dropout, Linear, LoraConfig, Pass, Reference, Target};
use crate::ops::Kernels;
use candle_core::{DType, Device, Result, Tensor, Var};
use features::model::{Config, Family};
use std::collections::HashMap;

pub(crate) struct Block {
    pub(crate) norm1: Tensor,
    pub(crate) q: Linear,
    pub(crate) k: Linear,
    pub(crate) v: Linear,
    pub(crate) o: Linear,
    pub(crate) norm2: Tensor,
    pub(crate) gate: Linear,
    pub(crate) up: Linear,
    pub(crate) down: Linear,
}

impl Block {
    fn linears_mut(&mut self) -> [(Target, &mut Linear); 7] {
        [
            (Target::QProj, &mut self.q),
            (Target::KProj, &mut self.k),
            (Target::VProj, &mut self.v),
            (Target::OProj, &mut self.o),
            (Target::GateProj, &mut self.gate),
            (Target::UpProj, &mut self.up),
            (Target::DownProj, &mut self.down),
        ]
    }

    fn linears(&self) -> [(Target, &Linear); 7] {
        [
            (Target::QProj, &self.q),
            (Target::KProj, &self.k),
            (Target::VProj, &self.v),
            (Target::OProj, &self.o),
            (Target::GateProj, &self.gate),
            (Target::UpProj, &self.up),
            (Target::DownProj, &self.down),
        ]
    }
}

/// A causal LM whose adapters train by backpropagation; base weights frozen.
pub struct PolicyModel {
    cfg: Config,
    lora: LoraConfig,
    /// Every base weight by its Hugging Face name (for [`PolicyModel::merged_weights`]).
    base: HashMap<String, Tensor>,
    pub(crate) embed: Tensor,
    lm_head: Tensor,
    /// The LM head packed for the CPU's products ([`PolicyModel::use_packed_products`]).
    lm_head_packed: Option<std::sync::Arc<crate::lora::PackedWeight>>,
    pub(crate) blocks: Vec<Block>,
    pub(crate) norm: Tensor,
    pub(crate) cos: Tensor,
    pub(crate) sin: Tensor,
    device: Device,
    /// Fused CPU kernels or composed differentiable ops ([`Kernels`]): chosen by the device.
    kernels: Kernels,
    /// Whether the fused kernels run a block's frozen stretches as single graph nodes
    /// ([`PolicyModel::set_sublayer_fusion`]); true unless turned off.
    fuse_sublayers: bool,
    /// What happened to the adapters besides training ([`LifeEvent`]), in order: a checkpoint
    /// replays it ([`PolicyModel::replay`]).
    life: Vec<LifeEvent>,
    /// blake3 chain over the merged adapters (None before the first merge): part of the digest.
    history: Option<[u8; 32]>,
    /// Full-parameter training ([`PolicyModel::new_full`]): every weight a variable, the
    /// reference pass a frozen copy. None for adapters.
    full: Option<Full>,
}

/// A policy whose every weight learns (issue 29: the authors' DPO arm is full-parameter). The
/// model's weights are [`Var`]s, so candle's autograd gives each its gradient (the frozen
/// matmul and the fused RMSNorm pass the weight's gradient when the weight is a variable); the
/// reference pass (`Pass::adapters` false) runs `reference`, a model of frozen weights — the
/// initial ones until [`PolicyModel::reference_here`] copies the current ones.
struct Full {
    /// Every weight the forward pass reads, by Hugging Face name, in name order.
    vars: Vec<(String, Var)>,
    reference: Box<PolicyModel>,
}

/// The adapter config of a model without adapters (a full-parameter policy and its reference).
fn no_adapters() -> LoraConfig {
    LoraConfig { rank: 1, alpha: 1.0, targets: Vec::new(), seed: 0, dropout: 0.0 }
}

/// An event of the adapters' life cycle besides training, with the adapter values (in
/// [`PolicyModel::vars`] order) at that moment.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum LifeEvent {
    /// [`PolicyModel::merge_and_reset`] with this seed.
    Merge { vars: Vec<Vec<f32>>, seed: u64 },
    /// [`PolicyModel::reference_here`].
    Reference { vars: Vec<Vec<f32>> },
}

impl PolicyModel {
    /// Whether every weight trains ([`PolicyModel::new_full`]) rather than adapters.
    pub fn is_full(&self) -> bool {
        self.full.is_some()
    }

    /// The frozen reference model of a full-parameter policy for a pass without adapters.
    fn full_reference(&self, pass: Pass<'_>) -> Option<&PolicyModel> {
        self.full.as_ref().filter(|_| !pass.adapters).map(|f| f.reference.as_ref())
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The compute dtype (the adapters' and activations').
    pub fn var_dtype(&self) -> DType {
        self.embed.dtype()
    }

    pub fn lora(&self) -> &LoraConfig {
        &self.lora
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The ops' implementation in use (fused on the CPU, composed elsewhere).
    pub fn kernels(&self) -> Kernels {
        self.kernels
    }

    /// With `on` false the fused kernels build the graph op by op again: each projection's rows
    /// before its heads, the output projection's rows and the residual sum, and the MLP's
    /// norm, products and SwiGLU product as nodes of their own. On by default: the fused
    /// sublayers ([`PolicyModel::mlp_fused`], [`PolicyModel::o_fused`],
    /// [`crate::lora::Linear::forward_heads`]) give the same values and gradients bit for bit
    /// and keep fewer activations; off is for tests and memory measurements
    /// (`ONEPASS_SUBLAYERS=unfused` in the `train_step` example).
    pub fn set_sublayer_fusion(&mut self, on: bool) {
        self.fuse_sublayers = on;
        if let Some(f) = &mut self.full {
            f.reference.set_sublayer_fusion(on);
        }
    }

    /// Uses `k` from now on: routed or composed on the CPU runs the path a GPU trains with (the
    /// tests compare them with the fused one); fused off the CPU, or routed off the CPU and
    /// CUDA, is an error.
    pub fn set_kernels(&mut self, k: Kernels) -> std::result::Result<(), features::Error> {
        if k == Kernels::Fused && !self.device.is_cpu() {
            return Err(features::Error::Input(format!("fused kernels on {:?}: they are CPU-only", self.device)));
        }
        if k == Kernels::Routed && !(self.device.is_cpu() || self.device.is_cuda()) {
            return Err(features::Error::Input(format!("routed kernels on {:?}: the CPU and CUDA only", self.device)));
        }
        self.kernels = k;
        if let Some(f) = &mut self.full {
            f.reference.set_kernels(k)?;
        }
        Ok(())
    }

    /// Trains with bf16 products (issue 31, `[policy] dtype = "bf16"`): every frozen weight's
    /// product with its input, forward (x Wᵀ) and backward (g W), and the LM head's, run on the
    /// CPU's packed bf16 kernel (`kernels::bf16`: W and the product's input rounded to bf16,
    /// sums in f32); the adapters, their products and gradients, the norms, attention's scores
    /// and Adam stay f32. The CPU's fused kernels and an f32 adapter model only; merging the
    /// adapters into the weights is refused from then on ([`crate::lora::BF16_MERGE`]).
    pub fn use_bf16_products(&mut self) -> std::result::Result<(), features::Error> {
        self.use_packed_products(true)
    }

    /// Whether [`PolicyModel::use_packed_products`] applies: the CPU's fused kernels, f32
    /// adapters, frozen weights (not a full-parameter model, whose weights learn).
    pub fn can_pack_products(&self) -> bool {
        self.device.is_cpu() && self.kernels == Kernels::Fused && self.var_dtype() == DType::F32 && !self.is_full()
    }

    /// Every frozen weight (and the LM head) packed once for the CPU's packed products
    /// ([`crate::lora::PackedWeight`]): bf16 (as [`PolicyModel::use_bf16_products`]), forward
    /// and backward, or f32 — the f32 kernel of φ and generation (`kernels::f32mm`) for
    /// forwards of at most [`crate::lora::F32_PACKED_MAX_ROWS`] rows, instead of candle's
    /// matmul, which packs W on every call. f32 keeps
    /// merging: a merged layer is packed again. An error where
    /// [`PolicyModel::can_pack_products`] is false.
    pub fn use_packed_products(&mut self, bf16: bool) -> std::result::Result<(), features::Error> {
        if !self.can_pack_products() {
            return Err(features::Error::Input(format!(
                "packed products are the CPU's fused path for f32 adapters: this policy is on {:?}, {:?} kernels, {:?}{}",
                self.device,
                self.kernels,
                self.var_dtype(),
                if self.is_full() { ", full-parameter" } else { "" }
            )));
        }
        for blk in &mut self.blocks {
            for (_, lin) in blk.linears_mut() {
                lin.pack(bf16)?;
            }
        }
        let head = if bf16 {
            crate::lora::PackedWeight::bf16(&self.lm_head)?
        } else {
            crate::lora::PackedWeight::f32(&self.lm_head)?
        };
        self.lm_head_packed = Some(std::sync::Arc::new(head));
        Ok(())
    }

    /// Whether the frozen products run in bf16 ([`PolicyModel::use_bf16_products`]).
    pub fn bf16_products(&self) -> bool {
        self.lm_head_packed.as_ref().is_some_and(|p| p.bf16)
    }

    /// Whether the frozen products run on a packed kernel, bf16 or f32
    /// ([`PolicyModel::use_packed_products`]).
    pub fn packed_products(&self) -> bool {
        self.lm_head_packed.is_some()
    }

    /// Logits (b, t, vocab) of right-padded ids (b, t), f32.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let h = self.hidden(ids, true)?.reshape((b * t, self.cfg.hidden))?;
        let logits = match &self.lm_head_packed {
            // as the linear layers: the packed product on the fused path only
            Some(p) if self.kernels == Kernels::Fused => crate::lora::packed_matmul(&h, p)?,
            _ => frozen_matmul(&h, &self.lm_head, self.kernels)?,
        };
        logits.reshape((b, t, self.cfg.vocab))
    }

    /// Final-norm hidden states (b, t, hidden) of right-padded ids (b, t); with `adapters`
    /// false, those of the base (reference) model.
    pub fn hidden(&self, ids: &Tensor, adapters: bool) -> Result<Tensor> {
        self.hidden_pass(ids, Pass::of(adapters))
    }

    /// [`PolicyModel::hidden`] for any [`Pass`] (a training pass with dropout).
    pub fn hidden_pass(&self, ids: &Tensor, pass: Pass<'_>) -> Result<Tensor> {
        if let Some(r) = self.full_reference(pass) {
            return r.hidden_pass(ids, Pass::BASE);
        }
        let (b, t) = ids.dims2()?;
        self.check_len(t)?;
        let mut x = self.embed(ids)?;
        let mask = causal_mask(t, 0, &self.device, self.embed.dtype())?;
        let (cos, sin) = (self.cos.narrow(0, 0, t)?, self.sin.narrow(0, 0, t)?);
        let seg = Segment::alone(&cos, &sin, &mask);
        for blk in &self.blocks {
            x = self.block(blk, x, seg, pass)?.0;
        }
        crate::ops::rms_norm(&x, &self.norm, self.cfg.eps, self.kernels)?.reshape((b, t, self.cfg.hidden))
    }

    /// The final-norm hidden states at one row per sequence, (n, hidden): row i of
    /// [`PolicyModel::hidden`] flattened to (b·t, hidden) at `rows[i]` (a reward model's last
    /// tokens). The last block runs its attention over every row (each query reads the keys
    /// before it) and its output projection, MLP and the final norm over the `rows` alone:
    /// ~80% of that block's products, 1/L of a forward and backward pass, are not done. The
    /// values are the full pass's gathered to rounding (gemm may block a product of a few rows
    /// differently: 1.7e-7 relative in f32 on the tiny test model; tested).
    pub fn hidden_at(&self, ids: &Tensor, adapters: bool, rows: &[u32]) -> Result<Tensor> {
        let pass = Pass::of(adapters);
        if let Some(r) = self.full_reference(pass) {
            return r.hidden_at(ids, false, rows);
        }
        let (b, t) = ids.dims2()?;
        self.check_len(t)?;
        if let Some(&r) = rows.iter().find(|&&r| r as usize >= b * t) {
            candle_core::bail!("hidden_at: row {r} of a ({b}, {t}) batch");
        }
        let idx = Tensor::from_vec(rows.to_vec(), rows.len(), &self.device)?;
        let mut x = self.embed(ids)?;
        let mask = causal_mask(t, 0, &self.device, self.embed.dtype())?;
        let (cos, sin) = (self.cos.narrow(0, 0, t)?, self.sin.narrow(0, 0, t)?);
        let Some((last, first)) = self.blocks.split_last() else {
            return crate::ops::rms_norm(&x.index_select(&idx, 0)?, &self.norm, self.cfg.eps, self.kernels);
        };
        let seg = Segment::alone(&cos, &sin, &mask);
        for blk in first {
            x = self.block(blk, x, seg, pass)?.0;
        }
        let k = self.kernels;
        let h = crate::ops::rms_norm(&x, &last.norm1, self.cfg.eps, k)?;
        let (a, _) = self.attention(last, &h, seg, pass, Some(&idx), None)?;
        let x = (x.index_select(&idx, 0)? + a)?;
        let h = crate::ops::rms_norm(&x, &last.norm2, self.cfg.eps, k)?;
        let m = last.down.forward(
            &crate::ops::silu_mul(&last.gate.forward(&h, pass, k)?, &last.up.forward(&h, pass, k)?, k)?,
            pass,
            k,
        )?;
        crate::ops::rms_norm(&(x + m)?, &self.norm, self.cfg.eps, k)
    }

    fn check_len(&self, t: usize) -> Result<()> {
        if t > self.cos.dim(0)? {
            candle_core::bail!("{t} tokens: the model was built for at most {}", self.cos.dim(0)?);
        }
        Ok(())
    }

    /// The embeddings of ids (b, t) as rows (b·t, hidden): the decoder's activations stay
    /// two-dimensional, so no layer reshapes them (in candle's autograd every reshape is a node
    /// with a zeroed gradient and an add in the backward).
    fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        self.embed.index_select(&ids.flatten_all()?, 0)
    }

    /// The hidden states that predict a shared-prompt group's response tokens (its `at` rows):
    /// the prompt (positions 0..p) runs through every block once; the k responses (positions
    /// p..p + r) attend to the prompt's keys and values, then causally to their own. The same
    /// function as the padded layout: the prompt's states never depend on what follows it.
    fn group_rows(&self, g: &crate::batch::Group, pass: Pass<'_>) -> Result<Tensor> {
        let (p, (n, r)) = (g.prompt.dim(1)?, g.responses.dims2()?);
        self.check_len(p + r)?;
        let dt = self.embed.dtype();
        let (mut xp, mut xr) = (self.embed(&g.prompt)?, self.embed(&g.responses)?);
        let (mp, mr) = (causal_mask(p, 0, &self.device, dt)?, causal_mask(r, p, &self.device, dt)?);
        let (cp, sp) = (self.cos.narrow(0, 0, p)?, self.sin.narrow(0, 0, p)?);
        let (cr, sr) = (self.cos.narrow(0, p, r)?, self.sin.narrow(0, p, r)?);
        for blk in &self.blocks {
            let prompt = Segment { need_kv: true, ..Segment::alone(&cp, &sp, &mp) };
            let (y, kv) = self.block(blk, xp, prompt, pass)?;
            let (keys, values) = kv.expect("asked for");
            xp = y;
            let (kv, hd) = (self.cfg.kv_heads, self.cfg.head_dim);
            let keys = keys.broadcast_as((n, kv, p, hd))?;
            let values = values.broadcast_as((n, kv, p, hd))?;
            let responses = Segment { prefix: Some((&keys, &values)), ..Segment::alone(&cr, &sr, &mr) };
            xr = self.block(blk, xr, responses, pass)?.0;
        }
        let last = crate::ops::rms_norm(&xp.narrow(0, p - 1, 1)?, &self.norm, self.cfg.eps, self.kernels)?;
        let hr = crate::ops::rms_norm(&xr, &self.norm, self.cfg.eps, self.kernels)?;
        Tensor::cat(&[last, hr], 0)?.index_select(&g.at, 0)
    }

    /// log π(target | prefix) at chosen positions of a right-padded batch: the hidden state of
    /// row r at position p predicts the token at p + 1. Only those rows of the hidden states
    /// reach the LM head and the log-softmax (a response is a fraction of its sequence).
    /// `batch` from [`crate::batch::SeqBatch`]; returns (positions,), f32.
    pub fn logprobs_at(&self, batch: &crate::batch::SeqBatch, adapters: bool) -> Result<Tensor> {
        self.logprobs_pass(batch, Pass::of(adapters))
    }

    /// [`PolicyModel::logprobs_at`] without a graph ([`Pass::SCORE`] with the adapters, the
    /// reference otherwise): what scoring reads — the same values, bit for bit, and no
    /// activation kept for a backward that never comes.
    pub fn logprobs_scored(&self, batch: &crate::batch::SeqBatch, adapters: bool) -> Result<Tensor> {
        self.logprobs_pass(batch, if adapters { Pass::SCORE } else { Pass::BASE })
    }

    /// [`PolicyModel::logprobs_at`] of the adapted model in a training pass: with the adapters'
    /// dropout of optimiser step `step` when the config has one ([`Dropout`]).
    pub fn logprobs_train(&self, batch: &crate::batch::SeqBatch, step: u64) -> Result<Tensor> {
        if self.lora.dropout > 0.0 {
            let d = Dropout::new(self.lora.dropout, self.lora.seed, step);
            self.logprobs_pass(batch, Pass { adapters: true, dropout: Some(&d), no_grad: false })
        } else {
            self.logprobs_pass(batch, Pass::ADAPTED)
        }
    }

    fn logprobs_pass(&self, batch: &crate::batch::SeqBatch, pass: Pass<'_>) -> Result<Tensor> {
        if let Some(r) = self.full_reference(pass) {
            return r.logprobs_pass(batch, Pass::BASE);
        }
        let rows = self.response_rows(batch, pass)?;
        crate::head::lm_head_logprobs(&rows, &self.lm_head, self.lm_head_packed.as_ref(), &batch.targets, self.kernels)
    }

    /// The final-norm hidden states (P, hidden) that predict the batch's response tokens, row
    /// after row: what the LM head reads for log π, and what a value head reads for V (the
    /// state before each response token, as OpenRLHF's critic takes it).
    pub fn response_rows(&self, batch: &crate::batch::SeqBatch, pass: Pass<'_>) -> Result<Tensor> {
        if let Some(r) = self.full_reference(pass) {
            return r.response_rows(batch, Pass::BASE);
        }
        match &batch.layout {
            crate::batch::Layout::Padded { ids, at } => {
                let h = self.hidden_pass(ids, pass)?;
                let (b, t, d) = h.dims3()?;
                h.reshape((b * t, d))?.index_select(at, 0)
            }
            crate::batch::Layout::Shared(groups) => {
                let rows = groups.iter().map(|g| self.group_rows(g, pass)).collect::<Result<Vec<_>>>()?;
                Tensor::cat(&rows, 0)
            }
        }
    }

    /// The adapters as (PEFT-style name without the `base_model.model.` prefix, A, B), e.g.
    /// `model.layers.0.self_attn.q_proj`.
    pub fn adapters(&self) -> Vec<(String, &Adapter)> {
        let mut out = Vec::new();
        for (i, blk) in self.blocks.iter().enumerate() {
            for (t, lin) in blk.linears() {
                if let Some(a) = &lin.adapter {
                    out.push((format!("model.layers.{i}.{}", t.path()), a));
                }
            }
        }
        out
    }

    /// Every trainable variable (A then B of each adapter, in [`PolicyModel::adapters`] order;
    /// a full-parameter policy's weights in name order).
    pub fn vars(&self) -> Vec<&Var> {
        if let Some(f) = &self.full {
            return f.vars.iter().map(|(_, v)| v).collect();
        }
        self.adapters().into_iter().flat_map(|(_, a)| [&a.a, &a.b]).collect()
    }

    /// Whether the policy is its reference: every B exactly 0 (LoRA's start), so the adapted
    /// pass adds exact zeros to every frozen product.
    pub fn at_reference(&self) -> Result<bool> {
        if let Some(f) = &self.full {
            // every weight equal to the reference's, bit for bit
            for (name, v) in &f.vars {
                let r = &f.reference.base[name];
                if !is_zero(&(v.as_tensor() - r.to_dtype(v.dtype())?)?)? {
                    return Ok(false);
                }
            }
            return Ok(true);
        }
        for blk in &self.blocks {
            for (_, lin) in blk.linears() {
                if !matches!(lin.reference, Reference::Frozen) {
                    return Ok(false);
                }
                if let Some(a) = &lin.adapter {
                    if !is_zero(a.b.as_tensor())? {
                        return Ok(false);
                    }
                }
            }
        }
        Ok(true)
    }

    /// The adapter values in [`PolicyModel::vars`] order, as f32.
    pub fn var_values(&self) -> Result<Vec<Vec<f32>>> {
        self.vars().iter().map(|v| v.as_tensor().flatten_all()?.to_dtype(DType::F32)?.to_vec1()).collect()
    }

    /// Sets the adapters to `values` ([`PolicyModel::var_values`]'s layout).
    pub fn set_var_values(&self, values: &[Vec<f32>]) -> Result<()> {
        let vars = self.vars();
        if values.len() != vars.len() {
            candle_core::bail!("{} adapter tensors: expected {}", values.len(), vars.len());
        }
        for (v, x) in vars.iter().zip(values) {
            let t = v.as_tensor();
            v.set(&Tensor::from_vec(x.clone(), t.shape(), t.device())?.to_dtype(t.dtype())?)?;
        }
        Ok(())
    }

    /// The authors' life cycle of an adapter (a fresh LoRA per chunk): W ← W + (α/r)BA in every
    /// adapted layer (in the model's dtype: f32 for training, never bf16), then every adapter
    /// starts again — A drawn from `seed` as at construction, B = 0. The reference pass keeps
    /// computing the policy it computed (the pre-merge weights are kept where it needs them);
    /// [`PolicyModel::reference_here`] moves it. The digest then covers the merged adapters too.
    ///
    /// A full-parameter policy has no adapter: its weights go on as they are (the caller's
    /// fresh optimiser is the whole of a fresh start) and nothing is recorded.
    pub fn merge_and_reset(&mut self, seed: u64) -> Result<()> {
        if self.full.is_some() {
            return Ok(());
        }
        if self.bf16_products() {
            candle_core::bail!("{}", crate::lora::BF16_MERGE);
        }
        let vars = self.var_values()?;
        let mut h = blake3::Hasher::new();
        h.update(&self.history.unwrap_or([0; 32]));
        for x in vars.iter().flatten() {
            h.update(&x.to_le_bytes());
        }
        self.history = Some(*h.finalize().as_bytes());
        let mut rng = init_rng(seed);
        for (i, blk) in self.blocks.iter_mut().enumerate() {
            for (t, lin) in blk.linears_mut() {
                if lin.adapter.is_none() {
                    continue;
                }
                lin.merge()?;
                self.base.insert(format!("model.layers.{i}.{}.weight", t.path()), lin.w.clone());
            }
        }
        // A's draws in adapters() order, as PolicyModel::new draws them
        for (_, a) in self.adapters() {
            a.reset(&mut rng)?;
        }
        self.life.push(LifeEvent::Merge { vars, seed });
        Ok(())
    }

    /// The reference pass becomes the current policy (the KL reference of a chunk's start): each
    /// adapted layer's W, with a frozen copy of its adapter when B ≠ 0.
    ///
    /// A full-parameter policy's reference becomes a frozen copy of its weights; only the last
    /// such event is kept (the earlier references are gone), so a checkpoint holds one copy.
    pub fn reference_here(&mut self) -> Result<()> {
        let vars = self.var_values()?;
        if let Some(f) = &mut self.full {
            let mut w = f.reference.base.clone();
            for (name, v) in &f.vars {
                // a copy outside the graph: later steps must not move the reference
                w.insert(name.clone(), v.as_tensor().copy()?.detach());
            }
            let max_len = self.cos.dim(0)?;
            let mut r = PolicyModel::new(w, self.cfg.clone(), &no_adapters(), max_len, self.embed.dtype())
                .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
            r.kernels = self.kernels;
            *f.reference = r;
            self.life.retain(|e| !matches!(e, LifeEvent::Reference { .. }));
            self.life.push(LifeEvent::Reference { vars });
            return Ok(());
        }
        for blk in self.blocks.iter_mut() {
            for (_, lin) in blk.linears_mut() {
                if lin.adapter.is_some() {
                    lin.reference_here()?;
                }
            }
        }
        self.life.push(LifeEvent::Reference { vars });
        Ok(())
    }

    /// The life-cycle events so far (for checkpoints).
    pub fn life(&self) -> &[LifeEvent] {
        &self.life
    }

    /// Re-applies `events` (a checkpoint's [`PolicyModel::life`]) to a fresh model, each with the
    /// adapter values it recorded; the caller then sets the current values.
    pub fn replay(&mut self, events: &[LifeEvent]) -> Result<()> {
        for e in events {
            match e {
                LifeEvent::Merge { vars, seed } => {
                    self.set_var_values(vars)?;
                    self.merge_and_reset(*seed)?;
                }
                LifeEvent::Reference { vars } => {
                    self.set_var_values(vars)?;
                    self.reference_here()?;
                }
            }
        }
        Ok(())
    }

    /// The names of [`PolicyModel::vars`], PEFT's (`model.layers.0.self_attn.q_proj.lora_A`).
    pub fn var_names(&self) -> Vec<String> {
        if let Some(f) = &self.full {
            return f.vars.iter().map(|(n, _)| n.clone()).collect();
        }
        self.adapters().into_iter().flat_map(|(n, _)| [format!("{n}.lora_A"), format!("{n}.lora_B")]).collect()
    }

    /// Adam on the adapters, its errors naming them.
    pub fn adam(&self, cfg: crate::adam::AdamConfig) -> Result<crate::adam::Adam> {
        crate::adam::Adam::new(cfg, &self.vars())?.with_names(self.var_names())
    }

    /// A digest of the adapters' current values (blake3 over their f32 bytes in
    /// [`PolicyModel::vars`] order, 16 hex digits): which policy generated a sample.
    pub fn digest(&self) -> Result<String> {
        let mut h = blake3::Hasher::new();
        // after merges, the chain of merged adapters comes first (before any, the digest is the
        // adapters' alone, as it always was)
        if let Some(hist) = &self.history {
            h.update(hist);
        }
        for v in self.vars() {
            let x: Vec<f32> = v.as_tensor().flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
            for f in x {
                h.update(&f.to_le_bytes());
            }
        }
        Ok(h.finalize().to_hex()[..16].to_string())
    }

    /// The base weights with every adapter merged in, W + (α/r)BA, by Hugging Face name, in
    /// f32 (f64 for an f64 model) whatever the base's dtype: what `features::model::Model`
    /// loads to generate with the current policy. Never merged in bf16/f16: at the learning
    /// rates of RLHF, (α/r)BA is far below half an ulp of W in bf16 and the merge would round the
    /// update away (the sampler would stay the base policy while the trainer moved).
    ///
    /// A full-parameter policy's weights are its variables, copied (in f32, or f64).
    pub fn merged_weights(&self) -> Result<HashMap<String, Tensor>> {
        let mut out = self.base.clone();
        if let Some(f) = &self.full {
            for (name, v) in &f.vars {
                let dt = if v.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
                out.insert(name.clone(), v.as_tensor().to_dtype(dt)?.copy()?.detach());
            }
            return Ok(out);
        }
        for (name, ad) in self.adapters() {
            let key = format!("{name}.weight");
            let delta = ad.delta()?;
            let dt = if delta.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
            let w = self.base[&key].to_dtype(dt)?;
            out.insert(key, (w + delta.to_dtype(dt)?)?);
        }
        Ok(out)
    }

    /// The adapters as a generator applies them unmerged (`features::model::Model::with_adapters`:
    /// y = x Wᵀ + (α/r)·(x Aᵀ) Bᵀ beside the base weights — the bf16 sampler, whose base is
    /// never merged into), copied out of the graph in f32. An error for a full-parameter policy
    /// (it has no adapters: its weights are [`PolicyModel::merged_weights`]) and after a merge
    /// (the base weights would no longer be the base's).
    pub fn unmerged_adapters(&self) -> Result<features::model::Adapters> {
        if self.full.is_some() {
            candle_core::bail!("a full-parameter policy has no adapters to apply unmerged");
        }
        if self.history.is_some() {
            candle_core::bail!("adapters applied unmerged after a merge: the base weights have moved");
        }
        let copy = |v: &Var| v.as_tensor().detach().to_dtype(DType::F32)?.copy();
        self.adapters()
            .into_iter()
            .map(|(name, ad)| {
                Ok((name, features::model::LowRank { a: copy(&ad.a)?, b: copy(&ad.b)?, scale: ad.scale }))
            })
            .collect()
    }

    /// [`PolicyModel::merge_error`] of adapters applied unmerged: over every adapted layer,
    /// ‖B'A − (α/r)BA‖_F / ‖(α/r)BA‖_F with B' = the generator's s·B rounded to f32
    /// (`LowRank::scaled_b`), the target in f64 from this policy's own A and B. 0 when exact;
    /// an adapter the generator lacks counts whole.
    pub fn unmerged_error(&self, adapters: &features::model::Adapters) -> Result<f64> {
        let (mut err, mut size) = (0f64, 0f64);
        for (name, ad) in self.adapters() {
            let (a, b) = (ad.a.as_tensor().to_dtype(DType::F64)?, ad.b.as_tensor().to_dtype(DType::F64)?);
            let want = (b.matmul(&a)? * ad.scale)?;
            let got = match adapters.get(&name) {
                Some(l) => l.scaled_b()?.to_dtype(DType::F64)?.matmul(&l.a.to_dtype(DType::F64)?)?,
                None => want.zeros_like()?,
            };
            err += (got - &want)?.sqr()?.sum_all()?.to_scalar::<f64>()?;
            size += want.sqr()?.sum_all()?.to_scalar::<f64>()?;
        }
        Ok(relative_error(err, size))
    }

    /// How far generation weights are from the trained policy: over every adapted layer,
    /// ‖W_gen − (W + (α/r)BA)‖_F / ‖(α/r)BA‖_F, the target computed in f64 (0 when the update
    /// is exact to f64, e.g. adapters at zero; ~1 when a merge rounded the update away).
    ///
    /// Full-parameter: ‖W_gen − W‖_F / ‖W − W₀‖_F over every weight, W₀ the initial weights.
    pub fn merge_error(&self, weights: &HashMap<String, Tensor>) -> Result<f64> {
        let (mut err, mut size) = (0f64, 0f64);
        for (name, v) in self.full.iter().flat_map(|f| &f.vars) {
            let Some(gen) = weights.get(name) else { candle_core::bail!("merge_error: `{name}` is missing") };
            let want = v.as_tensor().to_dtype(DType::F64)?;
            err += (gen.to_dtype(DType::F64)? - &want)?.sqr()?.sum_all()?.to_scalar::<f64>()?;
            size += (want - self.base[name].to_dtype(DType::F64)?)?.sqr()?.sum_all()?.to_scalar::<f64>()?;
        }
        for (name, ad) in self.adapters() {
            let key = format!("{name}.weight");
            let Some(gen) = weights.get(&key) else { candle_core::bail!("merge_error: `{key}` is missing") };
            let (a, b) = (ad.a.as_tensor().to_dtype(DType::F64)?, ad.b.as_tensor().to_dtype(DType::F64)?);
            let delta = (b.matmul(&a)? * ad.scale)?;
            let want = (self.base[&key].to_dtype(DType::F64)? + &delta)?;
            err += (gen.to_dtype(DType::F64)? - want)?.sqr()?.sum_all()?.to_scalar::<f64>()?;
            size += delta.sqr()?.sum_all()?.to_scalar::<f64>()?;
        }
        Ok(relative_error(err, size))
    }

    /// The family, for adapters exported in another layout.
    pub fn family(&self) -> Family {
        self.cfg.family
    }
}

/// The positions one pass of a decoder block runs at, and what its attention reads besides
/// them: borrowed from the caller, so a copy is a handful of references.
#[derive(Clone, Copy)]
struct Segment<'a> {
    /// The RoPE cos table's rows for the segment's t positions.
    cos: &'a Tensor,
    /// The RoPE sin table's rows for the same positions.
    sin: &'a Tensor,
    /// The additive causal mask: (t, t), or (t, p + t) with a prefix.
    mask: &'a Tensor,
    /// Keys and values (b, kv, p, hd) of earlier positions, attended to first.
    prefix: Option<(&'a Tensor, &'a Tensor)>,
    /// Return this segment's (roped) keys and values (b, kv, t, hd) too.
    need_kv: bool,
}

impl<'a> Segment<'a> {
    /// A segment with no prefix whose keys and values are not wanted.
    fn alone(cos: &'a Tensor, sin: &'a Tensor, mask: &'a Tensor) -> Segment<'a> {
        Segment { cos, sin, mask, prefix: None, need_kv: false }
    }
}

/// The additive mask of t queries at positions p..p + t over keys at 0..p + t: 0 where the key
/// is at or before the query, −10³⁰ after it (exp underflows to 0; no −∞ in the backward pass).
/// (t, p + t); p = 0 is the plain causal mask.
pub(crate) fn causal_mask(t: usize, p: usize, dev: &Device, dtype: DType) -> Result<Tensor> {
    let s = p + t;
    let m: Vec<f32> = (0..t * s).map(|i| if i % s > p + i / s { -1e30 } else { 0.0 }).collect();
    Tensor::from_vec(m, (t, s), dev)?.to_dtype(dtype)
}

/// √(err / size), the relative Frobenius error of [`PolicyModel::merge_error`] and
/// [`PolicyModel::unmerged_error`] from its squared sums: ∞ when an update of size 0 is missed,
/// 0 when both are 0.
fn relative_error(err: f64, size: f64) -> f64 {
    if size > 0.0 {
        (err / size).sqrt()
    } else if err > 0.0 {
        f64::INFINITY
    } else {
        0.0
    }
}
