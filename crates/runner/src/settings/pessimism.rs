//! The pessimistic policy of Alg. 2: per context, or Eq. (5) over the policy class.

use crate::spec::Pessimism;
use crate::world::env::{argmax, dot, Env};

/// The pessimistic policy of Alg. 2 with width β over the contexts; `norm` is the cell's
/// ‖·‖_{𝓗_t⁻¹} (the estimator's own 𝓗_t or the tracker's). With `centred`, Zhu et al.'s
/// reference-vector form: the penalty is on φ(x, a) − φ̄(x), φ̄(x) the mean over arms (a uniform
/// reference policy), and Eq. (5) on m − v, v its mean over contexts — 𝓗 only ever sees
/// differences of features, so the component all arms share no longer dominates the width.
pub fn pessimistic(
    env: &Env,
    theta: &[f64],
    norm: &mut dyn FnMut(&[f64]) -> f64,
    beta: f64,
    how: Pessimism,
    centred: bool,
) -> Vec<usize> {
    let k = env.k;
    let refs = reference_arms(env, centred);
    let phi64 = |c: usize, a: usize| -> Vec<f64> {
        env.arm(&env.contexts[c], a).iter().zip(&refs[c]).map(|(&v, r)| f64::from(v) - r).collect()
    };
    match how {
        Pessimism::PerContext => (0..env.contexts.len())
            .map(|c| argmax((0..k).map(|a| dot(env.arm(&env.contexts[c], a), theta) - beta * norm(&phi64(c, a)))))
            .collect(),
        Pessimism::Policy => {
            // Eq. (5): J(π) = mᵀθ − β‖m‖_{𝓗⁻¹}, m = mean_x φ(x, π(x)); exhaustive when the
            // policy class is small, else coordinate ascent from the greedy policy
            let n = env.contexts.len();
            // phi64 is already centred: m is m_π − v, and (m_π − v)ᵀθ ranks policies as m_πᵀθ does
            let mut objective =
                |m: &[f64]| -> f64 { m.iter().zip(theta).map(|(a, b)| a * b).sum::<f64>() - beta * norm(m) };
            if (k as f64).powi(n as i32) <= 1e5 {
                policy_exhaustive(env, &phi64, &mut objective)
            } else {
                policy_ascent(env, env.greedy(theta), &phi64, &mut objective)
            }
        }
    }
}

/// Each context's reference vector φ̄(x): the mean of its arms' features (a uniform reference
/// policy) when `centred`, else 0 (the paper's form).
fn reference_arms(env: &Env, centred: bool) -> Vec<Vec<f64>> {
    let k = env.k;
    let mean_arm = |c: usize| -> Vec<f64> {
        let mut m = vec![0.0; env.d];
        if centred {
            for a in 0..k {
                for (mi, &v) in m.iter_mut().zip(env.arm(&env.contexts[c], a)) {
                    *mi += f64::from(v) / k as f64;
                }
            }
        }
        m
    };
    (0..env.contexts.len()).map(mean_arm).collect()
}

/// m of Eq. (5) for the policy `choice` (an arm per context): mean_x φ(x, π(x)) of the
/// (centred) features `phi64`.
fn policy_mean(env: &Env, phi64: &dyn Fn(usize, usize) -> Vec<f64>, choice: &[usize]) -> Vec<f64> {
    let n = env.contexts.len();
    let mut m = vec![0.0; env.d];
    for (c, &a) in choice.iter().enumerate() {
        for (mi, v) in m.iter_mut().zip(phi64(c, a)) {
            *mi += v / n as f64;
        }
    }
    m
}

/// Eq. (5) by enumeration: every policy of the class (k^n of them, in lexicographic order),
/// the first with the largest `objective` J(π).
fn policy_exhaustive(
    env: &Env,
    phi64: &dyn Fn(usize, usize) -> Vec<f64>,
    objective: &mut dyn FnMut(&[f64]) -> f64,
) -> Vec<usize> {
    let (n, k) = (env.contexts.len(), env.k);
    let mut best = (f64::NEG_INFINITY, vec![0; n]);
    let mut choice = vec![0usize; n];
    loop {
        let v = objective(&policy_mean(env, phi64, &choice));
        if v > best.0 {
            best = (v, choice.clone());
        }
        // next policy in lexicographic order
        let mut i = 0;
        while i < n && choice[i] + 1 == k {
            choice[i] = 0;
            i += 1;
        }
        if i == n {
            break;
        }
        choice[i] += 1;
    }
    best.1
}

/// Eq. (5) by coordinate ascent from `choice` (the greedy policy): sweep the contexts, taking
/// any single-context change of arm that raises `objective` J(π) by more than 1e-12, until a
/// sweep changes nothing.
fn policy_ascent(
    env: &Env,
    mut choice: Vec<usize>,
    phi64: &dyn Fn(usize, usize) -> Vec<f64>,
    objective: &mut dyn FnMut(&[f64]) -> f64,
) -> Vec<usize> {
    let (n, k) = (env.contexts.len(), env.k);
    let mut m = policy_mean(env, phi64, &choice);
    let mut current = objective(&m);
    loop {
        let mut improved = false;
        #[allow(clippy::needless_range_loop)] // c indexes contexts and `choice`
        for c in 0..n {
            for a in 0..k {
                if a == choice[c] {
                    continue;
                }
                let (old, new) = (phi64(c, choice[c]), phi64(c, a));
                let trial: Vec<f64> =
                    m.iter().zip(old.iter().zip(&new)).map(|(mi, (o, w))| mi + (w - o) / n as f64).collect();
                let v = objective(&trial);
                if v > current + 1e-12 {
                    current = v;
                    m = trial;
                    choice[c] = a;
                    improved = true;
                }
            }
        }
        if !improved {
            break choice;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::EnvSpec;
    use estimators::{Curvature, CurvatureKind, HessianPoint};

    fn objective(env: &Env, theta: &[f64], curv: &Curvature, beta: f64, choice: &[usize]) -> f64 {
        let n = env.contexts.len() as f64;
        let mut m = vec![0.0; env.d];
        for (c, &a) in choice.iter().enumerate() {
            for (mi, &v) in m.iter_mut().zip(env.arm(&env.contexts[c], a)) {
                *mi += f64::from(v) / n;
            }
        }
        m.iter().zip(theta).map(|(a, b)| a * b).sum::<f64>() - beta * curv.inv_norm_f64(&m)
    }

    #[test]
    fn pessimistic_policies() {
        for contexts in [5, 12] {
            // 3^5 policies are enumerated; 3^12 > 1e5 use coordinate ascent
            let spec = EnvSpec { dim: 4, contexts, arms: 3, eval_pairs: 10, ..Default::default() };
            let env = Env::new(&spec, 7, 0);
            let mut curv = Curvature::new(CurvatureKind::Hessian { lambda: 1.0, point: HessianPoint::LookAhead }, 4);
            curv.add(&env.contexts[0].phi[..4], 3.0);
            let theta: Vec<f64> = env.theta_star.iter().map(|v| 0.7 * v + 0.1).collect();
            let greedy = env.greedy(&theta);
            let norm = |x: &[f64]| curv.inv_norm_f64(x);
            assert_eq!(pessimistic(&env, &theta, &mut { norm }, 0.0, Pessimism::PerContext, false), greedy);
            let p0 = pessimistic(&env, &theta, &mut { norm }, 0.0, Pessimism::Policy, false);
            assert!(
                (objective(&env, &theta, &curv, 0.0, &p0) - objective(&env, &theta, &curv, 0.0, &greedy)).abs() < 1e-12
            );
            let p = pessimistic(&env, &theta, &mut { norm }, 2.0, Pessimism::Policy, false);
            let v = objective(&env, &theta, &curv, 2.0, &p);
            assert!(v >= objective(&env, &theta, &curv, 2.0, &greedy) - 1e-12, "never worse than its start");
            if contexts == 5 {
                // exhaustive: no single-context change improves Eq. (5)
                for c in 0..contexts {
                    for a in 0..3 {
                        let mut q = p.clone();
                        q[c] = a;
                        assert!(objective(&env, &theta, &curv, 2.0, &q) <= v + 1e-12);
                    }
                }
            }
        }
    }

    /// Zhu et al.'s reference-vector form: adding a vector common to every arm of a context
    /// (what 𝓗, built from differences, never sees) leaves the centred pessimistic policy as it
    /// was; the paper's form, whose penalty is on ‖φ‖, changes (negative control).
    #[test]
    fn the_reference_form_ignores_what_all_arms_share() {
        let spec = EnvSpec { dim: 4, contexts: 8, arms: 3, eval_pairs: 10, ..Default::default() };
        let env = Env::new(&spec, 11, 0);
        let mut curv = Curvature::new(CurvatureKind::Hessian { lambda: 1.0, point: HessianPoint::LookAhead }, 4);
        // curvature along differences of arms only, as training pairs give it
        for c in env.contexts.iter() {
            let z: Vec<f32> = env.arm(c, 0).iter().zip(env.arm(c, 1)).map(|(a, b)| a - b).collect();
            curv.add(&z, 5.0);
        }
        let theta: Vec<f64> = env.theta_star.iter().map(|v| 0.8 * v).collect();
        let mut shifted = Env::new(&spec, 11, 0);
        let mut contexts: Vec<crate::world::env::Context> = shifted.contexts.iter().cloned().collect();
        for (i, c) in contexts.iter_mut().enumerate() {
            let u: Vec<f32> = (0..4).map(|j| 3.0 * ((i * 5 + j * 3) % 7) as f32 - 9.0).collect();
            for arm in c.phi.chunks_exact_mut(4) {
                for (p, v) in arm.iter_mut().zip(&u) {
                    *p += v;
                }
            }
        }
        shifted.contexts = std::sync::Arc::new(contexts);
        let norm = |x: &[f64]| curv.inv_norm_f64(x);
        for how in [Pessimism::PerContext, Pessimism::Policy] {
            let a = pessimistic(&env, &theta, &mut { norm }, 3.0, how, true);
            let b = pessimistic(&shifted, &theta, &mut { norm }, 3.0, how, true);
            assert_eq!(a, b, "{how:?}: the centred form moved with a shift common to all arms");
        }
        let a = pessimistic(&env, &theta, &mut { norm }, 3.0, Pessimism::PerContext, false);
        let b = pessimistic(&shifted, &theta, &mut { norm }, 3.0, Pessimism::PerContext, false);
        assert_ne!(a, b, "the paper's form should move with the shift (else this test proves nothing)");
    }
}
