//! The reward heads: θ of the first seed of every config as a safetensors `score.weight`.

use crate::results;
use anyhow::{Context, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// File-name form of a config label.
fn slug(label: &str) -> String {
    let s: String =
        label.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.=".contains(c) { c } else { '_' }).collect();
    s.split('_').filter(|p| !p.is_empty()).collect::<Vec<_>>().join("_")
}

/// θ of the first seed of every config as `score.weight` (shape [1, d], f32, no bias): the head of
/// transformers' `*ForSequenceClassification` over the feature model. Returns the files written.
pub fn export_heads(run: &Path, out: &Path) -> Result<Vec<PathBuf>> {
    let mut first: BTreeMap<String, (u32, String)> = BTreeMap::new();
    for (k, c) in results::read_cells(run)? {
        if c.status != "ok" {
            continue;
        }
        let e = first.entry(k.label).or_insert((u32::MAX, String::new()));
        if k.seed < e.0 {
            *e = (k.seed, k.cell_id);
        }
    }
    let meta: serde_json::Value = std::fs::read_to_string(run.join("meta.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default();
    let model = meta.pointer("/data/dataset/model").and_then(|v| v.as_str()).unwrap_or("").to_string();
    let dir = out.join("heads");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut written = Vec::new();
    for (label, (seed, cell)) in first {
        let npy = run.join("theta").join(format!("{cell}.npy"));
        if !npy.exists() {
            // an unfinished run (killed while writing its tables): report what exists
            continue;
        }
        let theta = crate::io::read_npy_f64(&npy)?;
        let bytes: Vec<u8> = theta.iter().flat_map(|&v| (v as f32).to_le_bytes()).collect();
        let info: std::collections::BTreeMap<&str, String> = [
            ("label", label.clone()),
            ("seed", seed.to_string()),
            ("cell_id", cell.clone()),
            ("feature_model", model.clone()),
            ("format", "pt".to_string()),
        ]
        .into();
        let data = safetensors_one("score.weight", theta.len(), &bytes, &info);
        let f = dir.join(format!("{}.safetensors", slug(&label)));
        crate::io::write_atomic(&f, &data)?;
        written.push(f);
    }
    Ok(written)
}

/// A safetensors file holding one f32 tensor of shape [1, n] and `metadata`, with the header's
/// keys in a fixed order (the safetensors crate writes its metadata from a HashMap, whose order
/// changes from process to process, so identical reports differed byte for byte).
fn safetensors_one(name: &str, n: usize, bytes: &[u8], metadata: &std::collections::BTreeMap<&str, String>) -> Vec<u8> {
    let header = serde_json::json!({
        "__metadata__": metadata,
        name: { "dtype": "F32", "shape": [1, n], "data_offsets": [0, bytes.len()] },
    });
    // the metadata comes sorted (BTreeMap) and the two top-level keys in a fixed order
    let mut h = header.to_string().into_bytes();
    // the data starts on an 8-byte boundary, the header padded with spaces
    h.resize(h.len().div_ceil(8) * 8, b' ');
    let mut out = Vec::with_capacity(8 + h.len() + bytes.len());
    out.extend_from_slice(&(h.len() as u64).to_le_bytes());
    out.extend_from_slice(&h);
    out.extend_from_slice(bytes);
    out
}
