//! `[env]`: where the pairs come from.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum FeatureDist {
    /// g ~ N(0, I/d), clipped to ‖g‖ ≤ 1, times L.
    Gaussian,
    /// Uniform on the sphere of radius L.
    Sphere,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum EnvKind {
    /// The synthetic contextual dueling bandit of the theory.
    Synthetic,
    /// "Bring your own features": labelled pairs from a parquet file (`path`).
    Features,
    /// A preference dataset and a feature model (`[data]`): φ computed through the feature cache.
    Dataset,
    /// Responses sampled from a policy (`[generate]`), their φ (`[features]`) and an oracle's
    /// rewards (`[oracle]`): contexts are prompts, arms are samples.
    Generated,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Order {
    /// A permutation of the training rows drawn from the seed's data stream.
    Shuffled,
    /// The file's order (the authors' "first N rows"); every seed sees the same stream.
    File,
    /// The training rows in the order listed by `order_path` (e.g. a permutation exported from
    /// PyTorch's `randperm`, which Rust cannot reproduce); every seed sees the same stream.
    Indices,
}

/// Where the pairs come from: the synthetic contextual dueling bandit (the theory's setting),
/// or a parquet file of features.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EnvSpec {
    /// Where the pairs come from.
    #[serde(default = "d_env_kind")]
    pub kind: EnvKind,
    /// d (features: read from the file; an explicit value must agree with it).
    #[serde(default = "d_dim")]
    pub dim: usize,
    /// features: parquet with list<float32> columns phi_chosen, phi_rejected and optional label.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// features: held-out pairs in the same layout (default: the last `eval_pairs` rows of `path`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_path: Option<PathBuf>,
    /// features: the order in which training rows are streamed.
    #[serde(default = "d_order")]
    pub order: Order,
    /// order = "indices": 0-based training-row indices, a .npy (integer, 1-D) or a text file
    /// (whitespace-separated); distinct, each below the number of training pairs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub order_path: Option<PathBuf>,
    /// N contexts, drawn uniformly each round (ρ).
    #[serde(default = "d_contexts")]
    pub contexts: usize,
    /// Draw a fresh context every round instead (N is then the size of the evaluation set).
    #[serde(default)]
    pub fresh_contexts: bool,
    /// K arms per context.
    #[serde(default = "d_arms")]
    pub arms: usize,
    /// kind = "synthetic": how the arms' features are drawn.
    #[serde(default = "d_features")]
    pub features: FeatureDist,
    /// L: ‖φ‖ ≤ L.
    #[serde(default = "d_one")]
    pub feature_norm: f64,
    /// B: θ* uniform on the sphere of radius B.
    #[serde(default = "d_theta_norm")]
    pub theta_norm: f64,
    /// Held-out labelled pairs for eval_loss / eval_accuracy.
    #[serde(default = "d_eval_pairs")]
    pub eval_pairs: usize,
}

impl Default for EnvSpec {
    fn default() -> Self {
        toml::from_str("").expect("all EnvSpec fields have defaults")
    }
}

fn d_env_kind() -> EnvKind {
    EnvKind::Synthetic
}
fn d_order() -> Order {
    Order::Shuffled
}
fn d_dim() -> usize {
    16
}
fn d_contexts() -> usize {
    100
}
fn d_arms() -> usize {
    8
}
fn d_features() -> FeatureDist {
    FeatureDist::Gaussian
}
fn d_one() -> f64 {
    1.0
}
fn d_theta_norm() -> f64 {
    3.0
}
fn d_eval_pairs() -> usize {
    2000
}
