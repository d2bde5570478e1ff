//! Against a real vLLM server (issue "past one machine"): `just test-vllm` builds the venv,
//! converts SmolLM2's GGUF to a transformers directory, serves it on the CPU and runs these with
//! `ONEPASS_VLLM_URL` set; plain `cargo test` skips them (`#[ignore]`).
//!
//! 1. Samples drawn by the server (`generate.backend = "openai"`) score under onepass's own
//!    model — the same GGUF, the prompts templated and tokenised by onepass, the completions'
//!    token ids as the server sampled them — with the log-probabilities the server returned,
//!    token by token within a stated tolerance; the same tokens scored after another prompt
//!    are the negative control.
//! 2. An adapter onepass trained, pushed to the server with vLLM's runtime LoRA API, samples
//!    tokens whose server log-probabilities are onepass's adapted model's within the same
//!    tolerance; the base model's log-probabilities of those tokens are the negative control.
//! 3. A deploy run on the server's samples end to end: its bank is the server's, cached under
//!    a key with the backend, and a second run reads the cache without asking the server; and a
//!    short online run (2 chunks, rloo) whose policy samples from its adapter on the server,
//!    then reruns with no server at all, every sample from the cache.
//! 4. Generation throughput on the deploy mini's shape, the server against onepass's sampler
//!    (printed: a CPU figure that says nothing about GPUs).

mod util;

use candle_core::{DType, Device};
use features::extract::{Backbone, Source};
use features::sampling::SampleOptions;
use features::Message;
use policy::batch::SeqBatch;
use policy::{LoraConfig, PolicyModel};

fn server() -> features::openai::Server {
    let url = std::env::var("ONEPASS_VLLM_URL").expect("ONEPASS_VLLM_URL: run `just test-vllm`");
    let model = std::env::var("ONEPASS_VLLM_MODEL").unwrap_or_else(|_| "smol".into());
    features::openai::Server { base_url: url, model, concurrency: 4, timeout_s: 120.0, retries: 2 }
}

fn prompts() -> Vec<Vec<Message>> {
    ["Name three primary colours.", "What is 12 times 7?", "Write a haiku about rain.", "Say hello in French."]
        .iter()
        .map(|q| vec![Message { role: "user".into(), content: (*q).into() }])
        .collect()
}

/// Per-token log π of `response` after `prompt` under the GGUF's own model (f32, no adapter).
fn onepass_logprobs(m: &PolicyModel, prompt: &[u32], response: &[u32]) -> Vec<f32> {
    let b = SeqBatch::new(&[(prompt, response)], &Device::Cpu).unwrap();
    m.logprobs_at(&b, false).unwrap().to_vec1::<f32>().unwrap()
}

#[test]
#[ignore = "needs a vLLM server: just test-vllm"]
fn server_samples_score_as_the_server_scored_them() {
    let s = server();
    s.check().unwrap();
    let path = util::smollm2();
    let b = Backbone::load_with(&Source::parse(&path).unwrap(), &Device::Cpu, DType::F32, 1024, true).unwrap();
    let opts = SampleOptions { n: 3, temperature: 1.0, top_p: 1.0, max_new_tokens: 24, seed: 7 };
    let ps = prompts();
    let samples = b.generate_remote(&s, &s.model, &ps, &opts, &mut |_| {}).unwrap();
    // the server's own log-probs, asked again for the same requests (same seeds: same samples)
    let ids: Vec<Vec<u32>> = ps.iter().map(|p| b.prompt_ids(p).unwrap()).collect();
    let g = features::gguf::Gguf::read_with(std::path::Path::new(&path), &Device::Cpu, DType::F32, true).unwrap();
    let m = PolicyModel::new(g.tensors, g.cfg, &LoraConfig::default(), 1024, DType::F32).unwrap();
    let (mut worst, mut n, mut control) = (0f32, 0usize, Vec::new());
    for (i, (p, ss)) in ids.iter().zip(&samples).enumerate() {
        let seeds = [features::openai::Request { ids: p, seed: remote_seed(&b, &ps[i], &opts) }];
        let server_side = s.complete(&s.model, &seeds, &opts, &b.stop_ids(), &|_| {}).unwrap().remove(0);
        for (sample, theirs) in ss.iter().zip(&server_side) {
            assert_eq!(sample.ids, theirs.ids, "prompt {i}: the same seed gave other tokens");
            assert_eq!(theirs.logprobs.len(), sample.ids.len(), "prompt {i}: a log-prob per sampled token");
            let ours = onepass_logprobs(&m, p, &sample.ids);
            for (a, b) in ours.iter().zip(&theirs.logprobs) {
                worst = worst.max((a - b).abs());
                n += 1;
            }
            // negative control: the same tokens after another prompt
            let other = &ids[(i + 1) % ids.len()];
            let shifted = onepass_logprobs(&m, other, &sample.ids);
            let d: f32 = shifted.iter().zip(&theirs.logprobs).map(|(a, b)| (a - b).abs()).sum::<f32>();
            control.push(d / shifted.len() as f32);
        }
    }
    eprintln!("{n} tokens: max |log π onepass − log π server| = {worst:.2e}; control mean {:.3}", mean(&control));
    assert!(n >= 12, "only {n} tokens compared");
    assert!(worst <= 5e-4, "max |Δ log π| = {worst}: onepass does not score the server's samples as it did");
    assert!(mean(&control) > 100.0 * 5e-4, "the control (another prompt) agrees too: {:?}", control);
}

#[test]
#[ignore = "needs a vLLM server: just test-vllm"]
fn a_pushed_adapter_samples_as_onepass_adapted_model_scores() {
    use rand::{Rng, SeedableRng};
    let s = server();
    let path = util::smollm2();
    let b = Backbone::load_with(&Source::parse(&path).unwrap(), &Device::Cpu, DType::F32, 1024, true).unwrap();
    let g = features::gguf::Gguf::read_with(std::path::Path::new(&path), &Device::Cpu, DType::F32, true).unwrap();
    let lora = LoraConfig { rank: 8, alpha: 16.0, ..LoraConfig::default() };
    let m = PolicyModel::new(g.tensors, g.cfg, &lora, 1024, DType::F32).unwrap();
    // B away from 0, so the adapter moves every adapted product
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    let values: Vec<Vec<f32>> = m
        .var_values()
        .unwrap()
        .into_iter()
        .enumerate()
        .map(|(i, v)| if i % 2 == 1 { v.iter().map(|_| rng.random_range(-0.05..0.05)).collect() } else { v })
        .collect();
    m.set_var_values(&values).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (st, cfg) = policy::peft::encode(&m, &path).unwrap();
    std::fs::write(dir.path().join("adapter_model.safetensors"), st).unwrap();
    std::fs::write(dir.path().join("adapter_config.json"), cfg).unwrap();
    let name = format!("onepass-test-{}", &m.digest().unwrap()[..12]);
    s.load_adapter(&name, dir.path()).unwrap();
    let opts = SampleOptions { n: 2, temperature: 1.0, top_p: 1.0, max_new_tokens: 24, seed: 3 };
    let ps = prompts();
    let ids: Vec<Vec<u32>> = ps.iter().map(|p| b.prompt_ids(p).unwrap()).collect();
    let reqs: Vec<features::openai::Request<'_>> =
        ids.iter().enumerate().map(|(i, p)| features::openai::Request { ids: p, seed: 100 + i as u64 }).collect();
    let got = s.complete(&name, &reqs, &opts, &b.stop_ids(), &|_| {}).unwrap();
    s.unload_adapter(&name).unwrap();
    // per token: |Δ log π| and the k1 estimate of KL(server ‖ model) = E_{y ~ server}[log p_server(y)
    // − log p_model(y)] over the server's own samples, for onepass's adapted model and the base
    let (mut worst, mut n, mut control) = (0f32, 0usize, Vec::new());
    let (mut kl, mut kl_base) = (0f64, 0f64);
    for (p, cs) in ids.iter().zip(&got) {
        for c in cs {
            let bt = SeqBatch::new(&[(p.as_slice(), c.ids.as_slice())], &Device::Cpu).unwrap();
            let adapted = m.logprobs_at(&bt, true).unwrap().to_vec1::<f32>().unwrap();
            let base = m.logprobs_at(&bt, false).unwrap().to_vec1::<f32>().unwrap();
            for ((a, t), z) in adapted.iter().zip(&c.logprobs).zip(&base) {
                worst = worst.max((a - t).abs());
                kl += f64::from(t - a);
                kl_base += f64::from(t - z);
                n += 1;
            }
            let d: f32 = base.iter().zip(&c.logprobs).map(|(a, t)| (a - t).abs()).sum();
            control.push(d / base.len() as f32);
        }
    }
    let (kl, kl_base) = (kl / n as f64, kl_base / n as f64);
    eprintln!(
        "{n} tokens from the adapter: max |log π onepass adapted − server| = {worst:.2e}; KL(server ‖ onepass adapted) ≈ {kl:.2e}/token, KL(server ‖ base) ≈ {kl_base:.3}/token (k1 over the server's samples); base mean |Δ| {:.3}",
        mean(&control)
    );
    assert!(n >= 12, "only {n} tokens compared");
    assert!(worst <= 5e-4, "max |Δ log π| = {worst}: the server's adapter is not onepass's");
    assert!(kl.abs() <= 5e-4, "KL(server ‖ onepass adapted) ≈ {kl} per token");
    assert!(mean(&control) > 100.0 * 5e-4, "the base model scores like the adapter: {control:?}");
    assert!(kl_base > 10.0 * 5e-4, "the negative control: KL(server ‖ base) ≈ {kl_base} per token");
}

/// Generation throughput on the deploy mini's shape (16 prompts × 8 samples, T = 1, ≤ 64 new
/// tokens): the vLLM CPU server against onepass's own sampler, one run each on this machine's
/// threads. A CPU figure: it says nothing about vLLM on a GPU.
#[test]
#[ignore = "needs a vLLM server: just test-vllm"]
fn generation_throughput_on_the_deploy_minis_shape() {
    let s = server();
    let path = util::smollm2();
    let b = Backbone::load_with(&Source::parse(&path).unwrap(), &Device::Cpu, DType::F32, 1024, true).unwrap();
    let text = std::fs::read_to_string(util::root().join("datasets/prompts/prompts.jsonl")).unwrap();
    let ps: Vec<Vec<Message>> = text
        .lines()
        .take(16)
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            vec![Message { role: "user".into(), content: v["prompt"].as_str().unwrap().to_string() }]
        })
        .collect();
    let opts = SampleOptions { n: 8, temperature: 1.0, top_p: 1.0, max_new_tokens: 64, seed: 1 };
    let tokens = |out: &[Vec<features::generate::Sample>]| out.iter().flatten().map(|x| x.tokens).sum::<usize>();
    let t0 = std::time::Instant::now();
    let ours = b.generate(&ps, &opts, 8, &mut |_| {}).unwrap();
    let t_ours = t0.elapsed().as_secs_f64();
    let t1 = std::time::Instant::now();
    let theirs = b.generate_remote(&s, &s.model, &ps, &opts, &mut |_| {}).unwrap();
    let t_theirs = t1.elapsed().as_secs_f64();
    let (r_ours, r_theirs) = (tokens(&ours) as f64 / t_ours, tokens(&theirs) as f64 / t_theirs);
    eprintln!(
        "deploy mini's shape, f32, {} threads: onepass {r_ours:.0} tok/s ({} tokens, {t_ours:.1} s); vLLM CPU server {r_theirs:.0} tok/s ({} tokens, {t_theirs:.1} s); onepass / vLLM = {:.2}x",
        std::env::var("RAYON_NUM_THREADS").unwrap_or_default(),
        tokens(&ours),
        tokens(&theirs),
        r_ours / r_theirs
    );
    assert!(ours.iter().chain(&theirs).all(|x| x.len() == 8), "8 samples per prompt from both");
}

fn mean(v: &[f32]) -> f32 {
    v.iter().sum::<f32>() / v.len().max(1) as f32
}

/// The seed `generate_remote` sends for `prompt` (recomputed to ask the server again).
fn remote_seed(_b: &Backbone, prompt: &[Message], opts: &SampleOptions) -> u64 {
    let mut h = blake3::Hasher::new();
    h.update(b"onepass-remote-sample");
    h.update(&opts.seed.to_le_bytes());
    h.update(&features::cache::text_key(prompt));
    u64::from_le_bytes(h.finalize().as_bytes()[..8].try_into().unwrap())
}

#[test]
#[ignore = "needs a vLLM server: just test-vllm"]
fn a_deploy_run_on_the_servers_samples() {
    let s = server();
    let dir = tempfile::tempdir().unwrap();
    let file_prompts = dir.path().join("prompts.jsonl");
    let lines: Vec<String> = prompts()
        .iter()
        .chain(prompts().iter())
        .enumerate()
        .map(|(i, p)| serde_json::json!({"prompt": format!("{} ({i})", p[0].content)}).to_string())
        .collect();
    std::fs::write(&file_prompts, lines.join("\n")).unwrap();
    let model = util::smollm2();
    let spec = format!(
        r#"setting = "deploy"
seeds = 1
[env]
kind = "generated"
eval_pairs = 20
[stream]
samples = 8
eval_every = 4
[deploy]
strategies = ["best-worst"]
chunks = 2
[generate]
prompts = "{p}"
policy = "{model}"
n = 3
max_new_tokens = 16
backend = "openai"
base_url = "{url}"
server_model = "{name}"
cache = "{cache}/gen"
[features]
model = "{model}"
max_len = 256
cache = "{cache}/phi"
[oracle]
kind = "linear"
seed = 3
[[estimator]]
kind = "sgd"
lr = 0.5
"#,
        p = file_prompts.display(),
        url = s.base_url,
        name = s.model,
        cache = dir.path().display(),
    );
    let file = dir.path().join("spec.toml");
    std::fs::write(&file, spec).unwrap();
    let out = dir.path().join("results");
    let run = |tag: &str| {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_onepass"))
            .args(["run", file.to_str().unwrap(), "--out", out.join(tag).to_str().unwrap(), "--threads", "1"])
            .output()
            .unwrap();
        assert!(o.status.success(), "{tag}: {}", String::from_utf8_lossy(&o.stderr));
        let run_dir = std::fs::read_dir(out.join(tag)).unwrap().next().unwrap().unwrap().path();
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(run_dir.join("meta.json")).unwrap()).unwrap();
        meta
    };
    let first = run("a");
    let bank = &first["generated"];
    assert_eq!(bank["generated_prompts"].as_u64(), Some(8), "{bank}");
    // the cache's description names the backend and the served model
    let describe = walk(&dir.path().join("gen")).into_iter().find(|p| p.ends_with("describe.json")).unwrap();
    let d: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(describe).unwrap()).unwrap();
    assert_eq!((d["backend"].as_str(), d["server_model"].as_str()), (Some("openai"), Some(s.model.as_str())));
    // a second run asks the server nothing: every prompt from the cache
    let second = run("b");
    assert_eq!(second["generated"]["generation_cache_hits"].as_u64(), Some(8), "{}", second["generated"]);
}

#[test]
#[ignore = "needs a vLLM server: just test-vllm"]
fn an_online_run_samples_its_policy_from_the_server() {
    let s = server();
    let dir = tempfile::tempdir().unwrap();
    let file_prompts = dir.path().join("prompts.jsonl");
    let lines: Vec<String> = (0..6)
        .map(|i| serde_json::json!({"prompt": format!("{} ({i})", prompts()[i % 4][0].content)}).to_string())
        .collect();
    std::fs::write(&file_prompts, lines.join("\n")).unwrap();
    let model = util::smollm2();
    let spec = format!(
        r#"setting = "deploy"
seeds = 1
[env]
kind = "generated"
eval_pairs = 10
[stream]
batch_size = 2
[deploy]
strategies = ["best-worst"]
chunks = 2
policy = ["rloo"]
[generate]
prompts = "{p}"
policy = "{model}"
n = 2
max_new_tokens = 8
backend = "openai"
base_url = "{url}"
server_model = "{name}"
cache = "{cache}/gen"
[features]
model = "{model}"
max_len = 128
cache = "{cache}/phi"
[oracle]
kind = "linear"
seed = 3
[policy]
rank = 8
alpha = 16.0
lr = 5e-3
eval_prompts = 2
[[estimator]]
kind = "sgd"
lr = 0.5
"#,
        p = file_prompts.display(),
        url = s.base_url,
        name = s.model,
        cache = dir.path().display(),
    );
    let file = dir.path().join("spec.toml");
    std::fs::write(&file, spec).unwrap();
    let out = dir.path().join("results");
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_onepass"))
        .args(["run", file.to_str().unwrap(), "--out", out.to_str().unwrap(), "--threads", "1"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let run_dir = std::fs::read_dir(&out).unwrap().next().unwrap().unwrap().path();
    let policy = runner::results::read_policy(&run_dir).unwrap();
    assert_eq!(policy.len(), 3, "chunks 0, 1 and 2 evaluated: {policy:?}");
    // after an update the policy is its adapter on the server: its digest moved, and the
    // adapters written for the server are the ones the cell loaded
    let digests: Vec<&str> = policy.iter().map(|(_, r)| r.policy_digest.as_str()).collect();
    assert_ne!(digests[0], digests[2], "the policy did not move");
    let served: Vec<String> = std::fs::read_dir(dir.path().join("gen/adapters"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        digests[1..].iter().all(|d| served.iter().any(|n| n.ends_with(&d[..16]))),
        "an evaluated policy whose adapter was not pushed: {digests:?} vs {served:?}"
    );
    // each evaluation names what it sampled from: the served model before any update, then
    // the cell's adapter carrying the policy's digest
    assert_eq!(policy[0].1.served_as, s.model);
    for (_, r) in &policy[1..] {
        assert!(r.served_as.starts_with("onepass-") && r.served_as.ends_with(&r.policy_digest[..16]), "{r:?}");
    }
    // the server applies the adapter: onepass measures no merge
    assert!(policy[2].1.merge_error.is_nan(), "{:?}", policy[2].1);
    // a rerun asks the server nothing: every sample — the bank's, each chunk's and each
    // evaluation's from each adapter — comes from the generation cache, so it runs with no
    // server at all and evaluates the same policies on the same samples
    let dead = std::fs::read_to_string(&file).unwrap().replace(&s.base_url, "http://127.0.0.1:9");
    std::fs::write(&file, dead).unwrap();
    let again = dir.path().join("again");
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_onepass"))
        .args(["run", file.to_str().unwrap(), "--out", again.to_str().unwrap(), "--threads", "1"])
        .output()
        .unwrap();
    assert!(o.status.success(), "the rerun asked the server: {}", String::from_utf8_lossy(&o.stderr));
    let rerun_dir = std::fs::read_dir(&again).unwrap().next().unwrap().unwrap().path();
    let rerun = runner::results::read_policy(&rerun_dir).unwrap();
    let key =
        |r: &runner::rows::PolicyRow| (r.policy_digest.clone(), r.sample_reward.to_bits(), r.response_tokens.to_bits());
    assert_eq!(
        policy.iter().map(|(_, r)| key(r)).collect::<Vec<_>>(),
        rerun.iter().map(|(_, r)| key(r)).collect::<Vec<_>>()
    );
    // policy.dtype = "bf16" changes the updates' products, not who samples: the unmoved
    // policy's rollouts are still the served model's bank, not a zero adapter pushed to the
    // server
    let live = std::fs::read_to_string(&file).unwrap().replace("http://127.0.0.1:9", &s.base_url);
    std::fs::write(&file, live.replace("[policy]\n", "[policy]\ndtype = \"bf16\"\n")).unwrap();
    let bf16 = dir.path().join("bf16");
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_onepass"))
        .args(["run", file.to_str().unwrap(), "--out", bf16.to_str().unwrap(), "--threads", "1"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let bf16_dir = std::fs::read_dir(&bf16).unwrap().next().unwrap().unwrap().path();
    let t = util::table(&bf16_dir.join("policy_updates.parquet"));
    let (chunk, served) = (util::u64s(&t, "chunk"), util::strs(&t, "rollout_served_as"));
    let first = (0..chunk.len()).find(|&i| chunk[i] == 1).expect("the first update");
    assert_eq!(served[first], s.model, "the unmoved bf16 policy's rollouts were not the bank's");
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}
