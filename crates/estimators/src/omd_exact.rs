//! `omd-exact`: paper Alg. 1 / Eq. (3), one sample at a time in batch order.
//!
//! With u = 𝓗_t⁻¹z and q = zᵀu, Sherman–Morrison gives
//!   H̃_t⁻¹g_t = (σ − y)·u / (1 + ησ'(zᵀθ_t)·q),
//!   𝓗_{t+1}⁻¹ = 𝓗_t⁻¹ − s·u uᵀ / (1 + s·q),  s = σ'(zᵀθ_{t+1})   (the look-ahead point),
//! so one u serves both. 𝓗⁻¹ is kept in f64, packed (upper triangle), and the rank-one update
//! of sample t is deferred and fused with the matvec of sample t+1: a step streams the matrix
//! once (read + write), the least any O(d²) update can do.
//!
//! Projection (optional): θ_{t+1} = argmin_{‖θ‖₂ ≤ B} ‖θ − θ′‖_{H̃_t}. When ‖θ′‖ > B the KKT
//! conditions give θ(μ) = (H̃_t + μI)⁻¹H̃_t θ′ with ‖θ(μ)‖ = B, μ > 0. In the eigenbasis of
//! H̃_t (eigenvalues λᵢ, coordinates cᵢ of θ′) ‖θ(μ)‖² = Σ (λᵢcᵢ/(λᵢ+μ))², and 1/‖θ(μ)‖ is
//! concave and increasing in μ, so Newton from μ = 0 converges monotonically (the trust-region
//! secular equation). Cost when the constraint binds: one symmetric eigendecomposition of the
//! dense H̃_t⁻¹, O(d³) time and O(d²) extra memory, plus O(d) per Newton iteration; nothing
//! when it does not bind (‖θ′‖ ≤ B is checked first, O(d)).

use crate::config::{Kind, OmdExactConfig};
use crate::linalg::{dot_f64, norm_f64, PackedSym};
use crate::logistic::{sigmoid, sigmoid_prime};
use crate::{Batch, Counters, Estimator, EstimatorError, PrequentialF64, StepReport};
use nalgebra::{DMatrix, DVector, SymmetricEigen};

/// Outcome of the last projection.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Projection {
    /// How many samples so far had ‖θ′‖ > B.
    pub count: u64,
    /// μ of the last binding projection.
    pub mu: f64,
    /// Newton iterations of the last binding projection.
    pub iterations: u32,
}

#[derive(serde::Serialize, serde::Deserialize)]
pub struct OmdExact {
    cfg: OmdExactConfig,
    theta: Vec<f64>,
    hinv: PackedSym,
    /// Deferred 𝓗⁻¹ ← 𝓗⁻¹ − pending_c·pending_u pending_uᵀ (pending_c = 0: nothing pending).
    pending_c: f64,
    pending_u: Vec<f64>,
    steps: u64,
    counters: Counters,
    projection: Projection,
    // scratch
    zd: Vec<f64>,
    u: Vec<f64>,
    stats: PrequentialF64,
    old: Vec<f64>,
}

impl OmdExact {
    pub fn new(cfg: OmdExactConfig, theta0: Vec<f64>) -> Result<Self, EstimatorError> {
        let d = theta0.len();
        Ok(OmdExact {
            cfg,
            hinv: PackedSym::scaled_identity(d, 1.0 / cfg.lambda),
            theta: theta0,
            pending_c: 0.0,
            pending_u: vec![0.0; d],
            steps: 0,
            counters: Counters::default(),
            projection: Projection::default(),
            zd: vec![0.0; d],
            u: vec![0.0; d],
            stats: PrequentialF64::default(),
            old: vec![0.0; d],
        })
    }

    /// 𝓗_{t}⁻¹ after all updates so far (applies the deferred rank-one update first).
    pub fn inverse_hessian(&mut self) -> &PackedSym {
        self.flush();
        &self.hinv
    }

    /// ‖x‖ in the 𝓗_t⁻¹ norm, for confidence widths (a negative form, rounding drift, is
    /// counted in `negative_quad_forms` and taken as 0).
    pub fn inverse_norm(&mut self, x: &[f64]) -> f64 {
        self.flush();
        let q = self.hinv.quad_form(x);
        if q < 0.0 {
            self.counters.negative_quad_forms += 1;
        }
        q.max(0.0).sqrt()
    }

    pub fn projection(&self) -> Projection {
        self.projection
    }

    fn flush(&mut self) {
        if self.pending_c != 0.0 {
            self.hinv.rank1_update(self.pending_c, &self.pending_u);
            self.pending_c = 0.0;
        }
    }

    /// One sample of Alg. 1; θ and 𝓗⁻¹ advance by one round.
    fn sample(&mut self, z: &[f32], y: f64) {
        let d = self.theta.len();
        for (a, &b) in self.zd.iter_mut().zip(z) {
            *a = f64::from(b);
        }
        // u = 𝓗_t⁻¹ z, applying the previous sample's deferred update in the same pass.
        if self.pending_c != 0.0 {
            self.hinv.rank1_update_matvec(self.pending_c, &self.pending_u, &self.zd, &mut self.u);
            self.pending_c = 0.0;
        } else {
            self.hinv.matvec(&self.zd, &mut self.u);
        }
        let eta = self.cfg.eta;
        let m = dot_f64(&self.zd, &self.theta);
        let (s, sp) = (sigmoid(m), sigmoid_prime(m));
        let mut q = dot_f64(&self.zd, &self.u);
        if q < 0.0 {
            // 𝓗⁻¹ is positive definite: a negative zᵀ𝓗⁻¹z is drift of the maintained inverse;
            // counted, and taken as 0 so that 1 + ησ′q stays ≥ 1
            self.counters.negative_quad_forms += 1;
            q = 0.0;
        }
        let denom = 1.0 + eta * sp * q;
        let coef = eta * (s - y) / denom;
        for (t, &ui) in self.theta.iter_mut().zip(&self.u) {
            *t -= coef * ui;
        }
        if let Some(radius) = self.cfg.radius {
            if norm_f64(&self.theta) > radius {
                // H̃_t⁻¹ = 𝓗_t⁻¹ − (ησ'/(1 + ησ'q))·u uᵀ
                let c = eta * sp / denom;
                let mut dense = self.hinv.to_dense();
                for i in 0..d {
                    for j in 0..d {
                        dense[i * d + j] -= c * self.u[i] * self.u[j];
                    }
                }
                let (theta, mu, iterations) = project(d, dense, &self.theta, radius);
                self.theta = theta;
                self.projection = Projection { count: self.projection.count + 1, mu, iterations };
                let dd = d as u64;
                self.counters.flops += 10 * dd * dd * dd; // eigendecomposition, order of magnitude
            }
        }
        // 𝓗_{t+1} = 𝓗_t + σ'(zᵀθ_{t+1}) zzᵀ, deferred to the next pass over the matrix.
        let s_next = sigmoid_prime(dot_f64(&self.zd, &self.theta));
        self.pending_c = s_next / (1.0 + s_next * q);
        std::mem::swap(&mut self.pending_u, &mut self.u);
    }
}

/// argmin_{‖θ‖ ≤ r} ‖θ − θ′‖_{H̃} given the dense H̃⁻¹ (row-major); returns (θ, μ, iterations).
fn project(d: usize, htilde_inv: Vec<f64>, theta_prime: &[f64], r: f64) -> (Vec<f64>, f64, u32) {
    let eig = SymmetricEigen::new(DMatrix::from_row_slice(d, d, &htilde_inv));
    // eigenvalues of H̃ are the reciprocals of those of H̃⁻¹ (all > 0: H̃ ⪰ λI)
    let lam: Vec<f64> = eig.eigenvalues.iter().map(|&s| 1.0 / s).collect();
    let c = eig.eigenvectors.transpose() * DVector::from_column_slice(theta_prime);
    let norm_at = |mu: f64| -> (f64, f64) {
        // ψ(μ) = ‖θ(μ)‖², ψ'(μ)
        let (mut psi, mut dpsi) = (0.0, 0.0);
        for i in 0..d {
            let a = lam[i] * c[i] / (lam[i] + mu);
            psi += a * a;
            dpsi += -2.0 * a * a / (lam[i] + mu);
        }
        (psi, dpsi)
    };
    let mut mu = 0.0;
    let mut iterations = 0;
    for _ in 0..100 {
        let (psi, dpsi) = norm_at(mu);
        let norm = psi.sqrt();
        if (norm - r).abs() <= 1e-13 * r {
            break;
        }
        // Newton on f(μ) = ψ^{-1/2} − 1/r, f' = −½ψ^{-3/2}ψ'
        let f = 1.0 / norm - 1.0 / r;
        let fp = -0.5 * dpsi / (psi * norm);
        mu -= f / fp;
        iterations += 1;
    }
    let shrunk = DVector::from_iterator(d, (0..d).map(|i| lam[i] * c[i] / (lam[i] + mu)));
    let theta = &eig.eigenvectors * shrunk;
    (theta.iter().copied().collect(), mu, iterations)
}

impl Estimator for OmdExact {
    fn kind(&self) -> Kind {
        Kind::OmdExact
    }

    fn inverse_norm(&mut self, x: &[f64]) -> Option<f64> {
        Some(OmdExact::inverse_norm(self, x))
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
        crate::SnapshotRef::OmdExact(self)
    }

    fn state_bytes(&self) -> usize {
        self.hinv.bytes() + 5 * self.theta.len() * 8 + self.stats.bytes()
    }

    fn update(&mut self, batch: &Batch<'_>) -> Result<StepReport, EstimatorError> {
        let d = self.theta.len();
        let (before, grad_norm) = self.stats.measure(batch, &self.theta)?;
        self.steps += 1;
        let b = batch.len();
        self.old.copy_from_slice(&self.theta);
        let flops_before = self.counters.flops;
        let negative_before = self.counters.negative_quad_forms;
        for (row, &y) in batch.rows().zip(batch.y()) {
            self.sample(row, f64::from(y));
        }
        let (step_norm, cos_step_grad) = self.stats.step_geometry(&self.old, &self.theta, grad_norm);
        if !step_norm.is_finite() {
            return Err(EstimatorError::NonFinite { kind: "omd-exact", step: self.steps });
        }
        let dd = d as u64;
        // per sample: fused update+matvec (3 multiply-adds per packed entry) and O(d) vector work;
        // per batch: margins and the diagnostic gradient
        let cost = Counters {
            grad_evals: b as u64,
            hvp_evals: 0,
            flops: (self.counters.flops - flops_before) + b as u64 * (3 * dd * (dd + 1) + 12 * dd) + 4 * b as u64 * dd,
            negative_quad_forms: self.counters.negative_quad_forms - negative_before,
        };
        self.counters.grad_evals += cost.grad_evals;
        self.counters.flops = flops_before + cost.flops;
        Ok(StepReport {
            before,
            grad_norm,
            step_norm,
            clip_factor: 1.0,
            cos_step_grad,
            damping: f64::NAN,
            inner_iters: 0,
            converged: true,
            cost,
        })
    }
}
