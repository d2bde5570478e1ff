//! Best-of-n (paper §6's deployed policy with the policy fixed): the sample the learned
//! reward ranks first.

use super::{does_not_learn, Arm, Chunk, Update};
use anyhow::Result;
use policy::adam::Adam;
use policy::PolicyModel;

pub(super) struct BestOfN;

impl Arm for BestOfN {
    fn learns(&self) -> bool {
        false
    }

    /// argmax_a φ(x,a)ᵀθ_t (ties to the lowest index).
    fn deploy(&self, truth: &[f64], est: &[f64]) -> (usize, f64) {
        super::best_of_n(truth, est)
    }

    fn deploys_all(&self) -> bool {
        false
    }

    fn update(&self, _: &PolicyModel, _: &mut Adam, _: &Chunk<'_>) -> Result<Update> {
        Err(does_not_learn("best-of-n"))
    }
}
