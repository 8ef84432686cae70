//! The `TelemetryRecorder` port (SPEC §8). `record` is synchronous and never blocks:
//! rows go to a bounded queue (so `Drop` guards can record cancelled attempts).

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::error::TelemetryError;
use crate::telemetry::TelemetryRow;

/// What a flush achieved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct FlushReport {
    /// Rows written since the recorder started.
    pub written: u64,
    /// Rows dropped (queue overflow) since the recorder started.
    pub dropped: u64,
    /// Rows still queued after the flush (backend down).
    pub pending: u64,
}

/// Records telemetry rows.
#[cfg_attr(any(test, feature = "mock"), mockall::automock)]
#[async_trait]
pub trait TelemetryRecorder: Send + Sync + std::fmt::Debug {
    /// Queues a row; never blocks, never fails the caller.
    fn record(&self, row: TelemetryRow);

    /// Whether recorded rows are kept at all. `false` (telemetry off) lets the engine
    /// skip what only a row would hold, such as the call's trace as JSON (issue 27).
    fn keeps_rows(&self) -> bool {
        true
    }

    /// Rows dropped so far because the queue overflowed.
    fn dropped(&self) -> u64;

    /// Writes what is queued (bounded wait) and reports.
    async fn flush(&self) -> Result<FlushReport, TelemetryError>;

    /// Whether rows can be written now (readiness, SPEC §21.2): a cheap check of the
    /// database, bounded in time, that writes nothing. Errors name the database with
    /// its password redacted. Telemetry off (or kept in memory) is always writable: the
    /// default is `Ok`.
    async fn check_writable(&self) -> Result<(), TelemetryError> {
        Ok(())
    }
}

/// Telemetry off.
#[derive(Debug, Clone, Copy, Default)]
pub struct NullRecorder;

#[async_trait]
impl TelemetryRecorder for NullRecorder {
    fn record(&self, _row: TelemetryRow) {}
    fn keeps_rows(&self) -> bool {
        false
    }
    fn dropped(&self) -> u64 {
        0
    }
    async fn flush(&self) -> Result<FlushReport, TelemetryError> {
        Ok(FlushReport::default())
    }
}
