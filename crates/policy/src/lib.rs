//! A policy that learns between deployment chunks (paper §6: each chunk's pairs update the
//! reward model and then the policy). Pure maths and models: no specs, files of runs or CLI.
//!
//! - [`lora`]: low-rank adapters W + (α/r)·B·A on chosen linear layers, base weights frozen;
//!   merging them into the weights for the fused inference path of `features`.
//! - [`model::PolicyModel`]: the Llama/Qwen2 decoder of `features` written with differentiable
//!   candle ops (RMSNorm, RoPE, attention, SiLU as plain tensor algebra), so `backward()` gives
//!   the adapters' gradients. Training batches are right-padded: with causal attention a real
//!   token never sees a pad, so no padding mask is needed; losses mask the pads.
//! - [`loss`]: per-token log-probabilities, the KL estimators k1 and k3, RLOO's leave-one-out
//!   advantages and its (optionally PPO-clipped) policy-gradient loss, the DPO loss.
//! - [`adam::Adam`]: Adam on the adapters with global-norm clipping; its state serialises.
//! - [`batch::SeqBatch`]: (prompt, response) sequences as one right-padded batch; only the
//!   response positions reach the LM head ([`PolicyModel::logprobs_at`]).
//! - [`train`]: one policy update on a chunk — [`train::rloo_update`], [`train::dpo_update`] —
//!   and [`train::score`] (log-probabilities and KL to the reference, no gradients).
//! - [`peft`]: adapters saved and read in PEFT's layout (`adapter_model.safetensors`,
//!   `adapter_config.json`).

/// This crate's version (a run's meta.json records it).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

pub mod adam;
pub mod batch;
pub mod lora;
pub mod loss;
pub mod model;
pub mod ops;
pub mod peft;
pub mod train;

pub use lora::{LoraConfig, Target};
pub use model::PolicyModel;

/// Makes glibc keep freed memory for reuse, for the processes that train: one arena, no mmap of
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
