//! Adam (Kingma & Ba 2015) on the adapters, with global-norm gradient clipping before the step
//! (as PyTorch's `clip_grad_norm_` then `Adam.step`): g ← g·min(1, c/‖g‖₂) over all adapters,
//! m ← β₁m + (1−β₁)g, v ← β₂v + (1−β₂)g², θ ← θ − lr_t·m̂/(√v̂ + ε) with bias-corrected m̂, v̂;
//! lr_t from an [`LrSchedule`] over a window of steps ([`LrWindow`]).

use candle_core::{backprop::GradStore, DType, Result, Tensor, Var};
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdamConfig {
    /// The peak learning rate (the schedule's factor multiplies it).
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Global-norm clipping threshold (None: no clipping).
    pub clip: Option<f64>,
    pub schedule: LrSchedule,
}

impl Default for AdamConfig {
    fn default() -> Self {
        AdamConfig { lr: 1e-4, beta1: 0.9, beta2: 0.999, eps: 1e-8, clip: Some(1.0), schedule: LrSchedule::Constant }
    }
}

/// The learning rate's factor per optimiser step, as transformers' schedulers (which TRL and
/// OpenRLHF use) compute it with `LambdaLR`: the k-th step of a window (k = 0, 1, …) uses
/// lr·f(k).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum LrSchedule {
    /// f = 1.
    Constant,
    /// transformers' `cosine_with_min_lr` (OpenRLHF: warm-up ⌈ratio·total⌉ steps, min_lr =
    /// 0.1·lr): f(k) = (k + 1) / w for k < w = ⌈warmup_ratio·total⌉, then m + (1 − m)·½(1 +
    /// cos π p) with p = (k − w) / max(1, total − w) and m = `min_lr_ratio`. One difference from
    /// transformers, whose warm-up is k / w: there the first step of a window has f = 0 and
    /// does not move the weights (a 1-step update would be a silent non-update); here the
    /// warm-up's first step is 1/w and its last reaches the peak. Past the window's end p stays
    /// at 1 (transformers would let the cosine rise again; an update never gets there).
    CosineWithMinLr { warmup_ratio: f64, min_lr_ratio: f64 },
}

impl LrSchedule {
    /// f(k) over a window of `total` steps.
    pub fn factor(&self, k: u64, total: u64) -> f64 {
        match *self {
            LrSchedule::Constant => 1.0,
            LrSchedule::CosineWithMinLr { warmup_ratio, min_lr_ratio } => {
                let w = (warmup_ratio * total as f64).ceil() as u64;
                if k < w {
                    return (k + 1) as f64 / w as f64;
                }
                let p = ((k - w) as f64 / total.saturating_sub(w).max(1) as f64).min(1.0);
                let f = 0.5 * (1.0 + (std::f64::consts::PI * p).cos());
                (f * (1.0 - min_lr_ratio) + min_lr_ratio).max(0.0)
            }
        }
    }
}

/// Which optimiser steps a schedule spans.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LrWindow {
    /// Each policy update's own steps: the schedule restarts every chunk (the authors' loop,
    /// which builds a new optimiser per chunk).
    Update,
    /// Steps 0..total of the optimiser's life (one schedule over the run; steps past `total`
    /// stay at its end).
    Run { total: u64 },
}

/// The optimizer's state: step count and moments, flat per variable, rounded to f32 (the
/// adapters train in f32; checkpoints keep them bit for bit).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct AdamState {
    pub t: u64,
    /// Steps of the optimisers this one continues ([`Adam::continuing`]; 0 for the first).
    #[serde(default)]
    pub before: u64,
    pub m: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
}

pub struct Adam {
    pub cfg: AdamConfig,
    /// The variables' names, for errors (e.g. `model.layers.0.self_attn.q_proj.lora_A`).
    names: Vec<String>,
    t: u64,
    /// The schedule's window: its first step and its length ([`Adam::begin`]).
    window: (u64, u64),
    /// Steps earlier optimisers of the same run took ([`Adam::continuing`]): a fresh optimiser
    /// per chunk keeps the run's step count for its schedule and mini-batch order.
    before: u64,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
}

/// What one step saw: ‖g‖₂ before clipping, the factor applied, the learning rate used.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepInfo {
    pub grad_norm: f64,
    pub clip_factor: f64,
    pub lr: f64,
}

impl Adam {
    pub fn new(cfg: AdamConfig, vars: &[&Var]) -> Result<Adam> {
        let zeros = |v: &&Var| v.as_tensor().zeros_like();
        Ok(Adam {
            cfg,
            names: (0..vars.len()).map(|i| format!("variable {i}")).collect(),
            t: 0,
            window: (0, 0),
            before: 0,
            m: vars.iter().map(zeros).collect::<Result<_>>()?,
            v: vars.iter().map(zeros).collect::<Result<_>>()?,
        })
    }

    /// Names the variables in errors (one per variable, in the order of `vars`).
    pub fn with_names(mut self, names: Vec<String>) -> Result<Adam> {
        if names.len() != self.m.len() {
            candle_core::bail!("{} names for {} variables", names.len(), self.m.len());
        }
        self.names = names;
        Ok(self)
    }

    /// This fresh optimiser continues the run of `prev` (the one it replaces: a fresh adapter
    /// per chunk, a ppo critic per chunk): its moments and bias correction start anew, but its
    /// step count in the run ([`Adam::run_steps`]) goes on from `prev`'s, so a schedule over the
    /// run (`LrWindow::Run`) does not restart and each chunk's mini-batch order is its own.
    pub fn continuing(mut self, prev_run_steps: u64) -> Adam {
        self.before = prev_run_steps;
        self
    }

    /// Steps taken in the run: this optimiser's and those of the optimisers it continues.
    pub fn run_steps(&self) -> u64 {
        self.before + self.t
    }

    /// Starts an update of `steps` optimiser steps: the schedule's window becomes this update's
    /// steps ([`LrWindow::Update`]) or the run's ([`LrWindow::Run`]).
    pub fn begin(&mut self, window: LrWindow, steps: u64) {
        self.window = match window {
            LrWindow::Update => (self.before + self.t, steps),
            LrWindow::Run { total } => (0, total),
        };
    }

    /// The step within the schedule's window of the next step: from the update's first step
    /// (`Update`), or the run's step count (`Run`).
    fn window_step(&self) -> u64 {
        (self.before + self.t).saturating_sub(self.window.0)
    }

    /// The learning rate of the next step: lr·f(t − window start) ([`LrSchedule::factor`]).
    pub fn lr(&self) -> f64 {
        match self.cfg.schedule {
            // exactly lr, not lr·1.0 through the window's arithmetic
            LrSchedule::Constant => self.cfg.lr,
            s => self.cfg.lr * s.factor(self.window_step(), self.window.1),
        }
    }

    /// One step on `vars` with their gradients in `grads`. A variable without a gradient is an
    /// error naming it: the graph was cut between it and the loss (a zero would be a silent
    /// non-update). A non-finite gradient norm is an error before any variable moves; a step
    /// that leaves a variable non-finite is an error after it (a diverged policy must not go on
    /// sampling).
    pub fn step(&mut self, vars: &[&Var], grads: &GradStore) -> Result<StepInfo> {
        if vars.len() != self.m.len() {
            candle_core::bail!("Adam::step on {} variables: the optimiser holds {}", vars.len(), self.m.len());
        }
        let gs: Vec<Tensor> = vars
            .iter()
            .enumerate()
            .map(|(i, v)| {
                grads.get(v.as_tensor()).cloned().ok_or_else(|| {
                    candle_core::Error::Msg(format!(
                        "{}: received no gradient (the computation graph does not reach it)",
                        self.names[i]
                    ))
                })
            })
            .collect::<Result<_>>()?;
        let mut sq = 0.0f64;
        for g in &gs {
            sq += g.sqr()?.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        }
        let norm = sq.sqrt();
        if !norm.is_finite() {
            // NaN or ∞ in the loss or the policy: a step would spread it into every weight and
            // the run would go on sampling from a broken policy
            candle_core::bail!(
                "Adam step {}: the gradient's global norm is {norm}: the loss diverged; no step was taken",
                self.t + 1
            );
        }
        let factor = match self.cfg.clip {
            Some(c) if norm > c => c / norm,
            _ => 1.0,
        };
        let lr = self.lr();
        self.t += 1;
        let (b1, b2) = (self.cfg.beta1, self.cfg.beta2);
        let bc1 = 1.0 - b1.powi(self.t as i32);
        let bc2 = 1.0 - b2.powi(self.t as i32);
        // each variable's sum after the step, read back once at the end (one device sync per
        // step, not one per variable): NaN or ∞ when any element is
        let mut totals = Vec::with_capacity(vars.len());
        for (i, (var, g)) in vars.iter().zip(gs).enumerate() {
            // detached: a gradient that depends on a variable would chain every step's graph into m and v
            let g = (g.detach() * factor)?;
            self.m[i] = ((&self.m[i] * b1)? + (&g * (1.0 - b1))?)?;
            self.v[i] = ((&self.v[i] * b2)? + (g.sqr()? * (1.0 - b2))?)?;
            let mhat = (&self.m[i] / bc1)?;
            let vhat = (&self.v[i] / bc2)?;
            let upd = (mhat / (vhat.sqrt()? + self.cfg.eps)?)?;
            var.set(&(var.as_tensor() - (upd * lr)?)?)?;
            totals.push(var.as_tensor().sum_all()?.to_dtype(DType::F32)?);
        }
        // a sum is also ∞ when finite weights near f32's limit overflow it: a broken policy too.
        // The step is taken by then; the error ends the update (the caller fails the cell).
        let totals: Vec<f32> = Tensor::stack(&totals, 0)?.to_vec1()?;
        if let Some(i) = totals.iter().position(|t| !t.is_finite()) {
            candle_core::bail!(
                "Adam step {}: {} is no longer finite (a step of learning rate {lr} overflowed it)",
                self.t,
                self.names[i]
            );
        }
        Ok(StepInfo { grad_norm: norm, clip_factor: factor, lr })
    }

    /// Steps taken so far (restored with the state, so a resumed run counts on).
    pub fn steps(&self) -> u64 {
        self.t
    }

    pub fn state(&self) -> Result<AdamState> {
        let flat = |ts: &[Tensor]| {
            ts.iter().map(|t| t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()).collect::<Result<Vec<_>>>()
        };
        Ok(AdamState { t: self.t, before: self.before, m: flat(&self.m)?, v: flat(&self.v)? })
    }

    /// Restores a state saved by [`Adam::state`] for the same variables.
    pub fn restore(&mut self, s: &AdamState) -> Result<()> {
        if s.m.len() != self.m.len() || s.v.len() != self.v.len() {
            candle_core::bail!("Adam state of {} variables: expected {}", s.m.len(), self.m.len());
        }
        for (dst, src) in self.m.iter_mut().zip(&s.m).chain(self.v.iter_mut().zip(&s.v)) {
            *dst = Tensor::from_vec(src.clone(), dst.shape(), dst.device())?.to_dtype(dst.dtype())?;
        }
        self.t = s.t;
        self.before = s.before;
        Ok(())
    }
}
