//! The process's memory: glibc's allocator kept from returning freed memory, and the peak
//! resident set the benchmarks report.

/// Makes glibc keep freed memory for reuse, for the processes that train or generate: one arena, no mmap of
/// large blocks, no trimming of the heap's top. Otherwise every large tensor of a training step —
/// activations, the log-softmax over the vocabulary (8 × 128 × 49,152 f32 = 201 MB) — comes back
/// as fresh pages the kernel must zero: `clear_page` took a quarter to a third of a LoRA step
/// (perf). `M_MMAP_THRESHOLD` alone is not enough (glibc caps it at 32 MiB), hence
/// `M_MMAP_MAX = 0`; `M_TRIM_THRESHOLD = -1` disables trimming. The cost: the process keeps its
/// peak memory until it exits. Call it first in `main`, before any other thread starts.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; the caller runs it before other threads.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, -1);
        libc::mallopt(libc::M_TOP_PAD, 1 << 28);
    }
}

/// Peak resident set size of this process (Linux `VmHWM`), in MB; what the benchmarks report.
pub fn peak_rss_mb() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}
