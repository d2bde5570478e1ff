//! A policy that learns between deployment chunks (paper §6: each chunk's pairs update the
//! reward model and then the policy). Pure maths and models: no specs, files of runs or CLI.
//!
//! Its files from the bottom up, each naming only files before it: `mm`, [`adam`], [`batch`],
//! [`loss`], [`ops`], [`attention`], [`lora`] (its `packed`, `matmul`, then its `mod.rs`),
//! [`head`], [`model`] (its `mod.rs`, then `load`, `blocks`), [`critic`], [`train`] (its `mod.rs`,
//! then `dpo`, `ppo`),
//! [`rm`] (within it `model`, `rop_cpu`, `rop`, `update`; see its doc), [`peft`].
//!
//! - [`lora`]: low-rank adapters W + (α/r)·B·A on chosen linear layers, base weights frozen;
//!   merging them into the weights for the fused inference path of `features`.
//! - [`model::PolicyModel`]: the Llama/Qwen2 decoder of `features` written with differentiable
//!   candle ops, so `backward()` gives the adapters' gradients; on the CPU its sublayers run as
//!   fused ops with their backward passes written out ([`ops`], [`attention`], [`head`],
//!   `mm`: the packed products of `features` for frozen weights; the passes over values are the
//!   `kernels` crate's `dense`, `rows_grad` and `attention_grad`), checked bit for bit against
//!   the op-by-op graph (`set_sublayer_fusion(false)`). Training batches are right-padded: with
//!   causal attention a real token never sees a pad, so no padding mask is needed; losses mask
//!   the pads.
//! - [`attention`]: grouped-query causal attention as one CPU op with its gradient written out
//!   (recomputing the probabilities in the backward pass): the fused path's attention.
//! - [`loss`]: per-token log-probabilities, the KL estimators k1 and k3, RLOO's leave-one-out
//!   advantages and its (optionally PPO-clipped) policy-gradient loss, the DPO loss, GAE and
//!   PPO's clipped value loss.
//! - [`model::PolicyModel`]'s life cycle besides training: merging an adapter into the weights
//!   and starting a fresh one, moving the KL reference ([`model::LifeEvent`]).
//! - [`adam::Adam`]: Adam on the adapters with global-norm clipping and a learning-rate
//!   schedule ([`adam::LrSchedule`]); its state serialises.
//! - [`critic::Critic`]: PPO's value head on a decoder's hidden states (its own adapters).
//! - [`batch::SeqBatch`]: (prompt, response) sequences as one right-padded batch or with
//!   shared prompts (a prompt's pass computed once for its samples); only the response
//!   positions reach the LM head ([`PolicyModel::logprobs_at`]).
//! - [`train`]: one policy update on a chunk — [`train::rloo_update`], [`train::dpo_update`],
//!   [`train::ppo_update`] (actor and critic) —
//!   and [`train::score`] (log-probabilities and KL to the reference, no gradients).
//! - [`rm`]: a reward model whose features learn ([`rm::model`]), r = θᵀh_ψ (the paper's appendix
//!   "Full update of reward model"), and ([`rm::update`]) its one-pass updates over (ψ, θ) with
//!   the head-only estimators' rules, HVPs by differences of gradients or exactly by
//!   [`rm::rop`] (Pearlmutter's R-operator over the adapters and the head; its CPU kernels are
//!   `kernels::rop`, wrapped for tensors in `rm::rop_cpu`).
//! - [`peft`]: adapters saved and read in PEFT's layout (`adapter_model.safetensors`,
//!   `adapter_config.json`).

/// This crate's version (a run's meta.json records it).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

pub mod adam;
pub mod attention;
pub mod batch;
pub mod critic;
pub mod head;
pub mod lora;
pub mod loss;
mod mm;
pub mod model;
pub mod ops;
pub mod peft;
pub mod rm;
pub mod train;

pub use lora::{Dropout, LoraConfig, Pass, Target};
pub use model::PolicyModel;
