//! A noisy labeller (`[oracle] flip = p`): the flip rate over 10,000 labels lies in its exact
//! binomial 99.9 % interval, each label's flip depends on its index alone; end to end on the tiny
//! Llama GGUF, flip = 0 writes the bytes of a run without the key, flip = 0.4 flips exactly the
//! labels metrics.parquet's `flipped_labels` counts while every reward and the regret keep the
//! noiseless preference (negative control), a killed run resumes to the same bytes, and
//! flip ≥ 0.5 is refused in one line naming the key.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use runner::spec::LabelRule;
use runner::world::env::{Bank, Context, Env, Flip, LabelCount};

mod util;
use util::{command, f64s, onepass, strs, table, u64s};

/// The exact two-sided 1 − α interval of Binomial(n, p): the largest lo with P(X < lo) ≤ α/2 and
/// the smallest hi with P(X > hi) ≤ α/2, from the pmf summed in f64 (log-space start).
fn binomial_interval(n: u64, p: f64, alpha: f64) -> (u64, u64) {
    let ln_fact: Vec<f64> = std::iter::once(0.0)
        .chain((1..=n).scan(0.0, |s, i| {
            *s += (i as f64).ln();
            Some(*s)
        }))
        .collect();
    let lf = |k: u64| ln_fact[k as usize];
    let pmf: Vec<f64> = (0..=n)
        .map(|k| (lf(n) - lf(k) - lf(n - k) + k as f64 * p.ln() + (n - k) as f64 * (1.0 - p).ln()).exp())
        .collect();
    let (mut lo, mut below) = (0, 0.0);
    while below + pmf[lo as usize] <= alpha / 2.0 {
        below += pmf[lo as usize];
        lo += 1;
    }
    let (mut hi, mut above) = (n, 0.0);
    while above + pmf[hi as usize] <= alpha / 2.0 {
        above += pmf[hi as usize];
        hi -= 1;
    }
    (lo, hi)
}

#[test]
fn the_flip_rate_over_10000_labels_is_within_its_binomial_interval() {
    let n = 10_000u64;
    for (p, seed) in [(0.05, 1u64), (0.2, 7), (0.4, 11)] {
        let f = Flip { p, seed };
        let k = (0..n).filter(|&i| f.flips(i)).count() as u64;
        let (lo, hi) = binomial_interval(n, p, 0.001);
        assert!((lo..=hi).contains(&k), "p = {p}: {k} flips of {n}, outside [{lo}, {hi}]");
        // each label's draw is its own: read backwards, the same labels flip
        let back: Vec<u64> = (0..n).rev().filter(|&i| f.flips(i)).collect();
        assert_eq!(back.len() as u64, k, "p = {p}: the flips depend on the order they are asked in");
    }
    // the interval itself can fail: a rate of 0.25 read as 0.2 is far outside it
    let f = Flip { p: 0.25, seed: 7 };
    let k = (0..n).filter(|&i| f.flips(i)).count() as u64;
    let (lo, hi) = binomial_interval(n, 0.2, 0.001);
    assert!(!(lo..=hi).contains(&k), "p = 0.25 passed as 0.2: {k} in [{lo}, {hi}]");
    // another seed flips other labels
    let (a, b) = (Flip { p: 0.2, seed: 1 }, Flip { p: 0.2, seed: 2 });
    assert!((0..200).any(|i| a.flips(i) != b.flips(i)));
}

/// An environment of `prompts` contexts with two samples each, rewards (1, 0): an argmax
/// labeller prefers the first every time, so each label of 0 is a flip.
fn bank(prompts: usize, flip: f64) -> Bank {
    let contexts = (0..prompts).map(|_| Context { phi: vec![1.0, 0.0], reward: Some(vec![1.0, 0.0]) }).collect();
    Bank {
        d: 1,
        k: 2,
        contexts: Arc::new(contexts),
        theta_star: Vec::new(),
        labels: LabelRule::Argmax,
        flip,
        flip_seed: 5,
    }
}

#[test]
fn a_noisy_labeller_flips_given_labels_only_and_counts_them() {
    let n = 10_000u64;
    let env = Env::from_bank(&bank(4, 0.3), 200, 9, 0);
    // held-out labels keep the noiseless preference
    assert!(env.eval_y.iter().zip(&env.eval_at).all(|(&y, &(_, a, b))| y == if a == 0 && b == 1 { 1.0 } else { 0.0 }));
    let c = &env.contexts[0];
    let mut count = LabelCount::default();
    let zeros = (0..n).filter(|_| env.give(c, 0, 1, &[1.0], 0.5, &mut count) == 0.0).count() as u64;
    assert_eq!(count, LabelCount { given: n, flipped: zeros }, "every label counted, every 0 a flip");
    let (lo, hi) = binomial_interval(n, 0.3, 0.001);
    assert!((lo..=hi).contains(&zeros), "{zeros} flips of {n}, outside [{lo}, {hi}]");
    assert_eq!(env.flipped(&count), Some(zeros));
    // the label's index names its draw: a count restored mid-way gives the rest alike
    let mut resumed = LabelCount { given: 5_000, flipped: 0 };
    let tail = (5_000..n).filter(|_| env.give(c, 0, 1, &[1.0], 0.5, &mut resumed) == 0.0).count() as u64;
    let f = env.flip.unwrap();
    assert_eq!(tail, (5_000..n).filter(|&i| f.flips(i)).count() as u64);
    // another cell seed, another stream
    let other = Env::from_bank(&bank(4, 0.3), 0, 9, 1);
    assert_ne!(other.flip.unwrap().seed, f.seed);
    // p = 0: no labeller noise, no count
    let clean = Env::from_bank(&bank(4, 0.0), 0, 9, 0);
    let mut count = LabelCount::default();
    assert!((0..1000).all(|_| clean.give(c, 0, 1, &[1.0], 0.5, &mut count) == 1.0));
    assert_eq!((clean.flip, clean.flipped(&count)), (None, None));
}

fn spec(oracle: &str) -> String {
    format!(
        r#"
setting = "deploy"
seeds = 2
[env]
kind = "generated"
eval_pairs = 20
[generate]
prompts = "prompts.jsonl"
rows = 9
policy = "{g}"
n = 3
max_new_tokens = 5
batch_prompts = 3
cache = "cache/gen"
[features]
model = "{g}"
max_len = 64
cache = "cache/phi"
[oracle]
kind = "linear"
seed = 3
{oracle}
[stream]
batch_size = 2
[checkpoint]
every_steps = 1
[deploy]
chunks = 3
strategies = ["random-pair"]
[[estimator]]
kind = "sgd"
lr = 0.1
"#,
        g = util::tiny_gguf().display()
    )
}

/// run.toml with `oracle`'s extra keys, run into `out/` (the spec's name, taken from its file's,
/// is the same for every run).
fn run(p: &Path, oracle: &str, out: &str) -> PathBuf {
    std::fs::write(p.join("run.toml"), spec(oracle)).unwrap();
    let (code, stdout, err) = onepass(p, &["run", "run.toml", "--out", out, "--threads", "2"]).parts();
    assert_eq!(code, 0, "{err}");
    p.join(stdout.lines().last().unwrap().trim())
}

const SAME: [&str; 4] = ["metrics.parquet", "rounds.parquet", "cells.parquet", "spec.resolved.toml"];

#[test]
fn flip_zero_keeps_the_bytes_and_flipped_labels_leave_rewards_and_regret_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path();
    util::write_prompts(p);
    let plain = run(p, "", "plain");
    let zero = run(p, "flip = 0.0", "zero");
    for f in SAME {
        assert!(std::fs::read(plain.join(f)).unwrap() == std::fs::read(zero.join(f)).unwrap(), "flip = 0: {f} differs");
    }
    let m = table(&plain.join("metrics.parquet"));
    assert!(m.column_by_name("flipped_labels").is_none(), "flip = 0 writes no flipped_labels column");

    let noisy = run(p, "flip = 0.4", "noisy");
    let (a, b) = (table(&plain.join("rounds.parquet")), table(&noisy.join("rounds.parquet")));
    // random pairs do not depend on θ: the same prompts, pairs and oracle rewards
    for c in ["reward_first", "reward_second", "best_reward"] {
        assert_eq!(f64s(&a, c), f64s(&b, c), "{c}: the oracle's rewards moved with the labeller's noise");
    }
    let (la, lb, cell) = (f64s(&a, "label"), f64s(&b, "label"), strs(&b, "cell_id"));
    let differ = |id: &str| (0..la.len()).filter(|&i| cell[i] == id && la[i] != lb[i]).count() as u64;
    let (ma, mb) = (table(&plain.join("metrics.parquet")), table(&noisy.join("metrics.parquet")));
    // the regret is the noiseless preference's: equal to the noiseless run's
    assert_eq!(f64s(&ma, "regret"), f64s(&mb, "regret"), "regret moved with the labels' noise");
    let (mcell, flipped, chunk) = (strs(&mb, "cell_id"), u64s(&mb, "flipped_labels"), u64s(&mb, "chunk"));
    let mut total = 0;
    for i in 0..mcell.len() {
        if chunk[i] == 3 {
            assert_eq!(flipped[i], differ(&mcell[i]), "{}: flipped_labels is not the labels that differ", mcell[i]);
            total += flipped[i];
        }
    }
    assert!(total > 0 && total < la.len() as u64, "{total} of {} labels flipped at p = 0.4", la.len());
    // the flips changed what θ learned: not the same estimator as the noiseless run's
    assert_ne!(f64s(&ma, "eval_loss"), f64s(&mb, "eval_loss"), "the labels' noise did not reach the estimator");

    // killed after the 4th estimator update (mid-way through the first cell), then resumed
    use std::os::unix::process::ExitStatusExt;
    std::fs::write(p.join("run.toml"), spec("flip = 0.4")).unwrap();
    let o = command()
        .current_dir(p)
        .args(["run", "run.toml", "--out", "killed", "--threads", "1"])
        .env("ONEPASS_FAILPOINT", "update:4")
        .output()
        .unwrap();
    assert_eq!(o.status.signal(), Some(9), "{}", String::from_utf8_lossy(&o.stderr));
    let dir = std::fs::read_dir(p.join("killed")).unwrap().next().unwrap().unwrap().path();
    let (code, _, err) = onepass(p, &["run", "run.toml", "--resume", dir.to_str().unwrap()]).parts();
    assert_eq!(code, 0, "{err}");
    for f in SAME {
        assert!(std::fs::read(noisy.join(f)).unwrap() == std::fs::read(dir.join(f)).unwrap(), "resumed: {f} differs");
    }
}

#[test]
fn a_flip_of_one_half_or_more_is_refused_naming_the_key() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path();
    util::write_prompts(p);
    for bad in ["0.5", "-0.1", "1.0", "nan"] {
        std::fs::write(p.join("bad.toml"), spec(&format!("flip = {bad}"))).unwrap();
        let (code, _, err) = onepass(p, &["run", "bad.toml", "--out", "x"]).parts();
        assert_eq!(code, 2, "flip = {bad}: {err}");
        assert!(err.contains("oracle.flip") && err.trim().lines().count() == 1, "flip = {bad}: {err}");
    }
}

/// Active collection on the generated responses with a noisy labeller: the pool's labels (drawn
/// once) and the fresh rule's are flipped and counted; three slices of the run merge to the bytes
/// of one process (each label's flip is named by its cell's seeds and index, not by the process).
#[test]
fn active_labels_flip_too_and_slices_merge_to_the_bytes_of_one_process() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path();
    util::write_prompts(p);
    let text = spec("flip = 0.3")
        .replace("setting = \"deploy\"", "setting = \"active\"")
        .replace("[checkpoint]\nevery_steps = 1\n", "")
        .replace(
            "[deploy]\nchunks = 3\nstrategies = [\"random-pair\"]\n",
            "[active]\nrule = [\"random\", \"best-worst\"]\npool = 30\n",
        )
        .replace("batch_size = 2\n", "batch_size = 2\nsamples = 20\neval_every = 10\n");
    std::fs::write(p.join("run.toml"), text).unwrap();
    let (code, stdout, err) = onepass(p, &["run", "run.toml", "--out", "one", "--threads", "2"]).parts();
    assert_eq!(code, 0, "{err}");
    let one = p.join(stdout.trim().lines().last().unwrap());
    let m = table(&one.join("metrics.parquet"));
    let (flipped, samples) = (u64s(&m, "flipped_labels"), u64s(&m, "samples_seen"));
    // random buys from the pool, whose labels were drawn (and flipped) once, from a stream of the
    // pool's own, and are counted as they are bought; best-worst labels each fresh pair: in both,
    // at most one flip a label given, and the count only grows
    let (rule, cell) = (strs(&m, "strategy"), strs(&m, "cell_id"));
    for r in ["random", "best-worst"] {
        let last: u64 = (0..flipped.len()).filter(|&i| rule[i] == r && samples[i] == 20).map(|i| flipped[i]).sum();
        assert!(last > 0, "{r}: no label flipped of 40 at p = 0.3: {flipped:?}");
    }
    for i in 0..flipped.len() {
        assert!(flipped[i] <= samples[i], "{}: {} flips of {} labels", cell[i], flipped[i], samples[i]);
        assert!(i == 0 || cell[i] != cell[i - 1] || flipped[i] >= flipped[i - 1], "{}: the count fell", cell[i]);
    }
    let parts: Vec<String> = (0..3)
        .map(|i| {
            let cells = format!("{i}/3");
            let (code, stdout, err) =
                onepass(p, &["run", "run.toml", "--out", "s", "--threads", "1", "--cells", &cells]).parts();
            assert_eq!(code, 0, "slice {i}: {err}");
            p.join(stdout.trim().lines().last().unwrap()).display().to_string()
        })
        .collect();
    let mut args = vec!["merge", "run.toml"];
    args.extend(parts.iter().map(String::as_str));
    args.extend(["--out", "m"]);
    let (code, stdout, err) = onepass(p, &args).parts();
    assert_eq!(code, 0, "{err}");
    let merged = p.join(stdout.trim().lines().last().unwrap());
    for f in ["metrics.parquet", "cells.parquet"] {
        assert!(std::fs::read(one.join(f)).unwrap() == std::fs::read(merged.join(f)).unwrap(), "merged: {f} differs");
    }
}
