//! `onepass run`: spec → plan → world → cells → rows → tables, with the run directory's
//! bookkeeping around it — its identity for `--resume`, finished cells kept as
//! `checkpoints/<cell>.done`, meta.json, and the summary printed at the end.
//!
//! A run directory holds, while it runs: `resume.json` (what the run is: the resolved spec, the
//! code revision and digests of its data), `checkpoints/<cell>.ckpt` (a running cell's whole
//! state) and `checkpoints/<cell>.done` (a finished cell's result). `meta.json` is written last;
//! once it exists the run is complete and `checkpoints/` is removed.

use crate::plan::{CellPlan, Plan};
use crate::{io, plan, results, spec, world};
use anyhow::{Context, Result};
use std::path::Path;

mod cells;
mod dir;
mod identity;
mod meta;
mod options;
mod summary;
pub use cells::cell_error;
use cells::{cell_what, run_cells, shared_digest, Ran};
use dir::{already_complete, claim_output, gather_slices, open_run_dir, remove_checkpoints};
pub(crate) use dir::{DoneCell, SliceFile};
pub use identity::RunIdentity;
pub use meta::{scale_meta, LARGE_Z_OVER_LAMBDA};
use meta::{Meta, Started};
use options::{resume_command, shell_word};
pub use options::{RunOptions, RunSummary};
use summary::print_summary;

/// The cells a process runs: the plan's, or with `--cells i/N` those at positions k with
/// k mod N = i (round robin: every slice gets configs and seeds alike).
fn my_cells(plan: &Plan, slice: Option<features::ShardSpec>) -> Vec<&CellPlan> {
    let s = slice.unwrap_or(features::ShardSpec::ALL);
    plan.cells.iter().enumerate().filter(|(k, _)| k % s.count == s.index).map(|(_, c)| c).collect()
}

/// Refuses a run whose cells would take more memory than `opts.max_memory` or what the machine
/// has available ([`budget`]), naming the key behind the largest term (exit 2); a policy on a
/// GPU, more than `opts.max_gpu_memory` or the device's free memory.
fn check_memory(
    opts: &RunOptions,
    plan: &Plan,
    spec: &spec::Spec,
    threads: usize,
    policy: Option<&crate::budget::PolicyShape>,
    reward: Option<&crate::budget::RewardShape>,
) -> Result<()> {
    let (limit, from) = match (opts.max_memory, crate::budget::available()) {
        (Some(m), _) => (m, "--max-memory allows".to_string()),
        (None, Some(a)) => {
            (a, "available on this machine (MemAvailable; --max-memory sets another budget)".to_string())
        }
        (None, None) => return Ok(()),
    };
    // threads = 0: one per core, as the pool starts them
    let threads = if threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { threads };
    let refuse = |(key, msg): (String, String)| {
        let path: Vec<&str> = key.split('.').collect();
        anyhow::Error::new(plan.keys().err(&path, msg))
    };
    // the cells this process runs: a slice keeps only its own cells' rows
    let cells = my_cells(plan, opts.slice).len();
    let e = crate::budget::estimate(spec, plan, cells, threads, policy, reward, crate::budget::Memory::Host);
    crate::budget::check(&e, limit, &from).map_err(refuse)?;
    // a policy or a learning reward model on an accelerator: its terms against the device's
    // memory, not the host's
    let free = match (policy.filter(|p| p.on_device), reward.filter(|r| r.on_device)) {
        (None, None) => return Ok(()),
        (p, r) => p.and_then(|p| p.device_free).or(r.and_then(|r| r.device_free)),
    };
    let (limit, from) = match (opts.max_gpu_memory, free) {
        (Some(m), _) => (m, "--max-gpu-memory allows".to_string()),
        (None, Some(f)) => (f, "free on the GPU (--max-gpu-memory sets another budget)".to_string()),
        (None, None) => return Ok(()),
    };
    let e = crate::budget::estimate(spec, plan, cells, threads, policy, reward, crate::budget::Memory::Device);
    crate::budget::check(&e, limit, &from).map_err(refuse)
}

/// Parses and validates a spec (errors are [`spec::SpecError`]); reads nothing else.
pub fn load_plan(path: &Path, overrides: &[String]) -> Result<Plan, spec::SpecError> {
    let (s, text) = spec::load(path, overrides)?;
    let plan = plan::build(s, path, &text, overrides)?;
    for w in &plan.warnings {
        eprintln!("onepass: warning: {w}");
    }
    Ok(plan)
}

/// What `--dry-run` says after the spec and the cells, as `#` lines: what each config resolves
/// to for its cells ([`plan::ConfigPlan::for_cells`]) — λ = "auto", a β of "theory" (ucb's, the
/// pessimistic policy's) — when the
/// environment is the synthetic bandit (its facts need no data: d and T are the spec's, the
/// data's scale is drawn as the run draws it), else what waits for the data.
pub fn dry_run_notes(plan: &Plan) -> Result<Vec<String>, spec::SpecError> {
    use spec::{Beta, EnvKind, Setting};
    let s = &plan.spec;
    let theory = |beta: Beta| matches!(beta, Beta::Theory);
    let ucb = |st: Option<selection::Strategy>| matches!(st, Some(selection::Strategy::Ucb { .. }));
    let fresh_ucb =
        |c: &plan::ConfigPlan| matches!(c.rule, Some(spec::ActiveRule::Fresh(selection::Strategy::Ucb { .. })));
    // per config, which of its values wait for the data's facts
    let pending = |c: &plan::ConfigPlan| {
        let mut w = Vec::new();
        if c.lambda_auto {
            w.push("λ");
        }
        if (s.setting == Setting::Deploy && ucb(c.strategy) && theory(s.deploy.beta))
            || (fresh_ucb(c) && theory(s.active.beta))
        {
            w.push("β");
        }
        w
    };
    let mut out = Vec::new();
    if s.env.kind == EnvKind::Synthetic {
        let world = world::build(plan, crate::progress::Mode::Quiet)?;
        for (c, cell) in plan.configs.iter().zip(&world.configs) {
            let r = &cell.config;
            let w = pending(c);
            if w.is_empty() {
                continue;
            }
            let mut parts = Vec::new();
            if w.contains(&"λ") {
                if let Some(l) = cell.lambda() {
                    parts.push(format!("λ = {l} (\"auto\": the median ‖z‖² of the first pairs)"));
                }
            }
            let beta = match (r.strategy, r.rule) {
                (Some(selection::Strategy::Ucb { beta }), _) if s.setting == Setting::Deploy => Some(beta),
                (_, Some(spec::ActiveRule::Fresh(selection::Strategy::Ucb { beta }))) => Some(beta),
                _ => None,
            };
            if let (true, Some(b)) = (w.contains(&"β"), beta) {
                parts.push(format!(
                    "ucb β = {b} (\"theory\": √d·log(T/δ), d = {}, T = {})",
                    world.spec.env.dim, world.spec.stream.samples
                ));
            }
            out.push(format!("# resolved: {}: {}", c.label, parts.join("; ")));
        }
        // the pessimistic policy (passive on the bandit, whose θ* it is scored against)
        if let (Setting::Passive, true, Some(b)) =
            (s.setting, theory(s.passive.beta), world.configs.first().and_then(|c| c.config.pessimism_beta))
        {
            out.push(format!(
                "# resolved: pessimism β = {b} (\"theory\": √d·log(T/δ), d = {}, T = {})",
                world.spec.env.dim, world.spec.stream.samples
            ));
        }
        return Ok(out);
    }
    let mut facts = vec!["env.dim (the feature model's size)".to_string()];
    if s.env.kind == EnvKind::Generated {
        facts.push("env.arms and env.contexts (the bank's responses per prompt and prompts)".into());
        if s.setting == Setting::Deploy {
            facts.push("stream.samples (one pair per prompt)".into());
        }
    }
    out.push(format!("# waits for the data: {}", facts.join(", ")));
    for c in &plan.configs {
        let w = pending(c);
        if !w.is_empty() {
            out.push(format!("# waits for the data: {}: {} (from the data's d, T and ‖z‖²)", c.label, w.join(", ")));
        }
    }
    Ok(out)
}

/// Runs every cell of a plan and writes the run directory (or continues `opts.resume`).
pub fn run(opts: &RunOptions) -> Result<RunSummary> {
    let plan = load_plan(&opts.spec, &opts.overrides)?;
    let threads = preflight(opts, &plan)?;
    if opts.cap_library_threads {
        cap_library_threads(threads);
    }
    let claimed = claim_output(opts)?;
    let world = world::build(&plan, opts.progress)?;
    let shape = world.online.as_ref().map(|o| o.shape());
    let reward = world.reward_shape();
    check_memory(opts, &plan, &world.spec, threads, shape.as_ref(), reward.as_ref())?;
    let (data_scale, warning) = scale_meta(&world);
    if let Some(w) = warning {
        eprintln!("onepass: warning: {w}");
    }
    let started = humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string();
    let id = RunIdentity::of(&plan, &world)?;
    let fingerprint = id.fingerprint();
    let shared = shared_digest(&world)?;
    let keys = (fingerprint.as_str(), shared.as_str());
    // a merge checks its slices before it makes its directory — each finished cell's file
    // too: a corrupt one is named before anything is created
    let (_slice_locks, merged) =
        if opts.merge.is_empty() { (Vec::new(), Default::default()) } else { gather_slices(&opts.merge, &plan, &id)? };
    verify_merged(opts, &plan, &merged, keys)?;
    let (dir, _lock, forced) = open_run_dir(opts, &plan, &world, &id, claimed)?;
    copy_merged(&merged, &dir)?;
    if let Some(done) = already_complete(&plan, &dir)? {
        return Ok(done);
    }
    let mine = my_cells(&plan, opts.slice);
    verify_checkpoints(opts, &plan, &mine, &dir, keys)?;
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().context("starting the worker threads")?;
    let outcomes = match run_cells(opts, &plan, &world, &mine, &dir, &pool, keys)? {
        Ran::All(o) => o,
        Ran::Stopped(summary) => return Ok(summary),
    };
    if let Some(sl) = opts.slice {
        return Ok(finish_slice(opts, &plan, sl, &outcomes, dir));
    }
    let started = Started { at: started, forced, data_scale, threads: pool.current_num_threads() };
    finish_run(opts, &plan, &world, &outcomes, dir, started)
}

/// `onepass merge`: each slice's finished cell file checked against this run's identity
/// (fingerprint and the cell's digest; `keys` = (fingerprint, shared digest)).
fn verify_merged(
    opts: &RunOptions,
    plan: &Plan,
    merged: &std::collections::BTreeMap<String, std::path::PathBuf>,
    (fingerprint, shared): (&str, &str),
) -> Result<()> {
    for (cell_id, from) in merged {
        if let Some(cell) = plan.cells.iter().find(|c| &c.cell_id == cell_id) {
            io::verify(from, fingerprint, &cell_what(shared, &plan.configs[cell.config], cell), opts.force)
                .context("merge")?;
        }
    }
    Ok(())
}

/// `onepass merge`: each slice's finished cell file, and its live curves, copied into the
/// merged run directory.
fn copy_merged(merged: &std::collections::BTreeMap<String, std::path::PathBuf>, dir: &Path) -> Result<()> {
    for (cell, from) in merged {
        let to = dir.join("checkpoints").join(format!("{cell}.done"));
        let bytes = std::fs::read(from).with_context(|| format!("merge: reading {}", from.display()))?;
        io::write_atomic(&to, &bytes)?;
        // the cell's live curves come along (`<slice>/tb/<cell>/`, beside its checkpoints/)
        if let Some(slice) = from.parent().and_then(Path::parent) {
            copy_tb(&slice.join("tb").join(cell), &dir.join("tb").join(cell))?;
        }
    }
    Ok(())
}

/// Every checkpoint (`.done`, `.ckpt`) of this process's cells checked against this run's
/// identity (`keys` = (fingerprint, shared digest)).
fn verify_checkpoints(
    opts: &RunOptions,
    plan: &Plan,
    mine: &[&CellPlan],
    dir: &Path,
    (fingerprint, shared): (&str, &str),
) -> Result<()> {
    // every checkpoint left by a killed run is checked before any cell starts
    for cell in mine {
        let what = cell_what(shared, &plan.configs[cell.config], cell);
        for ext in ["done", "ckpt"] {
            let p = dir.join("checkpoints").join(format!("{}.{ext}", cell.cell_id));
            if p.exists() {
                io::verify(&p, fingerprint, &what, opts.force)?;
            }
        }
    }
    Ok(())
}

/// A slice's end (`--cells i/N`): its cells' results stay in checkpoints/ for the merge, and
/// one line says how to merge.
fn finish_slice(
    opts: &RunOptions,
    plan: &Plan,
    sl: features::ShardSpec,
    outcomes: &[results::CellOutcome<'_>],
    dir: std::path::PathBuf,
) -> RunSummary {
    // a slice keeps its cells' results in checkpoints/ for the merge: no tables of its own
    let failed = outcomes.iter().filter(|o| o.result.is_err()).count();
    // the merge takes the slices' --set flags too: the hint keeps them
    let sets: String = opts.overrides.iter().map(|o| format!(" --set {}", shell_word(o))).collect();
    let empty = if outcomes.is_empty() {
        format!(
            " (the run has {} cells: slices {}/{} and above hold none)",
            plan.cells.len(),
            plan.cells.len(),
            sl.count
        )
    } else {
        String::new()
    };
    eprintln!(
        "onepass: slice {}/{}: {} cells finished ({failed} failed){empty} in {}; when every slice is done: onepass merge {}{sets} SLICE_DIR…",
        sl.index,
        sl.count,
        outcomes.len(),
        dir.display(),
        shell_word(&opts.spec.display().to_string())
    );
    RunSummary { dir, failed, cells: outcomes.len(), interrupted: false }
}

/// A whole run's end: the tables and schema.json, then meta.json (the run is complete), then
/// checkpoints/ removed and the summary printed.
fn finish_run(
    opts: &RunOptions,
    plan: &Plan,
    world: &world::World,
    outcomes: &[results::CellOutcome<'_>],
    dir: std::path::PathBuf,
    started: Started,
) -> Result<RunSummary> {
    let schemas = results::write_tables(&dir, plan, world, outcomes).with_context(|| {
        format!(
            "the finished cells are kept in {}/checkpoints: fix this, then `{}`",
            dir.display(),
            resume_command(opts, &dir)
        )
    })?;
    io::write_atomic(&dir.join("schema.json"), results::schema_json(&schemas).as_bytes())?;
    let failed = outcomes.iter().filter(|o| o.result.is_err()).count();
    let meta = Meta::of(opts, plan, world, started, failed);
    io::write_atomic(&dir.join("meta.json"), serde_json::to_string_pretty(&meta)?.as_bytes())?;
    // complete: what resume needed is now in the tables
    io::failpoint("meta-written");
    remove_checkpoints(&dir)?;
    print_summary(plan, world, outcomes);
    Ok(RunSummary { dir, failed, cells: outcomes.len(), interrupted: false })
}

/// `onepass merge`: a slice's event files of one cell into the merged run (none: nothing).
fn copy_tb(from: &Path, to: &Path) -> Result<()> {
    let files = crate::tb::event_files(from).with_context(|| format!("merge: reading {}", from.display()))?;
    if files.is_empty() {
        return Ok(());
    }
    std::fs::create_dir_all(to).with_context(|| format!("merge: creating {}", to.display()))?;
    for f in files {
        let dest = to.join(f.file_name().expect("a file"));
        std::fs::copy(&f, &dest).with_context(|| format!("merge: copying {} to {}", f.display(), dest.display()))?;
    }
    Ok(())
}

/// What can be refused before any data is read or model run: an `--out` that is a file, more
/// threads than the machine can start, a synthetic bandit too large for memory (its sizes are
/// all in the spec; the data kinds learn d from the data and are checked once it is read).
/// Returns the threads to run with.
fn preflight(opts: &RunOptions, plan: &Plan) -> Result<usize> {
    if opts.resume.is_none() && opts.out.exists() && !opts.out.is_dir() {
        anyhow::bail!("--out {}: not a directory (a file of that name is in the way)", opts.out.display());
    }
    preflight_sizes(opts, plan)
}

/// `--dry-run`'s checks, before it prints or resolves anything: the run's own [`preflight`]
/// (threads; a synthetic bandit's memory) but `--out`, which a dry run does not write. The
/// notes build the bandit's world ([`dry_run_notes`]), so a size this refuses is never
/// allocated (an `env.dim` of 2³² took 32 GiB, one of 2⁶⁴ − 1 panicked).
pub fn dry_run_preflight(opts: &RunOptions, plan: &Plan) -> Result<()> {
    preflight_sizes(opts, plan).map(|_| ())
}

/// [`preflight`]'s threads and memory.
fn preflight_sizes(opts: &RunOptions, plan: &Plan) -> Result<usize> {
    let threads = opts.threads.unwrap_or(plan.spec.threads);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if threads > 8 * cores {
        // named where it was given: the flag, a --set, or the spec's own `threads`
        let given = match opts.threads {
            Some(_) => format!("--threads {threads}"),
            None => match plan.overrides.iter().rev().find(|o| spec::override_key(o) == "threads") {
                Some(o) => format!("--set {o}"),
                None => format!("{}: `threads`: {threads}", plan.file.display()),
            },
        };
        anyhow::bail!(
            "{given}: at most {max} threads on this machine (8 per core, {cores} cores): cells beyond the cores only wait, and starting that many threads takes the machine; 0 runs one per core",
            max = 8 * cores
        );
    }
    if plan.spec.env.kind == spec::EnvKind::Synthetic {
        check_memory(opts, plan, &plan.spec, threads, None, None)?;
    }
    Ok(threads)
}

/// `--threads N` bounds the process, not only its pool of cells: candle runs its elementwise
/// kernels on a pool of its own (`CANDLE_NUM_THREADS`, else `RAYON_NUM_THREADS`, else one
/// thread per core, each spinning between ops) and splits each matmul into `RAYON_NUM_THREADS`
/// parts (else one per core), and φ's extraction runs on rayon's global pool (the same
/// variable). So a run at `--threads 1` on 2 cores still took both. Where unset, both are set
/// to N here — before the world is built, so before any of those pools starts; a value the
/// user set is kept; N = 0 (one per core) leaves them alone. Results do not depend on thread
/// counts (tested), so this changes CPU use and speed only.
fn cap_library_threads(threads: usize) {
    if threads == 0 {
        return;
    }
    for var in ["CANDLE_NUM_THREADS", "RAYON_NUM_THREADS"] {
        if std::env::var_os(var).is_none() {
            // the binary's only other thread here is the signal handler's, which reads no
            // environment (RunOptions::cap_library_threads)
            std::env::set_var(var, threads.to_string());
        }
    }
}
