//! `[stream]`: the stream's length, batch and evaluation cadence.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Stream length and evaluation cadence.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StreamSpec {
    /// T: labelled samples (passive: pairs seen; active: the label budget; deploy: rounds).
    #[serde(default = "d_samples")]
    pub samples: u64,
    /// Pairs per update (B).
    #[serde(default = "d_batch")]
    pub batch_size: usize,
    /// Evaluate every this many samples (and at the end).
    #[serde(default = "d_eval_every")]
    pub eval_every: u64,
    /// Also write steps.parquet (one row per update).
    #[serde(default)]
    pub record_steps: bool,
    /// Passive on pairs: R independent heads, as the authors' 4 GPUs ran their OMD (no
    /// all-reduce): rank r trains on rows r, r+R, r+2R, … of the stream (the tail that does not
    /// fill all ranks dropped), each with micro-batch `batch_size`. `samples` counts over all
    /// ranks; metrics are the mean over heads (each evaluated on every held-out pair); θ is rank
    /// 0's head. An all-reduced head of R ranks is one head with batch_size × R.
    #[serde(default = "d_ranks")]
    pub ranks: usize,
}

fn d_ranks() -> usize {
    1
}

impl Default for StreamSpec {
    fn default() -> Self {
        toml::from_str("").expect("all StreamSpec fields have defaults")
    }
}

fn d_samples() -> u64 {
    2000
}
fn d_batch() -> usize {
    1
}
fn d_eval_every() -> u64 {
    500
}
