//! The update rule of the first-order family on a flat parameter vector: a direction (the
//! gradient, paper Alg. 5's damped Newton-CG, or the authors' coded mix of reference-code.md
//! §2.3) handed to an optimizer (SGD with clipping, Adam, the authors' Adam of §2.4).
//!
//! Only the direction's CG solve depends on the model: its products with the damped batch
//! Hessian. The caller passes that solve, so one rule runs on a linear head's θ
//! ([`crate::FirstOrder`]: closed-form HVPs on cached features) and on every trainable
//! parameter of a reward model whose features learn (issue 30; `policy::rm::model`: HVPs by
//! central differences of gradients).

use crate::cg::{Beta, CgOptions, Stop};
use crate::config::*;
use crate::linalg::{axpy_f32, norm_f32};
use crate::EstimatorError;

#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize)]
pub(crate) enum Direction {
    Gradient,
    /// Paper Alg. 5.
    Paper(HvpCgConfig),
    /// reference-code.md §2.3.
    Reference(OmdReferenceConfig),
}

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub(crate) enum Optimizer {
    Sgd { lr: f32, clip: Option<f64> },
    Adam { cfg: AdamConfig, reference: bool, m: Vec<f32>, v: Vec<f32>, t: u64 },
}

/// A direction and an optimizer of one first-order estimator kind, with their state (Adam's
/// moments, the step count the damping schedules read) and the direction's buffer.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Rule {
    kind: Kind,
    direction: Direction,
    pub(crate) opt: Optimizer,
    bf16: bool,
    planned_steps: Option<u64>,
    steps: u64,
    /// The number of parameters.
    d: usize,
    /// The direction of the last step (scratch of the step geometry afterwards): recomputed
    /// every step, so a checkpoint leaves it out.
    #[serde(skip)]
    pub(crate) dir: Vec<f32>,
}

/// What one [`Rule::step`] did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RuleStep {
    /// λ_t of paper Alg. 5, or the authors' gate c_t; NaN for a plain gradient direction.
    pub damping: f64,
    /// Products with the damped Hessian the CG solve took.
    pub inner_iters: u32,
    /// The clipping factor SGD applied (1 without clipping).
    pub clip_factor: f64,
    /// Floating-point operations of the optimizer's update (the solve counts its own).
    pub flops: u64,
}

/// Solves (H_B + λI) v = g approximately into `dir` with the given CG options and returns the
/// products with H_B + λI it took: the model-dependent half of a direction.
pub trait DampedSolve {
    fn solve(&mut self, lambda: f32, opts: &CgOptions, g: &[f32], dir: &mut [f32]) -> u32;
}

impl<F: FnMut(f32, &CgOptions, &[f32], &mut [f32]) -> u32> DampedSolve for F {
    fn solve(&mut self, lambda: f32, opts: &CgOptions, g: &[f32], dir: &mut [f32]) -> u32 {
        self(lambda, opts, g, dir)
    }
}

fn adam_state(cfg: AdamConfig, reference: bool, d: usize) -> Optimizer {
    Optimizer::Adam { cfg, reference, m: vec![0.0; d], v: vec![0.0; d], t: 0 }
}

pub(crate) fn clip_factor(norm: f64, clip: Option<f64>) -> f64 {
    // torch.nn.utils.clip_grad_norm_: coef = max_norm / (total_norm + 1e-6), clamped to 1.
    match clip {
        Some(c) => (c / (norm + 1e-6)).min(1.0),
        None => 1.0,
    }
}

pub(crate) fn round_bf16(x: &mut [f32]) {
    for v in x {
        *v = half::bf16::from_f32(*v).to_f32();
    }
}

/// λ_t = max(λ_min, λ0·f(min(1, t/T))) of paper Alg. 5, t the 1-based step.
pub(crate) fn paper_damping(c: &HvpCgConfig, t: u64, planned: Option<u64>) -> f64 {
    // u = min(1, t/T); a missing or zero T (only possible for the constant schedule, which
    // ignores u) reads as u = 1
    let u = planned.map_or(1.0, |t_max| (t as f64 / t_max as f64).min(1.0));
    let f = match c.schedule {
        DampingSchedule::Linear => u,
        DampingSchedule::Log => (1.0 + (std::f64::consts::E - 1.0) * u).ln(),
        DampingSchedule::Constant => 1.0,
    };
    (c.lambda0 * f).max(c.lambda_min)
}

/// c_t of the authors' `get_current_damping` ("linear"): t = steps/G if G > 1, else steps/T.
pub(crate) fn reference_gate(c: &OmdReferenceConfig, steps: u64, planned: Option<u64>) -> f64 {
    let t = if c.growth > 1.0 { steps as f64 / c.growth } else { steps as f64 / planned.unwrap_or(1).max(1) as f64 };
    ((1.0 - c.lambda0) * t + c.lambda0).min(1.0)
}

impl Rule {
    /// The rule of `cfg` on `d` parameters; `planned_steps` is T of the damping schedules.
    /// Kinds that keep more than a step's state (omd-exact's 𝓗_t, mle's history, sgd-replay's
    /// stored batches) have no rule of this form: [`crate::FirstOrder`] adds sgd-replay's
    /// replay on top of sgd's rule, the others are an error.
    pub fn new(cfg: &EstimatorConfig, d: usize, planned_steps: Option<u64>) -> Result<Rule, EstimatorError> {
        let no_clip = |lr: f64| Optimizer::Sgd { lr: lr as f32, clip: None };
        let sgd = |s: &SgdConfig| Optimizer::Sgd { lr: s.lr as f32, clip: s.clip };
        let (direction, opt, bf16) = match cfg {
            EstimatorConfig::OmdHvpCg(c) => (Direction::Paper(*c), no_clip(c.lr), false),
            EstimatorConfig::OmdHvpCgAdam { cg, adam } => (Direction::Paper(*cg), adam_state(*adam, false, d), false),
            EstimatorConfig::OmdReference(c) => {
                let opt = match c.adam {
                    Some(a) => adam_state(a, true, d),
                    None => no_clip(c.lr),
                };
                (Direction::Reference(*c), opt, c.bf16_weights)
            }
            EstimatorConfig::Sgd(s) => (Direction::Gradient, sgd(s), false),
            EstimatorConfig::SgdReplay(r) => (Direction::Gradient, sgd(&r.sgd), false),
            EstimatorConfig::Adam(a) => (Direction::Gradient, adam_state(*a, false, d), false),
            EstimatorConfig::AdamReference(a) => (Direction::Gradient, adam_state(*a, true, d), false),
            EstimatorConfig::OmdExact(_) | EstimatorConfig::Mle(_) | EstimatorConfig::Ensemble(_) => {
                return Err(EstimatorError::BadConfig {
                    kind: cfg.kind().as_str(),
                    field: "kind",
                    value: cfg.kind().to_string(),
                    expected: "a first-order estimator",
                })
            }
        };
        Ok(Rule { kind: cfg.kind(), direction, opt, bf16, planned_steps, steps: 0, d, dir: vec![0.0; d] })
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// The number of parameters.
    pub fn dim(&self) -> usize {
        self.d
    }

    /// Steps taken.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Whether parameters are rounded to bf16 after every update (omd-reference's
    /// `bf16_weights`): the caller rounds its initial parameters the same way.
    pub fn bf16_weights(&self) -> bool {
        self.bf16
    }

    /// Whether a step of this rule asks its [`DampedSolve`] for a direction at step `t`
    /// (1-based): paper Alg. 5 always, the authors' update while their gate c_t < 1.
    pub fn solves_at(&self, t: u64) -> bool {
        match self.direction {
            Direction::Gradient => false,
            Direction::Paper(_) => true,
            Direction::Reference(c) => reference_gate(&c, t, self.planned_steps) < 1.0,
        }
    }

    /// The direction of the last step.
    pub fn direction(&self) -> &[f32] {
        &self.dir
    }

    /// Bytes of the rule's state (the direction and Adam's moments).
    pub fn state_bytes(&self) -> usize {
        let f = std::mem::size_of::<f32>();
        let moments = match &self.opt {
            Optimizer::Adam { m, v, .. } => (m.len() + v.len()) * f,
            Optimizer::Sgd { .. } => 0,
        };
        self.d * f + moments
    }

    /// One update of `theta` from the batch gradient `g`: the direction (g itself; paper Alg.
    /// 5's v ≈ (H_B + λ_t I)⁻¹g by K CG steps with Fletcher–Reeves β and relative stopping; or
    /// the authors' d = λ0·g + (1 − λ0)·CG_K(H_B + λ0·I, g) with β ≡ 1 while c_t < 1), then
    /// θ ← θ − lr·clip(d) or an Adam step on d, then bf16 rounding when asked.
    pub fn step(&mut self, theta: &mut [f32], g: &[f32], solve: &mut impl DampedSolve) -> RuleStep {
        let d = self.d;
        assert!(theta.len() == d && g.len() == d, "a rule of {d} parameters given {} and {}", theta.len(), g.len());
        // a rule read back from a checkpoint has no direction buffer yet
        self.dir.resize(d, 0.0);
        self.steps += 1;
        let mut damping = f64::NAN;
        let mut inner_iters = 0;
        match self.direction {
            Direction::Gradient => self.dir.copy_from_slice(g),
            Direction::Paper(c) => {
                damping = paper_damping(&c, self.steps, self.planned_steps);
                let opts = CgOptions {
                    steps: c.cg_steps,
                    beta: Beta::FletcherReeves,
                    alpha_eps: 0.0,
                    stop: Stop::Relative(c.cg_tol as f32),
                };
                inner_iters = solve.solve(damping as f32, &opts, g, &mut self.dir);
            }
            Direction::Reference(c) => {
                damping = reference_gate(&c, self.steps, self.planned_steps);
                if damping < 1.0 {
                    let opts =
                        CgOptions { steps: c.cg_steps, beta: Beta::One, alpha_eps: 1e-8, stop: Stop::Absolute(1e-10) };
                    inner_iters = solve.solve(c.lambda0 as f32, &opts, g, &mut self.dir);
                    if c.cg_steps > 1 {
                        let (l0, l1) = (c.lambda0 as f32, (1.0 - c.lambda0) as f32);
                        for (di, gi) in self.dir.iter_mut().zip(g) {
                            *di = l0 * gi + l1 * *di;
                        }
                    }
                } else {
                    self.dir.copy_from_slice(g);
                }
            }
        }
        let d64 = d as u64;
        let mut clip = 1.0;
        let flops;
        match &mut self.opt {
            Optimizer::Sgd { lr, clip: threshold } => {
                if threshold.is_some() {
                    clip = clip_factor(norm_f32(&self.dir), *threshold);
                }
                axpy_f32(-*lr * clip as f32, &self.dir, theta);
                flops = 4 * d64;
            }
            Optimizer::Adam { cfg, reference, m, v, t } => {
                *t += 1;
                let (b1, b2) = (cfg.beta1 as f32, cfg.beta2 as f32);
                // reference-code.md §2.4: the authors' first step sets m = β1·u, v = β2·u², and
                // their bias correction uses the exponent t + 1.
                let first_buggy = *reference && *t == 1;
                let expo = if *reference { *t + 1 } else { *t } as i32;
                let bc1 = (1.0 - cfg.beta1.powi(expo)) as f32;
                let bc2 = (1.0 - cfg.beta2.powi(expo)) as f32;
                let (lr, eps) = (cfg.lr as f32, cfg.eps as f32);
                // the authors' first step: m = β1·u, v = β2·u² (their m, v start as if "1")
                let (a1, a2) = if first_buggy { (b1, b2) } else { (1.0 - b1, 1.0 - b2) };
                let (k1, k2) = if first_buggy { (0.0, 0.0) } else { (b1, b2) };
                for (((th, mi), vi), &u) in theta.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(&self.dir) {
                    *mi = k1 * *mi + a1 * u;
                    *vi = k2 * *vi + a2 * u * u;
                    *th -= lr * (*mi / bc1) / ((*vi / bc2).sqrt() + eps);
                }
                flops = 12 * d64;
            }
        }
        if self.bf16 {
            round_bf16(theta);
        }
        RuleStep { damping, inner_iters, clip_factor: clip, flops }
    }
}
