//! The three settings of paper §5, each usable with any estimator: passive (Alg. 2), active
//! (Alg. 3) and deployment (Alg. 4). A cell is one estimator config × (deploy: one strategy;
//! active: one rule) × one seed; it draws its pairs from a [`Source`] made from the world,
//! and returns its rows (crate::rows) and θ.

mod active;
mod arms;
mod checkpoint;
mod clock;
mod deploy;
mod deploy_rm;
mod learner;
mod live;
mod online;
mod passive;
mod passive_rm;
pub mod pessimism;
mod rm_state;
mod state;
mod window;

pub use checkpoint::{CellCtx, CellSaver, CellState};
pub use learner::Learner;
pub use live::Live;

use crate::plan::CellConfig;
use crate::rows::CellResult;
use crate::spec::Setting;
use crate::world::env::{dot, Context, Env};
use crate::world::pairs::PairData;
use crate::world::World;
use anyhow::{anyhow, Result};
use rand_chacha::ChaCha20Rng;
use selection::Strategy;

/// Where a cell draws its pairs from: an environment with arms per context (synthetic, or the
/// generated responses), or a fixed set of labelled pairs.
pub(crate) enum Source<'a> {
    Synthetic(Env),
    Pairs(&'a PairData),
}

impl Source<'_> {
    /// Held-out z rows and labels.
    pub(crate) fn eval(&self) -> (&[f32], &[f32]) {
        match self {
            Source::Synthetic(env) => (&env.eval_z, &env.eval_y),
            Source::Pairs(p) => (&p.eval.z, &p.eval.y),
        }
    }
    /// The environment with θ*, when there is one.
    pub(crate) fn truth(&self) -> Option<&Env> {
        match self {
            Source::Synthetic(env) => Some(env),
            Source::Pairs(_) => None,
        }
    }
}

/// The learned rewards φ(x,a)ᵀθ of context `c`'s arms and the two arms `strategy` picks from
/// them; ucb's bonus of an arm a is ‖φ(x,a) − φ(x,first)‖_{𝓗⁻¹} with `first` the arm ranked
/// first (paper Eq. (6)); the ensemble strategies read every head's rewards φ(x,a)ᵀθ_k (the
/// plan admits them only with an ensemble). Deployment and the fresh-context active rules
/// share it.
pub(crate) fn choose(
    env: &Env,
    c: &Context,
    strategy: &Strategy,
    l: &mut Learner,
    select: &mut ChaCha20Rng,
) -> (Vec<f64>, selection::Pair) {
    let est: Vec<f64> = (0..env.k).map(|a| dot(env.arm(c, a), l.theta())).collect();
    if strategy.needs_ensemble() {
        let heads = l.heads().unwrap_or_else(|| panic!("{strategy} without an ensemble (the plan refuses it)"));
        let d = l.theta().len();
        let k = heads.len() / d;
        let rewards: Vec<f64> =
            heads.chunks_exact(d).flat_map(|h| (0..env.k).map(move |a| dot(env.arm(c, a), h))).collect();
        return (est, selection::select_ensemble(strategy, &rewards, k, select));
    }
    let bonus: Option<Vec<f64>> = strategy.needs_bonus().then(|| {
        let first = selection::first_arm(&est, &*select);
        (0..env.k).map(|a| l.inv_norm(&env.diff(c, a, first))).collect()
    });
    let pair = selection::select_pair(strategy, &est, bonus.as_deref(), select);
    (est, pair)
}

/// Runs one cell without checkpoints.
pub fn run_cell(world: &World, cell: &CellConfig, seed: u32) -> Result<CellResult> {
    run_cell_with(world, cell, seed, &mut CellCtx::none())
}

/// Runs one cell, checkpointing through `ctx` and resuming from its state when it has one.
pub fn run_cell_with(world: &World, cell: &CellConfig, seed: u32, ctx: &mut CellCtx) -> Result<CellResult> {
    let src = match (&world.data, &world.generated) {
        (Some(p), _) => Source::Pairs(p),
        (None, Some(g)) => Source::Synthetic(Env::from_bank(&g.bank, cell.env.eval_pairs, cell.master_seed, seed)),
        (None, None) => Source::Synthetic(Env::new(&cell.env, cell.master_seed, seed)),
    };
    let (mut learners, resumed) = match ctx.resume.take() {
        Some(st) => {
            let heads = if cell.setting == Setting::Passive { cell.stream.ranks.max(1) } else { 1 };
            let (n, dims) = (st.learners.len(), st.learners.iter().map(|l| l.dims()).collect::<Vec<_>>());
            if n != heads || dims.iter().any(|&(d, est)| d != cell.d || est != d) {
                return Err(anyhow!(
                    "the checkpoint holds {n} head(s) of dimension {:?}: expected {heads} of dimension {}",
                    dims.iter().map(|d| d.0).collect::<Vec<_>>(),
                    cell.d
                ));
            }
            ctx.saver.wall_before = st.wall_s;
            (st.learners, Some(st.progress))
        }
        None => (vec![Learner::new(cell, seed)?], None),
    };
    // the live curves start afresh, or again from what the checkpoint holds
    ctx.live.start(resumed.as_ref().map(|pr| live::Snapshot::of(&learners[0], pr)));
    let mut learner = learners.remove(0);
    let mut out = match (cell.setting, &src) {
        (Setting::Passive, Source::Pairs(_)) if cell.stream.ranks > 1 => {
            passive::passive_ranks(cell, &src, &mut learner, learners, seed, ctx, resumed)?
        }
        (Setting::Passive, Source::Pairs(p)) if world.reward.is_some() => {
            let base = world.reward.as_deref().expect("checked");
            passive_rm::passive_features(cell, p, base, &mut learner, seed, ctx, resumed)?
        }
        (Setting::Passive, _) => passive::passive(cell, &src, &mut learner, seed, ctx, resumed)?,
        (Setting::Active, _) => active::active(cell, &src, &mut learner, seed, ctx, resumed)?,
        (Setting::Deploy, Source::Synthetic(env)) if world.generated.is_some() => {
            let g = world.generated.as_deref().expect("checked");
            let (online, reward) = (world.online.as_deref(), world.reward.as_deref());
            let world = deploy::ChunkedWorld { env, g, online, reward };
            deploy::deploy_chunked(cell, world, &mut learner, seed, ctx, resumed)?
        }
        (Setting::Deploy, Source::Synthetic(env)) => deploy::deploy(cell, env, &mut learner, seed, ctx, resumed)?,
        (Setting::Deploy, Source::Pairs(_)) => return Err(anyhow!("deploy needs the synthetic environment")),
    };
    learner.finish(&mut out);
    ctx.live.finish(&out);
    Ok(out)
}
