//! `[curvature]`: the 𝓗_t behind uncertainty.

use super::OrAuto;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum CurvaturePoint {
    /// σ′(zᵀθ_{t+1}), after the update: the paper's look-ahead 𝓗_t.
    LookAhead,
    /// σ′(zᵀθ_t), before the update.
    Current,
}

/// The uncertainty ‖x‖_{𝓗_t⁻¹} that drives pessimism, UCB and active selection, and the 𝓗_t
/// tracker every cell keeps (theta_err_H; the uncertainty of estimators without their own 𝓗).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CurvatureSpec {
    /// The tracker's 𝓗_1 = λI: a number or "auto" (the median ‖z‖² of the first pairs). Unset:
    /// the estimator's own λ (`lambda` of omd-exact), else 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lambda: Option<OrAuto>,
    /// Where the tracker evaluates σ′: "look-ahead" (σ′(zᵀθ_{t+1}), after the update: the paper's
    /// 𝓗_t) or "current" (σ′(zᵀθ_t), before it).
    #[serde(default = "d_point")]
    pub point: CurvaturePoint,
    /// Whose 𝓗_t gives the uncertainty: `auto` (the estimator's own when it keeps one — omd-exact,
    /// as Alg. 3 and 4 use the learner's 𝓗_t —, else the tracker), `estimator` (refused for an
    /// estimator without one), `tracker`.
    #[serde(default)]
    pub source: CurvatureSource,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum CurvatureSource {
    #[default]
    Auto,
    Estimator,
    Tracker,
}

impl Default for CurvatureSpec {
    fn default() -> Self {
        toml::from_str("").expect("defaults")
    }
}

fn d_point() -> CurvaturePoint {
    CurvaturePoint::LookAhead
}
