//! A run's identity (resume.json): what a `--resume` or a merge must match.

use crate::plan::Plan;
use crate::world::World;
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

/// What a run is, for refusing a resume of a different one: the resolved spec without the
/// keys that do not change the numbers (`threads`, `[checkpoint]`, `[track]`), the code revision, and
/// digests of the data files the plan read.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunIdentity {
    pub spec: String,
    pub git_revision: String,
    pub git_dirty: bool,
    pub data: Vec<(String, String)>,
}

impl RunIdentity {
    /// This invocation's identity: the resolved spec less `threads`, `[checkpoint]` and
    /// `[track]`, the code revision, and the digests of what the world read, in a fixed order
    /// (the data files, the prompts and the policy's weights, the warm start, φ and the oracle's
    /// rewards).
    pub fn of(plan: &Plan, world: &World) -> Result<Self> {
        let mut s = plan.resolved(&world.spec);
        s.threads = 0;
        s.checkpoint = Default::default();
        s.track = Default::default();
        let mut data = Vec::new();
        data_file_digests(world, &mut data);
        bank_source_digests(world, &mut data);
        warm_start_digest(plan, world, &mut data);
        bank_digests(world, &mut data);
        Ok(RunIdentity {
            spec: toml::to_string(&s).context("serialising the resolved spec")?,
            git_revision: env!("ONEPASS_GIT_REV").to_string(),
            git_dirty: env!("ONEPASS_GIT_DIRTY") == "true",
            data,
        })
    }

    pub fn fingerprint(&self) -> String {
        blake3::hash(serde_json::to_string(self).expect("plain JSON").as_bytes()).to_hex().to_string()
    }

    /// Why `self` (this invocation) cannot resume `run` (the run directory's), or None.
    pub fn mismatch(&self, run: &RunIdentity) -> Option<String> {
        if self.spec != run.spec {
            let (a, b): (Vec<&str>, Vec<&str>) = (self.spec.lines().collect(), run.spec.lines().collect());
            let i = (0..a.len().max(b.len())).find(|&i| a.get(i) != b.get(i)).unwrap_or(0);
            return Some(format!(
                "the spec differs from the run's: line {} of the resolved spec is `{}` here, `{}` in the run",
                i + 1,
                a.get(i).unwrap_or(&"(end)"),
                b.get(i).unwrap_or(&"(end)")
            ));
        }
        if self.git_revision != run.git_revision {
            return Some(format!(
                "the code revision differs: this binary is {}, the run was made by {}",
                self.git_revision, run.git_revision
            ));
        }
        if self.data != run.data {
            let diff = self
                .data
                .iter()
                .zip(&run.data)
                .find(|(a, b)| a != b)
                .map(|(a, b)| {
                    let was = if a.0 == b.0 { String::new() } else { format!(" ({})", b.0) };
                    format!("{}: digest {} here, {} in the run{was}", a.0, a.1, b.1)
                })
                .unwrap_or_else(|| format!("{} data files here, {} in the run", self.data.len(), run.data.len()));
            return Some(format!("the data differ: {diff}"));
        }
        None
    }
}

/// The data files' digests (training, held out) and the stream order's, as (what, blake3).
fn data_file_digests(world: &World, data: &mut Vec<(String, String)>) {
    if let Some(d) = &world.data {
        data.push((d.train_path.display().to_string(), d.train.digest.clone()));
        if let Some(p) = &d.eval_path {
            data.push((p.display().to_string(), d.eval.digest.clone()));
        }
        if let Some(o) = &d.order {
            let bytes: Vec<u8> = o.iter().flat_map(|&i| (i as u64).to_le_bytes()).collect();
            data.push(("stream order".into(), blake3::hash(&bytes).to_hex().to_string()));
        }
    }
}

/// A generated bank's sources: the prompts' digest (each message's role and content,
/// length-prefixed) and the policy's weights'.
fn bank_source_digests(world: &World, data: &mut Vec<(String, String)>) {
    if let Some(g) = &world.generated {
        // what the bank is made of first — the prompts (training and held out) and the
        // policy's weights — so a refused resume names the file that changed
        if let Some(gs) = &world.spec.generate {
            let mut h = blake3::Hasher::new();
            for m in g.prompts.iter().chain(&g.eval_prompts).flatten() {
                h.update(&(m.role.len() as u64).to_le_bytes());
                h.update(m.role.as_bytes());
                h.update(&(m.content.len() as u64).to_le_bytes());
                h.update(m.content.as_bytes());
            }
            data.push((format!("the prompts (generate.prompts = {})", gs.prompts), h.finalize().to_hex().to_string()));
            data.push((
                format!("the policy's weights (generate.policy = {})", gs.policy),
                g.report.policy_weights_blake3.clone(),
            ));
        }
    }
}

/// The warm start's digest: each pair's prompt, chosen and rejected token ids, length-prefixed.
fn warm_start_digest(plan: &Plan, world: &World, data: &mut Vec<(String, String)>) {
    if let Some(o) = world.online.as_ref().filter(|o| !o.warm_start.is_empty()) {
        // the warm start's pairs as the policy reads them (token ids): a file edited under a
        // run would give its cells two warm starts
        let mut h = blake3::Hasher::new();
        for w in &o.warm_start {
            for ids in [&w.prompt, &w.chosen, &w.rejected] {
                h.update(&(ids.len() as u64).to_le_bytes());
                ids.iter().for_each(|t| {
                    h.update(&t.to_le_bytes());
                });
            }
        }
        let path = plan.policy.as_ref().and_then(|p| p.dpo.warm_start.as_ref()).map_or("", |w| w.path.as_str());
        data.push((
            format!("the warm start's pairs (policy.dpo.warm_start.path = {path})"),
            h.finalize().to_hex().to_string(),
        ));
    }
}

/// A generated bank's digests: its responses' φ and the oracle's rewards of them, each over
/// the contexts in order.
fn bank_digests(world: &World, data: &mut Vec<(String, String)>) {
    if let Some(g) = &world.generated {
        // φ and the oracle's rewards apart, so a refused resume names what changed (the
        // φ model, or an oracle file replaced under the run)
        let (mut hp, mut hr) = (blake3::Hasher::new(), blake3::Hasher::new());
        for c in g.bank.contexts.iter() {
            let phi: Vec<u8> = c.phi.iter().flat_map(|v| v.to_le_bytes()).collect();
            hp.update(&phi);
            let r: Vec<u8> = c.reward.iter().flatten().flat_map(|v| v.to_le_bytes()).collect();
            hr.update(&r);
        }
        let f = world.spec.features.as_ref().map_or(String::new(), |f| f.model.clone());
        data.push((format!("the generated responses' φ (features.model = {f})"), hp.finalize().to_hex().to_string()));
        let o = world.spec.oracle.as_ref();
        let source = match (o.and_then(|o| o.path.as_ref()), o.and_then(|o| o.model.as_ref())) {
            (Some(p), _) => format!("oracle.path = {p}"),
            (None, Some(m)) => format!("oracle.model = {m}"),
            _ => format!("oracle.seed = {}", o.map_or(0, |o| o.seed)),
        };
        data.push((
            format!("the oracle's rewards of the generated responses ({source})"),
            hr.finalize().to_hex().to_string(),
        ));
    }
}
