//! Live curves (`<run>/tb/<cell_id>/`, `[track] tensorboard`): a run killed (SIGKILL) after it
//! had written rows past its last checkpoint and then resumed holds every (tag, step) of an
//! uninterrupted run exactly once, with the same values (the wall-time tags aside); the tables
//! stay the same bytes; `tensorboard = false` writes no tb/. A learning policy's run logs its
//! evaluation, its updates, its stage times and its sampled completions per chunk.

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};

use runner::tb::{event_files, read_events};

mod util;
use util::{command, onepass};

/// Passive on the synthetic bandit, a metric row every update (2 samples) and a checkpoint
/// every 7 updates: a kill in update 24 leaves rows 22 and 23 written after the checkpoint.
const PASSIVE: &str = r#"
setting = "passive"
seeds = 1
[env]
dim = 4
contexts = 10
arms = 3
eval_pairs = 50
[stream]
samples = 80
batch_size = 2
eval_every = 2
[checkpoint]
every_s = 0
every_steps = 7
[[estimator]]
kind = "omd-exact"
[[estimator]]
kind = "sgd"
lr = 0.5
"#;

/// (tag, step) → (value, how many times) over every event file of a cell's directory.
type Points = BTreeMap<(String, i64), (f32, usize)>;

fn points(cell: &Path) -> Points {
    let mut out = Points::new();
    let files = event_files(cell).unwrap();
    assert!(!files.is_empty(), "no event file in {}", cell.display());
    for f in files {
        for e in read_events(&f).unwrap() {
            for (tag, v) in e.scalars() {
                out.entry((tag.to_string(), e.step)).or_insert((v, 0)).1 += 1;
            }
            for (tag, _) in e.texts() {
                out.entry((tag.to_string(), e.step)).or_insert((0.0, 0)).1 += 1;
            }
        }
    }
    out
}

/// Every cell's points under `<run>/tb/`.
fn run_points(dir: &Path) -> BTreeMap<String, Points> {
    let mut cells: Vec<PathBuf> = std::fs::read_dir(dir.join("tb")).unwrap().map(|e| e.unwrap().path()).collect();
    cells.sort();
    cells.iter().map(|c| (c.file_name().unwrap().to_string_lossy().into_owned(), points(c))).collect()
}

fn run(p: &Path, spec: &str, out: &str) -> PathBuf {
    let (code, stdout, err) = onepass(p, &["run", spec, "--out", out, "--threads", "1"]).parts();
    assert_eq!(code, 0, "{err}");
    p.join(stdout.lines().last().unwrap().trim())
}

fn only_dir(out: &Path) -> PathBuf {
    let dirs: Vec<PathBuf> = std::fs::read_dir(out).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(dirs.len(), 1, "{dirs:?}");
    dirs[0].clone()
}

/// `spec` killed at `failpoint` into `out/`, its run directory (not resumed yet).
fn killed(p: &Path, spec: &str, failpoint: &str, out: &str) -> PathBuf {
    let o = command()
        .current_dir(p)
        .args(["run", spec, "--out", out, "--threads", "1"])
        .env("ONEPASS_FAILPOINT", failpoint)
        .output()
        .unwrap();
    assert_eq!(o.status.signal(), Some(9), "{failpoint}: {}", String::from_utf8_lossy(&o.stderr));
    only_dir(&p.join(out))
}

fn resume(p: &Path, spec: &str, dir: &Path) {
    let (code, _, err) = onepass(p, &["run", spec, "--resume", dir.to_str().unwrap(), "--threads", "1"]).parts();
    assert_eq!(code, 0, "{err}");
}

/// Each (tag, step) once, and the same points and values as the uninterrupted run's (wall
/// times aside).
fn assert_like(want: &BTreeMap<String, Points>, got: &BTreeMap<String, Points>, what: &str) {
    assert_eq!(want.keys().collect::<Vec<_>>(), got.keys().collect::<Vec<_>>(), "{what}: cells");
    for (cell, g) in got {
        let twice: Vec<_> = g.iter().filter(|(_, v)| v.1 > 1).map(|(k, _)| k).collect();
        assert!(twice.is_empty(), "{what}: {cell}: (tag, step) written more than once: {twice:?}");
        let w = &want[cell];
        assert_eq!(w.keys().collect::<Vec<_>>(), g.keys().collect::<Vec<_>>(), "{what}: {cell}: (tag, step) differ");
        for (k, (v, _)) in g {
            if !k.0.starts_with("time/") {
                assert_eq!(w[k].0.to_bits(), v.to_bits(), "{what}: {cell}: {k:?}");
            }
        }
    }
}

#[test]
fn a_killed_and_resumed_run_holds_each_point_once() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path();
    util::write(p, "passive.toml", PASSIVE);
    let want_dir = run(p, "passive.toml", "a");
    let want = run_points(&want_dir);
    // every row of metrics.parquet is a point of eval/loss
    let rows = util::table(&want_dir.join("metrics.parquet")).num_rows();
    let n: usize = want.values().map(|c| c.keys().filter(|k| k.0 == "eval/loss").count()).sum();
    assert_eq!(n, rows, "eval/loss points against metrics.parquet's rows");
    assert!(want["c0000"].contains_key(&("theta/err".to_string(), 40)), "{:?}", want["c0000"].keys());
    assert!(want["c0000"].contains_key(&("eval/subopt_pessimistic".to_string(), 40)));

    let dir = killed(p, "passive.toml", "update:24", "b");
    // the killed process wrote rows past its checkpoint (update 21): a plain append on resume
    // would write them twice
    let before = points(&dir.join("tb/c0000"));
    let last = before.keys().filter(|k| k.0 == "eval/loss").map(|k| k.1).max().unwrap();
    assert!(last > 21, "the killed run's last row is at step {last}");
    resume(p, "passive.toml", &dir);
    assert_like(&want, &run_points(&dir), "passive, SIGKILL in update 24");
    assert_eq!(event_files(&dir.join("tb/c0000")).unwrap().len(), 1, "the resumed cell's old file is replaced");
    // the tables stay the bytes of the uninterrupted run
    for f in ["metrics.parquet", "cells.parquet"] {
        assert!(std::fs::read(want_dir.join(f)).unwrap() == std::fs::read(dir.join(f)).unwrap(), "{f} differs");
    }

    // the deployment preset, killed in its second cell
    util::write(p, "deploy.toml", util::SYNTHETIC_DEPLOY);
    let want = run_points(&run(p, "deploy.toml", "c"));
    let dir = killed(p, "deploy.toml", "update:80", "d");
    resume(p, "deploy.toml", &dir);
    assert_like(&want, &run_points(&dir), "deploy, SIGKILL in update 80");

    // off: no tb/, the same tables
    let (code, stdout, err) =
        onepass(p, &["run", "passive.toml", "--out", "f", "--threads", "1", "--set", "track.tensorboard=false"])
            .parts();
    assert_eq!(code, 0, "{err}");
    let off = p.join(stdout.lines().last().unwrap().trim());
    assert!(!off.join("tb").exists(), "track.tensorboard = false wrote tb/");
    assert!(
        std::fs::read(want_dir.join("metrics.parquet")).unwrap() == std::fs::read(off.join("metrics.parquet")).unwrap()
    );
}

/// The online loop on the tiny model: rloo's policy evaluation, its update per chunk, stage
/// times and completions; killed in a chunk and resumed, each point once.
#[test]
fn an_online_run_logs_its_policy_and_completions() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path();
    util::write_prompts(p);
    let spec = format!(
        r#"
setting = "deploy"
seeds = 1
[env]
kind = "generated"
eval_pairs = 20
[generate]
prompts = "prompts.jsonl"
rows = 6
policy = "{g}"
n = 2
max_new_tokens = 4
batch_prompts = 2
cache = "cache/gen"
[features]
model = "{g}"
max_len = 64
cache = "cache/phi"
[oracle]
kind = "linear"
seed = 3
[stream]
batch_size = 2
[deploy]
chunks = 3
strategies = ["random-pair"]
policy = ["rloo"]
[policy]
rank = 2
alpha = 4.0
lr = 0.05
epochs = 1
minibatch = 4
eval_prompts = 2
[checkpoint]
every_steps = 1
[[estimator]]
kind = "sgd"
lr = 0.1
"#,
        g = util::tiny_gguf().display()
    );
    util::write(p, "run.toml", &spec);
    let want = run_points(&run(p, "run.toml", "a"));
    let c = &want["c0000"];
    for tag in ["policy/reward", "policy/kl", "policy/entropy", "eval/accuracy", "deploy/regret"] {
        let steps: Vec<i64> = c.keys().filter(|k| k.0 == tag).map(|k| k.1).collect();
        let from = if tag.starts_with("policy/") { 0 } else { 1 };
        assert_eq!(steps, (from..=3).collect::<Vec<_>>(), "{tag}");
    }
    // chunk 0's times are its evaluation's (the policy before any update)
    for (tag, from) in
        [("train/loss", 1), ("train/grad_norm", 1), ("completions", 1), ("time/eval_s", 0), ("time/policy_s", 0)]
    {
        let steps: Vec<i64> = c.keys().filter(|k| k.0 == tag).map(|k| k.1).collect();
        assert_eq!(steps, (from..=3).collect::<Vec<_>>(), "{tag}");
    }
    let texts: Vec<String> = event_files(&want_dir_cell(p, "a"))
        .unwrap()
        .iter()
        .flat_map(|f| read_events(f).unwrap())
        .flat_map(|e| e.texts().map(|(_, t)| t).collect::<Vec<_>>())
        .collect();
    assert!(texts[0].starts_with("| prompt | completion | reward | learned reward |"), "{}", texts[0]);
    assert!(texts[0].lines().count() >= 3, "{}", texts[0]);

    // killed in chunk 2's evaluation (the third: chunk 0's is the first), after its completions
    // were written and chunk 1's checkpoint: resumed, each point once
    let dir = killed(p, "run.toml", "evaluate:3", "b");
    let before = points(&dir.join("tb/c0000"));
    assert!(before.contains_key(&("completions".to_string(), 2)), "{:?}", before.keys());
    resume(p, "run.toml", &dir);
    assert_like(&want, &run_points(&dir), "online, SIGKILL in chunk 2's evaluation");
}

fn want_dir_cell(p: &Path, out: &str) -> PathBuf {
    only_dir(&p.join(out)).join("tb/c0000")
}

/// `onepass merge` brings each cell's event files from its slice: the merged run holds the
/// points of a one-process run.
#[test]
fn a_merged_run_holds_its_slices_curves() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path();
    util::write(p, "passive.toml", PASSIVE);
    let want = run_points(&run(p, "passive.toml", "a"));
    let mut slices = Vec::new();
    for i in 0..2 {
        let cells = format!("{i}/2");
        let (code, stdout, err) =
            onepass(p, &["run", "passive.toml", "--out", "s", "--cells", &cells, "--threads", "1"]).parts();
        assert_eq!(code, 0, "slice {i}: {err}");
        slices.push(stdout.trim().lines().last().unwrap().to_string());
    }
    let mut args = vec!["merge", "passive.toml"];
    args.extend(slices.iter().map(String::as_str));
    args.extend(["--out", "m"]);
    let (code, stdout, err) = onepass(p, &args).parts();
    assert_eq!(code, 0, "{err}");
    let merged = p.join(stdout.trim().lines().last().unwrap());
    assert_like(&want, &run_points(&merged), "merged from two slices");
}
