//! Paired comparisons over seeds in one place: for per-seed values a (e.g. an arm at chunk 0,
//! or a control) and b (the arm after its last chunk, or the learned arm) on the same seeds, the
//! differences d = b − a; their mean, standard error (sample sd / √n), a 95% Student-t
//! interval with df = n − 1, the two-sided p-value of mean d = 0, and the smallest difference
//! detectable at 80% power, δ = (t_{0.975,df} + t_{0.80,df})·SE. One seed has no interval:
//! [`Paired::interval_text`] says so.

use super::{incomplete_beta, t_quantile};

/// A paired comparison of two arms (or two evaluations of one arm) over seeds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Paired {
    /// Seeds (pairs) compared.
    pub n: usize,
    /// Mean of d = b − a.
    pub mean: f64,
    /// sd(d)/√n (None for one seed).
    pub se: Option<f64>,
    /// The 95% t-interval of the mean difference (None for one seed).
    pub ci95: Option<(f64, f64)>,
    /// Two-sided p-value of mean d = 0 (None for one seed; 1 when every d is 0).
    pub p: Option<f64>,
    /// Smallest true difference detected with 80% power at the 5% level (None for one seed).
    pub mdd80: Option<f64>,
}

/// P(|T| > t) for T ~ t(df).
fn two_sided_p(t: f64, df: f64) -> f64 {
    incomplete_beta(df / (df + t * t), df / 2.0, 0.5).clamp(0.0, 1.0)
}

/// The paired comparison of `b` against `a` (the same seeds, in the same order); None when they
/// differ in length or are empty.
pub fn paired(a: &[f64], b: &[f64]) -> Option<Paired> {
    if a.len() != b.len() || a.is_empty() {
        return None;
    }
    let d: Vec<f64> = a.iter().zip(b).map(|(x, y)| y - x).collect();
    let n = d.len();
    let mean = d.iter().sum::<f64>() / n as f64;
    if n < 2 {
        return Some(Paired { n, mean, se: None, ci95: None, p: None, mdd80: None });
    }
    let df = (n - 1) as f64;
    let sd = (d.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / df).sqrt();
    let se = sd / (n as f64).sqrt();
    let t975 = t_quantile(0.975, df);
    let p = if se > 0.0 {
        two_sided_p(mean / se, df)
    } else if mean == 0.0 {
        1.0
    } else {
        0.0
    };
    Some(Paired {
        n,
        mean,
        se: Some(se),
        ci95: Some((mean - t975 * se, mean + t975 * se)),
        p: Some(p),
        mdd80: Some((t975 + t_quantile(0.80, df)) * se),
    })
}

impl Paired {
    /// "+0.1234 [+0.0100, +0.2368], p = 0.041, detectable ≥ 0.15", or "+0.1234 (1 seed: no
    /// interval)".
    pub fn interval_text(&self) -> String {
        match (self.ci95, self.p, self.mdd80) {
            (Some((lo, hi)), Some(p), Some(m)) => {
                format!("{:+.4} [{lo:+.4}, {hi:+.4}], p = {p:.3}, detectable ≥ {m:.4}", self.mean)
            }
            _ => format!("{:+.4} (1 seed: no interval)", self.mean),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// d = [1, 2, 3, 4, 5] (a = 0): mean 3, sd √2.5, SE 0.70711, t = 4.2426 on 4 df. The
    /// p-value by direct integration of the t(4) density, independently of the incomplete beta:
    /// `python3 -c "import math; pdf=lambda x:math.gamma(2.5)/(math.sqrt(4*math.pi)*math.gamma(2))*(1+x*x/4)**-2.5; N=200000; t=4.242640687119285; print(2*sum(pdf(t+u/(1-u))/(1-u)**2 for u in ((i+.5)/N for i in range(N)))/N)"`
    /// → 0.0132356. Quantiles from a t table: t_{0.975,4} = 2.7764, t_{0.80,4} = 0.9410, so the
    /// interval is 3 ± 1.9632 and δ = 3.7174·0.70711 = 2.6286.
    #[test]
    fn a_paired_comparison_matches_independent_values() {
        let p = paired(&[0.0; 5], &[1.0, 2.0, 3.0, 4.0, 5.0]).unwrap();
        assert_eq!(p.n, 5);
        assert!((p.mean - 3.0).abs() < 1e-12);
        assert!((p.se.unwrap() - 0.5f64.sqrt()).abs() < 1e-12);
        let (lo, hi) = p.ci95.unwrap();
        assert!((lo - 1.0368).abs() < 1e-3 && (hi - 4.9632).abs() < 1e-3, "{lo} {hi}");
        assert!((p.p.unwrap() - 0.013_235_6).abs() < 1e-5, "p = {}", p.p.unwrap());
        assert!((p.mdd80.unwrap() - 2.6286).abs() < 1e-3, "δ = {}", p.mdd80.unwrap());
        // d = [0.3, −0.1, 0.5, 0.2] on 3 df: t = 1.8, p = 0.16968 (the same integration, df 3)
        let q = paired(&[0.0; 4], &[0.3, -0.1, 0.5, 0.2]).unwrap();
        assert!((q.p.unwrap() - 0.169_68).abs() < 1e-4, "p = {}", q.p.unwrap());
        // t_{0.975,3} = 3.1824, t_{0.80,3} = 0.9785: δ = 4.1609·0.125
        assert!((q.mdd80.unwrap() - 4.1609 * 0.125).abs() < 1e-3, "δ = {}", q.mdd80.unwrap());
    }

    #[test]
    fn one_seed_has_no_interval_and_mismatched_seeds_none() {
        let p = paired(&[1.0], &[1.5]).unwrap();
        assert_eq!((p.se, p.ci95, p.p, p.mdd80), (None, None, None, None));
        assert_eq!(p.interval_text(), "+0.5000 (1 seed: no interval)");
        assert!(paired(&[1.0, 2.0], &[1.0]).is_none());
        // pairing matters: b − a is constant, so the paired interval has width 0 (an unpaired
        // one would not)
        let c = paired(&[1.0, 5.0, 9.0], &[2.0, 6.0, 10.0]).unwrap();
        assert_eq!(c.ci95, Some((1.0, 1.0)));
        assert_eq!(c.p, Some(0.0));
    }
}
