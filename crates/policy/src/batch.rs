//! Sequences (prompt, response) as one right-padded training batch, with the positions whose
//! log-probabilities a loss needs: the response's tokens, each predicted from the hidden state
//! one position earlier.

use candle_core::{DType, Device, Result, Tensor};

/// A right-padded batch and the response positions of its rows.
pub struct SeqBatch {
    /// (b, t) token ids; pads (id 0) only after a row's last token, so causal attention never
    /// lets a real token see one.
    pub ids: Tensor,
    /// (P,) flat indices r·t + (j − 1) of the hidden states that predict response token j.
    pub at: Tensor,
    /// (P,) the response tokens themselves.
    pub targets: Tensor,
    /// (b, P): 1 where position p belongs to row r (sums per sequence as one product).
    seg: Tensor,
    /// Response tokens per row.
    pub lens: Vec<usize>,
}

impl SeqBatch {
    /// `seqs`: (prompt ids, response ids) per row; every response has at least one token and
    /// every prompt at least one (the response's first token is predicted from the prompt).
    pub fn new(seqs: &[(&[u32], &[u32])], dev: &Device) -> Result<SeqBatch> {
        if seqs.is_empty() {
            candle_core::bail!("an empty batch");
        }
        if let Some(i) = seqs.iter().position(|(p, r)| p.is_empty() || r.is_empty()) {
            candle_core::bail!("row {i}: a prompt and a response need at least one token each");
        }
        let t = seqs.iter().map(|(p, r)| p.len() + r.len()).max().expect("non-empty");
        let b = seqs.len();
        let mut ids = vec![0u32; b * t];
        let (mut at, mut targets, mut lens) = (Vec::new(), Vec::new(), Vec::with_capacity(b));
        for (row, (p, r)) in seqs.iter().enumerate() {
            let base = row * t;
            ids[base..base + p.len()].copy_from_slice(p);
            ids[base + p.len()..base + p.len() + r.len()].copy_from_slice(r);
            for (i, &tok) in r.iter().enumerate() {
                at.push((base + p.len() + i - 1) as u32);
                targets.push(tok);
            }
            lens.push(r.len());
        }
        let n = at.len();
        let mut seg = vec![0f32; b * n];
        let mut col = 0;
        for (row, &l) in lens.iter().enumerate() {
            seg[row * n + col..row * n + col + l].iter_mut().for_each(|v| *v = 1.0);
            col += l;
        }
        Ok(SeqBatch {
            ids: Tensor::from_vec(ids, (b, t), dev)?,
            at: Tensor::from_vec(at, n, dev)?,
            targets: Tensor::from_vec(targets, n, dev)?,
            seg: Tensor::from_vec(seg, (b, n), dev)?,
            lens,
        })
    }

    pub fn rows(&self) -> usize {
        self.lens.len()
    }

    /// Σ over each row's response positions of `x` (P,): (b,), differentiable.
    pub fn seq_sum(&self, x: &Tensor) -> Result<Tensor> {
        self.seg.to_dtype(x.dtype())?.matmul(&x.reshape((x.dim(0)?, 1))?)?.squeeze(1)
    }

    /// `seq_sum` in f64 on the host (statistics, not gradients).
    pub fn seq_sums(&self, x: &Tensor) -> Result<Vec<f64>> {
        let v: Vec<f64> = x.to_dtype(DType::F64)?.to_vec1()?;
        let mut out = Vec::with_capacity(self.lens.len());
        let mut at = 0;
        for &l in &self.lens {
            out.push(v[at..at + l].iter().sum());
            at += l;
        }
        Ok(out)
    }
}
