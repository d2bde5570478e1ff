//! PPO's critic (issue 29; OpenRLHF's `CriticModel`): a value head on a decoder's final-norm
//! hidden states, V_t = vᵀ h_t at the state before each response token (the row that predicts
//! it), the decoder adapted by its own LoRA. OpenRLHF initialises the critic from the reward
//! model; onepass's reward model is φᵀθ with φ the final-norm hidden state at a conversation's
//! last token, so a critic on the φ model's weights with v = θ starts out predicting the learned
//! reward at the end of a response.

use crate::batch::SeqBatch;
use crate::lora::Pass;
use crate::model::PolicyModel;
use candle_core::{DType, Result, Tensor, Var};

pub struct Critic {
    /// The backbone (frozen weights, trainable adapters).
    pub model: PolicyModel,
    /// The value head v: (hidden,).
    pub head: Var,
    /// A fixed offset b added to every value, V_t = vᵀh_t + b (not trained: OpenRLHF's
    /// critic subtracts the reward model's normalisation mean as a buffer).
    pub offset: f64,
}

impl Critic {
    /// A critic on `model` with value head `head` (one weight per hidden unit; e.g. θ) and
    /// offset 0.
    pub fn new(model: PolicyModel, head: &[f64]) -> Result<Critic> {
        Critic::with_offset(model, head, 0.0)
    }

    /// A critic V_t = vᵀh_t + `offset`: a reward model (θ, then (hᵀθ − μ)/σ with v = θ/σ and
    /// b = −μ/σ) normalised as the rewards it is to predict are.
    pub fn with_offset(model: PolicyModel, head: &[f64], offset: f64) -> Result<Critic> {
        if !offset.is_finite() {
            candle_core::bail!("a critic offset of {offset}: expected a finite number");
        }
        let d = model.config().hidden;
        if head.len() != d {
            candle_core::bail!("a value head of {} weights for a model of hidden size {d}", head.len());
        }
        let dtype = model.var_dtype();
        let v = Tensor::from_vec(head.to_vec(), d, model.device())?.to_dtype(dtype)?;
        Ok(Critic { model, head: Var::from_tensor(&v)?, offset })
    }

    /// V at every response token of `batch` (P,), in the batch's row order.
    pub fn values(&self, batch: &SeqBatch, pass: Pass<'_>) -> Result<Tensor> {
        let rows = self.model.response_rows(batch, pass)?;
        let d = self.head.as_tensor().dim(0)?;
        let v = rows.matmul(&self.head.as_tensor().reshape((d, 1))?)?.squeeze(1)?;
        if self.offset == 0.0 {
            return Ok(v);
        }
        v.affine(1.0, self.offset)
    }

    /// The trainable variables: the adapters (in `PolicyModel::vars` order), then the head.
    pub fn vars(&self) -> Vec<&Var> {
        let mut v = self.model.vars();
        v.push(&self.head);
        v
    }

    /// Their names (PEFT's for the adapters, `value_head` for v).
    pub fn var_names(&self) -> Vec<String> {
        let mut v = self.model.var_names();
        v.push("value_head".into());
        v
    }

    /// Adam on [`Critic::vars`], its errors naming them.
    pub fn adam(&self, cfg: crate::adam::AdamConfig) -> Result<crate::adam::Adam> {
        crate::adam::Adam::new(cfg, &self.vars())?.with_names(self.var_names())
    }

    /// The head's values as f64.
    pub fn head_values(&self) -> Result<Vec<f64>> {
        self.head.as_tensor().to_dtype(DType::F64)?.to_vec1()
    }
}
