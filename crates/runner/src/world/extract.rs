//! `onepass features extract`: a preference dataset → φ of both sides of every pair through a
//! frozen LLM, read from and written to the feature cache, optionally saved as a "bring your
//! own features" parquet (`phi_chosen`, `phi_rejected`, `label`) that `env.kind = "features"`
//! reads.

use super::datasets::{read_pairs, Pair};
use crate::io::write_atomic;
use crate::progress::{Meter, Mode};
use crate::spec::{Format, PhiSpec};
use anyhow::{anyhow, Context, Result};
use arrow_array::builder::{Float32Builder, ListBuilder};
use arrow_array::{ArrayRef, BooleanArray, Float32Array, RecordBatch, UInt64Array};
use candle_core::{DType, Device};
use features::cache::{text_key, FeatureCache};
use features::{Backbone, PhiOptions, ShardSpec, Source};
use std::path::PathBuf;
use std::sync::Arc;

pub struct ExtractOptions {
    pub phi: PhiSpec,
    pub dataset: PathBuf,
    pub format: Format,
    pub limit: Option<usize>,
    pub out: Option<PathBuf>,
    pub progress: Mode,
    /// Run one part of the global batch plan (`--shard i/N`); `--out` needs the whole.
    pub shard: ShardSpec,
}

/// What an extraction did (printed, and returned for tests).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct ExtractSummary {
    pub pairs: usize,
    pub sequences: usize,
    /// `i/N` when sharded.
    pub shard: String,
    /// Sequences this process owns (all of them unless sharded).
    pub shard_sequences: usize,
    pub hits: usize,
    pub misses: usize,
    /// Pairs whose two sides became the same token sequence (after truncation): z = 0.
    pub degenerate_pairs: usize,
    pub truncated_sequences: usize,
    pub response_cut_sequences: usize,
    pub tokens: usize,
    pub forward_s: f64,
    pub space: String,
    pub dim: usize,
}

/// The candle device of a spec's `device`.
pub fn device(d: crate::spec::Device) -> Result<Device> {
    use crate::spec::Device as D;
    Ok(match d {
        D::Cpu => Device::Cpu,
        D::Cuda => Device::new_cuda(0).context("opening CUDA device 0 (build with --features cuda)")?,
        D::Metal => Device::new_metal(0).context("opening Metal device 0 (build with --features metal)")?,
        D::Auto => {
            if candle_core::utils::cuda_is_available() {
                Device::new_cuda(0)?
            } else if candle_core::utils::metal_is_available() {
                Device::new_metal(0)?
            } else {
                Device::Cpu
            }
        }
    })
}

/// The candle dtype of a spec's `dtype`.
pub fn dtype(d: crate::spec::DType) -> DType {
    match d {
        crate::spec::DType::F32 => DType::F32,
        crate::spec::DType::Bf16 => DType::BF16,
        crate::spec::DType::F16 => DType::F16,
    }
}

/// How φ is computed: model, options, cache, batching, device.
pub struct PhiRun {
    pub model: String,
    pub cache: PathBuf,
    pub batch: usize,
    pub phi: PhiOptions,
    pub dtype: DType,
    pub device: Device,
    pub progress: Mode,
    pub shard: ShardSpec,
    /// Keep every sequence's token ids ([`Extracted::ids`]): a reward model whose features
    /// learn recomputes them (`[reward] update`).
    pub keep_ids: bool,
}

impl PhiRun {
    /// `phi` on its device (the model path's `${VAR}` expanded), unsharded.
    pub fn new(phi: &PhiSpec, progress: Mode) -> Result<PhiRun> {
        Ok(PhiRun {
            model: crate::spec::data::expand_env(&phi.model).map_err(|m| anyhow!("model: {m}"))?,
            cache: phi.cache.clone(),
            batch: phi.batch,
            phi: phi.options(),
            dtype: dtype(phi.dtype),
            device: device(phi.device)?,
            progress,
            shard: ShardSpec::ALL,
            keep_ids: false,
        })
    }
}

/// φ of both sides of some pairs.
pub struct Extracted {
    /// chosen, rejected, chosen, … (`None`: another shard's row).
    pub phi: Vec<Option<Vec<f32>>>,
    /// Both sides became the same token sequence (so z = 0).
    pub degenerate: Vec<bool>,
    pub summary: ExtractSummary,
    /// blake3 of the weight files, and the source as given.
    pub weights_blake3: String,
    pub source: String,
    /// Token count of every sequence (chosen, rejected, …), computed or read from the cache.
    pub lengths: Vec<usize>,
    /// The token ids of every sequence (chosen, rejected, …) when [`PhiRun::keep_ids`]; else empty.
    pub ids: Vec<Vec<u32>>,
}

/// φ of both sides of every pair, through the feature cache. `origin` names the data in errors.
pub fn extract_pairs(pairs: &[Pair], origin: &str, o: &PhiRun) -> Result<Extracted> {
    if pairs.is_empty() {
        return Err(anyhow!("{origin}: no pairs"));
    }
    let convs: Vec<(String, &[features::Message])> = pairs
        .iter()
        .flat_map(|p| {
            [
                (format!("{}, field `chosen`", p.at), p.chosen.as_slice()),
                (format!("{}, field `rejected`", p.at), p.rejected.as_slice()),
            ]
        })
        .collect();
    // each label names its file and line already
    let (mut ex, items) = extract_conversations(&convs, "", o)?;
    ex.degenerate = items.chunks_exact(2).map(|p| p[0].ids == p[1].ids).collect();
    if o.keep_ids {
        ex.ids = items.into_iter().map(|p| p.ids).collect();
    }
    ex.summary.pairs = pairs.len();
    ex.summary.degenerate_pairs = ex.degenerate.iter().filter(|&&d| d).count();
    Ok(ex)
}

/// φ of conversations (each ending with the response), through the feature cache; each comes
/// with where it is from (for errors: "prompt 3, sample 1"; a label that names its file itself,
/// "d.jsonl: line 4, field `chosen`", comes with an empty `origin`). `degenerate` is left empty.
pub fn extract_conversations(
    convs: &[(String, &[features::Message])],
    origin: &str,
    o: &PhiRun,
) -> Result<(Extracted, Vec<features::Prepared>)> {
    if convs.is_empty() {
        return Err(anyhow!("{origin}: no conversations"));
    }
    let source = Source::parse(&o.model)?;
    let backbone = Backbone::load(&source, &o.device, o.dtype, o.phi.max_len)
        .with_context(|| format!("loading the model {}", o.model))?;
    let mut items = Vec::with_capacity(convs.len());
    let mut keys = Vec::with_capacity(convs.len());
    let mut s = ExtractSummary { dim: backbone.dim(), ..Default::default() };
    for (what, msgs) in convs {
        let prep = backbone.prepare(msgs, &o.phi).map_err(|e| match origin {
            "" => anyhow!("{what}: {e}"),
            _ => anyhow!("{origin}: {what}: {e}"),
        })?;
        s.truncated_sequences += usize::from(prep.dropped > 0);
        s.response_cut_sequences += usize::from(prep.response_cut);
        items.push(prep);
        keys.push(text_key(msgs));
    }
    s.sequences = items.len();
    let (space, describe) = backbone.space(&o.phi);
    s.space = space.clone();
    let mut cache = FeatureCache::open(&o.cache, &space, backbone.dim(), describe)?;
    let bar = Meter::new(o.progress, "φ extraction", "sequences", 0);
    let t0 = std::time::Instant::now();
    let mine: usize = features::batch_plan(&keys, &items, o.batch)
        .iter()
        .skip(o.shard.index)
        .step_by(o.shard.count)
        .map(Vec::len)
        .sum();
    bar.set_length(mine as u64);
    let schedule = features::Schedule { batch: o.batch, shard: o.shard };
    let (phi, stats) = backbone.features_cached(&mut cache, &keys, &items, &o.phi, schedule, &mut |done, tokens| {
        bar.set_position(done as u64);
        bar.set_message(format!("{:.0} tok/s", tokens as f64 / t0.elapsed().as_secs_f64().max(1e-9)));
    })?;
    bar.finish();
    s.shard = format!("{}/{}", o.shard.index, o.shard.count);
    s.shard_sequences = stats.rows;
    s.hits = stats.hits;
    s.misses = stats.misses;
    s.tokens = stats.tokens;
    s.forward_s = stats.forward_s;
    let lengths = items.iter().map(|p| p.ids.len()).collect();
    let ex = Extracted {
        phi,
        degenerate: Vec::new(),
        summary: s,
        weights_blake3: backbone.weights_digest.clone(),
        source: backbone.source,
        lengths,
        ids: Vec::new(),
    };
    Ok((ex, items))
}

pub fn extract(o: &ExtractOptions) -> Result<ExtractSummary> {
    if o.shard.count > 1 && o.out.is_some() {
        return Err(anyhow!(
            "--out needs every row, but --shard {}/{} computes a part: run the shards, `onepass features merge` their caches, then extract once more without --shard (all cache hits) to write --out",
            o.shard.index,
            o.shard.count
        ));
    }
    let pairs = read_pairs(&o.dataset, o.format, o.limit)?;
    let run = PhiRun { shard: o.shard, ..PhiRun::new(&o.phi, o.progress)? };
    let ex = extract_pairs(&pairs, &o.dataset.display().to_string(), &run)?;
    if let Some(out) = &o.out {
        let phi: Vec<Vec<f32>> = ex.phi.into_iter().map(|r| r.expect("unsharded: every row")).collect();
        write_pairs_parquet(out, &pairs.iter().map(|p| p.row as u64).collect::<Vec<_>>(), &phi, ex.summary.dim)?;
    }
    Ok(ex.summary)
}

/// phi rows alternate chosen, rejected.
fn write_pairs_parquet(path: &std::path::Path, rows: &[u64], phi: &[Vec<f32>], d: usize) -> Result<()> {
    let list = |side: usize| -> ArrayRef {
        let mut b = ListBuilder::new(Float32Builder::with_capacity(rows.len() * d));
        for pair in phi.chunks_exact(2) {
            b.values().append_slice(&pair[side]);
            b.append(true);
        }
        Arc::new(b.finish())
    };
    let degenerate: BooleanArray = phi.chunks_exact(2).map(|p| Some(p[0] == p[1])).collect();
    let batch = RecordBatch::try_from_iter([
        ("row", Arc::new(UInt64Array::from(rows.to_vec())) as ArrayRef),
        ("phi_chosen", list(0)),
        ("phi_rejected", list(1)),
        ("label", Arc::new(Float32Array::from(vec![1.0f32; rows.len()])) as ArrayRef),
        ("degenerate", Arc::new(degenerate) as ArrayRef),
    ])?;
    let mut buf = Vec::new();
    let mut w = parquet::arrow::ArrowWriter::try_new(&mut buf, batch.schema(), None)?;
    w.write(&batch)?;
    w.close()?;
    write_atomic(path, &buf)
}

/// What `onepass features merge` did for one space of one source cache.
#[derive(Clone, Debug, serde::Serialize)]
pub struct MergeReport {
    pub from: String,
    pub space: String,
    pub added: usize,
    pub already_present: usize,
}

/// Merges feature caches (e.g. one per shard of a SLURM array) into `into`: every space of every
/// source, the rows `into` lacks, one new shard per space and source.
pub fn merge(into: &std::path::Path, sources: &[PathBuf]) -> Result<Vec<MergeReport>> {
    let mut out = Vec::new();
    for src in sources {
        let entries =
            std::fs::read_dir(src).with_context(|| format!("{}: not a feature cache directory", src.display()))?;
        let mut spaces: Vec<PathBuf> =
            entries.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.join("index.json").is_file()).collect();
        spaces.sort();
        if spaces.is_empty() {
            return Err(anyhow!("{}: no feature cache space in it (expected <space>/index.json)", src.display()));
        }
        for dir in spaces {
            let index = dir.join("index.json");
            let v: serde_json::Value = serde_json::from_str(
                &std::fs::read_to_string(&index).with_context(|| format!("reading {}", index.display()))?,
            )
            .with_context(|| format!("{}: not JSON", index.display()))?;
            let dim =
                v.get("dim").and_then(|d| d.as_u64()).ok_or_else(|| anyhow!("{}: no `dim`", index.display()))? as usize;
            let space = dir.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
            let mut dst = FeatureCache::open(into, &space, dim, v["describe"].clone())?;
            let (added, already_present) = dst.merge_from(&dir)?;
            out.push(MergeReport { from: dir.display().to_string(), space, added, already_present });
        }
    }
    Ok(out)
}
