//! f32 products on the packed kernel (`PolicyModel::use_packed_products(false)`, issue 31: what
//! onepass trains and scores with in f32 on the CPU): every frozen weight and the LM head
//! packed once for `kernels::f32mm`'s forward x Wᵀ of passes of at most
//! `F32_PACKED_MAX_ROWS` rows, instead of candle's matmul, which packs W on every call (longer
//! passes and every backward g W stay candle's, the faster there). The values and every adapter's gradient are candle's to
//! f32 rounding (the two sum in different orders); a merge packs the merged weight again (else
//! the policy would go on computing the old one); what cannot pack (f64, every weight
//! learning, a GPU's kernels) is refused.

mod common;

use candle_core::{DType, Device};
use common::*;
use features::model::Family;
use policy::batch::SeqBatch;
use policy::{LoraConfig, PolicyModel, Target};

fn batch() -> SeqBatch {
    let seqs: [(&[u32], &[u32]); 3] = [(&[1, 5, 3], &[9, 2, 4]), (&[4, 2], &[10, 0, 6, 8]), (&[7, 7, 1, 3], &[2])];
    SeqBatch::new(&seqs, &Device::Cpu).unwrap()
}

fn lora() -> LoraConfig {
    LoraConfig { rank: 2, alpha: 4.0, targets: Target::ALL.to_vec(), seed: 2, dropout: 0.0 }
}

#[test]
fn packed_f32_products_give_candles_values_and_gradients() {
    let b = batch();
    for (family, interleaved) in [(Family::Llama, true), (Family::Qwen2, false)] {
        let c = cfg(family, interleaved);
        let plain = PolicyModel::new(weights(&c, 4), c.clone(), &lora(), 32, DType::F32).unwrap();
        let mut packed = PolicyModel::new(weights(&c, 4), c.clone(), &lora(), 32, DType::F32).unwrap();
        assert!(packed.can_pack_products());
        packed.use_packed_products(false).unwrap();
        assert!(packed.packed_products() && !packed.bf16_products());
        randomize(&plain, 7);
        randomize(&packed, 7);
        let (v0, g0) = values_and_gradients(&plain, &b);
        let (v1, g1) = values_and_gradients(&packed, &b);
        let v_err = rel(&v1, &v0);
        let g_err = g1.iter().zip(&g0).map(|(a, b)| rel(a, b)).fold(0.0, f64::max);
        assert!(v_err < 1e-5 && g_err < 1e-4, "{family:?}: values {v_err:e}, gradients {g_err:e}");
        // the reference pass (no adapters) runs the packed products too
        let r0: Vec<f32> = plain.logprobs_scored(&b, false).unwrap().to_vec1().unwrap();
        let r1: Vec<f32> = packed.logprobs_scored(&b, false).unwrap().to_vec1().unwrap();
        assert!(max_rel(&r1, &r0) < 1e-5, "{family:?}: reference pass {:e}", max_rel(&r1, &r0));
        // negative control: other weights, packed, are far from these
        let mut other = PolicyModel::new(weights(&c, 5), c.clone(), &lora(), 32, DType::F32).unwrap();
        other.use_packed_products(false).unwrap();
        randomize(&other, 7);
        let (v2, _) = values_and_gradients(&other, &b);
        assert!(rel(&v2, &v0) > 1e-2, "negative control: other weights give {:e}", rel(&v2, &v0));
    }
}

#[test]
fn a_merge_packs_the_merged_weight_again() {
    let c = cfg(Family::Llama, false);
    let b = batch();
    let lp =
        |m: &PolicyModel, adapters: bool| -> Vec<f32> { m.logprobs_scored(&b, adapters).unwrap().to_vec1().unwrap() };
    let mut plain = PolicyModel::new(weights(&c, 3), c.clone(), &lora(), 32, DType::F32).unwrap();
    let mut packed = PolicyModel::new(weights(&c, 3), c.clone(), &lora(), 32, DType::F32).unwrap();
    packed.use_packed_products(false).unwrap();
    randomize(&plain, 9);
    randomize(&packed, 9);
    let (adapted, reference) = (lp(&packed, true), lp(&packed, false));
    assert!(max_rel(&adapted, &reference) > 1e-3, "negative control: the adapters move the policy");
    plain.merge_and_reset(11).unwrap();
    packed.merge_and_reset(11).unwrap();
    // B is 0 again: the merged weight alone computes the adapted policy (a stale packing would
    // compute the reference), and the reference is still the weight before the merge
    let (after, after_ref) = (lp(&packed, true), lp(&packed, false));
    assert!(max_rel(&after, &adapted) < 1e-5, "the merged policy moved: {:e}", max_rel(&after, &adapted));
    assert!(max_rel(&after_ref, &reference) < 1e-5, "the reference moved: {:e}", max_rel(&after_ref, &reference));
    assert!(max_rel(&after, &after_ref) > 1e-3, "after the merge the policy is its reference");
    assert!(max_rel(&after, &lp(&plain, true)) < 1e-5, "packed and plain merges differ");
    // a second merge: the reference stays the first weight
    randomize(&plain, 12);
    randomize(&packed, 12);
    plain.merge_and_reset(13).unwrap();
    packed.merge_and_reset(13).unwrap();
    assert!(max_rel(&lp(&packed, true), &lp(&plain, true)) < 1e-5);
    assert!(max_rel(&lp(&packed, false), &reference) < 1e-5, "the reference after two merges");
}

#[test]
fn packed_products_are_refused_where_they_do_not_apply() {
    let c = cfg(Family::Qwen2, false);
    let w64 = weights(&c, 1).into_iter().map(|(k, v)| (k, v.to_dtype(DType::F64).unwrap())).collect();
    let mut m = PolicyModel::new(w64, c.clone(), &lora(), 32, DType::F64).unwrap();
    assert!(!m.can_pack_products());
    assert!(m.use_packed_products(false).unwrap_err().to_string().contains("F64"));
    let mut full = PolicyModel::new_full(weights(&c, 1), c.clone(), 32, DType::F32).unwrap();
    assert!(!full.can_pack_products());
    assert!(full.use_packed_products(false).unwrap_err().to_string().contains("full-parameter"));
    let mut composed = PolicyModel::new(weights(&c, 1), c, &lora(), 32, DType::F32).unwrap();
    composed.set_kernels(policy::ops::Kernels::Composed).unwrap();
    assert!(!composed.can_pack_products() && composed.use_packed_products(false).is_err());
}

/// The f32 packing's routing (session 33): a forward of at most `F32_PACKED_MAX_ROWS` rows runs
/// on the packed kernel (its bits exactly), a longer one and every backward g W on `gemm` (not
/// the packed kernel's bits; candle's matmul's values to f32 rounding).
#[test]
fn f32_packing_runs_short_forwards_packed_and_the_rest_on_gemm() {
    use candle_core::Tensor;
    use kernels::packed::PackedMatrix;
    use policy::lora::{PackedWeight, F32_PACKED_MAX_ROWS};
    // both contractions long: gemm splits a sum this long into blocks, the packed kernel adds it
    // in order, so the two differ in some bits (what tells the paths apart)
    let (n, k) = (1024, 1536);
    let vals = |len: usize, seed: usize| -> Vec<f32> {
        (0..len).map(|i| (((i * 7919 + seed * 104_729) % 2001) as f32 / 1000.0) - 1.0).collect()
    };
    let wv = vals(n * k, 1);
    let w = Tensor::from_vec(wv.clone(), (n, k), &Device::Cpu).unwrap();
    let wt: Vec<f32> = w.t().unwrap().contiguous().unwrap().flatten_all().unwrap().to_vec1().unwrap();
    let (kernel_w, kernel_wt) =
        (kernels::f32mm::F32Matrix::from_f32(&wv, n, k), kernels::f32mm::F32Matrix::from_f32(&wt, k, n));
    let p = PackedWeight::f32(&w).unwrap();
    let flat = |t: &Tensor| -> Vec<f32> { t.flatten_all().unwrap().to_vec1().unwrap() };
    let differ = |a: &[f32], b: &[f32]| a.iter().zip(b).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
    for rows in [F32_PACKED_MAX_ROWS, F32_PACKED_MAX_ROWS + 1] {
        let (xv, gv) = (vals(rows * k, 2), vals(rows * n, 3));
        let x = Tensor::from_vec(xv.clone(), (rows, k), &Device::Cpu).unwrap();
        let g = Tensor::from_vec(gv.clone(), (rows, n), &Device::Cpu).unwrap();
        let (y, dx) = (flat(&p.forward(&x).unwrap()), flat(&p.backward(&g).unwrap()));
        let (y0, dx0) = (flat(&x.matmul(&w.t().unwrap()).unwrap()), flat(&g.matmul(&w).unwrap()));
        assert!(
            max_rel(&y, &y0) < 1e-5 && max_rel(&dx, &dx0) < 1e-5,
            "rows {rows}: {:e} {:e}",
            max_rel(&y, &y0),
            max_rel(&dx, &dx0)
        );
        let packed_y = differ(&y, &kernel_w.matmul_t(&xv, rows));
        if rows > F32_PACKED_MAX_ROWS {
            assert!(packed_y > 0, "rows {rows}: a long forward ran on the packed kernel");
        } else {
            assert_eq!(packed_y, 0, "rows {rows}: a short forward is the packed kernel's");
        }
        assert!(differ(&dx, &kernel_wt.matmul_t(&gv, rows)) > 0, "rows {rows}: the backward ran on the packed kernel");
    }
    // a model pass longer than the bound (candle's matmul through the packed weights' fallback:
    // a transposed or mis-shaped product there would be far off) against the unpacked model
    let c = cfg(Family::Llama, false);
    let long: Vec<u32> = (0..(F32_PACKED_MAX_ROWS as u32 / 2 + 8)).map(|i| (i * 7 + 3) % 11).collect();
    let b = SeqBatch::new(&[(&long[..8], &long[8..]), (&long[..5], &long[5..])], &Device::Cpu).unwrap();
    let max_len = long.len() + 1;
    let plain = PolicyModel::new(weights(&c, 4), c.clone(), &lora(), max_len, DType::F32).unwrap();
    let mut packed = PolicyModel::new(weights(&c, 4), c.clone(), &lora(), max_len, DType::F32).unwrap();
    packed.use_packed_products(false).unwrap();
    randomize(&plain, 7);
    randomize(&packed, 7);
    let (v0, g0) = values_and_gradients(&plain, &b);
    let (v1, g1) = values_and_gradients(&packed, &b);
    let (v_err, g_err) = (rel(&v1, &v0), g1.iter().zip(&g0).map(|(a, b)| rel(a, b)).fold(0.0, f64::max));
    assert!(v_err < 1e-6 && g_err < 1e-5, "a long pass: values {v_err:e}, gradients {g_err:e}");
}
