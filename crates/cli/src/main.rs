//! The `polygw` binary: everything is in the library (`polygw_cli::run`).

/// mimalloc rather than glibc's malloc: per-thread heaps instead of arenas whose locks
/// the proxy's worker threads contend for (issue 27; docs/BENCHMARKS.md, "Issue 27").
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    polygw_cli::run()
}
