//! Dense kernels on plain slices, and a packed symmetric matrix with Sherman–Morrison updates.
//!
//! Every reduction accumulates in a fixed number of lanes and folds them in a fixed order, so
//! results are bit-identical whatever the CPU: the AVX2 copies chosen at run time are the same
//! Rust code compiled with wider registers (Rust never contracts `a * b + c` into an FMA), and
//! `tests::dispatch_is_bitwise_identical` checks that.

/// Lanes of the f32 and f64 accumulators of the `dispatched!` kernels.
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

/// Σ aᵢbᵢ in f32, the hottest kernel (every margin and HVP). LLVM does not vectorise a
/// fixed-lane reduction well here, so the AVX2 path uses intrinsics; the portable path does
/// the same lane arithmetic in the same order, so both give the same bits.
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") && !force_generic() {
            // SAFETY: AVX2 is present (checked above) and the lengths are equal.
            return unsafe { dot_f32_avx2(a, b) };
        }
    }
    dot_f32_portable(a, b)
}

/// 32 lanes: four AVX2 registers of 8, enough independent chains to hide the add latency.
const DOT_LANES: usize = 32;

#[inline(always)]
fn dot_f32_portable(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; DOT_LANES];
    let (ca, cb) = (a.chunks_exact(DOT_LANES), b.chunks_exact(DOT_LANES));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for k in 0..DOT_LANES {
            acc[k] += x[k] * y[k];
        }
    }
    // fold in the order of the AVX2 path: registers, then halves, then pairs
    let v: [f32; 8] = std::array::from_fn(|k| (acc[k] + acc[k + 8]) + (acc[k + 16] + acc[k + 24]));
    let w: [f32; 4] = std::array::from_fn(|k| v[k] + v[k + 4]);
    let mut total = (w[0] + w[2]) + (w[1] + w[3]);
    for (x, y) in ra.iter().zip(rb) {
        total += x * y;
    }
    total
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot_f32_avx2(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len() / DOT_LANES * DOT_LANES;
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i < n {
        for (r, slot) in acc.iter_mut().enumerate() {
            // SAFETY: i + 8r + 8 ≤ n ≤ len for both slices.
            let (x, y) = unsafe { (_mm256_loadu_ps(pa.add(i + 8 * r)), _mm256_loadu_ps(pb.add(i + 8 * r))) };
            *slot = _mm256_add_ps(*slot, _mm256_mul_ps(x, y));
        }
        i += DOT_LANES;
    }
    let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let w = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let pair = _mm_add_ps(w, _mm_movehl_ps(w, w)); // [w0+w2, w1+w3, ..]
    let mut total = _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
    for j in n..a.len() {
        total += a[j] * b[j];
    }
    total
}

/// out_i = z_i·p for the rows of row-major `z`: four rows per pass, so each load of p
/// serves four rows. Each row sums over 16 lanes (two AVX2 registers); the portable path
/// does the same lane arithmetic in the same order.
pub fn gemv_f32(z: &[f32], p: &[f32], out: &mut [f32]) {
    let d = p.len();
    assert_eq!(z.len(), out.len() * d);
    dots_strided(p, z, d, out);
}

/// out_r = x·y_r for the vectors y_r = ys[r·stride .. r·stride + x.len()], r < out.len().
pub fn dots_strided(x: &[f32], ys: &[f32], stride: usize, out: &mut [f32]) {
    let len = x.len();
    let count = out.len();
    if count == 0 {
        return;
    }
    assert!(stride >= len && ys.len() >= (count - 1) * stride + len);
    let mut r = 0;
    while r + 4 <= count {
        let base = &ys[r * stride..];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") && !force_generic() {
                // SAFETY: AVX2 is present; rows r..r+4 lie inside `ys` (asserted above).
                out[r..r + 4].copy_from_slice(&unsafe { dot4_avx2(base, stride, x) });
                r += 4;
                continue;
            }
        }
        out[r..r + 4].copy_from_slice(&dot4_portable(base, stride, x));
        r += 4;
    }
    for k in r..count {
        out[k] = dot_f32(&ys[k * stride..k * stride + len], x);
    }
}

const ROW_LANES: usize = 16;

#[inline(always)]
fn fold16(acc: &[f32; ROW_LANES]) -> f32 {
    let v: [f32; 8] = std::array::from_fn(|k| acc[k] + acc[k + 8]);
    let w: [f32; 4] = std::array::from_fn(|k| v[k] + v[k + 4]);
    (w[0] + w[2]) + (w[1] + w[3])
}

fn dot4_portable(rows: &[f32], stride: usize, p: &[f32]) -> [f32; 4] {
    let d = p.len();
    let n = d / ROW_LANES * ROW_LANES;
    let mut acc = [[0f32; ROW_LANES]; 4];
    for base in (0..n).step_by(ROW_LANES) {
        for (r, a) in acc.iter_mut().enumerate() {
            for k in 0..ROW_LANES {
                a[k] += rows[r * stride + base + k] * p[base + k];
            }
        }
    }
    std::array::from_fn(|r| {
        let mut t = fold16(&acc[r]);
        for j in n..d {
            t += rows[r * stride + j] * p[j];
        }
        t
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot4_avx2(rows: &[f32], stride: usize, p: &[f32]) -> [f32; 4] {
    use std::arch::x86_64::*;
    let d = p.len();
    let n = d / ROW_LANES * ROW_LANES;
    let (pz, pp) = (rows.as_ptr(), p.as_ptr());
    let mut acc = [[_mm256_setzero_ps(); 2]; 4];
    let mut j = 0;
    while j < n {
        // SAFETY: j + 16 ≤ n ≤ d, and row r spans [r·stride, r·stride + d) of `rows`.
        let (p0, p1) = unsafe { (_mm256_loadu_ps(pp.add(j)), _mm256_loadu_ps(pp.add(j + 8))) };
        for (r, a) in acc.iter_mut().enumerate() {
            let (z0, z1) =
                unsafe { (_mm256_loadu_ps(pz.add(r * stride + j)), _mm256_loadu_ps(pz.add(r * stride + j + 8))) };
            a[0] = _mm256_add_ps(a[0], _mm256_mul_ps(z0, p0));
            a[1] = _mm256_add_ps(a[1], _mm256_mul_ps(z1, p1));
        }
        j += ROW_LANES;
    }
    std::array::from_fn(|r| {
        let v = _mm256_add_ps(acc[r][0], acc[r][1]);
        let w = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let pair = _mm_add_ps(w, _mm_movehl_ps(w, w));
        let mut t = _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
        for k in n..d {
            t += rows[r * stride + k] * p[k];
        }
        t
    })
}

/// One CG update of paper Alg. 5 in a single pass: x += αp, r −= α·Ap; returns rᵀr.
pub fn cg_step_f32(alpha: f32, p: &[f32], ap: &[f32], x: &mut [f32], r: &mut [f32]) -> f32 {
    for (((xi, ri), pi), api) in x.iter_mut().zip(r.iter_mut()).zip(p).zip(ap) {
        *xi += alpha * pi;
        *ri -= alpha * api;
    }
    dot_f32(r, r)
}

dispatched! {
    /// Σ aᵢbᵢ in f64.
    pub fn dot_f64(a: &[f64], b: &[f64]) -> f64 {
        assert_eq!(a.len(), b.len());
        let mut acc = [0f64; L64];
        let (ca, cb) = (a.chunks_exact(L64), b.chunks_exact(L64));
        let (ra, rb) = (ca.remainder(), cb.remainder());
        for (x, y) in ca.zip(cb) {
            let (x, y): (&[f64; L64], &[f64; L64]) = (x.try_into().unwrap(), y.try_into().unwrap());
            for k in 0..L64 {
                acc[k] += x[k] * y[k];
            }
        }
        let mut tail = 0f64;
        for (x, y) in ra.iter().zip(rb) {
            tail += x * y;
        }
        fold64(acc) + tail
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
            let (x, y): (&[f32; L64], &[f64; L64]) = (x.try_into().unwrap(), y.try_into().unwrap());
            for k in 0..L64 {
                acc[k] += f64::from(x[k]) * y[k];
            }
        }
        let mut tail = 0f64;
        for (x, y) in ra.iter().zip(rb) {
            tail += f64::from(*x) * y;
        }
        fold64(acc) + tail
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

/// ‖x‖₂ of an f32 vector (accumulated in f32 over 32 lanes: ample for diagnostics and
/// clipping thresholds).
pub fn norm_f32(x: &[f32]) -> f64 {
    f64::from(dot_f32(x, x)).sqrt()
}

/// ‖x‖₂ of an f64 vector.
pub fn norm_f64(x: &[f64]) -> f64 {
    dot_f64(x, x).sqrt()
}

/// For s = old − new: (Σ sᵢ², Σ sᵢgᵢ) — the step norm and its projection on g. `s` is scratch.
pub fn step_geometry(old: &[f32], new: &[f32], g: &[f32], s: &mut [f32]) -> (f64, f64) {
    for ((si, o), n) in s.iter_mut().zip(old).zip(new) {
        *si = o - n;
    }
    (f64::from(dot_f32(s, s)), f64::from(dot_f32(s, g)))
}

/// out = Σᵢ cᵢ zᵢ over the rows of row-major `z` (`c.len()` rows).
pub fn gemv_t_f32(z: &[f32], c: &[f32], out: &mut [f32]) {
    gemv_t_init_f32(z, c, None, out)
}

dispatched! {
    /// out = λ·p + Σᵢ cᵢ zᵢ (`init = Some((λ, p))`) or Σᵢ cᵢ zᵢ. Rows go eight (then four, then
    /// one) at a time, so `out` is written once per eight rows.
    pub fn gemv_t_init_f32(z: &[f32], c: &[f32], init: Option<(f32, &[f32])>, out: &mut [f32]) {
        let d = out.len();
        assert_eq!(z.len(), c.len() * d);
        match init {
            Some((lambda, p)) => {
                assert_eq!(p.len(), d);
                for (o, pi) in out.iter_mut().zip(p) {
                    *o = lambda * pi;
                }
            }
            None => out.fill(0.0),
        }
        let row = |i: usize| &z[i * d..(i + 1) * d];
        let mut i = 0;
        while i + 8 <= c.len() {
            let r: [&[f32]; 8] = std::array::from_fn(|k| row(i + k));
            let k: [f32; 8] = std::array::from_fn(|k| c[i + k]);
            for j in 0..d {
                let lo = (k[0] * r[0][j] + k[1] * r[1][j]) + (k[2] * r[2][j] + k[3] * r[3][j]);
                let hi = (k[4] * r[4][j] + k[5] * r[5][j]) + (k[6] * r[6][j] + k[7] * r[7][j]);
                out[j] += lo + hi;
            }
            i += 8;
        }
        while i + 4 <= c.len() {
            let r: [&[f32]; 4] = std::array::from_fn(|k| row(i + k));
            let k: [f32; 4] = std::array::from_fn(|k| c[i + k]);
            for j in 0..d {
                out[j] += (k[0] * r[0][j] + k[1] * r[1][j]) + (k[2] * r[2][j] + k[3] * r[3][j]);
            }
            i += 4;
        }
        while i < c.len() {
            let r = row(i);
            for j in 0..d {
                out[j] += c[i] * r[j];
            }
            i += 1;
        }
    }
}

/// G = Z Zᵀ (row-major n×n, f64) for the n rows of row-major `z`, one pass over Z: the rows
/// are walked in column chunks that stay in L1 while all pairs are formed.
pub fn gram_f32(z: &[f32], d: usize, out: &mut [f64]) {
    let n = z.len() / d;
    assert_eq!(out.len(), n * n);
    out.fill(0.0);
    const CHUNK: usize = 1024;
    let mut part = vec![0f32; n];
    for lo in (0..d).step_by(CHUNK) {
        let hi = (lo + CHUNK).min(d);
        for i in 0..n {
            // row i against rows i..n on this chunk (4 rows per load of row i)
            let cnt = n - i;
            dots_strided(&z[i * d + lo..i * d + hi], &z[i * d + lo..], d, &mut part[..cnt]);
            for (k, v) in part[..cnt].iter().enumerate() {
                out[i * n + i + k] += f64::from(*v);
            }
        }
    }
    for i in 0..n {
        for j in 0..i {
            out[i * n + j] = out[j * n + i];
        }
    }
}

/// Batch Hessian-vector product H_B p = Zᵀ(w ⊙ Zp) for row-major `z` (`w.len()` rows):
/// two passes over Z. `s` is scratch of at least `w.len()` entries.
pub fn hvp_f32(z: &[f32], w: &[f32], p: &[f32], s: &mut [f32], out: &mut [f32]) {
    damped_hvp_f32(z, w, p, 0.0, s, out)
}

/// (H_B + λI) p, the λp term folded into the pass that writes `out`.
pub fn damped_hvp_f32(z: &[f32], w: &[f32], p: &[f32], lambda: f32, s: &mut [f32], out: &mut [f32]) {
    let s = &mut s[..w.len()];
    gemv_f32(z, p, s);
    for (si, wi) in s.iter_mut().zip(w) {
        *si *= wi;
    }
    gemv_t_init_f32(z, s, (lambda != 0.0).then_some((lambda, p)), out);
}

/// Upper triangle of a symmetric d×d matrix stored row by row: row i holds columns i..d.
///
/// Used for 𝓗⁻¹ (omd-exact) and for the curvature trackers: half the memory of a dense
/// matrix, and every O(d²) operation here is one sequential pass over `data`.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
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
    /// Sherman–Morrison step and the next sample's matvec share the stream of M. Rows go in
    /// blocks of four so u, x and out are read once per four rows of M.
    pub fn rank1_update_matvec(&mut self, c: f64, u: &[f64], x: &[f64], out: &mut [f64]) {
        assert_eq!(u.len(), self.d);
        assert_eq!(x.len(), self.d);
        let d = self.d;
        out.fill(0.0);
        let mut i0 = 0;
        while i0 + 4 <= d {
            // the triangle inside the block, entry by entry
            let mut dots = [0.0f64; 4];
            for k in 0..4 {
                let i = i0 + k;
                let o = self.offset(i);
                let ci = c * u[i];
                for j in i..i0 + 4 {
                    let m = self.data[o + j - i] - ci * u[j];
                    self.data[o + j - i] = m;
                    if j == i {
                        out[i] += m * x[i];
                    } else {
                        dots[k] += m * x[j];
                        out[j] += m * x[i];
                    }
                }
            }
            // columns i0+4.. shared by the four rows
            let tail = d - i0 - 4;
            let starts: [usize; 4] = std::array::from_fn(|k| self.offset(i0 + k) + 4 - k);
            let (a, rest) = self.data[starts[0]..].split_at_mut(starts[1] - starts[0]);
            let (b, rest) = rest.split_at_mut(starts[2] - starts[1]);
            let (cc, rest) = rest.split_at_mut(starts[3] - starts[2]);
            let cs: [f64; 4] = std::array::from_fn(|k| c * u[i0 + k]);
            let xs: [f64; 4] = std::array::from_fn(|k| x[i0 + k]);
            let t = update_matvec_block4(
                [&mut a[..tail], &mut b[..tail], &mut cc[..tail], &mut rest[..tail]],
                cs,
                xs,
                &u[i0 + 4..],
                &x[i0 + 4..],
                &mut out[i0 + 4..],
            );
            for k in 0..4 {
                out[i0 + k] += dots[k] + t[k];
            }
            i0 += 4;
        }
        for i in i0..d {
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
    /// Four rows at once: rₖⱼ ← rₖⱼ − cₖuⱼ; returns Σⱼ rₖⱼxⱼ per row and adds Σₖ rₖⱼxsₖ to accⱼ.
    /// `rows` are r₀…r₃ (equal lengths), borrowed side by side.
    fn update_matvec_block4(
        rows: [&mut [f64]; 4],
        cs: [f64; 4], xs: [f64; 4], u: &[f64], x: &[f64], acc: &mut [f64],
    ) -> [f64; 4] {
        let [r0, r1, r2, r3] = rows;
        const L: usize = 4;
        let n = r0.len();
        assert!(r1.len() == n && r2.len() == n && r3.len() == n && u.len() >= n && x.len() >= n && acc.len() >= n);
        let mut lanes = [[0f64; L]; 4];
        let mut tails = [0f64; 4];
        let full = n / L * L;
        for base in (0..full).step_by(L) {
            for k in 0..L {
                let j = base + k;
                let (uj, xj) = (u[j], x[j]);
                let m0 = r0[j] - cs[0] * uj;
                let m1 = r1[j] - cs[1] * uj;
                let m2 = r2[j] - cs[2] * uj;
                let m3 = r3[j] - cs[3] * uj;
                r0[j] = m0;
                r1[j] = m1;
                r2[j] = m2;
                r3[j] = m3;
                lanes[0][k] += m0 * xj;
                lanes[1][k] += m1 * xj;
                lanes[2][k] += m2 * xj;
                lanes[3][k] += m3 * xj;
                acc[j] += ((m0 * xs[0] + m1 * xs[1]) + m2 * xs[2]) + m3 * xs[3];
            }
        }
        for j in full..n {
            let (uj, xj) = (u[j], x[j]);
            let m = [r0[j] - cs[0] * uj, r1[j] - cs[1] * uj, r2[j] - cs[2] * uj, r3[j] - cs[3] * uj];
            r0[j] = m[0];
            r1[j] = m[1];
            r2[j] = m[2];
            r3[j] = m[3];
            for k in 0..4 {
                tails[k] += m[k] * xj;
            }
            acc[j] += ((m[0] * xs[0] + m[1] * xs[1]) + m[2] * xs[2]) + m[3] * xs[3];
        }
        std::array::from_fn(|k| ((lanes[k][0] + lanes[k][2]) + (lanes[k][1] + lanes[k][3])) + tails[k])
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
        let mut tail = 0f64;
        for j in full..n {
            let m = row[j];
            tail += m * x[j];
            acc[j] += m * xi;
        }
        fold64(lanes) + tail
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
        let mut tail = 0f64;
        for j in full..n {
            let m = row[j] - ci * u[j];
            row[j] = m;
            tail += m * x[j];
            acc[j] += m * xi;
        }
        fold64(lanes) + tail
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
        hvp_f32(&z, &w, &p, &mut [0.0; 3], &mut out);
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
            let m = PackedSym::from_dense(37, &sym(37));
            let mut out = vec![0.0; 37];
            let mut m2 = m.clone();
            m2.rank1_update_matvec(0.1, &a[..37], &b[..37], &mut out);
            let mut g = vec![0f32; 101];
            gemv_t_f32(&a32[..707], &b32[..7], &mut g);
            y.extend(g);
            let mut o = vec![0f32; 7];
            gemv_f32(&a32[..7 * 101], &b32[..101], &mut o);
            y.extend(o);
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
