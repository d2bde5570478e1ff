//! The ensemble estimator through the command line: passive, active and deployment runs with
//! it, killed mid-run and resumed, write the same bytes (rounds.parquet too) as uninterrupted runs; a strategy that draws from
//! an ensemble's heads is refused in one line with any other estimator.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_onepass");

const PASSIVE: &str = r#"
setting = "passive"
seeds = 2
[env]
dim = 5
contexts = 12
arms = 3
eval_pairs = 100
[stream]
samples = 120
batch_size = 3
eval_every = 30
record_steps = true
[checkpoint]
every_steps = 7
[[estimator]]
kind = "ensemble"
heads = 4
batch = 16
lr = 0.05
[[estimator]]
kind = "ensemble"
heads = 3
bootstrap = true
batch = 8
"#;

const ACTIVE: &str = r#"
setting = "active"
seeds = 2
[env]
dim = 5
contexts = 12
arms = 6
eval_pairs = 100
[stream]
samples = 80
batch_size = 2
eval_every = 20
[active]
rule = ["thompson", "double-thompson", "ensemble-uncertainty", "baits", "pool-argmax"]
pool = 200
[checkpoint]
every_steps = 5
[[estimator]]
kind = "ensemble"
heads = 4
batch = 16
lr = 0.05
"#;

const DEPLOY: &str = r#"
setting = "deploy"
seeds = 2
[env]
dim = 5
contexts = 12
arms = 6
eval_pairs = 100
[stream]
samples = 80
batch_size = 2
eval_every = 20
[deploy]
strategies = ["thompson", "double-thompson", "baits", "ucb"]
[checkpoint]
every_steps = 5
[[estimator]]
kind = "ensemble"
heads = 4
batch = 16
lr = 0.05
"#;

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn run(dir: &Path, args: &[&str], failpoint: Option<&str>) -> std::process::Output {
    let mut c = Command::new(BIN);
    c.current_dir(dir).args(args).env_remove("ONEPASS_FAILPOINT");
    if let Some(f) = failpoint {
        c.env("ONEPASS_FAILPOINT", f);
    }
    c.output().unwrap()
}

/// Every file that must not depend on interruptions, with θ's bytes.
fn fingerprint(dir: &Path) -> Vec<(String, Vec<u8>)> {
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

fn kill_then_resume(tmp: &Path, spec: &Path, failpoint: &str, out: &str) -> PathBuf {
    let s = spec.to_str().unwrap();
    let o = run(tmp, &["run", s, "--out", out, "--threads", "1"], Some(failpoint));
    assert_eq!(o.status.signal(), Some(9), "{failpoint}: {}", String::from_utf8_lossy(&o.stderr));
    let dirs: Vec<PathBuf> = std::fs::read_dir(tmp.join(out)).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(dirs.len(), 1);
    let dir = dirs[0].clone();
    let o = run(tmp, &["run", s, "--resume", dir.to_str().unwrap(), "--threads", "1"], None);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{failpoint}: resume failed: {err}");
    assert!(err.contains("(resumed)"), "{err}");
    dir
}

#[test]
fn ensemble_runs_killed_then_resumed_give_the_same_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    for (name, text, fps) in [
        ("passive.toml", PASSIVE, ["update:3", "update:100"]),
        ("active.toml", ACTIVE, ["update:50", "update:300"]),
        ("deploy.toml", DEPLOY, ["update:70", "update:250"]),
    ] {
        let spec = write(tmp, name, text);
        let o = run(tmp, &["run", spec.to_str().unwrap(), "--out", "ref", "--threads", "1"], None);
        let stdout = String::from_utf8_lossy(&o.stdout);
        assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
        let want = tmp.join(stdout.trim().lines().last().unwrap());
        let want_files = fingerprint(&want);
        for (i, fp) in fps.iter().enumerate() {
            let got = fingerprint(&kill_then_resume(tmp, &spec, fp, &format!("{name}-{i}")));
            assert_eq!(
                want_files.iter().map(|f| &f.0).collect::<Vec<_>>(),
                got.iter().map(|f| &f.0).collect::<Vec<_>>(),
                "{name} {fp}"
            );
            for ((f, a), (_, b)) in want_files.iter().zip(&got) {
                assert!(a == b, "{name}, SIGKILL at {fp}: {f} differs from the uninterrupted run's");
            }
        }
        // the run is not trivially resumable: another seed gives other bytes
        let o = run(
            tmp,
            &["run", spec.to_str().unwrap(), "--out", "other", "--threads", "1", "--set", "master_seed=7"],
            None,
        );
        assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
        let other = tmp.join(String::from_utf8_lossy(&o.stdout).trim().lines().last().unwrap());
        assert_ne!(
            std::fs::read(want.join("metrics.parquet")).unwrap(),
            std::fs::read(other.join("metrics.parquet")).unwrap()
        );
    }
}

#[test]
fn an_ensemble_strategy_with_another_estimator_is_refused_in_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let deploy = "setting = \"deploy\"\nseeds = 1\n[env]\ndim = 4\ncontexts = 6\narms = 4\neval_pairs = 20\n\
                  [stream]\nsamples = 20\nbatch_size = 2\n[deploy]\nstrategies = [\"best-two\", \"double-thompson\"]\n\
                  [[estimator]]\nkind = \"ensemble\"\nheads = 3\n[[estimator]]\nkind = \"sgd\"\n";
    let active = "setting = \"active\"\nseeds = 1\n[env]\ndim = 4\ncontexts = 6\narms = 4\neval_pairs = 20\n\
                  [stream]\nsamples = 20\nbatch_size = 2\n[active]\nrule = \"baits\"\n\
                  [[estimator]]\nkind = \"omd-exact\"\n";
    for (name, text, key, strategy, estimator) in [
        ("deploy.toml", deploy, "deploy.strategies", "double-thompson", "sgd"),
        ("active.toml", active, "active.rule", "baits", "omd-exact"),
    ] {
        let spec = write(tmp, name, text);
        let o = run(tmp, &["run", spec.to_str().unwrap(), "--out", "x", "--threads", "1"], None);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{name}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{name}: one line: {err}");
        for part in [key, &format!("`{strategy}`"), &format!("`{estimator}`"), "kind = \"ensemble\""] {
            assert!(err.contains(part), "{name}: `{part}` not in {err}");
        }
        // the same spec with only the ensemble runs
        if name == "deploy.toml" {
            let ok = text.replace("[[estimator]]\nkind = \"sgd\"\n", "");
            let spec = write(tmp, "deploy-ok.toml", &ok);
            let o = run(tmp, &["run", spec.to_str().unwrap(), "--out", "y", "--threads", "1"], None);
            assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
        }
    }
}
