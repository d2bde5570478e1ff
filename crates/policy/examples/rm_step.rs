//! Seconds of one reward-model step whose features learn (issue 30) on a GGUF model:
//! `cargo run --release -p policy --example rm_step -- MODEL.gguf RULE [PAIRS] [LEN] [REPS] [IDS_OUT]`,
//! RULE `sgd` (one forward and backward pass over the 2·PAIRS sequences, clip 1, lr 1e-3),
//! `omd` (paper Alg. 5: the gradient, then K = 3 conjugate-gradient steps on the damped batch
//! Hessian with HVPs by central differences of gradients — two more passes each — lr 1e-3),
//! `omd-forward` (the same with forward differences: one more pass each) or `omd-gn` (the
//! Gauss–Newton matrix's products: two forward passes and one backward each) or `omd-exact`
//! (exact products by Pearlmutter's R-operator on the step's recorded gradient pass, `policy::rm::rop`).
//! The reward model is r = θᵀh_ψ, ψ LoRA r = 8, α = 16 on every linear layer, θ = 1/(d+1)·1.
//! Each side of a pair has LEN random tokens (ChaCha8, seed 0), label 1. One untimed warm-up
//! step, then REPS timed ones; the last line is a JSON record for `just bench-rm-step`
//! (`scripts/bench_rm_step.sh`), which runs PyTorch + PEFT on the same ids (written to IDS_OUT).
//! `ONEPASS_KERNELS=routed` or `composed` runs a GPU's paths (CUDA's default, or candle's composed
//! ops) instead of the CPU's fused kernels: how their memory is measured on a CPU. Each step
//! also counts the buffers of ≥ 16 KiB it allocates (`buffers`): on the CPU each op allocates its
//! output, so the count stands for the kernels a GPU would launch per step (session 25).
//! On a GPU (built with `--features cuda`, e.g. by `just build-cuda`): `ONEPASS_DEVICE=cuda`;
//! `ONEPASS_PAIRS_PER_PASS=N` splits the step's backward passes as `[reward] pairs_per_pass`
//! does (default: the whole batch in one pass), `ONEPASS_RM_UPDATE=full` trains every weight
//! instead of LoRA adapters. The device is synchronised before each clock reading.

use candle_core::{DType, Device};
use estimators::{EstimatorConfig, HvpCgConfig, SgdConfig};
use policy::rm::model::{RewardModel, RmPair};
use policy::rm::update::{HvpConfig, HvpScheme, OnePass};
use policy::{LoraConfig, PolicyModel, Target};
use rand::{Rng, SeedableRng};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Allocations of ≥ 16 KiB (activation-sized buffers), counted.
struct Counting;
static BIG_ALLOCS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if l.size() >= 1 << 14 {
            BIG_ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        if l.size() >= 1 << 14 {
            BIG_ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn main() {
    kernels::mem::keep_freed_memory();
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
    // ONEPASS_KERNELS=routed|composed: a GPU's path, on the CPU (its memory and op count)
    let kernels = match env("ONEPASS_KERNELS").as_deref() {
        None => m.kernels(),
        Some("routed") => policy::ops::Kernels::Routed,
        Some("composed") => policy::ops::Kernels::Composed,
        Some("fused") => policy::ops::Kernels::Fused,
        Some(o) => panic!("ONEPASS_KERNELS={o}: expected fused, routed or composed"),
    };
    m.set_kernels(kernels).expect("kernels for the device");
    // as onepass runs a LoRA reward model on the CPU: candle's matmul for the frozen products
    // (`ONEPASS_F32_PRODUCTS=packed`: the packed f32 kernel a learning policy uses)
    if m.can_pack_products() && env("ONEPASS_F32_PRODUCTS").as_deref() == Some("packed") {
        m.use_packed_products(false).expect("packed f32 products");
    }
    let mut rm = RewardModel::new(m, &vec![1.0 / (d as f64 + 1.0); d], true).unwrap();
    let ppp = env("ONEPASS_PAIRS_PER_PASS").map(|v| v.parse::<usize>().expect("ONEPASS_PAIRS_PER_PASS: a number"));
    if let Some(n) = ppp {
        rm.set_pairs_per_pass(n);
    }
    let cfg = match rule.as_str() {
        "sgd" => EstimatorConfig::Sgd(SgdConfig { lr: 1e-3, clip: Some(1.0) }),
        "omd" | "omd-forward" | "omd-gn" | "omd-exact" => {
            EstimatorConfig::OmdHvpCg(HvpCgConfig { lr: 1e-3, cg_tol: 0.0, ..Default::default() })
        }
        r => panic!("rule {r}: expected sgd, omd, omd-forward, omd-gn or omd-exact"),
    };
    let scheme = match rule.as_str() {
        "omd-forward" => HvpScheme::Forward,
        "omd-gn" => HvpScheme::GaussNewton,
        "omd-exact" => HvpScheme::Exact,
        _ => HvpScheme::Central,
    };
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
    let (mut steps, mut hvps, mut loss, mut buffers) = (Vec::new(), 0, 0.0, 0);
    for r in 0..=reps {
        dev.synchronize().unwrap();
        let b0 = BIG_ALLOCS.load(Ordering::Relaxed);
        let t0 = std::time::Instant::now();
        let s = up.step(&rm, &batch).unwrap();
        dev.synchronize().unwrap();
        let t = t0.elapsed().as_secs_f64();
        buffers = BIG_ALLOCS.load(Ordering::Relaxed) - b0;
        if r > 0 {
            eprintln!("step {r}: {t:.2} s, {} HVPs, loss {:.4}, {buffers} buffers ≥ 16 KiB", s.hvps, s.before.loss);
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
            "pairs_per_pass": ppp.unwrap_or(pairs), "kernels": format!("{kernels:?}").to_lowercase(), "buffers": buffers, "model": path.display().to_string(), "dtype": "float32",
            "threads": threads, "pairs": pairs, "len": len, "reps": reps, "step_s": steps, "hvps": hvps,
            "peak_rss_mb": kernels::mem::peak_rss_mb().unwrap_or(0.0), "loss": loss,
        })
    );
}
