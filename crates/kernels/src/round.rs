//! f32 → bf16 rounding (round to nearest even, subnormals to zero), and rows of a product's
//! input rounded into words of two bf16: what the bf16 product ([`crate::bf16`]) and the AMX
//! tiles ([`crate::amx`]) share.

use crate::packed::Rows;

/// f32 → bf16 bits, rounding to nearest even (as PyTorch, `half` and `VCVTNE2PS2BF16` do);
/// subnormals become ±0 (the dot-product instruction would treat them as 0 anyway), NaN stays a
/// quiet NaN, values past the largest bf16 become ±∞.
#[inline(always)]
pub fn to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    // Adding 0x7fff plus the lowest kept bit rounds half to even; a carry into the exponent is the
    // correct rounding up to the next binade (or to ∞). Written with selects, no branches, so
    // that packing a row of activations vectorises.
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    let quiet_nan = (b >> 16) | 0x40;
    let signed_zero = (b >> 16) & 0x8000;
    let r = if b & 0x7fff_ffff > 0x7f80_0000 {
        quiet_nan
    } else if b & 0x7f80_0000 == 0 {
        signed_zero
    } else {
        rounded
    };
    r as u16
}

/// bf16 bits → f32 (exact).
#[inline(always)]
pub fn from_bf16(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// Row `i` of a product's input (x's row, or silu(g)·u formed in `row`) rounded into `w`, words
/// of two bf16 ([`round_pairs`]): how the bf16 product and the AMX tiles pack their input.
pub(crate) fn round_row(x: Rows, i: usize, k: usize, row: &mut Vec<f32>, w: &mut [u32]) {
    match x {
        Rows::Plain(x) => round_pairs(&x[i * k..][..k], w),
        Rows::SiluMul(gu) => {
            row.resize(k, 0.0);
            crate::rows::silu_mul_row(&gu[i * 2 * k..][..2 * k], row);
            round_pairs(row, w);
        }
    }
}

/// A row of f32 into words of two bf16 (low: the even input), an odd last input alone.
/// Compiled for AVX-512 and AVX2 as well, chosen at run time (the baseline's SSE copy was ~6% of
/// a bf16 forward pass).
#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw", "x86_64+avx2"))]
fn round_pairs(row: &[f32], words: &mut [u32]) {
    round_pairs_generic(row, words)
}

#[inline(always)]
fn round_pairs_generic(row: &[f32], words: &mut [u32]) {
    for (pair, w) in row.chunks_exact(2).zip(words.iter_mut()) {
        *w = to_bf16(pair[0]) as u32 | ((to_bf16(pair[1]) as u32) << 16);
    }
    if row.len() % 2 == 1 {
        words[row.len() / 2] = to_bf16(row[row.len() - 1]) as u32;
    }
}
