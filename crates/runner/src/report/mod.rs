//! `onepass report <run-dir>` and `onepass compare <run-dir>…`: they only read a run's tables.
//! The report is `report/report.md` (final metrics, mean ± std over seeds) and one PNG + SVG
//! figure per metric against samples seen, with a ±1 std band over seeds; `cost` plots the
//! flops per sample between evaluation points, flat for one-pass estimators and growing for mle.
//! Active and deployment runs add `sample-efficiency.{png,svg,csv}`: held-out reward accuracy
//! (and, in a deployment, the win rate against the base policy) against oracle queries, with a
//! 95% t-interval band over seeds ([`sample_efficiency`]).

use crate::results;
use crate::rows::{Key, MetricRow, PolicyRow, RoundRow, SampleRow};
use anyhow::{bail, Context, Result};
use plotters::prelude::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

mod figures;
pub mod stats;
use figures::{Band, Layout, LineFigure};

/// The metrics.parquet columns the report uses.
#[derive(Clone, Debug)]
pub struct Row {
    pub label: String,
    pub seed: u32,
    pub samples: u64,
    pub values: BTreeMap<&'static str, f64>,
}

/// Metrics that get a figure, with their axis titles.
pub const FIGURES: [(&str, &str); 11] = [
    ("train_loss", "Prequential training loss (each batch scored before its update)"),
    ("eval_loss", "Held-out logistic loss"),
    ("eval_accuracy", "Held-out accuracy"),
    ("theta_err", "Distance to the true parameter, ‖θ − θ*‖"),
    ("subopt", "Suboptimality of the greedy policy under θ"),
    ("regret", "Cumulative regret"),
    ("subopt_avg", "Suboptimality of the averaged iterate"),
    ("cost", "Flops per sample between evaluations (one-pass: flat; mle: growing)"),
    ("cum_pair_reward", "Cumulative oracle reward of the chosen pairs, Σ over chunks of mean r(a) + r(a′)"),
    ("policy_reward", "Oracle reward of the deployed policy, per chunk"),
    ("kendall_tau", "Kendall τ between the learned and the oracle ranking, per chunk"),
];

/// policy.parquet columns that get a figure (x: the chunk).
pub const POLICY_FIGURES: [(&str, &str); 3] = [
    ("policy_reward", "Oracle reward of what each arm deploys on held-out prompts (best-of-n: its pick)"),
    ("bon_reward", "Oracle reward of the best of n samples under θ on held-out prompts"),
    ("kl_initial", "KL divergence to the initial policy, per sequence"),
];

/// A named value of a typed row.
type Value<R, T> = (&'static str, fn(&R) -> T);

/// The policy.parquet values that get a figure, by column name (the typed row: a renamed field
/// is a compile error here).
const POLICY_VALUES: [Value<PolicyRow, f64>; 4] = [
    ("policy_reward", |r| r.policy_reward),
    ("bon_reward", |r| r.bon_reward),
    ("kl_initial", |r| r.kl_initial),
    ("sample_reward", |r| r.sample_reward),
];

/// Per label and seed: per held-out prompt the base policy's mean oracle reward at the first
/// evaluation (chunk 0: all its samples) and the arm's deployed reward at the last
/// (policy_samples.parquet; see [`first_last`] for the seed-level means of the same).
pub type PromptGrid = BTreeMap<String, BTreeMap<u32, (Vec<f64>, Vec<f64>)>>;

/// A run's policy_samples.parquet as a [`PromptGrid`]; None for a run written before the table
/// existed.
pub fn read_prompt_grid(run: &Path) -> Result<Option<PromptGrid>> {
    if !run.join("policy_samples.parquet").exists() {
        return Ok(None);
    }
    // label → seed → chunk → prompt → (deployed sum, deployed n, all sum, all n)
    type Sums = BTreeMap<u64, (f64, usize, f64, usize)>;
    let mut at: BTreeMap<String, BTreeMap<u32, BTreeMap<u64, Sums>>> = BTreeMap::new();
    for (k, r) in results::read_policy_samples(run)? {
        let e = at.entry(k.label).or_default().entry(k.seed).or_default().entry(r.chunk).or_default();
        let e = e.entry(r.prompt).or_default();
        if r.deployed {
            (e.0, e.1) = (e.0 + r.oracle_reward, e.1 + 1);
        }
        (e.2, e.3) = (e.2 + r.oracle_reward, e.3 + 1);
    }
    let mean = |s: f64, n: usize| if n == 0 { f64::NAN } else { s / n as f64 };
    Ok(Some(
        at.into_iter()
            .map(|(l, seeds)| {
                let seeds = seeds
                    .into_iter()
                    .filter_map(|(s, chunks)| {
                        let base = chunks.values().next()?.values().map(|e| mean(e.2, e.3)).collect();
                        let last = chunks.values().last()?.values().map(|e| mean(e.0, e.1)).collect();
                        Some((s, (base, last)))
                    })
                    .collect();
                (l, seeds)
            })
            .collect(),
    ))
}

/// A policy evaluation as the report's row (x: the chunk): the console's table, built from
/// the cells in memory, and the report's, read from policy.parquet, see the same values.
pub fn policy_row(label: String, seed: u32, r: &PolicyRow) -> Row {
    Row { label, seed, samples: r.chunk, values: POLICY_VALUES.iter().map(|(n, get)| (*n, get(r))).collect() }
}

/// A run's policy.parquet as rows whose x is the chunk.
pub fn read_policy(run: &Path) -> Result<Vec<Row>> {
    Ok(results::read_policy(run)?.into_iter().map(|(k, r)| policy_row(k.label, k.seed, &r)).collect())
}

/// Mean and standard error of the mean (sd/√n; 0 for one value).
fn mean_se(v: &[f64]) -> (f64, f64) {
    let (m, sd) = mean_std(v);
    (m, sd / (v.len() as f64).sqrt())
}

/// Per label and seed: the base policy at the first evaluation (chunk 0, on the seed's
/// streams: the mean oracle reward of its samples, `sample_reward`, the same for every arm of
/// the seed — a reranking arm is compared with the base policy as drawn, not with its own pick
/// under θ_0) and the arm's deployed reward (`policy_reward`) at the last.
fn first_last(rows: &[Row]) -> BTreeMap<String, BTreeMap<u32, (f64, f64)>> {
    // label → seed → chunk → (base, deployed)
    type AtChunk = BTreeMap<u64, (f64, f64)>;
    let mut at: BTreeMap<String, BTreeMap<u32, AtChunk>> = BTreeMap::new();
    for r in rows {
        if let Some(&v) = r.values.get("policy_reward") {
            // rows without sample_reward (a table of one column): the deployed reward is the base
            let base = r.values.get("sample_reward").copied().unwrap_or(v);
            at.entry(r.label.clone()).or_default().entry(r.seed).or_default().insert(r.samples, (base, v));
        }
    }
    at.into_iter()
        .map(|(l, seeds)| {
            let fl = seeds
                .into_iter()
                .filter_map(|(s, c)| Some((s, (c.values().next()?.0, c.values().last()?.1))))
                .collect();
            (l, fl)
        })
        .collect()
}

/// ln Γ(x) for x > 0 (Lanczos, g = 7, 9 terms: ~15 digits).
fn ln_gamma(x: f64) -> f64 {
    const C: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    if x < 0.5 {
        // reflection
        let pi = std::f64::consts::PI;
        return (pi / (pi * x).sin()).ln() - ln_gamma(1.0 - x);
    }
    let x = x - 1.0;
    let t = x + 7.5;
    let a = C[0] + C[1..].iter().enumerate().map(|(i, c)| c / (x + i as f64 + 1.0)).sum::<f64>();
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + a.ln()
}

/// The regularised incomplete beta function I_x(a, b) (continued fraction, Lentz).
fn incomplete_beta(x: f64, a: f64, b: f64) -> f64 {
    if x <= 0.0 {
        return 0.0;
    }
    if x >= 1.0 {
        return 1.0;
    }
    if x > (a + 1.0) / (a + b + 2.0) {
        return 1.0 - incomplete_beta(1.0 - x, b, a);
    }
    let front = (ln_gamma(a + b) - ln_gamma(a) - ln_gamma(b) + a * x.ln() + b * (1.0 - x).ln()).exp() / a;
    let tiny = 1e-300;
    let (mut c, mut d) = (1.0, 1.0 - (a + b) * x / (a + 1.0));
    d = 1.0 / if d.abs() < tiny { tiny } else { d };
    let mut f = d;
    for m in 1..300 {
        let m = m as f64;
        for num in [
            m * (b - m) * x / ((a + 2.0 * m - 1.0) * (a + 2.0 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2.0 * m) * (a + 2.0 * m + 1.0)),
        ] {
            d = 1.0 + num * d;
            d = 1.0 / if d.abs() < tiny { tiny } else { d };
            c = 1.0 + num / c;
            c = if c.abs() < tiny { tiny } else { c };
            f *= c * d;
        }
        if (c * d - 1.0).abs() < 1e-15 {
            break;
        }
    }
    front * f
}

/// Student's t quantile: the t with P(T ≤ t) = p for T ~ t(df), by bisection on the CDF
/// (P(|T| > t) = I_{df/(df+t²)}(df/2, 1/2)).
pub fn t_quantile(p: f64, df: f64) -> f64 {
    assert!(p > 0.0 && p < 1.0 && df > 0.0, "t_quantile({p}, {df})");
    let cdf = |t: f64| {
        let tail = 0.5 * incomplete_beta(df / (df + t * t), df / 2.0, 0.5);
        if t >= 0.0 {
            1.0 - tail
        } else {
            tail
        }
    };
    let (mut lo, mut hi) = (-1e6, 1e6);
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if cdf(mid) < p {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

/// Mean of `v` and the half-width of its 95% t-interval (df = n − 1); None for the half-width
/// of one value.
fn mean_t95(v: &[f64]) -> (f64, Option<f64>) {
    let (m, se) = mean_se(v);
    let hw = (v.len() > 1).then(|| t_quantile(0.975, (v.len() - 1) as f64) * se);
    (m, hw)
}

/// The console's account of a run with a learning policy: per arm the held-out oracle reward of
/// what it deploys (policy.parquet's `policy_reward`) at chunk 0 (the base policy) and at the
/// last evaluation, and their paired change, each the mean over seeds with its 95% Student-t
/// interval (df = seeds − 1); one seed says "1 seed: no interval".
pub fn policy_console(rows: &[Row]) -> String {
    let fl = first_last(rows);
    let last_chunk = rows.iter().map(|r| r.samples).max().unwrap_or(0);
    let w = fl.keys().map(|l| l.chars().count()).max().unwrap_or(3).max(3);
    let mut out = format!(
        "held-out policy reward (mean over seeds ± 95% t-interval, df = seeds − 1), chunk 0 → chunk {last_chunk}\n{:<w$} {:>5}  {:>18}  {:>18}  {:>18}\n",
        "arm", "seeds", "base (chunk 0)", "last", "last − base"
    );
    for (label, seeds) in &fl {
        let base: Vec<f64> = seeds.values().map(|p| p.0).collect();
        let last: Vec<f64> = seeds.values().map(|p| p.1).collect();
        let diff: Vec<f64> = seeds.values().map(|p| p.1 - p.0).collect();
        let show = |v: &[f64], sign: bool| {
            let (m, hw) = mean_t95(v);
            let m = if sign { format!("{m:+.4}") } else { format!("{m:.4}") };
            hw.map_or(m.clone(), |h| format!("{m} ± {h:.4}"))
        };
        let note = if seeds.len() == 1 { "  (1 seed: no interval)" } else { "" };
        out.push_str(&format!(
            "{label:<w$} {:>5}  {:>18}  {:>18}  {:>18}{note}\n",
            seeds.len(),
            show(&base, false),
            show(&last, false),
            show(&diff, true)
        ));
    }
    out
}

/// The policy on the held-out prompts: per arm the base policy (chunk 0, the same prompts and
/// sampling streams as every later evaluation of that seed), the last evaluation, their paired
/// difference; then every pair of arms that share an estimator and strategy, and every arm
/// driven by two estimators (or strategies), paired by seed at the last evaluation. Each difference is [`stats::paired`]'s: its 95% t-interval (df = seeds −
/// 1) and two-sided p; "detectable" is the smallest true difference found with 80% power.
pub fn policy_table(cs: &[Comparison]) -> String {
    let show = |c: &Comparison| match (c.paired.ci95, c.paired.p) {
        (Some((lo, hi)), Some(pv)) => format!("{:+.3} [{lo:+.3}, {hi:+.3}], p = {pv:.3}", c.paired.mean),
        _ => format!("{:+.3} (1 seed: no interval)", c.paired.mean),
    };
    let detectable = |c: &Comparison| c.paired.mdd80.map_or("–".to_string(), |m| format!("{m:.3}"));
    let crossed = |c: &Comparison| {
        c.crossed
            .map_or("–".to_string(), |x| format!("[{:+.3}, {:+.3}] ({}×{})", x.ci95.0, x.ci95.1, x.seeds, x.prompts))
    };
    let num = |v: Option<f64>| v.map_or("—".to_string(), |x| format!("{x:.3}"));
    let mut out = String::from(
        "| arm | seeds | base (chunk 0) | last | last − base [95% t-interval], p | detectable (80% power) | seeds × prompts bootstrap 95% | best of n under θ, last | KL to initial, last |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    let mut pairs = String::new();
    for c in cs {
        match &c.against {
            None => out.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                c.label,
                c.paired.n,
                num(c.base),
                num(c.last),
                show(c),
                detectable(c),
                crossed(c),
                num(c.bon_last),
                num(c.kl_last)
            )),
            Some(b) => pairs.push_str(&format!(
                "| {} | {} − {b} | {} | {} | {} | {} |\n",
                c.group,
                c.arm,
                c.paired.n,
                show(c),
                detectable(c),
                crossed(c)
            )),
        }
    }
    if !pairs.is_empty() {
        out.push_str("\nPaired differences at the last evaluation between arms of one estimator × strategy, and between estimators (or strategies) driving one arm (same seed: same held-out prompts and streams).\n\n| shared | difference | seeds | mean [95% t-interval], p | detectable (80% power) | seeds × prompts bootstrap 95% |\n|---|---|---|---|---|---|\n");
        out.push_str(&pairs);
    }
    out
}

/// One comparison of the policy table: an arm after its last chunk against the base policy
/// (`against` None), or against another arm of its estimator × strategy at the last evaluation.
#[derive(Clone, Debug)]
pub struct Comparison {
    /// The arm's full label, its estimator × strategy (the label up to its last " / ") and its
    /// arm (the rest).
    pub label: String,
    pub group: String,
    pub arm: String,
    /// The other arm (its part of the label), or None: the base policy.
    pub against: Option<String>,
    /// Means over seeds of the base (chunk 0) and of the arm after the last chunk (vs the base).
    pub base: Option<f64>,
    pub last: Option<f64>,
    /// Over seeds ([`stats::paired`]).
    pub paired: stats::Paired,
    /// Over seeds and prompts ([`stats::crossed_bootstrap`]; None without per-prompt rows).
    pub crossed: Option<stats::Crossed>,
    pub bon_last: Option<f64>,
    pub kl_last: Option<f64>,
}

/// Every comparison of the policy table, computed once: the markdown table
/// ([`policy_table`]) and `report/policy_comparisons.csv` ([`policy_csv`]) render the same
/// values. Replicates are seeds (every arm of a seed shares its streams and base samples, so
/// two cells of one seed are never pooled as two replicates).
pub fn policy_comparisons(rows: &[Row], grid: Option<&PromptGrid>) -> Vec<Comparison> {
    let fl = first_last(rows);
    let cell = |label: &str| grid.and_then(|g| g.get(label));
    let crossed = |d: Vec<Vec<f64>>| stats::crossed_bootstrap(&d, stats::RESAMPLES);
    let group =
        |l: &str| l.rsplit_once(" / ").map_or((String::new(), l.to_string()), |(g, a)| (g.to_string(), a.to_string()));
    let bon = series(rows, "bon_reward");
    let kl = series(rows, "kl_initial");
    let at_last = |m: &BTreeMap<String, BTreeMap<u64, Vec<f64>>>, label: &str| {
        m.get(label).and_then(|x| x.values().last()).map(|v| mean_std(v).0)
    };
    let mut out = Vec::new();
    for (label, seeds) in &fl {
        let base: Vec<f64> = seeds.values().map(|p| p.0).collect();
        let last: Vec<f64> = seeds.values().map(|p| p.1).collect();
        let Some(paired) = stats::paired(&base, &last) else { continue };
        let (group, arm) = group(label);
        // per (seed, prompt): the arm's deployed reward after its last chunk − the base's
        let d: Vec<Vec<f64>> = cell(label)
            .map(|s| s.values().map(|(b, l)| l.iter().zip(b).map(|(x, y)| x - y).collect()).collect())
            .unwrap_or_default();
        out.push(Comparison {
            label: label.clone(),
            group,
            arm,
            against: None,
            base: Some(mean_std(&base).0),
            last: Some(mean_std(&last).0),
            paired,
            crossed: crossed(d),
            bon_last: at_last(&bon, label),
            kl_last: at_last(&kl, label),
        });
    }
    let labels: Vec<&String> = fl.keys().collect();
    for (i, a) in labels.iter().enumerate() {
        for b in &labels[i + 1..] {
            // arms of one estimator × strategy (the same head), or one arm driven by two
            // estimators or strategies (the same last part: the estimators' question at the
            // policy level); the shared part names the comparison
            let ((ga, arm_a), (gb, arm_b)) = (group(a), group(b));
            let (ga, arm_a, arm_b) = if ga == gb {
                (ga, arm_a, arm_b)
            } else if arm_a == arm_b {
                (arm_a, ga, gb)
            } else {
                continue;
            };
            let (xa, xb): (Vec<f64>, Vec<f64>) =
                fl[*a].iter().filter_map(|(s, pa)| fl[*b].get(s).map(|pb| (pb.1, pa.1))).unzip();
            let Some(paired) = stats::paired(&xa, &xb) else { continue };
            let d: Vec<Vec<f64>> = match (cell(a), cell(b)) {
                (Some(sa), Some(sb)) => sa
                    .iter()
                    .filter_map(|(s, (_, la))| sb.get(s).map(|(_, lb)| la.iter().zip(lb).map(|(x, y)| x - y).collect()))
                    .collect(),
                _ => Vec::new(),
            };
            out.push(Comparison {
                label: (*a).clone(),
                group: ga,
                arm: arm_a,
                against: Some(arm_b),
                base: None,
                last: None,
                paired,
                crossed: crossed(d),
                bon_last: None,
                kl_last: None,
            });
        }
    }
    out
}

/// The policy table's comparisons as CSV (`report/policy_comparisons.csv`), one row each: what
/// is compared, seeds, the mean difference, its 95% t-interval (df = seeds − 1), p, the
/// difference detectable at 80% power, and the seeds × prompts bootstrap interval (empty where
/// a value does not exist: one seed, or a run without policy_samples.parquet).
pub fn policy_csv(cs: &[Comparison]) -> String {
    let f = |v: Option<f64>| v.map_or(String::new(), |x| format!("{x}"));
    let q = |s: &str| if s.contains([',', '"']) { format!("\"{}\"", s.replace('"', "\"\"")) } else { s.to_string() };
    let mut out = String::from(
        "group,arm,against,seeds,base,last,mean,se,ci95_lo,ci95_hi,p,detectable_80,prompts,boot95_lo,boot95_hi,bon_last,kl_initial_last\n",
    );
    for c in cs {
        let p = &c.paired;
        out.push_str(&format!(
            "{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}\n",
            q(&c.group),
            q(&c.arm),
            q(c.against.as_deref().unwrap_or("base")),
            p.n,
            f(c.base),
            f(c.last),
            p.mean,
            f(p.se),
            f(p.ci95.map(|x| x.0)),
            f(p.ci95.map(|x| x.1)),
            f(p.p),
            f(p.mdd80),
            c.crossed.map_or(String::new(), |x| x.prompts.to_string()),
            f(c.crossed.map(|x| x.ci95.0)),
            f(c.crossed.map(|x| x.ci95.1)),
            f(c.bon_last),
            f(c.kl_last)
        ));
    }
    out
}

/// The metrics.parquet values the report reads, by column name (the typed row: a renamed field
/// is a compile error here); None where a row has no value (e.g. θ-error without a θ*).
const METRIC_VALUES: [Value<MetricRow, Option<f64>>; 15] = [
    ("train_loss", |r| Some(r.train_loss)),
    ("eval_loss", |r| Some(r.eval_loss)),
    ("eval_accuracy", |r| Some(r.eval_accuracy)),
    ("theta_err", |r| r.theta_err),
    ("subopt", |r| r.subopt),
    ("regret", |r| r.regret),
    ("subopt_avg", |r| r.subopt_avg),
    ("cum_pair_reward", |r| r.cum_pair_reward),
    ("policy_reward", |r| r.policy_reward),
    ("kendall_tau", |r| r.kendall_tau),
    ("subopt_pessimistic", |r| r.subopt_pessimistic),
    ("subopt_pessimistic_ref", |r| r.subopt_pessimistic_ref),
    ("theta_err_h", |r| r.theta_err_h),
    ("kappa", |r| Some(r.kappa)),
    ("kappa_reference", |r| Some(r.kappa_reference)),
];

/// Reads a run's metrics.parquet (`results::read_metrics`) into the report's rows.
pub fn read_metrics(run: &Path) -> Result<Vec<Row>> {
    let mut rows: Vec<Row> = results::read_metrics(run)?
        .into_iter()
        .map(|(k, r)| {
            let mut values: BTreeMap<&'static str, f64> =
                METRIC_VALUES.iter().filter_map(|(n, get)| get(&r).map(|v| (*n, v))).collect();
            values.insert("flops_cum", r.flops as f64);
            Row { label: k.label, seed: k.seed, samples: r.samples_seen, values }
        })
        .collect();
    add_cost(&mut rows);
    Ok(rows)
}

/// cost = Δflops / Δsamples between consecutive rows of a cell.
fn add_cost(rows: &mut [Row]) {
    let mut last: BTreeMap<(String, u32), (u64, f64)> = BTreeMap::new();
    for r in rows.iter_mut() {
        let key = (r.label.clone(), r.seed);
        let (s0, f0) = last.get(&key).copied().unwrap_or((0, 0.0));
        let f = r.values["flops_cum"];
        if r.samples > s0 {
            r.values.insert("cost", (f - f0) / (r.samples - s0) as f64);
        }
        last.insert(key, (r.samples, f));
    }
}

/// mean and sample std of `v` (std 0 for one value).
fn mean_std(v: &[f64]) -> (f64, f64) {
    let n = v.len() as f64;
    let m = v.iter().sum::<f64>() / n;
    let var = if v.len() > 1 { v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0) } else { 0.0 };
    (m, var.sqrt())
}

/// label → samples → values over seeds, for one metric.
fn series(rows: &[Row], metric: &str) -> BTreeMap<String, BTreeMap<u64, Vec<f64>>> {
    let mut out: BTreeMap<String, BTreeMap<u64, Vec<f64>>> = BTreeMap::new();
    for r in rows {
        if let Some(&v) = r.values.get(metric) {
            out.entry(r.label.clone()).or_default().entry(r.samples).or_default().push(v);
        }
    }
    out
}

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

/// The final row of every cell, grouped by label.
fn finals(rows: &[Row]) -> BTreeMap<String, Vec<&Row>> {
    let mut last: BTreeMap<(String, u32), &Row> = BTreeMap::new();
    for r in rows {
        let k = (r.label.clone(), r.seed);
        if last.get(&k).is_none_or(|p| p.samples <= r.samples) {
            last.insert(k, r);
        }
    }
    let mut out: BTreeMap<String, Vec<&Row>> = BTreeMap::new();
    for ((label, _), r) in last {
        out.entry(label).or_default().push(r);
    }
    out
}

/// The final-metrics table in markdown (`prefix` labels the rows, for `compare`).
pub fn final_table(runs: &[(String, Vec<Row>)]) -> String {
    let metrics = [
        "eval_accuracy",
        "eval_loss",
        "theta_err",
        "subopt",
        "subopt_pessimistic",
        "subopt_pessimistic_ref",
        "subopt_avg",
        "regret",
        "cum_pair_reward",
    ];
    let present: Vec<&str> = metrics
        .iter()
        .copied()
        .filter(|m| runs.iter().any(|(_, rows)| rows.iter().any(|r| r.values.contains_key(m))))
        .collect();
    let mut s = String::from("| config | seeds |");
    for m in &present {
        s.push_str(&format!(" {m} |"));
    }
    s.push_str(&format!("\n|---|---|{}\n", "---|".repeat(present.len())));
    for (prefix, rows) in runs {
        for (label, fin) in finals(rows) {
            let name = if prefix.is_empty() { label } else { format!("{prefix}: {label}") };
            s.push_str(&format!("| {name} | {} |", fin.len()));
            for m in &present {
                let v: Vec<f64> = fin.iter().filter_map(|r| r.values.get(m).copied()).collect();
                if v.is_empty() {
                    s.push_str(" – |");
                } else {
                    let (mu, sd) = mean_std(&v);
                    // one seed has no spread to show: its value alone
                    if v.len() == 1 {
                        s.push_str(&format!(" {mu:.4} |"));
                    } else {
                        s.push_str(&format!(" {mu:.4} ± {sd:.4} |"));
                    }
                }
            }
            s.push('\n');
        }
    }
    s
}

fn win_table(run: &Path) -> Result<String> {
    let mut s = String::from("| config | chunk win rate | prompt win rate |\n|---|---|---|\n");
    for (label, w) in results::read_winrates(run)? {
        s.push_str(&format!("| {label} | {:.3} | {:.3} |\n", w.chunk_win_rate, w.prompt_win_rate));
    }
    Ok(s)
}

const FONT_PATHS: [&str; 5] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/Library/Fonts/Arial.ttf",
    "C:\\Windows\\Fonts\\arial.ttf",
];

/// Registers a TTF font for the figures: $ONEPASS_FONT, else a few system locations.
fn register_font() -> Result<PathBuf> {
    let candidates: Vec<PathBuf> = std::env::var_os("ONEPASS_FONT")
        .map(PathBuf::from)
        .into_iter()
        .chain(FONT_PATHS.iter().map(PathBuf::from))
        .collect();
    for p in &candidates {
        if let Ok(bytes) = std::fs::read(p) {
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                return Ok(p.clone());
            }
        }
    }
    bail!(
        "no TTF font for the figures: set ONEPASS_FONT to a .ttf file (looked in {})",
        candidates.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
    )
}

/// Draws one figure twice, as `<name>.png` and `<name>.svg` under `out` (plotters' backends are
/// different types, so the body is written once and expanded for each).
macro_rules! png_and_svg {
    ($out:expr, $name:expr, $size:expr, |$root:ident| $body:expr) => {{
        let png = $out.join(format!("{}.png", $name));
        let svg = $out.join(format!("{}.svg", $name));
        {
            let $root = BitMapBackend::new(&png, $size).into_drawing_area();
            $body.with_context(|| format!("drawing {}", png.display()))?;
        }
        {
            let $root = SVGBackend::new(&svg, $size).into_drawing_area();
            $body.with_context(|| format!("drawing {}", svg.display()))?;
        }
    }};
}

/// The y axis of a metric's figure (the figure's title says the rest).
fn axis_name(metric: &str) -> &'static str {
    match metric {
        "train_loss" | "eval_loss" => "logistic loss",
        "eval_accuracy" => "accuracy",
        "theta_err" => "‖θ − θ*‖",
        "subopt" | "subopt_avg" => "SubOpt",
        "regret" => "regret",
        "cost" => "flops per sample",
        "cum_pair_reward" => "cumulative reward",
        "policy_reward" | "bon_reward" => "oracle reward",
        "kendall_tau" => "Kendall τ",
        "kl" | "kl_initial" => "KL (nats)",
        _ => "value",
    }
}

/// A file's name from a path, a `*` pattern or an `hf:` locator (a model's without its extension).
fn short_name(p: &str) -> &str {
    let name = p.rsplit(['/', ':']).next().unwrap_or(p);
    [".gguf", ".safetensors"].iter().find_map(|e| name.strip_suffix(e)).unwrap_or(name)
}

/// What data a run's figures show, in a few words.
fn data_phrase(spec: &crate::spec::Spec) -> String {
    use crate::spec::EnvKind;
    match spec.env.kind {
        EnvKind::Synthetic => {
            format!("synthetic bandit (d = {}, {} contexts × {} arms)", spec.env.dim, spec.env.contexts, spec.env.arms)
        }
        EnvKind::Features => format!(
            "labelled pairs from {}",
            spec.env.path.as_ref().map_or("?".into(), |p| short_name(&p.display().to_string()).to_string())
        ),
        EnvKind::Dataset => match &spec.data {
            Some(d) => format!("{} pairs, φ from {}", short_name(&d.path), short_name(&d.model)),
            None => "a preference dataset".into(),
        },
        EnvKind::Generated => match (&spec.generate, &spec.features) {
            (Some(g), Some(f)) => {
                // a noisy labeller is part of the data: its flip rate in the subtitle
                let oracle = spec.oracle.as_ref().map_or("?".to_string(), |o| {
                    let kind = format!("{:?}", o.kind).to_lowercase();
                    if o.flip > 0.0 {
                        format!("{kind}, labels flipped with p = {}", o.flip)
                    } else {
                        kind
                    }
                });
                let models = if g.policy == f.model {
                    format!("{}: samples and φ", short_name(&g.policy))
                } else {
                    format!("{} samples, φ from {}", short_name(&g.policy), short_name(&f.model))
                };
                format!("{models}, prompts from {}, oracle {oracle}", short_name(&g.prompts))
            }
            _ => "generated responses".into(),
        },
    }
}

/// Every figure of the report (see `figures`); returns their names.
fn draw_figures(
    run: &Path,
    out: &Path,
    rows: &[Row],
    policy: &[Row],
    se: &[Row],
    times: &BTreeMap<String, Vec<(f64, f64)>>,
    spec: Option<&crate::spec::Spec>,
) -> Result<Vec<String>> {
    use crate::spec::Setting;
    let legend_title = match spec.map(|s| s.setting) {
        // labels `estimator / strategy / arm` when several policy arms are swept
        Some(Setting::Deploy) if rows.iter().any(|r| r.label.matches(" / ").count() >= 2) => "strategy / policy arm",
        Some(Setting::Deploy) => "strategy",
        Some(Setting::Active) => "selection rule",
        _ => "config",
    };
    let layout = Layout::new(rows.iter().chain(policy).map(|r| r.label.as_str()), legend_title);
    let seeds = rows.iter().map(|r| r.seed).collect::<std::collections::BTreeSet<_>>().len();
    let name = run.file_name().unwrap_or_default().to_string_lossy();
    // run directories are `<name>-<UTC time>`
    let name = name.rsplit_once('-').map_or(name.as_ref(), |x| x.0);
    let data = spec.map(data_phrase).unwrap_or_default();
    let plural = if seeds == 1 { "" } else { "s" };
    let sub = format!("{name} · {data} · mean ± 1 sd over {seeds} seed{plural} (bands)");
    let mut made = Vec::new();
    // (figures, their rows, the x axis, the file-name prefix)
    type FigureSet<'a> = (&'a [(&'a str, &'a str)], &'a [Row], &'a str, &'a str);
    let sets: [FigureSet<'_>; 2] = [
        (&FIGURES, rows, "samples seen", ""),
        (&POLICY_FIGURES, policy, "chunk (0: before the first update)", "policy_"),
    ];
    for (list, rows, x_title, prefix) in sets {
        for &(metric, title) in list {
            if series(rows, metric).is_empty() {
                continue;
            }
            let fig = LineFigure {
                metric,
                y_title: axis_name(metric),
                title: title.to_string(),
                subtitle: &sub,
                x_title,
                rows,
                layout: &layout,
                band: Band::Sd,
            };
            let size = figures::line_size(figures::panel_count(&fig));
            let file = format!("{prefix}{metric}");
            png_and_svg!(out, file, size, |root| figures::lines(root, &fig));
            made.push(file);
        }
    }
    if !se.is_empty() {
        // a panel per quantity (accuracy; win rate), a colour per config (estimator × strategy)
        let se_layout = Layout::new(se.iter().map(|r| r.label.as_str()), "config");
        let win = se.iter().any(|r| r.label.starts_with(SE_WIN));
        let band = if seeds == 1 {
            "1 seed: no band".to_string()
        } else {
            format!("mean ± 95% t-interval over {seeds} seeds (bands, df = {})", seeds - 1)
        };
        let sub = format!("{name} · {data} · {band}");
        let fig = LineFigure {
            metric: "value",
            y_title: if win { "accuracy / win rate" } else { "accuracy" },
            title: if win {
                "Sample efficiency: held-out reward accuracy and win rate against the base policy".to_string()
            } else {
                "Sample efficiency: held-out reward accuracy".to_string()
            },
            subtitle: &sub,
            x_title: "oracle queries (labelled pairs so far)",
            rows: se,
            layout: &se_layout,
            band: Band::T95,
        };
        let size = figures::line_size(figures::panel_count(&fig));
        png_and_svg!(out, "sample-efficiency", size, |root| figures::lines(root, &fig));
        made.push("sample-efficiency".to_string());
    }
    // Fig. 3c: configs in the plan's order
    let mut order: Vec<&str> = Vec::new();
    for r in rows {
        if !order.contains(&r.label.as_str()) {
            order.push(&r.label);
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let bars: figures::Times = order
        .iter()
        .filter_map(|l| times.get(*l).map(|t| (l.to_string(), t)))
        .map(|(l, t)| {
            let est: Vec<f64> = t.iter().map(|x| x.0).collect();
            let wall: Vec<f64> = t.iter().map(|x| x.1).collect();
            (l, mean(&est), mean(&wall))
        })
        .collect();
    if !bars.is_empty() {
        let size = (1000, 62 + 90 + 34 * bars.len() as u32);
        let sub = format!("{name} · {data} · mean over {seeds} seed{plural}");
        png_and_svg!(out, "time_per_cell", size, |root| figures::time_bars(root, &bars, &sub));
        made.push("time_per_cell".to_string());
    }
    let wpath = run.join("winrates.parquet");
    if wpath.exists() {
        let wins: Vec<(String, f64)> =
            results::read_winrates(run)?.into_iter().map(|(label, w)| (label, w.chunk_win_rate)).collect();
        if !wins.is_empty() {
            let size = figures::heatmap_size(&wins, &layout);
            let sub = format!("{name} · {data} · over {seeds} seed{plural} × chunks");
            png_and_svg!(out, "win_rates", size, |root| figures::win_heatmap(root, &wins, &layout, &sub));
            made.push("win_rates".to_string());
        }
    }
    Ok(made)
}

/// Per label: (estimator seconds, cell wall seconds) of every cell, from timings.parquet.
fn cell_times(run: &Path) -> Result<BTreeMap<String, Vec<(f64, f64)>>> {
    let mut seen: BTreeMap<(String, u32), (f64, f64)> = BTreeMap::new();
    for (k, t) in results::read_timings(run)? {
        seen.insert((k.label, k.seed), (t.estimator_s, t.wall_s));
    }
    let mut out: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for ((label, _), t) in seen {
        out.entry(label).or_default().push(t);
    }
    Ok(out)
}

/// Time per cell (the paper's Fig. 3c reports accuracy and time) and the κ the data showed.
fn time_and_kappa_table(rows: &[Row], times: &BTreeMap<String, Vec<(f64, f64)>>) -> String {
    let mut s = String::from(
        "| config | estimator s / cell | cell wall s | κ = max 1/σ′(zᵀθ) | authors' κ = 1/(min σ′ + 1e-3) |\n|---|---|---|---|---|\n",
    );
    let mut labels: Vec<&String> = times.keys().collect();
    for r in rows {
        if !times.contains_key(&r.label) && !labels.contains(&&r.label) {
            labels.push(&r.label);
        }
    }
    labels.sort();
    labels.dedup();
    let ms = |v: &[f64]| {
        let finite: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
        let inf = v.len() - finite.len();
        if finite.is_empty() && inf == 0 {
            return "–".to_string();
        }
        let mut s = if finite.is_empty() {
            "∞".to_string()
        } else {
            let (m, sd) = mean_std(&finite);
            if finite.len() == 1 {
                if m.abs() < 1e5 {
                    format!("{m:.3}")
                } else {
                    format!("{m:.3e}")
                }
            } else if m.abs() < 1e5 {
                format!("{m:.3} ± {sd:.3}")
            } else {
                format!("{m:.3e} ± {sd:.3e}")
            }
        };
        if inf > 0 {
            s.push_str(&format!(" (∞ in {inf} of {} windows: σ′ underflowed to 0)", v.len()));
        }
        s
    };
    for label in labels {
        let t = times.get(label).cloned().unwrap_or_default();
        let est: Vec<f64> = t.iter().map(|x| x.0).collect();
        let wall: Vec<f64> = t.iter().map(|x| x.1).collect();
        let k: Vec<f64> =
            rows.iter().filter(|r| &r.label == label).filter_map(|r| r.values.get("kappa").copied()).collect();
        let kr: Vec<f64> = rows
            .iter()
            .filter(|r| &r.label == label)
            .filter_map(|r| r.values.get("kappa_reference").copied())
            .filter(|v| *v > 0.0)
            .collect();
        let kmax = k.iter().copied().fold(f64::NAN, f64::max);
        let kmax = if kmax.is_infinite() { "∞".to_string() } else { format!("{kmax:.1}") };
        s.push_str(&format!("| {label} | {} | {} | {} (max {kmax}) | {} |\n", ms(&est), ms(&wall), ms(&k), ms(&kr)));
    }
    s
}

/// The `data` block of meta.json in words (kind = "dataset" and "features").
fn data_summary(meta: &serde_json::Value) -> Option<String> {
    // a synthetic run reads no data: no section
    let d = meta.get("data").filter(|d| !d.is_null())?;
    let ds = d.get("dataset");
    let g =
        |v: Option<&serde_json::Value>, k: &str| v.and_then(|x| x.get(k)).map(|x| x.to_string()).unwrap_or("–".into());
    let mut s = String::from("## Data\n\n");
    s.push_str(&format!(
        "- training pairs {}, held-out pairs {} (`{}`)\n",
        g(Some(d), "train_rows"),
        g(Some(d), "eval_rows"),
        g(Some(d), "path").trim_matches('"')
    ));
    if ds.is_some() {
        s.push_str(&format!(
            "- feature model `{}` (d = {}); degenerate pairs (z = 0) train/held-out {}/{} (dropped: {}); truncated sequences {} (response cut {}); score ties {}; malformed rows skipped {}; held-out pairs also in training {}\n",
            g(ds, "model").trim_matches('"'),
            g(ds, "dim"),
            g(ds, "degenerate_train"),
            g(ds, "degenerate_eval"),
            g(ds, "degenerate_dropped"),
            g(ds, "truncated_sequences"),
            g(ds, "response_cut_sequences"),
            g(ds, "score_ties"),
            g(ds, "malformed_skipped"),
            g(ds, "eval_in_train"),
        ));
        s.push_str(&format!(
            "- feature cache: {} hits, {} misses, {} tokens computed in {} s\n",
            g(ds, "cache_hits"),
            g(ds, "cache_misses"),
            g(ds, "tokens_computed"),
            ds.and_then(|x| x.get("extraction_s")).and_then(|x| x.as_f64()).map_or("–".into(), |v| format!("{v:.1}"))
        ));
    }
    if let Some(c) = d.get("backbone_cost") {
        let a = c.get("authors_schedule");
        let o = c.get("onepass_cache");
        let num = |v: Option<&serde_json::Value>, k: &str| {
            v.and_then(|x| x.get(k)).and_then(|x| x.as_f64()).map_or("–".into(), |x| format!("{x:.3e}"))
        };
        s.push_str(&format!(
            "- backbone cost model: the authors' schedule (φ recomputed for every labelled pair and every evaluation, per cell) needs {} tokens per cell, {} for all cells; the cache computes each sequence once: {} tokens\n",
            num(a, "per_cell_tokens"),
            num(a, "all_cells_tokens"),
            num(o, "tokens_once"),
        ));
    }
    Some(s)
}

/// meta.json's `data_scale` in words: ‖z‖² of the first pairs, each λ against it, the warning.
fn scale_summary(meta: &serde_json::Value) -> Option<String> {
    let d = meta.get("data_scale")?;
    let f = |k: &str| d.get(k).and_then(|v| v.as_f64()).unwrap_or(f64::NAN);
    let mut s = format!(
        "## Data scale\n\n‖z‖² over the first {} pairs: median {:.4}, 90th percentile {:.4}, max {:.4}. λ = \"auto\" resolves to the median. A full step 𝓗⁻¹z moves a margin by about ‖z‖²/λ.\n\n| config | λ of | λ | median ‖z‖² / λ |\n|---|---|---|---|\n",
        d.get("pairs").and_then(|v| v.as_u64()).unwrap_or(0),
        f("median_z_sq"),
        f("p90_z_sq"),
        f("max_z_sq")
    );
    for l in d.get("lambdas")?.as_array()? {
        let auto = if l.get("auto").and_then(|v| v.as_bool()) == Some(true) { " (auto)" } else { "" };
        s.push_str(&format!(
            "| {} | {} | {:.4}{auto} | {:.1} |\n",
            l.get("config").and_then(|v| v.as_str()).unwrap_or("?"),
            l.get("lambda_of").and_then(|v| v.as_str()).unwrap_or("?"),
            l.get("lambda").and_then(|v| v.as_f64()).unwrap_or(f64::NAN),
            l.get("median_z_sq_over_lambda").and_then(|v| v.as_f64()).unwrap_or(f64::NAN),
        ));
    }
    if let Some(w) = d.get("warning").and_then(|v| v.as_str()) {
        s.push_str(&format!("\n**Warning:** {w}.\n"));
    }
    Some(s)
}

/// File-name form of a config label.
fn slug(label: &str) -> String {
    let s: String =
        label.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.=".contains(c) { c } else { '_' }).collect();
    s.split('_').filter(|p| !p.is_empty()).collect::<Vec<_>>().join("_")
}

/// θ of the first seed of every config as `score.weight` (shape [1, d], f32, no bias): the head of
/// transformers' `*ForSequenceClassification` over the feature model. Returns the files written.
pub fn export_heads(run: &Path, out: &Path) -> Result<Vec<PathBuf>> {
    let mut first: BTreeMap<String, (u32, String)> = BTreeMap::new();
    for (k, c) in results::read_cells(run)? {
        if c.status != "ok" {
            continue;
        }
        let e = first.entry(k.label).or_insert((u32::MAX, String::new()));
        if k.seed < e.0 {
            *e = (k.seed, k.cell_id);
        }
    }
    let meta: serde_json::Value = std::fs::read_to_string(run.join("meta.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default();
    let model = meta.pointer("/data/dataset/model").and_then(|v| v.as_str()).unwrap_or("").to_string();
    let dir = out.join("heads");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut written = Vec::new();
    for (label, (seed, cell)) in first {
        let npy = run.join("theta").join(format!("{cell}.npy"));
        if !npy.exists() {
            // an unfinished run (killed while writing its tables): report what exists
            continue;
        }
        let theta = crate::io::read_npy_f64(&npy)?;
        let bytes: Vec<u8> = theta.iter().flat_map(|&v| (v as f32).to_le_bytes()).collect();
        let info: std::collections::BTreeMap<&str, String> = [
            ("label", label.clone()),
            ("seed", seed.to_string()),
            ("cell_id", cell.clone()),
            ("feature_model", model.clone()),
            ("format", "pt".to_string()),
        ]
        .into();
        let data = safetensors_one("score.weight", theta.len(), &bytes, &info);
        let f = dir.join(format!("{}.safetensors", slug(&label)));
        crate::io::write_atomic(&f, &data)?;
        written.push(f);
    }
    Ok(written)
}

/// A safetensors file holding one f32 tensor of shape [1, n] and `metadata`, with the header's
/// keys in a fixed order (the safetensors crate writes its metadata from a HashMap, whose order
/// changes from process to process, so identical reports differed byte for byte).
fn safetensors_one(name: &str, n: usize, bytes: &[u8], metadata: &std::collections::BTreeMap<&str, String>) -> Vec<u8> {
    let header = serde_json::json!({
        "__metadata__": metadata,
        name: { "dtype": "F32", "shape": [1, n], "data_offsets": [0, bytes.len()] },
    });
    // the metadata comes sorted (BTreeMap) and the two top-level keys in a fixed order
    let mut h = header.to_string().into_bytes();
    // the data starts on an 8-byte boundary, the header padded with spaces
    h.resize(h.len().div_ceil(8) * 8, b' ');
    let mut out = Vec::with_capacity(8 + h.len() + bytes.len());
    out.extend_from_slice(&(h.len() as u64).to_le_bytes());
    out.extend_from_slice(&h);
    out.extend_from_slice(bytes);
    out
}

/// Writes `<run>/report/`; returns the report directory.
pub fn report(run: &Path) -> Result<PathBuf> {
    // nothing is written (not even the lock file) before the checks pass: a directory that is
    // not a run is refused as it was found; a running run is named as one
    crate::io::refuse_if_locked(run)?;
    if run.is_dir() && !run.join("metrics.parquet").exists() {
        let why = if run.join("checkpoints").is_dir() {
            "the run has not finished (its cells are in checkpoints/): continue it with `onepass run <its spec, its --set flags> --resume DIR`, then report"
        } else {
            "the run never wrote its tables (or they were removed)"
        };
        bail!("{}: no metrics.parquet: {why}", run.display());
    }
    let rows = read_metrics(run)?;
    if rows.is_empty() {
        bail!("{}: no metric rows (did every cell fail? see cells.parquet)", run.display());
    }
    if !run.join("cells.parquet").exists() {
        bail!("{}: no cells.parquet beside metrics.parquet: the run's tables are incomplete", run.display());
    }
    // one writer: a running `onepass run` or another `report` of this directory holds the lock
    let _lock = crate::io::lock_dir(run)?;
    // a run with a learning policy writes policy.parquet beside metrics.parquet: its absence
    // is a lost file, not a run without a policy
    let learns = std::fs::read_to_string(run.join("spec.resolved.toml"))
        .ok()
        .and_then(|t| toml::from_str::<crate::spec::Spec>(&t).ok())
        .is_some_and(|s| s.policy.is_some() && s.deploy.policy.0.iter().any(|p| p.learns()));
    if learns && !run.join("policy.parquet").exists() {
        bail!(
            "{}: no policy.parquet, though its spec has a learning policy (spec.resolved.toml's deploy.policy): the file was removed or the run's tables are incomplete",
            run.display()
        );
    }
    // written whole into report.tmp/, then renamed over report/: a failed report leaves the old
    // one (or none), never half of a new one
    let done = run.join("report");
    let out = run.join("report.tmp");
    if out.exists() {
        std::fs::remove_dir_all(&out).with_context(|| format!("removing {}", out.display()))?;
    }
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let written = write_report(run, &out, &rows);
    if written.is_err() {
        // a failed report leaves no report.tmp/ behind
        let _ = std::fs::remove_dir_all(&out);
    }
    written?;
    if done.exists() {
        std::fs::remove_dir_all(&done).with_context(|| format!("removing the old {}", done.display()))?;
    }
    std::fs::rename(&out, &done).with_context(|| format!("renaming {} to {}", out.display(), done.display()))?;
    Ok(done)
}

/// meta.json, or None where it is missing (an unfinished run); one warning line naming it
/// when it exists but does not read as JSON (the sections from it are left out).
fn read_meta(run: &Path) -> Option<serde_json::Value> {
    let path = run.join("meta.json");
    let text = std::fs::read_to_string(&path).ok()?;
    match serde_json::from_str(&text) {
        Ok(v) => Some(v),
        Err(e) => {
            eprintln!(
                "onepass: warning: {}: not JSON ({e}): the report leaves out what it holds (the data and its scale)",
                path.display()
            );
            None
        }
    }
}

/// report.md and the figures into `out` (report.tmp/).
fn write_report(run: &Path, out: &Path, rows: &[Row]) -> Result<()> {
    let mut md = format!("# {}\n\n", run.file_name().unwrap_or_default().to_string_lossy());
    if !run.join("meta.json").exists() {
        md.push_str("**This run is unfinished** (no meta.json): the tables below cover what it wrote.\n\n");
    }
    let spec: Option<crate::spec::Spec> =
        std::fs::read_to_string(run.join("spec.resolved.toml")).ok().and_then(|t| toml::from_str(&t).ok());
    if let Some(d) = spec.as_ref().and_then(|s| s.description.as_ref()) {
        md.push_str(&format!("{}\n\n", d.trim()));
    }
    let seeds = rows.iter().map(|r| r.seed).collect::<std::collections::BTreeSet<_>>().len();
    md.push_str(if seeds == 1 {
        "Final metrics of 1 seed (1 seed: no interval).\n\n"
    } else {
        "Final metrics, mean ± std over seeds.\n\n"
    });
    md.push_str(&final_table(&[(String::new(), rows.to_vec())]));
    if run.join("winrates.parquet").exists() {
        md.push_str("\n## Win rates\n\nPer (seed, chunk), the cell with the highest chunk mean of oracle r(a) + r(a′) wins (ties share the win); per (seed, prompt), the same on the pair each cell chose. Over every estimator × strategy cell of the run, so chance is 1 / configs.\n\n");
        md.push_str(&win_table(run)?);
    }
    let policy = if run.join("policy.parquet").exists() { read_policy(run)? } else { Vec::new() };
    if !policy.is_empty() {
        md.push_str(&format!("\n## The policy\n\nOn the held-out prompts, the oracle reward of what each arm deploys (`policy_reward`: a learning policy's samples, best-of-n its pick under θ) after the last chunk against the base policy (chunk 0: the mean of its samples, `sample_reward`, the same for every arm of a seed), both on the seed's sampling streams; their paired difference over seeds with its 95% t-interval (df = seeds − 1) and two-sided p, and the smallest difference detectable at 80% power ((t₀.₉₇₅ + t₀.₈₀)·SE). The t-interval treats the held-out prompts as fixed; the seeds × prompts column resamples seeds and prompts together (the pigeonhole bootstrap, {} resamples, percentile interval; from policy_samples.parquet), so it also covers which prompts were drawn. Best of n under θ and the sequence KL to the initial policy after the last chunk are means over seeds.\n\n", stats::RESAMPLES));
        let cs = policy_comparisons(&policy, read_prompt_grid(run)?.as_ref());
        md.push_str(&policy_table(&cs));
        crate::io::write_atomic(&out.join("policy_comparisons.csv"), policy_csv(&cs).as_bytes())?;
    }
    let times = cell_times(run).unwrap_or_default();
    md.push_str("\n## Time and κ\n\nPer cell, mean ± std over seeds. κ over the samples each estimator trained on (windows between evaluations, all seeds); the paper's appendix reports κ = 171.6 ± 85.5 (Llama-3-8B, UltraFeedback).\n\n");
    md.push_str(&time_and_kappa_table(rows, &times));
    let meta = read_meta(run);
    if let Some(s) = meta.as_ref().and_then(data_summary) {
        md.push('\n');
        md.push_str(&s);
    }
    if let Some(s) = meta.as_ref().and_then(scale_summary) {
        md.push('\n');
        md.push_str(&s);
    }
    // θ over a synthetic bandit's features is the head of no model: no heads
    let synthetic = spec.as_ref().is_some_and(|s| s.env.kind == crate::spec::EnvKind::Synthetic);
    if !synthetic {
        let heads = export_heads(run, out)?;
        md.push_str("\n## Reward heads\n\nθ of the first seed of each config as `score.weight` ([1, d], f32, no bias), the head of transformers' `*ForSequenceClassification` on the feature model:\n\n");
        for h in &heads {
            md.push_str(&format!("- `heads/{}`\n", h.file_name().unwrap_or_default().to_string_lossy()));
        }
    }
    // active and deployment runs: the sample-efficiency figure and its points
    let setting = spec.as_ref().map(|s| s.setting);
    let se = match setting {
        Some(crate::spec::Setting::Active | crate::spec::Setting::Deploy) => {
            let (se, why) = sample_efficiency(run, rows, setting == Some(crate::spec::Setting::Deploy))?;
            crate::io::write_atomic(&out.join("sample-efficiency.csv"), sample_efficiency_csv(&se).as_bytes())?;
            let win = if se.iter().any(|r| r.label.starts_with(SE_WIN)) {
                ", and the win rate of what each config deploys against the base policy (the oracle's noiseless preference between the deployed response and one drawn from the base policy on the same prompt, ties ½, averaged over prompts: chance ½; on generated responses the chunk's prompts and the prompt's n base samples, with a learning policy the held-out prompts against chunk 0's samples) at the oracle queries θ had seen when it picked"
            } else {
                ""
            };
            let band = if seeds == 1 {
                "one seed: no band"
            } else {
                "mean over seeds ± the 95% Student-t interval, df = seeds − 1"
            };
            md.push_str(&format!("\n## Sample efficiency\n\nHeld-out reward accuracy against the number of oracle queries (labelled pairs so far){win} ({band}); the points are `sample-efficiency.csv`.{}\n", why.map_or(String::new(), |w| format!(" {w}."))));
            se
        }
        _ => Vec::new(),
    };
    let figures = match register_font() {
        Ok(_) => draw_figures(run, out, rows, &policy, &se, &times, spec.as_ref())?,
        Err(e) => {
            eprintln!("onepass: {e:#}; writing the tables only");
            Vec::new()
        }
    };
    md.push_str("\n## Figures\n\n");
    for m in &figures {
        md.push_str(&format!("![{m}]({m}.png)\n\n"));
    }
    md.push_str(&failed_cells(run)?);
    crate::io::write_atomic(&out.join("report.md"), md.as_bytes())?;
    Ok(())
}

/// A section naming every failed cell and its error (a failed config is missing from the
/// tables, or averaged over fewer seeds); empty when every cell finished.
fn failed_cells(run: &Path) -> Result<String> {
    let path = run.join("cells.parquet");
    if !path.exists() {
        return Ok(String::new());
    }
    let (mut total, mut lines) = (0, Vec::new());
    for (k, c) in results::read_cells(run)? {
        total += 1;
        if c.status != "ok" {
            let e = c.err.unwrap_or_default();
            lines.push(format!("| {} | {} | {} | {} |", k.cell_id, k.label, k.seed, e.replace('|', "\\|")));
        }
    }
    if lines.is_empty() {
        return Ok(String::new());
    }
    Ok(format!(
        "\n## Failed cells\n\n{} of {total} cells failed: their configs are missing from the tables above, or averaged over fewer seeds.\n\n| cell | config | seed | error |\n|---|---|---|---|\n{}\n",
        lines.len(),
        lines.join("\n")
    ))
}

/// A run as `compare` introduces it: its setting and preset (the spec file and its `--set`
/// flags, from meta.json); "?" where meta.json is missing (an unfinished run).
fn run_line(run: &Path, name: &str) -> String {
    let meta: Option<serde_json::Value> =
        std::fs::read_to_string(run.join("meta.json")).ok().and_then(|t| serde_json::from_str(&t).ok());
    let get = |k: &str| meta.as_ref().and_then(|m| m.get(k)).and_then(|v| v.as_str()).unwrap_or("?").to_string();
    let sets: Vec<String> = meta
        .as_ref()
        .and_then(|m| m.get("overrides"))
        .and_then(|v| v.as_array())
        .map(|a| a.iter().filter_map(|v| v.as_str()).map(|o| format!("--set {o}")).collect())
        .unwrap_or_default();
    let sets = if sets.is_empty() { String::new() } else { format!(" with `{}`", sets.join(" ")) };
    format!("- `{name}`: setting {}, preset `{}`{sets}\n", get("setting"), get("spec_file"))
}

/// Final metrics of several runs side by side, as markdown, after a line per run naming its
/// setting and preset.
pub fn compare(runs: &[PathBuf]) -> Result<String> {
    let mut all = Vec::new();
    let mut policies = String::new();
    let mut intro = String::new();
    for r in runs {
        let name = r.file_name().unwrap_or_default().to_string_lossy().into_owned();
        // what the directory is, before its tables are read: a slice, an unfinished run or no
        // run at all each say so (they were all "opening DIR/metrics.parquet: No such file")
        if !r.join("metrics.parquet").exists() {
            if r.join("slice.json").exists() {
                bail!(
                    "{}: a slice of a run (onepass run --cells i/N), which has no tables: `onepass merge` the slices, then compare the run",
                    r.display()
                );
            }
            if r.join("resume.json").exists() {
                bail!(
                    "{}: the run has not finished (no metrics.parquet; its cells are in checkpoints/): continue it with `onepass run <its spec, its --set flags> --resume DIR`, then compare",
                    r.display()
                );
            }
            bail!("{}: not a onepass run directory (no metrics.parquet, no resume.json)", r.display());
        }
        intro.push_str(&run_line(r, &name));
        all.push((name.clone(), read_metrics(r)?));
        if r.join("policy.parquet").exists() {
            policies.push_str(&format!("\n{name}: the policy on held-out prompts, paired over seeds\n\n"));
            policies.push_str(&policy_table(&policy_comparisons(&read_policy(r)?, read_prompt_grid(r)?.as_ref())));
        }
    }
    Ok(intro + "\n" + &final_table(&all) + &policies)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rows::{Col, METRICS, METRICS_CHUNKED};

    /// Student's t quantiles against the printed tables (two-sided 95%: 12.706 at df 1, 4.303
    /// at 2, 3.182 at 3, 2.262 at 9, 2.042 at 30; 1.960 as df grows), and the normal's 1.645 is
    /// not df 3's (a control).
    #[test]
    fn t_quantiles_match_the_tables() {
        for (df, want) in [(1.0, 12.7062), (2.0, 4.3027), (3.0, 3.1824), (9.0, 2.2622), (30.0, 2.0423), (1e6, 1.9600)] {
            let got = t_quantile(0.975, df);
            assert!((got - want).abs() < 1e-3, "df {df}: {got} vs {want}");
        }
        assert!((t_quantile(0.95, 3.0) - 2.3534).abs() < 1e-3);
        assert!((t_quantile(0.025, 4.0) + 2.7764).abs() < 1e-3, "symmetric");
        assert!((t_quantile(0.95, 3.0) - 1.645).abs() > 0.5);
    }

    /// Comparisons: each arm against the base (chunk 0's sample_reward, not its own chunk-0
    /// pick), arms of one estimator paired by seed, and one arm driven by two estimators paired
    /// by seed; labels that share neither part are not compared (negative control).
    #[test]
    fn comparisons_pair_arms_and_estimators_by_seed() {
        let row = |label: &str, seed: u32, chunk: u64, pr: f64, sr: f64| Row {
            label: label.into(),
            seed,
            samples: chunk,
            values: [("policy_reward", pr), ("sample_reward", sr)].into(),
        };
        let mut rows = Vec::new();
        for (seed, base) in [(0u32, 1.0), (1, 2.0), (2, 4.0)] {
            for (l, gain) in
                [("omd / bq / rloo", 0.5), ("omd / bq / best-of-n", 2.0), ("mle / bq / rloo", 0.25 * seed as f64)]
            {
                // chunk 0: the arm's own pick differs from the base's samples (best-of-n)
                rows.push(row(l, seed, 0, base + 10.0, base));
                rows.push(row(l, seed, 3, base + gain, base + gain));
            }
            rows.push(row("sgd / ucb / dpo", seed, 0, base, base));
            rows.push(row("sgd / ucb / dpo", seed, 3, base, base));
        }
        let cs = policy_comparisons(&rows, None);
        let find = |g: &str, a: &str, b: Option<&str>| {
            cs.iter()
                .find(|c| c.group == g && c.arm == a && c.against.as_deref() == b)
                .unwrap_or_else(|| panic!("{g} {a} {b:?}"))
        };
        assert_eq!(find("omd / bq", "best-of-n", None).paired.mean, 2.0);
        assert_eq!(find("omd / bq", "best-of-n", None).base, Some(7.0 / 3.0));
        let c = find("omd / bq", "best-of-n", Some("rloo"));
        assert_eq!((c.paired.n, c.paired.mean), (3, 1.5));
        let e = find("rloo", "mle / bq", Some("omd / bq"));
        // per seed: 0.25·s − 0.5 → −0.5, −0.25, 0
        assert!((e.paired.mean + 0.25).abs() < 1e-12 && e.paired.se.is_some());
        assert!(!cs
            .iter()
            .any(|c| c.against.is_some() && (c.label.starts_with("sgd") || c.against.as_deref() == Some("sgd / ucb"))));
        let csv = policy_csv(&cs);
        assert_eq!(csv.lines().count(), 1 + cs.len());
        assert!(csv.lines().any(|l| l.starts_with("rloo,mle / bq,omd / bq,3,")), "{csv}");
    }

    /// The console table: base → last per arm with a t-interval over seeds (df = seeds − 1);
    /// one seed prints no interval.
    #[test]
    fn policy_console_gives_t_intervals_and_says_when_there_is_none() {
        let row = |label: &str, seed: u32, chunk: u64, v: f64| Row {
            label: label.into(),
            seed,
            samples: chunk,
            values: [("policy_reward", v)].into(),
        };
        let rows = vec![
            row("sgd / rloo", 0, 0, 1.0),
            row("sgd / rloo", 0, 2, 2.0),
            row("sgd / rloo", 1, 0, 1.0),
            row("sgd / rloo", 1, 2, 3.0),
            row("one", 0, 0, 1.0),
            row("one", 0, 2, 1.5),
        ];
        let t = policy_console(&rows);
        // last: mean 2.5, sd √0.5, se 0.5, t(0.975, 1) = 12.706 → 6.3531
        assert!(t.contains("2.5000 ± 6.3531") && t.contains("+1.5000 ± 6.3531"), "{t}");
        assert!(t.contains("chunk 0 → chunk 2"), "{t}");
        let one = t.lines().find(|l| l.starts_with("one")).unwrap();
        assert!(one.contains("1 seed: no interval") && !one.contains('±'), "{one}");
    }

    /// The report's metrics are columns of the schema in `rows` under their own names (its
    /// figures are named after them), every figure but the computed `cost` has its value, and
    /// the policy figures are policy.parquet columns.
    #[test]
    fn report_reads_the_columns_rows_defines() {
        let float = |cols: &[Col<MetricRow>], n: &str| {
            cols.iter().any(|c| c.name() == n && matches!(c, Col::F64(..) | Col::OptF64(..)))
        };
        for (n, _) in METRIC_VALUES {
            assert!(float(METRICS, n) || float(METRICS_CHUNKED, n), "report reads `{n}`, which rows does not define");
        }
        for (n, _) in FIGURES.iter().filter(|(n, _)| *n != "cost") {
            assert!(METRIC_VALUES.iter().any(|(m, _)| m == n), "figure `{n}` has no value");
        }
        for ((n, _), (m, _)) in POLICY_FIGURES.iter().zip(POLICY_VALUES) {
            assert_eq!(*n, m);
            assert!(crate::rows::POLICY.iter().any(|c| c.name() == m && matches!(c, Col::F64(..))), "`{m}`");
        }
        // negative control
        assert!(!float(METRICS, "no_such_column"));
    }
}
