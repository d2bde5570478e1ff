//! `[policy.ppo]`: the ppo arm's table and where its critic's value head starts.

use super::shared::{
    d_clip, d_lr, d_one, d_ppo_kl, d_reward, d_reward_clip, d_reward_norm, d_true, RewardNormKind, RewardSource,
};
use crate::spec::Sweep;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Where a PPO critic's value head starts each chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum CriticHead {
    /// v = θ_t: the critic starts as the learned reward model (OpenRLHF initialises the critic
    /// from the reward model); needs features.model = generate.policy (the critic runs on the
    /// policy's backbone, φ on the feature model's).
    Theta,
    /// v = 0.
    Zero,
}

/// `[policy.ppo]`: PPO with a critic (OpenRLHF's, the authors' loop). The reward source (a
/// sweep, as rloo's) normalised per chunk and clipped; per token the reward −`kl_coef`·KL_t
/// plus the sequence's reward at its last token; GAE (`gamma`, `lambda`); the ratio clipped to
/// 1 ± `clip`, the value loss clipped to ± `value_clip` around the old values (0: no clip);
/// the critic's learning rate and value head's start; advantages divided by their sd.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PpoSpec {
    /// The reward that drives the update: "learned" (φᵀθ_t), or the controls "oracle" (the ceiling)
    /// and "null" (the floor). A list sweeps: one cell per source.
    #[serde(default = "d_reward")]
    pub reward: Sweep<RewardSource>,
    /// How the sequence reward is scaled before the KL penalty.
    #[serde(default = "d_reward_norm")]
    pub reward_norm: RewardNormKind,
    /// reward_norm = "chunk": the normalised reward is clipped to ±reward_clip.
    #[serde(default = "d_reward_clip")]
    pub reward_clip: f64,
    /// β of the per-token KL penalty in the reward.
    #[serde(default = "d_ppo_kl")]
    pub kl_coef: f64,
    /// The clip ε of the probability ratio.
    #[serde(default = "d_clip")]
    pub clip: f64,
    /// The value loss is clipped to ± value_clip around the old values (0: no clip).
    #[serde(default = "d_clip")]
    pub value_clip: f64,
    /// γ of GAE.
    #[serde(default = "d_one")]
    pub gamma: f64,
    /// λ of GAE.
    #[serde(default = "d_lambda")]
    pub lambda: f64,
    /// The critic's Adam learning rate.
    #[serde(default = "d_lr")]
    pub critic_lr: f64,
    /// Where the critic's value head starts each chunk. Absent: per reward source — "theta"
    /// for reward = "learned", "zero" for the controls "oracle" and "null" (a control's critic
    /// must carry no learned signal); "theta" written with a control source is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub critic_head: Option<CriticHead>,
    /// Divide the advantages by their standard deviation.
    #[serde(default = "d_true")]
    pub normalize_advantages: bool,
    /// Rollouts per prompt (default generate.n; the authors' PPO: 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollouts_per_prompt: Option<usize>,
}

impl PpoSpec {
    /// The critic's head for the reward source `reward`: `critic_head` when written, else θ for
    /// the learned reward and 0 for the controls (which must carry no learned signal).
    pub fn critic_head_for(&self, reward: RewardSource) -> CriticHead {
        self.critic_head.unwrap_or(match reward {
            RewardSource::Learned => CriticHead::Theta,
            RewardSource::Oracle | RewardSource::Null => CriticHead::Zero,
        })
    }
}

impl Default for PpoSpec {
    fn default() -> Self {
        toml::from_str("").expect("defaults")
    }
}

fn d_lambda() -> f64 {
    0.95
}
