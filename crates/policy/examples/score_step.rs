//! Seconds per scoring pass — log π of the adapted policy and of its reference over a batch's
//! response tokens, no graph (`PolicyModel::logprobs_scored`: what a rollout's old
//! log-probabilities, the KL and the held-out evaluation's scoring run) — on a GGUF model:
//! `cargo run --release -p policy --example score_step -- MODEL.gguf [SEQS] [PROMPT] [RESPONSE] [REPS]`
//! (defaults 16 × (64 + 32) tokens, 6 repetitions; ChaCha8 seed 0 random ids, right-padded
//! layout, LoRA r = 8, α = 16 on q_proj and v_proj). Prints the fastest and the median pass.

use candle_core::{DType, Device};
use policy::batch::SeqBatch;
use policy::{LoraConfig, PolicyModel};
use rand::{Rng, SeedableRng};

fn main() {
    // the allocator settings of the onepass binary: freed tensors are reused
    kernels::mem::keep_freed_memory();
    let args: Vec<String> = std::env::args().collect();
    let path = std::path::PathBuf::from(args.get(1).expect("a .gguf file"));
    let arg = |i: usize, d: usize| args.get(i).map_or(d, |s| s.parse().expect("a number"));
    let (seqs, prompt, response, reps) = (arg(2, 16), arg(3, 64), arg(4, 32), arg(5, 6).max(1));
    let g = features::gguf::Gguf::read_with(&path, &Device::Cpu, DType::F32, true).expect("reading the model");
    let vocab = g.cfg.vocab;
    let len = prompt + response;
    let m = PolicyModel::new(g.tensors, g.cfg, &LoraConfig::default(), len, DType::F32).expect("building the policy");
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    let ids: Vec<u32> = (0..seqs * len).map(|_| rng.random_range(0..vocab as u32)).collect();
    let rows: Vec<(&[u32], &[u32])> = ids.chunks(len).map(|s| (&s[..prompt], &s[prompt..])).collect();
    let b = SeqBatch::new(&rows, &Device::Cpu).expect("a batch");
    let mut ts = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t0 = std::time::Instant::now();
        std::hint::black_box(m.logprobs_scored(&b, true).expect("scoring"));
        std::hint::black_box(m.logprobs_scored(&b, false).expect("scoring"));
        ts.push(t0.elapsed().as_secs_f64());
    }
    ts.sort_by(f64::total_cmp);
    println!(
        "scoring {seqs} × ({prompt} + {response}) tokens, adapted + reference: fastest {:.3} s, median {:.3} s",
        ts[0],
        ts[ts.len() / 2]
    );
}
