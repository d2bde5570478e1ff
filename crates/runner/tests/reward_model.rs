//! `[reward] update = "lora" | "full"` (issue 30) through `onepass run`, on the tiny random
//! Llama GGUF and a planted preference dataset: every rule runs, the backbone fixed (step scale
//! 0) reproduces the head-only run's θ and stream, a learning backbone does not (a negative
//! control), a run killed mid-cell resumes to the same bytes, and the plan refuses what a
//! learning feature map cannot do, naming the key. In deploy on generated responses the same:
//! a fixed backbone is the head-only run (θ, picks), a learning one is not, a learning policy
//! learns from r_ψ,θ, and a killed run resumes to the 2-thread run's bytes.
mod util;

use std::path::Path;
use util::*;

/// 48 pairs: the chosen answer says "yes", the rejected one "no" (a token the features can learn).
fn setup(p: &Path) {
    let lines: Vec<String> = (0..48)
        .map(|i| {
            let (c, r) = if i % 2 == 0 { ("yes", "no") } else { ("yes indeed", "no way") };
            serde_json::json!({
                "prompt": format!("Question {i}: is {i} a number?"),
                "chosen": format!("{c}, {i}."),
                "rejected": format!("{r}, {i}."),
            })
            .to_string()
        })
        .collect();
    std::fs::write(p.join("pairs.jsonl"), lines.join("\n")).unwrap();
}

fn spec(update: &str, extra: &str, estimators: &str) -> String {
    format!(
        "setting = \"passive\"\nseeds = 1\n[env]\nkind = \"dataset\"\n[stream]\nsamples = 32\nbatch_size = 4\neval_every = 16\n[data]\npath = \"pairs.jsonl\"\nformat = \"generic\"\nmodel = \"{}\"\nmax_len = 48\neval_fraction = 0.25\n[data.keys]\nprompt = \"prompt\"\nchosen = \"chosen\"\nrejected = \"rejected\"\n[reward]\nupdate = \"{update}\"\nrank = 2\nalpha = 4.0\n{extra}\n{estimators}",
        tiny_gguf().display()
    )
}

const RULES: &str = "[[estimator]]\nkind = \"sgd\"\nlr = 0.05\n[[estimator]]\nkind = \"adam\"\nlr = 0.01\n[[estimator]]\nkind = \"omd-hvp-cg\"\nlr = 0.05\n[[estimator]]\nkind = \"omd-reference\"\nlr = 0.05\n";

fn run(p: &Path, text: &str, out: &str) -> std::path::PathBuf {
    std::fs::write(p.join("run.toml"), text).unwrap();
    let r = onepass(p, &["run", "run.toml", "--out", out, "--threads", "1"]);
    let (code, _, stderr) = r.parts();
    assert_eq!(code, 0, "{stderr}");
    only_run(p, out)
}

fn only_run(p: &Path, out: &str) -> std::path::PathBuf {
    let mut dirs: Vec<_> = std::fs::read_dir(p.join(out)).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(dirs.len(), 1, "{dirs:?}");
    dirs.pop().unwrap()
}

/// θ of a cell (theta/<cell>.npy: a v1 header, then little-endian f64).
fn npy(dir: &Path, cell: &str) -> Vec<f64> {
    let b = std::fs::read(dir.join(format!("theta/{cell}.npy"))).unwrap();
    let header = u16::from_le_bytes([b[8], b[9]]) as usize;
    b[10 + header..].chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect()
}

/// θ of the run's first cell.
fn theta(dir: &Path) -> Vec<f64> {
    npy(dir, "c0000")
}

#[test]
fn every_rule_learns_the_features_through_a_run() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path();
    setup(p);
    for update in ["lora", "full"] {
        let dir = run(p, &spec(update, "", RULES), update);
        let m = table(&dir.join("metrics.parquet"));
        let labels = strs(&m, "label");
        let hvp = u64s(&m, "hvp_evals");
        let steps = u64s(&m, "step");
        for (i, l) in labels.iter().enumerate() {
            assert!(steps[i] == 4 || steps[i] == 8, "{update} {l}: evaluation points at 16 and 32 samples");
            let omd = l.starts_with("omd");
            assert_eq!(hvp[i] > 0, omd, "{update} {l}: HVPs only for the CG rules ({})", hvp[i]);
        }
        assert_eq!(labels.len(), 8, "{update}: 4 rules × 2 evaluation points");
        let resolved = std::fs::read_to_string(dir.join("spec.resolved.toml")).unwrap();
        assert!(resolved.contains(&format!("update = \"{update}\"")), "{resolved}");
        // LoRA cells export ψ and θ as a PEFT sequence classifier; a full update writes none
        let st = dir.join("adapters/c0000/adapter_model.safetensors");
        assert_eq!(st.exists(), update == "lora", "{update}: {}", st.display());
        if update == "lora" {
            let bytes = std::fs::read(&st).unwrap();
            let t = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            let score = t.tensor("base_model.model.score.weight").unwrap();
            assert_eq!(score.shape(), [1, 32]);
            let cfg = std::fs::read_to_string(dir.join("adapters/c0000/adapter_config.json")).unwrap();
            assert!(cfg.contains("SEQ_CLS"), "{cfg}");
        }
    }
}

/// The backbone fixed (`backbone_lr_scale = 0`, sgd without clipping, so ψ's gradient counts
/// nowhere) gives the head-only run's θ: the same stream (hash), the same updates on features
/// recomputed through the trainable decoder instead of read from the φ cache (agreement to
/// f32 rounding of φ). A learning backbone gives another θ.
/// `hvp = "forward"` and `hvp = "gauss-newton"`: the CG rules run on one-pass products or on
/// the Gauss–Newton matrix's; the products differ from central ones, so omd-hvp-cg's θ does
/// too (sgd's, which takes none, does not). Absent, a LoRA reward model takes exact products
/// (the R-operator) and a full-parameter one central differences, and the resolved spec says
/// which; the exact products are the Hessian's, so omd-hvp-cg's θ is the central run's to the
/// differences' error, not to the bit.
#[test]
fn forward_differences_and_gauss_newton_are_named_choices() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path();
    setup(p);
    let rules = "[[estimator]]\nkind = \"sgd\"\nlr = 0.05\n[[estimator]]\nkind = \"omd-hvp-cg\"\nlr = 0.05\n";
    let central = run(p, &spec("lora", "hvp = \"central\"", rules), "central");
    let exact = run(p, &spec("lora", "", rules), "exact");
    let resolved = std::fs::read_to_string(exact.join("spec.resolved.toml")).unwrap();
    assert!(resolved.contains("hvp = \"exact\""), "a LoRA reward model's default is named: {resolved}");
    assert_eq!(npy(&central, "c0000"), npy(&exact, "c0000"), "sgd takes no HVP");
    let (c, e) = (npy(&central, "c0001"), npy(&exact, "c0001"));
    let rel = c.iter().zip(&e).map(|(a, b)| (a - b).powi(2)).sum::<f64>().sqrt()
        / c.iter().map(|a| a * a).sum::<f64>().sqrt();
    eprintln!("omd-hvp-cg θ, exact against central products: relative difference {rel:.2e}");
    assert!(rel > 0.0 && rel < 1e-2, "exact and central products: θ apart by {rel:e}");
    let full = run(p, &spec("full", "", rules), "full-default");
    let resolved = std::fs::read_to_string(full.join("spec.resolved.toml")).unwrap();
    assert!(resolved.contains("hvp = \"central\""), "a full update's default is named: {resolved}");
    let forward = run(p, &spec("lora", "hvp = \"forward\"", rules), "forward");
    assert_eq!(npy(&central, "c0000"), npy(&forward, "c0000"), "sgd takes no HVP");
    assert_ne!(npy(&central, "c0001"), npy(&forward, "c0001"), "omd-hvp-cg's products differ");
    let hvp = u64s(&table(&forward.join("metrics.parquet")), "hvp_evals");
    assert!(hvp.iter().any(|&h| h > 0), "{hvp:?}");
    let gn = run(p, &spec("lora", "hvp = \"gauss-newton\"", rules), "gauss-newton");
    assert_eq!(npy(&central, "c0000"), npy(&gn, "c0000"), "sgd takes no HVP");
    assert_ne!(npy(&central, "c0001"), npy(&gn, "c0001"), "omd-hvp-cg's Gauss–Newton products differ");
    assert_ne!(npy(&forward, "c0001"), npy(&gn, "c0001"), "and differ from forward differences");
    let resolved = std::fs::read_to_string(gn.join("spec.resolved.toml")).unwrap();
    assert!(resolved.contains("hvp = \"gauss-newton\""), "the resolved spec names the choice");
}

#[test]
fn a_fixed_backbone_is_the_head_only_run() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path();
    setup(p);
    let sgd = "[[estimator]]\nkind = \"sgd\"\nlr = 0.05\nclip = \"none\"\n";
    let head = run(p, &spec("head", "", sgd), "head");
    let fixed = run(p, &spec("lora", "backbone_lr_scale = 0.0", sgd), "fixed");
    let moving = run(p, &spec("lora", "", sgd), "moving");
    let (h, f, m) = (theta(&head), theta(&fixed), theta(&moving));
    assert_eq!(h.len(), 32, "d = 32");
    let diff = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
    let scale = h.iter().map(|x| x.abs()).fold(0.0, f64::max);
    eprintln!("|θ| {scale:.3e}; fixed − head {:.3e}; moving − head {:.3e}", diff(&f, &h), diff(&m, &h));
    assert!(scale > 1e-3, "the head moved: {scale}");
    assert!(diff(&f, &h) < 1e-4 * scale.max(1.0), "fixed backbone vs head: {:e}", diff(&f, &h));
    assert!(diff(&m, &h) > 1e-3 * scale, "a learning backbone changes θ: {:e}", diff(&m, &h));
    let hash = |d: &Path| strs(&table(&d.join("cells.parquet")), "stream_hash");
    assert_eq!(hash(&head), hash(&fixed), "the same stream of pairs");
}

/// Killed (SIGKILL) in the 5th reward-model step with a checkpoint after every step, resumed:
/// the tables are the uninterrupted run's, byte for byte.
#[test]
fn a_killed_reward_model_run_resumes_to_the_same_bytes() {
    use std::os::unix::process::ExitStatusExt;
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path();
    setup(p);
    let rules = "[[estimator]]\nkind = \"omd-hvp-cg+adam\"\n[checkpoint]\nevery_steps = 1\n";
    let whole = run(p, &spec("lora", "", rules), "whole");
    std::fs::write(p.join("run.toml"), spec("lora", "", rules)).unwrap();
    let o = command()
        .current_dir(p)
        .args(["run", "run.toml", "--out", "killed", "--threads", "1"])
        .env("ONEPASS_FAILPOINT", "update:5")
        .output()
        .unwrap();
    assert_eq!(o.status.signal(), Some(9), "{}", String::from_utf8_lossy(&o.stderr));
    let dir = only_run(p, "killed");
    let (code, _, stderr) = onepass(p, &["run", "run.toml", "--resume", dir.to_str().unwrap()]).parts();
    assert_eq!(code, 0, "{stderr}");
    for f in ["metrics.parquet", "theta/c0000.npy"] {
        assert_eq!(digest(&whole.join(f)), digest(&dir.join(f)), "{f}");
    }
}

#[test]
fn the_plan_refuses_what_a_learning_feature_map_cannot_do() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path();
    setup(p);
    let cases = [
        (spec("lora", "", "[[estimator]]\nkind = \"omd-exact\"\n"), "estimator[0].kind", "omd-exact"),
        (spec("lora", "", "[[estimator]]\nkind = \"mle\"\n"), "estimator[0].kind", "d×d"),
        (spec("lora", "hvp_eps = 0.0", RULES), "reward.hvp_eps", "expected a finite number > 0"),
        (spec("lora", "hvp_eps = 0.001", RULES), "reward.hvp_eps", "take no step"),
        (spec("full", "hvp = \"exact\"", RULES), "reward.hvp", "LoRA adapters and the head"),
        (spec("lora", "", RULES).replace("rank = 2", "rank = 0"), "reward.rank", "expected at least 1"),
        (spec("full", "targets = [\"w_proj\"]", RULES), "reward.targets", "w_proj"),
        (
            spec("lora", "", RULES).replace("setting = \"passive\"", "setting = \"active\""),
            "reward.update",
            "passive and deploy settings",
        ),
        (spec("lora", "", RULES).replace("[data.keys]", "pool = \"mean\"\n[data.keys]"), "data.pool", "last"),
        (spec("lora", "", RULES).replace("batch_size = 4", "batch_size = 4\nranks = 2"), "stream.ranks", "ranks = 1"),
        (
            spec("lora", "", RULES).replace("update = \"lora\"", "update = \"all\""),
            "`reward.update`",
            "`all`: expected",
        ),
        (spec("lora", "hvp = \"backward\"", RULES), "`reward.hvp`", "`backward`: expected"),
    ];
    for (text, key, says) in cases {
        std::fs::write(p.join("bad.toml"), &text).unwrap();
        let (code, _, stderr) = onepass(p, &["run", "bad.toml", "--dry-run"]).parts();
        assert_ne!(code, 0, "{key}: accepted");
        assert!(stderr.contains(key) && stderr.contains(says), "{key} / {says}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
    }
}

/// A deploy run on the tiny model's generated responses (`policy`: the `[policy]` lines, or
/// none for the bank's responses), with `[reward] update` and `extra` lines in `[reward]`.
fn deploy_spec(update: &str, extra: &str, policy: &str) -> String {
    format!(
        r#"{world}[curvature]
lambda = 1.0
[deploy]
chunks = 3
strategies = ["random-pair", "ucb"]
{policy}
[reward]
update = "{update}"
rank = 2
alpha = 4.0
{extra}
[[estimator]]
kind = "sgd"
lr = 0.1
clip = "none"
"#,
        world = util::tiny_world(1, 50)
    )
}

const DEPLOY_POLICY: &str = "policy = [\"best-of-n\", \"rloo\"]\n[policy]\nrank = 2\nalpha = 4.0\ntargets = \"all-linear\"\nlr = 0.05\nminibatch = 4\neval_prompts = 3\nsave_adapter = \"last\"";

/// Deploy with the backbone's step scale 0 is the head-only deploy run: the same pairs picked
/// (random-pair and ucb, whose bonus reads the head's curvature over h_ψ = φ) and θ within f32
/// rounding of φ's; a learning backbone moves θ away (the negative control).
#[test]
fn deploy_with_a_fixed_backbone_is_the_head_only_run() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path();
    write_prompts(p);
    let head = run(p, &deploy_spec("head", "", ""), "head");
    let fixed = run(p, &deploy_spec("lora", "backbone_lr_scale = 0.0", ""), "fixed");
    let moving = run(p, &deploy_spec("lora", "backbone_lr_scale = 5.0", ""), "moving");
    let diff = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
    for cell in ["c0000", "c0001"] {
        let (h, f, m) = (npy(&head, cell), npy(&fixed, cell), npy(&moving, cell));
        let scale = h.iter().map(|x| x.abs()).fold(0.0, f64::max);
        eprintln!("{cell}: |θ| {scale:.3e}; fixed − head {:.3e}; moving − head {:.3e}", diff(&f, &h), diff(&m, &h));
        assert!(scale > 1e-3, "{cell}: the head moved: {scale}");
        assert!(diff(&f, &h) < 1e-5 * scale.max(1.0), "{cell}: fixed backbone vs head {:e}", diff(&f, &h));
        assert!(diff(&m, &h) > 1e-3 * scale, "{cell}: a learning backbone changes θ: {:e}", diff(&m, &h));
    }
    let picks = |d: &Path| {
        let t = table(&d.join("rounds.parquet"));
        (u32s(&t, "first"), u32s(&t, "second"))
    };
    assert_eq!(picks(&head), picks(&fixed), "the same pairs picked");
    let ev = |d: &Path| f64s(&table(&d.join("metrics.parquet")), "eval_loss");
    let (eh, ef) = (ev(&head), ev(&fixed));
    assert!(eh.iter().zip(&ef).all(|(a, b)| (a - b).abs() < 1e-6), "held-out loss: {eh:?} vs {ef:?}");
    assert_ne!(ev(&head), ev(&moving), "a learning backbone's held-out pairs are scored under h_ψ");
    let grads = u64s(&table(&fixed.join("metrics.parquet")), "grad_evals");
    assert_eq!(grads.last(), Some(&6), "one gradient per labelled pair: {grads:?}");
}

/// A learning policy on a reward model whose features learn: it trains on r_ψ,θ (its rollouts'
/// learned reward is θᵀh_ψ, not θᵀφ), the reward model's adapter is written beside the
/// policy's, and a run killed in its fifth reward-model step resumes (1 thread) to the bytes of
/// the uninterrupted 2-thread run.
#[test]
fn deploy_with_a_learning_policy_resumes_to_the_same_bytes() {
    use std::os::unix::process::ExitStatusExt;
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path();
    write_prompts(p);
    let text = deploy_spec("lora", "backbone_lr_scale = 5.0", DEPLOY_POLICY)
        .replace("[[estimator]]", "[checkpoint]\nevery_steps = 1\n[[estimator]]");
    std::fs::write(p.join("run.toml"), &text).unwrap();
    let (code, stdout, stderr) = onepass(p, &["run", "run.toml", "--out", "whole", "--threads", "2"]).parts();
    assert_eq!(code, 0, "{stderr}");
    let whole = p.join(stdout.lines().last().unwrap().trim());
    let o = command()
        .current_dir(p)
        .args(["run", "run.toml", "--out", "killed", "--threads", "1"])
        .env("ONEPASS_FAILPOINT", "update:5")
        .output()
        .unwrap();
    assert_eq!(o.status.signal(), Some(9), "{}", String::from_utf8_lossy(&o.stderr));
    let dir = only_run(p, "killed");
    let (code, _, stderr) = onepass(p, &["run", "run.toml", "--resume", dir.to_str().unwrap()]).parts();
    assert_eq!(code, 0, "{stderr}");
    for f in ["metrics.parquet", "rounds.parquet", "policy.parquet", "policy_updates.parquet", "theta/c0001.npy"] {
        assert_eq!(digest(&whole.join(f)), digest(&dir.join(f)), "{f}");
    }
    // rloo's cells (c0001, c0003) write the policy's adapter and the reward model's; every
    // cell writes the reward model's
    for cell in ["c0000", "c0001", "c0002", "c0003"] {
        let rm = whole.join(format!("adapters/{cell}/reward-model/adapter_model.safetensors"));
        assert!(rm.exists(), "{}", rm.display());
        assert_eq!(digest(&rm), digest(&dir.join(format!("adapters/{cell}/reward-model/adapter_model.safetensors"))));
    }
    assert!(whole.join("adapters/c0001/adapter_model.safetensors").exists());
    // the policy's reward is the reward model's. θ₀ = 0 gives ψ no gradient in the first step,
    // so the first update (θ only) and the policy's first step are the same with the backbone
    // fixed or learning, and chunk 2's rollouts are the same samples in both (equal oracle
    // reward) under the same θ₂: their learned rewards differ only through h_ψ₂. With the
    // backbone fixed (h_ψ = φ to f32 rounding) they are the head-only run's.
    let learned = |text: String, out: &str| {
        std::fs::write(p.join(format!("{out}.toml")), text).unwrap();
        let (code, stdout, stderr) = onepass(p, &["run", &format!("{out}.toml"), "--out", out]).parts();
        assert_eq!(code, 0, "{stderr}");
        let u = table(&p.join(stdout.lines().last().unwrap().trim()).join("policy_updates.parquet"));
        let cell = strs(&u, "cell_id");
        let first = cell.iter().position(|c| c == "c0001").unwrap();
        (f64s(&u, "rollout_learned_reward")[first + 1], f64s(&u, "rollout_oracle_reward")[first + 1])
    };
    let (lh, oh) = learned(deploy_spec("head", "", DEPLOY_POLICY), "head");
    let (lf, of) = learned(deploy_spec("lora", "backbone_lr_scale = 0.0", DEPLOY_POLICY), "fixed");
    let (lm, om) = learned(text, "again");
    eprintln!("chunk 2: learned reward head {lh:.6e}, fixed {lf:.6e}, learning {lm:.6e}; oracle {oh}, {of}, {om}");
    assert_eq!((oh, of), (om, om), "chunk 2's rollouts are the same samples in every run");
    assert!((lh - lf).abs() <= 1e-4 * lh.abs(), "fixed backbone: {lf} vs head {lh}");
    assert!((lm - lf).abs() > 0.05 * lf.abs(), "learning backbone: {lm} vs fixed {lf}");
}

#[test]
fn deploy_refuses_what_a_learning_feature_map_cannot_do() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path();
    write_prompts(p);
    let cases = [
        (deploy_spec("lora", "", "reset_each_chunk = true"), "deploy.reset_each_chunk", "keeps one reward model"),
        (
            deploy_spec("lora", "", "").replace("cache = \"cache/phi\"", "cache = \"cache/phi\"\npool = \"mean\""),
            "features.pool",
            "last",
        ),
        (
            deploy_spec("lora", "", "").replace("cache = \"cache/phi\"", "cache = \"cache/phi\"\nlayer = 1"),
            "features.layer",
            "layer = -1",
        ),
        (
            deploy_spec("lora", "", "").replace("kind = \"sgd\"\nlr = 0.1\nclip = \"none\"", "kind = \"mle\""),
            "estimator[0].kind",
            "d×d",
        ),
    ];
    for (text, key, says) in cases {
        std::fs::write(p.join("bad.toml"), &text).unwrap();
        let (code, _, stderr) = onepass(p, &["run", "bad.toml", "--dry-run"]).parts();
        assert_ne!(code, 0, "{key}: accepted");
        assert!(stderr.contains(key) && stderr.contains(says), "{key} / {says}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
    }
}
