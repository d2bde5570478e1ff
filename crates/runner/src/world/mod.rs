//! The world of a run: the only stage that reads datasets, runs an LLM or builds a bank of
//! generated responses, and the checks that need the data (dimensions agree, enough rows,
//! chunks ≤ prompts), each error naming its spec key. It hands the cells what they draw pairs
//! from ([`World`]) and reports what only the data can tell ([`DataFacts`]: d, the samples per
//! prompt, the number of prompts); it never edits the spec — the plan completes the cells' copy
//! with the facts ([`crate::plan::resolve`]).
//!
//! - [`env`]: the synthetic contextual dueling bandit (and the environment over a [`env::Bank`]);
//! - [`arrow`]: a parquet row's cells as JSON (how [`datasets`] reads parquet files);
//! - [`datasets`], [`dataset`]: preference datasets → pairs → φ;
//! - [`pairs`]: "bring your own features" parquet files and order files;
//! - [`extract`]: φ through the feature cache (`onepass features extract` too);
//! - [`generated`]: a policy's responses, their φ and an oracle's rewards.

pub mod arrow;
pub mod dataset;
pub mod datasets;
pub mod env;
pub mod extract;
pub mod generated;
pub mod online;
pub mod pairs;
pub mod reward;

pub use crate::plan::DataFacts;
use crate::plan::{Locator, Plan};
use crate::progress::Mode;
use crate::spec::{DataScale, EnvKind, Order, Setting, Spec, SpecError};
use pairs::{read_pairs, PairData, Pairs};
use std::sync::Arc;

/// What the cells of a run share.
#[derive(Clone, Debug)]
pub struct World {
    /// The plan's spec completed with [`World::facts`] ([`crate::plan::resolve`]): env.dim
    /// (every data kind), env.arms and env.contexts (generated), stream.samples (deploy on
    /// generated responses: one pair per prompt) and the data's scale.
    pub spec: Spec,
    /// What the data says.
    pub facts: DataFacts,
    /// The plan's configs resolved for their cells against `spec` ([`crate::plan::CellConfig`]):
    /// what the cells run, and all they read of the spec.
    pub configs: Vec<crate::plan::CellConfig>,
    /// kind = "features" or "dataset": the pairs, read once.
    pub data: Option<Arc<PairData>>,
    /// kind = "generated": the responses, their φ and rewards.
    pub generated: Option<Arc<generated::Generated>>,
    /// deploy.policy with an arm that learns: the policy's frozen weights, the feature model
    /// and the oracle every cell's policy uses.
    pub online: Option<Arc<online::Online>>,
    /// `[reward] update = "lora" | "full"`: the feature model's weights every cell's reward
    /// model starts from.
    pub reward: Option<Arc<reward::RewardBase>>,
}

/// The warning for models asked to compute φ or rewards in bf16 on a CPU whose bf16 products
/// are slow (`slow`: no AVX-512 BF16, or `ONEPASS_CPU=avx2`): which keys, on which CPU, what it
/// costs.
/// None when no model computes in bf16 on the CPU, or bf16 is fast here.
pub fn slow_bf16_warning(spec: &Spec, slow: bool) -> Option<String> {
    use crate::spec::{DType, Device};
    let on_cpu = |d: Device| {
        d == Device::Cpu
            || (d == Device::Auto
                && !candle_core::utils::cuda_is_available()
                && !candle_core::utils::metal_is_available())
    };
    let mut keys = Vec::new();
    let mut see = |key: &'static str, dtype: DType, device: Device| {
        if dtype == DType::Bf16 && on_cpu(device) {
            keys.push(key);
        }
    };
    if let Some(d) = &spec.data {
        see("data.dtype", d.dtype, d.device);
    }
    // generate.dtype too: decoding streams the weights once per token, and half the bytes had
    // paid on an AVX-512 machine capped at AVX2 against candle's f32 gemm (182 against 137
    // tok/s), but on a real AVX2-only Zen 3 the packed f32 products generate faster (263 against
    // 196 tok/s, issue 35)
    if let Some(g) = &spec.generate {
        see("generate.dtype", g.dtype, g.device);
    }
    if let Some(f) = &spec.features {
        see("features.dtype", f.dtype, f.device);
    }
    if let Some(o) = &spec.oracle {
        see("oracle.dtype", o.dtype, o.device);
    }
    // the policy's bf16 products train on the same kernels (the policy lives where it generates)
    if let (Some(p), Some(g)) = (&spec.policy, &spec.generate) {
        if p.dtype == crate::spec::policy::TrainDtype::Bf16 && on_cpu(g.device) {
            keys.push("policy.dtype");
        }
    }
    if keys.is_empty() || !slow {
        return None;
    }
    Some(format!(
        "{} = \"bf16\" on a CPU without bf16 instructions ({}): the bf16 products widen every weight in software and run slower than f32's (on an AVX2-only Zen 3: φ at 0.7x of f32, generation at 0.75x); \"f32\" is the fast choice here",
        keys.join(", "),
        features::cpu::summary()
    ))
}

/// Reads the data of `plan` (and runs its models); `progress` says how stages report on stderr.
/// The spec is read, never changed: what the data says comes back as [`DataFacts`], and the
/// plan completes the cells' spec with them ([`crate::plan::resolve`]).
pub fn build(plan: &Plan, progress: Mode) -> Result<World, SpecError> {
    let keys = plan.keys();
    let spec = &plan.spec;
    if let Some(w) = slow_bf16_warning(spec, kernels::bf16::is_slow()) {
        eprintln!("onepass: warning: {w}");
    }
    let (mut data, mut generated, mut online, mut reward) = (None, None, None, None);
    let (mut dim, mut bank, mut samples) = (spec.env.dim, None, None);
    let learns_features = spec.reward.as_ref().is_some_and(|r| r.update != crate::spec::RewardUpdate::Head);
    match spec.env.kind {
        EnvKind::Synthetic => {}
        EnvKind::Features | EnvKind::Dataset => {
            let d = if spec.env.kind == EnvKind::Features {
                load_features(spec, keys)?
            } else {
                load_dataset(spec, keys, progress, learns_features)?
            };
            if learns_features {
                let d = spec.data.as_ref().expect("the plan requires [data] for [reward] update");
                let base = reward::RewardBase::load(&d.phi(), None)
                    .map_err(|e| keys.err(&["reward", "update"], format!("{e:#}")))?;
                reward = Some(Arc::new(base));
            }
            dim = d.d;
            data = Some(Arc::new(d));
        }
        EnvKind::Generated => {
            let holdout = plan.policy.as_ref().map_or(0, |p| p.eval_prompts);
            let g = load_generated(spec, keys, holdout, progress)?;
            (dim, bank) = (g.bank.d, Some((g.bank.k, g.bank.contexts.len())));
            if spec.setting == Setting::Deploy {
                // one labelled pair per prompt
                samples = Some(g.bank.contexts.len() as u64);
            }
            if let (Some(p), Some(gs), Some(f), Some(o)) = (&plan.policy, &spec.generate, &spec.features, &spec.oracle)
            {
                // the held-out sampling streams of each seed index
                let eval_seeds: Vec<u64> =
                    (0..spec.seeds).map(|i| env::seed_of(spec.master_seed, i, env::Component::EvalSamples)).collect();
                let o = online::Online::load(gs, f, o, p, &g, &eval_seeds, progress)
                    .map_err(|e| keys.err(&["policy"], format!("{e:#}")))?;
                online = Some(Arc::new(o));
            }
            if learns_features {
                let f = spec.features.as_ref().expect("the plan requires [features] for [reward] update");
                let base = reward::RewardBase::load(&f.phi(), Some(&g))
                    .map_err(|e| keys.err(&["reward", "update"], format!("{e:#}")))?;
                reward = Some(Arc::new(base));
            }
            generated = Some(Arc::new(g));
        }
    }
    let data_scale = data_scale(spec, data.as_deref(), generated.as_deref());
    let facts = DataFacts { dim, bank, samples, data_scale };
    let spec = crate::plan::resolve(spec, &facts);
    let configs = plan.configs.iter().map(|c| crate::plan::CellConfig::of(&spec, c)).collect();
    Ok(World { spec, facts, configs, data, generated, online, reward })
}

impl World {
    /// What sizes a reward model whose features learn (`budget::RewardShape`): the feature
    /// model and the longest pair sequence.
    pub fn reward_shape(&self) -> Option<crate::budget::RewardShape> {
        let r = self.reward.as_ref()?;
        // the pairs' longest sequence; on generated responses (fresh ones to come) the
        // feature model's max_len
        let longest = match self.data.as_ref().and_then(|d| d.ids.as_ref()) {
            Some(ids) => ids.train.iter().chain(&ids.eval).map(|(a, b)| a.len().max(b.len())).max().unwrap_or(0),
            None => r.max_len,
        };
        Some(crate::budget::RewardShape {
            cfg: r.cfg.clone(),
            weights: r.base.values().map(|t| t.elem_count() as u64).sum(),
            seq_len: longest,
            on_device: !r.device.is_cpu(),
            device_free: features::model::device_memory(&r.device).map(|(free, _)| free),
            routed: policy::ops::Kernels::for_device(&r.device) == policy::ops::Kernels::Routed,
        })
    }
}

/// ‖z‖² of the first pairs ([`DataScale`]): the training pairs in file order; for the bandits,
/// arms 0 and 1 of the first contexts (the synthetic one as seed 0 draws it).
fn data_scale(spec: &Spec, data: Option<&PairData>, generated: Option<&generated::Generated>) -> DataScale {
    if let Some(d) = data {
        return DataScale::of(&d.train.z, d.d);
    }
    let (contexts, d) = match generated {
        Some(g) => (g.bank.contexts.clone(), g.bank.d),
        None => (env::Env::new(&spec.env, spec.master_seed, 0).contexts, spec.env.dim),
    };
    let z: Vec<f32> = contexts
        .iter()
        .take(DataScale::PAIRS)
        .flat_map(|c| c.phi[..d].iter().zip(&c.phi[d..2 * d]).map(|(a, b)| a - b).collect::<Vec<_>>())
        .collect();
    DataScale::of(&z, d)
}

/// Generates (or reads from the caches) the responses of a `kind = "generated"` environment and
/// checks the spec's env.dim, deploy.chunks and stream.samples against them (d, the prompts).
/// `holdout` prompts after the bank's are held out for a learning policy's evaluation.
fn load_generated(
    spec: &Spec,
    keys: Locator<'_>,
    holdout: usize,
    progress: Mode,
) -> Result<generated::Generated, SpecError> {
    let need = |k: &str| keys.err(&[k], "required when env.kind = \"generated\"".into());
    let g = spec.generate.as_ref().ok_or_else(|| need("generate"))?;
    let f = spec.features.as_ref().ok_or_else(|| need("features"))?;
    let o = spec.oracle.as_ref().ok_or_else(|| need("oracle"))?;
    let out = generated::build(g, f, o, holdout, progress).map_err(|e| {
        // the error begins with the table it is about (the features or oracle stage, the
        // policy's held-out prompts), so that table's line or `--set` is cited; generation
        // otherwise
        let msg = format!("{e:#}");
        let head = msg.split(':').next().unwrap_or("");
        let named = ["oracle", "features", "policy"].iter().any(|t| head == *t || head.starts_with(&format!("{t}.")))
            && head.chars().all(|c| c.is_ascii_lowercase() || c == '_' || c == '.');
        if !named {
            return keys.err(&["generate"], msg);
        }
        let path: Vec<&str> = head.split('.').collect();
        keys.err(&path, msg[head.len() + 1..].trim_start().to_string())
    })?;
    if keys.written(&["env", "dim"]) && spec.env.dim != out.bank.d {
        return Err(
            keys.err(&["env", "dim"], format!("{}, but the feature model gives {} features", spec.env.dim, out.bank.d))
        );
    }
    if spec.setting == Setting::Deploy {
        let p = out.bank.contexts.len() as u64;
        if spec.deploy.chunks > p as usize {
            return Err(
                keys.err(&["deploy", "chunks"], format!("{}: more chunks than the {p} prompts", spec.deploy.chunks))
            );
        }
        if keys.written(&["stream", "samples"]) && spec.stream.samples != p {
            return Err(keys.err(
                &["stream", "samples"],
                format!("{}: a deployment run labels one pair per prompt, i.e. {p}; leave it out", spec.stream.samples),
            ));
        }
    }
    Ok(out)
}

/// Reads and checks the pairs of a `kind = "features"` environment.
fn load_features(spec: &Spec, keys: Locator<'_>) -> Result<PairData, SpecError> {
    let env = &spec.env;
    let path =
        env.path.as_ref().ok_or_else(|| keys.err(&["env", "path"], "required when kind = \"features\"".into()))?;
    let mut train = read_pairs(path, None)?;
    if keys.written(&["env", "dim"]) && env.dim != train.d {
        return Err(keys.err(
            &["env", "dim"],
            format!("{}, but the rows of {} have {} features", env.dim, path.display(), train.d),
        ));
    }
    let eval = match &env.eval_path {
        Some(p) => read_pairs(p, Some(train.d))?,
        None => {
            if env.eval_pairs >= train.len() {
                return Err(keys.err(
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
        ids: None,
    };
    check_pairs(spec, keys, &mut data)?;
    Ok(data)
}

/// Checks shared by the pair-data kinds (features, dataset): the stream order and its length.
fn check_pairs(spec: &Spec, keys: Locator<'_>, data: &mut PairData) -> Result<(), SpecError> {
    if spec.env.order == Order::Indices {
        let p = spec
            .env
            .order_path
            .as_ref()
            .ok_or_else(|| keys.err(&["env", "order_path"], "required when env.order = \"indices\"".into()))?;
        let idx = pairs::read_order(p, data.train_total)?;
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
    }
    let n = data.order.as_ref().map_or(data.train.len(), |o| o.len()) as u64;
    if spec.stream.samples > n && !(spec.setting == Setting::Active && spec.active.replacement) {
        return Err(keys.err(
            &["stream", "samples"],
            format!(
                "{}: one pass over {} holds only {n} training pairs",
                spec.stream.samples,
                data.train_path.display()
            ),
        ));
    }
    Ok(())
}

/// kind = "dataset": the `[data]` table read, split and run through the feature model.
fn load_dataset(spec: &Spec, keys: Locator<'_>, progress: Mode, keep_ids: bool) -> Result<PairData, SpecError> {
    let d = spec.data.as_ref().ok_or_else(|| keys.err(&["data"], "required when env.kind = \"dataset\"".into()))?;
    let (mut data, report) = dataset::load(d, progress, keep_ids).map_err(|e| keys.err(&["data"], format!("{e:#}")))?;
    if keys.written(&["env", "dim"]) && spec.env.dim != data.d {
        return Err(keys.err(&["env", "dim"], format!("{}, but the model gives {} features", spec.env.dim, data.d)));
    }
    data.report = serde_json::to_value(&report).ok();
    check_pairs(spec, keys, &mut data)?;
    Ok(data)
}
