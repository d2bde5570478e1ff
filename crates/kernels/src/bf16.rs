//! The bf16 matrix product of the CPU path: y = x Wᵀ with W stored in bf16, x rounded to bf16 at
//! the product's input and the products summed in f32 — the arithmetic of x86's `VDPBF16PS`
//! (AVX-512 BF16), which this CPU family runs at twice the rate of f32 FMAs and which halves the
//! weight bytes streamed per token.
//!
//! candle 0.11 has no bf16 CPU gemm (it widens both sides to f32, multiplies and narrows back), so
//! this module is the whole product: weights packed once at load ([`Bf16Matrix`]), activations
//! packed per call, a register-blocked kernel over (rows × 48 outputs) tiles on rayon's pool.
//!
//! **One result on every CPU without AMX.** Each output element is one accumulator that starts at 0 and, for
//! the input pairs (x₂ₚ, x₂ₚ₊₁) in ascending p, adds x₂ₚ₊₁·w₂ₚ₊₁ and then x₂ₚ·w₂ₚ, each sum
//! rounded to nearest even. That is `VDPBF16PS`'s documented order (and what a test measured on
//! Zen 4); a product of two bf16 values is exact in f32, so the portable kernel, written as a
//! multiply then an add in that order, gives the same bits. Blocking over the inner dimension
//! reloads the partial sums and continues the same sequence, so neither the tiling nor the thread
//! count changes a bit. The instruction flushes subnormal inputs to zero: [`to_bf16`] does so for
//! both sides, so no subnormal ever reaches it. (A partial sum below 1.2·10⁻³⁸ would be flushed by
//! the instruction and kept by the portable kernel; activations and weights of a language model
//! never get there.) An AMX machine runs its own instruction ([`crate::amx`]), which rounds
//! differently; `ONEPASS_BF16_KERNEL=avx512bf16` keeps this sequence there.

use crate::amx::Aligned;
use crate::packed::Rows;
use crate::round::round_row;
pub use crate::round::{from_bf16, to_bf16};
use rayon::prelude::*;

/// Output columns per packed panel: one 512-bit register of f32.
const LANES: usize = 16;
/// Panels per register tile (48 outputs): 8 rows × 3 panels = 24 accumulators, plus the three
/// weight registers and the broadcast, of the 32 vector registers.
const NB: usize = 3;
/// Rows per register tile.
const MR: usize = 8;
/// Input pairs per cache block: a 48-output panel of 128 pairs is 24 KiB, inside L1.
const KC: usize = 128;
// A task's rows start at a multiple of MR (pack_rows's tiles).
const _: () = assert!(MC.is_multiple_of(MR));
// The AVX2 interleave of pack_rows transposes 8 × 8 words.
const _: () = assert!(MR == 8);

/// Rows per task: the activations of a task's block (128 × 128 pairs = 64 KiB) stay in L2.
const MC: usize = 128;

/// A weight matrix W (n outputs × k inputs, PyTorch's `Linear` layout) in bf16, packed for the
/// kernel: panels of 16 outputs; within a panel, for each input pair p, 16 words holding
/// (w[o, 2p] in the low half, w[o, 2p+1] in the high half). Missing outputs and an odd k's last
/// input are zeros.
pub struct Bf16Matrix {
    n: usize,
    k: usize,
    pairs: usize,
    data: Aligned,
}

impl Bf16Matrix {
    /// Packs W given as bf16 bits, row-major (n, k).
    pub fn from_bits(w: &[u16], n: usize, k: usize) -> Bf16Matrix {
        assert_eq!(w.len(), n * k, "a {n} × {k} matrix needs {} values", n * k);
        Bf16Matrix::pack(n, k, |o, i| w[o * k + i])
    }

    /// Packs W given in f32, row-major (n, k), rounding each weight with [`to_bf16`].
    pub fn from_f32(w: &[f32], n: usize, k: usize) -> Bf16Matrix {
        assert_eq!(w.len(), n * k, "a {n} × {k} matrix needs {} values", n * k);
        Bf16Matrix::pack(n, k, |o, i| to_bf16(w[o * k + i]))
    }

    /// The packed layout from `at(output, input)` (bf16 bits). Large matrices (weights, once at
    /// load) are packed on the pool, small ones on the calling thread.
    fn pack(n: usize, k: usize, at: impl Fn(usize, usize) -> u16 + Sync) -> Bf16Matrix {
        let pairs = k.div_ceil(2);
        let panels = n.div_ceil(LANES);
        let mut data = Aligned::zeroed(panels * pairs * LANES);
        let fill = |panel: usize, dst: &mut [u32]| {
            let lanes = LANES.min(n - panel * LANES);
            for (p, words) in dst.chunks_exact_mut(LANES).enumerate() {
                let (i, odd) = (2 * p, 2 * p + 1 < k);
                for (lane, word) in words.iter_mut().enumerate().take(lanes) {
                    let o = panel * LANES + lane;
                    let hi = if odd { at(o, i + 1) as u32 } else { 0 };
                    *word = at(o, i) as u32 | (hi << 16);
                }
            }
        };
        if n * k >= 1 << 18 {
            data.par_chunks_mut(pairs * LANES).enumerate().for_each(|(panel, dst)| fill(panel, dst));
        } else {
            data.chunks_mut((pairs * LANES).max(1)).enumerate().for_each(|(panel, dst)| fill(panel, dst));
        }
        Bf16Matrix { n, k, pairs, data }
    }

    /// Outputs (rows of W).
    pub fn n(&self) -> usize {
        self.n
    }
    /// Inputs (columns of W).
    pub fn k(&self) -> usize {
        self.k
    }

    /// W as f32 values, row-major (n, k): what the products use (a test's reference).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut w = vec![0f32; self.n * self.k];
        for o in 0..self.n {
            let (panel, lane) = (o / LANES, o % LANES);
            for i in 0..self.k {
                let word = self.data[(panel * self.pairs + i / 2) * LANES + lane];
                w[o * self.k + i] = from_bf16(if i % 2 == 0 { word as u16 } else { (word >> 16) as u16 });
            }
        }
        w
    }
}

impl Bf16Matrix {
    /// Whether this matrix's products run on AMX: the CPU's kernel is AMX and the inputs fill
    /// whole 16-pair steps (k a multiple of 32, as every model's hidden sizes are). Decided per
    /// matrix, never per call, so a row's product does not depend on the batch it is in; it also
    /// says how [`Blocked::pack_input`](crate::packed::Blocked::pack_input) laid the input out.
    fn on_amx(&self) -> bool {
        Kernel::detect() == Kernel::Amx && self.pairs.is_multiple_of(crate::amx::PAIRS)
    }
}

impl crate::packed::Blocked for Bf16Matrix {
    type Input = Aligned;
    const GROUP: usize = LANES * NB;
    const MC: usize = MC;
    fn n(&self) -> usize {
        self.n
    }
    fn k(&self) -> usize {
        self.k
    }
    /// x rounded to bf16 and packed ([`pack_rows`]; for AMX row-major, [`crate::amx::pack_rows`]).
    fn pack_input(&self, x: Rows, m: usize) -> Aligned {
        if self.on_amx() {
            crate::amx::pack_rows(x, m, self.k)
        } else {
            pack_rows(x, m, self.k)
        }
    }

    /// Rows `rows` (starting at a multiple of MR) × column groups `groups` (48 outputs each,
    /// the last clipped to n) of y = x Wᵀ (row stride n), x packed by [`pack_rows`].
    ///
    /// # Safety
    /// `y` holds m × n values and this region of it is written by this call only.
    unsafe fn block(&self, xs: &Aligned, rows: std::ops::Range<usize>, groups: std::ops::Range<usize>, y: *mut f32) {
        #[cfg(target_arch = "x86_64")]
        if self.on_amx() {
            // SAFETY: on_amx holds only where the kernel is AMX (`available`), and pack_input then
            // packed xs for it; see the caller.
            unsafe { crate::amx::block(xs, &self.data, self.pairs, self.n, rows, groups, y) };
            return;
        }
        let kernel = Kernel::detect();
        let (pairs, n) = (self.pairs, self.n);
        // Equal blocks of at most KC pairs (288 pairs: 3 × 96, not 128 + 128 + 32: a short
        // block pays the accumulators' loads and stores for little work).
        let step = pairs.div_ceil(pairs.div_ceil(KC));
        for p0 in (0..pairs).step_by(step) {
            let kc = step.min(pairs - p0);
            for g in groups.clone() {
                let c0 = g * LANES * NB;
                let b = &self.data[((c0 / LANES) * pairs + p0) * LANES..];
                for r in rows.clone().step_by(MR) {
                    let t = Tile {
                        a: &xs[r * pairs + p0 * MR..],
                        b,
                        ldb: pairs * LANES,
                        kc,
                        c: y.add(r * n + c0),
                        ldc: n,
                        cols: (n - c0).min(LANES * NB),
                        first: p0 == 0,
                    };
                    kernel.run(MR.min(rows.end - r), &t);
                }
            }
        }
    }
}

/// x (m, k) rounded to bf16 and packed for the kernel: tiles of MR rows; within a tile, for each
/// input pair p, MR words (x[r, 2p] low, x[r, 2p+1] high), so that a step of the kernel reads
/// its MR broadcasts from one place. Rows past m and an odd k's last input are zeros.
fn pack_rows(x: Rows, m: usize, k: usize) -> Aligned {
    let pairs = k.div_ceil(2);
    let len = m.div_ceil(MR) * MR * pairs;
    // Round the tile's rows into `words` (a contiguous, vectorised pass), then interleave them;
    // `words` (and `row`, silu·up's f32 row) are scratch buffers per rayon job, not allocations
    // per tile.
    let fill = |(words, row): &mut (Vec<u32>, Vec<f32>), tile: usize, dst: &mut [std::mem::MaybeUninit<u32>]| {
        let rows = MR.min(m - tile * MR);
        words.resize(MR * pairs, 0);
        for (r, w) in words.chunks_exact_mut(pairs.max(1)).take(rows).enumerate() {
            round_row(x, tile * MR + r, k, row, w);
        }
        // Every word is written (the last tile's missing rows as zeros), so `xs` is never zeroed
        // first.
        let mut p0 = 0;
        #[cfg(target_arch = "x86_64")]
        if rows == MR && Kernel::detect() != Kernel::Portable && std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above); `words` holds MR rows of `pairs`
            // words and `dst` MR words per pair. (ONEPASS_BF16_KERNEL=portable keeps the scalar
            // copy, so that the portable-kernel test covers it too.)
            p0 = unsafe { interleave8_avx2(words, pairs, dst) };
        }
        for (p, d) in dst.chunks_exact_mut(MR).enumerate().skip(p0) {
            for (r, d) in d.iter_mut().enumerate() {
                d.write(if r < rows { words[r * pairs + p] } else { 0 });
            }
        }
    };
    // SAFETY (of `overwritten`): the tiles cover xs and `fill` writes each tile in full.
    unsafe {
        Aligned::overwritten(len, |xs| {
            if m * k >= 1 << 16 {
                xs.par_chunks_mut((MR * pairs).max(1))
                    .enumerate()
                    .for_each_init(Default::default, |scratch, (tile, dst)| fill(scratch, tile, dst));
            } else {
                let mut scratch = Default::default();
                xs.chunks_mut((MR * pairs).max(1)).enumerate().for_each(|(tile, dst)| fill(&mut scratch, tile, dst));
            }
        })
    }
}

/// The interleave of [`pack_rows`] for a full tile, eight pairs at a time as 8 × 8 transposes of
/// 32-bit words (the scalar copy was ~2% of a bf16 forward pass): `dst[p·8 + r] = words[r·pairs +
/// p]`. Returns how many pairs it did (a multiple of 8); the caller does the rest.
///
/// # Safety
/// The CPU has AVX2; `words` holds 8 × `pairs` words, `dst` 8 × `pairs`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn interleave8_avx2(words: &[u32], pairs: usize, dst: &mut [std::mem::MaybeUninit<u32>]) -> usize {
    use std::arch::x86_64::*;
    debug_assert!(words.len() >= MR * pairs && dst.len() >= MR * pairs);
    let full = pairs / 8 * 8;
    let (src, out) = (words.as_ptr(), dst.as_mut_ptr() as *mut u32);
    for p in (0..full).step_by(8) {
        // SAFETY: rows r < 8 and pairs p..p + 8 ≤ pairs are inside both buffers.
        unsafe {
            let row = |r: usize| _mm256_loadu_si256(src.add(r * pairs + p) as *const __m256i);
            let (r0, r1, r2, r3, r4, r5, r6, r7) = (row(0), row(1), row(2), row(3), row(4), row(5), row(6), row(7));
            let (t0, t1) = (_mm256_unpacklo_epi32(r0, r1), _mm256_unpackhi_epi32(r0, r1));
            let (t2, t3) = (_mm256_unpacklo_epi32(r2, r3), _mm256_unpackhi_epi32(r2, r3));
            let (t4, t5) = (_mm256_unpacklo_epi32(r4, r5), _mm256_unpackhi_epi32(r4, r5));
            let (t6, t7) = (_mm256_unpacklo_epi32(r6, r7), _mm256_unpackhi_epi32(r6, r7));
            let (u0, u1) = (_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2));
            let (u2, u3) = (_mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3));
            let (u4, u5) = (_mm256_unpacklo_epi64(t4, t6), _mm256_unpackhi_epi64(t4, t6));
            let (u6, u7) = (_mm256_unpacklo_epi64(t5, t7), _mm256_unpackhi_epi64(t5, t7));
            let col = |j: usize, v: __m256i| _mm256_storeu_si256(out.add((p + j) * MR) as *mut __m256i, v);
            col(0, _mm256_permute2x128_si256(u0, u4, 0x20));
            col(1, _mm256_permute2x128_si256(u1, u5, 0x20));
            col(2, _mm256_permute2x128_si256(u2, u6, 0x20));
            col(3, _mm256_permute2x128_si256(u3, u7, 0x20));
            col(4, _mm256_permute2x128_si256(u0, u4, 0x31));
            col(5, _mm256_permute2x128_si256(u1, u5, 0x31));
            col(6, _mm256_permute2x128_si256(u2, u6, 0x31));
            col(7, _mm256_permute2x128_si256(u3, u7, 0x31));
        }
    }
    full
}

/// One register tile: `rows` (≤ MR) rows of packed activations from `a` (MR words per pair, see
/// [`pack_rows`]), `kc` input pairs of up to NB panels from `b` (panel stride `ldb` words), accumulated into the
/// `cols` (≤ 48) outputs at `c` (row stride `ldc`); `first`: start from 0 rather than from c.
struct Tile<'a> {
    a: &'a [u32],
    b: &'a [u32],
    ldb: usize,
    kc: usize,
    c: *mut f32,
    ldc: usize,
    cols: usize,
    first: bool,
}

/// Which kernel this CPU runs, chosen once per product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// AMX's `TDPBF16PS` ([`crate::amx`]) for matrices whose k is a multiple of 32,
    /// `VDPBF16PS` for the others.
    Amx,
    /// AVX-512 BF16's `VDPBF16PS`.
    Avx512Bf16,
    /// The AVX-512F kernel for CPUs without bf16 instructions: weights widened in registers
    /// ([`tile_avx512`]).
    Avx512,
    /// The AVX2 + FMA kernel: weights widened in registers ([`tile_avx2`]).
    Avx2,
    /// The portable kernel, compiled for the baseline target.
    Portable,
}

impl Kernel {
    /// The fastest kernel this CPU has, decided once per process; `ONEPASS_BF16_KERNEL=portable`
    /// forces the portable one (how a test compares the two on one machine), `ONEPASS_CPU=avx2`
    /// caps it at the AVX2 + FMA build ([`crate::cpu`]).
    pub fn detect() -> Kernel {
        static CHOICE: std::sync::OnceLock<Kernel> = std::sync::OnceLock::new();
        *CHOICE.get_or_init(Kernel::probe)
    }

    fn probe() -> Kernel {
        if std::env::var("ONEPASS_BF16_KERNEL").as_deref() == Ok("portable") {
            return Kernel::Portable;
        }
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            // ONEPASS_CPU=avx2: an AVX-512 machine measures the kernel an AVX2-only CPU runs
            let avx512 = !crate::cpu::capped_at_avx2();
            if avx512 && has!("avx512f") && has!("avx512bf16") {
                // ONEPASS_BF16_KERNEL=avx512bf16: VDPBF16PS on an AMX machine (its bits)
                let keep = std::env::var("ONEPASS_BF16_KERNEL").as_deref() == Ok("avx512bf16");
                if !keep && crate::amx::available() {
                    return Kernel::Amx;
                }
                return Kernel::Avx512Bf16;
            }
            if avx512 && has!("avx512f") {
                return Kernel::Avx512;
            }
            if has!("avx2") && has!("fma") {
                return Kernel::Avx2;
            }
        }
        Kernel::Portable
    }

    /// # Safety
    /// `t` describes valid memory (see [`Tile`]), rows ≤ MR, the CPU has this kernel's features.
    unsafe fn run(self, rows: usize, t: &Tile) {
        macro_rules! dispatch {
            ($f:ident) => {
                match rows.min(MR) {
                    1 => $f::<1>(t),
                    2 => $f::<2>(t),
                    3 => $f::<3>(t),
                    4 => $f::<4>(t),
                    5 => $f::<5>(t),
                    6 => $f::<6>(t),
                    7 => $f::<7>(t),
                    _ => $f::<8>(t),
                }
            };
        }
        match self {
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512Bf16 | Kernel::Amx => dispatch!(tile_dpbf16),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => dispatch!(tile_avx512),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => dispatch!(tile_avx2),
            _ => dispatch!(tile_portable),
        }
    }
}

/// The portable tile: per output, acc += x_hi·w_hi, then acc += x_lo·w_lo (see the module doc);
/// the 16 lanes of a panel are independent, so the compiler vectorises over them.
#[inline(always)]
unsafe fn tile_portable<const R: usize>(t: &Tile) {
    let panels = t.cols.div_ceil(LANES);
    let mut acc = [[[0f32; LANES]; NB]; R];
    if !t.first {
        for (r, row) in acc.iter_mut().enumerate() {
            for c in 0..t.cols {
                row[c / LANES][c % LANES] = *t.c.add(r * t.ldc + c);
            }
        }
    }
    for p in 0..t.kc {
        for (j, _) in (0..panels).zip(0..NB) {
            let w = &t.b[j * t.ldb + p * LANES..][..LANES];
            for (r, row) in acc.iter_mut().enumerate() {
                let a = t.a[p * MR + r];
                let (a_lo, a_hi) = (f32::from_bits(a << 16), f32::from_bits(a & 0xffff_0000));
                for (o, &wv) in row[j].iter_mut().zip(w) {
                    *o += a_hi * f32::from_bits(wv & 0xffff_0000);
                    *o += a_lo * f32::from_bits(wv << 16);
                }
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        for c in 0..t.cols {
            *t.c.add(r * t.ldc + c) = row[c / LANES][c % LANES];
        }
    }
}

/// The AVX-512F tile for CPUs without bf16 instructions (Skylake-SP, Cascade Lake, Ice Lake):
/// as [`tile_avx2`], weights widened in registers — per input pair, each of the tile's three
/// panels becomes its odd and even halves as 16 f32 lanes — and multiplied-added, the odd product
/// then the even one, so the bits are every other kernel's. The activations are split into their
/// odd and even f32 values once per tile (on the stack, 8 KiB), so that each FMA broadcasts its
/// activation from memory: per pair, 6 widening operations feed 48 FMAs (8 rows × 3 panels × 2).
/// The register budget (32 zmm): 24 accumulators, 6 widened weights.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn tile_avx512<const R: usize>(t: &Tile) {
    use std::arch::x86_64::*;
    let panels = t.cols.div_ceil(LANES);
    let mask = |j: usize| -> __mmask16 { crate::packed::panel_mask(j, t.cols) };
    // the activations' odd (high half) and even (low half) values, [p][row]
    let mut hi = [0f32; KC * MR];
    let mut lo = [0f32; KC * MR];
    for (i, &x) in t.a[..t.kc * MR].iter().enumerate() {
        hi[i] = f32::from_bits(x & 0xffff_0000);
        lo[i] = f32::from_bits(x << 16);
    }
    let mut acc = [[_mm512_setzero_ps(); NB]; R];
    if !t.first {
        for (r, row) in acc.iter_mut().enumerate() {
            for (j, v) in row.iter_mut().enumerate() {
                *v = _mm512_maskz_loadu_ps(mask(j), t.c.add(r * t.ldc + j * LANES));
            }
        }
    }
    let b = t.b.as_ptr();
    let himask = _mm512_set1_epi32(0xffff_0000u32 as i32);
    // a full tile loads every panel; a short one widens zeros past its columns
    let full = panels == NB;
    for p in 0..t.kc {
        let w: [__m512i; NB] = std::array::from_fn(|j| {
            if full || j < panels {
                _mm512_loadu_si512(b.add(j * t.ldb + p * LANES) as *const _)
            } else {
                _mm512_setzero_si512()
            }
        });
        let wh: [__m512; NB] = std::array::from_fn(|j| _mm512_castsi512_ps(_mm512_and_si512(w[j], himask)));
        let wl: [__m512; NB] = std::array::from_fn(|j| _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w[j])));
        for (r, row) in acc.iter_mut().enumerate() {
            let xh = _mm512_set1_ps(hi[p * MR + r]);
            let xl = _mm512_set1_ps(lo[p * MR + r]);
            for j in 0..NB {
                row[j] = _mm512_fmadd_ps(xh, wh[j], row[j]);
                row[j] = _mm512_fmadd_ps(xl, wl[j], row[j]);
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        for (j, v) in row.iter().enumerate() {
            let m = mask(j);
            if m != 0 {
                _mm512_mask_storeu_ps(t.c.add(r * t.ldc + j * LANES), m, *v);
            }
        }
    }
}

/// The AVX2 + FMA tile (CPUs without bf16 instructions): each panel's 16 weight pairs are
/// widened in registers — the odd element is the word with its low half cleared, the even one
/// the word shifted left by 16 — once per step for up to four rows, and multiplied-added into
/// 2 × 8-lane accumulators per row. A product of two bf16 values is exact in f32, so
/// round(acc + x·w) by FMA is the portable kernel's multiply-then-add: the same bits (the test
/// checks every kernel against the defining sequence). The register budget (16 ymm) is 8
/// accumulators, 4 widened weights and 2 broadcast activations.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2<const R: usize>(t: &Tile) {
    let panels = t.cols.div_ceil(LANES);
    for j in 0..panels {
        let lanes = (t.cols - j * LANES).min(LANES);
        let mut r0 = 0;
        while r0 < R {
            match R - r0 {
                1 => avx2_rows::<1>(t, j, r0, lanes),
                2 => avx2_rows::<2>(t, j, r0, lanes),
                3 => avx2_rows::<3>(t, j, r0, lanes),
                _ => avx2_rows::<4>(t, j, r0, lanes),
            }
            r0 += 4;
        }
    }
}

/// Rows r0..r0 + G of panel `j` (its first `lanes` outputs stored) of [`tile_avx2`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn avx2_rows<const G: usize>(t: &Tile, j: usize, r0: usize, lanes: usize) {
    use std::arch::x86_64::*;
    let hi = _mm256_set1_epi32(0xffff_0000u32 as i32);
    let mut acc = [[_mm256_setzero_ps(); 2]; G];
    let at = |r: usize| t.c.add((r0 + r) * t.ldc + j * LANES);
    if !t.first {
        for (r, a) in acc.iter_mut().enumerate() {
            let mut buf = [0f32; LANES];
            std::ptr::copy_nonoverlapping(at(r), buf.as_mut_ptr(), lanes);
            *a = [_mm256_loadu_ps(buf.as_ptr()), _mm256_loadu_ps(buf.as_ptr().add(8))];
        }
    }
    let (a, b) = (t.a.as_ptr(), t.b.as_ptr().add(j * t.ldb));
    for p in 0..t.kc {
        let w0 = _mm256_loadu_si256(b.add(p * LANES) as *const __m256i);
        let w1 = _mm256_loadu_si256(b.add(p * LANES + 8) as *const __m256i);
        let (h0, l0) = (_mm256_castsi256_ps(_mm256_and_si256(w0, hi)), _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16)));
        let (h1, l1) = (_mm256_castsi256_ps(_mm256_and_si256(w1, hi)), _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16)));
        for (r, v) in acc.iter_mut().enumerate() {
            let x = *a.add(p * MR + r0 + r);
            let (xh, xl) = (_mm256_set1_ps(f32::from_bits(x & 0xffff_0000)), _mm256_set1_ps(f32::from_bits(x << 16)));
            // the odd product, then the even one (the defining order)
            v[0] = _mm256_fmadd_ps(xh, h0, v[0]);
            v[1] = _mm256_fmadd_ps(xh, h1, v[1]);
            v[0] = _mm256_fmadd_ps(xl, l0, v[0]);
            v[1] = _mm256_fmadd_ps(xl, l1, v[1]);
        }
    }
    for (r, v) in acc.iter().enumerate() {
        let mut buf = [0f32; LANES];
        _mm256_storeu_ps(buf.as_mut_ptr(), v[0]);
        _mm256_storeu_ps(buf.as_mut_ptr().add(8), v[1]);
        std::ptr::copy_nonoverlapping(buf.as_ptr(), at(r), lanes);
    }
}

/// The `VDPBF16PS` tile: R × 3 accumulators of 16 outputs, each step broadcasting one packed
/// activation pair per row against three panels' weight pairs.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn tile_dpbf16<const R: usize>(t: &Tile) {
    use std::arch::x86_64::*;
    let panels = t.cols.div_ceil(LANES);
    let mask = |j: usize| -> __mmask16 { crate::packed::panel_mask(j, t.cols) };
    let mut acc = [[_mm512_setzero_ps(); NB]; R];
    if !t.first {
        for (r, row) in acc.iter_mut().enumerate() {
            for (j, v) in row.iter_mut().enumerate() {
                *v = _mm512_maskz_loadu_ps(mask(j), t.c.add(r * t.ldc + j * LANES));
            }
        }
    }
    let (a, b) = (t.a.as_ptr(), t.b.as_ptr());
    // A full tile loads every panel unconditionally, so the loop has one shape; a short one loads
    // zeros for the panels past its columns.
    let full = panels == NB;
    for p in 0..t.kc {
        let w: [__m512bh; NB] = std::array::from_fn(|j| {
            if full || j < panels {
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(b.add(j * t.ldb + p * LANES) as *const _))
            } else {
                std::mem::transmute::<__m512i, __m512bh>(_mm512_setzero_si512())
            }
        });
        for (r, row) in acc.iter_mut().enumerate() {
            let x = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(*a.add(p * MR + r) as i32));
            for (v, wj) in row.iter_mut().zip(w) {
                *v = _mm512_dpbf16_ps(*v, x, wj);
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        for (j, v) in row.iter().enumerate() {
            let m = mask(j);
            if m != 0 {
                _mm512_mask_storeu_ps(t.c.add(r * t.ldc + j * LANES), m, *v);
            }
        }
    }
}

/// Whether bf16 products run slower than f32's here: the AVX2 + FMA kernel (an AVX2-only CPU, or
/// capped) and the portable one widen every weight in software below f32's speed (before the AVX2
/// kernel, 11x on an AVX2-only EPYC: 40 against 439 tok/s). An AVX-512F CPU without bf16
/// instructions (Skylake-SP, Cascade Lake, Ice Lake) widens in 512-bit registers at f32's speed
/// (on a Cascade Lake: φ 1.0–1.2x of f32, generation 1.16x, half the weight memory), so it is not.
pub fn is_slow() -> bool {
    matches!(Kernel::detect(), Kernel::Avx2 | Kernel::Portable)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packed::PackedMatrix;
    use rand::{Rng, SeedableRng};

    fn random(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| (rng.random::<f32>() * 2.0 - 1.0) * scale).collect()
    }

    /// The defining sequence, written independently of the kernels: per output, over pairs in
    /// order, the odd product then the even one, each added in f32.
    fn reference(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
        let r = |v: f32| from_bf16(to_bf16(v));
        let mut y = vec![0f32; m * n];
        for i in 0..m {
            for o in 0..n {
                let mut acc = 0f32;
                for p in 0..k.div_ceil(2) {
                    if 2 * p + 1 < k {
                        acc += r(x[i * k + 2 * p + 1]) * r(w[o * k + 2 * p + 1]);
                    } else {
                        acc += 0.0;
                    }
                    acc += r(x[i * k + 2 * p]) * r(w[o * k + 2 * p]);
                }
                y[i * n + o] = acc;
            }
        }
        y
    }

    #[test]
    fn rounding_matches_half() {
        let mut xs = random(100_000, 1, 1e3);
        xs.extend([0.0, -0.0, 1.0, f32::MAX, f32::MIN, f32::INFINITY, f32::NEG_INFINITY, 1e-30, -3e-39]);
        xs.extend((0..1000).map(|i| f32::from_bits(0x3f80_8000 + i * 0x1_0000)));
        for x in xs {
            let want = if x != 0.0 && x.abs() < f32::MIN_POSITIVE { 0.0f32.copysign(x) } else { x };
            assert_eq!(to_bf16(x), half::bf16::from_f32(want).to_bits(), "{x:e}");
        }
        assert!(from_bf16(to_bf16(f32::NAN)).is_nan());
        // Half-way cases round to even: 1 + 2^-8 is half an ulp of bf16 above 1.
        assert_eq!(from_bf16(to_bf16(1.0 + 2f32.powi(-8))), 1.0);
        assert_eq!(from_bf16(to_bf16(1.0 + 3.0 * 2f32.powi(-8))), 1.0 + 2f32.powi(-6));
    }

    /// Every kernel, every tile shape (rows 1–8 and beyond a task block, outputs not a multiple
    /// of 16 or 48, odd k, k past one cache block) gives the reference's bits.
    #[test]
    fn kernels_give_the_defining_sequence_bit_for_bit() {
        let kernels = {
            let mut v = vec![Kernel::Portable];
            #[cfg(target_arch = "x86_64")]
            {
                use std::arch::is_x86_feature_detected as has;
                if has!("avx2") && has!("fma") {
                    v.push(Kernel::Avx2);
                }
                if has!("avx512f") {
                    v.push(Kernel::Avx512);
                }
                if has!("avx512f") && has!("avx512bf16") {
                    v.push(Kernel::Avx512Bf16);
                }
            }
            v
        };
        for (m, n, k) in [(1, 1, 1), (3, 17, 5), (8, 48, 64), (13, 50, 257), (70, 96, 300), (9, 33, 2)] {
            let x = random(m * k, 2, 3.0);
            let w = random(n * k, 3, 0.5);
            let want = reference(&x, &w, m, n, k);
            let mat = Bf16Matrix::from_f32(&w, n, k);
            assert_eq!(mat.to_f32(), w.iter().map(|&v| from_bf16(to_bf16(v))).collect::<Vec<_>>());
            for &kern in &kernels {
                let got = with_kernel(kern, &mat, &x, m);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(g.to_bits(), w.to_bits(), "{kern:?} m {m} n {n} k {k} at {i}: {g} vs {w}");
                }
            }
            // Negative control: summing the even product first changes some bits (so the test
            // can see the order), and f32 inputs unrounded differ by far more.
            if k >= 64 {
                let mut swapped = vec![0f32; m * n];
                let r = |v: f32| from_bf16(to_bf16(v));
                for i in 0..m {
                    for o in 0..n {
                        let mut acc = 0f32;
                        for p in 0..k / 2 {
                            acc += r(x[i * k + 2 * p]) * r(w[o * k + 2 * p]);
                            acc += r(x[i * k + 2 * p + 1]) * r(w[o * k + 2 * p + 1]);
                        }
                        swapped[i * n + o] = acc;
                    }
                }
                assert!(swapped.iter().zip(&want).any(|(a, b)| a.to_bits() != b.to_bits()));
            }
        }
    }

    /// On an AMX machine (skipped elsewhere, saying so): the product through AMX is close to the
    /// exact dot product of the rounded inputs — closer than the sequential f32 order more often
    /// than not — and its bits do not depend on the other rows of the batch or on the thread
    /// count; a k that is not a multiple of 32 keeps `VDPBF16PS`'s defining sequence. Negative
    /// control: AMX's bits differ from the sequential order's somewhere (AMX did run).
    #[test]
    fn amx_products_are_near_exact_and_do_not_depend_on_the_batch_or_threads() {
        if Kernel::detect() != Kernel::Amx {
            eprintln!("no AMX on this CPU ({:?}): nothing to check", Kernel::detect());
            return;
        }
        let r = |v: f32| from_bf16(to_bf16(v)) as f64;
        for (m, n, k) in [(1, 16, 32), (17, 50, 64), (40, 96, 576), (130, 70, 1536)] {
            let x = random(m * k, 11, 3.0);
            let w = random(n * k, 12, 0.5);
            let mat = Bf16Matrix::from_f32(&w, n, k);
            assert!(mat.on_amx());
            let got = mat.matmul_t(&x, m);
            let seq = reference(&x, &w, m, n, k);
            let (mut amx_exact, mut seq_exact, mut differ) = (0, 0, 0);
            for i in 0..m {
                for o in 0..n {
                    let (mut exact, mut abs) = (0f64, 0f64);
                    for j in 0..k {
                        exact += r(x[i * k + j]) * r(w[o * k + j]);
                        abs += (r(x[i * k + j]) * r(w[o * k + j])).abs();
                    }
                    let (g, q) = (got[i * n + o], seq[i * n + o]);
                    assert!(
                        (g as f64 - exact).abs() <= abs * 2f64.powi(-22),
                        "m {m} n {n} k {k} at ({i}, {o}): {g} vs exact {exact} (Σ|xw| {abs})"
                    );
                    amx_exact += (g == exact as f32) as usize;
                    seq_exact += (q == exact as f32) as usize;
                    differ += (g.to_bits() != q.to_bits()) as usize;
                }
            }
            if k >= 576 {
                assert!(differ > 0, "AMX gave the sequential bits everywhere: did it run?");
                assert!(amx_exact > seq_exact, "exactly rounded: AMX {amx_exact}, sequential {seq_exact} of {}", m * n);
            }
            // each row alone, and the whole product on 1 and 3 threads: the same bits
            for i in [0, m / 2, m - 1] {
                let alone = mat.matmul_t(&x[i * k..(i + 1) * k], 1);
                assert_eq!(alone, got[i * n..(i + 1) * n], "row {i} alone differs (m {m}, k {k})");
            }
            for t in [1, 3] {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(t).build().unwrap();
                assert_eq!(pool.install(|| mat.matmul_t(&x, m)), got, "{t} threads (m {m}, k {k})");
            }
        }
        // k = 300: 150 pairs, not whole 16-pair steps: VDPBF16PS's defining sequence
        let (m, n, k) = (20, 33, 300);
        let (x, w) = (random(m * k, 13, 3.0), random(n * k, 14, 0.5));
        let mat = Bf16Matrix::from_f32(&w, n, k);
        assert!(!mat.on_amx());
        let want = reference(&x, &w, m, n, k);
        assert!(mat.matmul_t(&x, m).iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()));
    }

    /// The fused SwiGLU product is silu·up (the f32 op) followed by the plain product, bit for
    /// bit, over enough rows for the parallel packing path; a negative control: the product of
    /// the gate alone differs.
    #[test]
    fn swiglu_product_is_silu_mul_then_the_product() {
        let (m, n, k) = (130, 70, 515);
        let gu = random(m * 2 * k, 6, 3.0);
        let w = random(n * k, 7, 0.1);
        let mat = Bf16Matrix::from_f32(&w, n, k);
        let mut a = vec![0f32; m * k];
        for (d, s) in a.chunks_exact_mut(k).zip(gu.chunks_exact(2 * k)) {
            let (g, u) = s.split_at(k);
            for ((d, &g), &u) in d.iter_mut().zip(g).zip(u) {
                *d = g / (1.0 + (-g).exp()) * u;
            }
        }
        let want = crate::rows::silu_mul(&gu, k);
        // The f32 op itself is silu·up (within its exp's error) — not, say, the gate alone.
        assert!(want.iter().zip(&a).all(|(x, y)| (x - y).abs() <= 1e-5 * (1.0 + y.abs())));
        let fused = mat.matmul_t_swiglu(&gu, m);
        assert_eq!(fused, mat.matmul_t(&want, m));
        let gate: Vec<f32> = gu.chunks_exact(2 * k).flat_map(|r| r[..k].to_vec()).collect();
        assert_ne!(fused, mat.matmul_t(&gate, m));
    }

    /// The product with its residual + RMSNorm epilogue gives the product followed by the f32
    /// op's bits, with few rows (the epilogue after the product) and many (whole-row tasks),
    /// plain and SwiGLU inputs.
    #[test]
    fn add_rms_epilogue_is_the_product_then_the_norm() {
        let (n, k) = (100, 70);
        let w = random(n * k, 8, 0.1);
        let mat = Bf16Matrix::from_f32(&w, n, k);
        let norm = random(n, 9, 1.0);
        for m in [5, 130, 1100] {
            for swiglu in [false, true] {
                let x = random(m * if swiglu { 2 * k } else { k }, 10, 2.0);
                let r = random(m * n, 11, 1.0);
                let y = if swiglu { mat.matmul_t_swiglu(&x, m) } else { mat.matmul_t(&x, m) };
                let want = crate::rows::add_rms_norm(&r, &y, &norm, 1e-5);
                let got = mat.matmul_t_add_rms(&x, swiglu, m, &r, &norm, 1e-5);
                assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "m {m}, swiglu {swiglu}");
                // The residual is really added (the norm of y alone differs).
                let alone = mat.matmul_t_add_rms(&x, swiglu, m, &vec![0.0; m * n], &norm, 1e-5);
                assert_ne!(alone[m * n..], got[m * n..]);
            }
        }
    }

    /// The product a caller sees (rayon tasks, detected kernel) equals the reference at any
    /// thread count, and stays within bf16's rounding of the f32 product.
    #[test]
    fn matmul_is_deterministic_and_close_to_f32() {
        let (m, n, k) = (150, 200, 576);
        let x = random(m * k, 4, 2.0);
        let w = random(n * k, 5, 0.1);
        let mat = Bf16Matrix::from_f32(&w, n, k);
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap().install(|| mat.matmul_t(&x, m));
        let two = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap().install(|| mat.matmul_t(&x, m));
        assert_eq!(one, two);
        // AMX rounds its dot products its own way (amx_products_are_near_exact_…)
        if !mat.on_amx() {
            assert_eq!(one, reference(&x, &w, m, n, k));
        }
        let mut worst = 0f64;
        for i in 0..m {
            for o in 0..n {
                let exact: f64 = (0..k).map(|j| x[i * k + j] as f64 * w[o * k + j] as f64).sum();
                let scale: f64 = (0..k).map(|j| (x[i * k + j] as f64 * w[o * k + j] as f64).abs()).sum();
                worst = worst.max((one[i * n + o] as f64 - exact).abs() / scale);
            }
        }
        // Two roundings of 2^-9 each per product, relative to Σ|x·w|.
        assert!(worst < 2.0 * 2f64.powi(-8), "worst relative error {worst}");
        assert!(worst > 1e-6, "bf16 rounding should be visible ({worst}): is x rounded at all?");
    }

    fn with_kernel(kern: Kernel, mat: &Bf16Matrix, x: &[f32], m: usize) -> Vec<f32> {
        // The single-task path of matmul_t with a chosen kernel.
        let (k, pairs, n) = (mat.k, mat.pairs, mat.n);
        let xs = pack_rows(Rows::Plain(x), m, k);
        let mut y = vec![f32::NAN; m * n];
        for p0 in (0..pairs).step_by(KC) {
            let kc = KC.min(pairs - p0);
            for c0 in (0..n).step_by(LANES * NB) {
                let cols = (n - c0).min(LANES * NB);
                for r in (0..m).step_by(MR) {
                    let t = Tile {
                        a: &xs[r * pairs + p0 * MR..],
                        b: &mat.data[((c0 / LANES) * pairs + p0) * LANES..],
                        ldb: pairs * LANES,
                        kc,
                        c: unsafe { y.as_mut_ptr().add(r * n + c0) },
                        ldc: n,
                        cols,
                        first: p0 == 0,
                    };
                    unsafe { kern.run(MR.min(m - r), &t) };
                }
            }
        }
        y
    }
}
