//! Paired comparisons over seeds in one place: for per-seed values a (e.g. an arm at chunk 0,
//! or a control) and b (the arm after its last chunk, or the learned arm) on the same seeds, the
//! differences d = b − a; their mean, standard error (sample sd / √n), a 95% Student-t
//! interval with df = n − 1, the two-sided p-value of mean d = 0, and the smallest difference
//! detectable at 80% power, δ = (t_{0.975,df} + t_{0.80,df})·SE. One seed has no interval:
//! [`Paired::interval_text`] says so.

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

/// A difference resampled over seeds and prompts at once: the pigeonhole (two-way) bootstrap
/// of Owen (2007, "The pigeonhole bootstrap", Ann. Appl. Stat.) for a crossed design, where
/// every seed is evaluated on the same prompts. Each resample draws S seeds and P prompts with
/// replacement, independently, and takes the mean of d over the S × P cells they pick; the
/// interval is the resamples' 2.5 % and 97.5 % percentiles. Its spread carries both sources
/// the seed-level t-interval conditions on one of (the prompts drawn for evaluation).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Crossed {
    pub seeds: usize,
    pub prompts: usize,
    /// Mean of d over the grid.
    pub mean: f64,
    /// Standard deviation of the resampled means.
    pub sd: f64,
    /// The 95 % percentile interval.
    pub ci95: (f64, f64),
}

/// Resamples drawn by [`crossed_bootstrap`] in the report.
pub const RESAMPLES: usize = 4000;

/// [`Crossed`] of `d[seed][prompt]` (every row the same length), with `resamples` draws from a
/// fixed stream (the same input gives the same interval); None for fewer than 2 seeds or 2
/// prompts, or a ragged grid.
pub fn crossed_bootstrap(d: &[Vec<f64>], resamples: usize) -> Option<Crossed> {
    use rand::{Rng, SeedableRng};
    let (s, p) = (d.len(), d.first()?.len());
    if s < 2 || p < 2 || d.iter().any(|r| r.len() != p) || resamples < 2 {
        return None;
    }
    let mean = d.iter().flatten().sum::<f64>() / (s * p) as f64;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x7069_6765_6f6e_686f);
    let (mut seeds, mut prompts) = (vec![0usize; s], vec![0usize; p]);
    let mut means: Vec<f64> = (0..resamples)
        .map(|_| {
            seeds.iter_mut().for_each(|x| *x = rng.random_range(0..s));
            prompts.iter_mut().for_each(|x| *x = rng.random_range(0..p));
            seeds.iter().map(|&i| prompts.iter().map(|&j| d[i][j]).sum::<f64>()).sum::<f64>() / (s * p) as f64
        })
        .collect();
    let m = means.iter().sum::<f64>() / resamples as f64;
    let sd = (means.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (resamples - 1) as f64).sqrt();
    means.sort_by(f64::total_cmp);
    let at = |q: f64| means[((q * (resamples - 1) as f64).round() as usize).min(resamples - 1)];
    Some(Crossed { seeds: s, prompts: p, mean, sd, ci95: (at(0.025), at(0.975)) })
}

/// Mean and standard error of the mean (sd/√n; 0 for one value).
fn mean_se(v: &[f64]) -> (f64, f64) {
    let (m, sd) = mean_std(v);
    (m, sd / (v.len() as f64).sqrt())
}

/// ln Γ(x) for x > 0 (Lanczos, g = 7, 9 terms: ~15 digits).
fn ln_gamma(x: f64) -> f64 {
    const C: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    if x < 0.5 {
        // reflection
        let pi = std::f64::consts::PI;
        return (pi / (pi * x).sin()).ln() - ln_gamma(1.0 - x);
    }
    let x = x - 1.0;
    let t = x + 7.5;
    let a = C[0] + C[1..].iter().enumerate().map(|(i, c)| c / (x + i as f64 + 1.0)).sum::<f64>();
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + a.ln()
}

/// The regularised incomplete beta function I_x(a, b) (continued fraction, Lentz).
fn incomplete_beta(x: f64, a: f64, b: f64) -> f64 {
    if x <= 0.0 {
        return 0.0;
    }
    if x >= 1.0 {
        return 1.0;
    }
    if x > (a + 1.0) / (a + b + 2.0) {
        return 1.0 - incomplete_beta(1.0 - x, b, a);
    }
    let front = (ln_gamma(a + b) - ln_gamma(a) - ln_gamma(b) + a * x.ln() + b * (1.0 - x).ln()).exp() / a;
    let tiny = 1e-300;
    let (mut c, mut d) = (1.0, 1.0 - (a + b) * x / (a + 1.0));
    d = 1.0 / if d.abs() < tiny { tiny } else { d };
    let mut f = d;
    for m in 1..300 {
        let m = m as f64;
        for num in [
            m * (b - m) * x / ((a + 2.0 * m - 1.0) * (a + 2.0 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2.0 * m) * (a + 2.0 * m + 1.0)),
        ] {
            d = 1.0 + num * d;
            d = 1.0 / if d.abs() < tiny { tiny } else { d };
            c = 1.0 + num / c;
            c = if c.abs() < tiny { tiny } else { c };
            f *= c * d;
        }
        if (c * d - 1.0).abs() < 1e-15 {
            break;
        }
    }
    front * f
}

/// Student's t quantile: the t with P(T ≤ t) = p for T ~ t(df), by bisection on the CDF
/// (P(|T| > t) = I_{df/(df+t²)}(df/2, 1/2)).
pub fn t_quantile(p: f64, df: f64) -> f64 {
    assert!(p > 0.0 && p < 1.0 && df > 0.0, "t_quantile({p}, {df})");
    let cdf = |t: f64| {
        let tail = 0.5 * incomplete_beta(df / (df + t * t), df / 2.0, 0.5);
        if t >= 0.0 {
            1.0 - tail
        } else {
            tail
        }
    };
    let (mut lo, mut hi) = (-1e6, 1e6);
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if cdf(mid) < p {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

/// Mean of `v` and the half-width of its 95% t-interval (df = n − 1); None for the half-width
/// of one value.
pub(super) fn mean_t95(v: &[f64]) -> (f64, Option<f64>) {
    let (m, se) = mean_se(v);
    let hw = (v.len() > 1).then(|| t_quantile(0.975, (v.len() - 1) as f64) * se);
    (m, hw)
}

/// mean and sample std of `v` (std 0 for one value).
pub(super) fn mean_std(v: &[f64]) -> (f64, f64) {
    let n = v.len() as f64;
    let m = v.iter().sum::<f64>() / n;
    let var = if v.len() > 1 { v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0) } else { 0.0 };
    (m, var.sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Student's t quantiles against the printed tables (two-sided 95%: 12.706 at df 1, 4.303
    /// at 2, 3.182 at 3, 2.262 at 9, 2.042 at 30; 1.960 as df grows), and the normal's 1.645 is
    /// not df 3's (a control).
    #[test]
    fn t_quantiles_match_the_tables() {
        for (df, want) in [(1.0, 12.7062), (2.0, 4.3027), (3.0, 3.1824), (9.0, 2.2622), (30.0, 2.0423), (1e6, 1.9600)] {
            let got = t_quantile(0.975, df);
            assert!((got - want).abs() < 1e-3, "df {df}: {got} vs {want}");
        }
        assert!((t_quantile(0.95, 3.0) - 2.3534).abs() < 1e-3);
        assert!((t_quantile(0.025, 4.0) + 2.7764).abs() < 1e-3, "symmetric");
        assert!((t_quantile(0.95, 3.0) - 1.645).abs() > 0.5);
    }

    /// For an additive grid d = a_s + b_p the pigeonhole bootstrap's resampled mean is
    /// mean(a*) + mean(b*) with independent draws, so its variance is exactly
    /// var₁(a)/S + var₁(b)/P (var₁ the population variance, divisor N): the resampled sd is
    /// checked against that closed form. A prompt-only effect (a = 0) leaves the seed-level
    /// interval of the per-seed means at width 0 — the negative control the bootstrap must
    /// not share.
    #[test]
    fn the_crossed_bootstrap_carries_both_sources() {
        let a = [0.3, -0.2, 0.1, 0.5, -0.4, 0.0, 0.2, -0.1];
        let b: Vec<f64> = (0..24).map(|j| ((j * 7 % 11) as f64 - 5.0) / 4.0).collect();
        let var1 = |v: &[f64]| {
            let m = v.iter().sum::<f64>() / v.len() as f64;
            v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / v.len() as f64
        };
        let grid: Vec<Vec<f64>> = a.iter().map(|x| b.iter().map(|y| x + y).collect()).collect();
        let c = crossed_bootstrap(&grid, 20_000).unwrap();
        let want = (var1(&a) / 8.0 + var1(&b) / 24.0).sqrt();
        assert!((c.sd / want - 1.0).abs() < 0.03, "sd {} vs closed form {want}", c.sd);
        let mean = a.iter().sum::<f64>() / 8.0 + b.iter().sum::<f64>() / 24.0;
        assert!((c.mean - mean).abs() < 1e-12);
        assert!(c.ci95.0 < mean && mean < c.ci95.1);
        // prompts only: the seed-level comparison of per-seed means sees no spread at all
        let prompts_only: Vec<Vec<f64>> = (0..8).map(|_| b.clone()).collect();
        let per_seed: Vec<f64> = prompts_only.iter().map(|r| r.iter().sum::<f64>() / 24.0).collect();
        let t = paired(&[0.0; 8], &per_seed).unwrap();
        assert_eq!(t.ci95.map(|(lo, hi)| hi - lo), Some(0.0));
        let c = crossed_bootstrap(&prompts_only, 20_000).unwrap();
        let want = (var1(&b) / 24.0).sqrt();
        assert!(c.sd > 0.0 && (c.sd / want - 1.0).abs() < 0.03, "sd {} vs {want}", c.sd);
        // deterministic, and refused where it cannot say anything
        assert_eq!(crossed_bootstrap(&grid, 500), crossed_bootstrap(&grid, 500));
        assert!(crossed_bootstrap(&grid[..1], 500).is_none());
        assert!(crossed_bootstrap(&[vec![1.0, 2.0], vec![1.0]], 500).is_none());
    }

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
