//! Linear reward heads over φ: a sequence-classifier reward model's trained `score` layer
//! (transformers' `*ForSequenceClassification`: `score.weight` [1, d], read at the last token,
//! which is φ with `pool = last`), or a head trained by onepass (`onepass report` writes
//! `report/heads/<config>.safetensors` in the same layout). A checkpoint without the head is an
//! error: a causal LM loaded as a classifier would get a random head.

use crate::extract::{safetensors_files, Source};
use crate::Error;
use safetensors::{Dtype, SafeTensors};
use std::path::{Path, PathBuf};

/// r(x, a) = wᵀφ(x, a) + bias.
#[derive(Clone, Debug, PartialEq)]
pub struct ScoreHead {
    pub w: Vec<f32>,
    pub bias: f32,
    /// The file the head was read from.
    pub file: PathBuf,
}

impl ScoreHead {
    pub fn score(&self, phi: &[f32]) -> f64 {
        self.w.iter().zip(phi).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum::<f64>() + f64::from(self.bias)
    }
}

fn values(t: &safetensors::tensor::TensorView<'_>, what: &str) -> Result<Vec<f32>, Error> {
    let b = t.data();
    Ok(match t.dtype() {
        Dtype::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        Dtype::BF16 => b.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        Dtype::F16 => b.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        other => return Err(Error::Weights(format!("{what}: dtype {other:?}, expected f32, bf16 or f16"))),
    })
}

/// Reads `score.weight` (and `score.bias` when present) from safetensors files; `dim` is the
/// feature dimension the head must match.
pub fn read_score_head(files: &[PathBuf], dim: usize) -> Result<ScoreHead, Error> {
    for f in files {
        let file = std::fs::File::open(f).map_err(|e| Error::Io(format!("{}: {e}", f.display())))?;
        // SAFETY: read-only map of a weight file onepass never writes.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::Io(format!("{}: {e}", f.display())))?;
        let st = SafeTensors::deserialize(&map)
            .map_err(|e| Error::Format(format!("{}: not a readable safetensors file: {e}", f.display())))?;
        let Ok(w) = st.tensor("score.weight") else { continue };
        let what = format!("{}: tensor `score.weight`", f.display());
        if w.shape() != [1, dim] {
            return Err(Error::Weights(format!(
                "{what}: shape {:?}, expected [1, {dim}] (one reward over φ of dimension {dim})",
                w.shape()
            )));
        }
        let bias = match st.tensor("score.bias") {
            Ok(b) if b.shape() == [1] => values(&b, &format!("{}: tensor `score.bias`", f.display()))?[0],
            Ok(b) => {
                return Err(Error::Weights(format!(
                    "{}: tensor `score.bias`: shape {:?}, expected [1]",
                    f.display(),
                    b.shape()
                )))
            }
            Err(_) => 0.0,
        };
        let w = values(&w, &what)?;
        if w.iter().any(|v| !v.is_finite()) {
            return Err(Error::Weights(format!("{what}: non-finite values")));
        }
        return Ok(ScoreHead { w, bias, file: f.clone() });
    }
    let names: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
    Err(Error::Weights(format!(
        "no `score.weight` in {}: a reward model needs its trained score head (this looks like a causal LM or a backbone without the classifier)",
        names.join(", ")
    )))
}

/// The head of a sequence-classifier checkpoint: a model directory (or `hf:` repository) whose
/// safetensors hold `score.weight`; a .safetensors file is read as a head file.
pub fn load_score_head(source: &str, dim: usize) -> Result<ScoreHead, Error> {
    let p = Path::new(source);
    if p.extension().is_some_and(|e| e == "safetensors") {
        return read_score_head(&[p.to_path_buf()], dim);
    }
    let dir = match Source::parse(source)? {
        Source::Dir(d) => d,
        Source::Hub(spec) => match crate::hub::resolve(&spec, &crate::hub::HubEnv::from_env())? {
            crate::hub::Resolved::Dir(d) => d,
            crate::hub::Resolved::Gguf(f) => {
                return Err(Error::Unsupported(format!("{}: a GGUF file has no sequence-classifier head", f.display())))
            }
        },
        Source::Gguf(f) => {
            return Err(Error::Unsupported(format!("{}: a GGUF file has no sequence-classifier head", f.display())))
        }
    };
    read_score_head(&safetensors_files(&dir)?, dim)
}
