//! The packed products (f32 and bf16) against candle's f32 matmul (the `gemm` crate) on the
//! shapes of a SmolLM2 forward pass: `cargo run --release -p features --example bf16_gemm [rows]
//! [reps]`. Prints GFLOP/s of each and the ratios to candle, measured in the same run, and — on a CPU with AVX-512
//! BF16 — the instruction's peak: `VDPBF16PS` on registers alone, one core, times the threads.

use candle_core::{Device, Tensor};
use kernels::bf16::{Bf16Matrix, Kernel};
use kernels::f32mm::F32Matrix;
use kernels::packed::PackedMatrix;
use std::time::Instant;

fn main() -> anyhow::Result<()> {
    // as onepass runs: freed buffers are reused rather than returned and faulted in again (each
    // product's output would otherwise pay a page fault and a zeroing per 4 KiB)
    kernels::mem::keep_freed_memory();
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse()).collect::<Result<_, _>>()?;
    let m = args.first().copied().unwrap_or(2048);
    let reps = args.get(1).copied().unwrap_or(5);
    let threads = rayon::current_num_threads();
    println!("cpu: {}", features::cpu::summary());
    println!(
        "bf16 kernel {:?}, f32 kernel {:?}, {threads} threads, {m} rows",
        Kernel::detect(),
        kernels::f32mm::Kernel::detect()
    );
    if let Some(per_core) = fma_peak() {
        println!(
            "AVX2 FMA peak (f32): {per_core:.1} GFLOP/s per core, {:.1} for {threads} threads",
            per_core * threads as f64
        );
    }
    if let Some(per_core) = dpbf16_peak() {
        println!(
            "VDPBF16PS peak: {per_core:.1} GFLOP/s per core, {:.1} for {threads} threads",
            per_core * threads as f64
        );
    }
    println!(
        "{:>14} {:>12} {:>12} {:>7} {:>12} {:>7}",
        "n × k", "candle f32", "packed f32", "ratio", "packed bf16", "ratio"
    );
    for (n, k) in [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)] {
        let x: Vec<f32> = (0..m * k).map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0).collect();
        let w: Vec<f32> = (0..n * k).map(|i| ((i * 104729 % 1000) as f32 / 5000.0) - 0.1).collect();
        let xt = Tensor::from_vec(x.clone(), (m, k), &Device::Cpu)?;
        let wt = Tensor::from_vec(w.clone(), (n, k), &Device::Cpu)?;
        let mat = Bf16Matrix::from_f32(&w, n, k);
        let mat32 = F32Matrix::from_f32(&w, n, k);
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
        let p32_s = time(&|| {
            std::hint::black_box(mat32.matmul_t(&x, m));
        });
        let bf_s = time(&|| {
            std::hint::black_box(mat.matmul_t(&x, m));
        });
        // the backward's g W: g (m × n) times W (n × k), W unpacked for candle and Wᵀ packed
        let g: Vec<f32> = (0..m * n).map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0).collect();
        let gt = Tensor::from_vec(g.clone(), (m, n), &Device::Cpu)?;
        let wt_t: Vec<f32> = wt.t()?.contiguous()?.flatten_all()?.to_vec1()?;
        let matb = F32Matrix::from_f32(&wt_t, k, n);
        let bf32_s = time(&|| {
            std::hint::black_box(gt.matmul(&wt).unwrap());
        });
        let bp32_s = time(&|| {
            std::hint::black_box(matb.matmul_t(&g, m));
        });
        println!(
            "{:>14} {:>12.1} {:>12.1} {:>6.2}x {:>12.1} {:>6.2}x   bwd g W: {:>7.1} {:>7.1} {:>6.2}x",
            format!("{n} × {k}"),
            flop / f32_s / 1e9,
            flop / p32_s / 1e9,
            f32_s / p32_s,
            flop / bf_s / 1e9,
            f32_s / bf_s,
            flop / bf32_s / 1e9,
            flop / bp32_s / 1e9,
            bf32_s / bp32_s
        );
    }
    Ok(())
}

/// GFLOP/s of `VDPBF16PS` on one core with 24 independent accumulators and no memory traffic
/// (each instruction: 16 lanes × 2 products × 2 flops); None without AVX-512 BF16.
fn dpbf16_peak() -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx512f") && has!("avx512bf16") {
            let iters = 20_000_000;
            let t = Instant::now();
            // SAFETY: the CPU has the features (checked just above).
            std::hint::black_box(unsafe { dpbf16_loop(iters) });
            return Some((24 * iters * 64) as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
    }
    None
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn dpbf16_loop(iters: usize) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_setzero_ps(); 24];
    let a = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(0x3f80_3f80));
    let b = std::mem::transmute::<__m512i, __m512bh>(std::hint::black_box(_mm512_set1_epi32(0x0001_0001)));
    for _ in 0..iters {
        for v in acc.iter_mut() {
            *v = _mm512_dpbf16_ps(*v, a, b);
        }
    }
    acc.iter().fold(0.0, |s, v| s + _mm512_reduce_add_ps(*v))
}

/// GFLOP/s of 256-bit f32 FMAs on one core with 12 independent accumulators and no memory
/// traffic (each instruction: 8 lanes × 2 flops): the f32 kernels' ceiling on an AVX2 CPU.
fn fma_peak() -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx2") && has!("fma") {
            let iters = 50_000_000;
            let t = Instant::now();
            // SAFETY: the CPU has the features (checked just above).
            std::hint::black_box(unsafe { fma_loop(iters) });
            return Some((12 * iters * 16) as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
    }
    None
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_loop(iters: usize) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_ps(); 12];
    let a = _mm256_set1_ps(1.0);
    let b = std::hint::black_box(_mm256_set1_ps(1e-7));
    for _ in 0..iters {
        for v in acc.iter_mut() {
            *v = _mm256_fmadd_ps(a, b, *v);
        }
    }
    let mut out = [0f32; 8];
    let s = acc.iter().fold(_mm256_setzero_ps(), |s, v| _mm256_add_ps(s, *v));
    _mm256_storeu_ps(out.as_mut_ptr(), s);
    out.iter().sum()
}
