//! A cell's state between loop units: its random streams, the stream position, rows and running
//! sums ([`Progress`]), how it is checkpointed ([`CellSaver`], [`CellCtx`]) and read back
//! ([`CellState`]).

use super::learner::Learner;
use super::live::{Live, Snapshot};
use crate::io::{encode, stop_requested, write_atomic_at, Interrupted};
use crate::rows::{AdapterFiles, MetricRow, PolicyRow, PolicyTiming, RoundRow, SampleRow, UpdateRow};
use crate::spec::CheckpointSpec;
use crate::world::env::{stream, Component};
use anyhow::Result;
use estimators::Curvature;
use rand_chacha::ChaCha20Rng;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::Instant;

/// The wall clock of the current evaluation bucket, kept across a kill: a checkpoint writes the
/// seconds the bucket has run so far and a resume goes on from them. The steps between that
/// checkpoint and a kill drop out of this clock as they drop out of the estimator's seconds
/// (read back from the same checkpoint), so a resumed bucket's `other_s` = wall − estimator
/// stays what the steps left over — where a clock restarted at the resume made it negative.
#[derive(Clone, Debug)]
pub(super) struct BucketClock {
    before: f64,
    since: Instant,
}

impl BucketClock {
    pub(super) fn start() -> Self {
        BucketClock { before: 0.0, since: Instant::now() }
    }

    /// Wall seconds of the bucket so far, over every process that ran it.
    pub(super) fn seconds(&self) -> f64 {
        self.before + self.since.elapsed().as_secs_f64()
    }

    /// The bucket's wall seconds; the next bucket starts now.
    pub(super) fn lap(&mut self) -> f64 {
        let s = self.seconds();
        *self = Self::start();
        s
    }
}

impl Serialize for BucketClock {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_f64(self.seconds())
    }
}

impl<'de> Deserialize<'de> for BucketClock {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        Ok(BucketClock { before: f64::deserialize(d)?, since: Instant::now() })
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct Hasher(pub(super) u64);

impl Hasher {
    pub(super) fn new() -> Self {
        Hasher(0xcbf2_9ce4_8422_2325)
    }
    pub(super) fn bytes(&mut self, b: &[u8]) {
        for &x in b {
            self.0 = (self.0 ^ u64::from(x)).wrapping_mul(0x100_0000_01b3);
        }
    }
    pub(super) fn f32s(&mut self, v: &[f32]) {
        for x in v {
            self.bytes(&x.to_le_bytes());
        }
    }
}

/// Where a cell's loop stands: its random streams, the stream position, the rows so far, and
/// what each setting keeps besides ([`DeployProgress`], [`ActiveProgress`], [`PolicyProgress`],
/// the reward model's state). With the learners, everything a checkpoint holds.
#[derive(Serialize, Deserialize)]
pub struct Progress {
    /// Loop units completed: updates (passive, active, deploy) or chunks (chunked deploy).
    pub(super) done: u64,
    /// Training rows of the stream order consumed so far (pairs): an explicit index.
    pub(super) position: u64,
    pub(super) data: ChaCha20Rng,
    pub(super) labels: ChaCha20Rng,
    pub(super) select: ChaCha20Rng,
    pub(super) hash: Hasher,
    pub(super) rows: Vec<MetricRow>,
    /// Ties broken by a seeded draw so far (selection rules).
    pub(super) ties: u64,
    pub(super) deploy: DeployProgress,
    pub(super) active: ActiveProgress,
    pub(super) policy: PolicyProgress,
    /// The labels the cell's labeller has given and flipped (`[oracle] flip`).
    #[serde(default)]
    pub(super) flips: crate::world::env::LabelCount,
    /// `[reward] update = "lora" | "full"`: the reward model's parameters and update state.
    #[serde(default)]
    pub(super) reward_state: Option<super::passive_rm::RmState>,
}

/// Deployment's running sums: rounds.parquet's rows, the argmax oracle's ties, regret and the
/// chosen pairs' rewards, prompts seen.
#[derive(Default, Serialize, Deserialize)]
pub(super) struct DeployProgress {
    pub(super) rounds: Vec<RoundRow>,
    pub(super) oracle_ties: u64,
    pub(super) regret: f64,
    pub(super) reward_sum: f64,
    pub(super) cum_pair: f64,
    pub(super) seen: u64,
}

/// Active collection: pool rows already labelled, and the authors' V tracker.
#[derive(Default, Serialize, Deserialize)]
pub(super) struct ActiveProgress {
    pub(super) used: Vec<bool>,
    pub(super) vtrack: Option<Curvature>,
}

/// Deploy with a learning policy in the run: its evaluations, updates, timings, adapters and
/// optimiser state so far.
#[derive(Default, Serialize, Deserialize)]
pub(super) struct PolicyProgress {
    pub(super) rows: Vec<PolicyRow>,
    pub(super) samples: Vec<SampleRow>,
    pub(super) updates: Vec<UpdateRow>,
    pub(super) times: Vec<PolicyTiming>,
    pub(super) state: Option<super::online::PolicyState>,
    pub(super) adapters: Vec<AdapterFiles>,
}

impl Progress {
    /// The start of a cell: every stream at its origin.
    pub(super) fn fresh(master_seed: u64, seed: u32) -> Progress {
        Progress {
            done: 0,
            position: 0,
            data: stream(master_seed, seed, Component::Data),
            labels: stream(master_seed, seed, Component::Labels),
            select: stream(master_seed, seed, Component::Select),
            hash: Hasher::new(),
            rows: Vec::new(),
            ties: 0,
            deploy: DeployProgress::default(),
            active: ActiveProgress::default(),
            policy: PolicyProgress::default(),
            flips: Default::default(),
            reward_state: None,
        }
    }
}

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

#[cfg(test)]
mod tests {
    use super::BucketClock;

    #[test]
    fn a_bucket_clock_carries_its_seconds_through_a_checkpoint() {
        // 2.5 s of the bucket ran in the process that wrote the checkpoint
        let mut c = BucketClock::start();
        c.before = 2.5;
        let bytes = postcard::to_stdvec(&c).unwrap();
        let mut back: BucketClock = postcard::from_bytes(&bytes).unwrap();
        let s = back.seconds();
        assert!((2.5..3.5).contains(&s), "the resumed bucket's clock reads {s} s");
        // a lap ends the bucket with those seconds and starts the next one at zero
        let lap = back.lap();
        assert!(lap >= s, "lap {lap} < {s}");
        assert!(back.seconds() < 1.0, "the next bucket starts at {} s", back.seconds());
        // the checkpoint holds the seconds, not a restart: a fresh clock reads ~0
        assert!(BucketClock::start().seconds() < 1.0);
    }
}
