//! Passive data collection (paper Alg. 2) with a reward model whose features learn (issue 30,
//! `[reward] update = "lora" | "full"`): the stream of training pairs in the order `passive`
//! reads them (so the stream hash is the head-only cells'), each batch one
//! [`policy::rm::update::OnePass`] step over (ψ, θ) on the pairs' token ids; every evaluation point
//! scores the held-out pairs with the current r_{ψ,θ}. θ starts where the head-only estimator's
//! does (the config's `init`), ψ at the feature model (LoRA's B = 0) — so the first features
//! are φ.

use super::checkpoint::CellCtx;
use super::clock::BucketClock;
use super::learner::Learner;
use super::passive::file_order;
use super::rm_state::RmState;
use super::state::Progress;
use crate::plan::CellConfig;
use crate::rows::{AdapterFiles, Bucket, CellResult, MetricRow};
use crate::spec::RewardUpdate;
use crate::world::env::{seed_of, Component};
use crate::world::pairs::PairData;
use crate::world::reward::RewardBase;
use anyhow::{anyhow, Context, Result};
use estimators::logistic::{accuracy_credit, log_loss};
use policy::rm::model::{RewardModel, RmPair};
use policy::rm::update::OnePass;
use policy::PolicyModel;

/// The reward model of a cell: the feature model with fresh adapters (drawn from the cell's
/// seed) or a trainable copy of every weight, and θ₀.
pub(super) fn reward_model(cell: &CellConfig, base: &RewardBase, theta0: &[f64], seed: u32) -> Result<RewardModel> {
    let r = cell.reward.as_ref().expect("the plan routes only [reward] cells here");
    let dtype = candle_core::DType::F32;
    let model = match r.update {
        RewardUpdate::Lora => {
            let lora = r.lora(seed_of(cell.master_seed, seed, Component::RewardModel));
            PolicyModel::new(base.base.clone(), base.cfg.clone(), &lora, base.max_len, dtype)?
        }
        RewardUpdate::Full => PolicyModel::new_full(base.base.clone(), base.cfg.clone(), base.max_len, dtype)?,
        RewardUpdate::Head => return Err(anyhow!("reward.update = \"head\" learns on cached φ")),
    };
    // candle's matmul for the frozen products, not the packed f32 kernel a learning policy
    // uses: a reward-model step's passes (pairs_per_pass × 2 sequences of up to max_len
    // tokens, 1,024 rows at the default) ran 0–7% slower packed (`rm_step MODEL sgd 8 256 2`
    // with ONEPASS_PAIRS_PER_PASS 1 and 2, session 33), for +0.5 GB
    let mut rm = RewardModel::new(model, theta0, true)?;
    rm.set_pairs_per_pass(r.pairs_per_pass);
    Ok(rm)
}

/// h_ψ at the current weights: the feature model rebuilt on `features`' fused inference path
/// over the reward model's weights (the adapters merged, [`PolicyModel::merged_weights`]) — no
/// graph, the kernels φ is extracted with, the same h as the trainable path to f32 rounding.
pub(super) struct CurrentFeatures {
    model: features::model::Model,
    layer: usize,
    /// Sequences per forward pass.
    batch: usize,
    device: candle_core::Device,
}

impl CurrentFeatures {
    pub(super) fn of(rm: &RewardModel, base: &RewardBase, batch: usize) -> Result<CurrentFeatures> {
        let w = rm.model.merged_weights()?;
        let vb = candle_nn::VarBuilder::from_tensors(w, candle_core::DType::F32, &base.device);
        let model = features::model::Model::load_with(vb, base.cfg.clone(), base.max_len, None)?;
        Ok(CurrentFeatures { model, layer: base.cfg.layers, batch: batch.max(1), device: base.device.clone() })
    }

    /// Sequences per forward pass.
    pub(super) fn batch(&self) -> usize {
        self.batch
    }

    /// h of each sequence: the final-norm state at its last token, `batch` sequences per pass,
    /// in the order given. The passes take the sequences sorted by length (stable), as φ's
    /// extraction does (`features::batch_plan`), so each pass pads to a length close to its
    /// own: in the given order held-out batches of 16 HH sequences padded to 1.43x the tokens
    /// they hold, sorted 1.01x (`scripts/hh_padding.py`, session 26). A row's h does
    /// not depend on the batch it runs in beyond f32 rounding (`features`' padded-batch tests).
    pub(super) fn of_seqs(&self, seqs: &[&[u32]]) -> Result<Vec<Vec<f32>>> {
        if let Some(i) = seqs.iter().position(|s| s.is_empty()) {
            return Err(anyhow!("reward model features: sequence {i} is empty"));
        }
        let mut order: Vec<usize> = (0..seqs.len()).collect();
        order.sort_by_key(|&i| seqs[i].len());
        let mut out = vec![Vec::new(); seqs.len()];
        for part in order.chunks(self.batch) {
            let t = part.iter().map(|&i| seqs[i].len()).max().unwrap_or(1);
            let mut ids = vec![0u32; part.len() * t];
            for (r, &i) in part.iter().enumerate() {
                ids[r * t..r * t + seqs[i].len()].copy_from_slice(seqs[i]);
            }
            let ids = candle_core::Tensor::from_vec(ids, (part.len(), t), &self.device)?;
            let last: Vec<usize> = part.iter().map(|&i| seqs[i].len() - 1).collect();
            let h = self.model.hidden_at(&ids, self.layer, &last)?.to_dtype(candle_core::DType::F32)?;
            for (&i, row) in part.iter().zip(h.to_vec2::<f32>()?) {
                out[i] = row;
            }
        }
        Ok(out)
    }
}

/// Held-out loss, accuracy (ties ½) and exact ties of r_{ψ,θ}, `batch` sequences per pass, on
/// [`CurrentFeatures`].
fn evaluate(
    rm: &RewardModel,
    base: &RewardBase,
    pairs: &[(Vec<u32>, Vec<u32>)],
    y: &[f32],
    batch: usize,
) -> Result<(f64, f64, u64)> {
    let h = CurrentFeatures::of(rm, base, batch)?;
    let theta = rm.head_values()?;
    let seqs: Vec<&[u32]> = pairs.iter().flat_map(|(a, b)| [a.as_slice(), b.as_slice()]).collect();
    let r: Vec<f64> = h.of_seqs(&seqs)?.iter().map(|h| super::super::world::env::dot(h, &theta)).collect();
    let (mut loss, mut right, mut ties) = (0.0, 0.0, 0u64);
    for (i, &y) in y.iter().enumerate() {
        let m = r[2 * i] - r[2 * i + 1];
        loss += log_loss(m, f64::from(y));
        right += accuracy_credit(m, f64::from(y));
        ties += u64::from(m == 0.0);
    }
    let n = y.len() as f64;
    Ok((loss / n, right / n, ties))
}

/// Alg. 2's passive loop with a learning reward model: per step a batch of the file order, one
/// [`OnePass`] step over (ψ, θ), and at each evaluation point a metric row scored on
/// [`CurrentFeatures`]; checkpointed when the saver is due.
pub(super) fn passive_features(
    cell: &CellConfig,
    p: &PairData,
    base: &RewardBase,
    l: &mut Learner,
    seed: u32,
    ctx: &mut CellCtx,
    resumed: Option<Progress>,
) -> Result<CellResult> {
    let ids = p.ids.as_ref().ok_or_else(|| anyhow!("[reward] update: the world kept no token ids"))?;
    let r = cell.reward.as_ref().expect("routed here by [reward]");
    let b = cell.stream.batch_size;
    let steps = cell.stream.samples / b as u64;
    let mut fresh = Progress::fresh(cell.master_seed, seed);
    let order = file_order(cell, p, &mut fresh.data);
    let mut pr = resumed.unwrap_or(fresh);
    let rm = reward_model(cell, base, l.theta(), seed)?;
    let mut st = match pr.reward_state.take() {
        Some(s) => {
            rm.set_flat(&s.params).context("the checkpoint's reward model")?;
            s
        }
        None => RmState::new(OnePass::new(&cell.config.cfg, &rm, Some(steps), r.hvp_config(), r.backbone_lr_scale)?),
    };
    for t in pr.done + 1..=steps {
        let (rows, y) = next_batch(&order, &mut pr, p, t, b)?;
        let pairs: Vec<RmPair> =
            rows.iter().zip(&y).map(|(&i, &y)| RmPair { a: &ids.train[i].0, b: &ids.train[i].1, y }).collect();
        let s = st.step(&rm, &pairs)?;
        st.window.add(&s.before, b as f64);
        if t == steps || st.samples / cell.stream.eval_every > st.prev_samples / cell.stream.eval_every {
            let wall = st.bucket_clock.lap();
            let est = st.step_s - st.bucket_step_s;
            l.buckets.push(Bucket { step: t, samples_seen: st.samples, estimator_s: est, other_s: wall - est });
            let eval = evaluate(&rm, base, &ids.eval, &p.eval.y, r.eval_batch)?;
            pr.rows.push(close_window(&mut st, t, eval));
        }
        pr.done = t;
        ctx.live.publish(super::live::Snapshot::of(l, &pr));
        let due = ctx.saver.due();
        if due {
            st.params = rm.flat()?;
            pr.reward_state = Some(st);
            ctx.save(&[&*l], &pr)?;
            st = pr.reward_state.take().expect("just put");
            st.params = Vec::new();
        }
    }
    l.theta = rm.head_values()?;
    l.steps = st.steps;
    l.samples = st.samples;
    l.est_s = st.step_s;
    let adapters = reward_adapters(r.update, &rm, base)?;
    Ok(CellResult { rows: pr.rows, stream_hash: pr.hash.0, adapters, ..Default::default() })
}

/// Step `t`'s batch: the next `b` training pairs of the file order (`order` from the stream's
/// position, which moves past them) and their labels, hashed into the stream hash as the
/// head-only cells hash theirs.
fn next_batch<'o>(
    order: &'o [usize],
    pr: &mut Progress,
    p: &PairData,
    t: u64,
    b: usize,
) -> Result<(&'o [usize], Vec<f32>)> {
    let rows = order
        .get(pr.position as usize..pr.position as usize + b)
        .ok_or_else(|| anyhow!("the training pairs ran out at step {t}"))?;
    pr.position += b as u64;
    let y: Vec<f32> = rows.iter().map(|&i| p.train.y[i]).collect();
    // the head-only cells' stream hash: the same pairs in the same order
    for &i in rows {
        pr.hash.f32s(p.train.row(i));
    }
    pr.hash.f32s(&y);
    Ok((rows, y))
}

/// The evaluation point after step `t`: its metric row (the window's prequential means, the
/// held-out `eval` = (loss, accuracy, ties), the update's counters); then a fresh window and
/// bucket, whose clock starts after the held-out scoring.
fn close_window(st: &mut RmState, t: u64, eval: (f64, f64, u64)) -> MetricRow {
    let (eval_loss, eval_accuracy, eval_ties) = eval;
    let row = MetricRow {
        step: t,
        samples_seen: st.samples,
        train_loss: st.window.train_loss(),
        train_accuracy: st.window.train_accuracy(),
        eval_loss,
        eval_accuracy,
        eval_ties,
        kappa: st.window.kappa(),
        kappa_reference: st.window.kappa_reference(),
        grad_evals: st.grad_evals,
        hvp_evals: st.hvp_evals,
        negative_quad_forms: st.negative_curvature,
        converged: true,
        ..Default::default()
    };
    st.window = super::window::Window::default();
    st.bucket_step_s = st.step_s;
    // the held-out scoring is not the next bucket's
    st.bucket_clock = BucketClock::start();
    row
}

/// The cell's adapter files: LoRA's adapters and θ as a PEFT sequence classifier
/// (`adapters/<cell>/`); a full update's weights are the whole model, not written here.
fn reward_adapters(update: RewardUpdate, rm: &RewardModel, base: &RewardBase) -> Result<Vec<AdapterFiles>> {
    Ok(match update {
        RewardUpdate::Lora => {
            let (safetensors, config) = policy::peft::encode_reward(rm, &base.source)?;
            vec![AdapterFiles { dir: String::new(), safetensors, config }]
        }
        _ => Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The held-out sequences run sorted by length, their h come back in the order given: each
    /// equals the sequence's h computed alone (a row put back in the wrong place fails, since
    /// the sequences differ), and the test's order is not already the sorted one.
    #[test]
    fn features_come_back_in_the_given_order() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../features/tests/fixtures/tiny-llama-bpe.gguf");
        let source = features::Source::parse(dir.to_str().unwrap()).unwrap();
        let device = candle_core::Device::Cpu;
        let (backbone, weights, _) =
            features::Backbone::load_base(&source, &device, candle_core::DType::F32, 64).unwrap();
        let cfg = backbone.model.cfg.clone();
        let base = RewardBase {
            base: weights.clone(),
            cfg: cfg.clone(),
            max_len: 64,
            device: device.clone(),
            weights_digest: String::new(),
            source: String::new(),
            bank_ids: Vec::new(),
        };
        let lora = policy::LoraConfig { seed: 3, ..Default::default() };
        let model = policy::PolicyModel::new(weights, cfg.clone(), &lora, 64, candle_core::DType::F32).unwrap();
        let rm = RewardModel::new(model, &vec![0.0; cfg.hidden], true).unwrap();
        let h = CurrentFeatures::of(&rm, &base, 2).unwrap();
        let seqs: Vec<Vec<u32>> = [9usize, 3, 17, 5, 12, 1, 7]
            .iter()
            .enumerate()
            .map(|(i, &n)| (0..n as u32).map(|j| (j * 7 + i as u32 * 3 + 1) % cfg.vocab as u32).collect())
            .collect();
        assert!(seqs.windows(2).any(|w| w[0].len() > w[1].len()), "the order given is not sorted by length");
        let refs: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
        let got = h.of_seqs(&refs).unwrap();
        assert_eq!(got.len(), seqs.len());
        for (i, s) in refs.iter().enumerate() {
            let alone = h.of_seqs(&[s]).unwrap().remove(0);
            let scale = alone.iter().fold(0f32, |m, v| m.max(v.abs()));
            let diff = alone.iter().zip(&got[i]).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(diff <= 1e-5 * scale.max(1.0), "sequence {i}: batched vs alone differ by {diff}");
            let other = h.of_seqs(&[refs[(i + 1) % refs.len()]]).unwrap().remove(0);
            let apart = other.iter().zip(&got[i]).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(apart > 1e-3 * scale, "sequence {i}: its neighbour's h is as close ({apart})");
        }
        let empty: Vec<u32> = Vec::new();
        let e = h.of_seqs(&[refs[0], &empty]).unwrap_err().to_string();
        assert!(e.contains("sequence 1 is empty"), "{e}");
    }
}
