//! The policy on held-out prompts: per-prompt rewards (policy_samples.parquet), each arm
//! against the base policy and arms against each other paired over seeds, as the console's
//! table, report.md's table and `policy_comparisons.csv`.

use super::row::{series, Row};
use super::stats::{self, mean_std, mean_t95};
use crate::results;
use anyhow::Result;
use std::collections::BTreeMap;
use std::path::Path;

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
