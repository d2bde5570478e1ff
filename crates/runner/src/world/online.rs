//! Deployment with a policy that learns (`deploy.policy = "rloo"` or `"dpo"`): what every
//! cell's chunk loop shares to generate with its own current policy, compute φ of the new
//! responses and score them with the oracle — loaded once per run. Each cell keeps its own
//! adapters (crate::settings); this holds the frozen parts.

use super::extract::{device, dtype, PhiRun};
use super::generated::{generate_as, generate_with, BankReport, Generated, Scorer};
use crate::progress::Mode;
use crate::spec::data::expand_env;
use crate::spec::policy::TrainDtype;
use crate::spec::{FeatureSpec, GenerateSpec, OracleKind, OracleSpec, PolicySpec};
use anyhow::{anyhow, Context as _, Result};
use candle_core::{DType, Tensor};
use features::generate::Sample;
use features::model::{Config, Model};
use features::sampling::SampleOptions;
use features::{Backbone, FeatureCache, Message, Source};
use std::collections::HashMap;
use std::sync::Mutex;

/// The frozen parts of an online deployment run.
pub struct Online {
    pub spec: PolicySpec,
    /// `generate.backend = "openai"`: the server that samples each cell's policy (its adapter
    /// pushed after each update), and the directory the adapters are written to for it (under
    /// `generate.cache`: the server must be able to read it).
    pub server: Option<features::openai::Server>,
    pub adapter_dir: std::path::PathBuf,
    /// `[generate]`: what the server's samples are requested and cached with.
    gen: GenerateSpec,
    /// The policy's base weights (Hugging Face names, dense f32) and architecture: each cell
    /// builds its `policy::PolicyModel` on them (tensors are shared, not copied).
    pub base: HashMap<String, Tensor>,
    pub cfg: Config,
    /// The LM head is the embedding matrix.
    tied: bool,
    /// The policy's tokenizer and chat template (generation with merged weights).
    policy: Backbone,
    /// `policy.dtype = "bf16"` without a server: the base policy on packed bf16 weights, which a
    /// learning arm samples with its adapters unmerged beside them (`Model::with_adapters`) —
    /// the bank's backbone when generate.dtype is bf16 too, else built once from `base`.
    sampler16: Option<Model>,
    pub opts: SampleOptions,
    /// The held-out sampling options of seed index i: `eval_opts[i]` (its own streams).
    pub eval_opts: Vec<SampleOptions>,
    batch_prompts: usize,
    /// Prompt + new tokens: the longest sequence a policy scores.
    pub max_len: usize,
    /// Templated prompt ids of the bank's prompts and of the held-out prompts.
    pub prompt_ids: Vec<Vec<u32>>,
    pub eval_prompts: Vec<Vec<Message>>,
    pub eval_ids: Vec<Vec<u32>>,
    /// The base policy's samples of the held-out prompts per seed index, from the learning
    /// arms' sampler (f32, or bf16 with policy.dtype = "bf16") with the seed's streams: every
    /// policy's evaluation before its first update, and the evaluation of the arms whose policy
    /// does not learn.
    pub eval_base: Vec<Vec<Vec<Sample>>>,
    /// `[policy.dpo.warm_start]`'s pairs, tokenised for the policy (empty without one), and the
    /// count of its rows dropped for a prompt over generate.max_prompt_tokens.
    pub warm_start: Vec<WarmPair>,
    pub warm_dropped: u64,
    /// How the run reports progress: with plain lines, each cell says when a chunk is done.
    pub progress: Mode,
    phi: Mutex<Phi>,
    oracle: Oracle,
}

/// A preference pair as the policy scores it: the templated prompt, the chosen and rejected
/// responses' ids (see `Backbone::response_ids`).
#[derive(Clone, Debug)]
pub struct WarmPair {
    pub prompt: Vec<u32>,
    pub chosen: Vec<u32>,
    pub rejected: Vec<u32>,
}

/// The first `w.rows` pairs of the warm start's dataset, tokenised by `policy`: each side's last
/// message is its response, the messages before it (the chosen side's) the prompt. A pair whose
/// prompt is over `max_prompt_tokens` is dropped and counted (the policy cannot score it; the
/// count is the warm start's dropped_pairs in policy_updates.parquet).
fn warm_pairs(
    w: &crate::spec::policy::WarmStart,
    policy: &Backbone,
    max_prompt_tokens: usize,
    max_new_tokens: usize,
) -> Result<(Vec<WarmPair>, u64)> {
    use super::datasets::{read_dataset, ReadOptions};
    let key = "policy.dpo.warm_start";
    let files = super::dataset::resolve_files(&format!("{key}.path"), &w.path)?;
    let o = ReadOptions {
        format: Some(w.format),
        keys: w.keys.clone().unwrap_or_default(),
        limit: Some(w.rows),
        skip_malformed: false,
    };
    let pairs = read_dataset(&files, &o).with_context(|| format!("{key}.path"))?.pairs;
    if pairs.len() < w.rows {
        return Err(anyhow!("{key}.rows = {}, but {} holds only {} pairs", w.rows, w.path, pairs.len()));
    }
    let (mut out, mut dropped) = (Vec::with_capacity(pairs.len()), 0);
    for p in &pairs {
        let row = |m: String| anyhow!("{key}: {}: {m}", p.at);
        let (Some((c, prompt)), Some((r, _))) = (p.chosen.split_last(), p.rejected.split_last()) else {
            return Err(row("an empty conversation".into()));
        };
        let prompt_ids = policy.prompt_ids(prompt).map_err(|e| row(e.to_string()))?;
        if prompt_ids.len() > max_prompt_tokens {
            dropped += 1;
            continue;
        }
        let ids = |m: &Message| policy.response_ids(&m.content, max_new_tokens);
        out.push(WarmPair {
            prompt: prompt_ids,
            chosen: ids(c).map_err(|e| row(format!("chosen: {e}")))?,
            rejected: ids(r).map_err(|e| row(format!("rejected: {e}")))?,
        });
    }
    if out.is_empty() {
        return Err(anyhow!(
            "{key}: every one of its {} pairs has a prompt over generate.max_prompt_tokens = {max_prompt_tokens}",
            pairs.len()
        ));
    }
    Ok((out, dropped))
}

/// The oracle of new responses: a function of the learner's φ, or a reward model with its own
/// backbone (its φ through the cache, times its trained head).
enum Oracle {
    Phi(Scorer),
    RewardModel(Box<Mutex<Phi>>, features::head::ScoreHead),
}

impl std::fmt::Debug for Online {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Online")
            .field("spec", &self.spec)
            .field("prompts", &self.prompt_ids.len())
            .field("eval_prompts", &self.eval_prompts.len())
            .finish_non_exhaustive()
    }
}

/// The learner's feature model and its cache.
struct Phi {
    backbone: Backbone,
    run: PhiRun,
    cache: FeatureCache,
}

impl Online {
    /// Loads the policy's weights and tokenizer, the feature model, and generates (or reads from
    /// the generation cache) the base policy's samples of the held-out prompts.
    pub fn load(
        g: &GenerateSpec,
        f: &FeatureSpec,
        o: &OracleSpec,
        p: &PolicySpec,
        bank: &Generated,
        eval_seeds: &[u64],
        progress: Mode,
    ) -> Result<Online> {
        let oracle = oracle_of(bank, o, f)?;
        let model = expand_env(&g.policy).map_err(|m| anyhow!("generate.policy: {m}"))?;
        let source = Source::parse(&model)?;
        let dev = device(g.device)?;
        let max_len = g.max_prompt_tokens + g.max_new_tokens;
        // read once: the trainer's f32 base weights and the backbone that templates and generates
        let (policy, base, tied) = Backbone::load_base(&source, &dev, dtype(g.dtype), max_len)
            .with_context(|| format!("loading the policy {model}"))?;
        let cfg = policy.model.cfg.clone();
        let (prompt_ids, eval_ids) = prompt_ids(&policy, bank, g.max_prompt_tokens)?;
        let opts = g.sample_options();
        let m = p.eval_samples(g.n);
        let eval_opts: Vec<SampleOptions> =
            eval_seeds.iter().map(|&seed| SampleOptions { n: m, seed, ..opts.clone() }).collect();
        let phi = Phi::load(PhiRun::new(&f.phi(), Mode::Quiet).context("features")?)?;
        let (warm_start, warm_dropped) = match &p.dpo.warm_start {
            Some(w) => warm_pairs(w, &policy, g.max_prompt_tokens, g.max_new_tokens)?,
            None => (Vec::new(), 0),
        };
        let server = g.server().map_err(|(k, m)| anyhow!("generate.{k}: {m}"))?;
        // a server samples every policy itself (its adapters pushed to it): no bf16 model here
        let sampler16 = match p.dtype {
            _ if server.is_some() => None,
            TrainDtype::F32 => None,
            TrainDtype::Bf16 if policy.model.dtype() == DType::BF16 => Some(policy.model.clone()),
            TrainDtype::Bf16 => {
                let vb = candle_nn::VarBuilder::from_tensors(base.clone(), DType::BF16, &dev);
                Some(Model::load_with(vb, cfg.clone(), max_len, Some(tied)).context("the bf16 sampler")?)
            }
        };
        let mut o = Online {
            spec: p.clone(),
            server,
            adapter_dir: g.cache.join("adapters"),
            gen: g.clone(),
            base,
            cfg,
            tied,
            policy,
            sampler16,
            opts,
            eval_opts,
            batch_prompts: g.batch_prompts,
            max_len,
            prompt_ids,
            eval_prompts: bank.eval_prompts.clone(),
            eval_ids,
            eval_base: Vec::new(),
            warm_start,
            warm_dropped,
            progress,
            phi: Mutex::new(phi),
            oracle,
        };
        o.sample_base_eval(g, bank, progress)?;
        Ok(o)
    }

    /// The base policy's samples of the held-out prompts, one set per evaluation stream
    /// (`eval_opts`): the bank's generator's (or the server's) through the generation cache when
    /// it is the learning arms' sampler, else generated here by that sampler from the base.
    fn sample_base_eval(&mut self, g: &GenerateSpec, bank: &Generated, progress: Mode) -> Result<()> {
        for (i, eo) in self.eval_opts.iter().enumerate() {
            let samples = if self.bank_is_sampler() {
                // the sampler's (or the server's) samples, through the generation cache
                let gs = GenerateSpec { n: eo.n, seed: eo.seed, ..g.clone() };
                generate_with(&self.policy, &gs, &bank.eval_prompts, progress, &mut BankReport::default())?
            } else if self.sampler16.is_some() {
                self.generate_unmerged(&Default::default(), &self.eval_prompts, eo)?
            } else {
                self.generate(self.base.clone(), &self.eval_prompts, eo)?
            };
            if samples.iter().any(|s| s.len() != eo.n) {
                return Err(anyhow!("held-out samples of seed {i}: expected {} per prompt", eo.n));
            }
            self.eval_base.push(samples);
        }
        Ok(())
    }

    /// Samples of each prompt from the bf16 base with `adapters` beside its weights, unmerged
    /// (`PolicyModel::unmerged_adapters`; policy.dtype = "bf16": the trained policy's own
    /// products, and an update far below a bf16 ulp of W is kept). Streams as
    /// [`Online::generate`]'s.
    pub fn generate_unmerged(
        &self,
        adapters: &features::model::Adapters,
        prompts: &[Vec<Message>],
        opts: &SampleOptions,
    ) -> Result<Vec<Vec<Sample>>> {
        let base =
            self.sampler16.as_ref().ok_or_else(|| anyhow!("an unmerged sampler without policy.dtype = \"bf16\""))?;
        let model = base.with_adapters(adapters)?;
        Ok(self.policy.generate_on(&model, prompts, opts, self.batch_prompts, &mut |_| {})?)
    }

    /// Samples of each prompt from the policy with `weights` (f32, the adapters merged in: see
    /// `PolicyModel::merged_weights`), generated in f32 whatever generate.dtype says — a bf16
    /// merge would round a small update away (policy.dtype = "bf16" samples with
    /// [`Online::generate_unmerged`] instead). The streams are the options' (a policy that
    /// has not moved gives the base policy's samples, and two policies are compared on common
    /// random numbers).
    pub fn generate(
        &self,
        weights: HashMap<String, Tensor>,
        prompts: &[Vec<Message>],
        opts: &SampleOptions,
    ) -> Result<Vec<Vec<Sample>>> {
        let dev = self.policy.model.device().clone();
        let vb = candle_nn::VarBuilder::from_tensors(weights, candle_core::DType::F32, &dev);
        let model = Model::load_with(vb, self.cfg.clone(), self.max_len, Some(self.tied))?;
        Ok(self.policy.generate_on(&model, prompts, opts, self.batch_prompts, &mut |_| {})?)
    }

    /// Samples of each prompt from the server under `adapter` (a cell's adapter, `push` loading
    /// it on the server before the first prompt the cache lacks),
    /// templated and tokenised by the policy's backbone, through the generation cache (keyed
    /// by the adapter's name, which carries its digest: a resumed run asks nothing twice).
    /// `opts` differ from `[generate]`'s in n and seed only (rollouts, evaluations).
    pub fn generate_served(
        &self,
        adapter: &str,
        push: &dyn Fn() -> Result<()>,
        prompts: &[Vec<Message>],
        opts: &SampleOptions,
    ) -> Result<Vec<Vec<Sample>>> {
        if self.server.is_none() {
            return Err(anyhow!("generate.backend = \"openai\" without a server"));
        }
        let g = GenerateSpec { n: opts.n, seed: opts.seed, ..self.gen.clone() };
        if g.sample_options() != *opts {
            return Err(anyhow!("served samples asked with options other than [generate]'s in more than n and seed"));
        }
        generate_as(&self.policy, &g, prompts, Mode::Quiet, &mut BankReport::default(), Some((adapter, push)))
    }

    /// What sizes a learning cell's memory (`budget::PolicyShape`): the longest sequence any
    /// update or evaluation scores is its longest templated prompt (training, held-out, warm
    /// start) plus generate.max_new_tokens.
    pub fn shape(&self) -> crate::budget::PolicyShape {
        let prompts = self.prompt_ids.iter().chain(&self.eval_ids).chain(self.warm_start.iter().map(|w| &w.prompt));
        let longest = prompts.map(Vec::len).max().unwrap_or(0);
        crate::budget::PolicyShape {
            cfg: self.cfg.clone(),
            seq_len: longest + self.opts.max_new_tokens,
            n: self.opts.n.max(self.eval_opts.first().map_or(0, |o| o.n)),
            batch_prompts: self.batch_prompts,
            weights: self.base.values().map(|t| t.elem_count() as u64).sum(),
            on_device: !self.policy.model.device().is_cpu(),
            device_free: features::model::device_memory(self.policy.model.device()).map(|(free, _)| free),
            routed: policy::ops::Kernels::for_device(self.policy.model.device()) == policy::ops::Kernels::Routed,
        }
    }

    /// Whether a learning arm samples with its adapters unmerged, on the bf16 base
    /// ([`Online::generate_unmerged`]), rather than from an f32 merge.
    pub fn samples_unmerged(&self) -> bool {
        self.sampler16.is_some()
    }

    /// Whether the bank's generator is the learning arms' sampler (both f32, both bf16 with
    /// policy.dtype = "bf16", or both the server): then the base policy's training samples are
    /// the bank's and its held-out samples go through the generation cache; otherwise a
    /// learning arm generates its own.
    pub fn bank_is_sampler(&self) -> bool {
        if self.server.is_some() {
            // the server draws the bank and samples every policy
            return true;
        }
        let sampler = if self.sampler16.is_some() { DType::BF16 } else { DType::F32 };
        self.policy.model.dtype() == sampler
    }

    /// The learner's φ of (prompt, response) conversations and the oracle's rewards.
    pub fn score(&self, convs: &[Vec<Message>]) -> Result<(Vec<Vec<f32>>, Vec<f64>)> {
        let phi = lock(&self.phi)?.features(convs)?;
        let rewards = match &self.oracle {
            Oracle::Phi(s) => phi.iter().map(|p| s.score(p)).collect(),
            Oracle::RewardModel(rm, h) => lock(rm)?.features(convs)?.iter().map(|p| h.score(p)).collect(),
        };
        Ok((phi, rewards))
    }
}

impl Online {
    /// The token ids of (prompt, response) conversations as the learner's feature model reads
    /// them (template, EOS rule, truncation of `[features]`): what a reward model whose features
    /// learn runs on (`[reward] update`).
    pub fn feature_ids(&self, convs: &[Vec<Message>]) -> Result<Vec<Vec<u32>>> {
        let phi = lock(&self.phi)?;
        convs
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let item = phi.backbone.prepare(c, &phi.run.phi);
                Ok(item.map_err(|e| anyhow!("generated response {i}: {e}"))?.ids)
            })
            .collect()
    }
}

/// The oracle that scores the responses: the bank's scorer (φ-based), or a reward model
/// (oracle.model's backbone and score head) loaded here.
fn oracle_of(bank: &Generated, o: &OracleSpec, f: &FeatureSpec) -> Result<Oracle> {
    Ok(match (&bank.scorer, o.kind) {
        (Some(s), _) => Oracle::Phi(s.clone()),
        (None, OracleKind::RewardModel) => {
            let model = expand_env(o.model.as_deref().expect("checked")).map_err(|m| anyhow!("oracle.model: {m}"))?;
            let rm = Phi::load(PhiRun::new(&o.phi(model.clone(), f.cache.clone()), Mode::Quiet).context("oracle")?)?;
            let h =
                features::head::load_score_head(&model, rm.backbone.dim()).map_err(|e| anyhow!("oracle.model: {e}"))?;
            Oracle::RewardModel(Box::new(Mutex::new(rm)), h)
        }
        (None, k) => return Err(anyhow!("oracle.kind = {k:?}: no scorer was built")),
    })
}

/// Each prompt's token ids.
type TokenIds = Vec<Vec<u32>>;

/// The chat-templated token ids of the bank's prompts and of its held-out prompts; a held-out
/// prompt over generate.max_prompt_tokens is an error (generation would cut it).
fn prompt_ids(policy: &Backbone, bank: &Generated, max_prompt_tokens: usize) -> Result<(TokenIds, TokenIds)> {
    let ids = |ps: &[Vec<Message>], what: &str| -> Result<Vec<Vec<u32>>> {
        ps.iter()
            .enumerate()
            .map(|(i, m)| policy.prompt_ids(m).map_err(|e| anyhow!("generate.prompts: {what} {}: {e}", i + 1)))
            .collect()
    };
    let prompt_ids = ids(&bank.prompts, "prompt")?;
    let eval_ids = ids(&bank.eval_prompts, "held-out prompt")?;
    if let Some((i, x)) = eval_ids.iter().enumerate().find(|(_, x)| x.len() > max_prompt_tokens) {
        return Err(anyhow!(
            "generate.prompts: held-out prompt {} is {} tokens after the chat template, over generate.max_prompt_tokens = {}",
            i + 1,
            x.len(),
            max_prompt_tokens
        ));
    }
    Ok((prompt_ids, eval_ids))
}

fn lock<T>(m: &Mutex<T>) -> Result<std::sync::MutexGuard<'_, T>> {
    m.lock().map_err(|_| anyhow!("a feature model's lock is poisoned"))
}

impl Phi {
    fn load(run: PhiRun) -> Result<Phi> {
        let backbone = Backbone::load(&Source::parse(&run.model)?, &run.device, run.dtype, run.phi.max_len)
            .with_context(|| format!("loading the model {}", run.model))?;
        let (space, describe) = backbone.space(&run.phi);
        let cache = FeatureCache::open(&run.cache, &space, backbone.dim(), describe)?;
        Ok(Phi { backbone, run, cache })
    }

    /// φ of (prompt, response) conversations, through the feature cache.
    fn features(&mut self, convs: &[Vec<Message>]) -> Result<Vec<Vec<f32>>> {
        let Phi { backbone, run, cache } = self;
        let mut items = Vec::with_capacity(convs.len());
        let mut keys = Vec::with_capacity(convs.len());
        for (i, c) in convs.iter().enumerate() {
            items.push(backbone.prepare(c, &run.phi).map_err(|e| anyhow!("generated response {i}: {e}"))?);
            keys.push(features::cache::text_key(c));
        }
        let schedule = features::Schedule { batch: run.batch, shard: run.shard };
        let (phi, _) = backbone.features_cached(cache, &keys, &items, &run.phi, schedule, &mut |_, _| {})?;
        let phi: Vec<Vec<f32>> = phi.into_iter().map(|r| r.expect("unsharded")).collect();
        if let Some(i) = phi.iter().position(|r| r.iter().any(|v| !v.is_finite())) {
            return Err(anyhow!("φ of generated response {i} has non-finite values"));
        }
        Ok(phi)
    }
}
