//! report.md's markdown tables and sections: final metrics (also `compare`'s), win rates, time
//! and κ per config, and meta.json's data and data-scale summaries.

use super::row::Row;
use super::stats::mean_std;
use crate::results;
use anyhow::Result;
use std::collections::BTreeMap;
use std::path::Path;

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

pub(super) fn win_table(run: &Path) -> Result<String> {
    let mut s = String::from("| config | chunk win rate | prompt win rate |\n|---|---|---|\n");
    for (label, w) in results::read_winrates(run)? {
        s.push_str(&format!("| {label} | {:.3} | {:.3} |\n", w.chunk_win_rate, w.prompt_win_rate));
    }
    Ok(s)
}

/// Per label: (estimator seconds, cell wall seconds) of every cell, from timings.parquet.
pub(super) fn cell_times(run: &Path) -> Result<BTreeMap<String, Vec<(f64, f64)>>> {
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
pub(super) fn time_and_kappa_table(rows: &[Row], times: &BTreeMap<String, Vec<(f64, f64)>>) -> String {
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
        let kmax = if kmax.is_infinite() {
            "∞".to_string()
        } else if kmax.abs() >= 1e6 {
            format!("{kmax:.3e}")
        } else {
            format!("{kmax:.1}")
        };
        s.push_str(&format!("| {label} | {} | {} | {} (max {kmax}) | {} |\n", ms(&est), ms(&wall), ms(&k), ms(&kr)));
    }
    s
}

/// The `data` block of meta.json in words (kind = "dataset" and "features").
pub(super) fn data_summary(meta: &serde_json::Value) -> Option<String> {
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
pub(super) fn scale_summary(meta: &serde_json::Value) -> Option<String> {
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
