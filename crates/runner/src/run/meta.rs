//! meta.json, written last: what ran, on what data and code, and the data's scale against
//! each λ (with its warning).

use super::options::RunOptions;
use crate::plan::{ConfigPlan, Plan};
use crate::spec;
use crate::world::{self, World};
use serde::Serialize;

/// What meta.json says of the run's start besides the plan and the world.
pub(super) struct Started {
    pub(super) at: String,
    pub(super) forced: Option<String>,
    pub(super) data_scale: serde_json::Value,
    pub(super) threads: usize,
}

impl<'a> Meta<'a> {
    /// meta.json of a finished run with `failed` failed cells.
    pub(super) fn of(opts: &'a RunOptions, plan: &Plan, world: &'a World, st: Started, failed: usize) -> Meta<'a> {
        Meta {
            onepass_version: env!("CARGO_PKG_VERSION"),
            git_revision: env!("ONEPASS_GIT_REV"),
            git_dirty: match env!("ONEPASS_GIT_DIRTY") {
                "true" => Some(true),
                "false" => Some(false),
                _ => None,
            },
            spec_file: opts.spec.display().to_string(),
            cwd: std::env::current_dir().map(|d| d.display().to_string()).unwrap_or_default(),
            overrides: &opts.overrides,
            resumed: opts.resume.is_some(),
            forced: st.forced,
            merged_from: opts.merge.iter().map(|p| p.display().to_string()).collect(),
            master_seed: world.spec.master_seed,
            seeds: world.spec.seeds,
            setting: world.spec.setting.as_str(),
            data: world.data.as_ref().map(|d| DataMeta {
                path: d.train_path.display().to_string(),
                blake3: d.train.digest.clone(),
                train_rows: d.train.len(),
                eval_path: d.eval_path.as_ref().map(|p| p.display().to_string()),
                eval_blake3: d.eval_path.as_ref().map(|_| d.eval.digest.clone()),
                eval_rows: d.eval.len(),
                dim: d.d,
                dataset: d.report.clone(),
                backbone_cost: backbone_cost(plan, world),
            }),
            data_scale: st.data_scale,
            generated: world.generated.as_ref().map(|g| &g.report),
            cells: plan.cells.len(),
            failed_cells: failed,
            threads: st.threads,
            candle_threads: candle_core::utils::get_num_threads(),
            host: std::fs::read_to_string("/etc/hostname").map(|s| s.trim().to_string()).unwrap_or_default(),
            cpu: CpuMeta {
                model: kernels::cpu::model(),
                logical_cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
                features: kernels::cpu::features(),
                capped_at_avx2: kernels::cpu::capped_at_avx2(),
            },
            os: std::env::consts::OS,
            arch: std::env::consts::ARCH,
            crates: Meta::crates(),
            started: st.at,
            finished: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        }
    }
}

/// meta.json: what ran, on what, with which code and crates, and when.
#[derive(Serialize)]
pub(super) struct Meta<'a> {
    onepass_version: &'static str,
    git_revision: &'static str,
    /// Whether the build had uncommitted changes to tracked files; null where git was not there
    /// at build time. (Runs written by builds before 2026-11-29 hold the strings "true", "false"
    /// or "unknown".)
    git_dirty: Option<bool>,
    spec_file: String,
    /// The directory the run was started in: the spec's relative paths (and `spec_file`) are
    /// relative to it.
    cwd: String,
    overrides: &'a [String],
    resumed: bool,
    /// `--resume --force` over a difference of spec, code or data: which (cells whose config
    /// changed were started again).
    forced: Option<String>,
    /// `onepass merge`: the slice directories the run's cells came from.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    merged_from: Vec<String>,
    master_seed: u64,
    seeds: u32,
    setting: &'static str,
    data: Option<DataMeta>,
    /// ‖z‖² of the first pairs and each config's λ against it (λ = "auto", the diagnostic).
    data_scale: serde_json::Value,
    generated: Option<&'a world::generated::BankReport>,
    cells: usize,
    failed_cells: usize,
    threads: usize,
    /// The threads candle splits a matmul into (`RAYON_NUM_THREADS`; [`cap_library_threads`]).
    candle_threads: usize,
    host: String,
    /// The CPU the numbers were computed on: a learning policy's bits can differ between CPU
    /// models (the kernels' summation order follows the vector features they find).
    cpu: CpuMeta,
    os: &'static str,
    arch: &'static str,
    /// The project's crates and the third-party crates that produce the numbers (from Cargo.lock).
    crates: std::collections::BTreeMap<&'static str, &'static str>,
    started: String,
    finished: String,
}

/// meta.json's `cpu` block.
#[derive(Serialize)]
struct CpuMeta {
    /// `/proc/cpuinfo`'s model name (the architecture where it cannot be read).
    model: String,
    /// Logical CPUs this process may run on.
    logical_cpus: usize,
    /// The vector features onepass's kernels choose between (AMX where the process may use it).
    features: Vec<&'static str>,
    /// `ONEPASS_CPU=avx2` capped onepass's kernels at AVX2 + FMA.
    capped_at_avx2: bool,
}

/// ‖z‖²/λ above this: a full 𝓗⁻¹z step early in the stream moves the margin by ~100 units, and
/// omd-exact can overshoot into σ′ ≈ 0 where 𝓗 stops growing (issue 18's divergence).
pub const LARGE_Z_OVER_LAMBDA: f64 = 100.0;

/// meta.json's `data_scale` block, and a warning when some λ is small for the data:
/// median ‖z‖² over λ for the estimator's λ and the tracker's of every config.
pub fn scale_meta(world: &World) -> (serde_json::Value, Option<String>) {
    let s = world.spec.data_scale.unwrap_or_default();
    let mut lambdas = Vec::new();
    let mut worst: Option<(f64, String)> = None;
    for cell in &world.configs {
        let (c, choice) = (&cell.config, cell.curvature.choice);
        // a tracker's λ matters where the cell scores uncertainty with it (UCB, the pool and
        // stream rules, pessimism on a known truth); elsewhere it only feeds ‖θ − θ*‖_𝓗
        let scores = match (c.strategy, c.rule) {
            (Some(st), _) => st.needs_bonus(),
            (_, Some(crate::spec::ActiveRule::PoolArgmax)) => true,
            (_, Some(crate::spec::ActiveRule::Stream)) => world.spec.active.score_norm == crate::spec::ScoreNorm::H,
            (_, Some(crate::spec::ActiveRule::Fresh(st))) => st.needs_bonus(),
            _ => world.spec.setting == crate::spec::Setting::Passive,
        };
        let mut one = |what: &str, l: f64, auto: bool| {
            let ratio = s.median_z_sq / l;
            let counts = what == "estimator" || scores;
            if counts && worst.as_ref().is_none_or(|w| ratio > w.0) {
                worst = Some((ratio, format!("{} ({what} λ = {l})", c.label)));
            }
            serde_json::json!({"config": c.label, "lambda_of": what, "lambda": l, "auto": auto, "median_z_sq_over_lambda": ratio})
        };
        if let Some(l) = cell.lambda() {
            lambdas.push(one("estimator", l, c.lambda_auto));
        }
        if !choice.estimator && cell.curvature.tracker {
            let auto = world.spec.curvature.lambda == Some(crate::spec::OrAuto::Auto);
            lambdas.push(one("tracker", choice.tracker_lambda, auto));
        }
    }
    let warning = worst.filter(|w| w.0 > LARGE_Z_OVER_LAMBDA).map(|(r, who)| {
        format!(
            "median ‖z‖² / λ = {r:.0} for {who}: λ is small for this data (median ‖z‖² = {:.4}); early steps can overshoot — consider lambda = \"auto\" or a larger λ",
            s.median_z_sq
        )
    });
    let v = serde_json::json!({
        "pairs": s.pairs, "median_z_sq": s.median_z_sq, "p90_z_sq": s.p90_z_sq, "max_z_sq": s.max_z_sq,
        "auto_lambda": s.auto_lambda(), "lambdas": lambdas, "warning": warning,
    });
    (v, warning)
}

/// meta.json's `data` block (kind = "features" or "dataset").
#[derive(Serialize)]
struct DataMeta {
    path: String,
    blake3: String,
    train_rows: usize,
    eval_path: Option<String>,
    eval_blake3: Option<String>,
    eval_rows: usize,
    dim: usize,
    dataset: Option<serde_json::Value>,
    backbone_cost: Option<serde_json::Value>,
}

impl Meta<'_> {
    fn crates() -> std::collections::BTreeMap<&'static str, &'static str> {
        let mut m: std::collections::BTreeMap<&'static str, &'static str> = [
            ("runner", env!("CARGO_PKG_VERSION")),
            ("estimators", estimators::VERSION),
            ("selection", selection::VERSION),
            ("features", features::VERSION),
        ]
        .into();
        // "name=version,…" written by build.rs from Cargo.lock
        for kv in env!("ONEPASS_DEP_VERSIONS").split(',').filter(|s| !s.is_empty()) {
            if let Some((k, v)) = kv.split_once('=') {
                m.insert(k, v);
            }
        }
        m
    }
}

/// kind = "dataset": how many backbone forward passes (sequences and tokens) the run's methods
/// would need under the authors' schedule — the frozen LLM re-run on every training batch and on
/// the held-out set at every evaluation, for every cell (reference-code.md §1.6) — against
/// onepass's cache, where each distinct sequence is computed once for every cell, seed and later
/// run. A cost model to discuss timing claims with, not a measurement.
fn backbone_cost(plan: &Plan, world: &World) -> Option<serde_json::Value> {
    let d = world.data.as_ref()?;
    let r = d.report.as_ref()?;
    let get = |k: &str| r.get(k).and_then(|v| v.as_u64()).unwrap_or(0) as f64;
    let (train_pairs, eval_pairs) = (get("train_pairs").max(1.0), get("eval_pairs"));
    let (train_tok, eval_tok) = (get("train_tokens"), get("eval_tokens"));
    let s = &world.spec.stream;
    let samples = s.samples as f64;
    let evals = (s.samples / s.eval_every + u64::from(!s.samples.is_multiple_of(s.eval_every))) as f64;
    // pairs pushed through the backbone per labelled sample: 1, or the stream rule's candidates/keep
    let per_sample = |c: &ConfigPlan| match c.rule {
        Some(spec::ActiveRule::Stream) => plan.spec.active.candidates as f64 / plan.spec.active.keep.max(1) as f64,
        _ => 1.0,
    };
    let cost = |c: &ConfigPlan| {
        let seq = 2.0 * samples * per_sample(c) + 2.0 * eval_pairs * evals;
        let tok = samples * per_sample(c) * train_tok / train_pairs + eval_tok * evals;
        (seq, tok)
    };
    let (cell_seq, cell_tok) = cost(&plan.configs[0]);
    let (all_seq, all_tok) =
        plan.cells.iter().map(|c| cost(&plan.configs[c.config])).fold((0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1));
    Some(serde_json::json!({
        "authors_schedule": {
            "per_cell_sequences": cell_seq,
            "per_cell_tokens": cell_tok,
            "all_cells_sequences": all_seq,
            "all_cells_tokens": all_tok,
        },
        "onepass_cache": {
            "sequences_once": 2.0 * (train_pairs + eval_pairs),
            "tokens_once": train_tok + eval_tok,
            "tokens_computed_this_run": get("tokens_computed"),
            "extraction_s_this_run": r.get("extraction_s"),
        },
    }))
}
