//! The model's configuration: the subset of a Hugging Face `config.json` onepass reads
//! (Llama family, Qwen2), its RoPE scaling, and what the decoder derives from it.

use crate::Error;
use serde::Deserialize;

/// The subset of a Hugging Face `config.json` we read (Llama and Qwen2).
#[derive(Clone, Debug, Deserialize)]
pub struct HfConfig {
    #[serde(default)]
    pub architectures: Vec<String>,
    #[serde(default)]
    pub model_type: Option<String>,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    pub rms_norm_eps: f64,
    /// transformers < 5 (and most hub configs); ≥ 5 writes `rope_parameters` instead.
    #[serde(default)]
    pub rope_theta: Option<f64>,
    pub vocab_size: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Llama: q/k/v/o biases (Qwen2 always has q/k/v biases and no o bias).
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    /// transformers ≥ 5: `rope_theta` and the scaling in one table.
    #[serde(default)]
    pub rope_parameters: Option<RopeScaling>,
    #[serde(default)]
    pub hidden_act: Option<String>,
}

/// `rope_scaling` (or transformers 5's `rope_parameters`): `default`, or Llama-3.1's `llama3`.
#[derive(Clone, Debug, Deserialize)]
pub struct RopeScaling {
    #[serde(alias = "type", default = "d_rope_type")]
    pub rope_type: String,
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub factor: Option<f64>,
    #[serde(default)]
    pub low_freq_factor: Option<f64>,
    #[serde(default)]
    pub high_freq_factor: Option<f64>,
    #[serde(default)]
    pub original_max_position_embeddings: Option<usize>,
}

fn d_rope_type() -> String {
    "default".into()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Llama,
    Qwen2,
}

/// The validated configuration the blocks are built from.
#[derive(Clone, Debug)]
pub struct Config {
    pub family: Family,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub eps: f64,
    pub rope_theta: f64,
    pub vocab: usize,
    pub qkv_bias: bool,
    pub o_bias: bool,
    /// llama.cpp stores Llama's q/k rows permuted for interleaved RoPE; HF uses rotate-half.
    pub rope_interleaved: bool,
    /// Per-frequency divisors of the inverse frequencies (Llama-3.1 `rope_freqs`).
    pub rope_factors: Option<Vec<f64>>,
}

impl Config {
    /// From a Hugging Face `config.json`.
    pub fn from_hf(c: &HfConfig) -> Result<Config, Error> {
        let kind = c.model_type.clone().or_else(|| c.architectures.first().cloned()).unwrap_or_default();
        let family = match kind.as_str() {
            "llama" | "LlamaForCausalLM" | "mistral" => Family::Llama,
            "qwen2" | "Qwen2ForCausalLM" => Family::Qwen2,
            other => {
                return Err(Error::Unsupported(format!(
                    "architecture `{other}`: expected llama (Llama, SmolLM2) or qwen2 (Qwen2, Qwen2.5)"
                )))
            }
        };
        if let Some(act) = &c.hidden_act {
            if act != "silu" {
                return Err(Error::Unsupported(format!("hidden_act `{act}`: expected silu")));
            }
        }
        let head_dim = c.head_dim.unwrap_or(c.hidden_size / c.num_attention_heads);
        let rope_theta = c.rope_parameters.as_ref().and_then(|p| p.rope_theta).or(c.rope_theta).unwrap_or(10_000.0);
        let scaling = c.rope_parameters.as_ref().or(c.rope_scaling.as_ref());
        let rope_factors = match scaling {
            None => None,
            Some(s) if s.rope_type == "llama3" => Some(llama3_factors(s, head_dim, rope_theta)?),
            Some(s) if s.rope_type == "default" => None,
            Some(s) => return Err(Error::Unsupported(format!("rope_scaling type `{}`", s.rope_type))),
        };
        Ok(Config {
            family,
            hidden: c.hidden_size,
            intermediate: c.intermediate_size,
            layers: c.num_hidden_layers,
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads.unwrap_or(c.num_attention_heads),
            head_dim,
            eps: c.rms_norm_eps,
            rope_theta,
            vocab: c.vocab_size,
            qkv_bias: family == Family::Qwen2 || c.attention_bias,
            o_bias: family == Family::Llama && c.attention_bias,
            rope_interleaved: false,
            rope_factors,
        })
    }

    pub fn check(&self) -> Result<(), Error> {
        if self.heads == 0
            || self.kv_heads == 0
            || !self.heads.is_multiple_of(self.kv_heads)
            || !self.head_dim.is_multiple_of(2)
        {
            return Err(Error::Unsupported(format!(
                "{} query heads, {} key/value heads, head_dim {}: expected heads divisible by kv heads and an even head_dim",
                self.heads, self.kv_heads, self.head_dim
            )));
        }
        Ok(())
    }
}

/// Llama-3.1's frequency-dependent RoPE scaling, as divisors of the inverse frequencies.
fn llama3_factors(s: &RopeScaling, head_dim: usize, theta: f64) -> Result<Vec<f64>, Error> {
    let need = |v: Option<f64>, k: &str| v.ok_or_else(|| Error::Unsupported(format!("rope_scaling.{k} is missing")));
    let factor = need(s.factor, "factor")?;
    let low = need(s.low_freq_factor, "low_freq_factor")?;
    let high = need(s.high_freq_factor, "high_freq_factor")?;
    let old = s
        .original_max_position_embeddings
        .ok_or_else(|| Error::Unsupported("rope_scaling.original_max_position_embeddings is missing".into()))?
        as f64;
    let (low_wl, high_wl) = (old / low, old / high);
    Ok((0..head_dim / 2)
        .map(|i| {
            let freq = 1.0 / theta.powf(2.0 * i as f64 / head_dim as f64);
            let wl = 2.0 * std::f64::consts::PI / freq;
            if wl < high_wl {
                1.0
            } else if wl > low_wl {
                factor
            } else {
                let smooth = (old / wl - low) / (high - low);
                // new freq = (1 − smooth)·freq/factor + smooth·freq
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect())
}
