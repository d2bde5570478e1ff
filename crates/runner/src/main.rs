//! `onepass`: the one binary. `onepass run <spec.toml> [--set key=value]…` runs a spec and
//! writes a run directory under `results/`; `onepass estimators` lists the estimator names.
//! Exit codes: 0 ok, 1 a cell failed (the others still ran and were written), 2 bad input,
//! 130 interrupted by SIGINT/SIGTERM (checkpoints written; `onepass run <spec> --resume <dir>`).

use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

/// `--version`: the crate's version and the git revision the binary was built from (a run's
/// `--resume` and `onepass merge` compare revisions, so this says which one a binary is).
const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (git ",
    env!("ONEPASS_GIT_REV"),
    ", uncommitted changes: ",
    env!("ONEPASS_GIT_DIRTY"),
    ")"
);

#[derive(Parser)]
#[command(
    name = "onepass",
    version = VERSION,
    about = "One-pass reward modeling experiments (Li, Qian, Zhao, Zhou, NeurIPS 2025)"
)]
struct Cli {
    /// No progress bars or progress lines (errors, warnings and summaries are still printed).
    #[arg(long, short, global = true)]
    quiet: bool,
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
        #[arg(long, allow_negative_numbers = true, value_parser = threads_arg)]
        threads: Option<usize>,
        /// Only parse and validate the spec (no data or model is read), print the resolved spec
        /// and the cells.
        #[arg(long)]
        dry_run: bool,
        /// Continue a killed or interrupted run directory: finished cells are kept, the others
        /// resume from their checkpoints. Refused when the spec (same file and --set), the code
        /// revision or the data differ from the run's.
        #[arg(long, value_name = "RUN_DIR")]
        resume: Option<PathBuf>,
        /// With --resume: continue even when the spec, revision or data differ.
        #[arg(long, requires = "resume")]
        force: bool,
        /// The memory the cells may take, e.g. 8G or 512M (default: what the machine has
        /// available); a run whose estimate is larger is refused before it allocates.
        #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
        max_memory: Option<String>,
        /// The GPU memory a learning policy (generate.device = "cuda") or a reward model whose
        /// features learn (data.device / features.device = "cuda") may take (default: the
        /// device's free memory); their terms are counted there, not in host memory.
        #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
        max_gpu_memory: Option<String>,
        /// Run only slice i of N of the run's cells (cells k with k mod N = i), e.g. one task of
        /// a SLURM array: `--cells $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT`. The slice's
        /// directory keeps its cells' results; `onepass merge` assembles the run from the slices.
        #[arg(long, value_name = "i/N", allow_hyphen_values = true)]
        cells: Option<String>,
    },
    /// Assemble a run from the slice directories of `onepass run --cells i/N` (the same spec and
    /// --set): the run's tables and meta.json are those of a run in one process (no report:
    /// `onepass report RUN_DIR` writes it).
    Merge {
        /// The spec the slices ran.
        spec: PathBuf,
        /// The slice directories (every cell of the run finished in exactly one of them).
        #[arg(required = true)]
        slices: Vec<PathBuf>,
        /// The slices' --set overrides, in the same order.
        #[arg(long = "set", value_name = "KEY=VALUE")]
        overrides: Vec<String>,
        /// Where the run directory goes.
        #[arg(long, default_value = "results")]
        out: PathBuf,
    },
    /// Where each cell of a run or slice directory stands — finished (its last held-out loss and
    /// accuracy, read from its checkpoint before any merge), failed, checkpointed, not started —
    /// from the directory alone: nothing is read beside it, written or locked.
    Cells {
        /// Run or slice directories.
        #[arg(required = true)]
        dirs: Vec<PathBuf>,
        /// One JSON object per directory and its cells instead of the text table.
        #[arg(long)]
        json: bool,
    },
    /// Write <run-dir>/report/: report.md (final metrics, mean ± std over seeds) and figures.
    Report {
        /// The run directory.
        run: PathBuf,
    },
    /// Print the final metrics of several runs side by side (markdown).
    Compare {
        /// Run directories.
        #[arg(required = true)]
        runs: Vec<PathBuf>,
    },
    /// List the estimator names a spec may use (with --long: each with its hyper-parameters,
    /// their defaults and meanings).
    Estimators {
        /// Each estimator's hyper-parameters, defaults and meanings (markdown).
        #[arg(long)]
        long: bool,
    },
    /// Write the reference pages the code defines (spec keys, command line, result tables,
    /// estimators) into a directory, as the book's docs/src/reference/ holds them; exits 2 naming
    /// every key, argument or column that has no doc.
    Reference {
        /// Where the pages go.
        #[arg(long, default_value = "docs/src/reference")]
        out: PathBuf,
    },
    /// Print the CPU's model, the vector features onepass's kernels choose between and the bf16
    /// kernel in use (`ONEPASS_CPU=avx2` caps onepass's kernels at AVX2 + FMA).
    Cpu,
    /// Reward features φ(x, a) from a frozen LLM.
    Features {
        #[command(subcommand)]
        cmd: FeaturesCmd,
    },
}

#[derive(Subcommand)]
enum FeaturesCmd {
    /// φ of both sides of every pair of a dataset, through the feature cache.
    Extract(ExtractArgs),
    /// Merge feature caches (e.g. one per shard of a SLURM array) into one.
    Merge {
        /// The cache to merge into.
        #[arg(long, default_value = ".cache/features")]
        into: PathBuf,
        /// Caches to merge from.
        #[arg(required = true)]
        from: Vec<PathBuf>,
    },
    /// Forward-pass throughput on deterministic random ids (batch × len), as `just bench-features` runs it.
    Bench(BenchArgs),
}

#[derive(Args)]
struct ExtractArgs {
    #[command(flatten)]
    phi: runner::spec::PhiSpec,
    /// HH-RLHF jsonl(.gz) or UltraFeedback-binarized parquet.
    #[arg(long)]
    dataset: PathBuf,
    /// How rows are read (as `[data] format`).
    #[arg(long, value_enum, default_value = "auto")]
    format: runner::spec::Format,
    /// Only the first N pairs.
    #[arg(long, allow_negative_numbers = true, value_parser = runner::spec::phi::count_arg)]
    limit: Option<usize>,
    /// Also write a "bring your own features" parquet (phi_chosen, phi_rejected, label).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Compute part i of N (0 <= i < N) of the global batch plan; merge the caches afterwards.
    #[arg(long, default_value = "0/1")]
    shard: String,
}

#[derive(Args)]
struct BenchArgs {
    /// A .gguf file or a model directory.
    #[arg(long)]
    model: String,
    /// Sequences per forward pass.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 256)]
    len: usize,
    /// Timed passes.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Untimed passes first.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Seed of the random token ids.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// The weights' dtype in the products.
    #[arg(long, value_enum, default_value = "f32")]
    dtype: runner::spec::DType,
    /// Where the model runs.
    #[arg(long, value_enum, default_value = "cpu")]
    device: runner::spec::Device,
    /// Write the token ids (JSON) for the PyTorch side of the benchmark.
    #[arg(long)]
    ids_out: Option<PathBuf>,
    /// Write a Chrome trace (chrome://tracing, ui.perfetto.dev) of the timed passes: one span
    /// per block and per op (qkv, rope, causal_attention, o_proj, gate_up, silu_mul, down, …).
    #[arg(long)]
    trace: Option<PathBuf>,
}

/// An error as one line (long digit runs cut, [`runner::spec::shorten_numbers`]): candle appends a captured backtrace (lines `   0: …`) to its messages
/// when RUST_BACKTRACE is set; the error itself is what the user needs.
fn one_line(msg: &str) -> String {
    let mut out = Vec::new();
    for l in msg.lines() {
        let t = l.trim_start();
        let frame = t.split_once(':').is_some_and(|(n, _)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
        if frame && l.starts_with(' ') {
            break;
        }
        if !t.is_empty() {
            out.push(t.to_string());
        }
    }
    // a 300-digit number from the input is not echoed back in full
    runner::spec::shorten_numbers(&out.join(" "))
}

/// Prints an error as one line and gives exit code 2 (bad input).
/// `--threads N`: a count of threads (a negative number is named as such, not taken for an
/// unknown flag).
fn threads_arg(s: &str) -> Result<usize, String> {
    s.parse().map_err(|_| format!("expected a whole number of threads ≥ 0 (0: one per core), not `{s}`"))
}

fn bad_input(msg: &str) -> ExitCode {
    eprintln!("onepass: {}", one_line(msg));
    ExitCode::from(2)
}

fn features_cmd(cmd: FeaturesCmd, progress: runner::progress::Mode) -> anyhow::Result<()> {
    match cmd {
        FeaturesCmd::Extract(a) => extract_cmd(a, progress),
        FeaturesCmd::Bench(a) => {
            if a.batch == 0 || a.len == 0 || a.reps == 0 {
                anyhow::bail!("--batch, --len and --reps must be at least 1");
            }
            let o = runner::bench::BenchOptions {
                model: a.model,
                batch: a.batch,
                len: a.len,
                reps: a.reps,
                warmup: a.warmup,
                seed: a.seed,
                dtype: runner::world::extract::dtype(a.dtype),
                device: runner::world::extract::device(a.device)?,
                ids_out: a.ids_out,
                trace: a.trace,
            };
            let r = runner::bench::bench(&o)?;
            println!("{}", serde_json::to_string(&r)?);
            Ok(())
        }
        FeaturesCmd::Merge { into, from } => {
            for r in runner::world::extract::merge(&into, &from)? {
                eprintln!(
                    "onepass: {} → {}: {} rows added, {} already there (space {})",
                    r.from,
                    into.display(),
                    r.added,
                    r.already_present,
                    r.space
                );
                println!("{}", serde_json::to_string(&r)?);
            }
            Ok(())
        }
    }
}

fn extract_cmd(a: ExtractArgs, progress: runner::progress::Mode) -> anyhow::Result<()> {
    if let Err((k, m)) = a.phi.check() {
        anyhow::bail!("--{}: {m}", k.replace('_', "-"));
    }
    if a.limit == Some(0) {
        anyhow::bail!("--limit: 0: expected at least 1 pair");
    }
    let o = runner::world::extract::ExtractOptions {
        phi: a.phi,
        dataset: a.dataset,
        format: a.format,
        limit: a.limit,
        out: a.out,
        progress,
        shard: features::ShardSpec::parse(&a.shard)?,
    };
    let s = runner::world::extract::extract(&o)?;
    eprintln!(
        "onepass: {} pairs, {} sequences (shard {}: {}): {} cache hits, {} computed ({} tokens in {:.1} s, {:.0} tok/s); {} degenerate pairs (both sides the same tokens), {} sequences truncated ({} lost response tokens); cache space {}",
        s.pairs,
        s.sequences,
        s.shard,
        s.shard_sequences,
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

/// `onepass reference`: the generated pages, or every undocumented item and exit 2.
fn reference(out: &std::path::Path) -> ExitCode {
    use clap::CommandFactory;
    let cli = runner::reference::cli_page(&Cli::command());
    let pages = runner::reference::pages();
    let (pages, cli) = match (pages, cli) {
        (Ok(p), Ok(c)) => (p, c),
        (p, c) => {
            for m in p.err().into_iter().flatten().chain(c.err().into_iter().flatten()) {
                eprintln!("onepass reference: {m}");
            }
            return ExitCode::from(2);
        }
    };
    let write = |file: &str, text: &str| -> anyhow::Result<()> {
        std::fs::create_dir_all(out)?;
        runner::io::write_atomic(&out.join(file), text.as_bytes())?;
        Ok(())
    };
    for (file, text) in pages.iter().map(|p| (p.file, p.text.as_str())).chain([("cli.md", cli.as_str())]) {
        if let Err(e) = write(file, text) {
            eprintln!("onepass reference: writing {}: {e:#}", out.join(file).display());
            return ExitCode::from(2);
        }
    }
    eprintln!("onepass reference: wrote {} pages to {}", pages.len() + 1, out.display());
    ExitCode::SUCCESS
}

fn main() -> ExitCode {
    // a closed stdout (`onepass run … --dry-run | head -1`) ends the process quietly, as it does
    // other Unix tools, instead of a panic in println! (exit 101)
    // SAFETY: restoring the default disposition of SIGPIPE before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    // a LoRA step's large tensors are reused, not handed back and zeroed again
    kernels::mem::keep_freed_memory();
    let cli = Cli::parse();
    if let Err(e) = runner::io::check_env() {
        return bad_input(&format!("{e:#}"));
    }
    let progress = runner::progress::Mode::for_stderr(cli.quiet);
    dispatch(cli.cmd, progress)
}

/// Runs one subcommand; the exit code says how it ended.
fn dispatch(cmd: Cmd, progress: runner::progress::Mode) -> ExitCode {
    match cmd {
        Cmd::Report { run } => match runner::report::report(&run) {
            Ok(dir) => {
                println!("{}", dir.join("report.md").display());
                ExitCode::SUCCESS
            }
            Err(e) => bad_input(&format!("{e:#}")),
        },
        Cmd::Compare { runs } => match runner::report::compare(&runs) {
            Ok(md) => {
                print!("{md}");
                ExitCode::SUCCESS
            }
            Err(e) => bad_input(&format!("{e:#}")),
        },
        Cmd::Features { cmd } => match features_cmd(cmd, progress) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => bad_input(&format!("{e:#}")),
        },
        Cmd::Cells { dirs, json } => cells_cmd(&dirs, json),
        Cmd::Cpu => {
            println!("{}", features::cpu::summary());
            ExitCode::SUCCESS
        }
        Cmd::Estimators { long } => estimators_cmd(long),
        Cmd::Reference { out } => reference(&out),
        Cmd::Merge { spec, slices, overrides, out } => finish_run(runner::RunOptions {
            spec,
            overrides,
            out,
            threads: None,
            resume: None,
            force: false,
            progress,
            max_memory: None,
            max_gpu_memory: None,
            slice: None,
            merge: slices,
            cap_library_threads: true,
        }),
        Cmd::Run { spec, overrides, out, threads, dry_run, resume, force, max_memory, max_gpu_memory, cells } => {
            let slice = match cells.as_deref().map(features::ShardSpec::parse).transpose() {
                Ok(s) => s,
                Err(e) => return bad_input(&format!("--cells {}", e.to_string().replace("shard ", ""))),
            };
            let max_memory = match max_memory.as_deref().map(runner::budget::parse_size).transpose() {
                Ok(m) => m,
                Err(e) => return bad_input(&format!("--max-memory {e}")),
            };
            let max_gpu_memory = match max_gpu_memory.as_deref().map(runner::budget::parse_size).transpose() {
                Ok(m) => m,
                Err(e) => return bad_input(&format!("--max-gpu-memory {e}")),
            };
            let opts = runner::RunOptions {
                spec,
                overrides,
                out,
                threads,
                resume,
                force,
                progress,
                max_memory,
                max_gpu_memory,
                slice,
                merge: Vec::new(),
                cap_library_threads: true,
            };
            if dry_run {
                return dry_run_cmd(&opts);
            }
            finish_run(opts)
        }
    }
}

/// `onepass cells`: the cells of each run directory, as one table or one JSON line per directory.
fn cells_cmd(dirs: &[PathBuf], json: bool) -> ExitCode {
    let mut all = Vec::new();
    for d in dirs {
        match runner::inspect::cells(d) {
            Ok(s) => all.push(s),
            Err(e) => return bad_input(&format!("{e:#}")),
        }
    }
    if json {
        for s in &all {
            match serde_json::to_string(s) {
                Ok(t) => println!("{t}"),
                Err(e) => return bad_input(&format!("{e:#}")),
            }
        }
    } else {
        print!("{}", runner::inspect::render(&all));
    }
    ExitCode::SUCCESS
}

/// `onepass estimators [--long]`: the names, one a line, or each estimator's reference text.
fn estimators_cmd(long: bool) -> ExitCode {
    if long {
        let mut missing = Vec::new();
        print!("{}", runner::reference::estimators_text(&mut missing, false));
    } else {
        for k in estimators::Kind::ALL {
            println!("{k}");
        }
    }
    ExitCode::SUCCESS
}

/// `onepass run --dry-run`: the resolved spec, one `# cell config seed` line per cell and the
/// plan's notes, with nothing run or written.
fn dry_run_cmd(opts: &runner::RunOptions) -> ExitCode {
    match runner::load_plan(&opts.spec, &opts.overrides) {
        Ok(plan) => {
            // sizes the spec asks for are checked before anything is built
            if let Err(e) = runner::run::dry_run_preflight(opts, &plan) {
                return bad_input(&format!("{e:#}"));
            }
            match runner::plan::record::resolved_text(&plan, &plan.spec) {
                Ok(text) => print!("{text}"),
                Err(e) => return bad_input(&e),
            }
            for c in &plan.cells {
                println!("# {} {} seed {}", c.cell_id, plan.configs[c.config].label, c.seed);
            }
            match runner::run::dry_run_notes(&plan) {
                Ok(notes) => notes.iter().for_each(|n| println!("{n}")),
                Err(e) => return bad_input(&e.to_string()),
            }
            ExitCode::SUCCESS
        }
        Err(e) => bad_input(&e.to_string()),
    }
}

/// Runs (or merges) and prints the run directory; the exit code says how it ended.
fn finish_run(opts: runner::RunOptions) -> ExitCode {
    match runner::run(&opts) {
        Ok(s) => {
            println!("{}", s.dir.display());
            if s.interrupted {
                ExitCode::from(130)
            } else if s.failed > 0 {
                let table = if opts.slice.is_some() { "the merged run's cells.parquet" } else { "cells.parquet" };
                eprintln!("onepass: {} of {} cells failed (see {table})", s.failed, s.cells);
                ExitCode::from(1)
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(e) => bad_input(&format!("{e:#}")),
    }
}
