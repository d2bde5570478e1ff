//! Dense kernels on plain slices, and a packed symmetric matrix with Sherman–Morrison updates.
//!
//! Every reduction accumulates in a fixed number of lanes and folds them in a fixed order, so
//! results are bit-identical whatever the CPU: the AVX2 copies chosen at run time are the same
//! Rust code compiled with wider registers (Rust never contracts `a * b + c` into an FMA), and
//! `tests::dispatch_is_bitwise_identical` checks that.

/// Lanes of every accumulator (16 f32 = two AVX2 registers; 8 f64 = two).
const L32: usize = 16;
const L64: usize = 8;

/// Defines `pub fn $name` that runs `$body` compiled for AVX2 when the CPU has it.
macro_rules! dispatched {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$m])*
        #[inline]
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn generic($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? { generic($($arg),*) }
                if std::arch::is_x86_feature_detected!("avx2") && !force_generic() {
                    // SAFETY: the CPU supports AVX2, checked just above.
                    return unsafe { avx2($($arg),*) };
                }
            }
            generic($($arg),*)
        }
    };
}

#[cfg(test)]
thread_local!(static FORCE_GENERIC: std::cell::Cell<bool> = const { std::cell::Cell::new(false) });
#[cfg(test)]
#[inline]
fn force_generic() -> bool {
    FORCE_GENERIC.with(|f| f.get())
}
#[cfg(not(test))]
#[inline(always)]
fn force_generic() -> bool {
    false
}

#[inline(always)]
fn fold32(acc: [f32; L32]) -> f32 {
    let mut a = acc;
    let mut w = L32 / 2;
    while w > 0 {
        for k in 0..w {
            a[k] += a[k + w];
        }
        w /= 2;
    }
    a[0]
}

#[inline(always)]
fn fold64(acc: [f64; L64]) -> f64 {
    let mut a = acc;
    let mut w = L64 / 2;
    while w > 0 {
        for k in 0..w {
            a[k] += a[k + w];
        }
        w /= 2;
    }
    a[0]
}

dispatched! {
    /// Σ aᵢbᵢ in f32.
    pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        let mut acc = [0f32; L32];
        let (ca, cb) = (a.chunks_exact(L32), b.chunks_exact(L32));
        let (ra, rb) = (ca.remainder(), cb.remainder());
        for (x, y) in ca.zip(cb) {
            for k in 0..L32 {
                acc[k] += x[k] * y[k];
            }
        }
        for (k, (x, y)) in ra.iter().zip(rb).enumerate() {
            acc[k] += x * y;
        }
        fold32(acc)
    }
}

dispatched! {
    /// Σ aᵢbᵢ in f64.
    pub fn dot_f64(a: &[f64], b: &[f64]) -> f64 {
        assert_eq!(a.len(), b.len());
        let mut acc = [0f64; L64];
        let (ca, cb) = (a.chunks_exact(L64), b.chunks_exact(L64));
        let (ra, rb) = (ca.remainder(), cb.remainder());
        for (x, y) in ca.zip(cb) {
            for k in 0..L64 {
                acc[k] += x[k] * y[k];
            }
        }
        for (k, (x, y)) in ra.iter().zip(rb).enumerate() {
            acc[k] += x * y;
        }
        fold64(acc)
    }
}

dispatched! {
    /// Σ aᵢbᵢ with f32 `a` widened to f64 (features against an f64 parameter).
    pub fn dot_f32_f64(a: &[f32], b: &[f64]) -> f64 {
        assert_eq!(a.len(), b.len());
        let mut acc = [0f64; L64];
        let (ca, cb) = (a.chunks_exact(L64), b.chunks_exact(L64));
        let (ra, rb) = (ca.remainder(), cb.remainder());
        for (x, y) in ca.zip(cb) {
            for k in 0..L64 {
                acc[k] += f64::from(x[k]) * y[k];
            }
        }
        for (k, (x, y)) in ra.iter().zip(rb).enumerate() {
            acc[k] += f64::from(*x) * y;
        }
        fold64(acc)
    }
}

dispatched! {
    /// y ← y + αx (f32).
    pub fn axpy_f32(alpha: f32, x: &[f32], y: &mut [f32]) {
        assert_eq!(x.len(), y.len());
        for (yi, xi) in y.iter_mut().zip(x) {
            *yi += alpha * xi;
        }
    }
}

dispatched! {
    /// y ← y + αx with f32 `x` widened to f64.
    pub fn axpy_f32_f64(alpha: f64, x: &[f32], y: &mut [f64]) {
        assert_eq!(x.len(), y.len());
        for (yi, xi) in y.iter_mut().zip(x) {
            *yi += alpha * f64::from(*xi);
        }
    }
}

/// y ← y + αx (f64).
#[inline]
pub fn axpy_f64(alpha: f64, x: &[f64], y: &mut [f64]) {
    assert_eq!(x.len(), y.len());
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += alpha * xi;
    }
}

/// ‖x‖₂ of an f32 vector, accumulated in f64.
pub fn norm_f32(x: &[f32]) -> f64 {
    x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>().sqrt()
}

/// ‖x‖₂ of an f64 vector.
pub fn norm_f64(x: &[f64]) -> f64 {
    dot_f64(x, x).sqrt()
}

/// cos∠(a, b), 0 when either vector is zero.
pub fn cosine(a: &[f64], b: &[f64]) -> f64 {
    let (na, nb) = (norm_f64(a), norm_f64(b));
    if na == 0.0 || nb == 0.0 {
        0.0
    } else {
        dot_f64(a, b) / (na * nb)
    }
}

/// Batch Hessian-vector product H_B p = Zᵀ(w ⊙ Zp) for row-major `z` (`w.len()` rows).
/// Each row is read twice while it sits in L1: once for zᵢ·p, once for the axpy.
pub fn hvp_f32(z: &[f32], w: &[f32], p: &[f32], out: &mut [f32]) {
    let d = p.len();
    out.fill(0.0);
    for (row, &wi) in z.chunks_exact(d).zip(w) {
        let s = wi * dot_f32(row, p);
        axpy_f32(s, row, out);
    }
}

/// Upper triangle of a symmetric d×d matrix stored row by row: row i holds columns i..d.
///
/// Used for 𝓗⁻¹ (omd-exact) and for the curvature trackers: half the memory of a dense
/// matrix, and every O(d²) operation here is one sequential pass over `data`.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedSym {
    d: usize,
    data: Vec<f64>,
}

impl PackedSym {
    /// s·I.
    pub fn scaled_identity(d: usize, s: f64) -> Self {
        let mut m = PackedSym { d, data: vec![0.0; d * (d + 1) / 2] };
        for i in 0..d {
            let o = m.offset(i);
            m.data[o] = s;
        }
        m
    }

    /// From a dense row-major symmetric matrix (its upper triangle is read).
    pub fn from_dense(d: usize, dense: &[f64]) -> Self {
        assert_eq!(dense.len(), d * d);
        let mut data = Vec::with_capacity(d * (d + 1) / 2);
        for i in 0..d {
            data.extend_from_slice(&dense[i * d + i..(i + 1) * d]);
        }
        PackedSym { d, data }
    }

    pub fn dim(&self) -> usize {
        self.d
    }

    /// The packed entries (upper triangle, row by row).
    pub fn packed(&self) -> &[f64] {
        &self.data
    }

    /// Bytes held by the matrix.
    pub fn bytes(&self) -> usize {
        self.data.len() * std::mem::size_of::<f64>()
    }

    #[inline(always)]
    fn offset(&self, i: usize) -> usize {
        // Σ_{k<i} (d − k) = i·d − i(i−1)/2
        i * self.d - i * i.saturating_sub(1) / 2
    }

    /// Entry (i, j) of the symmetric matrix.
    pub fn get(&self, i: usize, j: usize) -> f64 {
        let (i, j) = if i <= j { (i, j) } else { (j, i) };
        self.data[self.offset(i) + (j - i)]
    }

    /// Dense row-major copy.
    pub fn to_dense(&self) -> Vec<f64> {
        let d = self.d;
        let mut out = vec![0.0; d * d];
        for i in 0..d {
            let row = &self.data[self.offset(i)..self.offset(i) + d - i];
            for (k, &v) in row.iter().enumerate() {
                out[i * d + i + k] = v;
                out[(i + k) * d + i] = v;
            }
        }
        out
    }

    /// out = M x, one read-only pass.
    pub fn matvec(&self, x: &[f64], out: &mut [f64]) {
        assert_eq!(x.len(), self.d);
        out.fill(0.0);
        for i in 0..self.d {
            let o = self.offset(i);
            let row = &self.data[o..o + self.d - i];
            let (diag, rest) = row.split_first().expect("row i has d - i >= 1 entries");
            let dot = matvec_row(rest, &x[i + 1..], x[i], &mut out[i + 1..]);
            out[i] += diag * x[i] + dot;
        }
    }

    /// xᵀ M x, one read-only pass (no allocation).
    pub fn quad_form(&self, x: &[f64]) -> f64 {
        assert_eq!(x.len(), self.d);
        let mut total = 0.0;
        for i in 0..self.d {
            let o = self.offset(i);
            let row = &self.data[o..o + self.d - i];
            // xᵢ (Mᵢᵢ xᵢ + 2 Σ_{j>i} Mᵢⱼ xⱼ)
            total += x[i] * (row[0] * x[i] + 2.0 * dot_f64(&row[1..], &x[i + 1..]));
        }
        total
    }

    /// M ← M − c·u uᵀ, one read-write pass.
    pub fn rank1_update(&mut self, c: f64, u: &[f64]) {
        assert_eq!(u.len(), self.d);
        let d = self.d;
        for i in 0..d {
            let o = self.offset(i);
            let ci = c * u[i];
            axpy_f64(-ci, &u[i..], &mut self.data[o..o + d - i]);
        }
    }

    /// M ← M − c·u uᵀ and then out = M x, fused into one read-write pass: the update of a
    /// Sherman–Morrison step and the next sample's matvec share the stream of M.
    pub fn rank1_update_matvec(&mut self, c: f64, u: &[f64], x: &[f64], out: &mut [f64]) {
        assert_eq!(u.len(), self.d);
        assert_eq!(x.len(), self.d);
        let d = self.d;
        out.fill(0.0);
        for i in 0..d {
            let o = self.offset(i);
            let row = &mut self.data[o..o + d - i];
            let ci = c * u[i];
            let (diag, rest) = row.split_first_mut().expect("row i has d - i >= 1 entries");
            *diag -= ci * u[i];
            let dot = update_matvec_row(rest, ci, &u[i + 1..], &x[i + 1..], x[i], &mut out[i + 1..]);
            out[i] += *diag * x[i] + dot;
        }
    }
}

dispatched! {
    /// Σ_j rowⱼxⱼ, and accⱼ += rowⱼ·xi (the mirrored lower triangle).
    fn matvec_row(row: &[f64], x: &[f64], xi: f64, acc: &mut [f64]) -> f64 {
        let n = row.len();
        let mut lanes = [0f64; L64];
        let full = n / L64 * L64;
        for base in (0..full).step_by(L64) {
            for k in 0..L64 {
                let m = row[base + k];
                lanes[k] += m * x[base + k];
                acc[base + k] += m * xi;
            }
        }
        for j in full..n {
            let m = row[j];
            lanes[j - full] += m * x[j];
            acc[j] += m * xi;
        }
        fold64(lanes)
    }
}

dispatched! {
    /// rowⱼ ← rowⱼ − ci·uⱼ, then the same as `matvec_row` on the updated row.
    fn update_matvec_row(row: &mut [f64], ci: f64, u: &[f64], x: &[f64], xi: f64, acc: &mut [f64]) -> f64 {
        let n = row.len();
        let mut lanes = [0f64; L64];
        let full = n / L64 * L64;
        for base in (0..full).step_by(L64) {
            for k in 0..L64 {
                let m = row[base + k] - ci * u[base + k];
                row[base + k] = m;
                lanes[k] += m * x[base + k];
                acc[base + k] += m * xi;
            }
        }
        for j in full..n {
            let m = row[j] - ci * u[j];
            row[j] = m;
            lanes[j - full] += m * x[j];
            acc[j] += m * xi;
        }
        fold64(lanes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(n: usize, a: f64) -> Vec<f64> {
        (0..n).map(|i| ((i as f64 + 1.0) * a).sin()).collect()
    }

    fn dense_matvec(d: usize, m: &[f64], x: &[f64]) -> Vec<f64> {
        (0..d).map(|i| (0..d).map(|j| m[i * d + j] * x[j]).sum()).collect()
    }

    fn sym(d: usize) -> Vec<f64> {
        let mut m = vec![0.0; d * d];
        for i in 0..d {
            for j in 0..d {
                m[i * d + j] = ((i + j) as f64 * 0.37).cos() + if i == j { d as f64 } else { 0.0 };
            }
        }
        m
    }

    #[test]
    fn dots_match_naive_sums() {
        for n in [0, 1, 7, 16, 33, 100] {
            let a = seq(n, 0.3);
            let b = seq(n, 0.7);
            let naive: f64 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
            assert!((dot_f64(&a, &b) - naive).abs() < 1e-12);
            let a32: Vec<f32> = a.iter().map(|&v| v as f32).collect();
            let b32: Vec<f32> = b.iter().map(|&v| v as f32).collect();
            assert!((f64::from(dot_f32(&a32, &b32)) - naive).abs() < 1e-4);
            let mixed: f64 = a32.iter().zip(&b).map(|(&x, y)| f64::from(x) * y).sum();
            assert!((dot_f32_f64(&a32, &b) - mixed).abs() < 1e-12);
        }
    }

    #[test]
    fn packed_ops_match_dense() {
        for d in [1, 2, 5, 9, 17] {
            let m = sym(d);
            let p = PackedSym::from_dense(d, &m);
            assert_eq!(p.to_dense(), m);
            assert_eq!(p.get(d - 1, 0), m[(d - 1) * d]);
            let x = seq(d, 0.9);
            let mut out = vec![0.0; d];
            p.matvec(&x, &mut out);
            let want = dense_matvec(d, &m, &x);
            for (a, b) in out.iter().zip(&want) {
                assert!((a - b).abs() < 1e-10, "{a} vs {b}");
            }
            let q: f64 = x.iter().zip(&want).map(|(a, b)| a * b).sum();
            assert!((p.quad_form(&x) - q).abs() < 1e-9);

            let u = seq(d, 1.3);
            let c = 0.25;
            let mut m2 = m.clone();
            for i in 0..d {
                for j in 0..d {
                    m2[i * d + j] -= c * u[i] * u[j];
                }
            }
            let mut p_fused = p.clone();
            p_fused.rank1_update_matvec(c, &u, &x, &mut out);
            let want = dense_matvec(d, &m2, &x);
            for (a, b) in out.iter().zip(&want) {
                assert!((a - b).abs() < 1e-10);
            }
            let mut p_plain = p.clone();
            p_plain.rank1_update(c, &u);
            for (a, b) in p_plain.to_dense().iter().zip(&m2) {
                assert!((a - b).abs() < 1e-12);
            }
            for (a, b) in p_fused.to_dense().iter().zip(&m2) {
                assert!((a - b).abs() < 1e-12);
            }
        }
    }

    #[test]
    fn hvp_matches_dense_hessian() {
        let (b, d) = (3, 11);
        let z: Vec<f32> = (0..b * d).map(|i| ((i as f32) * 0.31).sin()).collect();
        let w = [0.2f32, 0.05, 0.7];
        let p: Vec<f32> = (0..d).map(|i| ((i as f32) * 0.11).cos()).collect();
        let mut out = vec![0.0; d];
        hvp_f32(&z, &w, &p, &mut out);
        for j in 0..d {
            let mut want = 0.0f64;
            for i in 0..b {
                for k in 0..d {
                    want += f64::from(w[i]) * f64::from(z[i * d + j]) * f64::from(z[i * d + k]) * f64::from(p[k]);
                }
            }
            assert!((f64::from(out[j]) - want).abs() < 1e-5);
        }
    }

    #[test]
    fn dispatch_is_bitwise_identical() {
        let n = 1003;
        let a = seq(n, 0.3);
        let b = seq(n, 0.71);
        let a32: Vec<f32> = a.iter().map(|&v| v as f32).collect();
        let b32: Vec<f32> = b.iter().map(|&v| v as f32).collect();
        let run = || {
            let mut y = b32.clone();
            axpy_f32(0.3, &a32, &mut y);
            let m = PackedSym::from_dense(9, &sym(9));
            let mut out = vec![0.0; 9];
            let mut m2 = m.clone();
            m2.rank1_update_matvec(0.1, &a[..9], &b[..9], &mut out);
            (dot_f32(&a32, &b32), dot_f64(&a, &b), dot_f32_f64(&a32, &b), y, out, m2)
        };
        let fast = run();
        FORCE_GENERIC.with(|f| f.set(true));
        let slow = run();
        FORCE_GENERIC.with(|f| f.set(false));
        assert_eq!(fast.0.to_bits(), slow.0.to_bits());
        assert_eq!(fast.1.to_bits(), slow.1.to_bits());
        assert_eq!(fast.2.to_bits(), slow.2.to_bits());
        assert_eq!(fast.3, slow.3);
        assert_eq!(fast.4, slow.4);
        assert_eq!(fast.5, slow.5);
    }
}
