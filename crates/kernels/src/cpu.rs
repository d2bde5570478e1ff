//! The CPU a run measures on: its model and the vector features onepass's kernels use, and the
//! `ONEPASS_CPU=avx2` override that caps onepass's own kernels at AVX2 + FMA, so that an AVX-512
//! machine can measure the path an AVX2-only CPU takes. (candle's f32 matmul, which `features`
//! may hand f32 products to, is capped otherwise: `features::cpu`.) The PyTorch peer is capped by
//! its own variables (`scripts/bench_env.sh`: ATen, MKL and oneDNN).

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
