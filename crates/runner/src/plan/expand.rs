//! Estimator tables expanded over their swept keys into configs, times the deploy strategies and
//! arms or the active rules, each with its label (labels must differ).

use super::config::{arms_per_context, parametrize, ArmPlan, ConfigPlan};
use super::keys::Locator;
use crate::spec::estimator::{self, Bounds};
use crate::spec::*;
use estimators::{EstimatorError, Init, Kind, Setup};
use selection::Strategy;

/// A deploy strategy, an active rule, a deployed policy and the reward its update reads (each
/// absent outside its setting).
type Arm = (Option<Strategy>, Option<ActiveRule>, Option<ArmPlan>);

/// The arms every estimator config runs under: deploy strategies × active rules (one `None`
/// arm in the other settings).
pub(super) fn arms(spec: &Spec, keys: Locator<'_>) -> Result<Vec<Arm>, SpecError> {
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
pub(super) fn configs(spec: &Spec, keys: Locator<'_>, arms: &[Arm]) -> Result<Vec<ConfigPlan>, SpecError> {
    if spec.estimators.is_empty() {
        return Err(keys.err(&[], "no [[estimator]] tables: expected at least one".into()));
    }
    let several = Several::of(spec);
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
            for (strategy_index, arm) in arms.iter().enumerate() {
                check_ensemble(keys, arm, cfg.kind(), ei)?;
                let label = arm_label(&estimator_label, arm, several);
                let (strategy, rule, policy) = arm;
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

/// Which parts of an arm join a config's label: each only where the spec runs several of it
/// (several active rules, deployed policies, reward sources or adapter lives), so that labels
/// differ without naming what every config shares.
#[derive(Clone, Copy)]
struct Several {
    rules: bool,
    policies: bool,
    sources: bool,
    lives: bool,
}

impl Several {
    /// What the spec runs several of.
    fn of(spec: &Spec) -> Self {
        let rules = spec.setting == Setting::Active && spec.active.rule.0.len() > 1;
        let policies = spec.deploy.policy.0.len() > 1;
        // of the arms deployed: a table of an arm not deployed is ignored (check_policy)
        let has = |a| spec.deploy.policy.0.contains(&a);
        let sources = spec.policy.as_ref().is_some_and(|p| {
            (has(DeployPolicy::Rloo) && p.rloo.reward.0.len() > 1)
                || (has(DeployPolicy::Ppo) && p.ppo.reward.0.len() > 1)
                || (has(DeployPolicy::Grpo) && p.grpo.reward.0.len() > 1)
                || (has(DeployPolicy::ReinforcePp) && p.reinforce_pp.reward.0.len() > 1)
        });
        let learns = spec.deploy.policy.0.iter().any(|p| p.learns());
        let lives = learns && spec.policy.as_ref().is_some_and(|p| p.adapter.0.len() > 1);
        Several { rules, policies, sources, lives }
    }
}

/// A strategy or active rule that draws from an ensemble's heads needs an estimator of kind
/// "ensemble".
fn check_ensemble(keys: Locator<'_>, arm: &Arm, kind: Kind, ei: usize) -> Result<(), SpecError> {
    let (strategy, rule, _) = arm;
    // thompson, double-thompson, ensemble-uncertainty and baits read an ensemble's heads
    let needs = match (strategy, rule) {
        (Some(s), _) if s.needs_ensemble() => Some((s, ["deploy", "strategies"])),
        (_, Some(ActiveRule::Fresh(s))) if s.needs_ensemble() => Some((s, ["active", "rule"])),
        _ => None,
    };
    if let (Some((s, path)), false) = (needs, kind == Kind::Ensemble) {
        return Err(keys.err(
            &path,
            format!(
                "strategy `{s}` draws from an ensemble's heads: estimator {ei} is `{kind}`, expected kind = \"ensemble\""
            ),
        ));
    }
    Ok(())
}

/// A config's label: the estimator's, then ` / strategy`, ` / rule` and ` / policy`, the
/// ` (reward)` a learning arm reads and its ` [adapter]` life, each where `several` says so.
fn arm_label(estimator_label: &str, arm: &Arm, several: Several) -> String {
    let (strategy, rule, policy) = arm;
    let mut label = estimator_label.to_string();
    if let Some(s) = strategy {
        label = format!("{label} / {s}");
    }
    if let (Some(r), true) = (rule, several.rules) {
        label = format!("{label} / {r}");
    }
    if let (Some(a), true) = (policy, several.policies || several.sources) {
        label = format!("{label} / {}", a.kind());
    }
    if let (
        Some(a @ (ArmPlan::Rloo { .. } | ArmPlan::Ppo { .. } | ArmPlan::Grpo { .. } | ArmPlan::ReinforcePp { .. })),
        true,
    ) = (policy, several.sources)
    {
        label = format!("{label} ({} reward)", a.reward());
    }
    if let (Some(l), true) = (policy.as_ref().and_then(|a| a.learning()), several.lives) {
        label = format!("{label} [{}]", l.adapter);
    }
    label
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
                parts.push(format!("init_std={}", estimator::show(&toml::Value::Float(s))));
            }
        }
    }
    parts.join(" ")
}

/// Refuses two configs of one label (their rows would be one curve, their heads one file), in
/// one line naming both tables.
pub(super) fn check_labels(configs: &[ConfigPlan], keys: Locator<'_>) -> Result<(), SpecError> {
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
