//! `[policy.grpo]`: the grpo arm's table.

use super::shared::{d_clip, d_reward, RewardSource};
use crate::spec::Sweep;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// `[policy.grpo]`: GRPO as TRL's `GRPOTrainer` runs it by default (TRL 1.10.0.dev0, revision
/// f2cd577): the reward (a sweep of sources, as rloo's) centred on its prompt group's mean and
/// divided by the group's sample standard deviation + 1e-4 (`scale_rewards = "group"`), the
/// same advantage at every token of a response, the per-token ratio clipped to 1 ± `clip`
/// (`epsilon` 0.2), β·k3 per token in the loss (`beta`, TRL's default 0: no KL term), the token
/// losses summed over the mini-batch's token count (`loss_type = "dapo"`). The `[policy]` keys
/// `epochs` (TRL's `num_iterations`, 1) and `minibatch` apply.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GrpoSpec {
    /// The reward that drives the update: "learned" (φᵀθ_t), or the controls "oracle" (the ceiling)
    /// and "null" (the floor). A list sweeps: one cell per source.
    #[serde(default = "d_reward")]
    pub reward: Sweep<RewardSource>,
    /// β of the per-token k3 KL to the reference in the loss (TRL's `beta`, default 0: no KL
    /// term).
    #[serde(default)]
    pub kl_coef: f64,
    /// The clip ε of the per-token probability ratio (TRL's `epsilon`; 0: no clip).
    #[serde(default = "d_clip")]
    pub clip: f64,
    /// What the group-centred rewards are divided by (TRL's `scale_rewards`): "group" (the
    /// group's sample sd + 1e-4, TRL's default), "batch" (the update's) or "none" (Dr. GRPO).
    #[serde(default = "d_group_scale")]
    pub scale_rewards: policy::loss::GroupScale,
    /// Rollouts per prompt, ≥ 2 (TRL's `num_generations`; default generate.n).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollouts_per_prompt: Option<usize>,
}

impl Default for GrpoSpec {
    fn default() -> Self {
        toml::from_str("").expect("defaults")
    }
}

fn d_group_scale() -> policy::loss::GroupScale {
    policy::loss::GroupScale::Group
}
