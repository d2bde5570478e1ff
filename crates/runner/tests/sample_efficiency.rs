//! The report's sample-efficiency figure (`report/sample-efficiency.{png,svg,csv}`): held-out
//! reward accuracy against oracle queries in active and deployment runs, and in a deployment the
//! win rate of the deployed response against the base policy's, with 95% t-interval bands over
//! seeds. The figure's points (its CSV) are checked against a hand aggregation of the run's own
//! tables; one seed draws no band and says so.

mod util;

use std::collections::BTreeMap;
use std::path::Path;
use util::{onepass, table, write};

/// Student's t quantile t(0.975, df) for the seeds these tests use (printed tables).
fn t975(df: usize) -> f64 {
    match df {
        1 => 12.706_204_736_174_7,
        2 => 4.302_652_729_749_464,
        _ => panic!("df {df}"),
    }
}

/// (mean, half-width of the 95% t-interval) by hand; None for one value.
fn mean_t(v: &[f64]) -> (f64, Option<f64>) {
    let n = v.len() as f64;
    let m = v.iter().sum::<f64>() / n;
    if v.len() < 2 {
        return (m, None);
    }
    let sd = (v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (n - 1.0)).sqrt();
    (m, Some(t975(v.len() - 1) * sd / n.sqrt()))
}

/// One point of sample-efficiency.csv.
#[derive(Debug)]
struct Point {
    seeds: usize,
    mean: f64,
    lo: Option<f64>,
    hi: Option<f64>,
}

/// sample-efficiency.csv as (panel, config, queries) → point.
fn read_csv(path: &Path) -> BTreeMap<(String, String, u64), Point> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("panel,config,queries,seeds,mean,ci95_lo,ci95_hi"));
    let opt = |s: &str| (!s.is_empty()).then(|| s.parse::<f64>().unwrap());
    lines
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            assert_eq!(f.len(), 7, "{l}");
            let p = Point { seeds: f[3].parse().unwrap(), mean: f[4].parse().unwrap(), lo: opt(f[5]), hi: opt(f[6]) };
            ((f[0].to_string(), f[1].to_string(), f[2].parse().unwrap()), p)
        })
        .collect()
}

/// metrics.parquet's held-out accuracy grouped by (config, samples_seen) over seeds.
fn accuracy_by_hand(run: &Path) -> BTreeMap<(String, u64), Vec<f64>> {
    let m = table(&run.join("metrics.parquet"));
    let (labels, seen, acc) =
        (util::strs(&m, "label"), util::u64s(&m, "samples_seen"), util::f64s(&m, "eval_accuracy"));
    let mut out: BTreeMap<(String, u64), Vec<f64>> = BTreeMap::new();
    for i in 0..labels.len() {
        out.entry((labels[i].clone(), seen[i])).or_default().push(acc[i]);
    }
    out
}

/// Every hand-aggregated group is a point of `panel` with the same seeds, mean and interval,
/// and the panel has no other points.
fn check_panel(csv: &BTreeMap<(String, String, u64), Point>, panel: &str, hand: &BTreeMap<(String, u64), Vec<f64>>) {
    assert_eq!(csv.keys().filter(|k| k.0 == panel).count(), hand.len(), "{panel}: {csv:?}");
    for ((config, x), v) in hand {
        let p = csv.get(&(panel.to_string(), config.clone(), *x)).unwrap_or_else(|| panic!("{panel} {config} {x}"));
        let (m, hw) = mean_t(v);
        assert_eq!(p.seeds, v.len(), "{config} {x}");
        assert!((p.mean - m).abs() < 1e-12, "{panel} {config} {x}: {} vs {m}", p.mean);
        match hw {
            Some(hw) => {
                assert!((p.lo.unwrap() - (m - hw)).abs() < 1e-6, "{config} {x}: lo {:?} vs {}", p.lo, m - hw);
                assert!((p.hi.unwrap() - (m + hw)).abs() < 1e-6, "{config} {x}: hi {:?} vs {}", p.hi, m + hw);
            }
            None => assert!(p.lo.is_none() && p.hi.is_none(), "one seed: no interval ({p:?})"),
        }
    }
}

/// A nullable u64 column.
fn opt_u64s(b: &arrow_array::RecordBatch, c: &str) -> Vec<Option<u64>> {
    use arrow_array::Array;
    let a = b.column_by_name(c).unwrap().as_any().downcast_ref::<arrow_array::UInt64Array>().unwrap();
    (0..a.len()).map(|i| a.is_valid(i).then(|| a.value(i))).collect()
}

fn has_font() -> bool {
    Path::new("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf").exists() || std::env::var_os("ONEPASS_FONT").is_some()
}

/// The figure files exist and the SVG's subtitle says which band it draws.
fn check_figure(run: &Path, band: &str) {
    if !has_font() {
        eprintln!("no font: the report writes tables only");
        return;
    }
    let rep = run.join("report");
    assert!(rep.join("sample-efficiency.png").metadata().unwrap().len() > 10_000);
    let svg = std::fs::read_to_string(rep.join("sample-efficiency.svg")).unwrap();
    assert!(svg.contains(band), "the subtitle names the band ({band})");
    assert!(svg.contains("oracle queries (labelled pairs so far)"), "the x axis is oracle queries");
    let md = std::fs::read_to_string(rep.join("report.md")).unwrap();
    assert!(md.contains("![sample-efficiency](sample-efficiency.png)"), "{md}");
}

/// An active run: the accuracy points are metrics.parquet's eval_accuracy per (config,
/// samples_seen), the mean over seeds with its 95% t-interval (df = seeds − 1); not the ±1 sd
/// band the other figures draw (a control that the comparison can tell them apart). One seed:
/// the same means, no interval, and the subtitle and report.md say so.
#[test]
fn an_active_report_draws_accuracy_against_oracle_queries() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = util::root().join("experiments/active/synthetic.toml");
    for seeds in [3u32, 1] {
        let r = onepass(
            tmp.path(),
            &[
                "run",
                spec.to_str().unwrap(),
                "--out",
                "out",
                "--set",
                &format!("seeds={seeds}"),
                "--set",
                "stream.samples=200",
                "--set",
                "stream.eval_every=50",
            ],
        );
        let dir = tmp.path().join(r.dir());
        let rep = onepass(tmp.path(), &["report", dir.to_str().unwrap()]);
        assert_eq!(rep.code, 0, "{}", rep.stderr);
        let csv = read_csv(&dir.join("report/sample-efficiency.csv"));
        let hand = accuracy_by_hand(&dir);
        // 4 evaluations (50 … 200 labels) of each of the preset's configs
        assert!(hand.len() >= 8 && hand.keys().any(|k| k.1 == 200), "{hand:?}");
        check_panel(&csv, "held-out reward accuracy", &hand);
        assert!(!csv.keys().any(|k| k.0.starts_with("win rate")), "an active run has no win rate");
        let md = std::fs::read_to_string(dir.join("report/report.md")).unwrap();
        if seeds == 1 {
            assert!(csv.values().all(|p| p.lo.is_none() && p.seeds == 1));
            assert!(md.contains("one seed: no band"), "{md}");
            check_figure(&dir, "1 seed: no band");
        } else {
            // a ±1 sd band is not what was drawn
            let ((config, x), v) = hand.iter().find(|(_, v)| v.iter().any(|a| *a != v[0])).expect("seeds differ");
            let p = &csv[&("held-out reward accuracy".to_string(), config.clone(), *x)];
            let m = v.iter().sum::<f64>() / 3.0;
            let sd = (v.iter().map(|a| (a - m).powi(2)).sum::<f64>() / 2.0).sqrt();
            assert!((p.hi.unwrap() - (m + sd)).abs() > 1e-6, "the band is the t-interval, not ±1 sd");
            assert!(md.contains("95% Student-t interval, df = seeds − 1"), "{md}");
            check_figure(&dir, "mean ± 95% t-interval over 3 seeds (bands, df = 2)");
        }
    }
}

/// A deployment on generated responses (the tiny GGUF): accuracy per chunk as above, and the
/// win rate per chunk — by hand: for each rounds.parquet row, the share of the prompt's base
/// samples (generations.parquet) whose oracle reward is below that of the deployed pick
/// (`policy_pick`), ties ½, averaged over the chunk's prompts — at the labels θ had when it
/// picked (metrics.parquet's samples_seen of the previous chunk; 0 for the first).
#[test]
fn a_deployment_report_draws_the_win_rate_against_the_base_policy() {
    let tmp = tempfile::tempdir().unwrap();
    util::write_prompts(tmp.path());
    let text = format!(
        "{}[deploy]\nchunks = 3\nstrategies = [\"random-pair\", \"best-two\"]\n[[estimator]]\nkind = \"omd-exact\"\n[[estimator]]\nkind = \"mle\"\n",
        util::tiny_world(2, 20)
    );
    let spec = write(tmp.path(), "deploy.toml", &text);
    let r = onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--out", "out"]);
    let dir = tmp.path().join(r.dir());
    let rep = onepass(tmp.path(), &["report", dir.to_str().unwrap()]);
    assert_eq!(rep.code, 0, "{}", rep.stderr);
    let csv = read_csv(&dir.join("report/sample-efficiency.csv"));
    check_panel(&csv, "held-out reward accuracy", &accuracy_by_hand(&dir));
    // the base's samples per prompt
    let g = table(&dir.join("generations.parquet"));
    let mut base: BTreeMap<u64, BTreeMap<u32, f64>> = BTreeMap::new();
    for ((p, s), r) in
        util::u64s(&g, "prompt").into_iter().zip(util::u32s(&g, "sample")).zip(util::f64s(&g, "oracle_reward"))
    {
        base.entry(p).or_default().insert(s, r);
    }
    // cell → label; (cell, chunk) → samples_seen after it
    let c = table(&dir.join("cells.parquet"));
    let label: BTreeMap<String, String> = util::strs(&c, "cell_id").into_iter().zip(util::strs(&c, "label")).collect();
    let m = table(&dir.join("metrics.parquet"));
    let chunks = opt_u64s(&m, "chunk");
    let mut after: BTreeMap<(String, u64), u64> = BTreeMap::new();
    for ((cell, ch), seen) in util::strs(&m, "cell_id").into_iter().zip(chunks).zip(util::u64s(&m, "samples_seen")) {
        after.insert((cell, ch.expect("a chunked deployment's metrics name their chunk")), seen);
    }
    let rd = table(&dir.join("rounds.parquet"));
    let (cells, seeds, ch, prompt, pick) = (
        util::strs(&rd, "cell_id"),
        util::u32s(&rd, "seed"),
        util::u64s(&rd, "chunk"),
        util::u64s(&rd, "prompt"),
        util::u32s(&rd, "policy_pick"),
    );
    // (cell, chunk) → per-prompt wins
    let mut wins: BTreeMap<(String, u64), Vec<f64>> = BTreeMap::new();
    for i in 0..cells.len() {
        let samples = &base[&prompt[i]];
        let mine = samples[&pick[i]];
        let w = samples
            .values()
            .map(|&r| {
                if r < mine {
                    1.0
                } else if r == mine {
                    0.5
                } else {
                    0.0
                }
            })
            .sum::<f64>()
            / samples.len() as f64;
        wins.entry((cells[i].clone(), ch[i])).or_default().push(w);
    }
    // metrics' chunks are 1-based: chunk 1 deploys θ_0, chunk c θ after chunk c − 1's labels
    assert_eq!(ch.iter().min(), Some(&1));
    let mut hand: BTreeMap<(String, u64), Vec<f64>> = BTreeMap::new();
    for ((cell, chunk), w) in &wins {
        let x = if *chunk == 1 { 0 } else { after[&(cell.clone(), chunk - 1)] };
        hand.entry((label[cell].clone(), x)).or_default().push(w.iter().sum::<f64>() / w.len() as f64);
    }
    assert_eq!(seeds.iter().collect::<std::collections::BTreeSet<_>>().len(), 2);
    assert_eq!(hand.keys().filter(|k| k.1 == 0).count(), 4, "2 estimators × 2 strategies at 0 labels: {hand:?}");
    check_panel(&csv, "win rate against the base policy", &hand);
    check_figure(&dir, "mean ± 95% t-interval over 2 seeds (bands, df = 1)");
    // a noisy labeller is named in the subtitle; a noiseless one is not
    if has_font() {
        let svg = |d: &Path| std::fs::read_to_string(d.join("report/sample-efficiency.svg")).unwrap();
        assert!(!svg(&dir).contains("flipped"));
        let r = onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--out", "flip", "--set", "oracle.flip=0.2"]);
        let noisy = tmp.path().join(r.dir());
        assert_eq!(onepass(tmp.path(), &["report", noisy.to_str().unwrap()]).code, 0);
        assert!(svg(&noisy).contains("oracle linear, labels flipped with p = 0.2"));
    }
    // the synthetic bandit deploys no generated responses: accuracy only, and the report says why
    let spec = util::root().join("experiments/deploy/synthetic.toml");
    let r = onepass(
        tmp.path(),
        &["run", spec.to_str().unwrap(), "--out", "syn", "--set", "seeds=2", "--set", "stream.samples=400"],
    );
    let dir = tmp.path().join(r.dir());
    assert_eq!(onepass(tmp.path(), &["report", dir.to_str().unwrap()]).code, 0);
    let csv = read_csv(&dir.join("report/sample-efficiency.csv"));
    assert!(!csv.is_empty() && csv.keys().all(|k| k.0 == "held-out reward accuracy"));
    let md = std::fs::read_to_string(dir.join("report/report.md")).unwrap();
    assert!(md.contains("no win rate: a deployment on the synthetic bandit"), "{md}");
}

/// A deployment with a learning policy (best-of-n and rloo on the tiny GGUF): the win rate per
/// evaluation — by hand from policy_samples.parquet: per held-out prompt, every deployed sample
/// against every chunk-0 sample of the same prompt, ties ½, averaged over the prompt's pairs
/// and then over prompts — at metrics.parquet's samples_seen after that chunk (0 for chunk 0).
#[test]
fn an_online_report_draws_the_win_rate_against_chunk_zero() {
    let tmp = tempfile::tempdir().unwrap();
    util::write_prompts(tmp.path());
    let spec = write(tmp.path(), "online.toml", &format!("{}{}", util::tiny_world(2, 50), util::TINY_RLOO));
    let r = onepass(tmp.path(), &["run", spec.to_str().unwrap(), "--out", "out"]);
    let dir = tmp.path().join(r.dir());
    let rep = onepass(tmp.path(), &["report", dir.to_str().unwrap()]);
    assert_eq!(rep.code, 0, "{}", rep.stderr);
    let csv = read_csv(&dir.join("report/sample-efficiency.csv"));
    let m = table(&dir.join("metrics.parquet"));
    let mut after: BTreeMap<(String, u32, u64), u64> = BTreeMap::new();
    for (((l, s), c), seen) in util::strs(&m, "label")
        .into_iter()
        .zip(util::u32s(&m, "seed"))
        .zip(opt_u64s(&m, "chunk"))
        .zip(util::u64s(&m, "samples_seen"))
    {
        after.insert((l, s, c.unwrap()), seen);
    }
    let t = table(&dir.join("policy_samples.parquet"));
    let (labels, seeds, chunks, prompts, rewards, deployed) = (
        util::strs(&t, "label"),
        util::u32s(&t, "seed"),
        util::u64s(&t, "chunk"),
        util::u64s(&t, "prompt"),
        util::f64s(&t, "oracle_reward"),
        util::bools(&t, "deployed"),
    );
    // (label, seed, chunk, prompt) → (deployed, all)
    type Rewards = (Vec<f64>, Vec<f64>);
    let mut at: BTreeMap<(String, u32, u64, u64), Rewards> = BTreeMap::new();
    for i in 0..labels.len() {
        let e = at.entry((labels[i].clone(), seeds[i], chunks[i], prompts[i])).or_default();
        if deployed[i] {
            e.0.push(rewards[i]);
        }
        e.1.push(rewards[i]);
    }
    let mut per: BTreeMap<(String, u32, u64), Vec<f64>> = BTreeMap::new();
    for ((l, s, c, p), (dep, _)) in &at {
        let base = &at[&(l.clone(), *s, 0, *p)].1;
        let mut w = Vec::new();
        for d in dep {
            for b in base {
                w.push(if d > b {
                    1.0
                } else if d == b {
                    0.5
                } else {
                    0.0
                });
            }
        }
        per.entry((l.clone(), *s, *c)).or_default().push(w.iter().sum::<f64>() / w.len() as f64);
    }
    let mut hand: BTreeMap<(String, u64), Vec<f64>> = BTreeMap::new();
    for ((l, s, c), w) in per {
        let x = if c == 0 { 0 } else { after[&(l.clone(), s, c)] };
        hand.entry((l, x)).or_default().push(w.iter().sum::<f64>() / w.len() as f64);
    }
    // 2 arms × 3 evaluations (chunk 0, 1, 2)
    assert_eq!(hand.len(), 6, "{hand:?}");
    // rloo deploys its samples: at chunk 0 it is the base, so it wins exactly half
    let rloo0 = hand.iter().find(|((l, x), _)| l.ends_with("rloo") && *x == 0).unwrap().1;
    assert!(rloo0.iter().all(|w| (w - 0.5).abs() < 1e-12), "{rloo0:?}");
    check_panel(&csv, "win rate against the base policy", &hand);
}
