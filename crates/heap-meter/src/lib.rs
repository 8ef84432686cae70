//! A counting global allocator for memory tests: the live heap bytes and their peak,
//! counted only on threads that asked for it (so a mock upstream on its own thread is
//! not counted). A test binary installs it with
//! `#[global_allocator] static A: polygw_heap_meter::Counting = polygw_heap_meter::Counting;`
//! and calls [`track_this_thread`] on the threads that run the code under test.
//!
//! Bytes freed on a tracking thread that another thread allocated count down as well;
//! tests keep the code under test on tracking threads and everything else apart.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicI64, Ordering};

static LIVE: AtomicI64 = AtomicI64::new(0);
static PEAK: AtomicI64 = AtomicI64::new(0);

thread_local! {
    static TRACK: Cell<bool> = const { Cell::new(false) };
}

/// The system allocator, counting on tracking threads.
#[derive(Debug)]
pub struct Counting;

fn tracking() -> bool {
    TRACK.try_with(Cell::get).unwrap_or(false)
}

fn add(n: i64) {
    let now = LIVE.fetch_add(n, Ordering::Relaxed) + n;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call is forwarded to `System` unchanged; the counting touches only
// atomics and a const-initialised thread-local (no allocation inside the allocator).
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's layout.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() && tracking() {
            add(layout.size() as i64);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if tracking() {
            add(-(layout.size() as i64));
        }
        // SAFETY: forwarded with the caller's pointer and layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded with the caller's pointer, layout and size.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() && tracking() {
            add(new_size as i64 - layout.size() as i64);
        }
        p
    }
}

/// Counts this thread's allocations from now on.
pub fn track_this_thread() {
    TRACK.with(|t| t.set(true));
}

/// Live bytes counted so far (allocated minus freed on tracking threads).
pub fn live() -> i64 {
    LIVE.load(Ordering::Relaxed)
}

/// Resets the peak to the live bytes now; returns them.
pub fn reset_peak() -> i64 {
    let now = live();
    PEAK.store(now, Ordering::Relaxed);
    now
}

/// The highest live count since the last [`reset_peak`].
pub fn peak() -> i64 {
    PEAK.load(Ordering::Relaxed)
}
