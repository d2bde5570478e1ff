//! RLOO on the chunk's n samples per prompt (`policy::train::rloo_update`), driven by the
//! reward its source names: learned (φᵀθ_t, the paper's method), oracle (the ceiling) or null
//! (the floor).

use super::{mean, rewarded, Arm, Chunk, Update};
use crate::spec::RewardSource;
use anyhow::Result;
use policy::adam::Adam;
use policy::train::{rloo_update, RlooConfig};
use policy::PolicyModel;

pub(super) struct Rloo {
    pub(super) reward: RewardSource,
    pub(super) update: RlooConfig,
    /// The null reward's direction is drawn from this seed.
    pub(super) null_seed: u64,
}

impl Arm for Rloo {
    fn learns(&self) -> bool {
        true
    }

    fn deploy(&self, truth: &[f64], _: &[f64]) -> (usize, f64) {
        mean(truth)
    }

    fn update(&self, m: &PolicyModel, adam: &mut Adam, c: &Chunk<'_>) -> Result<Update> {
        let (rollouts, rewards, k) = rewarded(c, self.reward, self.null_seed)?;
        let stats = rloo_update(m, adam, &rollouts, &rewards, k, &self.update)?;
        Ok(Update { stats, pairs: 0, dropped: 0, critic: None })
    }
}
