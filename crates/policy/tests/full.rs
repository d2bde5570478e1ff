//! Full-parameter training (issue 29: the authors' DPO arm trains every weight): every weight of
//! the decoder is a variable whose gradient autograd gives — checked against central finite
//! differences in f64 on both kernel paths; the reference pass stays the initial policy until
//! moved; the weights a generator loads are the trained ones; a checkpoint's values and life
//! replay rebuild the same model; DPO moves the implicit reward and lr = 0 does not.

mod common;

use candle_core::{DType, Device, Tensor};
use common::*;
use features::model::Family;
use policy::adam::{Adam, AdamConfig, LrWindow};
use policy::batch::SeqBatch;
use policy::ops::Kernels;
use policy::train::{dpo_update, DpoConfig, Preference};
use policy::{LoraConfig, PolicyModel};
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

const SEQS: [(&[u32], &[u32]); 3] = [(&[1, 5, 3], &[9, 2, 4]), (&[4], &[10, 0, 6, 8]), (&[7, 7, 2, 1], &[3])];

/// Qwen2 (q/k/v biases) with an untied LM head, or Llama with a tied one.
fn tensors(family: Family, dtype: DType) -> (HashMap<String, Tensor>, features::model::Config) {
    let c = cfg(family, false);
    let mut w = weights(&c, 31);
    if family == Family::Qwen2 {
        let head = w["model.embed_tokens.weight"].affine(0.7, 0.01).unwrap();
        w.insert("lm_head.weight".into(), head);
    }
    (w.into_iter().map(|(k, v)| (k, v.to_dtype(dtype).unwrap())).collect(), c)
}

fn full(family: Family, dtype: DType) -> PolicyModel {
    let (w, c) = tensors(family, dtype);
    PolicyModel::new_full(w, c, 32, dtype).unwrap()
}

fn batch() -> SeqBatch {
    SeqBatch::shared(&SEQS, &Device::Cpu).unwrap()
}

fn lp(m: &PolicyModel, adapters: bool) -> Vec<f64> {
    m.logprobs_at(&batch(), adapters).unwrap().to_dtype(DType::F64).unwrap().to_vec1().unwrap()
}

/// A fixed random weighting of the response tokens' log-probabilities: the scalar loss.
fn loss_weights(n: usize) -> Vec<f64> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
    (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
}

fn loss(m: &PolicyModel) -> f64 {
    let l = lp(m, true);
    l.iter().zip(loss_weights(l.len())).map(|(a, b)| a * b).sum()
}

/// Moves every weight by a random amount (the trained policy differs from the initial one).
fn perturb(m: &PolicyModel, seed: u64, size: f64) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    for v in m.vars() {
        let t = v.as_tensor();
        let d: Vec<f64> = (0..t.elem_count()).map(|_| rng.random_range(-size..size)).collect();
        let d = Tensor::from_vec(d, t.shape(), t.device()).unwrap().to_dtype(t.dtype()).unwrap();
        v.set(&(t + d).unwrap()).unwrap();
    }
}

/// Every weight the decoder reads is a variable (embeddings, norms, every linear weight and
/// bias, an untied LM head), and its gradient from backward equals a central finite
/// difference of the loss (f64, h = 1e-5: error O(h²) ≈ 1e-10 relative) at three elements of
/// each — on the fused kernels (the CPU's) and on the composed ones (other devices'), which
/// also agree with each other. Negative control: the difference quotient of a different
/// element is not the gradient.
#[test]
fn every_weight_gets_its_gradient_on_both_kernel_paths() {
    for family in [Family::Qwen2, Family::Llama] {
        let mut by_kernel = Vec::new();
        for k in [Kernels::Fused, Kernels::Routed, Kernels::Composed] {
            let mut m = full(family, DType::F64);
            m.set_kernels(k).unwrap();
            perturb(&m, 2, 0.05);
            let names = m.var_names();
            let c = m.config().clone();
            // embeddings, final norm, an untied head; per layer two norms, 7 weights, q/k/v biases
            let expect = 2 + usize::from(family == Family::Qwen2) + c.layers * (9 + if c.qkv_bias { 3 } else { 0 });
            assert_eq!(names.len(), expect, "{names:?}");
            let l = m.logprobs_at(&batch(), true).unwrap();
            let w = Tensor::from_vec(loss_weights(l.dim(0).unwrap()), l.dim(0).unwrap(), &Device::Cpu).unwrap();
            let grads = (l * w).unwrap().sum_all().unwrap().backward().unwrap();
            let mut all = Vec::new();
            for (name, v) in names.iter().zip(m.vars()) {
                let g: Vec<f64> = grads
                    .get(v.as_tensor())
                    .unwrap_or_else(|| panic!("{name}: no gradient"))
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                let x0: Vec<f64> = v.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
                let n = x0.len();
                let at = |x: &[f64]| {
                    v.set(&Tensor::from_vec(x.to_vec(), v.as_tensor().shape(), &Device::Cpu).unwrap()).unwrap();
                    loss(&m)
                };
                let h = 1e-5;
                for i in [0, n / 2, n - 1] {
                    let (mut up, mut down) = (x0.clone(), x0.clone());
                    up[i] += h;
                    down[i] -= h;
                    let fd = (at(&up) - at(&down)) / (2.0 * h);
                    let scale = g[i].abs().max(1e-3);
                    assert!((fd - g[i]).abs() / scale < 1e-5, "{name}[{i}] ({k:?}): autograd {} vs {fd}", g[i]);
                    if n > 1 {
                        let j = (i + 1) % n;
                        if (g[j] - g[i]).abs() > 1e-3 {
                            assert!((fd - g[j]).abs() / scale > 1e-5, "negative control: {name}[{j}]");
                        }
                    }
                }
                at(&x0);
                all.extend(g);
            }
            by_kernel.push(all);
        }
        let r = rel(&by_kernel[0], &by_kernel[1]);
        assert!(r < 1e-10, "{family:?}: fused and composed gradients differ by {r:e}");
    }
}

/// At the start the full-parameter policy is the base (its log-probabilities equal an adapter
/// policy's at B = 0 to f32 rounding; its reference pass equals the base's bit for bit). After
/// training-sized moves the reference still computes the base, `at_reference` is false, and
/// `reference_here` makes the reference the current policy.
#[test]
fn the_reference_stays_the_initial_policy_until_moved() {
    let (w, c) = tensors(Family::Qwen2, DType::F32);
    let lora = LoraConfig { rank: 2, alpha: 4.0, targets: policy::Target::ALL.to_vec(), seed: 1, dropout: 0.0 };
    let adapter = PolicyModel::new(w, c, &lora, 32, DType::F32).unwrap();
    let mut m = full(Family::Qwen2, DType::F32);
    let base = lp(&adapter, false);
    assert!(rel(&lp(&m, true), &base) < 1e-5, "the full policy starts as the base");
    assert_eq!(lp(&m, false), base, "its reference is the base, bit for bit");
    assert!(m.at_reference().unwrap());
    perturb(&m, 5, 0.02);
    let moved = lp(&m, true);
    assert!(rel(&moved, &base) > 1e-3, "negative control: the weights moved the policy");
    assert_eq!(lp(&m, false), base, "training does not move the reference");
    assert!(!m.at_reference().unwrap());
    m.reference_here().unwrap();
    assert!(m.at_reference().unwrap());
    assert!(rel(&lp(&m, false), &moved) < 1e-5, "the reference is now the moved policy");
    assert_eq!(lp(&m, true), moved, "moving the reference does not move the policy");
    // a merge has nothing to merge: the policy and its digest stay
    let d = m.digest().unwrap();
    m.merge_and_reset(3).unwrap();
    assert_eq!((lp(&m, true), m.digest().unwrap()), (moved, d));
}

/// The generator's weights are the trained ones: the fused inference model loaded from
/// `merged_weights` gives the training model's logits (f32 rounding), merge_error is 0; the
/// base weights' logits differ (negative control). A full policy has no PEFT adapter to save.
#[test]
fn the_generator_loads_the_trained_weights() {
    let m = full(Family::Llama, DType::F32);
    perturb(&m, 8, 0.03);
    let ids = ids();
    let train: Vec<f32> = m.forward(&ids).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    let merged = m.merged_weights().unwrap();
    assert_eq!(m.merge_error(&merged).unwrap(), 0.0);
    let c = m.config().clone();
    let gen = inference_logits(&merged, &c, &ids);
    assert!(max_rel(&gen, &train) < 1e-4, "generator vs trainer: {:e}", max_rel(&gen, &train));
    let (w, _) = tensors(Family::Llama, DType::F32);
    assert!(max_rel(&inference_logits(&w, &c, &ids), &train) > 1e-3, "negative control: the base differs");
    let e = policy::peft::encode(&m, "base").unwrap_err().to_string();
    assert!(e.contains("full-parameter"), "{e}");
}

/// A checkpoint's weights and life events (the last reference move) rebuild the model: the
/// policy's and the reference's log-probabilities bit for bit, and the digest.
#[test]
fn a_checkpoint_rebuilds_the_policy_and_its_reference() {
    let mut m = full(Family::Qwen2, DType::F32);
    perturb(&m, 11, 0.02);
    m.reference_here().unwrap();
    perturb(&m, 12, 0.02);
    m.reference_here().unwrap();
    assert_eq!(m.life().len(), 1, "a full policy keeps only its last reference");
    perturb(&m, 13, 0.02);
    let (vars, life) = (m.var_values().unwrap(), m.life().to_vec());
    let mut back = full(Family::Qwen2, DType::F32);
    back.replay(&life).unwrap();
    back.set_var_values(&vars).unwrap();
    assert_eq!(lp(&back, true), lp(&m, true));
    assert_eq!(lp(&back, false), lp(&m, false));
    assert_ne!(lp(&m, true), lp(&m, false), "negative control: the policy is not its reference");
    assert_eq!(back.digest().unwrap(), m.digest().unwrap());
}

/// DPO over every weight raises the chosen-minus-rejected margin (the implicit reward's
/// direction); its first loss is log 2 (the policy is its reference); lr = 0 moves nothing.
#[test]
fn full_parameter_dpo_raises_the_margin_and_lr_zero_does_not_move() {
    let prompts: [&[u32]; 3] = [&[1, 5], &[2, 7, 3], &[4]];
    let chosen: [&[u32]; 3] = [&[3, 3, 9], &[6, 3], &[3, 8, 3, 1]];
    let rejected: [&[u32]; 3] = [&[10, 0], &[1, 2, 4], &[9]];
    let pairs: Vec<Preference> =
        (0..3).map(|i| Preference { prompt: prompts[i], chosen: chosen[i], rejected: rejected[i] }).collect();
    let run = |lr: f64| -> (f64, f64, f64) {
        let m = full(Family::Qwen2, DType::F32);
        let mut opt = Adam::new(AdamConfig { lr, ..Default::default() }, &m.vars()).unwrap();
        let cfg = DpoConfig { beta: 0.5, epochs: 1, minibatch: 3, lr_window: LrWindow::Update, seed: 3 };
        let first = dpo_update(&m, &mut opt, &pairs, &cfg).unwrap();
        let mut last = first;
        for _ in 0..15 {
            last = dpo_update(&m, &mut opt, &pairs, &cfg).unwrap();
        }
        let w: Vec<Vec<f32>> = m.var_values().unwrap();
        let moved = w
            .iter()
            .flatten()
            .zip(full(Family::Qwen2, DType::F32).var_values().unwrap().iter().flatten())
            .map(|(a, b)| (a - b).abs() as f64)
            .fold(0.0, f64::max);
        (first.loss, last.loss, moved)
    };
    let (first, last, moved) = run(0.005);
    assert!((first - std::f64::consts::LN_2).abs() < 1e-6, "first loss {first}");
    assert!(last < first - 0.1, "the DPO loss fell only from {first} to {last}");
    assert!(moved > 0.0);
    let (f0, l0, m0) = run(0.0);
    assert_eq!((m0, f0, l0), (0.0, first, first), "lr = 0 moved the weights");
}
