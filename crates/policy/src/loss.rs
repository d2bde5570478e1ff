//! The losses of a policy update, on per-token log-probabilities of sampled responses.
//!
//! Conventions (TRL's RLOO trainer, the reference we follow): the KL penalty subtracted from the
//! reward is β_KL·Σ_t KL_t with the per-token estimator of `train::KlEstimator` (k1 = log π −
//! log π_ref by default; k3 inside a reward is refused by the runner, its gradient being
//! biased); the baseline of a sample is the mean r̃ of the other k − 1 samples of its prompt
//! (leave-one-out); the policy-gradient loss is sequence-level, −A·ρ with ρ = exp(Σ_t log π −
//! Σ_t log π_old), PPO-clipped to [1 − ε, 1 + ε] when ε is given (ρ = 1 with gradient ∇ log π
//! on the first pass over freshly sampled responses). GRPO carries β·k3 per token as a term of
//! its loss (`train::GrpoConfig`), never in the reward.

use candle_core::{Result, Tensor};

/// Per-token k3 = e^{d} − d − 1 with d = log π_ref − log π, on tensors (GRPO's KL term in its
/// loss; `train::KlEstimator::per_token` is the same estimate on one token's numbers).
pub fn kl_k3(lp: &Tensor, lp_ref: &Tensor) -> Result<Tensor> {
    let d = (lp_ref - lp)?;
    (d.exp()? - &d)? - 1.0
}

/// Leave-one-out advantages of `rewards` in groups of `k` consecutive samples (one prompt
/// each): A_i = r_i − (Σ_{j≠i} r_j)/(k − 1). Needs k ≥ 2 and a length divisible by k.
pub fn rloo_advantages(rewards: &[f64], k: usize) -> Vec<f64> {
    assert!(k >= 2 && rewards.len().is_multiple_of(k), "rloo_advantages: {} rewards in groups of {k}", rewards.len());
    rewards
        .chunks_exact(k)
        .flat_map(|g| {
            let s: f64 = g.iter().sum();
            g.iter().map(move |r| r - (s - r) / (k - 1) as f64)
        })
        .collect()
}

/// RLOO's loss: mean over samples of max(−A·ρ, −A·clip(ρ, 1 − ε, 1 + ε)) with
/// ρ = exp(seq_lp − seq_lp_old) (no clipping when `clip` is None). `seq_lp` (b,) carries the
/// gradient; `seq_lp_old` and `adv` are constants.
pub fn rloo_loss(seq_lp: &Tensor, seq_lp_old: &Tensor, adv: &Tensor, clip: Option<f64>) -> Result<Tensor> {
    clipped_pg(seq_lp, seq_lp_old, adv, clip)?.mean_all()
}

/// The token-level PPO loss: Σ_t w_t·max(−A_t ρ_t, −A_t clip(ρ_t, 1 − ε, 1 + ε)) with
/// ρ_t = exp(log π_t − log π_old,t); `w` the tokens' weights (1/(len · b): a mean per sequence,
/// then over sequences). `lp` (P,) carries the gradient.
pub fn token_pg_loss(lp: &Tensor, old: &Tensor, adv: &Tensor, w: &Tensor, clip: Option<f64>) -> Result<Tensor> {
    (clipped_pg(lp, old, adv, clip)? * w.detach())?.sum_all()
}

/// GRPO's loss (TRL's `GRPOTrainer`): per token max(−A ρ_t, −A clip(ρ_t, 1 − ε, 1 + ε)) + β·k3_t
/// with k3_t = e^{log π_ref − log π} − (log π_ref − log π) − 1 (no KL term at β = 0, as TRL),
/// summed with the tokens' weights `w` (TRL's default `loss_type = "dapo"`: 1/(the mini-batch's
/// tokens) each). `lp` (P,) carries the gradient; `old`, `lp_ref`, `adv` and `w` are constants.
pub fn grpo_loss(
    lp: &Tensor,
    old: &Tensor,
    lp_ref: &Tensor,
    adv: &Tensor,
    w: &Tensor,
    clip: Option<f64>,
    beta: f64,
) -> Result<Tensor> {
    let pg = clipped_pg(lp, old, adv, clip)?;
    let per = if beta != 0.0 { (pg + (kl_k3(lp, &lp_ref.detach())? * beta)?)? } else { pg };
    (per * w.detach())?.sum_all()
}

/// How GRPO scales its group-centred rewards (TRL's `scale_rewards`).
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GroupScale {
    /// Divided by the group's sample standard deviation + 1e-4 (TRL's default).
    Group,
    /// Divided by the sample standard deviation of every reward of the update + 1e-4.
    Batch,
    /// Centred only (Dr. GRPO).
    None,
}

/// GRPO's advantages (TRL's `GRPOTrainer`): in groups of `k` consecutive samples (one prompt
/// each), A_i = r_i − mean of the group, divided by (sd + 1e-4) with sd the sample standard
/// deviation (n − 1) of the group or of the whole update (`scale`). Needs k ≥ 2.
pub fn grpo_advantages(rewards: &[f64], k: usize, scale: GroupScale) -> Vec<f64> {
    assert!(k >= 2 && rewards.len().is_multiple_of(k), "grpo_advantages: {} rewards in groups of {k}", rewards.len());
    let sample_sd = |x: &[f64]| {
        let m = x.iter().sum::<f64>() / x.len() as f64;
        (x.iter().map(|v| (v - m).powi(2)).sum::<f64>() / (x.len() - 1) as f64).sqrt()
    };
    let batch_sd = sample_sd(rewards);
    rewards
        .chunks_exact(k)
        .flat_map(|g| {
            let mean = g.iter().sum::<f64>() / k as f64;
            let sd = match scale {
                GroupScale::Group => Some(sample_sd(g)),
                GroupScale::Batch => Some(batch_sd),
                GroupScale::None => None,
            };
            g.iter().map(move |r| sd.map_or(r - mean, |sd| (r - mean) / (sd + 1e-4)))
        })
        .collect()
}

/// REINFORCE++'s advantages (OpenRLHF's `advantage_estimator = "reinforce"`): per response, the
/// token rewards −β·KL_t plus the sequence's reward `r` at its last token ([`token_rewards`]),
/// their discounted returns G_t = Σ_{s≥t} γ^{s−t} r_s; then over every token of the update
/// centred on their mean and, with `std_norm`, multiplied by 1/√max(var, 1e-8) (population
/// variance over the tokens).
pub fn reinforce_pp_advantages(r: &[f64], kl: &[Vec<f64>], beta: f64, gamma: f64, std_norm: bool) -> Vec<Vec<f64>> {
    assert_eq!(r.len(), kl.len(), "reinforce_pp_advantages: one KL row per reward");
    let mut adv: Vec<Vec<f64>> = r
        .iter()
        .zip(kl)
        .map(|(&ri, k)| {
            let rew = token_rewards(ri, k, beta);
            let mut g = vec![0.0; rew.len()];
            let mut acc = 0.0;
            for t in (0..rew.len()).rev() {
                acc = rew[t] + gamma * acc;
                g[t] = acc;
            }
            g
        })
        .collect();
    let n = adv.iter().map(Vec::len).sum::<usize>();
    if n == 0 {
        return adv;
    }
    let mean = adv.iter().flatten().sum::<f64>() / n as f64;
    let rstd = if std_norm {
        let var = adv.iter().flatten().map(|a| (a - mean).powi(2)).sum::<f64>() / n as f64;
        1.0 / var.max(1e-8).sqrt()
    } else {
        1.0
    };
    adv.iter_mut().flatten().for_each(|a| *a = (*a - mean) * rstd);
    adv
}

/// PPO's clipped surrogate per element: max(−A·ρ, −A·clip(ρ, 1 − ε, 1 + ε)), ρ = exp(lp − old);
/// `old` and `adv` are constants.
fn clipped_pg(lp: &Tensor, old: &Tensor, adv: &Tensor, clip: Option<f64>) -> Result<Tensor> {
    let ratio = (lp - old.detach())?.exp()?;
    let adv = adv.detach();
    let pg = (ratio.neg()? * &adv)?;
    match clip {
        Some(eps) => pg.maximum(&(ratio.clamp(1.0 - eps, 1.0 + eps)?.neg()? * &adv)?),
        None => Ok(pg),
    }
}

/// DPO (Rafailov et al. 2023): mean of −log σ(β[(log π(y_w) − log π_ref(y_w)) −
/// (log π(y_l) − log π_ref(y_l))]) over pairs; every argument (n,) sequence log-probabilities.
pub fn dpo_loss(pi_w: &Tensor, pi_l: &Tensor, ref_w: &Tensor, ref_l: &Tensor, beta: f64) -> Result<Tensor> {
    let m = ((pi_w - ref_w.detach())? - (pi_l - ref_l.detach())?)?;
    // −log σ(z) = softplus(−z) = log(1 + e^{−z}), computed stably as max(−z, 0) + log(1 + e^{−|z|})
    let z = (m * beta)?;
    let relu = z.neg()?.relu()?;
    let tail = (z.abs()?.neg()?.exp()? + 1.0)?.log()?;
    (relu + tail)?.mean_all()
}

/// Generalised advantage estimation (Schulman et al. 2016) over one response, as OpenRLHF's
/// `get_advantages_and_returns`: δ_t = r_t + γ V_{t+1} − V_t with V_T = 0 after the last token,
/// A_t = δ_t + γλ A_{t+1}, returns R_t = A_t + V_t. `rewards` and `values` per token, equal
/// lengths. Returns (advantages, returns).
pub fn gae(rewards: &[f64], values: &[f64], gamma: f64, lambda: f64) -> (Vec<f64>, Vec<f64>) {
    assert_eq!(rewards.len(), values.len(), "gae: one value per reward");
    let n = rewards.len();
    let mut adv = vec![0.0; n];
    let mut last = 0.0;
    for t in (0..n).rev() {
        let next = if t + 1 < n { values[t + 1] } else { 0.0 };
        let delta = rewards[t] + gamma * next - values[t];
        last = delta + gamma * lambda * last;
        adv[t] = last;
    }
    let ret = adv.iter().zip(values).map(|(a, v)| a + v).collect();
    (adv, ret)
}

/// OpenRLHF's per-token reward of a response: −β·KL_t at every token, plus the sequence's
/// (normalised, clipped) reward `r` at the last one.
pub fn token_rewards(r: f64, kl: &[f64], beta: f64) -> Vec<f64> {
    let mut out: Vec<f64> = kl.iter().map(|k| -beta * k).collect();
    if let Some(last) = out.last_mut() {
        *last += r;
    }
    out
}

/// PPO's clipped value loss (OpenRLHF's `ValueLoss`): Σ_t w_t·½·max((V_t − R_t)²,
/// (V_old,t + clip(V_t − V_old,t, −ε, ε) − R_t)²); without `clip`, Σ_t w_t·½(V_t − R_t)².
/// `values` (P,) carries the gradient; `old`, `returns` and the weights `w` are constants.
pub fn value_loss(values: &Tensor, old: &Tensor, returns: &Tensor, w: &Tensor, clip: Option<f64>) -> Result<Tensor> {
    let (old, returns) = (old.detach(), returns.detach());
    let plain = (values - &returns)?.sqr()?;
    let l = match clip {
        Some(eps) => {
            let clipped = (&old + (values - &old)?.clamp(-eps, eps)?)?;
            plain.maximum(&(clipped - &returns)?.sqr()?)?
        }
        None => plain,
    };
    ((l * 0.5)? * w.detach())?.sum_all()
}
