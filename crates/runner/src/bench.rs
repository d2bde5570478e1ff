//! `onepass features bench`: forward-pass throughput of a feature model on deterministic random
//! token ids (batch × len, no padding), the same ids `scripts/bench_features_torch.py` reads, so
//! candle and PyTorch run the identical workload. Prints one JSON line.

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use features::{Backbone, Source};
use rand::{Rng, SeedableRng};
use std::path::PathBuf;
use std::time::Instant;

pub struct BenchOptions {
    pub model: String,
    pub batch: usize,
    pub len: usize,
    pub reps: usize,
    pub warmup: usize,
    pub seed: u64,
    pub dtype: DType,
    pub device: Device,
    /// Write the ids here (JSON: {"batch", "len", "seed", "ids": [[…]]}).
    pub ids_out: Option<PathBuf>,
    /// Chrome trace of the timed passes.
    pub trace: Option<PathBuf>,
}

#[derive(Debug, serde::Serialize)]
pub struct BenchReport {
    pub engine: &'static str,
    pub model: String,
    pub dtype: String,
    pub device: String,
    pub threads: usize,
    pub batch: usize,
    pub len: usize,
    pub reps: usize,
    pub pass_s: Vec<f64>,
    pub tok_s: f64,
    pub load_s: f64,
    pub peak_rss_mb: Option<f64>,
    /// Checksum of the last-token states of the last pass (Σ|φ|), to compare engines roughly.
    pub abs_sum: f64,
}

pub fn bench(o: &BenchOptions) -> Result<BenchReport> {
    let t0 = Instant::now();
    let backbone = Backbone::load(&Source::parse(&o.model)?, &o.device, o.dtype, o.len)
        .with_context(|| format!("loading the model {}", o.model))?;
    let load_s = t0.elapsed().as_secs_f64();
    let vocab = backbone.model.cfg.vocab as u32;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(o.seed);
    let ids: Vec<Vec<u32>> = (0..o.batch).map(|_| (0..o.len).map(|_| rng.random_range(0..vocab)).collect()).collect();
    if let Some(p) = &o.ids_out {
        let j = serde_json::json!({"batch": o.batch, "len": o.len, "seed": o.seed, "ids": ids});
        crate::io::write_atomic(p, serde_json::to_string(&j)?.as_bytes())?;
    }
    let flat: Vec<u32> = ids.concat();
    let x = Tensor::from_vec(flat, (o.batch, o.len), &o.device)?;
    let layer = backbone.model.cfg.layers;
    let last = vec![o.len - 1; o.batch];
    let pass = || -> Result<Tensor> {
        let phi = backbone.model.hidden_at(&x, layer, &last)?;
        // Bring the result to the host so the timing includes the whole pass on any device.
        Ok(phi.to_dtype(DType::F32)?.to_device(&Device::Cpu)?)
    };
    for _ in 0..o.warmup {
        pass()?;
    }
    // Installed after the warm-up, so the trace holds the timed passes only.
    let _guard = match &o.trace {
        Some(p) => Some(chrome_trace(p)?),
        None => None,
    };
    let mut pass_s = Vec::with_capacity(o.reps);
    let mut abs_sum = 0.0;
    for _ in 0..o.reps {
        let t = Instant::now();
        let phi = pass()?;
        pass_s.push(t.elapsed().as_secs_f64());
        abs_sum = phi.abs()?.sum_all()?.to_scalar::<f32>()? as f64;
    }
    drop(_guard);
    let total: f64 = pass_s.iter().sum();
    Ok(BenchReport {
        engine: "candle",
        model: o.model.clone(),
        dtype: format!("{:?}", o.dtype).to_lowercase(),
        device: format!("{:?}", o.device),
        threads: candle_core::utils::get_num_threads(),
        batch: o.batch,
        len: o.len,
        reps: o.reps,
        tok_s: (o.batch * o.len * o.reps) as f64 / total.max(1e-12),
        pass_s,
        load_s,
        peak_rss_mb: kernels::mem::peak_rss_mb(),
        abs_sum,
    })
}

/// Keeps a Chrome trace recording; dropping it uninstalls the subscriber, then flushes the file.
pub struct TraceGuard {
    _default: tracing::subscriber::DefaultGuard,
    _flush: tracing_chrome::FlushGuard,
}

/// Records every span of this thread into a Chrome trace at `path` until the guard drops.
pub fn chrome_trace(path: &std::path::Path) -> Result<TraceGuard> {
    use tracing_subscriber::prelude::*;
    let (layer, guard) = tracing_chrome::ChromeLayerBuilder::new()
        .file(path)
        .include_args(true)
        .trace_style(tracing_chrome::TraceStyle::Threaded)
        .build();
    let sub = tracing_subscriber::registry().with(layer);
    let default = tracing::subscriber::set_default(sub);
    Ok(TraceGuard { _default: default, _flush: guard })
}
