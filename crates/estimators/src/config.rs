//! Canonical names and hyper-parameters of every estimator, with the documented defaults.

use crate::{EstimatorError, Setup};
use std::fmt;
use std::str::FromStr;

/// The canonical estimator names (spec keys and parquet values use them verbatim).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub enum Kind {
    OmdExact,
    OmdHvpCg,
    OmdReference,
    Sgd,
    Mle,
    Adam,
    AdamReference,
    OmdHvpCgAdam,
    SgdReplay,
    Ensemble,
}

impl Kind {
    pub const ALL: [Kind; 10] = [
        Kind::OmdExact,
        Kind::OmdHvpCg,
        Kind::OmdReference,
        Kind::Sgd,
        Kind::Mle,
        Kind::Adam,
        Kind::AdamReference,
        Kind::OmdHvpCgAdam,
        Kind::SgdReplay,
        Kind::Ensemble,
    ];

    /// Whether the estimator keeps the paper's 𝓗_t (Alg. 1's 𝓗_{t+1} = 𝓗_t + H_t(θ_{t+1})) and
    /// answers [`crate::Estimator::inverse_norm`] from it.
    pub fn keeps_curvature(&self) -> bool {
        matches!(self, Kind::OmdExact)
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            Kind::OmdExact => "omd-exact",
            Kind::OmdHvpCg => "omd-hvp-cg",
            Kind::OmdReference => "omd-reference",
            Kind::Sgd => "sgd",
            Kind::Mle => "mle",
            Kind::Adam => "adam",
            Kind::AdamReference => "adam-reference",
            Kind::OmdHvpCgAdam => "omd-hvp-cg+adam",
            Kind::SgdReplay => "sgd-replay",
            Kind::Ensemble => "ensemble",
        }
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Kind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Kind::ALL.iter().copied().find(|k| k.as_str() == s).ok_or_else(|| {
            let names: Vec<_> = Kind::ALL.iter().map(|k| k.as_str()).collect();
            format!("unknown estimator `{s}`: expected one of {}", names.join(", "))
        })
    }
}

/// `omd-exact`: paper Alg. 1 / Eq. (3).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OmdExactConfig {
    /// Step size η (default 1).
    pub eta: f64,
    /// 𝓗_1 = λI (default 1).
    pub lambda: f64,
    /// Project onto ‖θ‖₂ ≤ B in the H̃_t norm when set (default: no projection).
    pub radius: Option<f64>,
}

impl Default for OmdExactConfig {
    fn default() -> Self {
        OmdExactConfig { eta: 1.0, lambda: 1.0, radius: None }
    }
}

impl OmdExactConfig {
    /// Lemma 1: η = ½ log 2 + (BL + 1), λ = 84√2·η·(dL² + BL³), projection onto ‖θ‖ ≤ B.
    pub fn theory(b: f64, l: f64, dim: usize) -> Self {
        let eta = 0.5 * std::f64::consts::LN_2 + (b * l + 1.0);
        let lambda = 84.0 * std::f64::consts::SQRT_2 * eta * (dim as f64 * l * l + b * l.powi(3));
        OmdExactConfig { eta, lambda, radius: Some(b) }
    }
}

/// The damping shape f of omd-hvp-cg: λ_t = max(λ_min, λ0·f(min(1, t/T))).
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DampingSchedule {
    /// f(u) = u (the paper's choice).
    Linear,
    /// f(u) = log(1 + (e − 1)u), so f(1) = 1.
    Log,
    /// f(u) = 1.
    Constant,
}

impl DampingSchedule {
    pub fn as_str(&self) -> &'static str {
        match self {
            DampingSchedule::Linear => "linear",
            DampingSchedule::Log => "log",
            DampingSchedule::Constant => "constant",
        }
    }
}

impl FromStr for DampingSchedule {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "linear" => Ok(DampingSchedule::Linear),
            "log" => Ok(DampingSchedule::Log),
            "constant" => Ok(DampingSchedule::Constant),
            _ => Err(format!("unknown damping schedule `{s}`: expected linear, log or constant")),
        }
    }
}

/// `omd-hvp-cg`: paper Alg. 5. Read straight from an `[[estimator]]` table (its keys are these
/// fields; a key not among them is an error, a missing one takes the default).
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HvpCgConfig {
    /// η of θ ← θ − η v (default 1e-3).
    pub lr: f64,
    /// K, the CG steps (default 3).
    pub cg_steps: usize,
    /// λ0 (default 0.8).
    pub lambda0: f64,
    /// The damping shape f of λ_t = max(λ_min, λ0·f(min(1, t/T))).
    pub schedule: DampingSchedule,
    /// Floor of λ_t (default 1e-6), so the system stays positive definite at t = 1.
    pub lambda_min: f64,
    /// ε of CG's relative stopping rule ‖r‖ ≤ ε‖g‖ (default 1e-5).
    pub cg_tol: f64,
}

impl Default for HvpCgConfig {
    fn default() -> Self {
        HvpCgConfig {
            cg_steps: 3,
            lambda0: 0.8,
            schedule: DampingSchedule::Linear,
            lambda_min: 1e-6,
            lr: 1e-3,
            cg_tol: 1e-5,
        }
    }
}

/// `omd-reference`: what `rm_trainer_head_hvp.py` computes (reference-code.md §2.3).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OmdReferenceConfig {
    pub lr: f64,
    /// `--damping` λ0: the constant damping inside CG and the mixing weight (default 0.8).
    pub lambda0: f64,
    /// `--damping_growth_rate` G: c_t = min((1 − λ0)·t/G + λ0, 1), SGD once c_t ≥ 1 (default 100).
    pub growth: f64,
    /// `--num_cg_steps` K (default 3).
    pub cg_steps: usize,
    /// Round θ to bf16 after every update (the authors updated bf16 weights in place).
    pub bf16_weights: bool,
    /// `--use_momentum`: run the authors' Adam (§2.4) on the mixed direction ("hvp-adam"),
    /// with this config's `lr` (the `lr` above is then unused).
    pub adam: Option<AdamConfig>,
}

impl Default for OmdReferenceConfig {
    fn default() -> Self {
        OmdReferenceConfig { lr: 1e-3, lambda0: 0.8, growth: 100.0, cg_steps: 3, bf16_weights: false, adam: None }
    }
}

/// `sgd`: θ ← θ − lr·clip(g).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SgdConfig {
    pub lr: f64,
    /// Global-norm clipping threshold (default 1.0, as DeepSpeed's `gradient_clipping` in the
    /// authors' baseline); `None` disables it.
    pub clip: Option<f64>,
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig { lr: 1e-3, clip: Some(1.0) }
    }
}

/// `adam`, `adam-reference` and the Adam half of `omd-hvp-cg+adam`; read straight from an
/// `[[estimator]]` table.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdamConfig {
    /// Step size.
    pub lr: f64,
    /// β₁ of the first moment.
    pub beta1: f64,
    /// β₂ of the second moment.
    pub beta2: f64,
    /// ε of the denominator.
    pub eps: f64,
}

impl Default for AdamConfig {
    fn default() -> Self {
        AdamConfig { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8 }
    }
}

/// How `mle` re-fits.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MleSolver {
    /// Damped Newton with the exact d×d Hessian: O(t·d² + d³) per iteration, small d only.
    Newton,
    /// L-BFGS with an Armijo line search: O(t·d) per iteration.
    Lbfgs,
}

impl MleSolver {
    pub fn as_str(&self) -> &'static str {
        match self {
            MleSolver::Newton => "newton",
            MleSolver::Lbfgs => "lbfgs",
        }
    }
}

impl FromStr for MleSolver {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "newton" => Ok(MleSolver::Newton),
            "lbfgs" => Ok(MleSolver::Lbfgs),
            _ => Err(format!("unknown mle solver `{s}`: expected newton or lbfgs")),
        }
    }
}

/// `mle`: argmin Σ_{i≤t} ℓ_i(θ) + ridge·t·‖θ‖², re-fitted every `refit_every` updates; read
/// straight from an `[[estimator]]` table.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MleConfig {
    /// Default 1e-4 (so the optimum exists while the data are separable).
    pub ridge: f64,
    /// Default 1.
    pub refit_every: u64,
    /// Default L-BFGS (Newton is exact but O(d³)).
    pub solver: MleSolver,
    /// Iteration cap of one re-fit (default 200); a re-fit that hits it reports converged = false.
    pub max_iters: u32,
    /// Pairs kept by L-BFGS (default 10).
    pub lbfgs_memory: usize,
}

impl Default for MleConfig {
    fn default() -> Self {
        MleConfig { ridge: 1e-4, refit_every: 1, solver: MleSolver::Lbfgs, max_iters: 200, lbfgs_memory: 10 }
    }
}

/// `sgd-replay`: SGD, plus one SGD pass over every stored batch after each step with t % R = 0.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ReplayConfig {
    pub sgd: SgdConfig,
    /// R (default 200, the authors' `--retrain_step`).
    pub every: u64,
}

impl Default for ReplayConfig {
    fn default() -> Self {
        ReplayConfig { sgd: SgdConfig::default(), every: 200 }
    }
}

/// `ensemble`: K linear heads θ_1..θ_K over the same φ, each trained with Adam on minibatches
/// of a replay buffer that keeps every labelled pair (memory O(t)), after oat's `EnnEETS`
/// reward model (sail-sg/oat, `oat/rm/model.py`, `oat/rm/networks.py`); its θ is the heads'
/// mean. Read straight from an `[[estimator]]` table.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EnsembleConfig {
    /// K, the number of heads (oat's `num_ensemble`, default 20).
    pub heads: usize,
    /// Adam's learning rate (oat's `rm_lr`, default 1e-3); β₁ = 0.9, β₂ = 0.999, ε = 1e-8 as
    /// torch's Adam.
    pub lr: f64,
    /// L2 weight decay added to the gradient, as torch's `Adam(weight_decay=…)` (oat's `rm_wd`,
    /// default 5e-5).
    pub weight_decay: f64,
    /// λ of oat's prior term λ·(m/t)·mean over all weights of (θ − θ⁰)², which anchors each
    /// head to its own random start (oat's `enn_lambda`, default 0.5; m the minibatch, t the
    /// labels so far). 0 switches it off.
    pub prior: f64,
    /// Adam steps per update, each on a fresh minibatch of the buffer (oat's `rm_sgd_steps`,
    /// default 5).
    pub steps_per_update: u32,
    /// Minibatch size m (oat's `train_bs`, default 128); while the buffer holds fewer pairs,
    /// the minibatch is the whole buffer (oat skips training until it holds m).
    pub batch: usize,
    /// Head k starts at θ_1 + ε_k, ε_k drawn per head from N(0, (init_scale/√d)²) truncated at
    /// ±2 standard deviations: oat's init of a linear layer is init_scale = 0.5 (the default).
    pub init_scale: f64,
    /// false (oat's, the default): one minibatch drawn without replacement, shared by every
    /// head, so the heads differ by their random starts and prior only; true: each head draws
    /// its own minibatch with replacement (a bootstrap resample of the buffer).
    pub bootstrap: bool,
}

impl Default for EnsembleConfig {
    fn default() -> Self {
        EnsembleConfig {
            heads: 20,
            lr: 1e-3,
            weight_decay: 5e-5,
            prior: 0.5,
            steps_per_update: 5,
            batch: 128,
            init_scale: 0.5,
            bootstrap: false,
        }
    }
}

/// One estimator with its hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum EstimatorConfig {
    OmdExact(OmdExactConfig),
    OmdHvpCg(HvpCgConfig),
    OmdReference(OmdReferenceConfig),
    Sgd(SgdConfig),
    Mle(MleConfig),
    Adam(AdamConfig),
    AdamReference(AdamConfig),
    OmdHvpCgAdam { cg: HvpCgConfig, adam: AdamConfig },
    SgdReplay(ReplayConfig),
    Ensemble(EnsembleConfig),
}

impl EstimatorConfig {
    /// The config of `kind` with every default.
    pub fn default_for(kind: Kind) -> Self {
        match kind {
            Kind::OmdExact => EstimatorConfig::OmdExact(Default::default()),
            Kind::OmdHvpCg => EstimatorConfig::OmdHvpCg(Default::default()),
            Kind::OmdReference => EstimatorConfig::OmdReference(Default::default()),
            Kind::Sgd => EstimatorConfig::Sgd(Default::default()),
            Kind::Mle => EstimatorConfig::Mle(Default::default()),
            Kind::Adam => EstimatorConfig::Adam(Default::default()),
            Kind::AdamReference => EstimatorConfig::AdamReference(Default::default()),
            Kind::OmdHvpCgAdam => EstimatorConfig::OmdHvpCgAdam { cg: Default::default(), adam: Default::default() },
            Kind::SgdReplay => EstimatorConfig::SgdReplay(Default::default()),
            Kind::Ensemble => EstimatorConfig::Ensemble(Default::default()),
        }
    }

    pub fn kind(&self) -> Kind {
        match self {
            EstimatorConfig::OmdExact(_) => Kind::OmdExact,
            EstimatorConfig::OmdHvpCg(_) => Kind::OmdHvpCg,
            EstimatorConfig::OmdReference(_) => Kind::OmdReference,
            EstimatorConfig::Sgd(_) => Kind::Sgd,
            EstimatorConfig::Mle(_) => Kind::Mle,
            EstimatorConfig::Adam(_) => Kind::Adam,
            EstimatorConfig::AdamReference(_) => Kind::AdamReference,
            EstimatorConfig::OmdHvpCgAdam { .. } => Kind::OmdHvpCgAdam,
            EstimatorConfig::SgdReplay(_) => Kind::SgdReplay,
            EstimatorConfig::Ensemble(_) => Kind::Ensemble,
        }
    }

    /// Range checks of every hyper-parameter, and what they need of `setup`.
    pub fn validate(&self, setup: &Setup) -> Result<(), EstimatorError> {
        let c = Check { kind: self.kind().as_str() };
        if setup.dim == 0 {
            return c.bad("dim", "0".into(), "d ≥ 1");
        }
        if let crate::Init::Normal { std: Some(s) } = setup.init {
            c.non_negative("init.std", s)?;
        }
        match self {
            EstimatorConfig::OmdExact(o) => {
                c.positive("eta", o.eta)?;
                c.positive("lambda", o.lambda)?;
                if let Some(r) = o.radius {
                    c.positive("radius", r)?;
                }
                Ok(())
            }
            EstimatorConfig::OmdHvpCg(g) => c.cg(g, setup),
            EstimatorConfig::OmdHvpCgAdam { cg: g, adam: a } => {
                c.cg(g, setup)?;
                c.adam(a)
            }
            EstimatorConfig::OmdReference(o) => c.omd_reference(o, setup),
            EstimatorConfig::Sgd(g) => c.sgd(g),
            EstimatorConfig::SgdReplay(r) => {
                c.sgd(&r.sgd)?;
                c.at_least_one("every", r.every, "R ≥ 1")
            }
            EstimatorConfig::Adam(a) | EstimatorConfig::AdamReference(a) => c.adam(a),
            EstimatorConfig::Mle(m) => {
                c.non_negative("ridge", m.ridge)?;
                c.at_least_one("refit_every", m.refit_every, "≥ 1")?;
                c.at_least_one("max_iters", m.max_iters, "≥ 1")?;
                c.at_least_one("lbfgs_memory", m.lbfgs_memory, "≥ 1")
            }
            EstimatorConfig::Ensemble(e) => c.ensemble(e),
        }
    }
}

/// The checks of [`EstimatorConfig::validate`], each naming the estimator kind, the field, its
/// value and what was expected.
struct Check {
    kind: &'static str,
}

impl Check {
    fn bad(&self, field: &'static str, value: String, expected: &'static str) -> Result<(), EstimatorError> {
        Err(EstimatorError::BadConfig { kind: self.kind, field, value, expected })
    }

    fn positive(&self, field: &'static str, v: f64) -> Result<(), EstimatorError> {
        if v.is_finite() && v > 0.0 {
            Ok(())
        } else {
            self.bad(field, v.to_string(), "a finite number > 0")
        }
    }

    fn non_negative(&self, field: &'static str, v: f64) -> Result<(), EstimatorError> {
        if v.is_finite() && v >= 0.0 {
            Ok(())
        } else {
            self.bad(field, v.to_string(), "a finite number ≥ 0")
        }
    }

    /// A count that must not be 0 (any unsigned integer type).
    fn at_least_one<T: PartialEq + Default>(
        &self,
        field: &'static str,
        v: T,
        expected: &'static str,
    ) -> Result<(), EstimatorError> {
        if v == T::default() {
            self.bad(field, "0".into(), expected)
        } else {
            Ok(())
        }
    }

    fn adam(&self, a: &AdamConfig) -> Result<(), EstimatorError> {
        self.positive("lr", a.lr)?;
        self.positive("eps", a.eps)?;
        for (f, b) in [("beta1", a.beta1), ("beta2", a.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return self.bad(f, b.to_string(), "a number in [0, 1)");
            }
        }
        Ok(())
    }

    fn sgd(&self, s: &SgdConfig) -> Result<(), EstimatorError> {
        self.positive("lr", s.lr)?;
        if let Some(c) = s.clip {
            self.positive("clip", c)?;
        }
        Ok(())
    }

    fn cg(&self, c: &HvpCgConfig, setup: &Setup) -> Result<(), EstimatorError> {
        self.at_least_one("cg_steps", c.cg_steps, "K ≥ 1")?;
        self.positive("lambda0", c.lambda0)?;
        self.positive("lambda_min", c.lambda_min)?;
        self.positive("lr", c.lr)?;
        if !(c.cg_tol >= 0.0 && c.cg_tol < 1.0) {
            return self.bad("cg_tol", c.cg_tol.to_string(), "a number in [0, 1)");
        }
        if c.schedule != DampingSchedule::Constant && setup.planned_steps.unwrap_or(0) == 0 {
            return self.bad(
                "planned_steps",
                format!("{:?}", setup.planned_steps),
                "T ≥ 1 for a linear or log damping schedule",
            );
        }
        Ok(())
    }

    fn omd_reference(&self, c: &OmdReferenceConfig, setup: &Setup) -> Result<(), EstimatorError> {
        self.positive("lr", c.lr)?;
        if !(c.lambda0 > 0.0 && c.lambda0 <= 1.0) {
            return self.bad("lambda0", c.lambda0.to_string(), "a number in (0, 1]");
        }
        self.at_least_one("cg_steps", c.cg_steps, "K ≥ 1")?;
        self.positive("growth", c.growth)?;
        if c.growth <= 1.0 && setup.planned_steps.unwrap_or(0) == 0 {
            return self.bad(
                "planned_steps",
                format!("{:?}", setup.planned_steps),
                "T ≥ 1 when growth ≤ 1 (c_t uses t/T then)",
            );
        }
        if let Some(a) = &c.adam {
            self.adam(a)?;
        }
        Ok(())
    }

    fn ensemble(&self, e: &EnsembleConfig) -> Result<(), EstimatorError> {
        if e.heads < 2 {
            return self.bad("heads", e.heads.to_string(), "K ≥ 2 (one head has no spread)");
        }
        self.positive("lr", e.lr)?;
        for (f, v) in [("weight_decay", e.weight_decay), ("prior", e.prior), ("init_scale", e.init_scale)] {
            self.non_negative(f, v)?;
        }
        self.at_least_one("steps_per_update", e.steps_per_update, "≥ 1")?;
        self.at_least_one("batch", e.batch, "≥ 1")
    }
}
