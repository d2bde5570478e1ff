//! φ(x, a): the final-norm hidden state of a frozen instruct LLM at the last token of the
//! chat-templated conversation (Llama, Qwen2, SmolLM2; safetensors or GGUF), a tokenizer and
//! chat template, and a content-addressed feature cache.
//!
//! Placeholder: the features issue fills this crate. Nothing here is used yet.
