//! Nothing lost: runs killed with SIGKILL at chosen failpoints (during an update, a checkpoint
//! write, a parquet write, between cells) and at random times, or stopped with SIGTERM, then
//! continued with `onepass run --resume`, write the same metrics.parquet, steps.parquet,
//! cells.parquet and θ bytes as an uninterrupted run. A resume of another spec, revision or
//! data is refused; a corrupt checkpoint is named.

use rand::{Rng, SeedableRng};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

mod util;

const BIN: &str = env!("CARGO_BIN_EXE_onepass");

/// Every estimator kind on the synthetic bandit, steps recorded.
const PASSIVE: &str = r#"
setting = "passive"
seeds = 2
[env]
dim = 5
contexts = 12
arms = 3
eval_pairs = 100
[stream]
samples = 240
batch_size = 3
eval_every = 60
record_steps = true
[checkpoint]
every_steps = 7
[[estimator]]
kind = "omd-exact"
radius = 1.0
[[estimator]]
kind = "omd-hvp-cg"
lr = 0.5
[[estimator]]
kind = "omd-reference"
lr = 0.5
[[estimator]]
kind = "sgd"
lr = 0.5
clip = 1.0
[[estimator]]
kind = "adam"
lr = 0.05
[[estimator]]
kind = "adam-reference"
lr = 0.05
[[estimator]]
kind = "omd-hvp-cg+adam"
lr = 0.05
[[estimator]]
kind = "sgd-replay"
lr = 0.5
replay_every = 20
[[estimator]]
kind = "mle"
refit_every = 5
"#;

const ACTIVE: &str = r#"
setting = "active"
seeds = 2
[env]
dim = 5
contexts = 12
arms = 3
eval_pairs = 100
[stream]
samples = 120
batch_size = 2
eval_every = 40
[active]
rule = ["stream", "pool-argmax", "random"]
pool = 300
candidates = 10
keep = 2
score_norm = "v"
[checkpoint]
every_steps = 5
[[estimator]]
kind = "omd-exact"
[[estimator]]
kind = "sgd-replay"
lr = 0.5
replay_every = 10
"#;

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn cmd(dir: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.current_dir(dir).args(args).env_remove("ONEPASS_FAILPOINT");
    c
}

struct Out {
    code: Option<i32>,
    signal: Option<i32>,
    stdout: String,
    stderr: String,
}

fn output(mut c: Command) -> Out {
    let o = c.output().unwrap();
    Out {
        code: o.status.code(),
        signal: o.status.signal(),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    }
}

/// The run directory a killed run made under `out` (it printed nothing on stdout).
fn only_dir(out: &Path) -> PathBuf {
    let dirs: Vec<PathBuf> = std::fs::read_dir(out).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(dirs.len(), 1, "{dirs:?}");
    dirs[0].clone()
}

/// Every file that must not depend on interruptions (timings.parquet and meta.json do).
fn fingerprint_files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for f in ["metrics.parquet", "cells.parquet", "steps.parquet", "rounds.parquet", "spec.resolved.toml"] {
        if let Ok(b) = std::fs::read(dir.join(f)) {
            out.push((f.to_string(), b));
        }
    }
    let mut thetas: Vec<PathBuf> = std::fs::read_dir(dir.join("theta")).unwrap().map(|e| e.unwrap().path()).collect();
    thetas.sort();
    for t in thetas {
        out.push((t.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(&t).unwrap()));
    }
    assert!(out.iter().any(|(f, _)| f == "metrics.parquet"), "no metrics.parquet in {}", dir.display());
    out
}

fn assert_same(a: &Path, b: &Path, what: &str) {
    let (fa, fb) = (fingerprint_files(a), fingerprint_files(b));
    assert_eq!(fa.iter().map(|f| &f.0).collect::<Vec<_>>(), fb.iter().map(|f| &f.0).collect::<Vec<_>>(), "{what}");
    for ((name, x), (_, y)) in fa.iter().zip(&fb) {
        assert!(x == y, "{what}: {name} differs from the uninterrupted run's");
    }
    assert!(!b.join("checkpoints").exists(), "{what}: checkpoints/ left after completion");
    let tmp = std::fs::read_dir(b).unwrap().chain(std::fs::read_dir(b.join("theta")).unwrap());
    assert!(!tmp.into_iter().any(|e| e.unwrap().path().extension().is_some_and(|x| x == "tmp")), "{what}: .tmp left");
}

/// The uninterrupted run of `spec` (extra `--set`s included).
fn reference(tmp: &Path, spec: &Path, sets: &[&str]) -> PathBuf {
    let mut args = vec!["run", spec.to_str().unwrap(), "--out", "ref", "--threads", "1"];
    args.extend_from_slice(sets);
    let r = output(cmd(tmp, &args));
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    tmp.join(r.stdout.trim().lines().last().unwrap())
}

/// Runs `spec` with SIGKILL at `failpoint`, then resumes it; returns the completed directory.
fn kill_then_resume(tmp: &Path, spec: &Path, sets: &[&str], failpoint: &str, out: &str) -> PathBuf {
    let mut args = vec!["run", spec.to_str().unwrap(), "--out", out, "--threads", "1"];
    args.extend_from_slice(sets);
    let mut c = cmd(tmp, &args);
    c.env("ONEPASS_FAILPOINT", failpoint);
    let r = output(c);
    assert_eq!(r.signal, Some(9), "{failpoint}: expected SIGKILL, got {:?}: {}", r.code, r.stderr);
    assert!(r.stderr.contains(&format!("failpoint {}", failpoint.replace(':', " #"))), "{}", r.stderr);
    let dir = only_dir(&tmp.join(out));
    // killed after meta.json: the run is complete, only checkpoints/ is left to remove
    let complete = failpoint.starts_with("meta-written");
    assert_eq!(dir.join("meta.json").exists(), complete, "{failpoint}: meta.json is the last thing written");
    let mut args = vec!["run", spec.to_str().unwrap(), "--resume", dir.to_str().unwrap(), "--threads", "1"];
    args.extend_from_slice(sets);
    let r = output(cmd(tmp, &args));
    assert_eq!(r.code, Some(0), "{failpoint}: resume failed: {}", r.stderr);
    assert!(r.stderr.contains(if complete { "is complete" } else { "(resumed)" }), "{}", r.stderr);
    dir
}

#[test]
fn killed_at_failpoints_then_resumed_gives_the_same_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let passive = write(tmp, "passive.toml", PASSIVE);
    let want = reference(tmp, &passive, &[]);
    // 18 cells × 80 updates: kills in the first cell, mid-sweep, in the last cell; during a
    // checkpoint write; during the final parquet writes; right after a cell finished; between
    // meta.json and the removal of checkpoints/
    for (i, fp) in [
        "update:3",
        "update:700",
        "update:1430",
        "checkpoint-write:40",
        "parquet-write:1",
        "parquet-write:3",
        "cell-end:5",
        // after meta.json, before checkpoints/ is removed: the resume finds a complete run
        // and must still clean up
        "meta-written:1",
    ]
    .iter()
    .enumerate()
    {
        let got = kill_then_resume(tmp, &passive, &[], fp, &format!("p{i}"));
        assert_same(&want, &got, &format!("passive, SIGKILL at {fp}"));
    }
    for (name, text, fps) in [
        ("active.toml", ACTIVE, ["update:150", "cell-end:3"]),
        ("deploy.toml", util::SYNTHETIC_DEPLOY, ["update:200", "checkpoint-write:9"]),
    ] {
        let spec = write(tmp, name, text);
        let want = reference(tmp, &spec, &[]);
        for (i, fp) in fps.iter().enumerate() {
            let got = kill_then_resume(tmp, &spec, &[], fp, &format!("{name}-{i}"));
            assert_same(&want, &got, &format!("{name}, SIGKILL at {fp}"));
        }
    }
}

/// A corrupt checkpoint, or another cell's, is named and refused (exit 2, no panic); deleting
/// it starts that cell again, with the same bytes in the end.
#[test]
fn a_corrupt_or_foreign_checkpoint_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let spec = write(tmp, "p.toml", &PASSIVE.replace("seeds = 2", "seeds = 1"));
    let want = reference(tmp, &spec, &[]);
    // two cells checkpointed when the kill comes: both workers must have run 7 updates within
    // the first 60 (well under a millisecond), which a loaded machine may not schedule — so up
    // to five tries, each in a directory of its own
    let (dir, ckpts) = (0..5)
        .map(|k| {
            let out = format!("k{k}");
            let mut c = cmd(tmp, &["run", spec.to_str().unwrap(), "--out", &out, "--threads", "2"]);
            c.env("ONEPASS_FAILPOINT", "update:60");
            assert_eq!(output(c).signal, Some(9));
            let dir = only_dir(&tmp.join(&out));
            let ckpts: Vec<PathBuf> = std::fs::read_dir(dir.join("checkpoints"))
                .unwrap()
                .map(|e| e.unwrap().path())
                .filter(|p| p.extension().is_some_and(|x| x == "ckpt"))
                .collect();
            (dir, ckpts)
        })
        .find(|(_, c)| c.len() == 2)
        .expect("in five tries, never two cells running with a checkpoint each at the kill");
    let (a, b) = (&ckpts[0], &ckpts[1]);
    let resume = || output(cmd(tmp, &["run", spec.to_str().unwrap(), "--resume", dir.to_str().unwrap()]));
    let orig = std::fs::read(a).unwrap();
    let other = std::fs::read(b).unwrap();
    // one flipped bit
    let mut bad = orig.clone();
    let last = bad.len() - 1;
    bad[last] ^= 1;
    std::fs::write(a, &bad).unwrap();
    let r = resume();
    assert_eq!(r.code, Some(2), "{}", r.stderr);
    let name = a.file_name().unwrap().to_str().unwrap();
    assert!(r.stderr.contains(name) && r.stderr.contains("corrupt checkpoint"), "{}", r.stderr);
    assert!(!r.stderr.contains("panicked"));
    // another cell's checkpoint under this cell's name
    std::fs::write(a, &other).unwrap();
    let r = resume();
    assert_eq!(r.code, Some(2), "{}", r.stderr);
    assert!(r.stderr.contains(name) && r.stderr.contains("a checkpoint of cell"), "{}", r.stderr);
    // not a checkpoint at all
    std::fs::write(a, b"hello").unwrap();
    let r = resume();
    assert_eq!(r.code, Some(2), "{}", r.stderr);
    assert!(r.stderr.contains("not a onepass checkpoint"), "{}", r.stderr);
    // deleted: that cell starts again
    std::fs::remove_file(a).unwrap();
    let r = resume();
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert_same(&want, &dir, "restarted cell");
}

#[test]
fn killed_at_random_times_in_a_loop_then_resumed() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let spec = write(tmp, "p.toml", &PASSIVE.replace("every_steps = 7", "every_steps = 2"));
    let want = reference(tmp, &spec, &[]);
    // how long the run takes as the loop runs it (2 threads): the faster of two runs, so that a
    // load spike during the timing does not put every kill after the run's end
    let full = (0..2)
        .map(|i| {
            let t0 = std::time::Instant::now();
            let out = format!("timing{i}");
            let r = output(cmd(tmp, &["run", spec.to_str().unwrap(), "--out", &out, "--threads", "2"]));
            assert_eq!(r.code, Some(0), "{}", r.stderr);
            t0.elapsed().as_secs_f64()
        })
        .fold(f64::MAX, f64::min)
        .max(0.02);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    for round in 0..3 {
        // a round whose first attempt outran its kill (the machine was faster than when timed)
        // proves nothing: it is run again with the kill times halved, up to 4 tries
        let mut scale = full;
        let (d, kills) = (0..4)
            .map(|tryno| {
                let (d, kills) = killed_loop(tmp, &spec, &format!("r{round}-{tryno}"), scale, &mut rng, round);
                scale /= 2.0;
                (d, kills)
            })
            .find(|(_, kills)| *kills >= 1)
            .unwrap_or_else(|| panic!("round {round}: the run was never killed in 4 tries"));
        eprintln!("round {round}: {kills} SIGKILLs before it finished");
        assert_same(&want, &d, &format!("round {round}: {kills} random SIGKILLs"));
    }
}

/// One round of [`killed_at_random_times_in_a_loop_then_resumed`]: the run started into `out`,
/// killed at random times up to 0.8 × `full` seconds into each attempt and resumed, until it
/// finishes; its directory and the kill count.
fn killed_loop(
    tmp: &Path,
    spec: &Path,
    out: &str,
    full: f64,
    rng: &mut rand_chacha::ChaCha8Rng,
    round: usize,
) -> (PathBuf, usize) {
    let mut dir: Option<PathBuf> = None;
    let mut kills = 0;
    for attempt in 0..40 {
        let mut args = vec!["run".to_string(), spec.to_str().unwrap().into(), "--threads".into(), "2".into()];
        match &dir {
            None => args.extend(["--out".into(), out.to_string()]),
            Some(d) => args.extend(["--resume".into(), d.to_string_lossy().into_owned()]),
        }
        let mut child = cmd(tmp, &args.iter().map(String::as_str).collect::<Vec<_>>())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // kill somewhere in the run (the last attempts run to the end)
        let wait = if attempt < 30 { rng.random_range(0.02..0.8) * full } else { 1e9 };
        let deadline = std::time::Instant::now() + Duration::from_secs_f64(wait.min(600.0));
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if std::time::Instant::now() >= deadline {
                child.kill().unwrap();
                kills += 1;
                break child.wait().unwrap();
            }
            std::thread::sleep(Duration::from_millis(2));
        };
        if dir.is_none() && tmp.join(out).exists() {
            if let Some(e) = std::fs::read_dir(tmp.join(out)).unwrap().next() {
                dir = Some(e.unwrap().path());
            }
        }
        if status.code() == Some(0) {
            break;
        }
        assert_eq!(status.signal(), Some(9), "round {round}: {status:?}");
    }
    let d = dir.expect("a run directory");
    assert!(d.join("meta.json").exists(), "round {round}: never finished");
    (d, kills)
}

#[test]
fn sigterm_checkpoints_and_exits_130() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    // long enough to be running when the signal comes; only time-based checkpoints (none)
    let text = PASSIVE.replace("every_steps = 7", "every_s = 0").replace("samples = 240", "samples = 6000");
    let text = text.replace("eval_every = 60", "eval_every = 6000");
    let spec = write(tmp, "p.toml", &text);
    let want = reference(tmp, &spec, &[]);
    let child = cmd(tmp, &["run", spec.to_str().unwrap(), "--out", "t", "--threads", "2"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: kill(2) on a child we spawned.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let o = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    let dir = only_dir(&tmp.join("t"));
    if o.status.code() == Some(0) {
        eprintln!("the run finished before SIGTERM; nothing to check");
        return;
    }
    assert_eq!(o.status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("--resume"), "{stderr}");
    assert!(!dir.join("metrics.parquet").exists() && !dir.join("meta.json").exists());
    let ckpts = std::fs::read_dir(dir.join("checkpoints")).unwrap().count();
    assert!(ckpts >= 1, "SIGTERM wrote no checkpoint");
    let r = output(cmd(tmp, &["run", spec.to_str().unwrap(), "--resume", dir.to_str().unwrap()]));
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert_same(&want, &dir, "SIGTERM then resume");
}

#[test]
fn resume_refuses_another_spec_revision_or_data() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let spec = write(tmp, "p.toml", PASSIVE);
    let mut c = cmd(tmp, &["run", spec.to_str().unwrap(), "--out", "k", "--threads", "1"]);
    c.env("ONEPASS_FAILPOINT", "update:100");
    assert_eq!(output(c).signal, Some(9));
    let dir = only_dir(&tmp.join("k"));
    let d = dir.to_str().unwrap();
    let s = spec.to_str().unwrap();
    let refused = |args: &[&str], needle: &str| {
        let r = output(cmd(tmp, args));
        assert_eq!(r.code, Some(2), "{args:?}: {}", r.stderr);
        let line = r.stderr.trim();
        assert!(line.contains("refused") && line.contains(needle) && line.contains(d), "{args:?}: {line}");
        assert!(line.contains("--force"), "{line}");
        assert!(!line.contains("panicked"));
    };
    // another spec: an override, or an edited file
    refused(&["run", s, "--resume", d, "--set", "stream.samples=120"], "samples = 120");
    let edited = write(tmp, "edited.toml", &PASSIVE.replace("lr = 0.05", "lr = 0.06"));
    refused(&["run", edited.to_str().unwrap(), "--resume", d], "the spec differs");
    // another code revision
    let manifest = dir.join("resume.json");
    let orig = std::fs::read_to_string(&manifest).unwrap();
    let mut m: serde_json::Value = serde_json::from_str(&orig).unwrap();
    m["git_revision"] = "0000000000000000000000000000000000000000".into();
    std::fs::write(&manifest, m.to_string()).unwrap();
    refused(&["run", s, "--resume", d], "code revision differs");
    // checkpoints and results of the first run are untouched by the refusals
    std::fs::write(&manifest, &orig).unwrap();
    // checkpoint settings are not part of the identity
    let r = output(cmd(tmp, &["run", s, "--resume", d, "--set", "checkpoint.every_steps=3"]));
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    // not a run directory
    let r = output(cmd(tmp, &["run", s, "--resume", tmp.to_str().unwrap()]));
    assert_eq!(r.code, Some(2));
    assert!(r.stderr.contains("resume.json"), "{}", r.stderr);
}

/// Pairs from a features file: the data digest is part of the identity; --force overrides.
#[test]
fn resume_refuses_changed_data_unless_forced() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let d = 4;
    let write_pairs = |seed: u64| {
        use arrow_array::builder::{Float32Builder, ListBuilder};
        use arrow_array::{ArrayRef, RecordBatch};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut list = || -> ArrayRef {
            let mut b = ListBuilder::new(Float32Builder::new());
            for _ in 0..60 {
                for _ in 0..d {
                    b.values().append_value(rng.random_range(-1.0..1.0f32));
                }
                b.append(true);
            }
            std::sync::Arc::new(b.finish())
        };
        let (ch, rj) = (list(), list());
        let batch = RecordBatch::try_from_iter([("phi_chosen", ch), ("phi_rejected", rj)]).unwrap();
        let f = std::fs::File::create(tmp.join("pairs.parquet")).unwrap();
        let mut w = parquet::arrow::ArrowWriter::try_new(f, batch.schema(), None).unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
    };
    write_pairs(1);
    let spec = write(
        tmp,
        "f.toml",
        "setting = \"passive\"\n[env]\nkind = \"features\"\npath = \"pairs.parquet\"\neval_pairs = 12\n\
         [stream]\nsamples = 40\nbatch_size = 2\neval_every = 20\n[checkpoint]\nevery_steps = 3\n\
         [[estimator]]\nkind = \"omd-exact\"\n[[estimator]]\nkind = \"adam\"\n",
    );
    let s = spec.to_str().unwrap();
    let r = output(cmd(tmp, &["run", s, "--dry-run"]));
    if r.code != Some(0) {
        panic!("features spec: {}", r.stderr);
    }
    let want = reference(tmp, &spec, &[]);
    let got = kill_then_resume(tmp, &spec, &[], "update:25", "a");
    assert_same(&want, &got, "features file");
    let mut c = cmd(tmp, &["run", s, "--out", "b", "--threads", "1"]);
    c.env("ONEPASS_FAILPOINT", "update:25");
    assert_eq!(output(c).signal, Some(9));
    let dir = only_dir(&tmp.join("b"));
    write_pairs(2);
    let r = output(cmd(tmp, &["run", s, "--resume", dir.to_str().unwrap()]));
    assert_eq!(r.code, Some(2), "{}", r.stderr);
    assert!(r.stderr.contains("the data differ") && r.stderr.contains("pairs.parquet"), "{}", r.stderr);
    let r = output(cmd(tmp, &["run", s, "--resume", dir.to_str().unwrap(), "--force"]));
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(r.stderr.contains("warning") && r.stderr.contains("--force"), "{}", r.stderr);
}

/// One writer per run directory: while a run works in it, a second `--resume` and a `report`
/// of it are refused (exit 2, naming the holder's pid), nothing of the first run is lost, and
/// it finishes with the bytes of an undisturbed run.
#[test]
fn a_second_process_on_a_run_directory_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let text = PASSIVE.replace("samples = 240", "samples = 12000").replace("eval_every = 60", "eval_every = 3000");
    let text = text.replace("refit_every = 5", "refit_every = 4000").replace("every_steps = 7", "every_steps = 4000");
    let spec = write(tmp, "p.toml", &text);
    let want = reference(tmp, &spec, &[]);
    let first = cmd(tmp, &["run", spec.to_str().unwrap(), "--out", "l", "--threads", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // wait for the run directory and its lock
    let t0 = std::time::Instant::now();
    let dir = loop {
        if let Some(d) = std::fs::read_dir(tmp.join("l")).ok().and_then(|mut r| r.next()).map(|e| e.unwrap().path()) {
            if std::fs::read_to_string(d.join(".lock")).is_ok_and(|s| s.starts_with("pid")) {
                break d;
            }
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "no locked run directory");
        std::thread::sleep(Duration::from_millis(5));
    };
    let second = output(cmd(tmp, &["run", spec.to_str().unwrap(), "--resume", dir.to_str().unwrap()]));
    let report = output(cmd(tmp, &["report", dir.to_str().unwrap()]));
    let o = first.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    for (what, r) in [("resume", &second), ("report", &report)] {
        if r.code == Some(0) && !dir.join("meta.json").exists() {
            panic!("{what}: a second process worked in a running run's directory");
        }
        if r.code != Some(0) {
            assert_eq!(r.code, Some(2), "{what}: {}", r.stderr);
            assert!(r.stderr.contains("in use by another onepass process (pid"), "{what}: {}", r.stderr);
            assert_eq!(r.stderr.trim().lines().count(), 1, "{what}: {}", r.stderr);
        }
    }
    assert!(second.code == Some(2), "the first run finished before the second started; make the run longer");
    assert_same(&want, &dir, "a run with a refused second process");
}

/// `--resume --force` over a changed config does not mix configurations: cells whose config
/// changed start again (finished or checkpointed), the others continue, and the run ends with
/// the bytes of a fresh run of the new spec; meta.json says the resume was forced.
#[test]
fn forced_resume_restarts_cells_whose_config_changed() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let spec = write(tmp, "p.toml", PASSIVE);
    // the same run name (the file stem), another lr for the three Adam entries
    std::fs::create_dir(tmp.join("e")).unwrap();
    let edited = write(&tmp.join("e"), "p.toml", &PASSIVE.replace("lr = 0.05", "lr = 0.06"));
    let want = reference(tmp, &edited, &[]);
    // killed while adam-reference's second seed runs: adam's cells and adam-reference's first
    // are finished under the old lr, the running one checkpointed
    let mut c = cmd(tmp, &["run", spec.to_str().unwrap(), "--out", "f", "--threads", "1"]);
    c.env("ONEPASS_FAILPOINT", "update:900");
    assert_eq!(output(c).signal, Some(9));
    let dir = only_dir(&tmp.join("f"));
    let ckpts: Vec<String> = std::fs::read_dir(dir.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(ckpts.iter().any(|f| f == "c0008.done") && ckpts.iter().any(|f| f == "c0011.ckpt"), "{ckpts:?}");
    let r = output(cmd(tmp, &["run", edited.to_str().unwrap(), "--resume", dir.to_str().unwrap(), "--force"]));
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    // adam's two cells and adam-reference's finished and running ones restart; the finished cells
    // of the unchanged estimators are kept
    assert_eq!(r.stderr.matches("its config changed (--force): starting it again").count(), 4, "{}", r.stderr);
    assert_same(&want, &dir, "forced resume with a changed lr");
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json")).unwrap()).unwrap();
    assert!(meta["forced"].as_str().is_some_and(|w| w.contains("spec differs")), "{meta}");
}

/// A full disk while writing a checkpoint (issue 34, defect 1) is the run's fault, not the
/// cells': the run stops with one line naming the file, the cells that finished and the command
/// that continues it (with its `--set` flags), keeps `checkpoints/` and writes no meta.json;
/// the resume, with space again, gives the bytes of an uninterrupted run. Before the fix every
/// cell was marked failed, the run finalised and `checkpoints/` deleted.
#[test]
fn a_full_disk_at_a_checkpoint_stops_the_run_resumably() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let spec = write(tmp, "passive.toml", PASSIVE);
    let sets = ["--set", "seeds=1", "--set", "checkpoint.every_steps=3"];
    let want = reference(tmp, &spec, &sets);
    let mut args = vec!["run", "passive.toml", "--out", "full", "--threads", "1"];
    args.extend_from_slice(&sets);
    let mut c = cmd(tmp, &args);
    c.env("ONEPASS_FAIL_WRITE", "checkpoint-write");
    let r = output(c);
    assert_eq!(r.code, Some(2), "{}", r.stderr);
    let last = r.stderr.trim().lines().last().unwrap();
    assert!(last.contains("No space left on device") && last.contains(".ckpt"), "{last}");
    assert!(last.contains("--set seeds=1 --set checkpoint.every_steps=3 --resume"), "the resume command: {last}");
    // the cells stage ends "stopped after", not "done": no cell finished
    assert!(r.stderr.contains("running cells") && r.stderr.contains("stopped after"), "{}", r.stderr);
    assert!(!r.stderr.contains("cells (100%)"), "{}", r.stderr);
    let dir = only_dir(&tmp.join("full"));
    assert!(!dir.join("meta.json").exists(), "the run was finalised");
    assert!(dir.join("checkpoints").is_dir(), "checkpoints/ was removed");
    let mut args = vec!["run", "passive.toml", "--resume", dir.to_str().unwrap(), "--threads", "1"];
    args.extend_from_slice(&sets);
    let r = output(cmd(tmp, &args));
    assert_eq!(r.code, Some(0), "resume: {}", r.stderr);
    assert_same(&want, &dir, "resumed after a full disk at a checkpoint");
}

/// The run directory is claimed before any data is read or model loaded (issue 34): a resume of
/// a directory another process holds, and an `--out` that cannot be created, are refused with
/// their own line before the missing data file is even looked at (they used to fail only after
/// the world — models, generation, φ — was built).
#[test]
fn the_output_is_claimed_before_the_data_is_read() {
    use std::os::unix::io::AsRawFd;
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let spec = "setting = \"passive\"\n[env]\nkind = \"dataset\"\n[data]\npath = \"missing.jsonl\"\nmodel = \"model.gguf\"\n[[estimator]]\nkind = \"sgd\"\n";
    write(tmp, "d.toml", spec);
    // negative control: with nothing in the way, the missing file is the error
    let r = output(cmd(tmp, &["run", "d.toml", "--out", "free"]));
    assert_eq!(r.code, Some(2));
    assert!(r.stderr.contains("missing.jsonl"), "{}", r.stderr);
    // a run directory whose lock this process holds
    let held = tmp.join("held");
    std::fs::create_dir_all(&held).unwrap();
    std::fs::write(held.join("resume.json"), "{}").unwrap();
    let f = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(held.join(".lock")).unwrap();
    // SAFETY: flock(2) on a descriptor this test owns.
    assert_eq!(unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }, 0);
    let r = output(cmd(tmp, &["run", "d.toml", "--resume", "held"]));
    assert_eq!(r.code, Some(2));
    assert!(
        r.stderr.contains("in use by another onepass process") && !r.stderr.contains("missing.jsonl"),
        "{}",
        r.stderr
    );
    drop(f);
    // an --out below a regular file
    std::fs::write(tmp.join("afile"), "x").unwrap();
    let r = output(cmd(tmp, &["run", "d.toml", "--out", "afile/sub"]));
    assert_eq!(r.code, Some(2));
    assert!(
        r.stderr.contains("--out afile/sub: afile is not a directory") && !r.stderr.contains("missing.jsonl"),
        "{}",
        r.stderr
    );
}
