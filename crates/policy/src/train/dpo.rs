//! Direct preference optimisation on a chunk's labelled pairs ([`dpo_update`]): each pair's
//! chosen and rejected responses scored against the base model, Adam steps on the DPO loss.

use super::{
    batch, epoch_order, minibatch_loop, score, DpoConfig, Epochs, KlEstimator, MiniStep, Rollout, UpdateStats,
};
use crate::adam::Adam;
use crate::loss::dpo_loss;
use crate::model::PolicyModel;
use candle_core::{Result, Tensor};

/// A labelled pair: the prompt, the preferred and the other response.
#[derive(Clone, Debug)]
pub struct Preference<'a> {
    pub prompt: &'a [u32],
    pub chosen: &'a [u32],
    pub rejected: &'a [u32],
}

/// Each pair's chosen response, then its rejected one (rows 2i and 2i + 1: the two share
/// their prompt's pass).
fn flat<'a>(ps: &[Preference<'a>]) -> Vec<Rollout<'a>> {
    ps.iter()
        .flat_map(|p| {
            [Rollout { prompt: p.prompt, response: p.chosen }, Rollout { prompt: p.prompt, response: p.rejected }]
        })
        .collect()
}

/// DPO on `pairs`; the reference is the base model (adapters off). No pairs: an error (the
/// caller decides what a chunk without preferences means).
pub fn dpo_update(m: &PolicyModel, opt: &mut Adam, pairs: &[Preference<'_>], cfg: &DpoConfig) -> Result<UpdateStats> {
    if pairs.is_empty() {
        candle_core::bail!("dpo: no pairs to learn from");
    }
    let before = score(m, &flat(pairs), KlEstimator::K1, cfg.minibatch.max(1) * 2)?;
    let n = pairs.len();
    // reference log-probs: Σ log π − Σ k1 = Σ log π_ref
    // pair i: chosen at 2i, rejected at 2i + 1
    let refs: Vec<f64> = before.iter().map(|(lp, k1, _)| lp - k1).collect();
    let tokens: usize = before.iter().map(|s| s.2).sum();
    let mut st = UpdateStats {
        kl: before.iter().map(|s| s.1).sum::<f64>() / before.len() as f64,
        entropy: -before.iter().map(|s| s.0).sum::<f64>() / tokens as f64,
        reward: (0..n).map(|i| cfg.beta * (before[2 * i].1 - before[2 * i + 1].1)).sum::<f64>() / n as f64,
        ..Default::default()
    };
    let dev = m.device();
    let e = Epochs { epochs: cfg.epochs, minibatch: cfg.minibatch, lr_window: cfg.lr_window, seed: cfg.seed };
    let zero = "the gradient is exactly 0 on pairs of distinct responses";
    let step_of = |idx: &[usize], step: u64| {
        let c = idx.len();
        let part: Vec<Preference> = idx.iter().map(|&i| pairs[i].clone()).collect();
        let batch = batch(m, &flat(&part))?;
        let seq = batch.seq_sum(&m.logprobs_train(&batch, step)?)?.reshape((c, 2))?;
        let (w, l) = (seq.narrow(1, 0, 1)?.squeeze(1)?, seq.narrow(1, 1, 1)?.squeeze(1)?);
        let rw: Vec<f32> = idx.iter().map(|&i| refs[2 * i] as f32).collect();
        let rl: Vec<f32> = idx.iter().map(|&i| refs[2 * i + 1] as f32).collect();
        let loss = dpo_loss(&w, &l, &Tensor::from_vec(rw, c, dev)?, &Tensor::from_vec(rl, c, dev)?, cfg.beta)?;
        Ok(MiniStep { loss, must_move: part.iter().any(|p| p.chosen != p.rejected), batch })
    };
    let order = |step| epoch_order(n, cfg.seed, step);
    minibatch_loop(("dpo", zero), &m.vars(), opt, e, n, order, &mut st, step_of, |_, _| Ok(()))?;
    Ok(st)
}
