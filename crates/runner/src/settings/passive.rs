//! Passive data collection (paper Alg. 2): a stream of pairs drawn uniformly (synthetic) or
//! read in a per-seed order (pairs files), every estimator on the same stream; with
//! `stream.ranks` > 1 the authors' independent rank-local heads.

use super::checkpoint::{drive, CellCtx};
use super::learner::Learner;
use super::pessimism::pessimistic;
use super::state::Progress;
use super::Source;
use crate::plan::CellConfig;
use crate::rows::{CellResult, MetricRow};
use crate::spec::{Order, PessimismReference};
use crate::world::env::two_arms;
use crate::world::pairs::PairData;
use anyhow::{anyhow, Result};
use rand::seq::SliceRandom;
use rand::Rng;

/// The training rows of a features file in stream order.
pub(super) fn file_order(cell: &CellConfig, p: &PairData, data: &mut rand_chacha::ChaCha20Rng) -> Vec<usize> {
    if let Some(o) = &p.order {
        return o.clone();
    }
    let mut order: Vec<usize> = (0..p.train.len()).collect();
    if cell.env.order == Order::Shuffled {
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
        estimator_bytes: rows.iter().map(|r| r.estimator_bytes).sum(),
        ..Default::default()
    }
}

/// Passive with `stream.ranks` = R independent heads (the authors' un-synchronised OMD ranks):
/// head r reads rows r, r+R, … of the stream; a metric row is the mean over heads.
pub(super) fn passive_ranks(
    cell: &CellConfig,
    src: &Source<'_>,
    l0: &mut Learner,
    resumed_others: Vec<Learner>,
    seed: u32,
    ctx: &mut CellCtx,
    resumed: Option<Progress>,
) -> Result<CellResult> {
    let Source::Pairs(p) = src else { return Err(anyhow!("stream.ranks > 1 needs pairs")) };
    let (b, r) = (cell.stream.batch_size, cell.stream.ranks);
    let steps = cell.stream.samples / (b * r) as u64;
    let mut fresh = Progress::fresh(cell.master_seed, seed);
    let order = file_order(cell, p, &mut fresh.data);
    let shards: Vec<Vec<usize>> = (0..r).map(|k| order.iter().skip(k).step_by(r).copied().collect()).collect();
    // every head starts from the same θ (DeepSpeed broadcasts rank 0's initial weights)
    let mut others: Vec<Learner> = match resumed {
        Some(_) => resumed_others,
        None => (1..r).map(|_| Learner::new(cell, seed)).collect::<Result<_>>()?,
    };
    let mut pr = resumed.unwrap_or(fresh);
    let (mut z, mut y) = (Vec::with_capacity(b * cell.d), Vec::with_capacity(b));
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
        if s == steps || now / cell.stream.eval_every > before / cell.stream.eval_every {
            let mut each = vec![l0.row(src)];
            each.extend(others.iter_mut().map(|o| o.row(src)));
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

pub(super) fn passive(
    cell: &CellConfig,
    src: &Source<'_>,
    l: &mut Learner,
    seed: u32,
    ctx: &mut CellCtx,
    resumed: Option<Progress>,
) -> Result<CellResult> {
    let (b, d) = (cell.stream.batch_size, cell.d);
    let steps = cell.stream.samples / b as u64;
    let mut fresh = Progress::fresh(cell.master_seed, seed);
    let order = match src {
        Source::Pairs(p) => file_order(cell, p, &mut fresh.data),
        Source::Synthetic(_) => Vec::new(),
    };
    let mut pr = resumed.unwrap_or(fresh);
    let (mut z, mut y) = (Vec::with_capacity(b * d), Vec::with_capacity(b));
    drive(steps, &mut pr, l, ctx, |_, last, pr, l| {
        z.clear();
        y.clear();
        for _ in 0..b {
            match src {
                Source::Synthetic(env) => {
                    let c = env.draw_context(&mut pr.data);
                    let (a1, a2) = two_arms(&mut pr.data, env.k);
                    let zi = env.diff(&c, a1, a2);
                    let u = pr.labels.random();
                    y.push(env.give(&c, a1, a2, &zi, u, &mut pr.flips));
                    z.extend(zi);
                }
                Source::Pairs(p) => {
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
        if l.due(cell.stream.eval_every, last) {
            let mut row = l.row(src);
            row.flipped_labels = src.truth().and_then(|e| e.flipped(&pr.flips));
            pr.rows.push(row);
        }
        Ok(())
    })?;
    let (mut rows, h) = (pr.rows, pr.hash);
    let Some(env) = src.truth() else {
        return Ok(CellResult { rows, stream_hash: h.0, ..Default::default() });
    };
    let beta = cell.config.pessimism_beta.ok_or_else(|| anyhow!("a passive cell's config was not resolved"))?;
    let theta = l.theta.clone();
    let how = cell.passive.pessimism;
    let pess = pessimistic(env, &theta, &mut |x| l.inv_norm_f64(x), beta, how, false);
    let pess_ref = (cell.passive.reference == PessimismReference::Uniform)
        .then(|| pessimistic(env, &theta, &mut |x| l.inv_norm_f64(x), beta, how, true));
    if let Some(last) = rows.last_mut() {
        last.subopt_pessimistic = Some(env.subopt_of(&pess));
        last.subopt_pessimistic_ref = pess_ref.map(|p| env.subopt_of(&p));
    }
    Ok(CellResult { rows, stream_hash: h.0, ..Default::default() })
}
