//! `env.kind = "generated"`: a policy model samples n responses to each prompt (`[generate]`),
//! a feature model gives the learner's φ (`[features]`), and an oracle (`[oracle]`) scores
//! every response. The result is a [`Bank`] of contexts (prompts) × arms (samples) that every
//! cell of the run shares: deployment runs its chunked loop over it, passive and active draw
//! pairs from it like from the synthetic bandit, with exact SubOpt and regret.
//!
//! Generated texts are cached per (policy weights, tokenizer, template, sampling options,
//! prompt) under `generate.cache`, written after every batch, so a second run (or a killed one)
//! generates nothing twice.

use super::dataset::resolve_files;
use super::env::{Bank, Context};
use super::extract::{device, dtype, extract_conversations, PhiRun};
use crate::io::write_atomic;
use crate::progress::{Meter, Mode};
use crate::spec::data::expand_env;
use crate::spec::{FeatureSpec, GenerateSpec, OracleKind, OracleSpec};
use anyhow::{anyhow, bail, Context as _, Result};
use features::generate::Sample;
use features::sampling::SampleOptions;
use features::{Backbone, Message, Source};
use rand::SeedableRng;
use rand_distr::{Distribution, StandardNormal};
use serde::Serialize;
use std::sync::Arc;

/// What was generated, computed and scored (meta.json's `generated` block).
#[derive(Clone, Debug, Default, Serialize)]
pub struct BankReport {
    pub prompts_file: Vec<String>,
    pub prompts: usize,
    pub samples_per_prompt: usize,
    pub policy: String,
    pub policy_weights_blake3: String,
    pub generation_cache_hits: usize,
    pub generated_prompts: usize,
    pub generated_tokens: usize,
    pub generation_s: f64,
    /// New tokens per second over the prompts generated in this run (0 when all were cached).
    pub generation_tok_per_s: f64,
    pub mean_response_tokens: f64,
    /// Responses cut at max_new_tokens (no end-of-turn token).
    pub responses_cut: usize,
    pub empty_responses: usize,
    pub features_model: String,
    pub features_cache_hits: usize,
    pub features_tokens_computed: usize,
    pub features_s: f64,
    pub dim: usize,
    pub oracle: String,
    /// ‖θ*‖ of a linear or head oracle over the learner's φ.
    pub theta_star_norm: Option<f64>,
    /// Standard deviation of the rewards within a prompt (pooled) and over all responses.
    pub reward_std_within: f64,
    pub reward_std_all: f64,
    /// Prompts whose n rewards are not all distinct (ties in the oracle's ranking).
    pub prompts_with_reward_ties: usize,
}

/// The bank and what it took.
#[derive(Debug)]
pub struct Generated {
    pub bank: Bank,
    pub prompts: Vec<Vec<Message>>,
    pub samples: Vec<Vec<Sample>>,
    pub report: BankReport,
    /// The prompts after the bank's, held out to evaluate a learning policy (`holdout` of them).
    pub eval_prompts: Vec<Vec<Message>>,
    /// The oracle as a function of the learner's φ (linear and head oracles; None for a reward
    /// model over another backbone).
    pub scorer: Option<Scorer>,
}

/// An oracle over the learner's φ: r = φᵀθ* (linear) or a trained head w·φ + b.
#[derive(Clone, Debug)]
pub enum Scorer {
    Linear(Vec<f64>),
    Head(features::head::ScoreHead),
}

impl Scorer {
    pub fn score(&self, phi: &[f32]) -> f64 {
        match self {
            Scorer::Linear(t) => super::env::dot(phi, t),
            Scorer::Head(h) => h.score(phi),
        }
    }
}

/// The generation cache's key: the policy's weights, tokenizer and template, the options, the
/// weights' dtype unless f32 (bf16 draws other tokens) and, for a server, the backend and the
/// name the samples are requested under (the served model or a cell's adapter, whose name
/// carries its digest): its samples are the server's sampler's.
fn policy_key(b: &Backbone, o: &SampleOptions, server: Option<(&features::openai::Server, &str)>) -> String {
    let mut h = blake3::Hasher::new();
    for part in [b.weights_digest.as_str(), b.tok.digest.as_str(), b.template.source.as_str()] {
        h.update(&(part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    h.update(serde_json::to_string(o).expect("options serialise").as_bytes());
    // the weights' dtype draws other tokens (bf16 rounds every product): anything but f32 is
    // keyed apart; f32 keeps the key it always had, so existing caches stay valid
    if b.model.dtype() != candle_core::DType::F32 {
        let dtype = format!("dtype={:?}", b.model.dtype());
        h.update(&(dtype.len() as u64).to_le_bytes());
        h.update(dtype.as_bytes());
    }
    if let Some((_, served_as)) = server {
        for part in ["openai", served_as] {
            h.update(&(part.len() as u64).to_le_bytes());
            h.update(part.as_bytes());
        }
    }
    h.finalize().to_hex()[..24].to_string()
}

/// The generated responses of every prompt, from the cache where present.
pub(super) fn generate(
    g: &GenerateSpec,
    prompts: &[Vec<Message>],
    progress: Mode,
    rep: &mut BankReport,
) -> Result<Vec<Vec<Sample>>> {
    let policy = expand_env(&g.policy).map_err(|m| anyhow!("generate.policy: {m}"))?;
    let max_len = g.max_prompt_tokens + g.max_new_tokens;
    let b = Backbone::load_with(&Source::parse(&policy)?, &device(g.device)?, dtype(g.dtype), max_len, true)
        .with_context(|| format!("loading the policy {policy}"))?;
    generate_with(&b, g, prompts, progress, rep)
}

/// [`generate`] with the policy already loaded (the online loop holds it).
pub(super) fn generate_with(
    b: &Backbone,
    g: &GenerateSpec,
    prompts: &[Vec<Message>],
    progress: Mode,
    rep: &mut BankReport,
) -> Result<Vec<Vec<Sample>>> {
    generate_as(b, g, prompts, progress, rep, None)
}

/// [`generate_with`]; with a server, the samples requested under `adapter`'s name (a cell's
/// adapter, its closure loading it on the server, called once before the first prompt the
/// cache lacks) when given, else under `generate.server_model`. Cached either way.
pub(super) fn generate_as(
    b: &Backbone,
    g: &GenerateSpec,
    prompts: &[Vec<Message>],
    progress: Mode,
    rep: &mut BankReport,
    adapter: Option<(&str, &dyn Fn() -> Result<()>)>,
) -> Result<Vec<Vec<Sample>>> {
    rep.policy = b.source.clone();
    rep.policy_weights_blake3 = b.weights_digest.clone();
    let opts = g.sample_options();
    let server = g.server().map_err(|(k, m)| anyhow!("generate.{k}: {m}"))?;
    let served_as = server.as_ref().map(|s| adapter.map_or(s.model.as_str(), |a| a.0).to_string());
    let dir = g.cache.join(policy_key(b, &opts, server.as_ref().zip(served_as.as_deref())));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating the generation cache {}", dir.display()))?;
    std::fs::write(
        dir.join("describe.json"),
        serde_json::to_string_pretty(
            &serde_json::json!({"policy": b.source, "weights_blake3": b.weights_digest, "options": opts,
                "dtype": format!("{:?}", b.model.dtype()).to_lowercase(),
                "backend": g.backend, "server_model": server.as_ref().map(|s| &s.model), "adapter": adapter.map(|a| a.0)}),
        )?,
    )
    .with_context(|| format!("writing {}", dir.join("describe.json").display()))?;
    let file_of = |p: &[Message]| cache_file(&dir, p);
    let (mut out, todo) = cached_samples(b, g, prompts, &dir)?;
    rep.generation_cache_hits = prompts.len() - todo.len();
    rep.generated_prompts = todo.len();
    match (&server, todo.is_empty(), adapter) {
        // the model's name is blamed only when the server answered without it
        (Some(s), false, None) => s.check().map_err(|e| match e {
            features::Error::Input(_) => anyhow!("generate.server_model: {e}"),
            _ => anyhow!("generate.base_url: {e}"),
        })?,
        (Some(_), false, Some((_, push))) => push()?,
        _ => {}
    }
    let bar = Meter::new(progress, "generation", "prompts", todo.len() as u64);
    let t0 = std::time::Instant::now();
    // one call per batch of prompts, so every batch is cached as soon as it is done
    for group in todo.chunks(g.batch_prompts) {
        let ps: Vec<Vec<Message>> = group.iter().map(|&i| prompts[i].clone()).collect();
        let base = rep.generated_tokens;
        let mut show = |p: features::generate::GenProgress| {
            let secs = t0.elapsed().as_secs_f64().max(1e-9);
            bar.set_message(format!("{:.0} tok/s", (base + p.tokens) as f64 / secs));
        };
        let got = match &server {
            None => b.generate(&ps, &opts, g.batch_prompts, &mut show)?,
            Some(s) => b.generate_remote(s, served_as.as_deref().unwrap_or(&s.model), &ps, &opts, &mut show)?,
        };
        for (&i, mut s) in group.iter().zip(got) {
            // the recorded log-probabilities' last bits depend on which prompts shared the
            // padded batch, and so on what the cache held before: neither kept nor returned
            // (the token ids do not depend on it)
            s.iter_mut().for_each(|x| x.logprobs.clear());
            rep.generated_tokens += s.iter().map(|x| x.tokens).sum::<usize>();
            write_atomic(&file_of(&prompts[i]), &serde_json::to_vec(&s)?)?;
            out[i] = Some(s);
        }
        bar.inc(group.len() as u64);
    }
    bar.finish();
    rep.generation_s = t0.elapsed().as_secs_f64();
    if rep.generated_tokens > 0 {
        rep.generation_tok_per_s = rep.generated_tokens as f64 / rep.generation_s.max(1e-9);
    }
    Ok(out.into_iter().map(|s| s.expect("every prompt generated or cached")).collect())
}

/// A prompt's file in the generation cache directory `dir`: blake3 of its text key, `.json`.
fn cache_file(dir: &std::path::Path, p: &[Message]) -> std::path::PathBuf {
    dir.join(format!("{}.json", blake3::Hash::from(features::cache::text_key(p)).to_hex()))
}

/// [`cached_samples`]' answer: each prompt's samples where cached, and the prompts to generate.
type Cached = (Vec<Option<Vec<Sample>>>, Vec<usize>);

/// Each prompt's n samples from the generation cache `dir` where it holds them (None
/// otherwise), and the indices of the prompts to generate; a prompt over
/// generate.max_prompt_tokens after the chat template is an error.
fn cached_samples(b: &Backbone, g: &GenerateSpec, prompts: &[Vec<Message>], dir: &std::path::Path) -> Result<Cached> {
    let mut out: Vec<Option<Vec<Sample>>> = vec![None; prompts.len()];
    let mut todo = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let ids = b.prompt_ids(p).map_err(|e| anyhow!("generate.prompts: prompt {}: {e}", i + 1))?;
        if ids.len() > g.max_prompt_tokens {
            bail!(
                "generate.prompts: prompt {} is {} tokens after the policy's chat template, over generate.max_prompt_tokens = {}",
                i + 1,
                ids.len(),
                g.max_prompt_tokens
            );
        }
        match std::fs::read(cache_file(dir, p)).ok().and_then(|b| serde_json::from_slice::<Vec<Sample>>(&b).ok()) {
            // a cache written before samples kept their token ids is generated again
            Some(s) if s.len() == g.n && s.iter().all(|x| !x.ids.is_empty()) => out[i] = Some(s),
            _ => todo.push(i),
        }
    }
    Ok((out, todo))
}

/// (prompt, response) as the conversation φ reads.
pub fn conversation(p: &[Message], response: &str) -> Vec<Message> {
    let mut m = p.to_vec();
    m.push(Message::new("assistant", response));
    m
}

/// Pooled within-prompt and overall standard deviation of rewards (k per prompt).
fn reward_spread(r: &[f64], k: usize) -> (f64, f64) {
    let n = r.len() as f64;
    let mean = r.iter().sum::<f64>() / n;
    let all = (r.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n).sqrt();
    let within = r
        .chunks_exact(k)
        .map(|c| {
            let m = c.iter().sum::<f64>() / k as f64;
            c.iter().map(|x| (x - m).powi(2)).sum::<f64>()
        })
        .sum::<f64>()
        / n;
    (within.sqrt(), all)
}

/// Generates (or reads from the cache), computes φ and scores every response; the last
/// `holdout` prompts read (after the first `rows`) are kept aside, not generated for.
pub fn build(g: &GenerateSpec, f: &FeatureSpec, o: &OracleSpec, holdout: usize, progress: Mode) -> Result<Generated> {
    let (files, mut prompts) = read_prompts(g, holdout)?;
    let eval_prompts = prompts.split_off(prompts.len() - holdout);
    let mut rep = BankReport {
        prompts_file: files.iter().map(|f| f.display().to_string()).collect(),
        prompts: prompts.len(),
        samples_per_prompt: g.n,
        ..Default::default()
    };
    let samples = generate(g, &prompts, progress, &mut rep)?;
    let all: Vec<&Sample> = samples.iter().flatten().collect();
    rep.mean_response_tokens = all.iter().map(|s| s.tokens as f64).sum::<f64>() / all.len() as f64;
    rep.responses_cut = all.iter().filter(|s| !s.stopped).count();
    rep.empty_responses = all.iter().filter(|s| s.text.trim().is_empty()).count();
    let convs: Vec<Vec<Message>> =
        prompts.iter().zip(&samples).flat_map(|(p, ss)| ss.iter().map(move |s| conversation(p, &s.text))).collect();
    let named: Vec<(String, &[Message])> = convs
        .iter()
        .enumerate()
        .map(|(i, c)| (format!("prompt {}, sample {}", i / g.n + 1, i % g.n + 1), c.as_slice()))
        .collect();
    let (ex, _) =
        extract_conversations(&named, "generated responses", &PhiRun::new(&f.phi(), progress).context("features")?)?;
    let d = ex.summary.dim;
    rep.features_model = ex.source.clone();
    rep.features_cache_hits = ex.summary.hits;
    rep.features_tokens_computed = ex.summary.tokens;
    rep.features_s = ex.summary.forward_s;
    rep.dim = d;
    let phi: Vec<Vec<f32>> = ex.phi.into_iter().map(|r| r.expect("unsharded")).collect();
    if let Some((i, _)) = phi.iter().enumerate().find(|(_, r)| r.iter().any(|v| !v.is_finite())) {
        bail!("φ of prompt {}, sample {} has non-finite values", i / g.n + 1, i % g.n + 1);
    }
    let (rewards, theta_star, scorer) = oracle_rewards(g, f, o, &phi, &named, progress, &mut rep)?;
    if rewards.iter().any(|r| !r.is_finite()) {
        bail!("oracle: non-finite rewards");
    }
    if !theta_star.is_empty() {
        rep.theta_star_norm = Some(theta_star.iter().map(|x| x * x).sum::<f64>().sqrt());
    }
    (rep.reward_std_within, rep.reward_std_all) = reward_spread(&rewards, g.n);
    rep.prompts_with_reward_ties = rewards
        .chunks_exact(g.n)
        .filter(|c| {
            let mut s = c.to_vec();
            s.sort_by(f64::total_cmp);
            s.windows(2).any(|w| w[0] == w[1])
        })
        .count();
    let contexts: Vec<Context> = phi
        .chunks_exact(g.n)
        .zip(rewards.chunks_exact(g.n))
        .map(|(p, r)| Context { phi: p.concat(), reward: Some(r.to_vec()) })
        .collect();
    let bank =
        Bank { d, k: g.n, contexts: Arc::new(contexts), theta_star, labels: o.labels, flip: o.flip, flip_seed: o.seed };
    Ok(Generated { bank, prompts, samples, report: rep, eval_prompts, scorer })
}

/// The prompt files' first `generate.rows` prompts and the `holdout` after them, each shortfall
/// named by the key at fault.
fn read_prompts(g: &GenerateSpec, holdout: usize) -> Result<(Vec<std::path::PathBuf>, Vec<Vec<Message>>)> {
    let files = resolve_files("data.prompts", &g.prompts).map_err(|e| anyhow!("{e:#}").context("generate.prompts"))?;
    let prompts = super::datasets::read_prompts(&files, &g.prompt_key, g.rows.map(|r| r + holdout))?;
    if let Some(r) = g.rows {
        // the training rows fit, the held-out ones do not: policy.eval_prompts is at fault
        if prompts.len() >= r && prompts.len() < r + holdout {
            bail!(
                "policy.eval_prompts: {holdout} held-out prompts after generate.rows = {r}, but the prompt files hold only {} prompts ({} after the training rows)",
                prompts.len(),
                prompts.len() - r
            );
        }
        if prompts.len() < r + holdout {
            bail!(
                "generate.rows = {r}{}, but the prompt files hold only {} prompts",
                if holdout > 0 { format!(" and policy.eval_prompts = {holdout}") } else { String::new() },
                prompts.len()
            );
        }
    }
    if holdout > 0 && prompts.len() <= holdout {
        bail!("policy.eval_prompts = {holdout}: the prompt files hold only {} prompts", prompts.len());
    }
    Ok((files, prompts))
}

/// The oracle's reward of each response (from φ: a linear θ* or a trained head; or a reward
/// model over its own backbone), θ* when it is linear in φ (else empty), and the scorer of new
/// responses over φ (None for a reward model).
fn oracle_rewards(
    g: &GenerateSpec,
    f: &FeatureSpec,
    o: &OracleSpec,
    phi: &[Vec<f32>],
    named: &[(String, &[Message])],
    progress: Mode,
    rep: &mut BankReport,
) -> Result<(Vec<f64>, Vec<f64>, Option<Scorer>)> {
    let d = rep.dim;
    let mut scorer = None;
    let (rewards, theta_star): (Vec<f64>, Vec<f64>) = match o.kind {
        OracleKind::Linear => {
            let mut rng = rand_chacha::ChaCha20Rng::seed_from_u64(o.seed);
            let u: Vec<f64> = (0..d).map(|_| StandardNormal.sample(&mut rng)).collect();
            let n = u.iter().map(|x| x * x).sum::<f64>().sqrt();
            let u: Vec<f64> = u.iter().map(|x| x / n).collect();
            let raw: Vec<f64> = phi.iter().map(|p| super::env::dot(p, &u)).collect();
            let scale = match o.norm {
                Some(b) => b,
                None => {
                    let (within, _) = reward_spread(&raw, g.n);
                    if within == 0.0 {
                        bail!("oracle: every prompt's responses have the same φ: a linear oracle cannot rank them");
                    }
                    o.reward_std.unwrap_or(1.0) / within
                }
            };
            let theta: Vec<f64> = u.iter().map(|x| x * scale).collect();
            rep.oracle = format!("linear (seed {}, ‖θ*‖ = {scale:.4})", o.seed);
            scorer = Some(Scorer::Linear(theta.clone()));
            (phi.iter().map(|p| super::env::dot(p, &theta)).collect(), theta)
        }
        OracleKind::Head => {
            let path = expand_env(o.path.as_deref().expect("checked")).map_err(|m| anyhow!("oracle.path: {m}"))?;
            let h = features::head::load_score_head(&path, d).map_err(|e| anyhow!("oracle.path: {e}"))?;
            rep.oracle = format!("head {}", h.file.display());
            let out = (phi.iter().map(|p| h.score(p)).collect(), h.w.iter().map(|&x| f64::from(x)).collect());
            scorer = Some(Scorer::Head(h));
            out
        }
        OracleKind::RewardModel => {
            let model = expand_env(o.model.as_deref().expect("checked")).map_err(|m| anyhow!("oracle.model: {m}"))?;
            let run = PhiRun::new(&o.phi(model.clone(), f.cache.clone()), progress).context("oracle")?;
            let (rx, _) = extract_conversations(named, "generated responses (oracle)", &run)?;
            let h =
                features::head::load_score_head(&model, rx.summary.dim).map_err(|e| anyhow!("oracle.model: {e}"))?;
            rep.oracle = format!("reward model {model} (head {})", h.file.display());
            (rx.phi.into_iter().map(|r| h.score(&r.expect("unsharded"))).collect(), Vec::new())
        }
    };
    Ok((rewards, theta_star, scorer))
}
