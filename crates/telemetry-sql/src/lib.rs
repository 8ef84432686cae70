//! polygw-telemetry-sql: the `llm_calls` table of SPEC §8 in SQLite and PostgreSQL.
//!
//! - [`SqlRecorder`] implements [`polygw_core::ports::telemetry::TelemetryRecorder`]:
//!   `record()` pushes onto a bounded drop-oldest queue and returns; a background task
//!   writes batches (one transaction each, idempotent on `call_id`), retries with backoff
//!   while the database fails, and `flush()`/[`SqlRecorder::shutdown`] report how many
//!   rows were written, dropped and are still pending.
//! - [`read_rows`], [`accounting_gap`] and [`TelemetryReader`] read the table back (for
//!   `polygw report`: also one call's rows, and the client keys' names).
//! - [`SqlResponseStore`] ([`SqlRecorder::response_store`]) implements
//!   [`polygw_core::ports::ResponseStore`]: stored OpenAI Responses (SPEC §18.1) in the
//!   table `polygw_responses` of the same database.
//! - [`migrations`]: the embedded, additive migrations run on connect.
//! - [`queries`]: example queries that run unchanged on both databases.
//!
//! When telemetry is off, use [`polygw_core::ports::telemetry::NullRecorder`].
//! Column types, labels and behaviour: docs/TELEMETRY.md.
//!
//! ```no_run
//! # async fn demo() -> Result<(), polygw_core::TelemetryError> {
//! use polygw_core::ports::telemetry::TelemetryRecorder;
//! use polygw_core::{RowKind, TelemetryRow};
//! use polygw_telemetry_sql::{RecorderConfig, SqlRecorder};
//!
//! let rec = SqlRecorder::connect("sqlite://telemetry.db", RecorderConfig::default()).await?;
//! rec.record(TelemetryRow::new(RowKind::Attempt, "c1", "l1", "LLM", "chat", 0));
//! let report = rec.shutdown().await;
//! assert_eq!(report.written, 1);
//! # Ok(()) }
//! ```

mod config;
mod db;
mod keys;
pub mod migrations;
pub mod queries;
mod reader;
mod recorder;
mod store;
pub mod time;

pub use config::RecorderConfig;
pub use db::{
    Backend, APPLICATION_NAME, COLUMNS, POSTGRES_MAX_BINDS, SQLITE_MAX_BINDS, STORE_PG_CONNECTIONS,
};
pub use keys::SqlKeyStore;
pub use polygw_core::ports::telemetry::{FlushReport, NullRecorder, TelemetryRecorder};
pub use reader::{accounting_gap, read_rows, ClientKeyName, TelemetryReader};
pub use recorder::{RecorderMonitor, SqlRecorder};
pub use store::{SqlResponseStore, PURGE_BATCH};
