//! The `Clock` port: monotonic time for latency and metering, wall time for `created_at`.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Time, injected. The facade's default reads the tokio clock (so tests with a paused
/// runtime see consistent time); core never reads the system clock itself.
#[cfg_attr(any(test, feature = "mock"), mockall::automock)]
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// Monotonic now.
    fn now(&self) -> Instant;
    /// Wall-clock milliseconds since the Unix epoch (telemetry `created_at`).
    fn unix_ms(&self) -> i64;
}

/// A clock that moves only when told: for tests of pure logic and the memory backend.
#[derive(Debug)]
pub struct ManualClock {
    inner: Mutex<(Instant, i64)>,
}

impl ManualClock {
    /// A clock reading `base` (monotonic) and `unix_ms` (wall).
    pub fn new(base: Instant, unix_ms: i64) -> Self {
        ManualClock {
            inner: Mutex::new((base, unix_ms)),
        }
    }

    /// Moves both readings forward.
    pub fn advance(&self, by: Duration) {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        g.0 += by;
        g.1 += by.as_millis() as i64;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).0
    }
    fn unix_ms(&self) -> i64 {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).1
    }
}
