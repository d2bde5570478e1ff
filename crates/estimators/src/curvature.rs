//! A curvature tracker any setting can attach, whatever the estimator: it keeps M⁻¹ for
//! M = 𝓗_t = λI + Σ σ'(zᵢᵀθ) zᵢzᵢᵀ (the paper's local norm) or M = V_t = V₀I + Σ zᵢzᵢᵀ (the
//! authors' `uncertainty_score`), updated by Sherman–Morrison in O(d²) per sample, and answers
//! ‖x‖_{M⁻¹} = √(xᵀM⁻¹x) for the active-selection, UCB and pessimism rules.

use crate::linalg::{dot_f64, PackedSym};
use crate::logistic::sigmoid_prime;
use crate::Batch;

/// Where σ' is evaluated for the Hessian tracker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum HessianPoint {
    /// σ'(zᵀθ_{t+1}), after the update: the paper's look-ahead 𝓗_t.
    LookAhead,
    /// σ'(zᵀθ_t), before the update.
    Current,
}

#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum CurvatureKind {
    /// 𝓗 = λI + Σ σ'(zᵀθ) zzᵀ.
    Hessian { lambda: f64, point: HessianPoint },
    /// V = v0·I + Σ zzᵀ (v0 = 1e-5 in the authors' code).
    Gram { v0: f64 },
}

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Curvature {
    kind: CurvatureKind,
    inv: PackedSym,
    /// M itself, when asked for (norms ‖x‖_M, e.g. ‖θ − θ*‖_𝓗).
    forward: Option<PackedSym>,
    u: Vec<f64>,
    x: Vec<f64>,
    added: u64,
    /// Quadratic forms of M⁻¹ that came out negative (rounding drift) and were taken as 0.
    #[serde(default)]
    negative: std::cell::Cell<u64>,
}

impl Curvature {
    pub fn new(kind: CurvatureKind, dim: usize) -> Self {
        let base = match kind {
            CurvatureKind::Hessian { lambda, .. } => lambda,
            CurvatureKind::Gram { v0 } => v0,
        };
        assert!(base > 0.0 && base.is_finite(), "curvature base must be > 0 (validated by the caller)");
        Curvature {
            kind,
            inv: PackedSym::scaled_identity(dim, 1.0 / base),
            forward: None,
            u: vec![0.0; dim],
            x: vec![0.0; dim],
            added: 0,
            negative: std::cell::Cell::new(0),
        }
    }

    /// Also keeps M (one more O(d²) pass per added term), for [`Curvature::norm`].
    pub fn with_forward(kind: CurvatureKind, dim: usize) -> Self {
        let mut c = Curvature::new(kind, dim);
        let base = 1.0 / c.inv.get(0, 0);
        c.forward = Some(PackedSym::scaled_identity(dim, base));
        c
    }

    /// ‖x‖_M (needs [`Curvature::with_forward`]).
    pub fn norm(&self, x: &[f64]) -> Option<f64> {
        self.forward.as_ref().map(|m| m.quad_form(x).max(0.0).sqrt())
    }

    pub fn kind(&self) -> CurvatureKind {
        self.kind
    }

    pub fn dim(&self) -> usize {
        self.inv.dim()
    }

    /// Rank-one terms added so far.
    pub fn added(&self) -> u64 {
        self.added
    }

    /// M⁻¹.
    pub fn inverse(&self) -> &PackedSym {
        &self.inv
    }

    /// M ← M + w·xxᵀ.
    pub fn add(&mut self, x: &[f32], w: f64) {
        if w == 0.0 {
            return;
        }
        for (a, &b) in self.x.iter_mut().zip(x) {
            *a = f64::from(b);
        }
        self.inv.matvec(&self.x, &mut self.u);
        let q = dot_f64(&self.x, &self.u);
        self.inv.rank1_update(w / (1.0 + w * q), &self.u);
        if let Some(m) = &mut self.forward {
            m.rank1_update(-w, &self.x);
        }
        self.added += 1;
    }

    /// Adds every row of a batch the estimator just learned from, with the weight the kind
    /// prescribes (θ before and after the update are needed for the Hessian kinds).
    pub fn observe(&mut self, batch: &Batch<'_>, theta_before: &[f64], theta_after: &[f64]) {
        for row in batch.rows() {
            let w = match self.kind {
                CurvatureKind::Gram { .. } => 1.0,
                CurvatureKind::Hessian { point, .. } => {
                    let theta = match point {
                        HessianPoint::LookAhead => theta_after,
                        HessianPoint::Current => theta_before,
                    };
                    sigmoid_prime(crate::linalg::dot_f32_f64(row, theta))
                }
            };
            self.add(row, w);
        }
    }

    /// ‖x‖_{M⁻¹} (widens x into the tracker's scratch: no allocation).
    pub fn inv_norm(&mut self, x: &[f32]) -> f64 {
        for (a, &b) in self.x.iter_mut().zip(x) {
            *a = f64::from(b);
        }
        let q = self.inv.quad_form(&self.x);
        self.clamped(q)
    }

    /// ‖x‖_{M⁻¹} of an f64 vector.
    pub fn inv_norm_f64(&self, x: &[f64]) -> f64 {
        self.clamped(self.inv.quad_form(x))
    }

    /// √q, a negative q (drift of the maintained inverse: M⁻¹ is positive definite) counted and
    /// taken as 0.
    fn clamped(&self, q: f64) -> f64 {
        if q < 0.0 {
            self.negative.set(self.negative.get() + 1);
        }
        q.max(0.0).sqrt()
    }

    /// How many quadratic forms of M⁻¹ came out negative so far (each taken as 0).
    pub fn negative_quad_forms(&self) -> u64 {
        self.negative.get()
    }

    /// ‖xᵢ‖_{M⁻¹} for every row of row-major `xs`.
    pub fn inv_norms(&mut self, xs: &[f32]) -> Vec<f64> {
        let d = self.dim();
        xs.chunks_exact(d).map(|x| self.inv_norm(x)).collect()
    }
}
