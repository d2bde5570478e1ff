//! Checkpoints and `onepass run --resume`.
//!
//! A run directory holds, while it runs: `resume.json` (what the run is: the resolved spec, the
//! code revision and digests of its data), `checkpoints/<cell>.ckpt` (a running cell's whole
//! state: estimator, curvature trackers, RNG streams, the stream position as an explicit
//! index, the rows so far) and `checkpoints/<cell>.done` (a finished cell's result). Every file
//! is written to a temporary name and renamed. `meta.json` is written last; once it exists the
//! run is complete and `checkpoints/` is removed.
//!
//! A checkpoint file is `ONEPASS-CKPT-1\n`, the blake3 hash of the payload (32 bytes), then the
//! payload: postcard-encoded (f64 and f32 bit for bit) `(fingerprint, what)` then the body.
//!
//! Failpoints (tests): `ONEPASS_FAILPOINT=<name>:<n>` sends SIGKILL to the process at the n-th
//! time the named point is reached (names: `update`, `checkpoint-write`, `parquet-write`,
//! `cell-end`); `ONEPASS_FAIL_WRITE=<name>` makes the writes at that point fail with ENOSPC
//! (a full disk).

use anyhow::{anyhow, bail, Context, Result};
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

const MAGIC: &[u8] = b"ONEPASS-CKPT-1\n";

/// Returned (as the error of a cell) when SIGINT/SIGTERM stopped it after its checkpoint.
#[derive(Debug)]
pub struct Interrupted;

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "interrupted (checkpoint written)")
    }
}

impl std::error::Error for Interrupted {}

fn stop_flag() -> &'static Arc<AtomicBool> {
    static STOP: OnceLock<Arc<AtomicBool>> = OnceLock::new();
    STOP.get_or_init(|| Arc::new(AtomicBool::new(false)))
}

/// SIGINT and SIGTERM set the stop flag: running cells checkpoint at their next step and stop;
/// a second SIGINT/SIGTERM exits at once (code 130).
pub fn install_signal_handlers() -> Result<()> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    for sig in [SIGINT, SIGTERM] {
        signal_hook::flag::register_conditional_shutdown(sig, 130, stop_flag().clone())
            .context("installing the SIGINT/SIGTERM handler")?;
        signal_hook::flag::register(sig, stop_flag().clone()).context("installing the SIGINT/SIGTERM handler")?;
    }
    Ok(())
}

/// Whether SIGINT/SIGTERM asked the run to stop.
pub fn stop_requested() -> bool {
    stop_flag().load(Ordering::Relaxed)
}

/// A test hook: see the module docs.
pub fn failpoint(name: &str) {
    static POINT: OnceLock<Option<(String, u64)>> = OnceLock::new();
    static HITS: AtomicU64 = AtomicU64::new(0);
    let point = POINT.get_or_init(|| {
        let v = std::env::var("ONEPASS_FAILPOINT").ok()?;
        let (n, at) = v.rsplit_once(':')?;
        Some((n.to_string(), at.parse().ok()?))
    });
    if let Some((n, at)) = point {
        if n == name && HITS.fetch_add(1, Ordering::SeqCst) + 1 == *at {
            eprintln!("onepass: failpoint {name} #{at}: SIGKILL");
            // SAFETY: kill(2) on our own pid; it does not return.
            unsafe {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
        }
    }
}

/// A test hook: `ONEPASS_FAIL_WRITE=<name>` makes every write at that failpoint fail as a
/// full disk does (ENOSPC), to test that the error names the file and leaves nothing half-written.
pub fn injected_write_error(name: &str) -> std::io::Result<()> {
    static POINT: OnceLock<Option<String>> = OnceLock::new();
    match POINT.get_or_init(|| std::env::var("ONEPASS_FAIL_WRITE").ok()) {
        Some(p) if p == name => Err(std::io::Error::from_raw_os_error(libc::ENOSPC)),
        _ => Ok(()),
    }
}

/// What a run is, for refusing a resume of a different one: the resolved spec without the
/// keys that do not change the numbers (`threads`, `[checkpoint]`), the code revision, and
/// digests of the data files the plan read.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunIdentity {
    pub spec: String,
    pub git_revision: String,
    pub git_dirty: bool,
    pub data: Vec<(String, String)>,
}

impl RunIdentity {
    pub fn of(plan: &crate::plan::Plan) -> Result<Self> {
        let mut s = plan.resolved_spec();
        s.threads = 0;
        s.checkpoint = Default::default();
        let mut data = Vec::new();
        if let Some(d) = &plan.data {
            data.push((d.train_path.display().to_string(), d.train.digest.clone()));
            if let Some(p) = &d.eval_path {
                data.push((p.display().to_string(), d.eval.digest.clone()));
            }
            if let Some(o) = &d.order {
                let bytes: Vec<u8> = o.iter().flat_map(|&i| (i as u64).to_le_bytes()).collect();
                data.push(("stream order".into(), blake3::hash(&bytes).to_hex().to_string()));
            }
        }
        if let Some(g) = &plan.generated {
            let mut h = blake3::Hasher::new();
            let mut bytes = Vec::new();
            for c in g.bank.contexts.iter() {
                bytes.clear();
                bytes.extend(c.phi.iter().flat_map(|v| v.to_le_bytes()));
                bytes.extend(c.reward.iter().flatten().flat_map(|v| v.to_le_bytes()));
                h.update(&bytes);
            }
            data.push(("generated responses: φ and oracle rewards".into(), h.finalize().to_hex().to_string()));
        }
        Ok(RunIdentity {
            spec: toml::to_string(&s).context("serialising the resolved spec")?,
            git_revision: env!("ONEPASS_GIT_REV").to_string(),
            git_dirty: env!("ONEPASS_GIT_DIRTY") == "true",
            data,
        })
    }

    pub fn fingerprint(&self) -> String {
        blake3::hash(serde_json::to_string(self).expect("plain JSON").as_bytes()).to_hex().to_string()
    }

    /// Why `self` (this invocation) cannot resume `run` (the run directory's), or None.
    pub fn mismatch(&self, run: &RunIdentity) -> Option<String> {
        if self.spec != run.spec {
            let (a, b): (Vec<&str>, Vec<&str>) = (self.spec.lines().collect(), run.spec.lines().collect());
            let i = (0..a.len().max(b.len())).find(|&i| a.get(i) != b.get(i)).unwrap_or(0);
            return Some(format!(
                "the spec differs from the run's: line {} of the resolved spec is `{}` here, `{}` in the run",
                i + 1,
                a.get(i).unwrap_or(&"(end)"),
                b.get(i).unwrap_or(&"(end)")
            ));
        }
        if self.git_revision != run.git_revision {
            return Some(format!(
                "the code revision differs: this binary is {}, the run was made by {}",
                self.git_revision, run.git_revision
            ));
        }
        if self.data != run.data {
            let diff = self
                .data
                .iter()
                .zip(&run.data)
                .find(|(a, b)| a != b)
                .map(|(a, b)| format!("{} has digest {} here, {} in the run ({})", a.0, a.1, b.1, b.0))
                .unwrap_or_else(|| format!("{} data files here, {} in the run", self.data.len(), run.data.len()));
            return Some(format!("the data differ: {diff}"));
        }
        None
    }
}

/// Encodes a checkpoint file.
pub fn encode<T: Serialize>(fingerprint: &str, what: &str, body: &T) -> Result<Vec<u8>> {
    let mut payload = postcard::to_stdvec(&(fingerprint, what)).context("encoding a checkpoint")?;
    payload.extend(postcard::to_stdvec(body).context("encoding a checkpoint")?);
    let mut out = Vec::with_capacity(MAGIC.len() + 32 + payload.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(blake3::hash(&payload).as_bytes());
    out.extend_from_slice(&payload);
    Ok(out)
}

/// Reads a checkpoint file written for `what`; a fingerprint other than `fingerprint` is an
/// error unless `force`.
pub fn decode<T: DeserializeOwned>(path: &Path, fingerprint: &str, what: &str, force: bool) -> Result<T> {
    let b = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let rest = check(path, &b, fingerprint, what, force)?;
    postcard::from_bytes(rest)
        .map_err(|e| anyhow!("{}: this build cannot read the checkpoint ({e}); {HINT}", path.display()))
}

/// [`decode`]'s checks without reading the body: the header, the hash, whose it is.
pub fn verify(path: &Path, fingerprint: &str, what: &str, force: bool) -> Result<()> {
    let b = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    check(path, &b, fingerprint, what, force).map(|_| ())
}

const HINT: &str = "delete it to start that cell again";

/// Checks a checkpoint file's bytes; returns the body's bytes.
fn check<'a>(path: &Path, b: &'a [u8], fingerprint: &str, what: &str, force: bool) -> Result<&'a [u8]> {
    if !b.starts_with(MAGIC) || b.len() < MAGIC.len() + 32 {
        bail!("{}: not a onepass checkpoint (expected the header {:?}); {HINT}", path.display(), MAGIC);
    }
    let (hash, payload) = b[MAGIC.len()..].split_at(32);
    if blake3::hash(payload).as_bytes() != hash {
        bail!("{}: corrupt checkpoint (its blake3 hash does not match); {HINT}", path.display());
    }
    let ((fp, w), rest): ((String, String), &[u8]) = postcard::take_from_bytes(payload)
        .map_err(|e| anyhow!("{}: this build cannot read the checkpoint ({e}); {HINT}", path.display()))?;
    if w != what {
        bail!("{}: a checkpoint of {w}, expected one of {what}; {HINT}", path.display());
    }
    if fp != fingerprint && !force {
        bail!("{}: written for another spec, code revision or data (pass --force to use it anyway)", path.display());
    }
    Ok(rest)
}

/// Decides when a running cell saves its state, and writes it.
pub struct CellSaver {
    path: Option<PathBuf>,
    fingerprint: String,
    what: String,
    every_s: f64,
    every_steps: u64,
    since: u64,
    last: Instant,
    started: Instant,
    /// Wall seconds the cell ran before this process (resumed cells).
    pub wall_before: f64,
    /// Checkpoints written by this process.
    pub saves: u64,
}

impl CellSaver {
    pub fn new(path: PathBuf, fingerprint: &str, what: &str, spec: &crate::spec::CheckpointSpec) -> Self {
        CellSaver {
            path: Some(path),
            fingerprint: fingerprint.to_string(),
            what: what.to_string(),
            every_s: spec.every_s,
            every_steps: spec.every_steps,
            ..CellSaver::disabled()
        }
    }

    /// Saves nothing (library callers and tests that need no run directory).
    pub fn disabled() -> Self {
        CellSaver {
            path: None,
            fingerprint: String::new(),
            what: String::new(),
            every_s: 0.0,
            every_steps: 0,
            since: 0,
            last: Instant::now(),
            started: Instant::now(),
            wall_before: 0.0,
            saves: 0,
        }
    }

    /// Counts one loop step; true when a checkpoint is due (periodic, or a stop was asked).
    pub fn due(&mut self) -> bool {
        if self.path.is_none() {
            return false;
        }
        self.since += 1;
        stop_requested()
            || (self.every_steps > 0 && self.since >= self.every_steps)
            || (self.every_s > 0.0 && self.last.elapsed().as_secs_f64() >= self.every_s)
    }

    /// Wall seconds of the cell so far, over every process that ran it.
    pub fn wall_s(&self) -> f64 {
        self.wall_before + self.started.elapsed().as_secs_f64()
    }

    /// Writes the checkpoint; then, if a stop was asked, returns [`Interrupted`].
    pub fn save<T: Serialize>(&mut self, body: &T) -> Result<()> {
        let Some(path) = &self.path else { return Ok(()) };
        let bytes = encode(&self.fingerprint, &self.what, body)?;
        crate::results::write_atomic_at(path, &bytes, "checkpoint-write")?;
        self.saves += 1;
        self.since = 0;
        self.last = Instant::now();
        if stop_requested() {
            return Err(Interrupted.into());
        }
        Ok(())
    }
}

/// Removes what a killed process may have left half-written (`*.tmp`) in a run directory.
pub fn remove_temporaries(dir: &Path) -> Result<usize> {
    let mut n = 0;
    for sub in [dir.to_path_buf(), dir.join("theta"), dir.join("checkpoints")] {
        let Ok(rd) = std::fs::read_dir(&sub) else { continue };
        for e in rd.flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "tmp") {
                std::fs::remove_file(&p).with_context(|| format!("removing {}", p.display()))?;
                n += 1;
            }
        }
    }
    Ok(n)
}
