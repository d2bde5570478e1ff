//! Truncated conjugate gradient for A v = b with A symmetric positive definite, given only
//! products A·p: the inner solver of paper Alg. 5 and of the authors' coded update.
//!
//! For A = H_B + λI = ZᵀWZ + λI and b = g = Zᵀc, every CG vector stays of the form Zᵀβ
//! (Ap = Zᵀ(WGβ + λβ) with G = ZZᵀ, and uᵀv = aᵀGb), so [`solve_row_space`] runs the same
//! iteration on B-dimensional coefficients: one pass over Z to form G instead of two per
//! HVP. In exact arithmetic its iterates are those of [`solve`]; the tests check both
//! against the dense Krylov optimum.

use crate::linalg::{axpy_f32, cg_step_f32, dot_f32};

/// How p_{k+1} = r_{k+1} + β p_k picks β.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Beta {
    /// β = r_{k+1}ᵀr_{k+1} / r_kᵀr_k (paper Alg. 5, textbook CG).
    FletcherReeves,
    /// β ≡ 1: the authors' `beta = r_norm_sq / r_norm_sq` (reference-code.md §6.2, bug 1).
    One,
}

/// Options of one solve.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CgOptions {
    /// K: at most this many products A·p.
    pub steps: usize,
    pub beta: Beta,
    /// Added to pᵀAp in α's denominator (0 in the paper; the authors add 1e-8).
    pub alpha_eps: f32,
    pub stop: Stop,
}

/// When CG stops before K products.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Stop {
    /// ‖r‖ ≤ ε‖b‖: the same number of steps for problems equal up to a scaling (paper Alg. 5's ε).
    Relative(f32),
    /// ‖r‖² < tol: the authors' `r_norm_sq < 1e-10` (reference-code.md §6.2).
    Absolute(f32),
}

impl Stop {
    /// Whether ‖r‖² = `rr` is small enough, for a right-hand side with ‖b‖² = `bb`.
    fn reached(&self, rr: f64, bb: f64) -> bool {
        match *self {
            Stop::Relative(eps) => rr <= f64::from(eps) * f64::from(eps) * bb,
            Stop::Absolute(tol) => rr < f64::from(tol),
        }
    }
}

/// Work vectors, kept by the caller so a step allocates nothing.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct CgScratch {
    r: Vec<f32>,
    p: Vec<f32>,
    ap: Vec<f32>,
}

impl CgScratch {
    pub fn new(d: usize) -> Self {
        CgScratch { r: vec![0.0; d], p: vec![0.0; d], ap: vec![0.0; d] }
    }

    /// Bytes held (three vectors of the problem's dimension once a solve has run).
    pub fn bytes(&self) -> usize {
        (self.r.len() + self.p.len() + self.ap.len()) * std::mem::size_of::<f32>()
    }
}

/// Runs CG from v₀ = 0 and writes v_K into `x`; returns the number of products A·p taken.
pub fn solve(
    mut apply: impl FnMut(&[f32], &mut [f32]),
    b: &[f32],
    opts: &CgOptions,
    x: &mut [f32],
    s: &mut CgScratch,
) -> u32 {
    let d = b.len();
    if s.r.len() != d {
        *s = CgScratch::new(d);
    }
    x.fill(0.0);
    s.r.copy_from_slice(b);
    s.p.copy_from_slice(b);
    let mut rr = dot_f32(&s.r, &s.r);
    let bb = f64::from(rr);
    // x = 0 already solves it: b is zero, subnormal (pᵀAp would underflow to 0 and α to ∞), or
    // below the tolerance
    if rr.is_nan() || rr < f32::MIN_POSITIVE || opts.stop.reached(bb, bb) {
        return 0;
    }
    let mut products = 0;
    for k in 0..opts.steps {
        apply(&s.p, &mut s.ap);
        products += 1;
        let pap = dot_f32(&s.p, &s.ap) + opts.alpha_eps;
        let alpha = rr / pap;
        // no positive curvature along p (or it underflowed): keep the iterate
        if pap.is_nan() || pap <= 0.0 || !alpha.is_finite() {
            break;
        }
        if k + 1 == opts.steps {
            axpy_f32(alpha, &s.p, x);
            break;
        }
        let rr_new = cg_step_f32(alpha, &s.p, &s.ap, x, &mut s.r);
        if opts.stop.reached(f64::from(rr_new), bb) {
            break;
        }
        let beta = match opts.beta {
            Beta::FletcherReeves => rr_new / rr,
            Beta::One => 1.0,
        };
        for (pi, ri) in s.p.iter_mut().zip(&s.r) {
            *pi = ri + beta * *pi;
        }
        rr = rr_new;
    }
    products
}

/// CG for (ZᵀWZ + λI) v = Zᵀc in coefficient space: given G = ZZᵀ (row-major B×B), the
/// weights w and c, writes β with v_K = Zᵀβ into `x` and returns the iterations taken.
pub fn solve_row_space(gram: &[f64], w: &[f64], lambda: f64, c: &[f64], opts: &CgOptions, x: &mut [f64]) -> u32 {
    let n = c.len();
    assert!(gram.len() == n * n && w.len() == n && x.len() == n);
    let gmul = |v: &[f64], out: &mut [f64]| {
        for i in 0..n {
            out[i] = (0..n).map(|j| gram[i * n + j] * v[j]).sum();
        }
    };
    let inner = |a: &[f64], gb: &[f64]| -> f64 { a.iter().zip(gb).map(|(x, y)| x * y).sum() };
    let (mut r, mut p) = (c.to_vec(), c.to_vec());
    let (mut gr, mut gp, mut ap, mut gap) = (vec![0.0; n], vec![0.0; n], vec![0.0; n], vec![0.0; n]);
    x.fill(0.0);
    gmul(&r, &mut gr);
    let mut rr = inner(&r, &gr);
    let bb = rr;
    if rr.is_nan() || rr < f64::MIN_POSITIVE || opts.stop.reached(bb, bb) {
        return 0;
    }
    let mut iters = 0;
    for k in 0..opts.steps {
        // Ap = W G p + λ p, and pᵀAp = pᵀG(Ap)
        gmul(&p, &mut gp);
        for i in 0..n {
            ap[i] = w[i] * gp[i] + lambda * p[i];
        }
        gmul(&ap, &mut gap);
        iters += 1;
        let pap = inner(&p, &gap) + f64::from(opts.alpha_eps);
        let alpha = rr / pap;
        if pap.is_nan() || pap <= 0.0 || !alpha.is_finite() {
            break;
        }
        for i in 0..n {
            x[i] += alpha * p[i];
        }
        if k + 1 == opts.steps {
            break;
        }
        for i in 0..n {
            r[i] -= alpha * ap[i];
        }
        gmul(&r, &mut gr);
        let rr_new = inner(&r, &gr);
        if opts.stop.reached(rr_new, bb) {
            break;
        }
        let beta = match opts.beta {
            Beta::FletcherReeves => rr_new / rr,
            Beta::One => 1.0,
        };
        for i in 0..n {
            p[i] = r[i] + beta * p[i];
        }
        rr = rr_new;
    }
    iters
}
