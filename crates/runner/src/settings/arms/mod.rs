//! The deployed policies of a deployment run on generated responses, one room each: best-of-n
//! and the fixed policy (the controls), rloo and dpo (policies that learn between chunks). Each
//! is one implementation of [`Arm`]: what it deploys among a prompt's samples and, for a
//! learning arm, its policy update on a chunk. What all arms share — sampling from the current
//! weights, the held-out evaluation, adapters and Adam's state for checkpoints — is
//! `super::online::PolicyCell`'s. Adding an arm: a `DeployPolicy` variant, an `ArmPlan` variant
//! with its resolved config (and its `[policy.<arm>]` table), a file here, and the exhaustive
//! matches the compiler then lists ([`build`], `ArmPlan::of`, `DeployPolicy::learns`).

mod best_of_n;
mod dpo;
mod fixed;
mod grpo;
mod ppo;
mod reinforce_pp;
mod rloo;

use crate::plan::ArmPlan;
use crate::spec::RewardSource;
use crate::world::env::{dot, seed_of, Component, Context};
use anyhow::Result;
use features::generate::Sample;
use policy::adam::{Adam, LrWindow};
use policy::train::{Rollout, UpdateStats};
use policy::PolicyModel;

/// A labelled pair of a chunk: the prompt's index in the chunk, the two samples, y (1: the
/// first preferred), and whether the oracle's rewards tie under argmax labels (a coin flip,
/// not a preference).
pub(in crate::settings) struct Labelled {
    pub(in crate::settings) at: usize,
    pub(in crate::settings) first: usize,
    pub(in crate::settings) second: usize,
    pub(in crate::settings) label: f32,
    pub(in crate::settings) tie: bool,
}

/// What a chunk's update reports beside the optimiser's statistics.
pub(in crate::settings) struct Update {
    pub(in crate::settings) stats: UpdateStats,
    /// dpo: the pairs it learned from and those dropped (no preference).
    pub(in crate::settings) pairs: u64,
    pub(in crate::settings) dropped: u64,
    /// ppo: the critic's statistics.
    pub(in crate::settings) critic: Option<CriticStats>,
}

/// A learning arm's rollouts on a chunk (`plan::RolloutPlan`): for the prompts that have them,
/// their index in the chunk, the samples and their contexts (φ and the oracle's rewards).
#[derive(Default)]
pub(in crate::settings) struct Rollouts {
    pub(in crate::settings) at: Vec<usize>,
    pub(in crate::settings) samples: Vec<Vec<Sample>>,
    pub(in crate::settings) contexts: Vec<Context>,
}

/// What a PPO update's critic saw: its mean loss and ‖g‖, the mean value and return over the
/// update's tokens (before it), and its wall seconds.
#[derive(Clone, Copy, Debug, Default)]
pub(in crate::settings) struct CriticStats {
    pub(in crate::settings) loss: f64,
    pub(in crate::settings) grad_norm: f64,
    pub(in crate::settings) value_mean: f64,
    pub(in crate::settings) return_mean: f64,
    pub(in crate::settings) seconds: f64,
}

/// A chunk as a learning arm's update sees it, after θ's update on the chunk.
pub(in crate::settings) struct Chunk<'a> {
    /// The chunk's index (1-based).
    pub(in crate::settings) index: u64,
    /// The templated prompt ids of the chunk's prompts, in chunk order.
    pub(in crate::settings) prompts: Vec<&'a [u32]>,
    /// Each prompt's n samples (the strategy's pairs index them).
    pub(in crate::settings) samples: &'a [Vec<Sample>],
    pub(in crate::settings) pairs: &'a [Labelled],
    /// The arm's rollouts (empty for dpo on the strategy's pairs).
    pub(in crate::settings) rollouts: &'a Rollouts,
    /// θ_t after its update on the chunk, and d.
    pub(in crate::settings) theta: &'a [f64],
    pub(in crate::settings) d: usize,
}

/// One deployed policy.
pub(in crate::settings) trait Arm: Send + Sync {
    /// Its weights change between chunks: the cell then owns adapters and their Adam state.
    fn learns(&self) -> bool;

    /// What the arm deploys among one prompt's samples, as the oracle reward of its choice:
    /// `truth` the oracle's rewards, `est` the learned ones (φᵀθ_t); and the index it picks
    /// (0 for an arm that deploys its samples as drawn).
    fn deploy(&self, truth: &[f64], est: &[f64]) -> (usize, f64);

    /// Whether the arm deploys every sample it draws (its [`Arm::deploy`] is their mean), as
    /// every arm but a reranking one does.
    fn deploys_all(&self) -> bool {
        true
    }

    /// The policy step on a chunk (called for learning arms only).
    fn update(&self, m: &PolicyModel, adam: &mut Adam, chunk: &Chunk<'_>) -> Result<Update>;
}

/// The arm of a cell's plan; `master` and `seed` name the cell's streams (mini-batch order, the
/// null reward's direction, a critic's adapters); `window` is its learning-rate schedule's
/// window; `online` the frozen models (a critic's backbone).
pub(in crate::settings) fn build(
    plan: &ArmPlan,
    master: u64,
    seed: u32,
    window: LrWindow,
    online: &crate::world::online::Online,
) -> Box<dyn Arm> {
    let policy_seed = seed_of(master, seed, Component::Policy);
    match plan {
        ArmPlan::BestOfN => Box::new(best_of_n::BestOfN),
        ArmPlan::Fixed => Box::new(fixed::Fixed),
        ArmPlan::Rloo { reward, update, .. } => Box::new(rloo::Rloo {
            reward: *reward,
            update: policy::train::RlooConfig { seed: policy_seed, lr_window: window, ..update.clone() },
            null_seed: seed_of(master, seed, Component::NullReward),
        }),
        ArmPlan::Dpo { update, pairs, .. } => Box::new(dpo::Dpo {
            update: policy::train::DpoConfig { seed: policy_seed, lr_window: window, ..update.clone() },
            pairs: *pairs,
        }),
        ArmPlan::Ppo { reward, update, critic, .. } => Box::new(ppo::Ppo {
            reward: *reward,
            update: policy::train::PpoConfig { seed: policy_seed, lr_window: window, ..update.clone() },
            null_seed: seed_of(master, seed, Component::NullReward),
            critic: critic.clone(),
            critic_seed: seed_of(master, seed, Component::Critic),
            backbone: ppo::Backbone::of(online),
        }),
        ArmPlan::Grpo { reward, update, .. } => Box::new(grpo::Grpo {
            reward: *reward,
            update: policy::train::GrpoConfig { seed: policy_seed, lr_window: window, ..update.clone() },
            null_seed: seed_of(master, seed, Component::NullReward),
        }),
        ArmPlan::ReinforcePp { reward, update, .. } => Box::new(reinforce_pp::ReinforcePp {
            reward: *reward,
            update: policy::train::ReinforcePpConfig { seed: policy_seed, lr_window: window, ..update.clone() },
            null_seed: seed_of(master, seed, Component::NullReward),
        }),
    }
}

/// Best-of-n: the sample θ_t ranks first (ties to the lowest index) and its oracle reward.
pub(in crate::settings) fn best_of_n(truth: &[f64], est: &[f64]) -> (usize, f64) {
    let a = crate::world::env::argmax(est.iter().copied());
    (a, truth[a])
}

/// The mean of a prompt's samples' oracle rewards: what an arm that deploys its samples gets.
fn mean(truth: &[f64]) -> (usize, f64) {
    (0, truth.iter().sum::<f64>() / truth.len() as f64)
}

/// θ̃ of the null reward: a unit direction from `seed`'s stream (the same every chunk), scaled to
/// ‖θ‖ (with the reward normalised per chunk the scale does not matter; without, it matches the
/// learned reward's).
fn null_theta(seed: u64, theta: &[f64]) -> Vec<f64> {
    use rand::SeedableRng;
    use rand_distr::{Distribution, StandardNormal};
    let mut rng = rand_chacha::ChaCha20Rng::seed_from_u64(seed);
    let u: Vec<f64> = theta.iter().map(|_| StandardNormal.sample(&mut rng)).collect();
    let nu = u.iter().map(|x| x * x).sum::<f64>().sqrt();
    let nt = theta.iter().map(|x| x * x).sum::<f64>().sqrt();
    u.iter().map(|x| x / nu * nt).collect()
}

/// The chunk's rollouts (k consecutive per prompt) with the reward its source names: φᵀθ_t
/// (learned), the oracle's, or φᵀθ̃ (null, θ̃ from `null_seed`); and k.
fn rewarded<'a>(c: &Chunk<'a>, source: RewardSource, null_seed: u64) -> Result<(Vec<Rollout<'a>>, Vec<f64>, usize)> {
    let null = if source == RewardSource::Null { null_theta(null_seed, c.theta) } else { Vec::new() };
    let r = c.rollouts;
    let k = r.samples.first().map_or(0, Vec::len);
    if k == 0 || r.samples.iter().any(|ss| ss.len() != k) {
        anyhow::bail!("a chunk's rollouts: expected the same number ≥ 1 per prompt");
    }
    let (mut rollouts, mut rewards) = (Vec::new(), Vec::new());
    for ((&at, ss), ctx) in r.at.iter().zip(&r.samples).zip(&r.contexts) {
        let p = c.prompts[at];
        for (j, s) in ss.iter().enumerate() {
            rollouts.push(Rollout { prompt: p, response: &s.ids });
            let phi = &ctx.phi[j * c.d..(j + 1) * c.d];
            rewards.push(match source {
                RewardSource::Learned => dot(phi, c.theta),
                RewardSource::Null => dot(phi, &null),
                RewardSource::Oracle => ctx
                    .reward
                    .as_ref()
                    .and_then(|r| r.get(j).copied())
                    .ok_or_else(|| anyhow::anyhow!("no oracle reward to learn from"))?,
            });
        }
    }
    Ok((rollouts, rewards, k))
}

/// An arm that does not learn was asked to.
fn does_not_learn(name: &str) -> anyhow::Error {
    anyhow::anyhow!("{name} does not learn: no policy update")
}
