//! Fused CPU kernels for the forward pass (f32 activations: the f32 model and the bf16-weight
//! path of [`crate::bf16`]), with the plain candle composition as the fallback (other devices
//! and dtypes) and as the reference the tests compare against.
//!
//! candle 0.11 runs unary ops (silu, scaling) on one core and materialises every intermediate, so
//! on a 2-core CPU the attention mask/scale/softmax chain and the MLP's silu·up were ~15% of a
//! SmolLM2 forward pass next to the (multi-threaded) matmuls. Both kernels here work row by row on
//! rayon's pool.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};
use multiversion::multiversion;
use rayon::prelude::*;
use std::mem::MaybeUninit;

/// Rows per rayon task: enough work per task that scheduling stays negligible.
const MIN_ROWS: usize = 16;

/// e^x for every element, in place: Cody–Waite range reduction x = n·ln2 + r (|r| ≤ ln2/2) and a
/// degree-6 polynomial for e^r (Taylor coefficients; relative error < 3e-7 over the f32 range, see
/// the test), written branch-free so LLVM vectorises it: libm's scalar `expf` was ~40% of the
/// softmax and silu time.
///
/// This and the other elementwise kernels here are compiled for AVX-512 and AVX2 as well as the
/// baseline (`multiversion`, chosen at run time): the baseline's SSE copies of the softmax, silu
/// and norm loops were ~5% of a bf16 forward pass. Neither width changes a bit: no sum is
/// reordered and nothing is contracted into an FMA.
#[multiversion(targets("x86_64+avx512f+avx512bw", "x86_64+avx2+fma"))]
pub fn exp_in_place(x: &mut [f32]) {
    exp_generic(x)
}

#[inline(always)]
fn exp_generic(x: &mut [f32]) {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // 1.5·2^23: adding and subtracting it rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    for v in x.iter_mut() {
        // Below −87.3 the result is 0 (e^−87.3 ≈ 1.2e−38, the smallest normal; −∞ → 0); above
        // ln(f32::MAX) ≈ 88.72 it is +∞.
        let xi = v.clamp(-87.3, 89.0);
        let shifted = xi * LOG2E + ROUND;
        let n = shifted - ROUND;
        let r = (xi - n * LN2_HI) - n * LN2_LO;
        let p =
            1.0 + r * (1.0 + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
        // 2^n as 2·2^(n−1): n reaches 128 at the top of the range, one past the largest exponent.
        // n is read from `shifted`'s low mantissa bits (its bits are ROUND's plus n, |n| ≤ 127)
        // rather than with `n as i32`: Rust's saturating float → int cast does not vectorise, and
        // was most of this function's time.
        let n_int = shifted.to_bits().wrapping_sub(ROUND.to_bits()) as i32;
        let scale = f32::from_bits(((n_int + 126) << 23) as u32);
        *v = if *v < -87.3 { 0.0 } else { (p * scale) * 2.0 };
    }
}

/// softmax(scale · s) over the last dim with a causal mask: the rows are query positions, grouped
/// as (…, groups · t, t) so that row `r` of a (groups · t)-row block is position `r mod t` and sees
/// keys `0..=r mod t` (grouped-query attention stacks the query heads of one key/value head).
struct CausalSoftmax {
    scale: f32,
    t: usize,
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "onepass-causal-softmax"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(src) = storage else {
            candle_core::bail!("causal softmax: expected f32, got {:?}", storage.dtype());
        };
        let Some((o1, o2)) = layout.contiguous_offsets() else {
            candle_core::bail!("causal softmax: expected a contiguous input");
        };
        let src = &src[o1..o2];
        let (t, scale) = (self.t, self.scale);
        let dims = layout.shape().dims();
        if dims.last() != Some(&t) || dims.len() < 2 || !dims[dims.len() - 2].is_multiple_of(t) {
            candle_core::bail!("causal softmax: shape {dims:?} is not (…, k·{t}, {t})");
        }
        let mut dst = vec![0f32; src.len()];
        dst.par_chunks_mut(t).zip(src.par_chunks(t)).enumerate().with_min_len(MIN_ROWS).for_each(|(row, (d, s))| {
            let n = row % t + 1;
            let (s, d) = (&s[..n], &mut d[..n]);
            let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            for (o, &v) in d.iter_mut().zip(s) {
                *o = (v - max) * scale;
            }
            exp_in_place(d);
            let inv = 1.0 / d.iter().sum::<f32>();
            d.iter_mut().for_each(|o| *o *= inv);
        });
        Ok((CpuStorage::F32(dst), layout.shape().clone()))
    }
}

/// The plain composition: scale, add a −∞ mask above the diagonal, softmax.
pub fn causal_softmax_reference(s: &Tensor, scale: f64, t: usize) -> Result<Tensor> {
    let dims = s.dims().to_vec();
    let n = dims.len();
    let groups = dims[n - 2] / t;
    let m: Vec<f32> = (0..t).flat_map(|i| (0..t).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY })).collect();
    let mask = Tensor::from_vec(m, (t, t), s.device())?.to_dtype(s.dtype())?;
    let mut grouped = dims[..n - 2].to_vec();
    grouped.extend([groups, t, t]);
    let x = (s * scale)?.reshape(grouped)?.broadcast_add(&mask)?;
    candle_nn::ops::softmax_last_dim(&x)?.reshape(dims)
}

/// Causal softmax of attention scores `s` (…, groups · t, t), scaled by `scale`.
pub fn causal_softmax(s: &Tensor, scale: f64, t: usize) -> Result<Tensor> {
    if s.device().is_cpu() && s.dtype() == DType::F32 {
        s.contiguous()?.apply_op1_no_bwd(&CausalSoftmax { scale: scale as f32, t })
    } else {
        causal_softmax_reference(s, scale, t)
    }
}

/// Query rows per attention task: a block of rows sees only keys up to its last row, so the
/// causal half of the score matrix is mostly never computed (10/16 of it at t = 256).
const Q_BLOCK: usize = 64;

/// Causal attention softmax(scale · q kᵀ) v for q (b, h, t, d) and k, v (b, kv, t, d), query head
/// `j` reading key/value head `j / (h / kv)`; the output is (b, t, h, d), the layout the output
/// projection reads. One rayon task per (batch row, head, block of query rows), each calling
/// single-threaded gemm for its two products.
struct CausalAttention {
    scale: f32,
}

/// An output buffer shared by rayon tasks that write disjoint regions of it (attention's
/// (batch, position block, head) rows; the bf16 product's tiles).
pub(crate) struct OutPtr(pub(crate) *mut f32);
// SAFETY: every user's tasks write distinct regions of the buffer.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// A method, so closures capture the wrapper (Send + Sync), not the raw pointer field.
    pub(crate) fn at(&self, offset: usize) -> *mut f32 {
        // SAFETY: callers stay inside the buffer.
        unsafe { self.0.add(offset) }
    }
}

/// A vector of `len` values that `fill` writes in full, never zeroed first: the memsets of every
/// activation buffer that a kernel then overwrote were ~3% of a forward pass.
///
/// # Safety
/// `fill` writes each of the `len` elements (through `write` or a pointer from `as_mut_ptr`)
/// and reads none before writing it.
pub(crate) unsafe fn overwritten<T: Copy>(len: usize, fill: impl FnOnce(&mut [MaybeUninit<T>])) -> Vec<T> {
    let mut v: Vec<MaybeUninit<T>> = Vec::with_capacity(len);
    // SAFETY: MaybeUninit needs no initialisation.
    unsafe { v.set_len(len) };
    fill(&mut v);
    let mut v = std::mem::ManuallyDrop::new(v);
    // SAFETY: every element was written (the caller's promise); MaybeUninit<T> has T's layout.
    unsafe { Vec::from_raw_parts(v.as_mut_ptr() as *mut T, len, v.capacity()) }
}

/// The initialised view of a buffer [`overwritten`]'s `fill` has written.
///
/// # Safety
/// Every element of `s` has been written.
pub(crate) unsafe fn assume_written(s: &[MaybeUninit<f32>]) -> &[f32] {
    // SAFETY: the caller's promise; same layout.
    unsafe { std::slice::from_raw_parts(s.as_ptr() as *const f32, s.len()) }
}

/// [`assume_written`], mutable.
///
/// # Safety
/// Every element of `s` has been written.
pub(crate) unsafe fn assume_written_mut(s: &mut [MaybeUninit<f32>]) -> &mut [f32] {
    // SAFETY: the caller's promise; same layout.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr() as *mut f32, s.len()) }
}

/// The f32 values of a contiguous CPU tensor (a custom op's input named `what`).
pub(crate) fn contiguous_f32<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    let CpuStorage::F32(v) = s else {
        candle_core::bail!("{what} is {:?}, expected f32", s.dtype());
    };
    let Some((o1, o2)) = l.contiguous_offsets() else {
        candle_core::bail!("{what} is not contiguous");
    };
    Ok(&v[o1..o2])
}

/// Softmax(scale · s) of the rows of a block of query positions i0, i0 + 1, … (`n` scores each):
/// row r sees keys 0..=i0 + r, the rest become 0.
///
/// Each row's max and sum run in key order (the bits of a plain per-row fold), but eight rows'
/// chains side by side: one row's chain of dependent adds was most of the softmax's time.
#[multiversion(targets("x86_64+avx512f+avx512bw", "x86_64+avx2+fma"))]
fn causal_softmax_rows(sc: &mut [f32], n: usize, i0: usize, scale: f32) {
    const R: usize = 8;
    for (g, block) in sc.chunks_mut(R * n).enumerate() {
        let rows = block.len() / n;
        // Row r of the group sees `common + r` keys.
        let common = i0 + g * R + 1;
        let interleaved = |block: &[f32], init: f32, f: fn(f32, f32) -> f32| {
            let mut acc = [init; R];
            for j in 0..common {
                for (r, a) in acc.iter_mut().enumerate().take(rows) {
                    *a = f(*a, block[r * n + j]);
                }
            }
            for (r, a) in acc.iter_mut().enumerate().take(rows) {
                for &v in &block[r * n + common..r * n + common + r] {
                    *a = f(*a, v);
                }
            }
            acc
        };
        let max = interleaved(block, f32::NEG_INFINITY, f32::max);
        for (r, row) in block.chunks_exact_mut(n).enumerate() {
            let (live, dead) = row.split_at_mut(common + r);
            live.iter_mut().for_each(|x| *x = (*x - max[r]) * scale);
            exp_generic(live);
            dead.fill(0.0);
        }
        // −0.0 is `Sum for f32`'s start: the bits of `iter().sum()`.
        let sum = interleaved(block, -0.0, |a, v| a + v);
        for (r, row) in block.chunks_exact_mut(n).enumerate() {
            let inv = 1.0 / sum[r];
            row[..common + r].iter_mut().for_each(|x| *x *= inv);
        }
    }
}

/// The core of [`CausalAttention`] and [`CausalAttentionPacked`]: `q(bi, head)`, `k(bi, g)` and
/// `v(bi, g)` give the (t, d) rows of query head `head` and key/value head `g` of batch row `bi`;
/// the result is (b, t, h, d).
#[allow(clippy::too_many_arguments)]
fn attend<'a>(
    (b, h, kv, t, d): (usize, usize, usize, usize, usize),
    scale: f32,
    q: impl Fn(usize, usize) -> &'a [f32] + Sync,
    k: impl Fn(usize, usize) -> &'a [f32] + Sync,
    v: impl Fn(usize, usize) -> &'a [f32] + Sync,
) -> Vec<f32> {
    let rep = h / kv;
    let blocks = t.div_ceil(Q_BLOCK);
    // SAFETY (of `overwritten`): the tasks' (batch row, block, head) regions tile the output and
    // each task's second product writes its region in full.
    let fill = |out: &mut [MaybeUninit<f32>]| {
        let dst = OutPtr(out.as_mut_ptr() as *mut f32);
        // `sc`: the scores, one scratch buffer per rayon job.
        (0..b * h * blocks).into_par_iter().for_each_init(Vec::<f32>::new, |sc, task| {
            let (bh, blk) = (task / blocks, task % blocks);
            let (bi, head) = (bh / h, bh % h);
            let (i0, i1) = (blk * Q_BLOCK, ((blk + 1) * Q_BLOCK).min(t));
            let (m, n) = (i1 - i0, i1);
            let qp = &q(bi, head)[i0 * d..][..m * d];
            let (kp, vp) = (&k(bi, head / rep)[..n * d], &v(bi, head / rep)[..n * d]);
            sc.clear();
            sc.reserve(m * n);
            // SAFETY: the slices above hold m×d, n×d and n×d row-major values; `sc` has room for
            // m×n, which the product writes in full. Kᵀ's element (i, j) is k[j·d + i].
            unsafe {
                gemm_into((m, n, d), sc.as_mut_ptr(), n, qp.as_ptr(), d, kp.as_ptr(), (1, d));
                sc.set_len(m * n);
            }
            causal_softmax_rows(sc, n, i0, scale);
            // SAFETY: rows i0..i1 of head `head` of batch row `bi` in the (b, t, h, d) output are
            // written by this task only; `sc` is m×n and `vp` n×d.
            unsafe {
                let o = dst.at(((bi * t + i0) * h + head) * d);
                gemm_into((m, d, n), o, h * d, sc.as_ptr(), n, vp.as_ptr(), (d, 1));
            }
        });
    };
    unsafe { overwritten(b * t * h * d, fill) }
}

/// dst (m × n, row stride `ldd`) = a (m × k, row stride `lda`) · b, where b's element (i, j) is
/// at `b[i·rs + j·cs]` for `(rs, cs)`: one single-threaded gemm call (attention's tasks run in
/// parallel already); dst is written without being read.
///
/// # Safety
/// The pointers address matrices of those shapes and strides.
unsafe fn gemm_into(
    (m, n, k): (usize, usize, usize),
    dst: *mut f32,
    ldd: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    (rs, cs): (usize, usize),
) {
    // SAFETY: the caller's promise.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            ldd as isize,
            false,
            a,
            1,
            lda as isize,
            b,
            cs as isize,
            rs as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

impl CustomOp3 for CausalAttention {
    fn name(&self) -> &'static str {
        "onepass-causal-attention"
    }

    fn cpu_fwd(
        &self,
        sq: &CpuStorage,
        lq: &Layout,
        sk: &CpuStorage,
        lk: &Layout,
        sv: &CpuStorage,
        lv: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (q, k, v) = (
            contiguous_f32(sq, lq, "causal attention: q")?,
            contiguous_f32(sk, lk, "causal attention: k")?,
            contiguous_f32(sv, lv, "causal attention: v")?,
        );
        let (b, h, t, d) = lq.shape().dims4()?;
        let (bk, kv, tk, dk) = lk.shape().dims4()?;
        if (bk, tk, dk) != (b, t, d) || lv.shape() != lk.shape() || kv == 0 || h % kv != 0 {
            candle_core::bail!(
                "causal attention: q {:?}, k {:?}, v {:?} do not fit (b, h, t, d) / (b, kv, t, d)",
                lq.shape(),
                lk.shape(),
                lv.shape()
            );
        }
        let out = attend(
            (b, h, kv, t, d),
            self.scale,
            |bi, head| &q[(bi * h + head) * t * d..],
            |bi, g| &k[(bi * kv + g) * t * d..],
            |bi, g| &v[(bi * kv + g) * t * d..],
        );
        Ok((CpuStorage::F32(out), Shape::from((b, t, h, d))))
    }
}

/// [`CausalAttention`] reading q, k and v from one (b, h + 2·kv, t, d) tensor (what
/// [`qkv_rope`] writes): query heads first, then the key heads, then the value heads.
struct CausalAttentionPacked {
    scale: f32,
    heads: usize,
    kv_heads: usize,
}

impl CustomOp1 for CausalAttentionPacked {
    fn name(&self) -> &'static str {
        "onepass-causal-attention-packed"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = contiguous_f32(s, l, "causal attention: qkv")?;
        let (b, heads, t, d) = l.shape().dims4()?;
        let (h, kv) = (self.heads, self.kv_heads);
        if heads != h + 2 * kv || kv == 0 || h % kv != 0 {
            candle_core::bail!("causal attention: {:?} is not (b, {h} + 2·{kv}, t, d)", l.shape());
        }
        let at = |bi: usize, j: usize| &x[(bi * heads + j) * t * d..];
        let out =
            attend((b, h, kv, t, d), self.scale, |bi, j| at(bi, j), |bi, g| at(bi, h + g), |bi, g| at(bi, h + kv + g));
        Ok((CpuStorage::F32(out), Shape::from((b, t, h, d))))
    }
}

/// Causal grouped-query attention over a packed (b, h + 2·kv, t, d) tensor → (b, t, h, d); CPU
/// f32. The bf16-weight model uses it too: bf16 products here measured no faster (the scores'
/// softmax and the small products' overheads dominate) and f32 keeps prefill and decoding alike.
pub fn causal_attention_packed(qkv: &Tensor, heads: usize, kv_heads: usize, scale: f64) -> Result<Tensor> {
    qkv.contiguous()?.apply_op1_no_bwd(&CausalAttentionPacked { scale: scale as f32, heads, kv_heads })
}

/// q, k and v of a fused projection, rotated and laid out for attention: `qkv` (b, t, H, d) with
/// H = heads + 2·kv heads → (b, H, t, d), RoPE applied to the first `rotated` heads (q and k) at
/// positions offset..offset + t, v copied. The rotation is candle_nn's `rope` (rotate-half) or
/// `rope_i` (interleaved pairs), expression for expression, so the bits match the composition.
struct QkvRope {
    rotated: usize,
    offset: usize,
    interleaved: bool,
}

impl CustomOp3 for QkvRope {
    fn name(&self) -> &'static str {
        "onepass-qkv-rope"
    }

    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        l: &Layout,
        sc: &CpuStorage,
        lc: &Layout,
        ss: &CpuStorage,
        ls: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, cos, sin) = (
            contiguous_f32(s, l, "qkv rope: qkv")?,
            contiguous_f32(sc, lc, "qkv rope: cos")?,
            contiguous_f32(ss, ls, "qkv rope: sin")?,
        );
        let (b, t, heads, d) = l.shape().dims4()?;
        let (rows, half) = lc.shape().dims2()?;
        if d % 2 != 0 || half * 2 != d || self.offset + t > rows || ls.shape() != lc.shape() || self.rotated > heads {
            candle_core::bail!("qkv rope: {:?} against tables {:?} at offset {}", l.shape(), lc.shape(), self.offset);
        }
        // SAFETY (of `overwritten`): every (row, head) chunk is written in full below.
        let fill = |out: &mut [MaybeUninit<f32>]| {
            out.par_chunks_mut(t * d).enumerate().for_each(|(bj, dst)| {
                let (bi, j) = (bj / heads, bj % heads);
                // Head j of batch row bi: rows at a stride of heads·d in x.
                let src = &x[(bi * t * heads + j) * d..];
                let tables = (j < self.rotated).then(|| (&cos[self.offset * half..], &sin[self.offset * half..]));
                rope_head(src, (d, heads * d), tables, self.interleaved, dst);
            });
        };
        let out = unsafe { overwritten(x.len(), fill) };
        Ok((CpuStorage::F32(out), Shape::from((b, heads, t, d))))
    }
}

/// One head's rows into `dst` (t × d): row ti read from `src[ti · stride..]`, rotated with the
/// tables' rows from its position on (`tables`: cos, sin from the first row's position; `None`:
/// copied, v). See [`QkvRope`].
#[multiversion(targets("x86_64+avx512f+avx512bw", "x86_64+avx2+fma"))]
fn rope_head(
    src: &[f32],
    (d, stride): (usize, usize),
    tables: Option<(&[f32], &[f32])>,
    interleaved: bool,
    dst: &mut [MaybeUninit<f32>],
) {
    let half = d / 2;
    for (ti, o) in dst.chunks_exact_mut(d).enumerate() {
        let row = &src[ti * stride..][..d];
        match tables {
            Some((cos, sin)) => rope_row(row, &cos[ti * half..][..half], &sin[ti * half..][..half], interleaved, o),
            None => o.iter_mut().zip(row).for_each(|(o, &v)| _ = o.write(v)),
        }
    }
}

/// Rows `rows` (flat b·t indices) of a fused q/k/v product's output `y` (those rows × heads·d)
/// rotated and laid out into the packed (b, heads, t, d) tensor at `dst`: [`QkvRope`] at
/// offset 0 on a block of rows (the same expressions, so the same bits), for the bf16 product's
/// epilogue. The first `rotated` heads (q and k) are rotated with the tables `cos`, `sin`.
///
/// # Safety
/// `dst` holds b·heads·t·d values and these rows' entries are written by this call only.
#[multiversion(targets("x86_64+avx512f+avx512bw", "x86_64+avx2+fma"))]
pub(crate) unsafe fn qkv_rope_rows(
    y: &[f32],
    rows: std::ops::Range<usize>,
    (t, heads, d): (usize, usize, usize),
    rotated: usize,
    (cos, sin): (&[f32], &[f32]),
    interleaved: bool,
    dst: &OutPtr,
) {
    let half = d / 2;
    for (r, row) in rows.zip(y.chunks_exact(heads * d)) {
        let (bi, ti) = (r / t, r % t);
        for j in 0..heads {
            let src = &row[j * d..][..d];
            // SAFETY: the caller's promise: this (row, head) entry is ours to write.
            let o = unsafe {
                std::slice::from_raw_parts_mut(dst.at(((bi * heads + j) * t + ti) * d) as *mut MaybeUninit<f32>, d)
            };
            if j < rotated {
                rope_row(src, &cos[ti * half..][..half], &sin[ti * half..][..half], interleaved, o);
            } else {
                o.iter_mut().zip(src).for_each(|(o, &v)| _ = o.write(v));
            }
        }
    }
}

#[inline(always)]
fn rope_row(src: &[f32], c: &[f32], sn: &[f32], interleaved: bool, o: &mut [MaybeUninit<f32>]) {
    let half = c.len();
    if interleaved {
        for i in 0..half {
            let (a, b) = (src[2 * i], src[2 * i + 1]);
            o[2 * i].write(a * c[i] - b * sn[i]);
            o[2 * i + 1].write(a * sn[i] + b * c[i]);
        }
    } else {
        let (lo, hi) = o.split_at_mut(half);
        for i in 0..half {
            let (a, b) = (src[i], src[i + half]);
            lo[i].write(a * c[i] - b * sn[i]);
            hi[i].write(a * sn[i] + b * c[i]);
        }
    }
}

/// q, k and v of a fused projection, rotated and laid out for attention: `qkv` (b, t, H, d) →
/// (b, H, t, d), RoPE (candle_nn's `rope`, or `rope_i` when `interleaved`, bit for bit) applied
/// to the first `rotated` heads at positions offset..offset + t, the rest copied; `cos`, `sin`
/// (max_len, d/2), f32 on the CPU.
pub fn qkv_rope(
    qkv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    rotated: usize,
    offset: usize,
    interleaved: bool,
) -> Result<Tensor> {
    qkv.contiguous()?.apply_op3_no_bwd(
        &cos.contiguous()?,
        &sin.contiguous()?,
        &QkvRope { rotated, offset, interleaved },
    )
}

/// RMSNorm of each row of `src` into `dst` with candle_nn's arithmetic (Σx² summed in order in
/// f32, m = √(Σx²/n + ε), x / m · w), so the bits match `candle_nn::ops::rms_norm`. The sum is a
/// chain of dependent adds; running eight rows' chains side by side hides its latency.
#[multiversion(targets("x86_64+avx512f+avx512bw", "x86_64+avx2+fma"))]
fn rms_rows(src: &[f32], w: &[f32], eps: f32, dst: &mut [MaybeUninit<f32>]) {
    rms_rows_generic(src, w, eps, dst)
}

/// `s` = x + a, then [`rms_rows`] of it into `d`: a chunk of [`AddRmsNorm`].
#[multiversion(targets("x86_64+avx512f+avx512bw", "x86_64+avx2+fma"))]
fn add_rms_rows(x: &[f32], a: &[f32], w: &[f32], eps: f32, s: &mut [MaybeUninit<f32>], d: &mut [MaybeUninit<f32>]) {
    for ((o, &x), &a) in s.iter_mut().zip(x).zip(a) {
        o.write(x + a);
    }
    // SAFETY: every element of `s` was written just above.
    rms_rows_generic(unsafe { assume_written(s) }, w, eps, d)
}

/// s ← r + s in place, then [`rms_rows`] of it into `d`: the epilogue of a bf16 product ending a
/// residual sublayer ([`crate::bf16::Bf16Matrix::matmul_t_add_rms`]); the bits of
/// [`add_rms_rows`] (an f32 sum does not depend on its operands' order).
#[multiversion(targets("x86_64+avx512f+avx512bw", "x86_64+avx2+fma"))]
pub(crate) fn add_rms_rows_in_place(r: &[f32], s: &mut [f32], w: &[f32], eps: f32, d: &mut [MaybeUninit<f32>]) {
    for (o, &r) in s.iter_mut().zip(r) {
        *o += r;
    }
    rms_rows_generic(s, w, eps, d)
}

#[inline(always)]
fn rms_rows_generic(src: &[f32], w: &[f32], eps: f32, dst: &mut [MaybeUninit<f32>]) {
    let n = w.len();
    for (s8, d8) in src.chunks(8 * n).zip(dst.chunks_mut(8 * n)) {
        let rows = s8.len() / n;
        let mut sum = [0f32; 8];
        for i in 0..n {
            for (r, acc) in sum.iter_mut().enumerate().take(rows) {
                let v = s8[r * n + i];
                *acc += v * v;
            }
        }
        for (r, acc) in sum.iter().enumerate().take(rows) {
            let m = (acc / n as f32 + eps).sqrt();
            for ((o, &x), &a) in d8[r * n..(r + 1) * n].iter_mut().zip(&s8[r * n..(r + 1) * n]).zip(w) {
                o.write(x / m * a);
            }
        }
    }
}

/// RMSNorm over the last dim, `candle_nn::ops::rms_norm` bit for bit; rows in parallel.
struct RmsNormOp {
    eps: f32,
}

impl CustomOp2 for RmsNormOp {
    fn name(&self) -> &'static str {
        "onepass-rms-norm"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout, sw: &CpuStorage, lw: &Layout) -> Result<(CpuStorage, Shape)> {
        let (x, w) = (contiguous_f32(s, l, "rms norm: x")?, contiguous_f32(sw, lw, "rms norm: weight")?);
        let n = w.len();
        if l.dims().last() != Some(&n) || n == 0 {
            candle_core::bail!("rms norm: {:?} against a weight of {n}", l.shape());
        }
        // SAFETY (of `overwritten`): rms_rows writes every row of every chunk.
        let out = unsafe {
            overwritten(x.len(), |out| {
                out.par_chunks_mut(8 * n)
                    .zip(x.par_chunks(8 * n))
                    .with_min_len(4)
                    .for_each(|(d, s)| rms_rows(s, w, self.eps, d))
            })
        };
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }
}

/// x + a and RMSNorm(x + a) in one pass: a (2, …) tensor, [sum; normalised].
struct AddRmsNorm {
    eps: f32,
}

impl CustomOp3 for AddRmsNorm {
    fn name(&self) -> &'static str {
        "onepass-add-rms-norm"
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sa: &CpuStorage,
        la: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, a, w) = (
            contiguous_f32(sx, lx, "add + rms norm: x")?,
            contiguous_f32(sa, la, "add + rms norm: a")?,
            contiguous_f32(sw, lw, "add + rms norm: weight")?,
        );
        let n = w.len();
        if lx.shape() != la.shape() || lx.dims().last() != Some(&n) || n == 0 {
            candle_core::bail!("add + rms norm: {:?} + {:?} against a weight of {n}", lx.shape(), la.shape());
        }
        // SAFETY (of `overwritten`): add_rms_rows writes every sum and every normalised row.
        let out = unsafe {
            overwritten(2 * x.len(), |out| {
                let (sum, normed) = out.split_at_mut(x.len());
                sum.par_chunks_mut(8 * n)
                    .zip(normed.par_chunks_mut(8 * n))
                    .zip(x.par_chunks(8 * n).zip(a.par_chunks(8 * n)))
                    .with_min_len(4)
                    .for_each(|((s, d), (x, a))| add_rms_rows(x, a, w, self.eps, s, d))
            })
        };
        let mut dims = vec![2];
        dims.extend_from_slice(lx.dims());
        Ok((CpuStorage::F32(out), Shape::from(dims)))
    }
}

/// RMSNorm over the last dim (candle_nn's `rms_norm`, which it matches bit for bit on the CPU).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
    if x.device().is_cpu() && x.dtype() == DType::F32 && w.dtype() == DType::F32 {
        x.contiguous()?.apply_op2_no_bwd(&w.contiguous()?, &RmsNormOp { eps })
    } else {
        candle_nn::ops::rms_norm(&x.contiguous()?, w, eps)
    }
}

/// (x + a, RMSNorm(x + a)): the residual sum and the next sublayer's input in one pass.
pub fn add_rms_norm(x: &Tensor, a: &Tensor, w: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
    if x.device().is_cpu() && x.dtype() == DType::F32 && a.dtype() == DType::F32 && w.dtype() == DType::F32 {
        let both = x.contiguous()?.apply_op3_no_bwd(&a.contiguous()?, &w.contiguous()?, &AddRmsNorm { eps })?;
        Ok((both.get(0)?, both.get(1)?))
    } else {
        let sum = (x + a)?;
        let normed = candle_nn::ops::rms_norm(&sum.contiguous()?, w, eps)?;
        Ok((sum, normed))
    }
}

/// The plain composition (any device and dtype): grouped scores, [`causal_softmax`], values.
pub fn causal_attention_reference(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    let (b, h, t, d) = q.dims4()?;
    let kv = k.dim(1)?;
    let q = q.contiguous()?.reshape((b, kv, (h / kv) * t, d))?;
    let s = q.matmul(&k.t()?)?;
    let p = causal_softmax(&s, scale, t)?;
    p.matmul(&v.contiguous()?)?.reshape((b, h, t, d))?.transpose(1, 2)?.contiguous()
}

/// Causal grouped-query attention: q (b, h, t, d), k and v (b, kv, t, d) → (b, t, h, d).
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    if q.device().is_cpu() && q.dtype() == DType::F32 {
        q.contiguous()?.apply_op3_no_bwd(&k.contiguous()?, &v.contiguous()?, &CausalAttention { scale: scale as f32 })
    } else {
        causal_attention_reference(q, k, v, scale)
    }
}

/// silu(gate) · up for `x` = [gate | up] along the last dim: (…, 2i) → (…, i).
struct SiluMul;

impl CustomOp1 for SiluMul {
    fn name(&self) -> &'static str {
        "onepass-silu-mul"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(src) = storage else {
            candle_core::bail!("silu·mul: expected f32, got {:?}", storage.dtype());
        };
        let Some((o1, o2)) = layout.contiguous_offsets() else {
            candle_core::bail!("silu·mul: expected a contiguous input");
        };
        let src = &src[o1..o2];
        let mut dims = layout.shape().dims().to_vec();
        let two = *dims.last().unwrap_or(&0);
        if !two.is_multiple_of(2) || two == 0 {
            candle_core::bail!("silu·mul: last dim {two} is not even");
        }
        let i = two / 2;
        let mut dst = vec![0f32; src.len() / 2];
        dst.par_chunks_mut(i).zip(src.par_chunks(two)).with_min_len(MIN_ROWS).for_each(|(d, s)| silu_mul_row(s, d));
        *dims.last_mut().expect("non-empty") = i;
        Ok((CpuStorage::F32(dst), Shape::from(dims)))
    }
}

/// silu(g)·u of one row [g | u] into `d` (half its length): candle's silu, x / (1 + e^−x), with
/// [`exp_in_place`]'s e^x.
#[multiversion(targets("x86_64+avx512f+avx512bw", "x86_64+avx2+fma"))]
pub(crate) fn silu_mul_row(s: &[f32], d: &mut [f32]) {
    let (g, u) = s.split_at(d.len());
    for (o, &g) in d.iter_mut().zip(g) {
        *o = -g;
    }
    exp_generic(d);
    for ((o, &g), &u) in d.iter_mut().zip(g).zip(u) {
        *o = g / (1.0 + *o) * u;
    }
}

/// The plain composition.
pub fn silu_mul_reference(x: &Tensor) -> Result<Tensor> {
    let last = x.rank() - 1;
    let i = x.dim(last)? / 2;
    x.narrow(last, 0, i)?.silu()? * x.narrow(last, i, i)?
}

/// silu(gate) · up for `x` = [gate | up] along the last dim.
pub fn silu_mul(x: &Tensor) -> Result<Tensor> {
    if x.device().is_cpu() && x.dtype() == DType::F32 {
        x.contiguous()?.apply_op1_no_bwd(&SiluMul)
    } else {
        silu_mul_reference(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn max_abs(a: &Tensor, b: &Tensor) -> f32 {
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
    }

    #[test]
    fn fast_exp_matches_libm() {
        // A dense sweep of the range that matters plus the ends.
        let mut xs: Vec<f32> = (0..200_001).map(|i| -100.0 + i as f32 * 0.00095).collect();
        xs.extend([f32::NEG_INFINITY, -87.0, -1e-30, 0.0, 1e-30, 88.0, 88.72, 1e30, f32::INFINITY]);
        let mut got = xs.clone();
        exp_in_place(&mut got);
        let mut generic = xs.clone();
        exp_generic(&mut generic);
        for ((&x, &g), &h) in xs.iter().zip(&got).zip(&generic) {
            let want = (x as f64).exp();
            if want > f32::MAX as f64 {
                assert_eq!(g, f32::INFINITY, "exp({x})");
                continue;
            }
            let tol = 3e-7 * want + if want < 2e-38 { 2e-38 } else { 0.0 };
            assert!(((g as f64) - want).abs() <= tol, "exp({x}) = {g}, want {want}");
            assert_eq!(g.to_bits(), h.to_bits(), "the SIMD copy differs from the generic one at {x}");
        }
        // The generic body is what runs everywhere else; break it and this fails.
        let mut one = [1.0f32];
        exp_in_place(&mut one);
        assert!((one[0] - std::f32::consts::E).abs() < 1e-6);
    }

    /// The interleaved rows give the bits of a plain per-row softmax (max, exp, sum in key
    /// order), block sizes around the 8-row groups; a negative control: summing the row in
    /// another order changes some bits.
    #[test]
    fn causal_softmax_rows_match_a_per_row_fold() {
        let plain = |sc: &mut [f32], n: usize, i0: usize, scale: f32| {
            for (r, row) in sc.chunks_exact_mut(n).enumerate() {
                let (live, dead) = row.split_at_mut(i0 + r + 1);
                let max = live.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                live.iter_mut().for_each(|x| *x = (*x - max) * scale);
                exp_generic(live);
                let inv = 1.0 / live.iter().sum::<f32>();
                live.iter_mut().for_each(|x| *x *= inv);
                dead.fill(0.0);
            }
        };
        let mut reversed_differs = false;
        for (m, i0) in [(1, 0), (7, 0), (8, 0), (13, 5), (64, 64), (37, 200)] {
            let n = i0 + m;
            let x = Tensor::randn(0f32, 3.0, m * n, &Device::Cpu).unwrap().to_vec1::<f32>().unwrap();
            let (mut got, mut want) = (x.clone(), x.clone());
            causal_softmax_rows(&mut got, n, i0, 0.125);
            plain(&mut want, n, i0, 0.125);
            assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "m {m}, i0 {i0}");
            for (r, row) in x.chunks_exact(n).enumerate() {
                let live = &row[..i0 + r + 1];
                let forward: f32 = live.iter().sum();
                let backward: f32 = live.iter().rev().sum();
                reversed_differs |= forward.to_bits() != backward.to_bits();
            }
        }
        assert!(reversed_differs, "the order of an f32 sum should show in its bits");
    }

    #[test]
    fn causal_softmax_matches_the_masked_composition() {
        let dev = Device::Cpu;
        for (b, groups, t) in [(2, 3, 7), (1, 1, 1), (3, 2, 33)] {
            let s = (Tensor::randn(0f32, 3.0, (b, 2, groups * t, t), &dev).unwrap()).contiguous().unwrap();
            let fast = causal_softmax(&s, 0.125, t).unwrap();
            let slow = causal_softmax_reference(&s, 0.125, t).unwrap();
            assert!(max_abs(&fast, &slow) < 1e-6, "b {b} groups {groups} t {t}");
            // Rows sum to one and nothing above the diagonal leaks.
            let v = fast.reshape((b * 2 * groups * t, t)).unwrap().to_vec2::<f32>().unwrap();
            for (r, row) in v.iter().enumerate() {
                let p = r % t;
                assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-5);
                assert!(row[p + 1..].iter().all(|&x| x == 0.0), "row {r} sees the future");
            }
        }
        let bad = Tensor::zeros((2, 5, 4), DType::F32, &Device::Cpu).unwrap();
        assert!(causal_softmax(&bad, 1.0, 4).is_err(), "5 rows are not a multiple of t = 4");
    }

    #[test]
    fn causal_attention_matches_the_composition() {
        let dev = Device::Cpu;
        // t not a multiple of the query block, GQA 6/2, and plain multi-head.
        for (b, h, kv, t, d) in [(2, 6, 2, 150, 16), (1, 4, 4, 64, 8), (3, 3, 1, 5, 4), (1, 2, 1, 1, 2)] {
            let q = Tensor::randn(0f32, 1.0, (b, h, t, d), &dev).unwrap();
            let k = Tensor::randn(0f32, 1.0, (b, kv, t, d), &dev).unwrap();
            let v = Tensor::randn(0f32, 1.0, (b, kv, t, d), &dev).unwrap();
            let fast = causal_attention(&q, &k, &v, 0.3).unwrap();
            assert_eq!(fast.dims(), &[b, t, h, d]);
            // An independent reference: each head on its own, its key/value head repeated,
            // with a −∞ mask and softmax_last_dim.
            let rep = h / kv;
            let mask: Vec<f32> =
                (0..t).flat_map(|i| (0..t).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY })).collect();
            let mask = Tensor::from_vec(mask, (t, t), &dev).unwrap();
            for head in 0..h {
                let qh = q.narrow(1, head, 1).unwrap().squeeze(1).unwrap();
                let kh = k.narrow(1, head / rep, 1).unwrap().squeeze(1).unwrap();
                let vh = v.narrow(1, head / rep, 1).unwrap().squeeze(1).unwrap();
                let s = (qh.matmul(&kh.t().unwrap()).unwrap() * 0.3).unwrap().broadcast_add(&mask).unwrap();
                let want = candle_nn::ops::softmax_last_dim(&s).unwrap().matmul(&vh).unwrap();
                let got = fast.narrow(2, head, 1).unwrap().squeeze(2).unwrap();
                assert!(max_abs(&got, &want) < 1e-5, "b {b} h {h} kv {kv} t {t} head {head}");
            }
            let slow = causal_attention_reference(&q, &k, &v, 0.3).unwrap();
            assert!(max_abs(&fast, &slow) < 1e-5);
        }
        let q = Tensor::zeros((1, 3, 4, 2), DType::F32, &dev).unwrap();
        let k = Tensor::zeros((1, 2, 4, 2), DType::F32, &dev).unwrap();
        assert!(causal_attention(&q, &k, &k, 1.0).is_err(), "3 query heads over 2 kv heads");
    }

    #[test]
    fn silu_mul_matches_the_composition() {
        let x = Tensor::randn(0f32, 4.0, (3, 5, 2 * 37), &Device::Cpu).unwrap();
        let fast = silu_mul(&x).unwrap();
        assert_eq!(fast.dims(), &[3, 5, 37]);
        assert!(max_abs(&fast, &silu_mul_reference(&x).unwrap()) < 1e-5);
        let odd = Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap();
        assert!(silu_mul(&odd).is_err());
    }

    fn same_bits(a: &Tensor, b: &Tensor) -> bool {
        let (a, b) =
            (a.flatten_all().unwrap().to_vec1::<f32>().unwrap(), b.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        a.len() == b.len() && a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits())
    }

    /// The fused norms give candle_nn's bits (so the f32 path's φ did not move), for row counts
    /// around the 8-row interleave.
    #[test]
    fn fused_norms_match_candle_bit_for_bit() {
        let dev = Device::Cpu;
        let w = Tensor::randn(1f32, 0.3, 40, &dev).unwrap();
        for rows in [1, 7, 8, 9, 23, 300] {
            let x = Tensor::randn(0f32, 2.0, (rows, 40), &dev).unwrap();
            let a = Tensor::randn(0f32, 1.0, (rows, 40), &dev).unwrap();
            let want = candle_nn::ops::rms_norm(&x, &w, 1e-5).unwrap();
            assert!(same_bits(&rms_norm(&x, &w, 1e-5).unwrap(), &want), "rows {rows}");
            let sum = (&x + &a).unwrap();
            let (s, n) = add_rms_norm(&x, &a, &w, 1e-5).unwrap();
            assert!(same_bits(&s, &sum));
            assert!(same_bits(&n, &candle_nn::ops::rms_norm(&sum, &w, 1e-5).unwrap()), "rows {rows}");
            // Negative control: another ε changes the bits.
            assert!(!same_bits(&rms_norm(&x, &w, 1e-2).unwrap(), &want));
        }
    }

    /// qkv_rope = split, candle_nn's rope (both layouts) on q and k at an offset, v untouched.
    #[test]
    fn qkv_rope_matches_candle_rope() {
        let dev = Device::Cpu;
        let (b, t, h, kv, d, max_len) = (2, 5, 6, 2, 8, 12);
        let qkv = Tensor::randn(0f32, 1.0, (b, t, h + 2 * kv, d), &dev).unwrap();
        let cos = Tensor::randn(0f32, 1.0, (max_len, d / 2), &dev).unwrap();
        let sin = Tensor::randn(0f32, 1.0, (max_len, d / 2), &dev).unwrap();
        for interleaved in [false, true] {
            for offset in [0, 3] {
                let got = qkv_rope(&qkv, &cos, &sin, h + kv, offset, interleaved).unwrap();
                assert_eq!(got.dims(), &[b, h + 2 * kv, t, d]);
                let (c, s) = (cos.narrow(0, offset, t).unwrap(), sin.narrow(0, offset, t).unwrap());
                let rot = |x: &Tensor| {
                    let x = x.transpose(1, 2).unwrap().contiguous().unwrap();
                    if interleaved {
                        candle_nn::rotary_emb::rope_i(&x, &c, &s).unwrap()
                    } else {
                        candle_nn::rotary_emb::rope(&x, &c, &s).unwrap()
                    }
                };
                let q = rot(&qkv.narrow(2, 0, h + kv).unwrap());
                assert!(same_bits(&got.narrow(1, 0, h + kv).unwrap(), &q), "interleaved {interleaved} offset {offset}");
                let v = qkv.narrow(2, h + kv, kv).unwrap().transpose(1, 2).unwrap();
                assert!(same_bits(&got.narrow(1, h + kv, kv).unwrap(), &v));
                // The attention over the packed tensor equals the one over separate q, k, v.
                let packed = causal_attention_packed(&got, h, kv, 0.3).unwrap();
                let sep = causal_attention(
                    &got.narrow(1, 0, h).unwrap(),
                    &got.narrow(1, h, kv).unwrap(),
                    &got.narrow(1, h + kv, kv).unwrap(),
                    0.3,
                )
                .unwrap();
                assert!(same_bits(&packed, &sep));
            }
        }
        // The other layout rotates different pairs: a negative control.
        let a = qkv_rope(&qkv, &cos, &sin, h + kv, 0, false).unwrap();
        let b2 = qkv_rope(&qkv, &cos, &sin, h + kv, 0, true).unwrap();
        assert!(!same_bits(&a, &b2));
    }
}
