//! Active data collection (paper Alg. 3): the learner picks the pairs to label, by a rule —
//! the 𝓗⁻¹-norm argmax over a pool (Eq. (4)), the authors' stream rule, random pool pairs, or
//! the practical best-vs-worst of a fresh prompt's responses (§5).

use super::choose;
use super::learner::Learner;
use super::state::{drive, CellCtx, Progress};
use super::Source;
use crate::plan::CellConfig;
use crate::rows::CellResult;
use crate::spec::{ActiveRule, ScoreNorm};
use crate::world::env::two_arms;
use anyhow::{anyhow, Result};
use estimators::{Curvature, CurvatureKind};
use rand::Rng;
use std::borrow::Cow;

pub(super) fn active(
    cell: &CellConfig,
    src: &Source<'_>,
    l: &mut Learner,
    seed: u32,
    ctx: &mut CellCtx,
    resumed: Option<Progress>,
) -> Result<CellResult> {
    let a = &cell.active;
    let (b, d) = (cell.stream.batch_size, cell.d);
    let steps = cell.stream.samples / b as u64;
    let mut fresh = Progress::fresh(cell.master_seed, seed);
    // the pool: pairs drawn once, each with its label drawn once (a re-queried pair keeps it)
    let (pool_z, pool_y): (Cow<'_, [f32]>, Cow<'_, [f32]>) = match src {
        Source::Synthetic(env) => {
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
        Source::Pairs(p) => (Cow::Borrowed(&p.train.z[..]), Cow::Borrowed(&p.train.y[..])),
    };
    let pool = pool_y.len();
    fresh.hash.f32s(&pool_z);
    fresh.hash.f32s(&pool_y);
    fresh.active.used = vec![false; pool];
    fresh.active.vtrack = Some(Curvature::new(CurvatureKind::Gram { v0: a.v0 }, d));
    let row_of = |i: usize| &pool_z[i * d..(i + 1) * d];
    let mut pr = resumed.unwrap_or(fresh);
    if pr.active.used.len() != pool {
        return Err(anyhow!("the checkpoint's pool has {} pairs: expected {pool}", pr.active.used.len()));
    }
    let (mut z, mut y) = (Vec::with_capacity(b * d), Vec::with_capacity(b));
    let rule = cell.config.rule.ok_or_else(|| anyhow::anyhow!("an active cell without its rule"))?;
    let fresh_strategy = match rule {
        // q and β resolved by the plan (ConfigPlan::for_cells)
        ActiveRule::Fresh(s) => Some(s),
        _ => None,
    };
    drive(steps, &mut pr, l, ctx, |s, last, pr, l| {
        let Progress { data, labels, select, active: super::state::ActiveProgress { used, vtrack }, ties, .. } =
            &mut *pr;
        if let Some(strategy) = &fresh_strategy {
            // a fresh prompt, its n responses ranked by the current θ, two of them sent to the
            // oracle (best-worst: the paper's practical rule, §5)
            let Source::Synthetic(env) = src else {
                return Err(anyhow!("active.rule {rule} needs responses to rank (a synthetic or generated env)"));
            };
            z.clear();
            y.clear();
            for _ in 0..b {
                let c = env.draw_context(data);
                let (_, pair) = choose(env, &c, strategy, l, select);
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
                    let scores: Vec<f64> = avail.iter().map(|&i| l.inv_norm(row_of(i))).collect();
                    let (top, t) = selection::top_k(&scores, b, select);
                    *ties += u64::from(t);
                    top.iter().map(|&j| avail[j]).collect()
                }
                ActiveRule::Random => rand::seq::index::sample(data, avail.len(), b).iter().map(|j| avail[j]).collect(),
                ActiveRule::Fresh(_) => unreachable!("handled above"),
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
                        ScoreNorm::H => cand.iter().map(|&i| l.inv_norm(row_of(i))).collect(),
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
        if l.due(cell.stream.eval_every, last) {
            let mut row = l.row(src);
            row.subopt_avg = src.truth().map(|env| env.subopt_of(&env.greedy(&l.averaged())));
            row.ties = *ties;
            pr.rows.push(row);
        }
        Ok(())
    })?;
    Ok(CellResult { rows: pr.rows, stream_hash: pr.hash.0, ..Default::default() })
}
