//! `[deploy]`: chunks, strategies and the deployed policies.

use super::passive::{d_beta, d_delta};
use super::{Beta, Order, Sweep};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::fmt;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DeploySpec {
    /// Swept: every strategy is crossed with every estimator. random-pair, best-random,
    /// best-two, best-worst, best-quantile, ucb; with an ensemble estimator also thompson,
    /// double-thompson, ensemble-uncertainty and baits (they draw from its heads).
    #[serde(default = "d_strategies")]
    pub strategies: Sweep<String>,
    /// q of best-quantile.
    #[serde(default = "d_q")]
    pub q: f64,
    /// β of ucb.
    #[serde(default = "d_beta")]
    pub beta: Beta,
    /// δ of β = "theory".
    #[serde(default = "d_delta")]
    pub delta: f64,
    /// env.kind = "generated": the prompts are split into this many chunks, in order; the learned
    /// reward ranks a chunk's responses with θ fixed at the chunk's start, then the estimator
    /// updates on the chunk's labelled pairs (mini-batches of stream.batch_size).
    #[serde(default = "d_chunks")]
    pub chunks: usize,
    /// The order of the prompts: a permutation per seed ("shuffled") or the file's ("file").
    #[serde(default = "d_prompt_order")]
    pub prompt_order: Order,
    /// Swept: the deployed policy between chunks. "best-of-n": the best of the n samples under
    /// the learned reward (the policy itself fixed); "fixed": the policy's first sample;
    /// "rloo": the policy learns from the learned reward (RLOO on the chunk's n samples per
    /// prompt, `[policy]`); "dpo": online DPO on the chunk's labelled pairs (reward-free);
    /// "ppo": PPO with a critic on the chunk's n samples per prompt (`[policy.ppo]`); "grpo":
    /// GRPO with TRL's defaults (`[policy.grpo]`); "reinforce-pp": REINFORCE++ with OpenRLHF's
    /// defaults (`[policy.reinforce_pp]`).
    #[serde(default = "d_policy")]
    pub policy: Sweep<DeployPolicy>,
    /// Re-initialise the estimator at every chunk (the authors' pipeline did, by accident).
    #[serde(default)]
    pub reset_each_chunk: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum DeployPolicy {
    BestOfN,
    Fixed,
    Rloo,
    Dpo,
    Ppo,
    Grpo,
    ReinforcePp,
}

impl DeployPolicy {
    /// The policy's weights change between chunks (its responses are generated anew).
    pub fn learns(&self) -> bool {
        match self {
            DeployPolicy::Rloo
            | DeployPolicy::Dpo
            | DeployPolicy::Ppo
            | DeployPolicy::Grpo
            | DeployPolicy::ReinforcePp => true,
            DeployPolicy::BestOfN | DeployPolicy::Fixed => false,
        }
    }
}

impl fmt::Display for DeployPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DeployPolicy::BestOfN => "best-of-n",
            DeployPolicy::Fixed => "fixed",
            DeployPolicy::Rloo => "rloo",
            DeployPolicy::Dpo => "dpo",
            DeployPolicy::Ppo => "ppo",
            DeployPolicy::Grpo => "grpo",
            DeployPolicy::ReinforcePp => "reinforce-pp",
        })
    }
}

fn d_chunks() -> usize {
    10
}
fn d_prompt_order() -> Order {
    Order::Shuffled
}
fn d_policy() -> Sweep<DeployPolicy> {
    Sweep::one(DeployPolicy::BestOfN)
}

impl Default for DeploySpec {
    fn default() -> Self {
        toml::from_str("").expect("defaults")
    }
}

fn d_strategies() -> Sweep<String> {
    Sweep(["ucb", "best-quantile", "best-two", "best-worst", "random-pair"].map(String::from).to_vec())
}
pub(super) fn d_q() -> f64 {
    4.0
}
