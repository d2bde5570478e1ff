//! The options of `onepass run`, how a run ended, and the command that continues it.

use std::path::{Path, PathBuf};

/// How a run ended, for the exit code: 0 all cells ok, 1 some cell failed (2 is bad input,
/// reported as an error before any cell runs; 130 interrupted by SIGINT/SIGTERM after the
/// running cells wrote their checkpoints).
#[derive(Debug)]
pub struct RunSummary {
    pub dir: PathBuf,
    pub failed: usize,
    pub cells: usize,
    /// Stopped by SIGINT/SIGTERM: nothing final was written; `--resume` continues.
    pub interrupted: bool,
}

/// Options of `onepass run`.
pub struct RunOptions {
    pub spec: PathBuf,
    pub overrides: Vec<String>,
    pub out: PathBuf,
    pub threads: Option<usize>,
    /// Continue this run directory (its finished cells are kept, checkpointed cells resume).
    pub resume: Option<PathBuf>,
    /// Resume even when the spec, code revision or data differ from the run's.
    pub force: bool,
    /// How the long stages report on stderr (bars, log lines, nothing).
    pub progress: crate::progress::Mode,
    /// The memory the cells may take (default: the machine's MemAvailable).
    pub max_memory: Option<u64>,
    /// The accelerator memory a policy on it may take (default: the device's free memory).
    pub max_gpu_memory: Option<u64>,
    /// `--cells i/N`: only the plan's cells k with k mod N = i, into a slice directory that
    /// keeps their results (no tables) for `onepass merge` — one task of a SLURM array.
    pub slice: Option<features::ShardSpec>,
    /// `onepass merge`: the slice directories whose finished cells make this run.
    pub merge: Vec<PathBuf>,
    /// Bound candle's own threads by the run's too ([`cap_library_threads`]): the binary sets
    /// it; a library caller, whose other threads may read the environment meanwhile, does not.
    pub cap_library_threads: bool,
}

/// A word as a POSIX shell reads it back: as is when it holds only characters the shell leaves
/// alone, else in single quotes (a quote inside written '\'').
pub(super) fn shell_word(w: &str) -> String {
    let plain = !w.is_empty() && w.chars().all(|c| c.is_ascii_alphanumeric() || "_./=:,+-@%".contains(c));
    if plain {
        w.to_string()
    } else {
        format!("'{}'", w.replace('\'', "'\\''"))
    }
}

/// The command that continues the run in `dir`: the spec and every `--set` of this one (a
/// resume is refused without them), then `--resume`.
pub(super) fn resume_command(opts: &RunOptions, dir: &Path) -> String {
    let mut words = vec!["onepass".to_string(), "run".into(), shell_word(&opts.spec.display().to_string())];
    for o in &opts.overrides {
        words.push("--set".into());
        words.push(shell_word(o));
    }
    if let Some(sl) = opts.slice {
        words.push("--cells".into());
        words.push(format!("{}/{}", sl.index, sl.count));
    }
    words.push("--resume".into());
    words.push(shell_word(&dir.display().to_string()));
    words.join(" ")
}
