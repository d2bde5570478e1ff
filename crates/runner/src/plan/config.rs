//! A config of the plan (one estimator with fixed hyper-parameters, and its strategy, rule or
//! deployed arm) and what it resolves for its cells: λ = "auto", q and β, the curvature source.

use crate::spec::estimator;
use crate::spec::*;
use estimators::{EstimatorConfig, Init, Kind};
use selection::Strategy;

/// One estimator with fixed hyper-parameters (and, in deploy, one strategy; in active, one rule).
#[derive(Clone, Debug)]
pub struct ConfigPlan {
    pub config_id: usize,
    pub kind: Kind,
    pub cfg: EstimatorConfig,
    pub init: Init,
    /// Every hyper-parameter (typed as TOML writes it), in the order of the kind's table;
    /// `swept` names the ones the spec varied.
    pub hparams: Vec<(String, toml::Value)>,
    /// λ = "auto": the estimator takes the data's λ ([`ConfigPlan::cfg_for`]); `cfg`'s λ is the
    /// placeholder validation ran with.
    pub lambda_auto: bool,
    pub swept: Vec<String>,
    /// Deploy: the pair-selection strategy. A ucb width of "theory" is resolved by the cell,
    /// which knows d and T (they may come from the data).
    pub strategy: Option<Strategy>,
    /// Active: the selection rule of this config.
    pub rule: Option<ActiveRule>,
    /// Deploy on generated responses: the deployed policy, resolved (best-of-n, fixed, or one
    /// that learns with its update's config: rloo, dpo).
    pub arm: Option<ArmPlan>,
    /// Index of the expanded estimator config (shared by the strategies of a deploy run).
    pub estimator_index: usize,
    /// Index of the `[[estimator]]` table it was expanded from.
    pub table: usize,
    /// Index of the strategy in `deploy.strategies` or of the rule in `active.rule` (else 0).
    pub strategy_index: usize,
    /// The estimator's part of the label ([`estimator_label`]): `name`, or the kind with the
    /// hyper-parameters that differ from its defaults or that the table sweeps.
    pub estimator_label: String,
    /// The estimator's part, then the arm's: e.g. `sgd lr=0.1` or `omd-exact / ucb`.
    pub label: String,
    /// Passive: β of the pessimistic policy, "theory" resolved from d and T — None until the
    /// config is resolved for its cells ([`ConfigPlan::for_cells`]).
    pub pessimism_beta: Option<f64>,
}

/// A deployed policy resolved for its cells: which arm, and for a learning arm the reward it
/// reads, its update (the mini-batch seed is the cell's: set by the cell) and its
/// [`Learning`] (adapter life, rollouts).
#[derive(Clone, Debug, PartialEq)]
pub enum ArmPlan {
    BestOfN,
    Fixed,
    Rloo {
        reward: RewardSource,
        update: ::policy::train::RlooConfig,
        learning: Learning,
    },
    /// `pairs`: the strategy's or two fresh rollouts; `parameters`: adapters or every weight;
    /// `warm_start`: DPO on a dataset's pairs before the first chunk.
    Dpo {
        update: ::policy::train::DpoConfig,
        pairs: crate::spec::policy::DpoPairs,
        parameters: crate::spec::policy::DpoParameters,
        warm_start: Option<Box<crate::spec::policy::WarmStart>>,
        learning: Learning,
    },
    /// The critic's learning rate and head.
    Ppo {
        reward: RewardSource,
        update: ::policy::train::PpoConfig,
        critic: CriticPlan,
        learning: Learning,
    },
    Grpo {
        reward: RewardSource,
        update: ::policy::train::GrpoConfig,
        learning: Learning,
    },
    ReinforcePp {
        reward: RewardSource,
        update: ::policy::train::ReinforcePpConfig,
        learning: Learning,
    },
}

/// What every learning arm resolves once: its adapter's life across chunks and the rollouts its
/// update sees.
#[derive(Clone, Debug, PartialEq)]
pub struct Learning {
    pub adapter: crate::spec::AdapterLife,
    pub rollouts: RolloutPlan,
}

/// A learning arm's rollouts per chunk: `per_prompt` sequences (0: it reads the strategy's
/// pairs, no rollouts) on the first `prompts` of the chunk's prompts (None: all), from the
/// chunk's samples or fresh.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RolloutPlan {
    pub per_prompt: usize,
    pub prompts: Option<usize>,
    pub source: crate::spec::policy::RolloutSource,
}

/// A PPO critic's resolved keys.
#[derive(Clone, Debug, PartialEq)]
pub struct CriticPlan {
    pub lr: f64,
    pub head: crate::spec::CriticHead,
}

impl ArmPlan {
    /// The arms of `p` under `spec`'s `[policy]`: a learning arm one per adapter life of
    /// `policy.adapter`, rloo and ppo also one per reward source.
    pub(super) fn of(p: DeployPolicy, spec: &Spec) -> Vec<ArmPlan> {
        use crate::spec::policy::DpoPairs;
        let default = PolicySpec::default();
        let ps = spec.policy.as_ref().unwrap_or(&default);
        let n = spec.generate.as_ref().map_or(0, |g| g.n);
        let learning = |per_prompt: usize| -> Vec<Learning> {
            let rollouts = RolloutPlan { per_prompt, prompts: ps.prompts_per_update, source: ps.rollouts };
            ps.adapter.0.iter().map(|&adapter| Learning { adapter, rollouts }).collect()
        };
        let mut out = Vec::new();
        match p {
            DeployPolicy::BestOfN => out.push(ArmPlan::BestOfN),
            DeployPolicy::Fixed => out.push(ArmPlan::Fixed),
            DeployPolicy::Rloo => {
                for &reward in &ps.rloo.reward.0 {
                    for learning in learning(ps.rloo.rollouts_per_prompt.unwrap_or(n)) {
                        out.push(ArmPlan::Rloo { reward, update: ps.rloo_update(), learning });
                    }
                }
            }
            DeployPolicy::Dpo => {
                let per_prompt = if ps.dpo.pairs == DpoPairs::FreshTwo { 2 } else { 0 };
                for learning in learning(per_prompt) {
                    out.push(ArmPlan::Dpo {
                        update: ps.dpo_update(),
                        pairs: ps.dpo.pairs,
                        parameters: ps.dpo.parameters,
                        warm_start: ps.dpo.warm_start.clone().map(Box::new),
                        learning,
                    });
                }
            }
            DeployPolicy::Ppo => {
                for &reward in &ps.ppo.reward.0 {
                    // θ for the learned reward, 0 for the controls (unless written)
                    let critic = CriticPlan { lr: ps.ppo.critic_lr, head: ps.ppo.critic_head_for(reward) };
                    for learning in learning(ps.ppo.rollouts_per_prompt.unwrap_or(n)) {
                        out.push(ArmPlan::Ppo { reward, update: ps.ppo_update(), critic: critic.clone(), learning });
                    }
                }
            }
            DeployPolicy::Grpo => {
                for &reward in &ps.grpo.reward.0 {
                    for learning in learning(ps.grpo.rollouts_per_prompt.unwrap_or(n)) {
                        out.push(ArmPlan::Grpo { reward, update: ps.grpo_update(), learning });
                    }
                }
            }
            DeployPolicy::ReinforcePp => {
                for &reward in &ps.reinforce_pp.reward.0 {
                    for learning in learning(ps.reinforce_pp.rollouts_per_prompt.unwrap_or(n)) {
                        out.push(ArmPlan::ReinforcePp { reward, update: ps.reinforce_pp_update(), learning });
                    }
                }
            }
        }
        out
    }

    pub fn kind(&self) -> DeployPolicy {
        match self {
            ArmPlan::BestOfN => DeployPolicy::BestOfN,
            ArmPlan::Fixed => DeployPolicy::Fixed,
            ArmPlan::Rloo { .. } => DeployPolicy::Rloo,
            ArmPlan::Dpo { .. } => DeployPolicy::Dpo,
            ArmPlan::Ppo { .. } => DeployPolicy::Ppo,
            ArmPlan::Grpo { .. } => DeployPolicy::Grpo,
            ArmPlan::ReinforcePp { .. } => DeployPolicy::ReinforcePp,
        }
    }

    /// The reward the arm's update reads; `learned` for arms that read θ (best-of-n picks by
    /// it, dpo learns from the pairs it picks) or nothing (fixed).
    pub fn reward(&self) -> RewardSource {
        match self {
            ArmPlan::Rloo { reward, .. }
            | ArmPlan::Ppo { reward, .. }
            | ArmPlan::Grpo { reward, .. }
            | ArmPlan::ReinforcePp { reward, .. } => *reward,
            ArmPlan::BestOfN | ArmPlan::Fixed | ArmPlan::Dpo { .. } => RewardSource::Learned,
        }
    }

    /// A learning arm's adapter life and rollouts (None for an arm that does not learn).
    pub fn learning(&self) -> Option<&Learning> {
        match self {
            ArmPlan::Rloo { learning, .. }
            | ArmPlan::Dpo { learning, .. }
            | ArmPlan::Ppo { learning, .. }
            | ArmPlan::Grpo { learning, .. }
            | ArmPlan::ReinforcePp { learning, .. } => Some(learning),
            ArmPlan::BestOfN | ArmPlan::Fixed => None,
        }
    }

    /// Whether it trains every weight of the policy (dpo with parameters = "full") rather than
    /// adapters.
    pub fn full_parameters(&self) -> bool {
        matches!(self, ArmPlan::Dpo { parameters: crate::spec::policy::DpoParameters::Full, .. })
    }

    /// The items (sequences, or pairs for dpo) its update sees per prompt: the schedule's
    /// window over a run counts them.
    pub fn items_per_prompt(&self) -> usize {
        match self {
            ArmPlan::Rloo { learning, .. }
            | ArmPlan::Ppo { learning, .. }
            | ArmPlan::Grpo { learning, .. }
            | ArmPlan::ReinforcePp { learning, .. } => learning.rollouts.per_prompt,
            ArmPlan::Dpo { .. } => 1,
            ArmPlan::BestOfN | ArmPlan::Fixed => 0,
        }
    }
}

impl ConfigPlan {
    /// A hyper-parameter as labels and cells.parquet show it.
    pub fn hparam(&self, key: &str) -> Option<String> {
        self.hparams.iter().find(|(k, _)| k == key).map(|(_, v)| estimator::show(v))
    }

    /// λ = "auto" of this config resolved from the data (`spec.data_scale`, filled by the world).
    pub fn auto_lambda(&self, spec: &Spec) -> Option<f64> {
        self.lambda_auto.then(|| spec.data_scale.unwrap_or_default().auto_lambda())
    }

    /// This config resolved once for its cells against `spec`, the spec completed with the
    /// data's facts ([`resolve`]): the estimator's λ = "auto" (the data's λ), a deploy
    /// strategy's or an active fresh rule's q and β (a width of "theory": √d·log(T/δ) from d
    /// and T), the pessimistic policy's β. The settings read these and call no resolver.
    pub fn for_cells(&self, spec: &Spec) -> ConfigPlan {
        let theory = |delta: f64| theory_beta(spec.env.dim, spec.stream.samples, delta);
        let (d, a) = (&spec.deploy, &spec.active);
        let mut c = self.clone();
        c.cfg = self.cfg_for(spec);
        if spec.setting == Setting::Deploy {
            c.strategy = self.strategy.map(|s| parametrize(s, d.q, d.beta, theory(d.delta)));
        }
        if let Some(ActiveRule::Fresh(s)) = self.rule {
            c.rule = Some(ActiveRule::Fresh(parametrize(s, a.q, a.beta, theory(a.delta))));
        }
        c.pessimism_beta = Some(match spec.passive.beta {
            Beta::Theory => theory(spec.passive.delta),
            Beta::Value(v) => v,
        });
        c
    }

    /// The estimator's config with λ = "auto" resolved: what a cell builds.
    pub fn cfg_for(&self, spec: &Spec) -> EstimatorConfig {
        let mut cfg = self.cfg;
        if let (Some(l), EstimatorConfig::OmdExact(o)) = (self.auto_lambda(spec), &mut cfg) {
            o.lambda = l;
        }
        cfg
    }

    /// The λ of 𝓗_1 = λI this config's estimator uses, if it has one.
    pub fn lambda(&self, spec: &Spec) -> Option<f64> {
        match self.cfg_for(spec) {
            EstimatorConfig::OmdExact(o) => Some(o.lambda),
            _ => None,
        }
    }
}

/// Where a cell's uncertainty ‖x‖_{𝓗_t⁻¹} comes from (`[curvature]`), and its tracker's λ.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CurvatureChoice {
    /// the estimator's own 𝓗_t (omd-exact), not the tracker
    pub estimator: bool,
    /// the tracker's 𝓗_1 = λI: `curvature.lambda`, else the estimator's λ, else 1
    pub tracker_lambda: f64,
}

impl CurvatureChoice {
    pub fn of(spec: &Spec, c: &ConfigPlan) -> CurvatureChoice {
        let own = c.kind.keeps_curvature();
        let estimator = match spec.curvature.source {
            CurvatureSource::Auto => own,
            CurvatureSource::Estimator => true,
            CurvatureSource::Tracker => false,
        };
        let est_lambda = if own { c.lambda(spec) } else { None };
        let auto = spec.data_scale.unwrap_or_default().auto_lambda();
        let set = spec.curvature.lambda.map(|l| l.or(auto));
        CurvatureChoice { estimator, tracker_lambda: set.or(est_lambda).unwrap_or(1.0) }
    }
}

/// Whether a cell of `c` keeps the 𝓗_t tracker: for ‖θ − θ*‖_𝓗 when the truth is known (the
/// synthetic and generated bandits), or as the uncertainty of an estimator without its own 𝓗_t
/// in the settings that score uncertainty.
pub fn needs_tracker(spec: &Spec, c: &ConfigPlan) -> bool {
    let truth = matches!(spec.env.kind, EnvKind::Synthetic | EnvKind::Generated);
    let scores = spec.setting != Setting::Passive;
    truth || (scores && !CurvatureChoice::of(spec, c).estimator)
}

/// A selection strategy with its parameters: best-quantile's q, ucb's β (`theory` stands for
/// β = "theory", which needs d and T: the plan validates with a placeholder, the cell resolves
/// it with [`theory_beta`]). Deploy strategies and fresh-context active rules share it.
pub fn parametrize(s: Strategy, q: f64, beta: Beta, theory: f64) -> Strategy {
    match s {
        Strategy::BestQuantile { .. } => Strategy::BestQuantile { q },
        Strategy::Ucb { .. } => Strategy::Ucb {
            beta: match beta {
                Beta::Theory => theory,
                Beta::Value(b) => b,
            },
        },
        other => other,
    }
}

/// The arms a strategy chooses among: the generated samples per prompt, else the bandit's K.
pub(super) fn arms_per_context(spec: &Spec) -> usize {
    spec.generate.as_ref().filter(|_| spec.env.kind == EnvKind::Generated).map_or(spec.env.arms, |g| g.n)
}

/// β = "theory": √d · log(T/δ), the order of β̃_T in Lemma 1 (the constant is not given).
pub fn theory_beta(d: usize, t: u64, delta: f64) -> f64 {
    (d as f64).sqrt() * ((t.max(2) as f64) / delta).ln()
}
