//! `ensemble`: its update against a hand-written f64 Adam over the replay buffer, its θ the
//! heads' mean, its memory growing by one stored pair per label, its heads' starts.
#![allow(clippy::needless_range_loop)]
mod common;
use common::*;
use estimators::*;

/// The objective of oat's EnnEETS over linear heads, minibatch = the whole buffer: the mean over
/// heads and pairs of the logistic loss, plus λ·(n/t)·mean over all K·d weights of (w − w⁰)²,
/// plus torch's L2 weight decay in the gradient; torch's Adam. Written from the definitions,
/// not from the estimator's code.
struct HandAdam {
    k: usize,
    d: usize,
    lr: f64,
    wd: f64,
    lambda: f64,
    w: Vec<Vec<f64>>,
    w0: Vec<Vec<f64>>,
    m: Vec<Vec<f64>>,
    v: Vec<Vec<f64>>,
    t: i32,
    buf: Vec<(Vec<f64>, f64)>,
}

impl HandAdam {
    fn step(&mut self) {
        self.t += 1;
        let n = self.buf.len() as f64;
        let total = (self.k * self.d) as f64;
        for h in 0..self.k {
            let mut g = vec![0.0; self.d];
            for (z, y) in &self.buf {
                let p = sigmoid(dot(z, &self.w[h]));
                for j in 0..self.d {
                    g[j] += (p - y) * z[j] / (self.k as f64 * n);
                }
            }
            for j in 0..self.d {
                // d/dw of λ·(m/t)·Σ (w − w⁰)² / (K·d); m = t here (the whole buffer is the batch)
                g[j] += self.lambda * 2.0 * (self.w[h][j] - self.w0[h][j]) / total;
                g[j] += self.wd * self.w[h][j];
                self.m[h][j] = 0.9 * self.m[h][j] + 0.1 * g[j];
                self.v[h][j] = 0.999 * self.v[h][j] + 0.001 * g[j] * g[j];
                let mh = self.m[h][j] / (1.0 - 0.9f64.powi(self.t));
                let vh = self.v[h][j] / (1.0 - 0.999f64.powi(self.t));
                self.w[h][j] -= self.lr * mh / (vh.sqrt() + 1e-8);
            }
        }
    }
}

fn heads_of(e: &dyn Estimator, k: usize, d: usize) -> Vec<Vec<f64>> {
    let h = e.heads().expect("an ensemble has heads");
    assert_eq!(h.len(), k * d);
    h.chunks(d).map(|c| c.to_vec()).collect()
}

fn run_against_hand(cfg: EnsembleConfig, d: usize, b: usize, updates: usize) -> f64 {
    let s = stream(61, b * updates, d, 2.0, 2.0);
    let setup = Setup { dim: d, init: Init::Normal { std: Some(0.2) }, seed: 9, planned_steps: None };
    let mut e = build(&EstimatorConfig::Ensemble(cfg), &setup).unwrap();
    let k = cfg.heads;
    let w0 = heads_of(&*e, k, d);
    let mut hand = HandAdam {
        k,
        d,
        lr: cfg.lr,
        wd: cfg.weight_decay,
        lambda: cfg.prior,
        w: w0.clone(),
        w0,
        m: vec![vec![0.0; d]; k],
        v: vec![vec![0.0; d]; k],
        t: 0,
        buf: Vec::new(),
    };
    let mut worst: f64 = 0.0;
    for t in 0..updates {
        let batch = s.batch(t, b);
        e.update(&batch).unwrap();
        for (i, row) in batch.rows().enumerate() {
            hand.buf.push((row.iter().map(|&v| f64::from(v)).collect(), f64::from(batch.y()[i])));
        }
        for _ in 0..cfg.steps_per_update {
            hand.step();
        }
        let got = heads_of(&*e, k, d);
        for h in 0..k {
            worst = worst.max(max_abs_diff(&got[h], &hand.w[h]));
        }
        // θ is the heads' mean
        let mean: Vec<f64> = (0..d).map(|j| got.iter().map(|w| w[j]).sum::<f64>() / k as f64).collect();
        assert!(max_abs_diff(&e.theta(), &mean) < 1e-15, "θ is the heads' mean");
    }
    worst
}

/// Batch ≥ every label seen: each Adam step is on the whole buffer, so the hand-written Adam
/// sees the same data in every step and the heads agree to rounding.
#[test]
fn the_update_is_adam_over_the_buffer() {
    let cfg = EnsembleConfig {
        heads: 4,
        lr: 0.05,
        weight_decay: 1e-3,
        prior: 0.5,
        steps_per_update: 3,
        batch: 1000,
        init_scale: 0.5,
        bootstrap: false,
    };
    let worst = run_against_hand(cfg, 5, 3, 30);
    assert!(worst < 1e-10, "heads differ from the hand-written Adam by {worst}");
}

/// The comparison can fail: the hand-written Adam run against an estimator whose prior term
/// is off (the hand's is on) disagrees.
#[test]
fn the_comparison_sees_a_missing_term() {
    let (d, b, k) = (5, 3, 4);
    let s = stream(62, b * 10, d, 2.0, 2.0);
    let cfg = EnsembleConfig { heads: k, lr: 0.05, prior: 0.0, batch: 1000, ..Default::default() };
    let setup = Setup { dim: d, init: Init::Zero, seed: 1, planned_steps: None };
    let mut e = build(&EstimatorConfig::Ensemble(cfg), &setup).unwrap();
    let w0 = heads_of(&*e, k, d);
    let mut hand = HandAdam {
        k,
        d,
        lr: 0.05,
        wd: cfg.weight_decay,
        lambda: 5.0,
        w: w0.clone(),
        w0,
        m: vec![vec![0.0; d]; k],
        v: vec![vec![0.0; d]; k],
        t: 0,
        buf: Vec::new(),
    };
    for t in 0..10 {
        let batch = s.batch(t, b);
        e.update(&batch).unwrap();
        for (i, row) in batch.rows().enumerate() {
            hand.buf.push((row.iter().map(|&v| f64::from(v)).collect(), f64::from(batch.y()[i])));
        }
        for _ in 0..cfg.steps_per_update {
            hand.step();
        }
    }
    let got = heads_of(&*e, k, d);
    let gap = (0..k).map(|h| max_abs_diff(&got[h], &hand.w[h])).fold(0.0, f64::max);
    assert!(gap > 1e-4, "a prior of 5 against none moved the heads by only {gap}");
}

/// The heads start apart (one draw per head, within ±2σ of θ_1, σ = init_scale/√d), the same
/// seed gives the same starts and another seed other starts; the buffer grows by one pair
/// (d + 1 f32) per label and the memory report with it.
#[test]
fn starts_memory_and_seeds() {
    let (d, k) = (16, 6);
    let cfg = EnsembleConfig { heads: k, init_scale: 0.5, ..Default::default() };
    let build_with = |seed| {
        build(&EstimatorConfig::Ensemble(cfg), &Setup { dim: d, init: Init::Zero, seed, planned_steps: None }).unwrap()
    };
    let (a, a2, other) = (build_with(3), build_with(3), build_with(4));
    let h = heads_of(&*a, k, d);
    let sd = 0.5 / (d as f64).sqrt();
    assert!(h.iter().flatten().all(|w| w.abs() <= 2.0 * sd), "truncated at 2σ");
    for i in 0..k {
        for j in 0..i {
            assert!(max_abs_diff(&h[i], &h[j]) > 0.0, "heads {i} and {j} start equal");
        }
    }
    // the sample spread of the starts is σ to within sampling error (96 draws)
    let var = h.iter().flatten().map(|w| w * w).sum::<f64>() / (k * d) as f64;
    let truncated = sd * sd * 0.774; // variance of N(0, σ²) truncated at ±2σ
    assert!((var / truncated - 1.0).abs() < 0.35, "start variance {var} vs {truncated}");
    assert_eq!(a.heads(), a2.heads());
    assert_ne!(a.heads(), other.heads());
    let s = stream(63, 40, d, 1.0, 1.0);
    let mut e = build_with(3);
    // (the first update sizes the scratch vectors too)
    e.update(&s.batch(0, 4)).unwrap();
    let mut last = e.state_bytes();
    for t in 1..10 {
        e.update(&s.batch(t, 4)).unwrap();
        let now = e.state_bytes();
        assert_eq!(now - last, 4 * (d + 1) * 4, "step {t}: four pairs of d + 1 f32");
        last = now;
    }
}
