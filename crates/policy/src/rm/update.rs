//! The one-pass update of a reward model's (ψ, θ) ([`crate::rm::model`]): [`OnePass`] updates
//! (ψ, θ) one batch at a time with the rules of the head-only estimators
//! ([`estimators::Rule`]: sgd, adam, the paper's Alg. 5 `omd-hvp-cg`, the authors'
//! `omd-reference`), each step on the batch alone: no replay, no stored history, so a step's
//! cost does not grow with t. Alg. 5's conjugate gradient needs Hessian–vector products over
//! every trainable parameter; candle has no double backward, so [`RewardModel::hvp`] takes them
//! by central differences of gradients (its doc states the step and its error), or exactly
//! ([`HvpScheme::Exact`]) by [`crate::rm::rop`].

use crate::rm::model::{flatten, unflatten, Gradient, RewardModel, RmPair};
use crate::rm::rop::Tape;
use candle_core::{Result, Tensor, Var};
use estimators::cg::{self, CgOptions, CgScratch};
use estimators::{EstimatorConfig, Rule, RuleStep};

/// The difference quotient of [`RewardModel::hvp_with`] (`"central"`, `"forward"`).
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum HvpScheme {
    /// (g(w + hv) − g(w − hv)) / 2h: two passes per product, error O(ε²).
    #[default]
    Central,
    /// (g(w + hv) − g(w)) / h with the step's own gradient g(w): one pass, error O(ε).
    Forward,
    /// Exact: Pearlmutter's R-operator ([`crate::rm::rop`]) — the step's gradient pass recorded,
    /// then a tangent forward and backward pass per product, about one gradient pass of
    /// products each. LoRA adapters and the head only.
    Exact,
    /// Not the Hessian: the Gauss–Newton matrix G = (1/B) Σ σ′(mᵢ) ∇mᵢ ∇mᵢᵀ
    /// ([`RewardModel::gauss_newton_vp`]), positive semi-definite where the Hessian of a network's
    /// loss is not; two forward passes and one backward per product.
    GaussNewton,
}

impl HvpScheme {
    /// The f32 model's balance of truncation and rounding, measured against exact HVPs
    /// (`tests/reward.rs`): ε = 3e-3 for central differences (relative error 1e-4–5e-4 on the
    /// tiny Llama), 3e-4 for forward ones (1e-3–5e-3).
    pub fn default_eps(&self) -> f64 {
        match self {
            HvpScheme::Central => 3e-3,
            HvpScheme::Forward => 3e-4,
            // central differences of the margins: the same balance as of the gradients
            HvpScheme::GaussNewton => 3e-3,
            // no step: the products are exact
            HvpScheme::Exact => 0.0,
        }
    }
}

/// How [`OnePass`] takes Hessian–vector products.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct HvpConfig {
    /// ε of [`RewardModel::hvp`]: how far the parameters move along the direction.
    pub eps: f64,
    pub scheme: HvpScheme,
}

impl Default for HvpConfig {
    /// Central differences at ε = 3e-3: the f32 model's balance of truncation and rounding
    /// ([`RewardModel::hvp`]).
    fn default() -> Self {
        HvpConfig { eps: HvpScheme::Central.default_eps(), scheme: HvpScheme::Central }
    }
}

/// What one [`OnePass::step`] did (loss, accuracy and κ at the step's start).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RmStep {
    pub before: estimators::BatchStats,
    pub grad_norm: f64,
    pub step_norm: f64,
    pub clip_factor: f64,
    /// λ_t or the authors' gate c_t (NaN for a gradient direction).
    pub damping: f64,
    /// Curvature products taken (the Hessian's: two gradients each centrally, one forward;
    /// the Gauss–Newton matrix's: two forward passes and one backward).
    pub hvps: u32,
    /// Whether the damped Hessian curved down along the gradient, so the direction was the
    /// gradient (Newton–CG's fallback; never for a linear head, whose H_B + λI is positive).
    pub negative_curvature: bool,
}

/// The one-pass update of a reward model's (ψ, θ) (issue 30): each step the batch's gradient
/// by backpropagation, the rule's direction (for Alg. 5 and the authors' update, K CG steps
/// on H_B + λI with [`RewardModel::hvp`]), the rule's optimizer on the flat parameters. The
/// state is the rule's (Adam's moments, the step count): nothing grows with t.
#[derive(serde::Serialize, serde::Deserialize)]
pub struct OnePass {
    rule: Rule,
    hvp: HvpConfig,
    /// The backbone's step relative to the head's: ψ ← ψ_t + s·(ψ_rule − ψ_t). 1 is the rule
    /// as it is over all parameters.
    backbone_scale: f64,
    #[serde(skip)]
    cg: CgScratch,
}

impl OnePass {
    /// The update of estimator `cfg` (sgd, adam, adam-reference, omd-hvp-cg, omd-hvp-cg+adam,
    /// omd-reference: the kinds whose state does not grow with t) on `rm`'s parameters;
    /// `planned_steps` is T of the damping schedules.
    pub fn new(
        cfg: &EstimatorConfig,
        rm: &RewardModel,
        planned_steps: Option<u64>,
        hvp: HvpConfig,
        backbone_scale: f64,
    ) -> Result<OnePass> {
        use estimators::Kind;
        let kind = cfg.kind();
        if matches!(kind, Kind::OmdExact | Kind::Mle | Kind::SgdReplay) {
            candle_core::bail!(
                "estimator `{kind}` over a reward model's features: its state grows with t or is d×d; \
                 expected one of sgd, adam, adam-reference, omd-hvp-cg, omd-hvp-cg+adam, omd-reference"
            );
        }
        if !(backbone_scale.is_finite() && backbone_scale >= 0.0) {
            candle_core::bail!("a backbone step scale of {backbone_scale}: expected a finite number ≥ 0");
        }
        if hvp.scheme == HvpScheme::Exact
            && matches!(kind, Kind::OmdHvpCg | Kind::OmdHvpCgAdam | Kind::OmdReference)
            && !crate::rm::rop::Tape::applies(rm)
        {
            candle_core::bail!(
                "exact HVPs cover a reward model's LoRA adapters and head: this one {} (use central differences)",
                if rm.model.is_full() {
                    "trains every weight"
                } else {
                    "has no trainable adapters or has adapter dropout"
                }
            );
        }
        let rule = Rule::new(cfg, rm.dim(), planned_steps).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        Ok(OnePass { rule, hvp, backbone_scale, cg: CgScratch::default() })
    }

    pub fn steps(&self) -> u64 {
        self.rule.steps()
    }

    /// Bytes of the update's state besides the model: the rule's (direction, Adam's moments)
    /// and CG's work vectors.
    pub fn state_bytes(&self) -> usize {
        self.rule.state_bytes() + self.cg.bytes()
    }

    /// One step on `pairs` (paper Alg. 5 over (ψ, θ) for omd-hvp-cg). Errors: no pairs, a
    /// missing gradient, a non-finite gradient (before anything moves) or parameters that are
    /// not finite after the step. Its phases: the batch's gradient ([`OnePass::gradient`]), the
    /// rule's step with CG on the curvature products ([`OnePass::rule_step`]), the backbone's
    /// share of the step and the new parameters ([`OnePass::scale_and_set`]).
    pub fn step(&mut self, rm: &RewardModel, pairs: &[RmPair<'_>]) -> Result<RmStep> {
        if pairs.is_empty() {
            candle_core::bail!("reward model step {}: no pairs", self.steps() + 1);
        }
        let vars = rm.vars();
        if rm.dim() != self.rule.dim() {
            candle_core::bail!("a reward model of {} parameters for an update of {}", rm.dim(), self.rule.dim());
        }
        let (g0, tape, g, grad_norm) = self.gradient(rm, pairs)?;
        let old = rm.flat()?;
        let mut w = old.clone();
        let scheme = self.hvp.scheme;
        let curvature = Curvature {
            rm,
            pairs,
            vars,
            scheme,
            eps: self.hvp.eps,
            tape,
            g_at_w: (scheme == HvpScheme::Forward).then_some(g0.grads.as_slice()),
            curvature: g0.curvature.as_slice(),
        };
        let (st, hvps, negative_curvature) = self.rule_step(&curvature, &mut w, &g)?;
        let step_norm = self.scale_and_set(rm, &old, &mut w)?;
        Ok(RmStep {
            before: g0.stats,
            grad_norm,
            step_norm,
            clip_factor: st.clip_factor,
            damping: st.damping,
            hvps,
            negative_curvature,
        })
    }

    /// The batch's gradient at the step's start — with the exact products' tape when the step
    /// solves with them — as ([`Gradient`], the tape, the flat gradient, its norm); an error
    /// when the norm is not finite (the loss diverged), before anything moves.
    fn gradient(&self, rm: &RewardModel, pairs: &[RmPair<'_>]) -> Result<(Gradient, Option<Tape>, Vec<f32>, f64)> {
        // the exact products' tape comes from the step's own gradient pass
        // (only for a step that solves: another rule's gradient stays autograd's, bit for bit)
        let solves = self.rule.solves_at(self.rule.steps() + 1);
        let (g0, tape) = match self.hvp.scheme {
            HvpScheme::Exact if solves => {
                let (g, t) = rm.gradient_tape(pairs)?;
                (g, Some(t))
            }
            _ => (rm.gradient(pairs)?, None),
        };
        let g = flatten(&g0.grads)?;
        let grad_norm = estimators::linalg::norm_f32(&g);
        if !grad_norm.is_finite() {
            candle_core::bail!(
                "reward model step {}: the gradient's norm is {grad_norm}: the loss diverged; no step was taken",
                self.steps() + 1
            );
        }
        Ok((g0, tape, g, grad_norm))
    }

    /// The rule's step of the flat parameters `w` along the flat gradient `g`, its CG solves of
    /// (H_B + λI) v = g on `curvature`'s products (Newton–CG's steepest-descent fallback where
    /// H_B + λI curves down along g): (the rule's report, the products taken, whether a solve
    /// fell back). A product's error is the step's, once the rule has returned.
    fn rule_step(&mut self, curvature: &Curvature<'_, '_>, w: &mut [f32], g: &[f32]) -> Result<(RuleStep, u32, bool)> {
        let mut failed: Option<candle_core::Error> = None;
        let (mut hvps, mut downhill) = (0u32, 0u32);
        let cg_scratch = &mut self.cg;
        let mut solve = |lambda: f32, opts: &CgOptions, g: &[f32], dir: &mut [f32]| -> u32 {
            let apply = |p: &[f32], out: &mut [f32]| {
                if failed.is_some() {
                    out.fill(0.0);
                    return;
                }
                match curvature.product(p) {
                    Ok(hv) => {
                        hvps += 1;
                        for ((o, h), p) in out.iter_mut().zip(hv).zip(p) {
                            *o = h + lambda * p;
                        }
                    }
                    Err(e) => {
                        failed = Some(e);
                        out.fill(0.0);
                    }
                }
            };
            let it = cg::solve(apply, g, opts, dir, cg_scratch);
            // The batch loss of a network is not convex: H_B + λI can curve down along g
            // itself, where CG stops at its first product with v = 0. Newton–CG then takes
            // the steepest-descent direction (Nocedal & Wright, Numerical Optimization,
            // Alg. 7.1); past the first product it keeps the iterate, as CG does.
            if it == 1 && dir.iter().all(|&x| x == 0.0) && g.iter().any(|&x| x != 0.0) {
                dir.copy_from_slice(g);
                downhill += 1;
            }
            it
        };
        let st = self.rule.step(w, g, &mut solve);
        if let Some(e) = failed {
            return Err(e);
        }
        Ok((st, hvps, downhill > 0))
    }

    /// The backbone's share of the step, ψ ← ψ_t + s·(ψ_rule − ψ_t) (θ's step as the rule made
    /// it), then the parameters set to `w`; returns ‖w − old‖, an error when not finite.
    fn scale_and_set(&self, rm: &RewardModel, old: &[f32], w: &mut [f32]) -> Result<f64> {
        let n_psi = w.len() - rm.head.as_tensor().elem_count();
        if self.backbone_scale != 1.0 {
            let s = self.backbone_scale as f32;
            for (x, o) in w[..n_psi].iter_mut().zip(&old[..n_psi]) {
                *x = o + s * (*x - o);
            }
        }
        let step_norm = w.iter().zip(old).map(|(a, b)| f64::from(a - b).powi(2)).sum::<f64>().sqrt();
        if !step_norm.is_finite() {
            candle_core::bail!("reward model step {}: the parameters are no longer finite", self.steps());
        }
        rm.set_flat(w)?;
        Ok(step_norm)
    }
}

/// What a step's CG multiplies by, at the step's parameters: H_B v by differences of gradients
/// (central, or forward from the step's own gradient), exactly on the step's tape
/// ([`crate::rm::rop`]), or the Gauss–Newton product G v ([`HvpScheme`]).
struct Curvature<'a, 'p> {
    rm: &'a RewardModel,
    pairs: &'a [RmPair<'p>],
    /// The trainable variables, whose shapes a flat direction takes.
    vars: Vec<&'a Var>,
    scheme: HvpScheme,
    /// ε of the differences.
    eps: f64,
    /// The step's gradient pass recorded (exact products at a step that solves).
    tape: Option<Tape>,
    /// The step's own gradient g(w) (forward differences only).
    g_at_w: Option<&'a [Tensor]>,
    /// σ′(mᵢ) of the pairs' margins (the Gauss–Newton product's weights).
    curvature: &'a [f64],
}

impl Curvature<'_, '_> {
    /// The product with the flat direction `p`, flat.
    fn product(&self, p: &[f32]) -> Result<Vec<f32>> {
        unflatten(p, &self.vars)
            .and_then(|v| match (self.scheme, &self.tape) {
                (HvpScheme::Exact, Some(t)) => t.hvp(&v),
                (HvpScheme::Exact, None) => {
                    Err(candle_core::Error::Msg("exact HVPs asked for at a step that was not to solve".into()))
                }
                (HvpScheme::GaussNewton, _) => self.rm.gauss_newton_vp(self.pairs, &v, self.eps, self.curvature),
                _ => self.rm.hvp_with(self.pairs, &v, self.eps, self.g_at_w),
            })
            .and_then(|hv| flatten(&hv))
    }
}
