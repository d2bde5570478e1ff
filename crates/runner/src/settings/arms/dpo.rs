//! Online DPO on the chunk's labelled pairs (`policy::train::dpo_update`), reference = the
//! initial policy. Pairs without a preference — an argmax-label tie (a coin flip) or two
//! identical responses — are dropped and counted.

use super::{mean, Arm, Chunk, Update};
use anyhow::Result;
use policy::adam::Adam;
use policy::train::{dpo_update, DpoConfig, Preference, UpdateStats};
use policy::PolicyModel;

pub(super) struct Dpo {
    pub(super) update: DpoConfig,
}

impl Arm for Dpo {
    fn learns(&self) -> bool {
        true
    }

    fn deploy(&self, truth: &[f64], _: &[f64]) -> (usize, f64) {
        mean(truth)
    }

    fn update(&self, m: &PolicyModel, adam: &mut Adam, c: &Chunk<'_>) -> Result<Update> {
        let mut prefs = Vec::new();
        let mut dropped = 0;
        for p in c.pairs {
            let ss = &c.samples[p.at];
            if p.tie || ss[p.first].ids == ss[p.second].ids {
                dropped += 1;
                continue;
            }
            let (w, l) = if p.label >= 0.5 { (p.first, p.second) } else { (p.second, p.first) };
            prefs.push(Preference { prompt: c.prompts[p.at], chosen: &ss[w].ids, rejected: &ss[l].ids });
        }
        // a chunk whose pairs all lack a preference takes no step (recorded: 0 steps, dropped)
        let stats = if prefs.is_empty() { UpdateStats::default() } else { dpo_update(m, adam, &prefs, &self.update)? };
        Ok(Update { stats, pairs: prefs.len() as u64, dropped, critic: None })
    }
}
