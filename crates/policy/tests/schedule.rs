//! The learning-rate schedule: transformers' `cosine_with_min_lr` (OpenRLHF's) computed by hand
//! at the warm-up's start and end, mid-cosine and the end; Adam steps with those rates, per
//! update (restarting) or over the run.

use candle_core::{Device, Tensor, Var};
use policy::adam::{Adam, AdamConfig, LrSchedule, LrWindow};

/// The factor by hand, written independently of the library: warm-up w = ⌈r·T⌉ steps (k + 1)/w
/// (transformers' k/w shifted one step, so the first step moves), then
/// m + (1 − m)(1 + cos(π (k − w)/(T − w)))/2.
fn by_hand(k: u64, total: u64, r: f64, m: f64) -> f64 {
    let w = (r * total as f64).ceil();
    let k = k as f64;
    if k < w {
        (k + 1.0) / w
    } else {
        m + (1.0 - m) * (1.0 + (std::f64::consts::PI * (k - w) / (total as f64 - w)).cos()) / 2.0
    }
}

#[test]
fn cosine_with_min_lr_at_warmup_mid_and_end() {
    let s = LrSchedule::CosineWithMinLr { warmup_ratio: 0.1, min_lr_ratio: 0.1 };
    // T = 20: w = 2 warm-up steps (½, 1), the peak at k = 2, mid-cosine at k = 11, the floor at 20
    assert_eq!(s.factor(0, 20), 0.5, "the first warm-up step moves (transformers' would be lr 0)");
    assert!((s.factor(1, 20) - 1.0).abs() < 1e-15);
    assert!((s.factor(2, 20) - 1.0).abs() < 1e-15, "warm-up ends at the peak");
    assert!((s.factor(11, 20) - 0.55).abs() < 1e-12, "mid-cosine: m + (1 − m)/2");
    assert!((s.factor(20, 20) - 0.1).abs() < 1e-12, "the end: min_lr_ratio");
    assert!((s.factor(25, 20) - 0.1).abs() < 1e-12, "past the end it stays at the floor");
    for k in 0..=20 {
        let want = by_hand(k, 20, 0.1, 0.1);
        assert!((s.factor(k, 20) - want).abs() < 1e-12, "k = {k}: {} vs {want}", s.factor(k, 20));
    }
    // the authors' ratio 0.03 over 8 steps: ⌈0.24⌉ = 1 warm-up step, at the peak; over 1 step
    // (a 1-step update) too: never lr 0
    let a = LrSchedule::CosineWithMinLr { warmup_ratio: 0.03, min_lr_ratio: 0.1 };
    assert_eq!(a.factor(0, 8), 1.0);
    assert!((a.factor(1, 8) - 1.0).abs() < 1e-15);
    assert_eq!(a.factor(0, 1), 1.0, "a 1-step update moves");
    // no warm-up: starts at the peak
    let n = LrSchedule::CosineWithMinLr { warmup_ratio: 0.0, min_lr_ratio: 0.0 };
    assert!((n.factor(0, 4) - 1.0).abs() < 1e-15);
    assert!((n.factor(2, 4) - 0.5).abs() < 1e-12);
    assert_eq!(LrSchedule::Constant.factor(7, 3), 1.0);
}

/// Adam's steps use lr·f(step in window): restarted at each `begin` with `LrWindow::Update`,
/// counted from the optimiser's first step with `LrWindow::Run`. A constant schedule uses lr
/// exactly.
#[test]
fn adam_steps_with_the_scheduled_rate_per_update_or_over_the_run() {
    let x = Var::from_tensor(&Tensor::new(&[1.0f64, -2.0], &Device::Cpu).unwrap()).unwrap();
    let schedule = LrSchedule::CosineWithMinLr { warmup_ratio: 0.25, min_lr_ratio: 0.1 };
    let cfg = AdamConfig { lr: 0.01, clip: None, schedule, ..Default::default() };
    let rates = |window: LrWindow, updates: usize, steps: u64| -> Vec<f64> {
        let mut opt = Adam::new(cfg, &[&x]).unwrap();
        let mut out = Vec::new();
        for _ in 0..updates {
            opt.begin(window, steps);
            for _ in 0..steps {
                let g = x.as_tensor().sqr().unwrap().sum_all().unwrap().backward().unwrap();
                out.push(opt.step(&[&x], &g).unwrap().lr);
            }
        }
        out
    };
    let per_update = rates(LrWindow::Update, 2, 4);
    let want: Vec<f64> = (0..2).flat_map(|_| (0..4).map(|k| 0.01 * by_hand(k, 4, 0.25, 0.1))).collect();
    assert_eq!(per_update.len(), 8);
    for (g, w) in per_update.iter().zip(&want) {
        assert!((g - w).abs() < 1e-15, "{per_update:?} vs {want:?}");
    }
    // w = ⌈0.25·4⌉ = 1 warm-up step: at the peak (transformers' would be at lr 0)
    assert_eq!(per_update[0], 0.01, "the warm-up's first step is lr/w, not 0");
    assert_eq!(per_update[4], 0.01, "the second update restarts the warm-up");
    assert!(per_update[6] < per_update[5], "then the cosine");
    let run = rates(LrWindow::Run { total: 8 }, 2, 4);
    for (k, g) in run.iter().enumerate() {
        let w = 0.01 * by_hand(k as u64, 8, 0.25, 0.1);
        assert!((g - w).abs() < 1e-15, "step {k}: {g} vs {w}");
    }
    assert!(run[4] > 0.0, "over the run the second update continues the cosine");
    let mut opt = Adam::new(AdamConfig { lr: 0.0123, ..Default::default() }, &[&x]).unwrap();
    opt.begin(LrWindow::Update, 3);
    let g = x.as_tensor().sqr().unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(opt.step(&[&x], &g).unwrap().lr, 0.0123, "constant: lr itself");
}

/// A diverged update is an error, not a step: a NaN gradient (a NaN loss) is refused before any
/// variable moves, and a step that overflows a variable names it. Negative control: the same
/// step on a finite gradient at a sane rate is taken.
#[test]
fn adam_refuses_a_nan_gradient_and_an_overflowing_step() {
    use candle_core::{Device, Tensor, Var};
    use policy::adam::{Adam, AdamConfig};
    let x = Var::from_tensor(&Tensor::new(&[1.0f32, 2.0], &Device::Cpu).unwrap()).unwrap();
    let step = |lr: f64, scale: f64| {
        let mut opt = Adam::new(AdamConfig { lr, clip: None, ..Default::default() }, &[&x])
            .unwrap()
            .with_names(vec!["w".into()])
            .unwrap();
        let loss = (x.as_tensor() * scale).unwrap().sum_all().unwrap();
        opt.step(&[&x], &loss.backward().unwrap()).map(|_| ()).map_err(|e| e.to_string())
    };
    let e = step(0.1, f64::NAN).unwrap_err();
    assert!(e.contains("global norm is NaN") && e.contains("no step was taken"), "{e}");
    assert_eq!(x.as_tensor().to_vec1::<f32>().unwrap(), [1.0, 2.0], "a refused step moved the variable");
    let e = step(1e300, 1.0).unwrap_err();
    assert!(e.contains("w is no longer finite"), "{e}");
    let x2 = Var::from_tensor(&Tensor::new(&[1.0f32, 2.0], &Device::Cpu).unwrap()).unwrap();
    let mut opt = Adam::new(AdamConfig { lr: 0.1, clip: None, ..Default::default() }, &[&x2]).unwrap();
    let loss = x2.as_tensor().sum_all().unwrap();
    opt.step(&[&x2], &loss.backward().unwrap()).unwrap();
    assert!(x2.as_tensor().to_vec1::<f32>().unwrap()[0] < 1.0, "the sane step was taken");
}

/// `lr_restart = "run"` with a fresh optimiser per chunk (a fresh adapter, a ppo critic): each
/// chunk's new Adam continues the run's step count ([`Adam::continuing`], as the online loop
/// builds them), so the rates of 3 chunks of 4, 3 and 5 steps are the closed-form
/// cosine-with-min-lr over the run's 12 steps — while the moments start anew each chunk (the
/// first step's update is ±lr, Adam's bias-corrected first step). Negative control: fresh
/// optimisers that do not continue restart the warm-up each chunk.
#[test]
fn fresh_optimisers_per_chunk_follow_one_schedule_over_the_run() {
    let x = Var::from_tensor(&Tensor::new(&[1.0f64, -2.0], &Device::Cpu).unwrap()).unwrap();
    let schedule = LrSchedule::CosineWithMinLr { warmup_ratio: 0.25, min_lr_ratio: 0.1 };
    let cfg = AdamConfig { lr: 0.01, clip: None, schedule, ..Default::default() };
    let chunks = [4u64, 3, 5];
    let total: u64 = chunks.iter().sum();
    let rates = |continuing: bool| -> Vec<f64> {
        let mut out = Vec::new();
        let mut run = 0;
        for &steps in &chunks {
            let opt = Adam::new(cfg, &[&x]).unwrap();
            let mut opt = if continuing { opt.continuing(run) } else { opt };
            opt.begin(LrWindow::Run { total }, steps);
            for i in 0..steps {
                let before = x.as_tensor().to_vec1::<f64>().unwrap();
                let g = x.as_tensor().sqr().unwrap().sum_all().unwrap().backward().unwrap();
                let info = opt.step(&[&x], &g).unwrap();
                if i == 0 {
                    // a fresh Adam's first step moves each weight by lr (m̂/√v̂ = ±1)
                    let after = x.as_tensor().to_vec1::<f64>().unwrap();
                    for (a, b) in after.iter().zip(&before) {
                        assert!(((b - a).abs() - info.lr).abs() < 1e-9 * (1.0 + info.lr), "fresh moments");
                    }
                }
                out.push(info.lr);
            }
            assert_eq!(opt.steps(), steps, "the optimiser's own count (bias correction) restarts");
            run = opt.run_steps();
        }
        assert_eq!(run, if continuing { total } else { 5 });
        out
    };
    let got = rates(true);
    assert_eq!(got.len() as u64, total);
    for (k, g) in got.iter().enumerate() {
        let w = 0.01 * by_hand(k as u64, total, 0.25, 0.1);
        assert!((g - w).abs() < 1e-15, "step {k}: {g} vs the run's closed form {w} ({got:?})");
    }
    let restarted = rates(false);
    assert_eq!(restarted[4], restarted[0], "negative control: without continuing, chunk 2 restarts");
    assert!((restarted[4] - 0.01 * by_hand(4, total, 0.25, 0.1)).abs() > 1e-4);
}

/// Each chunk's mini-batch order comes from the run's step count: a fresh optimiser per chunk
/// that continues the run does not repeat the first chunk's order (negative control: one that
/// does not continue would).
#[test]
fn a_fresh_optimiser_per_chunk_draws_its_own_mini_batch_order() {
    let x = Var::from_tensor(&Tensor::new(&[1.0f64], &Device::Cpu).unwrap()).unwrap();
    let first = Adam::new(AdamConfig::default(), &[&x]).unwrap();
    let next = Adam::new(AdamConfig::default(), &[&x]).unwrap().continuing(6);
    let order = |o: &Adam| policy::train::group_order(40, 4, 7, o.run_steps());
    assert_ne!(order(&first), order(&next), "chunk 2's order repeats chunk 1's");
    let stale = Adam::new(AdamConfig::default(), &[&x]).unwrap();
    assert_eq!(order(&first), order(&stale), "negative control: the same count, the same order");
}
