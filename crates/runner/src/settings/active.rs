//! Active data collection (paper Alg. 3): the learner picks the pairs to label, by a rule —
//! the 𝓗⁻¹-norm argmax over a pool (Eq. (4)), the authors' stream rule, random pool pairs, or
//! the practical best-vs-worst of a fresh prompt's responses (§5).

use super::checkpoint::{drive, CellCtx};
use super::choose;
use super::learner::Learner;
use super::state::Progress;
use super::Source;
use crate::plan::{ActiveCell, CellConfig};
use crate::rows::CellResult;
use crate::spec::{ActiveRule, ScoreNorm};
use crate::world::env::two_arms;
use anyhow::{anyhow, Result};
use estimators::{Curvature, CurvatureKind};
use rand::Rng;
use rand_chacha::ChaCha20Rng;
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
    let (pool_z, pool_y, pool_flipped) = draw_pool(src, a.pool, d, &mut fresh);
    let pool = pool_y.len();
    fresh.hash.f32s(&pool_z);
    fresh.hash.f32s(&pool_y);
    fresh.active.used = vec![false; pool];
    fresh.active.vtrack = Some(Curvature::new(CurvatureKind::Gram { v0: a.v0 }, d));
    let mut pr = resumed.unwrap_or(fresh);
    if pr.active.used.len() != pool {
        return Err(anyhow!("the checkpoint's pool has {} pairs: expected {pool}", pr.active.used.len()));
    }
    let (mut z, mut y) = (Vec::with_capacity(b * d), Vec::with_capacity(b));
    let rule = cell.config.rule.ok_or_else(|| anyhow!("an active cell without its rule"))?;
    drive(steps, &mut pr, l, ctx, |s, last, pr, l| {
        let Progress {
            data, labels, select, active: super::state::ActiveProgress { used, vtrack }, ties, flips, ..
        } = &mut *pr;
        z.clear();
        y.clear();
        if let ActiveRule::Fresh(strategy) = rule {
            // a fresh prompt, its n responses ranked by the current θ, two of them sent to the
            // oracle (best-worst: the paper's practical rule, §5); q and β resolved by the plan
            let Source::Synthetic(env) = src else {
                return Err(anyhow!("active.rule {rule} needs responses to rank (a synthetic or generated env)"));
            };
            for _ in 0..b {
                let c = env.draw_context(data);
                let (_, pair) = choose(env, &c, &strategy, l, select);
                *ties += u64::from(pair.ties);
                let zi = env.diff(&c, pair.first, pair.second);
                y.push(env.give(&c, pair.first, pair.second, &zi, labels.random(), flips));
                z.extend(zi);
            }
        } else {
            let vtrack = vtrack.as_mut().ok_or_else(|| anyhow!("the checkpoint has no V tracker"))?;
            let avail: Vec<usize> = (0..pool).filter(|&i| a.replacement || !used[i]).collect();
            if avail.len() < b {
                return Err(anyhow!("active: the pool ran out after {} steps", s - 1));
            }
            let pool = Pool { z: &pool_z, d, avail: &avail };
            let (chosen, t) = pool.pick(rule, a, b, (l, vtrack), (data, select));
            *ties += u64::from(t);
            for &i in &chosen {
                used[i] = true;
                z.extend_from_slice(pool.row(i));
                y.push(pool_y[i]);
                // a pool label is given (and its flip counted) when it is bought
                if let Some(&f) = pool_flipped.get(i) {
                    flips.given += 1;
                    flips.flipped += u64::from(f);
                }
            }
        }
        l.update(&z, &y)?;
        if l.due(cell.stream.eval_every, last) {
            let mut row = l.row(src);
            row.subopt_avg = src.truth().map(|env| env.subopt_of(&env.greedy(&l.averaged())));
            row.ties = *ties;
            row.flipped_labels = src.truth().and_then(|e| e.flipped(&pr.flips));
            pr.rows.push(row);
        }
        Ok(())
    })?;
    Ok(CellResult { rows: pr.rows, stream_hash: pr.hash.0, ..Default::default() })
}

/// A pool's z rows, labels, and whether a noisy labeller flipped each label (empty without one).
type PoolDraw<'a> = (Cow<'a, [f32]>, Cow<'a, [f32]>, Vec<bool>);

/// The pool of Alg. 3: on the bandit, `n` pairs drawn once per seed, each with its label drawn
/// once (a re-queried pair keeps it; a noisy labeller's flip of pair i comes from the pool's own
/// stream, and counts when the pair is bought); on pairs, every training row with the file's label.
fn draw_pool<'a>(src: &'a Source<'_>, n: usize, d: usize, fresh: &mut Progress) -> PoolDraw<'a> {
    match src {
        Source::Synthetic(env) => {
            let (mut pool_z, mut pool_y) = (Vec::with_capacity(n * d), Vec::with_capacity(n));
            let mut flipped = Vec::with_capacity(n);
            for i in 0..n {
                let c = env.draw_context(&mut fresh.data);
                let (a1, a2) = two_arms(&mut fresh.data, env.k);
                let z = env.diff(&c, a1, a2);
                let (y, f) = env.pool_label(&c, a1, a2, &z, fresh.labels.random(), i as u64);
                pool_y.push(y);
                flipped.push(f);
                pool_z.extend(z);
            }
            // without a noisy labeller nothing is counted
            if env.flip.is_none() {
                flipped.clear();
            }
            (pool_z.into(), pool_y.into(), flipped)
        }
        Source::Pairs(p) => (Cow::Borrowed(&p.train.z[..]), Cow::Borrowed(&p.train.y[..]), Vec::new()),
    }
}

/// The pool's rows (`d` per pair) and the ones still available.
struct Pool<'a> {
    z: &'a [f32],
    d: usize,
    avail: &'a [usize],
}

impl Pool<'_> {
    fn row(&self, i: usize) -> &[f32] {
        &self.z[i * self.d..(i + 1) * self.d]
    }

    /// The `b` pool rows a pool rule labels next, and the ties its ranking broke: Eq. (4)'s
    /// argmax of ‖z‖_{𝓗⁻¹}, uniform, or the authors' stream rule (the top `keep` of
    /// `candidates` random rows under the V- or 𝓗-norm). `(l, vtrack)`: the learner (its
    /// 𝓗-norm) and the V tracker; `(data, select)`: the cell's data and selection streams.
    fn pick(
        &self,
        rule: ActiveRule,
        a: &ActiveCell,
        b: usize,
        (l, vtrack): (&mut Learner, &mut Curvature),
        (data, select): (&mut ChaCha20Rng, &mut ChaCha20Rng),
    ) -> (Vec<usize>, u32) {
        let avail = self.avail;
        match rule {
            ActiveRule::PoolArgmax => {
                let scores: Vec<f64> = avail.iter().map(|&i| l.inv_norm(self.row(i))).collect();
                let (top, t) = selection::top_k(&scores, b, select);
                (top.iter().map(|&j| avail[j]).collect(), t)
            }
            ActiveRule::Random => {
                (rand::seq::index::sample(data, avail.len(), b).iter().map(|j| avail[j]).collect(), 0)
            }
            ActiveRule::Stream => {
                let m = a.candidates.min(avail.len());
                let cand: Vec<usize> =
                    rand::seq::index::sample(data, avail.len(), m).iter().map(|j| avail[j]).collect();
                let scores: Vec<f64> = match a.score_norm {
                    ScoreNorm::V => {
                        // the authors add every candidate to V before scoring
                        for &i in &cand {
                            vtrack.add(self.row(i), 1.0);
                        }
                        cand.iter().map(|&i| vtrack.inv_norm(self.row(i))).collect()
                    }
                    ScoreNorm::H => cand.iter().map(|&i| l.inv_norm(self.row(i))).collect(),
                };
                let (top, t) = selection::top_k(&scores, a.keep, select);
                (top.iter().map(|&j| cand[j]).collect(), t)
            }
            ActiveRule::Fresh(_) => unreachable!("a fresh-context rule draws no pool pairs"),
        }
    }
}
