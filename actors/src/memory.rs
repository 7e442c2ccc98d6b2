//! Handing freed heap memory back to the OS. Sessions' saved states are large (MBs each) and freed in bursts (a
//! client closing its forks, an eviction): glibc's allocator raises its mmap threshold after the first such free, so
//! later states come from its arenas, and memory freed there stays in the process until trimmed — closing sessions
//! then returned nothing an operator could see.

/// Returns the allocator's free memory to the OS (glibc: `malloc_trim`, which also releases free pages inside its
/// arenas). A no-op on other C libraries, whose allocators return large frees on their own.
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only reorganizes the allocator's own free lists under its locks; it may run at any time
    // from any thread.
    unsafe {
        libc::malloc_trim(0);
    }
}
