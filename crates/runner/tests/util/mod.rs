//! The test harness shared by the runner's integration tests: the `onepass` binary run in a
//! directory, small files written there, the model files the tests read, and parquet columns.
#![allow(dead_code)] // each test binary uses its own part of the harness

use arrow_array::{Array, Float64Array, StringArray, UInt32Array, UInt64Array};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use std::path::{Path, PathBuf};
use std::process::Command;

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
