//! What the CPU path's packed matrix products share: y = x Wᵀ with W packed once at load
//! ([`crate::bf16::Bf16Matrix`], [`crate::f32mm::F32Matrix`]), the input rows packed per call,
//! tiles of (rows × output groups) on rayon's pool, and the epilogues that run on a block of
//! finished rows while it is still in cache (RoPE and the heads' layout after q/k/v, the residual
//! add and RMSNorm after the output and down projections, silu(gate)·up before down).
//!
//! A format says how it packs and how it multiplies one block ([`Blocked`]); the driver here
//! splits the work and runs the epilogues, so every format gets the same fusions.

use crate::buf::OutPtr;
use rayon::prelude::*;

/// A product's epilogue: called with a block of rows and their finished outputs (rows × n,
/// row-major), which it may rewrite in place.
pub type RowsDone<'a> = &'a (dyn Fn(std::ops::Range<usize>, &mut [f32]) + Sync);

/// A product's input rows: x (m, k) as it is, or [g | u] (m, 2k) whose row is silu(g)·u.
#[derive(Clone, Copy)]
pub(crate) enum Rows<'a> {
    Plain(&'a [f32]),
    SiluMul(&'a [f32]),
}

impl Rows<'_> {
    /// Row `i` of the product's input into `dst` (k values): x's row, or silu(g)·u.
    #[inline]
    pub(crate) fn row_into(self, i: usize, k: usize, dst: &mut [f32]) {
        match self {
            Rows::Plain(x) => dst.copy_from_slice(&x[i * k..][..k]),
            Rows::SiluMul(gu) => crate::rows::silu_mul_row(&gu[i * 2 * k..][..2 * k], dst),
        }
    }
}

/// A packed weight format: how the input is packed and how one block of y is computed.
pub(crate) trait Blocked: Sync {
    /// The input rows as the kernel reads them.
    type Input: Sync;
    /// Outputs per column group.
    const GROUP: usize;
    /// Rows per task (a multiple of the kernel's row tile): the activations of a task's block
    /// stay in L2.
    const MC: usize;
    fn n(&self) -> usize;
    fn k(&self) -> usize;
    fn pack_input(&self, x: Rows, m: usize) -> Self::Input;
    /// Rows `rows` (starting at a multiple of the row tile) × column groups `groups` of y
    /// (row stride n).
    ///
    /// # Safety
    /// `y` holds m × n values and this region of it is written by this call only.
    unsafe fn block(&self, x: &Self::Input, rows: std::ops::Range<usize>, groups: std::ops::Range<usize>, y: *mut f32);
}

/// y = x Wᵀ into `y` (m × n, written in full), then `done` (if any) on each block of finished
/// rows.
pub(crate) fn product_into<B: Blocked>(
    w: &B,
    x: Rows,
    m: usize,
    y: &mut [std::mem::MaybeUninit<f32>],
    done: Option<RowsDone>,
) {
    let n = w.n();
    if m == 0 || n == 0 {
        return;
    }
    if w.k() == 0 {
        y.iter_mut().for_each(|v| _ = v.write(0.0));
        if let Some(done) = done {
            // SAFETY: written just above.
            done(0..m, unsafe { crate::buf::assume_written_mut(y) });
        }
        return;
    }
    let xs = w.pack_input(x, m);
    let groups = n.div_ceil(B::GROUP);
    let row_blocks = m.div_ceil(B::MC);
    // Enough tasks for the pool with few rows (decoding), bigger column blocks with many;
    // with an epilogue and many rows, whole rows per task.
    let whole_rows = done.is_some() && row_blocks >= 8;
    let groups_per_task = if whole_rows {
        groups
    } else if row_blocks >= 8 {
        4
    } else {
        1
    };
    let col_tasks = groups.div_ceil(groups_per_task);
    let out = OutPtr(y.as_mut_ptr() as *mut f32);
    // Each task's rows × groups region of y is written by that task only; every output is
    // stored by exactly one tile before anything reads it (k > 0, so each tile runs its first
    // block).
    (0..row_blocks * col_tasks).into_par_iter().for_each(|task| {
        let (rb, ct) = (task / col_tasks, task % col_tasks);
        let rows = rb * B::MC..((rb + 1) * B::MC).min(m);
        let groups = ct * groups_per_task..((ct + 1) * groups_per_task).min(groups);
        // SAFETY: see above.
        unsafe { w.block(&xs, rows.clone(), groups, out.at(0)) };
        if let (true, Some(done)) = (whole_rows, done) {
            // SAFETY: this task wrote these whole rows just above and owns them.
            done(rows.clone(), unsafe { std::slice::from_raw_parts_mut(out.at(rows.start * n), rows.len() * n) });
        }
    });
    if let (false, Some(done)) = (whole_rows, done) {
        // SAFETY: every output was written above.
        let y = unsafe { crate::buf::assume_written_mut(y) };
        y.par_chunks_mut(B::MC * n).enumerate().for_each(|(rb, s)| done(rb * B::MC..rb * B::MC + s.len() / n, s));
    }
}

fn product<B: Blocked>(w: &B, x: Rows, m: usize, done: Option<RowsDone>) -> Vec<f32> {
    // SAFETY (of `overwritten`): product_into writes every output.
    unsafe { crate::buf::overwritten(m * w.n(), |y| product_into(w, x, m, y, done)) }
}

/// The products a packed weight offers; what the model's layers hold (`dyn`, one per format).
pub trait PackedMatrix: Send + Sync {
    /// Outputs (rows of W).
    fn n(&self) -> usize;
    /// Inputs (columns of W).
    fn k(&self) -> usize;
    /// y = x Wᵀ for x (m, k) row-major f32: (m, n) f32.
    fn matmul_t(&self, x: &[f32], m: usize) -> Vec<f32>;
    /// y = (silu(g) ⊙ u) Wᵀ for gu = [g | u] (m, 2k) row-major f32: SwiGLU's down projection,
    /// silu(g)·u formed row by row while the product's input is packed (the bits of
    /// [`crate::rows::silu_mul`] followed by [`PackedMatrix::matmul_t`], without writing and
    /// re-reading the (m, k) activation).
    fn matmul_t_swiglu(&self, gu: &[f32], m: usize) -> Vec<f32>;
    /// y = x Wᵀ as [`PackedMatrix::matmul_t`], then `done(rows, y[rows])` on each block of
    /// finished rows, which it may read or rewrite: with enough rows each task owns whole rows
    /// and runs `done` while its block is still in cache (how the q/k/v product lays out and
    /// rotates its heads without a separate pass over y).
    fn matmul_t_then(&self, x: &[f32], m: usize, done: RowsDone) -> Vec<f32>;
    /// The residual sublayer's end: y = x Wᵀ (`swiglu`: of silu(g)·u for x = [g | u], as
    /// [`PackedMatrix::matmul_t_swiglu`]), then s = r + y and RMSNorm(s) with weight `norm` —
    /// returned as one (2, m, n) buffer [s; RMSNorm(s)], the bits of the product followed by
    /// [`crate::rows::add_rms_norm`]. With enough rows each task owns whole rows and normalises
    /// its block while it is still in cache, rather than writing y out for a separate pass.
    fn matmul_t_add_rms(&self, x: &[f32], swiglu: bool, m: usize, r: &[f32], norm: &[f32], eps: f32) -> Vec<f32>;
}

impl<B: Blocked + Send> PackedMatrix for B {
    fn n(&self) -> usize {
        Blocked::n(self)
    }
    fn k(&self) -> usize {
        Blocked::k(self)
    }
    fn matmul_t(&self, x: &[f32], m: usize) -> Vec<f32> {
        let k = Blocked::k(self);
        assert_eq!(x.len(), m * k, "x has {} values, expected {m} × {k}", x.len());
        product(self, Rows::Plain(x), m, None)
    }
    fn matmul_t_swiglu(&self, gu: &[f32], m: usize) -> Vec<f32> {
        let k = Blocked::k(self);
        assert_eq!(gu.len(), m * 2 * k, "gu has {} values, expected {m} × 2·{k}", gu.len());
        product(self, Rows::SiluMul(gu), m, None)
    }
    fn matmul_t_then(&self, x: &[f32], m: usize, done: RowsDone) -> Vec<f32> {
        let k = Blocked::k(self);
        assert_eq!(x.len(), m * k, "x has {} values, expected {m} × {k}", x.len());
        product(self, Rows::Plain(x), m, Some(done))
    }
    fn matmul_t_add_rms(&self, x: &[f32], swiglu: bool, m: usize, r: &[f32], norm: &[f32], eps: f32) -> Vec<f32> {
        let n = Blocked::n(self);
        let k = if swiglu { 2 * Blocked::k(self) } else { Blocked::k(self) };
        assert_eq!(x.len(), m * k, "x has {} values, expected {m} × {k}", x.len());
        assert_eq!(r.len(), m * n, "the residual has {} values, expected {m} × {n}", r.len());
        assert_eq!(norm.len(), n, "the norm has {} weights, expected {n}", norm.len());
        let x = if swiglu { Rows::SiluMul(x) } else { Rows::Plain(x) };
        let fill = |both: &mut [std::mem::MaybeUninit<f32>]| {
            let (y, normed) = both.split_at_mut(m * n);
            let normed = OutPtr(normed.as_mut_ptr() as *mut f32);
            let done = |rows: std::ops::Range<usize>, s: &mut [f32]| {
                // SAFETY: rows of the normalised half are written by the one call that owns them.
                let d = unsafe {
                    std::slice::from_raw_parts_mut(
                        normed.at(rows.start * n) as *mut std::mem::MaybeUninit<f32>,
                        s.len(),
                    )
                };
                crate::rows::add_rms_rows_in_place(&r[rows.start * n..rows.end * n], s, norm, eps, d);
            };
            product_into(self, x, m, y, Some(&done))
        };
        // SAFETY (of `overwritten`): product_into writes the first half and the epilogue, called
        // on every block of rows, the second.
        unsafe { crate::buf::overwritten(2 * m * n, fill) }
    }
}

/// The q/k/v product with RoPE and the attention layout as its epilogue: x (b·t, k) row-major
/// f32 → the packed (b, heads, t, d) buffer of [`crate::rows::qkv_rope`] at offset 0, bit for bit,
/// without a separate pass over the product's output; the first `rotated` heads (q and k) are
/// rotated with the (≥ t, d/2) tables `cos`, `sin`.
///
/// # Panics
/// If the shapes do not fit W (n = heads · d) or the tables (callers check them first).
pub fn qkv_rope_product(
    w: &(impl PackedMatrix + ?Sized),
    x: &[f32],
    (b, t, heads, d): (usize, usize, usize, usize),
    rotated: usize,
    (cos, sin): (&[f32], &[f32]),
    interleaved: bool,
) -> Vec<f32> {
    assert!(
        w.n() == heads * d && x.len() == b * t * w.k() && d.is_multiple_of(2) && rotated <= heads,
        "qkv rope product: x of {} values and (b, t, heads, d) = {:?} against a {} × {} weight",
        x.len(),
        (b, t, heads, d),
        w.n(),
        w.k()
    );
    assert!(cos.len() >= t * (d / 2) && sin.len() == cos.len(), "qkv rope product: tables shorter than {t} rows");
    let fill = |out: &mut [std::mem::MaybeUninit<f32>]| {
        let dst = OutPtr(out.as_mut_ptr() as *mut f32);
        let done = |r: std::ops::Range<usize>, y: &mut [f32]| {
            // SAFETY: the product's blocks of rows are disjoint; each writes its rows' entries.
            unsafe { crate::rows::qkv_rope_rows(y, r, (t, heads, d), rotated, (cos, sin), interleaved, &dst) }
        };
        drop(w.matmul_t_then(x, b * t, &done));
    };
    // SAFETY (of `overwritten`): the epilogue writes every (row, head) entry.
    unsafe { crate::buf::overwritten(b * heads * t * d, fill) }
}

/// The store mask of panel `j` of a register tile of `cols` outputs in panels of 16 (AVX-512's
/// 16-lane masks): all lanes for a full panel, the low `cols mod 16` for a short last one, none
/// past the last.
pub(crate) fn panel_mask(j: usize, cols: usize) -> u16 {
    const LANES: usize = 16;
    let panels = cols.div_ceil(LANES);
    let last = cols - (panels - 1) * LANES;
    if j + 1 < panels || (j + 1 == panels && last == LANES) {
        0xffff
    } else if j + 1 == panels {
        ((1u32 << last) - 1) as u16
    } else {
        0
    }
}
