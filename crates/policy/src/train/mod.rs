//! One policy update on a deployment chunk (paper §6: the chunk's data update the reward model,
//! then the policy), as a library call on sampled token ids: [`rloo_update`] on the chunk's k
//! samples per prompt scored by the learned reward, [`dpo_update`] on its labelled pairs.
//! Both take Adam steps on the adapters, `epochs` passes over the data in mini-batches of
//! `minibatch` sequences (pairs, for DPO), shuffled anew each epoch from a seeded stream —
//! RLOO shuffles whole prompt groups, so the samples of a prompt stay together. Every pass lays
//! its sequences out with shared prompts ([`SeqBatch::shared`]): a prompt runs through the
//! decoder once for all of its samples in a mini-batch.
//! An update whose gradient is exactly zero while its advantages (pairs) are not is an error:
//! the graph did not reach the adapters, and a step would be a silent non-update.

use crate::adam::{Adam, LrWindow};
use crate::batch::SeqBatch;
use crate::loss::{rloo_advantages, rloo_loss, token_pg_loss};
use crate::model::PolicyModel;
use candle_core::{Result, Tensor};
use serde::{Deserialize, Serialize};

mod dpo;
mod ppo;

pub use dpo::{dpo_update, Preference};
pub use ppo::{ppo_update, PpoConfig, PpoStats};

/// The KL estimator per token, with d = log π_ref − log π: k1 = −d, k3 = e^d − d − 1.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KlEstimator {
    K1,
    K3,
}

impl KlEstimator {
    /// One token's estimate of KL(π‖π_ref) from its log-probabilities under π (the sampling
    /// policy) and π_ref (Schulman's k1 and k3): both unbiased for tokens drawn from π; k3 is
    /// never negative and has the lower variance where π ≈ π_ref.
    pub fn per_token(&self, lp: f64, lp_ref: f64) -> f64 {
        let d = lp_ref - lp;
        match self {
            KlEstimator::K1 => -d,
            KlEstimator::K3 => d.exp() - d - 1.0,
        }
    }
}

/// How the reward is scaled before the KL penalty is subtracted.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum RewardNorm {
    /// The raw reward (its scale, e.g. ‖θ‖ of a learned linear reward, sets the KL's weight).
    None,
    /// (r − mean)/sd over the update's rewards (the chunk), then clipped to ±`clip`: OpenRLHF's
    /// `normalize_reward` and `reward_clip_range` (±10). The update no longer depends on the
    /// reward's scale, so β means the same for every estimator and chunk.
    Chunk { clip: f64 },
}

impl RewardNorm {
    /// The rewards as the update sees them.
    pub fn apply(&self, r: &[f64]) -> Vec<f64> {
        match (*self, self.moments(r)) {
            (RewardNorm::Chunk { clip }, Some((mean, sd))) => {
                r.iter().map(|x| ((x - mean) / sd).clamp(-clip, clip)).collect()
            }
            // all equal (e.g. θ = 0): no information, every normalised reward 0
            (RewardNorm::Chunk { .. }, None) => vec![0.0; r.len()],
            (RewardNorm::None, _) => r.to_vec(),
        }
    }

    /// (mean, sd) of `r` that [`RewardNorm::apply`] divides by (population sd); None when it
    /// does not normalise, or every reward is equal. (0, 1) for `None`.
    pub fn moments(&self, r: &[f64]) -> Option<(f64, f64)> {
        match *self {
            RewardNorm::None => Some((0.0, 1.0)),
            RewardNorm::Chunk { .. } => {
                let n = r.len().max(1) as f64;
                let mean = r.iter().sum::<f64>() / n;
                let sd = (r.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n).sqrt();
                (sd > 0.0).then_some((mean, sd))
            }
        }
    }
}

/// Where the KL penalty enters RLOO's advantage.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KlPenalty {
    /// TRL's RLOO: r̃ = r − β Σ_t KL_t per sequence, leave-one-out baselines of r̃, one
    /// sequence-level ratio per sample.
    Sequence,
    /// OpenRLHF's: the leave-one-out advantage of r, then per token A_t = A − β Σ_{s≥t} KL_s
    /// (the return of a reward −β KL_s at every token and r at the last, γ = 1), a ratio and
    /// its clip per token, the loss averaged over each sequence's tokens, then over sequences.
    Token,
}

/// RLOO (Ahmadian et al. 2024): the reward normalised ([`RewardNorm`]), the KL penalty per
/// sequence (TRL's `RLOOTrainer`) or per token (OpenRLHF) ([`KlPenalty`]), leave-one-out
/// advantages within each prompt's k samples, the ratio PPO-clipped to [1 − ε, 1 + ε] against
/// the log-probabilities before the update.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RlooConfig {
    pub kl_coef: f64,
    pub kl: KlEstimator,
    pub kl_penalty: KlPenalty,
    pub reward_norm: RewardNorm,
    pub clip: Option<f64>,
    pub epochs: usize,
    pub minibatch: usize,
    /// Centre the advantages on their mean and divide them by their sample standard deviation
    /// over the chunk (TRL's `normalize_advantage`: [`whiten`]).
    pub normalize_advantages: bool,
    /// The steps the optimiser's learning-rate schedule spans.
    pub lr_window: LrWindow,
    /// Seed of the mini-batch shuffles (with the optimiser's step count): each epoch orders
    /// the prompt groups (a group's k samples stay together and in order), then cuts
    /// mini-batches of `minibatch` samples from that order.
    pub seed: u64,
}

/// Online DPO on the chunk's labelled pairs, reference = the initial policy (adapters off).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DpoConfig {
    pub beta: f64,
    pub epochs: usize,
    pub minibatch: usize,
    /// The steps the optimiser's learning-rate schedule spans.
    pub lr_window: LrWindow,
    /// Seed of the mini-batch shuffles (with the optimiser's step count).
    pub seed: u64,
}

/// Optimiser steps of an update of `items` sequences (pairs) in mini-batches of `minibatch`,
/// `epochs` times: epochs·⌈items / minibatch⌉.
pub fn update_steps(items: usize, minibatch: usize, epochs: usize) -> u64 {
    (epochs * items.div_ceil(minibatch.max(1))) as u64
}

/// The order of one epoch over `n` items: a permutation from a ChaCha20 stream named by
/// (`seed`, the optimiser's step count at the epoch's start), so a resumed run repeats it.
pub fn epoch_order(n: usize, seed: u64, step: u64) -> Vec<usize> {
    use rand::seq::SliceRandom;
    use rand::SeedableRng;
    let mut h = blake3::Hasher::new();
    h.update(b"onepass-minibatch-order");
    h.update(&seed.to_le_bytes());
    h.update(&step.to_le_bytes());
    let mut rng = rand_chacha::ChaCha20Rng::from_seed(*h.finalize().as_bytes());
    let mut order: Vec<usize> = (0..n).collect();
    order.shuffle(&mut rng);
    order
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
    Ok(score_tokens(m, seqs, kl, minibatch)?
        .into_iter()
        .map(|t| (t.logprobs.iter().sum(), t.kl.iter().sum(), t.logprobs.len()))
        .collect())
}

/// (Σ_t log π, tokens) per sequence under the adapted (`adapters`) or the reference model, one
/// forward pass per mini-batch, no gradients: the policy's log-probabilities when it is known to
/// equal its reference (adapters at their start, B = 0), where [`score`]'s second pass would
/// only repeat the first.
pub fn logprob_sums(
    m: &PolicyModel,
    seqs: &[Rollout<'_>],
    minibatch: usize,
    adapters: bool,
) -> Result<Vec<(f64, usize)>> {
    let mut out = Vec::with_capacity(seqs.len());
    for part in seqs.chunks(minibatch.max(1)) {
        let b = batch(m, part)?;
        let lp = m.logprobs_scored(&b, adapters)?;
        out.extend(b.seq_sums(&lp)?.into_iter().zip(b.lens.iter().copied()));
    }
    Ok(out)
}

/// [`score`] with the policy's per-token log π given (`policy[i]`: one value per response
/// token of `seqs[i]`, recorded by the sampler that drew it from this policy's weights): only
/// the reference's pass runs. The KL estimator is applied token by token as in [`score`].
pub fn score_recorded(
    m: &PolicyModel,
    seqs: &[Rollout<'_>],
    policy: &[&[f32]],
    kl: KlEstimator,
    minibatch: usize,
) -> Result<Vec<(f64, f64, usize)>> {
    if policy.len() != seqs.len() {
        candle_core::bail!("{} recorded log-probability rows for {} sequences", policy.len(), seqs.len());
    }
    if let Some(i) = (0..seqs.len()).find(|&i| policy[i].len() != seqs[i].response.len()) {
        candle_core::bail!(
            "sequence {i}: {} recorded log-probabilities for {} response tokens",
            policy[i].len(),
            seqs[i].response.len()
        );
    }
    let mut out = Vec::with_capacity(seqs.len());
    let mb = minibatch.max(1);
    for (part, lps) in seqs.chunks(mb).zip(policy.chunks(mb)) {
        let b = batch(m, part)?;
        let lr: Vec<f64> = m.logprobs_scored(&b, false)?.to_dtype(candle_core::DType::F64)?.to_vec1()?;
        let mut at = 0;
        for (&l, lp) in b.lens.iter().zip(lps) {
            let sum_lp = lp.iter().map(|&x| x as f64).sum();
            let sum_kl = lp.iter().zip(&lr[at..at + l]).map(|(&p, &r)| kl.per_token(p as f64, r)).sum();
            out.push((sum_lp, sum_kl, l));
            at += l;
        }
    }
    Ok(out)
}

/// One sequence's per-token log π and KL estimator against the reference.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenScores {
    pub logprobs: Vec<f64>,
    pub kl: Vec<f64>,
}

/// [`score`] token by token.
pub fn score_tokens(
    m: &PolicyModel,
    seqs: &[Rollout<'_>],
    kl: KlEstimator,
    minibatch: usize,
) -> Result<Vec<TokenScores>> {
    let at_ref = m.at_reference()?;
    let mut out = Vec::with_capacity(seqs.len());
    for part in seqs.chunks(minibatch.max(1)) {
        let b = batch(m, part)?;
        let lp: Vec<f64> = m.logprobs_scored(&b, true)?.to_dtype(candle_core::DType::F64)?.to_vec1()?;
        // at the reference (every B exactly 0) the adapted pass adds exact zeros: the
        // reference's log-probabilities are these, bit for bit, and the second pass is skipped
        let lr: Vec<f64> = if at_ref {
            lp.clone()
        } else {
            m.logprobs_scored(&b, false)?.to_dtype(candle_core::DType::F64)?.to_vec1()?
        };
        let mut at = 0;
        for &l in &b.lens {
            out.push(TokenScores {
                logprobs: lp[at..at + l].to_vec(),
                kl: (at..at + l).map(|i| kl.per_token(lp[i], lr[i])).collect(),
            });
            at += l;
        }
    }
    Ok(out)
}

/// TRL's `normalize_advantage` of RLOO: every advantage (per sequence, or per token) centred
/// on their mean and divided by their sample standard deviation (n − 1, torch's `std`) + 1e-8,
/// over the whole update. Fewer than 2 advantages: centred only.
pub fn whiten(adv: &mut [Vec<f64>]) {
    let n = adv.iter().map(Vec::len).sum::<usize>();
    if n == 0 {
        return;
    }
    let mean = adv.iter().flatten().sum::<f64>() / n as f64;
    let sd = if n < 2 {
        0.0
    } else {
        (adv.iter().flatten().map(|a| (a - mean).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt()
    };
    adv.iter_mut().flatten().for_each(|a| *a = (*a - mean) / (sd + 1e-8));
}

/// The global norm of the gradients of `vars` (0 for a variable without one).
fn grad_norm(vars: &[&candle_core::Var], grads: &candle_core::backprop::GradStore) -> Result<f64> {
    let mut sq = 0.0;
    for v in vars {
        if let Some(g) = grads.get(v.as_tensor()) {
            sq += g.sqr()?.sum_all()?.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
        }
    }
    Ok(sq.sqrt())
}

/// The per-token values `of(x[i])` of the sequences `idx`, one after another, as f32 (P,).
fn per_token<T>(idx: &[usize], x: &[T], of: impl Fn(&T) -> &Vec<f64>, dev: &candle_core::Device) -> Result<Tensor> {
    let v: Vec<f32> = idx.iter().flat_map(|&i| of(&x[i]).iter().map(|&a| a as f32)).collect();
    let n = v.len();
    Tensor::from_vec(v, n, dev)
}

/// Token weights of a token-level loss over the sequences `idx`: 1/(the sequence's length · b),
/// a mean per sequence, then over sequences (OpenRLHF's masked_mean over tokens, then the batch
/// mean).
fn token_weights(idx: &[usize], seqs: &[TokenScores], dev: &candle_core::Device) -> Result<Tensor> {
    let w: Vec<f32> = idx
        .iter()
        .flat_map(|&i| {
            let l = seqs[i].logprobs.len();
            std::iter::repeat_n(1.0 / (l * idx.len()) as f32, l)
        })
        .collect();
    let n = w.len();
    Tensor::from_vec(w, n, dev)
}

/// `part` in the shared-prompt layout (consecutive samples of a prompt share its pass).
fn batch(m: &PolicyModel, part: &[Rollout<'_>]) -> Result<SeqBatch> {
    let seqs: Vec<(&[u32], &[u32])> = part.iter().map(|r| (r.prompt, r.response)).collect();
    SeqBatch::shared(&seqs, m.device())
}

/// One epoch's order of `n` samples in groups of `k` consecutive ones: the groups in
/// [`epoch_order`]'s permutation, each group's samples in their own order.
pub fn group_order(n: usize, k: usize, seed: u64, step: u64) -> Vec<usize> {
    let k = k.max(1);
    epoch_order(n.div_ceil(k), seed, step).into_iter().flat_map(|g| g * k..((g + 1) * k).min(n)).collect()
}

/// RLOO on `rollouts` (k consecutive samples per prompt) with rewards `rewards` (one per
/// rollout; normalised by `cfg.reward_norm` before the KL penalty).
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
    if let Some(i) = rewards.iter().position(|r| !r.is_finite()) {
        candle_core::bail!("rloo: reward {i} is {}: expected a finite number", rewards[i]);
    }
    let before = score_tokens(m, rollouts, cfg.kl, cfg.minibatch)?;
    let seq_kl: Vec<f64> = before.iter().map(|t| t.kl.iter().sum()).collect();
    let seq_lp: Vec<f64> = before.iter().map(|t| t.logprobs.iter().sum()).collect();
    let r = cfg.reward_norm.apply(rewards);
    // per sequence: its advantage (Sequence: of r − β·KL; Token: of r, the KL added per token)
    let shaped: Vec<f64> = match cfg.kl_penalty {
        KlPenalty::Sequence => r.iter().zip(&seq_kl).map(|(r, kl)| r - cfg.kl_coef * kl).collect(),
        KlPenalty::Token => r.clone(),
    };
    let seq_adv = rloo_advantages(&shaped, k);
    // per token (Token) or one per sequence (Sequence)
    let mut adv: Vec<Vec<f64>> = match cfg.kl_penalty {
        KlPenalty::Sequence => seq_adv.iter().map(|&a| vec![a]).collect(),
        KlPenalty::Token => seq_adv
            .iter()
            .zip(&before)
            .map(|(&a, t)| {
                let mut tail = 0.0;
                let mut out = vec![0.0; t.kl.len()];
                for j in (0..t.kl.len()).rev() {
                    tail += t.kl[j];
                    out[j] = a - cfg.kl_coef * tail;
                }
                out
            })
            .collect(),
    };
    if cfg.normalize_advantages {
        whiten(&mut adv);
    }
    let mut st = before_stats(&before, rewards);
    let dev = m.device();
    let sched = Epochs { epochs: cfg.epochs, minibatch: cfg.minibatch, lr_window: cfg.lr_window, seed: cfg.seed };
    let groups = Groups { rollouts, k, adv: &adv };
    pg_epochs("rloo", m, opt, groups, sched, &mut st, |idx, b, lp| match cfg.kl_penalty {
        KlPenalty::Sequence => {
            let old: Vec<f32> = idx.iter().map(|&i| seq_lp[i] as f32).collect();
            let a: Vec<f32> = idx.iter().map(|&i| adv[i][0] as f32).collect();
            let old = Tensor::from_vec(old, idx.len(), dev)?;
            let a = Tensor::from_vec(a, idx.len(), dev)?;
            rloo_loss(&b.seq_sum(lp)?, &old, &a, cfg.clip)
        }
        KlPenalty::Token => {
            let old = per_token(idx, &before, |t| &t.logprobs, dev)?;
            let a = per_token(idx, &adv, |a| a, dev)?;
            token_pg_loss(lp, &old, &a, &token_weights(idx, &before, dev)?, cfg.clip)
        }
    })?;
    Ok(st)
}

/// The statistics of an update's rollouts before it: the mean sequence KL (the scoring's
/// estimator), the entropy estimate −mean log π over the tokens, the mean reward.
fn before_stats(before: &[TokenScores], rewards: &[f64]) -> UpdateStats {
    let tokens: usize = before.iter().map(|t| t.logprobs.len()).sum();
    UpdateStats {
        kl: before.iter().map(|t| t.kl.iter().sum::<f64>()).sum::<f64>() / before.len() as f64,
        entropy: -before.iter().map(|t| t.logprobs.iter().sum::<f64>()).sum::<f64>() / tokens as f64,
        reward: rewards.iter().sum::<f64>() / rewards.len() as f64,
        ..Default::default()
    }
}

/// How a policy-gradient update walks its rollouts: `epochs` passes in mini-batches of
/// `minibatch` sequences (whole prompt groups in a seeded order), the schedule's window.
#[derive(Clone, Copy, Debug)]
struct Epochs {
    epochs: usize,
    minibatch: usize,
    lr_window: LrWindow,
    seed: u64,
}

/// A mini-batch of [`minibatch_loop`]: its loss, whether its gradient may not be exactly 0 at
/// the update's first step, and its batch (handed to the loop's `after`).
struct MiniStep {
    loss: Tensor,
    must_move: bool,
    batch: SeqBatch,
}

/// The loop every policy update runs (rloo, grpo, reinforce++, dpo, ppo's actor), written once:
/// `e.epochs` passes over `items` items, each epoch in the order `order(run step)` (seeded by
/// the run's step count, so a fresh optimiser per chunk does not repeat the first chunk's
/// order), cut into mini-batches of `e.minibatch`; per mini-batch `step_of(indices, run step)`
/// gives the loss, one backward pass and one Adam step on `vars`, then `after(indices, batch)`
/// (ppo's critic step). The first step's gradient must not be exactly 0 where `must_move` (the
/// first step has ratio 1: nothing clipped, so a zero gradient means the graph does not reach
/// the adapters; later steps may be clipped to an exact 0 legitimately): `name` and `zero` make
/// the error. `st` gets the mean loss, the mean ‖g‖ before clipping and the steps.
#[allow(clippy::too_many_arguments)]
fn minibatch_loop(
    (name, zero): (&str, &str),
    vars: &[&candle_core::Var],
    opt: &mut Adam,
    e: Epochs,
    items: usize,
    order: impl Fn(u64) -> Vec<usize>,
    st: &mut UpdateStats,
    mut step_of: impl FnMut(&[usize], u64) -> Result<MiniStep>,
    mut after: impl FnMut(&[usize], SeqBatch) -> Result<()>,
) -> Result<()> {
    let mb = e.minibatch.max(1);
    opt.begin(e.lr_window, update_steps(items, mb, e.epochs));
    for _ in 0..e.epochs {
        let order = order(opt.run_steps());
        for idx in order.chunks(mb) {
            let s = step_of(idx, opt.run_steps())?;
            st.loss += s.loss.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
            let grads = s.loss.backward()?;
            if st.steps == 0 && s.must_move && grad_norm(vars, &grads)? == 0.0 {
                candle_core::bail!("{name}: {zero}: no gradient reaches the adapters");
            }
            st.grad_norm += opt.step(vars, &grads)?.grad_norm;
            st.steps += 1;
            after(idx, s.batch)?;
        }
    }
    if st.steps > 0 {
        st.loss /= st.steps as f64;
        st.grad_norm /= st.steps as f64;
    }
    Ok(())
}

/// The rollouts a policy-gradient update walks, in prompt groups, with their advantages.
#[derive(Clone, Copy)]
struct Groups<'r, 'a> {
    /// The rollouts, `k` consecutive ones per prompt.
    rollouts: &'r [Rollout<'a>],
    /// Rollouts per prompt group.
    k: usize,
    /// Each rollout's advantages (one per sequence or one per token).
    adv: &'r [Vec<f64>],
}

/// The epochs of a policy-gradient update (rloo, grpo, reinforce++) by [`minibatch_loop`]: the
/// prompt groups of `groups.k` rollouts in a seeded order ([`group_order`]), the gradient
/// pass's per-token log π (the adapters' dropout, if any, with this step's masks) and
/// `loss_of(indices, batch, log π)`; a mini-batch must move where its advantages
/// (`groups.adv`) are not all 0.
fn pg_epochs(
    name: &str,
    m: &PolicyModel,
    opt: &mut Adam,
    groups: Groups<'_, '_>,
    e: Epochs,
    st: &mut UpdateStats,
    mut loss_of: impl FnMut(&[usize], &SeqBatch, &Tensor) -> Result<Tensor>,
) -> Result<()> {
    let Groups { rollouts, k, adv } = groups;
    let zero = "the policy gradient is exactly 0 while the advantages are not";
    let order = |step| group_order(rollouts.len(), k, e.seed, step);
    let step_of = |idx: &[usize], step: u64| {
        let part: Vec<Rollout> = idx.iter().map(|&i| rollouts[i].clone()).collect();
        let batch = batch(m, &part)?;
        let lp = m.logprobs_train(&batch, step)?;
        let loss = loss_of(idx, &batch, &lp)?;
        Ok(MiniStep { loss, must_move: idx.iter().any(|&i| adv[i].iter().any(|&a| a != 0.0)), batch })
    };
    minibatch_loop((name, zero), &m.vars(), opt, e, rollouts.len(), order, st, step_of, |_, _| Ok(()))
}

/// Token weights of TRL's default GRPO aggregation (`loss_type = "dapo"`) and OpenRLHF's
/// `token_level_loss`: every token of the mini-batch `idx` weighs 1/(its tokens), so the loss is
/// the mini-batch's masked sum over its token count.
fn batch_token_weights(idx: &[usize], seqs: &[TokenScores], dev: &candle_core::Device) -> Result<Tensor> {
    let tokens: usize = idx.iter().map(|&i| seqs[i].logprobs.len()).sum();
    let w = vec![1.0 / tokens.max(1) as f32; tokens];
    Tensor::from_vec(w, tokens, dev)
}

/// Rollouts and rewards of a group-wise update: equal numbers, groups of `k` (at least
/// `min_k`), finite rewards.
fn check_rollouts(name: &str, rollouts: &[Rollout<'_>], rewards: &[f64], k: usize, min_k: usize) -> Result<()> {
    if rollouts.is_empty() || rollouts.len() != rewards.len() || k < min_k || !rollouts.len().is_multiple_of(k) {
        candle_core::bail!("{name}: {} rollouts, {} rewards, in groups of {k}", rollouts.len(), rewards.len());
    }
    if let Some(i) = rewards.iter().position(|r| !r.is_finite()) {
        candle_core::bail!("{name}: reward {i} is {}: expected a finite number", rewards[i]);
    }
    Ok(())
}

/// GRPO (Shao et al. 2024) as TRL's `GRPOTrainer` runs it by default: group-normalised
/// advantages ([`crate::loss::grpo_advantages`], `scale_rewards`), one per sequence and the same
/// at each of its tokens; the per-token ratio clipped to [1 − ε, 1 + ε] against the
/// log-probabilities before the update; β·k3 per token in the loss (not in the reward); the
/// token losses summed over the mini-batch's token count (`loss_type = "dapo"`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GrpoConfig {
    /// β of the k3 KL term in the loss (TRL's `beta`; 0: no KL term).
    pub kl_coef: f64,
    /// The estimator of the update's reported KL (its loss always uses k3).
    pub kl: KlEstimator,
    pub scale: crate::loss::GroupScale,
    pub clip: Option<f64>,
    pub epochs: usize,
    pub minibatch: usize,
    pub lr_window: LrWindow,
    /// Seed of the mini-batch shuffles (whole prompt groups, as RLOO's).
    pub seed: u64,
}

/// GRPO on `rollouts` (k ≥ 2 consecutive samples per prompt) with rewards `rewards`.
pub fn grpo_update(
    m: &PolicyModel,
    opt: &mut Adam,
    rollouts: &[Rollout<'_>],
    rewards: &[f64],
    k: usize,
    cfg: &GrpoConfig,
) -> Result<UpdateStats> {
    check_rollouts("grpo", rollouts, rewards, k, 2)?;
    // k1 recovers the reference's log-probabilities: log π_ref = log π − k1
    let before = score_tokens(m, rollouts, KlEstimator::K1, cfg.minibatch)?;
    let refs: Vec<Vec<f64>> =
        before.iter().map(|t| t.logprobs.iter().zip(&t.kl).map(|(lp, k1)| lp - k1).collect()).collect();
    let seq_adv = crate::loss::grpo_advantages(rewards, k, cfg.scale);
    let adv: Vec<Vec<f64>> = seq_adv.iter().zip(&before).map(|(&a, t)| vec![a; t.logprobs.len()]).collect();
    let reported: Vec<TokenScores> = before
        .iter()
        .zip(&refs)
        .map(|(t, r)| TokenScores {
            logprobs: t.logprobs.clone(),
            kl: t.logprobs.iter().zip(r).map(|(&lp, &lr)| cfg.kl.per_token(lp, lr)).collect(),
        })
        .collect();
    let mut st = before_stats(&reported, rewards);
    let dev = m.device();
    let sched = Epochs { epochs: cfg.epochs, minibatch: cfg.minibatch, lr_window: cfg.lr_window, seed: cfg.seed };
    let groups = Groups { rollouts, k, adv: &adv };
    pg_epochs("grpo", m, opt, groups, sched, &mut st, |idx, _, lp| {
        let old = per_token(idx, &before, |t| &t.logprobs, dev)?;
        let lr = per_token(idx, &refs, |r| r, dev)?;
        let a = per_token(idx, &adv, |a| a, dev)?;
        crate::loss::grpo_loss(lp, &old, &lr, &a, &batch_token_weights(idx, &before, dev)?, cfg.clip, cfg.kl_coef)
    })?;
    Ok(st)
}

/// REINFORCE++ (Hu 2025) as OpenRLHF runs `advantage_estimator = "reinforce"`: the sequence
/// reward (normalised by [`RewardNorm`], then clipped to ±`reward_clip`) at the last token and
/// −β·KL_t at every token (KL_t clamped to ±10, as OpenRLHF's `compute_approx_kl`), their
/// discounted returns as advantages normalised over every token of the update
/// ([`crate::loss::reinforce_pp_advantages`]); the per-token ratio clipped to [1 − ε, 1 + ε];
/// the token losses summed over the mini-batch's token count (`token_level_loss`). No critic.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReinforcePpConfig {
    pub kl_coef: f64,
    pub kl: KlEstimator,
    pub reward_norm: RewardNorm,
    pub reward_clip: f64,
    pub clip: Option<f64>,
    pub gamma: f64,
    /// Divide the centred advantages by their standard deviation (OpenRLHF's default; its
    /// `no_std_norm` turns it off).
    pub std_norm: bool,
    pub epochs: usize,
    pub minibatch: usize,
    pub lr_window: LrWindow,
    /// Seed of the mini-batch shuffles (whole prompt groups, as RLOO's).
    pub seed: u64,
}

/// REINFORCE++ on `rollouts` (k ≥ 1 consecutive samples per prompt) with rewards `rewards`.
pub fn reinforce_pp_update(
    m: &PolicyModel,
    opt: &mut Adam,
    rollouts: &[Rollout<'_>],
    rewards: &[f64],
    k: usize,
    cfg: &ReinforcePpConfig,
) -> Result<UpdateStats> {
    check_rollouts("reinforce-pp", rollouts, rewards, k, 1)?;
    let before = score_tokens(m, rollouts, cfg.kl, cfg.minibatch)?;
    let r: Vec<f64> =
        cfg.reward_norm.apply(rewards).iter().map(|x| x.clamp(-cfg.reward_clip, cfg.reward_clip)).collect();
    let kl: Vec<Vec<f64>> = before.iter().map(|t| t.kl.iter().map(|x| x.clamp(-10.0, 10.0)).collect()).collect();
    let adv = crate::loss::reinforce_pp_advantages(&r, &kl, cfg.kl_coef, cfg.gamma, cfg.std_norm);
    let mut st = before_stats(&before, rewards);
    let dev = m.device();
    let sched = Epochs { epochs: cfg.epochs, minibatch: cfg.minibatch, lr_window: cfg.lr_window, seed: cfg.seed };
    let groups = Groups { rollouts, k, adv: &adv };
    pg_epochs("reinforce-pp", m, opt, groups, sched, &mut st, |idx, _, lp| {
        let old = per_token(idx, &before, |t| &t.logprobs, dev)?;
        let a = per_token(idx, &adv, |a| a, dev)?;
        token_pg_loss(lp, &old, &a, &batch_token_weights(idx, &before, dev)?, cfg.clip)
    })?;
    Ok(st)
}
