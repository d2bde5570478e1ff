//! `[policy.dpo]`: the dpo arm's table: the pairs it learns from, what it trains, its warm
//! start on a preference dataset.

use super::shared::d_epochs;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The pairs the dpo arm learns from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum DpoPairs {
    /// The pair the deploy strategy picked among a prompt's n samples, with its label.
    Strategy,
    /// The authors' DPO arm: the first two of each prompt's rollouts (`[policy] rollouts`),
    /// chosen = the oracle's higher reward (their argmax labels); equal rewards or identical
    /// responses are dropped and counted.
    FreshTwo,
}

/// What the dpo arm trains.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum DpoParameters {
    /// LoRA adapters (`[policy]` rank, alpha, targets, dropout).
    Lora,
    /// Every weight of the policy (the authors' DPO arm): embeddings, norms, every linear
    /// layer's weight and bias, the LM head. Training holds the weights, their gradients and
    /// Adam's two moments besides the frozen reference: ~5 copies of the model in f32.
    Full,
}

/// `[policy.dpo.warm_start]`: DPO on the first `rows` pairs of a preference dataset before the
/// first chunk (the authors' DPO arm: 1,000 UltraFeedback train_prefs pairs), read as `[data]`
/// reads (`path`, `format`, `keys`). Prompts are templated by the policy; each response is
/// tokenised and cut to generate.max_new_tokens (an end-of-turn token closes the ones not cut).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WarmStart {
    /// The dataset's file (as `[data] path`).
    pub path: String,
    /// How its rows are read (as `[data] format`).
    #[serde(default = "d_format")]
    pub format: crate::spec::Format,
    /// Key names of the generic format (as `[data.keys]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keys: Option<crate::spec::data::Keys>,
    /// The first rows used (pairs).
    pub rows: usize,
    /// Passes over the pairs (mini-batches of `[policy] minibatch`).
    #[serde(default = "d_epochs")]
    pub epochs: usize,
}

fn d_format() -> crate::spec::Format {
    crate::spec::Format::Auto
}

/// `[policy.dpo]`: β of the DPO loss, the pairs it learns from, and a warm start.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DpoSpec {
    /// β of the DPO loss (TRL's default 0.1).
    #[serde(default = "d_dpo_beta")]
    pub beta: f64,
    /// The pairs the dpo arm learns from.
    #[serde(default = "d_dpo_pairs")]
    pub pairs: DpoPairs,
    /// What the dpo arm trains: LoRA adapters or every weight.
    #[serde(default = "d_dpo_parameters")]
    pub parameters: DpoParameters,
    /// `[policy.dpo.warm_start]`: DPO on a preference dataset before the first chunk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm_start: Option<WarmStart>,
}

impl Default for DpoSpec {
    fn default() -> Self {
        toml::from_str("").expect("defaults")
    }
}

fn d_dpo_parameters() -> DpoParameters {
    DpoParameters::Lora
}
fn d_dpo_pairs() -> DpoPairs {
    DpoPairs::Strategy
}
fn d_dpo_beta() -> f64 {
    0.1
}
