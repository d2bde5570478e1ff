//! `[policy.rloo]`: the rloo arm's table.

use super::shared::{d_clip, d_reward, d_reward_clip, d_reward_norm, d_true, RewardNormKind, RewardSource};
use crate::spec::Sweep;
use policy::train::KlPenalty;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// `[policy.rloo]`: which reward drives the update (a sweep: one cell per source), how it is
/// normalised before the KL penalty (`reward_norm`, `reward_clip`), β of the KL penalty and
/// where it enters (`kl_penalty`: per sequence as TRL's RLOO, or per token as OpenRLHF), the PPO
/// clip ε of the ratio (0: none), advantages centred and divided by their sd.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RlooSpec {
    /// The reward that drives the update: "learned" (φᵀθ_t), or the controls "oracle" (the ceiling)
    /// and "null" (the floor). A list sweeps: one cell per source.
    #[serde(default = "d_reward")]
    pub reward: Sweep<RewardSource>,
    /// How the reward is scaled before the KL penalty.
    #[serde(default = "d_reward_norm")]
    pub reward_norm: RewardNormKind,
    /// reward_norm = "chunk": the normalised reward is clipped to ±reward_clip.
    #[serde(default = "d_reward_clip")]
    pub reward_clip: f64,
    /// β of the KL penalty.
    #[serde(default = "d_kl_coef")]
    pub kl_coef: f64,
    /// Where the KL penalty enters: per sequence (TRL's RLOO) or per token (OpenRLHF).
    #[serde(default = "d_kl_penalty")]
    pub kl_penalty: KlPenalty,
    /// The PPO clip ε of the probability ratio (0: no clip).
    #[serde(default = "d_clip")]
    pub clip: f64,
    /// Centre the leave-one-out advantages on their mean over the chunk and divide them by
    /// their sample standard deviation (TRL's `normalize_advantage`).
    #[serde(default = "d_true")]
    pub normalize_advantages: bool,
    /// Rollouts per prompt, ≥ 2 (the leave-one-out baseline; default generate.n).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollouts_per_prompt: Option<usize>,
}

impl Default for RlooSpec {
    fn default() -> Self {
        toml::from_str("").expect("defaults")
    }
}

fn d_kl_coef() -> f64 {
    0.05
}
fn d_kl_penalty() -> KlPenalty {
    KlPenalty::Sequence
}
