//! `[policy.reinforce_pp]`: the reinforce-pp arm's table.

use super::shared::{d_clip, d_one, d_ppo_kl, d_reward, d_reward_clip, d_true, RewardNormKind, RewardSource};
use crate::spec::Sweep;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// `[policy.reinforce_pp]`: REINFORCE++ as OpenRLHF runs `advantage_estimator = "reinforce"`
/// (OpenRLHF 0.11.0, revision 3c3be62): the reward (a sweep of sources) clipped to
/// ±`reward_clip` (OpenRLHF's `reward.clip_range`, ±10; not normalised, its
/// `normalize_enable` default) at the last token, −`kl_coef`·KL_t at every token (k1, clamped
/// to ±10; `init_coef` 0.01), discounted returns (`gamma` 1) as advantages, centred and divided
/// by their standard deviation over every token of the update; the per-token ratio clipped to
/// 1 ± `clip` (`eps_clip` 0.2); the token losses summed over the mini-batch's token count
/// (`token_level_loss`). No critic.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReinforcePpSpec {
    /// The reward that drives the update: "learned" (φᵀθ_t), or the controls "oracle" (the ceiling)
    /// and "null" (the floor). A list sweeps: one cell per source.
    #[serde(default = "d_reward")]
    pub reward: Sweep<RewardSource>,
    /// How the reward is scaled before it is clipped and the KL penalty added: "none"
    /// (OpenRLHF's default) or "chunk" ((r − mean)/sd over the update).
    #[serde(default = "d_reward_norm_none")]
    pub reward_norm: RewardNormKind,
    /// The reward is clipped to ±reward_clip (OpenRLHF's `reward.clip_range`).
    #[serde(default = "d_reward_clip")]
    pub reward_clip: f64,
    /// β of the per-token KL penalty in the reward (OpenRLHF's `kl.init_coef`).
    #[serde(default = "d_ppo_kl")]
    pub kl_coef: f64,
    /// The clip ε of the per-token probability ratio (OpenRLHF's `eps_clip`; 0: no clip).
    #[serde(default = "d_clip")]
    pub clip: f64,
    /// The discount γ of the returns (OpenRLHF's `advantage.gamma`).
    #[serde(default = "d_one")]
    pub gamma: f64,
    /// Divide the centred advantages by their standard deviation over the update's tokens
    /// (OpenRLHF's default; its `no_std_norm` turns it off).
    #[serde(default = "d_true")]
    pub normalize_advantages: bool,
    /// Rollouts per prompt, ≥ 1 (default generate.n).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollouts_per_prompt: Option<usize>,
}

impl Default for ReinforcePpSpec {
    fn default() -> Self {
        toml::from_str("").expect("defaults")
    }
}

fn d_reward_norm_none() -> RewardNormKind {
    RewardNormKind::None
}
