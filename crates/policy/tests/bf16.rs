//! Training with bf16 products (issue 31: `PolicyModel::use_bf16_products`): every frozen
//! weight's product forward and backward and the LM head's on the CPU's packed bf16 kernel, the
//! adapters in f32. On SmolLM2-135M batches every adapter's gradient has cosine ≥ 0.999 with the
//! f32 step's on a Cascade Lake (min 0.999297 since session 24's fused ops); on the AMX Xeon at
//! session 22's revision one tensor missed the 0.999 bar (0.99892, layer 0's k_proj A);
//! the policy at its reference has a KL of exactly 0 (the reference pass rounds as the policy
//! does); a merge, which would round the adapter into bf16 weights, is refused, and so are composed
//! kernels (a GPU's), an f64 and a full-parameter policy.

mod common;

use candle_core::{DType, Device, Tensor};
use common::*;
use features::model::Family;
use policy::batch::SeqBatch;
use policy::{LoraConfig, PolicyModel, Target};
use rand::{Rng, SeedableRng};

fn smollm2() -> std::path::PathBuf {
    let p = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(p.exists(), "{} is missing: run `just fetch-models` first", p.display());
    p
}

/// Every adapter's gradient of −Σ log π over the batch's responses (f32 on the CPU).
fn gradients(m: &PolicyModel, b: &SeqBatch) -> Vec<Vec<f64>> {
    let lp = m.logprobs_at(b, true).unwrap();
    let grads = lp.sum_all().unwrap().neg().unwrap().backward().unwrap();
    m.vars().iter().map(|v| flat64(&[grads.get(v.as_tensor()).expect("a gradient").clone()])).collect()
}

fn cosine(a: &[f64], b: &[f64]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let n = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    dot / (n(a) * n(b))
}

#[test]
fn smollm2_adapter_gradients_with_bf16_products_keep_the_f32_direction() {
    let g = features::gguf::Gguf::read_with(&smollm2(), &Device::Cpu, DType::F32, true).unwrap();
    let lora = LoraConfig { rank: 8, alpha: 16.0, targets: Target::ALL.to_vec(), seed: 3, dropout: 0.0 };
    let mut m = PolicyModel::new(g.tensors, g.cfg, &lora, 128, DType::F32).unwrap();
    // B ≠ 0 (a trained adapter), so both factors' gradients are checked
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
    for (_, ad) in m.adapters() {
        let t = ad.b.as_tensor();
        let v: Vec<f32> = (0..t.elem_count()).map(|_| rng.random_range(-0.01f32..0.01)).collect();
        ad.b.set(&Tensor::from_vec(v, t.shape(), &Device::Cpu).unwrap()).unwrap();
    }
    // real conversations (the features crate's templated HH-RLHF and UltraFeedback rows): the
    // last 32 tokens are the response
    let f: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../features/tests/fixtures/smollm2_conversations.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let convs: Vec<Vec<u32>> = f["conversations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| serde_json::from_value::<Vec<u32>>(c["ids"].clone()).unwrap())
        .filter(|ids| ids.len() >= 64 && ids.len() <= 128)
        .collect();
    let split = |ids: &Vec<u32>| (ids[..ids.len() - 32].to_vec(), ids[ids.len() - 32..].to_vec());
    let rows: Vec<(Vec<u32>, Vec<u32>)> = convs[..4].iter().map(split).collect();
    let other: Vec<(Vec<u32>, Vec<u32>)> = convs[4..8].iter().map(split).collect();
    let batch = |r: &[(Vec<u32>, Vec<u32>)]| {
        let s: Vec<(&[u32], &[u32])> = r.iter().map(|(p, q)| (p.as_slice(), q.as_slice())).collect();
        SeqBatch::new(&s, &Device::Cpu).unwrap()
    };
    let (b, b2) = (batch(&rows), batch(&other));
    let f32_grads = gradients(&m, &b);
    let f32_lp: Vec<f32> = m.logprobs_at(&b, true).unwrap().to_vec1().unwrap();
    m.use_bf16_products().unwrap();
    assert!(m.bf16_products());
    let bf_grads = gradients(&m, &b);
    let bf_lp: Vec<f32> = m.logprobs_at(&b, true).unwrap().to_vec1().unwrap();
    let worst = f32_grads.iter().zip(&bf_grads).map(|(a, b)| cosine(a, b)).fold(1f64, f64::min);
    let lp_diff = f32_lp.iter().zip(&bf_lp).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    let mean_lp = f32_lp.iter().map(|x| x.abs()).sum::<f32>() / f32_lp.len() as f32;
    let below = f32_grads.iter().zip(&bf_grads).filter(|(a, b)| cosine(a, b) < 0.999).count();
    // negative control: another batch's gradient (all adapters together) points elsewhere
    let all = |g: &[Vec<f64>]| -> Vec<f64> { g.iter().flatten().copied().collect() };
    let control = cosine(&all(&gradients(&m, &b2)), &all(&f32_grads));
    eprintln!(
        "bf16 products vs f32 on SmolLM2 (4 × 64 tokens, LoRA r 8 on every linear layer, {} adapter tensors): \
         min cosine {worst:.6} ({below} below 0.999), max |Δ log π| {lp_diff:.3} (mean |log π| {mean_lp:.2}); \
         another batch's gradient: cosine {control:.3}",
        f32_grads.len()
    );
    // measured 0.999297 on a Cascade Lake, 0.99892 on an AMX Xeon at an older revision (layer 0's
    // k_proj A: the backward's products round g to bf16 in every layer above it; the f32
    // reference's gemm blocking differs by CPU): a regression bound, not the bar
    assert!(worst >= 0.998, "an adapter's bf16 gradient has cosine {worst} with the f32 one");
    assert!(lp_diff > 0.0, "the bf16 products changed nothing: are they used?");
    assert!(control < 0.9, "negative control: another batch's gradients have cosine {control}");
}

#[test]
fn the_reference_rounds_as_the_policy_does_and_a_merge_is_refused() {
    let c = cfg(Family::Llama, true);
    let lora = LoraConfig { rank: 2, alpha: 4.0, targets: Target::ALL.to_vec(), seed: 2, dropout: 0.0 };
    let mut m = PolicyModel::new(weights(&c, 4), c.clone(), &lora, 32, DType::F32).unwrap();
    m.use_bf16_products().unwrap();
    let seqs: [(&[u32], &[u32]); 2] = [(&[1, 5, 3], &[9, 2, 4]), (&[4, 2], &[10, 0, 6, 8])];
    let b = SeqBatch::new(&seqs, &Device::Cpu).unwrap();
    let lp =
        |m: &PolicyModel, adapters: bool| -> Vec<f32> { m.logprobs_scored(&b, adapters).unwrap().to_vec1().unwrap() };
    // B = 0: the policy is its reference, bit for bit
    assert_eq!(lp(&m, true), lp(&m, false));
    randomize(&m, 7);
    let moved = lp(&m, true);
    assert_ne!(moved, lp(&m, false), "negative control: the adapters move the policy");
    // a merge would round the adapter into bf16 weights: refused, and the policy unchanged
    let base = lp(&m, false);
    let e = m.merge_and_reset(11).unwrap_err().to_string();
    assert!(e.contains("bf16") && e.contains("persistent"), "{e}");
    assert_eq!(lp(&m, true), moved);
    assert_eq!(lp(&m, false), base);
    // and the f32 model differs from the bf16 one (the products are really bf16)
    let plain = PolicyModel::new(weights(&c, 4), c, &lora, 32, DType::F32).unwrap();
    let f: Vec<f32> = plain.logprobs_scored(&b, false).unwrap().to_vec1().unwrap();
    assert_ne!(f, base, "bf16 products should round differently from f32");
}

#[test]
fn bf16_products_are_refused_where_they_do_not_apply() {
    let c = cfg(Family::Qwen2, false);
    let lora = LoraConfig { rank: 2, alpha: 4.0, targets: Target::ALL.to_vec(), seed: 2, dropout: 0.0 };
    let w64 = weights(&c, 1).into_iter().map(|(k, v)| (k, v.to_dtype(DType::F64).unwrap())).collect();
    let mut m = PolicyModel::new(w64, c.clone(), &lora, 32, DType::F64).unwrap();
    assert!(m.use_bf16_products().unwrap_err().to_string().contains("F64"));
    let mut full = PolicyModel::new_full(weights(&c, 1), c.clone(), 32, DType::F32).unwrap();
    assert!(full.use_bf16_products().unwrap_err().to_string().contains("full-parameter"));
    let mut composed = PolicyModel::new(weights(&c, 1), c, &lora, 32, DType::F32).unwrap();
    composed.set_kernels(policy::ops::Kernels::Composed).unwrap();
    assert!(composed.use_bf16_products().is_err());
}
