//! The tables of `env.kind = "generated"`: `[generate]` (prompts, policy, sampling),
//! `[features]` (the learner's φ) and `[oracle]` (what scores and labels the responses).

use super::data::expand_env;
use super::phi::{d_batch, d_device, d_dtype};
use super::phi::{DType, Device, PhiSpec};
use features::sampling::SampleOptions;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// How an oracle turns a reward difference m = r(a) − r(a′) into a label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum LabelRule {
    /// y ~ Bernoulli(σ(m)) (the paper's model).
    BradleyTerry,
    /// y = [m > 0], a tie broken by the uniform draw (the authors' pipeline: the RM's argmax).
    Argmax,
}

/// The `[generate]` table: prompts, policy and sampling.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GenerateSpec {
    /// Prompts: a .jsonl(.gz) or .parquet file, a `*` pattern, or `hf:datasets/<o>/<n>[@rev]:<file>`.
    pub prompts: String,
    /// The column or key holding each prompt (a string or a list of messages).
    #[serde(default = "d_prompt_key")]
    pub prompt_key: String,
    /// The first `rows` prompts (default: all).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rows: Option<usize>,
    /// The policy: a .gguf file, a model directory or hf:<owner>/<name>.
    pub policy: String,
    /// Responses sampled per prompt (the arms a strategy picks two from).
    #[serde(default = "d_n")]
    pub n: usize,
    /// Sampling temperature (0: greedy).
    #[serde(default = "d_one")]
    pub temperature: f64,
    /// Nucleus sampling: the smallest set of tokens whose probability reaches top_p (1: off).
    #[serde(default = "d_one")]
    pub top_p: f64,
    /// Tokens per response at most (a response cut here is counted in cut_fraction); with
    /// max_prompt_tokens at most 131,072 (the rotary table's positions).
    #[serde(default = "d_max_new")]
    pub max_new_tokens: usize,
    /// Seed of the sampling streams (one per prompt × sample; the same for every run seed, so
    /// all cells and seeds see the same responses).
    #[serde(default)]
    pub seed: u64,
    /// Prompts per generation batch (× n rows).
    #[serde(default = "d_batch_prompts")]
    pub batch_prompts: usize,
    /// Prompts longer than this (templated tokens) are an error naming the row; with
    /// max_new_tokens at most 131,072 (the rotary table's positions).
    #[serde(default = "d_max_prompt")]
    pub max_prompt_tokens: usize,
    #[serde(default = "d_dtype")]
    pub dtype: DType,
    #[serde(default = "d_device")]
    pub device: Device,
    /// The generation cache: a bank of samples is generated once per (policy, its dtype,
    /// prompts, sampling options) and read back after.
    #[serde(default = "d_gen_cache")]
    pub cache: PathBuf,
    /// Where the samples come from: onepass's own sampler, or an OpenAI-compatible server
    /// (vLLM) that serves `policy` as `server_model` at `base_url`. `policy` is still read for
    /// its tokenizer and chat template: the prompts go to the server as token ids.
    #[serde(default)]
    pub backend: GenBackend,
    /// backend = "openai": the server, e.g. `http://localhost:8000`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_url: Option<String>,
    /// backend = "openai": the name the server serves the policy under.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_model: Option<String>,
    /// backend = "openai": requests in flight at once, seconds per request, retries of a
    /// transient failure.
    #[serde(default = "d_concurrency")]
    pub concurrency: usize,
    /// backend = "openai": seconds one request may take — connecting (at most 10 s of it),
    /// sending, the whole answer read — before it is retried; the start's `GET /v1/models`
    /// takes at most 10 s. A request waiting 15 s (or half of this) prints one line saying
    /// what it waits for.
    #[serde(default = "d_timeout_s")]
    pub timeout_s: f64,
    /// backend = "openai": retries of a transient failure (a timeout, a refused connection, a 5xx)
    /// before the run stops.
    #[serde(default = "d_retries")]
    pub retries: u32,
}

/// Where generated samples come from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum GenBackend {
    /// onepass's sampler on the policy's weights (candle).
    #[default]
    Candle,
    /// An OpenAI-compatible completions server (vLLM's `/v1/completions`).
    Openai,
}

fn d_concurrency() -> usize {
    8
}
fn d_timeout_s() -> f64 {
    600.0
}
fn d_retries() -> u32 {
    3
}

super::phi::phi_table! {
    /// The `[features]` table: the learner's φ over (prompt, response).
    #[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
    #[serde(deny_unknown_fields)]
    pub struct FeatureSpec {}
    cache = "d_feat_cache"
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum OracleKind {
    /// θ* over the learner's φ from `seed` (realizable Bradley–Terry, the paper's Assumption 1),
    /// scaled to `reward_std` or to ‖θ*‖ = `norm`.
    Linear,
    /// A head over the learner's φ read from `path` (`score.weight` [1, d]), e.g. a teacher
    /// trained by onepass (`report/heads/<config>.safetensors`).
    Head,
    /// A sequence-classifier reward model (`model`: its backbone and trained `score` head, e.g.
    /// NCSOFT/Llama-3-OffsetBias-RM-8B), read at the last token of its own chat template.
    RewardModel,
}

/// The `[oracle]` table.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct OracleSpec {
    /// The oracle that scores responses: "linear" (a random θ* on the learner's φ), "head" (a
    /// trained score head on φ, from `path`) or "reward-model" (a sequence-classifier checkpoint,
    /// `model`).
    pub kind: OracleKind,
    /// linear: the direction's seed.
    #[serde(default)]
    pub seed: u64,
    /// linear: scale θ* so the rewards of one prompt's samples have this standard deviation
    /// (pooled over prompts; default 1 unless `norm` is given).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reward_std: Option<f64>,
    /// linear: ‖θ*‖ = norm instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub norm: Option<f64>,
    /// head: the safetensors file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// reward-model: the checkpoint (a directory or hf:<owner>/<name>).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// reward-model: tokens per scored conversation.
    #[serde(default = "d_rm_max_len")]
    pub max_len: usize,
    /// reward-model: the checkpoint's dtype.
    #[serde(default = "d_dtype")]
    pub dtype: DType,
    /// reward-model: where it runs.
    #[serde(default = "d_device")]
    pub device: Device,
    /// reward-model: conversations per forward pass.
    #[serde(default = "d_batch")]
    pub batch: usize,
    /// Bradley–Terry labels (the paper's model) or the oracle's argmax (the authors' pipeline).
    #[serde(default = "d_labels")]
    pub labels: LabelRule,
    /// A noisy labeller (0 ≤ flip < 0.5): each label the oracle gives a learner is flipped with
    /// this probability, independently, from a stream of its own per label (named by `seed`,
    /// the run's and cell's seeds and the label's index in the cell, so a resumed run or a
    /// slice flips the same labels). Held-out pairs, rewards, regret and every score keep the
    /// oracle's noiseless preference. metrics.parquet's `flipped_labels` counts the flips
    /// (written only when flip > 0). oat's `preference_flip_prob`. Default 0: every label as the
    /// oracle gives it (and the spec's bytes as without the key).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub flip: f64,
}

fn is_zero(v: &f64) -> bool {
    *v == 0.0
}

fn d_prompt_key() -> String {
    "prompt".into()
}
fn d_n() -> usize {
    8
}
fn d_one() -> f64 {
    1.0
}
fn d_max_new() -> usize {
    64
}
fn d_batch_prompts() -> usize {
    8
}
fn d_max_prompt() -> usize {
    512
}
fn d_gen_cache() -> PathBuf {
    PathBuf::from(".cache/generations")
}
fn d_feat_cache() -> PathBuf {
    PathBuf::from(".cache/features")
}
fn d_rm_max_len() -> usize {
    2048
}
fn d_labels() -> LabelRule {
    LabelRule::BradleyTerry
}

impl GenerateSpec {
    /// Checks that need no file: (key, message).
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        if self.n < 2 {
            return Err(("n", format!("{}: a pair needs at least 2 responses per prompt", self.n)));
        }
        if self.max_new_tokens == 0 {
            return Err(("max_new_tokens", "expected at least 1".into()));
        }
        // the policy is loaded for prompt + response positions (its rotary table): past the
        // most a model is loaded for, the load would be refused after the data was read
        let most = features::model::MAX_POSITIONS;
        if self.max_prompt_tokens.saturating_add(self.max_new_tokens) > most {
            let (key, v) = match self.max_new_tokens > self.max_prompt_tokens {
                true => ("max_new_tokens", self.max_new_tokens),
                false => ("max_prompt_tokens", self.max_prompt_tokens),
            };
            return Err((
                key,
                format!(
                    "{v}: generate.max_prompt_tokens + generate.max_new_tokens is {}, expected at most {most} tokens",
                    self.max_prompt_tokens.saturating_add(self.max_new_tokens)
                ),
            ));
        }
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(("temperature", format!("{}: expected a finite number ≥ 0", self.temperature)));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(("top_p", format!("{}: expected 0 < top_p ≤ 1", self.top_p)));
        }
        if self.rows == Some(0) {
            return Err(("rows", "expected at least 1 prompt".into()));
        }
        if self.batch_prompts == 0 {
            return Err(("batch_prompts", "expected at least 1".into()));
        }
        if self.max_prompt_tokens == 0 {
            return Err(("max_prompt_tokens", "expected at least 1".into()));
        }
        expand_env(&self.prompts).map_err(|m| ("prompts", m))?;
        self.server().map(|_| ())
    }

    /// backend = "openai": the server (None for candle); its keys checked.
    pub fn server(&self) -> Result<Option<features::openai::Server>, (&'static str, String)> {
        let openai = "belongs to backend = \"openai\"";
        match self.backend {
            GenBackend::Candle => {
                if self.base_url.is_some() {
                    return Err(("base_url", openai.into()));
                }
                if self.server_model.is_some() {
                    return Err(("server_model", openai.into()));
                }
                Ok(None)
            }
            GenBackend::Openai => {
                let base_url = expand_env(self.base_url.as_deref().ok_or((
                    "base_url",
                    "backend = \"openai\" needs the server's URL, e.g. \"http://localhost:8000\"".to_string(),
                ))?)
                .map_err(|m| ("base_url", m))?;
                if !(base_url.starts_with("http://") || base_url.starts_with("https://")) {
                    return Err(("base_url", format!("`{base_url}`: expected an http:// or https:// URL")));
                }
                let model = self.server_model.clone().ok_or((
                    "server_model",
                    "backend = \"openai\" needs the name the server serves the policy under".to_string(),
                ))?;
                if self.concurrency == 0 {
                    return Err(("concurrency", "expected at least 1".into()));
                }
                if !(self.timeout_s.is_finite() && self.timeout_s > 0.0) {
                    return Err(("timeout_s", format!("{}: expected seconds > 0", self.timeout_s)));
                }
                Ok(Some(features::openai::Server {
                    base_url,
                    model,
                    concurrency: self.concurrency,
                    timeout_s: self.timeout_s,
                    retries: self.retries,
                }))
            }
        }
    }

    pub fn sample_options(&self) -> SampleOptions {
        SampleOptions {
            n: self.n,
            temperature: self.temperature,
            top_p: self.top_p,
            max_new_tokens: self.max_new_tokens,
            seed: self.seed,
        }
    }
}

impl FeatureSpec {
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        self.phi().check()
    }
}

impl OracleSpec {
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        if !(self.flip.is_finite() && (0.0..0.5).contains(&self.flip)) {
            return Err((
                "flip",
                format!("{}: expected a probability 0 ≤ flip < 0.5 (at 0.5 a label carries no preference)", self.flip),
            ));
        }
        let pos = |v: Option<f64>| v.is_none_or(|x| x.is_finite() && x > 0.0);
        if !pos(self.reward_std) {
            return Err(("reward_std", format!("{:?}: expected a finite number > 0", self.reward_std)));
        }
        if !pos(self.norm) {
            return Err(("norm", format!("{:?}: expected a finite number > 0", self.norm)));
        }
        match self.kind {
            OracleKind::Linear if self.reward_std.is_some() && self.norm.is_some() => {
                return Err(("norm", "give reward_std or norm, not both".into()))
            }
            OracleKind::Linear if self.path.is_some() || self.model.is_some() => {
                return Err((
                    "kind",
                    "a linear oracle is drawn from `seed`: `path` and `model` belong to kinds head and reward-model"
                        .into(),
                ))
            }
            OracleKind::Head if self.path.is_none() => {
                return Err(("path", "kind = \"head\" needs the safetensors file with `score.weight`".into()))
            }
            OracleKind::RewardModel if self.model.is_none() => {
                return Err((
                    "model",
                    "kind = \"reward-model\" needs the checkpoint (a directory or hf:<owner>/<name>)".into(),
                ))
            }
            OracleKind::Head | OracleKind::RewardModel if self.reward_std.is_some() || self.norm.is_some() => {
                return Err(("reward_std", "only a linear oracle is rescaled; a trained head keeps its scale".into()))
            }
            _ => {}
        }
        Ok(())
    }

    /// A reward model's φ: its own chat template read at the last token (no EOS rule), through
    /// the feature cache `cache`; `model` already expanded.
    pub fn phi(&self, model: String, cache: PathBuf) -> PhiSpec {
        PhiSpec {
            model,
            max_len: self.max_len,
            eos_rule: features::EosRule::Plain,
            truncation: features::Truncation::PromptFirst,
            layer: -1,
            pool: features::Pool::Last,
            dtype: self.dtype,
            device: self.device,
            batch: self.batch,
            cache,
        }
    }
}
