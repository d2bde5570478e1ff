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
pub(crate) fn pack_rows(x: crate::packed::Rows, m: usize, k: usize) -> Aligned {
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
        Aligned::overwritten(len, |xs| {
            if m * k >= 1 << 16 {
                xs.par_chunks_mut(pairs.max(1)).enumerate().for_each_init(Vec::new, |row, (i, d)| fill(row, i, d));
            } else {
                let mut row = Vec::new();
                xs.chunks_mut(pairs.max(1)).enumerate().for_each(|(i, d)| fill(&mut row, i, d));
            }
        })
    }
}

/// Words in a buffer that starts at a 64-byte boundary (the packed weights and activations of
/// the bf16 product), so that each 64-byte row of an AMX tile is one cache line: on this
/// project's AMX Xeon a tile load whose rows straddle two lines took 6.6 times as long (16 ns
/// against 2.4 ns, from L1), so long that the loads rather than `TDPBF16PS` bounded the product
/// (a `Vec<u32>` starts at whatever boundary the allocator gives, often 16 bytes).
pub(crate) struct Aligned {
    lines: Vec<Line>,
    len: usize,
}

/// One cache line of words.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u32; 16]);

impl Aligned {
    /// `len` zeros.
    pub(crate) fn zeroed(len: usize) -> Aligned {
        Aligned { lines: vec![Line([0; 16]); len.div_ceil(16)], len }
    }

    /// `len` words that `fill` writes in full, never zeroed first (as [`crate::buf::overwritten`]).
    ///
    /// # Safety
    /// `fill` writes each of the `len` words and reads none before writing it.
    pub(crate) unsafe fn overwritten(len: usize, fill: impl FnOnce(&mut [std::mem::MaybeUninit<u32>])) -> Aligned {
        let n = len.div_ceil(16);
        let mut lines: Vec<std::mem::MaybeUninit<Line>> = Vec::with_capacity(n);
        // SAFETY: MaybeUninit needs no initialisation; the words past `len` in the last line are
        // zeroed here (nothing else writes them), the others by `fill` (the caller's promise).
        unsafe {
            lines.set_len(n);
            let words = std::slice::from_raw_parts_mut(lines.as_mut_ptr() as *mut std::mem::MaybeUninit<u32>, n * 16);
            words[len..].iter_mut().for_each(|w| _ = w.write(0));
            fill(&mut words[..len]);
            let mut lines = std::mem::ManuallyDrop::new(lines);
            Aligned { lines: Vec::from_raw_parts(lines.as_mut_ptr() as *mut Line, n, lines.capacity()), len }
        }
    }
}

impl std::ops::Deref for Aligned {
    type Target = [u32];
    fn deref(&self) -> &[u32] {
        // SAFETY: the lines hold at least `len` initialised words; Line is 16 u32s.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr() as *const u32, self.len) }
    }
}

impl std::ops::DerefMut for Aligned {
    fn deref_mut(&mut self) -> &mut [u32] {
        // SAFETY: as in deref, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr() as *mut u32, self.len) }
    }
}

/// Outputs per column group of [`block`] (the bf16 product's groups: three panels of 16).
const GROUP: usize = 48;

/// The tile configuration (palette 1): tmm0–3 accumulators (16 rows × 16 f32: row tile i ∈
/// {0, 1} against panel j ∈ {0, 1} in tmm(2i + j)), tmm4–5 the two row tiles' activations
/// (16 rows × 16 pairs), tmm6–7 the two panels' weights (16 pairs × 16 outputs); every tile is
/// 16 rows of 64 bytes.
#[repr(C, align(64))]
struct Config([u8; 64]);

impl Config {
    fn new() -> Config {
        let mut c = [0u8; 64];
        c[0] = 1;
        for t in 0..8 {
            c[16 + 2 * t] = 64; // bytes per row (u16, little-endian)
            c[48 + t] = ROWS as u8;
        }
        Config(c)
    }
}

/// Rows `rows` (starting at a multiple of [`ROWS`]; rows past its end are computed, from the
/// padding, and not stored) × `groups` (of 48 outputs, the last clipped to n) of y = x Wᵀ (row
/// stride n): x packed by [`pack_rows`] (`pairs` words per row), W's panels in `w` (`pairs` × 16
/// words each, pairs a multiple of [`PAIRS`]).
///
/// The region's 16-output panels and 16-row tiles are taken two by two (the standard 2 × 2
/// register blocking of AMX): four accumulator tiles, and per 16-pair step two activation tiles
/// and two weight tiles, each loaded once and used twice — 4 loads per 4 `TDPBF16PS` (an odd
/// last panel or row tile runs as 2 × 1 or 1 × 2); a pair of panels stays in L2 while every
/// pair of row tiles runs over it. Each 16 × 16 block of y is one accumulator that runs over
/// every input pair in order, then is stored (through a scratch tile where the block is clipped
/// by m or n): which blocks are computed together changes no bit.
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
    if rows.is_empty() || groups.is_empty() {
        return;
    }
    let cfg = Config::new();
    let panels = groups.start * GROUP / PAIRS..(groups.end * GROUP).min(n).div_ceil(PAIRS);
    let tiles = rows.start / ROWS..rows.end.div_ceil(ROWS);
    // SAFETY: the caller checked `available`; tiles are this thread's state until the release
    // below. Every load reads 16 rows of 64 bytes inside xs (padded rows) or w (whole panels of
    // `pairs` pair-rows); every store writes inside y's region or the scratch tile.
    unsafe {
        asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly));
        let mut scratch = Scratch([0f32; ROWS * PAIRS]);
        let mut pair = |t: usize, j: usize| {
            let (two_rows, two_panels) = (t + 1 < tiles.end, j + 1 < panels.end);
            let a = xs.as_ptr().add(t * ROWS * pairs);
            let b = w.as_ptr().add(j * pairs * PAIRS);
            match (two_rows, two_panels) {
                (true, true) => steps::<true, true>(a, b, pairs),
                (true, false) => steps::<true, false>(a, b, pairs),
                (false, true) => steps::<false, true>(a, b, pairs),
                (false, false) => steps::<false, false>(a, b, pairs),
            }
            for (i, jj) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
                if (i == 1 && !two_rows) || (jj == 1 && !two_panels) {
                    continue;
                }
                let (r, col) = ((t + i) * ROWS, (j + jj) * PAIRS);
                store(2 * i + jj, y, n, r, col, (rows.end - r).min(ROWS), (n - col).min(PAIRS), &mut scratch);
            }
        };
        for j in panels.clone().step_by(2) {
            for t in tiles.clone().step_by(2) {
                pair(t, j);
            }
        }
        asm!("tilerelease", options(nostack, nomem));
    }
}

/// Stores accumulator tmm`acc` (0–3) as y's block at (row `r`, column `col`): straight into y
/// when all 16 × 16 values are inside (`valid_rows`, `lanes`), else through `scratch`.
///
/// # Safety
/// The tile configuration is loaded; the block's valid part lies in y's m × n values.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn store(
    acc: usize,
    y: *mut f32,
    n: usize,
    r: usize,
    col: usize,
    valid_rows: usize,
    lanes: usize,
    scratch: &mut Scratch,
) {
    let direct = valid_rows == ROWS && lanes == PAIRS;
    // SAFETY: see the contract; a direct store writes 16 rows of 16 values inside y.
    unsafe {
        if direct {
            tile_store(acc, y.add(r * n + col), n * 4);
        } else {
            tile_store(acc, scratch.0.as_mut_ptr(), PAIRS * 4);
            for i in 0..valid_rows {
                std::ptr::copy_nonoverlapping(scratch.0.as_ptr().add(i * PAIRS), y.add((r + i) * n + col), lanes);
            }
        }
    }
}

/// Zeroes accumulator tmm`acc` (0–3).
///
/// # Safety
/// The tile configuration is loaded.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn tile_zero(acc: usize) {
    use std::arch::asm;
    // SAFETY: see the contract.
    unsafe {
        match acc {
            0 => asm!("tilezero tmm0", options(nostack, nomem)),
            1 => asm!("tilezero tmm1", options(nostack, nomem)),
            2 => asm!("tilezero tmm2", options(nostack, nomem)),
            _ => asm!("tilezero tmm3", options(nostack, nomem)),
        }
    }
}

/// Stores accumulator tmm`acc` (0–3) as 16 rows of 16 f32 at `dst`, `stride` bytes apart.
///
/// # Safety
/// The tile configuration is loaded; the rows are writable.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn tile_store(acc: usize, dst: *mut f32, stride: usize) {
    use std::arch::asm;
    // SAFETY: see the contract.
    unsafe {
        match acc {
            0 => asm!("tilestored [{p} + {s}*1], tmm0", p = in(reg) dst, s = in(reg) stride, options(nostack)),
            1 => asm!("tilestored [{p} + {s}*1], tmm1", p = in(reg) dst, s = in(reg) stride, options(nostack)),
            2 => asm!("tilestored [{p} + {s}*1], tmm2", p = in(reg) dst, s = in(reg) stride, options(nostack)),
            _ => asm!("tilestored [{p} + {s}*1], tmm3", p = in(reg) dst, s = in(reg) stride, options(nostack)),
        }
    }
}

/// Zeroes the accumulators and runs them over every input pair, in 16-pair steps in order: the
/// activations of row tile `a` (and the next, `TWO_ROWS`) against W's panel `b` (and the next,
/// `TWO_PANELS`), into tmm0–3 as [`Config`] lays them out.
///
/// # Safety
/// The tile configuration is loaded; `a` points at 16 (32 with `TWO_ROWS`) rows of `pairs`
/// words, `b` at 1 (2) panels of `pairs` × 16 words.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn steps<const TWO_ROWS: bool, const TWO_PANELS: bool>(a: *const u32, b: *const u32, pairs: usize) {
    use std::arch::asm;
    let (sa, sb) = (pairs * 4, PAIRS * 4);
    let (a1, b1) = (ROWS * pairs, pairs * PAIRS);
    // SAFETY: see the contract; every load is 16 rows of 64 bytes inside the named rows or panels.
    unsafe {
        for acc in 0..4 {
            tile_zero(acc);
        }
        for p in (0..pairs).step_by(PAIRS) {
            let (a0, b0) = (a.add(p), b.add(p * PAIRS));
            match (TWO_ROWS, TWO_PANELS) {
                (true, true) => asm!(
                    "tileloadd tmm4, [{a0} + {sa}*1]",
                    "tileloadd tmm6, [{b0} + {sb}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tileloadd tmm7, [{b1} + {sb}*1]",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tileloadd tmm5, [{a1} + {sa}*1]",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    a0 = in(reg) a0, a1 = in(reg) a0.add(a1), b0 = in(reg) b0, b1 = in(reg) b0.add(b1),
                    sa = in(reg) sa, sb = in(reg) sb, options(nostack, readonly)
                ),
                (true, false) => asm!(
                    "tileloadd tmm6, [{b0} + {sb}*1]",
                    "tileloadd tmm4, [{a0} + {sa}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tileloadd tmm5, [{a1} + {sa}*1]",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    a0 = in(reg) a0, a1 = in(reg) a0.add(a1), b0 = in(reg) b0,
                    sa = in(reg) sa, sb = in(reg) sb, options(nostack, readonly)
                ),
                (false, true) => asm!(
                    "tileloadd tmm4, [{a0} + {sa}*1]",
                    "tileloadd tmm6, [{b0} + {sb}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tileloadd tmm7, [{b1} + {sb}*1]",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    a0 = in(reg) a0, b0 = in(reg) b0, b1 = in(reg) b0.add(b1),
                    sa = in(reg) sa, sb = in(reg) sb, options(nostack, readonly)
                ),
                (false, false) => asm!(
                    "tileloadd tmm4, [{a0} + {sa}*1]",
                    "tileloadd tmm6, [{b0} + {sb}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    a0 = in(reg) a0, b0 = in(reg) b0,
                    sa = in(reg) sa, sb = in(reg) sb, options(nostack, readonly)
                ),
            }
        }
    }
}

/// A tile's worth of f32, 64-byte aligned for the stores.
#[repr(C, align(64))]
struct Scratch([f32; ROWS * PAIRS]);

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// The previous kernel, kept as the reference of the bits: per 16-row tile, three
    /// accumulators (one per panel of a 48-output group) over every input pair in order.
    unsafe fn block_1x3(
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
    /// `rows` × `pairs` words of two random bf16 values each (|v| < 4), then zero rows up to a
    /// multiple of 16 (pack_rows's padding).
    fn words(rows: usize, pairs: usize, seed: u64) -> Vec<u32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let v = ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * 4.0;
            crate::round::to_bf16(v) as u32
        };
        let mut x: Vec<u32> = (0..rows * pairs).map(|_| next() | (next() << 16)).collect();
        x.resize(rows.div_ceil(ROWS) * ROWS * pairs, 0);
        x
    }

    /// W's panels for n outputs: random words, lanes past n zero (as Bf16Matrix packs them).
    fn panels(n: usize, pairs: usize, seed: u64) -> Vec<u32> {
        let mut w = words(n.div_ceil(PAIRS) * pairs * PAIRS, 1, seed);
        for (i, v) in w.iter_mut().enumerate() {
            if (i / (pairs * PAIRS)) * PAIRS + i % PAIRS >= n {
                *v = 0;
            }
        }
        w
    }

    type Block = unsafe fn(&[u32], &[u32], usize, usize, std::ops::Range<usize>, std::ops::Range<usize>, *mut f32);

    /// y (m × n) by `f` on tasks of `mc` rows × `gs` groups, as the product's driver splits it;
    /// NaN wherever nothing was stored.
    fn run(f: Block, xs: &[u32], w: &[u32], (m, n, pairs): (usize, usize, usize), mc: usize, gs: usize) -> Vec<f32> {
        let mut y = vec![f32::NAN; m * n];
        let groups = n.div_ceil(GROUP);
        for r in (0..m).step_by(mc) {
            for g in (0..groups).step_by(gs) {
                // SAFETY: the test runs only where `available`; the tasks are disjoint regions of y.
                unsafe { f(xs, w, pairs, n, r..(r + mc).min(m), g..(g + gs).min(groups), y.as_mut_ptr()) };
            }
        }
        y
    }

    fn bits(y: &[f32]) -> Vec<u32> {
        y.iter().map(|v| v.to_bits()).collect()
    }

    /// The 2 × 2 blocked kernel gives the previous kernel's bits, on shapes that are not
    /// multiples of the tiles (m, n, the groups of 48) and however the region is split into
    /// tasks; negative control: changing one input word changes that row's outputs (and only
    /// that row's), so the comparison sees the inputs.
    #[test]
    fn two_by_two_blocks_give_the_bits_of_the_one_by_three_kernel() {
        if !available() {
            eprintln!("no AMX on this CPU: nothing to check");
            return;
        }
        let mut seed = 1;
        for k in [32, 64, 576] {
            let pairs = k / 2;
            for m in [1, 15, 17, 33, 130] {
                for n in [16, 40, 48, 50, 96, 100] {
                    seed += 1;
                    let (xs, w) = (words(m, pairs, seed), panels(n, pairs, seed + 1000));
                    let shape = (m, n, pairs);
                    let want = bits(&run(block_1x3, &xs, &w, shape, 128, 1));
                    assert!(want.iter().all(|&b| !f32::from_bits(b).is_nan()), "m {m} n {n} k {k}");
                    for (mc, gs) in [(128, 1), (128, 4), (m.next_multiple_of(16), 8), (16, 1), (32, 2), (48, 3)] {
                        let got = bits(&run(block, &xs, &w, shape, mc, gs));
                        assert!(got == want, "m {m} n {n} k {k}, tasks of {mc} rows × {gs} groups");
                    }
                }
            }
        }
        let (m, n, pairs) = (33, 100, 288);
        let (xs, w) = (words(m, pairs, 7), panels(n, pairs, 8));
        let y = run(block, &xs, &w, (m, n, pairs), 128, 4);
        let mut changed = xs.clone();
        changed[20 * pairs + 100] ^= 0x0040_0040;
        let z = run(block, &changed, &w, (m, n, pairs), 128, 4);
        for i in 0..m {
            let same = bits(&y[i * n..(i + 1) * n]) == bits(&z[i * n..(i + 1) * n]);
            assert_eq!(same, i != 20, "row {i}");
        }
    }
}
