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

    // The one place the facade reads the wall clock: telemetry `created_at`, and the
    // time part of the ids.
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

/// A new time-ordered unique id (UUID v7: the Unix time in milliseconds, then 74
/// random bits) for calls and attempts. The random bits come from the thread's fast
/// generator, not the operating system: `Uuid::now_v7` asks the kernel (`getrandom`)
/// for every id, two system calls per call (docs/BENCHMARKS.md, "Call overhead").
/// These ids name calls; they guard nothing, so they need uniqueness, not secrecy.
pub(crate) fn new_id() -> String {
    let ms = TokioClock.unix_ms().max(0) as u64;
    let mut random = [0u8; 10];
    fastrand::fill(&mut random);
    uuid::Builder::from_unix_timestamp_millis(ms, &random)
        .into_uuid()
        .simple()
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_unique_uuid_v7_of_now() {
        let ids: std::collections::BTreeSet<String> = (0..10_000).map(|_| new_id()).collect();
        assert_eq!(ids.len(), 10_000);
        let now = TokioClock.unix_ms() as u64;
        for id in ids.iter().take(100) {
            assert_eq!(id.len(), 32, "{id}");
            let u = uuid::Uuid::parse_str(id).unwrap();
            assert_eq!(u.get_version_num(), 7, "{id}");
            let (secs, nanos) = u.get_timestamp().unwrap().to_unix();
            let ms = secs * 1000 + u64::from(nanos) / 1_000_000;
            assert!(now.abs_diff(ms) < 60_000, "{id}: {ms} vs {now}");
        }
    }
}
