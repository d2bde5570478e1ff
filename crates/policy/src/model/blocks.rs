//! A decoder block's pass ([`PolicyModel::block`]): grouped-query causal attention with its
//! output projection, and the MLP, each as one fused node where its products allow
//! ([`PolicyModel::mlp_fused`], [`PolicyModel::o_fused`]).

use super::{Block, PolicyModel, Segment};
use crate::lora::Pass;
use crate::ops::Kernels;
use candle_core::{DType, Result, Tensor};

impl PolicyModel {
    /// One decoder block on x (b·t, hidden) at the t positions of `seg.cos`/`seg.sin`, attending
    /// to `seg.prefix`'s keys and values first when given; returns the block's output and, with
    /// `seg.need_kv`, this segment's (roped) keys and values (b, kv, t, hd).
    pub(super) fn block(
        &self,
        blk: &Block,
        x: Tensor,
        seg: Segment<'_>,
        pass: Pass<'_>,
    ) -> Result<(Tensor, Option<(Tensor, Tensor)>)> {
        let k = self.kernels;
        let h = crate::ops::rms_norm(&x, &blk.norm1, self.cfg.eps, k)?;
        let (x, kv) = self.attention(blk, &h, seg, pass, None, Some(&x))?;
        if let Some(y) = self.mlp_fused(blk, &x, pass)? {
            return Ok((y, kv));
        }
        let h = crate::ops::rms_norm(&x, &blk.norm2, self.cfg.eps, k)?;
        let a = crate::ops::silu_mul(&blk.gate.forward(&h, pass, k)?, &blk.up.forward(&h, pass, k)?, k)?;
        let m = blk.down.forward(&a, pass, k)?;
        Ok(((x + m)?, kv))
    }

    /// The MLP sublayer y = x + down(silu(gate h) ⊙ up h), h = RMSNorm₂(x), as one node of the
    /// graph when each of its three products is frozen or a plain adapted one in `pass`
    /// ([`Linear::inner`]) on the fused kernels; None otherwise (the sublayer's ops one by one).
    /// The node's inputs are x and, when a product is adapted, its A and B (flattened into one
    /// tensor). The forward is those ops' own, outside the graph; the backward calls each op's
    /// backward in the graph's order (down, silu ⊙ up, gate + up, the norm, + the residual; the
    /// SwiGLU product recomputed for an adapted down), so values and gradients are theirs bit
    /// for bit. What changes is what the graph keeps: gate h and up h (and h where gate or up is
    /// adapted) where it kept h, both products, their SwiGLU product, down's output and the
    /// residual sum — 2·i + h values per token and layer instead of 3·i + 3·h (SmolLM2: 3,648 of
    /// 6,336; issue 31's memory item).
    fn mlp_fused(&self, blk: &Block, x: &Tensor, pass: Pass<'_>) -> Result<Option<Tensor>> {
        let k = self.kernels;
        if k != Kernels::Fused
            || !self.fuse_sublayers
            || !matches!(x.dtype(), DType::F32 | DType::F64)
            || blk.norm2.is_variable()
        {
            return Ok(None);
        }
        let (Some(gate), Some(up), Some(down)) =
            (blk.gate.inner(pass, k), blk.up.inner(pass, k), blk.down.inner(pass, k))
        else {
            return Ok(None);
        };
        // the adapters' A and B, in the order the backward returns their gradients
        let params: Vec<Tensor> =
            [&gate, &up, &down].iter().filter_map(|p| p.adapter()).flat_map(|(a, b)| [a.clone(), b.clone()]).collect();
        if !x.track_op() && params.is_empty() {
            return Ok(None);
        }
        let xd = x.detach();
        let eps = self.cfg.eps;
        let h = crate::ops::rms_norm(&xd, &blk.norm2, eps, k)?;
        let (g, u) = (gate.forward(&blk.gate, &h, pass, k)?, up.forward(&blk.up, &h, pass, k)?);
        let act = crate::ops::silu_mul(&g, &u, k)?;
        let m = down.forward(&blk.down, &act, pass, k)?;
        drop(act);
        let y = (&xd + m)?;
        let w = blk.norm2.clone();
        // h is what an adapted gate or up reads in its backward
        let h = (gate.adapter().is_some() || up.adapter().is_some()).then_some(h);
        let sizes: Vec<usize> = params.iter().map(|t| t.elem_count()).collect();
        let backward = move |x: &Tensor, dy: &Tensor| -> Result<(Tensor, Vec<Tensor>)> {
            let mut grads = Vec::new();
            let act = match down.adapter() {
                Some(_) => Some(crate::ops::silu_mul(&g, &u, Kernels::Fused)?),
                None => None,
            };
            let (da, dd) = down.backward(act.as_ref(), dy)?;
            let (dg, du) = crate::ops::silu_mul_grads(&g, &u, &da)?;
            let (dh_g, gg) = gate.backward(h.as_ref(), &dg)?;
            let (dh_u, gu) = up.backward(h.as_ref(), &du)?;
            for (da, db) in [gg, gu, dd].into_iter().flatten() {
                grads.push(da.flatten_all()?);
                grads.push(db.flatten_all()?);
            }
            let dh = (dh_g + dh_u)?;
            Ok(((dy + crate::ops::rms_norm_x_grad(x, &w, eps, &dh)?)?, grads))
        };
        if params.is_empty() {
            let y = crate::ops::routed(x, y, "mlp", move |x, _, dy| Ok(backward(x, dy)?.0))?;
            return Ok(Some(y));
        }
        let flat = Tensor::cat(&params.iter().map(|t| t.flatten_all()).collect::<Result<Vec<_>>>()?, 0)?;
        let y = crate::ops::routed2((x, &flat), y, "mlp", move |x, _, _, dy| {
            let (dx, grads) = backward(x, dy)?;
            if grads.iter().map(|t| t.elem_count()).ne(sizes.iter().copied()) {
                candle_core::bail!("mlp: the adapters' gradients do not match their sizes");
            }
            Ok((Some(dx), Some(Tensor::cat(&grads, 0)?)))
        })?;
        Ok(Some(y))
    }

    /// Grouped-query causal attention of x (b·t, hidden), t the positions of `seg.cos`; with
    /// `seg.prefix` ((b, kv, p, hd) keys and values of earlier positions), the queries attend to
    /// those first (`seg.mask` is then (t, p + t)). Returns the output — the output projection
    /// on the `rows` of (b·t) alone when given — and, with `seg.need_kv`, this segment's keys and
    /// values; with `residual` (the block's input), residual + that output. On the routed path
    /// without a prefix, attention is one node from the projections' rows
    /// ([`crate::attention::attention_routed`]). The steps: the projections as heads
    /// ([`PolicyModel::qkv_heads`]), the prefix's keys and values before the segment's, the
    /// attention itself ([`PolicyModel::attend`]), the output projection
    /// ([`PolicyModel::o_fused`], or [`PolicyModel::attention_out`] on the merged heads).
    pub(super) fn attention(
        &self,
        blk: &Block,
        x: &Tensor,
        seg: Segment<'_>,
        pass: Pass<'_>,
        rows: Option<&Tensor>,
        residual: Option<&Tensor>,
    ) -> Result<(Tensor, Option<(Tensor, Tensor)>)> {
        let Segment { cos, mask, prefix, need_kv, .. } = seg;
        let t = cos.dim(0)?;
        let b = x.dim(0)? / t.max(1);
        let (h, hd) = (self.cfg.heads, self.cfg.head_dim);
        if self.kernels == Kernels::Routed && prefix.is_none() && !need_kv {
            let y = self.routed_attention(blk, x, seg, pass, b)?;
            return Ok((self.attention_out(blk, y, pass, rows, residual)?, None));
        }
        let fused = self.kernels == Kernels::Fused;
        let (q, k, v) = self.qkv_heads(blk, x, seg, pass, b)?;
        let (keys, values) = match prefix {
            // candle's cat along an inner dimension returns a strided view: matmul wants rows
            Some((pk, pv)) => (Tensor::cat(&[pk, &k], 2)?.contiguous()?, Tensor::cat(&[pv, &v], 2)?.contiguous()?),
            None => (k.clone(), v.clone()),
        };
        let y = self.attend(&q, &keys, &values, mask, (b, t))?;
        if let (Some(x0), None) = (residual, rows) {
            if let Some(out) = self.o_fused(blk, x0, &y, pass)? {
                return Ok((out, need_kv.then_some((k, v))));
            }
        }
        let y = match fused {
            true => crate::ops::merge_heads(&y)?,
            false => y.transpose(1, 2)?.reshape((b * t, h * hd))?,
        };
        Ok((self.attention_out(blk, y, pass, rows, residual)?, need_kv.then_some((k, v))))
    }

    /// The attention's rows (b·t, heads·hd) on the routed path: the three projections' rows,
    /// then attention as one node over them ([`crate::attention::attention_routed`]).
    fn routed_attention(&self, blk: &Block, x: &Tensor, seg: Segment<'_>, pass: Pass<'_>, b: usize) -> Result<Tensor> {
        let Segment { cos, sin, mask, .. } = seg;
        let t = cos.dim(0)?;
        let (h, kv, hd) = (self.cfg.heads, self.cfg.kv_heads, self.cfg.head_dim);
        let (q, k, v) = (
            blk.q.forward(x, pass, self.kernels)?,
            blk.k.forward(x, pass, self.kernels)?,
            blk.v.forward(x, pass, self.kernels)?,
        );
        let geo = crate::attention::Geometry { b, t, heads: h, kv, hd, interleaved: self.cfg.rope_interleaved };
        crate::attention::attention_routed(&q, &k, &v, cos, sin, mask, geo)
    }

    /// The queries (b, heads, t, hd), keys and values (b, kv, t, hd) of x (b·t, hidden), RoPE
    /// turning q and k: each projection written in heads by its own op on the fused sublayers
    /// ([`crate::lora::Linear::forward_heads`]), else its rows split into heads.
    fn qkv_heads(
        &self,
        blk: &Block,
        x: &Tensor,
        seg: Segment<'_>,
        pass: Pass<'_>,
        b: usize,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let Segment { cos, sin, .. } = seg;
        let t = cos.dim(0)?;
        let (h, kv, hd) = (self.cfg.heads, self.cfg.kv_heads, self.cfg.head_dim);
        let fused = self.kernels == Kernels::Fused;
        // rows (b·t, n·hd) → heads (b, n, t, hd), RoPE on the way for q and k
        let heads = |y: Tensor, n: usize, rope: bool| -> Result<Tensor> {
            if fused {
                return crate::ops::split_heads(
                    &y,
                    (b, t, n, hd),
                    rope.then_some((cos, sin, self.cfg.rope_interleaved)),
                );
            }
            let y = y.reshape((b, t, n, hd))?.transpose(1, 2)?;
            match rope {
                true => crate::ops::rope(&y, cos, sin, self.cfg.rope_interleaved, self.kernels)?.contiguous(),
                false => y.contiguous(),
            }
        };
        if fused && self.fuse_sublayers {
            // each projection written in heads by its own op: its rows never enter the graph
            let to = |n: usize, rope: bool| {
                crate::ops::HeadsOut::new((b, t, n, hd), rope.then_some((cos, sin, self.cfg.rope_interleaved)))
            };
            return Ok((
                blk.q.forward_heads(x, pass, self.kernels, to(h, true)?)?,
                blk.k.forward_heads(x, pass, self.kernels, to(kv, true)?)?,
                blk.v.forward_heads(x, pass, self.kernels, to(kv, false)?)?,
            ));
        }
        Ok((
            heads(blk.q.forward(x, pass, self.kernels)?, h, true)?,
            heads(blk.k.forward(x, pass, self.kernels)?, kv, true)?,
            heads(blk.v.forward(x, pass, self.kernels)?, kv, false)?,
        ))
    }

    /// softmax(q kᵀ/√hd + mask) v of the heads q (b, heads, t, hd) over keys and values
    /// (b, kv, s, hd), query head j reading kv head j / (heads / kv): (b, heads, t, hd). Fused,
    /// one op with its gradient written out ([`crate::attention::causal_attention`]); else
    /// candle's ops.
    fn attend(
        &self,
        q: &Tensor,
        keys: &Tensor,
        values: &Tensor,
        mask: &Tensor,
        (b, t): (usize, usize),
    ) -> Result<Tensor> {
        let (h, kv, hd) = (self.cfg.heads, self.cfg.kv_heads, self.cfg.head_dim);
        if self.kernels == Kernels::Fused {
            // one op with its gradient written out: no (b, h, t, s) tensor in the graph
            return crate::attention::causal_attention(q, keys, values);
        }
        let s_len = keys.dim(2)?;
        // grouped-query attention: query head j reads kv head j / g
        let g = h / kv;
        let q = q.contiguous()?.reshape((b, kv, g * t, hd))?;
        let s = (q.matmul(&keys.t()?)? * (1.0 / (hd as f64).sqrt()))?;
        let s = s.reshape((b, kv, g, t, s_len))?.broadcast_add(mask)?;
        let p = crate::ops::softmax_last(&s.contiguous()?, self.kernels)?;
        p.reshape((b, kv, g * t, s_len))?.matmul(values)?.reshape((b, h, t, hd))
    }

    /// The output projection of the attention's rows y (b·t, heads·hd), on the `rows` of y alone
    /// when given, plus `residual` when given.
    fn attention_out(
        &self,
        blk: &Block,
        y: Tensor,
        pass: Pass<'_>,
        rows: Option<&Tensor>,
        residual: Option<&Tensor>,
    ) -> Result<Tensor> {
        // the attention's output rows that go on: all, or `rows`
        let y = match rows {
            Some(r) => y.index_select(r, 0)?,
            None => y,
        };
        let y = blk.o.forward(&y, pass, self.kernels)?;
        match residual {
            Some(x0) => x0 + y,
            None => Ok(y),
        }
    }

    /// The attention's tail x + o(merge(y)), y the heads (b, h, t, hd), as one node of the
    /// graph over x and y when the output projection is frozen in `pass`
    /// ([`Linear::frozen_x_grad`]) on the fused kernels and either carries a gradient; None
    /// otherwise. As [`PolicyModel::mlp_fused`]: the ops' own forward outside the graph, their
    /// backwards in the graph's order (∂x = g; ∂y = heads(g W_o)), the same bits; the graph no
    /// longer keeps the merged rows and the projection's output (heads·head_dim + hidden values
    /// per token and layer).
    fn o_fused(&self, blk: &Block, x: &Tensor, y: &Tensor, pass: Pass<'_>) -> Result<Option<Tensor>> {
        let k = self.kernels;
        if k != Kernels::Fused
            || !self.fuse_sublayers
            || !(x.track_op() || y.track_op())
            || !matches!(y.dtype(), DType::F32 | DType::F64)
            || y.dtype() != x.dtype()
        {
            return Ok(None);
        }
        let Some(dout) = blk.o.frozen_x_grad(pass, k) else { return Ok(None) };
        let (b, n, t, hd) = y.dims4()?;
        let out = blk.o.forward(&crate::ops::merge_heads(&y.detach())?, pass, k)?;
        let v = (x.detach() + out)?;
        let out = crate::ops::routed2((x, y), v, "attention-out", move |_, _, _, g| {
            let dy = crate::ops::heads_values(&dout.apply(g)?, (b, t, n, hd), None, true, true)?;
            Ok((Some(g.clone()), Some(dy)))
        })?;
        Ok(Some(out))
    }
}
