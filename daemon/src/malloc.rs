//! glibc's allocator, tuned for a long-lived control plane.

/// Tune glibc's allocator for a long-lived control plane; call it before any thread starts.
///
/// glibc gives threads that allocate at once malloc arenas of their own (up to 8 per core)
/// and returns an arena's free memory to the system only from its top, above a threshold
/// that grows with every large block freed. `serve` allocates on the async workers and the
/// blocking pool, so after a burst (1,000 Vms converging) it kept 35 MiB of heap for 10 MiB
/// in use. One arena, and fixed thresholds (blocks of 64 KiB and more mapped on their own,
/// free space above 128 KiB at the top returned), with [`trim`] for the free pages below
/// the top, keep it near what is in use (docs/benchmarks.md, issue 12: idle `serve` with 1,000
/// Vms at 28.6–31.5 MiB). The threads then share one arena lock; the per-thread caches of small
/// blocks (tcache) still avoid it for most calls.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
pub fn tune() {
    // SAFETY: mallopt only sets allocator parameters; it is called before any other thread
    // exists, with parameters and values glibc documents (mallopt(3)).
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 64 * 1024);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 128 * 1024);
    }
}

/// Tune the allocator: nothing to do outside glibc.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn tune() {}

/// Give the free pages inside the heap back to the system (glibc's `malloc_trim`). The trim
/// threshold of [`tune`] returns only free space at the heap's top; what a burst of work
/// frees below live blocks stays resident until this runs (about 3 MiB of an idle `serve` after
/// 1,000 Vms converged, docs/benchmarks.md).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
pub fn trim() {
    // SAFETY: malloc_trim takes the allocator's locks itself and only releases free memory.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Trim the heap: nothing to do outside glibc.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn trim() {}
