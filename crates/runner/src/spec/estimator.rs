//! `[[estimator]]` tables. A table may give any hyper-parameter as an array: [`expand`] crosses
//! the arrays on the raw TOML (first written key slowest), then each combination is read by
//! serde into [`EstimatorSpec`]: straight into the estimators crate's config where the table's
//! keys are its fields (omd-hvp-cg, adam, adam-reference, mle), else into a table struct of this
//! file — for the words "auto", "none" and "theory" (omd-exact, sgd, sgd-replay) or a flat
//! table over a nested config (omd-reference's `adam = true` with its β's, omd-hvp-cg+adam).
//! Either carries the defaults and refuses keys of other kinds. Hyper-parameters are read back
//! by serialising the same structs, so no key list is written twice. Adding an estimator kind
//! to the runner: a variant (its config, or a table struct) and its arm of
//! [`EstimatorSpec::resolve`], all in this file.

use super::{OrAuto, OrNone};
use estimators::{
    AdamConfig, DampingSchedule, EnsembleConfig, EstimatorConfig, HvpCgConfig, Init, MleConfig, OmdExactConfig,
    OmdReferenceConfig, ReplayConfig, SgdConfig,
};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The keys every `[[estimator]]` table takes beside its kind's hyper-parameters. [`read`]
/// takes `init` and `init_std` out of the table before the kind's struct reads the rest (the
/// plan takes `name`); this type documents them for the generated reference (a test checks
/// [`read`] accepts each).
#[derive(JsonSchema)]
#[allow(dead_code)] // read for its schema only
pub struct CommonKeys {
    /// The estimator's name (see below).
    kind: String,
    /// The config's label in every table and figure (absent: the kind and the hyper-parameters
    /// that differ from its defaults or are swept, e.g. `sgd lr=0.5`); two configs of one spec
    /// may not share a label.
    name: Option<String>,
    /// How θ_1 is drawn: "zero" (the paper's Alg. 2–4) or "normal" (N(0, init_std²) from a
    /// seeded stream, the authors' head init).
    #[schemars(extend("enum" = ["zero", "normal"]))]
    init: Option<String>,
    /// The standard deviation of init = "normal" (absent: 1/(d+1), the authors' choice).
    init_std: Option<f64>,
}

/// One estimator kind with one value per hyper-parameter (`init` and `init_std` are read apart).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum EstimatorSpec {
    /// Paper Alg. 1 / Eq. (3).
    OmdExact(OmdExactSpec),
    /// Paper Alg. 5.
    OmdHvpCg(HvpCgConfig),
    /// The authors' coded update (reference-code.md §2.3).
    OmdReference(OmdReferenceSpec),
    /// One-pass SGD with global-norm clipping (the paper's baseline): θ ← θ − lr·clip(g).
    Sgd(SgdSpec),
    /// Maximum likelihood re-fitted on the full history (the paper's MLE baseline; memory O(t)).
    Mle(MleConfig),
    /// Adam on the logistic loss, one pass.
    Adam(AdamConfig),
    /// The authors' coded Adam (reference-code.md §2.4).
    AdamReference(AdamConfig),
    /// Alg. 5's CG direction with Adam's step on it.
    #[serde(rename = "omd-hvp-cg+adam")]
    OmdHvpCgAdam(HvpCgAdamSpec),
    /// The authors' SGD with replay: SGD, plus one SGD pass over every stored batch every
    /// replay_every steps (memory O(t)).
    SgdReplay(SgdReplaySpec),
    /// K linear heads over φ, each trained by Adam on minibatches of a replay buffer of every
    /// label seen (memory O(t)), after oat's ensemble reward model; θ is the heads' mean. The
    /// strategies thompson, double-thompson, ensemble-uncertainty and baits read its heads.
    Ensemble(EnsembleConfig),
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct OmdExactSpec {
    /// η of Alg. 1 (the step of the mirror descent).
    pub eta: f64,
    /// A number, or "auto" (the median ‖z‖² of the first pairs, resolved by the world).
    pub lambda: OrAuto,
    /// Projection radius of θ (a number, or "none": no projection).
    pub radius: OrNone,
    /// Lemma 1's η, λ and radius from env.theta_norm and env.feature_norm.
    #[serde(skip_serializing)]
    pub theory: bool,
}

impl Default for OmdExactSpec {
    fn default() -> Self {
        let c = OmdExactConfig::default();
        OmdExactSpec { eta: c.eta, lambda: OrAuto::Value(c.lambda), radius: c.radius.into(), theory: false }
    }
}

/// omd-hvp-cg+adam: the CG direction, Adam's step (its `lr`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct HvpCgAdamSpec {
    /// K, the CG steps.
    pub cg_steps: usize,
    /// λ0 of the damping schedule.
    pub lambda0: f64,
    /// The damping shape f of λ_t = max(λ_min, λ0·f(min(1, t/T))).
    pub schedule: DampingSchedule,
    /// Floor of λ_t.
    pub lambda_min: f64,
    /// ε of CG's relative stopping rule ‖r‖ ≤ ε‖g‖.
    pub cg_tol: f64,
    /// Adam's learning rate.
    pub lr: f64,
    /// Adam's β₁.
    pub beta1: f64,
    /// Adam's β₂.
    pub beta2: f64,
    /// Adam's ε.
    pub eps: f64,
}

impl Default for HvpCgAdamSpec {
    fn default() -> Self {
        let (c, a) = (HvpCgConfig::default(), AdamConfig::default());
        HvpCgAdamSpec {
            cg_steps: c.cg_steps,
            lambda0: c.lambda0,
            schedule: c.schedule,
            lambda_min: c.lambda_min,
            cg_tol: c.cg_tol,
            lr: a.lr,
            beta1: a.beta1,
            beta2: a.beta2,
            eps: a.eps,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct OmdReferenceSpec {
    /// Step size of θ ← θ − lr·v (with adam = true: Adam's learning rate).
    pub lr: f64,
    /// `--damping` λ0: the constant damping inside CG and the mixing weight.
    pub lambda0: f64,
    /// `--damping_growth_rate` G: c_t = min((1 − λ0)·t/G + λ0, 1), plain SGD once c_t ≥ 1.
    pub growth: f64,
    /// `--num_cg_steps` K.
    pub cg_steps: usize,
    /// Round θ to bf16 after every update (the authors updated bf16 weights in place).
    pub bf16_weights: bool,
    /// The authors' Adam on the mixed direction (`--use_momentum`), with `lr`.
    pub adam: bool,
    /// adam = true: Adam's β₁ (absent: 0.9).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub beta1: Option<f64>,
    /// adam = true: Adam's β₂ (absent: 0.999).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub beta2: Option<f64>,
    /// adam = true: Adam's ε (absent: 1e-8).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eps: Option<f64>,
}

impl Default for OmdReferenceSpec {
    fn default() -> Self {
        let c = OmdReferenceConfig::default();
        OmdReferenceSpec {
            lr: c.lr,
            lambda0: c.lambda0,
            growth: c.growth,
            cg_steps: c.cg_steps,
            bf16_weights: c.bf16_weights,
            adam: c.adam.is_some(),
            beta1: None,
            beta2: None,
            eps: None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct SgdSpec {
    /// Step size.
    pub lr: f64,
    /// Global-norm clipping threshold (a number, or "none").
    pub clip: OrNone,
}

impl Default for SgdSpec {
    fn default() -> Self {
        let c = SgdConfig::default();
        SgdSpec { lr: c.lr, clip: c.clip.into() }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct SgdReplaySpec {
    /// Step size.
    pub lr: f64,
    /// Global-norm clipping threshold (a number, or "none").
    pub clip: OrNone,
    /// R: after every R-th step, one SGD pass over every stored batch (the authors'
    /// `--retrain_step`).
    pub replay_every: u64,
}

impl Default for SgdReplaySpec {
    fn default() -> Self {
        let c = ReplayConfig::default();
        SgdReplaySpec { lr: c.sgd.lr, clip: c.sgd.clip.into(), replay_every: c.every }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Bounds {
    /// B, L and d; None when the environment has no such bounds (features, datasets, generated).
    pub theta_norm_feature_norm_dim: Option<(f64, f64, usize)>,
}

impl EstimatorSpec {
    /// The estimator's config; fills in what the table left implicit (Lemma 1's values under
    /// `theory = true`, Adam's defaults inside omd-reference) so that serialising `self`
    /// afterwards lists every hyper-parameter the config uses. Errors: (key, message).
    pub fn resolve(&mut self, bounds: Bounds) -> Result<EstimatorConfig, (String, String)> {
        use EstimatorConfig as E;
        Ok(match self {
            EstimatorSpec::OmdExact(s) => {
                if s.theory {
                    let (b, l, d) = bounds.theta_norm_feature_norm_dim.ok_or_else(|| {
                        (
                            "theory".to_string(),
                            "needs the bounds B and L of the synthetic environment; kind = \"features\" has none"
                                .to_string(),
                        )
                    })?;
                    let t = OmdExactConfig::theory(b, l, d);
                    (s.eta, s.lambda, s.radius) = (t.eta, OrAuto::Value(t.lambda), t.radius.into());
                }
                // "auto" validates as 1 here; the cell builds its estimator with the data's value
                // (ConfigPlan::cfg_for)
                E::OmdExact(OmdExactConfig { eta: s.eta, lambda: s.lambda.or(1.0), radius: s.radius.get() })
            }
            EstimatorSpec::OmdHvpCg(c) => E::OmdHvpCg(*c),
            EstimatorSpec::OmdHvpCgAdam(s) => E::OmdHvpCgAdam {
                cg: HvpCgConfig {
                    cg_steps: s.cg_steps,
                    lambda0: s.lambda0,
                    schedule: s.schedule,
                    lambda_min: s.lambda_min,
                    cg_tol: s.cg_tol,
                    ..HvpCgConfig::default()
                },
                adam: AdamConfig { lr: s.lr, beta1: s.beta1, beta2: s.beta2, eps: s.eps },
            },
            EstimatorSpec::OmdReference(s) => {
                let adam = if s.adam {
                    let d = AdamConfig::default();
                    let (beta1, beta2, eps) =
                        (s.beta1.unwrap_or(d.beta1), s.beta2.unwrap_or(d.beta2), s.eps.unwrap_or(d.eps));
                    (s.beta1, s.beta2, s.eps) = (Some(beta1), Some(beta2), Some(eps));
                    Some(AdamConfig { lr: s.lr, beta1, beta2, eps })
                } else {
                    for (k, v) in [("beta1", s.beta1), ("beta2", s.beta2), ("eps", s.eps)] {
                        if v.is_some() {
                            return Err((k.to_string(), "needs `adam = true`".to_string()));
                        }
                    }
                    None
                };
                E::OmdReference(OmdReferenceConfig {
                    lr: s.lr,
                    lambda0: s.lambda0,
                    growth: s.growth,
                    cg_steps: s.cg_steps,
                    bf16_weights: s.bf16_weights,
                    adam,
                })
            }
            EstimatorSpec::Sgd(s) => E::Sgd(SgdConfig { lr: s.lr, clip: s.clip.get() }),
            EstimatorSpec::SgdReplay(s) => {
                E::SgdReplay(ReplayConfig { sgd: SgdConfig { lr: s.lr, clip: s.clip.get() }, every: s.replay_every })
            }
            EstimatorSpec::Adam(c) => E::Adam(*c),
            EstimatorSpec::AdamReference(c) => E::AdamReference(*c),
            EstimatorSpec::Mle(c) => E::Mle(*c),
            EstimatorSpec::Ensemble(c) => E::Ensemble(*c),
        })
    }

    /// Every hyper-parameter, in the order of its table struct (after [`EstimatorSpec::resolve`]).
    /// λ = "auto" (omd-exact): the cell's estimator takes the data's λ, not the resolved
    /// config's placeholder (after [`EstimatorSpec::resolve`], which "theory" may have replaced).
    pub fn lambda_auto(&self) -> bool {
        matches!(self, EstimatorSpec::OmdExact(s) if matches!(s.lambda, super::OrAuto::Auto))
    }

    pub fn hparams(&self) -> Vec<(String, toml::Value)> {
        let v = toml::Value::try_from(self).expect("estimator tables serialise");
        let t = v.as_table().expect("a table").clone();
        t.into_iter().filter(|(k, _)| k != "kind").collect()
    }
}

/// A hyper-parameter value as labels and cells.parquet show it: numbers as Rust prints them
/// (1, 0.001; in exponent form at or past 1e16 and below 1e-6: 1e300, 5e-7), words bare.
pub fn show(v: &toml::Value) -> String {
    match v {
        toml::Value::String(s) => s.clone(),
        toml::Value::Integer(i) => i.to_string(),
        // Rust writes every digit of a float; past 1e16 or below 1e-6 a label takes the
        // exponent form (`lr=1e300`, not 301 digits)
        toml::Value::Float(f) if *f != 0.0 && (f.abs() >= 1e16 || f.abs() < 1e-6) => format!("{f:e}"),
        toml::Value::Float(f) => f.to_string(),
        toml::Value::Boolean(b) => b.to_string(),
        other => other.to_string(),
    }
}

/// How θ_1 is drawn: (init, init_std) of a table.
pub fn init_of(init: Option<&str>, std: Option<f64>) -> Result<Init, (String, String)> {
    Ok(match (init, std) {
        (None | Some("zero"), None) => Init::Zero,
        (Some("zero"), Some(_)) => {
            return Err(("init_std".into(), "given with init = \"zero\": expected init = \"normal\"".into()))
        }
        (None | Some("normal"), Some(s)) => Init::Normal { std: Some(s) },
        (Some("normal"), None) => Init::Normal { std: None },
        (Some(other), _) => return Err(("init".into(), format!("`{other}`: expected \"zero\" or \"normal\""))),
    })
}

/// One combination of a swept `[[estimator]]` table: its scalar table and the keys it swept.
pub struct Combo {
    pub table: toml::Table,
    /// The keys the table gave more than one value, in written order.
    pub swept: Vec<String>,
}

/// Crosses the array-valued keys of a raw `[[estimator]]` table, first written key slowest.
/// Errors: (key, message).
pub fn expand(raw: &toml::Table) -> Result<Vec<Combo>, (String, String)> {
    let mut combos: Vec<toml::Table> = vec![toml::Table::new()];
    let mut swept = Vec::new();
    for (k, v) in raw {
        let vals: Vec<toml::Value> = match v {
            toml::Value::Array(_) if ["kind", "name", "init", "init_std", "theory"].contains(&k.as_str()) => {
                return Err((k.clone(), "cannot be swept: give one value".into()))
            }
            toml::Value::Array(a) if a.is_empty() => {
                return Err((k.clone(), "an empty array sweeps over nothing: give at least one value".into()))
            }
            toml::Value::Array(a) => a.clone(),
            other => vec![other.clone()],
        };
        if vals.len() > 1 {
            swept.push(k.clone());
        }
        combos = combos
            .into_iter()
            .flat_map(|c| {
                vals.iter().map(move |x| {
                    let mut c = c.clone();
                    c.insert(k.clone(), x.clone());
                    c
                })
            })
            .collect();
    }
    Ok(combos.into_iter().map(|table| Combo { table, swept: swept.clone() }).collect())
}

/// Reads one combination: (init, the kind's spec). Errors name the key: an unknown key, a
/// key of another kind, a value of the wrong type.
pub fn read(table: &toml::Table) -> Result<(Init, EstimatorSpec), (String, String)> {
    let mut t = table.clone();
    let kind = match t.get("kind") {
        None => return Err(("kind".into(), "missing: expected one of the estimator names".into())),
        Some(toml::Value::String(k)) => k.parse::<estimators::Kind>().map_err(|m| ("kind".to_string(), m))?,
        Some(other) => return Err(("kind".into(), format!("{other}: expected an estimator name"))),
    };
    let init = t.remove("init");
    let std = t.remove("init_std");
    let init = match (&init, &std) {
        (Some(toml::Value::String(_)) | None, Some(toml::Value::Float(_) | toml::Value::Integer(_)) | None) => {
            let as_f = |v: &toml::Value| v.as_float().or_else(|| v.as_integer().map(|i| i as f64));
            init_of(init.as_ref().and_then(|v| v.as_str()), std.as_ref().and_then(as_f))?
        }
        (Some(toml::Value::String(_)) | None, Some(v)) => {
            return Err(("init_std".into(), format!("{v}: expected a number")));
        }
        (Some(v), _) => return Err(("init".into(), format!("{v}: expected \"zero\" or \"normal\""))),
    };
    let spec = toml::Value::Table(t.clone()).try_into::<EstimatorSpec>().map_err(|e| {
        let msg = e.message().trim().to_string();
        // "unknown field `x`, expected one of `a`, `b`" → the key and the kind's keys
        if let Some(rest) = msg.strip_prefix("unknown field `") {
            let key = rest.split('`').next().unwrap_or_default().to_string();
            let expected = rest.split_once("expected ").map(|(_, e)| e.replace('`', "")).unwrap_or_default();
            let expected = expected.strip_prefix("one of ").unwrap_or(&expected).to_string();
            return (key, format!("not a hyper-parameter of `{kind}`: expected one of {expected}"));
        }
        // a wrong type: find the key by reading each alone
        let key = t
            .iter()
            .filter(|(k, _)| *k != "kind")
            .find(|(k, v)| {
                let mut one = toml::Table::new();
                one.insert("kind".into(), toml::Value::String(kind.to_string()));
                one.insert((*k).clone(), (*v).clone());
                toml::Value::Table(one).try_into::<EstimatorSpec>().is_err()
            })
            .map(|(k, _)| k.clone())
            .unwrap_or_else(|| "kind".into());
        (key, msg)
    })?;
    Ok((init, spec))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(s: &str) -> toml::Table {
        toml::from_str(s).unwrap()
    }

    /// Labels keep Rust's plain form for ordinary values and take the exponent form at the
    /// extremes, so that `lr = 1e300` does not become a 301-digit label.
    #[test]
    fn extreme_values_show_in_exponent_form() {
        let f = |x: f64| show(&toml::Value::Float(x));
        assert_eq!(
            (f(0.5), f(2.0), f(0.001), f(0.0), f(-3e-5)),
            ("0.5".into(), "2".into(), "0.001".into(), "0".into(), "-0.00003".into())
        );
        assert_eq!((f(1e300), f(5e-7), f(-2.5e20)), ("1e300".into(), "5e-7".into(), "-2.5e20".into()));
        assert_eq!(show(&toml::Value::Integer(7)), "7");
    }

    /// Every estimator name reads into the variant of that kind, with the estimators' defaults.
    #[test]
    fn every_kind_reads_with_its_defaults() {
        for k in estimators::Kind::ALL {
            let (_, mut s) = read(&table(&format!("kind = \"{k}\""))).unwrap();
            let cfg = s.resolve(Bounds { theta_norm_feature_norm_dim: None }).unwrap();
            assert_eq!(cfg.kind(), k);
            assert_eq!(cfg, EstimatorConfig::default_for(k), "{k}: defaults");
            // serialising and reading back gives the same spec
            let mut again = toml::Table::new();
            again.insert("kind".into(), toml::Value::String(k.to_string()));
            again.extend(s.hparams());
            assert_eq!(read(&again).unwrap().1, s, "{k}: round trip");
        }
    }

    /// The keys [`CommonKeys`] documents are read for every kind.
    #[test]
    fn every_kind_takes_the_common_keys() {
        let v = schemars::schema_for!(CommonKeys).to_value();
        let keys: Vec<String> = v["properties"].as_object().unwrap().keys().cloned().collect();
        let mut keys = keys;
        keys.sort();
        assert_eq!(keys, ["init", "init_std", "kind", "name"]);
        for k in estimators::Kind::ALL {
            // `name` is taken out by the plan before `read` (plan::configs; tests/records.rs)
            read(&table(&format!("kind = \"{k}\"\ninit = \"normal\"\ninit_std = 0.5"))).unwrap();
        }
    }

    #[test]
    fn keys_of_other_kinds_and_wrong_types_name_the_key() {
        let (k, m) = read(&table("kind = \"omd-exact\"\nlr = 0.1")).unwrap_err();
        assert_eq!(k, "lr");
        assert!(m.contains("not a hyper-parameter of `omd-exact`") && m.contains("eta"), "{m}");
        let (k, _) = read(&table("kind = \"sgd\"\nlr = 0.1\nclip = true")).unwrap_err();
        assert_eq!(k, "clip");
        let (k, m) = read(&table("kind = \"sgdd\"")).unwrap_err();
        assert_eq!(k, "kind");
        assert!(m.contains("unknown estimator"), "{m}");
        let (_, mut s) = read(&table("kind = \"omd-reference\"\nbeta1 = 0.5")).unwrap();
        assert_eq!(s.resolve(Bounds { theta_norm_feature_norm_dim: None }).unwrap_err().0, "beta1");
    }

    #[test]
    fn sweeps_cross_in_written_order() {
        let c = expand(&table("kind = \"sgd\"\nlr = [1, 2]\nclip = [\"none\", 3.0, 4.0]")).unwrap();
        assert_eq!(c.len(), 6);
        assert_eq!(c[0].swept, ["lr", "clip"]);
        let lr: Vec<String> = c.iter().map(|c| show(&c.table["lr"])).collect();
        assert_eq!(lr, ["1", "1", "1", "2", "2", "2"]);
        assert!(expand(&table("kind = \"sgd\"\nlr = []")).is_err());
        assert!(expand(&table("kind = [\"sgd\", \"adam\"]")).is_err());
    }
}
