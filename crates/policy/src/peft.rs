//! Adapters in PEFT's layout, so `peft.PeftModel.from_pretrained(model, dir)` loads them on the
//! transformers model: `adapter_model.safetensors` with keys
//! `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` (r, in) and `…lora_B.weight`
//! (out, r), and `adapter_config.json` (peft_type LORA, r, lora_alpha, target_modules, …).
//!
//! llama.cpp stores a Llama's q and k rows permuted for interleaved RoPE; a model read from GGUF
//! trains its q/k adapters in that row order, so B's rows are put back in Hugging Face's order
//! on save (and permuted again on load).

use crate::lora::Target;
use crate::model::PolicyModel;
use candle_core::{Device, Tensor};
use std::path::Path;

const PREFIX: &str = "base_model.model.";

/// Row r of Hugging Face's q (or k) weight is row `gguf_row(r)` of llama.cpp's: within each
/// head, HF row p·(hd/2) + i is llama.cpp's row 2i + p.
fn gguf_row(r: usize, head_dim: usize) -> usize {
    let (head, within) = (r / head_dim, r % head_dim);
    let half = head_dim / 2;
    let (p, i) = (within / half, within % half);
    head * head_dim + 2 * i + p
}

/// Rows in Hugging Face's order (`to_hf`) or back in llama.cpp's.
fn permute_rows(t: &Tensor, head_dim: usize, to_hf: bool) -> candle_core::Result<Tensor> {
    let n = t.dim(0)?;
    let mut idx = vec![0u32; n];
    for r in 0..n {
        let g = gguf_row(r, head_dim);
        // HF row r is llama.cpp row g: gather g for r, or r for g
        if to_hf {
            idx[r] = g as u32;
        } else {
            idx[g] = r as u32;
        }
    }
    t.index_select(&Tensor::from_vec(idx, n, t.device())?, 0)
}

fn needs_permute(m: &PolicyModel, name: &str) -> bool {
    m.config().rope_interleaved && (name.ends_with(Target::QProj.path()) || name.ends_with(Target::KProj.path()))
}

/// The two files of PEFT's layout as bytes: `adapter_model.safetensors` and
/// `adapter_config.json` (B's q/k rows in Hugging Face's order).
/// A full-parameter policy has no adapter: an error.
pub fn encode(m: &PolicyModel, base_model: &str) -> std::result::Result<(Vec<u8>, String), features::Error> {
    encode_with(m, base_model, None)
}

/// A reward model r = θᵀh_ψ (issue 30) in PEFT's layout for transformers'
/// `*ForSequenceClassification` with `num_labels = 1`: ψ's adapters as [`encode`] writes them,
/// and θ as the classification head `score` (`base_model.model.score.weight`, (1, d); PEFT's
/// `modules_to_save`), task_type SEQ_CLS. transformers scores a sequence at its last
/// non-padding token with the final-norm state: θᵀh.
pub fn encode_reward(
    rm: &crate::rm::model::RewardModel,
    base_model: &str,
) -> std::result::Result<(Vec<u8>, String), features::Error> {
    let d = rm.head.as_tensor().elem_count();
    let score = rm.head.as_tensor().to_device(&Device::Cpu)?.to_dtype(candle_core::DType::F32)?.reshape((1, d))?;
    encode_with(&rm.model, base_model, Some(score))
}

/// Writes a reward model's `dir/adapter_model.safetensors` and `dir/adapter_config.json`
/// ([`encode_reward`]).
pub fn save_reward(
    rm: &crate::rm::model::RewardModel,
    dir: &Path,
    base_model: &str,
) -> std::result::Result<(), features::Error> {
    let io = |e: std::io::Error| features::Error::Io(format!("{}: {e}", dir.display()));
    std::fs::create_dir_all(dir).map_err(io)?;
    let (st, cfg) = encode_reward(rm, base_model)?;
    std::fs::write(dir.join("adapter_model.safetensors"), st).map_err(io)?;
    std::fs::write(dir.join("adapter_config.json"), cfg).map_err(io)
}

/// Reads a reward model saved by [`save_reward`] (or by PEFT for a sequence classifier with one
/// label) into `rm`: the adapters, then θ from `score.weight`.
pub fn load_reward(rm: &crate::rm::model::RewardModel, dir: &Path) -> std::result::Result<(), features::Error> {
    load(&rm.model, dir)?;
    let st = dir.join("adapter_model.safetensors");
    let t = candle_core::safetensors::load(&st, rm.model.device())
        .map_err(|e| features::Error::Weights(format!("{}: {e}", st.display())))?;
    let key = format!("{PREFIX}score.weight");
    let x = t.get(&key).ok_or_else(|| features::Error::Weights(format!("{}: no `{key}`", st.display())))?;
    let d = rm.head.as_tensor().elem_count();
    if x.dims() != [1, d] {
        return Err(features::Error::Weights(format!(
            "{}: `{key}` has shape {:?}, expected [1, {d}] (one label)",
            st.display(),
            x.dims()
        )));
    }
    rm.head.set(&x.reshape(d)?.to_dtype(rm.head.dtype())?)?;
    Ok(())
}

fn encode_with(
    m: &PolicyModel,
    base_model: &str,
    score: Option<Tensor>,
) -> std::result::Result<(Vec<u8>, String), features::Error> {
    if m.is_full() {
        return Err(features::Error::Input(
            "a full-parameter policy has no LoRA adapter to save in PEFT's layout".into(),
        ));
    }
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    for (name, ad) in m.adapters() {
        let mut b = ad.b.as_tensor().to_device(&Device::Cpu)?;
        if needs_permute(m, &name) {
            b = permute_rows(&b, m.config().head_dim, true)?;
        }
        tensors.push((format!("{PREFIX}{name}.lora_A.weight"), ad.a.as_tensor().to_device(&Device::Cpu)?));
        tensors.push((format!("{PREFIX}{name}.lora_B.weight"), b));
    }
    let task = if score.is_some() { "SEQ_CLS" } else { "CAUSAL_LM" };
    let modules_to_save = score.as_ref().map(|_| vec!["score"]);
    if let Some(s) = score {
        tensors.push((format!("{PREFIX}score.weight"), s));
    }
    tensors.sort_by(|x, y| x.0.cmp(&y.0));
    let st = safetensors::serialize(tensors, None).map_err(|e| features::Error::Format(format!("safetensors: {e}")))?;
    let l = m.lora();
    let mut targets: Vec<&str> = l.targets.iter().map(|t| t.name()).collect();
    targets.sort();
    let cfg = serde_json::json!({
        "peft_type": "LORA",
        "task_type": task,
        "base_model_name_or_path": base_model,
        "r": l.rank,
        "lora_alpha": l.alpha,
        "lora_dropout": l.dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "use_rslora": false,
        "use_dora": false,
        "modules_to_save": modules_to_save,
        "layers_to_transform": null,
        "revision": null,
    });
    Ok((st, serde_json::to_string_pretty(&cfg).expect("plain JSON")))
}

/// Writes `dir/adapter_model.safetensors` and `dir/adapter_config.json`.
pub fn save(m: &PolicyModel, dir: &Path, base_model: &str) -> std::result::Result<(), features::Error> {
    let io = |e: std::io::Error| features::Error::Io(format!("{}: {e}", dir.display()));
    std::fs::create_dir_all(dir).map_err(io)?;
    let (st, cfg) = encode(m, base_model)?;
    std::fs::write(dir.join("adapter_model.safetensors"), st).map_err(io)?;
    std::fs::write(dir.join("adapter_config.json"), cfg).map_err(io)
}

/// Reads adapters saved by [`save`] (or by PEFT) into `m`'s variables; every adapter of `m`
/// must be present with its shape.
pub fn load(m: &PolicyModel, dir: &Path) -> std::result::Result<(), features::Error> {
    let st = dir.join("adapter_model.safetensors");
    let t = candle_core::safetensors::load(&st, m.device())
        .map_err(|e| features::Error::Weights(format!("{}: {e}", st.display())))?;
    for (name, ad) in m.adapters() {
        for (which, var) in [("lora_A", &ad.a), ("lora_B", &ad.b)] {
            let key = format!("{PREFIX}{name}.{which}.weight");
            let mut x =
                t.get(&key).ok_or_else(|| features::Error::Weights(format!("{}: no `{key}`", st.display())))?.clone();
            if which == "lora_B" && needs_permute(m, &name) {
                x = permute_rows(&x, m.config().head_dim, false)?;
            }
            if x.dims() != var.as_tensor().dims() {
                return Err(features::Error::Weights(format!(
                    "{}: `{key}` has shape {:?}, expected {:?}",
                    st.display(),
                    x.dims(),
                    var.as_tensor().dims()
                )));
            }
            var.set(&x.to_dtype(candle_core::DType::F32)?)?;
        }
    }
    Ok(())
}
