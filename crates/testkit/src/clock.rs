//! A [`Clock`] on tokio's clock, so tests under `start_paused` see consistent time.

use std::time::Instant;

use polygw_core::ports::Clock;

/// Monotonic time from `tokio::time::Instant` (pausable), wall time from the system.
#[derive(Debug, Clone, Copy, Default)]
pub struct TokioClock;

impl Clock for TokioClock {
    fn now(&self) -> Instant {
        tokio::time::Instant::now().into_std()
    }

    #[allow(clippy::disallowed_methods)]
    fn unix_ms(&self) -> i64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or(0)
    }
}
