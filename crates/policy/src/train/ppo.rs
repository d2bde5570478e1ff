//! PPO with a critic ([`ppo_update`]): GAE against the critic's values, the actor's clipped
//! token-level ratio and the critic's clipped value loss, one Adam step each per mini-batch.

use super::{
    batch, group_order, minibatch_loop, per_token, score_tokens, token_weights, update_steps, Epochs, KlEstimator,
    MiniStep, RewardNorm, Rollout, TokenScores, UpdateStats,
};
use crate::adam::{Adam, LrWindow};
use crate::batch::SeqBatch;
use crate::loss::{token_pg_loss, value_loss};
use crate::model::PolicyModel;
use candle_core::Result;
use serde::{Deserialize, Serialize};

/// PPO with a critic (Schulman et al. 2017) as OpenRLHF's `PPOTrainer` runs it (the authors'
/// loop): per token the reward −β·KL_t, plus the sequence's reward — normalised by
/// [`RewardNorm`] — at its last token; GAE (γ, λ) against the critic's values before the
/// update; advantages normalised over the update's tokens (mean and sd) when asked; the actor's
/// token-level ratio clipped to [1 − ε, 1 + ε]; the critic's value loss clipped around its old
/// values (`value_clip`). Actor and critic each take one Adam step per mini-batch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PpoConfig {
    pub kl_coef: f64,
    pub kl: KlEstimator,
    pub reward_norm: RewardNorm,
    pub clip: Option<f64>,
    pub value_clip: Option<f64>,
    pub gamma: f64,
    pub lambda: f64,
    pub epochs: usize,
    pub minibatch: usize,
    pub normalize_advantages: bool,
    /// The steps the optimisers' learning-rate schedules span.
    pub lr_window: LrWindow,
    /// Seed of the mini-batch shuffles (whole groups of k samples of a prompt, as RLOO's).
    pub seed: u64,
}

/// What a PPO update saw: the actor's statistics, the critic's mean loss and ‖g‖, the mean
/// value and return over the update's tokens (before it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PpoStats {
    pub actor: UpdateStats,
    pub critic_loss: f64,
    pub critic_grad_norm: f64,
    pub value_mean: f64,
    pub return_mean: f64,
    /// Wall seconds in the critic (its values before the update, its forward and backward
    /// passes and Adam steps).
    pub critic_seconds: f64,
}

/// One PPO update on `rollouts` (k consecutive samples per prompt; k = 1 for one rollout per
/// prompt) with sequence rewards `rewards`; the actor and the critic each come with its own
/// optimiser.
pub fn ppo_update(
    (actor, actor_opt): (&PolicyModel, &mut Adam),
    (critic, critic_opt): (&crate::critic::Critic, &mut Adam),
    rollouts: &[Rollout<'_>],
    rewards: &[f64],
    k: usize,
    cfg: &PpoConfig,
) -> Result<PpoStats> {
    if rollouts.is_empty() || rollouts.len() != rewards.len() || k == 0 || !rollouts.len().is_multiple_of(k) {
        candle_core::bail!("ppo: {} rollouts, {} rewards, in groups of {k}", rollouts.len(), rewards.len());
    }
    if let Some(i) = rewards.iter().position(|r| !r.is_finite()) {
        candle_core::bail!("ppo: reward {i} is {}: expected a finite number", rewards[i]);
    }
    let mb = cfg.minibatch.max(1);
    let before = score_tokens(actor, rollouts, cfg.kl, mb)?;
    let t0 = std::time::Instant::now();
    let old_v = old_values(critic, rollouts, mb)?;
    let mut critic_seconds = t0.elapsed().as_secs_f64();
    let tokens: usize = before.iter().map(|t| t.logprobs.len()).sum();
    let (adv, ret) = gae_targets(&cfg.reward_norm.apply(rewards), &before, &old_v, cfg, tokens);
    let mut st = stats_before(&before, rewards, &old_v, &ret, tokens);
    let cvars = critic.vars();
    let dev = actor.device();
    critic_opt.begin(cfg.lr_window, update_steps(rollouts.len(), mb, cfg.epochs));
    let e = Epochs { epochs: cfg.epochs, minibatch: cfg.minibatch, lr_window: cfg.lr_window, seed: cfg.seed };
    let zero = "the policy gradient is exactly 0 while the advantages are not";
    let order = |step| group_order(rollouts.len(), k, cfg.seed, step);
    let step_of = |idx: &[usize], step: u64| {
        let part: Vec<Rollout> = idx.iter().map(|&i| rollouts[i].clone()).collect();
        let batch = batch(actor, &part)?;
        let w = token_weights(idx, &before, dev)?;
        let old = per_token(idx, &before, |t| &t.logprobs, dev)?;
        let lp = actor.logprobs_train(&batch, step)?;
        let loss = token_pg_loss(&lp, &old, &per_token(idx, &adv, |a| a, dev)?, &w, cfg.clip)?;
        Ok(MiniStep { loss, must_move: idx.iter().any(|&i| adv[i].iter().any(|&a| a != 0.0)), batch })
    };
    // the critic's step on the actor's mini-batch, after the actor's
    let (mut critic_loss, mut critic_grad_norm) = (0.0, 0.0);
    let critic_step = |idx: &[usize], b: SeqBatch| {
        let t1 = std::time::Instant::now();
        let w = token_weights(idx, &before, dev)?;
        let v = critic.values(&b, crate::lora::Pass::ADAPTED)?;
        let (vo, r) = (per_token(idx, &old_v, |v| v, dev)?, per_token(idx, &ret, |r| r, dev)?);
        let closs = value_loss(&v, &vo, &r, &w, cfg.value_clip)?;
        critic_loss += closs.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
        critic_grad_norm += critic_opt.step(&cvars, &closs.backward()?)?.grad_norm;
        critic_seconds += t1.elapsed().as_secs_f64();
        Ok(())
    };
    let avars = actor.vars();
    minibatch_loop(("ppo", zero), &avars, actor_opt, e, rollouts.len(), order, &mut st.actor, step_of, critic_step)?;
    (st.critic_loss, st.critic_grad_norm) = (critic_loss, critic_grad_norm);
    // minibatch_loop took the actor's means; the critic steps once per actor step
    let s = st.actor.steps.max(1) as f64;
    st.critic_loss /= s;
    st.critic_grad_norm /= s;
    st.critic_seconds = critic_seconds;
    Ok(st)
}

/// The critic's values before the update, per token of each rollout, in mini-batches of `mb`.
fn old_values(critic: &crate::critic::Critic, rollouts: &[Rollout<'_>], mb: usize) -> Result<Vec<Vec<f64>>> {
    let mut old_v: Vec<Vec<f64>> = Vec::with_capacity(rollouts.len());
    for part in rollouts.chunks(mb) {
        let b = batch(&critic.model, part)?;
        let v: Vec<f64> =
            critic.values(&b, crate::lora::Pass::ADAPTED)?.to_dtype(candle_core::DType::F64)?.to_vec1()?;
        let mut at = 0;
        for &l in &b.lens {
            old_v.push(v[at..at + l].to_vec());
            at += l;
        }
    }
    Ok(old_v)
}

/// GAE(γ, λ) per rollout ([`crate::loss::gae`]) of the token rewards −β·KL_t plus the
/// normalised sequence reward `r` at the last token, against the critic's values `old_v`:
/// (advantages, returns); the advantages normalised over the update's `tokens` (mean and sd)
/// when `cfg.normalize_advantages`.
fn gae_targets(
    r: &[f64],
    before: &[TokenScores],
    old_v: &[Vec<f64>],
    cfg: &PpoConfig,
    tokens: usize,
) -> (Vec<Vec<f64>>, Vec<Vec<f64>>) {
    let (mut adv, mut ret) = (Vec::with_capacity(r.len()), Vec::with_capacity(r.len()));
    for ((ri, t), v) in r.iter().zip(before).zip(old_v) {
        let (a, g) = crate::loss::gae(&crate::loss::token_rewards(*ri, &t.kl, cfg.kl_coef), v, cfg.gamma, cfg.lambda);
        adv.push(a);
        ret.push(g);
    }
    if cfg.normalize_advantages {
        let mean = adv.iter().flatten().sum::<f64>() / tokens as f64;
        let sd = (adv.iter().flatten().map(|a| (a - mean).powi(2)).sum::<f64>() / tokens as f64).sqrt();
        adv.iter_mut().flatten().for_each(|a| *a = (*a - mean) / (sd + 1e-8));
    }
    (adv, ret)
}

/// The update's statistics before it: the mean sequence KL, the entropy estimate −mean log π
/// and the mean reward (the actor's), the mean value and return over the `tokens`.
fn stats_before(
    before: &[TokenScores],
    rewards: &[f64],
    old_v: &[Vec<f64>],
    ret: &[Vec<f64>],
    tokens: usize,
) -> PpoStats {
    let seq_kl: Vec<f64> = before.iter().map(|t| t.kl.iter().sum()).collect();
    PpoStats {
        actor: UpdateStats {
            kl: seq_kl.iter().sum::<f64>() / seq_kl.len() as f64,
            entropy: -before.iter().flat_map(|t| &t.logprobs).sum::<f64>() / tokens as f64,
            reward: rewards.iter().sum::<f64>() / rewards.len() as f64,
            ..Default::default()
        },
        value_mean: old_v.iter().flatten().sum::<f64>() / tokens as f64,
        return_mean: ret.iter().flatten().sum::<f64>() / tokens as f64,
        ..Default::default()
    }
}
