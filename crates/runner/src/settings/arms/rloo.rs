//! RLOO on the chunk's n samples per prompt (`policy::train::rloo_update`), driven by the
//! reward its source names: learned (φᵀθ_t, the paper's method), oracle (the ceiling) or null
//! (the floor).

use super::{mean, Arm, Chunk, Update};
use crate::spec::RewardSource;
use crate::world::env::{dot, Context};
use anyhow::{anyhow, Result};
use policy::adam::Adam;
use policy::train::{rloo_update, RlooConfig, Rollout};
use policy::PolicyModel;

pub(super) struct Rloo {
    pub(super) reward: RewardSource,
    pub(super) update: RlooConfig,
    /// The null reward's direction is drawn from this seed.
    pub(super) null_seed: u64,
}

impl Rloo {
    /// θ̃ of the null reward: a unit direction from the seed's stream (the same every chunk),
    /// scaled to ‖θ‖ (with the reward normalised per chunk the scale does not matter; without,
    /// it matches the learned reward's).
    fn null_theta(&self, theta: &[f64]) -> Vec<f64> {
        use rand::SeedableRng;
        use rand_distr::{Distribution, StandardNormal};
        let mut rng = rand_chacha::ChaCha20Rng::seed_from_u64(self.null_seed);
        let u: Vec<f64> = theta.iter().map(|_| StandardNormal.sample(&mut rng)).collect();
        let nu = u.iter().map(|x| x * x).sum::<f64>().sqrt();
        let nt = theta.iter().map(|x| x * x).sum::<f64>().sqrt();
        u.iter().map(|x| x / nu * nt).collect()
    }

    /// The reward of sample j of a context: φᵀθ (learned), the oracle's, or φᵀθ̃ (null).
    fn reward_of(&self, c: &Context, j: usize, theta: &[f64], null: &[f64], d: usize) -> Result<f64> {
        let phi = &c.phi[j * d..(j + 1) * d];
        Ok(match self.reward {
            RewardSource::Learned => dot(phi, theta),
            RewardSource::Null => dot(phi, null),
            RewardSource::Oracle => c
                .reward
                .as_ref()
                .and_then(|r| r.get(j).copied())
                .ok_or_else(|| anyhow!("no oracle reward to learn from"))?,
        })
    }
}

impl Arm for Rloo {
    fn learns(&self) -> bool {
        true
    }

    fn deploy(&self, truth: &[f64], _: &[f64]) -> (usize, f64) {
        mean(truth)
    }

    fn update(&self, m: &PolicyModel, adam: &mut Adam, c: &Chunk<'_>) -> Result<Update> {
        let null = if self.reward == RewardSource::Null { self.null_theta(c.theta) } else { Vec::new() };
        let k = c.samples.first().map_or(0, Vec::len);
        let mut rollouts = Vec::new();
        let mut rewards = Vec::new();
        for ((p, ss), ctx) in c.prompts.iter().zip(c.samples).zip(c.contexts) {
            for (j, s) in ss.iter().enumerate() {
                rollouts.push(Rollout { prompt: p, response: &s.ids });
                rewards.push(self.reward_of(ctx, j, c.theta, &null, c.d)?);
            }
        }
        let stats = rloo_update(m, adam, &rollouts, &rewards, k, &self.update)?;
        Ok(Update { stats, pairs: 0, dropped: 0 })
    }
}
