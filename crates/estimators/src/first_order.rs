//! The O(d)-per-step family: a direction (gradient, paper Alg. 5, or the authors' coded
//! update) fed to an optimizer (SGD with clipping, Adam, or the authors' Adam), optionally
//! with a replay pass (sgd-replay). θ is kept in f32, as the authors' fp32 master weights.

use crate::cg::{self, Beta, CgOptions, CgScratch, Stop};
use crate::config::*;
use crate::linalg::{axpy_f32, damped_hvp_f32, gemv_f32, gemv_t_f32, gram_f32, norm_f32, step_geometry};
use crate::logistic::BatchStats;
use crate::{Batch, Counters, Estimator, EstimatorError, StepReport};

#[derive(serde::Serialize, serde::Deserialize)]
enum Direction {
    Gradient,
    /// Paper Alg. 5.
    Paper(HvpCgConfig),
    /// reference-code.md §2.3.
    Reference(OmdReferenceConfig),
}

#[derive(serde::Serialize, serde::Deserialize)]
enum Optimizer {
    Sgd { lr: f32, clip: Option<f64> },
    Adam { cfg: AdamConfig, reference: bool, m: Vec<f32>, v: Vec<f32>, t: u64 },
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Replay {
    every: u64,
    z: Vec<f32>,
    y: Vec<f32>,
    /// Size of each stored batch, so replays keep the original batch boundaries.
    sizes: Vec<usize>,
}

/// omd-hvp-cg, omd-reference, sgd, adam, adam-reference, omd-hvp-cg+adam and sgd-replay.
#[derive(serde::Serialize, serde::Deserialize)]
pub struct FirstOrder {
    kind: Kind,
    theta: Vec<f32>,
    direction: Direction,
    opt: Optimizer,
    replay: Option<Replay>,
    bf16: bool,
    planned_steps: Option<u64>,
    steps: u64,
    counters: Counters,
    // scratch, sized on first use, so a step allocates nothing
    margins: Vec<f64>,
    coef: Vec<f64>,
    curv: Vec<f64>,
    w: Vec<f32>,
    /// Per-row coefficients (gradient cᵢ/B, HVP scratch).
    c32: Vec<f32>,
    gram: Vec<f64>,
    w64: Vec<f64>,
    c64: Vec<f64>,
    beta: Vec<f64>,
    g: Vec<f32>,
    dir: Vec<f32>,
    old: Vec<f32>,
    cg: CgScratch,
}

fn adam_state(cfg: AdamConfig, reference: bool, d: usize) -> Optimizer {
    Optimizer::Adam { cfg, reference, m: vec![0.0; d], v: vec![0.0; d], t: 0 }
}

fn sgd(s: &SgdConfig) -> Optimizer {
    Optimizer::Sgd { lr: s.lr as f32, clip: s.clip }
}

impl FirstOrder {
    /// `cfg` must be one of the first-order kinds; `theta0` is the initial θ.
    pub fn new(cfg: &EstimatorConfig, theta0: Vec<f64>, planned_steps: Option<u64>) -> Result<Self, EstimatorError> {
        let d = theta0.len();
        let no_clip = |lr: f64| Optimizer::Sgd { lr: lr as f32, clip: None };
        let (direction, opt, replay, bf16) = match cfg {
            EstimatorConfig::OmdHvpCg(c) => (Direction::Paper(*c), no_clip(c.lr), None, false),
            EstimatorConfig::OmdHvpCgAdam { cg, adam } => {
                (Direction::Paper(*cg), adam_state(*adam, false, d), None, false)
            }
            EstimatorConfig::OmdReference(c) => {
                let opt = match c.adam {
                    Some(a) => adam_state(a, true, d),
                    None => no_clip(c.lr),
                };
                (Direction::Reference(*c), opt, None, c.bf16_weights)
            }
            EstimatorConfig::Sgd(s) => (Direction::Gradient, sgd(s), None, false),
            EstimatorConfig::Adam(a) => (Direction::Gradient, adam_state(*a, false, d), None, false),
            EstimatorConfig::AdamReference(a) => (Direction::Gradient, adam_state(*a, true, d), None, false),
            EstimatorConfig::SgdReplay(r) => (
                Direction::Gradient,
                sgd(&r.sgd),
                Some(Replay { every: r.every, z: Vec::new(), y: Vec::new(), sizes: Vec::new() }),
                false,
            ),
            EstimatorConfig::OmdExact(_) | EstimatorConfig::Mle(_) => {
                return Err(EstimatorError::BadConfig {
                    kind: cfg.kind().as_str(),
                    field: "kind",
                    value: cfg.kind().to_string(),
                    expected: "a first-order estimator",
                })
            }
        };
        let mut theta: Vec<f32> = theta0.iter().map(|&v| v as f32).collect();
        if bf16 {
            round_bf16(&mut theta);
        }
        Ok(FirstOrder {
            kind: cfg.kind(),
            theta,
            direction,
            opt,
            replay,
            bf16,
            planned_steps,
            steps: 0,
            counters: Counters::default(),
            margins: Vec::new(),
            coef: Vec::new(),
            curv: Vec::new(),
            w: Vec::new(),
            c32: Vec::new(),
            gram: Vec::new(),
            w64: Vec::new(),
            c64: Vec::new(),
            beta: Vec::new(),
            g: vec![0.0; d],
            dir: vec![0.0; d],
            old: vec![0.0; d],
            cg: CgScratch::new(d),
        })
    }

    /// The current θ in the precision it is kept in.
    pub fn theta_f32(&self) -> &[f32] {
        &self.theta
    }

    /// Margins, loss statistics, and the batch-mean gradient into `self.g`.
    fn gradient(&mut self, batch: &Batch<'_>) -> BatchStats {
        let b = batch.len();
        for v in [&mut self.margins, &mut self.coef, &mut self.curv] {
            v.resize(b, 0.0);
        }
        self.c32.resize(b, 0.0);
        gemv_f32(batch.z(), &self.theta, &mut self.c32);
        for (m, &v) in self.margins.iter_mut().zip(&self.c32) {
            *m = f64::from(v);
        }
        let stats = BatchStats::compute(&self.margins, batch.y(), &mut self.coef, &mut self.curv);
        self.c32.clear();
        self.c32.extend(self.coef.iter().map(|&c| (c / b as f64) as f32));
        gemv_t_f32(batch.z(), &self.c32, &mut self.g);
        stats
    }

    /// θ ← θ − lr·clip(g) on one batch (sgd-replay's replay pass).
    fn plain_sgd_step(&mut self, batch: &Batch<'_>) {
        self.gradient(batch);
        if let Optimizer::Sgd { lr, clip } = self.opt {
            let cf = clip_factor(norm_f32(&self.g), clip) as f32;
            axpy_f32(-lr * cf, &self.g, &mut self.theta);
        }
    }
}

fn clip_factor(norm: f64, clip: Option<f64>) -> f64 {
    // torch.nn.utils.clip_grad_norm_: coef = max_norm / (total_norm + 1e-6), clamped to 1.
    match clip {
        Some(c) => (c / (norm + 1e-6)).min(1.0),
        None => 1.0,
    }
}

fn round_bf16(x: &mut [f32]) {
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

impl Estimator for FirstOrder {
    fn kind(&self) -> Kind {
        self.kind
    }

    fn dim(&self) -> usize {
        self.theta.len()
    }

    fn theta_into(&self, out: &mut [f64]) {
        for (o, &v) in out.iter_mut().zip(&self.theta) {
            *o = f64::from(v);
        }
    }

    fn steps(&self) -> u64 {
        self.steps
    }

    fn counters(&self) -> Counters {
        self.counters
    }

    fn snapshot(&self) -> crate::SnapshotRef<'_> {
        crate::SnapshotRef::FirstOrder(self)
    }

    fn state_bytes(&self) -> usize {
        let f = std::mem::size_of::<f32>();
        let vecs = 4 * self.theta.len() * f + 3 * self.theta.len() * f; // θ, g, dir, old + CG r, p, Ap
        let moments = match &self.opt {
            Optimizer::Adam { m, v, .. } => (m.len() + v.len()) * f,
            Optimizer::Sgd { .. } => 0,
        };
        let replay = self.replay.as_ref().map_or(0, |r| (r.z.len() + r.y.len()) * f + r.sizes.len() * 8);
        vecs + moments + replay + (self.margins.len() * 3) * 8 + self.w.len() * f
    }

    fn update(&mut self, batch: &Batch<'_>) -> Result<StepReport, EstimatorError> {
        let d = self.theta.len();
        if batch.dim() != d {
            return Err(EstimatorError::BadBatch { what: format!("dimension {}: expected {d}", batch.dim()) });
        }
        self.steps += 1;
        let b = batch.len();
        let (bd, d64) = ((b * d) as u64, d as u64);
        let before = self.gradient(batch);
        let grad_norm = norm_f32(&self.g);
        let mut cost = Counters { grad_evals: b as u64, hvp_evals: 0, flops: 4 * bd, negative_quad_forms: 0 };
        let mut damping = f64::NAN;
        let mut inner_iters = 0;

        // Direction. CG on H_B + λI runs in row space (one pass over Z for G = ZZᵀ) when
        // that is cheaper than K HVPs (two passes each): B(B+1)/2 ≤ 4K·B/2.
        let cg_solve = |lambda: f32, opts: CgOptions, this: &mut FirstOrder, cost: &mut Counters| -> u32 {
            if b < 4 * opts.steps {
                this.gram.resize(b * b, 0.0);
                gram_f32(batch.z(), d, &mut this.gram);
                this.w64.clear();
                this.w64.extend(this.curv.iter().map(|&s| s / b as f64));
                this.c64.clear();
                this.c64.extend(this.coef.iter().map(|&c| c / b as f64));
                this.beta.resize(b, 0.0);
                let it =
                    cg::solve_row_space(&this.gram, &this.w64, f64::from(lambda), &this.c64, &opts, &mut this.beta);
                this.c32.clear();
                this.c32.extend(this.beta.iter().map(|&v| v as f32));
                gemv_t_f32(batch.z(), &this.c32, &mut this.dir);
                cost.flops += (b * (b + 1)) as u64 * d64 + 2 * bd + u64::from(it) * 6 * (b * b) as u64;
                it
            } else {
                this.w.clear();
                this.w.extend(this.curv.iter().map(|&s| (s / b as f64) as f32));
                let (z, w, sc) = (batch.z(), &this.w, &mut this.c32);
                let it = cg::solve(
                    |p, out| damped_hvp_f32(z, w, p, lambda, sc, out),
                    &this.g,
                    &opts,
                    &mut this.dir,
                    &mut this.cg,
                );
                cost.flops += u64::from(it) * (4 * bd + 12 * d64);
                it
            }
        };
        match self.direction {
            Direction::Gradient => self.dir.copy_from_slice(&self.g),
            Direction::Paper(c) => {
                damping = paper_damping(&c, self.steps, self.planned_steps);
                let opts = CgOptions {
                    steps: c.cg_steps,
                    beta: Beta::FletcherReeves,
                    alpha_eps: 0.0,
                    stop: Stop::Relative(c.cg_tol as f32),
                };
                inner_iters = cg_solve(damping as f32, opts, self, &mut cost);
            }
            Direction::Reference(c) => {
                damping = reference_gate(&c, self.steps, self.planned_steps);
                if damping < 1.0 {
                    let opts =
                        CgOptions { steps: c.cg_steps, beta: Beta::One, alpha_eps: 1e-8, stop: Stop::Absolute(1e-10) };
                    inner_iters = cg_solve(c.lambda0 as f32, opts, self, &mut cost);
                    if c.cg_steps > 1 {
                        let (l0, l1) = (c.lambda0 as f32, (1.0 - c.lambda0) as f32);
                        for (di, gi) in self.dir.iter_mut().zip(&self.g) {
                            *di = l0 * gi + l1 * *di;
                        }
                    }
                } else {
                    self.dir.copy_from_slice(&self.g);
                }
            }
        }
        cost.hvp_evals = u64::from(inner_iters) * b as u64;

        // Optimizer.
        self.old.copy_from_slice(&self.theta);
        let mut clip = 1.0;
        match &mut self.opt {
            Optimizer::Sgd { lr, clip: threshold } => {
                if threshold.is_some() {
                    clip = clip_factor(norm_f32(&self.dir), *threshold);
                }
                axpy_f32(-*lr * clip as f32, &self.dir, &mut self.theta);
                cost.flops += 4 * d64;
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
                for (((th, mi), vi), &u) in self.theta.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(&self.dir) {
                    *mi = k1 * *mi + a1 * u;
                    *vi = k2 * *vi + a2 * u * u;
                    *th -= lr * (*mi / bc1) / ((*vi / bc2).sqrt() + eps);
                }
                cost.flops += 12 * d64;
            }
        }
        if self.bf16 {
            round_bf16(&mut self.theta);
        }

        // Step geometry, against the gradient at θ_t.
        let (ss, sg) = step_geometry(&self.old, &self.theta, &self.g, &mut self.dir);
        let step_norm = ss.sqrt();
        if !step_norm.is_finite() {
            return Err(EstimatorError::NonFinite { kind: self.kind.as_str(), step: self.steps });
        }
        let cos_step_grad = if step_norm > 0.0 && grad_norm > 0.0 { sg / (step_norm * grad_norm) } else { 0.0 };

        // sgd-replay: store, and every R steps one SGD pass over all stored batches.
        if let Some(mut r) = self.replay.take() {
            r.z.extend_from_slice(batch.z());
            r.y.extend_from_slice(batch.y());
            r.sizes.push(b);
            if self.steps.is_multiple_of(r.every) {
                let mut start = 0;
                for &n in &r.sizes {
                    let end = start + n;
                    let rb = Batch::new(&r.z[start * d..end * d], &r.y[start..end], d)?;
                    self.plain_sgd_step(&rb);
                    cost.grad_evals += (end - start) as u64;
                    cost.flops += 4 * ((end - start) * d) as u64 + 4 * d64;
                    start = end;
                }
            }
            self.replay = Some(r);
        }

        self.counters.add(&cost);
        Ok(StepReport {
            before,
            grad_norm,
            step_norm,
            clip_factor: clip,
            cos_step_grad,
            damping,
            inner_iters,
            converged: true,
            cost,
        })
    }
}
