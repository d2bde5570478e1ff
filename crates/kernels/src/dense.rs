//! Dense products of the training path, in f32 and f64: one call of the `gemm` crate (candle's
//! CPU matmul, so the same results for the same shapes) per product, written straight into the
//! caller's buffer or into fresh memory, on the calling thread or split over rayon's pool.
//! Operands are slices viewed at row and column strides ([`Mat`], so a transpose is a view);
//! every entry point checks that the views and the destination hold the shapes it is given, so
//! the `unsafe` of the gemm call stays here.

use num_traits::Float;

/// A matrix in a slice: its values and its row and column strides (so a transpose is a view).
#[derive(Clone, Copy)]
pub struct Mat<'a, T> {
    x: &'a [T],
    rs: usize,
    cs: usize,
}

impl<'a, T> Mat<'a, T> {
    /// Row-major (·, cols).
    pub fn rows(x: &'a [T], cols: usize) -> Mat<'a, T> {
        Mat { x, rs: cols, cs: 1 }
    }

    /// The transpose of row-major (·, cols).
    pub fn t(x: &'a [T], cols: usize) -> Mat<'a, T> {
        Mat { x, rs: 1, cs: cols }
    }

    /// Panics unless the view holds an r × c matrix: its last element (r − 1, c − 1) is in the
    /// slice (a matrix with no element reads nothing).
    fn check(&self, r: usize, c: usize, what: &str) {
        if r > 0 && c > 0 {
            let last = (r - 1) * self.rs + (c - 1) * self.cs;
            assert!(
                last < self.x.len(),
                "{what}: a {r} × {c} view at strides ({}, {}) of {} values",
                self.rs,
                self.cs,
                self.x.len()
            );
        }
    }
}

/// dst (m × n, row-major) = c · a (m × k) · b (k × n), or with `add` dst += c · a · b; on the
/// calling thread (`threads` ≤ 1: an op that runs one product per rayon task) or split over
/// `threads` of rayon's pool, as candle's matmul does. dst is read only with `add` (its first
/// m × n values; it may be longer).
pub fn mm_into<T: Float + 'static>(
    (m, n, k): (usize, usize, usize),
    dst: &mut [T],
    a: Mat<'_, T>,
    b: Mat<'_, T>,
    c: T,
    threads: usize,
    add: bool,
) {
    assert!(dst.len() >= m * n, "mm: {} values for a {m} × {n} product", dst.len());
    a.check(m, k, "mm's left operand");
    b.check(k, n, "mm's right operand");
    // SAFETY: dst holds m × n initialised values (row-major, strides (n, 1)), a and b hold the
    // m × k and k × n matrices at their strides (checked above).
    unsafe { gemm_raw((m, n, k), dst.as_mut_ptr(), (n as isize, 1), a, b, c, threads, add) }
}

/// dst (m × n, row-major) = c · a · b on the calling thread.
pub fn mm<T: Float + 'static>(m: usize, n: usize, k: usize, dst: &mut [T], a: Mat<'_, T>, b: Mat<'_, T>, c: T) {
    mm_into((m, n, k), dst, a, b, c, 1, false)
}

/// dst (m × n, row-major, initialised) += c · a · b on the calling thread.
pub fn mm_acc<T: Float + 'static>(m: usize, n: usize, k: usize, dst: &mut [T], a: Mat<'_, T>, b: Mat<'_, T>, c: T) {
    mm_into((m, n, k), dst, a, b, c, 1, true)
}

/// c · a · b (m × n) in fresh memory on `threads` of rayon's pool, row-major or (`transposed`)
/// as its n × m transpose — written straight into the new buffer: no zero fill first (candle's
/// matmul clears its output, then `gemm` overwrites it) and no copy after. With k = 0 the
/// product is zero.
pub fn product<T: Float + 'static>(
    (m, n, k): (usize, usize, usize),
    a: Mat<'_, T>,
    b: Mat<'_, T>,
    c: T,
    threads: usize,
    transposed: bool,
) -> Vec<T> {
    let len = m * n;
    if k == 0 {
        return vec![T::zero(); len];
    }
    a.check(m, k, "product's left operand");
    b.check(k, n, "product's right operand");
    let strides = if transposed { (1, m as isize) } else { (n as isize, 1) };
    let mut out: Vec<T> = Vec::with_capacity(len);
    // SAFETY: `out` has capacity for m × n values, which gemm writes (every one: dst is not read
    // and k > 0; element (i, j) at i·rs + j·cs) before the length covers them; `a` and `b` hold
    // their matrices (checked above).
    unsafe {
        gemm_raw((m, n, k), out.as_mut_ptr(), strides, a, b, c, threads, false);
        out.set_len(len);
    }
    out
}

/// dst (m × n at row and column strides `(rs, cs)`) = c · a · b, or += with `add`: one gemm call
/// (gemm computes dst = α·dst + β·a·b, reading dst only when asked to).
///
/// # Safety
/// `dst` must be valid for m × n writes at those strides (initialised when `add`), `a` and `b`
/// must hold m × k and k × n matrices at their strides.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_raw<T: Float + 'static>(
    (m, n, k): (usize, usize, usize),
    dst: *mut T,
    (rs, cs): (isize, isize),
    a: Mat<'_, T>,
    b: Mat<'_, T>,
    c: T,
    threads: usize,
    add: bool,
) {
    let par = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    let alpha = if add { T::one() } else { T::zero() };
    let (ap, bp) = (a.x.as_ptr(), b.x.as_ptr());
    let (ars, acs, brs, bcs) = (a.rs as isize, a.cs as isize, b.rs as isize, b.cs as isize);
    // SAFETY: the caller's contract.
    unsafe { gemm::gemm(m, n, k, dst, cs, rs, add, ap, acs, ars, bp, bcs, brs, alpha, c, false, false, false, par) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn draw(n: usize, seed: u64) -> Vec<f64> {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| r.random_range(-1.0..1.0)).collect()
    }

    /// c · a · b by the definition, a (m × k) and b (k × n) given by element functions.
    fn naive(
        m: usize,
        n: usize,
        k: usize,
        a: impl Fn(usize, usize) -> f64,
        b: impl Fn(usize, usize) -> f64,
        c: f64,
    ) -> Vec<f64> {
        (0..m * n).map(|i| c * (0..k).map(|l| a(i / n, l) * b(l, i % n)).sum::<f64>()).collect()
    }

    fn close(a: &[f64], b: &[f64]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-12)
    }

    /// Every entry point against the definition, with the operands as rows and as transposed
    /// views, in place and in fresh memory (row-major and transposed), on one thread and on two;
    /// negative control: the operands' views swapped (a row-major read of a transposed matrix)
    /// give other values.
    #[test]
    fn products_match_the_definition() {
        let (m, n, k, c) = (7, 5, 9, 0.75);
        // a (m × k) stored row-major; b (k × n) stored as its transpose (n × k), row-major
        let (a, bt) = (draw(m * k, 1), draw(n * k, 2));
        let want = naive(m, n, k, |i, l| a[i * k + l], |l, j| bt[j * k + l], c);
        let mut dst = vec![f64::NAN; m * n];
        mm(m, n, k, &mut dst, Mat::rows(&a, k), Mat::t(&bt, k), c);
        assert!(close(&dst, &want), "mm");
        let base = draw(m * n, 3);
        let mut acc = base.clone();
        mm_acc(m, n, k, &mut acc, Mat::rows(&a, k), Mat::t(&bt, k), c);
        let plus: Vec<f64> = base.iter().zip(&want).map(|(x, y)| x + y).collect();
        assert!(close(&acc, &plus), "mm_acc");
        for threads in [1, 2] {
            let mut acc = base.clone();
            mm_into((m, n, k), &mut acc, Mat::rows(&a, k), Mat::t(&bt, k), c, threads, true);
            assert!(close(&acc, &plus), "mm_into, {threads} threads");
            let p = product((m, n, k), Mat::rows(&a, k), Mat::t(&bt, k), c, threads, false);
            assert!(close(&p, &want), "product, {threads} threads");
            let pt = product((m, n, k), Mat::rows(&a, k), Mat::t(&bt, k), c, threads, true);
            let tr: Vec<f64> = (0..n * m).map(|i| want[(i % m) * n + i / m]).collect();
            assert!(close(&pt, &tr), "transposed product, {threads} threads");
        }
        assert_eq!(product((m, n, 0), Mat::rows(&a, 0), Mat::rows(&bt, n), c, 1, false), vec![0.0; m * n]);
        // a stored as its transpose (k × m, row-major) and read through a transposed view
        let at: Vec<f64> = (0..k * m).map(|i| a[(i % m) * k + i / m]).collect();
        let mut again = vec![0.0; m * n];
        mm(m, n, k, &mut again, Mat::t(&at, m), Mat::t(&bt, k), c);
        assert!(close(&again, &want), "a transposed left operand");
        // negative control: b read row-major (as k × n) where it is stored as its transpose
        let wrong = product((m, n, k), Mat::rows(&a, k), Mat::rows(&bt, n), c, 1, false);
        assert!(!close(&wrong, &want), "negative control: the views' strides are invisible");
    }

    /// A view too short for the shape it is given is refused.
    #[test]
    #[should_panic(expected = "right operand")]
    fn a_short_operand_panics() {
        let (a, b) = (vec![1.0f32; 6], vec![1.0f32; 5]);
        let mut dst = vec![0.0f32; 4];
        mm(2, 2, 3, &mut dst, Mat::rows(&a, 3), Mat::rows(&b, 2), 1.0);
    }
}
