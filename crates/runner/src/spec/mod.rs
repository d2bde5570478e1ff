//! Experiment specs: serde structs that mirror the TOML (unknown keys are errors, defaults are
//! declared on the types), `--set key=value` overrides, and the errors that name the file, the
//! key path and the line. `plan.rs` turns a parsed spec into validated cells.
//!
//! This is the bottom layer of the runner above `io`: every TOML table type lives here and
//! nothing here imports from the stages above (plan, world, settings, …).

pub mod data;
pub mod estimator;
pub mod generate;
pub mod phi;
pub mod policy;
pub mod reward;

pub use data::{DataSpec, Format, Keys};
pub use generate::{FeatureSpec, GenerateSpec, LabelRule, OracleKind, OracleSpec};
pub use phi::{DType, Device, PhiSpec};
pub use policy::{AdapterLife, CriticHead, KlReference, LrRestart, PolicySpec, RewardSource, SaveAdapter};
pub use reward::{RewardSpec, RewardUpdate};

use serde::{de, Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::path::{Path, PathBuf};

/// A bad spec: where, and what was expected. Exit code 2.
#[derive(Debug, Clone, PartialEq)]
pub struct SpecError {
    pub file: PathBuf,
    /// Dotted key path, e.g. `estimator[1].lr` (empty when the error is about the whole file).
    pub key: String,
    pub line: Option<usize>,
    pub message: String,
    /// The `--set key=value` argument the error is about, when it came from one (it is then
    /// cited instead of a line of the file).
    pub set: Option<String>,
}

impl fmt::Display for SpecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.set, self.line) {
            (Some(s), _) => write!(f, "--set {s} (over {})", self.file.display())?,
            (None, Some(l)) => write!(f, "{}:{l}", self.file.display())?,
            (None, None) => write!(f, "{}", self.file.display())?,
        }
        if !self.key.is_empty() {
            write!(f, ": `{}`", self.key)?;
        }
        write!(f, ": {}", self.message)
    }
}

impl std::error::Error for SpecError {}

/// One value or an array of values to sweep over.
#[derive(Clone, Debug, PartialEq)]
pub struct Sweep<T>(pub Vec<T>);

impl<T> Sweep<T> {
    pub fn one(v: T) -> Self {
        Sweep(vec![v])
    }
}

impl<T: Serialize> Serialize for Sweep<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.0.len() == 1 {
            self.0[0].serialize(s)
        } else {
            self.0.serialize(s)
        }
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Sweep<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(std::marker::PhantomData<T>);
        macro_rules! scalar {
            ($name:ident, $ty:ty, $de:ident) => {
                fn $name<E: de::Error>(self, v: $ty) -> Result<Self::Value, E> {
                    T::deserialize(de::value::$de::<E>::new(v)).map(|x| Sweep(vec![x]))
                }
            };
        }
        impl<'de, T: Deserialize<'de>> de::Visitor<'de> for V<T> {
            type Value = Sweep<T>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a value or a non-empty array of values to sweep over")
            }
            scalar!(visit_bool, bool, BoolDeserializer);
            scalar!(visit_i64, i64, I64Deserializer);
            scalar!(visit_u64, u64, U64Deserializer);
            scalar!(visit_f64, f64, F64Deserializer);
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                T::deserialize(de::value::StrDeserializer::<E>::new(v)).map(|x| Sweep(vec![x]))
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut out = Vec::new();
                while let Some(x) = seq.next_element()? {
                    out.push(x);
                }
                if out.is_empty() {
                    return Err(de::Error::custom("an empty array sweeps over nothing: give at least one value"));
                }
                Ok(Sweep(out))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

/// A hyper-parameter that is a number or one word: the enum `$name` with the word's variant
/// and `Value(f64)`, written back as the number or the word, read from either (integers too);
/// anything else is "`x`: expected a number or "word"".
macro_rules! number_or_word {
    ($(#[$doc:meta])* $name:ident, $word:ident, $text:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq)]
        pub enum $name {
            $word,
            Value(f64),
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                match self {
                    $name::$word => s.serialize_str($text),
                    $name::Value(v) => s.serialize_f64(*v),
                }
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct V;
                impl de::Visitor<'_> for V {
                    type Value = $name;
                    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                        write!(f, "a number or \"{}\"", $text)
                    }
                    fn visit_f64<E: de::Error>(self, v: f64) -> Result<$name, E> {
                        Ok($name::Value(v))
                    }
                    fn visit_i64<E: de::Error>(self, v: i64) -> Result<$name, E> {
                        Ok($name::Value(v as f64))
                    }
                    fn visit_u64<E: de::Error>(self, v: u64) -> Result<$name, E> {
                        Ok($name::Value(v as f64))
                    }
                    fn visit_str<E: de::Error>(self, v: &str) -> Result<$name, E> {
                        if v == $text {
                            Ok($name::$word)
                        } else {
                            Err(E::custom(format!("`{v}`: expected a number or \"{}\"", $text)))
                        }
                    }
                }
                d.deserialize_any(V)
            }
        }
    };
}

number_or_word!(
    /// A number, or the word "none" (no clipping, no projection).
    OrNone,
    None,
    "none"
);

impl OrNone {
    pub fn get(&self) -> Option<f64> {
        match self {
            OrNone::None => None,
            OrNone::Value(v) => Some(*v),
        }
    }
}

impl From<Option<f64>> for OrNone {
    fn from(v: Option<f64>) -> Self {
        v.map_or(OrNone::None, OrNone::Value)
    }
}

number_or_word!(
    /// A number, or the word "auto": resolved from the data once it is read (λ = "auto": the
    /// median ‖z‖² of the first pairs, [`DataScale`]).
    OrAuto,
    Auto,
    "auto"
);

impl OrAuto {
    /// The number, with "auto" resolved to `auto`.
    pub fn or(&self, auto: f64) -> f64 {
        match self {
            OrAuto::Auto => auto,
            OrAuto::Value(v) => *v,
        }
    }
}

number_or_word!(
    /// A confidence width β: a number, or "theory" (√d·log(T/δ), the order of Lemma 1).
    Beta,
    Theory,
    "theory"
);

/// The scale of the data's differences z = φ(x, a) − φ(x, a′): ‖z‖² over the first
/// [`DataScale::PAIRS`] training pairs in file order (bandits: arms 0 and 1 of the first
/// contexts). λ = "auto" is the median; meta.json and the report show it beside each λ.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DataScale {
    pub pairs: usize,
    pub median_z_sq: f64,
    pub p90_z_sq: f64,
    pub max_z_sq: f64,
}

impl DataScale {
    pub const PAIRS: usize = 1000;

    /// The scale of `zs` (row-major, `d` per row), the first [`DataScale::PAIRS`] rows.
    pub fn of(zs: &[f32], d: usize) -> DataScale {
        let mut sq: Vec<f64> = zs
            .chunks_exact(d.max(1))
            .take(Self::PAIRS)
            .map(|z| z.iter().map(|&v| f64::from(v) * f64::from(v)).sum())
            .collect();
        if sq.is_empty() {
            return DataScale::default();
        }
        sq.sort_by(f64::total_cmp);
        let at = |q: f64| sq[((sq.len() - 1) as f64 * q).round() as usize];
        DataScale { pairs: sq.len(), median_z_sq: at(0.5), p90_z_sq: at(0.9), max_z_sq: sq[sq.len() - 1] }
    }

    /// What λ = "auto" resolves to: the median ‖z‖² (so a typical pair moves the margin by
    /// about one unit in a full 𝓗⁻¹z step), 1 when the data has no nonzero difference.
    pub fn auto_lambda(&self) -> f64 {
        if self.median_z_sq > 0.0 && self.median_z_sq.is_finite() {
            self.median_z_sq
        } else {
            1.0
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
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
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Spec {
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
    #[serde(default)]
    pub env: EnvSpec,
    #[serde(default)]
    pub stream: StreamSpec,
    #[serde(default)]
    pub curvature: CurvatureSpec,
    #[serde(default)]
    pub passive: PassiveSpec,
    #[serde(default)]
    pub active: ActiveSpec,
    #[serde(default)]
    pub deploy: DeploySpec,
    /// When cells save their state for `onepass run --resume` (not part of a run's identity).
    #[serde(default)]
    pub checkpoint: CheckpointSpec,
    /// The raw `[[estimator]]` tables: swept keys are expanded and each combination read by
    /// [`estimator::read`] in the plan.
    #[serde(rename = "estimator", default)]
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

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FeatureDist {
    /// g ~ N(0, I/d), clipped to ‖g‖ ≤ 1, times L.
    Gaussian,
    /// Uniform on the sphere of radius L.
    Sphere,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
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

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
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
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvSpec {
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

/// Periodic checkpoints of every running cell (estimator, curvature, RNG streams, stream
/// position, rows so far) under `<run>/checkpoints/`; SIGINT/SIGTERM always checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSpec {
    /// Seconds of a cell's work between checkpoints (0: only at SIGINT/SIGTERM). Default 120.
    #[serde(default = "d_every_s")]
    pub every_s: f64,
    /// Also every this many loop steps (updates; deploy on generated responses: chunks); 0: off.
    #[serde(default)]
    pub every_steps: u64,
}

fn d_every_s() -> f64 {
    120.0
}

impl Default for CheckpointSpec {
    fn default() -> Self {
        CheckpointSpec { every_s: d_every_s(), every_steps: 0 }
    }
}

/// Stream length and evaluation cadence.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamSpec {
    /// T: labelled samples (passive: pairs seen; active: the label budget; deploy: rounds).
    #[serde(default = "d_samples")]
    pub samples: u64,
    #[serde(default = "d_batch")]
    pub batch_size: usize,
    /// Evaluate every this many samples (and at the end).
    #[serde(default = "d_eval_every")]
    pub eval_every: u64,
    /// Also write steps.parquet (one row per update).
    #[serde(default)]
    pub record_steps: bool,
    /// Passive on pairs: R independent heads, as the authors' 4 GPUs ran their OMD (no
    /// all-reduce): rank r trains on rows r, r+R, r+2R, … of the stream (the tail that does not
    /// fill all ranks dropped), each with micro-batch `batch_size`. `samples` counts over all
    /// ranks; metrics are the mean over heads (each evaluated on every held-out pair); θ is rank
    /// 0's head. An all-reduced head of R ranks is one head with batch_size × R.
    #[serde(default = "d_ranks")]
    pub ranks: usize,
}

fn d_ranks() -> usize {
    1
}

impl Default for StreamSpec {
    fn default() -> Self {
        toml::from_str("").expect("all StreamSpec fields have defaults")
    }
}

fn d_samples() -> u64 {
    2000
}
fn d_batch() -> usize {
    1
}
fn d_eval_every() -> u64 {
    500
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CurvaturePoint {
    LookAhead,
    Current,
}

/// The uncertainty ‖x‖_{𝓗_t⁻¹} that drives pessimism, UCB and active selection, and the 𝓗_t
/// tracker every cell keeps (theta_err_H; the uncertainty of estimators without their own 𝓗).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CurvatureSpec {
    /// The tracker's 𝓗_1 = λI: a number or "auto" (the median ‖z‖² of the first pairs). Unset:
    /// the estimator's own λ (`lambda` of omd-exact), else 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lambda: Option<OrAuto>,
    #[serde(default = "d_point")]
    pub point: CurvaturePoint,
    /// Whose 𝓗_t gives the uncertainty: `auto` (the estimator's own when it keeps one — omd-exact,
    /// as Alg. 3 and 4 use the learner's 𝓗_t —, else the tracker), `estimator` (refused for an
    /// estimator without one), `tracker`.
    #[serde(default)]
    pub source: CurvatureSource,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CurvatureSource {
    #[default]
    Auto,
    Estimator,
    Tracker,
}

impl Default for CurvatureSpec {
    fn default() -> Self {
        toml::from_str("").expect("defaults")
    }
}

fn d_point() -> CurvaturePoint {
    CurvaturePoint::LookAhead
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Pessimism {
    /// argmax_a φᵀθ − β‖φ‖_{𝓗⁻¹} in every context.
    PerContext,
    /// Eq. (5) over the policy class (exhaustive when small, else coordinate ascent).
    Policy,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PassiveSpec {
    #[serde(default = "d_pessimism")]
    pub pessimism: Pessimism,
    #[serde(default = "d_beta")]
    pub beta: Beta,
    /// δ of β = "theory".
    #[serde(default = "d_delta")]
    pub delta: f64,
    /// The reference vector of Zhu et al.'s pessimistic value, reported as
    /// `subopt_pessimistic_ref` beside the paper's form (`subopt_pessimistic`): `uniform` (the
    /// default) centres each context's features on their mean over arms — the reference policy
    /// picks arms uniformly —, `none` leaves the column empty.
    #[serde(default)]
    pub pessimism_reference: PessimismReference,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PessimismReference {
    #[default]
    Uniform,
    None,
}

impl Default for PassiveSpec {
    fn default() -> Self {
        toml::from_str("").expect("defaults")
    }
}

fn d_pessimism() -> Pessimism {
    Pessimism::PerContext
}
fn d_beta() -> Beta {
    Beta::Theory
}
fn d_delta() -> f64 {
    0.05
}

/// How the active learner picks the pairs to label. One vocabulary with the deployment
/// strategies: besides the pool rules, every `selection::Strategy` name (random-pair,
/// best-random, best-two, best-worst, best-quantile, ucb) is a rule that draws a fresh context
/// (prompt) per label and picks two of its arms (responses) by the current θ.
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
                format!("unknown rule `{other}`: expected pool-argmax, stream, random, or a strategy (random-pair, best-random, best-two, best-worst, best-quantile, ucb)")
            }),
        }
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

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ScoreNorm {
    /// V_t = V₀I + Σzzᵀ with all candidates added before scoring (the authors' uncertainty_score).
    V,
    /// The cell's 𝓗_t.
    H,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
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
    #[serde(default = "d_candidates")]
    pub candidates: usize,
    #[serde(default = "d_keep")]
    pub keep: usize,
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

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeploySpec {
    /// Swept: every strategy is crossed with every estimator.
    #[serde(default = "d_strategies")]
    pub strategies: Sweep<String>,
    /// q of best-quantile.
    #[serde(default = "d_q")]
    pub q: f64,
    /// β of ucb.
    #[serde(default = "d_beta")]
    pub beta: Beta,
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
    /// "ppo": PPO with a critic on the chunk's n samples per prompt (`[policy.ppo]`).
    #[serde(default = "d_policy")]
    pub policy: Sweep<DeployPolicy>,
    /// Re-initialise the estimator at every chunk (the authors' pipeline did, by accident).
    #[serde(default)]
    pub reset_each_chunk: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DeployPolicy {
    BestOfN,
    Fixed,
    Rloo,
    Dpo,
    Ppo,
}

impl DeployPolicy {
    /// The policy's weights change between chunks (its responses are generated anew).
    pub fn learns(&self) -> bool {
        match self {
            DeployPolicy::Rloo | DeployPolicy::Dpo | DeployPolicy::Ppo => true,
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
fn d_q() -> f64 {
    4.0
}

/// 1-based line of byte offset `at` in `text`.
pub fn line_of(text: &str, at: usize) -> usize {
    text[..at.min(text.len())].bytes().filter(|&b| b == b'\n').count() + 1
}

/// The line where `path` (e.g. ["estimator", "1", "lr"]) is written, if it is; else the line
/// of its closest written parent.
pub fn locate(text: &str, path: &[String]) -> Option<usize> {
    let doc = toml_edit::Document::parse(text.to_string()).ok()?;
    find_span(doc.as_item(), path).map(|s| line_of(text, s.start))
}

/// Whether the key at `path` of plain tables (e.g. ["env", "dim"]) is written in `text`.
pub fn is_written(text: &str, path: &[&str]) -> bool {
    let Ok(doc) = toml_edit::Document::parse(text.to_string()) else { return false };
    let mut item = doc.as_item();
    for seg in path {
        match item.get(seg) {
            Some(next) => item = next,
            None => return false,
        }
    }
    true
}

type Span = std::ops::Range<usize>;

fn find_span(item: &toml_edit::Item, path: &[String]) -> Option<Span> {
    let Some((seg, rest)) = path.split_first() else { return item.span() };
    match item {
        toml_edit::Item::Table(t) => find_in_table(t, seg, rest),
        toml_edit::Item::ArrayOfTables(a) => {
            let t = a.get(seg.parse().ok()?)?;
            match rest.split_first() {
                None => t.span(),
                Some((s2, r2)) => find_in_table(t, s2, r2).or_else(|| t.span()),
            }
        }
        toml_edit::Item::Value(toml_edit::Value::InlineTable(t)) => t.key(seg).and_then(|k| k.span()),
        _ => None,
    }
}

fn find_in_table(t: &toml_edit::Table, seg: &str, rest: &[String]) -> Option<Span> {
    let key_span = t.key(seg).and_then(|k| k.span());
    let child = t.get(seg)?;
    if rest.is_empty() {
        key_span.or_else(|| child.span())
    } else {
        find_span(child, rest).or(key_span)
    }
}

/// Reads a spec file, applies `--set key=value` overrides, and parses it.
pub fn load(path: &Path, overrides: &[String]) -> Result<(Spec, String), SpecError> {
    let text = std::fs::read_to_string(path).map_err(|e| SpecError {
        file: path.to_path_buf(),
        key: String::new(),
        line: None,
        message: format!("cannot read the spec: {e}"),
        set: None,
    })?;
    parse(&text, path, overrides)
}

/// Parses spec text (errors name `path`), after `--set` overrides; no file is read.
pub fn parse(text: &str, path: &Path, overrides: &[String]) -> Result<(Spec, String), SpecError> {
    let err = |key: &str, line, message: String| SpecError {
        file: path.to_path_buf(),
        key: key.into(),
        line,
        message,
        set: None,
    };
    let text = apply_overrides(text, overrides).map_err(|(k, m)| SpecError {
        set: overrides.iter().find(|o| o.starts_with(&format!("{k}="))).cloned(),
        ..err(&k, None, m)
    })?;
    let spec: Spec = toml::from_str(&text).map_err(|e: toml::de::Error| {
        let line = e.span().map(|s| line_of(&text, s.start));
        // name the key when the error sits on a `key = value` line (wrong types, bad values),
        // or the table when it sits on a `[table]` header (a table written twice)
        let at = line.and_then(|l| text.lines().nth(l - 1)).map(str::trim);
        let header = at.and_then(|l| l.strip_prefix('[')).and_then(|l| l.trim_start_matches('[').split(']').next());
        let key = at
            .and_then(|l| l.split_once('='))
            .map(|(k, _)| k.trim())
            .or(header.map(str::trim))
            .filter(|k| !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || "_-.\"".contains(c)))
            .unwrap_or("");
        let mut e = err(key, line, e.message().trim().to_string());
        // an error on a line that a `--set` wrote cites the argument (its line is not the file's)
        if let Some(o) = line.and_then(|l| override_at(&text, overrides, l)) {
            e.key = override_key(o).to_string();
            (e.set, e.line) = (Some(o.clone()), None);
        }
        e
    })?;
    Ok((spec, text))
}

/// The key of a `--set key=value` argument.
pub fn override_key(o: &str) -> &str {
    o.split_once('=').map_or(o, |(k, _)| k)
}

/// The `--set` argument whose value sits on line `line` of the overridden `text`: the last one
/// of its key (the one in force).
pub fn override_at<'a>(text: &str, overrides: &'a [String], line: usize) -> Option<&'a String> {
    overrides.iter().rev().find(|o| {
        let key = override_key(o);
        let path: Vec<String> = key.split('.').map(String::from).collect();
        locate(text, &path) == Some(line)
    })
}

/// Applies `key=value` overrides (dotted keys; array-of-table entries by index, e.g.
/// `estimator.0.lr=0.1`); the value is read as TOML, else as a string.
pub fn apply_overrides(text: &str, overrides: &[String]) -> Result<String, (String, String)> {
    if overrides.is_empty() {
        return Ok(text.to_string());
    }
    let mut doc: toml_edit::DocumentMut =
        text.parse().map_err(|e: toml_edit::TomlError| (String::new(), e.message().to_string()))?;
    for o in overrides {
        let (key, raw) = o.split_once('=').ok_or_else(|| (o.clone(), "--set expects key=value".to_string()))?;
        let value: toml_edit::Value = raw.parse().unwrap_or_else(|_| toml_edit::Value::from(raw));
        let segs: Vec<&str> = key.split('.').collect();
        if let Some(bad) =
            segs.iter().find(|s| s.is_empty() || !s.chars().all(|c| c.is_ascii_alphanumeric() || "_-".contains(c)))
        {
            let why = if bad.is_empty() { "an empty name".to_string() } else { format!("`{bad}`") };
            return Err((
                key.to_string(),
                format!("{why} in the key: expected dotted names such as stream.samples or estimator.0.lr"),
            ));
        }
        set_in_table(doc.as_table_mut(), &segs, value).map_err(|m| (key.to_string(), m))?;
    }
    Ok(doc.to_string())
}

fn set_in_table(t: &mut toml_edit::Table, segs: &[&str], value: toml_edit::Value) -> Result<(), String> {
    let (seg, rest) = segs.split_first().ok_or("empty key")?;
    if rest.is_empty() {
        // a table (or [[table]] list) is set key by key: replaced by a value it would vanish
        if let Some(kind) = match t.get(seg) {
            Some(toml_edit::Item::Table(_)) => Some("the table"),
            Some(toml_edit::Item::ArrayOfTables(_)) => Some("the [[tables]]"),
            _ => None,
        } {
            return Err(format!(
                "cannot replace {kind} `{seg}` with a value: set its keys (e.g. {seg}.0.lr=… for [[tables]])"
            ));
        }
        t[seg] = toml_edit::Item::Value(value);
        return Ok(());
    }
    match t.entry(seg).or_insert(toml_edit::table()) {
        toml_edit::Item::Table(child) => set_in_table(child, rest, value),
        toml_edit::Item::ArrayOfTables(a) => {
            let (idx, rest) = rest.split_first().ok_or("expected an index after an array of tables")?;
            let idx: usize = idx.parse().map_err(|_| format!("`{idx}` is not an index"))?;
            let len = a.len();
            let child = a.get_mut(idx).ok_or_else(|| format!("index {idx} out of range: {len} entries"))?;
            if rest.is_empty() {
                return Err("cannot replace a whole table".into());
            }
            set_in_table(child, rest, value)
        }
        _ => Err(format!("`{seg}` is not a table")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Deserialize, Serialize)]
    struct T {
        clip: OrNone,
        lambda: OrAuto,
        beta: Beta,
    }

    /// The words and the numbers read and write back; another word or type is refused naming
    /// what was expected.
    #[test]
    fn a_number_or_its_word() {
        let t: T = toml::from_str("clip = \"none\"\nlambda = 2\nbeta = 0.5").unwrap();
        assert_eq!((t.clip, t.lambda, t.beta), (OrNone::None, OrAuto::Value(2.0), Beta::Value(0.5)));
        let t: T = toml::from_str("clip = 1.5\nlambda = \"auto\"\nbeta = \"theory\"").unwrap();
        assert_eq!((t.clip, t.lambda, t.beta), (OrNone::Value(1.5), OrAuto::Auto, Beta::Theory));
        let back: T = toml::from_str(&toml::to_string(&t).unwrap()).unwrap();
        assert_eq!((back.clip, back.lambda, back.beta), (t.clip, t.lambda, t.beta));
        for (text, says) in [
            ("clip = \"auto\"\nlambda = 1\nbeta = 1", "`auto`: expected a number or \"none\""),
            ("clip = 1\nlambda = \"none\"\nbeta = 1", "`none`: expected a number or \"auto\""),
            ("clip = 1\nlambda = 1\nbeta = true", "expected a number or \"theory\""),
        ] {
            let e = toml::from_str::<T>(text).unwrap_err().to_string();
            assert!(e.contains(says), "{text}: {e}");
        }
    }
}
