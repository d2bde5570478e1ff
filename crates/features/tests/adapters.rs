//! LoRA adapters applied unmerged (`Model::with_adapters`: y = x Wᵀ + s·(x Aᵀ) Bᵀ beside the
//! weights): in f32 they give the merged model's logits (W + s·BA) up to f32 rounding; in bf16
//! they follow the f32 update within bf16's rounding of the activations; decoding with the KV cache follows the adapted model's own full
//! pass; zero B gives the base model's bits; and adapters that name no layer, or do not fit it,
//! are errors.

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use features::model::{Adapters, Config, HfConfig, LowRank, Model};
use std::collections::HashMap;
use std::path::PathBuf;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-llama")
}

fn config() -> (Config, bool) {
    let hf: HfConfig = serde_json::from_str(&std::fs::read_to_string(dir().join("config.json")).unwrap()).unwrap();
    (Config::from_hf(&hf).unwrap(), hf.tie_word_embeddings)
}

fn weights() -> HashMap<String, Tensor> {
    candle_core::safetensors::load(dir().join("model.safetensors"), &Device::Cpu)
        .unwrap()
        .into_iter()
        .map(|(k, v)| (k, v.to_dtype(DType::F32).unwrap()))
        .collect()
}

fn model(w: &HashMap<String, Tensor>, dtype: DType) -> Model {
    let (cfg, tied) = config();
    Model::load_with(VarBuilder::from_tensors(w.clone(), dtype, &Device::Cpu), cfg, 64, Some(tied)).unwrap()
}

const TARGETS: [&str; 7] = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
];

/// Rank-4 adapters on every layer, A and B drawn with a fixed seed (B zero with `zero_b`).
fn adapters(w: &HashMap<String, Tensor>, scale: f64, zero_b: bool) -> Adapters {
    let (cfg, _) = config();
    let mut out = Adapters::new();
    let mut i = 0u64;
    for l in 0..cfg.layers {
        for t in TARGETS {
            let name = format!("model.layers.{l}.{t}");
            let (o, k) = w[&format!("{name}.weight")].dims2().unwrap();
            i += 1;
            let draw = |n: usize, m: usize, s: u64| {
                let v: Vec<f32> = (0..n * m)
                    .map(|j| (((j as u64 * 2654435761 + s * 97) % 1000) as f32 / 500.0 - 1.0) * 0.3)
                    .collect();
                Tensor::from_vec(v, (n, m), &Device::Cpu).unwrap()
            };
            let b =
                if zero_b { Tensor::zeros((o, 4), DType::F32, &Device::Cpu).unwrap() } else { draw(o, 4, 2 * i + 1) };
            out.insert(name, LowRank { a: draw(4, k, 2 * i), b, scale });
        }
    }
    out
}

/// W + s·BA for every adapted layer, in f32.
fn merged(w: &HashMap<String, Tensor>, ad: &Adapters) -> HashMap<String, Tensor> {
    let mut m = w.clone();
    for (name, l) in ad {
        let key = format!("{name}.weight");
        m.insert(key.clone(), (&w[&key] + (l.b.matmul(&l.a).unwrap() * l.scale).unwrap()).unwrap());
    }
    m
}

fn ids() -> Tensor {
    let v: Vec<u32> = (0..2 * 20u32).map(|i| (i * 37 + 5) % 128).collect();
    Tensor::from_vec(v, (2, 20), &Device::Cpu).unwrap()
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

fn sub(a: &[f32], b: &[f32]) -> Vec<f32> {
    a.iter().zip(b).map(|(x, y)| x - y).collect()
}

fn norm(a: &[f32]) -> f64 {
    a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt()
}

/// ‖a − b‖ / ‖b‖.
fn rel(a: &[f32], b: &[f32]) -> f64 {
    norm(&sub(a, b)) / norm(b)
}

#[test]
fn unmerged_f32_adapters_give_the_merged_models_logits() {
    let w = weights();
    let ad = adapters(&w, 2.0, false);
    let want = flat(&model(&merged(&w, &ad), DType::F32).logits(&ids()).unwrap());
    let base = model(&w, DType::F32);
    let got = flat(&base.with_adapters(&ad).unwrap().logits(&ids()).unwrap());
    let err = rel(&got, &want);
    assert!(err < 1e-5, "adapted vs merged: relative error {err}");
    // negative control: the update is large enough that the base is far from the merged model
    let off = rel(&flat(&base.logits(&ids()).unwrap()), &want);
    assert!(off > 1e-2, "the adapters barely move the logits ({off}): the test could not fail");
}

/// In bf16 the adapted model tracks the f32 update of the logits within bf16's rounding of
/// the activations (which re-round differently once the branch moves them: at this model's
/// size that noise is about 1 % of an update of this size). That the branch, unlike a bf16
/// merge, keeps an update below half an ulp of W is the layer-level test in `model::linear`.
#[test]
fn unmerged_bf16_adapters_follow_the_f32_update() {
    let w = weights();
    let ad = adapters(&w, 0.1, false);
    let f32_delta = sub(
        &flat(&model(&merged(&w, &ad), DType::F32).logits(&ids()).unwrap()),
        &flat(&model(&w, DType::F32).logits(&ids()).unwrap()),
    );
    let base16 = model(&w, DType::BF16);
    let base16_logits = flat(&base16.logits(&ids()).unwrap());
    let adapted_delta = sub(&flat(&base16.with_adapters(&ad).unwrap().logits(&ids()).unwrap()), &base16_logits);
    let kept = rel(&adapted_delta, &f32_delta);
    // a model that ignored its adapters would be at 1
    assert!(kept < 0.05, "the bf16 adapted model moves {kept} (relative) off the f32 update");
}

#[test]
fn adapted_decoding_follows_the_adapted_full_pass() {
    let w = weights();
    let ad = adapters(&w, 2.0, false);
    for dtype in [DType::F32, DType::BF16] {
        let m = model(&w, dtype).with_adapters(&ad).unwrap();
        let seq: Vec<u32> = (0..16u32).map(|i| (i * 29 + 3) % 128).collect();
        let full = m.logits(&Tensor::new(seq.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap()).unwrap();
        let full = full.squeeze(0).unwrap().to_vec2::<f32>().unwrap();
        let mut cache = m.new_cache(vec![0], seq.len()).unwrap();
        m.forward_cached(&Tensor::new(&seq[..4], &Device::Cpu).unwrap().unsqueeze(0).unwrap(), &mut cache).unwrap();
        for p in 4..seq.len() {
            let t = Tensor::new(&seq[p..p + 1], &Device::Cpu).unwrap().unsqueeze(0).unwrap();
            let l: Vec<f32> = m.forward_cached(&t, &mut cache).unwrap().squeeze(0).unwrap().to_vec1().unwrap();
            let err = rel(&l, &full[p]);
            assert!(err < 1e-3, "{dtype:?}, position {p}: decoded vs full-pass logits {err}");
        }
    }
}

#[test]
fn zero_b_adapters_give_the_base_bits_and_bad_adapters_are_errors() {
    let w = weights();
    let zero = adapters(&w, 2.0, true);
    for dtype in [DType::F32, DType::BF16] {
        let base = model(&w, dtype);
        let adapted = base.with_adapters(&zero).unwrap();
        let bits = |t: Tensor| flat(&t).iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(adapted.logits(&ids()).unwrap()), bits(base.logits(&ids()).unwrap()), "{dtype:?}");
        let step = |m: &Model| {
            let mut c = m.new_cache(vec![0, 3], 12).unwrap();
            let first = m.forward_cached(&ids().narrow(1, 0, 8).unwrap(), &mut c).unwrap();
            let next = m.forward_cached(&ids().narrow(1, 8, 1).unwrap(), &mut c).unwrap();
            (bits(first), bits(next))
        };
        assert_eq!(step(&adapted), step(&base), "{dtype:?}: cached decoding");
        // the branch is taken: a non-zero B changes the bits
        assert_ne!(step(&base.with_adapters(&adapters(&w, 2.0, false)).unwrap()), step(&base), "{dtype:?}");
    }
    let base = model(&w, DType::BF16);
    let mut bad = zero.clone();
    let l = bad["model.layers.0.self_attn.q_proj"].clone();
    bad.insert("model.layers.9.self_attn.q_proj".into(), l.clone());
    let e = base.with_adapters(&bad).err().expect("an adapter of a layer the model lacks").to_string();
    assert!(e.contains("model.layers.9.self_attn.q_proj"), "{e}");
    let mut bad = zero.clone();
    bad.insert("model.layers.1.mlp.down_proj".into(), l);
    let e = base.with_adapters(&bad).err().expect("an adapter of the wrong shape").to_string();
    assert!(e.contains("model.layers.1.mlp.down_proj") && e.contains("expected"), "{e}");
}
