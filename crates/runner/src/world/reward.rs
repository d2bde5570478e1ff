//! `[reward] update = "lora" | "full"`: the feature model's weights, read once, that every
//! cell's reward model starts from (its adapters or a copy of every weight on top).

use crate::spec::DataSpec;
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
}

impl std::fmt::Debug for RewardBase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RewardBase({} tensors, {})", self.base.len(), self.weights_digest)
    }
}

impl RewardBase {
    pub fn load(d: &DataSpec) -> Result<RewardBase> {
        let model = crate::spec::data::expand_env(&d.model).map_err(|m| anyhow!("model: {m}"))?;
        let source = Source::parse(&model)?;
        let device = super::extract::device(d.device)?;
        // the backbone is built (and dropped) to read the weights as training takes them: f32
        let (backbone, base, _tied) = Backbone::load_base(&source, &device, candle_core::DType::F32, d.max_len)
            .with_context(|| format!("loading the reward model's weights from {model}"))?;
        Ok(RewardBase {
            base,
            cfg: backbone.model.cfg.clone(),
            max_len: d.max_len,
            device,
            weights_digest: backbone.weights_digest,
            source: model,
        })
    }
}
