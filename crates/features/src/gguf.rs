//! GGUF files of the llama and qwen2 architectures: the config from `{arch}.*` metadata, every
//! weight dequantized to a dense tensor at load and renamed to Hugging Face's names, and the
//! tokenizer and chat-template metadata.
//!
//! Why dequantize: candle 0.11's Q4_1 dot product has no SIMD path on CPU (17× slower than f32
//! here) and its 8-bit activation quantization moves φ by ~3% and makes φ depend on which rows
//! share a batch (see `shared/docs/candle-notes.md`). Dense weights match transformers to 1e-5.

use crate::model::{Config, Family};
use crate::Error;
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::path::Path;

/// A parsed GGUF file: metadata, the model config and the dense weights under HF names.
pub struct Gguf {
    pub metadata: HashMap<String, Value>,
    pub cfg: Config,
    pub tensors: HashMap<String, Tensor>,
}

fn hf_name(name: &str) -> Option<String> {
    let map = |s: &str| -> Option<&'static str> {
        Some(match s {
            "attn_norm" => "input_layernorm",
            "ffn_norm" => "post_attention_layernorm",
            "attn_q" => "self_attn.q_proj",
            "attn_k" => "self_attn.k_proj",
            "attn_v" => "self_attn.v_proj",
            "attn_output" => "self_attn.o_proj",
            "ffn_gate" => "mlp.gate_proj",
            "ffn_up" => "mlp.up_proj",
            "ffn_down" => "mlp.down_proj",
            _ => return None,
        })
    };
    match name {
        "token_embd.weight" => return Some("model.embed_tokens.weight".into()),
        "output_norm.weight" => return Some("model.norm.weight".into()),
        _ => {}
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (part, kind) = rest.rsplit_once('.')?;
    Some(format!("model.layers.{layer}.{}.{kind}", map(part)?))
}

/// A metadata value as a string.
pub fn meta_str<'a>(md: &'a HashMap<String, Value>, key: &str) -> Option<&'a str> {
    md.get(key).and_then(|v| v.to_string().ok()).map(|s| s.as_str())
}

fn meta_u(md: &HashMap<String, Value>, key: &str, file: &Path) -> Result<usize, Error> {
    let v = md.get(key).ok_or_else(|| Error::Format(format!("{}: metadata `{key}` is missing", file.display())))?;
    v.to_u64()
        .or_else(|_| v.to_u32().map(u64::from))
        .or_else(|_| v.to_i32().map(|x| x as u64))
        .map(|x| x as usize)
        .map_err(|e| Error::Format(format!("{}: metadata `{key}`: {e}", file.display())))
}

fn meta_f(md: &HashMap<String, Value>, key: &str) -> Option<f64> {
    md.get(key).and_then(|v| v.to_f32().map(f64::from).or_else(|_| v.to_f64()).ok())
}

/// A tensor's element count and byte range, checked (no overflow, inside the file) before
/// candle reads it: a corrupt table could otherwise overflow candle's size arithmetic or ask
/// for more memory than the file holds (found by `just fuzz gguf`).
fn check_tensor_extent(content: &Content, name: &str, file_len: u64, path: &Path) -> Result<(), Error> {
    let info = &content.tensor_infos[name];
    let bad = |what: String| Error::Format(format!("{}: tensor `{name}`: {what}", path.display()));
    let dims = info.shape.dims();
    let elems = dims
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d as u64))
        .ok_or_else(|| bad(format!("shape {dims:?} overflows")))?;
    let (block, size) = (info.ggml_dtype.block_size() as u64, info.ggml_dtype.type_size() as u64);
    if elems % block != 0 {
        return Err(bad(format!("{elems} elements are not a multiple of the block size {block}")));
    }
    let end = (elems / block)
        .checked_mul(size)
        .and_then(|b| b.checked_add(info.offset))
        .and_then(|b| b.checked_add(content.tensor_data_offset));
    match end {
        Some(e) if e <= file_len => Ok(()),
        _ => Err(bad(format!(
            "shape {dims:?} at offset {} runs past the end of the file ({file_len} bytes): truncated or corrupt",
            info.offset
        ))),
    }
}

impl Gguf {
    /// Reads `path`, dequantizing every weight to `dtype` on `device` (not the LM head).
    pub fn read(path: &Path, device: &Device, dtype: DType) -> Result<Gguf, Error> {
        Gguf::read_with(path, device, dtype, false)
    }

    /// As [`Gguf::read`]; with `lm_head`, `output.weight` too (as `lm_head.weight`), when the
    /// file has one (llama.cpp omits it when the head is tied to the embeddings).
    pub fn read_with(path: &Path, device: &Device, dtype: DType, lm_head: bool) -> Result<Gguf, Error> {
        let f = File::open(path).map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
        let mut r = BufReader::new(f);
        let content = Content::read(&mut r)
            .map_err(|e| Error::Format(format!("{}: not a readable GGUF file: {e}", path.display())))?;
        let md = &content.metadata;
        let arch = meta_str(md, "general.architecture")
            .ok_or_else(|| Error::Format(format!("{}: metadata `general.architecture` is missing", path.display())))?
            .to_string();
        let family = match arch.as_str() {
            "llama" => Family::Llama,
            "qwen2" => Family::Qwen2,
            other => {
                return Err(Error::Unsupported(format!(
                    "{}: architecture `{other}`: expected llama or qwen2",
                    path.display()
                )))
            }
        };
        let k = |s: &str| format!("{arch}.{s}");
        let hidden = meta_u(md, &k("embedding_length"), path)?;
        let heads = meta_u(md, &k("attention.head_count"), path)?;
        let kv_heads = meta_u(md, &k("attention.head_count_kv"), path).unwrap_or(heads);
        let head_dim = meta_u(md, &k("rope.dimension_count"), path).unwrap_or(hidden / heads);
        let embd = content
            .tensor_infos
            .get("token_embd.weight")
            .ok_or_else(|| Error::Weights(format!("{}: tensor `token_embd.weight` is missing", path.display())))?;
        let vocab = embd.shape.dims()[0];
        let mut tensors = HashMap::new();
        let mut rope_factors = None;
        let file_len = std::fs::metadata(path).map_err(|e| Error::Io(format!("{}: {e}", path.display())))?.len();
        let mut names: Vec<&String> = content.tensor_infos.keys().collect();
        names.sort();
        for name in names {
            let hf =
                if lm_head && name == "output.weight" { Some("lm_head.weight".to_string()) } else { hf_name(name) };
            if hf.is_none() && name != "rope_freqs.weight" {
                continue; // output.weight (the LM head) is not needed for hidden states
            }
            check_tensor_extent(&content, name, file_len, path)?;
            let q = content
                .tensor(&mut r, name, device)
                .map_err(|e| Error::Weights(format!("{}: tensor `{name}`: {e}", path.display())))?;
            let t = q
                .dequantize(device)
                .and_then(|t| t.to_dtype(dtype))
                .map_err(|e| Error::Weights(format!("{}: dequantizing `{name}`: {e}", path.display())))?;
            match hf {
                Some(hf) => {
                    tensors.insert(hf, t);
                }
                None => {
                    let v: Vec<f32> = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
                    rope_factors = Some(v.into_iter().map(f64::from).collect());
                }
            }
        }
        let has_bias = tensors.contains_key("model.layers.0.self_attn.q_proj.bias");
        let cfg = Config {
            family,
            hidden,
            intermediate: meta_u(md, &k("feed_forward_length"), path)?,
            layers: meta_u(md, &k("block_count"), path)?,
            heads,
            kv_heads,
            head_dim,
            eps: meta_f(md, &k("attention.layer_norm_rms_epsilon")).unwrap_or(1e-5),
            rope_theta: meta_f(md, &k("rope.freq_base")).unwrap_or(10_000.0),
            vocab,
            qkv_bias: has_bias,
            o_bias: tensors.contains_key("model.layers.0.self_attn.o_proj.bias"),
            // llama.cpp permutes Llama's q/k rows for its interleaved RoPE; Qwen2 is stored as is
            rope_interleaved: family == Family::Llama,
            rope_factors,
        };
        cfg.check()?;
        Ok(Gguf { metadata: content.metadata, cfg, tensors })
    }
}
