//! Tokens per second of one LoRA policy-update step (forward, backward, Adam) on a GGUF model:
//! `cargo run --release -p policy --example train_step -- MODEL.gguf [BATCH] [LEN] [REPS]`.
//! The measurement behind `just bench-train`'s onepass side (the PyTorch peer is to come).

use candle_core::{DType, Device};
use policy::adam::{Adam, AdamConfig};
use policy::batch::SeqBatch;
use policy::{LoraConfig, PolicyModel};
use rand::{Rng, SeedableRng};

fn main() {
    // the allocator settings of the onepass binary (see `keep_freed_memory` in runner/src/main.rs):
    // freed tensors are reused instead of returned to the kernel and zeroed again
    // SAFETY: mallopt only sets allocator parameters; no other thread runs yet.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
        libc::mallopt(libc::M_MMAP_THRESHOLD, i32::MAX);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
    let args: Vec<String> = std::env::args().collect();
    let path = std::path::PathBuf::from(args.get(1).expect("a .gguf file"));
    let arg = |i: usize, d: usize| args.get(i).map_or(d, |s| s.parse().expect("a number"));
    let (batch, len, reps) = (arg(2, 8), arg(3, 256), arg(4, 3));
    let g = features::gguf::Gguf::read_with(&path, &Device::Cpu, DType::F32, true).expect("reading the model");
    let vocab = g.cfg.vocab;
    let m = PolicyModel::new(g.tensors, g.cfg, &LoraConfig::default(), len, DType::F32).expect("building the policy");
    let vars = m.vars();
    let mut opt = Adam::new(AdamConfig::default(), &vars).unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    let ids: Vec<u32> = (0..batch * len).map(|_| rng.random_range(0..vocab as u32)).collect();
    // every sequence: `len` tokens, the second half the response (log-probabilities and
    // gradients at the response positions only, as an RLOO or DPO step takes them)
    let seqs: Vec<(&[u32], &[u32])> =
        ids.chunks(len).map(|s| (&s[..len / 2], &s[len / 2..])).collect();
    let b = SeqBatch::new(&seqs, &Device::Cpu).unwrap();
    for r in 0..=reps {
        let t0 = std::time::Instant::now();
        let lp = b.seq_sum(&m.logprobs_at(&b, true).unwrap()).unwrap();
        let t1 = t0.elapsed().as_secs_f64();
        let grads = lp.mean_all().unwrap().neg().unwrap().backward().unwrap();
        opt.step(&vars, &grads).unwrap();
        let s = t0.elapsed().as_secs_f64();
        if r > 0 {
            println!("step {r}: {:.2} s (forward {:.2} s), {:.0} tok/s", s, t1, (batch * len) as f64 / s);
        }
    }
}
