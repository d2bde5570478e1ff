//! Tiny random Llama, Llama-3.1-style (rope_scaling llama3) and Qwen2 models against hidden
//! states computed by Hugging Face transformers (fixtures/make_fixtures.py), and a padded batch
//! against one sequence at a time.

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use features::model::{Config, HfConfig, Model};
use std::path::PathBuf;

fn dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn load(name: &str, vb_files: Option<Vec<PathBuf>>) -> Result<Model, features::Error> {
    let d = dir(name);
    let hf: HfConfig = serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap();
    let cfg = Config::from_hf(&hf)?;
    let files = vb_files.unwrap_or_else(|| vec![d.join("model.safetensors")]);
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files, DType::F32, &Device::Cpu) }.unwrap();
    Model::load(vb, cfg, 128)
}

struct Case {
    ids: Vec<u32>,
    /// [layer][position][d]
    hidden: Vec<Vec<Vec<f32>>>,
}

fn cases(name: &str) -> Vec<Case> {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir(name).join("expected.json")).unwrap()).unwrap();
    v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            ids: serde_json::from_value(c["ids"].clone()).unwrap(),
            hidden: serde_json::from_value(c["hidden_states"].clone()).unwrap(),
        })
        .collect()
}

/// (cosine, max |a − b| / max |b|).
fn compare(a: &[f32], b: &[f32]) -> (f64, f64) {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
    let na: f64 = a.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    let md = a.iter().zip(b).map(|(x, y)| f64::from((x - y).abs())).fold(0.0, f64::max);
    let mb = b.iter().map(|y| f64::from(y.abs())).fold(0.0, f64::max);
    (dot / (na * nb), md / mb)
}

fn check_against_transformers(name: &str) {
    let model = load(name, None).unwrap();
    let layers = model.cfg.layers;
    for case in cases(name) {
        assert_eq!(case.hidden.len(), layers + 1);
        let ids = Tensor::new(case.ids.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        for (layer, want) in case.hidden.iter().enumerate() {
            let got: Vec<Vec<f32>> = model.hidden_states(&ids, layer).unwrap().squeeze(0).unwrap().to_vec2().unwrap();
            for (pos, (g, w)) in got.iter().zip(want).enumerate() {
                let (cos, rel) = compare(g, w);
                assert!(
                    cos > 0.9999 && rel < 1e-3,
                    "{name}: {} tokens, layer {layer}, position {pos}: cos {cos}, rel err {rel}",
                    case.ids.len()
                );
            }
        }
    }
}

#[test]
fn tiny_llama_matches_transformers() {
    check_against_transformers("tiny-llama");
}

#[test]
fn tiny_llama3_rope_scaling_matches_transformers() {
    check_against_transformers("tiny-llama3");
}

#[test]
fn tiny_qwen2_matches_transformers() {
    check_against_transformers("tiny-qwen2");
}

#[test]
fn a_padded_batch_gives_the_states_of_one_at_a_time() {
    for name in ["tiny-llama", "tiny-qwen2"] {
        let model = load(name, None).unwrap();
        let cs = cases(name);
        let t = cs.iter().map(|c| c.ids.len()).max().unwrap();
        let mut ids = Vec::new();
        for c in &cs {
            ids.extend_from_slice(&c.ids);
            ids.extend(std::iter::repeat_n(7u32, t - c.ids.len())); // any pad id
        }
        let batch = Tensor::from_vec(ids, (cs.len(), t), &Device::Cpu).unwrap();
        let h = model.hidden_states(&batch, model.cfg.layers).unwrap();
        let last: Vec<usize> = cs.iter().map(|c| c.ids.len() - 1).collect();
        let got: Vec<Vec<f32>> = features::model::gather_rows(&h, &last).unwrap().to_vec2().unwrap();
        for (c, g) in cs.iter().zip(&got) {
            let one = Tensor::new(c.ids.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
            let alone: Vec<Vec<f32>> =
                model.hidden_states(&one, model.cfg.layers).unwrap().squeeze(0).unwrap().to_vec2().unwrap();
            let want = alone.last().unwrap();
            let md = g.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(md < 1e-5, "{name}: {} tokens: padded vs alone differ by {md}", c.ids.len());
        }
    }
}

#[test]
fn a_missing_tensor_is_named() {
    // drop one tensor from the tiny Llama's weights
    let d = dir("tiny-llama");
    let bytes = std::fs::read(d.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let keep: Vec<(String, safetensors::tensor::TensorView<'_>)> =
        st.tensors().into_iter().filter(|(n, _)| n != "model.layers.1.mlp.down_proj.weight").collect();
    let tmp = tempfile::tempdir().unwrap();
    let f = tmp.path().join("model.safetensors");
    safetensors::serialize_to_file(keep, None, &f).unwrap();
    let e = load("tiny-llama", Some(vec![f])).err().expect("a missing tensor must fail");
    let msg = e.to_string();
    assert!(msg.contains("layer 1") && msg.contains("down_proj"), "{msg}");
}

#[test]
fn layer_indices_count_from_the_end_when_negative() {
    use features::model::resolve_layer;
    assert_eq!(resolve_layer(-1, 30).unwrap(), 30);
    assert_eq!(resolve_layer(-31, 30).unwrap(), 0);
    assert_eq!(resolve_layer(5, 30).unwrap(), 5);
    for bad in [31, -32] {
        assert!(resolve_layer(bad, 30).unwrap_err().to_string().contains("0..=30"));
    }
}
