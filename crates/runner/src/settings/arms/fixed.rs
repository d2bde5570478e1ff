//! The fixed policy: the base policy's samples as drawn (the floor of reranking).

use super::{does_not_learn, mean, Arm, Chunk, Update};
use anyhow::Result;
use policy::adam::Adam;
use policy::PolicyModel;

pub(super) struct Fixed;

impl Arm for Fixed {
    fn learns(&self) -> bool {
        false
    }

    fn deploy(&self, truth: &[f64], _: &[f64]) -> (usize, f64) {
        mean(truth)
    }

    fn update(&self, _: &PolicyModel, _: &mut Adam, _: &Chunk<'_>) -> Result<Update> {
        Err(does_not_learn("the fixed policy"))
    }
}
