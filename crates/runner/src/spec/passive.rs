//! `[passive]`: the pessimistic policy of the passive setting.

use super::Beta;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Pessimism {
    /// argmax_a φᵀθ − β‖φ‖_{𝓗⁻¹} in every context.
    PerContext,
    /// Eq. (5) over the policy class (exhaustive when small, else coordinate ascent).
    Policy,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PassiveSpec {
    /// The pessimistic policy the final θ is scored by (SubOpt of metrics.parquet's last row).
    #[serde(default = "d_pessimism")]
    pub pessimism: Pessimism,
    /// β of the pessimistic policy: a number or "theory" (√d·log(T/δ), the order of Lemma 1).
    #[serde(default = "d_beta")]
    pub beta: Beta,
    /// δ of β = "theory".
    #[serde(default = "d_delta")]
    pub delta: f64,
    /// The reference vector of Zhu et al.'s pessimistic value, reported as
    /// `subopt_pessimistic_ref` beside the paper's form (`subopt_pessimistic`): `uniform` (the
    /// default) centres each context's features on their mean over arms — the reference policy
    /// picks arms uniformly —, `none` leaves the column empty.
    #[serde(default)]
    pub pessimism_reference: PessimismReference,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum PessimismReference {
    #[default]
    Uniform,
    None,
}

impl Default for PassiveSpec {
    fn default() -> Self {
        toml::from_str("").expect("defaults")
    }
}

fn d_pessimism() -> Pessimism {
    Pessimism::PerContext
}
pub(super) fn d_beta() -> Beta {
    Beta::Theory
}
pub(super) fn d_delta() -> f64 {
    0.05
}
