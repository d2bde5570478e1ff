//! The O(d)-per-step family: a direction (gradient, paper Alg. 5, or the authors' coded
//! update) fed to an optimizer (SGD with clipping, Adam, or the authors' Adam), optionally
//! with a replay pass (sgd-replay). θ is kept in f32, as the authors' fp32 master weights.

use crate::cg::{self, CgOptions, CgScratch};
use crate::config::*;
use crate::linalg::{axpy_f32, damped_hvp_f32, gemv_f32, gemv_t_f32, gram_f32, norm_f32, step_geometry};
use crate::logistic::BatchStats;
use crate::rule::{clip_factor, round_bf16, Optimizer, Rule};
use crate::{Batch, Counters, Estimator, EstimatorError, StepReport};

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
    theta: Vec<f32>,
    /// The direction and optimizer (sgd-replay's is sgd's).
    rule: Rule,
    replay: Option<Replay>,
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
    old: Vec<f32>,
    cg: CgScratch,
}

impl FirstOrder {
    /// `cfg` must be one of the first-order kinds; `theta0` is the initial θ.
    pub fn new(cfg: &EstimatorConfig, theta0: Vec<f64>, planned_steps: Option<u64>) -> Result<Self, EstimatorError> {
        let d = theta0.len();
        let rule = Rule::new(cfg, d, planned_steps)?;
        let replay = match cfg {
            EstimatorConfig::SgdReplay(r) => {
                Some(Replay { every: r.every, z: Vec::new(), y: Vec::new(), sizes: Vec::new() })
            }
            _ => None,
        };
        let mut theta: Vec<f32> = theta0.iter().map(|&v| v as f32).collect();
        if rule.bf16_weights() {
            round_bf16(&mut theta);
        }
        Ok(FirstOrder {
            theta,
            rule,
            replay,
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

    /// sgd-replay: stores the batch, and every R steps runs one SGD pass over all stored
    /// batches, its gradients and flops added to `cost`. Nothing for the other rules.
    fn replay_pass(&mut self, batch: &Batch<'_>, cost: &mut Counters) -> Result<(), EstimatorError> {
        let Some(mut r) = self.replay.take() else { return Ok(()) };
        let d = self.theta.len();
        r.z.extend_from_slice(batch.z());
        r.y.extend_from_slice(batch.y());
        r.sizes.push(batch.len());
        if self.rule.steps().is_multiple_of(r.every) {
            let mut start = 0;
            for &n in &r.sizes {
                let end = start + n;
                let rb = Batch::new(&r.z[start * d..end * d], &r.y[start..end], d)?;
                self.plain_sgd_step(&rb);
                cost.grad_evals += (end - start) as u64;
                cost.flops += 4 * ((end - start) * d) as u64 + 4 * d as u64;
                start = end;
            }
        }
        self.replay = Some(r);
        Ok(())
    }

    /// θ ← θ − lr·clip(g) on one batch (sgd-replay's replay pass).
    fn plain_sgd_step(&mut self, batch: &Batch<'_>) {
        self.gradient(batch);
        if let Optimizer::Sgd { lr, clip } = self.rule.opt {
            let cf = clip_factor(norm_f32(&self.g), clip) as f32;
            axpy_f32(-lr * cf, &self.g, &mut self.theta);
        }
    }
}

impl Estimator for FirstOrder {
    fn kind(&self) -> Kind {
        self.rule.kind()
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
        self.rule.steps()
    }

    fn counters(&self) -> Counters {
        self.counters
    }

    fn snapshot(&self) -> crate::SnapshotRef<'_> {
        crate::SnapshotRef::FirstOrder(self)
    }

    fn state_bytes(&self) -> usize {
        let f = std::mem::size_of::<f32>();
        let vecs = 3 * self.theta.len() * f + 3 * self.theta.len() * f; // θ, g, old + CG r, p, Ap
        let replay = self.replay.as_ref().map_or(0, |r| (r.z.len() + r.y.len()) * f + r.sizes.len() * 8);
        // the rule: the direction and Adam's moments
        vecs + self.rule.state_bytes() + replay + (self.margins.len() * 3) * 8 + self.w.len() * f
    }

    fn update(&mut self, batch: &Batch<'_>) -> Result<StepReport, EstimatorError> {
        let d = self.theta.len();
        if batch.dim() != d {
            return Err(EstimatorError::BadBatch { what: format!("dimension {}: expected {d}", batch.dim()) });
        }
        let b = batch.len();
        let (bd, d64) = ((b * d) as u64, d as u64);
        let before = self.gradient(batch);
        let grad_norm = norm_f32(&self.g);
        let mut cost = Counters { grad_evals: b as u64, hvp_evals: 0, flops: 4 * bd, negative_quad_forms: 0 };

        // The direction's solve on H_B + λI = ZᵀWZ/B + λI. It runs in row space (one pass
        // over Z for G = ZZᵀ) when that is cheaper than K HVPs (two passes each):
        // B(B+1)/2 ≤ 4K·B/2.
        let mut solve_flops = 0u64;
        let mut solve = |lambda: f32, opts: &CgOptions, g: &[f32], dir: &mut [f32]| -> u32 {
            if b < 4 * opts.steps {
                self.gram.resize(b * b, 0.0);
                gram_f32(batch.z(), d, &mut self.gram);
                self.w64.clear();
                self.w64.extend(self.curv.iter().map(|&s| s / b as f64));
                self.c64.clear();
                self.c64.extend(self.coef.iter().map(|&c| c / b as f64));
                self.beta.resize(b, 0.0);
                let it = cg::solve_row_space(&self.gram, &self.w64, f64::from(lambda), &self.c64, opts, &mut self.beta);
                self.c32.clear();
                self.c32.extend(self.beta.iter().map(|&v| v as f32));
                gemv_t_f32(batch.z(), &self.c32, dir);
                solve_flops += (b * (b + 1)) as u64 * d64 + 2 * bd + u64::from(it) * 6 * (b * b) as u64;
                it
            } else {
                self.w.clear();
                self.w.extend(self.curv.iter().map(|&s| (s / b as f64) as f32));
                let (z, w, sc) = (batch.z(), &self.w, &mut self.c32);
                let it = cg::solve(|p, out| damped_hvp_f32(z, w, p, lambda, sc, out), g, opts, dir, &mut self.cg);
                solve_flops += u64::from(it) * (4 * bd + 12 * d64);
                it
            }
        };
        self.old.copy_from_slice(&self.theta);
        let g = std::mem::take(&mut self.g);
        let mut theta = std::mem::take(&mut self.theta);
        let step = self.rule.step(&mut theta, &g, &mut solve);
        (self.g, self.theta) = (g, theta);
        cost.flops += solve_flops + step.flops;
        let (damping, inner_iters, clip) = (step.damping, step.inner_iters, step.clip_factor);
        cost.hvp_evals = u64::from(inner_iters) * b as u64;

        // Step geometry, against the gradient at θ_t.
        let (ss, sg) = step_geometry(&self.old, &self.theta, &self.g, &mut self.rule.dir);
        let step_norm = ss.sqrt();
        if !step_norm.is_finite() {
            return Err(EstimatorError::NonFinite { kind: self.rule.kind().as_str(), step: self.rule.steps() });
        }
        let cos_step_grad = if step_norm > 0.0 && grad_norm > 0.0 { sg / (step_norm * grad_norm) } else { 0.0 };

        self.replay_pass(batch, &mut cost)?;
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
