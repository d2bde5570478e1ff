//! The report's row (a cell's values at one x) and the tables' columns it reads:
//! metrics.parquet's (with the computed `cost`) and policy.parquet's, and the per-label series.

use crate::results;
use crate::rows::{MetricRow, PolicyRow};
use anyhow::Result;
use std::collections::BTreeMap;
use std::path::Path;

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

/// A policy evaluation as the report's row (x: the chunk): the console's table, built from
/// the cells in memory, and the report's, read from policy.parquet, see the same values.
pub fn policy_row(label: String, seed: u32, r: &PolicyRow) -> Row {
    Row { label, seed, samples: r.chunk, values: POLICY_VALUES.iter().map(|(n, get)| (*n, get(r))).collect() }
}

/// A run's policy.parquet as rows whose x is the chunk.
pub fn read_policy(run: &Path) -> Result<Vec<Row>> {
    Ok(results::read_policy(run)?.into_iter().map(|(k, r)| policy_row(k.label, k.seed, &r)).collect())
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

/// label → samples → values over seeds, for one metric.
pub(super) fn series(rows: &[Row], metric: &str) -> BTreeMap<String, BTreeMap<u64, Vec<f64>>> {
    let mut out: BTreeMap<String, BTreeMap<u64, Vec<f64>>> = BTreeMap::new();
    for r in rows {
        if let Some(&v) = r.values.get(metric) {
            out.entry(r.label.clone()).or_default().entry(r.samples).or_default().push(v);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rows::{Col, METRICS, METRICS_CHUNKED};

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
