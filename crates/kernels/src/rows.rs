//! Fused row kernels of the forward pass (f32 activations): the causal softmax, attention, RoPE
//! with the attention layout, RMSNorm (alone and after a residual add) and SwiGLU's silu(g)·u,
//! each behind a safe entry point that takes and returns plain slices. `features::ops` wraps them
//! as candle custom ops; the bits match candle's compositions, which its tests check.
//!
//! candle 0.11 runs unary ops (silu, scaling) on one core and materialises every intermediate, so
//! on a 2-core CPU the attention mask/scale/softmax chain and the MLP's silu·up were ~15% of a
//! SmolLM2 forward pass next to the (multi-threaded) matmuls. These kernels work row by row on
//! rayon's pool.

use crate::buf::{assume_written, overwritten, OutPtr};
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

/// softmax(scale · s) over the last dim of `src` with a causal mask: rows of `t` scores are query
/// positions grouped as (…, groups · t, t), so that row `r` is position `r mod t` and sees keys
/// `0..=r mod t` (grouped-query attention stacks the query heads of one key/value head). Row by
/// row on rayon's pool; masked entries are 0.
///
/// # Panics
/// If `src.len()` is not a multiple of `t` (callers check the shape first).
pub fn causal_softmax(src: &[f32], t: usize, scale: f32) -> Vec<f32> {
    assert!(t > 0 && src.len().is_multiple_of(t), "causal softmax: {} scores are not rows of {t}", src.len());
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
    dst
}

/// Query rows per attention task: a block of rows sees only keys up to its last row, so the
/// causal half of the score matrix is mostly never computed (10/16 of it at t = 256).
const Q_BLOCK: usize = 64;

/// Causal attention softmax(scale · q kᵀ) v for q (b, h, t, d) and k, v (b, kv, t, d), query head
/// `j` reading key/value head `j / (h / kv)`; the output is (b, t, h, d), the layout the output
/// projection reads. One rayon task per (batch row, head, block of query rows), each calling
/// single-threaded gemm for its two products.
///
/// # Panics
/// If the slices are shorter than those shapes say, or `kv` does not divide `h`.
pub fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    (b, h, kv, t, d): (usize, usize, usize, usize, usize),
    scale: f32,
) -> Vec<f32> {
    assert!(kv > 0 && h.is_multiple_of(kv), "attention: {h} query heads over {kv} key/value heads");
    assert!(
        q.len() >= b * h * t * d && k.len() >= b * kv * t * d && v.len() >= b * kv * t * d,
        "attention: short inputs"
    );
    attend(
        (b, h, kv, t, d),
        scale,
        |bi, head| &q[(bi * h + head) * t * d..],
        |bi, g| &k[(bi * kv + g) * t * d..],
        |bi, g| &v[(bi * kv + g) * t * d..],
    )
}

/// [`attention`] reading q, k and v from one packed (b, h + 2·kv, t, d) buffer (what
/// [`qkv_rope`] writes): query heads first, then the key heads, then the value heads.
///
/// # Panics
/// As [`attention`].
pub fn attention_packed(x: &[f32], (b, h, kv, t, d): (usize, usize, usize, usize, usize), scale: f32) -> Vec<f32> {
    assert!(kv > 0 && h.is_multiple_of(kv), "attention: {h} query heads over {kv} key/value heads");
    let heads = h + 2 * kv;
    assert!(x.len() >= b * heads * t * d, "attention: short input");
    let at = |bi: usize, j: usize| &x[(bi * heads + j) * t * d..];
    attend((b, h, kv, t, d), scale, |bi, j| at(bi, j), |bi, g| at(bi, h + g), |bi, g| at(bi, h + kv + g))
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

/// The core of [`attention`] and [`attention_packed`]: `q(bi, head)`, `k(bi, g)` and
/// `v(bi, g)` give the (t, d) rows of query head `head` and key/value head `g` of batch row `bi`;
/// the result is (b, t, h, d).
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

/// q, k and v of a fused projection, rotated and laid out for attention: `x` (b, t, H, d) → (b, H,
/// t, d), RoPE applied to the first `rotated` heads (q and k) at positions offset..offset + t, the
/// rest (v) copied; `cos`, `sin` are (max_len, d/2) tables. The rotation is candle_nn's `rope`
/// (rotate-half) or `rope_i` (interleaved pairs, `interleaved`), expression for expression, so
/// the bits match the composition.
///
/// # Panics
/// If `d` is odd, the tables are shorter than offset + t rows, or `rotated` exceeds H.
pub fn qkv_rope(
    x: &[f32],
    (b, t, heads, d): (usize, usize, usize, usize),
    rotated: usize,
    offset: usize,
    (cos, sin): (&[f32], &[f32]),
    interleaved: bool,
) -> Vec<f32> {
    let half = d / 2;
    assert!(d.is_multiple_of(2) && rotated <= heads && x.len() == b * t * heads * d, "qkv rope: shapes");
    assert!(cos.len() >= (offset + t) * half && sin.len() == cos.len(), "qkv rope: tables too short");
    // SAFETY (of `overwritten`): every (row, head) chunk is written in full below.
    let fill = |out: &mut [MaybeUninit<f32>]| {
        out.par_chunks_mut(t * d).enumerate().for_each(|(bj, dst)| {
            let (bi, j) = (bj / heads, bj % heads);
            // Head j of batch row bi: rows at a stride of heads·d in x.
            let src = &x[(bi * t * heads + j) * d..];
            let tables = (j < rotated).then(|| (&cos[offset * half..], &sin[offset * half..]));
            rope_head(src, (d, heads * d), tables, interleaved, dst);
        });
    };
    unsafe { overwritten(x.len(), fill) }
}

/// One head's rows into `dst` (t × d): row ti read from `src[ti · stride..]`, rotated with the
/// tables' rows from its position on (`tables`: cos, sin from the first row's position; `None`:
/// copied, v). See [`qkv_rope`].
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
/// rotated and laid out into the packed (b, heads, t, d) tensor at `dst`: [`qkv_rope`] at
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

/// RMSNorm over rows of `w.len()` values, `candle_nn::ops::rms_norm` bit for bit; rows in
/// parallel.
///
/// # Panics
/// If `w` is empty or `x.len()` is not a multiple of its length.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let n = w.len();
    assert!(n > 0 && x.len().is_multiple_of(n), "rms norm: {} values against a weight of {n}", x.len());
    // SAFETY (of `overwritten`): rms_rows writes every row of every chunk.
    unsafe {
        overwritten(x.len(), |out| {
            out.par_chunks_mut(8 * n).zip(x.par_chunks(8 * n)).with_min_len(4).for_each(|(d, s)| rms_rows(s, w, eps, d))
        })
    }
}

/// x + a and RMSNorm(x + a) in one pass: one buffer of twice x's length, [sum; normalised].
///
/// # Panics
/// As [`rms_norm`], or if `a` is not as long as `x`.
pub fn add_rms_norm(x: &[f32], a: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let n = w.len();
    assert!(n > 0 && x.len().is_multiple_of(n) && a.len() == x.len(), "add + rms norm: shapes");
    // SAFETY (of `overwritten`): add_rms_rows writes every sum and every normalised row.
    unsafe {
        overwritten(2 * x.len(), |out| {
            let (sum, normed) = out.split_at_mut(x.len());
            sum.par_chunks_mut(8 * n)
                .zip(normed.par_chunks_mut(8 * n))
                .zip(x.par_chunks(8 * n).zip(a.par_chunks(8 * n)))
                .with_min_len(4)
                .for_each(|((s, d), (x, a))| add_rms_rows(x, a, w, eps, s, d))
        })
    }
}

/// RMSNorm of each row of `src` into `dst` with candle_nn's arithmetic (Σx² summed in order in
/// f32, m = √(Σx²/n + ε), x / m · w), so the bits match `candle_nn::ops::rms_norm`. The sum is a
/// chain of dependent adds; running eight rows' chains side by side hides its latency.
#[multiversion(targets("x86_64+avx512f+avx512bw", "x86_64+avx2+fma"))]
fn rms_rows(src: &[f32], w: &[f32], eps: f32, dst: &mut [MaybeUninit<f32>]) {
    rms_rows_generic(src, w, eps, dst)
}

/// `s` = x + a, then [`rms_rows`] of it into `d`: a chunk of [`add_rms_norm`].
#[multiversion(targets("x86_64+avx512f+avx512bw", "x86_64+avx2+fma"))]
fn add_rms_rows(x: &[f32], a: &[f32], w: &[f32], eps: f32, s: &mut [MaybeUninit<f32>], d: &mut [MaybeUninit<f32>]) {
    for ((o, &x), &a) in s.iter_mut().zip(x).zip(a) {
        o.write(x + a);
    }
    // SAFETY: every element of `s` was written just above.
    rms_rows_generic(unsafe { assume_written(s) }, w, eps, d)
}

/// s ← r + s in place, then [`rms_rows`] of it into `d`: the epilogue of a bf16 product ending a
/// residual sublayer ([`crate::packed::PackedMatrix::matmul_t_add_rms`]); the bits of
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

/// silu(gate) · up for rows of `2·i` values [gate | up] → rows of `i`, in parallel.
///
/// # Panics
/// If `i` is 0 or `src.len()` is not a multiple of 2·i.
pub fn silu_mul(src: &[f32], i: usize) -> Vec<f32> {
    assert!(i > 0 && src.len().is_multiple_of(2 * i), "silu·mul: {} values are not rows of 2·{i}", src.len());
    let mut dst = vec![0f32; src.len() / 2];
    dst.par_chunks_mut(i).zip(src.par_chunks(2 * i)).with_min_len(MIN_ROWS).for_each(|(d, s)| silu_mul_row(s, d));
    dst
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

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn normal(n: usize, seed: u64, sd: f32) -> Vec<f32> {
        // Box–Muller on a seeded stream: the tests' inputs, reproducible.
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n)
            .map(|_| {
                let (u, v): (f32, f32) = (r.random::<f32>().max(1e-12), r.random());
                sd * (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
            })
            .collect()
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
            let x = normal(m * n, (m * 1000 + i0) as u64, 3.0);
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
}
