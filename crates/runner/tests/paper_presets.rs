//! Every paper-* and reference-* preset, run end to end on a CPU in seconds: `--set` overrides swap
//! the hub's models for the tiny fixtures (a GGUF for φ and the policy; a safetensors directory
//! with a `score` head for a reward-model oracle), the hub's files for small files written here in
//! the same formats, and shrink rows, samples, chunks and n. Every other key of the presets stays
//! as written — formats, orders, selection, truncation, bf16 weights, ranks, the estimators'
//! settings, the active rules, the oracle's labels, the policy's LoRA settings — so each is proven
//! wired. `onepass report` then reads every run.
//!
//! The overrides are derived from the keys each preset has (the test reads its TOML): a preset
//! gaining a key that needs the hub or a GPU fails here until the test learns to shrink it.

use arrow_array::{ArrayRef, RecordBatch, StringArray};
use std::path::{Path, PathBuf};
use std::sync::Arc;

mod util;

/// The files the overrides point at.
struct Fixture {
    gguf: PathBuf,
    rm: PathBuf,
    train: PathBuf,
    test: PathBuf,
    prompts: PathBuf,
    order: PathBuf,
}

const TRAIN_ROWS: usize = 160;

fn borrow(v: &[Vec<(String, String)>]) -> Vec<Vec<(&str, Option<&str>)>> {
    v.iter().map(|c| c.iter().map(|(r, x)| (r.as_str(), Some(x.as_str()))).collect()).collect()
}

fn fixture(dir: &Path) -> Fixture {
    let gguf = util::tiny_gguf();
    // a reward model: the tiny Llama directory with a trained-looking `score.weight` [1, 32]
    let rm = dir.join("rm");
    util::tiny_model_dir(&rm);
    let w: Vec<u8> = (0..32).flat_map(|i| ((i as f32 - 15.5) / 16.0).to_le_bytes()).collect();
    let bytes = std::fs::read(rm.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, safetensors::tensor::TensorView<'_>)> = st.tensors();
    tensors.push((
        "score.weight".into(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1, 32], &w).unwrap(),
    ));
    safetensors::serialize_to_file(tensors, None, &rm.join("model.safetensors")).unwrap();
    // UltraFeedback-binarized (and Mixture2, the same message-list columns) train/test files
    let pairs = |n: usize, tag: &str| {
        let q: Vec<String> = (0..n).map(|i| format!("Question {tag}{i}: what is {i} plus {}?", i % 7)).collect();
        let good: Vec<String> = (0..n).map(|i| format!("It is {}.", i + i % 7)).collect();
        let bad: Vec<String> =
            (0..n).map(|i| format!("Maybe {} or so; hard to say{}", i * 3, "!".repeat(i % 4))).collect();
        (q, good, bad)
    };
    let write = |path: &Path, n: usize, tag: &str| {
        let (q, good, bad) = pairs(n, tag);
        let conv = |a: &[String]| -> Vec<Vec<(String, String)>> {
            q.iter().zip(a).map(|(q, a)| vec![("user".into(), q.clone()), ("assistant".into(), a.clone())]).collect()
        };
        let (good, bad) = (conv(&good), conv(&bad));
        // distinct scores: no ties for the score-based filters to drop
        let scores: Vec<(f64, f64)> = (0..n).map(|i| (7.0 + (i % 3) as f64, 2.0 + (i % 2) as f64)).collect();
        util::write_uf_scored(path, &borrow(&good), &borrow(&bad), &scores);
    };
    let train = dir.join("train_prefs-00000-of-00001.parquet");
    let test = dir.join("test_prefs-00000-of-00001.parquet");
    write(&train, TRAIN_ROWS, "t");
    write(&test, 40, "e");
    // test_gen-like prompts: a `prompt` column of strings
    let prompts = dir.join("test_gen-00000-of-00001.parquet");
    let p: Vec<String> = (0..24).map(|i| format!("Write one sentence about the number {i}.")).collect();
    let batch = RecordBatch::try_from_iter([("prompt", Arc::new(StringArray::from(p)) as ArrayRef)]).unwrap();
    let mut w =
        parquet::arrow::ArrowWriter::try_new(std::fs::File::create(&prompts).unwrap(), batch.schema(), None).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
    // a DistributedSampler-like order over the training rows (a fixed permutation)
    let order = dir.join("randperm.npy");
    let idx: Vec<i64> = (0..TRAIN_ROWS as i64).map(|i| (i * 37 + 11) % TRAIN_ROWS as i64).collect();
    std::fs::write(&order, util::npy_i64(&idx)).unwrap();
    Fixture { gguf, rm, train, test, prompts, order }
}

/// The `--set` arguments that make `preset` run here in seconds.
fn overrides(preset: &toml::Table, fx: &Fixture) -> Vec<String> {
    let has = |t: &str, k: &str| preset.get(t).and_then(|v| v.get(k)).is_some();
    let int = |t: &str, k: &str| preset.get(t).and_then(|v| v.get(k)).and_then(|v| v.as_integer());
    let p = |x: &Path| x.display().to_string();
    let mut s: Vec<String> = vec!["seeds=1".into()];
    let setting = preset["setting"].as_str().unwrap();
    if preset.contains_key("data") {
        s.push(format!("data.path={}", p(&fx.train)));
        if has("data", "eval_path") {
            s.push(format!("data.eval_path={}", p(&fx.test)));
        }
        if has("data", "eval_rows") {
            s.push("data.eval_rows=24".into());
        }
        s.push(format!("data.model={}", p(&fx.gguf)));
        s.push(format!("data.rows={TRAIN_ROWS}"));
        s.push("data.max_len=48".into());
        s.push("data.batch=8".into());
        // the preset's own device ("auto") runs on the CPU here
        let ranks = int("stream", "ranks").unwrap_or(1);
        let batch = int("stream", "batch_size").unwrap_or(1);
        let step = ranks * batch;
        let samples = if setting == "active" { 8 * step } else { 2 * step };
        s.push(format!("stream.samples={samples}"));
        s.push(format!("stream.eval_every={}", samples / 2));
        if has("env", "order_path") {
            s.push(format!("env.order_path={}", p(&fx.order)));
        }
        for (i, e) in preset.get("estimator").and_then(|v| v.as_array()).into_iter().flatten().enumerate() {
            // mle refits inside this short stream too
            if e.get("refit_every").is_some() {
                s.push(format!("estimator.{i}.refit_every={}", samples / 4));
            }
            if e.get("replay_every").is_some() {
                s.push(format!("estimator.{i}.replay_every={}", samples / 4));
            }
        }
    }
    if preset.contains_key("generate") {
        s.push(format!("generate.prompts={}", p(&fx.prompts)));
        s.push("generate.rows=8".into());
        s.push(format!("generate.policy={}", p(&fx.gguf)));
        s.push("generate.n=4".into());
        s.push("generate.max_new_tokens=6".into());
        s.push("generate.batch_prompts=2".into());
        s.push("generate.device=cpu".into());
        s.push(format!("features.model={}", p(&fx.gguf)));
        s.push("features.max_len=48".into());
        s.push("features.batch=8".into());
        s.push("features.device=cpu".into());
        if has("oracle", "model") {
            s.push(format!("oracle.model={}", p(&fx.rm)));
            s.push("oracle.max_len=48".into());
            s.push("oracle.device=cpu".into());
        }
        s.push("env.eval_pairs=40".into());
        s.push("deploy.chunks=2".into());
        s.push("stream.batch_size=2".into());
        if has("deploy", "q") {
            s.push("deploy.q=2".into());
        }
        if preset.contains_key("policy") {
            s.push("policy.eval_prompts=2".into());
            s.push("policy.minibatch=2".into());
        }
        let warm = preset.get("policy").and_then(|p| p.get("dpo")).and_then(|d| d.get("warm_start"));
        if warm.is_some() {
            s.push(format!("policy.dpo.warm_start.path={}", p(&fx.train)));
            s.push("policy.dpo.warm_start.rows=8".into());
        }
    }
    s
}

#[test]
fn every_paper_and_reference_preset_runs_on_a_cpu() {
    let tmp = tempfile::tempdir().unwrap();
    let fx = fixture(tmp.path());
    let root = util::root().join("experiments");
    let mut ran = Vec::new();
    let mut failures = Vec::new();
    for setting in ["passive", "active", "deploy"] {
        let mut files: Vec<PathBuf> = std::fs::read_dir(root.join(setting))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| {
                let n = p.file_name().unwrap().to_string_lossy();
                (n.starts_with("paper-") || n.starts_with("reference-")) && n.ends_with(".toml")
            })
            .collect();
        files.sort();
        for f in files {
            let name = format!("{setting}/{}", f.file_stem().unwrap().to_string_lossy());
            let preset: toml::Table = toml::from_str(&std::fs::read_to_string(&f).unwrap()).unwrap();
            let mut args: Vec<String> = vec!["run".into(), f.display().to_string(), "--out".into(), "out".into()];
            for o in overrides(&preset, &fx) {
                args.extend(["--set".into(), o]);
            }
            let r =
                util::finish(util::command().current_dir(tmp.path()).env("ONEPASS_PROGRESS_EVERY", "1000").args(&args));
            if r.code != 0 {
                failures.push(format!("{name}: exit {}: {}", r.code, r.stderr.trim()));
                continue;
            }
            let dir = tmp.path().join(r.dir());
            for t in ["meta.json", "metrics.parquet", "cells.parquet", "spec.resolved.toml"] {
                if !dir.join(t).exists() {
                    failures.push(format!("{name}: no {t}"));
                }
            }
            if preset.contains_key("policy") && !dir.join("policy.parquet").exists() {
                failures.push(format!("{name}: a learning policy arm and no policy.parquet"));
            }
            let cells = util::table(&dir.join("cells.parquet"));
            let bad: Vec<String> = util::strs(&cells, "status").into_iter().filter(|s| s != "ok").collect();
            if !bad.is_empty() {
                failures.push(format!("{name}: {} cells not ok: {}", bad.len(), r.stderr.trim()));
            }
            let rep = util::onepass(tmp.path(), &["report", dir.to_str().unwrap()]);
            if rep.code != 0 {
                failures.push(format!("{name}: report: {}", rep.stderr.trim()));
            }
            ran.push(name);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // the presets this test exists for (negative control: a renamed or lost preset is noticed)
    for must in ["passive/paper-llama", "passive/reference-llama-omd", "active/paper-llama", "deploy/paper-llama"] {
        assert!(ran.iter().any(|r| r == must), "{must} not run: {ran:?}");
    }
    assert!(ran.len() >= 10, "{ran:?}");
}
