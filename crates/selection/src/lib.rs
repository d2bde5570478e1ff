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
//!
//! [`select_ensemble`] implements the strategies that read an ensemble's K reward estimates per
//! candidate (oat's explorers, sail-sg/oat `oat/rm/model.py`, revision c1a074c): `thompson`,
//! `double-thompson` (oat's `EnnEETS`), `ensemble-uncertainty` (`EnnUncertainty`) and `baits`
//! (`EnnBAITS`); see [`Strategy`] for each.

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
    /// Thompson sampling with one draw: a head k uniformly at random, its best and its second
    /// best candidate.
    Thompson,
    /// Double Thompson sampling (oat's `EnnEETS`, "E&E Thompson sampling"; Dwaracherla et al.
    /// 2024): a head k₁ uniformly at random gives the first arm, its argmax; the other heads in
    /// a uniformly random order give the second, the first whose argmax differs (a redraw
    /// whenever a head picks the first arm again); when every head agrees, k₁'s second best.
    DoubleThompson,
    /// The pair {a, a′} of largest ensemble variance of the reward difference,
    /// Var_k(r_k(a) − r_k(a′)) (oat's `EnnUncertainty` with `logits_variance`).
    EnsembleUncertainty,
    /// oat's `EnnBAITS`: the first arm by one Thompson draw (a random head's argmax), the second
    /// the arm a′ ≠ a of largest Var_k(r_k(a) − r_k(a′)).
    Baits,
}

impl Strategy {
    /// Every strategy's name, as [`Strategy::name`] gives it and `FromStr` reads it.
    pub const NAMES: [&'static str; 10] = [
        "random-pair",
        "best-random",
        "best-two",
        "best-worst",
        "best-quantile",
        "ucb",
        "thompson",
        "double-thompson",
        "ensemble-uncertainty",
        "baits",
    ];

    pub fn name(&self) -> &'static str {
        match self {
            Strategy::RandomPair => "random-pair",
            Strategy::BestRandom => "best-random",
            Strategy::BestTwo => "best-two",
            Strategy::BestWorst => "best-worst",
            Strategy::BestQuantile { .. } => "best-quantile",
            Strategy::Ucb { .. } => "ucb",
            Strategy::Thompson => "thompson",
            Strategy::DoubleThompson => "double-thompson",
            Strategy::EnsembleUncertainty => "ensemble-uncertainty",
            Strategy::Baits => "baits",
        }
    }

    /// Whether the strategy reads an ensemble's heads ([`select_ensemble`]) rather than one
    /// reward per candidate.
    pub fn needs_ensemble(&self) -> bool {
        matches!(self, Strategy::Thompson | Strategy::DoubleThompson | Strategy::EnsembleUncertainty | Strategy::Baits)
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
            "thompson" => Strategy::Thompson,
            "double-thompson" => Strategy::DoubleThompson,
            "ensemble-uncertainty" => Strategy::EnsembleUncertainty,
            "baits" => Strategy::Baits,
            _ => return Err(format!("unknown strategy `{s}`: expected one of {}", Strategy::NAMES.join(", "))),
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
    assert!(!strategy.needs_ensemble(), "{strategy} reads an ensemble's heads: call select_ensemble");
    let order = rank_desc(rewards, rng);
    let first = order[0];
    let first_tie = u32::from(tied_at(rewards, &order, 0));
    let (second, second_tie) = match *strategy {
        Strategy::RandomPair => unreachable!("handled above"),
        Strategy::Thompson | Strategy::DoubleThompson | Strategy::EnsembleUncertainty | Strategy::Baits => {
            unreachable!("asserted above")
        }
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

/// Chooses the two arms of a round from an ensemble's rewards: `heads` is K × n, head-major
/// (`heads[k·n + a]` = r_k(a)), for the strategies with [`Strategy::needs_ensemble`]. Every
/// random draw (the head, the other heads' order, ties) comes from `rng`.
pub fn select_ensemble<R: Rng + ?Sized>(strategy: &Strategy, heads: &[f64], k: usize, rng: &mut R) -> Pair {
    assert!(k >= 1 && heads.len().is_multiple_of(k), "{} rewards for {k} heads", heads.len());
    let n = heads.len() / k;
    assert!(n >= 2, "select_ensemble needs at least 2 candidates (validate the strategy first)");
    let head = |h: usize| &heads[h * n..(h + 1) * n];
    // argmax of one head, ties by the seeded draw: (arm, tied)
    let best = |h: usize, rng: &mut R| {
        let order = rank_desc(head(h), rng);
        (order[0], tied_at(head(h), &order, 0))
    };
    // the sample variance over heads (divisor K − 1, as torch's var) of r_k(a) − r_k(b)
    let var = |a: usize, b: usize| {
        let diffs: Vec<f64> = (0..k).map(|h| head(h)[a] - head(h)[b]).collect();
        let mean = diffs.iter().sum::<f64>() / k as f64;
        diffs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / (k.max(2) - 1) as f64
    };
    match strategy {
        Strategy::Thompson => {
            let h = rng.random_range(0..k);
            let order = rank_desc(head(h), rng);
            let ties = u32::from(tied_at(head(h), &order, 0)) + u32::from(tied_at(head(h), &order, 1));
            Pair { first: order[0], second: order[1], ties }
        }
        Strategy::DoubleThompson => {
            let h1 = rng.random_range(0..k);
            let (first, t1) = best(h1, rng);
            let mut others: Vec<usize> = (0..k).filter(|&h| h != h1).collect();
            others.shuffle(rng);
            for h in others {
                let (a, t) = best(h, rng);
                if a != first {
                    return Pair { first, second: a, ties: u32::from(t1) + u32::from(t) };
                }
            }
            // every head agrees: the first head's second best
            let scores: Vec<f64> =
                head(h1).iter().enumerate().map(|(a, &r)| if a == first { f64::NEG_INFINITY } else { r }).collect();
            let o = rank_desc(&scores, rng);
            Pair { first, second: o[0], ties: u32::from(t1) + u32::from(tied_at(&scores, &o, 0)) }
        }
        Strategy::EnsembleUncertainty => {
            let pairs: Vec<(usize, usize)> = (0..n).flat_map(|a| (a + 1..n).map(move |b| (a, b))).collect();
            let scores: Vec<f64> = pairs.iter().map(|&(a, b)| var(a, b)).collect();
            let o = rank_desc(&scores, rng);
            let (first, second) = pairs[o[0]];
            Pair { first, second, ties: u32::from(tied_at(&scores, &o, 0)) }
        }
        Strategy::Baits => {
            let h = rng.random_range(0..k);
            let (first, t1) = best(h, rng);
            let scores: Vec<f64> = (0..n).map(|b| if b == first { f64::NEG_INFINITY } else { var(first, b) }).collect();
            let o = rank_desc(&scores, rng);
            Pair { first, second: o[0], ties: u32::from(t1) + u32::from(tied_at(&scores, &o, 0)) }
        }
        other => panic!("{other} does not read an ensemble: call select_pair"),
    }
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

    /// A fixed ensemble of K = 5 heads over n = 5 candidates, no ties within a head.
    /// Heads' (best, second best): 0 → (0, 1), 1 → (0, 2), 2 → (3, 0), 3 → (4, 3), 4 → (0, 1).
    const ENS: [[f64; 5]; 5] = [
        [0.9, 0.5, 0.1, 0.0, -0.3],
        [0.8, -0.2, 0.6, 0.1, 0.0],
        [0.4, -1.0, 0.2, 0.7, 0.3],
        [-0.5, 0.1, 0.0, 0.6, 0.9],
        [1.2, 1.1, -0.4, 0.3, 0.2],
    ];

    fn flat(e: &[[f64; 5]]) -> Vec<f64> {
        e.iter().flatten().copied().collect()
    }

    fn argmax(r: &[f64]) -> usize {
        (0..r.len()).fold(0, |b, a| if r[a] > r[b] { a } else { b })
    }

    /// Empirical pair frequencies over `draws` seeds against exact probabilities from the
    /// definition: every pair seen has positive probability and every frequency is within
    /// 4.5 binomial standard deviations of it.
    fn check_frequencies(s: &Strategy, want: &std::collections::BTreeMap<(usize, usize), f64>, draws: u64) {
        let h = flat(&ENS);
        let mut got = std::collections::BTreeMap::<(usize, usize), f64>::new();
        for seed in 0..draws {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let p = select_ensemble(s, &h, 5, &mut rng);
            assert_eq!(p.ties, 0, "no ties in this ensemble");
            *got.entry((p.first, p.second)).or_default() += 1.0 / draws as f64;
        }
        for pair in got.keys() {
            assert!(want.contains_key(pair), "{s}: {pair:?} has probability 0 by the definition");
        }
        for (pair, p) in want {
            let f = got.get(pair).copied().unwrap_or(0.0);
            let sd = (p * (1.0 - p) / draws as f64).sqrt();
            assert!((f - p).abs() <= 4.5 * sd + 1e-12, "{s}: {pair:?} drawn {f}, definition {p}");
        }
    }

    /// Thompson: one head uniformly at random, its best and second best. The probability of a
    /// pair is the share of heads whose top two it is.
    #[test]
    fn thompson_choices_match_their_definition() {
        let mut want = std::collections::BTreeMap::new();
        for r in &ENS {
            let a = argmax(r);
            let rest: Vec<f64> =
                r.iter().enumerate().map(|(i, &v)| if i == a { f64::NEG_INFINITY } else { v }).collect();
            *want.entry((a, argmax(&rest))).or_insert(0.0) += 1.0 / 5.0;
        }
        assert_eq!(want.len(), 4, "heads 0 and 4 share their top two");
        check_frequencies(&Strategy::Thompson, &want, 20_000);
    }

    /// Double Thompson: P(first = a, second = b) = Σ over heads h₁ with argmax a of
    /// (1/K)·#{h ≠ h₁: argmax h = b} / #{h ≠ h₁: argmax h ≠ a}; when no other head differs,
    /// h₁'s second best.
    #[test]
    fn double_thompson_choices_match_their_definition() {
        let best: Vec<usize> = ENS.iter().map(|r| argmax(r)).collect();
        let mut want = std::collections::BTreeMap::new();
        for (h1, &a) in best.iter().enumerate() {
            let differ: Vec<usize> = (0..5).filter(|&h| h != h1 && best[h] != a).collect();
            for &h in &differ {
                *want.entry((a, best[h])).or_insert(0.0) += 0.2 / differ.len() as f64;
            }
        }
        check_frequencies(&Strategy::DoubleThompson, &want, 20_000);
        // all heads agree on the best: the second is the drawn head's second best
        let agree = [[1.0, 0.5, 0.0], [1.0, 0.0, 0.5], [1.0, 0.5, 0.0]];
        let h: Vec<f64> = agree.iter().flatten().copied().collect();
        let mut seconds = std::collections::BTreeSet::new();
        for seed in 0..200 {
            let p = select_ensemble(&Strategy::DoubleThompson, &h, 3, &mut ChaCha8Rng::seed_from_u64(seed));
            assert_eq!(p.first, 0);
            seconds.insert(p.second);
        }
        assert_eq!(seconds, [1, 2].into(), "each head's second best, by the head drawn");
        // a different ensemble gives other probabilities: the check can fail
        let mut wrong = want.clone();
        let (k0, v0) = wrong.iter().next().map(|(k, v)| (*k, *v)).unwrap();
        wrong.insert(k0, v0 + 0.05);
        let r = std::panic::catch_unwind(|| check_frequencies(&Strategy::DoubleThompson, &wrong, 20_000));
        assert!(r.is_err(), "a probability off by 0.05 passed");
    }

    /// Var_k of r_k(a) − r_k(b) by E[x²] − E[x]², rescaled to the K − 1 divisor.
    fn brute_var(h: &[Vec<f64>], a: usize, b: usize) -> f64 {
        let k = h.len() as f64;
        let (mut s, mut s2) = (0.0, 0.0);
        for r in h {
            let x = r[a] - r[b];
            s += x;
            s2 += x * x;
        }
        (s2 / k - (s / k) * (s / k)) * k / (k - 1.0)
    }

    /// ensemble-uncertainty picks the pair of largest variance, baits the first arm of a head's
    /// argmax and the partner of largest variance with it: against a brute force on random
    /// ensembles.
    #[test]
    fn uncertainty_rules_match_a_brute_force_variance() {
        let mut g = ChaCha8Rng::seed_from_u64(11);
        for trial in 0..200 {
            let (k, n) = (g.random_range(2..8), g.random_range(2..9));
            let h: Vec<Vec<f64>> = (0..k).map(|_| (0..n).map(|_| g.random_range(-2.0..2.0)).collect()).collect();
            let flat: Vec<f64> = h.iter().flatten().copied().collect();
            let mut best = (0, 1, f64::NEG_INFINITY);
            for a in 0..n {
                for b in 0..n {
                    if a != b && brute_var(&h, a, b) > best.2 {
                        best = (a, b, brute_var(&h, a, b));
                    }
                }
            }
            let mut rng = ChaCha8Rng::seed_from_u64(trial);
            let p = select_ensemble(&Strategy::EnsembleUncertainty, &flat, k, &mut rng);
            let v = brute_var(&h, p.first, p.second);
            assert!((v - best.2).abs() <= 1e-9 * (1.0 + best.2), "trial {trial}: var {v}, max {}", best.2);
            assert_ne!(p.first, p.second);
            let q = select_ensemble(&Strategy::Baits, &flat, k, &mut rng);
            assert!(h.iter().any(|r| argmax(r) == q.first), "trial {trial}: baits' first is no head's argmax");
            let partner =
                (0..n).filter(|&b| b != q.first).map(|b| brute_var(&h, q.first, b)).fold(f64::NEG_INFINITY, f64::max);
            let v = brute_var(&h, q.first, q.second);
            assert!(
                q.second != q.first && (v - partner).abs() <= 1e-9 * (1.0 + partner),
                "trial {trial}: baits' second"
            );
        }
    }

    #[test]
    fn ensemble_strategies_parse_and_say_they_need_an_ensemble() {
        for n in ["thompson", "double-thompson", "ensemble-uncertainty", "baits"] {
            let s: Strategy = n.parse().unwrap();
            assert!(s.needs_ensemble(), "{n}");
        }
        assert!(!Strategy::BestTwo.needs_ensemble() && !Strategy::Ucb { beta: 1.0 }.needs_ensemble());
    }
}
