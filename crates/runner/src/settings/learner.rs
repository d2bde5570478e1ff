//! The learner of a cell: the estimator, its curvature tracker 𝓗_t, the averaged iterate and
//! the running window of training statistics that a metric row reports.

use super::clock::BucketClock;
use super::window::Window;
use super::Source;
use crate::plan::CellConfig;
use crate::rows::{Bucket, CellResult, MetricRow, StepRow};
use crate::spec::CurvaturePoint;
use crate::world::env::{dot, Component, Env};
use anyhow::Result;
use estimators::logistic::{accuracy_credit, log_loss};
use estimators::{Batch, Curvature, CurvatureKind, Estimator, HessianPoint, Setup};
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// The estimator, its curvature tracker and the running window of training statistics.
/// Serialised whole into checkpoints (the estimator through its [`estimators::Snapshot`]).
#[derive(Serialize, Deserialize)]
pub struct Learner {
    #[serde(with = "estimator_state")]
    pub(super) est: Box<dyn Estimator>,
    /// The 𝓗_t tracker, when the cell uses one ([`crate::budget::needs_tracker`]): an unused
    /// tracker is two packed d×d matrices (134 MB at d = 4096) per cell.
    pub(super) curv: Option<Curvature>,
    /// The uncertainty comes from the estimator's own 𝓗_t ([`crate::plan::CurvatureChoice`]).
    #[serde(default)]
    pub(super) own_curvature: bool,
    /// x widened to f64 for the estimator's norm (no allocation per call).
    #[serde(skip)]
    scratch: Vec<f64>,
    pub(super) d: usize,
    pub(super) steps: u64,
    pub(super) samples: u64,
    /// `samples` before the latest update.
    pub(super) prev_samples: u64,
    pub(super) record_steps: bool,
    pub(super) step_rows: Vec<StepRow>,
    pub(super) theta: Vec<f64>,
    /// θ_{t+1}, filled by `theta_into` and swapped with `theta` (no allocation per step).
    pub(super) next: Vec<f64>,
    pub(super) theta_sum: Vec<f64>,
    pub(super) iterates: u64,
    /// The prequential sums since the last evaluation point.
    pub(super) window: Window,
    pub(super) converged: bool,
    pub(super) est_s: f64,
    /// Wall time of the current bucket, carried through checkpoints.
    pub(super) bucket_clock: BucketClock,
    pub(super) bucket_est_s: f64,
    pub(super) buckets: Vec<Bucket>,
}

mod estimator_state {
    use estimators::{Estimator, Snapshot};
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[allow(clippy::borrowed_box)] // the field's type, as serde's `with` hands it over
    pub fn serialize<S: Serializer>(e: &Box<dyn Estimator>, s: S) -> Result<S::Ok, S::Error> {
        e.snapshot().serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Box<dyn Estimator>, D::Error> {
        Ok(Snapshot::deserialize(d)?.into_estimator())
    }
}

impl Learner {
    /// θ_t.
    pub fn theta(&self) -> &[f64] {
        &self.theta
    }

    /// ‖x‖_{𝓗_t⁻¹}, the uncertainty of Alg. 2–4: from the estimator's own 𝓗_t when the cell
    /// uses it (omd-exact under `curvature.source = "auto"`), else from the tracker.
    pub fn inv_norm(&mut self, x: &[f32]) -> f64 {
        if self.own_curvature {
            let mut xs = std::mem::take(&mut self.scratch);
            xs.clear();
            xs.extend(x.iter().map(|&v| f64::from(v)));
            let n = self.inv_norm_f64(&xs);
            self.scratch = xs;
            n
        } else {
            self.tracker().inv_norm(x)
        }
    }

    /// [`Learner::inv_norm`] of an f64 vector.
    pub fn inv_norm_f64(&mut self, x: &[f64]) -> f64 {
        if self.own_curvature {
            // the plan admits own_curvature only for estimators that keep 𝓗_t
            match self.est.inverse_norm(x) {
                Some(n) => n,
                None => self.tracker().inv_norm_f64(x),
            }
        } else {
            self.tracker().inv_norm_f64(x)
        }
    }

    /// The estimator's heads θ_1..θ_K (K × d, head-major) when it is an ensemble.
    pub fn heads(&self) -> Option<&[f64]> {
        self.est.heads()
    }

    fn tracker(&mut self) -> &mut Curvature {
        self.curv.as_mut().expect("a cell that scores uncertainty keeps a tracker (budget::needs_tracker)")
    }

    /// (d, the estimator's dimension): a checkpoint's learner must match the run's d.
    pub(super) fn dims(&self) -> (usize, usize) {
        (self.d, self.est.dim())
    }

    /// Moves what the cell's result takes of the learner into `out`: θ, step rows, timings.
    pub(super) fn finish(&mut self, out: &mut CellResult) {
        out.theta = self.theta.clone();
        out.steps = std::mem::take(&mut self.step_rows);
        out.estimator_s = self.est_s;
        out.buckets = std::mem::take(&mut self.buckets);
    }

    pub(super) fn new(cell: &CellConfig, seed: u32) -> Result<Learner> {
        let (d, c) = (cell.d, &cell.config);
        let setup = Setup {
            dim: d,
            init: c.init,
            seed: crate::world::env::seed_of(cell.master_seed, seed, Component::Init),
            // per head: with R ranks each head makes 1/R of the updates
            planned_steps: Some(cell.planned_steps()),
        };
        // the config is resolved for its cells (λ = "auto": ConfigPlan::for_cells)
        let est = estimators::build(&c.cfg, &setup)?;
        let point = match cell.curvature.point {
            CurvaturePoint::LookAhead => HessianPoint::LookAhead,
            CurvaturePoint::Current => HessianPoint::Current,
        };
        let choice = cell.curvature.choice;
        let curv = cell
            .curvature
            .tracker
            .then(|| Curvature::with_forward(CurvatureKind::Hessian { lambda: choice.tracker_lambda, point }, d));
        let theta = est.theta();
        Ok(Learner {
            est,
            curv,
            own_curvature: choice.estimator,
            scratch: Vec::new(),
            d,
            steps: 0,
            samples: 0,
            prev_samples: 0,
            record_steps: cell.stream.record_steps,
            step_rows: Vec::new(),
            theta_sum: theta.clone(),
            next: theta.clone(),
            theta,
            iterates: 1,
            window: Window::default(),
            converged: true,
            est_s: 0.0,
            bucket_clock: BucketClock::start(),
            bucket_est_s: 0.0,
            buckets: Vec::new(),
        })
    }

    /// A fresh estimator, curvature tracker and θ (the authors' re-initialised head); the
    /// counters, the training window and the timings go on.
    pub(super) fn reset_estimator(&mut self, cell: &CellConfig, seed: u32) -> Result<()> {
        let fresh = Learner::new(cell, seed)?;
        self.est = fresh.est;
        self.curv = fresh.curv;
        self.theta = fresh.theta;
        self.next = fresh.next;
        self.theta_sum = fresh.theta_sum;
        self.iterates = fresh.iterates;
        Ok(())
    }

    pub(super) fn update(&mut self, z: &[f32], y: &[f32]) -> Result<()> {
        let batch = Batch::new(z, y, self.d)?;
        let t0 = Instant::now();
        let rep = self.est.update(&batch)?;
        self.est_s += t0.elapsed().as_secs_f64();
        crate::io::failpoint("update");
        self.est.theta_into(&mut self.next);
        self.advance(&batch, &rep.before);
        self.converged &= rep.converged;
        if self.record_steps {
            self.step_rows.push(StepRow { step: self.steps, samples_seen: self.samples, report: rep });
        }
        Ok(())
    }

    /// A head updated outside the estimator — a reward model whose features learn (issue 30)
    /// steps (ψ, θ) itself: θ_{t+1} = `next`, the batch's statistics before the step, its
    /// seconds. The tracker's 𝓗 takes the batch's z as they were when the pairs were chosen
    /// (the features of that moment: one pass, no history recomputed).
    pub(super) fn record_external(
        &mut self,
        z: &[f32],
        y: &[f32],
        next: &[f64],
        before: &estimators::BatchStats,
        seconds: f64,
    ) -> Result<()> {
        let batch = Batch::new(z, y, self.d)?;
        if next.len() != self.d {
            return Err(anyhow::anyhow!("a head of {} weights for a learner of dimension {}", next.len(), self.d));
        }
        self.next.copy_from_slice(next);
        self.est_s += seconds;
        self.advance(&batch, before);
        Ok(())
    }

    /// θ_t → θ_{t+1} (in `next`): the tracker sees the batch, the averaged iterate and the
    /// counters move on, the training window takes the batch's pre-update statistics.
    fn advance(&mut self, batch: &Batch<'_>, before: &estimators::BatchStats) {
        if let Some(c) = &mut self.curv {
            c.observe(batch, &self.theta, &self.next);
        }
        std::mem::swap(&mut self.theta, &mut self.next);
        for (s, t) in self.theta_sum.iter_mut().zip(&self.theta) {
            *s += t;
        }
        self.iterates += 1;
        self.steps += 1;
        let n = batch.len() as f64;
        self.prev_samples = self.samples;
        self.samples += batch.len() as u64;
        self.window.add(before, n);
    }

    pub(super) fn averaged(&self) -> Vec<f64> {
        self.theta_sum.iter().map(|s| s / self.iterates as f64).collect()
    }

    /// A metric row at the current point; resets the training window.
    pub(super) fn row(&mut self, src: &Source<'_>) -> MetricRow {
        self.row_at(src.eval(), src.truth())
    }

    pub(super) fn row_at(&mut self, (eval_z, eval_y): (&[f32], &[f32]), truth: Option<&Env>) -> MetricRow {
        let wall = self.bucket_clock.lap();
        let est = self.est_s - self.bucket_est_s;
        self.buckets.push(Bucket {
            step: self.steps,
            samples_seen: self.samples,
            estimator_s: est,
            other_s: wall - est,
        });
        self.bucket_est_s = self.est_s;
        let (mut loss, mut right, mut ties) = (0.0, 0.0, 0u64);
        for (z, &y) in eval_z.chunks_exact(self.d).zip(eval_y) {
            let m = dot(z, &self.theta);
            loss += log_loss(m, f64::from(y));
            right += accuracy_credit(m, f64::from(y));
            ties += u64::from(m == 0.0);
        }
        let n = eval_y.len() as f64;
        let err: Option<Vec<f64>> = truth
            .filter(|env| !env.theta_star.is_empty())
            .map(|env| self.theta.iter().zip(&env.theta_star).map(|(a, b)| a - b).collect());
        let c = self.est.counters();
        let row = MetricRow {
            step: self.steps,
            samples_seen: self.samples,
            train_loss: self.window.train_loss(),
            train_accuracy: self.window.train_accuracy(),
            eval_loss: loss / n,
            eval_accuracy: right / n,
            eval_ties: ties,
            theta_err: err.as_ref().map(|e| e.iter().map(|v| v * v).sum::<f64>().sqrt()),
            theta_err_h: err.as_ref().and_then(|e| self.curv.as_ref().map(|c| c.norm(e).unwrap_or(f64::NAN))),
            subopt: truth.map(|env| env.subopt_of(&env.greedy(&self.theta))),
            kappa: self.window.kappa(),
            kappa_reference: self.window.kappa_reference(),
            grad_evals: c.grad_evals,
            hvp_evals: c.hvp_evals,
            negative_quad_forms: c.negative_quad_forms + self.curv.as_ref().map_or(0, |c| c.negative_quad_forms()),
            flops: c.flops,
            converged: self.converged,
            estimator_bytes: Some(self.est.state_bytes() as u64),
            ..Default::default()
        };
        self.window = Window::default();
        row
    }

    /// At the last step, and at every step whose batch crossed a multiple of `eval_every`
    /// samples (so `eval_every` need not be a multiple of the batch size).
    pub(super) fn due(&self, eval_every: u64, last: bool) -> bool {
        last || self.samples / eval_every > self.prev_samples / eval_every
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::CurvatureChoice;
    use rand::{Rng, SeedableRng};

    fn plan(text: &str) -> crate::plan::Plan {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("spec.toml");
        std::fs::write(&p, text).unwrap();
        load(&p).unwrap()
    }

    fn load(p: &std::path::Path) -> Result<crate::plan::Plan, crate::spec::SpecError> {
        let (s, text) = crate::spec::load(p, &[])?;
        crate::plan::build(s, p, &text, &[])
    }

    fn spec(batch: usize, extra: &str) -> String {
        format!(
            "setting = \"passive\"\n[env]\ndim = 6\n[stream]\nsamples = 64\nbatch_size = {batch}\n{extra}\n[[estimator]]\nkind = \"omd-exact\"\nlambda = 2.0\n[[estimator]]\nkind = \"sgd\"\n"
        )
    }

    /// Feeds the same 64 labelled differences to a learner; returns it.
    fn fed(p: &crate::plan::Plan, config: usize) -> Learner {
        let mut l = Learner::new(&CellConfig::of(&p.spec, &p.configs[config]), 0).unwrap();
        let mut rng = rand_chacha::ChaCha20Rng::seed_from_u64(5);
        let b = p.spec.stream.batch_size;
        for _ in 0..64 / b {
            let z: Vec<f32> = (0..6 * b).map(|_| rng.random_range(-2.0..2.0)).collect();
            let y: Vec<f32> = (0..b).map(|_| f32::from(u8::from(rng.random_bool(0.5)))).collect();
            l.update(&z, &y).unwrap();
        }
        l
    }

    /// Alg. 3/4 score with the learner's own 𝓗_t: under `auto`, omd-exact's uncertainty is its
    /// estimator's 𝓗_t (λ = its own 2), sgd's the tracker's (λ = 1); the tracker of omd-exact
    /// defaults to the estimator's λ and, with batch 1, is the same matrix as the estimator's
    /// (look-ahead σ′ at θ_{t+1} per sample); with batch 4 its look-ahead is taken once at the
    /// end of the batch for every row, so it differs — which is why it is not the default.
    #[test]
    fn the_uncertainty_comes_from_the_estimators_own_curvature() {
        let probes: Vec<Vec<f32>> =
            (0..5).map(|i| (0..6).map(|j| ((i * 7 + j * 3) % 5) as f32 - 2.0).collect()).collect();
        let p1 = plan(&spec(1, ""));
        let omd = CurvatureChoice::of(&p1.spec, &p1.configs[0]);
        assert_eq!(omd, CurvatureChoice { estimator: true, tracker_lambda: 2.0 });
        assert_eq!(
            CurvatureChoice::of(&p1.spec, &p1.configs[1]),
            CurvatureChoice { estimator: false, tracker_lambda: 1.0 }
        );
        let mut l = fed(&p1, 0);
        assert!(l.own_curvature);
        for x in &probes {
            let xd: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
            let own = l.inv_norm(x);
            let want = l.est.inverse_norm(&xd).unwrap();
            assert_eq!(own, want, "the learner's norm is the estimator's");
            let tracker = l.tracker().inv_norm(x);
            assert!((tracker - own).abs() <= 1e-9 * own, "batch 1: tracker {tracker} vs estimator {own}");
        }
        // batch 4: the tracker's look-ahead point differs from Alg. 1's per-sample one
        let p4 = plan(&spec(4, ""));
        let mut l4 = fed(&p4, 0);
        let gap = probes
            .iter()
            .map(|x| (l4.tracker().inv_norm(x) - l4.inv_norm(x)).abs() / l4.inv_norm(x))
            .fold(0.0, f64::max);
        assert!(gap > 1e-6, "batch 4: tracker and estimator agree to {gap}");
        // `tracker` forces the tracker; an explicit λ is the tracker's
        let pt = plan(&spec(1, "[curvature]\nsource = \"tracker\"\nlambda = 3"));
        assert_eq!(
            CurvatureChoice::of(&pt.spec, &pt.configs[0]),
            CurvatureChoice { estimator: false, tracker_lambda: 3.0 }
        );
        let mut lt = fed(&pt, 0);
        assert!(!lt.own_curvature);
        assert_eq!(lt.inv_norm(&probes[0]), lt.tracker().inv_norm(&probes[0]));
        // `estimator` with an estimator that keeps no 𝓗_t is refused by the plan
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("spec.toml");
        std::fs::write(&p, spec(1, "[curvature]\nsource = \"estimator\"")).unwrap();
        let e = load(&p).unwrap_err();
        assert_eq!(e.key, "curvature.source", "{e}");
        assert!(e.message.contains("sgd keeps no 𝓗_t"), "{e}");
    }
}
