//! The bf16 CPU path at the model level: a bf16 model keeps f32 activations around bf16 products
//! (`kernels::bf16`), so its hidden states and logits are within bf16's rounding of the f32
//! model's — and not equal to them (the path is taken); its KV-cache decoding agrees with its own
//! full forward pass; and the portable kernel gives the same bits as the AVX-512 BF16 one, end
//! to end (a child process forces it with ONEPASS_BF16_KERNEL=portable).

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use features::model::{Config, HfConfig, Model};
use std::path::PathBuf;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn tiny(name: &str, dtype: DType) -> Model {
    let d = fixtures().join(name);
    let hf: HfConfig = serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap();
    let cfg = Config::from_hf(&hf).unwrap();
    let vb =
        unsafe { VarBuilder::from_mmaped_safetensors(&[d.join("model.safetensors")], dtype, &Device::Cpu) }.unwrap();
    Model::load_with(vb, cfg, 128, Some(hf.tie_word_embeddings)).unwrap()
}

fn ids(b: usize, t: usize) -> Tensor {
    let v: Vec<u32> = (0..(b * t) as u32).map(|i| (i * 37 + 5) % 128).collect();
    Tensor::from_vec(v, (b, t), &Device::Cpu).unwrap()
}

fn rows(x: &Tensor) -> Vec<Vec<f32>> {
    let d = *x.dims().last().unwrap();
    x.reshape(((), d)).unwrap().to_vec2().unwrap()
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let n = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / n(a) / n(b)
}

#[test]
fn bf16_hidden_states_are_within_rounding_of_f32() {
    for name in ["tiny-llama", "tiny-qwen2"] {
        let (f, h) = (tiny(name, DType::F32), tiny(name, DType::BF16));
        assert_eq!(h.dtype(), DType::BF16);
        assert_eq!(h.activation_dtype(), DType::F32, "{name}: the CPU bf16 path keeps f32 activations");
        let x = ids(3, 40);
        let (a, b) = (f.hidden_states(&x, f.cfg.layers).unwrap(), h.hidden_states(&x, h.cfg.layers).unwrap());
        assert_eq!(b.dtype(), DType::F32);
        let (a, b) = (rows(&a), rows(&b));
        let worst = a.iter().zip(&b).map(|(x, y)| cosine(x, y)).fold(1.0, f64::min);
        assert!(worst > 0.999, "{name}: worst cosine {worst}");
        let differs = a.iter().zip(&b).any(|(x, y)| x.iter().zip(y).any(|(p, q)| p != q));
        assert!(differs, "{name}: bf16 gave the f32 bits: the packed path was not taken");
    }
}

#[test]
fn bf16_decoding_follows_its_own_full_forward() {
    let m = tiny("tiny-llama", DType::BF16);
    let seq: Vec<u32> = (0..16u32).map(|i| (i * 29 + 3) % 128).collect();
    let full = m.logits(&Tensor::new(seq.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap()).unwrap();
    let full = rows(&full);
    let mut cache = m.new_cache(vec![0], seq.len()).unwrap();
    m.forward_cached(&Tensor::new(&seq[..4], &Device::Cpu).unwrap().unsqueeze(0).unwrap(), &mut cache).unwrap();
    for p in 4..seq.len() {
        let t = Tensor::new(&seq[p..p + 1], &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        let l: Vec<f32> = m.forward_cached(&t, &mut cache).unwrap().squeeze(0).unwrap().to_vec1().unwrap();
        let c = cosine(&l, &full[p]);
        assert!(c > 0.9999, "position {p}: cosine {c} between decoded and full-forward logits");
    }
}

/// The child half of the next test (ignored in a plain run, which it would only print in):
/// prints the bf16 model's hidden states as bits.
#[test]
#[ignore = "run by portable_and_native_kernels_give_the_same_model_bits in a child process"]
fn print_bf16_hidden_state_bits() {
    let m = tiny("tiny-qwen2", DType::BF16);
    let h = m.hidden_states(&ids(2, 70), m.cfg.layers).unwrap();
    let bits: Vec<u32> = h.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect();
    println!("\nBITS {}", serde_json::to_string(&bits).unwrap());
    println!("KERNEL {:?}", kernels::bf16::Kernel::detect());
}

/// The native kernel, the portable one (`ONEPASS_BF16_KERNEL=portable`) and the one an AVX2-only
/// CPU runs (`ONEPASS_CPU=avx2`, which must take effect: no AVX-512 kernel) give the same bits —
/// except AMX, which rounds its dot products its own way: on an AMX machine `VDPBF16PS`
/// (`ONEPASS_BF16_KERNEL=avx512bf16`) gives the common bits, and AMX's hidden states differ from
/// them in the last bits only (cosine > 0.99999 on every row).
#[test]
fn portable_and_native_kernels_give_the_same_model_bits() {
    let run = |env: Option<(&str, &str)>| -> (String, String) {
        let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
        cmd.args(["--exact", "print_bf16_hidden_state_bits", "--ignored", "--nocapture", "--test-threads", "1"]);
        cmd.env_remove("ONEPASS_BF16_KERNEL").env_remove("ONEPASS_CPU");
        if let Some((k, v)) = env {
            cmd.env(k, v);
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let s = String::from_utf8(out.stdout).unwrap();
        let field = |tag: &str| {
            s.lines().find_map(|l| l.split_once(tag).map(|x| x.1.to_string())).expect("the child printed it")
        };
        (field("BITS "), field("KERNEL "))
    };
    let (mut native, kernel) = run(None);
    let (portable, _) = run(Some(("ONEPASS_BF16_KERNEL", "portable")));
    let (capped, capped_kernel) = run(Some(("ONEPASS_CPU", "avx2")));
    assert!(native.len() > 100);
    if kernel == "Amx" {
        let (sequential, seq_kernel) = run(Some(("ONEPASS_BF16_KERNEL", "avx512bf16")));
        assert_eq!(seq_kernel, "Avx512Bf16");
        assert_ne!(native, sequential, "AMX gave VDPBF16PS's bits: did it run?");
        let bits = |s: &str| -> Vec<f32> {
            serde_json::from_str::<Vec<u32>>(s).unwrap().into_iter().map(f32::from_bits).collect()
        };
        let (a, b) = (bits(&native), bits(&sequential));
        let d = a.len() / 140; // the hidden size: 2 sequences × 70 positions
        for (ra, rb) in a.chunks(d).zip(b.chunks(d)) {
            let dot: f64 = ra.iter().zip(rb).map(|(x, y)| *x as f64 * *y as f64).sum();
            let (na, nb) = (
                ra.iter().map(|x| (*x as f64).powi(2)).sum::<f64>(),
                rb.iter().map(|x| (*x as f64).powi(2)).sum::<f64>(),
            );
            assert!(dot / (na * nb).sqrt() > 0.99999, "AMX's hidden state is far from VDPBF16PS's");
        }
        native = sequential;
    }
    assert_eq!(native, portable, "kernel {kernel} and the portable kernel disagree");
    assert_eq!(native, capped, "kernel {kernel} and the AVX2-capped kernel {capped_kernel} disagree");
    assert!(!capped_kernel.starts_with("Avx512"), "ONEPASS_CPU=avx2 left the kernel at {capped_kernel}");
}

/// φ's pruned pass (the last block's output projection and MLP on the read rows only) gives the
/// full pass's rows bit for bit, in f32 and bf16, for an inner layer and the final norm, with
/// enough rows (8 × 120) that the bf16 products' fused norm runs on whole-row tasks. A negative
/// control: other positions' rows differ.
#[test]
fn hidden_at_is_the_full_pass_at_those_rows() {
    for name in ["tiny-llama", "tiny-qwen2"] {
        for dtype in [DType::F32, DType::BF16] {
            let m = tiny(name, dtype);
            let x = ids(8, 120);
            let pos: Vec<usize> = (0..8).map(|i| 119 - 13 * i).collect();
            for layer in [0, 1, m.cfg.layers] {
                let full = features::model::gather_rows(&m.hidden_states(&x, layer).unwrap(), &pos).unwrap();
                let got = m.hidden_at(&x, layer, &pos).unwrap();
                assert_eq!(rows(&got), rows(&full), "{name} {dtype:?} layer {layer}");
                let other: Vec<usize> = pos.iter().map(|p| p - 1).collect();
                let elsewhere = features::model::gather_rows(&m.hidden_states(&x, layer).unwrap(), &other).unwrap();
                assert_ne!(rows(&got), rows(&elsewhere), "{name} {dtype:?} layer {layer}");
            }
            assert!(m.hidden_at(&x, m.cfg.layers, &[120; 8]).is_err(), "a position past the batch's length");
        }
    }
}
