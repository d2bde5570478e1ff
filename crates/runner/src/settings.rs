//! The three settings of paper §5 on the synthetic bandit, each usable with any estimator:
//! passive (Alg. 2), active (Alg. 3) and deployment (Alg. 4). A cell is one estimator config ×
//! (deploy: one strategy) × one seed; it returns its metric rows, optional per-step rows and θ.

use crate::env::{argmax, dot, stream, two_arms, Component, Env};
use crate::pairs::PairData;
use crate::plan::{theory_beta, ConfigPlan, Plan};
use crate::spec::{ActiveRule, Beta, CurvaturePoint, Order, Pessimism, ScoreNorm, Setting, Spec};
use anyhow::{anyhow, Result};
use estimators::logistic::{accuracy_credit, log_loss};
use estimators::{Batch, Curvature, CurvatureKind, Estimator, HessianPoint, Setup};
use rand::seq::SliceRandom;
use rand::Rng;
use rand_chacha::ChaCha20Rng;
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::time::Instant;

use crate::checkpoint::CellSaver;

/// One row of metrics.parquet: a cell at an evaluation point. Deterministic: no wall clock.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MetricRow {
    pub step: u64,
    pub samples_seen: u64,
    /// Prequential (before each update), averaged since the previous evaluation point.
    pub train_loss: f64,
    pub train_accuracy: f64,
    pub eval_loss: f64,
    /// Held-out accuracy, a tie (zᵀθ = 0) counted as ½.
    pub eval_accuracy: f64,
    /// Held-out pairs with zᵀθ = 0 exactly (e.g. z = 0: both sides the same tokens).
    pub eval_ties: u64,
    /// ‖θ_t − θ*‖₂ and ‖θ_t − θ*‖_{𝓗_t} (None without a θ*: kind = "features").
    pub theta_err: Option<f64>,
    pub theta_err_h: Option<f64>,
    /// SubOpt of the greedy policy of the last iterate (None without a θ*).
    pub subopt: Option<f64>,
    /// Active: SubOpt of the greedy policy of the averaged iterate (1/t Σ θ_s).
    pub subopt_avg: Option<f64>,
    /// Passive, final row: SubOpt of the pessimistic policy.
    pub subopt_pessimistic: Option<f64>,
    /// Deploy: cumulative regret Σ r(x,π*) − ½(r(a)+r(a′)), and the mean of ½(r(a)+r(a′)).
    pub regret: Option<f64>,
    pub mean_reward: Option<f64>,
    /// Deploy on generated responses, per chunk: its index (1-based); the chunk's mean of
    /// r(a) + r(a′) (the authors' number) and its running sum over chunks; the mean oracle
    /// reward of the deployed policy's response (best-of-n under θ at the chunk's start, or the
    /// fixed first sample); the mean Kendall τ_b between learned and oracle rankings of the n
    /// samples; label ties of the argmax oracle so far.
    pub chunk: Option<u64>,
    pub pair_reward: Option<f64>,
    pub cum_pair_reward: Option<f64>,
    pub policy_reward: Option<f64>,
    pub kendall_tau: Option<f64>,
    pub oracle_ties: Option<u64>,
    /// max 1/σ'(zᵀθ_t) over the samples since the previous row (the paper's κ on the data seen).
    pub kappa: f64,
    /// Mean over those batches of the authors' 1/(min σ' + 1e-3).
    pub kappa_reference: f64,
    /// Ties broken by a seeded draw so far (selection rules).
    pub ties: u64,
    pub grad_evals: u64,
    pub hvp_evals: u64,
    pub flops: u64,
    /// Every re-fit so far reached its tolerance (mle; true otherwise).
    pub converged: bool,
}

/// One row of steps.parquet: the estimator's own report of one update.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepRow {
    pub step: u64,
    pub samples_seen: u64,
    pub report: estimators::StepReport,
}

/// Wall time between two evaluation points (timings.parquet; never in metrics.parquet).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Bucket {
    pub step: u64,
    pub samples_seen: u64,
    /// Inside `Estimator::update`.
    pub estimator_s: f64,
    /// Everything else: drawing data, selection, the curvature tracker, evaluation.
    pub other_s: f64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct CellResult {
    /// Timings per evaluation bucket.
    pub buckets: Vec<Bucket>,
    pub rows: Vec<MetricRow>,
    pub steps: Vec<StepRow>,
    pub theta: Vec<f64>,
    /// FNV-1a over the contexts, pairs and label noise the cell drew: equal for all cells of a
    /// seed whose data do not depend on the method (passive, and the noise of all settings).
    pub stream_hash: u64,
    /// Seconds inside `Estimator::update`, over the whole cell.
    pub estimator_s: f64,
    /// Deploy on generated responses: one row per prompt (rounds.parquet).
    pub rounds: Vec<RoundRow>,
}

/// One prompt of a chunked deployment run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RoundRow {
    pub chunk: u64,
    /// Index of the prompt in the prompt file (generations.parquet).
    pub prompt: u64,
    pub first: u32,
    pub second: u32,
    pub reward_first: f64,
    pub reward_second: f64,
    /// 1: the first response preferred.
    pub label: f32,
    pub policy_pick: u32,
    pub policy_reward: f64,
    /// max_a r(a) over the prompt's samples.
    pub best_reward: f64,
    pub kendall_tau: f64,
}

/// Kendall's τ_b between two score vectors (ties in either counted as τ_b does); 0 when either
/// is constant.
pub fn kendall_tau_b(a: &[f64], b: &[f64]) -> f64 {
    let (mut conc, mut disc, mut ta, mut tb) = (0i64, 0i64, 0i64, 0i64);
    for i in 0..a.len() {
        for j in i + 1..a.len() {
            let (x, y) = ((a[i] - a[j]).signum(), (b[i] - b[j]).signum());
            let (x, y) = (if a[i] == a[j] { 0.0 } else { x }, if b[i] == b[j] { 0.0 } else { y });
            match (x == 0.0, y == 0.0) {
                (true, true) => {}
                (true, false) => ta += 1,
                (false, true) => tb += 1,
                _ if x == y => conc += 1,
                _ => disc += 1,
            }
        }
    }
    let n = ((conc + disc + ta) as f64 * (conc + disc + tb) as f64).sqrt();
    if n == 0.0 {
        0.0
    } else {
        (conc - disc) as f64 / n
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Hasher(u64);

impl Hasher {
    fn new() -> Self {
        Hasher(0xcbf2_9ce4_8422_2325)
    }
    fn bytes(&mut self, b: &[u8]) {
        for &x in b {
            self.0 = (self.0 ^ u64::from(x)).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn f32s(&mut self, v: &[f32]) {
        for x in v {
            self.bytes(&x.to_le_bytes());
        }
    }
}

/// The estimator, its curvature tracker and the running window of training statistics.
/// Serialised whole into checkpoints (the estimator through its [`estimators::Snapshot`]).
#[derive(Serialize, Deserialize)]
pub struct Learner {
    #[serde(with = "estimator_state")]
    est: Box<dyn Estimator>,
    curv: Curvature,
    d: usize,
    steps: u64,
    samples: u64,
    /// `samples` before the latest update.
    prev_samples: u64,
    record_steps: bool,
    step_rows: Vec<StepRow>,
    theta: Vec<f64>,
    /// θ_{t+1}, filled by `theta_into` and swapped with `theta` (no allocation per step).
    next: Vec<f64>,
    theta_sum: Vec<f64>,
    iterates: u64,
    win_loss: f64,
    win_correct: f64,
    win_n: f64,
    win_kappa: f64,
    win_kref: f64,
    win_batches: f64,
    converged: bool,
    est_s: f64,
    /// Wall time of the current bucket restarts when a checkpoint is read back.
    #[serde(skip, default = "Instant::now")]
    bucket_start: Instant,
    bucket_est_s: f64,
    buckets: Vec<Bucket>,
}

mod estimator_state {
    use estimators::{Estimator, Snapshot};
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[allow(clippy::borrowed_box)] // the field's type, as serde's `with` hands it over
    pub fn serialize<S: Serializer>(e: &Box<dyn Estimator>, s: S) -> Result<S::Ok, S::Error> {
        e.snapshot().serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Box<dyn Estimator>, D::Error> {
        Ok(Snapshot::deserialize(d)?.into_estimator())
    }
}

/// Where a cell's loop stands: its random streams, the stream position, the rows and running
/// sums so far. With the learners, everything a checkpoint holds.
#[derive(Serialize, Deserialize)]
pub struct Progress {
    /// Loop units completed: updates (passive, active, deploy) or chunks (chunked deploy).
    done: u64,
    /// Training rows of the stream order consumed so far (pairs): an explicit index.
    position: u64,
    data: ChaCha20Rng,
    labels: ChaCha20Rng,
    select: ChaCha20Rng,
    hash: Hasher,
    rows: Vec<MetricRow>,
    rounds: Vec<RoundRow>,
    ties: u64,
    oracle_ties: u64,
    regret: f64,
    reward_sum: f64,
    cum_pair: f64,
    seen: u64,
    /// Active: pool rows already labelled, and the authors' V tracker.
    used: Vec<bool>,
    vtrack: Option<Curvature>,
}

impl Progress {
    /// The start of a cell: every stream at its origin.
    fn fresh(spec: &Spec, seed: u32) -> Progress {
        Progress {
            done: 0,
            position: 0,
            data: stream(spec.master_seed, seed, Component::Data),
            labels: stream(spec.master_seed, seed, Component::Labels),
            select: stream(spec.master_seed, seed, Component::Select),
            hash: Hasher::new(),
            rows: Vec::new(),
            rounds: Vec::new(),
            ties: 0,
            oracle_ties: 0,
            regret: 0.0,
            reward_sum: 0.0,
            cum_pair: 0.0,
            seen: 0,
            used: Vec::new(),
            vtrack: None,
        }
    }
}

/// A cell's checkpoint as written (borrowed) …
#[derive(Serialize)]
struct StateRef<'a> {
    learners: &'a [&'a Learner],
    progress: &'a Progress,
    wall_s: f64,
}

/// … and as read back.
#[derive(Deserialize)]
pub struct CellState {
    learners: Vec<Learner>,
    progress: Progress,
    wall_s: f64,
}

impl CellState {
    /// Wall seconds the cell had run when the checkpoint was written.
    pub fn wall_s(&self) -> f64 {
        self.wall_s
    }
}

/// What a cell needs besides the plan: where to checkpoint, and the state to resume from.
pub struct CellCtx {
    pub saver: CellSaver,
    pub resume: Option<CellState>,
}

impl CellCtx {
    /// No checkpoints, a fresh start.
    pub fn none() -> Self {
        CellCtx { saver: CellSaver::disabled(), resume: None }
    }

    /// After each loop unit: a checkpoint when one is due.
    fn tick(&mut self, learners: &[&Learner], progress: &Progress) -> Result<()> {
        if self.saver.due() {
            let wall_s = self.saver.wall_s();
            self.saver.save(&StateRef { learners, progress, wall_s })?;
        }
        Ok(())
    }
}

impl Learner {
    fn new(plan: &Plan, c: &ConfigPlan, seed: u32) -> Result<Learner> {
        let spec = &plan.spec;
        let d = spec.env.dim;
        let setup = Setup {
            dim: d,
            init: c.init,
            seed: crate::env::seed_of(spec.master_seed, seed, Component::Init),
            // per head: with R ranks each head makes 1/R of the updates
            planned_steps: Some(spec.stream.samples / (spec.stream.batch_size * spec.stream.ranks.max(1)) as u64),
        };
        let est = estimators::build(&c.cfg, &setup)?;
        let point = match spec.curvature.point {
            CurvaturePoint::LookAhead => HessianPoint::LookAhead,
            CurvaturePoint::Current => HessianPoint::Current,
        };
        let curv = Curvature::with_forward(CurvatureKind::Hessian { lambda: spec.curvature.lambda, point }, d);
        let theta = est.theta();
        Ok(Learner {
            est,
            curv,
            d,
            steps: 0,
            samples: 0,
            prev_samples: 0,
            record_steps: spec.stream.record_steps,
            step_rows: Vec::new(),
            theta_sum: theta.clone(),
            next: theta.clone(),
            theta,
            iterates: 1,
            win_loss: 0.0,
            win_correct: 0.0,
            win_n: 0.0,
            win_kappa: 0.0,
            win_kref: 0.0,
            win_batches: 0.0,
            converged: true,
            est_s: 0.0,
            bucket_start: Instant::now(),
            bucket_est_s: 0.0,
            buckets: Vec::new(),
        })
    }

    /// A fresh estimator, curvature tracker and θ (the authors' re-initialised head); the
    /// counters, the training window and the timings go on.
    fn reset_estimator(&mut self, plan: &Plan, c: &ConfigPlan, seed: u32) -> Result<()> {
        let fresh = Learner::new(plan, c, seed)?;
        self.est = fresh.est;
        self.curv = fresh.curv;
        self.theta = fresh.theta;
        self.next = fresh.next;
        self.theta_sum = fresh.theta_sum;
        self.iterates = fresh.iterates;
        Ok(())
    }

    fn update(&mut self, z: &[f32], y: &[f32]) -> Result<()> {
        let batch = Batch::new(z, y, self.d)?;
        let t0 = Instant::now();
        let rep = self.est.update(&batch)?;
        self.est_s += t0.elapsed().as_secs_f64();
        crate::checkpoint::failpoint("update");
        self.est.theta_into(&mut self.next);
        self.curv.observe(&batch, &self.theta, &self.next);
        std::mem::swap(&mut self.theta, &mut self.next);
        for (s, t) in self.theta_sum.iter_mut().zip(&self.theta) {
            *s += t;
        }
        self.iterates += 1;
        self.steps += 1;
        let n = batch.len() as f64;
        self.prev_samples = self.samples;
        self.samples += batch.len() as u64;
        self.win_loss += rep.before.loss * n;
        self.win_correct += rep.before.accuracy * n;
        self.win_n += n;
        self.win_kappa = self.win_kappa.max(rep.before.kappa);
        self.win_kref += rep.before.kappa_reference;
        self.win_batches += 1.0;
        self.converged &= rep.converged;
        if self.record_steps {
            self.step_rows.push(StepRow { step: self.steps, samples_seen: self.samples, report: rep });
        }
        Ok(())
    }

    fn averaged(&self) -> Vec<f64> {
        self.theta_sum.iter().map(|s| s / self.iterates as f64).collect()
    }

    /// A metric row at the current point; resets the training window.
    fn row(&mut self, world: &World<'_>) -> MetricRow {
        self.row_at(world.eval(), world.truth())
    }

    fn row_at(&mut self, (eval_z, eval_y): (&[f32], &[f32]), truth: Option<&Env>) -> MetricRow {
        let wall = self.bucket_start.elapsed().as_secs_f64();
        let est = self.est_s - self.bucket_est_s;
        self.buckets.push(Bucket {
            step: self.steps,
            samples_seen: self.samples,
            estimator_s: est,
            other_s: wall - est,
        });
        self.bucket_start = Instant::now();
        self.bucket_est_s = self.est_s;
        let (mut loss, mut right, mut ties) = (0.0, 0.0, 0u64);
        for (z, &y) in eval_z.chunks_exact(self.d).zip(eval_y) {
            let m = dot(z, &self.theta);
            loss += log_loss(m, f64::from(y));
            right += accuracy_credit(m, f64::from(y));
            ties += u64::from(m == 0.0);
        }
        let n = eval_y.len() as f64;
        let err: Option<Vec<f64>> = truth
            .filter(|env| !env.theta_star.is_empty())
            .map(|env| self.theta.iter().zip(&env.theta_star).map(|(a, b)| a - b).collect());
        let c = self.est.counters();
        let row = MetricRow {
            step: self.steps,
            samples_seen: self.samples,
            train_loss: self.win_loss / self.win_n.max(1.0),
            train_accuracy: self.win_correct / self.win_n.max(1.0),
            eval_loss: loss / n,
            eval_accuracy: right / n,
            eval_ties: ties,
            theta_err: err.as_ref().map(|e| e.iter().map(|v| v * v).sum::<f64>().sqrt()),
            theta_err_h: err.as_ref().map(|e| self.curv.norm(e).unwrap_or(f64::NAN)),
            subopt: truth.map(|env| env.subopt_of(&env.greedy(&self.theta))),
            kappa: self.win_kappa,
            kappa_reference: self.win_kref / self.win_batches.max(1.0),
            grad_evals: c.grad_evals,
            hvp_evals: c.hvp_evals,
            flops: c.flops,
            converged: self.converged,
            ..Default::default()
        };
        self.win_loss = 0.0;
        self.win_correct = 0.0;
        self.win_n = 0.0;
        self.win_kappa = 0.0;
        self.win_kref = 0.0;
        self.win_batches = 0.0;
        row
    }

    /// At the last step, and at every step whose batch crossed a multiple of `eval_every`
    /// samples (so `eval_every` need not be a multiple of the batch size).
    fn due(&self, eval_every: u64, last: bool) -> bool {
        last || self.samples / eval_every > self.prev_samples / eval_every
    }
}

/// Where a cell's pairs come from.
enum World<'a> {
    Synthetic(Env),
    Pairs(&'a PairData),
}

impl World<'_> {
    /// Held-out z rows and labels.
    fn eval(&self) -> (&[f32], &[f32]) {
        match self {
            World::Synthetic(env) => (&env.eval_z, &env.eval_y),
            World::Pairs(p) => (&p.eval.z, &p.eval.y),
        }
    }
    /// The environment with θ*, when there is one.
    fn truth(&self) -> Option<&Env> {
        match self {
            World::Synthetic(env) => Some(env),
            World::Pairs(_) => None,
        }
    }
}

/// Runs one cell without checkpoints.
pub fn run_cell(plan: &Plan, config: &ConfigPlan, seed: u32) -> Result<CellResult> {
    run_cell_with(plan, config, seed, &mut CellCtx::none())
}

/// Runs one cell, checkpointing through `ctx` and resuming from its state when it has one.
pub fn run_cell_with(plan: &Plan, config: &ConfigPlan, seed: u32, ctx: &mut CellCtx) -> Result<CellResult> {
    let spec = &plan.spec;
    let world = match (&plan.data, &plan.generated) {
        (Some(p), _) => World::Pairs(p),
        (None, Some(g)) => World::Synthetic(Env::from_bank(&g.bank, spec.env.eval_pairs, spec.master_seed, seed)),
        (None, None) => World::Synthetic(Env::new(&spec.env, spec.master_seed, seed)),
    };
    let (mut learners, resumed) = match ctx.resume.take() {
        Some(st) => {
            let heads = if spec.setting == Setting::Passive { spec.stream.ranks.max(1) } else { 1 };
            if st.learners.len() != heads || st.learners.iter().any(|l| l.d != spec.env.dim || l.est.dim() != l.d) {
                return Err(anyhow!(
                    "the checkpoint holds {} head(s) of dimension {:?}: expected {heads} of dimension {}",
                    st.learners.len(),
                    st.learners.iter().map(|l| l.d).collect::<Vec<_>>(),
                    spec.env.dim
                ));
            }
            ctx.saver.wall_before = st.wall_s;
            (st.learners, Some(st.progress))
        }
        None => (vec![Learner::new(plan, config, seed)?], None),
    };
    let mut learner = learners.remove(0);
    let mut out = match (spec.setting, &world) {
        (Setting::Passive, World::Pairs(_)) if spec.stream.ranks > 1 => {
            passive_ranks(plan, config, &world, &mut learner, learners, seed, ctx, resumed)?
        }
        (Setting::Passive, _) => passive(plan, &world, &mut learner, seed, ctx, resumed)?,
        (Setting::Active, _) => active(plan, config, &world, &mut learner, seed, ctx, resumed)?,
        (Setting::Deploy, World::Synthetic(env)) if plan.generated.is_some() => {
            deploy_chunked(plan, config, env, &mut learner, seed, ctx, resumed)?
        }
        (Setting::Deploy, World::Synthetic(env)) => deploy(plan, config, env, &mut learner, seed, ctx, resumed)?,
        (Setting::Deploy, World::Pairs(_)) => return Err(anyhow!("deploy needs the synthetic environment")),
    };
    out.theta = learner.theta.clone();
    out.steps = std::mem::take(&mut learner.step_rows);
    out.estimator_s = learner.est_s;
    out.buckets = std::mem::take(&mut learner.buckets);
    Ok(out)
}

/// The training rows of a features file in stream order.
fn file_order(spec: &Spec, p: &PairData, data: &mut rand_chacha::ChaCha20Rng) -> Vec<usize> {
    if let Some(o) = &p.order {
        return o.clone();
    }
    let mut order: Vec<usize> = (0..p.train.len()).collect();
    if spec.env.order == Order::Shuffled {
        order.shuffle(data);
    }
    order
}

/// The mean over heads of one evaluation point (counters summed, κ and ties the largest).
fn mean_rows(rows: &[MetricRow]) -> MetricRow {
    let n = rows.len() as f64;
    let mean = |f: fn(&MetricRow) -> f64| rows.iter().map(f).sum::<f64>() / n;
    let sum = |f: fn(&MetricRow) -> u64| rows.iter().map(f).sum::<u64>();
    MetricRow {
        step: rows[0].step,
        samples_seen: sum(|r| r.samples_seen),
        train_loss: mean(|r| r.train_loss),
        train_accuracy: mean(|r| r.train_accuracy),
        eval_loss: mean(|r| r.eval_loss),
        eval_accuracy: mean(|r| r.eval_accuracy),
        eval_ties: rows.iter().map(|r| r.eval_ties).max().unwrap_or(0),
        kappa: rows.iter().map(|r| r.kappa).fold(0.0, f64::max),
        kappa_reference: mean(|r| r.kappa_reference),
        grad_evals: sum(|r| r.grad_evals),
        hvp_evals: sum(|r| r.hvp_evals),
        flops: sum(|r| r.flops),
        converged: rows.iter().all(|r| r.converged),
        ..Default::default()
    }
}

/// Passive with `stream.ranks` = R independent heads (the authors' un-synchronised OMD ranks):
/// head r reads rows r, r+R, … of the stream; a metric row is the mean over heads.
#[allow(clippy::too_many_arguments)]
fn passive_ranks(
    plan: &Plan,
    config: &ConfigPlan,
    world: &World<'_>,
    l0: &mut Learner,
    resumed_others: Vec<Learner>,
    seed: u32,
    ctx: &mut CellCtx,
    resumed: Option<Progress>,
) -> Result<CellResult> {
    let spec = &plan.spec;
    let World::Pairs(p) = world else { return Err(anyhow!("stream.ranks > 1 needs pairs")) };
    let (b, r) = (spec.stream.batch_size, spec.stream.ranks);
    let steps = spec.stream.samples / (b * r) as u64;
    let mut fresh = Progress::fresh(spec, seed);
    let order = file_order(spec, p, &mut fresh.data);
    let shards: Vec<Vec<usize>> = (0..r).map(|k| order.iter().skip(k).step_by(r).copied().collect()).collect();
    // every head starts from the same θ (DeepSpeed broadcasts rank 0's initial weights)
    let mut others: Vec<Learner> = match resumed {
        Some(_) => resumed_others,
        None => (1..r).map(|_| Learner::new(plan, config, seed)).collect::<Result<_>>()?,
    };
    let mut pr = resumed.unwrap_or(fresh);
    let (mut z, mut y) = (Vec::with_capacity(b * spec.env.dim), Vec::with_capacity(b));
    let per_step = (b * r) as u64;
    for s in pr.done + 1..=steps {
        for k in 0..r {
            z.clear();
            y.clear();
            // the position counts rows per head: head k's next rows are shards[k][position..]
            let at = pr.position as usize;
            let rows_k = shards[k].get(at..at + b).ok_or_else(|| anyhow!("rank {k}: the stream ran out of rows"))?;
            for &i in rows_k {
                z.extend_from_slice(p.train.row(i));
                y.push(p.train.y[i]);
            }
            pr.hash.f32s(&z);
            pr.hash.f32s(&y);
            let learner = if k == 0 { &mut *l0 } else { &mut others[k - 1] };
            learner.update(&z, &y)?;
        }
        pr.position += b as u64;
        let (now, before) = (s * per_step, (s - 1) * per_step);
        if s == steps || now / spec.stream.eval_every > before / spec.stream.eval_every {
            let mut each = vec![l0.row(world)];
            each.extend(others.iter_mut().map(|o| o.row(world)));
            pr.rows.push(mean_rows(&each));
        }
        pr.done = s;
        let all: Vec<&Learner> = std::iter::once(&*l0).chain(others.iter()).collect();
        ctx.tick(&all, &pr)?;
    }
    let (rows, h) = (pr.rows, pr.hash);
    // rank 0's buckets carry every head's estimator time
    for o in &others {
        for (b0, bo) in l0.buckets.iter_mut().zip(&o.buckets) {
            b0.estimator_s += bo.estimator_s;
            b0.other_s -= bo.estimator_s;
            b0.samples_seen = b0.step * per_step;
        }
        l0.est_s += o.est_s;
    }
    Ok(CellResult { rows, stream_hash: h.0, ..Default::default() })
}

fn passive(
    plan: &Plan,
    world: &World<'_>,
    l: &mut Learner,
    seed: u32,
    ctx: &mut CellCtx,
    resumed: Option<Progress>,
) -> Result<CellResult> {
    let spec = &plan.spec;
    let (b, d) = (spec.stream.batch_size, spec.env.dim);
    let steps = spec.stream.samples / b as u64;
    let mut fresh = Progress::fresh(spec, seed);
    let order = match world {
        World::Pairs(p) => file_order(spec, p, &mut fresh.data),
        World::Synthetic(_) => Vec::new(),
    };
    let mut pr = resumed.unwrap_or(fresh);
    let (mut z, mut y) = (Vec::with_capacity(b * d), Vec::with_capacity(b));
    for s in pr.done + 1..=steps {
        z.clear();
        y.clear();
        for _ in 0..b {
            match world {
                World::Synthetic(env) => {
                    let c = env.draw_context(&mut pr.data);
                    let (a1, a2) = two_arms(&mut pr.data, env.k);
                    let zi = env.diff(&c, a1, a2);
                    y.push(env.label(&c, a1, a2, &zi, pr.labels.random()));
                    z.extend(zi);
                }
                World::Pairs(p) => {
                    let i =
                        *order.get(pr.position as usize).ok_or_else(|| anyhow!("the features file ran out of rows"))?;
                    pr.position += 1;
                    z.extend_from_slice(p.train.row(i));
                    y.push(p.train.y[i]);
                }
            }
        }
        pr.hash.f32s(&z);
        pr.hash.f32s(&y);
        l.update(&z, &y)?;
        if l.due(spec.stream.eval_every, s == steps) {
            pr.rows.push(l.row(world));
        }
        pr.done = s;
        ctx.tick(&[&*l], &pr)?;
    }
    let (mut rows, h) = (pr.rows, pr.hash);
    let Some(env) = world.truth() else {
        return Ok(CellResult { rows, stream_hash: h.0, ..Default::default() });
    };
    let beta = match spec.passive.beta {
        Beta::Theory => theory_beta(d, spec.stream.samples, spec.passive.delta),
        Beta::Value(v) => v,
    };
    let pess = pessimistic(env, &l.theta, &l.curv, beta, spec.passive.pessimism);
    if let Some(last) = rows.last_mut() {
        last.subopt_pessimistic = Some(env.subopt_of(&pess));
    }
    Ok(CellResult { rows, stream_hash: h.0, ..Default::default() })
}

/// The pessimistic policy of Alg. 2 with width β over the contexts.
pub fn pessimistic(env: &Env, theta: &[f64], curv: &Curvature, beta: f64, how: Pessimism) -> Vec<usize> {
    let k = env.k;
    let phi64 =
        |c: usize, a: usize| -> Vec<f64> { env.arm(&env.contexts[c], a).iter().map(|&v| f64::from(v)).collect() };
    match how {
        Pessimism::PerContext => (0..env.contexts.len())
            .map(|c| {
                argmax(
                    (0..k).map(|a| dot(env.arm(&env.contexts[c], a), theta) - beta * curv.inv_norm_f64(&phi64(c, a))),
                )
            })
            .collect(),
        Pessimism::Policy => {
            // Eq. (5): J(π) = mᵀθ − β‖m‖_{𝓗⁻¹}, m = mean_x φ(x, π(x)); exhaustive when the
            // policy class is small, else coordinate ascent from the greedy policy
            let n = env.contexts.len();
            let objective = |m: &[f64]| -> f64 {
                m.iter().zip(theta).map(|(a, b)| a * b).sum::<f64>() - beta * curv.inv_norm_f64(m)
            };
            let mean = |choice: &[usize]| -> Vec<f64> {
                let mut m = vec![0.0; env.d];
                for (c, &a) in choice.iter().enumerate() {
                    for (mi, v) in m.iter_mut().zip(phi64(c, a)) {
                        *mi += v / n as f64;
                    }
                }
                m
            };
            if (k as f64).powi(n as i32) <= 1e5 {
                let mut best = (f64::NEG_INFINITY, vec![0; n]);
                let mut choice = vec![0usize; n];
                loop {
                    let v = objective(&mean(&choice));
                    if v > best.0 {
                        best = (v, choice.clone());
                    }
                    // next policy in lexicographic order
                    let mut i = 0;
                    while i < n && choice[i] + 1 == k {
                        choice[i] = 0;
                        i += 1;
                    }
                    if i == n {
                        break;
                    }
                    choice[i] += 1;
                }
                best.1
            } else {
                let mut choice = env.greedy(theta);
                let mut m = mean(&choice);
                let mut current = objective(&m);
                loop {
                    let mut improved = false;
                    #[allow(clippy::needless_range_loop)] // c indexes contexts and `choice`
                    for c in 0..n {
                        for a in 0..k {
                            if a == choice[c] {
                                continue;
                            }
                            let (old, new) = (phi64(c, choice[c]), phi64(c, a));
                            let trial: Vec<f64> = m
                                .iter()
                                .zip(old.iter().zip(&new))
                                .map(|(mi, (o, w))| mi + (w - o) / n as f64)
                                .collect();
                            let v = objective(&trial);
                            if v > current + 1e-12 {
                                current = v;
                                m = trial;
                                choice[c] = a;
                                improved = true;
                            }
                        }
                    }
                    if !improved {
                        break choice;
                    }
                }
            }
        }
    }
}

fn active(
    plan: &Plan,
    config: &ConfigPlan,
    world: &World<'_>,
    l: &mut Learner,
    seed: u32,
    ctx: &mut CellCtx,
    resumed: Option<Progress>,
) -> Result<CellResult> {
    let spec = &plan.spec;
    let a = &spec.active;
    let (b, d) = (spec.stream.batch_size, spec.env.dim);
    let steps = spec.stream.samples / b as u64;
    let mut fresh = Progress::fresh(spec, seed);
    // the pool: pairs drawn once, each with its label drawn once (a re-queried pair keeps it)
    let (pool_z, pool_y): (Cow<'_, [f32]>, Cow<'_, [f32]>) = match world {
        World::Synthetic(env) => {
            let (mut pool_z, mut pool_y) = (Vec::with_capacity(a.pool * d), Vec::with_capacity(a.pool));
            for _ in 0..a.pool {
                let c = env.draw_context(&mut fresh.data);
                let (a1, a2) = two_arms(&mut fresh.data, env.k);
                let z = env.diff(&c, a1, a2);
                pool_y.push(env.label(&c, a1, a2, &z, fresh.labels.random()));
                pool_z.extend(z);
            }
            (pool_z.into(), pool_y.into())
        }
        // the pool is every training row; its labels are the file's
        World::Pairs(p) => (Cow::Borrowed(&p.train.z[..]), Cow::Borrowed(&p.train.y[..])),
    };
    let pool = pool_y.len();
    fresh.hash.f32s(&pool_z);
    fresh.hash.f32s(&pool_y);
    fresh.used = vec![false; pool];
    fresh.vtrack = Some(Curvature::new(CurvatureKind::Gram { v0: a.v0 }, d));
    let row_of = |i: usize| &pool_z[i * d..(i + 1) * d];
    let mut pr = resumed.unwrap_or(fresh);
    if pr.used.len() != pool {
        return Err(anyhow!("the checkpoint's pool has {} pairs: expected {pool}", pr.used.len()));
    }
    let (mut z, mut y) = (Vec::with_capacity(b * d), Vec::with_capacity(b));
    let rule = config.rule.unwrap_or(a.rule.0[0]);
    for s in pr.done + 1..=steps {
        let Progress { data, labels, select, used, vtrack, ties, .. } = &mut pr;
        if rule == ActiveRule::BestWorst {
            // paper §5 (practical rule): a fresh prompt, its n responses ranked by the current θ,
            // the best and the worst sent to the oracle
            let World::Synthetic(env) = world else {
                return Err(anyhow!("active.rule best-worst needs responses to rank (a synthetic or generated env)"));
            };
            z.clear();
            y.clear();
            for _ in 0..b {
                let c = env.draw_context(data);
                let est: Vec<f64> = (0..env.k).map(|x| dot(env.arm(&c, x), &l.theta)).collect();
                let pair = selection::select_pair(&selection::Strategy::BestWorst, &est, None, select);
                *ties += u64::from(pair.ties);
                let zi = env.diff(&c, pair.first, pair.second);
                y.push(env.label(&c, pair.first, pair.second, &zi, labels.random()));
                z.extend(zi);
            }
        } else {
            let vtrack = vtrack.as_mut().ok_or_else(|| anyhow!("the checkpoint has no V tracker"))?;
            let avail: Vec<usize> = (0..pool).filter(|&i| a.replacement || !used[i]).collect();
            if avail.len() < b {
                return Err(anyhow!("active: the pool ran out after {} steps", s - 1));
            }
            let chosen: Vec<usize> = match rule {
                ActiveRule::PoolArgmax => {
                    let scores: Vec<f64> = avail.iter().map(|&i| l.curv.inv_norm(row_of(i))).collect();
                    let (top, t) = selection::top_k(&scores, b, select);
                    *ties += u64::from(t);
                    top.iter().map(|&j| avail[j]).collect()
                }
                ActiveRule::Random => rand::seq::index::sample(data, avail.len(), b).iter().map(|j| avail[j]).collect(),
                ActiveRule::BestWorst => unreachable!("handled above"),
                ActiveRule::Stream => {
                    let m = a.candidates.min(avail.len());
                    let cand: Vec<usize> =
                        rand::seq::index::sample(data, avail.len(), m).iter().map(|j| avail[j]).collect();
                    let scores: Vec<f64> = match a.score_norm {
                        ScoreNorm::V => {
                            // the authors add every candidate to V before scoring
                            for &i in &cand {
                                vtrack.add(row_of(i), 1.0);
                            }
                            cand.iter().map(|&i| vtrack.inv_norm(row_of(i))).collect()
                        }
                        ScoreNorm::H => cand.iter().map(|&i| l.curv.inv_norm(row_of(i))).collect(),
                    };
                    let (top, t) = selection::top_k(&scores, a.keep, select);
                    *ties += u64::from(t);
                    top.iter().map(|&j| cand[j]).collect()
                }
            };
            z.clear();
            y.clear();
            for &i in &chosen {
                used[i] = true;
                z.extend_from_slice(row_of(i));
                y.push(pool_y[i]);
            }
        }
        l.update(&z, &y)?;
        if l.due(spec.stream.eval_every, s == steps) {
            let mut row = l.row(world);
            row.subopt_avg = world.truth().map(|env| env.subopt_of(&env.greedy(&l.averaged())));
            row.ties = *ties;
            pr.rows.push(row);
        }
        pr.done = s;
        ctx.tick(&[&*l], &pr)?;
    }
    Ok(CellResult { rows: pr.rows, stream_hash: pr.hash.0, ..Default::default() })
}

fn deploy(
    plan: &Plan,
    config: &ConfigPlan,
    env: &Env,
    l: &mut Learner,
    seed: u32,
    ctx: &mut CellCtx,
    resumed: Option<Progress>,
) -> Result<CellResult> {
    let spec = &plan.spec;
    let strategy = config.strategy.ok_or_else(|| anyhow!("deploy cell without a strategy"))?;
    let (b, d, k) = (spec.stream.batch_size, env.d, env.k);
    let steps = spec.stream.samples / b as u64;
    let mut pr = resumed.unwrap_or_else(|| Progress::fresh(spec, seed));
    let (mut z, mut y) = (Vec::with_capacity(b * d), Vec::with_capacity(b));
    for s in pr.done + 1..=steps {
        z.clear();
        y.clear();
        let Progress { data, labels, select, hash: h, regret, reward_sum, ties, seen: rounds, .. } = &mut pr;
        for _ in 0..b {
            let c = env.draw_context(data);
            let u: f64 = labels.random();
            h.f32s(&c.phi);
            h.bytes(&u.to_le_bytes());
            let est: Vec<f64> = (0..k).map(|a| dot(env.arm(&c, a), &l.theta)).collect();
            let bonus: Option<Vec<f64>> = strategy.needs_bonus().then(|| {
                let first = selection::first_arm(&est, &*select);
                (0..k).map(|a| l.curv.inv_norm(&env.diff(&c, a, first))).collect()
            });
            let pair = selection::select_pair(&strategy, &est, bonus.as_deref(), select);
            *ties += u64::from(pair.ties);
            let zi = env.diff(&c, pair.first, pair.second);
            y.push(env.label(&c, pair.first, pair.second, &zi, u));
            z.extend(zi);
            let best = (0..k).map(|a| env.reward(&c, a)).fold(f64::NEG_INFINITY, f64::max);
            let got = 0.5 * (env.reward(&c, pair.first) + env.reward(&c, pair.second));
            *regret += best - got;
            *reward_sum += got;
            *rounds += 1;
        }
        l.update(&z, &y)?;
        if l.due(spec.stream.eval_every, s == steps) {
            let mut row = l.row_at((&env.eval_z, &env.eval_y), Some(env));
            row.regret = Some(pr.regret);
            row.mean_reward = Some(pr.reward_sum / pr.seen as f64);
            row.ties = pr.ties;
            pr.rows.push(row);
        }
        pr.done = s;
        ctx.tick(&[&*l], &pr)?;
    }
    Ok(CellResult { rows: pr.rows, stream_hash: pr.hash.0, ..Default::default() })
}

/// Deployment on generated responses (paper Alg. 4 in the authors' chunked form): the prompts,
/// in a per-seed order, are cut into chunks; within a chunk θ is fixed — it ranks every
/// prompt's n responses, the strategy picks a pair, the oracle labels it — then the estimator
/// updates on the chunk's pairs in mini-batches of `stream.batch_size`.
fn deploy_chunked(
    plan: &Plan,
    config: &ConfigPlan,
    env: &Env,
    l: &mut Learner,
    seed: u32,
    ctx: &mut CellCtx,
    resumed: Option<Progress>,
) -> Result<CellResult> {
    let spec = &plan.spec;
    let strategy = config.strategy.ok_or_else(|| anyhow!("deploy cell without a strategy"))?;
    let (k, b) = (env.k, spec.stream.batch_size);
    let mut fresh = Progress::fresh(spec, seed);
    let p = env.contexts.len();
    let mut order: Vec<usize> = (0..p).collect();
    if spec.deploy.prompt_order == Order::Shuffled {
        order.shuffle(&mut fresh.data);
    }
    let chunks = spec.deploy.chunks.max(1);
    let mut pr = resumed.unwrap_or(fresh);
    for c in pr.done as usize..chunks {
        // chunk c holds prompts [c·p/chunks, (c+1)·p/chunks) of the order
        let (lo, hi) = (c * p / chunks, (c + 1) * p / chunks);
        if c > 0 && spec.deploy.reset_each_chunk {
            l.reset_estimator(plan, config, seed)?;
        }
        let (mut z, mut y) = (Vec::new(), Vec::new());
        let Progress { labels, select, hash: h, regret, reward_sum, ties, oracle_ties, rounds, .. } = &mut pr;
        let (mut pair_sum, mut pol_sum, mut tau_sum) = (0.0, 0.0, 0.0);
        for &x in &order[lo..hi] {
            let ctx = &env.contexts[x];
            let est: Vec<f64> = (0..k).map(|a| dot(env.arm(ctx, a), &l.theta)).collect();
            let truth: Vec<f64> = (0..k).map(|a| env.reward(ctx, a)).collect();
            let bonus: Option<Vec<f64>> = strategy.needs_bonus().then(|| {
                let first = selection::first_arm(&est, &*select);
                (0..k).map(|a| l.curv.inv_norm(&env.diff(ctx, a, first))).collect()
            });
            let pair = selection::select_pair(&strategy, &est, bonus.as_deref(), select);
            *ties += u64::from(pair.ties);
            let zi = env.diff(ctx, pair.first, pair.second);
            let u: f64 = labels.random();
            h.bytes(&(x as u64).to_le_bytes());
            h.bytes(&u.to_le_bytes());
            let label = env.label(ctx, pair.first, pair.second, &zi, u);
            *oracle_ties += u64::from(truth[pair.first] == truth[pair.second]);
            y.push(label);
            z.extend(zi);
            let best = truth.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let (ra, rb) = (truth[pair.first], truth[pair.second]);
            *regret += best - 0.5 * (ra + rb);
            *reward_sum += 0.5 * (ra + rb);
            pair_sum += ra + rb;
            let pick = match spec.deploy.policy {
                crate::spec::DeployPolicy::BestOfN => argmax(est.iter().copied()),
                crate::spec::DeployPolicy::Fixed => 0,
            };
            pol_sum += truth[pick];
            let tau = kendall_tau_b(&est, &truth);
            tau_sum += tau;
            rounds.push(RoundRow {
                chunk: c as u64 + 1,
                prompt: x as u64,
                first: pair.first as u32,
                second: pair.second as u32,
                reward_first: ra,
                reward_second: rb,
                label,
                policy_pick: pick as u32,
                policy_reward: truth[pick],
                best_reward: best,
                kendall_tau: tau,
            });
        }
        for (zb, yb) in z.chunks(b * env.d).zip(y.chunks(b)) {
            l.update(zb, yb)?;
        }
        pr.seen += (hi - lo) as u64;
        let n = (hi - lo) as f64;
        pr.cum_pair += pair_sum / n;
        let mut row = l.row_at((&env.eval_z, &env.eval_y), Some(env));
        row.regret = Some(pr.regret);
        row.mean_reward = Some(pr.reward_sum / pr.seen as f64);
        row.ties = pr.ties;
        row.chunk = Some(c as u64 + 1);
        row.pair_reward = Some(pair_sum / n);
        row.cum_pair_reward = Some(pr.cum_pair);
        row.policy_reward = Some(pol_sum / n);
        row.kendall_tau = Some(tau_sum / n);
        row.oracle_ties = Some(pr.oracle_ties);
        pr.rows.push(row);
        pr.done = c as u64 + 1;
        ctx.tick(&[&*l], &pr)?;
    }
    Ok(CellResult { rows: pr.rows, rounds: pr.rounds, stream_hash: pr.hash.0, ..Default::default() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::EnvSpec;

    fn objective(env: &Env, theta: &[f64], curv: &Curvature, beta: f64, choice: &[usize]) -> f64 {
        let n = env.contexts.len() as f64;
        let mut m = vec![0.0; env.d];
        for (c, &a) in choice.iter().enumerate() {
            for (mi, &v) in m.iter_mut().zip(env.arm(&env.contexts[c], a)) {
                *mi += f64::from(v) / n;
            }
        }
        m.iter().zip(theta).map(|(a, b)| a * b).sum::<f64>() - beta * curv.inv_norm_f64(&m)
    }

    #[test]
    fn pessimistic_policies() {
        for contexts in [5, 12] {
            // 3^5 policies are enumerated; 3^12 > 1e5 use coordinate ascent
            let spec = EnvSpec { dim: 4, contexts, arms: 3, eval_pairs: 10, ..Default::default() };
            let env = Env::new(&spec, 7, 0);
            let mut curv = Curvature::new(CurvatureKind::Hessian { lambda: 1.0, point: HessianPoint::LookAhead }, 4);
            curv.add(&env.contexts[0].phi[..4], 3.0);
            let theta: Vec<f64> = env.theta_star.iter().map(|v| 0.7 * v + 0.1).collect();
            let greedy = env.greedy(&theta);
            assert_eq!(pessimistic(&env, &theta, &curv, 0.0, Pessimism::PerContext), greedy);
            let p0 = pessimistic(&env, &theta, &curv, 0.0, Pessimism::Policy);
            assert!(
                (objective(&env, &theta, &curv, 0.0, &p0) - objective(&env, &theta, &curv, 0.0, &greedy)).abs() < 1e-12
            );
            let p = pessimistic(&env, &theta, &curv, 2.0, Pessimism::Policy);
            let v = objective(&env, &theta, &curv, 2.0, &p);
            assert!(v >= objective(&env, &theta, &curv, 2.0, &greedy) - 1e-12, "never worse than its start");
            if contexts == 5 {
                // exhaustive: no single-context change improves Eq. (5)
                for c in 0..contexts {
                    for a in 0..3 {
                        let mut q = p.clone();
                        q[c] = a;
                        assert!(objective(&env, &theta, &curv, 2.0, &q) <= v + 1e-12);
                    }
                }
            }
        }
    }

    /// τ_b = (n_c − n_d) / √((n₀ − n₁)(n₀ − n₂)) with n₁, n₂ counted from the tie groups.
    #[test]
    fn kendall_tau_b_matches_the_tie_group_formula() {
        let groups = |v: &[f64]| -> f64 {
            let mut s = v.to_vec();
            s.sort_by(f64::total_cmp);
            let mut t = 0.0;
            let mut i = 0;
            while i < s.len() {
                let j = (i..s.len()).find(|&j| s[j] != s[i]).unwrap_or(s.len());
                let k = (j - i) as f64;
                t += k * (k - 1.0) / 2.0;
                i = j;
            }
            t
        };
        let mut rng = rand_chacha::ChaCha20Rng::seed_from_u64(5);
        use rand::SeedableRng;
        for _ in 0..200 {
            let n = rng.random_range(2..9);
            let a: Vec<f64> = (0..n).map(|_| f64::from(rng.random_range(0..4u8))).collect();
            let b: Vec<f64> = (0..n).map(|_| f64::from(rng.random_range(0..4u8))).collect();
            let (mut nc, mut nd) = (0.0, 0.0);
            for i in 0..n {
                for j in 0..i {
                    let p = (a[i] - a[j]) * (b[i] - b[j]);
                    if p > 0.0 {
                        nc += 1.0
                    } else if p < 0.0 {
                        nd += 1.0
                    }
                }
            }
            let n0 = (n * (n - 1) / 2) as f64;
            let den = ((n0 - groups(&a)) * (n0 - groups(&b))).sqrt();
            let want = if den == 0.0 { 0.0 } else { (nc - nd) / den };
            assert!((kendall_tau_b(&a, &b) - want).abs() < 1e-12, "{a:?} {b:?}");
        }
        let a = [0.3, -1.0, 2.0, 0.5];
        assert_eq!(kendall_tau_b(&a, &a), 1.0);
        assert_eq!(kendall_tau_b(&a, &a.map(|x| -x)), -1.0);
    }
}
