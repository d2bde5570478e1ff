//! Deployment-time adaptation (paper Alg. 4): each round the deployed reward ranks a context's
//! arms, a strategy picks the pair to label, the learner updates — per round on the synthetic
//! bandit, per chunk of prompts on generated responses (the authors' form).

use super::arms::Labelled;
use super::choose;
use super::deploy_rm::{ChunkPair, LearnedRm};
use super::learner::Learner;
use super::online::PolicyCell;
use super::state::{drive, CellCtx, Progress};
use crate::plan::{parametrize, theory_beta, ConfigPlan};
use crate::rows::{CellResult, PolicyTiming, RoundRow};
use crate::spec::{Order, Spec};
use crate::world::env::Env;
use crate::world::generated::Generated;
use crate::world::online::Online;
use crate::world::reward::RewardBase;
use anyhow::{anyhow, Result};
use rand::seq::SliceRandom;
use rand::Rng;
use selection::{kendall_tau_b, Strategy};
use std::time::Instant;

/// The cell's strategy, with a ucb width of "theory" resolved from d and T.
fn strategy_of(spec: &Spec, config: &ConfigPlan) -> Result<Strategy> {
    let s = config.strategy.ok_or_else(|| anyhow!("deploy cell without a strategy"))?;
    let d = &spec.deploy;
    Ok(parametrize(s, d.q, d.beta, theory_beta(spec.env.dim, spec.stream.samples, d.delta)))
}

pub(super) fn deploy(
    spec: &Spec,
    config: &ConfigPlan,
    env: &Env,
    l: &mut Learner,
    seed: u32,
    ctx: &mut CellCtx,
    resumed: Option<Progress>,
) -> Result<CellResult> {
    let strategy = strategy_of(spec, config)?;
    let (b, d, k) = (spec.stream.batch_size, env.d, env.k);
    let steps = spec.stream.samples / b as u64;
    let mut pr = resumed.unwrap_or_else(|| Progress::fresh(spec, seed));
    let (mut z, mut y) = (Vec::with_capacity(b * d), Vec::with_capacity(b));
    drive(steps, &mut pr, l, ctx, |_, last, pr, l| {
        z.clear();
        y.clear();
        let Progress { data, labels, select, hash: h, regret, reward_sum, ties, seen: rounds, .. } = &mut *pr;
        for _ in 0..b {
            let c = env.draw_context(data);
            let u: f64 = labels.random();
            h.f32s(&c.phi);
            h.bytes(&u.to_le_bytes());
            let (_, pair) = choose(env, &c, &strategy, l, select);
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
        if l.due(spec.stream.eval_every, last) {
            let mut row = l.row_at((&env.eval_z, &env.eval_y), Some(env));
            row.regret = Some(pr.regret);
            row.mean_reward = Some(pr.reward_sum / pr.seen as f64);
            row.ties = pr.ties;
            pr.rows.push(row);
        }
        Ok(())
    })?;
    Ok(CellResult { rows: pr.rows, stream_hash: pr.hash.0, ..Default::default() })
}

/// Chunk c of `chunks` over p prompts: positions [c·p/chunks, (c+1)·p/chunks) of the order.
pub(super) fn chunk_range(c: usize, p: usize, chunks: usize) -> std::ops::Range<usize> {
    c * p / chunks..(c + 1) * p / chunks
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
#[allow(clippy::too_many_arguments)]
pub(super) fn deploy_chunked(
    spec: &Spec,
    config: &ConfigPlan,
    env: &Env,
    g: &Generated,
    online: Option<&Online>,
    reward: Option<&RewardBase>,
    l: &mut Learner,
    seed: u32,
    ctx: &mut CellCtx,
    resumed: Option<Progress>,
) -> Result<CellResult> {
    let strategy = strategy_of(spec, config)?;
    let (k, b, d) = (env.k, spec.stream.batch_size, env.d);
    let mut fresh = Progress::fresh(spec, seed);
    let p = env.contexts.len();
    let mut order: Vec<usize> = (0..p).collect();
    if spec.deploy.prompt_order == Order::Shuffled {
        order.shuffle(&mut fresh.data);
    }
    let chunks = spec.deploy.chunks.max(1);
    let mut pr = resumed.unwrap_or(fresh);
    let mut lrm = match reward {
        Some(base) => Some(LearnedRm::start(spec, config, base, l, seed, &mut pr, env)?),
        None => None,
    };
    let mut pc = match online {
        Some(o) => {
            let arm = config.arm.as_ref().ok_or_else(|| anyhow!("deploy cell without a policy arm"))?;
            Some(PolicyCell::new(o, arm, spec, seed, pr.policy_state.as_ref())?)
        }
        None => None,
    };
    // the policy before any update (a resumed cell has this row already)
    // then a dpo warm start, before the first chunk
    if let (Some(pc), true) = (&mut pc, pr.policy_rows.is_empty()) {
        let t0 = Instant::now();
        let (row, e) = pc.evaluate(0, l.theta(), d, lrm.as_ref().map(|m| m.features()))?;
        pr.policy_rows.push(row);
        let mut time = PolicyTiming { chunk: 0, eval_s: t0.elapsed().as_secs_f64(), ..Default::default() };
        time.record_eval(e);
        let (digest, t1) = (pc.digest()?, Instant::now());
        if let Some(up) = pc.warm_start()? {
            time.policy_s = t1.elapsed().as_secs_f64();
            pr.policy_updates.push(PolicyCell::update_row(0, digest, pc.digest()?, &[], l.theta(), d, &up));
            if let Some(a) = pc.adapter(0, chunks as u64)? {
                pr.adapters.push(a);
            }
        }
        pr.policy_times.push(time);
    }
    drive(chunks as u64, &mut pr, l, ctx, |t, last, pr, l| {
        let c = (t - 1) as usize;
        let r = chunk_range(c, p, chunks);
        let (lo, hi) = (r.start, r.end);
        if c > 0 && spec.deploy.reset_each_chunk {
            l.reset_estimator(spec, config, seed)?;
        }
        let mut time = PolicyTiming { chunk: t, ..Default::default() };
        let xs = &order[lo..hi];
        let rollout_digest = match &pc {
            Some(pc) => pc.digest()?,
            None => String::new(),
        };
        let (mut contexts, samples) = match &pc {
            Some(pc) => pc.respond(g, env, xs, &mut time)?,
            None => (Vec::new(), Vec::new()),
        };
        // a reward model whose features learn: every response's φ is its h_ψ now
        let mut ids = Vec::new();
        if let Some(m) = &lrm {
            let t0 = Instant::now();
            if contexts.is_empty() {
                contexts = xs.iter().map(|&x| env.contexts[x].clone()).collect();
            }
            ids = m.response_ids(online, g, xs, &samples)?;
            m.relabel(&mut contexts, &ids)?;
            time.phi_s += t0.elapsed().as_secs_f64();
        }
        let (mut z, mut y) = (Vec::new(), Vec::new());
        let mut labelled = Vec::new();
        let Progress { labels, select, hash: h, regret, reward_sum, ties, oracle_ties, rounds, .. } = &mut *pr;
        let (mut pair_sum, mut pol_sum, mut tau_sum) = (0.0, 0.0, 0.0);
        for (i, &x) in xs.iter().enumerate() {
            let ctx = if contexts.is_empty() { &env.contexts[x] } else { &contexts[i] };
            let (est, pair) = choose(env, ctx, &strategy, l, select);
            let truth: Vec<f64> = (0..k).map(|a| env.reward(ctx, a)).collect();
            *ties += u64::from(pair.ties);
            let zi = env.diff(ctx, pair.first, pair.second);
            let u: f64 = labels.random();
            h.bytes(&(x as u64).to_le_bytes());
            h.bytes(&u.to_le_bytes());
            let label = env.label(ctx, pair.first, pair.second, &zi, u);
            let tie = truth[pair.first] == truth[pair.second];
            let coin = tie && env.labels == crate::spec::LabelRule::Argmax;
            labelled.push(Labelled { at: i, first: pair.first, second: pair.second, label, tie: coin });
            *oracle_ties += u64::from(tie);
            y.push(label);
            z.extend(zi);
            let best = truth.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let (ra, rb) = (truth[pair.first], truth[pair.second]);
            *regret += best - 0.5 * (ra + rb);
            *reward_sum += 0.5 * (ra + rb);
            pair_sum += ra + rb;
            // what the arm deploys: best-of-n its pick under θ; a fixed or learning policy its
            // samples (their mean oracle reward; policy_pick 0 in rounds.parquet). Without a
            // policy arm in the run (no learning arm), best-of-n.
            let (pick, deployed) = match &pc {
                Some(pc) => pc.deploy(&truth, &est),
                None => super::arms::best_of_n(&truth, &est),
            };
            pol_sum += deployed;
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
                policy_reward: deployed,
                best_reward: best,
                kendall_tau: tau,
            });
        }
        let t0 = Instant::now();
        match &mut lrm {
            Some(m) => {
                let st =
                    pr.reward_state.as_mut().ok_or_else(|| anyhow!("a reward model without its update's state"))?;
                let pairs: Vec<ChunkPair> = labelled
                    .iter()
                    .map(|p| ChunkPair { at: p.at, first: p.first, second: p.second, label: p.label })
                    .collect();
                for (pb, zb) in pairs.chunks(b).zip(z.chunks(b * env.d)) {
                    m.step(st, pb, &ids, zb, l)?;
                }
                m.refresh(st)?;
            }
            None => {
                for (zb, yb) in z.chunks(b * env.d).zip(y.chunks(b)) {
                    l.update(zb, yb)?;
                }
            }
        }
        time.estimator_s = t0.elapsed().as_secs_f64();
        pr.seen += (hi - lo) as u64;
        let n = (hi - lo) as f64;
        pr.cum_pair += pair_sum / n;
        let mut row = match (&lrm, &pr.reward_state) {
            // held-out pairs under the current h_ψ; θ* and the greedy policy's SubOpt are in φ's
            // space, not h_ψ's: not reported
            (Some(m), Some(st)) => {
                let ez = m.eval_z(env)?;
                let mut row = l.row_at((&ez, &env.eval_y), None);
                (row.grad_evals, row.hvp_evals, row.negative_quad_forms) = st.counters();
                row
            }
            _ => l.row_at((&env.eval_z, &env.eval_y), Some(env)),
        };
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
        if let Some(pc) = &mut pc {
            let (t1, rollout_s) = (Instant::now(), time.generation_s + time.phi_s);
            let learned = lrm.as_ref().map(|m| m.features());
            if let (Some(m), true) = (&lrm, pc.learns()) {
                // the policy learns from the reward model as the chunk's steps left it
                let t2 = Instant::now();
                m.relabel(&mut contexts, &ids)?;
                time.phi_s += t2.elapsed().as_secs_f64();
            }
            let up = pc.update(t, xs, &samples, &contexts, &labelled, l.theta(), d, g, learned, &mut time)?;
            // the policy's own time: less fresh rollouts' generation and φ, less the critic
            time.critic_s = up.as_ref().and_then(|u| u.critic).map_or(0.0, |c| c.seconds);
            time.policy_s = t1.elapsed().as_secs_f64() - (time.generation_s + time.phi_s - rollout_s) - time.critic_s;
            if let Some(up) = &up {
                let row = PolicyCell::update_row(t, rollout_digest, pc.digest()?, &contexts, l.theta(), d, up);
                pr.policy_updates.push(row);
            }
            let every = pc.online.spec.eval_every_chunks as u64;
            if t % every == 0 || last {
                let t2 = Instant::now();
                let (row, e) = pc.evaluate(t, l.theta(), d, learned)?;
                pr.policy_rows.push(row);
                time.eval_s = t2.elapsed().as_secs_f64();
                time.record_eval(e);
            }
            // a long online cell says where it is in a log (bars show cells; --quiet nothing)
            if pc.online.progress == crate::progress::Mode::Lines {
                eprintln!(
                    "onepass: cell {} (seed {seed}): chunk {t}/{chunks} done — generation {:.0} s, φ {:.0} s, policy {:.0} s, critic {:.0} s, evaluation {:.0} s",
                    config.label, time.generation_s, time.phi_s, time.policy_s, time.critic_s, time.eval_s
                );
            }
            pr.policy_times.push(time);
            if let Some(a) = pc.adapter(t, chunks as u64)? {
                pr.adapters.push(a);
            }
            pr.policy_state = pc.state()?;
        }
        Ok(())
    })?;
    // the reward model's adapter and head (LoRA) beside the policy's adapters
    if let Some(a) = lrm.as_ref().map(|m| m.adapter()).transpose()?.flatten() {
        pr.adapters.push(a);
    }
    Ok(CellResult {
        rows: pr.rows,
        rounds: pr.rounds,
        stream_hash: pr.hash.0,
        policy: pr.policy_rows,
        policy_updates: pr.policy_updates,
        policy_times: pr.policy_times,
        adapters: pr.adapters,
        ..Default::default()
    })
}
