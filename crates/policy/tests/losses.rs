//! The losses against hand computations on fixed numbers, and Adam against its update written
//! out in f64.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use common::token_logprobs;
use policy::adam::{Adam, AdamConfig};
use policy::loss::*;
use policy::train::KlEstimator;

fn t(v: &[f64]) -> Tensor {
    Tensor::from_vec(v.to_vec(), v.len(), &Device::Cpu).unwrap()
}
fn s(x: &Tensor) -> f64 {
    x.to_scalar::<f64>().unwrap()
}
fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

#[test]
fn token_logprobs_gather_the_next_token() {
    // logits (1, 3, 4); ids (1, 3): log π(ids[1] | ·) from row 0, log π(ids[2] | ·) from row 1
    let l = [0.1, 2.0, -1.0, 0.5, 1.0, 1.0, 3.0, -2.0, 9.0, 9.0, 9.0, 9.0];
    let logits = Tensor::from_vec(l.to_vec(), (1, 3, 4), &Device::Cpu).unwrap();
    let ids = Tensor::from_vec(vec![0u32, 1, 2], (1, 3), &Device::Cpu).unwrap();
    let got: Vec<f64> = token_logprobs(&logits, &ids).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    let lse = |r: &[f64]| r.iter().map(|x| x.exp()).sum::<f64>().ln();
    let want = [l[1] - lse(&l[0..4]), l[6] - lse(&l[4..8])];
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() < 1e-12, "{got:?} vs {want:?}");
    }
}

#[test]
fn kl_estimators_match_their_formulas() {
    let (lp, lr) = ([-1.0, -0.2, -3.0], [-1.5, -0.1, -2.0]);
    let k3_tensor: Vec<f64> = kl_k3(&t(&lp), &t(&lr)).unwrap().to_vec1().unwrap();
    for i in 0..3 {
        let d: f64 = lr[i] - lp[i];
        let (k1, k3) = (KlEstimator::K1.per_token(lp[i], lr[i]), KlEstimator::K3.per_token(lp[i], lr[i]));
        assert!((k1 - (lp[i] - lr[i])).abs() < 1e-12);
        assert!((k3 - (d.exp() - d - 1.0)).abs() < 1e-12);
        assert!(k3 >= 0.0, "k3 is non-negative");
        assert!((k3_tensor[i] - k3).abs() < 1e-12, "GRPO's tensor k3 is the per-token k3");
        // negative control: the two differ wherever π ≠ π_ref
        assert!((k1 - k3).abs() > 1e-3);
    }
}

#[test]
fn rloo_advantages_leave_one_out() {
    let r = [1.0, 2.0, 6.0, 0.0, -1.0, 1.0];
    let a = rloo_advantages(&r, 3);
    // prompt 1: 1 − (2+6)/2, 2 − (1+6)/2, 6 − (1+2)/2; prompt 2 likewise
    let want = [1.0 - 4.0, 2.0 - 3.5, 6.0 - 1.5, 0.0 - 0.0, -1.0 - 0.5, 1.0 + 0.5];
    assert_eq!(a, want);
    // the advantages of a prompt sum to k/(k−1)·(Σr − k·mean) = 0
    assert!(a[..3].iter().sum::<f64>().abs() < 1e-12);
}

#[test]
fn rloo_loss_is_the_clipped_policy_gradient() {
    let (lp, old, adv) = ([-2.0, -1.0, -3.0], [-2.5, -1.0, -2.0], [1.5, -0.5, 2.0]);
    for clip in [None, Some(0.2)] {
        let got = s(&rloo_loss(&t(&lp), &t(&old), &t(&adv), clip).unwrap());
        let mut want = 0.0;
        for i in 0..3 {
            let rho = (lp[i] - old[i]).exp();
            let mut v = -adv[i] * rho;
            if let Some(e) = clip {
                v = v.max(-adv[i] * rho.clamp(1.0 - e, 1.0 + e));
            }
            want += v / 3.0;
        }
        assert!((got - want).abs() < 1e-12, "{clip:?}: {got} vs {want}");
    }
    // the gradient on fresh samples (old = current) is −A·∇log π / n
    let v = Var::from_tensor(&t(&lp)).unwrap();
    let g = rloo_loss(v.as_tensor(), &t(&lp), &t(&adv), Some(0.2)).unwrap().backward().unwrap();
    let g: Vec<f64> = g.get(v.as_tensor()).unwrap().to_vec1().unwrap();
    for i in 0..3 {
        assert!((g[i] + adv[i] / 3.0).abs() < 1e-12, "{g:?}");
    }
}

/// The token-level loss: Σ_t w_t·max(−A_t ρ_t, −A_t clip(ρ_t)), by hand; its gradient on fresh
/// tokens is −w_t·A_t.
#[test]
fn token_pg_loss_is_the_weighted_clipped_policy_gradient() {
    let (lp, old, adv, w) =
        ([-2.0, -1.0, -3.0, -0.5], [-2.5, -1.0, -2.0, -0.1], [1.5, -0.5, 2.0, -1.0], [0.25, 0.25, 0.1, 0.4]);
    for clip in [None, Some(0.2)] {
        let got = s(&token_pg_loss(&t(&lp), &t(&old), &t(&adv), &t(&w), clip).unwrap());
        let mut want = 0.0;
        for i in 0..4 {
            let rho = (lp[i] - old[i]).exp();
            let mut v = -adv[i] * rho;
            if let Some(e) = clip {
                v = v.max(-adv[i] * rho.clamp(1.0 - e, 1.0 + e));
            }
            want += w[i] * v;
        }
        assert!((got - want).abs() < 1e-12, "{clip:?}: {got} vs {want}");
    }
    let v = Var::from_tensor(&t(&lp)).unwrap();
    let g = token_pg_loss(v.as_tensor(), &t(&lp), &t(&adv), &t(&w), Some(0.2)).unwrap().backward().unwrap();
    let g: Vec<f64> = g.get(v.as_tensor()).unwrap().to_vec1().unwrap();
    for i in 0..4 {
        assert!((g[i] + w[i] * adv[i]).abs() < 1e-12, "{g:?}");
    }
}

#[test]
fn dpo_loss_is_minus_log_sigmoid_of_the_margin() {
    let (pw, pl, rw, rl) = ([-3.0, -10.0, 50.0], [-4.0, -2.0, -60.0], [-3.5, -9.0, 0.0], [-3.0, -3.0, 0.0]);
    for beta in [0.1, 1.0] {
        let got = s(&dpo_loss(&t(&pw), &t(&pl), &t(&rw), &t(&rl), beta).unwrap());
        let want: f64 = (0..3).map(|i| -sigmoid(beta * ((pw[i] - rw[i]) - (pl[i] - rl[i]))).ln()).sum::<f64>() / 3.0;
        assert!((got - want).abs() < 1e-9, "β = {beta}: {got} vs {want}");
        assert!(got.is_finite(), "large margins stay finite");
    }
}

#[test]
fn adam_steps_as_written_with_clipping() {
    let x0 = [0.5, -1.0, 2.0];
    let v = Var::from_tensor(&t(&x0)).unwrap();
    let cfg = AdamConfig { lr: 0.1, beta1: 0.9, beta2: 0.99, eps: 1e-8, clip: Some(1.0), ..Default::default() };
    let mut opt = Adam::new(cfg, &[&v]).unwrap();
    let (mut m, mut s2, mut x) = ([0.0; 3], [0.0; 3], x0);
    for step in 1..=3 {
        // loss = Σ 2x² + x → g = 4x + 1, norm above 1: clipped
        let loss = ((v.as_tensor().sqr().unwrap() * 2.0).unwrap() + v.as_tensor()).unwrap().sum_all().unwrap();
        let info = opt.step(&[&v], &loss.backward().unwrap()).unwrap();
        let g: Vec<f64> = x.iter().map(|x| 4.0 * x + 1.0).collect();
        let n = g.iter().map(|g| g * g).sum::<f64>().sqrt();
        assert!((info.grad_norm - n).abs() < 1e-9 && (info.clip_factor - 1.0 / n).abs() < 1e-12);
        for i in 0..3 {
            let gi = g[i] / n;
            m[i] = 0.9 * m[i] + 0.1 * gi;
            s2[i] = 0.99 * s2[i] + 0.01 * gi * gi;
            let (mh, vh) = (m[i] / (1.0 - 0.9f64.powi(step)), s2[i] / (1.0 - 0.99f64.powi(step)));
            x[i] -= 0.1 * mh / (vh.sqrt() + 1e-8);
        }
        let got: Vec<f64> = v.as_tensor().to_vec1().unwrap();
        for i in 0..3 {
            assert!((got[i] - x[i]).abs() < 1e-12, "step {step}: {got:?} vs {x:?}");
        }
    }
    // the state round-trips (f32 moments), and lr = 0 does not move θ (negative control)
    let st = opt.state().unwrap();
    assert_eq!(st.t, 3);
    let mut again = Adam::new(AdamConfig { lr: 0.0, ..cfg }, &[&v]).unwrap();
    again.restore(&st).unwrap();
    let before: Vec<f64> = v.as_tensor().to_vec1().unwrap();
    let loss = v.as_tensor().sqr().unwrap().sum_all().unwrap();
    again.step(&[&v], &loss.backward().unwrap()).unwrap();
    assert_eq!(v.as_tensor().to_vec1::<f64>().unwrap(), before);
}

/// GAE by hand on three tokens: the recursion written out, at γ, λ ∈ {0, 1} and in between.
#[test]
fn gae_and_returns_equal_a_hand_computation() {
    let (r, v) = ([0.5, -1.0, 2.0], [0.2, 0.4, -0.3]);
    for (g, l) in [(1.0, 0.95), (1.0, 1.0), (0.9, 0.0), (0.0, 0.5), (0.7, 0.3)] {
        let d2 = r[2] - v[2];
        let d1 = r[1] + g * v[2] - v[1];
        let d0 = r[0] + g * v[1] - v[0];
        let a2 = d2;
        let a1 = d1 + g * l * a2;
        let a0 = d0 + g * l * a1;
        let (adv, ret) = gae(&r, &v, g, l);
        for (x, y) in adv.iter().zip([a0, a1, a2]) {
            assert!((x - y).abs() < 1e-12, "γ {g} λ {l}: {adv:?}");
        }
        for i in 0..3 {
            assert!((ret[i] - (adv[i] + v[i])).abs() < 1e-12);
        }
    }
    // γ = λ = 1: the advantage is the sum of the remaining rewards minus the value
    let (adv, ret) = gae(&r, &v, 1.0, 1.0);
    assert!((adv[0] - (r.iter().sum::<f64>() - v[0])).abs() < 1e-12);
    assert!((ret[0] - r.iter().sum::<f64>()).abs() < 1e-12, "the return is the reward-to-go");
    // λ = 0: one-step TD errors
    let (adv, _) = gae(&r, &v, 0.9, 0.0);
    assert!((adv[0] - (r[0] + 0.9 * v[1] - v[0])).abs() < 1e-12);
    assert_eq!(token_rewards(1.5, &[0.1, 0.2], 0.5), vec![-0.05, -0.1 + 1.5]);
}

/// The clipped value loss and its gradient by hand: one token inside the clip range, one
/// outside (the clipped branch larger: its gradient is 0), one outside where the plain branch is
/// larger.
#[test]
fn the_clipped_value_loss_and_its_gradient_equal_a_hand_computation() {
    let v = Var::from_tensor(&t(&[1.0, 2.0, -1.0])).unwrap();
    let (old, ret, w) = ([0.95, 1.0, 0.0], [0.0, 3.0, 1.0], [0.5, 0.25, 0.25]);
    let eps = 0.2;
    let loss = value_loss(v.as_tensor(), &t(&old), &t(&ret), &t(&w), Some(eps)).unwrap();
    let vals = [1.0f64, 2.0, -1.0];
    let mut want = 0.0;
    let mut grad = [0.0; 3];
    for i in 0..3 {
        let clipped = old[i] + (vals[i] - old[i]).clamp(-eps, eps);
        let (a, b) = ((vals[i] - ret[i]).powi(2), (clipped - ret[i]).powi(2));
        want += w[i] * 0.5 * a.max(b);
        // d/dV: the plain branch when it is the max; the clipped branch's is 0 outside the range
        grad[i] = if a >= b {
            w[i] * (vals[i] - ret[i])
        } else if (vals[i] - old[i]).abs() < eps {
            w[i] * (clipped - ret[i])
        } else {
            0.0
        };
    }
    assert!((s(&loss) - want).abs() < 1e-12, "{} vs {want}", s(&loss));
    let g: Vec<f64> = loss.backward().unwrap().get(v.as_tensor()).unwrap().to_vec1().unwrap();
    for (x, y) in g.iter().zip(grad) {
        assert!((x - y).abs() < 1e-12, "{g:?} vs {grad:?}");
    }
    // token 1 is outside the range with the clipped branch larger: no gradient there
    assert_eq!(g[1], 0.0);
    let plain = value_loss(v.as_tensor(), &t(&old), &t(&ret), &t(&w), None).unwrap();
    let want: f64 = (0..3).map(|i| w[i] * 0.5 * (vals[i] - ret[i]).powi(2)).sum();
    assert!((s(&plain) - want).abs() < 1e-12);
}

/// The fused LM head + log-softmax + gather (`head::lm_head_logprobs`) against the graph it
/// replaces (the LM head's product, log-softmax and gather in candle's differentiable ops), in
/// f64 and f32: values and ∂/∂x of a weighted sum, over rows that span three blocks (the last
/// one partial) and a vocabulary that spans three of the log-softmax's exponential buffers.
/// Negative control: other targets give other values.
#[test]
fn the_fused_lm_head_log_probabilities_equal_the_graphs() {
    use policy::head::lm_head_logprobs;
    use policy::ops::Kernels;
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
    let (p, h, v) = (300, 7, 1300);
    let mut draw = |n: usize| -> Vec<f64> { (0..n).map(|_| rng.random_range(-1.0..1.0)).collect() };
    let (xv, wv, cv) = (draw(p * h), draw(v * h), draw(p));
    let targets: Vec<u32> = (0..p).map(|i| ((i * 17 + 5) % v) as u32).collect();
    let targets = Tensor::from_vec(targets, p, &Device::Cpu).unwrap();
    let other =
        Tensor::from_vec((0..p).map(|i| ((i * 17 + 6) % v) as u32).collect::<Vec<_>>(), p, &Device::Cpu).unwrap();
    let rel = |a: &[f64], b: &[f64]| {
        let s = b.iter().fold(0f64, |m, x| m.max(x.abs()));
        a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max) / s
    };
    for (dtype, tol) in [(DType::F64, 1e-13), (DType::F32, 1e-5)] {
        let t =
            |v: &[f64], s: &[usize]| Tensor::from_vec(v.to_vec(), s, &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
        let x = Var::from_tensor(&t(&xv, &[p, h])).unwrap();
        let (w, coef) = (t(&wv, &[v, h]), t(&cv, &[p]));
        let f64s =
            |t: &Tensor| -> Vec<f64> { t.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1().unwrap() };
        let run = |k: Kernels, tg: &Tensor| -> (Vec<f64>, Vec<f64>) {
            let lp = lm_head_logprobs(x.as_tensor(), &w, None, tg, k).unwrap();
            let g = (&lp * &coef).unwrap().sum_all().unwrap().backward().unwrap();
            (f64s(&lp), f64s(g.get(x.as_tensor()).expect("x receives a gradient")))
        };
        let (fv, fg) = run(Kernels::Fused, &targets);
        for k in [Kernels::Composed, Kernels::Routed] {
            let (cv, cg) = run(k, &targets);
            assert_eq!(fv.len(), p);
            assert!(
                rel(&fv, &cv) < tol && rel(&fg, &cg) < tol,
                "{dtype:?} {k:?}: values {:e}, gradient {:e}",
                rel(&fv, &cv),
                rel(&fg, &cg)
            );
        }
        // every row's log-probability is a log-probability
        assert!(fv.iter().all(|x| *x < 0.0));
        // without a gradient to keep, the same values
        let plain = lm_head_logprobs(&x.as_tensor().detach(), &w, None, &targets, Kernels::Fused).unwrap();
        assert_eq!(f64s(&plain), fv);
        let (ov, og) = run(Kernels::Fused, &other);
        assert!(rel(&ov, &fv) > 1e-2 && rel(&og, &fg) > 1e-2, "negative control: other targets");
    }
}

/// The KL the online loop computes (`train::KlEstimator::per_token`, used by its penalty and by
/// policy.parquet's `kl`/`kl_initial`), against the divergence computed directly: for tokens
/// drawn from π, both k1 = log π − log π_ref and k3 = e^d − d − 1 (d = log π_ref − log π) are
/// unbiased, so their π-weighted sums over the vocabulary equal KL(π‖π_ref) = Σ π ln(π/π_ref);
/// k3 is ≥ 0 on every token while k1 is not (the negative control that the two are told apart),
/// and both are 0 where π = π_ref.
#[test]
fn the_production_kl_per_token_is_unbiased_for_kl() {
    let pi: [f64; 5] = [0.5, 0.25, 0.125, 0.0625, 0.0625];
    let pref: [f64; 5] = [0.2, 0.2, 0.3, 0.1, 0.2];
    let kl: f64 = pi.iter().zip(&pref).map(|(p, q)| p * (p / q).ln()).sum();
    for est in [KlEstimator::K1, KlEstimator::K3] {
        let e: f64 = pi.iter().zip(&pref).map(|(p, q)| p * est.per_token(p.ln(), q.ln())).sum();
        assert!((e - kl).abs() < 1e-12, "{est:?}: E_π = {e}, KL(π‖π_ref) = {kl}");
        assert_eq!(est.per_token(0.3f64.ln(), 0.3f64.ln()), 0.0);
    }
    let k1: Vec<f64> = pi.iter().zip(&pref).map(|(p, q)| KlEstimator::K1.per_token(p.ln(), q.ln())).collect();
    let k3: Vec<f64> = pi.iter().zip(&pref).map(|(p, q)| KlEstimator::K3.per_token(p.ln(), q.ln())).collect();
    assert!(k1.iter().any(|&x| x < 0.0), "{k1:?}");
    assert!(k3.iter().all(|&x| x >= 0.0), "{k3:?}");
    // the same numbers as the tensor form GRPO's loss uses
    let t3: Vec<f64> = kl_k3(&t(&pi.map(f64::ln)), &t(&pref.map(f64::ln))).unwrap().to_vec1().unwrap();
    for i in 0..pi.len() {
        assert!((t3[i] - k3[i]).abs() < 1e-12, "token {i}");
    }
}
