//! A parsed spec → a validated plan, without reading anything but the spec: no data, no model,
//! no terminal. Every cross-field check that the spec alone decides lives here (the checks that
//! need data live in `world`). Estimator tables are expanded over their swept keys into configs;
//! configs × (deploy: strategies; active: rules) × seeds are the cells. `onepass run --dry-run`
//! stops here.

mod cell;
pub mod record;

pub use cell::{chunk_range, ActiveCell, CellConfig, CurvatureCell, DeployCell, PassiveCell};

use crate::spec::estimator::{self, Bounds};
use crate::spec::*;
use estimators::{EstimatorConfig, EstimatorError, Init, Kind, Setup};
use selection::Strategy;
use std::path::{Path, PathBuf};

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
    fn of(p: DeployPolicy, spec: &Spec) -> Vec<ArmPlan> {
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

#[derive(Clone, Debug)]
pub struct CellPlan {
    pub cell_id: String,
    pub config: usize,
    pub seed: u32,
}

#[derive(Clone, Debug)]
pub struct Plan {
    pub name: String,
    /// The spec file and its text after `--set` (errors of later stages name lines in it).
    pub file: PathBuf,
    pub text: String,
    /// The `--set key=value` arguments applied to the file.
    pub overrides: Vec<String>,
    pub spec: Spec,
    /// `[policy]` with its defaults when an arm learns (None otherwise): the table the learning
    /// cells read and the resolved spec shows, resolved here so the parsed spec stays as written.
    pub policy: Option<PolicySpec>,
    pub configs: Vec<ConfigPlan>,
    pub cells: Vec<CellPlan>,
    /// What the plan ignored, a line each (`load_plan` prints them): `[policy]` tables of arms
    /// that deploy.policy does not deploy.
    pub warnings: Vec<String>,
}

/// Builds errors that name the spec file, the dotted key and its line.
#[derive(Clone, Copy)]
pub struct Locator<'a> {
    pub file: &'a Path,
    pub text: &'a str,
    /// The `--set key=value` arguments (errors about their keys cite them).
    pub overrides: &'a [String],
}

impl Locator<'_> {
    /// An error at `path` (e.g. ["estimator", "1", "lr"] → `estimator[1].lr`).
    pub fn err(&self, path: &[&str], message: String) -> SpecError {
        let p: Vec<String> = path.iter().map(|s| s.to_string()).collect();
        let key = path
            .iter()
            .enumerate()
            .map(|(i, s)| match (i, s.parse::<usize>().is_ok()) {
                (0, _) => s.to_string(),
                (_, true) => format!("[{s}]"),
                (_, false) => format!(".{s}"),
            })
            .collect::<String>();
        let line = locate(self.text, &p);
        // an error about a key a `--set` wrote cites that argument: the last of its key, the
        // one in force
        let set = self.overrides.iter().rev().find(|o| {
            let segs: Vec<&str> = override_key(o).split('.').collect();
            !segs.is_empty() && (path.starts_with(&segs) || (segs.starts_with(path) && !path.is_empty()))
        });
        match set {
            Some(o) => SpecError { file: self.file.to_path_buf(), key, line: None, message, set: Some(o.clone()) },
            None => SpecError { file: self.file.to_path_buf(), key, line, message, set: None },
        }
    }

    /// An error `why` at the first of the `env.<names>` that the spec writes.
    pub fn env_keys_refused(&self, names: &[&str], why: &str) -> Result<(), SpecError> {
        match names.iter().find(|k| self.written(&["env", k])) {
            Some(k) => Err(self.err(&["env", k], why.into())),
            None => Ok(()),
        }
    }

    /// Whether the key at `path` of plain tables is written in the spec.
    pub fn written(&self, path: &[&str]) -> bool {
        is_written(self.text, path)
    }
}

impl Plan {
    pub fn keys(&self) -> Locator<'_> {
        Locator { file: &self.file, text: &self.text, overrides: &self.overrides }
    }

    /// The run directory's name before its time stamp: the setting, then the spec's `name` (or
    /// file stem) — `deploy-synthetic`, so that the passive, active and deploy runs of one data
    /// set are told apart — unless the name already begins with the setting and a `-`.
    pub fn dir_name(&self) -> String {
        let setting = self.spec.setting.as_str();
        if self.name.strip_prefix(setting).is_some_and(|rest| rest.starts_with('-')) {
            self.name.clone()
        } else {
            format!("{setting}-{}", self.name)
        }
    }

    /// `spec` (the plan's, or the world's with what the data told) with every default filled and
    /// every sweep expanded: one `[[estimator]]` per config.
    pub fn resolved(&self, spec: &Spec) -> Spec {
        let mut s = spec.clone();
        s.name = Some(self.name.clone());
        s.policy = self.policy.clone();
        // the curvature products a learning reward model takes, named
        if let Some(r) = s.reward.as_mut().filter(|r| r.update != crate::spec::reward::RewardUpdate::Head) {
            r.hvp = Some(r.hvp_scheme());
        }
        s.estimators = self
            .configs
            .iter()
            .filter(|c| c.strategy_index == 0)
            .map(|c| {
                let mut t = toml::Table::new();
                t.insert("kind".into(), c.kind.to_string().into());
                match c.init {
                    Init::Zero => {
                        t.insert("init".into(), "zero".into());
                    }
                    Init::Normal { std } => {
                        t.insert("init".into(), "normal".into());
                        if let Some(s) = std {
                            t.insert("init_std".into(), s.into());
                        }
                    }
                }
                t.extend(c.hparams.iter().cloned());
                // the label this table alone would give differs (a swept default, "theory",
                // a `name`): the resolved spec names it, so that it runs to the same labels
                let own = estimator::read(&t).map(|(init, es)| estimator_label(None, &es, false, init, &[]));
                if own.as_deref().ok() != Some(c.estimator_label.as_str()) {
                    t.insert("name".into(), c.estimator_label.clone().into());
                }
                t
            })
            .collect();
        s
    }
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
fn arms_per_context(spec: &Spec) -> usize {
    spec.generate.as_ref().filter(|_| spec.env.kind == EnvKind::Generated).map_or(spec.env.arms, |g| g.n)
}

/// β = "theory": √d · log(T/δ), the order of β̃_T in Lemma 1 (the constant is not given).
pub fn theory_beta(d: usize, t: u64, delta: f64) -> f64 {
    (d as f64).sqrt() * ((t.max(2) as f64) / delta).ln()
}

/// Validates `spec` (read from `file`, whose text after the `overrides` is `text`) into a plan.
/// What the data says that a spec need not (the world's report, `world::build`): the features'
/// dimension, a bank's responses per prompt and prompts, a deployment's pairs, the data's scale.
#[derive(Clone, Debug, PartialEq)]
pub struct DataFacts {
    /// d (the spec's env.dim for the synthetic bandit).
    pub dim: usize,
    /// Generated responses: (responses per prompt, prompts).
    pub bank: Option<(usize, usize)>,
    /// Deploy on generated responses: one labelled pair per prompt.
    pub samples: Option<u64>,
    pub data_scale: DataScale,
}

/// The spec the cells run and `spec.resolved.toml` records: `spec` as written, completed with
/// `facts` — env.dim, env.arms and env.contexts, stream.samples, data_scale. The one place a
/// spec gains values after parsing (the world reads the spec and reports; it never edits it).
pub fn resolve(spec: &Spec, facts: &DataFacts) -> Spec {
    let mut s = spec.clone();
    s.env.dim = facts.dim;
    if let Some((arms, contexts)) = facts.bank {
        (s.env.arms, s.env.contexts) = (arms, contexts);
    }
    if let Some(n) = facts.samples {
        s.stream.samples = n;
    }
    s.data_scale = Some(facts.data_scale);
    s
}

pub fn build(spec: Spec, file: &Path, text: &str, overrides: &[String]) -> Result<Plan, SpecError> {
    let keys = Locator { file, text, overrides };
    let name = run_name(&spec, file, keys)?;
    check_env_kind(&spec, keys)?;
    check_ranges(&spec, keys)?;
    check_setting(&spec, keys)?;
    let mut warnings = Vec::new();
    let policy = check_policy(&spec, keys, &mut warnings)?;
    let arms = arms(&spec, keys)?;
    let configs = configs(&spec, keys, &arms)?;
    check_reward(&spec, keys, &configs)?;
    check_backend(&spec, keys, &configs)?;
    check_labels(&configs, keys)?;
    if spec.curvature.source == CurvatureSource::Estimator {
        if let Some(c) = configs.iter().find(|c| !c.kind.keeps_curvature()) {
            return Err(keys.err(
                &["curvature", "source"],
                format!(
                    "`estimator`: {} keeps no 𝓗_t of its own (only omd-exact does); use \"auto\" (the estimator's where it has one, else the tracker) or \"tracker\"",
                    c.label
                ),
            ));
        }
    }
    let cells = configs
        .iter()
        .flat_map(|c| (0..spec.seeds).map(move |s| (c.config_id, s)))
        .enumerate()
        .map(|(i, (config, seed))| CellPlan { cell_id: format!("c{i:04}"), config, seed })
        .collect();
    Ok(Plan {
        name,
        file: file.to_path_buf(),
        text: text.to_string(),
        overrides: overrides.to_vec(),
        spec,
        policy,
        configs,
        cells,
        warnings,
    })
}

fn run_name(spec: &Spec, file: &Path, keys: Locator<'_>) -> Result<String, SpecError> {
    let name = spec
        .name
        .clone()
        .unwrap_or_else(|| file.file_stem().map_or("run".into(), |s| s.to_string_lossy().into_owned()));
    if !name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) || name.is_empty() {
        return Err(keys.err(
            &["name"],
            format!("`{name}`: expected letters, digits, `-`, `_` or `.` (it names the run directory)"),
        ));
    }
    Ok(name)
}

/// Which keys and tables apply to which `env.kind`, and the checks of each kind's tables that
/// need no file.
fn check_env_kind(spec: &Spec, keys: Locator<'_>) -> Result<(), SpecError> {
    const SYNTHETIC: [&str; 6] = ["contexts", "fresh_contexts", "arms", "features", "feature_norm", "theta_norm"];
    let labelled_pairs = |what: &str| {
        keys.err(
            &["env", "kind"],
            format!(
                "deploy needs several arms per context; kind = \"{what}\" holds labelled pairs (use passive or active)"
            ),
        )
    };
    match spec.env.kind {
        EnvKind::Synthetic => {
            keys.env_keys_refused(&["path", "eval_path", "order", "order_path"], "applies to kind = \"features\" only")?
        }
        EnvKind::Features => {
            keys.env_keys_refused(&SYNTHETIC, "applies to kind = \"synthetic\" only")?;
            if spec.setting == Setting::Deploy {
                return Err(labelled_pairs("features"));
            }
            if spec.env.path.is_none() {
                return Err(keys.err(&["env", "path"], "required when kind = \"features\"".into()));
            }
        }
        EnvKind::Dataset => {
            let mut ks = SYNTHETIC.to_vec();
            ks.extend(["path", "eval_path", "eval_pairs"]);
            keys.env_keys_refused(&ks, "does not apply to kind = \"dataset\" (the data is named in [data])")?;
            if spec.setting == Setting::Deploy {
                return Err(labelled_pairs("dataset"));
            }
            let d =
                spec.data.as_ref().ok_or_else(|| keys.err(&["data"], "required when env.kind = \"dataset\"".into()))?;
            d.check().map_err(|(k, m)| keys.err(&["data", k], m))?;
            if let Some(k) = &d.keys {
                k.label_form().map_err(|(key, m)| keys.err(&["data", "keys", key], m))?;
            }
        }
        EnvKind::Generated => check_generated(spec, keys)?,
    }
    if spec.env.kind != EnvKind::Dataset && spec.data.is_some() {
        return Err(keys.err(&["data"], "applies to env.kind = \"dataset\" only".into()));
    }
    if matches!(spec.env.kind, EnvKind::Features | EnvKind::Dataset) {
        if spec.env.order == Order::Indices && spec.env.order_path.is_none() {
            return Err(keys.err(&["env", "order_path"], "required when env.order = \"indices\"".into()));
        }
        if spec.env.order != Order::Indices && keys.written(&["env", "order_path"]) {
            return Err(keys.err(&["env", "order_path"], "applies to env.order = \"indices\" only".into()));
        }
        if spec.setting == Setting::Active && keys.written(&["active", "pool"]) {
            return Err(keys.err(&["active", "pool"], "the pool is every training pair of the data".into()));
        }
    }
    if spec.env.kind != EnvKind::Generated {
        for (k, given) in [
            ("generate", spec.generate.is_some()),
            ("features", spec.features.is_some()),
            ("oracle", spec.oracle.is_some()),
        ] {
            if given {
                return Err(keys.err(&[k], "applies to env.kind = \"generated\" only".into()));
            }
        }
        for k in ["chunks", "prompt_order", "policy", "reset_each_chunk"] {
            if keys.written(&["deploy", k]) {
                return Err(keys.err(&["deploy", k], "applies to env.kind = \"generated\" only".into()));
            }
        }
    }
    Ok(())
}

fn check_generated(spec: &Spec, keys: Locator<'_>) -> Result<(), SpecError> {
    let mut ks = vec!["contexts", "fresh_contexts", "arms", "features", "feature_norm", "theta_norm"];
    ks.extend(["path", "eval_path", "order", "order_path"]);
    keys.env_keys_refused(&ks, "does not apply to kind = \"generated\" (see [generate], [features], [oracle])")?;
    let need = |k: &str| keys.err(&[k], "required when env.kind = \"generated\"".into());
    let g = spec.generate.as_ref().ok_or_else(|| need("generate"))?;
    let f = spec.features.as_ref().ok_or_else(|| need("features"))?;
    let o = spec.oracle.as_ref().ok_or_else(|| need("oracle"))?;
    g.check().map_err(|(k, m)| keys.err(&["generate", k], m))?;
    f.check().map_err(|(k, m)| keys.err(&["features", k], m))?;
    o.check().map_err(|(k, m)| keys.err(&["oracle", k], m))?;
    if spec.setting == Setting::Deploy && spec.deploy.chunks == 0 {
        return Err(keys.err(&["deploy", "chunks"], "0: expected 1 ≤ chunks ≤ the number of prompts".into()));
    }
    if let (Setting::Deploy, Some(rows)) = (spec.setting, g.rows) {
        if spec.deploy.chunks > rows {
            return Err(
                keys.err(&["deploy", "chunks"], format!("{}: more chunks than the {rows} prompts", spec.deploy.chunks))
            );
        }
    }
    Ok(())
}

/// Ranges of the plain numbers, the stream's shape and rank-local heads.
fn check_ranges(spec: &Spec, keys: Locator<'_>) -> Result<(), SpecError> {
    let env = &spec.env;
    let checks: [(&[&str], bool, &str); 12] = [
        (&["seeds"], spec.seeds >= 1, "at least 1 seed"),
        (&["env", "dim"], env.dim >= 1, "d ≥ 1"),
        (&["env", "contexts"], env.contexts >= 1, "N ≥ 1"),
        (&["env", "arms"], env.arms >= 2, "K ≥ 2 arms"),
        (&["env", "feature_norm"], env.feature_norm.is_finite() && env.feature_norm > 0.0, "L > 0"),
        (&["env", "theta_norm"], env.theta_norm.is_finite() && env.theta_norm > 0.0, "B > 0"),
        (&["env", "eval_pairs"], env.eval_pairs >= 1, "at least 1 evaluation pair"),
        (&["stream", "samples"], spec.stream.samples >= 1, "T ≥ 1"),
        (&["stream", "batch_size"], spec.stream.batch_size >= 1, "a batch size ≥ 1"),
        (&["stream", "eval_every"], spec.stream.eval_every >= 1, "≥ 1 sample"),
        (
            &["curvature", "lambda"],
            spec.curvature.lambda.is_none_or(|l| l == OrAuto::Auto || l.or(1.0).is_finite() && l.or(1.0) > 0.0),
            "λ > 0 or \"auto\"",
        ),
        (
            &["checkpoint", "every_s"],
            spec.checkpoint.every_s.is_finite() && spec.checkpoint.every_s >= 0.0,
            "seconds ≥ 0 (0: only at SIGINT/SIGTERM)",
        ),
    ];
    let ranks = spec.stream.ranks;
    if ranks == 0 {
        return Err(keys.err(&["stream", "ranks"], "expected at least 1 head".into()));
    }
    if ranks > 1 && (spec.setting != Setting::Passive || spec.env.kind == EnvKind::Synthetic) {
        return Err(keys.err(
            &["stream", "ranks"],
            format!("{ranks} heads: only the passive setting on pairs (env.kind = \"features\" or \"dataset\") runs rank-local heads"),
        ));
    }
    if spec.stream.samples < (ranks * spec.stream.batch_size) as u64 {
        return Err(keys.err(
            &["stream", "samples"],
            format!(
                "{}: fewer than one micro-batch per head ({ranks} heads × batch {})",
                spec.stream.samples, spec.stream.batch_size
            ),
        ));
    }
    for (path, ok, expected) in checks {
        if !ok {
            return Err(keys.err(path, format!("out of range: expected {expected}")));
        }
    }
    let chunked = spec.setting == Setting::Deploy && spec.env.kind == EnvKind::Generated;
    if !chunked && !spec.stream.samples.is_multiple_of(spec.stream.batch_size as u64) {
        return Err(keys.err(
            &["stream", "samples"],
            format!("{} is not a multiple of batch_size = {}", spec.stream.samples, spec.stream.batch_size),
        ));
    }
    Ok(())
}

/// The tables of the chosen setting; another setting's table is refused, not ignored.
fn check_setting(spec: &Spec, keys: Locator<'_>) -> Result<(), SpecError> {
    for (table, setting) in [("passive", Setting::Passive), ("active", Setting::Active), ("deploy", Setting::Deploy)] {
        if spec.setting != setting && keys.written(&[table]) {
            return Err(keys.err(
                &[table],
                format!(
                    "applies to setting = \"{table}\" only; this spec's setting is \"{}\" (remove the table)",
                    spec.setting.as_str()
                ),
            ));
        }
    }
    match spec.setting {
        Setting::Passive => {
            if let Beta::Value(b) = spec.passive.beta {
                if !(b.is_finite() && b >= 0.0) {
                    return Err(keys.err(&["passive", "beta"], format!("{b}: expected a number ≥ 0 or \"theory\"")));
                }
            }
            if !(spec.passive.delta > 0.0 && spec.passive.delta < 1.0) {
                return Err(keys.err(&["passive", "delta"], "expected 0 < δ < 1".into()));
            }
        }
        Setting::Active => check_active(spec, keys)?,
        Setting::Deploy => {
            if !(spec.deploy.delta > 0.0 && spec.deploy.delta < 1.0) {
                return Err(keys.err(&["deploy", "delta"], "expected 0 < δ < 1".into()));
            }
        }
    }
    Ok(())
}

/// `[reward]`: its values, and where a reward model whose features learn runs — passive on a
/// preference dataset, or deploy on generated responses (chunked) — φ the final-norm state at
/// the last token (what h_ψ is), one head per cell, with an estimator whose state does not grow
/// with t (one pass over (ψ, θ)).
/// `generate.backend = "openai"` with a learning policy: the server samples each cell's policy
/// as base + its LoRA adapter (pushed after each update), so a policy the server cannot serve
/// that way — every weight learning, or an adapter merged into the weights after each chunk
/// (`policy.adapter = "fresh-per-chunk"`, the authors' loop) — is refused.
fn check_backend(spec: &Spec, keys: Locator<'_>, configs: &[ConfigPlan]) -> Result<(), SpecError> {
    if spec.generate.as_ref().is_none_or(|g| g.backend != GenBackend::Openai) {
        return Ok(());
    }
    for arm in configs.iter().filter_map(|c| c.arm.as_ref()) {
        let why = if arm.full_parameters() {
            "every weight learns"
        } else if arm.learning().is_some_and(|l| l.adapter == AdapterLife::FreshPerChunk) {
            "its adapters are merged into the weights after each chunk (policy.adapter = \"fresh-per-chunk\")"
        } else {
            continue;
        };
        return Err(keys.err(
            &["generate", "backend"],
            format!("\"openai\" serves a learning policy as the base plus one LoRA adapter; the {} arm cannot be served that way: {why}; use backend = \"candle\"", arm.kind()),
        ));
    }
    Ok(())
}

fn check_reward(spec: &Spec, keys: Locator<'_>, configs: &[ConfigPlan]) -> Result<(), SpecError> {
    let Some(r) = &spec.reward else { return Ok(()) };
    r.check().map_err(|(k, m)| keys.err(&["reward", k], m))?;
    if r.update == RewardUpdate::Head {
        return Ok(());
    }
    let update = |m: String| keys.err(&["reward", "update"], format!("\"{}\": {m}", r.update));
    let (pool, layer, table) = match (spec.setting, spec.env.kind) {
        (Setting::Passive, EnvKind::Dataset) => {
            spec.data.as_ref().map_or((features::Pool::Last, -1, "data"), |d| (d.pool, d.layer, "data"))
        }
        (Setting::Passive, _) => {
            return Err(update("needs env.kind = \"dataset\" (the pairs' texts, to recompute their features)".into()))
        }
        (Setting::Deploy, EnvKind::Generated) => {
            if spec.deploy.reset_each_chunk {
                return Err(keys.err(
                    &["deploy", "reset_each_chunk"],
                    format!("true: [reward] update = \"{}\" keeps one reward model through the chunks (false)", r.update),
                ));
            }
            spec.features.as_ref().map_or((features::Pool::Last, -1, "features"), |f| (f.pool, f.layer, "features"))
        }
        (Setting::Deploy, _) => {
            return Err(update("in deploy needs env.kind = \"generated\" (the responses' texts, to recompute their features)".into()))
        }
        (s, _) => {
            return Err(update(format!(
                "a reward model whose features learn runs in the passive and deploy settings (setting = \"{}\" learns θ on cached φ: use update = \"head\")",
                s.as_str()
            )))
        }
    };
    if pool != features::Pool::Last {
        return Err(keys.err(
            &[table, "pool"],
            format!("\"mean\": [reward] update = \"{}\" reads the last token's state (\"last\")", r.update),
        ));
    }
    if layer != -1 {
        return Err(keys.err(
            &[table, "layer"],
            format!("{layer}: [reward] update = \"{}\" reads the final-norm state (layer = -1)", r.update),
        ));
    }
    if spec.stream.ranks > 1 {
        return Err(keys.err(
            &["stream", "ranks"],
            format!(
                "{}: [reward] update = \"{}\" trains one reward model per cell (ranks = 1)",
                spec.stream.ranks, r.update
            ),
        ));
    }
    use estimators::Kind as K;
    if let Some(c) = configs.iter().find(|c| matches!(c.kind, K::OmdExact | K::Mle | K::SgdReplay)) {
        let i = c.table;
        return Err(keys.err(
            &["estimator", &i.to_string(), "kind"],
            format!("{}: with [reward] update = \"{}\" the estimator updates every parameter one batch at a time; its state would grow with t or be d×d: use sgd, adam, adam-reference, omd-hvp-cg, omd-hvp-cg+adam or omd-reference", c.kind, r.update),
        ));
    }
    Ok(())
}

fn check_active(spec: &Spec, keys: Locator<'_>) -> Result<(), SpecError> {
    let a = &spec.active;
    if a.pool < 2 {
        return Err(keys.err(&["active", "pool"], "expected a pool of at least 2 pairs".into()));
    }
    let stream_rule = a.rule.0.contains(&ActiveRule::Stream);
    if let Some(r) = a.rule.0.iter().find(|r| !r.uses_pool()) {
        if matches!(spec.env.kind, EnvKind::Features | EnvKind::Dataset) {
            return Err(keys.err(
                &["active", "rule"],
                format!("{r} ranks the responses of fresh prompts: it needs env.kind = \"synthetic\" or \"generated\" (pairs files have two sides only)"),
            ));
        }
    }
    for r in &a.rule.0 {
        if let ActiveRule::Fresh(s) = r {
            // "theory" is resolved by the cell (d and T may come from the data)
            let s = parametrize(*s, a.q, a.beta, 1.0);
            s.validate(arms_per_context(spec)).map_err(|m| keys.err(&["active", "rule"], m))?;
        }
    }
    if !(a.delta > 0.0 && a.delta < 1.0) {
        return Err(keys.err(&["active", "delta"], "expected 0 < δ < 1".into()));
    }
    if stream_rule && !(1 <= a.keep && a.keep <= a.candidates) {
        return Err(
            keys.err(&["active", "keep"], format!("{}: expected 1 ≤ keep ≤ candidates = {}", a.keep, a.candidates))
        );
    }
    if stream_rule && spec.stream.batch_size != a.keep {
        return Err(keys.err(
            &["stream", "batch_size"],
            format!(
                "{}: the stream rule labels `keep` = {} pairs per step; set batch_size to it",
                spec.stream.batch_size, a.keep
            ),
        ));
    }
    // the pool of a pairs file is its training rows, counted by the world
    let pool_here = !matches!(spec.env.kind, EnvKind::Features | EnvKind::Dataset);
    if pool_here && !a.replacement && spec.stream.samples > a.pool as u64 {
        return Err(keys.err(
            &["active", "replacement"],
            format!("false, but T = {} exceeds the pool of {} pairs", spec.stream.samples, a.pool),
        ));
    }
    if !(a.v0 > 0.0 && a.v0.is_finite()) {
        return Err(keys.err(&["active", "v0"], "expected V₀ > 0".into()));
    }
    Ok(())
}

/// `[policy]` and the learning arms of `deploy.policy`: both or neither; they need deployment
/// on generated responses and an oracle over the learner's φ. Returns the table with its
/// defaults when an arm learns (what the resolved spec shows), None when none does.
/// `[policy]` resolved with its defaults when an arm learns. Tables of arms the spec does not
/// deploy (`[policy]` with no learning arm, `[policy.rloo]` without rloo, `[policy.dpo]` without
/// dpo, `[policy.ppo]` without ppo) are ignored with one warning naming them, so that
/// `--set 'deploy.policy=["best-of-n"]'` subsets a preset's arms; `[policy]` where no arm could
/// ever learn (a setting other than deploy, an env other than generated) is refused.
fn check_policy(spec: &Spec, keys: Locator<'_>, warnings: &mut Vec<String>) -> Result<Option<PolicySpec>, SpecError> {
    use crate::spec::DeployPolicy as P;
    let learns = spec.deploy.policy.0.iter().any(|p| p.learns());
    let generated_deploy = spec.setting == Setting::Deploy && spec.env.kind == EnvKind::Generated;
    if spec.policy.is_some() && !generated_deploy {
        return Err(keys.err(
            &["policy"],
            "applies only to setting = \"deploy\" with env.kind = \"generated\", where deploy.policy may include \"rloo\", \"dpo\" or \"ppo\"".into(),
        ));
    }
    if spec.policy.is_some() {
        let has = |a| spec.deploy.policy.0.contains(&a);
        let mut unused: Vec<&str> = Vec::new();
        if !learns {
            unused.push("[policy]");
        }
        for (table, arm) in
            [("rloo", P::Rloo), ("dpo", P::Dpo), ("ppo", P::Ppo), ("grpo", P::Grpo), ("reinforce_pp", P::ReinforcePp)]
        {
            if keys.written(&["policy", table]) && (!learns || !has(arm)) {
                unused.push(match table {
                    "rloo" => "[policy.rloo]",
                    "dpo" => "[policy.dpo]",
                    "ppo" => "[policy.ppo]",
                    "grpo" => "[policy.grpo]",
                    _ => "[policy.reinforce_pp]",
                });
            }
        }
        if !unused.is_empty() {
            let arms: Vec<String> = spec.deploy.policy.0.iter().map(|p| format!("\"{p}\"")).collect();
            warnings.push(format!(
                "{}: {} ignored: deploy.policy = [{}] deploys no arm that reads {}",
                keys.file.display(),
                unused.join(", "),
                arms.join(", "),
                if unused.len() == 1 { "it" } else { "them" }
            ));
        }
    }
    if !learns {
        return Ok(None);
    }
    if spec.setting != Setting::Deploy || spec.env.kind != EnvKind::Generated {
        return Err(keys.err(
            &["deploy", "policy"],
            "a policy that learns needs setting = \"deploy\" and env.kind = \"generated\"".into(),
        ));
    }
    let resolved = spec.policy.clone().unwrap_or_default();
    let p = &resolved;
    p.check().map_err(|(k, m)| keys.err(&[&["policy"], k.as_slice()].concat(), m))?;
    let arms = &spec.deploy.policy.0;
    p.check_arms(arms).map_err(|(k, m)| keys.err(&[&["policy"], k.as_slice()].concat(), m))?;
    warnings.extend(p.warnings(arms).into_iter().map(|w| format!("{}: {w}", keys.file.display())));
    if let Some(g) = &spec.generate {
        // the update's log-probabilities are those of the untransformed policy: samples drawn
        // at another temperature or from a nucleus are not its samples
        for (key, v, why) in [
            ("temperature", g.temperature, "at temperature 1 (its update scores log π at T = 1)"),
            ("top_p", g.top_p, "with top_p = 1 (its update scores log π without a nucleus)"),
        ] {
            if v != 1.0 {
                return Err(keys.err(&["generate", key], format!("{v}: a policy that learns samples {why}")));
            }
        }
        let has = |a| spec.deploy.policy.0.contains(&a);
        let ppo = has(crate::spec::DeployPolicy::Ppo);
        let same_model = spec.features.as_ref().is_some_and(|f| f.model == g.policy);
        let theta_critic = p.ppo.reward.0.iter().any(|&r| p.ppo.critic_head_for(r) == crate::spec::CriticHead::Theta);
        if ppo && theta_critic && !same_model {
            return Err(keys.err(
                &["policy", "ppo", "critic_head"],
                "\"theta\": the critic runs on the policy's backbone, θ is over features.model's φ, and they differ: expected \"zero\" (or features.model = generate.policy)".into(),
            ));
        }
        let full = p.dpo.parameters == crate::spec::policy::DpoParameters::Full;
        if p.dtype == crate::spec::policy::TrainDtype::Bf16 {
            // bf16 products are the CPU's fused kernels over frozen weights and a LoRA adapter
            // (`PolicyModel::use_bf16_products`); what they cannot do is refused here, by key
            let why = if p.adapter.0.contains(&crate::spec::policy::AdapterLife::FreshPerChunk) {
                Some("with adapter = \"fresh-per-chunk\": each chunk merges its adapter into the weights, and weights packed in bf16 would round the merged update away: expected \"f32\" (or adapter = \"persistent\")")
            } else if full && has(crate::spec::DeployPolicy::Dpo) {
                Some("with policy.dpo.parameters = \"full\": every weight trains, none is frozen to pack: expected \"f32\"")
            } else if matches!(g.device, crate::spec::Device::Cuda | crate::spec::Device::Metal) {
                Some("with generate.device on a GPU: bf16 products are the CPU's packed kernels: expected \"f32\"")
            } else {
                None
            };
            if let Some(why) = why {
                return Err(keys.err(&["policy", "dtype"], format!("\"bf16\" {why}")));
            }
        }
        // save_adapter saves the LoRA cells' adapters; a full-parameter cell has none, so a run
        // whose only learning arm is full-parameter dpo would save nothing it was asked to
        let lora_arm = [P::Rloo, P::Ppo, P::Grpo, P::ReinforcePp].into_iter().any(has);
        if full && has(crate::spec::DeployPolicy::Dpo) && !lora_arm && p.save_adapter != crate::spec::SaveAdapter::None
        {
            return Err(keys.err(
                &["policy", "dpo", "parameters"],
                "\"full\" trains every weight: there is no LoRA adapter to save; expected policy.save_adapter = \"none\" (or parameters = \"lora\")".into(),
            ));
        }
        // rollouts from the chunk's samples are the first k of its n
        let samples = p.rollouts == crate::spec::policy::RolloutSource::Samples;
        let dpo_two = has(crate::spec::DeployPolicy::Dpo) && p.dpo.pairs == crate::spec::policy::DpoPairs::FreshTwo;
        for (key, k) in [
            (["policy", "rloo", "rollouts_per_prompt"], p.rloo.rollouts_per_prompt),
            (["policy", "ppo", "rollouts_per_prompt"], p.ppo.rollouts_per_prompt),
            (["policy", "grpo", "rollouts_per_prompt"], p.grpo.rollouts_per_prompt),
            (["policy", "reinforce_pp", "rollouts_per_prompt"], p.reinforce_pp.rollouts_per_prompt),
            (["policy", "dpo", "pairs"], dpo_two.then_some(2)),
        ] {
            if let Some(k) = k.filter(|&k| samples && k > g.n) {
                return Err(keys.err(
                    &key,
                    format!("{k} rollouts per prompt from the chunk's samples, but generate.n = {}: expected at most n (or policy.rollouts = \"fresh\")", g.n),
                ));
            }
        }
        for (arm, table, k) in
            [(P::Rloo, "rloo", p.rloo.rollouts_per_prompt), (P::Grpo, "grpo", p.grpo.rollouts_per_prompt)]
        {
            if has(arm) && k.is_none() && g.n < 2 {
                return Err(keys.err(
                    &["policy", table, "rollouts_per_prompt"],
                    format!("defaults to generate.n = {}: {arm} needs at least 2 rollouts per prompt", g.n),
                ));
            }
        }
        if let Some(m) = p.eval_samples.filter(|m| !m.is_multiple_of(g.n)) {
            return Err(keys.err(
                &["policy", "eval_samples"],
                format!("{m}: expected a multiple of generate.n = {} (best-of-n is read off groups of n)", g.n),
            ));
        }
    }
    Ok(Some(resolved))
}

/// A deploy strategy, an active rule, a deployed policy and the reward its update reads (each
/// absent outside its setting).
type Arm = (Option<Strategy>, Option<ActiveRule>, Option<ArmPlan>);

/// The arms every estimator config runs under: deploy strategies × active rules (one `None`
/// arm in the other settings).
fn arms(spec: &Spec, keys: Locator<'_>) -> Result<Vec<Arm>, SpecError> {
    let strategies: Vec<Option<Strategy>> = if spec.setting == Setting::Deploy {
        let mut out = Vec::new();
        for (i, name) in spec.deploy.strategies.0.iter().enumerate() {
            let s: Strategy = name.parse().map_err(|m| keys.err(&["deploy", "strategies"], m))?;
            // "theory" is resolved by the cell (d and T may come from the data)
            let s = parametrize(s, spec.deploy.q, spec.deploy.beta, 1.0);
            let n = arms_per_context(spec);
            s.validate(n).map_err(|m| keys.err(&["deploy", "strategies"], format!("{m} (entry {i})")))?;
            out.push(Some(s));
        }
        out
    } else {
        vec![None]
    };
    let rules: Vec<Option<ActiveRule>> = if spec.setting == Setting::Active {
        spec.active.rule.0.iter().map(|r| Some(*r)).collect()
    } else {
        vec![None]
    };
    let policies: Vec<Option<ArmPlan>> = if spec.setting == Setting::Deploy && spec.env.kind == EnvKind::Generated {
        spec.deploy.policy.0.iter().flat_map(|&p| ArmPlan::of(p, spec)).map(Some).collect()
    } else {
        vec![None]
    };
    let mut out = Vec::new();
    for s in &strategies {
        for r in &rules {
            out.extend(policies.iter().map(|p| (*s, *r, p.clone())));
        }
    }
    Ok(out)
}

/// Every `[[estimator]]` table expanded over its sweeps, read, resolved and validated, crossed
/// with the arms.
fn configs(spec: &Spec, keys: Locator<'_>, arms: &[Arm]) -> Result<Vec<ConfigPlan>, SpecError> {
    if spec.estimators.is_empty() {
        return Err(keys.err(&[], "no [[estimator]] tables: expected at least one".into()));
    }
    let several_rules = spec.setting == Setting::Active && spec.active.rule.0.len() > 1;
    let several_policies = spec.deploy.policy.0.len() > 1;
    // of the arms deployed: a table of an arm not deployed is ignored (check_policy)
    let has = |a| spec.deploy.policy.0.contains(&a);
    let several_sources = spec.policy.as_ref().is_some_and(|p| {
        (has(DeployPolicy::Rloo) && p.rloo.reward.0.len() > 1)
            || (has(DeployPolicy::Ppo) && p.ppo.reward.0.len() > 1)
            || (has(DeployPolicy::Grpo) && p.grpo.reward.0.len() > 1)
            || (has(DeployPolicy::ReinforcePp) && p.reinforce_pp.reward.0.len() > 1)
    });
    let learns = spec.deploy.policy.0.iter().any(|p| p.learns());
    let several_lives = learns && spec.policy.as_ref().is_some_and(|p| p.adapter.0.len() > 1);
    let bounds = Bounds {
        theta_norm_feature_norm_dim: (spec.env.kind == EnvKind::Synthetic).then_some((
            spec.env.theta_norm,
            spec.env.feature_norm,
            spec.env.dim,
        )),
    };
    let planned_steps = spec.stream.samples / spec.stream.batch_size as u64;
    let mut configs: Vec<ConfigPlan> = Vec::new();
    for (ei, raw) in spec.estimators.iter().enumerate() {
        let eis = ei.to_string();
        let at = |k: &str, m: String| keys.err(&["estimator", eis.as_str(), k], m);
        for mut combo in estimator::expand(raw).map_err(|(k, m)| at(&k, m))? {
            let name = match combo.table.remove("name") {
                None => None,
                Some(toml::Value::String(n)) if !n.trim().is_empty() && !n.contains(" / ") => Some(n),
                Some(v) => {
                    return Err(at(
                        "name",
                        format!("{v}: expected a non-empty string without \" / \" (it labels the config)"),
                    ))
                }
            };
            let (init, mut es) = estimator::read(&combo.table).map_err(|(k, m)| at(&k, m))?;
            let theory = combo.table.get("theory").and_then(|v| v.as_bool()) == Some(true);
            let estimator_label = estimator_label(name.as_deref(), &es, theory, init, &combo.swept);
            let cfg = es.resolve(bounds).map_err(|(k, m)| at(&k, m))?;
            let setup = Setup { dim: spec.env.dim, init, seed: 0, planned_steps: Some(planned_steps) };
            cfg.validate(&setup).map_err(|e| match &e {
                EstimatorError::BadConfig { field, .. } => at(field, e.to_string()),
                _ => at("kind", e.to_string()),
            })?;
            let hparams = es.hparams();
            let lambda_auto = es.lambda_auto();
            let estimator_index = configs.len() / arms.len();
            for (strategy_index, (strategy, rule, policy)) in arms.iter().enumerate() {
                // thompson, double-thompson, ensemble-uncertainty and baits read an ensemble's heads
                let needs = match (strategy, rule) {
                    (Some(s), _) if s.needs_ensemble() => Some((s, ["deploy", "strategies"])),
                    (_, Some(ActiveRule::Fresh(s))) if s.needs_ensemble() => Some((s, ["active", "rule"])),
                    _ => None,
                };
                if let (Some((s, path)), false) = (needs, cfg.kind() == Kind::Ensemble) {
                    return Err(keys.err(
                        &path,
                        format!(
                            "strategy `{s}` draws from an ensemble's heads: estimator {ei} is `{}`, expected kind = \"ensemble\"",
                            cfg.kind()
                        ),
                    ));
                }
                let mut label = estimator_label.clone();
                if let Some(s) = strategy {
                    label = format!("{label} / {s}");
                }
                if let (Some(r), true) = (rule, several_rules) {
                    label = format!("{label} / {r}");
                }
                if let (Some(a), true) = (policy, several_policies || several_sources) {
                    label = format!("{label} / {}", a.kind());
                }
                if let (
                    Some(
                        a @ (ArmPlan::Rloo { .. }
                        | ArmPlan::Ppo { .. }
                        | ArmPlan::Grpo { .. }
                        | ArmPlan::ReinforcePp { .. }),
                    ),
                    true,
                ) = (policy, several_sources)
                {
                    label = format!("{label} ({} reward)", a.reward());
                }
                if let (Some(l), true) = (policy.as_ref().and_then(|a| a.learning()), several_lives) {
                    label = format!("{label} [{}]", l.adapter);
                }
                configs.push(ConfigPlan {
                    config_id: configs.len(),
                    kind: cfg.kind(),
                    cfg,
                    init,
                    hparams: hparams.clone(),
                    lambda_auto,
                    swept: combo.swept.clone(),
                    strategy: *strategy,
                    rule: *rule,
                    arm: policy.clone(),
                    estimator_index,
                    table: ei,
                    strategy_index,
                    estimator_label: estimator_label.clone(),
                    label,
                    pessimism_beta: None,
                });
            }
        }
    }
    Ok(configs)
}

/// The estimator's part of a config's label, from its own `[[estimator]]` table alone (another
/// table of the spec never changes it): `name` when the table gives one, else the kind; then
/// each hyper-parameter, in the kind's order, whose value differs from the kind's default or
/// that the table sweeps (`key=value`: `sgd lr=0.1`, `omd-exact lambda=100`; a table of
/// defaults is its kind alone: `omd-exact`); then, without a `name`, `theory` under
/// `theory = true` and `init=normal` (with `init_std`) for a drawn θ_1. A `name` keeps the swept
/// keys (`fast lr=0.1`, `fast lr=0.5`). The arm's parts follow (`label`). Two configs of one
/// label are refused ([`check_labels`]).
pub fn estimator_label(
    name: Option<&str>,
    es: &estimator::EstimatorSpec,
    theory: bool,
    init: Init,
    swept: &[String],
) -> String {
    let kind = toml::Value::try_from(es).ok().and_then(|v| v.get("kind").and_then(|k| k.as_str()).map(String::from));
    let kind = kind.unwrap_or_default();
    let mut only_kind = toml::Table::new();
    only_kind.insert("kind".into(), toml::Value::String(kind.clone()));
    let defaults = estimator::read(&only_kind).map(|(_, d)| d.hparams()).unwrap_or_default();
    let default_of = |k: &str| defaults.iter().find(|(d, _)| d == k).map(|(_, v)| v);
    let mut parts = vec![name.map_or(kind, String::from)];
    for (k, v) in es.hparams() {
        if swept.contains(&k) || (name.is_none() && default_of(&k) != Some(&v)) {
            parts.push(format!("{k}={}", estimator::show(&v)));
        }
    }
    if name.is_none() {
        if theory {
            parts.push("theory".into());
        }
        if let Init::Normal { std } = init {
            parts.push("init=normal".into());
            if let Some(s) = std {
                parts.push(format!("init_std={s}"));
            }
        }
    }
    parts.join(" ")
}

/// Refuses two configs of one label (their rows would be one curve, their heads one file), in
/// one line naming both tables.
fn check_labels(configs: &[ConfigPlan], keys: Locator<'_>) -> Result<(), SpecError> {
    let mut seen: std::collections::BTreeMap<&str, usize> = std::collections::BTreeMap::new();
    for c in configs {
        if let Some(&first) = seen.get(c.label.as_str()) {
            let (a, b) = (first, c.table);
            let why = if a == b {
                format!("gives the label `{}` twice (a swept key repeats a value)", c.label)
            } else {
                format!("has the label `{}` of estimator[{a}] too: give one of them a `name = \"…\"`", c.label)
            };
            return Err(keys.err(&["estimator", &b.to_string()], why));
        }
        seen.insert(&c.label, c.table);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// λ = "auto" is a typed flag resolved once from the data's scale (never the λ string
    /// compared again): the cell's omd-exact takes the data's median ‖z‖²; a number stays that
    /// number (negative control), and so does "theory"'s λ.
    #[test]
    fn lambda_auto_takes_the_datas_scale_and_a_number_stays() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("spec.toml");
        let text = "setting = \"passive\"\n[env]\ndim = 4\n[stream]\nsamples = 100\n\
                    [[estimator]]\nkind = \"omd-exact\"\nlambda = [\"auto\", 2.0]\n";
        std::fs::write(&path, text).unwrap();
        let plan = crate::load_plan(&path, &[]).unwrap();
        let mut spec = plan.spec.clone();
        spec.data_scale = Some(DataScale { pairs: 10, median_z_sq: 7.5, p90_z_sq: 9.0, max_z_sq: 12.0 });
        let lambdas: Vec<(bool, Option<f64>)> = plan.configs.iter().map(|c| (c.lambda_auto, c.lambda(&spec))).collect();
        assert_eq!(lambdas, [(true, Some(7.5)), (false, Some(2.0))]);
    }

    /// The cells' configs are resolved once against the spec completed with the data's facts:
    /// λ = "auto" in the estimator's config, ucb's β = "theory" from the facts' d and T (not the
    /// spec's d: negative control), a number kept, the pessimistic policy's β.
    #[test]
    fn configs_are_resolved_for_their_cells_from_the_facts() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("spec.toml");
        let text = "setting = \"deploy\"\n[env]\ndim = 4\n[stream]\nsamples = 100\n[deploy]\n\
                    strategies = [\"ucb\"]\nbeta = \"theory\"\ndelta = 0.1\n\
                    [[estimator]]\nkind = \"omd-exact\"\nlambda = \"auto\"\n";
        std::fs::write(&path, text).unwrap();
        let plan = crate::load_plan(&path, &[]).unwrap();
        let facts = DataFacts {
            dim: 9,
            bank: None,
            samples: Some(50),
            data_scale: DataScale { pairs: 10, median_z_sq: 7.5, p90_z_sq: 9.0, max_z_sq: 12.0 },
        };
        let spec = resolve(&plan.spec, &facts);
        let c = plan.configs[0].for_cells(&spec);
        let EstimatorConfig::OmdExact(o) = c.cfg else { panic!("{:?}", c.cfg) };
        assert_eq!(o.lambda, 7.5);
        let want = 3.0 * (50f64 / 0.1).ln();
        assert_eq!(c.strategy, Some(Strategy::Ucb { beta: want }));
        assert_ne!(c.strategy, plan.configs[0].strategy, "resolution changed the strategy");
        assert_ne!(want, theory_beta(4, 100, 0.1), "the facts' d and T, not the spec's");
        let p = plan.configs[0].for_cells(&resolve(
            &Spec { passive: PassiveSpec { beta: Beta::Value(1.5), ..spec.passive.clone() }, ..spec.clone() },
            &facts,
        ));
        assert_eq!(p.pessimism_beta, Some(1.5));
    }
}
