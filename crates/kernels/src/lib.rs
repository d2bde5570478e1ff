//! The CPU kernels onepass's decoders run on, with no candle, tokenizer or I/O in them: CPU
//! detection and the `ONEPASS_CPU` cap ([`cpu`]), the packed matrix products y = x Wᵀ in f32
//! ([`f32mm`]), bf16 ([`bf16`], [`round`]) and AMX tiles ([`amx`]) with their fused epilogues
//! ([`packed`]), the fused row kernels of a forward pass ([`rows`]: causal softmax, attention,
//! RoPE, RMSNorm, silu·up), the uninitialised buffers they fill (`buf`) and the allocator
//! settings of the processes that use them ([`mem`]); for the training path (f32 and f64), the
//! dense products on slices viewed at strides ([`dense`]: one `gemm` call each, candle's
//! matmul), the fused row kernels with their backward passes ([`rows_grad`]: RMSNorm, the head
//! layout with RoPE, silu·up), grouped-query causal attention with its backward pass
//! ([`attention_grad`]) and the R-operator's passes for exact Hessian–vector products ([`rop`]).
//! `features` and `policy` wrap them as candle ops; everything here takes and returns plain
//! slices.
//!
//! Files sit on each other in this order (a file imports only from files before it): `buf`,
//! `mem`, `dense` → `rows` → `rows_grad` → `attention_grad`, `rop` → `packed` → `round` →
//! `amx` → `cpu` → `bf16` → `f32mm`. Every `unsafe` sits behind a safe entry point; the unsafe
//! contracts (a product's block, the uninitialised buffers of `buf`) stay inside the crate.

pub mod amx;
pub mod attention_grad;
pub mod bf16;
mod buf;
pub mod cpu;
pub mod dense;
pub mod f32mm;
pub mod mem;
pub mod packed;
pub mod rop;
pub mod round;
pub mod rows;
pub mod rows_grad;
