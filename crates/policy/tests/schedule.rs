//! The learning-rate schedule: transformers' `cosine_with_min_lr` (OpenRLHF's) computed by hand
//! at the warm-up's start and end, mid-cosine and the end; Adam steps with those rates, per
//! update (restarting) or over the run.

use candle_core::{Device, Tensor, Var};
use policy::adam::{Adam, AdamConfig, LrSchedule, LrWindow};

/// The factor by hand, written independently of the library: warm-up w = ⌈r·T⌉ steps k/w, then
/// m + (1 − m)(1 + cos(π (k − w)/(T − w)))/2.
fn by_hand(k: u64, total: u64, r: f64, m: f64) -> f64 {
    let w = (r * total as f64).ceil();
    let k = k as f64;
    if k < w {
        k / w
    } else {
        m + (1.0 - m) * (1.0 + (std::f64::consts::PI * (k - w) / (total as f64 - w)).cos()) / 2.0
    }
}

#[test]
fn cosine_with_min_lr_at_warmup_mid_and_end() {
    let s = LrSchedule::CosineWithMinLr { warmup_ratio: 0.1, min_lr_ratio: 0.1 };
    // T = 20: w = 2 warm-up steps (0, ½), the peak at k = 2, mid-cosine at k = 11, the floor at 20
    assert_eq!(s.factor(0, 20), 0.0, "the first warm-up step has lr 0, as in transformers");
    assert!((s.factor(1, 20) - 0.5).abs() < 1e-15);
    assert!((s.factor(2, 20) - 1.0).abs() < 1e-15, "warm-up ends at the peak");
    assert!((s.factor(11, 20) - 0.55).abs() < 1e-12, "mid-cosine: m + (1 − m)/2");
    assert!((s.factor(20, 20) - 0.1).abs() < 1e-12, "the end: min_lr_ratio");
    assert!((s.factor(25, 20) - 0.1).abs() < 1e-12, "past the end it stays at the floor");
    for k in 0..=20 {
        let want = by_hand(k, 20, 0.1, 0.1);
        assert!((s.factor(k, 20) - want).abs() < 1e-12, "k = {k}: {} vs {want}", s.factor(k, 20));
    }
    // the authors' ratio 0.03 over 8 steps: ⌈0.24⌉ = 1 warm-up step
    let a = LrSchedule::CosineWithMinLr { warmup_ratio: 0.03, min_lr_ratio: 0.1 };
    assert_eq!(a.factor(0, 8), 0.0);
    assert!((a.factor(1, 8) - 1.0).abs() < 1e-15);
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
    assert_eq!(per_update[0], 0.0);
    assert_eq!(per_update[4], 0.0, "the second update restarts the warm-up");
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
