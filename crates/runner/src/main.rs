//! `onepass`: the one binary. `onepass run <spec.toml> [--set key=value]…` runs a spec and
//! writes a run directory under `results/`; `onepass estimators` lists the estimator names.
//! Exit codes: 0 ok, 1 a cell failed (the others still ran and were written), 2 bad input.

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "onepass",
    version,
    about = "One-pass reward modeling experiments (Li, Qian, Zhao, Zhou, NeurIPS 2025)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a spec: every estimator config × seed (× strategy) is a cell; cells run in parallel.
    Run {
        /// The spec, e.g. experiments/passive/synthetic.toml
        spec: PathBuf,
        /// Override a key, e.g. --set stream.samples=5000 --set estimator.0.lr=0.1
        #[arg(long = "set", value_name = "KEY=VALUE")]
        overrides: Vec<String>,
        /// Where run directories go.
        #[arg(long, default_value = "results")]
        out: PathBuf,
        /// Worker threads (default: the spec's `threads`, 0 = one per core).
        #[arg(long)]
        threads: Option<usize>,
        /// Only parse and validate the spec, print the resolved spec and the cells.
        #[arg(long)]
        dry_run: bool,
    },
    /// Write <run-dir>/report/: report.md (final metrics, mean ± std over seeds) and figures.
    Report { run: PathBuf },
    /// Print the final metrics of several runs side by side (markdown).
    Compare {
        #[arg(required = true)]
        runs: Vec<PathBuf>,
    },
    /// List the estimator names a spec may use.
    Estimators,
    /// Reward features φ(x, a) from a frozen LLM.
    Features {
        #[command(subcommand)]
        cmd: FeaturesCmd,
    },
}

#[derive(Subcommand)]
enum FeaturesCmd {
    /// φ of both sides of every pair of a dataset, through the feature cache.
    Extract {
        /// A .gguf file or a model directory (config.json, tokenizer.json, tokenizer_config.json, safetensors).
        #[arg(long)]
        model: String,
        /// HH-RLHF jsonl(.gz) or UltraFeedback-binarized parquet.
        #[arg(long)]
        dataset: PathBuf,
        #[arg(long, value_enum, default_value = "auto")]
        format: runner::datasets::Format,
        /// Only the first N pairs.
        #[arg(long)]
        limit: Option<usize>,
        #[arg(long, default_value = ".cache/features")]
        cache: PathBuf,
        /// Also write a "bring your own features" parquet (phi_chosen, phi_rejected, label).
        #[arg(long)]
        out: Option<PathBuf>,
        #[arg(long, default_value_t = 8)]
        batch: usize,
        #[arg(long, default_value_t = 1024)]
        max_len: usize,
        #[arg(long, default_value = "reference")]
        eos_rule: String,
        #[arg(long, default_value = "prompt-first")]
        truncation: String,
        /// hidden_states[layer]; negative counts from the end (-1: after the final norm).
        #[arg(long, default_value_t = -1, allow_hyphen_values = true)]
        layer: i64,
        #[arg(long, default_value = "last")]
        pool: String,
        #[arg(long, default_value = "f32")]
        dtype: String,
        /// cpu, cuda, metal or auto.
        #[arg(long, default_value = "cpu")]
        device: String,
    },
    /// Forward-pass throughput on deterministic random ids (batch × len), as `just bench-features` runs it.
    Bench {
        /// A .gguf file or a model directory.
        #[arg(long)]
        model: String,
        #[arg(long, default_value_t = 8)]
        batch: usize,
        #[arg(long, default_value_t = 256)]
        len: usize,
        #[arg(long, default_value_t = 3)]
        reps: usize,
        #[arg(long, default_value_t = 1)]
        warmup: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[arg(long, default_value = "f32")]
        dtype: String,
        #[arg(long, default_value = "cpu")]
        device: String,
        /// Write the token ids (JSON) for the PyTorch side of the benchmark.
        #[arg(long)]
        ids_out: Option<PathBuf>,
        /// Write a Chrome trace (chrome://tracing, ui.perfetto.dev) of the timed passes: one span
        /// per block and per op (qkv, rope, scores, softmax, attn_v, o_proj, gate_up, silu_mul, down, …).
        #[arg(long)]
        trace: Option<PathBuf>,
    },
}

fn parse_dtype(dtype: &str) -> anyhow::Result<candle_core::DType> {
    Ok(match dtype {
        "f32" => candle_core::DType::F32,
        "bf16" => candle_core::DType::BF16,
        "f16" => candle_core::DType::F16,
        other => anyhow::bail!("--dtype {other}: expected f32, bf16 or f16"),
    })
}

fn word<T: serde::de::DeserializeOwned>(flag: &str, v: &str) -> anyhow::Result<T> {
    serde_json::from_value(serde_json::Value::String(v.to_string()))
        .map_err(|_| anyhow::anyhow!("--{flag} {v}: not one of the accepted values (see --help)"))
}

fn features_cmd(cmd: FeaturesCmd) -> anyhow::Result<()> {
    let (model, dataset, format, limit, cache, out, batch, max_len, eos_rule, truncation, layer, pool, dtype, device) =
        match cmd {
            FeaturesCmd::Bench { model, batch, len, reps, warmup, seed, dtype, device, ids_out, trace } => {
                if batch == 0 || len == 0 || reps == 0 {
                    anyhow::bail!("--batch, --len and --reps must be at least 1");
                }
                let o = runner::bench::BenchOptions {
                    model,
                    batch,
                    len,
                    reps,
                    warmup,
                    seed,
                    dtype: parse_dtype(&dtype)?,
                    device: runner::extract::device(&device)?,
                    ids_out,
                    trace,
                };
                let r = runner::bench::bench(&o)?;
                println!("{}", serde_json::to_string(&r)?);
                return Ok(());
            }
            FeaturesCmd::Extract {
                model,
                dataset,
                format,
                limit,
                cache,
                out,
                batch,
                max_len,
                eos_rule,
                truncation,
                layer,
                pool,
                dtype,
                device,
            } => (
                model, dataset, format, limit, cache, out, batch, max_len, eos_rule, truncation, layer, pool, dtype,
                device,
            ),
        };
    let dtype = parse_dtype(&dtype)?;
    let phi = features::PhiOptions {
        max_len,
        eos_rule: word("eos-rule", &eos_rule)?,
        truncation: word("truncation", &truncation)?,
        layer,
        pool: word("pool", &pool)?,
    };
    let o = runner::extract::ExtractOptions {
        model,
        dataset,
        format,
        limit,
        cache,
        out,
        batch,
        phi,
        dtype,
        device: runner::extract::device(&device)?,
        progress: std::io::IsTerminal::is_terminal(&std::io::stderr()),
    };
    let s = runner::extract::extract(&o)?;
    eprintln!(
        "onepass: {} pairs, {} sequences: {} cache hits, {} computed ({} tokens in {:.1} s, {:.0} tok/s); {} degenerate pairs (both sides the same tokens), {} sequences truncated ({} lost response tokens); cache space {}",
        s.pairs,
        s.sequences,
        s.hits,
        s.misses,
        s.tokens,
        s.forward_s,
        s.tokens as f64 / s.forward_s.max(1e-9),
        s.degenerate_pairs,
        s.truncated_sequences,
        s.response_cut_sequences,
        s.space
    );
    println!("{}", serde_json::to_string(&s)?);
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Report { run } => match runner::report::report(&run) {
            Ok(dir) => {
                println!("{}", dir.join("report.md").display());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("onepass: {e:#}");
                ExitCode::from(2)
            }
        },
        Cmd::Compare { runs } => match runner::report::compare(&runs) {
            Ok(md) => {
                print!("{md}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("onepass: {e:#}");
                ExitCode::from(2)
            }
        },
        Cmd::Features { cmd } => match features_cmd(cmd) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("onepass: {e:#}");
                ExitCode::from(2)
            }
        },
        Cmd::Estimators => {
            for k in estimators::Kind::ALL {
                println!("{k}");
            }
            ExitCode::SUCCESS
        }
        Cmd::Run { spec, overrides, out, threads, dry_run } => {
            if dry_run {
                return match runner::load_plan(&spec, &overrides) {
                    Ok(plan) => {
                        print!("{}", toml::to_string(&plan.resolved_spec()).unwrap_or_default());
                        for c in &plan.cells {
                            println!("# {} {} seed {}", c.cell_id, plan.configs[c.config].label, c.seed);
                        }
                        ExitCode::SUCCESS
                    }
                    Err(e) => {
                        eprintln!("onepass: {e}");
                        ExitCode::from(2)
                    }
                };
            }
            match runner::run(&runner::RunOptions { spec, overrides, out, threads }) {
                Ok(s) => {
                    println!("{}", s.dir.display());
                    if s.failed > 0 {
                        eprintln!("onepass: {} of {} cells failed (see cells.parquet)", s.failed, s.cells);
                        ExitCode::from(1)
                    } else {
                        ExitCode::SUCCESS
                    }
                }
                Err(e) => {
                    eprintln!("onepass: {e:#}");
                    ExitCode::from(2)
                }
            }
        }
    }
}
