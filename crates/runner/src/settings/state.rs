//! A cell's state between loop units: its random streams, the stream position, rows and running
//! sums ([`Progress`]), with what each setting keeps besides — the learning policy's
//! ([`PolicyState`]) and the reward model's ([`RmState`]). How it is checkpointed is
//! checkpoint.rs's.

use super::rm_state::RmState;
use crate::rows::{AdapterFiles, MetricRow, PolicyRow, PolicyTiming, RoundRow, SampleRow, UpdateRow};
use crate::world::env::{stream, Component};
use estimators::Curvature;
use policy::adam::AdamState;
use policy::model::LifeEvent;
use rand_chacha::ChaCha20Rng;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct Hasher(pub(super) u64);

impl Hasher {
    pub(super) fn new() -> Self {
        Hasher(0xcbf2_9ce4_8422_2325)
    }
    pub(super) fn bytes(&mut self, b: &[u8]) {
        for &x in b {
            self.0 = (self.0 ^ u64::from(x)).wrapping_mul(0x100_0000_01b3);
        }
    }
    pub(super) fn f32s(&mut self, v: &[f32]) {
        for x in v {
            self.bytes(&x.to_le_bytes());
        }
    }
}

/// Where a cell's loop stands: its random streams, the stream position, the rows so far, and
/// what each setting keeps besides ([`DeployProgress`], [`ActiveProgress`], [`PolicyProgress`],
/// the reward model's state). With the learners, everything a checkpoint holds.
#[derive(Serialize, Deserialize)]
pub struct Progress {
    /// Loop units completed: updates (passive, active, deploy) or chunks (chunked deploy).
    pub(super) done: u64,
    /// Training rows of the stream order consumed so far (pairs): an explicit index.
    pub(super) position: u64,
    pub(super) data: ChaCha20Rng,
    pub(super) labels: ChaCha20Rng,
    pub(super) select: ChaCha20Rng,
    pub(super) hash: Hasher,
    pub(super) rows: Vec<MetricRow>,
    /// Ties broken by a seeded draw so far (selection rules).
    pub(super) ties: u64,
    pub(super) deploy: DeployProgress,
    pub(super) active: ActiveProgress,
    pub(super) policy: PolicyProgress,
    /// The labels the cell's labeller has given and flipped (`[oracle] flip`).
    #[serde(default)]
    pub(super) flips: crate::world::env::LabelCount,
    /// `[reward] update = "lora" | "full"`: the reward model's parameters and update state.
    #[serde(default)]
    pub(super) reward_state: Option<RmState>,
}

/// Deployment's running sums: rounds.parquet's rows, the argmax oracle's ties, regret and the
/// chosen pairs' rewards, prompts seen.
#[derive(Default, Serialize, Deserialize)]
pub(super) struct DeployProgress {
    pub(super) rounds: Vec<RoundRow>,
    pub(super) oracle_ties: u64,
    pub(super) regret: f64,
    pub(super) reward_sum: f64,
    pub(super) cum_pair: f64,
    pub(super) seen: u64,
}

/// Active collection: pool rows already labelled, and the authors' V tracker.
#[derive(Default, Serialize, Deserialize)]
pub(super) struct ActiveProgress {
    pub(super) used: Vec<bool>,
    pub(super) vtrack: Option<Curvature>,
}

/// Deploy with a learning policy in the run: its evaluations, updates, timings, adapters and
/// optimiser state so far.
#[derive(Default, Serialize, Deserialize)]
pub(super) struct PolicyProgress {
    pub(super) rows: Vec<PolicyRow>,
    pub(super) samples: Vec<SampleRow>,
    pub(super) updates: Vec<UpdateRow>,
    pub(super) times: Vec<PolicyTiming>,
    pub(super) state: Option<PolicyState>,
    pub(super) adapters: Vec<AdapterFiles>,
}

/// A learning policy's state in a checkpoint: adapter values (in `PolicyModel::vars` order),
/// Adam's state, whether an update has happened (before it, the bank's samples are the
/// policy's), and the adapters' life-cycle events (merges, reference moves) to replay.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PolicyState {
    pub vars: Vec<Vec<f32>>,
    pub adam: AdamState,
    pub moved: bool,
    #[serde(default)]
    pub life: Vec<LifeEvent>,
}

impl Progress {
    /// The start of a cell: every stream at its origin.
    pub(super) fn fresh(master_seed: u64, seed: u32) -> Progress {
        Progress {
            done: 0,
            position: 0,
            data: stream(master_seed, seed, Component::Data),
            labels: stream(master_seed, seed, Component::Labels),
            select: stream(master_seed, seed, Component::Select),
            hash: Hasher::new(),
            rows: Vec::new(),
            ties: 0,
            deploy: DeployProgress::default(),
            active: ActiveProgress::default(),
            policy: PolicyProgress::default(),
            flips: Default::default(),
            reward_state: None,
        }
    }
}
