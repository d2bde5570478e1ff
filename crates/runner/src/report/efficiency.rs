//! The sample-efficiency figure's rows and CSV: held-out reward accuracy and, in a deployment,
//! the win rate against the base policy, against the oracle queries so far.

use super::figures::{self, Band};
use super::row::{series, Row};
use crate::results;
use crate::rows::{Key, RoundRow, SampleRow};
use anyhow::Result;
use std::collections::BTreeMap;
use std::path::Path;

/// The sample-efficiency figure's panels: the part of its rows' labels before the first " / ".
pub const SE_ACCURACY: &str = "held-out reward accuracy";
pub const SE_WIN: &str = "win rate against the base policy";

/// The chance of winning against one of `base` (ties ½; non-finite entries left out): the
/// oracle's noiseless preference of a reward `r` over a uniform draw from `base`.
fn win_share(r: f64, base: &[f64]) -> Option<f64> {
    let b: Vec<f64> = base.iter().copied().filter(|x| x.is_finite()).collect();
    (!b.is_empty()).then(|| {
        b.iter()
            .map(|&x| {
                if r > x {
                    1.0
                } else if r == x {
                    0.5
                } else {
                    0.0
                }
            })
            .sum::<f64>()
            / b.len() as f64
    })
}

/// A deployment on generated responses without a learning policy: per cell and chunk, the win
/// rate of what the cell deploys (its best-of-n pick under θ at the chunk's start,
/// rounds.parquet's `policy_reward`) against the base policy — the oracle's preference over a
/// response drawn uniformly from the prompt's n base samples (generations.parquet), ties ½ —
/// averaged over the chunk's prompts (chance: ½). x is the oracle queries θ had seen when it
/// picked: the labelled pairs of the cell's earlier chunks (one per prompt).
pub fn win_vs_base(rounds: &[(Key, RoundRow)], rewards: &BTreeMap<u64, Vec<f64>>) -> Result<Vec<Row>> {
    // cell → chunk → (label, seed, Σ win, prompts)
    type Chunks = BTreeMap<u64, (String, u32, f64, usize)>;
    let mut at: BTreeMap<&str, Chunks> = BTreeMap::new();
    for (k, r) in rounds {
        let base = rewards.get(&r.prompt).ok_or_else(|| {
            anyhow::anyhow!("rounds.parquet: prompt {} of cell {} is not in generations.parquet", r.prompt, k.cell_id)
        })?;
        let Some(w) = win_share(r.policy_reward, base) else { continue };
        let e = at.entry(&k.cell_id).or_default().entry(r.chunk).or_insert((k.label.clone(), k.seed, 0.0, 0));
        (e.2, e.3) = (e.2 + w, e.3 + 1);
    }
    let mut out = Vec::new();
    for chunks in at.values() {
        let mut before = 0u64;
        for (label, seed, sum, n) in chunks.values() {
            let values = [("value", sum / *n as f64)].into();
            out.push(Row { label: label.clone(), seed: *seed, samples: before, values });
            before += *n as u64;
        }
    }
    Ok(out)
}

/// A deployment with a learning policy: per cell and evaluation (policy_samples.parquet, the
/// held-out prompts), the win rate of what the arm deploys after chunk c against the base policy
/// — the chunk-0 samples of the same prompt, every deployed × base pair, ties ½ — averaged over
/// the prompts; x is the oracle queries so far (`queries`: label, seed → chunk → samples_seen;
/// chunk 0: none).
pub fn win_vs_base_online(
    samples: &[(Key, SampleRow)],
    queries: &BTreeMap<(String, u32), BTreeMap<u64, u64>>,
) -> Vec<Row> {
    // (label, seed) → chunk → prompt → (deployed rewards, all rewards)
    type Prompts = BTreeMap<u64, (Vec<f64>, Vec<f64>)>;
    let mut at: BTreeMap<(String, u32), BTreeMap<u64, Prompts>> = BTreeMap::new();
    for (k, r) in samples {
        let e = at.entry((k.label.clone(), k.seed)).or_default().entry(r.chunk).or_default();
        let e = e.entry(r.prompt).or_default();
        if r.deployed {
            e.0.push(r.oracle_reward);
        }
        e.1.push(r.oracle_reward);
    }
    let mut out = Vec::new();
    for ((label, seed), chunks) in &at {
        let Some(base) = chunks.get(&0) else { continue };
        for (&c, prompts) in chunks {
            let x =
                if c == 0 { Some(0) } else { queries.get(&(label.clone(), *seed)).and_then(|q| q.get(&c)).copied() };
            let Some(x) = x else { continue };
            let per: Vec<f64> = prompts
                .iter()
                .filter_map(|(p, (dep, _))| {
                    let b = &base.get(p)?.1;
                    let w: Vec<f64> = dep.iter().filter_map(|&d| win_share(d, b)).collect();
                    (!w.is_empty()).then(|| w.iter().sum::<f64>() / w.len() as f64)
                })
                .collect();
            if per.is_empty() {
                continue;
            }
            let values = [("value", per.iter().sum::<f64>() / per.len() as f64)].into();
            out.push(Row { label: label.clone(), seed: *seed, samples: x, values });
        }
    }
    out
}

/// The sample-efficiency figure's rows (value `value`, x the oracle queries so far): held-out
/// reward accuracy from metrics.parquet (`samples_seen` is the labelled pairs so far: one
/// oracle query each) labelled `"{SE_ACCURACY} / <config>"`, then in a deployment the win rate
/// against the base policy ([`win_vs_base`] on generated responses, [`win_vs_base_online`] with
/// a learning policy) labelled `"{SE_WIN} / <config>"`. The second value says why a
/// deployment has no win rate (None: it has one, or the run is not a deployment).
pub fn sample_efficiency(run: &Path, metrics: &[Row], deploy: bool) -> Result<(Vec<Row>, Option<&'static str>)> {
    let tag = |panel: &str, rows: Vec<Row>| {
        rows.into_iter().map(move |r| Row { label: format!("{panel} / {}", r.label), ..r }).collect::<Vec<_>>()
    };
    let acc: Vec<Row> = metrics
        .iter()
        .filter_map(|r| {
            let v = *r.values.get("eval_accuracy")?;
            Some(Row { label: r.label.clone(), seed: r.seed, samples: r.samples, values: [("value", v)].into() })
        })
        .collect();
    let mut out = tag(SE_ACCURACY, acc);
    if !deploy {
        return Ok((out, None));
    }
    let wins = if run.join("policy_samples.parquet").exists() {
        let mut queries: BTreeMap<(String, u32), BTreeMap<u64, u64>> = BTreeMap::new();
        for (k, m) in results::read_metrics(run)? {
            if let Some(c) = m.chunk {
                queries.entry((k.label, k.seed)).or_default().insert(c, m.samples_seen);
            }
        }
        win_vs_base_online(&results::read_policy_samples(run)?, &queries)
    } else if run.join("rounds.parquet").exists() && run.join("generations.parquet").exists() {
        win_vs_base(&results::read_rounds(run)?, &results::read_generation_rewards(run)?)?
    } else {
        return Ok((out, Some("no win rate: a deployment on the synthetic bandit has no base policy's responses (rounds.parquet and generations.parquet are written on generated responses)")));
    };
    out.extend(tag(SE_WIN, wins));
    Ok((out, None))
}

/// The sample-efficiency figure's points as CSV (`report/sample-efficiency.csv`): per panel,
/// config and x, the seeds, their mean and its 95% Student-t interval (df = seeds − 1; empty for
/// one seed) — the values the figure draws ([`figures::curve`] with [`Band::T95`]).
pub fn sample_efficiency_csv(rows: &[Row]) -> String {
    let q = |s: &str| if s.contains([',', '"']) { format!("\"{}\"", s.replace('"', "\"\"")) } else { s.to_string() };
    let mut out = String::from("panel,config,queries,seeds,mean,ci95_lo,ci95_hi\n");
    for (label, by) in series(rows, "value") {
        let (panel, config) = label.split_once(" / ").unwrap_or(("", &label));
        for (x, m, hw) in figures::curve(&by, Band::T95) {
            let n = by[&(x as u64)].len();
            let (lo, hi) = if n > 1 { (format!("{}", m - hw), format!("{}", m + hw)) } else { Default::default() };
            out.push_str(&format!("{},{},{},{n},{m},{lo},{hi}\n", q(panel), q(config), x as u64));
        }
    }
    out
}
