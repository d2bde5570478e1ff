//! How a cell is checkpointed ([`CellSaver`], [`CellCtx`]) and read back ([`CellState`]), and
//! the loop skeleton that checkpoints after each unit ([`drive`]).

use super::learner::Learner;
use super::live::{Live, Snapshot};
use super::state::Progress;
use crate::io::{encode, stop_requested, write_atomic_at, Interrupted};
use crate::spec::CheckpointSpec;
use anyhow::Result;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::Instant;

/// The loop skeleton of the single-learner settings: loop units `pr.done + 1 ..= units` (updates,
/// or chunks), each `unit(t, last, progress, learner)`; after each the unit counts as done and a
/// checkpoint is written when one is due (a resumed cell starts after its last done unit).
pub(super) fn drive(
    units: u64,
    pr: &mut Progress,
    l: &mut Learner,
    ctx: &mut CellCtx,
    mut unit: impl FnMut(u64, bool, &mut Progress, &mut Learner) -> Result<()>,
) -> Result<()> {
    for t in pr.done + 1..=units {
        unit(t, t == units, pr, l)?;
        pr.done = t;
        ctx.tick(&[&*l], pr)?;
    }
    Ok(())
}

/// A cell's checkpoint as written (borrowed) …
#[derive(Serialize)]
struct StateRef<'a> {
    pub(super) learners: &'a [&'a Learner],
    pub(super) progress: &'a Progress,
    pub(super) wall_s: f64,
}

/// … and as read back.
#[derive(Deserialize)]
pub struct CellState {
    pub(super) learners: Vec<Learner>,
    pub(super) progress: Progress,
    pub(super) wall_s: f64,
}

impl CellState {
    /// Wall seconds the cell had run when the checkpoint was written.
    pub fn wall_s(&self) -> f64 {
        self.wall_s
    }
}

/// What a cell needs besides the plan: where to checkpoint, the state to resume from, and
/// where its live curves go.
pub struct CellCtx {
    pub saver: CellSaver,
    pub resume: Option<CellState>,
    pub live: Live,
}

impl CellCtx {
    /// No checkpoints, a fresh start, no live curves.
    pub fn none() -> Self {
        CellCtx { saver: CellSaver::disabled(), resume: None, live: Live::off() }
    }

    /// A checkpoint now (the caller asked [`CellSaver::due`]).
    pub(super) fn save(&mut self, learners: &[&Learner], progress: &Progress) -> Result<()> {
        let wall_s = self.saver.wall_s();
        self.saver.save(&StateRef { learners, progress, wall_s })
    }

    /// After each loop unit: the new rows to the live curves, a checkpoint when one is due.
    pub(super) fn tick(&mut self, learners: &[&Learner], progress: &Progress) -> Result<()> {
        if let Some(l) = learners.first() {
            self.live.publish(Snapshot::of(l, progress));
        }
        if self.saver.due() {
            let wall_s = self.saver.wall_s();
            self.saver.save(&StateRef { learners, progress, wall_s })?;
        }
        Ok(())
    }
}

/// Decides when a running cell saves its state, and writes it.
pub struct CellSaver {
    path: Option<PathBuf>,
    fingerprint: String,
    what: String,
    every_s: f64,
    every_steps: u64,
    since: u64,
    last: Instant,
    started: Instant,
    /// Wall seconds the cell ran before this process (resumed cells).
    pub wall_before: f64,
    /// Checkpoints written by this process.
    pub saves: u64,
}

impl CellSaver {
    pub fn new(path: PathBuf, fingerprint: &str, what: &str, spec: &CheckpointSpec) -> Self {
        CellSaver {
            path: Some(path),
            fingerprint: fingerprint.to_string(),
            what: what.to_string(),
            every_s: spec.every_s,
            every_steps: spec.every_steps,
            ..CellSaver::disabled()
        }
    }

    /// Saves nothing (library callers and tests that need no run directory).
    pub fn disabled() -> Self {
        CellSaver {
            path: None,
            fingerprint: String::new(),
            what: String::new(),
            every_s: 0.0,
            every_steps: 0,
            since: 0,
            last: Instant::now(),
            started: Instant::now(),
            wall_before: 0.0,
            saves: 0,
        }
    }

    /// Counts one loop step; true when a checkpoint is due (periodic, or a stop was asked).
    pub fn due(&mut self) -> bool {
        if self.path.is_none() {
            return false;
        }
        self.since += 1;
        stop_requested()
            || (self.every_steps > 0 && self.since >= self.every_steps)
            || (self.every_s > 0.0 && self.last.elapsed().as_secs_f64() >= self.every_s)
    }

    /// Wall seconds of the cell so far, over every process that ran it.
    pub fn wall_s(&self) -> f64 {
        self.wall_before + self.started.elapsed().as_secs_f64()
    }

    /// Writes the checkpoint; then, if a stop was asked, returns [`Interrupted`].
    pub fn save<T: Serialize>(&mut self, body: &T) -> Result<()> {
        let Some(path) = &self.path else { return Ok(()) };
        let bytes = encode(&self.fingerprint, &self.what, body)?;
        write_atomic_at(path, &bytes, "checkpoint-write")?;
        self.saves += 1;
        self.since = 0;
        self.last = Instant::now();
        if stop_requested() {
            return Err(Interrupted.into());
        }
        Ok(())
    }
}
