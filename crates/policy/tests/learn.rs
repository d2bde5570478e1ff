//! A tiny policy learns: a reward that pays for one token, RLOO updates on the policy's own
//! samples, and the mean reward of the policy's samples rises; with lr = 0 it does not move
//! (negative control). Also: adapters saved in PEFT's layout read back, and a q/k adapter
//! trained on llama.cpp's permuted rows is saved in Hugging Face's row order.

mod common;

use candle_core::{DType, Device, Tensor};
use common::*;
use features::model::Family;
use policy::adam::{Adam, AdamConfig};
use policy::loss::{rloo_advantages, rloo_loss};
use policy::{LoraConfig, PolicyModel, Target};
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

const PROMPT: [u32; 2] = [1, 5];
const LEN: usize = 6;
const GOOD: u32 = 3;

/// n responses of LEN tokens sampled at temperature 1 (one full forward per token).
fn sample(m: &PolicyModel, n: usize, rng: &mut rand_chacha::ChaCha8Rng) -> Vec<Vec<u32>> {
    let mut seqs: Vec<Vec<u32>> = vec![PROMPT.to_vec(); n];
    for _ in 0..LEN {
        let t = seqs[0].len();
        let ids = Tensor::from_vec(seqs.concat(), (n, t), &Device::Cpu).unwrap();
        let logits = m.forward(&ids).unwrap().narrow(1, t - 1, 1).unwrap().squeeze(1).unwrap();
        let p: Vec<Vec<f32>> =
            candle_nn::ops::softmax_last_dim(&logits.contiguous().unwrap()).unwrap().to_vec2().unwrap();
        for (s, p) in seqs.iter_mut().zip(p) {
            let u: f32 = rng.random();
            let (mut acc, mut pick) = (0.0, p.len() - 1);
            for (i, q) in p.iter().enumerate() {
                acc += q;
                if u < acc {
                    pick = i;
                    break;
                }
            }
            s.push(pick as u32);
        }
    }
    seqs
}

fn reward(s: &[u32]) -> f64 {
    s[PROMPT.len()..].iter().filter(|&&x| x == GOOD).count() as f64 / LEN as f64
}

/// Mean reward of 64 samples drawn with a fixed seed.
fn evaluate(m: &PolicyModel) -> f64 {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(99);
    let s = sample(m, 64, &mut rng);
    s.iter().map(|x| reward(x)).sum::<f64>() / s.len() as f64
}

/// `updates` RLOO steps of 8 samples; returns the evaluated reward before and after.
fn train(lr: f64, updates: usize) -> (f64, f64) {
    let c = cfg(Family::Llama, true);
    let lora = LoraConfig { rank: 4, alpha: 8.0, targets: Target::ALL.to_vec(), seed: 3, dropout: 0.0 };
    let m = PolicyModel::new(weights(&c, 11), c, &lora, 16, DType::F32).unwrap();
    let vars = m.vars();
    let mut opt = Adam::new(AdamConfig { lr, clip: Some(1.0), ..Default::default() }, &vars).unwrap();
    let before = evaluate(&m);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let n = 8;
    let t = PROMPT.len() + LEN;
    let mask: Vec<f32> =
        (0..n).flat_map(|_| (0..t - 1).map(|j| if j + 1 >= PROMPT.len() { 1.0 } else { 0.0 })).collect();
    let mask = Tensor::from_vec(mask, (n, t - 1), &Device::Cpu).unwrap();
    for _ in 0..updates {
        let seqs = sample(&m, n, &mut rng);
        let r: Vec<f64> = seqs.iter().map(|s| reward(s)).collect();
        let adv: Vec<f32> = rloo_advantages(&r, n).iter().map(|&a| a as f32).collect();
        let ids = Tensor::from_vec(seqs.concat(), (n, t), &Device::Cpu).unwrap();
        let lp = masked_sum(&token_logprobs(&m.forward(&ids).unwrap(), &ids).unwrap(), &mask).unwrap();
        let adv = Tensor::from_vec(adv, n, &Device::Cpu).unwrap();
        let loss = rloo_loss(&lp, &lp.detach(), &adv, Some(0.2)).unwrap();
        opt.step(&vars, &loss.backward().unwrap()).unwrap();
    }
    (before, evaluate(&m))
}

#[test]
fn a_tiny_policy_learns_the_rewarded_token_and_lr_zero_does_not_move() {
    let (before, after) = train(0.05, 40);
    eprintln!("mean reward {before:.3} → {after:.3}");
    assert!(after > before + 0.25, "the reward rose by only {:.3} ({before:.3} → {after:.3})", after - before);
    let (b0, a0) = train(0.0, 10);
    assert_eq!(b0, a0, "lr = 0 moved the policy");
    assert_eq!(b0, before, "same initial policy");
}

#[test]
fn adapters_round_trip_in_peft_layout_and_q_k_rows_in_hf_order() {
    let tmp = tempfile::tempdir().unwrap();
    let c = cfg(Family::Llama, true);
    let w = weights(&c, 12);
    let lora = LoraConfig {
        rank: 2,
        alpha: 4.0,
        targets: vec![Target::QProj, Target::KProj, Target::VProj],
        seed: 5,
        dropout: 0.0,
    };
    let m = PolicyModel::new(w.clone(), c.clone(), &lora, 16, DType::F32).unwrap();
    randomize(&m, 3);
    policy::peft::save(&m, tmp.path(), "tiny").unwrap();
    let cfg_json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.path().join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(cfg_json["peft_type"], "LORA");
    assert_eq!(cfg_json["r"], 2);
    assert_eq!(cfg_json["target_modules"], serde_json::json!(["k_proj", "q_proj", "v_proj"]));
    let st = candle_core::safetensors::load(tmp.path().join("adapter_model.safetensors"), &Device::Cpu).unwrap();
    assert_eq!(st["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"].dims(), [2, 16]);
    assert_eq!(st["base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"].dims(), [8, 2]);
    // read back into a model with other initial adapters: the same logits
    let other =
        PolicyModel::new(w.clone(), c.clone(), &LoraConfig { seed: 77, ..lora.clone() }, 16, DType::F32).unwrap();
    policy::peft::load(&other, tmp.path()).unwrap();
    let a: Vec<f32> = m.forward(&ids()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    let b: Vec<f32> = other.forward(&ids()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    assert_eq!(a, b);
    // the same weights in Hugging Face's layout (q/k rows un-permuted, rotate-half RoPE) with the
    // saved adapter: the same logits, so the saved rows are in HF's order
    let hd = c.head_dim;
    let to_hf = |t: &Tensor| {
        let n = t.dim(0).unwrap();
        let idx: Vec<u32> =
            (0..n).map(|r| ((r / hd) * hd + 2 * (r % hd % (hd / 2)) + (r % hd) / (hd / 2)) as u32).collect();
        t.index_select(&Tensor::from_vec(idx, n, &Device::Cpu).unwrap(), 0).unwrap()
    };
    let mut w_hf = w.clone();
    for (k, v) in w.iter() {
        if k.contains("q_proj") || k.contains("k_proj") {
            w_hf.insert(k.clone(), to_hf(v));
        }
    }
    let c_hf = features::model::Config { rope_interleaved: false, ..c.clone() };
    let hf = PolicyModel::new(w_hf, c_hf, &LoraConfig { seed: 78, ..lora.clone() }, 16, DType::F32).unwrap();
    // before loading: the two layouts are the same model (B = 0)
    let base: Vec<f32> = hf.forward(&ids()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    let plain = PolicyModel::new(w, c, &LoraConfig { seed: 79, ..lora.clone() }, 16, DType::F32).unwrap();
    let plain: Vec<f32> = plain.forward(&ids()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    assert!(max_rel(&base, &plain) < 1e-5, "HF vs GGUF layout of one model: {}", max_rel(&base, &plain));
    assert!(max_rel(&a, &base) > 1e-3, "negative control: the saved adapters change the logits");
    policy::peft::load(&hf, tmp.path()).unwrap();
    let c2: Vec<f32> = hf.forward(&ids()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    assert!(max_rel(&c2, &a) < 1e-5, "HF layout + saved adapter vs GGUF layout: {}", max_rel(&c2, &a));
}

fn tiny(seed: u64) -> PolicyModel {
    let c = cfg(Family::Qwen2, false);
    let lora = LoraConfig { rank: 4, alpha: 8.0, targets: Target::ALL.to_vec(), seed, dropout: 0.0 };
    PolicyModel::new(weights(&c, 21), c, &lora, 16, DType::F32).unwrap()
}

/// Online DPO: at the start (B = 0) the policy is its reference, so the loss is log 2 exactly
/// and the KL is 0; updates raise the chosen-minus-rejected log-probability margin; lr = 0
/// leaves every log-probability unchanged (negative control).
#[test]
fn dpo_updates_raise_the_chosen_margin_and_lr_zero_does_not_move() {
    use policy::train::{dpo_update, score, DpoConfig, KlEstimator, Preference, Rollout};
    let prompts: [&[u32]; 3] = [&[1, 5], &[2, 7, 3], &[4]];
    let chosen: [&[u32]; 3] = [&[3, 3, 9], &[6, 3], &[3, 8, 3, 1]];
    let rejected: [&[u32]; 3] = [&[10, 0], &[1, 2, 4], &[9]];
    let pairs: Vec<Preference> =
        (0..3).map(|i| Preference { prompt: prompts[i], chosen: chosen[i], rejected: rejected[i] }).collect();
    let margin = |m: &PolicyModel| -> f64 {
        let seqs: Vec<Rollout> = (0..3)
            .flat_map(|i| {
                [
                    Rollout { prompt: prompts[i], response: chosen[i] },
                    Rollout { prompt: prompts[i], response: rejected[i] },
                ]
            })
            .collect();
        let s = score(m, &seqs, KlEstimator::K1, 4).unwrap();
        s.chunks(2).map(|c| c[0].0 - c[1].0).sum::<f64>() / 3.0
    };
    let run = |lr: f64| -> (f64, f64, f64, f64) {
        let m = tiny(4);
        let vars = m.vars();
        let mut opt = Adam::new(AdamConfig { lr, clip: Some(1.0), ..Default::default() }, &vars).unwrap();
        let before = margin(&m);
        // one mini-batch of all three pairs: the first update's loss is taken at B = 0
        let cfg = DpoConfig { beta: 0.5, epochs: 1, minibatch: 3, lr_window: policy::adam::LrWindow::Update, seed: 3 };
        let first = dpo_update(&m, &mut opt, &pairs, &cfg).unwrap();
        for _ in 0..31 {
            dpo_update(&m, &mut opt, &pairs, &cfg).unwrap();
        }
        (before, margin(&m), first.loss, first.kl)
    };
    let (before, after, first_loss, kl0) = run(0.02);
    eprintln!("DPO margin {before:.3} → {after:.3}");
    // the first loss is taken before any step: the policy is its reference, loss = log 2
    assert!((first_loss - std::f64::consts::LN_2).abs() < 1e-6, "first loss {first_loss}");
    assert_eq!(kl0, 0.0, "B = 0: the policy is its reference");
    assert!(after > before + 1.0, "the margin rose by only {:.3}", after - before);
    let (b0, a0, _, _) = run(0.0);
    assert_eq!(b0, a0, "lr = 0 moved the policy");
}

/// RLOO through `rloo_update`: the sample with the highest reward in each group gains
/// log-probability relative to the lowest; with lr = 0 nothing moves. The first update's KL is
/// 0 (B = 0) and its mean reward is the rewards' mean.
#[test]
fn rloo_updates_favour_the_rewarded_samples_and_lr_zero_does_not_move() {
    use policy::train::{rloo_update, score, KlEstimator, RlooConfig, Rollout};
    let prompts: [&[u32]; 2] = [&[1, 5], &[2, 7, 3]];
    let responses: [&[u32]; 6] = [&[3, 3], &[9, 1, 2], &[4], &[6, 3], &[1, 2, 4], &[9, 9]];
    let rollouts: Vec<Rollout> = (0..6).map(|i| Rollout { prompt: prompts[i / 3], response: responses[i] }).collect();
    let rewards = [1.0, -1.0, 0.0, 0.5, 2.0, -2.0];
    let gap = |m: &PolicyModel| -> f64 {
        let s = score(m, &rollouts, KlEstimator::K3, 4).unwrap();
        (s[0].0 - s[1].0) + (s[4].0 - s[5].0)
    };
    let run = |lr: f64| -> (f64, f64, policy::train::UpdateStats) {
        let m = tiny(6);
        let vars = m.vars();
        let mut opt = Adam::new(AdamConfig { lr, clip: Some(1.0), ..Default::default() }, &vars).unwrap();
        let cfg = RlooConfig {
            kl_coef: 0.05,
            kl: KlEstimator::K1,
            kl_penalty: policy::train::KlPenalty::Sequence,
            reward_norm: policy::train::RewardNorm::None,
            clip: Some(0.2),
            epochs: 2,
            minibatch: 4,
            normalize_advantages: true,
            lr_window: policy::adam::LrWindow::Update,
            seed: 1,
        };
        let before = gap(&m);
        let first = rloo_update(&m, &mut opt, &rollouts, &rewards, 3, &cfg).unwrap();
        for _ in 0..10 {
            rloo_update(&m, &mut opt, &rollouts, &rewards, 3, &cfg).unwrap();
        }
        (before, gap(&m), first)
    };
    let (before, after, first) = run(0.02);
    eprintln!("RLOO log-prob gap {before:.3} → {after:.3}");
    assert_eq!(first.kl, 0.0);
    assert!((first.reward - rewards.iter().sum::<f64>() / 6.0).abs() < 1e-12);
    assert_eq!(first.steps, 4, "2 epochs × 2 mini-batches");
    assert!(after > before + 1.0, "the gap rose by only {:.3}", after - before);
    let (b0, a0, _) = run(0.0);
    assert_eq!(b0, a0, "lr = 0 moved the policy");
}

fn rollouts6() -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    let prompts = vec![vec![1u32, 5], vec![2, 7, 3]];
    let responses = vec![vec![3u32, 3], vec![9, 1, 2], vec![4], vec![6, 3], vec![1, 2, 4], vec![9, 9]];
    (prompts, responses)
}

fn rloo_cfg(norm: policy::train::RewardNorm, pen: policy::train::KlPenalty) -> policy::train::RlooConfig {
    policy::train::RlooConfig {
        kl_coef: 0.05,
        kl: policy::train::KlEstimator::K1,
        kl_penalty: pen,
        reward_norm: norm,
        clip: Some(0.2),
        epochs: 2,
        minibatch: 4,
        normalize_advantages: true,
        lr_window: policy::adam::LrWindow::Update,
        seed: 2,
    }
}

/// Adapter values after `updates` RLOO updates with `rewards` (the first update has KL 0; the
/// later ones carry a KL term, so the reward's scale matters unless it is normalised).
fn after_rloo(rewards: &[f64], cfg: &policy::train::RlooConfig, updates: usize) -> Vec<f32> {
    use policy::train::{rloo_update, Rollout};
    let (p, r) = rollouts6();
    let rollouts: Vec<Rollout> = (0..6).map(|i| Rollout { prompt: &p[i / 3], response: &r[i] }).collect();
    let m = tiny(6);
    let mut opt = m.adam(AdamConfig { lr: 0.02, clip: Some(1.0), ..Default::default() }).unwrap();
    for _ in 0..updates {
        rloo_update(&m, &mut opt, &rollouts, rewards, 3, cfg).unwrap();
    }
    m.vars().iter().flat_map(|v| v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap()).collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// The learned reward φᵀθ scales with ‖θ‖: with the reward normalised per chunk, θ × 10
/// (rewards × 10) leaves the update unchanged, with the KL per sequence and per token; raw
/// rewards (the negative control) give another update, because β·KL weighs 10× less.
#[test]
fn a_normalised_reward_makes_the_update_independent_of_the_rewards_scale() {
    use policy::train::{KlPenalty, RewardNorm};
    let r = [1.0, -1.0, 0.0, 0.5, 2.0, -2.0];
    let r10: Vec<f64> = r.iter().map(|x| x * 10.0).collect();
    for pen in [KlPenalty::Sequence, KlPenalty::Token] {
        let norm = rloo_cfg(RewardNorm::Chunk { clip: 10.0 }, pen);
        let (a, b) = (after_rloo(&r, &norm, 3), after_rloo(&r10, &norm, 3));
        let moved = max_diff(&a, &after_rloo(&r, &norm, 0));
        assert!(moved > 1e-3, "{pen:?}: the updates moved the adapters by {moved}");
        assert!(
            max_diff(&a, &b) <= 1e-6 * moved,
            "{pen:?} normalised: θ×10 changed the update by {}",
            max_diff(&a, &b)
        );
        let raw = rloo_cfg(RewardNorm::None, pen);
        let (a, b) = (after_rloo(&r, &raw, 3), after_rloo(&r10, &raw, 3));
        assert!(max_diff(&a, &b) > 1e-2 * moved, "{pen:?} raw: θ×10 should change the update");
    }
}

/// The KL per token (OpenRLHF's shaping, token-level ratios) learns like the per-sequence form:
/// the rewarded samples gain log-probability; lr = 0 does not move.
#[test]
fn rloo_with_the_kl_per_token_favours_the_rewarded_samples() {
    use policy::train::{score, KlEstimator, KlPenalty, RewardNorm, Rollout};
    let (p, r) = rollouts6();
    let rollouts: Vec<Rollout> = (0..6).map(|i| Rollout { prompt: &p[i / 3], response: &r[i] }).collect();
    let rewards = [1.0, -1.0, 0.0, 0.5, 2.0, -2.0];
    let cfg = rloo_cfg(RewardNorm::Chunk { clip: 10.0 }, KlPenalty::Token);
    let gap = |m: &PolicyModel| -> f64 {
        let s = score(m, &rollouts, KlEstimator::K1, 4).unwrap();
        (s[0].0 - s[1].0) + (s[4].0 - s[5].0)
    };
    let m = tiny(6);
    let mut opt = m.adam(AdamConfig { lr: 0.02, clip: Some(1.0), ..Default::default() }).unwrap();
    let before = gap(&m);
    for _ in 0..10 {
        policy::train::rloo_update(&m, &mut opt, &rollouts, &rewards, 3, &cfg).unwrap();
    }
    let after = gap(&m);
    assert!(after > before + 1.0, "per-token KL: the gap rose by only {:.3}", after - before);
}

/// A gradient that does not reach the adapters is an error, not a zero step: Adam refuses a
/// variable without a gradient (naming it), and an RLOO update whose gradient is exactly 0
/// while its advantages are not (A = B = 0 cuts every adapter's gradient) stops.
#[test]
fn a_missing_or_empty_gradient_is_an_error() {
    use policy::train::{KlPenalty, RewardNorm, Rollout};
    let m = tiny(6);
    let vars = m.vars();
    let mut opt = m.adam(AdamConfig::default()).unwrap();
    // a loss that reaches only the first variable
    let loss = vars[0].as_tensor().sum_all().unwrap();
    let e = opt.step(&vars, &loss.backward().unwrap()).unwrap_err().to_string();
    assert!(e.contains("model.layers.0.self_attn.q_proj.lora_B") && e.contains("no gradient"), "{e}");
    assert_eq!(opt.steps(), 0, "nothing stepped");
    for v in &vars {
        v.set(&v.as_tensor().zeros_like().unwrap()).unwrap();
    }
    let (p, r) = rollouts6();
    let rollouts: Vec<Rollout> = (0..6).map(|i| Rollout { prompt: &p[i / 3], response: &r[i] }).collect();
    let cfg = rloo_cfg(RewardNorm::Chunk { clip: 10.0 }, KlPenalty::Sequence);
    let e = policy::train::rloo_update(&m, &mut opt, &rollouts, &[1.0, -1.0, 0.0, 0.5, 2.0, -2.0], 3, &cfg)
        .unwrap_err()
        .to_string();
    assert!(e.contains("exactly 0"), "{e}");
    // negative control: all-equal rewards give zero advantages, and a zero gradient is then fine
    let cfg = rloo_cfg(RewardNorm::Chunk { clip: 10.0 }, KlPenalty::Sequence);
    policy::train::rloo_update(&m, &mut opt, &rollouts, &[1.0; 6], 3, &cfg).unwrap();
}

/// Mini-batches are shuffled per epoch: a permutation, reproducible from (seed, step), another
/// one at another step or seed.
#[test]
fn minibatch_order_is_a_seeded_permutation_per_epoch() {
    use policy::train::epoch_order;
    let a = epoch_order(40, 7, 0);
    let mut sorted = a.clone();
    sorted.sort();
    assert_eq!(sorted, (0..40).collect::<Vec<_>>());
    assert_eq!(a, epoch_order(40, 7, 0));
    assert_ne!(a, epoch_order(40, 7, 5));
    assert_ne!(a, epoch_order(40, 8, 0));
    assert_ne!(a, (0..40).collect::<Vec<_>>());
}

/// RLOO's order keeps each prompt's group together: a permutation of whole groups (a short last
/// group included), each group's samples consecutive and in order, the groups shuffled.
#[test]
fn rloo_order_shuffles_whole_groups() {
    use policy::train::group_order;
    let o = group_order(22, 4, 3, 0);
    let mut sorted = o.clone();
    sorted.sort();
    assert_eq!(sorted, (0..22).collect::<Vec<_>>());
    let mut starts = Vec::new();
    let mut i = 0;
    while i < o.len() {
        let g = o[i] / 4;
        let len = if g == 5 { 2 } else { 4 };
        assert_eq!(&o[i..i + len], &(g * 4..g * 4 + len).collect::<Vec<_>>()[..], "group {g} whole, in order");
        starts.push(g);
        i += len;
    }
    assert_ne!(starts, (0..6).collect::<Vec<_>>(), "the groups are shuffled");
    assert_eq!(o, group_order(22, 4, 3, 0));
}

/// The sampler is the trained policy: after a few RLOO updates at the paper presets' lr
/// (5e-7), the f32 merge the generator loads changes most adapted weights and gives other
/// logits than the base model, with a small merge error; the negative control — the same
/// weights merged in bf16 — rounds the update away: almost every adapted weight is the bf16
/// base's, and the merge error (against W + BA in f64) is far above 1.
#[test]
fn the_generating_weights_carry_a_tiny_update_and_a_bf16_merge_does_not() {
    use policy::train::{KlPenalty, RewardNorm, Rollout};
    let c = cfg(Family::Qwen2, false);
    let w = weights(&c, 21);
    let lora = LoraConfig { rank: 4, alpha: 8.0, targets: Target::ALL.to_vec(), seed: 6, dropout: 0.0 };
    let m = PolicyModel::new(w.clone(), c.clone(), &lora, 16, DType::F32).unwrap();
    let d0 = m.digest().unwrap();
    let mut opt = m.adam(AdamConfig { lr: 5e-7, clip: Some(1.0), ..Default::default() }).unwrap();
    let (p, r) = rollouts6();
    let rollouts: Vec<Rollout> = (0..6).map(|i| Rollout { prompt: &p[i / 3], response: &r[i] }).collect();
    let cfg = rloo_cfg(RewardNorm::Chunk { clip: 10.0 }, KlPenalty::Sequence);
    for _ in 0..3 {
        policy::train::rloo_update(&m, &mut opt, &rollouts, &[1.0, -1.0, 0.0, 0.5, 2.0, -2.0], 3, &cfg).unwrap();
    }
    assert_ne!(m.digest().unwrap(), d0, "the digest names the updated adapters");
    let ids = ids();
    let logits = |t: &HashMap<String, Tensor>, dt: DType| -> Vec<f32> {
        let vb = candle_nn::VarBuilder::from_tensors(t.clone(), dt, &Device::Cpu);
        let model = features::model::Model::load_with(vb, c.clone(), 32, Some(true)).unwrap();
        model.logits(&ids).unwrap().to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    };
    let merged = m.merged_weights().unwrap();
    let err32 = m.merge_error(&merged).unwrap();
    let moved32 = max_diff(&logits(&merged, DType::F32), &logits(&w, DType::F32));
    let bf16: HashMap<String, Tensor> = merged
        .iter()
        .map(|(k, v)| (k.clone(), v.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap()))
        .collect();
    let base16: HashMap<String, Tensor> =
        w.iter().map(|(k, v)| (k.clone(), v.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap())).collect();
    let err16 = m.merge_error(&bf16).unwrap();
    // the fraction of adapted weights that differ from the base's, in each precision
    let changed = |a: &HashMap<String, Tensor>, b: &HashMap<String, Tensor>| -> f64 {
        let (mut n, mut d) = (0usize, 0usize);
        for (name, _) in m.adapters() {
            let k = format!("{name}.weight");
            let x: Vec<f32> = a[&k].flatten_all().unwrap().to_vec1().unwrap();
            let y: Vec<f32> = b[&k].flatten_all().unwrap().to_vec1().unwrap();
            n += x.len();
            d += x.iter().zip(&y).filter(|(p, q)| p != q).count();
        }
        d as f64 / n as f64
    };
    let (c32, c16) = (changed(&merged, &w), changed(&bf16, &base16));
    eprintln!(
        "lr 5e-7 × 3 updates: f32 merge error {err32:.2e}, {:.1}% of adapted weights changed, logits moved {moved32:.2e}; \
         bf16 merge error {err16:.1}, {:.2}% changed",
        100.0 * c32,
        100.0 * c16
    );
    assert!(err32 < 1e-2, "the f32 merge keeps the update: error {err32}");
    assert!(c32 > 0.5, "the f32 merge changed only {c32} of the adapted weights");
    assert!(moved32 > 0.0, "the f32 merge moved no logit");
    assert!(err16 > 1.0, "negative control: a bf16 merge should lose the update (error {err16})");
    assert!(c16 < 0.01, "negative control: the bf16 merge kept {c16} of the update's changes");
}

/// `logprob_sums` of the reference equals `score`'s Σ log π while the adapters are at their
/// start (B = 0: the policy is its reference, KL 0), and no longer once they moved (negative
/// control: the adapted sums differ from the reference's).
#[test]
fn one_pass_sums_equal_score_for_an_unmoved_policy() {
    use policy::train::{logprob_sums, score, KlEstimator, KlPenalty, RewardNorm, Rollout};
    let (p, r) = rollouts6();
    let rollouts: Vec<Rollout> = (0..6).map(|i| Rollout { prompt: &p[i / 3], response: &r[i] }).collect();
    let m = tiny(6);
    let full = score(&m, &rollouts, KlEstimator::K1, 4).unwrap();
    let one = logprob_sums(&m, &rollouts, 4, false).unwrap();
    for (f, o) in full.iter().zip(&one) {
        assert_eq!((f.0, f.2), *o);
        assert_eq!(f.1, 0.0);
    }
    let mut opt = m.adam(AdamConfig { lr: 0.02, clip: Some(1.0), ..Default::default() }).unwrap();
    let cfg = rloo_cfg(RewardNorm::Chunk { clip: 10.0 }, KlPenalty::Sequence);
    policy::train::rloo_update(&m, &mut opt, &rollouts, &[1.0, -1.0, 0.0, 0.5, 2.0, -2.0], 3, &cfg).unwrap();
    let moved = logprob_sums(&m, &rollouts, 4, true).unwrap();
    let reference = logprob_sums(&m, &rollouts, 4, false).unwrap();
    assert_eq!(reference, one, "the reference does not move");
    assert!(moved.iter().zip(&reference).any(|(a, b)| a.0 != b.0), "the adapted sums should differ after an update");
}

/// PPO with a critic through `ppo_update` learns the rewarded token: 8 samples per update (k = 8,
/// one group), the reward paid at the last token, γ = 1, λ = 0.95, ratio and value clip 0.2,
/// the critic a separate model with its own adapters and a value head from zero. lr = 0 (actor
/// and critic) does not move the policy (negative control); the critic's loss falls as it
/// learns the values.
#[test]
fn a_tiny_policy_learns_the_rewarded_token_with_ppo_and_lr_zero_does_not_move() {
    use policy::critic::Critic;
    use policy::train::{ppo_update, KlEstimator, PpoConfig, RewardNorm, Rollout};
    let run = |lr: f64, updates: usize| -> (f64, f64, Vec<f64>) {
        let c = cfg(Family::Llama, true);
        let lora = LoraConfig { rank: 4, alpha: 8.0, targets: Target::ALL.to_vec(), seed: 3, dropout: 0.0 };
        let m = PolicyModel::new(weights(&c, 11), c.clone(), &lora, 16, DType::F32).unwrap();
        let cm = PolicyModel::new(weights(&c, 11), c.clone(), &LoraConfig { seed: 4, ..lora }, 16, DType::F32).unwrap();
        let critic = Critic::new(cm, &vec![0.0; c.hidden]).unwrap();
        let mut aopt = m.adam(AdamConfig { lr, clip: Some(1.0), ..Default::default() }).unwrap();
        let mut copt = critic.adam(AdamConfig { lr: lr * 2.0, clip: Some(1.0), ..Default::default() }).unwrap();
        let cfg = PpoConfig {
            kl_coef: 0.01,
            kl: KlEstimator::K1,
            reward_norm: RewardNorm::None,
            clip: Some(0.2),
            value_clip: Some(0.2),
            gamma: 1.0,
            lambda: 0.95,
            epochs: 1,
            minibatch: 8,
            normalize_advantages: true,
            lr_window: policy::adam::LrWindow::Update,
            seed: 5,
        };
        let before = evaluate(&m);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let mut closs = Vec::new();
        for _ in 0..updates {
            let seqs = sample(&m, 8, &mut rng);
            let r: Vec<f64> = seqs.iter().map(|s| reward(s)).collect();
            let rollouts: Vec<Rollout> =
                seqs.iter().map(|s| Rollout { prompt: &PROMPT, response: &s[PROMPT.len()..] }).collect();
            let st = ppo_update((&m, &mut aopt), (&critic, &mut copt), &rollouts, &r, 8, &cfg).unwrap();
            assert_eq!(st.actor.steps, 1);
            closs.push(st.critic_loss);
        }
        (before, evaluate(&m), closs)
    };
    let (before, after, closs) = run(0.05, 40);
    eprintln!("PPO mean reward {before:.3} → {after:.3}; critic loss {:.4} → {:.4}", closs[0], closs[closs.len() - 1]);
    assert!(after > before + 0.25, "the reward rose by only {:.3} ({before:.3} → {after:.3})", after - before);
    let (early, late) = (closs[..10].iter().sum::<f64>(), closs[30..].iter().sum::<f64>());
    assert!(late < early, "the critic's loss did not fall: first 10 updates {early:.4}, last 10 {late:.4}");
    let (b0, a0, _) = run(0.0, 5);
    assert_eq!(b0, a0, "lr = 0 moved the policy");
    assert_eq!(b0, before);
}

/// A critic started as a normalised reward model (`Critic::with_offset`): V = vᵀh + b equals
/// the plain critic's vᵀh plus b at every response token, and the head's gradient is the
/// same (b is a constant, not trained); and `RewardNorm::moments` are the mean and population
/// sd that `apply` divides by, checked by hand (all-equal rewards: none).
#[test]
fn a_critic_offset_shifts_every_value_and_moments_match_the_normalisation() {
    use policy::critic::Critic;
    use policy::train::RewardNorm;
    let (p, r) = rollouts6();
    let seqs: Vec<(&[u32], &[u32])> = (0..6).map(|i| (p[i / 3].as_slice(), r[i].as_slice())).collect();
    let c = cfg(Family::Llama, true);
    let lora = LoraConfig { rank: 2, alpha: 4.0, targets: Target::ALL.to_vec(), seed: 3, dropout: 0.0 };
    let head: Vec<f64> = (0..c.hidden).map(|i| ((i * 7 % 5) as f64 - 2.0) * 0.1).collect();
    let plain =
        Critic::new(PolicyModel::new(weights(&c, 11), c.clone(), &lora, 16, DType::F32).unwrap(), &head).unwrap();
    let shifted =
        Critic::with_offset(PolicyModel::new(weights(&c, 11), c.clone(), &lora, 16, DType::F32).unwrap(), &head, -0.75)
            .unwrap();
    let b = policy::batch::SeqBatch::shared(&seqs, plain.model.device()).unwrap();
    let (v0, v1) = (
        plain.values(&b, policy::lora::Pass::ADAPTED).unwrap(),
        shifted.values(&b, policy::lora::Pass::ADAPTED).unwrap(),
    );
    let (a, s): (Vec<f32>, Vec<f32>) = (v0.to_vec1().unwrap(), v1.to_vec1().unwrap());
    assert!(a.iter().zip(&s).all(|(x, y)| (y - (x - 0.75)).abs() < 1e-6), "V + b at every token");
    let (g0, g1) = (v0.sum_all().unwrap().backward().unwrap(), v1.sum_all().unwrap().backward().unwrap());
    let (h0, h1): (Vec<f32>, Vec<f32>) = (
        g0.get(plain.head.as_tensor()).unwrap().to_vec1().unwrap(),
        g1.get(shifted.head.as_tensor()).unwrap().to_vec1().unwrap(),
    );
    assert_eq!(h0, h1, "the offset does not change the head's gradient");
    assert!(Critic::with_offset(plain.model, &head, f64::NAN).is_err(), "a NaN offset is refused");
    let rs = [1.0, 3.0, -2.0, 6.0];
    let (mean, sd) = RewardNorm::Chunk { clip: 10.0 }.moments(&rs).unwrap();
    let m = 8.0 / 4.0;
    let var = rs.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / 4.0;
    assert_eq!((mean, sd), (m, var.sqrt()));
    let n = RewardNorm::Chunk { clip: 10.0 }.apply(&rs);
    assert!(n.iter().zip(&rs).all(|(a, x)| (a - (x - mean) / sd).abs() < 1e-15));
    assert_eq!(RewardNorm::Chunk { clip: 10.0 }.moments(&[2.0, 2.0]), None);
    assert_eq!(RewardNorm::None.moments(&rs), Some((0.0, 1.0)));
}
