//! The runner's ground floor: atomic file writes, `.npy` files, the checkpoint file format,
//! SIGINT/SIGTERM handling and the failpoints the resume tests use. Nothing here knows a spec,
//! a plan or a cell.
//!
//! A checkpoint file is `ONEPASS-CKPT-1\n`, the blake3 hash of the payload (32 bytes), then the
//! payload: postcard-encoded (f64 and f32 bit for bit) `(fingerprint, what)` then the body.
//!
//! Failpoints (tests): `ONEPASS_FAILPOINT=<name>:<n>` sends SIGKILL to the process at the n-th
//! time the named point is reached (names: `update`, `checkpoint-write`, `parquet-write`,
//! `adapter-write`, `cell-end`, `meta-written`, and the online loop's `policy-update` — a warm
//! start's or a chunk's — and `evaluate`); `ONEPASS_FAIL_WRITE=<name>` makes the writes at that
//! point fail with ENOSPC (a full disk; `feature-cache` for `features`' cache shards).

use anyhow::{anyhow, bail, Context, Result};
use serde::{de::DeserializeOwned, Serialize};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

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

/// A write into the run directory failed (a full disk, an I/O error, a read-only file system).
/// Not a cell's failure: the run stops, keeps every checkpoint and finished cell, and stays
/// resumable.
#[derive(Debug)]
pub struct StorageError {
    pub path: PathBuf,
    pub source: std::io::Error,
}

impl std::fmt::Display for StorageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // the cause follows through `source` (anyhow's chain prints it)
        write!(f, "writing {}", self.path.display())
    }
}

impl std::error::Error for StorageError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

/// Whether `e` (or an error it wraps) is a [`StorageError`], or a cache write of `features`
/// that failed ([`features::Error::Storage`]: φ of a learning policy's new responses is
/// cached mid-run).
pub fn is_storage(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.is::<StorageError>() || matches!(c.downcast_ref(), Some(features::Error::Storage { .. })))
}

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

/// The failpoints `ONEPASS_FAILPOINT` may name (module docs).
pub const FAILPOINTS: &[&str] = &[
    "update",
    "cell-end",
    "meta-written",
    "policy-update",
    "evaluate",
    "write",
    "checkpoint-write",
    "parquet-write",
    "adapter-write",
];

/// The write points `ONEPASS_FAIL_WRITE` may name (module docs; `feature-cache` is the features
/// crate's).
pub const FAIL_WRITES: &[&str] = &["write", "checkpoint-write", "parquet-write", "adapter-write", "feature-cache"];

/// The environment's onepass variables, checked before anything runs: a value the code would
/// silently ignore (a misspelt `ONEPASS_CPU`, or a test hook naming no point, which would let
/// a test pass without injecting its failure) is an error naming the variable and what it takes.
pub fn check_env() -> Result<()> {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    if let Some(v) = var("ONEPASS_CPU") {
        if !v.eq_ignore_ascii_case("avx2") {
            bail!("ONEPASS_CPU={v}: expected avx2 (cap onepass's kernels at AVX2 + FMA) or unset");
        }
    }
    if let Some(v) = var("ONEPASS_FAILPOINT") {
        let ok = v
            .rsplit_once(':')
            .is_some_and(|(n, at)| FAILPOINTS.contains(&n) && at.parse::<u64>().is_ok_and(|a| a >= 1));
        if !ok {
            bail!("ONEPASS_FAILPOINT={v}: expected <name>:<n ≥ 1>, the name one of {}", FAILPOINTS.join(", "));
        }
    }
    if let Some(v) = var("ONEPASS_FAIL_WRITE") {
        if !FAIL_WRITES.contains(&v.as_str()) {
            bail!("ONEPASS_FAIL_WRITE={v}: expected one of {}", FAIL_WRITES.join(", "));
        }
    }
    Ok(())
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
    decode_unless_stale(path, fingerprint, what, force)?
        .ok_or_else(|| anyhow!("{}: written for another config of this cell; {HINT}", path.display()))
}

/// [`decode`], except that with `force` a checkpoint of the same cell written for another
/// config (its `what` names the cell, then a digest of its config) is None: the cell restarts.
pub fn decode_unless_stale<T: DeserializeOwned>(
    path: &Path,
    fingerprint: &str,
    what: &str,
    force: bool,
) -> Result<Option<T>> {
    let b = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    match check(path, &b, fingerprint, what, force)? {
        None => Ok(None),
        Some(rest) => postcard::from_bytes(rest)
            .map(Some)
            .map_err(|e| anyhow!("{}: this build cannot read the checkpoint ({e}); {HINT}", path.display())),
    }
}

/// [`decode`]'s checks without reading the body: the header, the hash, whose it is.
pub fn verify(path: &Path, fingerprint: &str, what: &str, force: bool) -> Result<()> {
    let b = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    check(path, &b, fingerprint, what, force).map(|_| ())
}

const HINT: &str = "delete it to start that cell again";

/// Checks a checkpoint file's bytes; returns the body's bytes, or None for a stale one (see
/// [`decode_unless_stale`]).
fn check<'a>(path: &Path, b: &'a [u8], fingerprint: &str, what: &str, force: bool) -> Result<Option<&'a [u8]>> {
    let (fp, w, rest) = open(path, b)?;
    // `what` is "cell <id> (<config digest>)": the same cell under another config is stale
    let cell = |s: &str| s.split(" (").next().unwrap_or_default().to_string();
    if w != what && force && cell(&w) == cell(what) {
        return Ok(None);
    }
    if w != what {
        bail!("{}: a checkpoint of {w}, expected one of {what}; {HINT}", path.display());
    }
    if fp != fingerprint && !force {
        bail!("{}: written for another spec, code revision or data (pass --force to use it anyway)", path.display());
    }
    Ok(Some(rest))
}

/// A checkpoint file's header checked (magic, blake3 hash): its fingerprint, its `what` and
/// the body's bytes.
fn open<'a>(path: &Path, b: &'a [u8]) -> Result<(String, String, &'a [u8])> {
    if !b.starts_with(MAGIC) || b.len() < MAGIC.len() + 32 {
        bail!(
            "{}: not a onepass checkpoint (expected the header `{}`); {HINT}",
            path.display(),
            String::from_utf8_lossy(MAGIC).trim_end()
        );
    }
    let (hash, payload) = b[MAGIC.len()..].split_at(32);
    if blake3::hash(payload).as_bytes() != hash {
        bail!("{}: corrupt checkpoint (its blake3 hash does not match); {HINT}", path.display());
    }
    let ((fp, w), rest): ((String, String), &[u8]) = postcard::take_from_bytes(payload)
        .map_err(|e| anyhow!("{}: this build cannot read the checkpoint ({e}); {HINT}", path.display()))?;
    Ok((fp, w, rest))
}

/// Reads a checkpoint file for looking at, not for resuming: its header and hash are checked,
/// not whose it is. Returns its `what` ("cell <id> (<config digest>)") and body.
pub fn read_any<T: DeserializeOwned>(path: &Path) -> Result<(String, T)> {
    let b = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let (_, what, rest) = open(path, &b)?;
    let body = postcard::from_bytes(rest)
        .map_err(|e| anyhow!("{}: this build cannot read the checkpoint ({e})", path.display()))?;
    Ok((what, body))
}

/// An exclusive `flock` on `<dir>/.lock`, held while the value lives: one writer per run
/// directory (two `--resume` of one run renamed each other's temporary files and lost cells).
/// The kernel releases it when the process ends, however it ends.
pub struct DirLock {
    _file: std::fs::File,
}

/// Takes the lock of a run directory, or says which process holds it.
pub fn lock_dir(dir: &Path) -> Result<DirLock> {
    use std::io::{Read, Seek, Write};
    use std::os::unix::io::AsRawFd;
    let path = dir.join(".lock");
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    // SAFETY: flock(2) on a descriptor we own.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let mut holder = String::new();
        let _ = f.read_to_string(&mut holder);
        bail!(
            "{} is in use by another onepass process ({}); wait for it to finish or stop it first",
            dir.display(),
            holder.split_whitespace().take(2).collect::<Vec<_>>().join(" ")
        );
    }
    f.set_len(0).and_then(|_| f.rewind()).with_context(|| format!("writing {}", path.display()))?;
    writeln!(f, "pid {}", std::process::id()).with_context(|| format!("writing {}", path.display()))?;
    Ok(DirLock { _file: f })
}

/// Refuses a run directory another process holds, without creating anything: a reader that
/// must not leave a lock file behind (a `report` of a directory that is not a run) asks this
/// before its own checks, so a running run is named as such rather than as one without tables.
pub fn refuse_if_locked(dir: &Path) -> Result<()> {
    use std::io::Read;
    use std::os::unix::io::AsRawFd;
    let path = dir.join(".lock");
    let Ok(mut f) = std::fs::File::open(&path) else { return Ok(()) };
    // SAFETY: flock(2) on a descriptor we own; a shared probe, released at once
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) } != 0 {
        let mut holder = String::new();
        let _ = f.read_to_string(&mut holder);
        bail!(
            "{} is in use by another onepass process ({}); wait for it to finish or stop it first",
            dir.display(),
            holder.split_whitespace().take(2).collect::<Vec<_>>().join(" ")
        );
    }
    // SAFETY: as above
    unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_UN) };
    Ok(())
}

/// Removes what a killed process may have left half-written (`*.tmp`) in a run directory.
pub fn remove_temporaries(dir: &Path) -> Result<usize> {
    let mut n = 0;
    for sub in [dir.to_path_buf(), dir.join("theta"), dir.join("checkpoints")] {
        let Ok(rd) = std::fs::read_dir(&sub) else { continue };
        for e in rd.flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "tmp") && p.is_file() {
                std::fs::remove_file(&p).with_context(|| format!("removing {}", p.display()))?;
                n += 1;
            }
        }
    }
    Ok(n)
}

/// An I/O error on `path` as a message; for a file not found, with [`where_missing`].
pub fn io_message(path: &Path, e: &std::io::Error) -> String {
    let hint = if e.kind() == std::io::ErrorKind::NotFound { where_missing(path) } else { String::new() };
    format!("{e}{hint}")
}

/// For a relative path that was not found: " (looked for in DIR; …)", the directory it was
/// looked for in (a spec's paths are relative to where onepass runs, and a `spec.resolved.toml`
/// re-run from elsewhere misses them); nothing for an absolute path.
pub fn where_missing(path: &Path) -> String {
    match std::env::current_dir() {
        Ok(cwd) if path.is_relative() => {
            format!(" (looked for in {}; relative paths are relative to the directory onepass runs in)", cwd.display())
        }
        _ => String::new(),
    }
}

/// Writes `bytes` to `path` through `path.tmp` (flushed to disk) and a rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_at(path, bytes, "write")
}

/// [`write_atomic`] with a named failpoint half-way through the temporary file.
pub fn write_atomic_at(path: &Path, bytes: &[u8], point: &str) -> Result<()> {
    use std::io::Write;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        let (a, b) = bytes.split_at(bytes.len() / 2);
        f.write_all(a)?;
        f.flush()?;
        failpoint(point);
        injected_write_error(point)?;
        f.write_all(b)?;
        f.sync_all()
    };
    if let Err(source) = write() {
        let _ = std::fs::remove_file(&tmp);
        return Err(StorageError { path: path.to_path_buf(), source }.into());
    }
    if let Err(source) = std::fs::rename(&tmp, path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(StorageError { path: path.to_path_buf(), source }.into());
    }
    Ok(())
}

/// A 1-D little-endian f64 array in NPY format 1.0.
pub fn npy_f64(v: &[f64]) -> Vec<u8> {
    let mut header = format!("{{'descr': '<f8', 'fortran_order': False, 'shape': ({},), }}", v.len());
    // magic (6) + version (2) + header length (2) + header, padded with spaces to a multiple of 64, ending in \n
    let total = 10 + header.len() + 1;
    header.push_str(&" ".repeat((64 - total % 64) % 64));
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len() + v.len() * 8);
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    for x in v {
        out.extend_from_slice(&x.to_le_bytes());
    }
    out
}

/// Reads what [`npy_f64`] wrote (a 1-D `<f8` array); other files are errors naming the file.
pub fn read_npy_f64(path: &Path) -> Result<Vec<f64>> {
    let b = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    if !b.starts_with(b"\x93NUMPY\x01\x00") || b.len() < 10 {
        anyhow::bail!("{}: not a version-1 .npy file", path.display());
    }
    let hlen = u16::from_le_bytes([b[8], b[9]]) as usize;
    let header = String::from_utf8_lossy(b.get(10..10 + hlen).unwrap_or_default());
    if !header.contains("'descr': '<f8'") {
        anyhow::bail!("{}: expected float64 ('<f8'), header {}", path.display(), header.trim());
    }
    let data = &b[(10 + hlen).min(b.len())..];
    if data.len() % 8 != 0 {
        anyhow::bail!("{}: truncated data", path.display());
    }
    Ok(data.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes"))).collect())
}
