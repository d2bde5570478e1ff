//! The adapters' life cycle besides training (issue 29: the authors' fresh adapter per chunk and
//! chunk-start KL reference): a merge keeps the policy and starts a fresh adapter (B = 0, A
//! redrawn); the reference pass keeps computing the policy it computed until it is moved; a
//! checkpoint's replay rebuilds the same model bit for bit; the digest changes with a merge.

mod common;

use candle_core::{DType, Device, Tensor};
use common::*;
use features::model::Family;
use policy::batch::SeqBatch;
use policy::{LoraConfig, PolicyModel, Target};
use std::collections::HashMap;

const SEQS: [(&[u32], &[u32]); 3] = [(&[1, 5, 3], &[9, 2, 4]), (&[4], &[10, 0, 6, 8]), (&[7, 7, 2, 1], &[3])];

fn model(dtype: DType) -> PolicyModel {
    let c = cfg(Family::Llama, false);
    let w: HashMap<String, Tensor> =
        weights(&c, 23).into_iter().map(|(k, v)| (k, v.to_dtype(dtype).unwrap())).collect();
    let lora = LoraConfig {
        rank: 2,
        alpha: 4.0,
        targets: vec![Target::QProj, Target::VProj, Target::DownProj],
        seed: 6,
        dropout: 0.0,
    };
    PolicyModel::new(w, c, &lora, 32, dtype).unwrap()
}

fn lp(m: &PolicyModel, adapters: bool) -> Vec<f64> {
    let b = SeqBatch::shared(&SEQS, &Device::Cpu).unwrap();
    m.logprobs_at(&b, adapters).unwrap().to_dtype(DType::F64).unwrap().to_vec1().unwrap()
}

/// Merging keeps the policy (the adapted pass before = after, up to f64 rounding), the next
/// adapter starts at B = 0 with A redrawn from the seed, and the reference pass still computes
/// the initial policy; after `reference_here` it computes the merged one. Negative control:
/// the policy moved, so the reference (initial) differs from it.
#[test]
fn a_merge_keeps_the_policy_and_starts_a_fresh_adapter() {
    let mut m = model(DType::F64);
    let base = lp(&m, false);
    randomize(&m, 3);
    let policy = lp(&m, true);
    assert!(rel(&policy, &base) > 1e-3, "negative control: the adapters moved the policy");
    let a_before: Vec<Vec<f32>> = m.var_values().unwrap();
    let d0 = m.digest().unwrap();
    m.merge_and_reset(41).unwrap();
    assert!(rel(&lp(&m, true), &policy) < 1e-12, "the merged policy is the adapted one");
    for (_, ad) in m.adapters() {
        assert!(policy::lora::is_zero(ad.b.as_tensor()).unwrap(), "the fresh adapter starts at B = 0");
    }
    let a_after = m.var_values().unwrap();
    assert_ne!(a_before[0], a_after[0], "A is redrawn");
    assert!(rel(&lp(&m, false), &base) < 1e-12, "the reference is still the initial policy");
    assert!(!m.at_reference().unwrap(), "B = 0 but W moved: not at the (initial) reference");
    let d1 = m.digest().unwrap();
    assert_ne!(d0, d1);
    // the same fresh draw from the same seed on another model, merged from other values: the
    // digest still differs (it chains the merged adapters)
    let mut other = model(DType::F64);
    randomize(&other, 4);
    other.merge_and_reset(41).unwrap();
    assert_eq!(other.var_values().unwrap(), a_after, "A's redraw depends on the seed alone");
    assert_ne!(other.digest().unwrap(), d1);
    m.reference_here().unwrap();
    assert!(rel(&lp(&m, false), &policy) < 1e-12, "the reference moved to the merged policy");
    assert!(m.at_reference().unwrap());
}

/// A persistent adapter's chunk-start reference is a frozen copy: later changes of the adapter
/// move the policy, not the reference.
#[test]
fn a_snapshot_reference_stays_while_the_adapter_moves() {
    let m0 = model(DType::F64);
    let mut m = m0;
    randomize(&m, 5);
    let start = lp(&m, true);
    m.reference_here().unwrap();
    assert_eq!(lp(&m, false), start, "the reference is the policy it was moved to");
    randomize(&m, 6);
    let moved = lp(&m, true);
    assert!(rel(&moved, &start) > 1e-3);
    assert_eq!(lp(&m, false), start, "the adapter moved, the reference did not");
    // the reference carries no gradient
    let b = SeqBatch::shared(&SEQS, &Device::Cpu).unwrap();
    let g = m.logprobs_at(&b, false).unwrap().sum_all().unwrap().backward().unwrap();
    assert!(m.vars().iter().all(|v| g.get(v.as_tensor()).is_none()), "no gradient through the reference");
}

/// A checkpoint replays the life cycle: a fresh model given the events and the current values
/// computes the same policy, reference and digest, bit for bit (f32, as the runner trains).
#[test]
fn replaying_the_life_cycle_rebuilds_the_model_bit_for_bit() {
    let mut m = model(DType::F32);
    randomize(&m, 7);
    m.merge_and_reset(1).unwrap();
    randomize(&m, 8);
    m.reference_here().unwrap();
    randomize(&m, 9);
    m.merge_and_reset(2).unwrap();
    randomize(&m, 10);
    let (events, values) = (m.life().to_vec(), m.var_values().unwrap());
    assert_eq!(events.len(), 3);
    let mut r = model(DType::F32);
    r.replay(&events).unwrap();
    for (v, x) in r.vars().iter().zip(&values) {
        let t = v.as_tensor();
        v.set(&Tensor::from_vec(x.clone(), t.shape(), t.device()).unwrap()).unwrap();
    }
    assert_eq!(lp(&r, true), lp(&m, true));
    assert_eq!(lp(&r, false), lp(&m, false));
    assert_eq!(r.digest().unwrap(), m.digest().unwrap());
    let (wm, wr) = (m.merged_weights().unwrap(), r.merged_weights().unwrap());
    for (k, t) in &wm {
        let a: Vec<f32> = t.flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1().unwrap();
        let b: Vec<f32> = wr[k].flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1().unwrap();
        assert_eq!(a, b, "{k}");
    }
    // negative control: replaying without the last merge gives another policy
    let mut short = model(DType::F32);
    short.replay(&events[..2]).unwrap();
    assert_ne!(lp(&short, true), lp(&m, true));
}
