//! `[reward] update = "lora" | "full"`: the feature model's weights, read once, that every
//! cell's reward model starts from (its adapters or a copy of every weight on top).

use super::generated::{conversation, Generated};
use crate::spec::PhiSpec;
use anyhow::{anyhow, Context, Result};
use candle_core::{Device, Tensor};
use features::model::Config;
use features::{Backbone, Source};
use std::collections::HashMap;

/// The weights of the feature model (`[data] model`) as f32 tensors under Hugging Face names.
pub struct RewardBase {
    pub base: HashMap<String, Tensor>,
    pub cfg: Config,
    /// Positions the decoder is built for: `data.max_len`.
    pub max_len: usize,
    pub device: Device,
    /// blake3 of the weight files (the same model φ was computed with).
    pub weights_digest: String,
    /// The model as the spec names it (an exported adapter's `base_model_name_or_path`).
    pub source: String,
    /// Deployment on generated responses: the token ids of each bank conversation (prompt i,
    /// sample j), templated and truncated as φ's (`Backbone::prepare`); empty in passive.
    pub bank_ids: Vec<Vec<Vec<u32>>>,
}

impl std::fmt::Debug for RewardBase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RewardBase({} tensors, {})", self.base.len(), self.weights_digest)
    }
}

impl RewardBase {
    /// The feature model of `phi` (`[data]` in passive, `[features]` in deploy) as f32 weights;
    /// with a bank of generated responses, the token ids of its conversations.
    pub fn load(phi: &PhiSpec, bank: Option<&Generated>) -> Result<RewardBase> {
        let run = super::extract::PhiRun::new(phi, crate::progress::Mode::Quiet)?;
        let source = Source::parse(&run.model)?;
        let device = super::extract::device(phi.device)?;
        // the backbone is built (and dropped) to read the weights as training takes them: f32
        let (backbone, base, _tied) = Backbone::load_base(&source, &device, candle_core::DType::F32, phi.max_len)
            .with_context(|| format!("loading the reward model's weights from {}", run.model))?;
        let mut bank_ids = Vec::new();
        for (i, (p, ss)) in bank.into_iter().flat_map(|g| g.prompts.iter().zip(&g.samples)).enumerate() {
            let ids: Result<Vec<Vec<u32>>> = ss
                .iter()
                .enumerate()
                .map(|(j, s)| {
                    let item = backbone.prepare(&conversation(p, &s.text), &run.phi);
                    Ok(item.map_err(|e| anyhow!("prompt {}, response {}: {e}", i + 1, j + 1))?.ids)
                })
                .collect();
            bank_ids.push(ids?);
        }
        Ok(RewardBase {
            base,
            cfg: backbone.model.cfg.clone(),
            max_len: phi.max_len,
            device,
            weights_digest: backbone.weights_digest,
            source: run.model,
            bank_ids,
        })
    }
}
