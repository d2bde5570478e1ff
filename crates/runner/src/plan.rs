//! A parsed spec → a validated plan: every cross-field check lives here. Estimator entries
//! are expanded over their swept hyper-parameters into configs; configs × (deploy: strategies)
//! × seeds are the cells.

use crate::pairs::{read_pairs, PairData, Pairs};
use crate::spec::*;
use estimators::*;
use selection::Strategy;
use std::path::Path;
use std::sync::Arc;

/// A hyper-parameter value, as swept.
#[derive(Clone, Debug, PartialEq)]
pub enum Hv {
    F(f64),
    U(u64),
    S(String),
    B(bool),
    N(OrNone),
}

impl std::fmt::Display for Hv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Hv::F(v) => write!(f, "{v}"),
            Hv::U(v) => write!(f, "{v}"),
            Hv::S(v) => write!(f, "{v}"),
            Hv::B(v) => write!(f, "{v}"),
            Hv::N(OrNone::None) => write!(f, "none"),
            Hv::N(OrNone::Value(v)) => write!(f, "{v}"),
        }
    }
}

/// The keys each kind accepts besides `kind`, `init` and `init_std`.
pub fn keys_of(kind: Kind) -> &'static [&'static str] {
    match kind {
        Kind::OmdExact => &["eta", "lambda", "radius", "theory"],
        Kind::OmdHvpCg => &["lr", "cg_steps", "lambda0", "schedule", "lambda_min"],
        Kind::OmdReference => &["lr", "lambda0", "growth", "cg_steps", "bf16_weights", "adam", "beta1", "beta2", "eps"],
        Kind::Sgd => &["lr", "clip"],
        Kind::Mle => &["ridge", "refit_every", "solver", "max_iters", "lbfgs_memory"],
        Kind::Adam | Kind::AdamReference => &["lr", "beta1", "beta2", "eps"],
        Kind::OmdHvpCgAdam => &["lr", "cg_steps", "lambda0", "schedule", "lambda_min", "beta1", "beta2", "eps"],
        Kind::SgdReplay => &["lr", "clip", "replay_every"],
    }
}

fn sweep_f(s: &Option<Sweep<f64>>) -> Option<Vec<Hv>> {
    s.as_ref().map(|s| s.0.iter().map(|&v| Hv::F(v)).collect())
}
fn sweep_u<T: Copy + Into<u64>>(s: &Option<Sweep<T>>) -> Option<Vec<Hv>> {
    s.as_ref().map(|s| s.0.iter().map(|&v| Hv::U(v.into())).collect())
}
fn sweep_s(s: &Option<Sweep<String>>) -> Option<Vec<Hv>> {
    s.as_ref().map(|s| s.0.iter().map(|v| Hv::S(v.clone())).collect())
}
fn sweep_n(s: &Option<Sweep<OrNone>>) -> Option<Vec<Hv>> {
    s.as_ref().map(|s| s.0.iter().map(|&v| Hv::N(v)).collect())
}

/// The hyper-parameter keys written in an entry, with their swept values (spec order).
fn written(e: &EstimatorEntry) -> Vec<(&'static str, Vec<Hv>)> {
    let usize_sweep = |s: &Option<Sweep<usize>>| s.as_ref().map(|s| s.0.iter().map(|&v| Hv::U(v as u64)).collect());
    let all: Vec<(&'static str, Option<Vec<Hv>>)> = vec![
        ("eta", sweep_f(&e.eta)),
        ("lambda", sweep_f(&e.lambda)),
        ("radius", sweep_n(&e.radius)),
        ("theory", e.theory.map(|b| vec![Hv::B(b)])),
        ("lr", sweep_f(&e.lr)),
        ("clip", sweep_n(&e.clip)),
        ("cg_steps", usize_sweep(&e.cg_steps)),
        ("lambda0", sweep_f(&e.lambda0)),
        ("schedule", sweep_s(&e.schedule)),
        ("lambda_min", sweep_f(&e.lambda_min)),
        ("growth", sweep_f(&e.growth)),
        ("bf16_weights", e.bf16_weights.map(|b| vec![Hv::B(b)])),
        ("adam", e.adam.map(|b| vec![Hv::B(b)])),
        ("beta1", sweep_f(&e.beta1)),
        ("beta2", sweep_f(&e.beta2)),
        ("eps", sweep_f(&e.eps)),
        ("replay_every", sweep_u(&e.replay_every)),
        ("ridge", sweep_f(&e.ridge)),
        ("refit_every", sweep_u(&e.refit_every)),
        ("solver", sweep_s(&e.solver)),
        ("max_iters", sweep_u(&e.max_iters)),
        ("lbfgs_memory", usize_sweep(&e.lbfgs_memory)),
    ];
    all.into_iter().filter_map(|(k, v)| v.map(|v| (k, v))).collect()
}

fn want_f(v: &Hv) -> Result<f64, String> {
    match v {
        Hv::F(x) => Ok(*x),
        Hv::U(x) => Ok(*x as f64),
        other => Err(format!("`{other}`: expected a number")),
    }
}
fn want_u(v: &Hv) -> Result<u64, String> {
    match v {
        Hv::U(x) => Ok(*x),
        other => Err(format!("`{other}`: expected a non-negative integer")),
    }
}
fn want_b(v: &Hv) -> Result<bool, String> {
    match v {
        Hv::B(x) => Ok(*x),
        other => Err(format!("`{other}`: expected true or false")),
    }
}
fn want_n(v: &Hv) -> Result<Option<f64>, String> {
    match v {
        Hv::N(x) => Ok(x.get()),
        Hv::F(x) => Ok(Some(*x)),
        other => Err(format!("`{other}`: expected a number or \"none\"")),
    }
}
fn want_s(v: &Hv) -> Result<&str, String> {
    match v {
        Hv::S(x) => Ok(x),
        other => Err(format!("`{other}`: expected a string")),
    }
}

/// Sets one hyper-parameter on a config of the right kind.
fn set(cfg: &mut EstimatorConfig, key: &str, v: &Hv) -> Result<(), String> {
    use EstimatorConfig as E;
    match (cfg, key) {
        (E::OmdExact(c), "eta") => c.eta = want_f(v)?,
        (E::OmdExact(c), "lambda") => c.lambda = want_f(v)?,
        (E::OmdExact(c), "radius") => c.radius = want_n(v)?,
        (E::OmdHvpCg(c) | E::OmdHvpCgAdam { cg: c, .. }, "cg_steps") => c.cg_steps = want_u(v)? as usize,
        (E::OmdHvpCg(c) | E::OmdHvpCgAdam { cg: c, .. }, "lambda0") => c.lambda0 = want_f(v)?,
        (E::OmdHvpCg(c) | E::OmdHvpCgAdam { cg: c, .. }, "lambda_min") => c.lambda_min = want_f(v)?,
        (E::OmdHvpCg(c) | E::OmdHvpCgAdam { cg: c, .. }, "schedule") => c.schedule = want_s(v)?.parse()?,
        (E::OmdHvpCg(c), "lr") => c.lr = want_f(v)?,
        (E::OmdHvpCgAdam { adam, .. }, "lr") => adam.lr = want_f(v)?,
        (E::OmdReference(c), "lr") => {
            c.lr = want_f(v)?;
            if let Some(a) = &mut c.adam {
                a.lr = c.lr;
            }
        }
        (E::OmdReference(c), "lambda0") => c.lambda0 = want_f(v)?,
        (E::OmdReference(c), "growth") => c.growth = want_f(v)?,
        (E::OmdReference(c), "cg_steps") => c.cg_steps = want_u(v)? as usize,
        (E::OmdReference(c), "bf16_weights") => c.bf16_weights = want_b(v)?,
        (E::OmdReference(c), "adam") => c.adam = want_b(v)?.then_some(AdamConfig { lr: c.lr, ..Default::default() }),
        (E::OmdReference(OmdReferenceConfig { adam: Some(a), .. }), k @ ("beta1" | "beta2" | "eps")) => {
            set_adam(a, k, v)?
        }
        (E::OmdReference(_), "beta1" | "beta2" | "eps") => return Err("needs `adam = true`".into()),
        (E::Adam(a) | E::AdamReference(a) | E::OmdHvpCgAdam { adam: a, .. }, k @ ("beta1" | "beta2" | "eps")) => {
            set_adam(a, k, v)?
        }
        (E::Adam(a) | E::AdamReference(a), "lr") => a.lr = want_f(v)?,
        (E::Sgd(s) | E::SgdReplay(ReplayConfig { sgd: s, .. }), "lr") => s.lr = want_f(v)?,
        (E::Sgd(s) | E::SgdReplay(ReplayConfig { sgd: s, .. }), "clip") => s.clip = want_n(v)?,
        (E::SgdReplay(r), "replay_every") => r.every = want_u(v)?,
        (E::Mle(m), "ridge") => m.ridge = want_f(v)?,
        (E::Mle(m), "refit_every") => m.refit_every = want_u(v)?,
        (E::Mle(m), "solver") => m.solver = want_s(v)?.parse()?,
        (E::Mle(m), "max_iters") => m.max_iters = u32::try_from(want_u(v)?).map_err(|_| "too large")?,
        (E::Mle(m), "lbfgs_memory") => m.lbfgs_memory = want_u(v)? as usize,
        (c, _) => {
            return Err(format!(
                "not a hyper-parameter of `{}`: expected one of {}",
                c.kind(),
                keys_of(c.kind()).join(", ")
            ))
        }
    }
    Ok(())
}

fn set_adam(a: &mut AdamConfig, key: &str, v: &Hv) -> Result<(), String> {
    let x = want_f(v)?;
    match key {
        "beta1" => a.beta1 = x,
        "beta2" => a.beta2 = x,
        _ => a.eps = x,
    }
    Ok(())
}

/// Every hyper-parameter of a config, for the resolved spec and the result tables.
pub fn hparams(cfg: &EstimatorConfig) -> Vec<(&'static str, Hv)> {
    use EstimatorConfig as E;
    let n = |o: Option<f64>| Hv::N(o.map_or(OrNone::None, OrNone::Value));
    let adam = |a: &AdamConfig| {
        vec![("lr", Hv::F(a.lr)), ("beta1", Hv::F(a.beta1)), ("beta2", Hv::F(a.beta2)), ("eps", Hv::F(a.eps))]
    };
    let cg = |c: &HvpCgConfig| {
        vec![
            ("cg_steps", Hv::U(c.cg_steps as u64)),
            ("lambda0", Hv::F(c.lambda0)),
            ("schedule", Hv::S(c.schedule.as_str().into())),
            ("lambda_min", Hv::F(c.lambda_min)),
        ]
    };
    match cfg {
        E::OmdExact(c) => vec![("eta", Hv::F(c.eta)), ("lambda", Hv::F(c.lambda)), ("radius", n(c.radius))],
        E::OmdHvpCg(c) => [vec![("lr", Hv::F(c.lr))], cg(c)].concat(),
        E::OmdHvpCgAdam { cg: c, adam: a } => [cg(c), adam(a)].concat(),
        E::OmdReference(c) => {
            let mut v = vec![
                ("lr", Hv::F(c.lr)),
                ("lambda0", Hv::F(c.lambda0)),
                ("growth", Hv::F(c.growth)),
                ("cg_steps", Hv::U(c.cg_steps as u64)),
                ("bf16_weights", Hv::B(c.bf16_weights)),
                ("adam", Hv::B(c.adam.is_some())),
            ];
            if let Some(a) = &c.adam {
                v.extend(adam(a).into_iter().skip(1));
            }
            v
        }
        E::Sgd(s) => vec![("lr", Hv::F(s.lr)), ("clip", n(s.clip))],
        E::SgdReplay(r) => vec![("lr", Hv::F(r.sgd.lr)), ("clip", n(r.sgd.clip)), ("replay_every", Hv::U(r.every))],
        E::Adam(a) | E::AdamReference(a) => adam(a),
        E::Mle(m) => vec![
            ("ridge", Hv::F(m.ridge)),
            ("refit_every", Hv::U(m.refit_every)),
            ("solver", Hv::S(m.solver.as_str().into())),
            ("max_iters", Hv::U(u64::from(m.max_iters))),
            ("lbfgs_memory", Hv::U(m.lbfgs_memory as u64)),
        ],
    }
}

/// One estimator with fixed hyper-parameters (and, in deploy, one strategy).
#[derive(Clone, Debug)]
pub struct ConfigPlan {
    pub config_id: usize,
    pub kind: Kind,
    pub cfg: EstimatorConfig,
    pub init: Init,
    /// Every hyper-parameter, rendered; `swept` names the ones the spec varied.
    pub hparams: Vec<(&'static str, Hv)>,
    pub swept: Vec<&'static str>,
    pub strategy: Option<Strategy>,
    /// Active: the selection rule of this config.
    pub rule: Option<ActiveRule>,
    /// Index of the expanded estimator config (shared by the strategies of a deploy run).
    pub estimator_index: usize,
    /// Index of the strategy in `deploy.strategies` or of the rule in `active.rule` (else 0).
    pub strategy_index: usize,
    /// e.g. `sgd lr=0.1` or `omd-exact / ucb`.
    pub label: String,
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
    pub spec: Spec,
    pub configs: Vec<ConfigPlan>,
    pub cells: Vec<CellPlan>,
    /// kind = "features": the pairs, read once and shared by every cell.
    pub data: Option<Arc<PairData>>,
    /// kind = "generated": the responses, their φ and rewards, shared by every cell.
    pub generated: Option<Arc<crate::generated::Generated>>,
}

impl Plan {
    /// The spec with every default filled and every sweep expanded: one `[[estimator]]` per config.
    pub fn resolved_spec(&self) -> Spec {
        let mut s = self.spec.clone();
        s.name = Some(self.name.clone());
        s.estimators = self
            .configs
            .iter()
            .filter(|c| c.strategy_index == 0)
            .map(|c| {
                let mut e = EstimatorEntry { kind: c.kind.to_string(), ..Default::default() };
                match c.init {
                    Init::Zero => e.init = Some("zero".into()),
                    Init::Normal { std } => {
                        e.init = Some("normal".into());
                        e.init_std = std;
                    }
                }
                for (k, v) in &c.hparams {
                    fill(&mut e, k, v);
                }
                e
            })
            .collect();
        s
    }
}

fn fill(e: &mut EstimatorEntry, key: &str, v: &Hv) {
    let f = || Some(Sweep::one(want_f(v).unwrap_or(f64::NAN)));
    let u = || want_u(v).unwrap_or(0);
    let s = || Some(Sweep::one(v.to_string()));
    let n = || {
        Some(Sweep::one(match v {
            Hv::N(x) => *x,
            Hv::F(x) => OrNone::Value(*x),
            _ => OrNone::None,
        }))
    };
    match key {
        "eta" => e.eta = f(),
        "lambda" => e.lambda = f(),
        "radius" => e.radius = n(),
        "lr" => e.lr = f(),
        "clip" => e.clip = n(),
        "cg_steps" => e.cg_steps = Some(Sweep::one(u() as usize)),
        "lambda0" => e.lambda0 = f(),
        "schedule" => e.schedule = s(),
        "lambda_min" => e.lambda_min = f(),
        "growth" => e.growth = f(),
        "bf16_weights" => e.bf16_weights = want_b(v).ok(),
        "adam" => e.adam = want_b(v).ok(),
        "beta1" => e.beta1 = f(),
        "beta2" => e.beta2 = f(),
        "eps" => e.eps = f(),
        "replay_every" => e.replay_every = Some(Sweep::one(u())),
        "ridge" => e.ridge = f(),
        "refit_every" => e.refit_every = Some(Sweep::one(u())),
        "solver" => e.solver = s(),
        "max_iters" => e.max_iters = Some(Sweep::one(u() as u32)),
        "lbfgs_memory" => e.lbfgs_memory = Some(Sweep::one(u() as usize)),
        _ => {}
    }
}

/// Two `[[estimator]]` entries of one kind (e.g. sgd with and without clipping) would share a
/// label: append the hyper-parameters whose values differ within each such group, or the entry's
/// index when none does.
fn disambiguate_labels(configs: &mut [ConfigPlan]) {
    let mut groups: std::collections::BTreeMap<String, Vec<usize>> = std::collections::BTreeMap::new();
    for (i, c) in configs.iter().enumerate() {
        groups.entry(c.label.clone()).or_default().push(i);
    }
    for (_, members) in groups.into_iter().filter(|(_, m)| m.len() > 1) {
        let first = &configs[members[0]].hparams;
        let differing: Vec<&'static str> = first
            .iter()
            .map(|(k, _)| *k)
            .filter(|k| {
                let val = |i: usize| configs[i].hparams.iter().find(|(kk, _)| kk == k).map(|(_, v)| v.to_string());
                members.iter().any(|&i| val(i) != val(members[0]))
            })
            .collect();
        for &i in &members {
            let extra: Vec<String> = if differing.is_empty() {
                vec![format!("#{}", configs[i].estimator_index)]
            } else {
                differing
                    .iter()
                    .filter_map(|k| configs[i].hparams.iter().find(|(kk, _)| kk == k).map(|(k, v)| format!("{k}={v}")))
                    .collect()
            };
            let c = &mut configs[i];
            c.label = match c.label.split_once(" / ") {
                Some((head, strategy)) => format!("{head} {} / {strategy}", extra.join(" ")),
                None => format!("{} {}", c.label, extra.join(" ")),
            };
        }
    }
}

/// β = "theory": √d · log(T/δ), the order of β̃_T in Lemma 1 (the constant is not given).
pub fn theory_beta(d: usize, t: u64, delta: f64) -> f64 {
    (d as f64).sqrt() * ((t.max(2) as f64) / delta).ln()
}

/// Validates `spec` (read from `file`, whose text is `text`) into a plan.
pub fn build(mut spec: Spec, file: &Path, text: &str) -> Result<Plan, SpecError> {
    let err = |path: &[&str], message: String| {
        let p: Vec<String> = path.iter().map(|s| s.to_string()).collect();
        let key = path
            .iter()
            .enumerate()
            .map(|(i, s)| {
                if s.parse::<usize>().is_ok() && i > 0 {
                    format!("[{s}]")
                } else if i > 0 {
                    format!(".{s}")
                } else {
                    s.to_string()
                }
            })
            .collect::<String>();
        SpecError { file: file.to_path_buf(), key, line: locate(text, &p), message }
    };
    let name = spec
        .name
        .clone()
        .unwrap_or_else(|| file.file_stem().map_or("run".into(), |s| s.to_string_lossy().into_owned()));
    if !name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) || name.is_empty() {
        return Err(err(
            &["name"],
            format!("`{name}`: expected letters, digits, `-`, `_` or `.` (it names the run directory)"),
        ));
    }
    let mut generated = None;
    let data = match spec.env.kind {
        EnvKind::Generated => {
            let g = load_generated(&mut spec, text, &err)?;
            generated = Some(Arc::new(g));
            None
        }
        EnvKind::Synthetic => {
            for k in ["path", "eval_path", "order", "order_path"] {
                if is_written(text, &["env", k]) {
                    return Err(err(&["env", k], "applies to kind = \"features\" only".into()));
                }
            }
            None
        }
        EnvKind::Features => {
            let data = load_features(&spec, text, &err)?;
            spec.env.dim = data.d;
            Some(Arc::new(data))
        }
        EnvKind::Dataset => {
            let data = load_dataset(&spec, text, &err)?;
            spec.env.dim = data.d;
            Some(Arc::new(data))
        }
    };
    if spec.env.kind != EnvKind::Dataset && spec.data.is_some() {
        return Err(err(&["data"], "applies to env.kind = \"dataset\" only".into()));
    }
    if spec.env.kind != EnvKind::Generated {
        for (k, given) in [
            ("generate", spec.generate.is_some()),
            ("features", spec.features.is_some()),
            ("oracle", spec.oracle.is_some()),
        ] {
            if given {
                return Err(err(&[k], "applies to env.kind = \"generated\" only".into()));
            }
        }
        for k in ["chunks", "prompt_order", "policy", "reset_each_chunk"] {
            if is_written(text, &["deploy", k]) {
                return Err(err(&["deploy", k], "applies to env.kind = \"generated\" only".into()));
            }
        }
    }
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
        (&["curvature", "lambda"], spec.curvature.lambda.is_finite() && spec.curvature.lambda > 0.0, "λ > 0"),
        (
            &["checkpoint", "every_s"],
            spec.checkpoint.every_s.is_finite() && spec.checkpoint.every_s >= 0.0,
            "seconds ≥ 0 (0: only at SIGINT/SIGTERM)",
        ),
    ];
    let ranks = spec.stream.ranks;
    if ranks == 0 {
        return Err(err(&["stream", "ranks"], "expected at least 1 head".into()));
    }
    if ranks > 1 && (spec.setting != Setting::Passive || spec.env.kind == EnvKind::Synthetic) {
        return Err(err(
            &["stream", "ranks"],
            format!("{ranks} heads: only the passive setting on pairs (env.kind = \"features\" or \"dataset\") runs rank-local heads"),
        ));
    }
    if spec.stream.samples < (ranks * spec.stream.batch_size) as u64 {
        return Err(err(
            &["stream", "samples"],
            format!(
                "{}: fewer than one micro-batch per head ({ranks} heads × batch {})",
                spec.stream.samples, spec.stream.batch_size
            ),
        ));
    }
    for (path, ok, expected) in checks {
        if !ok {
            return Err(err(path, format!("out of range: expected {expected}")));
        }
    }
    let chunked = spec.setting == Setting::Deploy && generated.is_some();
    if !chunked && spec.stream.samples % spec.stream.batch_size as u64 != 0 {
        return Err(err(
            &["stream", "samples"],
            format!("{} is not a multiple of batch_size = {}", spec.stream.samples, spec.stream.batch_size),
        ));
    }
    match spec.setting {
        Setting::Passive => {
            if let Beta::Value(b) = spec.passive.beta {
                if !(b.is_finite() && b >= 0.0) {
                    return Err(err(&["passive", "beta"], format!("{b}: expected a number ≥ 0 or \"theory\"")));
                }
            }
            if !(spec.passive.delta > 0.0 && spec.passive.delta < 1.0) {
                return Err(err(&["passive", "delta"], "expected 0 < δ < 1".into()));
            }
        }
        Setting::Active => {
            let a = &spec.active;
            if a.pool < 2 {
                return Err(err(&["active", "pool"], "expected a pool of at least 2 pairs".into()));
            }
            let stream_rule = a.rule.0.contains(&ActiveRule::Stream);
            if a.rule.0.contains(&ActiveRule::BestWorst)
                && matches!(spec.env.kind, EnvKind::Features | EnvKind::Dataset)
            {
                return Err(err(
                    &["active", "rule"],
                    "best-worst ranks the responses of fresh prompts: it needs env.kind = \"synthetic\" or \"generated\" (pairs files have two sides only)".into(),
                ));
            }
            if a.rule.0.is_empty() {
                return Err(err(&["active", "rule"], "an empty list: expected at least one rule".into()));
            }
            if stream_rule && !(1 <= a.keep && a.keep <= a.candidates) {
                return Err(err(
                    &["active", "keep"],
                    format!("{}: expected 1 ≤ keep ≤ candidates = {}", a.keep, a.candidates),
                ));
            }
            if stream_rule && spec.stream.batch_size != a.keep {
                return Err(err(
                    &["stream", "batch_size"],
                    format!(
                        "{}: the stream rule labels `keep` = {} pairs per step; set batch_size to it",
                        spec.stream.batch_size, a.keep
                    ),
                ));
            }
            if !a.replacement && spec.stream.samples > a.pool as u64 {
                return Err(err(
                    &["active", "replacement"],
                    format!("false, but T = {} exceeds the pool of {} pairs", spec.stream.samples, a.pool),
                ));
            }
            if !(a.v0 > 0.0 && a.v0.is_finite()) {
                return Err(err(&["active", "v0"], "expected V₀ > 0".into()));
            }
        }
        Setting::Deploy => {
            if !(spec.deploy.delta > 0.0 && spec.deploy.delta < 1.0) {
                return Err(err(&["deploy", "delta"], "expected 0 < δ < 1".into()));
            }
        }
    }
    let strategies: Vec<Option<Strategy>> = if spec.setting == Setting::Deploy {
        let mut out = Vec::new();
        for (i, name) in spec.deploy.strategies.0.iter().enumerate() {
            let i = i.to_string();
            let mut s: Strategy = name.parse().map_err(|m| err(&["deploy", "strategies"], m))?;
            match &mut s {
                Strategy::BestQuantile { q } => *q = spec.deploy.q,
                Strategy::Ucb { beta } => {
                    *beta = match spec.deploy.beta {
                        Beta::Theory => theory_beta(env.dim, spec.stream.samples, spec.deploy.delta),
                        Beta::Value(b) => b,
                    }
                }
                _ => {}
            }
            s.validate(env.arms).map_err(|m| err(&["deploy", "strategies"], format!("{m} (entry {i})")))?;
            out.push(Some(s));
        }
        out
    } else {
        vec![None]
    };
    // deploy: the strategies; active: the rules (labelled only when there are several)
    let rules: Vec<Option<ActiveRule>> = if spec.setting == Setting::Active {
        spec.active.rule.0.iter().map(|r| Some(*r)).collect()
    } else {
        vec![None]
    };
    let arms: Vec<(Option<Strategy>, Option<ActiveRule>)> =
        strategies.iter().flat_map(|s| rules.iter().map(move |r| (*s, *r))).collect();
    if spec.estimators.is_empty() {
        return Err(err(&[], "no [[estimator]] tables: expected at least one".into()));
    }
    let planned_steps = spec.stream.samples / spec.stream.batch_size as u64;
    let mut configs = Vec::new();
    for (ei, e) in spec.estimators.iter().enumerate() {
        let eis = ei.to_string();
        let at = |k: &'static str| -> Vec<&str> { vec!["estimator", eis.as_str(), k] };
        let kind: Kind = e.kind.parse().map_err(|m| err(&at("kind"), m))?;
        let init = match (e.init.as_deref(), e.init_std) {
            (None | Some("zero"), None) => Init::Zero,
            (Some("zero"), Some(_)) => {
                return Err(err(&at("init_std"), "given with init = \"zero\": expected init = \"normal\"".into()))
            }
            (None, Some(s)) | (Some("normal"), Some(s)) => Init::Normal { std: Some(s) },
            (Some("normal"), None) => Init::Normal { std: None },
            (Some(other), _) => return Err(err(&at("init"), format!("`{other}`: expected \"zero\" or \"normal\""))),
        };
        let keys = written(e);
        for (k, _) in &keys {
            if !keys_of(kind).contains(k) {
                return Err(err(
                    &at(k),
                    format!("not a hyper-parameter of `{kind}`: expected one of {}", keys_of(kind).join(", ")),
                ));
            }
        }
        let mut base = EstimatorConfig::default_for(kind);
        if kind == Kind::OmdExact && e.theory == Some(true) {
            if data.is_some() || generated.is_some() {
                return Err(err(
                    &at("theory"),
                    "needs the bounds B and L of the synthetic environment; kind = \"features\" has none".into(),
                ));
            }
            base = EstimatorConfig::OmdExact(OmdExactConfig::theory(env.theta_norm, env.feature_norm, env.dim));
        }
        // `adam = true` first, so the Adam keys find their config
        let mut keys = keys;
        keys.sort_by_key(|(k, _)| *k != "adam");
        let swept: Vec<&'static str> = keys.iter().filter(|(_, v)| v.len() > 1).map(|(k, _)| *k).collect();
        // cartesian product, first key slowest
        let mut combos: Vec<Vec<(&'static str, Hv)>> = vec![vec![]];
        for (k, vals) in keys.iter().filter(|(k, _)| *k != "theory") {
            combos = combos
                .into_iter()
                .flat_map(|c| vals.iter().map(move |v| [c.clone(), vec![(*k, v.clone())]].concat()))
                .collect();
        }
        for combo in combos {
            let estimator_index = configs.len() / arms.len();
            let mut cfg = base;
            for (k, v) in &combo {
                set(&mut cfg, k, v).map_err(|m| err(&at(k), m))?;
            }
            let setup = Setup { dim: env.dim, init, seed: 0, planned_steps: Some(planned_steps) };
            cfg.validate(&setup).map_err(|e| match &e {
                EstimatorError::BadConfig { field, .. } => err(&at(field), e.to_string()),
                _ => err(&at("kind"), e.to_string()),
            })?;
            let sweep_label: Vec<String> =
                combo.iter().filter(|(k, _)| swept.contains(k)).map(|(k, v)| format!("{k}={v}")).collect();
            for (strategy_index, (strategy, rule)) in arms.iter().enumerate() {
                let mut label = kind.to_string();
                if !sweep_label.is_empty() {
                    label = format!("{label} {}", sweep_label.join(" "));
                }
                if let Some(s) = strategy {
                    label = format!("{label} / {s}");
                }
                if let (Some(r), true) = (rule, rules.len() > 1) {
                    label = format!("{label} / {r}");
                }
                configs.push(ConfigPlan {
                    config_id: configs.len(),
                    kind,
                    cfg,
                    init,
                    hparams: hparams(&cfg),
                    swept: swept.clone(),
                    strategy: *strategy,
                    rule: *rule,
                    estimator_index,
                    strategy_index,
                    label,
                });
            }
        }
    }
    disambiguate_labels(&mut configs);
    let cells = configs
        .iter()
        .flat_map(|c| (0..spec.seeds).map(move |s| (c.config_id, s)))
        .enumerate()
        .map(|(i, (config, seed))| CellPlan { cell_id: format!("c{i:04}"), config, seed })
        .collect();
    Ok(Plan { name, spec, configs, cells, data, generated })
}

/// Generates (or reads from the caches) the responses of a `kind = "generated"` environment and
/// fills env.dim, env.arms, env.contexts and, for deploy, stream.samples from them.
fn load_generated(
    spec: &mut Spec,
    text: &str,
    err: &dyn Fn(&[&str], String) -> SpecError,
) -> Result<crate::generated::Generated, SpecError> {
    for k in
        ["contexts", "fresh_contexts", "arms", "features", "feature_norm", "theta_norm", "path", "eval_path", "order"]
    {
        if is_written(text, &["env", k]) {
            return Err(err(
                &["env", k],
                "does not apply to kind = \"generated\" (see [generate], [features], [oracle])".into(),
            ));
        }
    }
    let g =
        spec.generate.as_ref().ok_or_else(|| err(&["generate"], "required when env.kind = \"generated\"".into()))?;
    let f =
        spec.features.as_ref().ok_or_else(|| err(&["features"], "required when env.kind = \"generated\"".into()))?;
    let o = spec.oracle.as_ref().ok_or_else(|| err(&["oracle"], "required when env.kind = \"generated\"".into()))?;
    g.check().map_err(|(k, m)| err(&["generate", k], m))?;
    f.check().map_err(|(k, m)| err(&["features", k], m))?;
    o.check().map_err(|(k, m)| err(&["oracle", k], m))?;
    if spec.setting == Setting::Deploy && spec.deploy.chunks == 0 {
        return Err(err(&["deploy", "chunks"], "0: expected 1 ≤ chunks ≤ the number of prompts".into()));
    }
    let progress = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let out = crate::generated::build(g, f, o, progress).map_err(|e| err(&["generate"], format!("{e:#}")))?;
    let given = |k: &str| is_written(text, &["env", k]);
    if given("dim") && spec.env.dim != out.bank.d {
        return Err(err(
            &["env", "dim"],
            format!("{}, but the feature model gives {} features", spec.env.dim, out.bank.d),
        ));
    }
    spec.env.dim = out.bank.d;
    spec.env.arms = out.bank.k;
    spec.env.contexts = out.bank.contexts.len();
    if spec.setting == Setting::Deploy {
        let p = out.bank.contexts.len() as u64;
        if spec.deploy.chunks > p as usize {
            return Err(err(
                &["deploy", "chunks"],
                format!("{}: more chunks than the {p} prompts", spec.deploy.chunks),
            ));
        }
        if is_written(text, &["stream", "samples"]) && spec.stream.samples != p {
            return Err(err(
                &["stream", "samples"],
                format!("{}: a deployment run labels one pair per prompt, i.e. {p}; leave it out", spec.stream.samples),
            ));
        }
        spec.stream.samples = p;
    }
    Ok(out)
}

/// Reads and checks the pairs of a `kind = "features"` environment.
fn load_features(spec: &Spec, text: &str, err: &dyn Fn(&[&str], String) -> SpecError) -> Result<PairData, SpecError> {
    let given = |k: &str| is_written(text, &["env", k]);
    for k in ["contexts", "fresh_contexts", "arms", "features", "feature_norm", "theta_norm"] {
        if given(k) {
            return Err(err(&["env", k], "applies to kind = \"synthetic\" only".into()));
        }
    }
    if spec.setting == Setting::Deploy {
        return Err(err(
            &["env", "kind"],
            "deploy needs several arms per context; kind = \"features\" holds labelled pairs (use passive or active)"
                .into(),
        ));
    }
    let env = &spec.env;
    let path = env.path.as_ref().ok_or_else(|| err(&["env", "path"], "required when kind = \"features\"".into()))?;
    let mut train = read_pairs(path, None)?;
    if given("dim") && env.dim != train.d {
        return Err(err(
            &["env", "dim"],
            format!("{}, but the rows of {} have {} features", env.dim, path.display(), train.d),
        ));
    }
    let eval = match &env.eval_path {
        Some(p) => read_pairs(p, Some(train.d))?,
        None => {
            if env.eval_pairs >= train.len() {
                return Err(err(
                    &["env", "eval_pairs"],
                    format!(
                        "{}: the held-out rows are the last `eval_pairs` rows of {}, which has only {} (or give eval_path)",
                        env.eval_pairs,
                        path.display(),
                        train.len()
                    ),
                ));
            }
            let n = train.len() - env.eval_pairs;
            Pairs {
                d: train.d,
                z: train.z.split_off(n * train.d),
                y: train.y.split_off(n),
                digest: train.digest.clone(),
            }
        }
    };
    let train_total = train.len();
    let mut data = PairData {
        d: train.d,
        train,
        eval,
        train_path: path.clone(),
        eval_path: env.eval_path.clone(),
        report: None,
        train_origin: Vec::new(),
        train_total,
        order: None,
    };
    check_pairs(spec, text, err, &mut data)?;
    Ok(data)
}

/// Checks shared by the pair-data kinds (features, dataset).
fn check_pairs(
    spec: &Spec,
    text: &str,
    err: &dyn Fn(&[&str], String) -> SpecError,
    data: &mut PairData,
) -> Result<(), SpecError> {
    if spec.env.order == Order::Indices {
        let p = spec
            .env
            .order_path
            .as_ref()
            .ok_or_else(|| err(&["env", "order_path"], "required when env.order = \"indices\"".into()))?;
        let idx = crate::pairs::read_order(p, data.train_total)?;
        // file index (before dropping) → training row; dropped pairs map to nothing
        let pos: Vec<Option<usize>> = if data.train_origin.is_empty() {
            (0..data.train_total).map(Some).collect()
        } else {
            let mut pos = vec![None; data.train_total];
            for (row, &o) in data.train_origin.iter().enumerate() {
                pos[o] = Some(row);
            }
            pos
        };
        data.order = Some(idx.into_iter().filter_map(|i| pos[i]).collect());
    } else if is_written(text, &["env", "order_path"]) {
        return Err(err(&["env", "order_path"], "applies to env.order = \"indices\" only".into()));
    }
    let n = data.order.as_ref().map_or(data.train.len(), |o| o.len()) as u64;
    if spec.stream.samples > n && !(spec.setting == Setting::Active && spec.active.replacement) {
        return Err(err(
            &["stream", "samples"],
            format!(
                "{}: one pass over {} holds only {n} training pairs",
                spec.stream.samples,
                data.train_path.display()
            ),
        ));
    }
    if spec.setting == Setting::Active && is_written(text, &["active", "pool"]) {
        return Err(err(&["active", "pool"], "the pool is every training pair of the data".into()));
    }
    Ok(())
}

/// kind = "dataset": the `[data]` table read, split and run through the feature model.
fn load_dataset(spec: &Spec, text: &str, err: &dyn Fn(&[&str], String) -> SpecError) -> Result<PairData, SpecError> {
    let given = |k: &str| is_written(text, &["env", k]);
    for k in [
        "contexts",
        "fresh_contexts",
        "arms",
        "features",
        "feature_norm",
        "theta_norm",
        "path",
        "eval_path",
        "eval_pairs",
    ] {
        if given(k) {
            return Err(err(&["env", k], "does not apply to kind = \"dataset\" (the data is named in [data])".into()));
        }
    }
    if spec.setting == Setting::Deploy {
        return Err(err(
            &["env", "kind"],
            "deploy needs several arms per context; kind = \"dataset\" holds labelled pairs (use passive or active)"
                .into(),
        ));
    }
    let d = spec.data.as_ref().ok_or_else(|| err(&["data"], "required when env.kind = \"dataset\"".into()))?;
    d.check().map_err(|(k, m)| err(&["data", k], m))?;
    let progress = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let (mut data, report) = crate::dataset_env::load(d, progress).map_err(|e| err(&["data"], format!("{e:#}")))?;
    if given("dim") && spec.env.dim != data.d {
        return Err(err(&["env", "dim"], format!("{}, but the model gives {} features", spec.env.dim, data.d)));
    }
    data.report = serde_json::to_value(&report).ok();
    check_pairs(spec, text, err, &mut data)?;
    Ok(data)
}
