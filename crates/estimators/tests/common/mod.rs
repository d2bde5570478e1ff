//! A seeded synthetic Bradley–Terry stream and small dense helpers shared by the tests.
#![allow(dead_code)]

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::StandardNormal;

pub struct Stream {
    pub d: usize,
    pub z: Vec<f32>,
    pub y: Vec<f32>,
    pub theta_star: Vec<f64>,
}

/// n samples z ~ N(0, scale²/d · I) in f32, θ* ~ N(0, I) scaled to norm `b`, y ~ Bernoulli(σ(zᵀθ*)).
pub fn stream(seed: u64, n: usize, d: usize, scale: f64, b: f64) -> Stream {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut theta_star: Vec<f64> = (0..d).map(|_| rng.sample::<f64, _>(StandardNormal)).collect();
    let nrm = theta_star.iter().map(|v| v * v).sum::<f64>().sqrt();
    theta_star.iter_mut().for_each(|v| *v *= b / nrm);
    let mut z = Vec::with_capacity(n * d);
    let mut y = Vec::with_capacity(n);
    for _ in 0..n {
        let row: Vec<f32> =
            (0..d).map(|_| (rng.sample::<f64, _>(StandardNormal) * scale / (d as f64).sqrt()) as f32).collect();
        let m: f64 = row.iter().zip(&theta_star).map(|(&a, b)| f64::from(a) * b).sum();
        let p = 1.0 / (1.0 + (-m).exp());
        y.push(if rng.random::<f64>() < p { 1.0 } else { 0.0 });
        z.extend(row);
    }
    Stream { d, z, y, theta_star }
}

impl Stream {
    pub fn batch(&self, i: usize, b: usize) -> estimators::Batch<'_> {
        estimators::Batch::new(&self.z[i * b * self.d..(i + 1) * b * self.d], &self.y[i * b..(i + 1) * b], self.d)
            .unwrap()
    }

    pub fn row64(&self, i: usize) -> Vec<f64> {
        self.z[i * self.d..(i + 1) * self.d].iter().map(|&v| f64::from(v)).collect()
    }
}

pub fn sigmoid(m: f64) -> f64 {
    1.0 / (1.0 + (-m).exp())
}

pub fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

pub fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

pub fn norm(a: &[f64]) -> f64 {
    dot(a, a).sqrt()
}
