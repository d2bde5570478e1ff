//! The run directory: made fresh or claimed for `--resume` (locked, its identity checked), the
//! slices a merge gathers, finished cells kept in `checkpoints/` until the run is complete.

use super::identity::RunIdentity;
use super::options::{RunOptions, RunSummary};
use crate::plan::Plan;
use crate::rows::CellResult;
use crate::world::World;
use crate::{io, results};
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// A slice directory's `slice.json`: which slice of the run's cells it holds.
#[derive(Serialize, Deserialize, PartialEq)]
pub(crate) struct SliceFile {
    pub(crate) index: usize,
    pub(crate) count: usize,
}

/// `onepass merge`: where each of the plan's cells finished — its `.done` file in one of
/// `slices`, slice directories of this very run (the same identity: spec, `--set`, revision,
/// data), each locked while it is read (a slice still running is refused). Every cell must be
/// in exactly one slice.
pub(super) fn gather_slices(
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
pub(super) fn open_run_dir(
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
pub(super) struct Claimed {
    lock: io::DirLock,
    manifest: String,
}

/// What can be refused about the run directory before any data is read or model loaded: a
/// resumed directory that is not a run's or that another process holds (claimed here: locked,
/// its resume.json read), an `--out` that cannot be written (checked without writing anything).
pub(super) fn claim_output(opts: &RunOptions) -> Result<Option<Claimed>> {
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

/// A run directory whose meta.json exists is complete: nothing to resume (checkpoints a kill
/// between meta.json and their removal left behind are removed).
pub(super) fn already_complete(plan: &Plan, dir: &Path) -> Result<Option<RunSummary>> {
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

/// Removes `checkpoints/` of a complete run (meta.json exists).
pub(super) fn remove_checkpoints(dir: &Path) -> Result<()> {
    let p = dir.join("checkpoints");
    if p.exists() {
        std::fs::remove_dir_all(&p).with_context(|| format!("removing {}", p.display()))?;
    }
    Ok(())
}
