//! The `[policy]` table: how a deployed policy that learns (`deploy.policy = "rloo"` or
//! `"dpo"`) updates after each chunk (paper §6: each chunk's pairs update the reward model,
//! then the policy), and how it is evaluated.

use policy::train::KlEstimator;
use serde::{Deserialize, Serialize};

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
    /// sequences (pairs); each mini-batch is one Adam step.
    #[serde(default = "d_epochs")]
    pub epochs: usize,
    #[serde(default = "d_minibatch")]
    pub minibatch: usize,
    /// rloo: β of the KL penalty subtracted from the learned reward, its estimator, the PPO
    /// clip ε of the sequence ratio (0: none), advantages divided by their sd over the chunk.
    #[serde(default = "d_kl_coef")]
    pub kl_coef: f64,
    #[serde(default = "d_kl")]
    pub kl_estimator: KlEstimator,
    #[serde(default = "d_clip")]
    pub clip: f64,
    #[serde(default = "d_true")]
    pub normalize_advantages: bool,
    /// dpo: β.
    #[serde(default = "d_dpo_beta")]
    pub dpo_beta: f64,
    /// Held-out prompts (the ones after the training prompts in generate.prompts), the
    /// policy's samples per held-out prompt, and how often (in chunks) they are evaluated.
    #[serde(default = "d_eval_prompts")]
    pub eval_prompts: usize,
    #[serde(default = "d_eval_samples")]
    pub eval_samples: usize,
    #[serde(default = "d_one_usize")]
    pub eval_every_chunks: usize,
    #[serde(default = "d_save")]
    pub save_adapter: SaveAdapter,
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

impl Default for PolicySpec {
    fn default() -> Self {
        toml::from_str("").expect("defaults")
    }
}

impl PolicySpec {
    /// Checks that need no file: (key, message).
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        let pos = |k: &'static str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err((k, format!("{v}: expected a finite number > 0")))
            }
        };
        let nonneg = |k: &'static str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err((k, format!("{v}: expected a finite number ≥ 0")))
            }
        };
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
        nonneg("kl_coef", self.kl_coef)?;
        nonneg("clip", self.clip)?;
        pos("dpo_beta", self.dpo_beta)?;
        one("eval_prompts", self.eval_prompts)?;
        one("eval_samples", self.eval_samples)?;
        one("eval_every_chunks", self.eval_every_chunks)?;
        Ok(())
    }

    pub fn rloo(&self) -> policy::train::RlooConfig {
        policy::train::RlooConfig {
            kl_coef: self.kl_coef,
            kl: self.kl_estimator,
            clip: (self.clip > 0.0).then_some(self.clip),
            epochs: self.epochs,
            minibatch: self.minibatch,
            normalize_advantages: self.normalize_advantages,
        }
    }

    pub fn dpo(&self) -> policy::train::DpoConfig {
        policy::train::DpoConfig { beta: self.dpo_beta, epochs: self.epochs, minibatch: self.minibatch }
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
fn d_eval_samples() -> usize {
    2
}
fn d_save() -> SaveAdapter {
    SaveAdapter::Last
}
