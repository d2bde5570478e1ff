//! One policy update on a deployment chunk (paper §6: the chunk's data update the reward model,
//! then the policy), as a library call on sampled token ids: [`rloo_update`] on the chunk's k
//! samples per prompt scored by the learned reward, [`dpo_update`] on its labelled pairs.
//! Both take Adam steps on the adapters, `epochs` passes over the data in mini-batches of
//! `minibatch` sequences (pairs, for DPO), in the order given.

use crate::adam::Adam;
use crate::batch::SeqBatch;
use crate::loss::{dpo_loss, rloo_advantages, rloo_loss};
use crate::model::PolicyModel;
use candle_core::{Result, Tensor};
use serde::{Deserialize, Serialize};

/// The KL estimator per token, with d = log π_ref − log π: k1 = −d, k3 = e^d − d − 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KlEstimator {
    K1,
    K3,
}

impl KlEstimator {
    pub fn per_token(&self, lp: f64, lp_ref: f64) -> f64 {
        let d = lp_ref - lp;
        match self {
            KlEstimator::K1 => -d,
            KlEstimator::K3 => d.exp() - d - 1.0,
        }
    }
}

/// RLOO (Ahmadian et al. 2024) as TRL's `RLOOTrainer` does it: r̃ = r − β·KL(sequence),
/// leave-one-out advantages within each prompt's k samples, a sequence-level ratio PPO-clipped
/// to [1 − ε, 1 + ε] against the log-probabilities before the update.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RlooConfig {
    pub kl_coef: f64,
    pub kl: KlEstimator,
    pub clip: Option<f64>,
    pub epochs: usize,
    pub minibatch: usize,
    /// Divide the advantages by their standard deviation over the chunk (TRL's
    /// `normalize_advantages`; the learned reward's scale drifts as θ learns).
    pub normalize_advantages: bool,
}

/// Online DPO on the chunk's labelled pairs, reference = the initial policy (adapters off).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DpoConfig {
    pub beta: f64,
    pub epochs: usize,
    pub minibatch: usize,
}

/// A sampled response: its prompt's ids (rendered for generation), its own ids.
#[derive(Clone, Debug)]
pub struct Rollout<'a> {
    pub prompt: &'a [u32],
    pub response: &'a [u32],
}

/// What an update saw: mean loss over its steps, Adam steps taken, ‖g‖ before clipping (mean),
/// the mean sequence KL to the reference before the update and its policy's entropy estimate.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct UpdateStats {
    pub loss: f64,
    pub steps: u64,
    pub grad_norm: f64,
    pub kl: f64,
    /// −mean log π(y_t) over the sampled tokens (an unbiased estimate of the per-token entropy
    /// of the policy on its own samples).
    pub entropy: f64,
    /// RLOO: the mean learned reward before the KL penalty; DPO: the mean implicit reward margin.
    pub reward: f64,
}

/// Per-sequence statistics of the current policy against the reference, without gradients:
/// (Σ_t log π, Σ_t KL estimator, tokens) for each sequence, in mini-batches.
pub fn score(
    m: &PolicyModel,
    seqs: &[Rollout<'_>],
    kl: KlEstimator,
    minibatch: usize,
) -> Result<Vec<(f64, f64, usize)>> {
    let mut out = Vec::with_capacity(seqs.len());
    for part in seqs.chunks(minibatch.max(1)) {
        let b = batch(m, part)?;
        let lp: Vec<f64> = m.logprobs_at(&b, true)?.to_dtype(candle_core::DType::F64)?.to_vec1()?;
        let lr: Vec<f64> = m.logprobs_at(&b, false)?.to_dtype(candle_core::DType::F64)?.to_vec1()?;
        let mut at = 0;
        for &l in &b.lens {
            let s: f64 = lp[at..at + l].iter().sum();
            let k: f64 = (at..at + l).map(|i| kl.per_token(lp[i], lr[i])).sum();
            out.push((s, k, l));
            at += l;
        }
    }
    Ok(out)
}

fn batch(m: &PolicyModel, part: &[Rollout<'_>]) -> Result<SeqBatch> {
    let seqs: Vec<(&[u32], &[u32])> = part.iter().map(|r| (r.prompt, r.response)).collect();
    SeqBatch::new(&seqs, m.device())
}

/// RLOO on `rollouts` (k consecutive samples per prompt) with learned rewards `rewards`.
pub fn rloo_update(
    m: &PolicyModel,
    opt: &mut Adam,
    rollouts: &[Rollout<'_>],
    rewards: &[f64],
    k: usize,
    cfg: &RlooConfig,
) -> Result<UpdateStats> {
    if rollouts.len() != rewards.len() || k < 2 || !rollouts.len().is_multiple_of(k) {
        candle_core::bail!("rloo: {} rollouts, {} rewards, in groups of {k}", rollouts.len(), rewards.len());
    }
    let before = score(m, rollouts, cfg.kl, cfg.minibatch)?;
    let shaped: Vec<f64> = rewards.iter().zip(&before).map(|(r, (_, kl, _))| r - cfg.kl_coef * kl).collect();
    let mut adv = rloo_advantages(&shaped, k);
    if cfg.normalize_advantages {
        let n = adv.len() as f64;
        let mean = adv.iter().sum::<f64>() / n;
        let sd = (adv.iter().map(|a| (a - mean).powi(2)).sum::<f64>() / n).sqrt();
        adv.iter_mut().for_each(|a| *a /= sd + 1e-8);
    }
    let tokens: usize = before.iter().map(|s| s.2).sum();
    let mut st = UpdateStats {
        kl: before.iter().map(|s| s.1).sum::<f64>() / before.len() as f64,
        entropy: -before.iter().map(|s| s.0).sum::<f64>() / tokens as f64,
        reward: rewards.iter().sum::<f64>() / rewards.len() as f64,
        ..Default::default()
    };
    let vars = m.vars();
    let dev = m.device();
    for _ in 0..cfg.epochs {
        for (i, part) in rollouts.chunks(cfg.minibatch.max(1)).enumerate() {
            let at = i * cfg.minibatch.max(1);
            let b = batch(m, part)?;
            // the gradient pass: the adapters' dropout, if any, with this step's masks
            let seq_lp = b.seq_sum(&m.logprobs_train(&b, opt.steps())?)?;
            let old: Vec<f32> = before[at..at + part.len()].iter().map(|s| s.0 as f32).collect();
            let a: Vec<f32> = adv[at..at + part.len()].iter().map(|&x| x as f32).collect();
            let old = Tensor::from_vec(old, part.len(), dev)?;
            let a = Tensor::from_vec(a, part.len(), dev)?;
            let loss = rloo_loss(&seq_lp, &old, &a, cfg.clip)?;
            st.loss += loss.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
            let info = opt.step(&vars, &loss.backward()?)?;
            st.grad_norm += info.grad_norm;
            st.steps += 1;
        }
    }
    if st.steps > 0 {
        st.loss /= st.steps as f64;
        st.grad_norm /= st.steps as f64;
    }
    Ok(st)
}

/// A labelled pair: the prompt, the preferred and the other response.
#[derive(Clone, Debug)]
pub struct Preference<'a> {
    pub prompt: &'a [u32],
    pub chosen: &'a [u32],
    pub rejected: &'a [u32],
}

/// The chosen responses of `ps`, then their rejected ones.
fn flat<'a>(ps: &[Preference<'a>]) -> Vec<Rollout<'a>> {
    ps.iter()
        .map(|p| Rollout { prompt: p.prompt, response: p.chosen })
        .chain(ps.iter().map(|p| Rollout { prompt: p.prompt, response: p.rejected }))
        .collect()
}

/// DPO on `pairs`; the reference is the base model (adapters off).
pub fn dpo_update(m: &PolicyModel, opt: &mut Adam, pairs: &[Preference<'_>], cfg: &DpoConfig) -> Result<UpdateStats> {
    if pairs.is_empty() {
        return Ok(UpdateStats::default());
    }
    let before = score(m, &flat(pairs), KlEstimator::K1, cfg.minibatch.max(1) * 2)?;
    let n = pairs.len();
    // reference log-probs: Σ log π − Σ k1 = Σ log π_ref
    let refs: Vec<f64> = before.iter().map(|(lp, k1, _)| lp - k1).collect();
    let tokens: usize = before.iter().map(|s| s.2).sum();
    let mut st = UpdateStats {
        kl: before.iter().map(|s| s.1).sum::<f64>() / before.len() as f64,
        entropy: -before.iter().map(|s| s.0).sum::<f64>() / tokens as f64,
        reward: (0..n).map(|i| cfg.beta * (before[i].1 - before[n + i].1)).sum::<f64>() / n as f64,
        ..Default::default()
    };
    let vars = m.vars();
    let dev = m.device();
    let mb = cfg.minibatch.max(1);
    for _ in 0..cfg.epochs {
        for (i, part) in pairs.chunks(mb).enumerate() {
            let at = i * mb;
            let c = part.len();
            let b = batch(m, &flat(part))?;
            let seq = b.seq_sum(&m.logprobs_train(&b, opt.steps())?)?;
            let (w, l) = (seq.narrow(0, 0, c)?, seq.narrow(0, c, c)?);
            let rw: Vec<f32> = refs[at..at + c].iter().map(|&x| x as f32).collect();
            let rl: Vec<f32> = refs[n + at..n + at + c].iter().map(|&x| x as f32).collect();
            let loss = dpo_loss(&w, &l, &Tensor::from_vec(rw, c, dev)?, &Tensor::from_vec(rl, c, dev)?, cfg.beta)?;
            st.loss += loss.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
            let info = opt.step(&vars, &loss.backward()?)?;
            st.grad_norm += info.grad_norm;
            st.steps += 1;
        }
    }
    st.loss /= st.steps.max(1) as f64;
    st.grad_norm /= st.steps.max(1) as f64;
    Ok(st)
}
