//! Generation: the KV-cache path against the full forward pass (which the tiny-model tests pin
//! to transformers), left padding, cache row selection, the sampler against softmax, and
//! `Backbone::generate`'s independence of batching and prompt order on a tiny GGUF.

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use features::generate::sample_token;
use features::model::{Config, HfConfig, Model};
use features::sampling::SampleOptions;
use features::{Backbone, Message, Source};
use std::path::PathBuf;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn tiny(name: &str) -> Model {
    let d = fixtures().join(name);
    let hf: HfConfig = serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap();
    let cfg = Config::from_hf(&hf).unwrap();
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[d.join("model.safetensors")], DType::F32, &Device::Cpu) }
        .unwrap();
    Model::load_with(vb, cfg, 128, Some(hf.tie_word_embeddings)).unwrap()
}

fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let md = a.iter().zip(b).map(|(x, y)| f64::from((x - y).abs())).fold(0.0, f64::max);
    let mb = b.iter().map(|y| f64::from(y.abs())).fold(0.0, f64::max);
    md / mb
}

fn ids(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + salt * 11 + 5) % 128).collect()
}

/// Prefill `k` tokens, then one token at a time: the logits at every position equal the full
/// forward pass's.
fn check_incremental(name: &str) {
    let m = tiny(name);
    let seq = ids(20, 3);
    let full: Vec<Vec<f32>> = m
        .logits(&Tensor::new(seq.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap())
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_vec2()
        .unwrap();
    for k in [1, 7] {
        let mut cache = m.new_cache(vec![0], seq.len()).unwrap();
        let t = Tensor::new(&seq[..k], &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        let l: Vec<f32> = m.forward_cached(&t, &mut cache).unwrap().squeeze(0).unwrap().to_vec1().unwrap();
        assert!(rel_err(&l, &full[k - 1]) < 1e-5, "{name}: prefill of {k}: {}", rel_err(&l, &full[k - 1]));
        for p in k..seq.len() {
            let t = Tensor::new(&seq[p..p + 1], &Device::Cpu).unwrap().unsqueeze(0).unwrap();
            let l: Vec<f32> = m.forward_cached(&t, &mut cache).unwrap().squeeze(0).unwrap().to_vec1().unwrap();
            let e = rel_err(&l, &full[p]);
            assert!(e < 1e-5, "{name}: position {p} after a prefill of {k}: rel err {e}");
        }
        assert_eq!(cache.len(), seq.len());
        // the cache is full: one more token is an error, not a panic
        let t = Tensor::new(&seq[..1], &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        assert!(m.forward_cached(&t, &mut cache).is_err());
    }
}

#[test]
fn incremental_logits_equal_the_full_forward_llama() {
    check_incremental("tiny-llama");
}

#[test]
fn incremental_logits_equal_the_full_forward_qwen2() {
    check_incremental("tiny-qwen2");
}

#[test]
fn left_padded_rows_decode_as_if_alone_and_select_repeats_rows() {
    let m = tiny("tiny-llama");
    let (a, b) = (ids(11, 1), ids(4, 2));
    let steps = ids(6, 9);
    let alone = |s: &[u32]| -> Vec<Vec<f32>> {
        let mut c = m.new_cache(vec![0], s.len() + steps.len()).unwrap();
        let mut out = vec![m
            .forward_cached(&Tensor::new(s, &Device::Cpu).unwrap().unsqueeze(0).unwrap(), &mut c)
            .unwrap()
            .squeeze(0)
            .unwrap()
            .to_vec1()
            .unwrap()];
        for &t in &steps {
            let x = Tensor::new(&[t], &Device::Cpu).unwrap().unsqueeze(0).unwrap();
            out.push(m.forward_cached(&x, &mut c).unwrap().squeeze(0).unwrap().to_vec1().unwrap());
        }
        out
    };
    let (wa, wb) = (alone(&a), alone(&b));
    // b left-padded to a's length with a token that must not matter
    let pad = a.len() - b.len();
    let mut flat = a.clone();
    flat.extend(std::iter::repeat_n(77u32, pad));
    flat.extend(&b);
    let mut c = m.new_cache(vec![0, pad], a.len() + steps.len()).unwrap();
    let first: Vec<Vec<f32>> = m
        .forward_cached(&Tensor::from_vec(flat, (2, a.len()), &Device::Cpu).unwrap(), &mut c)
        .unwrap()
        .to_vec2()
        .unwrap();
    assert!(rel_err(&first[0], &wa[0]) < 1e-5 && rel_err(&first[1], &wb[0]) < 1e-5);
    // repeat row 1 twice and drop row 0: [b, b]
    c.select(&[1, 1]).unwrap();
    for (s, &t) in steps.iter().enumerate() {
        let x = Tensor::new(&[[t], [t]], &Device::Cpu).unwrap();
        let l: Vec<Vec<f32>> = m.forward_cached(&x, &mut c).unwrap().to_vec2().unwrap();
        for row in &l {
            let e = rel_err(row, &wb[s + 1]);
            assert!(e < 1e-5, "step {s}: padded, selected row vs alone: rel err {e}");
        }
    }
    assert!(c.select(&[2]).is_err(), "a row out of range is an error");
}

fn softmax(l: &[f32], t: f64) -> Vec<f64> {
    let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let e: Vec<f64> = l.iter().map(|&x| ((x as f64 - m) / t).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|x| x / s).collect()
}

#[test]
fn sampler_follows_softmax_temperature_and_nucleus() {
    let logits = [0.5f32, 2.0, -1.0, 1.5, 0.0];
    assert_eq!(sample_token(&logits, 0.0, 1.0, 0.99), 1, "temperature 0 is the argmax");
    assert_eq!(sample_token(&logits, 1.0, 1e-9, 0.99), 1, "a tiny nucleus keeps the argmax only");
    let draws = 40_000;
    for t in [1.0, 0.5, 2.0] {
        let want = softmax(&logits, t);
        let mut count = [0usize; 5];
        for i in 0..draws {
            let u = (i as f64 + 0.5) / draws as f64;
            count[sample_token(&logits, t, 1.0, u) as usize] += 1;
        }
        for (k, (&c, &w)) in count.iter().zip(&want).enumerate() {
            let got = c as f64 / draws as f64;
            assert!((got - w).abs() < 1e-3, "T {t}, token {k}: frequency {got} vs softmax {w}");
        }
    }
    // top-p 0.8: tokens by probability 1 (0.46), 3 (0.28), 0 (0.10) … reach 0.8 after three
    let p = softmax(&logits, 1.0);
    let nucleus = [1usize, 3, 0];
    let mass: f64 = nucleus.iter().map(|&k| p[k]).sum();
    assert!(p[1] + p[3] < 0.8 && mass >= 0.8);
    let mut count = [0usize; 5];
    for i in 0..draws {
        count[sample_token(&logits, 1.0, 0.8, (i as f64 + 0.5) / draws as f64) as usize] += 1;
    }
    for k in 0..5 {
        let want = if nucleus.contains(&k) { p[k] / mass } else { 0.0 };
        let got = count[k] as f64 / draws as f64;
        assert!((got - want).abs() < 1e-3, "top-p token {k}: {got} vs {want}");
    }
}

fn prompts() -> Vec<Vec<Message>> {
    ["Say hello.", "What is two plus two? Answer briefly please.", "A haiku about rust", "Why?"]
        .iter()
        .map(|p| vec![Message::new("user", p)])
        .collect()
}

#[test]
fn generation_does_not_depend_on_batching_or_prompt_order() {
    let b =
        Backbone::load_with(&Source::Gguf(fixtures().join("tiny-llama-bpe.gguf")), &Device::Cpu, DType::F32, 256, true)
            .unwrap();
    let opts = SampleOptions { n: 3, temperature: 1.0, top_p: 0.9, max_new_tokens: 12, seed: 7 };
    let mut steps = 0;
    let one = b.generate(&prompts(), &opts, 1, &mut |_| steps += 1).unwrap();
    assert!(steps > 0);
    // the tokens and texts are the same whatever the batch; the recorded log-probabilities
    // agree to rounding (the padded attention sums in another order)
    type Drawn = Vec<Vec<(String, usize, bool, Vec<u32>)>>;
    let same = |a: &[Vec<features::generate::Sample>], b: &[Vec<features::generate::Sample>], what: &str| {
        let strip = |v: &[Vec<features::generate::Sample>]| -> Drawn {
            v.iter().map(|p| p.iter().map(|s| (s.text.clone(), s.tokens, s.stopped, s.ids.clone())).collect()).collect()
        };
        assert_eq!(strip(a), strip(b), "{what}");
        let worst = a
            .iter()
            .flatten()
            .zip(b.iter().flatten())
            .flat_map(|(x, y)| x.logprobs.iter().zip(&y.logprobs).map(|(p, q)| (p - q).abs()))
            .fold(0f32, f32::max);
        assert!(worst < 1e-5, "{what}: recorded log-probabilities differ by {worst}");
    };
    let all = b.generate(&prompts(), &opts, 4, &mut |_| {}).unwrap();
    same(&one, &all, "one prompt per batch vs all four in one left-padded batch");
    let mut rev = prompts();
    rev.reverse();
    let mut back = b.generate(&rev, &opts, 3, &mut |_| {}).unwrap();
    back.reverse();
    same(&one, &back, "prompt order");
    for s in one.iter().flatten() {
        assert!(s.tokens >= 1 && s.tokens <= 12 && (s.stopped || s.tokens == 12), "{s:?}");
    }
    // the samples of a prompt differ (random weights, T = 1), and another seed gives others
    assert!(one.iter().any(|p| p[0] != p[1] || p[1] != p[2]));
    let other = b.generate(&prompts(), &SampleOptions { seed: 8, ..opts.clone() }, 4, &mut |_| {}).unwrap();
    assert_ne!(one, other);
    // greedy: every sample of a prompt is the same, and equals step-by-step argmax of the full
    // forward pass over the growing sequence
    let greedy = SampleOptions { temperature: 0.0, n: 2, max_new_tokens: 6, ..opts };
    let g = b.generate(&prompts()[..2], &greedy, 2, &mut |_| {}).unwrap();
    let stops = b.stop_ids();
    for (p, samples) in prompts()[..2].iter().zip(&g) {
        assert_eq!(samples[0], samples[1]);
        let mut seq = b.prompt_ids(p).unwrap();
        let mut new = Vec::new();
        for _ in 0..6 {
            let t = Tensor::new(seq.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
            let l: Vec<Vec<f32>> = b.model.logits(&t).unwrap().squeeze(0).unwrap().to_vec2().unwrap();
            let next = sample_token(l.last().unwrap(), 0.0, 1.0, 0.0);
            new.push(next);
            seq.push(next);
            if stops.contains(&next) {
                break;
            }
        }
        assert_eq!(samples[0].tokens, new.len());
        let body = if stops.contains(new.last().unwrap()) { &new[..new.len() - 1] } else { &new[..] };
        assert_eq!(samples[0].text, b.tok.decode(body).unwrap());
    }
    let bad = SampleOptions {
        top_p: 0.0,
        ..SampleOptions { n: 1, temperature: 1.0, top_p: 1.0, max_new_tokens: 1, seed: 0 }
    };
    assert!(b.generate(&prompts(), &bad, 1, &mut |_| {}).unwrap_err().to_string().contains("top_p"));
}

/// Each sample carries log π of its tokens at temperature 1 under the generating weights,
/// whatever temperature and nucleus drew it: recorded from the KV-cache path's logits, equal
/// to log-softmax of the full forward pass over prompt + response computed here in f64
/// (independent path); negative controls: the tempered distribution's log-probabilities, and
/// the log-probabilities the full pass gives the next token over (shifted by one).
#[test]
fn samples_record_their_tokens_log_probabilities_at_temperature_one() {
    let b =
        Backbone::load_with(&Source::Gguf(fixtures().join("tiny-llama-bpe.gguf")), &Device::Cpu, DType::F32, 256, true)
            .unwrap();
    // T = 0.7 records by a pass of its own; T = 1 reuses the draw's normaliser
    for temperature in [0.7, 1.0] {
        let opts = SampleOptions { n: 3, temperature, top_p: 0.9, max_new_tokens: 10, seed: 3 };
        let got = b.generate(&prompts(), &opts, 4, &mut |_| {}).unwrap();
        let (mut worst, mut tempered, mut shifted, mut count) = (0f64, 0f64, 0f64, 0usize);
        for (p, samples) in prompts().iter().zip(&got) {
            for s in samples {
                let lp = s.recorded_logprobs().expect("one log-probability per token");
                let prompt = b.prompt_ids(p).unwrap();
                let all: Vec<u32> = prompt.iter().chain(&s.ids).copied().collect();
                let t = Tensor::new(all.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
                let l: Vec<Vec<f32>> = b.model.logits(&t).unwrap().squeeze(0).unwrap().to_vec2().unwrap();
                let log_softmax = |row: &[f32], tok: u32, temp: f64| {
                    let mx = row.iter().map(|&x| x as f64 / temp).fold(f64::NEG_INFINITY, f64::max);
                    let lse = mx + row.iter().map(|&x| (x as f64 / temp - mx).exp()).sum::<f64>().ln();
                    row[tok as usize] as f64 / temp - lse
                };
                for (j, &tok) in s.ids.iter().enumerate() {
                    let row = &l[prompt.len() + j - 1];
                    let want = log_softmax(row, tok, 1.0);
                    worst = worst.max((lp[j] as f64 - want).abs());
                    tempered += (lp[j] as f64 - log_softmax(row, tok, 0.7)).abs();
                    if j + 1 < s.ids.len() {
                        shifted += (lp[j] as f64 - log_softmax(&l[prompt.len() + j], tok, 1.0)).abs();
                    }
                    count += 1;
                }
            }
        }
        assert!(count > 20, "{count} tokens");
        assert!(worst < 1e-4, "T = {temperature}: recorded vs full-pass log π: max |Δ| {worst:.2e}");
        assert!(tempered / count as f64 > 1e-2, "negative control: T = 0.7's log-probabilities differ ({tempered})");
        assert!(shifted / count as f64 > 1e-2, "negative control: the next position's differ ({shifted})");
    }
}

#[test]
fn a_model_loaded_for_features_cannot_generate() {
    let b =
        Backbone::load(&Source::Gguf(fixtures().join("tiny-llama-bpe.gguf")), &Device::Cpu, DType::F32, 64).unwrap();
    let opts = SampleOptions { n: 1, temperature: 0.0, top_p: 1.0, max_new_tokens: 2, seed: 0 };
    let e = b.generate(&prompts(), &opts, 1, &mut |_| {}).unwrap_err().to_string();
    assert!(e.contains("LM head"), "{e}");
}
