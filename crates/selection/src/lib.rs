//! Pair-selection strategies as pure functions of the learned rewards of n candidate responses
//! (and, for `ucb`, an uncertainty bonus per candidate), plus a seeded random source for the
//! random strategies and for breaking ties.
//!
//! [`select_pair`] implements the deployment strategies of paper §5.3 / §6 and of the authors'
//! `convert_to_dataset.py`: `random-pair`, `best-random`, `best-two`, `best-worst`,
//! `best-quantile` (best and the arm at rank max(2, ⌈n/q⌉): the authors' "best_quartile" is
//! q = 16 with n = 64, i.e. rank 4) and `ucb` (Eq. (6): the second arm maximises reward plus
//! β·‖φ(a′) − φ(a)‖_{𝓗⁻¹}, the first arm excluded). [`top_k`] ranks scores for the active
//! rules. Ties are broken by a seeded draw and reported, so runs are reproducible and the
//! number of ties is visible.

/// This crate's version (a run's meta.json records it).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

use rand::seq::SliceRandom;
use rand::Rng;
use std::fmt;
use std::str::FromStr;

/// How the two arms of a deployment round are chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Strategy {
    /// Two distinct arms uniformly at random (the authors' `random`).
    RandomPair,
    /// The best arm and a uniformly random other arm.
    BestRandom,
    /// Ranks 1 and 2 (`best_second`).
    BestTwo,
    /// Ranks 1 and n (`best_worst`).
    BestWorst,
    /// Rank 1 and rank max(2, ⌈n/q⌉); requires 1 ≤ q < n.
    BestQuantile { q: f64 },
    /// Rank 1, then argmax_{a′ ≠ a} r(a′) + β·bonus(a′) (paper Eq. (6)).
    Ucb { beta: f64 },
}

impl Strategy {
    /// Every strategy's name, as [`Strategy::name`] gives it and `FromStr` reads it.
    pub const NAMES: [&'static str; 6] =
        ["random-pair", "best-random", "best-two", "best-worst", "best-quantile", "ucb"];

    pub fn name(&self) -> &'static str {
        match self {
            Strategy::RandomPair => "random-pair",
            Strategy::BestRandom => "best-random",
            Strategy::BestTwo => "best-two",
            Strategy::BestWorst => "best-worst",
            Strategy::BestQuantile { .. } => "best-quantile",
            Strategy::Ucb { .. } => "ucb",
        }
    }

    /// Whether `select_pair` needs the per-arm uncertainty bonus.
    pub fn needs_bonus(&self) -> bool {
        matches!(self, Strategy::Ucb { .. })
    }

    /// Checks the strategy can run with n candidates.
    pub fn validate(&self, n: usize) -> Result<(), String> {
        if n < 2 {
            return Err(format!("{}: needs at least 2 candidates, got {n}", self.name()));
        }
        match *self {
            Strategy::BestQuantile { q } if !(q >= 1.0 && q < n as f64) => {
                Err(format!("best-quantile: q = {q} with n = {n} candidates: expected 1 ≤ q < n"))
            }
            Strategy::Ucb { beta } if !(beta.is_finite() && beta >= 0.0) => {
                Err(format!("ucb: beta = {beta}: expected a finite number ≥ 0"))
            }
            _ => Ok(()),
        }
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The names without parameters; `best-quantile` and `ucb` take theirs from elsewhere.
impl FromStr for Strategy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "random-pair" => Strategy::RandomPair,
            "best-random" => Strategy::BestRandom,
            "best-two" => Strategy::BestTwo,
            "best-worst" => Strategy::BestWorst,
            "best-quantile" => Strategy::BestQuantile { q: 16.0 },
            "ucb" => Strategy::Ucb { beta: 1.0 },
            _ => {
                return Err(format!(
                "unknown strategy `{s}`: expected random-pair, best-random, best-two, best-worst, best-quantile or ucb"
            ))
            }
        })
    }
}

/// The chosen pair and how many of its picks had to break a tie.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pair {
    pub first: usize,
    pub second: usize,
    /// 0, 1 or 2: picks whose value was shared with another candidate that could have been
    /// picked instead.
    pub ties: u32,
}

/// Candidate indices by descending `scores`, ties in a seeded random order.
pub fn rank_desc<R: Rng + ?Sized>(scores: &[f64], rng: &mut R) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.shuffle(rng);
    // stable sort keeps the shuffled order inside a tie
    idx.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
    idx
}

/// Whether the candidate at `rank` (0-based, in `order`) shares its score with a neighbour.
fn tied_at(scores: &[f64], order: &[usize], rank: usize) -> bool {
    let v = scores[order[rank]];
    (rank > 0 && scores[order[rank - 1]] == v) || (rank + 1 < order.len() && scores[order[rank + 1]] == v)
}

/// The k best of `scores` (indices, best first; ties broken by the seeded draw) and the number
/// of selected candidates whose score ties with a candidate across the cut.
pub fn top_k<R: Rng + ?Sized>(scores: &[f64], k: usize, rng: &mut R) -> (Vec<usize>, u32) {
    let order = rank_desc(scores, rng);
    let k = k.min(order.len());
    let ties = if k > 0 && k < order.len() && scores[order[k - 1]] == scores[order[k]] {
        order[..k].iter().filter(|&&i| scores[i] == scores[order[k]]).count() as u32
    } else {
        0
    };
    (order[..k].to_vec(), ties)
}

/// Chooses the two arms of a round from the learned rewards of the n candidates. `bonus[a]`
/// is the uncertainty term ‖φ(a) − φ(best)‖_{𝓗⁻¹} of candidate a, needed only by `ucb` (it is
/// computed after the first arm is known: see [`first_arm`]).
pub fn select_pair<R: Rng + ?Sized>(strategy: &Strategy, rewards: &[f64], bonus: Option<&[f64]>, rng: &mut R) -> Pair {
    let n = rewards.len();
    assert!(n >= 2, "select_pair needs at least 2 candidates (validate the strategy first)");
    if let Strategy::RandomPair = strategy {
        let first = rng.random_range(0..n);
        let mut second = rng.random_range(0..n - 1);
        if second >= first {
            second += 1;
        }
        return Pair { first, second, ties: 0 };
    }
    let order = rank_desc(rewards, rng);
    let first = order[0];
    let first_tie = u32::from(tied_at(rewards, &order, 0));
    let (second, second_tie) = match *strategy {
        Strategy::RandomPair => unreachable!("handled above"),
        Strategy::BestRandom => {
            let k = rng.random_range(1..n);
            (order[k], 0)
        }
        Strategy::BestTwo => (order[1], u32::from(tied_at(rewards, &order, 1))),
        Strategy::BestWorst => (order[n - 1], u32::from(tied_at(rewards, &order, n - 1))),
        Strategy::BestQuantile { q } => {
            let rank = quantile_rank(n, q);
            (order[rank - 1], u32::from(tied_at(rewards, &order, rank - 1)))
        }
        Strategy::Ucb { beta } => {
            let bonus = bonus.expect("ucb needs the uncertainty bonus of every candidate");
            let scores: Vec<f64> =
                (0..n).map(|a| if a == first { f64::NEG_INFINITY } else { rewards[a] + beta * bonus[a] }).collect();
            let o = rank_desc(&scores, rng);
            (o[0], u32::from(tied_at(&scores, &o, 0)))
        }
    };
    Pair { first, second, ties: first_tie + second_tie }
}

/// The first arm alone (argmax of the learned reward, ties by the seeded draw): `ucb` needs it
/// before its bonuses can be computed. Using the same `rng` state, `select_pair` then picks the
/// same first arm.
pub fn first_arm<R: Rng + Clone>(rewards: &[f64], rng: &R) -> usize {
    rank_desc(rewards, &mut rng.clone())[0]
}

/// The 1-based rank of best-quantile's second arm: max(2, ⌈n/q⌉).
pub fn quantile_rank(n: usize, q: f64) -> usize {
    ((n as f64 / q).ceil() as usize).clamp(2, n)
}

/// Kendall's τ_b between two score vectors (ties in either counted as τ_b does); 0 when either
/// is constant.
pub fn kendall_tau_b(a: &[f64], b: &[f64]) -> f64 {
    let (mut conc, mut disc, mut ta, mut tb) = (0i64, 0i64, 0i64, 0i64);
    for i in 0..a.len() {
        for j in i + 1..a.len() {
            let (x, y) = ((a[i] - a[j]).signum(), (b[i] - b[j]).signum());
            let (x, y) = (if a[i] == a[j] { 0.0 } else { x }, if b[i] == b[j] { 0.0 } else { y });
            match (x == 0.0, y == 0.0) {
                (true, true) => {}
                (true, false) => ta += 1,
                (false, true) => tb += 1,
                _ if x == y => conc += 1,
                _ => disc += 1,
            }
        }
    }
    let n = ((conc + disc + ta) as f64 * (conc + disc + tb) as f64).sqrt();
    if n == 0.0 {
        0.0
    } else {
        (conc - disc) as f64 / n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    /// `NAMES` is every strategy: each parses to a strategy of that name, and a name not in it
    /// does not parse.
    #[test]
    fn names_are_the_strategies() {
        for n in Strategy::NAMES {
            assert_eq!(n.parse::<Strategy>().unwrap().name(), n);
        }
        assert!("best-three".parse::<Strategy>().is_err());
    }

    #[test]
    fn deterministic_strategies_pick_the_documented_ranks() {
        let r = [0.1, 0.9, 0.5, -2.0, 0.7, 0.3, 0.2, 0.0];
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        assert_eq!(select_pair(&Strategy::BestTwo, &r, None, &mut rng), Pair { first: 1, second: 4, ties: 0 });
        assert_eq!(select_pair(&Strategy::BestWorst, &r, None, &mut rng), Pair { first: 1, second: 3, ties: 0 });
        // n = 8, q = 2: rank ⌈8/2⌉ = 4 → 0.3 (index 5)
        assert_eq!(select_pair(&Strategy::BestQuantile { q: 2.0 }, &r, None, &mut rng).second, 5);
        // q close to n: rank max(2, 1) = 2
        assert_eq!(select_pair(&Strategy::BestQuantile { q: 7.5 }, &r, None, &mut rng).second, 4);
        assert_eq!(quantile_rank(64, 16.0), 4, "the authors' best_quartile is rank 4 of 64");
    }

    #[test]
    fn ucb_excludes_the_first_arm_and_adds_the_bonus() {
        let r = [1.0, 0.8, 0.5, 0.0];
        let bonus = [100.0, 0.0, 0.0, 1.0];
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let p = select_pair(&Strategy::Ucb { beta: 1.0 }, &r, Some(&bonus), &mut rng);
        assert_eq!((p.first, p.second), (0, 3));
        let p = select_pair(&Strategy::Ucb { beta: 0.0 }, &r, Some(&bonus), &mut rng);
        assert_eq!((p.first, p.second), (0, 1));
    }

    #[test]
    fn ties_are_broken_by_the_seed_and_counted() {
        let r = [0.5, 0.5, 0.5, 0.1];
        let mut firsts = std::collections::BTreeSet::new();
        for seed in 0..50 {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let p = select_pair(&Strategy::BestWorst, &r, None, &mut rng);
            assert_eq!(p.second, 3);
            assert_eq!(p.ties, 1);
            firsts.insert(p.first);
            let mut again = ChaCha8Rng::seed_from_u64(seed);
            assert_eq!(select_pair(&Strategy::BestWorst, &r, None, &mut again), p, "same seed, same pair");
        }
        assert_eq!(firsts.len(), 3, "every tied arm wins for some seed");
    }

    #[test]
    fn random_strategies_cover_all_pairs_and_never_repeat_an_arm() {
        let r = [0.0, 1.0, 2.0, 3.0];
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..2000 {
            let p = select_pair(&Strategy::RandomPair, &r, None, &mut rng);
            assert_ne!(p.first, p.second);
            seen.insert((p.first, p.second));
            let q = select_pair(&Strategy::BestRandom, &r, None, &mut rng);
            assert_eq!(q.first, 3);
            assert_ne!(q.second, 3);
        }
        assert_eq!(seen.len(), 12);
    }

    #[test]
    fn top_k_and_first_arm() {
        let s = [0.2, 0.9, 0.9, 0.1, 0.5];
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let (k, ties) = top_k(&s, 2, &mut rng);
        assert_eq!(k.iter().copied().collect::<std::collections::BTreeSet<_>>(), [1, 2].into());
        assert_eq!(ties, 0, "both tied values are inside the cut");
        let (k, ties) = top_k(&s, 1, &mut rng);
        assert!(k == vec![1] || k == vec![2]);
        assert_eq!(ties, 1);
        let rng = ChaCha8Rng::seed_from_u64(4);
        let f = first_arm(&s, &rng);
        let mut r2 = rng.clone();
        assert_eq!(select_pair(&Strategy::BestTwo, &s, None, &mut r2).first, f);
    }

    #[test]
    fn validation() {
        assert!(Strategy::BestQuantile { q: 8.0 }.validate(8).is_err());
        assert!(Strategy::BestQuantile { q: 0.5 }.validate(8).is_err());
        assert!(Strategy::BestQuantile { q: 16.0 }.validate(64).is_ok());
        assert!(Strategy::BestTwo.validate(1).is_err());
        assert!("best-three".parse::<Strategy>().is_err());
    }

    /// τ_b = (n_c − n_d) / √((n₀ − n₁)(n₀ − n₂)) with n₁, n₂ counted from the tie groups.
    #[test]
    fn kendall_tau_b_matches_the_tie_group_formula() {
        let groups = |v: &[f64]| -> f64 {
            let mut s = v.to_vec();
            s.sort_by(f64::total_cmp);
            let mut t = 0.0;
            let mut i = 0;
            while i < s.len() {
                let j = (i..s.len()).find(|&j| s[j] != s[i]).unwrap_or(s.len());
                let k = (j - i) as f64;
                t += k * (k - 1.0) / 2.0;
                i = j;
            }
            t
        };
        let mut rng = rand_chacha::ChaCha20Rng::seed_from_u64(5);
        use rand::SeedableRng;
        for _ in 0..200 {
            let n = rng.random_range(2..9);
            let a: Vec<f64> = (0..n).map(|_| f64::from(rng.random_range(0..4u8))).collect();
            let b: Vec<f64> = (0..n).map(|_| f64::from(rng.random_range(0..4u8))).collect();
            let (mut nc, mut nd) = (0.0, 0.0);
            for i in 0..n {
                for j in 0..i {
                    let p = (a[i] - a[j]) * (b[i] - b[j]);
                    if p > 0.0 {
                        nc += 1.0
                    } else if p < 0.0 {
                        nd += 1.0
                    }
                }
            }
            let n0 = (n * (n - 1) / 2) as f64;
            let den = ((n0 - groups(&a)) * (n0 - groups(&b))).sqrt();
            let want = if den == 0.0 { 0.0 } else { (nc - nd) / den };
            assert!((kendall_tau_b(&a, &b) - want).abs() < 1e-12, "{a:?} {b:?}");
        }
        let a = [0.3, -1.0, 2.0, 0.5];
        assert_eq!(kendall_tau_b(&a, &a), 1.0);
        assert_eq!(kendall_tau_b(&a, &a.map(|x| -x)), -1.0);
    }
}
