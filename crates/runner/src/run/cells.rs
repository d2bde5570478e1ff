//! Running the cells: one cell read back, resumed or started under its checkpoint's key, all of
//! a process's cells on the pool, and a failed cell's error as one line.

use super::dir::DoneCell;
use super::options::{resume_command, RunOptions, RunSummary};
use crate::plan::{CellPlan, ConfigPlan, Plan};
use crate::progress::Meter;
use crate::settings::{self, CellCtx, CellSaver, Live};
use crate::world::World;
use crate::{io, results};
use anyhow::{Context, Result};
use rayon::prelude::*;
use std::path::Path;

/// A failed cell's error as one line (cells.parquet's `err`, the run's log): the chain as
/// `{:#}` writes it, without the backtraces candle appends to its errors when RUST_BACKTRACE is
/// set (frame lines `N: symbol` and `at file:line`), its other line breaks joined by ": ". A
/// device that ran out of memory says what to lower.
pub fn cell_error(e: &anyhow::Error) -> String {
    let text = format!("{e:#}");
    let frame = |l: &str| {
        let t = l.trim_start();
        t.starts_with("at ") && l.len() > t.len()
            || t.split_once(": ").is_some_and(|(n, _)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
                && l.len() > t.len()
    };
    let mut out =
        text.lines().map(str::trim_end).filter(|l| !l.trim().is_empty() && !frame(l)).collect::<Vec<_>>().join(": ");
    if out.contains("CUDA_ERROR_OUT_OF_MEMORY") {
        out.push_str(
            " — the GPU ran out of memory: run fewer cells on it at once (--threads, one process per GPU), \
             lower reward.pairs_per_pass or policy.minibatch, or give --max-gpu-memory what is free for this run",
        );
    }
    out
}

/// What a cell's checkpoint is of: "cell <id> (<digest of its config and seed>)", so that a
/// checkpoint of another config of the cell is never continued.
pub(super) fn cell_what(shared: &str, config: &ConfigPlan, cell: &CellPlan) -> String {
    let id = format!("{shared} {:?}", (&config.cfg, &config.init, &config.strategy, &config.rule, cell.seed));
    format!("cell {} ({})", cell.cell_id, &blake3::hash(id.as_bytes()).to_hex()[..16])
}

/// A digest of everything of the spec that every cell shares (the spec without its estimator
/// tables, `threads` and `[checkpoint]`): a change there makes every cell's state another's.
pub(super) fn shared_digest(world: &World) -> Result<String> {
    let mut s = world.spec.clone();
    s.estimators.clear();
    s.threads = 0;
    s.checkpoint = Default::default();
    s.track = Default::default();
    let text = toml::to_string(&s).context("serialising the resolved spec")?;
    Ok(blake3::hash(text.as_bytes()).to_hex()[..16].to_string())
}

/// Runs one cell of a run directory: a finished cell is read back, a checkpointed one
/// resumes, any other starts; the result is kept as `checkpoints/<cell>.done` until the tables
/// are written.
fn run_one<'p>(
    plan: &'p Plan,
    world: &World,
    cell: &'p CellPlan,
    dir: &Path,
    (fingerprint, shared): (&str, &str),
    force: bool,
) -> Result<results::CellOutcome<'p>> {
    let config = &plan.configs[cell.config];
    let done_path = dir.join("checkpoints").join(format!("{}.done", cell.cell_id));
    let ckpt_path = dir.join("checkpoints").join(format!("{}.ckpt", cell.cell_id));
    let what = cell_what(shared, config, cell);
    // with --force, a cell whose config changed starts again (its old state is another config's)
    let stale = |p: &Path| {
        eprintln!("onepass: cell {} ({}): its config changed (--force): starting it again", cell.cell_id, config.label);
        std::fs::remove_file(p).with_context(|| format!("removing {}", p.display()))
    };
    if done_path.exists() {
        match io::decode_unless_stale::<DoneCell>(&done_path, fingerprint, &what, force)? {
            Some(d) => {
                return Ok(results::CellOutcome {
                    cell_id: &cell.cell_id,
                    config,
                    seed: cell.seed,
                    result: d.result,
                    wall_s: d.wall_s,
                })
            }
            None => stale(&done_path)?,
        }
    }
    if io::stop_requested() {
        return Err(io::Interrupted.into());
    }
    let live = match plan.spec.track.tensorboard {
        true => Live::to(dir.join("tb").join(&cell.cell_id)),
        false => Live::off(),
    };
    let mut ctx = CellCtx {
        saver: CellSaver::new(ckpt_path.clone(), fingerprint, &what, &plan.spec.checkpoint),
        resume: None,
        live,
    };
    if ckpt_path.exists() {
        ctx.resume = io::decode_unless_stale(&ckpt_path, fingerprint, &what, force)?;
        if ctx.resume.is_none() {
            stale(&ckpt_path)?;
        }
    }
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // the config resolved for its cells (the outcome names the plan's)
        settings::run_cell_with(world, &world.configs[cell.config], cell.seed, &mut ctx)
    }))
    .unwrap_or_else(|p| {
        let msg = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
        Err(anyhow::anyhow!("the cell panicked: {}", msg.unwrap_or_default()))
    });
    // a stop or a failed write into the run directory (a checkpoint on a full disk) is the
    // run's, not the cell's: the cell keeps its last checkpoint and the run stays resumable
    let result = match result {
        Err(e) if e.is::<io::Interrupted>() || io::is_storage(&e) => return Err(e),
        r => r.map_err(|e| cell_error(&e)),
    };
    if let Err(e) = &result {
        eprintln!("onepass: cell {} ({}, seed {}) failed: {e}", cell.cell_id, config.label, cell.seed);
    }
    let done = DoneCell { result, wall_s: ctx.saver.wall_s() };
    io::write_atomic(&done_path, &io::encode(fingerprint, &what, &done)?)?;
    if ckpt_path.exists() {
        std::fs::remove_file(&ckpt_path).with_context(|| format!("removing {}", ckpt_path.display()))?;
    }
    io::failpoint("cell-end");
    Ok(results::CellOutcome {
        cell_id: &cell.cell_id,
        config,
        seed: cell.seed,
        result: done.result,
        wall_s: done.wall_s,
    })
}

/// How the cells of [`run_cells`] ended: all finished (failed cells included), or stopped by an
/// interrupt (a summary to return: the others are checkpointed).
pub(super) enum Ran<'p> {
    All(Vec<results::CellOutcome<'p>>),
    Stopped(RunSummary),
}

/// Runs `mine` on `pool` with a progress meter. An interrupt stops the run with its resume
/// command; a full disk is an error that says how many cells finished and how to resume.
pub(super) fn run_cells<'p>(
    opts: &RunOptions,
    plan: &'p Plan,
    world: &World,
    mine: &[&'p CellPlan],
    dir: &Path,
    pool: &rayon::ThreadPool,
    keys: (&str, &str),
) -> Result<Ran<'p>> {
    io::install_signal_handlers()?;
    let slice_note =
        opts.slice.map_or(String::new(), |s| format!(", slice {}/{}: {} of them", s.index, s.count, mine.len()));
    eprintln!(
        "onepass: {} cells ({} configs × {} seed{}{slice_note}) → {}{}",
        plan.cells.len(),
        plan.configs.len(),
        plan.spec.seeds,
        if plan.spec.seeds == 1 { "" } else { "s" },
        dir.display(),
        if opts.resume.is_some() { " (resumed)" } else { "" }
    );
    let meter = Meter::new(opts.progress, "running cells", "cells", mine.len() as u64);
    let outcomes: Vec<Result<results::CellOutcome<'_>>> = pool.install(|| {
        mine.par_iter()
            .map(|cell| {
                let r = run_one(plan, world, cell, dir, keys, opts.force);
                // a cell stopped (interrupt, failed write) is not done: the last line then says
                // "stopped after", not "done"
                if r.is_ok() {
                    meter.inc(1);
                }
                r
            })
            .collect()
    });
    meter.finish();
    let mut interrupted = false;
    let mut ok = Vec::with_capacity(outcomes.len());
    let mut storage = None;
    for o in outcomes {
        match o {
            Ok(o) => ok.push(o),
            Err(e) if e.is::<io::Interrupted>() => interrupted = true,
            Err(e) if io::is_storage(&e) => storage = storage.or(Some(e)),
            Err(e) => return Err(e),
        }
    }
    if let Some(e) = storage {
        // what the disk holds, not what was meant to be written: a failed first checkpoint
        // leaves its cell with none
        let ck = dir.join("checkpoints");
        let unfinished: Vec<&&CellPlan> =
            mine.iter().filter(|c| !ck.join(format!("{}.done", c.cell_id)).exists()).collect();
        let kept = unfinished.iter().filter(|c| ck.join(format!("{}.ckpt", c.cell_id)).exists()).count();
        let others = match (kept, unfinished.len()) {
            (_, 0) => String::new(),
            (k, n) if k == n => format!(", the others are checkpointed in {}", ck.display()),
            (0, n) => format!(", none of the other {n} has a checkpoint (they start over)"),
            (k, n) => format!(", {k} of the other {n} are checkpointed in {} (the rest start over)", ck.display()),
        };
        return Err(e.context(format!(
            "{} of {} cells finished{others}: free the space, then `{}`",
            mine.len() - unfinished.len(),
            mine.len(),
            resume_command(opts, dir)
        )));
    }
    if interrupted {
        eprintln!(
            "onepass: interrupted; {} of {} cells finished, the others checkpointed. Continue with:\n  {}",
            ok.len(),
            mine.len(),
            resume_command(opts, dir)
        );
        let dir = dir.to_path_buf();
        return Ok(Ran::Stopped(RunSummary { dir, failed: 0, cells: mine.len(), interrupted: true }));
    }
    Ok(Ran::All(ok))
}

#[cfg(test)]
mod tests {
    /// candle appends a backtrace to its errors when RUST_BACKTRACE is set (the H100 run's
    /// cells.parquet held 25 lines of `N: <unknown>` after a CUDA out-of-memory): a cell's error
    /// is one line, the chain kept, with what to lower when a device ran out of memory.
    #[test]
    fn a_cell_error_is_one_line_without_candles_backtrace() {
        let inner = candle_core::Error::Msg("DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")".into());
        let bt = candle_core::Error::WithBacktrace {
            inner: Box::new(inner),
            backtrace: Box::new(std::backtrace::Backtrace::force_capture()),
        };
        let e = anyhow::Error::new(bt).context("reward model step 1");
        let raw = format!("{e:#}");
        assert!(raw.lines().count() > 3, "negative control: the chain as {{:#}} writes it carries the trace:\n{raw}");
        let one = super::cell_error(&e);
        assert!(!one.contains('\n') && !one.contains("at /"), "{one}");
        assert!(one.starts_with("reward model step 1: DriverError(CUDA_ERROR_OUT_OF_MEMORY"), "{one}");
        assert!(one.contains("--max-gpu-memory") && one.contains("reward.pairs_per_pass"), "{one}");
        // candle's context puts its own line break between the context and the error: joined
        let e = anyhow::Error::new(candle_core::Error::Msg("bad shape".into()).context("loading layer 3"));
        assert_eq!(super::cell_error(&e), "loading layer 3: bad shape");
        // a message line that starts with a number is no frame
        let e = anyhow::anyhow!("12: rows expected").context("step 4");
        assert_eq!(super::cell_error(&e), "step 4: 12: rows expected");
    }
}
