//! experiments/slurm/run-array.sh without SLURM: each array task is the script run with the
//! variables sbatch would set (SLURM_ARRAY_TASK_ID, SLURM_ARRAY_TASK_COUNT, SLURM_CPUS_PER_TASK),
//! then its merge step (STEP=merge). The merged run's tables are the bytes of a one-process run
//! given the same `--set`s — one of them a value with spaces, brackets, quotes and a comma, which
//! the script used to split into several arguments. A task that never ran is named by the merge,
//! which exits non-zero and writes nothing; a second array with another N in the same WORK
//! neither resumes nor mixes with the first.

use std::path::{Path, PathBuf};
use std::process::Command;

mod util;
use util::{onepass, result_files, root};

/// One `--set` a line, as the script's header says; the strategies' value has spaces, brackets,
/// quotes and a comma.
const SETS: &str = "deploy.strategies=[\"ucb\", \"random-pair\"]\nstream.samples=80\n";

/// `bash run-array.sh` in `dir` with `env` (SETS as [`SETS`] unless `env` says otherwise):
/// (exit code, stdout, stderr).
fn script(dir: &Path, work: &str, env: &[(&str, &str)]) -> (i32, String, String) {
    let mut cmd = Command::new("bash");
    cmd.arg(root().join("experiments/slurm/run-array.sh"))
        .current_dir(dir)
        .env("SPEC", "run.toml")
        .env("SETS", SETS)
        .env("WORK", work)
        .env("OUT", "merged")
        .env("ONEPASS", env!("CARGO_BIN_EXE_onepass"))
        .env_remove("SETS_FILE")
        .env_remove("STEP")
        .env_remove("N")
        .env_remove("SLURM_ARRAY_TASK_ID")
        .env_remove("SLURM_ARRAY_TASK_COUNT");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("bash");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Array task `i` of `n`, as sbatch starts it.
fn task(dir: &Path, work: &str, i: usize, n: usize) {
    let (i_s, n_s) = (i.to_string(), n.to_string());
    let env = [("SLURM_ARRAY_TASK_ID", i_s.as_str()), ("SLURM_ARRAY_TASK_COUNT", &n_s), ("SLURM_CPUS_PER_TASK", "1")];
    let (code, _, err) = script(dir, work, &env);
    assert_eq!(code, 0, "task {i}/{n}: {err}");
    assert!(err.contains(&format!("slice {i}/{n}")), "task {i}/{n}: {err}");
}

/// The one slice directory of task `i` of an array of `n`, and its slice.json's (index, count).
fn slice_of(dir: &Path, work: &str, i: usize, n: usize) -> (PathBuf, (u64, u64)) {
    let task = dir.join(work).join(format!("n{n}/task-{i}"));
    let dirs: Vec<PathBuf> = std::fs::read_dir(&task).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(dirs.len(), 1, "{}: {dirs:?}", task.display());
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dirs[0].join("slice.json")).unwrap()).unwrap();
    (dirs[0].clone(), (s["index"].as_u64().unwrap(), s["count"].as_u64().unwrap()))
}

fn assert_same_tables(one: &Path, merged: &Path) {
    let (a, b) = (result_files(one), result_files(merged));
    let names: Vec<&PathBuf> = a.iter().map(|f| &f.0).collect();
    assert_eq!(names, b.iter().map(|f| &f.0).collect::<Vec<_>>());
    assert!(names.iter().any(|n| n.ends_with("metrics.parquet")) && names.iter().any(|n| n.starts_with("theta")));
    for ((name, x), (_, y)) in a.iter().zip(&b) {
        assert!(x == y, "{name:?} differs between the merged run ({}) and the one-process run", merged.display());
    }
}

#[test]
fn the_array_script_merges_to_one_process_and_names_what_did_not_finish() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path();
    std::fs::write(p.join("run.toml"), util::SYNTHETIC_DEPLOY).unwrap();
    let one = onepass(
        p,
        &[
            "run",
            "run.toml",
            "--set",
            "deploy.strategies=[\"ucb\", \"random-pair\"]",
            "--set",
            "stream.samples=80",
            "--out",
            "one",
            "--threads",
            "1",
        ],
    );
    let one = p.join(one.dir());

    // the array of 3: every task, then the merge (N read from the only array under WORK)
    for i in 0..3 {
        task(p, "w", i, 3);
    }
    for i in 0..3 {
        assert_eq!(slice_of(p, "w", i, 3).1, (i as u64, 3));
    }
    let (code, out, err) = script(p, "w", &[("STEP", "merge")]);
    assert_eq!(code, 0, "merge: {err}");
    let merged = p.join(out.trim().lines().last().unwrap());
    assert!(merged.starts_with(p.join("merged")), "{}", merged.display());
    assert_same_tables(&one, &merged);

    // the same WORK with N = 2: new slices beside the first array's, which stay as they were
    let before: Vec<_> = (0..3).map(|i| result_files(&slice_of(p, "w", i, 3).0)).collect();
    for i in 0..2 {
        task(p, "w", i, 2);
        assert_eq!(slice_of(p, "w", i, 2).1, (i as u64, 2));
    }
    for (i, b) in before.iter().enumerate() {
        assert!(&result_files(&slice_of(p, "w", i, 3).0) == b, "task {i} of the first array changed");
    }
    // two arrays under WORK: the merge must be told which
    let (code, _, err) = script(p, "w", &[("STEP", "merge")]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("set N") && err.contains("n2") && err.contains("n3"), "{err}");
    let (code, out, err) = script(p, "w", &[("STEP", "merge"), ("N", "2")]);
    assert_eq!(code, 0, "merge N=2: {err}");
    assert_same_tables(&one, &p.join(out.trim().lines().last().unwrap()));

    // `submit` with a stand-in sbatch that records its arguments: the log folder made, the
    // array, then the merge after any end of it, small, told N; the SETS recorded under WORK
    let bin = p.join("bin");
    std::fs::create_dir(&bin).unwrap();
    std::fs::write(bin.join("sbatch"), "#!/bin/sh\necho \"$*\" >> \"$SBATCH_LOG\"\necho 4242\n").unwrap();
    std::fs::set_permissions(bin.join("sbatch"), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap());
    let log = p.join("sbatch.log");
    let (code, out, err) = script(
        p,
        "x",
        &[("STEP", "submit"), ("N", "3"), ("PATH", &path), ("SBATCH_LOG", log.to_str().unwrap()), ("LOGS", "lg")],
    );
    assert_eq!(code, 0, "submit: {err}");
    assert!(out.contains("array job 4242 (3 tasks)"), "{out}");
    assert!(p.join("lg").is_dir(), "submit made no log folder");
    let calls = std::fs::read_to_string(&log).unwrap();
    let calls: Vec<&str> = calls.lines().collect();
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert!(calls[0].contains("--array=0-2") && calls[0].contains("--output=lg/"), "{}", calls[0]);
    assert!(calls[0].contains("STEP=slice,N=3"), "{}", calls[0]);
    for flag in ["--dependency=afterany:4242", "--cpus-per-task=1", "--mem=4G", "STEP=merge,N=3", "--output=lg/"] {
        assert!(calls[1].contains(flag), "{flag} not in {}", calls[1]);
    }
    assert_eq!(std::fs::read_to_string(p.join("x/n3/sets")).unwrap().trim_end(), SETS.trim_end());

    // negative control: task 1 of 3 never ran; the merge names it, exits 1 and writes nothing.
    // Tasks 0 and 2 run as resubmitted alone (an array of 1 told N = 3, SETS read from WORK)
    for i in [0, 2] {
        let i_s = i.to_string();
        let env = [("SLURM_ARRAY_TASK_ID", i_s.as_str()), ("SLURM_ARRAY_TASK_COUNT", "1"), ("N", "3"), ("SETS", "")];
        let (code, _, err) = script(p, "x", &env);
        assert_eq!(code, 0, "task {i} alone: {err}");
        assert_eq!(slice_of(p, "x", i, 3).1, (i as u64, 3));
    }
    // without N, a task alone is refused (it would be slice i of 1)
    let (code, _, err) = script(p, "x", &[("SLURM_ARRAY_TASK_ID", "1"), ("SLURM_ARRAY_TASK_COUNT", "1")]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("task 1 of 1") && err.contains("N=<N>"), "{err}");
    let runs_before = std::fs::read_dir(p.join("merged")).unwrap().count();
    let (code, _, err) = script(p, "x", &[("STEP", "merge"), ("N", "3")]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("1 of 3 tasks did not finish") && err.contains("task 1 (no slice directory"), "{err}");
    assert!(!err.contains("task 0") && !err.contains("task 2"), "{err}");
    assert_eq!(std::fs::read_dir(p.join("merged")).unwrap().count(), runs_before, "a refused merge wrote a run");
    // task 1 killed mid-way (its slice checkpointed, unfinished): named with its directory
    let mut killed = Command::new("bash");
    killed
        .arg(root().join("experiments/slurm/run-array.sh"))
        .current_dir(p)
        .envs([("SPEC", "run.toml"), ("SETS", SETS), ("WORK", "x"), ("ONEPASS", env!("CARGO_BIN_EXE_onepass"))])
        .envs([("SLURM_ARRAY_TASK_ID", "1"), ("SLURM_ARRAY_TASK_COUNT", "3"), ("SLURM_CPUS_PER_TASK", "1")])
        .env("ONEPASS_FAILPOINT", "update:30")
        .env_remove("STEP");
    assert_ne!(killed.status().unwrap().code(), Some(0), "the failpoint did not stop task 1");
    let (code, _, err) = script(p, "x", &[("STEP", "merge"), ("N", "3")]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("task 1 (") && err.contains("cells unfinished in x/n3/task-1/"), "{err}");
    assert_eq!(std::fs::read_dir(p.join("merged")).unwrap().count(), runs_before, "a refused merge wrote a run");
    // resubmitted, it resumes its slice; the same merge then goes through
    task(p, "x", 1, 3);
    let (code, out, err) = script(p, "x", &[("STEP", "merge"), ("N", "3"), ("SETS", "")]);
    assert_eq!(code, 0, "{err}");
    assert_same_tables(&one, &p.join(out.trim().lines().last().unwrap()));
}

/// The old form of SETS (`--set k=v --set …` on one line) is refused with the new form's
/// example, not split; a task id past the array's count is refused.
#[test]
fn the_array_script_refuses_the_old_sets_form() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path();
    std::fs::write(p.join("run.toml"), util::SYNTHETIC_DEPLOY).unwrap();
    let mut cmd = Command::new("bash");
    cmd.arg(root().join("experiments/slurm/run-array.sh"))
        .current_dir(p)
        .env("SETS", "--set seeds=3 --set stream.samples=80")
        .env("SPEC", "run.toml")
        .env("WORK", "w")
        .env("ONEPASS", env!("CARGO_BIN_EXE_onepass"))
        .env("SLURM_ARRAY_TASK_ID", "0")
        .env("SLURM_ARRAY_TASK_COUNT", "2")
        .env_remove("SETS_FILE")
        .env_remove("STEP");
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("one key=value a line, without --set"), "{err}");
    assert!(!p.join("w").exists(), "a refused task made its directory");
    let out = cmd.env("SETS", "seeds=1").env("SLURM_ARRAY_TASK_ID", "2").output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("task 2 of 2"), "{err}");
}
