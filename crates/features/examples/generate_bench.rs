//! Tokens per second of onepass's sampling loop (prefill + decode with the KV cache), the shape of
//! the deploy mini: `cargo run --release -p features --example generate_bench -- MODEL PROMPTS.jsonl
//! [PROMPTS=16] [N=8] [MAX_NEW=64] [BATCH_PROMPTS=8] [IDS_OUT] [DTYPE=f32|bf16]`. The first PROMPTS prompts of the
//! jsonl (key `prompt`) are templated with the model's chat template; N samples each at T = 1,
//! BATCH_PROMPTS prompts × N rows per decoding step, at most MAX_NEW new tokens, stopping at the
//! end-of-turn token. One untimed warm-up on the first batch, then one timed pass over all
//! prompts. tok/s counts generated tokens (the stop token included). The last line is a JSON
//! record for `just bench-generate` (`scripts/bench_generate.sh`); IDS_OUT receives the templated
//! prompt ids so that transformers' `generate()` starts from the same tokens.

use candle_core::{DType, Device};
use features::sampling::SampleOptions;
use features::{Backbone, Source};

mod common;

fn main() {
    // the allocator settings of the onepass binary
    kernels::mem::keep_freed_memory();
    let args: Vec<String> = std::env::args().collect();
    let model = args.get(1).expect("a .gguf file or model directory");
    let prompts_path = args.get(2).expect("a prompts .jsonl");
    let arg = |i: usize, d: usize| args.get(i).map_or(d, |s| s.parse().expect("a number"));
    let (n_prompts, n, max_new, batch_prompts) = (arg(3, 16), arg(4, 8), arg(5, 64), arg(6, 8));
    let prompts = common::first_prompts(prompts_path, n_prompts);
    let source = Source::parse(model).expect("a model source");
    let (dtype, dtype_name) = match args.get(8).map(String::as_str) {
        None | Some("f32") => (DType::F32, "float32"),
        Some("bf16") => (DType::BF16, "bfloat16"),
        Some(other) => panic!("dtype {other}: expected f32 or bf16"),
    };
    let b = Backbone::load_with(&source, &Device::Cpu, dtype, 4096, true).expect("loading the model");
    let ids: Vec<Vec<u32>> = prompts.iter().map(|p| b.prompt_ids(p).expect("templating")).collect();
    if let Some(out) = args.get(7).filter(|o| !o.is_empty()) {
        let eos: Vec<u32> = b.tok.eos.iter().map(|e| e.1).collect();
        let spec = serde_json::json!({"ids": ids, "n": n, "max_new_tokens": max_new, "batch_prompts": batch_prompts, "eos": eos});
        std::fs::write(out, spec.to_string()).expect("writing the ids");
    }
    let opts = SampleOptions { n, temperature: 1.0, top_p: 1.0, max_new_tokens: max_new, seed: 0 };
    // warm-up: the first batch
    b.generate(&prompts[..batch_prompts.min(prompts.len())], &opts, batch_prompts, &mut |_| {}).expect("generating");
    let t0 = std::time::Instant::now();
    let out = b.generate(&prompts, &opts, batch_prompts, &mut |_| {}).expect("generating");
    let s = t0.elapsed().as_secs_f64();
    let tokens: usize = out.iter().flatten().map(|x| x.tokens).sum();
    let stopped = out.iter().flatten().filter(|x| x.stopped).count();
    let threads = std::env::var("RAYON_NUM_THREADS").ok().and_then(|t| t.parse().ok()).unwrap_or(0usize);
    let rss = kernels::mem::peak_rss_mb().unwrap_or(0.0);
    eprintln!(
        "{tokens} tokens in {s:.2} s ({:.0} tok/s), {stopped} of {} rows stopped",
        tokens as f64 / s,
        n * prompts.len()
    );
    println!(
        "{}",
        serde_json::json!({
            "engine": "candle", "dtype": dtype_name, "model": model, "threads": threads,
            "batch": batch_prompts * n, "len": max_new, "reps": 1, "pass_s": [s],
            "tok_s": tokens as f64 / s, "peak_rss_mb": rss, "abs_sum": tokens as f64,
        })
    );
}
