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
mod rloo;

use crate::plan::ArmPlan;
use crate::world::env::{seed_of, Component, Context};
use anyhow::Result;
use features::generate::Sample;
use policy::adam::Adam;
use policy::train::UpdateStats;
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
}

/// A chunk as a learning arm's update sees it, after θ's update on the chunk.
pub(in crate::settings) struct Chunk<'a> {
    /// The templated prompt ids of the chunk's prompts, in chunk order.
    pub(in crate::settings) prompts: Vec<&'a [u32]>,
    /// Each prompt's n samples and their contexts (φ and the oracle's rewards).
    pub(in crate::settings) samples: &'a [Vec<Sample>],
    pub(in crate::settings) contexts: &'a [Context],
    pub(in crate::settings) pairs: &'a [Labelled],
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

    /// The policy step on a chunk (called for learning arms only).
    fn update(&self, m: &PolicyModel, adam: &mut Adam, chunk: &Chunk<'_>) -> Result<Update>;
}

/// The arm of a cell's plan; `master` and `seed` name the cell's streams (mini-batch order, the
/// null reward's direction).
pub(in crate::settings) fn build(plan: &ArmPlan, master: u64, seed: u32) -> Box<dyn Arm> {
    let policy_seed = seed_of(master, seed, Component::Policy);
    match plan {
        ArmPlan::BestOfN => Box::new(best_of_n::BestOfN),
        ArmPlan::Fixed => Box::new(fixed::Fixed),
        ArmPlan::Rloo { reward, update } => Box::new(rloo::Rloo {
            reward: *reward,
            update: policy::train::RlooConfig { seed: policy_seed, ..update.clone() },
            null_seed: seed_of(master, seed, Component::NullReward),
        }),
        ArmPlan::Dpo { update } => {
            Box::new(dpo::Dpo { update: policy::train::DpoConfig { seed: policy_seed, ..update.clone() } })
        }
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

/// An arm that does not learn was asked to.
fn does_not_learn(name: &str) -> anyhow::Error {
    anyhow::anyhow!("{name} does not learn: no policy update")
}
