//! The run directory: spec.resolved.toml, meta.json, plan.json, cells/metrics/steps/timings
//! parquet tables, θ of every cell as .npy, and schema.json. Every file is written to a temporary
//! name and renamed into place, so a reader never sees half a file.

use crate::io::{npy_f64, write_atomic, write_atomic_at};
use crate::plan::{ConfigPlan, Plan};
use crate::rows::{
    Bucket, CellResult, CellStatus, CellTotals, Col, Key, MetricRow, PolicyRow, PolicyTiming, RoundRow, SampleRow,
    StepRow, UpdateRow, WinRow, BUCKETS, CELL_STATUS, CELL_TOTALS, KEY, LABEL, METRICS, METRICS_CHUNKED, POLICY,
    POLICY_DIGEST, POLICY_SAMPLES, POLICY_TIMINGS, POLICY_UPDATES, ROUNDS, STEPS, WINRATES,
};
use crate::world::World;
use anyhow::{anyhow, Context, Result};
use arrow_array::{
    Array, ArrayRef, BooleanArray, Float64Array, Int64Array, RecordBatch, StringArray, UInt32Array, UInt64Array,
};
use arrow_schema::{DataType, Field, Schema};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::ArrowWriter;
use parquet::basic::Compression;
use parquet::file::properties::WriterProperties;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A fresh run directory `<out>/<name>-<UTC time>` (suffixed if it exists).
pub fn make_run_dir(out: &Path, name: &str) -> Result<PathBuf> {
    if out.exists() && !out.is_dir() {
        anyhow::bail!("--out {}: not a directory (a file of that name is in the way)", out.display());
    }
    std::fs::create_dir_all(out).with_context(|| format!("creating the results directory {}", out.display()))?;
    let stamp = humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string().replace([':', '-'], "");
    let base = out.join(format!("{name}-{stamp}"));
    let mut dir = base.clone();
    let mut k = 2;
    while dir.exists() {
        dir = PathBuf::from(format!("{}-{k}", base.display()));
        k += 1;
    }
    std::fs::create_dir(&dir).with_context(|| format!("creating the run directory {}", dir.display()))?;
    std::fs::create_dir(dir.join("theta")).with_context(|| format!("creating {}/theta", dir.display()))?;
    Ok(dir)
}

/// Columns of one table, in order.
#[derive(Default)]
struct Table {
    fields: Vec<Field>,
    cols: Vec<ArrayRef>,
}

impl Table {
    fn str(mut self, name: &str, v: impl IntoIterator<Item = String>) -> Self {
        self.fields.push(Field::new(name, DataType::Utf8, false));
        self.cols.push(Arc::new(StringArray::from(v.into_iter().collect::<Vec<_>>())));
        self
    }
    fn opt_str(mut self, name: &str, v: impl IntoIterator<Item = Option<String>>) -> Self {
        self.fields.push(Field::new(name, DataType::Utf8, true));
        self.cols.push(Arc::new(StringArray::from(v.into_iter().collect::<Vec<_>>())));
        self
    }
    fn u32(mut self, name: &str, v: impl IntoIterator<Item = u32>) -> Self {
        self.fields.push(Field::new(name, DataType::UInt32, false));
        self.cols.push(Arc::new(UInt32Array::from(v.into_iter().collect::<Vec<_>>())));
        self
    }
    fn u64(mut self, name: &str, v: impl IntoIterator<Item = u64>) -> Self {
        self.fields.push(Field::new(name, DataType::UInt64, false));
        self.cols.push(Arc::new(UInt64Array::from(v.into_iter().collect::<Vec<_>>())));
        self
    }
    fn opt_u64(mut self, name: &str, v: impl IntoIterator<Item = Option<u64>>) -> Self {
        self.fields.push(Field::new(name, DataType::UInt64, true));
        self.cols.push(Arc::new(UInt64Array::from(v.into_iter().collect::<Vec<_>>())));
        self
    }
    fn f64(mut self, name: &str, v: impl IntoIterator<Item = f64>) -> Self {
        self.fields.push(Field::new(name, DataType::Float64, false));
        self.cols.push(Arc::new(Float64Array::from(v.into_iter().collect::<Vec<_>>())));
        self
    }
    fn opt_f64(mut self, name: &str, v: impl IntoIterator<Item = Option<f64>>) -> Self {
        self.fields.push(Field::new(name, DataType::Float64, true));
        self.cols.push(Arc::new(Float64Array::from(v.into_iter().collect::<Vec<_>>())));
        self
    }
    fn opt_i64(mut self, name: &str, v: impl IntoIterator<Item = Option<i64>>) -> Self {
        self.fields.push(Field::new(name, DataType::Int64, true));
        self.cols.push(Arc::new(Int64Array::from(v.into_iter().collect::<Vec<_>>())));
        self
    }
    fn opt_bool(mut self, name: &str, v: impl IntoIterator<Item = Option<bool>>) -> Self {
        self.fields.push(Field::new(name, DataType::Boolean, true));
        self.cols.push(Arc::new(BooleanArray::from(v.into_iter().collect::<Vec<_>>())));
        self
    }
    fn bool(mut self, name: &str, v: impl IntoIterator<Item = bool>) -> Self {
        self.fields.push(Field::new(name, DataType::Boolean, false));
        self.cols.push(Arc::new(BooleanArray::from(v.into_iter().collect::<Vec<_>>())));
        self
    }

    /// The value columns of `cols`, filled from `rows`.
    fn cols<R, X>(mut self, cols: &[Col<R>], rows: &[X], row: impl Fn(&X) -> &R) -> Self {
        for c in cols {
            self = match c {
                Col::U32(n, f, _) => self.u32(n, rows.iter().map(|x| f(row(x)))),
                Col::U64(n, f, _) => self.u64(n, rows.iter().map(|x| f(row(x)))),
                Col::OptU64(n, f, _) => self.opt_u64(n, rows.iter().map(|x| f(row(x)))),
                Col::F64(n, f, _) => self.f64(n, rows.iter().map(|x| f(row(x)))),
                Col::OptF64(n, f, _) => self.opt_f64(n, rows.iter().map(|x| f(row(x)))),
                Col::Bool(n, f, _) => self.bool(n, rows.iter().map(|x| f(row(x)))),
                Col::Str(n, f, _) => self.str(n, rows.iter().map(|x| f(row(x)))),
                Col::OptStr(n, f, _) => self.opt_str(n, rows.iter().map(|x| f(row(x)))),
            };
        }
        self
    }

    fn schema(&self) -> Schema {
        Schema::new(self.fields.clone())
    }

    fn write(self, path: &Path) -> Result<Schema> {
        let schema = Arc::new(self.schema());
        let batch = RecordBatch::try_new(schema.clone(), self.cols).context("assembling a record batch")?;
        let mut buf = Vec::new();
        let props = WriterProperties::builder().set_compression(Compression::SNAPPY).build();
        let mut w = ArrowWriter::try_new(&mut buf, schema.clone(), Some(props))?;
        w.write(&batch)?;
        w.close()?;
        write_atomic_at(path, &buf, "parquet-write")?;
        Ok(schema.as_ref().clone())
    }
}

/// Everything a finished (or failed) cell contributes.
pub struct CellOutcome<'a> {
    pub cell_id: &'a str,
    pub config: &'a ConfigPlan,
    pub seed: u32,
    pub result: Result<CellResult, String>,
    pub wall_s: f64,
}

/// Every row of `part` of every finished cell, with its cell.
fn rows_of<'a, R>(cells: &'a [CellOutcome<'a>], part: fn(&CellResult) -> &[R]) -> Vec<(&'a CellOutcome<'a>, &'a R)> {
    cells
        .iter()
        .filter_map(|c| c.result.as_ref().ok().map(|r| (c, r)))
        .flat_map(|(c, r)| part(r).iter().map(move |m| (c, m)))
        .collect()
}

/// deploy: the pair-selection strategy; active: the selection rule.
fn strategy(c: &ConfigPlan) -> Option<String> {
    c.strategy.map(|s| s.to_string()).or_else(|| c.rule.map(|r| r.to_string()))
}

/// deploy with a learning policy in the run: the cell's deployed policy.
fn policy_arm(c: &ConfigPlan) -> String {
    c.arm.as_ref().map(|a| a.kind().to_string()).unwrap_or_default()
}

/// deploy with a learning policy in the run: the reward the cell's policy update reads
/// (policy.reward; "learned" for arms that read θ or the labels).
fn reward_source(c: &ConfigPlan) -> String {
    c.arm.as_ref().map(|a| a.reward().to_string()).unwrap_or_default()
}

/// deploy with a learning policy in the run: a learning cell's adapter life
/// (policy.adapter; "" for arms that do not learn).
fn adapter_life(c: &ConfigPlan) -> String {
    c.arm.as_ref().and_then(|a| a.learning()).map(|l| l.adapter.to_string()).unwrap_or_default()
}

/// The key columns of a per-cell table: cell_id, config_id, estimator, label, strategy, seed.
fn keyed<R>(t: Table, rows: &[(&CellOutcome<'_>, &R)]) -> Table {
    t.str("cell_id", rows.iter().map(|(c, _)| c.cell_id.to_string()))
        .u32("config_id", rows.iter().map(|(c, _)| c.config.config_id as u32))
        .str("estimator", rows.iter().map(|(c, _)| c.config.kind.to_string()))
        .str("label", rows.iter().map(|(c, _)| c.config.label.clone()))
        .opt_str("strategy", rows.iter().map(|(c, _)| strategy(c.config)))
        .u32("seed", rows.iter().map(|(c, _)| c.seed))
}

/// The deployed policy's columns of a run with a learning policy: its arm, the reward it
/// learns from, its adapter's life.
fn arm_cols<X>(t: Table, rows: &[X], config: impl Fn(&X) -> &ConfigPlan) -> Table {
    t.str("policy", rows.iter().map(|x| policy_arm(config(x))))
        .str("reward", rows.iter().map(|x| reward_source(config(x))))
        .str("adapter", rows.iter().map(|x| adapter_life(config(x))))
}

/// A hyper-parameter as JSON, typed as the spec's TOML: numbers as numbers, words ("auto",
/// "none", a schedule) as strings, booleans as booleans.
fn hparam_json(v: &toml::Value) -> serde_json::Value {
    match v {
        toml::Value::Integer(i) => serde_json::Value::from(*i),
        toml::Value::Float(f) => {
            serde_json::Number::from_f64(*f).map_or(serde_json::Value::Null, serde_json::Value::Number)
        }
        toml::Value::Boolean(b) => serde_json::Value::Bool(*b),
        toml::Value::String(s) => serde_json::Value::String(s.clone()),
        other => serde_json::Value::String(crate::spec::estimator::show(other)),
    }
}

/// cells.parquet's `hparams`: every hyper-parameter of the cell's estimator as one JSON object
/// with typed values (`{"lr":0.1,"clip":"none"}`): the whole config in one cell, for the record.
fn hparams_json(c: &ConfigPlan) -> String {
    let m: serde_json::Map<String, serde_json::Value> =
        c.hparams.iter().map(|(k, v)| (k.to_string(), hparam_json(v))).collect();
    serde_json::Value::Object(m).to_string()
}

/// cells.parquet's `hp.<key>` columns, one per hyper-parameter of any config of the run (in
/// order of first appearance), null for a config of a kind without it: what a pandas or polars
/// user groups by (`cells.groupby("hp.lr")`, joined to metrics.parquet on `cell_id`), typed
/// from the run's values — Int64 where every value is a whole number of an integer key, Float64
/// where every value is a number, Boolean where every value is one, else (a key whose values
/// mix numbers and words, as λ = ["auto", 2.0] or clip = ["none", 1.0]) text as labels show it.
fn hparam_cols(mut t: Table, cells: &[CellOutcome<'_>]) -> Table {
    let mut keys: Vec<&str> = Vec::new();
    for c in cells {
        for (k, _) in &c.config.hparams {
            if !keys.contains(&k.as_str()) {
                keys.push(k);
            }
        }
    }
    for k in keys {
        let vals: Vec<Option<&toml::Value>> =
            cells.iter().map(|c| c.config.hparams.iter().find(|(kk, _)| kk == k).map(|(_, v)| v)).collect();
        let present = || vals.iter().flatten();
        let name = format!("hp.{k}");
        t = if present().all(|v| v.is_integer()) {
            t.opt_i64(&name, vals.iter().map(|v| v.and_then(|v| v.as_integer())))
        } else if present().all(|v| v.is_integer() || v.is_float()) {
            t.opt_f64(&name, vals.iter().map(|v| v.and_then(|v| v.as_float().or(v.as_integer().map(|i| i as f64)))))
        } else if present().all(|v| v.is_bool()) {
            t.opt_bool(&name, vals.iter().map(|v| v.and_then(|v| v.as_bool())))
        } else {
            t.opt_str(&name, vals.iter().map(|v| v.map(crate::spec::estimator::show)))
        };
    }
    t
}

/// Writes the tables of a finished run; returns the schema of every table.
pub fn write_tables(
    dir: &Path,
    plan: &Plan,
    world: &World,
    cells: &[CellOutcome<'_>],
) -> Result<Vec<(String, Schema)>> {
    let mut out = Tables { dir, schemas: Vec::new() };
    let chunked = world.generated.is_some() && world.spec.setting == crate::spec::Setting::Deploy;
    out.put("cells.parquet", cells_table(world, cells))?;
    out.put("metrics.parquet", metrics_table(world, cells, chunked))?;
    if chunked {
        deploy_tables(&mut out, plan, cells)?;
    }
    if world.online.is_some() {
        policy_tables(&mut out, cells)?;
    }
    write_adapters(dir, cells)?;
    if let Some(g) = &world.generated {
        out.put("generations.parquet", generations_table(g))?;
    }
    if world.spec.stream.record_steps {
        let rows: Vec<(&CellOutcome<'_>, &StepRow)> = rows_of(cells, |r| &r.steps);
        out.put("steps.parquet", keyed(Table::default(), &rows).cols(STEPS, &rows, |(_, s)| s))?;
    }
    out.put("timings.parquet", timings_table(cells))?;
    for c in cells {
        if let Ok(r) = &c.result {
            write_atomic(&dir.join("theta").join(format!("{}.npy", c.cell_id)), &npy_f64(&r.theta))?;
        }
    }
    Ok(out.schemas)
}

/// The tables written so far, in order (schema.json lists them so).
struct Tables<'a> {
    dir: &'a Path,
    schemas: Vec<(String, Schema)>,
}

impl Tables<'_> {
    fn put(&mut self, name: &str, t: Table) -> Result<()> {
        let schema = t.write(&self.dir.join(name))?;
        self.schemas.push((name.to_string(), schema));
        Ok(())
    }
}

/// cells.parquet: one row per cell — its config, seed, hyper-parameters (JSON), curvature
/// source, status, stream hash, with a learning policy the deployed arm, then one typed
/// `hp.<key>` column per hyper-parameter ([`hparam_cols`]).
fn cells_table(world: &World, cells: &[CellOutcome<'_>]) -> Table {
    let status: Vec<CellStatus> = cells
        .iter()
        .map(|c| CellStatus {
            status: if c.result.is_ok() { "ok" } else { "failed" }.into(),
            err: c.result.as_ref().err().cloned(),
        })
        .collect();
    let t = Table::default()
        .str("cell_id", cells.iter().map(|c| c.cell_id.to_string()))
        .u32("config_id", cells.iter().map(|c| c.config.config_id as u32))
        .str("estimator", cells.iter().map(|c| c.config.kind.to_string()))
        .str("label", cells.iter().map(|c| c.config.label.clone()))
        .opt_str("strategy", cells.iter().map(|c| strategy(c.config)))
        .u32("seed", cells.iter().map(|c| c.seed))
        .str("hparams", cells.iter().map(|c| hparams_json(c.config)))
        // whose 𝓗_t scored the uncertainty (pessimism, UCB, active selection)
        .str("curvature", cells.iter().map(|c| world.configs[c.config.config_id].curvature_text()))
        .cols(CELL_STATUS, &status, |s| s)
        .opt_str(
            "stream_hash",
            cells.iter().map(|c| c.result.as_ref().ok().map(|r| format!("{:016x}", r.stream_hash))),
        );
    // runs with a learning policy: the deployed policy of each cell
    let t = if world.online.is_some() { arm_cols(t, cells, |c| c.config) } else { t };
    // last: the typed hyper-parameters, whose columns depend on the run's estimators
    hparam_cols(t, cells)
}

/// metrics.parquet: one row per cell × evaluation point (a chunked deployment's columns after).
fn metrics_table(world: &World, cells: &[CellOutcome<'_>], chunked: bool) -> Table {
    let setting = world.spec.setting.as_str();
    let rows: Vec<(&CellOutcome<'_>, &MetricRow)> = rows_of(cells, |r| &r.rows);
    let t = keyed(Table::default().str("setting", rows.iter().map(|_| setting.to_string())), &rows).cols(
        METRICS,
        &rows,
        |(_, m)| m,
    );
    let t = if chunked { t.cols(METRICS_CHUNKED, &rows, |(_, m)| m) } else { t };
    // a noisy labeller: its flips so far (absent at flip = 0, so those runs keep their bytes)
    let flips = world.generated.is_some() && world.spec.oracle.as_ref().is_some_and(|o| o.flip > 0.0);
    let t = if flips { t.cols(crate::rows::METRICS_FLIP, &rows, |(_, m)| m) } else { t };
    if world.online.is_some() {
        arm_cols(t, &rows, |(c, _)| c.config)
    } else {
        t
    }
}

/// A chunked deployment's rounds.parquet (one row per prompt) and winrates.parquet.
fn deploy_tables(out: &mut Tables<'_>, plan: &Plan, cells: &[CellOutcome<'_>]) -> Result<()> {
    let rows: Vec<(&CellOutcome<'_>, &RoundRow)> = rows_of(cells, |r| &r.rounds);
    let t = Table::default()
        .str("cell_id", rows.iter().map(|(c, _)| c.cell_id.to_string()))
        .u32("config_id", rows.iter().map(|(c, _)| c.config.config_id as u32))
        .str("estimator", rows.iter().map(|(c, _)| c.config.kind.to_string()))
        .opt_str("strategy", rows.iter().map(|(c, _)| strategy(c.config)))
        .u32("seed", rows.iter().map(|(c, _)| c.seed))
        .cols(ROUNDS, &rows, |(_, r)| r);
    out.put("rounds.parquet", t)?;
    let w = win_rates(plan, cells);
    let rates: Vec<WinRow> = w
        .iter()
        .map(|r| WinRow {
            chunk_win_rate: r.chunk_wins / r.chunks.max(1) as f64,
            prompt_win_rate: r.prompt_wins / r.prompts.max(1) as f64,
            chunks_compared: r.chunks,
            prompts_compared: r.prompts,
        })
        .collect();
    let t = Table::default()
        .u32("config_id", w.iter().map(|r| r.config_id as u32))
        .str("label", w.iter().map(|r| plan.configs[r.config_id].label.clone()))
        .str("estimator", w.iter().map(|r| plan.configs[r.config_id].kind.to_string()))
        .opt_str("strategy", w.iter().map(|r| strategy(&plan.configs[r.config_id])))
        .cols(WINRATES, &rates, |r| r);
    out.put("winrates.parquet", t)
}

/// A learning policy's policy.parquet (evaluations), policy_updates.parquet and
/// policy_timings.parquet.
fn policy_tables(out: &mut Tables<'_>, cells: &[CellOutcome<'_>]) -> Result<()> {
    let rows: Vec<(&CellOutcome<'_>, &PolicyRow)> = rows_of(cells, |r| &r.policy);
    let t = arm_cols(keyed(Table::default(), &rows), &rows, |(c, _)| c.config).cols(POLICY, &rows, |(_, m)| m).cols(
        POLICY_DIGEST,
        &rows,
        |(_, m)| m,
    );
    out.put("policy.parquet", t)?;
    let rows: Vec<(&CellOutcome<'_>, &SampleRow)> = rows_of(cells, |r| &r.policy_samples);
    let t = arm_cols(keyed(Table::default(), &rows), &rows, |(c, _)| c.config).cols(POLICY_SAMPLES, &rows, |(_, m)| m);
    out.put("policy_samples.parquet", t)?;
    let rows: Vec<(&CellOutcome<'_>, &UpdateRow)> = rows_of(cells, |r| &r.policy_updates);
    let t = arm_cols(keyed(Table::default(), &rows), &rows, |(c, _)| c.config)
        .cols(POLICY_UPDATES, &rows, |(_, m)| m)
        .str("rollout_digest", rows.iter().map(|(_, r)| r.rollout_digest.clone()))
        .str("updated_digest", rows.iter().map(|(_, r)| r.updated_digest.clone()))
        .str("rollout_served_as", rows.iter().map(|(_, r)| r.rollout_served_as.clone()));
    out.put("policy_updates.parquet", t)?;
    let rows: Vec<(&CellOutcome<'_>, &PolicyTiming)> = rows_of(cells, |r| &r.policy_times);
    let t = Table::default()
        .str("cell_id", rows.iter().map(|(c, _)| c.cell_id.to_string()))
        .str("label", rows.iter().map(|(c, _)| c.config.label.clone()))
        .str("policy", rows.iter().map(|(c, _)| policy_arm(c.config)))
        .u32("seed", rows.iter().map(|(c, _)| c.seed))
        .cols(POLICY_TIMINGS, &rows, |(_, m)| m);
    out.put("policy_timings.parquet", t)
}

/// A learning policy's adapters, and a reward model's whose features learn (LoRA + score head),
/// under `adapters/<cell>/<dir>/`.
fn write_adapters(dir: &Path, cells: &[CellOutcome<'_>]) -> Result<()> {
    for c in cells {
        for a in c.result.iter().flat_map(|r| &r.adapters) {
            let at = dir.join("adapters").join(c.cell_id).join(&a.dir);
            // a directory that cannot be made is the disk's failure, as a write's is: the run
            // stays resumable
            std::fs::create_dir_all(&at).map_err(|source| crate::io::StorageError { path: at.clone(), source })?;
            write_atomic_at(&at.join("adapter_model.safetensors"), &a.safetensors, "adapter-write")?;
            write_atomic_at(&at.join("adapter_config.json"), a.config.as_bytes(), "adapter-write")?;
        }
    }
    Ok(())
}

/// generations.parquet: the bank's responses with their oracle rewards.
fn generations_table(g: &crate::world::generated::Generated) -> Table {
    let rows: Vec<(usize, usize, &features::generate::Sample)> =
        g.samples.iter().enumerate().flat_map(|(i, ss)| ss.iter().enumerate().map(move |(j, s)| (i, j, s))).collect();
    let prompt_text = |i: usize| g.prompts[i].last().map(|m| m.content.clone()).unwrap_or_default();
    let reward = |i: usize, j: usize| g.bank.contexts[i].reward.as_ref().map_or(f64::NAN, |r| r[j]);
    Table::default()
        .u64("prompt", rows.iter().map(|(i, _, _)| *i as u64))
        .str("prompt_text", rows.iter().map(|(i, _, _)| prompt_text(*i)))
        .u32("sample", rows.iter().map(|(_, j, _)| *j as u32))
        .str("response", rows.iter().map(|(_, _, s)| s.text.clone()))
        .u64("tokens", rows.iter().map(|(_, _, s)| s.tokens as u64))
        .bool("stopped", rows.iter().map(|(_, _, s)| s.stopped))
        .f64("oracle_reward", rows.iter().map(|(i, j, _)| reward(*i, *j)))
}

/// timings.parquet: one row per cell × evaluation bucket (wall clock lives only here).
fn timings_table(cells: &[CellOutcome<'_>]) -> Table {
    let rows: Vec<(&CellOutcome<'_>, &CellResult, &Bucket)> = cells
        .iter()
        .filter_map(|c| c.result.as_ref().ok().map(|r| (c, r)))
        .flat_map(|(c, r)| r.buckets.iter().map(move |b| (c, r, b)))
        .collect();
    let totals: Vec<CellTotals> =
        rows.iter().map(|(c, r, _)| CellTotals { wall_s: c.wall_s, estimator_s: r.estimator_s }).collect();
    Table::default()
        .str("cell_id", rows.iter().map(|(c, _, _)| c.cell_id.to_string()))
        .str("estimator", rows.iter().map(|(c, _, _)| c.config.kind.to_string()))
        .str("label", rows.iter().map(|(c, _, _)| c.config.label.clone()))
        .u32("seed", rows.iter().map(|(c, _, _)| c.seed))
        .cols(BUCKETS, &rows, |(_, _, b)| b)
        .cols(CELL_TOTALS, &totals, |t| t)
}

/// A table of the run directory read back, one `R` per row, through the column lists that
/// wrote it (so a renamed column changes writer and reader at once). A nullable column that the
/// file lacks (a run written before the column existed; the chunked-only metrics) reads as
/// None; any other missing column, or one of another type, is an error naming file and column.
pub fn read_rows<R: Default>(path: &Path, lists: &[&[Col<R>]]) -> Result<Vec<R>> {
    let mut out: Vec<R> = Vec::new();
    for b in read_batches(path)? {
        let start = out.len();
        out.resize_with(start + b.num_rows(), R::default);
        let rows = &mut out[start..];
        for c in lists.iter().flat_map(|l| l.iter()) {
            fill(rows, c, &b, path)?;
        }
    }
    Ok(out)
}

/// Rows of a per-cell table with their [`Key`] (cell, label, seed).
pub fn read_keyed<R: Default>(path: &Path, lists: &[&[Col<R>]]) -> Result<Vec<(Key, R)>> {
    Ok(read_rows(path, &[KEY])?.into_iter().zip(read_rows(path, lists)?).collect())
}

/// metrics.parquet (with the chunked deployment's columns where the run has them).
pub fn read_metrics(run: &Path) -> Result<Vec<(Key, MetricRow)>> {
    read_keyed(&run.join("metrics.parquet"), &[METRICS, METRICS_CHUNKED])
}

/// policy.parquet: a learning policy's evaluations.
pub fn read_policy(run: &Path) -> Result<Vec<(Key, PolicyRow)>> {
    read_keyed(&run.join("policy.parquet"), &[POLICY, POLICY_DIGEST])
}

/// policy_samples.parquet: a learning policy's evaluations, one row per held-out sample.
pub fn read_policy_samples(run: &Path) -> Result<Vec<(Key, SampleRow)>> {
    read_keyed(&run.join("policy_samples.parquet"), &[POLICY_SAMPLES])
}

/// timings.parquet: each bucket's cell with its totals.
pub fn read_timings(run: &Path) -> Result<Vec<(Key, CellTotals)>> {
    read_keyed(&run.join("timings.parquet"), &[CELL_TOTALS])
}

/// cells.parquet: whether each cell finished.
pub fn read_cells(run: &Path) -> Result<Vec<(Key, CellStatus)>> {
    read_keyed(&run.join("cells.parquet"), &[CELL_STATUS])
}

/// rounds.parquet, each row with its cell, seed and label (the table has no label column:
/// cells.parquet names each cell's); a cell missing from cells.parquet is an error naming it.
pub fn read_rounds(run: &Path) -> Result<Vec<(Key, RoundRow)>> {
    const CELL_SEED: &[Col<Key>] = &[
        Col::Str("cell_id", |k| k.cell_id.clone(), |k, v| k.cell_id = v),
        Col::U32("seed", |k| k.seed, |k, v| k.seed = v),
    ];
    let path = run.join("rounds.parquet");
    let labels: std::collections::BTreeMap<String, String> =
        read_cells(run)?.into_iter().map(|(k, _)| (k.cell_id, k.label)).collect();
    let keys = read_rows(&path, &[CELL_SEED])?;
    let rows = read_rows(&path, &[ROUNDS])?;
    keys.into_iter()
        .zip(rows)
        .map(|(mut k, r)| {
            k.label = labels
                .get(&k.cell_id)
                .cloned()
                .ok_or_else(|| anyhow!("{}: cell `{}` is not in cells.parquet", path.display(), k.cell_id))?;
            Ok((k, r))
        })
        .collect()
}

/// generations.parquet's oracle rewards: per prompt, the reward of each sample by its index
/// (NaN for an index the table lacks).
pub fn read_generation_rewards(run: &Path) -> Result<std::collections::BTreeMap<u64, Vec<f64>>> {
    #[derive(Default)]
    struct G {
        prompt: u64,
        sample: u32,
        reward: f64,
    }
    const COLS: &[Col<G>] = &[
        Col::U64("prompt", |g| g.prompt, |g, v| g.prompt = v),
        Col::U32("sample", |g| g.sample, |g, v| g.sample = v),
        Col::F64("oracle_reward", |g| g.reward, |g, v| g.reward = v),
    ];
    let mut out: std::collections::BTreeMap<u64, Vec<f64>> = std::collections::BTreeMap::new();
    for g in read_rows(&run.join("generations.parquet"), &[COLS])? {
        let v = out.entry(g.prompt).or_default();
        let j = g.sample as usize;
        if v.len() <= j {
            v.resize(j + 1, f64::NAN);
        }
        v[j] = g.reward;
    }
    Ok(out)
}

/// winrates.parquet: each config's label and win rates.
pub fn read_winrates(run: &Path) -> Result<Vec<(String, WinRow)>> {
    let path = run.join("winrates.parquet");
    let labels = read_rows(&path, &[LABEL])?.into_iter().map(|k| k.label);
    Ok(labels.zip(read_rows(&path, &[WINRATES])?).collect())
}

fn read_batches(path: &Path) -> Result<Vec<RecordBatch>> {
    let f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let reader = ParquetRecordBatchReaderBuilder::try_new(f)
        .with_context(|| format!("{}: not a parquet file", path.display()))?
        .build()?;
    reader.map(|b| b.with_context(|| format!("reading {}", path.display()))).collect()
}

/// Column `name` of `b` as `T`; None when the file has no such column.
fn column<'a, T: 'static>(b: &'a RecordBatch, name: &str, path: &Path) -> Result<Option<&'a T>> {
    b.column_by_name(name)
        .map(|c| {
            c.as_any()
                .downcast_ref::<T>()
                .ok_or_else(|| anyhow!("{}: column `{name}` has an unexpected type", path.display()))
        })
        .transpose()
}

/// Sets column `c` of every row of `rows` from batch `b`.
fn fill<R>(rows: &mut [R], c: &Col<R>, b: &RecordBatch, path: &Path) -> Result<()> {
    fn all<T, R, A: Array>(rows: &mut [R], a: &A, set: fn(&mut R, T), v: impl Fn(&A, usize) -> T) {
        for (i, r) in rows.iter_mut().enumerate() {
            set(r, v(a, i));
        }
    }
    fn opt<T, R, A: Array>(rows: &mut [R], a: Option<&A>, set: fn(&mut R, Option<T>), v: impl Fn(&A, usize) -> T) {
        for (i, r) in rows.iter_mut().enumerate() {
            set(r, a.filter(|a| a.is_valid(i)).map(|a| v(a, i)));
        }
    }
    let need = |n: &str| anyhow!("{}: no column `{n}`", path.display());
    match c {
        Col::U32(n, _, set) => {
            all(rows, column::<UInt32Array>(b, n, path)?.ok_or_else(|| need(n))?, *set, |a, i| a.value(i))
        }
        Col::U64(n, _, set) => {
            all(rows, column::<UInt64Array>(b, n, path)?.ok_or_else(|| need(n))?, *set, |a, i| a.value(i))
        }
        Col::F64(n, _, set) => {
            all(rows, column::<Float64Array>(b, n, path)?.ok_or_else(|| need(n))?, *set, |a, i| a.value(i))
        }
        Col::Bool(n, _, set) => {
            all(rows, column::<BooleanArray>(b, n, path)?.ok_or_else(|| need(n))?, *set, |a, i| a.value(i))
        }
        Col::Str(n, _, set) => {
            all(rows, column::<StringArray>(b, n, path)?.ok_or_else(|| need(n))?, *set, |a, i| a.value(i).to_string())
        }
        Col::OptU64(n, _, set) => opt(rows, column::<UInt64Array>(b, n, path)?, *set, |a, i| a.value(i)),
        Col::OptF64(n, _, set) => opt(rows, column::<Float64Array>(b, n, path)?, *set, |a, i| a.value(i)),
        Col::OptStr(n, _, set) => opt(rows, column::<StringArray>(b, n, path)?, *set, |a, i| a.value(i).to_string()),
    }
    Ok(())
}

/// Win counts of one config over the cells of a chunked deployment run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WinRate {
    pub config_id: usize,
    /// Σ over (seed, chunk) of 1/w when this config is among the w cells with the highest
    /// chunk mean of r(a) + r(a′); `chunks` counts the (seed, chunk) pairs compared.
    pub chunk_wins: f64,
    pub chunks: u64,
    /// The same per (seed, prompt), on r(a) + r(a′) of the pair each cell chose.
    pub prompt_wins: f64,
    pub prompts: u64,
}

/// Win rates across every estimator × strategy cell of a run, per seed (cells of one seed see
/// the same prompt order and label noise). Configs whose cell failed do not compete.
pub fn win_rates(plan: &Plan, cells: &[CellOutcome<'_>]) -> Vec<WinRate> {
    use std::collections::BTreeMap;
    let mut out: Vec<WinRate> =
        plan.configs.iter().map(|c| WinRate { config_id: c.config_id, ..Default::default() }).collect();
    // (seed, chunk or prompt) → [(config, score)]
    let mut by_chunk: BTreeMap<(u32, u64), Vec<(usize, f64)>> = BTreeMap::new();
    let mut by_prompt: BTreeMap<(u32, u64), Vec<(usize, f64)>> = BTreeMap::new();
    for c in cells {
        let Ok(r) = &c.result else { continue };
        for m in &r.rows {
            if let (Some(ch), Some(v)) = (m.chunk, m.pair_reward) {
                by_chunk.entry((c.seed, ch)).or_default().push((c.config.config_id, v));
            }
        }
        for rr in &r.rounds {
            by_prompt
                .entry((c.seed, rr.prompt))
                .or_default()
                .push((c.config.config_id, rr.reward_first + rr.reward_second));
        }
    }
    let credit = |groups: BTreeMap<(u32, u64), Vec<(usize, f64)>>, out: &mut Vec<WinRate>, chunk: bool| {
        for (_, g) in groups {
            let best = g.iter().map(|x| x.1).fold(f64::NEG_INFINITY, f64::max);
            let winners = g.iter().filter(|x| x.1 == best).count() as f64;
            for (cfg, v) in g {
                let w = &mut out[cfg];
                let share = if v == best { 1.0 / winners } else { 0.0 };
                if chunk {
                    w.chunk_wins += share;
                    w.chunks += 1;
                } else {
                    w.prompt_wins += share;
                    w.prompts += 1;
                }
            }
        }
    };
    credit(by_chunk, &mut out, true);
    credit(by_prompt, &mut out, false);
    out
}

/// The schema of every table as JSON (name → [[column, type, nullable]]).
pub fn schema_json(schemas: &[(String, Schema)]) -> String {
    let m: serde_json::Map<String, serde_json::Value> = schemas
        .iter()
        .map(|(name, s)| {
            let cols = s
                .fields()
                .iter()
                .map(|f| serde_json::json!([f.name(), format!("{}", f.data_type()), f.is_nullable()]))
                .collect();
            (name.clone(), serde_json::Value::Array(cols))
        })
        .collect();
    serde_json::to_string_pretty(&serde_json::Value::Object(m)).expect("plain JSON") + "\n"
}

/// The file of a run directory that lists its plan's cells (written when the directory is made
/// or resumed): what `onepass cells` reads, with no spec to parse or data to read.
pub const PLAN_FILE: &str = "plan.json";

/// A planned cell as plan.json lists it.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct PlannedCell {
    pub cell_id: String,
    pub config: String,
    pub seed: u32,
}

/// plan.json's text: `{"cells": [{"cell_id", "config" (the config's label), "seed"}, …]}` in
/// the plan's order.
pub fn plan_json(plan: &Plan) -> Result<String> {
    let cells: Vec<PlannedCell> = plan
        .cells
        .iter()
        .map(|c| PlannedCell { cell_id: c.cell_id.clone(), config: plan.configs[c.config].label.clone(), seed: c.seed })
        .collect();
    Ok(serde_json::to_string_pretty(&serde_json::json!({ "cells": cells }))?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A table written through the column lists reads back through the same lists to the same
    /// rows (None where a nullable value was None); a file without a nullable column reads
    /// None, one without a required column is an error naming it (the negative control).
    #[test]
    fn a_table_reads_back_the_rows_it_was_written_from() {
        let dir = tempfile::tempdir().unwrap();
        let rows: Vec<(Key, MetricRow)> = (0..5u32)
            .map(|i| {
                let k = Key { cell_id: format!("c{i}"), label: format!("sgd lr={i}"), seed: i % 2 };
                let m = MetricRow {
                    step: u64::from(i) * 3,
                    samples_seen: u64::from(i) * 7,
                    eval_loss: 0.5 + f64::from(i),
                    theta_err: (i % 2 == 0).then_some(f64::from(i) / 3.0),
                    chunk: (i > 2).then_some(u64::from(i)),
                    converged: i != 4,
                    flops: 1 << i,
                    ..Default::default()
                };
                (k, m)
            })
            .collect();
        let keyed = |t: Table| {
            t.str("cell_id", rows.iter().map(|(k, _)| k.cell_id.clone()))
                .str("label", rows.iter().map(|(k, _)| k.label.clone()))
                .u32("seed", rows.iter().map(|(k, _)| k.seed))
        };
        let full = dir.path().join("metrics.parquet");
        keyed(Table::default())
            .cols(METRICS, &rows, |(_, m)| m)
            .cols(METRICS_CHUNKED, &rows, |(_, m)| m)
            .write(&full)
            .unwrap();
        assert_eq!(read_metrics(dir.path()).unwrap(), rows);
        // without the chunked columns (a run that is not chunked): None
        let plain = tempfile::tempdir().unwrap();
        keyed(Table::default()).cols(METRICS, &rows, |(_, m)| m).write(&plain.path().join("metrics.parquet")).unwrap();
        let back = read_metrics(plain.path()).unwrap();
        assert!(back.iter().all(|(_, m)| m.chunk.is_none()));
        assert_eq!(back[0].1.eval_loss, rows[0].1.eval_loss);
        // a required column missing
        let short = tempfile::tempdir().unwrap();
        keyed(Table::default())
            .cols(&METRICS[..3], &rows, |(_, m)| m)
            .write(&short.path().join("metrics.parquet"))
            .unwrap();
        let e = read_metrics(short.path()).unwrap_err().to_string();
        assert!(e.contains("metrics.parquet") && e.contains("no column `train_accuracy`"), "{e}");
    }
}
