//! Building a [`PolicyModel`] from a checkpoint's tensors: the adapters' model
//! ([`PolicyModel::new`]), the full-parameter one ([`PolicyModel::new_full`]), and the RoPE
//! tables.

use super::{no_adapters, Block, Full, PolicyModel};
use crate::lora::{init_rng, Adapter, Linear, LoraConfig, Reference, Target};
use crate::ops::Kernels;
use candle_core::{DType, Device, Result, Tensor, Var};
use features::model::Config;
use std::collections::HashMap;

/// The Hugging Face names of the weights the decoder of `cfg` reads (the LM head only when
/// `tensors` has its own), in name order.
fn weight_names(cfg: &Config, tensors: &HashMap<String, Tensor>) -> Vec<String> {
    let mut out = vec!["model.embed_tokens.weight".to_string(), "model.norm.weight".to_string()];
    if tensors.contains_key("lm_head.weight") {
        out.push("lm_head.weight".into());
    }
    for i in 0..cfg.layers {
        let p = format!("model.layers.{i}");
        out.push(format!("{p}.input_layernorm.weight"));
        out.push(format!("{p}.post_attention_layernorm.weight"));
        for t in Target::ALL {
            out.push(format!("{p}.{}.weight", t.path()));
            let bias = match t {
                Target::QProj | Target::KProj | Target::VProj => cfg.qkv_bias,
                Target::OProj => cfg.o_bias,
                _ => false,
            };
            if bias {
                out.push(format!("{p}.{}.bias", t.path()));
            }
        }
    }
    out.sort();
    out
}

fn get_as(t: &HashMap<String, Tensor>, name: &str, dtype: DType) -> std::result::Result<Tensor, features::Error> {
    t.get(name)
        .cloned()
        .ok_or_else(|| features::Error::Weights(format!("`{name}` is missing")))?
        .to_dtype(dtype)
        .map_err(features::Error::from)
}

impl PolicyModel {
    /// The model over `tensors` (Hugging Face names, e.g. from `features::gguf::Gguf`), with
    /// fresh adapters on `lora.targets` of every block; positions up to `max_len`; computing in
    /// `dtype` (f32; f64 for exact gradient checks).
    pub fn new(
        tensors: HashMap<String, Tensor>,
        cfg: Config,
        lora: &LoraConfig,
        max_len: usize,
        dtype: DType,
    ) -> std::result::Result<PolicyModel, features::Error> {
        cfg.check()?;
        if lora.rank == 0 {
            return Err(features::Error::Input("LoRA rank 0: expected at least 1".into()));
        }
        let embed = get_as(&tensors, "model.embed_tokens.weight", dtype)?;
        let device = embed.device().clone();
        let lm_head = match tensors.get("lm_head.weight") {
            Some(_) => get_as(&tensors, "lm_head.weight", dtype)?,
            None => embed.clone(),
        };
        let mut rng = init_rng(lora.seed);
        let mut blocks = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers {
            let p = format!("model.layers.{i}");
            let mut lin = |t: Target, bias: bool| -> std::result::Result<Linear, features::Error> {
                let w = get_as(&tensors, &format!("{p}.{}.weight", t.path()), dtype)?;
                let bias = if bias { Some(get_as(&tensors, &format!("{p}.{}.bias", t.path()), dtype)?) } else { None };
                let adapter = if lora.targets.contains(&t) {
                    let (out, inp) = w.dims2()?;
                    Some(Adapter::new(inp, out, lora.rank, lora.scale(), &mut rng, &device, dtype)?)
                } else {
                    None
                };
                Ok(Linear { w, bias, adapter, reference: Reference::Frozen, packed: None, packed_reference: None })
            };
            blocks.push(Block {
                q: lin(Target::QProj, cfg.qkv_bias)?,
                k: lin(Target::KProj, cfg.qkv_bias)?,
                v: lin(Target::VProj, cfg.qkv_bias)?,
                o: lin(Target::OProj, cfg.o_bias)?,
                gate: lin(Target::GateProj, false)?,
                up: lin(Target::UpProj, false)?,
                down: lin(Target::DownProj, false)?,
                norm1: get_as(&tensors, &format!("{p}.input_layernorm.weight"), dtype)?,
                norm2: get_as(&tensors, &format!("{p}.post_attention_layernorm.weight"), dtype)?,
            });
        }
        let norm = get_as(&tensors, "model.norm.weight", dtype)?;
        let (cos, sin) = rope_tables(&cfg, max_len.max(1), &device)?;
        let (cos, sin) = (cos.to_dtype(dtype)?, sin.to_dtype(dtype)?);
        let kernels = Kernels::for_device(&device);
        Ok(PolicyModel {
            cfg,
            lora: lora.clone(),
            base: tensors,
            embed,
            lm_head,
            lm_head_packed: None,
            blocks,
            norm,
            cos,
            sin,
            device,
            kernels,
            fuse_sublayers: true,
            life: Vec::new(),
            history: None,
            full: None,
        })
    }

    /// A policy that trains every weight (full-parameter; issue 29's DPO as the authors ran
    /// it): the embeddings, every linear layer's weight and bias, the RMSNorm weights and the
    /// LM head (tied to the embeddings when `tensors` has no `lm_head.weight`) become variables
    /// — copies of `tensors`, which stay as the reference policy. No adapters; training holds
    /// the weights, their gradients and Adam's two moments (4 copies of the model) besides the
    /// reference: for tiny models on the CPU.
    pub fn new_full(
        tensors: HashMap<String, Tensor>,
        cfg: Config,
        max_len: usize,
        dtype: DType,
    ) -> std::result::Result<PolicyModel, features::Error> {
        let reference = PolicyModel::new(tensors.clone(), cfg.clone(), &no_adapters(), max_len, dtype)?;
        let mut vars = Vec::new();
        let mut trainable = tensors.clone();
        for name in weight_names(&cfg, &tensors) {
            // a copy in the compute dtype (Var::from_tensor copies a tensor that is no variable)
            let v = Var::from_tensor(&get_as(&tensors, &name, dtype)?)?;
            trainable.insert(name.clone(), v.as_tensor().clone());
            vars.push((name, v));
        }
        let mut m = PolicyModel::new(trainable, cfg, &no_adapters(), max_len, dtype)?;
        m.base = tensors;
        m.full = Some(Full { vars, reference: Box::new(reference) });
        Ok(m)
    }
}

/// cos and sin of position × inverse frequency: (max_len, head_dim / 2).
fn rope_tables(cfg: &Config, max_len: usize, dev: &Device) -> Result<(Tensor, Tensor)> {
    let half = cfg.head_dim / 2;
    let mut cos = Vec::with_capacity(max_len * half);
    let mut sin = Vec::with_capacity(max_len * half);
    for p in 0..max_len {
        for i in 0..half {
            let f = 1.0 / cfg.rope_theta.powf(2.0 * i as f64 / cfg.head_dim as f64);
            let f = f / cfg.rope_factors.as_ref().map_or(1.0, |v| v[i]);
            // the angle in f32, as the inference path computes it
            let a = (p as f32) * (f as f32);
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }
    Ok((Tensor::from_vec(cos, (max_len, half), dev)?, Tensor::from_vec(sin, (max_len, half), dev)?))
}
