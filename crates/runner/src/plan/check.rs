//! The cross-field checks the spec alone decides: the environment's kind and its keys, ranges,
//! the setting's tables, the generation backend, the reward model, the active rules, `[policy]`.

use super::config::{arms_per_context, parametrize, ConfigPlan};
use super::keys::Locator;
use crate::spec::*;

/// Which keys and tables apply to which `env.kind`, and the checks of each kind's tables that
/// need no file.
pub(super) fn check_env_kind(spec: &Spec, keys: Locator<'_>) -> Result<(), SpecError> {
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
pub(super) fn check_ranges(spec: &Spec, keys: Locator<'_>) -> Result<(), SpecError> {
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
pub(super) fn check_setting(spec: &Spec, keys: Locator<'_>) -> Result<(), SpecError> {
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
pub(super) fn check_backend(spec: &Spec, keys: Locator<'_>, configs: &[ConfigPlan]) -> Result<(), SpecError> {
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

pub(super) fn check_reward(spec: &Spec, keys: Locator<'_>, configs: &[ConfigPlan]) -> Result<(), SpecError> {
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
pub(super) fn check_policy(
    spec: &Spec,
    keys: Locator<'_>,
    warnings: &mut Vec<String>,
) -> Result<Option<PolicySpec>, SpecError> {
    let learns = spec.deploy.policy.0.iter().any(|p| p.learns());
    let generated_deploy = spec.setting == Setting::Deploy && spec.env.kind == EnvKind::Generated;
    if spec.policy.is_some() && !generated_deploy {
        return Err(keys.err(
            &["policy"],
            "applies only to setting = \"deploy\" with env.kind = \"generated\", where deploy.policy may include \"rloo\", \"dpo\" or \"ppo\"".into(),
        ));
    }
    if spec.policy.is_some() {
        warn_unused_policy_tables(spec, keys, learns, warnings);
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
        check_policy_sampling(g, keys)?;
        check_policy_model(spec, p, g, keys)?;
        check_policy_rollouts(spec, p, g, keys)?;
    }
    Ok(Some(resolved))
}

/// The one warning naming the `[policy]` tables no deployed arm reads: `[policy]` itself when
/// no arm learns, `[policy.<arm>]` when its arm is not in `deploy.policy`.
fn warn_unused_policy_tables(spec: &Spec, keys: Locator<'_>, learns: bool, warnings: &mut Vec<String>) {
    use crate::spec::DeployPolicy as P;
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

/// A learning policy samples at temperature 1 without a nucleus.
fn check_policy_sampling(g: &GenerateSpec, keys: Locator<'_>) -> Result<(), SpecError> {
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
    Ok(())
}

/// What the learner's model allows: ppo's θ critic needs features.model = generate.policy,
/// bf16 products need frozen LoRA-packed weights on the CPU, and a saved adapter needs a LoRA arm.
fn check_policy_model(spec: &Spec, p: &PolicySpec, g: &GenerateSpec, keys: Locator<'_>) -> Result<(), SpecError> {
    use crate::spec::DeployPolicy as P;
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
    if full && has(crate::spec::DeployPolicy::Dpo) && !lora_arm && p.save_adapter != crate::spec::SaveAdapter::None {
        return Err(keys.err(
            &["policy", "dpo", "parameters"],
            "\"full\" trains every weight: there is no LoRA adapter to save; expected policy.save_adapter = \"none\" (or parameters = \"lora\")".into(),
        ));
    }
    Ok(())
}

/// Rollout counts against generate.n: at most n from the chunk's samples, at least 2 for
/// rloo's and grpo's leave-one-out baselines, and eval_samples in whole groups of n.
fn check_policy_rollouts(spec: &Spec, p: &PolicySpec, g: &GenerateSpec, keys: Locator<'_>) -> Result<(), SpecError> {
    use crate::spec::DeployPolicy as P;
    let has = |a| spec.deploy.policy.0.contains(&a);
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
    Ok(())
}
