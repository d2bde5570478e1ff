//! `onepass features extract` with SmolLM2 (models/, `just fetch-models`) on a small HH-RLHF
//! file: the second run is all cache hits and gives the same bytes; the output feeds a
//! `kind = "features"` run.

use std::path::PathBuf;
use std::process::Command;

mod util;
use util::onepass;

fn hh_line(q: &str, a: &str, b: &str) -> String {
    serde_json::json!({
        "chosen": format!("\n\nHuman: {q}\n\nAssistant: {a}"),
        "rejected": format!("\n\nHuman: {q}\n\nAssistant: {b}"),
    })
    .to_string()
}

#[test]
fn extract_twice_hits_the_cache_and_feeds_a_features_run() {
    let tmp = tempfile::tempdir().unwrap();
    let lines = [
        hh_line("What is 2+2?", "4.", "5."),
        hh_line("Name a colour.", "Blue.", "I would rather not."),
        hh_line("Say hi.", "Hi!", "Hi!"), // identical sides: a degenerate pair
        hh_line(&"Please read this long story. ".repeat(40), "It was long.", "It was short."),
        hh_line("Capital of France?", "Paris.", "Lyon."),
        hh_line("Is water wet?", "Yes, in the everyday sense.", "No."),
    ];
    std::fs::write(tmp.path().join("hh.jsonl"), lines.join("\n") + "\n").unwrap();
    let args = |out: &str| {
        vec![
            "features".to_string(),
            "extract".into(),
            "--model".into(),
            util::smollm2(),
            "--dataset".into(),
            "hh.jsonl".into(),
            "--max-len".into(),
            "64".into(),
            "--batch".into(),
            "4".into(),
            "--out".into(),
            out.into(),
        ]
    };
    let a1: Vec<String> = args("a.parquet");
    // stderr is a pipe here, as in a log: progress comes as plain lines (every update with
    // ONEPASS_PROGRESS_EVERY=0), the last one when the stage ends
    let (code, stdout, stderr) =
        util::finish(util::command().current_dir(tmp.path()).env("ONEPASS_PROGRESS_EVERY", "0").args(&a1)).parts();
    assert_eq!(code, 0, "{stderr}");
    let progress: Vec<&str> = stderr.lines().filter(|l| l.starts_with("onepass: φ extraction: ")).collect();
    assert!(progress.len() >= 2, "{stderr}");
    assert!(progress.iter().all(|l| l.contains("/11 sequences (") && l.contains(" sequences/s")), "{stderr}");
    let last = progress.last().unwrap();
    assert!(last.contains("11/11 sequences (100%)") && last.contains("done in"), "{last}");
    assert!(!stderr.contains('\r') && !stderr.contains('\u{1b}'), "no terminal control codes in a log: {stderr:?}");
    let s: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!((s["pairs"].as_u64(), s["hits"].as_u64(), s["misses"].as_u64()), (Some(6), Some(0), Some(11)));
    assert_eq!(s["degenerate_pairs"].as_u64(), Some(1));
    assert_eq!(s["truncated_sequences"].as_u64(), Some(2));
    assert_eq!(s["dim"].as_u64(), Some(576));
    let a2: Vec<String> = args("b.parquet");
    let (code, stdout, stderr) = onepass(tmp.path(), &a2.iter().map(String::as_str).collect::<Vec<_>>()).parts();
    assert_eq!(code, 0, "{stderr}");
    let s2: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!((s2["hits"].as_u64(), s2["misses"].as_u64()), (Some(12), Some(0)), "{stdout}");
    assert_eq!(
        std::fs::read(tmp.path().join("a.parquet")).unwrap(),
        std::fs::read(tmp.path().join("b.parquet")).unwrap()
    );

    // a different option is a different cache space: nothing is reused
    let mut a3 = args("c.parquet");
    a3.extend(["--pool".into(), "mean".into(), "--quiet".into()]);
    let (code, stdout, stderr) =
        util::finish(util::command().current_dir(tmp.path()).env("ONEPASS_PROGRESS_EVERY", "0").args(&a3)).parts();
    assert_eq!(code, 0, "{stderr}");
    assert!(!stderr.contains("φ extraction:"), "--quiet prints no progress: {stderr}");
    let s3: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(s3["hits"].as_u64(), Some(0));

    // the pairs file is a features environment
    std::fs::write(
        tmp.path().join("spec.toml"),
        "setting = \"passive\"\n[env]\nkind = \"features\"\npath = \"a.parquet\"\neval_pairs = 2\norder = \"file\"\n[stream]\nsamples = 4\neval_every = 2\n[[estimator]]\nkind = \"omd-hvp-cg\"\n",
    )
    .unwrap();
    let (code, _, stderr) = onepass(tmp.path(), &["run", "spec.toml", "--out", "out"]).parts();
    assert_eq!(code, 0, "{stderr}");

    // bad input names the file and the row
    std::fs::write(tmp.path().join("bad.jsonl"), lines[0].clone() + "\n{\"chosen\": 3}\n").unwrap();
    let mut a4 = args("d.parquet");
    a4[5] = "bad.jsonl".into();
    let (code, _, stderr) = onepass(tmp.path(), &a4.iter().map(String::as_str).collect::<Vec<_>>()).parts();
    assert_eq!(code, 2);
    assert!(stderr.contains("bad.jsonl: line 2") && stderr.contains("`chosen`"), "{stderr}");
}

#[test]
fn hh_transcripts_split_into_messages() {
    let m =
        runner::world::datasets::hh_messages("\n\nHuman: a\nb\n\nAssistant: c \n\nHuman: d\n\nAssistant: e").unwrap();
    let roles: Vec<&str> = m.iter().map(|x| x.role.as_str()).collect();
    assert_eq!(roles, ["user", "assistant", "user", "assistant"]);
    assert_eq!(m[0].content, "a\nb");
    assert_eq!(m[1].content, "c");
    assert_eq!(m[3].content, "e");
    assert!(runner::world::datasets::hh_messages("\n\nHuman: only a question").is_err());
    assert!(runner::world::datasets::hh_messages("no tags").is_err());
}

/// Two processes, each one shard of the global batch plan into its own cache; merged, the
/// caches give a pairs file byte-identical to a one-process extraction. (On CPU in f32, φ turned
/// out not to depend on which rows share a padded batch at all — batch 2 and batch 3 give the same
/// bytes — so the byte identity alone cannot tell a global plan from a per-shard one; the shard
/// sizes can: 20 sequences in batches of 3 are 7 batches, 11 + 9 rows under the global plan, where
/// splitting the pairs first would give 10 + 10.)
#[test]
fn sharded_extraction_in_two_processes_merges_to_the_same_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let qs = [
        "What is 2+2?",
        "Name a colour.",
        "Say hi.",
        "Capital of France?",
        "Is water wet?",
        "Write a haiku about rust.",
        "How many legs does a spider have?",
        "Translate 'cat' to French.",
        "What is the boiling point of water at sea level, in Celsius and in Fahrenheit?",
        "Why is the sky blue?",
    ];
    let lines: Vec<String> = qs
        .iter()
        .enumerate()
        .map(|(i, q)| {
            hh_line(q, &format!("Answer {i}: {}", "yes ".repeat(i + 1)), &format!("No idea {}.", "hm ".repeat(i)))
        })
        .collect();
    std::fs::write(tmp.path().join("hh.jsonl"), lines.join("\n") + "\n").unwrap();
    let base = |cache: &str| -> Vec<String> {
        ["features", "extract", "--model", &util::smollm2(), "--dataset", "hh.jsonl", "--batch", "3", "--cache", cache]
            .iter()
            .map(|s| s.to_string())
            .collect()
    };
    // one process
    let mut one = base("c-one");
    one.extend(["--out".into(), "one.parquet".into()]);
    let (code, _, stderr) = onepass(tmp.path(), &one.iter().map(String::as_str).collect::<Vec<_>>()).parts();
    assert_eq!(code, 0, "{stderr}");
    // two processes at once
    let spawn = |i: usize| {
        let mut a = base(&format!("c-{i}"));
        a.extend(["--shard".into(), format!("{i}/2")]);
        Command::new(env!("CARGO_BIN_EXE_onepass")).current_dir(tmp.path()).args(&a).output().unwrap()
    };
    let (p0, p1) = std::thread::scope(|s| {
        let h0 = s.spawn(|| spawn(0));
        let h1 = s.spawn(|| spawn(1));
        (h0.join().unwrap(), h1.join().unwrap())
    });
    for (p, want) in [(&p0, 11), (&p1, 9)] {
        assert!(p.status.success(), "{}", String::from_utf8_lossy(&p.stderr));
        let s: serde_json::Value = serde_json::from_slice(&p.stdout).unwrap();
        assert_eq!(s["misses"].as_u64(), Some(want), "batches 0, 2, 4, 6 vs 1, 3, 5 of the global plan: {s}");
        assert_eq!(s["shard_sequences"].as_u64(), Some(want), "{s}");
    }
    // merge and write the pairs file from the merged cache: all hits, the same bytes
    let (code, stdout, stderr) =
        onepass(tmp.path(), &["features", "merge", "--into", "c-merged", "c-0", "c-1"]).parts();
    assert_eq!(code, 0, "{stderr}");
    let added: u64 =
        stdout.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["added"].as_u64().unwrap()).sum();
    assert_eq!(added, 20);
    let mut again = base("c-merged");
    again.extend(["--out".into(), "merged.parquet".into()]);
    let (code, stdout, stderr) = onepass(tmp.path(), &again.iter().map(String::as_str).collect::<Vec<_>>()).parts();
    assert_eq!(code, 0, "{stderr}");
    let s: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!((s["hits"].as_u64(), s["misses"].as_u64()), (Some(20), Some(0)), "{s}");
    assert_eq!(
        std::fs::read(tmp.path().join("one.parquet")).unwrap(),
        std::fs::read(tmp.path().join("merged.parquet")).unwrap(),
        "sharded + merged differs from one process"
    );
    // merging again adds nothing
    let (code, stdout, _) = onepass(tmp.path(), &["features", "merge", "--into", "c-merged", "c-0"]).parts();
    assert_eq!(code, 0);
    assert!(stdout.contains("\"added\":0"), "{stdout}");

    // --out with --shard, a bad shard, a source that is not a cache: clear errors, exit 2
    let mut bad = base("c-x");
    bad.extend(["--shard".into(), "0/2".into(), "--out".into(), "x.parquet".into()]);
    let (code, _, stderr) = onepass(tmp.path(), &bad.iter().map(String::as_str).collect::<Vec<_>>()).parts();
    assert_eq!(code, 2);
    assert!(stderr.contains("--out needs every row"), "{stderr}");
    let mut bad = base("c-x");
    bad.extend(["--shard".into(), "2/2".into()]);
    let (code, _, stderr) = onepass(tmp.path(), &bad.iter().map(String::as_str).collect::<Vec<_>>()).parts();
    assert_eq!(code, 2);
    assert!(stderr.contains("shard `2/2`"), "{stderr}");
    let (code, _, stderr) = onepass(tmp.path(), &["features", "merge", "--into", "c-merged", "."]).parts();
    assert_eq!(code, 2);
    assert!(stderr.contains("no feature cache space"), "{stderr}");
}

/// `env.kind = "dataset"`: the spec names an HH file and the model; the runner splits, extracts
/// (through the cache), drops degenerate pairs, and the run's meta.json says what it did.
#[test]
fn dataset_kind_runs_from_a_spec() {
    let tmp = tempfile::tempdir().unwrap();
    let mut lines: Vec<String> = (0..14)
        .map(|i| hh_line(&format!("Question number {i}?"), &format!("A helpful answer {i}."), "I don't know."))
        .collect();
    lines.push(hh_line("Same?", "Same.", "Same.")); // degenerate
    lines.push(hh_line("Same again?", "Yes.", "Yes.")); // degenerate
    std::fs::write(tmp.path().join("hh.jsonl"), lines.join("\n") + "\n").unwrap();
    let spec = |extra: &str| {
        format!(
            "setting = \"passive\"\nseeds = 2\n[env]\nkind = \"dataset\"\n[stream]\nsamples = 10\neval_every = 5\n\
             [data]\npath = \"${{ONEPASS_TEST_DATA_DIR:-.}}/hh.jsonl\"\nmodel = \"{}\"\nmax_len = 64\neval_fraction = 0.25\nsplit_seed = 3\n{extra}\n\
             [[estimator]]\nkind = \"mle\"\n[[estimator]]\nkind = \"sgd\"\nlr = 0.01\n",
            util::smollm2()
        )
    };
    std::fs::write(tmp.path().join("run.toml"), spec("")).unwrap();
    let (code, stdout, stderr) = onepass(tmp.path(), &["run", "run.toml", "--out", "out"]).parts();
    assert_eq!(code, 0, "{stderr}");
    let dir = PathBuf::from(tmp.path()).join(stdout.trim());
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json")).unwrap()).unwrap();
    let d = &meta["data"]["dataset"];
    assert_eq!(d["rows_read"].as_u64(), Some(16), "{d}");
    assert_eq!(d["degenerate_train"].as_u64().unwrap() + d["degenerate_eval"].as_u64().unwrap(), 2, "{d}");
    // 16 pairs, 4 held out; the 2 degenerate ones dropped wherever they fell
    assert_eq!(d["train_pairs"].as_u64().unwrap() + d["eval_pairs"].as_u64().unwrap(), 14, "{d}");
    assert_eq!(d["cache_misses"].as_u64(), Some(30), "16 pairs, 2 × 2 identical sides: 30 distinct sequences");
    assert_eq!(meta["data"]["dim"].as_u64(), Some(576));
    // the cost model: 10 samples and 2 evaluation points (5, 10) over the held-out pairs per cell
    let c = &meta["data"]["backbone_cost"];
    let ev = d["eval_pairs"].as_f64().unwrap();
    assert_eq!(c["authors_schedule"]["per_cell_sequences"].as_f64(), Some(2.0 * 10.0 + 2.0 * ev * 2.0), "{c}");
    assert_eq!(
        c["authors_schedule"]["all_cells_sequences"].as_f64(),
        Some(4.0 * (20.0 + 4.0 * ev)),
        "2 methods × 2 seeds"
    );
    let (tt, et) = (d["train_tokens"].as_f64().unwrap(), d["eval_tokens"].as_f64().unwrap());
    assert!(tt > 0.0 && et > 0.0);
    let tp = d["train_pairs"].as_f64().unwrap();
    let want = 10.0 * tt / tp + 2.0 * et;
    assert!((c["authors_schedule"]["per_cell_tokens"].as_f64().unwrap() - want).abs() < 1e-6, "{c}");
    assert_eq!(c["onepass_cache"]["tokens_once"].as_f64(), Some(tt + et));
    // a second run: the same split, every φ from the cache, the same metrics
    let (code, stdout2, stderr) = onepass(tmp.path(), &["run", "run.toml", "--out", "out2"]).parts();
    assert_eq!(code, 0, "{stderr}");
    let dir2 = PathBuf::from(tmp.path()).join(stdout2.trim());
    let meta2: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir2.join("meta.json")).unwrap()).unwrap();
    assert_eq!(meta2["data"]["dataset"]["cache_misses"].as_u64(), Some(0));
    assert_eq!(meta2["data"]["dataset"]["cache_hits"].as_u64(), Some(32));
    assert_eq!(
        std::fs::read(dir.join("metrics.parquet")).unwrap(),
        std::fs::read(dir2.join("metrics.parquet")).unwrap(),
        "same spec, same seed, same bytes"
    );
    // on the cached features, 1 and 2 threads (cells and rayon's pool) give the same bytes
    let mut dirs = Vec::new();
    for t in ["1", "2"] {
        let out = Command::new(env!("CARGO_BIN_EXE_onepass"))
            .current_dir(tmp.path())
            .args(["run", "run.toml", "--out", &format!("threads{t}"), "--threads", t])
            .env("RAYON_NUM_THREADS", t)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        dirs.push(PathBuf::from(tmp.path()).join(String::from_utf8_lossy(&out.stdout).trim()));
    }
    for f in
        ["metrics.parquet", "cells.parquet", "theta/c0000.npy", "theta/c0001.npy", "theta/c0002.npy", "theta/c0003.npy"]
    {
        let (a, b) = (std::fs::read(dirs[0].join(f)).unwrap(), std::fs::read(dirs[1].join(f)).unwrap());
        assert!(a == b, "{f}: 1 and 2 threads differ");
        assert!(a == std::fs::read(dir.join(f)).unwrap(), "{f}: differs from the run that extracted");
    }

    // bad specs: a typo in [data], an unset variable, a bad share, [data] with another kind
    let bad = [
        (spec("max_lenn = 3"), "max_lenn"),
        (spec("").replace("eval_fraction = 0.25", "eval_fraction = 1.5"), "data.eval_fraction"),
        (
            spec("").replace("${ONEPASS_TEST_DATA_DIR:-.}", "${ONEPASS_TEST_SURELY_UNSET}"),
            "ONEPASS_TEST_SURELY_UNSET is not set",
        ),
        (spec("").replace("kind = \"dataset\"", "kind = \"synthetic\""), "applies to env.kind = \"dataset\" only"),
        (spec("").replace("hh.jsonl", "missing.jsonl"), "missing.jsonl"),
        (spec("").replace("samples = 10", "samples = 100"), "stream.samples"),
    ];
    for (text, want) in bad {
        std::fs::write(tmp.path().join("bad.toml"), &text).unwrap();
        let (code, _, stderr) = onepass(tmp.path(), &["run", "bad.toml", "--out", "bad"]).parts();
        assert_eq!(code, 2, "{want}: {stderr}");
        assert!(stderr.contains(want) && stderr.contains("bad.toml"), "want `{want}` in: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}
