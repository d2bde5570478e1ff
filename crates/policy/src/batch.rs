//! Sequences (prompt, response) as training batches, with the positions whose log-probabilities
//! a loss needs: the response's tokens, each predicted from the hidden state one position
//! earlier. Two layouts compute the same function:
//!
//! - **padded** ([`SeqBatch::new`]): every row is its whole sequence, right-padded to the
//!   longest;
//! - **shared prompts** ([`SeqBatch::shared`]): consecutive rows with the same prompt form a
//!   group whose prompt runs through the decoder once and whose responses attend to its keys
//!   and values (prefix sharing). RLOO's k samples of a prompt, DPO's chosen and rejected and
//!   an evaluation's samples of a held-out prompt all share their prompt, so a group of k
//!   costs P + k·R token positions instead of k·(P + R).

use candle_core::{DType, Device, Result, Tensor};

/// How the rows of a [`SeqBatch`] are laid out for the decoder.
pub enum Layout {
    /// (b, t) ids, pads (id 0) only after a row's last token, so causal attention never lets a
    /// real token see one; `at` (P,) holds the flat indices r·t + (j − 1) of the hidden states
    /// that predict response token j.
    Padded { ids: Tensor, at: Tensor },
    /// Groups of consecutive rows sharing a prompt, in row order.
    Shared(Vec<Group>),
}

/// Rows that share a prompt: the prompt once, the responses right-padded after it.
pub struct Group {
    /// (1, p) the prompt's ids.
    pub prompt: Tensor,
    /// (k, r) the responses' ids (positions p..p + r), right-padded with id 0.
    pub responses: Tensor,
    /// Indices into [the prompt's last hidden state; the responses' hidden states (k·r rows)]:
    /// response token 0 is predicted from the prompt's last position (index 0), token j ≥ 1 of
    /// response i from its position j − 1 (index 1 + i·r + j − 1).
    pub at: Tensor,
}

/// A batch and the response positions of its rows.
pub struct SeqBatch {
    pub layout: Layout,
    /// (P,) the response tokens, row after row.
    pub targets: Tensor,
    /// (b, P): 1 where position p belongs to row r (sums per sequence as one product).
    seg: Tensor,
    /// Response tokens per row.
    pub lens: Vec<usize>,
}

fn check(seqs: &[(&[u32], &[u32])]) -> Result<()> {
    if seqs.is_empty() {
        candle_core::bail!("an empty batch");
    }
    if let Some(i) = seqs.iter().position(|(p, r)| p.is_empty() || r.is_empty()) {
        candle_core::bail!("row {i}: a prompt and a response need at least one token each");
    }
    Ok(())
}

impl SeqBatch {
    /// The padded layout. `seqs`: (prompt ids, response ids) per row; every response has at
    /// least one token and every prompt at least one (the response's first token is predicted
    /// from the prompt).
    pub fn new(seqs: &[(&[u32], &[u32])], dev: &Device) -> Result<SeqBatch> {
        check(seqs)?;
        let t = seqs.iter().map(|(p, r)| p.len() + r.len()).max().expect("non-empty");
        let b = seqs.len();
        let mut ids = vec![0u32; b * t];
        let mut at = Vec::new();
        for (row, (p, r)) in seqs.iter().enumerate() {
            let base = row * t;
            ids[base..base + p.len()].copy_from_slice(p);
            ids[base + p.len()..base + p.len() + r.len()].copy_from_slice(r);
            at.extend((0..r.len()).map(|i| (base + p.len() + i - 1) as u32));
        }
        let n = at.len();
        let layout = Layout::Padded { ids: Tensor::from_vec(ids, (b, t), dev)?, at: Tensor::from_vec(at, n, dev)? };
        SeqBatch::finish(seqs, layout, dev)
    }

    /// The shared-prompt layout: consecutive rows with equal prompts form one [`Group`] (a
    /// prompt repeated further away starts another). Same rows, same results as [`SeqBatch::new`]
    /// up to the order of floating-point sums.
    pub fn shared(seqs: &[(&[u32], &[u32])], dev: &Device) -> Result<SeqBatch> {
        check(seqs)?;
        let mut groups = Vec::new();
        let mut start = 0;
        while start < seqs.len() {
            let p = seqs[start].0;
            let end = start + seqs[start..].iter().take_while(|(q, _)| *q == p).count();
            let rs = &seqs[start..end];
            let (k, r) = (rs.len(), rs.iter().map(|(_, r)| r.len()).max().expect("non-empty"));
            let mut ids = vec![0u32; k * r];
            let mut at = Vec::new();
            for (i, (_, resp)) in rs.iter().enumerate() {
                ids[i * r..i * r + resp.len()].copy_from_slice(resp);
                at.push(0u32);
                at.extend((1..resp.len()).map(|j| (1 + i * r + j - 1) as u32));
            }
            let n = at.len();
            groups.push(Group {
                prompt: Tensor::from_vec(p.to_vec(), (1, p.len()), dev)?,
                responses: Tensor::from_vec(ids, (k, r), dev)?,
                at: Tensor::from_vec(at, n, dev)?,
            });
            start = end;
        }
        SeqBatch::finish(seqs, Layout::Shared(groups), dev)
    }

    fn finish(seqs: &[(&[u32], &[u32])], layout: Layout, dev: &Device) -> Result<SeqBatch> {
        let targets: Vec<u32> = seqs.iter().flat_map(|(_, r)| r.iter().copied()).collect();
        let lens: Vec<usize> = seqs.iter().map(|(_, r)| r.len()).collect();
        let (b, n) = (seqs.len(), targets.len());
        let mut seg = vec![0f32; b * n];
        let mut col = 0;
        for (row, &l) in lens.iter().enumerate() {
            seg[row * n + col..row * n + col + l].iter_mut().for_each(|v| *v = 1.0);
            col += l;
        }
        Ok(SeqBatch {
            layout,
            targets: Tensor::from_vec(targets, n, dev)?,
            seg: Tensor::from_vec(seg, (b, n), dev)?,
            lens,
        })
    }

    /// The padded layout's (b, t) ids; None for shared prompts.
    pub fn padded_ids(&self) -> Option<&Tensor> {
        match &self.layout {
            Layout::Padded { ids, .. } => Some(ids),
            Layout::Shared(_) => None,
        }
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
