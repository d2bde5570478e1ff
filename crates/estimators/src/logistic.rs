//! The Bradley–Terry logistic loss ℓ(m, y) = −y log σ(m) − (1−y) log(1−σ(m)) of a margin
//! m = zᵀθ, in numerically stable forms, and the per-batch statistics every estimator reports.

/// σ(m) = 1/(1+e^{−m}), without overflow for large |m|.
#[inline]
pub fn sigmoid(m: f64) -> f64 {
    if m >= 0.0 {
        1.0 / (1.0 + (-m).exp())
    } else {
        let e = m.exp();
        e / (1.0 + e)
    }
}

/// σ'(m) = σ(m)(1 − σ(m)), in the symmetric form e/(1 + e)² with e = e^{−|m|}: σ'(m) = σ'(−m)
/// bit for bit, and no cancellation in 1 − σ(m) (s(1 − s) is exactly 0 for m ≳ 37 while the true
/// value is e^{−m} ≈ 1e−16, so κ = ∞ would come only from correctly classified pairs).
#[inline]
pub fn sigmoid_prime(m: f64) -> f64 {
    let e = (-m.abs()).exp();
    e / ((1.0 + e) * (1.0 + e))
}

/// log(1 + e^m) without overflow.
#[inline]
pub fn softplus(m: f64) -> f64 {
    m.max(0.0) + (-m.abs()).exp().ln_1p()
}

/// ℓ(m, y) = softplus(m) − y·m (the same as the definition above, for y ∈ [0, 1]).
#[inline]
pub fn log_loss(m: f64, y: f64) -> f64 {
    softplus(m) - y * m
}

/// Accuracy credit of margin `m` for label `y`: 1 when the sign of m predicts y (m > 0 for
/// y = 1, m < 0 for y = 0), 0 when it predicts the other side, ½ for a tie (m = 0: the model
/// cannot tell the sides apart, e.g. both responses became the same tokens). The authors'
/// `r_chosen > r_rejected` counts a tie as wrong; with ½ a coin flip is what a tie is worth.
/// A label y = ½ (a pair the data calls a tie: neither side is right) is worth ½ whatever m.
#[inline]
pub fn accuracy_credit(m: f64, y: f64) -> f64 {
    if m == 0.0 || y == 0.5 {
        0.5
    } else if (m > 0.0) == (y >= 0.5) {
        1.0
    } else {
        0.0
    }
}

/// What the batch looked like at θ_t, before the update (a prequential measurement).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct BatchStats {
    /// Mean logistic loss.
    pub loss: f64,
    /// Mean [`accuracy_credit`]: the fraction of samples whose margin has the label's sign, ties ½.
    pub accuracy: f64,
    /// max 1/σ'(m) over the batch: the paper's κ (Def. 2) restricted to these samples at θ_t.
    pub kappa: f64,
    /// 1/(min σ'(m) + 1e-3): the authors' logged `kappa` (reference-code.md §2.3).
    pub kappa_reference: f64,
}

impl BatchStats {
    /// Statistics of margins `m` against labels `y`; also writes cᵢ = σ(mᵢ) − yᵢ (the
    /// gradient coefficients) and σ'(mᵢ) into `coef` and `curv`.
    pub fn compute(m: &[f64], y: &[f32], coef: &mut [f64], curv: &mut [f64]) -> BatchStats {
        let n = m.len() as f64;
        let (mut loss, mut right, mut min_sp) = (0.0, 0.0, f64::INFINITY);
        for i in 0..m.len() {
            let yi = f64::from(y[i]);
            let s = sigmoid(m[i]);
            coef[i] = s - yi;
            curv[i] = sigmoid_prime(m[i]);
            min_sp = min_sp.min(curv[i]);
            loss += log_loss(m[i], yi);
            right += accuracy_credit(m[i], yi);
        }
        BatchStats { loss: loss / n, accuracy: right / n, kappa: 1.0 / min_sp, kappa_reference: 1.0 / (min_sp + 1e-3) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stable_forms_agree_with_definitions() {
        for &m in &[-30.0, -3.0, -0.1, 0.0, 0.2, 4.0, 25.0] {
            let naive_s = 1.0 / (1.0 + f64::exp(-m));
            assert!((sigmoid(m) - naive_s).abs() < 1e-15);
            for &y in &[0.0, 1.0] {
                if m.abs() > 5.0 {
                    // the naive form loses digits there; compare with log(1 + e^m) − y·m directly
                    let direct = if m > 0.0 { m + (-m).exp().ln_1p() } else { m.exp().ln_1p() } - y * m;
                    assert!((log_loss(m, y) - direct).abs() <= 1e-12 * direct.abs().max(1.0), "m={m} y={y}");
                    continue;
                }
                let naive = -y * naive_s.ln() - (1.0 - y) * (1.0 - naive_s).ln();
                assert!((log_loss(m, y) - naive).abs() < 1e-9, "m={m} y={y}");
            }
            // derivative of the loss in m is σ − y; check by central differences
            let h = 1e-6;
            let fd = (log_loss(m + h, 1.0) - log_loss(m - h, 1.0)) / (2.0 * h);
            assert!((fd - (sigmoid(m) - 1.0)).abs() < 1e-7);
            let fd2 = (sigmoid(m + h) - sigmoid(m - h)) / (2.0 * h);
            assert!((fd2 - sigmoid_prime(m)).abs() < 1e-7);
        }
        assert!(log_loss(-800.0, 1.0).is_finite());
        assert_eq!(sigmoid(-800.0), 0.0);
    }

    #[test]
    fn batch_stats_count_ties_as_half() {
        let m = [0.0, 2.0, -1.0, 1.0];
        let y = [1.0f32, 1.0, 0.0, 0.0];
        let mut c = [0.0; 4];
        let mut s = [0.0; 4];
        let st = BatchStats::compute(&m, &y, &mut c, &mut s);
        // ½ (tie) + 1 + 1 + 0, over 4
        assert_eq!(st.accuracy, 2.5 / 4.0);
        assert_eq!((accuracy_credit(0.0, 0.0), accuracy_credit(-0.0, 1.0)), (0.5, 0.5));
        assert_eq!((accuracy_credit(-1e-300, 0.0), accuracy_credit(1e-300, 0.0)), (1.0, 0.0));
        // a tied label: ½ on either side of the boundary
        assert_eq!((accuracy_credit(3.0, 0.5), accuracy_credit(-3.0, 0.5)), (0.5, 0.5));
        assert_eq!(accuracy_credit(3.0, 0.51), 1.0);
        // κ = max 1/σ'(m): the largest |m| (= 2) has the smallest σ'
        let sp2 = sigmoid_prime(2.0);
        assert!((st.kappa - 1.0 / sp2).abs() < 1e-9);
        assert!((st.kappa_reference - 1.0 / (sp2 + 1e-3)).abs() < 1e-9);
        assert!((c[1] - (sigmoid(2.0) - 1.0)).abs() < 1e-15);
    }

    /// σ' is symmetric bit for bit and does not cancel for large positive margins (it was
    /// σ(1 − σ) = 0 from m ≈ 37 on, but not for m ≪ 0).
    #[test]
    fn sigmoid_prime_is_symmetric_and_does_not_cancel() {
        for m in [0.0, 0.3, 2.0, 17.0, 36.9, 37.0, 40.0, 300.0, 700.0] {
            assert_eq!(sigmoid_prime(m).to_bits(), sigmoid_prime(-m).to_bits(), "m = {m}");
            // independent: for large |m|, σ'(m) = e^{−|m|}(1 − 2e^{−|m|} + O(e^{−2|m|}))
            if m >= 17.0 {
                let e = (-m).exp();
                assert!(((sigmoid_prime(m) - e * (1.0 - 2.0 * e)) / e).abs() < 1e-12, "m = {m}");
                assert!(sigmoid_prime(m) > 0.0);
            }
        }
        assert!((sigmoid_prime(0.0) - 0.25).abs() < 1e-16);
    }
}
