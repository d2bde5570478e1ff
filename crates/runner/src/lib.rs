//! The `onepass` runner: TOML specs ([`spec`]) validated into plans of cells ([`plan`]), the
//! synthetic dueling bandit ([`env`]), the three settings ([`settings`]), and the run
//! directory with its parquet tables ([`results`]). `main.rs` is the thin CLI over [`run`].
//!
//! This crate is the only place that knows about files, TOML, parquet and the command line;
//! `estimators` and `selection` are pure maths.

pub mod bench;
pub mod dataset_env;
pub mod datasets;
pub mod env;
pub mod extract;
pub mod generated;
pub mod pairs;
pub mod plan;
pub mod report;
pub mod results;
pub mod settings;
pub mod spec;

use anyhow::{Context, Result};
use rayon::prelude::*;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// How a run ended, for the exit code: 0 all cells ok, 1 some cell failed (2 is bad input,
/// reported as an error before any cell runs).
#[derive(Debug)]
pub struct RunSummary {
    pub dir: PathBuf,
    pub failed: usize,
    pub cells: usize,
}

/// Options of `onepass run`.
pub struct RunOptions {
    pub spec: PathBuf,
    pub overrides: Vec<String>,
    pub out: PathBuf,
    pub threads: Option<usize>,
}

/// Parses and validates a spec (errors are [`spec::SpecError`]).
pub fn load_plan(path: &Path, overrides: &[String]) -> Result<plan::Plan, spec::SpecError> {
    let (s, text) = spec::load(path, overrides)?;
    plan::build(s, path, &text)
}

/// Runs every cell of a plan and writes the run directory.
pub fn run(opts: &RunOptions) -> Result<RunSummary> {
    let plan = load_plan(&opts.spec, &opts.overrides)?;
    let started = humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string();
    let dir = results::make_run_dir(&opts.out, &plan.name)?;
    let resolved = toml::to_string(&plan.resolved_spec()).context("serialising the resolved spec")?;
    results::write_atomic(&dir.join("spec.resolved.toml"), resolved.as_bytes())?;
    let threads = opts.threads.unwrap_or(plan.spec.threads);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().context("starting the worker threads")?;
    eprintln!(
        "onepass: {} cells ({} configs × {} seeds) → {}",
        plan.cells.len(),
        plan.configs.len(),
        plan.spec.seeds,
        dir.display()
    );
    let outcomes: Vec<results::CellOutcome<'_>> = pool.install(|| {
        plan.cells
            .par_iter()
            .map(|cell| {
                let config = &plan.configs[cell.config];
                let t0 = Instant::now();
                let result = std::panic::catch_unwind(|| settings::run_cell(&plan, config, cell.seed))
                    .unwrap_or_else(|p| {
                        let msg = p
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
                        Err(anyhow::anyhow!("the cell panicked: {}", msg.unwrap_or_default()))
                    })
                    .map_err(|e| format!("{e:#}"));
                if let Err(e) = &result {
                    eprintln!("onepass: cell {} ({}, seed {}) failed: {e}", cell.cell_id, config.label, cell.seed);
                }
                results::CellOutcome {
                    cell_id: &cell.cell_id,
                    config,
                    seed: cell.seed,
                    result,
                    wall_s: t0.elapsed().as_secs_f64(),
                }
            })
            .collect()
    });
    let schemas = results::write_tables(&dir, &plan, &outcomes)?;
    results::write_atomic(&dir.join("schema.json"), results::schema_json(&schemas).as_bytes())?;
    let failed = outcomes.iter().filter(|o| o.result.is_err()).count();
    let meta = serde_json::json!({
        "onepass_version": env!("CARGO_PKG_VERSION"),
        "git_revision": env!("ONEPASS_GIT_REV"),
        "git_dirty": env!("ONEPASS_GIT_DIRTY"),
        "spec_file": opts.spec.display().to_string(),
        "overrides": opts.overrides,
        "master_seed": plan.spec.master_seed,
        "seeds": plan.spec.seeds,
        "setting": plan.spec.setting.as_str(),
        "data": plan.data.as_ref().map(|d| serde_json::json!({
            "path": d.train_path.display().to_string(),
            "blake3": d.train.digest,
            "train_rows": d.train.len(),
            "eval_path": d.eval_path.as_ref().map(|p| p.display().to_string()),
            "eval_blake3": d.eval_path.as_ref().map(|_| d.eval.digest.clone()),
            "eval_rows": d.eval.len(),
            "dim": d.d,
            "dataset": d.report,
            "backbone_cost": backbone_cost(&plan),
        })),
        "generated": plan.generated.as_ref().map(|g| serde_json::to_value(&g.report).unwrap_or_default()),
        "cells": plan.cells.len(),
        "failed_cells": failed,
        "threads": pool.current_num_threads(),
        "host": std::fs::read_to_string("/etc/hostname").map(|s| s.trim().to_string()).unwrap_or_default(),
        "os": std::env::consts::OS,
        "arch": std::env::consts::ARCH,
        "crates": { "estimators": env!("CARGO_PKG_VERSION"), "selection": env!("CARGO_PKG_VERSION"), "runner": env!("CARGO_PKG_VERSION") },
        "started": started,
        "finished": humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
    });
    results::write_atomic(&dir.join("meta.json"), serde_json::to_string_pretty(&meta)?.as_bytes())?;
    print_summary(&plan, &outcomes);
    Ok(RunSummary { dir, failed, cells: outcomes.len() })
}

/// Final metrics per config, mean over seeds.
fn print_summary(plan: &plan::Plan, outcomes: &[results::CellOutcome<'_>]) {
    if plan.generated.is_some() && plan.spec.setting == spec::Setting::Deploy {
        return print_deploy_summary(plan, outcomes);
    }
    eprintln!("{:<44} {:>8} {:>10} {:>10} {:>12}", "config", "eval_acc", "theta_err", "subopt", "regret");
    for c in &plan.configs {
        let finals: Vec<&settings::MetricRow> = outcomes
            .iter()
            .filter(|o| o.config.config_id == c.config_id)
            .filter_map(|o| o.result.as_ref().ok().and_then(|r| r.rows.last()))
            .collect();
        if finals.is_empty() {
            eprintln!("{:<44} (every seed failed)", c.label);
            continue;
        }
        let n = finals.len() as f64;
        let mean = |f: &dyn Fn(&settings::MetricRow) -> f64| finals.iter().map(|r| f(r)).sum::<f64>() / n;
        let opt = |f: &dyn Fn(&settings::MetricRow) -> Option<f64>, digits: usize| {
            if f(finals[0]).is_some() {
                format!("{:.digits$}", mean(&|r| f(r).unwrap_or(f64::NAN)))
            } else {
                "-".into()
            }
        };
        eprintln!(
            "{:<44} {:>8.4} {:>10} {:>10} {:>12}",
            c.label,
            mean(&|r| r.eval_accuracy),
            opt(&|r| r.theta_err, 4),
            opt(&|r| r.subopt, 4),
            opt(&|r| r.regret, 3)
        );
    }
}

/// Chunked deployment: cumulative metrics at the last chunk (mean over seeds) and win rates.
fn print_deploy_summary(plan: &plan::Plan, outcomes: &[results::CellOutcome<'_>]) {
    let wins = results::win_rates(plan, outcomes);
    eprintln!(
        "{:<34} {:>9} {:>9} {:>9} {:>8} {:>8} {:>7} {:>7}",
        "config", "cum_pair", "mean_rew", "regret", "policy", "tau", "win/ch", "win/pr"
    );
    for c in &plan.configs {
        let finals: Vec<&settings::MetricRow> = outcomes
            .iter()
            .filter(|o| o.config.config_id == c.config_id)
            .filter_map(|o| o.result.as_ref().ok().and_then(|r| r.rows.last()))
            .collect();
        if finals.is_empty() {
            eprintln!("{:<34} (every seed failed)", c.label);
            continue;
        }
        let n = finals.len() as f64;
        let mean =
            |f: &dyn Fn(&settings::MetricRow) -> Option<f64>| finals.iter().filter_map(|r| f(r)).sum::<f64>() / n;
        // the mean over the run of the chunks' policy reward and τ
        let all: Vec<&settings::MetricRow> = outcomes
            .iter()
            .filter(|o| o.config.config_id == c.config_id)
            .filter_map(|o| o.result.as_ref().ok())
            .flat_map(|r| r.rows.iter())
            .collect();
        let avg = |f: &dyn Fn(&settings::MetricRow) -> Option<f64>| {
            all.iter().filter_map(|r| f(r)).sum::<f64>() / all.len().max(1) as f64
        };
        let w = &wins[c.config_id];
        eprintln!(
            "{:<34} {:>9.3} {:>9.4} {:>9.2} {:>8.4} {:>8.3} {:>7.3} {:>7.3}",
            c.label,
            mean(&|r| r.cum_pair_reward),
            mean(&|r| r.mean_reward),
            mean(&|r| r.regret),
            avg(&|r| r.policy_reward),
            avg(&|r| r.kendall_tau),
            w.chunk_wins / w.chunks.max(1) as f64,
            w.prompt_wins / w.prompts.max(1) as f64
        );
    }
}

/// kind = "dataset": how many backbone forward passes (sequences and tokens) the run's methods
/// would need under the authors' schedule — the frozen LLM re-run on every training batch and on
/// the held-out set at every evaluation, for every cell (reference-code.md §1.6) — against
/// onepass's cache, where each distinct sequence is computed once for every cell, seed and later
/// run. A cost model to discuss timing claims with, not a measurement.
fn backbone_cost(plan: &plan::Plan) -> Option<serde_json::Value> {
    let d = plan.data.as_ref()?;
    let r = d.report.as_ref()?;
    let get = |k: &str| r.get(k).and_then(|v| v.as_u64()).unwrap_or(0) as f64;
    let (train_pairs, eval_pairs) = (get("train_pairs").max(1.0), get("eval_pairs"));
    let (train_tok, eval_tok) = (get("train_tokens"), get("eval_tokens"));
    let s = &plan.spec.stream;
    let samples = s.samples as f64;
    let evals = (s.samples / s.eval_every + u64::from(s.samples % s.eval_every != 0)) as f64;
    // pairs pushed through the backbone per labelled sample: 1, or the stream rule's candidates/keep
    let per_sample = |c: &plan::ConfigPlan| match c.rule {
        Some(spec::ActiveRule::Stream) => plan.spec.active.candidates as f64 / plan.spec.active.keep.max(1) as f64,
        _ => 1.0,
    };
    let cost = |c: &plan::ConfigPlan| {
        let seq = 2.0 * samples * per_sample(c) + 2.0 * eval_pairs * evals;
        let tok = samples * per_sample(c) * train_tok / train_pairs + eval_tok * evals;
        (seq, tok)
    };
    let (cell_seq, cell_tok) = cost(&plan.configs[0]);
    let (all_seq, all_tok) =
        plan.cells.iter().map(|c| cost(&plan.configs[c.config])).fold((0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1));
    Some(serde_json::json!({
        "authors_schedule": {
            "per_cell_sequences": cell_seq,
            "per_cell_tokens": cell_tok,
            "all_cells_sequences": all_seq,
            "all_cells_tokens": all_tok,
        },
        "onepass_cache": {
            "sequences_once": 2.0 * (train_pairs + eval_pairs),
            "tokens_once": train_tok + eval_tok,
            "tokens_computed_this_run": get("tokens_computed"),
            "extraction_s_this_run": r.get("extraction_s"),
        },
    }))
}
