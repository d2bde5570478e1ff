//! `env.kind = "dataset"`: a preference dataset and a feature model named in the spec's `[data]`
//! table. The runner reads the pairs, selects rows, splits train/held-out with the preset's own
//! seed (so every run of a preset sees the same split), computes φ through the feature cache, and
//! hands the cells z = φ(chosen) − φ(rejected) with y = 1 (chosen first).

use super::datasets::{expand_glob, read_dataset, Pair, ReadOptions};
use super::extract::{extract_pairs, PhiRun};
use super::pairs::{PairData, PairIds, Pairs};
use crate::progress::Mode;
use crate::spec::data::{expand_env, Degenerate, Malformed, ScoreTies, Select};
use crate::spec::DataSpec;
use anyhow::{anyhow, Result};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::Serialize;
use std::path::PathBuf;

/// What was read, selected, split, dropped and computed (meta.json's `data` block).
#[derive(Clone, Debug, Serialize)]
pub struct DataReport {
    pub path: String,
    /// Every file read (a pattern or hub dataset may name several); `blake3` covers them all.
    pub files: Vec<String>,
    pub blake3: String,
    pub eval_path: Option<String>,
    pub eval_files: Vec<String>,
    /// Rows read from `files` (kept and skipped malformed ones), and the pairs they gave (one
    /// per row, or what the ranked form's rule makes of a row).
    pub rows_read: usize,
    pub pairs_read: usize,
    /// Malformed rows skipped (`data.malformed = "skip"`), over all files, and the first reasons.
    pub malformed_skipped: usize,
    pub malformed_examples: Vec<String>,
    /// Held-out pairs whose two conversations also occur in the training pairs.
    pub eval_in_train: usize,
    /// Pairs selected (`data.rows` counts pairs).
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
    /// The ranked form: prompts with pairs, pairs per prompt and the score gaps of the pairs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ranked: Option<serde_json::Value>,
}

/// Pairs per prompt and score gaps (chosen − rejected) of the ranked form's pairs, as read.
fn ranked_summary(pairs: &[Pair]) -> serde_json::Value {
    let mut per: Vec<usize> = Vec::new();
    let mut last = None;
    for p in pairs {
        if last != Some(p.row) {
            per.push(0);
            last = Some(p.row);
        }
        *per.last_mut().expect("pushed") += 1;
    }
    let mut gaps: Vec<f64> = pairs.iter().filter_map(|p| p.scores.map(|(c, r)| c - r)).collect();
    gaps.sort_by(f64::total_cmp);
    let stat = |v: &[f64]| {
        if v.is_empty() {
            return serde_json::Value::Null;
        }
        serde_json::json!({
            "min": v[0], "median": v[(v.len() - 1) / 2], "mean": v.iter().sum::<f64>() / v.len() as f64,
            "max": v[v.len() - 1],
        })
    };
    let per_f: Vec<f64> = {
        let mut x: Vec<f64> = per.iter().map(|&n| n as f64).collect();
        x.sort_by(f64::total_cmp);
        x
    };
    serde_json::json!({"prompts": per.len(), "pairs": pairs.len(), "pairs_per_prompt": stat(&per_f), "score_gap": stat(&gaps)})
}

fn file_blake3(p: &std::path::Path) -> Result<String> {
    let f = std::fs::File::open(p).map_err(|e| anyhow!("{}: {e}", p.display()))?;
    let mut h = blake3::Hasher::new();
    h.update_reader(f).map_err(|e| anyhow!("{}: {e}", p.display()))?;
    Ok(h.finalize().to_hex().to_string())
}

/// The files a `path` names (local file or pattern, or hub dataset files); errors name `key`
/// (its full path in the spec, e.g. `data.path`).
pub fn resolve_files(key: &str, raw: &str) -> Result<Vec<PathBuf>> {
    let s = expand_env(raw).map_err(|m| anyhow!("{key}: {m}"))?;
    match s.strip_prefix("hf:datasets/") {
        Some(rest) => {
            let spec = features::hub::HubDataset::parse(rest).map_err(|e| anyhow!("{key}: {e}"))?;
            features::hub::dataset_files(&spec, &features::hub::HubEnv::from_env()).map_err(|e| anyhow!("{key}: {e}"))
        }
        None => expand_glob(std::path::Path::new(&s)).map_err(|e| anyhow!("{key}: {e:#}")),
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
/// `keep_ids`: keep each pair's token ids ([`PairData::ids`]) for a reward model whose features
/// learn.
pub fn load(d: &DataSpec, progress: Mode, keep_ids: bool) -> Result<(PairData, DataReport)> {
    let files = resolve_files("data.path", &d.path)?;
    let path = files[0].clone();
    let opts = ReadOptions {
        format: Some(d.format),
        keys: d.keys.clone().unwrap_or_default(),
        limit: None,
        skip_malformed: d.malformed == Malformed::Skip,
    };
    let read = read_dataset(&files, &opts)?;
    let ranked = opts.keys.responses.is_some() && opts.format == Some(crate::spec::Format::Generic);
    let ranked_report = ranked.then(|| ranked_summary(&read.pairs));
    let (mut skipped, mut skipped_examples) = (read.skipped, read.skipped_examples);
    let rows_in_files = read.rows_read;
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
            let ef = resolve_files("data.eval_path", e)?;
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
            let mut is_eval = vec![false; selected.len()];
            if ranked {
                // the ranked form makes several pairs of one prompt: a prompt's pairs go to the
                // same side, so no held-out prompt was trained on
                let mut per_row: std::collections::HashMap<usize, usize> = std::collections::HashMap::new();
                for p in &selected {
                    *per_row.entry(p.row).or_default() += 1;
                }
                let mut rows: Vec<usize> = selected.iter().map(|p| p.row).collect();
                rows.dedup();
                rows.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(d.split_seed));
                let mut held = std::collections::HashSet::new();
                let mut count = 0;
                for r in rows {
                    if count >= n_eval {
                        break;
                    }
                    held.insert(r);
                    count += per_row[&r];
                }
                for (e, p) in is_eval.iter_mut().zip(&selected) {
                    *e = held.contains(&p.row);
                }
            } else {
                let mut idx: Vec<usize> = (0..selected.len()).collect();
                idx.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(d.split_seed));
                for &i in &idx[..n_eval] {
                    is_eval[i] = true;
                }
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
    let run = PhiRun { keep_ids, ..PhiRun::new(&d.phi(), progress)? };
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
            y.push(both[i].y());
        }
        Pairs { d: dim, z, y, digest: String::new() }
    };
    let ids = |range: std::ops::Range<usize>| -> Vec<(Vec<u32>, Vec<u32>)> {
        range
            .filter(|&i| !(drop && ex.degenerate[i]))
            .map(|i| (ex.ids[2 * i].clone(), ex.ids[2 * i + 1].clone()))
            .collect()
    };
    let ids = keep_ids.then(|| PairIds { train: ids(0..n_train), eval: ids(n_train..both.len()) });
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
        rows_read: rows_in_files,
        pairs_read: rows_read,
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
        ranked: ranked_report,
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
        ids,
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
