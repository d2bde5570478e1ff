//! `cargo bench -p estimators` (or `just bench`): per-step cost of the estimators through the
//! public API at d = 4096, B = 8, single-threaded, with a STREAM-like copy bandwidth measured
//! in the same run so the O(d²) omd-exact can be judged against the memory it must stream.
//!
//! Environment knobs (all optional):
//!   ONEPASS_BENCH_DIM       feature dimension (default 4096)
//!   ONEPASS_BENCH_RSS_T     comma-separated sample counts for the peak-RSS table (default 1000,20000)
//!   ONEPASS_BENCH_MLE_T     comma-separated history sizes for the mle refit table (default 1000,5000,20000)
//!   ONEPASS_BENCH_SKIP_RSS  set to skip the peak-RSS table
//! Peak RSS is read from /proc/self/status (VmHWM) of a child process per (estimator, t).

use estimators::{build, Batch, Estimator, EstimatorConfig, Init, Kind, Mle, MleConfig, Setup};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::StandardNormal;
use std::hint::black_box;
use std::time::{Duration, Instant};

const B: usize = 8;

fn env_list(name: &str, default: &[usize]) -> Vec<usize> {
    match std::env::var(name) {
        Ok(v) => {
            v.split(',').map(|s| s.trim().parse().unwrap_or_else(|_| panic!("{name}: `{s}` is not a count"))).collect()
        }
        Err(_) => default.to_vec(),
    }
}

fn dim() -> usize {
    std::env::var("ONEPASS_BENCH_DIM").ok().map_or(4096, |v| v.parse().expect("ONEPASS_BENCH_DIM: expected an integer"))
}

/// `n` rows of z with ‖z‖ ≈ 4 and Bernoulli(½) labels.
fn data(n: usize, d: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let s = 4.0 / (d as f64).sqrt();
    let z = (0..n * d).map(|_| (rng.sample::<f64, _>(StandardNormal) * s) as f32).collect();
    let y = (0..n).map(|_| if rng.random::<bool>() { 1.0 } else { 0.0 }).collect();
    (z, y)
}

fn setup(d: usize, planned: u64) -> Setup {
    Setup { dim: d, init: Init::Zero, seed: 0, planned_steps: Some(planned) }
}

/// Median of `reps` timings of `steps` updates, per update (µs), cycling over the batches of
/// `pool` (one batch: it stays in L2, as the 20 µs target assumes; 256 batches, 32 MiB at
/// d = 4096: every step reads a batch that is not in cache, as a long run does).
fn time_updates(est: &mut dyn Estimator, pool: &(Vec<f32>, Vec<f32>), d: usize, steps: usize, reps: usize) -> f64 {
    let nb = pool.1.len() / B;
    let batch = |i: usize| {
        Batch::new(&pool.0[(i % nb) * B * d..(i % nb + 1) * B * d], &pool.1[(i % nb) * B..(i % nb + 1) * B], d).unwrap()
    };
    for i in 0..steps.min(50) {
        black_box(est.update(&batch(i)).unwrap());
    }
    let mut samples = Vec::new();
    for r in 0..reps {
        let t0 = Instant::now();
        for i in 0..steps {
            black_box(est.update(&batch(r * steps + i)).unwrap());
        }
        samples.push(t0.elapsed().as_secs_f64() * 1e6 / steps as f64);
    }
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

/// Best-of-5 copy bandwidth (bytes read + written per second) on a 256 MiB f64 array.
fn copy_bandwidth() -> f64 {
    let n = 32 << 20;
    let src: Vec<f64> = (0..n).map(|i| i as f64).collect();
    let mut dst = vec![0.0f64; n];
    let mut best = Duration::MAX;
    for _ in 0..5 {
        let t0 = Instant::now();
        dst.copy_from_slice(black_box(&src));
        black_box(&mut dst);
        best = best.min(t0.elapsed());
    }
    (2 * n * 8) as f64 / best.as_secs_f64()
}

fn vm_hwm_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn rss_config(kind: Kind) -> EstimatorConfig {
    match kind {
        // the synthetic presets' setting: a re-fit every 200 steps
        Kind::Mle => EstimatorConfig::Mle(MleConfig { refit_every: 200, ..Default::default() }),
        k => EstimatorConfig::default_for(k),
    }
}

/// Child mode: run `t` samples of `kind` and print the peak RSS in KiB.
fn rss_child(spec: &str) {
    let (kind, t) = spec.split_once(':').expect("kind:t");
    let kind: Kind = kind.parse().unwrap();
    let t: usize = t.parse().unwrap();
    let d = dim();
    let steps = t / B;
    let mut est = build(&rss_config(kind), &setup(d, steps as u64)).unwrap();
    // fresh data for every step (the stream a run would read), generated in chunks of 1k rows
    let chunk = 1000 / B * B;
    let mut done = 0;
    while done < t {
        let n = chunk.min(t - done);
        let (z, y) = data(n, d, done as u64);
        for i in 0..n / B {
            est.update(&Batch::new(&z[i * B * d..(i + 1) * B * d], &y[i * B..(i + 1) * B], d).unwrap()).unwrap();
        }
        done += n;
    }
    println!("{}", vm_hwm_kib());
}

fn main() {
    if let Ok(spec) = std::env::var("ONEPASS_BENCH_RSS_CHILD") {
        return rss_child(&spec);
    }
    if std::env::args().any(|a| a == "--list") {
        return; // `cargo bench -- --list` probes benches; nothing to list here
    }
    let d = dim();
    println!("onepass estimators bench: d = {d}, B = {B}, single thread");
    let bw = copy_bandwidth();
    println!("copy bandwidth (read + write, 256 MiB f64, best of 5): {:.2} GB/s", bw / 1e9);

    let pool = data(B, d, 1);
    let cold = data(256 * B, d, 2);
    println!("\n| estimator | µs / step, batch in cache | µs / sample | µs / step, fresh batch from memory | note |\n|---|---|---|---|---|");
    let mut per_step = std::collections::BTreeMap::new();
    for kind in [Kind::OmdHvpCg, Kind::OmdReference, Kind::Sgd, Kind::Adam, Kind::OmdHvpCgAdam] {
        let mut e = build(&EstimatorConfig::default_for(kind), &setup(d, 1_000_000)).unwrap();
        let us = time_updates(e.as_mut(), &pool, d, 2000, 7);
        let mut e = build(&EstimatorConfig::default_for(kind), &setup(d, 1_000_000)).unwrap();
        let us_cold = time_updates(e.as_mut(), &cold, d, 2000, 7);
        per_step.insert(kind, us);
        let note = match kind {
            Kind::OmdHvpCg => format!("target ≤ 20 µs in cache: {}", if us <= 20.0 { "met" } else { "MISSED" }),
            Kind::OmdReference => "past its CG phase (G = 100), i.e. plain SGD; CG phase below".into(),
            _ => String::new(),
        };
        println!("| {kind} | {us:.2} | {:.2} | {us_cold:.2} | {note} |", us / B as f64);
    }
    {
        // omd-reference during its CG phase (its first 99 steps)
        let mut e = build(&EstimatorConfig::default_for(Kind::OmdReference), &setup(d, 1_000_000)).unwrap();
        let nb = pool.1.len() / B;
        let t0 = Instant::now();
        for i in 0..99 {
            black_box(
                e.update(
                    &Batch::new(
                        &pool.0[(i % nb) * B * d..(i % nb + 1) * B * d],
                        &pool.1[(i % nb) * B..(i % nb + 1) * B],
                        d,
                    )
                    .unwrap(),
                )
                .unwrap(),
            );
        }
        println!("| omd-reference (CG phase, steps 1–99) | {:.2} | | | |", t0.elapsed().as_secs_f64() * 1e6 / 99.0);
    }
    let mut exact = build(&EstimatorConfig::default_for(Kind::OmdExact), &setup(d, 1)).unwrap();
    let steps = if d >= 2048 { 6 } else { 200 };
    let us = time_updates(exact.as_mut(), &pool, d, steps, 5);
    let packed = (d * (d + 1) / 2 * 8) as f64;
    let stream_us = 2.0 * packed / bw * 1e6;
    let ratio = us / B as f64 / stream_us;
    println!(
        "| omd-exact | {us:.0} | {:.0} | | packed 𝓗⁻¹ {:.0} MiB; streaming it (read + write) at the copy bandwidth takes {stream_us:.0} µs; ratio {ratio:.2} (target ≤ 1.5: {}) |",
        us / B as f64,
        packed / (1 << 20) as f64,
        if ratio <= 1.5 { "met" } else { "MISSED" }
    );
    let sgd = per_step[&Kind::Sgd];
    println!(
        "\nratios to sgd per step: omd-hvp-cg {:.2}x, adam {:.2}x, omd-exact {:.0}x",
        per_step[&Kind::OmdHvpCg] / sgd,
        per_step[&Kind::Adam] / sgd,
        us / sgd
    );

    println!("\n| mle history t | refit ms (warm, L-BFGS) | iterations | µs / sample, refit_every = 1 | µs / sample, refit_every = 200 |\n|---|---|---|---|---|");
    for t in env_list("ONEPASS_BENCH_MLE_T", &[1000, 5000, 20000]) {
        let mut m = Mle::new(MleConfig { refit_every: u64::MAX, ..Default::default() }, vec![0.0; d]);
        let (z, y) = data(t, d, 7);
        for i in 0..t / B - 1 {
            m.update(&Batch::new(&z[i * B * d..(i + 1) * B * d], &y[i * B..(i + 1) * B], d).unwrap()).unwrap();
        }
        m.refit_now(); // cold fit at t − B, untimed: the warm start a refit_every = 1 run has
        let i = t / B - 1;
        m.update(&Batch::new(&z[i * B * d..(i + 1) * B * d], &y[i * B..(i + 1) * B], d).unwrap()).unwrap();
        let t0 = Instant::now();
        let (iters, converged) = m.refit_now();
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        println!(
            "| {t} | {ms:.1} | {iters}{} | {:.0} | {:.1} |",
            if converged { "" } else { " (not converged)" },
            ms * 1e3 / B as f64,
            ms * 1e3 / (200 * B) as f64
        );
    }

    if std::env::var("ONEPASS_BENCH_SKIP_RSS").is_ok() {
        return;
    }
    let ts = env_list("ONEPASS_BENCH_RSS_T", &[1000, 20000]);
    println!("\npeak RSS (MiB) of a process that streams t samples through one estimator (mle: refit_every = 200)");
    print!("| estimator |");
    for t in &ts {
        print!(" t = {t} |");
    }
    println!("\n|---|{}", "---|".repeat(ts.len()));
    let exe = std::env::current_exe().unwrap();
    for kind in Kind::ALL {
        print!("| {kind} |");
        for &t in &ts {
            let out = std::process::Command::new(&exe)
                .env("ONEPASS_BENCH_RSS_CHILD", format!("{kind}:{t}"))
                .output()
                .unwrap();
            let kib: f64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap_or(f64::NAN);
            print!(" {:.1} |", kib / 1024.0);
        }
        println!();
    }
}
