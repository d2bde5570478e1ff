//! Llama-family and Qwen2 decoders (candle-transformers' layout: a config mirror, blocks with
//! `load(vb, cfg)` and `forward`) that return hidden states instead of last-token logits.
//!
//! Weights are read through a `VarBuilder` under Hugging Face's names (`model.layers.{i}.…`);
//! GGUF files are renamed to them at load (`gguf.rs`). Qwen2 differs from Llama only by the
//! q/k/v biases, so one file serves both. The attention mask is built here, causal, for
//! right-padded batches: a real token never sees a pad, so padded rows give the same states at
//! their real positions as unpadded ones (candle's own qwen2 mask is not causal: issue 3567).

use crate::Error;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Embedding, VarBuilder};

mod config;
mod linear;

pub use config::{Config, Family, HfConfig, RopeScaling};
pub use linear::{f32_uses_candle, LowRank};
use linear::{Lin, PackedQkvRope, RmsNorm, Store, Weight};

/// LoRA adapters by the name of the layer they adapt, as the policy and PEFT name it
/// (`model.layers.{i}.self_attn.q_proj`, …): what [`Model::with_adapters`] applies.
pub type Adapters = std::collections::HashMap<String, LowRank>;

#[derive(Clone)]
struct Rope {
    cos: Tensor,
    sin: Tensor,
    interleaved: bool,
}

/// The most positions (`max_len`) a model is loaded for: 128 Ki, the longest context of the
/// models onepass reads (Llama 3.1's); its rotary table then takes 128 Ki × head_dim × 6 bytes.
pub const MAX_POSITIONS: usize = 1 << 17;

impl Rope {
    fn new(cfg: &Config, max_len: usize, dev: &Device, dtype: DType) -> candle_core::Result<Rope> {
        let half = cfg.head_dim / 2;
        let inv: Vec<f32> = (0..half)
            .map(|i| {
                let f = 1.0 / cfg.rope_theta.powf(2.0 * i as f64 / cfg.head_dim as f64);
                let div = cfg.rope_factors.as_ref().map_or(1.0, |v| v[i]);
                (f / div) as f32
            })
            .collect();
        let inv = Tensor::from_vec(inv, (1, half), dev)?;
        let t = Tensor::arange(0u32, max_len as u32, dev)?.to_dtype(DType::F32)?.reshape((max_len, 1))?;
        let freqs = t.matmul(&inv)?;
        Ok(Rope {
            cos: freqs.cos()?.to_dtype(dtype)?,
            sin: freqs.sin()?.to_dtype(dtype)?,
            interleaved: cfg.rope_interleaved,
        })
    }

    /// `x`: (b, heads, t, head_dim).
    fn apply(&self, x: &Tensor, len: usize) -> candle_core::Result<Tensor> {
        self.apply_at(x, 0, len)
    }

    /// `x`: (b, heads, t, head_dim) at positions offset..offset + t.
    fn apply_at(&self, x: &Tensor, offset: usize, len: usize) -> candle_core::Result<Tensor> {
        let (cos, sin) = (self.cos.narrow(0, offset, len)?, self.sin.narrow(0, offset, len)?);
        if self.interleaved {
            candle_nn::rotary_emb::rope_i(&x.contiguous()?, &cos, &sin)
        } else {
            candle_nn::rotary_emb::rope(&x.contiguous()?, &cos, &sin)
        }
    }
}

#[derive(Clone)]
struct Attention {
    /// q, k and v fused: (heads + 2·kv_heads)·head_dim outputs.
    qkv: Lin,
    o: Lin,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl Attention {
    fn load(vb: VarBuilder, cfg: &Config) -> candle_core::Result<Self> {
        let (h, hd) = (cfg.hidden, cfg.head_dim);
        let names = [("q_proj", cfg.heads * hd), ("k_proj", cfg.kv_heads * hd), ("v_proj", cfg.kv_heads * hd)];
        Ok(Attention {
            qkv: Lin::load_fused(&vb, &names, h, cfg.qkv_bias)?,
            o: Lin::load(vb.pp("o_proj"), cfg.heads * hd, h, cfg.o_bias)?,
            heads: cfg.heads,
            kv_heads: cfg.kv_heads,
            head_dim: hd,
        })
    }

    /// Attention before its output projection: (b, t, heads·head_dim).
    fn mix(&self, x: &Tensor, rope: &Rope) -> candle_core::Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let (h, kv, hd) = (self.heads, self.kv_heads, self.head_dim);
        let scale = 1.0 / (hd as f64).sqrt();
        if let (Weight::Packed(w), None, None) = (&self.qkv.w, &self.qkv.b, &self.qkv.low) {
            // The bf16 CPU path: RoPE and the heads' layout in the product's epilogue (an
            // adapter's branch, added before RoPE, takes the path below).
            let packed = {
                let _s = tracing::trace_span!("qkv").entered();
                let op = PackedQkvRope {
                    w: w.clone(),
                    dims: (b, t, h + 2 * kv, hd),
                    rotated: h + kv,
                    interleaved: rope.interleaved,
                };
                x.reshape((b * t, ()))?.contiguous()?.apply_op3_no_bwd(&rope.cos, &rope.sin, &op)?
            };
            let _s = tracing::trace_span!("causal_attention").entered();
            return crate::ops::causal_attention_packed(&packed, h, kv, scale)?.reshape((b, t, h * hd));
        }
        let qkv = {
            let _s = tracing::trace_span!("qkv").entered();
            self.qkv.forward(x)?.reshape((b, t, h + 2 * kv, hd))?
        };
        if qkv.device().is_cpu() && qkv.dtype() == DType::F32 {
            // The fused CPU path: rotate and lay out q, k, v in one pass, attend from there.
            let packed = {
                let _s = tracing::trace_span!("rope").entered();
                crate::ops::qkv_rope(&qkv, &rope.cos, &rope.sin, h + kv, 0, rope.interleaved)?
            };
            let _s = tracing::trace_span!("causal_attention").entered();
            return crate::ops::causal_attention_packed(&packed, h, kv, scale)?.reshape((b, t, h * hd));
        }
        let _s = tracing::trace_span!("rope").entered();
        let q = rope.apply(&qkv.narrow(2, 0, h)?.transpose(1, 2)?, t)?;
        let k = rope.apply(&qkv.narrow(2, h, kv)?.transpose(1, 2)?, t)?;
        let v = qkv.narrow(2, h + kv, kv)?.transpose(1, 2)?.contiguous()?;
        drop(_s);
        let _s = tracing::trace_span!("causal_attention").entered();
        crate::ops::causal_attention(&q, &k, &v, scale)?.reshape((b, t, h * hd))
    }
}

impl Attention {
    /// One step of incremental decoding: `x` (b, t, d) are the tokens at cache slots
    /// offset..offset + t; their k and v are written into `kv` and attention runs over slots
    /// 0..offset + t under `mask` (b, 1, 1, t, offset + t; 0 or −∞). Positions are the slot
    /// indices: RoPE scores depend on position differences only, so a row left-padded by p slots
    /// gets the same scores as the unpadded sequence, as long as its pads are masked.
    fn forward_cached(
        &self,
        x: &Tensor,
        rope: &Rope,
        kv_cache: &mut (Tensor, Tensor),
        offset: usize,
        mask: &Tensor,
    ) -> candle_core::Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let (h, kv, hd) = (self.heads, self.kv_heads, self.head_dim);
        let qkv = self.qkv.forward(x)?.reshape((b, t, h + 2 * kv, hd))?;
        let (q, k, v) = if qkv.device().is_cpu() && qkv.dtype() == DType::F32 {
            let packed = crate::ops::qkv_rope(&qkv, &rope.cos, &rope.sin, h + kv, offset, rope.interleaved)?;
            (
                packed.narrow(1, 0, h)?,
                packed.narrow(1, h, kv)?.contiguous()?,
                packed.narrow(1, h + kv, kv)?.contiguous()?,
            )
        } else {
            let q = rope.apply_at(&qkv.narrow(2, 0, h)?.transpose(1, 2)?, offset, t)?;
            let k = rope.apply_at(&qkv.narrow(2, h, kv)?.transpose(1, 2)?, offset, t)?;
            (q, k, qkv.narrow(2, h + kv, kv)?.transpose(1, 2)?.contiguous()?)
        };
        kv_cache.0.slice_set(&k, 2, offset)?;
        kv_cache.1.slice_set(&v, 2, offset)?;
        let len = offset + t;
        let (kc, vc) = (kv_cache.0.narrow(2, 0, len)?, kv_cache.1.narrow(2, 0, len)?);
        // grouped-query attention without repeating k/v: query head j uses kv head j / g
        let g = h / kv;
        let q = q.reshape((b, kv, g * t, hd))?;
        let s = (q.matmul(&kc.t()?)? * (1.0 / (hd as f64).sqrt()))?;
        let s = s.reshape((b, kv, g, t, len))?.broadcast_add(mask)?;
        let p = candle_nn::ops::softmax_last_dim(&s)?;
        // vc is a view of the first len slots of each (row, kv head)'s cap slots: each matrix is
        // contiguous and the batch strides fold into one, which the matmul takes as it is (a
        // copy here moved the whole cache every decoding step)
        let y = p.reshape((b, kv, g * t, len))?.matmul(&vc)?;
        let y = y.reshape((b, h, t, hd))?.transpose(1, 2)?.reshape((b, t, h * hd))?;
        self.o.forward(&y)
    }
}

#[derive(Clone)]
struct Mlp {
    /// gate and up fused: 2·intermediate outputs.
    gate_up: Lin,
    down: Lin,
}

impl Mlp {
    fn load(vb: VarBuilder, cfg: &Config) -> candle_core::Result<Self> {
        let names = [("gate_proj", cfg.intermediate), ("up_proj", cfg.intermediate)];
        Ok(Mlp {
            gate_up: Lin::load_fused(&vb, &names, cfg.hidden, false)?,
            down: Lin::load(vb.pp("down_proj"), cfg.intermediate, cfg.hidden, false)?,
        })
    }
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let gu = {
            let _s = tracing::trace_span!("gate_up").entered();
            self.gate_up.forward(x)?
        };
        let _s = tracing::trace_span!("down").entered();
        self.down.forward_swiglu(&gu)
    }
}

#[derive(Clone)]
struct Block {
    norm1: RmsNorm,
    attn: Attention,
    norm2: RmsNorm,
    mlp: Mlp,
}

impl Block {
    fn load(vb: VarBuilder, cfg: &Config) -> candle_core::Result<Self> {
        Ok(Block {
            norm1: RmsNorm::load(vb.pp("input_layernorm"), cfg)?,
            attn: Attention::load(vb.pp("self_attn"), cfg)?,
            norm2: RmsNorm::load(vb.pp("post_attention_layernorm"), cfg)?,
            mlp: Mlp::load(vb.pp("mlp"), cfg)?,
        })
    }
    /// The block on `x` given `h` = its first norm of `x`: returns the block's output and `next`
    /// applied to it (the following block's first norm, or the final norm), each residual sum
    /// fused with the norm that reads it.
    fn forward(&self, x: &Tensor, h: &Tensor, rope: &Rope, next: &RmsNorm) -> candle_core::Result<(Tensor, Tensor)> {
        let (x, h) = {
            let _s = tracing::trace_span!("attention").entered();
            let y = self.attn.mix(h, rope)?;
            let _s = tracing::trace_span!("o_proj").entered();
            self.attn.o.forward_add_norm(&y, false, x, &self.norm2)?
        };
        let _s = tracing::trace_span!("mlp").entered();
        let gu = {
            let _s = tracing::trace_span!("gate_up").entered();
            self.mlp.gate_up.forward(&h)?
        };
        let _s = tracing::trace_span!("down").entered();
        self.mlp.down.forward_add_norm(&gu, true, &x, next)
    }
}

impl Block {
    /// [`Block::forward`] for φ: the block reads every position (keys and values need them all)
    /// but only the rows `idx` (flat b·t indices, one per batch row) leave it, so with packed
    /// bf16 products its output projection and MLP run on those rows alone. Returns (x, next(x))
    /// at those rows, (b, 1, d). Other weights run the whole block and then pick the rows: a
    /// dense gemm of 8 rows need not round like one of 2,048 (it does not, on the tiny test
    /// models), and f32 φ keeps the bits of its caches.
    fn forward_rows(
        &self,
        x: &Tensor,
        h: &Tensor,
        rope: &Rope,
        next: &RmsNorm,
        idx: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let (b, t, d) = x.dims3()?;
        let pick = |y: &Tensor| -> candle_core::Result<Tensor> {
            let w = y.dim(2)?;
            y.reshape((b * t, w))?.index_select(idx, 0)?.reshape((b, 1, w))
        };
        let packed = |l: &Lin| matches!(l.w, Weight::Packed(_));
        if ![&self.attn.o, &self.mlp.gate_up, &self.mlp.down].into_iter().all(packed) {
            let (x, h) = self.forward(x, h, rope, next)?;
            return Ok((pick(&x)?, pick(&h)?));
        }
        let y = pick(&self.attn.mix(h, rope)?)?;
        let (x, h) = self.attn.o.forward_add_norm(&y, false, &pick(&x.reshape((b, t, d))?)?, &self.norm2)?;
        let gu = self.mlp.gate_up.forward(&h)?;
        self.mlp.down.forward_add_norm(&gu, true, &x, next)
    }

    fn forward_cached(
        &self,
        x: &Tensor,
        rope: &Rope,
        kv: &mut (Tensor, Tensor),
        offset: usize,
        mask: &Tensor,
    ) -> candle_core::Result<Tensor> {
        let a = self.attn.forward_cached(&self.norm1.forward(x)?, rope, kv, offset, mask)?;
        let (x, h) = self.norm2.add_forward(x, &a)?;
        let m = self.mlp.forward(&h)?;
        &x + m
    }
}

/// The keys and values of every layer for a batch of left-padded rows, preallocated to a
/// capacity of slots; `len` slots are filled. Row i's first `pads[i]` slots are padding.
pub struct KvCache {
    layers: Vec<(Tensor, Tensor)>,
    len: usize,
    cap: usize,
    pads: Vec<usize>,
}

impl KvCache {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn rows(&self) -> usize {
        self.pads.len()
    }
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Keeps (or repeats) the given rows, in that order: to expand one prefilled prompt into n
    /// samples, or to drop rows that finished.
    pub fn select(&mut self, rows: &[usize]) -> Result<(), Error> {
        if rows.iter().any(|&r| r >= self.pads.len()) {
            return Err(Error::Input(format!("cache rows {rows:?} out of range: {} rows", self.pads.len())));
        }
        let dev = self.layers.first().map(|l| l.0.device().clone()).unwrap_or(Device::Cpu);
        let idx = Tensor::from_vec(rows.iter().map(|&r| r as u32).collect::<Vec<_>>(), rows.len(), &dev)?;
        for (k, v) in self.layers.iter_mut() {
            *k = k.index_select(&idx, 0)?;
            *v = v.index_select(&idx, 0)?;
        }
        self.pads = rows.iter().map(|&r| self.pads[r]).collect();
        Ok(())
    }

    /// Additive mask (b, 1, 1, t, len + t) for t new tokens: slot m is visible from slot q when
    /// m ≤ q and m is not a pad of the row; a pad slot sees itself (so its softmax is defined).
    fn mask(&self, t: usize, dev: &Device, dtype: DType) -> candle_core::Result<Tensor> {
        let (b, len) = (self.pads.len(), self.len + t);
        let mut m = vec![0f32; b * t * len];
        for (i, &pad) in self.pads.iter().enumerate() {
            for qi in 0..t {
                let q = self.len + qi;
                for k in 0..len {
                    if k > q || (k < pad && k != q) {
                        m[(i * t + qi) * len + k] = f32::NEG_INFINITY;
                    }
                }
            }
        }
        Tensor::from_vec(m, (b, 1, 1, t, len), dev)?.to_dtype(dtype)
    }
}

/// A decoder that returns hidden states.
#[derive(Clone)]
pub struct Model {
    pub cfg: Config,
    embed: Embedding,
    /// The LM head (vocab, d) when loaded for generation (tied: the embeddings).
    lm_head: Option<Lin>,
    blocks: Vec<Block>,
    norm: RmsNorm,
    rope: Rope,
    /// The weights' dtype (what the user asked for; part of the feature cache's key).
    dtype: DType,
    /// The activations' dtype: the weights' except on the bf16 CPU path, where it is f32.
    act: DType,
    device: Device,
    /// f32 weights packed for [`kernels::f32mm`] (f32 on the CPU unless `ONEPASS_F32_KERNEL=candle`).
    f32_packed: bool,
}

/// Which hidden state to return: Hugging Face's `hidden_states[layer]` (0: the embeddings,
/// L: the output of the final norm); negative values count from the end (−1: the final norm).
pub fn resolve_layer(layer: i64, layers: usize) -> Result<usize, Error> {
    let l = layers as i64;
    let idx = if layer < 0 { l + 1 + layer } else { layer };
    if !(0..=l).contains(&idx) {
        return Err(Error::Input(format!(
            "layer {layer}: the model has hidden states 0..={l} (or −1..=−{}, counted from the end)",
            l + 1
        )));
    }
    Ok(idx as usize)
}

impl Model {
    /// Builds the model from weights under Hugging Face names. `max_len`: the longest sequence.
    pub fn load(vb: VarBuilder, cfg: Config, max_len: usize) -> Result<Model, Error> {
        Model::load_with(vb, cfg, max_len, None)
    }

    /// As [`Model::load`], with the LM head for generation: `Some(tied)`, where `tied` says the
    /// head is the embedding matrix (`tie_word_embeddings`; a GGUF without `output.weight`),
    /// else `lm_head.weight` must be present.
    pub fn load_with(vb: VarBuilder, cfg: Config, max_len: usize, lm_head: Option<bool>) -> Result<Model, Error> {
        cfg.check()?;
        // the rotary table holds max_len positions, allocated here: an unbounded max_len would
        // abort the process on the allocation (or wrap the u32 positions)
        if max_len > MAX_POSITIONS {
            return Err(Error::Input(format!(
                "max_len {max_len}: expected at most {MAX_POSITIONS} tokens (the positions a rotary table is built for)"
            )));
        }
        let ctx = |what: String| move |e: candle_core::Error| Error::Weights(format!("{what}: {e}"));
        let m = vb.pp("model");
        let store = Store::of(&vb);
        let embed_w = m.get((cfg.vocab, cfg.hidden), "embed_tokens.weight").map_err(ctx("embeddings".into()))?;
        let lm_head = match lm_head {
            None => None,
            Some(true) => Some(embed_w.clone()),
            Some(false) => Some(vb.get((cfg.vocab, cfg.hidden), "lm_head.weight").map_err(|e| {
                Error::Weights(format!(
                    "`lm_head.weight` (the LM head a policy needs to generate; the model does not tie it to the embeddings): {e}"
                ))
            })?),
        };
        let lm_head = lm_head.map(|w| Lin::new(w, None, store)).transpose().map_err(ctx("LM head".into()))?;
        let embed = Embedding::new(store.plain(embed_w).map_err(ctx("embeddings".into()))?, cfg.hidden);
        let blocks = (0..cfg.layers)
            .map(|i| Block::load(m.pp("layers").pp(i), &cfg).map_err(ctx(format!("layer {i}"))))
            .collect::<Result<Vec<_>, _>>()?;
        let norm = RmsNorm::load(m.pp("norm"), &cfg).map_err(ctx("final norm".into()))?;
        let (device, dtype) = (vb.device().clone(), vb.dtype());
        let act = if store == Store::Bf16Cpu { DType::F32 } else { dtype };
        let rope = Rope::new(&cfg, max_len.max(1), &device, act).map_err(ctx("rope tables".into()))?;
        let f32_packed = store == Store::F32Cpu;
        Ok(Model { cfg, embed, lm_head, blocks, norm, rope, dtype, act, device, f32_packed })
    }

    /// This model with LoRA adapters applied unmerged beside its weights ([`LowRank`]:
    /// y = x Wᵀ + s·(x Aᵀ) Bᵀ, the branch's products in f32; added in f32 on the CPU's packed
    /// path, in the activations' dtype on a dense one), replacing any it had: the packed
    /// weights are shared, not copied. Every adapter must name a layer of the model (q, k, v, o,
    /// gate, up or down of a block) and fit its shape.
    pub fn with_adapters(&self, adapters: &Adapters) -> Result<Model, Error> {
        let cfg = &self.cfg;
        let (hd, inter) = (cfg.head_dim, cfg.intermediate);
        let mut used = std::collections::HashSet::new();
        let mut get = |i: usize, t: &str| {
            let name = format!("model.layers.{i}.{t}");
            let a = adapters.get(&name);
            if a.is_some() {
                used.insert(name);
            }
            a
        };
        let mut m = self.clone();
        for (i, blk) in m.blocks.iter_mut().enumerate() {
            let name = |t: &str| format!("model.layers.{i}.{t}");
            let parts = [
                (get(i, "self_attn.q_proj"), cfg.heads * hd),
                (get(i, "self_attn.k_proj"), cfg.kv_heads * hd),
                (get(i, "self_attn.v_proj"), cfg.kv_heads * hd),
            ];
            blk.attn.qkv = blk.attn.qkv.adapted(&parts, &name("self_attn.qkv_proj"))?;
            blk.attn.o = blk.attn.o.adapted(&[(get(i, "self_attn.o_proj"), cfg.hidden)], &name("self_attn.o_proj"))?;
            let parts = [(get(i, "mlp.gate_proj"), inter), (get(i, "mlp.up_proj"), inter)];
            blk.mlp.gate_up = blk.mlp.gate_up.adapted(&parts, &name("mlp.gate_up_proj"))?;
            blk.mlp.down = blk.mlp.down.adapted(&[(get(i, "mlp.down_proj"), cfg.hidden)], &name("mlp.down_proj"))?;
        }
        let mut unknown: Vec<&String> = adapters.keys().filter(|k| !used.contains(*k)).collect();
        if !unknown.is_empty() {
            unknown.sort();
            return Err(Error::Input(format!(
                "adapters {unknown:?} name no layer of this {}-layer model (expected model.layers.{{i}}.self_attn.{{q,k,v,o}}_proj or model.layers.{{i}}.mlp.{{gate,up,down}}_proj)",
                cfg.layers
            )));
        }
        Ok(m)
    }

    pub fn device(&self) -> &Device {
        &self.device
    }
    /// The weights' dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Whether the f32 products run on [`kernels::f32mm`]'s packed kernels (the CPU's f32 path)
    /// rather than candle's matmul: the two round differently, so φ's cache key says which.
    pub fn f32_packed(&self) -> bool {
        self.f32_packed
    }
    /// The activations' dtype (f32 on the bf16 CPU path).
    pub fn activation_dtype(&self) -> DType {
        self.act
    }
    pub fn max_len(&self) -> usize {
        self.rope.cos.dim(0).unwrap_or(0)
    }

    /// Hidden states (b, t, d) of `layer` (see [`resolve_layer`]) for right-padded `ids` (b, t).
    pub fn hidden_states(&self, ids: &Tensor, layer: usize) -> Result<Tensor, Error> {
        let (_, t) = ids.dims2()?;
        if t > self.max_len() {
            return Err(Error::Input(format!("a batch of {t} tokens exceeds max_len = {}", self.max_len())));
        }
        let mut x = self.embed.forward(ids)?;
        if layer == 0 {
            return Ok(x);
        }
        let Some(first) = self.blocks.first() else {
            return Ok(self.norm.forward(&x)?);
        };
        let mut h = first.norm1.forward(&x)?;
        for (i, b) in self.blocks.iter().enumerate() {
            let _s = tracing::debug_span!("block", i).entered();
            let next = self.blocks.get(i + 1).map_or(&self.norm, |n| &n.norm1);
            (x, h) = b.forward(&x, &h, &self.rope, next)?;
            if i + 1 == layer && layer < self.cfg.layers {
                return Ok(x);
            }
        }
        // h is the final norm of the last block's output
        Ok(h)
    }

    /// The rows of [`Model::hidden_states`] at one position per batch row, (b, d): φ's
    /// last-token features. The last block that `layer` needs runs its output projection and
    /// MLP on those rows only (~1/L of a pass saved); each row's arithmetic is the full pass's,
    /// so the values are `gather_rows(hidden_states(ids, layer), pos)` (tested).
    pub fn hidden_at(&self, ids: &Tensor, layer: usize, pos: &[usize]) -> Result<Tensor, Error> {
        let (b, t) = ids.dims2()?;
        if t > self.max_len() {
            return Err(Error::Input(format!("a batch of {t} tokens exceeds max_len = {}", self.max_len())));
        }
        if pos.len() != b || pos.iter().any(|&p| p >= t) {
            return Err(Error::Input(format!("positions {pos:?} out of range for a ({b}, {t}) batch")));
        }
        if layer == 0 || self.blocks.is_empty() {
            return gather_rows(&self.hidden_states(ids, layer)?, pos);
        }
        let idx: Vec<u32> = pos.iter().enumerate().map(|(i, &p)| (i * t + p) as u32).collect();
        let idx = Tensor::from_vec(idx, b, &self.device)?;
        let mut x = self.embed.forward(ids)?;
        let mut h = self.blocks[0].norm1.forward(&x)?;
        let last = layer.min(self.blocks.len()) - 1;
        for (i, blk) in self.blocks.iter().enumerate().take(last) {
            let _s = tracing::debug_span!("block", i).entered();
            (x, h) = blk.forward(&x, &h, &self.rope, &self.blocks[i + 1].norm1)?;
        }
        let _s = tracing::debug_span!("block", i = last).entered();
        let next = self.blocks.get(last + 1).map_or(&self.norm, |n| &n.norm1);
        let (x, h) = self.blocks[last].forward_rows(&x, &h, &self.rope, next, &idx)?;
        // As hidden_states: the block's output for an inner layer, the final norm after the last.
        let out = if layer < self.cfg.layers { x } else { h };
        Ok(out.squeeze(1)?)
    }
}

impl Model {
    /// An empty cache for `pads.len()` rows of up to `cap` slots (pads included).
    pub fn new_cache(&self, pads: Vec<usize>, cap: usize) -> Result<KvCache, Error> {
        if cap > self.max_len() {
            return Err(Error::Input(format!(
                "a generation of {cap} slots (left padding, prompt and new tokens) exceeds max_len = {}",
                self.max_len()
            )));
        }
        let (kv, hd) = (self.cfg.kv_heads, self.cfg.head_dim);
        let zeros = || Tensor::zeros((pads.len(), kv, cap, hd), self.act, &self.device);
        let layers = (0..self.cfg.layers).map(|_| Ok((zeros()?, zeros()?))).collect::<candle_core::Result<Vec<_>>>()?;
        Ok(KvCache { layers, len: 0, cap, pads })
    }

    /// Feeds `ids` (b, t) at the next t slots of `cache` and returns the logits (b, vocab) of
    /// the last of them, in f32. Needs the LM head ([`Model::load_with`]).
    pub fn forward_cached(&self, ids: &Tensor, cache: &mut KvCache) -> Result<Tensor, Error> {
        let head = self
            .lm_head
            .as_ref()
            .ok_or_else(|| Error::Input("the model was loaded without its LM head: it cannot generate".into()))?;
        let (b, t) = ids.dims2()?;
        if b != cache.rows() || cache.len + t > cache.cap {
            return Err(Error::Input(format!(
                "{b} rows × {t} tokens do not fit a cache of {} rows with {} of {} slots used",
                cache.rows(),
                cache.len,
                cache.cap
            )));
        }
        let mask = cache.mask(t, &self.device, self.act)?;
        let offset = cache.len;
        let mut x = self.embed.forward(ids)?;
        for (blk, kv) in self.blocks.iter().zip(cache.layers.iter_mut()) {
            x = blk.forward_cached(&x, &self.rope, kv, offset, &mask)?;
        }
        cache.len += t;
        let last = self.norm.forward(&x.narrow(1, t - 1, 1)?)?.squeeze(1)?;
        Ok(head.forward(&last)?.to_dtype(DType::F32)?)
    }

    /// Logits (b, t, vocab) of every position of right-padded `ids` by the full forward pass
    /// (the reference the incremental path is tested against).
    pub fn logits(&self, ids: &Tensor) -> Result<Tensor, Error> {
        let head =
            self.lm_head.as_ref().ok_or_else(|| Error::Input("the model was loaded without its LM head".into()))?;
        let h = self.hidden_states(ids, self.cfg.layers)?;
        let (b, t, d) = h.dims3()?;
        Ok(head.forward(&h.reshape((b * t, d))?)?.reshape((b, t, ()))?.to_dtype(DType::F32)?)
    }
}

/// Rows of `h` (b, t, d) at the given positions: (b, d).
pub fn gather_rows(h: &Tensor, pos: &[usize]) -> Result<Tensor, Error> {
    let (b, t, d) = h.dims3()?;
    let idx: Vec<u32> = pos.iter().enumerate().map(|(i, &p)| (i * t + p) as u32).collect();
    if pos.len() != b || pos.iter().any(|&p| p >= t) {
        return Err(Error::Input(format!("gather positions {pos:?} out of range for a ({b}, {t}) batch")));
    }
    let idx = Tensor::from_vec(idx, b, h.device())?;
    Ok(h.reshape((b * t, d))?.index_select(&idx, 0)?)
}

/// Mean of `h` (b, t, d) over positions [start_i, end_i) of each row: (b, d).
pub fn mean_rows(h: &Tensor, spans: &[(usize, usize)]) -> Result<Tensor, Error> {
    let (b, t, _) = h.dims3()?;
    if spans.len() != b || spans.iter().any(|&(s, e)| s >= e || e > t) {
        return Err(Error::Input(format!("mean spans {spans:?} out of range for a ({b}, {t}) batch")));
    }
    let w: Vec<f32> = spans
        .iter()
        .flat_map(|&(s, e)| (0..t).map(move |j| if j >= s && j < e { 1.0 / (e - s) as f32 } else { 0.0 }))
        .collect();
    let w = Tensor::from_vec(w, (b, 1, t), h.device())?.to_dtype(h.dtype())?;
    Ok(w.matmul(&h.contiguous()?)?.squeeze(1)?)
}

/// The free and total memory of `dev` in bytes: a CUDA device's, asked of its driver; None for
/// the CPU, other devices, or a build without the `cuda` feature.
pub fn device_memory(dev: &Device) -> Option<(u64, u64)> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = dev {
        return d.cuda_stream().context().mem_get_info().ok().map(|(free, total)| (free as u64, total as u64));
    }
    let _ = dev;
    None
}

#[cfg(test)]
mod tests {
    use super::linear::PackedLinear;
    use super::*;

    /// The bf16 q/k/v product with RoPE in its epilogue is the product followed by
    /// [`crate::ops::qkv_rope`], bit for bit, both RoPE layouts, with few rows (the epilogue after
    /// the product) and many (whole-row tasks); a negative control: other tables differ.
    #[test]
    fn fused_qkv_rope_is_the_product_then_qkv_rope() {
        let dev = Device::Cpu;
        let (h, kv, d, k) = (6, 2, 16, 40);
        let heads = h + 2 * kv;
        let w = Tensor::randn(0f32, 0.2, (heads * d, k), &dev).unwrap();
        let mat = std::sync::Arc::new(kernels::bf16::Bf16Matrix::from_f32(
            &w.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            heads * d,
            k,
        ));
        let cos = Tensor::randn(0f32, 1.0, (300, d / 2), &dev).unwrap();
        let sin = Tensor::randn(0f32, 1.0, (300, d / 2), &dev).unwrap();
        for (b, t) in [(2, 7), (5, 230)] {
            let x = Tensor::randn(0f32, 1.0, (b * t, k), &dev).unwrap();
            for interleaved in [false, true] {
                let op = PackedQkvRope { w: mat.clone(), dims: (b, t, heads, d), rotated: h + kv, interleaved };
                let got = x.apply_op3_no_bwd(&cos, &sin, &op).unwrap();
                let plain = x.apply_op1_no_bwd(&PackedLinear { w: mat.clone(), swiglu: false, low: None }).unwrap();
                let plain = plain.reshape((b, t, heads, d)).unwrap();
                let want = crate::ops::qkv_rope(&plain, &cos, &sin, h + kv, 0, interleaved).unwrap();
                let bits = |t: &Tensor| -> Vec<u32> {
                    t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()
                };
                assert_eq!(got.dims(), want.dims());
                assert_eq!(bits(&got), bits(&want), "b {b}, t {t}, interleaved {interleaved}");
                let other = crate::ops::qkv_rope(&plain, &sin, &cos, h + kv, 0, interleaved).unwrap();
                assert_ne!(bits(&got), bits(&other));
            }
        }
    }
}
