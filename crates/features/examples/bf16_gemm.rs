//! The bf16 product against candle's f32 matmul (the `gemm` crate) on the shapes of a SmolLM2
//! forward pass: `cargo run --release -p features --example bf16_gemm [rows] [reps]`.
//! Prints GFLOP/s of each and the ratio, measured in the same run.

use candle_core::{Device, Tensor};
use features::bf16::{Bf16Matrix, Kernel};
use std::time::Instant;

fn main() -> anyhow::Result<()> {
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse()).collect::<Result<_, _>>()?;
    let m = args.first().copied().unwrap_or(2048);
    let reps = args.get(1).copied().unwrap_or(5);
    println!("kernel {:?}, {} threads, {m} rows", Kernel::detect(), rayon::current_num_threads());
    println!("{:>14} {:>12} {:>12} {:>7}", "n × k", "f32 GFLOP/s", "bf16 GFLOP/s", "ratio");
    for (n, k) in [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)] {
        let x: Vec<f32> = (0..m * k).map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0).collect();
        let w: Vec<f32> = (0..n * k).map(|i| ((i * 104729 % 1000) as f32 / 5000.0) - 0.1).collect();
        let xt = Tensor::from_vec(x.clone(), (m, k), &Device::Cpu)?;
        let wt = Tensor::from_vec(w.clone(), (n, k), &Device::Cpu)?;
        let mat = Bf16Matrix::from_f32(&w, n, k);
        let flop = 2.0 * (m * n * k) as f64;
        let time = |f: &dyn Fn()| {
            f();
            let mut best = f64::MAX;
            for _ in 0..reps {
                let t = Instant::now();
                f();
                best = best.min(t.elapsed().as_secs_f64());
            }
            best
        };
        let f32_s = time(&|| {
            std::hint::black_box(xt.matmul(&wt.t().unwrap()).unwrap());
        });
        let bf_s = time(&|| {
            std::hint::black_box(mat.matmul_t(&x, m));
        });
        println!(
            "{:>14} {:>12.1} {:>12.1} {:>6.2}x",
            format!("{n} × {k}"),
            flop / f32_s / 1e9,
            flop / bf_s / 1e9,
            f32_s / bf_s
        );
    }
    Ok(())
}
