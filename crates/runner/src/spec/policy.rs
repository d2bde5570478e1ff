//! The `[policy]` table: how a deployed policy that learns (`deploy.policy = "rloo"` or
//! `"dpo"`) updates after each chunk (paper §6: each chunk's pairs update the reward model,
//! then the policy), and how it is evaluated.

use super::Sweep;
use policy::train::{KlEstimator, KlPenalty};
use serde::{Deserialize, Serialize};

/// What reward drives a learning arm's policy update (rloo): the paper's learned reward, or one
/// of the two controls a policy-level claim needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RewardSource {
    /// φᵀθ_t, the reward model learned in one pass (the paper's method).
    Learned,
    /// The oracle's own reward of each sample: the ceiling — can this update improve this
    /// policy at this budget at all?
    Oracle,
    /// φᵀθ̃ with θ̃ a random direction (drawn per seed) of ‖θ_t‖: a reward with no information
    /// about the oracle — the floor: what the update's drift alone does.
    Null,
}

impl std::fmt::Display for RewardSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RewardSource::Learned => "learned",
            RewardSource::Oracle => "oracle",
            RewardSource::Null => "null",
        })
    }
}

/// How rloo scales its reward before the KL penalty.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RewardNormKind {
    /// (r − mean)/sd over the chunk's rewards, clipped to ±reward_clip (OpenRLHF's convention).
    Chunk,
    /// The raw reward: its scale (‖θ‖) sets the KL penalty's weight.
    None,
}

/// What a learning policy's run saves of its adapters (PEFT layout, under `adapters/`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SaveAdapter {
    /// After the last chunk.
    Last,
    /// After every chunk (`chunk-01/`, …).
    EveryChunk,
    None,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicySpec {
    /// LoRA rank r and α (the update is scaled by α/r).
    #[serde(default = "d_rank")]
    pub rank: usize,
    #[serde(default = "d_alpha")]
    pub alpha: f64,
    /// PEFT's target_modules: a list of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
    /// down_proj, or "all-linear".
    #[serde(default = "d_targets")]
    pub targets: Targets,
    /// PEFT's lora_dropout: the chance of dropping an input of the adapters' branch in a
    /// gradient pass (kept inputs scaled by 1/(1 − p)); 0 turns it off.
    #[serde(default)]
    pub dropout: f64,
    /// Adam on the adapters (β = 0.9, 0.999, ε = 1e-8), gradients clipped to this global norm.
    #[serde(default = "d_lr")]
    pub lr: f64,
    #[serde(default = "d_one")]
    pub max_grad_norm: f64,
    /// Passes over a chunk's samples (pairs, for dpo), in mini-batches of `minibatch`
    /// sequences (pairs); each mini-batch is one Adam step. rloo shuffles whole prompt groups
    /// (a multiple of generate.n makes every mini-batch whole groups, each prompt computed once).
    #[serde(default = "d_epochs")]
    pub epochs: usize,
    #[serde(default = "d_minibatch")]
    pub minibatch: usize,
    /// The KL estimator of the evaluation's KL to the reference (and of rloo's penalty).
    #[serde(default = "d_kl")]
    pub kl_estimator: KlEstimator,
    /// Held-out prompts (the ones after the training prompts in generate.prompts), the
    /// policy's samples per held-out prompt (a multiple of generate.n, so best-of-n is read off
    /// groups of n; default n), and how often (in chunks) they are evaluated.
    #[serde(default = "d_eval_prompts")]
    pub eval_prompts: usize,
    #[serde(default)]
    pub eval_samples: Option<usize>,
    #[serde(default = "d_one_usize")]
    pub eval_every_chunks: usize,
    #[serde(default = "d_save")]
    pub save_adapter: SaveAdapter,
    /// `[policy.rloo]`: the rloo arm's own keys.
    #[serde(default)]
    pub rloo: RlooSpec,
    /// `[policy.dpo]`: the dpo arm's own keys.
    #[serde(default)]
    pub dpo: DpoSpec,
}

/// `[policy.rloo]`: which reward drives the update (a sweep: one cell per source), how it is
/// normalised before the KL penalty (`reward_norm`, `reward_clip`), β of the KL penalty and
/// where it enters (`kl_penalty`: per sequence as TRL's RLOO, or per token as OpenRLHF), the PPO
/// clip ε of the ratio (0: none), advantages divided by their sd.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RlooSpec {
    #[serde(default = "d_reward")]
    pub reward: Sweep<RewardSource>,
    #[serde(default = "d_reward_norm")]
    pub reward_norm: RewardNormKind,
    #[serde(default = "d_reward_clip")]
    pub reward_clip: f64,
    #[serde(default = "d_kl_coef")]
    pub kl_coef: f64,
    #[serde(default = "d_kl_penalty")]
    pub kl_penalty: KlPenalty,
    #[serde(default = "d_clip")]
    pub clip: f64,
    #[serde(default = "d_true")]
    pub normalize_advantages: bool,
}

impl Default for RlooSpec {
    fn default() -> Self {
        toml::from_str("").expect("defaults")
    }
}

/// `[policy.dpo]`: β of the DPO loss.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DpoSpec {
    #[serde(default = "d_dpo_beta")]
    pub beta: f64,
}

impl Default for DpoSpec {
    fn default() -> Self {
        toml::from_str("").expect("defaults")
    }
}

/// PEFT's `target_modules`: names, or "all-linear".
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
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
        if r.reward.0.is_empty() {
            return Err(at("reward")("an empty list: expected at least one of learned, oracle, null".into()));
        }
        if let Some(i) = (1..r.reward.0.len()).find(|&i| r.reward.0[..i].contains(&r.reward.0[i])) {
            return Err(at("reward")(format!("`{}` is listed twice (entry {i})", r.reward.0[i])));
        }
        positive(r.reward_clip).map_err(at("reward_clip"))?;
        nonnegative(r.kl_coef).map_err(at("kl_coef"))?;
        nonnegative(r.clip).map_err(at("clip"))?;
        positive(self.dpo.beta).map_err(|m| (vec!["dpo", "beta"], m))?;
        Ok(())
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
        one("epochs", self.epochs)?;
        one("minibatch", self.minibatch)?;
        one("eval_prompts", self.eval_prompts)?;
        if self.eval_samples == Some(0) {
            return Err(("eval_samples", "expected at least 1".into()));
        }
        one("eval_every_chunks", self.eval_every_chunks)?;
        Ok(())
    }

    /// rloo's update (its mini-batch seed 0: each cell sets its own).
    pub fn rloo_update(&self) -> policy::train::RlooConfig {
        let r = &self.rloo;
        policy::train::RlooConfig {
            kl_coef: r.kl_coef,
            kl: self.kl_estimator,
            kl_penalty: r.kl_penalty,
            reward_norm: match r.reward_norm {
                RewardNormKind::Chunk => policy::train::RewardNorm::Chunk { clip: r.reward_clip },
                RewardNormKind::None => policy::train::RewardNorm::None,
            },
            clip: (r.clip > 0.0).then_some(r.clip),
            epochs: self.epochs,
            minibatch: self.minibatch,
            normalize_advantages: r.normalize_advantages,
            seed: 0,
        }
    }

    /// dpo's update (its mini-batch seed 0: each cell sets its own).
    pub fn dpo_update(&self) -> policy::train::DpoConfig {
        policy::train::DpoConfig { beta: self.dpo.beta, epochs: self.epochs, minibatch: self.minibatch, seed: 0 }
    }

    /// Held-out samples per prompt: `eval_samples`, or generate.n.
    pub fn eval_samples(&self, n: usize) -> usize {
        self.eval_samples.unwrap_or(n)
    }

    pub fn adam(&self) -> policy::adam::AdamConfig {
        policy::adam::AdamConfig { lr: self.lr, clip: Some(self.max_grad_norm), ..Default::default() }
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

fn d_rank() -> usize {
    8
}
fn d_alpha() -> f64 {
    16.0
}
fn d_targets() -> Targets {
    Targets::List(vec!["q_proj".into(), "v_proj".into()])
}
fn d_lr() -> f64 {
    1e-4
}
fn d_one() -> f64 {
    1.0
}
fn d_one_usize() -> usize {
    1
}
fn d_epochs() -> usize {
    1
}
fn d_minibatch() -> usize {
    8
}
fn d_kl_coef() -> f64 {
    0.05
}
fn d_kl() -> KlEstimator {
    KlEstimator::K1
}
fn d_kl_penalty() -> KlPenalty {
    KlPenalty::Sequence
}
fn d_reward() -> Sweep<RewardSource> {
    Sweep::one(RewardSource::Learned)
}
fn d_reward_norm() -> RewardNormKind {
    RewardNormKind::Chunk
}
fn d_reward_clip() -> f64 {
    10.0
}
fn d_clip() -> f64 {
    0.2
}
fn d_true() -> bool {
    true
}
fn d_dpo_beta() -> f64 {
    0.1
}
fn d_eval_prompts() -> usize {
    16
}
fn d_save() -> SaveAdapter {
    SaveAdapter::Last
}
