//! mle against the ridge-logistic optimum computed by an independent dense Newton solve.
mod common;
use common::*;
use estimators::{Estimator, Mle, MleConfig, MleSolver};
use nalgebra::{DMatrix, DVector};

/// argmin Σℓᵢ + ρ·n·‖θ‖² by plain dense Newton with step halving, to ‖∇‖ < 1e-11.
fn dense_optimum(s: &Stream, n: usize, ridge: f64) -> Vec<f64> {
    let d = s.d;
    let reg = ridge * n as f64;
    let mut th = DVector::<f64>::zeros(d);
    let f = |th: &DVector<f64>| -> f64 {
        (0..n)
            .map(|i| {
                let m = DVector::from_vec(s.row64(i)).dot(th);
                let y = f64::from(s.y[i]);
                (1.0 + m.exp()).ln() - y * m
            })
            .sum::<f64>()
            + reg * th.norm_squared()
    };
    for _ in 0..100 {
        let mut g = &th * (2.0 * reg);
        let mut h = DMatrix::<f64>::identity(d, d) * (2.0 * reg);
        for i in 0..n {
            let z = DVector::from_vec(s.row64(i));
            let p = sigmoid(z.dot(&th));
            g += &z * (p - f64::from(s.y[i]));
            h += (&z * z.transpose()) * (p * (1.0 - p));
        }
        if g.norm() < 1e-11 {
            break;
        }
        let step = h.lu().solve(&g).unwrap();
        let mut t = 1.0;
        while f(&(&th - &step * t)) > f(&th) && t > 1e-8 {
            t *= 0.5;
        }
        th -= step * t;
    }
    th.iter().copied().collect()
}

#[test]
fn reaches_the_dense_ridge_optimum_with_both_solvers() {
    let (d, b, steps) = (6, 10, 30);
    let s = stream(21, b * steps, d, 3.0, 3.0);
    for solver in [MleSolver::Newton, MleSolver::Lbfgs] {
        let cfg = MleConfig { solver, ..Default::default() };
        let mut est = Mle::new(cfg, vec![0.0; d]);
        for i in 0..steps {
            let rep = est.update(&s.batch(i, b)).unwrap();
            assert!(rep.converged, "{solver:?} step {i} did not converge");
            let n = (i + 1) * b;
            let gnorm = est.objective_gradient_norm();
            assert!(gnorm <= 1.0 / n as f64);
            if i % 10 == 9 {
                // F is (2ρn)-strongly convex, so ‖θ − θ̂‖ ≤ ‖∇F(θ)‖ / (2ρn)
                let want = dense_optimum(&s, n, 1e-4);
                let err = norm(&est.theta().iter().zip(&want).map(|(a, b)| a - b).collect::<Vec<_>>());
                let bound = gnorm / (2e-4 * n as f64);
                assert!(err <= bound, "{solver:?} n={n}: error {err:e} > bound {bound:e}");
                assert!(norm(&want) > 0.5, "the optimum must be far from the start for this to mean anything");
            }
        }
    }
}

#[test]
fn refit_every_holds_theta_between_refits() {
    let (d, b) = (4, 5);
    let s = stream(22, 100, d, 2.0, 2.0);
    let mut est = Mle::new(MleConfig { refit_every: 4, ..Default::default() }, vec![0.0; d]);
    let mut last = est.theta();
    for i in 0..20 {
        let rep = est.update(&s.batch(i, b)).unwrap();
        if (i + 1) % 4 == 0 {
            assert_ne!(est.theta(), last);
            assert!(rep.inner_iters > 0);
        } else {
            assert_eq!(est.theta(), last);
            assert_eq!(rep.step_norm, 0.0);
        }
        last = est.theta();
    }
    assert_eq!(est.history_len(), 100);
}

#[test]
fn refits_reach_the_one_over_t_tolerance_on_a_long_history() {
    // regression: near the optimum F's round-off stalled the Armijo search and re-fits at
    // t = 20k reported converged = false after hundreds of passes
    let (d, b, steps) = (64, 100, 200);
    let s = stream(23, b * steps, d, 1.4, 3.0);
    for solver in [MleSolver::Lbfgs, MleSolver::Newton] {
        let mut est = Mle::new(MleConfig { solver, refit_every: 50, ..Default::default() }, vec![0.0; d]);
        for i in 0..steps {
            let rep = est.update(&s.batch(i, b)).unwrap();
            if (i + 1) % 50 == 0 {
                assert!(
                    rep.converged,
                    "{solver:?} refit at n = {} did not converge ({} iterations)",
                    (i + 1) * b,
                    rep.inner_iters
                );
            }
        }
        assert!(est.objective_gradient_norm() <= 1.0 / (b * steps) as f64);
    }
}
