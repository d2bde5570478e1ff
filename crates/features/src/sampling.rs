//! How to sample responses, whoever samples them: the local decoder ([`crate::generate`]) or an
//! OpenAI-compatible server ([`crate::openai`]).

use crate::Error;
use serde::{Deserialize, Serialize};

/// How to sample.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SampleOptions {
    /// Responses per prompt.
    pub n: usize,
    /// 0: greedy (argmax).
    pub temperature: f64,
    /// Nucleus sampling: the smallest set of tokens whose probability reaches `top_p` (1: off).
    pub top_p: f64,
    pub max_new_tokens: usize,
    pub seed: u64,
}

impl SampleOptions {
    pub fn check(&self) -> Result<(), Error> {
        if self.n == 0 || self.max_new_tokens == 0 {
            return Err(Error::Input(format!(
                "n = {} and max_new_tokens = {}: expected both ≥ 1",
                self.n, self.max_new_tokens
            )));
        }
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(Error::Input(format!("temperature = {}: expected a finite number ≥ 0", self.temperature)));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::Input(format!("top_p = {}: expected 0 < top_p ≤ 1", self.top_p)));
        }
        Ok(())
    }
}
