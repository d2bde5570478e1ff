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
//! - [`generate`]: sampling responses with a KV cache (n per prompt, temperature, top-p).
//! - [`cache::FeatureCache`]: content-addressed safetensors shards, one directory per
//!   (model, tokenizer, template, options) space.
//! - [`openai`]: sampling through an OpenAI-compatible server (vLLM) as token ids;
//!   [`hub`]: `hf:<owner>/<name>` sources; [`head`]: linear reward heads over φ.
//! - The CPU kernels the decoders run on: [`cpu`] (what the CPU has, `ONEPASS_CPU`), [`packed`]
//!   (packed products and their epilogues), [`f32mm`] and [`bf16`] (the f32 and bf16 products,
//!   [`amx`] the AMX tiles), [`ops`] (fused row kernels: RMSNorm, RoPE, attention, SwiGLU).
//!
//! This crate knows nothing of specs, parquet or the CLI.

/// This crate's version (a run's meta.json records it).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

pub mod amx;
pub mod bf16;
pub mod cache;
pub mod cpu;
pub mod extract;
pub mod f32mm;
pub mod generate;
pub mod gguf;
pub mod head;
pub mod hub;
pub mod model;
pub mod openai;
pub mod ops;
pub mod packed;
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

/// Makes glibc keep freed memory for reuse, for the processes that train or generate: one arena, no mmap of
/// large blocks, no trimming of the heap's top. Otherwise every large tensor of a training step —
/// activations, the log-softmax over the vocabulary (8 × 128 × 49,152 f32 = 201 MB) — comes back
/// as fresh pages the kernel must zero: `clear_page` took a quarter to a third of a LoRA step
/// (perf). `M_MMAP_THRESHOLD` alone is not enough (glibc caps it at 32 MiB), hence
/// `M_MMAP_MAX = 0`; `M_TRIM_THRESHOLD = -1` disables trimming. The cost: the process keeps its
/// peak memory until it exits. Call it first in `main`, before any other thread starts.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; the caller runs it before other threads.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, -1);
        libc::mallopt(libc::M_TOP_PAD, 1 << 28);
    }
}

/// Peak resident set size of this process (Linux `VmHWM`), in MB; what the benchmarks report.
pub fn peak_rss_mb() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}
