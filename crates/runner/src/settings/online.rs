//! A deployed policy that learns between chunks (paper §6: "…construct new preference pairs,
//! which are then used to update the reward model and the policy model"). Each cell owns its
//! policy: LoRA adapters on the frozen policy model and their Adam state. Per chunk the policy
//! samples n responses to the chunk's prompts (the bank's responses while it has not moved),
//! φ and the oracle score them, the chunk loop labels pairs and updates θ, then
//! [`PolicyCell::update`] takes the policy step: RLOO on the learned reward φᵀθ of all n
//! samples, or online DPO on the labelled pairs. [`PolicyCell::evaluate`] samples the held-out
//! prompts. Cells whose policy does not learn (best-of-n, fixed) are evaluated on the base
//! policy's samples, so every arm of a run has the same policy.parquet rows.

use crate::rows::{AdapterFiles, PolicyRow, PolicyTiming};
use crate::spec::{DeployPolicy, SaveAdapter, Spec};
use crate::world::env::{argmax, dot, seed_of, Component, Context, Env};
use crate::world::generated::{conversation, Generated};
use crate::world::online::Online;
use anyhow::{anyhow, Result};
use candle_core::{DType, Tensor};
use features::generate::Sample;
use policy::adam::{Adam, AdamState};
use policy::train::{dpo_update, rloo_update, score, Preference, Rollout, UpdateStats};
use policy::PolicyModel;
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// A learning policy's state in a checkpoint: adapter values (in `PolicyModel::vars` order),
/// Adam's state, and whether an update has happened (before it, the bank's samples are the
/// policy's).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PolicyState {
    pub vars: Vec<Vec<f32>>,
    pub adam: AdamState,
    pub moved: bool,
}

/// One cell's deployed policy.
pub(super) struct PolicyCell<'a> {
    pub(super) online: &'a Online,
    pub(super) arm: DeployPolicy,
    learner: Option<(PolicyModel, Adam)>,
    moved: bool,
    base_model: String,
}

/// A labelled pair of a chunk: the prompt's index in the chunk, the two samples, y (1: the
/// first preferred).
pub(super) struct Labelled {
    pub(super) at: usize,
    pub(super) first: usize,
    pub(super) second: usize,
    pub(super) label: f32,
}

impl<'a> PolicyCell<'a> {
    /// The cell's policy: fresh adapters drawn from (master seed, seed index, Policy), or the
    /// checkpointed ones.
    pub(super) fn new(
        online: &'a Online,
        arm: DeployPolicy,
        spec: &Spec,
        seed: u32,
        state: Option<&PolicyState>,
    ) -> Result<Self> {
        let base_model = spec.generate.as_ref().map(|g| g.policy.clone()).unwrap_or_default();
        let mut cell = PolicyCell { online, arm, learner: None, moved: false, base_model };
        if arm.learns() {
            let lora = online.spec.lora(seed_of(spec.master_seed, seed, Component::Policy));
            let m = PolicyModel::new(online.base.clone(), online.cfg.clone(), &lora, online.max_len, DType::F32)?;
            let mut adam = Adam::new(online.spec.adam(), &m.vars())?;
            if let Some(st) = state {
                let vars = m.vars();
                if st.vars.len() != vars.len() {
                    return Err(anyhow!(
                        "the checkpoint holds {} adapter tensors: expected {}",
                        st.vars.len(),
                        vars.len()
                    ));
                }
                for (v, x) in vars.iter().zip(&st.vars) {
                    v.set(&Tensor::from_vec(x.clone(), v.as_tensor().shape(), v.as_tensor().device())?)?;
                }
                adam.restore(&st.adam)?;
                cell.moved = st.moved;
            }
            cell.learner = Some((m, adam));
        }
        Ok(cell)
    }

    /// What a checkpoint keeps of the policy (None when it does not learn).
    pub(super) fn state(&self) -> Result<Option<PolicyState>> {
        let Some((m, adam)) = &self.learner else { return Ok(None) };
        let vars = m
            .vars()
            .iter()
            .map(|v| v.as_tensor().flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>())
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Some(PolicyState { vars, adam: adam.state()?, moved: self.moved }))
    }

    /// Samples of `prompts` from the current policy: sampled anew once it has moved, else the
    /// base policy's (`base`).
    fn sample(
        &self,
        prompts: &[Vec<features::Message>],
        opts: &features::generate::SampleOptions,
        base: impl FnOnce() -> Vec<Vec<Sample>>,
    ) -> Result<Vec<Vec<Sample>>> {
        match &self.learner {
            Some((m, _)) if self.moved => self.online.generate(m.merged_weights()?, prompts, opts),
            _ => Ok(base()),
        }
    }

    /// φ of every sample of every prompt, and the oracle's rewards, as contexts.
    fn contexts(&self, prompts: &[&[features::Message]], samples: &[Vec<Sample>]) -> Result<Vec<Context>> {
        let convs: Vec<Vec<features::Message>> =
            prompts.iter().zip(samples).flat_map(|(p, ss)| ss.iter().map(move |s| conversation(p, &s.text))).collect();
        let (phi, rewards) = self.online.score(&convs)?;
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
        if !self.moved {
            let samples = xs.iter().map(|&x| g.samples[x].clone()).collect();
            return Ok((xs.iter().map(|&x| env.contexts[x].clone()).collect(), samples));
        }
        let t0 = Instant::now();
        let prompts: Vec<Vec<features::Message>> = xs.iter().map(|&x| g.prompts[x].clone()).collect();
        let samples = self.sample(&prompts, &self.online.opts, Vec::new)?;
        time.generation_s += t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let refs: Vec<&[features::Message]> = prompts.iter().map(|p| p.as_slice()).collect();
        let contexts = self.contexts(&refs, &samples)?;
        time.phi_s += t1.elapsed().as_secs_f64();
        Ok((contexts, samples))
    }

    /// The policy step after θ's update on the chunk: RLOO on r̂ = φᵀθ of every sample, or DPO
    /// on the labelled pairs. None when the policy does not learn.
    pub(super) fn update(
        &mut self,
        xs: &[usize],
        samples: &[Vec<Sample>],
        contexts: &[Context],
        pairs: &[Labelled],
        theta: &[f64],
        d: usize,
    ) -> Result<Option<UpdateStats>> {
        let Some((m, adam)) = &mut self.learner else { return Ok(None) };
        let ids = &self.online.prompt_ids;
        let stats = match self.arm {
            DeployPolicy::Rloo => {
                let k = samples.first().map_or(0, Vec::len);
                let mut rollouts = Vec::new();
                let mut rewards = Vec::new();
                for ((&x, ss), c) in xs.iter().zip(samples).zip(contexts) {
                    for (j, s) in ss.iter().enumerate() {
                        rollouts.push(Rollout { prompt: &ids[x], response: &s.ids });
                        rewards.push(dot(&c.phi[j * d..(j + 1) * d], theta));
                    }
                }
                rloo_update(m, adam, &rollouts, &rewards, k, &self.online.spec.rloo())?
            }
            DeployPolicy::Dpo => {
                let prefs: Vec<Preference> = pairs
                    .iter()
                    .map(|p| {
                        let (w, l) = if p.label >= 0.5 { (p.first, p.second) } else { (p.second, p.first) };
                        let ss = &samples[p.at];
                        Preference { prompt: &ids[xs[p.at]], chosen: &ss[w].ids, rejected: &ss[l].ids }
                    })
                    .collect();
                dpo_update(m, adam, &prefs, &self.online.spec.dpo())?
            }
            DeployPolicy::BestOfN | DeployPolicy::Fixed => return Ok(None),
        };
        self.moved = true;
        Ok(Some(stats))
    }

    /// The policy on the held-out prompts under θ: oracle and learned rewards of its samples,
    /// best-of-`eval_samples` under θ, KL to the reference and entropy (learning policies).
    pub(super) fn evaluate(&self, chunk: u64, theta: &[f64], d: usize) -> Result<PolicyRow> {
        let o = self.online;
        let samples = self.sample(&o.eval_prompts, &o.eval_opts, || o.eval_base.clone())?;
        let refs: Vec<&[features::Message]> = o.eval_prompts.iter().map(|p| p.as_slice()).collect();
        let contexts = self.contexts(&refs, &samples)?;
        let (mut oracle, mut learned, mut bon, mut n) = (0.0, 0.0, 0.0, 0usize);
        for c in &contexts {
            let truth = c.reward.as_ref().expect("scored");
            let est: Vec<f64> = c.phi.chunks_exact(d).map(|p| dot(p, theta)).collect();
            oracle += truth.iter().sum::<f64>();
            learned += est.iter().sum::<f64>();
            bon += truth[argmax(est.iter().copied())];
            n += truth.len();
        }
        let all: Vec<&Sample> = samples.iter().flatten().collect();
        let mut row = PolicyRow {
            chunk,
            oracle_reward: oracle / n as f64,
            bon_oracle_reward: bon / contexts.len() as f64,
            learned_reward: learned / n as f64,
            response_tokens: all.iter().map(|s| s.tokens as f64).sum::<f64>() / n as f64,
            cut_fraction: all.iter().filter(|s| !s.stopped).count() as f64 / n as f64,
            ..Default::default()
        };
        if let Some((m, _)) = &self.learner {
            let rollouts: Vec<Rollout> = samples
                .iter()
                .zip(&o.eval_ids)
                .flat_map(|(ss, p)| ss.iter().map(move |s| Rollout { prompt: p, response: &s.ids }))
                .collect();
            let sc = score(m, &rollouts, o.spec.kl_estimator, o.spec.minibatch)?;
            row.kl = sc.iter().map(|s| s.1).sum::<f64>() / sc.len() as f64;
            let tokens: usize = sc.iter().map(|s| s.2).sum();
            row.entropy = Some(-sc.iter().map(|s| s.0).sum::<f64>() / tokens as f64);
        }
        Ok(row)
    }

    /// The adapters after chunk `chunk` (of `chunks`) when policy.save_adapter asks for them;
    /// `dir` relative to the cell's adapter directory.
    pub(super) fn adapter(&self, chunk: u64, chunks: u64) -> Result<Option<AdapterFiles>> {
        let Some((m, _)) = &self.learner else { return Ok(None) };
        let dir = match self.online.spec.save_adapter {
            SaveAdapter::None => return Ok(None),
            SaveAdapter::Last if chunk < chunks => return Ok(None),
            SaveAdapter::Last => String::new(),
            SaveAdapter::EveryChunk => format!("chunk-{chunk:02}"),
        };
        let (safetensors, config) = policy::peft::encode(m, &self.base_model)?;
        Ok(Some(AdapterFiles { dir, safetensors, config }))
    }
}
