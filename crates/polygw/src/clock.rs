//! Production implementations of the `Clock` and `Rng` ports.

use std::sync::{Arc, LazyLock};
use std::time::Instant;

use polygw_core::ports::{Clock, Rng};

/// Monotonic time from tokio's clock (so a paused test runtime sees consistent time;
/// the engine's timers run on the same clock), wall time from the system.
#[derive(Debug, Clone, Copy, Default)]
pub struct TokioClock;

impl Clock for TokioClock {
    fn now(&self) -> Instant {
        tokio::time::Instant::now().into_std()
    }

    // The one place the facade reads the wall clock: telemetry `created_at`.
    #[allow(clippy::disallowed_methods)]
    fn unix_ms(&self) -> i64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or(0)
    }
}

/// The clock of every client built without one: one shared instance, so that the
/// clients of a scope in this process share one memory governance state (SPEC §14.11;
/// the registry tells clocks apart by identity).
pub(crate) fn default_clock() -> Arc<dyn Clock> {
    static CLOCK: LazyLock<Arc<dyn Clock>> = LazyLock::new(|| Arc::new(TokioClock));
    CLOCK.clone()
}

/// A thread-safe generator seeded from the OS (fastrand's entropy seed).
#[derive(Debug)]
pub struct EntropyRng(polygw_core::ports::SplitMix64);

impl EntropyRng {
    /// A generator with a random seed.
    pub fn new() -> Self {
        EntropyRng(polygw_core::ports::SplitMix64::new(fastrand::u64(..)))
    }
}

impl Default for EntropyRng {
    fn default() -> Self {
        Self::new()
    }
}

impl Rng for EntropyRng {
    fn next_u64(&self) -> u64 {
        self.0.next_u64()
    }
}

/// A new time-ordered unique id (UUID v7) for calls and attempts.
pub(crate) fn new_id() -> String {
    uuid::Uuid::now_v7().simple().to_string()
}
