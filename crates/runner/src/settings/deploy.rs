//! Deployment-time adaptation (paper Alg. 4): each round the deployed reward ranks a context's
//! arms, a strategy picks the pair to label, the learner updates — per round on the synthetic
//! bandit, per chunk of prompts on generated responses (the authors' form).

use super::arms::Labelled;
use super::checkpoint::{drive, CellCtx};
use super::choose;
use super::deploy_rm::LearnedRm;
use super::learner::Learner;
use super::live::{Completion, Live, Snapshot, COMPLETIONS};
use super::online::{ChunkIn, PolicyCell};
use super::state::{DeployProgress, Progress};
use crate::plan::{chunk_range, CellConfig, ConfigPlan};
use crate::rows::{CellResult, MetricRow, PolicyTiming, RoundRow};
use crate::spec::Order;
use crate::world::env::{dot, Context, Env};
use crate::world::generated::Generated;
use crate::world::online::Online;
use crate::world::reward::RewardBase;
use anyhow::{anyhow, Result};
use features::generate::Sample;
use rand::seq::SliceRandom;
use rand::Rng;
use selection::{kendall_tau_b, Strategy};
use std::time::Instant;

/// What [`deploy_chunked`] deploys on: the prompts' environment, the generated bank and, when
/// the run has them, the learning policy and the reward model whose features learn.
#[derive(Clone, Copy)]
pub(super) struct ChunkedWorld<'a> {
    /// The prompts, their responses' φ and oracle rewards.
    pub(super) env: &'a Env,
    /// The generated bank (prompts, samples) behind `env`.
    pub(super) g: &'a Generated,
    /// The run's learning policy (`world.online`).
    pub(super) online: Option<&'a Online>,
    /// The reward model whose features learn (`world.reward`).
    pub(super) reward: Option<&'a RewardBase>,
}

/// The cell's strategy, its parameters resolved by the plan ([`ConfigPlan::for_cells`]).
fn strategy_of(config: &ConfigPlan) -> Result<Strategy> {
    config.strategy.ok_or_else(|| anyhow!("deploy cell without a strategy"))
}

pub(super) fn deploy(
    cell: &CellConfig,
    env: &Env,
    l: &mut Learner,
    seed: u32,
    ctx: &mut CellCtx,
    resumed: Option<Progress>,
) -> Result<CellResult> {
    let strategy = strategy_of(&cell.config)?;
    let (b, d, k) = (cell.stream.batch_size, env.d, env.k);
    let steps = cell.stream.samples / b as u64;
    let mut pr = resumed.unwrap_or_else(|| Progress::fresh(cell.master_seed, seed));
    let (mut z, mut y) = (Vec::with_capacity(b * d), Vec::with_capacity(b));
    drive(steps, &mut pr, l, ctx, |_, last, pr, l| {
        z.clear();
        y.clear();
        let Progress { data, labels, select, hash: h, ties, deploy, flips, .. } = &mut *pr;
        let DeployProgress { regret, reward_sum, seen: rounds, .. } = deploy;
        for _ in 0..b {
            let c = env.draw_context(data);
            let u: f64 = labels.random();
            h.f32s(&c.phi);
            h.bytes(&u.to_le_bytes());
            let (_, pair) = choose(env, &c, &strategy, l, select);
            *ties += u64::from(pair.ties);
            let zi = env.diff(&c, pair.first, pair.second);
            y.push(env.give(&c, pair.first, pair.second, &zi, u, flips));
            z.extend(zi);
            let best = (0..k).map(|a| env.reward(&c, a)).fold(f64::NEG_INFINITY, f64::max);
            let got = 0.5 * (env.reward(&c, pair.first) + env.reward(&c, pair.second));
            *regret += best - got;
            *reward_sum += got;
            *rounds += 1;
        }
        l.update(&z, &y)?;
        if l.due(cell.stream.eval_every, last) {
            let mut row = l.row_at((&env.eval_z, &env.eval_y), Some(env));
            row.regret = Some(pr.deploy.regret);
            row.mean_reward = Some(pr.deploy.reward_sum / pr.deploy.seen as f64);
            row.ties = pr.ties;
            row.flipped_labels = env.flipped(&pr.flips);
            pr.rows.push(row);
        }
        Ok(())
    })?;
    Ok(CellResult { rows: pr.rows, stream_hash: pr.hash.0, ..Default::default() })
}

/// Deployment on generated responses (paper Alg. 4 in the authors' chunked form): the prompts,
/// in a per-seed order, are cut into chunks; within a chunk θ is fixed — it ranks every
/// prompt's n responses, the strategy picks a pair, the oracle labels it — then the estimator
/// updates on the chunk's pairs in mini-batches of `stream.batch_size`. With `world.online`
/// (a learning policy in the run) the cell's [`PolicyCell`] supplies the chunk's responses,
/// updates after θ, and is evaluated on the held-out prompts before the first chunk and every
/// `policy.eval_every_chunks` chunks. With a reward model whose features learn (`reward`,
/// [`LearnedRm`]) the responses' φ is its current h_ψ, and each mini-batch is one step over
/// (ψ, θ) instead of the estimator's update on cached φ.
///
/// A chunk is five steps: its responses ([`responses`]), their labels ([`label_chunk`]), the
/// reward's update ([`update_reward`]), the metric row ([`chunk_row`]), the policy's step
/// ([`policy_step`]).
pub(super) fn deploy_chunked(
    cell: &CellConfig,
    world: ChunkedWorld<'_>,
    l: &mut Learner,
    seed: u32,
    ctx: &mut CellCtx,
    resumed: Option<Progress>,
) -> Result<CellResult> {
    let ChunkedWorld { env, g, online, reward } = world;
    let strategy = strategy_of(&cell.config)?;
    let mut fresh = Progress::fresh(cell.master_seed, seed);
    let p = env.contexts.len();
    let order = prompt_order(cell, p, &mut fresh.data);
    let chunks = cell.deploy.chunks;
    let mut pr = resumed.unwrap_or(fresh);
    let mut lrm = match reward {
        Some(base) => Some(LearnedRm::start(cell, base, l, seed, &mut pr, env)?),
        None => None,
    };
    let mut pc = policy_cell(cell, online, seed, &pr)?;
    if let (Some(pc), true) = (&mut pc, pr.policy.rows.is_empty()) {
        before_first_chunk(pc, lrm.as_ref(), l, &mut pr, env.d, chunks)?;
    }
    // the live curves, written per chunk from inside it (its completions) and at its end
    let mut live = std::mem::replace(&mut ctx.live, Live::off());
    live.publish(Snapshot::of(l, &pr));
    let ran = drive(chunks as u64, &mut pr, l, ctx, |t, last, pr, l| {
        let c = (t - 1) as usize;
        if c > 0 && cell.deploy.reset_each_chunk {
            l.reset_estimator(cell, seed)?;
        }
        let mut time = PolicyTiming { chunk: t, ..Default::default() };
        let xs = &order[chunk_range(c, p, chunks)];
        let (rollout_digest, rollout_served_as) = match &pc {
            Some(pc) => (pc.digest()?, pc.served_as(true)?),
            None => (String::new(), String::new()),
        };
        let mut chunk = responses(pc.as_ref(), lrm.as_ref(), env, g, online, xs, &mut time)?;
        let labels = label_chunk(env, &strategy, l, pr, pc.as_ref(), (&chunk, xs), t);
        live.completions(t, &completions(g, env, &chunk, xs, l.theta()));
        let t0 = Instant::now();
        update_reward(lrm.as_mut(), l, pr, &labels, &chunk.ids, cell.stream.batch_size, env.d)?;
        time.estimator_s = t0.elapsed().as_secs_f64();
        let row = chunk_row(l, lrm.as_ref(), pr, env, &labels, t, xs.len())?;
        pr.rows.push(row);
        if let Some(pc) = &mut pc {
            let step = PolicyStep {
                chunk: t,
                last,
                chunks: chunks as u64,
                xs,
                rollout_digest,
                rollout_served_as,
                label: &cell.config.label,
                seed,
                g,
                d: env.d,
            };
            policy_step(pc, lrm.as_ref(), l, pr, (&mut chunk, &labels), step, time)?;
        }
        live.publish(Snapshot::of(l, pr));
        Ok(())
    });
    ctx.live = live;
    ran?;
    chunked_result(pr, lrm.as_ref())
}

/// The order the prompts are deployed in: the bank's, or shuffled by the seed's data stream
/// (`deploy.prompt_order`).
fn prompt_order(cell: &CellConfig, p: usize, data: &mut rand_chacha::ChaCha20Rng) -> Vec<usize> {
    let mut order: Vec<usize> = (0..p).collect();
    if cell.deploy.prompt_order == Order::Shuffled {
        order.shuffle(data);
    }
    order
}

/// The cell's deployed policy with `world.online` (its adapters from the checkpoint `pr` holds,
/// if any), else None.
fn policy_cell<'o>(
    cell: &CellConfig,
    online: Option<&'o Online>,
    seed: u32,
    pr: &Progress,
) -> Result<Option<PolicyCell<'o>>> {
    match online {
        Some(o) => {
            let arm = cell.config.arm.as_ref().ok_or_else(|| anyhow!("deploy cell without a policy arm"))?;
            Ok(Some(PolicyCell::new(o, arm, cell, seed, pr.policy.state.as_ref())?))
        }
        None => Ok(None),
    }
}

/// The chunked cell's tables from its progress, with the reward model's adapter and head
/// (LoRA) beside the policy's adapters.
fn chunked_result(mut pr: Progress, lrm: Option<&LearnedRm<'_>>) -> Result<CellResult> {
    if let Some(a) = lrm.map(|m| m.adapter()).transpose()?.flatten() {
        pr.policy.adapters.push(a);
    }
    Ok(CellResult {
        rows: pr.rows,
        rounds: pr.deploy.rounds,
        stream_hash: pr.hash.0,
        policy: pr.policy.rows,
        policy_samples: pr.policy.samples,
        policy_updates: pr.policy.updates,
        policy_times: pr.policy.times,
        adapters: pr.policy.adapters,
        ..Default::default()
    })
}

/// Before the first chunk: the policy's evaluation (the base policy on the seed's held-out
/// streams; a resumed cell has this row already), then a dpo warm start.
fn before_first_chunk(
    pc: &mut PolicyCell<'_>,
    lrm: Option<&LearnedRm<'_>>,
    l: &Learner,
    pr: &mut Progress,
    d: usize,
    chunks: usize,
) -> Result<()> {
    let t0 = Instant::now();
    let (row, samples, e) = pc.evaluate(0, l.theta(), d, lrm.map(|m| m.features()))?;
    pr.policy.rows.push(row);
    pr.policy.samples.extend(samples);
    let mut time = PolicyTiming { chunk: 0, eval_s: t0.elapsed().as_secs_f64(), ..Default::default() };
    time.record_eval(e);
    let (digest, t1) = (pc.digest()?, Instant::now());
    if let Some(up) = pc.warm_start()? {
        time.policy_s = t1.elapsed().as_secs_f64();
        pr.policy.updates.push(PolicyCell::update_row(0, digest, pc.digest()?, &[], l.theta(), d, &up));
        if let Some(a) = pc.adapter(0, chunks as u64)? {
            pr.policy.adapters.push(a);
        }
    }
    pr.policy.times.push(time);
    Ok(())
}

/// A chunk's responses: each prompt's context (φ or, with a reward model whose features learn,
/// h_ψ of its n responses; empty when the bank's contexts serve as they are), a learning
/// policy's samples, and the responses' token ids for the reward model.
struct ChunkResponses {
    contexts: Vec<Context>,
    samples: Vec<Vec<Sample>>,
    ids: Vec<Vec<Vec<u32>>>,
}

impl ChunkResponses {
    fn context<'a>(&'a self, env: &'a Env, i: usize, x: usize) -> &'a Context {
        if self.contexts.is_empty() {
            &env.contexts[x]
        } else {
            &self.contexts[i]
        }
    }
}

/// The chunk's responses (step 1): the policy's (a learning one samples; others the bank's),
/// scored by the current h_ψ when the reward model's features learn.
fn responses(
    pc: Option<&PolicyCell<'_>>,
    lrm: Option<&LearnedRm<'_>>,
    env: &Env,
    g: &Generated,
    online: Option<&Online>,
    xs: &[usize],
    time: &mut PolicyTiming,
) -> Result<ChunkResponses> {
    let (mut contexts, samples) = match pc {
        Some(pc) => pc.respond(g, env, xs, time)?,
        None => (Vec::new(), Vec::new()),
    };
    let mut ids = Vec::new();
    if let Some(m) = lrm {
        let t0 = Instant::now();
        if contexts.is_empty() {
            contexts = xs.iter().map(|&x| env.contexts[x].clone()).collect();
        }
        ids = m.response_ids(online, g, xs, &samples)?;
        m.relabel(&mut contexts, &ids)?;
        time.phi_s += t0.elapsed().as_secs_f64();
    }
    Ok(ChunkResponses { contexts, samples, ids })
}

/// The first [`COMPLETIONS`] prompts of a chunk with the policy's first response to each, its
/// oracle reward and its learned reward under `theta` (the `completions` text of the live
/// curves).
fn completions<'a>(
    g: &'a Generated,
    env: &Env,
    chunk: &'a ChunkResponses,
    xs: &[usize],
    theta: &[f64],
) -> Vec<Completion<'a>> {
    xs.iter()
        .enumerate()
        .take(COMPLETIONS)
        .filter_map(|(i, &x)| {
            let sample = chunk.samples.get(i).or_else(|| g.samples.get(x))?.first()?;
            let c = chunk.context(env, i, x);
            let reward = *c.reward.as_ref()?.first()?;
            let learned = dot(c.phi.get(..env.d)?, theta);
            let messages = g.prompts.get(x)?;
            let prompt = messages.iter().rev().find(|m| m.role == "user").or(messages.last())?;
            Some(Completion { prompt: &prompt.content, completion: &sample.text, reward, learned })
        })
        .collect()
}

/// What a chunk labelled: the pairs (and their z, y for the update), and the sums its metric
/// row reports.
struct ChunkLabels {
    labelled: Vec<Labelled>,
    z: Vec<f32>,
    y: Vec<f32>,
    pair_sum: f64,
    deployed_sum: f64,
    tau_sum: f64,
}

/// Step 2: per prompt of the chunk, θ ranks its responses, the strategy picks a pair, the
/// oracle labels it; the regret, the stream hash and rounds.parquet's row move on. `(chunk, xs)`:
/// the chunk's responses and its prompts.
fn label_chunk(
    env: &Env,
    strategy: &Strategy,
    l: &mut Learner,
    pr: &mut Progress,
    pc: Option<&PolicyCell<'_>>,
    (chunk, xs): (&ChunkResponses, &[usize]),
    t: u64,
) -> ChunkLabels {
    let k = env.k;
    let mut out = ChunkLabels {
        labelled: Vec::new(),
        z: Vec::new(),
        y: Vec::new(),
        pair_sum: 0.0,
        deployed_sum: 0.0,
        tau_sum: 0.0,
    };
    let Progress { labels, select, hash: h, ties, deploy, flips, .. } = pr;
    let DeployProgress { regret, reward_sum, oracle_ties, rounds, .. } = deploy;
    for (i, &x) in xs.iter().enumerate() {
        let ctx = chunk.context(env, i, x);
        let (est, pair) = choose(env, ctx, strategy, l, select);
        let truth: Vec<f64> = (0..k).map(|a| env.reward(ctx, a)).collect();
        *ties += u64::from(pair.ties);
        let zi = env.diff(ctx, pair.first, pair.second);
        let u: f64 = labels.random();
        h.bytes(&(x as u64).to_le_bytes());
        h.bytes(&u.to_le_bytes());
        let label = env.give(ctx, pair.first, pair.second, &zi, u, flips);
        let tie = truth[pair.first] == truth[pair.second];
        let coin = tie && env.labels == crate::spec::LabelRule::Argmax;
        out.labelled.push(Labelled { at: i, first: pair.first, second: pair.second, label, tie: coin });
        *oracle_ties += u64::from(tie);
        out.y.push(label);
        out.z.extend(zi);
        let best = truth.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let (ra, rb) = (truth[pair.first], truth[pair.second]);
        *regret += best - 0.5 * (ra + rb);
        *reward_sum += 0.5 * (ra + rb);
        out.pair_sum += ra + rb;
        // what the arm deploys: best-of-n its pick under θ; a fixed or learning policy its
        // samples (their mean oracle reward; policy_pick 0 in rounds.parquet). Without a
        // policy arm in the run (no learning arm), best-of-n.
        let (pick, deployed) = match pc {
            Some(pc) => pc.deploy(&truth, &est),
            None => super::arms::best_of_n(&truth, &est),
        };
        out.deployed_sum += deployed;
        let tau = kendall_tau_b(&est, &truth);
        out.tau_sum += tau;
        rounds.push(RoundRow {
            chunk: t,
            prompt: x as u64,
            first: pair.first as u32,
            second: pair.second as u32,
            reward_first: ra,
            reward_second: rb,
            label,
            policy_pick: pick as u32,
            policy_reward: deployed,
            best_reward: best,
            kendall_tau: tau,
        });
    }
    out
}

/// Step 3: the estimator's updates on the chunk's pairs in mini-batches of `b`, or, with a
/// reward model whose features learn, one step over (ψ, θ) per mini-batch and h_ψ recomputed.
fn update_reward(
    lrm: Option<&mut LearnedRm<'_>>,
    l: &mut Learner,
    pr: &mut Progress,
    labels: &ChunkLabels,
    ids: &[Vec<Vec<u32>>],
    b: usize,
    d: usize,
) -> Result<()> {
    match lrm {
        Some(m) => {
            let st = pr.reward_state.as_mut().ok_or_else(|| anyhow!("a reward model without its update's state"))?;
            for (pb, zb) in labels.labelled.chunks(b).zip(labels.z.chunks(b * d)) {
                m.step(st, pb, ids, zb, l)?;
            }
            m.refresh(st)
        }
        None => {
            for (zb, yb) in labels.z.chunks(b * d).zip(labels.y.chunks(b)) {
                l.update(zb, yb)?;
            }
            Ok(())
        }
    }
}

/// Step 4: the chunk's metric row. The held-out pairs are scored under θ and φ, or under the
/// current h_ψ (θ-error and SubOpt are then left out: θ* lives in φ's space, not h_ψ's).
fn chunk_row(
    l: &mut Learner,
    lrm: Option<&LearnedRm<'_>>,
    pr: &mut Progress,
    env: &Env,
    labels: &ChunkLabels,
    t: u64,
    prompts: usize,
) -> Result<MetricRow> {
    pr.deploy.seen += prompts as u64;
    let n = prompts as f64;
    pr.deploy.cum_pair += labels.pair_sum / n;
    let mut row = match lrm {
        Some(m) => {
            let st = pr.reward_state.as_ref().ok_or_else(|| anyhow!("a reward model without its update's state"))?;
            let ez = m.eval_z(env)?;
            let mut row = l.row_at((&ez, &env.eval_y), None);
            (row.grad_evals, row.hvp_evals, row.negative_quad_forms) = st.counters();
            row
        }
        None => l.row_at((&env.eval_z, &env.eval_y), Some(env)),
    };
    row.regret = Some(pr.deploy.regret);
    row.mean_reward = Some(pr.deploy.reward_sum / pr.deploy.seen as f64);
    row.ties = pr.ties;
    row.chunk = Some(t);
    row.pair_reward = Some(labels.pair_sum / n);
    row.cum_pair_reward = Some(pr.deploy.cum_pair);
    row.policy_reward = Some(labels.deployed_sum / n);
    row.kendall_tau = Some(labels.tau_sum / n);
    row.oracle_ties = Some(pr.deploy.oracle_ties);
    row.flipped_labels = env.flipped(&pr.flips);
    Ok(row)
}

/// Where the policy's step of a chunk is.
struct PolicyStep<'a> {
    chunk: u64,
    last: bool,
    chunks: u64,
    xs: &'a [usize],
    /// The digest of the policy that produced the chunk's samples, and the name they were
    /// requested under on a server.
    rollout_digest: String,
    rollout_served_as: String,
    label: &'a str,
    seed: u32,
    /// The generated bank (the prompts of fresh rollouts).
    g: &'a Generated,
    /// φ's dimension.
    d: usize,
}

/// Step 5: the policy's update after θ's (on the reward as the chunk's steps left it), its
/// evaluation every `policy.eval_every_chunks` chunks and at the last, the chunk's timings,
/// adapters and checkpoint state. `(chunk, labels)`: the chunk's responses and what was labelled.
fn policy_step(
    pc: &mut PolicyCell<'_>,
    lrm: Option<&LearnedRm<'_>>,
    l: &Learner,
    pr: &mut Progress,
    (chunk, labels): (&mut ChunkResponses, &ChunkLabels),
    s: PolicyStep<'_>,
    mut time: PolicyTiming,
) -> Result<()> {
    let (t, g, d) = (s.chunk, s.g, s.d);
    let (t1, rollout_s) = (Instant::now(), time.generation_s + time.phi_s);
    let learned = lrm.map(|m| m.features());
    if let (Some(m), true) = (lrm, pc.learns()) {
        // the policy learns from the reward model as the chunk's steps left it
        let t2 = Instant::now();
        m.relabel(&mut chunk.contexts, &chunk.ids)?;
        time.phi_s += t2.elapsed().as_secs_f64();
    }
    let (samples, contexts) = (&chunk.samples, &chunk.contexts);
    let c = ChunkIn { chunk: t, xs: s.xs, samples, contexts, pairs: &labels.labelled };
    let up = pc.update(c, l.theta(), d, g, learned, &mut time)?;
    // the policy's own time: less fresh rollouts' generation and φ, less the critic
    time.critic_s = up.as_ref().and_then(|u| u.critic).map_or(0.0, |c| c.seconds);
    time.policy_s = t1.elapsed().as_secs_f64() - (time.generation_s + time.phi_s - rollout_s) - time.critic_s;
    if let Some(up) = &up {
        let mut row = PolicyCell::update_row(t, s.rollout_digest, pc.digest()?, contexts, l.theta(), d, up);
        row.rollout_served_as = s.rollout_served_as;
        pr.policy.updates.push(row);
    }
    let every = pc.online.spec.eval_every_chunks as u64;
    if t.is_multiple_of(every) || s.last {
        let t2 = Instant::now();
        let (row, samples, e) = pc.evaluate(t, l.theta(), d, learned)?;
        pc.check_not_destroyed(&row, pr.policy.rows.first())?;
        pr.policy.rows.push(row);
        pr.policy.samples.extend(samples);
        time.eval_s = t2.elapsed().as_secs_f64();
        time.record_eval(e);
    }
    // a long online cell says where it is in a log (bars show cells; --quiet nothing)
    if pc.online.progress == crate::progress::Mode::Lines {
        eprintln!(
            "onepass: cell {} (seed {}): chunk {t}/{} done — generation {:.0} s, φ {:.0} s, policy {:.0} s, critic {:.0} s, evaluation {:.0} s",
            s.label, s.seed, s.chunks, time.generation_s, time.phi_s, time.policy_s, time.critic_s, time.eval_s
        );
    }
    pr.policy.times.push(time);
    if let Some(a) = pc.adapter(t, s.chunks)? {
        pr.policy.adapters.push(a);
    }
    pr.policy.state = pc.state()?;
    Ok(())
}
