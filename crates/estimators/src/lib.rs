//! Online estimators of a Bradley–Terry reward head θ from a stream of preference pairs.
//!
//! A mini-batch ([`Batch`]) holds feature differences z = φ(x,a) − φ(x,a′) (row-major `f32`)
//! and labels y ∈ {0,1}; the loss is the batch mean of ℓ(θ) = −y log σ(zᵀθ) − (1−y) log(1−σ(zᵀθ)).
//! Every estimator implements [`Estimator`]: `update` takes one batch and returns a
//! [`StepReport`] (statistics before the update, step geometry after it, and the
//! deterministic cost of the step as [`Counters`]).
//!
//! | name ([`Kind`]) | type | what it is |
//! |---|---|---|
//! | `omd-exact` | [`OmdExact`] | paper Alg. 1 / Eq. (3): look-ahead Hessian, Sherman–Morrison, optional projection |
//! | `omd-hvp-cg` | [`FirstOrder`] | paper Alg. 5: K CG steps on H_B + λ_t I, no past curvature |
//! | `omd-reference` | [`FirstOrder`] | the authors' coded update, bugs included (reference-code.md §2.3) |
//! | `sgd` | [`FirstOrder`] | one-pass SGD with global-norm clipping (the authors' "MLE") |
//! | `adam`, `adam-reference` | [`FirstOrder`] | Adam, and the authors' hand-written Adam (§2.4) |
//! | `omd-hvp-cg+adam` | [`FirstOrder`] | Adam on the Alg. 5 direction |
//! | `sgd-replay` | [`FirstOrder`] | SGD plus a replay pass every R steps (the authors' Active-MLE) |
//! | `mle` | [`Mle`] | Eq. (1) with a ridge, re-fit on the whole history (Newton or L-BFGS) |
//! | `ensemble` | [`Ensemble`] | K linear heads, Adam over a replay buffer (oat's `EnnEETS` reward model); θ = the heads' mean |
//!
//! [`build`] turns an [`EstimatorConfig`] into a boxed estimator. [`Curvature`] tracks 𝓗_t or
//! V_t for selection rules, whatever the estimator. Kernels ([`linalg`]) are plain loops with
//! fixed-order reductions, so a run is bit-reproducible across CPUs; this crate knows nothing
//! of files, specs or the command line.
//!
//! Files sit in this order, each naming only files before it (`crates/runner/tests/cycles.rs`
//! fails on a circle): `config`, `lib` → `linalg` → `logistic` → `cg`, `curvature`, `ensemble`,
//! `mle`, `omd_exact` → `rule` → `first_order`.

// Numeric kernels index several arrays in lock-step; index loops read better there.
#![allow(clippy::needless_range_loop)]

/// This crate's version (a run's meta.json records it).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

pub mod cg;
mod config;
pub mod curvature;
mod ensemble;
mod first_order;
pub mod linalg;
pub mod logistic;
mod mle;
mod omd_exact;
pub mod rule;

pub use config::*;
pub use curvature::{Curvature, CurvatureKind, HessianPoint};
pub use ensemble::Ensemble;
pub use first_order::FirstOrder;
pub use logistic::BatchStats;
pub use mle::Mle;
pub use omd_exact::{OmdExact, Projection};
pub use rule::{DampedSolve, Rule, RuleStep};

use rand::SeedableRng;
use rand_chacha::ChaCha20Rng;
use rand_distr::{Distribution, Normal};

/// Errors of this crate; each names what was wrong and what was expected.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum EstimatorError {
    #[error("batch: {what}")]
    BadBatch { what: String },
    #[error("{kind}: invalid hyper-parameter `{field}` = {value}: expected {expected}")]
    BadConfig { kind: &'static str, field: &'static str, value: String, expected: &'static str },
    #[error("{kind}: θ became non-finite at step {step}")]
    NonFinite { kind: &'static str, step: u64 },
}

/// A mini-batch of B feature differences (row-major, B × dim) and labels.
#[derive(Clone, Copy, Debug)]
pub struct Batch<'a> {
    z: &'a [f32],
    y: &'a [f32],
    dim: usize,
}

impl<'a> Batch<'a> {
    /// Checks shapes and labels (y ∈ [0, 1]; the paper's labels are 0 or 1). Features are not
    /// scanned for NaN here: data loaders check them once, and a NaN reaching an estimator
    /// surfaces as [`EstimatorError::NonFinite`].
    pub fn new(z: &'a [f32], y: &'a [f32], dim: usize) -> Result<Self, EstimatorError> {
        if dim == 0 {
            return Err(EstimatorError::BadBatch { what: "dimension 0: expected d ≥ 1".into() });
        }
        if y.is_empty() {
            return Err(EstimatorError::BadBatch { what: "no samples: expected at least one row".into() });
        }
        if z.len() != y.len() * dim {
            return Err(EstimatorError::BadBatch {
                what: format!(
                    "z has {} values for {} labels of dimension {dim}: expected {}",
                    z.len(),
                    y.len(),
                    y.len() * dim
                ),
            });
        }
        if let Some((i, v)) = y.iter().enumerate().find(|(_, v)| !(0.0..=1.0).contains(*v)) {
            return Err(EstimatorError::BadBatch { what: format!("label {i} is {v}: expected a value in [0, 1]") });
        }
        Ok(Batch { z, y, dim })
    }

    pub fn len(&self) -> usize {
        self.y.len()
    }

    pub fn is_empty(&self) -> bool {
        self.y.is_empty()
    }

    pub fn dim(&self) -> usize {
        self.dim
    }

    pub fn z(&self) -> &'a [f32] {
        self.z
    }

    pub fn y(&self) -> &'a [f32] {
        self.y
    }

    /// Row i of z.
    pub fn row(&self, i: usize) -> &'a [f32] {
        &self.z[i * self.dim..(i + 1) * self.dim]
    }

    pub fn rows(&self) -> impl Iterator<Item = &'a [f32]> + 'a {
        self.z.chunks_exact(self.dim)
    }
}

/// Deterministic cost counters (cumulative on an estimator, per step in a [`StepReport`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Counters {
    /// Per-sample gradient evaluations ((σ(zᵀθ) − y)·z for one z counts 1).
    pub grad_evals: u64,
    /// Per-sample Hessian-vector products (one batch HVP on B rows counts B).
    pub hvp_evals: u64,
    /// Floating-point operations of the update, counted analytically (a multiply-add is 2).
    pub flops: u64,
    /// Quadratic forms xᵀ𝓗⁻¹x that came out negative (rounding drift of a maintained inverse)
    /// and were taken as 0: omd-exact's zᵀ𝓗⁻¹z in its update and in its confidence widths.
    #[serde(default)]
    pub negative_quad_forms: u64,
}

impl Counters {
    pub fn add(&mut self, o: &Counters) {
        self.grad_evals += o.grad_evals;
        self.hvp_evals += o.hvp_evals;
        self.flops += o.flops;
        self.negative_quad_forms += o.negative_quad_forms;
    }
}

/// What one `update` saw and did.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StepReport {
    /// Loss, accuracy and κ of the batch at θ_t, before the update.
    pub before: BatchStats,
    /// ‖g‖ of the batch-mean gradient at θ_t.
    pub grad_norm: f64,
    /// ‖θ_{t+1} − θ_t‖.
    pub step_norm: f64,
    /// Factor gradient clipping applied to the direction (1 when none).
    pub clip_factor: f64,
    /// cos∠(θ_t − θ_{t+1}, g): 1 for a plain gradient step.
    pub cos_step_grad: f64,
    /// λ_t of omd-hvp-cg, c_t of omd-reference; NaN for estimators without damping.
    pub damping: f64,
    /// CG iterations run (omd-hvp-cg, omd-reference) or solver iterations (mle) this step.
    pub inner_iters: u32,
    /// mle: the re-fit reached ‖∇‖ ≤ 1/t (true for every other estimator).
    pub converged: bool,
    /// Cost of this step.
    pub cost: Counters,
}

/// An online estimator of θ. See the crate docs for the variants.
pub trait Estimator: Send {
    fn kind(&self) -> Kind;
    fn dim(&self) -> usize;
    /// Writes the current θ_t (widened to f64) into `out` (length `dim`), allocating nothing.
    fn theta_into(&self, out: &mut [f64]);
    /// The current θ_t (widened to f64).
    fn theta(&self) -> Vec<f64> {
        let mut out = vec![0.0; self.dim()];
        self.theta_into(&mut out);
        out
    }
    /// Consumes one batch: θ_t → θ_{t+1}.
    fn update(&mut self, batch: &Batch<'_>) -> Result<StepReport, EstimatorError>;
    /// Number of `update` calls so far.
    fn steps(&self) -> u64;
    /// Cumulative cost.
    fn counters(&self) -> Counters;
    /// Bytes of state the estimator holds (parameters, matrices, moments, history), for the
    /// memory-independent-of-t claims.
    fn state_bytes(&self) -> usize;
    /// ‖x‖_{𝓗_t⁻¹} from the estimator's own 𝓗_t, when it keeps one ([`Kind::keeps_curvature`]):
    /// the uncertainty Alg. 3 and Alg. 4 score with. `None` otherwise.
    fn inverse_norm(&mut self, _x: &[f64]) -> Option<f64> {
        None
    }
    /// The heads θ_1..θ_K of an ensemble, K × d head-major (what Thompson sampling and the
    /// ensemble's uncertainty rules draw from); `None` for an estimator of one θ.
    fn heads(&self) -> Option<&[f64]> {
        None
    }
    /// Everything the estimator holds, borrowed for serialisation (checkpoints): deserialised
    /// as a [`Snapshot`], it continues bit for bit as this estimator would.
    fn snapshot(&self) -> SnapshotRef<'_>;
}

/// An estimator's whole state, borrowed; serialises to the same bytes a [`Snapshot`] reads.
#[derive(serde::Serialize)]
pub enum SnapshotRef<'a> {
    OmdExact(&'a OmdExact),
    FirstOrder(&'a FirstOrder),
    Mle(&'a Mle),
    Ensemble(&'a Ensemble),
}

/// An estimator's whole state, owned (what a [`SnapshotRef`] serialised).
#[derive(serde::Deserialize)]
pub enum Snapshot {
    OmdExact(Box<OmdExact>),
    FirstOrder(Box<FirstOrder>),
    Mle(Box<Mle>),
    Ensemble(Box<Ensemble>),
}

impl Snapshot {
    /// The estimator again, continuing where the snapshot was taken.
    pub fn into_estimator(self) -> Box<dyn Estimator> {
        match self {
            Snapshot::OmdExact(e) => e,
            Snapshot::FirstOrder(e) => e,
            Snapshot::Mle(e) => e,
            Snapshot::Ensemble(e) => e,
        }
    }
}

/// Initial θ: zero (the paper's Alg. 2–4) or N(0, std²) from a seeded ChaCha20 stream (the
/// authors' head init uses std = 1/(d+1)).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    Zero,
    /// `std: None` means 1/(d+1).
    Normal {
        std: Option<f64>,
    },
}

impl Init {
    pub fn draw(&self, dim: usize, seed: u64) -> Vec<f64> {
        match *self {
            Init::Zero => vec![0.0; dim],
            Init::Normal { std } => {
                let std = std.unwrap_or(1.0 / (dim as f64 + 1.0));
                let mut rng = ChaCha20Rng::seed_from_u64(seed);
                let n = Normal::new(0.0, std).expect("std validated finite and ≥ 0");
                (0..dim).map(|_| n.sample(&mut rng)).collect()
            }
        }
    }
}

/// What every estimator needs besides its own hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Setup {
    pub dim: usize,
    pub init: Init,
    /// Seed of the initialisation stream.
    pub seed: u64,
    /// T, the planned number of `update` calls (the damping schedules of omd-hvp-cg and
    /// omd-reference need it).
    pub planned_steps: Option<u64>,
}

/// Builds the estimator a config describes.
pub fn build(cfg: &EstimatorConfig, setup: &Setup) -> Result<Box<dyn Estimator>, EstimatorError> {
    cfg.validate(setup)?;
    let theta0 = setup.init.draw(setup.dim, setup.seed);
    Ok(match cfg {
        EstimatorConfig::OmdExact(c) => Box::new(OmdExact::new(*c, theta0)?),
        EstimatorConfig::Mle(c) => Box::new(Mle::new(*c, theta0)),
        EstimatorConfig::Ensemble(c) => Box::new(Ensemble::new(*c, theta0, setup.seed)),
        other => Box::new(FirstOrder::new(other, theta0, setup.planned_steps)?),
    })
}

/// Per-batch statistics of an estimator that keeps θ in f64 (omd-exact, mle): margins, loss,
/// accuracy and κ at θ_t, and the batch-mean gradient `g` (for ‖g‖ and cos(step, g)).
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub(crate) struct PrequentialF64 {
    margins: Vec<f64>,
    coef: Vec<f64>,
    curv: Vec<f64>,
    pub g: Vec<f64>,
}

impl PrequentialF64 {
    /// Checks the batch's dimension, then measures it at `theta`; returns the stats and ‖g‖.
    pub fn measure(&mut self, batch: &Batch<'_>, theta: &[f64]) -> Result<(BatchStats, f64), EstimatorError> {
        let d = theta.len();
        if batch.dim() != d {
            return Err(EstimatorError::BadBatch { what: format!("dimension {}: expected {d}", batch.dim()) });
        }
        let b = batch.len();
        for v in [&mut self.margins, &mut self.coef, &mut self.curv] {
            v.resize(b, 0.0);
        }
        for (m, row) in self.margins.iter_mut().zip(batch.rows()) {
            *m = linalg::dot_f32_f64(row, theta);
        }
        let stats = BatchStats::compute(&self.margins, batch.y(), &mut self.coef, &mut self.curv);
        self.g.resize(d, 0.0);
        self.g.fill(0.0);
        for (row, &c) in batch.rows().zip(&self.coef) {
            linalg::axpy_f32_f64(c / b as f64, row, &mut self.g);
        }
        Ok((stats, linalg::norm_f64(&self.g)))
    }

    /// (‖old − new‖, cos∠(old − new, g)) with the `g` of the last `measure`.
    pub fn step_geometry(&self, old: &[f64], new: &[f64], grad_norm: f64) -> (f64, f64) {
        let (mut ss, mut sg) = (0.0, 0.0);
        for ((o, n), g) in old.iter().zip(new).zip(&self.g) {
            let s = o - n;
            ss += s * s;
            sg += s * g;
        }
        let step = ss.sqrt();
        (step, if step > 0.0 && grad_norm > 0.0 { sg / (step * grad_norm) } else { 0.0 })
    }

    pub fn bytes(&self) -> usize {
        (self.margins.len() * 3 + self.g.len()) * 8
    }
}
