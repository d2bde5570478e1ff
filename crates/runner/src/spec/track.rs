//! `[track]`: what a run logs while it runs, beside its tables.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Live tracking of a run. Not part of a run's identity: a run resumed with other `[track]`
/// keys is the same run, and its tables the same bytes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TrackSpec {
    /// Write TensorBoard event files under `<run>/tb/<cell_id>/` as the cells compute their
    /// rows (held-out loss and accuracy, θ error, SubOpt, regret, a learning policy's reward,
    /// KL, losses, gradient norms, stage times and sampled completions), so that
    /// `tensorboard --logdir <run>/tb` shows the run while it runs. The tags are listed in
    /// docs/src/tensorboard-tags.md. Default true; false writes no `tb/`.
    #[serde(default = "d_tensorboard")]
    pub tensorboard: bool,
}

fn d_tensorboard() -> bool {
    true
}

impl Default for TrackSpec {
    fn default() -> Self {
        TrackSpec { tensorboard: d_tensorboard() }
    }
}
