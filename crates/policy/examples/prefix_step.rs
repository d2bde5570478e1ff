//! Seconds per gradient pass (forward + backward of Σ log π over the response tokens) in the
//! padded and the shared-prompt layouts (`SeqBatch::new` vs `SeqBatch::shared`), on a GGUF
//! model: `cargo run --release -p policy --example prefix_step -- MODEL.gguf [GROUPS] [K]
//! [PROMPT] [RESPONSE] [REPS]`. GROUPS prompts of PROMPT random tokens, K responses of
//! RESPONSE random tokens each (ChaCha8, seed 0): an RLOO mini-batch of GROUPS·K samples.
//! LoRA r = 8, α = 16 on q_proj and v_proj (B randomised so the adapters matter). Prints both
//! layouts' median seconds, their ratio, and the largest relative difference of the
//! log-probabilities (the two layouts compute the same function).

use candle_core::{DType, Device};
use policy::batch::SeqBatch;
use policy::{LoraConfig, PolicyModel};
use rand::{Rng, SeedableRng};

fn main() {
    kernels::mem::keep_freed_memory();
    let args: Vec<String> = std::env::args().collect();
    let path = std::path::PathBuf::from(args.get(1).expect("a .gguf file"));
    let arg = |i: usize, d: usize| args.get(i).map_or(d, |s| s.parse().expect("a number"));
    let (groups, k, p, r, reps) = (arg(2, 4), arg(3, 4), arg(4, 40), arg(5, 24), arg(6, 3));
    let g = features::gguf::Gguf::read_with(&path, &Device::Cpu, DType::F32, true).expect("reading the model");
    let vocab = g.cfg.vocab as u32;
    let m = PolicyModel::new(g.tensors, g.cfg, &LoraConfig::default(), p + r, DType::F32).expect("the policy");
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    for v in m.vars() {
        let n = v.as_tensor().elem_count();
        let x: Vec<f32> = (0..n).map(|_| rng.random_range(-0.01..0.01)).collect();
        v.set(&candle_core::Tensor::from_vec(x, v.as_tensor().shape(), &Device::Cpu).unwrap()).unwrap();
    }
    let mut tok = |n: usize| -> Vec<u32> { (0..n).map(|_| rng.random_range(0..vocab)).collect() };
    let prompts: Vec<Vec<u32>> = (0..groups).map(|_| tok(p)).collect();
    let responses: Vec<Vec<u32>> = (0..groups * k).map(|_| tok(r)).collect();
    let seqs: Vec<(&[u32], &[u32])> =
        responses.iter().enumerate().map(|(i, resp)| (prompts[i / k].as_slice(), resp.as_slice())).collect();
    let mut out = Vec::new();
    for (name, b) in [
        ("padded", SeqBatch::new(&seqs, &Device::Cpu).unwrap()),
        ("shared", SeqBatch::shared(&seqs, &Device::Cpu).unwrap()),
    ] {
        let mut times = Vec::new();
        let mut values = Vec::new();
        for i in 0..=reps {
            let t0 = std::time::Instant::now();
            let lp = m.logprobs_at(&b, true).unwrap();
            let _ = lp.sum_all().unwrap().backward().unwrap();
            if i > 0 {
                times.push(t0.elapsed().as_secs_f64());
            }
            values = lp.to_vec1::<f32>().unwrap();
        }
        times.sort_by(f64::total_cmp);
        let med = times[times.len() / 2];
        eprintln!("{name}: {med:.3} s per gradient pass ({groups} groups × {k}, prompt {p}, response {r})");
        out.push((med, values));
    }
    let diff = out[0].1.iter().zip(&out[1].1).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    let scale = out[0].1.iter().fold(0f32, |m, x| m.max(x.abs()));
    println!(
        "{}",
        serde_json::json!({"groups": groups, "k": k, "prompt": p, "response": r, "padded_s": out[0].0,
            "shared_s": out[1].0, "speedup": out[0].0 / out[1].0, "max_rel_diff": diff / scale})
    );
}
