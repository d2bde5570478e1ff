//! Tokens per second of one LoRA policy-update step (forward, backward, Adam) on a GGUF model:
//! `cargo run --release -p policy --example train_step -- MODEL.gguf [BATCH] [LEN] [REPS] [IDS_OUT] [f32|bf16]`
//! (bf16: the frozen products forward and backward on the packed bf16 kernel,
//! `PolicyModel::use_bf16_products`).
//! Each of BATCH sequences has LEN random tokens (ChaCha8, seed 0), the second half the
//! response: the loss is −mean Σ log π over the response tokens, as an RLOO or DPO step takes
//! it; LoRA r = 8, α = 16 on q_proj and v_proj; Adam (lr 1e-4) with global-norm clipping at 1.
//! One untimed warm-up step, then REPS timed ones; the last line is a JSON record for
//! `just bench-train` (`scripts/bench_train.sh`), which runs PyTorch + PEFT on the same ids
//! (written to IDS_OUT when given). `ONEPASS_KERNELS=routed` or `composed` runs a GPU's path
//! (CUDA's default, or candle's composed ops) instead of the CPU's fused kernels: how a GPU
//! path's memory is measured here. `ONEPASS_SUBLAYERS=unfused` builds the graph op by op
//! (`PolicyModel::set_sublayer_fusion(false)`: the same bits, more activations kept).

use candle_core::{DType, Device};
use policy::adam::{Adam, AdamConfig};
use policy::batch::SeqBatch;
use policy::{LoraConfig, PolicyModel};
use rand::{Rng, SeedableRng};

fn main() {
    // the allocator settings of the onepass binary: freed tensors are reused
    kernels::mem::keep_freed_memory();
    let args: Vec<String> = std::env::args().collect();
    let path = std::path::PathBuf::from(args.get(1).expect("a .gguf file"));
    let arg = |i: usize, d: usize| args.get(i).map_or(d, |s| s.parse().expect("a number"));
    let (batch, len, reps) = (arg(2, 8), arg(3, 256), arg(4, 3));
    let g = features::gguf::Gguf::read_with(&path, &Device::Cpu, DType::F32, true).expect("reading the model");
    let vocab = g.cfg.vocab;
    // the shapes the report counts the step's FLOPs from (scripts/peak.py)
    let c = &g.cfg;
    let shapes = serde_json::json!({
        "hidden": c.hidden, "intermediate": c.intermediate, "layers": c.layers, "heads": c.heads,
        "kv_heads": c.kv_heads, "head_dim": c.head_dim, "vocab": c.vocab,
    });
    let bf16 = match args.get(6).map(String::as_str) {
        None | Some("f32") => false,
        Some("bf16") => true,
        Some(other) => panic!("dtype {other}: expected f32 or bf16"),
    };
    let mut m =
        PolicyModel::new(g.tensors, g.cfg, &LoraConfig::default(), len, DType::F32).expect("building the policy");
    if bf16 {
        m.use_bf16_products().expect("bf16 products");
    } else if std::env::var("ONEPASS_F32_PRODUCTS").as_deref() != Ok("gemm") {
        // as onepass trains in f32 on the CPU: the packed f32 kernel (`gemm`: candle's matmul)
        m.use_packed_products(false).expect("packed f32 products");
    }
    // ONEPASS_KERNELS=routed|composed: a GPU's path, on the CPU (its memory)
    if let Ok(k) = std::env::var("ONEPASS_KERNELS") {
        let k = match k.as_str() {
            "fused" => policy::ops::Kernels::Fused,
            "routed" => policy::ops::Kernels::Routed,
            "composed" => policy::ops::Kernels::Composed,
            o => panic!("ONEPASS_KERNELS={o}: expected fused, routed or composed"),
        };
        m.set_kernels(k).expect("kernels for the CPU");
    }
    // ONEPASS_SUBLAYERS=unfused: the graph op by op (the same bits; what the fused sublayers save)
    if std::env::var("ONEPASS_SUBLAYERS").as_deref() == Ok("unfused") {
        m.set_sublayer_fusion(false);
    }
    let vars = m.vars();
    let mut opt = Adam::new(AdamConfig::default(), &vars).unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    let ids: Vec<u32> = (0..batch * len).map(|_| rng.random_range(0..vocab as u32)).collect();
    if let Some(out) = args.get(5) {
        let rows: Vec<&[u32]> = ids.chunks(len).collect();
        std::fs::write(out, serde_json::json!({ "ids": rows, "response_from": len / 2 }).to_string())
            .expect("writing the ids");
    }
    let seqs: Vec<(&[u32], &[u32])> = ids.chunks(len).map(|s| (&s[..len / 2], &s[len / 2..])).collect();
    let b = SeqBatch::new(&seqs, &Device::Cpu).unwrap();
    let mut steps = Vec::new();
    let mut loss = 0.0;
    for r in 0..=reps {
        let t0 = std::time::Instant::now();
        let lp = b.seq_sum(&m.logprobs_at(&b, true).unwrap()).unwrap();
        let t1 = t0.elapsed().as_secs_f64();
        let l = lp.mean_all().unwrap().neg().unwrap();
        loss = l.to_scalar::<f32>().unwrap() as f64;
        opt.step(&vars, &l.backward().unwrap()).unwrap();
        let s = t0.elapsed().as_secs_f64();
        if r > 0 {
            eprintln!("step {r}: {:.2} s (forward {:.2} s), {:.0} tok/s", s, t1, (batch * len) as f64 / s);
            steps.push(s);
        }
    }
    let threads = std::env::var("RAYON_NUM_THREADS").ok().and_then(|t| t.parse().ok()).unwrap_or(0usize);
    let rss = kernels::mem::peak_rss_mb().unwrap_or(0.0);
    println!(
        "{}",
        serde_json::json!({
            "engine": "candle", "model": path.display().to_string(), "dtype": if bf16 { "bfloat16" } else { "float32" },
            "threads": threads, "batch": batch, "len": len, "reps": reps, "pass_s": steps,
            "tok_s": (batch * len * reps) as f64 / steps.iter().sum::<f64>(),
            "peak_rss_mb": rss, "abs_sum": loss, "shapes": shapes,
            "lora": { "rank": 8, "targets": ["q_proj", "v_proj"] },
        })
    );
}
