//! `ensemble`: K linear heads over the same φ, trained with Adam on minibatches of a replay
//! buffer of every labelled pair, after oat's `EnnEETS` reward model (sail-sg/oat,
//! `oat/rm/model.py` and `oat/rm/networks.py`, read at revision c1a074c).
//!
//! What is kept of oat: K = 20 heads; Adam (lr 1e-3, torch's L2 `weight_decay` 5e-5 added to
//! the gradient); 5 Adam steps per update, each on a minibatch of 128 pairs drawn uniformly
//! without replacement from the buffer and shared by every head; the loss is the mean over
//! heads and pairs of −log σ(r(chosen) − r(rejected)), plus oat's prior term
//! λ·(m/t)·mean_w (w − w⁰)² (λ = `enn_lambda` = 0.5) that anchors each head to its random start;
//! heads start independently, truncated normal with std 1/(2√d) (oat's `init_weights`).
//!
//! What differs: oat's heads are MLPs (two hidden layers of 128, ReLU) over a frozen backbone's
//! features of each response; here a head is linear, r_k(x,a) = φ(x,a)ᵀθ_k. An [`crate::Batch`]
//! carries only the difference z = φ(a) − φ(a′), which determines a linear head's margin
//! r_k(a) − r_k(a′) = zᵀθ_k but not an MLP's; and the linear Bradley–Terry model is the one
//! the paper and its synthetic bandit assume, so the comparison with one-pass OMD is on the
//! same model class. The ensemble's mean reward is then φᵀθ̄ with θ̄ the heads' mean, which is
//! the θ every metric of the runner reads. While the buffer holds fewer than m pairs the
//! minibatch is the whole buffer (oat skips training until it holds m).
//!
//! Randomness: the heads' starts and every minibatch come from ChaCha20 streams of the
//! estimator's seed (stream 1 for the starts, stream 2 + s for Adam step s), so nothing but the
//! seed and the step count is needed to continue a run from a checkpoint.

use crate::config::{EnsembleConfig, Kind};
use crate::linalg::{axpy_f32_f64, dot_f32_f64};
use crate::logistic::sigmoid;
use crate::{Batch, Counters, Estimator, EstimatorError, PrequentialF64, StepReport};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;
use rand_distr::{Distribution, Normal};

const BETA1: f64 = 0.9;
const BETA2: f64 = 0.999;
const EPS: f64 = 1e-8;

#[derive(serde::Serialize, serde::Deserialize)]
pub struct Ensemble {
    cfg: EnsembleConfig,
    d: usize,
    seed: u64,
    /// K × d, head-major.
    heads: Vec<f64>,
    /// Each head's start θ⁰_k (the prior term's anchor).
    anchor: Vec<f64>,
    /// Adam's moments, K × d.
    m: Vec<f64>,
    v: Vec<f64>,
    /// Adam steps taken.
    adam_t: u64,
    /// The replay buffer: every z row and label seen.
    z: Vec<f32>,
    y: Vec<f32>,
    /// θ̄, the heads' mean.
    mean: Vec<f64>,
    steps: u64,
    counters: Counters,
    stats: PrequentialF64,
    #[serde(skip)]
    g: Vec<f64>,
    #[serde(skip)]
    old: Vec<f64>,
}

/// Head k's start: θ_1 + ε_k, ε_k ~ N(0, σ²) truncated at ±2σ (redrawn), σ = scale/√d.
fn draw_starts(theta0: &[f64], k: usize, scale: f64, seed: u64) -> Vec<f64> {
    let d = theta0.len();
    let sd = scale / (d as f64).sqrt();
    let mut rng = ChaCha20Rng::seed_from_u64(seed);
    rng.set_stream(1);
    let n = Normal::new(0.0, sd).expect("init_scale validated finite and ≥ 0");
    let mut out = Vec::with_capacity(k * d);
    for _ in 0..k {
        for &c in theta0 {
            let mut e: f64 = n.sample(&mut rng);
            while e.abs() > 2.0 * sd {
                e = n.sample(&mut rng);
            }
            out.push(c + e);
        }
    }
    out
}

impl Ensemble {
    /// K heads around `theta0` (θ_1 of the run's `init`), their starts and minibatches from
    /// `seed`.
    pub fn new(cfg: EnsembleConfig, theta0: Vec<f64>, seed: u64) -> Ensemble {
        let d = theta0.len();
        let k = cfg.heads;
        let heads = draw_starts(&theta0, k, cfg.init_scale, seed);
        let mut e = Ensemble {
            cfg,
            d,
            seed,
            anchor: heads.clone(),
            heads,
            m: vec![0.0; k * d],
            v: vec![0.0; k * d],
            adam_t: 0,
            z: Vec::new(),
            y: Vec::new(),
            mean: vec![0.0; d],
            steps: 0,
            counters: Counters::default(),
            stats: PrequentialF64::default(),
            g: Vec::new(),
            old: Vec::new(),
        };
        e.refresh_mean();
        e
    }

    pub fn config(&self) -> &EnsembleConfig {
        &self.cfg
    }

    /// Pairs in the replay buffer.
    pub fn buffered(&self) -> usize {
        self.y.len()
    }

    fn refresh_mean(&mut self) {
        let k = self.cfg.heads;
        self.mean.fill(0.0);
        for h in self.heads.chunks_exact(self.d) {
            for (m, &w) in self.mean.iter_mut().zip(h) {
                *m += w;
            }
        }
        for m in &mut self.mean {
            *m /= k as f64;
        }
    }

    /// The buffer rows each head trains on at Adam step `s` (1-based): one list shared by
    /// every head, or one per head under `bootstrap`.
    fn minibatches(&self, s: u64) -> Vec<Vec<usize>> {
        let n = self.y.len();
        let m = self.cfg.batch.min(n);
        let mut rng = ChaCha20Rng::seed_from_u64(self.seed);
        rng.set_stream(2 + s);
        if self.cfg.bootstrap {
            (0..self.cfg.heads).map(|_| (0..m).map(|_| rng.random_range(0..n)).collect()).collect()
        } else if m == n {
            vec![(0..n).collect()]
        } else {
            vec![rand::seq::index::sample(&mut rng, n, m).into_vec()]
        }
    }

    /// One Adam step of every head on its minibatch; returns (per-sample gradients, flops).
    fn adam_step(&mut self) -> (u64, u64) {
        let (d, k) = (self.d, self.cfg.heads);
        self.adam_t += 1;
        let batches = self.minibatches(self.adam_t);
        let t = self.y.len() as f64;
        let (lr, wd) = (self.cfg.lr, self.cfg.weight_decay);
        let bc1 = 1.0 - BETA1.powi(self.adam_t as i32);
        let bc2 = 1.0 - BETA2.powi(self.adam_t as i32);
        self.g.resize(d, 0.0);
        let (mut evals, mut flops) = (0u64, 0u64);
        for h in 0..k {
            let rows = &batches[if batches.len() == 1 { 0 } else { h }];
            let mb = rows.len() as f64;
            // the loss is the mean over heads and pairs (oat's `(loss * mask).mean()`)
            let scale = 1.0 / (k as f64 * mb);
            // λ·(m/t)·mean over all K·d weights of (w − w⁰)²
            let prior = 2.0 * self.cfg.prior * mb / t / (k * d) as f64;
            let theta = &self.heads[h * d..(h + 1) * d];
            self.g.fill(0.0);
            for &i in rows {
                let row = &self.z[i * d..(i + 1) * d];
                let c = sigmoid(dot_f32_f64(row, theta)) - f64::from(self.y[i]);
                axpy_f32_f64(c * scale, row, &mut self.g);
            }
            evals += rows.len() as u64;
            flops += 4 * (rows.len() * d) as u64;
            let r = h * d..(h + 1) * d;
            for ((((w, &w0), m), v), &gl) in self.heads[r.clone()]
                .iter_mut()
                .zip(&self.anchor[r.clone()])
                .zip(&mut self.m[r.clone()])
                .zip(&mut self.v[r])
                .zip(&self.g)
            {
                let g = gl + prior * (*w - w0) + wd * *w;
                *m = BETA1 * *m + (1.0 - BETA1) * g;
                *v = BETA2 * *v + (1.0 - BETA2) * g * g;
                *w -= lr * (*m / bc1) / ((*v / bc2).sqrt() + EPS);
            }
            flops += 18 * d as u64;
        }
        (evals, flops)
    }
}

impl Estimator for Ensemble {
    fn kind(&self) -> Kind {
        Kind::Ensemble
    }

    fn dim(&self) -> usize {
        self.d
    }

    fn theta_into(&self, out: &mut [f64]) {
        out.copy_from_slice(&self.mean);
    }

    fn update(&mut self, batch: &Batch<'_>) -> Result<StepReport, EstimatorError> {
        let (before, grad_norm) = self.stats.measure(batch, &self.mean)?;
        let (b, d) = (batch.len(), self.d);
        let mut cost = Counters { grad_evals: b as u64, flops: 4 * (b * d) as u64, ..Default::default() };
        self.z.extend_from_slice(batch.z());
        self.y.extend_from_slice(batch.y());
        self.steps += 1;
        let mut old = std::mem::take(&mut self.old);
        old.clear();
        old.extend_from_slice(&self.mean);
        for _ in 0..self.cfg.steps_per_update {
            let (e, f) = self.adam_step();
            cost.grad_evals += e;
            cost.flops += f;
        }
        self.refresh_mean();
        cost.flops += (self.cfg.heads * d) as u64;
        let (step_norm, cos_step_grad) = self.stats.step_geometry(&old, &self.mean, grad_norm);
        self.old = old;
        if !step_norm.is_finite() || self.heads.iter().any(|w| !w.is_finite()) {
            return Err(EstimatorError::NonFinite { kind: "ensemble", step: self.steps });
        }
        self.counters.add(&cost);
        Ok(StepReport {
            before,
            grad_norm,
            step_norm,
            clip_factor: 1.0,
            cos_step_grad,
            damping: f64::NAN,
            inner_iters: self.cfg.steps_per_update,
            converged: true,
            cost,
        })
    }

    fn steps(&self) -> u64 {
        self.steps
    }

    fn counters(&self) -> Counters {
        self.counters
    }

    fn state_bytes(&self) -> usize {
        let f64s = self.heads.len() + self.anchor.len() + self.m.len() + self.v.len() + self.mean.len() * 2;
        let scratch = self.g.len();
        (f64s + scratch) * 8 + (self.z.len() + self.y.len()) * 4 + self.stats.bytes()
    }

    fn heads(&self) -> Option<&[f64]> {
        Some(&self.heads)
    }

    fn snapshot(&self) -> crate::SnapshotRef<'_> {
        crate::SnapshotRef::Ensemble(self)
    }
}
