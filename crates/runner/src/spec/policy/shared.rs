//! What the `[policy]` table and its arms' tables share: the reward source a policy-gradient arm
//! reads, how its reward is normalised, and the defaults several tables take.

use crate::spec::Sweep;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// What reward drives a learning arm's policy update (rloo): the paper's learned reward, or one
/// of the two controls a policy-level claim needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum RewardSource {
    /// φᵀθ_t, the reward model learned in one pass (the paper's method).
    Learned,
    /// The oracle's own reward of each sample: the ceiling — can this update improve this
    /// policy at this budget at all?
    Oracle,
    /// φᵀθ̃ with θ̃ a random direction (drawn per seed) of ‖θ_t‖: a reward with no information
    /// about the oracle — the floor: what the update's drift alone does.
    Null,
}

impl std::fmt::Display for RewardSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RewardSource::Learned => "learned",
            RewardSource::Oracle => "oracle",
            RewardSource::Null => "null",
        })
    }
}

/// How rloo scales its reward before the KL penalty.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum RewardNormKind {
    /// (r − mean)/sd over the chunk's rewards, clipped to ±reward_clip (OpenRLHF's convention).
    Chunk,
    /// The raw reward: its scale (‖θ‖) sets the KL penalty's weight.
    None,
}

impl RewardNormKind {
    /// The update's normalisation, clipped to ±`clip` when per chunk.
    pub(super) fn resolve(self, clip: f64) -> policy::train::RewardNorm {
        match self {
            RewardNormKind::Chunk => policy::train::RewardNorm::Chunk { clip },
            RewardNormKind::None => policy::train::RewardNorm::None,
        }
    }
}

pub(super) fn d_lr() -> f64 {
    1e-4
}
pub(super) fn d_one() -> f64 {
    1.0
}
pub(super) fn d_epochs() -> usize {
    1
}
pub(super) fn d_reward() -> Sweep<RewardSource> {
    Sweep::one(RewardSource::Learned)
}
pub(super) fn d_reward_norm() -> RewardNormKind {
    RewardNormKind::Chunk
}
pub(super) fn d_reward_clip() -> f64 {
    10.0
}
pub(super) fn d_clip() -> f64 {
    0.2
}
pub(super) fn d_ppo_kl() -> f64 {
    0.01
}
pub(super) fn d_true() -> bool {
    true
}
