//! A LoRA adapter written by PEFT (`save_pretrained`, fixtures/make_peft_fixture.py) on the tiny
//! random Llama of the features fixtures: onepass reads it into its own adapters and gives the
//! logits transformers + peft gave (max relative error < 1e-4); without it, the base logits
//! (and not the adapted ones: a negative control). Then onepass saves it again and reads its
//! own file back to the same logits.

use candle_core::{DType, Device, Tensor};
use features::model::{Config, HfConfig};
use policy::{LoraConfig, PolicyModel, Target};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/peft-tiny-llama")
}

fn model() -> PolicyModel {
    let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../features/tests/fixtures/tiny-llama");
    let hf: HfConfig = serde_json::from_str(&std::fs::read_to_string(base.join("config.json")).unwrap()).unwrap();
    let cfg = Config::from_hf(&hf).unwrap();
    let t: HashMap<String, Tensor> =
        candle_core::safetensors::load(base.join("model.safetensors"), &Device::Cpu).unwrap();
    let lora = LoraConfig { rank: 2, alpha: 4.0, targets: Target::ALL.to_vec(), seed: 0, dropout: 0.0 };
    PolicyModel::new(t, cfg, &lora, 32, DType::F32).unwrap()
}

fn max_rel(a: &[f32], b: &[f32]) -> f64 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())) as f64;
    a.iter().zip(b).map(|(x, y)| ((x - y).abs() as f64) / scale).fold(0.0, f64::max)
}

fn logits(m: &PolicyModel, ids: &[u32]) -> Vec<f32> {
    let x = Tensor::from_vec(ids.to_vec(), (1, ids.len()), &Device::Cpu).unwrap();
    m.forward(&x).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

#[test]
fn a_peft_adapter_gives_the_logits_of_transformers_and_peft() {
    let exp: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("expected.json")).unwrap()).unwrap();
    let m = model();
    let cases = exp["cases"].as_array().unwrap();
    let flat = |v: &serde_json::Value| -> Vec<f32> {
        v.as_array()
            .unwrap()
            .iter()
            .flat_map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32))
            .collect()
    };
    let ids = |c: &serde_json::Value| -> Vec<u32> {
        c["ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
    };
    // before loading: B = 0, the base model
    for c in cases {
        let got = logits(&m, &ids(c));
        assert!(max_rel(&got, &flat(&c["base_logits"])) < 1e-4, "base: {}", max_rel(&got, &flat(&c["base_logits"])));
        assert!(max_rel(&got, &flat(&c["logits"])) > 1e-3, "negative control: the adapter changes the logits");
    }
    policy::peft::load(&m, &fixtures()).unwrap();
    for c in cases {
        let got = logits(&m, &ids(c));
        let want = flat(&c["logits"]);
        assert!(max_rel(&got, &want) < 1e-4, "adapted: max rel {}", max_rel(&got, &want));
    }
    // onepass's own save of it reads back to the same logits
    let tmp = tempfile::tempdir().unwrap();
    policy::peft::save(&m, tmp.path(), "tiny-llama").unwrap();
    let again = model();
    policy::peft::load(&again, tmp.path()).unwrap();
    for c in cases {
        assert_eq!(logits(&again, &ids(c)), logits(&m, &ids(c)));
    }
}
