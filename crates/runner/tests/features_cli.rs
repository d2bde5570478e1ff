//! `onepass features extract` with SmolLM2 (models/, `just fetch-models`) on a small HH-RLHF
//! file: the second run is all cache hits and gives the same bytes; the output feeds a
//! `kind = "features"` run.

use std::path::{Path, PathBuf};
use std::process::Command;

fn gguf() -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(p.exists(), "{} is missing: run `just fetch-models` first", p.display());
    p.to_string_lossy().into_owned()
}

fn onepass(dir: &Path, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_onepass")).current_dir(dir).args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

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
            gguf(),
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
    let (code, stdout, stderr) = onepass(tmp.path(), &a1.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(code, 0, "{stderr}");
    let s: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!((s["pairs"].as_u64(), s["hits"].as_u64(), s["misses"].as_u64()), (Some(6), Some(0), Some(11)));
    assert_eq!(s["degenerate_pairs"].as_u64(), Some(1));
    assert_eq!(s["truncated_sequences"].as_u64(), Some(2));
    assert_eq!(s["dim"].as_u64(), Some(576));
    let a2: Vec<String> = args("b.parquet");
    let (code, stdout, stderr) = onepass(tmp.path(), &a2.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(code, 0, "{stderr}");
    let s2: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!((s2["hits"].as_u64(), s2["misses"].as_u64()), (Some(12), Some(0)), "{stdout}");
    assert_eq!(
        std::fs::read(tmp.path().join("a.parquet")).unwrap(),
        std::fs::read(tmp.path().join("b.parquet")).unwrap()
    );

    // a different option is a different cache space: nothing is reused
    let mut a3 = args("c.parquet");
    a3.extend(["--pool".into(), "mean".into()]);
    let (code, stdout, stderr) = onepass(tmp.path(), &a3.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(code, 0, "{stderr}");
    let s3: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(s3["hits"].as_u64(), Some(0));

    // the pairs file is a features environment
    std::fs::write(
        tmp.path().join("spec.toml"),
        "setting = \"passive\"\n[env]\nkind = \"features\"\npath = \"a.parquet\"\neval_pairs = 2\norder = \"file\"\n[stream]\nsamples = 4\neval_every = 2\n[[estimator]]\nkind = \"omd-hvp-cg\"\n",
    )
    .unwrap();
    let (code, _, stderr) = onepass(tmp.path(), &["run", "spec.toml", "--out", "out"]);
    assert_eq!(code, 0, "{stderr}");

    // bad input names the file and the row
    std::fs::write(tmp.path().join("bad.jsonl"), lines[0].clone() + "\n{\"chosen\": 3}\n").unwrap();
    let mut a4 = args("d.parquet");
    a4[5] = "bad.jsonl".into();
    let (code, _, stderr) = onepass(tmp.path(), &a4.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(code, 2);
    assert!(stderr.contains("bad.jsonl: row 1") && stderr.contains("`chosen`"), "{stderr}");
}

#[test]
fn hh_transcripts_split_into_messages() {
    let m = runner::datasets::hh_messages("\n\nHuman: a\nb\n\nAssistant: c \n\nHuman: d\n\nAssistant: e").unwrap();
    let roles: Vec<&str> = m.iter().map(|x| x.role.as_str()).collect();
    assert_eq!(roles, ["user", "assistant", "user", "assistant"]);
    assert_eq!(m[0].content, "a\nb");
    assert_eq!(m[1].content, "c");
    assert_eq!(m[3].content, "e");
    assert!(runner::datasets::hh_messages("\n\nHuman: only a question").is_err());
    assert!(runner::datasets::hh_messages("no tags").is_err());
}
