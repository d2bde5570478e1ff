//! The test harness shared by the runner's integration tests: the `onepass` binary run in a
//! directory, small files written there, the model files the tests read, and parquet columns.
#![allow(dead_code)] // each test binary uses its own part of the harness

use arrow_array::builder::{ListBuilder, StringBuilder, StructBuilder};
use arrow_array::{Array, ArrayRef, Float64Array, RecordBatch, StringArray, UInt32Array, UInt64Array};
use arrow_schema::{DataType, Field, Fields};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

/// What a finished `onepass` process left.
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    /// The run directory `onepass run` printed last, whatever its exit code (1: a cell failed).
    pub fn dir_any(&self) -> PathBuf {
        PathBuf::from(self.stdout.trim().lines().last().unwrap_or_else(|| panic!("no run directory:\n{}", self.stderr)))
    }

    /// The run directory a successful `onepass run` printed last.
    pub fn dir(&self) -> PathBuf {
        assert_eq!(self.code, 0, "onepass failed:\n{}", self.stderr);
        PathBuf::from(self.stdout.trim().lines().last().expect("a run directory"))
    }
}

/// The `onepass` binary, ready to take arguments and environment variables.
pub fn command() -> Command {
    Command::new(env!("CARGO_BIN_EXE_onepass"))
}

/// Runs `onepass ARGS` in `dir`.
pub fn onepass(dir: &Path, args: &[&str]) -> Run {
    finish(command().current_dir(dir).args(args))
}

/// Runs a prepared command to its end.
pub fn finish(cmd: &mut Command) -> Run {
    let out = cmd.output().expect("starting onepass");
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Writes `text` to `dir/name` and returns the path.
pub fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// The workspace root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// SmolLM2-135M-Instruct's GGUF, as `just fetch-models` puts it under models/.
pub fn smollm2() -> String {
    let p = root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(p.exists(), "{} is missing: run `just fetch-models` first", p.display());
    p.to_string_lossy().into_owned()
}

/// The tiny random Llama GGUF of the features tests (a byte-level BPE tokenizer).
pub fn tiny_gguf() -> PathBuf {
    root().join("crates/features/tests/fixtures/tiny-llama-bpe.gguf")
}

/// A small parquet table, read whole (one record batch).
pub fn table(path: &Path) -> arrow_array::RecordBatch {
    let f = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let r = ParquetRecordBatchReaderBuilder::try_new(f).unwrap().build().unwrap();
    let mut batches: Vec<_> = r.map(|b| b.unwrap()).collect();
    assert_eq!(batches.len(), 1, "{}: small tables are one batch", path.display());
    batches.remove(0)
}

fn col<'a, T: 'static>(b: &'a arrow_array::RecordBatch, c: &str) -> &'a T {
    b.column_by_name(c).unwrap_or_else(|| panic!("no column {c}")).as_any().downcast_ref::<T>().unwrap()
}

pub fn f64s(b: &arrow_array::RecordBatch, c: &str) -> Vec<f64> {
    col::<Float64Array>(b, c).values().to_vec()
}
/// A nullable f64 column (None where null).
pub fn opt_f64s(b: &arrow_array::RecordBatch, c: &str) -> Vec<Option<f64>> {
    use arrow_array::Array;
    let a = col::<Float64Array>(b, c);
    (0..a.len()).map(|i| (!a.is_null(i)).then(|| a.value(i))).collect()
}
/// A boolean column.
pub fn bools(b: &arrow_array::RecordBatch, c: &str) -> Vec<bool> {
    let a = col::<arrow_array::BooleanArray>(b, c);
    (0..a.len()).map(|i| a.value(i)).collect()
}
pub fn u64s(b: &arrow_array::RecordBatch, c: &str) -> Vec<u64> {
    col::<UInt64Array>(b, c).values().to_vec()
}
pub fn u32s(b: &arrow_array::RecordBatch, c: &str) -> Vec<u32> {
    col::<UInt32Array>(b, c).values().to_vec()
}
pub fn strs(b: &arrow_array::RecordBatch, c: &str) -> Vec<String> {
    let a = col::<StringArray>(b, c);
    (0..a.len()).map(|i| a.value(i).to_string()).collect()
}

/// blake3 of a file's bytes (hex).
pub fn digest(path: &Path) -> String {
    blake3::hash(&std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).to_hex().to_string()
}

impl Run {
    /// (exit code, stdout, stderr).
    pub fn parts(self) -> (i32, String, String) {
        (self.code, self.stdout, self.stderr)
    }
}

/// The features crate's test fixtures (tiny models).
pub fn fixtures() -> PathBuf {
    root().join("crates/features/tests/fixtures")
}

/// Copies a directory tree.
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let t = e.file_type().unwrap();
        if t.is_file() {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        } else if t.is_dir() {
            copy_dir(&e.path(), &to.join(e.file_name()));
        }
    }
}

/// A transformers-layout model directory at `m`: the tiny Llama fixture (safetensors, d = 32)
/// with a WordLevel tokenizer and a ChatML-like template.
pub fn tiny_model_dir(m: &Path) {
    copy_dir(&fixtures().join("tiny-llama"), m);
    let vocab = serde_json::json!({"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "Hi?": 3, "Hello.": 4});
    let tok = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    });
    std::fs::write(m.join("tokenizer.json"), tok.to_string()).unwrap();
    let template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}";
    let tc = serde_json::json!({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": template});
    std::fs::write(m.join("tokenizer_config.json"), tc.to_string()).unwrap();
}

/// A list<struct<content, role>> column (UltraFeedback's and Mixture2's message lists).
pub fn messages(rows: &[Vec<(&str, Option<&str>)>]) -> ArrayRef {
    let fields =
        Fields::from(vec![Field::new("content", DataType::Utf8, true), Field::new("role", DataType::Utf8, true)]);
    let mut b = ListBuilder::new(StructBuilder::new(
        fields.clone(),
        vec![Box::new(StringBuilder::new()), Box::new(StringBuilder::new())],
    ))
    .with_field(Arc::new(Field::new("item", DataType::Struct(fields), true)));
    for row in rows {
        for (role, content) in row {
            let s = b.values();
            s.field_builder::<StringBuilder>(0).unwrap().append_option(*content);
            s.field_builder::<StringBuilder>(1).unwrap().append_value(role);
            s.append(true);
        }
        b.append(true);
    }
    Arc::new(b.finish())
}

/// An UltraFeedback-binarized parquet (zstd, as the hub's files): prompt, prompt_id, chosen,
/// rejected (message lists), score_chosen, score_rejected.
pub fn write_uf_scored(
    path: &std::path::Path,
    chosen: &[Vec<(&str, Option<&str>)>],
    rejected: &[Vec<(&str, Option<&str>)>],
    scores: &[(f64, f64)],
) {
    let n = chosen.len();
    let batch = RecordBatch::try_from_iter([
        ("prompt", Arc::new(StringArray::from(vec!["p"; n])) as ArrayRef),
        ("prompt_id", Arc::new(StringArray::from(vec!["id"; n])) as ArrayRef),
        ("chosen", messages(chosen)),
        ("rejected", messages(rejected)),
        ("score_chosen", Arc::new(Float64Array::from(scores.iter().map(|s| s.0).collect::<Vec<_>>())) as ArrayRef),
        ("score_rejected", Arc::new(Float64Array::from(scores.iter().map(|s| s.1).collect::<Vec<_>>())) as ArrayRef),
    ])
    .unwrap();
    let props = WriterProperties::builder().set_compression(Compression::ZSTD(ZstdLevel::default())).build();
    let mut w = ArrowWriter::try_new(std::fs::File::create(path).unwrap(), batch.schema(), Some(props)).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
}

/// One record batch as a parquet file (uncompressed).
pub fn write_parquet(path: &Path, batch: &RecordBatch) {
    let mut w = ArrowWriter::try_new(std::fs::File::create(path).unwrap(), batch.schema(), None).unwrap();
    w.write(batch).unwrap();
    w.close().unwrap();
}

/// A .npy of int64 as numpy writes it (header padded to a multiple of 64 bytes).
pub fn npy_i64(v: &[i64]) -> Vec<u8> {
    let mut h = format!("{{'descr': '<i8', 'fortran_order': False, 'shape': ({},), }}", v.len());
    while (10 + h.len() + 1) % 64 != 0 {
        h.push(' ');
    }
    h.push('\n');
    let mut b = b"\x93NUMPY\x01\x00".to_vec();
    b.extend_from_slice(&(h.len() as u16).to_le_bytes());
    b.extend_from_slice(h.as_bytes());
    for x in v {
        b.extend_from_slice(&x.to_le_bytes());
    }
    b
}

/// Every file of a run directory that does not hold wall-clock times (timings.parquet,
/// policy_timings.parquet, meta.json and the TensorBoard event files under tb/ do), by path
/// relative to it.
pub fn result_files(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    fn walk(root: &Path, d: &Path, out: &mut Vec<(PathBuf, Vec<u8>)>) {
        for e in std::fs::read_dir(d).unwrap() {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            if p.is_dir() {
                if d == root && name == "tb" {
                    continue;
                }
                walk(root, &p, out);
            } else if !["timings.parquet", "policy_timings.parquet", "meta.json", ".lock"].contains(&name.as_str()) {
                out.push((p.strip_prefix(root).unwrap().to_path_buf(), std::fs::read(&p).unwrap()));
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

/// Deployment on the synthetic bandit: omd-exact and mle × ucb, best-quantile and random-pair ×
/// 2 seeds (12 cells), checkpointed every 5 steps (resume.rs, slices.rs).
pub const SYNTHETIC_DEPLOY: &str = r#"
setting = "deploy"
seeds = 2
[env]
dim = 5
contexts = 12
arms = 6
eval_pairs = 100
[stream]
samples = 120
batch_size = 2
eval_every = 40
[deploy]
strategies = ["ucb", "best-quantile", "random-pair"]
[checkpoint]
every_steps = 5
[[estimator]]
kind = "omd-exact"
[[estimator]]
kind = "mle"
"#;

/// `prompts.jsonl` in `dir`: nine short prompts ({"prompt": …}) for the online-loop tests on the
/// tiny model.
pub fn write_prompts(dir: &Path) {
    let prompts: String = [
        "Say hi.",
        "Count to three.",
        "Name a colour.",
        "Why is the sky blue?",
        "A joke, please.",
        "Tell me a fact.",
        "What is rain?",
        "Spell cat.",
        "Pick a number.",
    ]
    .iter()
    .map(|p| format!("{}\n", serde_json::json!({ "prompt": p })))
    .collect();
    std::fs::write(dir.join("prompts.jsonl"), prompts).unwrap();
}

/// The head of an online spec on the tiny random Llama GGUF ([`tiny_gguf`]) — policy, φ model,
/// The tables an online test appends to [`tiny_world`]: two chunks, best-quantile pairs, best-of-n
/// beside an rloo policy (rank-2 adapters on every linear layer, 3 held-out prompts), sgd's θ.
pub const TINY_RLOO: &str = r#"
[deploy]
chunks = 2
strategies = ["best-quantile"]
q = 2
policy = ["best-of-n", "rloo"]
[policy]
rank = 2
alpha = 4.0
targets = "all-linear"
lr = 0.01
epochs = 1
minibatch = 4
eval_prompts = 3
[policy.rloo]
kl_coef = 0.05
[[estimator]]
kind = "sgd"
lr = 0.1
"#;

/// 6 training prompts of [`write_prompts`], n = 3, ≤ 5 new tokens, a linear oracle, batches of
/// 2, caches under `cache/` — up to `[stream]`; a test appends its `[deploy]`, `[policy]` and
/// `[[estimator]]` tables.
pub fn tiny_world(seeds: u32, eval_pairs: u32) -> String {
    format!(
        r#"
setting = "deploy"
seeds = {seeds}
[env]
kind = "generated"
eval_pairs = {eval_pairs}
[generate]
prompts = "prompts.jsonl"
rows = 6
policy = "{g}"
n = 3
max_new_tokens = 5
batch_prompts = 2
cache = "cache/gen"
[features]
model = "{g}"
max_len = 64
cache = "cache/phi"
[oracle]
kind = "linear"
seed = 3
[stream]
batch_size = 2
"#,
        g = tiny_gguf().display()
    )
}
