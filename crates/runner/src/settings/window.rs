//! The prequential window of a learner's metric rows ([`Window`]): what the steps since the last
//! evaluation point saw, before each step, on their own batches.

use serde::{Deserialize, Serialize};

/// Sums over the steps of an evaluation window of each step's statistics on its batch before the
/// step (prequential: the pairs had not been trained on), from which a metric row takes its
/// train loss, train accuracy, κ and κ_ref. Serialised inside a cell's checkpoint as its six
/// fields in order (the bytes of the six `win_*` fields it replaced).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(super) struct Window {
    /// Σ loss × pairs.
    loss: f64,
    /// Σ accuracy credit × pairs (a tie counts ½).
    correct: f64,
    /// Pairs.
    n: f64,
    /// max κ over the batches.
    kappa: f64,
    /// Σ κ_ref over the batches.
    kref: f64,
    /// Batches.
    batches: f64,
}

impl Window {
    /// Adds one step's statistics on its batch of `n` pairs, taken before the step.
    pub(super) fn add(&mut self, before: &estimators::BatchStats, n: f64) {
        self.loss += before.loss * n;
        self.correct += before.accuracy * n;
        self.n += n;
        self.kappa = self.kappa.max(before.kappa);
        self.kref += before.kappa_reference;
        self.batches += 1.0;
    }

    /// Mean loss per pair over the window (0 for an empty window).
    pub(super) fn train_loss(&self) -> f64 {
        self.loss / self.n.max(1.0)
    }

    /// Mean accuracy per pair over the window.
    pub(super) fn train_accuracy(&self) -> f64 {
        self.correct / self.n.max(1.0)
    }

    /// The window's largest κ.
    pub(super) fn kappa(&self) -> f64 {
        self.kappa
    }

    /// Mean κ_ref per batch.
    pub(super) fn kappa_reference(&self) -> f64 {
        self.kref / self.batches.max(1.0)
    }
}
