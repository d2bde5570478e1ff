//! CG against the dense Krylov-subspace optimum, the closed-form HVP against central
//! differences of the gradient, and omd-hvp-cg against a dense solve when K ≥ d.
mod common;
use common::*;
use estimators::cg::{self, Beta, CgOptions, CgScratch, Stop};
use estimators::linalg::hvp_f32;
use estimators::{DampingSchedule, Estimator, EstimatorConfig, FirstOrder, HvpCgConfig};
use nalgebra::{DMatrix, DVector};

/// A = Q diag(1..κ) Qᵀ, SPD, spread-out spectrum.
fn spd(d: usize, kappa: f64) -> DMatrix<f64> {
    let s = stream(11, d, d, 1.0, 1.0);
    let m = DMatrix::from_row_slice(d, d, &s.z.iter().map(|&v| f64::from(v)).collect::<Vec<_>>());
    let q = m.qr().q();
    let diag = DMatrix::from_diagonal(&DVector::from_iterator(
        d,
        (0..d).map(|i| 1.0 + (kappa - 1.0) * i as f64 / (d - 1) as f64),
    ));
    &q * diag * q.transpose()
}

/// argmin_{x ∈ span{b, Ab, …, A^{k−1}b}} ½xᵀAx − bᵀx, densely.
fn krylov_optimum(a: &DMatrix<f64>, b: &DVector<f64>, k: usize) -> DVector<f64> {
    let d = b.len();
    let mut basis: Vec<DVector<f64>> = Vec::new();
    let mut v = b.clone();
    for _ in 0..k {
        let mut w = v.clone();
        for q in &basis {
            w -= q * q.dot(&w);
        }
        for q in &basis {
            w -= q * q.dot(&w); // re-orthogonalise
        }
        basis.push(w.normalize());
        v = a * &v;
    }
    let q = DMatrix::from_columns(&basis);
    let _ = d;
    let small = q.transpose() * a * &q;
    let y = small.lu().solve(&(q.transpose() * b)).unwrap();
    q * y
}

fn run_cg(a: &DMatrix<f64>, b: &DVector<f64>, k: usize, beta: Beta) -> DVector<f64> {
    let d = b.len();
    let a32: Vec<f32> = a.transpose().iter().map(|&v| v as f32).collect(); // row-major
    let b32: Vec<f32> = b.iter().map(|&v| v as f32).collect();
    let mut x = vec![0f32; d];
    let opts = CgOptions { steps: k, beta, alpha_eps: 0.0, stop: Stop::Absolute(0.0) };
    let taken = cg::solve(
        |p, out| {
            for i in 0..d {
                out[i] = (0..d).map(|j| a32[i * d + j] * p[j]).sum();
            }
        },
        &b32,
        &opts,
        &mut x,
        &mut CgScratch::new(d),
    );
    assert_eq!(taken as usize, k, "tol 0 never stops early on this system");
    DVector::from_iterator(d, x.iter().map(|&v| f64::from(v)))
}

#[test]
fn cg_after_k_steps_is_the_krylov_optimum() {
    let d = 12;
    let a = spd(d, 50.0);
    let b = DVector::from_iterator(d, (0..d).map(|i| ((i as f64) * 0.7).sin() + 0.3));
    for k in 1..=4 {
        let want = krylov_optimum(&a, &b, k);
        let got = run_cg(&a, &b, k, Beta::FletcherReeves);
        let err = (&got - &want).norm() / want.norm();
        assert!(err < 2e-5, "K={k}: relative error {err:e}");
    }
}

#[test]
fn beta_one_is_not_the_krylov_optimum() {
    // negative control: the authors' β ≡ 1 leaves the Krylov optimum from K = 2 on
    let d = 12;
    let a = spd(d, 50.0);
    let b = DVector::from_iterator(d, (0..d).map(|i| ((i as f64) * 0.7).sin() + 0.3));
    assert!((run_cg(&a, &b, 1, Beta::One) - krylov_optimum(&a, &b, 1)).norm() < 1e-5 * b.norm());
    for k in 2..=3 {
        let want = krylov_optimum(&a, &b, k);
        let err = (run_cg(&a, &b, k, Beta::One) - &want).norm() / want.norm();
        assert!(err > 1e-2, "K={k}: β ≡ 1 should miss the optimum, error {err:e}");
    }
}

fn grad64(z: &[f32], y: &[f32], d: usize, theta: &[f64]) -> Vec<f64> {
    let n = y.len() as f64;
    let mut g = vec![0.0; d];
    for (row, &yi) in z.chunks_exact(d).zip(y) {
        let r: Vec<f64> = row.iter().map(|&v| f64::from(v)).collect();
        let c = (sigmoid(dot(&r, theta)) - f64::from(yi)) / n;
        for j in 0..d {
            g[j] += c * r[j];
        }
    }
    g
}

#[test]
fn closed_form_hvp_equals_central_differences() {
    let (b, d) = (5, 10);
    let s = stream(5, b, d, 3.0, 2.0);
    let theta: Vec<f64> = (0..d).map(|i| ((i as f64) * 0.37).cos()).collect();
    let p: Vec<f64> = (0..d).map(|i| ((i as f64) * 1.1).sin()).collect();
    let w: Vec<f32> =
        s.z.chunks_exact(d)
            .map(|row| {
                let m: f64 = row.iter().zip(&theta).map(|(&a, b)| f64::from(a) * b).sum();
                (sigmoid(m) * (1.0 - sigmoid(m)) / b as f64) as f32
            })
            .collect();
    let p32: Vec<f32> = p.iter().map(|&v| v as f32).collect();
    let mut hv = vec![0f32; d];
    hvp_f32(&s.z, &w, &p32, &mut vec![0.0; b], &mut hv);
    let h = 1e-5;
    let plus: Vec<f64> = theta.iter().zip(&p).map(|(t, q)| t + h * q).collect();
    let minus: Vec<f64> = theta.iter().zip(&p).map(|(t, q)| t - h * q).collect();
    let (gp, gm) = (grad64(&s.z, &s.y, d, &plus), grad64(&s.z, &s.y, d, &minus));
    for j in 0..d {
        let fd = (gp[j] - gm[j]) / (2.0 * h);
        assert!((fd - f64::from(hv[j])).abs() < 1e-5 * (1.0 + fd.abs()), "coord {j}: fd {fd} vs hvp {}", hv[j]);
    }
}

#[test]
fn omd_hvp_cg_with_k_ge_d_is_a_damped_newton_step() {
    let (b, d) = (6, 5);
    let s = stream(6, 60, d, 2.0, 2.0);
    let cfg = HvpCgConfig {
        cg_steps: 30,
        lambda0: 0.8,
        schedule: DampingSchedule::Linear,
        lambda_min: 1e-6,
        lr: 0.5,
        cg_tol: 1e-5,
    };
    let big_t = 10u64;
    let theta0: Vec<f64> = (0..d).map(|i| 0.1 * i as f64).collect();
    let mut est = FirstOrder::new(&EstimatorConfig::OmdHvpCg(cfg), theta0, Some(big_t)).unwrap();
    for step in 0..10 {
        let th: Vec<f64> = est.theta();
        let batch = s.batch(step, b);
        let rep = est.update(&batch).unwrap();
        let t = (step + 1) as f64;
        let lam = (0.8 * (t / big_t as f64).min(1.0)).max(1e-6);
        assert!((rep.damping - lam).abs() < 1e-12);
        // dense (H_B + λ_t I) v = g
        let mut hm = DMatrix::<f64>::identity(d, d) * lam;
        let g = DVector::from_vec(grad64(batch.z(), batch.y(), d, &th));
        for row in batch.rows() {
            let r = DVector::from_iterator(d, row.iter().map(|&v| f64::from(v)));
            let sp = sigmoid(r.dot(&DVector::from_vec(th.clone())));
            hm += (&r * r.transpose()) * (sp * (1.0 - sp) / b as f64);
        }
        let v = hm.lu().solve(&g).unwrap();
        let want: Vec<f64> = th.iter().zip(v.iter()).map(|(t, vi)| t - 0.5 * vi).collect();
        assert!(max_abs_diff(&est.theta(), &want) < 2e-5, "step {step}");
    }
}

#[test]
fn damping_schedules() {
    let s = stream(7, 8, 4, 1.0, 1.0);
    for (sched, f) in [
        (DampingSchedule::Linear, Box::new(|u: f64| u) as Box<dyn Fn(f64) -> f64>),
        (DampingSchedule::Log, Box::new(|u: f64| (1.0 + (std::f64::consts::E - 1.0) * u).ln())),
        (DampingSchedule::Constant, Box::new(|_| 1.0)),
    ] {
        let cfg = HvpCgConfig { schedule: sched, ..Default::default() };
        let mut est = FirstOrder::new(&EstimatorConfig::OmdHvpCg(cfg), vec![0.0; 4], Some(4)).unwrap();
        for t in 1..=8u64 {
            let rep = est.update(&s.batch(t as usize - 1, 1)).unwrap();
            let want = (0.8 * f((t as f64 / 4.0).min(1.0))).max(1e-6);
            assert!((rep.damping - want).abs() < 1e-12, "{sched:?} t={t}");
        }
    }
}

#[test]
fn row_space_cg_equals_direct_cg_and_the_krylov_optimum() {
    let (b, d) = (8, 40);
    let s = stream(8, b, d, 3.0, 2.0);
    let theta: Vec<f64> = (0..d).map(|i| ((i as f64) * 0.21).sin() * 0.5).collect();
    let (mut w, mut c) = (vec![0.0; b], vec![0.0; b]);
    for i in 0..b {
        let m = dot(&s.row64(i), &theta);
        w[i] = sigmoid(m) * (1.0 - sigmoid(m)) / b as f64;
        c[i] = (sigmoid(m) - f64::from(s.y[i])) / b as f64;
    }
    let lambda = 0.05;
    // dense A and g in f64
    let zm = DMatrix::from_row_slice(b, d, &s.z.iter().map(|&v| f64::from(v)).collect::<Vec<_>>());
    let a = zm.transpose() * DMatrix::from_diagonal(&DVector::from_vec(w.clone())) * &zm
        + DMatrix::<f64>::identity(d, d) * lambda;
    let g = zm.transpose() * DVector::from_vec(c.clone());
    let mut gram = vec![0.0; b * b];
    estimators::linalg::gram_f32(&s.z, d, &mut gram);
    let w32: Vec<f32> = w.iter().map(|&v| v as f32).collect();
    let g32: Vec<f32> = g.iter().map(|&v| v as f32).collect();
    for (beta_rule, k) in [
        (Beta::FletcherReeves, 1),
        (Beta::FletcherReeves, 2),
        (Beta::FletcherReeves, 3),
        (Beta::FletcherReeves, 5),
        (Beta::One, 3),
    ] {
        let opts = CgOptions { steps: k, beta: beta_rule, alpha_eps: 0.0, stop: Stop::Absolute(0.0) };
        let mut coef = vec![0.0; b];
        cg::solve_row_space(&gram, &w, lambda, &c, &opts, &mut coef);
        let row = zm.transpose() * DVector::from_vec(coef);
        let mut x = vec![0f32; d];
        let mut sc = vec![0f32; b];
        cg::solve(
            |p, out| estimators::linalg::damped_hvp_f32(&s.z, &w32, p, lambda as f32, &mut sc, out),
            &g32,
            &opts,
            &mut x,
            &mut CgScratch::new(d),
        );
        let direct = DVector::from_iterator(d, x.iter().map(|&v| f64::from(v)));
        let err = (&row - &direct).norm() / row.norm();
        assert!(err < 1e-4, "{beta_rule:?} K={k}: row space vs direct {err:e}");
        if beta_rule == Beta::FletcherReeves {
            let opt = krylov_optimum(&a, &g, k);
            let err = (&row - &opt).norm() / opt.norm();
            assert!(err < 1e-6, "K={k}: row space vs Krylov optimum {err:e}");
        }
    }
}

#[test]
fn cg_stops_once_the_residual_vanishes() {
    // A = 2I: one step solves exactly, r₁ = 0; going on would divide 0 by 0
    let d = 6;
    let b32: Vec<f32> = (0..d).map(|i| i as f32 - 2.5).collect();
    for beta in [Beta::FletcherReeves, Beta::One] {
        let opts = CgOptions { steps: 4, beta, alpha_eps: 0.0, stop: Stop::Absolute(1e-10) };
        let mut x = vec![0f32; d];
        let taken = cg::solve(
            |p, out| out.iter_mut().zip(p).for_each(|(o, v)| *o = 2.0 * v),
            &b32,
            &opts,
            &mut x,
            &mut CgScratch::new(d),
        );
        assert_eq!(taken, 1);
        for (xi, bi) in x.iter().zip(&b32) {
            assert!((xi - bi / 2.0).abs() < 1e-6, "{x:?}");
        }
        // the same in row space: Z = I (d×d), W = 0, λ = 2
        let gram: Vec<f64> = (0..d * d).map(|i| if i % (d + 1) == 0 { 1.0 } else { 0.0 }).collect();
        let c: Vec<f64> = b32.iter().map(|&v| f64::from(v)).collect();
        let mut coef = vec![0.0; d];
        let taken = cg::solve_row_space(&gram, &vec![0.0; d], 2.0, &c, &opts, &mut coef);
        assert_eq!(taken, 1);
        for (xi, ci) in coef.iter().zip(&c) {
            assert!((xi - ci / 2.0).abs() < 1e-12 && xi.is_finite());
        }
    }
}

/// A subnormal right-hand side (pᵀAp underflows to 0, α to ∞): CG returns x = 0 instead of ∞.
#[test]
fn cg_returns_zero_for_an_underflowing_right_hand_side() {
    let b = vec![3e-23f32; 4]; // ‖b‖² ≈ 4e-45: subnormal in f32
    let apply = |p: &[f32], out: &mut [f32]| {
        for (o, x) in out.iter_mut().zip(p) {
            *o = 1e-3 * x;
        }
    };
    let mut x = vec![0f32; 4];
    let opts = CgOptions { steps: 3, beta: Beta::FletcherReeves, alpha_eps: 0.0, stop: Stop::Relative(1e-5) };
    let k = cg::solve(apply, &b, &opts, &mut x, &mut CgScratch::new(4));
    assert!(x.iter().all(|v| v.is_finite()), "{x:?}");
    assert_eq!(k, 0);
    // no positive curvature: the iterate is kept, not pushed to ∞
    let zero = |_: &[f32], out: &mut [f32]| out.fill(0.0);
    let b = vec![1.0f32; 4];
    cg::solve(zero, &b, &opts, &mut x, &mut CgScratch::new(4));
    assert!(x.iter().all(|v| v.is_finite()), "{x:?}");
}

/// The relative stop takes the same steps for problems equal up to a scaling; the authors'
/// absolute rule does not (negative control).
#[test]
fn relative_stop_is_scale_free() {
    let diag = [1.0f32, 2.0, 5.0];
    let run = |a_scale: f32, b_scale: f32, stop: Stop| -> u32 {
        let apply = |p: &[f32], out: &mut [f32]| {
            for i in 0..3 {
                out[i] = a_scale * diag[i] * p[i];
            }
        };
        let b: Vec<f32> = [1.0f32, -2.0, 0.5].iter().map(|v| v * b_scale).collect();
        let mut x = vec![0f32; 3];
        let opts = CgOptions { steps: 10, beta: Beta::FletcherReeves, alpha_eps: 0.0, stop };
        cg::solve(apply, &b, &opts, &mut x, &mut CgScratch::new(3))
    };
    let rel = Stop::Relative(1e-4);
    let k = run(1.0, 1.0, rel);
    assert_eq!(run(1.0, 1e-5, rel), k);
    assert_eq!(run(1e3, 1e3, rel), k);
    let abs = Stop::Absolute(1e-10);
    assert_ne!(run(1.0, 1e-5, abs), run(1.0, 1.0, abs), "the absolute rule stops early on a small b");
}
