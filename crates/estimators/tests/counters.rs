//! Cost counters and held memory: constant per step for every omd-* and sgd, growing with t
//! for mle (asserted on the deterministic counters, never on time).
mod common;
use common::*;
use estimators::*;

fn per_step(kind: Kind, cfg: EstimatorConfig, steps: usize, b: usize, d: usize) -> (Vec<Counters>, Vec<usize>) {
    let s = stream(51, steps * b, d, 2.0, 2.0);
    let setup = Setup { dim: d, init: Init::Zero, seed: 0, planned_steps: Some(steps as u64) };
    let mut e = build(&cfg, &setup).unwrap();
    assert_eq!(e.kind(), kind);
    let (mut costs, mut bytes) = (Vec::new(), Vec::new());
    let mut total = Counters::default();
    for t in 0..steps {
        let rep = e.update(&s.batch(t, b)).unwrap();
        total.add(&rep.cost);
        costs.push(rep.cost);
        bytes.push(e.state_bytes());
    }
    assert_eq!(total, e.counters(), "{kind}: per-step costs add up to the cumulative counters");
    (costs, bytes)
}

#[test]
fn one_pass_estimators_cost_o1_per_step_and_hold_constant_memory() {
    let (steps, b, d) = (150, 4, 10);
    for kind in [
        Kind::OmdExact,
        Kind::OmdHvpCg,
        Kind::OmdReference,
        Kind::Sgd,
        Kind::Adam,
        Kind::AdamReference,
        Kind::OmdHvpCgAdam,
    ] {
        let (costs, bytes) = per_step(kind, EstimatorConfig::default_for(kind), steps, b, d);
        let max = costs.iter().map(|c| c.flops).max().unwrap();
        let first = costs[0];
        assert!(max <= first.flops, "{kind}: per-step flops grew from {} to {max}", first.flops);
        assert!(costs.iter().all(|c| c.grad_evals == b as u64), "{kind}: one gradient per sample");
        assert!(costs.iter().all(|c| c.hvp_evals <= 3 * b as u64), "{kind}: at most K = 3 batch HVPs");
        assert!(first.flops > 0);
        assert_eq!(bytes[1], *bytes.last().unwrap(), "{kind}: held memory must not grow with t");
    }
}

#[test]
fn mle_cost_grows_with_the_history() {
    let (steps, b, d) = (40, 5, 6);
    for solver in [MleSolver::Newton, MleSolver::Lbfgs] {
        let cfg = EstimatorConfig::Mle(MleConfig { solver, ..Default::default() });
        let (costs, bytes) = per_step(Kind::Mle, cfg, steps, b, d);
        for (t, c) in costs.iter().enumerate() {
            let n = ((t + 1) * b) as u64;
            // the prequential batch gradient, then whole passes over the n stored samples
            let passes = c.grad_evals - b as u64;
            assert!(
                passes >= n && passes.is_multiple_of(n),
                "{solver:?} step {}: {} evaluations for n = {n}",
                t + 1,
                c.grad_evals
            );
        }
        assert!(costs[steps - 1].grad_evals >= 8 * costs[4].grad_evals / 2, "{solver:?}: cost must scale with t");
        assert!(bytes[steps - 1] > bytes[0] * 10, "{solver:?}: the history is held");
    }
}

#[test]
fn sgd_replay_cost_grows_at_replay_steps() {
    let cfg = EstimatorConfig::SgdReplay(ReplayConfig { every: 10, ..Default::default() });
    let (costs, bytes) = per_step(Kind::SgdReplay, cfg, 40, 2, 4);
    assert_eq!(costs[9].grad_evals, 2 + 20);
    assert_eq!(costs[39].grad_evals, 2 + 80);
    assert_eq!(costs[10].grad_evals, 2);
    assert!(bytes[39] > bytes[0]);
}

#[test]
fn hvp_counts_follow_the_cg_iterations_and_flops_order_the_methods() {
    let (b, d) = (4, 10);
    let s = stream(52, 40 * b, d, 2.0, 2.0);
    let setup = Setup { dim: d, init: Init::Zero, seed: 0, planned_steps: Some(40) };
    let mut total = std::collections::BTreeMap::new();
    for kind in [Kind::Sgd, Kind::Adam, Kind::OmdHvpCg, Kind::OmdExact, Kind::Mle] {
        let mut e = build(&EstimatorConfig::default_for(kind), &setup).unwrap();
        for t in 0..40 {
            let rep = e.update(&s.batch(t, b)).unwrap();
            if kind != Kind::Mle {
                // (mle's inner_iters are solver iterations, which take no HVPs)
                assert_eq!(rep.cost.hvp_evals, u64::from(rep.inner_iters) * b as u64, "{kind}");
            }
            if kind == Kind::OmdHvpCg {
                assert!(rep.inner_iters >= 1);
            }
        }
        total.insert(kind, e.counters().flops);
    }
    // a gradient step reads the batch twice (4Bd flops) and touches θ; Adam adds per-coordinate
    // work; Alg. 5 adds the CG; omd-exact's O(d²) per sample dwarfs them all
    let d64 = d as u64;
    assert!(total[&Kind::Sgd] >= 40 * 4 * b as u64 * d64);
    assert!(total[&Kind::Adam] > total[&Kind::Sgd]);
    assert!(total[&Kind::OmdHvpCg] > total[&Kind::Sgd]);
    assert!(total[&Kind::OmdExact] >= 40 * b as u64 * 3 * d64 * d64);
    // mle re-reads the history: at least 4 flops per stored coordinate per pass, t(t+1)/2 rows
    assert!(total[&Kind::Mle] >= 4 * d64 * (b as u64) * 40 * 41 / 2);
}
