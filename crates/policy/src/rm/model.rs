//! A reward model whose features learn (issue 30; the paper's appendix "Full update of reward
//! model"): r_{ψ,θ}(x, a) = θᵀ h_ψ(x, a), h the final-norm hidden state at the last token of the
//! chat-templated conversation — `features`' φ when ψ is the base model — ψ the LoRA adapters of
//! a [`PolicyModel`] or all its weights ([`PolicyModel::new_full`]), θ a linear head.
//!
//! Its one-pass update over (ψ, θ) is `crate::rm::update`'s `OnePass`, its exact Hessian–vector
//! products `crate::rm::rop`'s; candle has no double backward, so [`RewardModel::hvp`] takes them by
//! central differences of gradients (its doc states the step and its error).

use crate::model::PolicyModel;
use candle_core::{DType, Result, Tensor, Var};

/// `seqs` as one right-padded batch: the ids (n·t, pad 0), each sequence's last row in the
/// flattened (n·t) layout, and t. An error for no sequences or an empty one.
pub(crate) fn padded(seqs: &[&[u32]]) -> Result<(Vec<u32>, Vec<u32>, usize)> {
    let n = seqs.len();
    if n == 0 || seqs.iter().any(|s| s.is_empty()) {
        candle_core::bail!("reward model features: expected non-empty sequences, got {n} with an empty one");
    }
    let t = seqs.iter().map(|s| s.len()).max().unwrap_or(1);
    let mut ids = vec![0u32; n * t];
    let mut last = Vec::with_capacity(n);
    for (i, s) in seqs.iter().enumerate() {
        ids[i * t..i * t + s.len()].copy_from_slice(s);
        last.push((i * t + s.len() - 1) as u32);
    }
    Ok((ids, last, t))
}

/// One labelled comparison: the token ids of the two chat-templated conversations (x, a) and
/// (x, a′), and y = 1 when a is preferred (Bradley–Terry: P(y = 1) = σ(r(x, a) − r(x, a′))).
#[derive(Clone, Copy, Debug)]
pub struct RmPair<'a> {
    pub a: &'a [u32],
    pub b: &'a [u32],
    pub y: f32,
}

/// r_{ψ,θ} = θᵀh_ψ: a backbone and its head.
pub struct RewardModel {
    /// The backbone: its adapters (or every weight) are ψ.
    pub model: PolicyModel,
    /// θ: (hidden,).
    pub head: Var,
    /// Whether ψ trains. With false only θ is a parameter of the updates: h is then the base
    /// model's φ and the updates are the head-only estimators' (the equivalence issue 30 tests).
    train_backbone: bool,
    /// Pairs per forward and backward pass ([`RewardModel::set_pairs_per_pass`]).
    pairs_per_pass: usize,
}

/// What one forward and backward pass over a batch gave.
pub struct Gradient {
    /// The batch's loss, accuracy (ties count ½) and κ, as the head-only estimators report
    /// them ([`estimators::BatchStats`], from the same margins).
    pub stats: estimators::BatchStats,
    /// ∂loss/∂ each trainable variable, in [`RewardModel::vars`] order.
    pub grads: Vec<Tensor>,
    /// σ′(mᵢ) of each pair's margin at these parameters, in the batch's order: the
    /// Bradley–Terry curvature that [`RewardModel::gauss_newton_vp`] weighs the pairs by.
    pub curvature: Vec<f64>,
}

impl RewardModel {
    /// A reward model on `model` with head `theta` (one weight per hidden unit).
    pub fn new(model: PolicyModel, theta: &[f64], train_backbone: bool) -> Result<RewardModel> {
        let d = model.config().hidden;
        if theta.len() != d {
            candle_core::bail!("a reward head of {} weights for a model of hidden size {d}", theta.len());
        }
        let t = Tensor::from_vec(theta.to_vec(), d, model.device())?.to_dtype(model.var_dtype())?;
        Ok(RewardModel { model, head: Var::from_tensor(&t)?, train_backbone, pairs_per_pass: usize::MAX })
    }

    pub fn trains_backbone(&self) -> bool {
        self.train_backbone
    }

    /// The trainable variables: ψ (in [`PolicyModel::vars`] order) when the backbone trains,
    /// then θ.
    pub fn vars(&self) -> Vec<&Var> {
        let mut v = if self.train_backbone { self.model.vars() } else { Vec::new() };
        v.push(&self.head);
        v
    }

    /// Their names: PEFT's for adapters, Hugging Face's for full weights, `score.weight` for θ
    /// (transformers' sequence-classification head).
    pub fn var_names(&self) -> Vec<String> {
        let mut v = if self.train_backbone { self.model.var_names() } else { Vec::new() };
        v.push("score.weight".into());
        v
    }

    /// The number of trainable parameters.
    pub fn dim(&self) -> usize {
        self.vars().iter().map(|v| v.as_tensor().elem_count()).sum()
    }

    /// θ as f64.
    pub fn head_values(&self) -> Result<Vec<f64>> {
        self.head.as_tensor().to_dtype(DType::F64)?.to_vec1()
    }

    /// h_ψ of each sequence (n, hidden): the final-norm hidden state at its last token. The
    /// sequences run as one right-padded batch; with causal attention the last real token never
    /// sees a pad, so h does not depend on the batch's other sequences.
    pub fn features(&self, seqs: &[&[u32]]) -> Result<Tensor> {
        let (ids, last, t) = padded(seqs)?;
        let n = seqs.len();
        let dev = self.model.device();
        let ids = Tensor::from_vec(ids, (n, t), dev)?;
        // the last block's projections and MLP, and the final norm, on the last tokens alone
        self.model.hidden_at(&ids, true, &last)
    }

    /// r_{ψ,θ} of each sequence (n,).
    pub fn rewards(&self, seqs: &[&[u32]]) -> Result<Tensor> {
        let h = self.features(seqs)?;
        let d = h.dim(1)?;
        h.matmul(&self.head.as_tensor().reshape((d, 1))?)?.squeeze(1)
    }

    /// The margins m_i = r(x, a_i) − r(x, a′_i) of `pairs` (n,), a's and a′'s in one batch.
    pub fn margins(&self, pairs: &[RmPair<'_>]) -> Result<Tensor> {
        let n = pairs.len();
        let seqs: Vec<&[u32]> = pairs.iter().map(|p| p.a).chain(pairs.iter().map(|p| p.b)).collect();
        let r = self.rewards(&seqs)?;
        r.narrow(0, 0, n)? - r.narrow(0, n, n)?
    }

    /// The batch-mean Bradley–Terry loss (1/B) Σ log(1 + e^{m_i}) − y_i·m_i (the loss of the
    /// head-only estimators, `estimators::logistic`), as a graph to differentiate.
    pub fn loss(&self, pairs: &[RmPair<'_>]) -> Result<Tensor> {
        if pairs.is_empty() {
            candle_core::bail!("reward model loss: no pairs");
        }
        Self::loss_of(&self.margins(pairs)?, pairs)
    }

    fn loss_of(m: &Tensor, pairs: &[RmPair<'_>]) -> Result<Tensor> {
        let y: Vec<f32> = pairs.iter().map(|p| p.y).collect();
        let y = Tensor::from_vec(y, pairs.len(), m.device())?.to_dtype(m.dtype())?;
        // softplus(m) = max(m, 0) + log(1 + e^{−|m|}), stable for large |m|
        let sp = (m.relu()? + (m.abs()?.neg()?.exp()? + 1.0)?.log()?)?;
        (sp - (m * y)?)?.mean_all()
    }

    /// The loss, the accuracy and the gradient of every trainable variable on `pairs`. A
    /// variable the loss does not reach is an error naming it, never a zero gradient. The
    /// backward passes take [`RewardModel::set_pairs_per_pass`] pairs at a time (a pass's
    /// activations are most of a step's memory): the batch-mean loss is the sum over passes of
    /// each pass's mean weighted by its share of the pairs, and so is its gradient.
    pub fn gradient(&self, pairs: &[RmPair<'_>]) -> Result<Gradient> {
        if pairs.is_empty() {
            candle_core::bail!("reward model gradient: no pairs");
        }
        let n = pairs.len();
        // each pass's batch-mean loss weighted by its share of the pairs
        let (grads, loss, margins) = self.passes(pairs, |m, part, _| {
            let (l, share) = (Self::loss_of(m, part)?, part.len() as f64 / n as f64);
            Ok(((&l * share)?, share * l.to_dtype(DType::F64)?.to_scalar::<f64>()?))
        })?;
        let y: Vec<f32> = pairs.iter().map(|p| p.y).collect();
        let (mut coef, mut curv) = (vec![0.0; n], vec![0.0; n]);
        let mut stats = estimators::BatchStats::compute(&margins, &y, &mut coef, &mut curv);
        // the graph's own loss (what was differentiated), not the f64 recomputation
        stats.loss = loss;
        Ok(Gradient { stats, grads, curvature: curv })
    }

    /// The gradient of Σ over passes of `objective(margins, pairs, indices)` (a scalar built on
    /// the pass's margins, and the value it adds to the sum reported), the passes
    /// [`RewardModel::set_pairs_per_pass`] pairs at a time: the gradients, the reported sum and
    /// every pair's margin in the batch's order. A variable the objective does not reach is an
    /// error naming it, never a zero gradient.
    fn passes(
        &self,
        pairs: &[RmPair<'_>],
        objective: impl Fn(&Tensor, &[RmPair<'_>], &[usize]) -> Result<(Tensor, f64)>,
    ) -> Result<(Vec<Tensor>, f64, Vec<f64>)> {
        let names = self.var_names();
        let vars = self.vars();
        let n = pairs.len();
        let (mut grads, mut total): (Option<Vec<Tensor>>, f64) = (None, 0.0);
        // each pair's margin, in the batch's order
        let mut margins = vec![0.0; n];
        for idx in self.pass_groups(pairs) {
            let idx = idx.as_slice();
            let part: Vec<RmPair<'_>> = idx.iter().map(|&i| pairs[i]).collect();
            let m = self.margins(&part)?;
            let (l, value) = objective(&m, &part, idx)?;
            let store = l.backward()?;
            let gs = vars
                .iter()
                .zip(&names)
                .map(|(v, name)| {
                    store.get(v.as_tensor()).map(|g| g.detach()).ok_or_else(|| {
                        candle_core::Error::Msg(format!(
                            "reward model: {name} received no gradient (the computation graph does not reach it)"
                        ))
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            grads = Some(match grads {
                None => gs,
                Some(acc) => acc.iter().zip(&gs).map(|(a, g)| a + g).collect::<Result<Vec<_>>>()?,
            });
            total += value;
            for (&i, v) in idx.iter().zip(m.to_dtype(DType::F64)?.to_vec1::<f64>()?) {
                margins[i] = v;
            }
        }
        Ok((grads.expect("at least one pass"), total, margins))
    }

    /// The pairs of each forward and backward pass, by index: [`RewardModel::set_pairs_per_pass`]
    /// at a time. With more than one pass, the passes take the pairs sorted by their longer
    /// side (stable), so each pads to a length close to its own: on mini-hh-ci's steps of 8
    /// pairs in passes of 2 the padded tokens fall from 1.28x to 1.14x the real ones (session
    /// 26, `scripts/hh_padding.py`). The gradient is the same sum in another order.
    pub(crate) fn pass_groups(&self, pairs: &[RmPair<'_>]) -> Vec<Vec<usize>> {
        let n = pairs.len();
        let mut order: Vec<usize> = (0..n).collect();
        let per = self.pairs_per_pass.max(1);
        if per < n {
            order.sort_by_key(|&i| pairs[i].a.len().max(pairs[i].b.len()));
        }
        order.chunks(per).map(|c| c.to_vec()).collect()
    }

    /// Pairs per forward and backward pass of [`RewardModel::gradient`] (and so of each HVP):
    /// the same gradient to rounding, a fraction of the memory. Default: the whole batch.
    pub fn set_pairs_per_pass(&mut self, n: usize) {
        self.pairs_per_pass = n.max(1);
    }

    /// H·v, H the Hessian of the batch loss on `pairs` over the trainable variables, by central
    /// differences of gradients: Hv ≈ (g(w + h·v) − g(w − h·v)) / 2h with h = ε/‖v‖, so the
    /// parameters move by ε in norm whatever v's scale. Its error is O(ε²) (the third derivative
    /// along v: the even terms of the expansion cancel) plus the gradients' rounding amplified
    /// by 1/ε. On the tiny test Llama against PyTorch's exact double-backward HVPs
    /// (`tests/reward.rs`): relative error 6e-11–5e-9 in f64 at ε = 1e-5; in f32 1e-4–5e-4 at
    /// ε = 3e-3, the balance of the two (3e-3–4e-2 at ε = 1e-4, 2e-2–1.1 at ε = 0.3). Costs two
    /// forward and backward passes; the variables are restored bit for bit.
    pub fn hvp(&self, pairs: &[RmPair<'_>], v: &[Tensor], eps: f64) -> Result<Vec<Tensor>> {
        self.hvp_with(pairs, v, eps, None)
    }

    /// [`RewardModel::hvp`] by central differences (`g0` None), or by forward differences
    /// Hv ≈ (g(w + h·v) − g(w)) / h given `g0` = g(w): one pass instead of two, error O(ε)
    /// instead of O(ε²) (measured against the exact HVPs in `tests/reward.rs`).
    pub fn hvp_with(&self, pairs: &[RmPair<'_>], v: &[Tensor], eps: f64, g0: Option<&[Tensor]>) -> Result<Vec<Tensor>> {
        let signs: &[f64] = if g0.is_some() { &[1.0] } else { &[1.0, -1.0] };
        let Some((h, g)) = self.along(v, eps, signs, || Ok(self.gradient(pairs)?.grads))? else {
            return v.iter().map(|t| t.zeros_like()).collect();
        };
        match g0 {
            Some(g0) => g[0].iter().zip(g0).map(|(p, g)| (p - g)? / h).collect(),
            None => g[0].iter().zip(&g[1]).map(|(p, m)| (p - m)? / (2.0 * h)).collect(),
        }
    }

    /// `f` with the variables at w + s·h·v for each s of `signs` in turn, h = ε/‖v‖ (so the
    /// parameters move by ε in norm whatever v's scale), stopping at the first error; the
    /// variables are restored bit for bit afterwards, error or not. (h, the values), or None
    /// for v = 0. The differences of [`RewardModel::hvp_with`] and
    /// [`RewardModel::gauss_newton_vp`].
    fn along<T>(
        &self,
        v: &[Tensor],
        eps: f64,
        signs: &[f64],
        mut f: impl FnMut() -> Result<T>,
    ) -> Result<Option<(f64, Vec<T>)>> {
        let vars = self.vars();
        if v.len() != vars.len() {
            candle_core::bail!("a curvature product's direction of {} tensors for {} variables", v.len(), vars.len());
        }
        // each tensor's Σ v² on the device, read back together (one transfer), summed in order
        let sums = v.iter().map(|t| t.to_dtype(DType::F64)?.sqr()?.sum_all()).collect::<Result<Vec<_>>>()?;
        let sq: f64 = match sums.is_empty() {
            true => 0.0,
            false => Tensor::stack(&sums, 0)?.to_vec1::<f64>()?.iter().sum(),
        };
        let norm = sq.sqrt();
        if norm == 0.0 {
            return Ok(None);
        }
        if !norm.is_finite() || !eps.is_finite() || eps <= 0.0 {
            candle_core::bail!(
                "a curvature product along a direction of norm {norm} with step {eps}: expected finite and positive"
            );
        }
        let h = eps / norm;
        let w: Vec<Tensor> = vars.iter().map(|x| x.as_tensor().copy()).collect::<Result<_>>()?;
        let mut out = Vec::with_capacity(signs.len());
        let mut run = || -> Result<()> {
            for &sign in signs {
                for ((x, w), v) in vars.iter().zip(&w).zip(v) {
                    x.set(&(w + (v.to_dtype(w.dtype())? * (sign * h))?)?)?;
                }
                out.push(f()?);
            }
            Ok(())
        };
        let done = run();
        for (x, w) in vars.iter().zip(&w) {
            x.set(w)?;
        }
        done?;
        Ok(Some((h, out)))
    }

    /// G·v, G = (1/B) Σᵢ σ′(mᵢ) ∇mᵢ ∇mᵢᵀ the Gauss–Newton matrix of the batch loss on `pairs`
    /// (`curvature` = σ′(mᵢ) at the current parameters, [`Gradient::curvature`]): paper Alg. 5's
    /// H_t = Σ σ′(zᵀθ) z zᵀ with the feature difference z replaced by the margin's gradient
    /// over every trainable parameter — the Hessian itself for a linear head, and for a network
    /// the Hessian without the term Σ ℓ′(mᵢ) ∇²mᵢ, so G is positive semi-definite wherever the
    /// loss is not convex (Schraudolph 2002; Martens 2010's Hessian-free optimisation).
    /// Computed as Jᵀ(c ⊙ Jv): each Jv = ∇mᵢᵀv by central differences of the margins,
    /// (mᵢ(w + hv) − mᵢ(w − hv)) / 2h with h = ε/‖v‖ (two forward passes, error O(ε²)), then one
    /// backward pass of Σᵢ cᵢ mᵢ with cᵢ = σ′(mᵢ)·Jvᵢ/B. The variables are restored bit for bit.
    pub fn gauss_newton_vp(
        &self,
        pairs: &[RmPair<'_>],
        v: &[Tensor],
        eps: f64,
        curvature: &[f64],
    ) -> Result<Vec<Tensor>> {
        let n = pairs.len();
        if curvature.len() != n || n == 0 {
            candle_core::bail!("a Gauss–Newton product with {} curvatures for {n} pairs", curvature.len());
        }
        // the margins at w ± h·v, in passes of pairs_per_pass, no backward
        let margins = || -> Result<Vec<f64>> {
            let mut m = Vec::with_capacity(n);
            for part in pairs.chunks(self.pairs_per_pass.max(1)) {
                m.extend(self.margins(part)?.detach().to_dtype(DType::F64)?.to_vec1::<f64>()?);
            }
            Ok(m)
        };
        let Some((h, m)) = self.along(v, eps, &[1.0, -1.0], margins)? else {
            return v.iter().map(|t| t.zeros_like()).collect();
        };
        let (plus, minus) = (&m[0], &m[1]);
        let c: Vec<f64> = (0..n).map(|i| curvature[i] * (plus[i] - minus[i]) / (2.0 * h) / n as f64).collect();
        let (gv, _, _) = self.passes(pairs, |m, _, idx| {
            let ci: Vec<f64> = idx.iter().map(|&i| c[i]).collect();
            let ci = Tensor::from_vec(ci, idx.len(), m.device())?.to_dtype(m.dtype())?;
            Ok(((m * ci)?.sum_all()?, 0.0))
        })?;
        Ok(gv)
    }

    /// The trainable variables' values, flattened and concatenated in [`RewardModel::vars`]
    /// order, as f32.
    pub fn flat(&self) -> Result<Vec<f32>> {
        flatten(&self.vars().iter().map(|v| v.as_tensor().clone()).collect::<Vec<_>>())
    }

    /// Sets the trainable variables from [`RewardModel::flat`]'s layout.
    pub fn set_flat(&self, x: &[f32]) -> Result<()> {
        let vars = self.vars();
        let parts = unflatten(x, &vars)?;
        for (v, p) in vars.iter().zip(parts) {
            v.set(&p)?;
        }
        Ok(())
    }
}

/// Tensors flattened and concatenated, as f32: concatenated on their device and read back in
/// one transfer (a LoRA reward model has ~400 variables; one synchronising copy each was a
/// GPU step's hundreds of host round trips).
pub fn flatten(ts: &[Tensor]) -> Result<Vec<f32>> {
    if ts.is_empty() {
        return Ok(Vec::new());
    }
    let parts = ts.iter().map(|t| t.flatten_all()?.to_dtype(DType::F32)).collect::<Result<Vec<_>>>()?;
    Tensor::cat(&parts, 0)?.to_vec1::<f32>()
}

/// `x` cut into tensors of the shapes, dtypes and device of `like`: sent in one transfer, then
/// cut on the device.
pub fn unflatten(x: &[f32], like: &[&Var]) -> Result<Vec<Tensor>> {
    let total: usize = like.iter().map(|v| v.as_tensor().elem_count()).sum();
    if x.len() != total {
        candle_core::bail!("{} values for variables of {total} elements", x.len());
    }
    let Some(first) = like.first() else { return Ok(Vec::new()) };
    let all = Tensor::from_slice(x, total, first.as_tensor().device())?;
    let mut at = 0;
    like.iter()
        .map(|v| {
            let t = v.as_tensor();
            let n = t.elem_count();
            let part = all.narrow(0, at, n)?.reshape(t.shape())?.to_dtype(t.dtype())?;
            at += n;
            Ok(part)
        })
        .collect()
}
