//! Experiment specs: serde structs that mirror the TOML (unknown keys are errors, defaults are
//! declared on the types), `--set key=value` overrides, and the errors that name the file, the
//! key path and the line. `plan.rs` turns a parsed spec into validated cells. One file per table
//! (`[env]` in `env.rs`, …); the words a number may be given as in `words.rs`, reading a file and
//! `--set` in `file.rs`.
//!
//! This is the bottom layer of the runner above `io`: every TOML table type lives here and
//! nothing here imports from the stages above (plan, world, settings, …).

pub mod active;
pub mod checkpoint;
pub mod curvature;
pub mod data;
pub mod deploy;
pub mod env;
pub mod estimator;
mod file;
pub mod generate;
pub mod passive;
pub mod phi;
pub mod policy;
pub mod reward;
pub mod stream;
pub mod track;
mod words;

pub use data::{DataSpec, Format, Keys};
pub use generate::{FeatureSpec, GenBackend, GenerateSpec, LabelRule, OracleKind, OracleSpec};
pub use phi::{DType, Device, PhiSpec};
pub use policy::{AdapterLife, CriticHead, KlReference, LrRestart, PolicySpec, RewardSource, SaveAdapter};
pub use reward::{RewardSpec, RewardUpdate};

pub use active::{ActiveRule, ActiveSpec, ScoreNorm};
pub use checkpoint::CheckpointSpec;
pub use curvature::{CurvaturePoint, CurvatureSource, CurvatureSpec};
pub use deploy::{DeployPolicy, DeploySpec};
pub use env::{EnvKind, EnvSpec, FeatureDist, Order};
pub use file::{
    apply_overrides, is_written, key_at, line_of, load, locate, override_at, override_key, parse, shorten_numbers,
    user_words, SpecError,
};
pub use passive::{PassiveSpec, Pessimism, PessimismReference};
pub use stream::StreamSpec;
pub use track::TrackSpec;
pub use words::{Beta, DataScale, OrAuto, OrNone, Sweep};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Setting {
    Passive,
    Active,
    Deploy,
}

impl Setting {
    pub fn as_str(&self) -> &'static str {
        match self {
            Setting::Passive => "passive",
            Setting::Active => "active",
            Setting::Deploy => "deploy",
        }
    }
}

/// The whole spec file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Spec {
    /// Which setting runs: "passive" (a stream of labelled pairs), "active" (the learner picks the
    /// pairs to label) or "deploy" (the policy deploys, the learner picks two responses, an oracle
    /// labels them).
    pub setting: Setting,
    /// Run name (default: the file stem).
    #[serde(default)]
    pub name: Option<String>,
    /// What the preset is and how to read it: printed at the top of `onepass report`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Every random stream derives from (master_seed, seed index, component).
    #[serde(default = "d_master_seed")]
    pub master_seed: u64,
    /// Seed indices 0..seeds.
    #[serde(default = "d_seeds")]
    pub seeds: u32,
    /// Worker threads for the cells (0: one per core).
    #[serde(default)]
    pub threads: usize,
    /// `[env]`: where the pairs come from (the synthetic bandit, a features file, a dataset, or
    /// generated responses).
    #[serde(default)]
    pub env: EnvSpec,
    /// `[stream]`: the labelled stream: its length, batch size and evaluation points.
    #[serde(default)]
    pub stream: StreamSpec,
    /// `[curvature]`: the 𝓗_t behind uncertainty (pessimism, UCB, active selection) and the tracker
    /// every cell keeps.
    #[serde(default)]
    pub curvature: CurvatureSpec,
    /// `[passive]`: the pessimistic policy of the passive setting (setting = "passive" only).
    #[serde(default)]
    pub passive: PassiveSpec,
    /// `[active]`: how the active learner picks the pairs to label (setting = "active" only).
    #[serde(default)]
    pub active: ActiveSpec,
    /// `[deploy]`: chunks, selection strategies and the deployed policies (setting = "deploy"
    /// only).
    #[serde(default)]
    pub deploy: DeploySpec,
    /// When cells save their state for `onepass run --resume` (not part of a run's identity).
    #[serde(default)]
    pub checkpoint: CheckpointSpec,
    /// What the run logs while it runs (TensorBoard event files; not part of a run's identity).
    #[serde(default)]
    pub track: TrackSpec,
    /// The raw `[[estimator]]` tables: swept keys are expanded and each combination read by
    /// [`estimator::read`] in the plan.
    #[serde(rename = "estimator", default)]
    #[schemars(skip)] // the estimators reference documents them from EstimatorSpec
    pub estimators: Vec<toml::Table>,
    /// env.kind = "dataset": the preference data and the feature model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<DataSpec>,
    /// env.kind = "generated": prompts, policy and sampling.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generate: Option<GenerateSpec>,
    /// env.kind = "generated": the learner's feature model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub features: Option<FeatureSpec>,
    /// env.kind = "generated": the oracle that scores and labels responses.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oracle: Option<OracleSpec>,
    /// deploy.policy with "rloo" or "dpo": how the policy learns between chunks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<PolicySpec>,
    /// What of the reward model learns (absent: θ on frozen φ, "head").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reward: Option<RewardSpec>,
    /// Filled by the world from the data (not a key): the scale λ = "auto" resolves from.
    #[serde(skip)]
    pub data_scale: Option<DataScale>,
}

fn d_master_seed() -> u64 {
    20251
}
fn d_seeds() -> u32 {
    1
}
