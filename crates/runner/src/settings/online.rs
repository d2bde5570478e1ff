//! A deployed policy that learns between chunks (paper §6: "…construct new preference pairs,
//! which are then used to update the reward model and the policy model"). Each cell owns its
//! policy: LoRA adapters on the frozen policy model (or, for dpo with parameters = "full",
//! every weight) and their Adam state. Per chunk the policy
//! samples n responses to the chunk's prompts (the bank's responses while it has not moved and
//! the bank's generator is its sampler), φ and the oracle score them, the chunk loop labels pairs
//! and updates θ, then [`PolicyCell::update`] takes the policy step: RLOO on the reward its
//! source names (learned φᵀθ, the oracle's, or the null control's) of all n samples, or online
//! DPO on the labelled pairs. The sampler is the trained policy: it generates from the adapters
//! merged in f32 (`PolicyModel::merged_weights`), or with policy.dtype = "bf16" from the packed
//! bf16 base with the adapters unmerged beside it (`PolicyModel::unmerged_adapters`).
//! [`PolicyCell::evaluate`] samples the held-out prompts with the seed's streams; cells whose
//! policy does not learn (best-of-n, fixed) are evaluated on the base policy's samples of those
//! streams, so every arm of a seed is measured on the same prompts and streams.

use super::arms::{self, Arm, Chunk, Labelled, Rollouts, Update};
use super::passive_rm::CurrentFeatures;
use super::state::PolicyState;
use crate::plan::CellConfig;
use crate::plan::{ArmPlan, Learning};
use crate::rows::{AdapterFiles, EvalTimes, PolicyRow, PolicyTiming, SampleRow, UpdateRow};
use crate::spec::policy::RolloutSource;
use crate::spec::{AdapterLife, KlReference, LrRestart, SaveAdapter};
use crate::world::env::{argmax, dot, per_chunk_seed, seed_of, Component, Context, Env};
use crate::world::generated::{conversation, Generated};
use crate::world::online::Online;
use anyhow::{anyhow, Result};
use candle_core::DType;
use features::generate::Sample;
use policy::adam::{Adam, LrWindow};
use policy::train::{logprob_sums, score, score_recorded, Rollout};
use policy::PolicyModel;
use std::time::Instant;

/// A chunk as the policy's step reads it: its prompts, their responses and the pairs θ was
/// labelled with.
#[derive(Clone, Copy)]
pub(super) struct ChunkIn<'a> {
    /// The chunk's number (1-based).
    pub(super) chunk: u64,
    /// The chunk's prompts (indices into the bank).
    pub(super) xs: &'a [usize],
    /// Each prompt's samples.
    pub(super) samples: &'a [Vec<Sample>],
    /// Each prompt's φ rows and oracle rewards.
    pub(super) contexts: &'a [Context],
    /// The chunk's labelled pairs.
    pub(super) pairs: &'a [Labelled],
}

/// [`PolicyCell::evaluate`]'s sums over the held-out samples: oracle and learned rewards over
/// `count` samples, best-of-n under θ and the deployed reward over `groups` groups of n.
struct HeldOut {
    oracle: f64,
    learned: f64,
    bon: f64,
    deployed: f64,
    count: usize,
    groups: usize,
}

/// One cell's deployed policy: its arm ([`Arm`]: what it deploys, how it learns) and, for a
/// learning arm, its adapters and Adam's state.
pub(super) struct PolicyCell<'a> {
    pub(super) online: &'a Online,
    arm: Box<dyn Arm>,
    learner: Option<(PolicyModel, Adam)>,
    moved: bool,
    base_model: String,
    /// The seed index: its held-out streams.
    seed: usize,
    /// The adapters' stream (their first draw; fresh adapters derive theirs per chunk).
    policy_seed: u64,
    /// A learning arm's adapter life and rollouts, and the fresh rollouts' stream (the seed
    /// index's: every arm of a seed draws its fresh rollouts with the same numbers).
    learning: Option<Learning>,
    rollout_seed: u64,
    /// dpo with `[policy.dpo.warm_start]`: the warm start's update (its epochs, mini-batch
    /// stream and a window of its own).
    warm: Option<policy::train::DpoConfig>,
    /// A fresh-per-chunk adapter's PEFT files, kept at its merge for `save_adapter`.
    merged_adapter: Option<(Vec<u8>, String)>,
    /// `generate.backend = "openai"`: this cell's adapters' name prefix (its label and seed),
    /// and the adapter the server holds for it now.
    served_tag: String,
    served: std::cell::RefCell<Option<String>>,
    /// The initial policy for `kl_initial` ([`PolicyCell::initial`]).
    initial: std::cell::OnceCell<PolicyModel>,
}

impl<'a> PolicyCell<'a> {
    /// The cell's policy: fresh adapters drawn from (master seed, seed index, Policy), or the
    /// checkpointed ones.
    pub(super) fn new(
        online: &'a Online,
        plan: &ArmPlan,
        cell: &CellConfig,
        seed: u32,
        state: Option<&PolicyState>,
    ) -> Result<Self> {
        let base_model = cell.base_policy.clone().unwrap_or_default();
        if seed as usize >= online.eval_opts.len() {
            return Err(anyhow!("seed index {seed}: the run prepared held-out streams for {}", online.eval_opts.len()));
        }
        let learning = plan.learning().cloned();
        let window = lr_window(online, plan, cell);
        let arm = arms::build(plan, cell.master_seed, seed, window, online);
        let learns = arm.learns();
        let policy_seed = seed_of(cell.master_seed, seed, Component::Policy);
        let mut pc = PolicyCell {
            online,
            arm,
            learner: None,
            moved: false,
            base_model,
            seed: seed as usize,
            policy_seed,
            learning,
            rollout_seed: seed_of(cell.master_seed, seed, Component::Rollouts),
            warm: warm_config(plan, policy_seed),
            merged_adapter: None,
            served_tag: served_tag(&cell.config.label, seed),
            served: std::cell::RefCell::new(None),
            initial: std::cell::OnceCell::new(),
        };
        if learns {
            pc.learner = Some(learner(online, plan, policy_seed, state)?);
            pc.moved = state.is_some_and(|st| st.moved);
        }
        Ok(pc)
    }

    /// The initial policy (the base weights, no adapters), built on first use: what
    /// policy.parquet's `kl_initial` is measured against when the KL reference moves.
    fn initial(&self) -> Result<&PolicyModel> {
        if let Some(m) = self.initial.get() {
            return Ok(m);
        }
        let o = self.online;
        let none = policy::LoraConfig { rank: 1, alpha: 1.0, targets: Vec::new(), seed: 0, dropout: 0.0 };
        let m = PolicyModel::new(o.base.clone(), o.cfg.clone(), &none, o.max_len, DType::F32)?;
        Ok(self.initial.get_or_init(|| m))
    }

    /// What a checkpoint keeps of the policy (None when it does not learn).
    pub(super) fn state(&self) -> Result<Option<PolicyState>> {
        let Some((m, adam)) = &self.learner else { return Ok(None) };
        Ok(Some(PolicyState { vars: m.var_values()?, adam: adam.state()?, moved: self.moved, life: m.life().to_vec() }))
    }

    /// Whether the policy learns (it has adapters or weights of its own).
    pub(super) fn learns(&self) -> bool {
        self.learner.is_some()
    }

    /// The name this cell's samples are requested under on the server ("" without one): its
    /// adapter's when it samples from its adapter (it has moved, or `rollouts` of a policy
    /// whose bank is not its sampler's: never with a server, which draws both), else the served
    /// model's (the bank's samples).
    pub(super) fn served_as(&self, rollouts: bool) -> Result<String> {
        let Some(s) = &self.online.server else { return Ok(String::new()) };
        match &self.learner {
            Some((m, _)) if self.moved || (rollouts && !self.online.bank_is_sampler()) => self.adapter_name(m),
            _ => Ok(s.model.clone()),
        }
    }

    fn adapter_name(&self, m: &PolicyModel) -> Result<String> {
        Ok(format!("onepass-{}-{}", self.served_tag, &m.digest()?[..16]))
    }

    /// The digest of the adapters ("base" for a policy that does not learn).
    pub(super) fn digest(&self) -> Result<String> {
        match &self.learner {
            Some((m, _)) => Ok(m.digest()?),
            None => Ok("base".into()),
        }
    }

    /// Samples of `prompts` from the current policy: generated once it has moved (or when
    /// `base` is None) — from the f32 merge, or with policy.dtype = "bf16" on the bf16 base with
    /// the adapters unmerged — else `base`; with the generating weights' merge error when
    /// `measure` asks for it (0 for `base`; unmerged, that of the adapters as applied).
    fn sample(
        &self,
        prompts: &[Vec<features::Message>],
        opts: &features::sampling::SampleOptions,
        base: Option<&Vec<Vec<Sample>>>,
        measure: bool,
    ) -> Result<(Vec<Vec<Sample>>, f64)> {
        match (&self.learner, base) {
            (_, Some(b)) if !self.moved => Ok((b.clone(), 0.0)),
            // the server applies the adapter itself: no merge of onepass's to measure
            (Some((m, _)), _) if self.online.server.is_some() => Ok((self.sample_served(m, prompts, opts)?, f64::NAN)),
            (Some((m, _)), _) if self.online.samples_unmerged() => {
                let ad = m.unmerged_adapters()?;
                let err = if measure { m.unmerged_error(&ad)? } else { 0.0 };
                Ok((self.online.generate_unmerged(&ad, prompts, opts)?, err))
            }
            (Some((m, _)), _) => {
                let w = m.merged_weights()?;
                let err = if measure { m.merge_error(&w)? } else { 0.0 };
                Ok((self.online.generate(w, prompts, opts)?, err))
            }
            (None, Some(b)) => Ok((b.clone(), 0.0)),
            (None, None) => Err(anyhow!("a policy that does not learn has no samples but the base's")),
        }
    }

    /// Samples of `prompts` from the server with this cell's current adapter: its PEFT files
    /// written under `generate.cache/adapters/<name>/` and loaded as `name` =
    /// `onepass-<cell>-<digest of its values>` (once; the cell's previous adapter unloaded), then
    /// requested under that name.
    fn sample_served(
        &self,
        m: &PolicyModel,
        prompts: &[Vec<features::Message>],
        opts: &features::sampling::SampleOptions,
    ) -> Result<Vec<Vec<Sample>>> {
        let s = self.online.server.as_ref().expect("routed here with a server");
        let name = self.adapter_name(m)?;
        // pushed only when a prompt is not in the generation cache (a rerun asks nothing)
        let push = || -> Result<()> {
            if self.served.borrow().as_deref() == Some(name.as_str()) {
                return Ok(());
            }
            let dir = self.online.adapter_dir.join(&name);
            if !dir.join("adapter_config.json").exists() {
                let (safetensors, config) = policy::peft::encode(m, &self.base_model)?;
                std::fs::create_dir_all(&dir).map_err(|e| anyhow!("creating {}: {e}", dir.display()))?;
                crate::io::write_atomic(&dir.join("adapter_model.safetensors"), &safetensors)?;
                crate::io::write_atomic(&dir.join("adapter_config.json"), config.as_bytes())?;
            }
            match s.load_adapter(&name, &dir) {
                Ok(()) => {}
                // a resumed run finds its adapter still loaded
                Err(e) if e.to_string().contains("already been loaded") => {}
                // a server without runtime LoRA, or one whose --max-lora-rank is below the
                // adapter's rank, refuses here: say which settings must agree
                Err(e) => {
                    return Err(anyhow!(
                        "generate.server_model = {:?}: {e} (the server must run with --enable-lora, \
                         VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --max-lora-rank ≥ policy.rank = {})",
                        s.model,
                        self.online.spec.rank
                    ))
                }
            }
            if let Some(old) = self.served.replace(Some(name.clone())) {
                s.unload_adapter(&old).map_err(|e| anyhow!("generate.server_model: {e}"))?;
            }
            Ok(())
        };
        self.online.generate_served(&name, &push, prompts, opts)
    }

    /// φ of every sample of every prompt, and the oracle's rewards, as contexts. With a reward
    /// model whose features learn (`learned`), φ is its current h_ψ (the oracle keeps its own).
    fn contexts(
        &self,
        prompts: &[&[features::Message]],
        samples: &[Vec<Sample>],
        learned: Option<&CurrentFeatures>,
    ) -> Result<Vec<Context>> {
        let convs: Vec<Vec<features::Message>> =
            prompts.iter().zip(samples).flat_map(|(p, ss)| ss.iter().map(move |s| conversation(p, &s.text))).collect();
        let (mut phi, rewards) = self.online.score(&convs)?;
        if let Some(h) = learned {
            let ids = self.online.feature_ids(&convs)?;
            phi = h.of_seqs(&ids.iter().map(|s| s.as_slice()).collect::<Vec<_>>())?;
        }
        let (mut it, mut r) = (phi.into_iter(), rewards.into_iter());
        Ok(samples
            .iter()
            .map(|ss| {
                let rows: Vec<Vec<f32>> = it.by_ref().take(ss.len()).collect();
                Context { phi: rows.concat(), reward: Some(r.by_ref().take(ss.len()).collect()) }
            })
            .collect())
    }

    /// The chunk's contexts (φ and oracle rewards of the policy's n samples per prompt) and,
    /// for a learning policy, the samples themselves.
    pub(super) fn respond(
        &self,
        g: &Generated,
        env: &Env,
        xs: &[usize],
        time: &mut PolicyTiming,
    ) -> Result<(Vec<Context>, Vec<Vec<Sample>>)> {
        if self.learner.is_none() {
            return Ok((xs.iter().map(|&x| env.contexts[x].clone()).collect(), Vec::new()));
        }
        if !self.moved && self.online.bank_is_sampler() {
            let samples = xs.iter().map(|&x| g.samples[x].clone()).collect();
            return Ok((xs.iter().map(|&x| env.contexts[x].clone()).collect(), samples));
        }
        let t0 = Instant::now();
        let prompts: Vec<Vec<features::Message>> = xs.iter().map(|&x| g.prompts[x].clone()).collect();
        let (samples, _) = self.sample(&prompts, &self.online.opts, None, false)?;
        time.generation_s += t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let refs: Vec<&[features::Message]> = prompts.iter().map(|p| p.as_slice()).collect();
        let contexts = self.contexts(&refs, &samples, None)?;
        time.phi_s += t1.elapsed().as_secs_f64();
        Ok((contexts, samples))
    }

    /// What the arm deploys among one prompt's samples: (pick, its oracle reward).
    pub(super) fn deploy(&self, truth: &[f64], est: &[f64]) -> (usize, f64) {
        self.arm.deploy(truth, est)
    }

    /// The arm's rollouts on chunk `c.chunk` (`plan::RolloutPlan`): the first k of each of the
    /// first P prompts' samples, or k fresh samples of those prompts from the current policy
    /// (their generation and φ timed into `time`). Empty for an arm without rollouts.
    fn rollouts(
        &self,
        c: ChunkIn<'_>,
        d: usize,
        g: &Generated,
        learned: Option<&CurrentFeatures>,
        time: &mut PolicyTiming,
    ) -> Result<Rollouts> {
        let ChunkIn { chunk, xs, samples, contexts, .. } = c;
        let Some(plan) = self.learning.as_ref().map(|l| l.rollouts).filter(|r| r.per_prompt > 0) else {
            return Ok(Rollouts::default());
        };
        let (k, p) = (plan.per_prompt, plan.prompts.map_or(xs.len(), |p| p.min(xs.len())));
        let at: Vec<usize> = (0..p).collect();
        match plan.source {
            RolloutSource::Samples => {
                if let Some(i) = at.iter().position(|&i| samples[i].len() < k) {
                    return Err(anyhow!(
                        "{k} rollouts per prompt, but prompt {} of the chunk has {}",
                        i + 1,
                        samples[i].len()
                    ));
                }
                let samples = at.iter().map(|&i| samples[i][..k].to_vec()).collect();
                let contexts = at
                    .iter()
                    .map(|&i| Context {
                        phi: contexts[i].phi[..k * d].to_vec(),
                        reward: contexts[i].reward.as_ref().map(|r| r[..k].to_vec()),
                    })
                    .collect();
                Ok(Rollouts { at, samples, contexts })
            }
            RolloutSource::Fresh => {
                let t0 = Instant::now();
                let prompts: Vec<Vec<features::Message>> = xs[..p].iter().map(|&x| g.prompts[x].clone()).collect();
                let seed = per_chunk_seed(b"onepass-rollouts", self.rollout_seed, chunk);
                let opts = features::sampling::SampleOptions { n: k, seed, ..self.online.opts.clone() };
                let (samples, _) = self.sample(&prompts, &opts, None, false)?;
                time.generation_s += t0.elapsed().as_secs_f64();
                let t1 = Instant::now();
                let refs: Vec<&[features::Message]> = prompts.iter().map(|p| p.as_slice()).collect();
                let contexts = self.contexts(&refs, &samples, learned)?;
                time.phi_s += t1.elapsed().as_secs_f64();
                Ok(Rollouts { at, samples, contexts })
            }
        }
    }

    /// dpo with a warm start: DPO on `[policy.dpo.warm_start]`'s pairs before the first chunk,
    /// with an Adam of its own; then the adapter's life cycle as after a chunk (a
    /// fresh-per-chunk adapter is merged, a chunk-start reference moves) and a fresh Adam for
    /// the chunks. None without a warm start.
    pub(super) fn warm_start(&mut self) -> Result<Option<Update>> {
        let (Some(cfg), Some((m, _))) = (&self.warm, &self.learner) else { return Ok(None) };
        crate::io::failpoint("policy-update");
        let w = &self.online.warm_start;
        let prefs: Vec<policy::train::Preference> = w
            .iter()
            .map(|p| policy::train::Preference { prompt: &p.prompt, chosen: &p.chosen, rejected: &p.rejected })
            .collect();
        let mut adam = m.adam(self.online.spec.adam())?;
        let stats = policy::train::dpo_update(m, &mut adam, &prefs, cfg)
            .map_err(|e| anyhow!("the warm start's policy update: {e}"))?;
        self.moved |= stats.steps > 0;
        self.after_update(0)?;
        Ok(Some(Update { stats, pairs: prefs.len() as u64, dropped: self.online.warm_dropped, critic: None }))
    }

    /// The adapter's life cycle after the update of chunk `chunk` (0: the warm start): a
    /// fresh-per-chunk adapter is merged (its PEFT files kept when saved) and redrawn, with a
    /// fresh Adam; a chunk-start KL reference moves to the updated policy.
    fn after_update(&mut self, chunk: u64) -> Result<()> {
        let Some((m, adam)) = &mut self.learner else { return Ok(()) };
        let ps = &self.online.spec;
        if self.learning.as_ref().is_some_and(|l| l.adapter == AdapterLife::FreshPerChunk) {
            if ps.save_adapter != SaveAdapter::None && !m.is_full() {
                self.merged_adapter = Some(policy::peft::encode(m, &self.base_model)?);
            }
            m.merge_and_reset(per_chunk_seed(b"onepass-fresh-adapter", self.policy_seed, chunk))?;
            // fresh moments, the run's step count kept (a schedule over the run goes on, and
            // the next chunk's mini-batch order is its own)
            let steps = adam.run_steps();
            *adam = m.adam(ps.adam())?.continuing(steps);
        }
        if ps.kl_reference == KlReference::ChunkStart {
            m.reference_here()?;
        }
        Ok(())
    }

    /// The policy step after θ's update on chunk `c.chunk` (the arm's [`Arm::update`] on its
    /// rollouts, their generation and φ timed into `time`), then the adapter's life cycle for
    /// the next chunk ([`PolicyCell::after_update`]). None when the policy does not learn.
    pub(super) fn update(
        &mut self,
        c: ChunkIn<'_>,
        theta: &[f64],
        d: usize,
        g: &Generated,
        learned: Option<&CurrentFeatures>,
        time: &mut PolicyTiming,
    ) -> Result<Option<Update>> {
        let ChunkIn { chunk, xs, samples, pairs, .. } = c;
        if self.learner.is_none() {
            return Ok(None);
        }
        crate::io::failpoint("policy-update");
        let rollouts = self.rollouts(c, d, g, learned, time)?;
        let Some((m, adam)) = &mut self.learner else { return Ok(None) };
        let prompts = xs.iter().map(|&x| self.online.prompt_ids[x].as_slice()).collect();
        let c = Chunk { index: chunk, prompts, samples, pairs, rollouts: &rollouts, theta, d };
        let up = self.arm.update(m, adam, &c).map_err(|e| anyhow!("chunk {chunk}'s policy update: {e}"))?;
        self.moved |= up.stats.steps > 0;
        self.after_update(chunk)?;
        Ok(Some(up))
    }

    /// The chunk's row of policy_updates.parquet.
    pub(super) fn update_row(
        chunk: u64,
        rollout_digest: String,
        updated_digest: String,
        contexts: &[Context],
        theta: &[f64],
        d: usize,
        up: &Update,
    ) -> UpdateRow {
        let (mut oracle, mut learned, mut n) = (0.0, 0.0, 0usize);
        for c in contexts {
            let truth = c.reward.as_deref().unwrap_or_default();
            oracle += truth.iter().sum::<f64>();
            learned += c.phi.chunks_exact(d).map(|p| dot(p, theta)).sum::<f64>();
            n += truth.len();
        }
        let s = &up.stats;
        UpdateRow {
            chunk,
            rollout_digest,
            updated_digest,
            // set by the chunk loop, which knows where the samples came from
            rollout_served_as: String::new(),
            // NaN: an update without the chunk's samples (a warm start)
            rollout_oracle_reward: if n == 0 { f64::NAN } else { oracle / n as f64 },
            rollout_learned_reward: if n == 0 { f64::NAN } else { learned / n as f64 },
            update_reward: s.reward,
            update_loss: s.loss,
            update_grad_norm: s.grad_norm,
            update_steps: s.steps,
            kl: s.kl,
            entropy: s.entropy,
            pairs: up.pairs,
            dropped_pairs: up.dropped,
            critic_loss: up.critic.map(|c| c.loss),
            critic_grad_norm: up.critic.map(|c| c.grad_norm),
            value_mean: up.critic.map(|c| c.value_mean),
            return_mean: up.critic.map(|c| c.return_mean),
        }
    }

    /// The policy on the held-out prompts under θ, with the seed's streams: the oracle reward of
    /// what the arm deploys (its samples; best-of-n's best of each n under θ), of its samples,
    /// best-of-n under θ of its samples, their learned reward, KL to the reference and entropy
    /// (learning policies), the adapters' digest and the generating weights' merge error. The
    /// learned reward is θᵀh_ψ of the current reward model when its features learn (`learned`).
    pub(super) fn evaluate(
        &self,
        chunk: u64,
        theta: &[f64],
        d: usize,
        learned: Option<&CurrentFeatures>,
    ) -> Result<(PolicyRow, Vec<SampleRow>, EvalTimes)> {
        crate::io::failpoint("evaluate");
        let o = self.online;
        let mut times = EvalTimes::default();
        let t0 = Instant::now();
        let (samples, merge_error) =
            self.sample(&o.eval_prompts, &o.eval_opts[self.seed], Some(&o.eval_base[self.seed]), true)?;
        times.generation_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let refs: Vec<&[features::Message]> = o.eval_prompts.iter().map(|p| p.as_slice()).collect();
        let contexts = self.contexts(&refs, &samples, learned)?;
        times.phi_s = t1.elapsed().as_secs_f64();
        let (sums, mut rows) = self.held_out_rows(chunk, &contexts, &samples, theta, d)?;
        let HeldOut { oracle, learned, bon, deployed, count, groups } = sums;
        let all: Vec<&Sample> = samples.iter().flatten().collect();
        let (sample_reward, bon_reward) = (oracle / count as f64, bon / groups as f64);
        let mut row = PolicyRow {
            chunk,
            policy_reward: deployed / groups as f64,
            sample_reward,
            bon_reward,
            learned_reward: learned / count as f64,
            response_tokens: all.iter().map(|s| s.tokens as f64).sum::<f64>() / count as f64,
            cut_fraction: all.iter().filter(|s| !s.stopped).count() as f64 / count as f64,
            merge_error,
            policy_digest: self.digest()?,
            served_as: self.served_as(false)?,
            ..Default::default()
        };
        if let Some((m, _)) = &self.learner {
            let t2 = Instant::now();
            self.score_held_out(m, &samples, &all, &mut rows, &mut row)?;
            times.score_s = t2.elapsed().as_secs_f64();
        }
        Ok((row, rows, times))
    }

    /// [`PolicyCell::evaluate`]'s rewards: per held-out prompt and group of n samples, the
    /// oracle reward of each sample, its learned reward φᵀθ, best-of-n under θ (the oracle
    /// reward of argmax_j φ_jᵀθ) and what the arm deploys; summed, with a row per sample.
    fn held_out_rows(
        &self,
        chunk: u64,
        contexts: &[Context],
        samples: &[Vec<Sample>],
        theta: &[f64],
        d: usize,
    ) -> Result<(HeldOut, Vec<SampleRow>)> {
        let n = self.online.opts.n;
        let (mut oracle, mut learned, mut bon, mut deployed) = (0.0, 0.0, 0.0, 0.0);
        let (mut count, mut groups) = (0usize, 0usize);
        let mut rows: Vec<SampleRow> = Vec::new();
        for ((p, c), ss) in contexts.iter().enumerate().zip(samples) {
            let truth = c.reward.as_ref().expect("scored");
            let est: Vec<f64> = c.phi.chunks_exact(d).map(|p| dot(p, theta)).collect();
            oracle += truth.iter().sum::<f64>();
            learned += est.iter().sum::<f64>();
            if truth.len() % n != 0 || truth.len() != ss.len() {
                return Err(anyhow!(
                    "{} held-out samples of a prompt ({} scored): expected a multiple of n = {n}",
                    ss.len(),
                    truth.len()
                ));
            }
            for (i, (t, e)) in truth.chunks_exact(n).zip(est.chunks_exact(n)).enumerate() {
                bon += t[argmax(e.iter().copied())];
                let (pick, value) = self.arm.deploy(t, e);
                deployed += value;
                groups += 1;
                // an arm that deploys its samples as drawn is valued at their mean: all of
                // them are deployed; a reranking arm deploys its pick
                let all = self.arm.deploys_all();
                for j in 0..n {
                    let k = i * n + j;
                    rows.push(SampleRow {
                        chunk,
                        prompt: p as u64,
                        sample: k as u32,
                        oracle_reward: t[j],
                        learned_reward: e[j],
                        deployed: all || j == pick,
                        tokens: ss[k].tokens as u64,
                        ..Default::default()
                    });
                }
            }
            count += truth.len();
        }
        Ok((HeldOut { oracle, learned, bon, deployed, count, groups }, rows))
    }

    /// A learning policy's scores of its held-out samples (`all`, flattened): per sequence
    /// (Σ log π, Σ KL to the reference, tokens) into each sample's row, and the means into
    /// `row`: KL per sequence, KL to the initial policy, entropy −Σ log π / tokens.
    fn score_held_out(
        &self,
        m: &PolicyModel,
        samples: &[Vec<Sample>],
        all: &[&Sample],
        rows: &mut [SampleRow],
        row: &mut PolicyRow,
    ) -> Result<()> {
        let o = self.online;
        let rollouts: Vec<Rollout> = samples
            .iter()
            .zip(&o.eval_ids)
            .flat_map(|(ss, p)| ss.iter().map(move |s| Rollout { prompt: p, response: &s.ids }))
            .collect();
        // a moved policy's samples come from onepass's sampler (f32 merged, or bf16 unmerged),
        // which records log π of every token it draws (its batches fixed by the spec: they
        // are not cached): the policy's pass is not run again. The base's samples (cached,
        // their log-probabilities dropped) and a server's are scored here.
        let recorded: Option<Vec<&[f32]>> = all.iter().map(|s| s.recorded_logprobs()).collect();
        let kl_initial = self.kl_to_initial(m, &rollouts, recorded.as_deref())?;
        // per sequence (Σ log π, Σ KL, tokens); at its reference (unmoved, or every B still
        // exactly 0) the policy's KL is exactly 0
        let sc: Vec<(f64, f64, usize)> = match (!self.moved || m.at_reference()?, recorded) {
            (false, Some(r)) => score_recorded(m, &rollouts, &r, o.spec.kl_estimator, o.spec.minibatch)?,
            (false, None) => score(m, &rollouts, o.spec.kl_estimator, o.spec.minibatch)?,
            (true, Some(r)) => r.iter().map(|l| (l.iter().map(|&x| x as f64).sum(), 0.0, l.len())).collect(),
            (true, None) => {
                logprob_sums(m, &rollouts, o.spec.minibatch, false)?.into_iter().map(|(lp, n)| (lp, 0.0, n)).collect()
            }
        };
        if sc.len() != rows.len() {
            return Err(anyhow!("{} held-out samples scored for {} drawn", sc.len(), rows.len()));
        }
        let kl = sc.iter().map(|s| s.1).sum::<f64>() / sc.len() as f64;
        let (lp, tokens) = (sc.iter().map(|s| s.0).sum::<f64>(), sc.iter().map(|s| s.2).sum::<usize>());
        for (i, (r, s)) in rows.iter_mut().zip(&sc).enumerate() {
            r.kl = Some(s.1);
            r.kl_initial = Some(kl_initial.as_ref().map_or(s.1, |k| k[i]));
            r.logprob = Some(s.0);
        }
        row.kl = kl;
        row.kl_initial = kl_initial.map_or(kl, |k| k.iter().sum::<f64>() / k.len() as f64);
        row.entropy = Some(-lp / tokens as f64);
        Ok(())
    }

    /// The KL of each held-out sequence to the initial policy when the reference has moved away
    /// from it (a chunk-start reference of a moved policy), else None (it is the KL to the
    /// reference): the policy's per-token log π (`recorded`, or scored) against the base
    /// weights' pass.
    fn kl_to_initial(
        &self,
        m: &PolicyModel,
        rollouts: &[Rollout<'_>],
        recorded: Option<&[&[f32]]>,
    ) -> Result<Option<Vec<f64>>> {
        let o = self.online;
        if !(o.spec.kl_reference == KlReference::ChunkStart && self.moved) {
            return Ok(None);
        }
        let scored: Vec<Vec<f32>>;
        let lps: Vec<&[f32]> = match recorded {
            Some(r) => r.to_vec(),
            None => {
                scored = policy::train::score_tokens(m, rollouts, o.spec.kl_estimator, o.spec.minibatch)?
                    .into_iter()
                    .map(|t| t.logprobs.iter().map(|&x| x as f32).collect())
                    .collect();
                scored.iter().map(|v| v.as_slice()).collect()
            }
        };
        let sc = score_recorded(self.initial()?, rollouts, &lps, o.spec.kl_estimator, o.spec.minibatch)?;
        Ok(Some(sc.iter().map(|s| s.1).collect::<Vec<f64>>()))
    }

    /// policy.max_kl's guard on an evaluation `row` after an update (`base`: the chunk-0 row):
    /// a learning policy whose mean sequence KL to the initial policy passes the bound, or
    /// whose entropy per token comes within 10 % of the uniform ln |V| while the base's was
    /// below 75 % of it, has been overwritten by its update — a finite policy that every other
    /// check passes. The cell fails, naming the learning rate.
    pub(super) fn check_not_destroyed(&self, row: &PolicyRow, base: Option<&PolicyRow>) -> Result<()> {
        let Some((m, _)) = &self.learner else { return Ok(()) };
        let ps = &self.online.spec;
        match destroyed(row, base, m.config().vocab, ps.max_kl, ps.lr) {
            Some(why) => Err(anyhow!(why)),
            None => Ok(()),
        }
    }

    /// The adapters after chunk `chunk` (of `chunks`; 0: after a warm start) when
    /// policy.save_adapter asks for them; `dir` relative to the cell's adapter directory. A
    /// fresh-per-chunk policy saves each chunk's adapter as it was merged: the policy after
    /// chunk t is the base with chunk-00 (a warm start), chunk-01, …, chunk-t merged in order.
    pub(super) fn adapter(&self, chunk: u64, chunks: u64) -> Result<Option<AdapterFiles>> {
        let Some((m, _)) = &self.learner else { return Ok(None) };
        if m.is_full() {
            // save_adapter is the LoRA cells': a full-parameter policy has no adapter (the plan
            // refuses a run whose only learning arm is one)
            return Ok(None);
        }
        let dir = match self.online.spec.save_adapter {
            SaveAdapter::None => return Ok(None),
            SaveAdapter::Last if chunk < chunks => return Ok(None),
            SaveAdapter::Last => String::new(),
            SaveAdapter::EveryChunk => format!("chunk-{chunk:02}"),
        };
        // a fresh-per-chunk adapter was merged and redrawn after the update: its files were kept
        let (safetensors, config) = match &self.merged_adapter {
            Some(files) => files.clone(),
            None => policy::peft::encode(m, &self.base_model)?,
        };
        Ok(Some(AdapterFiles { dir, safetensors, config }))
    }
}

/// The learning-rate schedule's window (`policy.lr_restart`): each update's steps, or the run's
/// (Σ over the chunks of the steps of an update that sees its items on every prompt it updates
/// on, the rollouts' prompt cap applied).
fn lr_window(online: &Online, plan: &ArmPlan, cell: &CellConfig) -> LrWindow {
    let ps = &online.spec;
    let (prompts, chunks) = (online.prompt_ids.len(), cell.deploy.chunks);
    let cap = plan.learning().filter(|l| l.rollouts.per_prompt > 0).and_then(|l| l.rollouts.prompts);
    match ps.lr_restart {
        LrRestart::Chunk => LrWindow::Update,
        LrRestart::Run => LrWindow::Run {
            total: (0..chunks)
                .map(|c| {
                    let r = crate::plan::chunk_range(c, prompts, chunks).len();
                    let p = cap.map_or(r, |cap| r.min(cap));
                    policy::train::update_steps(p * plan.items_per_prompt(), ps.minibatch, ps.epochs)
                })
                .sum(),
        },
    }
}

/// dpo with `[policy.dpo.warm_start]`: the warm start's update (its epochs, a mini-batch stream
/// drawn from the policy's seed, a window of its own); None otherwise.
fn warm_config(plan: &ArmPlan, policy_seed: u64) -> Option<policy::train::DpoConfig> {
    match plan {
        ArmPlan::Dpo { update, warm_start: Some(w), .. } => Some(policy::train::DpoConfig {
            epochs: w.epochs,
            seed: per_chunk_seed(b"onepass-warm-start", policy_seed, 0),
            lr_window: LrWindow::Update,
            ..update.clone()
        }),
        _ => None,
    }
}

/// A cell's adapters' name prefix on a server: the first 12 hex digits of blake3(label, seed).
fn served_tag(label: &str, seed: u32) -> String {
    let mut h = blake3::Hasher::new();
    h.update(label.as_bytes());
    h.update(&seed.to_le_bytes());
    h.finalize().to_hex()[..12].to_string()
}

/// A learning cell's policy and Adam: LoRA adapters drawn from `policy_seed` (or every weight,
/// for parameters = "full") on the products `policy.dtype` asks for; with a checkpoint's
/// `state`, its adapter life replayed and its values and moments restored.
fn learner(
    online: &Online,
    plan: &ArmPlan,
    policy_seed: u64,
    state: Option<&PolicyState>,
) -> Result<(PolicyModel, Adam)> {
    let (base, cfg) = (online.base.clone(), online.cfg.clone());
    let mut m = if plan.full_parameters() {
        PolicyModel::new_full(base, cfg, online.max_len, DType::F32)?
    } else {
        PolicyModel::new(base, cfg, &online.spec.lora(policy_seed), online.max_len, DType::F32)?
    };
    if online.spec.dtype == crate::spec::policy::TrainDtype::Bf16 {
        m.use_bf16_products()?;
    } else if m.can_pack_products() {
        // f32 on the CPU: the packed f32 kernel, W packed once (candle's matmul packs it per call)
        m.use_packed_products(false)?;
    }
    if let Some(st) = state {
        // merges and reference moves first, each with the adapter values it saw
        m.replay(&st.life)?;
    }
    let mut adam = m.adam(online.spec.adam())?;
    if let Some(st) = state {
        m.set_var_values(&st.vars).map_err(|e| anyhow!("the checkpoint's adapters: {e}"))?;
        adam.restore(&st.adam)?;
    }
    Ok((m, adam))
}

/// [`PolicyCell::check_not_destroyed`]'s rule on one evaluation `row` (`base`: the chunk-0
/// row) of a policy over a vocabulary of `vocab` tokens: the reason its cell fails, naming
/// policy.lr, or None. Destroyed: the mean sequence KL to the initial policy past `max_kl`, or
/// an entropy per token within 10 % of the uniform ln |V| where the base's was below 75 % of it
/// (a policy that was already near uniform is not called destroyed for staying so).
fn destroyed(row: &PolicyRow, base: Option<&PolicyRow>, vocab: usize, max_kl: f64, lr: f64) -> Option<String> {
    let chunk = row.chunk;
    if row.kl_initial > max_kl {
        return Some(format!(
            "the policy was destroyed, not tuned: after chunk {chunk} its mean sequence KL to the initial policy on the held-out prompts is {:.1} nats, past policy.max_kl = {max_kl}: lower policy.lr (now {lr}) or raise policy.max_kl",
            row.kl_initial
        ));
    }
    let uniform = (vocab as f64).ln();
    if let (Some(h), Some(h0)) = (row.entropy, base.and_then(|b| b.entropy)) {
        if h >= 0.9 * uniform && h0 < 0.75 * uniform {
            return Some(format!(
                "the policy was destroyed, not tuned: after chunk {chunk} its entropy is {h:.2} nats per token, near the uniform ln |V| = {uniform:.2} (the base policy's: {h0:.2}): lower policy.lr (now {lr})"
            ));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(chunk: u64, kl_initial: f64, entropy: Option<f64>) -> PolicyRow {
        PolicyRow { chunk, kl_initial, entropy, ..Default::default() }
    }

    /// Both branches of the guard by hand: ln 49,152 = 10.80 nats is SmolLM2's uniform entropy
    /// (the 1e30 learning rate's policy read 10.80); each failure names policy.lr with its value.
    /// Negative controls: a KL at the bound, an entropy below 90 % of uniform, and a base that
    /// was already near uniform (a random tiny model) pass.
    #[test]
    fn a_destroyed_policy_is_named_by_its_kl_or_its_entropy() {
        let (v, lr) = (49_152, 1e30);
        let uniform = (v as f64).ln();
        let base = row(0, 0.0, Some(2.5));
        let why = destroyed(&row(1, 116.7, Some(10.8)), Some(&base), v, 50.0, lr).unwrap();
        assert!(
            why.contains("116.7 nats, past policy.max_kl = 50")
                && why.contains("policy.lr (now 1000000000000000000000000000000)"),
            "{why}"
        );
        let why = destroyed(&row(1, 3.0, Some(0.95 * uniform)), Some(&base), v, 50.0, lr).unwrap();
        assert!(
            why.contains("entropy is 10.26 nats per token")
                && why.contains("ln |V| = 10.80")
                && why.contains("policy.lr"),
            "{why}"
        );
        assert_eq!(destroyed(&row(1, 50.0, Some(2.6)), Some(&base), v, 50.0, lr), None);
        assert_eq!(destroyed(&row(1, 3.0, Some(0.89 * uniform)), Some(&base), v, 50.0, lr), None);
        let near_uniform_base = row(0, 0.0, Some(0.8 * uniform));
        assert_eq!(destroyed(&row(1, 3.0, Some(0.95 * uniform)), Some(&near_uniform_base), v, 50.0, lr), None);
        assert_eq!(destroyed(&row(1, 3.0, Some(0.95 * uniform)), None, v, 50.0, lr), None);
    }
}
