//! The real `onepass` binary on small specs in fresh temporary directories.

use arrow_array::{Array, Float64Array, StringArray, UInt32Array};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use std::path::{Path, PathBuf};

mod util;
use util::{npy_i64, onepass, write};

const PASSIVE: &str = r#"
setting = "passive"
seeds = 2
[env]
dim = 6
contexts = 20
arms = 4
eval_pairs = 200
[stream]
samples = 400
batch_size = 4
eval_every = 100
record_steps = true
[[estimator]]
kind = "omd-exact"
[[estimator]]
kind = "sgd"
lr = [0.1, 0.5]
[[estimator]]
kind = "mle"
refit_every = 10
"#;

fn read_table(path: &Path) -> Vec<arrow_array::RecordBatch> {
    let f = std::fs::File::open(path).unwrap();
    ParquetRecordBatchReaderBuilder::try_new(f).unwrap().build().unwrap().map(|b| b.unwrap()).collect()
}

fn col<'a, T: 'static>(b: &'a arrow_array::RecordBatch, name: &str) -> &'a T {
    b.column_by_name(name).unwrap_or_else(|| panic!("no column {name}")).as_any().downcast_ref::<T>().unwrap()
}

fn run_dir(stdout: &str) -> PathBuf {
    PathBuf::from(stdout.trim().lines().last().unwrap())
}

#[test]
fn passive_run_writes_every_table_and_methods_share_the_stream() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = write(tmp.path(), "tiny.toml", PASSIVE);
    let r = onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--out", "out"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let dir = tmp.path().join(run_dir(&r.stdout));
    for f in [
        "spec.resolved.toml",
        "meta.json",
        "cells.parquet",
        "metrics.parquet",
        "steps.parquet",
        "timings.parquet",
        "schema.json",
    ] {
        assert!(dir.join(f).is_file(), "{f} missing");
    }
    assert!(!std::fs::read_dir(&dir).unwrap().any(|e| e.unwrap().file_name().to_string_lossy().ends_with(".tmp")));
    // 4 configs (omd-exact, sgd ×2, mle) × 2 seeds
    let cells = &read_table(&dir.join("cells.parquet"))[0];
    assert_eq!(cells.num_rows(), 8);
    let (est, seed, hash) = (
        col::<StringArray>(cells, "estimator"),
        col::<UInt32Array>(cells, "seed"),
        col::<StringArray>(cells, "stream_hash"),
    );
    for s in 0..2 {
        let hashes: std::collections::BTreeSet<&str> =
            (0..8).filter(|&i| seed.value(i) == s).map(|i| hash.value(i)).collect();
        assert_eq!(hashes.len(), 1, "seed {s}: every method saw the same stream");
    }
    let h0 = (0..8).find(|&i| seed.value(i) == 0).unwrap();
    let h1 = (0..8).find(|&i| seed.value(i) == 1).unwrap();
    assert_ne!(hash.value(h0), hash.value(h1), "seeds differ");
    assert_eq!((0..8).filter(|&i| est.value(i) == "sgd").count(), 4);
    // metrics: 4 evaluation points per cell, pessimistic SubOpt on the last row only
    let m = &read_table(&dir.join("metrics.parquet"))[0];
    assert_eq!(m.num_rows(), 8 * 4);
    let pess = col::<Float64Array>(m, "subopt_pessimistic");
    assert_eq!(pess.len() - pess.null_count(), 8);
    let acc = col::<Float64Array>(m, "eval_accuracy");
    assert!((0..m.num_rows()).all(|i| (0.0..=1.0).contains(&acc.value(i))));
    // θ of every cell, as NPY
    let npy = std::fs::read(dir.join("theta/c0000.npy")).unwrap();
    assert_eq!(&npy[..6], b"\x93NUMPY");
    let hlen = u16::from_le_bytes([npy[8], npy[9]]) as usize;
    assert_eq!((10 + hlen) % 64, 0);
    assert!(String::from_utf8_lossy(&npy[10..10 + hlen]).contains("'shape': (6,)"));
    assert_eq!(npy.len(), 10 + hlen + 6 * 8);
    // the resolved spec runs the same cells
    let resolved = std::fs::read_to_string(dir.join("spec.resolved.toml")).unwrap();
    assert!(resolved.contains("refit_every = 10") && resolved.contains("eta = 1.0"), "{resolved}");
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json")).unwrap()).unwrap();
    assert_eq!(meta["master_seed"], 20251);
    assert!(meta["git_revision"].as_str().unwrap().len() >= 7);
    // git_dirty is a bool (or null without git), never the string "false" that reads as true
    assert!(meta["git_dirty"].is_boolean() || meta["git_dirty"].is_null(), "{}", meta["git_dirty"]);
    // the CPU the numbers came from, and where the relative paths were resolved
    assert!(!meta["cpu"]["model"].as_str().unwrap().is_empty() && meta["cpu"]["logical_cpus"].as_u64() >= Some(1));
    assert!(meta["cpu"]["features"].is_array(), "{}", meta["cpu"]);
    assert_eq!(meta["cwd"].as_str().map(std::path::PathBuf::from), Some(tmp.path().canonicalize().unwrap()));
    // --version names the revision meta.json records
    let v = onepass(tmp.path(), &["--version"]);
    assert!(v.stdout.contains(meta["git_revision"].as_str().unwrap()), "{}", v.stdout);
}

#[test]
fn same_spec_same_bytes_with_one_or_two_threads() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = write(tmp.path(), "tiny.toml", PASSIVE);
    let a = onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--out", "a", "--threads", "1"]);
    let b = onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--out", "b", "--threads", "2"]);
    assert_eq!(a.code, 0, "{}", a.stderr);
    assert_eq!(b.code, 0, "{}", b.stderr);
    let (da, db) = (tmp.path().join(run_dir(&a.stdout)), tmp.path().join(run_dir(&b.stdout)));
    for f in ["metrics.parquet", "steps.parquet", "cells.parquet", "spec.resolved.toml", "theta/c0003.npy"] {
        assert_eq!(std::fs::read(da.join(f)).unwrap(), std::fs::read(db.join(f)).unwrap(), "{f} differs");
    }
}

#[test]
fn threads_bound_candles_kernels_too_unless_the_user_set_them() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = write(tmp.path(), "tiny.toml", PASSIVE);
    let meta = |out: &str, env: Option<&str>| -> serde_json::Value {
        let mut c = util::command();
        c.current_dir(tmp.path()).args(["run", spec.to_str().unwrap(), "--out", out, "--threads", "1"]);
        c.env_remove("CANDLE_NUM_THREADS").env_remove("RAYON_NUM_THREADS");
        if let Some(v) = env {
            c.env("RAYON_NUM_THREADS", v);
        }
        let r = util::finish(&mut c);
        assert_eq!(r.code, 0, "{}", r.stderr);
        let dir = tmp.path().join(run_dir(&r.stdout));
        serde_json::from_slice(&std::fs::read(dir.join("meta.json")).unwrap()).unwrap()
    };
    // --threads 1: candle splits its products in one part, not one per core
    let m = meta("a", None);
    assert_eq!(m["threads"], 1);
    assert_eq!(m["candle_threads"], 1, "{m}");
    // a value the user set is kept (and the field reads what candle uses: a control)
    assert_eq!(meta("b", Some("3"))["candle_threads"], 3);
}

#[test]
fn schema_matches_the_committed_snapshot() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = write(tmp.path(), "tiny.toml", PASSIVE);
    let r = onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--out", "out"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let got = std::fs::read_to_string(tmp.path().join(run_dir(&r.stdout)).join("schema.json")).unwrap();
    let snap = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/snapshots/schema.json");
    if std::env::var("ONEPASS_UPDATE_SNAPSHOTS").is_ok() {
        std::fs::write(&snap, &got).unwrap();
    }
    let want = std::fs::read_to_string(&snap).expect("snapshot missing: run with ONEPASS_UPDATE_SNAPSHOTS=1");
    assert_eq!(got, want, "the result schema changed: review, then ONEPASS_UPDATE_SNAPSHOTS=1 cargo test");
}

#[test]
fn active_and_deploy_presets_run() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let tmp = tempfile::tempdir().unwrap();
    for (setting, extra) in [("active", "active.pool=500"), ("deploy", "deploy.q=4")] {
        let spec = root.join(format!("experiments/{setting}/synthetic.toml"));
        let r = onepass(
            tmp.path(),
            &[
                "run",
                spec.to_str().unwrap(),
                "--out",
                "out",
                "--set",
                "seeds=1",
                "--set",
                "stream.samples=200",
                "--set",
                "stream.eval_every=100",
                "--set",
                extra,
            ],
        );
        assert_eq!(r.code, 0, "{setting}: {}", r.stderr);
        let m = &read_table(&tmp.path().join(run_dir(&r.stdout)).join("metrics.parquet"))[0];
        let name = if setting == "active" { "subopt_avg" } else { "regret" };
        let c = col::<Float64Array>(m, name);
        assert_eq!(c.null_count(), 0, "{setting}: {name} on every row");
        if setting == "deploy" {
            assert!((0..c.len()).all(|i| c.value(i) >= 0.0), "regret is a sum of non-negative terms");
            let strat = col::<StringArray>(m, "strategy");
            assert!(strat.null_count() == 0 && (0..strat.len()).any(|i| strat.value(i) == "ucb"));
        }
    }
}

#[test]
fn a_failing_cell_is_recorded_and_the_sweep_goes_on() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = write(tmp.path(), "boom.toml", &PASSIVE.replace("lr = [0.1, 0.5]", "lr = [0.1, 1e38]\nclip = \"none\""));
    let r = onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--out", "out"]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(!r.stderr.contains("panicked"), "{}", r.stderr);
    let cells = &read_table(&tmp.path().join(run_dir(&r.stdout)).join("cells.parquet"))[0];
    let status = col::<StringArray>(cells, "status");
    let err = col::<StringArray>(cells, "err");
    let failed: Vec<usize> = (0..cells.num_rows()).filter(|&i| status.value(i) == "failed").collect();
    assert_eq!(failed.len(), 2, "the lr = 1e38 cells of both seeds");
    assert!(err.value(failed[0]).contains("non-finite"), "{}", err.value(failed[0]));
    assert_eq!((0..cells.num_rows()).filter(|&i| status.value(i) == "ok").count(), 6);
}

#[test]
fn bad_specs_name_the_file_the_key_and_the_line() {
    let tmp = tempfile::tempdir().unwrap();
    let cases: [(&str, &str, &[&str]); 7] = [
        ("typo.toml", "setting = \"passive\"\n[env]\ndimm = 4\n[[estimator]]\nkind = \"sgd\"\n", &["typo.toml:3", "dimm"]),
        ("kindkey.toml", "setting = \"passive\"\n[[estimator]]\nkind = \"omd-exact\"\nlr = 0.1\n", &["kindkey.toml:4", "estimator[0].lr", "not a hyper-parameter of `omd-exact`"]),
        ("range.toml", "setting = \"passive\"\n[[estimator]]\nkind = \"omd-exact\"\nlambda = -1.0\n", &["range.toml:4", "lambda", "expected a finite number > 0"]),
        ("k0.toml", "setting = \"passive\"\n[[estimator]]\nkind = \"omd-hvp-cg\"\ncg_steps = 0\n", &["k0.toml:4", "cg_steps", "K ≥ 1"]),
        ("q.toml", "setting = \"deploy\"\n[env]\narms = 4\n[deploy]\nstrategies = [\"best-quantile\"]\nq = 8\n[[estimator]]\nkind = \"sgd\"\n", &["q.toml:5", "deploy.strategies", "q = 8 with n = 4"]),
        ("kind.toml", "setting = \"passive\"\n[[estimator]]\nkind = \"omd\"\n", &["kind.toml:3", "unknown estimator `omd`"]),
        ("type.toml", "setting = \"passive\"\n[stream]\nsamples = \"many\"\n[[estimator]]\nkind = \"sgd\"\n", &["type.toml:3"]),
    ];
    for (name, text, wants) in cases {
        let spec = write(tmp.path(), name, text);
        let r = onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--out", "out"]);
        assert_eq!(r.code, 2, "{name}: {}", r.stderr);
        assert!(!r.stderr.contains("panicked"), "{name}: {}", r.stderr);
        assert_eq!(r.stderr.trim().lines().count(), 1, "{name}: one line: {}", r.stderr);
        for w in wants {
            assert!(r.stderr.contains(w), "{name}: `{w}` not in: {}", r.stderr);
        }
    }
    assert!(!tmp.path().join("out").exists(), "nothing is written for a bad spec");
    let r = onepass(tmp.path(), &["run", "missing.toml"]);
    assert_eq!(r.code, 2);
    assert!(r.stderr.contains("missing.toml") && r.stderr.contains("cannot read"), "{}", r.stderr);
}

#[test]
fn set_overrides_keys_and_estimator_entries() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = write(tmp.path(), "tiny.toml", PASSIVE);
    let r = onepass(
        tmp.path(),
        &[
            "run",
            spec.to_str().unwrap(),
            "--dry-run",
            "--set",
            "env.dim=9",
            "--set",
            "estimator.1.lr=[0.2]",
            "--set",
            "seeds=1",
        ],
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stdout.contains("dim = 9"), "{}", r.stdout);
    assert!(r.stdout.contains("lr = 0.2"), "{}", r.stdout);
    assert_eq!(r.stdout.lines().filter(|l| l.starts_with("# c")).count(), 3);
    let r = onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--dry-run", "--set", "estimator.7.lr=1"]);
    assert_eq!(r.code, 2);
    assert!(r.stderr.contains("estimator.7.lr") && r.stderr.contains("out of range"), "{}", r.stderr);
}

/// `--set estimator=[{…}, …]` replaces the spec's [[estimator]] tables by the inline tables given
/// (how a run keeps some of a preset's estimators): the plan has exactly their cells, in their
/// order, with their keys; the other keys of the spec stay. Negative controls: the spec's own
/// estimators without the override, and a list that is not of tables is refused.
#[test]
fn set_replaces_the_estimator_tables_by_a_list_of_inline_tables() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = write(tmp.path(), "tiny.toml", PASSIVE);
    let cells = |out: &str| -> Vec<String> {
        out.lines().filter(|l| l.starts_with("# c")).map(|l| l.split_whitespace().nth(2).unwrap().to_string()).collect()
    };
    let r = onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--dry-run"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(cells(&r.stdout), ["omd-exact", "omd-exact", "sgd", "sgd", "sgd", "sgd", "mle", "mle"], "{}", r.stdout);
    let r = onepass(
        tmp.path(),
        &[
            "run",
            spec.to_str().unwrap(),
            "--dry-run",
            "--set",
            r#"estimator=[{kind="mle", refit_every=5}, {kind="sgd", lr=0.3}]"#,
            "--set",
            "estimator.1.clip=2.0",
        ],
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(cells(&r.stdout), ["mle", "mle", "sgd", "sgd"], "{}", r.stdout);
    assert!(r.stdout.contains("refit_every = 5") && r.stdout.contains("lr = 0.3"), "{}", r.stdout);
    assert!(r.stdout.contains("clip = 2.0") && r.stdout.contains("dim = 6"), "{}", r.stdout);
    assert!(!r.stdout.contains("omd-exact") && !r.stdout.contains("refit_every = 10"), "{}", r.stdout);
    let r = onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--dry-run", "--set", "estimator=[1, 2]"]);
    assert_eq!(r.code, 2);
    assert!(r.stderr.contains("non-empty list of inline tables"), "{}", r.stderr);
}

#[test]
fn report_and_compare_read_a_run() {
    let tmp = tempfile::tempdir().unwrap();
    let text = format!("description = \"A tiny run: plumbing only.\"\n{PASSIVE}");
    let spec = write(tmp.path(), "tiny.toml", &text);
    let r = onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--out", "out"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let dir = tmp.path().join(run_dir(&r.stdout));
    let rep = onepass(tmp.path(), &["report", dir.to_str().unwrap()]);
    assert_eq!(rep.code, 0, "{}", rep.stderr);
    let md = std::fs::read_to_string(dir.join("report/report.md")).unwrap();
    for label in ["omd-exact", "sgd lr=0.1", "sgd lr=0.5", "mle refit_every=10"] {
        assert!(md.contains(&format!("| {label} | 2 |")), "{label} row in:\n{md}");
    }
    assert!(md.contains("subopt_pessimistic"));
    assert!(md.contains("A tiny run: plumbing only."), "{md}");
    assert!(md.contains("| sgd lr=0.5 | ") && md.contains("authors' κ"), "{md}");
    // θ over a synthetic bandit's features is the head of no model: no heads
    assert!(!md.contains("Reward heads") && !dir.join("report/heads").exists(), "{md}");
    // on a features file: the learned head of omd-exact, seed 0 (cell c0000) as score.weight
    // [1, d] f32
    let synthetic = dir.clone();
    write_pairs(&tmp.path().join("pairs.parquet"), 400, 6, true);
    let head = FEATURES.split("[[estimator]]").next().unwrap();
    let text = format!("{head}[[estimator]]\nkind = \"omd-exact\"\n[[estimator]]\nkind = \"sgd\"\nlr = [0.1, 0.5]\n");
    let spec = write(tmp.path(), "features.toml", &text);
    let r = onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--out", "out"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let dir = tmp.path().join(run_dir(&r.stdout));
    let rep = onepass(tmp.path(), &["report", dir.to_str().unwrap()]);
    assert_eq!(rep.code, 0, "{}", rep.stderr);
    assert!(std::fs::read_to_string(dir.join("report/report.md")).unwrap().contains("## Reward heads"));
    let bytes = std::fs::read(dir.join("report/heads/omd-exact.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let w = st.tensor("score.weight").unwrap();
    assert_eq!((w.dtype(), w.shape()), (safetensors::Dtype::F32, &[1usize, 6][..]));
    let theta = read_npy_f64(&dir.join("theta/c0000.npy"));
    let got: Vec<f32> = w.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(got, theta.iter().map(|&v| v as f32).collect::<Vec<_>>());
    assert!(theta.iter().any(|&v| v != 0.0));
    assert!(dir.join("report/heads/sgd_lr=0.1.safetensors").exists());
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    assert_eq!(header.metadata().as_ref().and_then(|m| m.get("cell_id")).map(String::as_str), Some("c0000"));
    // a second report of the same run writes the same head bytes (the header's key order used
    // to follow a HashMap's, which changes from process to process)
    for _ in 0..3 {
        let again = onepass(tmp.path(), &["report", dir.to_str().unwrap()]);
        assert_eq!(again.code, 0, "{}", again.stderr);
        assert_eq!(std::fs::read(dir.join("report/heads/omd-exact.safetensors")).unwrap(), bytes);
    }
    let dir = synthetic;
    if Path::new("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf").exists() {
        for f in ["eval_accuracy.png", "theta_err.svg", "cost.png"] {
            assert!(dir.join("report").join(f).metadata().unwrap().len() > 1000, "{f}");
        }
        assert!(md.contains("![cost](cost.png)"));
    }
    let cmp = onepass(tmp.path(), &["compare", dir.to_str().unwrap(), dir.to_str().unwrap()]);
    assert_eq!(cmp.code, 0, "{}", cmp.stderr);
    assert_eq!(cmp.stdout.lines().filter(|l| l.contains(": omd-exact |")).count(), 2);
    let bad = onepass(tmp.path(), &["report", tmp.path().join("nope").to_str().unwrap()]);
    assert_eq!(bad.code, 2);
    assert!(bad.stderr.contains("metrics.parquet"), "{}", bad.stderr);
}

/// Writes a "bring your own features" parquet: `n` pairs in dimension `d` from a fixed θ*,
/// with a `label` column (some rows say the rejected side won) unless `labels` is false.
fn write_pairs(path: &Path, n: usize, d: usize, labels: bool) -> (Vec<Vec<f32>>, Vec<Vec<f32>>, Vec<f32>) {
    use arrow_array::{ArrayRef, Int64Array};
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    let mut u = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f32 / (1u64 << 53) as f32 * 2.0 - 1.0
    };
    let theta: Vec<f32> = (0..d).map(|i| if i % 2 == 0 { 2.0 } else { -1.0 }).collect();
    let (mut ch, mut rj, mut y) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..n {
        let a: Vec<f32> = (0..d).map(|_| u()).collect();
        let b: Vec<f32> = (0..d).map(|_| u()).collect();
        let m: f32 = a.iter().zip(&b).zip(&theta).map(|((x, y), t)| (x - y) * t).sum();
        ch.push(a);
        rj.push(b);
        // the label agrees with θ* except every 7th row
        let agree = i % 7 != 0;
        y.push(if (m > 0.0) == agree { 1.0 } else { 0.0 });
    }
    // integer labels here; save_pairs' callers write float ones: the reader takes both
    let label: Option<ArrayRef> =
        labels.then(|| std::sync::Arc::new(Int64Array::from_iter_values(y.iter().map(|&v| v as i64))) as ArrayRef);
    write_parquet(path, &ch, &rj, label);
    (ch, rj, if labels { y } else { vec![1.0; n] })
}

fn read_npy_f64(path: &Path) -> Vec<f64> {
    let b = std::fs::read(path).unwrap();
    let hlen = u16::from_le_bytes([b[8], b[9]]) as usize;
    b[10 + hlen..].chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect()
}

const FEATURES: &str = r#"
setting = "passive"
seeds = 2
[env]
kind = "features"
path = "pairs.parquet"
eval_pairs = 100
order = "file"
[stream]
samples = 300
eval_every = 100
[[estimator]]
kind = "sgd"
lr = 0.5
clip = "none"
init = "zero"
[[estimator]]
kind = "omd-exact"
"#;

#[test]
fn bring_your_own_features_streams_the_file_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let (ch, rj, y) = write_pairs(&tmp.path().join("pairs.parquet"), 400, 5, true);
    let spec = write(tmp.path(), "byo.toml", FEATURES);
    let r = onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--out", "out"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let dir = tmp.path().join(run_dir(&r.stdout));
    // an independent f64 SGD over the first 300 rows in file order, z = chosen − rejected
    let mut theta = vec![0.0f64; 5];
    for i in 0..300 {
        let z: Vec<f64> = ch[i].iter().zip(&rj[i]).map(|(a, b)| f64::from(*a) - f64::from(*b)).collect();
        let m: f64 = z.iter().zip(&theta).map(|(a, b)| a * b).sum();
        let g = 1.0 / (1.0 + (-m).exp()) - f64::from(y[i]);
        theta.iter_mut().zip(&z).for_each(|(t, zj)| *t -= 0.5 * g * zj);
    }
    let got = read_npy_f64(&dir.join("theta/c0000.npy"));
    for (a, b) in got.iter().zip(&theta) {
        assert!((a - b).abs() < 1e-3 * (1.0 + b.abs()), "θ {got:?} vs independent SGD {theta:?}");
    }
    // no θ*: the truth columns are null; the held-out rows give a sensible accuracy
    let m = &read_table(&dir.join("metrics.parquet"))[0];
    assert_eq!(col::<Float64Array>(m, "theta_err").null_count(), m.num_rows());
    assert_eq!(col::<Float64Array>(m, "subopt").null_count(), m.num_rows());
    let acc = col::<Float64Array>(m, "eval_accuracy");
    assert!(acc.value(m.num_rows() - 1) > 0.7, "eval accuracy {}", acc.value(m.num_rows() - 1));
    // file order: every cell, both seeds, saw the same stream
    let c = &read_table(&dir.join("cells.parquet"))[0];
    let h = col::<StringArray>(c, "stream_hash");
    assert!((1..c.num_rows()).all(|i| h.value(i) == h.value(0)));
    let meta = std::fs::read_to_string(dir.join("meta.json")).unwrap();
    assert!(meta.contains("\"train_rows\": 300") && meta.contains("\"eval_rows\": 100"), "{meta}");
    let resolved = std::fs::read_to_string(dir.join("spec.resolved.toml")).unwrap();
    assert!(resolved.contains("dim = 5"), "{resolved}");

    // shuffled: the seeds differ, the methods of a seed agree; no label column means chosen wins
    write_pairs(&tmp.path().join("pairs.parquet"), 400, 5, false);
    let r = onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--out", "out", "--set", "env.order=shuffled"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let c = &read_table(&tmp.path().join(run_dir(&r.stdout)).join("cells.parquet"))[0];
    let (seed, h) = (col::<UInt32Array>(c, "seed"), col::<StringArray>(c, "stream_hash"));
    for i in 0..c.num_rows() {
        for j in 0..c.num_rows() {
            assert_eq!(seed.value(i) == seed.value(j), h.value(i) == h.value(j), "cells {i} and {j}");
        }
    }

    // active: the pool is every training row, labelled by the file
    let r = onepass(
        tmp.path(),
        &["run", spec.to_str().unwrap(), "--out", "out", "--set", "setting=active", "--set", "stream.samples=50"],
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    let m = &read_table(&tmp.path().join(run_dir(&r.stdout)).join("metrics.parquet"))[0];
    assert_eq!(col::<Float64Array>(m, "subopt_avg").null_count(), m.num_rows());
    assert_eq!(col::<arrow_array::UInt64Array>(m, "samples_seen").value(m.num_rows() - 1), 50);
}

#[test]
fn bad_features_files_name_the_file_the_row_and_the_column() {
    use arrow_array::builder::{Float32Builder, ListBuilder};
    use arrow_array::{ArrayRef, Float64Array as F64, RecordBatch};
    let tmp = tempfile::tempdir().unwrap();
    let spec = write(tmp.path(), "byo.toml", FEATURES);
    let save = |cols: Vec<(&str, ArrayRef)>| {
        let batch = RecordBatch::try_from_iter(cols).unwrap();
        let f = std::fs::File::create(tmp.path().join("pairs.parquet")).unwrap();
        let mut w = parquet::arrow::ArrowWriter::try_new(f, batch.schema(), None).unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
    };
    let list = |rows: &[&[f32]]| -> ArrayRef {
        let mut b = ListBuilder::new(Float32Builder::new());
        for r in rows {
            b.values().append_slice(r);
            b.append(true);
        }
        std::sync::Arc::new(b.finish())
    };
    let expect = |extra: &[&str], needles: &[&str]| {
        let mut args = vec!["run", spec.to_str().unwrap(), "--out", "out"];
        for e in extra {
            args.extend(["--set", e]);
        }
        let r = onepass(tmp.path(), &args);
        assert_eq!(r.code, 2, "{extra:?}: {}", r.stderr);
        for n in needles {
            assert!(r.stderr.contains(n), "{extra:?}: {n:?} not in {}", r.stderr);
        }
    };
    expect(&[], &["pairs.parquet", "cannot read"]);
    save(vec![("phi_chosen", list(&[&[1.0, 2.0]])), ("phi_other", list(&[&[1.0, 2.0]]))]);
    expect(&[], &["pairs.parquet", "no column `phi_rejected`", "phi_other"]);
    save(vec![("phi_chosen", list(&[&[1.0, 2.0], &[1.0, 2.0]])), ("phi_rejected", list(&[&[1.0, 2.0], &[1.0]]))]);
    expect(&[], &["pairs.parquet", "row 2, column `phi_rejected`", "has 1 values, expected 2"]);
    save(vec![("phi_chosen", list(&[&[1.0, f32::NAN]])), ("phi_rejected", list(&[&[1.0, 2.0]]))]);
    expect(&[], &["row 1, column `phi_chosen`", "element 1 is NaN"]);
    let rows: Vec<&[f32]> = vec![&[1.0, 2.0]; 3];
    save(vec![
        ("phi_chosen", list(&rows)),
        ("phi_rejected", list(&rows)),
        ("label", std::sync::Arc::new(F64::from(vec![1.0, 0.0, 0.5]))),
    ]);
    expect(&[], &["row 3, column `label`", "is 0.5, expected 0 or 1"]);
    write_pairs(&tmp.path().join("pairs.parquet"), 150, 3, true);
    expect(&[], &["stream.samples", "300", "only 50 training pairs"]);
    expect(&["stream.samples=10", "env.dim=4"], &["env.dim", "have 3 features"]);
    expect(&["stream.samples=10", "env.arms=4"], &["env.arms", "synthetic"]);
    expect(&["stream.samples=10", "env.eval_pairs=150"], &["env.eval_pairs", "only 150"]);
    expect(&["stream.samples=10", "setting=deploy"], &["env.kind", "deploy"]);
    expect(&["stream.samples=10", "env.kind=synthetic"], &["env.path", "features"]);
    expect(&["stream.samples=10", "env.eval_path=nope.parquet"], &["nope.parquet", "cannot read"]);
    let r = onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--out", "out", "--set", "stream.samples=10"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
}

fn save_pairs(path: &Path, ch: &[Vec<f32>], rj: &[Vec<f32>], y: &[f32]) {
    let label = std::sync::Arc::new(arrow_array::Float32Array::from(y.to_vec())) as arrow_array::ArrayRef;
    write_parquet(path, ch, rj, Some(label));
}

/// phi_chosen / phi_rejected list<float32> columns and an optional label column.
fn write_parquet(path: &Path, ch: &[Vec<f32>], rj: &[Vec<f32>], label: Option<arrow_array::ArrayRef>) {
    use arrow_array::builder::{Float32Builder, ListBuilder};
    use arrow_array::{ArrayRef, RecordBatch};
    let list = |rows: &[Vec<f32>]| -> ArrayRef {
        let mut b = ListBuilder::new(Float32Builder::new());
        for r in rows {
            b.values().append_slice(r);
            b.append(true);
        }
        std::sync::Arc::new(b.finish())
    };
    let mut cols = vec![("phi_chosen", list(ch)), ("phi_rejected", list(rj))];
    cols.extend(label.map(|l| ("label", l)));
    let batch = RecordBatch::try_from_iter(cols).unwrap();
    let mut w =
        parquet::arrow::ArrowWriter::try_new(std::fs::File::create(path).unwrap(), batch.schema(), None).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
}

/// With no bias term, presenting a pair the other way round (z → −z, y → 1 − y) is the same
/// observation: the loss, its gradient and its Hessian are unchanged. So swapping the sides of a
/// random half of the pairs must leave every estimator's trajectory the same (up to rounding in
/// σ(−m) vs 1 − σ(m)) — which is why labels are chosen-first and side swapping is not an option.
#[test]
fn swapping_sides_of_pairs_changes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let (ch, rj, y) = write_pairs(&tmp.path().join("pairs.parquet"), 400, 6, true);
    let (mut ch2, mut rj2, mut y2) = (ch.clone(), rj.clone(), y.clone());
    let mut flipped = 0;
    for i in 0..y.len() {
        if (i * 7919) % 13 < 6 {
            std::mem::swap(&mut ch2[i], &mut rj2[i]);
            y2[i] = 1.0 - y2[i];
            flipped += 1;
        }
    }
    assert!(flipped > 100);
    save_pairs(&tmp.path().join("swapped.parquet"), &ch2, &rj2, &y2);
    let spec = |file: &str| {
        format!(
            "setting = \"passive\"\nseeds = 2\n[env]\nkind = \"features\"\npath = \"{file}\"\neval_pairs = 100\norder = \"shuffled\"\n\
             [stream]\nsamples = 296\nbatch_size = 4\neval_every = 100\n\
             [[estimator]]\nkind = \"omd-exact\"\n[[estimator]]\nkind = \"omd-hvp-cg\"\nlr = 0.1\n[[estimator]]\nkind = \"sgd\"\nlr = 0.1\n\
             [[estimator]]\nkind = \"adam\"\nlr = 0.05\n[[estimator]]\nkind = \"mle\"\nrefit_every = 10\n"
        )
    };
    let mut dirs = Vec::new();
    for (name, file) in [("a.toml", "pairs.parquet"), ("b.toml", "swapped.parquet")] {
        std::fs::write(tmp.path().join(name), spec(file)).unwrap();
        let r = onepass(tmp.path(), &["run", name, "--out", &format!("out-{name}")]);
        assert_eq!(r.code, 0, "{}", r.stderr);
        dirs.push(tmp.path().join(run_dir(&r.stdout)));
    }
    let (ma, mb) = (&read_table(&dirs[0].join("metrics.parquet"))[0], &read_table(&dirs[1].join("metrics.parquet"))[0]);
    let (aa, ab) = (col::<Float64Array>(ma, "eval_accuracy"), col::<Float64Array>(mb, "eval_accuracy"));
    let (la, lb) = (col::<Float64Array>(ma, "eval_loss"), col::<Float64Array>(mb, "eval_loss"));
    assert_eq!(ma.num_rows(), mb.num_rows());
    for i in 0..ma.num_rows() {
        assert!((aa.value(i) - ab.value(i)).abs() < 1e-9, "row {i}: accuracy {} vs {}", aa.value(i), ab.value(i));
        assert!((la.value(i) - lb.value(i)).abs() < 1e-5 * la.value(i).abs().max(1.0), "row {i}: loss");
    }
    for c in 0..10 {
        let f = format!("theta/c{c:04}.npy");
        let (ta, tb) = (read_npy_f64(&dirs[0].join(&f)), read_npy_f64(&dirs[1].join(&f)));
        let scale = ta.iter().map(|v| v.abs()).fold(1e-12, f64::max);
        let diff = ta.iter().zip(&tb).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
        assert!(diff / scale < 1e-4, "cell {c}: θ differs by {diff} (scale {scale})");
        assert!(scale > 1e-3, "cell {c}: θ moved");
    }
    // the check has teeth: flipping z without flipping y is a different dataset
    let mut y3 = y.clone();
    for (i, v) in y3.iter_mut().enumerate() {
        if (i * 7919) % 13 < 6 {
            *v = 1.0 - *v;
        }
    }
    save_pairs(&tmp.path().join("wrong.parquet"), &ch, &rj, &y3);
    std::fs::write(tmp.path().join("c.toml"), spec("wrong.parquet")).unwrap();
    let r = onepass(tmp.path(), &["run", "c.toml", "--out", "c"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let tc = read_npy_f64(&tmp.path().join(run_dir(&r.stdout)).join("theta/c0000.npy"));
    let ta = read_npy_f64(&dirs[0].join("theta/c0000.npy"));
    assert!(ta.iter().zip(&tc).any(|(x, y)| (x - y).abs() > 1e-3), "flipping labels alone must change θ");
}

const RANKS: &str = r#"
setting = "passive"
seeds = 1
[env]
kind = "features"
path = "pairs.parquet"
eval_pairs = 100
order = "indices"
order_path = "perm.npy"
[stream]
samples = 240
batch_size = 8
eval_every = 80
[[estimator]]
kind = "omd-reference"
lr = 0.3
[[estimator]]
kind = "sgd"
lr = 0.5
"#;

/// `stream.ranks = 2`: each head equals a single-head run over its rows r, r+2, … of the order
/// file (θ of rank 0 byte for byte), and the run's held-out accuracy and loss are the heads' mean.
#[test]
fn rank_local_heads_and_order_files() {
    let tmp = tempfile::tempdir().unwrap();
    write_pairs(&tmp.path().join("pairs.parquet"), 400, 5, true);
    // a fixed permutation of the 300 training rows (as torch.randperm would give)
    let mut perm: Vec<i64> = (0..300).collect();
    let mut s = 12345u64;
    for i in (1..perm.len()).rev() {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        perm.swap(i, (s >> 33) as usize % (i + 1));
    }
    std::fs::write(tmp.path().join("perm.npy"), npy_i64(&perm)).unwrap();
    let spec = write(tmp.path(), "ranks.toml", RANKS);
    let run = |out: &str, sets: &[&str]| -> PathBuf {
        let mut args = vec!["run", spec.to_str().unwrap(), "--out", out];
        for s in sets {
            args.extend(["--set", s]);
        }
        let r = onepass(tmp.path(), &args);
        assert_eq!(r.code, 0, "{}", r.stderr);
        tmp.path().join(run_dir(&r.stdout))
    };
    let both = run("a", &["stream.ranks=2"]);
    // each rank's rows as its own order file, half the samples, one head
    let mut single = Vec::new();
    for k in 0..2 {
        let rows: Vec<String> = perm.iter().skip(k).step_by(2).map(|v| v.to_string()).collect();
        write(tmp.path(), &format!("rank{k}.txt"), &rows.join("\n"));
        single.push(run(
            &format!("r{k}"),
            &[&format!("env.order_path=rank{k}.txt"), "stream.samples=120", "stream.eval_every=40"],
        ));
    }
    for cell in ["c0000", "c0001"] {
        let a = std::fs::read(both.join(format!("theta/{cell}.npy"))).unwrap();
        let b = std::fs::read(single[0].join(format!("theta/{cell}.npy"))).unwrap();
        assert_eq!(a, b, "{cell}: rank 0's head differs from the single-head run over its rows");
    }
    let m = &read_table(&both.join("metrics.parquet"))[0];
    let m0 = &read_table(&single[0].join("metrics.parquet"))[0];
    let m1 = &read_table(&single[1].join("metrics.parquet"))[0];
    assert_eq!(m.num_rows(), m0.num_rows());
    let samples = col::<arrow_array::UInt64Array>(m, "samples_seen");
    assert_eq!((samples.value(0), samples.value(m.num_rows() - 1)), (80, 240));
    for k in ["eval_accuracy", "eval_loss", "train_loss"] {
        let (a, b, c) = (col::<Float64Array>(m, k), col::<Float64Array>(m0, k), col::<Float64Array>(m1, k));
        for i in 0..m.num_rows() {
            assert!((a.value(i) - 0.5 * (b.value(i) + c.value(i))).abs() < 1e-12, "{k} row {i}");
        }
    }
    // the two heads really differ (else the mean test proves nothing)
    assert_ne!(
        col::<Float64Array>(m0, "eval_loss").value(m0.num_rows() - 1),
        col::<Float64Array>(m1, "eval_loss").value(m1.num_rows() - 1)
    );

    // bad order files (read by the world, before any cell) and rank settings: named, exit 2
    for (text, needle) in [
        ("0 1 1", "index 1 appears twice"),
        ("0 300", "entry 1: 300 is not a training-row index (expected 0..300)"),
        ("0 x", "entry 1: `x` is not an integer"),
    ] {
        write(tmp.path(), "bad.txt", text);
        let r =
            onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--set", "env.order_path=bad.txt", "--out", "bad"]);
        assert_eq!(r.code, 2, "{}", r.stderr);
        assert!(!tmp.path().join("bad").exists(), "nothing written before the data are checked");
        assert!(r.stderr.contains("bad.txt") && r.stderr.contains(needle), "{}", r.stderr);
    }
    let r = onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--set", "env.order=file", "--dry-run"]);
    assert!(r.code == 2 && r.stderr.contains("order_path") && r.stderr.contains("\"indices\" only"), "{}", r.stderr);
    let r = onepass(
        tmp.path(),
        &["run", spec.to_str().unwrap(), "--set", "stream.ranks=2", "--set", "setting=active", "--dry-run"],
    );
    assert!(r.code == 2 && r.stderr.contains("stream.ranks"), "{}", r.stderr);
}

/// Active rules and deployment strategies are one vocabulary: every strategy name is an active
/// rule on a fresh context's arms; their labels, strategy column and θ differ, and a strategy
/// the arms cannot hold is refused like in deploy.
#[test]
fn active_rules_take_every_deploy_strategy() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = write(
        tmp.path(),
        "act.toml",
        r#"
setting = "active"
seeds = 1
[env]
dim = 5
contexts = 30
arms = 6
eval_pairs = 100
[stream]
samples = 60
batch_size = 2
eval_every = 20
[active]
rule = ["best-worst", "best-two", "ucb", "best-quantile", "random-pair", "pool-argmax"]
pool = 200
q = 2
beta = 0.5
[[estimator]]
kind = "sgd"
lr = 0.5
"#,
    );
    let r = onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--out", "o"]);
    let dir = tmp.path().join(r.dir());
    let cells = util::table(&dir.join("cells.parquet"));
    let strategies = util::strs(&cells, "strategy");
    assert_eq!(strategies, ["best-worst", "best-two", "ucb", "best-quantile", "random-pair", "pool-argmax"]);
    assert!(util::strs(&cells, "status").iter().all(|s| s == "ok"));
    let thetas: Vec<Vec<u8>> = (0..6).map(|i| std::fs::read(dir.join(format!("theta/c{i:04}.npy"))).unwrap()).collect();
    for i in 0..6 {
        for j in 0..i {
            assert_ne!(thetas[i], thetas[j], "rules {i} and {j} labelled the same pairs");
        }
    }
    // best-quantile with q ≥ n arms is refused at the plan, as in deploy
    let r = onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--set", "active.q=6", "--dry-run"]);
    assert!(r.code == 2 && r.stderr.contains("active.rule") && r.stderr.contains("best-quantile"), "{}", r.stderr);
    let r = onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--set", "active.rule=best-three", "--dry-run"]);
    assert!(r.code == 2 && r.stderr.contains("unknown rule `best-three`"), "{}", r.stderr);
}

/// The issue's reproduction of large features (‖z‖² ≈ 1,700) and a small θ*, on passive/synthetic.
const LARGE_Z: &[&str] = &[
    "--set",
    "seeds=1",
    "--set",
    "stream.samples=4000",
    "--set",
    "env.feature_norm=30",
    "--set",
    "env.theta_norm=0.1",
];

/// Regression: large features and a small θ* gave a pair whose gradient underflowed; CG divided
/// by pᵀAp = 0 and omd-hvp-cg's θ became ∞ ("θ became non-finite"). Every cell now finishes.
#[test]
fn omd_hvp_cg_survives_underflowing_gradients() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = util::root().join("experiments/passive/synthetic.toml");
    let r = onepass(tmp.path(), &[&["run", spec.to_str().unwrap(), "--out", "o"][..], LARGE_Z].concat());
    assert_eq!(r.code, 0, "{}", r.stderr);
    let cells = util::table(&tmp.path().join(r.dir()).join("cells.parquet"));
    assert!(util::strs(&cells, "status").iter().all(|s| s == "ok"), "{:?}", util::strs(&cells, "err"));
}

/// A closed stdout ends `onepass` quietly (SIGPIPE), not with a panic (exit 101).
#[test]
fn a_closed_pipe_is_not_a_panic() {
    use std::io::BufRead;
    let tmp = tempfile::tempdir().unwrap();
    let spec = util::root().join("experiments/passive/synthetic.toml");
    // ~180,000 cell lines: more than a pipe holds, so the writer meets the closed end
    let mut child = util::command()
        .current_dir(tmp.path())
        .args(["run", spec.to_str().unwrap(), "--set", "seeds=20000", "--dry-run"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut first).unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert_ne!(out.status.code(), Some(101), "{err}");
    assert!(!first.is_empty());
}

/// The report says what failed and reports what exists: a failed cell is named with its error;
/// a run killed before writing θ and meta.json still gets a report (marked unfinished), and no
/// half-written report/ is left by a failure.
#[test]
fn report_names_failed_cells_and_reports_unfinished_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let text = PASSIVE.to_string() + "[[estimator]]\nkind = \"sgd\"\nlr = 1e300\nclip = \"none\"\n";
    let spec = write(tmp.path(), "f.toml", &text);
    let r = onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--out", "o"]);
    assert_eq!(r.code, 1, "a cell must fail: {}", r.stderr);
    let dir = tmp.path().join(r.dir_any());
    let rep = onepass(tmp.path(), &["report", dir.to_str().unwrap()]);
    assert_eq!(rep.code, 0, "{}", rep.stderr);
    let md = std::fs::read_to_string(dir.join("report/report.md")).unwrap();
    assert!(md.contains("## Failed cells") && md.contains("non-finite"), "{md}");
    assert!(!md.contains("unfinished"), "{md}");
    // an unfinished run: no meta.json, θ files not yet written
    std::fs::remove_file(dir.join("meta.json")).unwrap();
    for e in std::fs::read_dir(dir.join("theta")).unwrap() {
        std::fs::remove_file(e.unwrap().path()).unwrap();
    }
    let rep = onepass(tmp.path(), &["report", dir.to_str().unwrap()]);
    assert_eq!(rep.code, 0, "{}", rep.stderr);
    let md = std::fs::read_to_string(dir.join("report/report.md")).unwrap();
    assert!(md.contains("**This run is unfinished**"), "{md}");
    assert!(!dir.join("report.tmp").exists());
    // a report that fails (an unreadable cells.parquet) leaves the previous report whole
    std::fs::write(dir.join("cells.parquet"), b"not parquet").unwrap();
    let bad = onepass(tmp.path(), &["report", dir.to_str().unwrap()]);
    assert_eq!(bad.code, 2, "{}", bad.stderr);
    assert_eq!(std::fs::read_to_string(dir.join("report/report.md")).unwrap(), md);
}

/// Progress in a log (stderr redirected): one plain line per update with ONEPASS_PROGRESS_EVERY=0
/// (done/total, rate, ETA), the stage's last line at its end; at the default interval a short run
/// prints only the end line; `--quiet` prints none of them.
#[test]
fn a_redirected_run_prints_progress_lines() {
    let tmp = tempfile::tempdir().unwrap();
    write(tmp.path(), "spec.toml", PASSIVE);
    let run = |every: Option<&str>, extra: &[&str]| {
        let mut c = util::command();
        c.current_dir(tmp.path()).args(["run", "spec.toml", "--out", "out", "--set", "stream.samples=40"]).args(extra);
        if let Some(e) = every {
            c.env("ONEPASS_PROGRESS_EVERY", e);
        } else {
            c.env_remove("ONEPASS_PROGRESS_EVERY");
        }
        let r = util::finish(&mut c);
        assert_eq!(r.code, 0, "{}", r.stderr);
        r.stderr.lines().filter(|l| l.starts_with("onepass: running cells: ")).map(String::from).collect::<Vec<_>>()
    };
    let every = run(Some("0"), &[]);
    // 4 configs × 2 seeds: a line per finished cell, then the end line
    assert_eq!(every.len(), 9, "{every:?}");
    for (i, l) in every.iter().take(8).enumerate() {
        assert!(l.starts_with(&format!("onepass: running cells: {}/8 cells (", i + 1)), "{l}");
        assert!(l.contains(" cells/s"), "{l}");
    }
    assert!(every[6].contains("ETA "), "{}", every[6]);
    assert!(every[8].starts_with("onepass: running cells: 8/8 cells (100%)") && every[8].contains("done in"));
    let default = run(None, &[]);
    assert_eq!(default.len(), 1, "{default:?}");
    assert!(default[0].contains("8/8 cells (100%)"), "{default:?}");
    assert!(run(Some("0"), &["--quiet"]).is_empty());
    assert!(run(Some("0"), &["-q"]).is_empty());
}

/// λ = "auto" (issue 18, item 4): on features with ‖z‖² ≈ 1,700, omd-exact at λ = 1 overshoots
/// into σ′ ≈ 0 and ends far from θ* (the negative control, with the warning and meta.json's
/// ratio); at λ = "auto" (the median ‖z‖² of the first pairs) it ends as close as mle.
#[test]
fn lambda_auto_follows_the_scale_of_the_data() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = util::root().join("experiments/passive/synthetic.toml");
    let run = |lambda: &str| {
        let set = format!("estimator.0.lambda={lambda}");
        let args = [&["run", spec.to_str().unwrap(), "--out", "out"][..], LARGE_Z, &["--set", &set]].concat();
        let r = onepass(tmp.path(), &args);
        let dir = tmp.path().join(r.dir());
        let m = util::table(&dir.join("metrics.parquet"));
        let (labels, loss, err) = (util::strs(&m, "label"), util::f64s(&m, "eval_loss"), util::f64s(&m, "theta_err"));
        // by kind: omd-exact's label shows λ when it is not the default 1
        let last = |l: &str| {
            let i = labels.iter().rposition(|x| x.split(' ').next() == Some(l)).unwrap();
            (loss[i], err[i])
        };
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json")).unwrap()).unwrap();
        (last("omd-exact"), last("mle"), meta["data_scale"].clone(), r.stderr)
    };
    let ((loss1, err1), _, scale1, stderr1) = run("1.0");
    let median = scale1["median_z_sq"].as_f64().unwrap();
    assert!(median > 1000.0, "{scale1}");
    let omd1 = scale1["lambdas"].as_array().unwrap().iter().find(|l| l["config"] == "omd-exact").unwrap().clone();
    assert_eq!(omd1["median_z_sq_over_lambda"].as_f64(), Some(median));
    assert!(stderr1.contains("warning: median ‖z‖² / λ ="), "{stderr1}");
    assert!(loss1 > 2.0 && err1 > 1.0, "λ = 1 should overshoot here: loss {loss1}, θ-error {err1}");
    let ((loss, err), (mle_loss, mle_err), scale, _) = run("auto");
    let omd =
        scale["lambdas"].as_array().unwrap().iter().find(|l| l["config"] == "omd-exact lambda=auto").unwrap().clone();
    assert_eq!(omd["auto"], true);
    assert_eq!(omd["lambda"].as_f64(), Some(median), "auto = the median ‖z‖²");
    assert!(
        (loss - mle_loss).abs() < 0.05 && err < 2.0 * mle_err,
        "auto: loss {loss} vs mle {mle_loss}, θ-error {err} vs {mle_err}"
    );
}

/// Width and height of a PNG (its IHDR chunk).
fn png_size(path: &Path) -> (u32, u32) {
    let b = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(&b[..8], b"\x89PNG\r\n\x1a\n", "{}: not a PNG", path.display());
    let be = |i: usize| u32::from_be_bytes(b[i..i + 4].try_into().unwrap());
    (be(16), be(20))
}

/// Every setting's report draws its figures (issue 19): non-trivial PNGs and SVGs; one panel
/// per estimator when labels carry a strategy (deploy: 2 estimators → 2 panels side by side), a
/// single panel otherwise (passive); the time bars for each; titles name the data.
#[test]
fn every_setting_draws_readable_figures() {
    if !Path::new("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf").exists()
        && std::env::var_os("ONEPASS_FONT").is_none()
    {
        eprintln!("no font: the report writes tables only (tested elsewhere)");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let root = util::root().join("experiments");
    let mut widths = std::collections::BTreeMap::new();
    for (setting, extra) in
        [("passive", "stream.samples=400"), ("active", "stream.samples=200"), ("deploy", "stream.samples=400")]
    {
        let spec = root.join(setting).join("synthetic.toml");
        let r =
            onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--out", setting, "--set", "seeds=2", "--set", extra]);
        let dir = tmp.path().join(r.dir());
        let rep = onepass(tmp.path(), &["report", dir.to_str().unwrap()]);
        assert_eq!(rep.code, 0, "{}", rep.stderr);
        let fig = dir.join("report");
        for f in ["eval_accuracy", "time_per_cell"] {
            let png = fig.join(format!("{f}.png"));
            assert!(png.metadata().unwrap().len() > 10_000, "{setting}: {f}.png is near empty");
            let svg = std::fs::read_to_string(fig.join(format!("{f}.svg"))).unwrap();
            assert!(svg.contains("synthetic bandit"), "{setting}: the subtitle names the data");
        }
        let svg = std::fs::read_to_string(fig.join("eval_accuracy.svg")).unwrap();
        // plotters writes each text on its own line
        let texts: Vec<&str> = svg.lines().map(str::trim).collect();
        assert!(texts.contains(&"Held-out accuracy"), "{setting}");
        assert!(
            !texts.iter().any(|t| t.starts_with("-0") && t.trim_start_matches(['-', '0', '.']).is_empty()),
            "{setting}: a -0 tick"
        );
        widths.insert(setting, png_size(&fig.join("eval_accuracy.png")));
    }
    // passive: labels are estimators only → one panel; deploy: omd-exact and mle panels
    let (pw, _) = widths["passive"];
    let (dw, _) = widths["deploy"];
    assert!(dw > pw + 100, "deploy draws two panels side by side: {widths:?}");
    let svg = std::fs::read_to_string(
        std::fs::read_dir(tmp.path().join("deploy")).unwrap().next().unwrap().unwrap().path().join("report/regret.svg"),
    )
    .unwrap();
    // a panel title per estimator, the strategies once each in the legend
    let texts: Vec<&str> = svg.lines().map(str::trim).collect();
    assert!(texts.contains(&"omd-exact") && texts.contains(&"mle refit_every=100"), "panel captions");
    assert_eq!(texts.iter().filter(|t| **t == "best-two").count(), 1, "one legend entry per strategy");
}

/// The justfile's `reproduce-*` recipes run the binary where cargo puts it: with
/// `CARGO_TARGET_DIR` set (shared machines) that is not ./target (issue 34: every recipe failed
/// with "No such file or directory"). The recipes' script's own line is run with the variable set
/// and must name `$CARGO_TARGET_DIR/release/onepass`; neither the justfile nor the script names
/// `target/release/onepass` itself.
#[test]
fn the_justfile_finds_the_binary_under_cargo_target_dir() {
    let root = util::root();
    let just = std::fs::read_to_string(root.join("justfile")).unwrap();
    // the recipes run scripts/reproduce.sh (arguments passed on as typed)
    let script = std::fs::read_to_string(root.join("scripts/reproduce.sh")).unwrap();
    assert!(just.contains("scripts/reproduce.sh deploy \"$@\""), "reproduce-deploy runs the script");
    assert!(!just.contains("target/release/onepass"), "a recipe names ./target's binary");
    assert!(!script.contains("target/release/onepass"), "the script names ./target's binary");
    let line = script.lines().map(str::trim).find(|l| l.starts_with("bin=")).expect("the script's bin= line");
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new("bash")
        .arg("-c")
        .arg(format!("{line}\nprintf '%s' \"$bin\""))
        .current_dir(&root)
        .env("CARGO_TARGET_DIR", dir.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let bin = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(std::path::Path::new(&bin), dir.path().join("release/onepass"), "{bin}");
}

/// `--dry-run` says what each config resolves to for its cells on the synthetic bandit (ucb's
/// β = "theory" = √d·log(T/δ), λ = "auto" a number) and, for data it has not read, what waits
/// for the data; a numeric β prints no resolution (negative control).
#[test]
fn dry_run_names_what_it_resolves_and_what_waits_for_the_data() {
    let tmp = tempfile::tempdir().unwrap();
    let text = "setting = \"deploy\"\n[env]\ndim = 16\n[stream]\nsamples = 200\n[deploy]\nstrategies = [\"ucb\"]\nbeta = \"theory\"\ndelta = 0.1\n[[estimator]]\nkind = \"omd-exact\"\nlambda = \"auto\"\n";
    let spec = write(tmp.path(), "syn.toml", text);
    let r = onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--dry-run"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let line = r
        .stdout
        .lines()
        .find(|l| l.starts_with("# resolved: omd-exact lambda=auto / ucb"))
        .unwrap_or_else(|| panic!("{}", r.stdout));
    let num = |after: &str| -> f64 {
        let rest = &line[line.find(after).unwrap_or_else(|| panic!("{after}: {line}")) + after.len()..];
        rest.split_whitespace().next().unwrap().parse().unwrap()
    };
    let want = 4.0 * (200f64 / 0.1).ln();
    assert!((num("ucb β = ") - want).abs() < 1e-9 * want, "{line}");
    let lambda = num("λ = ");
    assert!(lambda.is_finite() && lambda > 0.0, "{line}");
    let r = onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--dry-run", "--set", "deploy.beta=2.0"]);
    assert!(!r.stdout.contains("ucb β ="), "a number needs no resolution: {}", r.stdout);
    // a dataset's dimension comes from its model: the dry run names it and reads nothing
    let data = "setting = \"passive\"\n[env]\nkind = \"dataset\"\n[data]\npath = \"none.jsonl\"\nmodel = \"none.gguf\"\n[[estimator]]\nkind = \"omd-exact\"\nlambda = \"auto\"\n";
    let spec = write(tmp.path(), "data.toml", data);
    let r = onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--dry-run"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stdout.contains("# waits for the data: env.dim"), "{}", r.stdout);
    assert!(r.stdout.contains("# waits for the data: omd-exact lambda=auto: λ"), "{}", r.stdout);
}
