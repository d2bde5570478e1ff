//! GRPO on the arm's rollouts (`policy::train::grpo_update`; TRL's `GRPOTrainer` defaults),
//! driven by the reward its source names (as rloo's): learned (φᵀθ_t), oracle (the ceiling) or
//! null (the floor). Each prompt's rollouts are its group.

use super::{mean, rewarded, Arm, Chunk, Update};
use crate::spec::RewardSource;
use anyhow::Result;
use policy::adam::Adam;
use policy::train::{grpo_update, GrpoConfig};
use policy::PolicyModel;

pub(super) struct Grpo {
    pub(super) reward: RewardSource,
    pub(super) update: GrpoConfig,
    /// The null reward's direction is drawn from this seed.
    pub(super) null_seed: u64,
}

impl Arm for Grpo {
    fn learns(&self) -> bool {
        true
    }

    fn deploy(&self, truth: &[f64], _: &[f64]) -> (usize, f64) {
        mean(truth)
    }

    fn update(&self, m: &PolicyModel, adam: &mut Adam, c: &Chunk<'_>) -> Result<Update> {
        let (rollouts, rewards, k) = rewarded(c, self.reward, self.null_seed)?;
        let stats = grpo_update(m, adam, &rollouts, &rewards, k, &self.update)?;
        Ok(Update { stats, pairs: 0, dropped: 0, critic: None })
    }
}
