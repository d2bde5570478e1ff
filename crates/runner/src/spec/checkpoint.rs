//! `[checkpoint]`: when cells save their state.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Periodic checkpoints of every running cell (estimator, curvature, RNG streams, stream
/// position, rows so far) under `<run>/checkpoints/`; SIGINT/SIGTERM always checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSpec {
    /// Seconds of a cell's work between checkpoints (0: only at SIGINT/SIGTERM). Default 120.
    #[serde(default = "d_every_s")]
    pub every_s: f64,
    /// Also every this many loop steps (updates; deploy on generated responses: chunks); 0: off.
    #[serde(default)]
    pub every_steps: u64,
}

fn d_every_s() -> f64 {
    120.0
}

impl Default for CheckpointSpec {
    fn default() -> Self {
        CheckpointSpec { every_s: d_every_s(), every_steps: 0 }
    }
}
