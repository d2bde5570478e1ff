//! Every preset in experiments/ parses (unknown keys are errors), its `[data]` table passes the
//! checks that need no file, and every estimator entry names a kind and only that kind's
//! hyper-parameters. The presets that need a GPU and the hub cannot run here; this keeps them
//! from rotting.

use runner::spec::Spec;
use std::path::PathBuf;

#[test]
fn every_preset_parses_and_names_valid_keys() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../experiments");
    let mut seen = 0;
    for setting in ["passive", "active", "deploy"] {
        for e in std::fs::read_dir(root.join(setting)).unwrap() {
            let path = e.unwrap().path();
            if path.extension().and_then(|x| x.to_str()) != Some("toml") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let spec: Spec = toml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert_eq!(spec.setting.as_str(), setting, "{}: setting", path.display());
            if let Some(d) = &spec.data {
                if let Err((k, m)) = d.check() {
                    // an unset ${VAR} without a default is the only acceptable failure
                    panic!("{}: data.{k}: {m}", path.display());
                }
            }
            assert!(!spec.estimators.is_empty(), "{}: no estimators", path.display());
            for (i, est) in spec.estimators.iter().enumerate() {
                let kind: estimators::Kind =
                    est.kind.parse().unwrap_or_else(|m| panic!("{}: estimator {i}: {m}", path.display()));
                let allowed = runner::plan::keys_of(kind);
                let written = toml::Value::try_from(est).unwrap();
                for k in written.as_table().unwrap().keys() {
                    if ["kind", "init", "init_std"].contains(&k.as_str()) {
                        continue;
                    }
                    assert!(allowed.contains(&k.as_str()), "{}: estimator {i} ({kind}): `{k}`", path.display());
                }
            }
            seen += 1;
        }
    }
    assert!(seen >= 12, "only {seen} presets found");
}
