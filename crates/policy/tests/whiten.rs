//! RLOO's advantage normalisation is TRL's `normalize_advantage`: (a − mean) / (std + 1e-8) with
//! torch's unbiased std (n − 1), over every advantage of the update. Values by hand:
//! a = [1, 2, 3, 6]: mean 3, Σ(a − 3)² = 4 + 1 + 0 + 9 = 14, sample sd √(14/3) = 2.160247;
//! `python3 -c "import statistics as s; a=[1,2,3,6]; m=s.mean(a); sd=s.stdev(a); print([(x-m)/(sd+1e-8) for x in a])"`
//! (stdev: n − 1, as torch's std) gives [-0.92582009548, -0.46291004774, 0.0, 1.38873014323].

#[test]
fn rloo_advantages_are_centred_and_scaled_by_the_sample_sd() {
    // two sequences of per-token advantages (OpenRLHF's token penalty): flattened over all
    let mut adv = vec![vec![1.0, 2.0], vec![3.0, 6.0]];
    policy::train::whiten(&mut adv);
    let want = [-0.9258200954868372, -0.4629100477434186, 0.0, 1.3887301432302557];
    let got: Vec<f64> = adv.into_iter().flatten().collect();
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() < 1e-7, "{got:?} vs {want:?}");
    }
    // the old normalisation (divide by the population sd, no centring) would give 1/√3.5 = 0.53
    // for the first: not this
    assert!((got[0] - 1.0 / 3.5f64.sqrt()).abs() > 1.0);
    let mut one = vec![vec![5.0]];
    policy::train::whiten(&mut one);
    assert_eq!(one, vec![vec![0.0]], "one advantage: centred, no sd");
}
