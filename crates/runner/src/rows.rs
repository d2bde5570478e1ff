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
    /// −mean log π(y_t) over the sampled tokens (None for a policy that does not learn).
    pub entropy: Option<f64>,
    pub response_tokens: f64,
    /// Samples cut at max_new_tokens.
    pub cut_fraction: f64,
    /// The generating weights against the trained policy: ‖W_gen − (W + (α/r)BA)‖_F /
    /// ‖(α/r)BA‖_F over the adapted layers (0 when exact or unmoved; see
    /// `PolicyModel::merge_error`).
    pub merge_error: f64,
    /// Which adapters generated the samples (blake3 of their values; "base" for an arm that
    /// does not learn).
    pub policy_digest: String,
}

/// A learning policy's chunk (policy_updates.parquet): the samples it drew on the chunk's
/// training prompts (before the chunk's update) and the update they drove.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct UpdateRow {
    pub chunk: u64,
    /// The adapters that generated the chunk's samples, and those after its update.
    pub rollout_digest: String,
    pub updated_digest: String,
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

/// One column of a table: its name, its parquet type and how a row fills it. The tables'
/// value columns are listed once below; `results` writes them after the cell's key columns
/// (cell_id, config_id, estimator, label, strategy, seed) and `report` reads them by name.
pub enum Col<R: 'static> {
    U32(&'static str, fn(&R) -> u32),
    U64(&'static str, fn(&R) -> u64),
    OptU64(&'static str, fn(&R) -> Option<u64>),
    F64(&'static str, fn(&R) -> f64),
    OptF64(&'static str, fn(&R) -> Option<f64>),
    Bool(&'static str, fn(&R) -> bool),
}

impl<R> Col<R> {
    pub fn name(&self) -> &'static str {
        match self {
            Col::U32(n, _)
            | Col::U64(n, _)
            | Col::OptU64(n, _)
            | Col::F64(n, _)
            | Col::OptF64(n, _)
            | Col::Bool(n, _) => n,
        }
    }
}

/// metrics.parquet: one row per cell × evaluation point.
pub const METRICS: &[Col<MetricRow>] = &[
    Col::U64("step", |r| r.step),
    Col::U64("samples_seen", |r| r.samples_seen),
    Col::F64("train_loss", |r| r.train_loss),
    Col::F64("train_accuracy", |r| r.train_accuracy),
    Col::F64("eval_loss", |r| r.eval_loss),
    Col::F64("eval_accuracy", |r| r.eval_accuracy),
    Col::U64("eval_ties", |r| r.eval_ties),
    Col::OptF64("theta_err", |r| r.theta_err),
    Col::OptF64("theta_err_h", |r| r.theta_err_h),
    Col::OptF64("subopt", |r| r.subopt),
    Col::OptF64("subopt_avg", |r| r.subopt_avg),
    Col::OptF64("subopt_pessimistic", |r| r.subopt_pessimistic),
    Col::OptF64("subopt_pessimistic_ref", |r| r.subopt_pessimistic_ref),
    Col::OptF64("regret", |r| r.regret),
    Col::OptF64("mean_reward", |r| r.mean_reward),
    Col::F64("kappa", |r| r.kappa),
    Col::F64("kappa_reference", |r| r.kappa_reference),
    Col::U64("ties", |r| r.ties),
    Col::U64("grad_evals", |r| r.grad_evals),
    Col::U64("hvp_evals", |r| r.hvp_evals),
    Col::U64("negative_quad_forms", |r| r.negative_quad_forms),
    Col::U64("flops", |r| r.flops),
    Col::Bool("converged", |r| r.converged),
];

/// metrics.parquet of a chunked deployment run, after [`METRICS`].
pub const METRICS_CHUNKED: &[Col<MetricRow>] = &[
    Col::OptU64("chunk", |r| r.chunk),
    Col::OptF64("pair_reward", |r| r.pair_reward),
    Col::OptF64("cum_pair_reward", |r| r.cum_pair_reward),
    Col::OptF64("policy_reward", |r| r.policy_reward),
    Col::OptF64("kendall_tau", |r| r.kendall_tau),
    Col::OptU64("oracle_ties", |r| r.oracle_ties),
];

/// rounds.parquet: one row per prompt of a chunked deployment run.
pub const ROUNDS: &[Col<RoundRow>] = &[
    Col::U64("chunk", |r| r.chunk),
    Col::U64("prompt", |r| r.prompt),
    Col::U32("first", |r| r.first),
    Col::U32("second", |r| r.second),
    Col::F64("reward_first", |r| r.reward_first),
    Col::F64("reward_second", |r| r.reward_second),
    Col::F64("label", |r| f64::from(r.label)),
    Col::U32("policy_pick", |r| r.policy_pick),
    Col::F64("policy_reward", |r| r.policy_reward),
    Col::F64("best_reward", |r| r.best_reward),
    Col::F64("kendall_tau", |r| r.kendall_tau),
];

/// policy.parquet: one row per cell × policy evaluation (runs with a learning policy).
pub const POLICY: &[Col<PolicyRow>] = &[
    Col::U64("chunk", |r| r.chunk),
    Col::F64("policy_reward", |r| r.policy_reward),
    Col::F64("sample_reward", |r| r.sample_reward),
    Col::F64("bon_reward", |r| r.bon_reward),
    Col::F64("learned_reward", |r| r.learned_reward),
    Col::F64("kl", |r| r.kl),
    Col::OptF64("entropy", |r| r.entropy),
    Col::F64("response_tokens", |r| r.response_tokens),
    Col::F64("cut_fraction", |r| r.cut_fraction),
    Col::F64("merge_error", |r| r.merge_error),
];

/// policy_updates.parquet: one row per learning cell × chunk (with policy_digest columns).
pub const POLICY_UPDATES: &[Col<UpdateRow>] = &[
    Col::U64("chunk", |r| r.chunk),
    Col::F64("rollout_oracle_reward", |r| r.rollout_oracle_reward),
    Col::F64("rollout_learned_reward", |r| r.rollout_learned_reward),
    Col::F64("update_reward", |r| r.update_reward),
    Col::F64("update_loss", |r| r.update_loss),
    Col::F64("update_grad_norm", |r| r.update_grad_norm),
    Col::U64("update_steps", |r| r.update_steps),
    Col::F64("kl", |r| r.kl),
    Col::F64("entropy", |r| r.entropy),
    Col::U64("pairs", |r| r.pairs),
    Col::U64("dropped_pairs", |r| r.dropped_pairs),
    Col::OptF64("critic_loss", |r| r.critic_loss),
    Col::OptF64("critic_grad_norm", |r| r.critic_grad_norm),
    Col::OptF64("value_mean", |r| r.value_mean),
    Col::OptF64("return_mean", |r| r.return_mean),
];

/// policy_timings.parquet: one row per cell × chunk.
pub const POLICY_TIMINGS: &[Col<PolicyTiming>] = &[
    Col::U64("chunk", |r| r.chunk),
    Col::F64("generation_s", |r| r.generation_s),
    Col::F64("phi_s", |r| r.phi_s),
    Col::F64("estimator_s", |r| r.estimator_s),
    Col::F64("policy_s", |r| r.policy_s),
    Col::F64("critic_s", |r| r.critic_s),
    Col::F64("eval_s", |r| r.eval_s),
    Col::F64("eval_generation_s", |r| r.eval_generation_s),
    Col::F64("eval_phi_s", |r| r.eval_phi_s),
    Col::F64("eval_score_s", |r| r.eval_score_s),
];

/// steps.parquet: one row per update (stream.record_steps).
pub const STEPS: &[Col<StepRow>] = &[
    Col::U64("step", |s| s.step),
    Col::U64("samples_seen", |s| s.samples_seen),
    Col::F64("loss", |s| s.report.before.loss),
    Col::F64("accuracy", |s| s.report.before.accuracy),
    Col::F64("grad_norm", |s| s.report.grad_norm),
    Col::F64("step_norm", |s| s.report.step_norm),
    Col::F64("clip_factor", |s| s.report.clip_factor),
    Col::F64("cos_step_grad", |s| s.report.cos_step_grad),
    Col::F64("damping", |s| s.report.damping),
    Col::U32("inner_iters", |s| s.report.inner_iters),
];

/// timings.parquet: one row per cell × evaluation bucket (then the cell's totals).
pub const BUCKETS: &[Col<Bucket>] = &[
    Col::U64("step", |b| b.step),
    Col::U64("samples_seen", |b| b.samples_seen),
    Col::F64("estimator_s", |b| b.estimator_s),
    Col::F64("other_s", |b| b.other_s),
];
