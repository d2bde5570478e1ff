//! GRPO (TRL's defaults) and REINFORCE++ (OpenRLHF's) against independent f64 computations:
//! their advantages on fixed numbers, their losses and gradients per token, and the loss the
//! update reports on a tiny policy (the aggregation over the mini-batch's tokens, GRPO's k3 term
//! after the policy moved); a tiny policy learns under each, and lr = 0 does not move it.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use common::*;
use features::model::Family;
use policy::adam::{Adam, AdamConfig, LrWindow};
use policy::loss::{grpo_advantages, grpo_loss, reinforce_pp_advantages, GroupScale};
use policy::train::{
    group_order, grpo_update, reinforce_pp_update, score, score_tokens, GrpoConfig, KlEstimator, ReinforcePpConfig,
    RewardNorm, Rollout,
};
use policy::{LoraConfig, PolicyModel, Target};

fn t(v: &[f64]) -> Tensor {
    Tensor::from_vec(v.to_vec(), v.len(), &Device::Cpu).unwrap()
}

fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol * (1.0 + b.abs())
}

#[test]
fn grpo_advantages_equal_a_hand_computation() {
    // two groups of 3: (1, 3, 2) has mean 2 and sample sd 1; (0, 0, 6) mean 2, sample sd √12
    let r = [1.0, 3.0, 2.0, 0.0, 0.0, 6.0];
    let group = grpo_advantages(&r, 3, GroupScale::Group);
    let s2 = 12f64.sqrt();
    let want = [-1.0 / 1.0001, 1.0 / 1.0001, 0.0, -2.0 / (s2 + 1e-4), -2.0 / (s2 + 1e-4), 4.0 / (s2 + 1e-4)];
    for (g, w) in group.iter().zip(want) {
        assert!(close(*g, w, 1e-12), "group: {group:?} vs {want:?}");
    }
    // batch: the group means, the sample sd of all six (mean 2, Σ(r − 2)² = 1 + 1 + 0 + 4 + 4 + 16 = 26)
    let sd = (26.0f64 / 5.0).sqrt();
    let batch = grpo_advantages(&r, 3, GroupScale::Batch);
    let want: Vec<f64> = [-1.0, 1.0, 0.0, -2.0, -2.0, 4.0].iter().map(|a| a / (sd + 1e-4)).collect();
    for (g, w) in batch.iter().zip(&want) {
        assert!(close(*g, *w, 1e-12), "batch: {batch:?} vs {want:?}");
    }
    assert_eq!(grpo_advantages(&r, 3, GroupScale::None), [-1.0, 1.0, 0.0, -2.0, -2.0, 4.0]);
    // a group whose rewards are all equal carries no signal: every advantage exactly 0
    assert_eq!(grpo_advantages(&[5.0, 5.0, 1.0, 2.0], 2, GroupScale::Group)[..2], [0.0, 0.0]);
}

#[test]
fn grpo_loss_and_its_gradient_equal_a_hand_computation() {
    let lp = [-2.0, -1.0, -3.0, -0.5];
    let old = [-2.5, -1.0, -2.0, -0.1];
    let lref = [-1.5, -1.2, -2.5, -0.4];
    let adv = [1.5, -0.5, 2.0, -1.0];
    let w = [0.25, 0.25, 0.25, 0.25];
    for (clip, beta) in [(None, 0.0), (Some(0.2), 0.0), (Some(0.2), 0.04)] {
        let got: f64 =
            grpo_loss(&t(&lp), &t(&old), &t(&lref), &t(&adv), &t(&w), clip, beta).unwrap().to_scalar().unwrap();
        let mut want = 0.0;
        for i in 0..4 {
            let rho = (lp[i] - old[i]).exp();
            let mut v = -adv[i] * rho;
            if let Some(e) = clip {
                v = v.max(-adv[i] * rho.clamp(1.0 - e, 1.0 + e));
            }
            let d = lref[i] - lp[i];
            want += w[i] * (v + beta * (d.exp() - d - 1.0));
        }
        assert!(close(got, want, 1e-12), "clip {clip:?}, β {beta}: {got} vs {want}");
    }
    // at ratio 1 (old = lp): ∂/∂lp_t = w_t (−A_t + β(1 − e^{ref_t − lp_t}))
    let v = Var::from_tensor(&t(&lp)).unwrap();
    let g =
        grpo_loss(v.as_tensor(), &t(&lp), &t(&lref), &t(&adv), &t(&w), Some(0.2), 0.04).unwrap().backward().unwrap();
    let g: Vec<f64> = g.get(v.as_tensor()).unwrap().to_vec1().unwrap();
    for i in 0..4 {
        let want = w[i] * (-adv[i] + 0.04 * (1.0 - (lref[i] - lp[i]).exp()));
        assert!(close(g[i], want, 1e-12), "{i}: {} vs {want}", g[i]);
    }
}

/// The returns of rewards `rew` discounted by γ, written out.
fn returns(rew: &[f64], gamma: f64) -> Vec<f64> {
    (0..rew.len()).map(|t| (t..rew.len()).map(|s| gamma.powi((s - t) as i32) * rew[s]).sum()).collect()
}

#[test]
fn reinforce_pp_advantages_equal_a_hand_computation() {
    let r = [1.0, -2.0];
    let kl = vec![vec![0.1, -0.2, 0.3], vec![0.05]];
    for (gamma, std_norm) in [(1.0, true), (0.9, true), (1.0, false)] {
        let got = reinforce_pp_advantages(&r, &kl, 0.5, gamma, std_norm);
        // token rewards: −β·KL_t, plus r at the last token
        let rew0 = [-0.05, 0.1, -0.15 + 1.0];
        let rew1 = [-0.025 - 2.0];
        let g: Vec<f64> = returns(&rew0, gamma).into_iter().chain(returns(&rew1, gamma)).collect();
        let mean = g.iter().sum::<f64>() / 4.0;
        let var = g.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / 4.0;
        let scale = if std_norm { 1.0 / var.sqrt() } else { 1.0 };
        let want: Vec<f64> = g.iter().map(|x| (x - mean) * scale).collect();
        let flat: Vec<f64> = got.iter().flatten().copied().collect();
        assert_eq!((got[0].len(), got[1].len()), (3, 1));
        for (a, b) in flat.iter().zip(&want) {
            assert!(close(*a, *b, 1e-12), "γ {gamma}, std {std_norm}: {flat:?} vs {want:?}");
        }
    }
    // equal returns everywhere: centred to 0, the variance floored at 1e-8 (no division by 0)
    let z = reinforce_pp_advantages(&[1.0, 1.0], &[vec![0.0], vec![0.0]], 0.1, 1.0, true);
    assert_eq!(z, vec![vec![0.0], vec![0.0]]);
}

fn tiny(seed: u64) -> PolicyModel {
    let c = cfg(Family::Qwen2, false);
    let lora = LoraConfig { rank: 4, alpha: 8.0, targets: Target::ALL.to_vec(), seed, dropout: 0.0 };
    PolicyModel::new(weights(&c, 21), c, &lora, 16, DType::F32).unwrap()
}

const PROMPTS: [&[u32]; 2] = [&[1, 5], &[2, 7, 3]];
const RESPONSES: [&[u32]; 6] = [&[3, 3], &[9, 1, 2], &[4], &[6, 3], &[1, 2, 4], &[9, 9]];
const REWARDS: [f64; 6] = [1.0, -1.0, 0.0, 0.5, 2.0, -2.0];

fn rollouts() -> Vec<Rollout<'static>> {
    (0..6).map(|i| Rollout { prompt: PROMPTS[i / 3], response: RESPONSES[i] }).collect()
}

fn grpo_cfg(beta: f64, minibatch: usize) -> GrpoConfig {
    GrpoConfig {
        kl_coef: beta,
        kl: KlEstimator::K1,
        scale: GroupScale::Group,
        clip: Some(0.2),
        epochs: 1,
        minibatch,
        lr_window: LrWindow::Update,
        seed: 1,
    }
}

fn rpp_cfg(minibatch: usize) -> ReinforcePpConfig {
    ReinforcePpConfig {
        kl_coef: 0.01,
        kl: KlEstimator::K1,
        reward_norm: RewardNorm::None,
        reward_clip: 10.0,
        clip: Some(0.2),
        gamma: 1.0,
        std_norm: true,
        epochs: 1,
        minibatch,
        lr_window: LrWindow::Update,
        seed: 1,
    }
}

fn adam(m: &PolicyModel, lr: f64) -> Adam {
    m.adam(AdamConfig { lr, clip: Some(1.0), ..Default::default() }).unwrap()
}

/// The loss an update reports, by hand: at lr = 0 every step's ratio is 1, so each mini-batch's
/// loss is Σ_t (−A_t + β k3_t) over its tokens divided by their count (TRL's "dapo", OpenRLHF's
/// token-level loss), and the update reports their mean. The mini-batches are `group_order`'s.
fn hand_loss(adv: &[Vec<f64>], k3: &[Vec<f64>], beta: f64, minibatch: usize, seed: u64) -> f64 {
    let order = group_order(adv.len(), 3, seed, 0);
    let parts: Vec<f64> = order
        .chunks(minibatch)
        .map(|idx| {
            let tokens: usize = idx.iter().map(|&i| adv[i].len()).sum();
            let s: f64 = idx.iter().flat_map(|&i| adv[i].iter().zip(&k3[i]).map(|(a, k)| -a + beta * k)).sum();
            s / tokens as f64
        })
        .collect();
    parts.iter().sum::<f64>() / parts.len() as f64
}

#[test]
fn the_reported_losses_equal_a_hand_computation_on_a_tiny_policy() {
    let ro = rollouts();
    // GRPO: one update moves the policy from its reference; a second at lr = 0 reports the
    // clipped surrogate at ratio 1 plus β·k3 per token against the reference
    let m = tiny(6);
    grpo_update(&m, &mut adam(&m, 0.05), &ro, &REWARDS, 3, &grpo_cfg(0.0, 6)).unwrap();
    let tok = score_tokens(&m, &ro, KlEstimator::K1, 6).unwrap();
    let k3: Vec<Vec<f64>> = tok
        .iter()
        .map(|t| {
            t.kl.iter()
                .map(|k1| {
                    let d = -k1; // log π_ref − log π
                    d.exp() - d - 1.0
                })
                .collect()
        })
        .collect();
    assert!(k3.iter().flatten().any(|&k| k > 1e-6), "the first update did not move the policy");
    let seq = grpo_advantages(&REWARDS, 3, GroupScale::Group);
    let adv: Vec<Vec<f64>> = seq.iter().zip(&tok).map(|(&a, t)| vec![a; t.kl.len()]).collect();
    for (beta, mb) in [(0.0, 6), (0.5, 6), (0.5, 3)] {
        let st = grpo_update(&m, &mut adam(&m, 0.0), &ro, &REWARDS, 3, &grpo_cfg(beta, mb)).unwrap();
        let want = hand_loss(&adv, &k3, beta, mb, 1);
        assert!(close(st.loss, want, 1e-5), "grpo β {beta}, minibatch {mb}: {} vs {want}", st.loss);
    }
    // REINFORCE++ at the reference (KL 0): the returns are each sequence's reward at every token,
    // normalised over the update's tokens; two mini-batches of one prompt group each
    let m = tiny(6);
    let lens: Vec<usize> = score(&m, &ro, KlEstimator::K1, 6).unwrap().iter().map(|s| s.2).collect();
    let g: Vec<f64> = (0..6).flat_map(|i| std::iter::repeat_n(REWARDS[i], lens[i])).collect();
    let mean = g.iter().sum::<f64>() / g.len() as f64;
    let sd = (g.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / g.len() as f64).sqrt();
    let adv: Vec<Vec<f64>> = (0..6).map(|i| vec![(REWARDS[i] - mean) / sd; lens[i]]).collect();
    let zero: Vec<Vec<f64>> = lens.iter().map(|&l| vec![0.0; l]).collect();
    let st = reinforce_pp_update(&m, &mut adam(&m, 0.0), &ro, &REWARDS, 3, &rpp_cfg(3)).unwrap();
    let want = hand_loss(&adv, &zero, 0.0, 3, 1);
    assert!(want.abs() > 1e-3, "a mini-batch's advantages should not sum to 0 here: {want}");
    assert!(close(st.loss, want, 1e-5), "reinforce++: {} vs {want}", st.loss);
    // over the whole update the normalised advantages sum to 0: so does the one step's loss
    let st = reinforce_pp_update(&m, &mut adam(&m, 0.0), &ro, &REWARDS, 3, &rpp_cfg(6)).unwrap();
    assert!(st.loss.abs() < 1e-6, "{}", st.loss);
}

/// The gap in log-probability between the highest and the lowest rewarded sample of each group.
fn gap(m: &PolicyModel) -> f64 {
    let s = score(m, &rollouts(), KlEstimator::K1, 6).unwrap();
    (s[0].0 - s[1].0) + (s[4].0 - s[5].0)
}

#[test]
fn a_tiny_policy_learns_under_grpo_and_reinforce_pp_and_lr_zero_does_not_move() {
    let ro = rollouts();
    type Update = fn(&PolicyModel, &mut Adam, &[Rollout<'_>]) -> policy::train::UpdateStats;
    let arms: [(&str, Update); 2] = [
        ("grpo", |m, o, r| grpo_update(m, o, r, &REWARDS, 3, &GrpoConfig { epochs: 2, ..grpo_cfg(0.04, 4) }).unwrap()),
        ("reinforce++", |m, o, r| {
            reinforce_pp_update(m, o, r, &REWARDS, 3, &ReinforcePpConfig { epochs: 2, ..rpp_cfg(4) }).unwrap()
        }),
    ];
    for (name, update) in arms {
        let run = |lr: f64| -> (f64, f64, Vec<f32>, policy::train::UpdateStats) {
            let m = tiny(6);
            let mut opt = adam(&m, lr);
            let before = gap(&m);
            let first = update(&m, &mut opt, &ro);
            for _ in 0..10 {
                update(&m, &mut opt, &ro);
            }
            let w =
                m.vars().iter().flat_map(|v| v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap()).collect();
            (before, gap(&m), w, first)
        };
        let (before, after, _, first) = run(0.02);
        eprintln!("{name}: log-prob gap {before:.3} → {after:.3}");
        assert_eq!(first.kl, 0.0, "{name}: B = 0, the policy is its reference");
        assert_eq!(first.steps, 4, "{name}: 2 epochs × 2 mini-batches");
        assert!((first.reward - REWARDS.iter().sum::<f64>() / 6.0).abs() < 1e-12);
        assert!(after > before + 1.0, "{name}: the gap rose by only {:.3}", after - before);
        let (b0, a0, w0, _) = run(0.0);
        assert_eq!(b0, a0, "{name}: lr = 0 moved the policy");
        let w_init: Vec<f32> = tiny(6)
            .vars()
            .iter()
            .flat_map(|v| v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap())
            .collect();
        assert!(w0 == w_init, "{name}: lr = 0 changed an adapter weight");
    }
}

#[test]
fn bad_groups_and_rewards_are_named() {
    let ro = rollouts();
    let m = tiny(6);
    let e = grpo_update(&m, &mut adam(&m, 0.0), &ro, &REWARDS, 1, &grpo_cfg(0.0, 6)).unwrap_err().to_string();
    assert!(e.contains("grpo") && e.contains("groups of 1"), "{e}");
    let mut bad = REWARDS;
    bad[2] = f64::NAN;
    let e = reinforce_pp_update(&m, &mut adam(&m, 0.0), &ro, &bad, 3, &rpp_cfg(6)).unwrap_err().to_string();
    assert!(e.contains("reinforce-pp") && e.contains("reward 2"), "{e}");
}
