//! PPO with a critic (`policy::train::ppo_update`; OpenRLHF's `PPOTrainer`, the loop the
//! authors ran) on the chunk's n samples per prompt, driven by the reward its source names (as
//! rloo's). The critic starts every chunk as the authors' loop starts it — from the reward
//! model of that chunk: a value head v = θ_t (`critic_head = "theta"`; or 0) on the policy's
//! backbone, final-norm hidden states, with fresh adapters (rank, α and targets of
//! `[policy]`, A drawn from the cell's critic stream and the chunk) and a fresh Adam at
//! `critic_lr`. So it carries no state from chunk to chunk, and a checkpoint needs none.

use super::{mean, rewarded, Arm, Chunk, CriticStats, Update};
use crate::plan::CriticPlan;
use crate::spec::{CriticHead, RewardSource};
use anyhow::{anyhow, Result};
use candle_core::{DType, Tensor};
use policy::adam::Adam;
use policy::critic::Critic;
use policy::train::{ppo_update, PpoConfig};
use policy::PolicyModel;
use std::collections::HashMap;

/// What a critic is built on: the policy's frozen weights (shared tensors), its architecture,
/// the longest sequence, the adapters' shape.
pub(super) struct Backbone {
    base: HashMap<String, Tensor>,
    cfg: features::model::Config,
    max_len: usize,
    lora: policy::LoraConfig,
}

impl Backbone {
    pub(super) fn of(o: &crate::world::online::Online) -> Backbone {
        Backbone { base: o.base.clone(), cfg: o.cfg.clone(), max_len: o.max_len, lora: o.spec.lora(0) }
    }
}

pub(super) struct Ppo {
    pub(super) reward: RewardSource,
    pub(super) update: PpoConfig,
    pub(super) null_seed: u64,
    pub(super) critic: CriticPlan,
    pub(super) critic_seed: u64,
    pub(super) backbone: Backbone,
}

impl Ppo {
    /// The critic of chunk `chunk`: fresh adapters from (critic stream, chunk), v = θ_t or 0.
    fn critic(&self, chunk: u64, theta: &[f64]) -> Result<Critic> {
        let b = &self.backbone;
        let seed = crate::world::env::per_chunk_seed(b"onepass-critic", self.critic_seed, chunk);
        let lora = policy::LoraConfig { seed, dropout: 0.0, ..b.lora.clone() };
        let m = PolicyModel::new(b.base.clone(), b.cfg.clone(), &lora, b.max_len, DType::F32)?;
        let head = match self.critic.head {
            CriticHead::Theta if theta.len() != b.cfg.hidden => {
                return Err(anyhow!(
                    "policy.ppo.critic_head = \"theta\": θ has {} weights, the policy's hidden size is {}",
                    theta.len(),
                    b.cfg.hidden
                ))
            }
            CriticHead::Theta => theta.to_vec(),
            CriticHead::Zero => vec![0.0; b.cfg.hidden],
        };
        Ok(Critic::new(m, &head)?)
    }
}

impl Arm for Ppo {
    fn learns(&self) -> bool {
        true
    }

    fn deploy(&self, truth: &[f64], _: &[f64]) -> (usize, f64) {
        mean(truth)
    }

    fn update(&self, m: &PolicyModel, adam: &mut Adam, c: &Chunk<'_>) -> Result<Update> {
        let (rollouts, rewards, k) = rewarded(c, self.reward, self.null_seed)?;
        let critic = self.critic(c.index, c.theta)?;
        let mut copt = critic.adam(policy::adam::AdamConfig { lr: self.critic.lr, ..adam.cfg })?;
        let st = ppo_update(m, adam, &critic, &mut copt, &rollouts, &rewards, k, &self.update)?;
        Ok(Update {
            stats: st.actor,
            pairs: 0,
            dropped: 0,
            critic: Some(CriticStats {
                loss: st.critic_loss,
                grad_norm: st.critic_grad_norm,
                value_mean: st.value_mean,
                return_mean: st.return_mean,
            }),
        })
    }
}
