//! LoRA on a tiny random decoder: the differentiable path gives the inference path's logits
//! (`features::model::Model`, itself checked against transformers), adapters on the side give
//! the logits of the merged weights, and backpropagation gives the gradients of central
//! differences (in f64).

mod common;

use candle_core::{DType, Device, Tensor};
use common::*;
use features::model::Family;
use policy::{LoraConfig, PolicyModel, Target};
use std::collections::HashMap;

#[test]
fn base_and_merged_logits_match_the_inference_path() {
    for (family, interleaved) in [(Family::Llama, false), (Family::Llama, true), (Family::Qwen2, false)] {
        let c = cfg(family, interleaved);
        let w = weights(&c, 3);
        let lora = LoraConfig { rank: 2, alpha: 4.0, targets: Target::ALL.to_vec(), seed: 1, dropout: 0.0 };
        let m = PolicyModel::new(w.clone(), c.clone(), &lora, 32, DType::F32).unwrap();
        let got: Vec<f32> = m.forward(&ids()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let want = inference_logits(&w, &c, &ids());
        assert!(
            max_rel(&got, &want) < 1e-5,
            "{family:?} {interleaved}: B = 0 gives the base model: {}",
            max_rel(&got, &want)
        );
        // adapters on the side vs merged into the weights
        randomize(&m, 9);
        let side: Vec<f32> = m.forward(&ids()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let merged = inference_logits(&m.merged_weights().unwrap(), &c, &ids());
        assert!(max_rel(&side, &merged) < 1e-5, "{family:?}: side vs merged {}", max_rel(&side, &merged));
        // negative control: the adapters changed the logits
        assert!(max_rel(&side, &want) > 1e-3, "{family:?}: the adapters did nothing");
    }
}

/// ∂/∂θ of Σ log π over the masked tokens, by backpropagation and by central differences.
/// Both RoPE layouts (llama.cpp's interleaved rows, Hugging Face's rotate-half with Qwen2's
/// biases): every fused op's hand-written gradient is on the path.
#[test]
fn adapter_gradients_equal_central_differences() {
    for (family, interleaved) in [(Family::Llama, true), (Family::Qwen2, false)] {
        gradients_equal_central_differences(family, interleaved);
    }
}

fn gradients_equal_central_differences(family: Family, interleaved: bool) {
    let c = cfg(family, interleaved);
    let w: HashMap<String, Tensor> =
        weights(&c, 4).into_iter().map(|(k, v)| (k, v.to_dtype(DType::F64).unwrap())).collect();
    let lora = LoraConfig {
        rank: 2,
        alpha: 3.0,
        targets: vec![Target::QProj, Target::VProj, Target::DownProj],
        seed: 2,
        dropout: 0.0,
    };
    let m = PolicyModel::new(w, c, &lora, 32, DType::F64).unwrap();
    randomize(&m, 5);
    let ids = ids();
    let mask = Tensor::from_vec(vec![0f64, 0., 1., 1., 1., 0., 0., 0., 1., 1., 0., 1.], (2, 6), &Device::Cpu).unwrap();
    let loss = |m: &PolicyModel| -> Tensor {
        let lp = token_logprobs(&m.forward(&ids).unwrap(), &ids).unwrap();
        masked_sum(&lp, &mask).unwrap().sum_all().unwrap()
    };
    let grads = loss(&m).backward().unwrap();
    let mut checked = 0;
    for (vi, var) in m.vars().into_iter().enumerate() {
        let g: Vec<f64> = grads.get(var.as_tensor()).expect("a gradient").flatten_all().unwrap().to_vec1().unwrap();
        let base: Vec<f64> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        for k in [0, base.len() / 2, base.len() - 1] {
            let at = |d: f64| {
                let mut v = base.clone();
                v[k] += d;
                var.set(&Tensor::from_vec(v, var.as_tensor().shape(), &Device::Cpu).unwrap()).unwrap();
                loss(&m).to_scalar::<f64>().unwrap()
            };
            let h = 1e-5;
            let fd = (at(h) - at(-h)) / (2.0 * h);
            var.set(&Tensor::from_vec(base.clone(), var.as_tensor().shape(), &Device::Cpu).unwrap()).unwrap();
            assert!(
                (fd - g[k]).abs() <= 1e-6 * (1.0 + fd.abs()),
                "var {vi} [{k}]: backprop {} vs differences {fd}",
                g[k]
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 3 * 2 * 2 * 3, "every adapter's A and B checked");
}

/// The response-only path (hidden states gathered at the response positions, then the LM
/// head) gives the full path's token log-probabilities, summed per sequence; with adapters off
/// it gives the base model's; and its gradients equal those of the full path.
#[test]
fn response_logprobs_equal_the_full_path_and_adapters_off_is_the_base_model() {
    let c = cfg(Family::Qwen2, false);
    let w: HashMap<String, Tensor> =
        weights(&c, 6).into_iter().map(|(k, v)| (k, v.to_dtype(DType::F64).unwrap())).collect();
    let lora = LoraConfig { rank: 2, alpha: 4.0, targets: Target::ALL.to_vec(), seed: 3, dropout: 0.0 };
    let m = PolicyModel::new(w.clone(), c.clone(), &lora, 32, DType::F64).unwrap();
    randomize(&m, 8);
    let seqs: [(&[u32], &[u32]); 3] = [(&[1, 5, 3], &[9, 2]), (&[4], &[10, 0, 6, 8]), (&[7, 7, 2, 1], &[3])];
    let b = policy::batch::SeqBatch::new(&seqs, &Device::Cpu).unwrap();
    let fast = |m: &PolicyModel, adapters: bool| b.seq_sum(&m.logprobs_at(&b, adapters).unwrap()).unwrap();
    // independent: each sequence alone through the full logits, log-softmax by hand
    let slow = |m: &PolicyModel| -> Vec<f64> {
        seqs.iter()
            .map(|(p, r)| {
                let all: Vec<u32> = p.iter().chain(r.iter()).copied().collect();
                let t = all.len();
                let ids = Tensor::from_vec(all.clone(), (1, t), &Device::Cpu).unwrap();
                let logits: Vec<Vec<f64>> = m.forward(&ids).unwrap().squeeze(0).unwrap().to_vec2().unwrap();
                (p.len()..t)
                    .map(|j| {
                        let row = &logits[j - 1];
                        let mx = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                        let lse = mx + row.iter().map(|x| (x - mx).exp()).sum::<f64>().ln();
                        row[all[j] as usize] - lse
                    })
                    .sum()
            })
            .collect()
    };
    let got: Vec<f64> = fast(&m, true).to_vec1().unwrap();
    let want = slow(&m);
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() < 1e-10 * (1.0 + w.abs()), "{got:?} vs {want:?}");
    }
    assert_eq!(b.seq_sums(&m.logprobs_at(&b, true).unwrap()).unwrap().len(), 3);
    // adapters off: the base model (a model built without adapters on any layer)
    let plain = PolicyModel::new(w, c, &LoraConfig { targets: vec![], ..lora.clone() }, 32, DType::F64).unwrap();
    let off: Vec<f64> = fast(&m, false).to_vec1().unwrap();
    let base = slow(&plain);
    for (g, w) in off.iter().zip(&base) {
        assert!((g - w).abs() < 1e-10 * (1.0 + w.abs()), "adapters off {off:?} vs base {base:?}");
    }
    assert!(got.iter().zip(&off).any(|(a, b)| (a - b).abs() > 1e-4), "negative control: the adapters matter");
    // gradients of the response-only sum equal those of the full path (masked token log-probs)
    let g1 = fast(&m, true).sum_all().unwrap().backward().unwrap();
    let full = {
        let ids = b.padded_ids().unwrap();
        let t = ids.dim(1).unwrap();
        let mut mask = vec![0f64; 3 * (t - 1)];
        for (r, (p, resp)) in seqs.iter().enumerate() {
            for j in p.len()..p.len() + resp.len() {
                mask[r * (t - 1) + j - 1] = 1.0;
            }
        }
        let mask = Tensor::from_vec(mask, (3, t - 1), &Device::Cpu).unwrap();
        masked_sum(&token_logprobs(&m.forward(ids).unwrap(), ids).unwrap(), &mask).unwrap().sum_all().unwrap()
    };
    let g2 = full.backward().unwrap();
    for var in m.vars() {
        let a: Vec<f64> = g1.get(var.as_tensor()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let z: Vec<f64> = g2.get(var.as_tensor()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let scale = z.iter().fold(0f64, |m, x| m.max(x.abs()));
        assert!(scale > 0.0);
        for (x, y) in a.iter().zip(&z) {
            assert!((x - y).abs() <= 1e-9 * scale, "gradients differ: {x} vs {y}");
        }
    }
}

/// The frozen matmul gives candle's matmul's values and, backward, ∂/∂x = g W as the plain
/// matmul's autograd does — the same bits, in f64 and f32, on a tiny shape and on one that
/// spans several of the `gemm` crate's blocks — and no gradient to W.
#[test]
fn frozen_matmul_routes_the_gradient_to_x_alone() {
    for dtype in [DType::F64, DType::F32] {
        for (m, k, n) in [(3, 4, 5), (67, 300, 130)] {
            let t = |len: usize, f: fn(f64) -> f64, s: (usize, usize)| {
                let v: Vec<f64> = (0..len).map(|i| f(i as f64 * 0.37)).collect();
                Tensor::from_vec(v, s, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
            };
            let x = candle_core::Var::from_tensor(&t(m * k, f64::sin, (m, k))).unwrap();
            let w = t(n * k, f64::cos, (n, k));
            let c = t(m * n, |v| (v * 1.3).sin(), (m, n));
            let y2 = x.as_tensor().matmul(&w.t().unwrap()).unwrap();
            let bits =
                |t: &Tensor| -> Vec<f64> { t.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1().unwrap() };
            let g2 = (&y2 * &c).unwrap().sum_all().unwrap().backward().unwrap();
            for kernels in [policy::ops::Kernels::Fused, policy::ops::Kernels::Routed] {
                let y1 = policy::lora::frozen_matmul(x.as_tensor(), &w, kernels).unwrap();
                assert_eq!(bits(&y1), bits(&y2), "{dtype:?} {m}×{k}×{n} {kernels:?}: values");
                let g1 = (&y1 * &c).unwrap().sum_all().unwrap().backward().unwrap();
                assert_eq!(
                    bits(g1.get(x.as_tensor()).unwrap()),
                    bits(g2.get(x.as_tensor()).unwrap()),
                    "{dtype:?} {m}×{k}×{n} {kernels:?}: ∂/∂x"
                );
                assert!(g1.get(&w).is_none(), "no gradient for the frozen weight");
            }
            let y1 = policy::lora::frozen_matmul(x.as_tensor(), &w, policy::ops::Kernels::Fused).unwrap();
            // negative control: the product with W's rows in another order is another value
            let wr = Tensor::cat(&[w.narrow(0, 1, n - 1).unwrap(), w.narrow(0, 0, 1).unwrap()], 0).unwrap();
            let y3 = policy::lora::frozen_matmul(x.as_tensor(), &wr, policy::ops::Kernels::Fused).unwrap();
            assert_ne!(bits(&y1), bits(&y3));
        }
    }
}

/// A weight that trains (a full-parameter model's) takes the fused weight-matmul op on the CPU:
/// the values and both gradients, ∂x and ∂W, are the same bits as candle's matmul of x and Wᵀ
/// and its autograd (f64 and f32, a tiny shape, one over several of gemm's blocks and one of
/// SmolLM2's q-projection at 300 rows). Negative control: another upstream gradient gives
/// another ∂W.
#[test]
fn a_trained_weights_product_gives_candles_values_and_both_gradients() {
    for dtype in [DType::F64, DType::F32] {
        for (m, k, n) in [(3, 4, 5), (67, 300, 130), (300, 576, 576)] {
            let t = |len: usize, f: fn(f64) -> f64, s: (usize, usize)| {
                let v: Vec<f64> = (0..len).map(|i| f(i as f64 * 0.37)).collect();
                Tensor::from_vec(v, s, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
            };
            let bits =
                |t: &Tensor| -> Vec<f64> { t.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1().unwrap() };
            let x = candle_core::Var::from_tensor(&t(m * k, f64::sin, (m, k))).unwrap();
            let w = candle_core::Var::from_tensor(&t(n * k, f64::cos, (n, k))).unwrap();
            let c = t(m * n, |v| (v * 1.3).sin(), (m, n));
            let y2 = x.as_tensor().matmul(&w.as_tensor().t().unwrap()).unwrap();
            let g2 = (&y2 * &c).unwrap().sum_all().unwrap().backward().unwrap();
            let y1 = policy::lora::frozen_matmul(x.as_tensor(), w.as_tensor(), policy::ops::Kernels::Fused).unwrap();
            assert_eq!(bits(&y1), bits(&y2), "{dtype:?} {m}×{k}×{n}: values");
            let g1 = (&y1 * &c).unwrap().sum_all().unwrap().backward().unwrap();
            for (v, what) in [(&x, "∂x"), (&w, "∂W")] {
                let (a, b) = (g1.get(v.as_tensor()).unwrap(), g2.get(v.as_tensor()).unwrap());
                assert_eq!(a.dims(), b.dims(), "{dtype:?} {m}×{k}×{n}: {what}'s shape");
                assert_eq!(bits(a), bits(b), "{dtype:?} {m}×{k}×{n}: {what}");
            }
            // negative control: another upstream gradient, another ∂W
            let g3 = (&y1 * (&c * 2.0).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
            assert_ne!(bits(g3.get(w.as_tensor()).unwrap()), bits(g1.get(w.as_tensor()).unwrap()));
        }
    }
}

/// The LoRA product as one op (`lora::lora_matmul`, and `lora_matmul_routed`: the GPU's)
/// gives the composition's values, x W^T + s (x A^T) B^T, and autograd's gradients of x, A and
/// B (f64, a shape over several of gemm's blocks); with x needing no gradient, A and B get the
/// same ones. Negative control: another scale gives other gradients of A and B.
#[test]
fn the_lora_product_op_gives_the_compositions_values_and_gradients() {
    use candle_core::Var;
    let (m, k, n, r, s) = (67, 300, 130, 8, 2.0);
    let t = |len: usize, f: fn(f64) -> f64, sh: (usize, usize)| {
        Tensor::from_vec((0..len).map(|i| f(i as f64 * 0.37)).collect::<Vec<f64>>(), sh, &Device::Cpu).unwrap()
    };
    let w = t(n * k, f64::cos, (n, k));
    let c = t(m * n, |v| (v * 1.3).sin(), (m, n));
    let flat = |t: &Tensor| -> Vec<f64> { t.flatten_all().unwrap().to_vec1().unwrap() };
    let err = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
    // which: 0 the fused CPU op, 1 the routed op (CUDA's path), 2 the composition
    let run = |which: u8, scale: f64, track_x: bool| {
        let x = Var::from_tensor(&t(m * k, f64::sin, (m, k))).unwrap();
        let a = Var::from_tensor(&(t(r * k, |v| (v * 0.7).cos(), (r, k)) * 0.05).unwrap()).unwrap();
        let b = Var::from_tensor(&(t(n * r, |v| (v * 2.1).sin(), (n, r)) * 0.05).unwrap()).unwrap();
        let xin = if track_x { x.as_tensor().clone() } else { x.as_tensor().detach() };
        let y = if which == 0 {
            policy::lora::lora_matmul(&xin, &w, None, a.as_tensor(), b.as_tensor(), scale).unwrap()
        } else if which == 1 {
            policy::lora::lora_matmul_routed(&xin, &w, a.as_tensor(), b.as_tensor(), scale).unwrap()
        } else {
            let low = xin.matmul(&a.as_tensor().t().unwrap()).unwrap().matmul(&b.as_tensor().t().unwrap()).unwrap();
            (xin.matmul(&w.t().unwrap()).unwrap() + (low * scale).unwrap()).unwrap()
        };
        let g = (&y * &c).unwrap().sum_all().unwrap().backward().unwrap();
        let gx = g.get(x.as_tensor()).map(flat);
        (flat(&y), gx, flat(g.get(a.as_tensor()).unwrap()), flat(g.get(b.as_tensor()).unwrap()))
    };
    let (cy, cx, ca, cb) = run(2, s, true);
    let cx = cx.expect("x's gradient");
    for which in [0, 1] {
        let (fy, fx, fa, fb) = run(which, s, true);
        let fx = fx.expect("x's gradient");
        assert!(err(&fy, &cy) < 1e-10, "op {which}: values {:e}", err(&fy, &cy));
        assert!(err(&fx, &cx) < 1e-10, "op {which}: dx {:e}", err(&fx, &cx));
        assert!(
            err(&fa, &ca) < 1e-9 && err(&fb, &cb) < 1e-9,
            "op {which}: dA {:e}, dB {:e}",
            err(&fa, &ca),
            err(&fb, &cb)
        );
        let (_, nx, na, nb) = run(which, s, false);
        assert!(nx.is_none(), "op {which}: x needs no gradient");
        assert!(err(&na, &fa) < 1e-12 && err(&nb, &fb) < 1e-12);
        let (_, _, oa, ob) = run(which, 3.0, true);
        assert!(err(&oa, &fa) > 1e-3 && err(&ob, &fb) > 1e-3, "op {which}: negative control: the scale is invisible");
    }
}

/// The composed ops — the path a GPU trains with (candle's differentiable tensor ops for
/// RMSNorm, RoPE, the softmaxes and the frozen products) — give the fused CPU kernels' values
/// and every adapter's gradient, on Llama (rotate-half and interleaved RoPE) and Qwen2 (biases),
/// in f64 (the maths) and f32 (what trains). Negative control: the same comparison against a
/// composed model with the other RoPE layout fails it.
#[test]
fn composed_ops_give_the_fused_values_and_every_adapter_gradient() {
    let seqs: [(&[u32], &[u32]); 3] = [(&[1, 5, 3], &[9, 2, 4]), (&[4], &[10, 0, 6, 8]), (&[7, 7, 2, 1], &[3])];
    let b = policy::batch::SeqBatch::new(&seqs, &Device::Cpu).unwrap();
    let mut worst = [0f64; 2];
    for (family, interleaved) in [(Family::Llama, false), (Family::Llama, true), (Family::Qwen2, false)] {
        for (di, (dtype, tol)) in [(DType::F64, 1e-11), (DType::F32, 2e-4)].into_iter().enumerate() {
            let c = cfg(family, interleaved);
            let w: HashMap<String, Tensor> =
                weights(&c, 11).into_iter().map(|(k, v)| (k, v.to_dtype(dtype).unwrap())).collect();
            let lora = LoraConfig { rank: 2, alpha: 4.0, targets: Target::ALL.to_vec(), seed: 4, dropout: 0.0 };
            let mut m = PolicyModel::new(w.clone(), c.clone(), &lora, 32, dtype).unwrap();
            randomize(&m, 13);
            assert_eq!(m.kernels(), policy::ops::Kernels::Fused, "the CPU trains fused");
            let (fv, fg) = values_and_gradients(&m, &b);
            // the two paths a GPU trains with: composed (autograd) and routed (device kernels)
            for k in [policy::ops::Kernels::Composed, policy::ops::Kernels::Routed] {
                m.set_kernels(k).unwrap();
                let (cv, cg) = values_and_gradients(&m, &b);
                let mut err = rel(&cv, &fv);
                for (vi, (x, y)) in cg.iter().zip(&fg).enumerate() {
                    assert!(
                        y.iter().any(|v| *v != 0.0),
                        "{family:?} {interleaved} {dtype:?}: adapter var {vi} has a zero gradient"
                    );
                    err = err.max(rel(x, y));
                }
                assert!(err < tol, "{family:?} interleaved={interleaved} {dtype:?}: {k:?} vs fused {err:e}");
                worst[di] = worst[di].max(err);
            }
            // negative control: the other RoPE layout, composed, is far off
            if family == Family::Llama && dtype == DType::F64 {
                let mut other = cfg(family, !interleaved);
                other.rope_interleaved = !interleaved;
                let mut m2 = PolicyModel::new(w.clone(), other, &lora, 32, dtype).unwrap();
                randomize(&m2, 13);
                for k in [policy::ops::Kernels::Composed, policy::ops::Kernels::Routed] {
                    m2.set_kernels(k).unwrap();
                    let (v2, g2) = values_and_gradients(&m2, &b);
                    let off = rel(&v2, &fv).max(rel(&g2[0], &fg[0]));
                    assert!(off > 1e-3, "{k:?}: the comparison cannot see a wrong RoPE layout: {off:e}");
                }
            }
        }
    }
    eprintln!("composed and routed vs fused, largest relative error: f64 {:e}, f32 {:e}", worst[0], worst[1]);
}

/// PEFT's lora_dropout: the frozen path never sees it (with B = 0 a dropped pass is the base
/// pass, bit for bit); the adapters' branch is unbiased (the mean over many masks is the
/// undropped output: inverted dropout); a step's masks are reproducible and differ between steps.
#[test]
fn lora_dropout_is_unbiased_reproducible_and_spares_the_frozen_path() {
    use policy::lora::{Adapter, Linear};
    use policy::{Dropout, Pass};
    use rand::{Rng, SeedableRng};
    let dev = Device::Cpu;
    let mut rng = rand_chacha::ChaCha20Rng::seed_from_u64(9);
    let mut rand = |n: usize| -> Vec<f64> { (0..n).map(|_| rng.random::<f64>() * 2.0 - 1.0).collect() };
    let (rows, inp, out, r) = (3, 6, 4, 2);
    let x = Tensor::from_vec(rand(rows * inp), (rows, inp), &dev).unwrap();
    let w = Tensor::from_vec(rand(out * inp), (out, inp), &dev).unwrap();
    let mut init = policy::lora::init_rng(1);
    let ad = Adapter::new(inp, out, r, 1.5, &mut init, &dev, DType::F64).unwrap();
    let lin = Linear {
        w,
        bias: None,
        adapter: Some(ad),
        reference: policy::lora::Reference::Frozen,
        packed: None,
        packed_reference: None,
    };
    let v = |t: Tensor| -> Vec<f64> { t.flatten_all().unwrap().to_vec1().unwrap() };
    fn pass(d: &Dropout) -> Pass<'_> {
        Pass { adapters: true, dropout: Some(d), no_grad: false }
    }
    // B = 0: the branch is zero, so a dropped pass must equal the base pass exactly.
    let base = v(lin.forward(&x, Pass::BASE, policy::ops::Kernels::Fused).unwrap());
    assert_eq!(v(lin.forward(&x, pass(&Dropout::new(0.5, 0, 0)), policy::ops::Kernels::Fused).unwrap()), base);
    // A non-zero B.
    let b = Tensor::from_vec(rand(out * r), (out, r), &dev).unwrap();
    lin.adapter.as_ref().unwrap().b.set(&b).unwrap();
    let want = v(lin.forward(&x, Pass::ADAPTED, policy::ops::Kernels::Fused).unwrap());
    let p = 0.3;
    let one = |step: u64| v(lin.forward(&x, pass(&Dropout::new(p, 4, step)), policy::ops::Kernels::Fused).unwrap());
    assert_eq!(one(7), one(7), "a step's masks are reproducible");
    assert_ne!(one(7), one(8), "steps draw different masks");
    assert_ne!(one(7), want, "p = 0.3 drops something");
    let n = 4000;
    let draws: Vec<Vec<f64>> = (0..n).map(|s| one(s as u64)).collect();
    for j in 0..want.len() {
        let mean = draws.iter().map(|d| d[j]).sum::<f64>() / n as f64;
        let sd = (draws.iter().map(|d| (d[j] - mean).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt();
        assert!(sd > 0.0, "element {j} never varies");
        assert!((mean - want[j]).abs() < 5.0 * sd / (n as f64).sqrt(), "element {j}: mean {mean} vs {}", want[j]);
        // Negative control: without the 1/(1 − p) rescaling the mean of the branch would shrink by
        // (1 − p); that bias is larger than the tolerance here, so the test could see it.
        let biased = base[j] + (1.0 - p) * (want[j] - base[j]);
        if (want[j] - base[j]).abs() > 0.05 {
            assert!(
                (mean - biased).abs() > 5.0 * sd / (n as f64).sqrt(),
                "element {j}: cannot tell scaled from unscaled"
            );
        }
    }
    // p = 0 in the config: the training pass is the adapted pass.
    assert_eq!(v(lin.forward(&x, pass(&Dropout::new(0.0, 4, 1)), policy::ops::Kernels::Fused).unwrap()), want);
}

/// Shared prompts (prefix sharing: each group's prompt through the decoder once, its responses
/// attending to the prompt's keys and values) give the padded layout's log-probabilities and
/// every adapter's gradient, on Llama (both RoPE layouts) and Qwen2, fused and composed, in f64.
/// The rows mix groups of 3, 2 and 1 (a prompt repeated after another starts a new group) and
/// responses of unequal lengths. Negative control: the shared layout with one group's prompt
/// cut by its last token differs.
#[test]
fn shared_prompts_give_the_padded_values_and_every_adapter_gradient() {
    let (p1, p2): (&[u32], &[u32]) = (&[1, 5, 3, 2], &[4, 9]);
    let seqs: [(&[u32], &[u32]); 7] = [
        (p1, &[9, 2, 4]),
        (p1, &[10]),
        (p1, &[6, 8, 0, 7, 1]),
        (p2, &[3, 3]),
        (p2, &[10, 2, 5]),
        (p1, &[2, 2]),
        (&[7], &[1, 4]),
    ];
    let padded = policy::batch::SeqBatch::new(&seqs, &Device::Cpu).unwrap();
    let shared = policy::batch::SeqBatch::shared(&seqs, &Device::Cpu).unwrap();
    match &shared.layout {
        policy::batch::Layout::Shared(g) => assert_eq!(g.len(), 4, "groups: p1 ×3, p2 ×2, p1, [7]"),
        _ => panic!("expected the shared layout"),
    }
    let mut worst = 0f64;
    for (family, interleaved) in [(Family::Llama, false), (Family::Llama, true), (Family::Qwen2, false)] {
        for kernels in [policy::ops::Kernels::Fused, policy::ops::Kernels::Routed, policy::ops::Kernels::Composed] {
            let c = cfg(family, interleaved);
            let w: HashMap<String, Tensor> =
                weights(&c, 17).into_iter().map(|(k, v)| (k, v.to_dtype(DType::F64).unwrap())).collect();
            let lora = LoraConfig { rank: 2, alpha: 4.0, targets: Target::ALL.to_vec(), seed: 5, dropout: 0.0 };
            let mut m = PolicyModel::new(w, c, &lora, 32, DType::F64).unwrap();
            randomize(&m, 19);
            m.set_kernels(kernels).unwrap();
            let (pv, pg) = values_and_gradients(&m, &padded);
            let (sv, sg) = values_and_gradients(&m, &shared);
            let mut err = rel(&sv, &pv);
            for (x, y) in sg.iter().zip(&pg) {
                assert!(y.iter().any(|v| *v != 0.0), "a zero gradient");
                err = err.max(rel(x, y));
            }
            assert!(err < 1e-11, "{family:?} {interleaved} {kernels:?}: shared vs padded, rel err {err:e}");
            worst = worst.max(err);
            // negative control: the first group's prompt without its last token
            let cut: Vec<(&[u32], &[u32])> =
                seqs.iter().map(|&(p, r)| if p == p1 { (&p1[..3], r) } else { (p, r) }).collect();
            let (cv, _) = values_and_gradients(&m, &policy::batch::SeqBatch::shared(&cut, &Device::Cpu).unwrap());
            assert!(rel(&cv, &pv) > 1e-3, "negative control: a different prompt changes the log-probabilities");
        }
    }
    eprintln!("shared vs padded: largest relative error {worst:e}");
}

/// An evaluation reads the policy's log-probabilities as the sampler recorded them (the merged
/// weights' KV-cache decode, `features::generate::token_logprob` of each drawn token) and runs
/// the reference's pass alone (`score_recorded`): its Σ log π and KL per sequence equal
/// [`policy::train::score`]'s two graph passes to f32 rounding, for k1 and k3. Negative
/// control: log-probabilities recorded from the base weights give another KL.
#[test]
fn recorded_logprobs_score_as_the_graphs_two_passes() {
    use features::generate::token_logprob;
    use policy::train::{score, score_recorded, KlEstimator, Rollout};
    let c = cfg(Family::Llama, false);
    let w = weights(&c, 4);
    let lora = LoraConfig { rank: 2, alpha: 4.0, targets: Target::ALL.to_vec(), seed: 2, dropout: 0.0 };
    let m = PolicyModel::new(w.clone(), c.clone(), &lora, 32, DType::F32).unwrap();
    randomize(&m, 5);
    let seqs: [(&[u32], &[u32]); 3] = [(&[1, 5, 3], &[9, 2, 10]), (&[4], &[10, 0, 6, 8]), (&[7, 7, 2, 1], &[3])];
    // the sampler's way: prefill the prompt, then one token at a time from the KV cache
    let recorded = |weights: &HashMap<String, Tensor>| -> Vec<Vec<f32>> {
        let vb = candle_nn::VarBuilder::from_tensors(weights.clone(), DType::F32, &Device::Cpu);
        let g = features::model::Model::load_with(vb, c.clone(), 32, Some(true)).unwrap();
        seqs.iter()
            .map(|(p, r)| {
                let mut cache = g.new_cache(vec![0], p.len() + r.len()).unwrap();
                let mut feed = Tensor::new(*p, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
                let mut out = Vec::new();
                for &tok in r.iter() {
                    let l: Vec<f32> =
                        g.forward_cached(&feed, &mut cache).unwrap().squeeze(0).unwrap().to_vec1().unwrap();
                    out.push(token_logprob(&l, tok));
                    feed = Tensor::new(&[tok], &Device::Cpu).unwrap().unsqueeze(0).unwrap();
                }
                out
            })
            .collect()
    };
    let rollouts: Vec<Rollout> = seqs.iter().map(|(p, r)| Rollout { prompt: p, response: r }).collect();
    let policy_lp = recorded(&m.merged_weights().unwrap());
    let base_lp = recorded(&w);
    for kl in [KlEstimator::K1, KlEstimator::K3] {
        let want = score(&m, &rollouts, kl, 2).unwrap();
        let refs: Vec<&[f32]> = policy_lp.iter().map(|v| v.as_slice()).collect();
        let got = score_recorded(&m, &rollouts, &refs, kl, 2).unwrap();
        let mut kl_gap = 0f64;
        for ((g_lp, g_kl, g_n), (w_lp, w_kl, w_n)) in got.iter().zip(&want) {
            assert_eq!(g_n, w_n);
            assert!((g_lp - w_lp).abs() < 1e-4 * (1.0 + w_lp.abs()), "{kl:?}: Σ log π {g_lp} vs {w_lp}");
            assert!((g_kl - w_kl).abs() < 1e-4, "{kl:?}: KL {g_kl} vs {w_kl}");
            kl_gap += w_kl.abs();
        }
        assert!(kl_gap > 1e-3, "{kl:?}: the adapters moved the policy (KL {kl_gap})");
        let refs: Vec<&[f32]> = base_lp.iter().map(|v| v.as_slice()).collect();
        let off = score_recorded(&m, &rollouts, &refs, kl, 2).unwrap();
        let diff: f64 = off.iter().zip(&want).map(|(a, b)| (a.1 - b.1).abs()).sum();
        assert!(diff > 1e-3, "{kl:?}: negative control: the base's log-probabilities give the same KL ({diff})");
    }
    // a row of the wrong length is refused, not truncated
    let short: Vec<&[f32]> = vec![&policy_lp[0][..2], &policy_lp[1], &policy_lp[2]];
    let e = score_recorded(&m, &rollouts, &short, KlEstimator::K1, 2).unwrap_err().to_string();
    assert!(e.contains("sequence 0") && e.contains("2 recorded"), "{e}");
}

/// A scoring pass (`logprobs_scored`, what the updates' old and reference log-probabilities and
/// the evaluation read) builds no graph and gives the tracked pass's log-probabilities bit for
/// bit, fused and composed — so a clipped ratio's first step against the training pass is
/// exactly 1. Negative control: the tracked pass is tracked.
#[test]
fn scoring_passes_build_no_graph_and_give_the_tracked_values() {
    let seqs: [(&[u32], &[u32]); 2] = [(&[1, 5, 3], &[9, 2, 4]), (&[4, 2], &[10, 0, 6, 8])];
    let b = policy::batch::SeqBatch::new(&seqs, &Device::Cpu).unwrap();
    for kernels in [policy::ops::Kernels::Fused, policy::ops::Kernels::Routed, policy::ops::Kernels::Composed] {
        let c = cfg(Family::Llama, true);
        let lora = LoraConfig { rank: 2, alpha: 4.0, targets: Target::ALL.to_vec(), seed: 6, dropout: 0.0 };
        let mut m = PolicyModel::new(weights(&c, 8), c, &lora, 32, DType::F32).unwrap();
        m.set_kernels(kernels).unwrap();
        randomize(&m, 2);
        let tracked = m.logprobs_at(&b, true).unwrap();
        let scored = m.logprobs_scored(&b, true).unwrap();
        assert!(tracked.track_op(), "negative control: the training path is tracked");
        assert!(!scored.track_op(), "{kernels:?}: the scoring pass built a graph");
        assert_eq!(scored.to_vec1::<f32>().unwrap(), tracked.to_vec1::<f32>().unwrap(), "{kernels:?}");
        let base = m.logprobs_scored(&b, false).unwrap();
        assert_ne!(base.to_vec1::<f32>().unwrap(), scored.to_vec1::<f32>().unwrap(), "the adapters are applied");
    }
}

/// The fused sublayers (`PolicyModel::set_sublayer_fusion`, issue 31's memory): each
/// projection written in heads by its own op, the attention's output projection and residual
/// as one node, the MLP (norm, three products frozen or adapted, SwiGLU, residual) as one node. With and
/// without them the log-probabilities and every adapter's gradient are the same bits — on the
/// plain f32 path, f64, bf16 products, interleaved RoPE, q/k/v biases and every layer adapted —
/// and the graph holds exactly the nodes the fusions remove fewer: per row and layer the MLP's
/// 2h + 3i (its norm, gate, up, SwiGLU product and down's output), the output projection's q + h
/// (the merged heads and its output), and each projection's rows (q or kv) where it fuses — an
/// adapted one, and a frozen one whose input carries a gradient (not layer 0's k: its input
/// does not) — and holds the adapted MLP's A and B once more as one joined input. Nothing is
/// removed where a bias or an adapter keeps an op out (the control).
#[test]
fn fused_sublayers_give_the_op_by_op_bits_and_keep_fewer_nodes() {
    use policy::ops::Kernels;
    let qv = vec![Target::QProj, Target::VProj];
    // (family, interleaved, targets, dtype, bf16 products)
    let with = |t: Target| [qv.clone(), vec![t]].concat();
    let cases: [(Family, bool, Vec<Target>, DType, bool); 7] = [
        (Family::Llama, false, qv.clone(), DType::F32, false),
        (Family::Llama, false, with(Target::DownProj), DType::F64, false),
        (Family::Llama, true, with(Target::GateProj), DType::F32, true),
        (Family::Llama, true, qv.clone(), DType::F64, false),
        (Family::Llama, false, qv.clone(), DType::F32, true),
        (Family::Llama, true, Target::ALL.to_vec(), DType::F32, false),
        (Family::Qwen2, false, qv.clone(), DType::F64, false),
    ];
    for (family, interleaved, targets, dtype, bf16) in cases {
        let c = cfg(family, interleaved);
        let w: HashMap<String, Tensor> =
            weights(&c, 11).into_iter().map(|(k, v)| (k, v.to_dtype(dtype).unwrap())).collect();
        let lora = LoraConfig { rank: 2, alpha: 4.0, targets: targets.clone(), seed: 5, dropout: 0.0 };
        let mut m = PolicyModel::new(w, c.clone(), &lora, 32, dtype).unwrap();
        if bf16 {
            m.use_bf16_products().unwrap();
        }
        assert_eq!(m.kernels(), Kernels::Fused);
        randomize(&m, 2);
        let seqs: [(&[u32], &[u32]); 3] =
            [(&[1, 5, 3], &[9, 2, 4]), (&[4, 2, 2], &[10, 0, 6]), (&[7, 7, 2], &[3, 1, 8])];
        let b = policy::batch::SeqBatch::new(&seqs, &Device::Cpu).unwrap();
        let rows = b.padded_ids().unwrap().elem_count();
        let nodes = |m: &PolicyModel| -> usize {
            let lp = m.logprobs_at(&b, true).unwrap();
            let l = lp.sum_all().unwrap();
            l.sorted_nodes().iter().map(|t| t.elem_count()).sum()
        };
        let fused = values_and_gradients(&m, &b);
        let fused_nodes = nodes(&m);
        m.set_sublayer_fusion(false);
        let plain = values_and_gradients(&m, &b);
        let plain_nodes = nodes(&m);
        let case = format!("{family:?} interleaved {interleaved} {targets:?} {dtype:?} bf16 {bf16}");
        assert_eq!(fused.0, plain.0, "{case}: log-probabilities");
        assert_eq!(fused.1, plain.1, "{case}: gradients");
        assert!(fused.1.iter().flatten().any(|&g| g != 0.0), "{case}: the gradients are not all zero");
        let (h, i, q, kv, layers) = (c.hidden, c.intermediate, c.heads * c.head_dim, c.kv_heads * c.head_dim, c.layers);
        let adapted = |t: Target| targets.contains(&t);
        let bias = c.qkv_bias;
        let mut per_row = 0;
        // what the fused MLP adds: its adapters' A and B flattened into one input (both views
        // of each and the joined tensor are graph nodes), per layer
        let r = lora.rank;
        let mut added = 0;
        for layer in 0..layers {
            // the MLP fuses frozen or adapted
            per_row += 2 * h + 3 * i;
            for t in [Target::GateProj, Target::UpProj, Target::DownProj] {
                if adapted(t) {
                    let (inp, out) = t.dims(&c);
                    added += 2 * (r * inp + out * r);
                }
            }
            if !adapted(Target::OProj) {
                per_row += q + h;
            }
            if !bias {
                per_row += q + kv; // q and v: adapted, or frozen with an input that carries a gradient…
                if adapted(Target::KProj) || layer > 0 {
                    per_row += kv; // …k too, except a frozen k on layer 0's embeddings
                }
            }
        }
        assert!(adapted(Target::QProj) && adapted(Target::VProj), "the count above assumes q and v adapted");
        assert_eq!(
            plain_nodes + added - fused_nodes,
            rows * per_row,
            "{case}: graph elements {plain_nodes} → {fused_nodes}"
        );
    }
}
