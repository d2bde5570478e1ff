//! The policy-level controls and what policy.parquet says about them, end to end on the tiny
//! Llama GGUF: ppo's oracle and null controls start their critic at 0 (no learned signal) while
//! the learned arm's starts at θ; `kl_reference = "chunk-start"` makes the KL penalty exactly 0
//! (the plan warns, naming the key) while policy.parquet's `kl_initial` still reports the KL to
//! the initial policy (negative control: with `"initial"` it equals `kl`).

use std::path::PathBuf;

mod util;
use util::{f64s, onepass, strs, table, u64s};

fn spec(extra: &str) -> String {
    format!(
        r#"
{world}[deploy]
chunks = 2
strategies = ["random-pair"]
{extra}
[[estimator]]
kind = "sgd"
lr = 0.1
"#,
        world = util::tiny_world(1, 20)
    )
}

/// Runs `extra` (the `deploy.policy` line and `[policy]` tables) in a fresh directory: the run
/// directory and the run's stderr.
fn run(extra: &str) -> (tempfile::TempDir, PathBuf, String) {
    let tmp = tempfile::tempdir().unwrap();
    util::write_prompts(tmp.path());
    std::fs::write(tmp.path().join("run.toml"), spec(extra)).unwrap();
    let (code, stdout, err) = onepass(tmp.path(), &["run", "run.toml", "--out", "a", "--threads", "2"]).parts();
    assert_eq!(code, 0, "{err}");
    let dir = tmp.path().join(stdout.lines().last().unwrap().trim());
    (tmp, dir, err)
}

const POLICY: &str = "policy = [\"ppo\"]\n[policy]\nrank = 2\nalpha = 4.0\ntargets = \"all-linear\"\nlr = 0.05\n\
                      minibatch = 4\neval_prompts = 3\nsave_adapter = \"none\"\n";

/// With `critic_head` left out, the oracle and null controls' critics start at v = 0 (every
/// value before the update exactly 0: value_mean = 0) and the learned arm's at θ (value_mean ≠ 0).
/// Before, every source's critic started at θ: the controls' value_mean was the learned arm's.
#[test]
fn the_controls_critic_starts_at_zero_the_learned_one_at_theta() {
    let (_tmp, dir, _) =
        run(&format!("{POLICY}[policy.ppo]\nreward = [\"learned\", \"oracle\", \"null\"]\ncritic_lr = 0.01\n"));
    let u = table(&dir.join("policy_updates.parquet"));
    let (src, v) = (strs(&u, "reward"), util::opt_f64s(&u, "value_mean"));
    let mut seen = std::collections::BTreeSet::new();
    for (s, v) in src.iter().zip(&v) {
        let v = v.expect("a ppo row has a value mean");
        match s.as_str() {
            "learned" => assert!(v != 0.0 && v.is_finite(), "learned: the critic starts at θ: {v}"),
            "oracle" | "null" => assert_eq!(v, 0.0, "{s}: a control's critic must start at 0"),
            s => panic!("reward source {s}"),
        }
        seen.insert(s.clone());
    }
    assert_eq!(seen.len(), 3);
}

/// `kl_reference = "chunk-start"`: the penalty's KL (policy_updates' `kl`, before each update)
/// is exactly 0 and the evaluation's `kl` 0 up to the sampler's rounding, the plan says so in one warning line naming the key,
/// and `kl_initial` is the KL to the initial policy: ≠ 0 after an update, and equal to the `kl` of
/// a run with `kl_reference = "initial"` after chunk 1 (its one update is the same in both runs:
/// before it the policy is its reference either way).
#[test]
fn a_chunk_start_reference_warns_and_policy_parquet_keeps_the_kl_to_the_initial_policy() {
    let rloo = "policy = [\"rloo\"]\n[policy]\nrank = 2\nalpha = 4.0\ntargets = \"all-linear\"\nlr = 0.05\n\
                minibatch = 4\neval_prompts = 3\nsave_adapter = \"none\"\n";
    let (_t1, start, err) = run(&format!("{rloo}kl_reference = \"chunk-start\"\n"));
    let warned: Vec<&str> = err.lines().filter(|l| l.contains("kl_reference")).collect();
    assert_eq!(warned.len(), 1, "{err}");
    assert!(warned[0].contains("identically 0") && warned[0].contains("policy.rloo.kl_coef"), "{}", warned[0]);
    let u = table(&start.join("policy_updates.parquet"));
    assert!(f64s(&u, "kl").iter().all(|&k| k == 0.0), "the penalty's KL: {:?}", f64s(&u, "kl"));
    let p = table(&start.join("policy.parquet"));
    let (chunk, kl, kli) = (u64s(&p, "chunk"), f64s(&p, "kl"), f64s(&p, "kl_initial"));
    for i in 0..chunk.len() {
        // the evaluation's samples carry the sampler's log π (f32 merged weights), the reference
        // pass is the scorer's: 0 up to that rounding
        assert!(kl[i].abs() < 1e-5, "chunk {}: kl to the chunk-start reference {}", chunk[i], kl[i]);
        if chunk[i] == 0 {
            assert_eq!(kli[i], 0.0, "the base policy");
        } else {
            assert!(kli[i].abs() > 100.0 * kl[i].abs(), "chunk {}: kl_initial {} vs kl {}", chunk[i], kli[i], kl[i]);
        }
    }
    // negative control: with the initial reference kl_initial is kl, and chunk 1's (one update,
    // identical in both runs: the penalty is 0 before the first update either way) is the same
    let (_t2, initial, err2) = run(rloo);
    assert!(!err2.contains("kl_reference"), "{err2}");
    let q = table(&initial.join("policy.parquet"));
    let (c2, kl2, kli2) = (u64s(&q, "chunk"), f64s(&q, "kl"), f64s(&q, "kl_initial"));
    assert_eq!(kl2, kli2);
    let at = |c: &[u64], v: &[f64], k: u64| v[c.iter().position(|&x| x == k).unwrap()];
    let (a, b) = (at(&chunk, &kli, 1), at(&c2, &kl2, 1));
    assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "chunk 1: kl_initial {a} vs the initial reference's kl {b}");
    assert!(a != 0.0);
}
