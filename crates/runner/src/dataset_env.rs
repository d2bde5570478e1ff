//! `env.kind = "dataset"`: a preference dataset and a feature model named in the spec's `[data]`
//! table. The runner reads the pairs, selects rows, splits train/held-out with the preset's own
//! seed (so every run of a preset sees the same split), computes φ through the feature cache, and
//! hands the cells z = φ(chosen) − φ(rejected) with y = 1 (chosen first).

use crate::datasets::{expand_glob, read_dataset, Format, Keys, Pair, ReadOptions};
use crate::extract::{device, extract_pairs, PhiRun};
use crate::pairs::{PairData, Pairs};
use anyhow::{anyhow, Result};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// The `[data]` table.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSpec {
    /// The dataset: a file, a `*` pattern in the file name (several files read in name order), or
    /// `hf:datasets/<owner>/<name>[@rev]:<file or pattern>`. `${VAR}` and `${VAR:-default}` are
    /// expanded from the environment.
    pub path: String,
    /// Held-out pairs from other files (e.g. UltraFeedback test_prefs); default: a seeded split.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_path: Option<String>,
    #[serde(default = "d_format")]
    pub format: Format,
    /// Key names of the `generic` format.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keys: Option<Keys>,
    /// A malformed row (missing or null field, a conversation not ending with the assistant):
    /// an error naming file, row and field, or skipped and counted in meta.json.
    #[serde(default = "d_malformed")]
    pub malformed: Malformed,
    /// Pairs to use (default: every row of `path`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rows: Option<usize>,
    /// Which `rows`: the first ones (the authors' code) or a seeded random sample (the paper).
    #[serde(default = "d_select")]
    pub select: Select,
    #[serde(default)]
    pub select_seed: u64,
    /// Held-out share of the selected pairs when there is no `eval_path`.
    #[serde(default = "d_eval_fraction")]
    pub eval_fraction: f64,
    /// Seed of the train/held-out split (part of the preset, not of the run's seeds).
    #[serde(default)]
    pub split_seed: u64,
    /// Held-out pairs to use from `eval_path` (default: all).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_rows: Option<usize>,
    /// Pairs whose two sides became the same tokens (z = 0): dropped (counted) or kept.
    #[serde(default = "d_degenerate")]
    pub degenerate: Degenerate,
    /// Pairs whose two sides have the same score (UltraFeedback): kept (default: the dataset as
    /// published) or dropped; counted either way.
    #[serde(default = "d_score_ties")]
    pub score_ties: ScoreTies,
    /// The feature model: a .gguf file, a model directory or hf:<owner>/<name>.
    pub model: String,
    #[serde(default = "d_max_len")]
    pub max_len: usize,
    #[serde(default = "d_eos_rule")]
    pub eos_rule: features::EosRule,
    #[serde(default = "d_truncation")]
    pub truncation: features::Truncation,
    #[serde(default = "d_layer")]
    pub layer: i64,
    #[serde(default = "d_pool")]
    pub pool: features::Pool,
    /// f32, bf16 or f16.
    #[serde(default = "d_dtype")]
    pub dtype: String,
    /// cpu, cuda, metal or auto.
    #[serde(default = "d_device")]
    pub device: String,
    #[serde(default = "d_batch")]
    pub batch: usize,
    #[serde(default = "d_cache")]
    pub cache: PathBuf,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Malformed {
    Error,
    Skip,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Select {
    First,
    Random,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Degenerate {
    Drop,
    Keep,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ScoreTies {
    Keep,
    Drop,
}

fn d_score_ties() -> ScoreTies {
    ScoreTies::Keep
}
fn d_format() -> Format {
    Format::Auto
}
fn d_malformed() -> Malformed {
    Malformed::Error
}
fn d_select() -> Select {
    Select::First
}
fn d_eval_fraction() -> f64 {
    0.2
}
fn d_degenerate() -> Degenerate {
    Degenerate::Drop
}
fn d_max_len() -> usize {
    1024
}
fn d_eos_rule() -> features::EosRule {
    features::EosRule::Reference
}
fn d_truncation() -> features::Truncation {
    features::Truncation::PromptFirst
}
fn d_layer() -> i64 {
    -1
}
fn d_pool() -> features::Pool {
    features::Pool::Last
}
fn d_dtype() -> String {
    "f32".into()
}
fn d_device() -> String {
    "cpu".into()
}
fn d_batch() -> usize {
    8
}
fn d_cache() -> PathBuf {
    PathBuf::from(".cache/features")
}

/// `${VAR}` and `${VAR:-default}` from the environment; an unset variable without a default is
/// an error naming it.
pub fn expand_env(s: &str) -> Result<String, String> {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find("${") {
        out.push_str(&rest[..i]);
        let close = rest[i..].find('}').ok_or_else(|| format!("`{s}`: `${{` without a closing `}}`"))? + i;
        let inner = &rest[i + 2..close];
        let (name, default) = match inner.split_once(":-") {
            Some((n, d)) => (n, Some(d)),
            None => (inner, None),
        };
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(format!("`{s}`: `${{{inner}}}` is not a variable name"));
        }
        match (std::env::var(name).ok().filter(|v| !v.is_empty()), default) {
            (Some(v), _) => out.push_str(&v),
            (None, Some(d)) => out.push_str(d),
            (None, None) => return Err(format!("`{s}`: the environment variable {name} is not set")),
        }
        rest = &rest[close + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

impl DataSpec {
    /// Checks that need no file: (key, message).
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        if !(self.eval_fraction > 0.0 && self.eval_fraction < 1.0) {
            return Err((
                "eval_fraction",
                format!("{}: expected a share strictly between 0 and 1", self.eval_fraction),
            ));
        }
        if self.rows == Some(0) || self.eval_rows == Some(0) {
            return Err(("rows", "expected at least 1 pair".into()));
        }
        if self.batch == 0 {
            return Err(("batch", "expected at least 1".into()));
        }
        if self.max_len < 8 {
            return Err(("max_len", format!("{}: expected at least 8 tokens", self.max_len)));
        }
        if !["f32", "bf16", "f16"].contains(&self.dtype.as_str()) {
            return Err(("dtype", format!("`{}`: expected f32, bf16 or f16", self.dtype)));
        }
        if !["cpu", "cuda", "metal", "auto"].contains(&self.device.as_str()) {
            return Err(("device", format!("`{}`: expected cpu, cuda, metal or auto", self.device)));
        }
        expand_env(&self.path).map_err(|m| ("path", m))?;
        if self.keys.is_some() && self.format != Format::Generic {
            return Err(("keys", "only the `generic` format reads key names: set data.format = \"generic\"".into()));
        }
        if let Some(e) = &self.eval_path {
            expand_env(e).map_err(|m| ("eval_path", m))?;
        }
        Ok(())
    }
}

/// What was read, selected, split, dropped and computed (meta.json's `data` block).
#[derive(Clone, Debug, Serialize)]
pub struct DataReport {
    pub path: String,
    /// Every file read (a pattern or hub dataset may name several); `blake3` covers them all.
    pub files: Vec<String>,
    pub blake3: String,
    pub eval_path: Option<String>,
    pub eval_files: Vec<String>,
    /// Pairs read from `files` (after skipping malformed rows).
    pub rows_read: usize,
    /// Malformed rows skipped (`data.malformed = "skip"`), over all files, and the first reasons.
    pub malformed_skipped: usize,
    pub malformed_examples: Vec<String>,
    /// Held-out pairs whose two conversations also occur in the training pairs.
    pub eval_in_train: usize,
    pub selected: usize,
    pub train_pairs: usize,
    pub eval_pairs: usize,
    pub degenerate_train: usize,
    pub degenerate_eval: usize,
    pub degenerate_dropped: bool,
    /// Selected pairs (train + held out) whose sides have equal scores, and whether they were dropped.
    pub score_ties: usize,
    pub score_ties_dropped: bool,
    pub truncated_sequences: usize,
    pub response_cut_sequences: usize,
    pub model: String,
    pub weights_blake3: String,
    pub cache_space: String,
    pub cache_hits: usize,
    pub cache_misses: usize,
    pub tokens_computed: usize,
    /// Tokens of the kept training and held-out sequences (both sides), for the cost model.
    pub train_tokens: usize,
    pub eval_tokens: usize,
    pub extraction_s: f64,
    pub dim: usize,
}

fn file_blake3(p: &std::path::Path) -> Result<String> {
    let f = std::fs::File::open(p).map_err(|e| anyhow!("{}: {e}", p.display()))?;
    let mut h = blake3::Hasher::new();
    h.update_reader(f).map_err(|e| anyhow!("{}: {e}", p.display()))?;
    Ok(h.finalize().to_hex().to_string())
}

/// The files a `path` names (local file or pattern, or hub dataset files).
pub fn resolve_files(key: &str, raw: &str) -> Result<Vec<PathBuf>> {
    let s = expand_env(raw).map_err(|m| anyhow!("data.{key}: {m}"))?;
    match s.strip_prefix("hf:datasets/") {
        Some(rest) => {
            let spec = features::hub::HubDataset::parse(rest).map_err(|e| anyhow!("data.{key}: {e}"))?;
            features::hub::dataset_files(&spec, &features::hub::HubEnv::from_env())
                .map_err(|e| anyhow!("data.{key}: {e}"))
        }
        None => expand_glob(std::path::Path::new(&s)).map_err(|e| anyhow!("data.{key}: {e:#}")),
    }
}

fn files_blake3(files: &[PathBuf]) -> Result<String> {
    if files.len() == 1 {
        return file_blake3(&files[0]);
    }
    let mut h = blake3::Hasher::new();
    for f in files {
        h.update(file_blake3(f)?.as_bytes());
    }
    Ok(h.finalize().to_hex().to_string())
}

fn display_files(files: &[PathBuf]) -> String {
    match files {
        [one] => one.display().to_string(),
        many => format!("{} (+{} files)", many[0].display(), many.len() - 1),
    }
}

/// Pairs whose (chosen, rejected) conversations are the same: held-out rows also in training.
fn overlap(train: &[Pair], eval: &[Pair]) -> usize {
    let key = |p: &Pair| {
        let mut h = blake3::Hasher::new();
        for m in p.chosen.iter().chain(&p.rejected) {
            for s in [&m.role, &m.content] {
                h.update(&(s.len() as u64).to_le_bytes());
                h.update(s.as_bytes());
            }
        }
        *h.finalize().as_bytes()
    };
    let seen: std::collections::HashSet<[u8; 32]> = train.iter().map(key).collect();
    eval.iter().filter(|p| seen.contains(&key(p))).count()
}

/// Reads, selects, splits and extracts: the pairs every cell of the run shares.
pub fn load(d: &DataSpec, progress: bool) -> Result<(PairData, DataReport)> {
    let files = resolve_files("path", &d.path)?;
    let path = files[0].clone();
    let opts = ReadOptions {
        format: Some(d.format),
        keys: d.keys.clone().unwrap_or_default(),
        limit: None,
        skip_malformed: d.malformed == Malformed::Skip,
    };
    let read = read_dataset(&files, &opts)?;
    let (mut skipped, mut skipped_examples) = (read.skipped, read.skipped_examples);
    let all = read.pairs;
    let rows_read = all.len();
    let take = d.rows.unwrap_or(rows_read);
    if take > rows_read {
        return Err(anyhow!("data.rows = {take}, but {} holds only {rows_read} pairs", display_files(&files)));
    }
    let mut selected: Vec<Pair> = match d.select {
        Select::First => all.into_iter().take(take).collect(),
        Select::Random => {
            let mut idx: Vec<usize> = (0..rows_read).collect();
            idx.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(d.select_seed));
            let mut keep: Vec<usize> = idx.into_iter().take(take).collect();
            keep.sort_unstable();
            let mut all: Vec<Option<Pair>> = all.into_iter().map(Some).collect();
            keep.into_iter().map(|i| all[i].take().expect("distinct")).collect()
        }
    };
    let (train, eval, eval_file) = match &d.eval_path {
        Some(e) => {
            let ef = resolve_files("eval_path", e)?;
            let r = read_dataset(&ef, &ReadOptions { limit: d.eval_rows, ..opts.clone() })?;
            skipped += r.skipped;
            skipped_examples.extend(r.skipped_examples);
            let mut ev = r.pairs;
            if let Some(n) = d.eval_rows {
                if ev.len() < n {
                    return Err(anyhow!(
                        "data.eval_rows = {n}, but {} holds only {} pairs",
                        display_files(&ef),
                        ev.len()
                    ));
                }
            }
            ev.truncate(d.eval_rows.unwrap_or(ev.len()));
            (std::mem::take(&mut selected), ev, Some(ef))
        }
        None => {
            let n_eval = ((selected.len() as f64) * d.eval_fraction).round() as usize;
            if n_eval == 0 || n_eval >= selected.len() {
                return Err(anyhow!(
                    "data.eval_fraction = {} of {} pairs leaves an empty side of the split",
                    d.eval_fraction,
                    selected.len()
                ));
            }
            let mut idx: Vec<usize> = (0..selected.len()).collect();
            idx.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(d.split_seed));
            let mut is_eval = vec![false; selected.len()];
            for &i in &idx[..n_eval] {
                is_eval[i] = true;
            }
            let (mut tr, mut ev) = (Vec::new(), Vec::new());
            for (p, e) in selected.into_iter().zip(is_eval) {
                if e {
                    ev.push(p)
                } else {
                    tr.push(p)
                }
            }
            (tr, ev, None)
        }
    };
    let score_ties = train.iter().chain(&eval).filter(|p| p.score_tie()).count();
    let eval_in_train = overlap(&train, &eval);
    let (train, eval): (Vec<Pair>, Vec<Pair>) = if d.score_ties == ScoreTies::Drop {
        (train.into_iter().filter(|p| !p.score_tie()).collect(), eval.into_iter().filter(|p| !p.score_tie()).collect())
    } else {
        (train, eval)
    };
    let dtype = match d.dtype.as_str() {
        "bf16" => candle_core::DType::BF16,
        "f16" => candle_core::DType::F16,
        _ => candle_core::DType::F32,
    };
    let run = PhiRun {
        model: d.model.clone(),
        cache: d.cache.clone(),
        batch: d.batch,
        phi: features::PhiOptions {
            max_len: d.max_len,
            eos_rule: d.eos_rule,
            truncation: d.truncation,
            layer: d.layer,
            pool: d.pool,
        },
        dtype,
        device: device(&d.device)?,
        progress,
        shard: features::ShardSpec::ALL,
    };
    // one extraction over both splits, so they share a batch plan and a progress bar
    let n_train = train.len();
    let both: Vec<Pair> = train.into_iter().chain(eval).collect();
    let origin = match &eval_file {
        Some(e) => format!("{} + {}", display_files(&files), display_files(e)),
        None => display_files(&files),
    };
    let ex = extract_pairs(&both, &origin, &run)?;
    let dim = ex.summary.dim;
    let drop = d.degenerate == Degenerate::Drop;
    let build = |range: std::ops::Range<usize>| -> Pairs {
        let mut z = Vec::new();
        let mut y = Vec::new();
        for i in range {
            if drop && ex.degenerate[i] {
                continue;
            }
            let (c, r) = (ex.phi[2 * i].as_ref().expect("all rows"), ex.phi[2 * i + 1].as_ref().expect("all rows"));
            z.extend(c.iter().zip(r).map(|(a, b)| a - b));
            y.push(1.0);
        }
        Pairs { d: dim, z, y, digest: String::new() }
    };
    let kept_tokens = |range: std::ops::Range<usize>| -> usize {
        range.filter(|&i| !(drop && ex.degenerate[i])).map(|i| ex.lengths[2 * i] + ex.lengths[2 * i + 1]).sum()
    };
    let (train_tokens, eval_tokens) = (kept_tokens(0..n_train), kept_tokens(n_train..both.len()));
    let digest = files_blake3(&files)?;
    let mut tr = build(0..n_train);
    let mut ev = build(n_train..both.len());
    tr.digest = digest.clone();
    ev.digest = match &eval_file {
        Some(e) => files_blake3(e)?,
        None => digest.clone(),
    };
    if tr.is_empty() || ev.is_empty() {
        return Err(anyhow!("{origin}: after dropping degenerate pairs, a side of the split is empty"));
    }
    let report = DataReport {
        path: path.display().to_string(),
        files: files.iter().map(|f| f.display().to_string()).collect(),
        blake3: digest,
        eval_path: eval_file.as_ref().map(|e| e[0].display().to_string()),
        eval_files: eval_file.iter().flatten().map(|f| f.display().to_string()).collect(),
        rows_read,
        malformed_skipped: skipped,
        malformed_examples: skipped_examples,
        eval_in_train,
        selected: take,
        train_pairs: tr.len(),
        eval_pairs: ev.len(),
        degenerate_train: ex.degenerate[..n_train].iter().filter(|&&x| x).count(),
        degenerate_eval: ex.degenerate[n_train..].iter().filter(|&&x| x).count(),
        degenerate_dropped: drop,
        score_ties,
        score_ties_dropped: d.score_ties == ScoreTies::Drop,
        truncated_sequences: ex.summary.truncated_sequences,
        response_cut_sequences: ex.summary.response_cut_sequences,
        model: ex.source.clone(),
        weights_blake3: ex.weights_blake3.clone(),
        cache_space: ex.summary.space.clone(),
        cache_hits: ex.summary.hits,
        cache_misses: ex.summary.misses,
        tokens_computed: ex.summary.tokens,
        train_tokens,
        eval_tokens,
        extraction_s: ex.summary.forward_s,
        dim,
    };
    let data = PairData {
        d: dim,
        train: tr,
        eval: ev,
        train_path: path,
        eval_path: eval_file.map(|e| e[0].clone()),
        report: None,
        train_origin: (0..n_train).filter(|&i| !(drop && ex.degenerate[i])).collect(),
        train_total: n_train,
        order: None,
    };
    Ok((data, report))
}

#[cfg(test)]
mod tests {
    use super::expand_env;

    #[test]
    fn env_expansion() {
        std::env::set_var("ONEPASS_TEST_EXPAND", "/data");
        assert_eq!(expand_env("${ONEPASS_TEST_EXPAND}/hh.jsonl").unwrap(), "/data/hh.jsonl");
        assert_eq!(expand_env("${ONEPASS_TEST_EXPAND:-x}/a").unwrap(), "/data/a");
        assert_eq!(expand_env("${ONEPASS_TEST_UNSET_VAR:-../shared}/a").unwrap(), "../shared/a");
        assert_eq!(expand_env("plain/path").unwrap(), "plain/path");
        assert!(expand_env("${ONEPASS_TEST_UNSET_VAR}/a").unwrap_err().contains("ONEPASS_TEST_UNSET_VAR is not set"));
        assert!(expand_env("${oops").unwrap_err().contains("closing"));
        assert!(expand_env("${a b}").unwrap_err().contains("not a variable name"));
    }
}
