//! `env.kind = "generated"` end to end on a tiny random Llama GGUF (policy and feature model):
//! generation, φ, a linear or head oracle, the chunked deployment loop, its tables, the caches
//! (a second run generates nothing and gives the same bytes) and the spec checks.

use arrow_array::Array;
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;

mod util;
use util::{f64s, onepass, table, u32s, u64s};

fn spec(oracle: &str) -> String {
    format!(
        r#"
setting = "deploy"
seeds = 2
[env]
kind = "generated"
eval_pairs = 100
[generate]
prompts = "prompts.jsonl"
policy = "{g}"
n = 4
max_new_tokens = 6
batch_prompts = 2
cache = "cache/gen"
[features]
model = "{g}"
max_len = 64
cache = "cache/phi"
[oracle]
{oracle}
[stream]
batch_size = 2
[deploy]
chunks = 3
strategies = ["random-pair", "best-worst", "ucb"]
[[estimator]]
kind = "omd-exact"
lambda = 1.0
[[estimator]]
kind = "sgd"
lr = 0.1
"#,
        g = util::tiny_gguf().display()
    )
}

fn setup() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let prompts: String =
        ["Say hi.", "Count to three.", "Name a colour.", "Why is the sky blue?", "A joke, please.", "Tell me a fact."]
            .iter()
            .map(|p| format!("{}\n", serde_json::json!({"prompt": p})))
            .collect();
    std::fs::write(dir.path().join("prompts.jsonl"), prompts).unwrap();
    dir
}

fn last_line(s: &str) -> PathBuf {
    PathBuf::from(s.lines().last().unwrap().trim())
}

#[test]
fn chunked_deployment_on_generated_responses() {
    let dir = setup();
    let p = dir.path();
    std::fs::write(p.join("dep.toml"), spec("kind = \"linear\"\nseed = 3")).unwrap();
    let (code, out, err) = onepass(p, &["run", "dep.toml", "--out", "runs"]).parts();
    assert_eq!(code, 0, "{err}");
    let run = p.join(last_line(&out));
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("meta.json")).unwrap()).unwrap();
    let g = &meta["generated"];
    assert_eq!((g["prompts"].as_u64(), g["generated_prompts"].as_u64()), (Some(6), Some(6)));
    assert!((g["reward_std_within"].as_f64().unwrap() - 1.0).abs() < 1e-9, "θ* scaled to within-prompt std 1: {g}");

    // generations: 6 prompts × 4 samples with the oracle's reward
    let gen = table(&run.join("generations.parquet"));
    assert_eq!(gen.num_rows(), 24);
    let reward: HashMap<(u64, u32), f64> =
        u64s(&gen, "prompt").into_iter().zip(u32s(&gen, "sample")).zip(f64s(&gen, "oracle_reward")).collect();

    // rounds: every prompt once per cell; the rewards are the oracle's; the final regret of a
    // cell is the sum over its rounds of best − ½(r(a) + r(a′))
    let rounds = table(&run.join("rounds.parquet"));
    let cells = 2 * 3 * 2;
    assert_eq!(rounds.num_rows(), cells * 6);
    let (pr, fi, se) = (u64s(&rounds, "prompt"), u32s(&rounds, "first"), u32s(&rounds, "second"));
    let (rf, rs, best) = (f64s(&rounds, "reward_first"), f64s(&rounds, "reward_second"), f64s(&rounds, "best_reward"));
    for i in 0..rounds.num_rows() {
        assert_eq!(rf[i], reward[&(pr[i], fi[i])]);
        assert_eq!(rs[i], reward[&(pr[i], se[i])]);
        assert_ne!(fi[i], se[i]);
        let b = (0..4).map(|a| reward[&(pr[i], a)]).fold(f64::NEG_INFINITY, f64::max);
        assert_eq!(best[i], b);
    }
    let cell_of: Vec<String> = {
        let c = rounds.column_by_name("cell_id").unwrap().as_any().downcast_ref::<arrow_array::StringArray>().unwrap();
        (0..c.len()).map(|i| c.value(i).to_string()).collect()
    };
    let mut regret: HashMap<&str, f64> = HashMap::new();
    for i in 0..rounds.num_rows() {
        *regret.entry(&cell_of[i]).or_default() += best[i] - 0.5 * (rf[i] + rs[i]);
    }
    let m = table(&run.join("metrics.parquet"));
    let mc = m.column_by_name("cell_id").unwrap().as_any().downcast_ref::<arrow_array::StringArray>().unwrap();
    let (chunk, mreg) = (u64s(&m, "chunk"), f64s(&m, "regret"));
    assert_eq!(m.num_rows(), cells * 3);
    for i in 0..m.num_rows() {
        if chunk[i] == 3 {
            assert!((mreg[i] - regret[mc.value(i)]).abs() < 1e-9);
        }
    }
    // win rates: every (seed, chunk) hands out one win in total
    let w = table(&run.join("winrates.parquet"));
    let (rate, n) = (f64s(&w, "chunk_win_rate"), u64s(&w, "chunks_compared"));
    let total: f64 = rate.iter().zip(&n).map(|(r, n)| r * *n as f64).sum();
    assert!((total - 2.0 * 3.0).abs() < 1e-9, "{total}: one win per (seed, chunk), 2 seeds × 3 chunks");
    assert!(n.iter().all(|&c| c == 6), "every config is compared on 2 seeds × 3 chunks");

    // a second run reads the texts and φ from the caches and writes the same metrics bytes
    let (code, out2, err) = onepass(p, &["run", "dep.toml", "--out", "runs"]).parts();
    assert_eq!(code, 0, "{err}");
    let run2 = p.join(last_line(&out2));
    let meta2: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run2.join("meta.json")).unwrap()).unwrap();
    assert_eq!(meta2["generated"]["generation_cache_hits"].as_u64(), Some(6));
    assert_eq!(meta2["generated"]["generated_prompts"].as_u64(), Some(0));
    assert_eq!(meta2["generated"]["features_cache_hits"].as_u64(), Some(24));
    for t in ["metrics.parquet", "rounds.parquet", "winrates.parquet", "generations.parquet"] {
        assert_eq!(std::fs::read(run.join(t)).unwrap(), std::fs::read(run2.join(t)).unwrap(), "{t}");
    }

    // a head oracle: the file's weights are what scores the responses
    let d = meta["generated"]["dim"].as_u64().unwrap() as usize;
    let w: Vec<f32> = (0..d).map(|i| ((i * 7919) % 13) as f32 / 13.0 - 0.5).collect();
    let bytes: Vec<u8> = w.iter().flat_map(|x| x.to_le_bytes()).collect();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1, d], &bytes).unwrap();
    safetensors::serialize_to_file([("score.weight", view)], None, &p.join("head.safetensors")).unwrap();
    std::fs::write(p.join("head.toml"), spec("kind = \"head\"\npath = \"head.safetensors\"\nlabels = \"argmax\""))
        .unwrap();
    let (code, out3, err) = onepass(p, &["run", "head.toml", "--out", "runs"]).parts();
    assert_eq!(code, 0, "{err}");
    let gen3 = table(&p.join(last_line(&out3)).join("generations.parquet"));
    let r3 = f64s(&gen3, "oracle_reward");
    // the rewards are linear in the file's weights: a head of 2w gives exactly twice the rewards
    let bytes2: Vec<u8> = w.iter().flat_map(|x| (2.0 * x).to_le_bytes()).collect();
    let view2 = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1, d], &bytes2).unwrap();
    safetensors::serialize_to_file([("score.weight", view2)], None, &p.join("head.safetensors")).unwrap();
    let (code, out4, err) = onepass(p, &["run", "head.toml", "--out", "runs"]).parts();
    assert_eq!(code, 0, "{err}");
    let r4 = f64s(&table(&p.join(last_line(&out4)).join("generations.parquet")), "oracle_reward");
    for (a, b) in r3.iter().zip(&r4) {
        assert!((2.0 * a - b).abs() <= 1e-9 * b.abs().max(1.0), "{a} vs {b}");
    }
    assert!(r3.iter().any(|x| *x != r3[0]));

    // the authors' re-initialised head: other θ from chunk 2 on, every chunk still timed
    let (code, out5, err) =
        onepass(p, &["run", "dep.toml", "--out", "runs", "--set", "deploy.reset_each_chunk=true"]).parts();
    assert_eq!(code, 0, "{err}");
    let run5 = p.join(last_line(&out5));
    let m5 = table(&run5.join("metrics.parquet"));
    assert_eq!(table(&run5.join("timings.parquet")).num_rows(), m5.num_rows());
    assert_eq!(u64s(&m5, "samples_seen"), u64s(&m, "samples_seen"), "counters go on across resets");
    assert_ne!(f64s(&m5, "eval_loss"), f64s(&m, "eval_loss"));
}

#[test]
fn generated_specs_are_checked() {
    let dir = setup();
    let p = dir.path();
    for (oracle, key) in [
        ("kind = \"head\"", "oracle.path"),
        ("kind = \"linear\"\nreward_std = -1.0", "oracle.reward_std"),
        ("kind = \"linear\"\nreward_std = 1.0\nnorm = 2.0", "oracle.norm"),
        ("kind = \"reward-model\"", "oracle.model"),
        ("kind = \"linear\"\nlabel = \"argmax\"", "label"),
    ] {
        std::fs::write(p.join("bad.toml"), spec(oracle)).unwrap();
        let (code, _, err) = onepass(p, &["run", "bad.toml", "--out", "runs"]).parts();
        assert_eq!(code, 2, "{oracle}: {err}");
        assert!(err.contains(key) && err.contains("bad.toml") && !err.contains("panicked"), "{oracle}: {err}");
    }
    std::fs::write(p.join("bad.toml"), spec("kind = \"linear\"").replace("n = 4", "n = 1")).unwrap();
    let (code, _, err) = onepass(p, &["run", "bad.toml", "--out", "runs"]).parts();
    assert!(code == 2 && err.contains("generate.n"), "{err}");
    std::fs::write(p.join("bad.toml"), spec("kind = \"linear\"").replace("chunks = 3", "chunks = 7")).unwrap();
    let (code, _, err) = onepass(p, &["run", "bad.toml", "--out", "runs"]).parts();
    assert!(code == 2 && err.contains("deploy.chunks"), "{err}");
    std::fs::write(p.join("prompts.jsonl"), "{\"prompt\": \"ok\"}\n{\"prompt\": null}\n").unwrap();
    std::fs::write(p.join("bad.toml"), spec("kind = \"linear\"")).unwrap();
    let (code, _, err) = onepass(p, &["run", "bad.toml", "--out", "runs"]).parts();
    assert!(code == 2 && err.contains("prompts.jsonl: line 2"), "{err}");
}

/// Chunked deployment killed (SIGKILL) in an update of its second cell and resumed: the same
/// metrics, rounds and θ bytes as an uninterrupted run.
#[test]
fn chunked_deployment_resumes_after_sigkill() {
    use std::os::unix::process::ExitStatusExt;
    let tmp = setup();
    let spec = spec("kind = \"linear\"\nseed = 3").replace("[deploy]", "[checkpoint]\nevery_steps = 1\n[deploy]");
    std::fs::write(tmp.path().join("run.toml"), spec).unwrap();
    let (code, stdout, stderr) = onepass(tmp.path(), &["run", "run.toml", "--out", "a", "--threads", "1"]).parts();
    assert_eq!(code, 0, "{stderr}");
    let want = tmp.path().join(last_line(&stdout));
    let out = Command::new(env!("CARGO_BIN_EXE_onepass"))
        .current_dir(tmp.path())
        .args(["run", "run.toml", "--out", "b", "--threads", "1"])
        .env("ONEPASS_FAILPOINT", "update:9")
        .output()
        .unwrap();
    assert_eq!(out.status.signal(), Some(9), "{}", String::from_utf8_lossy(&out.stderr));
    let dir = std::fs::read_dir(tmp.path().join("b")).unwrap().next().unwrap().unwrap().path();
    assert!(dir.join("checkpoints").read_dir().unwrap().count() >= 2, "a finished cell and a checkpoint");
    let (code, _, stderr) = onepass(tmp.path(), &["run", "run.toml", "--resume", dir.to_str().unwrap()]).parts();
    assert_eq!(code, 0, "{stderr}");
    for f in ["metrics.parquet", "rounds.parquet", "cells.parquet", "winrates.parquet", "theta/c0003.npy"] {
        assert!(
            std::fs::read(want.join(f)).unwrap() == std::fs::read(dir.join(f)).unwrap(),
            "{f} differs after resume"
        );
    }
}

/// The paper's practical active rule on generated responses: a fresh prompt per label, its n
/// samples ranked by θ, best vs worst queried — beside the pool rules, on the same bank.
#[test]
fn active_best_worst_on_generated_responses() {
    let tmp = setup();
    let text = spec("kind = \"linear\"\nseed = 3")
        .replace("setting = \"deploy\"", "setting = \"active\"")
        .replace("[stream]\nbatch_size = 2", "[stream]\nbatch_size = 2\nsamples = 12\neval_every = 6")
        .replace(
            "[deploy]\nchunks = 3\nstrategies = [\"random-pair\", \"best-worst\", \"ucb\"]",
            "[active]\nrule = [\"random\", \"best-worst\"]\npool = 20",
        );
    std::fs::write(tmp.path().join("act.toml"), text).unwrap();
    let (code, stdout, stderr) = onepass(tmp.path(), &["run", "act.toml", "--out", "a"]).parts();
    assert_eq!(code, 0, "{stderr}");
    let m = table(&tmp.path().join(last_line(&stdout)).join("metrics.parquet"));
    let strat = m.column_by_name("strategy").unwrap().as_any().downcast_ref::<arrow_array::StringArray>().unwrap();
    let rules: std::collections::BTreeSet<&str> = (0..m.num_rows()).map(|i| strat.value(i)).collect();
    assert_eq!(rules.into_iter().collect::<Vec<_>>(), ["best-worst", "random"]);
    let seen = u64s(&m, "samples_seen");
    assert_eq!(*seen.iter().max().unwrap(), 12);
    assert!(f64s(&m, "subopt").iter().all(|v| v.is_finite()));
}

/// The generation cache keys the generator's dtype: a bf16 bank is drawn by the bf16 model, not
/// read from the f32 bank's files (that key is unchanged: f32 caches stay valid), and each kind
/// says its dtype in its describe.json.
#[test]
fn a_bf16_bank_is_not_read_from_the_f32_banks_cache() {
    let tmp = setup();
    let p = tmp.path();
    let dirs = || -> Vec<(String, String)> {
        let mut v: Vec<(String, String)> = std::fs::read_dir(p.join("cache/gen"))
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                let d: serde_json::Value =
                    serde_json::from_slice(&std::fs::read(e.path().join("describe.json")).unwrap()).unwrap();
                (e.file_name().to_string_lossy().into_owned(), d["dtype"].as_str().unwrap_or("").to_string())
            })
            .collect();
        v.sort();
        v
    };
    let text = spec("kind = \"linear\"\nseed = 3");
    std::fs::write(p.join("run.toml"), &text).unwrap();
    let (code, _, err) = onepass(p, &["run", "run.toml", "--out", "a"]).parts();
    assert_eq!(code, 0, "{err}");
    let f32_dirs = dirs();
    assert!(!f32_dirs.is_empty() && f32_dirs.iter().all(|d| d.1 == "f32"), "{f32_dirs:?}");
    std::fs::write(p.join("run.toml"), text.replace("[generate]\n", "[generate]\ndtype = \"bf16\"\n")).unwrap();
    let (code, _, err) = onepass(p, &["run", "run.toml", "--out", "b"]).parts();
    assert_eq!(code, 0, "{err}");
    let all = dirs();
    let bf16: Vec<_> = all.iter().filter(|d| !f32_dirs.iter().any(|f| f.0 == d.0)).collect();
    assert_eq!(bf16.len(), f32_dirs.len(), "the bf16 bank read the f32 bank's cache: {all:?}");
    assert!(bf16.iter().all(|d| d.1 == "bf16"), "{all:?}");
}
