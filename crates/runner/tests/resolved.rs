//! A run's `spec.resolved.toml` is a spec: `onepass run RUN/spec.resolved.toml` runs the same
//! cells to the same bytes (every parquet table but the timings, θ, adapters) — on each
//! setting's synthetic preset, a deployment on generated responses and an online run; the
//! negative control (one value edited) gives other bytes. `--dry-run`'s output is a spec too.
//! Every table and column these runs write is documented (`runner::columns`, the reference's
//! result tables).

use std::path::{Path, PathBuf};

mod util;
use util::{onepass, result_files};

/// The files a re-run must reproduce: the tables (not the timings), θ and adapters.
fn outputs(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    result_files(dir)
        .into_iter()
        .filter(|(p, _)| {
            let top = p.components().next().unwrap().as_os_str().to_string_lossy().into_owned();
            p.extension().is_some_and(|x| x == "parquet") && p.components().count() == 1
                || top == "theta"
                || top == "adapters"
        })
        .collect()
}

fn run(cwd: &Path, spec: &str, out: &str, sets: &[&str]) -> PathBuf {
    let mut args = vec!["run", spec, "--out", out, "--threads", "2"];
    for s in sets {
        args.extend(["--set", s]);
    }
    let (code, stdout, err) = onepass(cwd, &args).parts();
    assert_eq!(code, 0, "onepass {args:?}:\n{err}");
    cwd.join(stdout.lines().last().unwrap().trim())
}

/// Runs `spec` with `sets`, then its resolved spec, and compares; then the resolved spec with
/// `edit` (the negative control) and checks the bytes differ.
fn round_trip(cwd: &Path, spec: &str, sets: &[&str], edit: &str) {
    let first = run(cwd, spec, "a", sets);
    let schema = std::fs::read_to_string(first.join("schema.json")).unwrap();
    let undocumented = runner::columns::undocumented(&schema).unwrap();
    assert!(undocumented.is_empty(), "{spec}: columns with no doc in columns.rs:\n{}", undocumented.join("\n"));
    let resolved = first.join("spec.resolved.toml");
    let text = std::fs::read_to_string(&resolved).unwrap();
    let again = run(cwd, resolved.to_str().unwrap(), "b", &[]);
    let (x, y) = (outputs(&first), outputs(&again));
    assert!(x.len() >= 3, "{:?}", x.iter().map(|f| &f.0).collect::<Vec<_>>());
    assert_eq!(x.iter().map(|f| &f.0).collect::<Vec<_>>(), y.iter().map(|f| &f.0).collect::<Vec<_>>());
    for ((p, a), (_, b)) in x.iter().zip(&y) {
        assert!(a == b, "{spec}: {} differs when re-run from its spec.resolved.toml:\n{text}", p.display());
    }
    // the resolved spec of the re-run is the same text
    assert_eq!(std::fs::read_to_string(again.join("spec.resolved.toml")).unwrap(), text);
    let edited = run(cwd, resolved.to_str().unwrap(), "c", &[edit]);
    let z = outputs(&edited);
    assert!(x.iter().zip(&z).any(|((_, a), (_, b))| a != b), "{spec}: `--set {edit}` changed no byte");
}

fn preset(setting: &str) -> String {
    util::root().join("experiments").join(setting).join("synthetic.toml").display().to_string()
}

#[test]
fn passive_synthetic_reruns_from_its_resolved_spec() {
    let dir = tempfile::tempdir().unwrap();
    round_trip(
        dir.path(),
        &preset("passive"),
        &["seeds=2", "stream.samples=400", "stream.record_steps=true"],
        "master_seed=7",
    );
}

#[test]
fn active_synthetic_reruns_from_its_resolved_spec() {
    let dir = tempfile::tempdir().unwrap();
    round_trip(dir.path(), &preset("active"), &["seeds=2", "stream.samples=200"], "master_seed=7");
}

#[test]
fn deploy_synthetic_reruns_from_its_resolved_spec() {
    let dir = tempfile::tempdir().unwrap();
    round_trip(dir.path(), &preset("deploy"), &["seeds=2", "stream.samples=200"], "master_seed=7");
}

/// A deployment on generated responses (the tiny GGUF generates, φ, a linear oracle): the
/// resolved spec states d, the bank's shape and the pairs the data gave.
const GENERATED: &str = r#"
setting = "deploy"
seeds = 2
[env]
kind = "generated"
eval_pairs = 30
[generate]
prompts = "prompts.jsonl"
rows = 6
policy = "{g}"
n = 3
max_new_tokens = 5
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
batch_size = 1
[deploy]
chunks = 2
strategies = ["best-quantile"]
q = 2
policy = {policy}
[[estimator]]
kind = "sgd"
lr = 0.1
"#;

fn generated(policy: &str, extra: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    util::write_prompts(dir.path());
    let text = GENERATED.replace("{g}", &util::tiny_gguf().display().to_string()).replace("{policy}", policy);
    std::fs::write(dir.path().join("run.toml"), format!("{text}{extra}")).unwrap();
    dir
}

#[test]
fn generated_deploy_reruns_from_its_resolved_spec() {
    let dir = generated("\"best-of-n\"", "");
    round_trip(dir.path(), "run.toml", &[], "oracle.seed=4");
    // the data's facts are values, not placeholders
    let first = std::fs::read_dir(dir.path().join("a")).unwrap().next().unwrap().unwrap().path();
    let text = std::fs::read_to_string(first.join("spec.resolved.toml")).unwrap();
    let spec: toml::Table = toml::from_str(&text).unwrap();
    assert!(spec["env"].get("contexts").is_none() && spec["env"].get("arms").is_none(), "{text}");
    assert!(spec.get("passive").is_none() && spec.get("active").is_none(), "{text}");
    assert_eq!(spec["stream"]["samples"].as_integer(), Some(6), "{text}");
}

#[test]
fn online_run_reruns_from_its_resolved_spec() {
    let extra = "[policy]\nrank = 2\nalpha = 4.0\nlr = 0.01\nepochs = 1\nminibatch = 3\neval_prompts = 2\n";
    let dir = generated("[\"best-of-n\", \"rloo\"]", extra);
    round_trip(dir.path(), "run.toml", &["seeds=1"], "policy.lr=0.02");
}

/// What `--dry-run` prints is a spec `onepass run` takes (a kind's keys only, no placeholders).
#[test]
fn dry_run_output_is_a_spec() {
    let dir = tempfile::tempdir().unwrap();
    for setting in ["passive", "active", "deploy"] {
        let (code, out, err) = onepass(dir.path(), &["run", &preset(setting), "--dry-run"]).parts();
        assert_eq!(code, 0, "{err}");
        let f = dir.path().join(format!("{setting}.toml"));
        std::fs::write(&f, &out).unwrap();
        let (code, _, err) = onepass(dir.path(), &["run", f.to_str().unwrap(), "--dry-run"]).parts();
        assert_eq!(code, 0, "{setting}: the dry run's output is refused:\n{err}\n{out}");
    }
    let g = generated("\"best-of-n\"", "");
    let (code, out, err) = onepass(g.path(), &["run", "run.toml", "--dry-run"]).parts();
    assert_eq!(code, 0, "{err}");
    let spec: toml::Table = toml::from_str(&out).unwrap();
    assert!(spec["env"].get("dim").is_none(), "a placeholder d:\n{out}");
    std::fs::write(g.path().join("dry.toml"), &out).unwrap();
    let (code, _, err) = onepass(g.path(), &["run", "dry.toml", "--dry-run"]).parts();
    assert_eq!(code, 0, "{err}");
}
