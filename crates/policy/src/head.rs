//! The LM head's log-probabilities of the targets as one op ([`lm_head_logprobs`]): the frozen
//! product of `crate::lora` (or its packed kernel) and the log-softmax of `crate::ops`, fused on
//! the CPU.

use crate::ops::{log_softmax_last, routed, Kernels};
use candle_core::{Result, Tensor};

/// Rows per block of [`lm_head_logprobs`]: a block's logits are 128 × vocabulary (25 MB for
/// SmolLM2's 49,152 tokens in f32).
const LM_BLOCK: usize = 128;

/// log π(t_r | row r) = log-softmax(x Wᵀ)[r, t_r]: the LM head, the log-softmax over the
/// vocabulary and the gather of each row's target in one op, for x (P, hidden), W (vocab,
/// hidden) and targets (P,) u32. ∂L/∂x_r = g_r (W[t_r] − softmax(x_r Wᵀ) W).
///
/// Fused (the CPU, W frozen): the rows in blocks of `LM_BLOCK`; each block's logits go through
/// candle's log-softmax kernel and are dropped, its log-softmax is kept for the backward only
/// when x needs a gradient, and the backward forms e^{log-softmax} ⊙ (−g) plus g at the
/// target block by block. A training step so holds one (P, vocab) tensor for the LM head where
/// the graph of `frozen_matmul` → `log_softmax_last` → `gather` held the logits and the
/// log-softmax through the backward and made four more (P, vocab) temporaries in it (issue 31:
/// the step's memory). The values are that graph's. With `packed` (a policy on packed
/// products, bf16 or f32) both products run on that packed kernel. Routed or composed (other devices), or
/// W a variable (a full-parameter policy, whose LM head takes a gradient): that graph.
pub fn lm_head_logprobs(
    x: &Tensor,
    w: &Tensor,
    packed: Option<&std::sync::Arc<crate::lora::PackedWeight>>,
    targets: &Tensor,
    k: Kernels,
) -> Result<Tensor> {
    let p = targets.dim(0)?;
    if k != Kernels::Fused || w.is_variable() {
        let logits = crate::lora::frozen_matmul(x, w, k)?;
        let lp = log_softmax_last(&logits, k)?;
        return lp.gather(&targets.reshape((p, 1))?, 1)?.squeeze(1);
    }
    if x.dim(0)? != p {
        candle_core::bail!("lm-head log-probabilities: {} rows for {p} targets", x.dim(0)?);
    }
    match x.dtype() {
        candle_core::DType::F32 => lm_head_fused::<f32>(x, w, packed, targets),
        candle_core::DType::F64 if packed.is_none() => lm_head_fused::<f64>(x, w, None, targets),
        other => candle_core::bail!("lm-head log-probabilities: the fused op runs in f32 or f64, not {other:?}"),
    }
}

/// The fused branch of [`lm_head_logprobs`]: per block of rows, the logits written by one
/// product and turned into their log-softmax in place, row by row on rayon's pool (max, then
/// Σ e^{x − max} on the vectorised exponential, then x − max − log Σ); the backward forms
/// −g_r e^{ls} + g_r at the target in one pass per row, then one product. candle's
/// log-softmax took six single-threaded passes over each block (and its backward four).
fn lm_head_fused<T: crate::mm::ExpRow + candle_core::WithDType>(
    x: &Tensor,
    w: &Tensor,
    packed: Option<&std::sync::Arc<crate::lora::PackedWeight>>,
    targets: &Tensor,
) -> Result<Tensor> {
    use crate::mm::{product, with_slices, Mat};
    use rayon::prelude::*;
    let (p, hidden) = x.dims2()?;
    let vocab = w.dim(0)?;
    let tg: Vec<u32> = targets.to_vec1()?;
    if let Some(bad) = tg.iter().find(|&&t| t as usize >= vocab) {
        candle_core::bail!("lm-head log-probabilities: target {bad} outside a vocabulary of {vocab}");
    }
    let xd = x.detach().contiguous()?;
    let w = w.contiguous()?;
    let keep = x.track_op();
    let (mut lps, mut kept) = (Vec::with_capacity(p), Vec::new());
    for start in (0..p).step_by(LM_BLOCK) {
        let n = LM_BLOCK.min(p - start);
        let rows = xd.narrow(0, start, n)?;
        let mut ls: Vec<T> = match packed {
            Some(pk) => with_slices::<T, _, 1>([&rows], |[r]| pk.forward_values(r, n))??,
            None => with_slices::<T, _, 2>([&rows, &w], |[r, w]| {
                product(n, vocab, hidden, Mat::rows(r, hidden), Mat::t(w, hidden))
            })?,
        };
        ls.par_chunks_mut(vocab).for_each(|row| {
            let m = row.iter().fold(T::neg_infinity(), |a, &b| num_traits::Float::max(a, b));
            let mut buf = [T::zero(); 512];
            let mut sum = T::zero();
            for c in row.chunks(buf.len()) {
                let e = &mut buf[..c.len()];
                e.iter_mut().zip(c).for_each(|(e, &v)| *e = v - m);
                T::exp_row(e);
                sum = e.iter().fold(sum, |a, &v| a + v);
            }
            let shift = m + sum.ln();
            row.iter_mut().for_each(|v| *v -= shift);
        });
        lps.extend(ls.chunks(vocab).zip(&tg[start..start + n]).map(|(row, &t)| row[t as usize]));
        if keep {
            kept.push(ls);
        }
    }
    let y = Tensor::from_vec(lps, p, x.device())?;
    let packed = packed.cloned();
    routed(x, y, "lm-head-logprobs", move |_, _, g| {
        let g: Vec<T> = g.to_vec1()?;
        let mut dx = Vec::with_capacity(kept.len());
        for (b, ls) in kept.iter().enumerate() {
            let n = ls.len() / vocab;
            let at = b * LM_BLOCK;
            let mut d = ls.clone();
            d.par_chunks_mut(vocab).enumerate().for_each(|(r, row)| {
                T::exp_row(row);
                let gr = g[at + r];
                row.iter_mut().for_each(|v| *v = -gr * *v);
                let t = tg[at + r] as usize;
                row[t] += gr;
            });
            dx.push(match &packed {
                Some(pk) => Tensor::from_vec(pk.backward_values(&d, n)?, (n, hidden), &candle_core::Device::Cpu)?,
                None => {
                    let v = with_slices::<T, _, 1>([&w], |[w]| {
                        product(n, hidden, vocab, Mat::rows(&d, vocab), Mat::rows(w, hidden))
                    })?;
                    Tensor::from_vec(v, (n, hidden), &candle_core::Device::Cpu)?
                }
            });
        }
        Tensor::cat(&dx, 0)
    })
}
