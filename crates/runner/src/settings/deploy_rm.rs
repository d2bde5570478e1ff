//! Deployment on generated responses with a reward model whose features learn (issue 30,
//! `[reward] update = "lora" | "full"` with env.kind = "generated"): each chunk the current
//! r_{ψ,θ} = θᵀh_ψ scores the chunk's n responses per prompt (h_ψ on the fused inference path,
//! [`CurrentFeatures`]), the strategy picks pairs with the head θ and the uncertainty of the
//! head's curvature over those features, the oracle labels them, and each mini-batch of
//! `stream.batch_size` labelled pairs is one [`policy::rm::update::OnePass`] step over (ψ, θ) on the
//! pairs' token ids. A learning policy then updates on the reward model as it is after the
//! chunk's steps (h_ψ recomputed), and its evaluation's learned reward is that model's.

use super::arms::Labelled;
use super::learner::Learner;
use super::passive_rm::{reward_model, CurrentFeatures};
use super::rm_state::RmState;
use super::state::Progress;
use crate::plan::CellConfig;
use crate::rows::AdapterFiles;
use crate::spec::RewardUpdate;
use crate::world::env::{Context, Env};
use crate::world::generated::{conversation, Generated};
use crate::world::online::Online;
use crate::world::reward::RewardBase;
use anyhow::{anyhow, Context as _, Result};
use features::generate::Sample;
use policy::rm::model::{RewardModel, RmPair};
use policy::rm::update::OnePass;
use std::time::Instant;

/// A cell's reward model and its current features. The update's state (the rule's, the
/// counters) lives in the cell's [`Progress::reward_state`], so a checkpoint holds it.
pub(super) struct LearnedRm<'a> {
    base: &'a RewardBase,
    rm: RewardModel,
    h: CurrentFeatures,
    update: RewardUpdate,
}

impl<'a> LearnedRm<'a> {
    /// The cell's reward model: ψ fresh (LoRA's A from the cell's seed; B = 0, so h starts at
    /// φ) and θ₀ = the learner's, or both from the checkpoint; the update's state is put in
    /// `pr` when the cell starts.
    pub(super) fn start(
        cell: &CellConfig,
        base: &'a RewardBase,
        l: &Learner,
        seed: u32,
        pr: &mut Progress,
        env: &Env,
    ) -> Result<LearnedRm<'a>> {
        let r = cell.reward.as_ref().expect("routed here by [reward]");
        if base.bank_ids.len() != env.contexts.len() || base.bank_ids.iter().any(|x| x.len() != env.k) {
            return Err(anyhow!(
                "[reward] update: the bank's token ids ({} prompts) do not match its {} contexts of {} responses",
                base.bank_ids.len(),
                env.contexts.len(),
                env.k
            ));
        }
        // the run's number of updates (Alg. 5's damping schedule): a step per mini-batch of
        // each chunk's pairs, one pair per prompt
        let (p, chunks, b) = (env.contexts.len(), cell.deploy.chunks, cell.stream.batch_size);
        let steps = (0..chunks).map(|c| crate::plan::chunk_range(c, p, chunks).len().div_ceil(b) as u64).sum();
        let rm = reward_model(cell, base, l.theta(), seed)?;
        match &pr.reward_state {
            Some(st) => rm.set_flat(&st.params).context("the checkpoint's reward model")?,
            None => {
                let update = OnePass::new(&cell.config.cfg, &rm, Some(steps), r.hvp_config(), r.backbone_lr_scale)?;
                pr.reward_state = Some(RmState::new(update));
            }
        }
        let h = CurrentFeatures::of(&rm, base, r.eval_batch)?;
        Ok(LearnedRm { base, rm, h, update: r.update })
    }

    /// h_ψ at the current weights.
    pub(super) fn features(&self) -> &CurrentFeatures {
        &self.h
    }

    /// The token ids of the chunk's responses (per prompt of `xs`, per response): the bank's
    /// when the chunk's responses are the bank's (`samples` empty), else the policy's new
    /// samples templated and truncated as φ's.
    pub(super) fn response_ids(
        &self,
        online: Option<&Online>,
        g: &Generated,
        xs: &[usize],
        samples: &[Vec<Sample>],
    ) -> Result<Vec<Vec<Vec<u32>>>> {
        if samples.is_empty() {
            return Ok(xs.iter().map(|&x| self.base.bank_ids[x].clone()).collect());
        }
        let o = online.ok_or_else(|| anyhow!("new responses without the online loop's feature model"))?;
        xs.iter()
            .zip(samples)
            .map(|(&x, ss)| {
                let convs: Vec<_> = ss.iter().map(|s| conversation(&g.prompts[x], &s.text)).collect();
                o.feature_ids(&convs)
            })
            .collect()
    }

    /// Replaces each context's φ rows by h_ψ of its responses (the oracle's rewards stay).
    pub(super) fn relabel(&self, contexts: &mut [Context], ids: &[Vec<Vec<u32>>]) -> Result<()> {
        let seqs: Vec<&[u32]> = ids.iter().flatten().map(|s| s.as_slice()).collect();
        let mut rows = self.h.of_seqs(&seqs)?.into_iter();
        for (c, ids) in contexts.iter_mut().zip(ids) {
            let h: Vec<Vec<f32>> = rows.by_ref().take(ids.len()).collect();
            let phi = h.concat();
            if phi.len() != c.phi.len() {
                return Err(anyhow!(
                    "h_ψ of {} responses has {} values where φ had {}",
                    ids.len(),
                    phi.len(),
                    c.phi.len()
                ));
            }
            c.phi = phi;
        }
        Ok(())
    }

    /// One step over (ψ, θ) on `pairs` (of the chunk's responses `ids`) with the update's
    /// state `st`; the learner takes θ_{t+1}, the batch's statistics and the tracker's z.
    pub(super) fn step(
        &mut self,
        st: &mut RmState,
        pairs: &[Labelled],
        ids: &[Vec<Vec<u32>>],
        z: &[f32],
        l: &mut Learner,
    ) -> Result<()> {
        let rp: Vec<RmPair> =
            pairs.iter().map(|p| RmPair { a: &ids[p.at][p.first], b: &ids[p.at][p.second], y: p.label }).collect();
        let t0 = Instant::now();
        let s = st.step(&self.rm, &rp)?;
        let y: Vec<f32> = pairs.iter().map(|p| p.label).collect();
        l.record_external(z, &y, &self.rm.head_values()?, &s.before, t0.elapsed().as_secs_f64())
    }

    /// h_ψ after the chunk's steps (the fused model rebuilt over the new weights), and the
    /// parameters into the checkpoint's state.
    pub(super) fn refresh(&mut self, st: &mut RmState) -> Result<()> {
        let r = self.h.batch();
        self.h = CurrentFeatures::of(&self.rm, self.base, r)?;
        st.params = self.rm.flat()?;
        Ok(())
    }

    /// z of the environment's held-out pairs (bank responses) under the current h_ψ.
    pub(super) fn eval_z(&self, env: &Env) -> Result<Vec<f32>> {
        if env.eval_at.len() != env.eval_y.len() {
            return Err(anyhow!("held-out pairs without their responses' positions"));
        }
        // each bank response once
        let mut index = std::collections::BTreeMap::new();
        for &(c, a, b) in &env.eval_at {
            for arm in [a, b] {
                let n = index.len();
                index.entry((c, arm)).or_insert(n);
            }
        }
        let mut keys: Vec<(usize, usize)> = vec![(0, 0); index.len()];
        for (&k, &i) in &index {
            keys[i] = k;
        }
        let seqs: Vec<&[u32]> = keys.iter().map(|&(c, a)| self.base.bank_ids[c][a].as_slice()).collect();
        let h = self.h.of_seqs(&seqs)?;
        let mut z = Vec::with_capacity(env.eval_at.len() * env.d);
        for &(c, a, b) in &env.eval_at {
            let (ha, hb) = (&h[index[&(c, a)]], &h[index[&(c, b)]]);
            z.extend(ha.iter().zip(hb).map(|(x, y)| x - y));
        }
        Ok(z)
    }

    /// The reward model's adapter and head in PEFT's layout (`update = "lora"`; a full
    /// update's weights are a whole model: none).
    pub(super) fn adapter(&self) -> Result<Option<AdapterFiles>> {
        if self.update != RewardUpdate::Lora {
            return Ok(None);
        }
        let (safetensors, config) = policy::peft::encode_reward(&self.rm, &self.base.source)?;
        Ok(Some(AdapterFiles { dir: "reward-model".into(), safetensors, config }))
    }
}
