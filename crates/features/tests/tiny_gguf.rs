//! Tiny random Qwen2 and Llama GGUF files (F32; pre-tokenizers `qwen2` and `llama-bpe`; Llama's
//! q/k stored permuted the way llama.cpp's converter writes them) against what transformers'
//! GGUF loader makes of the same files (fixtures/make_fixtures.py tiny-gguf): token ids of the
//! tricky strings, the rendered chat template, and final hidden states at every position.

use candle_core::{DType, Device, Tensor};
use features::{Backbone, Message, Source};
use std::path::PathBuf;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn expected() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("tiny_gguf.json")).unwrap()).unwrap()
}

fn check(file: &str) {
    let exp = expected();
    let tricky: Vec<String> = serde_json::from_value(exp["tricky"].clone()).unwrap();
    let e = &exp["files"][file];
    let b = Backbone::load(&Source::Gguf(fixtures().join(file)), &Device::Cpu, DType::F32, 256).unwrap();

    let want_ids: Vec<Vec<u32>> = serde_json::from_value(e["tricky_ids"].clone()).unwrap();
    let mut wrong = Vec::new();
    for (t, want) in tricky.iter().zip(&want_ids) {
        let got = b.tok.encode(t).unwrap();
        if &got != want {
            wrong.push(format!("{t:?}: {got:?} vs transformers {want:?}"));
        }
    }
    assert!(wrong.is_empty(), "{file}: {} of {} strings differ:\n{}", wrong.len(), tricky.len(), wrong.join("\n"));

    // Decomposed accents: Qwen2's own tokenizer.json normalises to NFC and so do we for `qwen2`;
    // transformers' GGUF loader does not (its ids of the raw text differ). Llama-3 has no normaliser.
    let d = &e["decomposed"];
    let got = b.tok.encode(d["text"].as_str().unwrap()).unwrap();
    let which = if file.contains("qwen2") { "nfc" } else { "raw" };
    let want: Vec<u32> = serde_json::from_value(d[which].clone()).unwrap();
    assert_eq!(got, want, "{file}: decomposed accents should give the {which} ids");
    assert_ne!(d["raw"], d["nfc"], "the fixture must tell NFC from raw");

    let chat = [Message::new("user", "Say hi."), Message::new("assistant", "Hi there! 123")];
    assert_eq!(b.template.render(&chat, false).unwrap(), e["rendered"].as_str().unwrap(), "{file}: template");

    let seqs: Vec<Vec<u32>> = serde_json::from_value(e["seqs"].clone()).unwrap();
    let states: Vec<Vec<Vec<f32>>> = serde_json::from_value(e["last_hidden"].clone()).unwrap();
    let layers = b.model.cfg.layers;
    for (ids, want) in seqs.iter().zip(&states) {
        let x = Tensor::new(ids.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        let got: Vec<Vec<f32>> = b.model.hidden_states(&x, layers).unwrap().squeeze(0).unwrap().to_vec2().unwrap();
        assert_eq!(got.len(), want.len());
        for (pos, (g, w)) in got.iter().zip(want).enumerate() {
            let dot: f64 = g.iter().zip(w).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum();
            let ng: f64 = g.iter().map(|a| f64::from(*a).powi(2)).sum::<f64>().sqrt();
            let nw: f64 = w.iter().map(|a| f64::from(*a).powi(2)).sum::<f64>().sqrt();
            let md = g.iter().zip(w).map(|(a, b)| f64::from((a - b).abs())).fold(0.0, f64::max);
            let mw = w.iter().map(|a| f64::from(a.abs())).fold(0.0, f64::max);
            assert!(
                dot / (ng * nw) > 0.9999 && md / mw < 1e-3,
                "{file}: position {pos} of {ids:?}: cos {}, rel {}",
                dot / (ng * nw),
                md / mw
            );
        }
    }
}

#[test]
fn qwen2_gguf_matches_transformers() {
    check("tiny-qwen2.gguf");
}

#[test]
fn llama_bpe_gguf_matches_transformers() {
    check("tiny-llama-bpe.gguf");
}

/// A hand-written GGUF whose tensor table claims 2^40 × 2^40 elements (the overflow `just fuzz
/// gguf` found in candle's size arithmetic) or more bytes than the file has: errors that name the
/// tensor, never a panic or a huge allocation.
#[test]
fn corrupt_tensor_tables_are_errors() {
    fn s(out: &mut Vec<u8>, v: &str) {
        out.extend((v.len() as u64).to_le_bytes());
        out.extend(v.as_bytes());
    }
    let gguf = |dims: &[u64]| -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend(1u64.to_le_bytes()); // tensors
        b.extend(3u64.to_le_bytes()); // metadata entries
        s(&mut b, "general.architecture");
        b.extend(8u32.to_le_bytes()); // string
        s(&mut b, "llama");
        for (k, v) in [("llama.embedding_length", 8u32), ("llama.attention.head_count", 2)] {
            s(&mut b, k);
            b.extend(4u32.to_le_bytes()); // u32
            b.extend(v.to_le_bytes());
        }
        s(&mut b, "token_embd.weight");
        b.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(0u32.to_le_bytes()); // F32
        b.extend(0u64.to_le_bytes()); // offset
        while !b.len().is_multiple_of(32) {
            b.push(0);
        }
        b.extend([0u8; 64]); // 16 f32 of data
        b
    };
    let dir = tempfile::tempdir().unwrap();
    for (dims, want) in [(vec![1u64 << 40, 1 << 40], "overflows"), (vec![8, 1000], "runs past the end of the file")] {
        let p = dir.path().join("bad.gguf");
        std::fs::write(&p, gguf(&dims)).unwrap();
        let e = features::gguf::Gguf::read(&p, &candle_core::Device::Cpu, candle_core::DType::F32).err().unwrap();
        let msg = e.to_string();
        assert!(msg.contains("bad.gguf") && msg.contains("token_embd.weight") && msg.contains(want), "{msg}");
    }
    // the same writer with a shape that fits reads the table (and fails later, on the config)
    let p = dir.path().join("ok.gguf");
    std::fs::write(&p, gguf(&[8, 2])).unwrap();
    let msg =
        features::gguf::Gguf::read(&p, &candle_core::Device::Cpu, candle_core::DType::F32).err().unwrap().to_string();
    assert!(!msg.contains("token_embd.weight`: shape"), "{msg}");
}
