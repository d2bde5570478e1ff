//! The `onepass` runner: TOML specs ([`spec`]) validated into plans of cells ([`plan`]), the
//! synthetic dueling bandit ([`env`]), the three settings ([`settings`]), and the run
//! directory with its parquet tables ([`results`]). `main.rs` is the thin CLI over [`run`].
//!
//! This crate is the only place that knows about files, TOML, parquet and the command line;
//! `estimators` and `selection` are pure maths.

pub mod bench;
pub mod checkpoint;
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

/// How a run ended, for the exit code: 0 all cells ok, 1 some cell failed (2 is bad input,
/// reported as an error before any cell runs; 130 interrupted by SIGINT/SIGTERM after the
/// running cells wrote their checkpoints).
#[derive(Debug)]
pub struct RunSummary {
    pub dir: PathBuf,
    pub failed: usize,
    pub cells: usize,
    /// Stopped by SIGINT/SIGTERM: nothing final was written; `--resume` continues.
    pub interrupted: bool,
}

/// Options of `onepass run`.
pub struct RunOptions {
    pub spec: PathBuf,
    pub overrides: Vec<String>,
    pub out: PathBuf,
    pub threads: Option<usize>,
    /// Continue this run directory (its finished cells are kept, checkpointed cells resume).
    pub resume: Option<PathBuf>,
    /// Resume even when the spec, code revision or data differ from the run's.
    pub force: bool,
}

/// Parses and validates a spec (errors are [`spec::SpecError`]).
pub fn load_plan(path: &Path, overrides: &[String]) -> Result<plan::Plan, spec::SpecError> {
    let (s, text) = spec::load(path, overrides)?;
    plan::build(s, path, &text)
}

/// A finished (or failed) cell as `checkpoints/<cell>.done` keeps it until the run's tables exist.
#[derive(serde::Serialize, serde::Deserialize)]
struct DoneCell {
    result: std::result::Result<settings::CellResult, String>,
    wall_s: f64,
}

/// The run directory: a fresh one, or `--resume`'s after checking it is this run.
fn open_run_dir(opts: &RunOptions, plan: &plan::Plan, id: &checkpoint::RunIdentity) -> Result<PathBuf> {
    let Some(dir) = &opts.resume else {
        let dir = results::make_run_dir(&opts.out, &plan.name)?;
        let resolved = toml::to_string(&plan.resolved_spec()).context("serialising the resolved spec")?;
        results::write_atomic(&dir.join("spec.resolved.toml"), resolved.as_bytes())?;
        results::write_atomic(&dir.join("resume.json"), serde_json::to_string_pretty(id)?.as_bytes())?;
        std::fs::create_dir(dir.join("checkpoints"))
            .with_context(|| format!("creating {}/checkpoints", dir.display()))?;
        return Ok(dir);
    };
    let manifest = dir.join("resume.json");
    let text = std::fs::read_to_string(&manifest).with_context(|| {
        format!(
            "--resume {}: no resume.json there (not a onepass run directory, or one made before resume existed)",
            dir.display()
        )
    })?;
    let theirs: checkpoint::RunIdentity =
        serde_json::from_str(&text).with_context(|| format!("{}: not a run identity", manifest.display()))?;
    if let Some(why) = id.mismatch(&theirs) {
        if opts.force {
            eprintln!("onepass: warning: resuming {} although {why} (--force)", dir.display());
        } else {
            anyhow::bail!("--resume {}: refused: {why}; pass --force to resume anyway", dir.display());
        }
    }
    if dir.join("meta.json").exists() {
        return Ok(dir.clone());
    }
    for sub in ["theta", "checkpoints"] {
        std::fs::create_dir_all(dir.join(sub)).with_context(|| format!("creating {}/{sub}", dir.display()))?;
    }
    let n = checkpoint::remove_temporaries(dir)?;
    if n > 0 {
        eprintln!("onepass: removed {n} half-written temporary file(s) of the killed run");
    }
    Ok(dir.clone())
}

/// Runs one cell of a run directory: a finished cell is read back, a checkpointed one
/// resumes, any other starts; the result is kept as `checkpoints/<cell>.done` until the tables
/// are written.
fn run_one<'p>(
    plan: &'p plan::Plan,
    cell: &'p plan::CellPlan,
    dir: &Path,
    fingerprint: &str,
    force: bool,
) -> Result<results::CellOutcome<'p>> {
    let config = &plan.configs[cell.config];
    let done_path = dir.join("checkpoints").join(format!("{}.done", cell.cell_id));
    let ckpt_path = dir.join("checkpoints").join(format!("{}.ckpt", cell.cell_id));
    let what = format!("cell {}", cell.cell_id);
    if done_path.exists() {
        let d: DoneCell = checkpoint::decode(&done_path, fingerprint, &what, force)?;
        return Ok(results::CellOutcome {
            cell_id: &cell.cell_id,
            config,
            seed: cell.seed,
            result: d.result,
            wall_s: d.wall_s,
        });
    }
    if checkpoint::stop_requested() {
        return Err(checkpoint::Interrupted.into());
    }
    let mut ctx = settings::CellCtx {
        saver: checkpoint::CellSaver::new(ckpt_path.clone(), fingerprint, &what, &plan.spec.checkpoint),
        resume: None,
    };
    if ckpt_path.exists() {
        ctx.resume = Some(checkpoint::decode(&ckpt_path, fingerprint, &what, force)?);
    }
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        settings::run_cell_with(plan, config, cell.seed, &mut ctx)
    }))
    .unwrap_or_else(|p| {
        let msg = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
        Err(anyhow::anyhow!("the cell panicked: {}", msg.unwrap_or_default()))
    });
    let result = match result {
        Err(e) if e.is::<checkpoint::Interrupted>() => return Err(e),
        r => r.map_err(|e| format!("{e:#}")),
    };
    if let Err(e) = &result {
        eprintln!("onepass: cell {} ({}, seed {}) failed: {e}", cell.cell_id, config.label, cell.seed);
    }
    let done = DoneCell { result, wall_s: ctx.saver.wall_s() };
    results::write_atomic(&done_path, &checkpoint::encode(fingerprint, &what, &done)?)?;
    if ckpt_path.exists() {
        std::fs::remove_file(&ckpt_path).with_context(|| format!("removing {}", ckpt_path.display()))?;
    }
    checkpoint::failpoint("cell-end");
    Ok(results::CellOutcome {
        cell_id: &cell.cell_id,
        config,
        seed: cell.seed,
        result: done.result,
        wall_s: done.wall_s,
    })
}

/// Runs every cell of a plan and writes the run directory (or continues `opts.resume`).
pub fn run(opts: &RunOptions) -> Result<RunSummary> {
    let plan = load_plan(&opts.spec, &opts.overrides)?;
    let started = humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string();
    let id = checkpoint::RunIdentity::of(&plan)?;
    let fingerprint = id.fingerprint();
    let dir = open_run_dir(opts, &plan, &id)?;
    if dir.join("meta.json").exists() {
        eprintln!("onepass: {} is complete (meta.json exists): nothing to resume", dir.display());
        let meta: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json"))?)
            .with_context(|| format!("{}/meta.json: not JSON", dir.display()))?;
        let failed = meta.get("failed_cells").and_then(|v| v.as_u64()).unwrap_or(0) as usize;
        return Ok(RunSummary { dir, failed, cells: plan.cells.len(), interrupted: false });
    }
    // every checkpoint left by a killed run is checked before any cell starts
    for cell in &plan.cells {
        let what = format!("cell {}", cell.cell_id);
        for ext in ["done", "ckpt"] {
            let p = dir.join("checkpoints").join(format!("{}.{ext}", cell.cell_id));
            if p.exists() {
                checkpoint::verify(&p, &fingerprint, &what, opts.force)?;
            }
        }
    }
    checkpoint::install_signal_handlers()?;
    let threads = opts.threads.unwrap_or(plan.spec.threads);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().context("starting the worker threads")?;
    eprintln!(
        "onepass: {} cells ({} configs × {} seeds) → {}{}",
        plan.cells.len(),
        plan.configs.len(),
        plan.spec.seeds,
        dir.display(),
        if opts.resume.is_some() { " (resumed)" } else { "" }
    );
    let outcomes: Vec<Result<results::CellOutcome<'_>>> = pool
        .install(|| plan.cells.par_iter().map(|cell| run_one(&plan, cell, &dir, &fingerprint, opts.force)).collect());
    let mut interrupted = false;
    let mut ok = Vec::with_capacity(outcomes.len());
    for o in outcomes {
        match o {
            Ok(o) => ok.push(o),
            Err(e) if e.is::<checkpoint::Interrupted>() => interrupted = true,
            Err(e) => return Err(e),
        }
    }
    if interrupted {
        eprintln!(
            "onepass: interrupted; {} of {} cells finished, the others checkpointed. Continue with:\n  onepass run {} --resume {}",
            ok.len(),
            plan.cells.len(),
            opts.spec.display(),
            dir.display()
        );
        return Ok(RunSummary { dir, failed: 0, cells: plan.cells.len(), interrupted: true });
    }
    let outcomes = ok;
    let schemas = results::write_tables(&dir, &plan, &outcomes).with_context(|| {
        format!(
            "the finished cells are kept in {}/checkpoints: fix this, then `onepass run {} --resume {}`",
            dir.display(),
            opts.spec.display(),
            dir.display()
        )
    })?;
    results::write_atomic(&dir.join("schema.json"), results::schema_json(&schemas).as_bytes())?;
    let failed = outcomes.iter().filter(|o| o.result.is_err()).count();
    let meta = serde_json::json!({
        "onepass_version": env!("CARGO_PKG_VERSION"),
        "git_revision": env!("ONEPASS_GIT_REV"),
        "git_dirty": env!("ONEPASS_GIT_DIRTY"),
        "spec_file": opts.spec.display().to_string(),
        "overrides": opts.overrides,
        "resumed": opts.resume.is_some(),
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
    // complete: what resume needed is now in the tables
    let p = dir.join("checkpoints");
    if p.exists() {
        std::fs::remove_dir_all(&p).with_context(|| format!("removing {}", p.display()))?;
    }
    print_summary(&plan, &outcomes);
    Ok(RunSummary { dir, failed, cells: outcomes.len(), interrupted: false })
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
