//! `onepass cells DIR…`: where each cell of a run directory stands — a slice of a SLURM array,
//! a run still going or killed, a complete run — read from the directory alone (its resolved
//! spec, resume.json, slice.json and checkpoints/), with no data or model. A finished cell's
//! `.done` file holds its rows, so its last evaluation is shown before any merge: the question
//! of a user whose array is half done ("what do the finished cells say?"), which `onepass
//! merge` answers only once every cell is finished. Nothing is written and nothing is locked.

use crate::results::{PlannedCell, PLAN_FILE};
use crate::run::{DoneCell, RunIdentity, SliceFile};
use anyhow::{Context, Result};
use serde::Serialize;
use std::path::{Path, PathBuf};

/// A cell of the directory's plan and where it stands.
#[derive(Clone, Debug, Serialize)]
pub struct CellStatus {
    pub cell_id: String,
    pub config: String,
    pub seed: u32,
    /// "finished", "failed", "checkpointed", "not started", "another slice" or "in the tables"
    /// (a complete run whose cells.parquet could not be read; else a complete run's cells are
    /// finished or failed as cells.parquet says, with metrics.parquet's last evaluation).
    pub state: &'static str,
    /// A failed cell's error, or why a `.done` file could not be read.
    pub error: Option<String>,
    /// A finished cell's last evaluation row: its step, held-out loss and accuracy.
    pub step: Option<u64>,
    pub eval_loss: Option<f64>,
    pub eval_accuracy: Option<f64>,
    /// A finished cell's wall time and the seconds inside its estimator's updates.
    pub wall_s: Option<f64>,
    pub estimator_s: Option<f64>,
}

/// A run directory and its cells.
#[derive(Clone, Debug, Serialize)]
pub struct DirStatus {
    pub dir: PathBuf,
    /// The revision that wrote it (resume.json) and this build's: a `.done` file is postcard,
    /// not self-describing, so another revision's may not be readable (its cell says so).
    pub revision: String,
    pub this_revision: &'static str,
    /// `--cells i/N` of a slice directory.
    pub slice: Option<(usize, usize)>,
    pub complete: bool,
    pub cells: Vec<CellStatus>,
}

/// Reads `dir` (a run or slice directory) — see the module's doc.
pub fn cells(dir: &Path) -> Result<DirStatus> {
    let id: RunIdentity = serde_json::from_str(
        &std::fs::read_to_string(dir.join("resume.json"))
            .with_context(|| format!("{}: no resume.json there (not a run or slice directory)", dir.display()))?,
    )
    .with_context(|| format!("{}/resume.json: not a run identity", dir.display()))?;
    let cells = planned_cells(dir)?;
    let slice = read_slice(dir)?;
    let complete = dir.join("meta.json").exists();
    let tables = if complete { from_tables(dir) } else { None };
    let mut out = Vec::with_capacity(cells.len());
    for (k, cell) in cells.iter().enumerate() {
        let mut st = CellStatus {
            cell_id: cell.cell_id.clone(),
            config: cell.config.clone(),
            seed: cell.seed,
            state: "not started",
            error: None,
            step: None,
            eval_loss: None,
            eval_accuracy: None,
            wall_s: None,
            estimator_s: None,
        };
        let ck = dir.join("checkpoints");
        let (done, ckpt) = (ck.join(format!("{}.done", cell.cell_id)), ck.join(format!("{}.ckpt", cell.cell_id)));
        if complete {
            st.state = "in the tables";
            if let Some(t) = tables.as_ref().and_then(|t| t.get(&cell.cell_id)) {
                let config = std::mem::take(&mut st.config);
                st = CellStatus { config, ..t.clone() };
            }
        } else if done.exists() {
            read_done(&mut st, &done, &id);
        } else if ckpt.exists() {
            st.state = "checkpointed";
        } else if slice.is_some_and(|(i, n)| k % n != i) {
            st.state = "another slice";
        }
        out.push(st);
    }
    Ok(DirStatus {
        dir: dir.to_path_buf(),
        revision: id.git_revision,
        this_revision: env!("ONEPASS_GIT_REV"),
        slice,
        complete,
        cells: out,
    })
}

/// `--cells i/N` of a slice directory, from its slice.json (None: not a slice).
fn read_slice(dir: &Path) -> Result<Option<(usize, usize)>> {
    Ok(match std::fs::read_to_string(dir.join("slice.json")) {
        Ok(t) => {
            let f: SliceFile = serde_json::from_str(&t)
                .with_context(|| format!("{}/slice.json: expected {{\"index\": i, \"count\": N}}", dir.display()))?;
            Some((f.index, f.count))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(e).with_context(|| format!("reading {}/slice.json", dir.display())),
    })
}

/// A `.done` cell file read into its status: finished (its wall time, estimator seconds and
/// last evaluation) or failed (its error); corrupt or unreadable (another revision's) with why.
fn read_done(st: &mut CellStatus, done: &Path, id: &RunIdentity) {
    match crate::io::read_any::<DoneCell>(done) {
        Ok((_, d)) => {
            st.wall_s = Some(d.wall_s);
            match d.result {
                Ok(r) => {
                    st.state = "finished";
                    st.estimator_s = Some(r.estimator_s);
                    if let Some(last) = r.rows.iter().max_by_key(|m| m.step) {
                        st.step = Some(last.step);
                        st.eval_loss = Some(last.eval_loss);
                        st.eval_accuracy = Some(last.eval_accuracy);
                    }
                }
                Err(e) => {
                    st.state = "failed";
                    st.error = Some(e);
                }
            }
        }
        Err(e) => {
            // a .done that cannot be read is not a finished cell: corrupt (or, from
            // another revision, unreadable here), named with its file
            let other = if id.git_revision != env!("ONEPASS_GIT_REV") {
                st.state = "unreadable";
                format!(" (written by revision {}: read it with a build of that revision)", id.git_revision)
            } else {
                st.state = "corrupt";
                String::new()
            };
            let e = format!("{e:#}");
            let named = if e.contains(&done.display().to_string()) { e } else { format!("{}: {e}", done.display()) };
            st.error = Some(format!("{named}{other}"));
        }
    }
}

/// A complete run's cells as its tables hold them (cells.parquet: finished or failed, the
/// error; metrics.parquet: the last evaluation; timings.parquet: the cell's times), by cell id;
/// None when cells.parquet cannot be read (the cells then say "in the tables").
fn from_tables(dir: &Path) -> Option<std::collections::BTreeMap<String, CellStatus>> {
    let mut out: std::collections::BTreeMap<String, CellStatus> = crate::results::read_cells(dir)
        .ok()?
        .into_iter()
        .map(|(k, c)| {
            let ok = c.status == "ok";
            let st = CellStatus {
                cell_id: k.cell_id.clone(),
                config: k.label,
                seed: k.seed,
                state: if ok { "finished" } else { "failed" },
                error: c.err,
                step: None,
                eval_loss: None,
                eval_accuracy: None,
                wall_s: None,
                estimator_s: None,
            };
            (k.cell_id, st)
        })
        .collect();
    for (k, m) in crate::results::read_metrics(dir).unwrap_or_default() {
        if let Some(st) = out.get_mut(&k.cell_id).filter(|st| st.step.is_none_or(|s| s <= m.step)) {
            (st.step, st.eval_loss, st.eval_accuracy) = (Some(m.step), Some(m.eval_loss), Some(m.eval_accuracy));
        }
    }
    for (k, t) in crate::results::read_timings(dir).unwrap_or_default() {
        if let Some(st) = out.get_mut(&k.cell_id) {
            (st.wall_s, st.estimator_s) = (Some(t.wall_s), Some(t.estimator_s));
        }
    }
    Some(out)
}

/// The directory's cells: plan.json's, or — for a directory made before plan.json existed —
/// from its resolved spec, where that is unambiguous: cells are config-major (cell k is config
/// k / seeds, seed k mod seeds), and without deploy's strategies a config is an
/// `[[estimator]]` table, labelled here by its kind (a sweep's labels are not rebuilt).
fn planned_cells(dir: &Path) -> Result<Vec<PlannedCell>> {
    let p = dir.join(PLAN_FILE);
    match std::fs::read_to_string(&p) {
        Ok(t) => {
            #[derive(serde::Deserialize)]
            struct F {
                cells: Vec<PlannedCell>,
            }
            let f: F = serde_json::from_str(&t)
                .with_context(|| format!("{}: expected {{\"cells\": [{{cell_id, config, seed}}, …]}}", p.display()))?;
            return Ok(f.cells);
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("reading {}", p.display())),
    }
    let r = dir.join("spec.resolved.toml");
    let text = std::fs::read_to_string(&r).with_context(|| format!("{}: neither {PLAN_FILE} nor it", r.display()))?;
    let t: toml::Table = text.parse().with_context(|| format!("{}: not TOML", r.display()))?;
    let setting = t.get("setting").and_then(|v| v.as_str()).unwrap_or_default();
    if setting == "deploy" {
        anyhow::bail!(
            "{}: no {PLAN_FILE} (made by an older onepass) and a deploy run's configs (estimator × strategy) are not rebuilt from its resolved spec: resume it with this build once, or merge it",
            dir.display()
        );
    }
    let seeds = t
        .get("seeds")
        .and_then(|v| v.as_integer())
        .filter(|&n| n > 0)
        .with_context(|| format!("{}: `seeds`: expected a positive whole number", r.display()))?;
    let ests = t
        .get("estimator")
        .and_then(|v| v.as_array())
        .filter(|a| !a.is_empty())
        .with_context(|| format!("{}: `estimator`: expected an array of tables", r.display()))?;
    let mut cells = Vec::new();
    for (i, e) in ests.iter().enumerate() {
        let kind = e
            .get("kind")
            .and_then(|v| v.as_str())
            .with_context(|| format!("{}: `estimator.{i}.kind`: expected a string", r.display()))?;
        for s in 0..seeds {
            let k = cells.len();
            cells.push(PlannedCell {
                cell_id: format!("c{k:04}"),
                config: format!("{kind} (estimator.{i})"),
                seed: s as u32,
            });
        }
    }
    Ok(cells)
}

/// The statuses as text: a header line per directory, then a line per cell.
pub fn render(dirs: &[DirStatus]) -> String {
    let mut s = String::new();
    for d in dirs {
        let slice = d.slice.map_or(String::new(), |(i, n)| format!(", slice {i}/{n}"));
        let done = d.cells.iter().filter(|c| c.state == "finished").count();
        s.push_str(&format!(
            "{} (revision {}{slice}{}): {} cells, {done} finished\n",
            d.dir.display(),
            short(&d.revision),
            if d.complete { ", complete: `onepass report` reads its tables" } else { "" },
            d.cells.len()
        ));
        let w = d.cells.iter().map(|c| c.config.len()).max().unwrap_or(6).max(6);
        s.push_str(&format!(
            "  {:<6} {:<w$} {:>4}  {:<13} {:>6} {:>9} {:>9} {:>9}\n",
            "cell", "config", "seed", "state", "step", "eval loss", "eval acc", "wall s"
        ));
        for c in &d.cells {
            let f = |x: Option<f64>, p: usize| x.map_or("-".to_string(), |v| format!("{v:.p$}"));
            s.push_str(&format!(
                "  {:<6} {:<w$} {:>4}  {:<13} {:>6} {:>9} {:>9} {:>9}\n",
                c.cell_id,
                c.config,
                c.seed,
                c.state,
                c.step.map_or("-".to_string(), |v| v.to_string()),
                f(c.eval_loss, 4),
                f(c.eval_accuracy, 4),
                // a cell under 10 s keeps a decimal: a sub-second cell is not "0"
                f(c.wall_s, if c.wall_s.is_some_and(|w| w < 10.0) { 1 } else { 0 }),
            ));
            if let Some(e) = &c.error {
                s.push_str(&format!("         {}: {e}\n", c.cell_id));
            }
        }
    }
    s
}

fn short(rev: &str) -> &str {
    rev.get(..7).unwrap_or(rev)
}
