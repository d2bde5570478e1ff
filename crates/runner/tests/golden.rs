//! Golden digests: the synthetic presets of the three settings (made small with `--set`) must
//! write the same bytes of metrics, steps, cells and rounds parquet and θ as the commit that
//! recorded `snapshots/golden.txt`. A refactor that moves a number fails here. When a change of
//! numbers is intended, re-record with `ONEPASS_BLESS=1 cargo test --release --test golden` and
//! say why in the commit.

mod util;

use std::path::Path;

/// (name, preset, overrides): small enough for CI, every estimator kind and strategy kept.
const RUNS: &[(&str, &str, &[&str])] = &[
    (
        "passive-synthetic",
        "experiments/passive/synthetic.toml",
        &["seeds=2", "stream.samples=1200", "stream.eval_every=300", "stream.record_steps=true", "env.dim=12"],
    ),
    (
        "active-synthetic",
        "experiments/active/synthetic.toml",
        &["seeds=2", "stream.samples=300", "stream.eval_every=100", "active.pool=600", "stream.record_steps=true"],
    ),
    (
        "deploy-synthetic",
        "experiments/deploy/synthetic.toml",
        &["seeds=2", "stream.samples=400", "stream.eval_every=100"],
    ),
    ("sweeps", "SWEEPS", &[]),
];

/// Sweeps of several keys, Lemma 1's theory config, Adam inside omd-reference, a stream rule.
const SWEEPS: &str = r#"
setting = "active"
seeds = 2
[env]
dim = 6
contexts = 20
arms = 4
eval_pairs = 100
[stream]
samples = 120
batch_size = 2
eval_every = 40
[active]
rule = ["stream", "random"]
pool = 300
[[estimator]]
kind = "omd-exact"
theory = true
[[estimator]]
kind = "omd-hvp-cg"
lr = [0.1, 0.5]
cg_steps = [1, 3]
[[estimator]]
kind = "omd-reference"
lr = 0.5
adam = true
beta1 = [0.8, 0.9]
[[estimator]]
kind = "sgd"
lr = 0.5
clip = ["none", 2.0]
[[estimator]]
kind = "sgd"
lr = 0.5
init = "normal"
init_std = 0.1
"#;

/// The digests of one run directory's deterministic outputs, a line each.
fn digests(name: &str, dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for t in ["metrics", "steps", "cells", "rounds"] {
        let p = dir.join(format!("{t}.parquet"));
        if p.exists() {
            out.push(format!("{name} {t}.parquet {}", util::digest(&p)));
        }
    }
    let mut thetas: Vec<_> = std::fs::read_dir(dir.join("theta")).unwrap().map(|e| e.unwrap().path()).collect();
    thetas.sort();
    let mut h = blake3::Hasher::new();
    for p in &thetas {
        h.update(&std::fs::read(p).unwrap());
    }
    out.push(format!("{name} theta/*.npy({}) {}", thetas.len(), h.finalize().to_hex()));
    out
}

fn run(tmp: &Path, preset: &str, overrides: &[&str], extra: &[&str]) -> std::path::PathBuf {
    let spec = if preset == "SWEEPS" { util::write(tmp, "sweeps.toml", SWEEPS) } else { util::root().join(preset) };
    let out = tmp.join("out");
    let mut args: Vec<String> =
        vec!["run".into(), spec.display().to_string(), "--out".into(), out.display().to_string()];
    for o in overrides.iter().chain(extra) {
        args.extend(["--set".to_string(), o.to_string()]);
    }
    let refs: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    util::onepass(tmp, &refs).dir()
}

#[test]
fn synthetic_outputs_keep_their_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let mut got = Vec::new();
    for (name, preset, overrides) in RUNS {
        let dir = run(tmp.path(), preset, overrides, &[]);
        got.extend(digests(name, &dir));
    }
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/snapshots/golden.txt");
    let text = got.join("\n") + "\n";
    if std::env::var_os("ONEPASS_BLESS").is_some() {
        std::fs::write(&path, &text).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path).expect("tests/snapshots/golden.txt (ONEPASS_BLESS=1 records it)");
    for (g, w) in text.lines().zip(want.lines()) {
        assert_eq!(g, w, "a golden digest moved");
    }
    assert_eq!(text.lines().count(), want.lines().count(), "tables appeared or vanished:\n{text}");
}

/// Negative control: the digests see the numbers (another master seed moves every table).
#[test]
fn digests_see_the_numbers() {
    let tmp = tempfile::tempdir().unwrap();
    let (name, preset, overrides) = RUNS[2];
    let a = digests(name, &run(tmp.path(), preset, overrides, &[]));
    let b = digests(name, &run(tmp.path(), preset, overrides, &["master_seed=7"]));
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(&b) {
        assert_ne!(x, y, "a digest did not move with the seed");
    }
}
