//! PPO with a critic (`policy::train::ppo_update`; OpenRLHF's `PPOTrainer`, the loop the
//! authors ran) on the arm's rollouts, driven by the reward its source names (as rloo's). The
//! critic starts every chunk as the authors' loop starts it — from the reward model of that
//! chunk, normalised as the rewards are (OpenRLHF's critic loaded with `normalize_reward`
//! returns (r − μ)/σ): V_t = (h_tᵀθ_t − μ)/σ with μ, σ the learned rewards' mean and sd over
//! the update's rollouts (`critic_head = "theta"`, the learned source's default; μ = 0, σ = 1
//! without normalisation; or V = 0 with "zero", the oracle and null controls' default: they
//! carry no learned signal), h the policy backbone's final-norm hidden states, with fresh adapters
//! (rank, α and targets of `[policy]`, A drawn from the cell's critic stream and the chunk) and
//! a fresh Adam at `critic_lr`. So it carries no state from chunk to chunk, and a checkpoint
//! needs none.

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
/// the longest sequence, the adapters' shape, and the products `[policy] dtype` asks for.
pub(super) struct Backbone {
    base: HashMap<String, Tensor>,
    cfg: features::model::Config,
    max_len: usize,
    lora: policy::LoraConfig,
    bf16: bool,
}

impl Backbone {
    /// The critic's backbone with adapters `lora`, on the policy's products: its frozen weights
    /// in bf16 as the learner's with policy.dtype = "bf16" (the value head, the adapters and
    /// Adam stay f32), else packed f32 where the CPU path allows.
    fn model(&self, lora: &policy::LoraConfig) -> Result<PolicyModel> {
        let mut m = PolicyModel::new(self.base.clone(), self.cfg.clone(), lora, self.max_len, DType::F32)?;
        if self.bf16 {
            m.use_bf16_products()?;
        } else if m.can_pack_products() {
            m.use_packed_products(false)?;
        }
        Ok(m)
    }

    pub(super) fn of(o: &crate::world::online::Online) -> Backbone {
        let bf16 = o.spec.dtype == crate::spec::policy::TrainDtype::Bf16;
        Backbone { base: o.base.clone(), cfg: o.cfg.clone(), max_len: o.max_len, lora: o.spec.lora(0), bf16 }
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
    /// The critic of chunk `chunk`: fresh adapters from (critic stream, chunk), v = θ_t/σ with
    /// offset −μ/σ (μ, σ: the moments of the learned reward `learned` over the update's
    /// rollouts, as the update normalises; all equal: θ as is) or 0.
    fn critic(&self, chunk: u64, theta: &[f64], learned: impl FnOnce() -> Result<Vec<f64>>) -> Result<Critic> {
        let b = &self.backbone;
        let seed = crate::world::env::per_chunk_seed(b"onepass-critic", self.critic_seed, chunk);
        let lora = policy::LoraConfig { seed, dropout: 0.0, ..b.lora.clone() };
        let m = b.model(&lora)?;
        let head = match self.critic.head {
            CriticHead::Theta if theta.len() != b.cfg.hidden => {
                return Err(anyhow!(
                    "policy.ppo.critic_head = \"theta\": θ has {} weights, the policy's hidden size is {}",
                    theta.len(),
                    b.cfg.hidden
                ))
            }
            CriticHead::Theta => {
                let (mu, sd) = self.update.reward_norm.moments(&learned()?).unwrap_or((0.0, 1.0));
                let v: Vec<f64> = theta.iter().map(|t| t / sd).collect();
                return Ok(Critic::with_offset(m, &v, -mu / sd)?);
            }
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
        // a θ head starts as the learned reward model (the plan gives the controls a zero head)
        let learned = || match self.reward {
            RewardSource::Learned => Ok(rewards.clone()),
            _ => Ok(rewarded(c, RewardSource::Learned, self.null_seed)?.1),
        };
        let critic = self.critic(c.index, c.theta, learned)?;
        // a fresh Adam per chunk on the run's step count (one critic step per actor step), so
        // a schedule over the run does not restart
        let mut copt =
            critic.adam(policy::adam::AdamConfig { lr: self.critic.lr, ..adam.cfg })?.continuing(adam.run_steps());
        let st = ppo_update((m, adam), (&critic, &mut copt), &rollouts, &rewards, k, &self.update)?;
        Ok(Update {
            stats: st.actor,
            pairs: 0,
            dropped: 0,
            critic: Some(CriticStats {
                loss: st.critic_loss,
                grad_norm: st.critic_grad_norm,
                value_mean: st.value_mean,
                return_mean: st.return_mean,
                seconds: st.critic_seconds,
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With policy.dtype = "bf16" the critic's frozen products are bf16, as the learner's; with
    /// f32 they are not (the control).
    #[test]
    fn the_critic_follows_the_policys_products() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../features/tests/fixtures/tiny-llama");
        let hf: features::model::HfConfig =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
        let cfg = features::model::Config::from_hf(&hf).unwrap();
        let base: HashMap<String, Tensor> =
            candle_core::safetensors::load(dir.join("model.safetensors"), &candle_core::Device::Cpu).unwrap();
        let base = base.into_iter().map(|(k, v)| (k, v.to_dtype(DType::F32).unwrap())).collect();
        let lora = policy::LoraConfig { rank: 2, alpha: 4.0, ..Default::default() };
        for bf16 in [false, true] {
            let b = Backbone { base: Clone::clone(&base), cfg: cfg.clone(), max_len: 32, lora: lora.clone(), bf16 };
            assert_eq!(b.model(&lora).unwrap().bf16_products(), bf16);
        }
    }
}
