//! A tiny policy learns: a reward that pays for one token, RLOO updates on the policy's own
//! samples, and the mean reward of the policy's samples rises; with lr = 0 it does not move
//! (negative control). Also: adapters saved in PEFT's layout read back, and a q/k adapter
//! trained on llama.cpp's permuted rows is saved in Hugging Face's row order.

mod common;

use candle_core::{DType, Device, Tensor};
use common::*;
use features::model::Family;
use policy::adam::{Adam, AdamConfig};
use policy::loss::{masked_sum, rloo_advantages, rloo_loss, token_logprobs};
use policy::{LoraConfig, PolicyModel, Target};
use rand::{Rng, SeedableRng};

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
        let cfg = DpoConfig { beta: 0.5, epochs: 1, minibatch: 2 };
        let first = dpo_update(&m, &mut opt, &pairs, &cfg).unwrap();
        for _ in 0..15 {
            dpo_update(&m, &mut opt, &pairs, &cfg).unwrap();
        }
        (before, margin(&m), first.loss, first.kl)
    };
    let (before, after, first_loss, kl0) = run(0.02);
    eprintln!("DPO margin {before:.3} → {after:.3}");
    // the first mini-batch's loss is log 2; the second mini-batch has moved by one step
    assert!(first_loss > 0.6 && first_loss < 0.7, "first loss {first_loss}");
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
            clip: Some(0.2),
            epochs: 2,
            minibatch: 4,
            normalize_advantages: true,
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
