//! Output buffers the kernels fill without zeroing first, and the pointer rayon tasks share to
//! write disjoint regions of one buffer. Every `unsafe` here states what its caller promises.

use std::mem::MaybeUninit;

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
