//! A run's cells over a SLURM array (issue 32): `onepass run --cells i/N` runs slice i of N into
//! a slice directory, `onepass merge` assembles the run. The merged run's tables and θ are the
//! bytes of a run in one process (N = 3, passive with every estimator and deployment; the online
//! loop in `online.rs`); a slice killed mid-way resumes as that slice; a merge missing a slice, or
//! given a slice of another spec, is refused on one line; a slice resumes only as itself.

use std::path::{Path, PathBuf};

mod util;
use util::{command, finish, onepass, result_files};

/// Runs the three slices of `run.toml` under `p` into `out/`; their directories.
fn slices(p: &Path, out: &str, sets: &[&str]) -> Vec<PathBuf> {
    (0..3)
        .map(|i| {
            let cells = format!("{i}/3");
            let mut args = vec!["run", "run.toml", "--out", out, "--threads", "1", "--cells", &cells];
            args.extend_from_slice(sets);
            let (code, stdout, err) = onepass(p, &args).parts();
            assert_eq!(code, 0, "slice {i}: {err}");
            assert!(err.contains(&format!("slice {i}/3")) && err.contains("onepass merge"), "{err}");
            let dir = p.join(stdout.trim().lines().last().unwrap());
            assert!(!dir.join("metrics.parquet").exists(), "a slice writes no tables");
            dir
        })
        .collect()
}

/// `onepass merge run.toml SLICES… --out out`: (exit code, run directory or stderr).
fn merge(p: &Path, slices: &[PathBuf], out: &str) -> (i32, String) {
    let mut args = vec!["merge".to_string(), "run.toml".into()];
    args.extend(slices.iter().map(|s| s.display().to_string()));
    args.extend(["--out".to_string(), out.to_string()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, stdout, err) = onepass(p, &args).parts();
    (code, if code == 0 { stdout.trim().lines().last().unwrap().to_string() } else { err })
}

#[test]
fn three_slices_merge_to_the_bytes_of_one_process() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path();
    std::fs::write(p.join("run.toml"), util::SYNTHETIC_DEPLOY).unwrap();
    let (code, stdout, err) = onepass(p, &["run", "run.toml", "--out", "one", "--threads", "2"]).parts();
    assert_eq!(code, 0, "{err}");
    let one = p.join(stdout.trim().lines().last().unwrap());
    let parts = slices(p, "s", &[]);
    let (code, merged) = merge(p, &parts, "m");
    assert_eq!(code, 0, "{merged}");
    let (a, b) = (result_files(&one), result_files(&p.join(&merged)));
    let names: Vec<&PathBuf> = a.iter().map(|f| &f.0).collect();
    assert_eq!(names, b.iter().map(|f| &f.0).collect::<Vec<_>>());
    assert!(names.iter().any(|n| n.starts_with("theta")) && names.iter().any(|n| n.ends_with("metrics.parquet")));
    for ((name, x), (_, y)) in a.iter().zip(&b) {
        assert!(x == y, "{name:?} differs between the merged run and the one-process run");
    }
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(p.join(&merged).join("meta.json")).unwrap()).unwrap();
    assert_eq!(meta["merged_from"].as_array().unwrap().len(), 3);
}

/// What is refused: a merge missing a slice (naming how many cells and the first), a slice of
/// another `--set` (not this run's), a slice resumed as another slice or as the whole run; a
/// slice killed mid-way resumes as itself and the merge is then the one-process run's.
#[test]
fn slices_are_refused_where_they_would_mix_and_resume_as_themselves() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path();
    std::fs::write(p.join("run.toml"), util::SYNTHETIC_DEPLOY).unwrap();
    let parts = slices(p, "s", &[]);
    let (code, err) = merge(p, &parts[..2], "m");
    assert_eq!(code, 2, "{err}");
    let last = err.trim_end().lines().last().unwrap();
    assert!(last.contains("finished in no slice given") && last.contains("c0002"), "{last}");
    assert!(!p.join("m").exists(), "a refused merge made a directory");
    let other = slices(p, "o", &["--set", "seeds=3"]);
    let (code, err) = merge(p, &[parts[0].clone(), parts[1].clone(), other[2].clone()], "m");
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("not a slice of this run"), "{err}");
    // a slice killed mid-way, resumed as another slice (refused), then as itself
    let out = finish(
        command()
            .current_dir(p)
            .args(["run", "run.toml", "--out", "k", "--threads", "1", "--cells", "1/3"])
            .env("ONEPASS_FAILPOINT", "update:30"),
    );
    assert!(out.code == -1 && out.stderr.contains("failpoint update #30"), "{}", out.stderr);
    let killed = std::fs::read_dir(p.join("k")).unwrap().next().unwrap().unwrap().path();
    let resume = |cells: Option<&str>| {
        let mut args = vec!["run", "run.toml", "--resume", killed.to_str().unwrap()];
        if let Some(c) = cells {
            args.extend(["--cells", c]);
        }
        onepass(p, &args).parts()
    };
    for (cells, holds) in [(Some("2/3"), "--cells 2/3"), (None, "the whole run")] {
        let (code, _, err) = resume(cells);
        assert_eq!(code, 2, "{err}");
        assert!(err.contains("holds --cells 1/3") && err.contains(holds), "{err}");
    }
    let (code, _, err) = resume(Some("1/3"));
    assert_eq!(code, 0, "{err}");
    let (code, merged) = merge(p, &[parts[0].clone(), killed, parts[2].clone()], "m2");
    assert_eq!(code, 0, "{merged}");
    let (code, whole) = merge(p, &parts, "m3");
    assert_eq!(code, 0, "{whole}");
    let (a, b) = (result_files(&p.join(&merged)), result_files(&p.join(&whole)));
    assert!(a == b, "a killed and resumed slice merges to other bytes");
}
