//! The synthetic contextual dueling bandit of the theory (paper §3): N contexts with K arms
//! each, features φ(x,a) ∈ R^d with ‖φ‖ ≤ L, θ* uniform on the sphere of radius B, labels
//! y ~ Bernoulli(σ(zᵀθ*)). Every random draw comes from a ChaCha20 stream keyed by
//! (master seed, seed index) with one stream id per component, never by the method, so all
//! cells of a seed see the same contexts, pairs and label noise.

use crate::spec::{EnvSpec, FeatureDist};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;
use rand_distr::StandardNormal;

/// The random components; each has its own stream.
#[derive(Clone, Copy, Debug)]
pub enum Component {
    /// Contexts, arms' features, θ*.
    Env = 1,
    /// The order of contexts and pairs (passive stream, active pool, deployment contexts).
    Data = 2,
    /// Label noise: one uniform per labelled pair.
    Labels = 3,
    /// The held-out evaluation pairs.
    Eval = 4,
    /// θ_1 when an estimator starts from N(0, σ²).
    Init = 5,
    /// Random selection rules and tie-breaking.
    Select = 6,
}

/// The stream of `component` for seed index `seed` under `master`.
pub fn stream(master: u64, seed: u32, component: Component) -> ChaCha20Rng {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&master.to_le_bytes());
    key[8..12].copy_from_slice(&seed.to_le_bytes());
    key[12..16].copy_from_slice(b"1pas");
    let mut rng = ChaCha20Rng::from_seed(key);
    rng.set_stream(component as u64);
    rng
}

/// A u64 seed for APIs that take one (the estimator's init), drawn from a component stream.
pub fn seed_of(master: u64, seed: u32, component: Component) -> u64 {
    stream(master, seed, component).random()
}

/// The features of one context: K rows of d values.
#[derive(Clone, Debug)]
pub struct Context {
    pub phi: Vec<f32>,
}

pub struct Env {
    pub d: usize,
    pub k: usize,
    dist: FeatureDist,
    l: f64,
    fresh: bool,
    /// The finite context set (or, with fresh contexts, the evaluation contexts).
    pub contexts: Vec<Context>,
    pub theta_star: Vec<f64>,
    /// Held-out pairs: z rows and labels.
    pub eval_z: Vec<f32>,
    pub eval_y: Vec<f32>,
    /// E_x max_a r(x,a) over `contexts`.
    pub optimal_value: f64,
}

fn features(rng: &mut ChaCha20Rng, d: usize, k: usize, dist: FeatureDist, l: f64) -> Context {
    let mut phi = Vec::with_capacity(k * d);
    for _ in 0..k {
        let g: Vec<f64> = (0..d).map(|_| rng.sample::<f64, _>(StandardNormal) / (d as f64).sqrt()).collect();
        let n = g.iter().map(|v| v * v).sum::<f64>().sqrt();
        let scale = match dist {
            FeatureDist::Gaussian => l / n.max(1.0),
            FeatureDist::Sphere => l / n,
        };
        phi.extend(g.iter().map(|v| (v * scale) as f32));
    }
    Context { phi }
}

impl Env {
    pub fn new(spec: &EnvSpec, master: u64, seed: u32) -> Env {
        let (d, k) = (spec.dim, spec.arms);
        let mut rng = stream(master, seed, Component::Env);
        let mut theta_star: Vec<f64> = (0..d).map(|_| rng.sample(StandardNormal)).collect();
        let n = theta_star.iter().map(|v| v * v).sum::<f64>().sqrt();
        theta_star.iter_mut().for_each(|v| *v *= spec.theta_norm / n);
        let contexts: Vec<Context> =
            (0..spec.contexts).map(|_| features(&mut rng, d, k, spec.features, spec.feature_norm)).collect();
        let mut env = Env {
            d,
            k,
            dist: spec.features,
            l: spec.feature_norm,
            fresh: spec.fresh_contexts,
            contexts,
            theta_star,
            eval_z: Vec::new(),
            eval_y: Vec::new(),
            optimal_value: 0.0,
        };
        env.optimal_value = env
            .contexts
            .iter()
            .map(|c| (0..k).map(|a| env.reward(c, a)).fold(f64::NEG_INFINITY, f64::max))
            .sum::<f64>()
            / env.contexts.len() as f64;
        let mut erng = stream(master, seed, Component::Eval);
        for _ in 0..spec.eval_pairs {
            let c = env.draw_context(&mut erng);
            let (a, b) = two_arms(&mut erng, k);
            let z = env.diff(&c, a, b);
            let y = env.label(&z, erng.random());
            env.eval_z.extend(z);
            env.eval_y.push(y);
        }
        env
    }

    /// A context from ρ: uniform over the set, or fresh.
    pub fn draw_context(&self, rng: &mut ChaCha20Rng) -> Context {
        if self.fresh {
            features(rng, self.d, self.k, self.dist, self.l)
        } else {
            self.contexts[rng.random_range(0..self.contexts.len())].clone()
        }
    }

    pub fn arm<'a>(&self, c: &'a Context, a: usize) -> &'a [f32] {
        &c.phi[a * self.d..(a + 1) * self.d]
    }

    /// z = φ(x,a) − φ(x,b).
    pub fn diff(&self, c: &Context, a: usize, b: usize) -> Vec<f32> {
        self.arm(c, a).iter().zip(self.arm(c, b)).map(|(x, y)| x - y).collect()
    }

    /// r(x,a) = φ(x,a)ᵀθ*.
    pub fn reward(&self, c: &Context, a: usize) -> f64 {
        dot(self.arm(c, a), &self.theta_star)
    }

    /// y = 1 with probability σ(zᵀθ*), from the uniform draw `u` (common random numbers).
    pub fn label(&self, z: &[f32], u: f64) -> f32 {
        let p = 1.0 / (1.0 + (-dot(z, &self.theta_star)).exp());
        if u < p {
            1.0
        } else {
            0.0
        }
    }

    /// SubOpt of the policy choosing `choice[i]` in context i: E_x[r(x,π*) − r(x,π)].
    pub fn subopt_of(&self, choice: &[usize]) -> f64 {
        let v: f64 = self.contexts.iter().zip(choice).map(|(c, &a)| self.reward(c, a)).sum::<f64>();
        self.optimal_value - v / self.contexts.len() as f64
    }

    /// The greedy policy of θ over the contexts (ties to the lowest arm index).
    pub fn greedy(&self, theta: &[f64]) -> Vec<usize> {
        self.contexts.iter().map(|c| argmax((0..self.k).map(|a| dot(self.arm(c, a), theta)))).collect()
    }
}

pub fn dot(a: &[f32], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(&x, y)| f64::from(x) * y).sum()
}

pub fn argmax(it: impl Iterator<Item = f64>) -> usize {
    let mut best = (0, f64::NEG_INFINITY);
    for (i, v) in it.enumerate() {
        if v > best.1 {
            best = (i, v);
        }
    }
    best.0
}

/// Two distinct arms, uniformly.
pub fn two_arms(rng: &mut ChaCha20Rng, k: usize) -> (usize, usize) {
    let a = rng.random_range(0..k);
    let mut b = rng.random_range(0..k - 1);
    if b >= a {
        b += 1;
    }
    (a, b)
}
