//! The online loop closed (`deploy.policy = "rloo" | "dpo"`) end to end on a tiny random Llama
//! GGUF: every arm's policy evaluated before the first chunk on the same base samples; the
//! fixed control stays flat; learning policies move away from the reference (KL > 0) and save
//! PEFT adapters; lr = 0 does not move them (negative control); 1 vs 2 threads give the same
//! bytes; a run killed mid-way resumes to the same bytes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

mod util;
use util::{f64s, onepass, strs, table, u32s, u64s};

fn spec(lr: f64) -> String {
    format!(
        r#"
setting = "deploy"
seeds = 2
[env]
kind = "generated"
eval_pairs = 50
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
batch_size = 2
[deploy]
chunks = 3
strategies = ["random-pair", "best-quantile"]
q = 2
policy = ["best-of-n", "rloo", "dpo"]
[policy]
rank = 2
alpha = 4.0
targets = "all-linear"
lr = {lr}
epochs = 2
minibatch = 4
eval_prompts = 3
eval_samples = 2
save_adapter = "every-chunk"
[[estimator]]
kind = "sgd"
lr = 0.1
"#,
        g = util::tiny_gguf().display()
    )
}

fn setup(lr: f64) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let prompts: String = [
        "Say hi.",
        "Count to three.",
        "Name a colour.",
        "Why is the sky blue?",
        "A joke, please.",
        "Tell me a fact.",
        "What is rain?",
        "Spell cat.",
        "Pick a number.",
    ]
    .iter()
    .map(|p| format!("{}\n", serde_json::json!({"prompt": p})))
    .collect();
    std::fs::write(dir.path().join("prompts.jsonl"), prompts).unwrap();
    std::fs::write(dir.path().join("run.toml"), spec(lr)).unwrap();
    dir
}

fn run(p: &Path, out: &str, threads: &str) -> PathBuf {
    let (code, stdout, err) = onepass(p, &["run", "run.toml", "--out", out, "--threads", threads]).parts();
    assert_eq!(code, 0, "{err}");
    p.join(stdout.lines().last().unwrap().trim())
}

/// (policy arm, seed, strategy) → oracle reward per chunk, and the same for KL.
type Curves = BTreeMap<(String, u32, String), Vec<(u64, f64, f64)>>;

fn curves(dir: &Path) -> Curves {
    let t = table(&dir.join("policy.parquet"));
    let (arm, seed, strat) = (strs(&t, "policy"), u32s(&t, "seed"), strs(&t, "strategy"));
    let (chunk, oracle, kl) = (u64s(&t, "chunk"), f64s(&t, "oracle_reward"), f64s(&t, "kl"));
    let mut out = Curves::new();
    for i in 0..chunk.len() {
        out.entry((arm[i].clone(), seed[i], strat[i].clone())).or_default().push((chunk[i], oracle[i], kl[i]));
    }
    out
}

#[test]
fn learning_policies_move_the_fixed_one_does_not_and_every_arm_starts_alike() {
    let tmp = setup(0.05);
    let p = tmp.path();
    let dir = run(p, "a", "2");
    let c = curves(&dir);
    assert_eq!(c.len(), 3 * 2 * 2, "3 arms × 2 seeds × 2 strategies");
    let start: Vec<f64> = c.values().map(|v| v[0].1).collect();
    for ((arm, seed, strat), v) in &c {
        assert_eq!(v.iter().map(|x| x.0).collect::<Vec<_>>(), [0, 1, 2, 3], "{arm} {seed} {strat}: chunks 0..=3");
        // before any update every policy is the base policy on the same samples
        assert_eq!(v[0].1, start[0], "{arm}: chunk 0 differs from the other arms'");
        assert_eq!(v[0].2, 0.0);
        if arm == "best-of-n" {
            assert!(v.iter().all(|x| x.1 == v[0].1 && x.2 == 0.0), "the fixed policy moved: {v:?}");
        } else {
            assert!(v[1..].iter().all(|x| x.2 != 0.0), "{arm}: no KL after an update: {v:?}");
            assert!(v[1..].iter().any(|x| x.1 != v[0].1), "{arm}: the samples never changed: {v:?}");
        }
    }
    // adapters in PEFT's layout for the learning cells, after every chunk
    let cells = table(&dir.join("cells.parquet"));
    let (ids, arms) = (strs(&cells, "cell_id"), strs(&cells, "policy"));
    for (id, arm) in ids.iter().zip(&arms) {
        let a = dir.join("adapters").join(id);
        if arm == "best-of-n" {
            assert!(!a.exists(), "{id} ({arm}) saved an adapter");
            continue;
        }
        for chunk in 1..=3 {
            let d = a.join(format!("chunk-{chunk:02}"));
            let cfg: serde_json::Value =
                serde_json::from_slice(&std::fs::read(d.join("adapter_config.json")).unwrap()).unwrap();
            assert_eq!(cfg["r"], 2);
            assert_eq!(cfg["peft_type"], "LORA");
            let st = std::fs::read(d.join("adapter_model.safetensors")).unwrap();
            let st = safetensors::SafeTensors::deserialize(&st).unwrap();
            assert!(st.names().iter().any(|n| n.ends_with("self_attn.q_proj.lora_B.weight")));
        }
    }
    // same spec, one thread: the same bytes
    let one = run(p, "b", "1");
    for f in ["policy.parquet", "metrics.parquet", "rounds.parquet", "cells.parquet"] {
        assert!(std::fs::read(dir.join(f)).unwrap() == std::fs::read(one.join(f)).unwrap(), "{f}: 1 vs 2 threads");
    }
}

/// Negative control: with lr = 0 the learning arms take their steps but never move, so their
/// held-out samples — and oracle rewards — stay the base policy's.
#[test]
fn lr_zero_leaves_the_learning_policies_at_the_base_policy() {
    let tmp = setup(0.0);
    let dir = run(tmp.path(), "a", "2");
    for ((arm, _, _), v) in curves(&dir) {
        assert!(v.iter().all(|x| x.1 == v[0].1 && x.2 == 0.0), "{arm} moved with lr = 0: {v:?}");
    }
}

/// A run killed (SIGKILL) in the 17th estimator update (a dpo cell's second chunk: its first
/// chunk's adapters and Adam state are in its checkpoint) resumes to the bytes of an
/// uninterrupted run: LoRA weights and Adam state are in the checkpoints.
#[test]
fn an_online_run_resumes_after_sigkill_to_the_same_bytes() {
    use std::os::unix::process::ExitStatusExt;
    let tmp = setup(0.05);
    let p = tmp.path();
    let text = spec(0.05).replace("[deploy]", "[checkpoint]\nevery_steps = 1\n[deploy]");
    std::fs::write(p.join("run.toml"), text).unwrap();
    let want = run(p, "a", "1");
    let out = Command::new(env!("CARGO_BIN_EXE_onepass"))
        .current_dir(p)
        .args(["run", "run.toml", "--out", "b", "--threads", "1"])
        .env("ONEPASS_FAILPOINT", "update:17")
        .output()
        .unwrap();
    assert_eq!(out.status.signal(), Some(9), "{}", String::from_utf8_lossy(&out.stderr));
    let dir = std::fs::read_dir(p.join("b")).unwrap().next().unwrap().unwrap().path();
    let (code, _, stderr) = onepass(p, &["run", "run.toml", "--resume", dir.to_str().unwrap()]).parts();
    assert_eq!(code, 0, "{stderr}");
    for f in ["policy.parquet", "metrics.parquet", "rounds.parquet", "cells.parquet"] {
        assert!(
            std::fs::read(want.join(f)).unwrap() == std::fs::read(dir.join(f)).unwrap(),
            "{f} differs after resume"
        );
    }
    let a = |d: &Path| std::fs::read(d.join("adapters/c0005/chunk-03/adapter_model.safetensors")).unwrap();
    assert!(a(&want) == a(&dir), "the last adapter differs after resume");
}

/// A head oracle scores the learning policies' new responses too: with argmax labels (scale
/// free) a head of 2w gives the same labels, θ, policies and samples as w, and exactly twice
/// every oracle reward of policy.parquet.
#[test]
fn a_head_oracle_scores_the_new_responses() {
    let tmp = setup(0.05);
    let p = tmp.path();
    let first = run(p, "a", "2");
    let meta: serde_json::Value = serde_json::from_slice(&std::fs::read(first.join("meta.json")).unwrap()).unwrap();
    let d = meta["generated"]["dim"].as_u64().unwrap() as usize;
    let head = |scale: f32, name: &str| {
        let w: Vec<f32> = (0..d).map(|i| scale * (((i * 7919) % 13) as f32 / 13.0 - 0.5)).collect();
        let bytes: Vec<u8> = w.iter().flat_map(|x| x.to_le_bytes()).collect();
        let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1, d], &bytes).unwrap();
        safetensors::serialize_to_file([("score.weight", view)], None, &p.join(name)).unwrap();
    };
    head(1.0, "h1.safetensors");
    head(2.0, "h2.safetensors");
    let with = |name: &str, out: &str| {
        let text = spec(0.05).replace(
            "kind = \"linear\"\nseed = 3",
            &format!("kind = \"head\"\npath = \"{name}\"\nlabels = \"argmax\""),
        );
        std::fs::write(p.join("run.toml"), text).unwrap();
        run(p, out, "2")
    };
    let (a, b) = (curves(&with("h1.safetensors", "h1")), curves(&with("h2.safetensors", "h2")));
    let mut moved = false;
    for (k, va) in &a {
        let vb = &b[k];
        for (x, y) in va.iter().zip(vb) {
            assert!((2.0 * x.1 - y.1).abs() <= 1e-9 * y.1.abs().max(1.0), "{k:?}: {} vs {}", x.1, y.1);
            assert_eq!(x.2, y.2, "{k:?}: the same policy (KL)");
        }
        moved |= va.iter().any(|x| x.1 != va[0].1);
    }
    assert!(moved, "some policy's samples changed");
}
