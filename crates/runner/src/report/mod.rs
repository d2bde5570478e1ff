//! `onepass report <run-dir>` and `onepass compare <run-dir>…`: they only read a run's tables.
//! The report is `report/report.md` (final metrics, mean ± std over seeds) and one PNG + SVG
//! figure per metric against samples seen, with a ±1 std band over seeds; `cost` plots the
//! flops per sample between evaluation points, flat for one-pass estimators and growing for mle.
//! Active and deployment runs add `sample-efficiency.{png,svg,csv}`: held-out reward accuracy
//! (and, in a deployment, the win rate against the base policy) against oracle queries, with a
//! 95% t-interval band over seeds ([`sample_efficiency`]).

use crate::results;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

mod draw;
mod efficiency;
mod figures;
mod heads;
mod policy;
mod row;
pub mod stats;
mod tables;
use draw::{draw_figures, register_font};
pub use efficiency::{sample_efficiency, sample_efficiency_csv, win_vs_base, win_vs_base_online, SE_ACCURACY, SE_WIN};
pub use heads::export_heads;
pub use policy::{
    policy_comparisons, policy_console, policy_csv, policy_table, read_prompt_grid, Comparison, PromptGrid,
};
pub use row::{policy_row, read_metrics, read_policy, Row, FIGURES, POLICY_FIGURES};
pub use stats::t_quantile;
pub use tables::final_table;
use tables::{cell_times, data_summary, scale_summary, time_and_kappa_table, win_table};

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
    let meta = read_meta(run);
    let spec: Option<crate::spec::Spec> =
        std::fs::read_to_string(run.join("spec.resolved.toml")).ok().and_then(|t| toml::from_str(&t).ok());
    if let Some(d) = spec.as_ref().and_then(|s| s.description.as_ref()) {
        md.push_str(&format!("{}\n\n", d.trim()));
        // the description is the preset's words: say what the run changed from it
        let overrides: Vec<String> = meta
            .as_ref()
            .and_then(|m| m.get("overrides").and_then(|o| o.as_array()).cloned())
            .map(|o| o.iter().filter_map(|v| v.as_str().map(|s| format!("`{s}`"))).collect())
            .unwrap_or_default();
        if !overrides.is_empty() {
            md.push_str(&format!(
                "(That is the preset's description; this run was started with --set {}.)\n\n",
                overrides.join(", ")
            ));
        }
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
    let policy = policy_section(run, out, &mut md)?;
    let times = cell_times(run).unwrap_or_default();
    md.push_str("\n## Time and κ\n\nPer cell, mean ± std over seeds. κ over the samples each estimator trained on (windows between evaluations, all seeds); the paper's appendix reports κ = 171.6 ± 85.5 (Llama-3-8B, UltraFeedback).\n\n");
    md.push_str(&time_and_kappa_table(rows, &times));
    if let Some(s) = meta.as_ref().and_then(data_summary) {
        md.push('\n');
        md.push_str(&s);
    }
    if let Some(s) = meta.as_ref().and_then(scale_summary) {
        md.push('\n');
        md.push_str(&s);
    }
    heads_section(run, out, spec.as_ref(), &mut md)?;
    let se = sample_efficiency_section(run, out, rows, spec.as_ref(), seeds, &mut md)?;
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

/// The policy section: each arm's held-out oracle reward after the last chunk against the base
/// policy, paired over seeds, and policy_comparisons.csv; returns the policy rows (none without
/// policy.parquet).
fn policy_section(run: &Path, out: &Path, md: &mut String) -> Result<Vec<Row>> {
    let policy = if run.join("policy.parquet").exists() { read_policy(run)? } else { Vec::new() };
    if !policy.is_empty() {
        md.push_str(&format!("\n## The policy\n\nOn the held-out prompts, the oracle reward of what each arm deploys (`policy_reward`: a learning policy's samples, best-of-n its pick under θ) after the last chunk against the base policy (chunk 0: the mean of its samples, `sample_reward`, the same for every arm of a seed), both on the seed's sampling streams; their paired difference over seeds with its 95% t-interval (df = seeds − 1) and two-sided p, and the smallest difference detectable at 80% power ((t₀.₉₇₅ + t₀.₈₀)·SE). The t-interval treats the held-out prompts as fixed; the seeds × prompts column resamples seeds and prompts together (the pigeonhole bootstrap, {} resamples, percentile interval; from policy_samples.parquet), so it also covers which prompts were drawn. Best of n under θ and the sequence KL to the initial policy after the last chunk are means over seeds.\n\n", stats::RESAMPLES));
        let cs = policy_comparisons(&policy, read_prompt_grid(run)?.as_ref());
        md.push_str(&policy_table(&cs));
        crate::io::write_atomic(&out.join("policy_comparisons.csv"), policy_csv(&cs).as_bytes())?;
    }
    Ok(policy)
}

/// The reward-heads section: θ of each config's first seed exported as a classifier head
/// (none for a synthetic bandit).
fn heads_section(run: &Path, out: &Path, spec: Option<&crate::spec::Spec>, md: &mut String) -> Result<()> {
    // θ over a synthetic bandit's features is the head of no model: no heads
    let synthetic = spec.is_some_and(|s| s.env.kind == crate::spec::EnvKind::Synthetic);
    if !synthetic {
        let heads = export_heads(run, out)?;
        md.push_str("\n## Reward heads\n\nθ of the first seed of each config as `score.weight` ([1, d], f32, no bias), the head of transformers' `*ForSequenceClassification` on the feature model:\n\n");
        for h in &heads {
            md.push_str(&format!("- `heads/{}`\n", h.file_name().unwrap_or_default().to_string_lossy()));
        }
    }
    Ok(())
}

/// The sample-efficiency section of active and deployment runs: held-out accuracy (and win
/// rate) against oracle queries, with sample-efficiency.csv; returns its points (none in the
/// other settings).
fn sample_efficiency_section(
    run: &Path,
    out: &Path,
    rows: &[Row],
    spec: Option<&crate::spec::Spec>,
    seeds: usize,
    md: &mut String,
) -> Result<Vec<Row>> {
    // active and deployment runs: the sample-efficiency figure and its points
    let setting = spec.map(|s| s.setting);
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
    Ok(se)
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
