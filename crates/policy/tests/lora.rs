//! LoRA on a tiny random decoder: the differentiable path gives the inference path's logits
//! (`features::model::Model`, itself checked against transformers), adapters on the side give
//! the logits of the merged weights, and backpropagation gives the gradients of central
//! differences (in f64).

use candle_core::{DType, Device, Tensor};
use features::model::{Config, Family, Model};
use policy::loss::{masked_sum, token_logprobs};
use policy::{LoraConfig, PolicyModel, Target};
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

fn cfg(family: Family, interleaved: bool) -> Config {
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
fn weights(c: &Config, seed: u64) -> HashMap<String, Tensor> {
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

fn inference_logits(t: &HashMap<String, Tensor>, c: &Config, ids: &Tensor) -> Vec<f32> {
    let vb = candle_nn::VarBuilder::from_tensors(t.clone(), DType::F32, &Device::Cpu);
    let m = Model::load_with(vb, c.clone(), 32, Some(true)).unwrap();
    m.logits(ids).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

fn ids() -> Tensor {
    Tensor::from_vec(vec![1u32, 5, 3, 9, 2, 7, 4, 4, 10, 0, 6, 8, 3, 1], (2, 7), &Device::Cpu).unwrap()
}

fn max_rel(a: &[f32], b: &[f32]) -> f64 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())) as f64;
    a.iter().zip(b).map(|(x, y)| ((x - y).abs() as f64) / scale).fold(0.0, f64::max)
}

/// Sets every adapter's B to random values (B starts at 0, which would hide an error).
fn randomize(m: &PolicyModel, seed: u64) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    for (_, ad) in m.adapters() {
        let t = ad.b.as_tensor();
        let v: Vec<f32> = (0..t.elem_count()).map(|_| rng.random_range(-0.3f32..0.3)).collect();
        ad.b.set(&Tensor::from_vec(v, t.shape(), t.device()).unwrap().to_dtype(t.dtype()).unwrap()).unwrap();
    }
}

#[test]
fn base_and_merged_logits_match_the_inference_path() {
    for (family, interleaved) in [(Family::Llama, false), (Family::Llama, true), (Family::Qwen2, false)] {
        let c = cfg(family, interleaved);
        let w = weights(&c, 3);
        let lora = LoraConfig { rank: 2, alpha: 4.0, targets: Target::ALL.to_vec(), seed: 1 };
        let m = PolicyModel::new(w.clone(), c.clone(), &lora, 32, DType::F32).unwrap();
        let got: Vec<f32> = m.forward(&ids()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let want = inference_logits(&w, &c, &ids());
        assert!(
            max_rel(&got, &want) < 1e-5,
            "{family:?} {interleaved}: B = 0 gives the base model: {}",
            max_rel(&got, &want)
        );
        // adapters on the side vs merged into the weights
        randomize(&m, 9);
        let side: Vec<f32> = m.forward(&ids()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let merged = inference_logits(&m.merged_weights().unwrap(), &c, &ids());
        assert!(max_rel(&side, &merged) < 1e-5, "{family:?}: side vs merged {}", max_rel(&side, &merged));
        // negative control: the adapters changed the logits
        assert!(max_rel(&side, &want) > 1e-3, "{family:?}: the adapters did nothing");
    }
}

/// ∂/∂θ of Σ log π over the masked tokens, by backpropagation and by central differences.
#[test]
fn adapter_gradients_equal_central_differences() {
    let c = cfg(Family::Llama, true);
    let w: HashMap<String, Tensor> =
        weights(&c, 4).into_iter().map(|(k, v)| (k, v.to_dtype(DType::F64).unwrap())).collect();
    let lora =
        LoraConfig { rank: 2, alpha: 3.0, targets: vec![Target::QProj, Target::VProj, Target::DownProj], seed: 2 };
    let m = PolicyModel::new(w, c, &lora, 32, DType::F64).unwrap();
    randomize(&m, 5);
    let ids = ids();
    let mask = Tensor::from_vec(vec![0f64, 0., 1., 1., 1., 0., 0., 0., 1., 1., 0., 1.], (2, 6), &Device::Cpu).unwrap();
    let loss = |m: &PolicyModel| -> Tensor {
        let lp = token_logprobs(&m.forward(&ids).unwrap(), &ids).unwrap();
        masked_sum(&lp, &mask).unwrap().sum_all().unwrap()
    };
    let grads = loss(&m).backward().unwrap();
    let mut checked = 0;
    for (vi, var) in m.vars().into_iter().enumerate() {
        let g: Vec<f64> = grads.get(var.as_tensor()).expect("a gradient").flatten_all().unwrap().to_vec1().unwrap();
        let base: Vec<f64> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        for k in [0, base.len() / 2, base.len() - 1] {
            let at = |d: f64| {
                let mut v = base.clone();
                v[k] += d;
                var.set(&Tensor::from_vec(v, var.as_tensor().shape(), &Device::Cpu).unwrap()).unwrap();
                loss(&m).to_scalar::<f64>().unwrap()
            };
            let h = 1e-5;
            let fd = (at(h) - at(-h)) / (2.0 * h);
            var.set(&Tensor::from_vec(base.clone(), var.as_tensor().shape(), &Device::Cpu).unwrap()).unwrap();
            assert!(
                (fd - g[k]).abs() <= 1e-6 * (1.0 + fd.abs()),
                "var {vi} [{k}]: backprop {} vs differences {fd}",
                g[k]
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 3 * 2 * 2 * 3, "every adapter's A and B checked");
}
