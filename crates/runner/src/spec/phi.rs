//! How φ is computed, once for every table that names a feature model (`[data]`, `[features]`,
//! `[oracle]`) and for `onepass features extract`: [`PhiSpec`], with typed dtype and device.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Weights and activations of a feature or policy model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum DType {
    F32,
    Bf16,
    F16,
}

/// Where a model runs: `auto` takes CUDA, else Metal, else the CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Device {
    Cpu,
    Cuda,
    Metal,
    Auto,
}

/// φ(x, a): the model, the options of `features::PhiOptions`, the batch and the cache. The
/// spec's tables produce it (`DataSpec::phi`, `FeatureSpec::phi`, `OracleSpec::phi`) and
/// `onepass features extract` takes it as flags (the same defaults).
#[derive(Clone, Debug, PartialEq, clap::Args)]
pub struct PhiSpec {
    /// A .gguf file, a model directory (config.json, tokenizer.json, tokenizer_config.json,
    /// safetensors) or hf:<owner>/<name>[@rev]; `${VAR}` is expanded.
    #[arg(long)]
    pub model: String,
    /// Tokens per sequence; longer conversations are truncated (see --truncation). At most
    /// 131,072 (the rotary table's positions).
    #[arg(long, default_value_t = d_max_len(), allow_negative_numbers = true, value_parser = count_arg)]
    pub max_len: usize,
    /// How the sequence ends: "reference" (the authors': `" " + eos` appended, the last token
    /// forced to eos after truncation) or "plain" (the rendered template as is).
    #[arg(long, default_value = "reference", value_parser = by_name::<features::EosRule>)]
    pub eos_rule: features::EosRule,
    /// What a too-long conversation loses first (as the spec's `truncation`).
    #[arg(long, default_value = "prompt-first", value_parser = by_name::<features::Truncation>)]
    pub truncation: features::Truncation,
    /// hidden_states[layer]; negative counts from the end (-1: after the final norm).
    #[arg(long, default_value_t = d_layer(), allow_hyphen_values = true)]
    pub layer: i64,
    /// How hidden states become φ: "last" (the last token's, the paper) or "mean".
    #[arg(long, default_value = "last", value_parser = by_name::<features::Pool>)]
    pub pool: features::Pool,
    /// The weights' dtype in the products.
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: DType,
    /// Where the model runs.
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: Device,
    /// Sequences per forward pass.
    #[arg(long, default_value_t = d_batch(), allow_negative_numbers = true, value_parser = count_arg)]
    pub batch: usize,
    /// The feature cache (content-addressed: model, options and text).
    #[arg(long, default_value = ".cache/features")]
    pub cache: PathBuf,
}

/// A flag's value read as the spec reads the same word (serde's kebab-case names).
fn by_name<T: serde::de::DeserializeOwned>(v: &str) -> Result<T, String> {
    serde_json::from_value(serde_json::Value::String(v.to_string())).map_err(|e| e.to_string())
}

/// A count flag (`--max-len`, `--batch`, `--limit`): a negative number is a bad value of that
/// flag, not taken by clap for an unknown argument.
pub fn count_arg(s: &str) -> Result<usize, String> {
    s.parse().map_err(|_| format!("expected a whole number ≥ 0, not `{s}`"))
}

impl PhiSpec {
    /// Checks that need no file: (key, message).
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        if self.batch == 0 {
            return Err(("batch", "expected at least 1".into()));
        }
        if self.max_len < 8 {
            return Err(("max_len", format!("{}: expected at least 8 tokens", self.max_len)));
        }
        if self.max_len > features::model::MAX_POSITIONS {
            let most = features::model::MAX_POSITIONS;
            return Err(("max_len", format!("{}: expected at most {most} tokens", self.max_len)));
        }
        Ok(())
    }

    pub fn options(&self) -> features::PhiOptions {
        features::PhiOptions {
            max_len: self.max_len,
            eos_rule: self.eos_rule,
            truncation: self.truncation,
            layer: self.layer,
            pool: self.pool,
        }
    }
}

/// A table that names a feature model: `$name`'s own keys, then the φ key block written once
/// here (model, max_len, eos_rule, truncation, layer, pool, dtype, device, batch, cache with the
/// table's own default `$cache`), and `$name::phi` giving them as [`PhiSpec`]. A macro rather
/// than `#[serde(flatten)]`: serde refuses unknown keys only on a struct without flatten.
macro_rules! phi_table {
    ($(#[$m:meta])* pub struct $name:ident { $($own:tt)* } cache = $cache:tt) => {
        $(#[$m])*
        pub struct $name {
            $($own)*
            /// The feature model: a .gguf file, a model directory or hf:<owner>/<name>.
            pub model: String,
            /// Tokens per sequence; longer conversations are truncated (`truncation`). At most
            /// 131,072 (the rotary table's positions).
            #[serde(default = "crate::spec::phi::d_max_len")]
            pub max_len: usize,
            #[serde(default = "crate::spec::phi::d_eos_rule")]
            pub eos_rule: features::EosRule,
            #[serde(default = "crate::spec::phi::d_truncation")]
            pub truncation: features::Truncation,
            /// hidden_states[layer]; negative counts from the end (-1: after the final norm, the
            /// paper's φ).
            #[serde(default = "crate::spec::phi::d_layer")]
            pub layer: i64,
            /// How a sequence's hidden states become φ (the paper: the last token's).
            #[serde(default = "crate::spec::phi::d_pool")]
            pub pool: features::Pool,
            /// f32, bf16 or f16.
            #[serde(default = "crate::spec::phi::d_dtype")]
            pub dtype: crate::spec::DType,
            /// cpu, cuda, metal or auto.
            #[serde(default = "crate::spec::phi::d_device")]
            pub device: crate::spec::Device,
            /// Sequences per forward pass.
            #[serde(default = "crate::spec::phi::d_batch")]
            pub batch: usize,
            /// The feature cache (content-addressed: model, options and text; shared by runs).
            #[serde(default = $cache)]
            pub cache: std::path::PathBuf,
        }

        impl $name {
            /// The feature model and its options.
            pub fn phi(&self) -> crate::spec::PhiSpec {
                crate::spec::PhiSpec {
                    model: self.model.clone(),
                    max_len: self.max_len,
                    eos_rule: self.eos_rule,
                    truncation: self.truncation,
                    layer: self.layer,
                    pool: self.pool,
                    dtype: self.dtype,
                    device: self.device,
                    batch: self.batch,
                    cache: self.cache.clone(),
                }
            }
        }
    };
}
pub(crate) use phi_table;

// serde defaults shared by the tables that name a feature model
pub(crate) fn d_max_len() -> usize {
    1024
}
pub(crate) fn d_eos_rule() -> features::EosRule {
    features::EosRule::Reference
}
pub(crate) fn d_truncation() -> features::Truncation {
    features::Truncation::PromptFirst
}
pub(crate) fn d_layer() -> i64 {
    -1
}
pub(crate) fn d_pool() -> features::Pool {
    features::Pool::Last
}
pub(crate) fn d_dtype() -> DType {
    DType::F32
}
pub(crate) fn d_device() -> Device {
    Device::Cpu
}
pub(crate) fn d_batch() -> usize {
    8
}
pub(crate) fn d_cache() -> PathBuf {
    PathBuf::from(".cache/features")
}
