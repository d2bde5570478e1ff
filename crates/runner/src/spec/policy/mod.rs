//! The `[policy]` table: how a deployed policy that learns (`deploy.policy = "rloo"` or
//! `"dpo"`) updates after each chunk (paper §6: each chunk's pairs update the reward model,
//! then the policy), and how it is evaluated.

use super::Sweep;
use policy::train::KlEstimator;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

mod dpo;
mod grpo;
mod ppo;
mod reinforce_pp;
mod rloo;
mod shared;
pub use dpo::{DpoPairs, DpoParameters, DpoSpec, WarmStart};
pub use grpo::GrpoSpec;
pub use ppo::{CriticHead, PpoSpec};
pub use reinforce_pp::ReinforcePpSpec;
pub use rloo::RlooSpec;
use shared::{d_epochs, d_lr, d_one};
pub use shared::{RewardNormKind, RewardSource};

/// The learning-rate schedule of the policy's Adam.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum LrScheduleKind {
    /// lr at every step.
    Constant,
    /// transformers' `cosine_with_min_lr` (OpenRLHF's actor and critic): linear warm-up over
    /// ⌈warmup_ratio·steps⌉ steps from 0, then a cosine down to min_lr_ratio·lr.
    CosineWithMinLr,
}

/// Which steps the learning-rate schedule spans.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum LrRestart {
    /// Each chunk's update (the authors' loop builds a new optimiser per chunk).
    Chunk,
    /// The whole run's updates.
    Run,
}

/// An adapter's life across chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum AdapterLife {
    /// One adapter and one Adam state over the whole run.
    Persistent,
    /// The authors' loop: after each chunk's update the adapter is merged into the policy's
    /// f32 weights, and the next chunk trains a fresh adapter (A redrawn, B = 0) with a fresh
    /// Adam state.
    FreshPerChunk,
}

impl std::fmt::Display for AdapterLife {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AdapterLife::Persistent => "persistent",
            AdapterLife::FreshPerChunk => "fresh-per-chunk",
        })
    }
}

/// The arithmetic of a learning policy's frozen products in its updates (`[policy] dtype`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum TrainDtype {
    /// f32 throughout.
    #[default]
    F32,
    /// Every frozen weight's product, forward (x Wᵀ) and backward (g W), and the LM head's on
    /// the CPU's packed bf16 kernel (`policy::PolicyModel::use_bf16_products`: AMX or AVX-512
    /// BF16 where the CPU has them); adapters, their gradients, norms, attention and Adam f32.
    Bf16,
}

impl std::fmt::Display for TrainDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TrainDtype::F32 => "f32",
            TrainDtype::Bf16 => "bf16",
        })
    }
}

/// Where a learning arm's rollouts (the sequences its update scores) come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum RolloutSource {
    /// The first `rollouts_per_prompt` of the chunk's n samples — the ones the reward model's
    /// pairs were picked from (draws of the same policy).
    Samples,
    /// `rollouts_per_prompt` new samples per prompt from the policy, on a stream of their own
    /// (per seed and chunk; the same for every arm of a seed): the authors' PPO generates its
    /// rollouts apart from the reward model's samples. φ and the oracle score them.
    Fresh,
}

/// The policy the KL penalty (and the evaluation's KL) is measured against.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum KlReference {
    /// The base policy before any update.
    Initial,
    /// The policy at the start of the chunk's update (the authors': each chunk's actor and
    /// reference start from the previous chunk's merged policy).
    ChunkStart,
}

/// What a learning policy's run saves of its adapters (PEFT layout, under `adapters/`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum SaveAdapter {
    /// After the last chunk.
    Last,
    /// After every chunk (`chunk-01/`, …).
    EveryChunk,
    /// Nothing.
    None,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PolicySpec {
    /// LoRA rank r and α (the update is scaled by α/r).
    #[serde(default = "d_rank")]
    pub rank: usize,
    /// LoRA α: the adapters' update is scaled by α/r.
    #[serde(default = "d_alpha")]
    pub alpha: f64,
    /// PEFT's target_modules: a list of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
    /// down_proj, or "all-linear".
    #[serde(default = "d_targets")]
    pub targets: Targets,
    /// PEFT's lora_dropout: the chance of dropping an input of the adapters' branch in a
    /// gradient pass (kept inputs scaled by 1/(1 − p)); 0 turns it off. dpo only: rloo and ppo
    /// refuse p > 0 (their ratio's old log-probabilities are taken without dropout).
    #[serde(default)]
    pub dropout: f64,
    /// "f32" or "bf16": the frozen products of the policy's updates and scoring passes
    /// ([`TrainDtype`]; the CPU only, a persistent LoRA adapter only), and of the ppo critic's
    /// backbone (its value head f32), and a learning arm's sampler: with "bf16" it samples on
    /// the packed bf16 base with the adapters unmerged beside it in f32 (merged into bf16
    /// weights a small update would be rounded away), with "f32" on the adapters merged in f32,
    /// whatever generate.dtype says (with generate.backend = "openai" the server samples, its
    /// adapters pushed to it, whatever this says). The unmoved policy's samples are the bank's
    /// only when generate.dtype is the same as this (or a server draws both).
    #[serde(default)]
    pub dtype: TrainDtype,
    /// Adam on the adapters, gradients clipped to this global norm; `lr` is the peak learning
    /// rate of the schedule.
    #[serde(default = "d_lr")]
    pub lr: f64,
    /// Gradients are clipped to this global norm before each Adam step.
    #[serde(default = "d_one")]
    pub max_grad_norm: f64,
    /// Adam's β₁, β₂ and ε (PyTorch's defaults; the authors' actor and critic use [0.9, 0.95]).
    #[serde(default = "d_betas")]
    pub adam_betas: [f64; 2],
    /// Adam's ε.
    #[serde(default = "d_adam_eps")]
    pub adam_eps: f64,
    /// "constant" or "cosine-with-min-lr" (warm-up over ⌈warmup_ratio·steps⌉ steps, then a
    /// cosine to min_lr_ratio·lr; OpenRLHF's defaults 0.03 and 0.1), restarted each chunk
    /// (`lr_restart = "chunk"`, the authors') or spanning the run (`"run"`).
    #[serde(default = "d_schedule")]
    pub lr_schedule: LrScheduleKind,
    /// cosine-with-min-lr: the warm-up's share of the schedule's steps (step k of w at
    /// (k + 1)/w·lr: the first step moves the weights).
    #[serde(default = "d_warmup_ratio")]
    pub warmup_ratio: f64,
    /// cosine-with-min-lr: the floor of the cosine, as a fraction of lr.
    #[serde(default = "d_min_lr_ratio")]
    pub min_lr_ratio: f64,
    /// Which steps the schedule spans: each chunk's update ("chunk", the authors') or the whole
    /// run's ("run"; a fresh optimiser per chunk — adapter = "fresh-per-chunk", the ppo
    /// critic's — continues the run's step count, so the schedule never restarts).
    #[serde(default = "d_restart")]
    pub lr_restart: LrRestart,
    /// "persistent" (one adapter over the run) or "fresh-per-chunk" (merged after each chunk,
    /// a fresh one for the next: the authors'); the KL reference "initial" or "chunk-start".
    /// A list sweeps: one cell per life (e.g. ["persistent", "fresh-per-chunk"]).
    #[serde(default = "d_adapter")]
    pub adapter: Sweep<AdapterLife>,
    /// The policy the KL penalty (and policy.parquet's `kl`) is measured against;
    /// policy.parquet's `kl_initial` is always to the initial policy. "chunk-start" makes rloo's
    /// and ppo's penalty exactly 0 (each chunk's rollouts are scored before its update, when
    /// the policy is its reference): the plan warns.
    #[serde(default = "d_kl_reference")]
    pub kl_reference: KlReference,
    /// Passes over a chunk's samples (pairs, for dpo), in mini-batches of `minibatch`
    /// sequences (pairs); each mini-batch is one Adam step. rloo shuffles whole prompt groups
    /// (a multiple of generate.n makes every mini-batch whole groups, each prompt computed once).
    #[serde(default = "d_epochs")]
    pub epochs: usize,
    /// Sequences (dpo: pairs) per mini-batch; each mini-batch is one Adam step.
    #[serde(default = "d_minibatch")]
    pub minibatch: usize,
    /// The rollouts a learning arm's update sees (rloo and ppo: `rollouts_per_prompt` of their
    /// tables per prompt; dpo with pairs = "fresh-two": 2): from the chunk's samples or fresh
    /// (see [`RolloutSource`]), on the first `prompts_per_update` of the chunk's prompts
    /// (default: all; the authors' PPO: 16 of a chunk's 20).
    #[serde(default = "d_rollouts")]
    pub rollouts: RolloutSource,
    /// The first prompts of each chunk the update learns from (absent: all).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompts_per_update: Option<usize>,
    /// The KL estimator of the evaluation's KL to the reference (and of rloo's and ppo's
    /// penalty). "k3" is refused as a penalty in the reward (rloo or ppo with kl_coef > 0): the
    /// policy gradient of a k3 reward is not the KL's gradient (biased); k1 is.
    #[serde(default = "d_kl")]
    pub kl_estimator: KlEstimator,
    /// Held-out prompts (the ones after the training prompts in generate.prompts), the
    /// policy's samples per held-out prompt (a multiple of generate.n, so best-of-n is read off
    /// groups of n; default n), and how often (in chunks) they are evaluated.
    #[serde(default = "d_eval_prompts")]
    pub eval_prompts: usize,
    /// The policy's samples per held-out prompt, a multiple of generate.n (absent: n).
    #[serde(default)]
    pub eval_samples: Option<usize>,
    /// Evaluate the policy on the held-out prompts every this many chunks (and after the last).
    #[serde(default = "d_one_usize")]
    pub eval_every_chunks: usize,
    /// The evaluation's guard against a destroyed policy: a learning cell fails (naming
    /// policy.lr) when its mean sequence KL to the initial policy on the held-out samples
    /// exceeds this many nats, or when its entropy per token comes within 10 % of the uniform
    /// ln |V| while the base policy's was below 75 % of it. A finite policy this far from its
    /// start has been overwritten, not tuned (online-proof's rloo ends near 2 nats; lr = 1e30
    /// gives > 100). `inf` turns the KL bound off.
    #[serde(default = "d_max_kl")]
    pub max_kl: f64,
    /// What the run saves of a learning policy's adapters (PEFT layout, under `adapters/`).
    #[serde(default = "d_save")]
    pub save_adapter: SaveAdapter,
    /// `[policy.rloo]`: the rloo arm's own keys.
    #[serde(default)]
    pub rloo: RlooSpec,
    /// `[policy.dpo]`: the dpo arm's own keys.
    #[serde(default)]
    pub dpo: DpoSpec,
    /// `[policy.ppo]`: the ppo arm's own keys.
    #[serde(default)]
    pub ppo: PpoSpec,
    /// `[policy.grpo]`: the grpo arm's own keys.
    #[serde(default)]
    pub grpo: GrpoSpec,
    /// `[policy.reinforce_pp]`: the reinforce-pp arm's own keys.
    #[serde(default)]
    pub reinforce_pp: ReinforcePpSpec,
}

/// PEFT's `target_modules`: names, or "all-linear".
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum Targets {
    All(String),
    List(Vec<String>),
}

impl Targets {
    pub fn resolve(&self) -> Result<Vec<policy::Target>, String> {
        let names = || policy::Target::ALL.iter().map(|t| t.name()).collect::<Vec<_>>().join(", ");
        match self {
            Targets::All(s) if s == "all-linear" => Ok(policy::Target::ALL.to_vec()),
            Targets::All(s) => Err(format!("`{s}`: expected a list of module names or \"all-linear\"")),
            Targets::List(v) if v.is_empty() => Err("an empty list: expected at least one module".into()),
            Targets::List(v) => v
                .iter()
                .map(|n| {
                    policy::Target::ALL
                        .iter()
                        .find(|t| t.name() == n)
                        .copied()
                        .ok_or_else(|| format!("`{n}`: expected one of {} (or \"all-linear\")", names()))
                })
                .collect(),
        }
    }
}

/// A sweep of named choices (reward sources, adapter lives): at least one, none twice.
fn sources<T: PartialEq + std::fmt::Display>(s: &Sweep<T>, names: &str) -> Result<(), String> {
    if s.0.is_empty() {
        return Err(format!("an empty list: expected at least one of {names}"));
    }
    if let Some(i) = (1..s.0.len()).find(|&i| s.0[..i].contains(&s.0[i])) {
        return Err(format!("`{}` is listed twice (entry {i})", s.0[i]));
    }
    Ok(())
}

const REWARDS: &str = "learned, oracle, null";

fn positive(v: f64) -> Result<(), String> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(format!("{v}: expected a finite number > 0"))
    }
}

fn nonnegative(v: f64) -> Result<(), String> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(format!("{v}: expected a finite number ≥ 0"))
    }
}

impl Default for PolicySpec {
    fn default() -> Self {
        toml::from_str("").expect("defaults")
    }
}

impl PolicySpec {
    /// Checks that need no file: (key path under `[policy]`, message).
    pub fn check(&self) -> Result<(), (Vec<&'static str>, String)> {
        self.check_shared().map_err(|(k, m)| (vec![k], m))?;
        let r = &self.rloo;
        let at = |k: &'static str| move |m: String| (vec!["rloo", k], m);
        sources(&r.reward, REWARDS).map_err(at("reward"))?;
        positive(r.reward_clip).map_err(at("reward_clip"))?;
        nonnegative(r.kl_coef).map_err(at("kl_coef"))?;
        nonnegative(r.clip).map_err(at("clip"))?;
        if r.rollouts_per_prompt.is_some_and(|k| k < 2) {
            return Err(at("rollouts_per_prompt")("expected at least 2 (the leave-one-out baseline)".into()));
        }
        positive(self.dpo.beta).map_err(|m| (vec!["dpo", "beta"], m))?;
        if let Some(w) = &self.dpo.warm_start {
            let at = |k: &'static str| move |m: String| (vec!["dpo", "warm_start", k], m);
            if w.rows == 0 {
                return Err(at("rows")("expected at least 1".into()));
            }
            if w.epochs == 0 {
                return Err(at("epochs")("expected at least 1".into()));
            }
        }
        let p = &self.ppo;
        let at = |k: &'static str| move |m: String| (vec!["ppo", k], m);
        sources(&p.reward, REWARDS).map_err(at("reward"))?;
        if p.critic_head == Some(CriticHead::Theta) {
            if let Some(c) = p.reward.0.iter().find(|&&r| r != RewardSource::Learned) {
                return Err(at("critic_head")(format!(
                    "\"theta\" with reward = \"{c}\": a control's critic must not start from the learned θ: expected \"zero\" (or leave critic_head out: zero for the controls, theta for learned)"
                )));
            }
        }
        positive(p.reward_clip).map_err(at("reward_clip"))?;
        nonnegative(p.kl_coef).map_err(at("kl_coef"))?;
        nonnegative(p.clip).map_err(at("clip"))?;
        nonnegative(p.value_clip).map_err(at("value_clip"))?;
        nonnegative(p.critic_lr).map_err(at("critic_lr"))?;
        if p.rollouts_per_prompt == Some(0) {
            return Err(at("rollouts_per_prompt")("expected at least 1".into()));
        }
        for (k, v) in [("gamma", p.gamma), ("lambda", p.lambda)] {
            if !(v.is_finite() && (0.0..=1.0).contains(&v)) {
                return Err(at(k)(format!("{v}: expected 0 ≤ {k} ≤ 1")));
            }
        }
        let g = &self.grpo;
        let at = |k: &'static str| move |m: String| (vec!["grpo", k], m);
        sources(&g.reward, REWARDS).map_err(at("reward"))?;
        nonnegative(g.kl_coef).map_err(at("kl_coef"))?;
        nonnegative(g.clip).map_err(at("clip"))?;
        if g.rollouts_per_prompt.is_some_and(|k| k < 2) {
            return Err(at("rollouts_per_prompt")(
                "expected at least 2 (a group's mean and standard deviation)".into(),
            ));
        }
        let r = &self.reinforce_pp;
        let at = |k: &'static str| move |m: String| (vec!["reinforce_pp", k], m);
        sources(&r.reward, REWARDS).map_err(at("reward"))?;
        positive(r.reward_clip).map_err(at("reward_clip"))?;
        nonnegative(r.kl_coef).map_err(at("kl_coef"))?;
        nonnegative(r.clip).map_err(at("clip"))?;
        if !(r.gamma.is_finite() && (0.0..=1.0).contains(&r.gamma)) {
            return Err(at("gamma")(format!("{}: expected 0 ≤ gamma ≤ 1", r.gamma)));
        }
        if r.rollouts_per_prompt == Some(0) {
            return Err(at("rollouts_per_prompt")("expected at least 1".into()));
        }
        Ok(())
    }

    /// The policy-gradient arms among `arms` with their KL penalty's β and whether it enters
    /// the reward (rloo, ppo, reinforce-pp) or the loss (grpo).
    fn kl_arms(&self, arms: &[super::DeployPolicy]) -> Vec<(&'static str, f64, bool)> {
        use super::DeployPolicy as P;
        [
            (P::Rloo, "rloo", self.rloo.kl_coef, true),
            (P::Ppo, "ppo", self.ppo.kl_coef, true),
            (P::Grpo, "grpo", self.grpo.kl_coef, false),
            (P::ReinforcePp, "reinforce_pp", self.reinforce_pp.kl_coef, true),
        ]
        .into_iter()
        .filter(|(p, ..)| arms.contains(p))
        .map(|(_, a, c, r)| (a, c, r))
        .collect()
    }

    /// Checks that depend on the arms deployed: (key path under `[policy]`, message).
    pub fn check_arms(&self, arms: &[super::DeployPolicy]) -> Result<(), (Vec<&'static str>, String)> {
        let pg = self.kl_arms(arms);
        if let (Some(&(arm, ..)), true) = (pg.first(), self.dropout > 0.0) {
            return Err((
                vec!["dropout"],
                format!("{} with {arm}: its ratio's old log-probabilities are taken without dropout, so the first step's ratio is not 1: expected 0 (dropout is dpo's)", self.dropout),
            ));
        }
        if self.kl_estimator == KlEstimator::K3 {
            for (arm, coef, in_reward) in pg {
                if in_reward && coef > 0.0 {
                    return Err((
                        vec!["kl_estimator"],
                        format!("\"k3\" as {arm}'s KL penalty in the reward (policy.{arm}.kl_coef = {coef}): the policy gradient of a k3 reward is a biased estimate of the KL's: expected \"k1\" (or kl_coef = 0)"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Warnings that depend on the arms deployed, one line each (without the file's name).
    pub fn warnings(&self, arms: &[super::DeployPolicy]) -> Vec<String> {
        let mut out = Vec::new();
        if self.kl_reference == KlReference::ChunkStart {
            let on: Vec<String> = self
                .kl_arms(arms)
                .iter()
                .filter(|(_, c, _)| *c > 0.0)
                .map(|(a, c, _)| format!("policy.{a}.kl_coef = {c}"))
                .collect();
            if !on.is_empty() {
                out.push(format!(
                    "policy.kl_reference = \"chunk-start\": the KL penalty is identically 0 ({} has no effect: each chunk's rollouts are scored before its update, when the policy is its reference); policy.parquet's kl_initial is the KL to the initial policy",
                    on.join(", ")
                ));
            }
        }
        out
    }

    fn check_shared(&self) -> Result<(), (&'static str, String)> {
        let pos = |k: &'static str, v: f64| positive(v).map_err(|m| (k, m));
        let nonneg = |k: &'static str, v: f64| nonnegative(v).map_err(|m| (k, m));
        let one = |k: &'static str, v: usize| if v >= 1 { Ok(()) } else { Err((k, "expected at least 1".to_string())) };
        one("rank", self.rank)?;
        pos("alpha", self.alpha)?;
        self.targets.resolve().map_err(|m| ("targets", m))?;
        if !(self.dropout.is_finite() && (0.0..1.0).contains(&self.dropout)) {
            return Err(("dropout", format!("{}: expected a probability 0 ≤ p < 1", self.dropout)));
        }
        nonneg("lr", self.lr)?;
        pos("max_grad_norm", self.max_grad_norm)?;
        for (i, b) in self.adam_betas.iter().enumerate() {
            if !(b.is_finite() && (0.0..1.0).contains(b)) {
                return Err(("adam_betas", format!("β{} = {b}: expected 0 ≤ β < 1", i + 1)));
            }
        }
        pos("adam_eps", self.adam_eps)?;
        for (k, v) in [("warmup_ratio", self.warmup_ratio), ("min_lr_ratio", self.min_lr_ratio)] {
            if !(v.is_finite() && (0.0..=1.0).contains(&v)) {
                return Err((k, format!("{v}: expected a ratio 0 ≤ r ≤ 1")));
            }
        }
        one("epochs", self.epochs)?;
        one("minibatch", self.minibatch)?;
        one("eval_prompts", self.eval_prompts)?;
        if self.eval_samples == Some(0) {
            return Err(("eval_samples", "expected at least 1".into()));
        }
        one("eval_every_chunks", self.eval_every_chunks)?;
        if self.max_kl.is_nan() || self.max_kl <= 0.0 {
            return Err(("max_kl", format!("{}: expected a positive number of nats (inf: no bound)", self.max_kl)));
        }
        if self.prompts_per_update == Some(0) {
            return Err(("prompts_per_update", "expected at least 1".into()));
        }
        sources(&self.adapter, "persistent, fresh-per-chunk").map_err(|m| ("adapter", m))?;
        if self.adapter.0.contains(&AdapterLife::FreshPerChunk) && self.save_adapter == SaveAdapter::Last {
            return Err((
                "save_adapter",
                "\"last\" with adapter = \"fresh-per-chunk\": that policy is the base with every chunk's adapter merged in order, not one adapter: expected \"every-chunk\" or \"none\""
                    .into(),
            ));
        }
        Ok(())
    }

    /// rloo's update (its mini-batch seed 0 and its schedule's window per update: each cell
    /// sets its own, see `settings::online`).
    pub fn rloo_update(&self) -> policy::train::RlooConfig {
        let r = &self.rloo;
        policy::train::RlooConfig {
            kl_coef: r.kl_coef,
            kl: self.kl_estimator,
            kl_penalty: r.kl_penalty,
            reward_norm: r.reward_norm.resolve(r.reward_clip),
            clip: (r.clip > 0.0).then_some(r.clip),
            epochs: self.epochs,
            minibatch: self.minibatch,
            normalize_advantages: r.normalize_advantages,
            lr_window: policy::adam::LrWindow::Update,
            seed: 0,
        }
    }

    /// dpo's update (its mini-batch seed 0 and its schedule's window per update: each cell sets
    /// its own).
    pub fn dpo_update(&self) -> policy::train::DpoConfig {
        policy::train::DpoConfig {
            beta: self.dpo.beta,
            epochs: self.epochs,
            minibatch: self.minibatch,
            lr_window: policy::adam::LrWindow::Update,
            seed: 0,
        }
    }

    /// ppo's update (its mini-batch seed 0 and its schedule's window per update: each cell
    /// sets its own).
    pub fn ppo_update(&self) -> policy::train::PpoConfig {
        let p = &self.ppo;
        policy::train::PpoConfig {
            kl_coef: p.kl_coef,
            kl: self.kl_estimator,
            reward_norm: p.reward_norm.resolve(p.reward_clip),
            clip: (p.clip > 0.0).then_some(p.clip),
            value_clip: (p.value_clip > 0.0).then_some(p.value_clip),
            gamma: p.gamma,
            lambda: p.lambda,
            epochs: self.epochs,
            minibatch: self.minibatch,
            normalize_advantages: p.normalize_advantages,
            lr_window: policy::adam::LrWindow::Update,
            seed: 0,
        }
    }

    /// grpo's update (its mini-batch seed 0 and its schedule's window per update: each cell
    /// sets its own).
    pub fn grpo_update(&self) -> policy::train::GrpoConfig {
        let g = &self.grpo;
        policy::train::GrpoConfig {
            kl_coef: g.kl_coef,
            kl: self.kl_estimator,
            scale: g.scale_rewards,
            clip: (g.clip > 0.0).then_some(g.clip),
            epochs: self.epochs,
            minibatch: self.minibatch,
            lr_window: policy::adam::LrWindow::Update,
            seed: 0,
        }
    }

    /// reinforce-pp's update (its mini-batch seed 0 and its schedule's window per update: each
    /// cell sets its own).
    pub fn reinforce_pp_update(&self) -> policy::train::ReinforcePpConfig {
        let r = &self.reinforce_pp;
        policy::train::ReinforcePpConfig {
            kl_coef: r.kl_coef,
            kl: self.kl_estimator,
            reward_norm: r.reward_norm.resolve(r.reward_clip),
            reward_clip: r.reward_clip,
            clip: (r.clip > 0.0).then_some(r.clip),
            gamma: r.gamma,
            std_norm: r.normalize_advantages,
            epochs: self.epochs,
            minibatch: self.minibatch,
            lr_window: policy::adam::LrWindow::Update,
            seed: 0,
        }
    }

    /// Held-out samples per prompt: `eval_samples`, or generate.n.
    pub fn eval_samples(&self, n: usize) -> usize {
        self.eval_samples.unwrap_or(n)
    }

    pub fn adam(&self) -> policy::adam::AdamConfig {
        let schedule = match self.lr_schedule {
            LrScheduleKind::Constant => policy::adam::LrSchedule::Constant,
            LrScheduleKind::CosineWithMinLr => policy::adam::LrSchedule::CosineWithMinLr {
                warmup_ratio: self.warmup_ratio,
                min_lr_ratio: self.min_lr_ratio,
            },
        };
        policy::adam::AdamConfig {
            lr: self.lr,
            beta1: self.adam_betas[0],
            beta2: self.adam_betas[1],
            eps: self.adam_eps,
            clip: Some(self.max_grad_norm),
            schedule,
        }
    }

    /// The adapters, their initial draw from `seed`.
    pub fn lora(&self, seed: u64) -> policy::LoraConfig {
        policy::LoraConfig {
            rank: self.rank,
            alpha: self.alpha,
            targets: self.targets.resolve().expect("checked by the plan"),
            seed,
            dropout: self.dropout,
        }
    }
}

fn d_adapter() -> Sweep<AdapterLife> {
    Sweep::one(AdapterLife::Persistent)
}
fn d_rollouts() -> RolloutSource {
    RolloutSource::Samples
}
fn d_kl_reference() -> KlReference {
    KlReference::Initial
}
fn d_betas() -> [f64; 2] {
    [0.9, 0.999]
}
fn d_adam_eps() -> f64 {
    1e-8
}
fn d_schedule() -> LrScheduleKind {
    LrScheduleKind::Constant
}
fn d_warmup_ratio() -> f64 {
    0.03
}
fn d_min_lr_ratio() -> f64 {
    0.1
}
fn d_restart() -> LrRestart {
    LrRestart::Chunk
}
pub(super) fn d_rank() -> usize {
    8
}
pub(super) fn d_alpha() -> f64 {
    16.0
}
fn d_targets() -> Targets {
    Targets::List(vec!["q_proj".into(), "v_proj".into()])
}
fn d_one_usize() -> usize {
    1
}
fn d_minibatch() -> usize {
    8
}
fn d_kl() -> KlEstimator {
    KlEstimator::K1
}
fn d_max_kl() -> f64 {
    50.0
}
fn d_eval_prompts() -> usize {
    16
}
fn d_save() -> SaveAdapter {
    SaveAdapter::Last
}
