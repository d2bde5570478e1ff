//! The f32 matrix product of the CPU path: y = x Wᵀ with W packed once at load and multiplied by
//! register-blocked AVX-512 or AVX2 + FMA kernels, with the fusions of [`crate::packed`] (RoPE
//! after q/k/v, residual + RMSNorm after the output and down projections, silu(gate)·up before
//! down).
//!
//! Why not candle's matmul (the `gemm` crate): it packs the weight on every call and leaves each
//! product's output for a separate pass of the op that follows; on an AVX2-only CPU it ran φ at
//! 0.76x PyTorch f32 (issue 35). Here the weight is packed once and the epilogues run on blocks
//! still in cache.
//!
//! **One result on every CPU.** Each output is one accumulator that starts at 0 and adds
//! xᵢ·wᵢ for i ascending by fused multiply-add (one rounding per step). AVX-512, AVX2 + FMA and
//! the portable kernel (`f32::mul_add`) run that same sequence, and blocking over the inner
//! dimension reloads the partial sums and continues it, so neither the CPU kind, the tiling nor
//! the thread count changes a bit (tested against the sequence written out in scalar code).

use crate::packed::Rows;
use rayon::prelude::*;

/// Output columns per packed panel: one 512-bit register, two 256-bit ones.
const LANES: usize = 16;
/// Panels per column group (48 outputs).
const NB: usize = 3;
/// Rows per register tile: AVX2 holds 6 rows × 2 registers = 12 accumulators, 2 weight
/// registers and a broadcast in its 16; AVX-512 6 × 3 = 18 of its 32.
const MR: usize = 6;
/// Inputs per cache block: a panel of 256 inputs is 16 KiB, inside L1 while the tile's rows run
/// over it (on a 2-core Zen 3, 256 measured ahead of 64 and 128, level with 512; noisy). On
/// Intel cores [`kc`] takes 128: the tile's three panels of 256 inputs (48 KiB) overflow their
/// 32 KiB L1, and on a Cascade Lake the products ran at 0.58–0.87x candle's gemm with 256 and
/// 0.82–0.97x with 128 (64: 0.78–0.94x; session 26, `bf16_gemm 2048 3`, 2 threads).
const KC: usize = 256;

/// The inputs per cache block on this CPU: `ONEPASS_F32_KC` (for measuring), else 128 on an
/// Intel CPU and [`KC`] elsewhere. The blocking never changes a bit (each output's sum
/// continues in order across blocks: tested), only the speed.
fn kc() -> usize {
    static KC_HERE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *KC_HERE.get_or_init(|| {
        if let Some(v) = std::env::var("ONEPASS_F32_KC").ok().and_then(|v| v.parse::<usize>().ok()).filter(|&v| v > 0) {
            return v;
        }
        if crate::cpu::is_intel() {
            128
        } else {
            KC
        }
    })
}
/// Rows per task (a multiple of MR): a task's block of activations (120 × 128 inputs, 60 KiB)
/// stays in L2.
const MC: usize = 120;
const _: () = assert!(MC.is_multiple_of(MR));

/// A weight matrix W (n outputs × k inputs, PyTorch's `Linear` layout) in f32, packed for the
/// kernels: panels of 16 outputs; within a panel, for each input i, the 16 outputs' w[o, i].
/// Missing outputs of the last panel are zeros.
pub struct F32Matrix {
    n: usize,
    k: usize,
    data: Vec<f32>,
}

impl F32Matrix {
    /// Packs W given row-major (n, k). Large matrices (weights, once at load) are packed on the
    /// pool.
    pub fn from_f32(w: &[f32], n: usize, k: usize) -> F32Matrix {
        assert_eq!(w.len(), n * k, "a {n} × {k} matrix needs {} values", n * k);
        let panels = n.div_ceil(LANES);
        let mut data = vec![0f32; panels * k * LANES];
        let fill = |panel: usize, dst: &mut [f32]| {
            let lanes = LANES.min(n - panel * LANES);
            for lane in 0..lanes {
                let row = &w[(panel * LANES + lane) * k..][..k];
                for (i, v) in row.iter().enumerate() {
                    dst[i * LANES + lane] = *v;
                }
            }
        };
        let chunk = (k * LANES).max(1);
        if n * k >= 1 << 18 {
            data.par_chunks_mut(chunk).enumerate().for_each(|(panel, dst)| fill(panel, dst));
        } else {
            data.chunks_mut(chunk).enumerate().for_each(|(panel, dst)| fill(panel, dst));
        }
        F32Matrix { n, k, data }
    }

    /// Outputs (rows of W).
    pub fn n(&self) -> usize {
        self.n
    }
    /// Inputs (columns of W).
    pub fn k(&self) -> usize {
        self.k
    }
}

impl crate::packed::Blocked for F32Matrix {
    type Input = Vec<f32>;
    const GROUP: usize = LANES * NB;
    const MC: usize = MC;
    fn n(&self) -> usize {
        self.n
    }
    fn k(&self) -> usize {
        self.k
    }

    /// x packed by [`pack_tiles`].
    fn pack_input(&self, x: Rows, m: usize) -> Vec<f32> {
        pack_tiles(x, m, self.k)
    }

    /// Rows `rows` (starting at a multiple of MR) × column groups `groups` (48 outputs each,
    /// the last clipped to n) of y = x Wᵀ (row stride n), x packed by `pack_input`.
    ///
    /// # Safety
    /// `y` holds m × n values and this region of it is written by this call only.
    unsafe fn block(&self, xs: &Vec<f32>, rows: std::ops::Range<usize>, groups: std::ops::Range<usize>, y: *mut f32) {
        self.block_with(Kernel::detect(), xs, rows, groups, y)
    }
}

impl F32Matrix {
    /// [`crate::packed::Blocked::block`] with a given kernel.
    ///
    /// # Safety
    /// As `block`; the CPU has the kernel's features.
    unsafe fn block_with(
        &self,
        kernel: Kernel,
        xs: &[f32],
        rows: std::ops::Range<usize>,
        groups: std::ops::Range<usize>,
        y: *mut f32,
    ) {
        let (k, n) = (self.k, self.n);
        // Equal blocks of at most KC inputs (a short last block pays the accumulators' loads
        // and stores for little work).
        let step = k.div_ceil(k.div_ceil(kc()));
        for i0 in (0..k).step_by(step) {
            let kc = step.min(k - i0);
            // A group's panels inside the row loop: AVX2's tile runs them one after the other
            // over its 6 rows' activations, which stay in L1. The other order (one 16-KiB panel
            // over every row tile, the activations' broadcasts from L2) ran φ at 0.91x of this
            // on a Zen 3 (rounds 0.79–0.92x; session 34, `onepass features bench`, 3
            // alternating rounds).
            for g in groups.clone() {
                let c0 = g * LANES * NB;
                let b = &self.data[((c0 / LANES) * k + i0) * LANES..];
                for r in rows.clone().step_by(MR) {
                    let t = Tile {
                        a: &xs[r * k + i0 * MR..],
                        b,
                        ldb: k * LANES,
                        kc,
                        c: y.add(r * n + c0),
                        ldc: n,
                        cols: (n - c0).min(LANES * NB),
                        first: i0 == 0,
                    };
                    kernel.run(MR.min(rows.end - r), &t);
                }
            }
        }
    }
}

/// x (m, k) packed in tiles of MR rows: within a tile, for each input i, the MR rows'
/// x[r, i], so that a step of the kernel reads its broadcasts from one place. Rows past m are
/// zeros.
fn pack_tiles(x: Rows, m: usize, k: usize) -> Vec<f32> {
    let fill = |row: &mut Vec<f32>, tile: usize, dst: &mut [std::mem::MaybeUninit<f32>]| {
        let rows = MR.min(m - tile * MR);
        row.resize(k, 0.0);
        for r in 0..MR {
            if r < rows {
                x.row_into(tile * MR + r, k, row);
                for (i, v) in row.iter().enumerate() {
                    dst[i * MR + r].write(*v);
                }
            } else {
                (0..k).for_each(|i| _ = dst[i * MR + r].write(0.0));
            }
        }
    };
    let len = m.div_ceil(MR) * MR * k;
    // SAFETY (of `overwritten`): the tiles cover xs and `fill` writes each tile in full.
    unsafe {
        crate::buf::overwritten(len, |xs| {
            if m * k >= 1 << 16 {
                xs.par_chunks_mut(MR * k).enumerate().for_each_init(Vec::new, |row, (t, dst)| fill(row, t, dst));
            } else {
                let mut row = Vec::new();
                xs.chunks_mut(MR * k).enumerate().for_each(|(t, dst)| fill(&mut row, t, dst));
            }
        })
    }
}

/// One register tile: `rows` (≤ MR) rows of packed activations from `a` (MR values per input),
/// `kc` inputs of up to NB panels from `b` (panel stride `ldb` values), accumulated into the
/// `cols` (≤ 48) outputs at `c` (row stride `ldc`); `first`: start from 0 rather than from c.
struct Tile<'a> {
    a: &'a [f32],
    b: &'a [f32],
    ldb: usize,
    kc: usize,
    c: *mut f32,
    ldc: usize,
    cols: usize,
    first: bool,
}

/// Which f32 kernel this CPU runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// AVX-512F: 6 rows × 48 outputs per tile.
    Avx512,
    /// AVX2 + FMA: 6 rows × 16 outputs, three times per tile.
    Avx2,
    /// `f32::mul_add` in scalar code the compiler may vectorise.
    Portable,
}

impl Kernel {
    /// The fastest kernel this CPU has, decided once per process; `ONEPASS_F32_KERNEL=portable`
    /// forces the portable one (how a test compares them on one machine), `ONEPASS_CPU=avx2`
    /// caps it at AVX2 + FMA ([`crate::cpu`]).
    pub fn detect() -> Kernel {
        static CHOICE: std::sync::OnceLock<Kernel> = std::sync::OnceLock::new();
        *CHOICE.get_or_init(Kernel::probe)
    }

    fn probe() -> Kernel {
        if std::env::var("ONEPASS_F32_KERNEL").as_deref() == Ok("portable") {
            return Kernel::Portable;
        }
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if !crate::cpu::capped_at_avx2() && has!("avx512f") {
                return Kernel::Avx512;
            }
            if has!("avx2") && has!("fma") {
                return Kernel::Avx2;
            }
        }
        Kernel::Portable
    }

    /// The kernels this CPU can run (the tests compare each with the defining sequence).
    pub fn available() -> Vec<Kernel> {
        let mut all = vec![Kernel::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx2") && has!("fma") {
                all.push(Kernel::Avx2);
            }
            if has!("avx512f") {
                all.push(Kernel::Avx512);
            }
        }
        all
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
                    _ => $f::<6>(t),
                }
            };
        }
        match self {
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => dispatch!(tile_avx512),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => dispatch!(tile_avx2),
            _ => dispatch!(tile_portable),
        }
    }
}

/// The portable tile: per output, acc = x·w + acc by `mul_add`; the 16 lanes of a panel are
/// independent, so the compiler may vectorise over them.
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
                for (o, &wv) in row[j].iter_mut().zip(w) {
                    *o = a.mul_add(wv, *o);
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

/// The AVX2 + FMA tile: for each of the group's panels, R rows × 2 × 8-lane accumulators, each
/// step loading the panel's 16 weights once and broadcasting one activation per row.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2<const R: usize>(t: &Tile) {
    use std::arch::x86_64::*;
    let panels = t.cols.div_ceil(LANES);
    for j in 0..panels {
        let lanes = (t.cols - j * LANES).min(LANES);
        let at = |r: usize| t.c.add(r * t.ldc + j * LANES);
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        if !t.first {
            for (r, v) in acc.iter_mut().enumerate() {
                if lanes == LANES {
                    *v = [_mm256_loadu_ps(at(r)), _mm256_loadu_ps(at(r).add(8))];
                } else {
                    let mut buf = [0f32; LANES];
                    std::ptr::copy_nonoverlapping(at(r), buf.as_mut_ptr(), lanes);
                    *v = [_mm256_loadu_ps(buf.as_ptr()), _mm256_loadu_ps(buf.as_ptr().add(8))];
                }
            }
        }
        let (a, b) = (t.a.as_ptr(), t.b.as_ptr().add(j * t.ldb));
        for p in 0..t.kc {
            let w0 = _mm256_loadu_ps(b.add(p * LANES));
            let w1 = _mm256_loadu_ps(b.add(p * LANES + 8));
            for (r, v) in acc.iter_mut().enumerate() {
                let x = _mm256_broadcast_ss(&*a.add(p * MR + r));
                v[0] = _mm256_fmadd_ps(x, w0, v[0]);
                v[1] = _mm256_fmadd_ps(x, w1, v[1]);
            }
        }
        for (r, v) in acc.iter().enumerate() {
            if lanes == LANES {
                _mm256_storeu_ps(at(r), v[0]);
                _mm256_storeu_ps(at(r).add(8), v[1]);
            } else {
                let mut buf = [0f32; LANES];
                _mm256_storeu_ps(buf.as_mut_ptr(), v[0]);
                _mm256_storeu_ps(buf.as_mut_ptr().add(8), v[1]);
                std::ptr::copy_nonoverlapping(buf.as_ptr(), at(r), lanes);
            }
        }
    }
}

/// The AVX-512 tile: R rows × 3 accumulators of 16 outputs, each step loading three panels'
/// weights and broadcasting one activation per row.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn tile_avx512<const R: usize>(t: &Tile) {
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
        let w: [__m512; NB] = std::array::from_fn(|j| {
            if full || j < panels {
                _mm512_loadu_ps(b.add(j * t.ldb + p * LANES))
            } else {
                _mm512_setzero_ps()
            }
        });
        for (r, row) in acc.iter_mut().enumerate() {
            let x = _mm512_set1_ps(*a.add(p * MR + r));
            for (v, wj) in row.iter_mut().zip(w) {
                *v = _mm512_fmadd_ps(x, wj, *v);
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

/// The product with one given kernel, whatever [`Kernel::detect`] chose, on the calling thread
/// (tests; a kernel the CPU lacks is refused).
pub fn matmul_t_with(w: &F32Matrix, kernel: Kernel, x: &[f32], m: usize) -> Vec<f32> {
    use crate::packed::Blocked;
    assert!(Kernel::available().contains(&kernel), "this CPU cannot run the {kernel:?} kernel");
    assert_eq!(x.len(), m * w.k, "x has {} values, expected {m} × {}", x.len(), w.k);
    let mut y = vec![0f32; m * w.n];
    if w.k > 0 {
        let xs = w.pack_input(Rows::Plain(x), m);
        // SAFETY: y holds m × n values, all written by this one call; the CPU has the kernel
        // (asserted above).
        unsafe { w.block_with(kernel, &xs, 0..m, 0..w.n.div_ceil(LANES * NB), y.as_mut_ptr()) };
    }
    y
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

    /// The defining sequence, written independently of the kernels: per output, from 0, over
    /// the inputs in order, one fused multiply-add each.
    fn reference(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
        let mut y = vec![0f32; m * n];
        for i in 0..m {
            for o in 0..n {
                y[i * n + o] = (0..k).fold(0f32, |acc, j| x[i * k + j].mul_add(w[o * k + j], acc));
            }
        }
        y
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Every kernel this CPU has, and the threaded product, give the defining sequence bit for
    /// bit: shapes with partial row tiles, partial panels and groups, several inner blocks
    /// (k > KC, not a multiple of it), and decoding's few rows. Negative control: a sum in
    /// another order (plain multiply then add) differs somewhere.
    #[test]
    fn kernels_give_the_defining_sequence_bit_for_bit() {
        let kernels = Kernel::available();
        for (m, n, k) in [(1, 5, 3), (7, 16, 128), (13, 100, 300), (6, 48, 129), (25, 97, 576), (130, 200, 40)] {
            let x = random(m * k, 1 + k as u64, 2.0);
            let w = random(n * k, 2 + n as u64, 0.3);
            let want = reference(&x, &w, m, n, k);
            let mat = F32Matrix::from_f32(&w, n, k);
            for &kern in &kernels {
                assert_eq!(bits(&matmul_t_with(&mat, kern, &x, m)), bits(&want), "{kern:?} at {m} × {n} × {k}");
            }
            assert_eq!(bits(&mat.matmul_t(&x, m)), bits(&want), "threaded at {m} × {n} × {k}");
            if k >= 100 {
                let plain: Vec<f32> = (0..m * n)
                    .map(|e| (0..k).fold(0f32, |acc, j| acc + x[(e / n) * k + j] * w[(e % n) * k + j]))
                    .collect();
                assert_ne!(bits(&plain), bits(&want), "the control sums like the kernels at {m} × {n} × {k}");
            }
        }
        assert!(kernels.contains(&Kernel::detect()));
    }

    /// The product agrees with a plain triple loop summed in f64 (another order and precision)
    /// to f32 precision, and not with another weight (negative control).
    #[test]
    fn product_is_close_to_a_plain_product() {
        let (m, n, k) = (37, 70, 257);
        let (x, w) = (random(m * k, 5, 1.0), random(n * k, 6, 0.1));
        let mat = F32Matrix::from_f32(&w, n, k);
        let got = mat.matmul_t(&x, m);
        let want: Vec<f32> = (0..m * n)
            .map(|ij| {
                let (i, j) = (ij / n, ij % n);
                (0..k).map(|l| x[i * k + l] as f64 * w[j * k + l] as f64).sum::<f64>() as f32
            })
            .collect();
        let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(err < 1e-5, "max |Δ| {err}");
        let other = F32Matrix::from_f32(&random(n * k, 7, 0.1), n, k).matmul_t(&x, m);
        let far = other.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(far > 0.1, "another weight gave max |Δ| {far}");
    }

    /// The fused forms are their parts in sequence, bit for bit: SwiGLU's product is silu·up
    /// then the product; the residual epilogue is the product then add + RMSNorm; with few rows
    /// (the epilogue after the product) and many (whole-row tasks).
    #[test]
    fn fused_forms_are_their_parts() {
        let (n, k) = (64, 96);
        let w = random(n * k, 9, 0.2);
        let mat = F32Matrix::from_f32(&w, n, k);
        let norm = random(n, 10, 1.0);
        for m in [5, 1000] {
            let gu = random(m * 2 * k, 11, 3.0);
            let a = crate::rows::silu_mul(&gu, k);
            let want = mat.matmul_t(&a, m);
            assert_eq!(bits(&mat.matmul_t_swiglu(&gu, m)), bits(&want), "swiglu at {m} rows");
            let r = random(m * n, 12, 1.0);
            let both = mat.matmul_t_add_rms(&a, false, m, &r, &norm, 1e-5);
            let sh = crate::rows::add_rms_norm(&r, &want, &norm, 1e-5);
            let (s, h) = sh.split_at(m * n);
            assert_eq!(bits(&both[..m * n]), bits(s), "residual sum at {m} rows");
            assert_eq!(bits(&both[m * n..]), bits(h), "norm at {m} rows");
            let fused = mat.matmul_t_add_rms(&gu, true, m, &r, &norm, 1e-5);
            assert_eq!(bits(&fused), bits(&both), "swiglu + norm at {m} rows");
        }
    }
}
