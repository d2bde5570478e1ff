//! The reward model whose features learn: r = θᵀh_ψ, a linear head θ on the last hidden state
//! h_ψ of the policy crate's differentiable decoder with LoRA adapters ψ (the paper's appendix
//! "Full update of reward model"). [`model`] holds the model and its Bradley–Terry gradients,
//! [`update`] its one-pass update over (ψ, θ) with the head-only estimators' rules, and [`rop`]
//! the exact Hessian-vector products by Pearlmutter's R-operator (its CPU kernels in `rop_cpu`).
//!
//! Its files from the bottom up, each naming only files before it: [`model`], `rop_cpu`,
//! [`rop`] (its `layers`, then its `mod.rs`), [`update`].

pub mod model;
pub mod rop;
mod rop_cpu;
pub mod update;
