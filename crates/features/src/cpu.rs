//! The CPU a run measures on: its model and the vector features onepass's kernels use, and the
//! `ONEPASS_CPU=avx2` override that caps onepass's own kernels at AVX2 + FMA, so that an AVX-512
//! machine can measure the path an AVX2-only CPU takes (issue 35). candle's f32 matmul (the `gemm`
//! crate) dispatches on the CPU's features itself, so no variable caps it; a build without the
//! default feature `gemm-avx512` (`just build-avx2`) leaves its AVX-512 kernels out, and then every
//! f32 product stops at AVX2 + FMA. The PyTorch peer is capped by its own variables
//! (`scripts/bench_env.sh`: ATen, MKL and oneDNN).

/// `ONEPASS_CPU=avx2` is set: onepass's kernels use nothing above AVX2 + FMA.
pub fn capped_at_avx2() -> bool {
    std::env::var("ONEPASS_CPU").is_ok_and(|v| v.eq_ignore_ascii_case("avx2"))
}

/// The CPU's model name (`/proc/cpuinfo`), or the architecture where that cannot be read.
pub fn model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

/// Whether the CPU is Intel's (cpuid's vendor string `GenuineIntel`): a cache-blocking choice
/// of the f32 products depends on it (`f32mm`), never a result.
pub fn is_intel() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // cpuid leaf 0 exists on every x86_64 CPU
        let r = std::arch::x86_64::__cpuid(0);
        let vendor: Vec<u8> = [r.ebx, r.edx, r.ecx].iter().flat_map(|v| v.to_le_bytes()).collect();
        vendor == b"GenuineIntel"
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The vector features the kernels choose between, as the CPU reports them (before the cap;
/// AMX where this process may use it).
pub fn features() -> Vec<&'static str> {
    let mut out = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        for (name, on) in [
            ("avx2", has!("avx2")),
            ("fma", has!("fma")),
            ("avx512f", has!("avx512f")),
            ("avx512bf16", has!("avx512bf16")),
        ] {
            if on {
                out.push(name);
            }
        }
        // AMX counts only where this process may use it (the kernel granted the tile state)
        if crate::amx::available() {
            out.push("amx-bf16");
        }
    }
    out
}

/// The widest kernel candle's f32 matmul (`gemm`) runs here: `Avx512` only where this build has
/// them (the `gemm-avx512` feature) and the CPU has AVX-512F — no environment variable caps it.
pub fn gemm_kernel() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if cfg!(feature = "gemm-avx512") && has!("avx512f") {
            return "Avx512";
        }
        if has!("avx2") && has!("fma") {
            return "Avx2";
        }
    }
    "Scalar"
}

/// One line for a benchmark or a log: model, features, and the cap when one is set, e.g.
/// `Intel(R) Xeon(R) Processor; avx2 fma avx512f avx512bf16; bf16 kernel Avx512Bf16; f32 kernel
/// Avx512; candle gemm Avx512` (`f32 kernel candle` when `ONEPASS_F32_KERNEL=candle` hands f32
/// products to candle; `candle gemm Avx2` in a `just build-avx2` binary).
pub fn summary() -> String {
    let cap = if capped_at_avx2() { " (onepass capped at AVX2: ONEPASS_CPU=avx2)" } else { "" };
    let f32k = if crate::model::f32_uses_candle() {
        "candle".to_string()
    } else {
        format!("{:?}", crate::f32mm::Kernel::detect())
    };
    format!(
        "{}; {}; bf16 kernel {:?}; f32 kernel {f32k}; candle gemm {}{cap}",
        model(),
        features().join(" "),
        crate::bf16::Kernel::detect(),
        gemm_kernel()
    )
}

/// Whether bf16 products run slower than f32's here: the AVX2 + FMA kernel (an AVX2-only CPU, or
/// capped) and the portable one widen every weight in software below f32's speed (before the AVX2
/// kernel, 11x on an AVX2-only EPYC: 40 against 439 tok/s). An AVX-512F CPU without bf16
/// instructions (Skylake-SP, Cascade Lake, Ice Lake) widens in 512-bit registers at f32's speed
/// (on a Cascade Lake: φ 1.0–1.2x of f32, generation 1.16x, half the weight memory), so it is not.
pub fn bf16_is_slow() -> bool {
    matches!(crate::bf16::Kernel::detect(), crate::bf16::Kernel::Avx2 | crate::bf16::Kernel::Portable)
}
