//! The reward model's state in a checkpoint (`[reward] update = "lora" | "full"`): the
//! update's state, its parameters and the running sums of the metric rows ([`RmState`]).

use super::clock::BucketClock;
use super::window::Window;
use anyhow::{Context, Result};
use policy::rm::model::{RewardModel, RmPair};
use policy::rm::update::OnePass;
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// What a checkpoint keeps of the reward model besides the stream: the update's state, every
/// trainable parameter, and the running sums of the metric rows.
#[derive(Serialize, Deserialize)]
pub(super) struct RmState {
    pub(super) update: OnePass,
    /// ψ then θ, flattened ([`RewardModel::flat`]).
    pub(super) params: Vec<f32>,
    pub(super) steps: u64,
    pub(super) samples: u64,
    pub(super) prev_samples: u64,
    /// The prequential sums since the last evaluation point.
    pub(super) window: Window,
    pub(super) grad_evals: u64,
    pub(super) hvp_evals: u64,
    /// Steps whose direction fell back to the gradient (negative curvature along g).
    pub(super) negative_curvature: u64,
    pub(super) step_s: f64,
    pub(super) bucket_step_s: f64,
    /// Wall time of the current evaluation bucket, carried through checkpoints.
    pub(super) bucket_clock: BucketClock,
}

impl RmState {
    /// The state before the first step.
    pub(super) fn new(update: OnePass) -> RmState {
        RmState {
            update,
            params: Vec::new(),
            steps: 0,
            samples: 0,
            prev_samples: 0,
            window: Window::default(),
            grad_evals: 0,
            hvp_evals: 0,
            negative_curvature: 0,
            step_s: 0.0,
            bucket_step_s: 0.0,
            bucket_clock: BucketClock::start(),
        }
    }

    /// One step of the update on `pairs`, counted (steps, samples, gradient and HVP
    /// evaluations per sample, fallbacks to the gradient, seconds).
    pub(super) fn step(&mut self, rm: &RewardModel, pairs: &[RmPair<'_>]) -> Result<policy::rm::update::RmStep> {
        let t0 = Instant::now();
        let s = self.update.step(rm, pairs).with_context(|| format!("reward model step {}", self.steps + 1))?;
        self.step_s += t0.elapsed().as_secs_f64();
        crate::io::failpoint("update");
        let b = pairs.len() as u64;
        self.steps += 1;
        self.prev_samples = self.samples;
        self.samples += b;
        self.grad_evals += b;
        self.hvp_evals += u64::from(s.hvps) * b;
        self.negative_curvature += u64::from(s.negative_curvature);
        Ok(s)
    }

    /// The counters a metric row reports of the update: (gradient and HVP evaluations per
    /// sample, steps whose direction fell back to the gradient).
    pub(super) fn counters(&self) -> (u64, u64, u64) {
        (self.grad_evals, self.hvp_evals, self.negative_curvature)
    }
}
