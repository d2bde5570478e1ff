//! Reward heads: `score.weight` is read as written (f32 and bf16), its absence or a wrong shape
//! is an error naming the file, and the score is wᵀφ + b.

use features::head::{load_score_head, read_score_head};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use std::collections::HashMap;

fn write(path: &std::path::Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
    let views: HashMap<String, TensorView<'_>> = tensors
        .iter()
        .map(|(n, dt, shape, b)| (n.to_string(), TensorView::new(*dt, shape.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(&views, None, path).unwrap();
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn score_head_is_read_as_written_or_refused() {
    let dir = tempfile::tempdir().unwrap();
    let w: Vec<f32> = (0..6).map(|i| (i as f32 - 2.5) * 0.37).collect();
    let other = f32s(&[1.0; 12]);
    // a sharded checkpoint: the head lives in the second file
    let (a, b) = (dir.path().join("model-00001.safetensors"), dir.path().join("model-00002.safetensors"));
    write(&a, &[("model.norm.weight", Dtype::F32, vec![12], other.clone())]);
    write(&b, &[("score.weight", Dtype::F32, vec![1, 6], f32s(&w)), ("score.bias", Dtype::F32, vec![1], f32s(&[0.5]))]);
    let h = read_score_head(&[a.clone(), b.clone()], 6).unwrap();
    assert_eq!(h.w, w);
    assert_eq!(h.file, b);
    let phi = [1.0f32, -2.0, 0.5, 3.0, 0.0, 1.5];
    let want: f64 = w.iter().zip(&phi).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum::<f64>() + 0.5;
    assert!((h.score(&phi) - want).abs() < 1e-12);

    // bf16 head (what hub RMs ship), read through a .safetensors path
    let c = dir.path().join("head.safetensors");
    let bf: Vec<u8> = w.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect();
    write(&c, &[("score.weight", Dtype::BF16, vec![1, 6], bf)]);
    let h = load_score_head(c.to_str().unwrap(), 6).unwrap();
    for (g, x) in h.w.iter().zip(&w) {
        assert_eq!(*g, half::bf16::from_f32(*x).to_f32());
    }

    // no head: an error, never a random head
    let e = read_score_head(std::slice::from_ref(&a), 12).unwrap_err().to_string();
    assert!(e.contains("no `score.weight`") && e.contains("model-00001"), "{e}");
    // wrong dimension
    let e = read_score_head(std::slice::from_ref(&b), 7).unwrap_err().to_string();
    assert!(e.contains("expected [1, 7]") && e.contains("model-00002"), "{e}");
    // a GGUF has no classifier head
    let g = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-qwen2.gguf");
    let e = load_score_head(g.to_str().unwrap(), 32).unwrap_err().to_string();
    assert!(e.contains("no sequence-classifier head"), "{e}");
}
