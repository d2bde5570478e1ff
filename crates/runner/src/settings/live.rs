//! Live curves: a cell's rows as TensorBoard scalars under `<run>/tb/<cell_id>/`, written as the
//! loop produces them (after each loop unit, flushed whenever something new was written), so
//! `tensorboard --logdir <run>/tb` shows a run while it runs. The cells know only [`Live`], a
//! handle in their [`super::CellCtx`]; the run layer decides whether and where it writes
//! (`[track] tensorboard`).
//!
//! # Tags
//!
//! The x-axis (step) is the metric row's `step` (estimator updates), or its `chunk` in a chunked
//! deployment (generated responses), where every tag of the cell is per chunk (0: before the
//! first update).
//!
//! The reward model, from metrics.parquet (each where the row has it):
//!
//! | tag | column |
//! |---|---|
//! | `eval/loss`, `eval/accuracy`, `eval/ties` | `eval_loss`, `eval_accuracy`, `eval_ties` |
//! | `reward/train_loss`, `reward/train_accuracy` | `train_loss`, `train_accuracy` (prequential) |
//! | `reward/kappa`, `reward/samples_seen` | `kappa`, `samples_seen` |
//! | `theta/err`, `theta/err_h` | `theta_err`, `theta_err_h` |
//! | `eval/subopt`, `eval/subopt_avg` | `subopt`, `subopt_avg` |
//! | `eval/subopt_pessimistic`, `eval/subopt_pessimistic_ref` | the final row's (written when the cell ends) |
//! | `deploy/regret`, `deploy/mean_reward` | `regret`, `mean_reward` |
//! | `deploy/pair_reward`, `deploy/cum_pair_reward`, `deploy/policy_reward`, `deploy/kendall_tau`, `deploy/oracle_ties` | the chunk's columns |
//!
//! A learning policy's held-out evaluation, from policy.parquet: `policy/reward`
//! (`policy_reward`), `policy/sample_reward`, `policy/bon_reward`, `policy/learned_reward`,
//! `policy/kl`, `policy/entropy`, `policy/response_tokens`, `policy/cut_fraction`,
//! `policy/merge_error`.
//!
//! Its update per chunk, from policy_updates.parquet: `train/loss` (`update_loss`),
//! `train/grad_norm` (`update_grad_norm`), `train/reward` (`update_reward`), `train/steps`,
//! `train/kl`, `train/entropy`, `train/rollout_oracle_reward`, `train/rollout_learned_reward`,
//! `train/pairs`, `train/dropped_pairs`, and ppo's `train/critic_loss`,
//! `train/critic_grad_norm`, `train/value_mean`, `train/return_mean`.
//!
//! Wall time (never in the deterministic tables): `time/<stage>_s` per chunk from
//! policy_timings.parquet (`generation`, `phi`, `estimator`, `policy`, `critic`, `eval`,
//! `eval_generation`, `eval_phi`, `eval_score`), else per evaluation point from timings.parquet
//! (`estimator`, `other`; with `stream.ranks` > 1 live curves show head 0's estimator time, the
//! table every head's).
//!
//! Text: `completions`, per chunk of a run on generated responses, a markdown table of the first
//! [`COMPLETIONS`] prompts of the chunk with the policy's first response, its oracle reward and
//! its learned reward φᵀθ (as the chunk's labelling saw it).
//!
//! # Resume
//!
//! A resumed cell rewrites its directory: a new event file with the scalars of every row its
//! checkpoint holds (at their first wall times where the old files had them) and the texts of
//! the chunks it had completed, then the old files are removed, so no (tag, step) appears twice
//! however far past its checkpoint the killed process got. A cell that starts afresh removes
//! what an earlier process left.

use super::learner::Learner;
use super::state::Progress;
use crate::rows::{Bucket, CellResult, MetricRow, PolicyRow, PolicyTiming, UpdateRow};
use crate::tb::{event_files, read_events, Event, EventWriter};
use std::collections::HashMap;
use std::path::PathBuf;

/// Prompts per chunk in the `completions` text.
pub const COMPLETIONS: usize = 4;

/// What a cell has produced so far (its rows and timings).
pub(super) struct Snapshot<'a> {
    pub(super) rows: &'a [MetricRow],
    pub(super) buckets: &'a [Bucket],
    pub(super) policy: &'a [PolicyRow],
    pub(super) updates: &'a [UpdateRow],
    pub(super) times: &'a [PolicyTiming],
}

impl<'a> Snapshot<'a> {
    pub(super) fn of(l: &'a Learner, pr: &'a Progress) -> Self {
        Snapshot {
            rows: &pr.rows,
            buckets: &l.buckets,
            policy: &pr.policy.rows,
            updates: &pr.policy.updates,
            times: &pr.policy.times,
        }
    }

    fn of_result(out: &'a CellResult) -> Self {
        Snapshot {
            rows: &out.rows,
            buckets: &out.buckets,
            policy: &out.policy,
            updates: &out.policy_updates,
            times: &out.policy_times,
        }
    }
}

/// One sampled completion of a chunk, for the `completions` text.
pub(super) struct Completion<'a> {
    pub(super) prompt: &'a str,
    pub(super) completion: &'a str,
    pub(super) reward: f64,
    pub(super) learned: f64,
}

/// A cell's live TensorBoard writer (or nothing: [`Live::off`]).
pub struct Live {
    dir: Option<PathBuf>,
    w: Option<EventWriter>,
    /// Rows, buckets, policy rows, updates and timings written so far.
    done: [usize; 5],
    /// Wall times of a resumed cell's earlier events, by (tag, step).
    walls: HashMap<(String, i64), f64>,
}

/// The x-axis value of a metric row.
fn step_of(r: &MetricRow) -> i64 {
    r.chunk.unwrap_or(r.step) as i64
}

impl Live {
    /// Writes nothing.
    pub fn off() -> Self {
        Live { dir: None, w: None, done: [0; 5], walls: HashMap::new() }
    }

    /// Writes the cell's event files into `dir` (`<run>/tb/<cell_id>`).
    pub fn to(dir: PathBuf) -> Self {
        Live { dir: Some(dir), ..Live::off() }
    }

    /// A write failed: say so once and write nothing more (the run and its tables go on).
    fn fail(&mut self, e: impl std::fmt::Display) {
        if let Some(d) = self.dir.take() {
            eprintln!(
                "onepass: warning: {}: {e}; this cell's live curves stop here (its tables are not affected)",
                d.display()
            );
        }
        self.w = None;
    }

    /// The cell starts (`history` None) or resumes from a checkpoint holding `history`: a new
    /// event file with what the checkpoint holds, the old files removed.
    pub(super) fn start(&mut self, history: Option<Snapshot<'_>>) {
        let Some(dir) = self.dir.clone() else { return };
        let run = || -> std::io::Result<()> {
            let old = event_files(&dir)?;
            let mut texts: Vec<Event> = Vec::new();
            if let Some(h) = &history {
                // the last step the checkpoint covers: what came after it is written again
                let last = h.rows.iter().map(step_of).chain(h.policy.iter().map(|p| p.chunk as i64)).max();
                for f in &old {
                    // an unreadable old file (cut by a kill mid-write) gives what it has
                    for e in read_events(f).unwrap_or_default() {
                        for (tag, _) in e.scalars() {
                            self.walls.entry((tag.to_string(), e.step)).or_insert(e.wall_time);
                        }
                        let keep = e.texts().next().is_some() && last.is_some_and(|l| e.step <= l);
                        if keep && !texts.iter().any(|t| t.step == e.step && t.summary == e.summary) {
                            texts.push(e);
                        }
                    }
                }
            }
            self.w = Some(EventWriter::create(&dir)?);
            if let Some(h) = history {
                for t in &texts {
                    self.w.as_mut().expect("just made").write(t)?;
                }
                self.write_new(&h)?;
            }
            self.w.as_mut().expect("just made").flush()?;
            let made = self.w.as_ref().map(|w| w.path().to_path_buf());
            for f in old.iter().filter(|f| Some(*f) != made.as_ref()) {
                std::fs::remove_file(f)?;
            }
            self.walls.clear();
            Ok(())
        };
        if let Err(e) = run() {
            self.fail(e);
        }
    }

    /// Writes what `s` holds beyond what was written, and flushes when that was anything.
    pub(super) fn publish(&mut self, s: Snapshot<'_>) {
        if self.w.is_none() {
            return;
        }
        let before = self.done;
        let r = self.write_new(&s).and_then(|()| match (before != self.done, self.w.as_mut()) {
            (true, Some(w)) => w.flush(),
            _ => Ok(()),
        });
        if let Err(e) = r {
            self.fail(e);
        }
    }

    /// A chunk's sampled completions as a markdown table (tag `completions`).
    pub(super) fn completions(&mut self, chunk: u64, items: &[Completion<'_>]) {
        let Some(w) = self.w.as_mut() else { return };
        if items.is_empty() {
            return;
        }
        let cell = |s: &str| s.replace('|', "\\|").replace('\r', "").replace('\n', "<br>");
        let mut md = String::from("| prompt | completion | reward | learned reward |\n|---|---|---|---|\n");
        for c in items {
            md.push_str(&format!(
                "| {} | {} | {:.4} | {:.4} |\n",
                cell(c.prompt),
                cell(c.completion),
                c.reward,
                c.learned
            ));
        }
        if let Err(e) = w.text("completions", chunk as i64, &md, None).and_then(|()| w.flush()) {
            self.fail(e);
        }
    }

    /// The cell ended with `out`: what the loop did not publish (the final row's pessimistic
    /// SubOpt, a last bucket), then the file is closed.
    pub(super) fn finish(&mut self, out: &CellResult) {
        if self.w.is_none() {
            return;
        }
        self.publish(Snapshot::of_result(out));
        if let Some(last) = out.rows.last() {
            let step = step_of(last);
            let r = (|| -> std::io::Result<()> {
                let w = self.w.as_mut().expect("checked");
                if let Some(v) = last.subopt_pessimistic {
                    w.scalar("eval/subopt_pessimistic", step, v, None)?;
                }
                if let Some(v) = last.subopt_pessimistic_ref {
                    w.scalar("eval/subopt_pessimistic_ref", step, v, None)?;
                }
                w.flush()
            })();
            if let Err(e) = r {
                self.fail(e);
            }
        }
        self.w = None;
    }

    /// The scalars of every row `s` holds past those already written (`self.done`, per table),
    /// each at its first wall time where a replaced file had one; then `done` moves to the end.
    fn write_new(&mut self, s: &Snapshot<'_>) -> std::io::Result<()> {
        let Some(w) = self.w.as_mut() else { return Ok(()) };
        let walls = &self.walls;
        let mut put =
            |tag: &str, step: i64, v: f64| w.scalar(tag, step, v, walls.get(&(tag.to_string(), step)).copied());
        put_metric_rows(&mut put, s.rows.iter().skip(self.done[0]))?;
        // a bucket is the time up to its row: written with it, on the row's step
        let rows_now = s.rows.len();
        if s.times.is_empty() {
            for (i, b) in s.buckets.iter().enumerate().take(rows_now).skip(self.done[1]) {
                let t = s.rows.get(i).map_or(b.step as i64, step_of);
                put("time/estimator_s", t, b.estimator_s)?;
                put("time/other_s", t, b.other_s)?;
            }
        }
        put_policy_rows(&mut put, s.policy.iter().skip(self.done[2]))?;
        put_update_rows(&mut put, s.updates.iter().skip(self.done[3]))?;
        put_policy_times(&mut put, s.times.iter().skip(self.done[4]))?;
        self.done =
            [rows_now, s.buckets.len().min(rows_now).max(self.done[1]), s.policy.len(), s.updates.len(), s.times.len()];
        Ok(())
    }
}

/// A scalar writer: (tag, step, value).
type Put<'p> = dyn FnMut(&str, i64, f64) -> std::io::Result<()> + 'p;

/// metrics.parquet's rows as `eval/`, `reward/`, `theta/` and `deploy/` scalars on their
/// [`step_of`] (the optional columns where the row has them).
fn put_metric_rows<'r>(put: &mut Put<'_>, rows: impl Iterator<Item = &'r MetricRow>) -> std::io::Result<()> {
    for r in rows {
        let t = step_of(r);
        put("eval/loss", t, r.eval_loss)?;
        put("eval/accuracy", t, r.eval_accuracy)?;
        put("eval/ties", t, r.eval_ties as f64)?;
        put("reward/train_loss", t, r.train_loss)?;
        put("reward/train_accuracy", t, r.train_accuracy)?;
        put("reward/kappa", t, r.kappa)?;
        put("reward/samples_seen", t, r.samples_seen as f64)?;
        let opt = [
            ("theta/err", r.theta_err),
            ("theta/err_h", r.theta_err_h),
            ("eval/subopt", r.subopt),
            ("eval/subopt_avg", r.subopt_avg),
            ("deploy/regret", r.regret),
            ("deploy/mean_reward", r.mean_reward),
            ("deploy/pair_reward", r.pair_reward),
            ("deploy/cum_pair_reward", r.cum_pair_reward),
            ("deploy/policy_reward", r.policy_reward),
            ("deploy/kendall_tau", r.kendall_tau),
            ("deploy/oracle_ties", r.oracle_ties.map(|v| v as f64)),
        ];
        for (tag, v) in opt {
            if let Some(v) = v {
                put(tag, t, v)?;
            }
        }
    }
    Ok(())
}

/// policy.parquet's held-out evaluations as `policy/` scalars, per chunk.
fn put_policy_rows<'r>(put: &mut Put<'_>, rows: impl Iterator<Item = &'r PolicyRow>) -> std::io::Result<()> {
    for p in rows {
        let t = p.chunk as i64;
        put("policy/reward", t, p.policy_reward)?;
        put("policy/sample_reward", t, p.sample_reward)?;
        put("policy/bon_reward", t, p.bon_reward)?;
        put("policy/learned_reward", t, p.learned_reward)?;
        put("policy/kl", t, p.kl)?;
        if let Some(e) = p.entropy {
            put("policy/entropy", t, e)?;
        }
        put("policy/response_tokens", t, p.response_tokens)?;
        put("policy/cut_fraction", t, p.cut_fraction)?;
        put("policy/merge_error", t, p.merge_error)?;
    }
    Ok(())
}

/// policy_updates.parquet's rows as `train/` scalars, per chunk (ppo's critic where it has one).
fn put_update_rows<'r>(put: &mut Put<'_>, rows: impl Iterator<Item = &'r UpdateRow>) -> std::io::Result<()> {
    for u in rows {
        let t = u.chunk as i64;
        put("train/loss", t, u.update_loss)?;
        put("train/grad_norm", t, u.update_grad_norm)?;
        put("train/reward", t, u.update_reward)?;
        put("train/steps", t, u.update_steps as f64)?;
        put("train/kl", t, u.kl)?;
        put("train/entropy", t, u.entropy)?;
        put("train/rollout_oracle_reward", t, u.rollout_oracle_reward)?;
        put("train/rollout_learned_reward", t, u.rollout_learned_reward)?;
        put("train/pairs", t, u.pairs as f64)?;
        put("train/dropped_pairs", t, u.dropped_pairs as f64)?;
        let critic = [
            ("train/critic_loss", u.critic_loss),
            ("train/critic_grad_norm", u.critic_grad_norm),
            ("train/value_mean", u.value_mean),
            ("train/return_mean", u.return_mean),
        ];
        for (tag, v) in critic {
            if let Some(v) = v {
                put(tag, t, v)?;
            }
        }
    }
    Ok(())
}

/// policy_timings.parquet's rows as `time/<stage>_s` scalars, per chunk.
fn put_policy_times<'r>(put: &mut Put<'_>, rows: impl Iterator<Item = &'r PolicyTiming>) -> std::io::Result<()> {
    for x in rows {
        let t = x.chunk as i64;
        let stages = [
            ("time/generation_s", x.generation_s),
            ("time/phi_s", x.phi_s),
            ("time/estimator_s", x.estimator_s),
            ("time/policy_s", x.policy_s),
            ("time/critic_s", x.critic_s),
            ("time/eval_s", x.eval_s),
            ("time/eval_generation_s", x.eval_generation_s),
            ("time/eval_phi_s", x.eval_phi_s),
            ("time/eval_score_s", x.eval_score_s),
        ];
        for (tag, v) in stages {
            put(tag, t, v)?;
        }
    }
    Ok(())
}
