//! What a cell reads, resolved once: [`CellConfig`], built by the world from the spec completed
//! with the data's facts ([`super::resolve`]) and one config. The settings take it and nothing
//! else of the spec: every word ("auto", "theory", a strategy's name) is a value here, every
//! default applied (`deploy.chunks` of 0 is one chunk).

use super::config::{needs_tracker, ConfigPlan, CurvatureChoice};
use crate::spec::{
    CurvaturePoint, EnvSpec, Order, Pessimism, PessimismReference, RewardSpec, ScoreNorm, Setting, Spec, StreamSpec,
};

/// One config resolved for its cells (the seed is the cell's).
#[derive(Clone, Debug)]
pub struct CellConfig {
    pub setting: Setting,
    /// Every random stream derives from (master_seed, the cell's seed, a component).
    pub master_seed: u64,
    /// d of the pairs: `env.dim` or the data's.
    pub d: usize,
    /// T, the batch, the evaluation cadence, the ranks (no word among them).
    pub stream: StreamSpec,
    /// The synthetic bandit a cell draws (and a bank's held-out pairs, `eval_pairs`), d resolved.
    pub env: EnvSpec,
    pub passive: PassiveCell,
    pub deploy: DeployCell,
    pub active: ActiveCell,
    pub curvature: CurvatureCell,
    /// `[reward] update = "lora" | "full"`: the reward model's table (no word among its keys).
    pub reward: Option<RewardSpec>,
    /// `[generate] policy`: the base model the policy's adapters name.
    pub base_policy: Option<String>,
    /// The estimator, its strategy or rule and the deployed policy, resolved
    /// ([`ConfigPlan::for_cells`]).
    pub config: ConfigPlan,
}

/// What a passive cell reads of `[passive]` (the pessimistic policy's β is in the config).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PassiveCell {
    pub pessimism: Pessimism,
    pub reference: PessimismReference,
}

/// What a deployment cell reads of `[deploy]` (its strategy is in the config).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeployCell {
    /// At least 1.
    pub chunks: usize,
    pub prompt_order: Order,
    pub reset_each_chunk: bool,
}

/// Chunk c of `chunks` over p prompts: positions [c·p/chunks, (c+1)·p/chunks) of the order
/// (the chunked deployment's chunks, which the policy's and the reward model's step counts
/// follow too).
pub fn chunk_range(c: usize, p: usize, chunks: usize) -> std::ops::Range<usize> {
    c * p / chunks..(c + 1) * p / chunks
}

/// What an active cell reads of `[active]` (its rule, q and β are in the config).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ActiveCell {
    pub pool: usize,
    pub replacement: bool,
    pub candidates: usize,
    pub keep: usize,
    pub score_norm: ScoreNorm,
    pub v0: f64,
}

/// Where the cell's uncertainty comes from, and whether it keeps a tracker.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CurvatureCell {
    pub choice: CurvatureChoice,
    pub point: CurvaturePoint,
    /// The cell keeps an 𝓗_t tracker ([`needs_tracker`]).
    pub tracker: bool,
}

impl CellConfig {
    /// `config` resolved for its cells against `spec`, the spec completed with the data's facts.
    pub fn of(spec: &Spec, config: &ConfigPlan) -> CellConfig {
        let mut config = config.for_cells(spec);
        if spec.setting == Setting::Active {
            // one rule per config: the plan's, else the table's first
            config.rule = config.rule.or(spec.active.rule.0.first().copied());
        }
        let (d, a) = (&spec.deploy, &spec.active);
        CellConfig {
            setting: spec.setting,
            master_seed: spec.master_seed,
            d: spec.env.dim,
            stream: spec.stream.clone(),
            env: spec.env.clone(),
            passive: PassiveCell { pessimism: spec.passive.pessimism, reference: spec.passive.pessimism_reference },
            deploy: DeployCell {
                chunks: d.chunks.max(1),
                prompt_order: d.prompt_order,
                reset_each_chunk: d.reset_each_chunk,
            },
            active: ActiveCell {
                pool: a.pool,
                replacement: a.replacement,
                candidates: a.candidates,
                keep: a.keep,
                score_norm: a.score_norm,
                v0: a.v0,
            },
            curvature: CurvatureCell {
                choice: CurvatureChoice::of(spec, &config),
                point: spec.curvature.point,
                tracker: needs_tracker(spec, &config),
            },
            reward: spec.reward.clone(),
            base_policy: spec.generate.as_ref().map(|g| g.policy.clone()),
            config,
        }
    }

    /// The λ of 𝓗_1 = λI the estimator uses, if it has one ("auto" resolved).
    pub fn lambda(&self) -> Option<f64> {
        match self.config.cfg {
            estimators::EstimatorConfig::OmdExact(o) => Some(o.lambda),
            _ => None,
        }
    }

    /// As cells.parquet's `curvature` column writes it: whose 𝓗_t scores uncertainty.
    pub fn curvature_text(&self) -> String {
        if self.curvature.choice.estimator {
            let l = self.lambda().map_or(String::new(), |l| format!(", λ = {l}"));
            format!("estimator ({} 𝓗_t{l})", self.config.kind)
        } else {
            format!("tracker (λ = {})", self.curvature.choice.tracker_lambda)
        }
    }

    /// The estimator's updates per head: T / (batch × ranks).
    pub fn planned_steps(&self) -> u64 {
        self.stream.samples / (self.stream.batch_size * self.stream.ranks.max(1)) as u64
    }
}
