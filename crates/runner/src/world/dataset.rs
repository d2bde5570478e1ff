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
    let f = std::fs::File::open(p).map_err(|e| anyhow!("{}: {}", p.display(), crate::io::io_message(p, &e)))?;
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
/// learn. Four steps: [`read_selected`], [`split`], [`extract_pairs`] (φ through the cache) and
/// [`assemble`] (z, y, ids and the report).
pub fn load(d: &DataSpec, progress: Mode, keep_ids: bool) -> Result<(PairData, DataReport)> {
    let files = resolve_files("data.path", &d.path)?;
    let opts = ReadOptions {
        format: Some(d.format),
        keys: d.keys.clone().unwrap_or_default(),
        limit: None,
        skip_malformed: d.malformed == Malformed::Skip,
    };
    let ranked = opts.format == Some(crate::spec::Format::Generic)
        && matches!(opts.keys.label_form(), Ok(super::datasets::LabelForm::Ranked { .. }));
    let read = read_selected(d, &files, &opts, ranked)?;
    let sp = split(d, &opts, ranked, read.selected)?;
    let score_ties = sp.train.iter().chain(&sp.eval).filter(|p| p.score_tie()).count();
    let eval_in_train = overlap(&sp.train, &sp.eval);
    let (train, eval): (Vec<Pair>, Vec<Pair>) = if d.score_ties == ScoreTies::Drop {
        let keep = |v: Vec<Pair>| v.into_iter().filter(|p| !p.score_tie()).collect();
        (keep(sp.train), keep(sp.eval))
    } else {
        (sp.train, sp.eval)
    };
    let run = PhiRun { keep_ids, ..PhiRun::new(&d.phi(), progress)? };
    // one extraction over both splits, so they share a batch plan and a progress bar
    let n_train = train.len();
    let both: Vec<Pair> = train.into_iter().chain(eval).collect();
    let origin = match &sp.eval_file {
        Some(e) => format!("{} + {}", display_files(&files), display_files(e)),
        None => display_files(&files),
    };
    let ex = extract_pairs(&both, &origin, &run)?;
    let counts = Counts {
        rows_read: read.rows_in_files,
        pairs_read: read.pairs_read,
        selected: read.take,
        malformed_skipped: read.skipped + sp.skipped,
        malformed_examples: read.skipped_examples.into_iter().chain(sp.skipped_examples).collect(),
        eval_in_train,
        score_ties,
        ranked: read.ranked,
    };
    assemble(d, (&files, sp.eval_file), &origin, (&both, n_train), &ex, keep_ids, counts)
}

/// What [`read_selected`] read: the selected pairs and the counts the report keeps.
struct Read {
    selected: Vec<Pair>,
    rows_in_files: usize,
    pairs_read: usize,
    take: usize,
    skipped: usize,
    skipped_examples: Vec<String>,
    ranked: Option<serde_json::Value>,
}

/// Step 1: the pairs of `files`, then `data.rows` of them — the first, or a random subset in
/// file order (`select_seed`).
fn read_selected(d: &DataSpec, files: &[PathBuf], opts: &ReadOptions, ranked: bool) -> Result<Read> {
    let read = read_dataset(files, opts)?;
    let ranked = ranked.then(|| ranked_summary(&read.pairs));
    let all = read.pairs;
    let pairs_read = all.len();
    let take = d.rows.unwrap_or(pairs_read);
    if take > pairs_read {
        return Err(anyhow!("data.rows = {take}, but {} holds only {pairs_read} pairs", display_files(files)));
    }
    let selected: Vec<Pair> = match d.select {
        Select::First => all.into_iter().take(take).collect(),
        Select::Random => {
            let mut idx: Vec<usize> = (0..pairs_read).collect();
            idx.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(d.select_seed));
            let mut keep: Vec<usize> = idx.into_iter().take(take).collect();
            keep.sort_unstable();
            let mut all: Vec<Option<Pair>> = all.into_iter().map(Some).collect();
            keep.into_iter().map(|i| all[i].take().expect("distinct")).collect()
        }
    };
    Ok(Read {
        selected,
        rows_in_files: read.rows_read,
        pairs_read,
        take,
        skipped: read.skipped,
        skipped_examples: read.skipped_examples,
        ranked,
    })
}

/// The train/held-out split, and what the held-out file's reading skipped.
struct Split {
    train: Vec<Pair>,
    eval: Vec<Pair>,
    eval_file: Option<Vec<PathBuf>>,
    skipped: usize,
    skipped_examples: Vec<String>,
}

/// Step 2: the held-out pairs — `data.eval_path`'s first `eval_rows`, or `eval_fraction` of the
/// selected ones drawn with `split_seed` (the ranked form: whole prompts, so no held-out prompt
/// was trained on).
fn split(d: &DataSpec, opts: &ReadOptions, ranked: bool, mut selected: Vec<Pair>) -> Result<Split> {
    if let Some(e) = &d.eval_path {
        let ef = resolve_files("data.eval_path", e)?;
        let r = read_dataset(&ef, &ReadOptions { limit: d.eval_rows, ..opts.clone() })?;
        let mut ev = r.pairs;
        if let Some(n) = d.eval_rows {
            if ev.len() < n {
                return Err(anyhow!("data.eval_rows = {n}, but {} holds only {} pairs", display_files(&ef), ev.len()));
            }
        }
        ev.truncate(d.eval_rows.unwrap_or(ev.len()));
        let train = std::mem::take(&mut selected);
        return Ok(Split {
            train,
            eval: ev,
            eval_file: Some(ef),
            skipped: r.skipped,
            skipped_examples: r.skipped_examples,
        });
    }
    let n_eval = ((selected.len() as f64) * d.eval_fraction).round() as usize;
    if n_eval == 0 || n_eval >= selected.len() {
        return Err(anyhow!(
            "data.eval_fraction = {} of {} pairs leaves an empty side of the split",
            d.eval_fraction,
            selected.len()
        ));
    }
    let is_eval = if ranked {
        held_out_prompts(&selected, n_eval, d.split_seed)
    } else {
        held_out_pairs(selected.len(), n_eval, d.split_seed)
    };
    let (mut tr, mut ev) = (Vec::new(), Vec::new());
    for (p, e) in selected.into_iter().zip(is_eval) {
        if e {
            ev.push(p)
        } else {
            tr.push(p)
        }
    }
    Ok(Split { train: tr, eval: ev, eval_file: None, skipped: 0, skipped_examples: Vec::new() })
}

/// `n_eval` of `n` pairs held out, drawn with `seed`.
fn held_out_pairs(n: usize, n_eval: usize, seed: u64) -> Vec<bool> {
    let mut is_eval = vec![false; n];
    let mut idx: Vec<usize> = (0..n).collect();
    idx.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(seed));
    for &i in &idx[..n_eval] {
        is_eval[i] = true;
    }
    is_eval
}

/// The ranked form makes several pairs of one prompt: whole prompts (rows) are held out, drawn
/// with `seed`, until at least `n_eval` pairs are.
fn held_out_prompts(selected: &[Pair], n_eval: usize, seed: u64) -> Vec<bool> {
    let mut per_row: std::collections::HashMap<usize, usize> = std::collections::HashMap::new();
    for p in selected {
        *per_row.entry(p.row).or_default() += 1;
    }
    let mut rows: Vec<usize> = selected.iter().map(|p| p.row).collect();
    rows.dedup();
    rows.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(seed));
    let mut held = std::collections::HashSet::new();
    let mut count = 0;
    for r in rows {
        if count >= n_eval {
            break;
        }
        held.insert(r);
        count += per_row[&r];
    }
    selected.iter().map(|p| held.contains(&p.row)).collect()
}

/// The counts of reading and splitting that the report keeps.
struct Counts {
    rows_read: usize,
    pairs_read: usize,
    selected: usize,
    malformed_skipped: usize,
    malformed_examples: Vec<String>,
    eval_in_train: usize,
    score_ties: usize,
    ranked: Option<serde_json::Value>,
}

/// Step 4: z = φ(chosen) − φ(rejected) and y of each split (degenerate pairs dropped when
/// `data.degenerate` says so), the token ids when kept, and the report. `(files, eval_file)`:
/// the data's files and the eval split's own, if any; `(both, n_train)`: the selected pairs,
/// the first `n_train` of them the training split.
fn assemble(
    d: &DataSpec,
    (files, eval_file): (&[PathBuf], Option<Vec<PathBuf>>),
    origin: &str,
    (both, n_train): (&[Pair], usize),
    ex: &super::extract::Extracted,
    keep_ids: bool,
    c: Counts,
) -> Result<(PairData, DataReport)> {
    let dim = ex.summary.dim;
    let drop = d.degenerate == Degenerate::Drop;
    let Splits { train: mut tr, eval: mut ev, ids, train_tokens, eval_tokens, train_origin } =
        split_pairs(ex, both, n_train, drop, keep_ids);
    let digest = files_blake3(files)?;
    tr.digest = digest.clone();
    ev.digest = match &eval_file {
        Some(e) => files_blake3(e)?,
        None => digest.clone(),
    };
    if tr.is_empty() || ev.is_empty() {
        return Err(anyhow!("{origin}: after dropping degenerate pairs, a side of the split is empty"));
    }
    let path = files[0].clone();
    let report = DataReport {
        path: path.display().to_string(),
        files: files.iter().map(|f| f.display().to_string()).collect(),
        blake3: digest,
        eval_path: eval_file.as_ref().map(|e| e[0].display().to_string()),
        eval_files: eval_file.iter().flatten().map(|f| f.display().to_string()).collect(),
        rows_read: c.rows_read,
        pairs_read: c.pairs_read,
        malformed_skipped: c.malformed_skipped,
        malformed_examples: c.malformed_examples,
        eval_in_train: c.eval_in_train,
        selected: c.selected,
        train_pairs: tr.len(),
        eval_pairs: ev.len(),
        degenerate_train: ex.degenerate[..n_train].iter().filter(|&&x| x).count(),
        degenerate_eval: ex.degenerate[n_train..].iter().filter(|&&x| x).count(),
        degenerate_dropped: drop,
        score_ties: c.score_ties,
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
        ranked: c.ranked,
    };
    let data = PairData {
        d: dim,
        train: tr,
        eval: ev,
        train_path: path,
        eval_path: eval_file.map(|e| e[0].clone()),
        report: None,
        train_origin,
        train_total: n_train,
        order: None,
        ids,
    };
    Ok((data, report))
}

/// [`split_pairs`]' splits: each one's z and y (digests unset), the token ids when kept, the
/// tokens each split's kept pairs hold, and the training pairs kept (indices into the
/// training split as selected).
struct Splits {
    train: Pairs,
    eval: Pairs,
    ids: Option<PairIds>,
    train_tokens: usize,
    eval_tokens: usize,
    train_origin: Vec<usize>,
}

/// Step 4's pairs: of `both` (the first `n_train` the training split, the rest the eval split),
/// those kept (degenerate ones dropped with `drop`), each as z = φ(chosen) − φ(rejected) and its
/// label y, with their token ids when `keep_ids`.
fn split_pairs(ex: &super::extract::Extracted, both: &[Pair], n_train: usize, drop: bool, keep_ids: bool) -> Splits {
    let dim = ex.summary.dim;
    let kept = |range: std::ops::Range<usize>| range.filter(move |&i| !(drop && ex.degenerate[i]));
    let build = |range: std::ops::Range<usize>| -> Pairs {
        let mut z = Vec::new();
        let mut y = Vec::new();
        for i in kept(range) {
            let (c, r) = (ex.phi[2 * i].as_ref().expect("all rows"), ex.phi[2 * i + 1].as_ref().expect("all rows"));
            z.extend(c.iter().zip(r).map(|(a, b)| a - b));
            y.push(both[i].y());
        }
        Pairs { d: dim, z, y, digest: String::new() }
    };
    let ids = |range: std::ops::Range<usize>| -> Vec<(Vec<u32>, Vec<u32>)> {
        kept(range).map(|i| (ex.ids[2 * i].clone(), ex.ids[2 * i + 1].clone())).collect()
    };
    let ids = keep_ids.then(|| PairIds { train: ids(0..n_train), eval: ids(n_train..both.len()) });
    let kept_tokens = |range: std::ops::Range<usize>| -> usize {
        kept(range).map(|i| ex.lengths[2 * i] + ex.lengths[2 * i + 1]).sum()
    };
    Splits {
        train: build(0..n_train),
        eval: build(n_train..both.len()),
        ids,
        train_tokens: kept_tokens(0..n_train),
        eval_tokens: kept_tokens(n_train..both.len()),
        train_origin: kept(0..n_train).collect(),
    }
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
