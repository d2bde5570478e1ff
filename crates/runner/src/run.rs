//! `onepass run`: spec → plan → world → cells → rows → tables, with the run directory's
//! bookkeeping around it — its identity for `--resume`, finished cells kept as
//! `checkpoints/<cell>.done`, meta.json, and the summary printed at the end.
//!
//! A run directory holds, while it runs: `resume.json` (what the run is: the resolved spec, the
//! code revision and digests of its data), `checkpoints/<cell>.ckpt` (a running cell's whole
//! state) and `checkpoints/<cell>.done` (a finished cell's result). `meta.json` is written last;
//! once it exists the run is complete and `checkpoints/` is removed.

use crate::plan::{CellPlan, ConfigPlan, Plan};
use crate::progress::Meter;
use crate::rows::{CellResult, MetricRow};
use crate::settings::{CellCtx, CellSaver, Live};
use crate::world::World;
use crate::{io, plan, results, settings, spec, world};
use anyhow::{Context, Result};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
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
    /// How the long stages report on stderr (bars, log lines, nothing).
    pub progress: crate::progress::Mode,
    /// The memory the cells may take (default: the machine's MemAvailable).
    pub max_memory: Option<u64>,
    /// The accelerator memory a policy on it may take (default: the device's free memory).
    pub max_gpu_memory: Option<u64>,
    /// `--cells i/N`: only the plan's cells k with k mod N = i, into a slice directory that
    /// keeps their results (no tables) for `onepass merge` — one task of a SLURM array.
    pub slice: Option<features::ShardSpec>,
    /// `onepass merge`: the slice directories whose finished cells make this run.
    pub merge: Vec<PathBuf>,
    /// Bound candle's own threads by the run's too ([`cap_library_threads`]): the binary sets
    /// it; a library caller, whose other threads may read the environment meanwhile, does not.
    pub cap_library_threads: bool,
}

/// A slice directory's `slice.json`: which slice of the run's cells it holds.
#[derive(Serialize, Deserialize, PartialEq)]
pub(crate) struct SliceFile {
    pub(crate) index: usize,
    pub(crate) count: usize,
}

/// A word as a POSIX shell reads it back: as is when it holds only characters the shell leaves
/// alone, else in single quotes (a quote inside written '\'').
fn shell_word(w: &str) -> String {
    let plain = !w.is_empty() && w.chars().all(|c| c.is_ascii_alphanumeric() || "_./=:,+-@%".contains(c));
    if plain {
        w.to_string()
    } else {
        format!("'{}'", w.replace('\'', "'\\''"))
    }
}

/// The command that continues the run in `dir`: the spec and every `--set` of this one (a
/// resume is refused without them), then `--resume`.
fn resume_command(opts: &RunOptions, dir: &Path) -> String {
    let mut words = vec!["onepass".to_string(), "run".into(), shell_word(&opts.spec.display().to_string())];
    for o in &opts.overrides {
        words.push("--set".into());
        words.push(shell_word(o));
    }
    if let Some(sl) = opts.slice {
        words.push("--cells".into());
        words.push(format!("{}/{}", sl.index, sl.count));
    }
    words.push("--resume".into());
    words.push(shell_word(&dir.display().to_string()));
    words.join(" ")
}

/// The cells a process runs: the plan's, or with `--cells i/N` those at positions k with
/// k mod N = i (round robin: every slice gets configs and seeds alike).
fn my_cells(plan: &Plan, slice: Option<features::ShardSpec>) -> Vec<&CellPlan> {
    let s = slice.unwrap_or(features::ShardSpec::ALL);
    plan.cells.iter().enumerate().filter(|(k, _)| k % s.count == s.index).map(|(_, c)| c).collect()
}

/// `onepass merge`: where each of the plan's cells finished — its `.done` file in one of
/// `slices`, slice directories of this very run (the same identity: spec, `--set`, revision,
/// data), each locked while it is read (a slice still running is refused). Every cell must be
/// in exactly one slice.
fn gather_slices(
    slices: &[PathBuf],
    plan: &Plan,
    id: &RunIdentity,
) -> Result<(Vec<io::DirLock>, std::collections::BTreeMap<String, PathBuf>)> {
    let mut locks = Vec::new();
    let mut done: std::collections::BTreeMap<String, PathBuf> = Default::default();
    // the same directory twice would meet its own lock ("in use by another onepass process"
    // with this process's pid)
    let mut seen: Vec<(PathBuf, &PathBuf)> = Vec::new();
    for s in slices {
        let real = s.canonicalize().unwrap_or_else(|_| s.clone());
        if let Some((_, first)) = seen.iter().find(|(r, _)| *r == real) {
            anyhow::bail!(
                "merge: {}: the same slice directory as {}, given twice: give each slice once",
                s.display(),
                first.display()
            );
        }
        seen.push((real, s));
    }
    for s in slices {
        let text = std::fs::read_to_string(s.join("resume.json"))
            .with_context(|| format!("merge: {}: no resume.json there (not a run or slice directory)", s.display()))?;
        let theirs: RunIdentity = serde_json::from_str(&text)
            .with_context(|| format!("merge: {}/resume.json: not a run identity", s.display()))?;
        if let Some(why) = id.mismatch(&theirs) {
            anyhow::bail!("merge: {}: not a slice of this run: {why}", s.display());
        }
        if s.join("meta.json").exists() {
            anyhow::bail!("merge: {}: a complete run, not a slice (its tables are written already)", s.display());
        }
        locks.push(io::lock_dir(s)?);
        let ck = s.join("checkpoints");
        let entries = std::fs::read_dir(&ck).with_context(|| format!("merge: reading {}", ck.display()))?;
        for e in entries {
            let p = e.with_context(|| format!("merge: reading {}", ck.display()))?.path();
            let (Some(stem), Some("done")) =
                (p.file_stem().and_then(|x| x.to_str()), p.extension().and_then(|x| x.to_str()))
            else {
                continue;
            };
            if let Some(first) = done.insert(stem.to_string(), p.clone()) {
                anyhow::bail!("merge: cell {stem} finished in two slices, {} and {}", first.display(), p.display());
            }
        }
    }
    if let Some(extra) = done.keys().find(|c| !plan.cells.iter().any(|p| &p.cell_id == *c)) {
        anyhow::bail!("merge: cell {extra} of {} is no cell of this run", done[extra].display());
    }
    let missing: Vec<&str> = plan.cells.iter().map(|c| c.cell_id.as_str()).filter(|c| !done.contains_key(*c)).collect();
    if !missing.is_empty() {
        anyhow::bail!(
            "merge: {} of the run's {} cells are finished in no slice given (first: {}): run or --resume the slices that hold them, then merge again",
            missing.len(),
            plan.cells.len(),
            missing[0]
        );
    }
    Ok((locks, done))
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
    let e = crate::budget::estimate(spec, plan, threads, policy, reward, crate::budget::Memory::Host);
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
    let e = crate::budget::estimate(spec, plan, threads, policy, reward, crate::budget::Memory::Device);
    crate::budget::check(&e, limit, &from).map_err(refuse)
}

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

/// A finished (or failed) cell as `checkpoints/<cell>.done` keeps it until the run's tables exist.
#[derive(Serialize, Deserialize)]
pub(crate) struct DoneCell {
    pub(crate) result: std::result::Result<CellResult, String>,
    pub(crate) wall_s: f64,
}

/// The run directory: a fresh one, or `--resume`'s (claimed by [`claim_output`]: locked, its
/// resume.json read) after checking it is this run. The directory comes locked (one writer per
/// run directory): a resumed one before anything in it is touched.
/// Third: why the run's identity differs when `--force` resumed it anyway (meta.json records it).
fn open_run_dir(
    opts: &RunOptions,
    plan: &Plan,
    world: &World,
    id: &RunIdentity,
    claimed: Option<Claimed>,
) -> Result<(PathBuf, io::DirLock, Option<String>)> {
    let Some(dir) = &opts.resume else {
        // a slice's directory says which slice it is
        let name = match opts.slice {
            Some(sl) => format!("{}-cells-{}-of-{}", plan.dir_name(), sl.index, sl.count),
            None => plan.dir_name(),
        };
        let dir = results::make_run_dir(&opts.out, &name)?;
        let lock = io::lock_dir(&dir)?;
        let resolved = crate::plan::record::resolved_text(plan, &world.spec).map_err(anyhow::Error::msg)?;
        io::write_atomic(&dir.join("spec.resolved.toml"), resolved.as_bytes())?;
        io::write_atomic(&dir.join("resume.json"), serde_json::to_string_pretty(id)?.as_bytes())?;
        io::write_atomic(&dir.join(crate::results::PLAN_FILE), crate::results::plan_json(plan)?.as_bytes())?;
        if let Some(sl) = opts.slice {
            let f = SliceFile { index: sl.index, count: sl.count };
            io::write_atomic(&dir.join("slice.json"), serde_json::to_string(&f)?.as_bytes())?;
        }
        std::fs::create_dir(dir.join("checkpoints"))
            .with_context(|| format!("creating {}/checkpoints", dir.display()))?;
        return Ok((dir, lock, None));
    };
    // a slice resumes as the slice it is, a whole run as a whole run
    let theirs_slice: Option<SliceFile> = match std::fs::read_to_string(dir.join("slice.json")) {
        Ok(t) => Some(serde_json::from_str(&t).with_context(|| format!("{}/slice.json: not a slice", dir.display()))?),
        Err(_) => None,
    };
    let ours = opts.slice.map(|s| SliceFile { index: s.index, count: s.count });
    if theirs_slice != ours {
        let show = |s: &Option<SliceFile>| {
            s.as_ref().map_or("the whole run".to_string(), |s| format!("--cells {}/{}", s.index, s.count))
        };
        anyhow::bail!(
            "--resume {}: refused: that directory holds {}, this invocation asks for {}",
            dir.display(),
            show(&theirs_slice),
            show(&ours)
        );
    }
    let Claimed { lock, manifest: text } =
        claimed.ok_or_else(|| anyhow::anyhow!("--resume {}: not claimed before the world was built", dir.display()))?;
    let manifest = dir.join("resume.json");
    let theirs: RunIdentity =
        serde_json::from_str(&text).with_context(|| format!("{}: not a run identity", manifest.display()))?;
    let forced = id.mismatch(&theirs);
    if let Some(why) = &forced {
        if opts.force {
            eprintln!("onepass: warning: resuming {} although {why} (--force)", dir.display());
        } else {
            anyhow::bail!("--resume {}: refused: {why}; pass --force to resume anyway", dir.display());
        }
    }
    if dir.join("meta.json").exists() {
        return Ok((dir.clone(), lock, forced));
    }
    if forced.is_some() {
        // from here on the run is this spec: cells of another config restart
        let resolved = crate::plan::record::resolved_text(plan, &world.spec).map_err(anyhow::Error::msg)?;
        io::write_atomic(&dir.join("spec.resolved.toml"), resolved.as_bytes())?;
        io::write_atomic(&manifest, serde_json::to_string_pretty(id)?.as_bytes())?;
    }
    // a directory begun before plan.json existed gets it on resuming (the plan is the run's)
    io::write_atomic(&dir.join(crate::results::PLAN_FILE), crate::results::plan_json(plan)?.as_bytes())?;
    for sub in ["theta", "checkpoints"] {
        std::fs::create_dir_all(dir.join(sub)).with_context(|| format!("creating {}/{sub}", dir.display()))?;
    }
    let n = io::remove_temporaries(dir)?;
    if n > 0 {
        eprintln!("onepass: removed {n} half-written temporary file(s) of the killed run");
    }
    Ok((dir.clone(), lock, forced))
}

/// A run directory's resume.json, or an error saying it is not one.
fn read_manifest(dir: &Path) -> Result<String> {
    std::fs::read_to_string(dir.join("resume.json")).with_context(|| {
        format!(
            "--resume {}: no resume.json there (not a onepass run directory, or one made before resume existed)",
            dir.display()
        )
    })
}

/// A resumed run directory, claimed: its lock (kept for the run) and its resume.json.
struct Claimed {
    lock: io::DirLock,
    manifest: String,
}

/// What can be refused about the run directory before any data is read or model loaded: a
/// resumed directory that is not a run's or that another process holds (claimed here: locked,
/// its resume.json read), an `--out` that cannot be written (checked without writing anything).
fn claim_output(opts: &RunOptions) -> Result<Option<Claimed>> {
    if let Some(dir) = &opts.resume {
        // a run directory has its lock before its resume.json, so where the lock file exists
        // the lock goes first (a run still starting up is "in use", not "no resume.json"); no
        // lock file is created in a directory that is not a run's
        if !dir.join(".lock").exists() {
            read_manifest(dir)?;
        }
        let lock = io::lock_dir(dir)?;
        return Ok(Some(Claimed { lock, manifest: read_manifest(dir)? }));
    }
    // nothing is written before the data are checked: the nearest existing ancestor of --out
    // must be a directory this process may write in (access(2), W_OK)
    let out = &opts.out;
    let mut at = out.as_path();
    while !at.exists() {
        at = match at.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
    }
    if !at.is_dir() {
        anyhow::bail!("--out {}: {} is not a directory", out.display(), at.display());
    }
    let c = std::ffi::CString::new(at.as_os_str().as_encoded_bytes())
        .map_err(|_| anyhow::anyhow!("--out {}: a NUL byte in the path", out.display()))?;
    // SAFETY: access(2) on a NUL-terminated path we own.
    if unsafe { libc::access(c.as_ptr(), libc::W_OK) } != 0 {
        let e = std::io::Error::last_os_error();
        anyhow::bail!("--out {}: cannot write in {}: {e}", out.display(), at.display());
    }
    Ok(None)
}

/// What a cell's checkpoint is of: "cell <id> (<digest of its config and seed>)", so that a
/// checkpoint of another config of the cell is never continued.
fn cell_what(shared: &str, config: &ConfigPlan, cell: &CellPlan) -> String {
    let id = format!("{shared} {:?}", (&config.cfg, &config.init, &config.strategy, &config.rule, cell.seed));
    format!("cell {} ({})", cell.cell_id, &blake3::hash(id.as_bytes()).to_hex()[..16])
}

/// A digest of everything of the spec that every cell shares (the spec without its estimator
/// tables, `threads` and `[checkpoint]`): a change there makes every cell's state another's.
fn shared_digest(world: &World) -> Result<String> {
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
    // a merge checks its slices before it makes its directory — each finished cell's file
    // too: a corrupt one is named before anything is created
    let (_slice_locks, merged) =
        if opts.merge.is_empty() { (Vec::new(), Default::default()) } else { gather_slices(&opts.merge, &plan, &id)? };
    for (cell_id, from) in &merged {
        if let Some(cell) = plan.cells.iter().find(|c| &c.cell_id == cell_id) {
            io::verify(from, &fingerprint, &cell_what(&shared, &plan.configs[cell.config], cell), opts.force)
                .context("merge")?;
        }
    }
    let (dir, _lock, forced) = open_run_dir(opts, &plan, &world, &id, claimed)?;
    for (cell, from) in &merged {
        let to = dir.join("checkpoints").join(format!("{cell}.done"));
        let bytes = std::fs::read(from).with_context(|| format!("merge: reading {}", from.display()))?;
        io::write_atomic(&to, &bytes)?;
        // the cell's live curves come along (`<slice>/tb/<cell>/`, beside its checkpoints/)
        if let Some(slice) = from.parent().and_then(Path::parent) {
            copy_tb(&slice.join("tb").join(cell), &dir.join("tb").join(cell))?;
        }
    }
    if let Some(done) = already_complete(&plan, &dir)? {
        return Ok(done);
    }
    let mine = my_cells(&plan, opts.slice);
    // every checkpoint left by a killed run is checked before any cell starts
    for cell in &mine {
        let what = cell_what(&shared, &plan.configs[cell.config], cell);
        for ext in ["done", "ckpt"] {
            let p = dir.join("checkpoints").join(format!("{}.{ext}", cell.cell_id));
            if p.exists() {
                io::verify(&p, &fingerprint, &what, opts.force)?;
            }
        }
    }
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().context("starting the worker threads")?;
    let outcomes = match run_cells(opts, &plan, &world, &mine, &dir, &pool, (&fingerprint, &shared))? {
        Ran::All(o) => o,
        Ran::Stopped(summary) => return Ok(summary),
    };
    if let Some(sl) = opts.slice {
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
        return Ok(RunSummary { dir, failed, cells: outcomes.len(), interrupted: false });
    }
    let schemas = results::write_tables(&dir, &plan, &world, &outcomes).with_context(|| {
        format!(
            "the finished cells are kept in {}/checkpoints: fix this, then `{}`",
            dir.display(),
            resume_command(opts, &dir)
        )
    })?;
    io::write_atomic(&dir.join("schema.json"), results::schema_json(&schemas).as_bytes())?;
    let failed = outcomes.iter().filter(|o| o.result.is_err()).count();
    let meta = Meta::of(
        opts,
        &plan,
        &world,
        Started { at: started, forced, data_scale, threads: pool.current_num_threads() },
        failed,
    );
    io::write_atomic(&dir.join("meta.json"), serde_json::to_string_pretty(&meta)?.as_bytes())?;
    // complete: what resume needed is now in the tables
    io::failpoint("meta-written");
    remove_checkpoints(&dir)?;
    print_summary(&plan, &world, &outcomes);
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

/// A run directory whose meta.json exists is complete: nothing to resume (checkpoints a kill
/// between meta.json and their removal left behind are removed).
fn already_complete(plan: &Plan, dir: &Path) -> Result<Option<RunSummary>> {
    if !dir.join("meta.json").exists() {
        return Ok(None);
    }
    eprintln!("onepass: {} is complete (meta.json exists): nothing to resume", dir.display());
    let meta: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json"))?)
        .with_context(|| format!("{}/meta.json: not JSON", dir.display()))?;
    let failed = meta.get("failed_cells").and_then(|v| v.as_u64()).unwrap_or(0) as usize;
    remove_checkpoints(dir)?;
    Ok(Some(RunSummary { dir: dir.to_path_buf(), failed, cells: plan.cells.len(), interrupted: false }))
}

/// How the cells of [`run_cells`] ended: all finished (failed cells included), or stopped by an
/// interrupt (a summary to return: the others are checkpointed).
enum Ran<'p> {
    All(Vec<results::CellOutcome<'p>>),
    Stopped(RunSummary),
}

/// Runs `mine` on `pool` with a progress meter. An interrupt stops the run with its resume
/// command; a full disk is an error that says how many cells finished and how to resume.
#[allow(clippy::too_many_arguments)]
fn run_cells<'p>(
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

/// What meta.json says of the run's start besides the plan and the world.
struct Started {
    at: String,
    forced: Option<String>,
    data_scale: serde_json::Value,
    threads: usize,
}

impl<'a> Meta<'a> {
    /// meta.json of a finished run with `failed` failed cells.
    fn of(opts: &'a RunOptions, plan: &Plan, world: &'a World, st: Started, failed: usize) -> Meta<'a> {
        Meta {
            onepass_version: env!("CARGO_PKG_VERSION"),
            git_revision: env!("ONEPASS_GIT_REV"),
            git_dirty: env!("ONEPASS_GIT_DIRTY"),
            spec_file: opts.spec.display().to_string(),
            overrides: &opts.overrides,
            resumed: opts.resume.is_some(),
            forced: st.forced,
            merged_from: opts.merge.iter().map(|p| p.display().to_string()).collect(),
            master_seed: world.spec.master_seed,
            seeds: world.spec.seeds,
            setting: world.spec.setting.as_str(),
            data: world.data.as_ref().map(|d| DataMeta {
                path: d.train_path.display().to_string(),
                blake3: d.train.digest.clone(),
                train_rows: d.train.len(),
                eval_path: d.eval_path.as_ref().map(|p| p.display().to_string()),
                eval_blake3: d.eval_path.as_ref().map(|_| d.eval.digest.clone()),
                eval_rows: d.eval.len(),
                dim: d.d,
                dataset: d.report.clone(),
                backbone_cost: backbone_cost(plan, world),
            }),
            data_scale: st.data_scale,
            generated: world.generated.as_ref().map(|g| &g.report),
            cells: plan.cells.len(),
            failed_cells: failed,
            threads: st.threads,
            candle_threads: candle_core::utils::get_num_threads(),
            host: std::fs::read_to_string("/etc/hostname").map(|s| s.trim().to_string()).unwrap_or_default(),
            os: std::env::consts::OS,
            arch: std::env::consts::ARCH,
            crates: Meta::crates(),
            started: st.at,
            finished: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        }
    }
}

/// Removes `checkpoints/` of a complete run (meta.json exists).
fn remove_checkpoints(dir: &Path) -> Result<()> {
    let p = dir.join("checkpoints");
    if p.exists() {
        std::fs::remove_dir_all(&p).with_context(|| format!("removing {}", p.display()))?;
    }
    Ok(())
}

/// meta.json: what ran, on what, with which code and crates, and when.
#[derive(Serialize)]
struct Meta<'a> {
    onepass_version: &'static str,
    git_revision: &'static str,
    /// "true", "false", or "unknown" (no git at build time).
    git_dirty: &'static str,
    spec_file: String,
    overrides: &'a [String],
    resumed: bool,
    /// `--resume --force` over a difference of spec, code or data: which (cells whose config
    /// changed were started again).
    forced: Option<String>,
    /// `onepass merge`: the slice directories the run's cells came from.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    merged_from: Vec<String>,
    master_seed: u64,
    seeds: u32,
    setting: &'static str,
    data: Option<DataMeta>,
    /// ‖z‖² of the first pairs and each config's λ against it (λ = "auto", the diagnostic).
    data_scale: serde_json::Value,
    generated: Option<&'a world::generated::BankReport>,
    cells: usize,
    failed_cells: usize,
    threads: usize,
    /// The threads candle splits a matmul into (`RAYON_NUM_THREADS`; [`cap_library_threads`]).
    candle_threads: usize,
    host: String,
    os: &'static str,
    arch: &'static str,
    /// The project's crates and the third-party crates that produce the numbers (from Cargo.lock).
    crates: std::collections::BTreeMap<&'static str, &'static str>,
    started: String,
    finished: String,
}

/// ‖z‖²/λ above this: a full 𝓗⁻¹z step early in the stream moves the margin by ~100 units, and
/// omd-exact can overshoot into σ′ ≈ 0 where 𝓗 stops growing (issue 18's divergence).
pub const LARGE_Z_OVER_LAMBDA: f64 = 100.0;

/// meta.json's `data_scale` block, and a warning when some λ is small for the data:
/// median ‖z‖² over λ for the estimator's λ and the tracker's of every config.
pub fn scale_meta(world: &World) -> (serde_json::Value, Option<String>) {
    let s = world.spec.data_scale.unwrap_or_default();
    let mut lambdas = Vec::new();
    let mut worst: Option<(f64, String)> = None;
    for cell in &world.configs {
        let (c, choice) = (&cell.config, cell.curvature.choice);
        // a tracker's λ matters where the cell scores uncertainty with it (UCB, the pool and
        // stream rules, pessimism on a known truth); elsewhere it only feeds ‖θ − θ*‖_𝓗
        let scores = match (c.strategy, c.rule) {
            (Some(st), _) => st.needs_bonus(),
            (_, Some(crate::spec::ActiveRule::PoolArgmax)) => true,
            (_, Some(crate::spec::ActiveRule::Stream)) => world.spec.active.score_norm == crate::spec::ScoreNorm::H,
            (_, Some(crate::spec::ActiveRule::Fresh(st))) => st.needs_bonus(),
            _ => world.spec.setting == crate::spec::Setting::Passive,
        };
        let mut one = |what: &str, l: f64, auto: bool| {
            let ratio = s.median_z_sq / l;
            let counts = what == "estimator" || scores;
            if counts && worst.as_ref().is_none_or(|w| ratio > w.0) {
                worst = Some((ratio, format!("{} ({what} λ = {l})", c.label)));
            }
            serde_json::json!({"config": c.label, "lambda_of": what, "lambda": l, "auto": auto, "median_z_sq_over_lambda": ratio})
        };
        if let Some(l) = cell.lambda() {
            lambdas.push(one("estimator", l, c.lambda_auto));
        }
        if !choice.estimator && cell.curvature.tracker {
            let auto = world.spec.curvature.lambda == Some(crate::spec::OrAuto::Auto);
            lambdas.push(one("tracker", choice.tracker_lambda, auto));
        }
    }
    let warning = worst.filter(|w| w.0 > LARGE_Z_OVER_LAMBDA).map(|(r, who)| {
        format!(
            "median ‖z‖² / λ = {r:.0} for {who}: λ is small for this data (median ‖z‖² = {:.4}); early steps can overshoot — consider lambda = \"auto\" or a larger λ",
            s.median_z_sq
        )
    });
    let v = serde_json::json!({
        "pairs": s.pairs, "median_z_sq": s.median_z_sq, "p90_z_sq": s.p90_z_sq, "max_z_sq": s.max_z_sq,
        "auto_lambda": s.auto_lambda(), "lambdas": lambdas, "warning": warning,
    });
    (v, warning)
}

/// meta.json's `data` block (kind = "features" or "dataset").
#[derive(Serialize)]
struct DataMeta {
    path: String,
    blake3: String,
    train_rows: usize,
    eval_path: Option<String>,
    eval_blake3: Option<String>,
    eval_rows: usize,
    dim: usize,
    dataset: Option<serde_json::Value>,
    backbone_cost: Option<serde_json::Value>,
}

impl Meta<'_> {
    fn crates() -> std::collections::BTreeMap<&'static str, &'static str> {
        let mut m: std::collections::BTreeMap<&'static str, &'static str> = [
            ("runner", env!("CARGO_PKG_VERSION")),
            ("estimators", estimators::VERSION),
            ("selection", selection::VERSION),
            ("features", features::VERSION),
        ]
        .into();
        // "name=version,…" written by build.rs from Cargo.lock
        for kv in env!("ONEPASS_DEP_VERSIONS").split(',').filter(|s| !s.is_empty()) {
            if let Some((k, v)) = kv.split_once('=') {
                m.insert(k, v);
            }
        }
        m
    }
}

/// The last metric row of each seed of config `c`; None (and a line saying so, in a column of
/// `width`) when every seed failed.
fn finals<'a>(outcomes: &'a [results::CellOutcome<'_>], c: &ConfigPlan, width: usize) -> Option<Vec<&'a MetricRow>> {
    let rows: Vec<&MetricRow> = outcomes
        .iter()
        .filter(|o| o.config.config_id == c.config_id)
        .filter_map(|o| o.result.as_ref().ok().and_then(|r| r.rows.last()))
        .collect();
    if rows.is_empty() {
        eprintln!("{:<width$} (every seed failed)", c.label);
        return None;
    }
    Some(rows)
}

/// Final metrics per config, mean over seeds.
fn print_summary(plan: &Plan, world: &World, outcomes: &[results::CellOutcome<'_>]) {
    if world.generated.is_some() && world.spec.setting == spec::Setting::Deploy {
        print_deploy_summary(plan, outcomes, world.online.is_none());
        if world.online.is_some() {
            eprint!("{}", policy_summary(outcomes));
        }
        return;
    }
    eprintln!("{:<44} {:>8} {:>10} {:>10} {:>12}", "config", "eval_acc", "theta_err", "subopt", "regret");
    for c in &plan.configs {
        let Some(finals) = finals(outcomes, c, 44) else { continue };
        let n = finals.len() as f64;
        let mean = |f: &dyn Fn(&MetricRow) -> f64| finals.iter().map(|r| f(r)).sum::<f64>() / n;
        let opt = |f: &dyn Fn(&MetricRow) -> Option<f64>, digits: usize| {
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

/// A run with a learning policy: the held-out policy reward per arm, chunk 0 → the last
/// evaluation, over seeds with its t-interval ([`crate::report::policy_console`]).
fn policy_summary(outcomes: &[results::CellOutcome<'_>]) -> String {
    let rows: Vec<crate::report::Row> = outcomes
        .iter()
        .filter_map(|o| o.result.as_ref().ok().map(|r| (o, r)))
        .flat_map(|(o, r)| r.policy.iter().map(move |p| crate::report::policy_row(o.config.label.clone(), o.seed, p)))
        .collect();
    crate::report::policy_console(&rows)
}

/// Chunked deployment: cumulative metrics at the last chunk (mean over seeds) and win rates;
/// `chunk_policy`: the mean over chunks of the oracle reward of the chunk's samples (a run
/// with a learning policy prints the held-out policy reward instead).
fn print_deploy_summary(plan: &Plan, outcomes: &[results::CellOutcome<'_>], chunk_policy: bool) {
    let wins = results::win_rates(plan, outcomes);
    let policy_head = if chunk_policy { format!(" {:>8}", "policy") } else { String::new() };
    eprintln!(
        "{:<34} {:>9} {:>9} {:>9}{policy_head} {:>8} {:>7} {:>7}",
        "config", "cum_pair", "mean_rew", "regret", "tau", "win/ch", "win/pr"
    );
    for c in &plan.configs {
        let Some(finals) = finals(outcomes, c, 34) else { continue };
        let n = finals.len() as f64;
        let mean = |f: &dyn Fn(&MetricRow) -> Option<f64>| finals.iter().filter_map(|r| f(r)).sum::<f64>() / n;
        // the mean over the run of the chunks' policy reward and τ
        let all: Vec<&MetricRow> = outcomes
            .iter()
            .filter(|o| o.config.config_id == c.config_id)
            .filter_map(|o| o.result.as_ref().ok())
            .flat_map(|r| r.rows.iter())
            .collect();
        let avg = |f: &dyn Fn(&MetricRow) -> Option<f64>| {
            all.iter().filter_map(|r| f(r)).sum::<f64>() / all.len().max(1) as f64
        };
        let w = &wins[c.config_id];
        let policy = if chunk_policy { format!(" {:>8.4}", avg(&|r| r.policy_reward)) } else { String::new() };
        eprintln!(
            "{:<34} {:>9.3} {:>9.4} {:>9.2}{policy} {:>8.3} {:>7.3} {:>7.3}",
            c.label,
            mean(&|r| r.cum_pair_reward),
            mean(&|r| r.mean_reward),
            mean(&|r| r.regret),
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
fn backbone_cost(plan: &Plan, world: &World) -> Option<serde_json::Value> {
    let d = world.data.as_ref()?;
    let r = d.report.as_ref()?;
    let get = |k: &str| r.get(k).and_then(|v| v.as_u64()).unwrap_or(0) as f64;
    let (train_pairs, eval_pairs) = (get("train_pairs").max(1.0), get("eval_pairs"));
    let (train_tok, eval_tok) = (get("train_tokens"), get("eval_tokens"));
    let s = &world.spec.stream;
    let samples = s.samples as f64;
    let evals = (s.samples / s.eval_every + u64::from(!s.samples.is_multiple_of(s.eval_every))) as f64;
    // pairs pushed through the backbone per labelled sample: 1, or the stream rule's candidates/keep
    let per_sample = |c: &ConfigPlan| match c.rule {
        Some(spec::ActiveRule::Stream) => plan.spec.active.candidates as f64 / plan.spec.active.keep.max(1) as f64,
        _ => 1.0,
    };
    let cost = |c: &ConfigPlan| {
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

/// What a run is, for refusing a resume of a different one: the resolved spec without the
/// keys that do not change the numbers (`threads`, `[checkpoint]`, `[track]`), the code revision, and
/// digests of the data files the plan read.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunIdentity {
    pub spec: String,
    pub git_revision: String,
    pub git_dirty: bool,
    pub data: Vec<(String, String)>,
}

impl RunIdentity {
    pub fn of(plan: &Plan, world: &World) -> Result<Self> {
        let mut s = plan.resolved(&world.spec);
        s.threads = 0;
        s.checkpoint = Default::default();
        s.track = Default::default();
        let mut data = Vec::new();
        if let Some(d) = &world.data {
            data.push((d.train_path.display().to_string(), d.train.digest.clone()));
            if let Some(p) = &d.eval_path {
                data.push((p.display().to_string(), d.eval.digest.clone()));
            }
            if let Some(o) = &d.order {
                let bytes: Vec<u8> = o.iter().flat_map(|&i| (i as u64).to_le_bytes()).collect();
                data.push(("stream order".into(), blake3::hash(&bytes).to_hex().to_string()));
            }
        }
        if let Some(g) = &world.generated {
            // what the bank is made of first — the prompts (training and held out) and the
            // policy's weights — so a refused resume names the file that changed
            if let Some(gs) = &world.spec.generate {
                let mut h = blake3::Hasher::new();
                for m in g.prompts.iter().chain(&g.eval_prompts).flatten() {
                    h.update(&(m.role.len() as u64).to_le_bytes());
                    h.update(m.role.as_bytes());
                    h.update(&(m.content.len() as u64).to_le_bytes());
                    h.update(m.content.as_bytes());
                }
                data.push((
                    format!("the prompts (generate.prompts = {})", gs.prompts),
                    h.finalize().to_hex().to_string(),
                ));
                data.push((
                    format!("the policy's weights (generate.policy = {})", gs.policy),
                    g.report.policy_weights_blake3.clone(),
                ));
            }
        }
        if let Some(o) = world.online.as_ref().filter(|o| !o.warm_start.is_empty()) {
            // the warm start's pairs as the policy reads them (token ids): a file edited under a
            // run would give its cells two warm starts
            let mut h = blake3::Hasher::new();
            for w in &o.warm_start {
                for ids in [&w.prompt, &w.chosen, &w.rejected] {
                    h.update(&(ids.len() as u64).to_le_bytes());
                    ids.iter().for_each(|t| {
                        h.update(&t.to_le_bytes());
                    });
                }
            }
            let path = plan.policy.as_ref().and_then(|p| p.dpo.warm_start.as_ref()).map_or("", |w| w.path.as_str());
            data.push((
                format!("the warm start's pairs (policy.dpo.warm_start.path = {path})"),
                h.finalize().to_hex().to_string(),
            ));
        }
        if let Some(g) = &world.generated {
            // φ and the oracle's rewards apart, so a refused resume names what changed (the
            // φ model, or an oracle file replaced under the run)
            let (mut hp, mut hr) = (blake3::Hasher::new(), blake3::Hasher::new());
            for c in g.bank.contexts.iter() {
                let phi: Vec<u8> = c.phi.iter().flat_map(|v| v.to_le_bytes()).collect();
                hp.update(&phi);
                let r: Vec<u8> = c.reward.iter().flatten().flat_map(|v| v.to_le_bytes()).collect();
                hr.update(&r);
            }
            let f = world.spec.features.as_ref().map_or(String::new(), |f| f.model.clone());
            data.push((
                format!("the generated responses' φ (features.model = {f})"),
                hp.finalize().to_hex().to_string(),
            ));
            let o = world.spec.oracle.as_ref();
            let source = match (o.and_then(|o| o.path.as_ref()), o.and_then(|o| o.model.as_ref())) {
                (Some(p), _) => format!("oracle.path = {p}"),
                (None, Some(m)) => format!("oracle.model = {m}"),
                _ => format!("oracle.seed = {}", o.map_or(0, |o| o.seed)),
            };
            data.push((
                format!("the oracle's rewards of the generated responses ({source})"),
                hr.finalize().to_hex().to_string(),
            ));
        }
        Ok(RunIdentity {
            spec: toml::to_string(&s).context("serialising the resolved spec")?,
            git_revision: env!("ONEPASS_GIT_REV").to_string(),
            git_dirty: env!("ONEPASS_GIT_DIRTY") == "true",
            data,
        })
    }

    pub fn fingerprint(&self) -> String {
        blake3::hash(serde_json::to_string(self).expect("plain JSON").as_bytes()).to_hex().to_string()
    }

    /// Why `self` (this invocation) cannot resume `run` (the run directory's), or None.
    pub fn mismatch(&self, run: &RunIdentity) -> Option<String> {
        if self.spec != run.spec {
            let (a, b): (Vec<&str>, Vec<&str>) = (self.spec.lines().collect(), run.spec.lines().collect());
            let i = (0..a.len().max(b.len())).find(|&i| a.get(i) != b.get(i)).unwrap_or(0);
            return Some(format!(
                "the spec differs from the run's: line {} of the resolved spec is `{}` here, `{}` in the run",
                i + 1,
                a.get(i).unwrap_or(&"(end)"),
                b.get(i).unwrap_or(&"(end)")
            ));
        }
        if self.git_revision != run.git_revision {
            return Some(format!(
                "the code revision differs: this binary is {}, the run was made by {}",
                self.git_revision, run.git_revision
            ));
        }
        if self.data != run.data {
            let diff = self
                .data
                .iter()
                .zip(&run.data)
                .find(|(a, b)| a != b)
                .map(|(a, b)| {
                    let was = if a.0 == b.0 { String::new() } else { format!(" ({})", b.0) };
                    format!("{}: digest {} here, {} in the run{was}", a.0, a.1, b.1)
                })
                .unwrap_or_else(|| format!("{} data files here, {} in the run", self.data.len(), run.data.len()));
            return Some(format!("the data differ: {diff}"));
        }
        None
    }
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
