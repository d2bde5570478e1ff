//! The memory a run's cells will take, estimated from the plan before anything is allocated, and
//! the check against what the machine has (`MemAvailable`) or `--max-memory`. The estimate counts
//! the dominant terms per cell — the estimator's state (omd-exact's packed 𝓗⁻¹ is d(d+1)/2 f64;
//! mle and sgd-replay keep the whole history), the curvature tracker (𝓗⁻¹ and 𝓗, two packed
//! matrices) when the cell uses one, the authors' V tracker, the synthetic bandit's contexts and
//! evaluation pairs, an active pool — times the cells that run at once. Shared data (pairs read
//! once) is already allocated when the second check runs, so `MemAvailable` accounts for it. A
//! learning policy's cell adds its adapters (with their gradient and Adam's two moments), the
//! f32 copies of the adapted weights its generator merges, on the CPU the frozen weights packed
//! for its products (and a ppo critic's), the KV cache of a generation batch, a gradient pass's
//! activations and logits, and a ppo critic's adapters ([`PolicyShape`]); a
//! full-parameter dpo cell, every weight with its gradient, Adam's moments, the reference, the
//! generator's copy and a checkpoint's copies of them.

use crate::plan::{needs_tracker, ConfigPlan, Plan};
use crate::spec::{ActiveRule, EnvKind, ScoreNorm, Setting, Spec};
use estimators::{EstimatorConfig, Kind, MleSolver};

/// One term of the estimate: the key that sets it, what it is, bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct Term {
    /// The key to blame (its spec line is named): a fixed key, or one with the table's index.
    pub key: std::borrow::Cow<'static, str>,
    pub what: String,
    pub bytes: u64,
}

/// What the cells will take.
#[derive(Clone, Debug, PartialEq)]
pub struct Estimate {
    /// the largest cell's terms, largest first
    pub cell: Vec<Term>,
    pub per_cell: u64,
    /// cells that run at once (threads, at most the cells)
    pub parallel: usize,
    /// the result rows of the process's cells, held until the tables are written
    /// ([`row_terms`]), largest first
    pub rows: Vec<Term>,
    pub total: u64,
}

/// Bytes an update's steps.parquet row takes until the tables are written (the row, the cell's
/// outcome and the table's columns). Measured: 381 B per update, the peak RSS of
/// `experiments/passive/synthetic.toml`-like runs (d = 8, one cell, 10⁶ updates) with and
/// without `stream.record_steps`; rounded up.
const STEP_ROW_BYTES: u64 = 400;

/// The same for an evaluation point's metrics and timings rows: 930 B measured (2·10⁵
/// evaluation points, `stream.eval_every = 1`); rounded up.
const METRIC_ROW_BYTES: u64 = 1000;

/// The result rows the process's `cells` keep until the tables are written: one metrics row per
/// evaluation point (at most one per update, so 1 + min(T / eval_every, T / (batch_size ·
/// ranks))) and, with `stream.record_steps`, one steps row per update of every head (T /
/// batch_size: each of the `ranks` heads records its own). A chunked deployment writes one
/// metrics row per chunk, fewer than this counts.
fn row_terms(spec: &Spec, cells: u64) -> Vec<Term> {
    let st = &spec.stream;
    let batch = (st.batch_size.max(1) as u64).saturating_mul(st.ranks.max(1) as u64);
    let evals = (st.samples / st.eval_every.max(1)).min(st.samples / batch).saturating_add(1);
    let mut t = vec![Term {
        key: "stream.eval_every".into(),
        what: format!("metrics rows ({evals} evaluation points × {cells} cells)"),
        bytes: evals.saturating_mul(cells).saturating_mul(METRIC_ROW_BYTES),
    }];
    if st.record_steps {
        let updates = st.samples / st.batch_size.max(1) as u64;
        t.push(Term {
            key: "stream.record_steps".into(),
            what: format!("steps rows ({updates} updates × {cells} cells)"),
            bytes: updates.saturating_mul(cells).saturating_mul(STEP_ROW_BYTES),
        });
    }
    t.sort_by_key(|x| std::cmp::Reverse(x.bytes));
    t
}

/// What sizes a learning policy's memory, known once the world has loaded the policy: its
/// architecture, the longest sequence it scores (templated prompt + new tokens), samples per
/// prompt, prompts per generation batch, and the number of its weights.
#[derive(Clone, Debug)]
pub struct PolicyShape {
    pub cfg: features::model::Config,
    pub seq_len: usize,
    pub n: usize,
    pub batch_prompts: usize,
    pub weights: u64,
    /// The policy lives on an accelerator (generate.device = "cuda"): its terms are the
    /// device's memory, not the host's ([`Memory`]).
    pub on_device: bool,
    /// The accelerator's free memory when it could be asked (bytes).
    pub device_free: Option<u64>,
    /// The accelerator trains on the routed kernels (`policy::ops::Kernels::Routed`, CUDA's
    /// default) rather than the composed ones.
    pub routed: bool,
}

/// What sizes a reward model whose features learn (`[reward] update = "lora" | "full"`): its
/// architecture, its number of weights and the longest pair sequence it reads.
#[derive(Clone, Debug)]
pub struct RewardShape {
    pub cfg: features::model::Config,
    pub weights: u64,
    pub seq_len: usize,
    /// The reward model lives on an accelerator (`[data]`/`[features]` device = "cuda"): its
    /// terms are the device's memory, not the host's ([`Memory`]).
    pub on_device: bool,
    /// The accelerator's free memory when it could be asked (bytes).
    pub device_free: Option<u64>,
    /// The accelerator trains on the routed kernels (CUDA's default) rather than the composed.
    pub routed: bool,
}

/// How much more a reward model's gradient pass takes on a GPU than [`reward_terms`]' CPU
/// calibration: a GPU trains on candle's composed ops, not the CPU's fused kernels. Measured:
/// three LoRA cells of `mini-hh-lora-rm` (`pairs_per_pass = 4`) held 76 GB of an H100 (~25 GB
/// per cell) where the host estimate of their activations was 9.8 GiB each; on the CPU the
/// composed ops take 1.7x the fused kernels' per pair of 256-token sequences (4.1 against 2.4 GB,
/// `ONEPASS_KERNELS=composed` in the `rm_step` example) and the GPU's allocator the rest.
const DEVICE_REWARD_ACTIVATIONS: f64 = 2.5;

/// The same for a policy's gradient pass: the composed ops on the CPU take 2.9x this estimate
/// per sequence (1.79 GB against 0.61 GB per 256-token sequence, `ONEPASS_KERNELS=composed` in
/// the `train_step` example), times the 1.45 the H100 added over the composed ops' CPU figure
/// for the reward model. Derived, not yet observed on a GPU for a policy.
const DEVICE_POLICY_ACTIVATIONS: f64 = 4.2;

/// [`DEVICE_REWARD_ACTIVATIONS`] and [`DEVICE_POLICY_ACTIVATIONS`] on the routed kernels, which
/// keep no (b, heads, t, t) tensor in the graph. Measured on the CPU (`rm_step` 2 pairs × 256,
/// `train_step` 4 × 256, peak RSS): the reward model's routed step 2.64 GB against composed
/// 9.90 GB, the policy's 3.93 against 9.24 GB — activations ~0.2x and ~0.36x of the composed
/// path's beyond the ~0.9 GB the process holds anyway. The composed factors times those are
/// 0.5 and 1.5; these are twice that (not yet observed on a GPU).
const DEVICE_REWARD_ACTIVATIONS_ROUTED: f64 = 1.0;
const DEVICE_POLICY_ACTIVATIONS_ROUTED: f64 = 3.0;

/// A host-calibrated activation term as the accelerator will hold it, with a note for its line.
fn on_device(host: u64, device: bool, factor: f64) -> (u64, String) {
    if device {
        ((host as f64 * factor) as u64, format!("; {factor}x on the GPU's kernels"))
    } else {
        (host, String::new())
    }
}

/// The terms of a cell whose reward model learns its features (`policy::rm::model`): the
/// trainable parameters with their gradient and the optimiser's moments, the one-pass update's
/// flat vectors (parameters before and after, gradient, direction, CG's three, an HVP's saved
/// parameters and two gradients: 10 copies), and a gradient pass's activations over its
/// 2·`pairs_per_pass` sequences (no logits: only the last token's state reaches the head),
/// calibrated on the measured peak: 19.8 GB for 8 pairs × 256 tokens in one pass on
/// SmolLM2-135M (`just bench-rm-step`), where this counts 21 GB.
fn reward_terms(spec: &Spec, r: &RewardShape) -> Vec<Term> {
    let Some(rs) = spec.reward.as_ref().filter(|x| x.update != crate::spec::RewardUpdate::Head) else {
        return Vec::new();
    };
    let cfg = &r.cfg;
    let l = cfg.layers as u64;
    let params = match rs.update {
        crate::spec::RewardUpdate::Full => r.weights,
        _ => {
            let targets = rs.targets.resolve().unwrap_or_default();
            targets.iter().map(|t| t.dims(cfg)).map(|(i, o)| mul(&[rs.rank as u64, (i + o) as u64, l])).sum()
        }
    } + cfg.hidden as u64;
    let mut t = vec![
        Term {
            key: "reward.update".into(),
            what: format!(
                "{params} trainable parameters (\"{}\"; f32: value, gradient, Adam's two moments)",
                rs.update
            ),
            bytes: mul(&[params, 4, 4]),
        },
        Term {
            key: "reward.update".into(),
            what: "the one-pass update's flat vectors over the parameters (10 copies)".into(),
            bytes: mul(&[params, 4, 10]),
        },
    ];
    let seqs = 2 * rs.pairs_per_pass.min(spec.stream.batch_size) as u64;
    let len = r.seq_len as u64;
    let tokens = seqs.saturating_mul(len);
    let (h, i, heads) = (cfg.hidden as u64, cfg.intermediate as u64, cfg.heads as u64);
    // candle's graph keeps ~3 f32 copies of each layer's activations and ~5 of its attention
    // scores (calibrated above)
    let per_layer = mul(&[tokens, 10 * h + 3 * i, 4, 3]).saturating_add(mul(&[seqs, heads, len, len, 4, 5]));
    let factor = if r.routed { DEVICE_REWARD_ACTIVATIONS_ROUTED } else { DEVICE_REWARD_ACTIVATIONS };
    let (bytes, on) = on_device(mul(&[per_layer, l]), r.on_device, factor);
    t.push(Term {
        key: "reward.pairs_per_pass".into(),
        what: format!("a gradient pass's activations ({seqs} sequences × {len} tokens{on})"),
        bytes,
    });
    // exact HVPs (`policy::rm::rop`): the tape of every pass of a step, held through its K products
    // — per token and layer each layer's inputs and adapted products' adjoints, 8h + 4·(q width)
    // + 4·(kv width) + 3i values (10,288 for SmolLM2-135M: 1.26 GB for 4 × 256 tokens, whose
    // step peaked at 3.15 GB against 1.87 GB for a gradient; the tangent pass's values are the
    // activation term's, which the exact path does not hold at the same time)
    let curvature = spec.estimators.iter().any(|e| {
        matches!(e.get("kind").and_then(|k| k.as_str()), Some("omd-hvp-cg" | "omd-hvp-cg+adam" | "omd-reference"))
    });
    if curvature && rs.hvp_scheme() == policy::rm::update::HvpScheme::Exact {
        let batch = 2 * spec.stream.batch_size as u64;
        let (qw, kvw) = ((cfg.heads * cfg.head_dim) as u64, (cfg.kv_heads * cfg.head_dim) as u64);
        let per_token = 8 * h + 4 * qw + 4 * kvw + 3 * i;
        let (bytes, on) = on_device(mul(&[batch, len, per_token, 4, l]), r.on_device, 1.0);
        t.push(Term {
            key: "reward.hvp".into(),
            what: format!(
                "the exact products' tape (\"exact\"; every pass of a step: {batch} sequences × {len} tokens{on})"
            ),
            bytes,
        });
    }
    t
}

/// Which memory an estimate counts: the host's (the estimator, the data, a CPU policy or reward
/// model) or the accelerator's (a policy with generate.device = "cuda", a reward model whose
/// features learn on one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Memory {
    Host,
    Device,
}

/// The terms of a learning cell's policy (see the module's doc): f32 throughout (the policy
/// trains and generates in f32).
fn policy_terms(ps: &crate::spec::PolicySpec, c: &ConfigPlan, p: &PolicyShape) -> Vec<Term> {
    let Some(arm) = c.arm.as_ref().filter(|a| a.learning().is_some()) else { return Vec::new() };
    let mut t = policy_weight_terms(ps, arm, p);
    policy_pass_terms(ps, arm, p, &mut t);
    t
}

/// A product of sizes, saturating at u64::MAX.
fn mul(xs: &[u64]) -> u64 {
    xs.iter().fold(1u64, |a, &b| a.saturating_mul(b))
}

/// A learning policy's weight terms: full-parameter dpo's every weight (value, gradient, Adam's
/// two moments, the reference; the generator's copy; a checkpoint's), else the LoRA adapters
/// (A: r × in and B: out × r per target and layer, with gradient and moments; a ppo critic's
/// too), the generator's merge of the adapted weights and, on the CPU, the packed frozen weights.
fn policy_weight_terms(ps: &crate::spec::PolicySpec, arm: &crate::plan::ArmPlan, p: &PolicyShape) -> Vec<Term> {
    let cfg = &p.cfg;
    let (l, r) = (cfg.layers as u64, ps.rank as u64);
    let targets = ps.targets.resolve().unwrap_or_default();
    // A (r × in) and B (out × r) per target and layer
    let adapter: u64 = targets.iter().map(|t| t.dims(cfg)).map(|(i, o)| mul(&[r, (i + o) as u64, l, 4])).sum();
    let merged: u64 = targets.iter().map(|t| t.dims(cfg)).map(|(i, o)| mul(&[i as u64, o as u64, l, 4])).sum();
    let critics = u64::from(matches!(arm, crate::plan::ArmPlan::Ppo { .. }));
    let mut t = if arm.full_parameters() {
        let w = p.weights;
        vec![
            Term {
                key: "policy.dpo.parameters".into(),
                what: format!(
                    "every weight trains ({w} weights, f32: value, gradient, Adam's two moments, the moved reference)"
                ),
                bytes: mul(&[w, 4, 5]),
            },
            Term {
                key: "generate.policy".into(),
                what: "the generator's f32 copy of the weights".into(),
                bytes: mul(&[w, 4]),
            },
            // a checkpoint copies the weights and Adam's moments out as vectors, then encodes them
            Term {
                key: "policy.dpo.parameters".into(),
                what: "a checkpoint of every weight and Adam's two moments (copied, then encoded)".into(),
                bytes: mul(&[w, 4, 3, 2]),
            },
        ]
    } else {
        vec![
            Term {
                key: "policy.rank".into(),
                what: format!(
                    "the adapters (rank {r} on {} modules × {l} layers; value, gradient, Adam's two moments{})",
                    targets.len(),
                    if critics > 0 { "; and the critic's" } else { "" }
                ),
                bytes: mul(&[adapter, 4, 1 + critics]),
            },
            Term {
                key: "generate.policy".into(),
                what: "the generator's f32 merge of the adapted weights".into(),
                bytes: merged,
            },
        ]
    };
    if !arm.full_parameters() && !p.on_device {
        // `PolicyModel::use_packed_products`: f32 packs W once (4 bytes a weight), bf16 packs W
        // and Wᵀ (2 + 2): the same bytes; a ppo critic packs its backbone too (taken at the
        // policy's size)
        t.push(Term {
            key: "generate.policy".into(),
            what: format!(
                "the frozen weights packed for the CPU's products ({} weights, 4 bytes each{})",
                p.weights,
                if critics > 0 { "; and the critic's" } else { "" }
            ),
            bytes: mul(&[p.weights, 4, 1 + critics]),
        });
    }
    t
}

/// A learning policy's pass terms: a generation batch's KV cache (prompts × n × positions ×
/// layers × K and V) and a gradient pass's activations and logits (per token and layer
/// 10h + 3i values, the attention's heads × len² twice, and the logits three times over the
/// vocabulary), scaled by the accelerator's factor when the policy lives there.
fn policy_pass_terms(ps: &crate::spec::PolicySpec, arm: &crate::plan::ArmPlan, p: &PolicyShape, t: &mut Vec<Term>) {
    let cfg = &p.cfg;
    let l = cfg.layers as u64;
    let (len, kv) = (p.seq_len as u64, (cfg.kv_heads * cfg.head_dim) as u64);
    t.push(Term {
        key: "generate.batch_prompts".into(),
        what: format!(
            "the KV cache of a generation batch ({} prompts × n = {}, {len} positions)",
            p.batch_prompts, p.n
        ),
        bytes: mul(&[p.batch_prompts as u64, p.n as u64, len, l, 2, kv, 4]),
    });
    // sequences per gradient pass: dpo's mini-batch counts pairs
    let seqs = ps.minibatch as u64 * if matches!(arm, crate::plan::ArmPlan::Dpo { .. }) { 2 } else { 1 };
    let tokens = seqs.saturating_mul(len);
    let (h, i, heads, v) = (cfg.hidden as u64, cfg.intermediate as u64, cfg.heads as u64, cfg.vocab as u64);
    let per_layer = mul(&[tokens, 10 * h + 3 * i, 4]).saturating_add(mul(&[seqs, heads, len, len, 4, 2]));
    let host = mul(&[per_layer, l]).saturating_add(mul(&[tokens, v, 4, 3]));
    let factor = if p.routed { DEVICE_POLICY_ACTIVATIONS_ROUTED } else { DEVICE_POLICY_ACTIVATIONS };
    let (bytes, on) = on_device(host, p.on_device, factor);
    t.push(Term {
        key: "policy.minibatch".into(),
        what: format!("a gradient pass's activations and logits ({seqs} sequences × {len} tokens{on})"),
        bytes,
    });
}

/// d(d+1)/2 f64: a packed symmetric matrix.
fn packed(d: u64) -> u64 {
    (d.saturating_mul(d.saturating_add(1)) / 2).saturating_mul(8)
}

/// The key behind d: env.dim for the synthetic bandit, else where the data's d comes from.
fn dim_key(spec: &Spec) -> &'static str {
    match spec.env.kind {
        EnvKind::Synthetic => "env.dim",
        EnvKind::Features => "env.path",
        EnvKind::Dataset => "data.model",
        EnvKind::Generated => "features.model",
    }
}

/// The host terms of a cell of `c` besides a learning policy's.
fn cell_terms(spec: &Spec, c: &ConfigPlan) -> Vec<Term> {
    let d = spec.env.dim as u64;
    let dk = dim_key(spec);
    let mut t = Vec::new();
    estimator_terms(spec, c, &mut t);
    if needs_tracker(spec, c) {
        t.push(Term {
            key: dk.into(),
            what: format!("the 𝓗_t tracker (𝓗⁻¹ and 𝓗, packed f64) at d = {d}"),
            bytes: packed(d).saturating_mul(2),
        });
    }
    data_terms(spec, c, &mut t);
    t.sort_by_key(|x| std::cmp::Reverse(x.bytes));
    t
}

/// The estimator's own terms: omd-exact's packed 𝓗⁻¹ (d(d+1)/2 f64) and its projection's dense
/// matrices, mle's, the ensemble's and sgd-replay's histories (T × d f32), mle's Newton Hessian,
/// the ensemble's heads with their starts and Adam moments; else a few d-vectors.
fn estimator_terms(spec: &Spec, c: &ConfigPlan, t: &mut Vec<Term>) {
    let d = spec.env.dim as u64;
    let dk = dim_key(spec);
    let f32s = |n: u64| n.saturating_mul(d).saturating_mul(4);
    let history = spec.stream.samples;
    match c.cfg_for(spec) {
        EstimatorConfig::OmdExact(o) => {
            t.push(Term {
                key: dk.into(),
                what: format!("omd-exact's 𝓗⁻¹ (packed, f64) at d = {d}"),
                bytes: packed(d),
            });
            if o.radius.is_some() {
                t.push(Term {
                    key: dk.into(),
                    what: "omd-exact's projection (dense H̃ and its eigenvectors)".into(),
                    bytes: d.saturating_mul(d).saturating_mul(8 * 3),
                });
            }
        }
        EstimatorConfig::Mle(m) => {
            t.push(Term {
                key: "stream.samples".into(),
                what: format!("mle's history ({history} pairs × d = {d}, f32)"),
                bytes: f32s(history),
            });
            if matches!(m.solver, MleSolver::Newton) {
                t.push(Term {
                    key: dk.into(),
                    what: format!("mle's Newton Hessian (d × d f64) at d = {d}"),
                    bytes: d.saturating_mul(d).saturating_mul(16),
                });
            }
        }
        EstimatorConfig::Ensemble(e) => {
            t.push(Term {
                key: "stream.samples".into(),
                what: format!("the ensemble's replay buffer ({history} pairs × d = {d}, f32)"),
                bytes: f32s(history),
            });
            // K × d: the larger of the two factors is the one to blame
            let key = if e.heads as u64 > d { format!("estimator.{}.heads", c.table).into() } else { dk.into() };
            t.push(Term {
                key,
                what: format!("the ensemble's {} heads, their starts and Adam moments (f64) at d = {d}", e.heads),
                bytes: (e.heads as u64).saturating_mul(d).saturating_mul(32),
            });
        }
        _ if c.kind == Kind::SgdReplay => {
            t.push(Term {
                key: "stream.samples".into(),
                what: format!("sgd-replay's history ({history} pairs × d = {d}, f32)"),
                bytes: f32s(history),
            });
        }
        _ => t.push(Term { key: dk.into(), what: format!("{}'s vectors", c.kind), bytes: d.saturating_mul(8 * 16) }),
    }
}

/// The data's terms: the synthetic bandit's features and evaluation pairs, and in the active
/// setting the V tracker (stream rule with score_norm = "v") and a synthetic pool.
fn data_terms(spec: &Spec, c: &ConfigPlan, t: &mut Vec<Term>) {
    let d = spec.env.dim as u64;
    let dk = dim_key(spec);
    let f32s = |n: u64| n.saturating_mul(d).saturating_mul(4);
    if spec.env.kind == EnvKind::Synthetic {
        let e = &spec.env;
        let rows = (e.contexts as u64).saturating_mul(e.arms as u64).saturating_add(e.eval_pairs as u64);
        t.push(Term {
            key: "env.contexts".into(),
            what: format!(
                "the bandit's features ({} contexts × {} arms + {} evaluation pairs, d = {d})",
                e.contexts, e.arms, e.eval_pairs
            ),
            bytes: f32s(rows),
        });
    }
    if spec.setting == Setting::Active {
        if let Some(rule) = c.rule {
            if matches!(rule, ActiveRule::Stream) && spec.active.score_norm == ScoreNorm::V {
                t.push(Term {
                    key: dk.into(),
                    what: format!("the V tracker (packed f64) at d = {d}"),
                    bytes: packed(d),
                });
            }
            if spec.env.kind == EnvKind::Synthetic && !matches!(rule, ActiveRule::Fresh(_)) {
                t.push(Term {
                    key: "active.pool".into(),
                    what: format!("the active pool ({} pairs × d = {d}, f32)", spec.active.pool),
                    bytes: f32s(spec.active.pool as u64),
                });
            }
        }
    }
}

/// The estimate of `on`'s memory for a plan whose `spec` has its final env.dim, of which this
/// process runs `cells` cells (a slice's, or all: their rows stay until the tables), `threads`
/// workers; `policy` the learning policy's shape when the run has one (its world is loaded):
/// its terms count on the host, or on the device when it lives there.
/// `reward`: a reward model whose features learn, when the run has one: counted on the host, or
/// on the device when it lives there.
pub fn estimate(
    spec: &Spec,
    plan: &Plan,
    cells: usize,
    threads: usize,
    policy: Option<&PolicyShape>,
    reward: Option<&RewardShape>,
    on: Memory,
) -> Estimate {
    let mut cell = Vec::new();
    let mut per_cell = 0;
    for c in &plan.configs {
        let mut t = if on == Memory::Host { cell_terms(spec, c) } else { Vec::new() };
        if let Some(r) = reward.filter(|r| r.on_device == (on == Memory::Device)) {
            t.extend(reward_terms(spec, r));
            t.sort_by_key(|x| std::cmp::Reverse(x.bytes));
        }
        if let (Some(p), Some(ps)) = (policy.filter(|p| p.on_device == (on == Memory::Device)), plan.policy.as_ref()) {
            t.extend(policy_terms(ps, c, p));
            t.sort_by_key(|x| std::cmp::Reverse(x.bytes));
        }
        let sum: u64 = t.iter().map(|x| x.bytes).fold(0, u64::saturating_add);
        if sum > per_cell {
            (per_cell, cell) = (sum, t);
        }
    }
    let parallel = threads.max(1).min(cells.max(1));
    // the rows live in the host's memory whatever the device
    let rows = if on == Memory::Host { row_terms(spec, cells as u64) } else { Vec::new() };
    let kept = rows.iter().map(|x| x.bytes).fold(0, u64::saturating_add);
    Estimate { cell, per_cell, parallel, rows, total: per_cell.saturating_mul(parallel as u64).saturating_add(kept) }
}

/// `MemAvailable` of /proc/meminfo (Linux), in bytes.
pub fn available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// "1.5 GiB".
pub fn show(bytes: u64) -> String {
    let g = bytes as f64 / (1u64 << 30) as f64;
    if g >= 1e4 {
        format!("{g:.2e} GiB")
    } else if g >= 0.1 {
        format!("{g:.1} GiB")
    } else if bytes >= 1 << 17 {
        format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
    } else {
        format!("{:.1} KiB", bytes as f64 / 1024.0)
    }
}

/// A size as `--max-memory` takes it: bytes, or a number with K, M, G, T (powers of 1024; "iB",
/// "B" and case are ignored), e.g. `8G`, `512MiB`, `1.5g`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim().to_ascii_lowercase();
    let t = t.trim_end_matches("ib").trim_end_matches('b');
    let (num, mult) = match t.chars().last() {
        Some('k') => (&t[..t.len() - 1], 1u64 << 10),
        Some('m') => (&t[..t.len() - 1], 1 << 20),
        Some('g') => (&t[..t.len() - 1], 1 << 30),
        Some('t') => (&t[..t.len() - 1], 1 << 40),
        _ => (t, 1),
    };
    let v: f64 =
        num.trim().parse().map_err(|_| format!("{s}: expected a size such as 8G, 512M or a number of bytes"))?;
    if !(v.is_finite() && v > 0.0) {
        return Err(format!("{s}: expected a size > 0"));
    }
    Ok((v * mult as f64) as u64)
}

/// Refuses an estimate above `budget`: (the key of the largest term, a one-line message).
pub fn check(e: &Estimate, budget: u64, budget_from: &str) -> Result<(), (String, String)> {
    if e.total <= budget {
        return Ok(());
    }
    let line = |t: &Term| format!("{}: {}", t.what, show(t.bytes));
    let kept = e.rows.iter().map(|x| x.bytes).fold(0, u64::saturating_add);
    let cells = format!(
        "{} per cell — largest: {} — × {} {} at a time",
        show(e.per_cell),
        e.cell.first().map_or(String::new(), line),
        e.parallel,
        if e.parallel == 1 { "cell" } else { "cells" },
    );
    // blame the larger share: the cells' state or the rows they keep
    let per_cells = e.per_cell.saturating_mul(e.parallel as u64);
    let (key, what) = match e.rows.first() {
        Some(r) if kept > per_cells => {
            (r.key.as_ref(), format!("{} of result rows — largest: {} — and {cells}", show(kept), line(r)))
        }
        // named where they are 1 % of the total or more, so that the figures add up
        _ if kept.saturating_mul(100) >= e.total => (
            e.cell.first().map_or("env.dim", |t| t.key.as_ref()),
            format!("{cells}, and {} of result rows", show(kept)),
        ),
        _ => (e.cell.first().map_or("env.dim", |t| t.key.as_ref()), cells),
    };
    Err((
        key.to_string(),
        format!("the run needs about {} ({what}), more than the {} {budget_from}", show(e.total), show(budget)),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rows every cell keeps until the tables are written count over all the cells, not
    /// the ones at a time: steps rows only with `record_steps` (the control: the same spec
    /// without it), metrics rows per evaluation point; a large enough stream is refused naming
    /// the key behind the larger share.
    #[test]
    fn result_rows_count_for_every_cell_of_the_run() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("spec.toml");
        let at = |samples: u64, eval_every: u64, steps: bool| -> Estimate {
            std::fs::write(
                &path,
                format!(
                    "setting = \"passive\"\nseeds = 3\n[env]\ndim = 4\n[stream]\nsamples = {samples}\n\
                     eval_every = {eval_every}\nbatch_size = 2\nrecord_steps = {steps}\n[[estimator]]\nkind = \"sgd\"\n"
                ),
            )
            .unwrap();
            let plan = crate::load_plan(&path, &[]).unwrap();
            estimate(&plan.spec, &plan, plan.cells.len(), 1, None, None, Memory::Host)
        };
        let (plain, steps) = (at(1000, 100, false), at(1000, 100, true));
        assert_eq!(plain.parallel, 1);
        // 11 evaluation points × 3 cells; 500 updates × 3 cells
        assert_eq!(plain.total - plain.per_cell, 33 * METRIC_ROW_BYTES);
        assert_eq!(steps.total - plain.total, 1500 * STEP_ROW_BYTES);
        assert_eq!(steps.per_cell, plain.per_cell, "rows are not a cell's state");
        let (key, msg) = check(&at(2_000_000_000, 1_000_000_000, true), 8 << 30, "allowed").unwrap_err();
        assert_eq!(key, "stream.record_steps", "{msg}");
        assert!(msg.contains("steps rows (1000000000 updates × 3 cells)"), "{msg}");
        let (key, msg) = check(&at(2_000_000_000, 1, false), 8 << 30, "allowed").unwrap_err();
        assert_eq!(key, "stream.eval_every", "{msg}");
        assert!(check(&at(1_000_000, 1000, true), 8 << 30, "allowed").is_ok());
        // an evaluation at most once per update: eval_every = 1 with batches of 2 is 501 points
        let fine = at(1000, 1, false);
        assert_eq!(fine.total - fine.per_cell, 3 * 501 * METRIC_ROW_BYTES);
        // a slice keeps its own cells' rows only
        let plan = crate::load_plan(&path, &[]).unwrap();
        let one = estimate(&plan.spec, &plan, 1, 1, None, None, Memory::Host);
        assert_eq!(one.total - one.per_cell, 501 * METRIC_ROW_BYTES);
        // when the cells are blamed, rows of 1 % of the total or more are named too, so that
        // the figures add up; smaller ones are not (the control)
        let term = |key: &'static str, bytes: u64| Term { key: key.into(), what: key.into(), bytes };
        let mixed = |rows: u64| Estimate {
            cell: vec![term("env.dim", 10 << 20)],
            per_cell: 10 << 20,
            parallel: 2,
            rows: vec![term("stream.eval_every", rows)],
            total: (20 << 20) + rows,
        };
        let (key, msg) = check(&mixed(8 << 20), 1 << 20, "allowed").unwrap_err();
        assert_eq!(key, "env.dim");
        assert!(msg.contains("× 2 cells at a time, and 8.0 MiB of result rows"), "{msg}");
        let (_, msg) = check(&mixed(1 << 10), 1 << 20, "allowed").unwrap_err();
        assert!(!msg.contains("result rows"), "{msg}");
    }

    /// A small decoder's shape for the memory terms.
    /// A policy of [`tiny_cfg`]'s shape with 1 Mi weights, on the CPU or a GPU.
    fn tiny_policy(on_device: bool) -> PolicyShape {
        PolicyShape {
            cfg: tiny_cfg(),
            seq_len: 64,
            n: 2,
            batch_prompts: 2,
            weights: 1 << 20,
            on_device,
            device_free: None,
            routed: false,
        }
    }

    fn tiny_cfg() -> features::model::Config {
        features::model::Config {
            family: features::model::Family::Llama,
            hidden: 64,
            intermediate: 128,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            eps: 1e-5,
            rope_theta: 1e4,
            vocab: 100,
            qkv_bias: false,
            o_bias: false,
            rope_interleaved: false,
            rope_factors: None,
        }
    }

    /// A reward model whose features learn (issue 30): a full update counts every weight 14
    /// times (value, gradient, two moments, the update's ten flat copies) and LoRA only its
    /// adapters; the activations scale with `pairs_per_pass`, not the batch; a head-only run
    /// counts none of it (negative control).
    #[test]
    fn a_learning_reward_model_counts_its_parameters_and_one_pass() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("spec.toml");
        let spec = |update: &str, ppp: usize| {
            format!(
                "setting = \"passive\"\n[env]\nkind = \"dataset\"\n[data]\npath = \"p.jsonl\"\nmodel = \"m.gguf\"\n\
                 [stream]\nbatch_size = 8\n[reward]\nupdate = \"{update}\"\npairs_per_pass = {ppp}\n[[estimator]]\nkind = \"sgd\"\n"
            )
        };
        let cfg = tiny_cfg();
        let shape =
            RewardShape { cfg, weights: 1 << 20, seq_len: 64, on_device: false, device_free: None, routed: false };
        let on = |update: &str, ppp: usize, shape: &RewardShape, mem: Memory| -> Estimate {
            std::fs::write(&path, spec(update, ppp)).unwrap();
            let plan = crate::load_plan(&path, &[]).unwrap();
            estimate(&plan.spec, &plan, plan.cells.len(), 1, None, Some(shape), mem)
        };
        let at = |update: &str, ppp: usize| on(update, ppp, &shape, Memory::Host);
        let term = |e: &Estimate, key: &str| e.cell.iter().filter(|t| t.key == key).map(|t| t.bytes).sum::<u64>();
        let full = at("full", 2);
        assert_eq!(term(&full, "reward.update"), ((1u64 << 20) + 64) * 4 * 14, "{:?}", full.cell);
        let lora = at("lora", 2);
        assert!(term(&lora, "reward.update") < term(&full, "reward.update") / 10, "{:?}", lora.cell);
        let (a1, a4) = (term(&at("lora", 1), "reward.pairs_per_pass"), term(&at("lora", 4), "reward.pairs_per_pass"));
        assert!(a4 > 3 * a1 && a1 > 0, "activations scale with the pairs per pass: {a1} {a4}");
        assert_eq!(
            term(&at("lora", 8), "reward.pairs_per_pass"),
            term(&at("lora", 40), "reward.pairs_per_pass"),
            "capped by the batch"
        );
        let head = at("head", 2);
        assert!(head.cell.iter().all(|t| !t.key.starts_with("reward.")), "{:?}", head.cell);
        // exact products (a LoRA reward model's default) keep a tape of the whole batch for the
        // CG rules; sgd takes none, nor do central differences (negative controls)
        let with = |update: &str, extra: &str, kind: &str| -> Estimate {
            let text = spec(update, 2)
                .replace("[[estimator]]\nkind = \"sgd\"\n", &format!("{extra}[[estimator]]\nkind = \"{kind}\"\n"));
            std::fs::write(&path, text).unwrap();
            let plan = crate::load_plan(&path, &[]).unwrap();
            estimate(&plan.spec, &plan, plan.cells.len(), 1, None, Some(&shape), Memory::Host)
        };
        let c = tiny_cfg();
        let per_token =
            (8 * c.hidden + 4 * c.heads * c.head_dim + 4 * c.kv_heads * c.head_dim + 3 * c.intermediate) as u64;
        assert_eq!(term(&with("lora", "", "omd-hvp-cg"), "reward.hvp"), 16 * 64 * per_token * 4 * c.layers as u64);
        assert_eq!(term(&with("lora", "", "sgd"), "reward.hvp"), 0);
        assert_eq!(term(&with("lora", "hvp = \"central\"\n", "omd-hvp-cg"), "reward.hvp"), 0);
        assert_eq!(term(&with("full", "", "omd-hvp-cg"), "reward.hvp"), 0, "a full update takes central differences");
        // on a GPU the same terms count in the device's memory and none in the host's (the
        // H100 run of mini-hh-lora-rm ran out of GPU memory while its estimate sat in the host's)
        let gpu = RewardShape { on_device: true, ..shape.clone() };
        let (dev, host) = (on("lora", 2, &gpu, Memory::Device), on("lora", 2, &gpu, Memory::Host));
        assert_eq!(term(&dev, "reward.update"), term(&lora, "reward.update"), "{:?}", dev.cell);
        // the GPU's composed ops hold more activations than the CPU's fused kernels
        let (a_dev, a_host) = (term(&dev, "reward.pairs_per_pass"), term(&lora, "reward.pairs_per_pass"));
        assert_eq!(a_dev, (a_host as f64 * DEVICE_REWARD_ACTIVATIONS) as u64, "{:?}", dev.cell);
        assert!(host.cell.iter().all(|t| !t.key.starts_with("reward.")), "{:?}", host.cell);
        assert_eq!(on("lora", 2, &shape, Memory::Device).per_cell, 0, "a CPU reward model takes no device memory");
    }

    /// The case that ran an H100 out of memory: three LoRA cells of `mini-hh-lora-rm` at
    /// `pairs_per_pass = 4` held 76 GB there. The device estimate must cover that (the host's
    /// calibration alone counted 30 GB: negative control), so the check refuses three such cells
    /// on a GPU with less free memory.
    #[test]
    fn the_gpu_estimate_covers_what_an_h100_held_for_three_lora_reward_cells() {
        // (that run took central differences, the default then: no exact products' tape)
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("spec.toml");
        std::fs::write(
            &path,
            "setting = \"passive\"\nseeds = 3\n[env]\nkind = \"dataset\"\n[data]\npath = \"p.jsonl\"\nmodel = \"m.gguf\"\n\
             [stream]\nbatch_size = 8\n[reward]\nupdate = \"lora\"\npairs_per_pass = 4\nhvp = \"central\"\n[[estimator]]\nkind = \"omd-hvp-cg\"\n",
        )
        .unwrap();
        let plan = crate::load_plan(&path, &[]).unwrap();
        // SmolLM2-135M's architecture
        let cfg = features::model::Config {
            hidden: 576,
            intermediate: 1536,
            layers: 30,
            heads: 9,
            kv_heads: 3,
            head_dim: 64,
            vocab: 49152,
            ..tiny_cfg()
        };
        let shape = |on_device| RewardShape {
            cfg: cfg.clone(),
            weights: 134_515_008,
            seq_len: 256,
            on_device,
            device_free: None,
            routed: false,
        };
        let gpu = estimate(&plan.spec, &plan, plan.cells.len(), 3, None, Some(&shape(true)), Memory::Device);
        let cpu = estimate(&plan.spec, &plan, plan.cells.len(), 3, None, Some(&shape(false)), Memory::Host);
        assert_eq!(gpu.parallel, 3);
        assert!(gpu.total >= 76_000_000_000, "{} bytes for three cells: {:?}", gpu.total, gpu.cell);
        assert!(cpu.total < 40_000_000_000, "the host calibration: {} bytes", cpu.total);
        // the routed kernels (CUDA's default since) count the host calibration's activations
        let routed = RewardShape { routed: true, ..shape(true) };
        let r = estimate(&plan.spec, &plan, plan.cells.len(), 3, None, Some(&routed), Memory::Device);
        let acts =
            |e: &Estimate| e.cell.iter().filter(|t| t.key == "reward.pairs_per_pass").map(|t| t.bytes).sum::<u64>();
        assert_eq!(acts(&r), (acts(&cpu) as f64 * DEVICE_REWARD_ACTIVATIONS_ROUTED) as u64);
        assert!(r.total < gpu.total && r.total > 0, "routed {} vs composed {}", r.total, gpu.total);
    }

    #[test]
    fn sizes_parse_as_people_write_them() {
        assert_eq!(parse_size("8G"), Ok(8 << 30));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("1.5g"), Ok(3 << 29));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("lots").is_err() && parse_size("-1G").is_err() && parse_size("0").is_err());
        // a budget of a few KiB is shown as such, not as "0.0 MiB"
        assert_eq!((show(1024), show(3 << 20), show(3 << 30)), ("1.0 KiB".into(), "3.0 MiB".into(), "3.0 GiB".into()));
    }

    /// A learning policy's terms count where the policy lives: on the host for a CPU policy, on
    /// the device (and not on the host) for a GPU one — the host estimate of a GPU run is the
    /// estimator's alone, and the device's is exactly what the CPU run added to the host's.
    #[test]
    fn a_policy_on_the_gpu_counts_in_device_memory_not_the_hosts() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("spec.toml");
        let text = "setting = \"deploy\"\n[env]\nkind = \"generated\"\n[generate]\nprompts = \"p.jsonl\"\n\
                    rows = 4\npolicy = \"m.gguf\"\nn = 2\nmax_new_tokens = 4\n[features]\nmodel = \"m.gguf\"\n\
                    [oracle]\nkind = \"linear\"\n[deploy]\nchunks = 2\nstrategies = [\"random-pair\"]\n\
                    policy = [\"best-of-n\", \"dpo\"]\n[policy.dpo]\nparameters = \"full\"\n[policy]\n\
                    save_adapter = \"none\"\n[[estimator]]\nkind = \"sgd\"\n";
        std::fs::write(&path, text).unwrap();
        let plan = crate::load_plan(&path, &[]).unwrap();
        let (cpu, gpu) = (tiny_policy(false), tiny_policy(true));
        let at = |p: &PolicyShape, on| estimate(&plan.spec, &plan, plan.cells.len(), 1, Some(p), None, on).per_cell;
        let none = estimate(&plan.spec, &plan, plan.cells.len(), 1, None, None, Memory::Host).per_cell;
        assert_eq!(at(&gpu, Memory::Host), none, "a GPU policy adds nothing to host memory");
        assert_eq!(at(&cpu, Memory::Device), 0, "a CPU policy takes no device memory");
        assert!(at(&gpu, Memory::Device) >= 20 << 20, "full-parameter: 5 f32 copies of 1 Mi weights at least");
        // the same terms counted elsewhere, the activations scaled for the GPU's composed ops
        let acts = |p: &PolicyShape, on| {
            let e = estimate(&plan.spec, &plan, plan.cells.len(), 1, Some(p), None, on);
            e.cell.iter().filter(|t| t.key == "policy.minibatch").map(|t| t.bytes).sum::<u64>()
        };
        let (a_cpu, a_gpu) = (acts(&cpu, Memory::Host), acts(&gpu, Memory::Device));
        assert!(a_cpu > 0);
        assert_eq!(a_gpu, (a_cpu as f64 * DEVICE_POLICY_ACTIVATIONS) as u64);
        let routed = PolicyShape { routed: true, ..gpu.clone() };
        assert_eq!(acts(&routed, Memory::Device), (a_cpu as f64 * DEVICE_POLICY_ACTIVATIONS_ROUTED) as u64);
        assert_eq!(
            at(&cpu, Memory::Host) - none - a_cpu,
            at(&gpu, Memory::Device) - a_gpu,
            "the other terms are the same"
        );
    }

    /// A CPU policy that trains adapters holds its frozen weights packed once more for the
    /// CPU's products (4 bytes a weight, f32 or bf16), a ppo critic likewise; a GPU policy and
    /// a full-parameter one (nothing frozen to pack) do not.
    #[test]
    fn a_cpu_lora_policy_counts_its_packed_weights() {
        let dir = tempfile::tempdir().unwrap();
        let terms = |policy: &str, on_device: bool, on: Memory| -> Vec<Term> {
            let path = dir.path().join(format!("{policy}.toml"));
            let full = if policy == "dpo-full" { "[policy.dpo]\nparameters = \"full\"\n" } else { "" };
            let arm = policy.trim_end_matches("-full");
            let text = format!(
                "setting = \"deploy\"\n[env]\nkind = \"generated\"\n[generate]\nprompts = \"p.jsonl\"\n\
                 rows = 4\npolicy = \"m.gguf\"\nn = 2\nmax_new_tokens = 4\n[features]\nmodel = \"m.gguf\"\n\
                 [oracle]\nkind = \"linear\"\n[deploy]\nchunks = 2\nstrategies = [\"random-pair\"]\n\
                 policy = [\"{arm}\"]\n{full}[policy]\nsave_adapter = \"none\"\n[[estimator]]\nkind = \"sgd\"\n"
            );
            std::fs::write(&path, text).unwrap();
            let plan = crate::load_plan(&path, &[]).unwrap();
            estimate(&plan.spec, &plan, plan.cells.len(), 1, Some(&tiny_policy(on_device)), None, on).cell
        };
        let packed = |ts: &[Term]| -> u64 {
            ts.iter().filter(|t| t.what.starts_with("the frozen weights packed")).map(|t| t.bytes).sum()
        };
        assert_eq!(packed(&terms("rloo", false, Memory::Host)), 4 << 20, "rloo on the CPU: 4 bytes a weight");
        assert_eq!(packed(&terms("ppo", false, Memory::Host)), 8 << 20, "ppo: the critic's packing too");
        assert_eq!(packed(&terms("rloo", true, Memory::Host)), 0, "a GPU policy: nothing on the host");
        assert_eq!(packed(&terms("rloo", true, Memory::Device)), 0, "nor on the device (no packing there)");
        assert_eq!(packed(&terms("dpo-full", false, Memory::Host)), 0, "full-parameter: nothing frozen");
    }

    #[test]
    fn packed_matrices_are_half_a_square() {
        assert_eq!(packed(4096), 4096 * 4097 / 2 * 8);
        // no overflow at absurd sizes: the estimate saturates
        assert_eq!(packed(u64::MAX), u64::MAX);
    }
}
