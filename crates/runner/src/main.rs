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
