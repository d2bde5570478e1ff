//! A tiny random decoder (Hugging Face names) shared by the policy tests.
#![allow(dead_code)]

use candle_core::{DType, Device, Tensor};
use features::model::{Config, Family, Model};
use policy::PolicyModel;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

pub mod rm;
#[allow(unused_imports)]
pub use rm::*;

/// The device under test: `ONEPASS_TEST_DEVICE` = `cuda` (a build with `--features cuda` on a
/// machine with a GPU) or `cpu` (the default). Anything else, or a CUDA device that does not
/// open, fails the test: a device check never passes by quietly running on the CPU.
pub fn test_device() -> Device {
    match std::env::var("ONEPASS_TEST_DEVICE").as_deref() {
        Err(_) | Ok("") | Ok("cpu") => Device::Cpu,
        Ok("cuda") => Device::new_cuda(0).unwrap_or_else(|e| panic!("ONEPASS_TEST_DEVICE=cuda: {e}")),
        Ok(other) => panic!("ONEPASS_TEST_DEVICE={other}: expected cpu or cuda"),
    }
}

pub fn cfg(family: Family, interleaved: bool) -> Config {
    Config {
        family,
        hidden: 16,
        intermediate: 24,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 4,
        eps: 1e-5,
        rope_theta: 10_000.0,
        vocab: 11,
        qkv_bias: family == Family::Qwen2,
        o_bias: false,
        rope_interleaved: interleaved,
        rope_factors: None,
    }
}

/// Random weights with Hugging Face names (embeddings tied to the LM head).
pub fn weights(c: &Config, seed: u64) -> HashMap<String, Tensor> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut t = HashMap::new();
    let mut put = |name: String, shape: &[usize], scale: f32, base: f32| {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| base + scale * rng.random_range(-1.0f32..1.0)).collect();
        t.insert(name, Tensor::from_vec(v, shape, &Device::Cpu).unwrap());
    };
    let (h, hd) = (c.hidden, c.head_dim);
    put("model.embed_tokens.weight".into(), &[c.vocab, h], 0.5, 0.0);
    put("model.norm.weight".into(), &[h], 0.1, 1.0);
    for i in 0..c.layers {
        let p = format!("model.layers.{i}");
        put(format!("{p}.input_layernorm.weight"), &[h], 0.1, 1.0);
        put(format!("{p}.post_attention_layernorm.weight"), &[h], 0.1, 1.0);
        for (m, out, inp) in [
            ("self_attn.q_proj", c.heads * hd, h),
            ("self_attn.k_proj", c.kv_heads * hd, h),
            ("self_attn.v_proj", c.kv_heads * hd, h),
            ("self_attn.o_proj", h, c.heads * hd),
            ("mlp.gate_proj", c.intermediate, h),
            ("mlp.up_proj", c.intermediate, h),
            ("mlp.down_proj", h, c.intermediate),
        ] {
            put(format!("{p}.{m}.weight"), &[out, inp], 0.4, 0.0);
            if c.qkv_bias && ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"].contains(&m) {
                put(format!("{p}.{m}.bias"), &[out], 0.1, 0.0);
            }
        }
    }
    t
}

pub fn inference_logits(t: &HashMap<String, Tensor>, c: &Config, ids: &Tensor) -> Vec<f32> {
    let vb = candle_nn::VarBuilder::from_tensors(t.clone(), DType::F32, &Device::Cpu);
    let m = Model::load_with(vb, c.clone(), 32, Some(true)).unwrap();
    m.logits(ids).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

pub fn ids() -> Tensor {
    Tensor::from_vec(vec![1u32, 5, 3, 9, 2, 7, 4, 4, 10, 0, 6, 8, 3, 1], (2, 7), &Device::Cpu).unwrap()
}

pub fn max_rel(a: &[f32], b: &[f32]) -> f64 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())) as f64;
    a.iter().zip(b).map(|(x, y)| ((x - y).abs() as f64) / scale).fold(0.0, f64::max)
}

/// Sets every adapter's B to random values (B starts at 0, which would hide an error).
pub fn randomize(m: &PolicyModel, seed: u64) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    for (_, ad) in m.adapters() {
        let t = ad.b.as_tensor();
        let v: Vec<f32> = (0..t.elem_count()).map(|_| rng.random_range(-0.3f32..0.3)).collect();
        ad.b.set(&Tensor::from_vec(v, t.shape(), t.device()).unwrap().to_dtype(t.dtype()).unwrap()).unwrap();
    }
}

/// Log-probabilities of a batch and every adapter's gradient of a weighted sum of them (on the
/// CPU, as f64).
pub fn values_and_gradients(m: &PolicyModel, b: &policy::batch::SeqBatch) -> (Vec<f64>, Vec<Vec<f64>>) {
    let lp = m.logprobs_at(b, true).unwrap();
    let n = lp.dim(0).unwrap();
    // unequal weights: a sum of log-probabilities alone would hide errors that cancel
    let w: Vec<f64> = (0..n).map(|i| 1.0 + 0.37 * (i as f64).sin()).collect();
    let w = Tensor::from_vec(w, n, lp.device()).unwrap().to_dtype(lp.dtype()).unwrap();
    let grads = (&lp * &w).unwrap().sum_all().unwrap().backward().unwrap();
    let values: Vec<f64> = lp.to_dtype(DType::F64).unwrap().to_vec1().unwrap();
    let g = m
        .vars()
        .into_iter()
        .map(|v| {
            let g = grads.get(v.as_tensor()).expect("every adapter receives a gradient");
            g.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1().unwrap()
        })
        .collect();
    (values, g)
}

/// max |a − b| / max |b|.
pub fn rel(a: &[f64], b: &[f64]) -> f64 {
    let scale = b.iter().fold(0f64, |m, x| m.max(x.abs()));
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max) / scale
}

/// log π(ids[:, i+1] | ids[:, ..=i]) for i < t − 1: (b, t − 1), from logits (b, t, vocab) — the
/// plain composition (log-softmax, gather) the fused log-probability paths are checked against.
pub fn token_logprobs(logits: &Tensor, ids: &Tensor) -> candle_core::Result<Tensor> {
    let (b, t, _) = logits.dims3()?;
    let lp = candle_nn::ops::log_softmax(&logits.narrow(1, 0, t - 1)?, candle_core::D::Minus1)?;
    let next = ids.narrow(1, 1, t - 1)?.to_dtype(DType::U32)?.contiguous()?;
    lp.gather(&next.reshape((b, t - 1, 1))?, 2)?.squeeze(2)
}

/// Σ_t x[:, t]·mask[:, t]: (b,).
pub fn masked_sum(x: &Tensor, mask: &Tensor) -> candle_core::Result<Tensor> {
    (x * mask)?.sum(1)
}
