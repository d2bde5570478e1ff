//! The bad-input corpus (tests/bad_inputs/, see its README): every broken input gives exit
//! code 2, exactly one line on stderr equal to the committed snapshot, no panic, and no
//! half-written or final file.

use arrow_array::builder::{Float32Builder, ListBuilder};
use arrow_array::{ArrayRef, RecordBatch};
use std::path::{Path, PathBuf};
use std::process::Command;

mod util;
use util::{copy_dir, fixtures};

fn features_parquet(path: &Path, variant: &str) {
    // "wide": d = 100,000 (omd-exact's 𝓗⁻¹ alone would be 40 GB)
    let d = if variant == "wide" { 100_000 } else { 3 };
    let row =
        |i: usize, side: f32| -> Vec<f32> { (0..d).map(|j| side * (i as f32 + 1.0) / (j as f32 + 2.0)).collect() };
    let list = |side: f32| -> ArrayRef {
        let mut b = ListBuilder::new(Float32Builder::new());
        for i in 0..16 {
            let mut r = row(i, side);
            match (variant, i) {
                ("nan", 9) if side > 0.0 => r[1] = f32::NAN,
                ("inf", 5) if side < 0.0 => r[2] = f32::INFINITY,
                ("ragged", 7) if side > 0.0 => r.push(0.5),
                _ => {}
            }
            b.values().append_slice(&r);
            b.append(true);
        }
        std::sync::Arc::new(b.finish())
    };
    let mut cols = vec![("phi_chosen", list(1.0))];
    if variant != "missing-column" {
        cols.push(("phi_rejected", list(-0.5)));
    }
    let batch = RecordBatch::try_from_iter(cols).unwrap();
    let mut w =
        parquet::arrow::ArrowWriter::try_new(std::fs::File::create(path).unwrap(), batch.schema(), None).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
}

/// A tiny Llama directory (the features fixtures' weights, SmolLM2's tokenizer), broken.
fn model_dir(dir: &Path, variant: &str) {
    let m = dir.join("model");
    util::tiny_model_dir(&m);
    if variant == "bad-tokenizer" {
        std::fs::write(m.join("tokenizer.json"), r#"{"model": {"type": "WordLevel""#).unwrap();
    }
    if variant == "bad-template" {
        let template = "{% for m in messages %}{% if m.role == 'user' %}{{ raise_exception('this template refuses user turns') }}{% endif %}{% endfor %}";
        let tc = serde_json::json!({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": template});
        std::fs::write(m.join("tokenizer_config.json"), tc.to_string()).unwrap();
    }
    if variant == "missing-tensor" {
        let bytes = std::fs::read(m.join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let kept: Vec<(String, safetensors::tensor::TensorView<'_>)> =
            st.tensors().into_iter().filter(|(name, _)| name != "model.layers.0.mlp.up_proj.weight").collect();
        assert_eq!(kept.len() + 1, st.len(), "the fixture has model.layers.0.mlp.up_proj.weight");
        safetensors::serialize_to_file(kept, None, &m.join("model.safetensors")).unwrap();
    }
}

fn make(dir: &Path, what: &str) {
    let gguf = fixtures().join("tiny-llama-bpe.gguf");
    match what.split_once(':').unwrap_or((what, "")) {
        ("tiny-gguf", _) => {
            std::fs::copy(&gguf, dir.join("model.gguf")).unwrap();
        }
        ("truncated-gguf", _) => {
            std::fs::write(dir.join("model.gguf"), &std::fs::read(&gguf).unwrap()[..1000]).unwrap();
        }
        ("features", v) => features_parquet(&dir.join("pairs.parquet"), v),
        ("model-dir", v) => model_dir(dir, v),
        _ => panic!("unknown make directive {what}"),
    }
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            walk(&p, out);
        } else {
            out.push(p);
        }
    }
}

#[test]
fn every_bad_input_is_one_clear_line_and_exit_2() {
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/bad_inputs");
    let update = std::env::var("ONEPASS_UPDATE_SNAPSHOTS").is_ok();
    let mut cases: Vec<PathBuf> =
        std::fs::read_dir(&corpus).unwrap().map(|e| e.unwrap().path()).filter(|p| p.is_dir()).collect();
    cases.sort();
    assert!(cases.len() >= 20, "the corpus has {} cases", cases.len());
    let mut failures = Vec::new();
    for case in &cases {
        let name = case.file_name().unwrap().to_string_lossy().into_owned();
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join(&name);
        copy_dir(case, &dir);
        for f in ["cmd", "env", "make", "expected"] {
            let _ = std::fs::remove_file(dir.join(f));
        }
        if let Ok(m) = std::fs::read_to_string(case.join("make")) {
            make(&dir, m.trim());
        }
        let args_text = std::fs::read_to_string(case.join("cmd")).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_onepass"));
        cmd.current_dir(&dir).args(args_text.split_whitespace());
        cmd.env_remove("ONEPASS_FAILPOINT").env_remove("ONEPASS_FAIL_WRITE");
        for line in std::fs::read_to_string(case.join("env")).unwrap_or_default().lines() {
            let (k, v) = line.split_once('=').unwrap();
            cmd.env(k, v);
        }
        let out = cmd.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).replace(&dir.display().to_string(), "$TMP");
        // run directories carry the UTC time
        let stderr: String = stderr
            .split('-')
            .map(|w| {
                let t = w.get(..16).filter(|t| t.len() == 16 && t.as_bytes()[8] == b'T' && t.ends_with('Z'));
                match t {
                    Some(t) if t[..8].bytes().chain(t[9..15].bytes()).all(|b| b.is_ascii_digit()) => {
                        format!("<UTC>{}", &w[16..])
                    }
                    _ => w.to_string(),
                }
            })
            .collect::<Vec<_>>()
            .join("-");
        // the thread limit is the machine's: 8 per core
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let stderr = stderr.replace(
            &format!("at most {} threads on this machine (8 per core, {cores} cores)", 8 * cores),
            "at most <8×CORES> threads on this machine (8 per core, <CORES> cores)",
        );
        // informational lines (a run that started: "onepass: N cells … → dir") may come first;
        // the error is the last line
        let all: Vec<&str> = stderr.trim_end().lines().collect();
        let line = all.last().copied().unwrap_or("");
        let before = &all[..all.len().saturating_sub(1)];
        let expected_path = case.join("expected");
        if update {
            std::fs::write(&expected_path, format!("{line}\n")).unwrap();
        }
        let expected = std::fs::read_to_string(&expected_path).unwrap_or_default();
        let mut why = Vec::new();
        if out.status.code() != Some(2) {
            why.push(format!("exit {:?}, expected 2", out.status.code()));
        }
        // progress lines of the stages that ran before the error (stderr is not a terminal here)
        let progress = |l: &str| l.starts_with("onepass: ") && l.contains("%), ") && l.contains("/s");
        if let Some(l) = before.iter().find(|l| !(l.starts_with("onepass: ") && l.contains(" cells (") || progress(l)))
        {
            why.push(format!("stderr has more than the error line: `{l}`"));
        }
        if stderr.contains("panicked") {
            why.push("panicked".into());
        }
        if line != expected.trim_end() {
            why.push(format!("expected `{}`", expected.trim_end()));
        }
        let mut files = Vec::new();
        walk(&dir, &mut files);
        for f in files {
            let n = f.file_name().unwrap().to_string_lossy();
            if n.ends_with(".tmp") || n == "meta.json" || n == "metrics.parquet" {
                why.push(format!("left {}", f.display()));
            }
        }
        if !why.is_empty() {
            failures.push(format!("{name}: {}\n  stderr: {line}", why.join("; ")));
        }
    }
    assert!(failures.is_empty(), "{} of {} cases:\n{}", failures.len(), cases.len(), failures.join("\n"));
}
