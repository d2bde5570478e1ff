//! The online loop closed (`deploy.policy = "rloo" | "dpo"`) end to end on a tiny random Llama
//! GGUF: every arm of a seed evaluated before the first chunk on the same base samples (the
//! seed's held-out streams; another seed's differ); the fixed control stays flat; learning
//! policies move away from the reference (KL > 0), change their digest every chunk, generate
//! from weights within f32 rounding of W + BA, and save PEFT adapters; lr = 0 does not move
//! them (negative control); each reward source drives its update with its own reward; 1 vs 2
//! threads give the same bytes; a run killed mid-way resumes to the same bytes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

mod util;
use util::{command, f64s, finish, onepass, strs, table, u32s, u64s};

fn spec(lr: f64) -> String {
    format!(
        r#"
{world}[deploy]
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
save_adapter = "every-chunk"
[[estimator]]
kind = "sgd"
lr = 0.1
"#,
        world = util::tiny_world(2, 50)
    )
}

fn setup(lr: f64) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    util::write_prompts(dir.path());
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
    let (chunk, oracle, kl) = (u64s(&t, "chunk"), f64s(&t, "sample_reward"), f64s(&t, "kl"));
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
    let start: BTreeMap<u32, f64> = c.iter().map(|((_, seed, _), v)| (*seed, v[0].1)).collect();
    assert_ne!(start[&0], start[&1], "the seeds' held-out streams should differ");
    for ((arm, seed, strat), v) in &c {
        assert_eq!(v.iter().map(|x| x.0).collect::<Vec<_>>(), [0, 1, 2, 3], "{arm} {seed} {strat}: chunks 0..=3");
        // before any update every policy of a seed is the base policy on the same samples
        assert_eq!(v[0].1, start[seed], "{arm}: chunk 0 differs from the other arms' of seed {seed}");
        assert_eq!(v[0].2, 0.0);
        if arm == "best-of-n" {
            assert!(v.iter().all(|x| x.1 == v[0].1 && x.2 == 0.0), "the fixed policy moved: {v:?}");
        } else {
            assert!(v[1..].iter().all(|x| x.2 != 0.0), "{arm}: no KL after an update: {v:?}");
            assert!(v[1..].iter().any(|x| x.1 != v[0].1), "{arm}: the samples never changed: {v:?}");
        }
    }
    // the sampler is the trained policy: a new digest after every update, generating weights
    // within f32 rounding of W + BA; the arms that do not learn generate from the base
    let t = table(&dir.join("policy.parquet"));
    let (arm, digest, merr, chunk) =
        (strs(&t, "policy"), strs(&t, "policy_digest"), f64s(&t, "merge_error"), u64s(&t, "chunk"));
    let (cid, mut last) = (strs(&t, "cell_id"), BTreeMap::new());
    for i in 0..arm.len() {
        if arm[i] == "best-of-n" {
            assert_eq!((digest[i].as_str(), merr[i]), ("base", 0.0));
            continue;
        }
        assert!(merr[i] < 1e-3, "{}: merge error {}", cid[i], merr[i]);
        if let Some(prev) = last.insert(cid[i].clone(), digest[i].clone()) {
            assert_ne!(prev, digest[i], "{} chunk {}: the digest did not change", cid[i], chunk[i]);
        }
    }
    // policy_updates.parquet: each chunk's samples come from the previous chunk's update
    let u = table(&dir.join("policy_updates.parquet"));
    let (uc, roll, upd, steps) =
        (strs(&u, "cell_id"), strs(&u, "rollout_digest"), strs(&u, "updated_digest"), u64s(&u, "update_steps"));
    assert_eq!(uc.len(), 2 * 2 * 2 * 3, "2 learning arms × 2 seeds × 2 strategies × 3 chunks");
    for i in 1..uc.len() {
        if uc[i] == uc[i - 1] {
            assert_eq!(roll[i], upd[i - 1], "{}: the chunk's sampler is not the last update's policy", uc[i]);
        }
        assert!(steps[i] > 0 || arms_of(&dir, &uc[i]) == "dpo", "{}: an rloo update without steps", uc[i]);
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
    policy_samples_are_the_rows_policy_averages(&dir);
    // same spec, one thread: the same bytes
    let one = run(p, "b", "1");
    for f in ["policy.parquet", "policy_samples.parquet", "metrics.parquet", "rounds.parquet", "cells.parquet"] {
        assert!(std::fs::read(dir.join(f)).unwrap() == std::fs::read(one.join(f)).unwrap(), "{f}: 1 vs 2 threads");
    }
}

/// policy_samples.parquet holds, per cell and evaluation, eval_prompts × eval_samples rows whose
/// means are policy.parquet's row (recomputed here from the samples: the oracle reward of all
/// and of the deployed ones, the learned reward, length, KL to the reference and to the initial
/// policy); every arm of a seed sees the same base samples at chunk 0; best-of-n deploys one
/// sample per group of n, a learning arm all. The report gives the seeds × prompts interval.
fn policy_samples_are_the_rows_policy_averages(dir: &Path) {
    let t = table(&dir.join("policy.parquet"));
    let s = table(&dir.join("policy_samples.parquet"));
    let (cell, chunk, prompt, sample) =
        (strs(&s, "cell_id"), u64s(&s, "chunk"), u64s(&s, "prompt"), u32s(&s, "sample"));
    let (oracle, learned, deployed) =
        (f64s(&s, "oracle_reward"), f64s(&s, "learned_reward"), util::bools(&s, "deployed"));
    let (tokens, kl, kl0) = (u64s(&s, "tokens"), util::opt_f64s(&s, "kl"), util::opt_f64s(&s, "kl_initial"));
    let (seed, arm) = (u32s(&s, "seed"), strs(&s, "policy"));
    // (cell, chunk) → its samples' indices
    let mut by: BTreeMap<(String, u64), Vec<usize>> = BTreeMap::new();
    for i in 0..cell.len() {
        by.entry((cell[i].clone(), chunk[i])).or_default().push(i);
    }
    let (tc, tk) = (strs(&t, "cell_id"), u64s(&t, "chunk"));
    assert_eq!(by.len(), tc.len(), "one group of samples per policy.parquet row");
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let close = |a: f64, b: f64, what: &str| assert!((a - b).abs() <= 1e-9 * (1.0 + b.abs()), "{what}: {a} vs {b}");
    let mut base: BTreeMap<u32, Vec<f64>> = BTreeMap::new();
    for r in 0..tc.len() {
        let ix = &by[&(tc[r].clone(), tk[r])];
        assert_eq!(ix.len(), 3 * 3, "{} chunk {}: eval_prompts 3 × eval_samples n = 3", tc[r], tk[r]);
        let got: Vec<(u64, u32)> = ix.iter().map(|&i| (prompt[i], sample[i])).collect();
        let want: Vec<(u64, u32)> = (0..3u64).flat_map(|p| (0..3u32).map(move |j| (p, j))).collect();
        assert_eq!(got, want, "{}: prompts and samples in order", tc[r]);
        let pick = |v: &[f64]| ix.iter().map(|&i| v[i]).collect::<Vec<f64>>();
        close(mean(&pick(&oracle)), f64s(&t, "sample_reward")[r], "sample_reward");
        close(mean(&pick(&learned)), f64s(&t, "learned_reward")[r], "learned_reward");
        let dep: Vec<f64> = ix.iter().filter(|&&i| deployed[i]).map(|&i| oracle[i]).collect();
        close(mean(&dep), f64s(&t, "policy_reward")[r], "policy_reward");
        let n_dep = if arm[ix[0]] == "best-of-n" { 3 } else { 9 };
        assert_eq!(dep.len(), n_dep, "{}: deployed samples", arm[ix[0]]);
        let toks: Vec<f64> = ix.iter().map(|&i| tokens[i] as f64).collect();
        close(mean(&toks), f64s(&t, "response_tokens")[r], "response_tokens");
        if arm[ix[0]] == "best-of-n" {
            assert!(ix.iter().all(|&i| kl[i].is_none() && kl0[i].is_none()), "a fixed policy has no KL");
        } else {
            let k: Vec<f64> = ix.iter().map(|&i| kl[i].unwrap()).collect();
            let k0: Vec<f64> = ix.iter().map(|&i| kl0[i].unwrap()).collect();
            close(mean(&k), f64s(&t, "kl")[r], "kl");
            close(mean(&k0), f64s(&t, "kl_initial")[r], "kl_initial");
        }
        if tk[r] == 0 {
            let b = pick(&oracle);
            let first = base.entry(seed[ix[0]]).or_insert_with(|| b.clone());
            assert_eq!(*first, b, "{}: chunk 0's samples differ from another arm's of its seed", tc[r]);
        }
    }
    let (code, _, err) = onepass(dir, &["report", dir.to_str().unwrap()]).parts();
    assert_eq!(code, 0, "{err}");
    let md = std::fs::read_to_string(dir.join("report").join("report.md")).unwrap();
    assert!(md.contains("seeds × prompts bootstrap 95%") && md.contains("(2×3)"), "{md}");
    // policy_comparisons.csv: each arm against the base, recomputed here from policy.parquet
    // (the base: chunk 0's sample_reward; the arm: policy_reward after the last chunk)
    let csv = std::fs::read_to_string(dir.join("report").join("policy_comparisons.csv")).unwrap();
    let (lab, ch, seeds) = (strs(&t, "label"), u64s(&t, "chunk"), u32s(&t, "seed"));
    let (pr, sr) = (f64s(&t, "policy_reward"), f64s(&t, "sample_reward"));
    let mut against_base = 0;
    for line in csv.lines().skip(1) {
        let f: Vec<&str> = line.split(',').collect();
        if f[2] != "base" {
            continue;
        }
        against_base += 1;
        let label = format!("{} / {}", f[0], f[1]);
        let mut d = Vec::new();
        for sd in 0..2u32 {
            let at = |c: u64| (0..lab.len()).find(|&i| lab[i] == label && seeds[i] == sd && ch[i] == c).unwrap();
            d.push(pr[at(3)] - sr[at(0)]);
        }
        assert_eq!(f[3], "2", "{line}");
        let want = (d[0] + d[1]) / 2.0;
        let got: f64 = f[6].parse().unwrap();
        assert!((got - want).abs() < 1e-12, "{label}: report {got} vs policy.parquet {want}");
        // the bootstrap over 2 seeds × 3 prompts brackets its own mean
        let (lo, hi): (f64, f64) = (f[13].parse().unwrap(), f[14].parse().unwrap());
        assert!(lo <= want && want <= hi, "{line}");
    }
    assert_eq!(against_base, 3 * 2, "3 arms × 2 strategies against the base: {csv}");
}

/// The deployed policy of a cell.
fn arms_of(dir: &Path, cell: &str) -> String {
    let t = table(&dir.join("cells.parquet"));
    let (ids, arms) = (strs(&t, "cell_id"), strs(&t, "policy"));
    ids.iter().zip(arms).find(|(i, _)| *i == cell).map(|(_, a)| a).unwrap()
}

/// `policy.reward` sweeps the reward rloo's update reads: the oracle arm trains on the oracle's
/// rewards of its samples and the learned arm on φᵀθ (so each update_reward equals the mean of
/// that reward over the chunk's samples); the null arm's reward is neither.
#[test]
fn each_reward_source_drives_its_update_with_its_own_reward() {
    let tmp = setup(0.05);
    let p = tmp.path();
    let text = spec(0.05)
        .replace("[[estimator]]", "[policy.rloo]\nreward = [\"learned\", \"oracle\", \"null\"]\n[[estimator]]");
    std::fs::write(p.join("run.toml"), text).unwrap();
    let dir = run(p, "a", "2");
    let cells = table(&dir.join("cells.parquet"));
    assert_eq!(strs(&cells, "cell_id").len(), (1 + 3 + 1) * 2 * 2, "best-of-n, rloo × 3 sources, dpo");
    let u = table(&dir.join("policy_updates.parquet"));
    let (arm, src) = (strs(&u, "policy"), strs(&u, "reward"));
    let (got, oracle, learned) =
        (f64s(&u, "update_reward"), f64s(&u, "rollout_oracle_reward"), f64s(&u, "rollout_learned_reward"));
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..arm.len() {
        if arm[i] != "rloo" {
            continue;
        }
        seen.insert(src[i].clone());
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * (1.0 + b.abs());
        match src[i].as_str() {
            "oracle" => assert!(close(got[i], oracle[i]), "oracle arm: {} vs {}", got[i], oracle[i]),
            "learned" => assert!(close(got[i], learned[i]), "learned arm: {} vs {}", got[i], learned[i]),
            "null" => assert!(!close(got[i], learned[i]) && !close(got[i], oracle[i]), "null arm read a real reward"),
            s => panic!("reward source {s}"),
        }
    }
    assert_eq!(seen.len(), 3);
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

/// run.toml killed (SIGKILL) in the 17th estimator update into `b/`, then resumed: its directory.
fn killed_and_resumed(p: &Path) -> PathBuf {
    killed_at_and_resumed(p, "update:17")
}

/// run.toml killed (SIGKILL) at `failpoint` into `b/`, then resumed: its directory.
fn killed_at_and_resumed(p: &Path, failpoint: &str) -> PathBuf {
    let dir = killed_at(p, failpoint, "b");
    let (code, _, stderr) = onepass(p, &["run", "run.toml", "--resume", dir.to_str().unwrap()]).parts();
    assert_eq!(code, 0, "{stderr}");
    dir
}

/// run.toml killed (SIGKILL) at `failpoint` into `out/`: its run directory.
fn killed_at(p: &Path, failpoint: &str, out: &str) -> PathBuf {
    use std::os::unix::process::ExitStatusExt;
    let o = command()
        .current_dir(p)
        .args(["run", "run.toml", "--out", out, "--threads", "1"])
        .env("ONEPASS_FAILPOINT", failpoint)
        .output()
        .unwrap();
    assert_eq!(o.status.signal(), Some(9), "{failpoint}: {}", String::from_utf8_lossy(&o.stderr));
    only_run(p, out)
}

/// The spec of `setup` with `policies` deployed, a dpo warm start on the committed 6-pair file
/// (copied into `p` as warm.jsonl, 4 rows) and a checkpoint every step.
fn with_warm_start(p: &Path, policies: &str) -> String {
    std::fs::copy(util::root().join("crates/runner/tests/fixtures/warm-prefs.jsonl"), p.join("warm.jsonl")).unwrap();
    spec(0.05)
        .replace("policy = [\"best-of-n\", \"rloo\", \"dpo\"]", &format!("policy = {policies}"))
        .replace("[[estimator]]", "[policy.dpo.warm_start]\npath = \"warm.jsonl\"\nrows = 4\n[[estimator]]")
        .replace("[deploy]", "[checkpoint]\nevery_steps = 1\n[deploy]")
}

/// A run killed (SIGKILL) in the 17th estimator update (a dpo cell's second chunk: its first
/// chunk's adapters and Adam state are in its checkpoint) resumes to the bytes of an
/// uninterrupted run: LoRA weights and Adam state are in the checkpoints.
#[test]
fn an_online_run_resumes_after_sigkill_to_the_same_bytes() {
    let tmp = setup(0.05);
    let p = tmp.path();
    let text = spec(0.05).replace("[deploy]", "[checkpoint]\nevery_steps = 1\n[deploy]");
    std::fs::write(p.join("run.toml"), text).unwrap();
    let want = run(p, "a", "1");
    let dir = killed_and_resumed(p);
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

/// The authors' life cycle (issue 29): a fresh adapter per chunk merged after each update, the
/// KL reference at the chunk's start, Adam betas (0.9, 0.95) and a cosine schedule with warm-up
/// restarted per chunk. The learning policies move (a digest per chunk, held-out samples
/// change); a run killed in a dpo cell's second chunk (its first merge and reference move are
/// in the checkpoint) resumes to the bytes of an uninterrupted run. Negative control: the same
/// run with a persistent adapter gives other policy rows.
#[test]
fn fresh_adapters_per_chunk_resume_after_sigkill_to_the_same_bytes() {
    let tmp = setup(0.05);
    let p = tmp.path();
    let life = "save_adapter = \"none\"\nadapter = \"fresh-per-chunk\"\nkl_reference = \"chunk-start\"\n\
                lr_schedule = \"cosine-with-min-lr\"\nwarmup_ratio = 0.1\nadam_betas = [0.9, 0.95]";
    let text = spec(0.05)
        .replace("save_adapter = \"every-chunk\"", life)
        .replace("[deploy]", "[checkpoint]\nevery_steps = 1\n[deploy]");
    std::fs::write(p.join("run.toml"), &text).unwrap();
    let want = run(p, "a", "1");
    let t = table(&want.join("policy_updates.parquet"));
    let (before, after) = (strs(&t, "rollout_digest"), strs(&t, "updated_digest"));
    assert!(before.iter().zip(&after).all(|(a, b)| a != b), "every update changes the policy's digest");
    for ((arm, _, _), v) in curves(&want) {
        if arm.starts_with("rloo") || arm.starts_with("dpo") {
            assert!(v.last().unwrap().2 > 0.0 || v.last().unwrap().1 != v[0].1, "{arm} did not move: {v:?}");
        }
    }
    let dir = killed_and_resumed(p);
    for f in ["policy.parquet", "policy_updates.parquet", "metrics.parquet", "cells.parquet"] {
        assert!(
            std::fs::read(want.join(f)).unwrap() == std::fs::read(dir.join(f)).unwrap(),
            "{f} differs after resume"
        );
    }
    // negative control: a persistent adapter (same schedule) is another policy
    std::fs::write(p.join("run.toml"), text.replace("adapter = \"fresh-per-chunk\"", "adapter = \"persistent\""))
        .unwrap();
    let other = run(p, "c", "1");
    assert!(
        std::fs::read(want.join("policy.parquet")).unwrap() != std::fs::read(other.join("policy.parquet")).unwrap(),
        "fresh-per-chunk and persistent gave the same policy rows"
    );
}

/// The ppo arm (issue 29): a critic per chunk from the learned reward (v = θ_t on the policy's
/// backbone), GAE, clipped ratio and value loss. Its policies move (digest per chunk, KL > 0),
/// policy_updates.parquet carries the critic's loss (ppo rows only), and with the oracle and
/// null sources both run; lr = 0 leaves the policy at the base (negative control).
#[test]
fn ppo_moves_the_policy_with_a_critic_per_chunk() {
    let tmp = setup(0.05);
    let p = tmp.path();
    let text = spec(0.05)
        .replace("policy = [\"best-of-n\", \"rloo\", \"dpo\"]", "policy = [\"rloo\", \"ppo\"]")
        .replace("[[estimator]]", "[policy.ppo]\nreward = [\"learned\", \"null\"]\ncritic_lr = 0.01\n[[estimator]]");
    std::fs::write(p.join("run.toml"), &text).unwrap();
    let dir = run(p, "a", "2");
    let t = table(&dir.join("policy_updates.parquet"));
    let (arm, loss) = (strs(&t, "policy"), util::opt_f64s(&t, "critic_loss"));
    assert!(arm.iter().any(|a| a == "ppo"));
    for (a, l) in arm.iter().zip(&loss) {
        assert_eq!(a == "ppo", l.is_some(), "{a}: critic loss {l:?}");
        if let Some(l) = l {
            assert!(l.is_finite() && *l >= 0.0);
        }
    }
    let (before, after) = (strs(&t, "rollout_digest"), strs(&t, "updated_digest"));
    assert!(before.iter().zip(&after).all(|(a, b)| a != b));
    // every evaluation after an update is of a moved policy: its KL (a k1 estimate: either sign)
    // is not exactly 0
    let pt = table(&dir.join("policy.parquet"));
    let (parm, chunk, kl) = (strs(&pt, "policy"), u64s(&pt, "chunk"), f64s(&pt, "kl"));
    assert!(parm.iter().any(|a| a == "ppo"));
    for i in 0..chunk.len() {
        assert_eq!(chunk[i] == 0, kl[i] == 0.0, "{} chunk {}: KL {}", parm[i], chunk[i], kl[i]);
    }
    std::fs::write(
        p.join("run.toml"),
        text.replace("lr = 0.05", "lr = 0.0").replace("critic_lr = 0.01", "critic_lr = 0.0"),
    )
    .unwrap();
    let still = run(p, "b", "2");
    for ((a, _, _), v) in curves(&still) {
        assert!(v.iter().all(|x| x.1 == v[0].1 && x.2 == 0.0), "{a} moved with lr = 0: {v:?}");
    }
}

/// The authors' loop's pieces (issue 29) in one run: ppo on 1 fresh rollout per prompt of the
/// first prompt of each chunk (`rollouts = "fresh"`, `prompts_per_update = 1`), dpo on two
/// fresh samples labelled by the oracle after a warm start on a committed preference file, both
/// with a persistent and a fresh-per-chunk adapter (a sweep: one cell each, named in the label
/// and the `adapter` column). Checked: every update's step count is that of its rollouts'
/// size (ppo 1 sequence, epochs 2 → 2 steps; dpo 1 pair; warm start 4 pairs in mini-batches of
/// 4, 2 epochs → 2 steps); ppo's first chunk generates its fresh rollouts (the policy has not
/// moved, so its chunk samples come from the bank: only rollouts are generated); the warm
/// start's mean DPO loss falls below log 2 (its first step is at log 2: the implicit reward
/// moved toward the chosen responses), and is log 2 with lr = 0 (negative control);
/// fresh-per-chunk saves chunk-00 … chunk-03 adapters; a run killed in the fresh-per-chunk dpo
/// cell's second chunk (its warm start and first chunk merged, in its checkpoint) resumes to
/// the bytes of an uninterrupted run.
#[test]
fn authors_rollouts_fresh_two_dpo_and_a_warm_start() {
    let tmp = setup(0.05);
    let p = tmp.path();
    let warm = util::root().join("crates/runner/tests/fixtures/warm-prefs.jsonl");
    let text = spec(0.05)
        .replace("policy = [\"best-of-n\", \"rloo\", \"dpo\"]", "policy = [\"ppo\", \"dpo\"]")
        .replace("strategies = [\"random-pair\", \"best-quantile\"]", "strategies = [\"random-pair\"]")
        .replace("seeds = 2", "seeds = 1")
        .replace("[deploy]", "[checkpoint]\nevery_steps = 1\n[deploy]")
        .replace(
            "save_adapter = \"every-chunk\"",
            "save_adapter = \"every-chunk\"\nadapter = [\"persistent\", \"fresh-per-chunk\"]\nrollouts = \"fresh\"\nprompts_per_update = 1",
        )
        .replace(
            "[[estimator]]",
            &format!(
                "[policy.ppo]\nrollouts_per_prompt = 1\ncritic_lr = 0.01\n[policy.dpo]\npairs = \"fresh-two\"\n\
                 [policy.dpo.warm_start]\npath = \"{}\"\nrows = 4\nepochs = 2\n[[estimator]]",
                warm.display()
            ),
        );
    std::fs::write(p.join("run.toml"), &text).unwrap();
    let dir = run(p, "a", "1");
    // cells in order ppo, ppo fresh, dpo, dpo fresh; one estimator update per chunk
    let resumed = killed_at_and_resumed(p, "update:11");
    for f in ["policy.parquet", "policy_updates.parquet", "metrics.parquet", "cells.parquet"] {
        assert!(
            std::fs::read(dir.join(f)).unwrap() == std::fs::read(resumed.join(f)).unwrap(),
            "{f} differs after resume"
        );
    }
    let cells = table(&dir.join("cells.parquet"));
    let (labels, lives) = (strs(&cells, "label"), strs(&cells, "adapter"));
    assert_eq!(labels.len(), 4, "2 arms × 2 adapter lives: {labels:?}");
    for (l, a) in labels.iter().zip(&lives) {
        assert!(l.ends_with(&format!("[{a}]")), "{l} names its adapter life {a}");
    }
    let t = table(&dir.join("policy_updates.parquet"));
    let (arm, chunk, steps) = (strs(&t, "policy"), u64s(&t, "chunk"), u64s(&t, "update_steps"));
    let (pairs, dropped, loss) = (u64s(&t, "pairs"), u64s(&t, "dropped_pairs"), f64s(&t, "update_loss"));
    let mut warm_rows = 0;
    for i in 0..arm.len() {
        match (arm[i].as_str(), chunk[i]) {
            ("ppo", 0) => panic!("ppo has no warm start"),
            ("ppo", _) => assert_eq!(steps[i], 2, "ppo chunk {}: 1 rollout, 2 epochs", chunk[i]),
            ("dpo", 0) => {
                warm_rows += 1;
                assert_eq!((pairs[i], steps[i]), (4, 2), "the warm start's pairs and steps");
                assert!(loss[i] < std::f64::consts::LN_2 - 1e-4, "warm start loss {} ≥ log 2", loss[i]);
            }
            ("dpo", _) => {
                assert_eq!(pairs[i] + dropped[i], 1, "dpo chunk {}: one fresh pair", chunk[i]);
                assert_eq!(steps[i], 2 * pairs[i], "dpo chunk {}: a step per epoch when the pair counts", chunk[i]);
            }
            (a, _) => panic!("unexpected arm {a}"),
        }
    }
    assert_eq!(warm_rows, 2, "one warm start per dpo cell");
    let tt = table(&dir.join("policy_timings.parquet"));
    let (tarm, tchunk, gen, critic) =
        (strs(&tt, "policy"), u64s(&tt, "chunk"), f64s(&tt, "generation_s"), f64s(&tt, "critic_s"));
    for i in 0..tarm.len() {
        if tarm[i] == "ppo" && tchunk[i] == 1 {
            assert!(gen[i] > 0.0, "ppo's first chunk generated its fresh rollouts");
        }
        assert_eq!(tarm[i] == "ppo" && tchunk[i] > 0, critic[i] > 0.0, "{} chunk {}: critic time", tarm[i], tchunk[i]);
    }
    let mut saved: Vec<String> = walk(&dir.join("adapters"))
        .into_iter()
        .filter(|f| f.ends_with("adapter_model.safetensors"))
        .map(|f| {
            f.strip_prefix(dir.join("adapters"))
                .unwrap()
                .parent()
                .unwrap()
                .file_name()
                .unwrap()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    saved.sort();
    assert!(saved.iter().filter(|d| *d == "chunk-00").count() == 2, "each dpo cell saves its warm start: {saved:?}");
    assert_eq!(saved.iter().filter(|d| *d == "chunk-03").count(), 4, "every cell's last chunk: {saved:?}");
    // negative control: lr = 0, the warm start's loss stays log 2
    std::fs::write(p.join("run.toml"), text.replace("lr = 0.05", "lr = 0.0")).unwrap();
    let still = run(p, "c", "2");
    let t = table(&still.join("policy_updates.parquet"));
    let (arm, chunk, loss) = (strs(&t, "policy"), u64s(&t, "chunk"), f64s(&t, "update_loss"));
    for i in (0..arm.len()).filter(|&i| arm[i] == "dpo" && chunk[i] == 0) {
        assert!((loss[i] - std::f64::consts::LN_2).abs() < 1e-6, "lr = 0: warm start loss {}", loss[i]);
    }
}

fn walk(d: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(d).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// In a log, each learning cell says when a chunk is done; `onepass report` on a run with a
/// learning policy whose policy.parquet is gone refuses, saying so (it exited 0 without the
/// policy table); on a run without metrics.parquet it says the run is unfinished and how to
/// continue it when checkpoints/ is there (issue 34).
#[test]
fn report_names_a_missing_policy_table_and_an_unfinished_run() {
    let tmp = setup(0.05);
    let p = tmp.path();
    std::fs::write(p.join("run.toml"), spec(0.05).replace("seeds = 2", "seeds = 1")).unwrap();
    let (code, stdout, err) = onepass(p, &["run", "run.toml", "--out", "a", "--threads", "2"]).parts();
    assert_eq!(code, 0, "{err}");
    let dir = p.join(stdout.lines().last().unwrap().trim());
    // in a log each online cell says when a chunk is done (issue 34: minutes of silence)
    assert!(err.contains("rloo (seed 0): chunk 3/3 done"), "{err}");
    let ok = onepass(p, &["report", dir.to_str().unwrap()]);
    assert_eq!(ok.code, 0, "{}", ok.stderr);
    std::fs::remove_file(dir.join("policy.parquet")).unwrap();
    let (code, _, err) = onepass(p, &["report", dir.to_str().unwrap()]).parts();
    assert_ne!(code, 0);
    assert!(err.contains("no policy.parquet, though its spec has a learning policy"), "{err}");
    std::fs::remove_file(dir.join("metrics.parquet")).unwrap();
    std::fs::create_dir_all(dir.join("checkpoints")).unwrap();
    let (code, _, err) = onepass(p, &["report", dir.to_str().unwrap()]).parts();
    assert_ne!(code, 0);
    assert!(err.contains("no metrics.parquet: the run has not finished") && err.contains("--resume"), "{err}");
}

/// Full-parameter DPO (issue 29: the authors' DPO arm trains every weight): with the reference
/// at the chunk's start, the policy moves (a new digest every update, KL > 0 or other held-out
/// samples); a run killed in a dpo cell's second chunk (its weights, Adam state and reference in
/// the checkpoint) resumes to the bytes of an uninterrupted run; LoRA dpo is another policy
/// (negative control); asking to save an adapter of it is refused on the key.
#[test]
fn full_parameter_dpo_moves_and_resumes_to_the_same_bytes() {
    let tmp = setup(0.002);
    let p = tmp.path();
    let text = spec(0.002)
        .replace("policy = [\"best-of-n\", \"rloo\", \"dpo\"]", "policy = [\"dpo\"]")
        .replace("save_adapter = \"every-chunk\"", "save_adapter = \"none\"\nkl_reference = \"chunk-start\"")
        .replace("[[estimator]]", "[policy.dpo]\nparameters = \"full\"\n[[estimator]]")
        .replace("[deploy]", "[checkpoint]\nevery_steps = 1\n[deploy]");
    std::fs::write(p.join("run.toml"), &text).unwrap();
    let want = run(p, "a", "1");
    let t = table(&want.join("policy_updates.parquet"));
    let (before, after, steps) = (strs(&t, "rollout_digest"), strs(&t, "updated_digest"), u64s(&t, "update_steps"));
    for i in 0..before.len() {
        assert!(steps[i] == 0 || before[i] != after[i], "row {i}: an update with steps kept the digest");
    }
    assert!(steps.iter().any(|&s| s > 0), "no dpo update took a step");
    let moved = curves(&want).values().any(|v| v.iter().any(|x| x.2 > 0.0 || x.1 != v[0].1));
    assert!(moved, "full-parameter dpo never moved the policy");
    let dir = killed_at_and_resumed(p, "update:5");
    for f in ["policy.parquet", "policy_updates.parquet", "metrics.parquet", "cells.parquet"] {
        assert!(
            std::fs::read(want.join(f)).unwrap() == std::fs::read(dir.join(f)).unwrap(),
            "{f} differs after resume"
        );
    }
    std::fs::write(p.join("run.toml"), text.replace("parameters = \"full\"", "parameters = \"lora\"")).unwrap();
    let lora = run(p, "c", "1");
    assert!(
        std::fs::read(want.join("policy.parquet")).unwrap() != std::fs::read(lora.join("policy.parquet")).unwrap(),
        "full-parameter and LoRA dpo gave the same policy rows"
    );
    std::fs::write(p.join("run.toml"), text.replace("save_adapter = \"none\"", "save_adapter = \"every-chunk\""))
        .unwrap();
    let (code, _, err) = onepass(p, &["run", "run.toml", "--out", "d", "--dry-run"]).parts();
    assert_ne!(code, 0);
    assert!(err.contains("policy.dpo.parameters") && err.contains("save_adapter"), "{err}");
}

/// A policy that diverges mid-run (lr = 1e30: the first step throws the weights to ~1e30, the
/// next loss is NaN) fails its cell with a line naming the chunk and the diverged step — it
/// does not go on sampling from a broken policy and writing NaN rows as results; the cells
/// that do not learn finish, and the run exits non-zero. Negative control: a sane lr fails
/// nothing.
#[test]
fn a_policy_that_diverges_fails_its_cell_on_one_line() {
    let tmp = setup(0.05);
    let p = tmp.path();
    std::fs::write(p.join("run.toml"), spec(0.05).replace("lr = 0.05", "lr = 1e30")).unwrap();
    let (code, _, err) = onepass(p, &["run", "run.toml", "--out", "a", "--threads", "2"]).parts();
    assert_ne!(code, 0, "a diverged policy exited 0");
    let dir = std::fs::read_dir(p.join("a")).unwrap().next().unwrap().unwrap().path();
    let cells = table(&dir.join("cells.parquet"));
    let (status, arm, msg) = (strs(&cells, "status"), strs(&cells, "policy"), strs(&cells, "err"));
    for i in 0..status.len() {
        let learns = arm[i] != "best-of-n";
        assert_eq!(status[i] == "failed", learns, "{}: {} ({})", arm[i], status[i], msg[i]);
        if learns {
            assert!(msg[i].contains("policy update") && msg[i].contains("Adam step"), "{}", msg[i]);
        }
    }
    assert!(err.contains("failed: chunk 1's policy update: Adam step"), "{err}");
    let tmp = setup(0.05);
    let (code, _, err) = onepass(tmp.path(), &["run", "run.toml", "--out", "a", "--threads", "2"]).parts();
    assert_eq!(code, 0, "{err}");
}

/// A finite policy its update overwrote passes every other check: policy.max_kl's guard fails
/// its cell naming policy.lr (here a bound no update can meet, so the tiny random model need
/// not collapse); the cells that do not learn finish, and the run exits non-zero. The default
/// bound passes the same run (the negative control is the test above, with the same lr).
#[test]
fn a_policy_past_max_kl_fails_its_cell_naming_the_lr() {
    let tmp = setup(0.05);
    let p = tmp.path();
    let text = spec(0.05)
        .replace("chunks = 3", "chunks = 1")
        .replace(r#"strategies = ["random-pair", "best-quantile"]"#, r#"strategies = ["best-quantile"]"#)
        .replace(r#"policy = ["best-of-n", "rloo", "dpo"]"#, r#"policy = ["best-of-n", "rloo"]"#)
        .replace("lr = 0.05\n", "lr = 0.05\nmax_kl = 1e-12\n");
    assert!(text.contains("max_kl = 1e-12"));
    std::fs::write(p.join("run.toml"), text).unwrap();
    let (code, _, err) = onepass(p, &["run", "run.toml", "--out", "a", "--threads", "2"]).parts();
    assert_ne!(code, 0, "a policy past max_kl exited 0");
    let cells = table(&only_run(p, "a").join("cells.parquet"));
    let (status, arm, msg) = (strs(&cells, "status"), strs(&cells, "policy"), strs(&cells, "err"));
    for i in 0..status.len() {
        let learns = arm[i] != "best-of-n";
        assert_eq!(status[i] == "failed", learns, "{}: {} ({})", arm[i], status[i], msg[i]);
        if learns {
            assert!(
                msg[i].contains("destroyed")
                    && msg[i].contains("policy.lr (now 0.05)")
                    && msg[i].contains("policy.max_kl = 0.000000000001"),
                "{}",
                msg[i]
            );
        }
    }
    assert!(err.contains("policy.max_kl"), "{err}");
}

/// The run directory `onepass run run.toml --out out` made under `p` (its only entry).
fn only_run(p: &Path, out: &str) -> PathBuf {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(p.join(out)).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(dirs.len(), 1, "{dirs:?}");
    dirs.pop().unwrap()
}

/// `run.toml` under `p` with `ONEPASS_FAIL_WRITE=point` into `out/`: it stops with exit 2 and
/// one line naming the resume command and the full disk; resumed without the fault, it gives
/// the bytes of `want` (an uninterrupted run of the same spec).
fn full_disk_then_resume(p: &Path, point: &str, want: &Path, files: &[&str]) {
    let (code, _, err) = finish(
        command()
            .current_dir(p)
            .args(["run", "run.toml", "--out", "f", "--threads", "1"])
            .env("ONEPASS_FAIL_WRITE", point),
    )
    .parts();
    assert_eq!(code, 2, "{point}: {err}");
    let last = err.trim_end().lines().last().unwrap();
    assert!(last.contains("--resume") && last.contains("No space left on device"), "{point}: {last}");
    let dir = only_run(p, "f");
    assert!(!dir.join("meta.json").exists(), "{point}: a run stopped by the disk was finalised");
    let (code, _, err) = onepass(p, &["run", "run.toml", "--resume", dir.to_str().unwrap()]).parts();
    assert_eq!(code, 0, "{point}: resume: {err}");
    for f in files {
        assert!(std::fs::read(want.join(f)).unwrap() == std::fs::read(dir.join(f)).unwrap(), "{point}: {f} differs");
    }
    std::fs::remove_dir_all(p.join("f")).unwrap();
}

/// Faults during the online loop's stages (issue 34): a full disk while a learning cell caches
/// φ of its policy's new responses (the bank's φ is cached by an earlier run, so the fault
/// lands mid-cell), and while the adapters are written at the end, stop the run resumably —
/// not a cell's failure — and the resumed run has the bytes of an uninterrupted one.
#[test]
fn a_full_disk_in_the_online_loop_stops_the_run_resumably() {
    let tmp = setup(0.05);
    let p = tmp.path();
    run(p, "warm", "1"); // caches the bank's φ (and lr 0.05's new responses)
    std::fs::write(p.join("run.toml"), spec(0.04)).unwrap();
    let want = {
        // the uninterrupted run in a cache of its own: its new responses' φ must be missing
        // from the shared cache when the faulty run reaches them
        let q = tempfile::tempdir().unwrap();
        for f in ["prompts.jsonl", "run.toml"] {
            std::fs::copy(p.join(f), q.path().join(f)).unwrap();
        }
        let d = run(q.path(), "a", "1");
        let keep = p.join("want");
        util::copy_dir(&d, &keep);
        keep
    };
    let files = ["policy.parquet", "policy_updates.parquet", "metrics.parquet", "cells.parquet"];
    full_disk_then_resume(p, "feature-cache", &want, &files);
    let adapter = "adapters/c0005/chunk-03/adapter_model.safetensors";
    full_disk_then_resume(p, "adapter-write", &want, &[&files[..], &[adapter]].concat());
}

/// An oracle file replaced under a run (between a kill and the resume) changes the oracle's
/// rewards of the bank: the resume is refused on one line naming `oracle.path`, not resumed
/// into a run that mixes two oracles. Negative control: the original file back, it resumes.
#[test]
fn an_oracle_file_replaced_under_a_run_refuses_the_resume_naming_it() {
    let tmp = setup(0.05);
    let p = tmp.path();
    let d = 32;
    let head = |scale: f32| {
        let w: Vec<f32> = (0..d).map(|i| scale * (((i * 7919) % 13) as f32 / 13.0 - 0.5)).collect();
        let bytes: Vec<u8> = w.iter().flat_map(|x| x.to_le_bytes()).collect();
        let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1, d], &bytes).unwrap();
        safetensors::serialize_to_file([("score.weight", view)], None, &p.join("h.safetensors")).unwrap();
    };
    head(1.0);
    let text = spec(0.05)
        .replace("kind = \"linear\"\nseed = 3", "kind = \"head\"\npath = \"h.safetensors\"")
        .replace("[deploy]", "[checkpoint]\nevery_steps = 1\n[deploy]");
    std::fs::write(p.join("run.toml"), text).unwrap();
    let dir = killed_at(p, "update:17", "b");
    head(2.0);
    let (code, _, err) = onepass(p, &["run", "run.toml", "--resume", dir.to_str().unwrap()]).parts();
    assert_eq!(code, 2, "{err}");
    let last = err.trim_end().lines().last().unwrap();
    assert!(last.contains("refused") && last.contains("oracle.path = h.safetensors"), "{last}");
    head(1.0);
    let (code, _, err) = onepass(p, &["run", "run.toml", "--resume", dir.to_str().unwrap()]).parts();
    assert_eq!(code, 0, "{err}");
}

/// Files read into a run and edited under it (between a kill and the resume) refuse the
/// resume on one line naming their key — the warm start's preference file (read at the start:
/// resumed cells would otherwise learn from another warm start than the finished ones) and the
/// prompts file; each restored, the run resumes.
#[test]
fn a_warm_start_or_prompts_file_edited_under_a_run_refuses_the_resume() {
    let tmp = setup(0.05);
    let p = tmp.path();
    std::fs::write(p.join("run.toml"), with_warm_start(p, "[\"dpo\"]")).unwrap();
    let dir = killed_at(p, "update:5", "b");
    let resume = || onepass(p, &["run", "run.toml", "--resume", dir.to_str().unwrap()]).parts();
    for (file, edit) in [
        ("warm.jsonl", "policy.dpo.warm_start.path = warm.jsonl"),
        ("prompts.jsonl", "generate.prompts = prompts.jsonl"),
    ] {
        let orig = std::fs::read_to_string(p.join(file)).unwrap();
        std::fs::write(p.join(file), orig.replace("Say hi.", "Say hello.")).unwrap();
        let (code, _, err) = resume();
        assert_eq!(code, 2, "{file}: {err}");
        let last = err.trim_end().lines().last().unwrap();
        assert!(last.contains("refused") && last.contains(edit), "{file}: {last}");
        std::fs::write(p.join(file), orig).unwrap();
    }
    let (code, _, err) = resume();
    assert_eq!(code, 0, "{err}");
}

/// A kill (SIGKILL) in each stage of the online loop — a warm start's policy update, a chunk's
/// policy update, a held-out evaluation, an adapter half-written at the end — resumes to the
/// bytes of an uninterrupted run (tables and the saved adapters).
#[test]
fn a_kill_in_each_stage_of_the_online_loop_resumes_to_the_same_bytes() {
    let tmp = setup(0.05);
    let p = tmp.path();
    std::fs::write(p.join("run.toml"), with_warm_start(p, "[\"rloo\", \"dpo\"]")).unwrap();
    let want = run(p, "a", "1");
    let adapters: Vec<PathBuf> = walk(&want.join("adapters"));
    assert!(!adapters.is_empty(), "the run saves adapters");
    // cells (threads 1) in order: random-pair rloo seeds 0, 1 (3 updates each), then dpo seed 0:
    // the 7th policy update is its warm start, the 9th its second chunk's
    for (i, point) in ["policy-update:7", "policy-update:9", "evaluate:6", "adapter-write:3"].iter().enumerate() {
        let dir = killed_at(p, point, &format!("k{i}"));
        let (code, _, err) = onepass(p, &["run", "run.toml", "--resume", dir.to_str().unwrap()]).parts();
        assert_eq!(code, 0, "{point}: {err}");
        for f in ["policy.parquet", "policy_updates.parquet", "metrics.parquet", "cells.parquet"] {
            assert!(
                std::fs::read(want.join(f)).unwrap() == std::fs::read(dir.join(f)).unwrap(),
                "{point}: {f} differs"
            );
        }
        for a in &adapters {
            let rel = a.strip_prefix(&want).unwrap();
            assert!(std::fs::read(a).unwrap() == std::fs::read(dir.join(rel)).unwrap(), "{point}: {rel:?} differs");
        }
    }
}

/// A feature-cache shard damaged between runs (truncated after it was written) is named on one
/// line with what to do; deleted, its rows are computed again and the run has the same bytes.
#[test]
fn a_damaged_feature_cache_shard_is_named_and_recomputed_once_deleted() {
    let tmp = setup(0.05);
    let p = tmp.path();
    let want = run(p, "a", "1");
    let shard = walk(&p.join("cache/phi"))
        .into_iter()
        .find(|f| f.extension().is_some_and(|x| x == "safetensors"))
        .expect("a φ shard");
    std::fs::write(&shard, b"short").unwrap();
    let (code, _, err) = onepass(p, &["run", "run.toml", "--out", "b", "--threads", "1"]).parts();
    assert_eq!(code, 2, "{err}");
    let last = err.trim_end().lines().last().unwrap();
    let name = shard.file_name().unwrap().to_string_lossy();
    assert!(last.contains(name.as_ref()) && last.contains("delete it"), "{last}");
    std::fs::remove_file(&shard).unwrap();
    let again = run(p, "c", "1");
    for f in ["policy.parquet", "metrics.parquet", "rounds.parquet"] {
        assert!(std::fs::read(want.join(f)).unwrap() == std::fs::read(again.join(f)).unwrap(), "{f} differs");
    }
}

/// The online loop over a SLURM array (issue 32): three slices of the run's cells (`--cells
/// i/3`) merged by `onepass merge` give the one-process run's tables, θ and adapters, byte for
/// byte.
#[test]
fn three_slices_of_an_online_run_merge_to_its_bytes() {
    let tmp = setup(0.05);
    let p = tmp.path();
    let one = run(p, "one", "2");
    let mut parts = Vec::new();
    for i in 0..3 {
        let cells = format!("{i}/3");
        let (code, stdout, err) =
            onepass(p, &["run", "run.toml", "--out", "s", "--threads", "1", "--cells", &cells]).parts();
        assert_eq!(code, 0, "{err}");
        parts.push(stdout.trim().lines().last().unwrap().to_string());
    }
    let mut args = vec!["merge", "run.toml"];
    args.extend(parts.iter().map(String::as_str));
    args.extend(["--out", "m"]);
    let (code, stdout, err) = onepass(p, &args).parts();
    assert_eq!(code, 0, "{err}");
    let merged = p.join(stdout.trim().lines().last().unwrap());
    let (a, b) = (util::result_files(&one), util::result_files(&merged));
    assert!(a.iter().any(|(n, _)| n.starts_with("adapters")), "the run saves adapters");
    assert_eq!(a.iter().map(|f| &f.0).collect::<Vec<_>>(), b.iter().map(|f| &f.0).collect::<Vec<_>>());
    for ((name, x), (_, y)) in a.iter().zip(&b) {
        assert!(x == y, "{name:?} differs between the merged run and the one-process run");
    }
}

/// bf16 on a CPU without bf16 instructions is announced, never a silent slowdown (issue 35):
/// with onepass capped at AVX2 (`ONEPASS_CPU=avx2`, what an AVX2-only CPU runs) a bf16 feature
/// model warns once, naming the key and the CPU, and so does a bf16 generator (on a real AVX2-only
/// CPU the packed f32 products decode faster), and so does a policy trained on bf16 products;
/// the same run in f32 does not (negative control).
#[test]
fn bf16_on_a_cpu_without_bf16_instructions_warns_naming_the_key() {
    let tmp = setup(0.05);
    let p = tmp.path();
    let go = |key: &str, dtype: &str| {
        let set = format!("{key}.dtype=\"{dtype}\"");
        let out = format!("{key}-{dtype}");
        let r = finish(
            command()
                .current_dir(p)
                .args(["run", "run.toml", "--out", &out, "--threads", "2", "--set", &set])
                .env("ONEPASS_CPU", "avx2"),
        );
        assert_eq!(r.code, 0, "{}", r.stderr);
        r.stderr
    };
    let err = go("features", "bf16");
    let warnings: Vec<&str> = err.lines().filter(|l| l.contains("warning")).collect();
    assert_eq!(warnings.len(), 1, "{err}");
    assert!(
        warnings[0].contains("features.dtype = \"bf16\"") && warnings[0].contains("ONEPASS_CPU=avx2"),
        "{}",
        warnings[0]
    );
    assert!(!go("features", "f32").contains("bf16"), "an f32 run warned about bf16");
    let err = go("generate", "bf16");
    let warnings: Vec<&str> = err.lines().filter(|l| l.contains("warning")).collect();
    assert_eq!(warnings.len(), 1, "{err}");
    assert!(warnings[0].contains("generate.dtype = \"bf16\""), "{}", warnings[0]);
    // and a policy training on bf16 products (issue 31)
    let err = go("policy", "bf16");
    let warnings: Vec<&str> = err.lines().filter(|l| l.contains("warning")).collect();
    assert_eq!(warnings.len(), 1, "{err}");
    assert!(warnings[0].contains("policy.dtype = \"bf16\""), "{}", warnings[0]);
}

/// policy_timings.parquet splits an evaluation (issue 31: where its time goes): sampling, φ and
/// the oracle, the policy's log-probabilities and KL — parts of eval_s, the score part taken by
/// learning arms only, the sampling part only once a policy has moved (before, its samples are
/// the base's, already drawn).
#[test]
fn an_evaluation_says_where_its_time_went() {
    let tmp = setup(0.05);
    let dir = run(tmp.path(), "a", "2");
    let t = table(&dir.join("policy_timings.parquet"));
    let (arm, chunk) = (strs(&t, "policy"), u64s(&t, "chunk"));
    let (all, gen, phi, score) =
        (f64s(&t, "eval_s"), f64s(&t, "eval_generation_s"), f64s(&t, "eval_phi_s"), f64s(&t, "eval_score_s"));
    for i in 0..all.len() {
        assert!(gen[i] + phi[i] + score[i] <= all[i] + 1e-9, "row {i}: the parts exceed eval_s");
        let learns = arm[i] != "best-of-n";
        assert_eq!(score[i] > 0.0, learns && all[i] > 0.0, "row {i} ({}): score part {}", arm[i], score[i]);
        if learns && chunk[i] > 0 && all[i] > 0.0 {
            assert!(gen[i] > 0.0, "row {i}: a moved policy's evaluation samples");
        }
    }
}

/// `[policy] dtype = "bf16"` (issue 31): the learning policies train on the packed bf16
/// products and move (KL > 0), differently from the f32 run of the same spec (negative control:
/// the key takes effect), the resolved spec says bf16, and the run gives the same bytes on 1 and
/// 2 threads and after a SIGKILL and resume (the adapters and Adam state are f32 in the
/// checkpoints; the packed weights are rebuilt from the model).
#[test]
fn bf16_training_moves_the_policy_and_resumes_to_the_same_bytes() {
    let tmp = setup(0.05);
    let p = tmp.path();
    let bf16 = spec(0.05)
        .replace("[policy]\n", "[policy]\ndtype = \"bf16\"\n")
        .replace("[deploy]", "[checkpoint]\nevery_steps = 1\n[deploy]");
    std::fs::write(p.join("run.toml"), &bf16).unwrap();
    let want = run(p, "a", "1");
    let resolved = std::fs::read_to_string(want.join("spec.resolved.toml")).unwrap();
    assert!(resolved.contains("dtype = \"bf16\""), "{resolved}");
    for ((arm, seed, strat), v) in curves(&want) {
        if arm != "best-of-n" {
            // a k1 estimate: either sign, exactly 0 only for an unmoved policy
            assert!(v.last().unwrap().2 != 0.0, "{arm} {seed} {strat} did not move: {v:?}");
        }
    }
    let two = run(p, "c", "2");
    let dir = killed_and_resumed(p);
    for f in ["policy.parquet", "metrics.parquet", "rounds.parquet"] {
        let w = std::fs::read(want.join(f)).unwrap();
        assert!(w == std::fs::read(two.join(f)).unwrap(), "{f} differs on 2 threads");
        assert!(w == std::fs::read(dir.join(f)).unwrap(), "{f} differs after resume");
    }
    std::fs::write(p.join("run.toml"), bf16.replace("dtype = \"bf16\"\n", "")).unwrap();
    let f32 = run(p, "f", "1");
    let (a, b) = (curves(&want), curves(&f32));
    assert!(
        a.iter().any(|(k, v)| k.0 != "best-of-n" && v.last().unwrap().2 != b[k].last().unwrap().2),
        "bf16 and f32 training gave the same KLs: did the key take effect?"
    );
}

/// policy.dtype = "bf16" samples on the bf16 base, the adapters unmerged beside it: a moved
/// policy's generating weights carry its update exactly (merge_error is f32 rounding of s·B
/// alone, here 0: s = α/r = 2; an f32 merge's is not, the control), and the base policy's
/// held-out samples are the same whether the bank was drawn in f32 (then the run samples them
/// on the bf16 base itself) or in bf16 (then they are the bank generator's, through the cache).
/// (This tiny model draws the same tokens in f32 and bf16; `features`' adapters tests show the
/// bf16 branch's arithmetic.)
#[test]
fn a_bf16_policy_samples_on_the_bf16_base_with_its_adapters_unmerged() {
    let tmp = setup(0.05);
    let p = tmp.path();
    let text = spec(0.05)
        .replace("strategies = [\"random-pair\", \"best-quantile\"]", "strategies = [\"best-quantile\"]")
        .replace("policy = [\"best-of-n\", \"rloo\", \"dpo\"]", "policy = [\"rloo\"]")
        .replace("chunks = 3", "chunks = 2");
    let bf16 = text.replace("[policy]\n", "[policy]\ndtype = \"bf16\"\n");
    let rows = |dir: &Path| {
        let t = table(&dir.join("policy.parquet"));
        let (chunk, seed, reward, err) =
            (u64s(&t, "chunk"), u32s(&t, "seed"), f64s(&t, "sample_reward"), f64s(&t, "merge_error"));
        let base: Vec<(u32, u64)> =
            (0..chunk.len()).filter(|&i| chunk[i] == 0).map(|i| (seed[i], reward[i].to_bits())).collect();
        let moved: Vec<f64> = (0..chunk.len()).filter(|&i| chunk[i] > 0).map(|i| err[i]).collect();
        (base, moved)
    };
    std::fs::write(p.join("run.toml"), &text).unwrap();
    let (base32, err32) = rows(&run(p, "f", "1"));
    std::fs::write(p.join("run.toml"), &bf16).unwrap();
    let (base16, err16) = rows(&run(p, "b", "1"));
    std::fs::write(p.join("run.toml"), bf16.replace("[generate]\n", "[generate]\ndtype = \"bf16\"\n")).unwrap();
    let (bank16, err_bank16) = rows(&run(p, "g", "1"));
    assert!(!base16.is_empty() && !err16.is_empty());
    assert_eq!(base16, bank16, "the bf16 base's held-out samples depend on the bank's dtype");
    assert_eq!(base32.len(), base16.len());
    for e in err16.iter().chain(&err_bank16) {
        assert_eq!(*e, 0.0, "the unmerged sampler's adapters are off the trained update by {e}");
    }
    // the control: an f32 merge does round the update (the column can tell the two apart)
    assert!(err32.iter().any(|e| *e > 0.0) && err32.iter().all(|e| e.is_finite()), "{err32:?}");
}
