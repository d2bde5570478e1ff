//! Truncated conjugate gradient for A v = b with A symmetric positive definite, given only
//! products A·p: the inner solver of paper Alg. 5 and of the authors' coded update.

use crate::linalg::{axpy_f32, dot_f32};

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
    /// Stop once ‖r‖² falls below this (1e-10).
    pub tol_sq: f32,
}

/// Work vectors, kept by the caller so a step allocates nothing.
#[derive(Clone, Debug, Default)]
pub struct CgScratch {
    r: Vec<f32>,
    p: Vec<f32>,
    ap: Vec<f32>,
}

impl CgScratch {
    pub fn new(d: usize) -> Self {
        CgScratch { r: vec![0.0; d], p: vec![0.0; d], ap: vec![0.0; d] }
    }
}

/// Runs CG from v₀ = 0 and writes v_K into `x`; returns the number of products A·p taken.
pub fn solve(mut apply: impl FnMut(&[f32], &mut [f32]), b: &[f32], opts: &CgOptions, x: &mut [f32], s: &mut CgScratch) -> u32 {
    let d = b.len();
    if s.r.len() != d {
        *s = CgScratch::new(d);
    }
    x.fill(0.0);
    s.r.copy_from_slice(b);
    s.p.copy_from_slice(b);
    let mut rr = dot_f32(&s.r, &s.r);
    if rr == 0.0 {
        return 0;
    }
    let mut products = 0;
    for k in 0..opts.steps {
        apply(&s.p, &mut s.ap);
        products += 1;
        let alpha = rr / (dot_f32(&s.p, &s.ap) + opts.alpha_eps);
        axpy_f32(alpha, &s.p, x);
        if k + 1 == opts.steps {
            break;
        }
        axpy_f32(-alpha, &s.ap, &mut s.r);
        let rr_new = dot_f32(&s.r, &s.r);
        if rr_new < opts.tol_sq {
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
