//! Every preset in experiments/ is a valid plan: it parses (unknown keys are errors), and the
//! plan's pure validation — every cross-field check that needs no file, the `[data]`,
//! `[generate]`, `[features]` and `[oracle]` tables, every estimator entry read by its kind —
//! accepts it. The plan reads nothing but the spec, so this runs on the presets that need a
//! GPU and the hub too, and keeps them from rotting.

use std::path::PathBuf;

#[test]
fn every_preset_is_a_valid_plan() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../experiments");
    let mut seen = 0;
    for setting in ["passive", "active", "deploy"] {
        for e in std::fs::read_dir(root.join(setting)).unwrap() {
            let path = e.unwrap().path();
            if path.extension().and_then(|x| x.to_str()) != Some("toml") {
                continue;
            }
            let plan = runner::load_plan(&path, &[]).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(plan.spec.setting.as_str(), setting, "{}: setting", path.display());
            assert!(!plan.cells.is_empty(), "{}: no cells", path.display());
            seen += 1;
        }
    }
    assert!(seen >= 12, "only {seen} presets found");
}

/// Negative control: a key of another estimator kind in a preset's table is refused.
#[test]
fn a_foreign_hyper_parameter_is_refused() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../experiments");
    let path = root.join("passive/synthetic.toml");
    let e = runner::load_plan(&path, &["estimator.0.lr=0.1".into()]).unwrap_err();
    assert_eq!(e.key, "estimator[0].lr", "{e}");
    assert!(e.message.contains("not a hyper-parameter of `omd-exact`"), "{e}");
}

mod util;

/// `--dry-run` is the plan alone: the deploy mini prints its cells in a directory that has no
/// models/, no prompt file and no caches (nothing is read, generated or extracted).
#[test]
fn dry_run_needs_no_models_or_data() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = util::root().join("experiments/deploy/mini.toml");
    let r = util::onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--dry-run"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let plan = runner::load_plan(&spec, &[]).unwrap();
    let cells: Vec<&str> = r.stdout.lines().filter(|l| l.starts_with("# c")).collect();
    assert_eq!(cells.len(), plan.cells.len(), "{}", r.stdout);
    assert!(cells.len() >= 20 && cells[0].contains("seed 0"), "{}", r.stdout);
    assert!(
        !tmp.path().join("models").exists()
            && !tmp.path().join(".cache").exists()
            && !tmp.path().join("results").exists()
    );
    // negative control: the real run in the same directory needs the model and the prompts
    let r = util::onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--set", "generate.rows=2"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
}

/// The ensemble deployment presets: deploy/ensemble-mini crosses omd-exact, the ensemble and mle
/// with random-pair (the same queries) and best-two; deploy/ensemble-mini-explore runs the
/// ensemble alone under its explorers, because a strategy that draws from the heads is refused
/// with any other estimator (the negative control: thompson added to ensemble-mini names
/// omd-exact); `--set oracle.flip=0.2` is the noisy-label variant of both.
#[test]
fn the_ensemble_deployment_presets_plan_their_comparison() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../experiments/deploy");
    let labels = |name: &str, sets: &[String]| {
        let plan = runner::load_plan(&root.join(name), sets).unwrap_or_else(|e| panic!("{name}: {e}"));
        let mut l: Vec<String> = plan.configs.iter().map(|c| c.label.clone()).collect();
        l.dedup();
        (l, plan.spec.oracle.as_ref().map(|o| o.flip))
    };
    let (mini, flip) = labels("ensemble-mini.toml", &[]);
    assert_eq!(
        mini,
        [
            "omd-exact lambda=100 / random-pair",
            "omd-exact lambda=100 / best-two",
            "ensemble / random-pair",
            "ensemble / best-two",
            "mle ridge=0.3 / random-pair",
            "mle ridge=0.3 / best-two"
        ]
    );
    assert_eq!(flip, Some(0.0));
    let (explore, _) = labels("ensemble-mini-explore.toml", &[]);
    assert_eq!(
        explore,
        ["ensemble / random-pair", "ensemble / best-two", "ensemble / thompson", "ensemble / ensemble-uncertainty"]
    );
    for name in ["ensemble-mini.toml", "ensemble-mini-explore.toml"] {
        assert_eq!(labels(name, &["oracle.flip=0.2".into()]).1, Some(0.2), "{name}");
    }
    let e =
        runner::load_plan(&root.join("ensemble-mini.toml"), &["deploy.strategies=[\"thompson\"]".into()]).unwrap_err();
    assert!(e.message.contains("`thompson` draws from an ensemble's heads") && e.message.contains("omd-exact"), "{e}");
}
