//! Online DPO (`policy::train::dpo_update`), reference = the KL reference of `[policy]`, on the
//! pairs `[policy.dpo] pairs` names: the strategy's labelled pair of each prompt, or the first
//! two of each prompt's rollouts labelled by the oracle's rewards (the authors' DPO arm). Pairs
//! without a preference — an argmax-label tie (a coin flip), equal oracle rewards, or two
//! identical responses — are dropped and counted.

use super::{mean, Arm, Chunk, Update};
use crate::spec::policy::DpoPairs;
use anyhow::{anyhow, Result};
use policy::adam::Adam;
use policy::train::{dpo_update, DpoConfig, Preference, UpdateStats};
use policy::PolicyModel;

pub(super) struct Dpo {
    pub(super) update: DpoConfig,
    pub(super) pairs: DpoPairs,
}

impl Dpo {
    /// The chunk's preferences and the count of pairs dropped.
    fn preferences<'a>(&self, c: &Chunk<'a>) -> Result<(Vec<Preference<'a>>, u64)> {
        let (mut prefs, mut dropped) = (Vec::new(), 0);
        match self.pairs {
            DpoPairs::Strategy => {
                for p in c.pairs {
                    let ss = &c.samples[p.at];
                    if p.tie || ss[p.first].ids == ss[p.second].ids {
                        dropped += 1;
                        continue;
                    }
                    let (w, l) = if p.label >= 0.5 { (p.first, p.second) } else { (p.second, p.first) };
                    prefs.push(Preference { prompt: c.prompts[p.at], chosen: &ss[w].ids, rejected: &ss[l].ids });
                }
            }
            DpoPairs::FreshTwo => {
                let r = c.rollouts;
                for ((&at, ss), ctx) in r.at.iter().zip(&r.samples).zip(&r.contexts) {
                    let truth = ctx.reward.as_deref().unwrap_or_default();
                    if ss.len() < 2 || truth.len() < 2 {
                        return Err(anyhow!("dpo pairs = \"fresh-two\": a prompt with {} rollouts", ss.len()));
                    }
                    // the oracle's argmax label, as the authors' (no coin for a tie: dropped)
                    if truth[0] == truth[1] || ss[0].ids == ss[1].ids {
                        dropped += 1;
                        continue;
                    }
                    let (w, l) = if truth[0] > truth[1] { (0, 1) } else { (1, 0) };
                    prefs.push(Preference { prompt: c.prompts[at], chosen: &ss[w].ids, rejected: &ss[l].ids });
                }
            }
        }
        Ok((prefs, dropped))
    }
}

impl Arm for Dpo {
    fn learns(&self) -> bool {
        true
    }

    fn deploy(&self, truth: &[f64], _: &[f64]) -> (usize, f64) {
        mean(truth)
    }

    fn update(&self, m: &PolicyModel, adam: &mut Adam, c: &Chunk<'_>) -> Result<Update> {
        let (prefs, dropped) = self.preferences(c)?;
        // a chunk whose pairs all lack a preference takes no step (recorded: 0 steps, dropped)
        let stats = if prefs.is_empty() { UpdateStats::default() } else { dpo_update(m, adam, &prefs, &self.update)? };
        Ok(Update { stats, pairs: prefs.len() as u64, dropped, critic: None })
    }
}
