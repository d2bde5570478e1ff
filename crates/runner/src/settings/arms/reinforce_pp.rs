//! REINFORCE++ on the arm's rollouts (`policy::train::reinforce_pp_update`; OpenRLHF's
//! `advantage_estimator = "reinforce"` defaults), driven by the reward its source names (as
//! rloo's). No critic and no group baseline: the advantages are normalised over the update.

use super::{mean, rewarded, Arm, Chunk, Update};
use crate::spec::RewardSource;
use anyhow::Result;
use policy::adam::Adam;
use policy::train::{reinforce_pp_update, ReinforcePpConfig};
use policy::PolicyModel;

pub(super) struct ReinforcePp {
    pub(super) reward: RewardSource,
    pub(super) update: ReinforcePpConfig,
    /// The null reward's direction is drawn from this seed.
    pub(super) null_seed: u64,
}

impl Arm for ReinforcePp {
    fn learns(&self) -> bool {
        true
    }

    fn deploy(&self, truth: &[f64], _: &[f64]) -> (usize, f64) {
        mean(truth)
    }

    fn update(&self, m: &PolicyModel, adam: &mut Adam, c: &Chunk<'_>) -> Result<Update> {
        let (rollouts, rewards, k) = rewarded(c, self.reward, self.null_seed)?;
        let stats = reinforce_pp_update(m, adam, &rollouts, &rewards, k, &self.update)?;
        Ok(Update { stats, pairs: 0, dropped: 0, critic: None })
    }
}
