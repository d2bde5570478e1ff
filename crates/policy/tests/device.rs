//! The paths a GPU runs, on the device under test (`ONEPASS_TEST_DEVICE`, default the CPU):
//! issue 28's "differentiable on every device" checked where it runs. On a GPU:
//!
//!   ONEPASS_TEST_DEVICE=cuda cargo test --release --features cuda -p policy --test device -- --nocapture
//!
//! On the CPU these tests run both paths a GPU trains with — routed (CUDA's default) and
//! composed (`ONEPASS_GPU_KERNELS=composed`) — against the fused kernels and PyTorch's float64
//! fixture; with `cuda` the same comparisons run on the GPU's kernels (cuBLAS, candle's CUDA
//! kernels), which nothing else in the suite reaches:
//! - the decoder's log-probabilities and every adapter's gradient equal the CPU's fused path;
//! - an Adam step moves every adapter as on the CPU (no gradient is lost on the way);
//! - a reward model's loss, gradient and Hessian–vector products equal PyTorch's exact ones,
//!   and one Alg. 5 step equals the CPU's;
//! - SmolLM2's φ equals transformers' (the features fixture), and samples drawn on the device
//!   carry the log-probabilities the CPU's full pass gives their tokens.

mod common;

use candle_core::{DType, Device, Tensor};
use common::*;
use features::model::Family;
use features::sampling::SampleOptions;
use features::{Backbone, EosRule, Message, PhiOptions, Source};
use policy::batch::SeqBatch;
use policy::ops::Kernels;
use policy::rm::update::{HvpConfig, OnePass};
use policy::{LoraConfig, PolicyModel, Target};
use std::collections::HashMap;
use std::path::PathBuf;

/// The two paths a GPU trains with: routed (the default on CUDA) and composed
/// (`ONEPASS_GPU_KERNELS=composed`).
const GPU_PATHS: [Kernels; 2] = [Kernels::Routed, Kernels::Composed];

/// `m` on the device under test runs `k` (set on the CPU too, where fused is the default).
fn on_path(mut m: PolicyModel, k: Kernels) -> PolicyModel {
    m.set_kernels(k).unwrap();
    assert_eq!(m.kernels(), k);
    m
}

/// The tiny decoder on `dev` in `dtype` with every adapter's values copied from `like` (so the
/// two models differ only in where they compute).
fn tiny_on(c: &features::model::Config, w: &HashMap<String, Tensor>, dtype: DType, dev: &Device) -> PolicyModel {
    let w: HashMap<String, Tensor> =
        w.iter().map(|(k, v)| (k.clone(), v.to_dtype(dtype).unwrap().to_device(dev).unwrap())).collect();
    let lora = LoraConfig { rank: 2, alpha: 4.0, targets: Target::ALL.to_vec(), seed: 4, dropout: 0.0 };
    PolicyModel::new(w, c.clone(), &lora, 32, dtype).unwrap()
}

fn copy_vars(from: &PolicyModel, to: &PolicyModel) {
    for (a, b) in from.vars().into_iter().zip(to.vars()) {
        b.set(&a.as_tensor().to_device(to.device()).unwrap()).unwrap();
    }
}

#[test]
fn values_and_every_adapter_gradient_on_the_device_equal_the_cpus_fused_path() {
    let dev = test_device();
    let seqs: [(&[u32], &[u32]); 3] = [(&[1, 5, 3], &[9, 2, 4]), (&[4], &[10, 0, 6, 8]), (&[7, 7, 2, 1], &[3])];
    let mut worst = [[0f64; 2]; 2];
    for (family, interleaved) in [(Family::Llama, false), (Family::Llama, true), (Family::Qwen2, false)] {
        // f64: the maths (the bound is rounding); f32: what trains
        for (di, (dtype, tol)) in [(DType::F64, 1e-10), (DType::F32, 2e-4)].into_iter().enumerate() {
            let c = cfg(family, interleaved);
            let w = weights(&c, 11);
            let cpu = tiny_on(&c, &w, dtype, &Device::Cpu);
            randomize(&cpu, 13);
            assert_eq!(cpu.kernels(), Kernels::Fused);
            let (fv, fg) = values_and_gradients(&cpu, &SeqBatch::new(&seqs, &Device::Cpu).unwrap());
            for (ki, k) in GPU_PATHS.into_iter().enumerate() {
                let on = on_path(tiny_on(&c, &w, dtype, &dev), k);
                copy_vars(&cpu, &on);
                let b = SeqBatch::new(&seqs, &dev).unwrap();
                let (dv, dg) = values_and_gradients(&on, &b);
                let mut err = rel(&dv, &fv);
                assert_eq!(dg.len(), fg.len());
                for (vi, (x, y)) in dg.iter().zip(&fg).enumerate() {
                    assert!(
                        x.iter().any(|v| *v != 0.0),
                        "{family:?} {dtype:?} {k:?} on {dev:?}: adapter var {vi} has no gradient"
                    );
                    err = err.max(rel(x, y));
                }
                assert!(
                    err < tol,
                    "{family:?} interleaved={interleaved} {dtype:?} {k:?}: {dev:?} vs the CPU's fused path {err:e}"
                );
                worst[ki][di] = worst[ki][di].max(err);
                // negative control: other adapter values on the device give other values and gradients
                randomize(&on, 14);
                let (v2, g2) = values_and_gradients(&on, &b);
                assert!(rel(&v2, &fv).max(rel(&g2[1], &fg[1])) > 1e-3, "the comparison cannot see other adapters");
            }
        }
    }
    for (k, w) in GPU_PATHS.iter().zip(worst) {
        eprintln!("{dev:?} {k:?} vs the CPU's fused path, largest relative error: f64 {:e}, f32 {:e}", w[0], w[1]);
    }
}

#[test]
fn an_adam_step_on_the_device_moves_every_adapter_as_on_the_cpu() {
    use policy::adam::{Adam, AdamConfig};
    let dev = test_device();
    let c = cfg(Family::Llama, false);
    let w = weights(&c, 5);
    let seqs: [(&[u32], &[u32]); 2] = [(&[1, 5, 3], &[9, 2, 4]), (&[4, 2], &[10, 0, 6, 8])];
    let step = |m: &PolicyModel| -> Vec<Vec<f64>> {
        let b = SeqBatch::new(&seqs, m.device()).unwrap();
        let lp = m.logprobs_at(&b, true).unwrap();
        let loss = lp.sum_all().unwrap().neg().unwrap();
        let grads = loss.backward().unwrap();
        let vars = m.vars();
        let cfg = AdamConfig { lr: 1e-2, clip: None, ..Default::default() };
        let mut adam = Adam::new(cfg, &vars).unwrap();
        let before: Vec<Vec<f64>> = vars.iter().map(|v| flat64(&[v.as_tensor().clone()])).collect();
        adam.step(&vars, &grads).unwrap();
        vars.iter()
            .zip(before)
            .map(|(v, b)| flat64(&[v.as_tensor().clone()]).iter().zip(b).map(|(x, y)| x - y).collect())
            .collect()
    };
    for k in GPU_PATHS {
        let cpu = tiny_on(&c, &w, DType::F32, &Device::Cpu);
        randomize(&cpu, 3);
        let on = on_path(tiny_on(&c, &w, DType::F32, &dev), k);
        copy_vars(&cpu, &on);
        let (want, got) = (step(&cpu), step(&on));
        let mut worst = 0f64;
        for (vi, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(g.iter().any(|x| *x != 0.0), "{dev:?} {k:?}: adapter var {vi} did not move");
            // Adam's first step is ±lr wherever |g| ≫ ε: compared in norm, so an element whose
            // gradient is rounding (its sign either way) cannot decide it alone
            worst = worst.max(rel_l2(g, w));
        }
        eprintln!("{dev:?} {k:?}: Adam's first step vs the CPU's, largest relative error {worst:e}");
        assert!(worst < 1e-2, "{dev:?} {k:?}: Adam's step differs from the CPU's by {worst:e}");
    }
}

#[test]
fn a_reward_models_gradient_hvps_and_step_on_the_device_equal_pytorchs_and_the_cpus() {
    let dev = test_device();
    for ((case, full), k) in [("lora", false), ("full", true)].into_iter().flat_map(|c| GPU_PATHS.map(|k| (c, k))) {
        let fx = fixture(case);
        let pairs = fx.pairs();
        // the GPU's paths (on the CPU too)
        let on = |dtype: DType| {
            let mut rm = fixture_model_on(&fx, full, dtype, &dev);
            rm.model.set_kernels(k).unwrap();
            rm
        };
        let rm = on(DType::F64);
        let names = rm.var_names();
        let g = rm.gradient(&pairs).unwrap();
        let loss_err = (g.stats.loss - fx.loss).abs() / fx.loss.abs();
        let g_err = rel_l2(&flat64(&g.grads), &flat64(&fx.get("grad", &names, DType::F64)));
        let v = fx.get("v0", &names, DType::F64);
        let v_dev: Vec<Tensor> = v.iter().map(|t| t.to_device(&dev).unwrap()).collect();
        let exact = flat64(&fx.get("hv0", &names, DType::F64));
        let hv_err = rel_l2(&flat64(&rm.hvp(&pairs, &v_dev, 1e-5).unwrap()), &exact);
        let rm32 = on(DType::F32);
        let v32: Vec<Tensor> = v_dev.iter().map(|t| t.to_dtype(DType::F32).unwrap()).collect();
        let hv32_err = rel_l2(&flat64(&rm32.hvp(&pairs, &v32, HvpConfig::default().eps).unwrap()), &exact);
        eprintln!(
            "{case} {k:?} on {dev:?}: loss {loss_err:.1e}, gradient {g_err:.1e}, f64 HVP {hv_err:.1e}, f32 HVP {hv32_err:.1e} (vs PyTorch's exact)"
        );
        // the CPU's bounds (tests/reward.rs): one function in float64, so agreement to rounding
        assert!(loss_err < 1e-10, "{case}: loss relative error {loss_err:e}");
        assert!(g_err < 1e-9, "{case}: gradient relative error {g_err:e}");
        assert!(hv_err < 1e-7, "{case}: f64 HVP relative error {hv_err:e}");
        assert!(hv32_err < 3e-3, "{case}: f32 HVP relative error {hv32_err:e} at the default ε");
        // the R-operator's exact products (LoRA): the composed ops off the CPU, exact to rounding
        if !full {
            let (g_tape, tape) = rm.gradient_tape(&pairs).unwrap();
            let tg_err = rel_l2(&flat64(&g_tape.grads), &flat64(&fx.get("grad", &names, DType::F64)));
            let rop_err = rel_l2(&flat64(&tape.hvp(&v_dev).unwrap()), &exact);
            eprintln!(
                "{case} {k:?} on {dev:?}: R-operator gradient {tg_err:.1e}, HVP {rop_err:.1e} (vs PyTorch's exact)"
            );
            assert!(tg_err < 1e-10 && rop_err < 1e-11, "{case}: R-operator gradient {tg_err:e}, HVP {rop_err:e}");
        }
        // one step of paper Alg. 5 (K = 3 CG steps on HVPs), f64: the device's and the CPU's
        let cfg = estimators::EstimatorConfig::OmdHvpCg(Default::default());
        let after = |rm: &policy::rm::model::RewardModel| -> Vec<f64> {
            let mut up = OnePass::new(&cfg, rm, Some(10), HvpConfig { eps: 1e-5, ..Default::default() }, 1.0).unwrap();
            let before = flat64(&rm.vars().iter().map(|v| v.as_tensor().copy().unwrap()).collect::<Vec<_>>());
            let s = up.step(rm, &pairs).unwrap();
            assert!(s.hvps > 0, "{case}: Alg. 5 took no HVP");
            let now = flat64(&rm.vars().iter().map(|v| v.as_tensor().copy().unwrap()).collect::<Vec<_>>());
            now.iter().zip(before).map(|(x, y)| x - y).collect()
        };
        let cpu = fixture_model(&fx, full, DType::F64);
        let (want, got) = (after(&cpu), after(&rm));
        let step_err = rel_l2(&got, &want);
        eprintln!("{case} {k:?} on {dev:?}: an Alg. 5 step vs the CPU's, relative error {step_err:.1e}");
        assert!(want.iter().any(|x| *x != 0.0) && step_err < 1e-6, "{case}: step relative error {step_err:e}");
    }
}

fn smollm2() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(p.exists(), "{} is missing: run `just fetch-models` first", p.display());
    p
}

fn features_fixture(name: &str) -> serde_json::Value {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../features/tests/fixtures").join(name);
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

/// φ of SmolLM2 on the device against transformers' (the features crate's fixture: its first
/// cases, batched as a run batches them), at the CPU test's bounds.
#[test]
fn smollm2_phi_on_the_device_matches_transformers() {
    let dev = test_device();
    let b = Backbone::load(&Source::Gguf(smollm2()), &dev, DType::F32, 2048).unwrap();
    let f = features_fixture("smollm2_phi.json");
    let convs = features_fixture("smollm2_conversations.json");
    let opts = PhiOptions { eos_rule: EosRule::Plain, max_len: 2048, ..Default::default() };
    let cases = f["cases"].as_array().unwrap();
    let mut prepared = Vec::new();
    for c in cases {
        let (ds, row) = (c["dataset"].as_str().unwrap(), c["row"].as_u64().unwrap());
        let conv = convs["conversations"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["dataset"] == ds && x["row"].as_u64() == Some(row))
            .unwrap();
        let msgs: Vec<Message> = serde_json::from_value(conv["messages"].clone()).unwrap();
        prepared.push(b.prepare(&msgs, &opts).unwrap());
    }
    let refs: Vec<&_> = prepared.iter().collect();
    let got = b.features(&refs, &opts).unwrap();
    let (mut worst_cos, mut worst_rel) = (1f64, 0f64);
    for (c, phi) in cases.iter().zip(&got) {
        let want: Vec<f32> = serde_json::from_value(c["phi"].clone()).unwrap();
        let dot: f64 = phi.iter().zip(&want).map(|(a, b)| f64::from(a * b)).sum();
        let n = |v: &[f32]| v.iter().map(|x| f64::from(x * x)).sum::<f64>().sqrt();
        let cos = dot / (n(phi) * n(&want));
        let rel = phi.iter().zip(&want).map(|(a, b)| f64::from((a - b).abs())).fold(0.0, f64::max)
            / want.iter().map(|x| f64::from(x.abs())).fold(0.0, f64::max);
        worst_cos = worst_cos.min(cos);
        worst_rel = worst_rel.max(rel);
    }
    eprintln!(
        "SmolLM2 φ on {dev:?} vs transformers over {} cases: min cos {worst_cos}, max rel {worst_rel:e}",
        cases.len()
    );
    assert!(worst_cos > 0.9999 && worst_rel < 1e-3, "cos {worst_cos}, rel {worst_rel}");
}

/// Samples drawn on the device (KV cache, T = 1) carry log π of their tokens as the CPU's full
/// forward pass over prompt + response computes it. Negative control: the next position's
/// log-probabilities differ.
#[test]
fn samples_drawn_on_the_device_carry_the_cpus_log_probabilities() {
    let dev = test_device();
    let on = Backbone::load_with(&Source::Gguf(smollm2()), &dev, DType::F32, 512, true).unwrap();
    let cpu = Backbone::load_with(&Source::Gguf(smollm2()), &Device::Cpu, DType::F32, 512, true).unwrap();
    let prompts: Vec<Vec<Message>> = ["Name a fruit.", "What is 2 + 2?", "Write a haiku about rain."]
        .iter()
        .map(|p| vec![Message::new("user", p)])
        .collect();
    let opts = SampleOptions { n: 2, temperature: 1.0, top_p: 1.0, max_new_tokens: 24, seed: 7 };
    let got = on.generate(&prompts, &opts, 3, &mut |_| {}).unwrap();
    let (mut worst, mut shifted, mut count) = (0f64, 0f64, 0usize);
    for (p, samples) in prompts.iter().zip(&got) {
        for s in samples {
            let lp = s.recorded_logprobs().expect("one log-probability per token");
            let prompt = cpu.prompt_ids(p).unwrap();
            let all: Vec<u32> = prompt.iter().chain(&s.ids).copied().collect();
            let t = Tensor::new(all.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
            let l: Vec<Vec<f32>> = cpu.model.logits(&t).unwrap().squeeze(0).unwrap().to_vec2().unwrap();
            let log_softmax = |row: &[f32], tok: u32| {
                let mx = row.iter().map(|&x| x as f64).fold(f64::NEG_INFINITY, f64::max);
                row[tok as usize] as f64 - mx - row.iter().map(|&x| (x as f64 - mx).exp()).sum::<f64>().ln()
            };
            for (j, &tok) in s.ids.iter().enumerate() {
                worst = worst.max((lp[j] as f64 - log_softmax(&l[prompt.len() + j - 1], tok)).abs());
                if j + 1 < s.ids.len() {
                    shifted += (lp[j] as f64 - log_softmax(&l[prompt.len() + j], tok)).abs();
                }
                count += 1;
            }
        }
    }
    eprintln!("{dev:?}: {count} sampled tokens, recorded vs the CPU's full pass: max |Δ log π| {worst:.2e}");
    assert!(count > 30, "{count} tokens");
    assert!(worst < 2e-3, "{dev:?}: recorded vs the CPU's log π: max |Δ| {worst:e}");
    assert!(shifted / count as f64 > 1e-2, "negative control: the next position's differ ({shifted})");
}

/// Three RLOO updates (scoring the rollouts without a graph, the clipped ratio, Adam) on the
/// device move the adapters as on the CPU's fused path; the policy moved (the later
/// updates see a k1 KL ≠ 0: these rollouts are fixed, not the policy's samples, so it may be negative). The whole update path of a learning arm, where the paper's presets run;
/// in f32, what the update takes (its per-token tensors are f32).
#[test]
fn rloo_updates_on_the_device_follow_the_cpus() {
    use policy::adam::{Adam, AdamConfig, LrWindow};
    use policy::train::{rloo_update, KlEstimator, KlPenalty, RewardNorm, RlooConfig, Rollout};
    let dev = test_device();
    let c = cfg(Family::Qwen2, false);
    let w = weights(&c, 9);
    let prompts: [&[u32]; 2] = [&[1, 5], &[2, 7, 3]];
    let responses: [&[u32]; 6] = [&[3, 3], &[9, 1, 2], &[4], &[6, 3], &[1, 2, 4], &[9, 9]];
    let rollouts: Vec<Rollout> = (0..6).map(|i| Rollout { prompt: prompts[i / 3], response: responses[i] }).collect();
    let rewards = [1.0, -1.0, 0.0, 0.5, 2.0, -2.0];
    let cfg = RlooConfig {
        kl_coef: 0.05,
        kl: KlEstimator::K1,
        kl_penalty: KlPenalty::Token,
        reward_norm: RewardNorm::None,
        clip: Some(0.2),
        epochs: 2,
        minibatch: 3,
        normalize_advantages: true,
        lr_window: LrWindow::Update,
        seed: 4,
    };
    let run_with = |m: &PolicyModel, rewards: &[f64]| -> (Vec<f64>, f64) {
        let vars = m.vars();
        let mut opt = Adam::new(AdamConfig { lr: 0.02, ..Default::default() }, &vars).unwrap();
        let mut kl = 0.0;
        for _ in 0..3 {
            kl = rloo_update(m, &mut opt, &rollouts, rewards, 3, &cfg).unwrap().kl;
        }
        (flat64(&vars.iter().map(|v| v.as_tensor().clone()).collect::<Vec<_>>()), kl)
    };
    let run = |m: &PolicyModel| run_with(m, &rewards);
    for k in GPU_PATHS {
        let cpu = cpu_start(&c, &w);
        let on = on_path(tiny_on(&c, &w, DType::F32, &dev), k);
        copy_vars(&cpu, &on);
        let start = flat64(&on.vars().iter().map(|v| v.as_tensor().clone()).collect::<Vec<_>>());
        let ((want, kl_cpu), (got, kl_dev)) = (run(&cpu), run(&on));
        let moved: Vec<f64> = got.iter().zip(&start).map(|(a, b)| a - b).collect();
        let moved_cpu: Vec<f64> = want.iter().zip(&start).map(|(a, b)| a - b).collect();
        let err = rel_l2(&moved, &moved_cpu);
        eprintln!(
        "{dev:?} {k:?}: 3 RLOO updates vs the CPU's, relative error of the adapters' move {err:e}; KL {kl_dev} vs {kl_cpu}"
    );
        assert!(kl_dev != 0.0 && (kl_dev - kl_cpu).abs() <= 1e-3 * kl_cpu.abs(), "KL {kl_dev} vs {kl_cpu}");
        // 12 Adam steps divide each gradient by its own running scale, so a component whose
        // gradient is near 0 moves by O(lr) whatever its rounding: the paths' different
        // summation orders show up here amplified (about 1e-3 with candle's AVX-512 gemm on an
        // AMX Xeon, where the KL still agrees to 2e-5), while other rewards move the adapters
        // 1e-1 away or more (the negative control below)
        assert!(err < 1e-2, "{dev:?}: the adapters moved differently: {err:e}");
        // negative control: other rewards move the adapters elsewhere
        let other = on_path(tiny_on(&c, &w, DType::F32, &dev), k);
        copy_vars(&cpu_start(&c, &w), &other);
        let reversed: Vec<f64> = rewards.iter().rev().copied().collect();
        let (got2, _) = run_with(&other, &reversed);
        let moved2: Vec<f64> = got2.iter().zip(&start).map(|(a, b)| a - b).collect();
        assert!(rel_l2(&moved2, &moved_cpu) > 1e-1, "the comparison cannot see other rewards");
    }
}

/// The tiny policy's adapters as the RLOO test starts them (B random, A from the seed).
fn cpu_start(c: &features::model::Config, w: &HashMap<String, Tensor>) -> PolicyModel {
    let m = tiny_on(c, w, DType::F32, &Device::Cpu);
    randomize(&m, 3);
    m
}
