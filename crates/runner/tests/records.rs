//! A run is its own record: a config's label comes from its own `[[estimator]]` table (another
//! table never renames it; `name` overrides it; two of one label are refused), cells.parquet
//! keeps hyper-parameters typed, a run directory names its setting and `compare` its preset, an
//! online run's console gives the held-out policy reward with a t-interval, `--set
//! deploy.policy` subsets a preset's arms, and the console, report and `onepass cells` say what
//! applies and count what finished.

mod util;

use arrow_array::{Array, BooleanArray, Float64Array, Int64Array, StringArray};
use std::path::Path;
use util::{onepass, table, write};

const BASE: &str = r#"
setting = "passive"
seeds = 2
[env]
dim = 4
contexts = 10
arms = 3
eval_pairs = 50
[stream]
samples = 40
batch_size = 2
eval_every = 20
"#;

/// The labels of a dry run's cells, one per config (`# c0000 <label> seed 0` lines of seed 0).
fn labels(stdout: &str) -> Vec<String> {
    stdout
        .lines()
        .filter_map(|l| l.strip_prefix("# c"))
        .filter_map(|l| l.split_once(' ').map(|(_, rest)| rest))
        .filter_map(|l| l.strip_suffix(" seed 0"))
        .map(String::from)
        .collect()
}

fn dry(dir: &Path, name: &str, text: &str) -> util::Run {
    let spec = write(dir, name, text);
    onepass(dir, &["run", spec.to_str().unwrap(), "--dry-run"])
}

/// Adding a second omd-exact to a copied spec leaves the first `omd-exact` (it used to become
/// `omd-exact eta=1`); the label shows what differs from the kind's defaults and what a table
/// sweeps; `name` overrides it; two configs of one label are refused in one line naming both
/// tables; the resolved spec (which expands "theory" and the sweeps) runs to the same labels.
#[test]
fn a_label_depends_on_its_own_table_only() {
    let tmp = tempfile::tempdir().unwrap();
    let one = format!("{BASE}[[estimator]]\nkind = \"omd-exact\"\n");
    let r = dry(tmp.path(), "one.toml", &one);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(labels(&r.stdout), ["omd-exact"]);
    let two = format!("{one}[[estimator]]\nkind = \"omd-exact\"\neta = 0.5\n");
    let r = dry(tmp.path(), "two.toml", &two);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(labels(&r.stdout), ["omd-exact", "omd-exact eta=0.5"], "the first keeps its label");
    // a third of the second's label: refused, naming both tables, on one line
    let three = format!("{two}[[estimator]]\nkind = \"omd-exact\"\neta = 0.5\n");
    let r = dry(tmp.path(), "three.toml", &three);
    assert_eq!(r.code, 2);
    assert_eq!(r.stderr.trim().lines().count(), 1, "{}", r.stderr);
    assert!(r.stderr.contains("estimator[2]") && r.stderr.contains("estimator[1]"), "{}", r.stderr);
    assert!(r.stderr.contains("`omd-exact eta=0.5`") && r.stderr.contains("name"), "{}", r.stderr);
    // … and a name tells them apart; a name keeps a sweep's keys
    let named = format!("{three}name = \"slow\"\n[[estimator]]\nkind = \"sgd\"\nname = \"fast\"\nlr = [0.1, 0.001]\n");
    let r = dry(tmp.path(), "named.toml", &named);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(labels(&r.stdout), ["omd-exact", "omd-exact eta=0.5", "slow", "fast lr=0.1", "fast lr=0.001"]);
    // a sweep shows its key even at the default (sgd's lr = 0.001); theory and a drawn θ_1 show
    let more = format!(
        "{BASE}[[estimator]]\nkind = \"sgd\"\nlr = [0.1, 0.001]\n[[estimator]]\nkind = \"omd-exact\"\ntheory = true\n\
         [[estimator]]\nkind = \"mle\"\nrefit_every = 5\ninit = \"normal\"\ninit_std = 0.5\n"
    );
    let r = dry(tmp.path(), "more.toml", &more);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let want = ["sgd lr=0.1", "sgd lr=0.001", "omd-exact theory", "mle refit_every=5 init=normal init_std=0.5"];
    assert_eq!(labels(&r.stdout), want);
    // the resolved spec runs to the same labels (it names the tables whose own label differs)
    let resolved: String = r.stdout.lines().filter(|l| !l.starts_with('#')).map(|l| format!("{l}\n")).collect();
    let again = dry(tmp.path(), "resolved.toml", &resolved);
    assert_eq!(again.code, 0, "{}\n{resolved}", again.stderr);
    assert_eq!(labels(&again.stdout), want, "{resolved}");
    // a name that is not a string, or swept, is refused at its key
    let bad = format!("{BASE}[[estimator]]\nkind = \"sgd\"\nname = [\"a\", \"b\"]\n");
    let r = dry(tmp.path(), "bad.toml", &bad);
    assert_eq!(r.code, 2);
    assert!(r.stderr.contains("estimator[0].name") && r.stderr.contains("cannot be swept"), "{}", r.stderr);
}

/// cells.parquet: `hparams` holds numbers as JSON numbers, and each hyper-parameter is a typed
/// `hp.<key>` column (null for a kind without it); a key mixing a number and a word is text.
#[test]
fn cells_parquet_keeps_hyper_parameters_typed() {
    let tmp = tempfile::tempdir().unwrap();
    let text = format!(
        "{BASE}[[estimator]]\nkind = \"sgd\"\nlr = [0.1, 0.5]\n[[estimator]]\nkind = \"omd-exact\"\nlambda = [\"auto\", 2.0]\n"
    );
    let spec = write(tmp.path(), "typed.toml", &text);
    let r = onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--out", "out", "--set", "seeds=1", "-q"]);
    let dir = tmp.path().join(r.dir());
    let cells = table(&dir.join("cells.parquet"));
    let json: Vec<serde_json::Value> =
        util::strs(&cells, "hparams").iter().map(|s| serde_json::from_str(s).unwrap()).collect();
    assert_eq!(json[0]["lr"], serde_json::json!(0.1), "{:?}", json[0]);
    assert!(json[0]["lr"].is_f64() && json[2]["lambda"].is_string() && json[3]["lambda"].is_f64(), "{json:?}");
    let col = |name: &str| cells.column_by_name(name).unwrap_or_else(|| panic!("no column {name}")).clone();
    let lr = col("hp.lr");
    let lr = lr.as_any().downcast_ref::<Float64Array>().expect("hp.lr is Float64");
    assert_eq!((lr.value(0), lr.value(1)), (0.1, 0.5));
    assert!(lr.is_null(2) && lr.is_null(3), "omd-exact has no lr");
    let eta = col("hp.eta");
    assert_eq!(eta.as_any().downcast_ref::<Float64Array>().expect("hp.eta is Float64").value(2), 1.0);
    let lambda = col("hp.lambda");
    let lambda = lambda.as_any().downcast_ref::<StringArray>().expect("λ = auto or a number: text");
    assert_eq!((lambda.value(2), lambda.value(3)), ("auto", "2"));
    // a key of integers is Int64
    let text = format!("{BASE}[[estimator]]\nkind = \"mle\"\nrefit_every = [5, 10]\n");
    let spec = write(tmp.path(), "ints.toml", &text);
    let r = onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--out", "out", "--set", "seeds=1", "-q"]);
    let cells = table(&tmp.path().join(r.dir()).join("cells.parquet"));
    let every = cells.column_by_name("hp.refit_every").unwrap();
    let every = every.as_any().downcast_ref::<Int64Array>().expect("hp.refit_every is Int64");
    assert_eq!(every.values().to_vec(), [5, 10]);
    assert!(cells.column_by_name("hp.lr").is_none(), "no column of a key no config has");
    // a key of booleans is Boolean
    let text = format!("{BASE}[[estimator]]\nkind = \"omd-reference\"\nbf16_weights = [true, false]\n");
    let spec = write(tmp.path(), "bools.toml", &text);
    let r = onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--out", "out", "--set", "seeds=1", "-q"]);
    let cells = table(&tmp.path().join(r.dir()).join("cells.parquet"));
    let bf16 = cells.column_by_name("hp.bf16_weights").unwrap();
    let bf16 = bf16.as_any().downcast_ref::<BooleanArray>().expect("hp.bf16_weights is Boolean");
    assert!(bf16.value(0) && !bf16.value(1));
}

/// metrics.parquet's estimator_bytes: a one-pass estimator's state is the same size at every
/// evaluation point; mle's grows by the labels it keeps, (d + 1) f32 per pair (z and y),
/// computed here from the rows' samples_seen.
#[test]
fn estimator_bytes_are_flat_for_one_pass_and_grow_with_mle() {
    let tmp = tempfile::tempdir().unwrap();
    let text = format!(
        "{BASE}[[estimator]]\nkind = \"sgd\"\n[[estimator]]\nkind = \"omd-exact\"\n[[estimator]]\nkind = \"mle\"\n"
    );
    let spec = write(tmp.path(), "bytes.toml", &text);
    let r = onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--out", "out", "--set", "seeds=1", "-q"]);
    let m = table(&tmp.path().join(r.dir()).join("metrics.parquet"));
    let (est, seen) = (util::strs(&m, "estimator"), util::u64s(&m, "samples_seen"));
    let bytes = util::u64s(&m, "estimator_bytes");
    let of = |k: &str| (0..est.len()).filter(|&i| est[i] == k).map(|i| (seen[i], bytes[i])).collect::<Vec<_>>();
    for k in ["sgd", "omd-exact"] {
        let v = of(k);
        assert!(v.len() >= 2 && v.iter().all(|x| x.1 == v[0].1 && x.1 > 0), "{k}: {v:?}");
    }
    let mle = of("mle");
    assert!(mle.len() >= 2, "{mle:?}");
    for w in mle.windows(2) {
        // dim = 4: each labelled pair keeps 4 + 1 f32
        assert_eq!(w[1].1 - w[0].1, (w[1].0 - w[0].0) * 5 * 4, "{mle:?}");
    }
    // the negative control: the omd-exact state (a d × d inverse) is larger than sgd's
    assert!(of("omd-exact")[0].1 > of("sgd")[0].1);
}

/// A run directory begins with its setting (the three synthetic presets' used to share
/// `synthetic-<time>`), a name that already begins with it is kept, and `compare` names each
/// run's setting and preset.
#[test]
fn run_directories_name_the_setting_and_compare_names_the_preset() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = write(tmp.path(), "synthetic.toml", &format!("{BASE}[[estimator]]\nkind = \"sgd\"\n"));
    let r = onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--out", "out", "-q"]);
    let a = r.dir();
    let name = a.file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.starts_with("passive-synthetic-2"), "{name}");
    let text = format!("name = \"passive-b\"\n{BASE}[[estimator]]\nkind = \"sgd\"\n");
    let spec = write(tmp.path(), "b.toml", &text);
    let r = onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--out", "out", "-q", "--set", "seeds=1"]);
    let b = r.dir();
    assert!(b.file_name().unwrap().to_string_lossy().starts_with("passive-b-2"), "{}", b.display());
    let cmp = onepass(tmp.path(), &["compare", a.to_str().unwrap(), b.to_str().unwrap()]);
    assert_eq!(cmp.code, 0, "{}", cmp.stderr);
    assert!(
        cmp.stdout.contains(&format!(
            "- `{name}`: setting passive, preset `{}`",
            spec.with_file_name("synthetic.toml").display()
        )),
        "{}",
        cmp.stdout
    );
    assert!(
        cmp.stdout.contains("setting passive, preset") && cmp.stdout.contains("with `--set seeds=1`"),
        "{}",
        cmp.stdout
    );
}

/// One seed: the console says "1 seed", the report prints no "± 0.0000" and says there is no
/// interval; a synthetic run's report has no data line and no transformers heads (a features
/// run has them); `onepass cells` on a finished run counts its finished cells from
/// cells.parquet; `merge --help` does not promise a report.
#[test]
fn one_seed_synthetic_reports_and_finished_cells_say_what_applies() {
    let tmp = tempfile::tempdir().unwrap();
    let spec =
        write(tmp.path(), "one.toml", &format!("{BASE}[[estimator]]\nkind = \"sgd\"\n[[estimator]]\nkind = \"mle\"\n"));
    let r = onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--out", "out", "--set", "seeds=1"]);
    let dir = tmp.path().join(r.dir());
    assert!(r.stderr.contains("(2 configs × 1 seed)"), "{}", r.stderr);
    assert!(!r.stderr.contains("1 seeds"), "{}", r.stderr);
    let rep = onepass(tmp.path(), &["report", dir.to_str().unwrap()]);
    assert_eq!(rep.code, 0, "{}", rep.stderr);
    let md = std::fs::read_to_string(dir.join("report/report.md")).unwrap();
    assert!(!md.contains("± 0.0000"), "{md}");
    assert!(md.contains("1 seed: no interval"), "{md}");
    assert!(!md.contains("training pairs") && !md.contains("## Data\n"), "{md}");
    assert!(!md.contains("Reward heads") && !dir.join("report/heads").exists(), "{md}");
    let cells = onepass(tmp.path(), &["cells", dir.to_str().unwrap()]);
    assert_eq!(cells.code, 0, "{}", cells.stderr);
    assert!(cells.stdout.lines().next().unwrap().ends_with(": 2 cells, 2 finished"), "{}", cells.stdout);
    assert_eq!(cells.stdout.lines().filter(|l| l.contains(" finished ")).count(), 2, "{}", cells.stdout);
    let help = onepass(tmp.path(), &["merge", "--help"]);
    assert!(!help.stdout.contains("and report are") && help.stdout.contains("onepass report"), "{}", help.stdout);
}

/// An online run's tables after [`util::tiny_world`]: [`util::TINY_RLOO`] and a `[policy.dpo]`
/// table for an arm the run does not deploy (ignored with one warning line).
const DPO_NOT_DEPLOYED: &str = "[policy.dpo]\nbeta = 0.1\n";

fn online_spec(dir: &Path) -> std::path::PathBuf {
    util::write_prompts(dir);
    write(dir, "online.toml", &format!("{}{}{DPO_NOT_DEPLOYED}", util::tiny_world(2, 50), util::TINY_RLOO))
}

/// An online run ends with the held-out policy reward per arm (policy.parquet's policy_reward,
/// chunk 0 → the last chunk), the mean over seeds with its Student-t interval (df = 1: 12.706 ×
/// the standard error), not the chunks' sample rewards; one seed says it has no interval.
#[test]
fn an_online_run_ends_with_the_held_out_policy_reward() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = online_spec(tmp.path());
    let r = onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--out", "out", "-q", "--threads", "2"]);
    let dir = tmp.path().join(r.dir());
    assert!(r.stderr.contains("held-out policy reward"), "{}", r.stderr);
    assert!(!r.stderr.lines().any(|l| l.starts_with("config ") && l.contains(" policy ")), "{}", r.stderr);
    let p = table(&dir.join("policy.parquet"));
    let (labels, seeds, chunks, reward) =
        (util::strs(&p, "label"), util::u32s(&p, "seed"), util::u64s(&p, "chunk"), util::f64s(&p, "policy_reward"));
    let last_chunk = *chunks.iter().max().unwrap();
    for arm in ["sgd lr=0.1 / best-quantile / best-of-n", "sgd lr=0.1 / best-quantile / rloo"] {
        let at = |c: u64| -> Vec<f64> {
            (0..labels.len()).filter(|&i| labels[i] == arm && chunks[i] == c).map(|i| reward[i]).collect()
        };
        // the base is the base policy as drawn (chunk 0's sample_reward), whatever the arm deploys
        let sample = util::f64s(&p, "sample_reward");
        let base: Vec<f64> =
            (0..labels.len()).filter(|&i| labels[i] == arm && chunks[i] == 0).map(|i| sample[i]).collect();
        let last = at(last_chunk);
        assert_eq!((base.len(), last.len()), (2, 2), "{arm}");
        assert!(seeds.contains(&1));
        let m = (last[0] + last[1]) / 2.0;
        let se = (last[0] - last[1]).abs() / 2.0; // sd/√2 of two values
        let table = r.stderr.split("held-out policy reward").nth(1).unwrap_or_else(|| panic!("{}", r.stderr));
        let line = table.lines().find(|l| l.starts_with(arm)).unwrap_or_else(|| panic!("{arm}: {}", r.stderr));
        // the last column pair: "<mean> ± <half-width>" of the last chunk
        let at = line.find(&format!("{m:.4} ± ")).unwrap_or_else(|| panic!("{arm}: mean {m:.4} in {line}"));
        let hw: f64 = line[at..].split_whitespace().nth(2).unwrap().parse().unwrap();
        assert!((hw - 12.7062 * se).abs() < 2e-4, "{arm}: half-width {hw} vs t(0.975, 1)·se = {}", 12.7062 * se);
        assert!(line.contains(&format!("{:.4}", (base[0] + base[1]) / 2.0)), "{line}");
    }
    let one = onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--out", "out", "-q", "--set", "seeds=1"]);
    assert_eq!(one.code, 0, "{}", one.stderr);
    let table = one.stderr.split("held-out policy reward").nth(1).unwrap_or_else(|| panic!("{}", one.stderr));
    let rloo = table.lines().find(|l| l.starts_with("sgd lr=0.1 / best-quantile / rloo")).unwrap();
    assert!(rloo.contains("1 seed: no interval") && !rloo.contains('±'), "{rloo}");
}

/// `--set 'deploy.policy=["best-of-n"]'` on a spec with `[policy]` tables runs with one warning
/// line naming the tables it ignores (it was refused); with rloo kept only `[policy.dpo]` is
/// named; `[policy]` where no arm could learn (env.kind = "synthetic") is still refused.
#[test]
fn deploy_policy_subsets_a_specs_arms_with_one_warning() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = online_spec(tmp.path());
    let s = spec.to_str().unwrap();
    let r = onepass(tmp.path(), &["run", s, "--dry-run", "--set", r#"deploy.policy=["best-of-n"]"#]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let warnings: Vec<&str> = r.stderr.lines().filter(|l| l.contains("warning")).collect();
    assert_eq!(warnings.len(), 1, "{}", r.stderr);
    assert!(warnings[0].contains("[policy], [policy.rloo], [policy.dpo] ignored"), "{}", warnings[0]);
    assert!(!r.stdout.contains("[policy]") && labels(&r.stdout).len() == 1, "{}", r.stdout);
    let r = onepass(tmp.path(), &["run", s, "--dry-run"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let warnings: Vec<&str> = r.stderr.lines().filter(|l| l.contains("warning")).collect();
    assert_eq!(warnings.len(), 1, "{}", r.stderr);
    assert!(warnings[0].contains(": [policy.dpo] ignored"), "{}", warnings[0]);
    let synthetic = write(
        tmp.path(),
        "synthetic.toml",
        "setting = \"deploy\"\n[env]\ndim = 4\n[stream]\nsamples = 20\n[[estimator]]\nkind = \"sgd\"\n[policy]\nlr = 0.1\n",
    );
    let r = onepass(tmp.path(), &["run", synthetic.to_str().unwrap(), "--dry-run"]);
    assert_eq!(r.code, 2);
    assert!(
        r.stderr.contains("`policy`: applies only to setting = \"deploy\" with env.kind = \"generated\""),
        "{}",
        r.stderr
    );
}
