//! φ(x, a): the hidden state of a frozen instruct LLM at the last token of the chat-templated
//! conversation (paper §6; reference-code.md §1), computed with candle.
//!
//! - [`model::Model`]: Llama-family and Qwen2 decoders returning hidden states `[b, t, d]`
//!   (after the final norm by default), from safetensors or GGUF ([`gguf::Gguf`], weights
//!   dequantized to dense tensors at load).
//! - [`tokenizer::Tok`]: `tokenizer.json`, or a byte-level BPE built from GGUF metadata.
//! - [`template::ChatTemplate`]: the model's Jinja chat template, rendered with minijinja.
//! - [`extract::Backbone`]: the three together, with [`extract::PhiOptions`] (max length, EOS
//!   rule, truncation side, layer, pooling): conversation → ids → φ.
//!
//! - [`generate`]: sampling responses with a KV cache (n per prompt, temperature, top-p), with
//!   the options of [`sampling`].
//! - [`cache::FeatureCache`]: content-addressed safetensors shards, one directory per
//!   (model, tokenizer, template, options) space.
//! - [`openai`]: sampling through an OpenAI-compatible server (vLLM) as token ids;
//!   [`hub`]: `hf:<owner>/<name>` sources; [`head`]: linear reward heads over φ.
//! - The decoders run on the candle-free CPU kernels of the `kernels` crate (packed f32, bf16
//!   and AMX products, fused row kernels): [`ops`] wraps the row kernels as candle custom ops,
//!   [`model`] holds packed weights; [`cpu`] says what the CPU has, with candle's own matmul.
//!
//! Files sit in this order, each naming only files before it (`crates/runner/tests/cycles.rs`
//! fails on a circle): `lib` (the error type), `hub`, `ops`, `sampling`, `template` → `cache`,
//! `model::config` → `model::linear` →
//! `model` → `openai`, `cpu`, `gguf`, `tokenizer` → `extract` → `generate`, `head`.
//!
//! This crate knows nothing of specs, parquet or the CLI.

/// This crate's version (a run's meta.json records it).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

pub mod cache;
pub mod cpu;
pub mod extract;
pub mod generate;
pub mod gguf;
pub mod head;
pub mod hub;
pub mod model;
pub mod openai;
pub mod ops;
pub mod sampling;
pub mod template;
pub mod tokenizer;

pub use cache::FeatureCache;
pub use extract::{
    batch_plan, Backbone, EosRule, ExtractStats, PhiOptions, Pool, Prepared, Schedule, ShardSpec, Source, Truncation,
};
pub use template::Message;

/// What went wrong, with the file, tensor or template it concerns.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Io(String),
    /// A write that failed (a full disk, an I/O error, a read-only file system): the caller's
    /// storage failed, not its input. (`cause` is no error `source`: the message carries it
    /// once, however the error is printed.)
    #[error("writing {}: {cause}", path.display())]
    Storage { path: std::path::PathBuf, cause: std::io::Error },
    /// Not the expected file format (a truncated or non-GGUF file, bad JSON, …).
    #[error("{0}")]
    Format(String),
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A missing or mis-shaped tensor.
    #[error("weights: {0}")]
    Weights(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("{0}")]
    Input(String),
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
}
