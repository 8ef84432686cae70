//! `cargo bench -p polygw --bench overhead_mimalloc` (part of `cargo xtask bench
//! overhead`): the `overhead` program, unchanged, in a process whose allocator is
//! mimalloc instead of glibc's malloc — what a service that links polygw and picks its
//! allocator gets (the `polygw` binary itself runs on mimalloc). With 64 callers on
//! glibc most of the gap to the bare client is the arenas' lock: memory allocated on one
//! worker thread and freed on another (docs/BENCHMARKS.md, "Issue 27").

#![allow(
    clippy::disallowed_methods,
    reason = "a benchmark measures real elapsed time"
)]

#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[path = "overhead.rs"]
mod overhead;

fn main() {
    println!("allocator: mimalloc (the process's global allocator)");
    overhead::main();
}
