//! Tokenizers: a Hugging Face `tokenizer.json`, or one built from a GGUF file's
//! `tokenizer.ggml.*` metadata (BPE vocabulary and merges, token types, special ids, and a
//! pre-tokenizer chosen by `tokenizer.ggml.pre`).
//!
//! We do not use candle's `TokenizerFromGguf`: for `smollm` and `llama-bpe` it falls back to a
//! ByteLevel pre-tokenizer with a prefix space and got 7 of 8 test strings wrong.

use crate::gguf::meta_str;
use crate::Error;
use candle_core::quantized::gguf_file::Value;
use std::collections::HashMap;
use std::path::Path;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

/// Llama-3's pre-tokenizer regex (llama.cpp `llama-bpe`).
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's pre-tokenizer regex (single digits).
const QWEN2_REGEX: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A tokenizer with the special tokens the chat template and the EOS rule need.
pub struct Tok {
    pub inner: Tokenizer,
    pub bos: Option<(String, u32)>,
    pub eos: Option<(String, u32)>,
    /// blake3 of what defines the tokenizer (part of the feature-cache key).
    pub digest: String,
}

fn strings(md: &HashMap<String, Value>, key: &str) -> Result<Vec<String>, Error> {
    let v = md.get(key).ok_or_else(|| Error::Format(format!("tokenizer metadata `{key}` is missing")))?;
    v.to_vec()
        .map_err(|e| Error::Format(format!("tokenizer metadata `{key}`: {e}")))?
        .iter()
        .map(|x| x.to_string().cloned().map_err(|e| Error::Format(format!("tokenizer metadata `{key}`: {e}"))))
        .collect()
}

fn id(md: &HashMap<String, Value>, key: &str) -> Option<u32> {
    md.get(key).and_then(|v| v.to_u32().ok())
}

fn split(regex: &str) -> Result<PreTokenizerWrapper, Error> {
    Split::new(SplitPattern::Regex(regex.into()), SplitDelimiterBehavior::Isolated, false)
        .map(PreTokenizerWrapper::from)
        .map_err(|e| Error::Format(format!("pre-tokenizer regex: {e}")))
}

impl Tok {
    /// From GGUF metadata (`tokenizer.ggml.model = gpt2`, i.e. byte-level BPE).
    pub fn from_gguf(md: &HashMap<String, Value>) -> Result<Tok, Error> {
        let model = meta_str(md, "tokenizer.ggml.model").unwrap_or("");
        if model != "gpt2" {
            return Err(Error::Unsupported(format!(
                "tokenizer.ggml.model `{model}`: only byte-level BPE (`gpt2`: Llama-3, Qwen2, SmolLM2) is supported"
            )));
        }
        let tokens = strings(md, "tokenizer.ggml.tokens")?;
        let raw_merges = strings(md, "tokenizer.ggml.merges")?;
        let types: Vec<i64> = match md.get("tokenizer.ggml.token_type").map(|v| v.to_vec()) {
            Some(Ok(v)) => v.iter().map(|x| x.to_i32().map(i64::from).unwrap_or(1)).collect(),
            _ => vec![1; tokens.len()],
        };
        let pre = meta_str(md, "tokenizer.ggml.pre").unwrap_or("default").to_string();
        let vocab: tokenizers::models::bpe::Vocab =
            tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
        let merges: Vec<(String, String)> = raw_merges
            .iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| Error::Format(format!("tokenizer merge `{m}`: expected two tokens")))
            })
            .collect::<Result<_, _>>()?;
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .ignore_merges(pre == "llama-bpe" || pre == "llama3")
            .build()
            .map_err(|e| Error::Format(format!("building the BPE model: {e}")))?;
        let mut tok = Tokenizer::new(bpe);
        let byte_level = || PreTokenizerWrapper::from(ByteLevel::new(false, true, false));
        let pre_tok: PreTokenizerWrapper = match pre.as_str() {
            // SmolLM2's own tokenizer.json splits digits first ([Digits, ByteLevel]); transformers'
            // GGUF converter does not, which changes whitespace runs before a digit (":\n\n1"
            // → "\n","\n" instead of "\n\n"). We match transformers, the tested reference; a
            // tokenizer.json beside the GGUF (`Tok::from_json`) gives the original behaviour.
            "smollm" => ByteLevel::new(false, true, true).into(),
            "llama-bpe" | "llama3" => Sequence::new(vec![split(LLAMA3_REGEX)?, byte_level()]).into(),
            "qwen2" => {
                tok.with_normalizer(Some(NFC)).map_err(|e| Error::Format(format!("normalizer: {e}")))?;
                Sequence::new(vec![split(QWEN2_REGEX)?, byte_level()]).into()
            }
            // GPT-2's own regex, without a prefix space
            _ => ByteLevel::new(false, true, true).into(),
        };
        tok.with_pre_tokenizer(Some(pre_tok));
        tok.with_decoder(Some(ByteLevelDecoder::default()));
        // token type 3 (control) → special added tokens, 4 (user-defined) → plain added tokens
        let added = |ty: i64, special: bool| -> Vec<AddedToken> {
            tokens
                .iter()
                .zip(&types)
                .filter(|(_, &t)| t == ty)
                .map(|(s, _)| AddedToken::from(s.clone(), special))
                .collect()
        };
        let (special, user) = (added(3, true), added(4, false));
        tok.add_special_tokens(special).map_err(|e| Error::Format(format!("special tokens: {e}")))?;
        tok.add_tokens(user).map_err(|e| Error::Format(format!("added tokens: {e}")))?;
        let named = |k: &str| id(md, k).and_then(|i| tokens.get(i as usize).map(|s| (s.clone(), i)));
        let mut h = blake3::Hasher::new();
        h.update(b"gguf-tokenizer\0");
        h.update(pre.as_bytes());
        for t in tokens.iter().chain(&raw_merges) {
            h.update(t.as_bytes());
            h.update(b"\0");
        }
        for t in &types {
            h.update(&t.to_le_bytes());
        }
        Ok(Tok {
            inner: tok,
            bos: named("tokenizer.ggml.bos_token_id"),
            eos: named("tokenizer.ggml.eos_token_id"),
            digest: h.finalize().to_hex().to_string(),
        })
    }

    /// From a `tokenizer.json` and the special tokens named in `tokenizer_config.json`.
    /// `origin` names the file in errors.
    pub fn from_json(json: &str, origin: &Path, bos: Option<&str>, eos: Option<&str>) -> Result<Tok, Error> {
        let inner: Tokenizer =
            json.parse().map_err(|e| Error::Format(format!("{}: not a readable tokenizer: {e}", origin.display())))?;
        let named = |s: Option<&str>| s.and_then(|s| inner.token_to_id(s).map(|i| (s.to_string(), i)));
        let (bos, eos) = (named(bos), named(eos));
        let digest = blake3::hash(json.as_bytes()).to_hex().to_string();
        Ok(Tok { inner, bos, eos, digest })
    }

    /// Token ids of `text` with no special tokens added (the template wrote them).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, Error> {
        let enc = self.inner.encode(text, false).map_err(|e| Error::Input(format!("tokenizing: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String, Error> {
        self.inner.decode(ids, false).map_err(|e| Error::Input(format!("decoding: {e}")))
    }
}
