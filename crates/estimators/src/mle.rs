//! `mle`: paper Eq. (1) with a ridge, re-fitted on the whole history.
//!
//! F_t(θ) = Σ_{i≤t} ℓ_i(θ) + ρ·t·‖θ‖², t the number of samples so far. Every `refit_every`
//! updates θ is re-fitted from the previous fit (warm start) until ‖∇F_t‖ ≤ 1/t, by damped
//! Newton (exact Hessian, Cholesky) or L-BFGS. One evaluation of F_t reads all t stored
//! samples: the O(t) per-step cost the paper's method removes, visible in the counters.

use crate::config::{Kind, MleConfig, MleSolver};
use crate::linalg::{axpy_f32_f64, dot_f32_f64, dot_f64, norm_f64};
use crate::logistic::{log_loss, sigmoid, sigmoid_prime};
use crate::{Batch, Counters, Estimator, EstimatorError, PrequentialF64, StepReport};
use nalgebra::{DMatrix, DVector};
use std::collections::VecDeque;

#[derive(serde::Serialize, serde::Deserialize)]
pub struct Mle {
    cfg: MleConfig,
    theta: Vec<f64>,
    z: Vec<f32>,
    y: Vec<f32>,
    steps: u64,
    counters: Counters,
    stats: PrequentialF64,
}

/// F, ∇F and the per-sample evaluation count of one pass.
struct Objective<'a> {
    z: &'a [f32],
    y: &'a [f32],
    d: usize,
    /// ρ·t, so the ridge term is reg·‖θ‖².
    reg: f64,
    evals: u64,
}

impl Objective<'_> {
    fn n(&self) -> usize {
        self.y.len()
    }

    /// F(θ); writes ∇F into `grad` and the margins into `m`.
    fn eval(&mut self, theta: &[f64], grad: &mut [f64], m: &mut Vec<f64>) -> f64 {
        self.evals += self.n() as u64;
        m.clear();
        grad.fill(0.0);
        let mut f = self.reg * dot_f64(theta, theta);
        for (row, &y) in self.z.chunks_exact(self.d).zip(self.y) {
            let mi = dot_f32_f64(row, theta);
            let y = f64::from(y);
            f += log_loss(mi, y);
            axpy_f32_f64(sigmoid(mi) - y, row, grad);
            m.push(mi);
        }
        for (gi, ti) in grad.iter_mut().zip(theta) {
            *gi += 2.0 * self.reg * ti;
        }
        f
    }
}

/// Where a line search starts: the point and what is known there.
#[derive(Clone, Copy)]
struct LineStart<'a> {
    /// The current point θ.
    theta: &'a [f64],
    /// F(θ).
    f0: f64,
    /// The directional derivative ∇F(θ)·dir (negative along a descent direction).
    slope: f64,
    /// ‖∇F(θ)‖.
    g0_norm: f64,
}

/// Backtracking (Armijo, c = 1e-4) along `dir` from `start.theta`. On success `trial` holds the
/// new point, `grad` and `m` its gradient and margins, and the step and F(trial) are returned.
/// Every trial evaluates the gradient too: the first trial is almost always accepted, so this
/// saves the extra pass a value-only search would need afterwards.
fn armijo(
    obj: &mut Objective<'_>,
    start: LineStart<'_>,
    dir: &[f64],
    trial: &mut [f64],
    grad: &mut [f64],
    m: &mut Vec<f64>,
) -> Option<(f64, f64)> {
    let LineStart { theta, f0, slope, g0_norm } = start;
    let mut t = 1.0;
    for _ in 0..60 {
        for i in 0..theta.len() {
            trial[i] = theta[i] + t * dir[i];
        }
        let f = obj.eval(trial, grad, m);
        // Near the optimum F changes by less than its round-off; there a step that lowers
        // ‖∇F‖ without raising F beyond round-off is accepted too.
        let flat = f - f0 <= 1e-13 * f0.abs().max(1.0) && norm_f64(grad) < g0_norm;
        if f <= f0 + 1e-4 * t * slope || flat {
            return Some((t, f));
        }
        t *= 0.5;
    }
    None
}

/// Result of one re-fit.
struct Fit {
    iterations: u32,
    converged: bool,
    /// Multiply-adds per sample pass beyond 2 per coordinate (Newton's Hessian build).
    extra_flops: u64,
}

fn newton(obj: &mut Objective<'_>, theta: &mut [f64], tol: f64, max_iters: u32) -> Fit {
    let d = theta.len();
    let (mut grad, mut m, mut trial) = (vec![0.0; d], Vec::new(), vec![0.0; d]);
    let mut f = obj.eval(theta, &mut grad, &mut m);
    let mut extra = 0;
    for it in 0..max_iters {
        if norm_f64(&grad) <= tol {
            return Fit { iterations: it, converged: true, extra_flops: extra };
        }
        let mut h = DMatrix::<f64>::identity(d, d) * (2.0 * obj.reg);
        for (row, &mi) in obj.z.chunks_exact(d).zip(&m) {
            let w = sigmoid_prime(mi);
            let v = DVector::from_iterator(d, row.iter().map(|&x| f64::from(x)));
            h.syger(w, &v, &v, 1.0);
        }
        extra += (obj.n() * d * d * 2 + d * d * d / 3) as u64;
        let rhs = DVector::from_column_slice(&grad);
        let step = match h.cholesky() {
            Some(ch) => -ch.solve(&rhs),
            None => -rhs, // cannot happen for reg > 0; falls back to steepest descent
        };
        let slope = dot_f64(step.as_slice(), &grad);
        let g0 = norm_f64(&grad);
        match armijo(
            obj,
            LineStart { theta, f0: f, slope, g0_norm: g0 },
            step.as_slice(),
            &mut trial,
            &mut grad,
            &mut m,
        ) {
            Some((_, f_new)) => {
                theta.copy_from_slice(&trial);
                f = f_new;
            }
            None => return Fit { iterations: it + 1, converged: false, extra_flops: extra },
        }
    }
    Fit { iterations: max_iters, converged: norm_f64(&grad) <= tol, extra_flops: extra }
}

fn lbfgs(obj: &mut Objective<'_>, theta: &mut [f64], tol: f64, max_iters: u32, memory: usize) -> Fit {
    let d = theta.len();
    let (mut grad, mut m, mut trial) = (vec![0.0; d], Vec::new(), vec![0.0; d]);
    let mut new_grad = vec![0.0; d];
    let mut dir = vec![0.0; d];
    let mut pairs: VecDeque<(Vec<f64>, Vec<f64>, f64)> = VecDeque::with_capacity(memory);
    let mut f = obj.eval(theta, &mut grad, &mut m);
    for it in 0..max_iters {
        let gnorm = norm_f64(&grad);
        if gnorm <= tol {
            return Fit { iterations: it, converged: true, extra_flops: 0 };
        }
        // two-loop recursion: dir = −H_k ∇F
        dir.copy_from_slice(&grad);
        let mut alphas = Vec::with_capacity(pairs.len());
        for (s, y, rho) in pairs.iter().rev() {
            let a = rho * dot_f64(s, &dir);
            for i in 0..d {
                dir[i] -= a * y[i];
            }
            alphas.push(a);
        }
        let gamma = match pairs.back() {
            Some((s, y, _)) => dot_f64(s, y) / dot_f64(y, y),
            None => 1.0 / gnorm,
        };
        for v in dir.iter_mut() {
            *v *= gamma;
        }
        for ((s, y, rho), a) in pairs.iter().zip(alphas.iter().rev()) {
            let b = rho * dot_f64(y, &dir);
            for i in 0..d {
                dir[i] += (a - b) * s[i];
            }
        }
        for v in dir.iter_mut() {
            *v = -*v;
        }
        let mut slope = dot_f64(&dir, &grad);
        if slope >= 0.0 {
            // not a descent direction (round-off): restart from steepest descent
            pairs.clear();
            for i in 0..d {
                dir[i] = -grad[i] / gnorm;
            }
            slope = -gnorm;
        }
        let Some((t, f_new)) =
            armijo(obj, LineStart { theta, f0: f, slope, g0_norm: gnorm }, &dir, &mut trial, &mut new_grad, &mut m)
        else {
            return Fit { iterations: it + 1, converged: false, extra_flops: 0 };
        };
        let s: Vec<f64> = dir.iter().map(|v| t * v).collect();
        let y: Vec<f64> = new_grad.iter().zip(&grad).map(|(a, b)| a - b).collect();
        let sy = dot_f64(&s, &y);
        if sy > 1e-300 {
            if pairs.len() == memory {
                pairs.pop_front();
            }
            pairs.push_back((s, y, 1.0 / sy));
        }
        theta.copy_from_slice(&trial);
        std::mem::swap(&mut grad, &mut new_grad);
        f = f_new;
    }
    Fit { iterations: max_iters, converged: norm_f64(&grad) <= tol, extra_flops: 0 }
}

impl Mle {
    pub fn new(cfg: MleConfig, theta0: Vec<f64>) -> Self {
        Mle {
            cfg,
            theta: theta0,
            z: Vec::new(),
            y: Vec::new(),
            steps: 0,
            counters: Counters::default(),
            stats: PrequentialF64::default(),
        }
    }

    /// Re-fits on the stored history now, warm-started from the current θ; returns the solver
    /// iterations and whether ‖∇F_t‖ ≤ 1/t was reached. `update` calls this every
    /// `refit_every` steps; benchmarks call it directly.
    pub fn refit_now(&mut self) -> (u32, bool) {
        let mut cost = Counters::default();
        let fit = self.refit_into(&mut cost);
        self.counters.add(&cost);
        (fit.iterations, fit.converged)
    }

    fn refit_into(&mut self, cost: &mut Counters) -> Fit {
        let d = self.theta.len();
        let n = self.y.len();
        if n == 0 {
            return Fit { iterations: 0, converged: true, extra_flops: 0 };
        }
        let tol = 1.0 / n as f64;
        let mut obj = Objective { z: &self.z, y: &self.y, d, reg: self.cfg.ridge * n as f64, evals: 0 };
        let fit = match self.cfg.solver {
            MleSolver::Newton => newton(&mut obj, &mut self.theta, tol, self.cfg.max_iters),
            MleSolver::Lbfgs => lbfgs(&mut obj, &mut self.theta, tol, self.cfg.max_iters, self.cfg.lbfgs_memory),
        };
        cost.grad_evals += obj.evals;
        cost.flops += 4 * obj.evals * d as u64 + fit.extra_flops;
        fit
    }

    /// Samples stored so far.
    pub fn history_len(&self) -> usize {
        self.y.len()
    }

    /// ‖∇F_t(θ)‖ at the current θ over the stored history (for tests and diagnostics).
    pub fn objective_gradient_norm(&self) -> f64 {
        let d = self.theta.len();
        let mut obj = Objective { z: &self.z, y: &self.y, d, reg: self.cfg.ridge * self.y.len() as f64, evals: 0 };
        let mut g = vec![0.0; d];
        obj.eval(&self.theta, &mut g, &mut Vec::new());
        norm_f64(&g)
    }
}

impl Estimator for Mle {
    fn kind(&self) -> Kind {
        Kind::Mle
    }

    fn dim(&self) -> usize {
        self.theta.len()
    }

    fn theta_into(&self, out: &mut [f64]) {
        out.copy_from_slice(&self.theta);
    }

    fn steps(&self) -> u64 {
        self.steps
    }

    fn counters(&self) -> Counters {
        self.counters
    }

    fn snapshot(&self) -> crate::SnapshotRef<'_> {
        crate::SnapshotRef::Mle(self)
    }

    fn state_bytes(&self) -> usize {
        (self.z.len() + self.y.len()) * 4 + self.theta.len() * 8 + self.stats.bytes()
    }

    fn update(&mut self, batch: &Batch<'_>) -> Result<StepReport, EstimatorError> {
        let d = self.theta.len();
        let (before, grad_norm) = self.stats.measure(batch, &self.theta)?;
        self.steps += 1;
        let b = batch.len();
        self.z.extend_from_slice(batch.z());
        self.y.extend_from_slice(batch.y());
        let mut cost =
            Counters { grad_evals: b as u64, hvp_evals: 0, flops: 4 * (b * d) as u64, negative_quad_forms: 0 };
        let (mut step_norm, mut cos, mut iters, mut converged) = (0.0, 0.0, 0, true);
        if self.steps.is_multiple_of(self.cfg.refit_every) {
            let old = self.theta.clone();
            let fit = self.refit_into(&mut cost);
            (step_norm, cos) = self.stats.step_geometry(&old, &self.theta, grad_norm);
            iters = fit.iterations;
            converged = fit.converged;
            if !step_norm.is_finite() {
                return Err(EstimatorError::NonFinite { kind: "mle", step: self.steps });
            }
        }
        self.counters.add(&cost);
        Ok(StepReport {
            before,
            grad_norm,
            step_norm,
            clip_factor: 1.0,
            cos_step_grad: cos,
            damping: f64::NAN,
            inner_iters: iters,
            converged,
            cost,
        })
    }
}
