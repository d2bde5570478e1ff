//! `[active]`: how the active learner picks the pairs to label.

use super::deploy::d_q;
use super::passive::{d_beta, d_delta};
use super::{Beta, Sweep};
use schemars::JsonSchema;
use serde::{de, Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// How the active learner picks the pairs to label. One vocabulary with the deployment
/// strategies: besides the pool rules, every `selection::Strategy` name (random-pair,
/// best-random, best-two, best-worst, best-quantile, ucb, and with an ensemble thompson,
/// double-thompson, ensemble-uncertainty, baits) is a rule that draws a fresh context (prompt)
/// per label and picks two of its arms (responses) by the current θ or heads.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ActiveRule {
    /// argmax over the pool of ‖φ(x,a) − φ(x,a′)‖_{𝓗⁻¹} (paper Eq. (4)).
    PoolArgmax,
    /// The authors' stream: score `candidates` random pool pairs, keep the top `keep`.
    Stream,
    /// Uniformly random pool pairs.
    Random,
    /// A fresh context per label, two of its arms by a deployment strategy; e.g. `best-worst`,
    /// the paper's practical rule (§5 "Computation of model uncertainty"). No pool; needs an
    /// environment with arms (synthetic or generated). `best-quantile` takes `active.q`, `ucb`
    /// takes `active.beta`.
    Fresh(selection::Strategy),
}

impl ActiveRule {
    /// The pool rules (the others pick among a fresh context's arms).
    pub fn uses_pool(&self) -> bool {
        !matches!(self, ActiveRule::Fresh(_))
    }
}

impl std::str::FromStr for ActiveRule {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "pool-argmax" => Ok(ActiveRule::PoolArgmax),
            "stream" => Ok(ActiveRule::Stream),
            "random" => Ok(ActiveRule::Random),
            other => other.parse().map(ActiveRule::Fresh).map_err(|_| {
                format!(
                    "unknown rule `{other}`: expected pool-argmax, stream, random, or a strategy ({})",
                    selection::Strategy::NAMES.join(", ")
                )
            }),
        }
    }
}

/// The key reference lists the rules: the pool rules, then every deployment strategy.
impl JsonSchema for ActiveRule {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "ActiveRule".into()
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        let mut words = vec![
            serde_json::json!({ "const": "pool-argmax", "description": "argmax over the pool of ‖φ(x,a) − φ(x,a′)‖_{𝓗⁻¹} (paper Eq. (4))." }),
            serde_json::json!({ "const": "stream", "description": "The authors' stream: score `candidates` random pool pairs, keep the top `keep`." }),
            serde_json::json!({ "const": "random", "description": "Uniformly random pool pairs." }),
        ];
        for s in selection::Strategy::NAMES {
            words.push(serde_json::json!({ "const": s, "description": format!("A fresh context per label, two of its arms by the deployment strategy `{s}`.") }));
        }
        schemars::json_schema!({ "type": "string", "oneOf": words })
    }
}

impl Serialize for ActiveRule {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for ActiveRule {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(de::Error::custom)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum ScoreNorm {
    /// V_t = V₀I + Σzzᵀ with all candidates added before scoring (the authors' uncertainty_score).
    V,
    /// The cell's 𝓗_t.
    H,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ActiveSpec {
    /// One rule, or a list: every estimator runs under each (Rand-MLE, Active-MLE, Rand-OMD and
    /// Ours in one run, on the same features and seeds).
    #[serde(default = "d_rule")]
    pub rule: Sweep<ActiveRule>,
    /// Pool size: pairs (x, a, a′) drawn once per seed, each with its label drawn once.
    #[serde(default = "d_pool")]
    pub pool: usize,
    /// Whether a pool pair can be queried again (it keeps its label). Off by default: a
    /// re-queried pair only duplicates its fixed label, and the 𝓗⁻¹-norm argmax then keeps
    /// choosing the pairs whose σ' is small.
    #[serde(default)]
    pub replacement: bool,
    /// rule = "stream": the random pool pairs scored per draw.
    #[serde(default = "d_candidates")]
    pub candidates: usize,
    /// rule = "stream": the best-scored candidates kept (labelled) per draw.
    #[serde(default = "d_keep")]
    pub keep: usize,
    /// rule = "stream": the norm that scores candidates ("v": the authors' V-norm, "h": the cell's
    /// 𝓗_t).
    #[serde(default = "d_score_norm")]
    pub score_norm: ScoreNorm,
    /// V₀ of the V-norm.
    #[serde(default = "d_v0")]
    pub v0: f64,
    /// q of the best-quantile rule.
    #[serde(default = "d_q")]
    pub q: f64,
    /// β of the ucb rule (a number or "theory", with `delta`).
    #[serde(default = "d_beta")]
    pub beta: Beta,
    /// δ of β = "theory".
    #[serde(default = "d_delta")]
    pub delta: f64,
}

impl Default for ActiveSpec {
    fn default() -> Self {
        toml::from_str("").expect("defaults")
    }
}

fn d_rule() -> Sweep<ActiveRule> {
    Sweep::one(ActiveRule::PoolArgmax)
}

impl fmt::Display for ActiveRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ActiveRule::PoolArgmax => "pool-argmax",
            ActiveRule::Stream => "stream",
            ActiveRule::Random => "random",
            ActiveRule::Fresh(s) => s.name(),
        })
    }
}
fn d_pool() -> usize {
    5000
}
fn d_candidates() -> usize {
    8
}
fn d_keep() -> usize {
    2
}
fn d_score_norm() -> ScoreNorm {
    ScoreNorm::V
}
fn d_v0() -> f64 {
    1e-5
}
