//! What every results table and column means, for users: each parquet table a run directory
//! may hold ([`TABLES`]) and each column's tables, type, unit and meaning ([`COLUMNS`]). The
//! reference page (`docs/src/reference/results.md`) is rendered from these lists; a unit test
//! checks them against [`crate::rows`]'s column lists (name and type), and the integration
//! tests check every table a real run writes against them ([`undocumented`]): a column the code
//! writes without a doc here fails the tests.

/// A results table: its file and what one row is.
pub struct TableDoc {
    pub file: &'static str,
    pub doc: &'static str,
}

/// A column: the tables that have it, its type as the reference shows it (`string`, `u32`,
/// `u64`, `i64`, `f64`, `bool`; `?` when it may be null; `varies` for a family of columns), its
/// unit ("" when it has none) and meaning.
pub struct ColumnDoc {
    pub tables: &'static [&'static str],
    pub column: &'static str,
    pub ty: &'static str,
    pub unit: &'static str,
    pub doc: &'static str,
}

const CELLS: &str = "cells.parquet";
const METRICS: &str = "metrics.parquet";
const STEPS: &str = "steps.parquet";
const TIMINGS: &str = "timings.parquet";
const ROUNDS: &str = "rounds.parquet";
const WINRATES: &str = "winrates.parquet";
const GENERATIONS: &str = "generations.parquet";
const POLICY: &str = "policy.parquet";
const UPDATES: &str = "policy_updates.parquet";
const SAMPLES: &str = "policy_samples.parquet";
const PTIMINGS: &str = "policy_timings.parquet";

/// Every table, in the order a run writes them.
pub const TABLES: &[TableDoc] = &[
    TableDoc {
        file: CELLS,
        doc: "One row per cell (estimator config × seed, × strategy and deployed policy in a \
              deployment): its config, hyper-parameters, status and error. Every run.",
    },
    TableDoc {
        file: METRICS,
        doc: "One row per cell × evaluation point (`stream.eval_every` samples in passive and active \
              runs, one per chunk in a chunked deployment). Deterministic: the same spec and seed \
              give the same bytes. Every run.",
    },
    TableDoc {
        file: ROUNDS,
        doc: "One row per cell × prompt of a chunked deployment (`env.kind = \"generated\"`): the \
              two responses the strategy picked, their oracle rewards and the label.",
    },
    TableDoc {
        file: WINRATES,
        doc: "One row per config of a chunked deployment with more than one config: how often its \
              cumulative pair reward beats the others', per chunk and per prompt, over seeds.",
    },
    TableDoc {
        file: POLICY,
        doc: "One row per cell × chunk of a deployment with a learning policy (`deploy.policy` with \
              rloo, dpo or ppo): the deployed policy evaluated on the held-out prompts after the \
              chunk's update (chunk 0: before any update), with the same sampling streams for every \
              arm of a seed.",
    },
    TableDoc {
        file: SAMPLES,
        doc: "One row per cell × evaluation × held-out prompt × sample: the samples policy.parquet's \
              row averages (the same prompts for every seed, the seed's sampling streams), so that a \
              difference can be analysed over seeds and prompts (the report's prompt-clustered \
              interval reads it).",
    },
    TableDoc {
        file: UPDATES,
        doc: "One row per learning cell × chunk: the samples the policy drew on the chunk's training \
              prompts and the update they drove.",
    },
    TableDoc {
        file: PTIMINGS,
        doc: "One row per cell × chunk of a run with a learning policy: wall seconds by stage.",
    },
    TableDoc {
        file: GENERATIONS,
        doc: "One row per response of the generated bank (`env.kind = \"generated\"`): the prompt, \
              the response and its oracle reward.",
    },
    TableDoc {
        file: STEPS,
        doc:
            "One row per cell × update (with `stream.record_steps = true`): the estimator's own report of each update.",
    },
    TableDoc {
        file: TIMINGS,
        doc: "One row per cell × evaluation bucket: wall time inside and outside the estimator's \
              update (wall clock lives only in the timing tables). Every run.",
    },
];

const ARMS: &[&str] = &[CELLS, METRICS, POLICY, SAMPLES, UPDATES];

/// Every column, the key columns first (one per line, as a table reads).
#[rustfmt::skip]
pub const COLUMNS: &[ColumnDoc] = &[
    // the cell's key
    ColumnDoc { tables: &[CELLS, METRICS, ROUNDS, POLICY, SAMPLES, UPDATES, PTIMINGS, STEPS, TIMINGS], column: "cell_id", ty: "string", unit: "", doc: "The cell's id (`c0000`, `c0001`, … in the plan's order); its θ is `theta/<cell_id>.npy`, its adapters under `adapters/<cell_id>/`." },
    ColumnDoc { tables: &[CELLS, METRICS, ROUNDS, POLICY, SAMPLES, UPDATES, STEPS, WINRATES], column: "config_id", ty: "u32", unit: "", doc: "Index of the estimator config (after sweeps are expanded) in the run's plan." },
    ColumnDoc { tables: &[CELLS, METRICS, ROUNDS, POLICY, SAMPLES, UPDATES, STEPS, TIMINGS, WINRATES], column: "estimator", ty: "string", unit: "", doc: "The estimator kind (see the estimators reference)." },
    ColumnDoc { tables: &[CELLS, METRICS, POLICY, SAMPLES, UPDATES, PTIMINGS, STEPS, TIMINGS, WINRATES], column: "label", ty: "string", unit: "", doc: "The config's label: what plots and tables group by." },
    ColumnDoc { tables: &[CELLS, METRICS, ROUNDS, POLICY, SAMPLES, UPDATES, STEPS, WINRATES], column: "strategy", ty: "string?", unit: "", doc: "Deployment: the pair-selection strategy; active: the selection rule; null in passive runs." },
    ColumnDoc { tables: &[CELLS, METRICS, ROUNDS, POLICY, SAMPLES, UPDATES, PTIMINGS, STEPS, TIMINGS], column: "seed", ty: "u32", unit: "", doc: "Seed index (0 … seeds − 1); every random stream derives from (master_seed, seed, component)." },
    ColumnDoc { tables: &[METRICS], column: "setting", ty: "string", unit: "", doc: "`passive`, `active` or `deploy`." },
    ColumnDoc { tables: ARMS, column: "policy", ty: "string", unit: "", doc: "Runs with a learning policy: the cell's deployed policy (`best-of-n`, `rloo`, `dpo`, `ppo`, …)." },
    ColumnDoc { tables: &[PTIMINGS], column: "policy", ty: "string", unit: "", doc: "The cell's deployed policy." },
    ColumnDoc { tables: ARMS, column: "reward", ty: "string", unit: "", doc: "Runs with a learning policy: the reward the policy update reads (`learned`, or the controls `oracle` and `null`)." },
    ColumnDoc { tables: ARMS, column: "adapter", ty: "string", unit: "", doc: "Runs with a learning policy: the adapter's life (`persistent`, `fresh-per-chunk`; empty for arms that do not learn)." },
    // cells.parquet
    ColumnDoc { tables: &[CELLS], column: "hparams", ty: "string", unit: "", doc: "The config's hyper-parameters as one JSON object, typed as the spec gives them (numbers as numbers)." },
    ColumnDoc { tables: &[CELLS], column: "hp.*", ty: "varies", unit: "", doc: "One column per hyper-parameter of any config in the run (`hp.lr`, `hp.eta`, …), typed as the spec gives it (numbers as numbers, words as strings); null for a config whose estimator has no such key." },
    ColumnDoc { tables: &[CELLS], column: "curvature", ty: "string", unit: "", doc: "Whose 𝓗_t scored uncertainty (pessimism, UCB, active selection): the estimator's own or a tracker's, with its λ." },
    ColumnDoc { tables: &[CELLS], column: "status", ty: "string", unit: "", doc: "`ok` or `failed`." },
    ColumnDoc { tables: &[CELLS], column: "err", ty: "string?", unit: "", doc: "A failed cell's error in one line (null when ok)." },
    ColumnDoc { tables: &[CELLS], column: "stream_hash", ty: "string?", unit: "", doc: "FNV-1a of the contexts, pairs and label noise the cell drew (hex): equal for every cell of a seed whose data do not depend on the method." },
    // metrics.parquet
    ColumnDoc { tables: &[METRICS, STEPS, TIMINGS], column: "step", ty: "u64", unit: "updates", doc: "Updates so far." },
    ColumnDoc { tables: &[METRICS, STEPS, TIMINGS], column: "samples_seen", ty: "u64", unit: "pairs", doc: "Labelled pairs seen so far." },
    ColumnDoc { tables: &[METRICS], column: "train_loss", ty: "f64", unit: "nats", doc: "Prequential logistic loss (each batch scored before its update), averaged since the previous evaluation point." },
    ColumnDoc { tables: &[METRICS], column: "train_accuracy", ty: "f64", unit: "fraction", doc: "Prequential accuracy, averaged since the previous evaluation point." },
    ColumnDoc { tables: &[METRICS], column: "eval_loss", ty: "f64", unit: "nats", doc: "Held-out logistic loss of θ_t." },
    ColumnDoc { tables: &[METRICS], column: "eval_accuracy", ty: "f64", unit: "fraction", doc: "Held-out accuracy of θ_t, a tie (zᵀθ = 0) counted as ½." },
    ColumnDoc { tables: &[METRICS], column: "eval_ties", ty: "u64", unit: "pairs", doc: "Held-out pairs with zᵀθ = 0 exactly (e.g. both sides the same tokens)." },
    ColumnDoc { tables: &[METRICS], column: "theta_err", ty: "f64?", unit: "", doc: "‖θ_t − θ*‖₂ (null without a known θ*)." },
    ColumnDoc { tables: &[METRICS], column: "theta_err_h", ty: "f64?", unit: "", doc: "‖θ_t − θ*‖ in the 𝓗_t norm (null without a known θ*)." },
    ColumnDoc { tables: &[METRICS], column: "subopt", ty: "f64?", unit: "reward", doc: "SubOpt of the greedy policy of the last iterate (null without a θ*)." },
    ColumnDoc { tables: &[METRICS], column: "subopt_avg", ty: "f64?", unit: "reward", doc: "Active: SubOpt of the greedy policy of the averaged iterate (1/t Σ θ_s)." },
    ColumnDoc { tables: &[METRICS], column: "subopt_pessimistic", ty: "f64?", unit: "reward", doc: "Passive, final row: SubOpt of the pessimistic policy." },
    ColumnDoc { tables: &[METRICS], column: "subopt_pessimistic_ref", ty: "f64?", unit: "reward", doc: "Passive, final row: SubOpt of the pessimistic policy with Zhu et al.'s reference vector (`passive.pessimism_reference`)." },
    ColumnDoc { tables: &[METRICS], column: "regret", ty: "f64?", unit: "reward", doc: "Deployment: cumulative regret Σ r(x, π*) − ½(r(a) + r(a′))." },
    ColumnDoc { tables: &[METRICS], column: "mean_reward", ty: "f64?", unit: "reward", doc: "Deployment: mean of ½(r(a) + r(a′)) over the rounds so far." },
    ColumnDoc { tables: &[METRICS], column: "kappa", ty: "f64", unit: "", doc: "max 1/σ′(zᵀθ_t) over the samples since the previous row: the paper's κ on the data seen." },
    ColumnDoc { tables: &[METRICS], column: "kappa_reference", ty: "f64", unit: "", doc: "Mean over those batches of the authors' 1/(min σ′ + 1e-3)." },
    ColumnDoc { tables: &[METRICS], column: "ties", ty: "u64", unit: "", doc: "Selection ties broken by a seeded draw so far." },
    ColumnDoc { tables: &[METRICS], column: "grad_evals", ty: "u64", unit: "", doc: "Gradient evaluations so far." },
    ColumnDoc { tables: &[METRICS], column: "hvp_evals", ty: "u64", unit: "", doc: "Hessian–vector products so far." },
    ColumnDoc { tables: &[METRICS], column: "negative_quad_forms", ty: "u64", unit: "", doc: "Quadratic forms xᵀ𝓗⁻¹x that came out negative and were taken as 0 (rounding drift of a maintained inverse); 0 in a healthy run." },
    ColumnDoc { tables: &[METRICS], column: "flops", ty: "u64", unit: "FLOPs", doc: "Floating-point operations of the estimator's updates so far (counted from the shapes)." },
    ColumnDoc { tables: &[METRICS], column: "converged", ty: "bool", unit: "", doc: "mle: every re-fit so far reached its tolerance (true for the other estimators)." },
    ColumnDoc { tables: &[METRICS], column: "estimator_bytes", ty: "u64?", unit: "bytes", doc: "Bytes of state the estimator holds at this point (parameters, matrices, Adam moments, the labels a re-fit keeps): flat in t for one-pass estimators, growing for mle; summed over heads with stream.ranks > 1; null for a reward model whose features learn." },
    ColumnDoc { tables: &[METRICS], column: "chunk", ty: "u64?", unit: "", doc: "Chunked deployment: the chunk (1-based)." },
    ColumnDoc { tables: &[METRICS], column: "pair_reward", ty: "f64?", unit: "reward", doc: "Chunked deployment: the chunk's mean of r(a) + r(a′) over its prompts (the authors' number)." },
    ColumnDoc { tables: &[METRICS], column: "cum_pair_reward", ty: "f64?", unit: "reward", doc: "Chunked deployment: the running sum of pair_reward over chunks." },
    ColumnDoc { tables: &[METRICS], column: "policy_reward", ty: "f64?", unit: "reward", doc: "Chunked deployment: mean oracle reward of the deployed response (best-of-n under θ at the chunk's start, or the fixed first sample)." },
    ColumnDoc { tables: &[METRICS], column: "kendall_tau", ty: "f64?", unit: "", doc: "Chunked deployment: mean Kendall τ_b between the learned and the oracle ranking of each prompt's samples." },
    ColumnDoc { tables: &[METRICS], column: "oracle_ties", ty: "u64?", unit: "", doc: "Chunked deployment: label ties of the argmax oracle so far." },
    ColumnDoc { tables: &[METRICS], column: "flipped_labels", ty: "u64?", unit: "labels", doc: "`[oracle] flip` > 0 (the column is absent otherwise): the labels the noisy labeller has flipped so far, of the labels given to the learner (held-out labels are never flipped)." },
    // rounds.parquet
    ColumnDoc { tables: &[ROUNDS, UPDATES, PTIMINGS, POLICY, SAMPLES], column: "chunk", ty: "u64", unit: "", doc: "The chunk (policy tables: 0 is the evaluation before any update)." },
    ColumnDoc { tables: &[ROUNDS], column: "prompt", ty: "u64", unit: "", doc: "Index of the prompt in the prompt file (as in generations.parquet)." },
    ColumnDoc { tables: &[ROUNDS], column: "first", ty: "u32", unit: "", doc: "The first response the strategy picked (its index among the prompt's samples)." },
    ColumnDoc { tables: &[ROUNDS], column: "second", ty: "u32", unit: "", doc: "The second response picked." },
    ColumnDoc { tables: &[ROUNDS], column: "reward_first", ty: "f64", unit: "reward", doc: "The oracle's reward of the first response." },
    ColumnDoc { tables: &[ROUNDS], column: "reward_second", ty: "f64", unit: "reward", doc: "The oracle's reward of the second response." },
    ColumnDoc { tables: &[ROUNDS], column: "label", ty: "f64", unit: "", doc: "The label: 1 when the first response is preferred, 0 when the second (½ for a tie where the oracle allows it)." },
    ColumnDoc { tables: &[ROUNDS], column: "policy_pick", ty: "u32", unit: "", doc: "The response the deployed policy picks (best under θ at the chunk's start)." },
    ColumnDoc { tables: &[ROUNDS], column: "policy_reward", ty: "f64", unit: "reward", doc: "The oracle's reward of the policy's pick." },
    ColumnDoc { tables: &[ROUNDS], column: "best_reward", ty: "f64", unit: "reward", doc: "max over the prompt's samples of the oracle's reward." },
    ColumnDoc { tables: &[ROUNDS], column: "kendall_tau", ty: "f64", unit: "", doc: "Kendall τ_b between the learned and the oracle ranking of the prompt's samples." },
    // winrates.parquet
    ColumnDoc { tables: &[WINRATES], column: "chunk_win_rate", ty: "f64", unit: "fraction", doc: "Share of (chunk, seed, other config) comparisons this config's pair reward wins (ties ½)." },
    ColumnDoc { tables: &[WINRATES], column: "prompt_win_rate", ty: "f64", unit: "fraction", doc: "The same per prompt." },
    ColumnDoc { tables: &[WINRATES], column: "chunks_compared", ty: "u64", unit: "", doc: "Comparisons behind chunk_win_rate." },
    ColumnDoc { tables: &[WINRATES], column: "prompts_compared", ty: "u64", unit: "", doc: "Comparisons behind prompt_win_rate." },
    // policy.parquet
    ColumnDoc { tables: &[POLICY], column: "policy_reward", ty: "f64", unit: "reward", doc: "Mean oracle reward of what the arm deploys on the held-out prompts: a learning policy's samples, best-of-n the best of each group of n under θ_t. Compare arms on this column." },
    ColumnDoc { tables: &[POLICY], column: "sample_reward", ty: "f64", unit: "reward", doc: "Mean oracle reward of the policy's own samples." },
    ColumnDoc { tables: &[POLICY], column: "bon_reward", ty: "f64", unit: "reward", doc: "Best-of-n of the policy's samples under θ_t (n = generate.n): mean oracle reward of the sample θ_t ranks first in each group." },
    ColumnDoc { tables: &[POLICY], column: "learned_reward", ty: "f64", unit: "reward", doc: "Mean learned reward φᵀθ_t of the policy's samples." },
    ColumnDoc { tables: &[POLICY], column: "kl", ty: "f64", unit: "nats", doc: "Mean over samples of the sequence KL to the KL penalty's reference (policy.kl_estimator; 0 for a policy that does not learn). With policy.kl_reference = \"chunk-start\" the reference is the policy after the last update, so this is 0: read kl_initial." },
    ColumnDoc { tables: &[POLICY], column: "kl_initial", ty: "f64", unit: "nats", doc: "Mean over samples of the sequence KL to the initial policy (policy.kl_estimator), whatever policy.kl_reference: equal to kl with \"initial\"; 0 for a policy that does not learn." },
    ColumnDoc { tables: &[POLICY], column: "entropy", ty: "f64?", unit: "nats/token", doc: "−mean log π(y_t) over the sampled tokens (null for a policy that does not learn)." },
    ColumnDoc { tables: &[POLICY], column: "response_tokens", ty: "f64", unit: "tokens", doc: "Mean response length." },
    ColumnDoc { tables: &[POLICY], column: "cut_fraction", ty: "f64", unit: "fraction", doc: "Samples cut at max_new_tokens." },
    ColumnDoc { tables: &[POLICY], column: "merge_error", ty: "f64", unit: "", doc: "‖W_gen − (W + (α/r)BA)‖_F / ‖(α/r)BA‖_F over the adapted layers: the generating weights against the trained policy (0 when exact or unmoved). With policy.dtype = \"bf16\" the sampler keeps the adapters unmerged: the same for its update, B'A with B' = (α/r)·B rounded to f32, against (α/r)BA." },
    ColumnDoc { tables: &[POLICY], column: "policy_digest", ty: "string", unit: "", doc: "blake3 of the adapters that generated the samples (`base` for an arm that does not learn)." },
    ColumnDoc { tables: &[POLICY], column: "served_as", ty: "string", unit: "", doc: "`generate.backend = \"openai\"`: the model name the samples were requested under; empty for onepass's sampler." },
    // policy_samples.parquet
    ColumnDoc { tables: &[SAMPLES], column: "prompt", ty: "u64", unit: "", doc: "The held-out prompt (0-based, in the order of the prompts after generate.rows: the same prompt for every seed and arm)." },
    ColumnDoc { tables: &[SAMPLES], column: "sample", ty: "u32", unit: "", doc: "The sample's index among the prompt's policy.eval_samples." },
    ColumnDoc { tables: &[SAMPLES], column: "oracle_reward", ty: "f64", unit: "reward", doc: "The oracle's reward of the sample." },
    ColumnDoc { tables: &[SAMPLES], column: "learned_reward", ty: "f64", unit: "reward", doc: "φᵀθ_t of the sample." },
    ColumnDoc { tables: &[SAMPLES], column: "deployed", ty: "bool", unit: "", doc: "Whether the arm deploys the sample (every sample of a policy that deploys what it draws; best-of-n the one θ_t ranks first in its group of n): the prompt's policy_reward is the mean oracle_reward of its deployed samples." },
    ColumnDoc { tables: &[SAMPLES], column: "tokens", ty: "u64", unit: "tokens", doc: "The sample's length." },
    ColumnDoc { tables: &[SAMPLES], column: "kl", ty: "f64?", unit: "nats", doc: "The sample's sequence KL to the KL penalty's reference (policy.kl_estimator; null for a policy that does not learn)." },
    ColumnDoc { tables: &[SAMPLES], column: "kl_initial", ty: "f64?", unit: "nats", doc: "The same to the initial policy." },
    ColumnDoc { tables: &[SAMPLES], column: "logprob", ty: "f64?", unit: "nats", doc: "Σ log π of the sample's tokens under the evaluated policy (null for a policy that does not learn)." },
    // policy_updates.parquet
    ColumnDoc { tables: &[UPDATES], column: "rollout_oracle_reward", ty: "f64", unit: "reward", doc: "Mean oracle reward of the chunk's training samples." },
    ColumnDoc { tables: &[UPDATES], column: "rollout_learned_reward", ty: "f64", unit: "reward", doc: "Mean learned reward φᵀθ_t of the chunk's samples, after θ's update on the chunk." },
    ColumnDoc { tables: &[UPDATES], column: "update_reward", ty: "f64", unit: "reward", doc: "Mean reward the update read (policy.reward: learned, oracle or null) before normalisation; dpo: the mean implicit reward margin." },
    ColumnDoc { tables: &[UPDATES], column: "update_loss", ty: "f64", unit: "", doc: "Mean loss of the update's steps." },
    ColumnDoc { tables: &[UPDATES], column: "update_grad_norm", ty: "f64", unit: "", doc: "Mean ‖g‖ before clipping over the update's steps." },
    ColumnDoc { tables: &[UPDATES], column: "update_steps", ty: "u64", unit: "", doc: "Optimiser steps of the update." },
    ColumnDoc { tables: &[UPDATES], column: "kl", ty: "f64", unit: "nats", doc: "Mean sequence KL to the penalty's reference on the chunk's samples, before the update." },
    ColumnDoc { tables: &[UPDATES], column: "entropy", ty: "f64", unit: "nats/token", doc: "Mean entropy on the chunk's samples, before the update." },
    ColumnDoc { tables: &[UPDATES], column: "pairs", ty: "u64", unit: "", doc: "dpo: the labelled pairs it learned from." },
    ColumnDoc { tables: &[UPDATES], column: "dropped_pairs", ty: "u64", unit: "", doc: "dpo: pairs dropped (an argmax tie or two identical responses: no preference)." },
    ColumnDoc { tables: &[UPDATES], column: "critic_loss", ty: "f64?", unit: "", doc: "ppo: the critic's mean loss over the update (null for other arms)." },
    ColumnDoc { tables: &[UPDATES], column: "critic_grad_norm", ty: "f64?", unit: "", doc: "ppo: the critic's mean ‖g‖." },
    ColumnDoc { tables: &[UPDATES], column: "value_mean", ty: "f64?", unit: "reward", doc: "ppo: mean value over the chunk's tokens before the update." },
    ColumnDoc { tables: &[UPDATES], column: "return_mean", ty: "f64?", unit: "reward", doc: "ppo: mean return over the chunk's tokens before the update." },
    ColumnDoc { tables: &[UPDATES], column: "rollout_digest", ty: "string", unit: "", doc: "blake3 of the adapters that generated the chunk's samples." },
    ColumnDoc { tables: &[UPDATES], column: "updated_digest", ty: "string", unit: "", doc: "blake3 of the adapters after the chunk's update." },
    ColumnDoc { tables: &[UPDATES], column: "rollout_served_as", ty: "string", unit: "", doc: "The model name the chunk's samples were requested under on a server (empty for onepass's sampler)." },
    // policy_timings.parquet
    ColumnDoc { tables: &[PTIMINGS], column: "generation_s", ty: "f64", unit: "s", doc: "Sampling the chunk's training prompts." },
    ColumnDoc { tables: &[PTIMINGS], column: "phi_s", ty: "f64", unit: "s", doc: "φ of the chunk's samples." },
    ColumnDoc { tables: &[PTIMINGS, TIMINGS], column: "estimator_s", ty: "f64", unit: "s", doc: "Inside the reward model's update (timings.parquet: inside `Estimator::update` in the bucket)." },
    ColumnDoc { tables: &[PTIMINGS], column: "policy_s", ty: "f64", unit: "s", doc: "The policy's update." },
    ColumnDoc { tables: &[PTIMINGS], column: "critic_s", ty: "f64", unit: "s", doc: "ppo: the critic's share, apart from policy_s (0 for other arms)." },
    ColumnDoc { tables: &[PTIMINGS], column: "eval_s", ty: "f64", unit: "s", doc: "The held-out evaluation." },
    ColumnDoc { tables: &[PTIMINGS], column: "eval_generation_s", ty: "f64", unit: "s", doc: "Part of eval_s: sampling the held-out prompts." },
    ColumnDoc { tables: &[PTIMINGS], column: "eval_phi_s", ty: "f64", unit: "s", doc: "Part of eval_s: φ and the oracle of those samples." },
    ColumnDoc { tables: &[PTIMINGS], column: "eval_score_s", ty: "f64", unit: "s", doc: "Part of eval_s: the policy's log-probabilities and KL." },
    // generations.parquet
    ColumnDoc { tables: &[GENERATIONS], column: "prompt", ty: "u64", unit: "", doc: "Index of the prompt in the prompt file." },
    ColumnDoc { tables: &[GENERATIONS], column: "prompt_text", ty: "string", unit: "", doc: "The prompt's last user message." },
    ColumnDoc { tables: &[GENERATIONS], column: "sample", ty: "u32", unit: "", doc: "The response's index among the prompt's samples." },
    ColumnDoc { tables: &[GENERATIONS], column: "response", ty: "string", unit: "", doc: "The response text." },
    ColumnDoc { tables: &[GENERATIONS], column: "tokens", ty: "u64", unit: "tokens", doc: "The response's length." },
    ColumnDoc { tables: &[GENERATIONS], column: "stopped", ty: "bool", unit: "", doc: "Whether it ended with a stop token (false: cut at max_new_tokens)." },
    ColumnDoc { tables: &[GENERATIONS], column: "oracle_reward", ty: "f64", unit: "reward", doc: "The oracle's reward of the response." },
    // steps.parquet
    ColumnDoc { tables: &[STEPS], column: "loss", ty: "f64", unit: "nats", doc: "The batch's loss before the update." },
    ColumnDoc { tables: &[STEPS], column: "accuracy", ty: "f64", unit: "fraction", doc: "The batch's accuracy before the update." },
    ColumnDoc { tables: &[STEPS], column: "grad_norm", ty: "f64", unit: "", doc: "‖g‖ of the batch's gradient." },
    ColumnDoc { tables: &[STEPS], column: "step_norm", ty: "f64", unit: "", doc: "‖θ_{t+1} − θ_t‖." },
    ColumnDoc { tables: &[STEPS], column: "clip_factor", ty: "f64", unit: "", doc: "The factor clipping scaled the gradient by (1: not clipped)." },
    ColumnDoc { tables: &[STEPS], column: "cos_step_grad", ty: "f64", unit: "", doc: "cos∠(step, −g): how far the step turns from steepest descent." },
    ColumnDoc { tables: &[STEPS], column: "damping", ty: "f64", unit: "", doc: "The damping λ_t the update used (CG estimators)." },
    ColumnDoc { tables: &[STEPS], column: "inner_iters", ty: "u32", unit: "", doc: "Inner iterations (CG steps, re-fit iterations)." },
    // timings.parquet
    ColumnDoc { tables: &[TIMINGS], column: "other_s", ty: "f64", unit: "s", doc: "Everything else in the bucket: drawing data, selection, the curvature tracker, evaluation." },
    ColumnDoc { tables: &[TIMINGS], column: "cell_wall_s", ty: "f64", unit: "s", doc: "The cell's wall time (repeated on each of its rows)." },
    ColumnDoc { tables: &[TIMINGS], column: "cell_estimator_s", ty: "f64", unit: "s", doc: "The cell's time inside `Estimator::update` (repeated on each of its rows)." },
];

/// The doc of `column` in `table`; a doc whose name ends in `*` covers every column with that
/// prefix (the hyper-parameters' `hp.<key>`).
pub fn column_doc(table: &str, column: &str) -> Option<&'static ColumnDoc> {
    let matches = |c: &ColumnDoc| match c.column.strip_suffix('*') {
        Some(prefix) => column.starts_with(prefix),
        None => c.column == column,
    };
    COLUMNS.iter().find(|c| matches(c) && c.tables.contains(&table))
}

/// The columns of `table` in the reference's order: (name, type).
pub fn columns_of(table: &str) -> Vec<(&'static str, &'static str)> {
    COLUMNS.iter().filter(|c| c.tables.contains(&table)).map(|c| (c.column, c.ty)).collect()
}

/// The reference's type of an arrow type as schema.json writes it (`Utf8`, `UInt32`, …).
pub fn type_word(arrow: &str, nullable: bool) -> String {
    let base = match arrow {
        "Utf8" | "LargeUtf8" | "Utf8View" => "string",
        "UInt32" => "u32",
        "UInt64" => "u64",
        "Int64" => "i64",
        "Float64" => "f64",
        "Boolean" => "bool",
        other => other,
    };
    if nullable {
        format!("{base}?")
    } else {
        base.to_string()
    }
}

/// What a run's schema.json (table → [[column, type, nullable]]) holds that [`COLUMNS`] does
/// not document, or documents with another type: one line each, empty when all is documented.
/// A non-null column documented as nullable is fine (the type says it *may* be null).
pub fn undocumented(schema_json: &str) -> Result<Vec<String>, String> {
    let v: serde_json::Value = serde_json::from_str(schema_json).map_err(|e| format!("schema.json: {e}"))?;
    let tables = v.as_object().ok_or("schema.json: expected an object of tables")?;
    let mut out = Vec::new();
    for (table, cols) in tables {
        if !TABLES.iter().any(|t| t.file == table) {
            out.push(format!("{table}: a table with no doc in columns::TABLES"));
        }
        for c in cols.as_array().into_iter().flatten() {
            let (Some(name), Some(ty)) = (c[0].as_str(), c[1].as_str()) else {
                return Err(format!("schema.json: {table}: expected [column, type, nullable], got {c}"));
            };
            let nullable = c[2].as_bool().unwrap_or(false);
            let word = type_word(ty, nullable);
            match column_doc(table, name) {
                None => out.push(format!("{table}:{name} ({word}): no doc in columns::COLUMNS")),
                Some(d) if d.ty != "varies" && d.ty != word && d.ty.trim_end_matches('?') != word => {
                    out.push(format!("{table}:{name}: written as {word}, documented as {}", d.ty))
                }
                Some(_) => {}
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rows::{self, Col};

    /// The tables keyed by (cell_id, label, seed).
    const KEYED: &[&str] = &[CELLS, METRICS, POLICY, UPDATES, PTIMINGS, STEPS, TIMINGS];

    fn ty<R>(c: &Col<R>) -> &'static str {
        match c {
            Col::U32(..) => "u32",
            Col::U64(..) => "u64",
            Col::OptU64(..) => "u64?",
            Col::F64(..) => "f64",
            Col::OptF64(..) => "f64?",
            Col::Bool(..) => "bool",
            Col::Str(..) => "string",
            Col::OptStr(..) => "string?",
        }
    }

    fn check<R>(table: &str, cols: &[Col<R>], bad: &mut Vec<String>) {
        for c in cols {
            match column_doc(table, c.name()) {
                None => bad.push(format!("{table}:{}: no doc", c.name())),
                Some(d) if d.ty != ty(c) => bad.push(format!("{table}:{}: {} vs {}", c.name(), d.ty, ty(c))),
                Some(_) => {}
            }
        }
    }

    /// Every column of rows.rs's lists has a doc of its type in the table it is written to;
    /// every table has a doc; no column is documented twice for one table.
    #[test]
    fn every_listed_column_is_documented_with_its_type() {
        let mut bad = Vec::new();
        check(METRICS, rows::METRICS, &mut bad);
        check(METRICS, rows::METRICS_CHUNKED, &mut bad);
        check(ROUNDS, rows::ROUNDS, &mut bad);
        check(POLICY, rows::POLICY, &mut bad);
        check(POLICY, rows::POLICY_DIGEST, &mut bad);
        check(UPDATES, rows::POLICY_UPDATES, &mut bad);
        check(PTIMINGS, rows::POLICY_TIMINGS, &mut bad);
        check(STEPS, rows::STEPS, &mut bad);
        check(TIMINGS, rows::BUCKETS, &mut bad);
        check(TIMINGS, rows::CELL_TOTALS, &mut bad);
        check(CELLS, rows::CELL_STATUS, &mut bad);
        check(WINRATES, rows::WINRATES, &mut bad);
        for t in KEYED {
            check(t, rows::KEY, &mut bad);
        }
        for t in TABLES {
            let cols = columns_of(t.file);
            let mut names: Vec<_> = cols.iter().map(|c| c.0).collect();
            names.sort();
            let n = names.len();
            names.dedup();
            if names.len() != n {
                bad.push(format!("{}: a column documented twice", t.file));
            }
        }
        assert!(bad.is_empty(), "{bad:#?}");
    }

    /// The negative control: a column the code writes without a doc, or of another type, is
    /// named; a documented schema passes.
    #[test]
    fn undocumented_names_the_column() {
        let ok = r#"{"metrics.parquet": [["eval_loss", "Float64", false], ["chunk", "UInt64", true]]}"#;
        assert_eq!(undocumented(ok).unwrap(), Vec::<String>::new());
        let bad = r#"{"metrics.parquet": [["eval_losss", "Float64", false], ["eval_loss", "Utf8", false]], "new.parquet": []}"#;
        let got = undocumented(bad).unwrap();
        assert_eq!(got.len(), 3, "{got:?}");
        assert!(got[0].contains("new.parquet") || got.iter().any(|g| g.contains("new.parquet")));
        assert!(got.iter().any(|g| g.contains("eval_losss")));
        assert!(got.iter().any(|g| g.contains("written as string")));
    }
}
