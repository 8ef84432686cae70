//! [`RecorderConfig`]: queue size, batching, retry and the bounds on flushing.

use std::time::Duration;

use polygw_core::TelemetryError;

/// How a [`crate::SqlRecorder`] queues and writes. `Default` gives the documented values;
/// change fields with struct update syntax:
///
/// ```
/// use polygw_telemetry_sql::RecorderConfig;
/// let cfg = RecorderConfig { queue_capacity: 50_000, ..RecorderConfig::default() };
/// assert_eq!(cfg.batch_size, 256);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecorderConfig {
    /// Rows the queue holds before the oldest is dropped (default 10 000).
    pub queue_capacity: usize,
    /// Rows per batch; one batch is one transaction (default 256). Batches larger than
    /// the backend's bind-parameter limit are split into several statements of the same
    /// transaction.
    pub batch_size: usize,
    /// The writer wakes at least this often to write a partial batch (default 200 ms);
    /// it wakes at once when a full batch is queued or on `flush`/`shutdown`.
    pub flush_interval: Duration,
    /// First retry delay after a failed write (default 200 ms); doubles per failure.
    pub retry_min: Duration,
    /// Cap of the retry delay (default 10 s).
    pub retry_max: Duration,
    /// At most one warning per this interval while the database fails, and at most one
    /// per interval about dropped rows (default 30 s).
    pub warn_interval: Duration,
    /// Bound on how long `flush()` waits, and on the last write at shutdown/drop
    /// (default 5 s).
    pub flush_timeout: Duration,
    /// Bound on one batch write, connection included (default 10 s); a write that takes
    /// longer counts as a failure and is retried. SQLite's busy timeout is half of it.
    pub write_timeout: Duration,
}

impl Default for RecorderConfig {
    fn default() -> Self {
        RecorderConfig {
            queue_capacity: 10_000,
            batch_size: 256,
            flush_interval: Duration::from_millis(200),
            retry_min: Duration::from_millis(200),
            retry_max: Duration::from_secs(10),
            warn_interval: Duration::from_secs(30),
            flush_timeout: Duration::from_secs(5),
            write_timeout: Duration::from_secs(10),
        }
    }
}

impl RecorderConfig {
    /// Checks the values: sizes ≥ 1, durations > 0, `retry_min ≤ retry_max`.
    pub fn validate(&self) -> Result<(), TelemetryError> {
        let mut errors = Vec::new();
        if self.queue_capacity == 0 {
            errors.push("queue_capacity must be at least 1".to_string());
        }
        if self.batch_size == 0 {
            errors.push("batch_size must be at least 1".to_string());
        }
        for (name, d) in [
            ("flush_interval", self.flush_interval),
            ("retry_min", self.retry_min),
            ("retry_max", self.retry_max),
            ("warn_interval", self.warn_interval),
            ("flush_timeout", self.flush_timeout),
            ("write_timeout", self.write_timeout),
        ] {
            if d.is_zero() {
                errors.push(format!("{name} must be greater than 0"));
            }
        }
        if self.retry_min > self.retry_max {
            errors.push(format!(
                "retry_min ({:?}) must not exceed retry_max ({:?})",
                self.retry_min, self.retry_max
            ));
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(TelemetryError(format!(
                "invalid recorder configuration: {}",
                errors.join("; ")
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_documented_values_and_valid() {
        let c = RecorderConfig::default();
        assert_eq!(c.queue_capacity, 10_000);
        assert_eq!(c.batch_size, 256);
        assert_eq!(c.flush_interval, Duration::from_millis(200));
        assert_eq!(c.warn_interval, Duration::from_secs(30));
        assert_eq!(c.flush_timeout, Duration::from_secs(5));
        assert!(c.validate().is_ok());
    }

    #[test]
    fn every_bad_value_is_named() {
        let c = RecorderConfig {
            queue_capacity: 0,
            batch_size: 0,
            flush_interval: Duration::ZERO,
            retry_min: Duration::from_secs(20),
            retry_max: Duration::from_secs(1),
            ..RecorderConfig::default()
        };
        let e = c.validate().unwrap_err().0;
        for part in [
            "queue_capacity",
            "batch_size",
            "flush_interval",
            "retry_min (20s) must not exceed retry_max (1s)",
        ] {
            assert!(e.contains(part), "{e}");
        }
    }
}
