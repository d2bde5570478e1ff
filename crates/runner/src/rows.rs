//! The output schema once: the rows the settings' loops write and `results` turns into
//! metrics, steps, timings and rounds parquet (`report` reads those tables back by these column
//! names). Deterministic rows hold no wall clock; timings live in [`Bucket`] only.

use serde::{Deserialize, Serialize};

/// One row of metrics.parquet: a cell at an evaluation point. Deterministic: no wall clock.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MetricRow {
    pub step: u64,
    pub samples_seen: u64,
    /// Prequential (before each update), averaged since the previous evaluation point.
    pub train_loss: f64,
    pub train_accuracy: f64,
    pub eval_loss: f64,
    /// Held-out accuracy, a tie (zᵀθ = 0) counted as ½.
    pub eval_accuracy: f64,
    /// Held-out pairs with zᵀθ = 0 exactly (e.g. z = 0: both sides the same tokens).
    pub eval_ties: u64,
    /// ‖θ_t − θ*‖₂ and ‖θ_t − θ*‖_{𝓗_t} (None without a θ*: kind = "features").
    pub theta_err: Option<f64>,
    pub theta_err_h: Option<f64>,
    /// SubOpt of the greedy policy of the last iterate (None without a θ*).
    pub subopt: Option<f64>,
    /// Active: SubOpt of the greedy policy of the averaged iterate (1/t Σ θ_s).
    pub subopt_avg: Option<f64>,
    /// Passive, final row: SubOpt of the pessimistic policy.
    pub subopt_pessimistic: Option<f64>,
    /// SubOpt of the pessimistic policy with Zhu et al.'s reference vector (`passive.pessimism_reference`).
    pub subopt_pessimistic_ref: Option<f64>,
    /// Deploy: cumulative regret Σ r(x,π*) − ½(r(a)+r(a′)), and the mean of ½(r(a)+r(a′)).
    pub regret: Option<f64>,
    pub mean_reward: Option<f64>,
    /// Deploy on generated responses, per chunk: its index (1-based); the chunk's mean of
    /// r(a) + r(a′) (the authors' number) and its running sum over chunks; the mean oracle
    /// reward of the deployed policy's response (best-of-n under θ at the chunk's start, or the
    /// fixed first sample); the mean Kendall τ_b between learned and oracle rankings of the n
    /// samples; label ties of the argmax oracle so far.
    pub chunk: Option<u64>,
    pub pair_reward: Option<f64>,
    pub cum_pair_reward: Option<f64>,
    pub policy_reward: Option<f64>,
    pub kendall_tau: Option<f64>,
    pub oracle_ties: Option<u64>,
    /// `[oracle] flip` > 0: the labels the noisy labeller has flipped so far.
    #[serde(default)]
    pub flipped_labels: Option<u64>,
    /// max 1/σ'(zᵀθ_t) over the samples since the previous row (the paper's κ on the data seen).
    pub kappa: f64,
    /// Mean over those batches of the authors' 1/(min σ' + 1e-3).
    pub kappa_reference: f64,
    /// Ties broken by a seeded draw so far (selection rules).
    pub ties: u64,
    pub grad_evals: u64,
    pub hvp_evals: u64,
    /// Negative quadratic forms xᵀ𝓗⁻¹x taken as 0 so far (the estimator's and the tracker's):
    /// rounding drift of a maintained inverse; 0 in a healthy run.
    pub negative_quad_forms: u64,
    pub flops: u64,
    /// Every re-fit so far reached its tolerance (mle; true otherwise).
    pub converged: bool,
    /// Bytes of state the estimator holds at this point (parameters, matrices, moments, the
    /// history a re-fit keeps): flat in t for one-pass estimators, growing for mle (None: a
    /// run written before the column, or a reward model whose features learn).
    pub estimator_bytes: Option<u64>,
}

/// One row of steps.parquet: the estimator's own report of one update.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepRow {
    pub step: u64,
    pub samples_seen: u64,
    pub report: estimators::StepReport,
}

/// Wall time between two evaluation points (timings.parquet; never in metrics.parquet).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Bucket {
    pub step: u64,
    pub samples_seen: u64,
    /// Inside `Estimator::update`.
    pub estimator_s: f64,
    /// Everything else: drawing data, selection, the curvature tracker, evaluation.
    pub other_s: f64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct CellResult {
    /// Timings per evaluation bucket.
    pub buckets: Vec<Bucket>,
    pub rows: Vec<MetricRow>,
    pub steps: Vec<StepRow>,
    pub theta: Vec<f64>,
    /// FNV-1a over the contexts, pairs and label noise the cell drew: equal for all cells of a
    /// seed whose data do not depend on the method (passive, and the noise of all settings).
    pub stream_hash: u64,
    /// Seconds inside `Estimator::update`, over the whole cell.
    pub estimator_s: f64,
    /// Deploy on generated responses: one row per prompt (rounds.parquet).
    pub rounds: Vec<RoundRow>,
    /// Deploy with a learning policy in the run: the policy's evaluation per chunk
    /// (policy.parquet), its wall time per chunk (policy_timings.parquet), and its adapters in
    /// PEFT's layout (`adapters/<cell>/[chunk-NN/]`).
    pub policy: Vec<PolicyRow>,
    /// The evaluations' samples (policy_samples.parquet).
    pub policy_samples: Vec<SampleRow>,
    pub policy_updates: Vec<UpdateRow>,
    pub policy_times: Vec<PolicyTiming>,
    pub adapters: Vec<AdapterFiles>,
}

/// A policy's evaluation on the held-out prompts after a chunk (chunk 0: before any update):
/// `policy.eval_samples` (a multiple of n) samples per prompt from the current policy, drawn
/// with the seed's held-out streams — the same streams for every arm of a seed and every chunk
/// (common random numbers), other streams for another seed. Deterministic.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PolicyRow {
    pub chunk: u64,
    /// The mean oracle reward of what the arm deploys: a learning (or fixed) policy its
    /// samples; best-of-n the best of each group of n samples under θ_t. One measure for every
    /// arm: compare arms on this column.
    pub policy_reward: f64,
    /// The mean oracle reward of the policy's samples.
    pub sample_reward: f64,
    /// Best-of-n of the policy's samples under θ_t (n = generate.n): the mean over groups of n
    /// of the oracle reward of the sample θ_t ranks first — every arm has it.
    pub bon_reward: f64,
    /// Mean learned reward φᵀθ_t of the policy's samples.
    pub learned_reward: f64,
    /// Mean over samples of the sequence KL to the reference policy (policy.kl_estimator;
    /// 0 for a policy that does not learn).
    pub kl: f64,
    /// The same to the initial policy, whatever policy.kl_reference (with "chunk-start" `kl`
    /// is to the policy after the last update: 0).
    pub kl_initial: f64,
    /// −mean log π(y_t) over the sampled tokens (None for a policy that does not learn).
    pub entropy: Option<f64>,
    pub response_tokens: f64,
    /// Samples cut at max_new_tokens.
    pub cut_fraction: f64,
    /// The generating weights against the trained policy: ‖W_gen − (W + (α/r)BA)‖_F /
    /// ‖(α/r)BA‖_F over the adapted layers (0 when exact or unmoved; see
    /// `PolicyModel::merge_error`; unmerged bf16 samplers: `PolicyModel::unmerged_error`).
    pub merge_error: f64,
    /// Which adapters generated the samples (blake3 of their values; "base" for an arm that
    /// does not learn).
    pub policy_digest: String,
    /// `generate.backend = "openai"`: the name the samples were requested under on the server
    /// (the cell's adapter once it has moved, else the served model); "" for onepass's sampler.
    pub served_as: String,
}

/// One held-out sample of a policy evaluation (policy_samples.parquet): the rows a
/// [`PolicyRow`] averages, kept so that a claim can be checked against prompt sampling (a
/// seed × prompt analysis) after the run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SampleRow {
    pub chunk: u64,
    /// The held-out prompt's index (0-based, in policy.eval_prompts' order: the same prompt for
    /// every seed and arm).
    pub prompt: u64,
    /// The sample's index among the prompt's policy.eval_samples (the seed's held-out stream).
    pub sample: u32,
    /// The oracle's reward of the sample.
    pub oracle_reward: f64,
    /// φᵀθ_t of the sample.
    pub learned_reward: f64,
    /// Whether the arm deploys this sample: every sample of a policy that deploys what it
    /// draws; best-of-n the one θ_t ranks first in its group of n. The prompt's
    /// `policy_reward` is the mean oracle reward of its deployed samples.
    pub deployed: bool,
    pub tokens: u64,
    /// The sample's sequence KL to the reference policy (policy.kl_estimator; None for a policy
    /// that does not learn).
    pub kl: Option<f64>,
    /// The same to the initial policy.
    pub kl_initial: Option<f64>,
    /// Σ log π of the sample's tokens under the policy (None for a policy that does not learn).
    pub logprob: Option<f64>,
}

/// A learning policy's chunk (policy_updates.parquet): the samples it drew on the chunk's
/// training prompts (before the chunk's update) and the update they drove.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct UpdateRow {
    pub chunk: u64,
    /// The adapters that generated the chunk's samples, and those after its update.
    pub rollout_digest: String,
    pub updated_digest: String,
    /// The name the chunk's samples were requested under on a server ("" for onepass's sampler).
    pub rollout_served_as: String,
    /// Mean oracle and learned (φᵀθ_t, after θ's update on the chunk) reward of the chunk's samples.
    pub rollout_oracle_reward: f64,
    pub rollout_learned_reward: f64,
    /// Mean of the reward the update read (policy.reward: learned, oracle or null; rloo)
    /// before normalisation, or the mean implicit DPO reward margin.
    pub update_reward: f64,
    /// Mean loss, mean ‖g‖ before clipping, Adam steps.
    pub update_loss: f64,
    pub update_grad_norm: f64,
    pub update_steps: u64,
    /// Mean sequence KL to the reference and entropy on the chunk's samples, before the update.
    pub kl: f64,
    pub entropy: f64,
    /// dpo: the labelled pairs it learned from, and the pairs dropped (an argmax tie or two
    /// identical responses: no preference).
    pub pairs: u64,
    pub dropped_pairs: u64,
    /// ppo: the critic's mean loss and ‖g‖ over the update, the mean value and return over the
    /// chunk's tokens before it (null for the other arms).
    #[serde(default)]
    pub critic_loss: Option<f64>,
    #[serde(default)]
    pub critic_grad_norm: Option<f64>,
    #[serde(default)]
    pub value_mean: Option<f64>,
    #[serde(default)]
    pub return_mean: Option<f64>,
}

/// Wall seconds of a chunk by stage (policy_timings.parquet; never in policy.parquet).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PolicyTiming {
    pub chunk: u64,
    pub generation_s: f64,
    pub phi_s: f64,
    pub estimator_s: f64,
    pub policy_s: f64,
    /// ppo: the critic's share, apart from policy_s (0 for other arms).
    pub critic_s: f64,
    pub eval_s: f64,
    /// eval_s's parts: sampling the held-out prompts (the generator's load of the current
    /// weights included), φ and the oracle of those samples, and the policy's log-probabilities
    /// and KL (the rest of eval_s is the rewards' arithmetic).
    #[serde(default)]
    pub eval_generation_s: f64,
    #[serde(default)]
    pub eval_phi_s: f64,
    #[serde(default)]
    pub eval_score_s: f64,
}

impl PolicyTiming {
    /// An evaluation's parts into eval_generation_s, eval_phi_s, eval_score_s.
    pub fn record_eval(&mut self, e: EvalTimes) {
        (self.eval_generation_s, self.eval_phi_s, self.eval_score_s) = (e.generation_s, e.phi_s, e.score_s);
    }
}

/// Where an evaluation's time went ([`PolicyTiming`]'s eval_* parts).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EvalTimes {
    pub generation_s: f64,
    pub phi_s: f64,
    pub score_s: f64,
}

/// An adapter in PEFT's layout: its directory under `adapters/`, the safetensors bytes and
/// adapter_config.json.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct AdapterFiles {
    pub dir: String,
    pub safetensors: Vec<u8>,
    pub config: String,
}

/// One prompt of a chunked deployment run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RoundRow {
    pub chunk: u64,
    /// Index of the prompt in the prompt file (generations.parquet).
    pub prompt: u64,
    pub first: u32,
    pub second: u32,
    pub reward_first: f64,
    pub reward_second: f64,
    /// 1: the first response preferred.
    pub label: f32,
    pub policy_pick: u32,
    pub policy_reward: f64,
    /// max_a r(a) over the prompt's samples.
    pub best_reward: f64,
    pub kendall_tau: f64,
}

/// One column of a table: its name, its parquet type, how a row fills it and how a row read
/// back takes it. The tables' value columns are listed once below; `results` writes them after
/// the cell's key columns (cell_id, config_id, estimator, label, strategy, seed) and reads them
/// back through the same list ([`crate::results`]'s readers, which `report` uses): a renamed
/// field is a compile error in both.
pub enum Col<R: 'static> {
    U32(&'static str, fn(&R) -> u32, fn(&mut R, u32)),
    U64(&'static str, fn(&R) -> u64, fn(&mut R, u64)),
    OptU64(&'static str, fn(&R) -> Option<u64>, fn(&mut R, Option<u64>)),
    F64(&'static str, fn(&R) -> f64, fn(&mut R, f64)),
    OptF64(&'static str, fn(&R) -> Option<f64>, fn(&mut R, Option<f64>)),
    Bool(&'static str, fn(&R) -> bool, fn(&mut R, bool)),
    Str(&'static str, fn(&R) -> String, fn(&mut R, String)),
    OptStr(&'static str, fn(&R) -> Option<String>, fn(&mut R, Option<String>)),
}

impl<R> Col<R> {
    pub fn name(&self) -> &'static str {
        match self {
            Col::U32(n, ..)
            | Col::U64(n, ..)
            | Col::OptU64(n, ..)
            | Col::F64(n, ..)
            | Col::OptF64(n, ..)
            | Col::Bool(n, ..)
            | Col::Str(n, ..)
            | Col::OptStr(n, ..) => n,
        }
    }
}

/// `col!(F64 "name" => field.path)`: the column `name` of type F64 read from and written to
/// `row.field.path`.
macro_rules! col {
    (Str $name:literal => $($f:ident).+) => {
        Col::Str($name, |r| r.$($f).+.clone(), |r, v| r.$($f).+ = v)
    };
    (OptStr $name:literal => $($f:ident).+) => {
        Col::OptStr($name, |r| r.$($f).+.clone(), |r, v| r.$($f).+ = v)
    };
    ($kind:ident $name:literal => $($f:ident).+) => {
        Col::$kind($name, |r| r.$($f).+, |r, v| r.$($f).+ = v)
    };
}

/// metrics.parquet: one row per cell × evaluation point.
pub const METRICS: &[Col<MetricRow>] = &[
    col!(U64 "step" => step),
    col!(U64 "samples_seen" => samples_seen),
    col!(F64 "train_loss" => train_loss),
    col!(F64 "train_accuracy" => train_accuracy),
    col!(F64 "eval_loss" => eval_loss),
    col!(F64 "eval_accuracy" => eval_accuracy),
    col!(U64 "eval_ties" => eval_ties),
    col!(OptF64 "theta_err" => theta_err),
    col!(OptF64 "theta_err_h" => theta_err_h),
    col!(OptF64 "subopt" => subopt),
    col!(OptF64 "subopt_avg" => subopt_avg),
    col!(OptF64 "subopt_pessimistic" => subopt_pessimistic),
    col!(OptF64 "subopt_pessimistic_ref" => subopt_pessimistic_ref),
    col!(OptF64 "regret" => regret),
    col!(OptF64 "mean_reward" => mean_reward),
    col!(F64 "kappa" => kappa),
    col!(F64 "kappa_reference" => kappa_reference),
    col!(U64 "ties" => ties),
    col!(U64 "grad_evals" => grad_evals),
    col!(U64 "hvp_evals" => hvp_evals),
    col!(U64 "negative_quad_forms" => negative_quad_forms),
    col!(U64 "flops" => flops),
    col!(Bool "converged" => converged),
    col!(OptU64 "estimator_bytes" => estimator_bytes),
];

/// metrics.parquet of a chunked deployment run, after [`METRICS`].
pub const METRICS_CHUNKED: &[Col<MetricRow>] = &[
    col!(OptU64 "chunk" => chunk),
    col!(OptF64 "pair_reward" => pair_reward),
    col!(OptF64 "cum_pair_reward" => cum_pair_reward),
    col!(OptF64 "policy_reward" => policy_reward),
    col!(OptF64 "kendall_tau" => kendall_tau),
    col!(OptU64 "oracle_ties" => oracle_ties),
];

/// metrics.parquet's columns of a run whose oracle flips labels (`[oracle] flip` > 0).
pub const METRICS_FLIP: &[Col<MetricRow>] = &[col!(OptU64 "flipped_labels" => flipped_labels)];

/// rounds.parquet: one row per prompt of a chunked deployment run.
pub const ROUNDS: &[Col<RoundRow>] = &[
    col!(U64 "chunk" => chunk),
    col!(U64 "prompt" => prompt),
    col!(U32 "first" => first),
    col!(U32 "second" => second),
    col!(F64 "reward_first" => reward_first),
    col!(F64 "reward_second" => reward_second),
    Col::F64("label", |r| f64::from(r.label), |r, v| r.label = v as f32),
    col!(U32 "policy_pick" => policy_pick),
    col!(F64 "policy_reward" => policy_reward),
    col!(F64 "best_reward" => best_reward),
    col!(F64 "kendall_tau" => kendall_tau),
];

/// policy.parquet: one row per cell × policy evaluation (runs with a learning policy).
pub const POLICY: &[Col<PolicyRow>] = &[
    col!(U64 "chunk" => chunk),
    col!(F64 "policy_reward" => policy_reward),
    col!(F64 "sample_reward" => sample_reward),
    col!(F64 "bon_reward" => bon_reward),
    col!(F64 "learned_reward" => learned_reward),
    col!(F64 "kl" => kl),
    col!(F64 "kl_initial" => kl_initial),
    col!(OptF64 "entropy" => entropy),
    col!(F64 "response_tokens" => response_tokens),
    col!(F64 "cut_fraction" => cut_fraction),
    col!(F64 "merge_error" => merge_error),
];

/// policy_samples.parquet: one row per cell × evaluation × held-out prompt × sample.
pub const POLICY_SAMPLES: &[Col<SampleRow>] = &[
    col!(U64 "chunk" => chunk),
    col!(U64 "prompt" => prompt),
    col!(U32 "sample" => sample),
    col!(F64 "oracle_reward" => oracle_reward),
    col!(F64 "learned_reward" => learned_reward),
    col!(Bool "deployed" => deployed),
    col!(U64 "tokens" => tokens),
    col!(OptF64 "kl" => kl),
    col!(OptF64 "kl_initial" => kl_initial),
    col!(OptF64 "logprob" => logprob),
];

/// policy.parquet's last column, after the deployed policy's (`results`).
pub const POLICY_DIGEST: &[Col<PolicyRow>] =
    &[col!(Str "policy_digest" => policy_digest), col!(Str "served_as" => served_as)];

/// policy_updates.parquet: one row per learning cell × chunk (with policy_digest columns).
pub const POLICY_UPDATES: &[Col<UpdateRow>] = &[
    col!(U64 "chunk" => chunk),
    col!(F64 "rollout_oracle_reward" => rollout_oracle_reward),
    col!(F64 "rollout_learned_reward" => rollout_learned_reward),
    col!(F64 "update_reward" => update_reward),
    col!(F64 "update_loss" => update_loss),
    col!(F64 "update_grad_norm" => update_grad_norm),
    col!(U64 "update_steps" => update_steps),
    col!(F64 "kl" => kl),
    col!(F64 "entropy" => entropy),
    col!(U64 "pairs" => pairs),
    col!(U64 "dropped_pairs" => dropped_pairs),
    col!(OptF64 "critic_loss" => critic_loss),
    col!(OptF64 "critic_grad_norm" => critic_grad_norm),
    col!(OptF64 "value_mean" => value_mean),
    col!(OptF64 "return_mean" => return_mean),
];

/// policy_timings.parquet: one row per cell × chunk.
pub const POLICY_TIMINGS: &[Col<PolicyTiming>] = &[
    col!(U64 "chunk" => chunk),
    col!(F64 "generation_s" => generation_s),
    col!(F64 "phi_s" => phi_s),
    col!(F64 "estimator_s" => estimator_s),
    col!(F64 "policy_s" => policy_s),
    col!(F64 "critic_s" => critic_s),
    col!(F64 "eval_s" => eval_s),
    col!(F64 "eval_generation_s" => eval_generation_s),
    col!(F64 "eval_phi_s" => eval_phi_s),
    col!(F64 "eval_score_s" => eval_score_s),
];

/// steps.parquet: one row per update (stream.record_steps).
pub const STEPS: &[Col<StepRow>] = &[
    col!(U64 "step" => step),
    col!(U64 "samples_seen" => samples_seen),
    col!(F64 "loss" => report.before.loss),
    col!(F64 "accuracy" => report.before.accuracy),
    col!(F64 "grad_norm" => report.grad_norm),
    col!(F64 "step_norm" => report.step_norm),
    col!(F64 "clip_factor" => report.clip_factor),
    col!(F64 "cos_step_grad" => report.cos_step_grad),
    col!(F64 "damping" => report.damping),
    col!(U32 "inner_iters" => report.inner_iters),
];

/// timings.parquet: one row per cell × evaluation bucket (then the cell's totals).
pub const BUCKETS: &[Col<Bucket>] = &[
    col!(U64 "step" => step),
    col!(U64 "samples_seen" => samples_seen),
    col!(F64 "estimator_s" => estimator_s),
    col!(F64 "other_s" => other_s),
];

/// A cell's totals, repeated on each of its rows of timings.parquet.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CellTotals {
    /// The cell's wall time, and the part inside `Estimator::update`.
    pub wall_s: f64,
    pub estimator_s: f64,
}

/// timings.parquet, after [`BUCKETS`].
pub const CELL_TOTALS: &[Col<CellTotals>] =
    &[col!(F64 "cell_wall_s" => wall_s), col!(F64 "cell_estimator_s" => estimator_s)];

/// Whether a cell finished (cells.parquet).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CellStatus {
    /// "ok" or "failed".
    pub status: String,
    pub err: Option<String>,
}

/// cells.parquet's status columns (after the cell's key, hyper-parameters and curvature).
pub const CELL_STATUS: &[Col<CellStatus>] = &[col!(Str "status" => status), col!(OptStr "err" => err)];

/// One config's win rates over a chunked deployment run (winrates.parquet).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WinRow {
    pub chunk_win_rate: f64,
    pub prompt_win_rate: f64,
    pub chunks_compared: u64,
    pub prompts_compared: u64,
}

/// winrates.parquet, after the config's key columns.
pub const WINRATES: &[Col<WinRow>] = &[
    col!(F64 "chunk_win_rate" => chunk_win_rate),
    col!(F64 "prompt_win_rate" => prompt_win_rate),
    col!(U64 "chunks_compared" => chunks_compared),
    col!(U64 "prompts_compared" => prompts_compared),
];

/// The key columns a table is read back by: the cell, its config's label and its seed.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Key {
    pub cell_id: String,
    pub label: String,
    pub seed: u32,
}

/// [`Key`]'s columns (every per-cell table has them; winrates.parquet has `label` only).
pub const KEY: &[Col<Key>] = &[col!(Str "cell_id" => cell_id), col!(Str "label" => label), col!(U32 "seed" => seed)];

/// winrates.parquet's key: the config's label.
pub const LABEL: &[Col<Key>] = &[col!(Str "label" => label)];
