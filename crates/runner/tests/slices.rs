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

/// `onepass cells DIR --json`: one JSON object per directory.
fn cells_json(p: &Path, dir: &Path) -> serde_json::Value {
    let (code, stdout, err) = onepass(p, &["cells", dir.to_str().unwrap(), "--json"]).parts();
    assert_eq!(code, 0, "{err}");
    serde_json::from_str(stdout.trim()).unwrap()
}

/// The last row (largest step, the later of equal ones) of each cell in a metrics.parquet:
/// cell → (label, step, eval loss, eval accuracy).
fn last_rows(metrics: &Path) -> std::collections::BTreeMap<String, (String, u64, f64, f64)> {
    let b = util::table(metrics);
    let (cells, labels, steps) = (util::strs(&b, "cell_id"), util::strs(&b, "label"), util::u64s(&b, "step"));
    let (loss, acc) = (util::f64s(&b, "eval_loss"), util::f64s(&b, "eval_accuracy"));
    let mut out = std::collections::BTreeMap::new();
    for i in 0..cells.len() {
        let keep = out.get(&cells[i]).is_none_or(|r: &(String, u64, f64, f64)| steps[i] >= r.1);
        if keep {
            out.insert(cells[i].clone(), (labels[i].clone(), steps[i], loss[i], acc[i]));
        }
    }
    out
}

/// `onepass cells` (issue 30's half-done arrays): each slice's finished cells show the label,
/// last step, held-out loss and accuracy that the merged run's metrics.parquet gives them (read
/// from the `.done` files before any merge, not from the tables), the other slices' cells say
/// so; a killed slice's cell in progress is "checkpointed"; a corrupt `.done` is named in its
/// cell's line; a directory that is no run, and an old deploy directory without plan.json, are
/// refused on one line. An old passive directory (no plan.json) lists its cells from the
/// resolved spec, in the same states with the same values.
#[test]
fn cells_reads_each_slices_finished_cells_as_the_merged_tables_have_them() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path();
    std::fs::write(p.join("run.toml"), util::SYNTHETIC_DEPLOY).unwrap();
    let parts = slices(p, "s", &[]);
    let (code, merged) = merge(p, &parts, "m");
    assert_eq!(code, 0, "{merged}");
    let want = last_rows(&p.join(&merged).join("metrics.parquet"));
    assert_eq!(want.len(), 12);
    let losses: std::collections::BTreeSet<u64> = want.values().map(|r| r.2.to_bits()).collect();
    assert!(
        losses.len() > 1,
        "every cell ended at the same held-out loss: the comparison below would not tell cells apart"
    );
    for (i, part) in parts.iter().enumerate() {
        let v = cells_json(p, part);
        assert_eq!(v["slice"], serde_json::json!([i, 3]));
        let cells = v["cells"].as_array().unwrap();
        assert_eq!(cells.len(), 12);
        for (k, c) in cells.iter().enumerate() {
            let id = c["cell_id"].as_str().unwrap();
            assert_eq!(id, format!("c{k:04}"));
            let (label, step, loss, acc) = &want[id];
            assert_eq!(c["config"].as_str().unwrap(), label, "{id}");
            if k % 3 == i {
                assert_eq!(c["state"], "finished", "{c}");
                assert_eq!(c["step"].as_u64().unwrap(), *step, "{id}");
                assert_eq!(c["eval_loss"].as_f64().unwrap().to_bits(), loss.to_bits(), "{id}");
                assert_eq!(c["eval_accuracy"].as_f64().unwrap().to_bits(), acc.to_bits(), "{id}");
                assert!(c["wall_s"].as_f64().unwrap() >= 0.0);
            } else {
                assert_eq!(c["state"], "another slice", "{c}");
                assert!(c["step"].is_null());
            }
        }
    }
    let text = onepass(p, &["cells", parts[0].to_str().unwrap()]).parts();
    assert!(text.1.contains("slice 0/3") && text.1.contains("12 cells, 4 finished"), "{}", text.1);
    // the wall column: a cell under 10 s keeps a decimal (a sub-second cell is not "0")
    let wall = cells_json(p, &parts[0])["cells"][0]["wall_s"].as_f64().unwrap();
    let line = text.1.lines().find(|l| l.trim_start().starts_with("c0000")).unwrap();
    let want = if wall < 10.0 { format!("{wall:.1}") } else { format!("{wall:.0}") };
    assert_eq!(line.split_whitespace().last(), Some(want.as_str()), "{line}");

    // a killed slice: its first cell in progress is checkpointed
    let out = finish(
        command()
            .current_dir(p)
            .args(["run", "run.toml", "--out", "k", "--threads", "1", "--cells", "1/3"])
            .env("ONEPASS_FAILPOINT", "update:30"),
    );
    assert_eq!(out.code, -1, "{}", out.stderr);
    let killed = std::fs::read_dir(p.join("k")).unwrap().next().unwrap().unwrap().path();
    let v = cells_json(p, &killed);
    let states: Vec<&str> = v["cells"].as_array().unwrap().iter().map(|c| c["state"].as_str().unwrap()).collect();
    assert!(states.contains(&"checkpointed") && !states.contains(&"finished"), "{states:?}");

    // a corrupt .done names its file in the cell's line; the others still read
    let done = parts[2].join("checkpoints").join("c0002.done");
    let mut b = std::fs::read(&done).unwrap();
    let n = b.len();
    b[n - 3] ^= 0x40;
    std::fs::write(&done, b).unwrap();
    let v = cells_json(p, &parts[2]);
    let c2 = &v["cells"][2];
    assert!(c2["error"].as_str().unwrap().contains("corrupt checkpoint"), "{c2}");
    assert!(c2["eval_loss"].is_null());
    assert_eq!(v["cells"][5]["state"], "finished");

    // not a run directory; an old deploy directory (no plan.json)
    let (code, _, err) = onepass(p, &["cells", "m"]).parts();
    assert_eq!(code, 2);
    assert!(err.trim().lines().count() == 1 && err.contains("no resume.json"), "{err}");
    std::fs::remove_file(parts[0].join("plan.json")).unwrap();
    let (code, _, err) = onepass(p, &["cells", parts[0].to_str().unwrap()]).parts();
    assert_eq!(code, 2);
    assert!(err.trim().lines().count() == 1 && err.contains("plan.json"), "{err}");
}

/// A passive slice made before plan.json existed (the file removed): its cells come from the
/// resolved spec, labelled by estimator kind, in the states and with the values they have with
/// plan.json.
#[test]
fn cells_of_an_old_passive_directory_come_from_its_resolved_spec() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path();
    let spec = util::SYNTHETIC_DEPLOY
        .replace("setting = \"deploy\"", "setting = \"passive\"")
        .replace("[deploy]\nstrategies = [\"ucb\", \"best-quantile\", \"random-pair\"]\n", "");
    std::fs::write(p.join("run.toml"), spec).unwrap();
    let (code, stdout, err) =
        onepass(p, &["run", "run.toml", "--out", "s", "--threads", "1", "--cells", "1/2"]).parts();
    assert_eq!(code, 0, "{err}");
    let dir = p.join(stdout.trim().lines().last().unwrap());
    let with = cells_json(p, &dir);
    std::fs::remove_file(dir.join("plan.json")).unwrap();
    let without = cells_json(p, &dir);
    let (a, b) = (with["cells"].as_array().unwrap(), without["cells"].as_array().unwrap());
    assert_eq!(a.len(), 4);
    assert_eq!(a.len(), b.len());
    for (k, (x, y)) in a.iter().zip(b).enumerate() {
        for key in ["cell_id", "seed", "state", "step", "eval_loss", "eval_accuracy"] {
            assert_eq!(x[key], y[key], "{key} of cell {k}");
        }
        let kind = if k < 2 { "omd-exact" } else { "mle" };
        assert_eq!(y["config"], format!("{kind} (estimator.{})", k / 2));
        assert_eq!(x["state"], if k % 2 == 1 { "finished" } else { "another slice" });
    }
}
