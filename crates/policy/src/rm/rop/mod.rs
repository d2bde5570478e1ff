//! Exact Hessian–vector products of a LoRA reward model's batch loss by Pearlmutter's
//! R-operator (B. A. Pearlmutter, "Fast exact multiplication by the Hessian", Neural
//! Computation 6(1), 1994): forward-over-reverse differentiation, written out for the decoder.
//!
//! [`Tape::record`] runs the loss's forward and backward pass by hand (plain tensor algebra, no
//! autograd graph) and keeps what the pass saw — each layer's inputs, each attention row's
//! log-sum-exp, and the adjoint ∂ℓ/∂y of every adapted product. That pass is the step's
//! gradient. [`Tape::hvp`] then differentiates the whole pass along a direction v of the
//! trainable parameters (every LoRA A, B and the head θ): a tangent forward pass
//! (ẏ = d/dε y(w + εv)) and a tangent backward pass (the derivative of each adjoint), whose
//! parameter adjoints' tangents are Hv exactly — no step size, no truncation, rounding alone.
//!
//! Why it is cheaper than differences of gradients: the weights W are frozen, so the tangent of
//! x Wᵀ is ẋ Wᵀ and that of the backward's g W is ġ W — one frozen product each way per layer
//! and product, where a gradient at w ± hv recomputes both passes (central differences: two
//! forward and two backward passes per HVP). With the tape at w shared by Alg. 5's K products,
//! an HVP costs about one gradient pass of products, plus attention's and the adapters' small
//! ones. The price is memory: the tape holds every pass's activations and adjoints (~11 k
//! values per token and layer for SmolLM2; ~1.3 GB per pair of 256-token sequences in f32).
//! What is cheap to recompute is not kept: attention's probabilities (from the rows'
//! log-sum-exps), the MLP's product silu(gate) ⊙ up and its gate's and up's adjoints.
//!
//! Scope: LoRA adapters and the head (the reward model of `[reward] update = "lora"`); a
//! full-parameter model (its W learn: their tangents would enter every product) takes
//! differences of gradients. On the CPU in f32 and f64 the products and the attention and MLP
//! passes run on [`crate::rm::rop_cpu`]'s kernels; elsewhere (a GPU) on composed candle ops on
//! detached tensors, which the tests also run on the CPU.

use crate::model::{Block, PolicyModel};
use crate::rm::model::{Gradient, RewardModel, RmPair};
use crate::rm::rop_cpu as cpu;
use candle_core::{DType, Result, Tensor, D};

mod layers;

use layers::{norm_bwd, norm_fwd, norm_tan, norm_tan_bwd, sigmoid, Lin, LinBwdSaved};

/// The pass's shape and its position tables.
struct Geo {
    b: usize,
    t: usize,
    heads: usize,
    kv: usize,
    hd: usize,
    eps: f64,
    interleaved: bool,
    /// The CPU's kernels ([`cpu`]) rather than composed ops.
    fused: bool,
    cos: Tensor,
    sin: Tensor,
    /// −sin: RoPE's inverse rotation, its transpose.
    nsin: Tensor,
    mask: Tensor,
}

impl Geo {
    /// Rows (b·t, n·hd) as heads (b, n, t, hd), turned by RoPE when `rope`.
    fn heads(&self, y: &Tensor, n: usize, rope: bool) -> Result<Tensor> {
        if self.fused && cpu::applies(y) {
            let tables = rope.then_some((&self.cos, &self.sin, self.interleaved));
            return crate::ops::heads_values(y, (self.b, self.t, n, self.hd), tables, true, false);
        }
        let y = y.reshape((self.b, self.t, n, self.hd))?.transpose(1, 2)?.contiguous()?;
        match rope {
            true => crate::ops::rope(&y, &self.cos, &self.sin, self.interleaved, crate::ops::Kernels::Composed),
            false => Ok(y),
        }
    }

    /// Heads (b, n, t, hd) back into rows (b·t, n·hd), turned back by RoPE's inverse rotation
    /// (its transpose) when `unrope`.
    fn rows(&self, y: &Tensor, unrope: bool) -> Result<Tensor> {
        let n = y.dim(1)?;
        if self.fused && cpu::applies(y) {
            let tables = unrope.then_some((&self.cos, &self.sin, self.interleaved));
            return crate::ops::heads_values(y, (self.b, self.t, n, self.hd), tables, false, true);
        }
        let y = match unrope {
            true => crate::ops::rope(y, &self.cos, &self.nsin, self.interleaved, crate::ops::Kernels::Composed)?,
            false => y.clone(),
        };
        y.transpose(1, 2)?.contiguous()?.reshape((self.b * self.t, n * self.hd))
    }

    /// Query heads (b, h, t, hd) grouped by the key–value head they read: (b, kv, g·t, hd).
    fn grouped(&self, q: &Tensor) -> Result<Tensor> {
        q.reshape((self.b, self.kv, self.heads / self.kv * self.t, self.hd))
    }

    /// Grouped queries back to (b, h, t, hd).
    fn ungrouped(&self, q: &Tensor) -> Result<Tensor> {
        q.reshape((self.b, self.heads, self.t, self.hd))
    }

    fn scale(&self) -> f64 {
        1.0 / (self.hd as f64).sqrt()
    }

    /// ⟨a, b⟩ over each head's hd values of rows (b·t, h·hd): (b, kv, g·t), the order of the
    /// grouped query rows.
    fn head_dots(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        let (h, g) = (self.heads, self.heads / self.kv);
        (a * b)?.reshape((self.b, self.t, h, self.hd))?.sum(D::Minus1)?.transpose(1, 2)?.contiguous()?.reshape((
            self.b,
            self.kv,
            g * self.t,
        ))
    }

    /// The layout of the CPU's attention kernels.
    fn att(&self) -> cpu::Att {
        cpu::Att { b: self.b, kv: self.kv, g: self.heads / self.kv, t: self.t, hd: self.hd }
    }

    /// Attention's scores of grouped queries (b, kv, g·t, hd) against keys (b, kv, t, hd),
    /// scaled and causally masked.
    fn scores(&self, q: &Tensor, k: &Tensor) -> Result<Tensor> {
        let g = self.heads / self.kv;
        let s = (q.matmul(&k.t()?)? * self.scale())?;
        s.reshape((self.b, self.kv, g, self.t, self.t))?.broadcast_add(&self.mask)?.reshape((
            self.b,
            self.kv,
            g * self.t,
            self.t,
        ))
    }
}

/// One block's forward values on the tape.
struct BlockFwd {
    x: Tensor,
    r1: Tensor,
    h1: Tensor,
    /// x Aᵀ of q, k, v, o, gate, up, down (where adapted).
    xa: [Option<Tensor>; 7],
    /// Roped grouped queries (b, kv, g·t, hd), roped keys and values (b, kv, t, hd).
    q: Tensor,
    k: Tensor,
    v: Tensor,
    /// Each query row's log-sum-exp of its scores (b, kv, g·t): the probabilities P,
    /// recomputed where needed (a (g·t × t) map per group would be the tape's largest item).
    lse: Tensor,
    /// Attention's output O = P V as rows: the output projection's input.
    ya: Tensor,
    x1: Tensor,
    r2: Tensor,
    h2: Tensor,
    /// The gate and up projections (rows, intermediate); a = silu(gate) ⊙ up, the down
    /// projection's input, and the gate's and up's adjoints are recomputed from them.
    gate: Tensor,
    up: Tensor,
}

/// One block's adjoints on the tape.
struct BlockAdj {
    /// ∂ℓ/∂y of q, k, v, o, gate, up, down (gate's and up's recomputed from ∂ℓ/∂a: None) and
    /// g B.
    lin: [LinBwdSaved; 7],
    /// ∂ℓ/∂h1, ∂ℓ/∂h2 (the norms' outputs), ∂ℓ/∂a (the down projection's input) and ∂ℓ/∂O
    /// (as rows, the output projection's input adjoint).
    gh1: Tensor,
    gh2: Tensor,
    ga: Tensor,
    gya: Tensor,
    /// D = ⟨Ō, O⟩ per query row (b, kv, g·t).
    d: Tensor,
}

/// One block's tangents of a direction.
struct BlockTan {
    x: Tensor,
    r1: Tensor,
    h1: Tensor,
    xa: [Option<Tensor>; 7],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    /// Ȯ as rows.
    ya: Tensor,
    x1: Tensor,
    r2: Tensor,
    h2: Tensor,
    gate: Tensor,
    up: Tensor,
    a: Tensor,
}

/// Log-sum-exps and probabilities of the composed path: lse = m + log Σ e^{s − m} per row,
/// P = e^{s − lse} (0 where masked).
fn lse_probs(geo: &Geo, q: &Tensor, k: &Tensor, lse: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
    let s = geo.scores(q, k)?;
    let lse = match lse {
        Some(l) => l.clone(),
        None => {
            let m = s.max_keepdim(D::Minus1)?;
            (s.broadcast_sub(&m)?.exp()?.sum_keepdim(D::Minus1)?.log()? + m)?.squeeze(D::Minus1)?
        }
    };
    let p = s.broadcast_sub(&lse.unsqueeze(D::Minus1)?)?.exp()?;
    Ok((lse, p))
}

/// Attention's forward pass: (the rows' log-sum-exps, O) ([`cpu::attn_fwd`] on the CPU).
fn attn_fwd(geo: &Geo, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
    if geo.fused && cpu::applies(q) {
        return cpu::attn_fwd(geo.att(), q, k, v);
    }
    let (lse, p) = lse_probs(geo, q, k, None)?;
    Ok((lse, p.matmul(v)?))
}

/// S̄ = c P ⊙ (Ō Vᵀ − D), the adjoint of Q Kᵀ (composed path; D (b, kv, g·t)).
fn scores_adjoint(geo: &Geo, p: &Tensor, f: &BlockFwd, go: &Tensor, d: &Tensor) -> Result<Tensor> {
    let gp = go.matmul(&f.v.t()?)?;
    (p * gp.broadcast_sub(&d.unsqueeze(D::Minus1)?)?)? * geo.scale()
}

/// Z = Ṡ − ⟨P, Ṡ⟩ per row, Ṡ = (Q̇ Kᵀ + Q K̇ᵀ)/√hd (the mask is constant): Ṗ = P ⊙ Z (composed path).
fn score_tangent(geo: &Geo, p: &Tensor, f: &BlockFwd, qd: &Tensor, kd: &Tensor) -> Result<Tensor> {
    let sd = ((qd.matmul(&f.k.t()?)? + f.q.matmul(&kd.t()?)?)? * geo.scale())?;
    sd.broadcast_sub(&(p * &sd)?.sum_keepdim(D::Minus1)?)
}

/// Attention's backward pass from Ō (rows) and D = ⟨Ō, O⟩ per query row: (Q̄, K̄, V̄)
/// ([`cpu::attn_bwd`]).
fn attn_bwd(geo: &Geo, f: &BlockFwd, go: &Tensor, d: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    if geo.fused && cpu::applies(go) {
        return cpu::attn_bwd(geo.att(), (&f.q, &f.k, &f.v, &f.lse, d), go);
    }
    let (_, p) = lse_probs(geo, &f.q, &f.k, Some(&f.lse))?;
    let gs = scores_adjoint(geo, &p, f, go, d)?;
    Ok((gs.matmul(&f.k)?, gs.t()?.matmul(&f.q)?, p.t()?.matmul(go)?))
}

/// Attention's tangent Ȯ (grouped heads) ([`cpu::attn_tan`]).
fn attn_tan(geo: &Geo, f: &BlockFwd, qd: &Tensor, kd: &Tensor, vd: &Tensor) -> Result<Tensor> {
    if geo.fused && cpu::applies(qd) {
        return cpu::attn_tan(geo.att(), (&f.q, &f.k, &f.v, &f.lse), (qd, kd, vd));
    }
    let (_, p) = lse_probs(geo, &f.q, &f.k, Some(&f.lse))?;
    let z = score_tangent(geo, &p, f, qd, kd)?;
    (&p * &z)?.matmul(&f.v)? + p.matmul(vd)?
}

/// The tangent of attention's backward pass given Ō̇ (grouped heads) and Ḋ: (Q̄̇, K̄̇, V̄̇)
/// ([`cpu::attn_tan_bwd`]).
fn attn_tan_bwd(
    geo: &Geo,
    f: &BlockFwd,
    (go, d): (&Tensor, &Tensor),
    td: &BlockTan,
    god: &Tensor,
    dd: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    if geo.fused && cpu::applies(god) {
        let saved = (&f.q, &f.k, &f.v, &f.lse, d, go);
        return cpu::attn_tan_bwd(geo.att(), saved, (&td.q, &td.k, &td.v, dd), god);
    }
    let (_, p) = lse_probs(geo, &f.q, &f.k, Some(&f.lse))?;
    let gs = scores_adjoint(geo, &p, f, go, d)?;
    let z = score_tangent(geo, &p, f, &td.q, &td.k)?;
    let gpd = (god.matmul(&f.v.t()?)? + go.matmul(&td.v.t()?)?)?;
    let gsd = ((&z * &gs)? + ((&p * gpd.broadcast_sub(&dd.unsqueeze(D::Minus1)?)?)? * geo.scale())?)?;
    let gqd = (gsd.matmul(&f.k)? + gs.matmul(&td.k)?)?;
    let gkd = (gsd.t()?.matmul(&f.q)? + gs.t()?.matmul(&td.q)?)?;
    let gvd = ((&p * &z)?.t()?.matmul(go)? + p.t()?.matmul(god)?)?;
    Ok((gqd, gkd, gvd))
}

/// a = silu(gate) ⊙ up, the down projection's input ([`cpu::mlp_out`]).
fn mlp_out(geo: &Geo, f: &BlockFwd) -> Result<Tensor> {
    if geo.fused && cpu::applies(&f.gate) {
        return cpu::mlp_out(&f.gate, &f.up);
    }
    (&f.gate * sigmoid(&f.gate)?)? * &f.up
}

/// The MLP's tangent ȧ ([`cpu::mlp_tan`]).
fn mlp_tan(geo: &Geo, f: &BlockFwd, gd: &Tensor, ud: &Tensor) -> Result<Tensor> {
    if geo.fused && cpu::applies(gd) {
        return cpu::mlp_tan(&f.gate, &f.up, gd, ud);
    }
    let (silu, d1, _) = silu_parts(&f.gate)?;
    ((&d1 * gd)? * &f.up)? + (&silu * ud)?
}

/// The MLP's backward pass from ā: (ḡ, ū) ([`cpu::mlp_bwd`]).
fn mlp_bwd(geo: &Geo, f: &BlockFwd, ga: &Tensor) -> Result<(Tensor, Tensor)> {
    if geo.fused && cpu::applies(ga) {
        return cpu::mlp_bwd(&f.gate, &f.up, ga);
    }
    let (silu, d1, _) = silu_parts(&f.gate)?;
    Ok((((ga * &f.up)? * &d1)?, (ga * &silu)?))
}

/// The tangent of the MLP's backward pass ([`cpu::mlp_tan_bwd`]).
fn mlp_tan_bwd(geo: &Geo, f: &BlockFwd, ga: &Tensor, gad: &Tensor, td: &BlockTan) -> Result<(Tensor, Tensor)> {
    if geo.fused && cpu::applies(ga) {
        return cpu::mlp_tan_bwd(&f.gate, &f.up, ga, gad, &td.gate, &td.up);
    }
    let (silu, d1, d2) = silu_parts(&f.gate)?;
    let ggd = ((((gad * &f.up)? + (ga * &td.up)?)? * &d1)? + (((ga * &f.up)? * &d2)? * &td.gate)?)?;
    let gud = ((gad * &silu)? + ((ga * &d1)? * &td.gate)?)?;
    Ok((ggd, gud))
}

/// A block's seven linear layers, in [`crate::model::Block`]'s order (q, k, v, o, gate, up,
/// down — the order of [`PolicyModel::vars`] within a block).
fn lins(blk: &Block, fused: bool) -> Result<[Lin; 7]> {
    Ok([
        Lin::of(&blk.q, fused)?,
        Lin::of(&blk.k, fused)?,
        Lin::of(&blk.v, fused)?,
        Lin::of(&blk.o, fused)?,
        Lin::of(&blk.gate, fused)?,
        Lin::of(&blk.up, fused)?,
        Lin::of(&blk.down, fused)?,
    ])
}

/// The silu factors of a gate value g with σ = σ(g): (silu g, silu′ g, silu″ g):
/// silu = g σ, silu′ = σ (1 + g (1 − σ)), silu″ = σ (1 − σ) (2 + g (1 − 2σ)).
fn silu_parts(g: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    let s = &sigmoid(g)?;
    let one_minus = s.affine(-1.0, 1.0)?;
    let silu = (g * s)?;
    let d1 = (s * ((g * &one_minus)? + 1.0)?)?;
    let d2 = ((s * &one_minus)? * ((g * s.affine(-2.0, 1.0)?)? + 2.0)?)?;
    Ok((silu, d1, d2))
}

/// One pass's tape: a group of pairs' forward values and adjoints.
struct PassTape {
    geo: Geo,
    fwd: Vec<BlockFwd>,
    adj: Vec<BlockAdj>,
    /// The rows of the sequences' last tokens, their final-block states, r of the final norm
    /// and h (2n, hidden): a's then a′'s.
    last: Tensor,
    xf: Tensor,
    rf: Tensor,
    hf: Tensor,
    /// ∂ℓ/∂rᵢ of each sequence's reward (2n, 1): (σ(mᵢ) − yᵢ)/N for a, its negative for a′.
    e: Tensor,
    /// σ′(mᵢ)/N (n, 1): the loss's second derivative in each margin.
    c: Tensor,
    n: usize,
}

/// A reward model's loss recorded at its parameters w for exact Hessian–vector products
/// ([`Tape::hvp`]); made by [`Tape::record`].
pub struct Tape {
    passes: Vec<PassTape>,
    /// The layers (detached), so the products are taken at w even if the model moves.
    blocks: Vec<[Lin; 7]>,
    gammas: Vec<(Tensor, Tensor)>,
    norm: Tensor,
    theta: Tensor,
}

/// What [`Tape::record`] gives: the tape, the batch's gradient in [`RewardModel::vars`] order
/// and each pair's margin (batch order), from which the caller computes the loss and accuracy.
pub struct Recorded {
    pub tape: Tape,
    pub grads: Vec<Tensor>,
    pub margins: Vec<f64>,
}

// the reward model's gradient pass that records this module's tape
impl RewardModel {
    /// The gradient of [`RewardModel::gradient`] by a hand-written forward and backward pass
    /// that records what the exact Hessian–vector products of [`Tape::hvp`] need
    /// (Pearlmutter's R-operator; LoRA adapters and the head). The same passes and loss; the
    /// gradient equals the autograd one to rounding (tested).
    pub fn gradient_tape(&self, pairs: &[RmPair<'_>]) -> Result<(Gradient, Tape)> {
        if pairs.is_empty() {
            candle_core::bail!("reward model gradient: no pairs");
        }
        let rec = Tape::record(self, pairs, &self.pass_groups(pairs))?;
        let y: Vec<f32> = pairs.iter().map(|p| p.y).collect();
        let n = pairs.len();
        let (mut coef, mut curv) = (vec![0.0; n], vec![0.0; n]);
        let stats = estimators::BatchStats::compute(&rec.margins, &y, &mut coef, &mut curv);
        Ok((Gradient { stats, grads: rec.grads, curvature: curv }, rec.tape))
    }
}

impl Tape {
    /// Whether [`Tape::record`] applies to `rm`: its backbone trains through LoRA adapters
    /// (not every weight) and no adapter has dropout.
    pub fn applies(rm: &RewardModel) -> bool {
        rm.trains_backbone() && !rm.model.is_full() && rm.model.lora().dropout == 0.0
    }

    /// The batch-mean Bradley–Terry loss's forward and backward pass on `pairs`, by hand, in
    /// groups of `order`'s chunks (the passes of [`RewardModel::gradient`]): the gradient and
    /// the tape. An error for a model [`Tape::applies`] rejects.
    pub fn record(rm: &RewardModel, pairs: &[RmPair<'_>], groups: &[Vec<usize>]) -> Result<Recorded> {
        if !Self::applies(rm) {
            candle_core::bail!(
                "exact HVPs (hvp = \"exact\") cover a reward model's LoRA adapters and head without dropout: \
                 this one {}",
                if !rm.trains_backbone() {
                    "trains its head alone"
                } else if rm.model.is_full() {
                    "trains every weight (use hvp = \"central\")"
                } else {
                    "has adapter dropout"
                }
            );
        }
        let m = &rm.model;
        // the CPU's kernels where the model runs its fused ones; composed ops elsewhere (a GPU)
        let fused = m.kernels() == crate::ops::Kernels::Fused;
        let blocks: Vec<[Lin; 7]> = m.blocks.iter().map(|b| lins(b, fused)).collect::<Result<_>>()?;
        let gammas = m.blocks.iter().map(|b| (b.norm1.detach(), b.norm2.detach())).collect();
        let theta = rm.head.as_tensor().detach();
        let mut tape = Tape { passes: Vec::new(), blocks, gammas, norm: m.norm.detach(), theta };
        let n_total = pairs.len();
        let mut grads: Option<Vec<Tensor>> = None;
        let mut margins = vec![0.0; n_total];
        for idx in groups {
            let part: Vec<RmPair<'_>> = idx.iter().map(|&i| pairs[i]).collect();
            let (pass, gs, ms) = tape.pass(m, &part, n_total)?;
            for (&i, v) in idx.iter().zip(ms) {
                margins[i] = v;
            }
            grads = Some(match grads {
                None => gs,
                Some(acc) => acc.iter().zip(&gs).map(|(a, g)| a + g).collect::<Result<_>>()?,
            });
            tape.passes.push(pass);
        }
        let grads = grads.ok_or_else(|| candle_core::Error::Msg("exact HVPs: no pairs".into()))?;
        Ok(Recorded { tape, grads, margins })
    }

    /// One group's forward and backward pass: its tape, its share of the gradient, its margins.
    fn pass(&self, m: &PolicyModel, pairs: &[RmPair<'_>], n_total: usize) -> Result<(PassTape, Vec<Tensor>, Vec<f64>)> {
        let cfg = m.config();
        let n = pairs.len();
        let seqs: Vec<&[u32]> = pairs.iter().map(|p| p.a).chain(pairs.iter().map(|p| p.b)).collect();
        let b = seqs.len();
        // the batch of `RewardModel::features`
        let (ids, last, t) = crate::rm::model::padded(&seqs)?;
        let dev = m.device();
        let dt = m.var_dtype();
        if t > m.cos.dim(0)? {
            candle_core::bail!("{t} tokens: the model was built for at most {}", m.cos.dim(0)?);
        }
        let sin = m.sin.narrow(0, 0, t)?.detach();
        let geo = Geo {
            b,
            t,
            heads: cfg.heads,
            kv: cfg.kv_heads,
            hd: cfg.head_dim,
            eps: cfg.eps,
            interleaved: cfg.rope_interleaved,
            fused: m.kernels() == crate::ops::Kernels::Fused,
            cos: m.cos.narrow(0, 0, t)?.detach(),
            nsin: sin.neg()?,
            sin,
            mask: crate::model::causal_mask(t, 0, dev, dt)?,
        };
        let ids = Tensor::from_vec(ids, b * t, dev)?;
        let last = Tensor::from_vec(last, b, dev)?;
        // forward
        let mut x = m.embed.detach().index_select(&ids, 0)?;
        let mut fwd = Vec::with_capacity(self.blocks.len());
        for (l, (gam, lin)) in self.gammas.iter().zip(&self.blocks).enumerate() {
            let (f, xn) = block_fwd(&geo, lin, gam, x).map_err(|e| e.context(format!("exact HVPs: block {l}")))?;
            fwd.push(f);
            x = xn;
        }
        let xf = x.index_select(&last, 0)?;
        let (rf, hf) = norm_fwd(&xf, &self.norm, geo.eps)?;
        let d = hf.dim(1)?;
        let r = hf.matmul(&self.theta.reshape((d, 1))?)?;
        let mv: Vec<f64> = (r.narrow(0, 0, n)? - r.narrow(0, n, n)?)?.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
        let nt = n_total as f64;
        let (mut e, mut c) = (Vec::with_capacity(2 * n), Vec::with_capacity(n));
        for (mi, p) in mv.iter().zip(pairs) {
            let s = 1.0 / (1.0 + (-mi).exp());
            e.push((s - f64::from(p.y)) / nt);
            c.push(s * (1.0 - s) / nt);
        }
        e.extend((0..n).map(|i| -e[i]).collect::<Vec<_>>());
        let e = Tensor::from_vec(e, (2 * n, 1), dev)?.to_dtype(dt)?;
        let c = Tensor::from_vec(c, (n, 1), dev)?.to_dtype(dt)?;
        // backward: θ̄ = hfᵀ e, ∂ℓ/∂hf = e θᵀ
        let g_theta = hf.t()?.matmul(&e)?.reshape(d)?;
        let ghf = e.broadcast_mul(&self.theta.reshape((1, d))?)?;
        let gxf = norm_bwd(&xf, &rf, &self.norm, &ghf)?;
        let mut gx = x.zeros_like()?.index_add(&last, &gxf, 0)?;
        let mut adj: Vec<BlockAdj> = Vec::with_capacity(fwd.len());
        let mut grads_rev: Vec<Vec<Tensor>> = Vec::with_capacity(fwd.len());
        for (l, f) in fwd.iter().enumerate().rev() {
            let (a, gs, gxn) = block_bwd(&geo, &self.blocks[l], &self.gammas[l], f, gx, l > 0)?;
            adj.push(a);
            grads_rev.push(gs);
            gx = match gxn {
                Some(g) => g,
                None => break,
            };
        }
        adj.reverse();
        let mut grads: Vec<Tensor> = grads_rev.into_iter().rev().flatten().collect();
        grads.push(g_theta);
        Ok((PassTape { geo, fwd, adj, last, xf, rf, hf, e, c, n }, grads, mv))
    }

    /// H v, H the Hessian of the recorded batch loss at the recorded parameters over the
    /// trainable variables (`v` in [`RewardModel::vars`] order: each adapter's A, B, then θ):
    /// the tangent forward and backward passes of every recorded pass, summed.
    pub fn hvp(&self, v: &[Tensor]) -> Result<Vec<Tensor>> {
        let n_ad: usize = self.blocks.iter().map(|ls| ls.iter().filter(|l| l.ad.is_some()).count()).sum();
        if v.len() != 2 * n_ad + 1 {
            candle_core::bail!("exact HVPs: a direction of {} tensors for {} variables", v.len(), 2 * n_ad + 1);
        }
        // each block's directions (Ȧ, Ḃ) by layer
        let mut it = v.iter();
        let mut dirs: Vec<[Option<(Tensor, Tensor)>; 7]> = Vec::with_capacity(self.blocks.len());
        for ls in &self.blocks {
            let mut d: [Option<(Tensor, Tensor)>; 7] = Default::default();
            for (j, l) in ls.iter().enumerate() {
                if l.ad.is_some() {
                    let (a, b) = (it.next(), it.next());
                    if let (Some(a), Some(b)) = (a, b) {
                        d[j] = Some((a.to_dtype(self.theta.dtype())?, b.to_dtype(self.theta.dtype())?));
                    }
                }
            }
            dirs.push(d);
        }
        let theta_d = it
            .next()
            .ok_or_else(|| candle_core::Error::Msg("exact HVPs: no head direction".into()))?
            .to_dtype(self.theta.dtype())?;
        let mut out: Option<Vec<Tensor>> = None;
        for pass in &self.passes {
            let hv = self.pass_hvp(pass, &dirs, &theta_d)?;
            out = Some(match out {
                None => hv,
                Some(acc) => acc.iter().zip(&hv).map(|(a, h)| a + h).collect::<Result<_>>()?,
            });
        }
        out.ok_or_else(|| candle_core::Error::Msg("exact HVPs: an empty tape".into()))
    }

    fn pass_hvp(&self, p: &PassTape, dirs: &[[Option<(Tensor, Tensor)>; 7]], theta_d: &Tensor) -> Result<Vec<Tensor>> {
        let geo = &p.geo;
        let n = p.n;
        let d = p.hf.dim(1)?;
        // tangent forward
        let mut xd = p.fwd[0].x.zeros_like()?;
        let mut tans = Vec::with_capacity(p.fwd.len());
        for (l, f) in p.fwd.iter().enumerate() {
            let (tn, xn) = block_tan(geo, &self.blocks[l], &self.gammas[l], f, &dirs[l], xd)?;
            tans.push(tn);
            xd = xn;
        }
        let xfd = xd.index_select(&p.last, 0)?;
        let (rfd, hfd) = norm_tan(&p.xf, &p.rf, &self.norm, &xfd)?;
        let theta = self.theta.reshape((d, 1))?;
        let rd = (p.hf.matmul(&theta_d.reshape((d, 1))?)? + hfd.matmul(&theta)?)?;
        let md = (rd.narrow(0, 0, n)? - rd.narrow(0, n, n)?)?;
        let ed = (&p.c * md)?;
        let ed = Tensor::cat(&[&ed, &ed.neg()?], 0)?;
        // tangent backward
        let g_theta = (p.hf.t()?.matmul(&ed)? + hfd.t()?.matmul(&p.e)?)?.reshape(d)?;
        let ghf = p.e.broadcast_mul(&theta.reshape((1, d))?)?;
        let ghfd = (ed.broadcast_mul(&theta.reshape((1, d))?)? + p.e.broadcast_mul(&theta_d.reshape((1, d))?)?)?;
        let gxfd = norm_tan_bwd(&p.xf, &xfd, &p.rf, &rfd, &self.norm, &ghf, &ghfd)?;
        let mut gxd = xd.zeros_like()?.index_add(&p.last, &gxfd, 0)?;
        let mut rev: Vec<Vec<Tensor>> = Vec::with_capacity(p.fwd.len());
        for l in (0..p.fwd.len()).rev() {
            let (gs, gxn) = block_tan_bwd(
                geo,
                &self.blocks[l],
                &self.gammas[l],
                (&p.fwd[l], &p.adj[l], &tans[l]),
                &dirs[l],
                gxd,
                l > 0,
            )?;
            rev.push(gs);
            match gxn {
                Some(g) => gxd = g,
                None => break,
            }
        }
        let mut out: Vec<Tensor> = rev.into_iter().rev().flatten().collect();
        out.push(g_theta);
        Ok(out)
    }
}

/// One block's forward pass on x (b·t, hidden), recorded.
fn block_fwd(geo: &Geo, lin: &[Lin; 7], (g1, g2): &(Tensor, Tensor), x: Tensor) -> Result<(BlockFwd, Tensor)> {
    let (r1, h1) = norm_fwd(&x, g1, geo.eps)?;
    let (ql, qxa) = lin[0].fwd(&h1)?;
    let (kl, kxa) = lin[1].fwd(&h1)?;
    let (vl, vxa) = lin[2].fwd(&h1)?;
    let q = geo.grouped(&geo.heads(&ql, geo.heads, true)?)?;
    let k = geo.heads(&kl, geo.kv, true)?;
    let v = geo.heads(&vl, geo.kv, false)?;
    let (lse, o) = attn_fwd(geo, &q, &k, &v)?;
    let ya = geo.rows(&geo.ungrouped(&o)?, false)?;
    let (od, oxa) = lin[3].fwd(&ya)?;
    let x1 = (&x + od)?;
    let (r2, h2) = norm_fwd(&x1, g2, geo.eps)?;
    let (gate, gxa) = lin[4].fwd(&h2)?;
    let (up, uxa) = lin[5].fwd(&h2)?;
    let a = ((&gate * sigmoid(&gate)?)? * &up)?;
    let (dn, dxa) = lin[6].fwd(&a)?;
    let xn = (&x1 + dn)?;
    let xa = [qxa, kxa, vxa, oxa, gxa, uxa, dxa];
    Ok((BlockFwd { x, r1, h1, xa, q, k, v, lse, ya, x1, r2, h2, gate, up }, xn))
}

/// One block's backward pass from ∂ℓ/∂(its output): its adjoints, its adapters' gradients
/// (A, B of each adapted layer in order) and, with `need_gx`, ∂ℓ/∂(its input).
fn block_bwd(
    geo: &Geo,
    lin: &[Lin; 7],
    (g1, g2): &(Tensor, Tensor),
    f: &BlockFwd,
    gxn: Tensor,
    need_gx: bool,
) -> Result<(BlockAdj, Vec<Tensor>, Option<Tensor>)> {
    let mut grads: [Option<(Tensor, Tensor)>; 7] = Default::default();
    let mut saved: [Option<LinBwdSaved>; 7] = Default::default();
    let mut keep = |j: usize, x: &Tensor, g: &Tensor, need: bool| -> Result<Option<Tensor>> {
        let r = lin[j].bwd(x, f.xa[j].as_ref(), g, need)?;
        grads[j] = r.grads;
        // the gate's and up's adjoints are recomputed from ∂ℓ/∂a (a third of the tape)
        saved[j] = Some(LinBwdSaved { g: (j != 4 && j != 5).then(|| g.clone()), gb: r.gb });
        Ok(r.gx)
    };
    let missing = || candle_core::Error::Msg("exact HVPs: a missing input adjoint".into());
    // MLP
    let ga = keep(6, &mlp_out(geo, f)?, &gxn, true)?.ok_or_else(missing)?;
    let (ggate, gup) = mlp_bwd(geo, f, &ga)?;
    let gh2 =
        (keep(4, &f.h2, &ggate, true)?.ok_or_else(missing)? + keep(5, &f.h2, &gup, true)?.ok_or_else(missing)?)?;
    let gx1 = (&gxn + norm_bwd(&f.x1, &f.r2, g2, &gh2)?)?;
    // attention
    let gya = keep(3, &f.ya, &gx1, true)?.ok_or_else(missing)?;
    let go = geo.grouped(&geo.heads(&gya, geo.heads, false)?)?;
    let d = geo.head_dots(&gya, &f.ya)?;
    let (gq, gk, gv) = attn_bwd(geo, f, &go, &d)?;
    let gql = geo.rows(&geo.ungrouped(&gq)?, true)?;
    let gkl = geo.rows(&gk, true)?;
    let gvl = geo.rows(&gv, false)?;
    // the first block's input is the embeddings, which do not learn: no ∂ℓ/∂h1 needed
    let (gq1, gk1, gv1) =
        (keep(0, &f.h1, &gql, need_gx)?, keep(1, &f.h1, &gkl, need_gx)?, keep(2, &f.h1, &gvl, need_gx)?);
    let (gh1, gx) = match (gq1, gk1, gv1) {
        (Some(a), Some(b), Some(c)) => {
            let gh1 = ((a + b)? + c)?;
            let gx = (&gx1 + norm_bwd(&f.x, &f.r1, g1, &gh1)?)?;
            (gh1, Some(gx))
        }
        _ => (gx1.zeros_like()?, None),
    };
    let lin_saved = saved.map(|s| s.expect("every layer's adjoint is kept"));
    let gs_out: Vec<Tensor> = grads.into_iter().flatten().flat_map(|(a, b)| [a, b]).collect();
    Ok((BlockAdj { lin: lin_saved, gh1, gh2, ga, gya, d }, gs_out, gx))
}

/// One block's tangent forward pass along the directions `dir` from the tangent of its input.
fn block_tan(
    geo: &Geo,
    lin: &[Lin; 7],
    (g1, g2): &(Tensor, Tensor),
    f: &BlockFwd,
    dir: &[Option<(Tensor, Tensor)>; 7],
    xd: Tensor,
) -> Result<(BlockTan, Tensor)> {
    let (r1, h1) = norm_tan(&f.x, &f.r1, g1, &xd)?;
    let (qd, qxa) = lin[0].tan(&f.h1, f.xa[0].as_ref(), &h1, dir[0].as_ref())?;
    let (kd, kxa) = lin[1].tan(&f.h1, f.xa[1].as_ref(), &h1, dir[1].as_ref())?;
    let (vd, vxa) = lin[2].tan(&f.h1, f.xa[2].as_ref(), &h1, dir[2].as_ref())?;
    let q = geo.grouped(&geo.heads(&qd, geo.heads, true)?)?;
    let k = geo.heads(&kd, geo.kv, true)?;
    let v = geo.heads(&vd, geo.kv, false)?;
    let ya = geo.rows(&geo.ungrouped(&attn_tan(geo, f, &q, &k, &v)?)?, false)?;
    let (od, oxa) = lin[3].tan(&f.ya, f.xa[3].as_ref(), &ya, dir[3].as_ref())?;
    let x1 = (&xd + od)?;
    let (r2, h2) = norm_tan(&f.x1, &f.r2, g2, &x1)?;
    let (gate, gxa) = lin[4].tan(&f.h2, f.xa[4].as_ref(), &h2, dir[4].as_ref())?;
    let (up, uxa) = lin[5].tan(&f.h2, f.xa[5].as_ref(), &h2, dir[5].as_ref())?;
    let a = mlp_tan(geo, f, &gate, &up)?;
    let (dn, dxa) = lin[6].tan(&mlp_out(geo, f)?, f.xa[6].as_ref(), &a, dir[6].as_ref())?;
    let xn = (&x1 + dn)?;
    let xa = [qxa, kxa, vxa, oxa, gxa, uxa, dxa];
    Ok((BlockTan { x: xd, r1, h1, xa, q, k, v, ya, x1, r2, h2, gate, up, a }, xn))
}

/// One block's tangent backward pass from the tangent of ∂ℓ/∂(its output): the tangents of its
/// adapters' gradients (the block's share of Hv) and, with `need_gx`, of ∂ℓ/∂(its input).
/// `(f, a, td)`: the block's records of the forward pass, the backward (adjoint) pass and the
/// tangent forward pass.
fn block_tan_bwd(
    geo: &Geo,
    lin: &[Lin; 7],
    (g1, g2): &(Tensor, Tensor),
    (f, a, td): (&BlockFwd, &BlockAdj, &BlockTan),
    dir: &[Option<(Tensor, Tensor)>; 7],
    gxnd: Tensor,
    need_gx: bool,
) -> Result<(Vec<Tensor>, Option<Tensor>)> {
    let mut hv: [Option<(Tensor, Tensor)>; 7] = Default::default();
    // the gate's and up's adjoints, recomputed
    let (ggate, gup) = mlp_bwd(geo, f, &a.ga)?;
    let mut step = |j: usize, x: &Tensor, xd: &Tensor, gd: &Tensor, need: bool| -> Result<Option<Tensor>> {
        let g = match j {
            4 => &ggate,
            5 => &gup,
            _ => {
                a.lin[j].g.as_ref().ok_or_else(|| candle_core::Error::Msg("exact HVPs: an adjoint not kept".into()))?
            }
        };
        let r = lin[j].tan_bwd(
            (x, f.xa[j].as_ref()),
            (xd, td.xa[j].as_ref()),
            (g, a.lin[j].gb.as_ref()),
            gd,
            dir[j].as_ref(),
            need,
        )?;
        hv[j] = r.grads;
        Ok(r.gx)
    };
    let missing = || candle_core::Error::Msg("exact HVPs: a missing input adjoint's tangent".into());
    // MLP: a = silu(gate) ⊙ up
    let gad = step(6, &mlp_out(geo, f)?, &td.a, &gxnd, true)?.ok_or_else(missing)?;
    let (ggated, gupd) = mlp_tan_bwd(geo, f, &a.ga, &gad, td)?;
    let gh2d = (step(4, &f.h2, &td.h2, &ggated, true)?.ok_or_else(missing)?
        + step(5, &f.h2, &td.h2, &gupd, true)?.ok_or_else(missing)?)?;
    let gx1d = (&gxnd + norm_tan_bwd(&f.x1, &td.x1, &f.r2, &td.r2, g2, &a.gh2, &gh2d)?)?;
    // attention
    let gyad = step(3, &f.ya, &td.ya, &gx1d, true)?.ok_or_else(missing)?;
    let god = geo.grouped(&geo.heads(&gyad, geo.heads, false)?)?;
    let go = geo.grouped(&geo.heads(&a.gya, geo.heads, false)?)?;
    // D's tangent ⟨Ō̇, O⟩ + ⟨Ō, Ȯ⟩ per query row
    let dd = (geo.head_dots(&gyad, &f.ya)? + geo.head_dots(&a.gya, &td.ya)?)?;
    let (gqd, gkd, gvd) = attn_tan_bwd(geo, f, (&go, &a.d), td, &god, &dd)?;
    let gqld = geo.rows(&geo.ungrouped(&gqd)?, true)?;
    let gkld = geo.rows(&gkd, true)?;
    let gvld = geo.rows(&gvd, false)?;
    // the first block: its input is the embeddings, which do not learn
    let (q1, k1, v1) = (
        step(0, &f.h1, &td.h1, &gqld, need_gx)?,
        step(1, &f.h1, &td.h1, &gkld, need_gx)?,
        step(2, &f.h1, &td.h1, &gvld, need_gx)?,
    );
    let gxd = match (q1, k1, v1) {
        (Some(q), Some(k), Some(v)) => {
            let gh1d = ((q + k)? + v)?;
            Some((&gx1d + norm_tan_bwd(&f.x, &td.x, &f.r1, &td.r1, g1, &a.gh1, &gh1d)?)?)
        }
        _ => None,
    };
    let out: Vec<Tensor> = hv.into_iter().flatten().flat_map(|(a, b)| [a, b]).collect();
    Ok((out, gxd))
}
