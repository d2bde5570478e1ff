//! Intel AMX (Advanced Matrix Extensions) for the bf16 product ([`crate::bf16`]): `TDPBF16PS`
//! multiplies a tile of 16 rows × 16 bf16 pairs by a tile of 16 pairs × 16 outputs and adds the
//! 16 × 16 f32 results into an accumulator tile — 8,192 multiply-adds per instruction, where
//! AVX-512 BF16's `VDPBF16PS` does 32. Sapphire Rapids and later Xeons have it; on such a CPU the
//! bf16 product runs here, on the same packed weights (a panel of 16 outputs holds, for each
//! input pair, 16 words of (even, odd) bf16: exactly the layout of AMX's second operand) and on
//! activations packed row-major ([`pack_rows`]).
//!
//! **Not the bits of the other kernels.** The instruction does not add the products one at a
//! time in f32: on random data its outputs equal the exactly rounded dot product far more often
//! than either sequential order does (the test measures both), so a product on an AMX machine
//! differs in the last bits from the same product on a machine with `VDPBF16PS` alone. Within
//! AMX machines the bits do not depend on the thread count or on the other rows of the batch
//! (each output is one accumulator over the inputs in order, in whole 16-pair steps; tested),
//! and φ computed with it is cached under its own key. `ONEPASS_BF16_KERNEL=avx512bf16` keeps
//! `VDPBF16PS` on an AMX machine (the bits of every other CPU; how a benchmark times both).
//!
//! Linux gives a process AMX's 8 KiB of tile state only on request (`arch_prctl(ARCH_REQ_XCOMP_PERM,
//! XFEATURE_XTILEDATA)`, kernel 5.16 and later); [`available`] asks once and says no where the
//! CPU, the kernel or a hypervisor refuses.

/// Input pairs (and output lanes) per tile: a tile row is 64 bytes.
pub(crate) const PAIRS: usize = 16;
/// Rows per tile.
pub(crate) const ROWS: usize = 16;

/// Whether this process may run AMX's bf16 instructions: the CPU reports AMX-TILE and AMX-BF16
/// (CPUID leaf 7) and the kernel granted the tile state. Decided once.
pub fn available() -> bool {
    static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OK.get_or_init(probe)
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn probe() -> bool {
    let leaf7 = std::arch::x86_64::__cpuid_count(7, 0);
    let (amx_bf16, amx_tile) = (leaf7.edx & (1 << 22) != 0, leaf7.edx & (1 << 24) != 0);
    if !(amx_bf16 && amx_tile) {
        return false;
    }
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a plain system call with integer arguments; it only changes this process's
    // permitted extended state.
    unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn probe() -> bool {
    false
}

/// x (m, k) rounded to bf16 as words of two (the even input low), row-major — row r's pair p
/// at r·pairs + p — with the rows padded by zeros to a multiple of [`ROWS`]: AMX's first operand
/// is 16 consecutive pairs of 16 rows, read with the row stride.
pub(crate) fn pack_rows(x: crate::packed::Rows, m: usize, k: usize) -> Vec<u32> {
    use rayon::prelude::*;
    let pairs = k.div_ceil(2);
    let len = m.div_ceil(ROWS) * ROWS * pairs;
    let fill = |row: &mut Vec<f32>, i: usize, dst: &mut [std::mem::MaybeUninit<u32>]| {
        // zeros first (the padding rows stay so), so that the words are initialised before they
        // are seen as u32
        dst.iter_mut().for_each(|d| _ = d.write(0));
        if i < m {
            // SAFETY: MaybeUninit<u32> and u32 have the same layout, and every word was written.
            let w = unsafe { &mut *(dst as *mut [std::mem::MaybeUninit<u32>] as *mut [u32]) };
            crate::round::round_row(x, i, k, row, w);
        }
    };
    // SAFETY (of `overwritten`): the rows cover xs and `fill` writes each in full.
    unsafe {
        crate::buf::overwritten(len, |xs| {
            if m * k >= 1 << 16 {
                xs.par_chunks_mut(pairs.max(1)).enumerate().for_each_init(Vec::new, |row, (i, d)| fill(row, i, d));
            } else {
                let mut row = Vec::new();
                xs.chunks_mut(pairs.max(1)).enumerate().for_each(|(i, d)| fill(&mut row, i, d));
            }
        })
    }
}

/// The tile configuration (palette 1): tmm0–2 accumulators (16 rows × 16 f32), tmm3 the
/// activations (16 rows × 16 pairs), tmm4–6 the weights (16 pairs × 16 outputs); every tile is
/// 16 rows of 64 bytes.
#[repr(C, align(64))]
struct Config([u8; 64]);

impl Config {
    fn new() -> Config {
        let mut c = [0u8; 64];
        c[0] = 1;
        for t in 0..7 {
            c[16 + 2 * t] = 64; // bytes per row (u16, little-endian)
            c[48 + t] = ROWS as u8;
        }
        Config(c)
    }
}

/// Rows `rows` (starting at a multiple of [`ROWS`]; rows past its end are computed, from the
/// padding, and not stored) × `groups` (of 48 outputs, the last clipped
/// to n) of y = x Wᵀ (row stride n): x packed by [`pack_rows`] (`pairs` words per row), W's
/// panels in `w` (`pairs` × 16 words each, pairs a multiple of [`PAIRS`]). Each 16 × 48 block of
/// y is three accumulator tiles that run over every input pair in order, then are stored (through
/// a scratch tile where the block is clipped by m or n).
///
/// # Safety
/// [`available`] is true; `xs` holds the padded rows, `w` the panels of n outputs, `y` the
/// product's m × n values, of which this region is written by this call only.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn block(
    xs: &[u32],
    w: &[u32],
    pairs: usize,
    n: usize,
    rows: std::ops::Range<usize>,
    groups: std::ops::Range<usize>,
    y: *mut f32,
) {
    use std::arch::asm;
    debug_assert!(pairs.is_multiple_of(PAIRS) && rows.start.is_multiple_of(ROWS));
    let cfg = Config::new();
    // SAFETY: the caller checked `available`; tiles are this thread's state until the release
    // below. Every load reads 16 rows of 64 bytes inside xs (padded rows) or w (whole panels of
    // `pairs` pair-rows); every store writes inside y's region or the scratch tile.
    unsafe {
        asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly));
        let (sa, sb, sy) = (pairs * 4, PAIRS * 4, n * 4);
        let mut scratch = Scratch([0f32; ROWS * PAIRS]);
        for g in groups {
            let c0 = g * 48;
            let panels = (n - c0).min(48).div_ceil(PAIRS);
            for r in rows.clone().step_by(ROWS) {
                asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", options(nostack, nomem));
                for p in (0..pairs).step_by(PAIRS) {
                    let a = xs.as_ptr().add(r * pairs + p);
                    asm!("tileloadd tmm3, [{a} + {s}*1]", a = in(reg) a, s = in(reg) sa, options(nostack, readonly));
                    let b = |j: usize| w.as_ptr().add(((c0 / PAIRS + j) * pairs + p) * PAIRS);
                    asm!(
                        "tileloadd tmm4, [{b} + {s}*1]", "tdpbf16ps tmm0, tmm3, tmm4",
                        b = in(reg) b(0), s = in(reg) sb, options(nostack, readonly)
                    );
                    if panels > 1 {
                        asm!(
                            "tileloadd tmm5, [{b} + {s}*1]", "tdpbf16ps tmm1, tmm3, tmm5",
                            b = in(reg) b(1), s = in(reg) sb, options(nostack, readonly)
                        );
                    }
                    if panels > 2 {
                        asm!(
                            "tileloadd tmm6, [{b} + {s}*1]", "tdpbf16ps tmm2, tmm3, tmm6",
                            b = in(reg) b(2), s = in(reg) sb, options(nostack, readonly)
                        );
                    }
                }
                let valid_rows = (rows.end - r).min(ROWS);
                for j in 0..panels {
                    let col = c0 + j * PAIRS;
                    let lanes = (n - col).min(PAIRS);
                    let direct = valid_rows == ROWS && lanes == PAIRS;
                    let (dst, stride) =
                        if direct { (y.add(r * n + col), sy) } else { (scratch.0.as_mut_ptr(), PAIRS * 4) };
                    match j {
                        0 => {
                            asm!("tilestored [{d} + {s}*1], tmm0", d = in(reg) dst, s = in(reg) stride, options(nostack))
                        }
                        1 => {
                            asm!("tilestored [{d} + {s}*1], tmm1", d = in(reg) dst, s = in(reg) stride, options(nostack))
                        }
                        _ => {
                            asm!("tilestored [{d} + {s}*1], tmm2", d = in(reg) dst, s = in(reg) stride, options(nostack))
                        }
                    }
                    if !direct {
                        for i in 0..valid_rows {
                            std::ptr::copy_nonoverlapping(
                                scratch.0.as_ptr().add(i * PAIRS),
                                y.add((r + i) * n + col),
                                lanes,
                            );
                        }
                    }
                }
            }
        }
        asm!("tilerelease", options(nostack, nomem));
    }
}

/// A tile's worth of f32, 64-byte aligned for the stores.
#[repr(C, align(64))]
struct Scratch([f32; ROWS * PAIRS]);
