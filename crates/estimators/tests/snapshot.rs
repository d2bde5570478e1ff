//! Checkpoints: an estimator serialised mid-stream (postcard, as the runner writes it) and read
//! back continues bit for bit as the uninterrupted one — θ, counters and step reports — for
//! every kind, with projection, bf16 weights and replay switched on where they exist.
mod common;
use common::*;
use estimators::*;

fn configs() -> Vec<EstimatorConfig> {
    let mut out: Vec<EstimatorConfig> = Kind::ALL.iter().map(|&k| EstimatorConfig::default_for(k)).collect();
    // the optional state: a binding projection (omd-exact), Newton re-fits every 3 steps (mle),
    // replay every 5 steps, bf16 weights
    if let EstimatorConfig::OmdExact(mut c) = EstimatorConfig::default_for(Kind::OmdExact) {
        c.radius = Some(0.5);
        out.push(EstimatorConfig::OmdExact(c));
    }
    if let EstimatorConfig::Mle(mut c) = EstimatorConfig::default_for(Kind::Mle) {
        c.solver = MleSolver::Newton;
        c.refit_every = 3;
        out.push(EstimatorConfig::Mle(c));
    }
    if let EstimatorConfig::SgdReplay(mut c) = EstimatorConfig::default_for(Kind::SgdReplay) {
        c.every = 5;
        out.push(EstimatorConfig::SgdReplay(c));
    }
    // minibatches smaller than the buffer, shared and bootstrapped
    for bootstrap in [false, true] {
        out.push(EstimatorConfig::Ensemble(EnsembleConfig { heads: 3, batch: 5, bootstrap, ..Default::default() }));
    }
    if let EstimatorConfig::OmdReference(mut c) = EstimatorConfig::default_for(Kind::OmdReference) {
        c.bf16_weights = true;
        out.push(EstimatorConfig::OmdReference(c));
    }
    out
}

#[test]
fn a_snapshot_continues_bit_for_bit() {
    let (steps, cut, b, d) = (40, 17, 3, 6);
    let s = stream(8, steps * b, d, 3.0, 3.0);
    for cfg in configs() {
        let setup = Setup { dim: d, init: Init::Normal { std: Some(0.1) }, seed: 5, planned_steps: Some(steps as u64) };
        let mut a = build(&cfg, &setup).unwrap();
        let mut b_est = build(&cfg, &setup).unwrap();
        for t in 0..cut {
            a.update(&s.batch(t, b)).unwrap();
            b_est.update(&s.batch(t, b)).unwrap();
        }
        let bytes = postcard::to_stdvec(&b_est.snapshot()).unwrap();
        drop(b_est);
        let snap: Snapshot = postcard::from_bytes(&bytes).unwrap();
        let mut r = snap.into_estimator();
        assert_eq!(r.kind(), a.kind());
        assert_eq!(r.steps(), cut as u64);
        for t in cut..steps {
            let (ra, rr) = (a.update(&s.batch(t, b)).unwrap(), r.update(&s.batch(t, b)).unwrap());
            assert_eq!(ra.cost, rr.cost, "{cfg:?} step {t}");
            assert_eq!(ra.step_norm.to_bits(), rr.step_norm.to_bits(), "{cfg:?} step {t}");
        }
        let (ta, tr) = (a.theta(), r.theta());
        assert!(ta.iter().zip(&tr).all(|(x, y)| x.to_bits() == y.to_bits()), "{cfg:?}: θ differs after resume");
        assert!(ta.iter().any(|&v| v != 0.0));
        assert_eq!(a.counters(), r.counters());
    }
}

/// The check above can fail: a snapshot taken one step earlier does not continue as `a` does.
#[test]
fn a_stale_snapshot_is_detected() {
    let (b, d) = (3, 6);
    let s = stream(9, 10 * b, d, 3.0, 3.0);
    let cfg = EstimatorConfig::default_for(Kind::OmdExact);
    let setup = Setup { dim: d, init: Init::Zero, seed: 0, planned_steps: Some(10) };
    let mut a = build(&cfg, &setup).unwrap();
    a.update(&s.batch(0, b)).unwrap();
    let bytes = postcard::to_stdvec(&a.snapshot()).unwrap();
    a.update(&s.batch(1, b)).unwrap();
    let mut r = postcard::from_bytes::<Snapshot>(&bytes).unwrap().into_estimator();
    r.update(&s.batch(2, b)).unwrap();
    a.update(&s.batch(2, b)).unwrap();
    assert_ne!(a.theta(), r.theta());
}
