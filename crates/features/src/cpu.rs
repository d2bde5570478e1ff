//! What the CPU has, for a log or a benchmark: [`kernels::cpu`]'s model and features, the kernels
//! onepass's products pick, and the widest kernel of candle's f32 matmul (the `gemm` crate), which
//! dispatches on the CPU's features itself, so no variable caps it: a build without the default
//! feature `gemm-avx512` (`just build-avx2`) leaves its AVX-512 kernels out, and then every f32
//! product stops at AVX2 + FMA.

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
    let cap = if kernels::cpu::capped_at_avx2() { " (onepass capped at AVX2: ONEPASS_CPU=avx2)" } else { "" };
    let f32k = if crate::model::f32_uses_candle() {
        "candle".to_string()
    } else {
        format!("{:?}", kernels::f32mm::Kernel::detect())
    };
    format!(
        "{}; {}; bf16 kernel {:?}; f32 kernel {f32k}; candle gemm {}{cap}",
        kernels::cpu::model(),
        kernels::cpu::features().join(" "),
        kernels::bf16::Kernel::detect(),
        gemm_kernel()
    )
}
