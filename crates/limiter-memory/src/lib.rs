//! polygw's in-process governance (SPEC §4.2, §4.4, §10): a [`MemoryLimiter`]
//! (`RateLimiter`), a [`MemoryBreakerStore`] (`BreakerStore`) and a [`MemoryCache`]
//! (`ResponseCache`), for one process.
//!
//! The limiter runs core's reference model [`polygw_core::window::WindowLimiter`] under a
//! mutex and the breaker store runs [`polygw_core::breaker::BreakerState`] as is, so their
//! semantics are the specification's by construction; the Redis backend mirrors the same
//! models in Lua and both run one contract suite (`polygw-testkit`). Time comes from the
//! injected [`polygw_core::ports::Clock`] as milliseconds since the component was created,
//! so a `ManualClock` (or a paused tokio clock) drives every window without real waiting.

mod breaker;
mod cache;
mod limiter;

pub use breaker::MemoryBreakerStore;
pub use cache::MemoryCache;
pub use limiter::MemoryLimiter;

use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use polygw_core::ports::Clock;

/// Milliseconds elapsed on `clock` since `base` (0 if the clock reads earlier).
fn elapsed_ms(clock: &dyn Clock, base: Instant) -> u64 {
    u64::try_from(clock.now().saturating_duration_since(base).as_millis()).unwrap_or(u64::MAX)
}

/// Locks a mutex, recovering from poisoning: every critical section here leaves the
/// state consistent before it can panic, so a poisoned lock still guards valid data.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
