//! `[reward]`: what of the reward model learns (issue 30, the paper's appendix "Full update of
//! reward model"). "head" — the default, and every run before this table — learns θ on
//! frozen φ (the `[[estimator]]` tables on cached features); "lora" and "full" learn θ and the
//! feature model's adapters or all its weights, one pass over the data with the same
//! estimator tables' rules (`policy::rm::model`).

use super::policy::{d_alpha, d_rank, Targets};
use policy::rm::update::HvpScheme;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum RewardUpdate {
    /// θ on frozen φ (cached features).
    #[default]
    Head,
    /// θ and LoRA adapters on the feature model.
    Lora,
    /// θ and every weight of the feature model.
    Full,
}

impl std::fmt::Display for RewardUpdate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RewardUpdate::Head => "head",
            RewardUpdate::Lora => "lora",
            RewardUpdate::Full => "full",
        })
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RewardSpec {
    /// What of the reward model learns: θ on frozen φ ("head", the default), θ and LoRA adapters on
    /// the feature model ("lora"), or θ and every weight ("full").
    #[serde(default)]
    pub update: RewardUpdate,
    /// LoRA rank r and α of update = "lora" (as `[policy]`'s).
    #[serde(default = "d_rank")]
    pub rank: usize,
    /// LoRA α of update = "lora" (the adapters' update is scaled by α/r).
    #[serde(default = "d_alpha")]
    pub alpha: f64,
    /// PEFT's target_modules of update = "lora": a list of module names or "all-linear".
    #[serde(default = "d_targets")]
    pub targets: Targets,
    /// The backbone's step relative to θ's: ψ ← ψ + s·(the rule's step of ψ). 1: the rule over
    /// all parameters as it is (the authors'); 0: the backbone fixed (the head-only estimator,
    /// computed through the trainable path).
    #[serde(default = "d_one")]
    pub backbone_lr_scale: f64,
    /// The curvature products of omd-hvp-cg and omd-reference: the Hessian's — "exact"
    /// (Pearlmutter's R-operator on the step's recorded gradient pass: about one gradient pass
    /// each, no step size; LoRA adapters and the head), or by differences of gradients,
    /// "central" (two passes each, error O(ε²)) or "forward" (one pass from the step's own
    /// gradient, error O(ε)) — or "gauss-newton": the Gauss–Newton matrix
    /// (1/B) Σ σ′(mᵢ) ∇mᵢ ∇mᵢᵀ, paper Alg. 5's H_t with the margin's gradient for z, positive
    /// semi-definite (two forward passes and one backward each). Absent: "exact" for
    /// update = "lora", "central" for "full" ([`RewardSpec::hvp_scheme`]; the resolved spec
    /// records which).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hvp: Option<HvpScheme>,
    /// ε: how far the parameters move along the direction (absent: the scheme's f32 balance of
    /// truncation and rounding, 3e-3 central and gauss-newton, 3e-4 forward). Taken in
    /// 1e-5 ≤ ε ≤ 0.1 only: on the tiny test Llama in f32 the products' relative error is
    /// already 3e-3–4e-2 at ε = 1e-4 and 2e-2–1.1 at ε = 0.3, and far outside that range
    /// (e.g. 1e308) every product is infinite or noise and each step falls back to steepest
    /// descent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hvp_eps: Option<f64>,
    /// Sequences per forward pass when the held-out pairs are scored.
    #[serde(default = "d_eval_batch")]
    pub eval_batch: usize,
    /// Pairs per forward and backward pass of a step (the batch's gradient is accumulated over
    /// passes: the same gradient to rounding). A pass's activations are most of a step's
    /// memory: ~2.4 GB per pair of 256-token sequences on SmolLM2-135M in f32.
    #[serde(default = "d_pairs_per_pass")]
    pub pairs_per_pass: usize,
}

/// The step sizes `reward.hvp_eps` may take, (lowest, highest).
pub const HVP_EPS_RANGE: (f64, f64) = (1e-5, 0.1);

impl Default for RewardSpec {
    fn default() -> Self {
        RewardSpec {
            update: RewardUpdate::Head,
            rank: d_rank(),
            alpha: d_alpha(),
            targets: d_targets(),
            backbone_lr_scale: d_one(),
            hvp: None,
            hvp_eps: None,
            eval_batch: d_eval_batch(),
            pairs_per_pass: d_pairs_per_pass(),
        }
    }
}

impl RewardSpec {
    /// The key and message of the first bad value, if any.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        if self.rank == 0 {
            return Err(("rank", "0: expected at least 1".into()));
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return Err(("alpha", format!("{}: expected a finite number > 0", self.alpha)));
        }
        self.targets.resolve().map_err(|m| ("targets", m))?;
        if !(self.backbone_lr_scale.is_finite() && self.backbone_lr_scale >= 0.0) {
            return Err(("backbone_lr_scale", format!("{}: expected a finite number ≥ 0", self.backbone_lr_scale)));
        }
        // θ on frozen φ has an exact curvature and takes no Hessian–vector products: hvp and
        // hvp_eps would be read by nothing
        if self.update == RewardUpdate::Head {
            if let Some(e) = self.hvp_eps {
                let e = if (1e-4..1e6).contains(&e.abs()) { e.to_string() } else { format!("{e:e}") };
                return Err(("hvp_eps", format!("{e}: update = \"head\" (θ on frozen φ) takes no Hessian–vector products, so no step; hvp_eps applies to update = \"lora\" or \"full\": remove the key")));
            }
            if let Some(h) = self.hvp {
                return Err(("hvp", format!("\"{}\": update = \"head\" (θ on frozen φ) takes no Hessian–vector products; hvp applies to update = \"lora\" or \"full\": remove the key", toml::Value::try_from(h).map(|v| v.as_str().unwrap_or("?").to_string()).unwrap_or_default())));
            }
        }
        if let Some(e) = self.hvp_eps.filter(|e| !(e.is_finite() && *e > 0.0)) {
            return Err(("hvp_eps", format!("{e}: expected a finite number > 0")));
        }
        let (lo, hi) = HVP_EPS_RANGE;
        if let Some(e) = self.hvp_eps.filter(|e| !(lo..=hi).contains(e) && self.hvp_scheme() != HvpScheme::Exact) {
            return Err((
                "hvp_eps",
                format!(
                    "{}: expected a step between {lo:e} and {hi} (the parameters move by ε in norm; outside that, rounding or truncation swamps the differences — absent, the scheme's default)",
                    if (1e-4..1e6).contains(&e) { e.to_string() } else { format!("{e:e}") }
                ),
            ));
        }
        if self.hvp_scheme() == HvpScheme::Exact {
            if self.update == RewardUpdate::Full {
                return Err((
                    "hvp",
                    "\"exact\": the R-operator covers LoRA adapters and the head; update = \"full\" takes \"central\", \"forward\" or \"gauss-newton\"".into(),
                ));
            }
            if let Some(e) = self.hvp_eps {
                return Err(("hvp_eps", format!("{e}: exact products (hvp = \"exact\") take no step; remove the key")));
            }
        }
        if self.eval_batch == 0 {
            return Err(("eval_batch", "0: expected at least 1".into()));
        }
        if self.pairs_per_pass == 0 {
            return Err(("pairs_per_pass", "0: expected at least 1".into()));
        }
        Ok(())
    }

    /// The curvature products' scheme: `hvp`, or absent the update's default — exact products
    /// where the R-operator applies (LoRA), central differences of gradients where it does not
    /// (every weight learning).
    pub fn hvp_scheme(&self) -> HvpScheme {
        self.hvp.unwrap_or(match self.update {
            RewardUpdate::Full => HvpScheme::Central,
            RewardUpdate::Head | RewardUpdate::Lora => HvpScheme::Exact,
        })
    }

    /// How the update takes Hessian–vector products.
    pub fn hvp_config(&self) -> policy::rm::update::HvpConfig {
        let scheme = self.hvp_scheme();
        policy::rm::update::HvpConfig { eps: self.hvp_eps.unwrap_or(scheme.default_eps()), scheme }
    }

    /// The adapters of update = "lora", their initial draw from `seed`.
    pub fn lora(&self, seed: u64) -> policy::LoraConfig {
        policy::LoraConfig {
            rank: self.rank,
            alpha: self.alpha,
            targets: self.targets.resolve().expect("checked by the plan"),
            seed,
            dropout: 0.0,
        }
    }
}

fn d_targets() -> Targets {
    Targets::All("all-linear".into())
}
fn d_one() -> f64 {
    1.0
}
fn d_eval_batch() -> usize {
    16
}
fn d_pairs_per_pass() -> usize {
    2
}
