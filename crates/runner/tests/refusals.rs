//! What `report` and `merge` do with a directory they refuse: they say why on one line and
//! write nothing there first (no lock file, no half report, no merged run directory); a corrupt
//! meta.json is named, not silently dropped from the report.

use std::path::{Path, PathBuf};

mod util;
use util::{onepass, write};

const TINY: &str = r#"
setting = "passive"
seeds = 2
[env]
dim = 3
contexts = 5
arms = 3
eval_pairs = 20
[stream]
samples = 20
batch_size = 2
eval_every = 10
[[estimator]]
kind = "sgd"
lr = 0.1
"#;

/// Every file and directory under `dir`, relative to it, sorted.
fn entries(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            out.push(p.strip_prefix(dir).unwrap().to_path_buf());
            if p.is_dir() {
                stack.push(p);
            }
        }
    }
    out.sort();
    out
}

fn tiny_run(p: &Path, out: &str) -> PathBuf {
    write(p, "run.toml", TINY);
    let r = onepass(p, &["run", "run.toml", "--out", out, "--threads", "1"]);
    p.join(r.dir())
}

/// `report` of a directory that is not a run, or of a run without cells.parquet: exit 2, and
/// the directory holds what it held (the old binary left `.lock`, and `report.tmp/`).
#[test]
fn report_writes_nothing_until_its_checks_pass() {
    let tmp = tempfile::tempdir().unwrap();
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let r = onepass(tmp.path(), &["report", "empty"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("no metrics.parquet"), "{}", r.stderr);
    assert_eq!(entries(&empty), Vec::<PathBuf>::new(), "report wrote into a directory it refused");

    let run = tiny_run(tmp.path(), "out");
    std::fs::remove_file(run.join("cells.parquet")).unwrap();
    let before = entries(&run);
    let r = onepass(tmp.path(), &["report", run.to_str().unwrap()]);
    assert_ne!(r.code, 0, "a run without cells.parquet reported: {}", r.stderr);
    assert_eq!(r.stderr.trim().lines().count(), 1, "{}", r.stderr);
    assert!(r.stderr.contains("cells.parquet"), "{}", r.stderr);
    assert_eq!(entries(&run), before, "a refused report changed the run directory");
}

/// A corrupt meta.json: the report still comes (exit 0) and says on stderr that it left out
/// what meta.json holds, naming the file; an intact one gives no such line (control).
#[test]
fn a_corrupt_meta_json_is_named_by_the_report() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tiny_run(tmp.path(), "out");
    let r = onepass(tmp.path(), &["report", run.to_str().unwrap()]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(!r.stderr.contains("meta.json"), "{}", r.stderr);
    std::fs::write(run.join("meta.json"), "{\"setting\": \"passive\", tru").unwrap();
    let r = onepass(tmp.path(), &["report", run.to_str().unwrap()]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let line = r.stderr.lines().find(|l| l.contains("meta.json")).unwrap_or_else(|| panic!("{}", r.stderr));
    assert!(line.contains("warning") && line.contains("not JSON") && line.contains("leaves out"), "{line}");
}

/// `merge` given a slice twice names the argument, not "in use by another onepass process" with
/// its own pid; given a slice whose `.done` is corrupt, it names that file — and neither makes
/// the merged run's directory. Control: the two slices merge.
#[test]
fn merge_checks_its_slices_before_it_creates_anything() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path();
    write(p, "run.toml", TINY);
    let mut slices = Vec::new();
    for i in 0..2 {
        let cells = format!("{i}/2");
        let r = onepass(p, &["run", "run.toml", "--out", "s", "--threads", "1", "--cells", &cells]);
        slices.push(r.dir().display().to_string());
    }
    let r = onepass(p, &["merge", "run.toml", &slices[0], &slices[0], "--out", "m"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(!r.stderr.contains("in use by another"), "{}", r.stderr);
    assert!(r.stderr.contains("given twice") && r.stderr.contains(&slices[0]), "{}", r.stderr);
    assert!(!p.join("m").exists(), "a refused merge made {:?}", entries(&p.join("m")));

    let ck = p.join(&slices[1]).join("checkpoints");
    let done =
        std::fs::read_dir(&ck).unwrap().map(|e| e.unwrap().path()).find(|f| f.extension().is_some_and(|x| x == "done"));
    let done = done.expect("a slice keeps its finished cells");
    let good = std::fs::read(&done).unwrap();
    std::fs::write(&done, b"not a checkpoint").unwrap();
    let r = onepass(p, &["merge", "run.toml", &slices[0], &slices[1], "--out", "m"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains(&done.file_name().unwrap().to_string_lossy().into_owned()), "{}", r.stderr);
    assert!(!p.join("m").exists(), "a refused merge made {:?}", entries(&p.join("m")));

    std::fs::write(&done, good).unwrap();
    let r = onepass(p, &["merge", "run.toml", &slices[0], &slices[1], "--out", "m"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
}

/// A negative number for `--threads`, `--cells`, `--max-memory` or `--max-gpu-memory` is named
/// as a bad value of that flag (it was "unexpected argument '-1' found"), exit 2.
#[test]
fn a_negative_count_or_size_is_a_bad_value_of_its_flag() {
    let tmp = tempfile::tempdir().unwrap();
    write(tmp.path(), "run.toml", TINY);
    for (flag, value) in [("--threads", "-1"), ("--cells", "-1"), ("--max-memory", "-1"), ("--max-gpu-memory", "-1G")] {
        let r = onepass(tmp.path(), &["run", "run.toml", "--dry-run", flag, value]);
        assert_eq!(r.code, 2, "{flag} {value}: {}", r.stderr);
        let first = r.stderr.lines().next().unwrap_or_default();
        assert!(!first.contains("unexpected argument") && first.contains(flag), "{flag} {value}: {first}");
    }
}

/// The same for `features extract`'s counts: a negative `--max-len`, `--batch` or `--limit` is a
/// bad value of that flag (it was "unexpected argument '-1' found"), exit 2, before any file is
/// read.
#[test]
fn a_negative_count_of_features_extract_is_a_bad_value_of_its_flag() {
    let tmp = tempfile::tempdir().unwrap();
    for flag in ["--max-len", "--batch", "--limit"] {
        let r = onepass(tmp.path(), &["features", "extract", "--model", "m.gguf", "--dataset", "d.jsonl", flag, "-1"]);
        assert_eq!(r.code, 2, "{flag} -1: {}", r.stderr);
        let first = r.stderr.lines().next().unwrap_or_default();
        assert!(!first.contains("unexpected argument") && first.contains(flag), "{flag} -1: {first}");
        assert!(first.contains("expected a whole number ≥ 0"), "{flag} -1: {first}");
    }
}

/// `onepass cells` shows a corrupt `.done` as corrupt, naming the file, with the expected header
/// as text (it was counted "finished", the header a byte list); an empty slice's merge hint
/// keeps the slice's `--set` flags.
#[test]
fn cells_names_a_corrupt_done_and_an_empty_slice_keeps_its_sets() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path();
    write(p, "tiny.toml", TINY);
    let (code, stdout, stderr) = onepass(
        p,
        &["run", "tiny.toml", "--out", "sl", "--cells", "0/2", "--set", "stream.samples=10", "--threads", "1"],
    )
    .parts();
    assert_eq!(code, 0, "{stderr}");
    assert!(stderr.contains("onepass merge tiny.toml --set stream.samples=10 SLICE_DIR"), "{stderr}");
    let dir = p.join(stdout.trim().lines().last().unwrap());
    let done = dir.join("checkpoints/c0000.done");
    assert!(done.exists());
    std::fs::write(&done, "not a checkpoint").unwrap();
    let (code, out, err) = onepass(p, &["cells", dir.to_str().unwrap()]).parts();
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("2 cells, 0 finished"), "{out}");
    let line = out.lines().find(|l| l.trim_start().starts_with("c0000 ")).unwrap();
    assert!(line.contains("corrupt") && !line.contains("finished"), "{out}");
    assert!(out.contains("checkpoints/c0000.done: not a onepass checkpoint"), "{out}");
    assert!(out.contains("expected the header `ONEPASS-CKPT-1`") && !out.contains("[79, 78"), "{out}");
    // a slice past the run's cells: empty, said so, and its hint keeps the --set flags
    let (code, _, stderr) = onepass(
        p,
        &["run", "tiny.toml", "--out", "sl", "--cells", "50/100", "--set", "stream.samples=10", "--threads", "1"],
    )
    .parts();
    assert_eq!(code, 0, "{stderr}");
    assert!(stderr.contains("0 cells finished") && stderr.contains("the run has 2 cells"), "{stderr}");
    assert!(stderr.contains("onepass merge tiny.toml --set stream.samples=10 SLICE_DIR"), "{stderr}");
}
