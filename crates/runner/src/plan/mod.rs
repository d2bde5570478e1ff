//! A parsed spec → a validated plan, without reading anything but the spec: no data, no model,
//! no terminal. Every cross-field check that the spec alone decides lives here (the checks that
//! need data live in `world`). Estimator tables are expanded over their swept keys into configs;
//! configs × (deploy: strategies; active: rules) × seeds are the cells. `onepass run --dry-run`
//! stops here.

mod cell;
mod check;
mod config;
mod expand;
mod keys;
pub mod record;

pub use cell::{chunk_range, ActiveCell, CellConfig, CurvatureCell, DeployCell, PassiveCell};
use check::{check_backend, check_env_kind, check_policy, check_ranges, check_reward, check_setting};
pub use config::{
    needs_tracker, parametrize, theory_beta, ArmPlan, ConfigPlan, CriticPlan, CurvatureChoice, Learning, RolloutPlan,
};
pub use expand::estimator_label;
use expand::{arms, check_labels, configs};
pub use keys::Locator;

use crate::spec::estimator;
use crate::spec::*;
use estimators::Init;
use std::path::{Path, PathBuf};

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

#[cfg(test)]
mod tests {
    use super::*;
    use estimators::EstimatorConfig;
    use selection::Strategy;

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
