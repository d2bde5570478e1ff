//! Seconds of one reward-model step whose features learn (issue 30) on a GGUF model:
//! `cargo run --release -p policy --example rm_step -- MODEL.gguf RULE [PAIRS] [LEN] [REPS] [IDS_OUT]`,
//! RULE `sgd` (one forward and backward pass over the 2·PAIRS sequences, clip 1, lr 1e-3),
//! `omd` (paper Alg. 5: the gradient, then K = 3 conjugate-gradient steps on the damped batch
//! Hessian with HVPs by central differences of gradients — two more passes each — lr 1e-3) or
//! `omd-forward` (the same with forward differences: one more pass each).
//! The reward model is r = θᵀh_ψ, ψ LoRA r = 8, α = 16 on every linear layer, θ = 1/(d+1)·1.
//! Each side of a pair has LEN random tokens (ChaCha8, seed 0), label 1. One untimed warm-up
//! step, then REPS timed ones; the last line is a JSON record for `just bench-rm-step`
//! (`scripts/bench_rm_step.sh`), which runs PyTorch + PEFT on the same ids (written to IDS_OUT).
//! `ONEPASS_KERNELS=composed` runs candle's composed ops (what a GPU trains with) instead of the
//! CPU's fused kernels: how the GPU path's memory is measured on a CPU.
//! On a GPU (built with `--features cuda`, e.g. by `just build-cuda`): `ONEPASS_DEVICE=cuda`;
//! `ONEPASS_PAIRS_PER_PASS=N` splits the step's backward passes as `[reward] pairs_per_pass`
//! does (default: the whole batch in one pass), `ONEPASS_RM_UPDATE=full` trains every weight
//! instead of LoRA adapters. The device is synchronised before each clock reading.

use candle_core::{DType, Device};
use estimators::{EstimatorConfig, HvpCgConfig, SgdConfig};
use policy::reward::{HvpConfig, HvpScheme, OnePass, RewardModel, RmPair};
use policy::{LoraConfig, PolicyModel, Target};
use rand::{Rng, SeedableRng};

fn main() {
    policy::keep_freed_memory();
    let args: Vec<String> = std::env::args().collect();
    let path = std::path::PathBuf::from(args.get(1).expect("a .gguf file"));
    let rule = args.get(2).expect("sgd or omd").clone();
    let arg = |i: usize, d: usize| args.get(i).map_or(d, |s| s.parse().expect("a number"));
    let (pairs, len, reps) = (arg(3, 8), arg(4, 256), arg(5, 2));
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let dev = match env("ONEPASS_DEVICE").as_deref() {
        None | Some("cpu") => Device::Cpu,
        Some("cuda") => Device::new_cuda(0).expect("opening CUDA device 0 (build with --features cuda)"),
        Some(o) => panic!("ONEPASS_DEVICE={o}: expected cpu or cuda"),
    };
    let full = match env("ONEPASS_RM_UPDATE").as_deref() {
        None | Some("lora") => false,
        Some("full") => true,
        Some(o) => panic!("ONEPASS_RM_UPDATE={o}: expected lora or full"),
    };
    let g = features::gguf::Gguf::read_with(&path, &dev, DType::F32, true).expect("reading the model");
    let (vocab, d) = (g.cfg.vocab, g.cfg.hidden);
    let lora = LoraConfig { rank: 8, alpha: 16.0, targets: Target::ALL.to_vec(), seed: 0, dropout: 0.0 };
    let mut m = if full {
        PolicyModel::new_full(g.tensors, g.cfg, len, DType::F32).expect("building the model")
    } else {
        PolicyModel::new(g.tensors, g.cfg, &lora, len, DType::F32).expect("building the model")
    };
    // ONEPASS_KERNELS=composed: the composed ops a GPU trains with, on the CPU (their memory)
    let composed = std::env::var("ONEPASS_KERNELS").as_deref() == Ok("composed");
    if composed {
        m.set_kernels(policy::ops::Kernels::Composed).expect("composed kernels");
    }
    let mut rm = RewardModel::new(m, &vec![1.0 / (d as f64 + 1.0); d], true).unwrap();
    let ppp = env("ONEPASS_PAIRS_PER_PASS").map(|v| v.parse::<usize>().expect("ONEPASS_PAIRS_PER_PASS: a number"));
    if let Some(n) = ppp {
        rm.set_pairs_per_pass(n);
    }
    let cfg = match rule.as_str() {
        "sgd" => EstimatorConfig::Sgd(SgdConfig { lr: 1e-3, clip: Some(1.0) }),
        "omd" | "omd-forward" => EstimatorConfig::OmdHvpCg(HvpCgConfig { lr: 1e-3, cg_tol: 0.0, ..Default::default() }),
        r => panic!("rule {r}: expected sgd, omd or omd-forward"),
    };
    let scheme = if rule == "omd-forward" { HvpScheme::Forward } else { HvpScheme::Central };
    let hvp = HvpConfig { eps: scheme.default_eps(), scheme };
    let mut up = OnePass::new(&cfg, &rm, Some(100), hvp, 1.0).unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    let ids: Vec<u32> = (0..2 * pairs * len).map(|_| rng.random_range(0..vocab as u32)).collect();
    if let Some(out) = args.get(6) {
        let rows: Vec<&[u32]> = ids.chunks(len).collect();
        std::fs::write(out, serde_json::json!({ "ids": rows }).to_string()).expect("writing the ids");
    }
    let seqs: Vec<&[u32]> = ids.chunks(len).collect();
    let batch: Vec<RmPair> = (0..pairs).map(|i| RmPair { a: seqs[2 * i], b: seqs[2 * i + 1], y: 1.0 }).collect();
    let (mut steps, mut hvps, mut loss) = (Vec::new(), 0, 0.0);
    for r in 0..=reps {
        dev.synchronize().unwrap();
        let t0 = std::time::Instant::now();
        let s = up.step(&rm, &batch).unwrap();
        dev.synchronize().unwrap();
        let t = t0.elapsed().as_secs_f64();
        if r > 0 {
            eprintln!("step {r}: {t:.2} s, {} HVPs, loss {:.4}", s.hvps, s.before.loss);
            steps.push(t);
            hvps = s.hvps;
            loss = s.before.loss;
        }
    }
    let threads = std::env::var("RAYON_NUM_THREADS").ok().and_then(|t| t.parse().ok()).unwrap_or(0usize);
    println!(
        "{}",
        serde_json::json!({
            "engine": "candle", "rule": rule, "device": format!("{dev:?}"), "update": if full { "full" } else { "lora" },
            "pairs_per_pass": ppp.unwrap_or(pairs), "kernels": if composed { "composed" } else { "fused" }, "model": path.display().to_string(), "dtype": "float32",
            "threads": threads, "pairs": pairs, "len": len, "reps": reps, "step_s": steps, "hvps": hvps,
            "peak_rss_mb": features::peak_rss_mb().unwrap_or(0.0), "loss": loss,
        })
    );
}
