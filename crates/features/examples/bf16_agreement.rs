//! Greedy decoding in bf16 against f32 (issue 20's quality bar): `cargo run --release -p features
//! --example bf16_agreement -- MODEL PROMPTS.jsonl [PROMPTS=50] [TOKENS=32]`. The first PROMPTS
//! prompts of the jsonl (key `prompt`), templated with the model's chat template, are decoded
//! greedily for at most TOKENS new tokens with the weights in f32 and in bf16; prints how many
//! prompts give the same tokens, the mean length of the common prefix, and a JSON record.

use candle_core::{DType, Device};
use features::sampling::SampleOptions;
use features::{Backbone, Source};

mod common;

fn main() {
    kernels::mem::keep_freed_memory();
    let args: Vec<String> = std::env::args().collect();
    let model = args.get(1).expect("a .gguf file or model directory");
    let arg = |i: usize, d: usize| args.get(i).map_or(d, |s| s.parse().expect("a number"));
    let (n_prompts, tokens) = (arg(3, 50), arg(4, 32));
    let prompts = common::first_prompts(args.get(2).expect("a prompts .jsonl"), n_prompts);
    let source = Source::parse(model).expect("a model source");
    let opts = SampleOptions { n: 1, temperature: 0.0, top_p: 1.0, max_new_tokens: tokens, seed: 0 };
    let run = |dtype: DType| -> Vec<Vec<u32>> {
        let b = Backbone::load_with(&source, &Device::Cpu, dtype, 4096, true).expect("loading the model");
        let out = b.generate(&prompts, &opts, 8, &mut |_| {}).expect("generating");
        out.into_iter().map(|mut s| s.remove(0).ids).collect()
    };
    let (f32_ids, bf16_ids) = (run(DType::F32), run(DType::BF16));
    let mut same = 0;
    let mut prefix = Vec::new();
    for (i, (a, b)) in f32_ids.iter().zip(&bf16_ids).enumerate() {
        let common = a.iter().zip(b).take_while(|(x, y)| x == y).count();
        prefix.push(common);
        if a == b {
            same += 1;
        } else {
            eprintln!("prompt {i}: first difference at token {common} of {} / {}", a.len(), b.len());
        }
    }
    let mean = prefix.iter().sum::<usize>() as f64 / prefix.len().max(1) as f64;
    eprintln!(
        "{same} of {} prompts decode to the same {tokens} tokens (greedy) in bf16 and f32; mean common prefix {mean:.1} tokens",
        prompts.len()
    );
    println!(
        "{}",
        serde_json::json!({"prompts": prompts.len(), "tokens": tokens, "same": same, "mean_common_prefix": mean, "common_prefix": prefix})
    );
}
